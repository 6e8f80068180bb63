//! The 256-byte `.mlb` header: every field at its spec offset, decoded and encoded.
//!
//! One table (`FIELDS`) drives decoding, encoding, `mlb-inspect`'s listing and its
//! JSON, so a field cannot be added in one place and forgotten in another.

/// Size of the fixed header; the arrays start here.
pub const HEADER_SIZE: usize = 256;
/// `"MLB1"`.
pub const MAGIC: [u8; 4] = *b"MLB1";
pub const VERSION: u32 = 1;

/// The type of a header field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldType {
    U32,
    F32,
}

/// One header field: its spec name, offset, type and meaning.
#[derive(Debug, Clone, Copy)]
pub struct FieldDesc {
    pub name: &'static str,
    pub offset: usize,
    pub ty: FieldType,
    pub doc: &'static str,
}

/// A field's value, as stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldValue {
    U32(u32),
    F32(f32),
}

macro_rules! header {
    ($($off:literal $name:ident: $ty:ident, $doc:literal;)*) => {
        /// The `.mlb` header as stored (no validation; see [`super::validate`]).
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct Header {
            pub magic: [u8; 4],
            $(#[doc = $doc] pub $name: $ty,)*
        }

        /// Every field after the magic, in offset order.
        pub const FIELDS: &[FieldDesc] = &[
            $(FieldDesc { name: stringify!($name), offset: $off, ty: header!(@ty $ty), doc: $doc },)*
        ];

        impl Header {
            /// Decodes the first 256 bytes of a file (little-endian).
            pub fn decode(b: &[u8; HEADER_SIZE]) -> Header {
                Header {
                    magic: [b[0], b[1], b[2], b[3]],
                    $($name: <$ty>::from_le_bytes([b[$off], b[$off + 1], b[$off + 2], b[$off + 3]]),)*
                }
            }

            /// Encodes the header, zero-padded to 256 bytes.
            pub fn encode(&self) -> [u8; HEADER_SIZE] {
                let mut b = [0u8; HEADER_SIZE];
                b[..4].copy_from_slice(&self.magic);
                $(b[$off..$off + 4].copy_from_slice(&self.$name.to_le_bytes());)*
                b
            }

            /// The value of the field named `name` (spec name), if there is one.
            pub fn get(&self, name: &str) -> Option<FieldValue> {
                match name {
                    $(stringify!($name) => Some(header!(@val $ty, self.$name)),)*
                    _ => None,
                }
            }
        }

        impl Default for Header {
            fn default() -> Self {
                Header { magic: MAGIC, $($name: header!(@zero $ty),)* }
            }
        }
    };
    (@ty u32) => { FieldType::U32 };
    (@ty f32) => { FieldType::F32 };
    (@val u32, $e:expr) => { FieldValue::U32($e) };
    (@val f32, $e:expr) => { FieldValue::F32($e) };
    (@zero u32) => { 0u32 };
    (@zero f32) => { 0.0f32 };
}

header! {
    4 version: u32, "format version, 1";
    8 dim: u32, "model width; multiple of 32";
    12 n_layers: u32, "number of layers";
    16 n_heads: u32, "attention heads";
    20 n_kv_heads: u32, "key/value heads; divides n_heads (GQA)";
    24 hidden_dim: u32, "FFN width; multiple of 32";
    28 vocab: u32, "vocabulary size; ids 1 and 2 are BOS and EOS";
    32 max_seq: u32, "longest context the model allows";
    36 rope_theta: f32, "RoPE base";
    40 norm_eps: f32, "RMSNorm epsilon";
    44 wtype: u32, "weight type: 1 Q8_0, 2 Q4_0, 3 BF16, 4 F16, 5-22 GGUF block types, 128 mixed";
    48 shared_classifier: u32, "non-zero: wcls is omitted and tok_emb is used";
    52 rope_type: u32, "0 = plain, 1 = llama3, 2 = linear, 3 = yarn, 4 = yarn unrounded";
    56 rope_factor: f32, "RoPE scaling factor (llama3, linear, yarn)";
    60 rope_low_freq_factor: f32, "llama3: low frequency factor; yarn: beta_fast";
    64 rope_high_freq_factor: f32, "llama3: high frequency factor; yarn: beta_slow";
    68 rope_orig_max_seq: u32, "llama3, yarn: original context length";
    72 q8_mask: u32, "Q4_0 only: matrix classes stored as Q8_0";
    76 qkv_bias: u32, "1: q, k and v projections have biases; 2: o too";
    80 head_dim: u32, "head size; 0 means dim / n_heads";
    84 qk_norm: u32, "RMSNorm of q and k before RoPE: 1 per head, 2 over the whole projection";
    88 rope_attn_factor: f32, "yarn only: factor on RoPE's cos and sin";
    92 sliding_window: u32, "0: full attention; else the last this many positions";
    96 layer_flags: u32, "a byte of flags per layer follows the header";
    100 rope_local_theta: f32, "RoPE base of local-RoPE layers, unscaled";
    104 act: u32, "FFN activation: 0 = SiLU, 1 = GELU (tanh)";
    108 post_norms: u32, "attention and FFN outputs RMS-normalized before the residual";
    112 embed_scale: f32, "factor on the embedding rows; 0 means 1";
    116 attn_scale: f32, "attention score factor; 0 means 1/sqrt(head_dim)";
    120 scale_f16: u32, "quantized matrices store f16 scales";
    124 attn_softcap: f32, "attention score softcap; 0 means none";
    128 final_softcap: f32, "logit softcap; 0 means none";
    132 rot_dim: u32, "RoPE rotates the first rot_dim dimensions of a head; 0 means all";
    136 attn_gate: u32, "attention output gated by sigmoid(wg x)";
    140 lin_k_heads: u32, "linear attention: key heads";
    144 lin_v_heads: u32, "linear attention: value heads";
    148 lin_k_dim: u32, "linear attention: key head size";
    152 lin_v_dim: u32, "linear attention: value head size";
    156 lin_conv: u32, "linear attention: causal convolution taps";
    160 n_experts: u32, "mixture of experts: routed experts per MoE layer; 0: none";
    164 n_experts_used: u32, "experts each token is routed to (top-k)";
    168 expert_hidden: u32, "FFN width of one routed expert; multiple of 32";
    172 moe_gating: u32, "routing: 0 softmax top-k, 1 the same renormalised, 2 top-k then softmax";
    176 shared_hidden: u32, "FFN width of the shared expert; 0: none";
    180 moe_flags: u32, "1 router bias, 2 expert biases, 4 sigmoid gate on the shared expert";
    184 swiglu_limit: f32, "0: the experts use act; > 0: clamped SwiGLU with this limit";
    188 swiglu_alpha: f32, "clamped SwiGLU: sigmoid gain";
    192 attn_sinks: u32, "attention layers store a sink logit per query head";
    196 pooling: u32, "embeddings: 0 none given (last token), 1 mean, 2 last token, 3 first token";
}

/// End of the last defined field; bytes from here to 256 are padding.
pub const FIELDS_END: usize = 200;

impl Header {
    /// A header with magic, version and every other field zero.
    pub fn new() -> Header {
        Header {
            version: VERSION,
            ..Header::default()
        }
    }
}

/// `wtype` values: a concrete type ([`WType::code`](crate::format::WType::code)) for a
/// file whose matrices all have that type (Q4_0: except the `q8_mask` classes), or
/// [`MIXED`](wtype::MIXED).
pub mod wtype {
    use crate::format::WType;
    pub const Q8_0: u32 = WType::Q8_0.code();
    pub const Q4_0: u32 = WType::Q4_0.code();
    /// Krafla: every matrix BF16.
    pub const BF16: u32 = WType::BF16.code();
    /// Krafla: every matrix F16.
    pub const F16: u32 = WType::F16.code();
    /// Krafla: codes reserved for further block types (after the last defined one, up to
    /// 31); refused until defined.
    pub const RESERVED: std::ops::RangeInclusive<u32> = WType::ALL.len() as u32 + 1..=31;
    /// Krafla: a per-matrix type table follows the header (and the layer flags).
    pub const MIXED: u32 = 128;

    /// The name of a `wtype` value: a type's name, `mixed`, or `None`.
    pub fn name(v: u32) -> Option<&'static str> {
        if v == MIXED {
            return Some("mixed");
        }
        WType::from_code(v).map(WType::name)
    }
}

