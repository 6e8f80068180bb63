//! mlb-run: run a `.mlb` model on a prompt; stream the generated text to stdout and a
//! speed and memory summary to stderr, or write the prompt's logits with `--logits`,
//! or measure (`--imatrix`, `--perplexity`, `--kl-divergence`), or chat (`--chat`).
//!
//! Thin: flags → `krafla::tools::run::options::RunOptions` → `krafla::tools::run::run` →
//! exit code
//! (0, or 1 with one line on stderr; 2 for bad usage). The library does the work and
//! the checks; this shows text, progress bars and the summary, and reads the
//! interactive chat's lines (rustyline on a terminal, with its history file).

use std::io::{BufRead, IsTerminal, StdoutLock, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use krafla::cli::{count, HalfActsArgs, SpecArgs};
use krafla::model::forward::DEFAULT_BATCH;
use krafla::model::KvType;
use krafla::tools::run::chat::default_history_file;
use krafla::tools::run::frontend::RunFrontend;
use krafla::tools::run::options::{
    parse_logit_bias, ChatRunOptions, MeasureMode, MeasureOptions, PromptSource, RunOptions,
    DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P,
};
use krafla::tools::run::report::Outcome;
use rustyline::error::ReadlineError;
use rustyline::history::DefaultHistory;

#[derive(Parser)]
#[command(
    version,
    about = "Run a .mlb model on a prompt",
    after_help = "Generation stops at an id of the tokenizer's stop set (its EOS, generation_config.json's eos_token_id and the chat template's end-of-turn token, as mlt-convert captured them; unless --ignore-eos), at a --stop string, after -n tokens, or when the context is full. With no stop set (no tokenizer, or one that names no EOS) it stops only at -n or a full context: no id is taken for EOS.

--chat: on a terminal (or with --interactive) type a message per line (end a line with \\ to go on on the next); /help lists the commands (/reset, /undo, /system, /exit); Ctrl-C stops a reply, Ctrl-D ends. The history is kept in $XDG_STATE_HOME/krafla/chat_history (default ~/.local/state/krafla/chat_history; --history, --no-history). From a pipe or --file: a JSON conversation {\"messages\": [...]} in, the reply out; --prompt: one user message."
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
    #[arg(short = 'n', long = "n-predict", allow_negative_numbers = true, value_parser = count(0..=1 << 31))]
    n: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = DEFAULT_TEMP, allow_negative_numbers = true)]
    temp: f32,
    /// Sample from the k most likely tokens (0: all).
    #[arg(long, default_value_t = DEFAULT_TOP_K, allow_negative_numbers = true, value_parser = count(0..=1 << 31))]
    top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches p.
    #[arg(long, default_value_t = DEFAULT_TOP_P, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only tokens whose probability is at least p times the most likely one's.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Divide positive logits (multiply negative ones) of the recent tokens by this
    /// (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// Subtract this from the logit of each token seen in the recent tokens (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtract this times its count from the logit of each recent token (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// How many of the last tokens the penalties look at (0: all).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = count(0..=1 << 31))]
    repeat_last_n: usize,
    /// Add BIAS to the logit of token ID (-inf: never); repeatable.
    #[arg(long, value_name = "ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    logit_bias: Vec<(u32, f32)>,
    /// Stop when the text contains STRING (not printed); repeatable.
    #[arg(long, value_name = "STRING", allow_hyphen_values = true)]
    stop: Vec<String>,
    /// Print each generated token's log-probability and its N most likely alternatives,
    /// one JSON line per token on stderr.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = count(0..=1 << 20))]
    logprobs: Option<usize>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// KV cache positions (default: max_seq, capped at 4096).
    #[arg(long, allow_negative_numbers = true)]
    ctx: Option<usize>,
    /// Most prompt tokens per prefill batch.
    #[arg(long, default_value_t = DEFAULT_BATCH, allow_negative_numbers = true, value_parser = count(1..=1 << 24))]
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
    /// --imatrix: also the full covariance of every matrix input (n × n per input:
    /// 4·n² bytes of memory, 2·n² in the file), for error feedback in mlb-convert.
    #[arg(long, requires = "imatrix")]
    covariance: bool,
    /// --imatrix, --perplexity, --kl-divergence: print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Keep generating past the stop set's ids (benchmarks: always -n tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Chat with the model through its chat template: interactive on a terminal, a JSON
    /// conversation from a pipe or --file, one message with --prompt (-n: most tokens
    /// per reply, default 1024).
    #[arg(long, conflicts_with_all = ["tokens", "logits", "imatrix", "perplexity", "kl_divergence"])]
    chat: bool,
    /// --chat: the system prompt.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    system: Option<String>,
    /// --chat: when the context is full, drop the oldest turns after the system prompt
    /// and prefill the rest again (instead of stopping).
    #[arg(long, requires = "chat")]
    context_shift: bool,
    /// --chat: read messages line by line even when stdin is not a terminal.
    #[arg(short, long, requires = "chat", conflicts_with_all = ["prompt", "file"])]
    interactive: bool,
    /// --chat: the history file of the interactive chat.
    #[arg(long, value_name = "FILE", requires = "chat")]
    history: Option<PathBuf>,
    /// --chat: keep no history.
    #[arg(long, requires = "chat", conflicts_with = "history")]
    no_history: bool,
    /// Read the weights from the mapped file as they are: no packed or huge-page copy
    /// at load (same results; starts sooner, runs slower).
    #[arg(long)]
    no_pack: bool,
    #[command(flatten)]
    acts: HalfActsArgs,
    #[command(flatten)]
    spec: SpecArgs,
}

