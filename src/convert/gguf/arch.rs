//! One table per GGUF architecture (llama.cpp's `general.architecture`): the Krafla
//! architecture it is, whether llama.cpp keeps q/k rows in Hugging Face's rotate-half
//! order, which metadata keys it reads, and which GGUF tensor is which spec array.
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

/// Llama, SmolLM3, Qwen2, Qwen3 (the transform matters only for NEOX architectures).
const LLAMA: &[GgufNames] = &[
    COMMON,
    &[
        ("wq", "attn_q.weight", Rope),
        ("bq", "attn_q.bias", Rope),
        ("bk", "attn_k.bias", Rope),
        ("bv", "attn_v.bias", Plain),
        ("ffn_norm", "ffn_norm.weight", Plain),
    ],
];

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

/// How llama.cpp lays out q/k rows of an architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeRows {
    /// Already the spec's interleaved pairs (llama.cpp permuted them).
    Interleaved,
    /// Hugging Face's rotate-half order (NEOX).
    RotateHalf,
}

/// Which layers have no RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRope {
    None,
    /// SmolLM3: llama.cpp's `n_no_rope_layer_step = 4`, layers (i + 1) % 4 == 0.
    Every4th,
}

/// Sliding-window layers as llama.cpp decides them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swa {
    /// llama.cpp has no window for the architecture.
    None,
    /// Gemma 2: always a window (default 4096), layer pattern default 2, the sliding
    /// layers' RoPE base `rope.freq_base_swa` (default the global one).
    Gemma2,
    /// Gemma 3: a window only when `attention.sliding_window` > 0, pattern default 6,
    /// sliding layers' base default 10000, unscaled.
    Gemma3,
}

/// One GGUF architecture.
#[derive(Debug)]
pub struct GgufArch {
    /// `general.architecture`.
    pub name: &'static str,
    /// The Krafla architecture (`arch::ARCHS` name).
    pub krafla: &'static str,
    pub rows: RopeRows,
    /// The name tables, searched in order (each spec array stands in one of them).
    pub names: &'static [GgufNames],
    pub no_rope: NoRope,
    pub swa: Swa,
    /// Metadata keys (after `{arch}.`) read by the converter; any other key under the
    /// architecture's prefix is refused by name.
    pub keys: &'static [&'static str],
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

const GEMMA2_KEYS: &[&str] = &[
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "rope.freq_base_swa",
];

const GEMMA3_KEYS: &[&str] = &[
    "final_logit_softcapping",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "rope.freq_base_swa",
];

/// The fields most architectures share: llama.cpp's Llama names, RoPE on every layer,
/// no window, no keys beyond the common ones.
const BASE: GgufArch = GgufArch {
    name: "",
    krafla: "",
    rows: RopeRows::RotateHalf,
    names: LLAMA,
    no_rope: NoRope::None,
    swa: Swa::None,
    keys: &[],
};

pub const GGUF_ARCHS: &[GgufArch] = &[
    GgufArch {
        name: "llama",
        krafla: "llama",
        rows: RopeRows::Interleaved,
        ..BASE
    },
    GgufArch {
        name: "smollm3",
        krafla: "smollm3",
        rows: RopeRows::Interleaved,
        no_rope: NoRope::Every4th,
        ..BASE
    },
    GgufArch {
        name: "qwen2",
        krafla: "qwen2",
        ..BASE
    },
    GgufArch {
        name: "qwen3",
        krafla: "qwen3",
        ..BASE
    },
    GgufArch {
        name: "gemma2",
        krafla: "gemma2",
        names: GEMMA,
        swa: Swa::Gemma2,
        keys: GEMMA2_KEYS,
        ..BASE
    },
    GgufArch {
        name: "gemma3",
        krafla: "gemma3_text",
        names: GEMMA,
        swa: Swa::Gemma3,
        keys: GEMMA3_KEYS,
        ..BASE
    },
    // Interleaved multimodal RoPE (IMROPE) is NEOX on the rotated dimensions for text,
    // whose three position components are equal.
    GgufArch {
        name: "qwen35",
        krafla: "qwen3_5_text",
        names: QWEN35,
        keys: QWEN35_KEYS,
        ..BASE
    },
];

impl GgufArch {
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
        COMMON_KEYS.contains(&key) || self.keys.contains(&key)
    }
}

/// The architecture named `name`.
pub fn by_name(name: &str) -> Option<&'static GgufArch> {
    GGUF_ARCHS.iter().find(|a| a.name == name)
}

/// The GGUF architecture of a Krafla architecture (export).
pub fn by_krafla(name: &str) -> Option<&'static GgufArch> {
    GGUF_ARCHS.iter().find(|a| a.krafla == name)
}

/// Every accepted `general.architecture`, for messages.
pub fn names() -> Vec<&'static str> {
    GGUF_ARCHS.iter().map(|a| a.name).collect()
}
