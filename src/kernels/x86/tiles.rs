//! The x86 tiles of the Q8_0 / Q4_0 matrix products (the row-major micro-kernels),
//! bit-identical to `scalar::tiles`: AVX2, AVX-512 BW and AVX-512 VNNI.
//!
//! AVX2: a block of 32 levels fills one ymm. The s8×s8 dot uses the sign trick:
//! `vpmaddubsw(|w|, sign(x, w))` (u8×s8, pair sums ≤ 2·127·127, no saturation), then
//! `vpmaddwd` by ones gives 8 exact i32 partials. Eight blocks are reduced together with
//! `vphaddd` into one ymm holding `isum_b` for blocks `b..b+8` — exactly the contract's
//! 8 lanes, so the float step `acc += (dw·dx)·isum` is one vector mul, mul, add.
//! Q4_0 skips the sign trick: the nibbles (u8, 0..15) go straight into `vpmaddubsw`
//! against the activations' Q4 arrangement, and `isum = Σ nibble·x − 8·Σx` with the
//! block sums kept in `QActs`.
//!
//! BW tier, Q8_0: two blocks fill one zmm. Sign trick: `u = |w|` as u8, `s = x` negated
//! where `w < 0` (a masked `0 − x`; x is never −128), then `vpmaddwd(vpmaddubsw(u, s), 1)`
//! gives 8 exact i32 partials per block. Four zmm (8 blocks) are reduced by shuffles into
//! one ymm of `isum_b` for blocks `b..b+8`, the contract's 8 lanes, and the float step
//! runs on that ymm like the AVX2 tier. BW tier, Q4_0: the VNNI layout below with
//! `vpmaddubsw` + `vpmaddwd` in place of `vpdpbusd` (nibble sums cannot saturate).
//!
//! VNNI tier: `vpdpbusd` (u8 × s8, i32 sums of 4) with an offset instead of the sign
//! trick, 16 blocks per step. Q8_0: `Σ (w+128)·x − 128·Σx`; Q4_0: `Σ nibble·x − 8·Σx`,
//! with `Σx` per block precomputed in `QActs` (exact in i32: |Σ (w+128)·x| ≤ 32·255·127).
//! Both read activations in `QActs`' Q4 arrangement (per 4 blocks: all first halves,
//! then all second halves), so a Q4_0 64-byte load of 4 blocks needs only `and`/`shift`
//! and Q8_0 two `vshufi64x2` per 4 blocks to pair with it. The isum vector covers blocks
//! `b..b+16`: lanes 0..8 are added to the contract's 8 accumulators, then lanes 8..16.

use core::arch::x86_64::*;

use super::simd::{hsum8, load_scales, reduce_lanes};
use crate::format::wtype::QK;
use crate::kernels::acts::{q4_layout_len, ActTile};
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::tiles::LANES;
use crate::kernels::tier::Tier;

/// How one weight block becomes 32 signed levels in a ymm.
pub(crate) trait WFormat {
    /// Bytes per block.
    const BYTES: usize;
    /// # Safety
    /// `p` points to `BYTES` readable bytes; AVX2 available.
    unsafe fn load(p: *const u8) -> __m256i;
}

pub(crate) struct Q8;

impl WFormat for Q8 {
    const BYTES: usize = QK;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        // SAFETY: 32 readable bytes per the trait contract.
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }
}

/// 8 i32 partial sums of `w·x` for one block, given `u = |w|`.
#[target_feature(enable = "avx2")]
#[inline]
fn block_dot(u: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let s = _mm256_sign_epi8(x, w);
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// One group of `k` (= 8 when `FULL`) blocks starting at block `b`, for `T` tokens.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group<F: WFormat, const T: usize, const FULL: bool>(
    wq: *const u8,
    wd: *const f32,
    xq: *const i8,
    xd: *const f32,
    nb: usize,
    b: usize,
    k: usize,
    acc: &mut [__m256; T],
) {
    let k = if FULL { LANES } else { k };
    // SAFETY: blocks b..b+k exist in the row and in each token (the caller's contract).
    unsafe {
        let zero = _mm256_setzero_si256();
        let mut w = [zero; 8];
        for (j, wj) in w.iter_mut().enumerate().take(k) {
            *wj = F::load(wq.add((b + j) * F::BYTES));
        }
        let dw = load_scales(wd.add(b), k);
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let mut v = [zero; 8];
            for j in 0..k {
                let x = _mm256_loadu_si256(xq.add((t * nb + b + j) * QK) as *const __m256i);
                v[j] = block_dot(_mm256_abs_epi8(w[j]), w[j], x);
            }
            let isum = _mm256_cvtepi32_ps(hsum8(&v));
            let dx = load_scales(xd.add(t * nb + b), k);
            *acc_t = _mm256_add_ps(*acc_t, _mm256_mul_ps(_mm256_mul_ps(dw, dx), isum));
        }
    }
}

