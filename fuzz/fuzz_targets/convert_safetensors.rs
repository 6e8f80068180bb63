//! The converter on an arbitrary model.safetensors (with the llama fixture's
//! config.json): an error or a file that loads; never a panic, and never a file left
//! behind on failure.
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
    let dir = base.join(format!("krafla-fuzz-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = krafla_fuzz::repo().join("testdata/models/llama/config.json");
    std::fs::copy(cfg, dir.join("config.json")).unwrap();
    dir
});

fuzz_target!(|data: &[u8]| {
    let dir = &*DIR;
    let out = dir.join("out.mlb");
    let _ = std::fs::remove_file(&out);
    std::fs::write(dir.join("model.safetensors"), data).unwrap();
    let mut opts = Options::new(dir.clone(), WType::Q8_0);
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
        Err(_) => assert!(!out.exists(), "output written on failure"),
    }
});
