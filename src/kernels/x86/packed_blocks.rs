//! Micro-kernels for packed matrices of the GGUF block types (layout:
//! [`crate::kernels::packed`]), bit-identical to `scalar::blocks`.
//!
//! AVX-512 VNNI: one zmm lane per row of a 16-row group, as the packed Q4_0 kernel. Per
//! block position the 4 chunks of nibbles become 8 u8 vectors (low nibbles: elements
//! `4k..4k+4` of every row; high: `16+4k..`), or-ed with the fifth bit or the top two
//! bits from their planes, or looked up in IQ4_NL's table as `T + 128`. Per token,
//! `vpdpbusd` with the activation bytes broadcast gives `Σ q·x` of 16 rows in two
//! chains (the block's first and last 16 weights), started at the contract's offset
//! (`−16·s_b`, `−32·s_b`, `−128·s_b`; Q6_K `−32·h_b` and `−32·(s_b − h_b)`, then each
//! chain times its half's int8 scale, `vpmulld`). The float step runs on 16 rows with
//! `dw = d·sc`, `mw = −(dmin·m)` made from the stored bits (exact), per lane in block
//! order, the lanes combined by the contract's tree.
//!
//! AVX2 (the AVX2 and AVX-512 BW tiers): the same with a ymm per half group (8 rows)
//! and `vpmaddubsw` + `vpmaddwd` in place of `vpdpbusd`, i16 sums kept below 2^15:
//! 16 products of 4-bit levels (≤ 30480), 8 of 5-bit (≤ 31496) or 4 of 6-bit (≤ 32004)
//! per `vpmaddwd`; IQ4_NL by the sign trick (`|T|` × `x` with `T`'s sign, one
//! `vpmaddwd` per `vpmaddubsw`).

use core::arch::x86_64::*;
use std::cell::Cell;

use super::packed::{
    add256, add512, dpbusd_block, in_passes, lane_tree, prefetch, store16, store8, unpack256,
    unpack512, with_tokens,
};
use super::prefetch::BLOCKS;
use super::simd::{f16x16, f16x8};
use crate::format::wtype::QK;
use crate::kernels::acts::{ActTile, PACKED_TILE};
use crate::kernels::counters::{count, Op};
use crate::kernels::packed::{lane_start, GroupLayout, PackedView, GROUP};
use crate::kernels::scalar::blocks::{BlockTy, ScaleKind};
use crate::kernels::scalar::tiles::LANES;
use crate::kernels::tier::Tier;

/// A type's 16 table levels plus `off` (wrapping), or their magnitudes, as 16 bytes.
fn table(tab: &[i8; 16], abs: bool, off: i8) -> [i8; 16] {
    let mut t = [0i8; 16];
    for (o, &v) in t.iter_mut().zip(tab) {
        *o = if abs { v.abs() } else { v.wrapping_add(off) };
    }
    t
}

/// 16 rows' f32 factors, one zmm (or two ymm) of a group.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Rows16([f32; 16]);

thread_local! {
    /// A group's super-block scales as f32 (see [`Supers`]); kept per thread so that a
    /// kernel call allocates nothing once it has grown.
    static SUPERS: Cell<Vec<Rows16>> = const { Cell::new(Vec::new()) };
}

thread_local! {
    /// Each token's and block's chain starts (see [`Offsets`]), per thread as `SUPERS`.
    static OFFSETS: Cell<Vec<[i32; 2]>> = const { Cell::new(Vec::new()) };
}

/// The integer offsets that start block `b`'s two `vpdpbusd` chains for token `t`, at
/// `b·n + t` for the tile's `n` tokens (the order of [`ActTile::iq`]): `−OFF·s_b` and 0,
/// or Q6_K's and Q3_K's `−OFF·h_b` and `−OFF·(s_b − h_b)`; Q2_K's chains start at 0 and
/// the table holds its minimum term's `h_b` and `s_b − h_b` as f32 bits. They depend on
/// the token only, so they are made once per call, not once per group of rows, and each
/// is then a broadcast from memory (a load) instead of scalar arithmetic and a register
/// broadcast per token and block position.
struct Offsets(Vec<[i32; 2]>);

impl Offsets {
    /// Whether type `B`'s chains start anywhere but 0.
    const fn used<B: BlockTy>() -> bool {
        matches!(B::SC, ScaleKind::K6 | ScaleKind::K3 | ScaleKind::K2) || B::OFF != 0
    }

    /// Whether type `B`'s chains start at the table's values (else at 0).
    const fn starts<B: BlockTy>() -> bool {
        Self::used::<B>() && !matches!(B::SC, ScaleKind::K2)
    }

