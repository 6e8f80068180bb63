//! A GGUF file's metadata → the model description, with the meaning llama.cpp gives it
//! (defaults, per-architecture rules such as Gemma's attention scale and sliding-layer
//! pattern, SmolLM3's no-RoPE layers).

use super::arch::{GgufArch, NoRope, Swa};
use super::meta::{usize_of, Meta};
use super::rope::{llama3_from_factors, rope_scaling};
use crate::convert::error::{ConvertError, Result};
use crate::convert::hf::arch;
use crate::convert::hf::config::{LayerFlags, LinearDims, ModelDesc, RopeScaling};
use crate::format::gguf::{dequant, Value};
use crate::format::mlb::header::act;
use crate::format::mlb::validate::SEQ_LIMIT;

/// What a GGUF file describes, beyond the header fields.
pub struct Described {
    pub desc: ModelDesc,
    /// GGUF tensors consumed by the description (rope_freqs).
    pub consumed: Vec<String>,
}

/// The model a GGUF file describes, as llama.cpp reads it.
pub fn describe(m: &Meta, ga: &'static GgufArch, notes: &mut Vec<String>) -> Result<Described> {
    let v = m.v;
    let arch = arch::ARCHS
        .iter()
        .find(|a| a.name == ga.krafla)
        .expect("every GGUF architecture maps to a Krafla one");
    let n_layers = usize_of(m, "block_count", m.u64_req("block_count")?)?;
    if n_layers == 0 || n_layers > 65536 {
        return Err(m.err("block_count", n_layers, "must be 1 to 65536"));
    }
    let dim = usize_of(m, "embedding_length", m.u64_req("embedding_length")?)?;
    let hidden_dim = m
        .uniform("feed_forward_length", n_layers)?
        .ok_or_else(|| m.err("feed_forward_length", "missing", "required key"))?;
    let hidden_dim = usize_of(m, "feed_forward_length", hidden_dim)?;
    let n_heads = m
        .uniform("attention.head_count", n_layers)?
        .ok_or_else(|| m.err("attention.head_count", "missing", "required key"))?;
    let n_heads = usize_of(m, "attention.head_count", n_heads)?;
    if n_heads == 0 {
        return Err(m.err("attention.head_count", 0, "must not be zero"));
    }
    let n_kv_heads = match m.uniform("attention.head_count_kv", n_layers)? {
        Some(k) => usize_of(m, "attention.head_count_kv", k)?,
        None => n_heads,
    };
    let head_dim = match m.u64_opt("attention.key_length")? {
        Some(k) => usize_of(m, "attention.key_length", k)?,
        None => dim / n_heads,
    };
    m.u64_eq(
        "attention.value_length",
        head_dim,
        format!("must equal the key length {head_dim}: the format has one head size"),
    )?;
    let rot_dim = match m.u64_opt("rope.dimension_count")? {
        Some(r) => usize_of(m, "rope.dimension_count", r)?,
        None => head_dim,
    };
    if rot_dim != head_dim && !arch.qwen35 {
        return Err(m.err(
            "rope.dimension_count",
            rot_dim,
            format!(
                "partial rotary (head size {head_dim}) is not supported for {}",
                ga.name
            ),
        ));
    }
    if rot_dim == 0 || rot_dim > head_dim || rot_dim % 2 != 0 {
        return Err(m.err(
            "rope.dimension_count",
            rot_dim,
            format!("must be even and in 1..={head_dim}"),
        ));
    }
    let ctx = m.u64_req("context_length")?;
    let max_seq = if ctx > SEQ_LIMIT as u64 {
        notes.push(format!(
            "{} {ctx} clamped to the format's limit {SEQ_LIMIT}",
            m.full("context_length")
        ));
        SEQ_LIMIT as usize
    } else {
        ctx as usize
    };
    let norm_eps = m
        .f64_opt("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| {
            m.err(
                "attention.layer_norm_rms_epsilon",
                "missing",
                "required key",
            )
        })?;
    // llama.cpp's default base is 10000.
    let rope_theta = m.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    if rope_theta <= 0.0 {
        return Err(m.err("rope.freq_base", rope_theta, "must be > 0"));
    }

    // Vocabulary and classifier from the tensors.
    let emb = v
        .tensor("token_embd.weight")
        .ok_or_else(|| ConvertError::checkpoint(m.file, "tensor token_embd.weight is missing"))?;
    let vocab = emb.rows() as usize;
    m.u64_eq(
        "vocab_size",
        vocab,
        format!("differs from token_embd.weight's {vocab} rows"),
    )?;
    let tied = v.tensor("output.weight").is_none();

    // RoPE scaling as llama.cpp applies it.
    let mut consumed = Vec::new();
    let mut rope = rope_scaling(m, ctx)?;
    if let Some(t) = v.tensor("rope_freqs.weight") {
        if rope != RopeScaling::None {
            return Err(ConvertError::tensor(
                m.file,
                t.name,
                "per-frequency factors together with a RoPE scaling type cannot be expressed",
            ));
        }
        let mut factors = vec![0f32; t.cols() as usize];
        if t.rows() != 1
            || t.cols() as usize != head_dim / 2
            || !dequant::dequantize_row(t.ty, v.data(t), &mut factors)
        {
            return Err(ConvertError::tensor(
                m.file,
                t.name,
                format!(
                    "{} {}: expected {} F32 frequency factors",
                    t.ty,
                    t.shape_text(),
                    head_dim / 2
                ),
            ));
        }
        let orig = m
            .u64_opt("rope.scaling.original_context_length")?
            .unwrap_or(8192)
            .clamp(1, u32::MAX as u64) as u32;
        rope = llama3_from_factors(rope_theta, head_dim, &factors, orig)
            .map_err(|msg| ConvertError::tensor(m.file, t.name, msg))?;
        consumed.push(t.name.to_string());
    }
    let _ = m.get("rope.scaling.finetuned"); // no effect on the math

    // Layers.
    let mut layers = vec![LayerFlags::default(); n_layers];
    if ga.no_rope == NoRope::Every4th {
        for (i, l) in layers.iter_mut().enumerate() {
            l.no_rope = (i + 1) % 4 == 0;
        }
    }
    let (mut sliding_window, mut rope_local_theta) = (None, None);
    let (mut attn_scale, mut attn_softcap, mut final_softcap) = (None, None, None);
    if arch.gemma {
        // llama.cpp: 1/sqrt(head size), except the 27B models (46 layers for Gemma 2,
        // 62 for Gemma 3): 1/sqrt(dim / n_heads). query_pre_attn_scalar is not stored.
        let big =
            (ga.swa == Swa::Gemma2 && n_layers == 46) || (ga.swa == Swa::Gemma3 && n_layers == 62);
        let d = if big { dim / n_heads } else { head_dim };
        attn_scale = Some(1.0 / (d as f64).sqrt());
        let cap = |suffix: &str, default: f64| -> Result<Option<f64>> {
            let c = m.f64_opt(suffix)?.unwrap_or(default);
            if c < 0.0 {
                return Err(m.err(suffix, c, "must be ≥ 0"));
            }
            Ok((c > 0.0).then_some(c))
        };
        match ga.swa {
            Swa::Gemma2 => {
                attn_softcap = cap("attn_logit_softcapping", 50.0)?;
                final_softcap = cap("final_logit_softcapping", 30.0)?;
            }
            _ => final_softcap = cap("final_logit_softcapping", 0.0)?,
        }
    }
    match ga.swa {
        Swa::None => {}
        Swa::Gemma2 | Swa::Gemma3 => {
            let (default_window, default_pattern) = if ga.swa == Swa::Gemma2 {
                (4096, 2)
            } else {
                (0, 6)
            };
            let w = m
                .u64_opt("attention.sliding_window")?
                .unwrap_or(default_window);
            if w > SEQ_LIMIT as u64 {
                return Err(m.err(
                    "attention.sliding_window",
                    w,
                    "above the format's limit 2^24",
                ));
            }
            if w > 0 {
                let swa = swa_layers(m, n_layers, default_pattern)?;
                let base_swa = m.f64_opt("rope.freq_base_swa")?;
                let local = match ga.swa {
                    Swa::Gemma2 => base_swa.filter(|&b| b != rope_theta),
                    _ => Some(base_swa.unwrap_or(10_000.0)),
                };
                if let Some(b) = local {
                    if b <= 0.0 {
                        return Err(m.err("rope.freq_base_swa", b, "must be > 0"));
                    }
                }
                for (l, s) in layers.iter_mut().zip(&swa) {
                    l.sliding = *s;
                    l.local_rope = *s && local.is_some();
                }
                sliding_window = Some(w as usize);
                rope_local_theta = local;
            }
        }
    }
    let mut linear = None;
    if arch.qwen35 {
        // Text positions: every mrope section rotates by the same position.
        // ggml's interleaved sections: pair i takes section sector = i mod Σ; sector
        // s % 3 = 0, 1, 2 rotates by position t, h, w below 3·section, else by the fourth
        // position, 0 for text. Every rotated pair must get t, h or w.
        if let Some(v) = m.get("rope.dimension_sections") {
            let sec: Option<Vec<i64>> = v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_i64()).collect());
            let sec = sec
                .filter(|s| s.len() == 4 && s.iter().all(|&x| x >= 0))
                .ok_or_else(|| {
                    m.err(
                        "rope.dimension_sections",
                        v,
                        "must be 4 non-negative integers",
                    )
                })?;
            let sum: i64 = sec.iter().sum();
            let covered = |i: i64| {
                let s = if sum > 0 { i % sum } else { return false };
                (s % 3 == 0 && s < 3 * sec[0])
                    || (s % 3 == 1 && s < 3 * sec[1])
                    || (s % 3 == 2 && s < 3 * sec[2])
            };
            if let Some(i) = (0..rot_dim as i64 / 2).find(|&i| !covered(i)) {
                return Err(m.err(
                    "rope.dimension_sections",
                    v,
                    format!("leaves rotary pair {i} unrotated for text (llama.cpp's fourth position is 0)"),
                ));
            }
        }
        let recurrent: Vec<bool> = match m.get("attention.recurrent_layers") {
            Some(Value::Array(a)) if a.len == n_layers => a
                .iter()
                .map(|x| {
                    x.as_bool().ok_or_else(|| {
                        m.err(
                            "attention.recurrent_layers",
                            Value::Array(a),
                            "must hold booleans",
                        )
                    })
                })
                .collect::<Result<_>>()?,
            Some(v) => {
                return Err(m.err(
                    "attention.recurrent_layers",
                    v,
                    format!("must be {n_layers} booleans"),
                ))
            }
            None => {
                let p = m.u64_opt("full_attention_interval")?.unwrap_or(4);
                if p == 0 {
                    return Err(m.err("full_attention_interval", 0, "must be ≥ 1"));
                }
                (0..n_layers as u64).map(|i| (i + 1) % p != 0).collect()
            }
        };
        let _ = m.get("full_attention_interval");
        for (l, r) in layers.iter_mut().zip(&recurrent) {
            l.linear = *r;
        }
        if recurrent.iter().any(|&r| r) {
            let g = |k: &str| -> Result<usize> {
                let v = m.u64_req(k)?;
                usize::try_from(v).map_err(|_| m.err(k, v, "too large"))
            };
            let (k_heads, v_heads, k_dim, conv) = (
                g("ssm.group_count")?,
                g("ssm.time_step_rank")?,
                g("ssm.state_size")?,
                g("ssm.conv_kernel")?,
            );
            let inner = g("ssm.inner_size")?;
            if v_heads == 0 || k_heads == 0 || v_heads % k_heads != 0 || inner != v_heads * k_dim {
                return Err(m.err(
                    "ssm.inner_size",
                    inner,
                    format!(
                        "must be time_step_rank ({v_heads}) × state_size ({k_dim}), with group_count ({k_heads}) dividing time_step_rank (llama.cpp's value heads are key-head sized)"
                    ),
                ));
            }
            linear = Some(LinearDims {
                k_heads,
                v_heads,
                k_dim,
                v_dim: k_dim,
                conv,
            });
        } else {
            for k in [
                "ssm.conv_kernel",
                "ssm.state_size",
                "ssm.group_count",
                "ssm.time_step_rank",
                "ssm.inner_size",
            ] {
                let _ = m.get(k);
            }
        }
    }
    let desc = ModelDesc {
        arch,
        wrapper: None,
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        hidden_dim,
        vocab,
        max_seq,
        norm_eps,
        rope_theta,
        rope,
        rope_local_theta,
        rot_dim,
        layers,
        sliding_window,
        tied,
        act: if arch.gemma {
            act::GELU_TANH
        } else {
            act::SILU
        },
        attn_scale,
        attn_softcap,
        final_softcap,
        linear,
        notes: Vec::new(),
    };
    Ok(Described { desc, consumed })
}

/// Gemma's sliding layers: `attention.sliding_window_pattern` as a per-layer bool
/// array, or a period n (layer i slides when i % n < n - 1), default `default`.
fn swa_layers(m: &Meta, n: usize, default: u64) -> Result<Vec<bool>> {
    let key = "attention.sliding_window_pattern";
    match m.get(key) {
        Some(Value::Array(a)) => {
            m.check_layers(key, a, n, "")?;
            a.iter()
                .map(|x| match x {
                    Value::Bool(b) => Ok(b),
                    other => other
                        .as_u64()
                        .filter(|&v| v <= 1)
                        .map(|v| v == 1)
                        .ok_or_else(|| m.err(key, Value::Array(a), "must hold booleans")),
                })
                .collect()
        }
        Some(v) => {
            let p = v
                .as_u64()
                .ok_or_else(|| m.err(key, v, "must be an integer or a list of booleans"))?;
            Ok((0..n as u64).map(|i| p == 0 || i % p < p - 1).collect())
        }
        None => Ok((0..n as u64).map(|i| i % default < default - 1).collect()),
    }
}
