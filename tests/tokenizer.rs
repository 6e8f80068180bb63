//! Tokenizer: tokenizer.json → MLT1 conversion, and encoding checked id for id against
//! the tokenizers crate (the oracle) on the corpus, on every added token in context and
//! on random strings of tricky characters; decode round trips; streaming decode.

use flate2::read::GzDecoder;
use krafla::format::mlt::{self, Mlt};
use krafla::rng::Rng;
use krafla::tokenizer::{from_hf, pretok, Tokenizer};
use serde_json::Value;
use std::io::Read;
use std::path::PathBuf;
use std::str::FromStr;

use crate::util::first_diff;
use crate::util::fixtures::convert_tokenizer;
use crate::util::tool::tool;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/tokenizers")
        .join(name)
}

pub(crate) fn gunzip(name: &str) -> String {
    let f = std::fs::File::open(data(name)).expect("test data present");
    let mut s = String::new();
    GzDecoder::new(f)
        .read_to_string(&mut s)
        .expect("gzip of UTF-8");
    s
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('s') => out.push(' '),
            Some('\\') => out.push('\\'),
            Some('u') => {
                assert_eq!(it.next(), Some('{'));
                let hex: String = it.by_ref().take_while(|&c| c != '}').collect();
                out.push(char::from_u32(u32::from_str_radix(&hex, 16).unwrap()).unwrap());
            }
            other => panic!("bad escape \\{other:?}"),
        }
    }
    out
}

/// The corpus cases: (name, text).
pub(crate) fn corpus() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(data("corpus.txt")).unwrap();
    let mut cases: Vec<(String, Vec<&str>)> = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("%%%% ") {
            cases.push((name.to_string(), Vec::new()));
        } else if let Some(c) = cases.last_mut() {
            c.1.push(line);
        }
    }
    let mut out: Vec<(String, String)> = cases
        .into_iter()
        .map(|(n, lines)| (n, unescape(&lines.join("\n"))))
        .collect();
    // All of it at once too, so cases meet each other.
    let all: String = out
        .iter()
        .map(|c| c.1.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    out.push(("whole corpus".into(), all));
    out
}

const ALPHABET: &[&str] = &[
    "a",
    "b",
    "Z",
    "é",
    "e\u{301}",
    "\u{301}",
    "\u{93F}",
    "क",
    "ก",
    "\u{E49}",
    "中",
    "の",
    "한",
    "ع",
    "ß",
    "ſ",
    "0",
    "1",
    "9",
    "²",
    "½",
    "٣",
    "३",
    "Ⅻ",
    " ",
    " ",
    " ",
    "  ",
    "\n",
    "\r\n",
    "\r",
    "\t",
    "\u{A0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{200B}",
    "\u{FEFF}",
    "'",
    "'s",
    "'S",
    "'ll",
    "'LL",
    "'t",
    "'d",
    "'Re",
    "!",
    ".",
    ",",
    "-",
    "_",
    "(",
    ")",
    "\"",
    "<",
    ">",
    "|",
    "#",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "\u{200D}",
    "\u{FFFD}",
    "\u{FFFF}",
    "\u{E000}",
    "\u{10FFFF}",
    "\u{0}",
    "\u{7F}",
    "▁",
    "<s>",
    "<0x41>",
    "<|",
    "|>",
    "im_",
    "<bo",
    "s>",
];

/// Random strings over [`ALPHABET`], from a fixed seed.
pub(crate) fn fuzz_cases(n: usize) -> Vec<String> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            let len = (rng.next_u64() % 24) as usize;
            (0..len)
                .map(|_| ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize])
                .collect()
        })
        .collect()
}

/// Every added token in context: inside words, next to each other and to spaces.
pub(crate) fn added_cases(m: &Mlt) -> Vec<String> {
    let added: Vec<String> = m
        .tokens
        .iter()
        .filter(|t| t.attr == mlt::Attr::Added)
        .map(|t| String::from_utf8(t.bytes.clone()).unwrap())
        .collect();
    let mut out = Vec::with_capacity(added.len());
    for (i, t) in added.iter().enumerate() {
        let u = &added[(i + 1) % added.len()];
        out.push(format!("x{t}y {t}{u}  {t} \n{t}\n 12{t}34 it's{t}'s"));
    }
    out.push(added.concat());
    out
}

pub(crate) struct Outcome {
    pub cases: usize,
    pub diffs: Vec<String>,
    pub round_trips: usize,
}

