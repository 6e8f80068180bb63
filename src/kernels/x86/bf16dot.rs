//! BF16 weights × BF16 activations (the opt-in contract of docs/kernels.md, "BF16
//! activations"; reference: `scalar::bf16dot`) on x86, bit-identical to the
//! reference on every tier:
//!
//! * AVX-512 BF16 (`avx512bf16` tier): `vdpbf16ps` is the contract's step for 16 lanes of
//!   column pairs ([`bf16_dot_avx512bf16`]);
//! * AVX-512 F (`avx512`, `avx512vnni`) and AVX2 + FMA (`avx2`): the step emulated
//!   ([`bf16_dot_avx512`], [`bf16_dot_avx2`]): the pair split into its odd and even
//!   columns (a BF16 is the upper half of an f32: `& 0xffff0000` and `<< 16`), a
//!   subnormal weight cleared to its sign, one `vfmadd` per column, and a lane whose
//!   result is at most 2^-126 and not zero (a branch that is almost never taken) redone
//!   by the reference's `step`, which flushes it or keeps it as `vdpbf16ps` does.
//!
//! The emulations run about a quarter of the f32-activation kernels' speed in a prompt
//! (compare and branch per multiply-add) and 0.6–0.8 of it in decode (Zen 4, llama1b):
//! the option is for CPUs with AVX-512 BF16; elsewhere it reproduces their bits.

use core::arch::x86_64::*;

use super::prefetch;
use super::simd::{reduce512, reduce_pair, tile46_asm};
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::bf16dot::step;
use crate::kernels::tier::Tier;

/// How a 512-bit kernel takes the contract's step on 16 column pairs: the form a load
/// of 32 weights or 32 activations takes, and the step itself.
trait Step512 {
    type V: Copy;
    /// 32 weights at `p` (subnormals read as zero where the step does not do it).
    unsafe fn w(p: *const u8) -> Self::V;
    /// 32 activations at `p`.
    unsafe fn x(p: *const u16) -> Self::V;
    unsafe fn step(acc: __m512, w: Self::V, x: Self::V) -> __m512;
}

/// AVX-512 BF16: `vdpbf16ps` is the step.
struct Vdp;