impl Args {
    fn into_options(self) -> RunOptions {
        let mode = match (self.imatrix, self.perplexity, self.kl_divergence) {
            (Some(output), _, _) => Some(MeasureMode::Imatrix {
                output,
                save_every: self.save_every,
                covariance: self.covariance,
            }),
            (None, true, _) => Some(MeasureMode::Perplexity),
            (None, false, Some(reference)) => Some(MeasureMode::KlDivergence { reference }),
            _ => None,
        };
        let interactive = self.chat
            && (self.interactive
                || (self.prompt.is_none()
                    && self.file.is_none()
                    && std::io::stdin().is_terminal()));
        let mut o = RunOptions::new(self.model);
        o.model.tokenizer = self.tokenizer;
        o.prompt = match (self.tokens, self.prompt, self.file) {
            (Some(ids), _, _) => PromptSource::Ids(ids),
            (None, Some(text), _) => PromptSource::Text(text),
            (None, None, Some(f)) => PromptSource::File(f),
            (None, None, None) => PromptSource::Stdin,
        };
        o.n_predict = self.n;
        o.sampling.temp = self.temp;
        o.sampling.top_k = self.top_k;
        o.sampling.top_p = self.top_p;
        o.sampling.seed = self.seed;
        o.sampling.min_p = self.min_p;
        o.sampling.repeat_penalty = self.repeat_penalty;
        o.sampling.presence_penalty = self.presence_penalty;
        o.sampling.frequency_penalty = self.frequency_penalty;
        o.sampling.penalty_window = self.repeat_last_n;
        o.sampling.logit_bias = self.logit_bias;
        o.stop_strings = self.stop;
        o.logprobs = self.logprobs;
        o.chat = self.chat.then_some(ChatRunOptions {
            system: self.system,
            context_shift: self.context_shift,
            interactive,
        });
        o.model.ctx = self.ctx;
        o.batch = self.batch;
        o.model.kv_type = self.kv_type;
        o.logits = self.logits;
        o.model.threads = self.threads;
        o.verbose = self.verbose;
        o.measure = mode.map(|mode| MeasureOptions {
            mode,
            chunks: self.chunks,
            json: self.json,
        });
        o.ignore_eos = self.ignore_eos;
        o.model.pack = !self.no_pack;
        o.spec = self.spec.options();
        self.acts.apply(&mut o.model);
        o
    }
}