    /// Whether type `B`'s second chain starts at the table's second value.
    const fn halves<B: BlockTy>() -> bool {
        matches!(B::SC, ScaleKind::K6 | ScaleKind::K3)
    }

    fn of<B: BlockTy>(x: &ActTile) -> Offsets {
        let mut v = OFFSETS.take();
        v.clear();
        if !Self::used::<B>() {
            return Offsets(v);
        }
        v.extend(x.is.iter().zip(x.ih).map(|(&s, &h)| match B::SC {
            ScaleKind::K6 | ScaleKind::K3 => [-B::OFF * h, -B::OFF * (s - h)],
            ScaleKind::K2 => [
                (h as f32).to_bits() as i32,
                ((s - h) as f32).to_bits() as i32,
            ],
            _ => [-B::OFF * s, 0],
        }));
        Offsets(v)
    }

    fn ptr(&self) -> *const i32 {
        self.0.as_ptr() as *const i32
    }
}

impl Drop for Offsets {
    fn drop(&mut self) {
        OFFSETS.set(std::mem::take(&mut self.0));
    }
}

/// The super-block scales of the group being computed, as f32: K45 and K2 `d` at `2s`
/// and `−dmin` at `2s + 1`, K6, K3 and KXs `d` at `s`. Every lane reads every super-block (lane `l`'s
/// `i`-th position is sub-block `l` of super-block `i`), so they are converted once per
/// group instead of once per block position. Exact: f16 → f32, a negation.
struct Supers(Vec<Rows16>);

impl Supers {
    fn take() -> Supers {
        Supers(SUPERS.take())
    }

    /// Converts group `grp`'s super-block scales (`f16x16` turns 16 f16 into f32).
    #[inline(always)]
    unsafe fn fill<B: BlockTy>(
        &mut self,
        grp: *const u8,
        lay: &GroupLayout,
        nb: usize,
        f16x16: impl Fn(*const u8) -> Rows16,
    ) {
        let nsb = nb / LANES;
        let ss = grp.wrapping_add(lay.supers_at);
        let v = &mut self.0;
        v.clear();
        match B::SC {
            ScaleKind::K45 | ScaleKind::K2 => {
                for sb in 0..nsb {
                    let p = ss.wrapping_add(64 * sb);
                    v.push(f16x16(p));
                    let mut m = f16x16(p.wrapping_add(32));
                    m.0.iter_mut().for_each(|x| *x = -*x);
                    v.push(m);
                }
            }
            ScaleKind::K6 | ScaleKind::K3 | ScaleKind::KXs => {
                v.extend((0..nsb).map(|sb| f16x16(ss.wrapping_add(32 * sb))))
            }
            ScaleKind::D | ScaleKind::DMin | ScaleKind::E8M0 => {}
        }
    }

    fn ptr(&self) -> *const f32 {
        self.0.as_ptr() as *const f32
    }
}

impl Drop for Supers {
    fn drop(&mut self) {
        SUPERS.set(std::mem::take(&mut self.0));
    }
}

/// Four activation bytes at `p` in every i32 lane.
#[inline(always)]
unsafe fn bcast4(p: *const i32) -> __m256i {
    // SAFETY: 4 readable bytes (the caller's contract).
    unsafe { _mm256_set1_epi32(p.read_unaligned()) }
}

/// 16 int8 at `p` as f32.
#[inline(always)]
unsafe fn i8x16_f32(p: *const u8) -> __m512 {
    // SAFETY: 16 readable bytes (the caller's contract); AVX-512 F.
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
}

/// 16 u8 lanes of `v` as f32 (a function, not a closure: a closure would not inherit
/// the caller's target features, and its intrinsics would stay out of line).
#[inline(always)]
unsafe fn u8x16_f32(v: __m128i) -> __m512 {
    // SAFETY: register-only; AVX-512 F (the caller's contract).
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)) }
}

/// The low 8 u8 lanes of `v` as f32 ([`u8x16_f32`] on ymm).
#[inline(always)]
unsafe fn u8x8_f32(v: __m128i) -> __m256 {
    // SAFETY: register-only; AVX2 (the caller's contract).
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)) }
}

/// Q4_K/Q5_K position scales (`sp`, 24 bytes, see `kernels::packed`): the top
/// four bits of `m` of rows `8h..8h + 8` (`h` = 1) or of all 16 rows (`h` = 0: rows
/// 0..8 in bytes 0..8, rows 8..16 in bytes 8..16), one per byte.
#[inline(always)]
unsafe fn k45_m_hi(sp: *const u8, h: usize) -> __m128i {
    // SAFETY: 24 readable bytes at `sp` (the caller's contract); SSE2.
    unsafe {
        let b = _mm_loadl_epi64(sp.add(16) as *const __m128i);
        let both = if h == 0 {
            _mm_unpacklo_epi64(b, _mm_srli_epi64(b, 4))
        } else {
            _mm_srli_epi64(b, 4)
        };
        _mm_and_si128(both, _mm_set1_epi8(15))
    }
}