impl Step512 for Vdp {
    type V = __m512i;
    #[inline(always)]
    unsafe fn w(p: *const u8) -> __m512i {
        // SAFETY: 64 readable bytes (the caller's contract).
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn x(p: *const u16) -> __m512i {
        // SAFETY: as above.
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn step(acc: __m512, w: __m512i, x: __m512i) -> __m512 {
        // SAFETY: register-only AVX-512 BF16 op; every caller is compiled with it.
        unsafe { _mm512_dpbf16_ps(acc, bh(w), bh(x)) }
    }
}

/// AVX-512 F: the step emulated, odd columns then even ([`split512`], [`step512`]).
struct Emu512;

impl Step512 for Emu512 {
    type V = (__m512, __m512);
    #[inline(always)]
    unsafe fn w(p: *const u8) -> Self::V {
        // SAFETY: 64 readable bytes (the caller's contract).
        unsafe { split512::<true>(_mm512_loadu_si512(p.cast())) }
    }
    #[inline(always)]
    unsafe fn x(p: *const u16) -> Self::V {
        // SAFETY: as above.
        unsafe { split512::<false>(_mm512_loadu_si512(p.cast())) }
    }
    #[inline(always)]
    unsafe fn step(acc: __m512, w: Self::V, x: Self::V) -> __m512 {
        // SAFETY: register-only AVX-512 F ops; every caller is compiled with them.
        unsafe { step512(step512(acc, w.0, x.0), w.1, x.1) }
    }
}

/// BF16 weights × BF16 activations (the BF16-activation contract) on 512-bit vectors,
/// the step by `S`: `R` adjacent rows against `T` tokens (`cols` BF16 bits each), 32
/// columns per step, into `y[t·ld + r]`; prefetches ahead when `PF`.
///
/// # Safety
/// AVX-512 F (and BF16 for [`Vdp`]); the rows, tokens and outputs are in bounds;
/// `cols` a multiple of 32.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile512<S: Step512, const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const u16,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: every load is inside the R rows and T tokens (caller's contract).
    unsafe {
        let rb = 2 * cols;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for c in (0..cols).step_by(32) {
            if PF {
                // A step reads a line of each row.
                prefetch::rows::<R>(w, rb, 2 * c);
            }
            // A loop, not `array::from_fn`: its closure does not inherit the kernel's
            // target features, so `Emu512`'s intrinsics were called out of line (AVX-512
            // emulated decode ran at 1/17 of the f32 path's speed).
            // SAFETY: every `S::V` is SIMD registers, for which all-zero bits are valid.
            let mut wv: [S::V; R] = core::mem::zeroed();
            for (r, v) in wv.iter_mut().enumerate() {
                *v = S::w(w.add(r * rb + 2 * c));
            }
            for t in 0..T {
                let xv = S::x(x.add(t * cols + c));
                for r in 0..R {
                    acc[r][t] = S::step(acc[r][t], wv[r], xv);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (t, &a) in row.iter().enumerate() {
                *y.add(t * ld + r) = reduce512(a);
            }
        }
    }
}

/// [`tile512`] with `vdpbf16ps`.
///
/// # Safety
/// As [`tile512`].
#[inline(always)]
unsafe fn dot_tile<const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const u16,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: forwarded.
    unsafe { tile512::<Vdp, R, T, PF>(w, cols, x, y, ld) }
}

/// [`dot_tile`] on ymm halves, for decode ([`tile256`] with the 256-bit `vdpbf16ps`),
/// so each row is read 32 bytes at a time as the f32 path reads it. The same bits as
/// [`dot_tile`]; on Zen 4, llama1b decode with `--bf16-activations` ran 1.027× the zmm
/// tile's speed (median of 15 alternating rounds in the host's fast state; 1.011 in its
/// slow state) and 0.99× the f32 path's (0.96× with the zmm tile).
///
/// Each line's prefetch is issued twice, back to back: llama1b decode 1.41× (1.06–1.47)
/// of once, 11 interleaved rounds on Zen 4, where once ran 0.73 of the f32 path and
/// llama.cpp's speed; a second prefetch of the line half a step later gave only 1.06×.
/// Why is not established; a guess is that Zen 4 drops a software prefetch that finds
/// its miss buffers full, and the second, issued before any load, finds one free.
///
/// # Safety
/// AVX-512 BF16 and VL; as [`tile512`].
#[inline(always)]
unsafe fn dot_tile256<const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const u16,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: forwarded.
    unsafe { tile256::<Vdp256, R, T, PF>(w, cols, x, y, ld) }
}

/// 16 BF16 values as the type the 256-bit `vdpbf16ps` takes (a reinterpretation).
#[inline(always)]
fn bh256(v: __m256i) -> __m256bh {
    // SAFETY: both are 32 bytes of plain bits.
    unsafe { core::mem::transmute::<__m256i, __m256bh>(v) }
}

/// 32 BF16 values as the type `vdpbf16ps` takes (a reinterpretation).
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain bits.
    unsafe { core::mem::transmute::<__m512i, __m512bh>(v) }
}

tile46_asm!(
    /// [`dot_tile`]`::<4, 6, false>` with its 24 accumulators pinned to zmm0–23
    /// (`tile46_asm!`): llama1b BF16 pp512 ran at 235 tok/s with the intrinsic form
    /// and 325 like this.
    dot_tile46,
    "avx512f,avx512bf16",
    u16,
    32,
    2,
    "vmovdqu64",
    "vdpbf16ps",
    [
        "vmovdqu64 zmm24, [{wp}]",
        "vmovdqu64 zmm25, [{wp} + {rb}]",
        "vmovdqu64 zmm26, [{wp} + {rb}*2]",
        "vmovdqu64 zmm27, [{wp} + {rb3}]"
    ]
);

