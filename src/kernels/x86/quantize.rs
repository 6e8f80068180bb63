//! The x86 forms of `scalar::quantize`: the activation quantizer on AVX2 (every x86
//! tier uses it), bit-identical to the reference, and f16 scales widened 8 at a time
//! with F16C.

use core::arch::x86_64::*;

use crate::format::wtype::QK;
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;
use crate::quant::q8_0::AMAX_MIN;

/// One block of the activation quantizer, the same f32 operations as `round_q8`.
#[inline(always)]
unsafe fn quantize_block(x: *const f32, q: *mut i8) -> f32 {
    // SAFETY: 32 readable floats at `x`, 32 writable bytes at `q` (caller's contract).
    unsafe {
        // Plain loops, not `map` closures: a closure does not inherit the caller's
        // target features, and its intrinsics would become calls.
        let mut v = [_mm256_setzero_ps(); 4];
        for (j, vj) in v.iter_mut().enumerate() {
            *vj = _mm256_loadu_ps(x.add(8 * j));
        }
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        // max_ps(a, m) returns m when a is NaN: NaN is skipped, as f32::max does.
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        if amax < AMAX_MIN {
            _mm256_storeu_si256(q as *mut __m256i, _mm256_setzero_si256());
            return 0.0;
        }
        let id = _mm256_set1_ps(127.0 / amax);
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let half = _mm256_set1_ps(0.5);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let mut i = [_mm256_setzero_si256(); 4];
        for (ij, &vi) in i.iter_mut().zip(&v) {
            let r = _mm256_add_ps(
                _mm256_mul_ps(vi, id),
                _mm256_or_ps(_mm256_and_ps(vi, sign), half),
            );
            let r = _mm256_round_ps(r, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            // NaN → 0, as the saturating `as i8` cast does.
            let r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
            *ij = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q as *mut __m256i, p);
        amax / 127.0
    }
}

#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for (b, db) in d.iter_mut().enumerate() {
        // SAFETY: x and q hold 32·d.len() values (checked by the caller).
        *db = unsafe { quantize_block(x.as_ptr().add(b * QK), q.as_mut_ptr().add(b * QK)) };
    }
}

/// Activation quantizer (see `table::QuantFn`), bit-identical to the scalar one.
///
/// # Safety
/// The CPU has AVX2; `x.len() == q.len() == 32·d.len()`.
pub unsafe fn quantize_act(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    count(Tier::Avx2, Op::Quantize);
    debug_assert!(x.len() == q.len() && x.len() == d.len() * QK);
    // SAFETY: forwarded caller contract.
    unsafe { quantize_avx2(x, q, d) }
}

/// `dst[i] = src[i]` as f32 (f16 bits in, exact), 8 at a time (see `table::F16Fn`).
///
/// Panics if the lengths differ.
///
/// # Safety
/// The CPU must support AVX and F16C (safe to call from code compiled with them).
#[target_feature(enable = "avx,f16c")]
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    count(Tier::Avx2, Op::F16);
    assert_eq!(src.len(), dst.len());
    let n8 = src.len() / 8 * 8;
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= len of both slices.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (d, &s) in dst[n8..].iter_mut().zip(&src[n8..]) {
        *d = ::half::f16::from_bits(s).to_f32_const();
    }
}
