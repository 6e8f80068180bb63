//! x86_64 tiers: AVX2 and AVX-512 (with or without VNNI), detected at run time.

pub mod avx2;
// The AVX-512 intrinsics are stable since Rust 1.89: the crate's `rust-version` (1.80)
// must be raised to 1.89 for this module to build on the oldest supported toolchain.
#[clippy::msrv = "1.89"]
pub mod avx512;

/// AVX2 tier: 256-bit integer ops (`vpmaddubsw`, `vpsignb`).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

/// AVX-512 tier: AVX-512 F and BW (and AVX2 for the shared activation quantizer).
pub fn has_avx512() -> bool {
    has_avx2() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// AVX-512 VNNI tier: adds `vpdpbusd`.
pub fn has_avx512vnni() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512vnni")
}
