//! The delta rule's head step (`scalar::delta::head_step`) on x86: the reference
//! compiled for AVX2 (its loops over the value dimension vectorize; the operations of
//! each element stay the same, so the bits do).

use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::delta::{head_step, DeltaHead};
use crate::kernels::tier::Tier;

/// The delta rule's head step (`scalar::delta::head_step`) compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 (safe to call from code compiled with them).
#[target_feature(enable = "avx2")]
pub fn delta_head(x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
    count(Tier::Avx2, Op::Delta);
    head_step(x, s, o, delta)
}
