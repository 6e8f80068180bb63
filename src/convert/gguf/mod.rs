//! GGUF, llama.cpp's file: in to `.mlb` ([`import`], its metadata read by [`desc`]) and
//! to `.mlt` ([`tokenizer`]), and an `.mlb` with its `.mlt` out to GGUF ([`export`]),
//! over one table per GGUF architecture ([`arch`]).

pub mod arch;
pub mod desc;
pub mod export;
pub mod file;
pub mod import;
pub mod keys;
pub mod meta;
pub mod rope;
pub mod sources;
pub mod tokenizer;
pub mod types;
