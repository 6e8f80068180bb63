//! Micro-kernels for packed weights ([`crate::kernels::packed`]). AVX-512 VNNI (Q8_0 and
//! Q4_0): one zmm lane per row of a 16-row group, so `isum_b` of 16 rows comes out of 8
//! `vpdpbusd` per block and token with no reduction across lanes. AVX2 (Q4_0 only, for
//! the AVX2 and AVX-512 BW tiers): the same with a ymm per half group, below.
//!
//! Per block and token: the accumulator starts at the offset correction (`−128·Σx` for
//! Q8_0, whose packed levels are `w + 128`; `−8·Σx` for Q4_0 nibbles), `vpdpbusd` adds
//! the 8 groups of 4 products with the activation bytes broadcast from memory, and the
//! float step is the contract's `acc += (dw·dx)·isum` on 16 rows at once. One lane's
//! accumulator runs over its blocks (b ≡ l mod 8, in order, which is how the packed
//! buffer stores them) before the next lane's; the 8 lane results are then combined by
//! the contract's tree. Exactness: `|Σ (w+128)·x| ≤ 32·255·127 < 2^31`.

use core::arch::x86_64::*;

use super::features::has_avx2;
use super::prefetch::PACKED;
use super::simd::{f16x16, f16x8};
use crate::format::wtype::{WType, QK};
use crate::kernels::acts::{ActTile, PACKED_TILE};
use crate::kernels::counters::{count, Op};
use crate::kernels::packed::{block_bytes, lane_start, PackedView, GROUP};
use crate::kernels::scalar::tiles::LANES;
use crate::kernels::tier::Tier;

/// How far ahead the packed kernels prefetch the weights they stream: with the hardware
/// prefetcher alone, generation was 30-40% slower (alternating runs of Gemma 3 and
/// SmolLM2 at Q4_0; docs/kernels.md). Every product of one token tile prefetches
/// ([`ActTile::stream`]), not only one-token decode: a server's batched decode step (a
/// token for each of 2-8 sessions) streams its weights from memory just the same, and
/// ran 1.3-1.8x faster with it (4- and 8-token prompts, llama1b and SmolLM2). A long
/// prefill's tiles reuse cached weights and skip it.
const PF_DIST: usize = 4096;

/// Prefetches the `bytes` (whole lines) that follow `p + ahead`, with stream `S`'s hint
/// (`x86::prefetch`: chosen per CPU; NTA on AMD for Q4_0 / Q8_0, as streamed weights are
/// read once per token). Into L1 (`T0`) decode ran 1.05-1.25x slower than into L2
/// (`T1`): 64 lines in flight per thread are more than L1's miss buffers hold.
#[inline(always)]
pub(super) fn prefetch<const S: u8>(p: *const u8, ahead: usize, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        super::prefetch::line::<S>(p.wrapping_add(ahead + line));
    }
}

/// The contract's tree over the 8 lanes, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 +
/// l7))`, with `$lane(l)` run just before its pair needs it. A macro, not a function
/// taking closures: the lanes must inline into the `#[target_feature]` kernels.
macro_rules! lane_tree {
    ($lane:expr, $add:expr) => {{
        let ln = &$lane;
        let h0 = $add($add(ln(0), ln(4)), $add(ln(2), ln(6)));
        let h1 = $add($add(ln(1), ln(5)), $add(ln(3), ln(7)));
        $add(h0, h1)
    }};
}
pub(super) use lane_tree;

/// `$body` with the const token count `$t` = `$nt`, one of 1..=8 (more than 8: 8), so
/// that each count gets its own monomorphized kernel.
macro_rules! with_tokens {
    ($nt:expr, const $t:ident => $body:expr) => {
        with_tokens!(@ $nt, $t, $body, 1 2 3 4 5 6 7)
    };
    (@ $nt:expr, $t:ident, $body:expr, $($n:literal)*) => {
        match $nt {
            $($n => {
                const $t: usize = $n;
                $body
            })*
            _ => {
                const $t: usize = 8;
                $body
            }
        }
    };
}
pub(super) use with_tokens;

/// Most tokens per inner pass of the AVX2 packed kernels: 8 weight vectors and 4
/// accumulators in 16 ymm.
pub(super) const PASS: usize = 4;

