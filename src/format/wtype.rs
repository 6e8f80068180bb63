//! The storage type of a weight matrix: the one enum every layer uses (the `.mlb`
//! header's `wtype` codes and the type table of a mixed file, the quantizers, the
//! kernels, the converter's `--wtype`).
//!
//! The file layout knows a type only through its [`Geometry`] (weights per block,
//! bytes per block, whether a separate array of per-block scales follows), so a new
//! type is a new variant with its code, names and geometry: the layout, validation,
//! writer and view need no change.

use std::fmt;

/// Values per block of the block-quantized types (Q8_0, Q4_0).
pub const QK: usize = 32;

/// How a matrix's weights are stored.
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

impl WType {
    /// Every type, in code order.
    pub const ALL: [WType; 4] = [WType::Q8_0, WType::Q4_0, WType::BF16, WType::F16];

    /// The header's `wtype` value of a model stored entirely in this type (and this
    /// type's entry in a mixed file's type table).
    pub const fn code(self) -> u32 {
        match self {
            WType::Q8_0 => 1,
            WType::Q4_0 => 2,
            WType::BF16 => 3,
            WType::F16 => 4,
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
        }
    }

    /// The lower-case name options and file names use: `q8_0`, `q4_0`, `bf16`, `f16`.
    pub fn cli_name(self) -> &'static str {
        match self {
            WType::Q8_0 => "q8_0",
            WType::Q4_0 => "q4_0",
            WType::BF16 => "bf16",
            WType::F16 => "f16",
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
        }
    }

    /// Weights per block ([`QK`] for Q8_0 and Q4_0, 1 for BF16 and F16).
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
        // 5–31 are reserved for the super-block types; 128 is a header value (mixed),
        // not a matrix type.
        assert_eq!(WType::from_code(5), None);
        assert_eq!(WType::from_code(128), None);
        assert_eq!(WType::from_cli_name("q4_k"), None);
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
}
