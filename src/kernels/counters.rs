//! Calls of the kernel table's entries, per instruction-set tier and operation, so that
//! a test can prove which code a forced tier ran: a scalar-tier forward pass runs no
//! SIMD at all, and a SIMD tier runs its own kernels and none of a higher tier.
//!
//! Every entry of the table counts itself on entry, under the tier whose CPU features
//! it needs (AVX2 code shared by the AVX-512 tiers counts as [`Tier::Avx2`]). Counting
//! happens only in builds with debug assertions (`cargo test`, debug builds): release
//! builds count nothing and the calls compile to nothing. The counts are per thread;
//! run the work on a one-thread pool (`Pool::leak(1).install`) to see all of it.

use std::cell::Cell;

use super::tier::Tier;

/// Whether this build counts (debug assertions on).
pub const ENABLED: bool = cfg!(debug_assertions);

/// What a counted kernel call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The activation quantizer.
    Quantize,
    /// A row-major matrix micro-kernel.
    Tile,
    /// A packed-weight matrix micro-kernel.
    Packed,
    /// f16 scales to f32.
    F16,
    /// Attention of a tile of queries.
    Attend,
    /// `exp` over a slice.
    Exp,
    /// The maximum of a slice.
    Max,
    /// SiLU or GELU times the up projection.
    Act,
    /// The gated delta rule's step of one head.
    Delta,
    /// A BF16 / F16 matrix micro-kernel (f32 activations).
    Half,
    /// A BF16 matrix micro-kernel on BF16 activations (`HalfActs::Bf16`).
    Dot,
    /// Error feedback's f64 product `C −= E·U`, and its update `y −= a·x`.
    SubProduct,
}

impl Op {
    pub const ALL: [Op; 12] = [
        Op::Quantize,
        Op::Tile,
        Op::Packed,
        Op::F16,
        Op::Attend,
        Op::Exp,
        Op::Max,
        Op::Act,
        Op::Delta,
        Op::Half,
        Op::Dot,
        Op::SubProduct,
    ];
}

const TIERS: usize = Tier::ALL.len();
const OPS: usize = Op::ALL.len();

/// Counts per tier and operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls([[u64; OPS]; TIERS]);

impl Calls {
    /// Calls of `op` made by code of tier `t`.
    pub fn get(&self, t: Tier, op: Op) -> u64 {
        self.0[t as usize][op as usize]
    }

    /// All calls made by code of tier `t`.
    pub fn of_tier(&self, t: Tier) -> u64 {
        self.0[t as usize].iter().sum()
    }

    /// Calls of `op` made by code of any tier other than the scalar one.
    pub fn simd(&self, op: Op) -> u64 {
        Tier::ALL[1..].iter().map(|&t| self.get(t, op)).sum()
    }
}

thread_local! {
    static CALLS: [[Cell<u64>; OPS]; TIERS] =
        const { [const { [const { Cell::new(0) }; OPS] }; TIERS] };
}

/// Counts one call of `op` by code of tier `t` (nothing without debug assertions).
#[inline(always)]
pub(crate) fn count(t: Tier, op: Op) {
    if ENABLED {
        CALLS.with(|c| {
            let c = &c[t as usize][op as usize];
            c.set(c.get() + 1);
        });
    }
}

/// The calls made on this thread since the last `take`, and a fresh start.
pub fn take() -> Calls {
    let mut out = Calls::default();
    CALLS.with(|c| {
        for (o, row) in out.0.iter_mut().zip(c) {
            for (o, cell) in o.iter_mut().zip(row) {
                *o = cell.replace(0);
            }
        }
    });
    out
}
