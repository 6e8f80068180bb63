//! A bounds-checked little-endian reader over a file's bytes, shared by the MLT1 parser
//! and its chat section. Each caller words a truncation its own way (the chat section
//! counts the bytes left in the section, the file the bytes of the file), so the error
//! is passed in. Their writers share [`fit_u32`], the check on the way back.

use super::error::{FormatError, Result};

/// A count or length as the u32 the file stores.
pub(super) fn fit_u32(n: usize, field: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| FormatError::shape(field, n, "must fit in u32"))
}

/// The error for `field` needing `n` bytes at offset `pos` of a `len`-byte buffer.
pub(super) type Truncated = fn(field: &str, n: usize, pos: usize, len: usize) -> FormatError;

pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    truncated: Truncated,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8], truncated: Truncated) -> Self {
        Reader {
            buf,
            pos: 0,
            truncated,
        }
    }

    /// The offset of the next byte.
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        match self.pos.checked_add(n).filter(|&e| e <= self.buf.len()) {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err((self.truncated)(field, n, self.pos, self.buf.len())),
        }
    }

    pub(super) fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.take(1, field)?[0])
    }

    pub(super) fn u32(&mut self, field: &str) -> Result<u32> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A u32 count of at most `max` items of at least `min_each` bytes each, checked
    /// against the bytes left before the caller allocates for them.
    pub(super) fn count(&mut self, field: &str, max: usize, min_each: usize) -> Result<usize> {
        let n = self.u32(field)? as usize;
        if n > max {
            return Err(FormatError::format(field, n, format!("at most {max}")));
        }
        let left = self.remaining();
        if n.saturating_mul(min_each) > left {
            return Err(FormatError::format(
                field,
                n,
                format!("needs at least {} bytes, {left} left", n * min_each),
            ));
        }
        Ok(n)
    }

    /// A length-prefixed (u32) UTF-8 string of at most `max` bytes.
    pub(super) fn text(&mut self, field: &str, max: usize) -> Result<&'a str> {
        let len = self.u32(field)? as usize;
        if len > max {
            return Err(FormatError::format(
                field,
                format!("length {len}"),
                format!("at most {max} bytes"),
            ));
        }
        let b = self.take(len, field)?;
        std::str::from_utf8(b).map_err(|e| {
            FormatError::format(field, format!("bytes at {}", e.valid_up_to()), "not UTF-8")
        })
    }
}
