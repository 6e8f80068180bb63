//! The importance matrix (MLI1, `--imatrix`): read and checked against the model, and
//! the importance of each matrix's input channels: a matrix's slot, or, for a stacked
//! expert matrix of a version-2 file, each expert's own sums ([`PerExpert`]).
//!
//! An expert no calibration token was routed to has no sums of its own. Its ew1/ew3 take
//! the layer's pooled FFN input (the W13 slot: every token's, and the router chooses
//! among tokens, it does not change their inputs), which is what the expert would have
//! seen; its ew2 is quantized unweighted, as its hidden channels are its own neurons,
//! which no other expert's sums describe. [`unrouted_warnings`] names each such expert.
//!
//! Error feedback on a stacked expert matrix ([`ExpertCov`]): each expert's ew2 takes
//! its own input's covariance (the tokens routed to it); ew1/ew3 take the layer's FFN
//! input (every token's: a dim × dim covariance per expert would cost E·dim², and each
//! would hold few tokens) at the expert's own channel scales ([`Feedback::rescaled`]).
//! An unrouted expert's ew2 has no feedback, its ew1/ew3 the pooled input's.

use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::format::mlb::Tensor;
use crate::format::mli::cov::{self as mli_cov, CovEntry, CovSlot};
use crate::format::mli::{self, ExpertSlot, Mli, Slot};
use crate::quant::feedback::{Feedback, Prior};

/// Reads and checks an MLI1 file against the model.
pub fn load_imatrix(p: &Path, d: &ModelDesc) -> Result<Mli> {
    // Mapped: a covariance section can be gigabytes, and is read one matrix at a time.
    let b = map(p)?;
    let m = mli::parse(&b).map_err(|e| ConvertError::Imatrix {
        file: p.to_path_buf(),
        field: e.field.clone(),
        value: e.value.clone(),
        msg: e.rule.clone(),
    })?;
    let q_dim = d.dims.head_dim * d.dims.n_heads;
    for (field, got, want) in [
        ("n_layers", m.n_layers, d.dims.n_layers),
        ("dim", m.dim, d.dims.dim),
        ("hidden_dim", m.hidden_dim, d.ffn.hidden_dim),
        ("q_dim", m.q_dim, q_dim),
    ] {
        if got != want {
            return Err(ConvertError::Imatrix {
                file: p.to_path_buf(),
                field: field.into(),
                value: got.to_string(),
                msg: format!("the model has {field} {want}: this imatrix is for another model"),
            });
        }
    }
    if let (Some(x), Some(e)) = (&m.moe, d.moe) {
        let moe_layers: Vec<usize> = (0..d.dims.n_layers).filter(|&l| d.layers[l].moe).collect();
        let layers = |v: &[usize]| format!("{v:?}");
        for (field, got, want) in [
            (
                "n_experts",
                x.n_experts.to_string(),
                e.n_experts.to_string(),
            ),
            (
                "expert_hidden",
                x.expert_hidden.to_string(),
                e.expert_hidden.to_string(),
            ),
            (
                "shared_hidden",
                x.shared_hidden.to_string(),
                e.shared_hidden.to_string(),
            ),
            ("moe_layers", layers(&x.layers), layers(&moe_layers)),
        ] {
            if got != want {
                return Err(ConvertError::Imatrix {
                    file: p.to_path_buf(),
                    field: field.into(),
                    value: got,
                    msg: format!("the model has {field} {want}: this imatrix is for another model"),
                });
            }
        }
    }
    if m.tokens == 0 {
        return Err(ConvertError::Imatrix {
            file: p.to_path_buf(),
            field: "tokens".into(),
            value: "0".into(),
            msg: "no tokens were summed: the importances are undefined".into(),
        });
    }
    Ok(m)
}

