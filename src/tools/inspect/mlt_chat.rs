//! The chat section as people and scripts see it (`mlb-inspect`, `mlt-convert`), and a
//! conversation rendered with it (`mlb-inspect --chat`).
//!
//! Each template is shown by its name, size, the SHA-256 of its source (the same as
//! `sha256sum chat_template.jinja` gives for a template read from that file), its first
//! lines and, if it does not compile, why; the stop set by id, token text and source.

use crate::chat::{encode_rendered, Chat, ChatError, ChatTemplate, Conversation, RenderOptions};
use crate::format::mlt::Mlt;
use crate::format::mlt_chat::{source_names, ChatSection, DEFAULT_TEMPLATE};
use crate::tokenizer::Tokenizer;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Lines of each template shown in the text report.
pub const SHOW_LINES: usize = 3;
const LINE_CHARS: usize = 100;

/// The hex SHA-256 of a template source.
pub fn sha256_hex(source: &str) -> String {
    Sha256::digest(source.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn token_text(m: &Mlt, id: u32) -> String {
    m.tokens
        .get(id as usize)
        .map(|t| String::from_utf8_lossy(&t.bytes).into_owned())
        .unwrap_or_default()
}

fn clip(line: &str) -> String {
    match line.char_indices().nth(LINE_CHARS) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_string(),
    }
}

/// A human summary (indented lines) and a JSON description of a chat section.
pub fn describe(m: &Mlt, c: &ChatSection) -> (String, Value) {
    let mut text = format!("  chat templates ({}):\n", c.templates.len());
    let mut templates = Vec::new();
    for t in &c.templates {
        let hash = sha256_hex(&t.source);
        let lines: Vec<&str> = t.source.lines().collect();
        text.push_str(&format!(
            "    {}: {} bytes, {} lines, sha256 {}\n",
            t.name,
            t.source.len(),
            lines.len(),
            &hash[..16]
        ));
        // The format holds any UTF-8; say so when minijinja cannot compile it.
        let error = ChatTemplate::from_source(&t.source, &[])
            .err()
            .map(|e| e.to_string());
        if let Some(e) = &error {
            text.push_str(&format!("      ! {e}\n"));
        }
        for l in lines.iter().take(SHOW_LINES) {
            text.push_str(&format!("      | {}\n", clip(l)));
        }
        if lines.len() > SHOW_LINES {
            let more = lines.len() - SHOW_LINES;
            let s = if more == 1 { "" } else { "s" };
            text.push_str(&format!("      | ... {more} more line{s}\n"));
        }
        templates.push(json!({
            "name": t.name,
            "bytes": t.source.len(),
            "lines": lines.len(),
            "sha256": hash,
            "first_lines": lines.iter().take(SHOW_LINES).collect::<Vec<_>>(),
            "compile_error": error,
        }));
    }
    text.push_str(&format!(
        "  template special tokens ({}):",
        c.specials.len()
    ));
    for (n, v) in &c.specials {
        text.push_str(&format!(" {n} {v:?}"));
    }
    text.push('\n');
    text.push_str(&format!("  stop set ({}):\n", c.stop.len()));
    let mut stop = Vec::new();
    for s in &c.stop {
        let tt = token_text(m, s.id);
        let names = source_names(s.sources);
        text.push_str(&format!("    {} {:?} ({})\n", s.id, tt, names.join(", ")));
        stop.push(json!({"id": s.id, "text": tt, "sources": names}));
    }
    let specials: serde_json::Map<String, Value> = c
        .specials
        .iter()
        .map(|(n, v)| (n.clone(), Value::String(v.clone())))
        .collect();
    let j = json!({
        "templates": templates,
        "special_tokens": specials,
        "stop": stop,
    });
    (text, j)
}

/// Renders the conversation JSON of `mlb-inspect --chat` (`{"messages": [...],
/// "add_generation_prompt": true, ...}`) with the file's templates: the text and its
/// ids. A conversation may give its own template source as `"chat_template"`.
pub fn render_json(m: &Mlt, tok: &Tokenizer, json: &str) -> Result<(String, Vec<u32>), ChatError> {
    let conv = Conversation::from_json(json)?;
    let text = match Chat::from_mlt(m)? {
        Some(chat) => chat.render(&conv.messages, &conv.options)?,
        None => match &conv.options.template {
            Some(source) => ChatTemplate::from_source(source, &[])?.render(
                &conv.messages,
                &RenderOptions {
                    template: None,
                    ..conv.options.clone()
                },
            )?,
            None => {
                return Err(ChatError::NoTemplate {
                    name: DEFAULT_TEMPLATE.into(),
                    available: Vec::new(),
                })
            }
        },
    };
    let ids = encode_rendered(tok, &text);
    Ok((text, ids))
}
