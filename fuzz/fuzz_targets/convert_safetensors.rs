//! The converter on an arbitrary model.safetensors (with the llama fixture's
//! config.json): an error or a file that loads; never a panic, and never a file left
//! behind on failure.
#![no_main]
use std::path::PathBuf;
use std::sync::LazyLock;

use krafla::convert::WType;
use libfuzzer_sys::fuzz_target;

static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
    let dir = krafla_fuzz::scratch_dir("st");
    let cfg = krafla_fuzz::repo().join("testdata/models/llama/config.json");
    std::fs::copy(cfg, dir.join("config.json")).unwrap();
    dir
});

fuzz_target!(|data: &[u8]| {
    let dir = &*DIR;
    std::fs::write(dir.join("model.safetensors"), data).unwrap();
    let _ = krafla_fuzz::convert_checked(dir, WType::Q8_0);
});
