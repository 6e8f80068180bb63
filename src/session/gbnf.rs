//! GBNF, llama.cpp's grammar format (its `grammars/README.md`), translated to the Lark
//! syntax llguidance compiles, so that mlb-serve's `grammar` field takes what
//! llama-server's takes.
//!
//! ```text
//! root  ::= item ("," ws item)*      # comments run to the end of the line
//! item  ::= "\"" [^"\\]* "\"" | [0-9]+ | .
//! ws    ::= [ \t\n]{0,4}
//! ```
//!
//! becomes one Lark rule per line: `root` is `start`, every other name `g_NAME` (an
//! upper-case letter `X` of a name as `_x`: GBNF names have no `_`, so names stay
//! apart); strings are JSON strings; a character class `[...]` is a one-character regex
//! with every character written `\x{HEX}`; `.` is `/(?s:.)/`; groups, `|`, `*`, `+`,
//! `?` and `{m}`, `{m,}`, `{m,n}`, `{,n}` keep their meaning; an empty alternative
//! (`a ::= | "x"`) makes its group optional; `<token>` and `<[id]>` token references are
//! kept as they are (the same syntax in both). Rules stay rules (no rule is turned into
//! a greedy terminal), so every GBNF grammar keeps its language.
//!
//! Errors name the line and column of the GBNF text.

use std::collections::HashSet;
use std::fmt;
use std::fmt::Write as _;

/// Why a GBNF text does not translate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GbnfError {
    /// 1-based line and column (0: the text as a whole).
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for GbnfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "GBNF: {}", self.message)
        } else {
            write!(
                f,
                "GBNF line {}, column {}: {}",
                self.line, self.col, self.message
            )
        }
    }
}

impl std::error::Error for GbnfError {}

/// Whether `text` reads as GBNF rather than Lark: some line defines a rule with `::=`
/// (Lark writes `name:`), and it does not start with `%llguidance` (llama.cpp's marker
/// for an llguidance grammar).
pub fn looks_like_gbnf(text: &str) -> bool {
    if text.trim_start().starts_with("%llguidance") {
        return false;
    }
    text.lines().any(|l| {
        let l = l.trim_start();
        let name = l
            .find(|c: char| !is_name_char(c))
            .map_or(l, |end| &l[..end]);
        !name.is_empty() && l[name.len()..].trim_start().starts_with("::=")
    })
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Def,
    Str(String),
    /// A character class: negated, and its inclusive ranges.
    Class(bool, Vec<(char, char)>),
    Any,
    Open,
    Close,
    Bar,
    /// `*`, `+`, `?`, or `{m,n}` as Lark writes it.
    Repeat(String),
    /// `<...>`: a token reference, kept as written.
    Token(String),
}

/// A token and where it starts.
type Spanned = (Tok, usize, usize);

struct Lexer<'a> {
    chars: std::iter::Peekable<std::str::Chars<'a>>,
    line: usize,
    col: usize,
}

