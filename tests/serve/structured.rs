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
    with(
        &json!({
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 200,
            "temperature": 1.0,
        }),
        &extra,
    )
}

/// `body` with the fields of `extra` added.
fn with(body: &Value, extra: &Value) -> Value {
    let mut b = body.clone();
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
        {"type": "function", "function": {"name": "now", "description": "The time now",
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

/// The default model with 1,024 positions (the real templates' tool prompts are longer
/// than its 256; its RoPE needs no more) and its tokenizer with a real template of
/// testdata/chat/templates/: a server of one template family (converted once per test
/// run).
fn start_family(template: &str) -> Server {
    use std::path::PathBuf;
    use std::sync::Mutex;
    static DONE: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let dir = super::files().mlb.parent().unwrap().to_path_buf();
    let long = dir.join("long.mlb");
    let tok = dir.join(format!("{template}.mlt"));
    let src = crate::util::testdata().join("default");
    let mut done = DONE.lock().unwrap();
    if done.is_empty() {
        let hf = crate::util::fixtures::copy_files(
            &src,
            &dir.join("long-hf"),
            &[
                "model.safetensors",
                "generation_config.json",
                "tokenizer.json",
                "tokenizer_config.json",
            ],
        );
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        cfg["max_position_embeddings"] = json!(1024);
        std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
        crate::util::fixtures::convert(&hf, &long, &["--wtype", "q8_0"]);
        done.push(String::new());
    }
    if !done.iter().any(|t| t == template) {
        let jinja: PathBuf =
            crate::util::testdata().join(format!("chat/templates/{template}.jinja"));
        let json = src.join("tokenizer.json");
        crate::util::tool::tool("mlt-convert")
            .arg(&json)
            .arg("-o")
            .arg(&tok)
            .arg("--chat-template")
            .arg(&jinja)
            .arg("-q")
            .ok();
        done.push(template.to_string());
    }
    drop(done);
    super::try_start_model(&long, &["--tokenizer", tok.to_str().unwrap()], None)
        .unwrap_or_else(|(c, e)| panic!("mlb-serve exited {c:?}: {e}"))
}

/// [`chat`] with a short system message first (Mistral Small 3.2's default one is
/// longer than the test model's context).
fn family_chat(extra: Value) -> Value {
    let mut b = chat(extra);
    b["messages"] = json!([
        {"role": "system", "content": "Be brief."},
        b["messages"][0].clone()
    ]);
    b
}

/// gpt-oss without tools: the analysis channel is `reasoning_content`, the final
/// channel the content, whole and streamed; a reasoning effort reaches the template.
#[test]
fn serve_harmony_reasoning_and_content() {
    let s = start_family("gpt-oss");
    let text = "<|channel|>analysis<|message|>The user asks the weather. Say sunny.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.";
    let grammar = format!("start: {}", serde_json::to_string(text).unwrap());
    let body =
        family_chat(json!({"grammar": grammar, "max_tokens": 80, "reasoning_effort": "low"}));
    let c = answer(&s, &body);
    assert_eq!(c["finish_reason"], "stop", "{c}");
    assert_eq!(c["message"]["content"], "It is sunny.", "{c}");
    assert_eq!(
        c["message"]["reasoning_content"], "The user asks the weather. Say sunny.",
        "{c}"
    );
    let data = s.stream("/v1/chat/completions", &body);
    assert_eq!(streamed_content(&data), "It is sunny.");
    let reasoning: String = data[..data.len() - 1]
        .iter()
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            v["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(reasoning, "The user asks the weather. Say sunny.");
    // The answer goes back with its reasoning (the template's `thinking`) and renders.
    let next = json!({
        "messages": [
            {"role": "user", "content": "Weather?"},
            c["message"],
            {"role": "user", "content": "Thanks."}
        ],
        "max_tokens": 2
    });
    let r = s.post("/v1/chat/completions", &next.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
}

/// gpt-oss's template over a tokenizer with harmony's markers as special tokens (as
/// gpt-oss's has them: the bundled tokenizer's ids, then the markers) and a random model
/// of that vocabulary with 1,024 positions: the model and tokenizer files (made once
/// per test run).
fn harmony_files() -> &'static (std::path::PathBuf, std::path::PathBuf) {
    use crate::util::fixtures::HARMONY_MARKERS as MARKERS;
    use std::sync::OnceLock;
    static MADE: OnceLock<(std::path::PathBuf, std::path::PathBuf)> = OnceLock::new();
    MADE.get_or_init(|| {
        let dir = super::files().mlb.parent().unwrap().join("harmony");
        std::fs::create_dir_all(&dir).unwrap();
        let src = crate::util::testdata().join("default");
        let mut tj: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
                .unwrap();
        let first = tj["model"]["vocab"].as_object().unwrap().len();
        for (i, t) in MARKERS.iter().enumerate() {
            tj["added_tokens"].as_array_mut().unwrap().push(json!({
                "id": first + i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
        }
        std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
        std::fs::copy(
            src.join("tokenizer_config.json"),
            dir.join("tokenizer_config.json"),
        )
        .unwrap();
        let mlt = dir.join("gpt-oss.mlt");
        crate::util::tool::tool("mlt-convert")
            .arg(dir.join("tokenizer.json"))
            .arg("-o")
            .arg(&mlt)
            .arg("--chat-template")
            .arg(crate::util::testdata().join("chat/templates/gpt-oss.jinja"))
            .arg("-q")
            .ok();
        let mut h = krafla::synth::tiny_header();
        h.vocab = (first + MARKERS.len()) as u32;
        h.max_seq = 1024;
        let mlb = dir.join("harmony.mlb");
        std::fs::write(&mlb, krafla::synth::synth_file(&h, &[], 11)).unwrap();
        (mlb, mlt)
    })
}

/// mlb-serve on [`harmony_files`].
fn start_harmony() -> Server {
    let (mlb, mlt) = harmony_files();
    super::try_start_model(mlb, &["--tokenizer", mlt.to_str().unwrap()], None)
        .unwrap_or_else(|(c, e)| panic!("mlb-serve exited {c:?}: {e}"))
}

/// gpt-oss with its markers as special tokens: a `response_format` constrains the final
/// channel's content, so the model may reason first (the random model does for some
/// seeds); `content` is exactly the JSON, which validates, `reasoning_content` the
/// analysis, whole and streamed. With `reasoning_effort` none it answers at once.
/// Beside auto tools the reply is the JSON answer or a call; a required call may reason
/// first too.
#[test]
fn serve_harmony_formats_constrain_the_final_channel() {
    let s = start_harmony();
    let rf = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}});
    let mut reasoned = 0;
    for seed in 1..=6 {
        for effort in ["low", "none"] {
            let body = family_chat(
                json!({"response_format": rf, "seed": seed, "max_tokens": 240, "reasoning_effort": effort}),
            );
            let c = answer(&s, &body);
            assert_eq!(c["finish_reason"], "stop", "{c}");
            let text = c["message"]["content"].as_str().unwrap();
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {c}"));
            validate(&schema(), &v).unwrap();
            let reasoning = c["message"]["reasoning_content"].as_str().unwrap_or("");
            if effort == "none" {
                assert_eq!(reasoning, "", "{c}");
            }
            reasoned += usize::from(!reasoning.is_empty());
            let data = s.stream("/v1/chat/completions", &body);
            assert_eq!(streamed_content(&data), text, "seed {seed}");
            assert_eq!(
                streamed(&data, "reasoning_content"),
                reasoning,
                "seed {seed}"
            );
        }
    }
    assert!((1..6).contains(&reasoned), "{reasoned} of 6 reasoned");
    // Tools the model may call beside the format: a call or the JSON answer.
    let (mut called, mut answered) = (0, 0);
    for seed in 1..=6 {
        let body = family_chat(
            json!({"response_format": rf, "tools": tools(), "seed": seed, "max_tokens": 240}),
        );
        let c = answer(&s, &body);
        let calls = whole_calls(&c);
        if calls.is_empty() {
            assert_eq!(c["finish_reason"], "stop", "{c}");
            let v: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
            validate(&schema(), &v).unwrap();
            answered += 1;
        } else {
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            check_call(&calls[0].1, &calls[0].2);
            called += 1;
        }
    }
    assert!(
        called > 0 && answered > 0,
        "{called} calls, {answered} answers"
    );
    let c = answer(
        &s,
        &family_chat(
            json!({"tools": tools(), "tool_choice": "required", "seed": 1, "max_tokens": 240}),
        ),
    );
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    let calls = whole_calls(&c);
    check_call(&calls[0].1, &calls[0].2);
}

/// `function.strict`: a strict tool whose schema the engine cannot enforce is a 400
/// naming the tool; the same tool not strict is called (the keyword ignored).
#[test]
fn serve_strict_tools() {
    let s = start(&[]);
    let tool = |strict: bool| {
        json!([{"type": "function", "function": {"name": "tag", "strict": strict,
            "parameters": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2, "uniqueItems": true}},
                "required": ["tags"], "additionalProperties": false}}}])
    };
    for choice in ["auto", "required"] {
        let r = s.post(
            "/v1/chat/completions",
            &chat(json!({"tools": tool(true), "tool_choice": choice})).to_string(),
        );
        let e = r.error(400);
        assert_eq!(e["param"], "tools[0].function.parameters", "{e}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains("'tag'") && m.contains("uniqueItems"), "{m}");
    }
    let c = answer(
        &s,
        &chat(
            json!({"tools": tool(false), "tool_choice": "required", "parallel_tool_calls": false, "seed": 3}),
        ),
    );
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    let calls = whole_calls(&c);
    let args: Value = serde_json::from_str(&calls[0].2).unwrap();
    assert!(args["tags"].as_array().unwrap().len() <= 2, "{args}");
    // A strict schema the engine takes is constrained as before.
    let mut t = tools();
    t[0]["function"]["strict"] = json!(true);
    let c = answer(
        &s,
        &chat(
            json!({"tools": t, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 4}),
        ),
    );
    let calls = whole_calls(&c);
    check_call(&calls[0].1, &calls[0].2);
}

/// The calls of a whole answer: (id, name, arguments).
fn whole_calls(c: &Value) -> Vec<(String, String, String)> {
    c["message"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            assert_eq!(t["type"], "function", "{t}");
            (
                t["id"].as_str().unwrap().into(),
                t["function"]["name"].as_str().unwrap().into(),
                t["function"]["arguments"].as_str().unwrap().into(),
            )
        })
        .collect()
}

/// What a stream's deltas add up to in one field (`content`, `reasoning_content`).
fn streamed(data: &[String], field: &str) -> String {
    data[..data.len() - 1]
        .iter()
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            v["choices"][0]["delta"][field].as_str().map(str::to_string)
        })
        .collect()
}

