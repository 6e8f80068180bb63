//! Chat templates: parity with transformers' `apply_chat_template` on real templates,
//! the chat section of converted `.mlt` files, and mlb-inspect's `--chat`.
//!
//! testdata/chat/ is made by testdata/make_chat_fixtures.py (transformers 5.24): real
//! templates, the conversations, and for each template and conversation the rendered
//! text and ids of `apply_chat_template(tokenize=True)`, or the error it raised.

use crate::util::fixtures::copy_files;
use crate::util::testdata;
use crate::util::tool::{mlb_inspect, tool, Tool};
use chrono::NaiveDateTime;
use flate2::read::GzDecoder;
use krafla::chat::{capture, Chat, ChatError, ChatTemplate, Conversation, Value};
use krafla::format::mlt::{Mlt, FLAG_CHAT};
use krafla::format::mlt_chat::{NamedTemplate, STOP_END_OF_TURN, STOP_EOS};
use krafla::tokenizer::{from_hf, Tokenizer};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

fn chat_dir() -> PathBuf {
    testdata().join("chat")
}

fn gunzip(path: &Path) -> String {
    let mut s = String::new();
    GzDecoder::new(std::fs::File::open(path).expect("fixture present"))
        .read_to_string(&mut s)
        .expect("gzip of UTF-8");
    s
}

/// The tokenizer_config.json (and generation_config.json, if any) of a family.
fn configs(family: &str) -> (String, Option<String>) {
    let own = chat_dir().join(format!("configs/{family}.tokenizer_config.json"));
    let cfg = std::fs::read_to_string(&own).unwrap_or_else(|_| {
        std::fs::read_to_string(
            testdata().join(format!("tokenizers/{family}.tokenizer_config.json")),
        )
        .expect("config present")
    });
    let gen = std::fs::read_to_string(
        chat_dir().join(format!("configs/{family}.generation_config.json")),
    )
    .ok();
    (cfg, gen)
}

/// The tokenizer of `family` converted with its config, with `template` as its chat
/// section (built as mlt-convert builds it), written to bytes and read back.
fn mlt_with_template(family: &str, cfg_family: &str, template: &str) -> Mlt {
    let json = gunzip(&testdata().join(format!("tokenizers/{family}.tokenizer.json.gz")));
    let (cfg, gen) = configs(cfg_family);
    let mut m =
        from_hf::convert(&json, Some(&cfg), &from_hf::HfTokenizerOptions::default()).unwrap();
    let cfg_v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let gen_eos = match gen {
        Some(g) => {
            capture::generation_eos(&serde_json::from_str(&g).unwrap(), m.tokens.len()).unwrap()
        }
        None => Vec::new(),
    };
    let section = capture::build_section(
        &m,
        vec![NamedTemplate {
            name: "default".into(),
            source: template.into(),
        }],
        capture::specials_from_config(Some(&cfg_v)),
        &gen_eos,
        &[],
    )
    .unwrap()
    .expect("a section");
    m.chat = Some(section);
    m.flags |= FLAG_CHAT;
    Mlt::parse(&m.to_bytes().unwrap()).unwrap()
}

fn get(v: &Value, key: &str) -> Value {
    v.get_item(&Value::from(key)).unwrap_or_default()
}

fn read_value(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture present")).unwrap()
}

/// The end-of-turn token each real template must give, by its text.
const END_OF_TURN: &[(&str, &str)] = &[
    ("smollm2", "<|im_end|>"),
    ("qwen3", "<|im_end|>"),
    ("qwen2.5", "<|im_end|>"),
    ("llama3.1", "<|eot_id|>"),
    ("llama3.2", "<|eot_id|>"),
    ("gemma3", "<end_of_turn>"),
    ("gemma3-unsloth", "<end_of_turn>"),
    ("smollm3", "<|im_end|>"),
];

