//! Capture: the chat section of an `.mlt` from the files of a Hugging Face folder.
//!
//! Templates, in transformers' order of precedence for a tokenizer (5.24,
//! `PreTrainedTokenizerBase._from_pretrained`): `chat_template.jinja` (the default)
//! and `additional_chat_templates/NAME.jinja` win over tokenizer_config.json's
//! `chat_template` (a string, or a list of `{name, template}`). A tokenizer never reads
//! `chat_template.json`, the processor's older file; it is used only when neither of
//! the others gives a template (a processor would read it).
//!
//! The special-token strings are tokenizer_config.json's `bos_token`, `eos_token`,
//! `unk_token`, `sep_token`, `pad_token`, `cls_token` and `mask_token` (transformers'
//! `special_tokens_map`), with `--bos`/`--eos` replacing the first two.
//!
//! The stop set: the tokenizer's EOS; every id of generation_config.json's
//! `eos_token_id`; and each template's **end-of-turn token**: the template renders
//! `[user, assistant]` probe messages, and the added token written right after the
//! assistant's text (skipping whitespace that is not itself a token) is the one that
//! ends an assistant turn (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`). Tokens the
//! template writes elsewhere (`<|im_start|>`, headers) are not stop tokens.

use super::conversation::{Message, RenderOptions};
use super::error::ChatError;
use super::template::ChatTemplate;
use crate::format::mlt::{Attr, Mlt, FLAG_CHAT};
use crate::format::mlt_chat::{
    ChatSection, NamedTemplate, StopToken, DEFAULT_TEMPLATE, STOP_END_OF_TURN, STOP_EOS,
    STOP_GENERATION_CONFIG, STOP_GIVEN,
};
use crate::format::{FormatError, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// transformers' named special tokens, in its order.
pub const SPECIAL_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

const PROBE_USER: &str = "Krafla probe question";
const PROBE_ANSWER: &str = "Krafla probe answer";

/// Chat options of `mlt-convert`.
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Write no chat section.
    pub disable: bool,
    /// A template file (raw Jinja) replacing the folder's templates as `default`.
    pub template_file: Option<PathBuf>,
    /// Token texts added to the stop set.
    pub stop_tokens: Vec<String>,
}

/// Where a template came from, for error messages.
#[derive(Debug, Clone)]
pub struct FoundTemplate {
    pub template: NamedTemplate,
    pub file: PathBuf,
}

/// Templates read from one file.
fn found_in(templates: Vec<NamedTemplate>, file: &Path) -> Vec<FoundTemplate> {
    templates
        .into_iter()
        .map(|template| FoundTemplate {
            template,
            file: file.to_path_buf(),
        })
        .collect()
}

fn read_opt(path: &Path) -> Result<Option<String>> {
    match std::fs::read(path) {
        Ok(b) => String::from_utf8(b).map(Some).map_err(|e| {
            FormatError::format(
                "file",
                format!("byte {}", e.utf8_error().valid_up_to()),
                "not UTF-8",
            )
            .in_file(path)
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(FormatError::io(path, &e)),
    }
}

fn parse_json(path: &Path, text: &str) -> Result<Value> {
    serde_json::from_str(text)
        .map_err(|e| FormatError::format("file", "", format!("not JSON: {e}")).in_file(path))
}

/// The templates of tokenizer_config.json's `chat_template` value.
pub fn templates_from_config(v: &Value) -> Result<Vec<NamedTemplate>> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(vec![NamedTemplate {
            name: DEFAULT_TEMPLATE.into(),
            source: s.clone(),
        }]),
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let name = e.get("name").and_then(Value::as_str);
                let source = e.get("template").and_then(Value::as_str);
                match (name, source) {
                    (Some(n), Some(s)) => Ok(NamedTemplate {
                        name: n.to_string(),
                        source: s.to_string(),
                    }),
                    _ => Err(FormatError::format(
                        format!("chat_template[{i}]"),
                        truncate(&e.to_string()),
                        "each entry must be {\"name\": string, \"template\": string}",
                    )),
                }
            })
            .collect(),
        other => Err(FormatError::format(
            "chat_template",
            truncate(&other.to_string()),
            "must be a string or a list of {name, template}",
        )),
    }
}