impl Lexer<'_> {
    fn err<T>(&self, message: impl Into<String>) -> Result<T, GbnfError> {
        Err(GbnfError {
            line: self.line,
            col: self.col,
            message: message.into(),
        })
    }

    fn next(&mut self) -> Option<char> {
        let c = self.chars.next()?;
        if c == '\n' {
            self.line += 1;
            self.col = 1;
        } else {
            self.col += 1;
        }
        Some(c)
    }

    fn hex(&mut self, digits: usize) -> Result<char, GbnfError> {
        let mut v = 0u32;
        for _ in 0..digits {
            match self.next().and_then(|c| c.to_digit(16)) {
                Some(d) => v = v * 16 + d,
                None => return self.err(format!("expected {digits} hex digits in an escape")),
            }
        }
        match char::from_u32(v) {
            Some(c) => Ok(c),
            None => self.err(format!("\\u{{{v:x}}} is not a Unicode scalar value")),
        }
    }

    /// One character of a string or class (after a backslash: its escape).
    fn char(&mut self, end: char) -> Result<char, GbnfError> {
        match self.next() {
            None => self.err(format!("unexpected end of the grammar, expected '{end}'")),
            Some('\\') => match self.next() {
                Some('x') => self.hex(2),
                Some('u') => self.hex(4),
                Some('U') => self.hex(8),
                Some('t') => Ok('\t'),
                Some('n') => Ok('\n'),
                Some('r') => Ok('\r'),
                Some(c @ ('\\' | '"' | '[' | ']' | '-' | '^' | '/')) => Ok(c),
                Some(c) => self.err(format!("unknown escape '\\{c}'")),
                None => self.err("unexpected end of the grammar in an escape"),
            },
            Some(c) => Ok(c),
        }
    }

    fn number(&mut self) -> Option<String> {
        let mut n = String::new();
        while let Some(&c) = self.chars.peek() {
            if !c.is_ascii_digit() {
                break;
            }
            n.push(c);
            self.next();
        }
        (!n.is_empty()).then_some(n)
    }

    fn skip_spaces(&mut self) {
        while self.chars.peek().is_some_and(|c| *c == ' ' || *c == '\t') {
            self.next();
        }
    }

    /// `{m}`, `{m,}`, `{m,n}`, `{,n}` after the `{`.
    fn repeat(&mut self) -> Result<String, GbnfError> {
        self.skip_spaces();
        let min = self.number();
        self.skip_spaces();
        let text = if self.chars.peek() == Some(&',') {
            self.next();
            self.skip_spaces();
            let max = self.number();
            self.skip_spaces();
            if let (Some(a), Some(b)) = (&min, &max) {
                if a.parse::<u64>().ok() > b.parse::<u64>().ok() {
                    return self.err(format!(
                        "repetition {{{a},{b}}}: the minimum exceeds the maximum"
                    ));
                }
            }
            format!(
                "{{{},{}}}",
                min.as_deref().unwrap_or("0"),
                max.unwrap_or_default()
            )
        } else {
            match min {
                Some(m) => format!("{{{m}}}"),
                None => return self.err("expected a number in a repetition {m,n}"),
            }
        };
        match self.next() {
            Some('}') => Ok(text),
            _ => self.err("expected '}' to close a repetition"),
        }
    }

    fn tokens(mut self) -> Result<Vec<Spanned>, GbnfError> {
        let mut out = Vec::new();
        while let Some(&c) = self.chars.peek() {
            let (line, col) = (self.line, self.col);
            let tok = match c {
                ' ' | '\t' | '\r' | '\n' => {
                    self.next();
                    continue;
                }
                '#' => {
                    while self.next().is_some_and(|c| c != '\n') {}
                    continue;
                }
                ':' => {
                    self.next();
                    if self.next() == Some(':') && self.next() == Some('=') {
                        Tok::Def
                    } else {
                        return self.err("expected '::='");
                    }
                }
                '"' => {
                    self.next();
                    let mut s = String::new();
                    while self.chars.peek() != Some(&'"') {
                        s.push(self.char('"')?);
                    }
                    self.next();
                    Tok::Str(s)
                }
                '[' => {
                    self.next();
                    let neg = self.chars.peek() == Some(&'^');
                    if neg {
                        self.next();
                    }
                    let mut items = Vec::new();
                    while self.chars.peek() != Some(&']') {
                        let lo = self.char(']')?;
                        let mut hi = lo;
                        let mut ahead = self.chars.clone();
                        if ahead.next() == Some('-') && ahead.next().is_some_and(|c| c != ']') {
                            self.next();
                            hi = self.char(']')?;
                            if hi < lo {
                                return self
                                    .err(format!("character range {lo:?}-{hi:?} runs backwards"));
                            }
                        }
                        items.push((lo, hi));
                    }
                    self.next();
                    Tok::Class(neg, items)
                }
                '<' => {
                    let mut s = String::new();
                    loop {
                        match self.next() {
                            Some('>') => break,
                            Some(c) if !c.is_whitespace() => s.push(c),
                            _ => return self.err("a token reference <...> is not closed"),
                        }
                    }
                    Tok::Token(format!("{s}>"))
                }
                '.' => {
                    self.next();
                    Tok::Any
                }
                '(' | ')' | '|' => {
                    self.next();
                    match c {
                        '(' => Tok::Open,
                        ')' => Tok::Close,
                        _ => Tok::Bar,
                    }
                }
                '*' | '+' | '?' => {
                    self.next();
                    Tok::Repeat(c.to_string())
                }
                '{' => {
                    self.next();
                    Tok::Repeat(self.repeat()?)
                }
                c if is_name_char(c) => {
                    let mut s = String::new();
                    while let Some(&c) = self.chars.peek().filter(|c| is_name_char(**c)) {
                        s.push(c);
                        self.next();
                    }
                    Tok::Name(s)
                }
                c => return self.err(format!("unexpected character {c:?}")),
            };
            out.push((tok, line, col));
        }
        Ok(out)
    }
}

