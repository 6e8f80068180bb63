//! The encoder of every real tokenizer (testdata/tokenizers) on arbitrary text: ids in
//! range, and byte-level BPE gives NFC text back exactly on decode.
#![no_main]
use std::sync::LazyLock;

use krafla::format::mlt::Kind;
use krafla::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;
use unicode_normalization::UnicodeNormalization;

static TOKS: LazyLock<Vec<Tokenizer>> = LazyLock::new(krafla_fuzz::real_tokenizers);

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let is_nfc = text.nfc().eq(text.chars());
    for t in TOKS.iter() {
        let mut ids = t.encode(&text);
        assert!(ids.iter().all(|&i| (i as usize) < t.n_vocab()));
        if t.kind() == Kind::ByteLevel && is_nfc {
            if t.bos().is_some() && ids.first() == t.bos().as_ref() {
                ids.remove(0);
            }
            assert_eq!(
                String::from_utf8_lossy(&t.decode(&ids)),
                text,
                "byte-level round trip"
            );
        }
    }
});