/// The importance of a matrix's input channels, from the MLI slot of its input
/// (docs/calibration.md). `None` (the unweighted search) for a matrix without a slot,
/// a slot of another width (lout when V·dv ≠ q_dim) or an all-zero slot.
pub fn importance(m: &Mli, t: &Tensor, cols: usize, tied: bool) -> Option<Vec<f32>> {
    let sums = match (t.name.layer, t.name.name) {
        (Some(l), "wq" | "wk" | "wv" | "wg" | "lqkv" | "lz" | "lb" | "la") => {
            m.slot(l as usize, Slot::Attn)
        }
        (Some(l), "wo" | "lout") => m.slot(l as usize, Slot::Wo),
        // Every expert reads the layer's FFN input: the experts' and the shared
        // expert's gate/up take the FFN input's importance (pooled over the experts:
        // the mix's measure; the write weighs each expert by its own sums where the
        // file has them, [`expert_importance`]); a down projection's input is as wide
        // as its own FFN, so the dense W2 slot serves only when the widths agree
        // (checked below).
        (Some(l), "w1" | "w3" | "ew1" | "ew3" | "sw1" | "sw3") => m.slot(l as usize, Slot::W13),
        // The shared expert's sw2 input is summed on its own in a version-2 file (every
        // token passes it).
        (Some(l), "sw2") => match m.moe.as_ref().and_then(|x| x.shared(l as usize)) {
            Some(s) => s,
            None => m.slot(l as usize, Slot::W2),
        },
        (Some(l), "w2" | "ew2") => m.slot(l as usize, Slot::W2),
        (None, "wcls") if m.cls_tokens > 0 => m.cls(),
        // A shared classifier: tok_emb's columns are the classifier's input channels.
        (None, "tok_emb") if tied && m.cls_tokens > 0 => m.cls(),
        _ => return None,
    };
    if sums.iter().all(|&s| s == 0.0) {
        return None;
    }
    let tokens = if t.name.layer.is_some() {
        m.tokens
    } else {
        m.cls_tokens
    };
    // lout's input is V·dv wide; the Wo slot is q_dim wide: use it only when they agree.
    (sums.len() == cols).then(|| Mli::importance(sums, tokens))
}

/// What an imatrix gives one matrix of a conversion, on either input path: the
/// importance of its input channels (pooled over a stack's experts), each expert's own,
/// and where the covariance section holds its input's covariance (error feedback).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Weighting {
    /// Importance per input channel (the searching quantizers with an imatrix; the
    /// layer's pooled one for an expert matrix, which the mix measures with).
    pub imp: Option<Vec<f32>>,
    /// Each expert's own importance (a stacked expert matrix, MLI version 2): the write's.
    pub imp_experts: Option<PerExpert>,
    /// Where the imatrix's covariance section holds this matrix's input covariance (the
    /// pooled one for ew1/ew3: the mix's measure).
    pub cov: Option<CovEntry>,
    /// Each expert's error feedback (a stacked expert matrix): the write's.
    pub cov_experts: Option<ExpertCov>,
}

impl Weighting {
    /// The importance of row `row`'s channels, and how many rows from it share it.
    pub fn importance(&self, row: usize) -> (Option<&[f32]>, usize) {
        match &self.imp_experts {
            Some(p) => p.at(row),
            None => (self.imp.as_deref(), usize::MAX),
        }
    }

    /// What matrix `t` (`rows` × `cols`) takes from the imatrix `m` and its covariance
    /// section `cov` (`None`: error feedback off).
    pub fn new(
        m: &Mli,
        cov: Option<&CovFile>,
        t: &Tensor,
        (rows, cols): (usize, usize),
        tied: bool,
    ) -> Weighting {
        Weighting {
            imp: importance(m, t, cols, tied),
            imp_experts: expert_importance(m, t, rows, cols),
            cov: cov.and_then(|c| c.entry(t, cols, tied)),
            cov_experts: cov.and_then(|c| c.experts(m, t, rows, cols)),
        }
    }

