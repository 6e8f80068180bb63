//! Speculative decoding: guess the next few tokens cheaply, check them all with one
//! forward pass of the model, keep the longest prefix it agrees with.
//!
//! A round, after the token `next` was sampled (not yet fed) following the ids `P`:
//! 1. draft `d_1..d_k`: by **lookup** ([`lookup`]: the tokens that followed the latest
//!    earlier occurrence of the last n ids of `P next`, as prompt lookup decoding
//!    does; no second model), or from a **draft model** ([`draft_batch`]: a smaller
//!    model of the same tokenizer, e.g. a Q4_0 copy, decoding `k` tokens, stopping
//!    early where its confidence falls below `p_min`);
//! 2. feed `next d_1..d_k` in one pass, every position's logits kept (the same
//!    prefill path as a prompt: one matrix product per weight for all `k + 1` rows);
//! 3. [`verify`]: sample position by position from those logits with the generation's
//!    own sampler ([`Generator::step_draft`]): greedy keeps `d_i` exactly when it is the
//!    argmax, so the output is the one plain decoding gives, id for id (the logits of a
//!    position are bit-identical however many positions a pass holds). Sampling uses the
//!    standard rule, which keeps the model's distribution: keep `d_i` with probability
//!    min(1, p(d_i) / q(d_i)), else draw from max(0, p − q) normalized and stop (`q`:
//!    the draft model's distribution, a point mass for lookup drafts). When every draft
//!    is kept, the row after `d_k` gives one more token;
//! 4. drop the rejected positions from the caches ([`Session::rewind`]: free
//!    truncation for attention; sliding windows keep `spare` extra ring slots so that
//!    they can; linear-attention (delta-rule) state cannot be truncated, so such a model
//!    takes a [`Snapshot`] before step 2 and goes back through it, feeding the kept ids
//!    again).
//!
//! Each round costs one pass over `k + 1` positions instead of one per token: a win when
//! enough drafts are kept (copied code, rewritten documents, a draft model that agrees).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use super::engine::{Engine, LoadOptions, TokenizerSource};
use super::error::SessionError;
use super::generate::{GenerateOptions, Generation, Generator, Step};
use super::sequence::{Session, Snapshot};
use crate::kernels::HalfActs;
use crate::model::sampler::{Sampler, SamplerOptions};
use crate::model::{LayerKind, StateOptions};

/// Most tokens drafted per round (`--draft-max` default).
pub const DEFAULT_DRAFT_MAX: usize = 8;
/// Longest n-gram a lookup matches (`--lookup-ngram` default).
pub const DEFAULT_NGRAM: usize = 3;
/// A draft model stops drafting at a token it gives less than this probability
/// (`--draft-p-min` default).
pub const DEFAULT_P_MIN: f32 = 0.5;
/// Most tokens drafted per round, at most.
pub const MAX_DRAFT: usize = 64;

/// Where drafts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraftSource {
    /// Prompt lookup: n-grams of the sequence itself.
    Lookup,
    /// A draft model (a `.mlb` of the same tokenizer).
    Model(PathBuf),
}

/// How to decode speculatively (`--lookup` / `--draft`, `--draft-max`,
/// `--lookup-ngram`, `--draft-p-min`).
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOptions {
    pub source: DraftSource,
    /// Most tokens drafted per round.
    pub draft_max: usize,
    /// Lookup: the longest n-gram matched (then shorter ones, down to 1).
    pub ngram: usize,
    /// Draft model: stop drafting at a token of lower probability than this.
    pub p_min: f32,
}

impl SpecOptions {
    /// The defaults for `source`.
    pub fn new(source: DraftSource) -> SpecOptions {
        SpecOptions {
            source,
            draft_max: DEFAULT_DRAFT_MAX,
            ngram: DEFAULT_NGRAM,
            p_min: DEFAULT_P_MIN,
        }
    }

    /// Checks the numbers.
    pub fn validate(&self) -> Result<(), SessionError> {
        let bad = |name, value: String, rule| Err(SessionError::BadOption { name, value, rule });
        if !(1..=MAX_DRAFT).contains(&self.draft_max) {
            return bad(
                "--draft-max",
                self.draft_max.to_string(),
                "must be between 1 and 64",
            );
        }
        if !(1..=16).contains(&self.ngram) {
            return bad(
                "--lookup-ngram",
                self.ngram.to_string(),
                "must be between 1 and 16",
            );
        }
        if !(0.0..=1.0).contains(&self.p_min) {
            return bad("--draft-p-min", self.p_min.to_string(), "must be in [0, 1]");
        }
        Ok(())
    }

