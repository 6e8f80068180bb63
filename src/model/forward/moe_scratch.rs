//! The buffers of a step's mixture-of-experts FFNs (`forward::moe` fills and reads
//! them): the routes, the rows grouped by expert, and the gathered rows' inputs,
//! hidden vectors and outputs.

use crate::kernels::QActs;
use crate::model::config::Moe;
use crate::model::ops::Zeros;

/// The buffers of the mixture-of-experts FFNs of a step of up to `cap` rows (empty in
/// models without them); `m = cap · k` gathered rows, a row once per chosen expert.
pub(super) struct MoeScratch {
    /// cap × E: router logits (then probabilities).
    pub(super) logits: Vec<f32>,
    /// cap × k: the chosen experts of each row, in the order chosen.
    pub(super) ids: Vec<u32>,
    /// cap × k: their weights.
    pub(super) w: Vec<f32>,
    /// cap × k: the gathered row of each choice.
    pub(super) slot: Vec<u32>,
    /// m: the step row of each gathered row.
    pub(super) row: Vec<u32>,
    /// E: rows per expert, then the next gathered row of each.
    pub(super) next: Vec<usize>,
    /// The experts with rows, ascending, and where their gathered rows start and end.
    pub(super) active: Vec<u32>,
    pub(super) bounds: Vec<usize>,
    /// m × dim: the gathered FFN inputs, then the experts' outputs.
    pub(super) gx: Vec<f32>,
    /// m × expert_hidden: ew1's rows (then the activation's output), ew3's.
    pub(super) gh: Vec<f32>,
    pub(super) gu: Vec<f32>,
    /// cap × shared_hidden: sw1's rows (then the activation's output), sw3's.
    pub(super) sh: Vec<f32>,
    pub(super) su: Vec<f32>,
    /// cap × dim: the shared expert's output.
    pub(super) sy: Vec<f32>,
    /// The shared expert's input activations (the gathered rows use the step's `qa`).
    pub(super) qa: QActs,
}

impl MoeScratch {
    /// The buffers for `cap` rows of a model with experts `moe` (None: empty), from `z`.
    pub(super) fn new(moe: Option<&Moe>, cap: usize, dim: usize, z: &mut Zeros) -> MoeScratch {
        let (e, k, eh, sh) = moe.map_or((0, 0, 0, 0), |m| {
            (m.n_experts, m.k, m.expert_hidden, m.shared_hidden)
        });
        let m = cap * k;
        // `next`, `active` and `bounds` (E + 1 at most each) grow at the first step.
        z.add(Some(3 * (e as u128 + 1) * 8));
        MoeScratch {
            logits: z.take(&[cap, e]),
            ids: z.take_of(&[cap, k]),
            w: z.take(&[cap, k]),
            slot: z.take_of(&[cap, k]),
            row: z.take_of(&[m]),
            next: Vec::new(),
            active: Vec::new(),
            bounds: Vec::new(),
            gx: z.take(&[m, dim]),
            gh: z.take(&[m, eh]),
            gu: z.take(&[m, eh]),
            sh: z.take(&[cap, sh]),
            su: z.take(&[cap, sh]),
            sy: z.take(&[if sh > 0 { cap } else { 0 }, dim]),
            qa: QActs::new(),
        }
    }
}
