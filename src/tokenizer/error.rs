//! The tokenizer's errors. A tokenizer is a file (the `.mlt`, or tokenizer.json on the
//! way in), so its errors are the format's [`FormatError`]: the spec's status
//! (ML_E_FORMAT, ML_E_SHAPE), the field, the value, the rule, and the file once the
//! caller knows it. The helpers here make the tokenizer's own.

pub use crate::format::{FormatError, Result};
use serde_json::Value;

/// Most bytes of a tokenizer.json value quoted in an error.
const MAX_QUOTED: usize = 300;

/// A tokenizer.json setting that MLT1 does not reproduce exactly: its key (`field`),
/// its value (cut to [`MAX_QUOTED`] bytes) and the rule it breaks.
pub(super) fn refuse(field: &str, value: &Value, rule: &str) -> FormatError {
    let mut v = value.to_string();
    if v.len() > MAX_QUOTED {
        v.truncate(MAX_QUOTED);
        v.push_str("...");
    }
    FormatError::format(field, v, rule)
}
