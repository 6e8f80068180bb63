//! MXFP4 (OCP microscaling FP4, GGUF's `block_mxfp4`): 32 weights in 17 bytes, byte for
//! byte.
//!
//! ```text
//! block_mxfp4 (17 bytes): e u8 | qs[16]
//! w = 2^(e − 128) · K[q],  K = 0, 1, 2, 3, 4, 6, 8, 12, 0, −1, −2, −3, −4, −6, −8, −12
//! ```
//!
//! `e` is an E8M0 exponent, `K` twice the FP4 E2M1 value of the 4-bit code (sign bit 3),
//! so `2^(e − 128)·K` is the E2M1 value times the E8M0 scale `2^(e − 127)` exactly
//! (ggml's `GGML_E8M0_TO_FP32_HALF`: `e < 2` gives the subnormals 2^−128, 2^−127).
//! Element `j < 16` is the low nibble of `qs[j]`, element `j + 16` its high nibble.
//! Dequantization is one f32 multiply `d·K[q]`, exact: gguf-py's values.
//!
//! The quantizer: with `d` a power of two, every element's best code is its nearest level
//! whatever the weights, so only `e` is searched: ggml's natural exponent
//! `e0 = floor(log2(max |x|)) − 2 + 127` (the largest element is then 8 to 16 units of
//! `d`, clipped to 12 above 12) and its neighbours `e0 − 2 ..= e0 + 1`, keeping the
//! smallest weighted error `Σ w (x − d·K[q])²` (the first of equal ones, in the order
//! e0, e0 − 1, e0 + 1, e0 − 2).

use crate::format::wtype::QK;

/// MXFP4's 16 levels (ggml's `kvalues_mxfp4`: the E2M1 values doubled).
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The largest exponent the converter stores (255 is E8M0's NaN).
pub const E_MAX: u8 = 254;

/// `2^(e − 128)` as f32 (ggml's `GGML_E8M0_TO_FP32_HALF`), exactly.
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        (e as u32 - 1) << 23
    })
}

/// The 32 codes of a block (element order).
#[inline]
pub fn unpack(b: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..16 {
        q[j] = b[1 + j] & 0x0f;
        q[j + 16] = b[1 + j] >> 4;
    }
    q
}

/// The 16 code bytes of a block from OCP's order, as Hugging Face's gpt-oss checkpoints
/// store them (`*_blocks`: element 2k in the low nibble of byte k, 2k + 1 in its high
/// nibble), to GGUF's (element j in the low nibble of byte j, j + 16 in its high one).
/// The scale byte needs no change: `2^(s − 127)` times an E2M1 value is `2^(s − 128)`
/// times its double, [`KVALUES`].
#[inline]
pub fn qs_from_pairs(pairs: &[u8]) -> [u8; 16] {
    let code = |j: usize| (pairs[j / 2] >> (4 * (j % 2))) & 0x0f;
    let mut qs = [0u8; 16];
    for (j, q) in qs.iter_mut().enumerate() {
        *q = code(j) | code(j + 16) << 4;
    }
    qs
}

/// Dequantizes one block into `out` (32 values).
pub fn dequant_block(b: &[u8], out: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for (o, &q) in out.iter_mut().zip(&unpack(b)) {
        *o = d * KVALUES[q as usize] as f32;
    }
}

/// The code nearest to `v` (in units of `d`): the magnitude thresholds are the midpoints
/// of 0, 1, 2, 3, 4, 6, 8, 12 (the smaller magnitude at a midpoint), then the sign; zero
/// is code 0.
#[inline(always)]
fn nearest(v: f32) -> u8 {
    const MID: [f32; 7] = [0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0];
    let a = v.abs();
    let mut m = 0u8;
    for t in MID {
        m += (a > t) as u8;
    }
    if m != 0 && v < 0.0 {
        m + 8
    } else {
        m
    }
}

/// ggml's exponent for a block whose largest magnitude is `amax > 0`:
/// `floor(log2(amax)) − 2 + 127`, clamped to `0..=E_MAX`.
fn natural_e(amax: f32) -> i32 {
    let bits = amax.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let log2 = if exp == 0 {
        // Subnormal: the position of the leading mantissa bit.
        31 - bits.leading_zeros() as i32 - 149
    } else {
        exp - 127
    };
    (log2 - 2 + 127).clamp(0, E_MAX as i32)
}

