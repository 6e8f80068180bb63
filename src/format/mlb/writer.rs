//! The streaming `.mlb` writer: header, then each array in the spec's order, each
//! zero-padded to 64 bytes. It checks every array against the layout as it goes, so a
//! converter cannot write arrays out of order or of the wrong size.

use std::io::Write;

use super::header::{wtype, Header, HEADER_SIZE};
use super::layout::{Kind, Layout, Tensor, ALIGN};
use super::validate::{validate, validate_layer_flags, Dims};
use crate::format::error::FormatError;
use crate::format::mat::{Quantized, Scales};
use crate::format::WType;

/// Why writing failed: a mismatch with the layout, or an I/O error.
#[derive(Debug)]
pub enum WriteError {
    Format(FormatError),
    Io(std::io::Error),
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Format(e) => e.fmt(f),
            WriteError::Io(e) => write!(f, "write failed: {e}"),
        }
    }
}

impl std::error::Error for WriteError {}

impl From<FormatError> for WriteError {
    fn from(e: FormatError) -> Self {
        WriteError::Format(e)
    }
}

impl From<std::io::Error> for WriteError {
    fn from(e: std::io::Error) -> Self {
        WriteError::Io(e)
    }
}

/// Writes one `.mlb` file to `W` array by array.
pub struct MlbWriter<W: Write> {
    out: W,
    layout: Layout,
    dims: Dims,
    /// Index of the next tensor to write.
    next: usize,
    pos: u64,
    scale_f16: bool,
    /// A matrix being written in row chunks ([`MlbWriter::write_mat_rows`]).
    pending: Option<PendingMat>,
}

/// A matrix whose quants are partly written: its scales wait until the last row.
struct PendingMat {
    tensor: Tensor,
    rows_done: usize,
    d: Vec<u8>,
}

const ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];

impl<W: Write> MlbWriter<W> {
    /// Validates `header` and `flags` (one byte per layer when `layer_flags` is set)
    /// and writes the header and the layer flags. For a mixed header (`wtype` 128) use
    /// [`MlbWriter::new_mixed`].
    pub fn new(out: W, header: &Header, flags: &[u8]) -> std::result::Result<Self, WriteError> {
        Self::create(out, header, flags, &[])
    }

    /// [`MlbWriter::new`] for a mixed header: `types` gives every matrix's type in
    /// array order ([`Layout::matrix_count`] of them); written as the type table.
    pub fn new_mixed(
        out: W,
        header: &Header,
        flags: &[u8],
        types: &[WType],
    ) -> std::result::Result<Self, WriteError> {
        if header.wtype != wtype::MIXED {
            return Err(FormatError::format(
                "wtype",
                header.wtype,
                "a type table needs wtype 128 (mixed)",
            )
            .into());
        }
        let table: Vec<u8> = types.iter().map(|t| t.code() as u8).collect();
        Self::create(out, header, flags, &table)
    }

    fn create(
        out: W,
        header: &Header,
        flags: &[u8],
        table: &[u8],
    ) -> std::result::Result<Self, WriteError> {
        let dims = validate(header)?;
        let want = if header.layer_flags != 0 {
            dims.n_layers
        } else {
            0
        };
        if flags.len() != want {
            return Err(FormatError::shape(
                "layer_flags",
                flags.len(),
                format!("expected {want} flag bytes"),
            )
            .into());
        }
        validate_layer_flags(header, flags)?;
        if header.wtype == wtype::MIXED {
            let n = Layout::matrix_count(header, &dims, flags)?;
            if table.len() != n {
                return Err(FormatError::format(
                    "type_table",
                    format!("{} entries", table.len()),
                    format!("the model has {n} matrices"),
                )
                .into());
            }
        }
        let layout = Layout::with_table(header, &dims, flags, table, usize::MAX as u64)?;
        let scale_f16 = header.scale_f16 != 0;
        let mut w = MlbWriter {
            out,
            layout,
            dims,
            next: 0,
            pos: 0,
            scale_f16,
            pending: None,
        };
        w.raw(&header.encode())?;
        debug_assert_eq!(w.pos, HEADER_SIZE as u64);
        if header.layer_flags != 0 {
            w.next += 1;
            w.array(flags)?;
        }
        if header.wtype == wtype::MIXED {
            w.next += 1;
            w.array(table)?;
        }
        Ok(w)
    }

    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The tensor the writer expects next, or `None` when all are written.
    pub fn next_tensor(&self) -> Option<&Tensor> {
        self.layout.tensors.get(self.next)
    }

