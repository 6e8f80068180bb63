//! Rotary position embeddings on interleaved pairs `(2i, 2i+1)` of each head's first
//! `rot_dim` dimensions.
//!
//! Pair `i < rot_dim/2` has the inverse frequency `inv_i = theta^(−2i / head_dim)`,
//! rescaled per `rope_type` (the local base is never rescaled):
//!
//! - llama3: with `wavelen = 2π / inv_i`, `inv_i` if `wavelen < orig/hi`, `inv_i / f` if
//!   `wavelen > orig/lo`, else `(1 − s)·inv_i/f + s·inv_i` with `s = (orig/wavelen − lo)/(hi − lo)`;
//! - linear: `inv_i / f`;
//! - yarn: `d(r) = head_dim·ln(orig/(2πr)) / (2 ln theta)`, `lo = max(⌊d(beta_fast)⌋, 0)`,
//!   `hi = min(⌈d(beta_slow)⌉, head_dim − 1)`, `ramp = clamp((i − lo)/(hi − lo), 0, 1)`,
//!   `inv_i/f·ramp + inv_i·(1 − ramp)`; cos and sin are multiplied by `rope_attn_factor`.
//!
//! At position `p`, the angle of pair `i` is `p·inv_i` (f32, as transformers computes
//! it), and `(x0, x1) → (x0·cos − x1·sin, x0·sin + x1·cos)`.

use super::config::RopeParams;
use crate::format::mlb::header::rope_type;

/// The inverse frequencies of one RoPE variant and its factor on cos and sin.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    /// rot_dim / 2 inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (1 except yarn's rope_attn_factor).
    pub mscale: f32,
}

/// Plain inverse frequencies `theta^(−2i/head_dim)` for `i < rot_dim/2` (in f64, rounded).
fn plain(theta: f32, head_dim: usize, rot_dim: usize) -> Vec<f64> {
    (0..rot_dim / 2)
        .map(|i| (theta as f64).powf(-((2 * i) as f64) / head_dim as f64))
        .collect()
}

impl RopeTable {
    /// The table of the global base with the header's scaling.
    pub fn global(p: &RopeParams, head_dim: usize, rot_dim: usize) -> RopeTable {
        let base = plain(p.theta, head_dim, rot_dim);
        let f = p.factor as f64;
        let mut mscale = 1.0;
        let inv: Vec<f64> = match p.rope_type {
            rope_type::LLAMA3 => {
                let (lo, hi, orig) = (p.low as f64, p.high as f64, p.orig_max_seq as f64);
                let low_wavelen = orig / lo;
                let high_wavelen = orig / hi;
                base.iter()
                    .map(|&inv| {
                        let wavelen = 2.0 * std::f64::consts::PI / inv;
                        if wavelen < high_wavelen {
                            inv
                        } else if wavelen > low_wavelen {
                            inv / f
                        } else {
                            let s = (orig / wavelen - lo) / (hi - lo);
                            (1.0 - s) * inv / f + s * inv
                        }
                    })
                    .collect()
            }
            rope_type::LINEAR => base.iter().map(|&inv| inv / f).collect(),
            rope_type::YARN | rope_type::YARN_UNROUNDED => {
                let (beta_fast, beta_slow) = (p.low as f64, p.high as f64);
                let orig = p.orig_max_seq as f64;
                let hd = head_dim as f64;
                let ln_theta = (p.theta as f64).ln();
                let d =
                    |r: f64| hd * (orig / (2.0 * std::f64::consts::PI * r)).ln() / (2.0 * ln_theta);
                // gpt-oss keeps the correction range's ends where they fall (truncate false).
                let (lo, hi) = if p.rope_type == rope_type::YARN_UNROUNDED {
                    (d(beta_fast), d(beta_slow))
                } else {
                    (d(beta_fast).floor(), d(beta_slow).ceil())
                };
                let lo = lo.max(0.0);
                let mut hi = hi.min(hd - 1.0);
                if hi == lo {
                    // transformers nudges an empty ramp to avoid a division by zero.
                    hi += 0.001;
                }
                if p.attn_factor > 0.0 {
                    mscale = p.attn_factor;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &inv)| {
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        inv / f * ramp + inv * (1.0 - ramp)
                    })
                    .collect()
            }
            _ => base,
        };
        RopeTable {
            inv_freq: inv.iter().map(|&v| v as f32).collect(),
            mscale,
        }
    }

    /// The local base's table: plain, unscaled.
    pub fn local(p: &RopeParams, head_dim: usize, rot_dim: usize) -> RopeTable {
        RopeTable {
            inv_freq: plain(p.local_theta, head_dim, rot_dim)
                .iter()
                .map(|&v| v as f32)
                .collect(),
            mscale: 1.0,
        }
    }

    /// Fills `cs` (rot_dim values: cos, sin per pair) for position `pos`.
    pub fn cos_sin(&self, pos: usize, cs: &mut [f32]) {
        let p = pos as f32;
        for (c, &inv) in cs.chunks_exact_mut(2).zip(&self.inv_freq) {
            let a = p * inv;
            c[0] = a.cos() * self.mscale;
            c[1] = a.sin() * self.mscale;
        }
    }
}

/// Rotates the first `cs.len()` dimensions of every head in `x` (heads of `head_dim`)
/// by the cos/sin pairs `cs` of one position.
pub fn apply(x: &mut [f32], head_dim: usize, cs: &[f32]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, c) in head.chunks_exact_mut(2).zip(cs.chunks_exact(2)) {
            let (x0, x1) = (pair[0], pair[1]);
            pair[0] = x0 * c[0] - x1 * c[1];
            pair[1] = x0 * c[1] + x1 * c[0];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(rope_type: u32) -> RopeParams {
        RopeParams {
            rope_type,
            theta: 10000.0,
            local_theta: 0.0,
            factor: 8.0,
            low: 1.0,
            high: 4.0,
            orig_max_seq: 64,
            attn_factor: 0.0,
        }
    }

    #[test]
    fn plain_frequencies() {
        let t = RopeTable::global(&params(rope_type::PLAIN), 16, 16);
        assert_eq!(t.inv_freq.len(), 8);
        assert_eq!(t.inv_freq[0], 1.0);
        assert!((t.inv_freq[1] - 10000f32.powf(-2.0 / 16.0)).abs() < 1e-7);
        let lin = RopeTable::global(&params(rope_type::LINEAR), 16, 8);
        assert_eq!(lin.inv_freq.len(), 4);
        assert!((lin.inv_freq[1] - t.inv_freq[1] / 8.0).abs() < 1e-8);
    }

    #[test]
    fn llama3_keeps_high_and_scales_low() {
        let p = params(rope_type::LLAMA3);
        let t = RopeTable::global(&p, 64, 64);
        let b = RopeTable::global(&params(rope_type::PLAIN), 64, 64);
        assert_eq!(t.inv_freq[0], b.inv_freq[0]);
        let last = t.inv_freq.len() - 1;
        assert!((t.inv_freq[last] - b.inv_freq[last] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn rotation_is_a_rotation() {
        let t = RopeTable::global(&params(rope_type::PLAIN), 4, 4);
        let mut cs = [0f32; 4];
        t.cos_sin(3, &mut cs);
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        apply(&mut x, 4, &cs);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 2.0).abs() < 1e-5);
    }
}