/// The Lark name of a GBNF rule name.
fn lark_name(name: &str) -> String {
    if name == "root" {
        return "start".into();
    }
    let mut s = String::from("g_");
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            s.push('_');
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

/// A string as a Lark (JSON-syntax) string literal: quotes, backslashes and control
/// characters (DEL too, which Lark's lexer refuses raw) escaped.
fn lark_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\x7f' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A character class as a one-character Lark regex.
fn lark_class(neg: bool, items: &[(char, char)]) -> String {
    if items.is_empty() {
        // `[^]`: any character; `[]` is refused before this.
        return "/(?s:.)/".into();
    }
    let mut out = String::from("/[");
    if neg {
        out.push('^');
    }
    for &(lo, hi) in items {
        let _ = write!(out, "\\x{{{:x}}}", lo as u32);
        if hi != lo {
            let _ = write!(out, "-\\x{{{:x}}}", hi as u32);
        }
    }
    out.push_str("]/");
    out
}

/// Groups nested deeper than this are refused: the parser recurses per group (a
/// request's `((((...` must not overflow the stack), and llguidance's Lark parser
/// takes fewer still (30).
const MAX_NESTING: usize = 64;

/// Parses rule bodies into Lark text.
struct Parser<'a> {
    toks: &'a [Spanned],
    at: usize,
    defined: &'a HashSet<String>,
    /// Groups open around the current token.
    depth: usize,
}

