//! The BPE tokenizer of MLT1 files: encoding, decoding and streaming decoding.
//!
//! Encoding follows the tokenizers library exactly: added tokens are matched first on
//! the raw text (leftmost, then longest); the text between them is normalized (NFC for
//! byte-level files when flagged; spaces → ▁ plus the ▁ prefix for SentencePiece
//! files), pre-tokenized (byte-level: the flagged regex) and each piece is merged by
//! BPE (lowest rank first, leftmost among equal ranks). BOS is prepended when flagged.

pub mod bpe;
pub mod error;
pub mod from_hf;
pub mod pretok;

use crate::format::mlt::{
    Attr, Kind, Mlt, FLAG_ADD_BOS, FLAG_IGNORE_MERGES, FLAG_NFC, FLAG_SP_NO_PREFIX,
    FLAG_SP_PREFIX_FIRST,
};
use bpe::{FxMap, Merges};
use error::{FormatError, Result};
use pretok::PreTokenizer;
use std::path::Path;
use std::sync::Mutex;
use unicode_normalization::UnicodeNormalization;

const SPACE_MARK: &str = "\u{2581}";

/// A trie over the added tokens' bytes, for leftmost-longest matching.
/// A trie node: sorted (byte, child) edges and the token ending here.
#[derive(Default)]
struct TrieNode {
    edges: Vec<(u8, u32)>,
    token: Option<u32>,
}

struct AddedTrie {
    nodes: Vec<TrieNode>,
    first: [bool; 256],
}

impl AddedTrie {
    fn new() -> AddedTrie {
        AddedTrie {
            nodes: vec![TrieNode::default()],
            first: [false; 256],
        }
    }

    fn insert(&mut self, bytes: &[u8], id: u32) {
        let Some(&b0) = bytes.first() else { return };
        self.first[b0 as usize] = true;
        let mut n = 0usize;
        for &b in bytes {
            n = match self.nodes[n].edges.binary_search_by_key(&b, |e| e.0) {
                Ok(i) => self.nodes[n].edges[i].1 as usize,
                Err(i) => {
                    let child = self.nodes.len() as u32;
                    self.nodes[n].edges.insert(i, (b, child));
                    self.nodes.push(TrieNode::default());
                    child as usize
                }
            };
        }
        // The first token with this content keeps it, as a vocabulary would.
        self.nodes[n].token.get_or_insert(id);
    }

    /// The longest added token starting at `text[at..]`: (id, length).
    #[inline]
    fn longest_at(&self, text: &[u8], at: usize) -> Option<(u32, usize)> {
        let mut n = 0usize;
        let mut best = None;
        for (k, &b) in text[at..].iter().enumerate() {
            match self.nodes[n].edges.binary_search_by_key(&b, |e| e.0) {
                Ok(i) => n = self.nodes[n].edges[i].1 as usize,
                Err(_) => break,
            }
            if let Some(id) = self.nodes[n].token {
                best = Some((id, k + 1));
            }
        }
        best
    }

    /// Splits `text` into segments and added tokens, calling `f(start, end, None)` for
    /// the text between matches and `f(.., Some(id))` for each match.
    fn split(&self, text: &str, mut f: impl FnMut(usize, usize, Option<u32>)) {
        let b = text.as_bytes();
        let mut start = 0;
        let mut i = 0;
        while i < b.len() {
            if self.first[b[i] as usize] {
                // (Added tokens are UTF-8, so a match starts and ends on a character
                // boundary; the check keeps a slice of `text` from ever panicking.)
                if let Some((id, len)) = self
                    .longest_at(b, i)
                    .filter(|&(_, len)| text.is_char_boundary(i) && text.is_char_boundary(i + len))
                {
                    if start < i {
                        f(start, i, None);
                    }
                    f(i, i + len, Some(id));
                    i += len;
                    start = i;
                    continue;
                }
            }
            i += 1;
        }
        if start < b.len() {
            f(start, b.len(), None);
        }
    }
}

/// A loaded tokenizer, ready to encode and decode.
pub struct Tokenizer {
    kind: Kind,
    flags: u32,
    bos: Option<u32>,
    eos: Option<u32>,
    tokens: Vec<Vec<u8>>,
    attrs: Vec<Attr>,
    vocab: FxMap<Vec<u8>, u32>,
    /// SentencePiece: the token of each single-char piece (hashing a char beats bytes).
    char_tok: FxMap<char, u32>,
    /// Byte-level: the token of each single byte. SentencePiece: its `<0xXX>` token.
    byte_tok: [u32; 256],
    merges: Merges,
    added: AddedTrie,
    pretok: Option<PreTokenizer>,
    cache: Mutex<FxMap<Vec<u8>, Vec<u32>>>,
}

