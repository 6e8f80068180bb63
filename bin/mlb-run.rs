//! mlb-run: run a `.mlb` model on a prompt; stream the generated text to stdout and a
//! speed and memory summary to stderr, or write the prompt's logits with `--logits`.

use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use krafla::atomic::AtomicFile;
use krafla::format::mlb::Mlb;
use krafla::kernels;
use krafla::model::forward::LogitsSink;
use krafla::model::{Model, Options, Packs, Sampler, SamplerOpts};
use krafla::tokenizer::Tokenizer;

#[path = "run_eval.rs"]
mod run_eval;

#[derive(Parser)]
#[command(version, about = "Run a .mlb model on a prompt")]
struct Args {
    /// The model file.
    model: PathBuf,
    /// The tokenizer (default: the .mlt of the same name beside the model).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The prompt text.
    #[arg(short, long, conflicts_with_all = ["file", "tokens"])]
    prompt: Option<String>,
    /// Read the prompt text from this file.
    #[arg(short, long, conflicts_with = "tokens")]
    file: Option<PathBuf>,
    /// Token ids instead of text, e.g. "1 2 3".
    #[arg(long)]
    tokens: Option<String>,
    /// Tokens to generate (default 128; 0 with --logits).
    #[arg(short = 'n', long = "n-predict", allow_negative_numbers = true)]
    n: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temp: f32,
    /// Sample from the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40, allow_negative_numbers = true)]
    top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches p.
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// KV cache positions (default: max_seq, capped at 4096).
    #[arg(long, allow_negative_numbers = true)]
    ctx: Option<usize>,
    /// Most prompt tokens per prefill batch.
    #[arg(long, default_value_t = krafla::model::forward::DEFAULT_BATCH, allow_negative_numbers = true)]
    batch: usize,
    /// Write every prompt position's logits (little-endian f32, positions × vocab).
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(long, allow_negative_numbers = true)]
    threads: Option<usize>,
    /// Print the kernel tier and the model's shape.
    #[arg(short, long)]
    verbose: bool,
    /// Sum the squared inputs of every matrix over the text, in chunks of --ctx tokens
    /// (default 512; a text shorter than one chunk runs as one), and write them as an
    /// MLI1 importance matrix (for `mlb-convert --imatrix`).
    #[arg(long, value_name = "FILE.mli", conflicts_with_all = ["perplexity", "kl_divergence", "logits"])]
    imatrix: Option<PathBuf>,
    /// Print the perplexity of the text (the second half of each --ctx chunk).
    #[arg(long, conflicts_with_all = ["kl_divergence", "logits"])]
    perplexity: bool,
    /// Print the KL divergence of the model's distributions from this reference model's
    /// (and both perplexities) on the text.
    #[arg(long, value_name = "REF.mlb", conflicts_with = "logits")]
    kl_divergence: Option<PathBuf>,
    /// --imatrix, --perplexity, --kl-divergence: stop after N chunks.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    chunks: Option<usize>,
    /// --imatrix: also write the file every K chunks.
    #[arg(
        long,
        value_name = "K",
        requires = "imatrix",
        allow_negative_numbers = true
    )]
    save_every: Option<usize>,
    /// --imatrix, --perplexity, --kl-divergence: print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Keep generating past EOS (benchmarks: always -n tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Read the weights from the mapped file as they are: no packed copy at load
    /// (same results; slower where the kernel tier has packed kernels).
    #[arg(long)]
    no_pack: bool,
}

/// The packed copies of `m`'s matrices for the active kernel tier, unless `--no-pack`.
fn load_packs(a: &Args, m: &Mlb) -> Result<Packs, krafla::format::FormatError> {
    if a.no_pack {
        return Ok(Packs::none());
    }
    Packs::new(m, &kernels::kernels())
}

/// Peak resident memory from /proc/self/status (VmHWM), in KiB.
fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

fn rate(n: usize, secs: f64) -> String {
    if secs > 0.0 {
        format!("{:.1} tok/s", n as f64 / secs)
    } else {
        "- tok/s".into()
    }
}

/// The tokenizer to use: the one asked for (must load), or the `.mlt` beside the model
/// if there is one.
fn load_tokenizer(a: &Args, vocab: usize) -> Result<Option<Tokenizer>, String> {
    let (path, explicit) = match &a.tokenizer {
        Some(p) => (p.clone(), true),
        None => (a.model.with_extension("mlt"), false),
    };
    if !explicit && !path.exists() {
        return Ok(None);
    }
    let tok = Tokenizer::from_path(&path).map_err(|e| e.to_string())?;
    if tok.n_vocab() > vocab {
        return Err(format!(
            "{}: n_vocab = {}: the tokenizer's vocabulary exceeds the model's vocab ({vocab})",
            path.display(),
            tok.n_vocab()
        ));
    }
    Ok(Some(tok))
}

