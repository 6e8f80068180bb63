//! A GGUF file's tokenizer (`tokenizer.ggml.*`) ↔ MLT1.
//!
//! Import (`mlt-convert model.gguf`) builds the tokenizer Hugging Face builds from the
//! same metadata (transformers' `gguf_tokenizer_mapping.py`, whose output is what the
//! repository's GGUF-derived tokenizer.json files are), so the ids equal that library's:
//!
//! - `gpt2`: byte-level BPE. A token spelled in GPT-2's byte alphabet stands for those
//!   bytes, any other token for its own UTF-8; control tokens (type 3) spelled in the
//!   alphabet and user-defined tokens (type 4) found in the vocabulary are added tokens
//!   (matched literally); `tokenizer.ggml.merges` in rank order. The pre-tokenizer
//!   comes from `tokenizer.ggml.pre` by name, as llama.cpp implements it (which is the
//!   model's original tokenizer: SmolLM's "smollm" splits digits first); a name whose
//!   regex MLT1 cannot reproduce exactly is refused. "qwen2"/"qwen35" also NFC-normalize,
//!   as the Qwen tokenizer.json files do (llama.cpp does not).
//! - `llama`: SentencePiece-style BPE with byte fallback. The file has no merges: they
//!   are every split of every piece into two pieces, ranked by the piece's score, or by
//!   its position in the file for Gemma (whose scores do not follow its merge order),
//!   then the longer left part, then the longer right part; Gemma's pieces of spaces
//!   (stored as spaces) are spelled with ▁. `add_space_prefix` false gives no ▁ prefix.
//!
//! Export (`mlb-export`) writes the same keys from an `.mlt`, and is refused unless
//! importing what it wrote gives back the same `.mlt`.
//!
//! Chat: `tokenizer.chat_template` is the default template and each
//! `tokenizer.chat_template.NAME` a named one (gguf-py's `add_chat_template`, which
//! also lists the names in `tokenizer.chat_templates`). The section is built by
//! [`crate::chat::capture::build_section`] as for a Hugging Face folder: the special
//! strings are the texts of the `bos/eos/unknown/seperator/padding/cls/mask_token_id`
//! tokens, the stop set EOS, each template's end-of-turn token, and llama.cpp's
//! `eot_token_id`/`eom_token_id` (end-of-turn). Export writes the templates and, when
//! an end-of-turn stop token is not EOS, `eot_token_id`.

use std::collections::HashMap;

use crate::chat::capture::build_section;
use crate::chat::capture::ChatOptions;
use crate::format::gguf::{GgufView, MetaValue, Value, ValueType};
use crate::format::mlt::{
    Attr, Kind, Merge, Mlt, Parts, Token, FLAG_ADD_BOS, FLAG_CHAT, FLAG_DIGITS_SPLIT,
    FLAG_GPT2_REGEX, FLAG_IGNORE_MERGES, FLAG_LETTER_MARKS, FLAG_NFC, FLAG_SINGLE_DIGITS,
    FLAG_SP_NO_PREFIX,
};
use crate::format::mlt_chat::{
    ChatSection, NamedTemplate, StopToken, DEFAULT_TEMPLATE, STOP_END_OF_TURN,
};
use crate::format::{FormatError, Result};
use crate::tokenizer::from_hf::gpt2_chars;

/// llama.cpp's token types.
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const BYTE: i64 = 6;

/// llama.cpp pre-tokenizer names MLT1 reproduces, with their flags.
const PRE: &[(&str, u32)] = &[
    ("gpt-2", FLAG_GPT2_REGEX),
    ("smollm", FLAG_DIGITS_SPLIT | FLAG_GPT2_REGEX),
    ("llama-bpe", FLAG_IGNORE_MERGES),
    ("llama3", FLAG_IGNORE_MERGES),
    ("llama-v3", FLAG_IGNORE_MERGES),
    ("qwen2", FLAG_SINGLE_DIGITS | FLAG_NFC),
    ("deepseek-r1-qwen", FLAG_SINGLE_DIGITS | FLAG_NFC),
    ("qwen35", FLAG_SINGLE_DIGITS | FLAG_LETTER_MARKS | FLAG_NFC),
];

