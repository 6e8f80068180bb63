//! `Mlb::from_bytes`, then every tensor through `mat()`/`f32s()` and a row dequant,
//! then one token through the model.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    krafla_fuzz::exercise_mlb(data);
});
