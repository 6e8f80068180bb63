//! The importance matrix (MLI1, `--imatrix`): read and checked against the model, and
//! the importance of each matrix's input channels.

use std::path::Path;

use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::format::mlb::Tensor;
use crate::format::mli::cov::{self as mli_cov, CovEntry, CovSlot};
use crate::format::mli::{self, Mli, Slot};
use crate::quant::feedback::Feedback;

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
        // expert's gate/up take the FFN input's importance (not yet kept per expert);
        // a down projection's input is as wide as its own FFN, so the dense W2 slot
        // serves only when the widths agree (checked below).
        (Some(l), "w1" | "w3" | "ew1" | "ew3" | "sw1" | "sw3") => m.slot(l as usize, Slot::W13),
        (Some(l), "w2" | "ew2" | "sw2") => m.slot(l as usize, Slot::W2),
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
        (Some(l), "w1" | "w3") => (Some(l), CovSlot::Layer(Slot::W13)),
        (Some(l), "w2") => (Some(l), CovSlot::Layer(Slot::W2)),
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
    /// The damping λ of [`CovFile::feedback`].
    pub damp: f64,
}

impl CovFile {
    /// The covariance section of the imatrix `p` (already read as `m`), if it has one.
    /// `damp`: error feedback's damping λ (> 0).
    pub fn load(p: &Path, m: &Mli, damp: f64) -> Result<Option<CovFile>> {
        if !(damp.is_finite() && damp > 0.0) {
            return Err(ConvertError::options(
                "--feedback-damp",
                format!("{damp}: must be a positive number"),
            ));
        }
        let Some(cov) = m.covariance.clone() else {
            return Ok(None);
        };
        Ok(Some(CovFile {
            map: map(p)?,
            cov,
            damp,
        }))
    }

    /// The entry of matrix `t`'s input (`cols` wide), if the file has one that saw rows.
    pub fn entry(&self, t: &Tensor, cols: usize, tied: bool) -> Option<CovEntry> {
        let (layer, slot) = cov_slot(t, tied)?;
        self.cov
            .find(layer, slot)
            .filter(|e| e.n == cols && e.tokens > 0)
            .cloned()
    }

    /// `H` of entry `e`: n × n, f64, row-major.
    pub fn matrix(&self, e: &CovEntry) -> Vec<f64> {
        let tri = mli_cov::values(&self.map, e);
        let n = e.n;
        let mut h = vec![0f64; n * n];
        let mut at = 0;
        for i in 0..n {
            for j in i..n {
                h[i * n + j] = tri[at];
                h[j * n + i] = tri[at];
                at += 1;
            }
        }
        h
    }

    /// The error feedback of entry `e` (`None` when its H is zero or cannot be
    /// factored).
    pub fn feedback(&self, e: &CovEntry) -> Option<Feedback> {
        Feedback::from_packed(e.n, &mli_cov::values(&self.map, e), self.damp)
    }
}
