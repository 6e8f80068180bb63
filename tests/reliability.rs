//! Bad input, faults and interruptions (issue 8): mutated and truncated files load as
//! valid files or fail with a status, never a panic; every error a user can cause is
//! one line on stderr naming the file, with a non-zero exit; an interrupted conversion
//! never damages an existing file. Crash reproducers of the fuzz targets live here too.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::OnceLock;

use krafla::format::mlb::{self, Kind, Mlb, HEADER_SIZE};
use krafla::format::mli::{self, Mli};
use krafla::format::mlt::Mlt;
use krafla::format::{FormatError, Status};
use krafla::model::Model;
use krafla::synth::{synth_file, Rng};
use krafla::tokenizer::{from_hf, Tokenizer};

use crate::run::{cases, file, opts, write_case};
use crate::util::fixtures::checkpoint;
use crate::util::tool::{mlb_convert, tool};
use crate::util::{stderr, testdata};

/// Values each header byte is set to: the edges of every field type, plus small
/// changes of the byte itself.
fn byte_values(orig: u8) -> Vec<u8> {
    let mut v = vec![
        0,
        1,
        2,
        3,
        0x7f,
        0x80,
        0xff,
        orig ^ 1,
        orig ^ 0x80,
        orig.wrapping_add(1),
        orig.wrapping_sub(1),
    ];
    v.retain(|&b| b != orig);
    v.sort_unstable();
    v.dedup();
    v
}

/// An error a caller can show: a status other than I/O and a named field.
fn assert_reportable(e: &FormatError, what: &str) {
    assert_ne!(e.status, Status::Io, "{what}: {e}");
    assert!(!e.field.is_empty(), "{what}: error without a field: {e}");
    assert!(
        !e.to_string().contains('\n'),
        "{what}: multi-line error: {e}"
    );
}

/// Loads `bytes` as an `.mlb`. If it loads: touches every array, builds the model and
/// runs one token; returns whether it loaded. Panics are turned into test failures
/// naming `what`.
fn load_mlb(bytes: &[u8], what: &str) -> bool {
    load_mlb_and(bytes, what, true)
}

/// [`load_mlb`], running the model only when `run`.
fn load_mlb_and(bytes: &[u8], what: &str, run: bool) -> bool {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let parsed = mlb::parse(bytes);
        let m = match Mlb::from_bytes(bytes) {
            Ok(m) => m,
            Err(e) => {
                assert_reportable(&e, what);
                assert_eq!(
                    parsed.unwrap_err(),
                    e,
                    "{what}: parse and from_bytes differ"
                );
                return false;
            }
        };
        for (i, t) in m.layout().tensors.iter().enumerate() {
            match t.kind {
                Kind::F32 { len } => assert_eq!(m.f32s(i).len(), len),
                Kind::Mat { rows, cols, .. } => {
                    let mut row = vec![0f32; cols];
                    krafla::quant::dequant_mat_row(&m.mat(i), rows - 1, &mut row);
                }
                Kind::U8 { .. } => {}
            }
        }
        if !run {
            return true;
        }
        if let Ok(model) = Model::new(&m) {
            let opts = opts(1);
            let mut st = model.state(&opts).unwrap();
            let logits = model.prefill(&mut st, &[0], None).unwrap();
            assert_eq!(logits.len(), m.dims().vocab, "{what}");
        }
        true
    }));
    match r {
        Ok(loaded) => loaded,
        Err(_) => panic!("{what}: panicked"),
    }
}

#[test]
fn mlb_every_header_byte_change_loads_or_fails_with_a_status() {
    let mut loaded = 0;
    let mut refused = 0;
    for c in cases() {
        let good = file(&c, 11);
        assert!(load_mlb(&good, c.name));
        let n_flags = if c.h.layer_flags != 0 {
            c.flags.len()
        } else {
            0
        };
        for pos in 0..HEADER_SIZE + n_flags {
            for v in byte_values(good[pos]) {
                let mut b = good.clone();
                b[pos] = v;
                if load_mlb(&b, &format!("{}: byte {pos} = {v:#04x}", c.name)) {
                    loaded += 1;
                } else {
                    refused += 1;
                }
            }
        }
    }
    // Many float fields take any finite value; every case has both outcomes.
    assert!(
        loaded > 0 && refused > 0,
        "{loaded} loaded, {refused} refused"
    );
}

