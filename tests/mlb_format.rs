//! The .mlb format: layout, round-trip and one test per row of the spec's error table,
//! on synthetic files (`krafla::synth`, which quantizes: so these live outside `format`).

use krafla::format::error::Status;
use krafla::format::mlb::header::{layer_flag, q8_class, rope_type, wtype, Header};
use krafla::format::mlb::layout::{self, align_up, to_usize_limited, Kind, Layout, Mixer};
use krafla::format::mlb::validate::validate;
use krafla::format::mlb::view::{parse, parse_limited, Mlb};
use krafla::format::WType;
use krafla::synth::{self, linear_dims, llama3_rope, synth_file, tiny_header, yarn_rope};

fn valid_file(h: &Header, flags: &[u8]) -> Vec<u8> {
    synth_file(h, flags, 7)
}

/// The status of parsing `h` (written over a valid file of `base`).
fn status_with(base: &Header, flags: &[u8], edit: impl FnOnce(&mut Header)) -> (Status, String) {
    let mut bytes = valid_file(base, flags);
    let mut h = *base;
    edit(&mut h);
    bytes[..256].copy_from_slice(&h.encode());
    let e = parse(&bytes).expect_err("edited header must fail");
    (e.status, e.field)
}

/// One change to a header.
type HeaderEdit = fn(&mut Header);

fn fmt(edit: impl FnOnce(&mut Header)) -> String {
    let (s, f) = status_with(&tiny_header(), &[], edit);
    assert_eq!(s, Status::Format, "field {f}");
    f
}

fn shape(edit: impl FnOnce(&mut Header)) -> String {
    let (s, f) = status_with(&tiny_header(), &[], edit);
    assert_eq!(s, Status::Shape, "field {f}");
    f
}

#[test]
fn tiny_layout_in_spec_order() {
    let h = tiny_header();
    let d = validate(&h).unwrap();
    let l = Layout::new(&h, &d, &[]).unwrap();
    let names: Vec<String> = l.tensors.iter().map(|t| t.name.to_string()).collect();
    let mut want = vec!["tok_emb".to_string()];
    for i in 0..2 {
        for n in [
            "attn_norm",
            "wq",
            "wk",
            "wv",
            "wo",
            "ffn_norm",
            "w1",
            "w2",
            "w3",
        ] {
            want.push(format!("layers.{i}.{n}"));
        }
    }
    want.push("final_norm".into());
    want.push("wcls".into());
    assert_eq!(names, want);
    let mut pos = 256;
    for t in &l.tensors {
        assert_eq!(t.offset % 64, 0);
        assert_eq!(t.offset, pos, "{}", t.name);
        pos = align_up(t.offset + t.bytes).unwrap();
        if let Kind::Mat {
            d_offset,
            d_bytes,
            rows,
            cols,
            ..
        } = t.kind
        {
            assert_eq!(d_offset, pos);
            assert_eq!(d_bytes, (rows * cols / 32 * 4) as u64);
            pos = align_up(d_offset + d_bytes).unwrap();
        }
    }
    // tok_emb: 96 × 64 int8 at 256, then 192 f32 scales.
    assert_eq!(l.tensors[0].bytes, 96 * 64);
    assert_eq!(
        l.tensors[1].offset,
        align_up(256 + 96 * 64 + align_up(96 * 2 * 4).unwrap()).unwrap()
    );
}

