//! Integration tests: one binary, one module per tool or concern.

mod calibrate;
mod chat;
mod convert;
mod hostile;
mod inspect;
mod kernels;
mod kernels_f32;
mod real;
mod reliability;
mod run;
mod serve;
mod session;
#[cfg(unix)]
mod signals;
mod tokenizer;
mod util;