#[test]
fn mlb_every_value_of_every_field_byte_of_the_seed_files() {
    // The fuzz seeds: small files with f16 scales, a shared classifier, Q4_0, layer
    // flags and linear attention. The fields end at byte 160; the rest is padding.
    let mut seeds: Vec<_> = std::fs::read_dir(seeds_dir("mlb_parse"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 4);
    for p in seeds {
        let good = std::fs::read(&p).unwrap();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(load_mlb(&good, &name));
        for pos in 0..mlb::header::FIELDS_END {
            for v in 0..=255u8 {
                if v != good[pos] {
                    let mut b = good.clone();
                    b[pos] = v;
                    load_mlb_and(&b, &format!("{name}: byte {pos} = {v:#04x}"), false);
                }
            }
        }
    }
}

#[test]
fn mlb_truncation_at_every_64_byte_boundary_fails() {
    for c in cases() {
        let good = file(&c, 3);
        let cuts = (0..good.len()).step_by(64).chain([good.len() - 1]);
        for n in cuts {
            let what = format!("{}: truncated to {n} of {} bytes", c.name, good.len());
            assert!(!load_mlb(&good[..n], &what), "{what}: loaded");
        }
    }
}

#[test]
fn mlb_random_body_bit_flips_load_or_fail_with_a_status() {
    let mut rng = Rng(0x5eed);
    for c in cases() {
        let good = file(&c, 9);
        let body = good.len() - HEADER_SIZE;
        for k in 0..60 {
            let mut b = good.clone();
            // One to four flipped bits anywhere after the header.
            for _ in 0..=(k % 4) {
                let r = ((rng.next_f32() + 1.0) / 2.0 * body as f32) as usize;
                let bit = ((rng.next_f32() + 1.0) * 4.0) as u32 % 8;
                b[HEADER_SIZE + r.min(body - 1)] ^= 1 << bit;
            }
            load_mlb(&b, &format!("{}: bit flips #{k}", c.name));
        }
    }
}

#[test]
fn mlb_header_claiming_huge_sizes_fails_before_allocating() {
    let c = &cases()[0];
    let mut b = synth_file(&c.h, &c.flags, 1);
    let mut h = c.h;
    h.vocab = 1 << 24;
    h.dim = 65536;
    h.hidden_dim = 65536;
    h.n_heads = 64;
    h.n_kv_heads = 64;
    b[..HEADER_SIZE].copy_from_slice(&h.encode());
    let e = mlb::parse(&b).unwrap_err();
    assert_eq!(
        (e.status, e.field.as_str()),
        (Status::Format, "file"),
        "{e}"
    );
}

#[test]
fn mlb_short_file_claiming_many_layers_fails_fast() {
    // Fuzz finding (mlb_parse, timeout): 260 bytes claiming 16194 layers walked the
    // whole per-layer layout before the size check; now refused on n_layers at once.
    let c = &cases()[0];
    let good = synth_file(&c.h, &c.flags, 1);
    let mut b = good[..260].to_vec();
    b[12..16].copy_from_slice(&16194u32.to_le_bytes());
    let t = std::time::Instant::now();
    for _ in 0..100 {
        let e = mlb::parse(&b).unwrap_err();
        assert_eq!(
            (e.status, e.field.as_str()),
            (Status::Format, "n_layers"),
            "{e}"
        );
    }
    assert!(t.elapsed().as_secs_f64() < 1.0, "{:?}", t.elapsed());
}

// ---------------------------------------------------------------- .mlt

/// The repository's real tokenizers as `.mlt` bytes: testdata/default's whole, and the
/// fuzz seeds (the first 600 tokens of each testdata/tokenizers family, byte-level and
/// SentencePiece, with the merges among them; made by fuzz/src/make_seeds.rs).
fn real_mlts() -> &'static [(String, Vec<u8>)] {
    static MLTS: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    MLTS.get_or_init(|| {
        let d = testdata().join("default");
        let json = std::fs::read_to_string(d.join("tokenizer.json")).unwrap();
        let cfg = std::fs::read_to_string(d.join("tokenizer_config.json")).unwrap();
        let m =
            from_hf::convert(&json, Some(&cfg), &from_hf::HfTokenizerOptions::default()).unwrap();
        let mut v = vec![("default".to_string(), m.to_bytes().unwrap())];
        let mut seeds: Vec<_> = std::fs::read_dir(seeds_dir("mlt_parse"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        seeds.sort();
        for p in seeds {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            v.push((name, std::fs::read(&p).unwrap()));
        }
        assert!(v.len() >= 3);
        v
    })
}

/// `fuzz/seeds/<target>`.
fn seeds_dir(target: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

/// Fuzz findings, kept as files in `fuzz/regressions/<target>/` (one per finding, named
/// after what it was): each must now load or fail with a status, and never panic.
#[test]
fn fuzz_regressions_load_or_fail_with_a_status() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/mlt_parse");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let what = p.display().to_string();
        let bytes = std::fs::read(&p).unwrap();
        load_mlt(&bytes, &what);
        // The text the fuzzer encoded when it found the crash.
        let r = catch_unwind(AssertUnwindSafe(|| {
            if let Ok(t) = Tokenizer::from_bytes(&bytes) {
                t.encode("Hello, world! 123 ünïcödé\n\t  x");
            }
        }));
        assert!(r.is_ok(), "{what}: panicked");
        n += 1;
    }
    assert!(n >= 1);
    // 2026-12-02 (mlt_parse): an added token holding a partial UTF-8 sequence matched
    // inside 'ü' and the encoder sliced the text there. Such a file is now refused.
    let bytes = std::fs::read(dir.join("added-token-inside-a-character.mlt")).unwrap();
    let e = Tokenizer::from_bytes(&bytes).err().expect("refused");
    assert!(e.to_string().contains("UTF-8"), "{e}");
}

/// Parses `bytes` as an `.mlt` and, if it parses, builds the tokenizer and encodes and
/// decodes with it; returns whether the tokenizer loaded.
fn load_mlt(bytes: &[u8], what: &str) -> bool {
    let r = catch_unwind(AssertUnwindSafe(|| match Tokenizer::from_bytes(bytes) {
        Ok(t) => {
            let ids = t.encode("Hello, wörld 123!\n");
            assert!(ids.iter().all(|&i| (i as usize) < t.n_vocab()), "{what}");
            t.decode(&ids);
            true
        }
        Err(e) => {
            assert_reportable(&e, what);
            false
        }
    }));
    r.unwrap_or_else(|_| panic!("{what}: panicked"))
}

#[test]
fn mlt_every_header_byte_set_to_every_value_loads_or_fails_with_a_status() {
    for (name, good) in real_mlts() {
        assert!(load_mlt(good, name));
        for pos in 0..krafla::format::mlt::HEADER_LEN {
            for v in 0..=255u8 {
                if v != good[pos] {
                    let mut b = good.clone();
                    b[pos] = v;
                    load_mlt(&b, &format!("{name}: byte {pos} = {v:#04x}"));
                }
            }
        }
    }
}

#[test]
fn mlt_truncation_at_every_64_byte_boundary_fails() {
    for (name, good) in real_mlts() {
        let cuts = (0..good.len()).step_by(64).chain([good.len() - 1]);
        for n in cuts {
            let what = format!("{name}: truncated to {n} of {} bytes", good.len());
            assert!(!load_mlt(&good[..n], &what), "{what}: loaded");
        }
    }
}

#[test]
fn mlt_random_bit_flips_load_or_fail_with_a_status() {
    let mut rng = Rng(77);
    for (name, good) in real_mlts() {
        for k in 0..200 {
            let mut b = good.clone();
            let r = ((rng.next_f32() + 1.0) / 2.0 * good.len() as f32) as usize;
            b[r.min(good.len() - 1)] ^= 1 << (k % 8);
            load_mlt(&b, &format!("{name}: bit flip #{k} at {r}"));
        }
    }
}

#[test]
fn mlt_header_claiming_huge_tables_fails_before_allocating() {
    let (_, good) = &real_mlts()[0];
    let mut b = good.clone();
    b[12..16].copy_from_slice(&u32::MAX.to_le_bytes()); // n_vocab
    b[16..20].copy_from_slice(&u32::MAX.to_le_bytes()); // n_merges
    let e = Mlt::parse(&b).unwrap_err();
    assert_eq!(e.field, "n_vocab/n_merges", "{e}");
}

// ---------------------------------------------------------------- .mli

fn small_mli() -> Vec<u8> {
    let mut m = Mli::new(2, 32, 64, 64);
    for (i, s) in m.sums.iter_mut().enumerate() {
        *s = i as f64;
    }
    m.to_bytes()
}

#[test]
fn mli_every_header_byte_set_to_every_value_parses_or_fails_with_a_status() {
    let good = small_mli();
    for pos in 0..mli::HEADER_SIZE {
        for v in 0..=255u8 {
            let mut b = good.clone();
            b[pos] = v;
            let what = format!("byte {pos} = {v:#04x}");
            match catch_unwind(|| mli::parse(&b)) {
                // A q_dim equal to dim re-encodes as 0: compare the parsed values.
                Ok(Ok(m)) => assert_eq!(mli::parse(&m.to_bytes()).unwrap(), m, "{what}"),
                Ok(Err(e)) => assert_reportable(&e, &what),
                Err(_) => panic!("{what}: panicked"),
            }
        }
    }
}

#[test]
fn mli_truncation_fails_and_huge_dims_fail_before_allocating() {
    let good = small_mli();
    for n in (0..good.len()).step_by(8) {
        assert!(mli::parse(&good[..n]).is_err(), "truncated to {n}");
    }
    let mut b = good[..mli::HEADER_SIZE].to_vec();
    for off in [8, 12, 16, 20] {
        b[off..off + 4].copy_from_slice(&65536u32.to_le_bytes());
    }
    assert_eq!(mli::parse(&b).unwrap_err().field, "file");
}

// ---------------------------------------------------------------- tokenizer

#[test]
fn stream_decoder_holds_back_an_incomplete_character_after_an_invalid_byte() {
    // A character split over byte tokens after an invalid byte: streamed decoding
    // holds the incomplete bytes back and gives the same text as decode.
    let t = Tokenizer::from_bytes(&real_mlts()[0].1).unwrap();
    let byte = |b: u8| {
        (0..t.n_vocab() as u32)
            .find(|&i| t.token_bytes(i) == Some(&[b][..]))
            .unwrap()
    };
    let ids = [byte(0xff), byte(0xe2), byte(0x82), byte(0xac)];
    let whole = String::from_utf8_lossy(&t.decode(&ids)).into_owned();
    assert_eq!(whole, "\u{fffd}€");
    let mut d = t.stream_decoder();
    let mut streamed: String = ids.iter().map(|&i| d.push(i)).collect();
    streamed.push_str(&d.finish());
    assert_eq!(streamed, whole);
}

// ---------------------------------------------------------------- binaries

/// Runs `bin` in `dir` and asserts a failure with exactly one stderr line that names
/// `file`, no panic and no backtrace hint.
fn assert_one_line_error(dir: &Path, bin: &str, args: &[&str], file: &str) {
    let err = tool(bin).current_dir(dir).args(args).fails_with(1);
    let what = format!("{bin} {args:?}");
    assert_eq!(err.lines().count(), 1, "{what}: {err}");
    assert!(err.contains(file), "{what}: {file} not named: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{what}: {err}"
    );
}

/// Bad `.mlb` files of every kind, by file name.
fn bad_mlbs(dir: &Path) -> Vec<String> {
    let c = &cases()[4];
    let good = synth_file(&c.h, &c.flags, 2);
    let mut files: Vec<(&str, Vec<u8>)> = vec![
        ("empty.mlb", vec![]),
        ("short.mlb", good[..100].to_vec()),
        ("truncated.mlb", good[..good.len() - 64].to_vec()),
        ("flags_cut.mlb", good[..HEADER_SIZE + 1].to_vec()),
        ("text.mlb", b"this is not a model\n".repeat(20)),
    ];
    for (name, pos, v) in [
        ("magic.mlb", 0, b'X'),
        ("version.mlb", 4, 9),
        ("dim.mlb", 8, 3),
        ("layer_flag.mlb", HEADER_SIZE, 0x80),
    ] {
        let mut b = good.clone();
        b[pos] = v;
        files.push((name, b));
    }
    for (name, b) in &files {
        std::fs::write(dir.join(name), b).unwrap();
        assert!(mlb::parse(b).is_err(), "{name}");
    }
    files.iter().map(|(n, _)| n.to_string()).collect()
}

#[test]
fn mlb_inspect_bad_inputs_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for f in bad_mlbs(d) {
        assert_one_line_error(d, "mlb-inspect", &[&f], &f);
    }
    let (_, mlt) = &real_mlts()[0];
    std::fs::write(d.join("cut.mlt"), &mlt[..mlt.len() / 2]).unwrap();
    std::fs::write(d.join("magic.mlt"), [b"MLTX", &mlt[4..]].concat()).unwrap();
    let mli = small_mli();
    std::fs::write(d.join("cut.mli"), &mli[..mli.len() - 8]).unwrap();
    for f in ["cut.mlt", "magic.mlt", "cut.mli", "missing.mlb"] {
        assert_one_line_error(d, "mlb-inspect", &[f], f);
    }
}

