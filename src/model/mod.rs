//! The model runtime: one forward pass for every architecture the `.mlb` format
//! describes, read from the header and the per-layer flags.
//!
//! - [`config`]: the [`Config`] derived once from the header (effective scales, per-layer
//!   kinds).
//! - [`weights`]: borrowed views into the mapped file, as kernel matrices.
//! - [`rope`]: inverse-frequency tables (plain, llama3, linear, yarn; local base).
//! - [`kv`]: the KV cache; sliding-window layers keep a ring of their window.
//! - [`delta`]: the gated delta rule's recurrent and convolution state.
//! - [`routing`]: a mixture of experts' router: the chosen experts and their weights.
//! - [`forward`]: [`Model`] and its [`State`]: prefill (matrix-matrix) and decode, the
//!   layer loop, with `forward::attention` (private): a softmax-attention layer's work
//!   scheduled over the pool; `forward::moe` (private): a mixture-of-experts FFN, its
//!   rows grouped by expert, two pool steps per layer (buffers in
//!   `forward::moe_scratch`); `ops` (private): the small shared operations (RMSNorm
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
pub mod covariance;
pub mod delta;
pub mod error;
pub mod eval;
pub mod forward;
pub mod imatrix;
pub mod kv;
pub mod observer;
mod ops;
pub mod rope;
pub mod routing;
pub mod sampler;
pub mod weights;

pub use config::{Config, Gating, LayerKind, Moe, RopeSel};
pub use error::{ModelError, Result};
pub use forward::{BatchScratch, Model, Output, SlotMemory, State, StateOptions};
pub use kv::KvType;
pub use sampler::{Sampler, SamplerOptions};
pub use weights::{Packs, Weights};
