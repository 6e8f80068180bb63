//! File formats: `.mlb` (model), `.mlt` (tokenizer), `.mli` (importance matrix), and
//! GGUF (llama.cpp's model file, read and written by the converters).
//!
//! Each format has a pure `parse(&[u8])` that validates every rule of the spec and a
//! deterministic writer; the same code validates for `mlb-inspect` and loads for
//! `mlb-run`.

pub mod error;
pub mod gguf;
pub mod mlb;
pub mod mli;
pub mod mlt;

pub use error::{FormatError, Result, Status};
