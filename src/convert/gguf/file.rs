//! Opening a GGUF file: recognized by its magic, mapped read-only, parsed with the
//! file named in errors.

use std::fs::File;
use std::path::Path;

use crate::convert::error::{ConvertError, Result};
use crate::format::gguf::{self, GgufView};

/// Whether `path` is a GGUF file (by its magic).
pub fn is_gguf_file(path: &Path) -> bool {
    use std::io::Read;
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|_| gguf::is_gguf(&magic))
        .unwrap_or(false)
}

/// Maps a GGUF file read-only.
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let f = File::open(path).map_err(|e| ConvertError::io(path, e))?;
    // SAFETY: a read-only map of an input file that is not expected to change while it
    // is converted (the mmap caveat of every loader, docs/reliability.md).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ConvertError::io(path, e))
}

/// Parses a mapped GGUF file, naming the file in errors.
pub(crate) fn parse_file<'a>(path: &Path, bytes: &'a [u8]) -> Result<GgufView<'a>> {
    gguf::parse(bytes).map_err(|e| ConvertError::checkpoint(path, e.to_string()))
}