/// The content a stream's deltas add up to.
fn streamed_content(data: &[String]) -> String {
    streamed(data, "content")
}

/// tool_choice auto: calls are read out of what the model writes, in each template
/// family's format (a grammar makes the random model write text and two calls), whole
/// and streamed, each with its own id; parallel calls in one reply.
#[test]
fn serve_auto_tool_calls_are_read_per_template_family() {
    let hermes = |city: &str| {
        format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"{city}\", \"unit\": \"c\"}}}}\n</tool_call>")
    };
    let llama = |city: &str| {
        format!("{{\"name\": \"get_weather\", \"parameters\": {{\"city\": \"{city}\", \"unit\": \"c\"}}}}")
    };
    let args = |city: &str| format!("{{\"city\": \"{city}\", \"unit\": \"c\"}}");
    let mistral = |city: &str| {
        format!(
            "{{\"name\": \"get_weather\", \"arguments\": {}}}",
            args(city)
        )
    };
    let mistral_args = |city: &str| format!("[TOOL_CALLS]get_weather[ARGS]{}", args(city));
    // The two calls, Oslo's and Bergen's, in one family's format, `sep` between them.
    fn both(call: impl Fn(&str) -> String, sep: &str) -> String {
        format!("{}{sep}{}", call("Oslo"), call("Bergen"))
    }
    // (template, what the model writes, the content expected beside the calls)
    let cases = [
        (
            "qwen3",
            format!("Checking both.\n{}", both(hermes, "\n")),
            Some("Checking both."),
        ),
        ("qwen2.5", both(hermes, "\n"), None),
        ("smollm3", both(hermes, "\n"), None),
        ("llama3.1", format!("<|python_tag|>{}", both(llama, "; ")), None),
        ("llama3.2", both(llama, "; "), None),
        (
            "mistral-nemo",
            format!("Checking both. [TOOL_CALLS][{}]", both(mistral, ", ")),
            Some("Checking both."),
        ),
        ("mistral-small3.2", both(mistral_args, ""), None),
        // Both header forms; the analysis is reasoning_content (checked below).
        (
            "gpt-oss",
            format!(
                "<|channel|>analysis<|message|>Need both.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{}",
                args("Oslo"),
                args("Bergen")
            ),
            None,
        ),
    ];
    for (template, text, content) in cases {
        let s = start_family(template);
        let grammar = format!("start: {}", serde_json::to_string(&text).unwrap());
        let body = family_chat(
            json!({"tools": tools(), "tool_choice": "auto", "grammar": grammar, "max_tokens": 250}),
        );
        let c = answer(&s, &body);
        assert_eq!(c["finish_reason"], "tool_calls", "{template}: {c}");
        assert_eq!(c["message"]["content"].as_str(), content, "{template}: {c}");
        if template == "gpt-oss" {
            assert_eq!(c["message"]["reasoning_content"], "Need both.", "{c}");
        } else {
            assert!(c["message"].get("reasoning_content").is_none(), "{c}");
        }
        if template.starts_with("mistral") {
            // Mistral's templates take 9-character ids only.
            for (id, _, _) in whole_calls(&c) {
                assert!(
                    id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
                    "{id}"
                );
            }
        }
        let calls = whole_calls(&c);
        let got: Vec<(&str, Value)> = calls
            .iter()
            .map(|(_, n, a)| (n.as_str(), serde_json::from_str(a).unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("get_weather", json!({"city": "Oslo", "unit": "c"})),
                ("get_weather", json!({"city": "Bergen", "unit": "c"}))
            ],
            "{template}: {c}"
        );
        assert_ne!(calls[0].0, calls[1].0, "ids differ");
        let data = s.stream("/v1/chat/completions", &body);
        let (streamed, finish) = streamed_calls(&data);
        assert_eq!(finish, "tool_calls", "{template}");
        let names_args = |v: &[(String, String, String)]| -> Vec<(String, String)> {
            v.iter().map(|(_, n, a)| (n.clone(), a.clone())).collect()
        };
        assert_eq!(names_args(&streamed), names_args(&calls), "{template}");
        assert_eq!(streamed_content(&data), content.unwrap_or(""), "{template}");
        // A reply with no call is plain content.
        let c = answer(
            &s,
            &family_chat(
                json!({"tools": tools(), "grammar": "start: \"It is sunny.\"", "max_tokens": 40}),
            ),
        );
        assert_eq!(c["finish_reason"], "stop", "{template}: {c}");
        assert_eq!(c["message"]["content"], "It is sunny.", "{template}: {c}");
        assert!(c["message"].get("tool_calls").is_none(), "{template}: {c}");
    }
}

