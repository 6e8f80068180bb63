//! The scalar reference for f32 activations × BF16 / F16 weights: the arithmetic
//! contract of `docs/kernels.md` ("2-byte float weights") written out plainly. Every
//! tier that multiplies these weights gives these bits; [`tile_bf16`] and [`tile_f16`]
//! are the scalar tier's entries of the kernel table (`kernels::table`).
//!
//! For an output `y = Σ_c w[c]·x[c]` over `cols` columns:
//!
//! * the weight is widened exactly to f32 (BF16: its bits are the upper half of the
//!   f32; F16: IEEE conversion, subnormals included); the activation stays f32;
//! * [`HALF_LANES`] = 16 partial sums `acc[0..16] = +0.0`; column `c`, in increasing
//!   order, does `acc[c % 16] = fma(w[c], x[c], acc[c % 16])`: one fused multiply-add,
//!   one rounding (the product is never rounded on its own);
//! * then `h[i] = acc[i] + acc[i + 8]` for `i < 8`, and the quantized kernels' 8-lane
//!   tree `((h0+h4) + (h2+h6)) + ((h1+h5) + (h3+h7))`.
//!
//! No flush-to-zero anywhere: subnormal weights, activations, products and sums are
//! IEEE arithmetic. `f32::mul_add` is a correctly rounded fused multiply-add on every
//! target (a hardware FMA, or the C library's `fmaf`).

use super::tiles::reduce_lanes;
use crate::format::half_float;
use crate::format::wtype::WType;
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// Partial sums per output in the contract: column `c` goes to lane `c % HALF_LANES`
/// (one zmm, two ymm, four NEON q registers).
pub const HALF_LANES: usize = 16;

/// The contract's reduction: lanes `i` and `i + 8` first, then the 8-lane tree.
#[inline(always)]
pub fn reduce_half_lanes(a: [f32; HALF_LANES]) -> f32 {
    let mut h = [0f32; 8];
    for (i, v) in h.iter_mut().enumerate() {
        *v = a[i] + a[i + 8];
    }
    reduce_lanes(h)
}

/// One row of 2-byte float weights (`wtype` BF16 or F16, their bits) · one f32
/// activation row of the same length.
pub fn dot_half(wtype: WType, w: &[u16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "weights vs activations");
    match wtype {
        WType::BF16 => dot_with(w, x, widen_bf16),
        WType::F16 => dot_with(w, x, widen_f16),
        t => panic!("{t} is not a 2-byte float type"),
    }
}

#[inline(always)]
fn dot_with(w: &[u16], x: &[f32], widen: impl Fn(u16) -> f32) -> f32 {
    dot_iter(w.iter().copied(), x, widen)
}

/// The contract over the weights' bits in column order.
#[inline(always)]
fn dot_iter(w: impl Iterator<Item = u16>, x: &[f32], widen: impl Fn(u16) -> f32) -> f32 {
    let mut acc = [0f32; HALF_LANES];
    for (c, (b, &v)) in w.zip(x).enumerate() {
        let l = c % HALF_LANES;
        acc[l] = widen(b).mul_add(v, acc[l]);
    }
    reduce_half_lanes(acc)
}

/// BF16 bits to f32 (exact).
#[inline(always)]
fn widen_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// F16 bits to f32 (exact).
#[inline(always)]
fn widen_f16(b: u16) -> f32 {
    ::half::f16::from_bits(b).to_f32()
}

/// The scalar tier's BF16 entry (see `table::HalfFn`): `y[t·ld + r]` =
/// row `r` of `w` · token `t` of `x`.
///
/// # Safety
/// `w` holds `rows × cols` weights (little-endian bytes), `x` a whole number of tokens
/// of `cols` values, and `y[t·ld + r]` is writable for every row and token.
pub unsafe fn tile_bf16(rows: usize, cols: usize, w: &[u8], x: &[f32], y: *mut f32, ld: usize) {
    count(Tier::Scalar, Op::Half);
    // SAFETY: forwarded caller contract.
    unsafe { tile(rows, cols, w, x, y, ld, widen_bf16) }
}

