//! `exp` for the runtime's element-wise work (softmax, SiLU, GELU), one fixed sequence of f32
//! operations, so the portable version and the 8-lane AVX2 version give the same bits.
//!
//! libm's `expf` cannot serve: its bits differ between platforms and it has no vector
//! form with the same bits. This is Cephes' `expf` scheme: `n = floor(x·log2 e + 0.5)`,
//! `r = (x − n·C1) − n·C2` (C1 + C2 = ln 2, C1 exact in few bits), a degree-5 polynomial
//! `p(r)`, `y = (p·r² + r) + 1`, times `2^n` built from its exponent bits. Relative
//! error below 2·2⁻²³ (tested against f64). Inputs above [`HI`] give +inf, below [`LO`]
//! give +0 (results under 2⁻¹²⁶, never significant in a softmax sum or a SiLU), NaN gives
//! NaN. No FMA anywhere: Rust does not fuse, and the AVX2 code uses separate mul/add.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const C1: f32 = 0.693_359_4;
const C2: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Above this, +inf (so that `n ≤ 127` and `2^n` is a normal f32).
pub const HI: f32 = 88.3;
/// Below this, +0.
pub const LO: f32 = -87.336_54;

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

/// `x / (1 + e^−x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `g[i] = silu(g[i]) · u[i]`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2::silu_mul(g, u) };
    }
    for (g, &u) in g.iter_mut().zip(u) {
        *g = silu(*g) * u;
    }
}

/// √(2/π), GELU's tanh-approximation constant.
const GELU_C: f32 = 0.797_884_6;

/// GELU, tanh approximation, `0.5·x·(1 + tanh(u))` with `u = √(2/π)·(x + 0.044715·x³)`,
/// computed as `x / (1 + e^(−2u))` (the same function: `1 + tanh u = 2 / (1 + e^(−2u))`),
/// so it needs only [`exp`] and has a vector form with the same bits.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044_715 * (x * x * x));
    x / (1.0 + exp(-2.0 * u))
}

/// `g[i] = gelu_tanh(g[i]) · u[i]`.
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2::gelu_mul(g, u) };
    }
    for (g, &u) in g.iter_mut().zip(u) {
        *g = gelu_tanh(*g) * u;
    }
}

/// The largest non-NaN value of `v` (−inf when there is none), as
/// `v.iter().fold(−inf, f32::max)`. The order of comparisons is free (the maximum of a
/// set does not depend on it), so the AVX2 form keeps 32 running maxima; only the sign
/// of a zero result could differ, and `e^(s − max)` is the same for ±0.
pub fn max(v: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2::max(v) };
    }
    v.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a))
}

