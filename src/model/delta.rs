//! The gated delta rule (Qwen3.5's linear attention), one position at a time.
//!
//! With `K` key heads and `V` value heads of sizes `dk` and `dv`, the projections of a
//! position are `2·K·dk + V·dv` channels (queries, keys, values), `V·dv` gate values
//! `z`, and `V` values each of `b` and `a`. Then:
//!
//! 1. each channel `c`: `u_c = Σ_{j<L} lconv[c][j] · x_{t−L+1+j}[c]` (inputs before
//!    position 0 are 0), then `silu`;
//! 2. each query and key head is divided by `sqrt(Σ x² + 1e-6)`; queries also by
//!    `sqrt(dk)`; value head `h` uses key head `h / (V/K)`;
//! 3. `β = sigmoid(b)`, `g = −exp(A_log) · softplus(a + dt_bias)`;
//! 4. the head's state `S` (dk × dv, zero at position 0) becomes `S·exp(g)`, then
//!    `S + k (β (v − Sᵀk))ᵀ`; the output is `Sᵀq`;
//! 5. the output is RMS-normalized per head (`lnorm`, `norm_eps`) and multiplied by
//!    `silu(z)`; `lout` follows (in [`super::forward`]).
//!
//! Steps 4 and 5 are the kernels' head step ([`Kernels::delta_head`], through the
//! tier's table); this module keeps the state and runs steps 1 to 3 and the heads.

use super::config::Config;
use super::ops::{sigmoid, Zeros, PAR_MIN};
use super::weights::LinearWeights;
use crate::kernels::{pool, DeltaHead, Kernels};

/// One linear-attention layer's state.
#[derive(Debug, Clone)]
pub struct DeltaState {
    /// (L − 1) × channels: the last L − 1 raw inputs, position p at slot p % (L − 1).
    conv: Vec<f32>,
    /// V × dk × dv: the recurrent state of each value head, row i = key dimension i.
    s: Vec<f32>,
    /// V × dv: scratch for each head's `β (v − Sᵀk)`.
    delta: Vec<f32>,
    /// Positions seen.
    t: usize,
}

/// softplus as torch computes it (threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Divides `x` by `sqrt(Σ x² + 1e-6)` and multiplies it by `extra`.
fn l2norm(k: &Kernels, x: &mut [f32], extra: f32) {
    let ss = k.dot(x, x);
    let inv = 1.0 / (ss + 1e-6).sqrt() * extra;
    for v in x {
        *v *= inv;
    }
}

impl DeltaState {
    /// The state of a layer of `c`, its buffers from `z`.
    pub(super) fn new(c: &Config, z: &mut Zeros) -> DeltaState {
        let taps = c.lin_conv.max(1);
        DeltaState {
            conv: z.take(&[taps - 1, c.lin_qkv]),
            s: z.take(&[c.lin_v_heads, c.lin_k_dim, c.lin_v_dim]),
            delta: z.take(&[c.lin_v_total]),
            t: 0,
        }
    }

    /// Back to position 0.
    pub fn reset(&mut self) {
        self.conv.fill(0.0);
        self.s.fill(0.0);
        self.t = 0;
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.s.len()) * std::mem::size_of::<f32>()
    }

    /// The bytes a layer of `c` holds ([`DeltaState::bytes`] before allocating).
    pub fn bytes_for(c: &Config) -> usize {
        let taps = c.lin_conv.max(1);
        ((taps - 1) * c.lin_qkv + c.lin_v_heads * c.lin_k_dim * c.lin_v_dim)
            * std::mem::size_of::<f32>()
    }

    /// One position: `qkv` (2·K·dk + V·dv raw projections; overwritten with the
    /// convolved, normalized channels), `z` (V·dv), `b` and `a` (V each) → `out` (V·dv).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        k: &Kernels,
        c: &Config,
        w: &LinearWeights,
        qkv: &mut [f32],
        z: &[f32],
        b: &[f32],
        a: &[f32],
        out: &mut [f32],
    ) {
        let (kh, vh, dk, dv) = (c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim);
        let ch = c.lin_qkv;
        let taps = c.lin_conv.max(1);
        let hist = taps - 1;
        // 1. causal convolution over the last `taps` inputs, then SiLU.
        if hist > 0 {
            let slot = self.t % hist;
            for (i, x) in qkv.iter_mut().enumerate() {
                let wt = &w.lconv[i * taps..(i + 1) * taps];
                let mut acc = 0.0f32;
                for (j, &wj) in wt[..hist].iter().enumerate() {
                    // Tap j multiplies the input of position t − hist + j: the oldest
                    // held input is at slot t % hist.
                    acc += wj * self.conv[((slot + j) % hist) * ch + i];
                }
                acc += wt[hist] * *x;
                // The raw input replaces the oldest one.
                self.conv[slot * ch + i] = *x;
                *x = k.silu(acc);
            }
        } else {
            for (i, x) in qkv.iter_mut().enumerate() {
                *x = k.silu(w.lconv[i] * *x);
            }
        }
        self.t += 1;
        // 2. L2-normalized query and key heads; queries also / sqrt(dk).
        let (qs, rest) = qkv.split_at_mut(kh * dk);
        let (ks, vs) = rest.split_at_mut(kh * dk);
        let qscale = 1.0 / (dk as f32).sqrt();
        for h in 0..kh {
            l2norm(k, &mut qs[h * dk..(h + 1) * dk], qscale);
            l2norm(k, &mut ks[h * dk..(h + 1) * dk], 1.0);
        }
        let (qs, ks, vs) = (&*qs, &*ks, &*vs);
        let group = vh / kh;
        let head = |h: usize, s: &mut [f32], o: &mut [f32], delta: &mut [f32]| {
            let kk = h / group;
            let hw = DeltaHead {
                q: &qs[kk * dk..(kk + 1) * dk],
                k: &ks[kk * dk..(kk + 1) * dk],
                v: &vs[h * dv..(h + 1) * dv],
                z: &z[h * dv..(h + 1) * dv],
                beta: sigmoid(b[h]),
                decay: (-w.a_log[h].exp() * softplus(a[h] + w.dt_bias[h])).exp(),
                lnorm: w.lnorm,
                eps: c.norm_eps,
            };
            k.delta_head(&hw, s, o, delta);
        };
        let sd = dk * dv;
        pool::parallel_if(vh * sd >= 2 * PAR_MIN).for_chunks3(
            (&mut self.s, sd),
            (out, dv),
            (&mut self.delta, dv),
            head,
        );
    }
}
