//! The CPU features each x86 tier's kernels need, detected at run time
//! (`is_x86_feature_detected!`, cached by std): the table is built only for tiers whose
//! features are all here.

/// AVX2 tier: 256-bit integer ops (`vpmaddubsw`, `vpsignb`).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

/// The AVX2 kernels whose contracts round a multiply-add once (the 2-byte float
/// weights', the GGUF block types'): AVX2 with FMA and F16C. Every AVX2 CPU made has
/// both; one without them runs the scalar reference for those weights.
pub fn has_avx2_fma() -> bool {
    has_avx2() && has_f16c() && is_x86_feature_detected!("fma")
}

/// AVX-512 tier: AVX-512 F and BW (and AVX2 for the shared activation quantizer, F16C
/// for f16 KV caches; every AVX-512 CPU has it).
pub fn has_avx512() -> bool {
    has_avx2()
        && has_f16c()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
}

/// AVX-512 VNNI tier: adds `vpdpbusd`.
pub fn has_avx512vnni() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512vnni")
}

/// The VNNI tier's byte-table lookups (`vpermt2b`, `vpmultishiftqb`): AVX-512 VBMI,
/// which every CPU with VNNI but Cascade Lake has.
pub fn has_avx512vbmi() -> bool {
    has_avx512vnni()
        && is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("avx512vl")
}

/// AVX-512 BF16 tier: the VNNI tier's kernels, and `vdpbf16ps` (on ymm too: VL, which
/// every CPU with AVX-512 BF16 has).
pub fn has_avx512bf16() -> bool {
    has_avx512vnni()
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx512vl")
}

/// F16C (with AVX), for converting f16 scales 8 at a time.
pub fn has_f16c() -> bool {
    is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx")
}
