//! The description ↔ the `.mlb` header: [`ModelDesc::header`] writes the model's fields
//! (the caller adds wtype, q8_mask and scale_f16), [`ModelDesc::from_header`] reads them
//! back for `mlb-export`.
//!
//! Partial rotary: the spec's pair frequency is theta^(-2i/head_dim) while transformers
//! uses theta^(-2i/rot_dim), so the header stores rope_theta = theta^(head_dim/rot_dim).

use super::model::{
    AttnScales, Dims, Ffn, LayerFlags, LinearDims, ModelDesc, Moe, Rope, RopeScaling, Vocab, Yarn,
};
use crate::convert::arch::{Arch, Scales};
use crate::format::mlb::header::{layer_flag, moe_flag, qk_norm, qkv_bias, rope_type, Header};
use crate::format::mlb::validate;

/// A size as a header field; saturated, so that an oversized value fails validation
/// instead of wrapping.
fn u(x: usize) -> u32 {
    x.min(u32::MAX as usize) as u32
}

impl ModelDesc {
    /// The header fields that come from the model (wtype, q8_mask and scale_f16 are
    /// the caller's) and the layer flag bytes (empty without layer flags).
    pub fn header(&self) -> (Header, Vec<u8>) {
        let mut h = Header::new();
        self.dims_fields(&mut h);
        self.rope_fields(&mut h);
        let flags = self.layer_fields(&mut h);
        self.scale_fields(&mut h);
        if let Some(l) = self.linear {
            h.lin_k_heads = u(l.k_heads);
            h.lin_v_heads = u(l.v_heads);
            h.lin_k_dim = u(l.k_dim);
            h.lin_v_dim = u(l.v_dim);
            h.lin_conv = u(l.conv);
        }
        self.moe_fields(&mut h);
        h.pooling = self.pooling;
        (h, flags)
    }

    /// The experts' fields (offsets 160-195) and the biases and gates the family adds.
    fn moe_fields(&self, h: &mut Header) {
        let (Some(m), Some(a)) = (self.moe, self.arch.moe) else {
            return;
        };
        h.n_experts = u(m.n_experts);
        h.n_experts_used = u(m.n_used);
        h.expert_hidden = u(m.expert_hidden);
        h.moe_gating = m.gating;
        h.shared_hidden = u(m.shared_hidden);
        let bit = |on: bool, b: u32| if on { b } else { 0 };
        h.moe_flags = bit(a.router_bias, moe_flag::ROUTER_BIAS)
            | bit(a.expert_bias, moe_flag::EXPERT_BIAS)
            | bit(a.shared_gate && m.shared_hidden > 0, moe_flag::SHARED_GATE);
        if let Some((limit, alpha)) = m.swiglu {
            h.swiglu_limit = limit;
            h.swiglu_alpha = alpha;
        }
    }

    /// Sizes, the family's tensors (biases, norms), the activation.
    fn dims_fields(&self, h: &mut Header) {
        let d = &self.dims;
        h.dim = u(d.dim);
        h.n_layers = u(d.n_layers);
        h.n_heads = u(d.n_heads);
        h.n_kv_heads = u(d.n_kv_heads);
        h.hidden_dim = u(self.ffn.hidden_dim);
        h.vocab = u(self.vocab.size);
        h.max_seq = u(d.max_seq);
        h.norm_eps = self.norm_eps as f32;
        h.shared_classifier = self.vocab.tied as u32;
        // head_dim 0 means dim / n_heads: write it only when it differs.
        if !d.dim.is_multiple_of(d.n_heads) || d.dim / d.n_heads != d.head_dim {
            h.head_dim = u(d.head_dim);
        }
        h.qkv_bias = match (self.arch.qkv_bias, self.arch.o_bias) {
            (_, true) => qkv_bias::QKVO,
            (true, false) => qkv_bias::QKV,
            (false, false) => qkv_bias::NONE,
        };
        h.qk_norm = match (self.arch.qk_norm, self.arch.qk_norm_whole) {
            (_, true) => qk_norm::WHOLE,
            (true, false) => qk_norm::PER_HEAD,
            (false, false) => qk_norm::NONE,
        };
        h.attn_sinks = self.arch.attn_sinks as u32;
        h.post_norms = self.arch.post_norms as u32;
        h.attn_gate = self.arch.attn_gate as u32;
        h.act = self.ffn.act;
    }

