//! The K types: GGUF's Q4_K, Q5_K and Q6_K super-blocks of 256 weights, byte for byte.
//!
//! ```text
//! block_q4_K (144 bytes): d f16 | dmin f16 | scales[12] | qs[128]
//! block_q5_K (176 bytes): d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
//! block_q6_K (210 bytes): ql[128] | qh[64] | scales[16] (i8) | d f16
//! ```
//!
//! **Q4_K / Q5_K**: 8 sub-blocks of 32; sub-block `j` has a 6-bit scale `sc_j` and a
//! 6-bit minimum `m_j`, and its weights are `w = (d·sc_j)·q − (dmin·m_j)`. The 12 scale
//! bytes hold, for `j < 4`, `sc_j` and `m_j` in the low 6 bits of bytes `j` and `j + 4`;
//! for `j ≥ 4`, the low 4 bits of `sc_j` and `m_j` in the low and high nibble of byte
//! `j + 4`, and their top 2 bits in bits 6–7 of bytes `j − 4` (sc) and `j` (m). Level
//! `q` of element `l` of sub-block `j` is nibble `j % 2` (low first) of
//! `qs[32·(j/2) + l]`; Q5_K adds bit `j` of `qh[l]` as bit 4.
//!
//! **Q6_K**: 16 sub-blocks of 16, each with an int8 scale `sc`; `w = (d·sc)·(q − 32)`,
//! `q` in 0..=63. Element `e` (with `h = e/128`, `k = (e%128)/32`, `l = e%32`) takes
//! its low 4 bits from nibble `k/2` of `ql[64h + 32·(k%2) + l]` and its top 2 bits
//! from bits `2k..2k+2` of `qh[32h + l]`; its scale is `scales[e/16]`.
//!
//! Dequantization is `(d·sc)·q − (dmin·m)` (Q6_K: `(d·sc)·(q − 32)`) in f32, each
//! operation rounded, no FMA; `d·sc` and `dmin·m` are exact (an f16 times a 6- or 8-bit
//! integer fits in f32's mantissa). These are the f32 values of gguf-py's numpy
//! dequantizers (test `dequant_matches_gguf_py`).
//!
//! The quantizers search: each sub-block's scale (and minimum) by the weighted
//! least-squares fits of [`super::fit`], then the super-block's f16 scales and the
//! sub-block codes by a weighted least-squares fit of the sub-block scales, then per
//! sub-block the codes next to the chosen ones with the levels re-assigned, keeping
//! the smallest weighted error of the stored block.

use super::fit::{self, Levels};
use crate::format::wtype::{WType, QK, QK_K};

/// Sub-blocks of 32 per super-block.
const NSUB: usize = QK_K / QK;

/// Whether `t` is one of the K types.
pub fn is_k(t: WType) -> bool {
    matches!(t, WType::Q4_K | WType::Q5_K | WType::Q6_K)
}

#[inline(always)]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[inline(always)]
pub(super) fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// Sub-block `j`'s 6-bit scale and minimum from the 12 scale bytes of Q4_K / Q5_K.
#[inline(always)]
pub fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Packs 8 scales and minimums (each < 64) into the 12 scale bytes.
pub fn pack_scale_min(sc: &[u8; NSUB], m: &[u8; NSUB], s: &mut [u8]) {
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
}

/// Per sub-block of 32 of a Q4_K / Q5_K block: `(d·sc_j, dmin·m_j)` (both exact).
#[inline]
pub fn sub_scales(b: &[u8]) -> [(f32, f32); NSUB] {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let mut out = [(0.0, 0.0); NSUB];
    for (j, o) in out.iter_mut().enumerate() {
        let (sc, m) = scale_min(j, &b[4..16]);
        *o = (d * sc as f32, dmin * m as f32);
    }
    out
}

/// The 256 levels `q` of a Q4_K (0..=15) or Q5_K (0..=31) block, element order.
#[inline]
pub fn levels_q45(t: WType, b: &[u8]) -> [u8; QK_K] {
    if t == WType::Q5_K {
        levels_q45_of::<true>(b)
    } else {
        levels_q45_of::<false>(b)
    }
}