/// One row's `nb` blocks into `$t` token accumulators, a group of 8 blocks at a time,
/// then each token's 8 lanes reduced by the contract's tree into `$out`. `$group` runs
/// once per group with its first block `$b`, its block count `$k` (the last group's may
/// be less than 8), the const `$full` (`$k` is 8) and the accumulators `$acc`. A macro,
/// as [`each_row!`], so that the groups inline into the `#[target_feature]` caller.
macro_rules! row_groups {
    ($t:expr, $nb:expr, $out:expr, |$b:ident, $k:ident, $full:ident, $acc:ident| $group:expr) => {{
        let nb: usize = $nb;
        let mut acc = [core::arch::x86_64::_mm256_setzero_ps(); $t];
        let full =
            nb / $crate::kernels::scalar::tiles::LANES * $crate::kernels::scalar::tiles::LANES;
        for $b in (0..full).step_by($crate::kernels::scalar::tiles::LANES) {
            const $full: bool = true;
            let ($k, $acc) = ($crate::kernels::scalar::tiles::LANES, &mut acc);
            $group;
        }
        if full < nb {
            const $full: bool = false;
            let ($b, $k, $acc) = (full, nb - full, &mut acc);
            $group;
        }
        for (o, a) in $out.iter_mut().zip(acc) {
            *o = $crate::kernels::x86::simd::reduce_lanes(a);
        }
    }};
}

/// One row against `T` tokens.
#[inline(always)]
unsafe fn tile<F: WFormat, const T: usize>(
    wq: &[u8],
    wd: &[f32],
    xq: &[i8],
    xd: &[f32],
    out: &mut [f32],
) {
    let nb = wd.len();
    debug_assert!(wq.len() == nb * F::BYTES && xq.len() == T * nb * QK && xd.len() == T * nb);
    debug_assert_eq!(out.len(), T);
    let (wp, dp, xp, xdp) = (wq.as_ptr(), wd.as_ptr(), xq.as_ptr(), xd.as_ptr());
    // SAFETY: the lengths above cover every block `group` reads.
    unsafe {
        row_groups!(T, nb, out, |b, k, FULL, acc| group::<F, T, FULL>(
            wp, dp, xp, xdp, nb, b, k, acc
        ))
    }
}

/// The row loop of `kernels::for_rows` as a macro, so the tile inlines into the
/// `#[target_feature]` function (a closure is a separate function).
macro_rules! each_row {
    ($rows:expr, $wq:expr, $wd:expr, $out:expr, |$q:ident, $d:ident, $o:ident| $call:expr) => {{
        let (rb, nb, nt) = ($wq.len() / $rows, $wd.len() / $rows, $out.len() / $rows);
        let it = $wq
            .chunks_exact(rb)
            .zip($wd.chunks_exact(nb))
            .zip($out.chunks_exact_mut(nt));
        for (($q, $d), $o) in it {
            // SAFETY: the target features are enabled; slice lengths per `TileFn`.
            unsafe { $call }
        }
    }};
}

/// [`each_row!`] for a tile of `out.len() / rows` ≤
/// [`TILE_TOKENS`](crate::kernels::acts::TILE_TOKENS) tokens, the count
/// a const `$n` in `$call`: each count gets its own monomorphized tile, inlined into
/// the caller.
macro_rules! each_row_of_tile {
    ($rows:expr, $wq:expr, $wd:expr, $out:expr, |$q:ident, $d:ident, $o:ident, $n:ident| $call:expr) => {{
        let nt = $out.len() / $rows;
        debug_assert!(nt <= $crate::kernels::acts::TILE_TOKENS);
        match nt {
            0 => {}
            1 => {
                const $n: usize = 1;
                each_row!($rows, $wq, $wd, $out, |$q, $d, $o| $call)
            }
            2 => {
                const $n: usize = 2;
                each_row!($rows, $wq, $wd, $out, |$q, $d, $o| $call)
            }
            3 => {
                const $n: usize = 3;
                each_row!($rows, $wq, $wd, $out, |$q, $d, $o| $call)
            }
            _ => {
                const $n: usize = 4;
                each_row!($rows, $wq, $wd, $out, |$q, $d, $o| $call)
            }
        }
    }};
}

