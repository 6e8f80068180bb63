//! Constrained decoding (`krafla::session::constraint`) on a model with random weights
//! and the bundled tokenizer: whatever the model prefers, every generation matches its
//! grammar (JSON schemas validated, regexes, Lark and GBNF grammars, tool calls), bad
//! grammars are refused naming the problem, and masks computed on another thread (as
//! the server does during the forward pass) give the same tokens.

use std::sync::Arc;

use serde_json::{json, Value};

use krafla::chat::tools::{self, ToolFormat, ToolSpec};
use krafla::format::mlb::Mlb;
use krafla::model::{Packs, SamplerOptions, StateOptions};
use krafla::session::constraint::{call_json_options, BODY};
use krafla::session::{
    ConstraintError, Engine, GenerateOptions, Generator, Grammar, Grammars, StopReason,
};
use krafla::synth::{synth_file, tiny_header};
use krafla::tokenizer::{from_hf, Tokenizer};

use crate::util::fixtures::HARMONY_MARKERS;
use crate::util::schema::validate;
use crate::util::testdata;

/// The bundled tokenizer's `<|endoftext|>`: its EOS, the stop id here.
const EOS: u32 = 2;

/// A random model over the bundled tokenizer's 2,048 ids, and its grammar compiler.
fn setup() -> (Arc<Engine>, Grammars) {
    setup_with(&[])
}

/// [`setup`] with `added` as special tokens after the bundled tokenizer's ids (the
/// model's vocabulary grown to hold them).
fn setup_with(added: &[&str]) -> (Arc<Engine>, Grammars) {
    let dir = testdata().join("default");
    let json = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let mut mlt =
        from_hf::convert(&json, Some(&cfg), &from_hf::HfTokenizerOptions::default()).unwrap();
    for t in added {
        mlt.tokens.push(krafla::format::mlt::Token {
            attr: krafla::format::mlt::Attr::Added,
            bytes: t.as_bytes().to_vec(),
        });
    }
    let tok = Tokenizer::from_mlt(&mlt).unwrap();
    assert_eq!(tok.eos(), Some(EOS));
    let mut h = tiny_header();
    h.vocab = 2048 + added.len() as u32;
    h.max_seq = 256;
    let mlb = Mlb::from_bytes(&synth_file(&h, &[], 7)).unwrap();
    let engine = Arc::new(Engine::new(mlb, Packs::none(), Some(tok)).unwrap());
    let grammars = Grammars::new(engine.clone(), &[EOS]).unwrap();
    (engine, grammars)
}

/// Generates from a short prompt under `g` with sampling seed `seed` (temperature 1:
/// the random model's own choices, masked); `threaded`: each next mask is computed on
/// another thread while the model runs, as mlb-serve does.
fn generate(
    e: &Engine,
    gs: &Grammars,
    g: &Grammar,
    seed: u64,
    max_tokens: usize,
    threaded: bool,
) -> (String, Vec<u32>, StopReason) {
    let mut s = e.session(&StateOptions::default()).unwrap();
    s.feed(&e.encode("The answer:").unwrap()).unwrap();
    let opts = GenerateOptions {
        max_tokens,
        sampling: SamplerOptions {
            temp: 1.0,
            seed,
            ..SamplerOptions::default()
        },
        stop_ids: vec![EOS],
        ..GenerateOptions::default()
    };
    let mut gen = Generator::new(e, opts)
        .unwrap()
        .with_constraint(gs.compile(g).unwrap());
    loop {
        let step = gen.step(&s).unwrap();
        if step.stop.is_some() {
            break;
        }
        if threaded {
            let c = gen.constraint_mut().unwrap();
            std::thread::scope(|sc| {
                sc.spawn(|| c.prepare());
                s.feed(&[step.id]).unwrap();
            });
        } else {
            s.feed(&[step.id]).unwrap();
        }
    }
    let out = gen.finish();
    (out.text, out.tokens, out.stop)
}

#[test]
fn json_schemas_are_always_valid() {
    let (e, gs) = setup();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "kind": {"$ref": "#/$defs/kind"}
        },
        "required": ["name", "age", "tags", "ok", "kind"],
        "additionalProperties": false,
        "$defs": {"kind": {"anyOf": [{"const": "x"}, {"type": "null"}]}}
    });
    let g = Grammar::JsonSchema {
        schema: schema.clone(),
        strict: true,
    };
    for seed in 1..=8 {
        let (text, _, stop) = generate(&e, &gs, &g, seed, 200, false);
        assert_eq!(stop, StopReason::StopId(EOS), "seed {seed}: {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|err| panic!("{err}: {text:?}"));
        validate(&schema, &v).unwrap_or_else(|err| panic!("seed {seed}: {err}: {text}"));
    }
    for seed in 1..=4 {
        let (text, _, _) = generate(&e, &gs, &Grammar::JsonObject, seed, 200, false);
        // A random model rarely closes an open object in 200 tokens: check what came.
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            assert!(v.is_object(), "{text}");
        } else {
            assert!(text.starts_with('{'), "{text:?}");
        }
    }
}

