//! mlb-inspect on synthetic files: snapshots of the reports, and the status of every
//! row of the spec's error table through the binary.

use std::path::Path;

use krafla::format::mlb::header::{layer_flag, q8_class, wtype, Header};
use krafla::format::mli::Mli;
use krafla::format::WType;
use krafla::synth::{synth_file, synth_mixed, tiny_header};

use crate::util::tool::{mlb_inspect, tool};

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn rich_header() -> Header {
    Header {
        wtype: wtype::Q4_0,
        q8_mask: q8_class::TOK_EMB | q8_class::WV,
        qk_norm: 1,
        layer_flags: 1,
        sliding_window: 8,
        rope_local_theta: 10000.0,
        rope_theta: 1_000_000.0,
        shared_classifier: 1,
        act: 1,
        post_norms: 1,
        embed_scale: 8.0,
        ..tiny_header()
    }
}

#[test]
fn report_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tiny.mlb", &synth_file(&tiny_header(), &[], 1));
    let flags = [layer_flag::SLIDING | layer_flag::LOCAL_ROPE, 0];
    write(
        dir.path(),
        "rich.mlb",
        &synth_file(&rich_header(), &flags, 2),
    );
    let mut bf16 = tiny_header();
    bf16.wtype = wtype::BF16;
    write(dir.path(), "bf16.mlb", &synth_file(&bf16, &[], 3));
    let mut mixed = rich_header();
    mixed.wtype = wtype::MIXED;
    mixed.q8_mask = 0;
    mixed.scale_f16 = 1;
    // tok_emb (the shared classifier) Q8_0; layer 0 BF16 but w2 F16; layer 1 Q4_0.
    let types: Vec<WType> = (0..15)
        .map(|i| match i {
            0 => WType::Q8_0,
            6 => WType::F16,
            1..=7 => WType::BF16,
            _ => WType::Q4_0,
        })
        .collect();
    write(
        dir.path(),
        "mixed.mlb",
        &synth_mixed(&mixed, &flags, &types, 4),
    );
    // The 32-weight block types and Q8_0 in one file (the K types need rows of 256).
    let mut blocks = tiny_header();
    blocks.wtype = wtype::MIXED;
    let bt = [
        WType::Q4_1,
        WType::Q5_0,
        WType::Q5_1,
        WType::IQ4_NL,
        WType::Q6_0,
    ];
    let types: Vec<WType> = (0..16)
        .map(|i| if i == 0 { WType::Q8_0 } else { bt[i % 5] })
        .collect();
    write(
        dir.path(),
        "blocks.mlb",
        &synth_mixed(&blocks, &[], &types, 5),
    );
    for (name, args) in [
        ("blocks_text", vec!["blocks.mlb"]),
        ("tiny_text", vec!["tiny.mlb"]),
        ("rich_text", vec!["rich.mlb"]),
        ("rich_tensor", vec!["rich.mlb", "--tensor", "layers.0.wq"]),
        ("bf16_text", vec!["bf16.mlb"]),
        ("bf16_tensor", vec!["bf16.mlb", "--tensor", "layers.1.w3"]),
        ("mixed_text", vec!["mixed.mlb"]),
    ] {
        let o = mlb_inspect(dir.path(), &args).ok();
        insta::assert_snapshot!(name, o.stdout);
    }
    let o = mlb_inspect(dir.path(), &["rich.mlb", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    insta::assert_json_snapshot!("rich_json", v);
    // Every header field is a plain number under its spec name.
    let hdr = v["header"].as_object().unwrap();
    assert_eq!(hdr["magic"], "MLB1");
    for f in krafla::format::mlb::FIELDS {
        assert!(hdr[f.name].is_number(), "{}", f.name);
    }
    assert_eq!(hdr["norm_eps"].as_f64(), Some(1e-5));
    assert_eq!(hdr["q8_mask"].as_u64(), Some(9));

    let o = mlb_inspect(dir.path(), &["mixed.mlb", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    insta::assert_json_snapshot!("mixed_json", v);
    // The mix: matrices, weights and bytes per type; bits per weight over all matrices.
    let types = v["totals"]["types"].as_array().unwrap();
    let names: Vec<&str> = types.iter().map(|t| t["type"].as_str().unwrap()).collect();
    assert_eq!(names, ["Q8_0", "Q4_0", "BF16", "F16"]);
    let count: u64 = types.iter().map(|t| t["matrices"].as_u64().unwrap()).sum();
    assert_eq!(count, 15);
    let bytes: u64 = types.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    let mats: u64 = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["type"] != "F32" && t["type"] != "U8")
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(bytes, mats);
    let bf = types.iter().find(|t| t["type"] == "BF16").unwrap();
    assert_eq!(bf["bits_per_weight"].as_f64(), Some(16.0));
    // --tensor on a BF16 matrix: the widened values, in JSON too.
    let o = mlb_inspect(dir.path(), &["bf16.mlb", "--tensor", "tok_emb", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["count"], 96 * 64);
    assert!(v["zero_blocks"].is_null());
    assert!(v["max"].as_f64().unwrap() <= 1.0 && v["min"].as_f64().unwrap() >= -1.0);
}

#[test]
fn mli_report() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Mli::new(2, 32, 64, 32);
    for (i, s) in m.sums.iter_mut().enumerate() {
        *s = (i % 7) as f64;
    }
    m.tokens = 4;
    m.cls_tokens = 3;
    write(dir.path(), "a.mli", &m.to_bytes());
    let o = mlb_inspect(dir.path(), &["a.mli"]).ok();
    insta::assert_snapshot!("mli_text", o.stdout);
    let o = mlb_inspect(dir.path(), &["a.mli", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["header"]["tokens"], 4);
    assert_eq!(v["layers"].as_array().unwrap().len(), 2);
}

#[test]
fn mli_covariance_report() {
    use krafla::format::mli::cov::{write as write_cov, CovData, CovSlot};
    use krafla::format::mli::Slot;
    let dir = tempfile::tempdir().unwrap();
    let mut m = Mli::new(2, 32, 64, 32);
    m.tokens = 4;
    m.cls_tokens = 4;
    // H of 4 rows: channel c of row r is (r + 1)·(c % 3 + 1) (perfectly correlated).
    let h = |n: usize| -> Vec<f64> {
        let mut t = Vec::new();
        for i in 0..n {
            for j in i..n {
                let s: f64 = (1..=4).map(|r| (r * r) as f64).sum();
                t.push(s * ((i % 3 + 1) * (j % 3 + 1)) as f64);
            }
        }
        t
    };
    let (h32, h64) = (h(32), h(64));
    let data = [
        CovData {
            layer: Some(0),
            slot: CovSlot::Layer(Slot::Attn),
            expert: None,
            tokens: 4,
            n: 32,
            tri: &h32,
        },
        CovData {
            layer: Some(1),
            slot: CovSlot::Layer(Slot::W2),
            expert: None,
            tokens: 4,
            n: 64,
            tri: &h64,
        },
        CovData {
            layer: None,
            slot: CovSlot::Cls,
            expert: None,
            tokens: 4,
            n: 32,
            tri: &h32,
        },
    ];
    write(dir.path(), "c.mli", &write_cov(m.to_bytes(), &data));
    let o = mlb_inspect(dir.path(), &["c.mli"]).ok();
    insta::assert_snapshot!("mli_covariance_text", o.stdout);
    let o = mlb_inspect(dir.path(), &["c.mli", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["header"]["version"], 65537);
    assert_eq!(v["covariance"]["entries"].as_array().unwrap().len(), 3);
    assert_eq!(v["covariance"]["entries"][1]["n"], 64);
}

/// A mixture-of-experts imatrix's covariances: the routed experts' ew2 inputs of a
/// layer make one line (their count, the least and most rows), the shared expert's sw2
/// input its own; the JSON lists every entry with its expert.
#[test]
fn mli_expert_covariance_report() {
    use krafla::format::mli::cov::{write as write_cov, CovData, CovSlot};
    use krafla::format::mli::{MoeSums, Slot};
    let dir = tempfile::tempdir().unwrap();
    let mut m = Mli::new(2, 32, 64, 32).with_moe(MoeSums::new(vec![1], 4, 32, 16, 8));
    m.tokens = 6;
    // Diagonal H: channel c's square sum c + 1.
    let diag = |n: usize| -> Vec<f64> {
        let mut t = Vec::new();
        for i in 0..n {
            t.extend((i..n).map(|j| if i == j { (i + 1) as f64 } else { 0.0 }));
        }
        t
    };
    let (d16, d8) = (diag(16), diag(8));
    let data: Vec<CovData> = [(Some(0), 3, &d16), (Some(2), 5, &d16), (None, 6, &d8)]
        .into_iter()
        .map(|(expert, tokens, tri)| CovData {
            layer: Some(1),
            slot: CovSlot::Layer(Slot::W2),
            expert,
            tokens,
            n: if expert.is_some() { 16 } else { 8 },
            tri,
        })
        .collect();
    write(dir.path(), "e.mli", &write_cov(m.to_bytes(), &data));
    let o = mlb_inspect(dir.path(), &["e.mli"]).ok();
    let cov = &o.stdout[o.stdout.find("covariance section").unwrap()..];
    insta::assert_snapshot!("mli_expert_covariance_text", cov);
    let o = mlb_inspect(dir.path(), &["e.mli", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["header"]["version"], 65538);
    let e = v["covariance"]["entries"].as_array().unwrap();
    let experts: Vec<_> = e.iter().map(|x| x["expert"].clone()).collect();
    assert_eq!(
        experts,
        [
            serde_json::json!(0),
            serde_json::json!(2),
            serde_json::Value::Null
        ]
    );
}

/// Runs mlb-inspect on `bytes`, which it must refuse cleanly: its stderr.
fn inspect_refusal(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "x.mlb", bytes);
    mlb_inspect(dir.path(), &["x.mlb"]).fails()
}

/// One change to a valid header.
type HeaderEdit = fn(&mut Header);

fn with_header(edit: impl FnOnce(&mut Header)) -> Vec<u8> {
    let h = tiny_header();
    let mut b = synth_file(&h, &[], 3);
    let mut e = h;
    edit(&mut e);
    b[..256].copy_from_slice(&e.encode());
    b
}

/// A mixed file whose type-table entry for layers.0.wv is 23 (reserved).
fn bad_table_entry() -> Vec<u8> {
    let mut h = tiny_header();
    h.wtype = wtype::MIXED;
    let mut b = synth_mixed(&h, &[], &[WType::BF16; 16], 8);
    b[256 + 3] = 23;
    b
}

#[test]
fn error_table_through_the_binary() {
    let good = synth_file(&tiny_header(), &[], 3);
    let mut minus128 = good.clone();
    let p = krafla::format::mlb::parse(&good).unwrap();
    minus128[p.layout.find("layers.0.wk").unwrap().offset as usize] = 0x80;
    const FORMAT: &str = "ML_E_FORMAT";
    const SHAPE: &str = "ML_E_SHAPE";
    // One edit of a valid header each, with the status of its row of the error table.
    let header_rows: [(&str, HeaderEdit, &str); 31] = [
        ("bad magic", |h| h.magic = *b"MLBX", FORMAT),
        ("bad version", |h| h.version = 9, FORMAT),
        ("unknown wtype", |h| h.wtype = 23, FORMAT),
        ("wtype above the known ones", |h| h.wtype = 129, FORMAT),
        ("unknown rope_type", |h| h.rope_type = 9, FORMAT),
        ("bad llama3", |h| h.rope_type = 1, FORMAT),
        ("bad linear", |h| h.rope_type = 2, FORMAT),
        ("bad yarn", |h| h.rope_type = 3, FORMAT),
        ("attn_factor no yarn", |h| h.rope_attn_factor = 1.0, FORMAT),
        ("qkv_bias 2", |h| h.qkv_bias = 2, FORMAT),
        ("qk_norm 2", |h| h.qk_norm = 2, FORMAT),
        ("layer_flags 2", |h| h.layer_flags = 2, FORMAT),
        ("post_norms 2", |h| h.post_norms = 2, FORMAT),
        ("scale_f16 2", |h| h.scale_f16 = 2, FORMAT),
        ("unknown act", |h| h.act = 3, FORMAT),
        ("negative embed_scale", |h| h.embed_scale = -1.0, FORMAT),
        ("nan attn_scale", |h| h.attn_scale = f32::NAN, FORMAT),
        ("inf softcap", |h| h.attn_softcap = f32::INFINITY, FORMAT),
        ("negative final_softcap", |h| h.final_softcap = -2.0, FORMAT),
        ("local theta < 0", |h| h.rope_local_theta = -5.0, FORMAT),
        ("huge window", |h| h.sliding_window = u32::MAX, FORMAT),
        ("zero dim", |h| h.dim = 0, SHAPE),
        ("over-limit n_layers", |h| h.n_layers = 70000, SHAPE),
        ("dim not multiple of 32", |h| h.dim = 40, SHAPE),
        ("hidden_dim % 32", |h| h.hidden_dim = 130, SHAPE),
        (
            "dim % n_heads",
            |h| (h.n_heads, h.n_kv_heads) = (6, 2),
            SHAPE,
        ),
        ("n_heads % n_kv_heads", |h| h.n_kv_heads = 3, SHAPE),
        ("odd head_dim", |h| h.head_dim = 9, SHAPE),
        ("q_dim not multiple of 32", |h| h.head_dim = 20, SHAPE),
        ("q_dim above 65536", |h| h.head_dim = 65536, SHAPE),
        ("vocab < 3", |h| h.vocab = 2, SHAPE),
    ];
    let mut rows: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty file", vec![], FORMAT),
        ("short file", good[..100].to_vec(), FORMAT),
        ("bad type table entry", bad_table_entry(), FORMAT),
        (
            "truncated arrays",
            good[..good.len() - 4096].to_vec(),
            FORMAT,
        ),
        ("q8 quant -128", minus128, FORMAT),
    ];
    rows.extend(
        header_rows
            .into_iter()
            .map(|(what, edit, status)| (what, with_header(edit), status)),
    );
    for (what, bytes, status) in rows {
        let err = inspect_refusal(&bytes);
        assert!(
            err.contains(status),
            "{what}: expected {status}, got: {err}"
        );
        assert!(
            err.contains("x.mlb"),
            "{what}: error does not name the file: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{what}: one line: {err}");
    }
    // Layer-flag rows.
    let mut h = tiny_header();
    h.layer_flags = 1;
    h.rope_local_theta = 1e4;
    for (flags, what) in [
        ([32u8, 0], "unknown bits"),
        ([6, 0], "local RoPE and no RoPE"),
        ([2, 0], "local RoPE without base"),
    ] {
        let mut b = synth_file(&h, &[0, 0], 4);
        b[256..258].copy_from_slice(&flags);
        if what == "local RoPE without base" {
            let mut e = h;
            e.rope_local_theta = 0.0;
            b[..256].copy_from_slice(&e.encode());
        }
        let err = inspect_refusal(&b);
        assert!(err.contains("ML_E_FORMAT"), "{what}: {err}");
    }
    // ML_E_IO: a file that cannot be opened.
    let dir = tempfile::tempdir().unwrap();
    let e = mlb_inspect(dir.path(), &["missing.mlb"]).fails();
    assert!(e.contains("ML_E_IO"), "{e}");
}

#[test]
fn mlt_report_encode_decode() {
    let dir = tempfile::tempdir().unwrap();
    let src = crate::util::testdata().join("default/tokenizer.json");
    tool("mlt-convert")
        .current_dir(dir.path())
        .args([src.to_str().unwrap(), "-o", "t.mlt"])
        .ok();
    let o = mlb_inspect(dir.path(), &["t.mlt"]).ok();
    insta::assert_snapshot!("mlt_text", o.stdout);
    let o = mlb_inspect(dir.path(), &["t.mlt", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["file"], "t.mlt");
    let d = dir.path();
    let text = "The built-in functions, 1234 of them.";
    let ids = mlb_inspect(d, &["t.mlt", "--encode"])
        .stdin(text)
        .ok()
        .stdout;
    assert_eq!(ids.lines().count(), 1);
    let parsed: Vec<u32> = serde_json::from_str(ids.trim()).unwrap();
    assert_eq!(parsed[0], 1, "BOS first");
    // Decoding without the BOS gives the text back.
    let rest = serde_json::to_string(&parsed[1..]).unwrap();
    let o = mlb_inspect(d, &["t.mlt", "--decode"]).stdin(rest).ok();
    assert_eq!(o.stdout, text);
    // Out-of-range ids are refused with a status.
    let e = mlb_inspect(d, &["t.mlt", "--decode"])
        .stdin("[999999]")
        .fails();
    assert!(e.contains("ML_E_SHAPE"), "{e}");
    // --encode on a model file is refused.
    std::fs::write(dir.path().join("m.mlb"), synth_file(&tiny_header(), &[], 5)).unwrap();
    mlb_inspect(dir.path(), &["m.mlb", "--encode"]).fails();
}

/// A non-zero byte in the header padding (offsets 160–255) is not in the spec's error
/// table, so the file loads; mlb-inspect names the byte as a warning, in both reports.
#[test]
fn nonzero_header_padding_loads_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = synth_file(&tiny_header(), &[], 6);
    write(dir.path(), "clean.mlb", &b);
    b[200] = 0x5a;
    write(dir.path(), "pad.mlb", &b);
    assert!(krafla::format::mlb::Mlb::from_bytes(&b).is_ok());
    let o = mlb_inspect(dir.path(), &["pad.mlb"]).ok();
    let text = o.stdout;
    assert!(
        text.contains("header padding at offset 200 = 0x5a"),
        "{text}"
    );
    assert!(text.contains("verdict: valid, 1 warning(s)"), "{text}");
    let o = mlb_inspect(dir.path(), &["pad.mlb", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["warnings"].as_array().unwrap().len(), 1, "{v}");
    let o = mlb_inspect(dir.path(), &["clean.mlb", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["warnings"], serde_json::json!([]));
}

/// A mixture of experts as mlb-inspect shows it: the header's MoE fields (experts,
/// routing, biases, SwiGLU, sinks), each layer's flags, the stacked experts and the F32
/// routers (gpt-oss's fixture, converted to BF16 with a Q8_0 embedding: a mixed file).
#[test]
fn moe_report_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    crate::util::fixtures::convert(
        &crate::util::testdata().join("models/gpt_oss"),
        &dir.path().join("gpt_oss.mlb"),
        &["--wtype", "bf16", "--types", "tok_emb=q8_0,experts=q8_0"],
    );
    let o = mlb_inspect(dir.path(), &["gpt_oss.mlb"]).ok();
    insta::assert_snapshot!("moe_text", o.stdout);
}
