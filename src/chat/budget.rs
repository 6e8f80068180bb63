//! The render budget: what one rendering of a chat template may cost.
//!
//! A chat template is code that comes with a downloaded file (a `.mlt`, a GGUF's
//! `tokenizer.chat_template`), so it is treated as hostile. One rendering gets one
//! [`RenderBudget`], and running out of any part of it is a [`ChatError::Budget`]
//! instead of an abort, a stack overflow or a hang:
//!
//! - **fuel** (minijinja's): one per instruction plus one per 64 bytes of data the
//!   template creates (strings and lists built by `~`, `+`, `*`, literals, filter and
//!   method results, captured output). Fuel only goes down, so it bounds both the time
//!   and the memory of a rendering: at most `fuel × 64` bytes of intermediate values.
//!   minijinja checks allocations of a known size (`'x' * n`, `~`, `|format` widths,
//!   `|indent`) *before* making them; the filters and methods this crate adds or
//!   replaces do the same here: `tojson` (huge `separators` or `indent`) and
//!   `str.format` (huge widths and precisions) pay for their output before building it.
//! - **output**: at most `max_output` bytes of rendered text (the writer refuses more).
//! - **depth**: minijinja's recursion limit (macros, recursive loops, includes), and
//!   values stored in a namespace nest at most [`MAX_NAMESPACE_DEPTH`] levels.
//!
//! Namespaces are the only mutable values a template has, hence the only way to build a
//! cycle (`{% set ns.me = ns %}`), which every printer, comparison and serializer would
//! follow until the stack overflows, or an unbounded nesting (`{% set ns.l = [ns.l] %}`
//! in a loop). [`guard_namespace_sets`] rewrites every `{% set X.attr = EXPR %}` to
//! `{% set X.attr = __namespace_value((EXPR)) %}`, which refuses a value holding a
//! namespace or nested too deeply: with that, the values of a rendering stay acyclic
//! and shallow.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, State, Value};

use super::error::ChatError;

/// Default fuel of one rendering: up to 4 M instructions, or 256 MiB of data. The
/// largest real template over a conversation filling a 32k context takes well under
/// a tenth of it (`a_long_conversation_renders_well_within_the_budget`).
pub const DEFAULT_FUEL: u64 = 4_000_000;

/// Default most bytes of rendered text (16 MiB: far over any context's worth of text).
pub const DEFAULT_MAX_OUTPUT: usize = 16 << 20;

/// Deepest nesting of a value stored in a namespace attribute.
pub const MAX_NAMESPACE_DEPTH: usize = 128;

/// The name of the guard [`guard_namespace_sets`] inserts.
pub const NAMESPACE_GUARD: &str = "__namespace_value";

/// What one rendering may cost (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderBudget {
    /// minijinja fuel: one per instruction, one per 64 bytes of data created.
    pub fuel: u64,
    /// Most bytes of rendered text.
    pub max_output: usize,
}

impl Default for RenderBudget {
    fn default() -> Self {
        RenderBudget {
            fuel: DEFAULT_FUEL,
            max_output: DEFAULT_MAX_OUTPUT,
        }
    }
}

impl RenderBudget {
    /// The most bytes of intermediate data the fuel pays for.
    pub fn max_data(&self) -> u64 {
        self.fuel.saturating_mul(64)
    }
}

/// The error of a rendering that ran out of its budget.
pub(crate) fn budget_error(template: &str, line: Option<usize>, what: String) -> ChatError {
    ChatError::Budget {
        template: template.to_string(),
        line,
        message: what,
    }
}

/// Fails unless the fuel left pays for `bytes` more bytes of data (charging them).
pub(crate) fn pay_bytes(state: &State, bytes: u64, what: &str) -> Result<(), Error> {
    state.consume_fuel(bytes / 64 + 1).map_err(|_| {
        Error::new(
            ErrorKind::OutOfFuel,
            format!("{what} would need {bytes} bytes, more than the render budget has left"),
        )
    })
}

/// The bytes left in the fuel (`None`: no fuel set).
pub(crate) fn bytes_left(state: &State) -> Option<u64> {
    state.fuel_levels().map(|(_, left)| left.saturating_mul(64))
}

/// The type name minijinja's namespaces have (taken from one, not spelled out).
fn namespace_type() -> &'static str {
    static T: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        minijinja::functions::namespace(None)
            .ok()
            .and_then(|ns| ns.as_object().map(|o| o.type_name()))
            .unwrap_or("minijinja::value::namespace_object::Namespace")
    })
}

fn refuse(why: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, why)
}

/// The `__namespace_value` guard: `v` unchanged, if it holds no namespace and nests at most [`MAX_NAMESPACE_DEPTH`] levels. Every item visited costs fuel.
pub(crate) fn namespace_value(state: &State, v: Value) -> Result<Value, Error> {
    check_stored(state, &v, 0)?;
    Ok(v)
}

