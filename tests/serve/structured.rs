//! mlb-serve's structured output and tool calls over HTTP, on the default model (random
//! weights: whatever it prefers, the grammar decides what can come out): every JSON
//! answer parses and validates against its schema, whole and streamed; grammars and
//! regexes match; bad schemas and grammars are 400s naming the field; required and
//! named tool calls come back as OpenAI `tool_calls`, their streamed deltas adding up
//! to the same calls; conversations carrying tool calls and results render.

use serde_json::{json, Value};

use super::{start, stream_text, Server};
use crate::util::schema::validate;

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    })
}

fn chat(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 200,
        "temperature": 1.0,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The message of a non-streaming chat answer (asserting 200).
fn answer(s: &Server, body: &Value) -> Value {
    let r = s.post("/v1/chat/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0].clone()
}

#[test]
fn serve_json_schema_answers_validate() {
    let s = start(&["--parallel", "2"]);
    let rf = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}});
    for seed in 1..=4 {
        let body = chat(json!({"response_format": rf, "seed": seed}));
        let c = answer(&s, &body);
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let text = c["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        validate(&schema(), &v).unwrap();
        // Streamed: the same seed gives the same answer.
        let (streamed, finish, _) = stream_text(&s.stream("/v1/chat/completions", &body));
        assert_eq!((streamed.as_str(), finish.as_str()), (text, "stop"));
    }
    // /v1/completions takes response_format too, and json_object any object.
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": "JSON:", "max_tokens": 150, "seed": 5, "response_format": {"type": "json_object", "schema": schema()}}).to_string(),
    );
    let v: Value = serde_json::from_str(r.json()["choices"][0]["text"].as_str().unwrap()).unwrap();
    validate(&schema(), &v).unwrap();
    let c = answer(
        &s,
        &chat(json!({"response_format": {"type": "json_object"}, "seed": 2, "max_tokens": 20})),
    );
    assert!(
        c["message"]["content"].as_str().unwrap().starts_with('{'),
        "{c}"
    );
    // Each request logs its masks' cost.
    assert!(s.log().contains("ms per mask"), "{}", s.log());
}

#[test]
fn serve_grammars_and_regexes_match() {
    let s = start(&[]);
    for seed in 1..=3 {
        let c = answer(
            &s,
            &chat(
                json!({"grammar": "root ::= (\"yes\" | \"no\") \", \" [0-9]{2}\n", "seed": seed}),
            ),
        );
        let t = c["message"]["content"].as_str().unwrap().to_string();
        let (a, n) = t.split_once(", ").unwrap();
        assert!(
            ["yes", "no"].contains(&a) && n.len() == 2 && n.bytes().all(|b| b.is_ascii_digit()),
            "{t}"
        );
        let c = answer(
            &s,
            &chat(json!({"regex": "[A-Z][a-z]{2,4}!", "seed": seed})),
        );
        let t = c["message"]["content"].as_str().unwrap();
        assert!(
            t.ends_with('!')
                && (4..=6).contains(&t.len())
                && t.chars().next().unwrap().is_ascii_uppercase(),
            "{t}"
        );
        let c = answer(
            &s,
            &chat(json!({"grammar": "%llguidance {}\nstart: \"n=\" /[0-9]{3}/", "seed": seed})),
        );
        let t = c["message"]["content"].as_str().unwrap();
        assert!(t.starts_with("n=") && t.len() == 5, "{t}");
    }
}

#[test]
fn serve_bad_schemas_and_grammars_are_400s_naming_the_field() {
    let s = start(&[]);
    for (extra, param, what) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}),
            "response_format",
            "frobnicate",
        ),
        (
            json!({"grammar": "root ::= item\n"}),
            "grammar",
            "'item' is used but not defined",
        ),
        (json!({"grammar": "root ::= \"x\n"}), "grammar", "line 2"),
        (json!({"grammar": "start: nope"}), "grammar", "nope"),
        (json!({"regex": "(unclosed"}), "regex", "regex"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}], "tool_choice": "required"}),
            "tools",
            "frobnicate",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
            "yaml",
        ),
        (json!({"tool_choice": "required"}), "tool_choice", "tools"),
    ] {
        let r = s.post("/v1/chat/completions", &chat(extra.clone()).to_string());
        let e = r.error(400);
        assert_eq!(e["param"], param, "{extra}: {e}");
        assert!(
            e["message"].as_str().unwrap().contains(what),
            "{extra}: {e}"
        );
    }
    // The server stays up.
    s.assert_serves();
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}
    ])
}

/// Checks one call against the tools: a known name, arguments valid for its schema.
fn check_call(name: &str, arguments: &str) {
    let t = tools();
    let spec = t
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == name)
        .unwrap_or_else(|| panic!("unknown tool {name}"));
    let args: Value =
        serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments}"));
    validate(&spec["function"]["parameters"], &args).unwrap();
}

/// The calls of a stream's `tool_calls` deltas: (id, name, arguments joined).
fn streamed_calls(data: &[String]) -> (Vec<(String, String, String)>, String) {
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = String::new();
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.into();
        }
        for tc in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert_eq!(tc["type"], "function", "{tc}");
                calls.push((
                    tc["id"].as_str().unwrap().into(),
                    tc["function"]["name"].as_str().unwrap().into(),
                    tc["function"]["arguments"].as_str().unwrap().into(),
                ));
            } else {
                assert!(tc.get("id").is_none(), "{tc}");
                calls[i]
                    .2
                    .push_str(tc["function"]["arguments"].as_str().unwrap());
            }
        }
    }
    (calls, finish)
}

#[test]
fn serve_required_and_named_tool_calls() {
    let s = start(&["--parallel", "2"]);
    for (choice, parallel) in [
        (json!("required"), false),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            true,
        ),
    ] {
        for seed in 1..=3 {
            let body = chat(
                json!({"tools": tools(), "tool_choice": choice, "parallel_tool_calls": parallel, "seed": seed}),
            );
            let c = answer(&s, &body);
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            let calls = c["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{c}");
            let f = &calls[0]["function"];
            if choice.is_object() {
                assert_eq!(f["name"], "get_weather");
            }
            check_call(
                f["name"].as_str().unwrap(),
                f["arguments"].as_str().unwrap(),
            );
            assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"), "{c}");
            assert_eq!(calls[0]["type"], "function");
            assert!(c["message"]["content"].is_null(), "{c}");
            // Streamed: the same call, in deltas.
            let (streamed, finish) = streamed_calls(&s.stream("/v1/chat/completions", &body));
            assert_eq!(finish, "tool_calls");
            assert_eq!(streamed.len(), 1);
            assert_eq!(
                (&streamed[0].1, &streamed[0].2),
                (
                    &f["name"].as_str().unwrap().to_string(),
                    &f["arguments"].as_str().unwrap().to_string()
                )
            );
        }
    }
    // tool_choice none: the reply is text, never read for calls.
    let c = answer(
        &s,
        &chat(json!({"tools": tools(), "tool_choice": "none", "max_tokens": 8})),
    );
    assert!(
        c["message"].get("tool_calls").is_none() && c["finish_reason"] != "tool_calls",
        "{c}"
    );
}

#[test]
fn serve_tool_conversations_render() {
    let s = start(&[]);
    // An assistant message carrying tool calls (arguments as the JSON string OpenAI
    // clients send) and the tool's result.
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"c\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"}
        ],
        "tools": tools(),
        "max_tokens": 4,
        "temperature": 0
    });
    let c = answer(&s, &body);
    assert!(c["message"]["content"].is_string(), "{c}");
}
