//! Byte-level pre-tokenization: the regex split of the Llama 3 family (and its
//! single-digit and letter-mark variants) or of GPT-2, optionally preceded by the
//! Digits(individual_digits) split. Pieces are emitted in order and cover the whole
//! input, as the tokenizers library's `Split(Isolated)` does (gaps between matches are
//! pieces too).

use crate::format::mlt::{
    FLAG_DIGITS_SPLIT, FLAG_GPT2_REGEX, FLAG_LETTER_MARKS, FLAG_SINGLE_DIGITS,
};
use fancy_regex::Regex;

/// The GPT-2 pattern of the ByteLevel pre-tokenizer with `use_regex: true`.
pub const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The Llama 3-family pattern selected by the flags 16 (single digits) and 256
/// (letter runs take marks), exactly as the tokenizer.json files spell it.
pub fn llama3_pattern(single_digits: bool, letter_marks: bool) -> String {
    let (letters, punct) = if letter_marks {
        (r"[\p{L}\p{M}]+", r"[^\s\p{L}\p{M}\p{N}]+")
    } else {
        (r"\p{L}+", r"[^\s\p{L}\p{N}]+")
    };
    let digits = if single_digits {
        r"\p{N}"
    } else {
        r"\p{N}{1,3}"
    };
    format!(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?{letters}|{digits}| ?{punct}[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
}

/// The regex pattern a byte-level file's flags select.
pub fn pattern_for_flags(flags: u32) -> String {
    if flags & FLAG_GPT2_REGEX != 0 {
        GPT2_PATTERN.to_string()
    } else {
        llama3_pattern(
            flags & FLAG_SINGLE_DIGITS != 0,
            flags & FLAG_LETTER_MARKS != 0,
        )
    }
}

/// A compiled byte-level pre-tokenizer.
pub struct PreTokenizer {
    re: Regex,
    digits_split: bool,
}

impl PreTokenizer {
    pub fn new(flags: u32) -> PreTokenizer {
        // The patterns are fixed and known to compile.
        let re = Regex::new(&pattern_for_flags(flags)).expect("built-in pattern compiles");
        PreTokenizer {
            re,
            digits_split: flags & FLAG_DIGITS_SPLIT != 0,
        }
    }

    /// Calls `f` on each pre-token of `text`, in order.
    pub fn split<'t>(&self, text: &'t str, f: &mut impl FnMut(&'t str)) {
        if !self.digits_split {
            return self.regex_split(text, f);
        }
        // Digits(individual_digits): every numeric char is its own piece.
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                if start < i {
                    self.regex_split(&text[start..i], f);
                }
                let end = i + c.len_utf8();
                self.regex_split(&text[i..end], f);
                start = end;
            }
        }
        if start < text.len() {
            self.regex_split(&text[start..], f);
        }
    }

    fn regex_split<'t>(&self, text: &'t str, f: &mut impl FnMut(&'t str)) {
        let mut last = 0;
        for m in self.re.find_iter(text) {
            let Ok(m) = m else {
                // Backtrack limit: cannot happen on these linear patterns; keep the
                // rest whole rather than lose text.
                break;
            };
            if m.start() > last {
                f(&text[last..m.start()]);
            }
            if m.end() > m.start() {
                f(m.as_str());
            }
            last = m.end();
        }
        if last < text.len() {
            f(&text[last..]);
        }
    }
}
