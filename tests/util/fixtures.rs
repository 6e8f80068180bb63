//! The tiny checkpoints of testdata/models: their transformers references, and the shared
//! builders that convert them (by `mlb-convert` and `mlt-convert`, or by the library).

use std::path::{Path, PathBuf};

use krafla::convert::{ConvertOptions, Progress, WType};
use serde_json::Value;

use super::tool::{mlb_convert, tool, Ran};

/// Little-endian f32 values.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A little-endian f32 file (the fixtures' logits).
pub fn read_f32(p: &Path) -> Vec<f32> {
    f32s(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A fixture's reference.json and its tokens; `None` (with a SKIP line) without the
/// file.
pub fn reference(dir: &Path) -> Option<(Value, Vec<u32>)> {
    let Ok(text) = std::fs::read_to_string(dir.join("reference.json")) else {
        eprintln!("SKIP: no fixture {}", dir.display());
        return None;
    };
    let r: Value = serde_json::from_str(&text).unwrap();
    let toks = ids(&r["tokens"]);
    Some((r, toks))
}

/// The fixtures `names` below `root` that have a reference.json, in order: each name,
/// folder and tokens (the others with a SKIP line, as [`reference`]).
pub fn with_reference<'a>(
    root: &'a Path,
    names: &'a [&'static str],
) -> impl Iterator<Item = (&'static str, PathBuf, Vec<u32>)> + 'a {
    names.iter().filter_map(move |&name| {
        let dir = root.join(name);
        let (_, toks) = reference(&dir)?;
        Some((name, dir, toks))
    })
}

/// The fixtures below `root` that have a reference.json, sorted; `None` (with a SKIP
/// line) without the folder.
pub fn fixture_dirs(root: &Path) -> Option<Vec<PathBuf>> {
    let Ok(rd) = std::fs::read_dir(root) else {
        eprintln!("SKIP: no fixtures at {}", root.display());
        return None;
    };
    let mut dirs: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    Some(dirs)
}

/// `mlb-convert dir -o out args`, which must succeed and write `out`: what it printed.
pub fn convert(dir: &Path, out: &Path, args: &[&str]) -> Ran {
    let ran = mlb_convert(dir, out).args(args).ok();
    assert!(
        out.exists(),
        "mlb-convert {}: no {}",
        dir.display(),
        out.display()
    );
    ran
}

/// [`convert`], then the file's bytes.
pub fn converted(dir: &Path, out: &Path, args: &[&str]) -> Vec<u8> {
    convert(dir, out, args);
    std::fs::read(out).unwrap()
}

/// Copies `files` of the folder `src` into `dst` (made if missing); returns `dst`.
pub fn copy_files(src: &Path, dst: &Path, files: &[&str]) -> PathBuf {
    std::fs::create_dir_all(dst).unwrap();
    for f in files {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    dst.to_path_buf()
}

/// A copy of the fixture checkpoint `testdata/models/<fixture>` (its config and
/// weights) in `dir/name`.
pub fn checkpoint(dir: &Path, fixture: &str, name: &str) -> PathBuf {
    let src = super::testdata().join("models").join(fixture);
    copy_files(&src, &dir.join(name), &["config.json", "model.safetensors"])
}

/// The arguments that should give the same file from a float GGUF and from its
/// checkpoint: `--requantize t` and `--wtype t`, each followed by `extra`.
pub fn requantize_args<'a>(t: &'a str, extra: &[&'a str]) -> (Vec<&'a str>, Vec<&'a str>) {
    (
        [&["--requantize", t][..], extra].concat(),
        [&["--wtype", t][..], extra].concat(),
    )
}

/// `mlt-convert json -o out -q`, which must succeed.
pub fn convert_tokenizer(json: &Path, out: &Path) {
    tool("mlt-convert")
        .arg(json)
        .arg("-o")
        .arg(out)
        .arg("-q")
        .ok();
}

/// `dir` converted into `out` by the library at `wtype`: the file's bytes.
pub fn convert_to(dir: &Path, out: &Path, wtype: WType) -> Vec<u8> {
    convert_with(dir, out, |o| o.wtype = Some(wtype))
}

/// `dir` converted into `out` by the library with the options `f` sets (from Q8_0's
/// defaults): the file's bytes.
pub fn convert_with(dir: &Path, out: &Path, f: impl FnOnce(&mut ConvertOptions)) -> Vec<u8> {
    let mut o = ConvertOptions::new(dir, WType::Q8_0);
    o.output = Some(out.to_path_buf());
    f(&mut o);
    krafla::convert::convert(&o, &mut |_: Progress| {})
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    std::fs::read(out).unwrap()
}

/// A byte-level tokenizer of the 256 bytes (the fixtures' GGUFs carry one without
/// merges, which llama.cpp's byte-level BPE would refuse).
pub fn byte_mlt(path: &Path) {
    use krafla::format::mlt::{Attr, Kind, Mlt, Token, FLAG_GPT2_REGEX};
    let m = Mlt {
        kind: Kind::ByteLevel,
        bos: Some(1),
        eos: Some(2),
        flags: FLAG_GPT2_REGEX,
        tokens: (0..=255u8)
            .map(|b| Token {
                attr: Attr::Normal,
                bytes: vec![b],
            })
            .collect(),
        merges: Vec::new(),
        chat: None,
    };
    std::fs::write(path, m.to_bytes().unwrap()).unwrap();
}

/// gpt-oss's harmony markers, special tokens in its tokenizer (in its order).
pub const HARMONY_MARKERS: [&str; 7] = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
];
