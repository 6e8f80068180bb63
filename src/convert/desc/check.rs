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
        self.check_layers()?;
        self.check_moe()
    }

    /// Experts only in a family that has them, with the format's counts and widths:
    /// 2..=1024 experts, 1..=n_experts per token, widths in whole blocks of 32.
    fn check_moe(&self) -> Result<(), DescError> {
        let moe_layer = self.layers.iter().position(|l| l.moe);
        let Some(m) = self.moe else {
            return match moe_layer {
                Some(i) => Err(broken(
                    DescField::Layers,
                    format!("layer {i} moe"),
                    "a mixture-of-experts layer needs the experts' sizes",
                )),
                None => Ok(()),
            };
        };
        if self.arch.moe.is_none() {
            return Err(broken(
                DescField::Experts,
                m.n_experts,
                format!("mixture of experts is not part of {}", self.arch.name),
            ));
        }
        if !(2..=1024).contains(&m.n_experts) {
            return Err(broken(
                DescField::Experts,
                m.n_experts,
                "the format takes 2 to 1024 experts",
            ));
        }
        if m.n_used == 0 || m.n_used > m.n_experts {
            return Err(broken(
                DescField::ExpertsUsed,
                m.n_used,
                format!("must be in 1..={} (the number of experts)", m.n_experts),
            ));
        }
        let block = |f: DescField, w: usize, zero_ok: bool| {
            if (w == 0 && !zero_ok) || !w.is_multiple_of(32) || w > 65536 {
                return Err(broken(
                    f,
                    w,
                    "an expert's FFN width must be a multiple of 32, at most 65536",
                ));
            }
            Ok(())
        };
        block(DescField::ExpertHidden, m.expert_hidden, false)?;
        block(DescField::SharedHidden, m.shared_hidden, true)?;
        if moe_layer.is_none() {
            return Err(broken(
                DescField::Layers,
                "no moe layer",
                "experts are described but no layer uses them",
            ));
        }
        Ok(())
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
