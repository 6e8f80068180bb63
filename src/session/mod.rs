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
//! - [`Pooling`], [`Pooler`]: embeddings from the final hidden states
//!   ([`Session::feed_hidden`], [`Session::embed`]).
//! - [`speculative`]: speculative decoding (lookup or a draft model; greedy output
//!   unchanged, sampling's distribution kept): [`Session::generate_speculative`] and
//!   the pieces a server batches.
//! - [`ModelOptions`]: which model and tokenizer, how they load and how their sessions
//!   run: the options `mlb-run` and `mlb-serve` share.
//! - [`Grammars`], [`Grammar`], [`Constraint`]: constrained decoding (a JSON schema,
//!   regex, Lark or GBNF grammar the text must match), given to a [`Generator`].
//! - [`SessionError`], [`ChatSessionError`], [`ConstraintError`]: why a call refused.
//!
//! `mlb-run` ([`crate::tools::run`]) and `mlb-serve` ([`crate::serve`]) are built on
//! this API; it imports neither.
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

mod batch;
mod chat;
pub mod constraint;
mod embed;
mod engine;
mod error;
pub mod gbnf;
mod generate;
mod options;
mod sequence;
pub mod speculative;

pub use batch::{feed_batch, feed_batch_with};
pub use chat::{
    ChatEvent, ChatSession, ChatSessionOptions, PromptInfo, Reply, DEFAULT_CHAT_MAX_TOKENS,
};
pub use constraint::{Constraint, Grammar, Grammars};
pub use embed::{l2_normalize, Pooler, Pooling};
pub use engine::{Engine, LoadOptions, TokenizerSource};
pub use error::{ChatSessionError, ConstraintError, SessionError};
pub use generate::{GenerateOptions, Generation, Generator, Step, StopReason, DEFAULT_MAX_TOKENS};
pub use options::ModelOptions;
pub use sequence::{Session, Snapshot};
