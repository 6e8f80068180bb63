//! Micro-kernels for packed matrices of the GGUF block types (layout:
//! [`crate::kernels::packed_blocks`]), bit-identical to `kernels::scalar_k`.
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
use std::marker::PhantomData;

use super::packed::{
    add256, add512, all_tokens, dot_chains, float_step, lane_tree, nibbles, prefetch, store16,
    store8, token_passes, GroupFn, Width, Y, Z,
};
use crate::kernels::counters::{count, Op};
use crate::kernels::packed::{lane_start, PackedView, GROUP};
use crate::kernels::packed_blocks::{BlockTy, GroupLayout, ScaleKind};
use crate::kernels::{ActTile, Tier, LANES, PACKED_TILE};
use crate::quant::blocks32::IQ4NL_VALUES;
use crate::quant::QK;

/// IQ4_NL's 16 levels plus `off` (wrapping), or their magnitudes, as 16 bytes.
fn table(abs: bool, off: i8) -> [i8; 16] {
    let mut t = [0i8; 16];
    for (o, &v) in t.iter_mut().zip(&IQ4NL_VALUES) {
        *o = if abs { v.abs() } else { v.wrapping_add(off) };
    }
    t
}

/// Four activation bytes at `p` in every i32 lane.
#[inline(always)]
unsafe fn bcast4(p: *const i32) -> __m256i {
    // SAFETY: 4 readable bytes (the caller's contract).
    unsafe { _mm256_set1_epi32(p.read_unaligned()) }
}

/// The float factors of one block position for a vector of rows.
struct Scales<V: Width> {
    dw: V::F,
    mw: V::F,
    sc_lo: V::I,
    sc_hi: V::I,
}

/// `dw`, `mw` (and Q6_K's half scales) of block `b` at position record `sp` of a group
/// whose super-block scales start at `ss`, for the rows of half `h` (zmm: `h = 0`, the
/// whole group).
#[inline(always)]
unsafe fn scales<V: Width, B: BlockTy>(
    sp: *const u8,
    ss: *const u8,
    b: usize,
    h: usize,
) -> Scales<V> {
    // SAFETY: the position and super-block records exist (the caller's contract).
    unsafe {
        let zero = V::zero_i();
        let mut s = Scales::<V> {
            dw: V::zero_f(),
            mw: V::zero_f(),
            sc_lo: zero,
            sc_hi: zero,
        };
        let sb = b / LANES;
        // Half h's offset in a record of f16 per row (hf) and of a byte per row (hc).
        let (hf, hc) = (2 * V::ROWS * h, V::ROWS * h);
        match B::SC {
            ScaleKind::D => s.dw = V::h16(sp.add(hf)),
            ScaleKind::DMin => (s.dw, s.mw) = (V::h16(sp.add(hf)), V::h16(sp.add(32 + hf))),
            ScaleKind::K45 => {
                let sup = ss.add(64 * sb);
                let sc = V::u8_f32(sp.add(hc));
                let m = V::u8_f32(sp.add(16 + hc));
                s.dw = V::mul(V::h16(sup.add(hf)), sc);
                s.mw = V::neg(V::mul(V::h16(sup.add(32 + hf)), m));
            }
            ScaleKind::K6 => {
                s.dw = V::h16(ss.add(32 * sb + hf));
                s.sc_lo = V::i8_i32(sp.add(hc));
                s.sc_hi = V::i8_i32(sp.add(16 + hc));
            }
        }
        s
    }
}

/// The rows' levels of one block position as u8 vectors, before IQ4_NL's table:
/// `lo[k]` pairs with activation bytes `4k..4k+4`, `hi[k]` with `16+4k..`; the
/// nibbles or-ed with the fifth bit or the top two bits from their planes.
#[inline(always)]
unsafe fn levels<V: Width, B: BlockTy>(wp: *const u8) -> ([V::I; 4], [V::I; 4]) {
    // SAFETY: the position's quant record (QB bytes) exists.
    unsafe {
        let (mut lo, mut hi) = nibbles::<V>(wp);
        if B::BITS == 5 {
            let qh = V::load_q(wp.add(256));
            let m = V::splat8(0x10);
            lo[0] = V::or_and(lo[0], V::slli::<4>(qh), m);
            lo[1] = V::or_and(lo[1], V::slli::<3>(qh), m);
            lo[2] = V::or_and(lo[2], V::slli::<2>(qh), m);
            lo[3] = V::or_and(lo[3], V::slli::<1>(qh), m);
            hi[0] = V::or_and(hi[0], qh, m);
            hi[1] = V::or_and(hi[1], V::srli::<1>(qh), m);
            hi[2] = V::or_and(hi[2], V::srli::<2>(qh), m);
            hi[3] = V::or_and(hi[3], V::srli::<3>(qh), m);
        }
        if B::BITS == 6 {
            let m = V::splat8(0x30);
            for (plane, v) in [(256, &mut lo), (320, &mut hi)] {
                let q = V::load_q(wp.add(plane));
                v[0] = V::or_and(v[0], V::slli::<4>(q), m);
                v[1] = V::or_and(v[1], V::slli::<2>(q), m);
                v[2] = V::or_and(v[2], q, m);
                v[3] = V::or_and(v[3], V::srli::<2>(q), m);
            }
        }
        (lo, hi)
    }
}

