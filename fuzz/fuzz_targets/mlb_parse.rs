//! `krafla::format::mlb::parse` on arbitrary bytes: an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = krafla::format::mlb::parse(data);
});
