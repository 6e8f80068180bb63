//! Row-major tile kernels of GGUF's codebook types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
//! IQ2_S, IQ1_M) on AVX2 + FMA, bit-identical to `scalar::codebook`. Every x86 tier uses
//! them (the codebook types have no packed layout).
//!
//! A super-block is decoded once per row into 8 ymm of 32 signed levels `v` (one per
//! block of 32, element order): grid entries gathered by scalar index into a ymm (4 of 8
//! values or 8 of 4), sign bytes expanded to byte masks (`vpshufb` + `vpcmpeqb`) and
//! applied as `(m ^ mask) − mask`; IQ1_M's levels are `8·g ± 1`. Then for every token
//! `vpmaddubsw(|v|, sign(x, v))` (the IQ4_NL sign trick: `|v| ≤ 62`, pair sums ≤
//! 2·62·127, no saturation) and `vpmaddwd` by 1 give 8 exact i32 partials per block,
//! reduced to `isum` per block (a scale per 32) or to `Σ_lo`, `Σ_hi` (a scale per 16),
//! then the contract's float step on the 8 blocks as 8 lanes.
//!
//! A prompt (VNNI tiers) decodes a sub-block of rows once into the layout of
//! `kernels::packed` ("Decoded codebook groups": levels + 128 as a packed Q8_0 block,
//! f32 scales per 16 weights; [`decode_groups`]) and runs every tile of tokens on it as
//! the packed Q8_0 kernel does ([`decoded_vnni`]): one zmm lane per row, `vpdpbusd`
//! chains started at `−128·Σx` (a scale per 32) or at `−128·Σx_lo` and `−128·Σx_hi`
//! (a scale per 16), then the contract's float step on 16 rows.

use core::arch::x86_64::*;

use super::packed::{add512, dpbusd_block, lane_tree, store16, with_tokens};
use super::simd::{hsum8, hsum8_halves, reduce_lanes};
use crate::format::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};
use crate::format::wtype::{WType, QK, QK_K};
use crate::kernels::acts::{ActTile, PACKED_TILE, TILE_TOKENS};
use crate::kernels::counters::{count, Op};
use crate::kernels::packed::{lane_start, Line, DECODED_LINES, GROUP};
use crate::kernels::scalar::codebook::CodebookTy;
use crate::kernels::scalar::tiles::LANES;
use crate::kernels::tier::Tier;
use crate::quant::codebook;

