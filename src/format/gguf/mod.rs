//! GGUF (llama.cpp's model file), version 2 and 3, little-endian.
//!
//! - [`types`]: the metadata value types and ggml's tensor types with their block sizes.
//! - [`view`]: `parse`, the validated zero-copy [`GgufView`] over a map.
//! - [`writer`]: the deterministic streaming writer.
//! - [`dequant`]: ggml's block types to f32 (for `mlb-convert --requantize`).
//!
//! What a GGUF model means (architectures, metadata keys, tensor names) is the
//! converter's business: `crate::convert::gguf_in` and `gguf_out`.

pub mod dequant;
pub mod types;
pub mod view;
pub mod writer;

pub use types::{GgmlType, ValueType};
pub use view::{parse, Array, GgufView, Kv, TensorInfo, Value, DEFAULT_ALIGNMENT};
pub use writer::{to_bytes, GgufWriter, MetaValue, TensorSpec};

/// Whether `bytes` start like a GGUF file.
pub fn is_gguf(bytes: &[u8]) -> bool {
    bytes.starts_with(view::MAGIC)
}

#[cfg(test)]
mod tests;