/// Rows `0..rows` of a BF16-activation call in micro-tiles of `$rp` rows × `$n` tokens
/// through `$full`, the rest one by one through `$one::<1, $n, $pf>`.
macro_rules! dot_rows {
    ($full:expr, $one:ident, $rp:literal, $n:literal, $pf:literal, $w:expr, $rows:expr, $cols:expr, $x:expr, $y:expr, $ld:expr) => {{
        let (wp, rows, cols, xp, y, ld) = ($w, $rows, $cols, $x, $y, $ld);
        let (rb, full) = (2 * cols, rows / $rp * $rp);
        for r in (0..full).step_by($rp) {
            $full(wp.add(r * rb), cols, xp, y.add(r), ld);
        }
        for r in full..rows {
            $one::<1, $n, $pf>(wp.add(r * rb), cols, xp, y.add(r), ld);
        }
    }};
}

/// AVX-512 BF16, BF16 weights × BF16 activations (see `table::DotFn`): decode
/// 8 rows × 1 token with prefetch (2 rows on ymm halves where `few_rows`,
/// [`dot_tile256`]); prefill 4 rows × 6 tokens ([`dot_tile46`]), a call of at most 6
/// tokens prefetching as decode does (as the f32 driver).
///
/// # Safety
/// The CPU has AVX-512 F, BF16 and VL; the `DotFn` contract.
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
pub unsafe fn bf16_dot_avx512bf16(
    rows: usize,
    cols: usize,
    w: &[u8],
    x: &[u16],
    y: *mut f32,
    ld: usize,
) {
    count(Tier::Avx512Bf16, Op::Dot);
    debug_assert!(cols.is_multiple_of(32) && w.len() == rows * cols * 2);
    debug_assert!(x.len().is_multiple_of(cols));
    let nt = x.len() / cols;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    // SAFETY: rows r..r + R of w and tokens t..t + T of x exist; outputs are
    // y[t·ld + r] inside the caller's contract.
    unsafe {
        macro_rules! pf {
            ($r:literal, $n:literal) => {
                dot_tile::<$r, $n, true>
            };
        }
        if nt == 1 {
            // Fewer rows side by side where the CPU streams them better (`few_rows`).
            if prefetch::few_rows() {
                let ymm = dot_tile256::<2, 1, true>;
                dot_rows!(ymm, dot_tile256, 2, 1, true, wp, rows, cols, xp, y, ld);
            } else {
                dot_rows!(pf!(8, 1), dot_tile, 8, 1, true, wp, rows, cols, xp, y, ld);
            }
            return;
        }
        if nt <= 6 {
            // One tile of tokens streams its weights once: prefetch.
            match nt {
                2 => dot_rows!(pf!(4, 2), dot_tile, 4, 2, true, wp, rows, cols, xp, y, ld),
                3 => dot_rows!(pf!(4, 3), dot_tile, 4, 3, true, wp, rows, cols, xp, y, ld),
                4 => dot_rows!(pf!(4, 4), dot_tile, 4, 4, true, wp, rows, cols, xp, y, ld),
                5 => dot_rows!(pf!(4, 5), dot_tile, 4, 5, true, wp, rows, cols, xp, y, ld),
                _ => dot_rows!(pf!(4, 6), dot_tile, 4, 6, true, wp, rows, cols, xp, y, ld),
            }
            return;
        }
        macro_rules! no {
            ($r:literal, $n:literal) => {
                dot_tile::<$r, $n, false>
            };
        }
        let mut t0 = 0;
        while t0 < nt {
            let tn = (nt - t0).min(6);
            let (xt, yt) = (xp.add(t0 * cols), y.add(t0 * ld));
            match tn {
                1 => dot_rows!(no!(4, 1), dot_tile, 4, 1, false, wp, rows, cols, xt, yt, ld),
                2 => dot_rows!(no!(4, 2), dot_tile, 4, 2, false, wp, rows, cols, xt, yt, ld),
                3 => dot_rows!(no!(4, 3), dot_tile, 4, 3, false, wp, rows, cols, xt, yt, ld),
                4 => dot_rows!(no!(4, 4), dot_tile, 4, 4, false, wp, rows, cols, xt, yt, ld),
                5 => dot_rows!(no!(4, 5), dot_tile, 4, 5, false, wp, rows, cols, xt, yt, ld),
                _ => dot_rows!(dot_tile46, dot_tile, 4, 6, false, wp, rows, cols, xt, yt, ld),
            }
            t0 += tn;
        }
    }
}