fn truncate(s: &str) -> String {
    let mut end = s.len().min(80);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    if end < s.len() {
        format!("{}...", &s[..end])
    } else {
        s.to_string()
    }
}

/// Finds the chat templates beside `tokenizer.json` in `dir` (precedence in the
/// module docs); `config` is tokenizer_config.json, when present.
pub fn find_templates(dir: &Path, config: Option<(&Path, &Value)>) -> Result<Vec<FoundTemplate>> {
    let mut found = Vec::new();
    let jinja = dir.join("chat_template.jinja");
    if let Some(s) = read_opt(&jinja)? {
        found.push(FoundTemplate {
            template: NamedTemplate {
                name: DEFAULT_TEMPLATE.into(),
                source: s,
            },
            file: jinja,
        });
    }
    let extra_dir = dir.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let mut extra = Vec::new();
        let entries = std::fs::read_dir(&extra_dir).map_err(|e| FormatError::io(&extra_dir, &e))?;
        for entry in entries {
            let path = entry.map_err(|e| FormatError::io(&extra_dir, &e))?.path();
            let Some(stem) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jinja"))
            else {
                continue;
            };
            if let Some(s) = read_opt(&path)? {
                extra.push(FoundTemplate {
                    template: NamedTemplate {
                        name: stem.to_string(),
                        source: s,
                    },
                    file: path.clone(),
                });
            }
        }
        // Directory order is arbitrary: sort so the output is deterministic.
        extra.sort_by(|a, b| a.template.name.cmp(&b.template.name));
        found.retain(|f: &FoundTemplate| !extra.iter().any(|e| e.template.name == f.template.name));
        found.extend(extra);
    }
    if !found.is_empty() {
        return Ok(found);
    }
    if let Some((path, cfg)) = config {
        if let Some(v) = cfg.get("chat_template") {
            let t = templates_from_config(v).map_err(|e| e.in_file(path))?;
            return Ok(found_in(t, path));
        }
    }
    let legacy = dir.join("chat_template.json");
    if let Some(s) = read_opt(&legacy)? {
        let v = parse_json(&legacy, &s)?;
        let t = templates_from_config(v.get("chat_template").unwrap_or(&Value::Null))
            .map_err(|e| e.in_file(&legacy))?;
        return Ok(found_in(t, &legacy));
    }
    Ok(Vec::new())
}

/// tokenizer_config.json's named special tokens (a string or `{"content": ...}`).
pub fn specials_from_config(config: Option<&Value>) -> Vec<(String, String)> {
    let Some(cfg) = config else {
        return Vec::new();
    };
    SPECIAL_NAMES
        .iter()
        .filter_map(|&name| {
            let v = cfg.get(name)?;
            let text = v
                .as_str()
                .or_else(|| v.get("content").and_then(Value::as_str))?;
            Some((name.to_string(), text.to_string()))
        })
        .collect()
}

/// generation_config.json's `eos_token_id`: an int, a list of ints, or absent.
pub fn generation_eos(v: &Value, n_vocab: usize) -> Result<Vec<u32>> {
    let ids: Vec<&Value> = match v.get("eos_token_id") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().collect(),
        Some(x) => vec![x],
    };
    ids.into_iter()
        .map(|x| {
            x.as_u64()
                .filter(|&i| (i as usize) < n_vocab)
                .map(|i| i as u32)
                .ok_or_else(|| {
                    FormatError::format(
                        "eos_token_id",
                        x,
                        format!("must be a token id below n_vocab ({n_vocab})"),
                    )
                })
        })
        .collect()
}

