//! Generation: sample a token from the session's logits, decide whether to stop, feed
//! it, again. [`Generator`] is one step of that loop, so that a caller can run the
//! steps of several sessions together (a server's batch); [`Session::generate`]
//! is the loop for one.
//!
//! A step samples `id` ([`Sampler::sample_with`], penalties over the session's ids),
//! then, in this order:
//! 1. `id` in the stop set (the engine's, [`Engine::stop_ids`], unless `ignore_eos`,
//!    and `stop_ids`): stop (`StopId`); its text is not given out;
//! 2. its text (the tokenizer's stream decoder: only complete UTF-8; without a
//!    tokenizer, the id in decimal, space-separated) joins any held-back text; a
//!    complete stop string ends the text before it (`StopString`); text that could
//!    still become a stop string is held back;
//! 3. `max_tokens` sampled: stop (`Length`); the context full: stop (`ContextFull`).
//!
//! Otherwise the caller feeds `id` and steps again. The last sampled token is never
//! fed (nothing needs its logits).
//!
//! With a [`Constraint`] ([`Generator::with_constraint`]) the sample is drawn from the
//! logits with every token the grammar does not allow next set to −∞.

use std::ops::ControlFlow;

use super::constraint::Constraint;
use super::engine::Engine;
use super::error::SessionError;
use super::sequence::Session;
use crate::model::sampler::{Logprobs, Sampled, Sampler, SamplerOptions};
use crate::tokenizer::StreamDecoder;

/// mlb-run's `-n` default.
pub const DEFAULT_MAX_TOKENS: usize = 128;

/// How to generate: length, sampling, stops.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens sampled (a stop id included).
    pub max_tokens: usize,
    pub sampling: SamplerOptions,
    /// Do not stop at the engine's stop set ([`Engine::stop_ids`]: the tokenizer's EOS,
    /// the chat section's end-of-turn and generation_config ids); `stop_ids` still apply.
    pub ignore_eos: bool,
    /// More ids that end the generation, besides the engine's stop set.
    pub stop_ids: Vec<u32>,
    /// Texts that end the generation; the text given out stops before them.
    pub stop_strings: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: DEFAULT_MAX_TOKENS,
            sampling: SamplerOptions::default(),
            ignore_eos: false,
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop id was sampled (this one).
    StopId(u32),
    /// The stop string of this index in `stop_strings` appeared.
    StopString(usize),
    /// `max_tokens` were sampled.
    Length,
    /// The session's context is full.
    ContextFull,
    /// The caller ended it.
    Cancelled,
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub id: u32,
    /// The text it completes (maybe empty: an incomplete character or a possible stop
    /// string held back, or a stop id).
    pub text: String,
    pub logprobs: Option<Logprobs>,
    /// Set on the last step.
    pub stop: Option<StopReason>,
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Every sampled id, a stop id included.
    pub tokens: Vec<u32>,
    /// The whole text (the steps' texts, then `tail`).
    pub text: String,
    /// Text no step gave out: bytes the decoder held back (incomplete UTF-8 becomes
    /// U+FFFD) or the start of a stop string that never completed.
    pub tail: String,
    pub stop: StopReason,
}

/// The state of one generation between steps.
pub struct Generator<'e> {
    opts: GenerateOptions,
    /// The ids that stop it, sorted: `stop_ids` and (unless `ignore_eos`) the engine's.
    stop_ids: Vec<u32>,
    sampler: Sampler,
    dec: Option<StreamDecoder<'e>>,
    /// Text held back: it could be the start of a stop string.
    held: String,
    tokens: Vec<u32>,
    text: String,
    stop: Option<StopReason>,
    /// The grammar the text must match, if any.
    constraint: Option<Constraint>,
    /// The logits with the grammar's mask applied (vocab).
    masked: Vec<f32>,
}

/// The first complete stop string in `text`: (byte offset, index).
fn first_stop(text: &str, stops: &[String]) -> Option<(usize, usize)> {
    stops
        .iter()
        .enumerate()
        .filter_map(|(k, s)| text.find(s.as_str()).map(|at| (at, k)))
        .min()
}

/// Where the longest suffix of `text` that could begin a stop string starts
/// (`text.len()` if none).
fn partial_stop(text: &str, stops: &[String]) -> usize {
    text.char_indices()
        .map(|(i, _)| i)
        .find(|&i| stops.iter().any(|s| s.starts_with(&text[i..])))
        .unwrap_or(text.len())
}

