//! tokenizer.json (Hugging Face tokenizers) → MLT1.
//!
//! Every normalizer, pre-tokenizer, model, decoder and post-processor option is
//! checked: a setting that MLT1 reproduces exactly sets the matching kind and flags,
//! anything else is refused with the key and value, never approximated. Vocabulary
//! ids must be dense (holes are refused). Byte-level pieces are stored as the raw
//! bytes their GPT-2 characters stand for.

use super::error::{refuse, FormatError, Result};
use super::pretok::{llama3_pattern, GPT2_PATTERN};
use crate::format::mlt::{
    Attr, Kind, Merge, Mlt, Token, FLAG_DIGITS_SPLIT, FLAG_GPT2_REGEX, FLAG_IGNORE_MERGES,
    FLAG_LETTER_MARKS, FLAG_NFC, FLAG_SINGLE_DIGITS, FLAG_SP_NO_PREFIX,
};
use serde_json::Value;
use std::collections::HashMap;

/// Overrides given on the command line.
#[derive(Debug, Default, Clone)]
pub struct HfTokenizerOptions {
    /// BOS token text, replacing tokenizer_config.json's.
    pub bos: Option<String>,
    /// EOS token text, replacing tokenizer_config.json's.
    pub eos: Option<String>,
}

fn null_or(v: Option<&Value>) -> &Value {
    v.unwrap_or(&Value::Null)
}

/// The array `v[key]`; empty when it is missing or not an array.
fn members<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn type_of(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// Requires `v[key]` to equal `want`, naming `field.key` otherwise.
fn expect(v: &Value, field: &str, key: &str, want: &Value) -> Result<()> {
    let got = null_or(v.get(key));
    if got != want {
        return Err(refuse(
            &format!("{field}.{key}"),
            got,
            &format!("only {want} is supported"),
        ));
    }
    Ok(())
}

/// GPT-2's byte ↔ printable character map, both ways (byte → char, char → byte).
pub(crate) fn gpt2_chars() -> ([char; 256], HashMap<char, u8>) {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut to_char = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        to_char[b as usize] = char::from_u32(c).expect("valid scalar");
    }
    let to_byte = to_char
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect();
    (to_char, to_byte)
}

/// The flags a byte-level pre-tokenizer stands for.
fn byte_level_pretok(pre: &Value) -> Result<u32> {
    let steps: Vec<(String, &Value)> = match type_of(pre) {
        "Sequence" => match pre.get("pretokenizers").and_then(Value::as_array) {
            Some(a) => a
                .iter()
                .enumerate()
                .map(|(i, p)| (format!("pre_tokenizer.pretokenizers[{i}]"), p))
                .collect(),
            None => {
                return Err(refuse(
                    "pre_tokenizer.pretokenizers",
                    null_or(pre.get("pretokenizers")),
                    "must be a list",
                ))
            }
        },
        _ => vec![("pre_tokenizer".to_string(), pre)],
    };
    let mut flags = 0;
    let mut i = 0;
    if let Some((f, p)) = steps.first() {
        if type_of(p) == "Digits" {
            expect(p, f, "individual_digits", &Value::Bool(true))?;
            flags |= FLAG_DIGITS_SPLIT;
            i = 1;
        }
    }
    let rest = &steps[i..];
    match rest {
        [(f, bl)] if type_of(bl) == "ByteLevel" => {
            expect(bl, f, "add_prefix_space", &Value::Bool(false))?;
            expect(bl, f, "use_regex", &Value::Bool(true))?;
            flags |= FLAG_GPT2_REGEX;
        }
        [(fs, split), (fb, bl)] if type_of(split) == "Split" && type_of(bl) == "ByteLevel" => {
            expect(bl, fb, "add_prefix_space", &Value::Bool(false))?;
            expect(bl, fb, "use_regex", &Value::Bool(false))?;
            expect(split, fs, "behavior", &Value::from("Isolated"))?;
            expect(split, fs, "invert", &Value::Bool(false))?;
            let pat = split.get("pattern").and_then(|p| p.get("Regex")).and_then(Value::as_str);
            let Some(pat) = pat else {
                return Err(refuse(&format!("{fs}.pattern"), null_or(split.get("pattern")), "must be a known Regex"));
            };
            flags |= regex_flags(pat).ok_or_else(|| {
                FormatError::format(
                    format!("{fs}.pattern.Regex"),
                    pat,
                    "unknown pre-tokenizer regex (known: Llama 3, Qwen2/3 single-digit, Qwen3.5 letter-marks, GPT-2)",
                )
            })?;
        }
        _ => {
            return Err(refuse(
                "pre_tokenizer",
                pre,
                "a byte-level pre-tokenizer must be [Digits(individual_digits)] then ByteLevel(use_regex) or Split(known regex) + ByteLevel",
            ))
        }
    }
    Ok(flags)
}

