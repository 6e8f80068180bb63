//! Row-major tile kernels of the GGUF block types (Q4_K, Q5_K, Q6_K, Q4_1, Q5_0, Q5_1,
//! IQ4_NL, Q6_0, MXFP4, Q2_K, Q3_K, IQ4_XS) on AVX2 + FMA + F16C, bit-identical to
//! `scalar::blocks`. Every x86 tier
//! uses them for matrices it reads from the map (`--no-pack`); packed matrices go through
//! `x86::packed_blocks`.
//!
//! A row is walked 8 blocks of 32 at a time (a K super-block, or 8 32-weight blocks),
//! which are the contract's 8 lanes. Each block's levels are decoded once per row into a
//! ymm of 32 u8 in element order (nibbles, plus the fifth bit or the top two bits), and
//! for every token `vpmaddubsw` (u8 levels × s8 activations, pair sums ≤ 2·63·127, no
//! saturation) and `vpmaddwd` give 8 exact i32 partials per block, reduced to one
//! `isum` per block (`vphaddd`, as the AVX2 Q8_0 kernel). IQ4_NL uses the sign trick of
//! Q8_0 (`|T|` × `x` with `T`'s sign; `|T| ≤ 127`). Q6_K's `vpmaddwd` multiplies the
//! pair sums by the half-blocks' int8 scales instead of 1 (low 128 bits: the first 16
//! weights, high: the last 16), which is `sc_lo·Σ_lo q·x + sc_hi·Σ_hi q·x` exactly.
//! Then the contract's offsets (`16·s_b`, `32·s_b`; Q6_K: `32·(sc_lo·h_b + sc_hi·(s_b −
//! h_b))`) and the float step on the 8 lanes: `acc = fma(dw·dx, isum, acc)` [then
//! `acc = fma(mw, dx·s, acc)`]. MXFP4 and IQ4_XS are IQ4_NL with their own table and
//! scales. Q3_K and Q2_K (a scale per 16 weights) keep each block's two halves apart:
//! `vpmaddwd` by 1 leaves the first 16 weights' partials in the low 128 bits and the last
//! 16's in the high ones, reduced to one `Σ_lo` and one `Σ_hi` per block, then the
//! halves' step of the contract.

use core::arch::x86_64::*;

use super::simd::{bit_mask, hsum8, hsum8_halves, load_scales, reduce_lanes};
use super::tiles::block_rows_of_tile;
use crate::format::wtype::QK;
use crate::kernels::acts::ActTile;
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::blocks::{BlockTy, ScaleKind};
use crate::kernels::scalar::tiles::LANES;
use crate::kernels::tier::Tier;
use crate::quant::{kquants, lowbit, mxfp4};

/// The 16 bytes of a type's table in both 128-bit lanes; `abs`: the magnitudes.
#[target_feature(enable = "avx2")]
#[inline]
fn table16(tab: &[i8; 16], abs: bool) -> __m256i {
    let mut t = [0i8; 16];
    for (o, &v) in t.iter_mut().zip(tab) {
        *o = if abs { v.abs() } else { v };
    }
    // SAFETY: `t` holds the 16 bytes read.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(t.as_ptr() as *const __m128i) })
}

/// Eight blocks of one row, decoded for the tokens.
struct Group {
    /// Levels (u8; IQ4_NL: `|T|`), one block per ymm, element order.
    w: [__m256i; LANES],
    /// IQ4_NL: the signed levels `T` (for `vpsignb`); Q6_K: per block the i16 scale
    /// vector (`sc_lo` ×8, `sc_hi` ×8) for `vpmaddwd`.
    aux: [__m256i; LANES],
    dw: __m256,
    mw: __m256,
    /// Q6_K: the 8 blocks' half scales as i32 lanes.
    sc_lo: __m256i,
    sc_hi: __m256i,
    /// Q3_K, Q2_K: the halves' `d·sc` and (Q2_K) `−dmin·m`.
    dl: __m256,
    dh: __m256,
    ml: __m256,
    mh: __m256,
}

/// f16 bits of 8 blocks (zero where missing) as f32 lanes.
#[target_feature(enable = "f16c")]
#[inline]
fn f16x8(v: &[u16; LANES]) -> __m256 {
    // SAFETY: `v` holds the 16 bytes read.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(v.as_ptr() as *const __m128i) })
}

