//! BF16 and F16 weights: f32 → 2-byte float by round-to-nearest-even, and back (exact).
//!
//! BF16 is the upper half of an IEEE f32 (8 exponent bits, 7 stored mantissa bits);
//! F16 is IEEE binary16 (5 and 10; subnormals below 2^-14, largest finite 65504).
//! Both conversions round to nearest, ties to even, as IEEE 754 and the `half` crate
//! do (F16 subnormals are kept, rounded the same way). A finite input that rounds to
//! infinity (|x| ≥ 65520 for F16, ≥ 0x7F7F8000 as f32 bits ≈ 3.3961e38 for BF16) is
//! not representable: [`to_half`] reports it instead of storing an infinity. A value
//! that is already a BF16 (any weight of a bf16 checkpoint) converts to BF16 exactly.

use crate::format::wtype::WType;

/// The 2-byte float of `x` in `wtype` (BF16 or F16), round to nearest even.
#[inline]
pub fn round(wtype: WType, x: f32) -> u16 {
    match wtype {
        WType::BF16 => half::bf16::from_f32(x).to_bits(),
        WType::F16 => half::f16::from_f32(x).to_bits(),
        _ => panic!("{wtype} is not a 2-byte float type"),
    }
}

/// `b` (BF16 or F16 bits) as f32: exact.
#[inline]
pub fn to_f32(wtype: WType, b: u16) -> f32 {
    match wtype {
        WType::BF16 => f32::from_bits((b as u32) << 16),
        WType::F16 => half::f16::from_bits(b).to_f32(),
        _ => panic!("{wtype} is not a 2-byte float type"),
    }
}

/// Whether the bits `b` of a 2-byte float are an infinity or NaN (exponent all ones).
#[inline]
pub fn is_non_finite(wtype: WType, b: u16) -> bool {
    match wtype {
        WType::BF16 => b & 0x7F80 == 0x7F80,
        WType::F16 => b & 0x7C00 == 0x7C00,
        _ => panic!("{wtype} is not a 2-byte float type"),
    }
}

/// The largest finite value of `wtype` (BF16 or F16).
pub fn max_finite(wtype: WType) -> f32 {
    match wtype {
        WType::BF16 => half::bf16::MAX.to_f32(),
        WType::F16 => half::f16::MAX.to_f32(),
        _ => panic!("{wtype} is not a 2-byte float type"),
    }
}

/// Rounds finite `x` into `out` (same length). Returns the index of the first value
/// that rounds to infinity (beyond the type's range), if any; `out` is then incomplete.
pub fn to_half(wtype: WType, x: &[f32], out: &mut [u16]) -> Result<(), usize> {
    debug_assert_eq!(x.len(), out.len());
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round(wtype, v);
    }
    match out.iter().position(|&b| is_non_finite(wtype, b)) {
        Some(i) => Err(i),
        None => Ok(()),
    }
}