/// Pieces longer than this are not cached (they rarely repeat).
const CACHE_MAX_LEN: usize = 64;
const CACHE_MAX_ENTRIES: usize = 1 << 18;

impl Tokenizer {
    /// Builds the encoder tables; refuses files whose base symbols are missing.
    pub fn from_mlt(m: &Mlt) -> Result<Tokenizer> {
        let n = m.tokens.len();
        let mut vocab = FxMap::with_capacity_and_hasher(n, Default::default());
        // Normal tokens first, so an added token never shadows a vocabulary piece.
        for pass in [Attr::Normal, Attr::Added] {
            for (id, t) in m.tokens.iter().enumerate() {
                if t.attr == pass {
                    vocab.entry(t.bytes.clone()).or_insert(id as u32);
                }
            }
        }
        let mut byte_tok = [u32::MAX; 256];
        match m.kind {
            Kind::ByteLevel => {
                // A byte without a token is dropped when encoding, as the tokenizers
                // library does for a character missing from a vocabulary without unk.
                for (b, slot) in byte_tok.iter_mut().enumerate() {
                    if let Some(&id) = vocab.get(&[b as u8][..]) {
                        *slot = id;
                    }
                }
            }
            Kind::SentencePiece => {
                for (id, t) in m.tokens.iter().enumerate() {
                    if t.attr == Attr::Byte && byte_tok[t.bytes[0] as usize] == u32::MAX {
                        byte_tok[t.bytes[0] as usize] = id as u32;
                    }
                }
                if let Some(b) = byte_tok.iter().position(|&t| t == u32::MAX) {
                    return Err(FormatError::format(
                        "tokens",
                        format!("<0x{b:02X}>"),
                        "a SentencePiece vocabulary must hold all 256 byte-fallback tokens",
                    ));
                }
            }
        }
        let mut char_tok = FxMap::default();
        if m.kind == Kind::SentencePiece {
            for (bytes, &id) in &vocab {
                if let Ok(s) = std::str::from_utf8(bytes) {
                    let mut it = s.chars();
                    if let (Some(c), None) = (it.next(), it.next()) {
                        char_tok.insert(c, id);
                    }
                }
            }
        }
        let mut added = AddedTrie::new();
        for (id, t) in m.tokens.iter().enumerate() {
            if t.attr == Attr::Added {
                // Added tokens are matched in the text, so they must be text: a partial
                // UTF-8 sequence would match inside a character.
                if std::str::from_utf8(&t.bytes).is_err() {
                    return Err(FormatError::format(
                        format!("tokens[{id}]"),
                        format!("{:02x?}", &t.bytes[..t.bytes.len().min(8)]),
                        "an added token must be UTF-8 text",
                    ));
                }
                added.insert(&t.bytes, id as u32);
            }
        }
        let merges = Merges::new(m.merges.iter().map(|r| (r.left, r.right, r.merged)));
        let pretok = (m.kind == Kind::ByteLevel).then(|| PreTokenizer::new(m.flags));
        Ok(Tokenizer {
            kind: m.kind,
            flags: m.flags,
            bos: m.bos,
            eos: m.eos,
            tokens: m.tokens.iter().map(|t| t.bytes.clone()).collect(),
            attrs: m.tokens.iter().map(|t| t.attr).collect(),
            vocab,
            char_tok,
            byte_tok,
            merges,
            added,
            pretok,
            cache: Mutex::new(FxMap::default()),
        })
    }

    /// Parses MLT1 bytes and builds the tokenizer.
    pub fn from_bytes(buf: &[u8]) -> Result<Tokenizer> {
        Tokenizer::from_mlt(&Mlt::parse(buf)?)
    }

