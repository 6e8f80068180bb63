//! `C −= E·U` in f64 (`scalar::subproduct`) on x86: the reference compiled for AVX2 +
//! FMA and for AVX-512 F, with tiles as wide as their registers (4 rows × 8 columns:
//! 8 of the 16 ymm registers accumulate; 8 × 16: 16 of the 32 zmm). Each element's
//! chain of fused steps stays the same, so the bits do.

use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::subproduct::{scaled, tiled, Dims, Rows};
use crate::kernels::tier::Tier;

/// `C −= E·U` (`scalar::subproduct`) compiled for AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA (safe to call from code compiled with them).
#[target_feature(enable = "avx2,fma")]
pub fn sub_product_avx2(d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize)) {
    count(Tier::Avx2, Op::SubProduct);
    tiled::<4, 8>(d, e, u, c)
}

/// `C −= E·U` (`scalar::subproduct`) compiled for AVX-512 F and FMA.
///
/// # Safety
/// The CPU must support AVX-512 F and FMA (safe to call from code compiled with them).
#[target_feature(enable = "avx512f,fma")]
pub fn sub_product_avx512(d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize)) {
    count(Tier::Avx512, Op::SubProduct);
    tiled::<8, 16>(d, e, u, c)
}

/// `y −= a·x` (`scalar::subproduct::scaled`) compiled for AVX2: 4 lanes, unfused.
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with it).
#[target_feature(enable = "avx2")]
pub fn sub_scaled_avx2(a: f64, x: &[f64], y: &mut [f64]) {
    count(Tier::Avx2, Op::SubProduct);
    scaled(a, x, y)
}

/// `y −= a·x` (`scalar::subproduct::scaled`) compiled for AVX-512 F: 8 lanes, unfused.
///
/// # Safety
/// The CPU must support AVX-512 F (safe to call from code compiled with it).
#[target_feature(enable = "avx512f")]
pub fn sub_scaled_avx512(a: f64, x: &[f64], y: &mut [f64]) {
    count(Tier::Avx512, Op::SubProduct);
    scaled(a, x, y)
}