/// The flags of a known Split regex, if it is one.
fn regex_flags(pat: &str) -> Option<u32> {
    if pat == GPT2_PATTERN {
        return Some(FLAG_GPT2_REGEX);
    }
    for (digits, marks) in [(false, false), (true, false), (false, true), (true, true)] {
        if pat == llama3_pattern(digits, marks) {
            let mut f = 0;
            if digits {
                f |= FLAG_SINGLE_DIGITS;
            }
            if marks {
                f |= FLAG_LETTER_MARKS;
            }
            return Some(f);
        }
    }
    None
}

fn is_replace(v: &Value, from: &str, to: &str) -> bool {
    type_of(v) == "Replace"
        && v.get("pattern")
            .and_then(|p| p.get("String"))
            .and_then(Value::as_str)
            == Some(from)
        && v.get("content").and_then(Value::as_str) == Some(to)
}

/// Decides the kind and the normalizer/pre-tokenizer/decoder flags.
fn kind_and_flags(j: &Value) -> Result<(Kind, u32)> {
    let norm = null_or(j.get("normalizer"));
    let pre = null_or(j.get("pre_tokenizer"));
    let dec = null_or(j.get("decoder"));
    let sp_norm = if is_replace(norm, " ", "\u{2581}") {
        Some(FLAG_SP_NO_PREFIX)
    } else if type_of(norm) == "Sequence" {
        let n = members(norm, "normalizers");
        match n {
            [p, r]
                if type_of(p) == "Prepend"
                    && p.get("prepend").and_then(Value::as_str) == Some("\u{2581}")
                    && is_replace(r, " ", "\u{2581}") =>
            {
                Some(0)
            }
            _ => None,
        }
    } else {
        None
    };
    if let Some(flags) = sp_norm {
        // After spaces became ▁ a Split on " " finds nothing: it is a no-op.
        let noop_split = type_of(pre) == "Split"
            && pre
                .get("pattern")
                .and_then(|p| p.get("String"))
                .and_then(Value::as_str)
                == Some(" ")
            && pre.get("invert") != Some(&Value::Bool(true));
        if !pre.is_null() && !noop_split {
            return Err(refuse(
                "pre_tokenizer",
                pre,
                "a SentencePiece-style file supports no pre-tokenizer (or a no-op Split on \" \")",
            ));
        }
        check_sp_decoder(dec, flags & FLAG_SP_NO_PREFIX == 0)?;
        return Ok((Kind::SentencePiece, flags));
    }
    let mut flags = match type_of(norm) {
        "" if norm.is_null() => 0,
        "NFC" => FLAG_NFC,
        _ => {
            return Err(refuse(
                "normalizer",
                norm,
                "only null, NFC (byte-level) or SentencePiece Replace/Prepend are supported",
            ))
        }
    };
    if type_of(pre) == "Metaspace" {
        return Err(refuse(
            "pre_tokenizer",
            pre,
            "Metaspace is not supported (its prefix rules differ from MLT1's)",
        ));
    }
    flags |= byte_level_pretok(pre)?;
    if type_of(dec) != "ByteLevel" {
        return Err(refuse(
            "decoder",
            dec,
            "a byte-level file needs the ByteLevel decoder",
        ));
    }
    Ok((Kind::ByteLevel, flags))
}

