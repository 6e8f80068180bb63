//! The storage type of a weight matrix: the one enum every layer uses (the `.mlb`
//! header's `wtype` codes and the type table of a mixed file, the quantizers, the
//! kernels, the converter's `--wtype`).
//!
//! The file layout knows a type only through its [`Geometry`] (weights per block,
//! bytes per block, whether a separate array of per-block scales follows), so a new
//! type is a new variant with its code, names and geometry: the layout, validation,
//! writer and view need no change.

use std::fmt;

/// Values per block of the 32-weight block types (Q8_0, Q4_0, Q4_1, Q5_0, ...).
pub const QK: usize = 32;

/// Weights per super-block of the 256-weight types (Q2_K … Q6_K, the IQ types), as in GGUF.
pub const QK_K: usize = 256;

/// How a matrix's weights are stored.
#[allow(non_camel_case_types)] // GGUF's names: Q4_K, IQ4_NL
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    /// One int8 per weight in [-127, 127] and a scale per block of 32.
    Q8_0,
    /// Two 4-bit levels per byte (`w = (nibble − 8)·d`) and a scale per block of 32.
    Q4_0,
    /// One bfloat16 per weight (the upper half of an IEEE f32), no scales.
    BF16,
    /// One IEEE binary16 per weight, no scales.
    F16,
    /// GGUF's block_q4_K (144 bytes per 256 weights): 8 sub-blocks of 32 with 6-bit
    /// scales and minimums under f16 super-scales, `w = d·sc·q − dmin·m`, q in 0..=15.
    Q4_K,
    /// GGUF's block_q5_K (176 bytes per 256): Q4_K's scales with 5-bit levels.
    Q5_K,
    /// GGUF's block_q6_K (210 bytes per 256): 16 sub-blocks of 16 with int8 scales,
    /// `w = d·sc·(q − 32)`, q in 0..=63.
    Q6_K,
    /// GGUF's block_q4_1 (20 bytes per 32): `w = d·q + m`, f16 d and m.
    Q4_1,
    /// GGUF's block_q5_0 (22 bytes per 32): `w = d·(q − 16)`, q in 0..=31.
    Q5_0,
    /// GGUF's block_q5_1 (24 bytes per 32): `w = d·q + m`, q in 0..=31.
    Q5_1,
    /// GGUF's block_iq4_nl (18 bytes per 32): `w = d·T[nibble]`, T the 16 fixed levels.
    IQ4_NL,
    /// Krafla's 6-bit 32-block (26 bytes per 32; ik_llama.cpp's block_q6_0 layout):
    /// `w = d·(q − 32)`, q in 0..=63.
    Q6_0,
    /// GGUF's block_mxfp4 (17 bytes per 32; OCP microscaling FP4): `w = 2^(e − 128)·K[nibble]`,
    /// `e` an E8M0 exponent, `K` twice the E2M1 values.
    MXFP4,
    /// GGUF's block_q2_K (84 bytes per 256): 16 sub-blocks of 16 with 4-bit scales and
    /// minimums under f16 super-scales, `w = (d·sc)·q − dmin·m`, q in 0..=3.
    Q2_K,
    /// GGUF's block_q3_K (110 bytes per 256): 16 sub-blocks of 16 with 6-bit scales,
    /// `w = (d·(sc − 32))·q`, q in −4..=3.
    Q3_K,
    /// GGUF's block_iq4_xs (136 bytes per 256): 8 sub-blocks of 32 with 6-bit scales,
    /// `w = (d·(ls − 32))·T[nibble]`, T IQ4_NL's levels.
    IQ4_XS,
    /// GGUF's block_iq3_xxs (98 bytes per 256): groups of 4 weights from a 256-entry
    /// grid, even-parity signs per 8, a 4-bit scale per 32 (docs/file-format.md).
    IQ3_XXS,
    /// GGUF's block_iq3_s (110 bytes per 256): groups of 4 from a 512-entry grid, a sign
    /// bit per weight, a 4-bit scale per 32.
    IQ3_S,
    /// GGUF's block_iq2_xxs (66 bytes per 256): groups of 8 from a 256-entry grid,
    /// even-parity signs per 8, a 4-bit scale per 32.
    IQ2_XXS,
    /// GGUF's block_iq2_xs (74 bytes per 256): groups of 8 from a 512-entry grid,
    /// even-parity signs per 8, a 4-bit scale per 16.
    IQ2_XS,
    /// GGUF's block_iq2_s (82 bytes per 256): groups of 8 from a 1024-entry grid, a sign
    /// bit per weight, a 4-bit scale per 16.
    IQ2_S,
    /// GGUF's block_iq1_m (56 bytes per 256): groups of 8 in {−1, 0, 1} from a
    /// 2048-entry grid with a ±1/8 shift per 8, a 3-bit scale per 16.
    IQ1_M,
}