/// A decoded super-block of one row.
struct Group {
    /// `|v|` per block of 32 (u8).
    w: [__m256i; LANES],
    /// `v` per block of 32 (i8), the signs for `vpsignb`.
    v: [__m256i; LANES],
    /// Per block: the scale of its first 16 weights (the block's scale when the type
    /// has one per 32) and of its last 16.
    dl: __m256,
    dh: __m256,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Byte `8k + i` = 0xFF where bit `i` of byte `k` of `s` is set (the signs of 32
/// weights, 8 per byte).
#[target_feature(enable = "avx2")]
#[inline]
fn sign_mask(s: u32) -> __m256i {
    let v = _mm256_set1_epi32(s as i32);
    let idx = _mm256_setr_epi64x(
        0,
        0x0101_0101_0101_0101,
        0x0202_0202_0202_0202,
        0x0303_0303_0303_0303,
    );
    let bytes = _mm256_shuffle_epi8(v, idx);
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit)
}

/// Magnitudes `m` with the signs of `s`: `(m ^ mask) − mask`.
#[target_feature(enable = "avx2")]
#[inline]
fn signed(m: __m256i, s: u32) -> __m256i {
    let mask = sign_mask(s);
    _mm256_sub_epi8(_mm256_xor_si256(m, mask), mask)
}

/// Four 8-value grid entries in element order.
#[target_feature(enable = "avx2")]
#[inline]
fn grid8(g: &[u64], i: [usize; 4]) -> __m256i {
    _mm256_setr_epi64x(
        g[i[0]] as i64,
        g[i[1]] as i64,
        g[i[2]] as i64,
        g[i[3]] as i64,
    )
}

/// Eight 4-value grid entries in element order.
#[target_feature(enable = "avx2")]
#[inline]
fn grid4(g: &[u32], i: impl Fn(usize) -> usize) -> __m256i {
    let e = |k: usize| g[i(k)] as i32;
    _mm256_setr_epi32(e(0), e(1), e(2), e(3), e(4), e(5), e(6), e(7))
}

/// The signed levels of block `j` (32 weights) of super-block `b` of type `t`.
#[target_feature(enable = "avx2")]
#[inline]
fn levels(t: WType, b: &[u8], j: usize) -> __m256i {
    match t {
        WType::IQ2_XXS => {
            let q = &b[2 + 8 * j..][..4];
            let m = grid8(&IQ2XXS_GRID, [0, 1, 2, 3].map(|l| q[l] as usize));
            signed(m, codebook::ksigns4(u32_at(b, 2 + 8 * j + 4)))
        }
        WType::IQ3_XXS => {
            let q = &b[2 + 8 * j..][..8];
            let m = grid4(&IQ3XXS_GRID, |i| q[i] as usize);
            signed(m, codebook::ksigns4(u32_at(b, 66 + 4 * j)))
        }
        WType::IQ2_XS => {
            let q = [0, 1, 2, 3].map(|l| u16_at(b, 2 + 8 * j + 2 * l));
            let m = grid8(&IQ2XS_GRID, q.map(|q| (q & 511) as usize));
            let s = (0..4).fold(0u32, |a, l| {
                a | (KSIGNS[(q[l] >> 9) as usize] as u32) << (8 * l)
            });
            signed(m, s)
        }
        WType::IQ2_S => {
            let m = grid8(
                &IQ2S_GRID,
                [0, 1, 2, 3].map(|l| codebook::iq2s_index(b, 4 * j + l)),
            );
            signed(m, u32_at(b, 34 + 4 * j))
        }
        WType::IQ3_S => {
            let m = grid4(&IQ3S_GRID, |i| codebook::iq3s_index(b, 8 * j + i));
            signed(m, u32_at(b, 74 + 4 * j))
        }
        WType::IQ1_M => {
            let k = [0, 1, 2, 3].map(|l| codebook::iq1m_index(b, 4 * j + l));
            let g = grid8(&IQ1S_GRID, k.map(|(i, _)| i));
            // 8·g per byte (g in −1..=1): the 16-bit shift's carries into a byte's low 3
            // bits are masked off.
            let g8 = _mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8(-8));
            let sh = k.map(|(_, neg)| if neg { -1i64 } else { 0x0101_0101_0101_0101 });
            _mm256_add_epi8(g8, _mm256_setr_epi64x(sh[0], sh[1], sh[2], sh[3]))
        }
        _ => unreachable!("a codebook type"),
    }
}

/// Decodes super-block `b` of type `C`.
#[target_feature(enable = "avx2")]
#[inline]
fn decode<C: CodebookTy>(b: &[u8]) -> Group {
    let dw = codebook::scales(C::W, b);
    let (mut dl, mut dh) = ([0f32; LANES], [0f32; LANES]);
    for j in 0..LANES {
        (dl[j], dh[j]) = (dw[2 * j], dw[2 * j + 1]);
    }
    let (mut v, mut w) = (
        [_mm256_setzero_si256(); LANES],
        [_mm256_setzero_si256(); LANES],
    );
    for j in 0..LANES {
        v[j] = levels(C::W, b, j);
        w[j] = _mm256_abs_epi8(v[j]);
    }
    Group {
        w,
        v,
        // SAFETY: each array holds the 8 f32 read.
        dl: unsafe { _mm256_loadu_ps(dl.as_ptr()) },
        dh: unsafe { _mm256_loadu_ps(dh.as_ptr()) },
    }
}

/// One row (`wq`: its super-blocks) against `T` tokens of `x`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn row<C: CodebookTy, const T: usize>(wq: &[u8], x: &ActTile, out: &mut [f32]) {
    let nb = x.d.len() / T;
    let cols = nb * QK;
    assert!(wq.len() == C::W.row_bytes(cols) && x.q.len() >= T * cols && out.len() == T);
    let halves = codebook::halves(C::W);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for (sb, blk) in wq.chunks_exact(C::W.block_bytes()).enumerate() {
        let g = decode::<C>(blk);
        let b0 = sb * LANES;
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let xr = &x.q[t * cols + b0 * QK..][..QK_K];
            let xd = &x.d[t * nb + b0..][..LANES];
            let mut p = [_mm256_setzero_si256(); LANES];
            for (j, pj) in p.iter_mut().enumerate() {
                // SAFETY: `xr` holds the 8 blocks' 256 quants; block j's are at 32·j.
                let xv = unsafe { _mm256_loadu_si256(xr.as_ptr().add(QK * j) as *const __m256i) };
                let s = _mm256_maddubs_epi16(g.w[j], _mm256_sign_epi8(xv, g.v[j]));
                *pj = _mm256_madd_epi16(s, ones);
            }
            // SAFETY: `xd` holds the 8 blocks' scales.
            let dx = unsafe { _mm256_loadu_ps(xd.as_ptr()) };
            *acc_t = if halves {
                let (lo, hi) = hsum8_halves(&p);
                let l = _mm256_mul_ps(g.dl, _mm256_cvtepi32_ps(lo));
                let v = _mm256_fmadd_ps(g.dh, _mm256_cvtepi32_ps(hi), l);
                _mm256_fmadd_ps(dx, v, *acc_t)
            } else {
                let d = _mm256_mul_ps(g.dl, dx);
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hsum8(&p)), *acc_t)
            };
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = reduce_lanes(a);
    }
}