/// Whether a generated text is what its grammar allows.
type Check = dyn Fn(&str) -> bool;

#[test]
fn regexes_lark_and_gbnf_grammars_match() {
    let (e, gs) = setup();
    let is_code = |t: &str| {
        let b = t.as_bytes();
        b.len() >= 5
            && b[..3].iter().all(|c| (b'a'..=b'c').contains(c))
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit)
            && b.len() <= 7
    };
    let cases: Vec<(Grammar, Box<Check>)> = vec![
        (Grammar::Regex("[a-c]{3}-[0-9]{1,3}".into()), Box::new(is_code)),
        (
            Grammar::Lark("%llguidance {}\nstart: \"id=\" NUM (\",\" NUM)*\nNUM: /[0-9]{1,2}/\n".into()),
            Box::new(|t: &str| {
                t.strip_prefix("id=").is_some_and(|r| {
                    r.split(',')
                        .all(|n| (1..=2).contains(&n.len()) && n.bytes().all(|c| c.is_ascii_digit()))
                })
            }),
        ),
        (
            Grammar::from_text(
                "root ::= greet \" \" name\ngreet ::= \"hi\" | \"yo\" # two\nname ::= [A-Z] [a-z]{1,5}\n",
            ),
            Box::new(|t: &str| {
                let (g, n) = t.split_once(' ').unwrap_or(("", ""));
                ["hi", "yo"].contains(&g)
                    && n.chars().next().is_some_and(|c| c.is_ascii_uppercase())
                    && (2..=6).contains(&n.len())
                    && n.chars().skip(1).all(|c| c.is_ascii_lowercase())
            }),
        ),
    ];
    assert!(matches!(cases[2].0, Grammar::Gbnf(_)));
    for (g, ok) in &cases {
        for seed in 1..=5 {
            let (text, _, stop) = generate(&e, &gs, g, seed, 60, false);
            assert!(ok(&text), "{g:?} seed {seed}: {text:?} ({stop:?})");
        }
    }
}

#[test]
fn masks_made_on_another_thread_give_the_same_tokens() {
    let (e, gs) = setup();
    let g = Grammar::JsonSchema {
        schema: json!({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 5}}, "required": ["n", "s"]}),
        strict: false,
    };
    for seed in [3, 4] {
        let a = generate(&e, &gs, &g, seed, 80, false);
        let b = generate(&e, &gs, &g, seed, 80, true);
        assert_eq!(a, b, "seed {seed}");
    }
}

#[test]
fn required_tool_calls_always_parse() {
    let (e, gs) = setup();
    let specs = vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false}),
            strict: true,
        },
        ToolSpec {
            name: "now".into(),
            parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}),
            strict: false,
        },
    ];
    for format in [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::MistralJson,
        ToolFormat::MistralArgs,
        ToolFormat::Harmony,
    ] {
        // One call: a random model writes whitespace and calls until its length runs out.
        let lark = tools::call_grammar(
            format,
            &specs,
            false,
            call_json_options(),
            |t| gs.has_special(t),
            100,
        );
        for seed in 1..=5 {
            let (text, _, stop) = generate(&e, &gs, &Grammar::Lark(lark.clone()), seed, 200, false);
            assert_eq!(stop, StopReason::StopId(EOS), "{format:?} {seed}: {text:?}");
            let names = specs.iter().map(|s| s.name.clone()).collect();
            let (content, calls) = tools::parse(format, names, &text);
            assert!(
                content.is_none() && !calls.is_empty(),
                "{format:?}: {text:?}"
            );
            for c in calls {
                let spec = specs
                    .iter()
                    .find(|s| s.name == c.name)
                    .expect("a known tool");
                let args: Value = serde_json::from_str(&c.arguments).unwrap();
                validate(&spec.parameters, &args).unwrap();
            }
        }
    }
}

#[test]
fn bad_grammars_are_refused_naming_the_problem() {
    let (_e, gs) = setup();
    for (g, kind, what) in [
        (
            Grammar::JsonSchema {
                schema: json!({"type": "frobnicate"}),
                strict: true,
            },
            "json_schema",
            "frobnicate",
        ),
        (
            Grammar::JsonSchema {
                schema: json!([1]),
                strict: true,
            },
            "json_schema",
            "must be an object",
        ),
        (Grammar::Regex("[a-".into()), "regex", ""),
        (
            Grammar::Lark("start: undefined_rule".into()),
            "lark",
            "undefined_rule",
        ),
        (
            Grammar::Gbnf("root ::= nope".into()),
            "gbnf",
            "'nope' is used but not defined",
        ),
    ] {
        match gs.compile(&g) {
            Err(ConstraintError::Grammar { kind: k, message }) => {
                assert_eq!(k, kind, "{g:?}");
                assert!(message.contains(what), "{g:?}: {message}");
            }
            Err(other) => panic!("{g:?}: {other}"),
            Ok(_) => panic!("{g:?} compiled"),
        }
    }
}