    /// Loads an MLT1 file.
    pub fn from_path(path: &Path) -> Result<Tokenizer> {
        Tokenizer::from_mlt(&Mlt::load(path)?).map_err(|e| e.in_file(path))
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }
    pub fn kind(&self) -> Kind {
        self.kind
    }
    /// The stored bytes of a token (▁ kept for SentencePiece pieces).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.tokens.get(id as usize).map(|t| t.as_slice())
    }
    /// Whether a token is an added (control or literal) token.
    pub fn is_added(&self, id: u32) -> bool {
        self.attrs.get(id as usize) == Some(&Attr::Added)
    }

    /// Encodes UTF-8 text into token ids (BOS first when the file says so).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, true)
    }

    /// Encodes text; `add_special_tokens = false` never prepends BOS (the tokenizers
    /// library's flag of that name: what rendered chat templates are encoded with).
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special_tokens && self.flags & FLAG_ADD_BOS != 0 {
            out.extend(self.bos);
        }
        let mut scratch = Vec::new();
        self.added.split(text, |s, e, id| match id {
            Some(id) => out.push(id),
            None => match self.kind {
                Kind::ByteLevel => self.encode_byte_level(&text[s..e], &mut out, &mut scratch),
                Kind::SentencePiece => self.encode_sp(&text[s..e], s == 0, &mut out, &mut scratch),
            },
        });
        out
    }

    /// Encodes a piece of generated text as the model would continue with it: no BOS,
    /// no added tokens matched in it, no SentencePiece ▁ prefix (a grammar engine's
    /// forced text, `session::constraint`).
    pub fn encode_fragment(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Vec::new();
        match self.kind {
            Kind::ByteLevel => self.encode_byte_level(text, &mut out, &mut scratch),
            Kind::SentencePiece => self.encode_sp_with(text, false, &mut out, &mut scratch),
        }
        out
    }

    fn encode_byte_level(&self, seg: &str, out: &mut Vec<u32>, scratch: &mut Vec<u32>) {
        let nfc;
        let seg = if self.flags & FLAG_NFC != 0
            && unicode_normalization::is_nfc_quick(seg.chars())
                != unicode_normalization::IsNormalized::Yes
        {
            nfc = seg.nfc().collect::<String>();
            nfc.as_str()
        } else {
            seg
        };
        let pretok = self
            .pretok
            .as_ref()
            .expect("byte-level tokenizer has a pre-tokenizer");
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        pretok.split(seg, &mut |piece| {
            let b = piece.as_bytes();
            if self.flags & FLAG_IGNORE_MERGES != 0 {
                if let Some(&id) = self.vocab.get(b) {
                    out.push(id);
                    return;
                }
            }
            if b.len() == 1 {
                out.extend(self.byte_symbol(b[0]));
                return;
            }
            if b.len() <= CACHE_MAX_LEN {
                if let Some(ids) = cache.get(b) {
                    out.extend_from_slice(ids);
                    return;
                }
            } else if pretok.encode_long_run(piece, &mut |p, v| self.bpe_piece(p, v), out) {
                return;
            }
            scratch.clear();
            scratch.extend(b.iter().filter_map(|&c| self.byte_symbol(c)));
            self.merges.apply(scratch);
            out.extend_from_slice(scratch);
            if b.len() <= CACHE_MAX_LEN {
                if cache.len() >= CACHE_MAX_ENTRIES {
                    cache.clear();
                }
                cache.insert(b.to_vec(), scratch.clone());
            }
        });
    }

    /// A byte-level piece's ids, uncached (the long-run path's slow reference).
    fn bpe_piece(&self, piece: &str, out: &mut Vec<u32>) {
        let b = piece.as_bytes();
        if self.flags & FLAG_IGNORE_MERGES != 0 {
            if let Some(&id) = self.vocab.get(b) {
                out.push(id);
                return;
            }
        }
        let mut syms: Vec<u32> = b.iter().filter_map(|&c| self.byte_symbol(c)).collect();
        self.merges.apply(&mut syms);
        out.extend_from_slice(&syms);
    }

    #[inline]
    fn byte_symbol(&self, b: u8) -> Option<u32> {
        let id = self.byte_tok[b as usize];
        (id != u32::MAX).then_some(id)
    }

    /// SentencePiece: spaces become ▁, the ▁ prefix is added as flagged, and the whole
    /// segment is one BPE word (the tokenizers library's SentencePiece-style files have
    /// no pre-tokenizer that splits it).
    fn encode_sp(&self, seg: &str, at_start: bool, out: &mut Vec<u32>, scratch: &mut Vec<u32>) {
        let prefix = if self.flags & FLAG_SP_NO_PREFIX != 0 {
            false
        } else if self.flags & FLAG_SP_PREFIX_FIRST != 0 {
            at_start
        } else {
            true
        };
        self.encode_sp_with(seg, prefix, out, scratch);
    }

    /// [`Self::encode_sp`] with the ▁ prefix decided.
    fn encode_sp_with(&self, seg: &str, prefix: bool, out: &mut Vec<u32>, scratch: &mut Vec<u32>) {
        if self.flags & FLAG_IGNORE_MERGES != 0 {
            let mut s = String::with_capacity(seg.len() * 2 + 3);
            if prefix {
                s.push_str(SPACE_MARK);
            }
            s.extend(seg.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
            if let Some(&id) = self.vocab.get(s.as_bytes()) {
                out.push(id);
                return;
            }
        }
        scratch.clear();
        let mut push = |c: char| match self.char_tok.get(&c) {
            Some(&id) => scratch.push(id),
            None => {
                let mut buf = [0u8; 4];
                scratch.extend(
                    c.encode_utf8(&mut buf)
                        .bytes()
                        .map(|b| self.byte_tok[b as usize]),
                );
            }
        };
        if prefix {
            push('\u{2581}');
        }
        for c in seg.chars() {
            push(if c == ' ' { '\u{2581}' } else { c });
        }
        self.merges.apply(scratch);
        out.extend_from_slice(scratch);
    }

    /// The bytes one token stands for in decoded text (▁ → space for SentencePiece).
    pub fn piece(&self, id: u32, out: &mut Vec<u8>) {
        let Some(t) = self.tokens.get(id as usize) else {
            return;
        };
        if self.kind == Kind::SentencePiece && self.attrs[id as usize] == Attr::Normal {
            let mark = SPACE_MARK.as_bytes();
            let mut i = 0;
            while i < t.len() {
                if t[i..].starts_with(mark) {
                    out.push(b' ');
                    i += mark.len();
                } else {
                    out.push(t[i]);
                    i += 1;
                }
            }
        } else {
            out.extend_from_slice(t);
        }
    }

    /// Whether decoding strips the space of the ▁ prefix from the first piece.
    fn strips_prefix(&self) -> bool {
        self.kind == Kind::SentencePiece && self.flags & FLAG_SP_NO_PREFIX == 0
    }

    /// Decodes ids to bytes (added tokens as their text; unknown ids are skipped). For
    /// SentencePiece files with a ▁ prefix, the prefix space of the first piece (after
    /// a leading BOS) is removed.
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        let mut first = true;
        for &id in ids {
            let start = out.len();
            self.piece(id, &mut out);
            if first && Some(id) != self.bos {
                if self.strips_prefix() && out.get(start) == Some(&b' ') {
                    out.remove(start);
                }
                first = false;
            }
        }
        out
    }

    /// A streaming decoder for generation.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            pending: Vec::new(),
            first: true,
        }
    }
}