    /// Error feedback from the covariance section `cov` (`None`: off) for the rows from
    /// `row`, where it holds their input (shared with the matrices that read the same
    /// input), and how many rows from `row` share it (as [`Weighting::importance`]).
    pub fn feedback(&self, cov: Option<&CovFile>, row: usize) -> (Option<Arc<Feedback>>, usize) {
        match (&self.cov_experts, cov) {
            (Some(x), Some(c)) => {
                let per = x.per();
                (c.expert_feedback(x, row / per), per - row % per)
            }
            (None, Some(c)) => (self.cov.as_ref().and_then(|e| c.feedback(e)), usize::MAX),
            (_, None) => (None, usize::MAX),
        }
    }
}

/// Error feedback per expert of a stacked expert matrix (`per` rows each).
#[derive(Debug, Clone, PartialEq)]
pub enum ExpertCov {
    /// ew2: each expert's own input covariance (`None`: never routed, no feedback).
    Own {
        per: usize,
        each: Vec<Option<CovEntry>>,
    },
    /// ew1/ew3: the layer's FFN input, at each expert's channel scales `r` (the root
    /// of its tokens' mean square over every token's, per channel; `None`: never
    /// routed, the pooled input as it is).
    Pooled {
        per: usize,
        entry: CovEntry,
        scales: Vec<Option<Vec<f64>>>,
    },
}

impl ExpertCov {
    fn per(&self) -> usize {
        match self {
            ExpertCov::Own { per, .. } | ExpertCov::Pooled { per, .. } => *per,
        }
    }
}

/// Expert e's channel scales for [`ExpertCov::Pooled`]: `sqrt((own_c / tokens) /
/// (pooled_c / all))`, 1 where no token had the channel, floored at 10⁻³ (a channel
/// the expert's tokens never had then costs it next to nothing).
fn channel_scales(own: &[f64], tokens: u64, pooled: &[f64], all: u64) -> Vec<f64> {
    own.iter()
        .zip(pooled)
        .map(|(&o, &p)| match p > 0.0 {
            true => ((o / tokens as f64) / (p / all as f64)).sqrt().max(1e-3),
            false => 1.0,
        })
        .collect()
}

/// The importance of each expert's rows of a stacked expert matrix (`per` rows each).
#[derive(Debug, Clone, PartialEq)]
pub struct PerExpert {
    pub per: usize,
    /// Expert e's (`None`: the unweighted search).
    pub each: Vec<Option<Vec<f32>>>,
}

impl PerExpert {
    /// The importance of row `r`'s channels, and how many rows from `r` share it (to
    /// the end of its expert).
    pub fn at(&self, r: usize) -> (Option<&[f32]>, usize) {
        (self.each[r / self.per].as_deref(), self.per - r % self.per)
    }
}

/// Each expert's own importance for stacked expert matrix `t` (`rows` × `cols`) from a
/// version-2 file: ew1/ew3 its FFN inputs, ew2 its hidden inputs, over the tokens
/// routed to it; an unrouted expert's ew1/ew3 take the layer's pooled FFN input, its
/// ew2 none (the module's note). `None` for any other matrix or a version-1 file.
pub fn expert_importance(m: &Mli, t: &Tensor, rows: usize, cols: usize) -> Option<PerExpert> {
    let x = m.moe.as_ref()?;
    let l = t.name.layer? as usize;
    let slot = match t.name.name {
        "ew1" | "ew3" => ExpertSlot::In,
        "ew2" => ExpertSlot::Hidden,
        _ => return None,
    };
    let pooled = || {
        let s = m.slot(l, Slot::W13);
        (slot == ExpertSlot::In && s.len() == cols && s.iter().any(|&v| v != 0.0))
            .then(|| Mli::importance(s, m.tokens))
    };
    let each = (0..x.n_experts)
        .map(|e| {
            let sums = x.expert(l, e, slot)?;
            match x.tokens(l, e)? {
                0 => pooled(),
                n => (sums.len() == cols && sums.iter().any(|&v| v != 0.0))
                    .then(|| Mli::importance(sums, n)),
            }
        })
        .collect();
    Some(PerExpert {
        per: rows / x.n_experts,
        each,
    })
}

