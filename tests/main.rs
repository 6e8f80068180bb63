//! Integration tests: one binary, one module per tool or concern.

mod calibrate;
mod convert;
mod inspect;
mod kernels;
mod kernels_f32;
mod real;
mod reliability;
mod run;
mod tokenizer;
mod util;