#[test]
fn every_optional_array() {
    let mut h = tiny_header();
    h.wtype = wtype::Q4_0;
    h.q8_mask = q8_class::WV | q8_class::TOK_EMB;
    h.qkv_bias = 1;
    h.qk_norm = 1;
    h.attn_gate = 1;
    h.post_norms = 1;
    h.shared_classifier = 1;
    h.scale_f16 = 1;
    h.layer_flags = 1;
    h.rope_local_theta = 10000.0;
    linear_dims(&mut h);
    let flags = [
        layer_flag::LINEAR,
        layer_flag::SLIDING | layer_flag::LOCAL_ROPE,
    ];
    let bytes = valid_file(&h, &flags);
    let m = Mlb::from_bytes(&bytes).unwrap();
    let l = m.layout();
    let names: Vec<String> = l.tensors.iter().map(|t| t.name.to_string()).collect();
    let want: Vec<&str> = vec![
        "layer_flags",
        "tok_emb",
        "layers.0.attn_norm",
        "layers.0.lqkv",
        "layers.0.lz",
        "layers.0.lb",
        "layers.0.la",
        "layers.0.lconv",
        "layers.0.dt_bias",
        "layers.0.A_log",
        "layers.0.lnorm",
        "layers.0.lout",
        "layers.0.ffn_norm",
        "layers.0.w1",
        "layers.0.w2",
        "layers.0.w3",
        "layers.0.post_attn_norm",
        "layers.0.post_ffn_norm",
        "layers.1.attn_norm",
        "layers.1.wq",
        "layers.1.wk",
        "layers.1.wv",
        "layers.1.wo",
        "layers.1.wg",
        "layers.1.bq",
        "layers.1.bk",
        "layers.1.bv",
        "layers.1.q_norm",
        "layers.1.k_norm",
        "layers.1.ffn_norm",
        "layers.1.w1",
        "layers.1.w2",
        "layers.1.w3",
        "layers.1.post_attn_norm",
        "layers.1.post_ffn_norm",
        "final_norm",
    ];
    assert_eq!(names, want);
    let qt = |n: &str| match l.find(n).unwrap().kind {
        Kind::Mat { wtype, .. } => wtype,
        _ => panic!(),
    };
    assert_eq!(qt("tok_emb"), WType::Q8_0);
    assert_eq!(qt("layers.1.wq"), WType::Q4_0);
    assert_eq!(qt("layers.1.wv"), WType::Q8_0);
    assert_eq!(qt("layers.0.lz"), WType::Q8_0);
    assert_eq!(qt("layers.0.lb"), WType::Q8_0);
    assert_eq!(qt("layers.0.lqkv"), WType::Q4_0);
    // lqkv: 2·K·dk + V·dv = 2·2·16 + 4·16 rows; lconv that many × 4 taps.
    match l.find("layers.0.lqkv").unwrap().kind {
        Kind::Mat { rows, cols, .. } => assert_eq!((rows, cols), (128, 64)),
        _ => panic!(),
    }
    assert_eq!(m.f32s(l.layers[0].attn_norm).len(), 64);
    assert!(matches!(l.layers[0].mixer, Mixer::Linear(_)));
    assert_eq!(l.wcls, l.tok_emb);
    // f16 scales are converted once: dequantized rows come out finite.
    let e = m.mat(l.tok_emb);
    let mut row = vec![0.0; 64];
    krafla::quant::dequant_mat_row(&e, 3, &mut row);
    assert!(row.iter().all(|v| v.is_finite()) && row.iter().any(|&v| v != 0.0));
    assert_eq!(m.layer_flags(1), 3);
    // With a shared classifier, the wcls bit alone makes tok_emb Q8_0.
    let mut h2 = h;
    h2.q8_mask = q8_class::WCLS;
    let d2 = validate(&h2).unwrap();
    let l2 = Layout::new(&h2, &d2, &flags).unwrap();
    assert!(matches!(
        l2.tensors[l2.tok_emb].kind,
        Kind::Mat {
            wtype: WType::Q8_0,
            ..
        }
    ));
}

#[test]
fn writer_is_deterministic_and_roundtrips() {
    let h = tiny_header();
    let a = valid_file(&h, &[]);
    assert_eq!(a, valid_file(&h, &[]));
    let p = parse(&a).unwrap();
    assert_eq!(p.header, h);
    // Dropping the optional padding after the last array still loads.
    let end = p.layout.end as usize;
    assert!(parse(&a[..end]).is_ok());
    assert_eq!(parse(&a[..end - 1]).unwrap_err().status, Status::Format);
}

// One test per row of the error table.

#[test]
fn err_empty_and_short() {
    assert_eq!(parse(&[]).unwrap_err().status, Status::Format);
    let f = valid_file(&tiny_header(), &[]);
    assert_eq!(parse(&f[..255]).unwrap_err().status, Status::Format);
}

/// One bad field on the tiny header: ML_E_FORMAT, naming the field.
#[test]
fn err_single_fields() {
    // Magic, version and the enumerations.
    assert_eq!(fmt(|h| h.magic = *b"MLB2"), "magic");
    assert_eq!(fmt(|h| h.version = 2), "version");
    assert_eq!(fmt(|h| h.wtype = 23), "wtype");
    assert_eq!(fmt(|h| h.wtype = 129), "wtype");
    assert_eq!(fmt(|h| h.wtype = 0), "wtype");
    assert_eq!(fmt(|h| h.rope_type = 5), "rope_type");
    assert_eq!(fmt(|h| h.act = 2), "act");
    assert_eq!(fmt(|h| h.q8_mask = 4), "q8_mask");
    // The 0-or-1 fields.
    assert_eq!(fmt(|h| h.qkv_bias = 3), "qkv_bias");
    assert_eq!(fmt(|h| h.qk_norm = 3), "qk_norm");
    assert_eq!(fmt(|h| h.attn_sinks = 2), "attn_sinks");
    assert_eq!(fmt(|h| h.layer_flags = 2), "layer_flags");
    assert_eq!(fmt(|h| h.post_norms = 5), "post_norms");
    assert_eq!(fmt(|h| h.scale_f16 = 2), "scale_f16");
    assert_eq!(fmt(|h| h.attn_gate = 2), "attn_gate");
    assert_eq!(fmt(|h| h.pooling = 4), "pooling");
    // Scales, caps and bases: finite and not negative; the sliding window at most 2^24.
    assert_eq!(fmt(|h| h.embed_scale = -1.0), "embed_scale");
    assert_eq!(fmt(|h| h.attn_scale = f32::INFINITY), "attn_scale");
    assert_eq!(fmt(|h| h.attn_softcap = f32::NAN), "attn_softcap");
    assert_eq!(fmt(|h| h.final_softcap = -0.5), "final_softcap");
    assert_eq!(fmt(|h| h.rope_local_theta = -1.0), "rope_local_theta");
    assert_eq!(fmt(|h| h.sliding_window = (1 << 24) + 1), "sliding_window");
    assert_eq!(fmt(|h| h.norm_eps = -1e-5), "norm_eps");
}

