//! The runtime's view of a model: every header field resolved to its effective value
//! once (zero defaults applied), and each layer's kind from its flag byte.
//!
//! - `embed_scale = 0` means 1; `attn_scale = 0` means `1/sqrt(head_dim)`.
//! - A layer is sliding if its flag says so, or, without layer flags, if the header has
//!   a window: it attends to positions `s` with `t − s < window`.
//! - RoPE per layer: the global base with the header's scaling, the local base unscaled
//!   (flag bit 1), or none (bit 2). Linear-attention layers (bit 3) have no RoPE and no
//!   KV cache.
//! - A layer's FFN is dense, or a mixture of experts (flag bit 4) with the header's
//!   [`Moe`] shape and routing rule.

use crate::format::mlb::header::{act, layer_flag, moe_flag, moe_gating, qk_norm, Header};
use crate::format::mlb::Dims;

/// FFN activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    Silu,
    /// GELU with the tanh approximation.
    GeluTanh,
}

/// Which rotary table a layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeSel {
    /// `rope_theta` with the header's scaling.
    Global,
    /// `rope_local_theta`, unscaled.
    Local,
    /// Queries and keys stay unrotated.
    None,
}

/// What a layer's mixer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention; `window` is `Some(w)` for a sliding layer.
    Attention {
        rope: RopeSel,
        window: Option<usize>,
    },
    /// The gated delta rule.
    Linear,
}

/// How a token's router logits choose and weight its experts (`moe_gating`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, the top k with their probabilities (OLMoE).
    SoftmaxTopK,
    /// The same, the k weights then divided by their sum (Qwen3-MoE, Mixtral).
    SoftmaxTopKNorm,
    /// The top k logits, softmax over those k (gpt-oss).
    TopKSoftmax,
}

/// The experts of a mixture-of-experts layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moe {
    /// Routed experts E.
    pub n_experts: usize,
    /// Experts per token k.
    pub k: usize,
    /// One expert's FFN width.
    pub expert_hidden: usize,
    pub gating: Gating,
    /// The shared expert's FFN width (0: none).
    pub shared_hidden: usize,
    pub router_bias: bool,
    pub expert_bias: bool,
    /// The shared expert's output is multiplied by sigmoid(sgate · x).
    pub shared_gate: bool,
    /// gpt-oss's clamped SwiGLU: (limit, alpha); `None`: the model's `act`.
    pub swiglu: Option<(f32, f32)>,
}

impl Moe {
    /// Routed experts alone: no shared expert, no biases, the model's `act` (the routing
    /// tests' shape).
    pub fn routed(n_experts: usize, k: usize, expert_hidden: usize, gating: Gating) -> Moe {
        Moe {
            n_experts,
            k,
            expert_hidden,
            gating,
            shared_hidden: 0,
            router_bias: false,
            expert_bias: false,
            shared_gate: false,
            swiglu: None,
        }
    }
}

/// RoPE scaling parameters as stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub rope_type: u32,
    pub theta: f32,
    pub local_theta: f32,
    pub factor: f32,
    /// llama3: low frequency factor; yarn: beta_fast.
    pub low: f32,
    /// llama3: high frequency factor; yarn: beta_slow.
    pub high: f32,
    pub orig_max_seq: u32,
    /// yarn: factor on cos and sin (0 otherwise, meaning 1).
    pub attn_factor: f32,
}

/// Effective model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub hidden_dim: usize,
    pub vocab: usize,
    pub max_seq: usize,
    pub norm_eps: f32,
    pub act: Act,
    /// Factor on the embedding rows (1 when the header has 0).
    pub embed_scale: f32,
    /// Factor on q·k (1/sqrt(head_dim) when the header has 0).
    pub attn_scale: f32,
    /// 0: none.
    pub attn_softcap: f32,
    /// 0: none.
    pub final_softcap: f32,
    pub post_norms: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// The q and k norms run over the whole projections (qk_norm 2), not per head.
    pub qk_norm_whole: bool,
    pub attn_gate: bool,
    /// Rotated dimensions per head (even, ≤ head_dim).
    pub rot_dim: usize,
    pub rope: RopeParams,
    pub layers: Vec<LayerKind>,
    /// Linear attention: key heads K, value heads V, their sizes, conv taps.
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_k_dim: usize,
    pub lin_v_dim: usize,
    pub lin_conv: usize,
    /// 2·K·dk + V·dv.
    pub lin_qkv: usize,
    /// V·dv.
    pub lin_v_total: usize,
    /// The experts of the mixture-of-experts layers (`None`: every FFN is dense).
    pub moe: Option<Moe>,
    /// Per layer: whether its FFN is a mixture of experts.
    pub moe_layers: Vec<bool>,
}

