//! AVX2 forms of `scalar::math`: `exp` (also on 16 lanes with AVX-512 F), the maximum,
//! SiLU and GELU times the up projection on 8 lanes. The same f32 operations in the
//! same order per element, so the same bits; tails shorter than 8 run the scalar
//! functions.

use core::arch::x86_64::*;

use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::math::{self as sm, C1, C2, GELU_C, HI, LO, LOG2E, P};
use crate::kernels::tier::Tier;

/// The range reduction and polynomial of [`sm::exp`] on the lanes of the width whose
/// intrinsics are given (`$floor` rounds toward −∞): `(n, y)`, the result being
/// `y · 2^n` where `n` is in range. A macro for [`exp8`] and [`exp16`], which then scale
/// and handle the out-of-range lanes each with its width's compare and blend.
macro_rules! exp_poly {
    ($x:expr, $floor:expr, $set1:ident, $add:ident, $sub:ident, $mul:ident) => {{
        let x = $x;
        let n = $floor($add($mul(x, $set1(LOG2E)), $set1(0.5)));
        let r = $sub($sub(x, $mul(n, $set1(C1))), $mul(n, $set1(C2)));
        let z = $mul(r, r);
        let mut p = $set1(P[0]);
        for &c in &P[1..] {
            p = $add($mul(p, r), $set1(c));
        }
        (n, $add($add($mul(p, z), r), $set1(1.0)))
    }};
}

/// [`sm::exp`] on 8 lanes: the same operations in the same order.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let (n, y) = exp_poly!(
        x,
        _mm256_floor_ps,
        _mm256_set1_ps,
        _mm256_add_ps,
        _mm256_sub_ps,
        _mm256_mul_ps
    );
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

/// [`sm::exp`] on 16 lanes (AVX-512 F): [`exp8`]'s operations, so the same bits.
#[target_feature(enable = "avx512f")]
#[inline]
fn exp16(x: __m512) -> __m512 {
    // Round toward −∞, exceptions suppressed: `_mm256_floor_ps`'s rounding.
    let (n, y) = exp_poly!(
        x,
        _mm512_roundscale_ps::<0x09>,
        _mm512_set1_ps,
        _mm512_add_ps,
        _mm512_sub_ps,
        _mm512_mul_ps
    );
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvttps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    let v = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    let hi = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(HI));
    let v = _mm512_mask_blend_ps(hi, v, _mm512_set1_ps(f32::INFINITY));
    let lo = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO));
    let v = _mm512_mask_blend_ps(lo, v, _mm512_setzero_ps());
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_blend_ps(nan, v, x)
}

/// `v[i] = $f(v[i])` over the whole vectors of `$n` lanes at the front of `v` (loaded
/// and stored unaligned by `$load` and `$store`), in order; the count of values done.
/// The caller has the width's CPU features.
macro_rules! map_lanes {
    ($v:expr, $n:literal, $load:ident, $store:ident, $f:ident) => {{
        let v: &mut [f32] = $v;
        let done = v.len() / $n * $n;
        let mut i = 0;
        while i < done {
            // SAFETY: i + $n <= len; the width's features (the caller's).
            unsafe {
                let p = v.as_mut_ptr().add(i);
                $store(p, $f($load(p)));
            }
            i += $n;
        }
        done
    }};
}

/// `v[i] = exp(v[i])`, 16 at a time, then [`exp_all`] on the rest (inlined into
/// AVX-512 F callers: the attention's softmax over a query's scores, where 8 lanes
/// at a time took about a third of the attention kernels' time in prefill).
#[target_feature(enable = "avx2,avx512f")]
#[inline]
pub(crate) fn exp_all16(v: &mut [f32]) {
    let n16 = map_lanes!(v, 16, _mm512_loadu_ps, _mm512_storeu_ps, exp16);
    exp_all(&mut v[n16..])
}

/// `v[i] = exp(v[i])`, 8 at a time (inlined into AVX2 callers).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn exp_all(v: &mut [f32]) {
    let n8 = map_lanes!(v, 8, _mm256_loadu_ps, _mm256_storeu_ps, exp8);
    for x in &mut v[n8..] {
        *x = sm::exp(*x);
    }
}

/// [`sm::max`] with 32 running maxima (inlined into AVX2 callers).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn max_all(v: &[f32]) -> f32 {
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
    let mut lanes = [0f32; 8];
    let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    // SAFETY: lanes holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let r = sm::max(&lanes);
    v[n32..].iter().fold(r, |r, &x| r.max(x))
}

