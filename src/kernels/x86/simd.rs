//! Register helpers the x86 kernels share: exact f16 widening loads, the horizontal
//! sums and the contract's 8-lane tree on a ymm (and a zmm's two halves), masked scale
//! loads, a u32's bits as byte masks.

use core::arch::x86_64::*;

use crate::kernels::scalar::tiles::LANES;

/// 8 f16 at `p` as f32 (`vcvtph2ps`: exact, subnormals too, MXCSR not consulted for
/// this conversion's exact results).
///
/// # Safety
/// 16 readable bytes at `p`; the caller has F16C and AVX.
#[inline(always)]
pub(crate) unsafe fn f16x8(p: *const u8) -> __m256 {
    // SAFETY: the function's contract.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
}

/// 16 f16 at `p` as f32 (exact, as [`f16x8`]).
///
/// # Safety
/// 32 readable bytes at `p`; the caller has AVX-512 F.
#[inline(always)]
pub(crate) unsafe fn f16x16(p: *const u8) -> __m512 {
    // SAFETY: the function's contract.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
}

/// Byte `8k + i` = 0xFF where bit `i` of byte `k` of `s` is set (the signs of 32
/// codebook weights, 8 per byte; Q5's fifth bits, bit `e` for element `e`).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn bit_mask(s: u32) -> __m256i {
    bit_mask_of(_mm256_set1_epi32(s as i32))
}

/// [`bit_mask`] of dword `j` of `words` (`j < 8`).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn bit_mask_lane(words: __m256i, j: usize) -> __m256i {
    bit_mask_of(_mm256_permutevar8x32_epi32(
        words,
        _mm256_set1_epi32(j as i32),
    ))
}

/// [`bit_mask`] of the dword `v` holds in every lane.
#[target_feature(enable = "avx2")]
#[inline]
fn bit_mask_of(v: __m256i) -> __m256i {
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

/// Lane `j` = sum of the 8 lanes of `v[j]`.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn hsum8(v: &[__m256i; 8]) -> __m256i {
    let (lo, hi) = hsum8_halves(v);
    _mm256_add_epi32(lo, hi)
}

/// Lane `j` of the first = sum of lanes 0..4 of `v[j]` (its low 128 bits), of the
/// second = sum of lanes 4..8.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn hsum8_halves(v: &[__m256i; 8]) -> (__m256i, __m256i) {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    // 128-bit lane 0 holds elements 0..4 of v0..v3 (resp. v4..v7), lane 1 elements 4..8.
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    let lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
    let hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
    (lo, hi)
}

/// The contract's tree over 8 lanes: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[target_feature(enable = "avx")]
#[inline]
pub(crate) fn reduce_lanes(acc: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)))
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

/// Lanes `i` (of `lo`) and `i + 8` (of `hi`) added, then the 8-lane tree
/// `((h0+h4) + (h2+h6)) + ((h1+h5) + (h3+h7))`.
#[target_feature(enable = "avx")]
#[inline]
pub(crate) fn reduce_pair(lo: __m256, hi: __m256) -> f32 {
    let h = _mm256_add_ps(lo, hi);
    let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); // i + 4
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q)); // (0+2), (1+3)
    _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
}

/// [`reduce_pair`] of a zmm's two halves.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn reduce512(a: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    reduce_pair(_mm512_castps512_ps256(a), hi)
}