/// How a type lays out the weights of a row: what the file layout needs to know.
///
/// A matrix of `rows × cols` weights is `rows · cols / block_weights` blocks of
/// `block_bytes` bytes in one array, row-major (a row never shares a block with the
/// next); with `scale_array`, a second array of one scale per block follows (f32, or
/// f16 when the header's `scale_f16` is 1). `cols` must be a multiple of
/// `block_weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Weights per block (1 for the float types: every weight its own block).
    pub block_weights: usize,
    /// Bytes per block in the matrix's first array.
    pub block_bytes: usize,
    /// A separate array of per-block scales follows the blocks.
    pub scale_array: bool,
}

/// `Some($e)` with `$T` the marker type listed for weight type `$w` (`WType_variant =>
/// Type`), `None` for the types `$none` matches: how the kernel tables list a family's
/// types (`for_block_type!`, `for_codebook_type!`).
macro_rules! with_marker {
    ($w:expr, |$T:ident| $e:expr, { $($wt:ident => $ty:ty),* $(,)? }, $none:pat) => {
        match $w {
            $($crate::format::wtype::WType::$wt => {
                type $T = $ty;
                Some($e)
            })*
            $none => None,
        }
    };
}
pub(crate) use with_marker;

impl WType {
    /// Every type, in code order.
    pub const ALL: [WType; 22] = [
        WType::Q8_0,
        WType::Q4_0,
        WType::BF16,
        WType::F16,
        WType::Q4_K,
        WType::Q5_K,
        WType::Q6_K,
        WType::Q4_1,
        WType::Q5_0,
        WType::Q5_1,
        WType::IQ4_NL,
        WType::Q6_0,
        WType::MXFP4,
        WType::Q2_K,
        WType::Q3_K,
        WType::IQ4_XS,
        WType::IQ3_XXS,
        WType::IQ3_S,
        WType::IQ2_XXS,
        WType::IQ2_XS,
        WType::IQ2_S,
        WType::IQ1_M,
    ];

    /// The block types beyond the spec's two and the 2-byte floats that the kernels'
    /// `scalar/blocks.rs` multiplies (`quant::blocks` quantizes these and
    /// [`WType::CODEBOOKS`]).
    pub const BLOCKS: &'static [WType] = WType::ALL.split_at(4).1.split_at(12).0;

    /// GGUF's codebook types (IQ3_XXS … IQ1_M): block types too (scales inside),
    /// quantized by `quant::codebook_fit` and multiplied by `scalar/codebook.rs` (not in
    /// [`WType::BLOCKS`], whose types `scalar/blocks.rs` multiplies).
    pub const CODEBOOKS: &'static [WType] = WType::ALL.split_at(16).1;

    /// The header's `wtype` value of a model stored entirely in this type (and this
    /// type's entry in a mixed file's type table).
    pub const fn code(self) -> u32 {
        match self {
            WType::Q8_0 => 1,
            WType::Q4_0 => 2,
            WType::BF16 => 3,
            WType::F16 => 4,
            WType::Q4_K => 5,
            WType::Q5_K => 6,
            WType::Q6_K => 7,
            WType::Q4_1 => 8,
            WType::Q5_0 => 9,
            WType::Q5_1 => 10,
            WType::IQ4_NL => 11,
            WType::Q6_0 => 12,
            WType::MXFP4 => 13,
            WType::Q2_K => 14,
            WType::Q3_K => 15,
            WType::IQ4_XS => 16,
            WType::IQ3_XXS => 17,
            WType::IQ3_S => 18,
            WType::IQ2_XXS => 19,
            WType::IQ2_XS => 20,
            WType::IQ2_S => 21,
            WType::IQ1_M => 22,
        }
    }

    /// The type of a header `wtype` value or type-table entry, if it names one.
    pub fn from_code(code: u32) -> Option<WType> {
        WType::ALL.into_iter().find(|t| t.code() == code)
    }