/// The 6-bit `sc` and `m` codes, one per byte, from the position scales' bytes `a`
/// (`sc | (m & 3) << 6` per row) and `m`'s top four bits `m_hi` (see [`k45_m_hi`]).
#[target_feature(enable = "sse2")]
#[inline]
fn k45_codes(a: __m128i, m_hi: __m128i) -> (__m128i, __m128i) {
    let sc = _mm_and_si128(a, _mm_set1_epi8(63));
    // Per 16-bit lane, so mask the bits shifted in from the next byte.
    let m_lo = _mm_and_si128(_mm_srli_epi16(a, 6), _mm_set1_epi8(3));
    (sc, _mm_or_si128(m_lo, _mm_slli_epi16(m_hi, 2)))
}

/// The float factors of one block position for the 16 rows (zmm) of a group; Q6_K's
/// int8 half scales as f32 (exact); Q3_K's and Q2_K's halves' `d·sc` (in `sc_lo`,
/// `sc_hi`) and Q2_K's `−dmin·m` (`ml`, `mh`).
struct Scales512 {
    dw: __m512,
    mw: __m512,
    sc_lo: __m512,
    sc_hi: __m512,
    ml: __m512,
    mh: __m512,
}

/// 2^(e − 128) of the E8M0 exponents `e` (i32 lanes), exactly (`e < 2`: subnormals).
#[target_feature(enable = "avx512f")]
#[inline]
fn e8m0_512(e: __m512i) -> __m512 {
    let normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    let sub = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    let bits = _mm512_mask_sllv_epi32(normal, sub, _mm512_set1_epi32(0x0020_0000), e);
    _mm512_castsi512_ps(bits)
}

/// [`e8m0_512`] on ymm.
#[target_feature(enable = "avx2")]
#[inline]
fn e8m0_256(e: __m256i) -> __m256 {
    let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    let sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, sub))
}

/// `dw`, `mw` (and Q6_K's half scales) of block `b` at position record `sp` of a group
/// whose super-block scales are `sup` (a [`Supers`] table).
#[inline(always)]
unsafe fn scales512<B: BlockTy>(sp: *const u8, sup: *const f32, b: usize) -> Scales512 {
    // SAFETY: the position and super-block records exist (the caller's contract).
    unsafe {
        let zero = _mm512_setzero_ps();
        let mut s = Scales512 {
            dw: zero,
            mw: zero,
            sc_lo: zero,
            sc_hi: zero,
            ml: zero,
            mh: zero,
        };
        let sb = b / LANES;
        match B::SC {
            ScaleKind::E8M0 => {
                s.dw = e8m0_512(_mm512_cvtepu8_epi32(_mm_loadu_si128(sp as *const __m128i)))
            }
            ScaleKind::KXs => s.dw = _mm512_mul_ps(_mm512_load_ps(sup.add(16 * sb)), i8x16_f32(sp)),
            ScaleKind::K3 => {
                let d = _mm512_load_ps(sup.add(16 * sb));
                s.sc_lo = _mm512_mul_ps(d, i8x16_f32(sp));
                s.sc_hi = _mm512_mul_ps(d, i8x16_f32(sp.add(16)));
            }
            ScaleKind::K2 => {
                let (d, nmin) = (
                    _mm512_load_ps(sup.add(32 * sb)),
                    _mm512_load_ps(sup.add(32 * sb + 16)),
                );
                let m4 = _mm_set1_epi8(15);
                let (lo, hi) = (
                    _mm_loadu_si128(sp as *const __m128i),
                    _mm_loadu_si128(sp.add(16) as *const __m128i),
                );
                s.sc_lo = _mm512_mul_ps(d, u8x16_f32(_mm_and_si128(lo, m4)));
                s.sc_hi = _mm512_mul_ps(d, u8x16_f32(_mm_and_si128(hi, m4)));
                s.ml = _mm512_mul_ps(nmin, u8x16_f32(_mm_and_si128(_mm_srli_epi16(lo, 4), m4)));
                s.mh = _mm512_mul_ps(nmin, u8x16_f32(_mm_and_si128(_mm_srli_epi16(hi, 4), m4)));
            }
            ScaleKind::D => s.dw = f16x16(sp),
            ScaleKind::DMin => (s.dw, s.mw) = (f16x16(sp), f16x16(sp.add(32))),
            ScaleKind::K45 => {
                let (sc, m) = k45_codes(_mm_loadu_si128(sp as *const __m128i), k45_m_hi(sp, 0));
                let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc));
                let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m));
                s.dw = _mm512_mul_ps(_mm512_load_ps(sup.add(32 * sb)), sc);
                s.mw = _mm512_mul_ps(_mm512_load_ps(sup.add(32 * sb + 16)), m);
            }
            ScaleKind::K6 => {
                s.dw = _mm512_load_ps(sup.add(16 * sb));
                (s.sc_lo, s.sc_hi) = (i8x16_f32(sp), i8x16_f32(sp.add(16)));
            }
        }
        s
    }
}

