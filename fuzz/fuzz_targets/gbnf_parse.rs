//! `krafla::session::gbnf::to_lark`, which reads a request's `grammar` field: any text
//! gives Lark or an error with a place, never a panic or a stack overflow; a grammar it
//! translates is GBNF by its own test.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(lark) = krafla::session::gbnf::to_lark(text) {
            assert!(lark.starts_with("start: ") || lark.contains("\nstart: "), "{lark}");
        }
    }
});