impl<'e> Generator<'e> {
    /// Checks `opts` (sampling ranges, logit-bias ids, non-empty stop strings).
    pub fn new(engine: &'e Engine, opts: GenerateOptions) -> Result<Generator<'e>, SessionError> {
        opts.sampling
            .validate(Some(engine.config().vocab))
            .map_err(SessionError::Sampling)?;
        if opts.stop_strings.iter().any(String::is_empty) {
            return Err(SessionError::BadOption {
                name: "stop",
                value: "\"\"".into(),
                rule: "a stop string cannot be empty",
            });
        }
        let mut stop_ids = opts.stop_ids.clone();
        if !opts.ignore_eos {
            stop_ids.extend(engine.stop_ids());
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(Generator {
            stop_ids,
            sampler: Sampler::new(opts.sampling.clone()),
            dec: engine.tokenizer().map(|t| t.stream_decoder()),
            held: String::new(),
            tokens: Vec::new(),
            text: String::new(),
            stop: (opts.max_tokens == 0).then_some(StopReason::Length),
            opts,
            constraint: None,
            masked: Vec::new(),
        })
    }

    /// Samples only what `c`'s grammar allows (its mask applied to the logits; the
    /// grammar's end is where the stop ids are allowed).
    pub fn with_constraint(mut self, c: Constraint) -> Generator<'e> {
        self.constraint = Some(c);
        self
    }

    /// The grammar state, e.g. to [`Constraint::prepare`] the next mask on another
    /// thread while the forward pass runs.
    pub fn constraint_mut(&mut self) -> Option<&mut Constraint> {
        self.constraint.as_mut()
    }

    /// Whether the generation has ended.
    pub fn done(&self) -> bool {
        self.stop.is_some()
    }

    /// Samples the next token from `s`'s logits (see the module docs). When the step
    /// does not stop, the caller feeds its id to `s` before the next step.
    pub fn step(&mut self, s: &Session) -> Result<Step, SessionError> {
        if self.stop.is_some() {
            return Err(SessionError::Finished);
        }
        let logits = s.logits().ok_or(SessionError::NoLogits)?;
        self.step_on(logits, s.tokens(), s.pos(), s.ctx())
    }

    /// [`Generator::step`] on `logits`, the logits after `history` (the sequence's ids,
    /// `pos` of them held in a context of `ctx`): a batched or speculative caller's
    /// step, whose logits are not the session's.
    pub fn step_on(
        &mut self,
        logits: &[f32],
        history: &[u32],
        pos: usize,
        ctx: usize,
    ) -> Result<Step, SessionError> {
        let sampled = self.sample(logits, |s, l| s.sample_with(l, history))?;
        self.commit(sampled.id);
        Ok(self.took(sampled, pos, ctx))
    }

    /// A step that checks the drafted token `draft` ([`Sampler::verify`]; `q`: the
    /// draft model's distribution, `None` for an n-gram draft): the step, and whether
    /// its token is the draft. Greedy, the step is the one [`Generator::step_on`] takes.
    pub fn step_draft(
        &mut self,
        logits: &[f32],
        history: &[u32],
        pos: usize,
        ctx: usize,
        draft: u32,
        q: Option<&[f32]>,
    ) -> Result<(Step, bool), SessionError> {
        let (sampled, kept) = self.sample(logits, |s, l| s.verify(l, history, draft, q))?;
        self.commit(sampled.id);
        Ok((self.took(sampled, pos, ctx), kept))
    }

    /// `how` of the sampler on `logits`, masked by the grammar if any; an error once the
    /// generation has stopped.
    fn sample<R>(
        &mut self,
        logits: &[f32],
        how: impl FnOnce(&mut Sampler, &[f32]) -> R,
    ) -> Result<R, SessionError> {
        if self.stop.is_some() {
            return Err(SessionError::Finished);
        }
        let logits = if self.mask(logits)? {
            &self.masked
        } else {
            logits
        };
        Ok(how(&mut self.sampler, logits))
    }

    /// With a grammar: `logits` with its mask applied (what may be sampled) into
    /// `self.masked`, and true; false without one.
    fn mask(&mut self, logits: &[f32]) -> Result<bool, SessionError> {
        let Some(c) = self.constraint.as_mut() else {
            return Ok(false);
        };
        self.masked.clear();
        self.masked.extend_from_slice(logits);
        c.mask_logits(&mut self.masked)?;
        Ok(true)
    }

    /// Advances the grammar, if any, past the sampled `id`.
    fn commit(&mut self, id: u32) {
        if let Some(c) = self.constraint.as_mut() {
            c.commit(id);
        }
    }

    /// Tokens still to sample before `max_tokens`.
    pub fn remaining(&self) -> usize {
        self.opts.max_tokens.saturating_sub(self.tokens.len())
    }

    /// The sampling options.
    pub fn sampling(&self) -> &SamplerOptions {
        &self.opts.sampling
    }

    /// After sampling: the stop rules and the text of the token.
    fn took(&mut self, sampled: Sampled, pos: usize, ctx: usize) -> Step {
        let i = self.tokens.len();
        let id = sampled.id;
        self.tokens.push(id);
        let (text, stop) = if self.stop_ids.binary_search(&id).is_ok() {
            (String::new(), Some(StopReason::StopId(id)))
        } else {
            let piece = match self.dec.as_mut() {
                Some(d) => d.push(id),
                None => format!("{}{id}", if i > 0 { " " } else { "" }),
            };
            let (text, hit) = self.cut(&piece);
            let stop = if let Some(k) = hit {
                Some(StopReason::StopString(k))
            } else if i + 1 == self.opts.max_tokens {
                Some(StopReason::Length)
            } else if pos >= ctx {
                Some(StopReason::ContextFull)
            } else {
                None
            };
            (text, stop)
        };
        self.text.push_str(&text);
        self.stop = stop;
        Step {
            id,
            text,
            logprobs: sampled.logprobs,
            stop,
        }
    }

    /// Adds `piece` to the held text; returns what can be given out and, when a stop
    /// string is complete, its index (the text then ends before it).
    fn cut(&mut self, piece: &str) -> (String, Option<usize>) {
        let stops = &self.opts.stop_strings;
        if stops.is_empty() {
            return (piece.to_string(), None);
        }
        self.held.push_str(piece);
        if let Some((at, k)) = first_stop(&self.held, stops) {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, Some(k));
        }
        let keep = partial_stop(&self.held, stops);
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, None)
    }

    /// Ends the generation now (`Cancelled`), unless it has ended.
    pub fn cancel(&mut self) {
        self.stop.get_or_insert(StopReason::Cancelled);
    }

    /// The result: the ids, the text, the tail and why it ended.
    pub fn finish(mut self) -> Generation {
        let mut tail = String::new();
        if !matches!(self.stop, Some(StopReason::StopString(_))) {
            tail = std::mem::take(&mut self.held);
            if let Some(d) = self.dec.as_mut() {
                tail.push_str(&d.finish());
            }
            if let Some((at, _)) = first_stop(&tail, &self.opts.stop_strings) {
                tail.truncate(at);
            }
        }
        self.text.push_str(&tail);
        Generation {
            tokens: self.tokens,
            text: self.text,
            tail,
            stop: self.stop.unwrap_or(StopReason::Cancelled),
        }
    }
}

