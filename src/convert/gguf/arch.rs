//! One table per GGUF architecture (llama.cpp's `general.architecture`): the family it
//! is ([`Arch`]), whether llama.cpp keeps q/k rows in Hugging Face's rotate-half order,
//! what llama.cpp computes on its own (activation, no-RoPE layers, sliding window,
//! softcaps, attention scale), which metadata keys it reads, and which GGUF tensor is
//! which spec array.
//!
//! Facts from llama.cpp (convert_hf_to_gguf.py and src/models/*.cpp of the vendored
//! copy in llama-cpp-python 0.3.36):
//! - `llama` and `smollm3` use llama.cpp's "normal" RoPE on consecutive pairs: the
//!   converter permutes the q/k rows of every head (`LlamaModel.permute`) into exactly
//!   the interleaved order the spec wants, so the rows are copied as they are.
//! - `qwen2`, `qwen3`, `gemma2`, `gemma3` and `qwen35` use NEOX (rotate-half) RoPE: the
//!   rows are Hugging Face's, and the converter applies the spec's permutation
//!   (`permute.rs`) to whole rows, which moves quantized blocks without touching them.
//! - Gemma and Qwen3.5 norms are stored as w + 1 by llama.cpp's converter, as in .mlb.
//! - `qwen35`: llama.cpp's converter tiles the delta rule's value heads
//!   (`_reorder_v_heads`), stores `ssm_a = −exp(A_log)` and the conv taps as [K, C];
//!   the gather maps here undo that (A_log as ln(−ssm_a), exact to float rounding).
//! - `gpt-oss` (src/models/openai-moe.cpp): NEOX RoPE on Hugging Face's rows, the
//!   FFN's input norm named `post_attention_norm`, sinks, q/k/v/o biases, the router's
//!   and experts' biases required; layers slide by a pattern of default 2; its clamped
//!   SwiGLU's limit 7 and alpha 1.702 are constants of the graph, whatever the
//!   checkpoint's config said; the yarn betas its converter writes are not read.

use crate::convert::arch::{self, Arch};
use crate::convert::desc::{Dims, ModelDesc};
use crate::format::mlb::header::{act, moe_gating};

/// How a GGUF tensor becomes a spec array (rows gathered, values changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// As stored.
    Plain,
    /// q/k rows (or bq/bk elements): the spec's RoPE permutation on NEOX architectures.
    Rope,
    /// q/k norm: permuted like the rows on NEOX architectures.
    RopeNorm,
    /// Qwen3.5's attn_q → wq: per head the first head_dim of 2·head_dim rows, permuted.
    GateQuery,
    /// Qwen3.5's attn_q → wg: per head the second head_dim rows.
    GateGate,
    /// Qwen3.5's attn_qkv: q and k rows as stored, value-head rows back to grouped order.
    VQkv,
    /// Rows in value heads of lin_v_dim (attn_gate → lz).
    VHeads,
    /// One element or row per value head (ssm_beta, ssm_alpha, ssm_dt.bias).
    VScalar,
    /// ssm_conv1d [K, C]: channels as VQkv's rows.
    VConv,
    /// ssm_a = −exp(A_log), per value head: A_log = ln(−ssm_a).
    NegExpA,
    /// ssm_out: columns in value heads back to grouped order.
    VCols,
    /// A tensor whose outermost dimension is the experts, [.., E]: the stacked
    /// ffn_{gate,up,down}_exps [cols, rows, E] (expert e's rows contiguous, as the
    /// `.mlb` stacks them), a router ffn_gate_inp [dim, E], expert biases [w, E].
    Experts,
    /// A vector stored as one column, [len, 1] (ffn_gate_inp_shexp).
    Column,
}

/// The dimensions the gathers of [`Transform`] need.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub head_dim: usize,
    pub rot_dim: usize,
    /// llama.cpp keeps q/k rows in rotate-half order (NEOX).
    pub neox: bool,
    /// Qwen3.5: key heads, value heads per key head, value head size, and the q/k rows
    /// of attn_qkv (2·K·dk); 1, 1, 1, 0 without linear attention.
    pub k_heads: usize,
    pub per_k: usize,
    pub v_dim: usize,
    pub qk_rows: usize,
}