#[test]
fn mlb_run_bad_models_and_tokenizers_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for f in bad_mlbs(d) {
        assert_one_line_error(d, "mlb-run", &[&f, "--tokens", "1"], &f);
    }
    write_case(d, 0, 4);
    let (_, mlt) = &real_mlts()[0];
    std::fs::write(d.join("cut.mlt"), &mlt[..mlt.len() / 2]).unwrap();
    // testdata/default's vocabulary (far more than the model's 96) does not fit.
    std::fs::write(d.join("big.mlt"), mlt).unwrap();
    for mlt in ["cut.mlt", "big.mlt", "none.mlt"] {
        let args = ["m.mlb", "--tokenizer", mlt, "-p", "hi"];
        assert_one_line_error(d, "mlb-run", &args, mlt);
    }
    let args = ["m.mlb", "--file", "none.txt"];
    assert_one_line_error(d, "mlb-run", &args, "none.txt");
}

#[test]
fn mlb_run_prompt_longer_than_ctx_and_ids_out_of_range_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_case(d, 0, 4);
    let vocab = cases()[0].h.vocab as usize;
    let small = Mlt::parse(&real_mlts()[0].1).unwrap().vocab_prefix(vocab);
    std::fs::write(d.join("m.mlt"), small.to_bytes().unwrap()).unwrap();
    let long = "a b c d e f g h i j k l m n o p".to_string();
    for (mut args, needle) in [
        (vec!["m.mlb", "-p", &long, "--ctx", "4"], "ctx"),
        (vec!["m.mlb", "--tokens", "1 2 3 4 5", "--ctx", "4"], "ctx"),
        (vec!["m.mlb", "--tokens", "1 96"], "96"),
        (vec!["m.mlb", "--tokens", "1 4294967295"], "4294967295"),
        (vec!["m.mlb", "--tokens", "1 99999999999"], "99999999999"),
        (vec!["m.mlb", "--tokens", "1 -1"], "-1"),
    ] {
        for logits in [false, true] {
            if logits {
                args.extend(["--logits", "out.f32"]);
            }
            let err = tool("mlb-run").current_dir(d).args(&args).fails_with(1);
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            assert!(err.contains(needle), "{args:?}: {err}");
            // A failed run leaves no logits file, finished or temporary.
            assert_eq!(names_in(d), ["m.mlb", "m.mlt"], "{args:?}");
        }
    }
    // A run that fails after some positions were written (the model file changes
    // size) leaves nothing either: see a_mapped_file_that_changes_size_is_refused_before_use.
}