    /// The base (rewritten for partial rotary) and the scaling fields.
    fn rope_fields(&self, h: &mut Header) {
        let (r, hd) = (&self.rope, self.dims.head_dim);
        // theta^(head_dim / rot_dim) turns the spec's exponent -2i/head_dim into
        // transformers' -2i/rot_dim.
        h.rope_theta = if r.rot_dim < hd {
            h.rot_dim = u(r.rot_dim);
            r.theta.powf(hd as f64 / r.rot_dim as f64) as f32
        } else {
            r.theta as f32
        };
        // Type, factor, low and high frequency factors (yarn: beta_fast and beta_slow),
        // original context, yarn's attention factor; zero where the type has none.
        let (ty, factor, low, high, orig, attn) = match r.scaling {
            RopeScaling::None => (rope_type::PLAIN, 0.0, 0.0, 0.0, 0, 0.0),
            RopeScaling::Linear { factor } => (rope_type::LINEAR, factor, 0.0, 0.0, 0, 0.0),
            RopeScaling::Llama3 {
                factor,
                low,
                high,
                orig,
            } => (rope_type::LLAMA3, factor, low, high, orig, 0.0),
            RopeScaling::Yarn(y) => (
                if y.truncate {
                    rope_type::YARN
                } else {
                    rope_type::YARN_UNROUNDED
                },
                y.factor,
                y.beta_fast,
                y.beta_slow,
                y.orig,
                y.attn_factor,
            ),
        };
        h.rope_type = ty;
        h.rope_factor = factor as f32;
        h.rope_low_freq_factor = low as f32;
        h.rope_high_freq_factor = high as f32;
        h.rope_orig_max_seq = orig;
        h.rope_attn_factor = attn as f32;
    }

    /// The window, the local base and the flag bytes (empty when not needed).
    fn layer_fields(&self, h: &mut Header) -> Vec<u8> {
        h.sliding_window = u(self.sliding_window.unwrap_or(0));
        let flags: Vec<u8> = self.layers.iter().map(|l| l.bits()).collect();
        if self.layers.iter().any(|l| l.local_rope) {
            h.rope_local_theta = self.rope.local_theta.unwrap_or(0.0) as f32;
        }
        // Layer flags are needed unless every layer is alike and the window, if any,
        // covers every layer; a model with experts always has them (its MoE layers are
        // flagged).
        let all_plain = flags.iter().all(|&f| f == 0);
        let all_sliding = flags.iter().all(|&f| f == layer_flag::SLIDING);
        if (all_plain || all_sliding) && self.moe.is_none() {
            if all_plain {
                h.sliding_window = 0;
            }
            Vec::new()
        } else {
            h.layer_flags = 1;
            flags
        }
    }

    /// The family's scales: Gemma's embed_scale = sqrt(dim), attention scale and softcaps.
    fn scale_fields(&self, h: &mut Header) {
        match self.arch.scales {
            Scales::None => {}
            Scales::Gemma => {
                h.embed_scale = (self.dims.dim as f32).sqrt();
                h.attn_scale = self.scales.attn.unwrap_or(0.0) as f32;
                h.attn_softcap = self.scales.attn_softcap.unwrap_or(0.0) as f32;
                h.final_softcap = self.scales.final_softcap.unwrap_or(0.0) as f32;
            }
        }
    }