impl Session<'_> {
    /// Samples and feeds tokens until a stop (see [`GenerateOptions`]); `on` sees each
    /// step as it is made and may end the generation (`StopReason::Cancelled`). The
    /// last sampled token is not fed (nothing needs its logits): afterwards
    /// `logits()` is `None`, and the ids held end with the one before it.
    pub fn generate(
        &mut self,
        opts: &GenerateOptions,
        mut on: impl FnMut(&Step) -> ControlFlow<()>,
    ) -> Result<Generation, SessionError> {
        let mut g = Generator::new(self.engine(), opts.clone())?;
        while !g.done() {
            let step = g.step(self)?;
            let flow = on(&step);
            if step.stop.is_some() {
                break;
            }
            if flow.is_break() {
                g.cancel();
                break;
            }
            self.feed(&[step.id])?;
        }
        Ok(self.finish_generation(g))
    }

    /// Ends a generation over this session: its result, the session without the
    /// logits that chose the last sampled token (which was not fed).
    pub(super) fn finish_generation(&mut self, g: Generator) -> Generation {
        let gen = g.finish();
        if !gen.tokens.is_empty() {
            self.drop_logits();
        }
        gen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_and_held_back() {
        let stops = vec!["</s>".to_string(), "END".to_string()];
        assert_eq!(first_stop("a</s>bEND", &stops), Some((1, 0)));
        assert_eq!(first_stop("aENDb</s>", &stops), Some((1, 1)));
        assert_eq!(first_stop("abc", &stops), None);
        assert_eq!(partial_stop("abc</", &stops), 3);
        assert_eq!(partial_stop("abcE", &stops), 3);
        assert_eq!(partial_stop("abc", &stops), 3);
        assert_eq!(partial_stop("é<", &stops), "é".len());
        assert_eq!(partial_stop("", &stops), 0);
    }
}
