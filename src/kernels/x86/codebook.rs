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

use core::arch::x86_64::*;

use super::simd::{hsum8, hsum8_halves, reduce_lanes};
use crate::format::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};
use crate::format::wtype::{WType, QK, QK_K};
use crate::kernels::acts::{ActTile, TILE_TOKENS};
use crate::kernels::counters::{count, Op};
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
