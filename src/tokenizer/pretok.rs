//! Byte-level pre-tokenization: the regex split of the Llama 3 family (and its
//! single-digit and letter-mark variants) or of GPT-2, optionally preceded by the
//! Digits(individual_digits) split. Pieces are emitted in order and cover the whole
//! input, as the tokenizers library's `Split(Isolated)` does (gaps between matches are
//! pieces too).
//!
//! [`PreTokenizer`] is a hand-written matcher of exactly these patterns (leftmost-first
//! alternation with the regex engine's backtracking worked out per alternative), over
//! the Unicode classes of `regex-syntax`; [`RegexPreTokenizer`] runs the same patterns
//! through fancy-regex and is kept as the reference the matcher is tested against.
//!
//! Long runs: a piece that is one character repeated (8 MiB of spaces is one piece)
//! would cost the BPE heap O(n log n) with a large constant (about 1 s per MiB).
//! [`PreTokenizer::encode_long_run`] encodes a run of `n` ≥ [`RUN_MIN`] copies of `c` in
//! linear time: BPE on a long run of one character merges it, left to right, into a
//! body of one repeated token `T = c^L` (the longest the merges build; nothing merges
//! with it) and a tail set by `n` modulo `L`, so `bpe(c^(m+L)) = [T] + bpe(c^m)` once
//! `m` is past the start-up length [`RUN_BASE`]. For each character that period is
//! found and then checked over a whole period of lengths against the slow path at first
//! use; a character that does not check out keeps the slow path.

use crate::format::mlt::{
    FLAG_DIGITS_SPLIT, FLAG_GPT2_REGEX, FLAG_LETTER_MARKS, FLAG_SINGLE_DIGITS,
};
use fancy_regex::Regex;
use std::collections::HashMap;
use std::sync::Mutex;

/// Runs of one character at least this long take the linear path.
pub const RUN_MIN: usize = 4096;
/// The run length from which the period is checked (the body is established by then).
pub const RUN_BASE: usize = 512;
/// The longest body token looked for, in characters.
const RUN_MAX_UNIT: usize = 256;

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

/// The reference pre-tokenizer: the patterns run by fancy-regex.
pub struct RegexPreTokenizer {
    re: Regex,
    digits_split: bool,
}

/// Digits(individual_digits): every numeric char is its own piece; `g` splits the rest.
fn digits_split<'t>(
    text: &'t str,
    f: &mut impl FnMut(&'t str),
    g: impl Fn(&'t str, &mut dyn FnMut(&'t str)),
) {
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            if start < i {
                g(&text[start..i], f);
            }
            let end = i + c.len_utf8();
            g(&text[i..end], f);
            start = end;
        }
    }
    if start < text.len() {
        g(&text[start..], f);
    }
}

impl RegexPreTokenizer {
    pub fn new(flags: u32) -> RegexPreTokenizer {
        // The patterns are fixed and known to compile.
        let re = Regex::new(&pattern_for_flags(flags)).expect("built-in pattern compiles");
        RegexPreTokenizer {
            re,
            digits_split: flags & FLAG_DIGITS_SPLIT != 0,
        }
    }

    /// Calls `f` on each pre-token of `text`, in order.
    pub fn split<'t>(&self, text: &'t str, f: &mut impl FnMut(&'t str)) {
        if self.digits_split {
            digits_split(text, f, |t, f| self.regex_split(t, &mut |p| f(p)));
        } else {
            self.regex_split(text, f);
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

const L: u8 = 1;
const N: u8 = 2;
const M: u8 = 4;
/// `\s`: White_Space.
const S: u8 = 8;

/// Unicode class bits per code point: a table for the BMP, ranges above it.
struct Classes {
    bmp: Vec<u8>,
    astral: Vec<(u32, u32, u8)>,
}

fn class_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("built-in class parses");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        _ => unreachable!("a Unicode class"),
    }
}

fn classes() -> &'static Classes {
    static C: std::sync::OnceLock<Classes> = std::sync::OnceLock::new();
    C.get_or_init(|| {
        let mut bmp = vec![0u8; 0x10000];
        let mut astral: Vec<(u32, u32, u8)> = Vec::new();
        for (pat, bit) in [(r"\p{L}", L), (r"\p{N}", N), (r"\p{M}", M), (r"\s", S)] {
            for (a, b) in class_ranges(pat) {
                for c in a..=b.min(0xffff) {
                    bmp[c as usize] |= bit;
                }
                if b > 0xffff {
                    astral.push((a.max(0x10000), b, bit));
                }
            }
        }
        // The classes are disjoint, so sorted ranges never overlap.
        astral.sort_unstable();
        Classes { bmp, astral }
    })
}

