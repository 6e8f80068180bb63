//! Krafla: run open LLM weights on plain CPUs.
//!
//! The core shared by the four tools: the `.mlb` / `.mlt` / `.mli` formats, the
//! quantizers, the SIMD kernels, the model runtime and its session API, the BPE
//! tokenizer and the Hugging Face checkpoint converter.

pub mod atomic;
pub mod chat;
pub mod convert;
pub mod format;
pub mod input;
pub mod inspect;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod serve;
pub mod session;
pub mod signals;
pub mod tokenizer;

pub mod cli;