/// Tokens `0..$nt` in passes of at most [`PASS`]: per pass,
/// `$f::<$g.., T>($a..)` with `$t0` its first token and the const `T` its length.
macro_rules! in_passes {
    ($nt:expr, $t0:ident, $($f:ident)::+::<$($g:tt),*>($($a:expr),*)) => {{
        let nt = $nt;
        let mut $t0 = 0;
        while $t0 < nt {
            let n = (nt - $t0).min($crate::kernels::x86::packed::PASS);
            match n {
                1 => $($f)::+::<$($g,)* 1>($($a),*),
                2 => $($f)::+::<$($g,)* 2>($($a),*),
                3 => $($f)::+::<$($g,)* 3>($($a),*),
                _ => $($f)::+::<$($g,)* 4>($($a),*),
            }
            $t0 += n;
        }
    }};
}
pub(super) use in_passes;

/// The levels of one block position as u8 vectors of the width the intrinsics `$load`
/// .. `$or_and` work on (zmm or ymm): `lo[k]` pairs with activation bytes `4k..4k+4`,
/// `hi[k]` with `16+4k..`, the low and high nibbles of the 4 chunks at `$wp + 64k`,
/// or-ed with the fifth bit (`$bits` = 5) or the top two bits (6) from their planes at
/// `$wp + 256` (and `+ 320`); with `$bits` ≤ 3, the 2-bit fields `2k..2k+2` of the
/// planes at `$wp` (low half) and `$wp + 64` (high half), or-ed with bit 2 (3) from the
/// plane at `$wp + 128`. A macro for the two widths, whose shifts take their count as a
/// const of a different type.
macro_rules! levels {
    ($bits:expr, $wp:expr, $zero:expr, $load:ident, $set1:ident, $and:ident, $slli:ident, $srli:ident, $or_and:ident) => {{
        let wp = $wp;
        let (mut lo, mut hi) = ([$zero; 4], [$zero; 4]);
        if $bits <= 3 {
            let m2 = $set1(3);
            let (p0, p1) = ($load(wp as *const _), $load(wp.add(64) as *const _));
            (lo[0], hi[0]) = ($and(p0, m2), $and(p1, m2));
            (lo[1], hi[1]) = ($and($srli(p0, 2), m2), $and($srli(p1, 2), m2));
            (lo[2], hi[2]) = ($and($srli(p0, 4), m2), $and($srli(p1, 4), m2));
            (lo[3], hi[3]) = ($and($srli(p0, 6), m2), $and($srli(p1, 6), m2));
            if $bits == 3 {
                let q = $load(wp.add(128) as *const _);
                let m = $set1(4);
                lo[0] = $or_and(lo[0], $slli(q, 2), m);
                lo[1] = $or_and(lo[1], $slli(q, 1), m);
                lo[2] = $or_and(lo[2], q, m);
                lo[3] = $or_and(lo[3], $srli(q, 1), m);
                hi[0] = $or_and(hi[0], $srli(q, 2), m);
                hi[1] = $or_and(hi[1], $srli(q, 3), m);
                hi[2] = $or_and(hi[2], $srli(q, 4), m);
                hi[3] = $or_and(hi[3], $srli(q, 5), m);
            }
        } else {
            let m4 = $set1(0x0F);
            for k in 0..4 {
                let v = $load(wp.add(64 * k) as *const _);
                lo[k] = $and(v, m4);
                hi[k] = $and($srli(v, 4), m4);
            }
        }
        if $bits == 5 {
            let qh = $load(wp.add(256) as *const _);
            let m = $set1(0x10);
            lo[0] = $or_and(lo[0], $slli(qh, 4), m);
            lo[1] = $or_and(lo[1], $slli(qh, 3), m);
            lo[2] = $or_and(lo[2], $slli(qh, 2), m);
            lo[3] = $or_and(lo[3], $slli(qh, 1), m);
            hi[0] = $or_and(hi[0], qh, m);
            hi[1] = $or_and(hi[1], $srli(qh, 1), m);
            hi[2] = $or_and(hi[2], $srli(qh, 2), m);
            hi[3] = $or_and(hi[3], $srli(qh, 3), m);
        }
        if $bits == 6 {
            let m = $set1(0x30);
            for (plane, v) in [(256, &mut lo), (320, &mut hi)] {
                let q = $load(wp.add(plane) as *const _);
                v[0] = $or_and(v[0], $slli(q, 4), m);
                v[1] = $or_and(v[1], $slli(q, 2), m);
                v[2] = $or_and(v[2], q, m);
                v[3] = $or_and(v[3], $srli(q, 2), m);
            }
        }
        (lo, hi)
    }};
}

