//! The importance matrix (MLI1, `--imatrix`): read and checked against the model, and
//! the importance of each matrix's input channels.

use std::path::Path;

use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::format::mlb::Tensor;
use crate::format::mli::{self, Mli, Slot};

/// Reads and checks an MLI1 file against the model.
pub fn load_imatrix(p: &Path, d: &ModelDesc) -> Result<Mli> {
    let b = crate::input::read(p).map_err(|e| ConvertError::io(p, e))?;
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
        (Some(l), "w1" | "w3") => m.slot(l as usize, Slot::W13),
        (Some(l), "w2") => m.slot(l as usize, Slot::W2),
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
