//! One table per architecture as Hugging Face stores it: `model_type`s, transformers'
//! config defaults, which Hugging Face tensor becomes which spec array with which
//! transform, and the family ([`Arch`]: what the model computes).
//!
//! Defaults are transformers 5.24's config class defaults, used only when config.json
//! omits the key.

use crate::convert::arch::{self, Arch};
use crate::convert::desc::LinearDims;

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
    /// A 2-D tensor read as one vector of floats (a router [E, dim], a gate [1, dim]).
    Flat,
    /// One tensor per expert, `{e}` in the name standing for the expert's number: the
    /// experts' rows stacked, expert 0's first.
    Experts,
    /// One 3-D tensor of every expert stored input-major, [E, in, W] (gpt-oss): row i
    /// of expert e is column `first + step·i` of its slice, so a fused gate/up with
    /// interleaved columns gives its gate (0, 2) and up (1, 2) rows; as a vector (a
    /// bias [E, W]), element `first + step·i` of row e. Its MXFP4 form (`_blocks` and
    /// `_scales`, [E, W, in/32, 16] output-major) is read when the tensor is absent.
    ExpertsT { first: usize, step: usize },
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

/// The query and the FFN input norm of a Llama layer, and Qwen2's biases.
const LLAMA_LAYER: NameTable = &[
    ("wq", "self_attn.q_proj.weight", Rope),
    ("bq", "self_attn.q_proj.bias", Rope),
    ("bk", "self_attn.k_proj.bias", Rope),
    ("bv", "self_attn.v_proj.bias", Plain),
    ("ffn_norm", "post_attention_layernorm.weight", Norm),
];

/// Llama, Mistral, Qwen2, Qwen3, SmolLM3: pre-norm layers with a gated SiLU MLP.
const LLAMA_NAMES: &[NameTable] = &[COMMON_NAMES, LLAMA_LAYER];

/// Qwen3-MoE, OLMoE, Qwen3.5-MoE: the router `mlp.gate` and one tensor per expert and
/// projection, as the Hub ships them.
const MLP_EXPERTS: NameTable = &[
    ("router", "mlp.gate.weight", Flat),
    ("ew1", "mlp.experts.{e}.gate_proj.weight", Experts),
    ("ew2", "mlp.experts.{e}.down_proj.weight", Experts),
    ("ew3", "mlp.experts.{e}.up_proj.weight", Experts),
];

/// Qwen3-MoE, OLMoE: Llama layers with experts.
const MOE_NAMES: &[NameTable] = &[COMMON_NAMES, LLAMA_LAYER, MLP_EXPERTS];

/// Mixtral: the experts' w1 (gate), w2 (down), w3 (up) under `block_sparse_moe`.
const MIXTRAL_NAMES: &[NameTable] = &[
    COMMON_NAMES,
    LLAMA_LAYER,
    &[
        ("router", "block_sparse_moe.gate.weight", Flat),
        ("ew1", "block_sparse_moe.experts.{e}.w1.weight", Experts),
        ("ew2", "block_sparse_moe.experts.{e}.w2.weight", Experts),
        ("ew3", "block_sparse_moe.experts.{e}.w3.weight", Experts),
    ],
];

/// gpt-oss's fused gate/up experts: the gate in the even columns, the up in the odd.
const GATE_COLS: Transform = ExpertsT { first: 0, step: 2 };
const UP_COLS: Transform = ExpertsT { first: 1, step: 2 };
/// gpt-oss's down experts: every column.
const ALL_COLS: Transform = ExpertsT { first: 0, step: 1 };