    /// The name mlb-inspect prints: `Q8_0`, `Q4_0`, `BF16`, `F16`.
    pub fn name(self) -> &'static str {
        match self {
            WType::Q8_0 => "Q8_0",
            WType::Q4_0 => "Q4_0",
            WType::BF16 => "BF16",
            WType::F16 => "F16",
            WType::Q4_K => "Q4_K",
            WType::Q5_K => "Q5_K",
            WType::Q6_K => "Q6_K",
            WType::Q4_1 => "Q4_1",
            WType::Q5_0 => "Q5_0",
            WType::Q5_1 => "Q5_1",
            WType::IQ4_NL => "IQ4_NL",
            WType::Q6_0 => "Q6_0",
            WType::MXFP4 => "MXFP4",
            WType::Q2_K => "Q2_K",
            WType::Q3_K => "Q3_K",
            WType::IQ4_XS => "IQ4_XS",
            WType::IQ3_XXS => "IQ3_XXS",
            WType::IQ3_S => "IQ3_S",
            WType::IQ2_XXS => "IQ2_XXS",
            WType::IQ2_XS => "IQ2_XS",
            WType::IQ2_S => "IQ2_S",
            WType::IQ1_M => "IQ1_M",
        }
    }

    /// The lower-case name options and file names use: `q8_0`, `q4_0`, `bf16`, `f16`.
    pub fn cli_name(self) -> &'static str {
        match self {
            WType::Q8_0 => "q8_0",
            WType::Q4_0 => "q4_0",
            WType::BF16 => "bf16",
            WType::F16 => "f16",
            WType::Q4_K => "q4_k",
            WType::Q5_K => "q5_k",
            WType::Q6_K => "q6_k",
            WType::Q4_1 => "q4_1",
            WType::Q5_0 => "q5_0",
            WType::Q5_1 => "q5_1",
            WType::IQ4_NL => "iq4_nl",
            WType::Q6_0 => "q6_0",
            WType::MXFP4 => "mxfp4",
            WType::Q2_K => "q2_k",
            WType::Q3_K => "q3_k",
            WType::IQ4_XS => "iq4_xs",
            WType::IQ3_XXS => "iq3_xxs",
            WType::IQ3_S => "iq3_s",
            WType::IQ2_XXS => "iq2_xxs",
            WType::IQ2_XS => "iq2_xs",
            WType::IQ2_S => "iq2_s",
            WType::IQ1_M => "iq1_m",
        }
    }

    /// The type named `s` ([`WType::cli_name`], any case).
    pub fn from_cli_name(s: &str) -> Option<WType> {
        WType::ALL
            .into_iter()
            .find(|t| t.cli_name().eq_ignore_ascii_case(s))
    }

    /// The type's row layout.
    pub const fn geometry(self) -> Geometry {
        match self {
            WType::Q8_0 => Geometry {
                block_weights: QK,
                block_bytes: QK,
                scale_array: true,
            },
            WType::Q4_0 => Geometry {
                block_weights: QK,
                block_bytes: QK / 2,
                scale_array: true,
            },
            WType::BF16 | WType::F16 => Geometry {
                block_weights: 1,
                block_bytes: 2,
                scale_array: false,
            },
            // GGUF's blocks: scales (and minimums) inside each block, one array.
            WType::Q4_K => gguf_block(QK_K, 144),
            WType::Q5_K => gguf_block(QK_K, 176),
            WType::Q6_K => gguf_block(QK_K, 210),
            WType::Q4_1 => gguf_block(QK, 20),
            WType::Q5_0 => gguf_block(QK, 22),
            WType::Q5_1 => gguf_block(QK, 24),
            WType::IQ4_NL => gguf_block(QK, 18),
            WType::Q6_0 => gguf_block(QK, 26),
            WType::MXFP4 => gguf_block(QK, 17),
            WType::Q2_K => gguf_block(QK_K, 84),
            WType::Q3_K => gguf_block(QK_K, 110),
            WType::IQ4_XS => gguf_block(QK_K, 136),
            WType::IQ3_XXS => gguf_block(QK_K, 98),
            WType::IQ3_S => gguf_block(QK_K, 110),
            WType::IQ2_XXS => gguf_block(QK_K, 66),
            WType::IQ2_XS => gguf_block(QK_K, 74),
            WType::IQ2_S => gguf_block(QK_K, 82),
            WType::IQ1_M => gguf_block(QK_K, 56),
        }
    }

    /// Weights per block ([`QK`], [`QK_K`] for the 256-weight types, 1 for BF16 and F16).
    pub const fn block_weights(self) -> usize {
        self.geometry().block_weights
    }

    /// Bytes of one block in the matrix's first array (quants, or the 2-byte floats).
    pub const fn block_bytes(self) -> usize {
        self.geometry().block_bytes
    }

    /// Bytes of a row of `cols` weights in the first array (`cols` a multiple of
    /// [`WType::block_weights`]).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_weights() * self.block_bytes()
    }

    /// Whether a separate array of per-block scales follows the blocks.
    pub const fn has_scales(self) -> bool {
        self.geometry().scale_array
    }

    /// Whether the weights are 2-byte floats (BF16, F16): `&[u16]` views, no scales.
    pub const fn is_half(self) -> bool {
        matches!(self, WType::BF16 | WType::F16)
    }
}