/// Flags that come from the pre-tokenizer name.
const PRE_FLAGS: u32 = FLAG_GPT2_REGEX
    | FLAG_DIGITS_SPLIT
    | FLAG_IGNORE_MERGES
    | FLAG_SINGLE_DIGITS
    | FLAG_NFC
    | FLAG_LETTER_MARKS;

/// GGUF architectures whose SentencePiece merges follow token positions.
const GEMMA_ARCHS: &[&str] = &["gemma", "gemma2", "gemma3"];

fn bad(key: &str, v: impl std::fmt::Display, rule: impl Into<String>) -> FormatError {
    FormatError::format(key, v, rule)
}

/// A tensorless GGUF of `general.architecture` then `parts`, to import back and compare:
/// only what comes back exactly is written. A write error is blamed on `field`.
fn probe_gguf(arch: &str, parts: &[&[(String, MetaValue)]], field: &str) -> Result<Vec<u8>> {
    let mut probe = vec![(
        "general.architecture".to_string(),
        MetaValue::Str(arch.to_string()),
    )];
    for part in parts {
        probe.extend(part.iter().cloned());
    }
    crate::format::gguf::to_bytes(&probe, &[]).map_err(|e| match e {
        crate::format::mlb::WriteError::Format(f) => f,
        crate::format::mlb::WriteError::Io(e) => bad(field, "", e.to_string()),
    })
}

fn strings<'a>(v: &GgufView<'a>, key: &str) -> Result<Option<Vec<&'a str>>> {
    match v.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) if a.elem == ValueType::String => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_str()
                    .ok_or_else(|| bad(&format!("{key}[{i}]"), x, "not UTF-8"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(x) => Err(bad(key, x, "must be an array of strings")),
    }
}

fn numbers(v: &GgufView, key: &str, n: usize) -> Result<Option<Vec<f64>>> {
    match v.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => {
            if a.len != n {
                return Err(bad(
                    key,
                    Value::Array(*a),
                    format!("must have {n} entries, one per token"),
                ));
            }
            a.iter()
                .map(|x| {
                    x.as_f64()
                        .or_else(|| x.as_i64().map(|i| i as f64))
                        .ok_or_else(|| bad(key, Value::Array(*a), "must hold numbers"))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some)
        }
        Some(x) => Err(bad(key, x, "must be an array")),
    }
}

fn id_opt(v: &GgufView, key: &str, n: usize) -> Result<Option<u32>> {
    match v.get(key) {
        None => Ok(None),
        Some(x) => match x.as_u64() {
            Some(id) if (id as usize) < n => Ok(Some(id as u32)),
            // llama.cpp writes -1 (as i32) or u32::MAX for "none" in some files.
            _ if x.as_i64() == Some(-1) || x.as_u64() == Some(u32::MAX as u64) => Ok(None),
            _ => Err(bad(key, x, format!("must be a token id below {n}"))),
        },
    }
}

fn bool_opt(v: &GgufView, key: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad(key, x, "must be a bool")),
    }
}

/// The default chat template's key; named ones are `{CHAT_TEMPLATE}.NAME`.
pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";
/// gguf-py's list of the named templates' names.
const CHAT_TEMPLATES: &str = "tokenizer.chat_templates";
/// llama.cpp's end-of-turn and end-of-message tokens.
const EOT_ID: &str = "tokenizer.ggml.eot_token_id";
const EOM_ID: &str = "tokenizer.ggml.eom_token_id";
/// transformers' special-token names and the GGUF keys of their ids (BOS and EOS come
/// from the tokenizer itself, so `--bos`/`--eos` apply).
const SPECIAL_IDS: [(&str, &str); 5] = [
    ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ("sep_token", "tokenizer.ggml.seperator_token_id"),
    ("pad_token", "tokenizer.ggml.padding_token_id"),
    ("cls_token", "tokenizer.ggml.cls_token_id"),
    ("mask_token", "tokenizer.ggml.mask_token_id"),
];

/// The chat templates of a GGUF: the default first, then the named ones in file order.
pub fn templates_from_gguf(v: &GgufView) -> Result<Vec<NamedTemplate>> {
    let mut out = Vec::new();
    for kv in &v.kvs {
        let name = if kv.key == CHAT_TEMPLATE {
            DEFAULT_TEMPLATE
        } else if let Some(n) = kv.key.strip_prefix("tokenizer.chat_template.") {
            n
        } else {
            continue;
        };
        let source = kv
            .value
            .as_str()
            .ok_or_else(|| bad(kv.key, kv.value, "must be a string (a Jinja template)"))?;
        if name.is_empty() {
            return Err(bad(kv.key, "", "a template name must not be empty"));
        }
        out.push(NamedTemplate {
            name: name.to_string(),
            source: source.to_string(),
        });
    }
    // The default first, as a Hugging Face folder's chat_template.jinja.
    out.sort_by_key(|t| t.name != DEFAULT_TEMPLATE);
    Ok(out)
}

