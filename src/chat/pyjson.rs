//! Python's `json.dumps` over template values: the `tojson` filter as transformers
//! defines it.
//!
//! transformers replaces Jinja's `tojson` (which escapes `<`, `>`, `&`, `'` for HTML and
//! sorts keys) with `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`: keys in their given order, `", "` and `": "` between items (`","`
//! once an indent is given), non-ASCII text as is, floats as Python's `repr`
//! (`1.0`, `1e-05`, `NaN`, `Infinity`). The same arguments are accepted, by position or
//! by keyword.

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How `dumps` writes.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: everything on one line; `Some(s)`: one item a line, `s` per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// The `tojson` filter: `value | tojson(ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`.
pub fn tojson_filter(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(bad(format!(
            "tojson takes at most {} arguments, got {}",
            NAMES.len(),
            args.len()
        )));
    }
    let mut given: [Option<Value>; 4] = Default::default();
    for (i, a) in args.iter().enumerate() {
        given[i] = Some(a.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if given[i].is_some() {
                return Err(bad(format!("tojson got multiple values for '{name}'")));
            }
            given[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let mut o = DumpOptions {
        ensure_ascii: given[0].as_ref().is_some_and(Value::is_true),
        sort_keys: given[3].as_ref().is_some_and(Value::is_true),
        ..DumpOptions::default()
    };
    match given[1].as_ref().filter(|v| !v.is_none()) {
        None => {}
        Some(v) if v.kind() == ValueKind::String => {
            o.indent = Some(v.as_str().unwrap_or("").to_string());
        }
        Some(v) if v.kind() == ValueKind::Bool || v.is_integer() => {
            // Python: " " * indent (a negative count gives "").
            let n = if v.kind() == ValueKind::Bool {
                usize::from(v.is_true())
            } else {
                v.as_i64().unwrap_or(0).clamp(0, 64) as usize
            };
            o.indent = Some(" ".repeat(n));
        }
        Some(v) => {
            return Err(bad(format!(
                "tojson: indent must be an int or a string, got {v}"
            )))
        }
    }
    if o.indent.is_some() {
        o.item_sep = ",".into();
    }
    if let Some(sep) = given[2].as_ref().filter(|v| !v.is_none()) {
        let parts: Vec<Value> = sep.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] if a.kind() == ValueKind::String && b.kind() == ValueKind::String => {
                o.item_sep = a.as_str().unwrap_or("").to_string();
                o.key_sep = b.as_str().unwrap_or("").to_string();
            }
            _ => return Err(bad("tojson: separators must be a pair of strings")),
        }
    }
    let mut out = String::new();
    dumps(&value, &o, 0, &mut out)?;
    Ok(out)
}

/// Python's `repr(float)`: the shortest digits that round-trip, fixed notation for
/// decimal exponents -4..=15, else `d.ddde±XX`.
pub fn py_float_repr(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-5".
    let sci = format!("{v:e}");
    let (mant, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    let (sign, mant) = match mant.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{s}")
    } else {
        let (first, rest) = digits.split_at(1);
        let m = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

fn json_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        py_float_repr(v)
    }
}

fn write_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn scalar(v: &Value) -> Result<Option<String>, Error> {
    Ok(Some(match v.kind() {
        ValueKind::None => "null".into(),
        ValueKind::Bool => if v.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if v.is_integer() => v.to_string(),
        ValueKind::Number => json_float(f64::try_from(v.clone())?),
        _ => return Ok(None),
    }))
}

fn newline(o: &DumpOptions, level: usize, out: &mut String) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

/// `json.dumps(value)` with the options, appended to `out`.
pub fn dumps(v: &Value, o: &DumpOptions, level: usize, out: &mut String) -> Result<(), Error> {
    if level > 512 {
        return Err(bad("tojson: nesting too deep"));
    }
    if let Some(s) = scalar(v)? {
        out.push_str(&s);
        return Ok(());
    }
    match v.kind() {
        ValueKind::String => write_str(v.as_str().unwrap_or(""), o.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(o, level + 1, out);
                dumps(item, o, level + 1, out)?;
            }
            newline(o, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let k = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or("").to_string(),
                    _ => match scalar(&key)? {
                        Some(s) => s,
                        None => {
                            return Err(bad(format!(
                                "tojson: keys must be str, int, float, bool or None, not {}",
                                key.kind()
                            )))
                        }
                    },
                };
                let val = v.get_item(&key)?;
                items.push((k, val));
            }
            if o.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(o, level + 1, out);
                write_str(k, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                dumps(val, o, level + 1, out)?;
            }
            newline(o, level, out);
            out.push('}');
        }
        kind => {
            let what = if kind == ValueKind::Undefined {
                "Undefined".to_string()
            } else {
                kind.to_string()
            };
            return Err(bad(format!(
                "tojson: object of type {what} is not JSON serializable"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_like_python() {
        for (v, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (123456789.125, "123456789.125"),
            (-2.5e-7, "-2.5e-07"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-0.0, "-0.0"),
            (5e-324, "5e-324"),
        ] {
            assert_eq!(py_float_repr(v), want, "{v:e}");
        }
    }

    fn dump(json: &str, o: &DumpOptions) -> String {
        let v: Value = serde_json::from_str(json).unwrap();
        let mut s = String::new();
        dumps(&v, o, 0, &mut s).unwrap();
        s
    }

    #[test]
    fn dumps_like_python() {
        let d = DumpOptions::default();
        // Python: json.dumps({"b": [1, 2.0, None, True], "a": "é\"\n\u0001</x>"})
        assert_eq!(
            dump(r#"{"b": [1, 2.0, null, true], "a": "é\"\n\u0001</x>"}"#, &d),
            r#"{"b": [1, 2.0, null, true], "a": "é\"\n\u0001</x>"}"#
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..d.clone()
        };
        assert_eq!(dump(r#"["é😀"]"#, &ascii), r#"["\u00e9\ud83d\ude00"]"#);
        // json.dumps({"b": {}, "a": [1, []]}, indent=2, sort_keys=True)
        let ind = DumpOptions {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            sort_keys: true,
            ..d.clone()
        };
        assert_eq!(
            dump(r#"{"b": {}, "a": [1, []]}"#, &ind),
            "{\n  \"a\": [\n    1,\n    []\n  ],\n  \"b\": {}\n}"
        );
    }
}
