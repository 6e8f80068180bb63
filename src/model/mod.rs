//! The model runtime: one forward pass for every architecture the `.mlb` format
//! describes, read from the header and the per-layer flags.
//!
//! - [`config`]: the [`Config`] derived once from the header (effective scales, per-layer
//!   kinds).
//! - [`weights`]: borrowed views into the mapped file, as kernel matrices.
//! - [`rope`]: inverse-frequency tables (plain, llama3, linear, yarn; local base).
//! - [`kv`]: the KV cache; sliding-window layers keep a ring of their window.
//! - [`delta`]: the gated delta rule's recurrent and convolution state.
//! - [`forward`]: [`Model`] and its [`State`]: prefill (matrix-matrix) and decode, the
//!   layer loop, with `forward::attention` (private): a softmax-attention layer's work
//!   scheduled over the pool; `ops` (private): the small shared operations (RMSNorm
//!   rows, adds, sigmoid, fallible zeroed buffers).
//! - [`observer`]: the hook that sees every matrix input, and the importance-matrix
//!   [`observer::Collector`].
//! - [`sampler`]: temperature, top-k, top-p and a seeded PRNG; temperature 0 is greedy.
//! - [`imatrix`]: runs a text through the model to collect an importance matrix.
//! - [`eval`]: perplexity and KL divergence over chunks of a text.
//!
//! Every SIMD instruction of a forward pass runs in [`crate::kernels`], through the one
//! table chosen per call (`kernels::kernels()`): the matrix products (their inputs
//! quantized to Q8_0), attention, SiLU / GELU and the delta rule's head step. matvec and
//! matmul give the same bits, and so do prefill and token-by-token decoding, every tier
//! and every thread count.

pub mod config;
pub mod delta;
pub mod eval;
pub mod forward;
pub mod imatrix;
pub mod kv;
pub mod observer;
mod ops;
pub mod rope;
pub mod sampler;
pub mod weights;

pub use config::{Config, LayerKind, RopeSel};
pub use forward::{BatchScratch, Model, Output, SlotMemory, State, StateOptions};
pub use kv::KvType;
pub use sampler::{Sampler, SamplerOptions};
pub use weights::{Packs, Weights};

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