/// Required and named calls under the real templates: the grammar writes each family's
/// format (Llama 3's JSON with "parameters", Qwen's tags), the reply parses, and a
/// conversation carrying the call and its result renders for the next turn.
#[test]
fn serve_required_tool_calls_per_template_family() {
    for template in [
        "qwen3",
        "llama3.1",
        "smollm3",
        "mistral-nemo",
        "mistral-small3.2",
        "gpt-oss",
    ] {
        let s = start_family(template);
        for (choice, seed) in [
            (json!("required"), 1),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                2,
            ),
        ] {
            let body = family_chat(
                json!({"tools": tools(), "tool_choice": choice, "parallel_tool_calls": false, "seed": seed}),
            );
            let c = answer(&s, &body);
            assert_eq!(c["finish_reason"], "tool_calls", "{template}: {c}");
            let calls = whole_calls(&c);
            assert_eq!(calls.len(), 1, "{template}: {c}");
            check_call(&calls[0].1, &calls[0].2);
            // The call and its result go back to the template.
            let next = json!({
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Oslo?"},
                    c["message"],
                    {"role": "tool", "tool_call_id": calls[0].0, "content": "{\"temp\": 3}"}
                ],
                "tools": tools(), "max_tokens": 2
            });
            let r = s.post("/v1/chat/completions", &next.to_string());
            assert_eq!(r.status, 200, "{template}: {}", r.body);
        }
    }
}