#[test]
fn err_rope_parameters() {
    fn plain(_: &mut Header) {}
    fn llama3(h: &mut Header) {
        llama3_rope(h, 8192);
    }
    fn linear(h: &mut Header) {
        h.rope_type = rope_type::LINEAR;
    }
    fn yarn(h: &mut Header) {
        yarn_rope(h, 4096, 1.1);
    }
    for base in [llama3 as HeaderEdit, yarn] {
        let mut ok = tiny_header();
        base(&mut ok);
        assert!(validate(&ok).is_ok());
    }
    // A valid RoPE setting, one bad value on top of it, the field the error names.
    let rows: [(HeaderEdit, HeaderEdit, &str); 10] = [
        (llama3, |h| h.rope_factor = 0.0, "rope_factor"),
        (
            llama3,
            |h| h.rope_low_freq_factor = -1.0,
            "rope_low_freq_factor",
        ),
        (
            llama3,
            |h| h.rope_high_freq_factor = 1.0,
            "rope_high_freq_factor",
        ),
        (llama3, |h| h.rope_orig_max_seq = 0, "rope_orig_max_seq"),
        (linear, |h| h.rope_factor = f32::NAN, "rope_factor"),
        (
            yarn,
            |h| h.rope_high_freq_factor = 0.0,
            "rope_high_freq_factor",
        ),
        (
            yarn,
            |h| h.rope_low_freq_factor = 0.5,
            "rope_low_freq_factor",
        ),
        (yarn, |h| h.rope_attn_factor = 0.0, "rope_attn_factor"),
        (plain, |h| h.rope_attn_factor = 1.0, "rope_attn_factor"),
        (plain, |h| h.rope_theta = 0.0, "rope_theta"),
    ];
    for (i, (base, bad, field)) in rows.into_iter().enumerate() {
        let got = fmt(|h| {
            base(h);
            bad(h)
        });
        assert_eq!(got, field, "row {i}");
    }
}

#[test]
fn err_layer_flags() {
    let mut base = tiny_header();
    base.layer_flags = 1;
    base.rope_local_theta = 10000.0;
    let mut bytes = valid_file(&base, &[0, 0]);
    let mut try_flags = |f: u8| {
        bytes[256] = f;
        let e = parse(&bytes).unwrap_err();
        (e.status, e.field)
    };
    assert_eq!(try_flags(16), (Status::Format, "layer_flags[0]".into()));
    assert_eq!(
        try_flags(layer_flag::LOCAL_ROPE | layer_flag::NO_ROPE).0,
        Status::Format
    );
    assert_eq!(
        try_flags(layer_flag::LINEAR | layer_flag::SLIDING).0,
        Status::Format
    );
    // A local-RoPE layer without a local base.
    let mut b = valid_file(&base, &[layer_flag::LOCAL_ROPE, 0]);
    let mut h = base;
    h.rope_local_theta = 0.0;
    b[..256].copy_from_slice(&h.encode());
    assert_eq!(parse(&b).unwrap_err().status, Status::Format);
    // Flag bytes cut off.
    let b = valid_file(&base, &[0, 0]);
    assert_eq!(parse(&b[..257]).unwrap_err().status, Status::Format);
}

/// A MoE layer's arrays sit in the order of docs/file-format.md, stacked by expert, and
/// OLMoE's whole-projection q/k norms, gpt-oss's o bias and sinks take their sizes.
#[test]
fn moe_layout_in_spec_order() {
    let mut h = tiny_header();
    synth::tiny_moe(&mut h);
    h.qkv_bias = 2;
    h.qk_norm = 2;
    h.attn_sinks = 1;
    let f = valid_file(&h, &[0, layer_flag::MOE]);
    let p = parse(&f).unwrap();
    let names: Vec<String> = p
        .layout
        .tensors
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    let l1: Vec<&str> = names
        .iter()
        .filter_map(|n| n.strip_prefix("layers.1."))
        .collect();
    assert_eq!(
        l1,
        [
            "attn_norm",
            "wq",
            "wk",
            "wv",
            "wo",
            "bq",
            "bk",
            "bv",
            "bo",
            "q_norm",
            "k_norm",
            "sinks",
            "ffn_norm",
            "router",
            "router_b",
            "ew1",
            "ew2",
            "ew3",
            "eb1",
            "eb2",
            "eb3",
            "sw1",
            "sw2",
            "sw3",
            "sgate"
        ]
    );
    let t = |n: &str| *p.layout.find(n).unwrap();
    let mat = |n: &str| match t(n).kind {
        Kind::Mat { rows, cols, .. } => (rows, cols),
        k => panic!("{n}: {k:?}"),
    };
    let len = |n: &str| match t(n).kind {
        Kind::F32 { len } => len,
        k => panic!("{n}: {k:?}"),
    };
    assert_eq!(mat("layers.1.ew1"), (4 * 32, 64));
    assert_eq!(mat("layers.1.ew2"), (4 * 64, 32));
    assert_eq!(mat("layers.1.sw2"), (64, 32));
    assert_eq!(len("layers.1.router"), 4 * 64);
    assert_eq!(len("layers.1.eb2"), 4 * 64);
    assert_eq!(len("layers.0.q_norm"), 64);
    assert_eq!(len("layers.0.k_norm"), 32);
    assert_eq!(len("layers.0.sinks"), 4);
    assert_eq!(len("layers.0.bo"), 64);
    // Layer 0 stays dense.
    assert!(p.layout.layers[0].dense().is_some());
    assert!(matches!(p.layout.layers[1].ffn, layout::Ffn::Moe(_)));
}

