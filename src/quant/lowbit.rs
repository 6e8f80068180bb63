//! GGUF's 256-weight types at and below 4 bits: Q2_K, Q3_K and IQ4_XS, byte for byte.
//!
//! ```text
//! block_q2_K   (84 bytes):  scales[16] | qs[64] | d f16 | dmin f16
//! block_q3_K   (110 bytes): hmask[32] | qs[64] | scales[12] | d f16
//! block_iq4_xs (136 bytes): d f16 | scales_h u16 | scales_l[4] | qs[128]
//! ```
//!
//! **Q2_K**: 16 sub-blocks of 16; sub-block `j` has a 4-bit scale `sc_j` (low nibble of
//! `scales[j]`) and minimum `m_j` (high nibble); `w = (d·sc_j)·q − dmin·m_j`, q in 0..=3.
//! Element `e` (with `n = e/128`, `k = (e%128)/32`, `l = e%32`) is bits `2k..2k+2` of
//! `qs[32n + l]`.
//!
//! **Q3_K**: 16 sub-blocks of 16 with 6-bit scales `sc_j` (stored `sc_j + 32`: the low 4
//! bits in the low nibble of `scales[j]` for `j < 8` and the high nibble of `scales[j−8]`
//! for `j ≥ 8`, the top 2 bits at bits `2·(j/4)` of `scales[8 + j%4]`);
//! `w = (d·sc_j)·q`, q in −4..=3: the low 2 bits of `q + 4` as Q2_K's `qs`, bit 2 is
//! bit `4n + k` of `hmask[l]` (set: q ≥ 0).
//!
//! **IQ4_XS**: 8 sub-blocks of 32 with 6-bit scales `ls_j` (low 4 bits: nibble `j % 2`
//! of `scales_l[j/2]`; top 2: bits `2j..2j+2` of the little-endian `scales_h`);
//! `w = (d·(ls_j − 32))·T[q]`, T IQ4_NL's 16 levels; element `l < 16` of sub-block `j`
//! is the low nibble of `qs[16j + l]`, element `l + 16` its high nibble.
//!
//! Dequantization is f32 with every operation rounded, no FMA, as gguf-py's numpy:
//! `(d·sc)·q − dmin·m` (Q2_K), `(d·sc)·q` (Q3_K), `(d·(ls − 32))·T[q]` (IQ4_XS); the
//! scale products are exact (an f16 times a 4- or 6-bit integer).
//!
//! The quantizers search as the K types of [`super::kquants`] do: each sub-block by the
//! weighted least-squares fits of [`super::fit`] (Q2_K affine with `min ≤ 0`, Q3_K and
//! IQ4_XS symmetric), then the super-block's f16 scales and the sub-block codes by a
//! weighted least-squares fit of the sub-block scales, then per sub-block the codes next
//! to the chosen ones with the levels re-assigned, keeping the smallest weighted error of
//! the stored block.
//!
//! Q2_K and Q3_K search further, since their few levels make every choice count:
//! - each sub-block's fit also tries the scales (and minimums) that put its two heaviest
//!   elements exactly on a level ([`heavy_symmetric`], [`heavy_affine`]): an outlier
//!   input channel (large importance, small weight) otherwise rounds to 0 on Q3_K;
//! - the super-scale `d` (Q2_K: `d`, then `dmin`) is searched over ±2, 4, 6% of the
//!   fitted one (Q3_K also the values putting the heaviest sub-block's scale exactly on
//!   a code), each with every sub-block's codes searched next to its fitted scale;
//! - then rounds of least squares for `d` (and `dmin`) with the chosen codes and
//!   levels, the codes searched again under its f16 value, while the error falls.
//!
//! Measured on SmolLM2-135M's down projections (the relative output error on held-out
//! text, against llama-quantize with the same calibration text): Q2_K 0.92× → 0.86×,
//! Q3_K 1.11× → 0.45×. It takes several times as long as the plain search: on those 30
//! matrices (2 shared cores) Q2_K about 20 s and Q3_K about 15 s, from 4-8 s.
//!
//! Q2_K's element weights lean on the large weights less than the other types'
//! (`(s² + x²)^¼` for `sqrt(s² + x²)`, [`fit::magnitude`]): on those matrices its
//! output error went 0.587% → 0.574% (exponent 0: 0.580%). What did not pay there: every
//! sub-block's `(sc, m)` searched over all 16 × 16 codes (each with its nearest levels,
//! exact for the weighted error) under the chosen `d`, `dmin`, then least squares for
//! them and the full search again, gave 0.578% at about 4× the time (±2 codes: 0.585%).

