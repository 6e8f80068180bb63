//! mlb-run: run a `.mlb` model on a prompt; stream the generated text to stdout and a
//! speed and memory summary to stderr, or write the prompt's logits with `--logits`,
//! or measure (`--imatrix`, `--perplexity`, `--kl-divergence`).
//!
//! Thin: flags → `krafla::session::RunOptions` → `krafla::session::run` → exit code
//! (0, or 1 with one line on stderr; 2 for bad usage). The library does the work and
//! the checks; this shows text, progress bars and the summary.

use std::io::{IsTerminal, StdoutLock, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use krafla::model::forward::DEFAULT_BATCH;
use krafla::model::KvType;
use krafla::session::measure::{Measure, Mode};
use krafla::session::run::{Outcome, Prompt, DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P};
use krafla::session::{Frontend, RunOptions};

#[derive(Parser)]
#[command(
    version,
    about = "Run a .mlb model on a prompt",
    after_help = "Generation stops at the tokenizer's EOS (unless --ignore-eos), after -n tokens, or when the context is full. With no EOS known (no tokenizer, or one that names none) it stops only at -n or a full context: no id is taken for EOS."
)]
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
    #[arg(long, default_value_t = DEFAULT_TEMP, allow_negative_numbers = true)]
    temp: f32,
    /// Sample from the k most likely tokens (0: all).
    #[arg(long, default_value_t = DEFAULT_TOP_K, allow_negative_numbers = true)]
    top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches p.
    #[arg(long, default_value_t = DEFAULT_TOP_P, allow_negative_numbers = true)]
    top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// KV cache positions (default: max_seq, capped at 4096).
    #[arg(long, allow_negative_numbers = true)]
    ctx: Option<usize>,
    /// Most prompt tokens per prefill batch.
    #[arg(long, default_value_t = DEFAULT_BATCH, allow_negative_numbers = true)]
    batch: usize,
    /// How the KV cache stores keys and values: f32, f16 (half the memory) or q8_0
    /// (about 0.28 of it).
    #[arg(long, default_value_t = KvType::F32, value_name = "f32|f16|q8_0")]
    kv_type: KvType,
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

impl Args {
    fn into_options(self) -> RunOptions {
        let mode = match (self.imatrix, self.perplexity, self.kl_divergence) {
            (Some(output), _, _) => Some(Mode::Imatrix {
                output,
                save_every: self.save_every,
            }),
            (None, true, _) => Some(Mode::Perplexity),
            (None, false, Some(reference)) => Some(Mode::KlDivergence { reference }),
            _ => None,
        };
        let mut o = RunOptions::new(self.model);
        o.tokenizer = self.tokenizer;
        o.prompt = match (self.tokens, self.prompt, self.file) {
            (Some(ids), _, _) => Prompt::Ids(ids),
            (None, Some(text), _) => Prompt::Text(text),
            (None, None, Some(f)) => Prompt::File(f),
            (None, None, None) => Prompt::Stdin,
        };
        o.n_predict = self.n;
        o.sampling.temp = self.temp;
        o.sampling.top_k = self.top_k;
        o.sampling.top_p = self.top_p;
        o.sampling.seed = self.seed;
        o.ctx = self.ctx;
        o.batch = self.batch;
        o.kv_type = self.kv_type;
        o.logits = self.logits;
        o.threads = self.threads;
        o.verbose = self.verbose;
        o.measure = mode.map(|mode| Measure {
            mode,
            chunks: self.chunks,
            json: self.json,
        });
        o.ignore_eos = self.ignore_eos;
        o.pack = !self.no_pack;
        o
    }
}

/// Text to stdout as it is made; `--verbose` lines and a progress bar (on a terminal)
/// to stderr.
struct Terminal {
    out: StdoutLock<'static>,
    bar: Option<ProgressBar>,
}

impl Frontend for Terminal {
    fn text(&mut self, s: &str) -> std::io::Result<()> {
        self.out.write_all(s.as_bytes())?;
        self.out.flush()
    }

    fn info(&mut self, line: &str) {
        eprintln!("{line}");
    }

    fn chunks_start(&mut self, total: usize) {
        if !std::io::stderr().is_terminal() {
            return;
        }
        let pb = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} chunks  {msg}  [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        self.bar = Some(pb);
    }

    fn chunks_done(&mut self, done: usize, figure: Option<&str>) {
        if let Some(pb) = &self.bar {
            pb.set_position(done as u64);
            if let Some(f) = figure {
                pb.set_message(f.to_string());
            }
        }
    }

    fn chunks_end(&mut self) {
        if let Some(pb) = self.bar.take() {
            pb.finish_and_clear();
        }
    }
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let opts = Args::parse().into_options();
    // A model file truncated while mapped faults (SIGBUS) inside a forward pass: one
    // line and exit 1 (docs/reliability.md).
    krafla::signals::report_sigbus("mlb-run", &opts.model);
    let mut term = Terminal {
        out: std::io::stdout().lock(),
        bar: None,
    };
    match krafla::session::run(&opts, &mut term) {
        Ok(Outcome::Generated(summary)) => {
            eprintln!("{summary}");
            ExitCode::SUCCESS
        }
        Ok(Outcome::Measured(report)) => {
            drop(term);
            krafla::out!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlb-run: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