/// Quantizes one block of 32 values with element weights `w` into `b` (17 bytes).
pub fn quantize_block(x: &[f32], w: &[f32], b: &mut [u8]) {
    debug_assert_eq!(x.len(), QK);
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let mut q = [0u8; QK];
    let mut e_best = 0u8;
    if amax > 0.0 {
        let e0 = natural_e(amax);
        let mut best = f32::INFINITY;
        let mut cand = [0u8; QK];
        for e in [e0, e0 - 1, e0 + 1, e0 - 2] {
            if !(0..=E_MAX as i32).contains(&e) {
                continue;
            }
            let d = e8m0_half(e as u8);
            let mut err = 0.0f32;
            for i in 0..QK {
                cand[i] = nearest(x[i] / d);
                let r = x[i] - d * KVALUES[cand[i] as usize] as f32;
                err += w[i] * r * r;
            }
            if err < best {
                (best, e_best) = (err, e as u8);
                q = cand;
            }
        }
    }
    b[0] = e_best;
    for j in 0..16 {
        b[1 + j] = q[j] | (q[j + 16] << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_reorder_to_gguf_halves() {
        // OCP pairs: element i has code (i * 5 + 3) % 16; every byte value occurs.
        let codes: Vec<u8> = (0..32).map(|i| ((i * 5 + 3) % 16) as u8).collect();
        let pairs: Vec<u8> = codes.chunks(2).map(|c| c[0] | c[1] << 4).collect();
        let mut b = [0u8; 17];
        b[0] = 130;
        b[1..].copy_from_slice(&qs_from_pairs(&pairs));
        assert_eq!(unpack(&b).to_vec(), codes);
        // The E2M1 value × 2^(s − 127) is the block's value.
        const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let mut out = [0f32; 32];
        dequant_block(&b, &mut out);
        for (o, &c) in out.iter().zip(&codes) {
            let v = E2M1[(c & 7) as usize] * if c & 8 != 0 { -1.0 } else { 1.0 };
            // (Code 8, E2M1's −0, is ggml's level 0: equal as values.)
            assert_eq!(*o, v * 8.0, "code {c}");
        }
    }

    #[test]
    fn e8m0_half_is_two_to_the_e_minus_128() {
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(254), 2f32.powi(126));
        assert_eq!(natural_e(1.0), 125);
        assert_eq!(natural_e(7.99), 127);
        assert_eq!(natural_e(f32::from_bits(1)), 0);
    }

    #[test]
    fn nearest_codes() {
        assert_eq!(nearest(0.0), 0);
        assert_eq!(nearest(-0.4), 0);
        assert_eq!(nearest(0.5), 0); // a midpoint: the smaller magnitude
        assert_eq!(nearest(-0.6), 9);
        assert_eq!(nearest(5.0), 4);
        assert_eq!(nearest(5.1), 5);
        assert_eq!(nearest(-100.0), 15);
        for (q, &k) in KVALUES.iter().enumerate() {
            if q != 8 {
                assert_eq!(nearest(k as f32), q as u8);
            }
        }
    }

    #[test]
    fn a_block_by_hand() {
        // e = 127: d = 1/2; element 0 code 7 (12 → 6.0), element 16 code 13 (−6 → −3.0).
        let mut b = [0u8; 17];
        b[0] = 127;
        b[1] = 0xd7;
        let mut out = [0f32; 32];
        dequant_block(&b, &mut out);
        assert_eq!((out[0], out[16], out[1]), (6.0, -3.0, 0.0));
        // Values on the grid of e = 127 come back exactly.
        let x: Vec<f32> = (0..32).map(|i| [0.5, -1.0, 6.0, 4.0][i % 4]).collect();
        let mut q = [0u8; 17];
        quantize_block(&x, &[1.0; 32], &mut q);
        dequant_block(&q, &mut out);
        assert_eq!(&out[..], &x[..]);
    }
}
