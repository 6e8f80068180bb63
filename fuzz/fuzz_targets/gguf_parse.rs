//! `krafla::format::gguf::parse` on arbitrary bytes, then everything readable of a file
//! that parses (arrays, tensor data, dequantization, the tokenizer, a rewrite): an
//! error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    krafla_fuzz::exercise_gguf(data);
});
