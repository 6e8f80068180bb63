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

use crate::kernels::pool;

use super::config::Config;
use super::forward::{dot, rmsnorm_inplace};
use super::vmath::silu;
use super::weights::LinearWeights;

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

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Divides `x` by `sqrt(Σ x² + 1e-6)` and multiplies it by `extra`.
fn l2norm(x: &mut [f32], extra: f32) {
    let ss = dot(x, x);
    let inv = 1.0 / (ss + 1e-6).sqrt() * extra;
    for v in x {
        *v *= inv;
    }
}

/// One value head's inputs at one position.
struct HeadIn<'a> {
    /// dk: the (normalized, scaled) query of its key head.
    q: &'a [f32],
    /// dk: the normalized key.
    k: &'a [f32],
    /// dv: the value.
    v: &'a [f32],
    /// dv: the output gate.
    z: &'a [f32],
    /// sigmoid(b).
    beta: f32,
    /// exp(g), g = −exp(A_log) · softplus(a + dt_bias).
    decay: f32,
    /// dv.
    lnorm: &'a [f32],
    eps: f32,
}

/// Steps 4 and 5 for one head: state `s` (dk × dv), output `o` (dv), scratch `delta`.
fn head_step(x: &HeadIn, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { head_step_avx2(x, s, o, delta) };
    }
    head_step_body(x, s, o, delta)
}

/// [`head_step`] compiled for AVX2: the same operations in the same order, same bits.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn head_step_avx2(x: &HeadIn, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
    head_step_body(x, s, o, delta)
}

#[inline(always)]
fn head_step_body(x: &HeadIn, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
    let dv = o.len();
    // S ← S·exp(g) and Sᵀk; delta = β (v − Sᵀk); S ← S + k deltaᵀ; o = Sᵀq.
    delta.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(x.k) {
        for (sv, dj) in row.iter_mut().zip(delta.iter_mut()) {
            *sv *= x.decay;
            *dj += *sv * ki;
        }
    }
    for (dj, &vj) in delta.iter_mut().zip(x.v) {
        *dj = (vj - *dj) * x.beta;
    }
    o.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(x.k).zip(x.q) {
        for ((sv, &dj), ov) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
            *sv += ki * dj;
            *ov += *sv * qi;
        }
    }
    // 5. per-head RMSNorm with lnorm, times silu(z).
    rmsnorm_inplace(o, x.lnorm, x.eps);
    for (ov, &zv) in o.iter_mut().zip(x.z) {
        *ov *= silu(zv);
    }
}

impl DeltaState {
    pub fn new(c: &Config) -> DeltaState {
        let taps = c.lin_conv.max(1);
        DeltaState {
            conv: vec![0.0; (taps - 1) * c.lin_qkv],
            s: vec![0.0; c.lin_v_heads * c.lin_k_dim * c.lin_v_dim],
            delta: vec![0.0; c.lin_v_total],
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

    /// One position: `qkv` (2·K·dk + V·dv raw projections; overwritten with the
    /// convolved, normalized channels), `z` (V·dv), `b` and `a` (V each) → `out` (V·dv).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
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
                *x = silu(acc);
            }
        } else {
            for (i, x) in qkv.iter_mut().enumerate() {
                *x = silu(w.lconv[i] * *x);
            }
        }
        self.t += 1;
        // 2. L2-normalized query and key heads; queries also / sqrt(dk).
        let (qs, rest) = qkv.split_at_mut(kh * dk);
        let (ks, vs) = rest.split_at_mut(kh * dk);
        let qscale = 1.0 / (dk as f32).sqrt();
        for h in 0..kh {
            l2norm(&mut qs[h * dk..(h + 1) * dk], qscale);
            l2norm(&mut ks[h * dk..(h + 1) * dk], 1.0);
        }
        let (qs, ks, vs) = (&*qs, &*ks, &*vs);
        let group = vh / kh;
        let head = |h: usize, s: &mut [f32], o: &mut [f32], delta: &mut [f32]| {
            let kk = h / group;
            let hw = HeadIn {
                q: &qs[kk * dk..(kk + 1) * dk],
                k: &ks[kk * dk..(kk + 1) * dk],
                v: &vs[h * dv..(h + 1) * dv],
                z: &z[h * dv..(h + 1) * dv],
                beta: sigmoid(b[h]),
                decay: (-w.a_log[h].exp() * softplus(a[h] + w.dt_bias[h])).exp(),
                lnorm: w.lnorm,
                eps: c.norm_eps,
            };
            head_step(&hw, s, o, delta);
        };
        let sd = dk * dv;
        if vh * sd >= 1 << 16 {
            pool::for_chunks3((&mut self.s, sd), (out, dv), (&mut self.delta, dv), head);
        } else {
            self.s
                .chunks_exact_mut(sd)
                .zip(out.chunks_exact_mut(dv))
                .zip(self.delta.chunks_exact_mut(dv))
                .enumerate()
                .for_each(|(h, ((s, o), d))| head(h, s, o, d));
        }
    }
}
