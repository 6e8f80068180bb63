//! [`ServeError`]: why mlb-serve could not start, one line each.

use std::fmt;
use std::path::PathBuf;

use crate::chat::ChatError;
use crate::format::FormatError;
use crate::session::SessionError;

/// Why mlb-serve could not start (or stopped): one line each.
#[derive(Debug)]
pub enum ServeError {
    BadOption {
        name: &'static str,
        value: String,
        rule: String,
    },
    /// Loading the model or making the slots.
    Session(SessionError),
    /// The tokenizer file does not exist (the server needs one).
    NoTokenizer { expected: PathBuf },
    /// The tokenizer file is invalid.
    Tokenizer {
        path: PathBuf,
        err: Box<FormatError>,
    },
    /// Its chat template does not compile.
    Chat { path: PathBuf, err: ChatError },
    /// The address cannot be listened on.
    Listen { addr: String, err: std::io::Error },
    /// A thread or the async runtime could not be started, or the server failed.
    Thread(String),
}

impl fmt::Display for ServeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServeError::BadOption { name, value, rule } => write!(f, "{name} = {value}: {rule}"),
            ServeError::Session(e) => write!(f, "{e}"),
            ServeError::NoTokenizer { expected } => write!(
                f,
                "no tokenizer: {} does not exist; mlb-serve needs one (--tokenizer FILE.mlt)",
                expected.display()
            ),
            ServeError::Tokenizer { path, err } => write!(f, "{}: {err}", path.display()),
            ServeError::Chat { path, err } => write!(f, "{}: {err}", path.display()),
            ServeError::Listen { addr, err } => write!(f, "cannot listen on {addr}: {err}"),
            ServeError::Thread(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ServeError {}

impl From<SessionError> for ServeError {
    fn from(e: SessionError) -> Self {
        ServeError::Session(e)
    }
}