/// Ctrl-C during a reply of the interactive chat.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Where the interactive chat's lines come from.
enum Lines {
    /// A terminal: rustyline, with its history file.
    Editor(Box<rustyline::Editor<(), DefaultHistory>>, Option<PathBuf>),
    /// A pipe (`--interactive`): plain lines.
    Plain(std::io::StdinLock<'static>),
}

impl Lines {
    fn open(history: Option<PathBuf>) -> Lines {
        if !std::io::stdin().is_terminal() {
            return Lines::Plain(std::io::stdin().lock());
        }
        let config = rustyline::Config::builder()
            .max_history_size(1000)
            .map(|b| b.build())
            .unwrap_or_default();
        match rustyline::Editor::with_config(config) {
            Ok(mut ed) => {
                if let Some(h) = &history {
                    if let Some(dir) = h.parent() {
                        let _ = std::fs::create_dir_all(dir);
                    }
                    // A missing history file is a first run.
                    let _ = ed.load_history(h);
                }
                Lines::Editor(Box::new(ed), history)
            }
            Err(_) => Lines::Plain(std::io::stdin().lock()),
        }
    }

    fn read(&mut self, prompt: &str) -> std::io::Result<Option<String>> {
        match self {
            Lines::Plain(r) => {
                let mut s = String::new();
                if r.read_line(&mut s)? == 0 {
                    return Ok(None);
                }
                let n = s.trim_end_matches(['\n', '\r']).len();
                s.truncate(n);
                Ok(Some(s))
            }
            Lines::Editor(ed, history) => match ed.readline(prompt) {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        let _ = ed.add_history_entry(line.as_str());
                        if let Some(h) = history {
                            if let Err(e) = ed.append_history(h) {
                                eprintln!("mlb-run: note: history {}: {e}", h.display());
                                *history = None;
                            }
                        }
                    }
                    Ok(Some(line))
                }
                // Ctrl-C at the prompt drops the line.
                Err(ReadlineError::Interrupted) => Ok(Some(String::new())),
                Err(ReadlineError::Eof) => Ok(None),
                Err(ReadlineError::Io(e)) => Err(e),
                Err(e) => Err(std::io::Error::other(e.to_string())),
            },
        }
    }
}

/// Text to stdout as it is made; `--verbose` lines and a progress bar (on a terminal)
/// to stderr; the interactive chat's lines from stdin.
struct Terminal {
    out: StdoutLock<'static>,
    bar: Option<ProgressBar>,
    lines: Option<Lines>,
}

impl RunFrontend for Terminal {
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

    fn read_line(&mut self, prompt: &str) -> std::io::Result<Option<String>> {
        match &mut self.lines {
            Some(l) => l.read(prompt),
            None => Ok(None),
        }
    }

    fn interrupted(&mut self) -> bool {
        INTERRUPTED.swap(false, Ordering::Relaxed)
    }
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let args = krafla::cli::parse_args::<Args>();
    let history = match (&args.history, args.no_history) {
        (_, true) => None,
        (Some(h), false) => Some(h.clone()),
        (None, false) => default_history_file(),
    };
    let opts = args.into_options();
    // A model file truncated while mapped faults (SIGBUS) inside a forward pass: one
    // line and exit 1 (docs/reliability.md).
    krafla::signals::report_sigbus("mlb-run", &opts.model.path);
    let interactive = opts.chat.as_ref().is_some_and(|c| c.interactive);
    if interactive {
        // Ctrl-C stops the reply being generated, not the chat.
        krafla::signals::flag_on_sigint(&INTERRUPTED);
    }
    let mut term = Terminal {
        out: std::io::stdout().lock(),
        bar: None,
        lines: interactive.then(|| Lines::open(history)),
    };
    match krafla::tools::run::run(&opts, &mut term) {
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
