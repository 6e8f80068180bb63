//! Krafla: run open LLM weights on plain CPUs.
//!
//! The core shared by the four tools: the `.mlb` / `.mlt` / `.mli` formats, the
//! quantizers, the SIMD kernels, the model runtime and its session API, the BPE
//! tokenizer and the Hugging Face checkpoint converter. What each tool does with them
//! is in [`tools`], which nothing else in the library imports.

pub mod atomic;
pub mod chat;
pub mod convert;
pub mod format;
pub mod input;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod rng;
pub mod serve;
pub mod session;
pub mod signals;
pub mod synth;
pub mod tokenizer;
pub mod tools;

pub mod cli;
