//! GGUF in and out, against the fixtures llama.cpp's own converter made
//! (`testdata/make_gguf_fixtures.py`, `testdata/gguf/`):
//!
//! - float GGUFs (the checkpoint's own bf16/f16 values) with `--requantize` give the
//!   same bytes as `mlb-convert` on the Hugging Face checkpoint, up to what llama.cpp's
//!   GGUF itself changes (listed in `llama_cpp_view`);
//! - Q4_0 GGUFs (gguf-py's Q4_0, llama.cpp's round rule) are copied block for block and
//!   give the bytes of `--wtype q4_0 --q4-rule round --f16-scales --q8 none`;
//! - Q8_0 GGUFs are copied block for block: the same bytes as requantizing their own
//!   dequantized values, and logits within the fixtures' bounds of transformers';
//! - the refusals, one per kind.

use std::path::{Path, PathBuf};

use krafla::format::gguf::{self, GgmlType, GgufWriter, MetaValue, TensorSpec};
use krafla::format::mlb::{self, Header, HEADER_SIZE};

use crate::util::fixtures::byte_mlt;
use crate::util::fixtures::{convert, converted, f32s, read_f32, reference, requantize_args};
use crate::util::tool::{mlb_convert, mlb_export, tool};
use crate::util::{first_diff, testdata};

fn gguf_dir() -> PathBuf {
    testdata().join("gguf")
}

/// The float GGUF fixtures: (fixture, file).
const FLOAT: &[(&str, &str)] = &[
    ("llama", "llama.bf16.gguf"),
    ("llama_tied", "llama_tied.f16.gguf"),
    ("llama_rope_llama3", "llama_rope_llama3.bf16.gguf"),
    ("llama_rope_yarn", "llama_rope_yarn.bf16.gguf"),
    ("mistral_sliding", "mistral_sliding.bf16.gguf"),
    ("qwen2", "qwen2.f16.gguf"),
    ("qwen3", "qwen3.bf16.gguf"),
    ("gemma2", "gemma2.bf16.gguf"),
    ("gemma3_text", "gemma3_text.bf16.gguf"),
    ("smollm3", "smollm3.f16.gguf"),
    ("qwen3_5_text", "qwen3_5_text.bf16.gguf"),
    ("olmoe", "olmoe.bf16.gguf"),
    ("qwen3_5_moe_text", "qwen3_5_moe_text.bf16.gguf"),
    ("gpt_oss", "gpt_oss.bf16.gguf"),
];

const QUANT: &[&str] = &["llama", "qwen3", "gemma3_text", "olmoe"];

/// Notes in `failures` where `got` first differs from `want`, after `what`.
fn note_diff(failures: &mut Vec<String>, what: String, got: &[u8], want: &[u8]) {
    if let Some(d) = describe_diff(got, want) {
        failures.push(format!("{what}: {d}"));
    }
}

/// The first differing byte, named by the tensor it falls in.
fn describe_diff(a: &[u8], b: &[u8]) -> Option<String> {
    let at = first_diff(a, b)?;
    let what = if at < HEADER_SIZE {
        let f = mlb::FIELDS
            .iter()
            .find(|f| f.offset <= at && at < f.offset + 4)
            .map_or("padding", |f| f.name);
        format!("header field {f}")
    } else {
        match mlb::parse(a) {
            Ok(p) => p
                .layout
                .tensors
                .iter()
                .find(|t| (t.offset as usize) <= at && at < t.end().next_multiple_of(64) as usize)
                .map_or("?".to_string(), |t| t.name.to_string()),
            Err(e) => format!("(unparsable: {e})"),
        }
    };
    Some(format!(
        "sizes {} and {}, first difference at byte {at} ({what})",
        a.len(),
        b.len()
    ))
}

fn header_of(b: &[u8]) -> Header {
    Header::decode(b[..HEADER_SIZE].try_into().unwrap())
}

/// The spec's llama3 frequency divisors of a header (f64), per pair.
fn llama3_divisors(h: &Header, head_dim: usize) -> Vec<f64> {
    let (f, lo, hi, orig) = (
        h.rope_factor as f64,
        h.rope_low_freq_factor as f64,
        h.rope_high_freq_factor as f64,
        h.rope_orig_max_seq as f64,
    );
    (0..head_dim / 2)
        .map(|i| {
            let inv = (h.rope_theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
            let wl = 2.0 * std::f64::consts::PI / inv;
            if wl < orig / hi {
                1.0
            } else if wl > orig / lo {
                f
            } else {
                let s = (orig / wl - lo) / (hi - lo);
                1.0 / ((1.0 - s) / f + s)
            }
        })
        .collect()
}

/// The `.mlb` of a Hugging Face fixture as llama.cpp's GGUF of it means it: what
/// convert_hf_to_gguf.py does not store, or llama.cpp decides by its own rules.
/// `gguf_mlb` supplies the Llama 3 RoPE parameters (equivalent ones are recovered
/// from llama.cpp's per-frequency factors; checked here to give the same divisors).
fn llama_cpp_view(name: &str, mut hf: Vec<u8>, gguf_mlb: &[u8]) -> Vec<u8> {
    let mut h = header_of(&hf);
    let g = header_of(gguf_mlb);
    let set_flags = |hf: &mut Vec<u8>, from: &[u8], to: &[u8]| {
        assert_eq!(
            &hf[HEADER_SIZE..HEADER_SIZE + from.len()],
            from,
            "{name}: HF flags"
        );
        hf[HEADER_SIZE..HEADER_SIZE + to.len()].copy_from_slice(to);
    };
    match name {
        // llama.cpp's converter writes OLMoE's RMSNorm epsilon as 1e-5 whatever the
        // config says (conversion/olmo*.py: add_layer_norm_rms_eps(1e-5)).
        "olmoe" => h.norm_eps = g.norm_eps,
        // query_pre_attn_scalar is not in the GGUF: llama.cpp uses 1/sqrt(head_dim).
        "gemma2" | "gemma3_text" => {
            assert_ne!(
                h.attn_scale, 0.25,
                "{name}: the fixture tests a different scale"
            );
            h.attn_scale = 0.25;
        }
        // llama.cpp's gpt-oss clamps its SwiGLU at 7 (constants of its graph: the
        // fixture's limit 1 is not in the GGUF) and rounds yarn's correction range
        // (the checkpoint's `truncate: false` is not in the GGUF either).
        "gpt_oss" => {
            assert_eq!((h.swiglu_limit, h.rope_type), (1.0, 4), "{name}");
            h.swiglu_limit = 7.0;
            h.rope_type = 3;
        }
        // llama.cpp's llama architecture has no sliding window.
        "mistral_sliding" => {
            assert_eq!(h.sliding_window, 8);
            h.sliding_window = 0;
        }
        "llama_rope_llama3" => {
            let (a, b) = (llama3_divisors(&h, 16), llama3_divisors(&g, 16));
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5 * x, "{name}: divisors {a:?} vs {b:?}");
            }
            h.rope_low_freq_factor = g.rope_low_freq_factor;
            h.rope_high_freq_factor = g.rope_high_freq_factor;
            h.rope_orig_max_seq = g.rope_orig_max_seq;
        }
        _ => {}
    }
    match name {
        // The converter writes no sliding-window pattern: llama.cpp's default of 6
        // makes every one of the four layers a sliding one (HF: S S F S).
        "gemma3_text" => set_flags(&mut hf, &[3, 3, 0, 3], &[3, 3, 3, 3]),
        // llama.cpp's SmolLM3 drops RoPE on every fourth layer (the fixture: layer 2).
        "smollm3" => {
            set_flags(&mut hf, &[0, 0, 4, 0], &[0, 0, 0, 4]);
            // A no-RoPE layer keeps the checkpoint's q/k row order; a RoPE layer has
            // the spec's interleaved order. Layer 2 gains RoPE, layer 3 loses it.
            move_qk_rows(&mut hf, 2, true);
            move_qk_rows(&mut hf, 3, false);
        }
        _ => {}
    }
    hf[..HEADER_SIZE].copy_from_slice(&h.encode());
    hf
}

/// Reorders the q/k rows (whole quantized rows with their scales) of one layer of an
/// .mlb: to the spec's interleaved RoPE order (`to_rope`) or back to the checkpoint's.
fn move_qk_rows(bytes: &mut [u8], layer: u32, to_rope: bool) {
    use krafla::convert::pipeline::permute::{rope_dst, rope_src};
    use krafla::format::mlb::layout::Kind;
    let m = mlb::Mlb::from_bytes(bytes).unwrap();
    let (hd, rot) = (m.dims().head_dim, m.dims().rot_dim);
    let mut moves = Vec::new();
    for t in &m.layout().tensors {
        if t.name.layer != Some(layer) || !matches!(t.name.name, "wq" | "wk" | "bq" | "bk") {
            continue;
        }
        let (rows, arrays) = match t.kind {
            Kind::Mat {
                rows,
                d_offset,
                d_bytes,
                ..
            } => (rows, vec![(t.offset, t.bytes), (d_offset, d_bytes)]),
            Kind::F32 { len } => (len, vec![(t.offset, t.bytes)]),
            Kind::U8 { .. } => continue,
        };
        moves.push((rows, arrays));
    }
    assert!(!moves.is_empty(), "layer {layer} has no q/k arrays");
    drop(m);
    for (rows, arrays) in moves {
        for (off, len) in arrays {
            let (off, len) = (off as usize, len as usize);
            let rb = len / rows;
            let old = bytes[off..off + len].to_vec();
            for r in 0..rows {
                let (h, d) = (r / hd, r % hd);
                let from = h * hd
                    + if to_rope {
                        rope_src(d, rot)
                    } else {
                        rope_dst(d, rot)
                    };
                bytes[off + r * rb..off + (r + 1) * rb]
                    .copy_from_slice(&old[from * rb..(from + 1) * rb]);
            }
        }
    }
}