/// Refuses an output (--logits, --imatrix) that is one of the inputs.
fn check_outputs(a: &Args) -> Result<(), String> {
    let default_tok = a.model.with_extension("mlt");
    let inputs = [
        Some(a.model.as_path()),
        Some(a.tokenizer.as_deref().unwrap_or(&default_tok)),
        a.kl_divergence.as_deref(),
        a.file.as_deref(),
    ];
    let inputs: Vec<&Path> = inputs.into_iter().flatten().collect();
    for (opt, out) in [("--logits", &a.logits), ("--imatrix", &a.imatrix)] {
        if let Some(out) = out {
            krafla::atomic::check_not_input(out, &inputs)
                .map_err(|e| format!("{opt} {}: {e}", out.display()))?;
        }
    }
    Ok(())
}

/// Writes the logits of every prompt position; the file appears only when all are written
/// (dropped unfinished, on any error, it leaves nothing).
struct LogitsFile {
    out: BufWriter<AtomicFile>,
    err: Option<std::io::Error>,
}

impl LogitsFile {
    fn create(path: &Path) -> Result<LogitsFile, String> {
        let f =
            AtomicFile::create(path).map_err(|e| format!("--logits {}: {e}", path.display()))?;
        Ok(LogitsFile {
            out: BufWriter::new(f),
            err: None,
        })
    }

    fn row(&mut self, row: &[f32]) {
        if self.err.is_some() {
            return;
        }
        let mut buf = Vec::with_capacity(row.len() * 4);
        for v in row {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        if let Err(e) = self.out.write_all(&buf) {
            self.err = Some(e);
        }
    }

    fn finish(self, path: &Path) -> Result<(), String> {
        let fail = |e: std::io::Error| format!("--logits {}: {e}", path.display());
        if let Some(e) = self.err {
            return Err(fail(e));
        }
        let f = self.out.into_inner().map_err(|e| fail(e.into_error()))?;
        f.commit().map_err(fail)
    }
}

fn run(a: Args) -> Result<(), String> {
    if let Some(t) = a.threads {
        if t == 0 {
            return Err("--threads = 0: at least one thread is needed".into());
        }
        if t > kernels::pool::MAX_THREADS {
            let max = kernels::pool::MAX_THREADS;
            return Err(format!("--threads = {t}: at most {max}"));
        }
        kernels::pool::set_threads(t);
    }
    if let Some(note) = kernels::pool::global().shortfall() {
        eprintln!("mlb-run: note: {note}");
    }
    check_outputs(&a)?;
    if !(a.temp >= 0.0 && a.temp.is_finite()) {
        return Err(format!(
            "--temp = {}: must be a finite number ≥ 0 (0 is greedy)",
            a.temp
        ));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(format!("--top-p = {}: must be in (0, 1]", a.top_p));
    }
    let t_load = Instant::now();
    sigbus::report_as(&a.model);
    let mlb = Mlb::open(&a.model).map_err(|e| e.to_string())?;
    let packs = load_packs(&a, &mlb).map_err(|e| e.to_string())?;
    let model = Model::with_packs(&mlb, &packs).map_err(|e| e.to_string())?;
    let cfg = &model.cfg;
    let tok = load_tokenizer(&a, cfg.vocab)?;

    let prompt: Vec<u32> = if let Some(ids) = &a.tokens {
        krafla::tokenizer::parse_ids(ids, cfg.vocab).map_err(|e| format!("--tokens: {e}"))?
    } else {
        let text = match (&a.prompt, &a.file) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => {
                std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?
            }
            (None, None) => {
                let mut s = String::new();
                std::io::stdin()
                    .read_to_string(&mut s)
                    .map_err(|e| format!("stdin: {e}"))?;
                s
            }
        };
        let tok = tok.as_ref().ok_or_else(|| {
            format!(
                "no tokenizer: {} does not exist; a text prompt needs --tokenizer FILE.mlt (or use --tokens)",
                a.model.with_extension("mlt").display()
            )
        })?;
        tok.encode(&text)
    };
    if run_eval::wanted(&a) {
        // Each chunk starts with BOS when the tokenizer adds one to a text.
        let bos = match (&tok, &a.tokens) {
            (Some(t), None) => t.bos().filter(|b| t.encode("").first() == Some(b)),
            _ => None,
        };
        return run_eval::run(&a, &model, bos, &prompt);
    }
    let opts = Options {
        ctx: a.ctx,
        batch: a.batch.max(1),
        ..Options::default()
    };
    let mut st = model.state(&opts).map_err(|e| e.to_string())?;
    let load_secs = t_load.elapsed().as_secs_f64();
    if a.verbose {
        eprintln!(
            "kernel tier: {} (supported: {}); packed weights: {}",
            kernels::tier(),
            kernels::supported_tiers()
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(", "),
            match packs.bytes() {
                0 => "none".to_string(),
                b => mib(b as f64),
            }
        );
        eprintln!(
            "threads: {}; model: dim {} layers {} heads {}/{} head_dim {} hidden {} vocab {}; ctx {} batch {}; loaded in {load_secs:.2} s",
            kernels::pool::threads(),
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.hidden_dim,
            cfg.vocab,
            st.ctx(),
            opts.batch
        );
    }