/// The MoE fields' rules, one per row.
#[test]
fn err_moe_fields() {
    let mut base = tiny_header();
    synth::tiny_moe(&mut base);
    let flags = [0, layer_flag::MOE];
    let moe = |edit: HeaderEdit| status_with(&base, &flags, edit);
    use Status::{Format, Shape};
    // One bad value on the MoE header, the status and the field the error names.
    let rows: [(HeaderEdit, Status, &str); 13] = [
        (|h| h.n_experts = 1, Shape, "n_experts"),
        (|h| h.n_experts = 1025, Shape, "n_experts"),
        (|h| h.n_experts_used = 0, Shape, "n_experts_used"),
        (|h| h.n_experts_used = 5, Shape, "n_experts_used"),
        (|h| h.expert_hidden = 48, Shape, "expert_hidden"),
        (|h| h.expert_hidden = 0, Shape, "expert_hidden"),
        (|h| h.shared_hidden = 40, Shape, "shared_hidden"),
        (|h| h.moe_gating = 3, Format, "moe_gating"),
        (|h| h.moe_flags = 8, Format, "moe_flags"),
        (
            |h| {
                h.shared_hidden = 0;
                h.moe_flags = 4
            },
            Format,
            "moe_flags",
        ),
        (|h| h.swiglu_limit = -1.0, Format, "swiglu_limit"),
        (|h| h.swiglu_limit = 7.0, Format, "swiglu_alpha"),
        (|h| h.swiglu_alpha = 1.7, Format, "swiglu_alpha"),
    ];
    for (i, (edit, status, field)) in rows.into_iter().enumerate() {
        assert_eq!(moe(edit), (status, field.into()), "row {i}");
    }
    // Without experts every MoE field is zero, and no layer is flagged 16.
    assert_eq!(fmt(|h| h.moe_gating = 1), "moe_gating");
    assert_eq!(fmt(|h| h.swiglu_alpha = 1.0), "swiglu_alpha");
    let mut dense = tiny_header();
    dense.layer_flags = 1;
    let mut b = valid_file(&dense, &[0, 0]);
    b[257] = layer_flag::MOE;
    assert_eq!(parse(&b).unwrap_err().field, "layer_flags[1]");
    // Experts but no MoE layer, or no layer flags at all.
    let mut b = valid_file(&base, &flags);
    b[257] = 0;
    assert_eq!(parse(&b).unwrap_err().field, "layer_flags");
    assert_eq!(moe(|h| h.layer_flags = 0).1, "layer_flags");
}

#[test]
fn err_file_shorter_than_arrays() {
    let f = valid_file(&tiny_header(), &[]);
    let e = parse(&f[..f.len() / 2]).unwrap_err();
    assert_eq!(e.status, Status::Format);
    assert!(e.rule.contains("shorter"), "{e}");
}

#[test]
fn err_q8_quant_minus_128() {
    let h = tiny_header();
    let mut f = valid_file(&h, &[]);
    let p = parse(&f).unwrap();
    let wv = p.layout.find("layers.1.wv").unwrap().offset as usize;
    f[wv + 5] = 0x80;
    let e = parse(&f).unwrap_err();
    assert_eq!(
        (e.status, e.field.as_str()),
        (Status::Format, "layers.1.wv")
    );
    // In a Q4_0 matrix the same byte is two valid nibbles.
    let mut h4 = h;
    h4.wtype = wtype::Q4_0;
    let mut f = valid_file(&h4, &[]);
    let p = parse(&f).unwrap();
    let wv = p.layout.find("layers.1.wv").unwrap().offset as usize;
    f[wv + 5] = 0x80;
    assert!(parse(&f).is_ok());
}

