//! The rules of a model description, checked once for every reader: what the format
//! can express and what the model's family computes.

use super::model::{ModelDesc, RopeScaling};
use crate::convert::error::{DescError, DescField};
use crate::format::mlb::header::act;
use crate::format::mlb::validate::SEQ_LIMIT;

fn broken(field: DescField, value: impl ToString, msg: impl Into<String>) -> DescError {
    DescError {
        field,
        value: value.to_string(),
        msg: msg.into(),
    }
}

impl ModelDesc {
    /// Checks the rules between sections; the readers checked each value on its own.
    pub fn check(&self) -> Result<(), DescError> {
        self.check_rope()?;
        self.check_ffn()?;
        self.check_layers()
    }

    /// rot_dim is even and at most head_dim; partial rotary only where the family has
    /// it, and never with yarn (whose ramp the format computes over head_dim).
    fn check_rope(&self) -> Result<(), DescError> {
        let (rot, hd) = (self.rope.rot_dim, self.dims.head_dim);
        if rot == 0 || rot > hd || !rot.is_multiple_of(2) {
            return Err(broken(
                DescField::RotDim,
                rot,
                format!("rot_dim {rot}: must be even and in 1..=head_dim ({hd})"),
            ));
        }
        if rot < hd && !self.arch.partial_rotary {
            return Err(broken(
                DescField::RotDim,
                rot,
                format!(
                    "partial rotary (rot_dim {rot} of head_dim {hd}) is not supported for {}",
                    self.arch.name
                ),
            ));
        }
        if rot < hd && matches!(self.rope.scaling, RopeScaling::Yarn(_)) {
            return Err(broken(
                DescField::RopeScaling,
                "yarn",
                "yarn with partial rotary is not expressible in the format",
            ));
        }
        Ok(())
    }

    /// The activation the family needs.
    fn check_ffn(&self) -> Result<(), DescError> {
        match self.arch.act {
            Some(a) if a != self.ffn.act => Err(broken(
                DescField::Act,
                act::name(self.ffn.act),
                format!("{} layers need {}", self.arch.name, act::name(a)),
            )),
            _ => Ok(()),
        }
    }

    /// The window within the format's limit; linear-attention layers only where the
    /// family has them.
    fn check_layers(&self) -> Result<(), DescError> {
        if let Some(w) = self.sliding_window.filter(|&w| w > SEQ_LIMIT as usize) {
            return Err(broken(
                DescField::SlidingWindow,
                w,
                "above the format's limit 2^24",
            ));
        }
        if let Some(i) = self.layers.iter().position(|l| l.linear) {
            if !self.arch.linear_attention {
                return Err(broken(
                    DescField::Layers,
                    format!("layer {i} linear"),
                    format!("linear-attention layers are not part of {}", self.arch.name),
                ));
            }
        }
        Ok(())
    }
}
