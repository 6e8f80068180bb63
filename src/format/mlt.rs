//! MLT1 tokenizer files: a pure, bounds-checked parser and a deterministic writer.
//!
//! Layout (little-endian): a 32-byte header (magic `MLT1`, version 1, kind, n_vocab,
//! n_merges, bos, eos, flags), then n_vocab tokens (`u8 attr, u32 len, bytes`), then
//! n_merges rules of three u32 (left, right, merged) in rank order. The parser checks
//! every rule of the spec and every size against the file length before allocating;
//! it never panics.

use super::error::{FormatError, Result};
use super::mlt_chat::ChatSection;
use super::reader::{fit_u32, Reader};
use std::path::Path;

pub const MAGIC: &[u8; 4] = b"MLT1";
pub const VERSION: u32 = 1;
pub const HEADER_LEN: usize = 32;

named_bits! {
    FLAG_NAMES, KNOWN_FLAGS;
    /// Prepend BOS when encoding.
    FLAG_ADD_BOS = 1, "add_bos";
    /// A whole pre-token found in the vocabulary is one token.
    FLAG_IGNORE_MERGES = 2, "ignore_merges";
    /// SentencePiece: the ▁ prefix only at the start of the text, not after each added token.
    FLAG_SP_PREFIX_FIRST = 4, "sp_prefix_first_only";
    /// Byte-level: NFC-normalize the text between added tokens.
    FLAG_NFC = 8, "nfc";
    /// Byte-level: numbers split into single digits (`\p{N}` instead of `\p{N}{1,3}`).
    FLAG_SINGLE_DIGITS = 16, "single_digits";
    /// Byte-level: the GPT-2 regex instead of the Llama 3 one.
    FLAG_GPT2_REGEX = 32, "gpt2_regex";
    /// Byte-level: every `\p{N}` is split off before the regex (Digits(individual_digits)).
    FLAG_DIGITS_SPLIT = 64, "digits_split";
    /// Extension: SentencePiece without any ▁ prefix (Gemma 3).
    FLAG_SP_NO_PREFIX = 128, "sp_no_prefix";
    /// Extension: byte-level Llama 3-family regex whose letter runs take marks,
    /// `[\p{L}\p{M}]+`, and whose punctuation class excludes them (Qwen3.5).
    FLAG_LETTER_MARKS = 256, "letter_marks";
    /// Extension: a chat section (templates, special-token strings, stop set) follows the
    /// merge table (`super::mlt_chat`).
    FLAG_CHAT = 512, "chat";
}

const SP_ONLY: u32 = FLAG_SP_PREFIX_FIRST | FLAG_SP_NO_PREFIX;
const BYTE_ONLY: u32 =
    FLAG_NFC | FLAG_SINGLE_DIGITS | FLAG_GPT2_REGEX | FLAG_DIGITS_SPLIT | FLAG_LETTER_MARKS;

/// The tokenizer family of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SentencePiece-style BPE over UTF-8 with ▁ for spaces and byte fallback.
    SentencePiece = 1,
    /// Byte-level BPE with a regex pre-tokenizer.
    ByteLevel = 2,
}

/// What a token is, beyond its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attr {
    Normal = 0,
    /// Matched literally in the text before anything else.
    Added = 1,
    /// A SentencePiece byte-fallback token `<0xXX>`, stored as its byte.
    Byte = 2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub attr: Attr,
    pub bytes: Vec<u8>,
}

/// A merge rule: `left` + `right` → `merged`; its rank is its index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Merge {
    pub left: u32,
    pub right: u32,
    pub merged: u32,
}

/// A whole MLT1 file in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlt {
    pub kind: Kind,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub flags: u32,
    pub tokens: Vec<Token>,
    pub merges: Vec<Merge>,
    /// The chat section; present exactly when `flags` has FLAG_CHAT (`to_bytes` sets
    /// the bit from it).
    pub chat: Option<ChatSection>,
}