impl Geometry {
    /// The gathers' dimensions of a model as GGUF architecture `ga` stores it.
    pub fn of(d: &ModelDesc, ga: &GgufArch) -> Geometry {
        Geometry {
            head_dim: d.dims.head_dim,
            rot_dim: d.rope.rot_dim,
            neox: ga.rows == RopeRows::RotateHalf,
            k_heads: d.linear.map_or(1, |l| l.k_heads),
            per_k: d.linear.map_or(1, |l| l.v_heads / l.k_heads),
            v_dim: d.linear.map_or(1, |l| l.v_dim),
            qk_rows: d.linear.map_or(0, |l| 2 * l.k_heads * l.k_dim),
        }
    }
}

impl Transform {
    /// The GGUF row (or element) holding the spec array's row `r`.
    pub fn src_row(self, g: &Geometry, r: usize) -> usize {
        use crate::convert::pipeline::permute::RowMap;
        let v = |x: usize, size: usize| v_head_src(x / size, g.k_heads, g.per_k) * size + x % size;
        match self {
            Rope | RopeNorm if g.neox => RowMap::Rope {
                head_dim: g.head_dim,
                rot: g.rot_dim,
            }
            .src(r),
            GateQuery => RowMap::GateQuery {
                head_dim: g.head_dim,
                rot: g.rot_dim,
            }
            .src(r),
            GateGate => RowMap::GateGate {
                head_dim: g.head_dim,
            }
            .src(r),
            VQkv | VConv if r >= g.qk_rows => g.qk_rows + v(r - g.qk_rows, g.v_dim),
            VHeads => v(r, g.v_dim),
            VScalar | NegExpA => v(r, 1),
            _ => r,
        }
    }

    /// [`src_row`](Self::src_row) in a layer with or without RoPE. A no-RoPE layer's
    /// q/k rows keep the checkpoint's order in a .mlb, while llama.cpp permutes them on
    /// every layer of a non-NEOX architecture (SmolLM3): those rows go back through
    /// the inverse permutation.
    pub fn src_row_in(self, g: &Geometry, r: usize, no_rope: bool) -> usize {
        match self {
            Rope | RopeNorm if no_rope && g.neox => r,
            Rope | RopeNorm if no_rope => {
                let (h, d) = (r / g.head_dim, r % g.head_dim);
                h * g.head_dim + crate::convert::pipeline::permute::rope_dst(d, g.rot_dim)
            }
            _ => self.src_row(g, r),
        }
    }

    /// [`moves_rows`](Self::moves_rows) in a layer with or without RoPE.
    pub fn moves_rows_in(self, g: &Geometry, no_rope: bool) -> bool {
        match self {
            Rope | RopeNorm if no_rope => !g.neox,
            _ => self.moves_rows(g),
        }
    }

    /// The GGUF dimensions (innermost first) of a spec array of `rows` × `row_len`
    /// read through this transform, in a model of `n_experts`; `None`: the usual
    /// [row_len, rows] or [rows].
    pub fn dims(self, rows: usize, row_len: usize, n_experts: usize) -> Option<Vec<u64>> {
        match self {
            Experts if row_len > 1 => Some(vec![
                row_len as u64,
                (rows / n_experts) as u64,
                n_experts as u64,
            ]),
            Experts => Some(vec![(rows / n_experts) as u64, n_experts as u64]),
            Column => Some(vec![rows as u64, 1]),
            _ => None,
        }
    }

    /// Rows of the GGUF tensor behind `rows` spec rows.
    pub fn src_rows(self, rows: usize) -> usize {
        match self {
            GateQuery | GateGate => 2 * rows,
            _ => rows,
        }
    }

    /// Whether rows are gathered (not row r from row r).
    pub fn moves_rows(self, g: &Geometry) -> bool {
        match self {
            Rope | RopeNorm => g.neox,
            GateQuery | GateGate | VQkv | VConv | VHeads | VScalar | NegExpA => true,
            _ => false,
        }
    }

    /// The GGUF column holding the spec array's column `c` (ssm_out).
    pub fn src_col(self, g: &Geometry, c: usize) -> usize {
        match self {
            VCols => v_head_src(c / g.v_dim, g.k_heads, g.per_k) * g.v_dim + c % g.v_dim,
            _ => c,
        }
    }
}

/// Tensor name of a spec array: per layer (`blk.N.` + suffix) or global.
pub type GgufNames = &'static [(&'static str, &'static str, Transform)];

use Transform::*;