/// The u16 at byte `at` of the block at `p`.
///
/// # Safety
/// 2 readable bytes at `p + at`.
#[inline(always)]
unsafe fn u16_at(p: *const u8, at: usize) -> u16 {
    // SAFETY: the function's contract.
    unsafe { (p.add(at) as *const u16).read_unaligned() }
}

/// Bit 4 of every byte from the u32 `qh`, bit `e` for element `e` (Q5_0, Q5_1).
#[target_feature(enable = "avx2")]
#[inline]
fn bits5(qh: u32) -> __m256i {
    _mm256_and_si256(bit_mask(qh), _mm256_set1_epi8(0x10))
}

/// Bits 4–5 of every byte from Q6_0's `qh[8]` (element `j < 16`: bits `4·(j/8)..` of
/// `qh[j % 8]`; element `j + 16`: the two bits above).
#[target_feature(enable = "avx2")]
#[inline]
fn bits6(qh: u64) -> __m256i {
    let v = _mm256_set1_epi64x(qh as i64);
    let idx = _mm256_set1_epi64x(0x0706_0504_0302_0100);
    let g = _mm256_shuffle_epi8(v, idx);
    let t = _mm256_srlv_epi64(g, _mm256_setr_epi64x(0, 4, 2, 6));
    _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi8(3)), 4)
}

/// The 32 nibbles of a 32-weight block's `qs[16]` in element order.
#[inline(always)]
unsafe fn nibbles32(qs: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes at `qs` (the caller's block).
    unsafe {
        let v = _mm_loadu_si128(qs as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m))
    }
}