/// The rows of a block type (their scales inside the blocks: no `wd`) against a tile of
/// `out.len() / rows` (1..=[`TILE_TOKENS`](crate::kernels::acts::TILE_TOKENS)) tokens:
/// `$call` per row with its bytes `$q` and outputs `$o`, the count a const `$n`, each
/// count monomorphized and inlined into the `#[target_feature]` caller (as
/// [`each_row_of_tile!`]).
macro_rules! block_rows_of_tile {
    ($rows:expr, $wq:expr, $out:expr, |$q:ident, $o:ident, $n:ident| $call:expr) => {{
        let nt = $out.len() / $rows;
        debug_assert!((1..=$crate::kernels::acts::TILE_TOKENS).contains(&nt));
        let rb = $wq.len() / $rows;
        let it = $wq.chunks_exact(rb).zip($out.chunks_exact_mut(nt));
        match nt {
            1 => {
                const $n: usize = 1;
                for ($q, $o) in it {
                    $call
                }
            }
            2 => {
                const $n: usize = 2;
                for ($q, $o) in it {
                    $call
                }
            }
            3 => {
                const $n: usize = 3;
                for ($q, $o) in it {
                    $call
                }
            }
            _ => {
                const $n: usize = 4;
                for ($q, $o) in it {
                    $call
                }
            }
        }
    }};
}
pub(super) use block_rows_of_tile;

#[target_feature(enable = "avx2")]
unsafe fn tile_any<F: WFormat>(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    let (xq, xd) = (x.q, x.d);
    each_row_of_tile!(rows, wq, wd, out, |q, d, o, N| tile::<F, N>(
        q, d, xq, xd, o
    ));
}

/// Q8_0 tile kernel, AVX2 (see `table::TileFn`).
///
/// # Safety
/// The CPU has AVX2; slice lengths as `TileFn` says.
pub unsafe fn tile_q8_avx2(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: forwarded caller contract.
    unsafe { tile_any::<Q8>(rows, wq, wd, x, out) }
}

/// Q4_0 tile kernel, AVX2 (see `table::TileFn`).
///
/// # Safety
/// The CPU has AVX2; slice lengths as `TileFn` says.
pub unsafe fn tile_q4_avx2(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: forwarded caller contract.
    unsafe { tile_q4_any(rows, wq, wd, x, out) }
}

/// Q4_0, 8 blocks (`k` valid, = 8 when `FULL`) from block `b` (a multiple of 8) for `T`
/// tokens, against the activations' Q4 arrangement: a 32-byte load of 2 blocks gives
/// their low nibbles (elements 0..16) and high nibbles (16..32) as u8, which
/// `vpmaddubsw` pairs with the arranged s8 activations (pair sums ≤ 2·15·127, exact);
/// then `isum = Σ nibble·x − 8·Σx`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group_q4<const T: usize, const FULL: bool>(
    wq: *const u8,
    wd: *const f32,
    x: &ActTile,
    nb: usize,
    l4: usize,
    b: usize,
    k: usize,
    acc: &mut [__m256; T],
) {
    let k = if FULL { LANES } else { k };
    let pairs = k.div_ceil(2);
    // SAFETY: blocks b..b+k exist in the row (a last odd block is read with 16 bytes);
    // the arrangement has whole 128-byte groups per token, so its loads are inside.
    unsafe {
        let zero = _mm256_setzero_si256();
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut lo = [zero; 4];
        let mut hi = [zero; 4];
        for p in 0..pairs {
            let ptr = wq.add((b + 2 * p) * (QK / 2));
            let v = if 2 * p + 1 < k {
                _mm256_loadu_si256(ptr as *const __m256i)
            } else {
                _mm256_zextsi128_si256(_mm_loadu_si128(ptr as *const __m128i))
            };
            lo[p] = _mm256_and_si256(v, low);
            hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        let dw = load_scales(wd.add(b), k);
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let smask = _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), lanes);
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let mut v = [zero; 4];
            for p in 0..pairs {
                // Pair p of the group: 128-byte group (b + 2p)/4, offset 32·(p % 2).
                let base =
                    x.q4.as_ptr()
                        .add(t * l4 + (b + 2 * p) / 4 * 128 + 32 * (p % 2));
                let xl = _mm256_loadu_si256(base as *const __m256i);
                let xh = _mm256_loadu_si256(base.add(64) as *const __m256i);
                let s16 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo[p], xl),
                    _mm256_maddubs_epi16(hi[p], xh),
                );
                // 128-bit lane j: block b + 2p + j as 4 partials.
                v[p] = _mm256_madd_epi16(s16, ones);
            }
            // Elements [B0, B2, B4, B6, B1, B3, B5, B7] → natural order.
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let o = t * nb + b;
            let sx = _mm256_maskload_epi32(x.s.as_ptr().add(o), smask);
            let isum = _mm256_cvtepi32_ps(_mm256_sub_epi32(h, _mm256_slli_epi32(sx, 3)));
            let dx = load_scales(x.d.as_ptr().add(o), k);
            *acc_t = _mm256_add_ps(*acc_t, _mm256_mul_ps(_mm256_mul_ps(dw, dx), isum));
        }
    }
}

