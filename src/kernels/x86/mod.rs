//! x86_64 tiers: AVX2 and AVX-512 (with or without VNNI), detected at run time.

pub mod avx2;
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
