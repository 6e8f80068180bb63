//! One table per architecture: `model_type`s, transformers' config defaults, what the
//! model computes (norm offset, activation, biases, q/k norm, Gemma's scales), and
//! which Hugging Face tensor becomes which spec array with which transform.
//!
//! Defaults are transformers 5.24's config class defaults, used only when config.json
//! omits the key.

use crate::quant::Q4Rule;

/// How a Hugging Face tensor becomes a spec array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// As stored.
    Plain,
    /// An RMSNorm weight: w + 1 where the architecture computes x·(1 + w).
    Norm,
    /// Rows (or elements) permuted per head from rotate-half to interleaved pairs.
    Rope,
    /// A per-head q/k norm (head_dim): permuted like the rows, plus the norm offset.
    RopeNorm,
    /// Qwen3.5's q_proj → wq (query rows of each head, permuted).
    GateQuery,
    /// Qwen3.5's q_proj → wg (gate rows of each head).
    GateGate,
    /// A depthwise conv1d weight [C, 1, K] → C × K floats.
    Conv,
}

/// Which spec array comes from which tensor, relative to `layers.N.` (layer arrays) or
/// to the text model's prefix (`embed_tokens`, `norm`); `wcls` is relative to the
/// classifier's prefix.
pub type NameTable = &'static [(&'static str, &'static str, Transform)];

use Transform::*;

/// The arrays every architecture names alike: the embedding, the attention's input
/// norm, k/v/o projections, the per-head q/k norms (when present), the gated MLP, the
/// final norm and the classifier.
const COMMON_NAMES: NameTable = &[
    ("tok_emb", "embed_tokens.weight", Plain),
    ("attn_norm", "input_layernorm.weight", Norm),
    ("wk", "self_attn.k_proj.weight", Rope),
    ("wv", "self_attn.v_proj.weight", Plain),
    ("wo", "self_attn.o_proj.weight", Plain),
    ("q_norm", "self_attn.q_norm.weight", RopeNorm),
    ("k_norm", "self_attn.k_norm.weight", RopeNorm),
    ("w1", "mlp.gate_proj.weight", Plain),
    ("w2", "mlp.down_proj.weight", Plain),
    ("w3", "mlp.up_proj.weight", Plain),
    ("final_norm", "norm.weight", Norm),
    ("wcls", "lm_head.weight", Plain),
];

/// Llama, Mistral, Qwen2, Qwen3, SmolLM3: pre-norm layers with a gated SiLU MLP.
const LLAMA_NAMES: &[NameTable] = &[
    COMMON_NAMES,
    &[
        ("wq", "self_attn.q_proj.weight", Rope),
        ("bq", "self_attn.q_proj.bias", Rope),
        ("bk", "self_attn.k_proj.bias", Rope),
        ("bv", "self_attn.v_proj.bias", Plain),
        ("ffn_norm", "post_attention_layernorm.weight", Norm),
    ],
];

/// Gemma 2 and 3: four norms per layer. transformers' post_attention_layernorm is the
/// norm of the attention output (spec post_attn_norm), pre_feedforward_layernorm the
/// FFN's input norm (spec ffn_norm).
const GEMMA_NAMES: &[NameTable] = &[
    COMMON_NAMES,
    &[
        ("wq", "self_attn.q_proj.weight", Rope),
        ("ffn_norm", "pre_feedforward_layernorm.weight", Norm),
        ("post_attn_norm", "post_attention_layernorm.weight", Norm),
        ("post_ffn_norm", "post_feedforward_layernorm.weight", Norm),
    ],
];

/// Qwen3.5: gated attention layers and gated-delta-rule layers. The delta rule's
/// gated norm (linear_attn.norm) is x·w, so it is Plain, unlike every other norm.
const QWEN35_NAMES: &[NameTable] = &[
    COMMON_NAMES,
    &[
        ("wq", "self_attn.q_proj.weight", GateQuery),
        ("wg", "self_attn.q_proj.weight", GateGate),
        ("lqkv", "linear_attn.in_proj_qkv.weight", Plain),
        ("lz", "linear_attn.in_proj_z.weight", Plain),
        ("lb", "linear_attn.in_proj_b.weight", Plain),
        ("la", "linear_attn.in_proj_a.weight", Plain),
        ("lconv", "linear_attn.conv1d.weight", Conv),
        ("dt_bias", "linear_attn.dt_bias", Plain),
        ("A_log", "linear_attn.A_log", Plain),
        ("lnorm", "linear_attn.norm.weight", Plain),
        ("lout", "linear_attn.out_proj.weight", Plain),
        ("ffn_norm", "post_attention_layernorm.weight", Norm),
    ],
];

