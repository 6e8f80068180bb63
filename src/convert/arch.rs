//! One row per model family: what the model computes, whatever file it comes from.
//! The readers' own tables point here (`hf::arch::HfArch::arch`,
//! `gguf::arch::GgufArch::arch`), and the model description's rules
//! ([`ModelDesc::check`](super::desc::ModelDesc::check)) and header fields read these
//! rows instead of asking which family a model is.

use crate::format::mlb::header::{act, moe_gating};
use crate::quant::Q4Rule;

/// Scales the family applies beyond the spec's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scales {
    /// None: embeddings as stored, attention by 1/sqrt(head_dim), no softcaps.
    None,
    /// Gemma: embeddings times sqrt(dim), attention by its own scale (the readers say
    /// which), attention and final logit softcaps.
    Gemma,
}

/// One model family.
#[derive(Debug)]
pub struct Arch {
    /// Canonical name (the Hugging Face text model's `model_type`).
    pub name: &'static str,
    /// RMSNorms compute x·(1 + w) (the `.mlb` stores w + 1).
    pub norm_plus_one: bool,
    /// q, k, v projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm.
    pub qk_norm: bool,
    /// Post-attention and post-FFN norms (Gemma).
    pub post_norms: bool,
    pub scales: Scales,
    /// A sigmoid gate on the attention output (Qwen3.5).
    pub attn_gate: bool,
    /// Gated-delta-rule layers besides attention ones (Qwen3.5).
    pub linear_attention: bool,
    /// RoPE may rotate part of each head (rot_dim < head_dim).
    pub partial_rotary: bool,
    /// The activation the layers need, if only one will do (Qwen3.5's delta rule and
    /// MLP: SiLU).
    pub act: Option<u32>,
    /// The Q4_0 rounding without `--q4-rule`: llama.cpp's round rule for Gemma 3 (whose
    /// reference quantizations use it), the search elsewhere.
    pub default_q4_rule: Q4Rule,
    /// The q/k norms are over the whole projection, not per head (OLMoE: qk_norm 2).
    pub qk_norm_whole: bool,
    /// The output projection has a bias too (gpt-oss: qkv_bias 2).
    pub o_bias: bool,
    /// A learned sink logit per query head (gpt-oss).
    pub attn_sinks: bool,
    /// The FFN is a mixture of experts (in every layer the reader marks so).
    pub moe: Option<MoeArch>,
}

/// What a mixture-of-experts family computes (docs/file-format.md, "Mixture of
/// experts").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeArch {
    /// The routing rule (`moe_gating`), or `None` when the model's config chooses
    /// between 0 and 1 (`norm_topk_prob`).
    pub gating: Option<u32>,
    /// The router has a bias.
    pub router_bias: bool,
    /// Every expert's products have biases.
    pub expert_bias: bool,
    /// A shared expert, when the model has one, is scaled by a sigmoid gate.
    pub shared_gate: bool,
    /// The experts use gpt-oss's clamped SwiGLU (limit and alpha from the reader).
    pub clamped_swiglu: bool,
}

/// Routing as most families do it: softmax over all experts, top-k, renormalised or
/// not as the config says; no biases, no shared expert gate.
const MOE_BASE: MoeArch = MoeArch {
    gating: None,
    router_bias: false,
    expert_bias: false,
    shared_gate: false,
    clamped_swiglu: false,
};

/// The fields most families share: a Llama.
const BASE: Arch = Arch {
    name: "",
    norm_plus_one: false,
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    scales: Scales::None,
    attn_gate: false,
    linear_attention: false,
    partial_rotary: false,
    act: None,
    default_q4_rule: Q4Rule::Search,
    qk_norm_whole: false,
    o_bias: false,
    attn_sinks: false,
    moe: None,
};

/// A family that computes what the base does.
const fn family(name: &'static str) -> Arch {
    Arch { name, ..BASE }
}

/// Llama 1-3, SmolLM2: the base.
pub const LLAMA: Arch = family("llama");

/// Mistral (its window is the reader's: every layer).
pub const MISTRAL: Arch = family("mistral");

/// SmolLM3 (its no-RoPE layers are the reader's).
pub const SMOLLM3: Arch = family("smollm3");

/// Qwen2: q/k/v biases.
pub const QWEN2: Arch = Arch {
    qkv_bias: true,
    ..family("qwen2")
};

/// Qwen3: per-head q/k norms.
pub const QWEN3: Arch = Arch {
    qk_norm: true,
    ..family("qwen3")
};

/// Gemma 2: (1 + w) norms, post norms, Gemma's scales.
pub const GEMMA2: Arch = Arch {
    norm_plus_one: true,
    post_norms: true,
    scales: Scales::Gemma,
    ..family("gemma2")
};

/// Gemma 3: Gemma 2's, with q/k norms and llama.cpp's Q4_0 rounding.
pub const GEMMA3: Arch = Arch {
    name: "gemma3_text",
    qk_norm: true,
    default_q4_rule: Q4Rule::Round,
    ..GEMMA2
};

/// Qwen3.5: gated attention and gated-delta-rule layers, partial rotary, SiLU.
pub const QWEN35: Arch = Arch {
    norm_plus_one: true,
    qk_norm: true,
    attn_gate: true,
    linear_attention: true,
    partial_rotary: true,
    act: Some(act::SILU),
    ..family("qwen3_5_text")
};

/// Qwen3-MoE: Qwen3 with experts (renormalised with `norm_topk_prob`); some layers may
/// stay dense (`mlp_only_layers`, `decoder_sparse_step`).
pub const QWEN3_MOE: Arch = Arch {
    moe: Some(MOE_BASE),
    ..family_qk("qwen3_moe")
};

/// OLMoE: q/k norms over the whole projection, softmax top-k (renormalised with
/// `norm_topk_prob`).
pub const OLMOE: Arch = Arch {
    qk_norm_whole: true,
    moe: Some(MOE_BASE),
    ..family_qk("olmoe")
};

/// Mixtral: a Mistral with experts, top-k always renormalised.
pub const MIXTRAL: Arch = Arch {
    moe: Some(MoeArch {
        gating: Some(moe_gating::SOFTMAX_TOPK_NORM),
        ..MOE_BASE
    }),
    ..family("mixtral")
};

/// gpt-oss: q/k/v/o biases, attention sinks; a router with a bias, top-k on the logits
/// then softmax over the k, expert biases, clamped SwiGLU.
pub const GPT_OSS: Arch = Arch {
    qkv_bias: true,
    o_bias: true,
    attn_sinks: true,
    moe: Some(MoeArch {
        gating: Some(moe_gating::TOPK_SOFTMAX),
        router_bias: true,
        expert_bias: true,
        shared_gate: false,
        clamped_swiglu: true,
    }),
    ..family("gpt_oss")
};

/// Qwen3.5-MoE: the Qwen3.5 hybrid with experts (top-k renormalised) and a shared
/// expert behind a sigmoid gate.
pub const QWEN35_MOE: Arch = Arch {
    name: "qwen3_5_moe_text",
    moe: Some(MoeArch {
        gating: Some(moe_gating::SOFTMAX_TOPK_NORM),
        shared_gate: true,
        ..MOE_BASE
    }),
    ..QWEN35
};

/// A family with per-head q/k norms.
const fn family_qk(name: &'static str) -> Arch {
    Arch {
        qk_norm: true,
        ..family(name)
    }
}
