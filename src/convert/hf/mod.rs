//! A Hugging Face checkpoint folder: `config.json` read into the model description
//! ([`config`], its keys through [`cfg`], RoPE in [`rope`]), the tensors of its
//! safetensors shards ([`checkpoint`]) mapped to the spec's arrays through one table
//! per architecture ([`arch`]), then converted ([`import`]).

pub mod arch;
pub(crate) mod cfg;
pub mod checkpoint;
pub mod config;
pub mod import;
pub(crate) mod rope;
pub(crate) mod sources;