/// [`levels!`] on zmm (the packed records are 64-byte aligned).
///
/// # Safety
/// The record at `wp` holds the 4 chunks and the planes `bits` reads; AVX-512 F/BW.
#[inline(always)]
pub(super) unsafe fn unpack512(bits: u32, wp: *const u8) -> ([__m512i; 4], [__m512i; 4]) {
    // SAFETY: the caller's contract.
    unsafe {
        levels!(
            bits,
            wp,
            _mm512_setzero_si512(),
            _mm512_load_si512,
            _mm512_set1_epi8,
            _mm512_and_si512,
            _mm512_slli_epi16,
            _mm512_srli_epi16,
            or_and512
        )
    }
}

/// [`levels!`] on ymm (unaligned loads: a half block starts 32 bytes in).
///
/// # Safety
/// As [`unpack512`]; AVX2.
#[inline(always)]
pub(super) unsafe fn unpack256(bits: u32, wp: *const u8) -> ([__m256i; 4], [__m256i; 4]) {
    // SAFETY: the caller's contract.
    unsafe {
        levels!(
            bits,
            wp,
            _mm256_setzero_si256(),
            _mm256_loadu_si256,
            _mm256_set1_epi8,
            _mm256_and_si256,
            _mm256_slli_epi16,
            _mm256_srli_epi16,
            or_and256
        )
    }
}

/// `a | (b & m)`.
#[target_feature(enable = "avx512f")]
#[inline]
fn or_and512(a: __m512i, b: __m512i, m: __m512i) -> __m512i {
    _mm512_or_si512(a, _mm512_and_si512(b, m))
}

/// `a | (b & m)`.
#[target_feature(enable = "avx2")]
#[inline]
fn or_and256(a: __m256i, b: __m256i, m: __m256i) -> __m256i {
    _mm256_or_si256(a, _mm256_and_si256(b, m))
}

/// `(i0 + Σ_k lo[k]·x[4k..4k+4], i1 + Σ_k hi[k]·x[16+4k..])` for 16 rows by `vpdpbusd`,
/// the activation bytes broadcast from `xb`: two chains of 4 halve the dependent
/// `vpdpbusd` latency.
///
/// # Safety
/// 32 readable bytes at `xb`; the caller has AVX-512 VNNI.
#[inline(always)]
pub(super) unsafe fn dpbusd_block(
    mut i0: __m512i,
    mut i1: __m512i,
    lo: &[__m512i; 4],
    hi: &[__m512i; 4],
    xb: *const i32,
) -> (__m512i, __m512i) {
    // SAFETY: the function's contract.
    unsafe {
        for k in 0..4 {
            let x0 = _mm512_set1_epi32(xb.add(k).read_unaligned());
            let x1 = _mm512_set1_epi32(xb.add(4 + k).read_unaligned());
            i0 = _mm512_dpbusd_epi32(i0, lo[k], x0);
            i1 = _mm512_dpbusd_epi32(i1, hi[k], x1);
        }
    }
    (i0, i1)
}

/// `a[t] + b[t]` for every token (a loop, not `array::from_fn`, whose closure would
/// be a function of its own).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn add512<const T: usize>(mut a: [__m512; T], b: [__m512; T]) -> [__m512; T] {
    for (x, y) in a.iter_mut().zip(b) {
        *x = _mm512_add_ps(*x, y);
    }
    a
}

/// `a[t] + b[t]` for every token (as [`add512`]).
#[target_feature(enable = "avx")]
#[inline]
pub(super) fn add256<const T: usize>(mut a: [__m256; T], b: [__m256; T]) -> [__m256; T] {
    for (x, y) in a.iter_mut().zip(b) {
        *x = _mm256_add_ps(*x, y);
    }
    a
}

