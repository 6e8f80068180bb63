//! The 32-weight GGUF block types for rows whose length is not a multiple of 256:
//! Q4_1, Q5_0, Q5_1 and IQ4_NL with GGUF's exact bytes, and Krafla's Q6_0.
//!
//! Each block is 32 consecutive weights of a row, stored as one record with its scale
//! (no separate scale array), byte for byte as `block_q4_1`, `block_q5_0`,
//! `block_q5_1` and `block_iq4_nl` of ggml, so they convert to and from GGUF without
//! loss. Scales are IEEE f16, little-endian. Element `j < 16` takes the low nibble of
//! `qs[j]`, element `j + 16` its high nibble; the fifth bit of Q5 element `j` is bit `j`
//! of the little-endian u32 `qh`; Q6_0 (ik_llama.cpp's `block_q6_0` layout) takes bits
//! 4–5 of element `j < 16` from bits `4·(j/8)..+2` of `qh[j % 8]` and of element
//! `j + 16` from the two bits above those.
//!
//! | type | bytes | value of level `q` | bits per weight |
//! |---|---|---|---|
//! | Q4_1 | d, m, qs[16] (20) | `d·q + m`, q in 0..=15 | 5.0 |
//! | Q5_0 | d, qh[4], qs[16] (22) | `d·(q − 16)`, q in 0..=31 | 5.5 |
//! | Q5_1 | d, m, qh[4], qs[16] (24) | `d·q + m`, q in 0..=31 | 6.0 |
//! | IQ4_NL | d, qs[16] (18) | `d·T[q]`, T = [`IQ4NL_VALUES`] | 4.5 |
//! | Q6_0 | d, qh[8], qs[16] (26) | `d·(q − 32)`, q in 0..=63 | 6.5 |
//!
//! Dequantization is one f32 multiply (`d·v`), or a multiply and an add (`d·q + m`),
//! each rounded: the f32 values numpy's `gguf.quants.dequantize` gives.
//!
//! The quantizers search ([`super::fit`]): weighted least squares over candidate
//! scales, then the f16 values next to the fitted scale(s) with the levels re-assigned.

use super::fit::{self, Levels};
use crate::format::wtype::{WType, QK};

/// IQ4_NL's 16 levels (ggml's `kvalues_iq4nl`).
pub const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Whether `t` is one of this module's types.
pub fn is_block32(t: WType) -> bool {
    matches!(
        t,
        WType::Q4_1 | WType::Q5_0 | WType::Q5_1 | WType::IQ4_NL | WType::Q6_0
    )
}

/// How a type's levels map to values.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// `w = d·v[q]`.
    Symmetric(Levels),
    /// `w = d·q + m`, q in `0..=nmax`.
    Affine { nmax: u8 },
}