/// Hostile grammars and schemas cannot hang or crash the server: each request ends in
/// bounded time with an answer or a 400 naming its field (never a panic's backtrace),
/// and the server serves on.
#[test]
fn serve_hostile_grammars_are_bounded() {
    let s = start(&[]);
    let schema = |v: Value| json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": v}}});
    let cases = [
        json!({"grammar": format!("root ::= {}\"a\"{}", "(".repeat(50_000), ")".repeat(50_000))}),
        json!({"grammar": format!("start: {}\"a\"{}", "(".repeat(50_000), ")".repeat(50_000))}),
        json!({"grammar": format!("start: r0\n{}r40: \"a\"\n", (0..40).map(|i| format!("r{i}: r{} r{}\n", i + 1, i + 1)).collect::<String>())}),
        json!({"regex": "((a{100}){100}){100}"}),
        json!({"regex": "(a|b)*a(a|b){40}"}),
        schema(json!({"type": "integer", "minimum": -1e300, "maximum": 1e300})),
        schema(json!({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"})),
        schema(json!({"type": "array", "minItems": 1_000_000, "items": {"type": "integer"}})),
        schema(json!({"type": "string", "minLength": 100_000_000})),
        schema(json!({"type": "string", "pattern": "^(a|b)*a(a|b){30}$"})),
        schema(
            json!({"anyOf": (0..20_000).map(|i| json!({"const": format!("{}{i}", "x".repeat(50))})).collect::<Vec<_>>()}),
        ),
        schema(
            json!({"allOf": (10..20).map(|i| json!({"type": "string", "pattern": format!("^(.*a.{{{i}}})$")})).collect::<Vec<_>>()}),
        ),
    ];
    for extra in cases {
        let field = extra.as_object().unwrap().keys().next().unwrap().clone();
        let body = chat(json!({"max_tokens": 20})).as_object().unwrap().clone();
        let mut body = Value::Object(body);
        body[&field] = extra[&field].clone();
        let t0 = std::time::Instant::now();
        let r = s.post("/v1/chat/completions", &body.to_string());
        let took = t0.elapsed();
        let what = &body[&field].to_string()[..body[&field].to_string().len().min(80)];
        assert!(took.as_secs() < 30, "{what}: {took:?}");
        match r.status {
            200 => {}
            400 => {
                let e = r.error(400);
                assert_eq!(e["param"], field.as_str(), "{what}: {e}");
                let m = e["message"].as_str().unwrap();
                assert!(!m.contains("backtrace") && m.len() < 1000, "{what}: {m}");
            }
            st => panic!("{what}: {st} {}", r.body),
        }
    }
    s.assert_serves();
}

/// A chat request's grammar as mlb-serve compiles it (`api::parse`, then
/// `structured::GrammarEngine`), on a model file and tokenizer of the tests, with the
/// template's tool format.
struct Compiled {
    engine: std::sync::Arc<krafla::session::Engine>,
    grammar: krafla::serve::structured::GrammarEngine,
    format: krafla::chat::tools::ToolFormat,
}

impl Compiled {
    fn new(mlb: &std::path::Path, mlt: &std::path::Path) -> Compiled {
        use krafla::session::{Engine, LoadOptions, TokenizerSource};
        let engine = std::sync::Arc::new(
            Engine::load(&LoadOptions {
                tokenizer: TokenizerSource::File(mlt.to_path_buf()),
                pack: false,
                ..LoadOptions::new(mlb)
            })
            .unwrap(),
        );
        let format = krafla::serve::structured::tool_format(engine.chat());
        let grammar = krafla::serve::structured::GrammarEngine::new(engine.clone(), vec![]);
        Compiled {
            engine,
            grammar,
            format,
        }
    }

    /// The request's constraint (200 tokens long), or the field its refusal names.
    fn constraint(&self, body: &Value) -> Result<krafla::session::Constraint, Option<String>> {
        use krafla::serve::api::{self, ApiError, Endpoint};
        let vocab = self.engine.config().vocab;
        let req =
            api::parse(body.to_string().as_bytes(), Endpoint::Chat, vocab).map_err(|e| e.param)?;
        match self.grammar.constraint(&req.structured, self.format, 200) {
            Ok(c) => Ok(c.expect("a grammar").0),
            Err(e) => Err(ApiError::from(e).param),
        }
    }

    /// Whether the request's grammar takes `text` (its markers as special tokens)
    /// token by token, and is complete after it.
    fn takes(&self, body: &Value, text: &str) -> bool {
        let mut c = self.constraint(body).unwrap();
        let ids = self.engine.tokenizer().unwrap().encode_with(text, false);
        let mut logits = vec![0.0f32; self.grammar.grammars().unwrap().vocab()];
        for id in ids {
            logits.fill(0.0);
            if c.mask_logits(&mut logits).is_err() || logits[id as usize] == f32::NEG_INFINITY {
                return false;
            }
            c.commit(id);
        }
        c.accepting()
    }
}

/// A required or named call beside a `response_format`, `regex` or `grammar` (OpenAI
/// takes the pair): the matcher takes the call as it would alone and refuses the format's
/// answer or text before the call, in the `<tool_call>` family and under harmony (where
/// only an analysis may come first); a bad schema beside the call is still refused,
/// naming `response_format`.
#[test]
fn required_calls_beside_a_format_are_the_call() {
    let rf = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}});
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let person = r#"{"name": "Al", "age": 3, "tags": [], "ok": true}"#;
    let weather = r#"{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}"#;
    let now = r#"{"name": "now", "arguments": {}}"#;
    let hermes = Compiled::new(&super::files().mlb, &super::files().chat);
    assert_eq!(hermes.format, krafla::chat::tools::ToolFormat::Hermes);
    let call = |c: &str| format!("<tool_call>\n{c}\n</tool_call>");
    for (choice, shape) in [
        (json!("required"), json!({"response_format": rf})),
        (named.clone(), json!({"regex": "[0-9]+"})),
        (named.clone(), json!({"grammar": "root ::= \"x\""})),
    ] {
        let body = chat(json!({"tools": tools(), "tool_choice": choice}));
        let both = with(&body, &shape);
        for text in [
            call(weather),
            call(now),
            person.to_string(),
            "12".into(),
            "x".into(),
            format!("Sure. {}", call(weather)),
        ] {
            assert_eq!(
                hermes.takes(&both, &text),
                hermes.takes(&body, &text),
                "{both}: {text}"
            );
        }
        assert!(hermes.takes(&both, &call(weather)), "{both}");
        assert!(
            !hermes.takes(&both, person) && !hermes.takes(&both, "12"),
            "{both}"
        );
    }
    let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}});
    let body = chat(json!({"tools": tools(), "tool_choice": "required", "response_format": bad}));
    assert_eq!(
        hermes.constraint(&body).err(),
        Some(Some("response_format".into()))
    );

    let (mlb, mlt) = harmony_files();
    let harmony = Compiled::new(mlb, mlt);
    assert_eq!(harmony.format, krafla::chat::tools::ToolFormat::Harmony);
    let analysis = "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant";
    let to = |name: &str, args: &str| {
        format!("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}")
    };
    let fin = format!("<|channel|>final<|message|>{person}");
    for choice in [json!("required"), named] {
        let body = chat(json!({"tools": tools(), "tool_choice": choice, "response_format": rf}));
        let to_weather = to("get_weather", r#"{"city": "Oslo", "unit": "c"}"#);
        assert!(harmony.takes(&body, &to_weather), "{body}");
        assert!(
            harmony.takes(&body, &format!("{analysis}{to_weather}")),
            "{body}"
        );
        assert_eq!(harmony.takes(&body, &to("now", "{}")), choice == "required");
        assert!(!harmony.takes(&body, &fin), "{body}");
        assert!(!harmony.takes(&body, &format!("{analysis}{fin}")), "{body}");
        // reasoning_effort none, in either place: the call comes first.
        for effort in [
            json!({"reasoning_effort": "none"}),
            json!({"chat_template_kwargs": {"reasoning_effort": "none"}}),
        ] {
            let b = with(&body, &effort);
            assert!(harmony.takes(&b, &to_weather), "{b}");
            assert!(
                !harmony.takes(&b, &format!("{analysis}{to_weather}")),
                "{b}"
            );
        }
    }
}

