//! The session API's errors: [`SessionError`] (loading, feeding, sampling, snapshots),
//! [`ChatSessionError`] (a chat turn) and [`ConstraintError`] (a grammar).

use std::fmt;
use std::path::PathBuf;

use crate::chat::ChatError;
use crate::format::FormatError;
use crate::model::sampler::BadSamplerOption;
use crate::model::ModelError;

/// `impl From<E> for Enum` for each variant `Variant(E)` that wraps an error as it is,
/// so that `?` lifts it: `wrap_errors!(Enum { Variant(E), ... })`.
macro_rules! wrap_errors {
    ($enum:ident { $($variant:ident($from:ty)),+ $(,)? }) => {
        $(
            impl From<$from> for $enum {
                fn from(e: $from) -> Self {
                    $enum::$variant(e)
                }
            }
        )+
    };
}

/// Why the session API refused.
#[derive(Debug, Clone, PartialEq)]
pub enum SessionError {
    /// The model file is invalid, or changed while in use.
    Format(FormatError),
    /// The model refused (options, ids, a full context).
    Model(ModelError),
    /// The tokenizer file is invalid.
    Tokenizer(FormatError),
    /// The tokenizer has more tokens than the model's vocabulary.
    TokenizerTooLarge {
        path: Option<PathBuf>,
        n_vocab: usize,
        vocab: usize,
    },
    /// Text needs a tokenizer and the engine has none.
    NoTokenizer,
    /// A sampling option is out of range.
    Sampling(BadSamplerOption),
    /// Another option is out of range.
    BadOption {
        name: &'static str,
        value: String,
        rule: &'static str,
    },
    /// Sampling needs logits: feed an id first.
    NoLogits,
    /// The generator has already stopped.
    Finished,
    /// [`Session::truncate`](super::Session::truncate) cannot reach the position without a snapshot.
    Truncate {
        to: usize,
        pos: usize,
        why: &'static str,
    },
    /// The snapshot is of another engine, context or cache layout.
    SnapshotMismatch,
    /// The session no longer holds the snapshot's ids in its full-attention caches.
    SnapshotStale { pos: usize, held: usize },
    /// The draft model cannot draft for this model (speculative decoding).
    BadDraft { path: PathBuf, why: String },
    /// Session `index` of a batched step ([`feed_batch`](super::feed_batch)) was refused; no session of
    /// the batch has changed.
    InBatch {
        index: usize,
        error: Box<SessionError>,
    },
    /// The generation's grammar failed ([`super::constraint`]).
    Constraint(ConstraintError),
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionError::Format(e) | SessionError::Tokenizer(e) => write!(f, "{e}"),
            SessionError::Model(e) => write!(f, "{e}"),
            SessionError::TokenizerTooLarge {
                path,
                n_vocab,
                vocab,
            } => write!(
                f,
                "{}: n_vocab = {n_vocab}: the tokenizer's vocabulary exceeds the model's vocab ({vocab})",
                path.as_deref()
                    .map_or("tokenizer".into(), |p| p.display().to_string())
            ),
            SessionError::NoTokenizer => {
                write!(f, "no tokenizer: text needs one (load the model's .mlt)")
            }
            SessionError::Sampling(e) => write!(f, "{e}"),
            SessionError::BadOption { name, value, rule } => write!(f, "{name} = {value}: {rule}"),
            SessionError::NoLogits => write!(
                f,
                "no logits to sample from: feed an id first (a generation does not feed its last token)"
            ),
            SessionError::Finished => write!(f, "the generation has already ended"),
            SessionError::Truncate { to, pos, why } => {
                write!(f, "cannot truncate from position {pos} to {to}: {why}")
            }
            SessionError::SnapshotMismatch => write!(
                f,
                "the snapshot is of another engine, context size or cache layout"
            ),
            SessionError::SnapshotStale { pos, held } => write!(
                f,
                "the snapshot's {pos} ids are no longer in the session's caches (it holds {held} ids that do not start with them)"
            ),
            SessionError::BadDraft { path, why } => {
                write!(f, "--draft {}: {why}", path.display())
            }
            SessionError::InBatch { index, error } => {
                write!(f, "session {index} of the batch: {error}")
            }
            SessionError::Constraint(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SessionError {}

wrap_errors!(SessionError {
    Constraint(ConstraintError),
    Model(ModelError),
    Format(FormatError),
});

/// Why a grammar could not constrain a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintError {
    /// The grammar (a schema, regex, Lark or GBNF text) does not compile, or allows no
    /// text at all; `kind` names which (`json_schema`, `regex`, ...).
    Grammar { kind: &'static str, message: String },
    /// Grammars need a tokenizer (its trie) and the engine has none.
    NoTokenizer,
    /// The grammar engine could not be set up for the tokenizer.
    Engine { message: String },
    /// The grammar failed during generation (e.g. a parser limit).
    Mask { message: String },
}

impl fmt::Display for ConstraintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConstraintError::Grammar { kind, message } => write!(f, "invalid {kind}: {message}"),
            ConstraintError::NoTokenizer => {
                write!(f, "a grammar needs a tokenizer (load the model's .mlt)")
            }
            ConstraintError::Engine { message } => {
                write!(f, "the grammar engine cannot use this tokenizer: {message}")
            }
            ConstraintError::Mask { message } => {
                write!(f, "the grammar failed during generation: {message}")
            }
        }
    }
}

impl std::error::Error for ConstraintError {}

/// Why a turn could not be run.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatSessionError {
    /// The tokenizer's `.mlt` has no chat section.
    NoTemplate,
    /// The template failed on this conversation.
    Chat(ChatError),
    Session(SessionError),
    /// The conversation does not fit: it needs `tokens` ids and `room` more positions
    /// for the reply in a context of `ctx`, and (with the context shift) no older turn is
    /// left to drop.
    ContextFull {
        tokens: usize,
        room: usize,
        ctx: usize,
        shift: bool,
    },
}

impl fmt::Display for ChatSessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChatSessionError::NoTemplate => write!(
                f,
                "the tokenizer has no chat template (mlt-convert --chat-template FILE.jinja adds one)"
            ),
            ChatSessionError::Chat(e) => write!(f, "{e}"),
            ChatSessionError::Session(e) => write!(f, "{e}"),
            ChatSessionError::ContextFull {
                tokens,
                room,
                ctx,
                shift: false,
            } => write!(
                f,
                "context full: the conversation is {tokens} tokens and a reply needs {room} more; the context holds {ctx} (start over, use a larger --ctx, or --context-shift to drop the oldest turns)"
            ),
            ChatSessionError::ContextFull {
                tokens,
                room,
                ctx,
                shift: true,
            } => write!(
                f,
                "context full: the last turn alone is {tokens} tokens and a reply needs {room} more; the context holds {ctx} (use a larger --ctx)"
            ),
        }
    }
}

impl std::error::Error for ChatSessionError {}

wrap_errors!(ChatSessionError {
    Session(SessionError),
    Chat(ChatError),
});