    /// The description of a valid header `h` (with its derived sizes `d` and flag
    /// bytes `flags`, one per layer) of family `arch`: the inverse of [`Self::header`].
    /// The header's own family fields (biases, norms, embed_scale, attn_gate) are the
    /// caller's to compare with `arch`.
    pub fn from_header(
        arch: &'static Arch,
        h: &Header,
        d: &validate::Dims,
        flags: &[u8],
    ) -> ModelDesc {
        let f = |x: f32| (x != 0.0).then_some(x as f64);
        // No flag bytes: a window, if any, covers every layer.
        let layers: Vec<LayerFlags> = match h.layer_flags {
            0 => vec![
                LayerFlags {
                    sliding: h.sliding_window != 0,
                    ..LayerFlags::default()
                };
                d.n_layers
            ],
            _ => flags.iter().map(|&b| LayerFlags::of_bits(b)).collect(),
        };
        ModelDesc {
            arch,
            wrapper: None,
            dims: Dims {
                dim: d.dim,
                n_layers: d.n_layers,
                n_heads: d.n_heads,
                n_kv_heads: d.n_kv_heads,
                head_dim: d.head_dim,
                max_seq: h.max_seq as usize,
            },
            ffn: Ffn {
                hidden_dim: d.hidden_dim,
                act: h.act,
            },
            vocab: Vocab {
                size: d.vocab,
                tied: h.shared_classifier != 0,
            },
            norm_eps: h.norm_eps as f64,
            rope: rope_of(h, d, &layers),
            sliding_window: (h.sliding_window != 0).then_some(h.sliding_window as usize),
            layers,
            scales: AttnScales {
                attn: f(h.attn_scale),
                attn_softcap: f(h.attn_softcap),
                final_softcap: f(h.final_softcap),
            },
            linear: (h.lin_k_heads != 0).then_some(LinearDims {
                k_heads: h.lin_k_heads as usize,
                v_heads: h.lin_v_heads as usize,
                k_dim: h.lin_k_dim as usize,
                v_dim: h.lin_v_dim as usize,
                conv: h.lin_conv as usize,
            }),
            moe: (h.n_experts != 0).then_some(Moe {
                n_experts: h.n_experts as usize,
                n_used: h.n_experts_used as usize,
                expert_hidden: h.expert_hidden as usize,
                gating: h.moe_gating,
                shared_hidden: h.shared_hidden as usize,
                swiglu: (h.swiglu_limit > 0.0).then_some((h.swiglu_limit, h.swiglu_alpha)),
            }),
            pooling: h.pooling,
            notes: Vec::new(),
        }
    }
}

