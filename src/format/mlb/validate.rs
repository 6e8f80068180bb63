//! The spec's error table for `.mlb` headers and layer flags, rule by rule.
//!
//! `validate` returns the derived dimensions (`head_dim`, `q_dim`, `kv_dim`, ...) of a
//! header that passes; every failure names the field and its value.

use super::header::{
    act, layer_flag, moe_flag, moe_gating, pooling, q8_class, qk_norm, qkv_bias, rope_type, wtype,
    Header, MAGIC, VERSION,
};
use crate::format::error::{FormatError, Result};

/// Limit of dim, n_layers, n_heads, n_kv_heads, hidden_dim (and of q_dim).
pub const DIM_LIMIT: u32 = 65536;
/// Limit of vocab, max_seq and sliding_window.
pub const SEQ_LIMIT: u32 = 1 << 24;

/// Values derived from a valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub hidden_dim: usize,
    pub vocab: usize,
    pub head_dim: usize,
    /// head_dim × n_heads.
    pub q_dim: usize,
    /// head_dim × n_kv_heads.
    pub kv_dim: usize,
    /// Rotated dimensions of each head (rot_dim, or head_dim when 0).
    pub rot_dim: usize,
    /// Linear attention: 2·K·dk + V·dv (rows of lqkv); 0 without it.
    pub lin_qkv: usize,
    /// Linear attention: V·dv (rows of lz, columns of lout); 0 without it.
    pub lin_v_total: usize,
    /// Mixture of experts: routed experts per MoE layer (0 without), experts per token,
    /// one expert's FFN width, the shared expert's (0 without).
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_hidden: usize,
    pub shared_hidden: usize,
}

/// Most routed experts a MoE layer may have.
pub const EXPERT_LIMIT: u32 = 1024;

fn shape(field: &str, v: impl std::fmt::Display, rule: &str) -> FormatError {
    FormatError::shape(field, v, rule)
}

fn format(field: &str, v: impl std::fmt::Display, rule: &str) -> FormatError {
    FormatError::format(field, v, rule)
}

fn flag01(field: &str, v: u32) -> Result<()> {
    code_at_most(field, v, 1, "must be 0 or 1")
}

/// A code field whose known values are 0..=`max`.
fn code_at_most(field: &str, v: u32, max: u32, rule: &str) -> Result<()> {
    if v > max {
        return Err(format(field, v, rule));
    }
    Ok(())
}

fn multiple_of_32(field: &str, v: usize) -> Result<()> {
    if !v.is_multiple_of(32) {
        return Err(shape(field, v, "must be a multiple of 32"));
    }
    Ok(())
}

fn nonneg_finite(field: &str, v: f32) -> Result<()> {
    if !v.is_finite() || v < 0.0 {
        return Err(format(field, v, "must be finite and ≥ 0"));
    }
    Ok(())
}

fn positive(field: &str, v: f32, rule: &str) -> Result<()> {
    if !(v.is_finite() && v > 0.0) {
        return Err(format(field, v, rule));
    }
    Ok(())
}

fn dim_in(field: &str, v: u32, limit: u32) -> Result<usize> {
    if v == 0 {
        return Err(shape(field, v, "must not be zero"));
    }
    if v > limit {
        return Err(shape(field, v, &format!("above the limit {limit}")));
    }
    Ok(v as usize)
}

