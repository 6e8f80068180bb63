//! Model files in, `.mlb` out, and `.mlb` out to GGUF: `mlb-convert`, `mlt-convert`'s
//! GGUF input and `mlb-export`.
//!
//! Split by source, meeting in one pipeline:
//! - [`hf`]: a Hugging Face checkpoint folder (config.json, safetensors shards, the
//!   per-architecture name tables).
//! - [`gguf`]: a GGUF file in ([`gguf::import`], its tokenizer in [`gguf::tokenizer`]),
//!   and an `.mlb` out to GGUF ([`gguf::export`]).
//! - [`desc`]: the model description both readers fill in and `mlb-export` reads back
//!   from a header, checked once ([`desc::ModelDesc::check`]); [`arch`]: what each
//!   model family computes, as table rows.
//! - [`pipeline`]: what both readers share once the model is described: the type of
//!   every matrix ([`pipeline::plan`], [`pipeline::mix`]), the importance matrix, the
//!   spec's row orders ([`pipeline::permute`]) and the streamed write.
//!
//! [`convert`] is the front door; [`ConvertError`] the one error type.

pub mod arch;
pub mod desc;
pub mod error;
pub mod front;
pub mod gguf;
pub mod hf;
pub mod options;
pub mod pipeline;
pub mod summary;

pub use crate::format::WType;
pub use error::{ConvertError, Result};
pub use front::convert;
pub use options::{default_output, ConvertOptions, DEFAULT_Q4_Q8_MASK};
pub use pipeline::plan::{Select, TypePlan, TypeRule};
pub use pipeline::stream::Progress;
pub use summary::Summary;