    fn raw(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn array(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.raw(b)?;
        let pad = (ALIGN - self.pos % ALIGN) % ALIGN;
        self.raw(&ZEROS[..pad as usize])
    }

    /// An error when a matrix written row by row is not yet complete.
    fn check_no_pending(&self) -> std::result::Result<(), WriteError> {
        match &self.pending {
            Some(p) => Err(FormatError::shape(
                p.tensor.name.to_string(),
                p.rows_done,
                "rows written of a matrix not yet complete",
            )
            .into()),
            None => Ok(()),
        }
    }

    fn expect(&mut self) -> std::result::Result<Tensor, WriteError> {
        self.check_no_pending()?;
        let t = *self.layout.tensors.get(self.next).ok_or_else(|| {
            FormatError::shape("tensor", self.next, "more arrays than the header implies")
        })?;
        if self.pos != t.offset {
            return Err(FormatError::format(
                t.name.to_string(),
                self.pos,
                format!("expected at offset {}", t.offset),
            )
            .into());
        }
        self.next += 1;
        Ok(t)
    }

    /// Writes the next tensor, which must be a float array of this length.
    pub fn write_f32(&mut self, x: &[f32]) -> std::result::Result<(), WriteError> {
        let t = self.expect()?;
        match t.kind {
            Kind::F32 { len } if len == x.len() => {}
            _ => {
                return Err(FormatError::shape(
                    t.name.to_string(),
                    x.len(),
                    format!("expected {:?}", t.kind),
                )
                .into())
            }
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(FormatError::format(
                t.name.to_string(),
                x[i],
                format!("element {i} is not finite"),
            )
            .into());
        }
        let mut b = Vec::with_capacity(x.len() * 4);
        for v in x {
            b.extend_from_slice(&v.to_le_bytes());
        }
        self.array(&b)?;
        Ok(())
    }

    /// Writes the next tensor, which must be a matrix of this type and shape.
    pub fn write_mat(&mut self, m: &Quantized) -> std::result::Result<(), WriteError> {
        let t = self.expect()?;
        self.check_mat(&t, m, true)?;
        let d = self.scale_bytes(&t, m)?;
        self.array(&m.q)?;
        self.array(&d)?;
        Ok(())
    }

    /// Writes the next rows of the next matrix: call it with consecutive row chunks
    /// (each a `Quantized` of `rows_in_chunk` × cols) until all rows are written. The
    /// quants go out at once; the scales, which follow all quants in the file, are
    /// kept until the last chunk. This lets a converter quantize a large matrix
    /// without holding all of it in memory.
    pub fn write_mat_rows(&mut self, m: &Quantized) -> std::result::Result<(), WriteError> {
        if self.pending.is_none() {
            let t = self.expect()?;
            self.pending = Some(PendingMat {
                tensor: t,
                rows_done: 0,
                d: Vec::new(),
            });
        }
        let p = self.pending.take().expect("pending matrix");
        let t = p.tensor;
        let name = t.name.to_string();
        let Kind::Mat { rows, .. } = t.kind else {
            return Err(
                FormatError::shape(name, "matrix", format!("expected {:?}", t.kind)).into(),
            );
        };
        if m.rows == 0 || p.rows_done + m.rows > rows {
            return Err(FormatError::shape(
                name,
                format!("{} more rows after {}", m.rows, p.rows_done),
                format!("the matrix has {rows} rows"),
            )
            .into());
        }
        self.check_mat(&t, m, false)?;
        let mut d = p.d;
        d.extend_from_slice(&self.scale_bytes(&t, m)?);
        self.raw(&m.q)?;
        let rows_done = p.rows_done + m.rows;
        if rows_done == rows {
            let pad = (ALIGN - self.pos % ALIGN) % ALIGN;
            self.raw(&ZEROS[..pad as usize])?;
            self.array(&d)?;
        } else {
            self.pending = Some(PendingMat {
                tensor: t,
                rows_done,
                d,
            });
        }
        Ok(())
    }

    /// Checks a matrix (`whole`) or a row chunk of one against tensor `t`.
    fn check_mat(
        &self,
        t: &Tensor,
        m: &Quantized,
        whole: bool,
    ) -> std::result::Result<(), WriteError> {
        let name = t.name.to_string();
        let Kind::Mat {
            wtype, rows, cols, ..
        } = t.kind
        else {
            return Err(
                FormatError::shape(name, "matrix", format!("expected {:?}", t.kind)).into(),
            );
        };
        if m.wtype != wtype || (whole && m.rows != rows) || m.cols != cols {
            return Err(FormatError::shape(
                name,
                format!("{} {}×{}", m.wtype.name(), m.rows, m.cols),
                format!("expected {} {rows}×{cols}", wtype.name()),
            )
            .into());
        }
        let want = m.rows.checked_mul(wtype.row_bytes(cols));
        if want != Some(m.q.len()) {
            return Err(FormatError::shape(
                name,
                format!("{} bytes", m.q.len()),
                format!("{} rows of {} need {want:?}", m.rows, wtype.name()),
            )
            .into());
        }
        if m.wtype == WType::Q8_0 && memchr::memchr(0x80, &m.q).is_some() {
            return Err(FormatError::format(name, -128, "Q8_0 quant -128 cannot be stored").into());
        }
        Ok(())
    }

    fn scale_bytes(&self, t: &Tensor, m: &Quantized) -> std::result::Result<Vec<u8>, WriteError> {
        if !m.wtype.has_scales() {
            if !m.d.is_empty() {
                return Err(FormatError::format(
                    t.name.to_string(),
                    format!("{} scales", m.d.len()),
                    format!("{} stores no scales", m.wtype.name()),
                )
                .into());
            }
            return Ok(Vec::new());
        }
        let nb = m.rows * (m.cols / m.wtype.block_weights());
        if m.d.len() != nb {
            return Err(FormatError::shape(
                t.name.to_string(),
                format!("{} scales", m.d.len()),
                format!("{} rows of {} need {nb}", m.rows, m.wtype.name()),
            )
            .into());
        }
        Ok(match (&m.d, self.scale_f16) {
            (Scales::F32(d), false) => d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            (Scales::F16(d), true) => d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => {
                return Err(FormatError::format(
                    t.name.to_string(),
                    "scales",
                    "scale type differs from the header's scale_f16",
                )
                .into())
            }
        })
    }

    /// Checks that every array was written and returns the output.
    pub fn finish(mut self) -> std::result::Result<W, WriteError> {
        self.check_no_pending()?;
        if let Some(t) = self.layout.tensors.get(self.next) {
            return Err(FormatError::shape(t.name.to_string(), "missing", "not written").into());
        }
        self.out.flush()?;
        Ok(self.out)
    }
}
