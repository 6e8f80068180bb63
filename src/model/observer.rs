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
//! In a mixture-of-experts layer, W13 holds the FFN input of every token (the input of
//! the router and of the shared expert's sw1, sw3); each routed expert `e` has its own
//! sums (an MLI1 version-2 file, [`MoeSums`]): its ew1/ew3 input (the FFN inputs of the
//! tokens routed to it, with their count) and its ew2 input, and the shared expert its
//! sw2 input. The layer's W2 slot stays zero.
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
use crate::format::mli::{ExpertSlot, Mli, MoeSums, Slot};

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
    /// The input of routed expert `e`'s ew1 and ew3: the FFN inputs (dim channels) of
    /// the tokens routed to it, in position order.
    ExpertIn(u32),
    /// The input of routed expert `e`'s ew2: expert_hidden channels, its tokens in
    /// position order.
    ExpertHidden(u32),
    /// The input of the shared expert's sw2: shared_hidden channels.
    SharedHidden,
}

/// Sees every matrix input of a forward pass: `rows` holds one row per position of the
/// chunk, each as wide as the input (see [`Input`]).
pub trait Observer: Any + Send {
    fn observe(&mut self, layer: usize, input: Input, rows: &[f32]);

    /// The experts the router of mixture-of-experts layer `layer` chose for the
    /// positions `pos..`: `k` ids per position, in the order chosen (the largest
    /// weight first; between equal weights the lower id).
    fn routed(&mut self, layer: usize, pos: usize, k: usize, ids: &[u32]) {
        let _ = (layer, pos, k, ids);
    }
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
        let mut mli = Mli::new(cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.q_dim);
        if let Some(m) = cfg.moe.filter(|_| cfg.has_moe()) {
            let layers = (0..cfg.n_layers).filter(|&l| cfg.moe_layers[l]).collect();
            let sums = MoeSums::new(
                layers,
                m.n_experts,
                cfg.dim,
                m.expert_hidden,
                m.shared_hidden,
            );
            mli = mli.with_moe(sums);
        }
        Collector {
            mli,
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
            Input::ExpertIn(e) | Input::ExpertHidden(e) => {
                let slot = match input {
                    Input::ExpertIn(_) => ExpertSlot::In,
                    _ => ExpertSlot::Hidden,
                };
                let Some(x) = m.moe.as_mut() else { return };
                if let Some(sums) = x.expert_mut(layer, e as usize, slot) {
                    let n = add_squares(sums, rows);
                    if slot == ExpertSlot::In {
                        *x.tokens_mut(layer, e as usize).expect("a MoE layer") += n;
                    }
                }
            }
            Input::SharedHidden => {
                if let Some(sums) = m.moe.as_mut().and_then(|x| x.shared_mut(layer)) {
                    add_squares(sums, rows);
                }
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