/// Q4_0: one row against `T` tokens (arranged activations).
#[inline(always)]
unsafe fn tile_q4x<const T: usize>(wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    let nb = wd.len();
    let l4 = q4_layout_len(nb * QK);
    debug_assert!(wq.len() == nb * QK / 2 && x.d.len() == T * nb && x.s.len() == T * nb);
    debug_assert!(x.q4.len() == T * l4 && out.len() == T);
    let (wp, dp) = (wq.as_ptr(), wd.as_ptr());
    // SAFETY: the lengths above cover every block `group_q4` reads.
    unsafe {
        row_groups!(T, nb, out, |b, k, FULL, acc| group_q4::<T, FULL>(
            wp, dp, x, nb, l4, b, k, acc
        ))
    }
}

#[target_feature(enable = "avx2")]
unsafe fn tile_q4_any(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    each_row_of_tile!(rows, wq, wd, out, |q, d, o, N| tile_q4x::<N>(q, d, x, o));
}

// AVX-512 BW and VNNI.

/// u8×s8 dot of groups of 4 bytes into i32 lanes, AVX-512 BW. Pair sums are at most
/// 2·127·127 (w ≠ −128 gives |w| ≤ 127; −128 gives 128·127 + 127·127, still < 2^15).
#[target_feature(enable = "avx512bw")]
#[inline]
fn dot_bw(u: __m512i, s: __m512i) -> __m512i {
    _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))
}

/// How weight blocks become signed levels in a zmm (two blocks) or its low half (one).
trait WPair {
    /// Bytes per block.
    const BYTES: usize;
    /// # Safety
    /// `2·BYTES` readable bytes at `p`; AVX-512 F/BW and AVX2 available.
    unsafe fn load2(p: *const u8) -> __m512i;
    /// # Safety
    /// `BYTES` readable bytes at `p`; the upper half of the result is zero.
    unsafe fn load1(p: *const u8) -> __m512i;
}

struct Q8Pair;

impl WPair for Q8Pair {
    const BYTES: usize = QK;
    #[inline(always)]
    unsafe fn load2(p: *const u8) -> __m512i {
        // SAFETY: 64 readable bytes (trait contract).
        unsafe { _mm512_loadu_si512(p as *const _) }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> __m512i {
        // SAFETY: 32 readable bytes (trait contract).
        unsafe { _mm512_zextsi256_si512(_mm256_loadu_si256(p as *const __m256i)) }
    }
}

/// From 4 zmm of 2 blocks × 8 partials each: the ymm of the 8 block sums, in order.
#[target_feature(enable = "avx512f")]
#[inline]
fn hsum4(v: &[__m512i; 4]) -> __m256i {
    // 128-bit lane k of s01 = block k (k < 4) as 4 partials; s23 = blocks 4..8.
    let s01 = _mm512_add_epi32(
        _mm512_shuffle_i32x4(v[0], v[1], 0x88),
        _mm512_shuffle_i32x4(v[0], v[1], 0xDD),
    );
    let s23 = _mm512_add_epi32(
        _mm512_shuffle_i32x4(v[2], v[3], 0x88),
        _mm512_shuffle_i32x4(v[2], v[3], 0xDD),
    );
    let (a, b) = (_mm512_castsi512_ps(s01), _mm512_castsi512_ps(s23));
    // Lane k: [block k: 2 partials, block 4+k: 2 partials].
    let t = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)),
        _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xDD)),
    );
    let tf = _mm512_castsi512_ps(t);
    // Lane k: [block k, block 4+k, (repeated)].
    let u = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_shuffle_ps(tf, tf, 0x88)),
        _mm512_castps_si512(_mm512_shuffle_ps(tf, tf, 0xDD)),
    );
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, u))
}