use super::blocks32::IQ4NL_VALUES;
use super::fit::{self, Levels};
use super::kquants::{f16_at, put_f16, quantize_scales_signed, quantize_scales_unsigned};
use crate::format::wtype::{WType, QK, QK_K};

/// Whether `t` is one of this module's types.
pub fn is_lowbit(t: WType) -> bool {
    matches!(t, WType::Q2_K | WType::Q3_K | WType::IQ4_XS)
}

/// Q3_K's levels −4..=3 (stored as `q + 4`).
const Q3_LEVELS: Levels = Levels::Uniform { lo: -4, hi: 3 };

/// Position of element `e` of a Q2_K / Q3_K super-block in its 2-bit planes: the byte
/// `32n + l` of `qs` (and of Q3_K's `hmask`, `l` only) and the pair `k`.
#[inline(always)]
fn crumb_at(e: usize) -> (usize, usize, usize) {
    (e / 128, (e % 128) / 32, e % 32)
}

/// The 256 low 2-bit fields of `qs` (64 bytes), element order.
#[inline]
fn crumbs(qs: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    // Element e = 128n + 32k + l: loops over l of 32 bytes that vectorize.
    for (nk, out) in q.chunks_exact_mut(32).enumerate() {
        let (n, k) = (nk / 4, nk % 4);
        for (l, o) in out.iter_mut().enumerate() {
            *o = (qs[32 * n + l] >> (2 * k)) & 3;
        }
    }
    q
}

fn pack_crumbs(q: &[u8; QK_K], qs: &mut [u8]) {
    qs[..64].fill(0);
    for (e, &v) in q.iter().enumerate() {
        let (n, k, l) = crumb_at(e);
        qs[32 * n + l] |= (v & 3) << (2 * k);
    }
}

/// The 256 levels `q` (0..=3) of a Q2_K block.
#[inline]
pub fn levels_q2(b: &[u8]) -> [u8; QK_K] {
    crumbs(&b[16..80])
}

/// `d`, `dmin` (f32 from f16) and the 16 sub-blocks' scale and minimum codes of a Q2_K
/// block.
#[inline]
pub fn q2_scales(b: &[u8]) -> (f32, f32, [u8; 16], [u8; 16]) {
    let (mut sc, mut m) = ([0u8; 16], [0u8; 16]);
    for j in 0..16 {
        (sc[j], m[j]) = (b[j] & 15, b[j] >> 4);
    }
    (f16_at(b, 80), f16_at(b, 82), sc, m)
}

/// The 256 levels of a Q3_K block as `q + 4` (0..=7).
#[inline]
pub fn levels_q3(b: &[u8]) -> [u8; QK_K] {
    let mut q = crumbs(&b[32..96]);
    let hm: &[u8; 32] = b[..32].try_into().expect("a Q3_K block");
    for (nk, out) in q.chunks_exact_mut(32).enumerate() {
        for (l, o) in out.iter_mut().enumerate() {
            *o |= ((hm[l] >> nk) & 1) << 2;
        }
    }
    q
}