/// One line per expert no calibration token was routed to, naming its layer and number
/// and what its matrices are weighted by instead.
pub fn unrouted_warnings(m: &Mli) -> Vec<String> {
    let Some(x) = &m.moe else {
        return Vec::new();
    };
    x.unrouted()
        .into_iter()
        .map(|(l, e)| {
            format!(
                "imatrix: layer {l} expert {e} was never routed during calibration: its ew1/ew3 are weighted by the layer's pooled FFN input, its ew2 is quantized unweighted"
            )
        })
        .collect()
}

/// The imatrix file `p`, mapped read-only.
fn map(p: &Path) -> Result<memmap2::Mmap> {
    // SAFETY: a read-only map of a file the conversion only reads; the files it writes
    // are checked not to be it (`check_not_input`).
    unsafe { crate::input::map(p) }.map_err(|e| ConvertError::io(p, e))
}

/// The covariance slot of a matrix's input, as [`importance`] maps it.
pub fn cov_slot(t: &Tensor, tied: bool) -> Option<(Option<usize>, CovSlot)> {
    let layer = t.name.layer.map(|l| l as usize);
    Some(match (layer, t.name.name) {
        (Some(l), "wq" | "wk" | "wv" | "wg" | "lqkv" | "lz" | "lb" | "la") => {
            (Some(l), CovSlot::Layer(Slot::Attn))
        }
        (Some(l), "wo" | "lout") => (Some(l), CovSlot::Layer(Slot::Wo)),
        // A MoE layer's W13 entry is every token's FFN input (the experts' ew1/ew3
        // take it rescaled: [`CovFile::experts`]); its W2 entry without an expert is
        // the shared expert's sw2 input. Each expert's ew2 has an entry of its own.
        (Some(l), "w1" | "w3" | "ew1" | "ew3" | "sw1" | "sw3") => {
            (Some(l), CovSlot::Layer(Slot::W13))
        }
        (Some(l), "w2" | "sw2") => (Some(l), CovSlot::Layer(Slot::W2)),
        (None, "wcls") => (None, CovSlot::Cls),
        (None, "tok_emb") if tied => (None, CovSlot::Cls),
        _ => return None,
    })
}

/// An imatrix file's covariance section, mapped: `mlb-convert` reads one matrix's
/// input covariance at a time (docs/convert.md, "Error feedback").
pub struct CovFile {
    map: memmap2::Mmap,
    pub cov: mli_cov::Covariance,
    /// How [`CovFile::feedback`] regularizes H.
    pub prior: Prior,
    /// The factors built last, by entry offset, newest last: at most [`RECENT`].
    recent: Mutex<Vec<(usize, Arc<Feedback>)>>,
    /// The expert's factor built last, by entry offset and expert: a stack's rows go
    /// expert by expert, and its factors stay out of `recent`, which keeps the layer's
    /// W13 factor from ew1 over ew2 to ew3.
    expert: Mutex<Option<(ExpertKey, Arc<Feedback>)>>,
}

/// An expert's factor: its entry's offset (the layer's W13 entry for ew1/ew3) and its
/// index.
type ExpertKey = (usize, usize);

/// Factors kept for reuse: the matrices that read one input are at most one other
/// input apart in array order (wq wk wv; wo wg; w1 w2 w3), so two serve every reuse,
/// and memory holds at most two factors (n² f64 each) and the one being built.
const RECENT: usize = 2;

