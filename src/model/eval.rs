//! Quality measurement over chunks of a text: perplexity, and the KL divergence of a
//! model's next-token distributions from a reference model's.
//!
//! The token stream is cut into consecutive chunks of `ctx` tokens ([`chunks`]; with a
//! tokenizer that adds BOS, each chunk is BOS followed by `ctx − 1` text tokens), and
//! each chunk runs from an empty context. Only the second half of each chunk is
//! scored, so every scored token has at least `ctx/2` tokens of context (llama.cpp's
//! definition): with `first = ⌊ctx/2⌋`, position `i ∈ [first, ctx − 1)` predicts token
//! `t[i+1]`, and
//!
//! ```text
//! log p_i  = log_softmax(logits_i)                  (f64)
//! NLL_i    = −log p_i[t[i+1]]
//! PPL      = exp(mean_i NLL_i)                      over all chunks' scored positions
//! KL_i     = Σ_v p_ref,i[v] · (log p_ref,i[v] − log p_i[v])    KL(ref ‖ model)
//! mean KL ± 1.96 · sd / √n    (sd: the sample standard deviation over positions)
//! p99      = the 99th percentile of KL_i (nearest rank: the ⌈0.99 n⌉-th smallest)
//! top-1    = the share of positions where both models' most likely tokens agree
//! ```
//!
//! The last token of a chunk is only a target, so [`perplexity`] and [`kl_divergence`]
//! never run it, and they prefill the first half without logits.

use std::fmt;
use std::path::PathBuf;

use crate::kernels::pool;

use super::error::ModelError;
use super::forward::{Model, State, StateOptions};
use super::sampler::argmax;

/// Why a measurement could not run.
#[derive(Debug, Clone, PartialEq)]
pub enum EvalError {
    /// The model refused (options, tokens).
    Model(ModelError),
    /// The text is shorter than one chunk.
    TooFewTokens { tokens: usize, ctx: usize },
    /// Scoring needs at least two tokens per chunk.
    CtxTooSmall { ctx: usize },
    /// The reference model's vocabulary differs.
    VocabMismatch { model: usize, reference: usize },
    /// A file could not be written.
    Io { path: PathBuf, msg: String },
}

impl fmt::Display for EvalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvalError::Model(e) => write!(f, "{e}"),
            EvalError::TooFewTokens { tokens, ctx } => write!(
                f,
                "the text has {tokens} tokens, fewer than one chunk of --ctx {ctx}: give more text or a smaller --ctx"
            ),
            EvalError::CtxTooSmall { ctx } => write!(
                f,
                "--ctx = {ctx}: scoring the second half of each chunk needs --ctx of at least 2"
            ),
            EvalError::VocabMismatch { model, reference } => write!(
                f,
                "--kl-divergence: the reference has vocab {reference} but the model has {model}: both must share a tokenizer"
            ),
            EvalError::Io { path, msg } => write!(f, "{}: {msg}", path.display()),
        }
    }
}

impl std::error::Error for EvalError {}

impl From<ModelError> for EvalError {
    fn from(e: ModelError) -> Self {
        EvalError::Model(e)
    }
}

/// Consecutive chunks of `ctx` tokens of `tokens` (the rest is dropped); with `bos`,
/// each chunk is `bos` then `ctx − 1` tokens, and a leading `bos` of `tokens` is
/// skipped. At most `max` chunks when given.
pub fn chunks(
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max: Option<usize>,
) -> Result<Vec<Vec<u32>>, EvalError> {
    if ctx == 0 {
        return Err(EvalError::CtxTooSmall { ctx });
    }
    let (text, step) = match bos {
        Some(b) => {
            let t = tokens.strip_prefix(&[b]).unwrap_or(tokens);
            (t, ctx - 1)
        }
        None => (tokens, ctx),
    };
    // ctx = 1 with BOS (step 0): every chunk is BOS alone; one per text token.
    let n = text.len().checked_div(step).unwrap_or(text.len());
    let n = max.map_or(n, |m| n.min(m));
    if n == 0 {
        return Err(EvalError::TooFewTokens {
            tokens: tokens.len(),
            ctx,
        });
    }
    Ok((0..n)
        .map(|i| {
            let mut c = Vec::with_capacity(ctx);
            c.extend(bos);
            c.extend_from_slice(&text[i * step..(i + 1) * step]);
            c
        })
        .collect())
}

/// The first scored position of a chunk of `n` tokens: `⌊n/2⌋`.
pub fn first_scored(n: usize) -> usize {
    n / 2
}

/// `out = log_softmax(logits)` in f64.
pub fn log_softmax(logits: &[f32], out: &mut Vec<f64>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    out.clear();
    out.extend(logits.iter().map(|&v| v as f64 - lse));
}

