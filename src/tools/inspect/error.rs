//! [`InspectError`]: why `mlb-inspect` failed, one line each.

use std::fmt;
use std::path::PathBuf;

use crate::chat::ChatError;
use crate::format::FormatError;

/// Why `mlb-inspect` failed; `Display` is the one line it prints.
#[derive(Debug)]
pub enum InspectError {
    /// The file (or the conversation file) cannot be read or is invalid.
    Format(FormatError),
    /// The action does not apply to this kind of file.
    Usage {
        file: PathBuf,
        message: &'static str,
    },
    /// `--tensor NAME` names no tensor of the model.
    NoTensor { file: PathBuf, name: String },
    /// The conversation or the template failed: named by `file` (the conversation
    /// for a bad message list, the .mlt for a template failure).
    Chat { file: PathBuf, error: ChatError },
    /// The input on stdin is not what the action reads.
    Stdin(String),
}

impl fmt::Display for InspectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InspectError::Format(e) => e.fmt(f),
            InspectError::Usage { file, message } => write!(f, "{}: {message}", file.display()),
            InspectError::NoTensor { file, name } => {
                let file = file.display();
                write!(
                    f,
                    "{file}: no tensor named '{name}' (see the tensor table of mlb-inspect {file})"
                )
            }
            InspectError::Chat { file, error } => write!(f, "{}: {error}", file.display()),
            InspectError::Stdin(e) => write!(f, "stdin: {e}"),
        }
    }
}

impl std::error::Error for InspectError {}