/// The scalar tier's F16 entry, as [`tile_bf16`].
///
/// # Safety
/// As [`tile_bf16`].
pub unsafe fn tile_f16(rows: usize, cols: usize, w: &[u8], x: &[f32], y: *mut f32, ld: usize) {
    count(Tier::Scalar, Op::Half);
    // SAFETY: forwarded caller contract.
    unsafe { tile(rows, cols, w, x, y, ld, widen_f16) }
}

/// Every row of `w` against every token of `x` by the contract.
///
/// # Safety
/// As [`tile_bf16`].
#[inline(always)]
unsafe fn tile(
    rows: usize,
    cols: usize,
    w: &[u8],
    x: &[f32],
    y: *mut f32,
    ld: usize,
    widen: fn(u16) -> f32,
) {
    debug_assert_eq!(w.len(), rows * cols * 2);
    for (r, wr) in w.chunks_exact(cols * 2).enumerate() {
        for (t, xt) in x.chunks_exact(cols).enumerate() {
            let bits = wr.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
            // SAFETY: row r < rows and token t of x: writable (caller's contract).
            unsafe { *y.add(t * ld + r) = dot_iter(bits, xt, widen) };
        }
    }
}

/// `y[t·rows + r] = dot(w row r, x row t)` for `n = x.len() / cols` activation rows;
/// `w` is `rows × cols` weights (bits), row-major.
pub fn matmul_half(wtype: WType, rows: usize, cols: usize, w: &[u16], x: &[f32], y: &mut [f32]) {
    assert!(cols > 0 && rows > 0, "empty matrix");
    assert_eq!(w.len(), rows * cols, "weights vs rows × cols");
    assert_eq!(x.len() % cols, 0, "activations vs cols");
    let n = x.len() / cols;
    assert_eq!(y.len(), n * rows, "outputs vs n × rows");
    for (xt, yt) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
        for (wr, o) in w.chunks_exact(cols).zip(yt.iter_mut()) {
            *o = dot_half(wtype, wr, xt);
        }
    }
}

