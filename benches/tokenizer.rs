//! Encode throughput of the Krafla tokenizer next to the tokenizers crate, on the same
//! large mixed text in the same run, per family. `cargo bench --bench tokenizer`
//! (`-- SIZE_MB` to change the text size, default 4).

use flate2::read::GzDecoder;
use krafla::rng::Rng;
use krafla::tokenizer::{from_hf, Tokenizer};
use std::io::Read;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/tokenizers")
        .join(name)
}

fn gunzip(name: &str) -> String {
    let mut s = String::new();
    GzDecoder::new(std::fs::File::open(data(name)).unwrap())
        .read_to_string(&mut s)
        .unwrap();
    s
}

/// A mixed text of about `size` bytes: the corpus paragraphs in a shuffled order, with
/// words shuffled within each line so pieces are not all repeats.
fn mixed_text(size: usize) -> String {
    let corpus = std::fs::read_to_string(data("corpus.txt")).unwrap();
    let lines: Vec<&str> = corpus.lines().filter(|l| !l.starts_with("%%%%")).collect();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut out = String::with_capacity(size + 4096);
    while out.len() < size {
        let line = lines[(rng.next_u64() % lines.len() as u64) as usize];
        let mut words: Vec<&str> = line.split(' ').collect();
        for i in (1..words.len()).rev() {
            words.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        out.push_str(&words.join(" "));
        out.push('\n');
    }
    out
}

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let r = f();
        best = best.min(t.elapsed().as_secs_f64());
        last = Some(r);
    }
    (best, last.unwrap())
}

fn main() {
    let mb: f64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(4.0);
    let text = mixed_text((mb * 1e6) as usize);
    let size = text.len() as f64 / 1e6;
    let families: [(&str, &str, Option<&str>); 5] = [
        ("llama3", "llama3.tokenizer.json.gz", None),
        ("qwen3", "qwen3.tokenizer.json.gz", None),
        (
            "gemma3",
            "gemma3.tokenizer.json.gz",
            Some("gemma3.tokenizer_config.json"),
        ),
        (
            "smollm2",
            "smollm2.tokenizer.json.gz",
            Some("smollm2.tokenizer_config.json"),
        ),
        (
            "smollm2-digits",
            "smollm2.tokenizer.digits-split.json.gz",
            Some("smollm2.tokenizer_config.json"),
        ),
    ];
    println!("encode throughput on {size:.1} MB of mixed text (best of 3, one thread)");
    println!(
        "| family | tokens | krafla MB/s | tokenizers MB/s (encode_fast) | speed-up | same ids |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | --- |");
    // TOK_BENCH_ONLY=name picks one family; TOK_BENCH_NO_HF=1 skips the oracle (profiling).
    let only = std::env::var("TOK_BENCH_ONLY").ok();
    let no_hf = std::env::var_os("TOK_BENCH_NO_HF").is_some();
    for (name, file, cfg) in families {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let json = gunzip(file);
        let cfg = cfg.map(|c| std::fs::read_to_string(data(c)).unwrap());
        let m = from_hf::convert(&json, cfg.as_deref(), &Default::default()).unwrap();
        let ours = Tokenizer::from_mlt(&m).unwrap();
        let hf = tokenizers::Tokenizer::from_str(&json).unwrap();
        let (t_ours, ids) = best_of(3, || ours.encode(&text));
        if no_hf {
            println!(
                "| {name} | {} | {:.1} | - | - | - |",
                ids.len(),
                size / t_ours
            );
            continue;
        }
        let (t_hf, enc) = best_of(3, || hf.encode_fast(text.as_str(), true).unwrap());
        let same = ids == enc.get_ids();
        println!(
            "| {name} | {} | {:.1} | {:.1} | {:.2}x | {} |",
            ids.len(),
            size / t_ours,
            size / t_hf,
            t_hf / t_ours,
            if same { "yes" } else { "NO" }
        );
    }
}
