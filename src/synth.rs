//! Synthetic `.mlb` files with seeded random weights, for tests, fuzz seeds and
//! crafted-error cases. Not used by the tools. It sits above `format` and `quant` (it
//! quantizes and writes), so their own tests do not use it.

use crate::format::mlb::header::{rope_type, wtype, Header};
use crate::format::mlb::layout::Kind;
use crate::format::mlb::writer::MlbWriter;
use crate::format::WType;
use crate::quant::{quantize, Q4Rule, QuantOptions};
pub use crate::rng::Rng;

/// A small valid Llama-like header: dim 64, 2 layers, 4 heads, 2 kv heads.
pub fn tiny_header() -> Header {
    let mut h = Header::new();
    h.dim = 64;
    h.n_layers = 2;
    h.n_heads = 4;
    h.n_kv_heads = 2;
    h.hidden_dim = 128;
    h.vocab = 96;
    h.max_seq = 128;
    h.rope_theta = 10000.0;
    h.norm_eps = 1e-5;
    h.wtype = wtype::Q8_0;
    h
}

/// The smallest gated-delta-rule shape: 2 key heads and 4 value heads of 16, conv 4.
pub fn linear_dims(h: &mut Header) {
    h.lin_k_heads = 2;
    h.lin_v_heads = 4;
    h.lin_k_dim = 16;
    h.lin_v_dim = 16;
    h.lin_conv = 4;
}

/// Qwen3.5's hybrid layers: per-layer flags (the caller marks the linear ones), gated
/// attention with q/k norms rotating 8 of a tiny header's 16 head dimensions, and the
/// [`linear_dims`] delta rule.
pub fn qwen35_hybrid(h: &mut Header) {
    h.layer_flags = 1;
    h.attn_gate = 1;
    h.qk_norm = 1;
    h.rot_dim = 8;
    linear_dims(h);
}

/// A mixture of experts on a tiny header: 4 experts of 32 (2 per token, renormalised), a
/// shared expert of 32 behind its gate, router and expert biases; layer 1 (of the caller's
/// flags) is the MoE layer, as the caller marks it with flag 16.
pub fn tiny_moe(h: &mut Header) {
    h.layer_flags = 1;
    h.n_experts = 4;
    h.n_experts_used = 2;
    h.expert_hidden = 32;
    h.moe_gating = 1;
    h.shared_hidden = 32;
    h.moe_flags = 7;
}

/// Llama 3.1's RoPE scaling (factor 8, low frequency factor 1, high 4) over an
/// original context of `orig_max_seq`.
pub fn llama3_rope(h: &mut Header, orig_max_seq: u32) {
    h.rope_type = rope_type::LLAMA3;
    h.rope_factor = 8.0;
    h.rope_low_freq_factor = 1.0;
    h.rope_high_freq_factor = 4.0;
    h.rope_orig_max_seq = orig_max_seq;
}

/// YaRN with factor 4 and transformers' default betas (beta_fast 32, beta_slow 1) over
/// an original context of `orig_max_seq`, cos and sin scaled by `attn_factor`.
pub fn yarn_rope(h: &mut Header, orig_max_seq: u32, attn_factor: f32) {
    h.rope_type = rope_type::YARN;
    h.rope_factor = 4.0;
    h.rope_low_freq_factor = 32.0;
    h.rope_high_freq_factor = 1.0;
    h.rope_orig_max_seq = orig_max_seq;
    h.rope_attn_factor = attn_factor;
}

/// Writes a complete file for `h` and `flags` with random weights (norms near 1).
pub fn synth_file(h: &Header, flags: &[u8], seed: u64) -> Vec<u8> {
    let w = MlbWriter::new(Vec::new(), h, flags).expect("valid synthetic header");
    fill(w, h, seed)
}

/// [`synth_file`] for a mixed header: `types` gives every matrix's type in array order.
pub fn synth_mixed(h: &Header, flags: &[u8], types: &[WType], seed: u64) -> Vec<u8> {
    let w = MlbWriter::new_mixed(Vec::new(), h, flags, types).expect("valid synthetic header");
    fill(w, h, seed)
}

fn fill(mut w: MlbWriter<Vec<u8>>, h: &Header, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let opts = QuantOptions {
        scale_f16: h.scale_f16 != 0,
        q4_rule: Q4Rule::Round,
        imatrix: None,
    };
    while let Some(t) = w.next_tensor().copied() {
        match t.kind {
            Kind::F32 { len } => {
                let v: Vec<f32> = rng.vec(len).iter().map(|x| 1.0 + 0.1 * x).collect();
                w.write_f32(&v).unwrap();
            }
            Kind::Mat {
                wtype, rows, cols, ..
            } => {
                let x = rng.vec(rows * cols);
                let m = quantize(wtype, rows, cols, &x, &opts).unwrap();
                w.write_mat(&m).unwrap();
            }
            Kind::U8 { .. } => {
                unreachable!("the writer writes the layer flags and the type table itself")
            }
        }
    }
    w.finish().unwrap()
}