/// The 16 rows' levels of one block position as u8 vectors: `lo[k]` pairs with
/// activation bytes `4k..4k+4`, `hi[k]` with `16+4k..` (IQ4_NL: `T + 128`).
#[inline(always)]
unsafe fn levels512<B: BlockTy>(wp: *const u8) -> ([__m512i; 4], [__m512i; 4]) {
    // SAFETY: the position's quant record (QB bytes, 64-aligned) exists.
    unsafe {
        let (mut lo, mut hi) = unpack512(B::BITS, wp);
        if B::TABLE {
            let t = table(B::TAB, false, -128);
            let tab = _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i));
            for k in 0..4 {
                lo[k] = _mm512_shuffle_epi8(tab, lo[k]);
                hi[k] = _mm512_shuffle_epi8(tab, hi[k]);
            }
        }
        (lo, hi)
    }
}

/// Bytes of quant records ahead of the one being read that the streaming kernels
/// prefetch: 24 Q4_K records, 19.2 of Q5_K, 16 of Q6_K.
const PF_BYTES: usize = 6144;

/// Prefetches ([`prefetch`]) the group bytes that position `pos` of the group at `grp` is
/// ahead of: a cursor that moves through memory at the rate the kernel reads it, one
/// group's bytes over its positions ([`GroupLayout::stride`] per position), starting
/// [`PF_BYTES`] past the quants' start, so it runs on into the next group's super-block
/// and position scales and first quants without a gap. Each position asks for the lines
/// that start in its `stride` bytes, so no line is asked for twice.
///
/// Both matter (llama1b decode, the products' time, alternating steps in one process):
/// offsets from the quant pointer, the scale line and the quant record 16 records
/// ahead, skipped a group's first 6-16 records at 2048 columns and asked for each scale
/// line twice; this took 0.75, 0.87 and 0.85 of their time at Q4_K, Q5_K and Q6_K. A
/// fixed 5 lines per position (a line asked for twice every few positions) took 1.08
/// of this one's. The distance was 16 records of every type until the weights moved to
/// huge pages (stop 36); on them, llama1b decode on Zen 4 (interleaved rounds, against
/// 16 records): Q4_K 24 records 1.075, 32 1.06, 48 1.045 (54 rounds); Q5_K 20 records
/// 1.009, 24 0.993; Q6_K 20 0.992, 24 0.988 (26 rounds). About 6 KiB suits all three.
#[inline(always)]
fn prefetch_ahead(grp: *const u8, lay: &GroupLayout, pos: usize) {
    let at = lay.quants_at + PF_BYTES + pos * lay.stride;
    let first = at.next_multiple_of(64);
    prefetch::<BLOCKS>(grp, first, (at + lay.stride).saturating_sub(first))
}