/// The id of a token given by its text: an added token, else a vocabulary piece.
fn token_id(m: &Mlt, text: &str) -> Option<u32> {
    let find = |want: Attr| {
        m.tokens
            .iter()
            .position(|t| t.attr == want && t.bytes == text.as_bytes())
    };
    find(Attr::Added)
        .or_else(|| find(Attr::Normal))
        .map(|i| i as u32)
}

/// The end-of-turn token of a template: the added token it writes right after an
/// assistant message's text (None if the probe does not render or no added token
/// follows the text).
pub fn end_of_turn(template: &ChatTemplate, name: &str, m: &Mlt) -> Option<u32> {
    let probe = [
        Message::new("user", PROBE_USER),
        Message::new("assistant", PROBE_ANSWER),
    ];
    let opts = RenderOptions {
        template: Some(name.to_string()),
        ..Default::default()
    };
    let text = template.render(&probe, &opts).ok()?;
    let at = text.rfind(PROBE_ANSWER)? + PROBE_ANSWER.len();
    let mut rest = &text[at..];
    loop {
        // The longest added token at this point, ignoring whitespace-only ones
        // (Gemma's "\n" is a token, but it is layout, not an end of turn).
        let best = m
            .tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| {
                t.attr == Attr::Added
                    && !t.bytes.is_empty()
                    && rest.as_bytes().starts_with(&t.bytes)
                    && !t.bytes.iter().all(u8::is_ascii_whitespace)
            })
            .max_by_key(|(_, t)| t.bytes.len());
        if let Some((id, _)) = best {
            return Some(id as u32);
        }
        let c = rest.chars().next()?;
        if !c.is_whitespace() {
            return None;
        }
        rest = &rest[c.len_utf8()..];
    }
}

/// The field of a template's compile error: `chat_template 'NAME'`.
fn template_field(name: &str) -> String {
    format!("chat_template '{name}'")
}

/// Builds the chat section from its parts: `templates` (each compiled, to refuse one
/// that does not compile, naming it: field `chat_template 'NAME'`), `specials`, the
/// generation config's EOS ids (checked below n_vocab by the caller) and `stop_tokens`
/// given by text. `None` when there is no template. A GGUF reader can call this with
/// `tokenizer.chat_template` and its EOS id.
pub fn build_section(
    m: &Mlt,
    templates: Vec<NamedTemplate>,
    specials: Vec<(String, String)>,
    generation_eos: &[u32],
    stop_tokens: &[String],
) -> Result<Option<ChatSection>> {
    if templates.is_empty() {
        return Ok(None);
    }
    let mut section = ChatSection {
        templates,
        specials,
        stop: Vec::new(),
    };
    for t in &section.templates {
        if let Err(e) = ChatTemplate::new(&ChatSection {
            templates: vec![t.clone()],
            ..Default::default()
        }) {
            let (line, msg) = match &e {
                ChatError::Syntax { line, message, .. } => (*line, message.clone()),
                other => (None, other.to_string()),
            };
            return Err(FormatError::format(
                template_field(&t.name),
                line.map(|l| format!("line {l}")).unwrap_or_default(),
                format!(
                    "does not compile ({msg}); convert with --no-chat, or give one with --chat-template FILE"
                ),
            ));
        }
    }
    // Names, sizes and specials are checked before the templates are compiled together.
    section.validate(m.tokens.len() as u32)?;
    let compiled = ChatTemplate::new(&section)
        .map_err(|e| FormatError::format("chat_template", "", e.to_string()))?;
    let mut stop: Vec<StopToken> = Vec::new();
    let mut add = |id: u32, sources: u32| match stop.iter_mut().find(|s| s.id == id) {
        Some(s) => s.sources |= sources,
        None => stop.push(StopToken { id, sources }),
    };
    if let Some(eos) = m.eos {
        add(eos, STOP_EOS);
    }
    for &id in generation_eos {
        add(id, STOP_GENERATION_CONFIG);
    }
    for t in &section.templates {
        if let Some(id) = end_of_turn(&compiled, &t.name, m) {
            add(id, STOP_END_OF_TURN);
        }
    }
    for text in stop_tokens {
        let id = token_id(m, text)
            .ok_or_else(|| FormatError::format("--stop-token", text, "no such token"))?;
        add(id, STOP_GIVEN);
    }
    stop.sort_by_key(|s| s.id);
    section.stop = stop;
    section.validate(m.tokens.len() as u32)?;
    Ok(Some(section))
}

