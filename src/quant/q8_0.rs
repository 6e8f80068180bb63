//! Q8_0: `d = amax / 127`, `q = trunc(x · (127 / amax) + copysign(0.5, x))`, clamped to ±127.
//!
//! This is the reference for both the writer and the runtime's activation quantizer;
//! the SIMD activation quantizers in `kernels` must match it bit for bit.

use crate::format::wtype::QK;

/// Below this block maximum, `127 / amax` would overflow: the block is all zeros.
pub const AMAX_MIN: f32 = 1e-30;

/// Quantizes one block of 32 values with an f32 scale; returns `d`.
#[inline]
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    debug_assert_eq!(x.len(), QK);
    debug_assert_eq!(q.len(), QK);
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax < AMAX_MIN {
        q.fill(0);
        return 0.0;
    }
    let d = amax / 127.0;
    let id = 127.0 / amax;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = round_q8(v * id);
    }
    d
}

/// Dequantizes one block: `out[i] = (q[i] as i8) · d`, one f32 multiply.
#[inline]
pub fn dequant_block(q: &[u8], d: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = v as i8 as f32 * d;
    }
}

/// `trunc(v + copysign(0.5, v))` clamped to ±127; the float-to-int cast truncates.
#[inline(always)]
pub fn round_q8(v: f32) -> i8 {
    let r = (v + 0.5f32.copysign(v)).trunc();
    r.clamp(-127.0, 127.0) as i8
}

/// Quantizes one block with an f16 scale: `d` is rounded to the nearest f16 first and
/// the quants are computed against the rounded `d`. Returns the f16 scale, or `None`
/// when `d` is above 65504 and cannot be stored.
#[inline]
pub fn quantize_block_f16(x: &[f32], q: &mut [i8]) -> Option<half::f16> {
    debug_assert_eq!(x.len(), QK);
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax < AMAX_MIN {
        q.fill(0);
        return Some(half::f16::ZERO);
    }
    let d = amax / 127.0;
    if d > 65504.0 {
        return None;
    }
    let dh = half::f16::from_f32(d);
    let dr = dh.to_f32();
    if dr == 0.0 {
        // d underflowed f16: every weight rounds to zero against it.
        q.fill(0);
        return Some(dh);
    }
    let id = 1.0 / dr;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = round_q8(v * id);
    }
    Some(dh)
}

/// Quantizes a row (length a multiple of 32) with f32 scales.
pub fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    debug_assert_eq!(x.len() % QK, 0);
    for ((xb, qb), db) in x
        .chunks_exact(QK)
        .zip(q.chunks_exact_mut(QK))
        .zip(d.iter_mut())
    {
        *db = quantize_block(xb, qb);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_basic() {
        let mut x = [0.0f32; 32];
        x[0] = 1.0;
        x[1] = -0.5;
        x[2] = 0.25;
        let mut q = [0i8; 32];
        let d = quantize_block(&x, &mut q);
        assert_eq!(d, 1.0 / 127.0);
        assert_eq!(q[0], 127);
        // -0.5 * 127 = -63.5 rounds away from zero.
        assert_eq!(q[1], -64);
        // 31.75 + 0.5 truncates to 32.
        assert_eq!(q[2], 32);
        assert!(q[3..].iter().all(|&v| v == 0));
    }

    #[test]
    fn tiny_block_is_zero() {
        let x = [1e-31f32; 32];
        let mut q = [5i8; 32];
        assert_eq!(quantize_block(&x, &mut q), 0.0);
        assert!(q.iter().all(|&v| v == 0));
    }

    #[test]
    fn f16_scale_refuses_huge() {
        let x = [1e7f32; 32];
        let mut q = [0i8; 32];
        assert!(quantize_block_f16(&x, &mut q).is_none());
        let x = [1.0f32; 32];
        let d = quantize_block_f16(&x, &mut q).unwrap();
        assert_eq!(d, half::f16::from_f32(1.0 / 127.0));
        // 1 / rounded d is slightly off 127: the quants are computed against it.
        let dr = d.to_f32();
        assert_eq!(q[0] as f32, (1.0f32 * (1.0 / dr) + 0.5).trunc().min(127.0));
    }
}