/// The odd and even columns of 16 column pairs (32 BF16 bits) as f32, a subnormal
/// weight read as zero when `daz` (activations were flushed when rounded).
#[target_feature(enable = "avx512f")]
#[inline]
fn split512<const DAZ: bool>(v: __m512i) -> (__m512, __m512) {
    let mut odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
    let mut even = _mm512_slli_epi32(v, 16);
    if DAZ {
        let (exp, sign) = (_mm512_set1_epi32(0x7f80_0000), _mm512_set1_epi32(i32::MIN));
        odd = _mm512_mask_and_epi32(odd, _mm512_testn_epi32_mask(odd, exp), odd, sign);
        even = _mm512_mask_and_epi32(even, _mm512_testn_epi32_mask(even, exp), even, sign);
    }
    (_mm512_castsi512_ps(odd), _mm512_castsi512_ps(even))
}

/// One step of the contract on 16 lanes: `fma(w, x, acc)`, and the reference's `step`
/// on a lane whose result is tiny (0 < |r| ≤ 2^-126).
#[target_feature(enable = "avx512f")]
#[inline]
fn step512(acc: __m512, w: __m512, x: __m512) -> __m512 {
    let r = _mm512_fmadd_ps(w, x, acc);
    let a = _mm512_abs_ps(r);
    let small = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, _mm512_set1_ps(f32::MIN_POSITIVE));
    let tiny = _mm512_mask_cmp_ps_mask::<_CMP_NEQ_OQ>(small, a, _mm512_setzero_ps());
    if tiny == 0 {
        return r;
    }
    // SAFETY: a __m512 and a [f32; 16] are the same 64 bytes of plain bits.
    unsafe {
        let f = |v: __m512| core::mem::transmute::<__m512, [f32; 16]>(v);
        core::mem::transmute(redo(f(acc), f(w), f(x), f(r), u32::from(tiny)))
    }
}

/// The lanes `tiny` (a bit mask) of an emulated step redone by the reference: `r` with
/// lane `i` replaced by `step(acc[i], w[i], x[i])`.
#[cold]
#[inline(never)]
fn redo<const N: usize>(
    acc: [f32; N],
    w: [f32; N],
    x: [f32; N],
    r: [f32; N],
    tiny: u32,
) -> [f32; N] {
    std::array::from_fn(|i| {
        if tiny >> i & 1 == 1 {
            step(acc[i], w[i], x[i])
        } else {
            r[i]
        }
    })
}

/// [`tile512`] with the emulated step.
///
/// # Safety
/// As [`tile512`].
#[inline(always)]
unsafe fn emu_tile512<const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const u16,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: forwarded.
    unsafe { tile512::<Emu512, R, T, PF>(w, cols, x, y, ld) }
}