/// One group of `k` (= 8 when `FULL`) blocks starting at block `b`, for `T` tokens.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group512<F: WPair, const T: usize, const FULL: bool>(
    wq: *const u8,
    wd: *const f32,
    xq: *const i8,
    xd: *const f32,
    nb: usize,
    b: usize,
    k: usize,
    acc: &mut [__m256; T],
) {
    let k = if FULL { LANES } else { k };
    let pairs = k.div_ceil(2);
    // SAFETY: blocks b..b+k exist in the row and in each token (the caller's contract);
    // a last odd block is read with 32-byte (16 for Q4) loads only.
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut u = [zero; 4];
        let mut m: [__mmask64; 4] = [0; 4];
        for p in 0..pairs {
            let wp = wq.add((b + 2 * p) * F::BYTES);
            let w = if 2 * p + 1 < k {
                F::load2(wp)
            } else {
                F::load1(wp)
            };
            u[p] = _mm512_abs_epi8(w);
            m[p] = _mm512_movepi8_mask(w);
        }
        let dw = load_scales(wd.add(b), k);
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let mut v = [zero; 4];
            for p in 0..pairs {
                let xp = xq.add((t * nb + b + 2 * p) * QK);
                let x = if 2 * p + 1 < k {
                    _mm512_loadu_si512(xp as *const _)
                } else {
                    _mm512_zextsi256_si512(_mm256_loadu_si256(xp as *const __m256i))
                };
                v[p] = dot_bw(u[p], _mm512_mask_sub_epi8(x, m[p], zero, x));
            }
            let isum = _mm256_cvtepi32_ps(hsum4(&v));
            let dx = load_scales(xd.add(t * nb + b), k);
            *acc_t = _mm256_add_ps(*acc_t, _mm256_mul_ps(_mm256_mul_ps(dw, dx), isum));
        }
    }
}

/// One row against `T` tokens.
#[inline(always)]
unsafe fn tile512<F: WPair, const T: usize>(
    wq: &[u8],
    wd: &[f32],
    xq: &[i8],
    xd: &[f32],
    out: &mut [f32],
) {
    let nb = wd.len();
    debug_assert!(wq.len() == nb * F::BYTES && xq.len() == T * nb * QK && xd.len() == T * nb);
    debug_assert_eq!(out.len(), T);
    let (wp, dp, xp, xdp) = (wq.as_ptr(), wd.as_ptr(), xq.as_ptr(), xd.as_ptr());
    // SAFETY: the lengths above cover every block `group` reads.
    unsafe {
        row_groups!(T, nb, out, |b, k, FULL, acc| group512::<F, T, FULL>(
            wp, dp, xp, xdp, nb, b, k, acc
        ))
    }
}

/// Row loop and token-count dispatch, inlined into each tier's `#[target_feature]` wrapper.
#[inline(always)]
unsafe fn tile512_any<F: WPair>(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    let (xq, xd) = (x.q, x.d);
    each_row_of_tile!(rows, wq, wd, out, |q, d, o, N| tile512::<F, N>(
        q, d, xq, xd, o
    ));
}

macro_rules! tier_fn {
    ($name:ident, $fmt:ty, $features:literal, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The CPU has the tier's features; slice lengths as `table::TileFn` says.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
            count(Tier::Avx512, Op::Tile);
            // SAFETY: forwarded caller contract; features enabled on this function.
            unsafe { tile512_any::<$fmt>(rows, wq, wd, x, out) }
        }
    };
}

tier_fn!(
    tile_q8_bw,
    Q8Pair,
    "avx2,avx512f,avx512bw",
    "Q8_0 tile kernel, AVX-512 BW."
);

/// All-ones in the first `k` of 16 lanes.
#[inline(always)]
fn mask16(k: usize) -> __mmask16 {
    if k >= 16 {
        !0
    } else {
        (1u16 << k) - 1
    }
}

/// All-ones in the first `n` of 64 bytes.
#[inline(always)]
fn mask64(n: usize) -> __mmask64 {
    if n >= 64 {
        !0
    } else {
        (1u64 << n) - 1
    }
}