impl Classes {
    #[inline]
    fn of(&self, c: char) -> u8 {
        let c = c as u32;
        if c < 0x10000 {
            return self.bmp[c as usize];
        }
        match self.astral.binary_search_by(|&(a, b, _)| {
            if b < c {
                std::cmp::Ordering::Less
            } else if a > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        }) {
            Ok(i) => self.astral[i].2,
            Err(_) => 0,
        }
    }
}

/// Which pattern the matcher follows.
#[derive(Clone, Copy)]
enum Pattern {
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?LETTERS|DIGITS| ?PUNCT[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3 { single_digits: bool, marks: bool },
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
}

/// The hand-written byte-level pre-tokenizer (see the module docs).
pub struct PreTokenizer {
    pattern: Pattern,
    digits_split: bool,
    cls: &'static Classes,
    /// Per character: the body token of its long runs and its length in characters
    /// (`None`: the period did not check out, the slow path stays).
    runs: Mutex<HashMap<char, Option<(u32, usize)>>>,
}

/// Characters of a text with their classes, decoded on demand.
struct Cursor<'t> {
    s: &'t str,
    cls: &'static Classes,
}

impl Cursor<'_> {
    /// The char at byte `i` (None at the end), its class and its length.
    #[inline]
    fn at(&self, i: usize) -> Option<(char, u8, usize)> {
        let b = *self.s.as_bytes().get(i)?;
        if b < 0x80 {
            return Some((b as char, self.cls.bmp[b as usize], 1));
        }
        let c = self.s[i..].chars().next()?;
        Some((c, self.cls.of(c), c.len_utf8()))
    }

    /// The end of the run of chars from `i` whose class satisfies `ok`.
    #[inline]
    fn run(&self, mut i: usize, ok: impl Fn(char, u8) -> bool) -> usize {
        while let Some((c, k, n)) = self.at(i) {
            if !ok(c, k) {
                break;
            }
            i += n;
        }
        i
    }

    /// At most `max` chars of class N from `i`.
    fn digits(&self, mut i: usize, max: usize) -> usize {
        for _ in 0..max {
            match self.at(i) {
                Some((_, k, n)) if k & N != 0 => i += n,
                _ => break,
            }
        }
        i
    }
}

/// The case-insensitive contraction at `i` (just after `'`), as the Llama 3 regex's
/// `(?i:...)` sees it: `ſ` folds to `s`.
fn contraction_len(cur: &Cursor, i: usize, fold: bool) -> Option<usize> {
    let lower = |c: char| {
        if !fold {
            c
        } else if c == '\u{17f}' {
            's'
        } else {
            c.to_ascii_lowercase()
        }
    };
    let (c1, _, n1) = cur.at(i)?;
    match lower(c1) {
        's' | 't' | 'm' | 'd' => Some(n1),
        'r' | 'v' | 'l' => {
            let want = match lower(c1) {
                'r' | 'v' => 'e',
                _ => 'l',
            };
            let (c2, _, n2) = cur.at(i + n1)?;
            (lower(c2) == want).then_some(n1 + n2)
        }
        _ => None,
    }
}

impl PreTokenizer {
    pub fn new(flags: u32) -> PreTokenizer {
        let pattern = if flags & FLAG_GPT2_REGEX != 0 {
            Pattern::Gpt2
        } else {
            Pattern::Llama3 {
                single_digits: flags & FLAG_SINGLE_DIGITS != 0,
                marks: flags & FLAG_LETTER_MARKS != 0,
            }
        };
        PreTokenizer {
            pattern,
            digits_split: flags & FLAG_DIGITS_SPLIT != 0,
            cls: classes(),
            runs: Mutex::new(HashMap::new()),
        }
    }

    /// The ids of `piece` if it is one character repeated at least [`RUN_MIN`] times,
    /// appended to `out` in linear time (see the module docs); `false` (nothing
    /// appended) otherwise. `encode` appends the ids of a piece the slow way.
    pub fn encode_long_run(
        &self,
        piece: &str,
        encode: &mut dyn FnMut(&str, &mut Vec<u32>),
        out: &mut Vec<u32>,
    ) -> bool {
        let Some(c) = piece.chars().next() else {
            return false;
        };
        let w = c.len_utf8();
        if piece.len() < RUN_MIN * w || !piece.chars().all(|x| x == c) {
            return false;
        }
        let shape = {
            let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
            *runs.entry(c).or_insert_with(|| run_period(c, encode))
        };
        let Some((body, unit)) = shape else {
            return false;
        };
        let n = piece.len() / w;
        let k = (n - RUN_BASE) / unit;
        out.extend(std::iter::repeat_n(body, k));
        encode(&piece[k * unit * w..], out);
        true
    }