#[test]
fn real_templates_match_transformers() {
    let convs = read_value(&chat_dir().join("conversations.json"));
    let convs: Vec<(String, Value)> = convs
        .try_iter()
        .unwrap()
        .map(|c| (get(&c, "name").to_string(), get(&c, "conversation")))
        .collect();
    assert!(convs.len() >= 40, "{} conversations", convs.len());
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut total = 0;
    for &(name, eot) in END_OF_TURN {
        let (exp, source, now, results) = expected(name);
        let family = get(&exp, "tokenizer").to_string();
        let cfg_family = get(&exp, "config").to_string();
        let m = mlt_with_template(&family, &cfg_family, &source);
        let tok = Tokenizer::from_mlt(&m).unwrap();
        let chat = Chat::from_mlt(&m).unwrap().expect("chat section");
        // The stop set holds the template's end-of-turn token.
        let eot_id = m
            .tokens
            .iter()
            .position(|t| t.bytes == eot.as_bytes())
            .expect("end-of-turn token in vocab") as u32;
        let stop = chat.stop();
        assert!(
            stop.tokens()
                .iter()
                .any(|s| s.id == eot_id && s.sources & STOP_END_OF_TURN != 0),
            "{name}: stop set {:?} lacks {eot} ({eot_id}) as end of turn",
            stop.tokens()
        );
        if let Some(eos) = m.eos {
            assert!(stop
                .tokens()
                .iter()
                .any(|s| s.id == eos && s.sources & STOP_EOS != 0));
        }
        let (mut same, mut errors) = (0, 0);
        for (cname, conv) in &convs {
            total += 1;
            let want = &results[cname];
            let mut c = Conversation::from_value(conv).unwrap();
            c.options.now = Some(now);
            let got = chat.render(&c.messages, &c.options);
            let err = get(want, "error");
            if err.is_undefined() {
                let text = get(want, "text").to_string();
                let ids: Vec<u32> = get(want, "ids")
                    .try_iter()
                    .unwrap()
                    .map(|v| u32::try_from(v).unwrap())
                    .collect();
                match got {
                    Ok(t) if t == text => {
                        let got_ids = chat.encode(&tok, &c.messages, &c.options).unwrap();
                        if got_ids == ids {
                            same += 1;
                        } else {
                            failures.push(format!(
                                "{name}/{cname}: ids differ\n  want {ids:?}\n  got  {got_ids:?}"
                            ));
                        }
                    }
                    Ok(t) => failures.push(format!(
                        "{name}/{cname}: text differs\n  want {text:?}\n  got  {t:?}"
                    )),
                    Err(e) => {
                        failures.push(format!("{name}/{cname}: error {e}, want text {text:?}"))
                    }
                }
            } else {
                errors += 1;
                let msg = get(want, "message").to_string();
                match (err.as_str(), got) {
                    (Some("raised"), Err(ChatError::Raised { message, .. })) if message == msg => {
                        same += 1
                    }
                    (Some("other"), Err(e)) if !matches!(e, ChatError::Raised { .. }) => same += 1,
                    (_, got) => {
                        failures.push(format!("{name}/{cname}: want {err} {msg:?}, got {got:?}"))
                    }
                }
            }
        }
        report.push(format!(
            "{name}: {same}/{} identical ({errors} expected errors)",
            convs.len()
        ));
    }
    eprintln!("chat parity:\n  {}", report.join("\n  "));
    assert!(
        failures.is_empty(),
        "{} of {total} differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A template's committed source and what transformers rendered of it
/// (`expected/{name}.json`): the document, the source, the document's clock and its
/// results by conversation name.
fn expected(name: &str) -> (Value, String, NaiveDateTime, HashMap<String, Value>) {
    let doc = read_value(&chat_dir().join(format!("expected/{name}.json")));
    let source =
        std::fs::read_to_string(chat_dir().join(format!("templates/{name}.jinja"))).unwrap();
    let now =
        NaiveDateTime::parse_from_str(&get(&doc, "now").to_string(), "%Y-%m-%dT%H:%M:%S").unwrap();
    let results = get(&doc, "results")
        .try_iter()
        .unwrap()
        .map(|r| (get(&r, "name").to_string(), r))
        .collect();
    (doc, source, now, results)
}

/// The templates of tokenizers not committed here (gpt-oss, Mistral): the rendered text
/// against transformers' (`apply_chat_template(tokenize=False)`, the model's special-token
/// strings given), no ids.
#[test]
fn text_only_templates_match_transformers() {
    let convs = read_value(&chat_dir().join("conversations.json"));
    let mut failures = Vec::new();
    for name in ["gpt-oss", "mistral-nemo", "mistral-small3.2"] {
        let (exp, source, now, results) = expected(name);
        assert!(get(&exp, "tokenizer").is_none(), "{name}: text only");
        let specials: Vec<(String, String)> = get(&exp, "specials")
            .try_iter()
            .unwrap()
            .map(|k| {
                let v = get(&get(&exp, "specials"), k.as_str().unwrap());
                (k.to_string(), v.to_string())
            })
            .collect();
        let t = ChatTemplate::from_source(&source, &specials).unwrap();
        let mut same = 0;
        for c in convs.try_iter().unwrap() {
            let cname = get(&c, "name").to_string();
            let want = &results[&cname];
            let mut conv = Conversation::from_value(&get(&c, "conversation")).unwrap();
            conv.options.now = Some(now);
            let got = t.render(&conv.messages, &conv.options);
            let err = get(want, "error");
            match (err.as_str(), got) {
                (None, Ok(text)) if text == get(want, "text").to_string() => same += 1,
                (Some("raised"), Err(ChatError::Raised { message, .. }))
                    if message == get(want, "message").to_string() =>
                {
                    same += 1
                }
                (Some("other"), Err(e)) if !matches!(e, ChatError::Raised { .. }) => same += 1,
                (_, got) => failures.push(format!(
                    "{name}/{cname}: want {:?}, got {got:?}",
                    if err.is_undefined() {
                        get(want, "text")
                    } else {
                        err.clone()
                    }
                )),
            }
        }
        eprintln!("{name}: {same} identical");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// gpt-oss's stop set: the template's end of turn is `<|return|>` (its last assistant
/// message ends so), not `<|end|>`, which ends the analysis message before the answer.
#[test]
fn harmony_end_of_turn_is_return() {
    let source = std::fs::read_to_string(chat_dir().join("templates/gpt-oss.jinja")).unwrap();
    let json = gunzip(&testdata().join("tokenizers/smollm2.tokenizer.json.gz"));
    let mut m = from_hf::convert(&json, None, &from_hf::HfTokenizerOptions::default()).unwrap();
    let first = m.tokens.len();
    for t in crate::util::fixtures::HARMONY_MARKERS {
        m.tokens.push(krafla::format::mlt::Token {
            attr: krafla::format::mlt::Attr::Added,
            bytes: t.as_bytes().to_vec(),
        });
    }
    let t = ChatTemplate::from_source(&source, &[]).unwrap();
    assert_eq!(
        capture::end_of_turn(&t, "default", &m),
        Some(first as u32 + 4)
    );
}

/// A chatml-style template over the default tokenizer's added tokens.
const TINY_TEMPLATE: &str = "{% for m in messages %}<|startoftext|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|startoftext|>assistant\n{% endif %}";

/// A folder with the default tokenizer.json and tokenizer_config.json.
fn tokenizer_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = ["tokenizer.json", "tokenizer_config.json"];
    copy_files(&testdata().join("default"), dir.path(), &tokenizer);
    dir
}

/// `mlt-convert tokenizer.json -o t.mlt -q` in `dir`, to add flags to and run.
fn mlt_convert(dir: &Path) -> Tool {
    let mut t = tool("mlt-convert");
    t.current_dir(dir)
        .args(["tokenizer.json", "-o", "t.mlt", "-q"]);
    t
}

fn write(dir: &Path, name: &str, text: &str) {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

#[test]
fn mlt_convert_captures_templates_and_stop_set() {
    let dir = tokenizer_folder();
    let d = dir.path();
    write(d, "chat_template.jinja", TINY_TEMPLATE);
    write(d, "generation_config.json", r#"{"eos_token_id": [2, 0]}"#);
    mlt_convert(d).ok();
    let m = Mlt::load(&d.join("t.mlt")).unwrap();
    assert_ne!(m.flags & FLAG_CHAT, 0);
    let o = mlb_inspect(d, &["t.mlt"]).ok();
    insta::assert_snapshot!("mlt_chat_text", o.stdout);
    let o = mlb_inspect(d, &["t.mlt", "--json"]).ok();
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    insta::assert_json_snapshot!("mlt_chat_json", v["chat"]);

    // --chat prints the ids on one line, --chat-text the text; no BOS is added although
    // this tokenizer prepends one to plain text (add_special_tokens=False).
    write(
        d,
        "conv.json",
        r#"{"messages": [{"role": "user", "content": "Hi <|endoftext|> there"}], "add_generation_prompt": true}"#,
    );
    let o = mlb_inspect(d, &["t.mlt", "--chat", "conv.json", "--chat-text"]).ok();
    let text = o.stdout;
    assert_eq!(
        text,
        "<|startoftext|>user\nHi <|endoftext|> there<|endoftext|>\n<|startoftext|>assistant\n"
    );
    let o = mlb_inspect(d, &["t.mlt", "--chat", "conv.json"]).ok();
    let out = o.stdout;
    assert_eq!(out.lines().count(), 1);
    let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
    let tok = Tokenizer::from_mlt(&m).unwrap();
    let plain = tok.encode(&text);
    assert_eq!(plain[0], 1, "plain encoding starts with BOS");
    assert_eq!(ids, plain[1..], "chat ids are the text's ids without BOS");
    // The special-token text in the content is matched as a token (as transformers does).
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
}

#[test]
fn template_files_take_transformers_precedence() {
    // chat_template.jinja and additional_chat_templates/ win over tokenizer_config.json.
    let dir = tokenizer_folder();
    let d = dir.path();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("tokenizer_config.json")).unwrap())
            .unwrap();
    cfg["chat_template"] = serde_json::json!("CONFIG{{ messages|length }}");
    write(d, "tokenizer_config.json", &cfg.to_string());
    write(d, "chat_template.json", r#"{"chat_template": "LEGACY"}"#);
    let names = |d: &Path| -> Vec<(String, String)> {
        let m = Mlt::load(&d.join("t.mlt")).unwrap();
        m.chat
            .map(|c| {
                c.templates
                    .into_iter()
                    .map(|t| (t.name, t.source))
                    .collect()
            })
            .unwrap_or_default()
    };
    mlt_convert(d).ok();
    assert_eq!(
        names(d),
        [("default".into(), "CONFIG{{ messages|length }}".into())]
    );
    write(d, "chat_template.jinja", "JINJA");
    write(d, "additional_chat_templates/tool_use.jinja", "TOOLS");
    write(d, "additional_chat_templates/notes.txt", "ignored");
    mlt_convert(d).ok();
    assert_eq!(
        names(d),
        [
            ("default".to_string(), "JINJA".to_string()),
            ("tool_use".into(), "TOOLS".into())
        ]
    );
    // The list form of tokenizer_config.json.
    std::fs::remove_file(d.join("chat_template.jinja")).unwrap();
    std::fs::remove_dir_all(d.join("additional_chat_templates")).unwrap();
    cfg["chat_template"] =
        serde_json::json!([{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]);
    write(d, "tokenizer_config.json", &cfg.to_string());
    mlt_convert(d).ok();
    assert_eq!(
        names(d),
        [
            ("default".to_string(), "D".to_string()),
            ("rag".into(), "R".into())
        ]
    );
    // chat_template.json alone (the processor's file) is the last resort.
    cfg.as_object_mut().unwrap().remove("chat_template");
    write(d, "tokenizer_config.json", &cfg.to_string());
    mlt_convert(d).ok();
    assert_eq!(names(d), [("default".to_string(), "LEGACY".to_string())]);
    // --chat-template FILE replaces them; --no-chat writes none.
    write(d, "mine.jinja", TINY_TEMPLATE);
    mlt_convert(d).args(["--chat-template", "mine.jinja"]).ok();
    assert_eq!(
        names(d),
        [("default".to_string(), TINY_TEMPLATE.to_string())]
    );
    mlt_convert(d).args(["--no-chat"]).ok();
    let m = Mlt::load(&d.join("t.mlt")).unwrap();
    assert!(m.chat.is_none() && m.flags & FLAG_CHAT == 0);
    // Without any template the file is exactly what it was before chat sections existed.
    std::fs::remove_file(d.join("chat_template.json")).unwrap();
    mlt_convert(d).ok();
    let without = std::fs::read(d.join("t.mlt")).unwrap();
    mlt_convert(d).args(["--no-chat"]).ok();
    assert_eq!(std::fs::read(d.join("t.mlt")).unwrap(), without);
}

#[test]
fn stop_tokens_and_refusals() {
    let dir = tokenizer_folder();
    let d = dir.path();
    write(d, "chat_template.jinja", TINY_TEMPLATE);
    mlt_convert(d).args(["--stop-token", "<|pad|>"]).ok();
    let m = Mlt::load(&d.join("t.mlt")).unwrap();
    let stop: Vec<(u32, u32)> = m
        .chat
        .unwrap()
        .stop
        .iter()
        .map(|s| (s.id, s.sources))
        .collect();
    assert_eq!(stop, [(0, 8), (2, STOP_EOS | STOP_END_OF_TURN)]);
    // An unknown stop token, a template that does not compile, a bad generation config:
    // one line naming the file, field and value; no output written.
    let cases: &[(&str, &str, &[&str], &str)] = &[
        (
            "chat_template.jinja",
            TINY_TEMPLATE,
            &["--stop-token", "<nope>"],
            "--stop-token = <nope>: no such token",
        ),
        (
            "chat_template.jinja",
            "ok\n{% for %}",
            &[],
            "chat_template.jinja: chat_template 'default' = line 2: does not compile",
        ),
        (
            "generation_config.json",
            r#"{"eos_token_id": [2, 99999]}"#,
            &[],
            "generation_config.json: eos_token_id = 99999: must be a token id below n_vocab (2048)",
        ),
    ];
    for (file, text, extra, want) in cases {
        let dir = tokenizer_folder();
        let d = dir.path();
        write(d, "chat_template.jinja", TINY_TEMPLATE);
        write(d, file, text);
        let e = mlt_convert(d).args(*extra).fails();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(
            e.contains("ML_E_FORMAT") && e.contains(want),
            "{e}\nwant {want}"
        );
        assert!(!d.join("t.mlt").exists());
    }
}

#[test]
fn inspect_chat_errors_name_the_template_line() {
    let dir = tokenizer_folder();
    let d = dir.path();
    write(
        d,
        "chat_template.jinja",
        "{% for m in messages %}\n{% if m.role == 'system' %}\n{{ raise_exception('System role not supported') }}\n{% endif %}{{ m.content }}<|endoftext|>{% endfor %}",
    );
    mlt_convert(d).ok();
    write(
        d,
        "sys.json",
        r#"{"messages": [{"role": "system", "content": "x"}]}"#,
    );
    let e = mlb_inspect(d, &["t.mlt", "--chat", "sys.json"]).fails();
    assert_eq!(
        e,
        "mlb-inspect: t.mlt: chat template 'default' line 3: raise_exception: System role not supported\n"
    );
    write(d, "bad.json", r#"{"messages": [{"content": "x"}]}"#);
    let e = mlb_inspect(d, &["t.mlt", "--chat", "bad.json"]).fails();
    assert!(
        e.starts_with("mlb-inspect: bad.json: messages[0].role"),
        "{}",
        e
    );
    // A file whose template minijinja cannot compile is valid MLT1; the report says why
    // the template is unusable, and --chat fails naming it.
    let mut m = Mlt::load(&d.join("t.mlt")).unwrap();
    m.chat.as_mut().unwrap().templates[0].source = "ok\n{% for %}".into();
    std::fs::write(d.join("bad.mlt"), m.to_bytes().unwrap()).unwrap();
    let o = mlb_inspect(d, &["bad.mlt"]).ok();
    assert!(
        o.stdout
            .contains("      ! chat template 'default' line 2: does not compile"),
        "{}",
        o.stdout
    );
    let e = mlb_inspect(d, &["bad.mlt", "--chat", "sys.json"]).fails();
    assert!(
        e.starts_with("mlb-inspect: bad.mlt: chat template 'default' line 2: does not compile"),
        "{}",
        e
    );
    // A tokenizer without a chat section says so.
    mlt_convert(d).args(["--no-chat"]).ok();
    write(
        d,
        "ok.json",
        r#"{"messages": [{"role": "user", "content": "x"}]}"#,
    );
    let e = mlb_inspect(d, &["t.mlt", "--chat", "ok.json"]).fails();
    assert!(e.contains("has none"), "{e}");
}

/// The default render budget (issue 42) is far above what real templates need: each
/// real template renders a 2,000-message conversation (about 32k tokens of text, a
/// system prompt, alternating turns) with a tenth of the default fuel.
#[test]
fn a_long_conversation_renders_well_within_the_budget() {
    use krafla::chat::budget::DEFAULT_FUEL;
    use krafla::chat::{ChatTemplate, Message, RenderBudget, RenderOptions};
    let mut msgs = vec![Message::new("system", "You are a helpful assistant.")];
    for i in 0..2000 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        msgs.push(Message::new(
            role,
            &format!("message {i}: the quick brown fox jumps over the lazy dog {i}."),
        ));
    }
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let specials = [
        ("bos_token".to_string(), "<s>".to_string()),
        ("eos_token".to_string(), "</s>".to_string()),
    ];
    for e in std::fs::read_dir(chat_dir().join("templates")).unwrap() {
        let path = e.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        let mut t = ChatTemplate::from_source(&src, &specials).unwrap();
        t.set_budget(RenderBudget {
            fuel: DEFAULT_FUEL / 10,
            ..RenderBudget::default()
        });
        let text = t
            .render(&msgs, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(text.len() > 100_000, "{}", path.display());
    }
}