/// `KL(p ‖ q) = Σ p (log p − log q)` from log-probabilities.
pub fn kl(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&a, &b)| if a > -700.0 { a.exp() * (a - b) } else { 0.0 })
        .sum::<f64>()
        .max(0.0)
}

/// Running mean and variance (Welford).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mean {
    pub n: u64,
    mean: f64,
    m2: f64,
}

impl Mean {
    pub fn push(&mut self, x: f64) {
        self.n += 1;
        let d = x - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (x - self.mean);
    }

    /// NaN when empty.
    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            self.mean
        }
    }

    /// Sample standard deviation (n − 1); 0 for one value.
    pub fn sd(&self) -> f64 {
        if self.n < 2 {
            0.0
        } else {
            (self.m2 / (self.n - 1) as f64).sqrt()
        }
    }

    /// Half-width of the 95% confidence interval of the mean: 1.96 · sd / √n.
    pub fn ci95(&self) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            1.96 * self.sd() / (self.n as f64).sqrt()
        }
    }
}

/// NLL statistics of the scored positions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ChunkStats {
    pub nll: Mean,
}

impl ChunkStats {
    pub fn push_nll(&mut self, nll: f64) {
        self.nll.push(nll);
    }

    /// exp(mean NLL); NaN with no scored position.
    pub fn ppl(&self) -> f64 {
        self.nll.mean().exp()
    }
}

/// The result of [`perplexity`].
#[derive(Debug, Clone, PartialEq)]
pub struct PplReport {
    pub chunks: usize,
    pub ctx: usize,
    pub stats: ChunkStats,
}

/// The result of [`kl_divergence`].
#[derive(Debug, Clone, PartialEq)]
pub struct KlReport {
    pub chunks: usize,
    pub ctx: usize,
    /// KL(ref ‖ model) per scored position.
    pub kl: Mean,
    /// 99th percentile of the per-position KL.
    pub kl_p99: f64,
    /// Largest per-position KL.
    pub kl_max: f64,
    /// Positions where both argmaxes agree.
    pub top1: u64,
    /// The model's NLL and the reference's on the same positions.
    pub model: ChunkStats,
    pub reference: ChunkStats,
}

impl KlReport {
    /// Share of positions where the most likely tokens agree.
    pub fn top1_rate(&self) -> f64 {
        self.top1 as f64 / self.kl.n.max(1) as f64
    }
}

/// The nearest-rank `q` quantile (0 < q ≤ 1) of `v` (sorted in place); NaN if empty.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn check_chunks(chunks: &[Vec<u32>]) -> Result<usize, EvalError> {
    let ctx = chunks.first().map_or(0, Vec::len);
    if ctx < 2 {
        return Err(EvalError::CtxTooSmall { ctx });
    }
    Ok(ctx)
}

/// Starts chunk `c` afresh in `st`: resets it and feeds the unscored first half.
/// Returns the first scored position.
fn feed_unscored(model: &Model, st: &mut State, c: &[u32]) -> Result<usize, EvalError> {
    st.reset();
    let first = first_scored(c.len());
    if first > 0 {
        model.prefill(st, &c[..first], None)?;
    }
    Ok(first)
}

/// Perplexity of `model` over the second half of each chunk. `progress` sees the
/// chunks done and the running statistics.
pub fn perplexity(
    model: &Model,
    opts: &StateOptions,
    chunks: &[Vec<u32>],
    mut progress: impl FnMut(usize, &ChunkStats),
) -> Result<PplReport, EvalError> {
    let ctx = check_chunks(chunks)?;
    let mut st = model.state(opts)?;
    let mut stats = ChunkStats::default();
    let mut lp = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        let first = feed_unscored(model, &mut st, c)?;
        let mut sink = |pos: usize, logits: &[f32]| {
            log_softmax(logits, &mut lp);
            stats.push_nll(-lp[c[pos + 1] as usize]);
        };
        model.prefill(&mut st, &c[first..c.len() - 1], Some(&mut sink))?;
        progress(i + 1, &stats);
    }
    Ok(PplReport {
        chunks: chunks.len(),
        ctx,
        stats,
    })
}

/// Most positions whose logits are held at once per model in [`kl_divergence`].
const KL_ROWS: usize = 32;

/// Per-position results of comparing two logit rows.
struct Cmp {
    kl: f64,
    nll_ref: f64,
    nll: f64,
    agree: bool,
}

fn compare(r: &[f32], m: &[f32], target: usize) -> Cmp {
    let (mut lr, mut lm) = (Vec::new(), Vec::new());
    log_softmax(r, &mut lr);
    log_softmax(m, &mut lm);
    Cmp {
        kl: kl(&lr, &lm),
        nll_ref: -lr[target],
        nll: -lm[target],
        agree: argmax(r) == argmax(m),
    }
}