    /// Calls `f` on each pre-token of `text`, in order.
    pub fn split<'t>(&self, text: &'t str, f: &mut impl FnMut(&'t str)) {
        if self.digits_split {
            digits_split(text, f, |t, f| self.split_one(t, f));
        } else {
            self.split_one(text, f);
        }
    }

    fn split_one<'t>(&self, text: &'t str, f: &mut dyn FnMut(&'t str)) {
        let cur = Cursor {
            s: text,
            cls: self.cls,
        };
        let mut i = 0;
        let mut gap = 0;
        while i < text.len() {
            match self.match_at(&cur, i) {
                Some(end) => {
                    if gap < i {
                        f(&text[gap..i]);
                    }
                    f(&text[i..end]);
                    i = end;
                    gap = end;
                }
                None => i += cur.at(i).map_or(1, |x| x.2),
            }
        }
        if gap < text.len() {
            f(&text[gap..]);
        }
    }

    /// The end of the match starting at `i`, if the pattern matches there.
    #[inline]
    fn match_at(&self, cur: &Cursor, i: usize) -> Option<usize> {
        let (c0, k0, n0) = cur.at(i)?;
        let next = cur.at(i + n0);
        // `punct` holds the classes a punctuation char must not have.
        let (letters, punct, prefix_ok, gpt2) = match self.pattern {
            Pattern::Llama3 { marks, .. } => {
                let letters = if marks { L | M } else { L };
                (
                    letters,
                    S | letters | N,
                    (c0 != '\r' && c0 != '\n' && k0 & (L | N) == 0),
                    false,
                )
            }
            Pattern::Gpt2 => (L, S | L | N, c0 == ' ', true),
        };
        // 's 't 're 've 'm 'll 'd
        if c0 == '\'' {
            if let Some(n) = contraction_len(cur, i + 1, !gpt2) {
                return Some(i + 1 + n);
            }
        }
        // [^\r\n\p{L}\p{N}]?LETTERS+ (GPT-2: " ?\p{L}+")
        if let Some((_, k1, _)) = next {
            if prefix_ok && k1 & letters != 0 {
                return Some(cur.run(i + n0, |_, k| k & letters != 0));
            }
        }
        if k0 & letters != 0 {
            return Some(cur.run(i, |_, k| k & letters != 0));
        }
        if gpt2 {
            // " ?\p{N}+"
            if c0 == ' ' && matches!(next, Some((_, k1, _)) if k1 & N != 0) {
                return Some(cur.run(i + 1, |_, k| k & N != 0));
            }
            if k0 & N != 0 {
                return Some(cur.run(i, |_, k| k & N != 0));
            }
        } else if k0 & N != 0 {
            let single = matches!(
                self.pattern,
                Pattern::Llama3 {
                    single_digits: true,
                    ..
                }
            );
            return Some(cur.digits(i, if single { 1 } else { 3 }));
        }
        // " ?PUNCT+" (Llama 3: then "[\r\n]*")
        let p_start = if c0 == ' ' && matches!(next, Some((_, k1, _)) if k1 & punct == 0) {
            Some(i + 1)
        } else if k0 & punct == 0 {
            Some(i)
        } else {
            None
        };
        if let Some(p) = p_start {
            let e = cur.run(p, |_, k| k & punct == 0);
            return Some(if gpt2 {
                e
            } else {
                cur.run(e, |c, _| c == '\r' || c == '\n')
            });
        }
        if k0 & S == 0 {
            return None;
        }
        // The whitespace run from i, and where its last \r or \n ends.
        let mut j = i;
        let mut last_nl = None;
        let mut last_start = i;
        while let Some((c, k, n)) = cur.at(j) {
            if k & S == 0 {
                break;
            }
            if c == '\r' || c == '\n' {
                last_nl = Some(j + n);
            }
            last_start = j;
            j += n;
        }
        // \s*[\r\n]+ : up to the last newline of the run.
        if !gpt2 {
            if let Some(e) = last_nl {
                return Some(e);
            }
        }
        // \s+(?!\S) : the whole run at the end of text, else all but its last char;
        // \s+ : a single whitespace char before a non-space.
        if j >= cur.s.len() || last_start == i {
            Some(j)
        } else {
            Some(last_start)
        }
    }
}

