//! Writing the arrays: row chunks of a bounded size, a finiteness check, the writer
//! of a uniform or mixed file.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::convert::error::{ConvertError, Result};
use crate::convert::summary::Progress;
use crate::format::mlb::header::Header;
use crate::format::mlb::{Layout, MlbWriter, WriteError};
use crate::format::WType;

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
const CHUNK_VALUES: usize = 1 << 22;

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
