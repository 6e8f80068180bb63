//! [`RunError`]: why `mlb-run` failed, one line each, and its exit code.

use std::fmt;
use std::path::PathBuf;

use crate::chat::ChatError;
use crate::format::FormatError;
use crate::model::eval::EvalError;
use crate::session::{ChatSessionError, SessionError};

/// Why mlb-run failed: one line each (the binary prefixes `mlb-run: `).
#[derive(Debug)]
pub enum RunError {
    /// Loading, feeding or generating.
    Session(SessionError),
    /// A measurement.
    Eval(EvalError),
    /// An option out of range.
    BadOption {
        name: &'static str,
        value: String,
        rule: &'static str,
    },
    /// A text prompt and no tokenizer (`expected`: where it was looked for).
    NoTokenizer { expected: PathBuf },
    /// `--tokens` is not a list of ids.
    Ids(FormatError),
    /// The prompt file or stdin cannot be read.
    Read { what: String, err: std::io::Error },
    /// The `--logits` file cannot be written.
    Logits { path: PathBuf, err: std::io::Error },
    /// Generated text cannot be written.
    Stdout(std::io::Error),
    /// An output (`--logits`, `--imatrix`) is one of the inputs.
    OutputIsInput {
        option: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
    /// `--kl-divergence`: the reference model cannot be used.
    Reference {
        path: PathBuf,
        err: Box<SessionError>,
    },
    /// `--chat`: a turn failed (a full context, a template that raised, ...).
    Chat(ChatSessionError),
    /// `--chat`: the conversation JSON (from `what`) is not one.
    Conversation { what: String, err: ChatError },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Reference { path, err } => write!(f, "{}: {err}", path.display()),
            RunError::Session(e) => write!(f, "{e}"),
            RunError::Eval(e) => write!(f, "{e}"),
            RunError::BadOption { name, value, rule } => write!(f, "{name} = {value}: {rule}"),
            RunError::NoTokenizer { expected } => write!(
                f,
                "no tokenizer: {} does not exist; a text prompt needs --tokenizer FILE.mlt (or use --tokens)",
                expected.display()
            ),
            RunError::Ids(e) => write!(f, "--tokens: {e}"),
            RunError::Read { what, err } => write!(f, "{what}: {err}"),
            RunError::Logits { path, err } => write!(f, "--logits {}: {err}", path.display()),
            RunError::Stdout(e) => write!(f, "stdout: {e}"),
            RunError::OutputIsInput { option, path, err } => {
                write!(f, "{option} {}: {err}", path.display())
            }
            RunError::Chat(e) => write!(f, "{e}"),
            RunError::Conversation { what, err } => write!(f, "{what}: {err}"),
        }
    }
}

impl std::error::Error for RunError {}

impl RunError {
    /// The process exit status: 1 for every run error (2 is clap's bad usage).
    pub fn exit_code(&self) -> u8 {
        1
    }
}

impl From<SessionError> for RunError {
    fn from(e: SessionError) -> Self {
        RunError::Session(e)
    }
}

impl From<EvalError> for RunError {
    fn from(e: EvalError) -> Self {
        RunError::Eval(e)
    }
}
