//! Decoding arbitrary ids (mostly in range, some out of range): streamed decoding
//! gives the same text as decoding at once.
#![no_main]
use std::sync::LazyLock;

use krafla::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

static TOKS: LazyLock<Vec<Tokenizer>> = LazyLock::new(krafla_fuzz::real_tokenizers);

fuzz_target!(|data: &[u8]| {
    let raw: Vec<u32> = data
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    for t in TOKS.iter() {
        let n = t.n_vocab() as u32;
        let ids: Vec<u32> = raw
            .iter()
            .map(|&r| if r >> 28 == 0xf { r } else { r % n })
            .collect();
        let whole = String::from_utf8_lossy(&t.decode(&ids)).into_owned();
        let mut d = t.stream_decoder();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(id));
        }
        streamed.push_str(&d.finish());
        assert_eq!(streamed, whole, "streamed decode differs from decode");
    }
});
