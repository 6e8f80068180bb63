//! The encoder of every real tokenizer (testdata/tokenizers) on arbitrary text: ids in
//! range, and byte-level BPE gives NFC text back exactly on decode when the vocabulary
//! has a token for each of the text's bytes (SmolLM2's lacks some control bytes, and
//! Hugging Face tokenizers drops those too: found by this target on 2026-12-02).
#![no_main]
use std::sync::LazyLock;

use krafla::format::mlt::Kind;
use krafla::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;
use unicode_normalization::UnicodeNormalization;

static TOKS: LazyLock<Vec<Tokenizer>> = LazyLock::new(krafla_fuzz::real_tokenizers);

/// Per tokenizer: which bytes have a single-byte token.
static BYTES: LazyLock<Vec<[bool; 256]>> = LazyLock::new(|| {
    TOKS.iter()
        .map(|t| {
            let mut has = [false; 256];
            for id in 0..t.n_vocab() as u32 {
                if let Some(&[b]) = t.token_bytes(id) {
                    has[b as usize] = !t.is_added(id);
                }
            }
            has
        })
        .collect()
});

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let is_nfc = text.nfc().eq(text.chars());
    for (t, has) in TOKS.iter().zip(BYTES.iter()) {
        let ids = t.encode(&text);
        assert!(ids.iter().all(|&i| (i as usize) < t.n_vocab()));
        let covered = text.bytes().all(|b| has[b as usize]);
        if t.kind() == Kind::ByteLevel && is_nfc && covered {
            // The text, or the text after a prepended BOS (a text that itself starts
            // with the BOS token's literal gives the first form).
            let got = t.decode(&ids);
            let bos = t.bos().and_then(|b| t.token_bytes(b)).unwrap_or(&[]);
            let with_bos = [bos, text.as_bytes()].concat();
            assert!(
                got == text.as_bytes() || got == with_bos,
                "byte-level round trip: {:?} from {text:?}",
                String::from_utf8_lossy(&got)
            );
        }
    }
});
