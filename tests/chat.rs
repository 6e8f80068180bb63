//! Chat templates: parity with transformers' `apply_chat_template` on real templates,
//! the chat section of converted `.mlt` files, and mlb-inspect's `--chat`.
//!
//! testdata/chat/ is made by testdata/make_chat_fixtures.py (transformers 5.24): real
//! templates, the conversations, and for each template and conversation the rendered
//! text and ids of `apply_chat_template(tokenize=True)`, or the error it raised.

use crate::util::{run_in, stderr, stdout, testdata};
use flate2::read::GzDecoder;
use krafla::chat::{capture, Chat, ChatError, Conversation, Value};
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
        std::fs::read_to_string(testdata().join(format!("tokenizers/{family}.tokenizer_config.json")))
            .expect("config present")
    });
    let gen = std::fs::read_to_string(chat_dir().join(format!("configs/{family}.generation_config.json"))).ok();
    (cfg, gen)
}

/// The tokenizer of `family` converted with its config, with `template` as its chat
/// section (built as mlt-convert builds it), written to bytes and read back.
fn mlt_with_template(family: &str, cfg_family: &str, template: &str) -> Mlt {
    let json = gunzip(&testdata().join(format!("tokenizers/{family}.tokenizer.json.gz")));
    let (cfg, gen) = configs(cfg_family);
    let mut m = from_hf::convert(&json, Some(&cfg), &from_hf::Options::default()).unwrap();
    let cfg_v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let gen_eos = match gen {
        Some(g) => capture::generation_eos(&serde_json::from_str(&g).unwrap(), m.tokens.len()).unwrap(),
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
        let exp = read_value(&chat_dir().join(format!("expected/{name}.json")));
        let source = std::fs::read_to_string(chat_dir().join(format!("templates/{name}.jinja"))).unwrap();
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
            stop.tokens().iter().any(|s| s.id == eot_id && s.sources & STOP_END_OF_TURN != 0),
            "{name}: stop set {:?} lacks {eot} ({eot_id}) as end of turn",
            stop.tokens()
        );
        if let Some(eos) = m.eos {
            assert!(stop.tokens().iter().any(|s| s.id == eos && s.sources & STOP_EOS != 0));
        }
        let now = chrono::NaiveDateTime::parse_from_str(&get(&exp, "now").to_string(), "%Y-%m-%dT%H:%M:%S").unwrap();
        let results: HashMap<String, Value> = get(&exp, "results")
            .try_iter()
            .unwrap()
            .map(|r| (get(&r, "name").to_string(), r))
            .collect();
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
                            failures.push(format!("{name}/{cname}: ids differ\n  want {ids:?}\n  got  {got_ids:?}"));
                        }
                    }
                    Ok(t) => failures.push(format!("{name}/{cname}: text differs\n  want {text:?}\n  got  {t:?}")),
                    Err(e) => failures.push(format!("{name}/{cname}: error {e}, want text {text:?}")),
                }
            } else {
                errors += 1;
                let msg = get(want, "message").to_string();
                match (err.as_str(), got) {
                    (Some("raised"), Err(ChatError::Raised { message, .. })) if message == msg => same += 1,
                    (Some("other"), Err(e)) if !matches!(e, ChatError::Raised { .. }) => same += 1,
                    (_, got) => failures.push(format!("{name}/{cname}: want {err} {msg:?}, got {got:?}")),
                }
            }
        }
        report.push(format!("{name}: {same}/{} identical ({errors} expected errors)", convs.len()));
    }
    eprintln!("chat parity:\n  {}", report.join("\n  "));
    assert!(failures.is_empty(), "{} of {total} differ:\n{}", failures.len(), failures.join("\n"));
}
