//! The scalar reference for BF16 weights × activations rounded to BF16: the opt-in
//! contract of `docs/kernels.md` ("BF16 activations"), the arithmetic of AVX-512 BF16's
//! `vdpbf16ps` written out plainly. Every tier that runs this contract gives these bits;
//! [`tile`] is the entry of every tier without `vdpbf16ps` (`kernels::table`).
//!
//! For an output `y = Σ_c w[c]·x[c]` over `cols` columns (a multiple of 32):
//!
//! * each activation is rounded to BF16 once per input ([`round_bf16`]: nearest even,
//!   f32 subnormals to a signed zero, NaN quieted), as llama.cpp rounds its BF16
//!   operands;
//! * [`HALF_LANES`] = 16 partial sums `acc[0..16] = +0.0`; column pair `p` (columns
//!   `2p`, `2p + 1`) goes to lane `p % 16`, in increasing `p`; a pair is two steps, the
//!   odd column first: `acc = step(acc, w[2p+1], x[2p+1])`, then `step(acc, w[2p], x[2p])`;
//! * [`step`] is one fused multiply-add rounded to nearest even, with subnormal inputs
//!   read as zero and a result below the smallest normal flushed to a zero of its sign,
//!   the tininess judged after rounding to 24 bits with an unbounded exponent;
//! * then the 2-byte float contract's reduction ([`reduce_half_lanes`]), IEEE adds.

use super::half::{reduce_half_lanes, HALF_LANES};
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// `x` rounded to BF16 bits: round to nearest, ties to even; a subnormal to the zero of
/// its sign; NaN to a quiet NaN of its sign (the top payload bits kept); overflow to
/// infinity (what rounding gives).
#[inline(always)]
pub fn round_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    let abs = u & 0x7fff_ffff;
    // Branch-free, so that slices of it vectorize.
    let nearest = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
    let nan = ((u >> 16) | 0x40) as u16;
    let zero = ((u >> 16) & 0x8000) as u16;
    if abs > 0x7f80_0000 {
        nan
    } else if abs < 0x0080_0000 {
        zero
    } else {
        nearest
    }
}

/// [`round_bf16`] of every value: `out.len() == x.len()`.
pub fn round_bf16_slice(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len(), "values vs outputs");
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round_bf16(v);
    }
}

/// BF16 bits to f32, a subnormal read as a zero of its sign.
#[inline(always)]
fn widen_daz(b: u16) -> f32 {
    let b = if b & 0x7f80 == 0 { b & 0x8000 } else { b };
    f32::from_bits((b as u32) << 16)
}

/// Just below the smallest normal f32 by half of its binade's unbounded-exponent ulp:
/// an exact result at or above it (in magnitude) rounds to `f32::MIN_POSITIVE` or more.
const TINY_EDGE: f64 = f32::MIN_POSITIVE as f64 * (1.0 - 1.0 / (1u64 << 25) as f64);

/// `fma(w, x, acc)` as `vdpbf16ps` does one element: `w`, `x` and `acc` are never
/// subnormal here (widened with [`widen_daz`], or a previous step's result); the
/// result is flushed to a zero of its sign when, rounded to 24 bits with an unbounded
/// exponent, it is below `f32::MIN_POSITIVE`.
#[inline(always)]
pub fn step(acc: f32, w: f32, x: f32) -> f32 {
    let r = w.mul_add(x, acc);
    let a = r.abs();
    // IEEE rounding in the subnormal range uses a coarser grid than the unbounded
    // exponent: the two disagree only on exact results in (2^-126 - 2^-150, 2^-126 -
    // 2^-151), which IEEE rounds up to 2^-126 and the instruction flushes. The product
    // of two BF16 values is exact in f64, and near 2^-126 so is the sum.
    let tiny = a < f32::MIN_POSITIVE
        || (a == f32::MIN_POSITIVE && ((w as f64).mul_add(x as f64, acc as f64)).abs() < TINY_EDGE);
    if tiny {
        0f32.copysign(r)
    } else {
        r
    }
}