fn check_sp_decoder(dec: &Value, prefix: bool) -> Result<()> {
    let steps = members(dec, "decoders");
    let ok_step = |s: &Value| {
        is_replace(s, "\u{2581}", " ")
            || matches!(type_of(s), "ByteFallback" | "Fuse")
            || (prefix
                && type_of(s) == "Strip"
                && s.get("content").and_then(Value::as_str) == Some(" ")
                && s.get("start").and_then(Value::as_u64) == Some(1)
                && s.get("stop").and_then(Value::as_u64) == Some(0))
    };
    if type_of(dec) != "Sequence" || steps.is_empty() || !steps.iter().all(ok_step) {
        return Err(refuse(
            "decoder",
            dec,
            "a SentencePiece-style file needs Sequence[Replace(▁→ ), ByteFallback, Fuse(, Strip)]",
        ));
    }
    Ok(())
}

/// Checks the BPE model options MLT1 cannot express.
fn check_model(model: &Value, kind: Kind) -> Result<u32> {
    if type_of(model) != "BPE" {
        return Err(refuse(
            "model.type",
            null_or(model.get("type")),
            "only BPE is supported",
        ));
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        let v = null_or(model.get(key));
        if !(v.is_null() || v == "") {
            return Err(refuse(
                &format!("model.{key}"),
                v,
                "only null or \"\" is supported",
            ));
        }
    }
    let dropout = null_or(model.get("dropout"));
    if !(dropout.is_null() || dropout.as_f64() == Some(0.0)) {
        return Err(refuse(
            "model.dropout",
            dropout,
            "BPE dropout is not supported",
        ));
    }
    let byte_fallback = model
        .get("byte_fallback")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    match kind {
        Kind::SentencePiece if !byte_fallback => {
            return Err(refuse(
                "model.byte_fallback",
                &Value::Bool(false),
                "a SentencePiece-style file needs byte_fallback",
            ))
        }
        Kind::ByteLevel if byte_fallback => {
            return Err(refuse(
                "model.byte_fallback",
                &Value::Bool(true),
                "not supported with a byte-level vocabulary",
            ))
        }
        _ => {}
    }
    let ignore = model
        .get("ignore_merges")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(if ignore { FLAG_IGNORE_MERGES } else { 0 })
}

struct Added {
    id: u32,
    content: String,
}

fn added_tokens(j: &Value, norm_is_null: bool) -> Result<Vec<Added>> {
    let list = match j.get("added_tokens") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(refuse("added_tokens", v, "must be a list")),
    };
    let mut out = Vec::with_capacity(list.len());
    let mut normalized_seen = None;
    for (i, t) in list.iter().enumerate() {
        let f = format!("added_tokens[{i}]");
        for key in ["lstrip", "rstrip", "single_word"] {
            expect(t, &f, key, &Value::Bool(false))?;
        }
        let normalized = t
            .get("normalized")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if normalized && !norm_is_null {
            return Err(refuse(
                &format!("{f}.normalized"),
                &Value::Bool(true),
                "matching on normalized text is not supported",
            ));
        }
        // Two matching passes (raw, then normalized) only equal one pass if all agree.
        if *normalized_seen.get_or_insert(normalized) != normalized {
            return Err(refuse(
                &format!("{f}.normalized"),
                &Value::Bool(normalized),
                "all added tokens must agree on normalized",
            ));
        }
        let id = t
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok());
        let content = t.get("content").and_then(Value::as_str);
        match (id, content) {
            (Some(id), Some(c)) if !c.is_empty() => out.push(Added {
                id,
                content: c.to_string(),
            }),
            _ => return Err(refuse(&f, t, "needs an id and a non-empty content")),
        }
    }
    Ok(out)
}