/// The chat section of a GGUF for its tokenizer `m` (`None`: no template, or
/// `opts.disable`). `opts.template_file` replaces the file's templates.
pub fn chat_from_gguf(v: &GgufView, m: &Mlt, opts: &ChatOptions) -> Result<Option<ChatSection>> {
    if opts.disable {
        return Ok(None);
    }
    let templates = match &opts.template_file {
        Some(f) => {
            let source = std::fs::read(f)
                .map_err(|e| FormatError::io(f, &e))
                .and_then(|b| {
                    String::from_utf8(b)
                        .map_err(|_| bad("--chat-template", f.display(), "not UTF-8"))
                })?;
            vec![NamedTemplate {
                name: DEFAULT_TEMPLATE.into(),
                source,
            }]
        }
        None => templates_from_gguf(v)?,
    };
    let n = m.tokens.len();
    let text = |id: u32| String::from_utf8(m.tokens[id as usize].bytes.clone()).ok();
    let mut specials = Vec::new();
    for (name, id) in [("bos_token", m.bos), ("eos_token", m.eos)] {
        if let Some(t) = id.and_then(text) {
            specials.push((name.to_string(), t));
        }
    }
    for (name, key) in SPECIAL_IDS {
        if let Some(t) = id_opt(v, key, n)?.and_then(text) {
            specials.push((name.to_string(), t));
        }
    }
    let section = build_section(m, templates, specials, &[], &opts.stop_tokens)?;
    let Some(mut section) = section else {
        if let Some(t) = opts.stop_tokens.first() {
            return Err(bad(
                "--stop-token",
                t,
                "a stop set is written with a chat template; the file has none (give one with --chat-template FILE)",
            ));
        }
        return Ok(None);
    };
    // llama.cpp's end-of-turn and end-of-message tokens end a turn.
    for key in [EOT_ID, EOM_ID] {
        if let Some(id) = id_opt(v, key, n)? {
            match section.stop.iter_mut().find(|s| s.id == id) {
                Some(s) => s.sources |= STOP_END_OF_TURN,
                None => section.stop.push(StopToken {
                    id,
                    sources: STOP_END_OF_TURN,
                }),
            }
        }
    }
    section.stop.sort_by_key(|s| s.id);
    section.validate(n as u32)?;
    Ok(Some(section))
}

/// The chat keys of `section` for a GGUF: the templates, and `eot_token_id` when an
/// end-of-turn stop token is not EOS (`eos`).
fn chat_kvs(section: &ChatSection, eos: Option<u32>) -> Vec<(String, MetaValue)> {
    let mut kv = Vec::new();
    let mut names = Vec::new();
    for t in &section.templates {
        if t.name == DEFAULT_TEMPLATE {
            kv.push((CHAT_TEMPLATE.to_string(), MetaValue::Str(t.source.clone())));
        } else {
            names.push(t.name.clone());
            kv.push((
                format!("{CHAT_TEMPLATE}.{}", t.name),
                MetaValue::Str(t.source.clone()),
            ));
        }
    }
    if !names.is_empty() {
        kv.push((CHAT_TEMPLATES.to_string(), MetaValue::strings(names)));
    }
    if let Some(s) = section
        .stop
        .iter()
        .find(|s| s.sources & STOP_END_OF_TURN != 0 && Some(s.id) != eos)
    {
        kv.push((EOT_ID.to_string(), MetaValue::U32(s.id)));
    }
    kv
}