/// Decodes blocks `b0..b0 + k` of the row at `wq` (`k ≤ 8`; 8 and one super-block for
/// the K types).
#[inline(always)]
unsafe fn decode<B: BlockTy>(wq: *const u8, b0: usize, k: usize) -> Group {
    // SAFETY: the blocks exist in the row (the caller's contract); AVX2 and F16C.
    unsafe {
        let zero = _mm256_setzero_si256();
        let mut g = Group {
            w: [zero; LANES],
            aux: [zero; LANES],
            dw: _mm256_setzero_ps(),
            mw: _mm256_setzero_ps(),
            sc_lo: zero,
            sc_hi: zero,
            dl: _mm256_setzero_ps(),
            dh: _mm256_setzero_ps(),
            ml: _mm256_setzero_ps(),
            mh: _mm256_setzero_ps(),
        };
        let m4 = _mm256_set1_epi8(0x0F);
        match B::SC {
            ScaleKind::K45 => {
                let blk = wq.add(b0 / LANES * B::W.block_bytes());
                let qs = blk.add(if B::BITS == 5 { 48 } else { 16 });
                for p in 0..4 {
                    let v = _mm256_loadu_si256(qs.add(32 * p) as *const __m256i);
                    g.w[2 * p] = _mm256_and_si256(v, m4);
                    g.w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                if B::BITS == 5 {
                    let qh = _mm256_loadu_si256(blk.add(16) as *const __m256i);
                    let b4 = _mm256_set1_epi8(0x10);
                    let hb = [
                        _mm256_slli_epi16(qh, 4),
                        _mm256_slli_epi16(qh, 3),
                        _mm256_slli_epi16(qh, 2),
                        _mm256_slli_epi16(qh, 1),
                        qh,
                        _mm256_srli_epi16(qh, 1),
                        _mm256_srli_epi16(qh, 2),
                        _mm256_srli_epi16(qh, 3),
                    ];
                    for (w, h) in g.w.iter_mut().zip(hb) {
                        *w = _mm256_or_si256(*w, _mm256_and_si256(h, b4));
                    }
                }
                let s = std::slice::from_raw_parts(blk.add(4), 12);
                let (mut sc, mut mn) = ([0f32; LANES], [0f32; LANES]);
                for j in 0..LANES {
                    let (a, b) = kquants::scale_min(j, s);
                    (sc[j], mn[j]) = (a as f32, b as f32);
                }
                let d = f16x8(&[u16_at(blk, 0); LANES]);
                let dmin = f16x8(&[u16_at(blk, 2); LANES]);
                g.dw = _mm256_mul_ps(d, _mm256_loadu_ps(sc.as_ptr()));
                let sign = _mm256_set1_ps(-0.0);
                g.mw = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_loadu_ps(mn.as_ptr())), sign);
            }
            ScaleKind::K6 => {
                let blk = wq.add(b0 / LANES * B::W.block_bytes());
                let m6 = _mm256_set1_epi8(0x30);
                for h in 0..2 {
                    let ql0 = _mm256_loadu_si256(blk.add(64 * h) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(blk.add(64 * h + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
                    let hi = [
                        _mm256_slli_epi16(qh, 4),
                        _mm256_slli_epi16(qh, 2),
                        qh,
                        _mm256_srli_epi16(qh, 2),
                    ];
                    let lo = [
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    ];
                    for k4 in 0..4 {
                        g.w[4 * h + k4] = _mm256_or_si256(lo[k4], _mm256_and_si256(hi[k4], m6));
                    }
                }
                let sc = std::slice::from_raw_parts(blk.add(192) as *const i8, 16);
                let (mut lo, mut hi) = ([0i32; LANES], [0i32; LANES]);
                for j in 0..LANES {
                    (lo[j], hi[j]) = (sc[2 * j] as i32, sc[2 * j + 1] as i32);
                    g.aux[j] = _mm256_set_m128i(
                        _mm_set1_epi16(sc[2 * j + 1] as i16),
                        _mm_set1_epi16(sc[2 * j] as i16),
                    );
                }
                g.sc_lo = _mm256_loadu_si256(lo.as_ptr() as *const __m256i);
                g.sc_hi = _mm256_loadu_si256(hi.as_ptr() as *const __m256i);
                g.dw = f16x8(&[u16_at(blk, 208); LANES]);
            }
            ScaleKind::E8M0 => {
                let mut dw = [0f32; LANES];
                let (tab_abs, tab) = (table16(B::TAB, true), table16(B::TAB, false));
                for (j, dj) in dw.iter_mut().enumerate().take(k) {
                    let blk = wq.add((b0 + j) * B::W.block_bytes());
                    *dj = mxfp4::e8m0_half(*blk);
                    let n = nibbles32(blk.add(1));
                    g.aux[j] = _mm256_shuffle_epi8(tab, n);
                    g.w[j] = _mm256_shuffle_epi8(tab_abs, n);
                }
                g.dw = _mm256_loadu_ps(dw.as_ptr());
            }
            ScaleKind::KXs => {
                let blk = wq.add(b0 / LANES * B::W.block_bytes());
                let (d, sc) = lowbit::iq4xs_scales(std::slice::from_raw_parts(blk, 136));
                let (tab_abs, tab) = (table16(B::TAB, true), table16(B::TAB, false));
                let mut dw = [0f32; LANES];
                for j in 0..LANES {
                    dw[j] = d * sc[j] as f32;
                    let n = nibbles32(blk.add(8 + 16 * j));
                    g.aux[j] = _mm256_shuffle_epi8(tab, n);
                    g.w[j] = _mm256_shuffle_epi8(tab_abs, n);
                }
                g.dw = _mm256_loadu_ps(dw.as_ptr());
            }
            ScaleKind::K3 | ScaleKind::K2 => {
                let k3 = B::SC == ScaleKind::K3;
                let bb = B::W.block_bytes();
                let blk = wq.add(b0 / LANES * bb);
                let b = std::slice::from_raw_parts(blk, bb);
                // Block 4n + k: the 2-bit fields 2k..2k+2 of qs[32n..32n + 32].
                let qs = blk.add(if k3 { 32 } else { 16 });
                let m2 = _mm256_set1_epi8(3);
                for n in 0..2 {
                    let v = _mm256_loadu_si256(qs.add(32 * n) as *const __m256i);
                    g.w[4 * n] = _mm256_and_si256(v, m2);
                    g.w[4 * n + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m2);
                    g.w[4 * n + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m2);
                    g.w[4 * n + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m2);
                }
                let (mut dl, mut dh, mut ml, mut mh) =
                    ([0f32; LANES], [0f32; 8], [0f32; 8], [0f32; 8]);
                if k3 {
                    // Bit 2 of block j's levels: bit j of hmask[l].
                    let hm = _mm256_loadu_si256(blk as *const __m256i);
                    let hb = [
                        _mm256_slli_epi16(hm, 2),
                        _mm256_slli_epi16(hm, 1),
                        hm,
                        _mm256_srli_epi16(hm, 1),
                        _mm256_srli_epi16(hm, 2),
                        _mm256_srli_epi16(hm, 3),
                        _mm256_srli_epi16(hm, 4),
                        _mm256_srli_epi16(hm, 5),
                    ];
                    let b2 = _mm256_set1_epi8(4);
                    for (w, h) in g.w.iter_mut().zip(hb) {
                        *w = _mm256_or_si256(*w, _mm256_and_si256(h, b2));
                    }
                    let (d, sc) = lowbit::q3_scales(b);
                    for j in 0..LANES {
                        (dl[j], dh[j]) = (d * sc[2 * j] as f32, d * sc[2 * j + 1] as f32);
                    }
                } else {
                    let (d, dmin, sc, m) = lowbit::q2_scales(b);
                    for j in 0..LANES {
                        (dl[j], dh[j]) = (d * sc[2 * j] as f32, d * sc[2 * j + 1] as f32);
                        ml[j] = -(dmin * m[2 * j] as f32);
                        mh[j] = -(dmin * m[2 * j + 1] as f32);
                    }
                }
                g.dl = _mm256_loadu_ps(dl.as_ptr());
                g.dh = _mm256_loadu_ps(dh.as_ptr());
                g.ml = _mm256_loadu_ps(ml.as_ptr());
                g.mh = _mm256_loadu_ps(mh.as_ptr());
            }
            ScaleKind::D | ScaleKind::DMin => {
                let bb = B::W.block_bytes();
                let (mut d, mut m) = ([0u16; LANES], [0u16; LANES]);
                let (tab_abs, tab) = (table16(B::TAB, true), table16(B::TAB, false));
                for j in 0..k {
                    let blk = wq.add((b0 + j) * bb);
                    d[j] = u16_at(blk, 0);
                    let affine = B::SC == ScaleKind::DMin;
                    if affine {
                        m[j] = u16_at(blk, 2);
                    }
                    // qs and qh offsets: Q4_1 4/-, Q5_0 6/2, Q5_1 8/4, IQ4_NL 2/-, Q6_0 10/2.
                    let qh_at = if affine { 4 } else { 2 };
                    let qs_at = qh_at + [0, 0, 0, 0, 0, 4, 8][B::BITS as usize];
                    let n = nibbles32(blk.add(qs_at));
                    g.w[j] = match B::BITS {
                        5 => _mm256_or_si256(
                            n,
                            bits5((blk.add(qh_at) as *const u32).read_unaligned()),
                        ),
                        6 => _mm256_or_si256(
                            n,
                            bits6((blk.add(qh_at) as *const u64).read_unaligned()),
                        ),
                        _ if B::TABLE => {
                            g.aux[j] = _mm256_shuffle_epi8(tab, n);
                            _mm256_shuffle_epi8(tab_abs, n)
                        }
                        _ => n,
                    };
                }
                g.dw = f16x8(&d);
                g.mw = f16x8(&m);
            }
        }
        g
    }
}

/// One decoded group against `T` tokens: the contract's step for its `k` blocks.
#[inline(always)]
unsafe fn step<B: BlockTy, const T: usize>(
    g: &Group,
    x: &ActTile,
    nb: usize,
    b0: usize,
    k: usize,
    acc: &mut [__m256; T],
) {
    let cols = nb * QK;
    // SAFETY: blocks b0..b0 + k of every token of `x` exist; masked loads past them.
    unsafe {
        let zero = _mm256_setzero_si256();
        let ones = _mm256_set1_epi16(1);
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let kmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), lanes);
        if matches!(B::SC, ScaleKind::K3 | ScaleKind::K2) {
            return step_halves::<B, T>(g, x, nb, b0, acc);
        }
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let mut p = [zero; LANES];
            for (j, pj) in p.iter_mut().enumerate().take(k) {
                let xp = x.q.as_ptr().add(t * cols + (b0 + j) * QK);
                let xv = _mm256_loadu_si256(xp as *const __m256i);
                *pj = if B::TABLE {
                    let s = _mm256_maddubs_epi16(g.w[j], _mm256_sign_epi8(xv, g.aux[j]));
                    _mm256_madd_epi16(s, ones)
                } else if B::SC == ScaleKind::K6 {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(g.w[j], xv), g.aux[j])
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(g.w[j], xv), ones)
                };
            }
            let mut isum = hsum8(&p);
            let o = t * nb + b0;
            let s = _mm256_maskload_epi32(x.s.as_ptr().add(o), kmask);
            if B::SC == ScaleKind::K6 {
                let h0 = _mm256_maskload_epi32(x.h.as_ptr().add(o), kmask);
                let h1 = _mm256_sub_epi32(s, h0);
                let c = _mm256_add_epi32(
                    _mm256_mullo_epi32(g.sc_lo, h0),
                    _mm256_mullo_epi32(g.sc_hi, h1),
                );
                isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(c, 5));
            } else if !B::TABLE && B::OFF != 0 {
                isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(s, _mm256_set1_epi32(B::OFF)));
            }
            let dx = load_scales(x.d.as_ptr().add(o), k);
            let d = _mm256_mul_ps(g.dw, dx);
            *acc_t = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), *acc_t);
            if B::AFFINE {
                let xs = _mm256_mul_ps(dx, _mm256_cvtepi32_ps(s));
                *acc_t = _mm256_fmadd_ps(g.mw, xs, *acc_t);
            }
        }
    }
}

