//! f32 activations × BF16 / F16 weights on x86: AVX2 + FMA + F16C (the `avx2` tier) and
//! AVX-512 F (the `avx512` and `avx512vnni` tiers), bit-identical to
//! `scalar::half` (the contract of docs/kernels.md, "2-byte float weights").
//!
//! 16 weights at a time are widened exactly to f32 (BF16: `vpmovzxwd` + `vpslld 16`;
//! F16: `vcvtph2ps`) and multiplied into the output's 16 lanes with `vfmadd231ps`: one
//! zmm per output on AVX-512, two ymm (lanes 0–7 and 8–15) on AVX2. At the end, lanes
//! `i` and `i + 8` are added (the zmm's halves, or the two ymm), then the 8-lane tree.
//! Each (row, token) output is one such chain; the kernels run micro-tiles of rows ×
//! tokens so that each widened weight vector serves every token of the tile:
//!
//! * AVX-512: 4 rows × 6 tokens (24 zmm accumulators, 4 widened weights, 1 activation
//!   vector); decode 8 rows × 1 token (8 independent FMA chains), 2 rows on CPUs that
//!   stream few rows side by side better (`prefetch::few_rows`: AMD before Zen 5);
//! * AVX2: 2 rows × 3 tokens (12 ymm accumulators); decode 4 rows × 1 token.
//!
//! Decode calls (one token) and calls of a single token tile (a server's batched decode
//! step, a short prompt) stream weights that nothing else reads: they prefetch each
//! row of the micro-tile in flight `PF_DIST / R` bytes ahead (continuing into the next
//! micro-tile's rows), [`PF_DIST`] bytes in all, as the packed quantized kernels do.

use core::arch::x86_64::*;

use super::features::has_avx2_fma;
use super::prefetch;
use super::simd::{f16x16, f16x8, reduce512, reduce_pair, tile46_asm};
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// The 2-byte float types' exact widening to f32.
trait Widen {
    /// # Safety
    /// 16 readable bytes at `p`; AVX2 and F16C available.
    unsafe fn w8(p: *const u8) -> __m256;
    /// # Safety
    /// 32 readable bytes at `p`; AVX-512 F available.
    unsafe fn w16(p: *const u8) -> __m512;
    /// [`tile512`]`::<Self, 4, 6, false>`, in asm (`tile46_asm!`).
    ///
    /// # Safety
    /// As [`tile512`].
    unsafe fn tile46(w: *const u8, cols: usize, x: *const f32, y: *mut f32, ld: usize);
}

struct Bf16;
struct F16;

impl Widen for Bf16 {
    #[inline(always)]
    unsafe fn w8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes (trait contract); BF16 is the upper half of an f32.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
    #[inline(always)]
    unsafe fn w16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes (trait contract).
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }
    #[inline(always)]
    unsafe fn tile46(w: *const u8, cols: usize, x: *const f32, y: *mut f32, ld: usize) {
        // SAFETY: forwarded caller contract.
        unsafe { bf16_tile46(w, cols, x, y, ld) }
    }
}

impl Widen for F16 {
    #[inline(always)]
    unsafe fn w8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes (trait contract); F16C.
        unsafe { f16x8(p) }
    }
    #[inline(always)]
    unsafe fn w16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes (trait contract).
        unsafe { f16x16(p) }
    }
    #[inline(always)]
    unsafe fn tile46(w: *const u8, cols: usize, x: *const f32, y: *mut f32, ld: usize) {
        // SAFETY: forwarded caller contract.
        unsafe { f16_tile46(w, cols, x, y, ld) }
    }
}

