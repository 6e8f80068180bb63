//! Picks the next token from logits.
//!
//! In this order:
//! 1. logit bias: `l[id] += bias` for each `(id, bias)` of `logit_bias`;
//! 2. penalties, over the distinct ids of the last `penalty_window` tokens of the
//!    sequence (the caller's history; 0: all of it), each seen `c` times: repetition
//!    `l = l / r` where `l > 0`, else `l · r`; then `l −= c · frequency + presence`
//!    (llama.cpp's repetition penalty, OpenAI's presence and frequency penalties);
//! 3. temperature 0 (or `top_k` 1) is greedy: the first largest logit;
//! 4. otherwise `p_i = exp((l_i − max) / temp)`, restricted to the `top_k` most likely
//!    tokens (0: all), sorted by `p` (ties: lower id first), cut to the smallest prefix
//!    whose share of the mass reaches `top_p` (1: all), then to the tokens with
//!    `p ≥ min_p · p_max` (0: all), and sampled in proportion to `p` with a seeded
//!    xorshift64* generator.
//!
//! With `logprobs`, the log-probabilities of the logits after steps 1–2 at temperature 1
//! (`l_i − max − ln Σ exp(l_j − max)`, summed in f64) are reported for the chosen token
//! and the `top_logprobs` most likely ones.
//!
//! Everything here is scalar code on the logits, so equal logits (every kernel tier and
//! thread count gives the same bits) and an equal seed give equal tokens.

use std::fmt;

/// Sampling parameters, with the library's defaults (greedy, nothing else on).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerOptions {
    /// 0: greedy.
    pub temp: f32,
    /// 0: no limit.
    pub top_k: usize,
    /// 1: no limit.
    pub top_p: f32,
    /// 0: no limit.
    pub min_p: f32,
    pub seed: u64,
    /// 1: off.
    pub repeat_penalty: f32,
    /// 0: off.
    pub presence_penalty: f32,
    /// 0: off.
    pub frequency_penalty: f32,
    /// The penalties look at this many of the last tokens (0: the whole sequence).
    pub penalty_window: usize,
    /// Added to the logits of these ids before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report the chosen token's log-probability (and `top_logprobs` alternatives).
    pub logprobs: bool,
    pub top_logprobs: usize,
}

impl Default for SamplerOptions {
    fn default() -> Self {
        SamplerOptions {
            temp: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: 64,
            logit_bias: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

/// A sampling option out of its range: `NAME = VALUE: RULE` (names as mlb-run's flags).
#[derive(Debug, Clone, PartialEq)]
pub struct BadSamplerOption {
    pub name: &'static str,
    pub value: String,
    pub rule: &'static str,
}

impl fmt::Display for BadSamplerOption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}: {}", self.name, self.value, self.rule)
    }
}

impl std::error::Error for BadSamplerOption {}

impl SamplerOptions {
    /// Checks every option's range against `vocab` (logit-bias ids).
    pub fn validate(&self, vocab: Option<usize>) -> Result<(), BadSamplerOption> {
        let bad = |name, value: String, rule| Err(BadSamplerOption { name, value, rule });
        if !(self.temp >= 0.0 && self.temp.is_finite()) {
            return bad(
                "--temp",
                self.temp.to_string(),
                "must be a finite number ≥ 0 (0 is greedy)",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("--top-p", self.top_p.to_string(), "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("--min-p", self.min_p.to_string(), "must be in [0, 1]");
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return bad(
                "--repeat-penalty",
                self.repeat_penalty.to_string(),
                "must be a finite number > 0 (1 is off)",
            );
        }
        for (name, v) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return bad(name, v.to_string(), "must be a finite number (0 is off)");
            }
        }
        for &(id, b) in &self.logit_bias {
            if b.is_nan() || b == f32::INFINITY {
                return bad(
                    "--logit-bias",
                    format!("{id}:{b}"),
                    "a bias is a number or -inf (never this token)",
                );
            }
            if vocab.is_some_and(|v| id as usize >= v) {
                return bad(
                    "--logit-bias",
                    format!("{id}:{b}"),
                    "the id is not below the model's vocab",
                );
            }
        }
        Ok(())
    }

