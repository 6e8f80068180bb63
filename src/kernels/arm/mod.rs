//! aarch64 tier: NEON, part of the aarch64 baseline, so chosen at compile time.

pub mod neon;