/// Lane `l`'s accumulators (blocks `l, l + 8, …` of one group) for `T` tokens.
#[inline(always)]
unsafe fn lane512<B: BlockTy, const T: usize>(
    grp: *const u8,
    lay: &GroupLayout,
    sup: *const f32,
    off: *const i32,
    x: &ActTile,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `group512`): a whole group, T tokens of nb blocks.
    unsafe {
        // The tile's tokens of one block are adjacent (`ActTile::iq`).
        let (xq, xd, xm) = (x.iq.as_ptr(), x.id.as_ptr(), x.ixs.as_ptr());
        let mut acc = [_mm512_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = grp.add(lay.quants_at + pos * lay.quant_bytes);
            let sp = grp.add(lay.scales_at + pos * lay.pos_scale_bytes);
            if x.stream {
                prefetch_ahead(grp, lay, pos);
            }
            let (lo, hi) = levels512::<B>(wp);
            let sc = scales512::<B>(sp, sup, b);
            let at = b * T;
            let (xq, xd, xm, off) = (xq.add(at * QK), xd.add(at), xm.add(at), off.add(2 * at));
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add(t * QK) as *const i32;
                let o = off.add(2 * t);
                // Two chains (the block's halves) also halve the `vpdpbusd` latency.
                let i0 = if Offsets::starts::<B>() {
                    _mm512_set1_epi32(*o)
                } else {
                    _mm512_setzero_si512()
                };
                let i1 = if Offsets::halves::<B>() {
                    _mm512_set1_epi32(*o.add(1))
                } else {
                    _mm512_setzero_si512()
                };
                let (i0, i1) = dpbusd_block(i0, i1, &lo, &hi, xb);
                if matches!(B::SC, ScaleKind::K3 | ScaleKind::K2) {
                    // The halves' step: `sc_lo`, `sc_hi` hold `d·sc`.
                    let l = if B::SC == ScaleKind::K2 {
                        let h = _mm512_set1_ps(f32::from_bits(*o as u32));
                        let sh = _mm512_set1_ps(f32::from_bits(*o.add(1) as u32));
                        let mt = _mm512_fmadd_ps(sc.mh, sh, _mm512_mul_ps(sc.ml, h));
                        _mm512_fmadd_ps(sc.sc_lo, _mm512_cvtepi32_ps(i0), mt)
                    } else {
                        _mm512_mul_ps(sc.sc_lo, _mm512_cvtepi32_ps(i0))
                    };
                    let v = _mm512_fmadd_ps(sc.sc_hi, _mm512_cvtepi32_ps(i1), l);
                    *acc_t = _mm512_fmadd_ps(_mm512_set1_ps(*xd.add(t)), v, *acc_t);
                    continue;
                }
                // `isum_b as f32`. Q6_K: `sc_lo·i0` is exact in f32 (|·| ≤ 128·65,024 <
                // 2^24) and the fused add rounds the exact integer sum once, as the
                // conversion does: the contract's bits without `vpmulld` (2 uops, port 0
                // only on Intel, where `vpdpbusd` runs).
                let fsum = if B::SC == ScaleKind::K6 {
                    let lo = _mm512_mul_ps(sc.sc_lo, _mm512_cvtepi32_ps(i0));
                    _mm512_fmadd_ps(sc.sc_hi, _mm512_cvtepi32_ps(i1), lo)
                } else {
                    _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1))
                };
                // The contract's fused step (min term last: the product term's fma
                // issues as soon as `fsum` is ready).
                let d = _mm512_mul_ps(sc.dw, _mm512_set1_ps(*xd.add(t)));
                *acc_t = _mm512_fmadd_ps(d, fsum, *acc_t);
                if B::AFFINE {
                    *acc_t = _mm512_fmadd_ps(sc.mw, _mm512_set1_ps(*xm.add(t)), *acc_t);
                }
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// The VNNI kernel's per-call tables.
struct Tables {
    sup: Supers,
    off: Offsets,
}

/// One group of 16 rows against `T` tokens; writes `y[t·ld + 16g + j]` for real rows.
#[inline(always)]
unsafe fn group512<B: BlockTy, const T: usize>(
    p: &PackedView,
    lay: &GroupLayout,
    tabs: &mut Tables,
    g: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    let nb = p.nb;
    // SAFETY: g < groups, `x` holds T tokens of nb blocks, y has T rows of ld ≥ rows.
    unsafe {
        let grp = p.q.as_ptr().add(g * lay.group);
        let Tables { sup, off } = tabs;
        sup.fill::<B>(grp, lay, nb, |p| {
            let mut r = Rows16([0.0; 16]);
            _mm512_store_ps(r.0.as_mut_ptr(), f16x16(p));
            r
        });
        let (sp, off) = (sup.ptr(), off.ptr());
        let r = lane_tree!(
            |l: usize| lane512::<B, T>(grp, lay, sp, off, x, nb, l),
            add512
        );
        store16(r, p.rows, g, y, ld);
    }
}

/// Packed block type `B`, AVX-512 VNNI (see `table::PackedFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI, AVX2, FMA and F16C; `p` is a packed view of type `B`,
/// `g0 ≤ g1 ≤ groups`, `x` holds 1..=8 tokens of `p.nb` blocks, `y[t·ld + r]` is
/// writable for every token `t` and row `r < p.rows` of the groups.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub unsafe fn vnni<B: BlockTy>(
    p: &PackedView,
    g0: usize,
    g1: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    count(Tier::Avx512Vnni, Op::Packed);
    let nt = x.d.len() / p.nb;
    debug_assert!((1..=PACKED_TILE).contains(&nt));
    debug_assert!(x.q.len() == nt * p.nb * QK && x.s.len() == nt * p.nb && x.h.len() == x.s.len());
    debug_assert!(x.iq.len() == x.q.len() && x.id.len() == x.d.len() && x.ixs.len() == x.d.len());
    debug_assert!(x.is.len() == x.d.len() && x.ih.len() == x.d.len());
    let lay = GroupLayout::of(B::W, p.nb);
    debug_assert!(p.q.len() >= g1 * lay.group);
    let mut tabs = Tables {
        sup: Supers::take(),
        off: Offsets::of::<B>(x),
    };
    // SAFETY: forwarded caller contract.
    unsafe {
        with_tokens!(nt, const T => for g in g0..g1 {
            group512::<B, T>(p, &lay, &mut tabs, g, x, y, ld)
        })
    }
}