/// Python's `str.isspace`: Unicode White_Space plus the separators U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The tokenizer of a GGUF file.
pub fn mlt_from_gguf(v: &GgufView) -> Result<Mlt> {
    let model = match v.get("tokenizer.ggml.model") {
        None => {
            return Err(bad(
                "tokenizer.ggml.model",
                "missing",
                "the file has no tokenizer",
            ))
        }
        Some(x) => x
            .as_str()
            .ok_or_else(|| bad("tokenizer.ggml.model", x, "must be a string"))?,
    };
    let tokens = strings(v, "tokenizer.ggml.tokens")?
        .ok_or_else(|| bad("tokenizer.ggml.tokens", "missing", "required key"))?;
    let n = tokens.len();
    if n == 0 {
        return Err(bad("tokenizer.ggml.tokens", "[]", "no tokens"));
    }
    let types: Vec<i64> = match numbers(v, "tokenizer.ggml.token_type", n)? {
        Some(t) => t.into_iter().map(|x| x as i64).collect(),
        None => vec![NORMAL; n],
    };
    if bool_opt(v, "tokenizer.ggml.add_eos_token")? == Some(true) {
        return Err(bad(
            "tokenizer.ggml.add_eos_token",
            true,
            "appending EOS is not supported",
        ));
    }
    let bos = id_opt(v, "tokenizer.ggml.bos_token_id", n)?;
    let eos = id_opt(v, "tokenizer.ggml.eos_token_id", n)?;
    let add_bos_key = bool_opt(v, "tokenizer.ggml.add_bos_token")?;
    let arch = v
        .get("general.architecture")
        .and_then(|x| x.as_str())
        .unwrap_or("");
    let parts =
        match model {
            "gpt2" => byte_level(v, &tokens, &types)?,
            "llama" => sentencepiece(v, &tokens, &types, GEMMA_ARCHS.contains(&arch))?,
            other => return Err(bad(
                "tokenizer.ggml.model",
                format!("{other:?}"),
                "only \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece BPE) are supported",
            )),
        };
    // llama.cpp's defaults: BOS for SentencePiece and the Llama 3 family.
    let (kind, flags) = (parts.0, parts.1);
    let add_bos =
        add_bos_key.unwrap_or(kind == Kind::SentencePiece || flags & FLAG_IGNORE_MERGES != 0);
    let mlt = Mlt::from_parts(
        parts,
        bos,
        eos,
        add_bos,
        "tokenizer.ggml.bos_token_id",
        "missing",
    )?;
    crate::tokenizer::Tokenizer::from_mlt(&mlt)?;
    Ok(mlt)
}