impl CovFile {
    /// The covariance section of the imatrix `p` (already read as `m`), if it has one.
    /// `prior`: error feedback's damping λ (> 0) and shrinkage α (0 to 1).
    pub fn load(p: &Path, m: &Mli, prior: Prior) -> Result<Option<CovFile>> {
        let Prior { damp, shrink } = prior;
        if !(damp.is_finite() && damp > 0.0) {
            return Err(ConvertError::options(
                "--feedback-damp",
                format!("{damp}: must be a positive number"),
            ));
        }
        if !(0.0..=1.0).contains(&shrink) {
            return Err(ConvertError::options(
                "--feedback-shrink",
                format!("{shrink}: must be from 0 to 1"),
            ));
        }
        let Some(cov) = m.covariance.clone() else {
            return Ok(None);
        };
        Ok(Some(CovFile {
            map: map(p)?,
            cov,
            prior,
            recent: Mutex::new(Vec::new()),
            expert: Mutex::new(None),
        }))
    }

    /// What the conversion says of the covariances: how many, whether error feedback
    /// uses them (`feedback`), and a warning when one holds too few tokens for its width.
    pub fn notes(&self, feedback: bool) -> Vec<String> {
        let mut notes = vec![format!(
            "the imatrix has the covariance of {} matrix inputs: {}",
            self.cov.entries.len(),
            if feedback {
                "quantizing with error feedback"
            } else {
                "error feedback is off (--no-error-feedback)"
            }
        )];
        // Too few tokens for a covariance's width and the compensation fits the
        // calibration text's noise: measured on SmolLM2-135M, 4,096 tokens for its
        // 1,536-wide down projections made Q2_K's and Q4_0's KL divergence worse.
        let thin = self
            .cov
            .entries
            .iter()
            .filter(|e| (e.tokens as f64) < 16.0 * e.n as f64);
        if let Some(e) = thin.min_by(|a, b| {
            (a.tokens as f64 / a.n as f64).total_cmp(&(b.tokens as f64 / b.n as f64))
        }) {
            if feedback {
                let whose = match (e.layer, e.expert) {
                    (Some(l), Some(x)) => format!(" (layer {l} expert {x}'s ew2 input)"),
                    (Some(l), None) => format!(" (layer {l} {} input)", e.slot.name()),
                    (None, _) => " (the classifier's input)".into(),
                };
                let experts = match self.cov.entries.iter().any(|e| e.expert.is_some()) {
                    true => "; an expert sees only the tokens routed to it",
                    false => "",
                };
                notes.push(format!(
                    "warning: a covariance of {} channels{whose} holds {} tokens: error feedback wants many more tokens than channels (16x at least, GPTQ uses 100x){experts}; collect with more --chunks, or compare with --no-error-feedback",
                    e.n, e.tokens
                ));
            }
        }
        notes
    }

    /// The entry of matrix `t`'s input (`cols` wide), if the file has one that saw rows.
    pub fn entry(&self, t: &Tensor, cols: usize, tied: bool) -> Option<CovEntry> {
        let (layer, slot) = cov_slot(t, tied)?;
        self.cov
            .find(layer, slot)
            .filter(|e| e.n == cols && e.tokens > 0)
            .cloned()
    }

    /// The per-expert feedback of stacked expert matrix `t` (`rows` × `cols`) of a
    /// version-2 imatrix `m` ([`ExpertCov`]); `None` for any other matrix, or ew1/ew3
    /// when the file has no covariance of the layer's FFN input.
    pub fn experts(&self, m: &Mli, t: &Tensor, rows: usize, cols: usize) -> Option<ExpertCov> {
        let x = m.moe.as_ref()?;
        let l = t.name.layer? as usize;
        let per = rows / x.n_experts;
        match t.name.name {
            "ew2" => Some(ExpertCov::Own {
                per,
                each: (0..x.n_experts as u32)
                    .map(|e| {
                        let slot = CovSlot::Layer(Slot::W2);
                        self.cov
                            .find_expert(Some(l), slot, Some(e))
                            .filter(|c| c.n == cols && c.tokens > 0)
                            .cloned()
                    })
                    .collect(),
            }),
            "ew1" | "ew3" => {
                let entry = self.entry(t, cols, false)?;
                let pooled = m.slot(l, Slot::W13);
                let scales = (0..x.n_experts)
                    .map(
                        |e| match (x.tokens(l, e)?, x.expert(l, e, ExpertSlot::In)?) {
                            (0, _) => None,
                            (n, own) => Some(channel_scales(own, n, pooled, m.tokens)),
                        },
                    )
                    .collect();
                Some(ExpertCov::Pooled { per, entry, scales })
            }
            _ => None,
        }
    }

