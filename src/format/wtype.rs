//! The storage type of a weight matrix: the one enum every layer uses (the `.mlb`
//! header's `wtype` codes, the quantizers, the kernels, the converter's `--wtype`).

use std::fmt;

/// Values per block of the block-quantized types.
pub const QK: usize = 32;

/// Weights per super-block of the K types (Q4_K, Q5_K, Q6_K), as in GGUF.
pub const QK_K: usize = 256;

/// How a matrix's weights are stored.
#[allow(non_camel_case_types)] // GGUF's names: Q4_K, IQ4_NL
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    /// One int8 per weight in [-127, 127] and a scale per block of 32.
    Q8_0,
    /// Two 4-bit levels per byte (`w = (nibble − 8)·d`) and a scale per block of 32.
    Q4_0,
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
}

impl WType {
    /// Every type, in code order.
    pub const ALL: [WType; 10] = [
        WType::Q8_0,
        WType::Q4_0,
        WType::Q4_K,
        WType::Q5_K,
        WType::Q6_K,
        WType::Q4_1,
        WType::Q5_0,
        WType::Q5_1,
        WType::IQ4_NL,
        WType::Q6_0,
    ];

    /// The header's `wtype` value of a model stored entirely in this type.
    pub const fn code(self) -> u32 {
        match self {
            WType::Q8_0 => 1,
            WType::Q4_0 => 2,
            WType::Q4_K => 5,
            WType::Q5_K => 6,
            WType::Q6_K => 7,
            WType::Q4_1 => 8,
            WType::Q5_0 => 9,
            WType::Q5_1 => 10,
            WType::IQ4_NL => 11,
            WType::Q6_0 => 12,
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
            WType::Q4_K => "Q4_K",
            WType::Q5_K => "Q5_K",
            WType::Q6_K => "Q6_K",
            WType::Q4_1 => "Q4_1",
            WType::Q5_0 => "Q5_0",
            WType::Q5_1 => "Q5_1",
            WType::IQ4_NL => "IQ4_NL",
            WType::Q6_0 => "Q6_0",
        }
    }

    /// The lower-case name options and file names use: `q8_0`, `q4_0`.
    pub fn cli_name(self) -> &'static str {
        match self {
            WType::Q8_0 => "q8_0",
            WType::Q4_0 => "q4_0",
            WType::Q4_K => "q4_k",
            WType::Q5_K => "q5_k",
            WType::Q6_K => "q6_k",
            WType::Q4_1 => "q4_1",
            WType::Q5_0 => "q5_0",
            WType::Q5_1 => "q5_1",
            WType::IQ4_NL => "iq4_nl",
            WType::Q6_0 => "q6_0",
        }
    }

    /// Weights per block: [`QK`], or [`QK_K`] for the K types.
    pub const fn block_weights(self) -> usize {
        match self {
            WType::Q4_K | WType::Q5_K | WType::Q6_K => QK_K,
            _ => QK,
        }
    }

    /// Bytes of quants in a block of [`WType::block_weights`] weights (for the GGUF
    /// block types, the whole block with its scales: they have no scale array).
    pub const fn block_bytes(self) -> usize {
        match self {
            WType::Q8_0 => QK,
            WType::Q4_0 => QK / 2,
            WType::Q4_K => 144,
            WType::Q5_K => 176,
            WType::Q6_K => 210,
            WType::Q4_1 => 20,
            WType::Q5_0 => 22,
            WType::Q5_1 => 24,
            WType::IQ4_NL => 18,
            WType::Q6_0 => 26,
        }
    }

    /// Bytes of quants in a row of `cols` weights (`cols` a multiple of
    /// [`WType::block_weights`]).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_weights() * self.block_bytes()
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
        assert_eq!(WType::IQ4_NL.row_bytes(576), 18 * 18);
    }
}
