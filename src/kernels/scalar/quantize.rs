//! The references of the matrix products' inputs: the activation quantizer (Q8_0 of
//! f32 rows, the spec's rounding) and the f16 scales widened to f32.

use crate::format::wtype::QK;
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;
use crate::quant::q8_0;

/// The reference activation quantizer: `quant::q8_0::quantize_block` per block.
///
/// NaN values are skipped by the block maximum (`f32::max` returns the other operand)
/// and quantize to 0; an infinite value makes `d = inf` and every quant 0.
pub fn quantize_act(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    count(Tier::Scalar, Op::Quantize);
    let blocks = x.chunks_exact(QK).zip(q.chunks_exact_mut(QK));
    for ((xb, qb), db) in blocks.zip(d.iter_mut()) {
        *db = q8_0::quantize_block(xb, qb);
    }
}

/// f16 scales (their bits) to f32, exactly, in software (see `table::F16Fn`).
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    count(Tier::Scalar, Op::F16);
    assert_eq!(src.len(), dst.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_bits(s).to_f32_const();
    }
}