/// The float factors of one block position for a half group (ymm).
struct Scales256 {
    dw: __m256,
    mw: __m256,
    sc_lo: __m256i,
    sc_hi: __m256i,
    /// Q3_K, Q2_K: the halves' `d·sc`; Q2_K: `−dmin·m`.
    dl: __m256,
    dh: __m256,
    ml: __m256,
    mh: __m256,
}

/// 8 int8 at `p` as f32.
#[inline(always)]
unsafe fn i8x8_f32(p: *const u8) -> __m256 {
    // SAFETY: 8 readable bytes (the caller's contract); AVX2.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
}

#[inline(always)]
unsafe fn scales256<B: BlockTy>(sp: *const u8, sup: *const f32, b: usize, h: usize) -> Scales256 {
    // SAFETY: the position and super-block records exist (the caller's contract).
    unsafe {
        let zero = _mm256_setzero_si256();
        let fz = _mm256_setzero_ps();
        let mut s = Scales256 {
            dw: fz,
            mw: fz,
            sc_lo: zero,
            sc_hi: zero,
            dl: fz,
            dh: fz,
            ml: fz,
            mh: fz,
        };
        let sb = b / LANES;
        match B::SC {
            ScaleKind::E8M0 => {
                s.dw = e8m0_256(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    sp.add(8 * h) as *const __m128i
                )))
            }
            ScaleKind::KXs => {
                s.dw = _mm256_mul_ps(
                    _mm256_load_ps(sup.add(16 * sb + 8 * h)),
                    i8x8_f32(sp.add(8 * h)),
                )
            }
            ScaleKind::K3 => {
                let d = _mm256_load_ps(sup.add(16 * sb + 8 * h));
                s.dl = _mm256_mul_ps(d, i8x8_f32(sp.add(8 * h)));
                s.dh = _mm256_mul_ps(d, i8x8_f32(sp.add(16 + 8 * h)));
            }
            ScaleKind::K2 => {
                let d = _mm256_load_ps(sup.add(32 * sb + 8 * h));
                let nmin = _mm256_load_ps(sup.add(32 * sb + 16 + 8 * h));
                let m4 = _mm_set1_epi8(15);
                let lo = _mm_loadl_epi64(sp.add(8 * h) as *const __m128i);
                let hi = _mm_loadl_epi64(sp.add(16 + 8 * h) as *const __m128i);
                s.dl = _mm256_mul_ps(d, u8x8_f32(_mm_and_si128(lo, m4)));
                s.dh = _mm256_mul_ps(d, u8x8_f32(_mm_and_si128(hi, m4)));
                s.ml = _mm256_mul_ps(nmin, u8x8_f32(_mm_and_si128(_mm_srli_epi16(lo, 4), m4)));
                s.mh = _mm256_mul_ps(nmin, u8x8_f32(_mm_and_si128(_mm_srli_epi16(hi, 4), m4)));
            }
            ScaleKind::D => s.dw = f16x8(sp.add(16 * h)),
            ScaleKind::DMin => (s.dw, s.mw) = (f16x8(sp.add(16 * h)), f16x8(sp.add(32 + 16 * h))),
            ScaleKind::K45 => {
                let a = _mm_loadl_epi64(sp.add(8 * h) as *const __m128i);
                let (sc, m) = k45_codes(a, k45_m_hi(sp, h));
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc));
                let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m));
                s.dw = _mm256_mul_ps(_mm256_load_ps(sup.add(32 * sb + 8 * h)), sc);
                s.mw = _mm256_mul_ps(_mm256_load_ps(sup.add(32 * sb + 16 + 8 * h)), m);
            }
            ScaleKind::K6 => {
                s.dw = _mm256_load_ps(sup.add(16 * sb + 8 * h));
                s.sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sp.add(8 * h) as *const __m128i));
                s.sc_hi =
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(sp.add(16 + 8 * h) as *const __m128i));
            }
        }
        s
    }
}