#[target_feature(enable = "avx2,fma")]
fn tile_any<C: CodebookTy>(rows: usize, wq: &[u8], x: &ActTile, out: &mut [f32]) {
    let nt = out.len() / rows;
    debug_assert!((1..=TILE_TOKENS).contains(&nt));
    let rb = wq.len() / rows;
    let it = wq.chunks_exact(rb).zip(out.chunks_exact_mut(nt));
    macro_rules! go {
        ($n:literal) => {
            for (q, o) in it {
                row::<C, $n>(q, x, o)
            }
        };
    }
    match nt {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}

/// Tile kernel of codebook type `C` (see `table::TileFn`; `wd` is empty).
///
/// # Safety
/// The CPU has AVX2 and FMA; slice lengths as `TileFn` says.
pub unsafe fn tile<C: CodebookTy>(
    rows: usize,
    wq: &[u8],
    _wd: &[f32],
    x: &ActTile,
    out: &mut [f32],
) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: the caller's CPU has the features.
    unsafe { tile_any::<C>(rows, wq, x, out) }
}

/// Decodes groups `g0..g1` of type `C`'s rows into `buf` (see `table::DecodeFn`).
///
/// # Safety
/// The CPU has AVX2; `wq` holds `rows` rows of `cols`, `g1·16 < rows + 16`, `buf` holds
/// `(g1 − g0)·(cols/32)·DECODED_LINES` lines.
#[target_feature(enable = "avx2")]
pub unsafe fn decode_groups<C: CodebookTy>(
    wq: &[u8],
    rows: usize,
    cols: usize,
    g0: usize,
    g1: usize,
    buf: &mut [Line],
) {
    // Counted as the packing step it is (AVX2 code on the VNNI tiers).
    count(Tier::Avx2, Op::Packed);
    let (nb, rb, bb) = (cols / QK, C::W.row_bytes(cols), C::W.block_bytes());
    let per_group = nb * DECODED_LINES;
    assert!(wq.len() == rows * rb && buf.len() >= (g1 - g0) * per_group);
    assert!(g0 <= g1 && (g1 - 1) * GROUP < rows.max(1));
    // Block b = 8·sb + l of a row sits at position lane_start(l) + sb.
    let starts: [usize; LANES] = std::array::from_fn(|l| lane_start(nb, l));
    let flip = _mm256_set1_epi8(-128);
    for (g, rec) in (g0..g1).zip(buf.chunks_exact_mut(per_group)) {
        for j in 0..GROUP {
            let at = 4 * j..4 * j + 4;
            let r = g * GROUP + j;
            if r >= rows {
                for lines in rec.chunks_exact_mut(DECODED_LINES) {
                    for (k, line) in lines.iter_mut().enumerate() {
                        line.0[at.clone()].fill(if k < 8 { 0x80 } else { 0 });
                    }
                }
                continue;
            }
            for (sb, blk) in wq[r * rb..(r + 1) * rb].chunks_exact(bb).enumerate() {
                let dw = codebook::scales(C::W, blk);
                for (l, &start) in starts.iter().enumerate() {
                    let v = _mm256_xor_si256(levels(C::W, blk, l), flip);
                    let mut u = [0u8; QK];
                    // SAFETY: `u` holds 32 bytes.
                    unsafe { _mm256_storeu_si256(u.as_mut_ptr() as *mut __m256i, v) };
                    let lines = &mut rec[(start + sb) * DECODED_LINES..][..DECODED_LINES];
                    for (k, line) in lines[..8].iter_mut().enumerate() {
                        line.0[at.clone()].copy_from_slice(&u[4 * k..4 * k + 4]);
                    }
                    lines[8].0[at.clone()].copy_from_slice(&dw[2 * l].to_ne_bytes());
                    lines[9].0[at.clone()].copy_from_slice(&dw[2 * l + 1].to_ne_bytes());
                }
            }
        }
    }
}