/// gpt-oss: the o_proj bias, the sinks, a router with a bias, and the experts as two
/// 3-D tensors stored input-major: gate_up_proj [E, dim, 2·eh] with gate and up in
/// alternate columns, down_proj [E, eh, dim]; their biases alike.
const GPT_OSS_NAMES: &[NameTable] = &[
    COMMON_NAMES,
    LLAMA_LAYER,
    &[
        ("bo", "self_attn.o_proj.bias", Plain),
        ("sinks", "self_attn.sinks", Plain),
        ("router", "mlp.router.weight", Flat),
        ("router_b", "mlp.router.bias", Plain),
        ("ew1", "mlp.experts.gate_up_proj", GATE_COLS),
        ("ew3", "mlp.experts.gate_up_proj", UP_COLS),
        ("ew2", "mlp.experts.down_proj", ALL_COLS),
        ("eb1", "mlp.experts.gate_up_proj_bias", GATE_COLS),
        ("eb3", "mlp.experts.gate_up_proj_bias", UP_COLS),
        ("eb2", "mlp.experts.down_proj_bias", ALL_COLS),
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

/// Qwen3.5-MoE: Qwen3.5's layers, the experts, and a shared expert behind a gate.
const QWEN35_MOE_NAMES: &[NameTable] = &[
    QWEN35_NAMES[0],
    QWEN35_NAMES[1],
    MLP_EXPERTS,
    &[
        ("sw1", "mlp.shared_expert.gate_proj.weight", Plain),
        ("sw2", "mlp.shared_expert.down_proj.weight", Plain),
        ("sw3", "mlp.shared_expert.up_proj.weight", Plain),
        ("sgate", "mlp.shared_expert_gate.weight", Flat),
    ],
];

/// Which layers attend through the sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    /// Never (the config has no window).
    None,
    /// `sliding_window`, when set, applies to every layer (Mistral ignores layer_types).
    AllLayers,
    /// `sliding_window` applies to every layer when `use_sliding_window` is true
    /// (Qwen3-MoE).
    AllLayersIfUsed,
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

/// One architecture as Hugging Face stores it.
#[derive(Debug)]
pub struct HfArch {
    /// What the model computes.
    pub arch: &'static Arch,
    pub model_types: &'static [&'static str],
    /// The name tables, searched in order (each spec array stands in one of them).
    pub names: &'static [NameTable],
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
    /// Gemma 2's softcap defaults (attention, final); None for no cap.
    pub default_softcaps: (Option<f64>, Option<f64>),
    pub window: Window,
    pub default_layer_types: DefaultLayerTypes,
    /// Default partial_rotary_factor (Qwen3.5: 0.25).
    pub default_partial_rotary: f64,
    /// The gated-delta-rule layers' dimensions where config.json omits them (for an
    /// architecture with linear attention).
    pub default_linear: Option<LinearDims>,
    /// SmolLM3's no_rope_layers.
    pub no_rope_layers: bool,
    /// Multimodal wrappers of this text model: (wrapper model_type).
    pub wrappers: &'static [&'static str],
    /// The config keys of the experts (an architecture whose family has them).
    pub moe: Option<HfMoe>,
}

/// Where a mixture-of-experts config keeps its experts, with transformers' defaults.
#[derive(Debug)]
pub struct HfMoe {
    /// The key of the number of experts (transformers 5 also writes
    /// `num_local_experts` where the class reads `num_experts`: both are read).
    pub experts_key: &'static str,
    pub default_experts: usize,
    pub default_used: usize,
    /// The key of one expert's FFN width, and its default.
    pub hidden_key: &'static str,
    pub default_hidden: usize,
    /// `decoder_sparse_step` and `mlp_only_layers` choose the MoE layers (Qwen3-MoE);
    /// else every layer's FFN is the experts.
    pub sparse_layers: bool,
    /// The shared expert's width key and default.
    pub shared_key: Option<(&'static str, usize)>,
    /// `norm_topk_prob` when config.json omits it (families whose routing it chooses).
    pub default_norm_topk: bool,
    /// gpt-oss's clamped SwiGLU: the defaults of `swiglu_limit` and `swiglu_alpha`.
    pub default_swiglu: Option<(f64, f64)>,
}

/// The keys most MoE configs use.
const HF_MOE: HfMoe = HfMoe {
    experts_key: "num_experts",
    default_experts: 8,
    default_used: 2,
    hidden_key: "intermediate_size",
    default_hidden: 14336,
    sparse_layers: false,
    shared_key: None,
    default_norm_topk: false,
    default_swiglu: None,
};

const BASE: HfArch = HfArch {
    arch: &arch::LLAMA,
    model_types: &[],
    names: LLAMA_NAMES,
    act_key: "hidden_act",
    default_act: "silu",
    default_tie: false,
    default_theta: 10_000.0,
    default_local_theta: None,
    default_head_dim: None,
    default_max_pos: 2048,
    default_rms_eps: 1e-6,
    default_softcaps: (None, None),
    window: Window::None,
    default_layer_types: DefaultLayerTypes::Full,
    default_partial_rotary: 1.0,
    default_linear: None,
    no_rope_layers: false,
    wrappers: &[],
    moe: None,
};

/// Gemma 2 (Gemma 3 differs from it where its row says).
const GEMMA2: HfArch = HfArch {
    arch: &arch::GEMMA2,
    model_types: &["gemma2"],
    names: GEMMA_NAMES,
    act_key: "hidden_activation",
    default_act: "gelu_pytorch_tanh",
    default_tie: true,
    default_head_dim: Some(256),
    default_max_pos: 8192,
    default_softcaps: (Some(50.0), Some(30.0)),
    window: Window::LayerTypes,
    default_layer_types: DefaultLayerTypes::Alternate,
    ..BASE
};

/// Qwen3.5 (Qwen3.5-MoE differs from it where its row says).
const QWEN35: HfArch = HfArch {
    arch: &arch::QWEN35,
    model_types: &["qwen3_5_text"],
    names: QWEN35_NAMES,
    default_head_dim: Some(256),
    default_max_pos: 32768,
    default_layer_types: DefaultLayerTypes::LinearInterval,
    default_partial_rotary: 0.25,
    default_linear: Some(LinearDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
        conv: 4,
    }),
    wrappers: &["qwen3_5"],
    ..BASE
};