/// From 4 zmm whose 128-bit lane `k` holds block `4q + k` as 4 partials (q = vector
/// index): the 16 block sums in natural order.
#[target_feature(enable = "avx512f")]
#[inline]
fn red4(s: &[__m512i; 4]) -> __m512i {
    let f = |v: __m512i| _mm512_castsi512_ps(v);
    let pair = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(
            _mm512_castps_si512(_mm512_shuffle_ps(f(a), f(b), 0x88)),
            _mm512_castps_si512(_mm512_shuffle_ps(f(a), f(b), 0xDD)),
        )
    };
    // Lane k: [block k, 4+k] (resp. [8+k, 12+k]) × 2 partials.
    let t01 = pair(s[0], s[1]);
    let t23 = pair(s[2], s[3]);
    // Lane k: blocks [k, 4+k, 8+k, 12+k]: element 4k+j is block 4j+k.
    let u = pair(t01, t23);
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_epi32(idx, u)
}

/// The float step for 16 blocks (`k` valid): `acc[j] += t[j]`, then `acc[j] += t[8+j]`,
/// with `t = (dw·dx)·(isum − (Σx << SHIFT))`; invalid lanes are exactly zero.
#[inline(always)]
unsafe fn float_step<const SHIFT: u32>(
    red: __m512i,
    sx: *const i32,
    dw: *const f32,
    dx: *const f32,
    k: usize,
    acc: &mut __m256,
) {
    // SAFETY: `k` readable values at each pointer (the caller's contract); masked loads.
    unsafe {
        let m = mask16(k);
        let corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, sx), SHIFT);
        let isum = _mm512_cvtepi32_ps(_mm512_sub_epi32(red, corr));
        let d = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dw), _mm512_maskz_loadu_ps(m, dx));
        let t = _mm512_mul_ps(d, isum);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
        *acc = _mm256_add_ps(_mm256_add_ps(*acc, _mm512_castps512_ps256(t)), hi);
    }
}

/// VNNI: 16 blocks (`k` valid, `Q = ⌈k/4⌉` quads of 4 blocks) from block `b` (a multiple
/// of 16) for `T` tokens. Each quad becomes two u8 vectors whose 128-bit lane `j` holds
/// block `j`'s elements 0..16 (`lo`) and 16..32 (`hi`), matching the activations' Q4
/// arrangement, so two `vpdpbusd` leave 4 partials per block in lane `j`.
/// Q8_0: `w + 128` (lanes regrouped by `vshufi64x2`); Q4_0: the nibbles as they are.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn vnni_group<const VNNI: bool, const IS_Q4: bool, const T: usize, const Q: usize>(
    wq: *const u8,
    wd: *const f32,
    x: &ActTile,
    nb: usize,
    l4: usize,
    b: usize,
    k: usize,
    acc: &mut [__m256; T],
) {
    // Q8_0's +128 offset would saturate `vpmaddubsw`: only VNNI takes it.
    const { assert!(VNNI || IS_Q4) };
    debug_assert_eq!(k.div_ceil(4), Q);
    debug_assert_eq!(b % 16, 0);
    // SAFETY: blocks b..b+k exist in the row (tails use masked loads); the Q4
    // arrangement of each token has `l4` bytes, whole 128-byte groups, so the two 64-byte
    // loads per quad are inside.
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut lo = [zero; 4];
        let mut hi = [zero; 4];
        for c in 0..Q {
            let rem = k - 4 * c;
            if IS_Q4 {
                let ptr = wq.add((b + 4 * c) * (QK / 2)) as *const i8;
                let w = _mm512_maskz_loadu_epi8(mask64(rem * (QK / 2)), ptr);
                let low = _mm512_set1_epi8(0x0F);
                lo[c] = _mm512_and_si512(w, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            } else {
                let ptr = wq.add((b + 4 * c) * QK) as *const i8;
                let w01 = _mm512_maskz_loadu_epi8(mask64(rem * QK), ptr);
                let w23 = _mm512_maskz_loadu_epi8(mask64(rem.saturating_sub(2) * QK), ptr.add(64));
                // [b0 h0, b0 h1, b1 h0, b1 h1] and [b2 .., b3 ..] → [b0..b3 h0], [b0..b3 h1].
                let off = _mm512_set1_epi8(-128);
                lo[c] = _mm512_xor_si512(_mm512_shuffle_i64x2(w01, w23, 0x88), off);
                hi[c] = _mm512_xor_si512(_mm512_shuffle_i64x2(w01, w23, 0xDD), off);
            }
        }
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let mut v = [zero; 4];
            for c in 0..Q {
                let ptr = x.q4.as_ptr().add(t * l4 + (b / 4 + c) * 128);
                let xl = _mm512_loadu_si512(ptr as *const _);
                let xh = _mm512_loadu_si512(ptr.add(64) as *const _);
                v[c] = if VNNI {
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[c], xl), hi[c], xh)
                } else {
                    // BW, Q4_0 only: nibble pair sums ≤ 2·2·15·127 fit i16 exactly.
                    let s16 = _mm512_add_epi16(
                        _mm512_maddubs_epi16(lo[c], xl),
                        _mm512_maddubs_epi16(hi[c], xh),
                    );
                    _mm512_madd_epi16(s16, _mm512_set1_epi16(1))
                };
            }
            let o = t * nb + b;
            let (sx, dx) = (x.s.as_ptr().add(o), x.d.as_ptr().add(o));
            if IS_Q4 {
                float_step::<3>(red4(&v), sx, wd.add(b), dx, k, acc_t);
            } else {
                float_step::<7>(red4(&v), sx, wd.add(b), dx, k, acc_t);
            }
        }
    }
}

