//! The storage type of a weight matrix: the one enum every layer uses (the `.mlb`
//! header's `wtype` codes, the quantizers, the kernels, the converter's `--wtype`).

use std::fmt;

/// Values per block of the block-quantized types.
pub const QK: usize = 32;

/// How a matrix's weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    /// One int8 per weight in [-127, 127] and a scale per block of 32.
    Q8_0,
    /// Two 4-bit levels per byte (`w = (nibble − 8)·d`) and a scale per block of 32.
    Q4_0,
}

impl WType {
    /// Every type, in code order.
    pub const ALL: [WType; 2] = [WType::Q8_0, WType::Q4_0];

    /// The header's `wtype` value of a model stored entirely in this type.
    pub const fn code(self) -> u32 {
        match self {
            WType::Q8_0 => 1,
            WType::Q4_0 => 2,
        }
    }

    /// The type of a header `wtype` value, if it names one.
    pub fn from_code(code: u32) -> Option<WType> {
        WType::ALL.into_iter().find(|t| t.code() == code)
    }

    /// The name mlb-inspect prints: `Q8_0`, `Q4_0`.
    pub fn name(self) -> &'static str {
        match self {
            WType::Q8_0 => "Q8_0",
            WType::Q4_0 => "Q4_0",
        }
    }

    /// The lower-case name options and file names use: `q8_0`, `q4_0`.
    pub fn cli_name(self) -> &'static str {
        match self {
            WType::Q8_0 => "q8_0",
            WType::Q4_0 => "q4_0",
        }
    }

    /// Bytes of quants in a block of [`QK`] weights.
    pub const fn block_bytes(self) -> usize {
        match self {
            WType::Q8_0 => QK,
            WType::Q4_0 => QK / 2,
        }
    }

    /// Bytes of quants in a row of `cols` weights (`cols` a multiple of [`QK`]).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / QK * self.block_bytes()
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
        for t in WType::ALL {
            assert_eq!(WType::from_code(t.code()), Some(t));
        }
        assert_eq!(WType::from_code(0), None);
        assert_eq!(WType::from_code(3), None);
        assert_eq!(WType::Q4_0.row_bytes(64), 32);
        assert_eq!(WType::Q8_0.row_bytes(64), 64);
    }
}
