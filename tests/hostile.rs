//! The tools run as a hostile user would run them (issue 14): outputs that name an
//! input, devices and FIFOs as inputs and outputs, sizes that would allocate terabytes,
//! a process limit on threads, stale temporary names, files the loaders refuse.
//!
//! Every refusal is checked the same way ([`refused`]): exit status 1 (not 101, not a
//! signal), exactly one stderr line naming the file and the field or value, no
//! "panicked", and the folder exactly as it was (no output, no temporary file, every
//! existing file byte for byte). Every run has a time limit, so a tool that hangs on
//! a FIFO fails the test instead of hanging it. Tests that need root or a working
//! process limit skip with a message.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use krafla::format::mlb::{header::wtype, Layout, Mlb, HEADER_SIZE};
use krafla::format::mli::Mli;
use krafla::format::mlt::{Attr, Kind, Mlt};
use krafla::synth::{synth_file, tiny_header};
use serde_json::Value;

use crate::util::fixtures::{checkpoint, convert_to, copy_files};
use crate::util::tool::{tool, Tool};
use crate::util::{stderr, testdata};

/// Longest a run may take: every case here fails or finishes in well under a second.
const LIMIT: Duration = Duration::from_secs(60);

/// `bin args` in `dir`, killed after [`LIMIT`]; `setup` runs in the child before exec
/// (resource limits).
fn run_with(
    dir: &Path,
    bin: &str,
    args: &[&str],
    setup: Option<fn() -> std::io::Result<()>>,
) -> Tool {
    let mut t = tool(bin);
    t.args(args).current_dir(dir).time_limit(LIMIT);
    if let Some(f) = setup {
        // SAFETY: `f` only makes system calls (setrlimit, setuid), safe after fork.
        unsafe { t.command().pre_exec(f) };
    }
    t
}

fn run(dir: &Path, bin: &str, args: &[&str]) -> Tool {
    run_with(dir, bin, args, None)
}

/// Every file under `dir` (relative name → bytes; symlinks as their target, FIFOs and
/// devices as their kind), to check that a refused run changed nothing.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let t = std::fs::symlink_metadata(&p).unwrap().file_type();
            let v = if t.is_symlink() {
                let to = std::fs::read_link(&p).unwrap();
                format!("symlink → {}", to.display()).into_bytes()
            } else if t.is_dir() {
                walk(root, &p, out);
                b"folder".to_vec()
            } else if t.is_file() {
                std::fs::read(&p).unwrap()
            } else {
                format!("{t:?}").into_bytes()
            };
            out.insert(name, v);
        }
    }
    let mut m = BTreeMap::new();
    walk(dir, dir, &mut m);
    m
}

/// Runs `bin` and asserts a refusal: exit 1, one stderr line holding every needle, no
/// panic, and `dir` unchanged.
fn refused(dir: &Path, bin: &str, args: &[&str], needles: &[&str]) -> String {
    let before = snapshot(dir);
    let err = run(dir, bin, args).fails_with(1);
    let what = format!("{bin} {args:?}");
    assert_eq!(err.lines().count(), 1, "{what}: {err}");
    for n in needles {
        assert!(err.contains(n), "{what}: {n:?} not in: {err}");
    }
    let after = snapshot(dir);
    if before != after {
        let changed: Vec<_> = after
            .keys()
            .chain(before.keys())
            .filter(|k| before.get(*k) != after.get(*k))
            .collect();
        panic!("{what}: changed {changed:?}");
    }
    err
}

/// Runs `bin` and asserts success without a panic; returns stderr.
fn succeeds(dir: &Path, bin: &str, args: &[&str]) -> String {
    run(dir, bin, args).ok().stderr
}

fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

/// The tensors of a safetensors file: name → (start, end) of its bytes in the file.
fn tensor_ranges(st: &[u8]) -> BTreeMap<String, (usize, usize)> {
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&st[8..8 + n]).unwrap();
    h.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = &v["data_offsets"];
            let (a, b) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            (k.clone(), (8 + n + a as usize, 8 + n + b as usize))
        })
        .collect()
}

