//! Integration tests: one binary, one module per tool or concern.

mod batch;
mod calibrate;
mod chat;
mod chat_session;
mod convert;
mod embed;
mod gguf;
mod hostile;
mod inspect;
mod kernels;
mod mixes;
mod mlb_format;
mod real;
mod reliability;
mod run;
mod serve;
mod session;
#[cfg(unix)]
mod signals;
mod speculative;
mod structured;
mod tokenizer;
mod util;