fn byte_level(v: &GgufView, tokens: &[&str], types: &[i64]) -> Result<Parts> {
    let pre = v
        .get("tokenizer.ggml.pre")
        .map(|x| {
            x.as_str()
                .ok_or_else(|| bad("tokenizer.ggml.pre", x, "must be a string"))
        })
        .transpose()?
        .unwrap_or("");
    let flags = PRE
        .iter()
        .find(|(name, _)| *name == pre)
        .map(|(_, f)| *f)
        .ok_or_else(|| {
            bad(
                "tokenizer.ggml.pre",
                format!("{pre:?}"),
                format!(
                    "a pre-tokenizer MLT1 cannot reproduce exactly (known: {})",
                    PRE.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
    let (to_char, to_byte) = gpt2_chars();
    let in_alphabet = |t: &str| t.chars().all(|c| to_byte.contains_key(&c));
    // The vocabulary as transformers keys it: spelled tokens as they are, others
    // spelled from their UTF-8 bytes (the last of equal keys wins, as in a dict).
    let mut keys: HashMap<String, u32> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        let key = if in_alphabet(t) {
            t.to_string()
        } else {
            t.bytes().map(|b| to_char[b as usize]).collect()
        };
        keys.insert(key, i as u32);
    }
    let mut out = Vec::with_capacity(tokens.len());
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        let spelled = in_alphabet(t);
        let added = (ty == CONTROL && spelled) || (ty == USER_DEFINED && keys.contains_key(*t));
        let tok = if added {
            Token {
                attr: Attr::Added,
                bytes: t.as_bytes().to_vec(),
            }
        } else if spelled {
            Token {
                attr: Attr::Normal,
                bytes: t.chars().map(|c| to_byte[&c]).collect(),
            }
        } else {
            Token {
                attr: Attr::Normal,
                bytes: t.as_bytes().to_vec(),
            }
        };
        if tok.bytes.is_empty() {
            return Err(bad(
                &format!("tokenizer.ggml.tokens[{i}]"),
                "\"\"",
                "empty token",
            ));
        }
        out.push(tok);
    }
    let merge_strs = strings(v, "tokenizer.ggml.merges")?.ok_or_else(|| {
        bad(
            "tokenizer.ggml.merges",
            "missing",
            "a byte-level BPE needs merges",
        )
    })?;
    let mut merges = Vec::with_capacity(merge_strs.len());
    for (i, m) in merge_strs.iter().enumerate() {
        let key = format!("tokenizer.ggml.merges[{i}]");
        let (l, r) = m
            .split_once(' ')
            .filter(|(_, r)| !r.contains(' '))
            .ok_or_else(|| bad(&key, format!("{m:?}"), "must be \"left right\""))?;
        let look = |p: &str| {
            keys.get(p)
                .copied()
                .ok_or_else(|| bad(&key, format!("{m:?}"), format!("{p:?} is not a token")))
        };
        merges.push(Merge {
            left: look(l)?,
            right: look(r)?,
            merged: look(&format!("{l}{r}"))?,
        });
    }
    Ok((Kind::ByteLevel, flags, out, merges))
}

/// A SentencePiece byte-fallback piece `<0xXX>`.
fn byte_piece(p: &str) -> Option<u8> {
    let hex = p.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn sentencepiece(v: &GgufView, tokens: &[&str], types: &[i64], gemma: bool) -> Result<Parts> {
    if v.get("tokenizer.ggml.merges").is_some() {
        return Err(bad(
            "tokenizer.ggml.merges",
            "present",
            "a SentencePiece vocabulary with explicit merges is not supported",
        ));
    }
    let n = tokens.len();
    // Gemma stores pieces of two or more spaces as spaces; they are ▁ pieces.
    let pieces: Vec<String> = tokens
        .iter()
        .map(|t| {
            if gemma && t.contains(' ') && t.chars().all(py_space) {
                "\u{2581}".repeat(t.chars().count())
            } else {
                t.to_string()
            }
        })
        .collect();
    let mut vocab: HashMap<&str, u32> = HashMap::with_capacity(n);
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert(p.as_str(), i as u32);
    }
    // Rank key per piece: position (Gemma) or score.
    let key: Vec<f64> = if gemma {
        (0..n).map(|i| -(i as f64)).collect()
    } else {
        numbers(v, "tokenizer.ggml.scores", n)?.ok_or_else(|| {
            bad(
                "tokenizer.ggml.scores",
                "missing",
                "needed to rank the merges",
            )
        })?
    };
    // transformers' generate_merges: pieces in dict order (first position of each
    // distinct piece, last value), splits sorted by (left id, right id), then a stable
    // sort by (key, left length, right length), descending.
    let mut first: HashMap<&str, usize> = HashMap::with_capacity(n);
    let mut order: Vec<&str> = Vec::with_capacity(n);
    let mut score: HashMap<&str, f64> = HashMap::with_capacity(n);
    for (i, p) in pieces.iter().enumerate() {
        if first.insert(p.as_str(), i).is_none() {
            order.push(p.as_str());
        }
        score.insert(p.as_str(), key[i]);
    }
    let mut all: Vec<(u32, u32, u32, f64, usize, usize)> = Vec::new();
    for p in order {
        let mut local = Vec::new();
        for (at, _) in p.char_indices().skip(1) {
            let (l, r) = (&p[..at], &p[at..]);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                local.push((
                    li,
                    ri,
                    vocab[p],
                    score[p],
                    l.chars().count(),
                    r.chars().count(),
                ));
            }
        }
        local.sort_by_key(|x| (x.0, x.1));
        all.extend(local);
    }
    all.sort_by(|a, b| {
        (b.3, b.4, b.5)
            .partial_cmp(&(a.3, a.4, a.5))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let merges = all
        .into_iter()
        .map(|(left, right, merged, ..)| Merge {
            left,
            right,
            merged,
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        let key = format!("tokenizer.ggml.tokens[{i}]");
        let tok = if ty == BYTE {
            let b = byte_piece(t)
                .ok_or_else(|| bad(&key, format!("{t:?}"), "a byte token must be <0xXX>"))?;
            Token {
                attr: Attr::Byte,
                bytes: vec![b],
            }
        } else if ty == CONTROL || (ty == USER_DEFINED && vocab.contains_key(*t)) {
            Token {
                attr: Attr::Added,
                bytes: t.as_bytes().to_vec(),
            }
        } else {
            Token {
                attr: Attr::Normal,
                bytes: pieces[i].as_bytes().to_vec(),
            }
        };
        if tok.bytes.is_empty() {
            return Err(bad(&key, "\"\"", "empty token"));
        }
        out.push(tok);
    }
    let prefix = bool_opt(v, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let flags = if prefix { 0 } else { FLAG_SP_NO_PREFIX };
    Ok((Kind::SentencePiece, flags, out, merges))
}

/// Reads a GGUF file's tokenizer (`mlt-convert model.gguf`).
pub fn mlt_from_gguf_file(path: &std::path::Path) -> Result<Mlt> {
    let f = std::fs::File::open(path).map_err(|e| FormatError::io(path, &e))?;
    // SAFETY: a read-only map of an input file (the mmap caveat, docs/reliability.md).
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| FormatError::io(path, &e))?;
    let v = crate::format::gguf::parse(&map).map_err(|e| e.in_file(path))?;
    mlt_from_gguf(&v).map_err(|e| e.in_file(path))
}

/// `mlt-convert model.gguf -o out.mlt`: the tokenizer, with BOS/EOS overridden by
/// token text when given, written atomically.
pub fn convert_file(
    input: &std::path::Path,
    output: &std::path::Path,
    bos: Option<&str>,
    eos: Option<&str>,
    chat: &ChatOptions,
) -> Result<Mlt> {
    if let Err(e) = crate::atomic::check_not_input(output, &[input]) {
        return Err(bad("-o", output.display(), e.to_string()));
    }
    let f = std::fs::File::open(input).map_err(|e| FormatError::io(input, &e))?;
    // SAFETY: a read-only map of an input file (the mmap caveat, docs/reliability.md).
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| FormatError::io(input, &e))?;
    let v = crate::format::gguf::parse(&map).map_err(|e| e.in_file(input))?;
    let mut mlt = mlt_from_gguf(&v).map_err(|e| e.in_file(input))?;
    for (name, text, slot) in [("--bos", bos, &mut mlt.bos), ("--eos", eos, &mut mlt.eos)] {
        if let Some(t) = text {
            let id = mlt
                .tokens
                .iter()
                .position(|x| x.bytes == t.as_bytes())
                .ok_or_else(|| bad(name, format!("{t:?}"), "no such token"))?;
            *slot = Some(id as u32);
        }
    }
    if let Some(section) = chat_from_gguf(&v, &mlt, chat).map_err(|e| e.in_file(input))? {
        mlt.chat = Some(section);
        mlt.flags |= FLAG_CHAT;
    }
    crate::tokenizer::Tokenizer::from_mlt(&mlt).map_err(|e| e.in_file(input))?;
    let bytes = mlt.to_bytes().map_err(|e| e.in_file(output))?;
    crate::atomic::write(output, &bytes).map_err(|e| FormatError::io(output, &e))?;
    Ok(mlt)
}

/// The `tokenizer.*` metadata of an `.mlt` for `arch` (a GGUF architecture): the
/// tokenizer, then the chat templates. Refused when importing it would not give the
/// same tokenizer and templates back.
pub fn gguf_tokenizer_kvs(mlt: &Mlt, arch: &str) -> Result<Vec<(String, MetaValue)>> {
    let mut plain = mlt.clone();
    plain.chat = None;
    plain.flags &= !FLAG_CHAT;
    let mut kv = tokenizer_kvs(&plain, arch)?;
    if let Some(c) = &mlt.chat {
        let chat = chat_kvs(c, mlt.eos);
        let bytes = probe_gguf(arch, &[&kv, &chat], "chat_template")?;
        let view = crate::format::gguf::parse(&bytes)?;
        let mut back = templates_from_gguf(&view)?;
        let mut want = c.templates.clone();
        back.sort_by(|a, b| a.name.cmp(&b.name));
        want.sort_by(|a, b| a.name.cmp(&b.name));
        if back != want {
            return Err(bad(
                "chat_template",
                "",
                "the templates cannot be written as GGUF metadata exactly",
            ));
        }
        kv.extend(chat);
    }
    Ok(kv)
}

fn tokenizer_kvs(mlt: &Mlt, arch: &str) -> Result<Vec<(String, MetaValue)>> {
    let mut kv: Vec<(String, MetaValue)> = Vec::new();
    let n = mlt.tokens.len();
    let text = |i: usize, t: &Token| {
        String::from_utf8(t.bytes.clone()).map_err(|_| {
            bad(
                &format!("tokens[{i}]"),
                format!("{:02x?}", &t.bytes[..t.bytes.len().min(8)]),
                "not UTF-8: GGUF token strings are UTF-8",
            )
        })
    };
    let mut types = Vec::with_capacity(n);
    let mut strs = Vec::with_capacity(n);
    match mlt.kind {
        Kind::ByteLevel => {
            let pre = PRE
                .iter()
                .find(|(_, f)| *f == mlt.flags & PRE_FLAGS)
                .map(|(name, _)| *name)
                .ok_or_else(|| {
                    bad(
                        "flags",
                        format!("{:?}", mlt.flag_names()),
                        "no llama.cpp pre-tokenizer splits text this way",
                    )
                })?;
            let (to_char, _) = gpt2_chars();
            for (i, t) in mlt.tokens.iter().enumerate() {
                match t.attr {
                    Attr::Added => {
                        strs.push(text(i, t)?);
                        types.push(CONTROL as i32);
                    }
                    _ => {
                        strs.push(t.bytes.iter().map(|&b| to_char[b as usize]).collect());
                        types.push(NORMAL as i32);
                    }
                }
            }
            let merges: Vec<String> = mlt
                .merges
                .iter()
                .map(|m| format!("{} {}", strs[m.left as usize], strs[m.right as usize]))
                .collect();
            kv.push(("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())));
            kv.push(("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())));
            kv.push(("tokenizer.ggml.tokens".into(), MetaValue::strings(strs)));
            kv.push(token_types(types));
            kv.push(("tokenizer.ggml.merges".into(), MetaValue::strings(merges)));
        }
        Kind::SentencePiece => {
            let mut scores = Vec::with_capacity(n);
            for (i, t) in mlt.tokens.iter().enumerate() {
                let (s, ty, score) = match t.attr {
                    Attr::Byte => (format!("<0x{:02X}>", t.bytes[0]), BYTE, 0.0),
                    Attr::Added => (text(i, t)?, CONTROL, -1000.0),
                    Attr::Normal => (text(i, t)?, NORMAL, -(i as f32)),
                };
                strs.push(s);
                types.push(ty as i32);
                scores.push(MetaValue::F32(score));
            }
            kv.push((
                "tokenizer.ggml.model".into(),
                MetaValue::Str("llama".into()),
            ));
            kv.push(("tokenizer.ggml.tokens".into(), MetaValue::strings(strs)));
            kv.push((
                "tokenizer.ggml.scores".into(),
                MetaValue::Array(ValueType::F32, scores),
            ));
            kv.push(token_types(types));
            kv.push((
                "tokenizer.ggml.add_space_prefix".into(),
                MetaValue::Bool(mlt.flags & FLAG_SP_NO_PREFIX == 0),
            ));
        }
    }
    if let Some(b) = mlt.bos {
        kv.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(b)));
    }
    if let Some(e) = mlt.eos {
        kv.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(e)));
    }
    kv.push((
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(mlt.flags & FLAG_ADD_BOS != 0),
    ));
    // Only what importing it gives back exactly is written.
    let bytes = probe_gguf(arch, &[&kv], "tokenizer")?;
    let view = crate::format::gguf::parse(&bytes)?;
    let back = mlt_from_gguf(&view)?;
    if back != *mlt {
        let what = if back.tokens != mlt.tokens {
            let i = back
                .tokens
                .iter()
                .zip(&mlt.tokens)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            format!("token {i} would read back differently")
        } else if back.merges != mlt.merges {
            "its merges are not the ones llama.cpp's vocabulary implies (every split of a piece, ranked by the piece)".to_string()
        } else {
            format!(
                "flags {:?} would read back as {:?}",
                mlt.flag_names(),
                back.flag_names()
            )
        };
        return Err(bad(
            "tokenizer",
            format!("{:?}", mlt.kind),
            format!("cannot be written as GGUF metadata exactly: {what}"),
        ));
    }
    Ok(kv)
}

fn token_types(types: Vec<i32>) -> (String, MetaValue) {
    (
        "tokenizer.ggml.token_type".into(),
        MetaValue::Array(
            ValueType::I32,
            types.into_iter().map(MetaValue::I32).collect(),
        ),
    )
}
