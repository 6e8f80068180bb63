//! The chat section of an MLT1 file (Krafla extension, flag bit 512): chat templates,
//! the named special-token strings templates read, and the stop set.
//!
//! It follows the merge table when the flag is set, all integers little-endian:
//!
//! ```text
//! u32 n_templates                      1..=64
//!   n_templates × { u32 len, name (UTF-8), u32 len, source (UTF-8) }
//! u32 n_specials                       0..=64
//!   n_specials  × { u32 len, name (identifier), u32 len, text (UTF-8) }
//! u32 n_stop                           0..=min(n_vocab, 4096)
//!   n_stop      × { u32 id (< n_vocab, strictly increasing), u32 sources (bits 1, 2, 4, 8; ≠ 0) }
//! ```
//!
//! Nothing may follow. The section is plain data: `mlt-convert` fills it from the files
//! beside tokenizer.json, a GGUF reader could fill it from `tokenizer.chat_template`;
//! `krafla::chat` compiles and renders it.

use super::error::{FormatError, Result};
use super::reader::{fit_u32, Reader};

/// At most this many templates (HF's list form has a handful: default, tool_use, rag).
pub const MAX_TEMPLATES: usize = 64;
/// At most this many named special tokens (transformers has seven names).
pub const MAX_SPECIALS: usize = 64;
/// At most this many stop ids.
pub const MAX_STOP: usize = 4096;
/// Longest template source, in bytes (real ones are under 64 KiB).
pub const MAX_TEMPLATE_LEN: usize = 4 << 20;
/// Longest template or special-token name, in bytes.
pub const MAX_NAME_LEN: usize = 256;
/// Longest special-token text, in bytes.
pub const MAX_SPECIAL_LEN: usize = 4096;

named_bits! {
    STOP_SOURCE_NAMES, KNOWN_SOURCES;
    /// Stop id source: the tokenizer's EOS (tokenizer_config.json's eos_token, or --eos).
    STOP_EOS = 1, "eos";
    /// Stop id source: generation_config.json's eos_token_id (an int or a list).
    STOP_GENERATION_CONFIG = 2, "generation_config";
    /// Stop id source: the added token the template writes right after an assistant turn.
    STOP_END_OF_TURN = 4, "end_of_turn";
    /// Stop id source: named on the command line (mlt-convert --stop-token).
    STOP_GIVEN = 8, "given";
}

/// The name of the template used when none is asked for.
pub const DEFAULT_TEMPLATE: &str = "default";

/// One chat template, as the model's files give it (unmodified Jinja source).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedTemplate {
    /// `default` for the single template; else the name of HF's list form or the
    /// additional_chat_templates/ file.
    pub name: String,
    pub source: String,
}

/// One id of the stop set and why it is there (`STOP_*` bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopToken {
    pub id: u32,
    pub sources: u32,
}

/// The chat section of an `.mlt`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatSection {
    /// At least one; names unique.
    pub templates: Vec<NamedTemplate>,
    /// Named special-token strings passed to templates (`bos_token`, `eos_token`, ...),
    /// as transformers passes its `special_tokens_map`.
    pub specials: Vec<(String, String)>,
    /// The stop set, ids strictly increasing.
    pub stop: Vec<StopToken>,
}

/// The names of the set source bits.
pub fn source_names(sources: u32) -> Vec<&'static str> {
    super::bit_names(STOP_SOURCE_NAMES, sources)
}

/// Whether `s` is a template variable name: ASCII letters, digits and `_`, not
/// starting with a digit.
pub fn is_identifier(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(f) if f.is_ascii_alphabetic() || f == '_')
        && c.all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
}

/// A truncated section: the bytes `field` needs and the bytes left in the section.
fn truncated(field: &str, n: usize, pos: usize, len: usize) -> FormatError {
    FormatError::format(
        field,
        format!("{n} bytes"),
        format!("chat section truncated: {} bytes left", len - pos),
    )
}