    /// Expert `e`'s error feedback in `x` (kept while its rows are written).
    pub fn expert_feedback(&self, x: &ExpertCov, e: usize) -> Option<Arc<Feedback>> {
        // The entry, and the scales an ew1/ew3 expert takes it at.
        let (entry, scales) = match x {
            ExpertCov::Own { each, .. } => (each.get(e)?.as_ref()?, None),
            ExpertCov::Pooled { entry, scales, .. } => match scales.get(e)? {
                Some(r) => (entry, Some(r)),
                None => return self.feedback(entry),
            },
        };
        let key = (entry.offset, e);
        let lock = || self.expert.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, f)) = lock().as_ref().filter(|(k, _)| *k == key) {
            return Some(f.clone());
        }
        let fb = Arc::new(match scales {
            Some(r) => self.feedback(entry)?.rescaled(r),
            None => self.build(entry)?,
        });
        *lock() = Some((key, fb.clone()));
        Some(fb)
    }

    /// Entry `e`'s factor, built.
    fn build(&self, e: &CovEntry) -> Option<Feedback> {
        let values = mli_cov::values(&self.map, e);
        Feedback::from_packed(e.n, &values, self.prior, crate::kernels::feedback_kernels())
    }

    /// `H` of entry `e`, its first `w` channels (`w ≤ n`): w × w, f64, row-major.
    pub fn matrix(&self, e: &CovEntry, w: usize) -> Vec<f64> {
        let tri = mli_cov::values(&self.map, e);
        let n = e.n;
        assert!(w <= n, "a window of {w} of {n} channels");
        let mut h = vec![0f64; w * w];
        for i in 0..w {
            // Row i of the packed upper triangle starts at i·n − i(i−1)/2.
            let at = i * n - i * i.saturating_sub(1) / 2;
            for j in i..w {
                let v = tri[at + j - i];
                h[i * w + j] = v;
                h[j * w + i] = v;
            }
        }
        h
    }

    /// The error feedback of entry `e` (`None` when its H is zero or cannot be
    /// factored): built once while the matrices that read its input are quantized
    /// ([`RECENT`]).
    pub fn feedback(&self, e: &CovEntry) -> Option<Arc<Feedback>> {
        let recent = || self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, f)) = recent().iter().find(|(o, _)| *o == e.offset) {
            return Some(f.clone());
        }
        let fb = Arc::new(self.build(e)?);
        let mut r = recent();
        r.push((e.offset, fb.clone()));
        if r.len() > RECENT {
            r.remove(0);
        }
        Some(fb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mli::MoeSums;

    #[test]
    fn per_expert_rows_and_unrouted_warnings() {
        let p = PerExpert {
            per: 3,
            each: vec![Some(vec![1.0]), None],
        };
        assert_eq!(p.at(0), (Some(&[1.0f32][..]), 3));
        assert_eq!(p.at(2), (Some(&[1.0f32][..]), 1));
        assert_eq!(p.at(4), (None, 2));
        let mut x = MoeSums::new(vec![1, 3], 2, 4, 4, 0);
        for (l, e) in [(1, 0), (3, 1)] {
            *x.tokens_mut(l, e).unwrap() = 5;
        }
        let m = Mli::new(4, 4, 4, 4).with_moe(x);
        let w = unrouted_warnings(&m);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("layer 1 expert 1 was never routed"), "{w:?}");
        assert!(w[1].contains("layer 3 expert 0 was never routed"), "{w:?}");
        assert!(unrouted_warnings(&Mli::new(4, 4, 4, 4)).is_empty());
    }
}