/// Writes group `g`'s 16 row results `r[t]` to `y[t·ld + 16g + j]`, real rows only.
///
/// # Safety
/// `y[t·ld + r]` writable for every token and real row `r < rows` of the group;
/// AVX-512 F.
#[inline(always)]
pub(super) unsafe fn store16<const T: usize>(
    r: [__m512; T],
    rows: usize,
    g: usize,
    y: *mut f32,
    ld: usize,
) {
    let r0 = g * GROUP;
    let valid = (rows - r0).min(GROUP);
    let mask: __mmask16 = if valid == GROUP {
        !0
    } else {
        (1u16 << valid) - 1
    };
    for (t, v) in r.iter().enumerate() {
        // SAFETY: the function's contract; masked-off rows are not written.
        unsafe { _mm512_mask_storeu_ps(y.add(t * ld + r0), mask, *v) };
    }
}

/// Writes the 8 row results `r[i]` of the half group from row `r0` for tokens
/// `t0 + i` to `y[(t0 + i)·ld + r0 + j]`, real rows only.
///
/// # Safety
/// `r0 < rows`; those outputs are writable for the real rows; AVX.
#[inline(always)]
pub(super) unsafe fn store8<const T: usize>(
    r: [__m256; T],
    rows: usize,
    r0: usize,
    t0: usize,
    y: *mut f32,
    ld: usize,
) {
    let valid = (rows - r0).min(8);
    // SAFETY: the function's contract; a part half is copied row by row.
    unsafe {
        for (i, v) in r.iter().enumerate() {
            let out = y.add((t0 + i) * ld + r0);
            if valid == 8 {
                _mm256_storeu_ps(out, *v);
            } else {
                let mut tmp = [0f32; 8];
                _mm256_storeu_ps(tmp.as_mut_ptr(), *v);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, valid);
            }
        }
    }
}

/// Lane `l`'s accumulators for `T` tokens: blocks `l, l + 8, …` of one group, which the
/// packed buffer stores from block position `pos` on. All zero when `l ≥ nb`.
#[inline(always)]
unsafe fn lane<const IS_Q4: bool, const F16: bool, const T: usize>(
    qg: *const u8,
    sg: *const u8,
    x: &ActTile,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    let bb = block_bytes(if IS_Q4 { WType::Q4_0 } else { WType::Q8_0 });
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `group`): blocks of this group and T tokens.
    unsafe {
        // The tile's tokens of one block are adjacent (`ActTile::iq`).
        let (xq, xd, xs) = (x.iq.as_ptr(), x.id.as_ptr(), x.is.as_ptr());
        let mut acc = [_mm512_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = qg.add(pos * bb);
            if x.stream {
                prefetch::<PACKED>(wp, PF_DIST, bb);
            }
            let dw = if F16 {
                f16x16(sg.add(pos * 32))
            } else {
                _mm512_loadu_ps(sg.add(pos * 64) as *const f32)
            };
            // The block's 16 rows as u8 vectors: lo[k] pairs with x[4k..4k+4] and
            // hi[k] with x[16+4k..] (Q4: low and high nibbles of chunk k; Q8: chunks k
            // and 4 + k).
            let (lo, hi) = if IS_Q4 {
                unpack512(4, wp)
            } else {
                let mut w = [_mm512_setzero_si512(); 8];
                for (k, wk) in w.iter_mut().enumerate() {
                    *wk = _mm512_load_si512(wp.add(64 * k) as *const _);
                }
                ([w[0], w[1], w[2], w[3]], [w[4], w[5], w[6], w[7]])
            };
            let (xq, xd, xs) = (xq.add(b * T * QK), xd.add(b * T), xs.add(b * T));
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add(t * QK) as *const i32;
                let s = *xs.add(t);
                let corr = if IS_Q4 { -8 * s } else { -128 * s };
                let (i0, i1) = dpbusd_block(
                    _mm512_set1_epi32(corr),
                    _mm512_setzero_si512(),
                    &lo,
                    &hi,
                    xb,
                );
                let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(t)));
                *acc_t = _mm512_add_ps(*acc_t, _mm512_mul_ps(d, isum));
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// One group of 16 rows against `T` tokens; writes `y[t·ld + 16g + j]` for real rows;
/// the lanes combined by `lane_tree!`.
#[inline(always)]
unsafe fn group<const IS_Q4: bool, const F16: bool, const T: usize>(
    p: &PackedView,
    g: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    let nb = p.nb;
    let bb = block_bytes(if IS_Q4 { WType::Q4_0 } else { WType::Q8_0 });
    let ss = if F16 { 2 } else { 4 };
    // SAFETY: the caller guarantees g < groups, `x` holds T tokens of nb blocks, and y
    // has room for T rows of ld ≥ rows outputs; every pointer below stays inside those.
    unsafe {
        let qg = p.q.as_ptr().add(g * nb * bb);
        let sg = p.s.as_ptr().add(g * nb * GROUP * ss);
        let r = lane_tree!(|l: usize| lane::<IS_Q4, F16, T>(qg, sg, x, nb, l), add512);
        store16(r, p.rows, g, y, ld);
    }
}

