//! The `.mlb` model file: a 256-byte header, optional layer flags, then every array
//! 64-byte aligned so the runtime can map the file and point straight into it.
//!
//! - [`header`]: the fields at their offsets.
//! - [`validate`]: the spec's error table; derived dimensions.
//! - [`layout`]: where each array lies (checked arithmetic).
//! - [`view`]: `parse` and the zero-copy [`Mlb`] view over a map.
//! - [`writer`]: the streaming writer with padding.

pub mod header;
pub mod layout;
pub mod validate;
pub mod view;
pub mod writer;

pub use crate::format::wtype::{Geometry, WType};
pub use header::{Header, FIELDS, HEADER_SIZE};
pub use layout::{Ffn, Kind, LayerIdx, Layout, Mixer, MoeIdx, Tensor, TensorName};
pub use validate::{validate, Dims};
pub use view::{parse, HalfRef, Mlb, Parsed};
pub use writer::{MlbWriter, WriteError};