#[test]
fn err_shapes() {
    // One bad value on the tiny header, the field the error names.
    let rows: [(HeaderEdit, &str); 21] = [
        (|h| h.dim = 0, "dim"),
        (|h| h.n_layers = 65537, "n_layers"),
        (|h| h.n_heads = 0, "n_heads"),
        (|h| h.n_kv_heads = 0, "n_kv_heads"),
        (|h| h.hidden_dim = 0, "hidden_dim"),
        (|h| h.vocab = (1 << 24) + 1, "vocab"),
        (|h| h.max_seq = 0, "max_seq"),
        (|h| h.dim = 48, "dim"),
        (|h| h.hidden_dim = 100, "hidden_dim"),
        (|h| h.n_heads = 3, "n_kv_heads"),
        (
            |h| {
                h.n_heads = 3;
                h.n_kv_heads = 1
            },
            "n_heads",
        ),
        (|h| h.n_kv_heads = 3, "n_kv_heads"),
        // dim 64 over 32 heads gives head_dim 2 and q_dim 64: fine; 64 heads gives 1 (odd).
        (
            |h| {
                h.n_heads = 64;
                h.n_kv_heads = 64
            },
            "head_dim",
        ),
        (|h| h.head_dim = 7, "head_dim"),
        // head_dim 12 × 4 heads = 48: not a multiple of 32.
        (|h| h.head_dim = 12, "q_dim"),
        (|h| h.head_dim = 32768, "q_dim"),
        (|h| h.vocab = 2, "vocab"),
        (|h| h.rot_dim = 3, "rot_dim"),
        (|h| h.rot_dim = 18, "rot_dim"),
        (|h| h.lin_v_heads = 4, "lin_v_heads"),
        (
            |h| {
                linear_dims(h);
                h.lin_v_heads = 6;
            },
            "lin_v_heads",
        ),
    ];
    for (i, (edit, field)) in rows.into_iter().enumerate() {
        assert_eq!(shape(edit), field, "row {i}");
    }
}

#[test]
fn sizes_past_32_bits_refused_on_a_32_bit_target() {
    // 2^24 × 65536 int8 = 2^40 bytes of tok_emb: beyond 32 bits, fine in 64.
    let mut h = tiny_header();
    h.vocab = 1 << 24;
    h.dim = 65536;
    h.hidden_dim = 65536;
    h.n_heads = 512;
    h.n_kv_heads = 512;
    h.n_layers = 65536;
    let d = validate(&h).unwrap();
    let e = Layout::with_limit(&h, &d, &[], u32::MAX as u64).unwrap_err();
    assert_eq!(e.status, Status::Shape);
    assert_eq!(e.field, "tok_emb");
    // On 64 bits the size is computed exactly (no overflow) and compared with the file,
    // without allocating the per-layer table first.
    let end = Layout::end_offset(&h, &d, &[], &[], u64::MAX).unwrap();
    assert!(end > 1 << 40);
    let mut bytes = vec![0u8; 4096];
    bytes[..256].copy_from_slice(&h.encode());
    let e = parse(&bytes).unwrap_err();
    assert_eq!(e.status, Status::Format);
    let e = parse_limited(&bytes, u32::MAX as u64).unwrap_err();
    assert_eq!(e.status, Status::Shape);
}

#[test]
fn checked_arithmetic_helpers() {
    assert_eq!(align_up(u64::MAX), None);
    assert_eq!(align_up(u64::MAX - 63), Some(u64::MAX - 63));
    assert_eq!(align_up(65), Some(128));
    assert!(to_usize_limited(1 << 32, u32::MAX as u64, "x").is_err());
    assert_eq!(
        to_usize_limited(u32::MAX as u64, u32::MAX as u64, "x").unwrap(),
        u32::MAX as usize
    );
    assert!(to_usize_limited(u64::MAX, u64::MAX, "x").is_ok() == (usize::MAX as u64 == u64::MAX));
}

#[test]
fn quantize_is_thread_count_independent() {
    use krafla::quant::{quantize, QuantOptions};
    let mut rng = krafla::rng::Rng(99);
    let x = rng.vec(257 * 96);
    let run = |threads: usize, qt: WType| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| quantize(qt, 257, 96, &x, &QuantOptions::default()).unwrap())
    };
    for qt in [WType::Q8_0, WType::Q4_0] {
        assert_eq!(run(1, qt), run(2, qt));
        assert_eq!(run(1, qt), run(3, qt));
    }
}

// ---------------------------------------------------------------- Krafla weight types

use krafla::format::mlb::layout::mat_bytes;
use krafla::format::mlb::writer::MlbWriter;
use krafla::format::mlb::{Geometry, TensorName};
use krafla::synth::synth_mixed;

/// main at 09aeb59 (before BF16/F16) checked `wtype` with exactly this rule, first
/// among the header's enums, and refused anything else with ML_E_FORMAT ("must be 1
/// (Q8_0) or 2 (Q4_0)"): a reader of that version refuses BF16, F16 and mixed files.
fn wtype_accepted_by_krafla_0_9(v: u32) -> bool {
    v == wtype::Q8_0 || v == wtype::Q4_0
}

#[test]
fn wtype_values_known_reserved_and_refused() {
    for v in 0..=300u32 {
        let mut h = tiny_header();
        h.wtype = v;
        let ok = validate(&h).is_ok();
        assert_eq!(ok, (1..=22).contains(&v) || v == 128, "wtype {v}");
        if !ok {
            let e = validate(&h).unwrap_err();
            assert_eq!((e.status, e.field.as_str()), (Status::Format, "wtype"));
            if (23..=31).contains(&v) {
                assert!(e.rule.contains("reserved"), "{e}");
            }
        }
        // The extensions are exactly the values the previous reader refused.
        if (3..=22).contains(&v) || v == 128 {
            assert!(!wtype_accepted_by_krafla_0_9(v));
        }
    }
    // A real BF16 file carries 3 at offset 44.
    let mut h = tiny_header();
    h.wtype = wtype::BF16;
    let f = valid_file(&h, &[]);
    let v = u32::from_le_bytes(f[44..48].try_into().unwrap());
    assert_eq!(v, 3);
    assert!(!wtype_accepted_by_krafla_0_9(v));
}

