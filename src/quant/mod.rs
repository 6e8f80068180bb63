//! Weight and activation quantizers, exactly the spec's float32 operations.
//!
//! Blocks are 32 consecutive values of a row. Q8_0 stores one int8 per value and a
//! scale `d` per block; Q4_0 stores two 4-bit levels per byte and a scale per block.

pub mod q8_0;

/// Values per quantization block.
pub const QK: usize = 32;
