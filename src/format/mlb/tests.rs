//! Layout, round-trip and one test per row of the spec's error table.

use super::header::{layer_flag, q8_class, rope_type, wtype, Header};
use super::layout::{align_up, to_usize_limited, Kind, Layout, Mixer};
use super::synth::{synth_file, tiny_header};
use super::validate::validate;
use super::view::{parse, parse_limited, Mlb};
use crate::format::error::Status;
use crate::format::WType;

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
    h.lin_k_heads = 2;
    h.lin_v_heads = 4;
    h.lin_k_dim = 16;
    h.lin_v_dim = 16;
    h.lin_conv = 4;
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
    e.dequant_row(3, &mut row);
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

#[test]
fn err_magic_version_enums() {
    assert_eq!(fmt(|h| h.magic = *b"MLB2"), "magic");
    assert_eq!(fmt(|h| h.version = 2), "version");
    assert_eq!(fmt(|h| h.wtype = 3), "wtype");
    assert_eq!(fmt(|h| h.wtype = 0), "wtype");
    assert_eq!(fmt(|h| h.rope_type = 4), "rope_type");
    assert_eq!(fmt(|h| h.act = 2), "act");
    assert_eq!(fmt(|h| h.q8_mask = 4), "q8_mask");
}

#[test]
fn err_rope_parameters() {
    let llama3 = |h: &mut Header| {
        h.rope_type = rope_type::LLAMA3;
        h.rope_factor = 8.0;
        h.rope_low_freq_factor = 1.0;
        h.rope_high_freq_factor = 4.0;
        h.rope_orig_max_seq = 8192;
    };
    let mut ok = tiny_header();
    llama3(&mut ok);
    assert!(validate(&ok).is_ok());
    assert_eq!(
        fmt(|h| {
            llama3(h);
            h.rope_factor = 0.0
        }),
        "rope_factor"
    );
    assert_eq!(
        fmt(|h| {
            llama3(h);
            h.rope_low_freq_factor = -1.0
        }),
        "rope_low_freq_factor"
    );
    assert_eq!(
        fmt(|h| {
            llama3(h);
            h.rope_high_freq_factor = 1.0
        }),
        "rope_high_freq_factor"
    );
    assert_eq!(
        fmt(|h| {
            llama3(h);
            h.rope_orig_max_seq = 0
        }),
        "rope_orig_max_seq"
    );
    assert_eq!(
        fmt(|h| {
            h.rope_type = rope_type::LINEAR;
            h.rope_factor = f32::NAN
        }),
        "rope_factor"
    );
    let yarn = |h: &mut Header| {
        h.rope_type = rope_type::YARN;
        h.rope_factor = 4.0;
        h.rope_low_freq_factor = 32.0;
        h.rope_high_freq_factor = 1.0;
        h.rope_orig_max_seq = 4096;
        h.rope_attn_factor = 1.1;
    };
    let mut ok = tiny_header();
    yarn(&mut ok);
    assert!(validate(&ok).is_ok());
    assert_eq!(
        fmt(|h| {
            yarn(h);
            h.rope_high_freq_factor = 0.0
        }),
        "rope_high_freq_factor"
    );
    assert_eq!(
        fmt(|h| {
            yarn(h);
            h.rope_low_freq_factor = 0.5
        }),
        "rope_low_freq_factor"
    );
    assert_eq!(
        fmt(|h| {
            yarn(h);
            h.rope_attn_factor = 0.0
        }),
        "rope_attn_factor"
    );
    assert_eq!(fmt(|h| h.rope_attn_factor = 1.0), "rope_attn_factor");
    assert_eq!(fmt(|h| h.rope_theta = 0.0), "rope_theta");
}

