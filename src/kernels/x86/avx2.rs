//! AVX2 tier: 256-bit micro-kernels, bit-identical to `kernels::scalar`.
//!
//! A block of 32 levels fills one ymm. The s8×s8 dot uses the sign trick:
//! `vpmaddubsw(|w|, sign(x, w))` (u8×s8, pair sums ≤ 2·127·127, no saturation), then
//! `vpmaddwd` by ones gives 8 exact i32 partials. Eight blocks are reduced together with
//! `vphaddd` into one ymm holding `isum_b` for blocks `b..b+8` — exactly the contract's
//! 8 lanes, so the float step `acc += (dw·dx)·isum` is one vector mul, mul, add.
//!
//! Q4_0 skips the sign trick: the nibbles (u8, 0..15) go straight into `vpmaddubsw`
//! against the activations' Q4 arrangement, and `isum = Σ nibble·x − 8·Σx` with the
//! block sums kept in `QActs`.

use core::arch::x86_64::*;

use crate::kernels::counters::{count, Op};
use crate::kernels::{ActTile, Tier, LANES};
use crate::quant::q8_0::AMAX_MIN;
use crate::quant::QK;

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
#[inline(always)]
unsafe fn block_dot(u: __m256i, w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: register-only AVX2 ops; the caller has AVX2.
    unsafe {
        let s = _mm256_sign_epi8(x, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }
}

/// Lane `j` = sum of the 8 lanes of `v[j]`.
#[inline(always)]
pub(crate) unsafe fn hsum8(v: &[__m256i; 8]) -> __m256i {
    // SAFETY: register-only AVX2 ops; the caller has AVX2.
    unsafe {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        // 128-bit lane 0 holds elements 0..4 of v0..v3 (resp. v4..v7), lane 1 elements 4..8.
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        let lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
        let hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
        _mm256_add_epi32(lo, hi)
    }
}

/// The contract's tree over 8 lanes: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline(always)]
pub(crate) unsafe fn reduce_lanes(acc: __m256) -> f32 {
    // SAFETY: register-only AVX ops; the caller has AVX2.
    unsafe {
        let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)))
    }
}

/// `k ≤ 8` f32 scales from `p`, zeros in the other lanes.
#[inline(always)]
pub(crate) unsafe fn load_scales(p: *const f32, k: usize) -> __m256 {
    // SAFETY: `p` has `k` readable f32 (the caller's contract); masked lanes aren't read.
    unsafe {
        if k == LANES {
            return _mm256_loadu_ps(p);
        }
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), lanes);
        _mm256_maskload_ps(p, mask)
    }
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
        let full = nb / $crate::kernels::LANES * $crate::kernels::LANES;
        for $b in (0..full).step_by($crate::kernels::LANES) {
            const $full: bool = true;
            let ($k, $acc) = ($crate::kernels::LANES, &mut acc);
            $group;
        }
        if full < nb {
            const $full: bool = false;
            let ($b, $k, $acc) = (full, nb - full, &mut acc);
            $group;
        }
        for (o, a) in $out.iter_mut().zip(acc) {
            *o = $crate::kernels::x86::avx2::reduce_lanes(a);
        }
    }};
}
pub(crate) use row_groups;

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
pub(crate) use each_row;

/// [`each_row!`] for a tile of `out.len() / rows` ≤ [`TILE_TOKENS`](crate::kernels::TILE_TOKENS) tokens, the count
/// a const `$n` in `$call`: each count gets its own monomorphized tile, inlined into
/// the caller.
macro_rules! each_row_of_tile {
    ($rows:expr, $wq:expr, $wd:expr, $out:expr, |$q:ident, $d:ident, $o:ident, $n:ident| $call:expr) => {{
        let nt = $out.len() / $rows;
        debug_assert!(nt <= $crate::kernels::TILE_TOKENS);
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
pub(crate) use each_row_of_tile;

#[target_feature(enable = "avx2")]
unsafe fn tile_any<F: WFormat>(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    let (xq, xd) = (x.q, x.d);
    each_row_of_tile!(rows, wq, wd, out, |q, d, o, N| tile::<F, N>(
        q, d, xq, xd, o
    ));
}

/// Q8_0 tile kernel (see `kernels::TileFn`).
///
/// # Safety
/// The CPU has AVX2; slice lengths as `TileFn` says.
pub unsafe fn tile_q8(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: forwarded caller contract.
    unsafe { tile_any::<Q8>(rows, wq, wd, x, out) }
}

/// Q4_0 tile kernel (see `kernels::TileFn`).
///
/// # Safety
/// The CPU has AVX2; slice lengths as `TileFn` says.
pub unsafe fn tile_q4(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: forwarded caller contract.
    unsafe { tile_q4_any(rows, wq, wd, x, out) }
}

/// One block of the activation quantizer, the same f32 operations as `round_q8`.
#[inline(always)]
unsafe fn quantize_block(x: *const f32, q: *mut i8) -> f32 {
    // SAFETY: 32 readable floats at `x`, 32 writable bytes at `q` (caller's contract).
    unsafe {
        // Plain loops, not `map` closures: a closure does not inherit the caller's
        // target features, and its intrinsics would become calls.
        let mut v = [_mm256_setzero_ps(); 4];
        for (j, vj) in v.iter_mut().enumerate() {
            *vj = _mm256_loadu_ps(x.add(8 * j));
        }
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        // max_ps(a, m) returns m when a is NaN: NaN is skipped, as f32::max does.
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        if amax < AMAX_MIN {
            _mm256_storeu_si256(q as *mut __m256i, _mm256_setzero_si256());
            return 0.0;
        }
        let id = _mm256_set1_ps(127.0 / amax);
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let half = _mm256_set1_ps(0.5);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let mut i = [_mm256_setzero_si256(); 4];
        for (ij, &vi) in i.iter_mut().zip(&v) {
            let r = _mm256_add_ps(
                _mm256_mul_ps(vi, id),
                _mm256_or_ps(_mm256_and_ps(vi, sign), half),
            );
            let r = _mm256_round_ps(r, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            // NaN → 0, as the saturating `as i8` cast does.
            let r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
            *ij = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q as *mut __m256i, p);
        amax / 127.0
    }
}

#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for (b, db) in d.iter_mut().enumerate() {
        // SAFETY: x and q hold 32·d.len() values (checked by the caller).
        *db = unsafe { quantize_block(x.as_ptr().add(b * QK), q.as_mut_ptr().add(b * QK)) };
    }
}

/// Activation quantizer (see `kernels::QuantFn`), bit-identical to the scalar one.
///
/// # Safety
/// The CPU has AVX2; `x.len() == q.len() == 32·d.len()`.
pub unsafe fn quantize_act(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    count(Tier::Avx2, Op::Quantize);
    debug_assert!(x.len() == q.len() && x.len() == d.len() * QK);
    // SAFETY: forwarded caller contract.
    unsafe { quantize_avx2(x, q, d) }
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
    let l4 = crate::kernels::q4_layout_len(nb * QK);
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
