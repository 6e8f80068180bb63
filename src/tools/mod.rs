//! The tools' logic: what each binary does, as one library call that its thin `main`
//! makes (flags in, a validated options struct, one call, an exit code out).
//!
//! - [`run`]: `mlb-run` (generation, `--logits`, the measurements, `--chat`) over the
//!   session API;
//! - [`inspect`]: `mlb-inspect`'s reports of `.mlb`, `.mlt` and `.mli` files;
//! - [`mlt_convert`]: `mlt-convert` from a Hugging Face folder.
//!
//! This is the top of the crate: a tool uses the library's core (`format`, `model`,
//! `session`, `chat`, `tokenizer`, ...), and no module outside `tools` imports it.

pub mod inspect;
pub mod mlt_convert;
pub mod run;