/// Checks the header against every rule of the spec; returns the derived dimensions.
pub fn validate(h: &Header) -> Result<Dims> {
    if h.magic != MAGIC {
        return Err(format(
            "magic",
            format!("{:?}", String::from_utf8_lossy(&h.magic)),
            "must be \"MLB1\"",
        ));
    }
    if h.version != VERSION {
        return Err(format("version", h.version, "must be 1"));
    }
    validate_wtype(h)?;
    positive("rope_theta", h.rope_theta, "must be finite and > 0")?;
    nonneg_finite("norm_eps", h.norm_eps)?;
    validate_rope(h)?;
    code_at_most(
        "qkv_bias",
        h.qkv_bias,
        qkv_bias::QKVO,
        "must be 0, 1 (q, k, v) or 2 (q, k, v and o)",
    )?;
    code_at_most(
        "qk_norm",
        h.qk_norm,
        qk_norm::WHOLE,
        "must be 0, 1 (per head) or 2 (over the whole projection)",
    )?;
    flag01("attn_sinks", h.attn_sinks)?;
    code_at_most(
        "pooling",
        h.pooling,
        pooling::CLS,
        "must be 0 (none given), 1 (mean), 2 (last token) or 3 (first token)",
    )?;
    flag01("layer_flags", h.layer_flags)?;
    flag01("post_norms", h.post_norms)?;
    flag01("scale_f16", h.scale_f16)?;
    flag01("attn_gate", h.attn_gate)?;
    if h.act != act::SILU && h.act != act::GELU_TANH {
        return Err(format("act", h.act, "must be 0 (SiLU) or 1 (GELU tanh)"));
    }
    nonneg_finite("embed_scale", h.embed_scale)?;
    nonneg_finite("attn_scale", h.attn_scale)?;
    nonneg_finite("attn_softcap", h.attn_softcap)?;
    nonneg_finite("final_softcap", h.final_softcap)?;
    nonneg_finite("rope_local_theta", h.rope_local_theta)?;
    if h.sliding_window > SEQ_LIMIT {
        return Err(format(
            "sliding_window",
            h.sliding_window,
            "above the limit 2^24",
        ));
    }

    let dim = dim_in("dim", h.dim, DIM_LIMIT)?;
    let n_layers = dim_in("n_layers", h.n_layers, DIM_LIMIT)?;
    let n_heads = dim_in("n_heads", h.n_heads, DIM_LIMIT)?;
    let n_kv_heads = dim_in("n_kv_heads", h.n_kv_heads, DIM_LIMIT)?;
    let hidden_dim = dim_in("hidden_dim", h.hidden_dim, DIM_LIMIT)?;
    let vocab = dim_in("vocab", h.vocab, SEQ_LIMIT)?;
    dim_in("max_seq", h.max_seq, SEQ_LIMIT)?;
    multiple_of_32("dim", dim)?;
    multiple_of_32("hidden_dim", hidden_dim)?;
    if n_heads % n_kv_heads != 0 {
        return Err(shape(
            "n_kv_heads",
            n_kv_heads,
            &format!("must divide n_heads ({n_heads})"),
        ));
    }
    if vocab < 3 {
        return Err(shape("vocab", vocab, "must be at least 3"));
    }
    let head_dim = if h.head_dim == 0 {
        if dim % n_heads != 0 {
            return Err(shape(
                "n_heads",
                n_heads,
                &format!("must divide dim ({dim}) when head_dim is 0"),
            ));
        }
        dim / n_heads
    } else {
        dim_in("head_dim", h.head_dim, DIM_LIMIT)?
    };
    if head_dim % 2 != 0 {
        return Err(shape("head_dim", head_dim, "must be even"));
    }
    // n_heads and head_dim are both ≤ 2^16, so the product fits in u64 and usize ≥ 32 bits
    // would overflow only above 2^32: check in u64.
    let q_dim64 = head_dim as u64 * n_heads as u64;
    if q_dim64 > DIM_LIMIT as u64 {
        return Err(shape(
            "q_dim",
            q_dim64,
            "head_dim × n_heads above the limit 65536",
        ));
    }
    let q_dim = q_dim64 as usize;
    if !q_dim.is_multiple_of(32) {
        return Err(shape(
            "q_dim",
            q_dim,
            "head_dim × n_heads must be a multiple of 32",
        ));
    }
    let kv_dim = head_dim * n_kv_heads;
    let rot_dim = match h.rot_dim as usize {
        0 => head_dim,
        r if r % 2 != 0 => return Err(shape("rot_dim", r, "must be even")),
        r if r > head_dim => {
            return Err(shape(
                "rot_dim",
                r,
                &format!("must be at most head_dim ({head_dim})"),
            ))
        }
        r => r,
    };

    let (lin_qkv, lin_v_total) = validate_linear(h, dim)?;
    let (n_experts, n_experts_used, expert_hidden, shared_hidden) = validate_moe(h)?;
    Ok(Dims {
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        hidden_dim,
        vocab,
        head_dim,
        q_dim,
        kv_dim,
        rot_dim,
        lin_qkv,
        lin_v_total,
        n_experts,
        n_experts_used,
        expert_hidden,
        shared_hidden,
    })
}