/// The synthetic model (tiny Llama, vocab 96) and a tokenizer fitting it, in `dir`.
fn small_model(dir: &Path) {
    let h = tiny_header();
    std::fs::write(dir.join("m.mlb"), synth_file(&h, &[], 3)).unwrap();
    let json = std::fs::read_to_string(testdata().join("default/tokenizer.json")).unwrap();
    let mut m = krafla::tokenizer::from_hf::convert(&json, None, &Default::default()).unwrap();
    m.tokens.truncate(h.vocab as usize);
    m.merges.retain(|r| r.merged < h.vocab);
    m.bos = m.bos.filter(|&b| b < h.vocab);
    m.eos = m.eos.filter(|&b| b < h.vocab);
    m.flags &= !krafla::format::mlt::FLAG_ADD_BOS;
    std::fs::write(dir.join("m.mlt"), m.to_bytes().unwrap()).unwrap();
}

// ------------------------------------------------------------ 1: outputs that are inputs

#[test]
fn mlb_convert_refuses_an_output_that_is_one_of_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    checkpoint(d, "llama", "ck");
    std::os::unix::fs::symlink("ck/model.safetensors", d.join("link.mlb")).unwrap();
    std::fs::hard_link(d.join("ck/config.json"), d.join("hard.mlb")).unwrap();
    for out in [
        "ck/model.safetensors",
        "ck/config.json",
        "link.mlb",
        "hard.mlb",
    ] {
        refused(
            d,
            "mlb-convert",
            &["ck", "-o", out],
            &[out, "the same file as the input", "ck/"],
        );
    }

    // A sharded checkpoint: the shard and the index are inputs too.
    let sh = checkpoint(d, "llama", "sharded");
    let st = std::fs::read(sh.join("model.safetensors")).unwrap();
    std::fs::remove_file(sh.join("model.safetensors")).unwrap();
    let shard = "model-00001-of-00001.safetensors";
    std::fs::write(sh.join(shard), &st).unwrap();
    let map: serde_json::Map<String, Value> = tensor_ranges(&st)
        .into_keys()
        .map(|k| (k, Value::from(shard)))
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(sh.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let shard_out = format!("sharded/{shard}");
    for out in [shard_out.as_str(), "sharded/model.safetensors.index.json"] {
        refused(
            d,
            "mlb-convert",
            &["sharded", "-o", out],
            &[out, "the same file as the input"],
        );
    }
    succeeds(d, "mlb-convert", &["sharded", "-o", "ok.mlb"]);

    // The importance matrix.
    let mut m = Mli::new(2, 64, 128, 64);
    m.tokens = 1;
    m.sums.iter_mut().for_each(|s| *s = 1.0);
    std::fs::write(d.join("i.mli"), m.to_bytes()).unwrap();
    let args = ["ck", "--wtype", "q4_0", "--imatrix", "i.mli", "-o", "i.mli"];
    refused(
        d,
        "mlb-convert",
        &args,
        &["i.mli", "the same file as the input i.mli"],
    );
    succeeds(
        d,
        "mlb-convert",
        &[
            "ck",
            "--wtype",
            "q4_0",
            "--imatrix",
            "i.mli",
            "-o",
            "q4.mlb",
        ],
    );
}

#[test]
fn mlt_convert_refuses_an_output_that_is_one_of_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tokenizer = ["tokenizer.json", "tokenizer_config.json"];
    copy_files(&testdata().join("default"), d, &tokenizer);
    std::os::unix::fs::symlink("tokenizer.json", d.join("link.mlt")).unwrap();
    for out in ["tokenizer.json", "tokenizer_config.json", "link.mlt"] {
        refused(
            d,
            "mlt-convert",
            &["tokenizer.json", "-o", out],
            &[out, "the same file as the input"],
        );
    }
    succeeds(d, "mlt-convert", &["tokenizer.json", "-o", "t.mlt"]);
}

#[test]
fn mlb_run_refuses_an_output_that_is_one_of_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    std::fs::write(d.join("prompt.txt"), "a b c").unwrap();
    std::fs::copy(d.join("m.mlb"), d.join("ref.mlb")).unwrap();
    std::os::unix::fs::symlink("m.mlb", d.join("link.f32")).unwrap();
    // The output, named last, is one of the inputs (or a link to one).
    for args in [
        &["m.mlb", "--tokens", "1 2 3", "--logits", "m.mlb"][..],
        &["m.mlb", "--tokens", "1 2 3", "--logits", "link.f32"],
        &["m.mlb", "--tokens", "1 2 3", "--logits", "m.mlt"],
        &["m.mlb", "--file", "prompt.txt", "--logits", "prompt.txt"],
        &["m.mlb", "--tokens", "1 2 3", "--imatrix", "m.mlb"],
        &[
            "m.mlb",
            "--tokenizer",
            "m.mlt",
            "--file",
            "prompt.txt",
            "--imatrix",
            "m.mlt",
        ],
    ] {
        let out = args[args.len() - 1];
        refused(d, "mlb-run", args, &[out, "the same file as the input"]);
    }
    succeeds(
        d,
        "mlb-run",
        &["m.mlb", "--tokens", "1 2 3", "--logits", "out.f32"],
    );
}