/// The tensors every architecture names alike: the embedding, the attention's input
/// norm, k/v/o projections, the per-head q/k norms (when present), the gated MLP, the
/// final norm and the classifier.
const COMMON: GgufNames = &[
    ("tok_emb", "token_embd.weight", Plain),
    ("attn_norm", "attn_norm.weight", Plain),
    ("wk", "attn_k.weight", Rope),
    ("wv", "attn_v.weight", Plain),
    ("wo", "attn_output.weight", Plain),
    ("q_norm", "attn_q_norm.weight", RopeNorm),
    ("k_norm", "attn_k_norm.weight", RopeNorm),
    ("w1", "ffn_gate.weight", Plain),
    ("w2", "ffn_down.weight", Plain),
    ("w3", "ffn_up.weight", Plain),
    ("final_norm", "output_norm.weight", Plain),
    ("wcls", "output.weight", Plain),
];

/// A Llama layer's query and the q/k/v biases (Qwen2, gpt-oss); the transform matters
/// only for NEOX architectures.
const LLAMA_QKV: GgufNames = &[
    ("wq", "attn_q.weight", Rope),
    ("bq", "attn_q.bias", Rope),
    ("bk", "attn_k.bias", Rope),
    ("bv", "attn_v.bias", Plain),
];

/// The FFN's input norm of a Llama layer.
const LLAMA_FFN_NORM: GgufNames = &[("ffn_norm", "ffn_norm.weight", Plain)];

/// Llama, SmolLM3, Qwen2, Qwen3.
const LLAMA: &[GgufNames] = &[COMMON, LLAMA_QKV, LLAMA_FFN_NORM];

/// A mixture-of-experts FFN: the router and the stacked experts.
const MOE_FFN: GgufNames = &[
    ("router", "ffn_gate_inp.weight", Experts),
    ("ew1", "ffn_gate_exps.weight", Experts),
    ("ew2", "ffn_down_exps.weight", Experts),
    ("ew3", "ffn_up_exps.weight", Experts),
];

/// Llama layers with experts (qwen3moe, olmoe, Mixtral as llama).
const LLAMA_MOE: &[GgufNames] = &[COMMON, LLAMA_QKV, LLAMA_FFN_NORM, MOE_FFN];

/// The experts' keys (after `{arch}.`).
const MOE_KEYS: &[&str] = &[
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
];

/// gpt-oss (llama.cpp's `gpt-oss`): q/k/v/o biases, a sink logit per head, the FFN's
/// input norm named `post_attention_norm`, the router's bias, and the experts' biases
/// stacked like their matrices ([w, E]); the experts as every MoE layer's.
const GPT_OSS: &[GgufNames] = &[
    COMMON,
    LLAMA_QKV,
    &[
        ("bo", "attn_output.bias", Plain),
        ("sinks", "attn_sinks.weight", Plain),
        ("ffn_norm", "post_attention_norm.weight", Plain),
        ("router_b", "ffn_gate_inp.bias", Plain),
        ("eb1", "ffn_gate_exps.bias", Experts),
        ("eb2", "ffn_down_exps.bias", Experts),
        ("eb3", "ffn_up_exps.bias", Experts),
    ],
    MOE_FFN,
];

/// A sliding window's keys: its width, the period of the sliding layers and their RoPE
/// base.
const SWA_KEYS: &[&str] = &[
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "rope.freq_base_swa",
];

/// gpt-oss's keys: the experts', the window's, and the yarn betas its converter writes
/// (read only at llama.cpp's own values, [`super::rope`]).
const GPT_OSS_KEYS: &[&[&str]] = &[MOE_KEYS, SWA_KEYS];

/// What llama.cpp's gpt-oss loader reads with `get_key` required, beyond what every
/// architecture needs (`attention.layer_norm_rms_epsilon`, the experts' counts): the
/// window, and the experts' width (which would else default to `feed_forward_length`).
const GPT_OSS_REQUIRED: &[&str] = &["attention.sliding_window", "expert_feed_forward_length"];

/// Gemma 2 and 3: llama.cpp's `post_attention_norm` is the norm of the attention
/// output, `ffn_norm` the FFN's input norm (Hugging Face's pre_feedforward_layernorm).
const GEMMA: &[GgufNames] = &[
    COMMON,
    &[
        ("wq", "attn_q.weight", Rope),
        ("ffn_norm", "ffn_norm.weight", Plain),
        ("post_attn_norm", "post_attention_norm.weight", Plain),
        ("post_ffn_norm", "post_ffw_norm.weight", Plain),
    ],
];