impl Parser<'_> {
    fn err<T>(&self, message: impl Into<String>) -> Result<T, GbnfError> {
        let (line, col) = self
            .toks
            .get(self.at)
            .or(self.toks.last())
            .map_or((0, 0), |t| (t.1, t.2));
        Err(GbnfError {
            line,
            col,
            message: message.into(),
        })
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at).map(|t| &t.0)
    }

    /// Alternatives up to a `)` or the end; `None`: only empty alternatives.
    fn alternatives(&mut self) -> Result<Option<String>, GbnfError> {
        let mut alts = Vec::new();
        let mut empty = false;
        loop {
            let seq = self.sequence()?;
            if seq.is_empty() {
                empty = true;
            } else {
                alts.push(seq);
            }
            if self.peek() == Some(&Tok::Bar) {
                self.at += 1;
            } else {
                break;
            }
        }
        Ok(match (alts.len(), empty) {
            (0, _) => None,
            (1, false) => Some(alts.pop().expect("one")),
            (_, false) => Some(alts.join(" | ")),
            (_, true) => Some(format!("({})?", alts.join(" | "))),
        })
    }

    fn sequence(&mut self) -> Result<String, GbnfError> {
        // `None`: an item that matches only the empty text (`""`, `( | )`).
        let mut items: Vec<Option<String>> = Vec::new();
        while let Some(t) = self.peek() {
            let item = match t {
                Tok::Bar | Tok::Close => break,
                Tok::Name(n) => {
                    if !self.defined.contains(n) {
                        return self.err(format!("rule '{n}' is used but not defined"));
                    }
                    Some(lark_name(n))
                }
                Tok::Str(s) if s.is_empty() => None,
                Tok::Str(s) => Some(lark_string(s)),
                Tok::Class(false, items) if items.is_empty() => {
                    return self.err("an empty character class [] matches nothing")
                }
                Tok::Class(neg, items) => Some(lark_class(*neg, items)),
                Tok::Any => Some("/(?s:.)/".into()),
                Tok::Token(t) => Some(t.clone()),
                Tok::Open => {
                    if self.depth == MAX_NESTING {
                        return self.err(format!("groups nested deeper than {MAX_NESTING}"));
                    }
                    self.at += 1;
                    self.depth += 1;
                    let inner = self.alternatives()?;
                    self.depth -= 1;
                    if self.peek() != Some(&Tok::Close) {
                        return self.err("expected ')'");
                    }
                    inner.map(|i| format!("({i})"))
                }
                Tok::Repeat(op) => {
                    let Some(last) = items.pop() else {
                        return self.err(format!("'{op}' has nothing to repeat"));
                    };
                    // A repeated repetition needs its own group; the empty text
                    // repeated is the empty text.
                    last.map(|last| {
                        if last.ends_with(['*', '+', '?', '}']) {
                            format!("({last}){op}")
                        } else {
                            format!("{last}{op}")
                        }
                    })
                }
                Tok::Def => {
                    return self
                        .err("'::=' inside a rule (a rule name must start a line's definition)")
                }
            };
            self.at += 1;
            items.push(item);
        }
        Ok(items.into_iter().flatten().collect::<Vec<_>>().join(" "))
    }
}