impl ChatSection {
    /// Parses the section (all bytes after the merge table) and checks every rule.
    pub fn parse(buf: &[u8], n_vocab: u32) -> Result<ChatSection> {
        let mut c = Reader::new(buf, truncated);
        let n_templates = c.count("chat.n_templates", MAX_TEMPLATES, 8)?;
        if n_templates == 0 {
            return Err(FormatError::format(
                "chat.n_templates",
                0,
                "a chat section holds at least one template",
            ));
        }
        let mut templates: Vec<NamedTemplate> = Vec::with_capacity(n_templates);
        for i in 0..n_templates {
            let name = c.text(&format!("chat.templates[{i}].name"), MAX_NAME_LEN)?;
            if name.is_empty() || templates.iter().any(|t| t.name == name) {
                return Err(FormatError::format(
                    format!("chat.templates[{i}].name"),
                    format!("{name:?}"),
                    "template names are non-empty and unique",
                ));
            }
            let source = c.text(&format!("chat.templates[{i}].source"), MAX_TEMPLATE_LEN)?;
            templates.push(NamedTemplate {
                name: name.to_string(),
                source: source.to_string(),
            });
        }
        let n_specials = c.count("chat.n_specials", MAX_SPECIALS, 8)?;
        let mut specials: Vec<(String, String)> = Vec::with_capacity(n_specials);
        for i in 0..n_specials {
            let name = c.text(&format!("chat.specials[{i}].name"), MAX_NAME_LEN)?;
            if !is_identifier(name) || specials.iter().any(|(n, _)| n == name) {
                return Err(FormatError::format(
                    format!("chat.specials[{i}].name"),
                    format!("{name:?}"),
                    "special-token names are unique identifiers",
                ));
            }
            let text = c.text(&format!("chat.specials[{i}].text"), MAX_SPECIAL_LEN)?;
            specials.push((name.to_string(), text.to_string()));
        }
        let max_stop = MAX_STOP.min(n_vocab as usize);
        let n_stop = c.count("chat.n_stop", max_stop, 8)?;
        let mut stop: Vec<StopToken> = Vec::with_capacity(n_stop);
        for i in 0..n_stop {
            let field = format!("chat.stop[{i}]");
            let id = c.u32(&field)?;
            let sources = c.u32(&field)?;
            if id >= n_vocab {
                return Err(FormatError::format(
                    format!("{field}.id"),
                    id,
                    format!("must be below n_vocab ({n_vocab})"),
                ));
            }
            if stop.last().is_some_and(|p| p.id >= id) {
                return Err(FormatError::format(
                    format!("{field}.id"),
                    id,
                    "stop ids are strictly increasing",
                ));
            }
            if sources == 0 || sources & !KNOWN_SOURCES != 0 {
                return Err(FormatError::format(
                    format!("{field}.sources"),
                    format!("{sources:#x}"),
                    "must be a non-empty set of the bits 1, 2, 4, 8",
                ));
            }
            stop.push(StopToken { id, sources });
        }
        if c.remaining() != 0 {
            return Err(FormatError::format(
                "file",
                format!("{} trailing bytes", c.remaining()),
                "nothing may follow the chat section",
            ));
        }
        Ok(ChatSection {
            templates,
            specials,
            stop,
        })
    }

    /// Checks the rules `parse` checks, for a section built in memory.
    pub fn validate(&self, n_vocab: u32) -> Result<()> {
        ChatSection::parse(&self.to_bytes()?, n_vocab).map(|_| ())
    }