/// SiLU on 8 lanes ([`sm::silu`]'s operations).
#[target_feature(enable = "avx2")]
#[inline]
fn silu8(x: __m256) -> __m256 {
    let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
}

/// GELU on 8 lanes ([`sm::gelu_tanh`]'s operations).
#[target_feature(enable = "avx2")]
#[inline]
fn gelu8(x: __m256) -> __m256 {
    let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    let inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044_715), x3));
    let v = _mm256_mul_ps(_mm256_set1_ps(GELU_C), inner);
    let e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0), v));
    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
}

/// `g[i] = act(g[i]) · u[i]` (GELU when `GELU`, else SiLU), 8 at a time, the tail one by
/// one with the scalar function (the same bits).
#[target_feature(enable = "avx2")]
#[inline]
fn act_mul<const GELU: bool>(g: &mut [f32], u: &[f32]) {
    let n = g.len().min(u.len());
    let n8 = n / 8 * 8;
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n <= both lengths.
        unsafe {
            let p = g.as_mut_ptr().add(i);
            let x = _mm256_loadu_ps(p);
            let s = if GELU { gelu8(x) } else { silu8(x) };
            _mm256_storeu_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
        }
        i += 8;
    }
    for (g, &u) in g[n8..n].iter_mut().zip(&u[n8..n]) {
        *g = if GELU {
            sm::gelu_tanh(*g)
        } else {
            sm::silu(*g)
        } * u;
    }
}

/// [`sm::swiglu_clamped`] on 8 lanes: `min_ps(l, g)` and `max_ps(−l, u)` return their
/// second operand for a NaN, as the reference's comparisons do.
#[target_feature(enable = "avx2")]
#[inline]
fn swiglu8(g: __m256, u: __m256, l: __m256, nl: __m256, a: __m256) -> __m256 {
    let g = _mm256_min_ps(l, g);
    let u = _mm256_min_ps(l, _mm256_max_ps(nl, u));
    let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, a)));
    let s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e));
    _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0)), s)
}

// The table's entries (see `table::F32Kernels`): safe functions of the CPU features
// they need, which the table holds as `unsafe fn` pointers and calls only on a CPU that
// has them.

/// `v[i] = exp(v[i])`.
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with them).
#[target_feature(enable = "avx2")]
pub fn exp_slice(v: &mut [f32]) {
    count(Tier::Avx2, Op::Exp);
    exp_all(v)
}

/// `v[i] = exp(v[i])`, 16 lanes at a time: the AVX-512 tiers' entry.
///
/// # Safety
/// The CPU must support AVX2 and AVX-512 F (safe to call from code compiled with them).
#[target_feature(enable = "avx2,avx512f")]
pub fn exp_slice512(v: &mut [f32]) {
    count(Tier::Avx512, Op::Exp);
    exp_all16(v)
}

/// The maximum of `v` (see [`sm::max`]).
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with them).
#[target_feature(enable = "avx2")]
pub fn max_slice(v: &[f32]) -> f32 {
    count(Tier::Avx2, Op::Max);
    max_all(v)
}

/// `g[i] = silu(g[i]) · u[i]`.
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with them).
#[target_feature(enable = "avx2")]
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    count(Tier::Avx2, Op::Act);
    act_mul::<false>(g, u)
}

/// `g[i] = gelu_tanh(g[i]) · u[i]`.
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with them).
#[target_feature(enable = "avx2")]
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    count(Tier::Avx2, Op::Act);
    act_mul::<true>(g, u)
}

/// `g[i] = swiglu_clamped(g[i], u[i], l, a)` (gpt-oss's experts), 8 at a time, the tail
/// with the scalar function (the same bits).
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with them).
#[target_feature(enable = "avx2")]
pub fn swiglu_mul(g: &mut [f32], u: &[f32], l: f32, a: f32) {
    count(Tier::Avx2, Op::Act);
    let n = g.len().min(u.len());
    let n8 = n / 8 * 8;
    let (lv, nl, av) = (_mm256_set1_ps(l), _mm256_set1_ps(-l), _mm256_set1_ps(a));
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n <= both lengths.
        unsafe {
            let p = g.as_mut_ptr().add(i);
            let y = swiglu8(
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(u.as_ptr().add(i)),
                lv,
                nl,
                av,
            );
            _mm256_storeu_ps(p, y);
        }
        i += 8;
    }
    for (g, &u) in g[n8..n].iter_mut().zip(&u[n8..n]) {
        *g = sm::swiglu_clamped(*g, u, l, a);
    }
}
