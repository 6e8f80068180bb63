//! x86_64 tiers: AVX2 and AVX-512 (with or without VNNI), detected at run time.

pub mod avx2;
// The AVX-512 intrinsics are stable since Rust 1.89: the crate's `rust-version` (1.80)
// must be raised to 1.89 for this module to build on the oldest supported toolchain.
#[clippy::msrv = "1.89"]
pub mod avx512;
#[clippy::msrv = "1.89"]
pub mod packed;

/// AVX2 tier: 256-bit integer ops (`vpmaddubsw`, `vpsignb`).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

/// AVX-512 tier: AVX-512 F and BW (and AVX2 for the shared activation quantizer).
pub fn has_avx512() -> bool {
    has_avx2() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// AVX-512 VNNI tier: adds `vpdpbusd`.
pub fn has_avx512vnni() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512vnni")
}

/// `dst[i] = src[i]` as f32 (f16 bits in, exact), 8 at a time with F16C; false (nothing
/// written) when the CPU has no F16C and the caller must convert another way.
#[inline]
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) -> bool {
    if !(is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx")) {
        return false;
    }
    // SAFETY: F16C and AVX checked above.
    unsafe { f16_to_f32_f16c(src, dst) };
    true
}

#[target_feature(enable = "avx,f16c")]
unsafe fn f16_to_f32_f16c(src: &[u16], dst: &mut [f32]) {
    use core::arch::x86_64::*;
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
        *d = half::f16::from_bits(s).to_f32();
    }
}