/// A SentencePiece byte-fallback piece `<0xXX>`.
fn byte_piece(p: &str) -> Option<u8> {
    let hex = p.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
    {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// A merge entry: "a b" or ["a", "b"].
fn merge_pair<'a>(m: &'a Value, f: &str) -> Result<(&'a str, &'a str)> {
    match m {
        Value::String(s) => {
            let mut it = s.splitn(3, ' ');
            match (it.next(), it.next(), it.next()) {
                (Some(a), Some(b), None) => Ok((a, b)),
                _ => Err(refuse(f, m, "must be \"left right\"")),
            }
        }
        Value::Array(a) => match a.as_slice() {
            [Value::String(l), Value::String(r)] => Ok((l, r)),
            _ => Err(refuse(f, m, "must be [left, right]")),
        },
        _ => Err(refuse(f, m, "must be a string or a pair")),
    }
}

/// Where BOS comes from: the post-processor's template, then tokenizer_config.json.
fn bos_eos(
    j: &Value,
    config: Option<&Value>,
    opts: &HfTokenizerOptions,
) -> Result<(Option<String>, Option<String>, bool)> {
    let post = null_or(j.get("post_processor"));
    let mut templ_bos = None;
    let mut check_post = |p: &Value, f: &str| -> Result<()> {
        match type_of(p) {
            "ByteLevel" => Ok(()),
            "TemplateProcessing" => {
                let single = members(p, "single");
                let seq_a = |v: &Value| {
                    v.get("Sequence")
                        .and_then(|s| s.get("id"))
                        .and_then(Value::as_str)
                        == Some("A")
                };
                let special = |v: &Value| {
                    v.get("SpecialToken")
                        .and_then(|s| s.get("id"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                };
                match single {
                    [a] if seq_a(a) => Ok(()),
                    [b, a] if seq_a(a) && special(b).is_some() => {
                        let name = special(b).unwrap_or_default();
                        // The template names a special token whose ids are listed.
                        let ids = p
                            .get("special_tokens")
                            .and_then(|s| s.get(&name))
                            .and_then(|s| s.get("ids"))
                            .and_then(Value::as_array);
                        if ids.map(|v| v.len()) != Some(1) {
                            return Err(refuse(
                                &format!("{f}.special_tokens"),
                                null_or(p.get("special_tokens")),
                                "the prepended token must be one id",
                            ));
                        }
                        let tokens = p
                            .get("special_tokens")
                            .and_then(|s| s.get(&name))
                            .and_then(|s| s.get("tokens"))
                            .and_then(Value::as_array);
                        let text = tokens
                            .and_then(|t| t.first())
                            .and_then(Value::as_str)
                            .unwrap_or(&name);
                        templ_bos = Some(text.to_string());
                        Ok(())
                    }
                    _ => Err(refuse(
                        &format!("{f}.single"),
                        null_or(p.get("single")),
                        "only [A] or [BOS, A] is supported",
                    )),
                }
            }
            _ => Err(refuse(
                f,
                p,
                "only ByteLevel, TemplateProcessing or their Sequence are supported",
            )),
        }
    };
    match type_of(post) {
        _ if post.is_null() => {}
        "Sequence" => {
            for (i, p) in members(post, "processors").iter().enumerate() {
                check_post(p, &format!("post_processor.processors[{i}]"))?;
            }
        }
        _ => check_post(post, "post_processor")?,
    }
    let tok_text = |key: &str| -> Option<String> {
        let v = config?.get(key)?;
        v.as_str()
            .map(str::to_string)
            .or_else(|| v.get("content").and_then(Value::as_str).map(str::to_string))
    };
    let add_bos_cfg = config
        .and_then(|c| c.get("add_bos_token"))
        .and_then(Value::as_bool);
    let add_bos = templ_bos.is_some() || add_bos_cfg == Some(true);
    let bos = opts
        .bos
        .clone()
        .or(templ_bos)
        .or_else(|| tok_text("bos_token"));
    let eos = opts.eos.clone().or_else(|| tok_text("eos_token"));
    if config
        .and_then(|c| c.get("add_eos_token"))
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(FormatError::format(
            "tokenizer_config.add_eos_token",
            true,
            "appending EOS is not supported",
        ));
    }
    Ok((bos, eos, add_bos))
}

/// Converts tokenizer.json (and tokenizer_config.json, when given) to MLT1.
pub fn convert(
    tokenizer_json: &str,
    config_json: Option<&str>,
    opts: &HfTokenizerOptions,
) -> Result<Mlt> {
    let j: Value = serde_json::from_str(tokenizer_json)
        .map_err(|e| FormatError::format("tokenizer.json", "", format!("not JSON: {e}")))?;
    let config: Option<Value> = match config_json {
        Some(c) => Some(serde_json::from_str(c).map_err(|e| {
            FormatError::format("tokenizer_config.json", "", format!("not JSON: {e}"))
        })?),
        None => None,
    };
    for key in ["truncation", "padding"] {
        let v = null_or(j.get(key));
        if !v.is_null() {
            return Err(refuse(
                key,
                v,
                "must be null (it changes what encode returns)",
            ));
        }
    }
    let (kind, mut flags) = kind_and_flags(&j)?;
    let model = null_or(j.get("model"));
    flags |= check_model(model, kind)?;
    let added = added_tokens(&j, null_or(j.get("normalizer")).is_null())?;
    let Some(vocab) = model.get("vocab").and_then(Value::as_object) else {
        return Err(refuse(
            "model.vocab",
            null_or(model.get("vocab")),
            "must be an object",
        ));
    };

    // Ids are dense, so none can reach the number of entries: checked before the slot
    // table grows to an id (an id of 2^32 − 1 would allocate 100 GB).
    let max_tokens = vocab.len() + added.len();
    let too_big = |field: &str, id: u32| {
        FormatError::format(
            field,
            id,
            format!("ids must be dense 0..n, and there are only {max_tokens} tokens"),
        )
    };
    // Slots: model vocabulary first, then added tokens (which must agree with it).
    let mut slots: Vec<Option<Token>> = Vec::new();
    let mut piece_id: HashMap<&str, u32> = HashMap::with_capacity(vocab.len());
    let gpt2 = gpt2_chars().1;
    let added_ids: HashMap<u32, &str> = added.iter().map(|a| (a.id, a.content.as_str())).collect();
    for (piece, id) in vocab {
        let Some(id) = id.as_u64().and_then(|v| u32::try_from(v).ok()) else {
            return Err(refuse(
                &format!("model.vocab[{piece:?}]"),
                id,
                "must be a u32 id",
            ));
        };
        piece_id.insert(piece.as_str(), id);
        let idx = id as usize;
        if idx >= max_tokens {
            return Err(too_big(&format!("model.vocab[{piece:?}]"), id));
        }
        if idx >= slots.len() {
            slots.resize(idx + 1, None);
        }
        if slots[idx].is_some() {
            return Err(FormatError::format(
                format!("model.vocab[{piece:?}]"),
                id,
                "id used twice",
            ));
        }
        let tok = if let Some(content) = added_ids.get(&id) {
            if *content != piece {
                return Err(FormatError::format(
                    format!("added_tokens id {id}"),
                    content,
                    format!("the vocabulary has {piece:?} at that id"),
                ));
            }
            Token {
                attr: Attr::Added,
                bytes: content.as_bytes().to_vec(),
            }
        } else {
            match kind {
                Kind::ByteLevel => {
                    let bytes: Option<Vec<u8>> =
                        piece.chars().map(|c| gpt2.get(&c).copied()).collect();
                    match bytes {
                        Some(b) if !b.is_empty() => Token {
                            attr: Attr::Normal,
                            bytes: b,
                        },
                        _ => {
                            return Err(FormatError::format(
                                format!("model.vocab[{id}]"),
                                piece,
                                "not a byte-level piece (GPT-2 characters)",
                            ))
                        }
                    }
                }
                Kind::SentencePiece => match byte_piece(piece) {
                    Some(b) => Token {
                        attr: Attr::Byte,
                        bytes: vec![b],
                    },
                    None => Token {
                        attr: Attr::Normal,
                        bytes: piece.as_bytes().to_vec(),
                    },
                },
            }
        };
        slots[idx] = Some(tok);
    }
    for a in &added {
        let idx = a.id as usize;
        if idx >= max_tokens {
            return Err(too_big(&format!("added_tokens id {}", a.id), a.id));
        }
        if idx >= slots.len() {
            slots.resize(idx + 1, None);
        }
        match &slots[idx] {
            Some(t) if t.attr == Attr::Added && t.bytes != a.content.as_bytes() => {
                return Err(FormatError::format(
                    format!("added_tokens id {}", a.id),
                    &a.content,
                    "id used twice",
                ));
            }
            Some(t) if t.attr != Attr::Added => {
                return Err(FormatError::format(
                    format!("added_tokens id {}", a.id),
                    &a.content,
                    "conflicts with the vocabulary",
                ));
            }
            _ => {
                slots[idx] = Some(Token {
                    attr: Attr::Added,
                    bytes: a.content.as_bytes().to_vec(),
                })
            }
        }
    }
    if let Some(hole) = slots.iter().position(Option::is_none) {
        return Err(FormatError::format(
            "model.vocab",
            format!("id {hole}"),
            "ids must be dense 0..n: this id has no token",
        ));
    }
    let tokens: Vec<Token> = slots.into_iter().flatten().collect();

    let Some(merge_list) = model.get("merges").and_then(Value::as_array) else {
        return Err(refuse(
            "model.merges",
            null_or(model.get("merges")),
            "must be a list",
        ));
    };
    let mut merges = Vec::with_capacity(merge_list.len());
    for (i, m) in merge_list.iter().enumerate() {
        let f = format!("model.merges[{i}]");
        let (l, r) = merge_pair(m, &f)?;
        let look = |p: &str| {
            piece_id
                .get(p)
                .copied()
                .ok_or_else(|| refuse(&f, m, &format!("{p:?} is not in the vocabulary")))
        };
        let (left, right) = (look(l)?, look(r)?);
        let merged = look(&format!("{l}{r}"))?;
        merges.push(Merge {
            left,
            right,
            merged,
        });
    }

    let (bos, eos, add_bos) = bos_eos(&j, config.as_ref(), opts)?;
    let find = |name: &str, text: Option<String>| -> Result<Option<u32>> {
        let Some(text) = text else { return Ok(None) };
        let id = added
            .iter()
            .find(|a| a.content == text)
            .map(|a| a.id)
            .or_else(|| piece_id.get(text.as_str()).copied());
        id.map(Some)
            .ok_or_else(|| FormatError::format(name, &text, "no such token"))
    };
    let bos = find("bos_token", bos)?;
    let eos = find("eos_token", eos)?;
    let mlt = Mlt::from_parts(
        (kind, flags, tokens, merges),
        bos,
        eos,
        add_bos,
        "bos_token",
        "none",
    )?;
    // Without unk a missing byte is dropped (as the library does); with one it is not.
    let unk = null_or(model.get("unk_token"));
    if kind == Kind::ByteLevel && !unk.is_null() {
        let have: std::collections::HashSet<&[u8]> =
            mlt.tokens.iter().map(|t| t.bytes.as_slice()).collect();
        if let Some(b) = (0..=255u8).find(|b| !have.contains(&[*b][..])) {
            return Err(refuse(
                "model.unk_token",
                unk,
                &format!("byte {b:#04x} has no token and unknown tokens are not supported"),
            ));
        }
    }
    // The encoder's own checks (every byte present, ...) must pass too.
    super::Tokenizer::from_mlt(&mlt)?;
    Ok(mlt)
}
