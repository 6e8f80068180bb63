//! The gated delta rule's step for one value head at one position (steps 4 and 5 of
//! `model::delta`), the reference. With the head's state `S` (dk × dv, row `i` = key
//! dimension `i`), in this order:
//!
//! ```text
//! S[i][j] = S[i][j] · decay;  Sk[j] += S[i][j] · k[i]     rows i in order, Sk from +0.0
//! delta[j] = (v[j] − Sk[j]) · beta
//! S[i][j] += k[i] · delta[j];  o[j] += S[i][j] · q[i]     rows i in order, o from +0.0
//! o = rmsnorm(o, lnorm, eps);  o[j] = o[j] · silu(z[j])
//! ```
//!
//! Every operation is a separately rounded f32 operation (no FMA); the SIMD tiers run
//! this very code compiled for their instruction set (the loops over `j` vectorize, the
//! operations of each element stay the same), so they give these bits.

use super::math::{rmsnorm_inplace, silu};
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// One value head's inputs at one position.
pub struct DeltaHead<'a> {
    /// dk: the (normalized, scaled) query of its key head.
    pub q: &'a [f32],
    /// dk: the normalized key.
    pub k: &'a [f32],
    /// dv: the value.
    pub v: &'a [f32],
    /// dv: the output gate.
    pub z: &'a [f32],
    /// sigmoid(b).
    pub beta: f32,
    /// exp(g), g = −exp(A_log) · softplus(a + dt_bias).
    pub decay: f32,
    /// dv: the per-head RMSNorm weights.
    pub lnorm: &'a [f32],
    pub eps: f32,
}

/// The step on state `s` (dk × dv) into `o` (dv), with scratch `delta` (dv); see the
/// module docs.
#[inline(always)]
pub fn head_step(x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
    let dv = o.len();
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
    rmsnorm_inplace(o, x.lnorm, x.eps);
    for (ov, &zv) in o.iter_mut().zip(x.z) {
        *ov *= silu(zv);
    }
}

/// The scalar tier's entry (see `table::DeltaFn`).
pub fn delta_head(x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
    count(Tier::Scalar, Op::Delta);
    head_step(x, s, o, delta)
}