// ---------------------------------------------- 2: devices and FIFOs as outputs

/// Reads everything written into the FIFO `p` while `f` runs. The FIFO is held open
/// for writing meanwhile, so neither side blocks even when the tool never opens it (as
/// when it renames a file over it): then the result is empty, not a hang.
fn read_fifo_during<T>(p: &Path, f: impl FnOnce() -> T) -> (T, Vec<u8>) {
    let keep = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let reader = {
        let p = p.to_path_buf();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            std::fs::File::open(p).unwrap().read_to_end(&mut v).unwrap();
            v
        })
    };
    // Let the reader open before the tool runs (it would also open later: `keep`).
    std::thread::sleep(Duration::from_millis(20));
    let r = f();
    drop(keep);
    (r, reader.join().unwrap())
}

fn assert_fifo(p: &Path) {
    let t = std::fs::symlink_metadata(p).unwrap().file_type();
    assert!(t.is_fifo(), "{}: replaced by {t:?}", p.display());
}

#[test]
fn a_fifo_output_receives_the_bytes_and_stays_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    std::fs::copy(testdata().join("default/tokenizer.json"), d.join("t.json")).unwrap();
    succeeds(d, "mlt-convert", &["t.json", "-o", "want.mlt"]);
    succeeds(
        d,
        "mlb-run",
        &["m.mlb", "--tokens", "1 2 3", "--logits", "want.f32"],
    );
    let fifo = d.join("fifo");
    mkfifo(&fifo);
    for (bin, args, want) in [
        (
            "mlt-convert",
            vec!["t.json", "-o", "fifo", "-q"],
            "want.mlt",
        ),
        (
            "mlb-run",
            vec!["m.mlb", "--tokens", "1 2 3", "--logits", "fifo"],
            "want.f32",
        ),
    ] {
        let (_, got) = read_fifo_during(&fifo, || succeeds(d, bin, &args));
        assert_fifo(&fifo);
        assert!(
            got == std::fs::read(d.join(want)).unwrap(),
            "{bin}: bytes differ"
        );
    }
    let names: Vec<_> = snapshot(d).into_keys().collect();
    assert_eq!(
        names,
        ["fifo", "m.mlb", "m.mlt", "t.json", "want.f32", "want.mlt"]
    );
}

/// A character device as the output: a copy of /dev/null made with mknod where that
/// is allowed (root), so a regression renames over the copy; elsewhere /dev/null
/// itself, which a user without root could not replace anyway.
#[test]
fn a_device_output_is_written_not_replaced() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    let copy = d.join("null");
    let c = std::ffi::CString::new(copy.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; makedev(1, 3) is /dev/null.
    let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let dev = match (made, root) {
        (true, _) if std::fs::OpenOptions::new().write(true).open(&copy).is_ok() => copy,
        (_, false) => PathBuf::from("/dev/null"),
        _ => {
            eprintln!(
                "skipped: as root without a usable device node copy, /dev/null itself is at stake"
            );
            return;
        }
    };
    let out = dev.to_str().unwrap();
    std::fs::copy(testdata().join("default/tokenizer.json"), d.join("t.json")).unwrap();
    succeeds(
        d,
        "mlb-run",
        &["m.mlb", "--tokens", "1 2 3", "--logits", out],
    );
    succeeds(d, "mlt-convert", &["t.json", "-o", out, "-q"]);
    succeeds(
        d,
        "mlb-convert",
        &[testdata().join("models/llama").to_str().unwrap(), "-o", out],
    );
    let t = std::fs::symlink_metadata(&dev).unwrap().file_type();
    assert!(t.is_char_device(), "{out} replaced by {t:?}");
}

// ------------------------------------------------------------------- 3: thread limits