    /// Ring slots a session's sliding layers need beyond their window so that a
    /// rejected draft can always be truncated away ([`StateOptions::spare`]).
    pub fn spare(&self) -> usize {
        self.draft_max
    }
}

/// Counts of a generation's (or a server's) speculation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Checking passes (rounds with at least one draft).
    pub rounds: usize,
    /// Tokens drafted.
    pub drafted: usize,
    /// Drafts kept.
    pub accepted: usize,
}

impl SpecStats {
    /// Kept drafts over drafted tokens (0 with none).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    pub fn add(&mut self, other: SpecStats) {
        self.rounds += other.rounds;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }
}

/// Prompt lookup: up to `k` tokens to follow `history`: those after the latest earlier
/// occurrence of its last `n` ids, for `n` from `ngram` down to 1 (the longest that
/// occurs wins). A match whose continuation reaches the end of `history` continues
/// with its own tokens (a repeating pattern). Empty when nothing matches.
pub fn lookup(history: &[u32], ngram: usize, k: usize) -> Vec<u32> {
    let len = history.len();
    for n in (1..=ngram.min(len.saturating_sub(1))).rev() {
        let key = &history[len - n..];
        // The latest start j < len − n whose n ids equal the key.
        let Some(j) = (0..len - n).rev().find(|&j| &history[j..j + n] == key) else {
            continue;
        };
        let from = j + n;
        let mut out: Vec<u32> = Vec::with_capacity(k);
        for i in 0..k {
            let at = from + i;
            out.push(if at < len { history[at] } else { out[at - len] });
        }
        return out;
    }
    Vec::new()
}

/// Tokens drafted for one round, and the draft model's distributions when they were
/// sampled from it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub ids: Vec<u32>,
    /// `ids.len()` × vocab: the distribution each draft was drawn from (a draft model
    /// with a sampling generation); empty: point masses (lookup, or greedy).
    pub q: Vec<f32>,
}

impl Draft {
    /// The distribution draft `i` was drawn from, if recorded.
    pub fn q(&self, i: usize) -> Option<&[f32]> {
        if self.q.is_empty() {
            return None;
        }
        let v = self.q.len() / self.ids.len().max(1);
        Some(&self.q[i * v..(i + 1) * v])
    }
}

/// Why a draft model cannot serve a target, if it cannot: it must have the target's
/// vocabulary and, when both have tokenizers, the same bytes for every token; and its
/// state must be truncatable (no linear-attention layers).
pub fn check_draft(target: &Engine, draft: &Engine) -> Result<(), String> {
    let (tv, dv) = (target.config().vocab, draft.config().vocab);
    if tv != dv {
        return Err(format!(
            "its vocab ({dv}) is not the model's ({tv}): a draft model must share the model's tokenizer"
        ));
    }
    if let (Some(t), Some(d)) = (target.tokenizer(), draft.tokenizer()) {
        if t.n_vocab() != d.n_vocab() {
            return Err(format!(
                "its tokenizer has {} tokens, the model's {}",
                d.n_vocab(),
                t.n_vocab()
            ));
        }
        if let Some(id) = (0..t.n_vocab() as u32).find(|&id| t.token_bytes(id) != d.token_bytes(id))
        {
            return Err(format!(
                "token {id} is {:?} in its tokenizer and {:?} in the model's: a draft model must share the model's tokenizer",
                String::from_utf8_lossy(d.token_bytes(id).unwrap_or_default()),
                String::from_utf8_lossy(t.token_bytes(id).unwrap_or_default()),
            ));
        }
    }
    if draft.config().layers.contains(&LayerKind::Linear) {
        return Err(
            "it has linear-attention (delta-rule) layers, whose state cannot be rolled back after a rejected draft; use an attention-only draft model or --lookup".into(),
        );
    }
    Ok(())
}

