//! A chat template and a conversation (JSON), split at the first NUL: compile, parse,
//! render.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    krafla_fuzz::exercise_chat(data);
});