/// KL(reference ‖ model) over the second half of each chunk, both models run in
/// lockstep on the same tokens (no logits are stored beyond [`KL_ROWS`] positions).
/// `progress` sees the chunks done and the running mean KL.
pub fn kl_divergence(
    reference: &Model,
    model: &Model,
    opts: &StateOptions,
    chunks: &[Vec<u32>],
    mut progress: impl FnMut(usize, &Mean),
) -> Result<KlReport, EvalError> {
    let ctx = check_chunks(chunks)?;
    let vocab = model.cfg.vocab;
    if reference.cfg.vocab != vocab {
        return Err(EvalError::VocabMismatch {
            model: vocab,
            reference: reference.cfg.vocab,
        });
    }
    let mut st_ref = reference.state(opts)?;
    let mut st = model.state(opts)?;
    let mut rep = KlReport {
        chunks: chunks.len(),
        ctx,
        kl: Mean::default(),
        kl_p99: f64::NAN,
        kl_max: 0.0,
        top1: 0,
        model: ChunkStats::default(),
        reference: ChunkStats::default(),
    };
    let mut all_kl = Vec::new();
    let mut rows_ref = vec![0f32; KL_ROWS * vocab];
    let mut rows = vec![0f32; KL_ROWS * vocab];
    for (i, c) in chunks.iter().enumerate() {
        feed_unscored(reference, &mut st_ref, c)?;
        let first = feed_unscored(model, &mut st, c)?;
        let end = c.len() - 1;
        let mut a = first;
        while a < end {
            let b = (a + KL_ROWS).min(end);
            for (m, s, buf) in [
                (reference, &mut st_ref, &mut rows_ref),
                (model, &mut st, &mut rows),
            ] {
                let mut sink = |pos: usize, l: &[f32]| {
                    let r = pos - a;
                    buf[r * vocab..(r + 1) * vocab].copy_from_slice(l);
                };
                m.prefill(s, &c[a..b], Some(&mut sink))?;
            }
            let mut cmp: Vec<Option<Cmp>> = (0..b - a).map(|_| None).collect();
            pool::for_chunks(&mut cmp, 1, |r, x| {
                let rr = &rows_ref[r * vocab..(r + 1) * vocab];
                let rm = &rows[r * vocab..(r + 1) * vocab];
                x[0] = Some(compare(rr, rm, c[a + r + 1] as usize));
            });
            for x in cmp.into_iter().flatten() {
                rep.kl.push(x.kl);
                rep.kl_max = rep.kl_max.max(x.kl);
                all_kl.push(x.kl);
                rep.reference.push_nll(x.nll_ref);
                rep.model.push_nll(x.nll);
                rep.top1 += x.agree as u64;
            }
            a = b;
        }
        progress(i + 1, &rep.kl);
    }
    rep.kl_p99 = percentile(&mut all_kl, 0.99);
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking() {
        let t: Vec<u32> = (10..20).collect();
        let c = chunks(&t, 4, None, None).unwrap();
        assert_eq!(c, vec![vec![10, 11, 12, 13], vec![14, 15, 16, 17]]);
        let c = chunks(&t, 4, Some(1), Some(2)).unwrap();
        assert_eq!(c, vec![vec![1, 10, 11, 12], vec![1, 13, 14, 15]]);
        let mut b = vec![1];
        b.extend(&t);
        assert_eq!(chunks(&b, 4, Some(1), None).unwrap().len(), 3);
        assert_eq!(
            chunks(&t, 11, None, None).unwrap_err(),
            EvalError::TooFewTokens {
                tokens: 10,
                ctx: 11
            }
        );
    }

    #[test]
    fn softmax_kl_percentile() {
        let mut lp = Vec::new();
        log_softmax(&[0.0, 0.0], &mut lp);
        assert!((lp[0] + 2f64.ln()).abs() < 1e-12);
        assert_eq!(kl(&lp, &lp), 0.0);
        let mut lq = Vec::new();
        log_softmax(&[1.0, 0.0], &mut lq);
        // KL([.5,.5] ‖ [σ(1), 1 − σ(1)]) by hand.
        let s = 1.0 / (1.0 + (-1f64).exp());
        let want = 0.5 * (0.5 / s).ln() + 0.5 * (0.5 / (1.0 - s)).ln();
        assert!((kl(&lp, &lq) - want).abs() < 1e-12);
        let mut v: Vec<f64> = (1..=200).map(f64::from).collect();
        v.reverse();
        assert_eq!(percentile(&mut v, 0.99), 198.0);
    }

    #[test]
    fn mean_and_ci() {
        let mut m = Mean::default();
        for x in [1.0, 2.0, 3.0, 4.0] {
            m.push(x);
        }
        assert!((m.mean() - 2.5).abs() < 1e-12);
        let sd = (5.0f64 / 3.0).sqrt();
        assert!((m.sd() - sd).abs() < 1e-12);
        assert!((m.ci95() - 1.96 * sd / 2.0).abs() < 1e-12);
    }
}