/// A module of `u32` codes and `name`, the name of a code ("unknown" for any other).
macro_rules! codes {
    ($(#[$doc:meta])* $module:ident { $($(#[$cdoc:meta])* $code:ident = $v:literal $name:literal,)* }) => {
        $(#[$doc])*
        pub mod $module {
            $($(#[$cdoc])* pub const $code: u32 = $v;)*

            pub fn name(v: u32) -> &'static str {
                match v {
                    $($code => $name,)*
                    _ => "unknown",
                }
            }
        }
    };
}

codes! {
    /// `rope_type` values.
    rope_type {
        PLAIN = 0 "plain",
        LLAMA3 = 1 "llama3",
        LINEAR = 2 "linear",
        YARN = 3 "yarn",
        /// Krafla: yarn whose correction range is not rounded to whole dimensions
        /// (gpt-oss's `truncate: false`).
        YARN_UNROUNDED = 4 "yarn_unrounded",
    }
}

codes! {
    /// `pooling` values (**Krafla**): how the model's own embeddings pool its final hidden
    /// states (sentence-transformers' pooling config), a hint for embedding servers.
    pooling {
        NONE = 0 "none",
        MEAN = 1 "mean",
        LAST = 2 "last",
        CLS = 3 "cls",
    }
}

codes! {
    /// `moe_gating` values: how a token's router logits choose and weight its experts.
    moe_gating {
        SOFTMAX_TOPK = 0 "softmax_topk",
        SOFTMAX_TOPK_NORM = 1 "softmax_topk_norm",
        TOPK_SOFTMAX = 2 "topk_softmax",
    }
}

codes! {
    /// `qkv_bias` values.
    qkv_bias {
        NONE = 0 "none",
        QKV = 1 "qkv",
        /// Krafla: the output projection has a bias too (gpt-oss).
        QKVO = 2 "qkvo",
    }
}

codes! {
    /// `qk_norm` values.
    qk_norm {
        NONE = 0 "none",
        PER_HEAD = 1 "per_head",
        /// Krafla: over the whole q and k projections (OLMoE).
        WHOLE = 2 "whole",
    }
}

/// `moe_flags` bits.
pub mod moe_flag {
    /// The router has a bias (`router_b`).
    pub const ROUTER_BIAS: u32 = 1;
    /// Every expert's products have biases (`eb1`, `eb2`, `eb3`).
    pub const EXPERT_BIAS: u32 = 2;
    /// The shared expert's output is scaled by sigmoid(sgate · x).
    pub const SHARED_GATE: u32 = 4;
    pub const ALL: u32 = ROUTER_BIAS | EXPERT_BIAS | SHARED_GATE;

    pub fn names(f: u32) -> Vec<&'static str> {
        [
            (ROUTER_BIAS, "router_bias"),
            (EXPERT_BIAS, "expert_bias"),
            (SHARED_GATE, "shared_gate"),
        ]
        .iter()
        .filter(|(b, _)| f & b != 0)
        .map(|(_, n)| *n)
        .collect()
    }
}

codes! {
    /// `act` values.
    act {
        SILU = 0 "silu",
        GELU_TANH = 1 "gelu_tanh",
    }
}

/// Per-layer flag bits (one byte per layer when `layer_flags` is set).
pub mod layer_flag {
    /// The layer attends through the sliding window.
    pub const SLIDING: u8 = 1;
    /// The layer uses `rope_local_theta`, unscaled.
    pub const LOCAL_ROPE: u8 = 2;
    /// The layer's queries and keys are not rotated.
    pub const NO_ROPE: u8 = 4;
    /// The layer is a gated-delta-rule linear-attention layer.
    pub const LINEAR: u8 = 8;
    /// Krafla: the layer's FFN is a mixture of experts.
    pub const MOE: u8 = 16;
    pub const ALL: u8 = SLIDING | LOCAL_ROPE | NO_ROPE | LINEAR | MOE;

    /// Names of the set bits, e.g. `["sliding", "local_rope"]`.
    pub fn names(f: u8) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (bit, name) in [
            (SLIDING, "sliding"),
            (LOCAL_ROPE, "local_rope"),
            (NO_ROPE, "no_rope"),
            (LINEAR, "linear_attention"),
            (MOE, "moe"),
        ] {
            if f & bit != 0 {
                v.push(name);
            }
        }
        v
    }
}

/// `q8_mask` bits: matrix classes stored as Q8_0 in a Q4_0 model.
pub mod q8_class {
    pub const TOK_EMB: u32 = 1;
    pub const WCLS: u32 = 2;
    /// wq and wk, also wg and lqkv.
    pub const WQK: u32 = 4;
    /// wv, also lz.
    pub const WV: u32 = 8;
    /// wo, also lout.
    pub const WO: u32 = 16;
    /// w1 and w3.
    pub const W13: u32 = 32;
    pub const W2: u32 = 64;
    pub const ALL: u32 = 127;

    /// Class names in bit order, as `mlb-convert --q8` takes them.
    pub const NAMES: [(u32, &str); 7] = [
        (TOK_EMB, "tok_emb"),
        (WCLS, "wcls"),
        (WQK, "wqk"),
        (WV, "wv"),
        (WO, "wo"),
        (W13, "w13"),
        (W2, "w2"),
    ];

    pub fn names(mask: u32) -> Vec<&'static str> {
        NAMES
            .iter()
            .filter(|(b, _)| mask & b != 0)
            .map(|(_, n)| *n)
            .collect()
    }

    /// Parses `tok_emb,wcls,...` or `none`.
    pub fn parse(s: &str) -> Result<u32, String> {
        let s = s.trim();
        if s == "none" || s.is_empty() {
            return Ok(0);
        }
        let mut mask = 0;
        for part in s.split(',') {
            let part = part.trim();
            match NAMES.iter().find(|(_, n)| *n == part) {
                Some((b, _)) => mask |= b,
                None => {
                    let known: Vec<_> = NAMES.iter().map(|(_, n)| *n).collect();
                    return Err(format!(
                        "unknown matrix class '{part}' (known: {}, or none)",
                        known.join(", ")
                    ));
                }
            }
        }
        Ok(mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_the_spec_table() {
        let mut expect = 4;
        for f in FIELDS {
            assert_eq!(f.offset, expect, "{}", f.name);
            expect += 4;
        }
        assert_eq!(expect, FIELDS_END);
    }

    #[test]
    fn roundtrip() {
        let mut h = Header::new();
        h.dim = 64;
        h.rope_theta = 10000.0;
        h.lin_conv = 4;
        let b = h.encode();
        assert_eq!(&b[..4], b"MLB1");
        assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 64);
        assert_eq!(u32::from_le_bytes(b[156..160].try_into().unwrap()), 4);
        assert!(b[160..].iter().all(|&x| x == 0));
        assert_eq!(Header::decode(&b), h);
        h.attn_sinks = 1;
        assert_eq!(
            u32::from_le_bytes(h.encode()[192..196].try_into().unwrap()),
            1
        );
        assert!(h.encode()[196..].iter().all(|&x| x == 0));
        h.pooling = pooling::MEAN;
        assert_eq!(
            u32::from_le_bytes(h.encode()[196..200].try_into().unwrap()),
            1
        );
        assert!(h.encode()[200..].iter().all(|&x| x == 0));
        assert_eq!(h.get("rope_theta"), Some(FieldValue::F32(10000.0)));
        assert_eq!(h.get("nope"), None);
    }

    #[test]
    fn q8_class_names() {
        assert_eq!(q8_class::parse("none"), Ok(0));
        assert_eq!(q8_class::parse("tok_emb,w2"), Ok(65));
        assert!(q8_class::parse("wq").unwrap_err().contains("wq"));
        assert_eq!(q8_class::names(65), vec!["tok_emb", "w2"]);
    }
}
