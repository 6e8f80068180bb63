//! `.mlb` (+ its `.mlt`) → a GGUF file llama.cpp loads (`mlb-export`).
//!
//! The inverse of [`super::gguf_in`], so the round trip `.mlb → GGUF → .mlb` gives the
//! same bytes for f16-scale Q8_0/Q4_0 files: the architecture is named from the header
//! (Gemma 3: post norms and q/k norms; Gemma 2: post norms; Qwen2: q/k/v biases; Qwen3:
//! q/k norms; SmolLM3: no-RoPE layers; otherwise Llama), its fields become llama.cpp's
//! keys, tensors get llama.cpp's names and, for NEOX architectures, Hugging Face's
//! rotate-half row order back. Q8_0/Q4_0 matrices become GGUF blocks (f16 scale, then
//! the quants), F32 arrays stay F32; Llama 3 RoPE becomes llama.cpp's `rope_freqs`
//! factors. What llama.cpp cannot run as the header says (a sliding window on a Llama,
//! an attention scale llama.cpp would compute differently, f32 scales that f16 cannot
//! hold, ...) is refused by field name rather than written wrong.

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use super::error::{ConvertError, Result};
use super::gguf_arch::{self, GgufArch, NoRope, RopeRows, Swa};
use super::gguf_tok;
use super::permute::RowMap;
use crate::atomic::AtomicFile;
use crate::format::gguf::{GgmlType, GgufWriter, MetaValue, TensorSpec, ValueType};
use crate::format::mlb::header::{act, layer_flag, rope_type, wtype};
use crate::format::mlb::{Kind, Mlb, QType, Tensor, WriteError};
use crate::format::mlt::Mlt;
use crate::quant::QK;

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub input: PathBuf,
    /// The tokenizer; `None`: the `.mlt` of the same name beside the model.
    pub tokenizer: Option<PathBuf>,
    /// `None`: `<stem>.gguf` beside the model.
    pub output: Option<PathBuf>,
    /// `general.name`; `None`: the file's stem.
    pub name: Option<String>,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    pub output: PathBuf,
    pub arch: &'static str,
    pub tensors: usize,
    pub file_bytes: u64,
}

fn field(input: &Path, f: &str, v: impl std::fmt::Display, msg: impl Into<String>) -> ConvertError {
    ConvertError::config(input, f, v, msg)
}

/// The GGUF architecture an `.mlb` header describes.
fn arch_of(m: &Mlb) -> &'static GgufArch {
    let h = m.header();
    let flags: Vec<u8> = (0..m.dims().n_layers).map(|l| m.layer_flags(l)).collect();
    let name = if h.post_norms != 0 && h.qk_norm != 0 {
        "gemma3_text"
    } else if h.post_norms != 0 {
        "gemma2"
    } else if h.qkv_bias != 0 {
        "qwen2"
    } else if h.qk_norm != 0 {
        "qwen3"
    } else if flags.iter().any(|f| f & layer_flag::NO_ROPE != 0) {
        "smollm3"
    } else {
        "llama"
    };
    gguf_arch::by_krafla(name).expect("in the table")
}

