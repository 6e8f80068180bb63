//! The kernels' errors: a view whose lengths do not fit its shape ([`ShapeError`], the
//! one `format::mat::QMat`'s constructors return too) and a tier this CPU cannot run
//! ([`TierError`]).

use std::fmt;

use super::tier::Tier;
pub use crate::format::ShapeError;

/// A tier this CPU (or build) cannot run, asked for by `kernels::with_tier`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierError(pub Tier);

impl fmt::Display for TierError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tier {} not supported here", self.0)
    }
}

impl std::error::Error for TierError {}