/// A truncated file: the offset of `field` and the bytes it needs.
fn truncated(field: &str, n: usize, pos: usize, len: usize) -> FormatError {
    FormatError::format(
        field,
        format!("offset {pos}"),
        format!("truncated: needs {n} bytes, file has {len}"),
    )
}

fn opt_id(v: u32) -> Option<u32> {
    (v != u32::MAX).then_some(v)
}

/// Checks the flags against the kind: unknown bits and bits of the other family
/// are refused, and so are contradictory pairs.
pub fn check_flags(kind: Kind, flags: u32) -> Result<()> {
    let bad = |rule: &str| Err(FormatError::format("flags", format!("{flags:#x}"), rule));
    if flags & !KNOWN_FLAGS != 0 {
        return bad("unknown flag bits set");
    }
    match kind {
        Kind::SentencePiece if flags & BYTE_ONLY != 0 => {
            bad("byte-level flags (8, 16, 32, 64, 256) set on a SentencePiece file")
        }
        Kind::ByteLevel if flags & SP_ONLY != 0 => {
            bad("SentencePiece flags (4, 128) set on a byte-level file")
        }
        _ if flags & SP_ONLY == SP_ONLY => bad("flags 4 and 128 contradict each other"),
        _ if flags & FLAG_GPT2_REGEX != 0
            && flags & (FLAG_SINGLE_DIGITS | FLAG_LETTER_MARKS) != 0 =>
        {
            bad("flags 16 and 256 modify the Llama 3 regex, not the GPT-2 one (32)")
        }
        _ => Ok(()),
    }
}

/// What a converter builds from a tokenizer's files: kind, flags, tokens, merges.
pub type Parts = (Kind, u32, Vec<Token>, Vec<Merge>);

impl Mlt {
    /// A converter's file, without a chat section: FLAG_ADD_BOS is set when `add_bos`,
    /// which needs a BOS token (the error names the source's key for it, `bos_key`, and
    /// says how it is absent, `missing`); then the flags are checked against the kind.
    pub fn from_parts(
        (kind, mut flags, tokens, merges): Parts,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: bool,
        bos_key: &str,
        missing: &str,
    ) -> Result<Mlt> {
        if add_bos {
            if bos.is_none() {
                return Err(FormatError::format(
                    bos_key,
                    missing,
                    "BOS is prepended but no BOS token is named",
                ));
            }
            flags |= FLAG_ADD_BOS;
        }
        check_flags(kind, flags)?;
        Ok(Mlt {
            kind,
            bos,
            eos,
            flags,
            tokens,
            merges,
            chat: None,
        })
    }

