//! `exp`, the maximum, SiLU / GELU (`kernels/scalar/math.rs` and its SIMD twins): the
//! reference against f64, every tier against the reference, bit for bit, on a sweep of
//! the range and its edges.

use krafla::kernels::scalar::math::{self as sm, HI, LO};

use super::same_bits;
use crate::util::tiers::all_kernels;

/// Inputs of `exp` and the activations: a sweep through the range, the cut-offs,
/// subnormals, zeros of both signs, infinities, NaN, the largest values.
fn sweep() -> Vec<f32> {
    let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.05).collect();
    v.extend((0..4000).map(|i| -87.5 + i as f32 * 0.044));
    v.extend([
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        1e-40,
        -1e-40,
        HI,
        HI + 0.01,
        LO,
        LO - 0.01,
        88.0,
        -87.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
    ]);
    v
}

#[test]
fn exp_is_accurate() {
    for x in sweep() {
        let got = sm::exp(x);
        if x.is_nan() {
            assert!(got.is_nan());
            continue;
        }
        let want = (x as f64).exp();
        if x > HI {
            assert_eq!(got, f32::INFINITY, "{x}");
        } else if x < LO {
            assert_eq!(got.to_bits(), 0, "{x}");
        } else {
            let rel = ((got as f64 - want) / want).abs();
            assert!(
                rel < 2.0 * f32::EPSILON as f64,
                "exp({x}) = {got}, want {want}: {rel:e}"
            );
        }
    }
    assert_eq!(sm::exp(0.0), 1.0);
}

#[test]
fn gelu_matches_the_tanh_formula() {
    for x in sweep()
        .into_iter()
        .filter(|x| x.is_finite() && x.abs() < 30.0)
    {
        let xd = x as f64;
        let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd * xd * xd);
        let want = 0.5 * xd * (1.0 + u.tanh());
        let got = sm::gelu_tanh(x) as f64;
        // Relative to |x|: GELU is x times a factor in [0, 1].
        let err = (got - want).abs() / xd.abs().max(1e-30);
        assert!(err < 1e-6, "gelu({x}) = {got}, want {want}");
    }
    assert_eq!(sm::gelu_tanh(0.0), 0.0);
    assert!(sm::gelu_tanh(f32::NAN).is_nan());
}

#[test]
fn exp_max_and_activations_give_the_scalar_bits() {
    let xs = sweep();
    let u: Vec<f32> = (0..xs.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
    for k in all_kernels() {
        let t = k.tier();
        // Every length around the vector widths, and starts off alignment.
        for len in (0..70).chain([xs.len() - 3]) {
            for start in [0, 3] {
                let x = &xs[start..start + len];
                let mut e = x.to_vec();
                k.exp(&mut e);
                let want: Vec<f32> = x.iter().map(|&v| sm::exp(v)).collect();
                same_bits(&e, &want, &format!("{t} exp, len {len}"));
                let m = k.max(x);
                assert_eq!(m.to_bits(), sm::max(x).to_bits(), "{t} max, len {len}");
                let uu = &u[..len];
                let mut g = x.to_vec();
                k.silu_mul(&mut g, uu);
                let want: Vec<f32> = x.iter().zip(uu).map(|(&a, &b)| sm::silu(a) * b).collect();
                same_bits(&g, &want, &format!("{t} silu, len {len}"));
                let mut g = x.to_vec();
                k.gelu_mul(&mut g, uu);
                let want: Vec<f32> = x
                    .iter()
                    .zip(uu)
                    .map(|(&a, &b)| sm::gelu_tanh(a) * b)
                    .collect();
                same_bits(&g, &want, &format!("{t} gelu, len {len}"));
            }
        }
        // NaN is skipped by the maximum; all NaN gives −inf.
        assert_eq!(k.max(&[f32::NAN; 40]), f32::NEG_INFINITY, "{t}");
        let mut mixed = [f32::NAN; 40];
        mixed[37] = -3.0;
        mixed[5] = -7.0;
        assert_eq!(k.max(&mixed), -3.0, "{t}");
    }
}
