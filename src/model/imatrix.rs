//! Importance matrices: the sums of squared matrix inputs per input channel that
//! `mlb-run --imatrix` writes as an MLI1 file ([`crate::format::mli`]) and
//! `mlb-convert --imatrix` uses to weight the Q4_0 search.
//!
//! [`collect`] runs a text through the model in chunks with a [`Collector`] (the
//! forward pass's observer, [`super::observer`], which holds the formula and the
//! slots) and returns the matrix with the text's perplexity.

use std::path::Path;

use super::eval::{self, ChunkStats, EvalError};
use super::forward::{Model, StateOptions};
use crate::format::mli::Mli;

pub use super::observer::{Collector, Input, Observer};

/// After each chunk of [`collect`]: the chunks done and the perplexity so far.
#[derive(Debug, Clone, Copy)]
pub struct ChunkProgress {
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
    opts: &StateOptions,
    chunks: &[Vec<u32>],
    mut after: impl FnMut(&ChunkProgress, &Mli) -> Result<(), EvalError>,
) -> Result<(Mli, ChunkStats), EvalError> {
    let c = Collector::new(&model.cfg);
    let (c, stats) = collect_with(model, opts, chunks, c, |p, c| after(p, c.mli()))?;
    Ok((c.into_mli(), stats))
}

/// [`collect`] with any observer `obs` (e.g. [`super::covariance::CovCollector`]),
/// returned with the perplexity; `after` sees it after each chunk.
pub fn collect_with<O: Observer>(
    model: &Model,
    opts: &StateOptions,
    chunks: &[Vec<u32>],
    obs: O,
    mut after: impl FnMut(&ChunkProgress, &O) -> Result<(), EvalError>,
) -> Result<(O, ChunkStats), EvalError> {
    let mut st = model.state(opts)?;
    st.set_observer(Box::new(obs));
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
        let p = ChunkProgress {
            done: i + 1,
            total: chunks.len(),
            ppl: stats.ppl(),
        };
        let obs = st.take_observer_as::<O>().expect("the observer set above");
        let res = after(&p, &obs);
        st.set_observer(obs);
        res?;
    }
    let c = st.take_observer_as::<O>().expect("the observer set above");
    Ok((*c, stats))
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