/// Which layers attend through the sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    /// Never (the config has no window).
    None,
    /// `sliding_window`, when set, applies to every layer (Mistral ignores layer_types).
    AllLayers,
    /// The layers `layer_types` marks "sliding_attention", when `use_sliding_window`
    /// is true (Qwen2, Qwen3, SmolLM3 drop the window otherwise).
    LayerTypesIfUsed,
    /// The layers `layer_types` marks "sliding_attention" (Gemma).
    LayerTypes,
}

/// How transformers fills `layer_types` when config.json has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultLayerTypes {
    /// Every layer full attention.
    Full,
    /// Qwen2/Qwen3: sliding from `max_window_layers` on, when a window is used.
    MaxWindowLayers,
    /// Gemma 2: sliding when (i + 1) % 2 != 0.
    Alternate,
    /// Gemma 3: sliding when (i + 1) % sliding_window_pattern != 0 (default 6).
    Pattern,
    /// SmolLM3: sliding on the no-RoPE layers, when a window is used.
    SmolLM3,
    /// Qwen3.5: linear attention when (i + 1) % full_attention_interval != 0 (default 4).
    LinearInterval,
}

/// Qwen3.5's gated-delta-rule dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearDims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv: usize,
}

/// One architecture.
#[derive(Debug)]
pub struct Arch {
    /// Canonical name (the text model's `model_type`).
    pub name: &'static str,
    pub model_types: &'static [&'static str],
    /// The name tables, searched in order (each spec array stands in one of them).
    pub names: &'static [NameTable],
    /// RMSNorms compute x·(1 + w): stored weights are w + 1.
    pub norm_plus_one: bool,
    /// The config key of the FFN activation and its default.
    pub act_key: &'static str,
    pub default_act: &'static str,
    pub default_tie: bool,
    pub default_theta: f64,
    /// Gemma 3's sliding layers: RoPE base default.
    pub default_local_theta: Option<f64>,
    /// head_dim when the config omits it (None: dim / n_heads).
    pub default_head_dim: Option<usize>,
    pub default_max_pos: usize,
    pub default_rms_eps: f64,
    /// q, k, v projections always have biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm.
    pub qk_norm: bool,
    /// Gemma's post-attention and post-FFN norms.
    pub post_norms: bool,
    /// Gemma: embed_scale = sqrt(dim), attn_scale = query_pre_attn_scalar^-0.5, softcaps.
    pub gemma: bool,
    /// Gemma 2's softcap defaults (attention, final); None for no cap.
    pub default_softcaps: (Option<f64>, Option<f64>),
    pub window: Window,
    pub default_layer_types: DefaultLayerTypes,
    /// Default partial_rotary_factor (Qwen3.5: 0.25).
    pub default_partial_rotary: f64,
    /// Attention output gate and gated-delta-rule layers (Qwen3.5).
    pub qwen35: bool,
    /// The gated-delta-rule layers' dimensions where config.json omits them (with
    /// `qwen35`).
    pub default_linear: Option<LinearDims>,
    /// The Q4_0 rounding of `--wtype q4_0` without `--q4-rule`: llama.cpp's round rule
    /// for Gemma 3 (whose reference quantizations use it), the search elsewhere.
    pub default_q4_rule: Q4Rule,
    /// SmolLM3's no_rope_layers.
    pub no_rope_layers: bool,
    /// Multimodal wrappers of this text model: (wrapper model_type).
    pub wrappers: &'static [&'static str],
}

const BASE: Arch = Arch {
    name: "",
    model_types: &[],
    names: LLAMA_NAMES,
    norm_plus_one: false,
    act_key: "hidden_act",
    default_act: "silu",
    default_tie: false,
    default_theta: 10_000.0,
    default_local_theta: None,
    default_head_dim: None,
    default_max_pos: 2048,
    default_rms_eps: 1e-6,
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    gemma: false,
    default_softcaps: (None, None),
    window: Window::None,
    default_layer_types: DefaultLayerTypes::Full,
    default_partial_rotary: 1.0,
    qwen35: false,
    default_linear: None,
    default_q4_rule: Q4Rule::Search,
    no_rope_layers: false,
    wrappers: &[],
};

