//! The f32 arithmetic contract of everything besides the quantized matrix products: the
//! dot product of attention scores and norms, `exp` (softmax, SiLU, GELU), SiLU, GELU,
//! the maximum of a slice, RMSNorm. Plain Rust, always compiled; the SIMD tiers'
//! versions (`x86::math`) do the same f32 operations in the same order, so they give
//! these bits. No FMA anywhere: Rust never fuses a multiply and an add.
//!
//! `exp` is Cephes' `expf` scheme: `n = floor(x·log2 e + 0.5)`, `r = (x − n·C1) − n·C2`
//! (C1 + C2 = ln 2, C1 exact in few bits), a degree-5 polynomial `p(r)` in Horner form,
//! `y = (p·r² + r) + 1`, times `2^n` built from its exponent bits. Relative error below
//! 2·2⁻²³ (tested against f64). Inputs above [`HI`] give +inf, below [`LO`] give +0
//! (results under 2⁻¹²⁶, never significant in a softmax sum or a SiLU), NaN gives NaN.
//! libm's `expf` cannot serve: its bits differ between platforms and it has no vector
//! form with the same bits.

use super::tiles::{reduce_lanes, LANES};
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const C1: f32 = 0.693_359_4;
pub(crate) const C2: f32 = -2.121_944_4e-4;
pub(crate) const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Above this, `exp` gives +inf (so that `n ≤ 127` and `2^n` is a normal f32).
pub const HI: f32 = 88.3;
/// Below this, `exp` gives +0.
pub const LO: f32 = -87.336_54;
/// √(2/π), GELU's tanh-approximation constant.
pub(crate) const GELU_C: f32 = 0.797_884_6;

/// e^x; see the module docs.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > HI {
        return f32::INFINITY;
    }
    if x < LO {
        return 0.0;
    }
    let n = (x * LOG2E + 0.5).floor();
    let r = (x - n * C1) - n * C2;
    let z = r * r;
    let mut p = P[0];
    for &c in &P[1..] {
        p = p * r + c;
    }
    let y = (p * z + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// SiLU, `x / (1 + e^−x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// The sigmoid `1 / (1 + e^−x)` with [`exp`] (a mixture of experts' shared-expert gate).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// gpt-oss's clamped SwiGLU of a gate value `g` and an up value `u`, with limit `l`
/// and gain `a`: `g' = min(g, l)`, `u' = clamp(u, −l, l)` (a NaN stays NaN),
/// `(u' + 1) · (g' / (1 + e^−(g'·a)))`, each operation rounded in that order.
#[inline]
pub fn swiglu_clamped(g: f32, u: f32, l: f32, a: f32) -> f32 {
    let g = if g > l { l } else { g };
    let u = if u < -l { -l } else { u };
    let u = if u > l { l } else { u };
    (u + 1.0) * (g / (1.0 + exp(-(g * a))))
}

/// GELU, tanh approximation, `0.5·x·(1 + tanh(u))` with `u = √(2/π)·(x + 0.044715·x³)`,
/// computed as `x / (1 + e^(−2u))` (the same function: `1 + tanh u = 2 / (1 + e^(−2u))`),
/// so it needs only [`exp`] and has a vector form with the same bits.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044_715 * (x * x * x));
    x / (1.0 + exp(-2.0 * u))
}

/// The largest non-NaN value of `v` (−inf when there is none). The order of comparisons
/// is free (the maximum of a set does not depend on it), so SIMD tiers keep several
/// running maxima; only the sign of a zero result could differ, and `e^(s − max)` is the
/// same for ±0.
#[inline]
pub fn max(v: &[f32]) -> f32 {
    v.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a))
}

/// Dot product with [`LANES`] partial sums in a fixed order: element `i` of each group of
/// 8 goes to `acc[i]`, the lanes are combined by the contract's tree
/// ([`reduce_lanes`]), then the tail is added in order.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    reduce8(acc, ra, rb)
}

/// The end of [`dot`]: the lanes' tree, then `Σ ra[i]·rb[i]` added in order.
#[inline(always)]
pub fn reduce8(acc: [f32; LANES], ra: &[f32], rb: &[f32]) -> f32 {
    let mut s = reduce_lanes(acc);
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// RMSNorm, `out = x / sqrt(mean(x²) + eps) · w`, with `mean(x²) = dot(x, x) / len`.
#[inline]
pub fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, &xv), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = xv * inv * wv;
    }
}

/// [`rmsnorm`] in place.
#[inline(always)]
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for (xv, &wv) in x.iter_mut().zip(w) {
        *xv = *xv * inv * wv;
    }
}

// The scalar tier's table entries (safe functions; the table holds every tier's entries
// as `unsafe fn` pointers).

/// `v[i] = exp(v[i])`.
pub fn exp_slice(v: &mut [f32]) {
    count(Tier::Scalar, Op::Exp);
    for x in v {
        *x = exp(*x);
    }
}

/// [`max`] of `v`.
pub fn max_slice(v: &[f32]) -> f32 {
    count(Tier::Scalar, Op::Max);
    max(v)
}

/// `g[i] = silu(g[i]) · u[i]`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    count(Tier::Scalar, Op::Act);
    for (g, &u) in g.iter_mut().zip(u) {
        *g = silu(*g) * u;
    }
}

/// `g[i] = gelu_tanh(g[i]) · u[i]`.
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    count(Tier::Scalar, Op::Act);
    for (g, &u) in g.iter_mut().zip(u) {
        *g = gelu_tanh(*g) * u;
    }
}

/// `g[i] = swiglu_clamped(g[i], u[i], l, a)`.
pub fn swiglu_mul(g: &mut [f32], u: &[f32], l: f32, a: f32) {
    count(Tier::Scalar, Op::Act);
    for (g, &u) in g.iter_mut().zip(u) {
        *g = swiglu_clamped(*g, u, l, a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn dot_is_accurate_and_in_the_contract_order() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for n in [0usize, 1, 7, 8, 9, 16, 63, 64, 65, 130, 256] {
            let a: Vec<f32> = (0..n).map(|_| rng.next_f32() * 100.0).collect();
            let b = rng.vec(n);
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - exact).abs() < 1e-3 * (1.0 + exact.abs()));
            // Written out: lane sums, the tree, the tail in order.
            let mut acc = [0f32; 8];
            let full = n / 8 * 8;
            for i in 0..full {
                acc[i % 8] += a[i] * b[i];
            }
            let h = [
                acc[0] + acc[4],
                acc[1] + acc[5],
                acc[2] + acc[6],
                acc[3] + acc[7],
            ];
            let mut want = (h[0] + h[2]) + (h[1] + h[3]);
            for i in full..n {
                want += a[i] * b[i];
            }
            assert_eq!(dot(&a, &b).to_bits(), want.to_bits(), "n {n}");
        }
    }
}
