//! A mixture of experts' arithmetic (docs/kernels.md, "Mixture of experts"): the router's
//! logits, softmax and top-k (`model::routing`, over the table's `exp` and maximum) and
//! the clamped SwiGLU (`kernels/scalar/math.rs` and its SIMD twin) on every tier against
//! a plain scalar reading of the contract, bit for bit; ties, NaN and the clamp's edges.

use krafla::kernels::scalar::math::{self as sm};
use krafla::model::routing;
use krafla::model::{Gating, Moe};

use super::{bits, Rng};
use crate::util::tiers::all_kernels;

/// The contract's top k of `v`: largest first, the lower index on a tie, a NaN last.
fn top_k(v: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..v.len() as u32).collect();
    let key = |i: &u32| v[*i as usize];
    idx.sort_by(|a, b| match (key(a).is_nan(), key(b).is_nan()) {
        (false, true) => std::cmp::Ordering::Less,
        (true, false) => std::cmp::Ordering::Greater,
        (true, true) => a.cmp(b),
        _ => key(b).partial_cmp(&key(a)).unwrap().then(a.cmp(b)),
    });
    idx.truncate(k);
    idx
}

/// The contract's softmax of `v`: the maximum, `exp(v − m)` with the reference exp, the
/// sum in order from +0, each divided by it.
fn softmax(v: &[f32]) -> Vec<f32> {
    let m = v
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    let e: Vec<f32> = v.iter().map(|&x| sm::exp(x - m)).collect();
    let mut s = 0.0f32;
    for &x in &e {
        s += x;
    }
    e.iter().map(|&x| x / s).collect()
}

/// The contract's routing of one token's logits: the chosen experts and their weights.
fn route_ref(gating: Gating, k: usize, l: &[f32]) -> (Vec<u32>, Vec<f32>) {
    match gating {
        Gating::SoftmaxTopK | Gating::SoftmaxTopKNorm => {
            let p = softmax(l);
            let ids = top_k(&p, k);
            let mut w: Vec<f32> = ids.iter().map(|&e| p[e as usize]).collect();
            if gating == Gating::SoftmaxTopKNorm {
                let mut s = 0.0f32;
                for &x in &w {
                    s += x;
                }
                w.iter_mut().for_each(|x| *x /= s);
            }
            (ids, w)
        }
        Gating::TopKSoftmax => {
            let ids = top_k(l, k);
            let w = softmax(&ids.iter().map(|&e| l[e as usize]).collect::<Vec<_>>());
            (ids, w)
        }
    }
}

#[test]
fn routing_gives_the_contract_bits_on_every_tier() {
    let mut rng = Rng(0x5eed_0042);
    // Expert counts across the vector widths (exp and max run 8 or 16 lanes), k from 1
    // to all; logits from the router, then some with ties and extreme values.
    let mut cases: Vec<(usize, usize, Vec<f32>)> = Vec::new();
    for (ne, k, dim, scale) in [
        (2, 1, 32, 1.0),
        (4, 2, 64, 1.0),
        (8, 3, 96, 3.0),
        (17, 4, 64, 10.0),
        (32, 8, 128, 0.1),
        (64, 8, 64, 30.0),
        (128, 8, 32, 1.0),
    ] {
        let router = rng.vec(ne * dim, 1.0);
        let x = rng.vec(dim, scale);
        let bias = rng.vec(ne, 1.0);
        for b in [None, Some(&bias[..])] {
            let mut l = vec![0.0; ne];
            // The router's logits are the table's f32 dot (one order on every tier).
            routing::logits(&all_kernels()[0], &router, b, &x, &mut l);
            for (e, &got) in l.iter().enumerate() {
                let mut want = sm::dot(&router[e * dim..(e + 1) * dim], &x);
                if let Some(b) = b {
                    want += b[e];
                }
                assert_eq!(got.to_bits(), want.to_bits(), "logit {e} of {ne}");
            }
            cases.push((ne, k, l));
        }
    }
    cases.push((6, 3, vec![1.0, 2.0, 2.0, -1.0, 2.0, 0.5]));
    cases.push((5, 2, vec![0.0; 5]));
    cases.push((6, 2, vec![80.0, -80.0, 1e-40, -0.0, 0.0, 79.9]));
    cases.push((4, 2, vec![f32::NAN, 1.0, 3.0, -2.0]));
    cases.push((8, 4, vec![-1e30, 1e30, 3.0, 3.0, 3.0, -3.0, 1e-3, 1e30]));
    for k in all_kernels() {
        for (ne, kk, l) in &cases {
            for g in [
                Gating::SoftmaxTopK,
                Gating::SoftmaxTopKNorm,
                Gating::TopKSoftmax,
            ] {
                let mut lg = l.clone();
                let (mut ids, mut w) = (vec![0u32; *kk], vec![0f32; *kk]);
                routing::route(&k, &Moe::routed(*ne, *kk, 32, g), &mut lg, &mut ids, &mut w);
                let (want_ids, want_w) = route_ref(g, *kk, l);
                let what = format!(
                    "tier {}, {g:?}, {ne} experts, k {kk}, logits {l:?}",
                    k.tier()
                );
                assert_eq!(ids, want_ids, "{what}: experts");
                assert_eq!(
                    bits(&w),
                    bits(&want_w),
                    "{what}: weights {w:?} vs {want_w:?}"
                );
            }
        }
    }
}