/// [`step`] of Q3_K and Q2_K (a whole super-block: `k` = 8): `Σ_lo`, `Σ_hi` per block,
/// then the halves' step.
#[inline(always)]
unsafe fn step_halves<B: BlockTy, const T: usize>(
    g: &Group,
    x: &ActTile,
    nb: usize,
    b0: usize,
    acc: &mut [__m256; T],
) {
    let cols = nb * QK;
    // SAFETY: blocks b0..b0 + 8 of every token of `x` exist.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let mut p = [_mm256_setzero_si256(); LANES];
            for (j, pj) in p.iter_mut().enumerate() {
                let xp = x.q.as_ptr().add(t * cols + (b0 + j) * QK);
                let xv = _mm256_loadu_si256(xp as *const __m256i);
                *pj = _mm256_madd_epi16(_mm256_maddubs_epi16(g.w[j], xv), ones);
            }
            let (mut lo, mut hi) = hsum8_halves(&p);
            let o = t * nb + b0;
            let s = _mm256_loadu_si256(x.s.as_ptr().add(o) as *const __m256i);
            let h = _mm256_loadu_si256(x.h.as_ptr().add(o) as *const __m256i);
            let sh = _mm256_sub_epi32(s, h);
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(o));
            let v = if B::SC == ScaleKind::K3 {
                // Levels q + 4: Σ q·x = Σ (q + 4)·x − 4·Σ x per half.
                lo = _mm256_sub_epi32(lo, _mm256_slli_epi32(h, 2));
                hi = _mm256_sub_epi32(hi, _mm256_slli_epi32(sh, 2));
                let l = _mm256_mul_ps(g.dl, _mm256_cvtepi32_ps(lo));
                _mm256_fmadd_ps(g.dh, _mm256_cvtepi32_ps(hi), l)
            } else {
                let m = _mm256_mul_ps(g.ml, _mm256_cvtepi32_ps(h));
                let mt = _mm256_fmadd_ps(g.mh, _mm256_cvtepi32_ps(sh), m);
                let l = _mm256_fmadd_ps(g.dl, _mm256_cvtepi32_ps(lo), mt);
                _mm256_fmadd_ps(g.dh, _mm256_cvtepi32_ps(hi), l)
            };
            *acc_t = _mm256_fmadd_ps(dx, v, *acc_t);
        }
    }
}