/// Half `h`'s levels of one block position (see [`levels512`]); IQ4_NL: `|T|` in the
/// first pair, `T` (for the sign) in the second.
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn levels256<B: BlockTy>(
    wp: *const u8,
    h: usize,
) -> ([__m256i; 4], [__m256i; 4], [__m256i; 4], [__m256i; 4]) {
    // SAFETY: the position's quant record (QB bytes) exists.
    unsafe {
        let zero = _mm256_setzero_si256();
        let (mut lo, mut hi) = unpack256(B::BITS, wp.add(32 * h));
        let (mut slo, mut shi) = ([zero; 4], [zero; 4]);
        if B::TABLE {
            let (ta, ts) = (table(B::TAB, true, 0), table(B::TAB, false, 0));
            let tab_abs =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(ta.as_ptr() as *const __m128i));
            let tab = _mm256_broadcastsi128_si256(_mm_loadu_si128(ts.as_ptr() as *const __m128i));
            for k in 0..4 {
                (slo[k], shi[k]) = (
                    _mm256_shuffle_epi8(tab, lo[k]),
                    _mm256_shuffle_epi8(tab, hi[k]),
                );
                lo[k] = _mm256_shuffle_epi8(tab_abs, lo[k]);
                hi[k] = _mm256_shuffle_epi8(tab_abs, hi[k]);
            }
        }
        (lo, hi, slo, shi)
    }
}

/// Lane `l` of half `h` of one group for tokens `t0..t0 + T`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn lane256<B: BlockTy, const T: usize>(
    grp: *const u8,
    lay: &GroupLayout,
    sup: *const f32,
    x: &ActTile,
    t0: usize,
    nb: usize,
    h: usize,
    l: usize,
) -> [__m256; T] {
    let nt = x.id.len() / nb;
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `group256`).
    unsafe {
        // The tile's tokens of one block are adjacent (`ActTile::iq`).
        let (xq, xd, xs, xh) = (x.iq.as_ptr(), x.id.as_ptr(), x.is.as_ptr(), x.ih.as_ptr());
        let xm = x.ixs.as_ptr();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = grp.add(lay.quants_at + pos * lay.quant_bytes);
            let sp = grp.add(lay.scales_at + pos * lay.pos_scale_bytes);
            if x.stream && h == 0 {
                prefetch_ahead(grp, lay, pos);
            }
            let (lo, hi, slo, shi) = levels256::<B>(wp, h);
            let sc = scales256::<B>(sp, sup, b, h);
            let at = b * nt + t0;
            let (xq, xd, xs, xh) = (xq.add(at * QK), xd.add(at), xs.add(at), xh.add(at));
            let xm = xm.add(at);
            for (i, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add(i * QK) as *const i32;
                let s = *xs.add(i);
                let (mut i0, mut i1);
                if B::TABLE {
                    let (mut a, mut c) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for k in 0..4 {
                        let p0 = _mm256_maddubs_epi16(
                            lo[k],
                            _mm256_sign_epi8(bcast4(xb.add(k)), slo[k]),
                        );
                        let p1 = _mm256_maddubs_epi16(
                            hi[k],
                            _mm256_sign_epi8(bcast4(xb.add(4 + k)), shi[k]),
                        );
                        a = _mm256_add_epi32(a, _mm256_madd_epi16(ones, p0));
                        c = _mm256_add_epi32(c, _mm256_madd_epi16(ones, p1));
                    }
                    (i0, i1) = (a, c);
                } else if B::BITS == 4 {
                    let mut s16 = _mm256_setzero_si256();
                    for k in 0..4 {
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[k], bcast4(xb.add(k))));
                        s16 = _mm256_add_epi16(
                            s16,
                            _mm256_maddubs_epi16(hi[k], bcast4(xb.add(4 + k))),
                        );
                    }
                    (i0, i1) = (_mm256_madd_epi16(ones, s16), _mm256_setzero_si256());
                } else if B::BITS == 5 || B::BITS < 4 {
                    // Each half apart (the 5-bit types, and Q3_K's and Q2_K's halves).
                    let (mut a, mut c) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for k in 0..4 {
                        a = _mm256_add_epi16(a, _mm256_maddubs_epi16(lo[k], bcast4(xb.add(k))));
                        c = _mm256_add_epi16(c, _mm256_maddubs_epi16(hi[k], bcast4(xb.add(4 + k))));
                    }
                    (i0, i1) = (_mm256_madd_epi16(ones, a), _mm256_madd_epi16(ones, c));
                } else {
                    // 4 products of 6-bit levels per i16 lane at most (≤ 32004).
                    let (mut a, mut c) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for k in [0, 2] {
                        let l2 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[k], bcast4(xb.add(k))),
                            _mm256_maddubs_epi16(lo[k + 1], bcast4(xb.add(k + 1))),
                        );
                        let h2 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(hi[k], bcast4(xb.add(4 + k))),
                            _mm256_maddubs_epi16(hi[k + 1], bcast4(xb.add(5 + k))),
                        );
                        a = _mm256_add_epi32(a, _mm256_madd_epi16(ones, l2));
                        c = _mm256_add_epi32(c, _mm256_madd_epi16(ones, h2));
                    }
                    (i0, i1) = (a, c);
                }
                if matches!(B::SC, ScaleKind::K3 | ScaleKind::K2) {
                    let hh = *xh.add(i);
                    let l = if B::SC == ScaleKind::K2 {
                        let m = _mm256_mul_ps(sc.ml, _mm256_set1_ps(hh as f32));
                        let mt = _mm256_fmadd_ps(sc.mh, _mm256_set1_ps((s - hh) as f32), m);
                        _mm256_fmadd_ps(sc.dl, _mm256_cvtepi32_ps(i0), mt)
                    } else {
                        i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(B::OFF * hh));
                        i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(B::OFF * (s - hh)));
                        _mm256_mul_ps(sc.dl, _mm256_cvtepi32_ps(i0))
                    };
                    let v = _mm256_fmadd_ps(sc.dh, _mm256_cvtepi32_ps(i1), l);
                    *acc_t = _mm256_fmadd_ps(_mm256_set1_ps(*xd.add(i)), v, *acc_t);
                    continue;
                }
                let isum = if B::SC == ScaleKind::K6 {
                    let hh = *xh.add(i);
                    i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(32 * hh));
                    i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(32 * (s - hh)));
                    _mm256_add_epi32(
                        _mm256_mullo_epi32(i0, sc.sc_lo),
                        _mm256_mullo_epi32(i1, sc.sc_hi),
                    )
                } else {
                    let off = if B::TABLE { 0 } else { B::OFF * s };
                    _mm256_sub_epi32(_mm256_add_epi32(i0, i1), _mm256_set1_epi32(off))
                };
                let d = _mm256_mul_ps(sc.dw, _mm256_set1_ps(*xd.add(i)));
                *acc_t = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), *acc_t);
                if B::AFFINE {
                    *acc_t = _mm256_fmadd_ps(sc.mw, _mm256_set1_ps(*xm.add(i)), *acc_t);
                }
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// Tokens `t0..t0 + T` of group `g`, both halves.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group256<B: BlockTy, const T: usize>(
    p: &PackedView,
    lay: &GroupLayout,
    sup: *const f32,
    g: usize,
    x: &ActTile,
    t0: usize,
    y: *mut f32,
    ld: usize,
) {
    let nb = p.nb;
    // SAFETY: as in `group512`.
    unsafe {
        let grp = p.q.as_ptr().add(g * lay.group);
        for h in 0..2 {
            let r0 = g * GROUP + 8 * h;
            if r0 >= p.rows {
                break;
            }
            let r = lane_tree!(
                |l: usize| lane256::<B, T>(grp, lay, sup, x, t0, nb, h, l),
                add256
            );
            store8(r, p.rows, r0, t0, y, ld);
        }
    }
}

