//! Shared pieces of the fuzz targets: what each target does with its input, so the
//! same code runs under libFuzzer and in the seed generator's self-check.

use std::io::Read;
use std::path::{Path, PathBuf};

use krafla::convert::{convert, ConvertError, ConvertOptions, WType};
use krafla::format::mlb::{Kind, Mlb};
use krafla::format::mlt::Mlt;
use krafla::model::{Model, StateOptions};
use krafla::tokenizer::{from_hf, Tokenizer};

/// The repository root (the fuzz crate lives in `fuzz/`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A scratch folder for this fuzz process, `krafla-fuzz-TAG-PID`: in /dev/shm (a RAM
/// disk) where there is one, else in the temp dir.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("krafla-fuzz-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Converts the checkpoint in `dir` (config.json, model.safetensors) to `dir/out.mlb`
/// and checks the converter's promises: no other file is left behind, a converted file
/// loads, and a failure leaves no output. Returns the converter's result.
pub fn convert_checked(dir: &Path, wtype: WType) -> Result<(), ConvertError> {
    let out = dir.join("out.mlb");
    let _ = std::fs::remove_file(&out);
    let mut opts = ConvertOptions::new(dir.to_path_buf(), wtype);
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
            Ok(())
        }
        Err(e) => {
            assert!(!out.exists(), "output written on failure");
            Err(e)
        }
    }
}

/// `testdata/tokenizers/NAME`, gunzipped.
pub fn gunzip(name: &str) -> String {
    let path = repo().join("testdata/tokenizers").join(name);
    let gz = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut s = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut s)
        .expect("gzip of UTF-8");
    s
}

/// Every `testdata/tokenizers/*.json.gz`, converted to `.mlt` (with its
/// tokenizer_config.json when there is one).
pub fn real_mlts() -> Vec<(String, Mlt)> {
    let dir = repo().join("testdata/tokenizers");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("testdata/tokenizers")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".json.gz"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let family = n.split('.').next().unwrap().to_string();
            let cfg = std::fs::read_to_string(dir.join(format!("{family}.tokenizer_config.json")));
            let m = from_hf::convert(
                &gunzip(&n),
                cfg.ok().as_deref(),
                &from_hf::HfTokenizerOptions::default(),
            )
            .unwrap_or_else(|e| panic!("{n}: {e}"));
            (n, m)
        })
        .collect()
}

/// The real tokenizers, loaded.
pub fn real_tokenizers() -> Vec<Tokenizer> {
    real_mlts()
        .iter()
        .map(|(n, m)| Tokenizer::from_mlt(m).unwrap_or_else(|e| panic!("{n}: {e}")))
        .collect()
}

/// Loads `data` as an `.mlb`; if it loads, touches every array (floats, quants,
/// scales, the first and last row dequantized) and runs one token through the model.
pub fn exercise_mlb(data: &[u8]) {
    let parsed = krafla::format::mlb::parse(data);
    let Ok(m) = Mlb::from_bytes(data) else {
        assert!(parsed.is_err(), "parse accepts what from_bytes refuses");
        return;
    };
    let mut sum = 0f32;
    for (i, t) in m.layout().tensors.iter().enumerate() {
        match t.kind {
            Kind::F32 { .. } => sum += m.f32s(i).iter().sum::<f32>(),
            Kind::Mat { rows, cols, .. } => {
                let mat = m.mat(i);
                let mut row = vec![0f32; cols];
                krafla::quant::dequant_mat_row(&mat, 0, &mut row);
                krafla::quant::dequant_mat_row(&mat, rows - 1, &mut row);
                sum += row[0];
            }
            Kind::U8 { .. } => {}
        }
    }
    std::hint::black_box(sum);
    // Files that validate may still be refused by the runtime, with an error.
    let Ok(model) = Model::new(&m) else { return };
    let opts = StateOptions {
        ctx: Some(2),
        ..StateOptions::default()
    };
    let Ok(mut st) = model.state(&opts) else {
        return;
    };
    let _ = std::hint::black_box(model.prefill(&mut st, &[0], None).map(|l| l[0]));
}

/// Parses `data` as an `.mlt`; if it parses, builds the tokenizer and, if that
/// works, round-trips a short text and the whole vocabulary's decode.
pub fn exercise_mlt(data: &[u8]) {
    let Ok(m) = Mlt::parse(data) else { return };
    if let Ok(bytes) = m.to_bytes() {
        assert_eq!(bytes, data, "a parsed file re-encodes to its bytes");
    }
    let Ok(t) = Tokenizer::from_mlt(&m) else {
        return;
    };
    let ids = t.encode("Hello, world! 123 ünïcödé\n\t  x");
    std::hint::black_box(t.decode(&ids));
    let all: Vec<u32> = (0..t.n_vocab() as u32).take(4096).collect();
    std::hint::black_box(t.decode(&all));
    // A chat section's templates compile and render, or fail with an error.
    if let Ok(Some(chat)) = krafla::chat::Chat::from_mlt(&m) {
        let msgs = [
            krafla::chat::Message::new("system", "Be brief."),
            krafla::chat::Message::new("user", "Hello <|im_end|> {{ x }}"),
        ];
        let opts = krafla::chat::RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        let _ = std::hint::black_box(chat.encode(&t, &msgs, &opts));
    }
}

