//! x86_64 tiers: AVX2 and AVX-512 (with or without VNNI), detected at run time once
//! (`kernels::Kernels::for_tier`); every function here is reached through the table.

pub mod attention;
pub mod attention_kv;
pub mod avx2;
pub mod avx512;
pub mod bf16dot;
pub mod blocks;
pub mod half;
pub mod math;
pub mod packed;
pub mod packed_blocks;
pub mod prefetch;

use crate::kernels::counters::{count, Op};
use crate::kernels::Tier;

/// AVX2 tier: 256-bit integer ops (`vpmaddubsw`, `vpsignb`).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

/// The AVX2 kernels whose contracts round a multiply-add once (the 2-byte float
/// weights', the GGUF block types'): AVX2 with FMA and F16C. Every AVX2 CPU made has
/// both; one without them runs the scalar reference for those weights.
pub fn has_avx2_fma() -> bool {
    has_avx2() && has_f16c() && is_x86_feature_detected!("fma")
}

/// AVX-512 tier: AVX-512 F and BW (and AVX2 for the shared activation quantizer, F16C
/// for f16 KV caches; every AVX-512 CPU has it).
pub fn has_avx512() -> bool {
    has_avx2()
        && has_f16c()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
}

/// AVX-512 VNNI tier: adds `vpdpbusd`.
pub fn has_avx512vnni() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512vnni")
}

/// AVX-512 BF16 tier: the VNNI tier's kernels, and `vdpbf16ps` (on ymm too: VL, which
/// every CPU with AVX-512 BF16 has).
pub fn has_avx512bf16() -> bool {
    has_avx512vnni()
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx512vl")
}

/// F16C (with AVX), for converting f16 scales 8 at a time.
pub fn has_f16c() -> bool {
    is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx")
}

/// 8 f16 at `p` as f32 (`vcvtph2ps`: exact, subnormals too, MXCSR not consulted for
/// this conversion's exact results).
///
/// # Safety
/// 16 readable bytes at `p`; the caller has F16C and AVX.
#[inline(always)]
pub(crate) unsafe fn f16x8(p: *const u8) -> core::arch::x86_64::__m256 {
    use core::arch::x86_64::*;
    // SAFETY: the function's contract.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
}

/// 16 f16 at `p` as f32 (exact, as [`f16x8`]).
///
/// # Safety
/// 32 readable bytes at `p`; the caller has AVX-512 F.
#[inline(always)]
pub(crate) unsafe fn f16x16(p: *const u8) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    // SAFETY: the function's contract.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
}

/// `dst[i] = src[i]` as f32 (f16 bits in, exact), 8 at a time (see `kernels::F16Fn`).
///
/// # Safety
/// The CPU has F16C and AVX; `src.len() == dst.len()`.
#[target_feature(enable = "avx,f16c")]
pub unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    use core::arch::x86_64::*;
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