/// A harmony reply under a JSON schema, with the markers as special tokens (as
/// gpt-oss's tokenizer has them): `reasoning` tokens of analysis at most.
fn harmony_answer(gs: &Grammars, schema: &Value, reasoning: usize) -> Grammar {
    let frame = tools::answer_grammar(
        ToolFormat::Harmony,
        BODY,
        true,
        &[],
        call_json_options(),
        |t| gs.has_special(t),
        reasoning,
    )
    .unwrap();
    Grammar::Framed {
        frame,
        body: Box::new(Grammar::JsonSchema {
            schema: schema.clone(),
            strict: true,
        }),
    }
}

/// Whether the matcher of `g` takes `text` (its markers as the special tokens) token by
/// token, then the stop token.
fn takes(e: &Engine, gs: &Grammars, g: &Grammar, text: &str) -> bool {
    let ids = e.tokenizer().unwrap().encode_with(text, false);
    let mut c = gs.compile(g).unwrap();
    let mut logits = vec![0.0f32; gs.vocab()];
    for id in ids.into_iter().chain([EOS]) {
        logits.fill(0.0);
        if c.mask_logits(&mut logits).is_err() || logits[id as usize] == f32::NEG_INFINITY {
            return false;
        }
        c.commit(id);
    }
    true
}

/// The content and reasoning of a harmony reply, as mlb-serve reads it.
fn harmony_parts(text: &str) -> (String, String) {
    let mut p = tools::ToolParser::new(ToolFormat::Harmony, vec![], false);
    let mut evs = p.push(text);
    evs.extend(p.finish());
    let (mut content, mut reasoning) = (String::new(), String::new());
    for ev in evs {
        match ev {
            tools::ToolEvent::Content(t) => content.push_str(&t),
            tools::ToolEvent::Reasoning(t) => reasoning.push_str(&t),
            other => panic!("{other:?} in {text:?}"),
        }
    }
    (content, reasoning)
}

/// Under a harmony template a format constrains the final channel's content: at most
/// one analysis message (bounded), then `<|start|>assistant<|channel|>final<|message|>`
/// and the JSON; JSON outside the final channel, a malformed or invalid final, a second
/// analysis are refused. A random model's replies read as content that validates.
#[test]
fn harmony_answers_are_constrained_to_the_final_channel() {
    let (e, gs) = setup_with(&HARMONY_MARKERS);
    assert!(gs.has_special("<|channel|>") && gs.has_special("<|end|>"));
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"], "additionalProperties": false});
    let g = harmony_answer(&gs, &schema, 8);
    let analysis = "<|channel|>analysis<|message|>Need a.\n<|end|><|start|>assistant";
    let fin = "<|channel|>final<|message|>";
    for text in [
        format!("{analysis}{fin}{{\"a\": 1}}"),
        format!("{fin}{{\"a\": 1}}"),
        "<|channel|>final <|constrain|>json<|message|>{\"a\": 2}".to_string(),
    ] {
        assert!(takes(&e, &gs, &g, &text), "{text}");
    }
    for text in [
        "{\"a\": 1}".to_string(),
        "<|channel|>analysis<|message|>{\"a\": 1}<|end|>".to_string(),
        format!("{analysis}{{\"a\": 1}}"),
        format!("{analysis}{fin}{{\"a\": }}"),
        format!("{fin}{{\"a\": \"x\"}}"),
        format!("{fin}{{\"a\": 1}} and more"),
        format!("{fin}{{\"a\": 1}}<|end|>"),
        "<|channel|>commentary<|message|>{\"a\": 1}".to_string(),
        format!("{analysis}{analysis}{fin}{{\"a\": 1}}"),
        // Longer than the 8 tokens of analysis allowed.
        format!(
            "<|channel|>analysis<|message|>{}<|end|><|start|>assistant{fin}{{\"a\": 1}}",
            "think ".repeat(20)
        ),
    ] {
        assert!(!takes(&e, &gs, &g, &text), "{text}");
    }
    // No reasoning (reasoning_effort none): the final channel first.
    let none = harmony_answer(&gs, &schema, 0);
    assert!(takes(&e, &gs, &none, &format!("{fin}{{\"a\": 1}}")));
    assert!(!takes(
        &e,
        &gs,
        &none,
        &format!("{analysis}{fin}{{\"a\": 1}}")
    ));

    let g = harmony_answer(&gs, &schema, 30);
    let mut reasoned = 0;
    for seed in 1..=6 {
        let (text, _, stop) = generate(&e, &gs, &g, seed, 120, false);
        assert_eq!(stop, StopReason::StopId(EOS), "seed {seed}: {text:?}");
        let (content, reasoning) = harmony_parts(&text);
        let v: Value =
            serde_json::from_str(&content).unwrap_or_else(|err| panic!("{err}: {text:?}"));
        validate(&schema, &v).unwrap_or_else(|err| panic!("seed {seed}: {err}: {text}"));
        reasoned += usize::from(text.starts_with("<|channel|>analysis"));
        assert_eq!(
            reasoning.is_empty(),
            !text.starts_with("<|channel|>analysis"),
            "{text:?}"
        );
    }
    // The random model takes either way; both are exercised.
    assert!((1..6).contains(&reasoned), "{reasoned} of 6 reasoned");
}