    // Prompt.
    let t0 = Instant::now();
    let mut logits_file = a.logits.as_deref().map(LogitsFile::create).transpose()?;
    let last: Vec<f32> = {
        let mut sink = |_: usize, row: &[f32]| {
            if let Some(f) = logits_file.as_mut() {
                f.row(row)
            }
        };
        let each: Option<LogitsSink> = if a.logits.is_some() {
            Some(&mut sink)
        } else {
            None
        };
        mlb.check_unchanged().map_err(|e| e.to_string())?;
        model
            .prefill(&mut st, &prompt, each)
            .map_err(|e| e.to_string())?
            .to_vec()
    };
    let prompt_secs = t0.elapsed().as_secs_f64();
    if let (Some(f), Some(p)) = (logits_file.take(), &a.logits) {
        f.finish(p)?;
    }

    // Generation.
    let n_gen = a.n.unwrap_or(if a.logits.is_some() { 0 } else { 128 });
    let mut sampler = Sampler::new(SamplerOpts {
        temp: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    });
    let eos = tok.as_ref().and_then(|t| t.eos()).unwrap_or(2);
    let mut dec = tok.as_ref().map(|t| t.stream_decoder());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let t1 = Instant::now();
    let mut generated = 0;
    let mut logits = last;
    let mut stop = "";
    for i in 0..n_gen {
        let next = sampler.sample(&logits);
        generated += 1;
        if next == eos && !a.ignore_eos {
            stop = " (EOS)";
            break;
        }
        let text = match dec.as_mut() {
            Some(d) => d.push(next),
            None => format!("{}{next}", if i > 0 { " " } else { "" }),
        };
        out.write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .map_err(|e| format!("stdout: {e}"))?;
        if i + 1 == n_gen {
            break;
        }
        if st.pos() >= st.ctx() {
            stop = " (context full)";
            break;
        }
        mlb.check_unchanged().map_err(|e| e.to_string())?;
        logits = model
            .decode(&mut st, next)
            .map_err(|e| e.to_string())?
            .to_vec();
    }
    let tail = match dec.as_mut() {
        Some(d) => d.finish(),
        None => String::new(),
    };
    let nl = if n_gen > 0 { "\n" } else { "" };
    write!(out, "{tail}{nl}")
        .and_then(|_| out.flush())
        .map_err(|e| format!("stdout: {e}"))?;
    let gen_secs = t1.elapsed().as_secs_f64();

    let rss = peak_rss_kib()
        .map(|k| mib(k as f64 * 1024.0))
        .unwrap_or_else(|| "?".into());
    eprintln!(
        "prompt: {} tokens in {prompt_secs:.3} s ({}); generated: {generated} tokens in {gen_secs:.3} s ({}){stop}",
        prompt.len(),
        rate(prompt.len(), prompt_secs),
        rate(generated, gen_secs)
    );
    eprintln!(
        "memory: peak RSS {rss}; KV cache {} ({} positions){}",
        mib(st.kv_bytes() as f64),
        st.ctx(),
        if st.delta_bytes() > 0 {
            format!("; linear-attention state {}", mib(st.delta_bytes() as f64))
        } else {
            String::new()
        }
    );
    Ok(())
}

/// A mapped model file that another process truncates while it is in use raises
/// SIGBUS on the next read of a page past its new end. The size is re-checked before
/// each forward pass; a fault inside one is reported as one line and exit 1 instead of
/// a bare "Bus error" (see docs/reliability.md).
#[cfg(unix)]
mod sigbus {
    use std::sync::OnceLock;

    static MSG: OnceLock<Vec<u8>> = OnceLock::new();

    extern "C" fn on_sigbus(_: libc::c_int) {
        // Only async-signal-safe calls: write(2) of a prepared message, then _exit.
        if let Some(m) = MSG.get() {
            // SAFETY: m is a live, initialized buffer.
            unsafe { libc::write(2, m.as_ptr().cast(), m.len()) };
        }
        // SAFETY: _exit ends the process without running any user code.
        unsafe { libc::_exit(1) }
    }

    pub fn report_as(path: &std::path::Path) {
        let msg = format!(
            "mlb-run: ML_E_IO: {}: the file was truncated or changed while in use (SIGBUS)\n",
            path.display()
        );
        if MSG.set(msg.into_bytes()).is_ok() {
            // SAFETY: the handler only calls async-signal-safe functions.
            unsafe {
                libc::signal(
                    libc::SIGBUS,
                    on_sigbus as extern "C" fn(libc::c_int) as libc::sighandler_t,
                )
            };
        }
    }
}

#[cfg(not(unix))]
mod sigbus {
    pub fn report_as(_: &std::path::Path) {}
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let a = Args::parse();
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlb-run: {e}");
            ExitCode::FAILURE
        }
    }
}