/// A chat template and a conversation JSON, separated by the first NUL byte: compiled,
/// parsed and rendered (errors are fine; panics and hangs are not).
pub fn exercise_chat(data: &[u8]) {
    let Some(split) = data.iter().position(|&b| b == 0) else {
        return;
    };
    let (Ok(source), Ok(conv)) = (
        std::str::from_utf8(&data[..split]),
        std::str::from_utf8(&data[split + 1..]),
    ) else {
        return;
    };
    let Ok(mut t) =
        krafla::chat::ChatTemplate::from_source(source, &[("bos_token".into(), "<s>".into())])
    else {
        return;
    };
    // The render budget (issue 42), smaller than the default so that a run stays fast:
    // 12.8 MB of data, 1 MiB of text. Under -malloc_limit_mb and -rss_limit_mb, an
    // allocation the budget did not pay for is a finding.
    let budget = krafla::chat::RenderBudget {
        fuel: 200_000,
        max_output: 1 << 20,
    };
    t.set_budget(budget);
    let Ok(c) = krafla::chat::Conversation::from_json(conv) else {
        return;
    };
    if let Ok(text) = std::hint::black_box(t.render(&c.messages, &c.options)) {
        assert!(text.len() <= budget.max_output, "{} bytes", text.len());
    }
}

/// Parses `data` as GGUF; if it parses, reads every metadata array and every tensor
/// (dequantizing a first row of a readable type), builds the tokenizer from the
/// metadata, and writes the file again: the same metadata must read back.
pub fn exercise_gguf(data: &[u8]) {
    use krafla::format::gguf::{self, dequant, MetaValue, TensorSpec};
    let Ok(v) = gguf::parse(data) else { return };
    let mut n = 0usize;
    for kv in &v.kvs {
        if let Some(a) = kv.value.as_array() {
            n += a.iter().count();
        }
    }
    for t in &v.tensors {
        let d = v.data(t);
        n += d.len();
        let cols = t.cols() as usize;
        if dequant::supported(t.ty) && cols <= 1 << 16 {
            let mut row = vec![0f32; cols];
            assert!(dequant::dequantize_row(
                t.ty,
                &d[..t.row_bytes() as usize],
                &mut row
            ));
            std::hint::black_box(&row);
        }
    }
    std::hint::black_box(n);
    if let Ok(m) = krafla::convert::gguf::tokenizer::mlt_from_gguf(&v) {
        // The chat section: templates compiled, the probe rendered, the stop set.
        let _ = krafla::convert::gguf::tokenizer::chat_from_gguf(&v, &m, &Default::default());
    }
    // Strings that are not UTF-8 are written lossily; the rest reads back as it was.
    let lossless = v.kvs.iter().all(|k| match k.value {
        gguf::Value::Str(s) => std::str::from_utf8(s).is_ok(),
        gguf::Value::Array(a) => a
            .iter()
            .all(|x| !matches!(x, gguf::Value::Str(s) if std::str::from_utf8(s).is_err())),
        _ => true,
    });
    // Writes `v`'s metadata and tensors again; None if the writer refuses them.
    let write_back = |v: &gguf::GgufView| -> Option<Vec<u8>> {
        let kvs: Vec<(String, MetaValue)> = v
            .kvs
            .iter()
            .map(|k| (k.key.to_string(), MetaValue::from_value(&k.value)))
            .collect();
        let specs: Vec<TensorSpec> = v.tensors.iter().map(TensorSpec::of).collect();
        let mut w = gguf::GgufWriter::new(Vec::new(), &kvs, specs).ok()?;
        for t in &v.tensors {
            w.write_data(v.data(t)).expect("sizes as parsed");
        }
        Some(w.finish().expect("every tensor written"))
    };
    let Some(bytes) = write_back(&v) else { return };
    let back = gguf::parse(&bytes).expect("the writer's output parses");
    let keys = |v: &gguf::GgufView| -> Vec<(String, gguf::ValueType)> {
        v.kvs
            .iter()
            .map(|k| (k.key.to_string(), k.value.value_type()))
            .collect()
    };
    assert_eq!(keys(&back), keys(&v), "metadata keys and types round-trip");
    for (a, b) in v.tensors.iter().zip(&back.tensors) {
        assert_eq!(v.data(a), back.data(b), "tensor data round-trips");
    }
    // Values compared as written bytes (NaN-safe): writing what was read back gives
    // the same file.
    if lossless {
        let again = write_back(&back).expect("valid again");
        assert_eq!(again, bytes, "metadata values round-trip");
    }
}