/// `reasoning_effort` in `chat_template_kwargs` (as transformers' and vLLM's clients
/// pass it) frames a harmony format as the top-level field does: `none` allows no
/// analysis before the final channel; a top-level effort wins over the kwarg.
#[test]
fn reasoning_effort_in_template_kwargs_frames_harmony() {
    let (mlb, mlt) = harmony_files();
    let harmony = Compiled::new(mlb, mlt);
    let analysis = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant";
    let fin = "<|channel|>final<|message|>{\"a\": 1}";
    let none = json!({"reasoning_effort": "none"});
    for (extra, reasons) in [
        (json!({}), true),
        (json!({"chat_template_kwargs": none}), false),
        (
            json!({"reasoning_effort": "low", "chat_template_kwargs": none}),
            true,
        ),
        (
            json!({"reasoning_effort": "none", "chat_template_kwargs": {"reasoning_effort": "high"}}),
            false,
        ),
    ] {
        let body = with(
            &chat(json!({"response_format": {"type": "json_object"}})),
            &extra,
        );
        assert!(harmony.takes(&body, fin), "{body}");
        assert_eq!(
            harmony.takes(&body, &format!("{analysis}{fin}")),
            reasons,
            "{body}"
        );
    }
}

/// Over HTTP: a required or named call beside a format comes back as the call (whole and
/// streamed, no content), in the `<tool_call>` family and under harmony; a bad schema
/// beside it is a 400 naming `response_format`. Under harmony, `reasoning_effort` none
/// in `chat_template_kwargs` answers without reasoning.
#[test]
fn serve_required_calls_beside_a_format_and_kwargs_effort() {
    let rf = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}});
    let s = start(&[]);
    for (choice, shape) in [
        (json!("required"), json!({"response_format": rf})),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            json!({"regex": "[0-9]+"}),
        ),
    ] {
        let body = with(
            &chat(
                json!({"tools": tools(), "tool_choice": choice, "parallel_tool_calls": false, "seed": 2}),
            ),
            &shape,
        );
        let c = answer(&s, &body);
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        assert!(c["message"]["content"].is_null(), "{c}");
        let calls = whole_calls(&c);
        assert_eq!(calls.len(), 1, "{c}");
        check_call(&calls[0].1, &calls[0].2);
        let (streamed, finish) = streamed_calls(&s.stream("/v1/chat/completions", &body));
        assert_eq!(finish, "tool_calls");
        assert_eq!((&streamed[0].1, &streamed[0].2), (&calls[0].1, &calls[0].2));
    }
    let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}});
    let r = s.post(
        "/v1/chat/completions",
        &chat(json!({"tools": tools(), "tool_choice": "required", "response_format": bad}))
            .to_string(),
    );
    let e = r.error(400);
    assert_eq!(e["param"], "response_format", "{e}");
    assert!(e["message"].as_str().unwrap().contains("frobnicate"), "{e}");

    let s = start_harmony();
    let c = answer(
        &s,
        &family_chat(
            json!({"tools": tools(), "tool_choice": "required", "response_format": rf, "seed": 1, "max_tokens": 240}),
        ),
    );
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    assert!(c["message"]["content"].is_null(), "{c}");
    let calls = whole_calls(&c);
    check_call(&calls[0].1, &calls[0].2);
    for seed in 1..=6 {
        let body = family_chat(
            json!({"response_format": rf, "seed": seed, "max_tokens": 240, "chat_template_kwargs": {"reasoning_effort": "none"}}),
        );
        let c = answer(&s, &body);
        assert_eq!(c["finish_reason"], "stop", "{c}");
        assert!(
            c["message"].get("reasoning_content").is_none(),
            "seed {seed}: {c}"
        );
        let v: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        validate(&schema(), &v).unwrap();
    }
}