/// The value mapping of `t` (one of [`is_block32`]'s types).
pub fn kind(t: WType) -> Kind {
    match t {
        WType::Q4_1 => Kind::Affine { nmax: 15 },
        WType::Q5_1 => Kind::Affine { nmax: 31 },
        WType::Q5_0 => Kind::Symmetric(Levels::Uniform { lo: -16, hi: 15 }),
        WType::Q6_0 => Kind::Symmetric(Levels::Uniform { lo: -32, hi: 31 }),
        WType::IQ4_NL => Kind::Symmetric(Levels::Table(&IQ4NL_VALUES)),
        t => panic!("{t} is not a 32-block GGUF type"),
    }
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Offset of `qs` in a block, and whether the type has `m` and `qh`.
fn parts(t: WType) -> (usize, bool, usize) {
    // (qs offset, has m, qh bytes)
    match t {
        WType::Q4_1 => (4, true, 0),
        WType::Q5_0 => (6, false, 4),
        WType::Q5_1 => (8, true, 4),
        WType::IQ4_NL => (2, false, 0),
        WType::Q6_0 => (10, false, 8),
        t => panic!("{t} is not a 32-block GGUF type"),
    }
}

/// The scale `d` and (affine types) minimum `m` of block `b`, as f32.
#[inline]
pub fn scales(t: WType, b: &[u8]) -> (f32, f32) {
    let (_, has_m, _) = parts(t);
    (f16_at(b, 0), if has_m { f16_at(b, 2) } else { 0.0 })
}

/// The 32 level indices `q` of block `b` (before the type's offset or table).
#[inline]
pub fn unpack(t: WType, b: &[u8]) -> [u8; QK] {
    let (qs_at, has_m, qh_len) = parts(t);
    let qh_at = if has_m { 4 } else { 2 };
    let qs = &b[qs_at..qs_at + 16];
    let qh = &b[qh_at..qh_at + qh_len];
    let mut q = [0u8; QK];
    for j in 0..16 {
        q[j] = qs[j] & 0x0f;
        q[j + 16] = qs[j] >> 4;
    }
    match qh_len {
        4 => {
            let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
            for (j, v) in q.iter_mut().enumerate() {
                *v |= (((h >> j) & 1) as u8) << 4;
            }
        }
        8 => {
            for j in 0..16 {
                let h = qh[j % 8] >> (4 * (j / 8));
                q[j] |= (h & 3) << 4;
                q[j + 16] |= ((h >> 2) & 3) << 4;
            }
        }
        _ => {}
    }
    q
}

/// Writes the 32 level indices into block `b`'s `qs` (and `qh`).
pub(crate) fn pack(t: WType, q: &[u8; QK], b: &mut [u8]) {
    let (qs_at, has_m, qh_len) = parts(t);
    let qh_at = if has_m { 4 } else { 2 };
    for j in 0..16 {
        b[qs_at + j] = (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4);
    }
    match qh_len {
        4 => {
            let mut h = 0u32;
            for (j, &v) in q.iter().enumerate() {
                h |= ((v >> 4) as u32 & 1) << j;
            }
            b[qh_at..qh_at + 4].copy_from_slice(&h.to_le_bytes());
        }
        8 => {
            let qh = &mut b[qh_at..qh_at + 8];
            qh.fill(0);
            for j in 0..16 {
                let h = ((q[j] >> 4) & 3) | (((q[j + 16] >> 4) & 3) << 2);
                qh[j % 8] |= h << (4 * (j / 8));
            }
        }
        _ => {}
    }
}

/// Dequantizes one block into `out` (32 values).
pub fn dequant_block(t: WType, b: &[u8], out: &mut [f32]) {
    let (d, m) = scales(t, b);
    let q = unpack(t, b);
    match kind(t) {
        Kind::Symmetric(lv) => {
            for (o, &l) in out.iter_mut().zip(&q) {
                *o = d * lv.value(l);
            }
        }
        Kind::Affine { .. } => {
            for (o, &l) in out.iter_mut().zip(&q) {
                *o = d * l as f32 + m;
            }
        }
    }
}

/// Quantizes one block of 32 values with element weights `w` into `b`
/// ([`WType::block_bytes`] bytes). `Err(v)` when a scale `v` does not fit in an f16.
pub fn quantize_block(t: WType, x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    debug_assert_eq!(x.len(), QK);
    let mut q = [0u8; QK];
    match kind(t) {
        Kind::Symmetric(lv) => {
            let d = fit::fit_symmetric_f16(x, w, &lv, &mut q)
                .ok_or_else(|| fit::fit_symmetric(x, w, &lv, &mut [0u8; QK]))?;
            b[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        }
        Kind::Affine { nmax } => {
            let (d, m) = fit::fit_affine_f16(x, w, nmax, &mut q).ok_or_else(|| {
                let (d, m) = fit::fit_affine(x, w, nmax, false, &mut [0u8; QK]);
                if d.abs() > m.abs() {
                    d
                } else {
                    m
                }
            })?;
            b[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
            b[2..4].copy_from_slice(&half::f16::from_f32(m).to_bits().to_le_bytes());
        }
    }
    pack(t, &q, b);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    const TYPES: [WType; 5] = [
        WType::Q4_1,
        WType::Q5_0,
        WType::Q5_1,
        WType::IQ4_NL,
        WType::Q6_0,
    ];

    #[test]
    fn pack_unpack_round_trip() {
        let mut s = 7u64;
        for t in TYPES {
            let nmax = match kind(t) {
                Kind::Symmetric(lv) => lv.len() as u8 - 1,
                Kind::Affine { nmax } => nmax,
            };
            for _ in 0..50 {
                let mut q = [0u8; QK];
                for v in q.iter_mut() {
                    *v = ((rng(&mut s) + 1.0) * 0.5 * (nmax as f32 + 0.999)) as u8;
                }
                let mut b = vec![0u8; t.block_bytes()];
                pack(t, &q, &mut b);
                assert_eq!(unpack(t, &b), q, "{t}");
            }
        }
    }

    #[test]
    fn hand_made_blocks_dequantize() {
        // Q5_0: d = 0.5, element 0: low nibble 3, high bit 1 → q = 19 → 0.5·3 = 1.5;
        // element 16: high nibble 0, bit 16 of qh 0 → q = 0 → -8.
        let mut b = [0u8; 22];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2] = 1; // qh bit 0
        b[6] = 0x03;
        let mut out = [0f32; 32];
        dequant_block(WType::Q5_0, &b, &mut out);
        assert_eq!(out[0], 1.5);
        assert_eq!(out[16], -8.0);
        assert_eq!(out[1], -8.0);
        // Q6_0: element 9 (j = 9 < 16) takes bits 4-5 from qh[1] bits 4-5;
        // element 25 (= 9 + 16) from qh[1] bits 6-7.
        let mut b = [0u8; 26];
        b[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        b[2 + 1] = 0b1110_0000; // element 9: high bits 2, element 25: high bits 3
        b[10 + 9] = 0x5a; // element 9 low 0xa, element 25 low 0x5
        dequant_block(WType::Q6_0, &b, &mut out);
        assert_eq!(out[9], (0x2a - 32) as f32);
        assert_eq!(out[25], (0x35 - 32) as f32);
        assert_eq!(out[0], -32.0);
        // IQ4_NL: nibble 0 → -127, 15 → 113.
        let mut b = [0u8; 18];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        b[2] = 0xf0;
        dequant_block(WType::IQ4_NL, &b, &mut out);
        assert_eq!(out[0], -127.0 * 0.25);
        assert_eq!(out[16], 113.0 * 0.25);
        // Q4_1: d = 2, m = -1: level 15 → 29.
        let mut b = [0u8; 20];
        b[0..2].copy_from_slice(&half::f16::from_f32(2.0).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_bits().to_le_bytes());
        b[4] = 0x0f;
        dequant_block(WType::Q4_1, &b, &mut out);
        assert_eq!(out[0], 29.0);
        assert_eq!(out[16], -1.0);
    }

    #[test]
    fn f16_overflow_is_an_error() {
        let x = [1e9f32; 32];
        let w = [1.0f32; 32];
        for t in TYPES {
            let mut b = vec![0u8; t.block_bytes()];
            assert!(quantize_block(t, &x, &w, &mut b).is_err(), "{t}");
        }
    }
}
