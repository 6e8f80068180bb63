//! The observer of a forward pass: every matrix input (in f32, before the Q8_0
//! activation rounding) is shown to an [`Observer`] set on the `State`. The
//! [`Collector`] sums an importance matrix from them: for every row `x` (one position)
//! of a matrix input and every channel `j`,
//!
//! ```text
//! sums[slot][j] += (x_j as f64)²
//! ```
//!
//! into these slots of layer `l`:
//!
//! | slot | channels | input of | the vector |
//! |---|---|---|---|
//! | Attn | dim | wq, wk, wv, wg; lqkv, lz, lb, la | rmsnorm(x, attn_norm) |
//! | Wo | q_dim | wo; lout when V·dv = q_dim | attention output before wo (after the gate) / gated delta rule output |
//! | W13 | dim | w1, w3 | rmsnorm(x, ffn_norm) |
//! | W2 | hidden_dim | w2 | act(w1 h) ⊙ (w3 h) |
//! | classifier | dim | wcls (or tok_emb when shared) | rmsnorm(x, final_norm) |
//!
//! `tokens` counts the rows seen by layer 0's Attn input (every position run), and
//! `cls_tokens` the rows seen by the classifier: positions prefilled without logits
//! skip it. A linear-attention layer whose lout input width V·dv differs from q_dim
//! leaves its Wo slot at zero; `mlb-convert` then quantizes that lout (and any matrix
//! whose slot is all zero) with the unweighted search.
//!
//! The forward pass calls this module; the driver that runs forward passes over a text
//! ([`super::imatrix::collect`]) is apart from it.

use std::any::Any;

use super::config::{Config, LayerKind};
use crate::format::mli::{Mli, Slot};

/// Which matrix input the forward pass is showing an [`Observer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// The mixer input (wq/wk/wv/wg, or lqkv/lz/lb/la): dim channels.
    Attn,
    /// The attention output before wo: q_dim channels.
    Wo,
    /// The gated delta rule's output before lout: V·dv channels.
    LinOut,
    /// The FFN input (w1, w3): dim channels.
    W13,
    /// The input of w2: hidden_dim channels.
    W2,
    /// The classifier input (after final_norm): dim channels; the layer is ignored.
    Cls,
}

/// Sees every matrix input of a forward pass: `rows` holds one row per position of the
/// chunk, each as wide as the input (see [`Input`]).
pub trait Observer: Any + Send {
    fn observe(&mut self, layer: usize, input: Input, rows: &[f32]);
}

/// Shows `rows` to the observer, if any (called by the forward pass).
#[inline]
pub(crate) fn tap(obs: &mut Option<Box<dyn Observer>>, layer: usize, input: Input, rows: &[f32]) {
    if let Some(o) = obs.as_mut() {
        o.observe(layer, input, rows);
    }
}

/// Adds `Σ x²` of each column of `rows` (rows of `sums.len()`) into `sums`; returns
/// the number of rows.
fn add_squares(sums: &mut [f64], rows: &[f32]) -> u64 {
    let w = sums.len();
    debug_assert_eq!(rows.len() % w, 0);
    for row in rows.chunks_exact(w) {
        for (s, &v) in sums.iter_mut().zip(row) {
            let v = v as f64;
            *s += v * v;
        }
    }
    (rows.len() / w) as u64
}

/// The [`Observer`] that sums an importance matrix.
#[derive(Debug, Clone)]
pub struct Collector {
    mli: Mli,
    /// V·dv, the width of lout's input (0 without linear layers).
    lin_v_total: usize,
}

impl Collector {
    /// An empty matrix for the model `cfg`.
    pub fn new(cfg: &Config) -> Collector {
        Collector {
            mli: Mli::new(cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.q_dim),
            lin_v_total: if cfg.layers.contains(&LayerKind::Linear) {
                cfg.lin_v_total
            } else {
                0
            },
        }
    }

    /// Whether linear-attention layers feed their lout input into the Wo slot.
    pub fn lout_in_wo(&self) -> bool {
        self.lin_v_total == self.mli.q_dim
    }

    pub fn mli(&self) -> &Mli {
        &self.mli
    }

    pub fn into_mli(self) -> Mli {
        self.mli
    }
}

impl Observer for Collector {
    fn observe(&mut self, layer: usize, input: Input, rows: &[f32]) {
        let m = &mut self.mli;
        match input {
            Input::Attn => {
                let n = add_squares(m.slot_mut(layer, Slot::Attn), rows);
                if layer == 0 {
                    m.tokens += n;
                }
            }
            Input::Wo => {
                add_squares(m.slot_mut(layer, Slot::Wo), rows);
            }
            Input::LinOut => {
                if self.lin_v_total == m.q_dim {
                    add_squares(m.slot_mut(layer, Slot::Wo), rows);
                }
            }
            Input::W13 => {
                add_squares(m.slot_mut(layer, Slot::W13), rows);
            }
            Input::W2 => {
                add_squares(m.slot_mut(layer, Slot::W2), rows);
            }
            Input::Cls => {
                let n = add_squares(m.cls_mut(), rows);
                m.cls_tokens += n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squares_and_counts() {
        let mut s = vec![0.0; 2];
        assert_eq!(add_squares(&mut s, &[1.0, 2.0, 3.0, -4.0]), 2);
        assert_eq!(s, vec![10.0, 20.0]);
    }
}
