//! Importance matrices: the sums of squared matrix inputs per input channel that
//! `mlb-run --imatrix` writes as an MLI1 file ([`crate::format::mli`]) and
//! `mlb-convert --imatrix` uses to weight the Q4_0 search.
//!
//! The forward pass hands every matrix input to an [`Observer`] set on the
//! [`State`] (in f32, before the Q8_0 activation rounding). The [`Collector`] adds,
//! for every row `x` (one position) of a matrix input and every channel `j`,
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

use std::any::Any;
use std::path::Path;

use super::config::{Config, LayerKind};
use super::eval::{self, ChunkStats, EvalError};
use super::forward::{Model, Options, State};
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

impl State {
    /// Shows every following matrix input to `o`.
    pub fn set_observer(&mut self, o: Box<dyn Observer>) {
        self.observer = Some(o);
    }

    /// Removes the observer.
    pub fn take_observer(&mut self) -> Option<Box<dyn Observer>> {
        self.observer.take()
    }

    /// Removes the observer if it is a `T`.
    pub fn take_observer_as<T: Observer>(&mut self) -> Option<Box<T>> {
        let o = self.observer.take()?;
        let any: Box<dyn Any> = o;
        any.downcast::<T>().ok()
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

/// After each chunk of [`collect`]: the chunks done and the perplexity so far.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub done: usize,
    pub total: usize,
    /// Running perplexity over the chunks' second halves (NaN when ctx < 2).
    pub ppl: f64,
}

/// Runs every chunk (each from an empty context, logits at every position, so
/// `tokens = cls_tokens = Σ chunk lengths`) and returns the importance matrix and the
/// perplexity of the chunks' second halves ([`eval`]). `after` sees each chunk's
/// progress and the matrix so far (e.g. to save it every few chunks); its error stops
/// the run.
pub fn collect(
    model: &Model,
    opts: &Options,
    chunks: &[Vec<u32>],
    mut after: impl FnMut(&Progress, &Mli) -> Result<(), EvalError>,
) -> Result<(Mli, ChunkStats), EvalError> {
    let mut st = model.state(opts)?;
    st.set_observer(Box::new(Collector::new(&model.cfg)));
    let mut stats = ChunkStats::default();
    let mut lp = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        st.reset();
        let first = eval::first_scored(chunk.len());
        let mut sink = |pos: usize, logits: &[f32]| {
            if pos >= first && pos + 1 < chunk.len() {
                eval::log_softmax(logits, &mut lp);
                stats.push_nll(-lp[chunk[pos + 1] as usize]);
            }
        };
        model.prefill(&mut st, chunk, Some(&mut sink))?;
        let p = Progress {
            done: i + 1,
            total: chunks.len(),
            ppl: stats.ppl(),
        };
        let obs = st
            .take_observer_as::<Collector>()
            .expect("the collector set above");
        let res = after(&p, obs.mli());
        st.set_observer(obs);
        res?;
    }
    let c = st
        .take_observer_as::<Collector>()
        .expect("the collector set above");
    Ok((c.into_mli(), stats))
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over `path`: a
/// reader never sees a partial file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), EvalError> {
    crate::atomic::write(path, bytes).map_err(|e| EvalError::Io {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
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

    #[test]
    fn atomic_write_replaces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.mli");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        let e = write_atomic(&d.path().join("no/such/x.mli"), b"x").unwrap_err();
        assert!(e.to_string().contains("no/such"), "{e}");
    }
}
