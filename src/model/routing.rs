//! A mixture of experts' routing: which experts a token runs and with what weights,
//! from its FFN input `x` (f32, not quantized) and the layer's router (F32, E × dim), as
//! transformers routes (docs/file-format.md, "Mixture of experts"), with the f32
//! arithmetic of docs/kernels.md ("Mixture of experts"):
//!
//! ```text
//! l_e = dot(router_e, x) (+ router_b_e)       the table's f32 dot, then one add
//! gating 0, 1:  m = max_e l_e;  p_e = exp(l_e − m);  s = Σ_e p_e (index order, from +0)
//!               p_e = p_e / s;  the top k of p
//!               gating 1: w_j = p_j / Σ_j p_j (the k, in selection order)
//! gating 2:     the top k of l;  m = l_{j0} (the first chosen);  e_j = exp(l_j − m)
//!               w_j = e_j / Σ_j e_j (selection order)
//! top k: by value, largest first; between equal values the lower index first
//! ```
//!
//! `exp` is the contract's (`Kernels::exp`, the same bits on every tier). The choice
//! and the weights of a token depend on its row alone, so prompt, decode and batched
//! steps route it alike.

use super::config::{Gating, Moe};
use crate::kernels::Kernels;

/// The router logits of one row `x`: `logits[e] = dot(router_e, x) (+ bias[e])`.
pub fn logits(k: &Kernels, router: &[f32], bias: Option<&[f32]>, x: &[f32], logits: &mut [f32]) {
    let dim = x.len();
    for (e, l) in logits.iter_mut().enumerate() {
        *l = k.dot(&router[e * dim..(e + 1) * dim], x);
        if let Some(b) = bias {
            *l += b[e];
        }
    }
}

/// The `ids.len()` largest values of `v` into `ids` (largest first; between equal
/// values the lower index first). A NaN is never chosen over a number.
pub fn top_k(v: &[f32], ids: &mut [u32]) {
    // Strictly better: larger, or a number against a NaN.
    let better = |x: f32, than: f32| x > than || (than.is_nan() && !x.is_nan());
    for j in 0..ids.len() {
        let mut best: Option<usize> = None;
        for (e, &x) in v.iter().enumerate() {
            if ids[..j].contains(&(e as u32)) {
                continue;
            }
            match best {
                Some(b) if !better(x, v[b]) => {}
                _ => best = Some(e),
            }
        }
        ids[j] = best.unwrap_or(0) as u32;
    }
}

/// Routes one row: its router logits `l` (E values; overwritten by the
/// probabilities for gating 0 and 1) give the chosen experts `ids` and their weights
/// `w` (k each, in selection order).
pub fn route(k: &Kernels, moe: &Moe, l: &mut [f32], ids: &mut [u32], w: &mut [f32]) {
    match moe.gating {
        Gating::SoftmaxTopK | Gating::SoftmaxTopKNorm => {
            let m = k.max(l);
            for v in l.iter_mut() {
                *v -= m;
            }
            k.exp(l);
            let mut s = 0.0f32;
            for &p in l.iter() {
                s += p;
            }
            for p in l.iter_mut() {
                *p /= s;
            }
            top_k(l, ids);
            for (w, &e) in w.iter_mut().zip(ids.iter()) {
                *w = l[e as usize];
            }
            if moe.gating == Gating::SoftmaxTopKNorm {
                let mut s = 0.0f32;
                for &p in w.iter() {
                    s += p;
                }
                for p in w.iter_mut() {
                    *p /= s;
                }
            }
        }
        Gating::TopKSoftmax => {
            top_k(l, ids);
            let m = l[ids[0] as usize];
            for (w, &e) in w.iter_mut().zip(ids.iter()) {
                *w = l[e as usize] - m;
            }
            k.exp(w);
            let mut s = 0.0f32;
            for &p in w.iter() {
                s += p;
            }
            for p in w.iter_mut() {
                *p /= s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{Kernels, Tier};

    #[test]
    fn top_k_takes_the_lower_index_of_a_tie_and_never_a_nan() {
        let v = [1.0, 3.0, f32::NAN, 3.0, -1.0, 2.0];
        let mut ids = [0u32; 4];
        top_k(&v, &mut ids);
        assert_eq!(ids, [1, 3, 5, 0]);
        let mut all = [0u32; 6];
        top_k(&v, &mut all);
        assert_eq!(all, [1, 3, 5, 0, 4, 2]);
    }

    #[test]
    fn each_gating_rule() {
        let k = Kernels::for_tier(Tier::Scalar).unwrap();
        let l0 = [0.5f32, 2.0, -1.0, 2.0, 1.0, 0.0];
        let p: Vec<f64> = {
            let e: Vec<f64> = l0.iter().map(|&v| (v as f64 - 2.0).exp()).collect();
            let s: f64 = e.iter().sum();
            e.iter().map(|v| v / s).collect()
        };
        let (mut ids, mut w) = ([0u32; 3], [0f32; 3]);
        for g in [
            Gating::SoftmaxTopK,
            Gating::SoftmaxTopKNorm,
            Gating::TopKSoftmax,
        ] {
            let mut l = l0;
            route(&k, &Moe::routed(6, 3, 32, g), &mut l, &mut ids, &mut w);
            assert_eq!(ids, [1, 3, 4], "{g:?}");
            let want: Vec<f64> = match g {
                Gating::SoftmaxTopK => vec![p[1], p[3], p[4]],
                Gating::SoftmaxTopKNorm => {
                    let s = p[1] + p[3] + p[4];
                    vec![p[1] / s, p[3] / s, p[4] / s]
                }
                Gating::TopKSoftmax => {
                    let e = [1.0, 1.0, (-1.0f64).exp()];
                    let s: f64 = e.iter().sum();
                    e.iter().map(|v| v / s).collect()
                }
            };
            for (a, b) in w.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-6, "{g:?}: {w:?} vs {want:?}");
            }
        }
    }
}