/// Exports `opts.input`.
pub fn export(opts: &ExportOptions) -> Result<ExportSummary> {
    let input = &opts.input;
    let m = Mlb::open(input).map_err(|e| ConvertError::Format {
        file: input.clone(),
        err: Box::new(e),
    })?;
    let tok_path = opts
        .tokenizer
        .clone()
        .unwrap_or_else(|| input.with_extension("mlt"));
    let mlt = Mlt::load(&tok_path).map_err(|e| {
        ConvertError::checkpoint(
            &tok_path,
            format!("{e} (the tokenizer is needed: pass --tokenizer FILE.mlt)"),
        )
    })?;
    let h = *m.header();
    let d = *m.dims();
    if h.lin_k_heads != 0 || h.attn_gate != 0 {
        return Err(field(input, "lin_k_heads", h.lin_k_heads, "Qwen3.5 (gated attention, delta rule) export is not supported"));
    }
    let ga = arch_of(&m);
    let a = ga.name;
    let key = |k: &str| format!("{a}.{k}");
    let flags: Vec<u8> = (0..d.n_layers).map(|l| m.layer_flags(l)).collect();

    // What llama.cpp computes on its own must be what the header says.
    if h.rot_dim != 0 && h.rot_dim as usize != d.head_dim {
        return Err(field(input, "rot_dim", h.rot_dim, format!("partial rotary cannot be expressed for {a}")));
    }
    let gemma = ga.swa != Swa::None;
    if gemma {
        if h.act != act::GELU_TANH {
            return Err(field(input, "act", h.act, format!("{a} uses GELU (tanh)")));
        }
        if h.embed_scale != (d.dim as f32).sqrt() {
            return Err(field(input, "embed_scale", h.embed_scale, format!("llama.cpp's {a} scales embeddings by sqrt(dim) = {}", (d.dim as f32).sqrt())));
        }
        let big = (ga.swa == Swa::Gemma2 && d.n_layers == 46) || (ga.swa == Swa::Gemma3 && d.n_layers == 62);
        let hd = if big { d.dim / d.n_heads } else { d.head_dim };
        let want = (1.0 / (hd as f64).sqrt()) as f32;
        if h.attn_scale != want {
            return Err(field(input, "attn_scale", h.attn_scale, format!("llama.cpp's {a} computes 1/sqrt({hd}) = {want}")));
        }
        if ga.swa == Swa::Gemma3 && h.attn_softcap != 0.0 {
            return Err(field(input, "attn_softcap", h.attn_softcap, "llama.cpp's gemma3 has no attention softcap"));
        }
    } else {
        for (f, v) in [("embed_scale", h.embed_scale), ("attn_softcap", h.attn_softcap), ("final_softcap", h.final_softcap)] {
            if v != 0.0 && !(f == "embed_scale" && v == 1.0) {
                return Err(field(input, f, v, format!("llama.cpp's {a} has no such factor")));
            }
        }
        if h.attn_scale != 0.0 && h.attn_scale != (1.0 / (d.head_dim as f64).sqrt()) as f32 {
            return Err(field(input, "attn_scale", h.attn_scale, format!("llama.cpp's {a} uses 1/sqrt(head_dim)")));
        }
        if h.act != act::SILU {
            return Err(field(input, "act", h.act, format!("{a} uses SiLU")));
        }
        if flags.iter().any(|f| f & layer_flag::SLIDING != 0) || (h.sliding_window != 0 && h.layer_flags == 0) {
            return Err(field(input, "sliding_window", h.sliding_window, format!("llama.cpp's {a} has no sliding window")));
        }
        if h.qk_norm != 0 && !matches!(a, "qwen3") {
            return Err(field(input, "qk_norm", 1, format!("llama.cpp's {a} has no q/k norm")));
        }
    }
    for (l, &f) in flags.iter().enumerate() {
        let want_no_rope = ga.no_rope == NoRope::Every4th && (l + 1) % 4 == 0;
        if (f & layer_flag::NO_ROPE != 0) != want_no_rope {
            return Err(field(input, &format!("layer_flags[{l}]"), f, format!("llama.cpp's {a} has no RoPE exactly on every fourth layer")));
        }
    }

    // Metadata.
    let mut kv: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        (
            "general.name".into(),
            MetaValue::Str(opts.name.clone().unwrap_or_else(|| {
                input.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
            })),
        ),
        (key("block_count"), MetaValue::U32(h.n_layers)),
        (key("context_length"), MetaValue::U32(h.max_seq)),
        (key("embedding_length"), MetaValue::U32(h.dim)),
        (key("feed_forward_length"), MetaValue::U32(h.hidden_dim)),
        (key("attention.head_count"), MetaValue::U32(h.n_heads)),
        (key("attention.head_count_kv"), MetaValue::U32(h.n_kv_heads)),
        (key("rope.freq_base"), MetaValue::F32(h.rope_theta)),
        (key("attention.layer_norm_rms_epsilon"), MetaValue::F32(h.norm_eps)),
        (key("attention.key_length"), MetaValue::U32(d.head_dim as u32)),
        (key("attention.value_length"), MetaValue::U32(d.head_dim as u32)),
        (key("rope.dimension_count"), MetaValue::U32(d.head_dim as u32)),
        (key("vocab_size"), MetaValue::U32(h.vocab)),
    ];
    let mut rope_freqs = None;
    match h.rope_type {
        rope_type::PLAIN => {}
        rope_type::LINEAR => {
            kv.push((key("rope.scaling.type"), MetaValue::Str("linear".into())));
            kv.push((key("rope.scaling.factor"), MetaValue::F32(h.rope_factor)));
        }
        rope_type::YARN => {
            if h.rope_low_freq_factor != 32.0 || h.rope_high_freq_factor != 1.0 {
                return Err(field(input, "rope_low_freq_factor", h.rope_low_freq_factor, format!("llama.cpp's {a} uses yarn's beta_fast 32 and beta_slow 1 (this file: {} and {})", h.rope_low_freq_factor, h.rope_high_freq_factor)));
            }
            let f = h.rope_factor as f64;
            let mscale = if f <= 1.0 { 1.0 } else { 0.1 * f.ln() + 1.0 };
            // llama.cpp multiplies get_mscale(f) by rope.scaling.attn_factor (default 1).
            let attn = (h.rope_attn_factor as f64 / mscale) as f32;
            if (mscale * attn as f64) as f32 != h.rope_attn_factor {
                return Err(field(input, "rope_attn_factor", h.rope_attn_factor, "not expressible as llama.cpp's yarn attention factor"));
            }
            kv.push((key("rope.scaling.type"), MetaValue::Str("yarn".into())));
            kv.push((key("rope.scaling.factor"), MetaValue::F32(h.rope_factor)));
            kv.push((key("rope.scaling.original_context_length"), MetaValue::U32(h.rope_orig_max_seq)));
            if attn != 1.0 {
                kv.push((key("rope.scaling.attn_factor"), MetaValue::F32(attn)));
            }
        }
        rope_type::LLAMA3 => {
            if ga.rows != RopeRows::Interleaved || gemma {
                return Err(field(input, "rope_type", "llama3", format!("llama.cpp's {a} takes no frequency factors")));
            }
            // llama.cpp's converter: divisor per pair of the head (generate_extra_tensors).
            let (f, lo, hi, orig) = (h.rope_factor as f64, h.rope_low_freq_factor as f64, h.rope_high_freq_factor as f64, h.rope_orig_max_seq as f64);
            let factors: Vec<f32> = (0..d.head_dim / 2)
                .map(|i| {
                    let inv = (h.rope_theta as f64).powf(-2.0 * i as f64 / d.head_dim as f64);
                    let wl = 2.0 * std::f64::consts::PI / inv;
                    if wl < orig / hi {
                        1.0
                    } else if wl > orig / lo {
                        f as f32
                    } else {
                        let s = (orig / wl - lo) / (hi - lo);
                        (1.0 / ((1.0 - s) / f + s)) as f32
                    }
                })
                .collect();
            kv.push((key("rope.scaling.original_context_length"), MetaValue::U32(h.rope_orig_max_seq)));
            rope_freqs = Some(factors);
        }
        t => return Err(field(input, "rope_type", t, "unknown")),
    }
    if gemma {
        let sliding: Vec<bool> = flags.iter().map(|f| f & layer_flag::SLIDING != 0).collect();
        let local: Vec<bool> = flags.iter().map(|f| f & layer_flag::LOCAL_ROPE != 0).collect();
        if ga.swa == Swa::Gemma2 {
            kv.push((key("attn_logit_softcapping"), MetaValue::F32(h.attn_softcap)));
        }
        kv.push((key("final_logit_softcapping"), MetaValue::F32(h.final_softcap)));
        let window = if h.layer_flags == 0 && h.sliding_window != 0 {
            // A window on every layer.
            vec![true; d.n_layers]
        } else {
            sliding.clone()
        };
        let any = window.iter().any(|&s| s) && h.sliding_window != 0;
        if any {
            kv.push((key("attention.sliding_window"), MetaValue::U32(h.sliding_window)));
            kv.push((
                key("attention.sliding_window_pattern"),
                MetaValue::Array(ValueType::Bool, window.iter().map(|&b| MetaValue::Bool(b)).collect()),
            ));
        } else if ga.swa == Swa::Gemma2 {
            // llama.cpp's Gemma 2 always has a window: make it cover no layer.
            kv.push((
                key("attention.sliding_window_pattern"),
                MetaValue::Array(ValueType::Bool, vec![MetaValue::Bool(false); d.n_layers]),
            ));
        }
        // The sliding layers, and only they, use the local base.
        let uses_local = local.iter().any(|&l| l);
        if uses_local && (local != window || !any) {
            return Err(field(input, "layer_flags", format!("{flags:?}"), format!("llama.cpp's {a} uses the local RoPE base on exactly the sliding layers")));
        }
        match (ga.swa, uses_local) {
            (_, true) => kv.push((key("rope.freq_base_swa"), MetaValue::F32(h.rope_local_theta))),
            (Swa::Gemma3, false) if any => {
                return Err(field(input, "rope_local_theta", h.rope_local_theta, "llama.cpp's gemma3 sliding layers use a local RoPE base"));
            }
            _ => {}
        }
        if ga.swa == Swa::Gemma3 && uses_local && h.rope_type != rope_type::PLAIN && h.rope_type != rope_type::LINEAR {
            return Err(field(input, "rope_type", h.rope_type, "gemma3: only linear scaling of the global layers"));
        }
    }
    let ftype = if h.wtype == wtype::Q4_0 { 2 } else { 7 };
    kv.push(("general.file_type".into(), MetaValue::U32(ftype)));
    kv.push(("general.quantization_version".into(), MetaValue::U32(2)));
    let tok = gguf_tok::gguf_tokenizer_kvs(&mlt, a).map_err(|e| ConvertError::checkpoint(&tok_path, e.to_string()))?;
    if mlt.tokens.len() > d.vocab {
        return Err(ConvertError::checkpoint(&tok_path, format!("{} tokens for a model of {} rows", mlt.tokens.len(), d.vocab)));
    }
    for (k, v) in tok {
        // llama.cpp wants one token per embedding row: pad as convert_hf_to_gguf.py does.
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", MetaValue::Array(t, mut items)) => {
                for i in items.len()..d.vocab {
                    items.push(MetaValue::Str(format!("[PAD{i}]")));
                }
                MetaValue::Array(t, items)
            }
            ("tokenizer.ggml.token_type", MetaValue::Array(t, mut items)) => {
                items.resize(d.vocab, MetaValue::I32(5));
                MetaValue::Array(t, items)
            }
            ("tokenizer.ggml.scores", MetaValue::Array(t, mut items)) => {
                items.resize(d.vocab, MetaValue::F32(-1000.0));
                MetaValue::Array(t, items)
            }
            (_, v) => v,
        };
        kv.push((k, v));
    }

    // Tensors.
    let layout = m.layout();
    let mut plan: Vec<(TensorSpec, Option<&Tensor>, Option<Vec<usize>>)> = Vec::new();
    if let Some(f) = &rope_freqs {
        plan.push((TensorSpec::vector("rope_freqs.weight", f.len() as u64, GgmlType::F32), None, None));
    }
    for t in &layout.tensors {
        let (name, tr) = match t.kind {
            Kind::U8 { .. } => continue,
            _ => ga.tensor_name(t.name.name, t.name.layer).ok_or_else(|| {
                field(input, &t.name.to_string(), "", format!("no {a} tensor for it"))
            })?,
        };
        let spec = match t.kind {
            Kind::F32 { len } => TensorSpec::vector(name, len as u64, GgmlType::F32),
            Kind::Mat { qtype, rows, cols, .. } => TensorSpec::matrix(
                name,
                rows as u64,
                cols as u64,
                if qtype == QType::Q8_0 { GgmlType::Q8_0 } else { GgmlType::Q4_0 },
            ),
            Kind::U8 { .. } => unreachable!(),
        };
        // GGUF row j holds .mlb row r where map.src(r) = j (the inverse gather).
        let rows = match t.kind {
            Kind::Mat { rows, .. } => rows,
            Kind::F32 { len } => len,
            Kind::U8 { .. } => 0,
        };
        let inverse = match (ga.rows, tr) {
            (RopeRows::RotateHalf, super::arch::Transform::Rope | super::arch::Transform::RopeNorm) => {
                let map = RowMap::Rope { head_dim: d.head_dim, rot: d.rot_dim };
                let mut inv = vec![0usize; rows];
                for (r, slot) in (0..rows).map(|r| (r, map.src(r))) {
                    inv[slot] = r;
                }
                Some(inv)
            }
            _ => None,
        };
        plan.push((spec, Some(t), inverse));
    }
    let specs: Vec<TensorSpec> = plan.iter().map(|(s, _, _)| s.clone()).collect();

    let out = opts.output.clone().unwrap_or_else(|| input.with_extension("gguf"));
    if super::gguf_in::same_file(&out, input) || super::gguf_in::same_file(&out, &tok_path) {
        return Err(ConvertError::options("-o", format!("{} is an input file", out.display())));
    }
    let mut file = AtomicFile::create(&out).map_err(|e| ConvertError::io(&out, e))?;
    let werr = |e: WriteError| match e {
        WriteError::Io(e) => ConvertError::io(&out, e),
        WriteError::Format(err) => ConvertError::Format { file: out.clone(), err: Box::new(err) },
    };
    {
        let mut w = GgufWriter::new(BufWriter::with_capacity(1 << 20, &mut file), &kv, specs).map_err(werr)?;
        for (spec, t, inverse) in &plan {
            let Some(t) = t else {
                let f = rope_freqs.as_ref().expect("rope_freqs planned");
                let b: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.write_data(&b).map_err(werr)?;
                continue;
            };
            let idx = layout.tensors.iter().position(|x| x.name == t.name).expect("from the layout");
            match t.kind {
                Kind::F32 { .. } => {
                    let x = m.f32s(idx);
                    let b: Vec<u8> = match inverse {
                        Some(inv) => inv.iter().flat_map(|&r| x[r].to_le_bytes()).collect(),
                        None => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    };
                    w.write_data(&b).map_err(werr)?;
                }
                Kind::Mat { qtype, rows, cols, .. } => {
                    let (_, _, _, q) = m.mat_quants(idx);
                    let f16 = m.mat_f16(idx);
                    let f32s = if f16.is_none() { Some(m.mat(idx).d.to_vec()) } else { None };
                    let nb = cols / QK;
                    let qb = qtype.block_bytes() as usize;
                    let qrow = nb * qb;
                    let mut buf = Vec::with_capacity(nb * (2 + qb));
                    for j in 0..rows {
                        let r = inverse.as_ref().map_or(j, |inv| inv[j]);
                        buf.clear();
                        for b in 0..nb {
                            let bits = match (&f16, &f32s) {
                                (Some(s), _) => s[r * nb + b],
                                (None, Some(s)) => {
                                    let x = s[r * nb + b];
                                    let hb = half::f16::from_f32(x);
                                    if hb.to_f32() != x {
                                        return Err(ConvertError::tensor(
                                            input,
                                            t.name.to_string(),
                                            format!("row {r} block {b}: scale {x} is not an f16 (GGUF blocks hold f16 scales): convert with --f16-scales"),
                                        ));
                                    }
                                    hb.to_bits()
                                }
                                _ => unreachable!(),
                            };
                            buf.extend_from_slice(&bits.to_le_bytes());
                            buf.extend_from_slice(&q[r * qrow + b * qb..r * qrow + (b + 1) * qb]);
                        }
                        w.write_data(&buf).map_err(werr)?;
                    }
                    let _ = spec;
                }
                Kind::U8 { .. } => unreachable!(),
            }
        }
        w.finish()
            .map_err(werr)?
            .into_inner()
            .map_err(|e| ConvertError::io(&out, e.into_error()))?;
    }
    file.commit().map_err(|e| ConvertError::io(&out, e))?;
    Ok(ExportSummary {
        output: out.clone(),
        arch: a,
        tensors: plan.len(),
        file_bytes: std::fs::metadata(&out).map(|x| x.len()).unwrap_or(0),
    })
}