/// The mixture-of-experts fields: all zero without experts; else within their limits.
/// Returns (n_experts, n_experts_used, expert_hidden, shared_hidden).
fn validate_moe(h: &Header) -> Result<(usize, usize, usize, usize)> {
    if h.n_experts == 0 {
        let u32s = [
            ("n_experts_used", h.n_experts_used),
            ("expert_hidden", h.expert_hidden),
            ("moe_gating", h.moe_gating),
            ("shared_hidden", h.shared_hidden),
            ("moe_flags", h.moe_flags),
        ];
        for (n, v) in u32s {
            if v != 0 {
                return Err(format(n, v, "must be 0 when n_experts is 0"));
            }
        }
        for (n, v) in [
            ("swiglu_limit", h.swiglu_limit),
            ("swiglu_alpha", h.swiglu_alpha),
        ] {
            if v != 0.0 {
                return Err(format(n, v, "must be 0 when n_experts is 0"));
            }
        }
        return Ok((0, 0, 0, 0));
    }
    if !(2..=EXPERT_LIMIT).contains(&h.n_experts) {
        return Err(shape(
            "n_experts",
            h.n_experts,
            &format!("must be 2..={EXPERT_LIMIT} (or 0: no experts)"),
        ));
    }
    if h.n_experts_used == 0 || h.n_experts_used > h.n_experts {
        return Err(shape(
            "n_experts_used",
            h.n_experts_used,
            &format!("must be 1..=n_experts ({})", h.n_experts),
        ));
    }
    let eh = dim_in("expert_hidden", h.expert_hidden, DIM_LIMIT)?;
    multiple_of_32("expert_hidden", eh)?;
    if h.shared_hidden > DIM_LIMIT {
        return Err(shape(
            "shared_hidden",
            h.shared_hidden,
            "above the limit 65536",
        ));
    }
    multiple_of_32("shared_hidden", h.shared_hidden as usize)?;
    code_at_most(
        "moe_gating",
        h.moe_gating,
        moe_gating::TOPK_SOFTMAX,
        "must be 0 (softmax, top-k), 1 (the same, renormalised) or 2 (top-k, softmax)",
    )?;
    if h.moe_flags & !moe_flag::ALL != 0 {
        return Err(format(
            "moe_flags",
            h.moe_flags,
            "unknown bits (only 1, 2, 4)",
        ));
    }
    if h.moe_flags & moe_flag::SHARED_GATE != 0 && h.shared_hidden == 0 {
        return Err(format(
            "moe_flags",
            h.moe_flags,
            "a shared-expert gate (4) needs shared_hidden > 0",
        ));
    }
    nonneg_finite("swiglu_limit", h.swiglu_limit)?;
    if h.swiglu_limit > 0.0 {
        positive(
            "swiglu_alpha",
            h.swiglu_alpha,
            "the clamped SwiGLU needs swiglu_alpha > 0",
        )?;
    } else if h.swiglu_alpha != 0.0 {
        return Err(format(
            "swiglu_alpha",
            h.swiglu_alpha,
            "must be 0 unless swiglu_limit > 0",
        ));
    }
    if h.layer_flags == 0 {
        return Err(format(
            "layer_flags",
            0,
            "a mixture-of-experts model (n_experts > 0) marks its MoE layers with flag 16",
        ));
    }
    Ok((
        h.n_experts as usize,
        h.n_experts_used as usize,
        eh,
        h.shared_hidden as usize,
    ))
}