/// The 6-bit code `sc + 32` of sub-block `j` from Q3_K's 12 scale bytes.
#[inline(always)]
pub fn q3_code(j: usize, s: &[u8]) -> u8 {
    let low = if j < 8 { s[j] & 15 } else { s[j - 8] >> 4 };
    low | ((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4
}

/// `d` (f32 from f16) and the 16 sub-block scales `sc` (−32..=31) of a Q3_K block.
#[inline]
pub fn q3_scales(b: &[u8]) -> (f32, [i8; 16]) {
    let mut sc = [0i8; 16];
    for (j, o) in sc.iter_mut().enumerate() {
        *o = q3_code(j, &b[96..108]) as i8 - 32;
    }
    (f16_at(b, 108), sc)
}

/// Writes 16 codes (0..=63) into Q3_K's 12 scale bytes.
pub(crate) fn pack_q3_codes(c: &[u8; 16], s: &mut [u8]) {
    s[..12].fill(0);
    for (j, &v) in c.iter().enumerate() {
        if j < 8 {
            s[j] |= v & 15;
        } else {
            s[j - 8] |= (v & 15) << 4;
        }
        s[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
    }
}

/// Writes Q3_K's `hmask` and `qs` from 256 levels `q + 4` (0..=7).
pub(crate) fn pack_q3_levels(q: &[u8; QK_K], b: &mut [u8]) {
    pack_crumbs(q, &mut b[32..96]);
    b[..32].fill(0);
    for (e, &v) in q.iter().enumerate() {
        let (n, k, l) = crumb_at(e);
        b[l] |= (v >> 2 & 1) << (4 * n + k);
    }
}

/// Writes Q2_K's `qs` from 256 levels (0..=3).
pub(crate) fn pack_q2_levels(q: &[u8; QK_K], b: &mut [u8]) {
    pack_crumbs(q, &mut b[16..80]);
}

/// The 6-bit code `ls` of sub-block `j` of an IQ4_XS block.
#[inline(always)]
pub fn iq4xs_code(j: usize, b: &[u8]) -> u8 {
    let h = u16::from_le_bytes([b[2], b[3]]);
    ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((h >> (2 * j)) & 3) as u8) << 4
}

/// `d` (f32 from f16) and the 8 sub-block scales `ls − 32` (−32..=31) of an IQ4_XS block.
#[inline]
pub fn iq4xs_scales(b: &[u8]) -> (f32, [i8; 8]) {
    let mut sc = [0i8; 8];
    for (j, o) in sc.iter_mut().enumerate() {
        *o = iq4xs_code(j, b) as i8 - 32;
    }
    (f16_at(b, 0), sc)
}

/// Writes 8 codes `ls` (0..=63) into an IQ4_XS block's `scales_h` and `scales_l`.
pub(crate) fn pack_iq4xs_codes(c: &[u8; 8], b: &mut [u8]) {
    let mut h = 0u16;
    b[4..8].fill(0);
    for (j, &v) in c.iter().enumerate() {
        b[4 + j / 2] |= (v & 15) << (4 * (j % 2));
        h |= ((v >> 4) as u16 & 3) << (2 * j);
    }
    b[2..4].copy_from_slice(&h.to_le_bytes());
}

/// The 256 table indices (nibbles) of an IQ4_XS block, element order.
#[inline]
pub fn levels_iq4xs(b: &[u8]) -> [u8; QK_K] {
    let qs: &[u8; 128] = b[8..136].try_into().expect("an IQ4_XS block");
    let mut q = [0u8; QK_K];
    for (out, src) in q.chunks_exact_mut(QK).zip(qs.chunks_exact(16)) {
        let (lo, hi) = out.split_at_mut(16);
        for l in 0..16 {
            lo[l] = src[l] & 15;
            hi[l] = src[l] >> 4;
        }
    }
    q
}

/// Writes an IQ4_XS block's `qs` from 256 nibbles.
pub(crate) fn pack_iq4xs_levels(q: &[u8; QK_K], b: &mut [u8]) {
    for (j, src) in q.chunks_exact(QK).enumerate() {
        for l in 0..16 {
            b[8 + 16 * j + l] = src[l] | (src[l + 16] << 4);
        }
    }
}

/// Dequantizes one super-block of `t` into `out` (256 values).
pub fn dequant_block(t: WType, b: &[u8], out: &mut [f32]) {
    match t {
        WType::Q2_K => {
            let (d, dmin, sc, m) = q2_scales(b);
            let q = levels_q2(b);
            for (e, o) in out.iter_mut().enumerate() {
                let j = e / 16;
                *o = (d * sc[j] as f32) * q[e] as f32 - dmin * m[j] as f32;
            }
        }
        WType::Q3_K => {
            let (d, sc) = q3_scales(b);
            let q = levels_q3(b);
            for (e, o) in out.iter_mut().enumerate() {
                *o = (d * sc[e / 16] as f32) * (q[e] as i32 - 4) as f32;
            }
        }
        WType::IQ4_XS => {
            let (d, sc) = iq4xs_scales(b);
            let q = levels_iq4xs(b);
            for (e, o) in out.iter_mut().enumerate() {
                *o = (d * sc[e / QK] as f32) * IQ4NL_VALUES[q[e] as usize] as f32;
            }
        }
        t => panic!("{t} is not a Q2_K, Q3_K or IQ4_XS type"),
    }
}

/// `Err` with the super-scale when the largest sub-block scale `smax` over `top` does not
/// fit in an f16.
fn check_f16(smax: f32, top: f32) -> Result<(), f32> {
    if half::f16::from_f32(smax / top).to_f32().is_finite() {
        Ok(())
    } else {
        Err(smax / top)
    }
}

/// IQ4_XS's symmetric K search (8 sub-blocks of 32, IQ4_NL's table; generic in the
/// sub-block count, Q3_K searches further in [`quantize_q3`]): sub-block scales by
/// [`fit::fit_symmetric`], signed 6-bit codes under an f16 `d` ([`quantize_scales_signed`]), then the codes ±2 next to
/// each with its levels re-assigned. Returns `d` and the codes (−32..=31); the levels
/// (indices of `lv`) in `q`.
fn quantize_symmetric<const N: usize>(
    x: &[f32],
    w: &[f32],
    lv: &Levels,
    q: &mut [u8; QK_K],
) -> Result<(f32, [i8; N]), f32> {
    let sub = QK_K / N;
    let (mut s, mut ws) = ([0f32; N], [0f32; N]);
    for j in 0..N {
        let (xj, wj) = (&x[sub * j..sub * (j + 1)], &w[sub * j..sub * (j + 1)]);
        let lj = &mut q[sub * j..sub * (j + 1)];
        s[j] = fit::fit_symmetric(xj, wj, lv, lj);
        ws[j] = (0..sub).map(|i| wj[i] * lv.value(lj[i]).powi(2)).sum();
    }
    let (_, amax) = fit::signed_max(&s);
    check_f16(amax, 32.0)?;
    let (d, mut sc) = quantize_scales_signed(&s, &ws, -32, 31);
    let mut cand = [0u8; QK];
    let cand = &mut cand[..sub];
    for j in 0..N {
        let (xj, wj) = (&x[sub * j..sub * (j + 1)], &w[sub * j..sub * (j + 1)]);
        let lj = &mut q[sub * j..sub * (j + 1)];
        let mut best = f32::INFINITY;
        let c0 = sc[j] as i32;
        for c in (c0 - 2).max(-32)..=(c0 + 2).min(31) {
            let dj = d * c as f32;
            fit::assign_symmetric(xj, lv, dj, cand);
            let e = fit::err_symmetric(xj, wj, lv, dj, cand);
            if e < best {
                best = e;
                sc[j] = c as i8;
                lj.copy_from_slice(cand);
            }
        }
    }
    Ok((d, sc))
}

/// Q2_K's sub-block `j` (16 values) under the super-scales `d`, `dmin`: the scale and
/// minimum codes within ±2 and ±1 of `c0`, `m0` (clamped to 0..=15) with the smallest
/// weighted error, their levels in `l`. Returns `(error, sc, m)`.
fn q2_sub(
    xj: &[f32],
    wj: &[f32],
    d: f32,
    dmin: f32,
    c0: i32,
    m0: i32,
    l: &mut [u8],
) -> (f32, u8, u8) {
    let mut cand = [0u8; 16];
    let mut best = (f32::INFINITY, 0u8, 0u8);
    for c in (c0 - 1).max(0)..=(c0 + 1).min(15) {
        for mm in (m0 - 1).max(0)..=(m0 + 1).min(15) {
            let (dj, mj) = (d * c as f32, dmin * mm as f32);
            fit::assign_affine(xj, 3, dj, -mj, &mut cand);
            let e = fit::err_affine(xj, wj, dj, -mj, &cand);
            if e < best.0 {
                best = (e, c as u8, mm as u8);
                l.copy_from_slice(&cand);
            }
        }
    }
    best
}

/// A Q2_K super-block's choice: weighted error, `d`, `dmin`, codes and levels.
#[derive(Clone, Copy)]
struct Q2Pick {
    err: f32,
    d: f32,
    dmin: f32,
    sc: [u8; 16],
    m: [u8; 16],
    q: [u8; QK_K],
}

/// Every sub-block's best codes ([`q2_sub`]) near its fitted scale `s_j` and minimum
/// `mu_j` under the f16 super-scales `d`, `dmin`; kept in `best` when its total error is
/// lower. Whether it was.
fn q2_try(
    x: &[f32],
    w: &[f32],
    s: &[f32; 16],
    mu: &[f32; 16],
    d: f32,
    dmin: f32,
    best: &mut Q2Pick,
) -> bool {
    let near = |v: f32, by: f32| {
        if by > 0.0 {
            (v / by).round().clamp(0.0, 15.0) as i32
        } else {
            0
        }
    };
    let mut p = Q2Pick {
        err: 0.0,
        d,
        dmin,
        sc: [0; 16],
        m: [0; 16],
        q: [0; QK_K],
    };
    for j in 0..16 {
        let r = 16 * j..16 * (j + 1);
        let (e, c, mm) = q2_sub(
            &x[r.clone()],
            &w[r.clone()],
            d,
            dmin,
            near(s[j], d),
            near(mu[j], dmin),
            &mut p.q[r],
        );
        p.err += e;
        (p.sc[j], p.m[j]) = (c, mm);
        if p.err >= best.err {
            return false;
        }
    }
    *best = p;
    true
}

/// The weighted least-squares `(d, dmin)` of a Q2_K block for fixed codes and levels:
/// `x ≈ d·(sc_j·q) − dmin·m_j`. `None` when singular.
fn q2_solve(x: &[f32], w: &[f32], p: &Q2Pick) -> Option<(f32, f32)> {
    let (mut aa, mut ab, mut bb, mut xa, mut xb) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for e in 0..QK_K {
        let (a, b) = (
            (p.sc[e / 16] as u32 * p.q[e] as u32) as f64,
            -(p.m[e / 16] as f64),
        );
        let (wi, xi) = (w[e] as f64, x[e] as f64);
        aa += wi * a * a;
        ab += wi * a * b;
        bb += wi * b * b;
        xa += wi * xi * a;
        xb += wi * xi * b;
    }
    let det = aa * bb - ab * ab;
    if det.is_nan() || det <= 0.0 {
        return None;
    }
    let d = (xa * bb - xb * ab) / det;
    let dmin = (aa * xb - ab * xa) / det;
    (d > 0.0 && dmin >= 0.0).then_some((d as f32, dmin as f32))
}

/// The f16 value of `v` as f32 (infinite when it overflows).
fn f16r(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// Steps of the super-scale search: `d` times `1 + STEP·k` for `k` in `−K..=K`.
const SUPER_STEPS: i32 = 3;
const SUPER_STEP: f32 = 0.02;
/// Rounds of least squares for the super-scales after the codes are chosen.
const LS_ROUNDS: usize = 3;

/// The two heaviest elements of a sub-block (the first of equal weights first).
fn heaviest_two(w: &[f32]) -> [usize; 2] {
    let (mut h1, mut h2) = (0, 1);
    if w[1] > w[0] {
        (h1, h2) = (1, 0);
    }
    for (i, &v) in w.iter().enumerate().skip(2) {
        if v > w[h1] {
            (h1, h2) = (i, h1);
        } else if v > w[h2] {
            h2 = i;
        }
    }
    [h1, h2]
}

/// Heavy elements first, for Q3_K's sub-blocks: one whose weights single out a small
/// element (an outlier input channel: large importance, small weight) loses it to level
/// 0 under the scales the largest element suggests, and that element can carry most of
/// the matrix's output error (SmolLM2-135M's down projections). So the scales putting
/// each of the two heaviest elements exactly on a non-zero level are tried too, each
/// with the levels re-assigned and their least-squares scale; the lowest weighted error
/// wins. Returns the scale (`d` when nothing beats it), its levels in `l`.
fn heavy_symmetric(x: &[f32], w: &[f32], d: f32, l: &mut [u8]) -> f32 {
    let lv = &Q3_LEVELS;
    let mut best = (fit::err_symmetric(x, w, lv, d, l), d);
    let mut cand = [0u8; 16];
    for i in heaviest_two(w).into_iter().filter(|&i| x[i] != 0.0) {
        for k in (0..lv.len() as u8).filter(|&k| lv.value(k) != 0.0) {
            fit::assign_symmetric(x, lv, x[i] / lv.value(k), &mut cand);
            if let Some((dd, e)) = fit::solve_symmetric(x, w, lv, &cand) {
                if e < best.0 {
                    best = (e, dd);
                    l.copy_from_slice(&cand);
                }
            }
        }
    }
    best.1
}

/// [`heavy_symmetric`] for Q2_K's affine sub-blocks: the `(d, mn)` that put the two
/// heaviest elements exactly on levels (each alone under the fitted `d`, and both at
/// once), each with the levels re-assigned and their least-squares `(d, mn ≤ 0)`; the
/// lowest weighted error wins.
fn heavy_affine(x: &[f32], w: &[f32], d: f32, mn: f32, l: &mut [u8]) -> (f32, f32) {
    let mut best = (fit::err_affine(x, w, d, mn, l), (d, mn));
    let mut cand = [0u8; 16];
    let [h1, h2] = heaviest_two(w);
    let alone = [h1, h2]
        .into_iter()
        .flat_map(|i| (0..4).map(move |k| (d, x[i] - d * k as f32)));
    let both = (0..4i32)
        .flat_map(|k1| (0..4i32).map(move |k2| (k1, k2)))
        .filter(|&(k1, k2)| k1 != k2)
        .map(|(k1, k2)| {
            let dd = (x[h1] - x[h2]) / (k1 - k2) as f32;
            (dd, x[h1] - dd * k1 as f32)
        });
    for (d, mn) in alone.chain(both) {
        if !(d > 0.0 && mn <= 0.0) {
            continue;
        }
        fit::assign_affine(x, 3, d, mn, &mut cand);
        let Some((dd, m)) = fit::solve_affine(x, w, &cand, true) else {
            continue;
        };
        let e = fit::err_affine(x, w, dd, m, &cand);
        if dd > 0.0 && e < best.0 {
            best = (e, (dd, m));
            l.copy_from_slice(&cand);
        }
    }
    best.1
}

/// Quantizes one Q2_K super-block (256 values, weights `w`) into `b`.
fn quantize_q2(x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    const SUB: usize = 16;
    let mut q = [0u8; QK_K];
    let (mut s, mut mu) = ([0f32; 16], [0f32; 16]);
    let (mut ws, mut wm) = ([0f32; 16], [0f32; 16]);
    for j in 0..16 {
        let (xj, wj) = (&x[SUB * j..SUB * (j + 1)], &w[SUB * j..SUB * (j + 1)]);
        let lj = &mut q[SUB * j..SUB * (j + 1)];
        let (d, mn) = fit::fit_affine(xj, wj, 3, true, lj);
        let (d, mn) = heavy_affine(xj, wj, d, mn, lj);
        s[j] = d.max(0.0);
        mu[j] = -mn;
        // First-order error of a scale change Δ is Δ²·Σ w l²; of a minimum change Σ w.
        ws[j] = (0..SUB).map(|i| wj[i] * (lj[i] as f32).powi(2)).sum();
        wm[j] = wj.iter().sum();
    }
    for v in [s, mu].iter().flatten() {
        check_f16(*v, 15.0)?;
    }
    let (d0, _) = quantize_scales_unsigned(&s, &ws, 15);
    let (dmin0, _) = quantize_scales_unsigned(&mu, &wm, 15);
    let mut best = Q2Pick {
        err: f32::INFINITY,
        d: d0,
        dmin: dmin0,
        sc: [0; 16],
        m: [0; 16],
        q: [0; QK_K],
    };
    q2_try(x, w, &s, &mu, d0, dmin0, &mut best);
    if d0 > 0.0 {
        // A finer super-scale: the sub-block scales' fit weighs them by a first-order
        // error; the codes' own error decides here.
        for k in (-SUPER_STEPS..=SUPER_STEPS).filter(|&k| k != 0) {
            let d = f16r(d0 * (1.0 + SUPER_STEP * k as f32));
            if d.is_finite() {
                q2_try(x, w, &s, &mu, d, best.dmin, &mut best);
            }
        }
        if dmin0 > 0.0 {
            for k in (-SUPER_STEPS..=SUPER_STEPS).filter(|&k| k != 0) {
                let dmin = f16r(dmin0 * (1.0 + SUPER_STEP * k as f32));
                if dmin.is_finite() {
                    q2_try(x, w, &s, &mu, best.d, dmin, &mut best);
                }
            }
        }
        // Least squares for (d, dmin) with the chosen codes and levels, then the codes
        // again, while the error falls.
        for _ in 0..LS_ROUNDS {
            let Some((d, dmin)) = q2_solve(x, w, &best) else {
                break;
            };
            let (d, dmin) = (f16r(d), f16r(dmin));
            if !(d.is_finite() && dmin.is_finite() && q2_try(x, w, &s, &mu, d, dmin, &mut best)) {
                break;
            }
        }
    }
    for (j, o) in b[..16].iter_mut().enumerate() {
        *o = best.sc[j] | (best.m[j] << 4);
    }
    pack_q2_levels(&best.q, b);
    put_f16(b, 80, best.d);
    put_f16(b, 82, best.dmin);
    Ok(())
}

/// Q3_K's sub-block under the super-scale `d`: the code within ±2 of `c0` (clamped to
/// −32..=31) with the smallest weighted error, its levels in `l`. Returns `(error, code)`.
fn q3_sub(xj: &[f32], wj: &[f32], d: f32, c0: i32, l: &mut [u8]) -> (f32, i8) {
    let mut cand = [0u8; 16];
    let mut best = (f32::INFINITY, 0i8);
    for c in (c0 - 2).max(-32)..=(c0 + 2).min(31) {
        let dj = d * c as f32;
        fit::assign_symmetric(xj, &Q3_LEVELS, dj, &mut cand);
        let e = fit::err_symmetric(xj, wj, &Q3_LEVELS, dj, &cand);
        if e < best.0 {
            best = (e, c as i8);
            l.copy_from_slice(&cand);
        }
    }
    best
}

/// A Q3_K super-block's choice: weighted error, `d`, codes and levels (`q + 4`).
#[derive(Clone, Copy)]
struct Q3Pick {
    err: f32,
    d: f32,
    sc: [i8; 16],
    q: [u8; QK_K],
}

/// Every sub-block's best code ([`q3_sub`]) near its fitted scale `s_j` under the f16
/// super-scale `d`; kept in `best` when its total error is lower. Whether it was.
fn q3_try(x: &[f32], w: &[f32], s: &[f32; 16], d: f32, best: &mut Q3Pick) -> bool {
    let mut p = Q3Pick {
        err: 0.0,
        d,
        sc: [0; 16],
        q: [0; QK_K],
    };
    for (j, &sj) in s.iter().enumerate() {
        let r = 16 * j..16 * (j + 1);
        let c0 = if d != 0.0 {
            (sj / d).round().clamp(-32.0, 31.0) as i32
        } else {
            0
        };
        let (e, c) = q3_sub(&x[r.clone()], &w[r.clone()], d, c0, &mut p.q[r]);
        p.err += e;
        p.sc[j] = c;
        if p.err >= best.err {
            return false;
        }
    }
    *best = p;
    true
}

/// The weighted least-squares `d` of a Q3_K block for fixed codes and levels.
fn q3_solve(x: &[f32], w: &[f32], p: &Q3Pick) -> Option<f32> {
    let (mut aa, mut xa) = (0f64, 0f64);
    for e in 0..QK_K {
        let a = (p.sc[e / 16] as i32 * (p.q[e] as i32 - 4)) as f64;
        aa += w[e] as f64 * a * a;
        xa += w[e] as f64 * x[e] as f64 * a;
    }
    (aa > 0.0).then(|| (xa / aa) as f32)
}

/// Quantizes one Q3_K super-block into `b`.
fn quantize_q3(x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    let (mut s, mut ws) = ([0f32; 16], [0f32; 16]);
    let mut q = [0u8; QK_K];
    for j in 0..16 {
        let (xj, wj) = (&x[16 * j..16 * (j + 1)], &w[16 * j..16 * (j + 1)]);
        let lj = &mut q[16 * j..16 * (j + 1)];
        s[j] = fit::fit_symmetric(xj, wj, &Q3_LEVELS, lj);
        s[j] = heavy_symmetric(xj, wj, s[j], lj);
        ws[j] = (0..16)
            .map(|i| wj[i] * Q3_LEVELS.value(lj[i]).powi(2))
            .sum();
    }
    let (_, amax) = fit::signed_max(&s);
    check_f16(amax, 32.0)?;
    let (d0, _) = quantize_scales_signed(&s, &ws, -32, 31);
    let mut best = Q3Pick {
        err: f32::INFINITY,
        d: d0,
        sc: [0; 16],
        q: [0; QK_K],
    };
    q3_try(x, w, &s, d0, &mut best);
    if d0 != 0.0 {
        // The heaviest sub-block's scale on a code exactly: what an outlier channel
        // needs when its sub-block's code is small.
        let jh = (0..16).fold(0, |a, j| if ws[j] > ws[a] { j } else { a });
        let ch = (s[jh] / d0).round() as i32;
        for c in (ch - 2..=ch + 2).filter(|&c| c != 0 && c != ch && (-32..=31).contains(&c)) {
            let d = f16r(s[jh] / c as f32);
            if d.is_finite() && (s[jh] / d).round() as i32 == c {
                q3_try(x, w, &s, d, &mut best);
            }
        }
        for k in (-SUPER_STEPS..=SUPER_STEPS).filter(|&k| k != 0) {
            let d = f16r(d0 * (1.0 + SUPER_STEP * k as f32));
            if d.is_finite() {
                q3_try(x, w, &s, d, &mut best);
            }
        }
        for _ in 0..LS_ROUNDS {
            let Some(d) = q3_solve(x, w, &best).map(f16r) else {
                break;
            };
            if !d.is_finite() || !q3_try(x, w, &s, d, &mut best) {
                break;
            }
        }
    }
    pack_q3_levels(&best.q, b);
    pack_q3_codes(&best.sc.map(|c| (c + 32) as u8), &mut b[96..108]);
    put_f16(b, 108, best.d);
    Ok(())
}

/// Quantizes one IQ4_XS super-block into `b`.
fn quantize_iq4xs(x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    let mut q = [0u8; QK_K];
    let (d, sc) = quantize_symmetric::<8>(x, w, &Levels::Table(&IQ4NL_VALUES), &mut q)?;
    put_f16(b, 0, d);
    pack_iq4xs_codes(&sc.map(|c| (c + 32) as u8), b);
    pack_iq4xs_levels(&q, b);
    Ok(())
}

/// Quantizes one super-block of `t` (256 values, element weights `w`) into `b`
/// ([`WType::block_bytes`] bytes). `Err(v)` when a super-scale `v` does not fit in f16.
pub fn quantize_block(t: WType, x: &[f32], w: &[f32], b: &mut [u8]) -> Result<(), f32> {
    debug_assert_eq!(x.len(), QK_K);
    match t {
        WType::Q2_K => quantize_q2(x, w, b),
        WType::Q3_K => quantize_q3(x, w, b),
        WType::IQ4_XS => quantize_iq4xs(x, w, b),
        t => panic!("{t} is not a Q2_K, Q3_K or IQ4_XS type"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_and_code_packing_round_trips() {
        let mut q = [0u8; QK_K];
        for (e, v) in q.iter_mut().enumerate() {
            *v = ((e * 7 + e / 13) % 8) as u8;
        }
        let mut b = [0u8; 110];
        pack_q3_levels(&q, &mut b);
        assert_eq!(levels_q3(&b), q);
        let c: [u8; 16] = std::array::from_fn(|j| (j * 11 % 64) as u8);
        pack_q3_codes(&c, &mut b[96..108]);
        for (j, &cj) in c.iter().enumerate() {
            assert_eq!(q3_code(j, &b[96..108]), cj, "sub-block {j}");
        }
        let q2 = q.map(|v| v & 3);
        let mut b = [0u8; 84];
        pack_q2_levels(&q2, &mut b);
        assert_eq!(levels_q2(&b), q2);
        let q4 = q.map(|v| (v * 2 + 1) & 15);
        let mut b = [0u8; 136];
        pack_iq4xs_levels(&q4, &mut b);
        assert_eq!(levels_iq4xs(&b), q4);
        let c: [u8; 8] = std::array::from_fn(|j| (j * 23 % 64) as u8);
        pack_iq4xs_codes(&c, &mut b);
        for (j, &cj) in c.iter().enumerate() {
            assert_eq!(iq4xs_code(j, &b), cj, "sub-block {j}");
        }
    }

    fn h(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn hand_made_blocks() {
        // Q2_K: d = 0.5, dmin = 0.25; sub-block 9 (elements 144..160): sc 3, m 2.
        // Element 150: n = 1, k = 0, l = 22: bits 0-1 of qs[32 + 22].
        let mut b = [0u8; 84];
        b[9] = 0x23;
        b[16 + 32 + 22] = 0b10;
        b[80..82].copy_from_slice(&h(0.5));
        b[82..84].copy_from_slice(&h(0.25));
        let mut out = [0f32; 256];
        dequant_block(WType::Q2_K, &b, &mut out);
        assert_eq!(out[150], 1.5 * 2.0 - 0.5);
        assert_eq!(out[151], -0.5);
        // Q3_K: element 200 (n = 1, k = 2, l = 8): low bits at bits 4-5 of qs[32 + 8],
        // bit 2 at bit 6 of hmask[8]; sub-block 12: code low 4 bits in the high nibble of
        // scales[4], top 2 bits at bits 6-7 of scales[8].
        let mut b = [0u8; 110];
        b[32 + 32 + 8] = 0b01 << 4;
        b[8] = 1 << 6; // q = 1 + 4 − 4 = 1
        b[96 + 4] = 0x50; // code low nibble 5
        b[96 + 8] = 0b10 << 6; // code = 0b10_0101 = 37 → sc 5
        b[108..110].copy_from_slice(&h(0.125));
        dequant_block(WType::Q3_K, &b, &mut out);
        assert_eq!(out[200], 0.125 * 5.0 * 1.0);
        // Element 201 (l = 9): levels 0, hmask bit clear → q = −4.
        assert_eq!(out[201], 0.125 * 5.0 * -4.0);
        // IQ4_XS: sub-block 3 code 0b01_0010 = 18 (ls − 32 = −14): low nibble in the high
        // nibble of scales_l[1], top bits at bits 6-7 of scales_h; element 3·32 + 17:
        // high nibble of qs[48 + 1].
        let mut b = [0u8; 136];
        b[0..2].copy_from_slice(&h(0.25));
        b[2..4].copy_from_slice(&(0b01u16 << 6).to_le_bytes());
        b[5] = 0x20;
        b[8 + 48 + 1] = 0xf0;
        dequant_block(WType::IQ4_XS, &b, &mut out);
        assert_eq!(out[3 * 32 + 17], (0.25 * -14.0) * 113.0);
        assert_eq!(out[3 * 32 + 1], (0.25 * -14.0) * -127.0);
    }
}