pub(crate) fn compare(
    name: &str,
    ours: &Tokenizer,
    hf: &tokenizers::Tokenizer,
    cases: &[(String, String)],
) -> Outcome {
    let mut out = Outcome {
        cases: 0,
        diffs: Vec::new(),
        round_trips: 0,
    };
    for (case, text) in cases {
        out.cases += 1;
        let want = hf
            .encode(text.as_str(), true)
            .expect("oracle encodes")
            .get_ids()
            .to_vec();
        let got = ours.encode(text);
        if let Some(at) = first_diff(&got, &want) {
            let lo = at.saturating_sub(3);
            out.diffs.push(format!(
                "{name} / {case} {text:?}: first difference at {at}: ours {:?} hf {:?}",
                &got[lo..(at + 4).min(got.len())],
                &want[lo..(at + 4).min(want.len())]
            ));
            continue;
        }
        // decode(encode(x)) == x wherever the library round-trips too.
        let body: &[u32] = match (got.first(), ours.bos()) {
            (Some(&f), Some(b)) if f == b && !text.starts_with("<bos>") => &got[1..],
            _ => &got,
        };
        if hf.decode(body, false).ok().as_deref() == Some(text.as_str()) {
            let dec = ours.decode(body);
            if dec != text.as_bytes() {
                out.diffs.push(format!(
                    "{name} / {case} {text:?}: decode gave {:?}",
                    String::from_utf8_lossy(&dec)
                ));
            }
            out.round_trips += 1;
        }
        // Streaming gives the same text, token by token.
        let mut sd = ours.stream_decoder();
        let mut streamed = String::new();
        for &id in body {
            streamed.push_str(&sd.push(id));
        }
        streamed.push_str(&sd.finish());
        let whole = String::from_utf8_lossy(&ours.decode(body)).into_owned();
        if streamed != whole {
            out.diffs.push(format!(
                "{name} / {case}: streamed {streamed:?} != decoded {whole:?}"
            ));
        }
    }
    out
}

/// Converts, checks the file round-trips through bytes, and compares on every case.
fn check_family(
    name: &str,
    json: &str,
    config: Option<&str>,
    want_kind: mlt::Kind,
    want_flags: u32,
) {
    let m = from_hf::convert(json, config, &from_hf::HfTokenizerOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        (m.kind, m.flags),
        (want_kind, want_flags),
        "{name}: kind/flags {:?}",
        m.flag_names()
    );
    let bytes = m.to_bytes().unwrap();
    let m2 = Mlt::parse(&bytes).unwrap();
    assert!(m2 == m, "{name}: file does not round-trip");
    let ours = Tokenizer::from_mlt(&m2).unwrap();
    assert_matches_hf(name, &ours, &m2, json);
}

/// `ours` (made from `m`) against the tokenizers library on `json`: the corpus, every
/// added token in context and random strings; encode, decode and streamed decode.
pub(crate) fn assert_matches_hf(name: &str, ours: &Tokenizer, m: &Mlt, json: &str) {
    let hf = tokenizers::Tokenizer::from_str(json).expect("oracle loads");
    assert_eq!(ours.n_vocab(), hf.get_vocab_size(true), "{name}: n_vocab");
    let mut cases = corpus();
    cases.extend(
        added_cases(m)
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("added {i}"), t)),
    );
    cases.extend(
        fuzz_cases(3000)
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("fuzz {i}"), t)),
    );
    let r = compare(name, ours, &hf, &cases);
    eprintln!(
        "{name}: {} cases, {} differences, {} round trips checked",
        r.cases,
        r.diffs.len(),
        r.round_trips
    );
    for d in r.diffs.iter().take(15) {
        eprintln!("  {d}");
    }
    assert!(
        r.diffs.is_empty(),
        "{name}: {} of {} cases differ",
        r.diffs.len(),
        r.cases
    );
}

/// The families as testdata holds them: the gzipped tokenizer.json and, where the
/// family has one, its tokenizer_config.json.
#[test]
fn file_families_match_hf() {
    use mlt::Kind::{ByteLevel, SentencePiece};
    let families: [(&str, &str, Option<&str>, mlt::Kind, u32); 5] = [
        (
            "llama3",
            "llama3.tokenizer.json.gz",
            None,
            ByteLevel,
            mlt::FLAG_IGNORE_MERGES,
        ),
        (
            "qwen3",
            "qwen3.tokenizer.json.gz",
            None,
            ByteLevel,
            mlt::FLAG_NFC | mlt::FLAG_SINGLE_DIGITS,
        ),
        (
            "gemma3",
            "gemma3.tokenizer.json.gz",
            Some("gemma3.tokenizer_config.json"),
            SentencePiece,
            mlt::FLAG_ADD_BOS | mlt::FLAG_SP_NO_PREFIX,
        ),
        (
            "smollm2",
            "smollm2.tokenizer.json.gz",
            Some("smollm2.tokenizer_config.json"),
            ByteLevel,
            mlt::FLAG_GPT2_REGEX,
        ),
        (
            "smollm2-digits",
            "smollm2.tokenizer.digits-split.json.gz",
            Some("smollm2.tokenizer_config.json"),
            ByteLevel,
            mlt::FLAG_GPT2_REGEX | mlt::FLAG_DIGITS_SPLIT,
        ),
    ];
    for (name, json_gz, config, kind, flags) in families {
        let cfg = config.map(|c| std::fs::read_to_string(data(c)).unwrap());
        check_family(name, &gunzip(json_gz), cfg.as_deref(), kind, flags);
    }
}