/// VNNI: one row against `T` tokens.
#[inline(always)]
unsafe fn vnni_tile<const VNNI: bool, const IS_Q4: bool, const T: usize>(
    wq: &[u8],
    wd: &[f32],
    x: &ActTile,
    out: &mut [f32],
) {
    let nb = wd.len();
    let l4 = q4_layout_len(nb * QK);
    debug_assert!(x.q.len() == T * nb * QK && x.d.len() == T * nb && x.s.len() == T * nb);
    debug_assert!(x.q4.len() == T * l4 && out.len() == T);
    debug_assert_eq!(wq.len(), nb * if IS_Q4 { QK / 2 } else { QK });
    let (wp, dp) = (wq.as_ptr(), wd.as_ptr());
    // SAFETY: the lengths above cover every block the groups read.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        let full = nb / 16 * 16;
        for b in (0..full).step_by(16) {
            vnni_group::<VNNI, IS_Q4, T, 4>(wp, dp, x, nb, l4, b, 16, &mut acc);
        }
        let (b, k, a) = (full, nb - full, &mut acc);
        match k.div_ceil(4) {
            0 => {}
            1 => vnni_group::<VNNI, IS_Q4, T, 1>(wp, dp, x, nb, l4, b, k, a),
            2 => vnni_group::<VNNI, IS_Q4, T, 2>(wp, dp, x, nb, l4, b, k, a),
            3 => vnni_group::<VNNI, IS_Q4, T, 3>(wp, dp, x, nb, l4, b, k, a),
            _ => vnni_group::<VNNI, IS_Q4, T, 4>(wp, dp, x, nb, l4, b, k, a),
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = reduce_lanes(a);
        }
    }
}

/// Row loop and token-count dispatch of [`vnni_tile`], inlined into the wrappers.
#[inline(always)]
unsafe fn wide_any<const VNNI: bool, const IS_Q4: bool>(
    rows: usize,
    wq: &[u8],
    wd: &[f32],
    x: &ActTile,
    out: &mut [f32],
) {
    each_row_of_tile!(rows, wq, wd, out, |q, d, o, N| vnni_tile::<VNNI, IS_Q4, N>(
        q, d, x, o
    ));
}

/// Q8_0 tile kernel, AVX-512 VNNI (see `table::TileFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI and AVX2; slice lengths as `TileFn` says.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn tile_q8_vnni(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx512Vnni, Op::Tile);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { wide_any::<true, false>(rows, wq, wd, x, out) }
}

/// Q4_0 tile kernel, AVX-512 VNNI (see `table::TileFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI and AVX2; slice lengths as `TileFn` says.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn tile_q4_vnni(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx512Vnni, Op::Tile);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { wide_any::<true, true>(rows, wq, wd, x, out) }
}

/// Q4_0 tile kernel, AVX-512 BW: the VNNI tier's layout with `vpmaddubsw`/`vpmaddwd`
/// (see `table::TileFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW and AVX2; slice lengths as `TileFn` says.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub unsafe fn tile_q4_bw(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx512, Op::Tile);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { wide_any::<false, true>(rows, wq, wd, x, out) }
}
