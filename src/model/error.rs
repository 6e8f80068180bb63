//! Why the runtime refused to run: [`ModelError`].

use std::fmt;

use crate::format::FormatError;

/// Why the runtime refused to run.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelError {
    /// The model file is invalid (from the format's validator).
    Format(FormatError),
    /// A token id is not below the model's vocabulary.
    TokenOutOfRange { index: usize, id: u32, vocab: usize },
    /// The prompt (plus what is already cached) does not fit the context.
    ContextFull { needed: usize, ctx: usize },
    /// An option has a value the model cannot take.
    BadOption {
        name: &'static str,
        value: String,
        rule: String,
    },
    /// Sequence `index` of a batched step ([`Model::forward_batch`]) was refused; no
    /// sequence of the batch has changed.
    InBatch {
        index: usize,
        error: Box<ModelError>,
    },
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Format(e) => write!(f, "{e}"),
            ModelError::TokenOutOfRange { index, id, vocab } => write!(
                f,
                "token {index} = {id}: out of range, ids must be below the model's vocab ({vocab})"
            ),
            ModelError::ContextFull { needed, ctx } => write!(
                f,
                "prompt needs {needed} positions but the context holds {ctx} (raise --ctx, at most max_seq)"
            ),
            ModelError::BadOption { name, value, rule } => write!(f, "{name} = {value}: {rule}"),
            ModelError::InBatch { index, error } => write!(f, "sequence {index} of the batch: {error}"),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<FormatError> for ModelError {
    fn from(e: FormatError) -> Self {
        ModelError::Format(e)
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