/// Loads the draft model at `path` (its tokenizer from the `.mlt` beside it, if there
/// is one) and checks it against `target` ([`check_draft`]).
pub fn load_draft(
    target: &Engine,
    path: &Path,
    pack: bool,
    half_acts: HalfActs,
) -> Result<Engine, SessionError> {
    let draft = Engine::load(&LoadOptions {
        model: path.to_path_buf(),
        tokenizer: TokenizerSource::Beside,
        pack,
        half_acts,
    })?;
    check_draft(target, &draft).map_err(|why| SessionError::BadDraft {
        path: path.to_path_buf(),
        why,
    })?;
    Ok(draft)
}

/// Whether `s` needs a snapshot to roll a round back (linear-attention layers).
pub fn needs_snapshot(s: &Session) -> bool {
    s.engine().config().layers.contains(&LayerKind::Linear)
}

/// The probability of `id` in the softmax of `logits` (temperature 1).
fn softmax_at(logits: &[f32], id: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    (f64::from(logits[id as usize] - max).exp() / sum) as f32
}

/// One sequence's draft model: its session over the draft engine and the sampler that
/// draws its tokens (the generation's options, its own seed).
pub struct DraftModel<'d> {
    pub session: Session<'d>,
    pub sampler: Sampler,
}

impl<'d> DraftModel<'d> {
    /// A session of `draft` sized as `state` (give it the target's context: `ctx`
    /// is cut to the draft's max_seq; sliding layers with spare ring slots) and a
    /// sampler for the generation's `sampling`.
    pub fn new(
        draft: &'d Engine,
        state: &StateOptions,
        sampling: &SamplerOptions,
    ) -> Result<DraftModel<'d>, SessionError> {
        let ctx = state.ctx.map(|c| c.min(draft.config().max_seq));
        Ok(DraftModel {
            session: draft.session(&StateOptions { ctx, ..*state })?,
            sampler: draft_sampler(sampling),
        })
    }
}

/// The draft's sampler for a generation's `sampling`: the same options, another seed.
pub fn draft_sampler(sampling: &SamplerOptions) -> Sampler {
    Sampler::new(SamplerOptions {
        seed: sampling.seed ^ 0x5bd1_e995_d1b5_4a32,
        logprobs: false,
        top_logprobs: 0,
        ..sampling.clone()
    })
}

/// Drafts for several sequences at once from their draft models. `contexts[i]` is
/// sequence `i`'s ids so far, its last sampled token included; each draft session first
/// takes the ids of it that it lacks (one batched step of the draft model; a session
/// holding another sequence goes back to the common prefix, or feeds again from the
/// start), then drafts up to `ks[i]` tokens, one batched step per token. A sequence stops
/// drafting at a token the draft model gives less than `p_min` (greedy: its softmax
/// probability; sampling: `q`), or when the draft's context is full.
pub fn draft_batch(
    drafters: &mut [&mut DraftModel<'_>],
    contexts: &[&[u32]],
    ks: &[usize],
    p_min: f32,
) -> Result<Vec<Draft>, SessionError> {
    let n = drafters.len();
    let mut out: Vec<Draft> = vec![Draft::default(); n];
    // Per sequence: how many it may still draft (0: done).
    let mut left: Vec<usize> = (0..n)
        .map(|i| {
            let room = drafters[i].session.ctx().saturating_sub(contexts[i].len());
            if contexts[i].is_empty() {
                0
            } else {
                ks[i].min(room)
            }
        })
        .collect();
    // Sync: each session holds its context but the last id, which it feeds now.
    let mut feed: Vec<Vec<u32>> = vec![Vec::new(); n];
    for i in 0..n {
        if left[i] == 0 {
            continue;
        }
        let c = contexts[i];
        let s = &mut drafters[i].session;
        let keep = s.common_prefix(c).min(c.len() - 1);
        s.rewind(keep, &[])?;
        feed[i] = c[keep..].to_vec();
    }
    let mut q_row = Vec::new();
    loop {
        let ids: Vec<&[u32]> = feed.iter().map(Vec::as_slice).collect();
        if ids.iter().all(|l| l.is_empty()) {
            break;
        }
        {
            let mut sessions: Vec<&mut Session<'_>> =
                drafters.iter_mut().map(|d| &mut d.session).collect();
            super::feed_batch(&mut sessions, &ids)?;
        }
        for i in 0..n {
            if feed[i].is_empty() {
                continue;
            }
            feed[i].clear();
            let d = &mut *drafters[i];
            let logits = d.session.logits().ok_or(SessionError::NoLogits)?;
            let mut history = contexts[i].to_vec();
            history.extend_from_slice(&out[i].ids);
            let (id, p) = if d.sampler.greedy() {
                let id = d.sampler.sample_with(logits, &history).id;
                (id, softmax_at(logits, id))
            } else {
                d.sampler.distribution(logits, &history, &mut q_row);
                let id = d.sampler.sample_from(&q_row);
                (id, q_row[id as usize])
            };
            if p < p_min {
                left[i] = 0;
                continue;
            }
            out[i].ids.push(id);
            if !d.sampler.greedy() {
                out[i].q.extend_from_slice(&q_row);
            }
            left[i] -= 1;
            if left[i] > 0 {
                feed[i].push(id);
            }
        }
    }
    Ok(out)
}

/// What [`verify`] decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The tokens taken, in order: the kept drafts, then the correction (or the token
    /// after the last draft), unless a stop came first.
    pub steps: Vec<Step>,
    /// Drafts kept.
    pub accepted: usize,
}

