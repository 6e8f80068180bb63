//! The kernels against their scalar references, bit for bit, one file per operation as
//! in `src/kernels/scalar/`: `tiles` (Q8_0 / Q4_0 products), `quantize` (the activation
//! quantizer), `blocks` (the GGUF block types), `half` (BF16 / F16 weights, BF16
//! activations), `attention` (over f32, f16 and Q8_0 caches), `math` (exp, max, SiLU /
//! GELU), `delta` (the delta rule's head step), `subproduct` (error feedback's f64 product), `moe` (routing, the clamped SwiGLU);
//! `counters`: which tier's code ran.
//! Below: what the f32 files share.

use crate::util::{first_diff, nan_bits};

mod attention;
mod blocks;
mod counters;
mod delta;
mod half;
mod math;
mod moe;
mod quantize;
mod subproduct;
mod tiles;

/// xorshift32 values in [-scale, scale).
pub(super) struct Rng(pub(super) u32);

impl Rng {
    pub(super) fn unit(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        (self.0 as f32 / u32::MAX as f32) * 2.0 - 1.0
    }
    pub(super) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// The bits, every NaN as one value ([`nan_bits`]).
pub(super) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|&x| nan_bits(x)).collect()
}

/// Panics with the first differing index and both bit patterns.
pub(super) fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = first_diff(got, want) {
        panic!(
            "{what}: index {i}: got {} ({:#010x}), want {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}