/// Qwen3.5: llama.cpp's converter tiles the value heads (v-major: for each value head
/// of a key head, every key head), Hugging Face groups them (k-major). The GGUF value
/// head holding Hugging Face's head `h`.
pub fn v_head_src(h: usize, k_heads: usize, per_k: usize) -> usize {
    (h % per_k) * k_heads + h / per_k
}

/// Qwen3.5: gated attention layers (q and gate rows interleaved per head in attn_q) and
/// gated-delta-rule layers (llama.cpp's ssm_* tensors, value heads tiled).
const QWEN35: &[GgufNames] = &[
    COMMON,
    &[
        ("wq", "attn_q.weight", GateQuery),
        ("wg", "attn_q.weight", GateGate),
        ("lqkv", "attn_qkv.weight", VQkv),
        ("lz", "attn_gate.weight", VHeads),
        ("lb", "ssm_beta.weight", VScalar),
        ("la", "ssm_alpha.weight", VScalar),
        ("lconv", "ssm_conv1d.weight", VConv),
        ("dt_bias", "ssm_dt.bias", VScalar),
        ("A_log", "ssm_a", NegExpA),
        ("lnorm", "ssm_norm.weight", Plain),
        ("lout", "ssm_out.weight", VCols),
        ("ffn_norm", "post_attention_norm.weight", Plain),
    ],
];

/// Qwen3.5-MoE: Qwen3.5's layers, the experts and the gated shared expert.
const QWEN35_MOE: &[GgufNames] = &[
    COMMON,
    QWEN35[1],
    MOE_FFN,
    &[
        ("sw1", "ffn_gate_shexp.weight", Plain),
        ("sw2", "ffn_down_shexp.weight", Plain),
        ("sw3", "ffn_up_shexp.weight", Plain),
        ("sgate", "ffn_gate_inp_shexp.weight", Column),
    ],
];

const QWEN35_KEYS: &[&str] = &[
    "rope.dimension_sections",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "attention.recurrent_layers",
    "full_attention_interval",
];

/// Qwen3.5-MoE's keys: Qwen3.5's, the experts' and the shared expert's width.
const QWEN35_MOE_KEYS: &[&[&str]] = &[
    QWEN35_KEYS,
    MOE_KEYS,
    &["expert_shared_feed_forward_length"],
];

/// How llama.cpp lays out q/k rows of an architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeRows {
    /// Already the spec's interleaved pairs (llama.cpp permuted them).
    Interleaved,
    /// Hugging Face's rotate-half order (NEOX).
    RotateHalf,
}

/// Sliding-window layers as llama.cpp decides them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Swa {
    /// `attention.sliding_window` when the file has none (0: no window).
    pub default_window: u64,
    /// The period of the sliding layers when `attention.sliding_window_pattern` is
    /// absent (layer i slides when i % n < n - 1).
    pub default_pattern: u64,
    /// The sliding layers' RoPE base without `rope.freq_base_swa`: `None` is the global
    /// base (no local base then), `Some` a base of their own they always have.
    pub default_local_base: Option<f64>,
    /// llama.cpp always has a window: a model without one is written with a pattern
    /// covering no layer.
    pub always: bool,
    /// llama.cpp scales only the global layers' RoPE, and only linearly.
    pub linear_scaling_only: bool,
}

/// Gemma 2: always a window (default 4096), pattern default 2, the sliding layers'
/// base `rope.freq_base_swa` (default the global one).
const GEMMA2_SWA: Swa = Swa {
    default_window: 4096,
    default_pattern: 2,
    default_local_base: None,
    always: true,
    linear_scaling_only: false,
};

/// Gemma 3: a window only when `attention.sliding_window` > 0, pattern default 6,
/// sliding layers' base default 10000, unscaled.
const GEMMA3_SWA: Swa = Swa {
    default_window: 0,
    default_pattern: 6,
    default_local_base: Some(10_000.0),
    always: false,
    linear_scaling_only: true,
};

/// gpt-oss: a window always (`attention.sliding_window` is required: [`GPT_OSS_REQUIRED`],
/// so the default is never used), pattern default 2 (layers 0, 2, 4, ... slide), the
/// sliding layers' base `rope.freq_base_swa` (default the global one), scaled like the
/// global layers.
const GPT_OSS_SWA: Swa = Swa {
    default_window: 0,
    default_pattern: 2,
    default_local_base: None,
    always: true,
    linear_scaling_only: false,
};

