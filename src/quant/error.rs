//! Why a matrix could not be quantized ([`QuantError`]), and the checks every quantizer
//! runs on its input first.

use crate::format::half_float;
use crate::format::wtype::WType;

/// Why a matrix could not be quantized.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantError {
    /// A weight is NaN or infinite.
    NonFinite { row: usize, col: usize, value: f32 },
    /// A scale is above 65504 and cannot be stored as f16.
    ScaleOverflow { row: usize, block: usize, d: f32 },
    /// A weight rounds to infinity in a 2-byte float type (BF16, F16).
    OutOfRange {
        row: usize,
        col: usize,
        value: f32,
        wtype: WType,
    },
    /// A scale of a GGUF block type (always f16) is above 65504.
    BlockScaleOverflow {
        wtype: WType,
        row: usize,
        block: usize,
        d: f32,
    },
    /// Krafla reads this type but has no quantizer for it (the IQ codebook types).
    NoQuantizer { wtype: WType },
    /// cols is not a multiple of 32, or the data has the wrong length.
    Shape {
        rows: usize,
        cols: usize,
        len: usize,
    },
}

impl std::fmt::Display for QuantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantError::NonFinite { row, col, value } => {
                write!(f, "weight [{row}, {col}] is {value}: weights must be finite")
            }
            QuantError::ScaleOverflow { row, block, d } => write!(
                f,
                "scale of row {row} block {block} is {d}: above 65504, it cannot be stored as f16 (drop --f16-scales)"
            ),
            QuantError::OutOfRange {
                row,
                col,
                value,
                wtype,
            } => write!(
                f,
                "weight [{row}, {col}] is {value}: beyond the {wtype} range (largest finite {})",
                half_float::max_finite(*wtype)
            ),
            QuantError::BlockScaleOverflow {
                wtype,
                row,
                block,
                d,
            } => write!(
                f,
                "scale of row {row} block {block} is {d}: above 65504, it cannot be stored in {wtype}'s f16 scales"
            ),
            QuantError::NoQuantizer { wtype } => write!(
                f,
                "no quantizer for {wtype}: Krafla reads {wtype} (GGUF import) but cannot write it yet"
            ),
            QuantError::Shape { rows, cols, len } => {
                write!(f, "{rows}×{cols} matrix with {len} values: cols must be a multiple of 32")
            }
        }
    }
}

impl std::error::Error for QuantError {}

/// Checks a rows × cols matrix (row-major f32) before quantizing: `cols` a non-zero
/// multiple of `block`, `x` holding exactly rows × cols values, all finite (the first
/// NaN or infinity is reported with its row and column).
pub(super) fn check_matrix(
    rows: usize,
    cols: usize,
    block: usize,
    x: &[f32],
) -> Result<(), QuantError> {
    if cols == 0 || !cols.is_multiple_of(block) || rows.checked_mul(cols) != Some(x.len()) {
        return Err(QuantError::Shape {
            rows,
            cols,
            len: x.len(),
        });
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite {
            row: i / cols,
            col: i % cols,
            value: x[i],
        });
    }
    Ok(())
}