/// One row against `T` tokens.
#[inline(always)]
unsafe fn row<B: BlockTy, const T: usize>(wq: &[u8], x: &ActTile, out: &mut [f32]) {
    let nb = x.d.len() / T;
    debug_assert!(wq.len() == B::W.row_bytes(nb * QK) && x.q.len() == T * nb * QK);
    debug_assert!(x.s.len() == T * nb && x.h.len() == T * nb && out.len() == T);
    // SAFETY: the lengths above cover every block `decode` and `step` read.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        for b0 in (0..nb).step_by(LANES) {
            let k = (nb - b0).min(LANES);
            let g = decode::<B>(wq.as_ptr(), b0, k);
            step::<B, T>(&g, x, nb, b0, k, &mut acc);
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = reduce_lanes(a);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_any<B: BlockTy>(rows: usize, wq: &[u8], x: &ActTile, out: &mut [f32]) {
    block_rows_of_tile!(rows, wq, out, |q, o, N| {
        // SAFETY: features enabled here; one row's blocks and `N` tokens.
        unsafe { row::<B, N>(q, x, o) }
    });
}

/// Tile kernel of block type `B` (see `table::TileFn`; `wd` is empty).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; slice lengths as `TileFn` says.
pub unsafe fn tile<B: BlockTy>(rows: usize, wq: &[u8], _wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: forwarded caller contract.
    unsafe { tile_any::<B>(rows, wq, x, out) }
}