/// Logit softcaps: the defaults of the keys llama.cpp reads (`None`: it reads none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Softcaps {
    /// `attn_logit_softcapping`.
    pub attn: Option<f64>,
    /// `final_logit_softcapping`.
    pub final_: Option<f64>,
}

/// One GGUF architecture.
#[derive(Debug)]
pub struct GgufArch {
    /// `general.architecture`.
    pub name: &'static str,
    /// What the model computes.
    pub arch: &'static Arch,
    pub rows: RopeRows,
    /// The name tables, searched in order (each spec array stands in one of them).
    pub names: &'static [GgufNames],
    /// The FFN activation llama.cpp uses (it reads no key for it).
    pub act: u32,
    /// llama.cpp's `n_no_rope_layer_step`: layers (i + 1) % n == 0 have no RoPE.
    pub no_rope_every: Option<usize>,
    pub swa: Option<Swa>,
    pub softcaps: Softcaps,
    /// llama.cpp scales attention by 1/sqrt(dim / n_heads) instead of 1/sqrt(head
    /// size) in models of this many layers (Gemma's 27B models).
    pub attn_scale_dim_layers: Option<usize>,
    /// Interleaved multimodal RoPE sections (`rope.dimension_sections`): every rotated
    /// pair must turn with the text position.
    pub rope_sections: bool,
    /// Metadata keys (after `{arch}.`) read by the converter, in groups; any other key
    /// under the architecture's prefix is refused by name.
    pub keys: &'static [&'static [&'static str]],
    /// Keys (after `{arch}.`) llama.cpp refuses to load the architecture without, where
    /// the converter would otherwise take a default (gpt-oss's window): a file without
    /// one is refused by name rather than converted into a model llama.cpp never runs.
    pub required: &'static [&'static str],
    /// The `.mlb` features that name this architecture on export ([`by_features`]).
    pub features: Features,
    /// The routing llama.cpp computes where the family leaves it to the config
    /// (qwen3moe always renormalises, olmoe never).
    pub moe_gating: Option<u32>,
    /// The clamped SwiGLU llama.cpp computes, (limit, alpha): constants of its graph
    /// (gpt-oss: 7 and 1.702, `LLM_FFN_SWIGLU_OAI_MOE`), read from no key.
    pub swiglu: Option<(f32, f32)>,
}

/// What an `.mlb` header says of a model's family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// An attention gate or linear-attention layers.
    pub gated: bool,
    pub post_norms: bool,
    pub qk_norm: bool,
    pub qkv_bias: bool,
    /// Some layer without RoPE.
    pub no_rope: bool,
    /// Mixture-of-experts layers (an architecture has them exactly when the header
    /// does).
    pub experts: bool,
    /// q/k norms over the whole projection (OLMoE; exactly as the header says).
    pub qk_norm_whole: bool,
    /// Attention sinks (gpt-oss).
    pub sinks: bool,
}

const NO_FEATURES: Features = Features {
    gated: false,
    post_norms: false,
    qk_norm: false,
    qkv_bias: false,
    no_rope: false,
    experts: false,
    qk_norm_whole: false,
    sinks: false,
};

impl Features {
    /// Whether a header with features `of` has every one of these.
    fn within(self, of: Features) -> bool {
        let has = |want: bool, got: bool| !want || got;
        has(self.gated, of.gated)
            && has(self.post_norms, of.post_norms)
            && has(self.qk_norm, of.qk_norm)
            && has(self.qkv_bias, of.qkv_bias)
            && has(self.no_rope, of.no_rope)
            && self.experts == of.experts
            && self.qk_norm_whole == of.qk_norm_whole
            && has(self.sinks, of.sinks)
    }
}

/// Keys every architecture reads.
const COMMON_KEYS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    "rope.scaling.finetuned",
    "vocab_size",
];

const GEMMA2_KEYS: &[&[&str]] = &[
    &["attn_logit_softcapping", "final_logit_softcapping"],
    SWA_KEYS,
];

const GEMMA3_KEYS: &[&[&str]] = &[&["final_logit_softcapping"], SWA_KEYS];

