//! `krafla::format::mli::parse`; what parses re-encodes to a file that parses to the
//! same values (a q_dim equal to dim is written as 0).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = krafla::format::mli::parse(data) {
        assert_eq!(krafla::format::mli::parse(&m.to_bytes()).unwrap(), m);
    }
});