/// `wtype` is a known type or mixed; `q8_mask` only in Q4_0 files; `scale_f16` only
/// where some matrix has scales.
fn validate_wtype(h: &Header) -> Result<()> {
    let Some(name) = wtype::name(h.wtype) else {
        let rule = if wtype::RESERVED.contains(&h.wtype) {
            "reserved for weight types this reader does not know (up to 31)"
        } else {
            "must be 1 (Q8_0), 2 (Q4_0), 3 (BF16), 4 (F16) or 128 (mixed)"
        };
        return Err(format("wtype", h.wtype, rule));
    };
    if h.q8_mask & !q8_class::ALL != 0 {
        return Err(format(
            "q8_mask",
            h.q8_mask,
            "unknown class bits (above 64)",
        ));
    }
    if h.wtype != wtype::Q4_0 && h.q8_mask != 0 {
        let rule = if h.wtype == wtype::MIXED {
            "must be 0 in a mixed model (its type table gives every matrix's type)".to_string()
        } else {
            format!("must be 0 in a {name} model")
        };
        return Err(format("q8_mask", h.q8_mask, rule.as_str()));
    }
    if (h.wtype == wtype::BF16 || h.wtype == wtype::F16) && h.scale_f16 != 0 {
        return Err(format(
            "scale_f16",
            h.scale_f16,
            &format!("must be 0 in a {name} model (it stores no scales)"),
        ));
    }
    Ok(())
}

fn validate_rope(h: &Header) -> Result<()> {
    match h.rope_type {
        rope_type::PLAIN => {}
        rope_type::LLAMA3 => scaled_rope(
            h,
            "llama3",
            ("rope_low_freq_factor", h.rope_low_freq_factor, None),
            ("rope_high_freq_factor", h.rope_high_freq_factor, None),
        )?,
        rope_type::LINEAR => rope_factor(h, "linear")?,
        rope_type::YARN | rope_type::YARN_UNROUNDED => {
            scaled_rope(
                h,
                "yarn",
                (
                    "rope_high_freq_factor",
                    h.rope_high_freq_factor,
                    Some("beta_slow"),
                ),
                (
                    "rope_low_freq_factor",
                    h.rope_low_freq_factor,
                    Some("beta_fast"),
                ),
            )?;
            positive(
                "rope_attn_factor",
                h.rope_attn_factor,
                "yarn RoPE needs rope_attn_factor > 0",
            )?;
        }
        other => {
            return Err(format(
                "rope_type",
                other,
                "must be 0 (plain), 1 (llama3), 2 (linear), 3 (yarn) or 4 (yarn, unrounded)",
            ))
        }
    }
    let yarn = h.rope_type == rope_type::YARN || h.rope_type == rope_type::YARN_UNROUNDED;
    if !yarn && h.rope_attn_factor != 0.0 {
        return Err(format(
            "rope_attn_factor",
            h.rope_attn_factor,
            "must be 0 unless rope_type is 3 or 4 (yarn)",
        ));
    }
    Ok(())
}

/// Every scaled RoPE (`kind`: llama3, linear, yarn) needs rope_factor > 0.
fn rope_factor(h: &Header, kind: &str) -> Result<()> {
    positive(
        "rope_factor",
        h.rope_factor,
        &format!("{kind} RoPE needs rope_factor > 0"),
    )
}

/// One end of a scaled RoPE's frequency range: the header field, its value, and the
/// name yarn gives it (messages say `beta_slow (rope_high_freq_factor)`).
type FreqBound = (&'static str, f32, Option<&'static str>);

/// llama3 and yarn RoPE: rope_factor > 0, the frequency range's `lower` end > 0 and
/// its `upper` end above it, and an original context length.
fn scaled_rope(h: &Header, kind: &str, lower: FreqBound, upper: FreqBound) -> Result<()> {
    let long = |(field, _, alias): FreqBound| match alias {
        Some(a) => format!("{a} ({field})"),
        None => field.to_string(),
    };
    rope_factor(h, kind)?;
    positive(
        lower.0,
        lower.1,
        &format!("{kind} RoPE needs {} > 0", long(lower)),
    )?;
    if !(upper.1.is_finite() && upper.1 > lower.1) {
        return Err(format(
            upper.0,
            upper.1,
            &format!(
                "{kind} RoPE needs {} > {} ({})",
                long(upper),
                lower.2.unwrap_or(lower.0),
                lower.1
            ),
        ));
    }
    if h.rope_orig_max_seq == 0 {
        return Err(format(
            "rope_orig_max_seq",
            0,
            &format!("{kind} RoPE needs rope_orig_max_seq > 0"),
        ));
    }
    Ok(())
}