/// In the child: at most one process or thread for its user (as root, the user
/// nobody, since root is exempt from the limit).
fn one_thread_only() -> std::io::Result<()> {
    // SAFETY: plain system calls with valid arguments.
    unsafe {
        os_ok(libc::setrlimit(libc::RLIMIT_NPROC, &limit(1)))?;
        if libc::geteuid() == 0 {
            os_ok(libc::setgroups(0, std::ptr::null()))?;
            os_ok(libc::setgid(65534))?;
            os_ok(libc::setuid(65534))?;
        }
    }
    Ok(())
}

/// A resource limit of `n`, soft and hard.
fn limit(n: libc::rlim_t) -> libc::rlimit {
    libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    }
}

/// A system call's status: nonzero is the error in errno.
fn os_ok(status: libc::c_int) -> std::io::Result<()> {
    if status != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[test]
fn under_a_thread_limit_the_tools_run_on_one_thread_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap();
    small_model(d);
    // Whether the limit holds here: a shell cannot fork a subshell under it.
    let mut probe = Command::new("sh");
    probe.args(["-c", "(true) && echo forked"]).current_dir(d);
    // SAFETY: as in run_with.
    let probe = unsafe { probe.pre_exec(one_thread_only) }.output();
    match probe {
        Ok(o) if !String::from_utf8_lossy(&o.stdout).contains("forked") => {}
        other => {
            eprintln!("skipped: no effective process limit here ({other:?})");
            return;
        }
    }
    let err = run_with(
        d,
        "mlb-run",
        &["m.mlb", "--tokens", "1 2 3", "-n", "2", "--threads", "4"],
        Some(one_thread_only),
    )
    .ok()
    .stderr;
    assert!(
        err.contains("mlb-run: note: started 1 of 4 threads ("),
        "{err}"
    );

    let ck = checkpoint(d, "llama", "ck");
    std::fs::set_permissions(&ck, std::fs::Permissions::from_mode(0o755)).unwrap();
    for extra in [&["--threads", "3"][..], &[]] {
        let mut args = vec!["ck", "-o", "x.mlb"];
        args.extend(extra);
        let err = run_with(d, "mlb-convert", &args, Some(one_thread_only))
            .ok()
            .stderr;
        assert!(err.contains("note: could not start "), "{args:?}: {err}");
        assert!(err.contains("converting on one thread"), "{args:?}: {err}");
        let fresh = convert_to(&ck, &d.join("y.mlb"), krafla::convert::WType::Q8_0);
        assert_eq!(std::fs::read(d.join("x.mlb")).unwrap(), fresh);
    }
}

// ------------------------------------------------------ 4: sizes that would allocate

#[test]
fn huge_sizes_fail_on_the_limit_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ck = checkpoint(d, "llama", "ck");
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
    for (key, v) in [
        ("num_hidden_layers", 1_000_000_000_000u64),
        ("hidden_size", 1 << 40),
        ("vocab_size", u64::MAX),
    ] {
        let mut c = cfg.clone();
        c[key] = Value::from(v);
        std::fs::write(ck.join("config.json"), c.to_string()).unwrap();
        let value = format!("{key} = {v}: above the format's limit");
        refused(
            d,
            "mlb-convert",
            &["ck", "-o", "x.mlb"],
            &["ck/config.json", &value],
        );
    }

    // tokenizer.json ids far above the number of tokens.
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(testdata().join("default/tokenizer.json")).unwrap(),
    )
    .unwrap();
    // mlt-convert refuses `j` as t.json, naming the file and `field`.
    let json_refused = |j: &Value, field: String| {
        std::fs::write(d.join("t.json"), j.to_string()).unwrap();
        refused(
            d,
            "mlt-convert",
            &["t.json", "-o", "t.mlt"],
            &["t.json", &field],
        );
    };
    for id in [1u64 << 31, u32::MAX as u64] {
        let mut j = json.clone();
        let piece = j["model"]["vocab"]
            .as_object()
            .unwrap()
            .keys()
            .nth(300)
            .unwrap()
            .clone();
        j["model"]["vocab"][&piece] = Value::from(id);
        json_refused(
            &j,
            format!("model.vocab[{piece:?}] = {id}: ids must be dense"),
        );
        let mut j = json.clone();
        j["added_tokens"][0]["id"] = Value::from(id);
        json_refused(
            &j,
            format!("added_tokens id {id} = {id}: ids must be dense"),
        );
    }
}

// --------------------------------------------- 5 and 8: FIFOs and devices as inputs