/// Packed block type `B`, AVX2 (see `table::PackedFn`).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; otherwise as [`vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn avx2<B: BlockTy>(
    p: &PackedView,
    g0: usize,
    g1: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    count(Tier::Avx2, Op::Packed);
    let nt = x.d.len() / p.nb;
    debug_assert!((1..=PACKED_TILE).contains(&nt));
    debug_assert!(x.iq.len() == x.q.len() && x.id.len() == x.d.len() && x.ixs.len() == x.d.len());
    debug_assert!(x.is.len() == x.d.len() && x.ih.len() == x.d.len());
    let lay = GroupLayout::of(B::W, p.nb);
    debug_assert!(p.q.len() >= g1 * lay.group);
    let mut sup = Supers::take();
    for g in g0..g1 {
        let grp = p.q.as_ptr().wrapping_add(g * lay.group);
        // SAFETY: group g's super-block records exist (forwarded caller contract).
        unsafe {
            sup.fill::<B>(grp, &lay, p.nb, |p| {
                let mut r = Rows16([0.0; 16]);
                _mm256_store_ps(r.0.as_mut_ptr(), f16x8(p));
                _mm256_store_ps(r.0.as_mut_ptr().add(8), f16x8(p.add(16)));
                r
            })
        };
        let sp = sup.ptr();
        // SAFETY: forwarded caller contract; each pass's tokens exist.
        unsafe { in_passes!(nt, t0, group256::<B>(p, &lay, sp, g, x, t0, y, ld)) }
    }
}
