//! The description's sections, as typed pieces.

use crate::convert::arch::Arch;
use crate::format::mlb::header::layer_flag;

/// What the converter knows about a model.
#[derive(Debug, Clone)]
pub struct ModelDesc {
    pub arch: &'static Arch,
    /// The wrapper's model_type when the config is multimodal.
    pub wrapper: Option<String>,
    pub dims: Dims,
    pub ffn: Ffn,
    pub vocab: Vocab,
    pub norm_eps: f64,
    pub rope: Rope,
    /// The sliding window of the layers flagged `sliding`.
    pub sliding_window: Option<usize>,
    /// One entry per layer.
    pub layers: Vec<LayerFlags>,
    pub scales: AttnScales,
    /// The delta rule's dimensions, when some layer is `linear`.
    pub linear: Option<LinearDims>,
    /// The experts, when some layer is `moe`.
    pub moe: Option<Moe>,
    /// How the model's own embeddings pool (`header::pooling`; sentence-transformers'
    /// pooling config), a hint for embedding servers.
    pub pooling: u32,
    /// Remarks for the user (skipped parts, clamped values).
    pub notes: Vec<String>,
}

/// The sizes of the attention and the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub n_layers: usize,
    /// The residual stream's width.
    pub dim: usize,
    /// Query heads; key/value heads (fewer with grouped-query attention).
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// The context, clamped to the format's limit.
    pub max_seq: usize,
}

/// The feed-forward block of every layer: a gated MLP of `hidden_dim` with `act` (in a
/// mixture-of-experts model, of the dense layers; the experts' width when there are
/// none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ffn {
    pub hidden_dim: usize,
    /// The header's `act` code.
    pub act: u32,
}

/// The vocabulary and the classifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vocab {
    pub size: usize,
    /// The classifier is the embedding matrix.
    pub tied: bool,
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low: f64,
        high: f64,
        orig: u32,
    },
    Yarn(Yarn),
}

/// Yarn's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// The original context.
    pub orig: u32,
    /// The attention factor (mscale).
    pub attn_factor: f64,
    /// The correction range is rounded to whole dimensions (false: gpt-oss's
    /// `truncate: false`, rope_type 4).
    pub truncate: bool,
}

/// Rotary position embeddings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The base as transformers uses it (before the header's partial-rotary rewrite).
    pub theta: f64,
    pub scaling: RopeScaling,
    /// The base of the layers flagged `local_rope` (unscaled).
    pub local_theta: Option<f64>,
    /// Rotated dimensions per head (head_dim when all).
    pub rot_dim: usize,
}

/// One layer's flags, as the header's per-layer flag byte stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerFlags {
    pub linear: bool,
    pub sliding: bool,
    pub local_rope: bool,
    pub no_rope: bool,
    /// The FFN is the mixture of experts.
    pub moe: bool,
}

/// Attention and logit scales beyond the defaults ([`Scales::Gemma`](crate::convert::arch::Scales)).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttnScales {
    /// The attention scale (None: 1/sqrt(head_dim)).
    pub attn: Option<f64>,
    pub attn_softcap: Option<f64>,
    pub final_softcap: Option<f64>,
}

/// The gated delta rule's dimensions (Qwen3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearDims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv: usize,
}

/// The mixture of experts of the layers flagged `moe` (the family's
/// [`MoeArch`](crate::convert::arch::MoeArch) says which biases and gates it has).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moe {
    /// Routed experts per layer, and experts per token.
    pub n_experts: usize,
    pub n_used: usize,
    /// One routed expert's FFN width.
    pub expert_hidden: usize,
    /// The header's `moe_gating`.
    pub gating: u32,
    /// The shared expert's FFN width (0: none).
    pub shared_hidden: usize,
    /// gpt-oss's clamped SwiGLU: (limit, alpha).
    pub swiglu: Option<(f32, f32)>,
}

impl LayerFlags {
    /// The flag byte.
    pub fn bits(self) -> u8 {
        let mut f = 0;
        if self.sliding {
            f |= layer_flag::SLIDING;
        }
        if self.local_rope {
            f |= layer_flag::LOCAL_ROPE;
        }
        if self.no_rope {
            f |= layer_flag::NO_ROPE;
        }
        if self.linear {
            f |= layer_flag::LINEAR;
        }
        if self.moe {
            f |= layer_flag::MOE;
        }
        f
    }

    /// The flags of a flag byte.
    pub fn of_bits(f: u8) -> LayerFlags {
        LayerFlags {
            linear: f & layer_flag::LINEAR != 0,
            sliding: f & layer_flag::SLIDING != 0,
            local_rope: f & layer_flag::LOCAL_ROPE != 0,
            no_rope: f & layer_flag::NO_ROPE != 0,
            moe: f & layer_flag::MOE != 0,
        }
    }
}
