//! Picks the next token from logits.
//!
//! Temperature 0 is greedy (the first largest logit). Otherwise
//! `p_i = softmax(logit_i / temp)`, restricted to the `top_k` most likely tokens (0: all),
//! then to the smallest set whose mass reaches `top_p` (1: all), renormalized and
//! sampled with a seeded xorshift64* generator.

/// Sampling parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerOpts {
    pub temp: f32,
    /// 0: no limit.
    pub top_k: usize,
    /// 1: no limit.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerOpts {
    fn default() -> Self {
        SamplerOpts {
            temp: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampler with its PRNG state and a reusable candidate buffer.
#[derive(Debug, Clone)]
pub struct Sampler {
    opts: SamplerOpts,
    rng: u64,
    /// (probability, id) candidates, sized to the vocabulary once.
    cand: Vec<(f32, u32)>,
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
    pub fn new(opts: SamplerOpts) -> Sampler {
        // splitmix64 of the seed: a non-zero, well-mixed xorshift state.
        let mut z = opts.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Sampler {
            opts,
            rng: z | 1,
            cand: Vec::new(),
        }
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

    /// The next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let o = self.opts;
        if o.temp <= 0.0 || o.top_k == 1 {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (((l - max) / o.temp).exp(), i as u32)),
        );
        let by_p = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let mut n = self.cand.len();
        if o.top_k > 0 && o.top_k < n {
            self.cand.select_nth_unstable_by(o.top_k - 1, by_p);
            n = o.top_k;
        }
        let cand = &mut self.cand[..n];
        cand.sort_unstable_by(by_p);
        let total: f32 = cand.iter().map(|c| c.0).sum();
        if o.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, c) in cand.iter().enumerate() {
                acc += c.0 / total;
                if acc >= o.top_p {
                    n = i + 1;
                    break;
                }
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1, "the first among equals");
        let l = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(SamplerOpts::default()).sample(&l), 1);
        let opts = SamplerOpts {
            temp: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(opts);
            (0..50).map(|_| s.sample(&l)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(opts);
            (0..50).map(|_| s.sample(&l)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t == 1 || t == 2));
        assert!(a.contains(&1) && a.contains(&2));
        let mut s = Sampler::new(SamplerOpts {
            top_p: 0.3,
            top_k: 0,
            ..opts
        });
        assert!((0..20).all(|_| s.sample(&l) == 1));
    }
}
