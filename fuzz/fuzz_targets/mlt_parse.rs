//! `Mlt::parse`, then `Tokenizer::from_mlt`, an encode and a decode of every id.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    krafla_fuzz::exercise_mlt(data);
});