/// The file names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Whether `dir`'s file system makes anonymous files (O_TMPFILE), so that even a
/// SIGKILLed writer leaves no temporary file.
fn has_o_tmpfile(dir: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .open(dir)
            .is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = dir;
        false
    }
}

#[test]
fn a_mapped_file_that_changes_size_is_refused_before_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.mlb");
    let c = &cases()[0];
    let good = synth_file(&c.h, &c.flags, 6);
    std::fs::write(&path, &good).unwrap();
    let m = Mlb::open(&path).unwrap();
    m.check_unchanged().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(good.len() as u64 / 2).unwrap();
    // Nothing reads the map after this point: its second half now faults.
    let e = m.check_unchanged().unwrap_err();
    assert!(e.to_string().contains("m.mlb"), "{e}");
    assert!(e.rule.contains("changed size"), "{e}");
    assert!(Mlb::from_bytes(&good).unwrap().check_unchanged().is_ok());
}

#[test]
fn mlb_run_model_truncated_while_running_fails_with_one_line() {
    // Cut the model while mlb-run computes every position's logits of a long prompt:
    // whether the cut lands during load (size against the header), before a forward
    // pass (size re-check) or inside one (SIGBUS handler), the result is one line
    // naming the file and exit 1, never a bare "Bus error".
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut h = krafla::synth::tiny_header();
    h.dim = 256;
    h.hidden_dim = 768;
    h.n_layers = 4;
    h.vocab = 256;
    h.max_seq = 4096;
    let good = synth_file(&h, &[], 8);
    let path = d.join("big.mlb");
    std::fs::write(&path, &good).unwrap();
    let ids: Vec<String> = (0..4000).map(|i| (i % 250).to_string()).collect();
    // Spawned: the file changes size while it runs.
    let child = tool("mlb-run")
        .current_dir(d)
        .args([
            "big.mlb",
            "--threads",
            "1",
            "--logits",
            "out.bin",
            "--tokens",
        ])
        .arg(ids.join(" "))
        .spawn();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(HEADER_SIZE as u64 + 4096).unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{:?}: {err}", o.status);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("big.mlb") && !err.contains("panicked"),
        "{err}"
    );
    assert!(!d.join("out.bin").exists());
}