/// Widens 2-byte floats (bits) to f32: exact.
pub fn widen(wtype: WType, w: &[u16], out: &mut [f32]) {
    debug_assert_eq!(w.len(), out.len());
    for (o, &b) in out.iter_mut().zip(w) {
        *o = to_f32(wtype, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 → binary16 by round-to-nearest-even, written independently of `half`: from
    /// the exact f64 value, scaled so the kept bits are the integer part.
    fn f16_ref(x: f32) -> u16 {
        let sign = if x.is_sign_negative() { 0x8000u16 } else { 0 };
        let a = (x as f64).abs();
        if a == 0.0 {
            return sign;
        }
        // Quantum: 2^(e − 10) for normal binades (e ≥ −14), 2^−24 below (every f32 is
        // a normal f64, so its exponent field is exact).
        let exp = |v: f64| ((v.to_bits() >> 52) & 0x7FF) as i32 - 1023;
        let e = exp(a).max(-14);
        let q = 2f64.powi(e - 10);
        let m = a / q; // exact: a power-of-two scaling
        let (fl, frac) = (m.floor(), m - m.floor());
        let r = if frac > 0.5 || (frac == 0.5 && fl % 2.0 == 1.0) {
            fl + 1.0
        } else {
            fl
        };
        let v = r * q;
        if v > 65504.0 {
            return sign | 0x7C00;
        }
        // Encode v: subnormal when below 2^-14.
        if v < 2f64.powi(-14) {
            return sign | (v / 2f64.powi(-24)) as u16;
        }
        let e = exp(v);
        let mant = (v / 2f64.powi(e) - 1.0) * 1024.0;
        sign | (((e + 15) as u16) << 10) | mant as u16
    }

    /// f32 → bf16 by round-to-nearest-even on the bits (finite inputs).
    fn bf16_ref(x: f32) -> u16 {
        let b = x.to_bits();
        let (hi, lo) = (b >> 16, b & 0xFFFF);
        let up = lo > 0x8000 || (lo == 0x8000 && hi & 1 == 1);
        (hi + up as u32) as u16
    }

    fn sweep() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            65536.0,
            6.1035156e-5,       // 2^-14, smallest normal f16
            5.9604645e-8,       // 2^-24, smallest subnormal f16
            2.9802322e-8,       // 2^-25: a tie between 0 and the smallest subnormal → 0
            4.4703484e-8,       // 1.5 · 2^-25 → rounds up
            1.0 + 1.0 / 2048.0, // tie between 1 and 1 + 2^-10 → 1 (even)
            1.0 + 3.0 / 2048.0, // tie → 1 + 2^-9 (even)
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            3.3961776e38, // 0x7F7F8000: BF16 tie to infinity
        ];
        let mut s = 0x1234_5678_9abc_def1u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let bits = s as u32;
            // Exponents around the f16 range, and anywhere.
            let e = if s >> 63 == 0 {
                (100 + (s >> 40) % 60) as u32
            } else {
                ((s >> 40) % 255) as u32
            };
            v.push(f32::from_bits((bits & 0x807F_FFFF) | (e << 23)));
        }
        v
    }

    #[test]
    fn halves_round_to_nearest_even_like_an_independent_computation() {
        let f16: fn(f32) -> u16 = f16_ref;
        for (w, reference) in [(WType::F16, f16), (WType::BF16, bf16_ref)] {
            for x in sweep() {
                assert_eq!(
                    round(w, x),
                    reference(x),
                    "{w} {x:e} ({:#010x})",
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn widening_is_exact_and_bf16_values_round_trip() {
        for b in 0..=u16::MAX {
            for t in [WType::BF16, WType::F16] {
                let x = to_f32(t, b);
                if !is_non_finite(t, b) {
                    assert_eq!(round(t, x), b, "{t} {b:#06x}");
                }
                assert_eq!(x.is_finite(), !is_non_finite(t, b));
            }
        }
        // Every BF16 value is an f32 with 16 zero low bits; F16 subnormals widen exactly.
        assert_eq!(to_f32(WType::F16, 1), 2f32.powi(-24));
        assert_eq!(to_f32(WType::BF16, 0x3F80), 1.0);
    }

    #[test]
    fn out_of_range_is_reported_with_its_index() {
        let mut out = [0u16; 4];
        assert_eq!(
            to_half(WType::F16, &[1.0, 65519.0, -65504.0, 0.5], &mut out),
            Ok(())
        );
        assert_eq!(out[1], 0x7BFF); // 65519 rounds down to 65504
        assert_eq!(
            to_half(WType::F16, &[1.0, 2.0, -65520.0, 1e9], &mut out),
            Err(2)
        );
        assert_eq!(
            to_half(WType::BF16, &[1.0, f32::MAX, 0.0, 0.0], &mut out),
            Err(1)
        );
        assert!(to_half(WType::BF16, &[3.38e38, 1e-40, 0.0, 0.0], &mut out).is_ok());
        assert_eq!(max_finite(WType::F16), 65504.0);
    }
}