    /// Whether steps 1–2 change the logits.
    fn adjusts(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.repeat_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// The log-probabilities of a sampled token (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The chosen token's.
    pub chosen: f32,
    /// The `top_logprobs` most likely tokens, most likely first (ties: lower id).
    pub top: Vec<(u32, f32)>,
}

/// A sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// With `SamplerOptions::logprobs`.
    pub logprobs: Option<Logprobs>,
}

/// A sampler with its PRNG state and reusable buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    opts: SamplerOptions,
    rng: u64,
    /// (probability, id) candidates, sized to the vocabulary once.
    cand: Vec<(f32, u32)>,
    /// The logits after bias and penalties.
    work: Vec<f32>,
    /// The penalty window's ids, sorted.
    seen: Vec<u32>,
}

/// The index of the first largest value (greedy sampling; the evaluation's top-1).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(opts: SamplerOptions) -> Sampler {
        // splitmix64 of the seed: a non-zero, well-mixed xorshift state.
        let mut z = opts.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Sampler {
            opts,
            rng: z | 1,
            cand: Vec::new(),
            work: Vec::new(),
            seen: Vec::new(),
        }
    }

    pub fn opts(&self) -> &SamplerOptions {
        &self.opts
    }

    /// xorshift64*.
    fn next_u64(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// The next token, with no history (penalties see nothing).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_with(logits, &[]).id
    }

    /// The next token after the sequence `history` (whose last `penalty_window` ids the
    /// penalties see).
    pub fn sample_with(&mut self, logits: &[f32], history: &[u32]) -> Sampled {
        let mut work = std::mem::take(&mut self.work);
        let l = self.adjusted(logits, history, &mut work);
        let id = self.pick(l);
        let logprobs = self
            .opts
            .logprobs
            .then(|| logprobs(l, id, self.opts.top_logprobs));
        self.work = work;
        Sampled { id, logprobs }
    }

    /// Steps 1–2: logit bias, then penalties over the window of `history`.
    fn adjust(&mut self, l: &mut [f32], history: &[u32]) {
        let o = &self.opts;
        for &(id, b) in &o.logit_bias {
            if let Some(v) = l.get_mut(id as usize) {
                *v += b;
            }
        }
        let w = match o.penalty_window {
            0 => history.len(),
            n => n.min(history.len()),
        };
        self.seen.clear();
        self.seen.extend_from_slice(&history[history.len() - w..]);
        self.seen.sort_unstable();
        for run in self.seen.chunk_by(|a, b| a == b) {
            let Some(v) = l.get_mut(run[0] as usize) else {
                continue;
            };
            if o.repeat_penalty != 1.0 {
                *v = if *v > 0.0 {
                    *v / o.repeat_penalty
                } else {
                    *v * o.repeat_penalty
                };
            }
            *v -= run.len() as f32 * o.frequency_penalty + o.presence_penalty;
        }
    }

    /// Whether step 3 applies: the choice is the first largest logit.
    pub fn greedy(&self) -> bool {
        self.opts.temp <= 0.0 || self.opts.top_k == 1
    }

    /// Steps 3–4 on the (adjusted) logits.
    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.greedy() {
            return argmax(logits);
        }
        let n = self.candidates(logits);
        let u = self.uniform();
        let cand = &self.cand[..n];
        let total: f32 = cand.iter().map(|c| c.0).sum();
        let r = u * total;
        let mut acc = 0.0;
        for c in cand {
            acc += c.0;
            if r < acc {
                return c.1;
            }
        }
        cand[n - 1].1
    }

    /// Step 4's candidates (not greedy): `self.cand[..n]` holds (weight, id), most
    /// likely first, after top-k, top-p and min-p; the probability of each is its weight
    /// over their sum. Returns `n`.
    fn candidates(&mut self, logits: &[f32]) -> usize {
        let o = &self.opts;
        let (temp, top_k, top_p, min_p) = (o.temp, o.top_k, o.top_p, o.min_p);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (((l - max) / temp).exp(), i as u32)),
        );
        let by_p = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let mut n = self.cand.len();
        if top_k > 0 && top_k < n {
            self.cand.select_nth_unstable_by(top_k - 1, by_p);
            n = top_k;
        }
        let cand = &mut self.cand[..n];
        cand.sort_unstable_by(by_p);
        let total: f32 = cand.iter().map(|c| c.0).sum();
        if top_p < 1.0 {
            let mut acc = 0.0;
            for (i, c) in cand.iter().enumerate() {
                acc += c.0 / total;
                if acc >= top_p {
                    n = i + 1;
                    break;
                }
            }
        }
        if min_p > 0.0 {
            let floor = min_p * self.cand[0].0;
            n = self.cand[..n].partition_point(|c| c.0 >= floor).max(1);
        }
        n
    }

    /// The distribution the next token is drawn from after `history` (steps 1–4):
    /// `out[id]` is its probability (vocab values, 0 outside the candidates; greedy: 1
    /// at the choice). A speculative draft's `q`.
    pub fn distribution(&mut self, logits: &[f32], history: &[u32], out: &mut Vec<f32>) {
        let mut work = std::mem::take(&mut self.work);
        let l = self.adjusted(logits, history, &mut work);
        out.clear();
        out.resize(logits.len(), 0.0);
        if self.greedy() {
            out[argmax(l) as usize] = 1.0;
        } else {
            let n = self.candidates(l);
            let total: f32 = self.cand[..n].iter().map(|c| c.0).sum();
            for &(w, id) in &self.cand[..n] {
                out[id as usize] = w / total;
            }
        }
        self.work = work;
    }

    /// A token drawn from `probs` (non-negative, any sum > 0; the first id with
    /// weight when the sum is 0).
    pub fn sample_from(&mut self, probs: &[f32]) -> u32 {
        let total: f32 = probs.iter().sum();
        let r = self.uniform() * total;
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                acc += p;
                last = i;
                if r < acc {
                    return i as u32;
                }
            }
        }
        last as u32
    }

    /// Speculative decoding's check of a drafted token `draft` at this position: the
    /// next token, and whether it is the draft. Greedy: the choice [`sample_with`]
    /// makes (so the draft is kept exactly when it is that token). Otherwise the
    /// standard rule (Leviathan et al., Chen et al.), which keeps the distribution of
    /// [`Sampler::distribution`] `p`: the draft, drawn from `q` (the draft model's
    /// distribution; `None`: a point mass on `draft`, as n-gram drafts are), is kept
    /// with probability min(1, p(draft) / q(draft)); else a token is drawn from
    /// max(0, p − q), normalized.
    ///
    /// [`sample_with`]: Sampler::sample_with
    pub fn verify(
        &mut self,
        logits: &[f32],
        history: &[u32],
        draft: u32,
        q: Option<&[f32]>,
    ) -> (Sampled, bool) {
        if self.greedy() {
            let s = self.sample_with(logits, history);
            let ok = s.id == draft;
            return (s, ok);
        }
        let mut work = std::mem::take(&mut self.work);
        let l = self.adjusted(logits, history, &mut work);
        let n = self.candidates(l);
        let total: f32 = self.cand[..n].iter().map(|c| c.0).sum();
        let p_of = |id: u32, cand: &[(f32, u32)]| {
            cand.iter().find(|c| c.1 == id).map_or(0.0, |c| c.0 / total)
        };
        let qd = q.map_or(1.0, |q| q.get(draft as usize).copied().unwrap_or(0.0));
        let pd = p_of(draft, &self.cand[..n]);
        let u = self.uniform();
        let id = if qd > 0.0 && u * qd < pd {
            draft
        } else {
            // The residual max(0, p − q) over the candidates (p is 0 elsewhere).
            let q_of = |id: u32| match q {
                Some(q) => q.get(id as usize).copied().unwrap_or(0.0),
                None => f32::from(u8::from(id == draft)),
            };
            let res: Vec<(f32, u32)> = self.cand[..n]
                .iter()
                .map(|&(w, id)| ((w / total - q_of(id)).max(0.0), id))
                .collect();
            let sum: f32 = res.iter().map(|r| r.0).sum();
            if sum > 0.0 {
                let r = self.uniform() * sum;
                let mut acc = 0.0;
                let mut pick = res.iter().rfind(|r| r.0 > 0.0).map_or(draft, |r| r.1);
                for &(w, id) in &res {
                    acc += w;
                    if w > 0.0 && r < acc {
                        pick = id;
                        break;
                    }
                }
                pick
            } else {
                // p ≤ q everywhere means p = q: the draft is always kept.
                draft
            }
        };
        let logprobs = self
            .opts
            .logprobs
            .then(|| logprobs(l, id, self.opts.top_logprobs));
        self.work = work;
        (Sampled { id, logprobs }, id == draft)
    }

    /// The logits after steps 1–2 (`logits` itself when they change nothing).
    fn adjusted<'l>(
        &mut self,
        logits: &'l [f32],
        history: &[u32],
        work: &'l mut Vec<f32>,
    ) -> &'l [f32] {
        if self.opts.adjusts() {
            work.clear();
            work.extend_from_slice(logits);
            self.adjust(work, history);
            work
        } else {
            logits
        }
    }
}

