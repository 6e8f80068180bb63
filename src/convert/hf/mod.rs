//! A Hugging Face checkpoint folder: `config.json` read into the model description
//! ([`config`], its keys through [`json`], RoPE in [`rope`]), the tensors of its
//! safetensors shards ([`checkpoint`]) mapped to the spec's arrays through one table
//! per architecture ([`arch`]), then converted ([`import`]).

pub mod arch;
pub mod checkpoint;
pub mod config;
pub mod import;
pub mod json;
pub mod pooling;
pub mod rope;
pub mod sources;