fn check_stored(state: &State, v: &Value, depth: usize) -> Result<(), Error> {
    if depth > MAX_NAMESPACE_DEPTH {
        return Err(refuse(format!(
            "a value stored in a namespace may nest at most {MAX_NAMESPACE_DEPTH} levels"
        )));
    }
    if let Some(o) = v.as_object() {
        if o.type_name() == namespace_type() {
            return Err(refuse(
                "a namespace cannot hold a namespace (it could hold itself)".into(),
            ));
        }
    }
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            for item in v.try_iter()? {
                state.consume_fuel(1)?;
                check_stored(state, &item, depth + 1)?;
            }
            Ok(())
        }
        ValueKind::Map => {
            for key in v.try_iter()? {
                state.consume_fuel(1)?;
                check_stored(state, &key, depth + 1)?;
                let item = v.get_item(&key)?;
                check_stored(state, &item, depth + 1)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Bytes `str.format` may produce beyond its inputs: the widths and precisions its
/// replacement fields ask for (every number in a field's format spec, summed), so that
/// `'{:>999999999}'.format(x)` pays before it allocates.
pub(crate) fn str_format_padding(fmt: &str) -> u64 {
    let b = fmt.as_bytes();
    let mut total: u64 = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' if b.get(i + 1) == Some(&b'{') => i += 2,
            b'{' => {
                let end = fmt[i..].find('}').map_or(b.len(), |e| i + e);
                if let Some(colon) = fmt[i..end].find(':') {
                    let mut n: u64 = 0;
                    for &c in &b[i + colon..end] {
                        if c.is_ascii_digit() {
                            n = n.saturating_mul(10).saturating_add(u64::from(c - b'0'));
                        } else {
                            total = total.saturating_add(n);
                            n = 0;
                        }
                    }
                    total = total.saturating_add(n);
                }
                i = end + 1;
            }
            _ => i += 1,
        }
    }
    total
}

/// An upper bound of the bytes `tojson` writes for `v` with these separators and
/// indent (each string at most 12 bytes a byte: a `\uXXXX` surrogate pair per 4-byte
/// char), walking at most `limit` bytes' worth before giving up (`None`: over it).
pub(crate) fn tojson_size(
    v: &Value,
    item_sep: usize,
    key_sep: usize,
    indent: Option<usize>,
    limit: u64,
) -> Option<u64> {
    fn walk(v: &Value, s: &Seps, level: u64, total: &mut u64) -> Option<()> {
        let add = |t: &mut u64, n: u64| {
            *t = t.saturating_add(n);
            (*t <= s.limit).then_some(())
        };
        // An item's own newline and indent, and its separator.
        let per_item = |level: u64| {
            s.item
                .saturating_add(s.indent.map_or(0, |w| 1 + w.saturating_mul(level + 1)))
        };
        if level > 512 {
            // dumps refuses this itself.
            return Some(());
        }
        match v.kind() {
            ValueKind::String => add(total, 2 + 3 * v.as_str().map_or(0, |x| x.len() as u64)),
            ValueKind::Seq | ValueKind::Iterable => {
                add(
                    total,
                    2 + s.indent.map_or(0, |w| 1 + w.saturating_mul(level)),
                )?;
                for item in v.try_iter().ok()? {
                    add(total, per_item(level))?;
                    walk(&item, s, level + 1, total)?;
                }
                Some(())
            }
            ValueKind::Map => {
                add(
                    total,
                    2 + s.indent.map_or(0, |w| 1 + w.saturating_mul(level)),
                )?;
                for key in v.try_iter().ok()? {
                    add(total, per_item(level).saturating_add(s.key))?;
                    walk(&key, s, level + 1, total)?;
                    walk(&v.get_item(&key).ok()?, s, level + 1, total)?;
                }
                Some(())
            }
            // Numbers, booleans, null: at most 24 bytes (Python's float repr).
            _ => add(total, 24),
        }
    }
    struct Seps {
        item: u64,
        key: u64,
        indent: Option<u64>,
        limit: u64,
    }
    let s = Seps {
        item: item_sep as u64,
        key: key_sep as u64,
        indent: indent.map(|w| w as u64),
        limit,
    };
    let mut total = 0;
    walk(v, &s, 0, &mut total).map(|()| total)
}

/// A writer that keeps at most `max` bytes and then refuses more.
pub(crate) struct CappedOutput {
    pub buf: Vec<u8>,
    pub max: usize,
    pub over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(b.len()) > self.max {
            self.over = true;
            return Err(std::io::Error::other("over the output budget"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The end of a Jinja expression that starts at `i` and runs to `end` (`"}}"` or
/// `"%}"`), skipping string literals: the index of `end`, or the text's length.
fn expr_end(b: &[u8], mut i: usize, end: &[u8; 2]) -> usize {
    while i < b.len() {
        match b[i] {
            q @ (b'\'' | b'"') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c if c == end[0] && b.get(i + 1) == Some(&end[1]) => return i,
            _ => i += 1,
        }
    }
    b.len()
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Rewrites every `{% set TARGET = EXPR %}` whose target assigns an attribute
/// (`ns.x`, `ns.a, b`) into `{% set TARGET = __namespace_value((EXPR)) %}`, leaving
/// everything else (including `{% raw %}` blocks, comments and string literals) as is.
pub fn guard_namespace_sets(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len() + 64);
    let mut copied = 0;
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] != b'{' {
            i += 1;
            continue;
        }
        match b[i + 1] {
            b'#' => {
                i = src[i + 2..].find("#}").map_or(b.len(), |e| i + 2 + e + 2);
            }
            b'{' => i = expr_end(b, i + 2, b"}}") + 2,
            b'%' => {
                let mut j = i + 2;
                if matches!(b.get(j), Some(b'-' | b'+')) {
                    j += 1;
                }
                while j < b.len() && b[j].is_ascii_whitespace() {
                    j += 1;
                }
                let kw_end = (j..b.len()).find(|&k| !is_ident(b[k])).unwrap_or(b.len());
                let end = expr_end(b, kw_end, b"%}");
                match &src[j..kw_end] {
                    "raw" => {
                        // To the `{% endraw %}` (with any markers and spaces).
                        let mut k = end + 2;
                        i = b.len();
                        while let Some(e) = src.get(k..).and_then(|r| r.find("{%")) {
                            let t = src[k + e + 2..].trim_start_matches(['-', '+']);
                            if t.trim_start().starts_with("endraw") {
                                i = expr_end(b, k + e + 2, b"%}") + 2;
                                break;
                            }
                            k += e + 2;
                        }
                    }
                    "set" => {
                        let body = &src[kw_end..end.min(b.len())];
                        // The target: names, dots, commas, parentheses, up to `=`.
                        let target_len = body
                            .bytes()
                            .position(|c| !(is_ident(c) || b".,() \t\r\n".contains(&c)))
                            .unwrap_or(body.len());
                        let rest = &body[target_len..];
                        if body[..target_len].contains('.')
                            && rest.starts_with('=')
                            && !rest.starts_with("==")
                        {
                            let mut expr = &rest[1..];
                            let mut marker = "";
                            if let Some(e) = expr.strip_suffix(['-', '+']) {
                                marker = &expr[e.len()..];
                                expr = e;
                            }
                            let at = kw_end + target_len;
                            out.push_str(&src[copied..at]);
                            out.push_str("= ");
                            out.push_str(NAMESPACE_GUARD);
                            out.push_str("((");
                            out.push_str(expr);
                            out.push_str(")) ");
                            out.push_str(marker);
                            copied = end.min(b.len());
                        }
                        i = end + 2;
                    }
                    _ => i = end + 2,
                }
            }
            _ => i += 1,
        }
    }
    out.push_str(&src[copied.min(src.len())..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_attribute_statements_are_guarded() {
        for (src, want) in [
            (
                "{% set ns.me = ns %}",
                "{% set ns.me = __namespace_value(( ns )) %}",
            ),
            (
                "a{%- set ns.a, b = 1, '%}' -%}b",
                "a{%- set ns.a, b = __namespace_value(( 1, '%}' )) -%}b",
            ),
            ("{% set x = ns %}", "{% set x = ns %}"),
            ("{% set ns.x %}v{% endset %}", "{% set ns.x %}v{% endset %}"),
            (
                "{% raw %}{% set ns.a = 1 %}{% endraw %}",
                "{% raw %}{% set ns.a = 1 %}{% endraw %}",
            ),
            (
                "{{ '{% set ns.a = 1 %}' }}{# {% set ns.a = 1 %} #}",
                "{{ '{% set ns.a = 1 %}' }}{# {% set ns.a = 1 %} #}",
            ),
            (
                "{% if a %}{% set ns.y=[ns.y]%}",
                "{% if a %}{% set ns.y= __namespace_value(([ns.y])) %}",
            ),
            ("{% set", "{% set"),
            ("{% set ns.a =", "{% set ns.a = __namespace_value(()) "),
        ] {
            assert_eq!(guard_namespace_sets(src), want, "{src}");
        }
    }

    #[test]
    fn format_widths_are_counted() {
        assert_eq!(str_format_padding("{:>999999999}"), 999_999_999);
        assert_eq!(str_format_padding("{0:10.5f} {{:99}} {}"), 15);
        assert_eq!(str_format_padding("{:"), 0);
    }
}