    /// Serializes the section (to follow the merge table).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let put_len = |out: &mut Vec<u8>, n: usize, field: &str| -> Result<()> {
            out.extend_from_slice(&fit_u32(n, field)?.to_le_bytes());
            Ok(())
        };
        let put_str = |out: &mut Vec<u8>, s: &str, field: &str| -> Result<()> {
            put_len(out, s.len(), field)?;
            out.extend_from_slice(s.as_bytes());
            Ok(())
        };
        put_len(&mut out, self.templates.len(), "chat.n_templates")?;
        for t in &self.templates {
            put_str(&mut out, &t.name, "chat.templates.name")?;
            put_str(&mut out, &t.source, "chat.templates.source")?;
        }
        put_len(&mut out, self.specials.len(), "chat.n_specials")?;
        for (name, text) in &self.specials {
            put_str(&mut out, name, "chat.specials.name")?;
            put_str(&mut out, text, "chat.specials.text")?;
        }
        put_len(&mut out, self.stop.len(), "chat.n_stop")?;
        for s in &self.stop {
            out.extend_from_slice(&s.id.to_le_bytes());
            out.extend_from_slice(&s.sources.to_le_bytes());
        }
        Ok(out)
    }

    /// The template called `name`, if any.
    pub fn template(&self, name: &str) -> Option<&NamedTemplate> {
        self.templates.iter().find(|t| t.name == name)
    }

    /// The text of a named special token (`bos_token`, ...), if given.
    pub fn special(&self, name: &str) -> Option<&str> {
        self.specials
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Status;

    fn sample() -> ChatSection {
        ChatSection {
            templates: vec![
                NamedTemplate {
                    name: "default".into(),
                    source: "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                        .into(),
                },
                NamedTemplate {
                    name: "tool_use".into(),
                    source: "é".into(),
                },
            ],
            specials: vec![
                ("bos_token".into(), "<s>".into()),
                ("eos_token".into(), "</s>".into()),
            ],
            stop: vec![
                StopToken {
                    id: 2,
                    sources: STOP_EOS | STOP_GENERATION_CONFIG,
                },
                StopToken {
                    id: 7,
                    sources: STOP_END_OF_TURN,
                },
            ],
        }
    }

    fn err(b: &[u8]) -> FormatError {
        ChatSection::parse(b, 10).expect_err("must be refused")
    }

    fn set_u32(b: &mut [u8], off: usize, v: u32) {
        b[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    #[test]
    fn round_trip() {
        let s = sample();
        assert_eq!(ChatSection::parse(&s.to_bytes().unwrap(), 10).unwrap(), s);
    }

    #[test]
    fn counts_and_truncation() {
        let good = sample().to_bytes().unwrap();
        let mut b = good.clone();
        set_u32(&mut b, 0, 0);
        assert_eq!(err(&b).field, "chat.n_templates");
        let mut b = good.clone();
        set_u32(&mut b, 0, 65);
        assert_eq!(err(&b).field, "chat.n_templates");
        let mut b = good.clone();
        set_u32(&mut b, 0, 40); // more than the bytes can hold
        assert_eq!(err(&b).field, "chat.n_templates");
        for cut in [0, 3, 10, good.len() - 1] {
            let e = err(&good[..cut]);
            assert_eq!(e.status, Status::Format, "cut {cut}: {e}");
        }
        let mut b = good.clone();
        b.push(0);
        assert_eq!(err(&b).field, "file");
    }

    #[test]
    fn names_and_utf8() {
        let mut s = sample();
        s.templates[1].name = "default".into();
        assert_eq!(err(&s.to_bytes().unwrap()).field, "chat.templates[1].name");
        let mut s = sample();
        s.templates[0].name.clear();
        assert_eq!(err(&s.to_bytes().unwrap()).field, "chat.templates[0].name");
        let mut s = sample();
        s.specials[1].0 = "eos token".into();
        assert_eq!(err(&s.to_bytes().unwrap()).field, "chat.specials[1].name");
        // "é" is the last two bytes of templates[1].source: break its UTF-8.
        let mut b = sample().to_bytes().unwrap();
        let at = b.windows(2).position(|w| w == "é".as_bytes()).unwrap();
        b[at + 1] = b'x';
        let e = err(&b);
        assert_eq!(e.field, "chat.templates[1].source");
        assert!(e.to_string().contains("UTF-8"), "{e}");
        // A template length beyond the cap is refused before reading it.
        let mut b = sample().to_bytes().unwrap();
        set_u32(&mut b, 4 + 4 + 7, (MAX_TEMPLATE_LEN + 1) as u32);
        assert_eq!(err(&b).field, "chat.templates[0].source");
    }

    #[test]
    fn stop_rules() {
        let mut s = sample();
        s.stop[1].id = 10;
        let e = err(&s.to_bytes().unwrap());
        assert_eq!(
            (e.field.as_str(), e.value.as_str()),
            ("chat.stop[1].id", "10")
        );
        let mut s = sample();
        s.stop[1].id = 2;
        assert_eq!(err(&s.to_bytes().unwrap()).field, "chat.stop[1].id");
        let mut s = sample();
        s.stop[0].sources = 0;
        assert_eq!(err(&s.to_bytes().unwrap()).field, "chat.stop[0].sources");
        let mut s = sample();
        s.stop[0].sources = 16;
        assert_eq!(err(&s.to_bytes().unwrap()).field, "chat.stop[0].sources");
        // More stop ids than the vocabulary has.
        let mut s = sample();
        s.stop = (0..3).map(|id| StopToken { id, sources: 1 }).collect();
        let e = ChatSection::parse(&s.to_bytes().unwrap(), 2).unwrap_err();
        assert_eq!(e.field, "chat.n_stop");
    }

    #[test]
    fn identifiers() {
        assert!(is_identifier("bos_token"));
        assert!(is_identifier("_x1"));
        assert!(!is_identifier("1x"));
        assert!(!is_identifier(""));
        assert!(!is_identifier("a-b"));
    }
}
