//! The instruction-set tiers ([`Tier`]): each has its own kernels, with identical
//! results. Which tiers this CPU runs, and the table of each, are `table`'s.

use std::fmt;

/// An instruction-set tier; each has its own micro-kernels with identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Scalar,
    Avx2,
    Avx512,
    Avx512Vnni,
    /// AVX-512 VNNI's kernels, and `vdpbf16ps` for BF16 weights × BF16 activations.
    Avx512Bf16,
    Neon,
}

impl Tier {
    /// Every tier, lowest first.
    pub const ALL: [Tier; 6] = [
        Tier::Scalar,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Vnni,
        Tier::Avx512Bf16,
        Tier::Neon,
    ];

    /// The name `KRAFLA_KERNEL` takes.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Vnni => "avx512vnni",
            Tier::Avx512Bf16 => "avx512bf16",
            Tier::Neon => "neon",
        }
    }

    /// Parses a `KRAFLA_KERNEL` value.
    pub fn from_name(s: &str) -> Option<Tier> {
        Tier::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