/// `out[c] = w[c]` widened (exact): the embedding lookup of a BF16 / F16 `tok_emb`.
pub fn dequant_row_half(wtype: WType, w: &[u16], out: &mut [f32]) {
    assert_eq!(w.len(), out.len(), "weights vs out");
    half_float::widen(wtype, w, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    const ONE_BF16: u16 = 0x3F80;

    fn rand_row(rng: &mut Rng, t: WType, n: usize) -> (Vec<u16>, Vec<f32>) {
        let w = (0..n)
            .map(|_| half_float::round(t, rng.next_f32() * 0.1))
            .collect();
        let x = (0..n).map(|_| rng.next_f32() * 3.0).collect();
        (w, x)
    }

    #[test]
    fn close_to_the_exact_sum() {
        // Against an independent f64 sum of the exactly widened products: the contract
        // makes one rounding per term, so the error is far below n · 2^-24 · Σ|w·x|.
        let mut rng = Rng(7);
        for t in [WType::BF16, WType::F16] {
            for n in [16, 32, 48, 576, 1536, 2048] {
                let (w, x) = rand_row(&mut rng, t, n);
                let exact: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(&b, &v)| half_float::to_f32(t, b) as f64 * v as f64)
                    .sum();
                let mag: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(&b, &v)| (half_float::to_f32(t, b) as f64 * v as f64).abs())
                    .sum();
                let got = dot_half(t, &w, &x) as f64;
                assert!(
                    (got - exact).abs() <= mag * 4.0 * n as f64 / (1u64 << 24) as f64,
                    "{t} n={n}: {got} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn fused_multiply_add_not_mul_then_add() {
        // Lane 0 gets columns 0 and 16: acc = fma(1, -1, 0) = -1, then
        // fma(1 + 2^-7, 1 - 2^-7 + 2^-20, -1) = -2^-14 + 2^-20 + 2^-27 exactly; a
        // rounded product would lose the 2^-27.
        let mut w = vec![0u16; 32];
        let mut x = vec![0f32; 32];
        (w[0], x[0]) = (ONE_BF16, -1.0);
        let x16 = 1.0 - 2f32.powi(-7) + 2f32.powi(-20);
        (w[16], x[16]) = (0x3F81, x16); // 1 + 2^-7
        let want = -2f32.powi(-14) + 2f32.powi(-20) + 2f32.powi(-27);
        assert_eq!(dot_half(WType::BF16, &w, &x), want);
        let unfused = (1.0f32 + 2f32.powi(-7)) * x16 - 1.0;
        assert_ne!(unfused, want);
    }

    #[test]
    fn lanes_and_tree_order() {
        // Lane i holds v[i] (x = v, w = 1): the tree pairs i with i + 8 first.
        let v: [f32; 16] = [
            1e8, 1.0, -1e8, 3.0, 0.5, 7.0, 2.0, -1.0, 1.0, 1e8, 0.25, -1e8, 5.0, 0.125, 9.0, 4.0,
        ];
        let w = vec![ONE_BF16; 16];
        let h: Vec<f32> = (0..8).map(|i| v[i] + v[i + 8]).collect();
        let tree = ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
        assert_eq!(dot_half(WType::BF16, &w, &v), tree);
        let seq = v.iter().fold(0f32, |a, &b| a + b);
        assert_ne!(
            seq.to_bits(),
            tree.to_bits(),
            "the test must tell the orders apart"
        );
        // Within a lane, columns in increasing order: (0 + 1e8) + 1 = 1e8, then − 1e8.
        let mut w = vec![0u16; 48];
        let mut x = vec![0f32; 48];
        for (c, val) in [(0, 1e8f32), (16, 1.0), (32, -1e8)] {
            (w[c], x[c]) = (ONE_BF16, val);
        }
        assert_eq!(dot_half(WType::BF16, &w, &x), 0.0);
    }

    #[test]
    fn subnormals_are_arithmetic() {
        // A subnormal BF16 weight (2^-133) times 2^100 is 2^-33: no flush to zero.
        let (w, x) = ([1u16; 16], [2f32.powi(100); 16]);
        assert_eq!(dot_half(WType::BF16, &w, &x), 16.0 * 2f32.powi(-33));
        // The smallest F16 subnormal (2^-24) widens exactly.
        assert_eq!(
            dot_half(WType::F16, &[1; 16], &[1.0; 16]),
            16.0 * 2f32.powi(-24)
        );
        // Subnormal products stay (2^-126 · 2^-10 = 2^-136).
        let r = dot_half(WType::BF16, &[0x0080; 16], &[2f32.powi(-10); 16]);
        assert_eq!(r, 16.0 * 2f32.powi(-136));
    }

    #[test]
    fn inf_and_nan() {
        let mut w = vec![ONE_BF16; 32];
        let mut x = vec![1f32; 32];
        x[3] = f32::INFINITY;
        assert_eq!(dot_half(WType::BF16, &w, &x), f32::INFINITY);
        x[19] = f32::NEG_INFINITY; // same lane: inf − inf
        assert!(dot_half(WType::BF16, &w, &x).is_nan());
        x.fill(1.0);
        w[5] = 0x7FC0; // NaN weight
        assert!(dot_half(WType::BF16, &w, &x).is_nan());
    }

    #[test]
    fn matmul_and_dequant() {
        let mut rng = Rng(3);
        for t in [WType::BF16, WType::F16] {
            let (rows, cols, n) = (5, 64, 3);
            let (w, _) = rand_row(&mut rng, t, rows * cols);
            let (_, x) = rand_row(&mut rng, t, n * cols);
            let mut y = vec![0f32; n * rows];
            matmul_half(t, rows, cols, &w, &x, &mut y);
            for tk in 0..n {
                for r in 0..rows {
                    let d = dot_half(t, &w[r * cols..][..cols], &x[tk * cols..][..cols]);
                    assert_eq!(y[tk * rows + r].to_bits(), d.to_bits());
                }
            }
            let mut out = vec![0f32; cols];
            dequant_row_half(t, &w[cols..2 * cols], &mut out);
            for (o, &b) in out.iter().zip(&w[cols..]) {
                assert_eq!(*o, half_float::to_f32(t, b));
            }
        }
    }

    /// The contract is met by the x86 instruction sequences docs/kernels.md names:
    /// exact widening (F16C `vcvtph2ps`; BF16 zero-extend and shift), `vfmadd231ps`
    /// on 16 lanes (one zmm, or two ymm), then lanes i + 8 and the 8-lane tree. These
    /// are test-only sketches of one step per 16 columns (the kernels come with the
    /// SIMD step); they must give the reference's bits.
    #[cfg(target_arch = "x86_64")]
    mod x86_sketch {
        use super::*;
        use std::arch::x86_64::*;

        /// # Safety
        /// Needs AVX2, FMA and F16C; `w.len() == x.len()`, a multiple of 16.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn dot_avx2(t: WType, w: &[u16], x: &[f32]) -> f32 {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in (0..w.len()).step_by(16) {
                // SAFETY: c + 16 ≤ len for both slices; unaligned loads.
                let (a, b, xl, xh) = unsafe {
                    let p = w.as_ptr().add(c) as *const __m128i;
                    (
                        _mm_loadu_si128(p),
                        _mm_loadu_si128(p.add(1)),
                        _mm256_loadu_ps(x.as_ptr().add(c)),
                        _mm256_loadu_ps(x.as_ptr().add(c + 8)),
                    )
                };
                let (wl, wh) = match t {
                    WType::F16 => (_mm256_cvtph_ps(a), _mm256_cvtph_ps(b)),
                    _ => (
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)),
                    ),
                };
                lo = _mm256_fmadd_ps(wl, xl, lo);
                hi = _mm256_fmadd_ps(wh, xh, hi);
            }
            let h = _mm256_add_ps(lo, hi); // lanes i + 8
            let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); // i + 4
            let p = _mm_add_ps(q, _mm_movehl_ps(q, q)); // (0+2), (1+3)
            _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
        }

        /// # Safety
        /// Needs AVX-512 F; `w.len() == x.len()`, a multiple of 16.
        #[target_feature(enable = "avx512f")]
        unsafe fn dot_avx512(t: WType, w: &[u16], x: &[f32]) -> f32 {
            let mut acc = _mm512_setzero_ps();
            for c in (0..w.len()).step_by(16) {
                // SAFETY: c + 16 ≤ len for both slices; unaligned loads.
                let (v, xv) = unsafe {
                    (
                        _mm256_loadu_si256(w.as_ptr().add(c) as *const __m256i),
                        _mm512_loadu_ps(x.as_ptr().add(c)),
                    )
                };
                let wv = match t {
                    WType::F16 => _mm512_cvtph_ps(v),
                    _ => _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)),
                };
                acc = _mm512_fmadd_ps(wv, xv, acc);
            }
            let h = _mm256_add_ps(
                _mm512_castps512_ps256(acc),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)),
            );
            let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
            _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
        }

        #[test]
        fn avx2_fma_f16c_and_avx512f_give_the_reference_bits() {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = is_x86_feature_detected!("avx512f");
            let mut rng = Rng(11);
            let mut checked = 0;
            for t in [WType::BF16, WType::F16] {
                for n in [16, 32, 48, 64, 576, 1536] {
                    for case in 0..20 {
                        let (mut w, mut x) = rand_row(&mut rng, t, n);
                        if case % 4 == 1 {
                            // Subnormal weights and activations, cancellation.
                            for (c, (wb, xv)) in w.iter_mut().zip(x.iter_mut()).enumerate() {
                                if c % 3 == 0 {
                                    *wb = (rng.next_u64() as u16) & 0x807F;
                                    *xv = f32::from_bits(rng.next_u64() as u32 & 0x807F_FFFF);
                                }
                            }
                        }
                        let want = dot_half(t, &w, &x);
                        if avx2 {
                            // SAFETY: features checked above; lengths are multiples of 16.
                            let got = unsafe { dot_avx2(t, &w, &x) };
                            assert_eq!(got.to_bits(), want.to_bits(), "avx2 {t} n={n} case {case}");
                            checked += 1;
                        }
                        if avx512 {
                            // SAFETY: as above.
                            let got = unsafe { dot_avx512(t, &w, &x) };
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "avx512 {t} n={n} case {case}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
            eprintln!("x86 sketches checked against the reference: {checked} dot products");
        }

        #[test]
        fn f16c_widening_equals_the_reference_for_every_f16() {
            if !is_x86_feature_detected!("f16c") {
                return;
            }
            for b in 0..=u16::MAX {
                // SAFETY: F16C checked above.
                let hw = unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(b as i32))) };
                let sw = half_float::to_f32(WType::F16, b);
                if sw.is_nan() {
                    assert!(hw.is_nan(), "{b:#06x}");
                } else {
                    assert_eq!(hw.to_bits(), sw.to_bits(), "{b:#06x}");
                }
            }
        }
    }
}