/// A block type that carries its own scales (GGUF's layout): one array, no scales after.
const fn gguf_block(block_weights: usize, block_bytes: usize) -> Geometry {
    Geometry {
        block_weights,
        block_bytes,
        scale_array: false,
    }
}

impl fmt::Display for WType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_the_spec_values() {
        assert_eq!(WType::Q8_0.code(), 1);
        assert_eq!(WType::Q4_0.code(), 2);
        assert_eq!(WType::BF16.code(), 3);
        assert_eq!(WType::F16.code(), 4);
        for t in WType::ALL {
            assert_eq!(WType::from_code(t.code()), Some(t));
            assert_eq!(WType::from_cli_name(t.cli_name()), Some(t));
            assert_eq!(WType::from_cli_name(t.name()), Some(t));
        }
        assert_eq!(WType::from_code(0), None);
        // The codes after the last type up to 31 are reserved for further block types;
        // 128 is a header value (mixed), not a matrix type.
        assert_eq!(WType::from_code(31), None);
        assert_eq!(WType::from_code(128), None);
        assert_eq!(WType::from_cli_name("q4_k"), Some(WType::Q4_K));
    }

    #[test]
    fn geometry() {
        assert_eq!(WType::Q4_0.row_bytes(64), 32);
        assert_eq!(WType::Q8_0.row_bytes(64), 64);
        assert_eq!(WType::BF16.row_bytes(64), 128);
        assert_eq!(WType::F16.row_bytes(96), 192);
        assert!(WType::Q8_0.has_scales() && WType::Q4_0.has_scales());
        assert!(!WType::BF16.has_scales() && !WType::F16.has_scales());
        assert!(WType::BF16.is_half() && !WType::Q8_0.is_half());
        assert_eq!(WType::BF16.block_weights(), 1);
        assert_eq!(WType::Q4_0.block_weights(), QK);
    }

    #[test]
    fn gguf_block_types_have_their_codes_and_gguf_sizes() {
        let expect = [
            (WType::Q4_K, 5, 256, 144),
            (WType::Q5_K, 6, 256, 176),
            (WType::Q6_K, 7, 256, 210),
            (WType::Q4_1, 8, 32, 20),
            (WType::Q5_0, 9, 32, 22),
            (WType::Q5_1, 10, 32, 24),
            (WType::IQ4_NL, 11, 32, 18),
            (WType::Q6_0, 12, 32, 26),
            (WType::MXFP4, 13, 32, 17),
            (WType::Q2_K, 14, 256, 84),
            (WType::Q3_K, 15, 256, 110),
            (WType::IQ4_XS, 16, 256, 136),
            (WType::IQ3_XXS, 17, 256, 98),
            (WType::IQ3_S, 18, 256, 110),
            (WType::IQ2_XXS, 19, 256, 66),
            (WType::IQ2_XS, 20, 256, 74),
            (WType::IQ2_S, 21, 256, 82),
            (WType::IQ1_M, 22, 256, 56),
        ];
        for (t, code, w, b) in expect {
            assert_eq!(
                (t.code(), t.block_weights(), t.block_bytes()),
                (code, w, b),
                "{t}"
            );
            assert_eq!(t.name().to_ascii_lowercase(), t.cli_name());
        }
        assert_eq!(WType::Q6_K.row_bytes(512), 420);
        assert_eq!(WType::BLOCKS.last(), Some(&WType::IQ4_XS));
        assert_eq!(WType::CODEBOOKS.first(), Some(&WType::IQ3_XXS));
        assert_eq!(WType::CODEBOOKS.len(), 6);
        assert_eq!(WType::IQ4_NL.row_bytes(576), 18 * 18);
    }
}