/// The 16 rows' levels of one block position (see [`levels`]; IQ4_NL: `T + 128`).
#[inline(always)]
unsafe fn levels512<B: BlockTy>(wp: *const u8) -> ([__m512i; 4], [__m512i; 4]) {
    // SAFETY: the position's quant record (QB bytes, 64-aligned) exists.
    unsafe {
        let (mut lo, mut hi) = levels::<Z, B>(wp);
        if B::TABLE {
            let t = table(false, -128);
            let tab = _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i));
            for k in 0..4 {
                lo[k] = _mm512_shuffle_epi8(tab, lo[k]);
                hi[k] = _mm512_shuffle_epi8(tab, hi[k]);
            }
        }
        (lo, hi)
    }
}

/// Lane `l`'s accumulators (blocks `l, l + 8, …` of one group) for `T` tokens.
#[inline(always)]
unsafe fn lane512<B: BlockTy, const T: usize>(
    grp: *const u8,
    lay: &GroupLayout,
    x: &ActTile,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    let cols = nb * QK;
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see the zmm `Job::group`): a whole group, T tokens of nb blocks.
    unsafe {
        let (xq, xd, xs, xh) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.h.as_ptr());
        let ss = grp.add(lay.supers_at);
        let mut acc = [_mm512_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = grp.add(pos * lay.quant_bytes);
            let sp = grp.add(lay.scales_at + pos * lay.pos_scale_bytes);
            if T == 1 {
                prefetch(wp, lay.quant_bytes);
                prefetch(sp, lay.pos_scale_bytes);
            }
            let (lo, hi) = levels512::<B>(wp);
            let sc = scales::<Z, B>(sp, ss, b, 0);
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add(t * cols + b * QK) as *const i32;
                let s = *xs.add(t * nb + b);
                let (c0, c1) = if B::SC == ScaleKind::K6 {
                    let h = *xh.add(t * nb + b);
                    (-32 * h, -32 * (s - h))
                } else {
                    (-B::OFF * s, 0)
                };
                // Two chains: the block's halves.
                let (i0, i1) = dot_chains(c0, c1, &lo, &hi, xb);
                let isum = if B::SC == ScaleKind::K6 {
                    _mm512_add_epi32(
                        _mm512_mullo_epi32(i0, sc.sc_lo),
                        _mm512_mullo_epi32(i1, sc.sc_hi),
                    )
                } else {
                    _mm512_add_epi32(i0, i1)
                };
                let dx = *xd.add(t * nb + b);
                *acc_t = float_step::<Z>(B::AFFINE, *acc_t, sc.dw, sc.mw, isum, dx, s);
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// A packed view of block type `B` with its tokens and outputs, for the kernels of
/// width `V`.
struct Job<'a, B, V> {
    p: &'a PackedView<'a>,
    lay: GroupLayout,
    x: &'a ActTile<'a>,
    y: *mut f32,
    ld: usize,
    ty: PhantomData<(B, V)>,
}

impl<'a, B: BlockTy, V> Job<'a, B, V> {
    #[inline(always)]
    fn new(p: &'a PackedView<'a>, g1: usize, x: &'a ActTile<'a>, y: *mut f32, ld: usize) -> Self {
        let lay = GroupLayout::of(B::W, p.nb);
        debug_assert!(p.q.len() >= g1 * lay.group);
        Job {
            p,
            lay,
            x,
            y,
            ld,
            ty: PhantomData,
        }
    }
}

