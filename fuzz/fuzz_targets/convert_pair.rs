//! The whole converter on an arbitrary checkpoint: one input holds config.json and
//! model.safetensors, split at the first NUL byte (JSON text never holds one; a
//! safetensors file starts with an 8-byte length that does). An error or a file that
//! loads; never a panic, an abort on allocation or a hang, and never a file left
//! behind on failure. An odd-length config converts to Q4_0, an even one to Q8_0.
#![no_main]
use std::path::PathBuf;
use std::sync::LazyLock;

use krafla::convert::WType;
use libfuzzer_sys::fuzz_target;

static DIR: LazyLock<PathBuf> = LazyLock::new(|| krafla_fuzz::scratch_dir("pair"));

fuzz_target!(|data: &[u8]| {
    let Some(nul) = data.iter().position(|&b| b == 0) else {
        return;
    };
    let (cfg, st) = (&data[..nul], &data[nul + 1..]);
    let dir = &*DIR;
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    std::fs::write(dir.join("model.safetensors"), st).unwrap();
    let wtype = if cfg.len() % 2 == 1 {
        WType::Q4_0
    } else {
        WType::Q8_0
    };
    if let Err(e) = krafla_fuzz::convert_checked(dir, wtype) {
        assert!(!e.to_string().contains('\n'), "multi-line error: {e}");
    }
});