/// Float GGUFs requantized give the checkpoint's conversion: `--requantize T` its
/// `--wtype T` (the 256-weight types on the fixtures' rows falling back as they do
/// there, Q6_K to Q6_0, or Q8_0 with `--gguf-types`), and `--types` its `--types` over
/// the GGUF's own float type (the other matrices copied).
#[test]
fn gguf_float_requantized_equals_hf_conversion() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let types = "w2=q6_k,wqk=q4_0,experts=iq3_s";
    for (name, file) in FLOAT {
        let dir = testdata().join("models").join(name);
        let float = if file.contains(".f16.") {
            "f16"
        } else {
            "bf16"
        };
        for (q, (gguf_args, hf_args)) in [
            ("q8_0", requantize_args("q8_0", &[])),
            ("q4_0", requantize_args("q4_0", &[])),
            ("iq3_s", requantize_args("iq3_s", &[])),
            ("q6_k", requantize_args("q6_k", &[])),
            ("q6_k-gguf", requantize_args("q6_k", &["--gguf-types"])),
            (
                "types",
                (
                    vec!["--types", types],
                    vec!["--wtype", float, "--types", types],
                ),
            ),
        ] {
            let a = tmp.path().join(format!("{name}.{q}.gguf.mlb"));
            let b = tmp.path().join(format!("{name}.{q}.hf.mlb"));
            let got = converted(&gguf_dir().join(file), &a, &gguf_args);
            let want = llama_cpp_view(name, converted(&dir, &b, &hf_args), &got);
            note_diff(&mut failures, format!("{name} {q}"), &got, &want);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The bytes of the array named `name` in an .mlb (a matrix's scales after its quants),
/// and a matrix's type.
fn array(bytes: &[u8], name: &str) -> (Vec<u8>, Option<krafla::format::WType>) {
    use krafla::format::mlb::layout::Kind;
    let m = mlb::parse(bytes).unwrap();
    let t = m.layout.find(name).unwrap();
    let mut out = bytes[t.offset as usize..(t.offset + t.bytes) as usize].to_vec();
    let Kind::Mat {
        wtype,
        d_offset,
        d_bytes,
        ..
    } = t.kind
    else {
        return (out, None);
    };
    out.extend_from_slice(&bytes[d_offset as usize..(d_offset + d_bytes) as usize]);
    (out, Some(wtype))
}

/// `--types` on a quantized GGUF: the matrices it names are dequantized and quantized
/// to their type, every other array keeps the bytes of a plain import (blocks copied),
/// the router stays F32; a rule naming a tensor's own type copies it.
#[test]
fn gguf_types_requantize_exactly_the_named_classes() {
    use krafla::format::mlb::layout::Kind;
    use krafla::format::WType;
    let src = gguf_dir().join("olmoe.q8_0.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let plain = converted(&src, &tmp.path().join("plain.mlb"), &[]);
    let out = tmp.path().join("types.mlb");
    let log = convert(&src, &out, &["--types", "experts=q4_0,wo=q6_k"]).stderr;
    let got = std::fs::read(&out).unwrap();
    // The rows (64 wide) are not whole super-blocks: Q6_K falls back to Q6_0.
    assert!(
        log.contains("as --types asks")
            && log.contains("blk.0.ffn_gate_exps.weight (Q8_0 to Q4_0)")
            && log.contains("Q6_K needs rows of whole 256-weight super-blocks")
            && log.contains("stored as Q6_0"),
        "{log}"
    );
    assert!(!log.contains("cannot store"), "{log}");
    let (pm, gm) = (mlb::parse(&plain).unwrap(), mlb::parse(&got).unwrap());
    // Every array of the plain import, and one more: the mixed file's type table.
    assert_eq!(pm.layout.tensors.len() + 1, gm.layout.tensors.len());
    let mut requantized = 0;
    for p in &pm.layout.tensors {
        let name = p.name.to_string();
        let g = gm.layout.find(&name).unwrap();
        let want = match (g.name.name, p.kind) {
            ("ew1" | "ew2" | "ew3", Kind::Mat { .. }) => Some(WType::Q4_0),
            ("wo", Kind::Mat { .. }) => Some(WType::Q6_0),
            _ => None,
        };
        match (want, p.kind, g.kind) {
            (Some(w), Kind::Mat { wtype: pw, .. }, Kind::Mat { wtype: gw, .. }) => {
                assert_eq!((pw, gw), (WType::Q8_0, w), "{name}");
                requantized += 1;
            }
            (Some(_), _, _) => panic!("{name}: not a matrix"),
            (None, _, _) => {
                let (a, b) = (array(&plain, &name), array(&got, &name));
                assert_eq!(a.1, b.1, "{name}");
                assert!(a.0 == b.0, "{name}: bytes differ");
            }
        }
    }
    // Every layer's three expert matrices and wo.
    let layers = header_of(&plain).n_layers as usize;
    assert_eq!(requantized, 4 * layers);
    let router = gm.layout.find("layers.0.router").unwrap();
    assert!(matches!(router.kind, Kind::F32 { .. }), "{:?}", router.kind);

    // A rule naming the tensors' own type: copied, the same bytes as a plain import.
    let same = converted(
        &src,
        &tmp.path().join("same.mlb"),
        &["--types", "experts=q8_0"],
    );
    assert_eq!(describe_diff(&same, &plain), None);
    // A rule for a tensor the model lacks, by the flag.
    let e = mlb_convert(&src, &tmp.path().join("x.mlb"))
        .args(["--types", "layers.9.w2=q4_0"])
        .fails();
    assert!(e.contains("--types") && e.contains("layers.9.w2"), "{e}");
}

/// `--requantize` to a 256-weight type on rows that are not whole super-blocks falls
/// back as a checkpoint's `--wtype` does, with its note (the bytes: the test above).
#[test]
fn gguf_requantize_falls_back_on_short_rows() {
    use krafla::format::WType;
    let src = gguf_dir().join("llama.bf16.gguf");
    let tmp = tempfile::tempdir().unwrap();
    for (args, from, to) in [
        (&["--requantize", "iq3_s"][..], "IQ3_S", WType::IQ4_NL),
        (&["--requantize", "q2_k"][..], "Q2_K", WType::IQ4_NL),
        (&["--requantize", "q5_k"][..], "Q5_K", WType::Q5_0),
        (&["--requantize", "q6_k"][..], "Q6_K", WType::Q6_0),
        (
            &["--requantize", "q6_k", "--gguf-types"][..],
            "Q6_K",
            WType::Q8_0,
        ),
    ] {
        let out = tmp.path().join("f.mlb");
        let log = convert(&src, &out, args).stderr;
        let note = format!("{from} needs rows of whole 256-weight super-blocks");
        assert!(
            log.contains(&note) && log.contains(&format!("stored as {to}")),
            "{args:?}: {log}"
        );
        let types = matrix_types(&std::fs::read(&out).unwrap());
        assert!(types.iter().all(|(_, t)| *t == to), "{args:?}: {types:?}");
    }
}

/// Flags that choose a checkpoint's types are refused on a GGUF by name.
#[test]
fn gguf_refuses_checkpoint_type_flags() {
    let src = gguf_dir().join("llama.q8_0.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.mlb");
    for (args, words) in [
        (
            &["--wtype", "q4_0"][..],
            &["--wtype", "--types", "--requantize"][..],
        ),
        (
            &["--target-bpw", "4.5"][..],
            &["--target-bpw", "--preset"][..],
        ),
        (
            &["--preset", "q4_k_m"][..],
            &["--target-bpw", "--preset"][..],
        ),
        (
            &["--types", "w2=q6_0", "--gguf-types"][..],
            &["--gguf-types", "Q6_0"][..],
        ),
    ] {
        let e = mlb_convert(&src, &out).args(args).fails();
        assert_eq!(e.trim().lines().count(), 1, "{e}");
        for w in words {
            assert!(e.contains(w), "{args:?}: {w} not in {e}");
        }
        assert!(!out.exists());
    }
}

#[test]
fn gguf_q4_0_blocks_copied_equal_hf_round_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for name in QUANT {
        let dir = testdata().join("models").join(name);
        let a = tmp.path().join(format!("{name}.gguf.mlb"));
        let b = tmp.path().join(format!("{name}.hf.mlb"));
        let log = convert(&gguf_dir().join(format!("{name}.q4_0.gguf")), &a, &[]).stderr;
        assert!(!log.contains("requantized"), "{name}: {log}");
        let got = std::fs::read(&a).unwrap();
        let hf = converted(
            &dir,
            &b,
            &[
                "--wtype",
                "q4_0",
                "--q4-rule",
                "round",
                "--f16-scales",
                "--q8",
                "none",
            ],
        );
        let want = llama_cpp_view(name, hf, &got);
        note_diff(&mut failures, name.to_string(), &got, &want);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A GGUF rewritten: metadata edited by `kv`, tensors by `tensor` (name, type, data).
fn rewrite(
    src: &[u8],
    kv: impl Fn(&mut Vec<(String, MetaValue)>),
    tensor: impl Fn(&str, GgmlType, &[u64], &[u8]) -> Option<(GgmlType, Vec<u8>)>,
) -> Vec<u8> {
    let v = gguf::parse(src).unwrap();
    let mut kvs: Vec<(String, MetaValue)> = v
        .kvs
        .iter()
        .map(|k| (k.key.to_string(), MetaValue::from_value(&k.value)))
        .collect();
    kv(&mut kvs);
    let mut specs = Vec::new();
    let mut datas = Vec::new();
    for t in &v.tensors {
        let data = v.data(t);
        let (ty, d) = tensor(t.name, t.ty, t.shape(), data).unwrap_or((t.ty, data.to_vec()));
        specs.push(TensorSpec {
            name: t.name.to_string(),
            dims: t.shape().to_vec(),
            ty,
        });
        datas.push(d);
    }
    let mut w = GgufWriter::new(Vec::new(), &kvs, specs).unwrap();
    for d in &datas {
        w.write_data(d).unwrap();
    }
    w.finish().unwrap()
}

/// Q8_0 blocks → F32 values (d · q), as a GGUF tensor.
fn q8_to_f32(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in data.chunks_exact(34) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        for &q in &b[2..] {
            out.extend_from_slice(&((q as i8) as f32 * d).to_le_bytes());
        }
    }
    out
}

#[test]
fn gguf_q8_0_blocks_copied_are_exact() {
    let tmp = tempfile::tempdir().unwrap();
    for name in QUANT {
        let src = gguf_dir().join(format!("{name}.q8_0.gguf"));
        let a = tmp.path().join(format!("{name}.copy.mlb"));
        let copied = converted(&src, &a, &[]);
        let h = header_of(&copied);
        assert_eq!((h.wtype, h.scale_f16, h.q8_mask), (1, 1, 0), "{name}");
        // The GGUF's own values, dequantized and quantized again by the spec's Q8_0
        // rule with f16 scales, give back the same blocks: d = amax / 127 of a block
        // whose largest quant is ±127 is the stored d, and each q·d rounds to q.
        let bytes = std::fs::read(&src).unwrap();
        let f32s = rewrite(
            &bytes,
            |_| {},
            |_, ty, _, data| (ty == GgmlType::Q8_0).then(|| (GgmlType::F32, q8_to_f32(data))),
        );
        let fsrc = tmp.path().join(format!("{name}.dequantized.gguf"));
        std::fs::write(&fsrc, f32s).unwrap();
        let b = tmp.path().join(format!("{name}.requant.mlb"));
        let requant = converted(&fsrc, &b, &["--requantize", "q8_0", "--f16-scales"]);
        if let Some(d) = describe_diff(&copied, &requant) {
            panic!("{name}: copy vs requantized: {d}");
        }
    }
}

#[test]
fn gguf_quantized_logits_match_transformers() {
    use krafla::format::mlb::Mlb;
    use krafla::model::{Model, StateOptions};
    let tmp = tempfile::tempdir().unwrap();
    // The mixture-of-experts fixtures run with the MoE runtime (tests/run/moe_fixtures.rs).
    for name in QUANT.iter().filter(|n| **n != "olmoe") {
        let dir = testdata().join("models").join(name);
        let (_, toks) = reference(&dir).unwrap();
        let f32_ref = read_f32(&dir.join("logits.f32.bin"));
        for q in ["q8_0", "q4_0"] {
            let out = tmp.path().join(format!("{name}.{q}.mlb"));
            convert(&gguf_dir().join(format!("{name}.{q}.gguf")), &out, &[]);
            let m = Mlb::open(&out).unwrap();
            let model = Model::new(&m).unwrap();
            let got = crate::run::all_logits(&model, &StateOptions::default(), &toks);
            let e = crate::run::nrmse(&got, &f32_ref);
            eprintln!("{name} {q}: nRMSE vs transformers f32 {e:.4}");
            // Gemma 3's GGUF makes every layer a sliding one (llama.cpp's default
            // pattern), so it is compared loosely; the others as the fixture tests do.
            let bound = match (*name, q) {
                ("gemma3_text", _) => 1.0,
                (_, "q8_0") => 0.05,
                _ => 0.4,
            };
            assert!(e < bound, "{name} {q}: nRMSE {e}");
        }
    }
}

fn set_kv(kvs: &mut Vec<(String, MetaValue)>, key: &str, v: MetaValue) {
    match kvs.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => kvs.push((key.to_string(), v)),
    }
}

/// Converts crafted GGUF bytes; the error text.
fn refusal(bytes: &[u8], args: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("in.gguf");
    std::fs::write(&src, bytes).unwrap();
    let out = tmp.path().join("out.mlb");
    let e = mlb_convert(&src, &out).args(args).fails();
    assert!(!out.exists(), "no output on a refusal");
    assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
    e
}

#[test]
fn gguf_refusals_name_the_key_or_tensor() {
    let base = std::fs::read(gguf_dir().join("llama.q8_0.gguf")).unwrap();
    let same = |_: &str, _: GgmlType, _: &[u64], _: &[u8]| None;
    // Not a GGUF past its magic: the parser's error, naming the file.
    let e = refusal(&base[..200], &[]);
    assert!(e.contains("in.gguf") && e.contains("ML_E_FORMAT"), "{e}");
    // One key set to a value the converter refuses: the words of its error.
    let per_layer = MetaValue::Array(
        gguf::ValueType::U32,
        vec![MetaValue::U32(2), MetaValue::U32(1)],
    );
    let one_key: [(&str, MetaValue, &[&str]); 7] = [
        // Unknown architecture.
        (
            "general.architecture",
            MetaValue::Str("mamba".into()),
            &["general.architecture = mamba"],
        ),
        // A key that may change the math.
        (
            "llama.expert_weights_scale",
            MetaValue::F32(2.5),
            &["llama.expert_weights_scale = 2.5", "unknown key"],
        ),
        // Experts make a llama a Mixtral, which needs its experts' keys.
        (
            "llama.expert_count",
            MetaValue::U32(8),
            &["llama.expert_used_count = missing"],
        ),
        // Unsupported RoPE scaling.
        (
            "llama.rope.scaling.type",
            MetaValue::Str("longrope".into()),
            &["llama.rope.scaling.type = \"longrope\""],
        ),
        // Per-layer values that differ.
        (
            "llama.attention.head_count_kv",
            per_layer,
            &["llama.attention.head_count_kv"],
        ),
        // A split file.
        ("split.count", MetaValue::U16(2), &["split.count = 2"]),
        // Wrong shape.
        (
            "llama.feed_forward_length",
            MetaValue::U32(96),
            &["blk.0.ffn_gate.weight"],
        ),
    ];
    for (key, v, words) in one_key {
        let e = refusal(&rewrite(&base, |k| set_kv(k, key, v.clone()), same), &[]);
        for w in words {
            assert!(e.contains(w), "{key}: {w:?} not in {e}");
        }
    }
    // A yarn key llama.cpp ignores for this architecture.
    let b = rewrite(
        &base,
        |k| {
            set_kv(k, "llama.rope.scaling.type", MetaValue::Str("yarn".into()));
            set_kv(k, "llama.rope.scaling.factor", MetaValue::F32(4.0));
            set_kv(k, "llama.rope.scaling.yarn_beta_fast", MetaValue::F32(16.0));
        },
        same,
    );
    let e = refusal(&b, &[]);
    assert!(e.contains("llama.rope.scaling.yarn_beta_fast = 16"), "{e}");
    // A tensor the model does not use, and one it needs that is missing.
    let mut extra = rewrite(&base, |_| {}, same);
    {
        let v = gguf::parse(&extra).unwrap();
        let kvs: Vec<_> = v
            .kvs
            .iter()
            .map(|k| (k.key.to_string(), MetaValue::from_value(&k.value)))
            .collect();
        let mut specs: Vec<TensorSpec> = v.tensors.iter().map(TensorSpec::of).collect();
        let mut datas: Vec<Vec<u8>> = v.tensors.iter().map(|t| v.data(t).to_vec()).collect();
        specs.push(TensorSpec::vector(
            "blk.0.attn_output.bias",
            64,
            GgmlType::F32,
        ));
        datas.push(vec![0; 256]);
        let mut w = GgufWriter::new(Vec::new(), &kvs, specs).unwrap();
        for d in &datas {
            w.write_data(d).unwrap();
        }
        extra = w.finish().unwrap();
    }
    let e = refusal(&extra, &[]);
    assert!(
        e.contains("blk.0.attn_output.bias") && e.contains("not used"),
        "{e}"
    );
}

/// A gpt-oss GGUF without a key llama.cpp's loader requires of it is refused naming the
/// file and the key (without the window it would convert with none, a model llama.cpp
/// never runs).
#[test]
fn gguf_gpt_oss_required_keys() {
    let base = std::fs::read(gguf_dir().join("gpt_oss.bf16.gguf")).unwrap();
    let same = |_: &str, _: GgmlType, _: &[u64], _: &[u8]| None;
    for key in [
        "gpt-oss.attention.sliding_window",
        "gpt-oss.expert_feed_forward_length",
    ] {
        let b = rewrite(&base, |k| k.retain(|(n, _)| n != key), same);
        let e = refusal(&b, &[]);
        assert!(
            e.contains("in.gguf") && e.contains(&format!("{key} = missing")),
            "{key}: {e}"
        );
    }
}

/// Random but valid Q5_0 blocks for a rows × cols matrix (small scales).
fn q5_0_blocks(rows: usize, cols: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut x = 12345u32;
    for _ in 0..rows * cols / 32 {
        let mut b = [0u8; 22];
        for v in b.iter_mut() {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            *v = (x >> 24) as u8;
        }
        b[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        out.extend_from_slice(&b);
    }
    out
}

/// The storage type of every matrix of an .mlb, by name.
fn matrix_types(bytes: &[u8]) -> Vec<(String, krafla::format::WType)> {
    use krafla::format::mlb::layout::Kind;
    let m = mlb::parse(bytes).unwrap();
    m.layout
        .tensors
        .iter()
        .filter_map(|t| match t.kind {
            Kind::Mat { wtype, .. } => Some((t.name.to_string(), wtype)),
            _ => None,
        })
        .collect()
}

#[test]
fn gguf_mixed_types_copied_or_need_requantize() {
    use krafla::format::mlb::header::{q8_class, wtype};
    use krafla::format::WType;
    // Like llama-quantize's mixes: token_embd Q8_0 (copied from the Q8_0 file), output
    // in another type Krafla has (Q5_0): every matrix keeps its blocks, in a mixed file.
    let q4 = std::fs::read(gguf_dir().join("llama.q4_0.gguf")).unwrap();
    let q8 = std::fs::read(gguf_dir().join("llama.q8_0.gguf")).unwrap();
    let v8 = gguf::parse(&q8).unwrap();
    let emb8 = v8.data(v8.tensor("token_embd.weight").unwrap()).to_vec();
    let out8 = v8.data(v8.tensor("output.weight").unwrap()).to_vec();
    let with_output = |ty: GgmlType, data: Vec<u8>| {
        rewrite(
            &q4,
            |_| {},
            |name, _, _, _| match name {
                "token_embd.weight" => Some((GgmlType::Q8_0, emb8.clone())),
                "output.weight" => Some((ty, data.clone())),
                _ => None,
            },
        )
    };
    let q5 = q5_0_blocks(256, 64);
    let mixed = with_output(GgmlType::Q5_0, q5.clone());
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("mixed.gguf");
    std::fs::write(&src, &mixed).unwrap();
    let out = tmp.path().join("mixed.mlb");
    let log = convert(&src, &out, &[]).stderr;
    assert!(!log.contains("requantized"), "{log}");
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(header_of(&bytes).wtype, wtype::MIXED);
    let types = matrix_types(&bytes);
    let of = |n: &str| types.iter().find(|(x, _)| x == n).unwrap().1;
    assert_eq!(
        (of("tok_emb"), of("wcls"), of("layers.0.wq")),
        (WType::Q8_0, WType::Q5_0, WType::Q4_0)
    );
    let m = mlb::parse(&bytes).unwrap();
    let t = m.layout.find("wcls").unwrap();
    assert_eq!(
        &bytes[t.offset as usize..(t.offset + t.bytes) as usize],
        &q5[..]
    );

    // An F32 output matrix: Krafla stores no F32 matrices, so --requantize is needed.
    let f32s = with_output(GgmlType::F32, q8_to_f32(&out8));
    let e = refusal(&f32s, &[]);
    assert!(
        e.contains("output.weight") && e.contains("F32") && e.contains("--requantize"),
        "{e}"
    );
    std::fs::write(&src, &f32s).unwrap();
    let log = convert(&src, &out, &["--requantize", "q8_0"]).stderr;
    assert!(
        log.contains("requantized 1 tensor(s)") && log.contains("output.weight (F32)"),
        "{log}"
    );
    let bytes = std::fs::read(&out).unwrap();
    let h = header_of(&bytes);
    // Uniform again: Q4_0 with the Q8_0 classes in q8_mask.
    assert_eq!(
        (h.wtype, h.q8_mask, h.scale_f16),
        (wtype::Q4_0, q8_class::TOK_EMB | q8_class::WCLS, 1)
    );
    // The embedding rows are the Q8_0 file's blocks, copied.
    let m = mlb::parse(&bytes).unwrap();
    let t = m.layout.find("tok_emb").unwrap();
    let q = &bytes[t.offset as usize..(t.offset + t.bytes) as usize];
    let want: Vec<u8> = emb8
        .chunks_exact(34)
        .flat_map(|b| b[2..].to_vec())
        .collect();
    assert_eq!(q, &want[..]);
    // A type with no Krafla counterpart, by name.
    let e = mlb_convert(&src, &out)
        .args(["--requantize", "q9_9"])
        .fails();
    assert!(e.contains("q9_9") && e.contains("q4_k"), "{e}");
}

#[test]
fn gguf_llama_cpp_mixed_types_copied_and_exported() {
    use krafla::format::mlb::header::wtype;
    use krafla::format::WType;
    // llama-quantize's file with Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0, F16 and BF16
    // matrices (testdata/make_gguf_mixed.sh), q/k rows in llama.cpp's rotate-half order.
    let src = gguf_dir().join("qwen3.mixed.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("mixed.mlb");
    let first = converted(&src, &a, &[]);
    assert_eq!(header_of(&first).wtype, wtype::MIXED);
    let types = matrix_types(&first);
    let of = |n: &str| types.iter().find(|(x, _)| x == n).unwrap().1;
    assert_eq!(
        [
            of("layers.1.wq"),
            of("layers.1.wk"),
            of("layers.1.wv"),
            of("layers.1.wo"),
            of("layers.1.w1"),
            of("layers.1.w3"),
            of("layers.1.w2"),
            of("tok_emb"),
            of("wcls"),
        ],
        [
            WType::Q5_1,
            WType::Q4_1,
            WType::IQ4_NL,
            WType::Q8_0,
            WType::F16,
            WType::BF16,
            WType::Q5_0,
            WType::Q4_0,
            WType::Q8_0,
        ]
    );
    // Exported: every tensor is the GGUF's, bytes and types, rows back in llama.cpp's
    // order; so the .mlb holds each matrix's blocks unchanged up to the row permutation.
    byte_mlt(&a.with_extension("mlt"));
    let x = tmp.path().join("mixed.export.gguf");
    mlb_export(&a, &x).ok();
    same_tensors(&std::fs::read(&src).unwrap(), &std::fs::read(&x).unwrap()).unwrap();
    let b = tmp.path().join("mixed.again.mlb");
    let second = converted(&x, &b, &[]);
    assert_eq!(describe_diff(&first, &second), None);
    // --requantize quantizes the float (F16/BF16) matrices; blocks stay as they are.
    let c = tmp.path().join("mixed.q4.mlb");
    let log = convert(&src, &c, &["--requantize", "q4_0"]).stderr;
    assert!(log.contains("blk.0.ffn_gate.weight (F16)"), "{log}");
    let types = matrix_types(&std::fs::read(&c).unwrap());
    let of = |n: &str| types.iter().find(|(x, _)| x == n).unwrap().1;
    assert_eq!(
        (of("layers.0.w1"), of("layers.0.w3"), of("layers.0.wq")),
        (WType::Q4_0, WType::Q4_0, WType::Q5_1)
    );
}

#[test]
fn gguf_llama_cpp_iq_types_copied_and_exported() {
    use krafla::format::WType;
    // llama-quantize's IQ codebook blocks (testdata/make_gguf_iq.py): a 256-wide Llama
    // with one IQ type per tensor kind, copied with no flag and exported as the same
    // tensors; the .mlb runs on every tier (tests/kernels/blocks.rs holds the tiers to
    // the reference bit for bit).
    let src = gguf_dir().join("llama256.iq.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("iq.mlb");
    let first = converted(&src, &a, &[]);
    let types = matrix_types(&first);
    let of = |n: &str| types.iter().find(|(x, _)| x == n).unwrap().1;
    assert_eq!(
        vec![
            of("layers.0.wq"),
            of("layers.0.wk"),
            of("layers.0.wv"),
            of("layers.0.wo"),
            of("layers.0.w1"),
            of("layers.0.w3"),
            of("layers.0.w2"),
            of("tok_emb"),
            of("wcls"),
        ],
        // Every codebook type in code order on wq..w3, IQ3_XXS again on w2.
        [
            WType::CODEBOOKS,
            &[WType::IQ3_XXS, WType::Q8_0, WType::Q8_0]
        ]
        .concat()
    );
    byte_mlt(&a.with_extension("mlt"));
    let x = tmp.path().join("iq.export.gguf");
    mlb_export(&a, &x).ok();
    same_tensors(&std::fs::read(&src).unwrap(), &std::fs::read(&x).unwrap()).unwrap();
    let b = tmp.path().join("iq.again.mlb");
    assert_eq!(describe_diff(&first, &converted(&x, &b, &[])), None);
    // --requantize leaves them as they are (it applies to float matrices and to types
    // Krafla lacks), a codebook type as its target too.
    for target in ["q8_0", "iq2_xxs"] {
        let c = tmp.path().join(format!("iq.{target}.mlb"));
        let log = convert(&src, &c, &["--requantize", target]).stderr;
        assert!(!log.contains("requantized"), "{log}");
        assert_eq!(matrix_types(&std::fs::read(&c).unwrap()), types);
    }
}

/// Krafla's own codebook quantizers: `--wtype iq…` on a 256-wide checkpoint gives a
/// file of that type that runs (finite logits), exports to GGUF with llama.cpp's types
/// and reads back identical; `--types` and `--requantize` take them too.
#[test]
fn codebook_types_quantized_run_and_export() {
    use krafla::format::WType;
    let hf = testdata().join("models").join("llama_k256");
    let tmp = tempfile::tempdir().unwrap();
    for &want in WType::CODEBOOKS {
        let ty = want.cli_name();
        let a = tmp.path().join(format!("{ty}.mlb"));
        let first = converted(&hf, &a, &["--wtype", ty, "--gguf-types"]);
        byte_mlt(&a.with_extension("mlt"));
        let types = matrix_types(&first);
        assert!(types.iter().any(|(_, t)| *t == want), "{ty}: {types:?}");
        let logits = tmp.path().join(format!("{ty}.f32"));
        tool("mlb-run")
            .arg(&a)
            .args(["--tokens", "1 17 42 99 3 250", "--logits"])
            .arg(&logits)
            .ok();
        let l = read_f32(&logits);
        assert!(!l.is_empty() && l.iter().all(|v| v.is_finite()), "{ty}");
        let x = tmp.path().join(format!("{ty}.gguf"));
        mlb_export(&a, &x).ok();
        let b = tmp.path().join(format!("{ty}.again.mlb"));
        assert_eq!(describe_diff(&first, &converted(&x, &b, &[])), None, "{ty}");
    }
    // --types CLASS=iq… on one class; --requantize iq… on a BF16 GGUF (the checkpoint
    // exported).
    let a = tmp.path().join("types.mlb");
    let t = matrix_types(&converted(&hf, &a, &["--types", "w2=iq2_s"]));
    assert!(t.iter().any(|(_, t)| *t == WType::IQ2_S), "{t:?}");
    let f = tmp.path().join("bf16.mlb");
    converted(&hf, &f, &["--wtype", "bf16", "--gguf-types"]);
    byte_mlt(&f.with_extension("mlt"));
    let g = tmp.path().join("bf16.gguf");
    mlb_export(&f, &g).ok();
    let r = tmp.path().join("requant.mlb");
    let t = matrix_types(&converted(&g, &r, &["--requantize", "iq3_s"]));
    assert!(t.iter().any(|(_, t)| *t == WType::IQ3_S), "{t:?}");
}

#[test]
fn gguf_dequantizers_match_gguf_py() {
    let bytes = std::fs::read(gguf_dir().join("dequant.gguf")).unwrap();
    let v = gguf::parse(&bytes).unwrap();
    let mut seen = 0;
    for t in &v.tensors {
        let Some(ty) = t.name.strip_suffix(".blocks") else {
            continue;
        };
        let e = v.tensor(&format!("{ty}.expected")).unwrap();
        let want = f32s(v.data(e));
        let mut got = vec![0f32; want.len()];
        assert!(
            gguf::dequant::dequantize_row(t.ty, v.data(t), &mut got),
            "{ty}"
        );
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{ty} element {i}: {a} vs {b}");
        }
        seen += 1;
    }
    assert_eq!(seen, 12);
}

// ---------------------------------------------------------------------------------
// Tokenizers

use krafla::convert::gguf::tokenizer as gguf_tok;
use krafla::format::mlt::Mlt;
use krafla::tokenizer::{from_hf, Tokenizer};

/// mlt-convert's tokenizer of the GGUF `src` (chat section included), written to `out`.
fn gguf_mlt(src: &Path, out: &Path) -> Mlt {
    let chat = krafla::chat::capture::ChatOptions::default();
    gguf_tok::convert_file(src, out, None, None, &chat).unwrap()
}

fn real_gguf(name: &str) -> Option<PathBuf> {
    let d = PathBuf::from(std::env::var_os("KRAFLA_REAL_DIR")?)
        .join("gguf")
        .join(name);
    d.exists().then_some(d)
}

/// Our encoder on the GGUF's tokenizer against the tokenizers library on `json`: the
/// corpus, every added token in context and random strings.
fn check_against_hf(name: &str, m: &Mlt, json: &str) {
    let ours = Tokenizer::from_mlt(m).unwrap();
    crate::tokenizer::assert_matches_hf(name, &ours, m, json);
}

#[test]
fn gguf_vocab_of_default_model_equals_its_tokenizer_json() {
    // convert_hf_to_gguf.py --vocab-only of testdata/default, read back: the same file
    // mlt-convert makes from the tokenizer.json.
    let m = gguf_tok::mlt_from_gguf_file(&gguf_dir().join("default.vocab.gguf")).unwrap();
    let dir = testdata().join("default");
    let json = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let want =
        from_hf::convert(&json, Some(&cfg), &from_hf::HfTokenizerOptions::default()).unwrap();
    assert_eq!(m, want);
    check_against_hf("default (GGUF)", &m, &json);
}

#[test]
fn gguf_real_tokenizers_match_hf() {
    use crate::tokenizer::gunzip;
    let (Some(smol), Some(gemma)) = (
        real_gguf("smollm2-135m-instruct-q4_1.gguf"),
        real_gguf("gemma-3-270m-q4_k_m.gguf"),
    ) else {
        eprintln!("SKIP gguf_real_tokenizers_match_hf: set KRAFLA_REAL_DIR to the output of shared/tools/real-checkpoints.sh");
        return;
    };
    // SmolLM2: pre-tokenizer "smollm" splits digits first, as SmolLM's own
    // tokenizer.json does (the one transformers writes from the GGUF drops that step).
    let m = gguf_tok::mlt_from_gguf_file(&smol).unwrap();
    check_against_hf(
        "smollm2 (GGUF)",
        &m,
        &gunzip("smollm2.tokenizer.digits-split.json.gz"),
    );
    let m = gguf_tok::mlt_from_gguf_file(&gemma).unwrap();
    check_against_hf("gemma3 (GGUF)", &m, &gunzip("gemma3.tokenizer.json.gz"));
}

#[test]
fn gguf_tokenizer_metadata_round_trips() {
    use crate::tokenizer::gunzip;
    for (name, json, cfg, arch) in [
        (
            "default",
            std::fs::read_to_string(testdata().join("default/tokenizer.json")).unwrap(),
            Some(
                std::fs::read_to_string(testdata().join("default/tokenizer_config.json")).unwrap(),
            ),
            "llama",
        ),
        (
            "smollm2",
            gunzip("smollm2.tokenizer.digits-split.json.gz"),
            None,
            "llama",
        ),
        ("qwen3", gunzip("qwen3.tokenizer.json.gz"), None, "qwen3"),
        ("llama3", gunzip("llama3.tokenizer.json.gz"), None, "llama"),
        (
            "gemma3",
            gunzip("gemma3.tokenizer.json.gz"),
            Some(
                std::fs::read_to_string(testdata().join("tokenizers/gemma3.tokenizer_config.json"))
                    .unwrap(),
            ),
            "gemma3",
        ),
    ] {
        let m = from_hf::convert(
            &json,
            cfg.as_deref(),
            &from_hf::HfTokenizerOptions::default(),
        )
        .unwrap();
        let kvs = gguf_tok::gguf_tokenizer_kvs(&m, arch).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut all = vec![(
            "general.architecture".to_string(),
            MetaValue::Str(arch.into()),
        )];
        all.extend(kvs);
        let bytes = gguf::to_bytes(&all, &[]).unwrap();
        let back = gguf_tok::mlt_from_gguf(&gguf::parse(&bytes).unwrap()).unwrap();
        assert!(back == m, "{name}: does not round-trip");
    }
}

/// mlt-convert on a Hugging Face folder made of a fixture's tokenizer.json,
/// tokenizer_config.json and chat template: the .mlt with its chat section.
fn hf_chat_mlt(dir: &Path, json: &str, cfg: &str, template: &str) -> Mlt {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), cfg).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    let out = dir.join("hf.mlt");
    krafla::tools::mlt_convert::convert_file(&dir.join("tokenizer.json"), &out, &Default::default())
        .unwrap()
}

/// The stop ids of an .mlt's chat section.
fn stop_ids(m: &Mlt) -> Vec<u32> {
    m.chat.as_ref().unwrap().stop.iter().map(|s| s.id).collect()
}

#[test]
fn gguf_chat_template_round_trips_with_its_stop_set() {
    use crate::tokenizer::gunzip;
    use krafla::chat::capture::ChatOptions;
    use krafla::format::mlt_chat::NamedTemplate;
    let tmp = tempfile::tempdir().unwrap();
    let chat = testdata().join("chat/templates");
    for (name, json, cfg, template, arch, want_stop) in [
        (
            "smollm2",
            gunzip("smollm2.tokenizer.digits-split.json.gz"),
            std::fs::read_to_string(testdata().join("tokenizers/smollm2.tokenizer_config.json"))
                .unwrap(),
            "smollm2.jinja",
            "llama",
            vec![2],
        ),
        (
            "gemma3",
            gunzip("gemma3.tokenizer.json.gz"),
            std::fs::read_to_string(testdata().join("tokenizers/gemma3.tokenizer_config.json"))
                .unwrap(),
            "gemma3.jinja",
            "gemma3",
            vec![1, 106],
        ),
    ] {
        let template = std::fs::read_to_string(chat.join(template)).unwrap();
        let mut hf = hf_chat_mlt(&tmp.path().join(name), &json, &cfg, &template);
        // A named template too (tokenizer.chat_template.NAME).
        let c = hf.chat.as_mut().unwrap();
        c.templates.push(NamedTemplate {
            name: "tool_use".into(),
            source: template.clone(),
        });
        assert_eq!(stop_ids(&hf), want_stop, "{name}: the HF folder's stop set");
        // The export's metadata (mlb-export writes these keys) ...
        let mut all = vec![(
            "general.architecture".to_string(),
            MetaValue::Str(arch.into()),
        )];
        all.extend(gguf_tok::gguf_tokenizer_kvs(&hf, arch).unwrap());
        let keys: Vec<&str> = all.iter().map(|(k, _)| k.as_str()).collect();
        assert!(
            keys.contains(&"tokenizer.chat_template")
                && keys.contains(&"tokenizer.chat_template.tool_use"),
            "{name}: {keys:?}"
        );
        // Gemma's end of turn is not its EOS: llama.cpp's eot_token_id says it.
        assert_eq!(
            keys.contains(&"tokenizer.ggml.eot_token_id"),
            name == "gemma3",
            "{name}"
        );
        let g = tmp.path().join(format!("{name}.gguf"));
        std::fs::write(&g, gguf::to_bytes(&all, &[]).unwrap()).unwrap();
        // ... imported by mlt-convert: the same templates and stop ids.
        let back = gguf_mlt(&g, &tmp.path().join(format!("{name}.mlt")));
        let (a, b) = (hf.chat.as_ref().unwrap(), back.chat.as_ref().unwrap());
        assert_eq!(a.templates, b.templates, "{name}");
        assert_eq!(stop_ids(&back), want_stop, "{name}");
        // And --no-chat writes none.
        let none = gguf_tok::convert_file(
            &g,
            &tmp.path().join(format!("{name}.nochat.mlt")),
            None,
            None,
            &ChatOptions {
                disable: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(none.chat.is_none());
    }
}

#[test]
fn gguf_real_chat_template_matches_hf_folder() {
    let Some(smol) = real_gguf("smollm2-135m-instruct-q4_1.gguf") else {
        eprintln!("SKIP gguf_real_chat_template_matches_hf_folder: set KRAFLA_REAL_DIR");
        return;
    };
    let real = PathBuf::from(std::env::var_os("KRAFLA_REAL_DIR").unwrap());
    let tmp = tempfile::tempdir().unwrap();
    // llama.cpp's GGUF of SmolLM2-135M-Instruct (template and ids from its
    // tokenizer_config.json) against mlt-convert on the Hugging Face folder.
    let g = gguf_mlt(&smol, &tmp.path().join("g.mlt"));
    let hf = krafla::tools::mlt_convert::convert_file(
        &real.join("smollm2-135m/tokenizer.json"),
        &tmp.path().join("hf.mlt"),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(stop_ids(&g), stop_ids(&hf));
    eprintln!("smollm2: stop ids {:?}", stop_ids(&g));
}

#[test]
fn gguf_tokenizer_refusals() {
    let base = std::fs::read(gguf_dir().join("default.vocab.gguf")).unwrap();
    let same = |_: &str, _: GgmlType, _: &[u64], _: &[u8]| None;
    let err = |b: &[u8]| {
        gguf_tok::mlt_from_gguf(&gguf::parse(b).unwrap())
            .unwrap_err()
            .to_string()
    };
    let b = rewrite(
        &base,
        |k| set_kv(k, "tokenizer.ggml.pre", MetaValue::Str("default".into())),
        same,
    );
    let e = err(&b);
    assert!(
        e.contains("tokenizer.ggml.pre = \"default\"") && e.contains("cannot reproduce"),
        "{e}"
    );
    let b = rewrite(
        &base,
        |k| set_kv(k, "tokenizer.ggml.model", MetaValue::Str("bert".into())),
        same,
    );
    assert!(err(&b).contains("tokenizer.ggml.model = \"bert\""));
    let b = rewrite(
        &base,
        |k| set_kv(k, "tokenizer.ggml.add_eos_token", MetaValue::Bool(true)),
        same,
    );
    assert!(err(&b).contains("tokenizer.ggml.add_eos_token"));
    let b = rewrite(
        &base,
        |k| k.retain(|(n, _)| n != "tokenizer.ggml.merges"),
        same,
    );
    assert!(err(&b).contains("tokenizer.ggml.merges = missing"));
    let b = rewrite(
        &base,
        |k| set_kv(k, "tokenizer.ggml.bos_token_id", MetaValue::U32(99999)),
        same,
    );
    assert!(err(&b).contains("tokenizer.ggml.bos_token_id = 99999"));
    // mlt-convert on a GGUF: one line naming the file.
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("bad.gguf");
    let b = rewrite(
        &base,
        |k| set_kv(k, "tokenizer.ggml.pre", MetaValue::Str("falcon".into())),
        same,
    );
    std::fs::write(&src, b).unwrap();
    let e = tool("mlt-convert")
        .arg(&src)
        .arg("-o")
        .arg(tmp.path().join("x.mlt"))
        .fails();
    assert!(e.contains("bad.gguf") && e.contains("falcon"), "{e}");
    assert!(!tmp.path().join("x.mlt").exists());
}

// ---------------------------------------------------------------------------------
// Export

/// Every tensor of `a` is in `b` with the same type, shape and bytes, and the reverse.
fn same_tensors(a: &[u8], b: &[u8]) -> Result<(), String> {
    let (va, vb) = (gguf::parse(a).unwrap(), gguf::parse(b).unwrap());
    if va.tensors.len() != vb.tensors.len() {
        return Err(format!(
            "{} vs {} tensors",
            va.tensors.len(),
            vb.tensors.len()
        ));
    }
    for t in &va.tensors {
        let u = vb
            .tensor(t.name)
            .ok_or_else(|| format!("{} missing", t.name))?;
        if (t.ty, t.shape()) != (u.ty, u.shape()) || va.data(t) != vb.data(u) {
            return Err(format!(
                "{}: {} {:?} vs {} {:?}, data equal: {}",
                t.name,
                t.ty,
                t.shape(),
                u.ty,
                u.shape(),
                va.data(t) == vb.data(u)
            ));
        }
    }
    Ok(())
}

#[test]
fn gguf_export_round_trip_is_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for name in QUANT {
        for q in ["q8_0", "q4_0"] {
            let src = gguf_dir().join(format!("{name}.{q}.gguf"));
            let a = tmp.path().join(format!("{name}.{q}.mlb"));
            let first = converted(&src, &a, &[]);
            byte_mlt(&a.with_extension("mlt"));
            let x = tmp.path().join(format!("{name}.{q}.export.gguf"));
            mlb_export(&a, &x).ok();
            // llama.cpp's names, types, shapes and row order: the tensors of the file
            // its converter (or gguf-py's Q4_0) made.
            if let Err(e) = same_tensors(&std::fs::read(&src).unwrap(), &std::fs::read(&x).unwrap())
            {
                failures.push(format!("{name} {q}: tensors: {e}"));
            }
            let b = tmp.path().join(format!("{name}.{q}.again.mlb"));
            let second = converted(&x, &b, &[]);
            note_diff(
                &mut failures,
                format!("{name} {q}: .mlb → GGUF → .mlb"),
                &first,
                &second,
            );
        }
    }
    // Every float fixture, requantized with f16 scales: the header mapping both ways
    // (Qwen 3.5's fixture is refused: its 16-wide value heads would split blocks of
    // ssm_out; the synthetic test below has 32-wide ones).
    for (name, file) in FLOAT
        .iter()
        .filter(|(n, _)| !["qwen3_5_text", "qwen3_5_moe_text"].contains(n))
    {
        let a = tmp.path().join(format!("{name}.f.mlb"));
        let first = converted(
            &gguf_dir().join(file),
            &a,
            &["--requantize", "q4_0", "--f16-scales"],
        );
        byte_mlt(&a.with_extension("mlt"));
        let x = tmp.path().join(format!("{name}.f.gguf"));
        mlb_export(&a, &x).ok();
        let b = tmp.path().join(format!("{name}.f.again.mlb"));
        let mut second = converted(&x, &b, &[]);
        if *name == "llama_rope_llama3" {
            // With one interpolated frequency (head_dim 16) the Llama 3 parameters read
            // back from llama.cpp's factors are equivalent ones: the same divisors.
            second = llama_cpp_view(name, second, &first);
        }
        note_diff(
            &mut failures,
            format!("{name}: .mlb → GGUF → .mlb"),
            &first,
            &second,
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Mixtral as llama.cpp's llama with experts: the checkpoint's model, without the
/// sliding window llama.cpp ignores (so every layer is flagged MoE only), the experts
/// stacked alike; exported back as a llama with `expert_count`, read back the same.
#[test]
fn gguf_mixtral_is_llama_with_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let src = gguf_dir().join("mixtral.bf16.gguf");
    let a = tmp.path().join("mixtral.mlb");
    let got = converted(&src, &a, &["--requantize", "q8_0", "--f16-scales"]);
    let hf = converted(
        &testdata().join("models/mixtral"),
        &tmp.path().join("hf.mlb"),
        &["--wtype", "q8_0", "--f16-scales"],
    );
    let (g, w) = (mlb::parse(&got).unwrap(), mlb::parse(&hf).unwrap());
    assert_eq!(
        (
            g.header.n_experts,
            g.header.n_experts_used,
            g.header.expert_hidden
        ),
        (4, 2, 32)
    );
    assert_eq!(g.header.moe_gating, w.header.moe_gating);
    assert_eq!(
        (g.header.sliding_window, g.flags.clone()),
        (0, vec![16, 16])
    );
    // The arrays are the checkpoint's (the window is only in the header and flags).
    for (tg, tw) in g.layout.tensors.iter().zip(&w.layout.tensors) {
        if tg.name.name == "layer_flags" {
            continue;
        }
        assert_eq!(tg.name, tw.name);
        let (a0, b0) = (tg.offset as usize, tw.offset as usize);
        let n = (tg.end() - tg.offset) as usize;
        assert_eq!(&got[a0..a0 + n], &hf[b0..b0 + n], "{}", tg.name);
    }
    byte_mlt(&a.with_extension("mlt"));
    let x = tmp.path().join("mixtral.gguf");
    mlb_export(&a, &x).ok();
    let v = std::fs::read(&x).unwrap();
    let view = gguf::parse(&v).unwrap();
    assert_eq!(
        view.get("general.architecture").and_then(|x| x.as_str()),
        Some("llama")
    );
    let again = converted(&x, &tmp.path().join("again.mlb"), &[]);
    assert_eq!(first_diff(&got, &again), None);
}

#[test]
fn gguf_export_writes_the_chat_template() {
    use krafla::chat::capture::build_section;
    use krafla::format::mlt::FLAG_CHAT;
    use krafla::format::mlt_chat::NamedTemplate;
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("m.mlb");
    convert(&gguf_dir().join("llama.q8_0.gguf"), &a, &[]);
    let t = a.with_extension("mlt");
    byte_mlt(&t);
    let mut m = Mlt::load(&t).unwrap();
    let templates = vec![
        NamedTemplate {
            name: "default".into(),
            source: "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".into(),
        },
        NamedTemplate {
            name: "rag".into(),
            source: "{{ documents }}".into(),
        },
    ];
    m.chat = build_section(&m, templates, Vec::new(), &[], &[]).unwrap();
    m.flags |= FLAG_CHAT;
    std::fs::write(&t, m.to_bytes().unwrap()).unwrap();
    let x = tmp.path().join("m.gguf");
    mlb_export(&a, &x).ok();
    let back = gguf_mlt(&x, &tmp.path().join("back.mlt"));
    let (want, got) = (m.chat.unwrap(), back.chat.unwrap());
    assert_eq!((got.templates, got.stop), (want.templates, want.stop));
}

#[test]
fn gguf_real_k_quants_copied_and_exported() {
    use krafla::format::WType;
    let Some(src) = real_gguf("gemma-3-270m-q4_k_m.gguf") else {
        eprintln!("SKIP gguf_real_k_quants_copied_and_exported: set KRAFLA_REAL_DIR");
        return;
    };
    // llama-quantize's Q4_K_M of Gemma 3 270M: Q4_K, Q6_K, Q5_0 and Q8_0 matrices,
    // copied with no flag, exported as the same tensors.
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("g.mlb");
    let first = converted(&src, &a, &[]);
    let types = matrix_types(&first);
    for w in [WType::Q4_K, WType::Q6_K, WType::Q5_0, WType::Q8_0] {
        assert!(types.iter().any(|(_, t)| *t == w), "{w}: {types:?}");
    }
    let t = a.with_extension("mlt");
    gguf_mlt(&src, &t);
    let x = tmp.path().join("g.gguf");
    mlb_export(&a, &x).ok();
    let (sb, xb) = (std::fs::read(&src).unwrap(), std::fs::read(&x).unwrap());
    let (vs, vx) = (gguf::parse(&sb).unwrap(), gguf::parse(&xb).unwrap());
    let mut n = 0;
    for t in vs.tensors.iter().filter(|t| t.ty != GgmlType::F32) {
        let u = vx
            .tensor(t.name)
            .unwrap_or_else(|| panic!("{} missing", t.name));
        assert_eq!((t.ty, t.shape()), (u.ty, u.shape()), "{}", t.name);
        assert!(vs.data(t) == vx.data(u), "{}: bytes differ", t.name);
        n += 1;
    }
    eprintln!("gemma3 Q4_K_M: {n} quantized tensors exported as they were");
    let b = tmp.path().join("g.again.mlb");
    assert_eq!(describe_diff(&first, &converted(&x, &b, &[])), None);
}

#[test]
fn gguf_export_refuses_what_llama_cpp_would_run_differently() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str)] = &[
        ("gemma3_text", &["--f16-scales"], "attn_scale = 0.20412415"),
        ("mistral_sliding", &["--f16-scales"], "sliding_window = 8"),
        // The fixture clamps at 1; llama.cpp's gpt-oss always at 7.
        ("gpt_oss", &["--f16-scales"], "swiglu_limit = 1"),
        ("smollm3", &["--f16-scales"], "layer_flags[2] = 4"),
        ("llama", &[], "is not an f16"),
    ];
    for (name, args, want) in cases {
        let a = tmp.path().join(format!("{name}.mlb"));
        convert(&testdata().join("models").join(name), &a, args);
        byte_mlt(&a.with_extension("mlt"));
        let x = tmp.path().join(format!("{name}.gguf"));
        let e = mlb_export(&a, &x).fails();
        assert!(
            e.contains(want) && e.trim().lines().count() == 1,
            "{name}: {e}"
        );
        assert!(!x.exists());
    }
    // No tokenizer beside the model.
    let a = tmp.path().join("lonely.mlb");
    convert(&gguf_dir().join("llama.q8_0.gguf"), &a, &[]);
    let e = mlb_export(&a, &tmp.path().join("lonely.gguf")).fails();
    assert!(e.contains("lonely.mlt") && e.contains("--tokenizer"), "{e}");
}

/// The real GGUF files (Q4_1, and Gemma 3's Q4_K_M mix) with `--requantize q8_0`,
/// against the Hugging Face checkpoints real-checkpoints.sh dequantized from the same
/// files (bf16): logits of a prompt close, greedy tokens agreeing.
#[test]
fn gguf_real_models_requantized_run_like_their_checkpoints() {
    use krafla::format::mlb::Mlb;
    use krafla::model::{Model, StateOptions};
    let Some(real) = std::env::var_os("KRAFLA_REAL_DIR").map(PathBuf::from) else {
        eprintln!(
            "SKIP gguf_real_models_requantized_run_like_their_checkpoints: set KRAFLA_REAL_DIR"
        );
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    for (ckpt, file) in [
        ("smollm2-135m", "smollm2-135m-instruct-q4_1.gguf"),
        ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
    ] {
        let (src, dir) = (real.join("gguf").join(file), real.join(ckpt));
        if !src.exists() || !dir.exists() {
            eprintln!("SKIP {ckpt}: missing in {}", real.display());
            continue;
        }
        let a = tmp.path().join(format!("{ckpt}.gguf.mlb"));
        let b = tmp.path().join(format!("{ckpt}.hf.mlb"));
        let log = convert(&src, &a, &["--requantize", "q8_0"]).stderr;
        assert!(log.contains("requantized"), "{log}");
        convert(&dir, &b, &["--wtype", "q8_0", "--f16-scales"]);
        let tok = gguf_tok::mlt_from_gguf_file(&src).unwrap();
        let ids = Tokenizer::from_mlt(&tok)
            .unwrap()
            .encode("The capital of France is Paris. The largest planet of the solar system is");
        let logits = |p: &Path| {
            let m = Mlb::open(p).unwrap();
            let model = Model::new(&m).unwrap();
            crate::run::all_logits(&model, &StateOptions::default(), &ids)
        };
        let (got, want) = (logits(&a), logits(&b));
        let vocab = got.len() / ids.len();
        let e = crate::run::nrmse(&got, &want);
        let t = crate::run::top1(&got, &want, vocab);
        eprintln!("{ckpt}: GGUF --requantize q8_0 vs checkpoint q8_0: nRMSE {e:.4}, top-1 {t:.3} over {} positions", ids.len());
        assert!(e < 0.1 && t >= 0.9, "{ckpt}: nRMSE {e}, top-1 {t}");
    }
}

/// `A_log` arrays of `b` replaced by `a`'s where they differ by at most 2 ulps (llama.cpp
/// stores −exp(A_log), read back as ln(−ssm_a)); any other difference is kept.
fn a_log_within_ulps(a: &[u8], mut b: Vec<u8>) -> Vec<u8> {
    let p = mlb::parse(a).unwrap();
    for t in p.layout.tensors.iter().filter(|t| t.name.name == "A_log") {
        let r = t.offset as usize..(t.offset + t.bytes) as usize;
        for (x, y) in a[r.clone()]
            .chunks_exact(4)
            .zip(b[r.clone()].chunks_exact(4))
        {
            let (x, y) = (
                u32::from_le_bytes(x.try_into().unwrap()),
                u32::from_le_bytes(y.try_into().unwrap()),
            );
            assert!(
                (x as i64 - y as i64).abs() <= 2,
                "{}: {} vs {}",
                t.name,
                f32::from_bits(x),
                f32::from_bits(y)
            );
        }
        b[r.clone()].copy_from_slice(&a[r]);
    }
    b
}

#[test]
fn gguf_export_round_trip_qwen35_synthetic() {
    use krafla::format::mlb::header::{layer_flag, wtype};
    use krafla::synth::{qwen35_hybrid, synth_file, tiny_header};
    let tmp = tempfile::tempdir().unwrap();
    for (q, seed) in [(wtype::Q8_0, 3), (wtype::Q4_0, 4)] {
        let mut h = tiny_header();
        h.vocab = 256;
        h.n_layers = 3;
        qwen35_hybrid(&mut h);
        h.rope_theta = 1e8; // θ = 1e4 over head_dim / rot_dim = 2
        h.lin_k_dim = 32; // key and value heads of 32, not linear_dims' 16
        h.lin_v_dim = 32;
        h.scale_f16 = 1;
        h.wtype = q;
        let bytes = synth_file(&h, &[layer_flag::LINEAR, 0, layer_flag::LINEAR], seed);
        let a = tmp.path().join(format!("q35.{q}.mlb"));
        std::fs::write(&a, &bytes).unwrap();
        byte_mlt(&a.with_extension("mlt"));
        let x = tmp.path().join(format!("q35.{q}.gguf"));
        mlb_export(&a, &x).ok();
        let v = std::fs::read(&x).unwrap();
        let g = gguf::parse(&v).unwrap();
        assert_eq!(
            g.get("general.architecture").unwrap().as_str(),
            Some("qwen35")
        );
        assert_eq!(g.tensor("blk.1.attn_q.weight").unwrap().shape(), &[64, 128]);
        let b = tmp.path().join(format!("q35.{q}.again.mlb"));
        let back = a_log_within_ulps(&bytes, converted(&x, &b, &[]));
        if let Some(d) = describe_diff(&bytes, &back) {
            panic!("wtype {q}: .mlb → GGUF → .mlb: {d}");
        }
    }
}

#[test]
fn mlb_export_help_snapshot() {
    insta::assert_snapshot!(tool("mlb-export").arg("--help").ok().stdout);
}

/// gpt-oss as llama.cpp's `gpt-oss`: the GGUF's BF16 blocks copied give the
/// checkpoint's BF16 conversion as llama.cpp computes it (`llama_cpp_view`), whose
/// logits stay near transformers'; exported with llama.cpp's tensors (names, types,
/// shapes, bytes: those of its converter's file) and keys, read back to the same bytes;
/// with MXFP4 matrices (GGUF type 39) too.
#[test]
fn gguf_gpt_oss_imports_and_exports_llama_cpp_layout() {
    use krafla::format::mlb::Mlb;
    use krafla::model::{Model, StateOptions};
    let tmp = tempfile::tempdir().unwrap();
    let src = gguf_dir().join("gpt_oss.bf16.gguf");
    let dir = testdata().join("models/gpt_oss");
    let a = tmp.path().join("g.mlb");
    let got = converted(&src, &a, &[]);
    let hf = converted(&dir, &tmp.path().join("hf.mlb"), &["--wtype", "bf16"]);
    assert_eq!(
        describe_diff(&got, &llama_cpp_view("gpt_oss", hf, &got)),
        None
    );
    // Logits: as llama.cpp means the file (its clamp at 7 where the fixture's is 1, which
    // the tiny model's gates reach often, and the rounded yarn range), far from
    // transformers'; with the fixture's two values put back, within the BF16 bound.
    let (_, toks) = reference(&dir).unwrap();
    let want = read_f32(&dir.join("logits.f32.bin"));
    let nrmse_of = |bytes: &[u8]| {
        let m = Mlb::from_bytes(bytes).unwrap();
        let model = Model::new(&m).unwrap();
        let logits = crate::run::all_logits(&model, &StateOptions::default(), &toks);
        crate::run::nrmse(&logits, &want)
    };
    let mut h = header_of(&got);
    (h.swiglu_limit, h.rope_type) = (1.0, 4);
    let mut fixture_view = got.clone();
    fixture_view[..HEADER_SIZE].copy_from_slice(&h.encode());
    let (e_cpp, e_hf) = (nrmse_of(&got), nrmse_of(&fixture_view));
    eprintln!(
        "gpt_oss.bf16.gguf: nRMSE vs transformers f32 {e_cpp:.4} as llama.cpp runs it, \
         {e_hf:.5} with the checkpoint's swiglu_limit and yarn rounding"
    );
    assert!(e_hf < 0.02, "nRMSE {e_hf}");

    byte_mlt(&a.with_extension("mlt"));
    let x = tmp.path().join("g.gguf");
    mlb_export(&a, &x).ok();
    let (sb, xb) = (std::fs::read(&src).unwrap(), std::fs::read(&x).unwrap());
    same_tensors(&sb, &xb).unwrap();
    let (vs, vx) = (gguf::parse(&sb).unwrap(), gguf::parse(&xb).unwrap());
    // Every gpt-oss key of llama.cpp's file with its value, but the yarn betas
    // llama.cpp does not read; the window's pattern spelled out.
    for kv in vs.kvs.iter().filter(|k| k.key.starts_with("gpt-oss.")) {
        if kv.key.contains("yarn_beta") {
            continue;
        }
        let ours = vx.get(kv.key).map(|v| v.to_string());
        assert_eq!(ours, Some(kv.value.to_string()), "{}", kv.key);
    }
    let pattern: Vec<Option<bool>> = vx
        .get("gpt-oss.attention.sliding_window_pattern")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|b| b.as_bool()).collect())
        .unwrap();
    assert_eq!(pattern, [true, false, true, false].map(Some));
    let again = converted(&x, &tmp.path().join("again.mlb"), &[]);
    assert_eq!(describe_diff(&got, &again), None);

    // MXFP4 matrices: GGUF type 39 out, the same blocks back.
    let q = tmp.path().join("q.mlb");
    let first = converted(&src, &q, &["--requantize", "mxfp4"]);
    byte_mlt(&q.with_extension("mlt"));
    let qx = tmp.path().join("q.gguf");
    mlb_export(&q, &qx).ok();
    let qb = std::fs::read(&qx).unwrap();
    let vq = gguf::parse(&qb).unwrap();
    let t = vq.tensor("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!((t.ty, t.shape()), (GgmlType::MXFP4, &[64u64, 32, 4][..]));
    let back = converted(&qx, &tmp.path().join("q.again.mlb"), &[]);
    assert_eq!(describe_diff(&first, &back), None);
}