/// Translates a GBNF grammar to llguidance's Lark (module docs).
pub fn to_lark(src: &str) -> Result<String, GbnfError> {
    let toks = Lexer {
        chars: src.chars().peekable(),
        line: 1,
        col: 1,
    }
    .tokens()?;
    // A rule starts at `NAME ::=` and runs to the next one.
    let starts: Vec<usize> = (0..toks.len())
        .filter(|&i| {
            matches!(toks[i].0, Tok::Name(_)) && toks.get(i + 1).is_some_and(|t| t.0 == Tok::Def)
        })
        .collect();
    match (starts.first(), toks.first()) {
        (_, None) => {
            return Err(GbnfError {
                line: 0,
                col: 0,
                message: "the grammar is empty".into(),
            })
        }
        (Some(0), _) => {}
        (_, Some(t)) => {
            return Err(GbnfError {
                line: t.1,
                col: t.2,
                message: "expected a rule definition (name ::= ...)".into(),
            })
        }
    }
    let mut defined = HashSet::new();
    for &i in &starts {
        let Tok::Name(n) = &toks[i].0 else {
            unreachable!("starts are names")
        };
        if !defined.insert(n.clone()) {
            return Err(GbnfError {
                line: toks[i].1,
                col: toks[i].2,
                message: format!("rule '{n}' is defined twice"),
            });
        }
    }
    if !defined.contains("root") {
        return Err(GbnfError {
            line: 0,
            col: 0,
            message: "the grammar has no 'root' rule (generation starts there)".into(),
        });
    }
    let mut out = String::new();
    for (k, &i) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(toks.len());
        let Tok::Name(name) = &toks[i].0 else {
            unreachable!("starts are names")
        };
        let body = &toks[i + 2..end];
        let mut p = Parser {
            toks: body,
            at: 0,
            defined: &defined,
            depth: 0,
        };
        let alts = p.alternatives()?;
        if p.at < body.len() {
            return p.err("unbalanced ')'");
        }
        let Some(alts) = alts else {
            return Err(GbnfError {
                line: toks[i].1,
                col: toks[i].2,
                message: format!("rule '{name}' is empty"),
            });
        };
        let _ = writeln!(out, "{}: {alts}", lark_name(name));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_repetitions() {
        let g = to_lark(
            "root ::= item (\",\" ws item)* # a list\nitem ::= \"\\\"\" [^\"\\\\]* \"\\\"\" | [0-9]+ | .\nws ::= [ \\t\\n]{0,4}\n",
        )
        .unwrap();
        assert_eq!(
            g,
            "start: g_item (\",\" g_ws g_item)*\n\
             g_item: \"\\\"\" /[^\\x{22}\\x{5c}]/* \"\\\"\" | /[\\x{30}-\\x{39}]/+ | /(?s:.)/\n\
             g_ws: /[\\x{20}\\x{9}\\x{a}]/{0,4}\n"
        );
    }

    #[test]
    fn names_empty_alternatives_tokens_and_escapes() {
        // The empty string repeated is the empty string.
        let g = to_lark("root ::= \"a\" \"\"{2,} ( | )*\n").unwrap();
        assert_eq!(g, "start: \"a\"\n");
        let g = to_lark("root ::= Ab ab <|eot_id|>\nAb ::= | \"x\"\nab ::= (\"\\x41\\u00e9\\U0001F600\\x7f\" | )\n")
            .unwrap();
        assert_eq!(
            g,
            "start: g__ab g_ab <|eot_id|>\ng__ab: (\"x\")?\ng_ab: ((\"Aé😀\\u007f\")?)\n"
        );
        let g = to_lark("root ::= \"a\"*? [^] \"b\"{3}\n").unwrap();
        assert_eq!(g, "start: (\"a\"*)? /(?s:.)/ \"b\"{3}\n");
    }

    #[test]
    fn errors_name_the_place() {
        let deep = format!(
            "root ::= {}\"a\"{}\n",
            "(".repeat(100_000),
            ")".repeat(100_000)
        );
        for (src, line, col, what) in [
            ("root ::= foo\n", 1, 10, "not defined"),
            ("item ::= \"x\"\n", 0, 0, "no 'root'"),
            ("root ::= \"x\"\nroot ::= \"y\"\n", 2, 1, "twice"),
            ("root ::= \"x\n", 2, 1, "end of the grammar"),
            ("root ::= [z-a]\n", 1, 14, "backwards"),
            ("root ::= \"\\q\"\n", 1, 13, "unknown escape"),
            ("root ::= ( \"x\"\n", 1, 12, "expected ')'"),
            ("root ::= \"x\" )\n", 1, 14, "unbalanced"),
            ("root ::= * \"x\"\n", 1, 10, "nothing to repeat"),
            ("root ::= \"x\"{3,1}\n", 1, 17, "minimum exceeds"),
            ("root ::= []\n", 1, 10, "empty character class"),
            ("root ::=\n", 1, 1, "is empty"),
            ("\"x\" root ::= \"y\"", 1, 1, "expected a rule"),
            ("root ::= @\n", 1, 10, "unexpected character"),
            ("   \n# only a comment\n", 0, 0, "empty"),
            (deep.as_str(), 1, 74, "nested deeper than 64"),
        ] {
            let e = to_lark(src).unwrap_err();
            assert!(e.message.contains(what), "{src:?}: {e}");
            assert_eq!((e.line, e.col), (line, col), "{src:?}: {e}");
        }
    }

    #[test]
    fn gbnf_is_told_from_lark() {
        assert!(looks_like_gbnf("root ::= \"a\""));
        assert!(looks_like_gbnf("# c\n  my-rule::= x\nroot ::= my-rule"));
        assert!(!looks_like_gbnf("start: \"a\" | b\nb: /x::=y/"));
        assert!(!looks_like_gbnf("%llguidance {}\nstart: a\na ::= b"));
    }
}