/// [`split512`] on AVX2: 8 column pairs (16 BF16 bits).
#[target_feature(enable = "avx2")]
#[inline]
fn split256<const DAZ: bool>(v: __m256i) -> (__m256, __m256) {
    let mut odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000u32 as i32));
    let mut even = _mm256_slli_epi32(v, 16);
    if DAZ {
        let (exp, mag) = (_mm256_set1_epi32(0x7f80_0000), _mm256_set1_epi32(i32::MAX));
        let flush = |v: __m256i| {
            let z = _mm256_cmpeq_epi32(_mm256_and_si256(v, exp), _mm256_setzero_si256());
            _mm256_andnot_si256(_mm256_and_si256(z, mag), v)
        };
        odd = flush(odd);
        even = flush(even);
    }
    (_mm256_castsi256_ps(odd), _mm256_castsi256_ps(even))
}

/// [`step512`] on 8 lanes (AVX2 + FMA).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn step256(acc: __m256, w: __m256, x: __m256) -> __m256 {
    let r = _mm256_fmadd_ps(w, x, acc);
    let a = _mm256_and_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX)));
    let small = _mm256_cmp_ps::<_CMP_LE_OQ>(a, _mm256_set1_ps(f32::MIN_POSITIVE));
    let nonzero = _mm256_cmp_ps::<_CMP_NEQ_OQ>(a, _mm256_setzero_ps());
    let tiny = _mm256_movemask_ps(_mm256_and_ps(small, nonzero));
    if tiny == 0 {
        return r;
    }
    // SAFETY: a __m256 and a [f32; 8] are the same 32 bytes of plain bits.
    unsafe {
        let f = |v: __m256| core::mem::transmute::<__m256, [f32; 8]>(v);
        core::mem::transmute(redo(f(acc), f(w), f(x), f(r), tiny as u32))
    }
}

/// How a 256-bit kernel takes the contract's step on 8 column pairs (as [`Step512`]).
trait Step256 {
    type V: Copy;
    /// Whether a prefetching tile asks for each line twice, back to back (see
    /// [`dot_tile256`]).
    const PF_TWICE: bool = false;
    /// 16 weights at `p` (subnormals read as zero where the step does not do it).
    unsafe fn w(p: *const u8) -> Self::V;
    /// 16 activations at `p`.
    unsafe fn x(p: *const u16) -> Self::V;
    unsafe fn step(acc: __m256, w: Self::V, x: Self::V) -> __m256;
}

/// AVX-512 BF16 with VL: the 256-bit `vdpbf16ps` is the step.
struct Vdp256;

