//! A GGUF file's metadata → the model description, with the meaning llama.cpp gives it,
//! one section at a time: `dims`, `ffn`, `vocab`, `rope` ([`super::rope`]), `layers`
//! (no-RoPE layers), the family's `scales`, the sliding `window`, the delta rule's
//! `linear` dimensions; then the description's own rules
//! ([`ModelDesc::check`]), with errors under the file's keys. What llama.cpp computes
//! without a key (Gemma's attention scale, SmolLM3's no-RoPE layers, the window's
//! defaults) is the GGUF architecture's table ([`GgufArch`]).

use super::arch::GgufArch;
use super::meta::{usize_of, Meta};
use super::rope::rope;
use crate::convert::arch::Scales;
use crate::convert::desc::{AttnScales, Dims, Ffn, LayerFlags, LinearDims, ModelDesc, Moe, Vocab};
use crate::convert::error::{ConvertError, DescField, Result};
use crate::format::gguf::Value;
use crate::format::mlb::header::{moe_gating, pooling};
use crate::format::mlb::validate::SEQ_LIMIT;

/// What a GGUF file describes, beyond the header fields.
pub struct Described {
    pub desc: ModelDesc,
    /// GGUF tensors consumed by the description (rope_freqs).
    pub consumed: Vec<String>,
}

/// `{arch}.pooling_type`, llama.cpp's (1 mean, 2 cls, 3 last; 0 none, 4 rank): the
/// header's hint; a kind the header has no code for names none.
fn pooling_type(m: &Meta) -> Result<u32> {
    Ok(match m.u64_opt("pooling_type")? {
        Some(1) => pooling::MEAN,
        Some(2) => pooling::CLS,
        Some(3) => pooling::LAST,
        _ => pooling::NONE,
    })
}

