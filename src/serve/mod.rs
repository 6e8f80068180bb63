//! mlb-serve: an OpenAI-compatible HTTP server over the session API.
//!
//! - `options`, `error`, `frontend`: [`ServeOptions`], [`ServeError`], the
//!   [`Frontend`] the binary implements and the start-up summary [`Ready`];
//! - `server`: [`serve`], the whole server as one call;
//! - [`api`]: the JSON of requests, responses, stream chunks and errors; `embed`: the
//!   JSON of /v1/embeddings; `metrics`: the counters of /metrics (Prometheus' text);
//! - `http`: axum on tokio: routes, handlers, server-sent events, the API key check;
//! - `conn`: the accept loop: the connection cap, the head and body timeouts, the
//!   two-stage shutdown;
//! - `scheduler`: the model's own thread: `parallel` slots (each a
//!   [`Session`](crate::session::Session) over the one [`Engine`](crate::session::Engine)), continuous batching
//!   (every step runs each busy slot's next ids through one call), chunked prefill,
//!   prefix reuse, speculative rounds, embeddings, cancellation and shutdown.
//!
//! The async runtime never runs the model: handlers send a request to the model thread
//! over a channel and get its tokens back on another, so a forward pass never blocks the
//! HTTP side and the HTTP side never slows a step.
//!
//! [`serve`] is the whole server as one call: [`ServeOptions`] in, `Ok(())` after a
//! clean shutdown (SIGINT/SIGTERM), or a typed [`ServeError`].

pub mod api;
mod conn;
mod embed;
mod error;
mod frontend;
mod http;
mod metrics;
mod options;
mod scheduler;
mod server;
pub mod structured;

pub use error::ServeError;
pub use frontend::{Frontend, Ready};
pub use options::{
    ServeOptions, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_BODY,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_EMBED_TOKENS, DEFAULT_PORT, DEFAULT_PREFILL_CHUNK,
    DEFAULT_QUEUE, MAX_PARALLEL, MAX_QUEUE, PROMPT_BYTES_SLACK, SHUTDOWN_DRAIN, SHUTDOWN_GRACE,
};
pub use scheduler::step_all;
pub use server::serve;

/// The KV cache's element type (`--kv-type`): the engine's.
pub use crate::model::KvType;
