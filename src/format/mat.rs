//! A weight matrix as a file stores it, borrowed ([`QMat`]): what `Mlb::mat` hands out
//! straight from the map and [`Quantized::view`] from the quantizer's output. The
//! kernels multiply it (with its packed copy when the runtime made one,
//! `kernels::WeightMat`); `quant::dequant_mat_row` reads a row back.
//!
//! Row-major, one row per output. Q8_0 / Q4_0 keep their per-block scales in a second
//! array (f32, or f16 bits as in a file with `scale_f16`); the GGUF block types carry
//! their scales inside the blocks and the 2-byte floats have none.

use super::error::ShapeError;
use super::wtype::{WType, QK};

/// A borrowed weight matrix, row-major, one row per output.
///
/// Built with [`QMat::new`] (or [`QMat::new_f16`], [`QMat::new_half`],
/// [`QMat::new_blocks`]), which check every length; it usually points straight into an
/// mmap. Q8_0 quants must not be -128 (the loader rejects it).
#[derive(Debug, Clone, Copy)]
pub struct QMat<'a> {
    pub wtype: WType,
    pub rows: usize,
    pub cols: usize,
    /// Q8_0: `rows·cols` int8 bytes; Q4_0: `rows·cols/2` packed bytes; the other types:
    /// `rows` rows of their blocks (BF16, F16: 2-byte floats, little-endian).
    pub q: &'a [u8],
    /// `rows·cols/32` f32 scales, row-major (empty when the scales are `d16`, and for
    /// the types without a scale array).
    pub d: &'a [f32],
    /// `rows·cols/32` f16 scales (as bits), row-major, when the file stores f16 scales:
    /// the kernels convert them per block of rows as they go (exact), so no f32 copy of
    /// them exists and a decode step reads 2 bytes per block instead of 4. Empty otherwise.
    pub d16: &'a [u16],
}

impl<'a> QMat<'a> {
    /// Checks `cols % 32 == 0`, `rows, cols > 0` and the lengths of `q` and `d`.
    pub fn new(
        wtype: WType,
        rows: usize,
        cols: usize,
        q: &'a [u8],
        d: &'a [f32],
    ) -> Result<Self, ShapeError> {
        let m = QMat::new_unchecked_scales(wtype, rows, cols, q)?;
        m.check_scales(d.len(), "")?;
        Ok(QMat { d, ..m })
    }

    /// [`QMat::new`] with f16 scales (their bits, little-endian order as in the file).
    pub fn new_f16(
        wtype: WType,
        rows: usize,
        cols: usize,
        q: &'a [u8],
        d16: &'a [u16],
    ) -> Result<Self, ShapeError> {
        let m = QMat::new_unchecked_scales(wtype, rows, cols, q)?;
        m.check_scales(d16.len(), "f16 ")?;
        Ok(QMat { d16, ..m })
    }

