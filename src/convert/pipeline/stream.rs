//! Writing the `.mlb`: every array in spec order from one source ([`Arrays`]: a
//! checkpoint, a GGUF file), matrices read as f32 and quantized (or their blocks copied),
//! large matrices in row chunks of a bounded size, so that
//! peak memory stays near one chunk plus its quantized form; quantization is per row,
//! so the bytes do not depend on the chunk size or the thread count.
//!
//! The output goes through [`AtomicFile`]: it gets its name only on success, and on any
//! error (or a kill) an existing target is untouched.

use std::io::BufWriter;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::atomic::AtomicFile;
use crate::convert::error::{ConvertError, Result};
use crate::format::mlb::header::Header;
use crate::format::mlb::{Kind, Layout, MlbWriter, WriteError};
use crate::format::WType;
use crate::quant::feedback::{self, Feedback};
use crate::quant::{Q4Rule, QuantError, QuantOptions, Quantized};

/// Progress reports, in order: one `Start`, `Note`s and `Warning`s, one `Tensor` per
/// array written.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    Start {
        tensors: usize,
        bytes: u64,
    },
    Note(&'a str),
    /// Something the user should act on, though the file is written (an imatrix that
    /// never routed to an expert).
    Warning(&'a str),
    Tensor {
        index: usize,
        name: &'a str,
        bytes_done: u64,
    },
}

/// Where the arrays' values come from (a checkpoint, a GGUF file), asked for in array
/// order; matrices are read as f32 and quantized here, or copied as stored.
pub trait Arrays {
    /// The values of F32 array `i`, appended to `buf` and checked finite.
    fn floats(&self, i: usize, buf: &mut Vec<f32>) -> Result<()>;

    /// Rows `rows` of matrix `i` (`cols` columns of `wtype`) as stored, when its blocks
    /// are copied rather than quantized (`Ok(None)`: quantized); an error names a block
    /// the format cannot hold.
    fn copied(
        &self,
        _i: usize,
        _wtype: WType,
        _cols: usize,
        _rows: Range<usize>,
    ) -> Result<Option<Quantized>> {
        Ok(None)
    }

    /// Rows `rows` of matrix `i` as f32, appended to `buf`.
    fn read(&self, i: usize, rows: Range<usize>, buf: &mut Vec<f32>);

    /// The importance of matrix `i`'s input channels for its rows from `row` (from the
    /// imatrix), if any, and how many rows from `row` share it (`usize::MAX`: all; a
    /// stacked expert matrix: to the end of the row's expert).
    fn importance(&self, i: usize, row: usize) -> (Option<&[f32]>, usize);

    /// Error feedback for matrix `i`'s rows from `row` (from the imatrix's covariance
    /// of their input), if any, and how many rows from `row` share it (as
    /// [`Arrays::importance`]): built once per input and shared by the matrices that
    /// read it, a few in memory at a time (`CovFile::feedback`).
    fn feedback(&self, _i: usize, _row: usize) -> (Option<Arc<Feedback>>, usize) {
        (None, usize::MAX)
    }

    /// The quantizer refused rows from `r0` of matrix `i`.
    fn quant_error(&self, i: usize, r0: usize, e: QuantError) -> ConvertError;

    /// Rows `rows` of matrix `i` are written.
    fn written(&self, _i: usize, _rows: Range<usize>) {}

    /// Matrix `i` is written.
    fn done(&self, _i: usize) {}

    /// The writer refused rows of matrix `i` (`out`: the file being written).
    fn refused(&self, _i: usize, out: &Path, e: WriteError) -> ConvertError {
        ConvertError::write(out, out, e)
    }
}

/// The file to write: its name and header.
pub struct Target<'a> {
    pub out: &'a Path,
    pub header: &'a Header,
    /// The layer flag bytes (empty without layer flags).
    pub flags: &'a [u8],
    /// Every matrix's type, for a mixed file.
    pub mixed_types: Option<&'a [WType]>,
    /// Set by a signal handler: stop between row chunks.
    pub cancel: Option<&'a AtomicBool>,
    /// The Q4_0 rounding of quantized matrices.
    pub q4_rule: Q4Rule,
}

/// Refuses an output that is no file name (a folder, `..`).
pub fn check_output_name(out: &Path) -> Result<()> {
    if out.file_name().is_none() || out.is_dir() {
        return Err(ConvertError::options(
            "-o",
            format!("{} is not a file name", out.display()),
        ));
    }
    Ok(())
}