    /// Parses and validates a whole file.
    pub fn parse(buf: &[u8]) -> Result<Mlt> {
        if buf.len() < HEADER_LEN {
            return Err(FormatError::format(
                "header",
                format!("{} bytes", buf.len()),
                format!("file shorter than the {HEADER_LEN}-byte header"),
            ));
        }
        let mut r = Reader::new(buf, truncated);
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(FormatError::format(
                "magic",
                format!("{magic:?}"),
                "must be \"MLT1\"",
            ));
        }
        let version = r.u32("version")?;
        if version != VERSION {
            return Err(FormatError::format("version", version, "must be 1"));
        }
        let kind = match r.u32("kind")? {
            1 => Kind::SentencePiece,
            2 => Kind::ByteLevel,
            k => return Err(FormatError::format("kind", k, "must be 1 or 2")),
        };
        let n_vocab = r.u32("n_vocab")?;
        let n_merges = r.u32("n_merges")?;
        let bos = r.u32("bos")?;
        let eos = r.u32("eos")?;
        let flags = r.u32("flags")?;
        if n_vocab == 0 {
            return Err(FormatError::shape("n_vocab", 0, "must be at least 1"));
        }
        check_flags(kind, flags)?;
        for (name, id) in [("bos", bos), ("eos", eos)] {
            if id != u32::MAX && id >= n_vocab {
                return Err(FormatError::format(
                    name,
                    id as i32,
                    format!("must be -1 or below n_vocab ({n_vocab})"),
                ));
            }
        }
        if flags & FLAG_ADD_BOS != 0 && bos == u32::MAX {
            return Err(FormatError::format(
                "bos",
                -1,
                "flag 1 (add_bos) needs a BOS token",
            ));
        }
        // Each token takes at least 5 bytes and each merge 12: check before allocating.
        let min_tokens = u64::from(n_vocab) * 5;
        let min_merges = u64::from(n_merges) * 12;
        if min_tokens.saturating_add(min_merges) > r.remaining() as u64 {
            return Err(FormatError::format(
                "n_vocab/n_merges",
                format!("{n_vocab}/{n_merges}"),
                format!(
                    "tables need at least {} bytes, file has {} after the header",
                    min_tokens + min_merges,
                    r.remaining()
                ),
            ));
        }
        let mut tokens = Vec::with_capacity(n_vocab as usize);
        for i in 0..n_vocab {
            let field = format!("tokens[{i}]");
            let attr = match r.u8(&field)? {
                0 => Attr::Normal,
                1 => Attr::Added,
                2 => Attr::Byte,
                a => {
                    return Err(FormatError::format(
                        format!("{field}.attr"),
                        a,
                        "must be 0, 1 or 2",
                    ))
                }
            };
            let len = r.u32(&field)?;
            let bytes = r.take(len as usize, &field)?;
            if attr == Attr::Byte && len != 1 {
                return Err(FormatError::format(
                    format!("{field}.len"),
                    len,
                    "a byte token has length 1",
                ));
            }
            tokens.push(Token {
                attr,
                bytes: bytes.to_vec(),
            });
        }
        if u64::from(n_merges) * 12 > r.remaining() as u64 {
            return Err(FormatError::format(
                "n_merges",
                n_merges,
                format!("merge table truncated: {} bytes left", r.remaining()),
            ));
        }
        let mut merges = Vec::with_capacity(n_merges as usize);
        for i in 0..n_merges {
            let field = format!("merges[{i}]");
            let m = Merge {
                left: r.u32(&field)?,
                right: r.u32(&field)?,
                merged: r.u32(&field)?,
            };
            for id in [m.left, m.right, m.merged] {
                if id >= n_vocab {
                    return Err(FormatError::format(
                        field,
                        id,
                        format!("token id must be below n_vocab ({n_vocab})"),
                    ));
                }
            }
            merges.push(m);
        }
        let chat = if flags & FLAG_CHAT != 0 {
            Some(ChatSection::parse(&buf[r.pos()..], n_vocab)?)
        } else if r.remaining() != 0 {
            return Err(FormatError::format(
                "file",
                format!("{} trailing bytes", r.remaining()),
                "nothing may follow the merge table",
            ));
        } else {
            None
        };
        Ok(Mlt {
            kind,
            bos: opt_id(bos),
            eos: opt_id(eos),
            flags,
            tokens,
            merges,
            chat,
        })
    }

    /// Reads and parses a file, naming it in errors.
    pub fn load(path: &Path) -> Result<Mlt> {
        let buf = crate::input::read(path).map_err(|e| FormatError::io(path, &e))?;
        Mlt::parse(&buf).map_err(|e| e.in_file(path))
    }

    /// Serializes the file. Fails only if a count does not fit the format. The chat
    /// bit of the flags is written from `chat`.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let n_vocab = fit_u32(self.tokens.len(), "n_vocab")?;
        let n_merges = fit_u32(self.merges.len(), "n_merges")?;
        let size: usize = HEADER_LEN
            + self.tokens.iter().map(|t| 5 + t.bytes.len()).sum::<usize>()
            + self.merges.len() * 12;
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(MAGIC);
        let id = |o: Option<u32>| o.unwrap_or(u32::MAX);
        for v in [
            VERSION,
            self.kind as u32,
            n_vocab,
            n_merges,
            id(self.bos),
            id(self.eos),
            match self.chat {
                Some(_) => self.flags | FLAG_CHAT,
                None => self.flags & !FLAG_CHAT,
            },
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for t in &self.tokens {
            let len = fit_u32(t.bytes.len(), "token.len")?;
            out.push(t.attr as u8);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&t.bytes);
        }
        for m in &self.merges {
            for v in [m.left, m.right, m.merged] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        if let Some(chat) = &self.chat {
            out.extend_from_slice(&chat.to_bytes()?);
        }
        Ok(out)
    }

    /// The tokenizer of this one's first `n` tokens: the merges among them (in rank
    /// order), BOS and EOS kept where inside (FLAG_ADD_BOS dropped with BOS), the chat
    /// section as it is. Small tokenizers for tests and fuzz seeds.
    pub fn vocab_prefix(&self, n: usize) -> Mlt {
        let mut s = self.clone();
        s.tokens.truncate(n);
        let n = n as u32;
        s.merges
            .retain(|g| g.left < n && g.right < n && g.merged < n);
        s.bos = s.bos.filter(|&b| b < n);
        s.eos = s.eos.filter(|&e| e < n);
        if s.bos.is_none() {
            s.flags &= !FLAG_ADD_BOS;
        }
        s
    }

    /// The names of the set flags, in bit order.
    pub fn flag_names(&self) -> Vec<&'static str> {
        super::bit_names(FLAG_NAMES, self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Status;

    fn sample() -> Mlt {
        Mlt {
            kind: Kind::ByteLevel,
            bos: Some(3),
            eos: None,
            flags: FLAG_ADD_BOS | FLAG_NFC,
            tokens: vec![
                Token {
                    attr: Attr::Normal,
                    bytes: b"a".to_vec(),
                },
                Token {
                    attr: Attr::Normal,
                    bytes: b"b".to_vec(),
                },
                Token {
                    attr: Attr::Normal,
                    bytes: b"ab".to_vec(),
                },
                Token {
                    attr: Attr::Added,
                    bytes: b"<s>".to_vec(),
                },
            ],
            merges: vec![Merge {
                left: 0,
                right: 1,
                merged: 2,
            }],
            chat: None,
        }
    }

    fn set_u32(buf: &mut [u8], off: usize, v: u32) {
        buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn err(buf: &[u8]) -> FormatError {
        Mlt::parse(buf).expect_err("must be refused")
    }

    /// The field blamed when the sample's u32 at `off` is `v`.
    fn field_with(off: usize, v: u32) -> String {
        let mut b = sample().to_bytes().unwrap();
        set_u32(&mut b, off, v);
        err(&b).field
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(Mlt::parse(&m.to_bytes().unwrap()).unwrap(), m);
    }

    #[test]
    fn short_header() {
        let e = err(&sample().to_bytes().unwrap()[..31]);
        assert_eq!((e.status, e.field.as_str()), (Status::Format, "header"));
    }

    #[test]
    fn bad_magic_version_kind() {
        let good = sample().to_bytes().unwrap();
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(err(&b).field, "magic");
        assert_eq!(field_with(4, 2), "version");
        assert_eq!(field_with(8, 3), "kind");
    }

    #[test]
    fn bad_flags() {
        let good = sample().to_bytes().unwrap();
        for f in [
            1 << 10,
            1 << 31,
            FLAG_SP_NO_PREFIX,
            FLAG_GPT2_REGEX | FLAG_SINGLE_DIGITS,
        ] {
            let mut b = good.clone();
            set_u32(&mut b, 28, f);
            let e = err(&b);
            assert_eq!(
                (e.status, e.field.as_str()),
                (Status::Format, "flags"),
                "{f:#x}"
            );
        }
        assert_eq!(field_with(8, 1), "flags"); // SentencePiece with the NFC bit
    }

    #[test]
    fn zero_vocab_is_shape() {
        let mut b = sample().to_bytes().unwrap();
        set_u32(&mut b, 12, 0);
        assert_eq!(err(&b).status, Status::Shape);
    }

    #[test]
    fn bos_eos_out_of_range() {
        assert_eq!(field_with(20, 4), "bos");
        assert_eq!(field_with(24, 0xffff_fffe), "eos");
        assert_eq!(field_with(20, u32::MAX), "bos"); // add_bos without a BOS
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let good = sample().to_bytes().unwrap();
        let mut b = good.clone();
        set_u32(&mut b, 16, u32::MAX);
        assert_eq!(err(&b).status, Status::Format);
        let mut b = good.clone();
        set_u32(&mut b, 12, u32::MAX);
        set_u32(&mut b, 20, 0);
        assert_eq!(err(&b).status, Status::Format);
    }

    #[test]
    fn truncated_tables() {
        let good = sample().to_bytes().unwrap();
        for cut in [33, 40, good.len() - 1] {
            let e = err(&good[..cut]);
            assert_eq!(e.status, Status::Format, "cut {cut}");
        }
        // A token length running past the end.
        let mut b = good.clone();
        set_u32(&mut b, 33, 1000);
        assert!(err(&b).field.starts_with("tokens[0]"));
    }

    #[test]
    fn bad_attr_and_byte_len() {
        let good = sample().to_bytes().unwrap();
        let mut b = good.clone();
        b[32] = 3;
        assert_eq!(err(&b).field, "tokens[0].attr");
        // tokens[2] is "ab": mark it a byte token.
        let off = 32 + 6 + 6;
        let mut b = good.clone();
        b[off] = 2;
        assert_eq!(err(&b).field, "tokens[2].len");
    }

    #[test]
    fn merge_ids_out_of_range() {
        let mut b = sample().to_bytes().unwrap();
        let n = b.len();
        set_u32(&mut b, n - 4, 4);
        assert_eq!(err(&b).field, "merges[0]");
    }

    #[test]
    fn chat_section_behind_its_flag() {
        use crate::format::mlt_chat::{NamedTemplate, StopToken, STOP_EOS};
        let mut m = sample();
        m.flags |= FLAG_CHAT;
        m.chat = Some(ChatSection {
            templates: vec![NamedTemplate {
                name: "default".into(),
                source: "{{ messages }}".into(),
            }],
            specials: vec![("bos_token".into(), "<s>".into())],
            stop: vec![StopToken {
                id: 3,
                sources: STOP_EOS,
            }],
        });
        let b = m.to_bytes().unwrap();
        assert_eq!(Mlt::parse(&b).unwrap(), m);
        // Without the bit the section is trailing bytes.
        let mut nb = b.clone();
        set_u32(&mut nb, 28, m.flags & !FLAG_CHAT);
        assert_eq!(err(&nb).field, "file");
        // The bit without a section.
        let mut fb = sample().to_bytes().unwrap();
        set_u32(&mut fb, 28, sample().flags | FLAG_CHAT);
        assert_eq!(err(&fb).field, "chat.n_templates");
        // Stop ids are checked against this file's n_vocab (4).
        let mut big = m.clone();
        big.chat.as_mut().unwrap().stop[0].id = 4;
        let e = err(&big.to_bytes().unwrap());
        assert_eq!(
            (e.field.as_str(), e.value.as_str()),
            ("chat.stop[0].id", "4")
        );
        // The writer sets the bit from the section, and clears it without one.
        let mut nf = m.clone();
        nf.flags &= !FLAG_CHAT;
        assert_eq!(nf.to_bytes().unwrap(), b);
        let mut plain = sample();
        plain.flags |= FLAG_CHAT;
        assert_eq!(plain.to_bytes().unwrap(), sample().to_bytes().unwrap());
    }

    #[test]
    fn trailing_bytes() {
        let mut b = sample().to_bytes().unwrap();
        b.push(0);
        assert_eq!(err(&b).field, "file");
    }
}
