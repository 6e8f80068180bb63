//! The `.mlt` report: the header, the flags by name, the token counts, the added tokens
//! and the chat section ([`super::mlt_chat`]).

use crate::format::mlt::{Attr, Kind, Mlt};

fn shown(bytes: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(bytes))
}

/// A human summary and a JSON description of a file: header, flags by name, counts
/// and added tokens.
pub fn describe(m: &Mlt) -> (String, serde_json::Value) {
    let kind = match m.kind {
        Kind::SentencePiece => "sentencepiece",
        Kind::ByteLevel => "byte_level",
    };
    let flags = m.flag_names();
    let count = |a: Attr| m.tokens.iter().filter(|t| t.attr == a).count();
    let added: Vec<(usize, &[u8])> = m
        .tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| t.attr == Attr::Added)
        .map(|(i, t)| (i, t.bytes.as_slice()))
        .collect();
    let name = |id: Option<u32>| match id {
        Some(i) => format!(
            "{i} {}",
            m.tokens
                .get(i as usize)
                .map(|t| shown(&t.bytes))
                .unwrap_or_default()
        ),
        None => "-1".into(),
    };
    let mut text = format!(
        "MLT1 tokenizer: kind {} ({kind})\n  n_vocab {}  n_merges {}\n  bos {}\n  eos {}\n  flags {:#x} [{}]\n  tokens: {} normal, {} added, {} byte\n",
        m.kind as u32,
        m.tokens.len(),
        m.merges.len(),
        name(m.bos),
        name(m.eos),
        m.flags,
        flags.join(", "),
        count(Attr::Normal),
        count(Attr::Added),
        count(Attr::Byte),
    );
    const SHOW: usize = 40;
    text.push_str(&format!("  added tokens ({}):\n", added.len()));
    for (i, b) in added.iter().take(SHOW) {
        text.push_str(&format!("    {i} {}\n", shown(b)));
    }
    if added.len() > SHOW {
        text.push_str(&format!("    ... {} more\n", added.len() - SHOW));
    }
    let chat = m.chat.as_ref().map(|c| super::mlt_chat::describe(m, c));
    if let Some((t, _)) = &chat {
        text.push_str(t);
    }
    let mut json = serde_json::json!({
        "magic": "MLT1",
        "version": 1,
        "kind": m.kind as u32,
        "kind_name": kind,
        "n_vocab": m.tokens.len(),
        "n_merges": m.merges.len(),
        "bos": m.bos.map(i64::from).unwrap_or(-1),
        "eos": m.eos.map(i64::from).unwrap_or(-1),
        "flags": m.flags,
        "flag_names": flags,
        "n_normal": count(Attr::Normal),
        "n_added": count(Attr::Added),
        "n_byte": count(Attr::Byte),
        "added_tokens": added.iter().map(|(i, b)| serde_json::json!({"id": i, "text": String::from_utf8_lossy(b)})).collect::<Vec<_>>(),
    });
    if let Some((_, j)) = chat {
        json["chat"] = j;
    }
    (text, json)
}