/// Checks `draft` after a pass that fed `next d_1..d_k` to `s` and kept every
/// position's logits (`rows`: `(k + 1)` × vocab, the logits after `next`, after
/// `d_1`, ...): samples position by position with `gen` ([`Generator::step_draft`];
/// the module docs), until a draft is refused, the generation stops, or the row after
/// `d_k` gave one more token. Then `s` is rolled back to hold the ids up to the last
/// step's token, that token not fed (as after a plain step): by truncation, or through
/// `snapshot` (taken before the pass) for state that cannot be truncated.
pub fn verify(
    gen: &mut Generator<'_>,
    s: &mut Session<'_>,
    draft: &Draft,
    rows: &[f32],
    snapshot: Option<&Snapshot>,
) -> Result<Verdict, SessionError> {
    let k = draft.ids.len();
    let vocab = rows.len() / (k + 1);
    let p0 = s.pos() - (k + 1);
    let ctx = s.ctx();
    let mut steps = Vec::with_capacity(k + 1);
    let mut accepted = 0;
    let mut keep = s.pos();
    for i in 0..=k {
        let at = p0 + 1 + i;
        let row = &rows[i * vocab..(i + 1) * vocab];
        let history = &s.tokens()[..at];
        let (step, kept) = if i < k {
            gen.step_draft(row, history, at, ctx, draft.ids[i], draft.q(i))?
        } else {
            (gen.step_on(row, history, at, ctx)?, false)
        };
        let stop = step.stop.is_some();
        steps.push(step);
        accepted += usize::from(kept);
        if stop || !kept {
            keep = at;
            break;
        }
    }
    if keep < s.pos() {
        s.rewind(keep, snapshot.map(std::slice::from_ref).unwrap_or_default())?;
    }
    Ok(Verdict { steps, accepted })
}

/// A single sequence's speculation (mlb-run): where its drafts come from and what they
/// gave.
pub struct Speculator<'d> {
    opts: SpecOptions,
    model: Option<DraftModel<'d>>,
    pub stats: SpecStats,
}

impl<'d> Speculator<'d> {
    /// Lookup drafts (`opts.source` should be [`DraftSource::Lookup`]).
    pub fn lookup(opts: &SpecOptions) -> Speculator<'static> {
        Speculator {
            opts: opts.clone(),
            model: None,
            stats: SpecStats::default(),
        }
    }

    /// Drafts from `draft` (loaded with [`load_draft`]), its session sized as `state`.
    pub fn with_model(
        opts: &SpecOptions,
        draft: &'d Engine,
        state: &StateOptions,
        sampling: &SamplerOptions,
    ) -> Result<Speculator<'d>, SessionError> {
        Ok(Speculator {
            opts: opts.clone(),
            model: Some(DraftModel::new(draft, state, sampling)?),
            stats: SpecStats::default(),
        })
    }

    /// Up to `k` tokens to follow `context`.
    pub fn draft(&mut self, context: &[u32], k: usize) -> Result<Draft, SessionError> {
        if k == 0 {
            return Ok(Draft::default());
        }
        match &mut self.model {
            None => Ok(Draft {
                ids: lookup(context, self.opts.ngram, k),
                q: Vec::new(),
            }),
            Some(m) => Ok(draft_batch(&mut [m], &[context], &[k], self.opts.p_min)?
                .pop()
                .unwrap_or_default()),
        }
    }
}