/// Linear-attention dimensions: (2·K·dk + V·dv, V·dv), or zeros when there is none.
fn validate_linear(h: &Header, _dim: usize) -> Result<(usize, usize)> {
    let fields = [
        h.lin_k_heads,
        h.lin_v_heads,
        h.lin_k_dim,
        h.lin_v_dim,
        h.lin_conv,
    ];
    if h.lin_k_heads == 0 {
        let names = [
            "lin_k_heads",
            "lin_v_heads",
            "lin_k_dim",
            "lin_v_dim",
            "lin_conv",
        ];
        for (n, v) in names.iter().zip(fields) {
            if v != 0 {
                return Err(shape(n, v, "must be 0 when lin_k_heads is 0"));
            }
        }
        return Ok((0, 0));
    }
    let k = dim_in("lin_k_heads", h.lin_k_heads, DIM_LIMIT)? as u64;
    let v = dim_in("lin_v_heads", h.lin_v_heads, DIM_LIMIT)? as u64;
    let dk = dim_in("lin_k_dim", h.lin_k_dim, DIM_LIMIT)? as u64;
    let dv = dim_in("lin_v_dim", h.lin_v_dim, DIM_LIMIT)? as u64;
    dim_in("lin_conv", h.lin_conv, DIM_LIMIT)?;
    if !v.is_multiple_of(k) || !v.is_multiple_of(4) {
        return Err(shape(
            "lin_v_heads",
            v,
            &format!("must be a multiple of lin_k_heads ({k}) and of 4"),
        ));
    }
    let v_total = v * dv;
    if !v_total.is_multiple_of(32) {
        return Err(shape(
            "lin_v_dim",
            dv,
            "lin_v_heads × lin_v_dim must be a multiple of 32",
        ));
    }
    // All factors ≤ 2^16: the sum is below 2^34, exact in u64.
    let qkv = 2 * k * dk + v_total;
    let qkv = usize::try_from(qkv)
        .map_err(|_| shape("lin_k_dim", dk, "linear-attention size overflows usize"))?;
    let v_total = usize::try_from(v_total)
        .map_err(|_| shape("lin_v_dim", dv, "linear-attention size overflows usize"))?;
    Ok((qkv, v_total))
}

/// Checks the per-layer flag bytes against the header.
pub fn validate_layer_flags(h: &Header, flags: &[u8]) -> Result<()> {
    use crate::format::error::Status::{Format, Shape};
    let has = |f: u8, bit: u8| f & bit != 0;
    for (i, &f) in flags.iter().enumerate() {
        // The byte's rules in order: the first one broken is the error.
        let rules = [
            (
                f & !layer_flag::ALL != 0,
                Format,
                "unknown layer flag bits (only 1, 2, 4, 8, 16)",
            ),
            (
                has(f, layer_flag::MOE) && h.n_experts == 0,
                Format,
                "mixture-of-experts layer (16) but n_experts is 0",
            ),
            (
                has(f, layer_flag::LOCAL_ROPE) && has(f, layer_flag::NO_ROPE),
                Format,
                "local RoPE base (2) and no RoPE (4) together",
            ),
            (
                has(f, layer_flag::LINEAR) && f & !layer_flag::MOE != layer_flag::LINEAR,
                Format,
                "linear attention (8) goes with no flag but MoE (16)",
            ),
            (
                has(f, layer_flag::LOCAL_ROPE) && h.rope_local_theta <= 0.0,
                Format,
                "local-RoPE layer but rope_local_theta is 0",
            ),
            (
                has(f, layer_flag::LINEAR) && h.lin_k_heads == 0,
                Shape,
                "linear-attention layer but lin_k_heads is 0",
            ),
        ];
        if let Some((_, status, rule)) = rules.into_iter().find(|r| r.0) {
            return Err(FormatError::new(
                status,
                format!("layer_flags[{i}]"),
                f,
                rule,
            ));
        }
    }
    if h.n_experts != 0 && !flags.iter().any(|f| f & layer_flag::MOE != 0) {
        return Err(FormatError::format(
            "layer_flags",
            format!("{} layers", flags.len()),
            "n_experts > 0 but no layer has flag 16 (mixture of experts)",
        ));
    }
    Ok(())
}