/// One row of BF16 weights (bits) · one row of BF16-rounded activations (bits), by the
/// contract; `w.len() == x.len()`, a multiple of 32.
pub fn dot(w: &[u16], x: &[u16]) -> f32 {
    assert_eq!(w.len(), x.len(), "weights vs activations");
    assert!(
        w.len().is_multiple_of(32),
        "columns must be a multiple of 32"
    );
    dot_iter(w.iter().copied(), x)
}

#[inline(always)]
fn dot_iter(mut w: impl Iterator<Item = u16>, x: &[u16]) -> f32 {
    let mut acc = [0f32; HALF_LANES];
    for (p, xp) in x.chunks_exact(2).enumerate() {
        let (w0, w1) = (w.next().unwrap_or(0), w.next().unwrap_or(0));
        let l = p % HALF_LANES;
        acc[l] = step(acc[l], widen_daz(w1), widen_daz(xp[1]));
        acc[l] = step(acc[l], widen_daz(w0), widen_daz(xp[0]));
    }
    reduce_half_lanes(acc)
}

/// The reference entry (see `table::DotFn`): `y[t·ld + r]` = row `r` of `w` ·
/// token `t` of `x` (BF16 bits, `cols` per token).
///
/// # Safety
/// `w` holds `rows × cols` BF16 weights (little-endian bytes), `x` a whole number of
/// tokens of `cols` values, and `y[t·ld + r]` is writable for every row and token.
pub unsafe fn tile(rows: usize, cols: usize, w: &[u8], x: &[u16], y: *mut f32, ld: usize) {
    count(Tier::Scalar, Op::Dot);
    debug_assert_eq!(w.len(), rows * cols * 2);
    for (r, wr) in w.chunks_exact(cols * 2).enumerate() {
        for (t, xt) in x.chunks_exact(cols).enumerate() {
            let bits = wr.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
            // SAFETY: row r < rows and token t of x: writable (caller's contract).
            unsafe { *y.add(t * ld + r) = dot_iter(bits, xt) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn bf(x: f32) -> u16 {
        round_bf16(x)
    }

    #[test]
    fn rounding_is_nearest_even_with_flushed_subnormals() {
        // Against an independent computation in f64: the nearest BF16 by distance.
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for i in 0..200_000u32 {
            let u = if i < 4096 {
                // Ties and near-ties around every exponent.
                (i << 19) | 0x8000 | (i & 1) << 16
            } else {
                rng.next_u64() as u32
            };
            let x = f32::from_bits(u);
            let got = round_bf16(x);
            if x.is_nan() {
                assert!(f32::from_bits((got as u32) << 16).is_nan(), "{u:08x}");
                assert_eq!(got & 0x8000, (u >> 16) as u16 & 0x8000);
                continue;
            }
            if x != 0.0 && x.abs() < f32::MIN_POSITIVE {
                assert_eq!(got, (u >> 16) as u16 & 0x8000, "subnormal {u:08x}");
                continue;
            }
            let lo = (u >> 16) as u16;
            let hi = lo.wrapping_add(1);
            let widen = |b: u16| match f32::from_bits((b as u32) << 16) {
                // Past the largest finite BF16 the next step is 2^128 (infinity).
                v if v.is_infinite() => v.signum() as f64 * 2f64.powi(128),
                v => v as f64,
            };
            let (vl, vh) = (widen(lo), widen(hi));
            let want = if f32::from_bits((hi as u32) << 16).is_nan() {
                lo
            } else {
                let (dl, dh) = ((x as f64 - vl).abs(), (vh - x as f64).abs());
                if dl < dh || (dl == dh && lo & 1 == 0) {
                    lo
                } else {
                    hi
                }
            };
            assert_eq!(got, want, "{u:08x}");
        }
        assert_eq!(round_bf16(f32::MAX), 0x7f80);
        assert_eq!(round_bf16(-0.0), 0x8000);
        assert_eq!(round_bf16(f32::NEG_INFINITY), 0xff80);
    }

    #[test]
    fn odd_column_first_then_even() {
        // Lane 0 holds pairs 0 and 16 (columns 0, 1 and 32, 33). Pair 0 puts 1 in the
        // lane; pair 16 then adds o = 2^-24 (odd column) and e = 2^-24·(1 + 2^-7):
        // o first ties to 1, and e lifts it to 1 + 2^-23; e first gives 1 + 2^-23, and
        // o then ties up to 1 + 2^-22.
        let mut w = vec![0u16; 64];
        let mut x = vec![0u16; 64];
        (w[1], x[1]) = (bf(1.0), bf(1.0));
        (w[33], x[33]) = (bf(1.0), bf(2f32.powi(-24)));
        (w[32], x[32]) = (bf(1.0), bf(2f32.powi(-24) * (1.0 + 2f32.powi(-7))));
        assert_eq!(dot(&w, &x), 1.0 + 2f32.powi(-23));
        // Lanes: the same pair moved to lane 1 (columns 34, 35) is summed apart from
        // lane 0 and meets it only in the tree: 1 + (2^-24 + 2^-24·(1 + 2^-7)) → 1 + 2^-23.
        let mut w2 = vec![0u16; 64];
        let mut x2 = vec![0u16; 64];
        (w2[1], x2[1]) = (bf(1.0), bf(1.0));
        (w2[35], x2[35]) = (w[33], x[33]);
        (w2[34], x2[34]) = (w[32], x[32]);
        assert_eq!(dot(&w2, &x2), 1.0 + 2f32.powi(-23));
        (w2[3], x2[3]) = (bf(1.0), bf(2f32.powi(-23)));
        assert_eq!(dot(&w2, &x2), 1.0 + 2f32.powi(-22));
    }

    #[test]
    fn subnormals_flush() {
        let mut w = vec![0u16; 32];
        let mut x = vec![0u16; 32];
        // A subnormal weight reads as zero.
        w[1] = 0x0001;
        x[1] = bf(1e30);
        assert_eq!(dot(&w, &x).to_bits(), 0);
        // A product below the normal range flushes.
        w[1] = bf(1e-20);
        x[1] = bf(1e-20);
        assert_eq!(dot(&w, &x).to_bits(), 0);
        // The boundary: 2^-126 - 1.5·2^-151 rounds (unbounded exponent) below 2^-126.
        assert_eq!(
            step(f32::MIN_POSITIVE, 1.5 * 2f32.powi(-76), -(2f32.powi(-75))),
            0.0
        );
        // 2^-126 - 2^-151 is a tie and rounds to 2^-126: kept.
        assert_eq!(
            step(f32::MIN_POSITIVE, 2f32.powi(-75), -(2f32.powi(-76))),
            f32::MIN_POSITIVE
        );
        // A flushed negative result keeps its sign.
        assert_eq!(
            step(-f32::MIN_POSITIVE, 2f32.powi(-70), 2f32.powi(-57)).to_bits(),
            0x8000_0000
        );
    }

    /// The contract is `vdpbf16ps`: the instruction and the reference agree lane for lane,
    /// on random inputs and on ones built to land near the flush boundary.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vdpbf16ps_gives_the_reference_bits() {
        use core::arch::x86_64::*;
        if !is_x86_feature_detected!("avx512bf16") || !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        #[target_feature(enable = "avx512f,avx512bf16")]
        fn hw(acc: &[f32; 16], a: &[u16; 32], b: &[u16; 32]) -> [f32; 16] {
            // SAFETY: 64-byte reads and writes of the arrays; a __m512i and a __m512bh are
            // the same 64 bytes of plain bits.
            unsafe {
                let av: __m512bh = core::mem::transmute(_mm512_loadu_si512(a.as_ptr().cast()));
                let bv: __m512bh = core::mem::transmute(_mm512_loadu_si512(b.as_ptr().cast()));
                let r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc.as_ptr()), av, bv);
                let mut out = [0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), r);
                out
            }
        }
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        // Exact sums within a few 2^-151 of ±2^-126, from either side: acc = ±2^-126
        // (or one f32 step above), a product of ±(1 + k/128)·2^-(145..160).
        let mut edge = Vec::new();
        for e in 145..160 {
            for k in 0..128u16 {
                for (sa, sp) in [(1.0f32, -1.0f32), (-1.0, 1.0), (1.0, 1.0)] {
                    for up in [0u32, 1] {
                        let acc = sa * f32::from_bits(f32::MIN_POSITIVE.to_bits() + up);
                        let a = sp * (1.0 + k as f32 / 128.0) * 2f32.powi(-(e - 70));
                        edge.push((acc, round_bf16(a), round_bf16(2f32.powi(-70))));
                    }
                }
            }
        }
        for (j, chunk) in edge.chunks(16).enumerate() {
            let mut a = [0u16; 32];
            let mut b = [0u16; 32];
            let mut acc = [0f32; 16];
            for (i, &(v, x, y)) in chunk.iter().enumerate() {
                // In the odd element (the first step) or the even one (the second).
                let o = 2 * i + (j & 1);
                (acc[i], a[o], b[o]) = (v, x, y);
            }
            // SAFETY: the CPU has AVX-512 F and BF16 (checked above).
            let got = unsafe { hw(&acc, &a, &b) };
            for i in 0..16 {
                let r = step(acc[i], widen_daz(a[2 * i + 1]), widen_daz(b[2 * i + 1]));
                let r = step(r, widen_daz(a[2 * i]), widen_daz(b[2 * i]));
                assert_eq!(
                    r.to_bits(),
                    got[i].to_bits(),
                    "edge lane {i}: acc {:e} a {:04x} {:04x} b {:04x} {:04x}",
                    acc[i],
                    a[2 * i + 1],
                    a[2 * i],
                    b[2 * i + 1],
                    b[2 * i]
                );
            }
        }
        for case in 0..100_000 {
            let mut a = [0u16; 32];
            let mut b = [0u16; 32];
            let mut acc = [0f32; 16];
            for i in 0..16 {
                let r = rng.next_u64();
                // Exponents spread over the whole range, clustered near the bottom in
                // a third of the cases, with cancelling signs.
                let e = |s: u64| -> u16 {
                    if case % 3 == 0 {
                        (s % 40) as u16
                    } else {
                        (s % 255) as u16
                    }
                };
                a[2 * i] = (r as u16 & 0x807f) | e(r >> 16) << 7;
                a[2 * i + 1] = ((r >> 24) as u16 & 0x807f) | e(r >> 40) << 7;
                b[2 * i] = ((r >> 32) as u16 & 0x807f) | (e(r >> 48) + 60).min(254) << 7;
                b[2 * i + 1] = ((r >> 48) as u16 & 0x807f) | (e(r >> 8) + 60).min(254) << 7;
                let s = rng.next_u64() as u32;
                acc[i] = match case % 4 {
                    0 => 0.0,
                    1 => f32::from_bits(s & 0x8fff_ffff), // small, normal or subnormal
                    _ => {
                        // Minus the first product, so that the sum nearly cancels.
                        let p = widen_daz(a[2 * i + 1]) as f64 * widen_daz(b[2 * i + 1]) as f64;
                        -(p as f32) * (1.0 + (s % 7) as f32 * f32::EPSILON)
                    }
                };
            }
            // SAFETY: the CPU has AVX-512 F and BF16 (checked above).
            let got = unsafe { hw(&acc, &a, &b) };
            for i in 0..16 {
                let acc0 = if acc[i].is_subnormal() {
                    0f32.copysign(acc[i])
                } else {
                    acc[i]
                };
                let r = step(acc0, widen_daz(a[2 * i + 1]), widen_daz(b[2 * i + 1]));
                let r = step(r, widen_daz(a[2 * i]), widen_daz(b[2 * i]));
                let same = r.to_bits() == got[i].to_bits() || (r.is_nan() && got[i].is_nan());
                if !same {
                    panic!(
                        "lane {i} of case {case}: acc {:e} a {:04x} {:04x} b {:04x} {:04x}: \
                         reference {:08x}, vdpbf16ps {:08x}",
                        acc[i],
                        a[2 * i + 1],
                        a[2 * i],
                        b[2 * i + 1],
                        b[2 * i],
                        r.to_bits(),
                        got[i].to_bits()
                    );
                }
            }
        }
    }
}