/// The RoPE of header `h`: the base back from θ^(head_dim/rot_dim), the scaling
/// fields, the local base where `layers` use it.
fn rope_of(h: &Header, d: &validate::Dims, layers: &[LayerFlags]) -> Rope {
    let theta = match d.rot_dim < d.head_dim {
        true => (h.rope_theta as f64).powf(d.rot_dim as f64 / d.head_dim as f64),
        false => h.rope_theta as f64,
    };
    let (factor, low, high) = (
        h.rope_factor as f64,
        h.rope_low_freq_factor as f64,
        h.rope_high_freq_factor as f64,
    );
    let scaling = match h.rope_type {
        rope_type::LINEAR => RopeScaling::Linear { factor },
        rope_type::LLAMA3 => RopeScaling::Llama3 {
            factor,
            low,
            high,
            orig: h.rope_orig_max_seq,
        },
        rope_type::YARN | rope_type::YARN_UNROUNDED => RopeScaling::Yarn(Yarn {
            factor,
            beta_fast: low,
            beta_slow: high,
            orig: h.rope_orig_max_seq,
            attn_factor: h.rope_attn_factor as f64,
            truncate: h.rope_type == rope_type::YARN,
        }),
        // Validation refuses other codes.
        _ => RopeScaling::None,
    };
    Rope {
        theta,
        scaling,
        local_theta: layers
            .iter()
            .any(|l| l.local_rope)
            .then_some(h.rope_local_theta as f64),
        rot_dim: d.rot_dim,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::arch;
    use crate::format::mlb::header::act;

    fn gemma3() -> ModelDesc {
        let flags = |sliding| LayerFlags {
            sliding,
            local_rope: sliding,
            ..LayerFlags::default()
        };
        ModelDesc {
            arch: &arch::GEMMA3,
            wrapper: None,
            dims: Dims {
                dim: 64,
                n_layers: 3,
                n_heads: 4,
                n_kv_heads: 1,
                head_dim: 32,
                max_seq: 256,
            },
            ffn: Ffn {
                hidden_dim: 128,
                act: act::GELU_TANH,
            },
            vocab: Vocab {
                size: 300,
                tied: true,
            },
            norm_eps: 1e-6f32 as f64,
            rope: Rope {
                theta: 1e6,
                scaling: RopeScaling::Linear { factor: 8.0 },
                local_theta: Some(1e4),
                rot_dim: 32,
            },
            sliding_window: Some(16),
            layers: vec![flags(true), flags(true), flags(false)],
            scales: AttnScales {
                attn: Some(0.125),
                attn_softcap: None,
                final_softcap: Some(30.0),
            },
            linear: None,
            moe: None,
            pooling: 0,
            notes: Vec::new(),
        }
    }

    /// What the header stores comes back: every section of a Gemma 3 description, and
    /// a Qwen3.5 one's partial rotary (its base through θ^(head_dim/rot_dim)), yarn and
    /// delta-rule sizes.
    #[test]
    fn from_header_inverts_header() {
        let qwen35 = ModelDesc {
            arch: &arch::QWEN35,
            ffn: Ffn {
                hidden_dim: 128,
                act: act::SILU,
            },
            rope: Rope {
                theta: 1e7,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low: 1.0,
                    high: 4.0,
                    orig: 64,
                },
                local_theta: None,
                rot_dim: 8,
            },
            sliding_window: None,
            layers: vec![
                LayerFlags {
                    linear: true,
                    ..LayerFlags::default()
                },
                LayerFlags::default(),
                LayerFlags::default(),
            ],
            scales: AttnScales::default(),
            linear: Some(LinearDims {
                k_heads: 2,
                v_heads: 4,
                k_dim: 16,
                v_dim: 16,
                conv: 4,
            }),
            ..gemma3()
        };
        for d in [gemma3(), qwen35] {
            let (mut h, flags) = d.header();
            h.wtype = crate::format::WType::Q8_0.code();
            let dims = validate::validate(&h).unwrap();
            let flags = if flags.is_empty() {
                vec![0; d.dims.n_layers]
            } else {
                flags
            };
            let back = ModelDesc::from_header(d.arch, &h, &dims, &flags);
            assert_eq!(back.dims, d.dims);
            assert_eq!(
                (back.ffn, back.vocab, back.linear),
                (d.ffn, d.vocab, d.linear)
            );
            assert_eq!(back.norm_eps, d.norm_eps);
            assert_eq!(back.layers, d.layers);
            assert_eq!(back.sliding_window, d.sliding_window);
            assert_eq!(back.scales, d.scales);
            assert_eq!(
                (back.rope.scaling, back.rope.local_theta, back.rope.rot_dim),
                (d.rope.scaling, d.rope.local_theta, d.rope.rot_dim)
            );
            assert!((back.rope.theta / d.rope.theta - 1.0).abs() < 1e-6);
            assert!(back.check().is_ok());
        }
    }

    /// Partial rotary is one rule, checked on the description: refused for a family
    /// without it, and with yarn.
    #[test]
    fn partial_rotary_is_checked_once() {
        let mut d = gemma3();
        d.rope.rot_dim = 16;
        let e = d.check().unwrap_err();
        assert_eq!(e.field, crate::convert::error::DescField::RotDim);
        assert!(e.msg.contains("not supported for gemma3_text"), "{}", e.msg);
        d.arch = &arch::QWEN35;
        d.ffn.act = act::SILU;
        d.rope.scaling = RopeScaling::Yarn(Yarn {
            factor: 4.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            orig: 64,
            attn_factor: 1.0,
            truncate: true,
        });
        let e = d.check().unwrap_err();
        assert_eq!(e.field, crate::convert::error::DescField::RopeScaling);
        d.rope.rot_dim = 7;
        assert_eq!(
            d.check().unwrap_err().field,
            crate::convert::error::DescField::RotDim
        );
    }
}
