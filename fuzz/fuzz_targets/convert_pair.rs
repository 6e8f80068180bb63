//! The whole converter on an arbitrary checkpoint: one input holds config.json and
//! model.safetensors, split at the first NUL byte (JSON text never holds one; a
//! safetensors file starts with an 8-byte length that does). An error or a file that
//! loads; never a panic, an abort on allocation or a hang, and never a file left
//! behind on failure. An odd-length config converts to Q4_0, an even one to Q8_0.
#![no_main]
use std::path::PathBuf;
use std::sync::LazyLock;

use krafla::convert::{convert, Options, WType};
use krafla::format::mlb::Mlb;
use libfuzzer_sys::fuzz_target;

static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("krafla-fuzz-pair-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
});

fuzz_target!(|data: &[u8]| {
    let Some(nul) = data.iter().position(|&b| b == 0) else {
        return;
    };
    let (cfg, st) = (&data[..nul], &data[nul + 1..]);
    let dir = &*DIR;
    let out = dir.join("out.mlb");
    let _ = std::fs::remove_file(&out);
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    std::fs::write(dir.join("model.safetensors"), st).unwrap();
    let wtype = if cfg.len() % 2 == 1 {
        WType::Q4_0
    } else {
        WType::Q8_0
    };
    let mut opts = Options::new(dir.clone(), wtype);
    opts.output = Some(out.clone());
    let r = convert(&opts, &mut |_| {});
    let left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "config.json" && n != "model.safetensors" && n != "out.mlb")
        .collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
    match r {
        Ok(_) => {
            Mlb::open(&out).expect("a converted file loads");
        }
        Err(e) => {
            assert!(!out.exists(), "output written on failure");
            assert!(!e.to_string().contains('\n'), "multi-line error: {e}");
        }
    }
});