/// One group of 16 rows against `T` tokens; writes `y[t·ld + 16g + j]` for real rows.
impl<B: BlockTy> GroupFn for Job<'_, B, Z> {
    #[inline(always)]
    unsafe fn group<const T: usize>(&self, g: usize, _t0: usize) {
        let (p, lay, x) = (self.p, &self.lay, self.x);
        // SAFETY: g < groups, `x` holds T tokens of nb blocks, y has T rows of ld ≥ rows.
        unsafe {
            let grp = p.q.as_ptr().add(g * lay.group);
            let r = lane_tree!(|l: usize| lane512::<B, T>(grp, lay, x, p.nb, l), add512);
            store16(&r, p.rows, g, self.y, self.ld);
        }
    }
}

/// Packed block type `B`, AVX-512 VNNI (see `kernels::PackedFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI, AVX2 and F16C; `p` is a packed view of type `B`,
/// `g0 ≤ g1 ≤ groups`, `x` holds 1..=8 tokens of `p.nb` blocks, `y[t·ld + r]` is
/// writable for every token `t` and row `r < p.rows` of the groups.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vnni")]
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
    debug_assert!(x.q.len() == nt * p.nb * QK && x.s.len() == nt * p.nb && x.h.len() == x.s.len());
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { all_tokens(&Job::<B, Z>::new(p, g1, x, y, ld), g0, g1, nt) }
}

/// Half `h`'s levels of one block position (see [`levels`]); IQ4_NL: `|T|` in the
/// first pair, `T` (for the sign) in the second.
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn levels256<B: BlockTy>(
    wp: *const u8,
    h: usize,
) -> ([__m256i; 4], [__m256i; 4], [__m256i; 4], [__m256i; 4]) {
    // SAFETY: the position's quant record (QB bytes) exists.
    unsafe {
        let (mut lo, mut hi) = levels::<Y, B>(wp.add(32 * h));
        let zero = _mm256_setzero_si256();
        let (mut slo, mut shi) = ([zero; 4], [zero; 4]);
        if B::TABLE {
            let (ta, ts) = (table(true, 0), table(false, 0));
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
    x: &ActTile,
    t0: usize,
    nb: usize,
    h: usize,
    l: usize,
) -> [__m256; T] {
    let cols = nb * QK;
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see the ymm `Job::group`).
    unsafe {
        let (xq, xd, xs, xh) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.h.as_ptr());
        let ss = grp.add(lay.supers_at);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = grp.add(pos * lay.quant_bytes);
            let sp = grp.add(lay.scales_at + pos * lay.pos_scale_bytes);
            if T == 1 && h == 0 {
                prefetch(wp, lay.quant_bytes);
                prefetch(sp, lay.pos_scale_bytes);
            }
            let (lo, hi, slo, shi) = levels256::<B>(wp, h);
            let sc = scales::<Y, B>(sp, ss, b, h);
            for (i, acc_t) in acc.iter_mut().enumerate() {
                let t = t0 + i;
                let xb = xq.add(t * cols + b * QK) as *const i32;
                let s = *xs.add(t * nb + b);
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
                } else if B::BITS == 5 {
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
                let isum = if B::SC == ScaleKind::K6 {
                    let hh = *xh.add(t * nb + b);
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
                let dx = *xd.add(t * nb + b);
                *acc_t = float_step::<Y>(B::AFFINE, *acc_t, sc.dw, sc.mw, isum, dx, s);
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// Tokens `t0..t0 + T` of group `g`, both halves.
impl<B: BlockTy> GroupFn for Job<'_, B, Y> {
    #[inline(always)]
    unsafe fn group<const T: usize>(&self, g: usize, t0: usize) {
        let (p, lay, x) = (self.p, &self.lay, self.x);
        // SAFETY: as for the zmm group, tokens t0..t0 + T.
        unsafe {
            let grp = p.q.as_ptr().add(g * lay.group);
            for h in 0..2 {
                let r0 = g * GROUP + 8 * h;
                if r0 >= p.rows {
                    break;
                }
                let r = lane_tree!(
                    |l: usize| lane256::<B, T>(grp, lay, x, t0, p.nb, h, l),
                    add256
                );
                store8(&r, p.rows, r0, t0, self.y, self.ld);
            }
        }
    }
}

/// Packed block type `B`, AVX2 (see `kernels::PackedFn`).
///
/// # Safety
/// The CPU has AVX2 and F16C; otherwise as [`vnni`].
#[target_feature(enable = "avx2,f16c")]
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
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { token_passes(&Job::<B, Y>::new(p, g1, x, y, ld), g0, g1, nt) }
}