/// Lane `l`'s accumulators for `T` tokens over one decoded group (`rec`): blocks `l, l
/// + 8, …`, stored from position `lane_start(nb, l)` on. All zero when `l ≥ nb`.
#[inline(always)]
unsafe fn decoded_lane<const HALVES: bool, const T: usize>(
    rec: *const u8,
    x: &ActTile,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `decoded_vnni`): the group's lines and a packed
    // tile of T tokens.
    unsafe {
        let (xq, xd, xs, xh) = (x.iq.as_ptr(), x.id.as_ptr(), x.is.as_ptr(), x.ih.as_ptr());
        let mut acc = [_mm512_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = rec.add(pos * DECODED_LINES * 64);
            let mut w = [_mm512_setzero_si512(); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                *wk = _mm512_load_si512(wp.add(64 * k) as *const _);
            }
            let (lo, hi) = ([w[0], w[1], w[2], w[3]], [w[4], w[5], w[6], w[7]]);
            let dl = _mm512_load_ps(wp.add(512) as *const f32);
            let dh = _mm512_load_ps(wp.add(576) as *const f32);
            let at = b * T;
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add((at + t) * QK) as *const i32;
                let (s, dx) = (*xs.add(at + t), _mm512_set1_ps(*xd.add(at + t)));
                if HALVES {
                    let h = *xh.add(at + t);
                    let (i0, i1) = dpbusd_block(
                        _mm512_set1_epi32(-128 * h),
                        _mm512_set1_epi32(-128 * (s - h)),
                        &lo,
                        &hi,
                        xb,
                    );
                    let l = _mm512_mul_ps(dl, _mm512_cvtepi32_ps(i0));
                    let v = _mm512_fmadd_ps(dh, _mm512_cvtepi32_ps(i1), l);
                    *acc_t = _mm512_fmadd_ps(dx, v, *acc_t);
                } else {
                    let (i0, i1) = dpbusd_block(
                        _mm512_set1_epi32(-128 * s),
                        _mm512_setzero_si512(),
                        &lo,
                        &hi,
                        xb,
                    );
                    let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                    *acc_t = _mm512_fmadd_ps(_mm512_mul_ps(dl, dx), isum, *acc_t);
                }
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// Groups `g0..g1` of `buf` against `T` tokens, the lanes combined by `lane_tree!`.
#[inline(always)]
unsafe fn decoded_groups<const HALVES: bool, const T: usize>(
    buf: &[Line],
    nb: usize,
    g0: usize,
    g1: usize,
    rows: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    for g in g0..g1 {
        let rec = buf[(g - g0) * nb * DECODED_LINES..].as_ptr() as *const u8;
        // SAFETY: the caller's contract (see `decoded_vnni`).
        unsafe {
            let r = lane_tree!(|l: usize| decoded_lane::<HALVES, T>(rec, x, nb, l), add512);
            store16(r, rows, g, y, ld);
        }
    }
}

/// Decoded groups of codebook type `C` against a packed tile, AVX-512 VNNI (see
/// `table::DecodedFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI; `buf` holds groups `g0..g1` from [`decode_groups`] of
/// a matrix of `rows` rows of `nb` blocks; `x` is a packed tile of 1..=8 tokens of `nb`
/// blocks; `y[t·ld + r]` is writable for every token and real row of the groups.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub unsafe fn decoded_vnni<C: CodebookTy>(
    buf: &[Line],
    nb: usize,
    g0: usize,
    g1: usize,
    rows: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    count(Tier::Avx512Vnni, Op::Packed);
    let nt = x.d.len() / nb;
    assert!((1..=PACKED_TILE).contains(&nt) && buf.len() >= (g1 - g0) * nb * DECODED_LINES);
    assert!(x.iq.len() == nt * nb * QK && x.is.len() == nt * nb && x.ih.len() == nt * nb);
    // SAFETY: forwarded caller contract; the lengths checked above.
    unsafe {
        if codebook::halves(C::W) {
            with_tokens!(nt, const T => decoded_groups::<true, T>(buf, nb, g0, g1, rows, x, y, ld))
        } else {
            with_tokens!(nt, const T => decoded_groups::<false, T>(buf, nb, g0, g1, rows, x, y, ld))
        }
    }
}