/// Token-count and scale-type dispatch, then groups `g0..g1`.
#[inline(always)]
unsafe fn any<const IS_Q4: bool>(
    p: &PackedView,
    g0: usize,
    g1: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    let nt = x.d.len() / p.nb;
    debug_assert!((1..=PACKED_TILE).contains(&nt));
    debug_assert!(x.q.len() == nt * p.nb * QK && x.s.len() == nt * p.nb);
    debug_assert!(x.iq.len() == x.q.len() && x.id.len() == x.d.len() && x.is.len() == x.d.len());
    // SAFETY: forwarded caller contract.
    unsafe {
        if p.f16 {
            with_tokens!(nt, const T => for g in g0..g1 {
                group::<IS_Q4, true, T>(p, g, x, y, ld)
            })
        } else {
            with_tokens!(nt, const T => for g in g0..g1 {
                group::<IS_Q4, false, T>(p, g, x, y, ld)
            })
        }
    }
}

/// Packed Q8_0, AVX-512 VNNI (see `table::PackedFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI; `p` is a Q8_0 packed view, `g0 ≤ g1 ≤
/// groups`, `x` holds 1..=8 tokens of `p.nb` blocks, `y[t·ld + r]` is writable for
/// every token `t` and row `r < p.rows` of the groups.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn q8_vnni(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx512Vnni, Op::Packed);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { any::<false>(p, g0, g1, x, y, ld) }
}

/// Packed Q4_0, AVX-512 VNNI (see `table::PackedFn`).
///
/// # Safety
/// As [`q8_vnni`], for a Q4_0 packed view.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn q4_vnni(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx512Vnni, Op::Packed);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { any::<true>(p, g0, g1, x, y, ld) }
}

/// The AVX2 packed kernel: Q4_0 (F16C for f16 scales).
pub fn has_avx2_packed() -> bool {
    has_avx2() && is_x86_feature_detected!("f16c")
}

/// AVX2, Q4_0: a group as two halves of 8 rows (a ymm lane per row). Per block, half
/// and token: 8 `vpmaddubsw` of the nibbles (u8) with the broadcast activation bytes
/// (s8), summed in i16, which is exact: each lane adds 16 products of at most 15·127,
/// ≤ 30480 < 2^15; one `vpmaddwd` by 1 gives the row's `Σ nibble·x`, then `− 8·Σx`.
/// The float step and the lane order are the VNNI kernel's.
mod avx2q4 {
    use super::*;

