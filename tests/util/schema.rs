//! A JSON Schema checker for the keywords the structured-output tests use: `type`
//! (one or a list), `enum`, `const`, `properties`, `required`, `additionalProperties`,
//! `items`, `minItems`, `maxItems`, `minimum`, `maximum`, `exclusiveMinimum`,
//! `exclusiveMaximum`, `minLength`, `maxLength`, `anyOf`, `oneOf`, `allOf` and local
//! `$ref`s (`#/$defs/NAME`, `#/definitions/NAME`). Anything else in a schema is a
//! test bug: the checker refuses it rather than pass what it did not check.

use serde_json::Value;

const KNOWN: &[&str] = &[
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "description",
    "title",
    "x-guidance",
];

/// Whether `v` is valid under `schema` (the root schema, for `$ref`s); the error names
/// the path and the rule broken.
pub fn validate(schema: &Value, v: &Value) -> Result<(), String> {
    check(schema, schema, v, "$")
}

fn type_ok(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        other => panic!("unknown type {other}"),
    }
}

fn check(root: &Value, s: &Value, v: &Value, at: &str) -> Result<(), String> {
    let fail = |rule: &str| Err(format!("{at}: {v} breaks {rule}"));
    let s = match s {
        Value::Bool(true) => return Ok(()),
        Value::Bool(false) => return fail("false"),
        Value::Object(o) => o,
        other => panic!("schema {other} is not an object"),
    };
    for k in s.keys() {
        assert!(
            KNOWN.contains(&k.as_str()),
            "the checker does not know '{k}'"
        );
    }
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r
            .strip_prefix("#/$defs/")
            .map(|n| &root["$defs"][n])
            .or_else(|| {
                r.strip_prefix("#/definitions/")
                    .map(|n| &root["definitions"][n])
            })
            .unwrap_or_else(|| panic!("unsupported $ref {r}"));
        check(root, name, v, at)?;
    }
    match s.get("type") {
        Some(Value::String(t)) if !type_ok(t, v) => return fail(&format!("type {t}")),
        Some(Value::Array(ts)) if !ts.iter().any(|t| type_ok(t.as_str().unwrap(), v)) => {
            return fail("type list")
        }
        _ => {}
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return fail("enum");
        }
    }
    if let Some(c) = s.get("const") {
        if c != v {
            return fail("const");
        }
    }
    if let Some(x) = v.as_f64() {
        let num = |k: &str| s.get(k).and_then(Value::as_f64);
        if num("minimum").is_some_and(|m| x < m)
            || num("maximum").is_some_and(|m| x > m)
            || num("exclusiveMinimum").is_some_and(|m| x <= m)
            || num("exclusiveMaximum").is_some_and(|m| x >= m)
        {
            return fail("a numeric bound");
        }
    }
    if let Some(t) = v.as_str() {
        let n = t.chars().count() as u64;
        let len = |k: &str| s.get(k).and_then(Value::as_u64);
        if len("minLength").is_some_and(|m| n < m) || len("maxLength").is_some_and(|m| n > m) {
            return fail("a length bound");
        }
    }
    if let Some(a) = v.as_array() {
        let len = |k: &str| s.get(k).and_then(Value::as_u64);
        let n = a.len() as u64;
        if len("minItems").is_some_and(|m| n < m) || len("maxItems").is_some_and(|m| n > m) {
            return fail("an item count bound");
        }
        if let Some(items) = s.get("items") {
            for (i, x) in a.iter().enumerate() {
                check(root, items, x, &format!("{at}[{i}]"))?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if !o.contains_key(r.as_str().unwrap()) {
                return fail(&format!("required {r}"));
            }
        }
        for (k, x) in o {
            let p = format!("{at}.{k}");
            match (props.and_then(|p| p.get(k)), s.get("additionalProperties")) {
                (Some(ps), _) => check(root, ps, x, &p)?,
                (None, Some(ap)) => check(root, ap, x, &p)?,
                (None, None) => {}
            }
        }
    }
    for (k, need) in [("anyOf", 1usize), ("oneOf", 1)] {
        if let Some(list) = s.get(k).and_then(Value::as_array) {
            let ok = list
                .iter()
                .filter(|x| check(root, x, v, at).is_ok())
                .count();
            if ok < need || (k == "oneOf" && ok > 1) {
                return fail(k);
            }
        }
    }
    for x in s
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        check(root, x, v, at)?;
    }
    Ok(())
}

#[test]
fn the_checker_checks() {
    let s: Value = serde_json::json!({
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 1}, "b": {"$ref": "#/$defs/b"}},
        "required": ["a"],
        "additionalProperties": false,
        "$defs": {"b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}
    });
    assert!(validate(&s, &serde_json::json!({"a": 2, "b": ["x"]})).is_ok());
    for bad in [
        serde_json::json!({"a": 0}),
        serde_json::json!({"b": []}),
        serde_json::json!({"a": 1, "c": 1}),
        serde_json::json!({"a": 1, "b": ["z"]}),
        serde_json::json!({"a": 1, "b": ["x", "x", "x"]}),
        serde_json::json!({"a": 1.5}),
        serde_json::json!([1]),
    ] {
        assert!(validate(&s, &bad).is_err(), "{bad}");
    }
}
