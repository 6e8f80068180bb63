//! Krafla: run open LLM weights on plain CPUs.
//!
//! The core shared by the four tools: the `.mlb` / `.mlt` / `.mli` formats, the
//! quantizers, the SIMD kernels, the model runtime, the BPE tokenizer and the
//! Hugging Face checkpoint converter.

pub mod atomic;
pub mod convert;
pub mod format;
pub mod input;
pub mod inspect;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod tokenizer;

pub mod cli;