/// [`levels_q45`] with the type fixed, on fixed-size arrays: the loop over a sub-block's
/// 32 bytes vectorizes (loading a packed model decodes every block once).
fn levels_q45_of<const FIVE: bool>(b: &[u8]) -> [u8; QK_K] {
    let qs_at = if FIVE { 48 } else { 16 };
    let qs: &[u8; 128] = b[qs_at..qs_at + 128].try_into().expect("a Q4_K/Q5_K block");
    let qh: &[u8; 32] = if FIVE {
        b[16..48].try_into().expect("a Q5_K block")
    } else {
        &[0; 32]
    };
    let mut q = [0u8; QK_K];
    // Sub-blocks 2p and 2p + 1: the low and high nibbles of qs[32p..32p + 32], fifth
    // bits j = 2p, 2p + 1 of qh (fixed shifts and compares, which vectorize).
    for (p, (out, src)) in q
        .chunks_exact_mut(2 * QK)
        .zip(qs.chunks_exact(QK))
        .enumerate()
    {
        let (lo_bit, hi_bit) = (1u8 << (2 * p), 1u8 << (2 * p + 1));
        let (lo, hi) = out.split_at_mut(QK);
        for l in 0..QK {
            let (h0, h1) = if FIVE {
                (
                    u8::from(qh[l] & lo_bit != 0) << 4,
                    u8::from(qh[l] & hi_bit != 0) << 4,
                )
            } else {
                (0, 0)
            };
            lo[l] = (src[l] & 0x0f) | h0;
            hi[l] = (src[l] >> 4) | h1;
        }
    }
    q
}

/// Writes the 256 levels into a Q4_K / Q5_K block's `qs` (and `qh`).
pub(crate) fn pack_q45(t: WType, q: &[u8; QK_K], b: &mut [u8]) {
    let five = t == WType::Q5_K;
    let qs_at = if five { 48 } else { 16 };
    if five {
        b[16..48].fill(0);
    }
    for j in (0..NSUB).step_by(2) {
        for l in 0..QK {
            let (lo, hi) = (q[QK * j + l], q[QK * (j + 1) + l]);
            b[qs_at + 32 * (j / 2) + l] = (lo & 0x0f) | ((hi & 0x0f) << 4);
            if five {
                b[16 + l] |= ((lo >> 4) << j) | ((hi >> 4) << (j + 1));
            }
        }
    }
}

/// The 256 levels `q` (0..=63, before the −32 offset) of a Q6_K block.
#[inline]
pub fn levels_q6(b: &[u8]) -> [u8; QK_K] {
    let ql: &[u8; 128] = b[0..128].try_into().expect("a Q6_K block");
    let qh: &[u8; 64] = b[128..192].try_into().expect("a Q6_K block");
    let mut q = [0u8; QK_K];
    // Element e = 128·h + 32·k + l, in loops over l of 32 bytes that vectorize.
    for (hk, out) in q.chunks_exact_mut(32).enumerate() {
        let (h, k) = (hk / 4, hk % 4);
        let (lo_at, lo_shift) = (64 * h + 32 * (k % 2), 4 * (k / 2));
        for (l, o) in out.iter_mut().enumerate() {
            let lo = (ql[lo_at + l] >> lo_shift) & 0x0f;
            let hi = (qh[32 * h + l] >> (2 * k)) & 3;
            *o = lo | (hi << 4);
        }
    }
    q
}

pub(crate) fn pack_q6(q: &[u8; QK_K], b: &mut [u8]) {
    b[0..192].fill(0);
    for (e, &v) in q.iter().enumerate() {
        let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
        b[64 * h + 32 * (k % 2) + l] |= (v & 0x0f) << (4 * (k / 2));
        b[128 + 32 * h + l] |= ((v >> 4) & 3) << (2 * k);
    }
}

/// The super-scale `d` (f32 from f16) and the 16 int8 sub-block scales of a Q6_K block.
#[inline]
pub fn q6_scales(b: &[u8]) -> (f32, [i8; 16]) {
    let mut sc = [0i8; 16];
    for (o, &v) in sc.iter_mut().zip(&b[192..208]) {
        *o = v as i8;
    }
    (f16_at(b, 208), sc)
}

/// Dequantizes one super-block of `t` into `out` (256 values).
pub fn dequant_block(t: WType, b: &[u8], out: &mut [f32]) {
    match t {
        WType::Q4_K | WType::Q5_K => {
            let ss = sub_scales(b);
            let q = levels_q45(t, b);
            for (e, o) in out.iter_mut().enumerate() {
                let (dj, mj) = ss[e / QK];
                *o = dj * q[e] as f32 - mj;
            }
        }
        WType::Q6_K => {
            let (d, sc) = q6_scales(b);
            let q = levels_q6(b);
            for (e, o) in out.iter_mut().enumerate() {
                *o = (d * sc[e / 16] as f32) * (q[e] as i32 - 32) as f32;
            }
        }
        t => panic!("{t} is not a K type"),
    }
}