/// Qwen3.5's regex: the Qwen3 file with the letter-mark pattern put in.
#[test]
fn qwen35_synthetic_matches_hf() {
    let mut j: Value = serde_json::from_str(&gunzip("qwen3.tokenizer.json.gz")).unwrap();
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
        Value::from(pretok::llama3_pattern(true, true));
    let f = mlt::FLAG_NFC | mlt::FLAG_SINGLE_DIGITS | mlt::FLAG_LETTER_MARKS;
    check_family(
        "qwen3.5 (synthetic)",
        &j.to_string(),
        None,
        mlt::Kind::ByteLevel,
        f,
    );
}

/// Llama 2-style SentencePiece (▁ prefix after every added token): Gemma 3's vocabulary
/// with the Prepend normalizer and the Strip decoder.
#[test]
fn sentencepiece_prefix_synthetic_matches_hf() {
    let mut j: Value = serde_json::from_str(&gunzip("gemma3.tokenizer.json.gz")).unwrap();
    j["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u{2581}"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]});
    j["pre_tokenizer"] = Value::Null;
    j["decoder"]["decoders"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!(
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    let cfg = std::fs::read_to_string(data("gemma3.tokenizer_config.json")).unwrap();
    check_family(
        "sp-prefix (synthetic)",
        &j.to_string(),
        Some(&cfg),
        mlt::Kind::SentencePiece,
        mlt::FLAG_ADD_BOS,
    );
}

fn smollm2_json() -> Value {
    serde_json::from_str(&gunzip("smollm2.tokenizer.json.gz")).unwrap()
}

fn refusal(j: &Value) -> krafla::format::FormatError {
    from_hf::convert(
        &j.to_string(),
        None,
        &from_hf::HfTokenizerOptions::default(),
    )
    .expect_err("must be refused")
}

#[test]
fn converter_refuses_what_it_cannot_reproduce() {
    let base = {
        let mut j = smollm2_json();
        j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        j
    };
    let e = refusal(&base);
    assert!(
        e.to_string().contains("\\p{L}+|\\s+"),
        "the pattern is printed: {e}"
    );

    let mut j = smollm2_json();
    j["added_tokens"][0]["lstrip"] = Value::Bool(true);
    assert_eq!(refusal(&j).field, "added_tokens[0].lstrip");

    let mut j = smollm2_json();
    j["pre_tokenizer"]["add_prefix_space"] = Value::Bool(true);
    assert_eq!(refusal(&j).field, "pre_tokenizer.add_prefix_space");

    let mut j = smollm2_json();
    j["normalizer"] = serde_json::json!({"type": "NFKC"});
    assert_eq!(refusal(&j).field, "normalizer");

    let mut j = smollm2_json();
    j["model"]["dropout"] = Value::from(0.1);
    assert_eq!(refusal(&j).field, "model.dropout");

    let mut j = smollm2_json();
    j["model"]["type"] = Value::from("Unigram");
    assert_eq!(refusal(&j).field, "model.type");

    let mut j = smollm2_json();
    j["model"]["vocab"].as_object_mut().unwrap().remove("a");
    let e = refusal(&j);
    assert!(
        e.field == "model.vocab" || e.field.starts_with("model.merges"),
        "{e}"
    );

    let mut j = smollm2_json();
    j["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false});
    assert_eq!(refusal(&j).field, "pre_tokenizer");
}

#[test]
fn mlt_convert_binary_writes_and_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("tokenizer.json");
    std::fs::write(&input, gunzip("smollm2.tokenizer.json.gz")).unwrap();
    std::fs::copy(
        data("smollm2.tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let out = dir.path().join("tok.mlt");
    convert_tokenizer(&input, &out);
    let m = Mlt::load(&out).unwrap();
    assert_eq!((m.bos, m.eos), (Some(1), Some(2)));

    // A refused file: non-zero exit, the field and value named, no output left.
    let mut j = smollm2_json();
    j["normalizer"] = serde_json::json!({"type": "Lowercase"});
    std::fs::write(&input, j.to_string()).unwrap();
    let out2 = dir.path().join("bad.mlt");
    let err = tool("mlt-convert").arg(&input).arg("-o").arg(&out2).fails();
    assert!(
        err.contains("normalizer") && err.contains("Lowercase") && err.contains("tokenizer.json"),
        "{err}"
    );
    assert!(!out2.exists());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 3, "{leftovers:?}");
}

#[test]
fn stream_decoder_holds_back_partial_utf8() {
    let cfg = std::fs::read_to_string(data("gemma3.tokenizer_config.json")).unwrap();
    let m = from_hf::convert(
        &gunzip("gemma3.tokenizer.json.gz"),
        Some(&cfg),
        &Default::default(),
    )
    .unwrap();
    let tok = Tokenizer::from_mlt(&m).unwrap();
    let byte = |b: u8| {
        m.tokens
            .iter()
            .position(|t| t.attr == mlt::Attr::Byte && t.bytes == [b])
            .unwrap() as u32
    };
    // 😀 = F0 9F 98 80 as four byte-fallback tokens.
    let mut sd = tok.stream_decoder();
    assert_eq!(sd.push(byte(b'a')), "a");
    assert_eq!(sd.push(byte(0xF0)), "");
    assert_eq!(sd.push(byte(0x9F)), "");
    assert_eq!(sd.push(byte(0x98)), "");
    assert_eq!(sd.push(byte(0x80)), "😀");
    // An invalid byte is final at once, and an unfinished tail is flushed as U+FFFD.
    assert_eq!(sd.push(byte(0xFF)), "\u{FFFD}");
    assert_eq!(sd.push(byte(0xE2)), "");
    assert_eq!(sd.finish(), "\u{FFFD}");
    assert_eq!(
        tok.decode(&[byte(0xE2), byte(0x96), byte(0x81)]),
        "▁".as_bytes()
    );
}

#[test]
fn describe_and_json_helpers() {
    let m = from_hf::convert(
        &gunzip("smollm2.tokenizer.json.gz"),
        None,
        &Default::default(),
    )
    .unwrap();
    let (text, json) = krafla::tools::inspect::mlt::describe(&m);
    assert!(
        text.contains("gpt2_regex") && text.contains("<|im_start|>"),
        "{text}"
    );
    assert_eq!(json["n_vocab"], 49152);
    assert_eq!(json["flag_names"][0], "gpt2_regex");
    let tok = Tokenizer::from_mlt(&m).unwrap();
    let line = krafla::tokenizer::encode_to_json(&tok, "Hello world");
    let ids = krafla::tokenizer::parse_ids(&line, tok.n_vocab()).unwrap();
    assert_eq!(tok.decode(&ids), b"Hello world");
    assert!(krafla::tokenizer::parse_ids("[1, 99999999]", tok.n_vocab()).is_err());
    assert_eq!(
        krafla::tokenizer::parse_ids("1 2,3", tok.n_vocab()).unwrap(),
        [1, 2, 3]
    );
}

/// Long runs of one character (issue 42: 8 MiB of spaces took 7.6 s of CPU, the BPE
/// heap over one piece) take the linear path, with the ids of the tokenizers library:
/// random texts mixing words with runs of 4,000 to 12,000 spaces, newlines, tabs, dashes
/// or no-break spaces, on each byte-level family; and 1 MiB of spaces is fast.
#[test]
fn long_runs_match_hf_and_are_linear() {
    for fam in [
        "smollm2.tokenizer.json.gz",
        "qwen3.tokenizer.json.gz",
        "llama3.tokenizer.json.gz",
    ] {
        let json = gunzip(fam);
        let m = from_hf::convert(&json, None, &from_hf::HfTokenizerOptions::default()).unwrap();
        let ours = Tokenizer::from_mlt(&m).unwrap();
        let hf = tokenizers::Tokenizer::from_str(&json).unwrap();
        let mut rng = Rng(0x42 ^ fam.len() as u64);
        for case in 0..12 {
            let mut text = String::new();
            for _ in 0..3 {
                let words = ["Hello", " world", "x", "\n", " 12", "é", ""];
                text.push_str(words[(rng.next_u64() % words.len() as u64) as usize]);
                let c = [' ', '\n', '\t', '-', '\u{a0}', '\r'][(rng.next_u64() % 6) as usize];
                let n = 4000 + (rng.next_u64() % 8000) as usize;
                text.extend(std::iter::repeat_n(c, n));
            }
            let want: Vec<u32> = hf.encode(text.as_str(), true).unwrap().get_ids().to_vec();
            let got = ours.encode(&text);
            assert!(
                got == want,
                "{fam} case {case}: {} ids, want {}",
                got.len(),
                want.len()
            );
        }
        let spaces = " ".repeat(1 << 20);
        let t0 = std::time::Instant::now();
        let ids = ours.encode(&spaces);
        let took = t0.elapsed();
        eprintln!("{fam}: 1 MiB of spaces in {took:?} ({} ids)", ids.len());
        assert!(took < std::time::Duration::from_secs(1), "{fam}: {took:?}");
    }
}
