//! Integration tests: one binary, one module per tool or concern.

mod calibrate;
mod convert;
mod gguf;
mod inspect;
mod kernels;
mod real;
mod reliability;
mod run;
mod tokenizer;
mod util;