    /// A BF16 / F16 matrix: `w` holds `rows × cols` 2-byte floats, row-major,
    /// little-endian; `cols` a positive multiple of 32 as in a file.
    pub fn new_half(
        wtype: WType,
        rows: usize,
        cols: usize,
        w: &'a [u8],
    ) -> Result<Self, ShapeError> {
        if !wtype.is_half() {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype}: not a 2-byte float type"
            )));
        }
        check_dims(rows, cols, QK, None)?;
        let len = rows.checked_mul(cols).and_then(|v| v.checked_mul(2));
        if len != Some(w.len()) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype}: {} bytes, expected {len:?}",
                w.len()
            )));
        }
        Ok(QMat::bare(wtype, rows, cols, w))
    }

    /// A matrix of a GGUF block type (Q4_K, …, Q6_0: the scales are inside the blocks);
    /// checks the shape (cols a multiple of the type's block) and the length of `q`.
    pub fn new_blocks(
        wtype: WType,
        rows: usize,
        cols: usize,
        q: &'a [u8],
    ) -> Result<Self, ShapeError> {
        if !is_block_type(wtype) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype}: not a block type (its scales are an array)"
            )));
        }
        QMat::new_unchecked_scales(wtype, rows, cols, q)
    }

    /// Whether `n` scales (of kind `kind`, for the message) are one per block.
    fn check_scales(&self, n: usize, kind: &str) -> Result<(), ShapeError> {
        let (wtype, rows, cols) = (self.wtype, self.rows, self.cols);
        let nb = rows.checked_mul(cols / QK);
        if nb != Some(n) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype:?}: {n} {kind}scales, expected {nb:?}"
            )));
        }
        Ok(())
    }

    /// The matrix `q` of `wtype` with no scale arrays, unchecked.
    fn bare(wtype: WType, rows: usize, cols: usize, q: &'a [u8]) -> Self {
        QMat {
            wtype,
            rows,
            cols,
            q,
            d: &[],
            d16: &[],
        }
    }

    /// The shape and `q` checks of the quantized types' constructors; no scales yet.
    fn new_unchecked_scales(
        wtype: WType,
        rows: usize,
        cols: usize,
        q: &'a [u8],
    ) -> Result<Self, ShapeError> {
        if !matches!(wtype, WType::Q8_0 | WType::Q4_0) && !is_block_type(wtype) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype}: no kernel for this weight type yet"
            )));
        }
        check_dims(rows, cols, wtype.block_weights().max(QK), Some(wtype))?;
        let qlen = rows.checked_mul(wtype.row_bytes(cols));
        if qlen != Some(q.len()) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype:?}: q has {} bytes, expected {qlen:?}",
                q.len()
            )));
        }
        Ok(QMat::bare(wtype, rows, cols, q))
    }

    /// Blocks of 32 per row (the scale arrays' row length).
    pub fn blocks(&self) -> usize {
        self.cols / QK
    }

    /// Rows `r0..r1` as a matrix of their own: the same bytes (a row's quants and its
    /// scales are contiguous in every type), such as one expert of a stacked expert
    /// matrix. `ShapeError` unless `r0 < r1 ≤ rows`.
    pub fn row_range(&self, r0: usize, r1: usize) -> Result<QMat<'a>, ShapeError> {
        if r0 >= r1 || r1 > self.rows {
            return Err(ShapeError(format!(
                "rows {r0}..{r1} of a {}x{} matrix",
                self.rows, self.cols
            )));
        }
        let (rb, nb) = (self.wtype.row_bytes(self.cols), self.blocks());
        let part = |v: &'a [f32]| {
            if v.is_empty() {
                v
            } else {
                &v[r0 * nb..r1 * nb]
            }
        };
        let d16 = if self.d16.is_empty() {
            self.d16
        } else {
            &self.d16[r0 * nb..r1 * nb]
        };
        Ok(QMat {
            rows: r1 - r0,
            q: &self.q[r0 * rb..r1 * rb],
            d: part(self.d),
            d16,
            ..*self
        })
    }

    /// The bytes of row `r` in the first array (its quants, blocks or 2-byte floats).
    pub fn row_q(&self, r: usize) -> &'a [u8] {
        let rb = self.wtype.row_bytes(self.cols);
        &self.q[r * rb..(r + 1) * rb]
    }
}

/// The GGUF block types (codebook types too): their scales are inside the blocks.
fn is_block_type(t: WType) -> bool {
    WType::BLOCKS.contains(&t) || WType::CODEBOOKS.contains(&t)
}

/// Checks `rows, cols > 0` and `cols` a multiple of `m`; the error names the matrix by
/// its shape and, when given, its type.
fn check_dims(rows: usize, cols: usize, m: usize, wtype: Option<WType>) -> Result<(), ShapeError> {
    if rows == 0 || cols == 0 || !cols.is_multiple_of(m) {
        let t = wtype.map_or(String::new(), |t| format!(" {t}"));
        return Err(ShapeError(format!(
            "matrix {rows}x{cols}{t}: rows and cols must be > 0 and cols a multiple of {m}"
        )));
    }
    Ok(())
}

/// The scales of a quantized matrix, as they are stored.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    F32(Vec<f32>),
    /// IEEE half bits.
    F16(Vec<u16>),
}

impl Scales {
    pub fn len(&self) -> usize {
        match self {
            Scales::F32(v) => v.len(),
            Scales::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The quantizer's output (`quant::quantize`): a matrix's quants and scales, owned (rows × cols, row-major
/// blocks), as the writer stores them. The one borrowed view of a quantized matrix
/// is [`QMat`] ([`Quantized::view`], `Mlb::mat`), which the kernels multiply.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub wtype: WType,
    pub rows: usize,
    pub cols: usize,
    /// Q8_0: rows × cols int8 as bytes; Q4_0: rows × cols / 2 packed nibbles; BF16, F16:
    /// rows × cols 2-byte floats, little-endian.
    pub q: Vec<u8>,
    /// One per block of 32 (empty for BF16 and F16).
    pub d: Scales,
}

impl Quantized {
    /// The matrix as a borrowed view.
    pub fn view(&self) -> QMat<'_> {
        let m = QMat {
            wtype: self.wtype,
            rows: self.rows,
            cols: self.cols,
            q: &self.q,
            d: &[],
            d16: &[],
        };
        match &self.d {
            Scales::F32(d) => QMat { d, ..m },
            Scales::F16(d16) => QMat { d16, ..m },
        }
    }
}