    /// Lane `l` of half `h` of one group for `T` tokens (see [`super::lane`]).
    #[inline(always)]
    unsafe fn lane<const F16: bool, const T: usize>(
        qg: *const u8,
        sg: *const u8,
        x: &ActTile,
        t0: usize,
        nb: usize,
        h: usize,
        l: usize,
    ) -> [__m256; T] {
        let nt = x.id.len() / nb;
        let bb = block_bytes(WType::Q4_0);
        let mut pos = lane_start(nb, l);
        // SAFETY: the caller's contract (see `group`): blocks of this group, tokens
        // t0..t0 + T of `x`.
        unsafe {
            // The tile's tokens of one block are adjacent (`ActTile::iq`).
            let (xq, xd, xs) = (x.iq.as_ptr(), x.id.as_ptr(), x.is.as_ptr());
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); T];
            let mut b = l;
            while b < nb {
                let wp = qg.add(pos * bb + 32 * h);
                if x.stream && h == 0 {
                    // The first half's pass reads every line of the block.
                    prefetch::<PACKED>(wp, PF_DIST, bb);
                }
                let dw = if F16 {
                    f16x8(sg.add(pos * 32 + 16 * h))
                } else {
                    _mm256_loadu_ps(sg.add(pos * 64 + 32 * h) as *const f32)
                };
                let (lo, hi) = unpack256(4, wp);
                let at = b * nt + t0;
                let (xq, xd, xs) = (xq.add(at * QK), xd.add(at), xs.add(at));
                for (i, acc_t) in acc.iter_mut().enumerate() {
                    let xb = xq.add(i * QK) as *const i32;
                    // Chunks' low nibbles with x[0..16], then the high ones with x[16..32].
                    let mut s16 = _mm256_setzero_si256();
                    for (k, wk) in lo.iter().enumerate() {
                        let xv = _mm256_set1_epi32(xb.add(k).read_unaligned());
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wk, xv));
                    }
                    for (k, wk) in hi.iter().enumerate() {
                        let xv = _mm256_set1_epi32(xb.add(4 + k).read_unaligned());
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wk, xv));
                    }
                    let corr = _mm256_set1_epi32(-8 * *xs.add(i));
                    let isum = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), corr);
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xd.add(i)));
                    *acc_t = _mm256_add_ps(*acc_t, _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)));
                }
                pos += 1;
                b += LANES;
            }
            acc
        }
    }

    /// Tokens `t0..t0 + T` of group `g`, both halves.
    #[inline(always)]
    pub(super) unsafe fn group<const F16: bool, const T: usize>(
        p: &PackedView,
        g: usize,
        x: &ActTile,
        t0: usize,
        y: *mut f32,
        ld: usize,
    ) {
        let nb = p.nb;
        let ss = if F16 { 2 } else { 4 };
        // SAFETY: as in `super::group`.
        unsafe {
            let qg = p.q.as_ptr().add(g * nb * block_bytes(WType::Q4_0));
            let sg = p.s.as_ptr().add(g * nb * GROUP * ss);
            for h in 0..2 {
                let r0 = g * GROUP + 8 * h;
                if r0 >= p.rows {
                    break;
                }
                let r = lane_tree!(|l: usize| lane::<F16, T>(qg, sg, x, t0, nb, h, l), add256);
                store8(r, p.rows, r0, t0, y, ld);
            }
        }
    }
}

/// Packed Q4_0, AVX2 (see `table::PackedFn`).
///
/// # Safety
/// The CPU has AVX2 and F16C; otherwise as [`q8_vnni`], for a Q4_0 packed view.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q4_avx2(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx2, Op::Packed);
    debug_assert!(x.q.len() == x.d.len() * QK && x.s.len() == x.d.len());
    debug_assert!(x.iq.len() == x.q.len() && x.id.len() == x.d.len() && x.is.len() == x.d.len());
    let nt = x.d.len() / p.nb;
    // SAFETY: forwarded caller contract; features enabled on this function; each pass's
    // tokens exist. Groups `g0..g1`, all tokens of `x`, in passes of at most [`PASS`].
    unsafe {
        if p.f16 {
            for g in g0..g1 {
                in_passes!(nt, t0, avx2q4::group::<true>(p, g, x, t0, y, ld))
            }
        } else {
            for g in g0..g1 {
                in_passes!(nt, t0, avx2q4::group::<false>(p, g, x, t0, y, ld))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::packed::LANE_VISIT;

    #[test]
    fn lane_tree_runs_the_lanes_in_the_packed_order() {
        // The buffer stores the lanes in the order `lane_tree!` runs them, so that the
        // kernels read a group front to back (and prefetch what they read next).
        let seen = std::cell::RefCell::new(Vec::new());
        let sum = lane_tree!(
            |l: usize| {
                seen.borrow_mut().push(l);
                l
            },
            |a: usize, b: usize| a + b
        );
        assert_eq!(sum, 28);
        assert_eq!(seen.into_inner(), LANE_VISIT);
    }
}
