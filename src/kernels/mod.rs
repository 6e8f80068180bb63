//! Every SIMD path of the crate, reached through one table per instruction-set tier
//! ([`Kernels`]) chosen once: the quantized matrix products `y = W·x` (Q8_0 / Q4_0 and
//! the GGUF block types' weights, Q8_0 activations), f32 activations × BF16 / F16
//! weights (their own contract, 16 lanes of fused multiply-adds), the activation
//! quantizer, f16 scale conversion, and the f32 work of a forward pass: attention
//! (scores, softmax, value sums), `exp`, SiLU / GELU, the maximum of a slice and the
//! gated delta rule's head step; and error feedback's f64 product `C −= E·U`. Forcing
//! a tier (`KRAFLA_KERNEL`, [`with_tier`], [`Kernels::for_tier`]) forces all of it; the
//! call [`counters`] let a test see which tier's code ran.
//!
//! The folders mirror the arithmetic contract (docs/kernels.md, docs/architecture.md):
//!
//! * [`scalar`]: the references, one file per operation (`tiles`, `quantize`,
//!   `blocks`, `half`, `bf16dot`, `attention`, `kv`, `math`, `delta`, `subproduct`),
//!   always compiled, the fallback tier, the bits every SIMD tier gives;
//! * `x86/` (AVX2, AVX-512 BW / VNNI / BF16, detected at run time) and `arm/` (NEON):
//!   the same file name for the same operation, plus what only they have (`simd`,
//!   `prefetch`, `packed*`);
//! * [`table`] builds the tables and chooses one; [`matmul`] schedules the matrix
//!   products over the thread pool ([`pool`]);
//! * data only: [`tier`], [`mat`] (the matrix a kernel takes: [`QMat`] as stored and
//!   its packed copy, [`packed`]), [`acts`] (the activations).
//!
//! The arithmetic contract of the Q8_0 / Q4_0 matrix products, identical in every
//! tier: per block `b` of 32 columns, `isum_b = Σ q_w·q_x` exactly in i32; per output,
//! [`LANES`] = 8 partial sums, block `b` in increasing order doing
//! `acc[b % 8] += (d_w[b] · d_x[b]) · (isum_b as f32)` (separately rounded f32
//! operations, no FMA); the result `((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) +
//! (acc3+acc7))`. The GGUF block types keep these lanes and this tree but fuse their
//! step. Rows are independent, so the results do not depend on the thread count.

pub mod acts;
pub mod counters;
pub mod error;
pub mod hugebuf;
pub mod mat;
pub mod matmul;
pub mod packed;
pub mod pool;
pub mod scalar;
pub mod table;
pub mod tier;

#[cfg(target_arch = "x86_64")]
pub mod x86;

#[cfg(target_arch = "aarch64")]
pub mod arm;

pub use crate::format::{QMat, WType};
pub use acts::{ActTile, HalfActs, QActs, PACKED_TILE, TILE_TOKENS};
pub use error::{ShapeError, TierError};
pub use mat::WeightMat;
pub use matmul::{matmul, matvec, quantize_acts, GroupInput, GroupProduct, HALF_TILE};
pub use packed::{PackedMat, PackedRows};
pub use scalar::attention::{KvView, Query, TILE_QUERIES};
pub use scalar::delta::DeltaHead;
pub use scalar::kv::{KvData, KvType};
pub use scalar::tiles::LANES;
pub use table::{
    feedback_kernels, kernels, prefetch_hints, quantize_act, sub_product, supported_tiers, tier,
    with_tier, Kernels,
};
pub use tier::Tier;