/// Every supported architecture.
pub const ARCHS: &[HfArch] = &[
    HfArch {
        arch: &arch::LLAMA,
        model_types: &["llama"],
        ..BASE
    },
    HfArch {
        arch: &arch::MISTRAL,
        model_types: &["mistral"],
        default_max_pos: 4096 * 32,
        window: Window::AllLayers,
        ..BASE
    },
    HfArch {
        arch: &arch::QWEN2,
        model_types: &["qwen2"],
        default_max_pos: 32768,
        window: Window::LayerTypesIfUsed,
        default_layer_types: DefaultLayerTypes::MaxWindowLayers,
        ..BASE
    },
    HfArch {
        arch: &arch::QWEN3,
        model_types: &["qwen3"],
        default_head_dim: Some(128),
        default_max_pos: 32768,
        window: Window::LayerTypesIfUsed,
        default_layer_types: DefaultLayerTypes::MaxWindowLayers,
        ..BASE
    },
    HfArch {
        arch: &arch::SMOLLM3,
        model_types: &["smollm3"],
        default_tie: true,
        default_theta: 2_000_000.0,
        default_max_pos: 32768,
        window: Window::LayerTypesIfUsed,
        default_layer_types: DefaultLayerTypes::SmolLM3,
        no_rope_layers: true,
        ..BASE
    },
    GEMMA2,
    HfArch {
        arch: &arch::GEMMA3,
        model_types: &["gemma3_text"],
        default_theta: 1_000_000.0,
        default_local_theta: Some(10_000.0),
        default_max_pos: 131_072,
        default_softcaps: (None, None),
        default_layer_types: DefaultLayerTypes::Pattern,
        wrappers: &["gemma3"],
        ..GEMMA2
    },
    QWEN35,
    HfArch {
        arch: &arch::QWEN3_MOE,
        model_types: &["qwen3_moe"],
        names: MOE_NAMES,
        default_max_pos: 32768,
        window: Window::AllLayersIfUsed,
        moe: Some(HfMoe {
            default_experts: 128,
            default_used: 8,
            hidden_key: "moe_intermediate_size",
            default_hidden: 768,
            sparse_layers: true,
            ..HF_MOE
        }),
        ..BASE
    },
    HfArch {
        arch: &arch::OLMOE,
        model_types: &["olmoe"],
        names: MOE_NAMES,
        default_max_pos: 4096,
        default_rms_eps: 1e-5,
        moe: Some(HfMoe {
            default_experts: 64,
            default_used: 8,
            default_hidden: 2048,
            ..HF_MOE
        }),
        ..BASE
    },
    HfArch {
        arch: &arch::MIXTRAL,
        model_types: &["mixtral"],
        names: MIXTRAL_NAMES,
        default_max_pos: 4096 * 32,
        default_rms_eps: 1e-5,
        window: Window::AllLayers,
        moe: Some(HfMoe {
            experts_key: "num_local_experts",
            ..HF_MOE
        }),
        ..BASE
    },
    HfArch {
        arch: &arch::GPT_OSS,
        model_types: &["gpt_oss"],
        names: GPT_OSS_NAMES,
        default_theta: 150_000.0,
        default_head_dim: Some(64),
        default_max_pos: 131_072,
        default_rms_eps: 1e-5,
        window: Window::LayerTypes,
        default_layer_types: DefaultLayerTypes::Alternate,
        moe: Some(HfMoe {
            experts_key: "num_local_experts",
            default_experts: 128,
            default_used: 4,
            default_hidden: 2880,
            default_swiglu: Some((7.0, 1.702)),
            ..HF_MOE
        }),
        ..BASE
    },
    HfArch {
        arch: &arch::QWEN35_MOE,
        model_types: &["qwen3_5_moe_text"],
        names: QWEN35_MOE_NAMES,
        wrappers: &["qwen3_5_moe"],
        moe: Some(HfMoe {
            default_experts: 256,
            default_used: 8,
            hidden_key: "moe_intermediate_size",
            default_hidden: 512,
            shared_key: Some(("shared_expert_intermediate_size", 512)),
            ..HF_MOE
        }),
        ..QWEN35
    },
];

/// The architecture of a text `model_type`.
pub fn by_model_type(t: &str) -> Option<&'static HfArch> {
    ARCHS.iter().find(|a| a.model_types.contains(&t))
}

/// The table of family `a`.
pub fn by_arch(a: &Arch) -> &'static HfArch {
    ARCHS
        .iter()
        .find(|h| h.arch.name == a.name)
        .expect("every family has a Hugging Face table")
}

/// The architecture whose multimodal wrapper is `t`.
pub fn by_wrapper(t: &str) -> Option<&'static HfArch> {
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

impl HfArch {
    /// The HF name (relative) and transform of spec array `spec`.
    pub fn source(&self, spec: &str) -> Option<(&'static str, Transform)> {
        self.names
            .iter()
            .flat_map(|t| t.iter())
            .find(|(s, _, _)| *s == spec)
            .map(|(_, hf, t)| (*hf, *t))
    }
}