/// `v[i] = exp(v[i])`.
pub fn exp_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2::exp_in_place(v) };
    }
    for x in v {
        *x = exp(*x);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{C1, C2, GELU_C, HI, LO, LOG2E, P};

    /// [`super::exp`] on 8 lanes: the same operations in the same order.
    #[inline(always)]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: register-only AVX2 ops; the caller has AVX2.
        unsafe {
            let n = _mm256_floor_ps(_mm256_add_ps(
                _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                _mm256_set1_ps(0.5),
            ));
            let r = _mm256_sub_ps(
                _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(C1))),
                _mm256_mul_ps(n, _mm256_set1_ps(C2)),
            );
            let z = _mm256_mul_ps(r, r);
            let mut p = _mm256_set1_ps(P[0]);
            for &c in &P[1..] {
                p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
            }
            let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, z), r), _mm256_set1_ps(1.0));
            // n is integral in [-126, 127] where it is used; other lanes are replaced.
            let e = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)),
                23,
            );
            let v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
            let v = _mm256_blendv_ps(
                v,
                _mm256_set1_ps(f32::INFINITY),
                _mm256_cmp_ps(x, _mm256_set1_ps(HI), _CMP_GT_OQ),
            );
            let v = _mm256_blendv_ps(
                v,
                _mm256_setzero_ps(),
                _mm256_cmp_ps(x, _mm256_set1_ps(LO), _CMP_LT_OQ),
            );
            _mm256_blendv_ps(v, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q))
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn exp_in_place(v: &mut [f32]) {
        let n8 = v.len() / 8 * 8;
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= len.
            unsafe {
                let p = v.as_mut_ptr().add(i);
                _mm256_storeu_ps(p, exp8(_mm256_loadu_ps(p)));
            }
            i += 8;
        }
        for x in &mut v[n8..] {
            *x = super::exp(*x);
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max(v: &[f32]) -> f32 {
        let n32 = v.len() / 32 * 32;
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        let mut i = 0;
        while i < n32 {
            for (k, mk) in m.iter_mut().enumerate() {
                // SAFETY: i + 32 <= len. `max_ps(x, m)` returns m when x is NaN.
                *mk = unsafe { _mm256_max_ps(_mm256_loadu_ps(v.as_ptr().add(i + 8 * k)), *mk) };
            }
            i += 32;
        }
        // The running maxima are never NaN, so any combining order gives the maximum.
        let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let mut lanes = [0f32; 8];
        // SAFETY: lanes holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        let mut r = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for &x in &v[n32..] {
            r = r.max(x);
        }
        r
    }

    /// An activation in its 8-lane and scalar forms (the same bits).
    trait Act {
        /// # Safety
        /// AVX2 is available (the caller is compiled with it).
        unsafe fn v8(x: __m256) -> __m256;
        fn one(x: f32) -> f32;
    }

    struct Silu;

    impl Act for Silu {
        #[inline(always)]
        unsafe fn v8(x: __m256) -> __m256 {
            // SAFETY: register-only AVX2 ops (trait contract).
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
            }
        }
        #[inline(always)]
        fn one(x: f32) -> f32 {
            super::silu(x)
        }
    }

    struct Gelu;

    impl Act for Gelu {
        #[inline(always)]
        unsafe fn v8(x: __m256) -> __m256 {
            // SAFETY: register-only AVX2 ops (trait contract).
            unsafe {
                let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
                let inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044_715), x3));
                let v = _mm256_mul_ps(_mm256_set1_ps(GELU_C), inner);
                let e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0), v));
                _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
            }
        }
        #[inline(always)]
        fn one(x: f32) -> f32 {
            super::gelu_tanh(x)
        }
    }

    /// `g[i] = A(g[i]) · u[i]`, 8 at a time, the tail one by one.
    #[inline(always)]
    unsafe fn act_mul<A: Act>(g: &mut [f32], u: &[f32]) {
        let n = g.len().min(u.len());
        let n8 = n / 8 * 8;
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= n <= both lengths; AVX2 in the callers.
            unsafe {
                let p = g.as_mut_ptr().add(i);
                let s = A::v8(_mm256_loadu_ps(p));
                _mm256_storeu_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
            }
            i += 8;
        }
        for (g, &u) in g[n8..n].iter_mut().zip(&u[n8..n]) {
            *g = A::one(*g) * u;
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        // SAFETY: AVX2 (this function's contract).
        unsafe { act_mul::<Silu>(g, u) }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn gelu_mul(g: &mut [f32], u: &[f32]) {
        // SAFETY: AVX2 (this function's contract).
        unsafe { act_mul::<Gelu>(g, u) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> Vec<f32> {
        let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.05).collect();
        v.extend((0..20000).map(|i| -87.5 + i as f32 * 0.0088));
        v.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            HI,
            HI + 0.01,
            LO,
            LO - 0.01,
            88.0,
            -87.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
        ]);
        v
    }

    #[test]
    fn exp_is_accurate() {
        for x in sweep() {
            let got = exp(x);
            if x.is_nan() {
                assert!(got.is_nan());
                continue;
            }
            let want = (x as f64).exp();
            if x > HI {
                assert_eq!(got, f32::INFINITY, "{x}");
            } else if x < LO {
                assert_eq!(got.to_bits(), 0, "{x}");
            } else {
                let rel = ((got as f64 - want) / want).abs();
                assert!(
                    rel < 2.0 * f32::EPSILON as f64,
                    "exp({x}) = {got}, want {want}: {rel:e}"
                );
            }
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn vector_paths_give_the_scalar_bits() {
        let xs = sweep();
        let mut v = xs.clone();
        exp_in_place(&mut v);
        for (&x, &y) in xs.iter().zip(&v) {
            assert_eq!(y.to_bits(), exp(x).to_bits(), "exp({x})");
        }
        let mut g = xs.clone();
        let u: Vec<f32> = (0..xs.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let fold = |v: &[f32]| v.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
        for len in [0, 1, 7, 31, 32, 33, 100, xs.len()] {
            for start in [0, 3] {
                let v = &xs[start.min(xs.len() - len)..][..len];
                assert_eq!(max(v).to_bits(), fold(v).to_bits(), "max of {len}");
            }
        }
        let nans = [f32::NAN; 40];
        assert_eq!(max(&nans), f32::NEG_INFINITY);
        let mut mixed = [f32::NAN; 40];
        mixed[37] = -3.0;
        mixed[5] = -7.0;
        assert_eq!(max(&mixed), -3.0);
        silu_mul(&mut g, &u);
        for ((&x, &y), &w) in xs.iter().zip(&g).zip(&u) {
            assert_eq!(y.to_bits(), (silu(x) * w).to_bits(), "silu({x})");
        }
        let mut g = xs.clone();
        gelu_mul(&mut g, &u);
        for ((&x, &y), &w) in xs.iter().zip(&g).zip(&u) {
            assert_eq!(y.to_bits(), (gelu_tanh(x) * w).to_bits(), "gelu({x})");
        }
    }

    #[test]
    fn gelu_matches_the_tanh_formula() {
        for x in sweep()
            .into_iter()
            .filter(|x| x.is_finite() && x.abs() < 30.0)
        {
            let xd = x as f64;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd * xd * xd);
            let want = 0.5 * xd * (1.0 + u.tanh());
            let got = gelu_tanh(x) as f64;
            // Relative to |x|: GELU is x times a factor in [0, 1].
            let err = (got - want).abs() / xd.abs().max(1e-30);
            assert!(err < 1e-6, "gelu({x}) = {got}, want {want}");
        }
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!(gelu_tanh(f32::NAN).is_nan());
    }
}