/// Decodes ids one at a time, emitting only complete UTF-8: the bytes of an incomplete
/// character are held back until the next token completes them; bytes that can never
/// form a character become U+FFFD.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
    first: bool,
}

/// The length of the longest prefix of `b` that ends at a character boundary such that
/// the rest could still become a valid character.
fn complete_len(b: &[u8]) -> usize {
    let mut done = 0;
    loop {
        match std::str::from_utf8(&b[done..]) {
            Ok(_) => return b.len(),
            Err(e) => match e.error_len() {
                // Invalid bytes: final (they become U+FFFD); look past them.
                Some(n) => done += e.valid_up_to() + n,
                // An incomplete character at the end: hold it back.
                None => return done + e.valid_up_to(),
            },
        }
    }
}

impl StreamDecoder<'_> {
    /// Adds one token; returns the text that is now complete (maybe empty).
    pub fn push(&mut self, id: u32) -> String {
        let start = self.pending.len();
        self.tok.piece(id, &mut self.pending);
        if self.first && Some(id) != self.tok.bos {
            if self.tok.strips_prefix() && self.pending.get(start) == Some(&b' ') {
                self.pending.remove(start);
            }
            self.first = false;
        }
        let n = complete_len(&self.pending);
        let rest = self.pending.split_off(n);
        let done = std::mem::replace(&mut self.pending, rest);
        String::from_utf8_lossy(&done).into_owned()
    }

    /// Flushes what is held back (incomplete bytes become U+FFFD).
    pub fn finish(&mut self) -> String {
        let done = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&done).into_owned()
    }
}

/// Encodes `text` and renders the ids as one JSON array on one line.
pub fn encode_to_json(tok: &Tokenizer, text: &str) -> String {
    serde_json::to_string(&tok.encode(text)).unwrap_or_else(|_| "[]".into())
}

/// Parses ids given as a JSON array (or whitespace/comma separated numbers) and checks
/// them against the vocabulary.
pub fn parse_ids(text: &str, n_vocab: usize) -> Result<Vec<u32>> {
    let t = text.trim();
    let ids: Vec<u32> = if t.starts_with('[') {
        serde_json::from_str(t).map_err(|e| {
            FormatError::format("ids", t.chars().take(40).collect::<String>(), e.to_string())
        })?
    } else {
        t.split(|c: char| c.is_whitespace() || c == ',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u32>()
                    .map_err(|_| FormatError::format("ids", s, "not a token id"))
            })
            .collect::<Result<_>>()?
    };
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= n_vocab) {
        return Err(FormatError::shape(
            "ids",
            bad,
            format!("must be below n_vocab ({n_vocab})"),
        ));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_len_holds_back_partial_chars() {
        assert_eq!(complete_len(b"ab"), 2);
        assert_eq!(complete_len(b"a\xe2\x96"), 1);
        assert_eq!(complete_len(b"a\xff"), 2);
        assert_eq!(complete_len("é".as_bytes()), 2);
        assert_eq!(complete_len(b"\xffa\xe2\x96"), 2);
        assert_eq!(complete_len(b"\xe2\x96\xff\xf0"), 3);
    }
}