/// Codes for sub-block scales `s` (≥ 0) in `0..=63` under an f16 super-scale
/// ([`quantize_scales_unsigned`] with `nmax` 63).
fn quantize_scales_u6(s: &[f32; NSUB], wt: &[f32; NSUB]) -> (f32, [u8; NSUB]) {
    quantize_scales_unsigned(s, wt, 63)
}

/// Codes for sub-block scales `s` (≥ 0) in `0..=nmax` under an f16 super-scale: the
/// weighted least-squares fit over candidate mappings of the largest scale to
/// nmax + 0.5, nmax, …, nmax − 3 (then the f16 values next to each fit), smallest
/// `Σ W_j (s_j − d·c_j)²` first. Returns `(d, codes)`, `d` as its f16 value.
pub(super) fn quantize_scales_unsigned<const N: usize>(
    s: &[f32; N],
    wt: &[f32; N],
    nmax: u8,
) -> (f32, [u8; N]) {
    let smax = s.iter().fold(0.0f32, |a, &v| a.max(v));
    if smax <= 0.0 {
        return (0.0, [0; N]);
    }
    let top = nmax as f32;
    let codes = |d: f32| -> [u8; N] {
        let mut c = [0u8; N];
        if d > 0.0 {
            for (o, &v) in c.iter_mut().zip(s) {
                *o = (v / d).round().clamp(0.0, top) as u8;
            }
        }
        c
    };
    let starts = (0..8).map(|k| smax / (top + 0.5 - 0.5 * k as f32));
    fit_scale_codes(s, wt, starts, codes)
}

/// Int8 codes (−128..=127) for signed sub-block scales under an f16 super-scale
/// ([`quantize_scales_signed`] over the whole int8 range).
fn quantize_scales_i8(s: &[f32; 16], wt: &[f32; 16]) -> (f32, [i8; 16]) {
    quantize_scales_signed(s, wt, -128, 127)
}

/// Codes in `lo..=hi` for signed sub-block scales under an f16 super-scale: the scale of
/// largest magnitude mapped to lo, lo + 0.5, …, lo + 3.5 and to hi, hi − 0.5, …,
/// hi − 3.5, each followed by the weighted least-squares `d` for its codes and the f16
/// values next to it; smallest `Σ W_j (s_j − d·c_j)²` first. Returns `(d, codes)`.
pub(super) fn quantize_scales_signed<const N: usize>(
    s: &[f32; N],
    wt: &[f32; N],
    lo: i8,
    hi: i8,
) -> (f32, [i8; N]) {
    let (m, amax) = fit::signed_max(s);
    if amax == 0.0 {
        return (0.0, [0; N]);
    }
    let (flo, fhi) = (lo as f32, hi as f32);
    let codes = |d: f32| -> [i8; N] {
        let mut c = [0i8; N];
        if d != 0.0 {
            for (o, &v) in c.iter_mut().zip(s) {
                *o = (v / d).round().clamp(flo, fhi) as i8;
            }
        }
        c
    };
    let starts = [flo, fhi]
        .into_iter()
        .flat_map(|end| (0..8).map(move |k| m / (end - end.signum() * 0.5 * k as f32)));
    fit_scale_codes(s, wt, starts, codes)
}

/// The search both sub-block scale quantizers share: for each starting super-scale in
/// `starts` (in order), the codes `codes(start)`, the weighted least-squares
/// `d = Σ W c s / Σ W c²` for them (skipped when `Σ W c² ≤ 0`), then the f16 values
/// next to `d`, each with its own codes; the first with the smallest
/// `Σ W_j (s_j − d·c_j)²` wins. Returns `(d, codes)`; `d = 0` with all-zero codes
/// when no candidate has a finite error.
pub(super) fn fit_scale_codes<T: Copy + Default + Into<f32>, const N: usize>(
    s: &[f32; N],
    wt: &[f32; N],
    starts: impl IntoIterator<Item = f32>,
    codes: impl Fn(f32) -> [T; N],
) -> (f32, [T; N]) {
    let err = |d: f32, c: &[T; N]| -> f32 {
        (0..N)
            .map(|j| {
                let cj: f32 = c[j].into();
                let r = s[j] - d * cj;
                wt[j] * r * r
            })
            .sum()
    };
    let mut best = (f32::INFINITY, 0.0f32, [T::default(); N]);
    for start in starts {
        let c = codes(start);
        let (mut scs, mut scc) = (0.0f32, 0.0f32);
        for j in 0..N {
            let cj: f32 = c[j].into();
            scs += wt[j] * cj * s[j];
            scc += wt[j] * cj * cj;
        }
        if scc <= 0.0 {
            continue;
        }
        for d16 in fit::f16_neighbours(scs / scc) {
            let c = codes(d16);
            let e = err(d16, &c);
            if e < best.0 {
                best = (e, d16, c);
            }
        }
    }
    (best.1, best.2)
}