#[test]
fn fifos_and_devices_as_inputs_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    mkfifo(&d.join("fifo"));
    std::fs::copy(testdata().join("default/tokenizer.json"), d.join("t.json")).unwrap();
    let fifo = "not a regular file (a FIFO)";
    let dev = "not a regular file (a character device)";
    let cases: Vec<(&str, Vec<&str>, &str, &str)> = vec![
        ("mlb-inspect", vec!["fifo"], "fifo", fifo),
        ("mlb-inspect", vec!["/dev/zero"], "/dev/zero", dev),
        ("mlb-run", vec!["fifo", "--tokens", "1"], "fifo", fifo),
        (
            "mlb-run",
            vec!["/dev/zero", "--tokens", "1"],
            "/dev/zero",
            dev,
        ),
        (
            "mlb-run",
            vec!["m.mlb", "--tokenizer", "fifo", "-p", "hi"],
            "fifo",
            fifo,
        ),
        (
            "mlb-run",
            vec!["m.mlb", "--tokenizer", "/dev/zero", "-p", "hi"],
            "/dev/zero",
            dev,
        ),
        (
            "mlb-run",
            vec!["m.mlb", "--tokens", "1 2", "--kl-divergence", "fifo"],
            "fifo",
            fifo,
        ),
        ("mlt-convert", vec!["fifo", "-o", "x.mlt"], "fifo", fifo),
        (
            "mlt-convert",
            vec!["/dev/zero", "-o", "x.mlt"],
            "/dev/zero",
            dev,
        ),
    ];
    for (bin, args, file, why) in &cases {
        refused(d, bin, args, &[file, why]);
    }
    // tokenizer_config.json beside the tokenizer.
    mkfifo(&d.join("tokenizer_config.json"));
    refused(
        d,
        "mlt-convert",
        &["t.json", "-o", "x.mlt"],
        &["tokenizer_config.json", fifo],
    );
    std::fs::remove_file(d.join("tokenizer_config.json")).unwrap();

    // Every file of a checkpoint, and the importance matrix.
    let ck = checkpoint(d, "llama", "ck");
    for f in ["config.json", "model.safetensors"] {
        let keep = std::fs::read(ck.join(f)).unwrap();
        std::fs::remove_file(ck.join(f)).unwrap();
        mkfifo(&ck.join(f));
        refused(d, "mlb-convert", &["ck", "-o", "x.mlb"], &[f, fifo]);
        std::fs::remove_file(ck.join(f)).unwrap();
        std::fs::write(ck.join(f), keep).unwrap();
    }
    let args = ["ck", "--wtype", "q4_0", "--imatrix", "fifo", "-o", "x.mlb"];
    refused(d, "mlb-convert", &args, &["fifo", fifo]);
}

/// In the child: at most 24 MiB of heap and other private writable memory.
fn small_heap() -> std::io::Result<()> {
    // SAFETY: a plain system call with a valid argument.
    os_ok(unsafe { libc::setrlimit(libc::RLIMIT_DATA, &limit(24 << 20)) })
}

/// A model larger than the memory a process may allocate is mapped, not read: the
/// report needs little more than the header.
#[test]
fn mlb_inspect_maps_a_model_larger_than_its_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut h = tiny_header();
    h.vocab = 1 << 20; // a 64 MiB Q8_0 embedding (and classifier)
    h.shared_classifier = 1;
    // All-zero arrays are valid: write the header and extend the file (sparse).
    let dims = krafla::format::mlb::validate(&h).unwrap();
    let end = Layout::end_offset(&h, &dims, &[], &[], u64::MAX).unwrap();
    let f = std::fs::File::create(d.join("big.mlb")).unwrap();
    std::io::Write::write_all(&mut &f, &h.encode()).unwrap();
    f.set_len(end).unwrap();
    assert!(end > 64 << 20);
    let o = run_with(d, "mlb-inspect", &["big.mlb"], Some(small_heap)).ok();
    assert!(o.stdout.contains("verdict: valid"));
}

// ------------------------------------------------------------- 7: stale temporary names