impl Session<'_> {
    /// [`Session::generate`], speculatively: each round drafts with `spec` and checks
    /// the drafts in one pass (the module docs). Greedy, the ids are those of
    /// [`Session::generate`]; sampling, they follow the same distribution (not the
    /// same ids for a seed). `on` sees each step; afterwards the session holds what
    /// [`Session::generate`] leaves (every id but the last sampled, no logits).
    pub fn generate_speculative(
        &mut self,
        opts: &GenerateOptions,
        spec: &mut Speculator<'_>,
        mut on: impl FnMut(&Step) -> ControlFlow<()>,
    ) -> Result<Generation, SessionError> {
        let mut g = Generator::new(self.engine(), opts.clone())?;
        let snap_needed = needs_snapshot(self);
        let mut next: Option<u32> = None;
        let mut rows: Vec<f32> = Vec::new();
        'gen: while !g.done() {
            // The position before this round's first step (its token not fed).
            let base = self.pos() + usize::from(next.is_some());
            let steps = match next {
                None => vec![g.step(self)?],
                Some(id) => {
                    let mut context = self.tokens().to_vec();
                    context.push(id);
                    let room = self.ctx().saturating_sub(self.pos() + 1);
                    let k = spec
                        .opts
                        .draft_max
                        .min(g.remaining().saturating_sub(1))
                        .min(room);
                    let draft = spec.draft(&context, k)?;
                    if draft.ids.is_empty() {
                        self.feed(&[id])?;
                        vec![g.step(self)?]
                    } else {
                        let snap = snap_needed.then(|| self.snapshot());
                        let mut fed = Vec::with_capacity(draft.ids.len() + 1);
                        fed.push(id);
                        fed.extend_from_slice(&draft.ids);
                        rows.clear();
                        self.feed_with(&fed, Some(&mut |_, l: &[f32]| rows.extend_from_slice(l)))?;
                        let v = verify(&mut g, self, &draft, &rows, snap.as_ref())?;
                        spec.stats.rounds += 1;
                        spec.stats.drafted += draft.ids.len();
                        spec.stats.accepted += v.accepted;
                        v.steps
                    }
                }
            };
            for (j, step) in steps.iter().enumerate() {
                let flow = on(step);
                if step.stop.is_some() {
                    break 'gen;
                }
                if flow.is_break() {
                    g.cancel();
                    // Hold the ids before this step's token, as a plain cancel would.
                    let at = base + j;
                    if at < self.pos() {
                        self.rewind(at, &[])?;
                    }
                    break 'gen;
                }
                next = Some(step.id);
            }
        }
        Ok(self.finish_generation(g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_finds_the_latest_longest_match() {
        // "a b c x a b c" -> after the last "a b c": "x".
        assert_eq!(lookup(&[1, 2, 3, 9, 1, 2, 3], 3, 1), vec![9]);
        // The longest n-gram wins over a later shorter one.
        assert_eq!(lookup(&[1, 2, 3, 7, 5, 3, 8, 2, 3], 2, 2), vec![7, 5]);
        // A repeating pattern continues past the end.
        assert_eq!(lookup(&[4, 5, 4, 5], 2, 5), vec![4, 5, 4, 5, 4]);
        assert!(lookup(&[1, 2, 3], 3, 4).is_empty());
        assert!(lookup(&[], 3, 4).is_empty());
        assert!(lookup(&[1], 3, 4).is_empty());
    }

    #[test]
    fn options_are_checked() {
        let ok = SpecOptions::new(DraftSource::Lookup);
        assert!(ok.validate().is_ok());
        for o in [
            SpecOptions {
                draft_max: 0,
                ..ok.clone()
            },
            SpecOptions {
                ngram: 0,
                ..ok.clone()
            },
            SpecOptions {
                p_min: 2.0,
                ..ok.clone()
            },
        ] {
            assert!(o.validate().is_err(), "{o:?}");
        }
    }
}