#[test]
fn mlb_convert_bad_checkpoints_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let st = std::fs::read(testdata().join("models/llama/model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(testdata().join("models/llama/config.json")).unwrap();
    let mut cases: Vec<(&str, &str, Vec<u8>)> = vec![
        ("cfg_text", "config.json", b"{ not json".to_vec()),
        ("cfg_array", "config.json", b"[1, 2]".to_vec()),
        ("cfg_empty", "config.json", vec![]),
        ("st_cut", "model.safetensors", st[..st.len() / 2].to_vec()),
        ("st_short", "model.safetensors", st[..5].to_vec()),
        ("st_empty", "model.safetensors", vec![]),
    ];
    let mut huge = st.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("st_huge_header", "model.safetensors", huge));
    let mut garbled = st.clone();
    garbled[8..20].copy_from_slice(b"!!!!!!!!!!!!");
    cases.push(("st_garbled", "model.safetensors", garbled));
    for (key, bad) in [
        ("\"hidden_size\"", "\"hidden_size\": -64, \"x\""),
        (
            "\"num_attention_heads\"",
            "\"num_attention_heads\": 0, \"x\"",
        ),
        ("\"vocab_size\"", "\"vocab_size\": \"many\", \"x\""),
    ] {
        assert!(cfg.contains(key), "{key}");
        let c = cfg.replacen(key, bad, 1);
        cases.push(("cfg_field", "config.json", c.into_bytes()));
    }
    for (i, (name, file, bytes)) in cases.iter().enumerate() {
        let ck = checkpoint(d, "llama", &format!("{name}{i}"));
        std::fs::write(ck.join(file), bytes).unwrap();
        let ck = ck.file_name().unwrap().to_str().unwrap().to_string();
        let out = format!("{ck}.mlb");
        assert_one_line_error(d, "mlb-convert", &[&ck, "-o", &out], file);
        assert!(!d.join(&out).exists(), "{ck}: output written");
    }
    let ck = checkpoint(d, "llama", "no_weights");
    std::fs::remove_file(ck.join("model.safetensors")).unwrap();
    assert_one_line_error(
        d,
        "mlb-convert",
        &["no_weights", "-o", "x.mlb"],
        "no_weights",
    );
    assert_one_line_error(
        d,
        "mlb-convert",
        &["missing_dir", "-o", "x.mlb"],
        "missing_dir",
    );
}

