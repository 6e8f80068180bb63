//! The session API: load a model once, run sequences over it.
//!
//! - [`Engine`]: the shared, read-only part, loaded once: the mapped `.mlb` file, its
//!   packed weights, the [`Model`](crate::model::Model) and the tokenizer. `Send +
//!   Sync`; any number of sessions borrow one engine.
//! - [`Session`]: one sequence (a server's slot): its KV caches and linear-attention
//!   state, the ids it holds and the logits after the last. Feed ids or text, read
//!   logits, sample with a stop reason ([`Session::generate`], or [`Generator`] one
//!   step at a time), snapshot, restore, truncate, rewind.
//! - [`ChatSession`]: a conversation over a session: the chat template renders it,
//!   each turn prefills only its new ids, replies stop at the stop set, the context
//!   shift drops the oldest turns.
//! - [`ModelOptions`]: which model and tokenizer, how they load and how their sessions
//!   run: the options `mlb-run` and `mlb-serve` share.
//! - [`run`]: `mlb-run` as one call: its validated [`RunOptions`], the generation,
//!   the `--logits` file, and ([`measure`]) `--imatrix`, `--perplexity`,
//!   `--kl-divergence`.
//!
//! Every path gives the logits of [`Model::prefill`](crate::model::Model::prefill):
//! feeding in one call or token by token, after a restore, a truncation or a rewind,
//! the bits are those of a fresh prefill of the same ids.
//!
//! ```no_run
//! use std::ops::ControlFlow;
//! use krafla::model::StateOptions;
//! use krafla::session::{Engine, GenerateOptions, LoadOptions};
//!
//! let engine = Engine::load(&LoadOptions::new("smollm2-q8_0.mlb"))?;
//! let mut s = engine.session(&StateOptions::default())?;
//! s.feed_text("The capital of France is")?;
//! // Stops at the model's stop set (engine.stop_ids()) unless ignore_eos.
//! let opts = GenerateOptions {
//!     max_tokens: 16,
//!     ..GenerateOptions::default()
//! };
//! let g = s.generate(&opts, |step| {
//!     print!("{}", step.text);
//!     ControlFlow::Continue(())
//! })?;
//! println!("{} ({:?})", g.tail, g.stop);
//! # Ok::<(), krafla::session::SessionError>(())
//! ```

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

mod batch;
mod chat;
pub mod chat_run;
mod engine;
mod generate;
pub mod measure;
mod options;
pub mod run;
mod sequence;

pub use batch::feed_batch;
pub use chat::{
    ChatEvent, ChatSessionOptions, ChatSession, ChatSessionError, PromptInfo, Reply,
    DEFAULT_CHAT_MAX_TOKENS,
};
pub use engine::{Engine, LoadOptions, TokenizerSource};
pub use generate::{GenerateOptions, Generation, Generator, Step, StopReason, DEFAULT_MAX_TOKENS};
pub use options::ModelOptions;
pub use run::{run, Frontend, RunError, RunOptions};
pub use sequence::{Session, Snapshot};

use std::fmt;
use std::path::PathBuf;

use crate::format::FormatError;
use crate::model::sampler::BadSamplerOption;
use crate::model::ModelError;

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
    /// [`Session::truncate`] cannot reach the position without a snapshot.
    Truncate {
        to: usize,
        pos: usize,
        why: &'static str,
    },
    /// The snapshot is of another engine, context or cache layout.
    SnapshotMismatch,
    /// The session no longer holds the snapshot's ids in its full-attention caches.
    SnapshotStale { pos: usize, held: usize },
    /// Session `index` of a batched step ([`feed_batch`]) was refused; no session of
    /// the batch has changed.
    InBatch {
        index: usize,
        error: Box<SessionError>,
    },
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
            SessionError::InBatch { index, error } => {
                write!(f, "session {index} of the batch: {error}")
            }
        }
    }
}

impl std::error::Error for SessionError {}

wrap_errors!(SessionError {
    Model(ModelError),
    Format(FormatError),
});