/// Every supported architecture.
pub const ARCHS: &[Arch] = &[
    Arch {
        name: "llama",
        model_types: &["llama"],
        ..BASE
    },
    Arch {
        name: "mistral",
        model_types: &["mistral"],
        default_max_pos: 4096 * 32,
        window: Window::AllLayers,
        ..BASE
    },
    Arch {
        name: "qwen2",
        model_types: &["qwen2"],
        qkv_bias: true,
        default_max_pos: 32768,
        window: Window::LayerTypesIfUsed,
        default_layer_types: DefaultLayerTypes::MaxWindowLayers,
        ..BASE
    },
    Arch {
        name: "qwen3",
        model_types: &["qwen3"],
        qk_norm: true,
        default_head_dim: Some(128),
        default_max_pos: 32768,
        window: Window::LayerTypesIfUsed,
        default_layer_types: DefaultLayerTypes::MaxWindowLayers,
        ..BASE
    },
    Arch {
        name: "smollm3",
        model_types: &["smollm3"],
        default_tie: true,
        default_theta: 2_000_000.0,
        default_max_pos: 32768,
        window: Window::LayerTypesIfUsed,
        default_layer_types: DefaultLayerTypes::SmolLM3,
        no_rope_layers: true,
        ..BASE
    },
    Arch {
        name: "gemma2",
        model_types: &["gemma2"],
        names: GEMMA_NAMES,
        norm_plus_one: true,
        act_key: "hidden_activation",
        default_act: "gelu_pytorch_tanh",
        default_tie: true,
        default_head_dim: Some(256),
        default_max_pos: 8192,
        post_norms: true,
        gemma: true,
        default_softcaps: (Some(50.0), Some(30.0)),
        window: Window::LayerTypes,
        default_layer_types: DefaultLayerTypes::Alternate,
        ..BASE
    },
    Arch {
        name: "gemma3_text",
        model_types: &["gemma3_text"],
        names: GEMMA_NAMES,
        norm_plus_one: true,
        act_key: "hidden_activation",
        default_act: "gelu_pytorch_tanh",
        default_tie: true,
        default_theta: 1_000_000.0,
        default_local_theta: Some(10_000.0),
        default_head_dim: Some(256),
        default_max_pos: 131_072,
        qk_norm: true,
        post_norms: true,
        gemma: true,
        window: Window::LayerTypes,
        default_layer_types: DefaultLayerTypes::Pattern,
        default_q4_rule: Q4Rule::Round,
        wrappers: &["gemma3"],
        ..BASE
    },
    Arch {
        name: "qwen3_5_text",
        model_types: &["qwen3_5_text"],
        names: QWEN35_NAMES,
        norm_plus_one: true,
        default_head_dim: Some(256),
        default_max_pos: 32768,
        qk_norm: true,
        default_layer_types: DefaultLayerTypes::LinearInterval,
        default_partial_rotary: 0.25,
        qwen35: true,
        default_linear: Some(LinearDims {
            k_heads: 16,
            v_heads: 32,
            k_dim: 128,
            v_dim: 128,
            conv: 4,
        }),
        wrappers: &["qwen3_5"],
        ..BASE
    },
];

/// The architecture of a text `model_type`.
pub fn by_model_type(t: &str) -> Option<&'static Arch> {
    ARCHS.iter().find(|a| a.model_types.contains(&t))
}

/// The architecture whose multimodal wrapper is `t`.
pub fn by_wrapper(t: &str) -> Option<&'static Arch> {
    ARCHS.iter().find(|a| a.wrappers.contains(&t))
}

/// Every accepted model_type (for error messages and docs).
pub fn model_types() -> Vec<&'static str> {
    let mut v = Vec::new();
    for a in ARCHS {
        v.extend_from_slice(a.model_types);
        v.extend_from_slice(a.wrappers);
    }
    v
}

impl Arch {
    /// The HF name (relative) and transform of spec array `spec`.
    pub fn source(&self, spec: &str) -> Option<(&'static str, Transform)> {
        self.names
            .iter()
            .flat_map(|t| t.iter())
            .find(|(s, _, _)| *s == spec)
            .map(|(_, hf, t)| (*hf, *t))
    }
}