/// Writes `layout`'s arrays from `arrays` to `target` (a temporary file beside it,
/// renamed on success); returns the file's size.
pub fn write_file(
    target: &Target,
    layout: &Layout,
    arrays: &impl Arrays,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<u64> {
    let out = target.out;
    let mut file = AtomicFile::create(out).map_err(|e| ConvertError::io(out, e))?;
    // On an error `file` is dropped uncommitted: the target stays as it was.
    write_arrays(target, layout, arrays, &mut file, progress)?;
    file.commit().map_err(|e| ConvertError::io(out, e))?;
    Ok(std::fs::metadata(out)
        .ok()
        .filter(|m| m.is_file()) // a device given as the output has no length
        .map_or(layout.end, |m| m.len()))
}

fn write_arrays(
    target: &Target,
    layout: &Layout,
    arrays: &impl Arrays,
    file: &mut AtomicFile,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<()> {
    let (out, cancel) = (target.out, target.cancel);
    let werr = |e| ConvertError::write(out, out, e);
    let sink = BufWriter::with_capacity(1 << 20, file);
    let mut w = new_writer(sink, target.header, target.flags, target.mixed_types).map_err(werr)?;
    let mut buf: Vec<f32> = Vec::new();
    for (i, t) in layout.tensors.iter().enumerate() {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(ConvertError::Interrupted);
        }
        match t.kind {
            Kind::F32 { .. } => {
                buf.clear();
                arrays.floats(i, &mut buf)?;
                w.write_f32(&buf).map_err(werr)?;
            }
            Kind::Mat {
                wtype, rows, cols, ..
            } => {
                for_row_chunks(rows, cols, cancel, |r| {
                    if let Some(m) = arrays.copied(i, wtype, cols, r.clone())? {
                        w.write_mat_rows(&m)
                            .map_err(|e| arrays.refused(i, out, e))?;
                        arrays.written(i, r);
                        return Ok(());
                    }
                    buf.clear();
                    arrays.read(i, r.clone(), &mut buf);
                    // Rows sharing one importance and one feedback at a time
                    // (quantization is per row: the cut changes no byte).
                    let mut at = r.start;
                    while at < r.end {
                        let (imatrix, span) = arrays.importance(i, at);
                        let (fb, fb_span) = match wtype.is_half() {
                            true => (None, usize::MAX),
                            false => arrays.feedback(i, at),
                        };
                        let end = r.end.min(at.saturating_add(span.min(fb_span)));
                        let qopts = QuantOptions {
                            scale_f16: target.header.scale_f16 != 0,
                            q4_rule: target.q4_rule,
                            imatrix,
                        };
                        let x = &buf[(at - r.start) * cols..(end - r.start) * cols];
                        let m = feedback::quantize(wtype, end - at, cols, x, &qopts, fb.as_deref())
                            .map_err(|e| arrays.quant_error(i, at, e))?;
                        w.write_mat_rows(&m)
                            .map_err(|e| arrays.refused(i, out, e))?;
                        at = end;
                    }
                    arrays.written(i, r);
                    Ok(())
                })?;
                arrays.done(i);
            }
            // Layer flags: the writer writes them.
            Kind::U8 { .. } => {}
        }
        progress(Progress::Tensor {
            index: i,
            name: &t.name.to_string(),
            bytes_done: t.end(),
        });
    }
    w.finish()
        .map_err(werr)?
        .into_inner()
        .map_err(|e| ConvertError::io(out, e.into_error()))?;
    Ok(())
}

/// Refuses a tensor with a weight that is NaN or infinite, naming the first.
pub fn check_finite(buf: &[f32], file: &Path, tensor: &str) -> Result<()> {
    match buf.iter().position(|x| !x.is_finite()) {
        Some(j) => Err(ConvertError::tensor(
            file,
            tensor,
            format!("element {j} is {}: weights must be finite", buf[j]),
        )),
        None => Ok(()),
    }
}

/// Tells `progress` the size of the file to write and the notes gathered planning it.
pub fn announce(progress: &mut (dyn FnMut(Progress) + Send), layout: &Layout, notes: &[String]) {
    progress(Progress::Start {
        tensors: layout.tensors.len(),
        bytes: layout.end,
    });
    for n in notes {
        progress(Progress::Note(n));
    }
}

/// A writer for a uniform header, or a mixed one with its matrix types.
pub fn new_writer<W: std::io::Write>(
    out: W,
    header: &Header,
    flags: &[u8],
    mixed_types: Option<&[WType]>,
) -> std::result::Result<MlbWriter<W>, WriteError> {
    match mixed_types {
        Some(t) => MlbWriter::new_mixed(out, header, flags, t),
        None => MlbWriter::new(out, header, flags),
    }
}

/// Rows per chunk of a large matrix: ~4M values (16 MB as f32).
pub const CHUNK_VALUES: usize = 1 << 22;

/// Runs `f` on a `rows × cols` matrix's consecutive row ranges of about
/// [`CHUNK_VALUES`] values, stopping with `Interrupted` between chunks on a signal.
pub fn for_row_chunks(
    rows: usize,
    cols: usize,
    cancel: Option<&AtomicBool>,
    mut f: impl FnMut(std::ops::Range<usize>) -> Result<()>,
) -> Result<()> {
    let step = (CHUNK_VALUES / cols).max(1);
    let mut r0 = 0;
    while r0 < rows {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(ConvertError::Interrupted);
        }
        let r1 = (r0 + step).min(rows);
        f(r0..r1)?;
        r0 = r1;
    }
    Ok(())
}