/// The log-probabilities of `l` at temperature 1 for `id` and the `top` most likely.
fn logprobs(l: &[f32], id: u32, top: usize) -> Logprobs {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max as f64
        + l.iter()
            .map(|&v| (v as f64 - max as f64).exp())
            .sum::<f64>()
            .ln();
    let lp = |v: f32| (v as f64 - lse) as f32;
    let mut best: Vec<(f32, u32)> = l.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
    let by_l = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let top = top.min(best.len());
    if top > 0 && top < best.len() {
        best.select_nth_unstable_by(top - 1, by_l);
    }
    best.truncate(top);
    best.sort_unstable_by(by_l);
    Logprobs {
        chosen: lp(l[id as usize]),
        top: best.into_iter().map(|(v, i)| (i, lp(v))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1, "the first among equals");
        let l = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(SamplerOptions::default()).sample(&l), 1);
        let opts = SamplerOptions {
            temp: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 7,
            ..SamplerOptions::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(opts.clone());
            (0..50).map(|_| s.sample(&l)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(opts.clone());
            (0..50).map(|_| s.sample(&l)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t == 1 || t == 2));
        assert!(a.contains(&1) && a.contains(&2));
        let mut s = Sampler::new(SamplerOptions {
            top_p: 0.3,
            top_k: 0,
            ..opts
        });
        assert!((0..20).all(|_| s.sample(&l) == 1));
    }

    #[test]
    fn min_p_cuts_unlikely_tokens() {
        // p ∝ exp(l): 1, e^-0.1 ≈ 0.905, e^-3 ≈ 0.050, e^-4 ≈ 0.018.
        let l = [0.0, -0.1, -3.0, -4.0];
        let opts = SamplerOptions {
            temp: 1.0,
            seed: 3,
            ..SamplerOptions::default()
        };
        let draw = |o: SamplerOptions| {
            let mut s = Sampler::new(o);
            (0..400).map(|_| s.sample(&l)).collect::<Vec<_>>()
        };
        let all = draw(opts.clone());
        assert!(
            all.contains(&2) || all.contains(&3),
            "without min-p all can come"
        );
        let cut = draw(SamplerOptions {
            min_p: 0.1,
            ..opts.clone()
        });
        assert!(cut.iter().all(|&t| t < 2) && cut.contains(&1), "{cut:?}");
        // min-p 1 keeps only the most likely.
        let top = draw(SamplerOptions { min_p: 1.0, ..opts });
        assert!(top.iter().all(|&t| t == 0));
    }

    #[test]
    fn bias_and_penalties_change_the_choice() {
        let l = [1.0, 2.0, 0.5, -1.0];
        let greedy = |o: SamplerOptions, hist: &[u32]| Sampler::new(o).sample_with(&l, hist).id;
        assert_eq!(greedy(SamplerOptions::default(), &[1, 1]), 1, "no penalty");
        let bias = SamplerOptions {
            logit_bias: vec![(2, 5.0), (1, f32::NEG_INFINITY)],
            ..SamplerOptions::default()
        };
        assert_eq!(greedy(bias, &[]), 2);
        // Repetition: 2 / 3 < 1: token 0 wins; a negative logit is multiplied.
        let rep = SamplerOptions {
            repeat_penalty: 3.0,
            ..SamplerOptions::default()
        };
        assert_eq!(greedy(rep.clone(), &[1]), 0);
        assert_eq!(
            greedy(rep.clone(), &[5, 5, 5]),
            1,
            "ids past the vocab are ignored"
        );
        // The window: only the last token counts.
        let win = SamplerOptions {
            penalty_window: 1,
            ..rep
        };
        assert_eq!(greedy(win.clone(), &[1, 0]), 1);
        assert_eq!(greedy(win, &[0, 1]), 0);
        // Frequency counts repeats, presence does not: 2 − 2·0.6 = 0.8 < 1.
        let freq = SamplerOptions {
            frequency_penalty: 0.6,
            ..SamplerOptions::default()
        };
        assert_eq!(greedy(freq.clone(), &[1]), 1);
        assert_eq!(greedy(freq, &[1, 1]), 0);
        let pres = SamplerOptions {
            presence_penalty: 0.6,
            ..SamplerOptions::default()
        };
        assert_eq!(greedy(pres.clone(), &[1, 1, 1]), 1);
        let pres = SamplerOptions {
            presence_penalty: 1.5,
            ..pres
        };
        assert_eq!(greedy(pres, &[1]), 0);
    }

    #[test]
    fn logprobs_are_log_softmax() {
        let l = [1.0f32, 3.0, 2.0, 3.0];
        let s = Sampler::new(SamplerOptions {
            logprobs: true,
            top_logprobs: 3,
            ..SamplerOptions::default()
        })
        .sample_with(&l, &[]);
        let lse = l.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        let want = |i: usize| (l[i] as f64 - lse) as f32;
        let lp = s.logprobs.unwrap();
        assert_eq!(s.id, 1);
        assert!((lp.chosen - want(1)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "most likely first, ties by id");
        for (i, v) in lp.top {
            assert!((v - want(i as usize)).abs() < 1e-6);
        }
        // Probabilities of the adjusted logits: a bias moves them.
        let b = Sampler::new(SamplerOptions {
            logprobs: true,
            logit_bias: vec![(0, 10.0)],
            ..SamplerOptions::default()
        })
        .sample_with(&l, &[]);
        assert_eq!(b.id, 0);
        assert!(b.logprobs.unwrap().chosen > -0.01);
        assert!(Sampler::new(SamplerOptions::default())
            .sample_with(&l, &[])
            .logprobs
            .is_none());
    }

    /// The acceptance rule keeps the model's distribution: a draft drawn from `q` (or a
    /// point mass), checked with `verify`, yields tokens distributed as
    /// `distribution()` (top-k / top-p / min-p and penalties included), within 4.5
    /// standard deviations per token over 60000 draws.
    #[test]
    fn verify_keeps_the_distribution() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.7, 0.0, 2.2];
        let history = [4u32, 4, 1];
        let opts = SamplerOptions {
            temp: 0.8,
            top_k: 6,
            top_p: 0.97,
            repeat_penalty: 1.2,
            seed: 5,
            ..SamplerOptions::default()
        };
        let mut p = Vec::new();
        Sampler::new(opts.clone()).distribution(&logits, &history, &mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(p.iter().filter(|&&x| x > 0.0).count() <= 6);
        // A draft distribution unlike p (it even favours a token p excludes).
        let q = [0.05f32, 0.1, 0.3, 0.3, 0.05, 0.1, 0.1];
        let n = 60_000;
        for (name, q) in [("draft model", Some(&q[..])), ("point masses", None)] {
            let mut s = Sampler::new(opts.clone());
            let mut drafter = Sampler::new(SamplerOptions {
                seed: 77,
                ..opts.clone()
            });
            let mut counts = [0usize; 7];
            let mut kept = 0;
            for i in 0..n {
                let d = match q {
                    Some(q) => drafter.sample_from(q),
                    None => (i % 7) as u32,
                };
                let (t, ok) = s.verify(&logits, &history, d, q);
                assert_eq!(ok, t.id == d);
                kept += usize::from(ok);
                counts[t.id as usize] += 1;
            }
            for (id, (&c, &pi)) in counts.iter().zip(&p).enumerate() {
                let mean = n as f64 * f64::from(pi);
                let sd = (mean * (1.0 - f64::from(pi))).sqrt().max(1.0);
                assert!(
                    (c as f64 - mean).abs() < 4.5 * sd,
                    "{name}: token {id}: {c} draws, expected {mean:.0} (p {pi})"
                );
            }
            assert!(kept > 0 && kept < n, "{name}: {kept}");
        }
        // Greedy: the draft is kept exactly when it is the choice.
        let mut g = Sampler::new(SamplerOptions::default());
        assert_eq!(
            g.verify(&logits, &[], 6, None),
            (
                Sampled {
                    id: 6,
                    logprobs: None
                },
                true
            )
        );
        assert!(!g.verify(&logits, &[], 1, None).1);
        let mut d = Vec::new();
        g.distribution(&logits, &[], &mut d);
        assert_eq!(d, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn options_are_validated() {
        let ok = SamplerOptions::default();
        assert!(ok.validate(Some(4)).is_ok());
        for (o, name) in [
            (
                SamplerOptions {
                    temp: -1.0,
                    ..ok.clone()
                },
                "--temp",
            ),
            (
                SamplerOptions {
                    temp: f32::NAN,
                    ..ok.clone()
                },
                "--temp",
            ),
            (
                SamplerOptions {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "--top-p",
            ),
            (
                SamplerOptions {
                    min_p: 1.5,
                    ..ok.clone()
                },
                "--min-p",
            ),
            (
                SamplerOptions {
                    repeat_penalty: 0.0,
                    ..ok.clone()
                },
                "--repeat-penalty",
            ),
            (
                SamplerOptions {
                    presence_penalty: f32::INFINITY,
                    ..ok.clone()
                },
                "--presence-penalty",
            ),
            (
                SamplerOptions {
                    logit_bias: vec![(4, 1.0)],
                    ..ok.clone()
                },
                "--logit-bias",
            ),
            (
                SamplerOptions {
                    logit_bias: vec![(0, f32::NAN)],
                    ..ok.clone()
                },
                "--logit-bias",
            ),
        ] {
            let e = o.validate(Some(4)).unwrap_err();
            assert_eq!(e.name, name, "{e}");
        }
        let e = SamplerOptions { top_p: 0.0, ..ok }
            .validate(None)
            .unwrap_err();
        assert_eq!(e.to_string(), "--top-p = 0: must be in (0, 1]");
    }
}
