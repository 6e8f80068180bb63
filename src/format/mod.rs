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
pub mod mlt_chat;
mod reader;
pub mod wtype;

pub use error::{FormatError, Result, Status};
pub use wtype::WType;