#[test]
fn mlb_convert_killed_midway_leaves_the_existing_output_intact() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let old = synth_file(&cases()[0].h, &[], 1);
    let out = d.join("out.mlb");
    let ck = testdata().join("default");
    for delay_ms in [20, 80, 200] {
        std::fs::write(&out, &old).unwrap();
        let mut child = mlb_convert(&ck, &out).spawn();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        child.wait().unwrap();
        let now = std::fs::read(&out).unwrap();
        // Either untouched, or replaced whole by a finished conversion.
        assert!(
            now == old || Mlb::from_bytes(&now).is_ok(),
            "killed after {delay_ms} ms: out.mlb damaged"
        );
        // The temporary file was anonymous: nothing is left beside the output.
        if has_o_tmpfile(d) {
            assert_eq!(names_in(d), ["out.mlb"], "killed after {delay_ms} ms");
        }
    }
}

/// A disk that fills up mid-conversion: a 256 KiB tmpfs, mounted in a private mount
/// namespace (`unshare -rm`), holding an existing output. The conversion fails with one
/// line naming the output and the cause; the old file is untouched and nothing else is
/// left. Skipped, with a message, where namespaces or tmpfs mounts are not allowed.
#[test]
fn mlb_convert_on_a_full_disk_fails_and_keeps_the_existing_output() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("mnt");
    std::fs::create_dir(&m).unwrap();
    let script = r#"mount -t tmpfs -o size=256k tmpfs "$1" || exit 77