/// The model a GGUF file describes, as llama.cpp reads it.
pub fn describe(m: &Meta, ga: &'static GgufArch, notes: &mut Vec<String>) -> Result<Described> {
    required(m, ga)?;
    let dims = dims(m, notes)?;
    let moe = moe(m, ga, dims.n_layers)?;
    // With experts in every layer the dense width is the experts' (llama.cpp's
    // feed_forward_length is then unused).
    let hidden_dim = match moe {
        Some(e) => e.expert_hidden,
        None => ffn_length(m, dims.n_layers)?,
    };
    let ffn = Ffn {
        hidden_dim,
        act: ga.act,
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
    let vocab = vocab(m)?;
    let (mut rope, consumed) = rope(m, &dims)?;
    let mut layers = vec![
        LayerFlags {
            moe: moe.is_some(),
            ..LayerFlags::default()
        };
        dims.n_layers
    ];
    if let Some(k) = ga.no_rope_every {
        for (i, l) in layers.iter_mut().enumerate() {
            l.no_rope = (i + 1) % k == 0;
        }
    }
    let scales = scales(m, ga, &dims)?;
    let (sliding_window, local_theta) = window(m, ga, rope.theta, &mut layers)?;
    rope.local_theta = local_theta;
    if ga.rope_sections {
        rope_sections(m, rope.rot_dim)?;
    }
    let linear = match ga.arch.linear_attention {
        true => linear(m, &mut layers)?,
        false => None,
    };
    let desc = ModelDesc {
        arch: ga.arch,
        wrapper: None,
        dims,
        ffn,
        vocab,
        norm_eps,
        rope,
        sliding_window,
        layers,
        scales,
        linear,
        moe,
        pooling: pooling_type(m)?,
        notes: Vec::new(),
    };
    desc.check().map_err(|e| {
        let key = match e.field {
            DescField::RotDim => m.full("rope.dimension_count"),
            DescField::RopeScaling => m.full("rope.scaling.type"),
            DescField::Act => "general.architecture".to_string(),
            DescField::SlidingWindow => m.full("attention.sliding_window"),
            DescField::Layers => m.full("attention.recurrent_layers"),
            DescField::Experts => m.full("expert_count"),
            DescField::ExpertsUsed => m.full("expert_used_count"),
            DescField::ExpertHidden => m.full("expert_feed_forward_length"),
            DescField::SharedHidden => m.full("expert_shared_feed_forward_length"),
        };
        e.at(m.file, key, None)
    })?;
    Ok(Described {
        desc,
        consumed: consumed.into_iter().collect(),
    })
}

/// Refuses a file without a key llama.cpp requires of the architecture
/// ([`GgufArch::required`]), naming the first one missing.
fn required(m: &Meta, ga: &GgufArch) -> Result<()> {
    match ga.required.iter().find(|k| m.v.get(&m.full(k)).is_none()) {
        Some(k) => Err(m.err(
            k,
            "missing",
            format!(
                "required key (llama.cpp refuses a {} file without it)",
                ga.name
            ),
        )),
        None => Ok(()),
    }
}

/// A required per-layer size that every layer shares.
fn uniform_req(m: &Meta, suffix: &str, n_layers: usize) -> Result<usize> {
    let v = m
        .uniform(suffix, n_layers)?
        .ok_or_else(|| m.err(suffix, "missing", "required key"))?;
    usize_of(m, suffix, v)
}

/// The `dims` section: layers, width, heads, head size, context (clamped to the
/// format's limit, with a note).
fn dims(m: &Meta, notes: &mut Vec<String>) -> Result<Dims> {
    let n_layers = usize_of(m, "block_count", m.u64_req("block_count")?)?;
    if n_layers == 0 || n_layers > 65536 {
        return Err(m.err("block_count", n_layers, "must be 1 to 65536"));
    }
    let dim = usize_of(m, "embedding_length", m.u64_req("embedding_length")?)?;
    let n_heads = uniform_req(m, "attention.head_count", n_layers)?;
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
    Ok(Dims {
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        max_seq,
    })
}

/// The experts (every layer's FFN, as llama.cpp's MoE architectures have them): their
/// count, experts per token, width (`expert_feed_forward_length`, else
/// `feed_forward_length`), the shared expert's width, the routing llama.cpp
/// computes, and its clamped SwiGLU's constants (gpt-oss).
fn moe(m: &Meta, ga: &GgufArch, n_layers: usize) -> Result<Option<Moe>> {
    let Some(am) = ga.arch.moe else {
        return Ok(None);
    };
    let g = |k: &str| -> Result<usize> { usize_of(m, k, m.u64_req(k)?) };
    let n_experts = g("expert_count")?;
    let n_used = g("expert_used_count")?;
    let expert_hidden = match m.u64_opt("expert_feed_forward_length")? {
        Some(v) => usize_of(m, "expert_feed_forward_length", v)?,
        None => ffn_length(m, n_layers)?,
    };
    let shared_hidden = match m.u64_opt("expert_shared_feed_forward_length")? {
        Some(v) => usize_of(m, "expert_shared_feed_forward_length", v)?,
        None => 0,
    };
    let _ = m.get("feed_forward_length");
    Ok(Some(Moe {
        n_experts,
        n_used,
        expert_hidden,
        gating: am
            .gating
            .or(ga.moe_gating)
            .unwrap_or(moe_gating::SOFTMAX_TOPK_NORM),
        shared_hidden,
        swiglu: ga.swiglu.filter(|_| am.clamped_swiglu),
    }))
}

/// The `ffn` section's width (the activation is the architecture's).
fn ffn_length(m: &Meta, n_layers: usize) -> Result<usize> {
    uniform_req(m, "feed_forward_length", n_layers)
}

/// The `vocab` section, from the tensors: the embedding's rows, and a classifier
/// only when `output.weight` is there.
fn vocab(m: &Meta) -> Result<Vocab> {
    let emb = m
        .v
        .tensor("token_embd.weight")
        .ok_or_else(|| ConvertError::checkpoint(m.file, "tensor token_embd.weight is missing"))?;
    let size = emb.rows() as usize;
    m.u64_eq(
        "vocab_size",
        size,
        format!("differs from token_embd.weight's {size} rows"),
    )?;
    Ok(Vocab {
        size,
        tied: m.v.tensor("output.weight").is_none(),
    })
}

/// The family's scales: Gemma's attention scale as llama.cpp computes it
/// (`query_pre_attn_scalar` is not stored) and the softcaps the architecture reads.
fn scales(m: &Meta, ga: &GgufArch, dims: &Dims) -> Result<AttnScales> {
    let cap = |suffix: &str, default: Option<f64>| -> Result<Option<f64>> {
        let Some(default) = default else {
            return Ok(None);
        };
        let c = m.f64_opt(suffix)?.unwrap_or(default);
        if c < 0.0 {
            return Err(m.err(suffix, c, "must be ≥ 0"));
        }
        Ok((c > 0.0).then_some(c))
    };
    Ok(match ga.arch.scales {
        Scales::None => AttnScales::default(),
        Scales::Gemma => AttnScales {
            attn: Some(ga.attn_scale(dims).1),
            attn_softcap: cap("attn_logit_softcapping", ga.softcaps.attn)?,
            final_softcap: cap("final_logit_softcapping", ga.softcaps.final_)?,
        },
    })
}

/// The sliding `window` section: the window, which layers slide, and their local RoPE
/// base (`None` where it is the global `theta`).
fn window(
    m: &Meta,
    ga: &GgufArch,
    theta: f64,
    layers: &mut [LayerFlags],
) -> Result<(Option<usize>, Option<f64>)> {
    let Some(swa) = ga.swa else {
        return Ok((None, None));
    };
    let w = m
        .u64_opt("attention.sliding_window")?
        .unwrap_or(swa.default_window);
    if w == 0 {
        return Ok((None, None));
    }
    let sliding = swa_layers(m, layers.len(), swa.default_pattern)?;
    let base_swa = m.f64_opt("rope.freq_base_swa")?;
    let local = match swa.default_local_base {
        None => base_swa.filter(|&b| b != theta),
        Some(d) => Some(base_swa.unwrap_or(d)),
    };
    if let Some(b) = local {
        if b <= 0.0 {
            return Err(m.err("rope.freq_base_swa", b, "must be > 0"));
        }
    }
    for (l, s) in layers.iter_mut().zip(&sliding) {
        l.sliding = *s;
        l.local_rope = *s && local.is_some();
    }
    Ok((Some(w as usize), local))
}

/// Interleaved multimodal RoPE: text positions turn every section alike, so each
/// rotated pair must fall in a section of the text position. ggml's interleaved
/// sections: pair i takes sector s = i mod Σ; sector s % 3 = 0, 1, 2 rotates by
/// position t, h, w below 3·section, else by the fourth position, 0 for text.
fn rope_sections(m: &Meta, rot_dim: usize) -> Result<()> {
    let Some(v) = m.get("rope.dimension_sections") else {
        return Ok(());
    };
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
    Ok(())
}

/// The `linear` section: which layers are recurrent (`attention.recurrent_layers`, else
/// all but every `full_attention_interval`-th) and the delta rule's dimensions from
/// llama.cpp's `ssm.*` keys.
fn linear(m: &Meta, layers: &mut [LayerFlags]) -> Result<Option<LinearDims>> {
    let n_layers = layers.len();
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
    const SSM_KEYS: [&str; 5] = [
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.state_size",
        "ssm.conv_kernel",
        "ssm.inner_size",
    ];
    if !recurrent.iter().any(|&r| r) {
        // Read (so not refused as unknown) but unused.
        for k in SSM_KEYS {
            let _ = m.get(k);
        }
        return Ok(None);
    }
    let g = |k: &str| -> Result<usize> { usize_of(m, k, m.u64_req(k)?) };
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
    Ok(Some(LinearDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim: k_dim,
        conv,
    }))
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