/// A 4 rows × 6 tokens micro-tile in inline asm, `$name(w, cols, x, y, ld)`: per step of
/// `$per` columns, the four `$w` lines put row r's weights in zmm24+r (from `{wp}`,
/// rows `{rb}` bytes apart), `$ld` loads token t's activations (`$xb` bytes per column
/// in `x`), and `$op` accumulates each (row, token) into zmm0–23; then each accumulator
/// is reduced into `y[t·ld + r]`. The accumulators are pinned: LLVM gives the intrinsic
/// form only zmm0–19 and keeps ten accumulators on the stack, a load and a store per
/// multiply-add. Used for the f32 contract's BF16/F16 tiles here ([`tile512`]`::<_, 4,
/// 6, false>`, `vfmadd231ps` on widened weights) and `vdpbf16ps`'s (`bf16dot`).
macro_rules! tile46_asm {
    ($(#[$m:meta])* $name:ident, $feat:literal, $xt:ty, $per:literal, $xb:literal, $ld:literal,
     $op:literal, [$w0:expr, $w1:expr, $w2:expr, $w3:expr]) => {
        $(#[$m])*
        /// # Safety
        /// The CPU features; 4 rows at `w` (`2·cols` bytes each), 6 tokens at `x`,
        /// `y[t·ld + r]` writable; `cols` a positive multiple of the step's columns.
        #[target_feature(enable = $feat)]
        #[inline]
        unsafe fn $name(w: *const u8, cols: usize, x: *const $xt, y: *mut f32, ld: usize) {
            debug_assert!(cols >= $per && cols.is_multiple_of($per));
            let (rb, xs) = (2 * cols, $xb * cols);
            let mut a = [_mm512_setzero_ps(); 24];
            // SAFETY: each step reads 2·$per bytes of each row and 64 of each token, for
            // cols / $per ≥ 1 steps: inside the caller's rows and tokens.
            unsafe {
                core::arch::asm!(
                    "2:",
                    $w0, $w1, $w2, $w3,
                    concat!($ld, " zmm28, [{xp}]"),
                    concat!($op, " zmm0, zmm24, zmm28"),
                    concat!($op, " zmm1, zmm25, zmm28"),
                    concat!($op, " zmm2, zmm26, zmm28"),
                    concat!($op, " zmm3, zmm27, zmm28"),
                    concat!($ld, " zmm29, [{xp} + {xs}]"),
                    concat!($op, " zmm4, zmm24, zmm29"),
                    concat!($op, " zmm5, zmm25, zmm29"),
                    concat!($op, " zmm6, zmm26, zmm29"),
                    concat!($op, " zmm7, zmm27, zmm29"),
                    concat!($ld, " zmm30, [{xp} + {xs}*2]"),
                    concat!($op, " zmm8, zmm24, zmm30"),
                    concat!($op, " zmm9, zmm25, zmm30"),
                    concat!($op, " zmm10, zmm26, zmm30"),
                    concat!($op, " zmm11, zmm27, zmm30"),
                    concat!($ld, " zmm31, [{xp} + {xs3}]"),
                    concat!($op, " zmm12, zmm24, zmm31"),
                    concat!($op, " zmm13, zmm25, zmm31"),
                    concat!($op, " zmm14, zmm26, zmm31"),
                    concat!($op, " zmm15, zmm27, zmm31"),
                    concat!($ld, " zmm28, [{xp} + {xs}*4]"),
                    concat!($op, " zmm16, zmm24, zmm28"),
                    concat!($op, " zmm17, zmm25, zmm28"),
                    concat!($op, " zmm18, zmm26, zmm28"),
                    concat!($op, " zmm19, zmm27, zmm28"),
                    concat!($ld, " zmm29, [{xp} + {xs5}]"),
                    concat!($op, " zmm20, zmm24, zmm29"),
                    concat!($op, " zmm21, zmm25, zmm29"),
                    concat!($op, " zmm22, zmm26, zmm29"),
                    concat!($op, " zmm23, zmm27, zmm29"),
                    "add {wp}, {step}",
                    "add {xp}, 64",
                    "dec {n}",
                    "jnz 2b",
                    wp = inout(reg) w => _,
                    xp = inout(reg) x => _,
                    n = inout(reg) cols / $per => _,
                    step = const 2 * $per,
                    rb = in(reg) rb,
                    rb3 = in(reg) 3 * rb,
                    xs = in(reg) xs,
                    xs3 = in(reg) 3 * xs,
                    xs5 = in(reg) 5 * xs,
                    inout("zmm0") a[0], inout("zmm1") a[1], inout("zmm2") a[2],
                    inout("zmm3") a[3], inout("zmm4") a[4], inout("zmm5") a[5],
                    inout("zmm6") a[6], inout("zmm7") a[7], inout("zmm8") a[8],
                    inout("zmm9") a[9], inout("zmm10") a[10], inout("zmm11") a[11],
                    inout("zmm12") a[12], inout("zmm13") a[13], inout("zmm14") a[14],
                    inout("zmm15") a[15], inout("zmm16") a[16], inout("zmm17") a[17],
                    inout("zmm18") a[18], inout("zmm19") a[19], inout("zmm20") a[20],
                    inout("zmm21") a[21], inout("zmm22") a[22], inout("zmm23") a[23],
                    out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                    out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                    options(nostack, readonly),
                );
                // Accumulator 4t + r is (row r, token t).
                for (i, &v) in a.iter().enumerate() {
                    *y.add(i / 4 * ld + i % 4) = $crate::kernels::x86::simd::reduce512(v);
                }
            }
        }
    };
}
pub(crate) use tile46_asm;
