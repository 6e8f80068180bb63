//! x86_64 tiers: AVX2, AVX-512 BW (with VNNI, with BF16), detected at run time once
//! (`features`, `table::Kernels::for_tier`); every function here is reached through the
//! table. The same file names as `scalar/` for the same operations, plus what only x86
//! has: `simd` (shared register helpers), `prefetch` (the weight streams' hints),
//! `packed*` (the packed-weight kernels).

pub mod attention;
pub mod bf16dot;
pub mod blocks;
pub mod codebook;
pub mod codebook_vbmi;
pub mod delta;
pub mod features;
pub mod half;
pub mod kv;
pub mod math;
pub mod packed;
pub mod packed_blocks;
pub mod prefetch;
pub mod quantize;
pub mod simd;
pub mod subproduct;
pub mod tiles;
