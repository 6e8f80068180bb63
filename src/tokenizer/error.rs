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
        // Cut on a character: a JSON string keeps its non-ASCII text as UTF-8.
        let mut end = MAX_QUOTED;
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        v.truncate(end);
        v.push_str("...");
    }
    FormatError::format(field, v, rule)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_value_is_cut_on_a_character() {
        let e = refuse("normalizer.content", &Value::from("é".repeat(400)), "rule");
        assert!(e.value.ends_with("é..."), "{}", e.value);
        assert!(e.value.len() <= MAX_QUOTED + 3);
        let e = refuse("x", &Value::from("a".repeat(400)), "rule");
        assert_eq!(e.value.len(), MAX_QUOTED + 3);
    }
}
