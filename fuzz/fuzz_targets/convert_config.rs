//! config.json parsing of the converter on arbitrary JSON, then the header it derives
//! through the writer's validation (as `mlb-convert` does before creating a file).
#![no_main]
use std::path::Path;

use krafla::convert::hf::config;
use krafla::format::mlb::MlbWriter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(desc) = config::parse(Path::new("config.json"), &v) else {
        return;
    };
    let (h, flags) = desc.header();
    let _ = MlbWriter::new(std::io::sink(), &h, &flags);
});
