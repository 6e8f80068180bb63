//! GGUF, llama.cpp's file: in to `.mlb` ([`import`], its metadata read by [`desc`]) and
//! to `.mlt` ([`tokenizer`]), and an `.mlb` with its `.mlt` out to GGUF ([`export`]),
//! over one table per GGUF architecture ([`arch`]).

pub mod arch;
pub(crate) mod desc;
pub mod export;
pub mod file;
pub mod import;
pub(crate) mod keys;
pub(crate) mod meta;
pub(crate) mod rope;
pub(crate) mod sources;
pub mod tokenizer;
pub mod types;