/// In the child (its PID is the tool's): creates `.out.mlt.tmp-PID` in the current
/// folder, as a run killed between link and rename with the same PID would leave it.
fn stale_tmp_name() -> std::io::Result<()> {
    // No allocation after fork: the name is built in a stack buffer.
    let mut buf = [0u8; 64];
    let prefix = b".out.mlt.tmp-";
    buf[..prefix.len()].copy_from_slice(prefix);
    // SAFETY: getpid has no preconditions.
    let mut pid = unsafe { libc::getpid() } as u32;
    let mut digits = [0u8; 10];
    let mut n = 0;
    loop {
        digits[n] = b'0' + (pid % 10) as u8;
        n += 1;
        pid /= 10;
        if pid == 0 {
            break;
        }
    }
    for i in 0..n {
        buf[prefix.len() + i] = digits[n - 1 - i];
    }
    // buf stays NUL-terminated: it is longer than the name.
    // SAFETY: a NUL-terminated name in a live buffer.
    let fd = unsafe { libc::open(buf.as_ptr().cast(), libc::O_CREAT | libc::O_WRONLY, 0o644) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened; "stale" is 5 bytes.
    unsafe {
        libc::write(fd, b"stale".as_ptr().cast(), 5);
        libc::close(fd);
    }
    Ok(())
}

#[test]
fn a_stale_temporary_name_does_not_block_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::copy(testdata().join("default/tokenizer.json"), d.join("t.json")).unwrap();
    run_with(
        d,
        "mlt-convert",
        &["t.json", "-o", "out.mlt", "-q"],
        Some(stale_tmp_name),
    )
    .ok();
    Mlt::load(&d.join("out.mlt")).unwrap();
    // The stale file is someone else's: left as it was.
    let stale: Vec<_> = snapshot(d)
        .into_iter()
        .filter(|(k, _)| k.starts_with(".out.mlt.tmp-"))
        .collect();
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert_eq!(stale[0].1, b"stale");
}

// ------------------------------------------------ 9: mlb-inspect's verdict on .mlt files

#[test]
fn mlb_inspect_refuses_the_mlt_files_the_loader_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An added token that is not UTF-8 (the fuzzer's reproducer).
    let repro = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions/mlt_parse/added-token-inside-a-character.mlt");
    std::fs::copy(repro, d.join("added.mlt")).unwrap();
    // A SentencePiece vocabulary missing a byte-fallback token.
    let json = {
        let gz =
            std::fs::File::open(testdata().join("tokenizers/gemma3.tokenizer.json.gz")).unwrap();
        let mut s = String::new();
        flate2::read::GzDecoder::new(gz)
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    let mut m = krafla::tokenizer::from_hf::convert(&json, None, &Default::default()).unwrap();
    assert_eq!(m.kind, Kind::SentencePiece);
    let b = m
        .tokens
        .iter()
        .position(|t| t.attr == Attr::Byte && t.bytes == [0x41])
        .unwrap();
    m.tokens[b].attr = Attr::Normal;
    m.tokens[b].bytes = b"<0x41>".to_vec();
    std::fs::write(d.join("sp.mlt"), m.to_bytes().unwrap()).unwrap();
    for (f, needle) in [
        ("added.mlt", "an added token must be UTF-8 text"),
        (
            "sp.mlt",
            "tokens = <0x41>: a SentencePiece vocabulary must hold all 256",
        ),
    ] {
        refused(d, "mlb-inspect", &[f], &[f, needle]);
        refused(d, "mlb-inspect", &[f, "--json"], &[f, needle]);
        // The loader agrees.
        assert!(krafla::tokenizer::Tokenizer::from_path(&d.join(f)).is_err());
    }
}

// ---------------------------------------------------------- 10: a dropped lm_head.weight

#[test]
fn a_tied_model_says_what_it_does_with_lm_head() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ck = checkpoint(d, "llama", "ck");
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
    cfg["tie_word_embeddings"] = Value::Bool(true);
    std::fs::write(ck.join("config.json"), cfg.to_string()).unwrap();
    let err = succeeds(d, "mlb-convert", &["ck", "-o", "differs.mlb"]);
    assert!(
        err.contains("note: lm_head.weight differs from model.embed_tokens.weight and is dropped"),
        "{err}"
    );
    // The same file with lm_head a copy of the embeddings.
    let mut st = std::fs::read(ck.join("model.safetensors")).unwrap();
    let r = tensor_ranges(&st);
    let (e, h) = (r["model.embed_tokens.weight"], r["lm_head.weight"]);
    let emb = st[e.0..e.1].to_vec();
    st[h.0..h.1].copy_from_slice(&emb);
    std::fs::write(ck.join("model.safetensors"), &st).unwrap();
    let err = succeeds(d, "mlb-convert", &["ck", "-o", "copy.mlb"]);
    assert!(
        err.contains("note: lm_head.weight is a copy of model.embed_tokens.weight"),
        "{err}"
    );
    // Either way the classifier is the embeddings, as in transformers.
    assert_eq!(
        std::fs::read(d.join("differs.mlb")).unwrap(),
        std::fs::read(d.join("copy.mlb")).unwrap()
    );
    let m = Mlb::open(&d.join("copy.mlb")).unwrap();
    assert_eq!(m.header().shared_classifier, 1);
}