#[test]
fn bf16_and_f16_layout_view_and_round_trip() {
    for (code, t) in [(wtype::BF16, WType::BF16), (wtype::F16, WType::F16)] {
        let mut h = tiny_header();
        h.wtype = code;
        let bytes = valid_file(&h, &[]);
        let m = Mlb::from_bytes(&bytes).unwrap();
        let l = m.layout();
        let mut pos = 256;
        for (i, ten) in l.tensors.iter().enumerate() {
            assert_eq!(ten.offset, pos, "{}", ten.name);
            if let Kind::Mat {
                wtype,
                rows,
                cols,
                d_offset,
                d_bytes,
                ..
            } = ten.kind
            {
                // One array of rows × cols 2-byte floats, no scales.
                assert_eq!(wtype, t);
                assert_eq!(ten.bytes, (rows * cols * 2) as u64);
                assert_eq!((d_offset, d_bytes), (ten.offset + ten.bytes, 0));
                assert_eq!(m.mat_type(i), Some(t));
                let hm = m.mat_half(i).unwrap();
                assert_eq!((hm.rows, hm.cols, hm.w.len()), (rows, cols, rows * cols));
                let at = hm.w.as_ptr() as usize - m.bytes().as_ptr() as usize;
                assert_eq!(at as u64, ten.offset);
                // The bits are the file's bytes; dequantizing widens them.
                let at = ten.offset as usize;
                assert_eq!(
                    hm.w[5],
                    u16::from_le_bytes([bytes[at + 10], bytes[at + 11]])
                );
                let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
                hm.dequant_row(rows - 1, &mut a);
                krafla::quant::dequant_mat_row(&m.mat(i), rows - 1, &mut b);
                assert_eq!(a, b);
                assert!(a.iter().all(|v| v.is_finite() && v.abs() <= 1.0));
                assert!(m.mat_f16(i).is_none());
            } else {
                assert_eq!(m.mat_type(i), None);
                assert!(m.mat_half(i).is_none());
            }
            pos = align_up(ten.end()).unwrap();
        }
        assert_eq!(m.layout().end, bytes.len() as u64);
        // Deterministic; truncating the last array fails.
        assert_eq!(bytes, valid_file(&h, &[]));
        assert_eq!(
            parse(&bytes[..bytes.len() - 1]).unwrap_err().status,
            Status::Format
        );
    }
    // Q8_0 matrices are not half views.
    let m = Mlb::from_bytes(&valid_file(&tiny_header(), &[])).unwrap();
    assert!(m.mat_half(m.layout().tok_emb).is_none());
}

#[test]
fn bf16_stores_linear_attention_lb_la_as_bf16() {
    // A lossless original: in a uniform BF16 file lb and la are BF16 too (Q8_0 only
    // in a Q4_0 model, where the spec keeps them at 8 bits).
    let mut h = tiny_header();
    h.wtype = wtype::BF16;
    h.layer_flags = 1;
    linear_dims(&mut h);
    let m = Mlb::from_bytes(&valid_file(&h, &[layer_flag::LINEAR, 0])).unwrap();
    for n in ["layers.0.lb", "layers.0.la", "layers.0.lqkv", "tok_emb"] {
        let t = m.layout().find(n).unwrap();
        assert!(
            matches!(
                t.kind,
                Kind::Mat {
                    wtype: WType::BF16,
                    ..
                }
            ),
            "{n}"
        );
    }
}

#[test]
fn err_q8_mask_and_scale_f16_without_meaning() {
    for code in [wtype::Q8_0, wtype::BF16, wtype::F16, wtype::MIXED] {
        let mut h = tiny_header();
        h.wtype = code;
        h.q8_mask = q8_class::WCLS;
        let e = validate(&h).unwrap_err();
        assert_eq!((e.status, e.field.as_str()), (Status::Format, "q8_mask"));
    }
    for code in [wtype::BF16, wtype::F16] {
        let mut h = tiny_header();
        h.wtype = code;
        h.scale_f16 = 1;
        let e = validate(&h).unwrap_err();
        assert_eq!((e.status, e.field.as_str()), (Status::Format, "scale_f16"));
    }
    // In a mixed file scale_f16 applies to its Q8_0 / Q4_0 matrices.
    let mut h = tiny_header();
    h.wtype = wtype::MIXED;
    h.scale_f16 = 1;
    assert!(validate(&h).is_ok());
}

/// The matrix types of a layout, in array order.
fn mat_types(l: &Layout) -> Vec<WType> {
    l.tensors
        .iter()
        .filter_map(|t| match t.kind {
            Kind::Mat { wtype, .. } => Some(wtype),
            _ => None,
        })
        .collect()
}

fn mixed_header() -> Header {
    let mut h = tiny_header();
    h.wtype = wtype::MIXED;
    h
}