#[test]
fn routing_takes_the_lower_index_on_a_tie() {
    let k = &all_kernels()[0];
    let (mut ids, mut w) = ([0u32; 2], [0f32; 2]);
    let mut l = [1.0, 3.0, 0.0, 3.0];
    routing::route(
        k,
        &Moe::routed(4, 2, 32, Gating::TopKSoftmax),
        &mut l,
        &mut ids,
        &mut w,
    );
    assert_eq!(ids, [1, 3]);
    assert_eq!(w, [0.5, 0.5]);
}

/// Gate and up values around the limit's edges, zeros, subnormals, infinities, NaN.
fn swiglu_inputs(rng: &mut Rng, n: usize, lim: f32) -> (Vec<f32>, Vec<f32>) {
    let edges = [
        0.0,
        -0.0,
        lim,
        -lim,
        lim + 1e-3,
        -lim - 1e-3,
        1e-40,
        -1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        60.0,
        -60.0,
        f32::MAX,
    ];
    let mut g = rng.vec(n, 2.0 * lim);
    let mut u = rng.vec(n, 2.0 * lim);
    for i in 0..n {
        if i % 3 == 0 {
            g[i] = edges[(i / 3) % edges.len()];
        }
        if i % 5 == 1 {
            u[i] = edges[(i / 5) % edges.len()];
        }
    }
    (g, u)
}

#[test]
fn clamped_swiglu_gives_the_scalar_bits_on_every_tier() {
    let mut rng = Rng(77);
    for (lim, alpha) in [(7.0, 1.702), (3.0, 1.0), (0.5, 4.0)] {
        // Lengths across the 8- and 16-lane bodies and their tails.
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100] {
            let (g, u) = swiglu_inputs(&mut rng, n, lim);
            let want: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| {
                    // The contract, written out: clamp, sigmoid by exp, then the products.
                    let g = if g > lim { lim } else { g };
                    let u = if u < -lim {
                        -lim
                    } else if u > lim {
                        lim
                    } else {
                        u
                    };
                    (u + 1.0) * (g / (1.0 + sm::exp(-(g * alpha))))
                })
                .collect();
            for k in all_kernels() {
                let mut got = g.clone();
                k.swiglu_mul(&mut got, &u, lim, alpha);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "tier {}, limit {lim}, alpha {alpha}, length {n}",
                    k.tier()
                );
            }
        }
    }
}

#[test]
fn clamped_swiglu_is_close_to_f64() {
    let (lim, alpha) = (7.0f64, 1.702f64);
    for i in -400..=400 {
        let g = i as f32 * 0.05;
        let u = -i as f32 * 0.03;
        let got = sm::swiglu_clamped(g, u, lim as f32, alpha as f32) as f64;
        let (gd, ud) = ((g as f64).min(lim), (u as f64).clamp(-lim, lim));
        let want = (ud + 1.0) * gd / (1.0 + (-alpha * gd).exp());
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "swiglu({g}, {u}) = {got}, want {want}"
        );
    }
}