impl Step256 for Vdp256 {
    type V = __m256i;
    const PF_TWICE: bool = true;
    #[inline(always)]
    unsafe fn w(p: *const u8) -> __m256i {
        // SAFETY: 32 readable bytes (the caller's contract).
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn x(p: *const u16) -> __m256i {
        // SAFETY: as above.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn step(acc: __m256, w: __m256i, x: __m256i) -> __m256 {
        // SAFETY: register-only AVX-512 BF16/VL op; every caller is compiled with it.
        unsafe { _mm256_dpbf16_ps(acc, bh256(w), bh256(x)) }
    }
}

/// AVX2 + FMA: the step emulated, odd columns then even ([`split256`], [`step256`]).
struct Emu256;

impl Step256 for Emu256 {
    type V = (__m256, __m256);
    #[inline(always)]
    unsafe fn w(p: *const u8) -> Self::V {
        // SAFETY: 32 readable bytes (the caller's contract).
        unsafe { split256::<true>(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn x(p: *const u16) -> Self::V {
        // SAFETY: as above.
        unsafe { split256::<false>(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn step(acc: __m256, w: Self::V, x: Self::V) -> __m256 {
        // SAFETY: register-only AVX2 / FMA ops; every caller is compiled with them.
        unsafe { step256(step256(acc, w.0, x.0), w.1, x.1) }
    }
}

/// `R` rows × `T` tokens of the BF16-activation contract on ymm, the step by `S`: each
/// output's 16 lanes as two ymm (lanes 0–7: the step's first 16 columns, 8–15: the next
/// 16), combined as `reduce512` combines a zmm's halves.
///
/// # Safety
/// AVX2 (and FMA, or AVX-512 BF16 and VL, as `S` needs); bounds as [`dot_tile`].
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile256<S: Step256, const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const u16,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: every load is inside the R rows and T tokens (caller's contract).
    unsafe {
        let rb = 2 * cols;
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        for c in (0..cols).step_by(32) {
            if PF {
                prefetch::rows::<R>(w, rb, 2 * c);
                if S::PF_TWICE {
                    prefetch::rows::<R>(w, rb, 2 * c);
                }
            }
            for h in 0..2 {
                // A loop, not `array::from_fn` (see `tile512`).
                // SAFETY: every `S::V` is SIMD registers, for which all-zero bits are valid.
                let mut wv: [S::V; R] = core::mem::zeroed();
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = S::w(w.add(r * rb + 2 * c + 32 * h));
                }
                for t in 0..T {
                    let xv = S::x(x.add(t * cols + c + 16 * h));
                    for r in 0..R {
                        acc[r][t][h] = S::step(acc[r][t][h], wv[r], xv);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (t, a) in row.iter().enumerate() {
                *y.add(t * ld + r) = reduce_pair(a[0], a[1]);
            }
        }
    }
}

/// [`tile256`] with the emulated step (AVX2 + FMA).
///
/// # Safety
/// As [`tile256`].
#[inline(always)]
unsafe fn emu_tile256<const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const u16,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: forwarded.
    unsafe { tile256::<Emu256, R, T, PF>(w, cols, x, y, ld) }
}

/// The driver of an emulating tier: `$rp` rows × up to `$t` tokens, 4 rows × 1 token with
/// prefetch in decode (and a call of at most `$t` tokens prefetching too).
macro_rules! emu_driver {
    ($name:ident, $tile:ident, $feat:literal, $tier:expr, $rp:literal, $t:literal) => {
        /// # Safety
        /// The tier's CPU features; the `DotFn` contract.
        #[target_feature(enable = $feat)]
        pub unsafe fn $name(rows: usize, cols: usize, w: &[u8], x: &[u16], y: *mut f32, ld: usize) {
            count($tier, Op::Dot);
            debug_assert!(cols.is_multiple_of(32) && w.len() == rows * cols * 2);
            debug_assert!(x.len().is_multiple_of(cols));
            let nt = x.len() / cols;
            let (wp, xp) = (w.as_ptr(), x.as_ptr());
            // SAFETY: rows r..r + R of w and tokens t..t + T of x exist; outputs are
            // y[t·ld + r] inside the caller's contract.
            unsafe {
                macro_rules! tiles {
                    ($r:literal, $n:literal, $pf:literal, $xt:expr, $yt:expr) => {
                        dot_rows!(
                            $tile::<$r, $n, $pf>,
                            $tile,
                            $r,
                            $n,
                            $pf,
                            wp,
                            rows,
                            cols,
                            $xt,
                            $yt,
                            ld
                        )
                    };
                }
                if nt == 1 {
                    tiles!(4, 1, true, xp, y);
                    return;
                }
                let pf = nt <= $t;
                let mut t0 = 0;
                while t0 < nt {
                    let tn = (nt - t0).min($t);
                    let (xt, yt) = (xp.add(t0 * cols), y.add(t0 * ld));
                    match (tn, pf) {
                        (1, _) => tiles!($rp, 1, false, xt, yt),
                        (2, true) => tiles!($rp, 2, true, xt, yt),
                        (2, false) => tiles!($rp, 2, false, xt, yt),
                        (_, true) => tiles!($rp, $t, true, xt, yt),
                        _ => tiles!($rp, $t, false, xt, yt),
                    }
                    t0 += tn;
                }
            }
        }
    };
}

emu_driver!(bf16_dot_avx512, emu_tile512, "avx512f", Tier::Avx512, 2, 3);
emu_driver!(bf16_dot_avx2, emu_tile256, "avx2,fma", Tier::Avx2, 2, 3);