#[test]
fn mixed_type_table_position_and_types() {
    use WType::*;
    // tok_emb, 2 × (wq wk wv wo w1 w2 w3), wcls: 16 matrices.
    let h = mixed_header();
    let d = validate(&h).unwrap();
    assert_eq!(Layout::matrix_count(&h, &d, &[]).unwrap(), 16);
    let mut types = vec![BF16; 16];
    types[0] = Q8_0; // tok_emb
    types[2] = F16; // layers.0.wk
    types[8] = Q4_0; // layers.1.wq
    types[15] = Q8_0; // wcls
    let bytes = synth_mixed(&h, &[], &types, 5);
    let m = Mlb::from_bytes(&bytes).unwrap();
    let l = m.layout();
    // The table right after the header: one byte per matrix, padded to 64.
    let tt = &l.tensors[l.type_table.unwrap()];
    assert_eq!(
        (tt.name.to_string().as_str(), tt.offset, tt.bytes),
        ("type_table", 256, 16)
    );
    assert_eq!(Layout::type_table_offset(&h, &d), 256);
    let codes: Vec<u8> = types.iter().map(|t| t.code() as u8).collect();
    assert_eq!(&bytes[256..272], &codes[..]);
    assert!(bytes[272..320].iter().all(|&b| b == 0));
    assert_eq!(l.tensors[l.tok_emb].offset, 320);
    assert_eq!(mat_types(l), types);
    assert!(matches!(
        l.find("layers.0.wk").unwrap().kind,
        Kind::Mat {
            wtype: F16,
            d_bytes: 0,
            ..
        }
    ));
    assert!(matches!(
        l.find("layers.1.wq").unwrap().kind,
        Kind::Mat {
            wtype: Q4_0,
            d_bytes: 512,
            ..
        }
    ));
    assert!(m.mat_half(l.tok_emb).is_none());
    assert!(m.mat_half(l.layers[0].dense().unwrap().0).is_some());

    // With layer flags, a shared classifier and linear layers: the table follows the
    // flags, and counts tok_emb, 8 + 7 (+ wg) layer matrices and no wcls.
    let mut h = mixed_header();
    h.layer_flags = 1;
    h.shared_classifier = 1;
    h.attn_gate = 1;
    h.scale_f16 = 1;
    linear_dims(&mut h);
    let flags = [layer_flag::LINEAR, 0];
    let d = validate(&h).unwrap();
    assert_eq!(Layout::matrix_count(&h, &d, &flags).unwrap(), 1 + 8 + 8);
    assert_eq!(Layout::type_table_offset(&h, &d), 320);
    let types: Vec<WType> = (0..17).map(|i| WType::ALL[i % 4]).collect();
    let bytes = synth_mixed(&h, &flags, &types, 6);
    let m = Mlb::from_bytes(&bytes).unwrap();
    let l = m.layout();
    assert_eq!(l.tensors[l.type_table.unwrap()].offset, 320);
    assert_eq!(mat_types(l), types);
    // lb (entry 3) takes the table's type like any matrix; f16 scales where there are scales.
    assert!(matches!(
        l.find("layers.0.lb").unwrap().kind,
        Kind::Mat { wtype: F16, .. }
    ));
    assert!(matches!(
        l.find("layers.0.lz").unwrap().kind,
        Kind::Mat {
            wtype: BF16,
            d_bytes: 0,
            ..
        }
    ));
    match l.find("layers.0.lqkv").unwrap().kind {
        Kind::Mat {
            wtype,
            rows,
            cols,
            d_bytes,
            ..
        } => {
            assert_eq!(wtype, Q4_0);
            assert_eq!(d_bytes, (rows * cols / 32 * 2) as u64);
        }
        _ => panic!(),
    }
}

#[test]
fn err_mixed_type_table() {
    let h = mixed_header();
    let types = vec![WType::BF16; 16];
    let good = synth_mixed(&h, &[], &types, 7);
    assert!(parse(&good).is_ok());
    // An entry that is not a concrete type names the tensor.
    for (entry, code, tensor) in [
        (0, 0u8, "tok_emb"),
        (3, 23, "layers.0.wv"),
        (9, 128, "layers.1.wk"),
        (15, 255, "wcls"),
    ] {
        let mut b = good.clone();
        b[256 + entry] = code;
        let e = parse(&b).unwrap_err();
        assert_eq!(
            (e.status, e.field.as_str()),
            (Status::Format, tensor),
            "{e}"
        );
        assert!(e.rule.contains(&format!("entry {entry}")), "{e}");
    }
    // An entry changed to a type of another size: the arrays no longer fit the file.
    let mut b = good.clone();
    b[256] = WType::Q8_0.code() as u8;
    assert_eq!(parse(&b).unwrap_err().status, Status::Format);
    // A file that ends inside the table (parse_limited: parse refuses so short a
    // file for its layer count first).
    let e = parse_limited(&good[..256 + 8], u64::MAX).unwrap_err();
    assert_eq!((e.status, e.field.as_str()), (Status::Format, "type_table"));
    // The writer wants one type per matrix, and a table only with wtype 128.
    let e = MlbWriter::new_mixed(Vec::new(), &h, &[], &types[..15])
        .err()
        .unwrap();
    assert!(e.to_string().contains("16 matrices"), "{e}");
    assert!(MlbWriter::new(Vec::new(), &h, &[]).is_err());
    let e = MlbWriter::new_mixed(Vec::new(), &tiny_header(), &[], &types)
        .err()
        .unwrap();
    assert!(e.to_string().contains("wtype"), "{e}");
    let d = validate(&h).unwrap();
    let e = Layout::with_table(&tiny_header(), &d, &[], &[1, 2], u64::MAX).unwrap_err();
    assert_eq!(e.field, "type_table");
}

