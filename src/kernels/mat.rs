//! A weight matrix as the kernels take it ([`WeightMat`]): the matrix as stored
//! ([`QMat`], a `format` type: borrowed from the map or the quantizer's output) and,
//! when the runtime made one, its copy in the row-interleaved layout ([`PackedMat`])
//! that tiers with packed kernels read instead. Data only: the table multiplies it.

use super::packed::PackedMat;
use crate::format::mat::QMat;
use crate::format::ShapeError;

/// A weight matrix the kernels multiply: [`QMat`] as stored, and its packed form.
#[derive(Debug, Clone, Copy)]
pub struct WeightMat<'a> {
    /// The matrix as stored.
    pub mat: QMat<'a>,
    /// The same matrix in the row-interleaved layout ([`super::packed`]), when the
    /// runtime packed it; tiers with a packed kernel read it instead of `mat`.
    pub packed: Option<&'a PackedMat>,
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
}
