//! Dequantization of the ggml block types a GGUF file commonly holds, to f32, with the
//! float operations of ggml's reference `dequantize_row_*` (no fused multiply-add):
//! F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K.
//! `mlb-convert --requantize` reads every type Krafla lacks through it. Tested against
//! gguf-py's numpy dequantizers on random blocks (`testdata/gguf/dequant.gguf`).

use half::f16;

use super::types::GgmlType;

/// Whether [`dequantize_row`] reads `ty`.
pub fn supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
    )
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes whole blocks of `ty` in `src` into `out` (`src.len() / block_bytes ×
/// block_size` values). Returns false, writing nothing, for a type it does not read
/// or mismatched lengths.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> bool {
    let (bs, bb) = (ty.block_size() as usize, ty.block_bytes() as usize);
    if !supported(ty) || !src.len().is_multiple_of(bb) || out.len() != src.len() / bb * bs {
        return false;
    }
    for (x, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
        block(ty, x, y);
    }
    true
}

fn block(ty: GgmlType, x: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::F32 => y[0] = f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
        GgmlType::F16 => y[0] = h(x, 0),
        GgmlType::BF16 => y[0] = f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16),
        GgmlType::Q8_0 => {
            let d = h(x, 0);
            for (o, &q) in y.iter_mut().zip(&x[2..34]) {
                *o = (q as i8) as f32 * d;
            }
        }
        GgmlType::Q4_0 => {
            let d = h(x, 0);
            for j in 0..16 {
                let q = x[2 + j];
                y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (h(x, 0), h(x, 2));
            for j in 0..16 {
                let q = x[4 + j];
                y[j] = (q & 0x0f) as f32 * d + m;
                y[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = h(x, 0);
            let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
            for j in 0..16 {
                let q = x[6 + j];
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = (((q & 0x0f) as u32 | h0) as i32 - 16) as f32 * d;
                y[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let (d, m) = (h(x, 0), h(x, 2));
            let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
            for j in 0..16 {
                let q = x[8 + j];
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = ((q & 0x0f) as u32 | h0) as f32 * d + m;
                y[j + 16] = ((q >> 4) as u32 | h1) as f32 * d + m;
            }
        }
        GgmlType::Q2_K => q2_k(x, y),
        GgmlType::Q3_K => q3_k(x, y),
        GgmlType::Q4_K => q45_k(x, y, false),
        GgmlType::Q5_K => q45_k(x, y, true),
        GgmlType::Q6_K => q6_k(x, y),
        _ => unreachable!("checked by supported()"),
    }
}

/// block_q2_K: scales[16], qs[64], d, dmin.
fn q2_k(x: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&x[0..16], &x[16..80]);
    let (d, min) = (h(x, 80), h(x, 82));
    let mut is = 0;
    let mut o = 0;
    for n in 0..2 {
        let q = &qs[n * 32..n * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0f) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    y[o] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    o += 1;
                }
            }
        }
    }
}

/// block_q3_K: hmask[32], qs[64], scales[12] (6-bit, packed), d.
fn q3_k(x: &[u8], y: &mut [f32]) {
    let (hm, qs, sb) = (&x[0..32], &x[32..96], &x[96..108]);
    let d_all = h(x, 108);
    let mut aux = [0u32; 4];
    for (i, a) in aux.iter_mut().take(3).enumerate() {
        *a = u32::from_le_bytes([sb[4 * i], sb[4 * i + 1], sb[4 * i + 2], sb[4 * i + 3]]);
    }
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let mut scales = [0i8; 16];
    for (i, a) in aux.iter().enumerate() {
        for (k, b) in a.to_le_bytes().iter().enumerate() {
            scales[4 * i + k] = *b as i8;
        }
    }
    let mut is = 0;
    let mut o = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &qs[n * 32..n * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let i = l + 16 * half;
                    let v = ((q[i] >> shift) & 3) as i32 - if hm[i] & m != 0 { 0 } else { 4 };
                    y[o] = dl * v as f32;
                    o += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The j-th 6-bit scale and min of a Q4_K / Q5_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// block_q4_K: d, dmin, scales[12], qs[128]; block_q5_K: d, dmin, scales[12],
/// qh[32], qs[128].
fn q45_k(x: &[u8], y: &mut [f32], five: bool) {
    let (d, min) = (h(x, 0), h(x, 2));
    let scales = &x[4..16];
    let (qh, ql) = if five {
        (&x[16..48], &x[48..176])
    } else {
        (&x[0..0], &x[16..144])
    };
    let (mut u1, mut u2) = (1u8, 2u8);
    for (k, j) in (0..256).step_by(64).enumerate() {
        let is = 2 * k;
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        let q = &ql[k * 32..k * 32 + 32];
        for l in 0..32 {
            let hi = if five && qh[l] & u1 != 0 { 16 } else { 0 };
            y[j + l] = d1 * ((q[l] & 0x0f) + hi) as f32 - m1;
        }
        for l in 0..32 {
            let hi = if five && qh[l] & u2 != 0 { 16 } else { 0 };
            y[j + 32 + l] = d2 * ((q[l] >> 4) + hi) as f32 - m2;
        }
        u1 <<= 2;
        u2 <<= 2;
    }
}

/// block_q6_K: ql[128], qh[64], scales[16] (int8), d.
fn q6_k(x: &[u8], y: &mut [f32]) {
    let d = h(x, 208);
    for n in 0..2 {
        let ql = &x[n * 64..n * 64 + 64];
        let qh = &x[128 + n * 32..128 + n * 32 + 32];
        let sc = &x[192 + n * 8..192 + n * 8 + 8];
        let y = &mut y[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_blocks() {
        // Q8_0: d = 0.5, quants 0..32 signed.
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for i in 0..32 {
            b[2 + i] = (i as i8 - 16) as u8;
        }
        let mut y = [0f32; 32];
        assert!(dequantize_row(GgmlType::Q8_0, &b, &mut y));
        assert_eq!(y[0], -8.0);
        assert_eq!(y[31], 7.5);
        // Q4_0: byte j holds element j (low) and j + 16 (high).
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2] = 0xf0;
        assert!(dequantize_row(GgmlType::Q4_0, &b, &mut y));
        assert_eq!((y[0], y[16], y[1]), (-8.0, 7.0, -8.0));
        // Wrong lengths and unsupported types write nothing.
        assert!(!dequantize_row(GgmlType::Q4_0, &b[..17], &mut y));
        assert!(!dequantize_row(
            GgmlType::IQ2_XXS,
            &[0; 66],
            &mut [0.0; 256]
        ));
    }
}