/// The fields most architectures share: llama.cpp's Llama names, SiLU, RoPE on every
/// layer, no window, no keys beyond the common ones.
const BASE: GgufArch = GgufArch {
    name: "",
    arch: &arch::LLAMA,
    rows: RopeRows::RotateHalf,
    names: LLAMA,
    act: act::SILU,
    no_rope_every: None,
    swa: None,
    softcaps: Softcaps {
        attn: None,
        final_: None,
    },
    attn_scale_dim_layers: None,
    rope_sections: false,
    keys: &[],
    required: &[],
    features: NO_FEATURES,
    moe_gating: None,
    swiglu: None,
};

/// Every architecture, in the order messages list them.
pub const GGUF_ARCHS: &[GgufArch] = &[
    GgufArch {
        name: "llama",
        arch: &arch::LLAMA,
        rows: RopeRows::Interleaved,
        ..BASE
    },
    GgufArch {
        name: "smollm3",
        arch: &arch::SMOLLM3,
        rows: RopeRows::Interleaved,
        no_rope_every: Some(4),
        features: Features {
            no_rope: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    GgufArch {
        name: "qwen2",
        arch: &arch::QWEN2,
        features: Features {
            qkv_bias: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    GgufArch {
        name: "qwen3",
        arch: &arch::QWEN3,
        features: Features {
            qk_norm: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    GgufArch {
        name: "gemma2",
        arch: &arch::GEMMA2,
        names: GEMMA,
        act: act::GELU_TANH,
        swa: Some(GEMMA2_SWA),
        softcaps: Softcaps {
            attn: Some(50.0),
            final_: Some(30.0),
        },
        attn_scale_dim_layers: Some(46),
        keys: GEMMA2_KEYS,
        features: Features {
            post_norms: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    GgufArch {
        name: "gemma3",
        arch: &arch::GEMMA3,
        names: GEMMA,
        act: act::GELU_TANH,
        swa: Some(GEMMA3_SWA),
        softcaps: Softcaps {
            attn: None,
            final_: Some(0.0),
        },
        attn_scale_dim_layers: Some(62),
        keys: GEMMA3_KEYS,
        features: Features {
            post_norms: true,
            qk_norm: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    // Interleaved multimodal RoPE (IMROPE) is NEOX on the rotated dimensions for text,
    // whose three position components are equal.
    GgufArch {
        name: "qwen35",
        arch: &arch::QWEN35,
        names: QWEN35,
        rope_sections: true,
        keys: &[QWEN35_KEYS],
        features: Features {
            gated: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    GgufArch {
        name: "qwen3moe",
        arch: &arch::QWEN3_MOE,
        names: LLAMA_MOE,
        keys: &[MOE_KEYS],
        features: Features {
            qk_norm: true,
            experts: true,
            ..NO_FEATURES
        },
        moe_gating: Some(moe_gating::SOFTMAX_TOPK_NORM),
        ..BASE
    },
    GgufArch {
        name: "olmoe",
        arch: &arch::OLMOE,
        names: LLAMA_MOE,
        keys: &[MOE_KEYS],
        features: Features {
            qk_norm: true,
            qk_norm_whole: true,
            experts: true,
            ..NO_FEATURES
        },
        moe_gating: Some(moe_gating::SOFTMAX_TOPK),
        ..BASE
    },
    // gpt-oss: NEOX RoPE on Hugging Face's rows, SiLU's clamped variant with llama.cpp's
    // constants, sliding and full layers alternating, yarn on both.
    GgufArch {
        name: "gpt-oss",
        arch: &arch::GPT_OSS,
        names: GPT_OSS,
        swa: Some(GPT_OSS_SWA),
        keys: GPT_OSS_KEYS,
        required: GPT_OSS_REQUIRED,
        features: Features {
            qkv_bias: true,
            experts: true,
            sinks: true,
            ..NO_FEATURES
        },
        swiglu: Some((7.0, 1.702)),
        ..BASE
    },
    // Mixtral: llama.cpp's llama with experts (`llama.expert_count`), q/k rows
    // permuted like Llama's; llama.cpp ignores Mixtral's sliding window.
    GgufArch {
        name: "llama",
        arch: &arch::MIXTRAL,
        rows: RopeRows::Interleaved,
        names: LLAMA_MOE,
        keys: &[MOE_KEYS],
        features: Features {
            experts: true,
            ..NO_FEATURES
        },
        ..BASE
    },
    GgufArch {
        name: "qwen35moe",
        arch: &arch::QWEN35_MOE,
        names: QWEN35_MOE,
        rope_sections: true,
        keys: QWEN35_MOE_KEYS,
        features: Features {
            gated: true,
            experts: true,
            ..NO_FEATURES
        },
        ..BASE
    },
];

/// Export's choice, most specific first: the first row whose features an `.mlb` has.
const EXPORT_ORDER: &[&str] = &[
    "gpt-oss",
    "qwen35moe",
    "qwen35",
    "gemma3",
    "gemma2",
    "qwen2",
    "olmoe",
    "qwen3moe",
    "qwen3",
    "smollm3",
    "llama",
];

impl GgufArch {
    /// The attention scale llama.cpp computes: 1/sqrt(head size), or 1/sqrt(dim /
    /// n_heads) in the models of [`GgufArch::attn_scale_dim_layers`] layers.
    pub fn attn_scale(&self, dims: &Dims) -> (usize, f64) {
        let d = match self.attn_scale_dim_layers == Some(dims.n_layers) {
            true => dims.dim / dims.n_heads,
            false => dims.head_dim,
        };
        (d, 1.0 / (d as f64).sqrt())
    }

    /// The GGUF tensor name and transform of spec array `spec` in layer `layer`.
    pub fn tensor_name(&self, spec: &str, layer: Option<u32>) -> Option<(String, Transform)> {
        let (_, suffix, t) = self
            .names
            .iter()
            .flat_map(|t| t.iter())
            .find(|(s, _, _)| *s == spec)?;
        Some(match layer {
            Some(l) => (format!("blk.{l}.{suffix}"), *t),
            None => (suffix.to_string(), *t),
        })
    }

    /// Whether `{arch}.key` is a key this converter reads for the architecture.
    pub fn knows_key(&self, key: &str) -> bool {
        COMMON_KEYS.contains(&key) || self.keys.iter().any(|k| k.contains(&key))
    }
}

/// The architecture named `name` (its dense row).
pub fn by_name(name: &str) -> Option<&'static GgufArch> {
    GGUF_ARCHS.iter().find(|a| a.name == name)
}

/// The row of `name` with or without experts (llama.cpp's llama is Mixtral when the
/// file has `llama.expert_count`); `None` when the architecture has no such row.
pub fn by_name_experts(name: &str, experts: bool) -> Option<&'static GgufArch> {
    GGUF_ARCHS
        .iter()
        .find(|a| a.name == name && a.features.experts == experts)
}

/// The architecture of an `.mlb` whose header has `features` (export).
pub fn by_features(features: Features) -> &'static GgufArch {
    EXPORT_ORDER
        .iter()
        .flat_map(|n| GGUF_ARCHS.iter().filter(move |a| a.name == *n))
        .find(|a| a.features.within(features))
        .expect("llama has no features")
}

/// Every accepted `general.architecture`, for messages.
pub fn names() -> Vec<&'static str> {
    let mut v: Vec<&str> = GGUF_ARCHS.iter().map(|a| a.name).collect();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_picks_gpt_oss_by_its_sinks() {
        let moe = Features {
            qkv_bias: true,
            experts: true,
            ..NO_FEATURES
        };
        let ga = by_features(Features { sinks: true, ..moe });
        assert_eq!((ga.name, ga.arch.name), ("gpt-oss", "gpt_oss"));
        assert_eq!(ga.swiglu, Some((7.0, 1.702)));
        // Without sinks a model with experts and biases is not gpt-oss.
        assert_ne!(by_features(moe).name, "gpt-oss");
        // Its names: the FFN input norm, the biases, sinks and stacked experts.
        let name = |s: &str| ga.tensor_name(s, Some(3));
        assert_eq!(
            name("ffn_norm").unwrap().0,
            "blk.3.post_attention_norm.weight"
        );
        assert_eq!(
            name("eb2"),
            Some(("blk.3.ffn_down_exps.bias".into(), Transform::Experts))
        );
        assert_eq!(name("sinks").unwrap().0, "blk.3.attn_sinks.weight");
        assert_eq!(name("router_b").unwrap().0, "blk.3.ffn_gate_inp.bias");
        assert_eq!(
            Transform::Experts.dims(4 * 32, 1, 4),
            Some(vec![32, 4]),
            "an expert bias [w, E]"
        );
    }
}