/// Reads the chat files beside `input` (tokenizer.json) and attaches the chat section
/// to `m` (setting the chat flag); leaves `m` without one when there is no template or
/// `opts.disable`. `config` is tokenizer_config.json's path and text, when present;
/// `bos`/`eos` override its bos_token/eos_token strings.
pub fn attach(
    m: &mut Mlt,
    input: &Path,
    config: Option<(&Path, &str)>,
    bos: Option<&str>,
    eos: Option<&str>,
    opts: &ChatOptions,
) -> Result<()> {
    m.chat = None;
    m.flags &= !FLAG_CHAT;
    if opts.disable {
        return Ok(());
    }
    let dir = input.parent().unwrap_or(Path::new("."));
    let config: Option<(&Path, Value)> = match config {
        Some((p, text)) => Some((p, parse_json(p, text)?)),
        None => None,
    };
    let found = match &opts.template_file {
        Some(f) => {
            let source = read_opt(f)?.ok_or_else(|| {
                FormatError::io(f, &std::io::Error::from(std::io::ErrorKind::NotFound))
            })?;
            vec![FoundTemplate {
                template: NamedTemplate {
                    name: DEFAULT_TEMPLATE.into(),
                    source,
                },
                file: f.clone(),
            }]
        }
        None => find_templates(dir, config.as_ref().map(|(p, v)| (*p, v)))?,
    };
    let mut specials = specials_from_config(config.as_ref().map(|(_, v)| v));
    for (name, value) in [("bos_token", bos), ("eos_token", eos)] {
        if let Some(v) = value {
            specials.retain(|(n, _)| n != name);
            specials.push((name.to_string(), v.to_string()));
        }
    }
    specials.sort_by_key(|(n, _)| SPECIAL_NAMES.iter().position(|s| s == n));
    let gen_path = dir.join("generation_config.json");
    let gen_eos = match read_opt(&gen_path)? {
        Some(text) => generation_eos(&parse_json(&gen_path, &text)?, m.tokens.len())
            .map_err(|e| e.in_file(&gen_path))?,
        None => Vec::new(),
    };
    let files: Vec<(String, PathBuf)> = found
        .iter()
        .map(|f| (template_field(&f.template.name), f.file.clone()))
        .collect();
    let templates = found.into_iter().map(|f| f.template).collect();
    match build_section(m, templates, specials, &gen_eos, &opts.stop_tokens) {
        Ok(Some(section)) => {
            m.chat = Some(section);
            m.flags |= FLAG_CHAT;
            Ok(())
        }
        Ok(None) if !opts.stop_tokens.is_empty() => Err(FormatError::format(
            "--stop-token",
            &opts.stop_tokens[0],
            "a stop set is written with a chat template; none was found (give one with --chat-template FILE)",
        )
        .in_file(input)),
        Ok(None) => Ok(()),
        // A template's error names the file it came from.
        Err(e) => Err(match files.iter().find(|(field, _)| *field == e.field) {
            Some((_, f)) => e.in_file(f),
            None => e.in_file(input),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mlt::{Kind, Token};

    fn mlt(added: &[&str]) -> Mlt {
        let mut tokens: Vec<Token> = (0..=255u8)
            .map(|b| Token {
                attr: Attr::Normal,
                bytes: vec![b],
            })
            .collect();
        for a in added {
            tokens.push(Token {
                attr: Attr::Added,
                bytes: a.as_bytes().to_vec(),
            });
        }
        Mlt {
            kind: Kind::ByteLevel,
            bos: None,
            eos: Some(256),
            flags: 0,
            tokens,
            merges: Vec::new(),
            chat: None,
        }
    }

    fn eot(src: &str, m: &Mlt) -> Option<u32> {
        let t = ChatTemplate::from_source(src, &[]).unwrap();
        end_of_turn(&t, "default", m)
    }

    #[test]
    fn end_of_turn_is_the_token_after_the_answer() {
        let m = mlt(&["<|end|>", "<|im_start|>", "<|im_end|>", "\n"]);
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        assert_eq!(eot(chatml, &m), Some(258));
        // Whitespace (even a whitespace token) before it is skipped.
        assert_eq!(
            eot(
                "{% for m in messages %}{{ m.content }}\n  <|end|>{% endfor %}",
                &m
            ),
            Some(256)
        );
        // Text after the answer: no end-of-turn token.
        assert_eq!(
            eot(
                "{% for m in messages %}{{ m.content }} END<|end|>{% endfor %}",
                &m
            ),
            None
        );
        // A template that raises on the probe gives none.
        assert_eq!(eot("{{ raise_exception('no') }}", &m), None);
    }

    #[test]
    fn config_template_forms() {
        let v: Value = serde_json::json!([{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]);
        let t = templates_from_config(&v).unwrap();
        assert_eq!(
            (t[1].name.as_str(), t[1].source.as_str()),
            ("tool_use", "B")
        );
        let e = templates_from_config(&serde_json::json!([{"name": "x"}])).unwrap_err();
        assert_eq!(e.field, "chat_template[0]");
        assert_eq!(
            templates_from_config(&serde_json::json!(3))
                .unwrap_err()
                .field,
            "chat_template"
        );
    }

    #[test]
    fn generation_config_ids() {
        let v = serde_json::json!({"eos_token_id": [1, 2]});
        assert_eq!(generation_eos(&v, 10).unwrap(), vec![1, 2]);
        let v = serde_json::json!({"eos_token_id": 7});
        assert_eq!(generation_eos(&v, 10).unwrap(), vec![7]);
        let v = serde_json::json!({"eos_token_id": 10});
        let e = generation_eos(&v, 10).unwrap_err();
        assert_eq!((e.field.as_str(), e.value.as_str()), ("eos_token_id", "10"));
        assert!(generation_eos(&serde_json::json!({"eos_token_id": "x"}), 10).is_err());
        assert!(generation_eos(&serde_json::json!({}), 10)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn stop_set_from_all_sources() {
        let m = mlt(&["<|end|>", "<|im_start|>", "<|im_end|>"]);
        let t = vec![NamedTemplate {
            name: "default".into(),
            source: "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
                .into(),
        }];
        let s = build_section(&m, t, Vec::new(), &[256, 3], &["<|im_start|>".into()])
            .unwrap()
            .unwrap();
        let got: Vec<(u32, u32)> = s.stop.iter().map(|s| (s.id, s.sources)).collect();
        assert_eq!(
            got,
            vec![
                (3, STOP_GENERATION_CONFIG),
                (256, STOP_EOS | STOP_GENERATION_CONFIG),
                (257, STOP_GIVEN),
                (258, STOP_END_OF_TURN)
            ]
        );
        let bad = vec![NamedTemplate {
            name: "default".into(),
            source: "ok\n{% if %}".into(),
        }];
        let e = build_section(&m, bad, Vec::new(), &[], &[]).unwrap_err();
        assert_eq!(e.field, "chat_template 'default'");
        assert_eq!(e.value, "line 2");
        assert!(e.rule.contains("--no-chat"), "{e}");
    }
}
