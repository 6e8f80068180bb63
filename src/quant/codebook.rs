//! GGUF's codebook types, byte for byte: IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M.
//!
//! ```text
//! block_iq2_xxs (66 bytes):  d f16 | qs[64]  (8 × (u32 grid bytes, u32 signs + scale))
//! block_iq2_xs  (74 bytes):  d f16 | qs[32] u16 (9-bit grid, 7-bit signs) | scales[8]
//! block_iq2_s   (82 bytes):  d f16 | qs[32] | signs[32] | qh[8] | scales[8]
//! block_iq3_xxs (98 bytes):  d f16 | qs[64] | 8 × u32 (signs + scale)
//! block_iq3_s   (110 bytes): d f16 | qs[64] | qh[8] | signs[32] | scales[4]
//! block_iq1_m   (56 bytes):  qs[32] | qh[16] | scales[8] (4 × u16, d in their top nibbles)
//! ```
//!
//! Every weight is an integer level times an exact f32 scale: [`decode`] gives the 256
//! signed levels `v` of a block and the scale `dw_h` of each 16 weights `h`, with
//!
//! ```text
//! IQ2_XXS  v = ±G2[i]        (8, 25, 43)  dw = d·(0.5 + ls)·0.25   ls 4 bits per 32
//! IQ2_XS   v = ±G2[i]                     dw = d·(0.5 + ls)·0.25   ls 4 bits per 16
//! IQ2_S    v = ±G2[i]                     dw = d·(0.5 + ls)·0.25   ls 4 bits per 16
//! IQ3_XXS  v = ±G3[i]        (4 .. 62)    dw = d·(0.5 + ls)·0.5    ls 4 bits per 32
//! IQ3_S    v = ±G3[i]        (1 .. 15)    dw = d·(1 + 2·ls)        ls 4 bits per 32
//! IQ1_M    v = 8·G1[i] ± 1   (−9 .. 9)    dw = d·(2·ls + 1)·0.125  ls 3 bits per 16
//! ```
//!
//! and `w = dw·v`. Each product is exact in f32 (an f16 times at most 5 + 6 bits of
//! integer), so `dw·v` is the value gguf-py's `db·grid·sign` (IQ1_M: `dl·(grid ± 1/8)`)
//! gives, bit for bit. The grids and the sign table are `format::iq_grids` (generated);
//! docs/file-format.md ("The IQ codebook types") states where every field lives.
//!
//! The quantizer that writes these bytes is [`super::codebook_fit`].

use crate::format::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};
use crate::format::wtype::{WType, QK_K};

/// Whether `t` is one of the codebook types.
pub fn is_codebook(t: WType) -> bool {
    WType::CODEBOOKS.contains(&t)
}

/// Whether `t` has a scale per 16 weights (else one per 32: `dw` of both halves equal).
pub fn halves(t: WType) -> bool {
    matches!(t, WType::IQ2_XS | WType::IQ2_S | WType::IQ1_M)
}

/// The largest `|v|` of type `t`.
pub fn max_level(t: WType) -> i32 {
    match t {
        WType::IQ2_XXS | WType::IQ2_XS | WType::IQ2_S => 43,
        WType::IQ3_XXS => 62,
        WType::IQ3_S => 15,
        WType::IQ1_M => 9,
        _ => 0,
    }
}

/// A block's signed levels (element order) and the scale of each 16 weights.
#[derive(Debug, Clone, Copy)]
pub struct Decoded {
    pub v: [i8; QK_K],
    pub dw: [f32; QK_K / 16],
}

fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 8 values of grid entry `e` (u64: one per byte) with sign bits `s` (bit `i`
/// negates value `i`), into `out`.
fn put8(out: &mut [i8], e: u64, s: u8) {
    for (i, o) in out.iter_mut().enumerate().take(8) {
        let m = (e >> (8 * i)) as u8 as i8;
        *o = if s >> i & 1 != 0 { -m } else { m };
    }
}

/// The 4 values of grid entry `e` (u32) with sign bits `s` (bit `i` negates value `i`).
fn put4(out: &mut [i8], e: u32, s: u8) {
    for (i, o) in out.iter_mut().enumerate().take(4) {
        let m = (e >> (8 * i)) as u8 as i8;
        *o = if s >> i & 1 != 0 { -m } else { m };
    }
}

/// IQ1_M's f16 `d`: the top nibbles of its four scale words, lowest word first.
pub fn iq1m_d(b: &[u8]) -> f32 {
    f16(iq1m_d_bits(b))
}

/// The f16 bits of IQ1_M's `d` (see [`iq1m_d`]).
#[inline(always)]
pub fn iq1m_d_bits(b: &[u8]) -> u16 {
    let sc = |k: usize| u16_at(b, 48 + 2 * k);
    (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000)
}

/// The scale `dw_h` of each 16 weights `h` of block `b` of codebook type `t` (the types
/// with a scale per 32 give both halves the same).
///
/// Panics if `t` is not a codebook type or `b` is shorter than its block.
pub fn scales(t: WType, b: &[u8]) -> [f32; QK_K / 16] {
    dw_of(t, scale_codes(t, b))
}

/// The super-scale `d` (its f16 value) and the scale codes `ls` block `b` of codebook type
/// `t` stores: one per 16 weights (IQ2_XS, IQ2_S, IQ1_M), else one per 32 in the first 8.
///
/// Panics if `t` is not a codebook type or `b` is shorter than its block.
pub fn scale_codes(t: WType, b: &[u8]) -> (f32, [u8; 16]) {
    assert!(is_codebook(t) && b.len() >= t.block_bytes(), "{t} block");
    let mut codes = [0u8; 16];
    let nib = |at: usize, h: usize| b[at + h / 2] >> (4 * (h % 2)) & 15;
    let d = if t == WType::IQ1_M {
        iq1m_d(b)
    } else {
        f16(u16_at(b, 0))
    };
    match t {
        WType::IQ2_XXS => (0..8).for_each(|j| codes[j] = (u32_at(b, 2 + 8 * j + 4) >> 28) as u8),
        WType::IQ3_XXS => (0..8).for_each(|j| codes[j] = (u32_at(b, 66 + 4 * j) >> 28) as u8),
        WType::IQ2_XS => (0..16).for_each(|h| codes[h] = nib(66, h)),
        WType::IQ2_S => (0..16).for_each(|h| codes[h] = nib(74, h)),
        WType::IQ3_S => (0..8).for_each(|j| codes[j] = nib(106, j)),
        WType::IQ1_M => (0..16).for_each(|h| {
            codes[h] = (u16_at(b, 48 + 2 * (h / 4)) >> (3 * (h % 4)) & 7) as u8;
        }),
        _ => unreachable!("checked above"),
    }
    (d, codes)
}

/// The scale of each 16 weights from `d` and the codes ([`scale_codes`]).
pub fn dw_of(t: WType, (d, codes): (f32, [u8; 16])) -> [f32; QK_K / 16] {
    let mut dw = [0f32; QK_K / 16];
    let ls = |k: usize| codes[k] as f32;
    match t {
        WType::IQ2_XXS | WType::IQ3_XXS => {
            for (j, pair) in dw.chunks_exact_mut(2).enumerate() {
                let v = if t == WType::IQ3_XXS {
                    d * (0.5 + ls(j)) * 0.5
                } else {
                    d * (0.5 + ls(j)) * 0.25
                };
                pair.fill(v);
            }
        }
        WType::IQ2_XS | WType::IQ2_S => {
            for (h, o) in dw.iter_mut().enumerate() {
                *o = d * (0.5 + ls(h)) * 0.25;
            }
        }
        WType::IQ3_S => {
            for (j, pair) in dw.chunks_exact_mut(2).enumerate() {
                pair.fill(d * (1.0 + 2.0 * ls(j)));
            }
        }
        WType::IQ1_M => {
            for (h, o) in dw.iter_mut().enumerate() {
                *o = d * (2.0 * ls(h) + 1.0) * 0.125;
            }
        }
        t => panic!("{t} is not a codebook type"),
    }
    dw
}

/// The 7-bit sign indices of a u32 (IQ2_XXS, IQ3_XXS) as their 4 sign bytes, lowest
/// first: byte `l` holds the signs of weights `8l..8l + 8` of the 32.
pub fn ksigns4(aux: u32) -> u32 {
    (0..4).fold(0, |acc, l| {
        acc | (KSIGNS[(aux >> (7 * l) & 127) as usize] as u32) << (8 * l)
    })
}

/// The grid index of group `k` of 8 weights of an IQ2_S block (8 bits of `qs`, 2 of `qh`).
#[inline(always)]
pub fn iq2s_index(b: &[u8], k: usize) -> usize {
    b[2 + k] as usize | (b[66 + k / 4] as usize >> (2 * (k % 4)) & 3) << 8
}

/// The grid index of group `i` of 4 weights of an IQ3_S block (8 bits of `qs`, 1 of `qh`).
#[inline(always)]
pub fn iq3s_index(b: &[u8], i: usize) -> usize {
    b[2 + i] as usize | (b[66 + i / 8] as usize >> (i % 8) & 1) << 8
}

/// The grid index of group `k` of 8 weights of an IQ1_M block (8 bits of `qs`, 3 of the
/// `qh` nibble) and its shift bit (bit 3 of the nibble: the shift is −1/8, else +1/8).
#[inline(always)]
pub fn iq1m_index(b: &[u8], k: usize) -> (usize, bool) {
    let qh = b[32 + k / 2] >> (4 * (k % 2));
    (b[k] as usize | (qh as usize & 7) << 8, qh & 8 != 0)
}

/// Decodes one block `b` of codebook type `t`.
///
/// Panics if `t` is not a codebook type or `b` is shorter than its block.
pub fn decode(t: WType, b: &[u8]) -> Decoded {
    let mut o = Decoded {
        v: [0; QK_K],
        dw: scales(t, b),
    };
    let v = &mut o.v;
    match t {
        WType::IQ2_XXS => {
            for j in 0..8 {
                let s = ksigns4(u32_at(b, 2 + 8 * j + 4));
                for l in 0..4 {
                    let e = IQ2XXS_GRID[b[2 + 8 * j + l] as usize];
                    put8(&mut v[32 * j + 8 * l..][..8], e, (s >> (8 * l)) as u8);
                }
            }
        }
        WType::IQ3_XXS => {
            for j in 0..8 {
                let s = ksigns4(u32_at(b, 66 + 4 * j));
                for i in 0..8 {
                    let e = IQ3XXS_GRID[b[2 + 8 * j + i] as usize];
                    put4(&mut v[32 * j + 4 * i..][..4], e, (s >> (4 * i)) as u8);
                }
            }
        }
        WType::IQ2_XS => {
            for k in 0..32 {
                let q = u16_at(b, 2 + 2 * k);
                let s = KSIGNS[(q >> 9) as usize];
                put8(&mut v[8 * k..][..8], IQ2XS_GRID[(q & 511) as usize], s);
            }
        }
        WType::IQ2_S => {
            for k in 0..32 {
                put8(&mut v[8 * k..][..8], IQ2S_GRID[iq2s_index(b, k)], b[34 + k]);
            }
        }
        WType::IQ3_S => {
            for i in 0..64 {
                // Sign byte k covers weights 8k..8k + 8: this entry is its half i % 2.
                let s = b[74 + i / 2] >> (4 * (i % 2));
                put4(&mut v[4 * i..][..4], IQ3S_GRID[iq3s_index(b, i)], s);
            }
        }
        WType::IQ1_M => {
            for k in 0..32 {
                let (i, neg) = iq1m_index(b, k);
                // 8·(g ± 1/8) = 8g ± 1.
                let shift = if neg { -1 } else { 1 };
                let e = IQ1S_GRID[i];
                for (l, x) in v[8 * k..][..8].iter_mut().enumerate() {
                    *x = 8 * ((e >> (8 * l)) as u8 as i8) + shift;
                }
            }
        }
        _ => unreachable!("scales() checked the type"),
    }
    o
}

/// Dequantizes one block `b` of codebook type `t` into `out` (256 values): `dw_h·v`.
pub fn dequant_block(t: WType, b: &[u8], out: &mut [f32]) {
    let dec = decode(t, b);
    for (e, (o, &v)) in out.iter_mut().zip(&dec.v).enumerate() {
        *o = dec.dw[e / 16] * v as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn iq2_xxs_by_hand() {
        // Group 0: grid entries 0 (all 8) and 1 (…, 43 last), sign index 1 (0x81: values
        // 0 and 7 negative) for the first 8, scale 3: dw = 2·3.5·0.25 = 1.75.
        let mut b = [0u8; 66];
        b[0..2].copy_from_slice(&h(2.0));
        b[3] = 1;
        let aux: u32 = 1 | (3 << 28);
        b[6..10].copy_from_slice(&aux.to_le_bytes());
        let d = decode(WType::IQ2_XXS, &b);
        assert_eq!(d.v[..8], [-8, 8, 8, 8, 8, 8, 8, -8]);
        assert_eq!(d.v[8..16], [43, 8, 8, 8, 8, 8, 8, 8]);
        assert_eq!((d.dw[0], d.dw[1]), (1.75, 1.75));
        let mut y = [0f32; 256];
        dequant_block(WType::IQ2_XXS, &b, &mut y);
        assert_eq!((y[0], y[8]), (-14.0, 1.75 * 43.0));
    }

    #[test]
    fn iq1_m_scale_and_shift() {
        // d = 1 (0x3c00) spread over the top nibbles; scale 0 of the first word = 2: dw =
        // 5/8. Group 0: grid entry 0 (all −1), shift bit set: 8·(−1) − 1 = −9.
        let mut b = [0u8; 56];
        let d = 0x3c00u16;
        for k in 0..4 {
            let w = ((d >> (4 * k)) & 15) << 12 | if k == 0 { 2 } else { 0 };
            b[48 + 2 * k..50 + 2 * k].copy_from_slice(&w.to_le_bytes());
        }
        b[32] = 0x08;
        let dec = decode(WType::IQ1_M, &b);
        assert_eq!(iq1m_d(&b), 1.0);
        assert_eq!(dec.dw[0], 0.625);
        assert_eq!(dec.v[..8], [-9; 8]);
        assert_eq!(dec.v[8], -7, "group 1: shift +1/8");
        assert!(dec
            .v
            .iter()
            .all(|&x| x.abs() <= max_level(WType::IQ1_M) as i8));
    }

    #[test]
    fn grids_hold_their_values() {
        let bytes = |e: u64, n: usize| (0..n).map(move |i| (e >> (8 * i)) as u8);
        for g in [&IQ2XXS_GRID[..], &IQ2XS_GRID[..], &IQ2S_GRID[..]] {
            assert!(g
                .iter()
                .all(|&e| bytes(e, 8).all(|v| [8, 25, 43].contains(&v))));
        }
        let ok3 = |g: &[u32], vals: &[u8]| {
            g.iter()
                .all(|&e| bytes(e as u64, 4).all(|v| vals.contains(&v)))
        };
        assert!(ok3(&IQ3XXS_GRID, &[4, 12, 20, 28, 36, 44, 52, 62]));
        assert!(ok3(&IQ3S_GRID, &[1, 3, 5, 7, 9, 11, 13, 15]));
        assert!(IQ1S_GRID
            .iter()
            .all(|&e| bytes(e, 8).all(|v| [0xff, 0, 1].contains(&v))));
        assert!(KSIGNS.iter().all(|k| k.count_ones() % 2 == 0));
    }
}