/// The body token of long runs of `c` and its length `L` in characters, if
/// `bpe(c^(m+L)) = [T] + bpe(c^m)` holds for every `m` of a whole period from
/// [`RUN_BASE`] (each checked against `encode`, the slow path).
fn run_period(c: char, encode: &mut dyn FnMut(&str, &mut Vec<u32>)) -> Option<(u32, usize)> {
    let mut ids = |m: usize| {
        let mut v = Vec::new();
        encode(&c.to_string().repeat(m), &mut v);
        v
    };
    let body = *ids(RUN_BASE).first()?;
    let unit = (1..=RUN_MAX_UNIT).find(|&m| ids(m) == [body])?;
    let base: Vec<Vec<u32>> = (0..unit).map(|j| ids(RUN_BASE + j)).collect();
    for (j, b) in base.iter().enumerate() {
        let longer = ids(RUN_BASE + unit + j);
        if longer.first() != Some(&body) || longer[1..] != b[..] {
            return None;
        }
    }
    Some((body, unit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mlt::FLAG_NFC;

    fn pieces_fast(p: &PreTokenizer, s: &str) -> Vec<String> {
        let mut v = Vec::new();
        p.split(s, &mut |p| v.push(p.to_string()));
        v
    }
    fn pieces_ref(p: &RegexPreTokenizer, s: &str) -> Vec<String> {
        let mut v = Vec::new();
        p.split(s, &mut |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn variants_split_differently() {
        let text = "नमस्ते 12345 a\u{301}!";
        let p = |f| pieces_fast(&PreTokenizer::new(f), text);
        // A lone mark is a valid prefix of the next letter run, or punctuation.
        assert_eq!(
            p(0),
            [
                "नमस",
                "\u{94d}त",
                "\u{947}",
                " ",
                "123",
                "45",
                " a",
                "\u{301}!"
            ]
        );
        // Both single-digit variants end alike: the space, one piece a digit, the rest.
        let single_digits = [" ", "1", "2", "3", "4", "5", " a", "\u{301}!"];
        let singles = [&["नमस", "\u{94d}त", "\u{947}"][..], &single_digits].concat();
        assert_eq!(p(FLAG_SINGLE_DIGITS), singles);
        assert_eq!(
            p(FLAG_LETTER_MARKS),
            ["नमस्ते", " ", "123", "45", " a\u{301}", "!"]
        );
        assert_eq!(
            p(FLAG_GPT2_REGEX),
            ["नमस", "\u{94d}", "त", "\u{947}", " 12345", " a", "\u{301}!"]
        );
        let digits = [&["नमस", "\u{94d}", "त", "\u{947}"][..], &single_digits].concat();
        assert_eq!(p(FLAG_GPT2_REGEX | FLAG_DIGITS_SPLIT), digits);
    }

    #[test]
    fn matcher_equals_regex() {
        const A: &[&str] = &[
            "a",
            "Z",
            "é",
            "\u{301}",
            "\u{93F}",
            "क",
            "中",
            "0",
            "9",
            "²",
            "½",
            "٣",
            "Ⅻ",
            " ",
            " ",
            "  ",
            "\n",
            "\r",
            "\t",
            "\u{A0}",
            "\u{3000}",
            "\u{2028}",
            "\u{85}",
            "\u{200B}",
            "\u{B}",
            "\u{C}",
            "'",
            "s",
            "S",
            "ſ",
            "t",
            "r",
            "E",
            "v",
            "l",
            "L",
            "m",
            "d",
            "D",
            "!",
            ".",
            "_",
            "😀",
            "\u{1F3FD}",
            "\u{200D}",
            "\u{E0041}",
            "\u{10FFFF}",
            "\u{0}",
            "𝟘",
            "𐌰",
        ];
        let mut seed = 88172645463325252u64;
        for flags in [
            0,
            FLAG_SINGLE_DIGITS,
            FLAG_LETTER_MARKS,
            FLAG_SINGLE_DIGITS | FLAG_LETTER_MARKS | FLAG_NFC,
            FLAG_GPT2_REGEX,
            FLAG_GPT2_REGEX | FLAG_DIGITS_SPLIT,
        ] {
            let (fast, reference) = (PreTokenizer::new(flags), RegexPreTokenizer::new(flags));
            for _ in 0..4000 {
                let mut s = String::new();
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let len = seed % 16;
                for _ in 0..len {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    s.push_str(A[(seed % A.len() as u64) as usize]);
                }
                assert_eq!(
                    pieces_fast(&fast, &s),
                    pieces_ref(&reference, &s),
                    "flags {flags:#x} on {s:?}"
                );
            }
        }
    }
}