#[test]
fn mixed_file_holds_the_same_arrays_as_q8_mask() {
    // A Q4_0 model with q8_mask and the mixed file with the same types: every array
    // has the same bytes (only the header and the table differ).
    let mut q4 = tiny_header();
    q4.wtype = wtype::Q4_0;
    q4.q8_mask = q8_class::WV | q8_class::TOK_EMB;
    let a = Mlb::from_bytes(&valid_file(&q4, &[])).unwrap();
    let types = mat_types(a.layout());
    let b = Mlb::from_bytes(&synth_mixed(&mixed_header(), &[], &types, 7)).unwrap();
    let (la, lb) = (a.layout(), b.layout());
    let shift = lb.tensors[lb.tok_emb].offset - la.tensors[la.tok_emb].offset;
    assert_eq!(shift, 64);
    let arrays = |m: &Mlb, t: &krafla::format::mlb::layout::Tensor| {
        m.bytes()[t.offset as usize..t.end() as usize].to_vec()
    };
    for (ta, tb) in la.tensors.iter().zip(lb.tensors.iter().skip(1)) {
        assert_eq!(ta.name, tb.name);
        assert_eq!(tb.offset, ta.offset + shift);
        assert_eq!(arrays(&a, ta), arrays(&b, tb), "{}", ta.name);
    }
}

#[test]
fn layout_follows_the_geometry_alone() {
    // A super-block type (256 weights per 144-byte block, scales inside, one array)
    // needs nothing but its geometry: sizes, and columns in whole blocks (ML_E_SHAPE
    // naming the tensor otherwise).
    let name = TensorName {
        layer: Some(3),
        name: "w2",
    };
    let sb = Geometry {
        block_weights: 256,
        block_bytes: 144,
        scale_array: false,
    };
    assert_eq!(
        mat_bytes(name, "Q4_K", sb, 10, 512, false).unwrap(),
        (10 * 2 * 144, 0)
    );
    let e = mat_bytes(name, "Q4_K", sb, 10, 576, false).unwrap_err();
    assert_eq!((e.status, e.field.as_str()), (Status::Shape, "layers.3.w2"));
    assert!(e.rule.contains("256"), "{e}");
    assert_eq!(
        mat_bytes(name, "Q8_0", WType::Q8_0.geometry(), 2, 64, true).unwrap(),
        (128, 8)
    );
    assert!(mat_bytes(name, "X", sb, u64::MAX / 2, 512, false).is_err());
}

#[test]
fn mutated_bf16_and_mixed_files_load_or_fail_with_a_status() {
    // Every byte of the header, the layer flags and the type table set to edge values:
    // the file loads (and every matrix can be read) or fails with a status, never a
    // panic or an out-of-bounds read.
    let bf16 = {
        let mut h = tiny_header();
        h.wtype = wtype::BF16;
        (valid_file(&h, &[]), 256)
    };
    let mixed = {
        let mut h = mixed_header();
        h.layer_flags = 1;
        h.scale_f16 = 1;
        linear_dims(&mut h);
        let flags = [layer_flag::LINEAR, 0];
        let d = validate(&h).unwrap();
        let n = Layout::matrix_count(&h, &d, &flags).unwrap();
        let types: Vec<WType> = (0..n).map(|i| WType::ALL[(i * 3) % 4]).collect();
        (synth_mixed(&h, &flags, &types, 9), 256 + 64 + n)
    };
    let (mut loaded, mut refused) = (0, 0);
    for (good, end) in [bf16, mixed] {
        assert!(parse(&good).is_ok());
        for pos in 0..end {
            for v in [0u8, 1, 2, 3, 4, 5, 0x7f, 0x80, 0xff, good[pos] ^ 1] {
                let mut b = good.clone();
                b[pos] = v;
                let r = std::panic::catch_unwind(|| match Mlb::from_bytes(&b) {
                    Ok(m) => {
                        for (i, t) in m.layout().tensors.iter().enumerate() {
                            if let Kind::Mat { rows, cols, .. } = t.kind {
                                let mut row = vec![0f32; cols];
                                krafla::quant::dequant_mat_row(&m.mat(i), rows - 1, &mut row);
                                if let Some(h) = m.mat_half(i) {
                                    h.dequant_row(0, &mut row);
                                }
                            }
                        }
                        true
                    }
                    Err(e) => {
                        assert_ne!(e.status, Status::Io);
                        false
                    }
                });
                match r {
                    Ok(true) => loaded += 1,
                    Ok(false) => refused += 1,
                    Err(_) => panic!("byte {pos} = {v:#04x}: panicked"),
                }
            }
        }
    }
    assert!(
        loaded > 100 && refused > 100,
        "{loaded} loaded, {refused} refused"
    );
}