/// Quantizes one Q4_K / Q5_K super-block (256 values, weights `w`) into `b`.
/// `Err(v)` when a super-scale `v` does not fit in an f16.
fn quantize_q45(t: WType, x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    let nmax: u8 = if t == WType::Q5_K { 31 } else { 15 };
    let mut q = [0u8; QK_K];
    let (mut s, mut mu) = ([0f32; NSUB], [0f32; NSUB]);
    let (mut ws, mut wm) = ([0f32; NSUB], [0f32; NSUB]);
    for j in 0..NSUB {
        let (xj, wj) = (&x[QK * j..QK * (j + 1)], &w[QK * j..QK * (j + 1)]);
        let lj = &mut q[QK * j..QK * (j + 1)];
        let (d, mn) = fit::fit_affine(xj, wj, nmax, true, lj);
        s[j] = d.max(0.0);
        mu[j] = -mn;
        // First-order error of a scale change Δ is Δ²·Σ w l²; of a minimum change Σ w.
        ws[j] = (0..QK).map(|i| wj[i] * (lj[i] as f32).powi(2)).sum();
        wm[j] = wj.iter().sum();
    }
    for v in [s, mu].iter().flatten() {
        if !half::f16::from_f32(v / 63.0).to_f32().is_finite() {
            return Err(*v / 63.0);
        }
    }
    let (d, mut sc) = quantize_scales_u6(&s, &ws);
    let (dmin, mut m) = quantize_scales_u6(&mu, &wm);
    // Per sub-block: the codes next to the chosen ones, levels re-assigned, true error.
    let mut cand = [0u8; QK];
    for j in 0..NSUB {
        let (xj, wj) = (&x[QK * j..QK * (j + 1)], &w[QK * j..QK * (j + 1)]);
        let lj = &mut q[QK * j..QK * (j + 1)];
        let mut best = f32::INFINITY;
        let (c0, m0) = (sc[j] as i32, m[j] as i32);
        for c in (c0 - 1).max(0)..=(c0 + 1).min(63) {
            for mm in (m0 - 1).max(0)..=(m0 + 1).min(63) {
                let (dj, mj) = (d * c as f32, dmin * mm as f32);
                fit::assign_affine(xj, nmax, dj, -mj, &mut cand);
                let e = fit::err_affine(xj, wj, dj, -mj, &cand);
                if e < best {
                    best = e;
                    (sc[j], m[j]) = (c as u8, mm as u8);
                    lj.copy_from_slice(&cand);
                }
            }
        }
    }
    put_f16(b, 0, d);
    put_f16(b, 2, dmin);
    pack_scale_min(&sc, &m, &mut b[4..16]);
    pack_q45(t, &q, b);
    Ok(())
}

/// Quantizes one Q6_K super-block into `b`. `Err(v)` when the super-scale `v` does not
/// fit in an f16.
fn quantize_q6(x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    let lv = Levels::Uniform { lo: -32, hi: 31 };
    let mut q = [0u8; QK_K];
    let (mut s, mut ws) = ([0f32; 16], [0f32; 16]);
    for j in 0..16 {
        let (xj, wj) = (&x[16 * j..16 * (j + 1)], &w[16 * j..16 * (j + 1)]);
        let lj = &mut q[16 * j..16 * (j + 1)];
        s[j] = fit::fit_symmetric(xj, wj, &lv, lj);
        ws[j] = (0..16).map(|i| wj[i] * lv.value(lj[i]).powi(2)).sum();
    }
    let (_, amax) = fit::signed_max(&s);
    if !half::f16::from_f32(amax / 128.0).to_f32().is_finite() {
        return Err(amax / 128.0);
    }
    let (d, mut sc) = quantize_scales_i8(&s, &ws);
    let mut cand = [0u8; 16];
    for j in 0..16 {
        let (xj, wj) = (&x[16 * j..16 * (j + 1)], &w[16 * j..16 * (j + 1)]);
        let lj = &mut q[16 * j..16 * (j + 1)];
        let mut best = f32::INFINITY;
        let c0 = sc[j] as i32;
        for c in (c0 - 2).max(-128)..=(c0 + 2).min(127) {
            let dj = d * c as f32;
            fit::assign_symmetric(xj, &lv, dj, &mut cand);
            let e = fit::err_symmetric(xj, wj, &lv, dj, &cand);
            if e < best {
                best = e;
                sc[j] = c as i8;
                lj.copy_from_slice(&cand);
            }
        }
    }
    pack_q6(&q, b);
    for (o, &c) in b[192..208].iter_mut().zip(&sc) {
        *o = c as u8;
    }
    put_f16(b, 208, d);
    Ok(())
}