// ------------------------------------------------------------------------ 11: small ones

#[test]
fn mlb_run_numeric_options_reach_the_tools_own_checks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    refused(
        d,
        "mlb-run",
        &["m.mlb", "--tokens", "1 4294967295"],
        &["ids = 4294967295: must be below n_vocab (96)"],
    );
    // An option out of range, on a one-token prompt.
    for (option, value, needle) in [
        ("--temp", "-1", "--temp = -1: must be a finite number"),
        ("--top-p", "-0.5", "--top-p = -0.5: must be in (0, 1]"),
        // Not a hundred thousand spinning threads.
        ("--threads", "100000", "--threads = 100000: at most 1024"),
    ] {
        let args = ["m.mlb", "--tokens", "1", option, value];
        refused(d, "mlb-run", &args, &[needle]);
    }
    let ck = testdata().join("models/llama");
    let args = [ck.to_str().unwrap(), "-o", "x.mlb", "--threads", "100000"];
    refused(
        d,
        "mlb-convert",
        &args,
        &["--threads: at most 1024 (got 100000)"],
    );
}

#[test]
fn mlb_inspect_warns_when_the_file_goes_on_past_the_arrays() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let h = tiny_header();
    let good = synth_file(&h, &[], 5);
    let end = krafla::format::mlb::parse(&good).unwrap().layout.end;
    assert_eq!(end, good.len() as u64);
    // wtype Q8_0 → Q4_0: the header now implies smaller matrices (Q4_0 quants are any
    // byte, so the file loads) and the rest of the file is unaccounted for.
    let mut q4h = h;
    q4h.wtype = wtype::Q4_0;
    let mut q4 = good.clone();
    q4[..HEADER_SIZE].copy_from_slice(&q4h.encode());
    let mut pad63 = good.clone();
    pad63.resize(good.len() + 63, 0);
    let mut pad64 = good.clone();
    pad64.resize(good.len() + 64, 0);
    for (name, bytes, warn) in [
        ("q4.mlb", &q4, true),
        ("pad63.mlb", &pad63, false),
        ("pad64.mlb", &pad64, true),
    ] {
        std::fs::write(d.join(name), bytes).unwrap();
        let out = run(d, "mlb-inspect", &[name]).ok().stdout;
        assert_eq!(
            out.contains("bytes past the last array"),
            warn,
            "{name}: {out}"
        );
        assert_eq!(
            out.contains("verdict: valid, 1 warning(s)"),
            warn,
            "{name}: {out}"
        );
        let o = run(d, "mlb-inspect", &[name, "--json"]).ok();
        let v: Value = serde_json::from_str(&o.stdout).unwrap();
        assert_eq!(
            v["warnings"].as_array().unwrap().len(),
            warn as usize,
            "{name}: {v}"
        );
    }
}

// ------------------------------------------- mlb-inspect maps: the mmap caveat's SIGBUS

/// mlb-inspect now maps its file, so a truncation by another process while it reads
/// raises SIGBUS; like mlb-run it reports that as one line and exit 1. The signal is
/// sent by hand (a truncation cannot be timed into the read) once `--encode` has the
/// file mapped (in /proc's maps) and so waits on stdin with the handler in place: the
/// handler is installed before the map. SigCgt in /proc is no such sign: Rust's runtime
/// catches SIGBUS before `main` (its stack-overflow handler), and a SIGBUS sent then is
/// swallowed and the tool exits 0.
#[test]
fn mlb_inspect_reports_a_sigbus_as_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    let child = tool("mlb-inspect")
        .args(["m.mlt", "--encode"])
        .current_dir(d)
        .stdin_open()
        .spawn();
    let maps = format!("/proc/{}/maps", child.id());
    let t0 = Instant::now();
    let mapped = || {
        let s = std::fs::read_to_string(&maps).unwrap_or_default();
        s.lines().any(|l| l.ends_with("/m.mlt"))
    };
    while !mapped() {
        assert!(t0.elapsed() < LIMIT, "m.mlt never mapped");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill with a live child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGBUS) }, 0);
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{:?}: {err}", o.status);
    assert_eq!(
        err,
        "mlb-inspect: ML_E_IO: m.mlt: the file was truncated or changed while in use (SIGBUS)\n"
    );
}

