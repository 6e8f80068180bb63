//! A weight matrix as the kernels take it ([`WeightMat`]): the matrix as stored
//! ([`QMat`], a `format` type: borrowed from the map or the quantizer's output) and,
//! when the runtime made one, its copy in the row-interleaved layout ([`PackedMat`])
//! that tiers with packed kernels read instead. Data only: the table multiplies it.

use super::packed::{PackedMat, PackedRows};
use crate::format::mat::QMat;
use crate::format::ShapeError;

/// A weight matrix the kernels multiply: [`QMat`] as stored, and its packed form.
#[derive(Debug, Clone, Copy)]
pub struct WeightMat<'a> {
    /// The matrix as stored.
    pub mat: QMat<'a>,
    /// The same matrix in the row-interleaved layout ([`super::packed`]), when the
    /// runtime packed it; tiers with a packed kernel read it instead of `mat`.
    pub packed: Option<PackedRows<'a>>,
}

impl<'a> From<QMat<'a>> for WeightMat<'a> {
    /// The matrix with no packed copy.
    fn from(mat: QMat<'a>) -> Self {
        WeightMat { mat, packed: None }
    }
}

impl<'a> WeightMat<'a> {
    /// This matrix with its packed form `p` (made by [`PackedMat::new`] from it).
    pub fn with_packed(self, p: &'a PackedMat) -> Result<Self, ShapeError> {
        let m = &self.mat;
        let p = PackedRows::all(p);
        if !p.fits(m) {
            return Err(ShapeError(format!(
                "{p:?} is not the packed form of a {:?} {}x{} matrix",
                m.wtype, m.rows, m.cols
            )));
        }
        Ok(WeightMat {
            packed: Some(p),
            ..self
        })
    }

    /// Rows `r0..r1` as a matrix of their own (one expert of a stacked expert matrix),
    /// with the same rows of the packed copy: `ShapeError` unless `r0 < r1 ≤ rows` and,
    /// for a packed matrix, both ends lie on a group boundary of
    /// [`GROUP`](super::packed::GROUP) rows (or `r1` is the last row).
    pub fn row_range(&self, r0: usize, r1: usize) -> Result<Self, ShapeError> {
        let mat = self.mat.row_range(r0, r1)?;
        let packed = match self.packed {
            Some(p) => Some(p.range(r0, r1).ok_or_else(|| {
                ShapeError(format!(
                    "rows {r0}..{r1} of a packed {}x{} matrix: not on a group boundary",
                    self.mat.rows, self.mat.cols
                ))
            })?),
            None => None,
        };
        Ok(WeightMat { mat, packed })
    }
}