/// `R` adjacent rows at `w` (`cols` weights each) against `T` tokens at `x` (`cols`
/// f32 each), into `y[t·ld + r]`; prefetches ahead when `PF`.
///
/// # Safety
/// AVX-512 F; the rows, tokens and outputs are in bounds; `cols` a multiple of 16.
#[inline(always)]
// Indexed loops: acc[r][t] is the (row, token) grid the FMAs fill, in the contract's order.
#[allow(clippy::needless_range_loop)]
unsafe fn tile512<W: Widen, const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const f32,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: every load is inside the R rows and T tokens (caller's contract).
    unsafe {
        if R == 4 && T == 6 && !PF {
            return W::tile46(w, cols, x, y, ld);
        }
        let rb = 2 * cols;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for c in (0..cols).step_by(16) {
            if PF && c % 32 == 0 {
                // A step reads 32 bytes of each row: a line per row every other step.
                prefetch::rows::<R>(w, rb, 2 * c);
            }
            let mut wv = [_mm512_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = W::w16(w.add(r * rb + 2 * c));
            }
            for t in 0..T {
                let xv = _mm512_loadu_ps(x.add(t * cols + c));
                for r in 0..R {
                    acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
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

tile46_asm!(
    bf16_tile46,
    "avx512f",
    f32,
    16,
    4,
    "vmovups",
    "vfmadd231ps",
    [
        "vpmovzxwd zmm24, [{wp}]\nvpslld zmm24, zmm24, 16",
        "vpmovzxwd zmm25, [{wp} + {rb}]\nvpslld zmm25, zmm25, 16",
        "vpmovzxwd zmm26, [{wp} + {rb}*2]\nvpslld zmm26, zmm26, 16",
        "vpmovzxwd zmm27, [{wp} + {rb3}]\nvpslld zmm27, zmm27, 16"
    ]
);
tile46_asm!(
    f16_tile46,
    "avx512f",
    f32,
    16,
    4,
    "vmovups",
    "vfmadd231ps",
    [
        "vcvtph2ps zmm24, [{wp}]",
        "vcvtph2ps zmm25, [{wp} + {rb}]",
        "vcvtph2ps zmm26, [{wp} + {rb}*2]",
        "vcvtph2ps zmm27, [{wp} + {rb3}]"
    ]
);

/// [`tile512`] on AVX2: each output's 16 lanes as two ymm.
///
/// # Safety
/// AVX2, FMA, F16C; bounds as [`tile512`].
#[inline(always)]
unsafe fn tile256<W: Widen, const R: usize, const T: usize, const PF: bool>(
    w: *const u8,
    cols: usize,
    x: *const f32,
    y: *mut f32,
    ld: usize,
) {
    // SAFETY: every load is inside the R rows and T tokens (caller's contract).
    unsafe {
        let rb = 2 * cols;
        let mut lo = [[_mm256_setzero_ps(); T]; R];
        let mut hi = [[_mm256_setzero_ps(); T]; R];
        for c in (0..cols).step_by(16) {
            if PF && c % 32 == 0 {
                prefetch::rows::<R>(w, rb, 2 * c);
            }
            for r in 0..R {
                let p = w.add(r * rb + 2 * c);
                let (wl, wh) = (W::w8(p), W::w8(p.add(16)));
                for t in 0..T {
                    let xp = x.add(t * cols + c);
                    lo[r][t] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xp), lo[r][t]);
                    hi[r][t] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xp.add(8)), hi[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                *y.add(t * ld + r) = reduce_pair(lo[r][t], hi[r][t]);
            }
        }
    }
}

/// Rows `0..rows` in micro-tiles of `$rp` rows (the rest one by one) × `$n` tokens,
/// prefetching ahead when `$pf` (a bool, chosen once per call).
macro_rules! row_tiles {
    ($tile:ident, $rp:literal, $n:literal, $pf:expr, $w:expr, $rows:expr, $cols:expr, $x:expr, $y:expr, $ld:expr) => {{
        if $pf {
            row_tiles!(@ $tile, $rp, $n, true, $w, $rows, $cols, $x, $y, $ld)
        } else {
            row_tiles!(@ $tile, $rp, $n, false, $w, $rows, $cols, $x, $y, $ld)
        }
    }};
    (@ $tile:ident, $rp:literal, $n:literal, $pf:literal, $w:expr, $rows:expr, $cols:expr, $x:expr, $y:expr, $ld:expr) => {{
        let (wp, rows, cols, xp, y, ld) = ($w, $rows, $cols, $x, $y, $ld);
        let (rb, full) = (2 * cols, rows / $rp * $rp);
        for r in (0..full).step_by($rp) {
            $tile::<W, $rp, $n, $pf>(wp.add(r * rb), cols, xp, y.add(r), ld);
        }
        for r in full..rows {
            $tile::<W, 1, $n, $pf>(wp.add(r * rb), cols, xp, y.add(r), ld);
        }
    }};
}

/// The driver of a tier: every row of `w` against every token of `x`, through the
/// micro-tile `$tile`: `$rp` rows × up to `$t` tokens in prefill, `$rd` rows × 1 token
/// (with prefetch) in decode, `$rf` where the CPU takes few rows (`prefetch::few_rows`).
macro_rules! driver {
    ($name:ident, $tile:ident, $feat:literal, $rp:literal, $rd:literal, $rf:literal, $t:literal) => {
        /// # Safety
        /// The tier's CPU features; the `HalfFn` contract.
        #[target_feature(enable = $feat)]
        unsafe fn $name<W: Widen>(
            rows: usize,
            cols: usize,
            w: &[u8],
            x: &[f32],
            y: *mut f32,
            ld: usize,
        ) {
            debug_assert!(cols.is_multiple_of(16) && w.len() == rows * cols * 2);
            debug_assert!(x.len().is_multiple_of(cols));
            let nt = x.len() / cols;
            let (wp, xp) = (w.as_ptr(), x.as_ptr());
            // SAFETY: rows r..r + R of w and tokens t..t + T of x exist; outputs are
            // y[t·ld + r] inside the caller's contract.
            unsafe {
                if nt == 1 {
                    // Fewer rows side by side where the CPU streams them better.
                    if $crate::kernels::x86::prefetch::few_rows() {
                        row_tiles!($tile, $rf, 1, true, wp, rows, cols, xp, y, ld);
                    } else {
                        row_tiles!($tile, $rd, 1, true, wp, rows, cols, xp, y, ld);
                    }
                    return;
                }
                // One tile of tokens (a server's batched decode step, a short prompt)
                // streams its weights once, as decode does: prefetch. Longer prompts
                // read them again per tile, from cache.
                let pf = nt <= $t;
                let mut t0 = 0;
                while t0 < nt {
                    let tn = (nt - t0).min($t);
                    let (xt, yt) = (xp.add(t0 * cols), y.add(t0 * ld));
                    match tn {
                        1 => row_tiles!($tile, $rp, 1, pf, wp, rows, cols, xt, yt, ld),
                        2 => row_tiles!($tile, $rp, 2, pf, wp, rows, cols, xt, yt, ld),
                        3 => row_tiles!($tile, $rp, 3, pf, wp, rows, cols, xt, yt, ld),
                        4 => row_tiles!($tile, $rp, 4, pf, wp, rows, cols, xt, yt, ld),
                        5 => row_tiles!($tile, $rp, 5, pf, wp, rows, cols, xt, yt, ld),
                        _ => row_tiles!($tile, $rp, $t, pf, wp, rows, cols, xt, yt, ld),
                    }
                    t0 += tn;
                }
            }
        }
    };
}

// Decode: 8 rows, or 2 where `prefetch::few_rows` (AVX2 stays at 4: Gemma 3 BF16 ran
// 0.97x with 2 on Zen 4).
driver!(drive512, tile512, "avx512f", 4, 8, 2, 6);
driver!(drive256, tile256, "avx2,fma,f16c", 2, 4, 4, 3);

/// Rows BF16/F16 decode reads side by side on tier `t` (the `driver!` lines above and
/// `bf16dot`'s decode); `None` for tiers without these kernels.
pub fn decode_rows(t: Tier) -> Option<usize> {
    match t {
        Tier::Avx2 if has_avx2_fma() => Some(4),
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 => {
            Some(if prefetch::few_rows() { 2 } else { 8 })
        }
        _ => None,
    }
}

/// A tier's entry for one weight type (see `table::HalfFn`): the call count,
/// then the tier's driver for the type.
macro_rules! half_entry {
    ($(#[$doc:meta])* $name:ident, $tier:ident, $drive:ident, $w:ident) => {
        $(#[$doc])*
        pub unsafe fn $name(rows: usize, cols: usize, w: &[u8], x: &[f32], y: *mut f32, ld: usize) {
            count(Tier::$tier, Op::Half);
            // SAFETY: forwarded caller contract.
            unsafe { $drive::<$w>(rows, cols, w, x, y, ld) }
        }
    };
}

half_entry!(
    /// AVX-512 F, BF16 (see `table::HalfFn`).
    ///
    /// # Safety
    /// The CPU has AVX-512 F; the `HalfFn` contract.
    bf16_avx512, Avx512, drive512, Bf16
);

half_entry!(
    /// AVX-512 F, F16 (see `table::HalfFn`).
    ///
    /// # Safety
    /// As [`bf16_avx512`].
    f16_avx512, Avx512, drive512, F16
);

half_entry!(
    /// AVX2 + FMA + F16C, BF16 (see `table::HalfFn`).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; the `HalfFn` contract.
    bf16_avx2, Avx2, drive256, Bf16
);

half_entry!(
    /// AVX2 + FMA + F16C, F16 (see `table::HalfFn`).
    ///
    /// # Safety
    /// As [`bf16_avx2`].
    f16_avx2, Avx2, drive256, F16
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::scalar::{bf16dot as scalar_bf16dot, half as scalar_half};
    use crate::kernels::x86::bf16dot;
    use crate::kernels::x86::features::{has_avx512, has_avx512bf16};

    /// The table's entry types (`table::HalfFn`, `table::DotFn`).
    type HalfFn = unsafe fn(usize, usize, &[u8], &[f32], *mut f32, usize);
    type DotFn = unsafe fn(usize, usize, &[u8], &[u16], *mut f32, usize);

    /// Decode (one token) with 2 and with 8 (AVX2: 4) rows side by side gives the
    /// scalar reference's bits, for every kernel this CPU runs; 13 rows leave a tail.
    #[test]
    fn decode_rows_side_by_side_do_not_change_bits() {
        let (rows, cols) = (13, 96);
        let mut s = 0x2545_f491_u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        // Weights: finite BF16 / F16 bit patterns of mixed magnitude.
        let w: Vec<u8> = (0..rows * cols)
            .flat_map(|_| ((next() & 0x3fff) as u16 | 0x3000).to_le_bytes())
            .collect();
        let x: Vec<f32> = (0..cols)
            .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let xb: Vec<u16> = (0..cols)
            .map(|_| (next() & 0x3fff) as u16 | 0x3c00)
            .collect();
        let run = |f: HalfFn| {
            let mut y = vec![0f32; rows];
            // SAFETY: a kernel this CPU runs (checked by the caller); shapes as above.
            unsafe { f(rows, cols, &w, &x, y.as_mut_ptr(), rows) };
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let dot = |f: DotFn| {
            let mut y = vec![0f32; rows];
            // SAFETY: as `run`.
            unsafe { f(rows, cols, &w, &xb, y.as_mut_ptr(), rows) };
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let mut kinds: Vec<(HalfFn, HalfFn)> = Vec::new();
        if has_avx2_fma() {
            kinds.push((bf16_avx2, scalar_half::tile_bf16));
            kinds.push((f16_avx2, scalar_half::tile_f16));
        }
        if has_avx512() {
            kinds.push((bf16_avx512, scalar_half::tile_bf16));
            kinds.push((f16_avx512, scalar_half::tile_f16));
        }
        let bf16 = has_avx512bf16();
        let chosen = prefetch::few_rows();
        for few in [true, false] {
            prefetch::set_few_rows(few);
            for &(f, reference) in &kinds {
                assert_eq!(run(f), run(reference), "few rows {few}");
            }
            if bf16 {
                assert_eq!(
                    dot(bf16dot::bf16_dot_avx512bf16),
                    dot(scalar_bf16dot::tile),
                    "few rows {few}"
                );
            }
        }
        prefetch::set_few_rows(chosen);
    }
}