// ------------------------------------------------- 12: hostile chat templates (issue 42)

/// A 3 GiB address space, as the issue's probes ran.
fn three_gib() -> std::io::Result<()> {
    let l = limit(3 << 30);
    // SAFETY: setrlimit with a valid rlimit.
    os_ok(unsafe { libc::setrlimit(libc::RLIMIT_AS, &l) })
}

/// Every hostile template through each tool that renders one, under a 3 GiB address
/// space: mlb-inspect --chat and mlb-run --chat refuse with one line naming the
/// template and its budget (before: SIGABRT on a 4 GB allocation, a stack overflow, or
/// 2.5 GiB and 30 s); mlt-convert, which renders a probe conversation to find the end
/// of turn, writes the file (the probe's failure only leaves that unknown).
#[test]
fn hostile_chat_templates_are_one_line_in_every_tool() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    let conv =
        r#"{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}"#;
    std::fs::write(d.join("conv.json"), conv).unwrap();
    let base = Mlt::parse(&std::fs::read(d.join("m.mlt")).unwrap()).unwrap();
    let json = testdata().join("default/tokenizer.json");
    for (i, src) in crate::util::hostile_templates().into_iter().enumerate() {
        let mut m = base.clone();
        m.flags |= krafla::format::mlt::FLAG_CHAT;
        m.chat = Some(krafla::format::mlt_chat::ChatSection {
            templates: vec![krafla::format::mlt_chat::NamedTemplate {
                name: "default".into(),
                source: src.to_string(),
            }],
            ..Default::default()
        });
        let t = format!("t{i}.mlt");
        std::fs::write(d.join(&t), m.to_bytes().unwrap()).unwrap();
        let jinja = format!("t{i}.jinja");
        std::fs::write(d.join(&jinja), src).unwrap();
        let t0 = Instant::now();
        for (bin, args) in [
            ("mlb-inspect", vec![t.as_str(), "--chat", "conv.json"]),
            (
                "mlb-run",
                vec![
                    "m.mlb",
                    "--tokenizer",
                    &t,
                    "--chat",
                    "--prompt",
                    "hi",
                    "-n",
                    "1",
                ],
            ),
        ] {
            let err = run_with(d, bin, &args, Some(three_gib)).fails_with(1);
            let what = format!("{bin} on {src}");
            assert_eq!(err.lines().count(), 1, "{what}: {err}");
            assert!(
                err.contains("chat template 'default'")
                    && (err.contains("render budget") || err.contains("namespace")),
                "{what}: {err}"
            );
        }
        let json = json.to_str().unwrap();
        run_with(
            d,
            "mlt-convert",
            &[json, "-o", "out.mlt", "--chat-template", &jinja, "-q"],
            Some(three_gib),
        )
        .ok();
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{src}: {:?}",
            t0.elapsed()
        );
    }
}

/// Numeric flags out of their range are one line (issue 42), not clap's paragraph.
#[test]
fn numeric_flags_out_of_range_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_model(d);
    for (bin, args, want) in [
        (
            "mlb-run",
            vec!["m.mlb", "--tokens", "1", "--batch", "0"],
            "--batch",
        ),
        (
            "mlb-run",
            vec!["m.mlb", "--tokens", "1", "--top-k", "99999999999999999999"],
            "--top-k",
        ),
        (
            "mlb-run",
            vec!["m.mlb", "--tokens", "1", "-n", "-1"],
            "--n-predict",
        ),
        (
            "mlb-run",
            vec![
                "m.mlb",
                "--tokens",
                "1",
                "--logprobs",
                "18446744073709551615",
            ],
            "--logprobs",
        ),
        (
            "mlb-convert",
            vec!["ck", "--threads", "99999999999999999999"],
            "--threads",
        ),
    ] {
        let err = run(d, bin, &args).fails_with(2);
        assert_eq!(err.lines().count(), 1, "{bin} {args:?}: {err}");
        assert!(
            err.starts_with(&format!("{bin}: invalid value")) && err.contains(want),
            "{bin} {args:?}: {err}"
        );
    }
}
