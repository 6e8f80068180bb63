//! The scalar references: the arithmetic contract of every kernel written out plainly
//! (docs/kernels.md), always compiled, the fallback tier, and the bits every SIMD tier
//! gives. One file per operation; `x86/` and `arm/` give their versions the same names.

pub mod attention;
pub mod bf16dot;
pub mod blocks;
pub mod codebook;
pub mod delta;
pub mod half;
pub mod kv;
pub mod math;
pub mod quantize;
pub mod subproduct;
pub mod tiles;
