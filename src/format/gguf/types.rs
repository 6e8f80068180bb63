//! GGUF's two type enums: the metadata value types and ggml's tensor types, with the
//! block size and bytes per block of every tensor type (ggml.h, gguf-py's
//! `GGML_QUANT_SIZES`).

use std::fmt;

/// The type of a metadata value (`gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub fn from_u32(v: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn to_u32(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// Bytes of a fixed-size value; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one value of this type takes (a string: its u64 length).
    pub fn min_size(self) -> usize {
        match self {
            ValueType::String => 8,
            // element type u32 + count u64
            ValueType::Array => 12,
            t => t.fixed_size().expect("fixed"),
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

macro_rules! ggml_types {
    ($($name:ident = $id:literal, $block:literal, $bytes:literal;)*) => {
        /// A tensor's element type (`ggml_type`): every type a GGUF file may hold.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum GgmlType {
            $($name,)*
        }

        impl GgmlType {
            pub fn from_u32(v: u32) -> Option<GgmlType> {
                match v {
                    $($id => Some(GgmlType::$name),)*
                    _ => None,
                }
            }

            pub fn to_u32(self) -> u32 {
                match self {
                    $(GgmlType::$name => $id,)*
                }
            }

            /// Elements per block.
            pub fn block_size(self) -> u64 {
                match self {
                    $(GgmlType::$name => $block,)*
                }
            }

            /// Bytes per block.
            pub fn block_bytes(self) -> u64 {
                match self {
                    $(GgmlType::$name => $bytes,)*
                }
            }

            /// ggml's name, e.g. `Q4_K`.
            pub fn name(self) -> &'static str {
                match self {
                    $(GgmlType::$name => stringify!($name),)*
                }
            }
        }
    };
}

ggml_types! {
    F32 = 0, 1, 4;
    F16 = 1, 1, 2;
    Q4_0 = 2, 32, 18;
    Q4_1 = 3, 32, 20;
    Q5_0 = 6, 32, 22;
    Q5_1 = 7, 32, 24;
    Q8_0 = 8, 32, 34;
    Q8_1 = 9, 32, 36;
    Q2_K = 10, 256, 84;
    Q3_K = 11, 256, 110;
    Q4_K = 12, 256, 144;
    Q5_K = 13, 256, 176;
    Q6_K = 14, 256, 210;
    Q8_K = 15, 256, 292;
    IQ2_XXS = 16, 256, 66;
    IQ2_XS = 17, 256, 74;
    IQ3_XXS = 18, 256, 98;
    IQ1_S = 19, 256, 50;
    IQ4_NL = 20, 32, 18;
    IQ3_S = 21, 256, 110;
    IQ2_S = 22, 256, 82;
    IQ4_XS = 23, 256, 136;
    I8 = 24, 1, 1;
    I16 = 25, 1, 2;
    I32 = 26, 1, 4;
    I64 = 27, 1, 8;
    F64 = 28, 1, 8;
    IQ1_M = 29, 256, 56;
    BF16 = 30, 1, 2;
    TQ1_0 = 34, 256, 54;
    TQ2_0 = 35, 256, 66;
    MXFP4 = 39, 32, 17;
    NVFP4 = 40, 64, 36;
    Q1_0 = 41, 128, 18;
    Q2_0 = 42, 64, 18;
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_ggml() {
        // gguf-py GGML_QUANT_SIZES, spelled out with QK_K = 256.
        assert_eq!(GgmlType::Q2_K.block_bytes(), 2 + 2 + 256 / 16 + 256 / 4);
        assert_eq!(GgmlType::Q3_K.block_bytes(), 2 + 256 / 4 + 256 / 8 + 12);
        assert_eq!(GgmlType::Q4_K.block_bytes(), 2 + 2 + 256 / 2 + 12);
        assert_eq!(GgmlType::Q5_K.block_bytes(), 2 + 2 + 256 / 2 + 256 / 8 + 12);
        assert_eq!(
            GgmlType::Q6_K.block_bytes(),
            2 + 256 / 2 + 256 / 4 + 256 / 16
        );
        assert_eq!(GgmlType::IQ3_S.block_bytes(), 2 + 64 + 32 + 8 + 4);
        assert_eq!(GgmlType::IQ1_M.block_bytes(), 32 + 16 + 8);
        for v in 0..64 {
            if let Some(t) = GgmlType::from_u32(v) {
                assert_eq!(t.to_u32(), v);
            }
        }
        assert_eq!(GgmlType::from_u32(4), None);
        for v in 0..13 {
            assert_eq!(ValueType::from_u32(v).unwrap().to_u32(), v);
        }
    }
}
