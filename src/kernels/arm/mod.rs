//! aarch64 tier: NEON, part of the aarch64 baseline, so chosen at compile time. The
//! same file names as `scalar/` for the same operations.

pub mod tiles;