#[test]
fn err_boolean_fields() {
    assert_eq!(fmt(|h| h.qkv_bias = 2), "qkv_bias");
    assert_eq!(fmt(|h| h.qk_norm = 2), "qk_norm");
    assert_eq!(fmt(|h| h.layer_flags = 2), "layer_flags");
    assert_eq!(fmt(|h| h.post_norms = 5), "post_norms");
    assert_eq!(fmt(|h| h.scale_f16 = 2), "scale_f16");
    assert_eq!(fmt(|h| h.attn_gate = 2), "attn_gate");
}

#[test]
fn err_scales_and_caps() {
    assert_eq!(fmt(|h| h.embed_scale = -1.0), "embed_scale");
    assert_eq!(fmt(|h| h.attn_scale = f32::INFINITY), "attn_scale");
    assert_eq!(fmt(|h| h.attn_softcap = f32::NAN), "attn_softcap");
    assert_eq!(fmt(|h| h.final_softcap = -0.5), "final_softcap");
    assert_eq!(fmt(|h| h.rope_local_theta = -1.0), "rope_local_theta");
    assert_eq!(fmt(|h| h.sliding_window = (1 << 24) + 1), "sliding_window");
    assert_eq!(fmt(|h| h.norm_eps = -1e-5), "norm_eps");
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
    assert_eq!(shape(|h| h.dim = 0), "dim");
    assert_eq!(shape(|h| h.n_layers = 65537), "n_layers");
    assert_eq!(shape(|h| h.n_heads = 0), "n_heads");
    assert_eq!(shape(|h| h.n_kv_heads = 0), "n_kv_heads");
    assert_eq!(shape(|h| h.hidden_dim = 0), "hidden_dim");
    assert_eq!(shape(|h| h.vocab = (1 << 24) + 1), "vocab");
    assert_eq!(shape(|h| h.max_seq = 0), "max_seq");
    assert_eq!(shape(|h| h.dim = 48), "dim");
    assert_eq!(shape(|h| h.hidden_dim = 100), "hidden_dim");
    assert_eq!(shape(|h| h.n_heads = 3), "n_kv_heads");
    assert_eq!(
        shape(|h| {
            h.n_heads = 3;
            h.n_kv_heads = 1
        }),
        "n_heads"
    );
    assert_eq!(shape(|h| h.n_kv_heads = 3), "n_kv_heads");
    // dim 64 over 32 heads gives head_dim 2 and q_dim 64: fine; 64 heads gives 1 (odd).
    assert_eq!(
        shape(|h| {
            h.n_heads = 64;
            h.n_kv_heads = 64
        }),
        "head_dim"
    );
    assert_eq!(shape(|h| h.head_dim = 7), "head_dim");
    // head_dim 12 × 4 heads = 48: not a multiple of 32.
    assert_eq!(shape(|h| h.head_dim = 12), "q_dim");
    assert_eq!(shape(|h| h.head_dim = 32768), "q_dim");
    assert_eq!(shape(|h| h.vocab = 2), "vocab");
    assert_eq!(shape(|h| h.rot_dim = 3), "rot_dim");
    assert_eq!(shape(|h| h.rot_dim = 18), "rot_dim");
    assert_eq!(shape(|h| h.lin_v_heads = 4), "lin_v_heads");
    assert_eq!(
        shape(|h| {
            h.lin_k_heads = 2;
            h.lin_v_heads = 6;
            h.lin_k_dim = 16;
            h.lin_v_dim = 16;
            h.lin_conv = 4
        }),
        "lin_v_heads"
    );
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
    let end = Layout::end_offset(&h, &d, &[], u64::MAX).unwrap();
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
    use crate::quant::{quantize, QuantOpts};
    let mut rng = super::synth::Rng(99);
    let x = rng.vec(257 * 96);
    let run = |threads: usize, qt: WType| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| quantize(qt, 257, 96, &x, &QuantOpts::default()).unwrap())
    };
    for qt in [WType::Q8_0, WType::Q4_0] {
        assert_eq!(run(1, qt), run(2, qt));
        assert_eq!(run(1, qt), run(3, qt));
    }
}