printf precious > "$1/out.mlb"
"$2" "$3" -o "$1/out.mlb" >/dev/null
echo "rc=$?"
ls -A "$1"
cat "$1/out.mlb""#;
    let o = std::process::Command::new("unshare")
        .args(["-rm", "sh", "-c", script, "sh"])
        .arg(&m)
        .arg(crate::util::bin_path("mlb-convert"))
        .arg(testdata().join("default"))
        .output();
    let o = match o {
        Ok(o) if o.status.code() != Some(77) && o.status.success() => o,
        other => {
            eprintln!("skipped: no private tmpfs mount here ({other:?})");
            return;
        }
    };
    let out = String::from_utf8_lossy(&o.stdout);
    let err = stderr(&o);
    assert_eq!(out, "rc=1\nout.mlb\nprecious", "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("out.mlb") && err.contains("No space left"),
        "{err}"
    );
}

#[test]
fn mlt_convert_bad_inputs_fail_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let json = std::fs::read_to_string(testdata().join("default/tokenizer.json")).unwrap();
    std::fs::write(d.join("cut.json"), &json[..json.len() / 2]).unwrap();
    std::fs::write(d.join("empty.json"), "").unwrap();
    std::fs::write(d.join("array.json"), "[]").unwrap();
    std::fs::write(
        d.join("model.json"),
        json.replacen("\"model\"", "\"model\": 5, \"x\"", 1),
    )
    .unwrap();
    for f in [
        "cut.json",
        "empty.json",
        "array.json",
        "model.json",
        "none.json",
    ] {
        assert_one_line_error(d, "mlt-convert", &[f, "-o", "t.mlt"], f);
        assert!(!d.join("t.mlt").exists(), "{f}: output written");
    }
}

/// A stdout that fails (a full disk: /dev/full) ends every tool with one line and exit
/// status 1, never a panic; a closed pipe ends it quietly (SIGPIPE's default).
#[test]
fn a_failing_stdout_is_one_line_not_a_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped: no /dev/full here");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_case(d, 0, 4);
    let ck = testdata().join("default");
    let ck = ck.to_str().unwrap();
    for (bin, args) in [
        ("mlb-inspect", vec!["m.mlb"]),
        ("mlb-inspect", vec!["m.mlb", "--json"]),
        ("mlb-run", vec!["m.mlb", "--tokens", "1 2", "-n", "2"]),
        ("mlb-convert", vec![ck, "-o", "c.mlb"]),
    ] {
        let mut t = tool(bin);
        t.args(&args).current_dir(d);
        t.command().stdout(full.try_clone().unwrap());
        let err = t.fails_with(1);
        assert_eq!(err.lines().count(), 1, "{bin} {args:?}: {err}");
        assert!(err.contains("stdout"), "{bin}: {err}");
    }
}