/// Quantizes one super-block of `t` (256 values, element weights `w`) into `b`
/// ([`WType::block_bytes`] bytes). `Err(v)` when a super-scale `v` does not fit in f16.
pub fn quantize_block(t: WType, x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    debug_assert_eq!(x.len(), QK_K);
    match t {
        WType::Q4_K | WType::Q5_K => quantize_q45(t, x, w, b),
        WType::Q6_K => quantize_q6(x, w, b),
        t => panic!("{t} is not a K type"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_packing_round_trips() {
        let sc = [1, 63, 17, 32, 48, 5, 60, 33];
        let m = [62, 0, 31, 16, 15, 47, 1, 63];
        let mut s = [0u8; 12];
        pack_scale_min(&sc, &m, &mut s);
        for j in 0..8 {
            assert_eq!(scale_min(j, &s), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn level_packing_round_trips() {
        let mut q = [0u8; QK_K];
        for t in [WType::Q4_K, WType::Q5_K] {
            let nmax = if t == WType::Q5_K { 32 } else { 16 };
            for (e, v) in q.iter_mut().enumerate() {
                *v = ((e * 7 + e / 13) % nmax) as u8;
            }
            let mut b = vec![0u8; t.block_bytes()];
            pack_q45(t, &q, &mut b);
            assert_eq!(levels_q45(t, &b), q, "{t}");
        }
        for (e, v) in q.iter_mut().enumerate() {
            *v = ((e * 11 + e / 5) % 64) as u8;
        }
        let mut b = vec![0u8; 210];
        pack_q6(&q, &mut b);
        assert_eq!(levels_q6(&b), q);
    }

    #[test]
    fn hand_made_q4_k_block() {
        // d = 0.5, dmin = 0.25; sub-block 5: sc = 0b10_0011 (35), m = 0b01_0100 (20):
        // low nibbles in byte 9, top bits in bytes 1 (sc) and 5 (m).
        let mut b = [0u8; 144];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        b[4 + 9] = 0x43; // sc low 3, m low 4
        b[4 + 1] = 0b10 << 6;
        b[4 + 5] = 0b01 << 6;
        // Element 3 of sub-block 5: high nibble of qs[32·2 + 3].
        b[16 + 64 + 3] = 0x90;
        let mut out = [0f32; 256];
        dequant_block(WType::Q4_K, &b, &mut out);
        assert_eq!(out[5 * 32 + 3], 0.5 * 35.0 * 9.0 - 0.25 * 20.0);
        assert_eq!(out[5 * 32 + 4], -0.25 * 20.0);
        assert_eq!(out[4 * 32 + 3], 0.0); // sub-block 4: low nibble 0, sc 0, m 0
    }

    #[test]
    fn hand_made_q6_k_block() {
        // Element 200: h = 1, k = 2, l = 8: low nibble = high nibble of ql[64 + 8],
        // top bits = bits 4-5 of qh[32 + 8]; scale = scales[12].
        let mut b = [0u8; 210];
        b[64 + 8] = 0xb0;
        b[128 + 32 + 8] = 0b10 << 4;
        b[192 + 12] = (-3i8) as u8;
        b[208..210].copy_from_slice(&half::f16::from_f32(0.125).to_bits().to_le_bytes());
        let mut out = [0f32; 256];
        dequant_block(WType::Q6_K, &b, &mut out);
        assert_eq!(out[200], (0.125 * -3.0) * (0x2b - 32) as f32);
        assert_eq!(out[199], (0.125 * -3.0) * -32.0);
    }
}