impl Config {
    /// The configuration of a validated header, its dimensions and flag bytes (one per
    /// layer; all zero without layer flags).
    pub fn new(h: &Header, d: &Dims, flags: &[u8]) -> Config {
        let window = h.sliding_window as usize;
        let layers = (0..d.n_layers)
            .map(|l| {
                let f = flags.get(l).copied().unwrap_or(0);
                if f & layer_flag::LINEAR != 0 {
                    return LayerKind::Linear;
                }
                let sliding = if h.layer_flags != 0 {
                    f & layer_flag::SLIDING != 0 && window > 0
                } else {
                    window > 0
                };
                let rope = if f & layer_flag::NO_ROPE != 0 {
                    RopeSel::None
                } else if f & layer_flag::LOCAL_ROPE != 0 {
                    RopeSel::Local
                } else {
                    RopeSel::Global
                };
                LayerKind::Attention {
                    rope,
                    window: sliding.then_some(window),
                }
            })
            .collect();
        Config {
            dim: d.dim,
            n_layers: d.n_layers,
            n_heads: d.n_heads,
            n_kv_heads: d.n_kv_heads,
            head_dim: d.head_dim,
            q_dim: d.q_dim,
            kv_dim: d.kv_dim,
            hidden_dim: d.hidden_dim,
            vocab: d.vocab,
            max_seq: h.max_seq as usize,
            norm_eps: h.norm_eps,
            act: if h.act == act::GELU_TANH {
                Act::GeluTanh
            } else {
                Act::Silu
            },
            embed_scale: if h.embed_scale > 0.0 {
                h.embed_scale
            } else {
                1.0
            },
            attn_scale: if h.attn_scale > 0.0 {
                h.attn_scale
            } else {
                1.0 / (d.head_dim as f32).sqrt()
            },
            attn_softcap: h.attn_softcap,
            final_softcap: h.final_softcap,
            post_norms: h.post_norms != 0,
            qkv_bias: h.qkv_bias != 0,
            qk_norm: h.qk_norm != 0,
            qk_norm_whole: h.qk_norm == qk_norm::WHOLE,
            attn_gate: h.attn_gate != 0,
            rot_dim: d.rot_dim,
            rope: RopeParams {
                rope_type: h.rope_type,
                theta: h.rope_theta,
                local_theta: h.rope_local_theta,
                factor: h.rope_factor,
                low: h.rope_low_freq_factor,
                high: h.rope_high_freq_factor,
                orig_max_seq: h.rope_orig_max_seq,
                attn_factor: h.rope_attn_factor,
            },
            layers,
            lin_k_heads: h.lin_k_heads as usize,
            lin_v_heads: h.lin_v_heads as usize,
            lin_k_dim: h.lin_k_dim as usize,
            lin_v_dim: h.lin_v_dim as usize,
            lin_conv: h.lin_conv as usize,
            lin_qkv: d.lin_qkv,
            lin_v_total: d.lin_v_total,
            moe: (d.n_experts > 0).then(|| Moe {
                n_experts: d.n_experts,
                k: d.n_experts_used,
                expert_hidden: d.expert_hidden,
                gating: match h.moe_gating {
                    moe_gating::SOFTMAX_TOPK => Gating::SoftmaxTopK,
                    moe_gating::SOFTMAX_TOPK_NORM => Gating::SoftmaxTopKNorm,
                    _ => Gating::TopKSoftmax,
                },
                shared_hidden: d.shared_hidden,
                router_bias: h.moe_flags & moe_flag::ROUTER_BIAS != 0,
                expert_bias: h.moe_flags & moe_flag::EXPERT_BIAS != 0,
                shared_gate: h.moe_flags & moe_flag::SHARED_GATE != 0,
                swiglu: (h.swiglu_limit > 0.0).then_some((h.swiglu_limit, h.swiglu_alpha)),
            }),
            moe_layers: (0..d.n_layers)
                .map(|l| flags.get(l).is_some_and(|f| f & layer_flag::MOE != 0))
                .collect(),
        }
    }

    /// Whether any layer's FFN is a mixture of experts.
    pub fn has_moe(&self) -> bool {
        self.moe_layers.contains(&true)
    }

    /// Whether any layer uses the local RoPE base.
    pub fn has_local_rope(&self) -> bool {
        self.layers.iter().any(|l| {
            matches!(
                l,
                LayerKind::Attention {
                    rope: RopeSel::Local,
                    ..
                }
            )
        })
    }
}
