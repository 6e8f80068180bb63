//! `mlb-run` as one library call: [`RunOptions`] (every flag, validated here), [`run`]
//! (load, read the prompt, prefill with the optional `--logits` file, generate or
//! measure) and [`RunError`] (typed, one line each, an exit code).
//!
//! What the command shows goes through a [`Frontend`] (generated text to stdout,
//! `--verbose` lines and progress to stderr; the interactive chat's lines come from it),
//! so the binary stays a flag parser. `--chat` runs in [`super::chat_run`].

use std::fmt;
use std::io::{BufWriter, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::chat_run::{self, ChatRun};
use super::measure::{self, Measure};
use super::{ChatSessionError, Engine, GenerateOptions, ModelOptions, SessionError, StopReason};
use crate::atomic::AtomicFile;
use crate::chat::ChatError;
use crate::format::FormatError;
use crate::kernels::{self, pool};
use crate::model::eval::EvalError;
use crate::model::forward::{LogitsSink, DEFAULT_BATCH};
use crate::model::sampler::Logprobs;
use crate::model::{StateOptions, SamplerOptions};

/// `--temp` default.
pub const DEFAULT_TEMP: f32 = 0.8;
/// `--top-k` default.
pub const DEFAULT_TOP_K: usize = 40;
/// `--top-p` default.
pub const DEFAULT_TOP_P: f32 = 0.95;

/// Where the prompt comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    File(PathBuf),
    /// Token ids as text: "1 2 3", "1,2,3" or a JSON array (no tokenizer needed).
    Ids(String),
    Stdin,
}

/// Every option of `mlb-run`, with its defaults (`RunOptions::new`).
#[derive(Debug, Clone, PartialEq)]
pub struct RunOptions {
    /// The model, the tokenizer, `--ctx`, `--threads`, `--kv-type`, `--no-pack` and
    /// `--bf16-activations` (the reference model of `--kl-divergence` always takes f32
    /// activations).
    pub model: ModelOptions,
    pub prompt: Prompt,
    /// Tokens to generate; `None`: 128, or 0 with `logits`.
    pub n_predict: Option<usize>,
    pub sampling: SamplerOptions,
    /// Most prompt tokens per prefill batch.
    pub batch: usize,
    /// Write every prompt position's logits here (little-endian f32, positions × vocab).
    pub logits: Option<PathBuf>,
    /// Show the kernel tier and the model's shape.
    pub verbose: bool,
    /// Measure instead of generating.
    pub measure: Option<Measure>,
    /// Keep generating past the stop set (always `n_predict` tokens).
    pub ignore_eos: bool,
    /// Texts that end the generation (`--stop`); the output stops before them.
    pub stop_strings: Vec<String>,
    /// Print each sampled token's log-probability and this many alternatives
    /// (`--logprobs N`), one JSON line per token on stderr.
    pub logprobs: Option<usize>,
    /// Chat with the model (`--chat`): the prompt is a conversation.
    pub chat: Option<ChatRun>,
}

impl RunOptions {
    /// mlb-run's defaults for `model`, prompt from stdin.
    pub fn new(model: impl Into<PathBuf>) -> RunOptions {
        RunOptions {
            model: ModelOptions::new(model),
            prompt: Prompt::Stdin,
            n_predict: None,
            sampling: SamplerOptions {
                temp: DEFAULT_TEMP,
                top_k: DEFAULT_TOP_K,
                top_p: DEFAULT_TOP_P,
                ..SamplerOptions::default()
            },
            batch: DEFAULT_BATCH,
            logits: None,
            verbose: false,
            measure: None,
            ignore_eos: false,
            stop_strings: Vec::new(),
            logprobs: None,
            chat: None,
        }
    }

    /// The sampler's options, with `--logprobs`.
    pub fn sampling_opts(&self) -> SamplerOptions {
        SamplerOptions {
            logprobs: self.logprobs.is_some(),
            top_logprobs: self.logprobs.unwrap_or(0),
            ..self.sampling.clone()
        }
    }

    /// Checks what can be checked without the files.
    pub fn validate(&self) -> Result<(), RunError> {
        self.model.validate()?;
        self.sampling
            .validate(None)
            .map_err(|e| RunError::Session(SessionError::Sampling(e)))?;
        if let Some(m) = &self.measure {
            m.validate()?;
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return Err(RunError::BadOption {
                name: "--stop",
                value: "\"\"".into(),
                rule: "a stop string cannot be empty",
            });
        }
        if self.chat.is_some() {
            let clash = if matches!(self.prompt, Prompt::Ids(_)) {
                Some("--tokens")
            } else if self.logits.is_some() {
                Some("--logits")
            } else if self.measure.is_some() {
                Some("--imatrix, --perplexity, --kl-divergence")
            } else {
                None
            };
            if let Some(name) = clash {
                return Err(RunError::BadOption {
                    name,
                    value: "(given)".into(),
                    rule: "cannot be used with --chat",
                });
            }
        }
        Ok(())
    }
}

/// Why mlb-run failed: one line each (the binary prefixes `mlb-run: `).
#[derive(Debug)]
pub enum RunError {
    /// Loading, feeding or generating.
    Session(SessionError),
    /// A measurement.
    Eval(EvalError),
    /// An option out of range.
    BadOption {
        name: &'static str,
        value: String,
        rule: &'static str,
    },
    /// A text prompt and no tokenizer (`expected`: where it was looked for).
    NoTokenizer { expected: PathBuf },
    /// `--tokens` is not a list of ids.
    Ids(FormatError),
    /// The prompt file or stdin cannot be read.
    Read { what: String, err: std::io::Error },
    /// The `--logits` file cannot be written.
    Logits { path: PathBuf, err: std::io::Error },
    /// Generated text cannot be written.
    Stdout(std::io::Error),
    /// An output (`--logits`, `--imatrix`) is one of the inputs.
    OutputIsInput {
        option: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
    /// `--kl-divergence`: the reference model cannot be used.
    Reference {
        path: PathBuf,
        err: Box<SessionError>,
    },
    /// `--chat`: a turn failed (a full context, a template that raised, ...).
    Chat(ChatSessionError),
    /// `--chat`: the conversation JSON (from `what`) is not one.
    Conversation { what: String, err: ChatError },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Reference { path, err } => write!(f, "{}: {err}", path.display()),
            RunError::Session(e) => write!(f, "{e}"),
            RunError::Eval(e) => write!(f, "{e}"),
            RunError::BadOption { name, value, rule } => write!(f, "{name} = {value}: {rule}"),
            RunError::NoTokenizer { expected } => write!(
                f,
                "no tokenizer: {} does not exist; a text prompt needs --tokenizer FILE.mlt (or use --tokens)",
                expected.display()
            ),
            RunError::Ids(e) => write!(f, "--tokens: {e}"),
            RunError::Read { what, err } => write!(f, "{what}: {err}"),
            RunError::Logits { path, err } => write!(f, "--logits {}: {err}", path.display()),
            RunError::Stdout(e) => write!(f, "stdout: {e}"),
            RunError::OutputIsInput { option, path, err } => {
                write!(f, "{option} {}: {err}", path.display())
            }
            RunError::Chat(e) => write!(f, "{e}"),
            RunError::Conversation { what, err } => write!(f, "{what}: {err}"),
        }
    }
}

impl std::error::Error for RunError {}

impl RunError {
    /// The process exit status: 1 for every run error (2 is clap's bad usage).
    pub fn exit_code(&self) -> u8 {
        1
    }
}

wrap_errors!(RunError {
    Session(SessionError),
    Eval(EvalError),
});

/// What the command shows, as it happens.
pub trait Frontend {
    /// Generated text (stdout), as it is made; an error ends the run.
    fn text(&mut self, s: &str) -> std::io::Result<()>;
    /// A `--verbose` line or a note (stderr).
    fn info(&mut self, _line: &str) {}
    /// A measurement starts over `total` chunks.
    fn chunks_start(&mut self, _total: usize) {}
    /// `done` chunks measured; `figure` is the running result ("PPL 12.3456"), when
    /// there is one.
    fn chunks_done(&mut self, _done: usize, _figure: Option<&str>) {}
    /// The measurement is over (before its report is shown).
    fn chunks_end(&mut self) {}
    /// The interactive chat's next line, `prompt` shown before it; `None` at the end of
    /// the input (Ctrl-D).
    fn read_line(&mut self, _prompt: &str) -> std::io::Result<Option<String>> {
        Ok(None)
    }
    /// Whether the user asked to stop the reply being generated (Ctrl-C) since the
    /// last call.
    fn interrupted(&mut self) -> bool {
        false
    }
}

/// What a successful run gives back for the binary to show.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A generation's summary (stderr).
    Generated(Summary),
    /// A measurement's report (stdout, text or JSON).
    Measured(String),
}

/// The speed and memory of a generation: two lines for stderr ([`fmt::Display`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated: usize,
    pub gen_secs: f64,
    pub stop: StopReason,
    pub peak_rss_kib: Option<u64>,
    pub kv_bytes: usize,
    pub ctx: usize,
    pub delta_bytes: usize,
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

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stop = match self.stop {
            StopReason::StopId(id) => format!(" (stop id {id})"),
            StopReason::StopString(_) => " (stop string)".into(),
            StopReason::ContextFull => " (context full)".into(),
            StopReason::Length | StopReason::Cancelled => String::new(),
        };
        writeln!(
            f,
            "prompt: {} tokens in {:.3} s ({}); generated: {} tokens in {:.3} s ({}){stop}",
            self.prompt_tokens,
            self.prompt_secs,
            rate(self.prompt_tokens, self.prompt_secs),
            self.generated,
            self.gen_secs,
            rate(self.generated, self.gen_secs)
        )?;
        let rss = self
            .peak_rss_kib
            .map(|k| mib(k as f64 * 1024.0))
            .unwrap_or_else(|| "?".into());
        write!(
            f,
            "memory: peak RSS {rss}; KV cache {} ({} positions){}",
            mib(self.kv_bytes as f64),
            self.ctx,
            if self.delta_bytes > 0 {
                format!("; linear-attention state {}", mib(self.delta_bytes as f64))
            } else {
                String::new()
            }
        )
    }
}

/// Peak resident memory from /proc/self/status (VmHWM), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Writes the logits of every prompt position; the file appears only when all are
/// written (dropped unfinished, on any error, it leaves nothing).
struct LogitsFile {
    out: BufWriter<AtomicFile>,
    err: Option<std::io::Error>,
}

impl LogitsFile {
    fn create(path: &Path) -> Result<LogitsFile, RunError> {
        let f = AtomicFile::create(path).map_err(|err| RunError::Logits {
            path: path.to_path_buf(),
            err,
        })?;
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

    fn finish(self, path: &Path) -> Result<(), RunError> {
        let fail = |err: std::io::Error| RunError::Logits {
            path: path.to_path_buf(),
            err,
        };
        if let Some(e) = self.err {
            return Err(fail(e));
        }
        let f = self.out.into_inner().map_err(|e| fail(e.into_error()))?;
        f.commit().map_err(fail)
    }
}

/// Refuses an output (`--logits`, `--imatrix`) that is one of the inputs (the model,
/// the tokenizer, the `--kl-divergence` reference, the prompt file).
fn check_outputs(o: &RunOptions) -> Result<(), RunError> {
    let tokenizer = o.model.tokenizer_path();
    let mut inputs = vec![o.model.path.as_path(), &tokenizer];
    if let Prompt::File(f) = &o.prompt {
        inputs.push(f);
    }
    let mut outputs = vec![("--logits", o.logits.as_deref())];
    if let Some(m) = &o.measure {
        match &m.mode {
            measure::Mode::KlDivergence { reference } => inputs.push(reference),
            measure::Mode::Imatrix { output, .. } => outputs.push(("--imatrix", Some(output))),
            measure::Mode::Perplexity => {}
        }
    }
    for (option, out) in outputs {
        if let Some(path) = out {
            crate::atomic::check_not_input(path, &inputs).map_err(|err| {
                RunError::OutputIsInput {
                    option,
                    path: path.to_path_buf(),
                    err,
                }
            })?;
        }
    }
    Ok(())
}

/// The text of `file`, or of stdin without one.
pub(super) fn read_text(file: Option<&Path>) -> Result<String, RunError> {
    match file {
        Some(f) => std::fs::read_to_string(f).map_err(|err| RunError::Read {
            what: f.display().to_string(),
            err,
        }),
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|err| RunError::Read {
                    what: "stdin".into(),
                    err,
                })?;
            Ok(s)
        }
    }
}

/// The prompt's ids.
fn prompt_ids(o: &RunOptions, engine: &Engine) -> Result<Vec<u32>, RunError> {
    let text = match &o.prompt {
        Prompt::Ids(ids) => {
            return crate::tokenizer::parse_ids(ids, engine.config().vocab).map_err(RunError::Ids)
        }
        Prompt::Text(t) => t.clone(),
        Prompt::File(f) => read_text(Some(f))?,
        Prompt::Stdin => read_text(None)?,
    };
    match engine.tokenizer() {
        Some(t) => Ok(t.encode(&text)),
        None => Err(RunError::NoTokenizer {
            expected: o.model.path.with_extension("mlt"),
        }),
    }
}

/// The `--verbose` lines: the kernel tier, the threads, the model's shape.
pub(super) fn note_verbose(
    engine: &Engine,
    ctx: usize,
    opts: &StateOptions,
    load_secs: f64,
    fe: &mut dyn Frontend,
) -> Result<(), RunError> {
    let cfg = engine.config();
    fe.info(&format!(
        "kernel tier: {} (supported: {}); packed weights: {}",
        kernels::tier(),
        kernels::supported_tiers()
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(", "),
        match engine.packed_bytes() {
            0 => "none".to_string(),
            b => mib(b as f64),
        }
    ));
    if let Some(h) = kernels::prefetch_hints() {
        fe.info(&format!("weight prefetch (KRAFLA_PREFETCH): {h}"));
    }
    fe.info(&format!(
        "threads: {}; model: dim {} layers {} heads {}/{} head_dim {} hidden {} vocab {}; ctx {ctx} batch {} kv {}; loaded in {load_secs:.2} s",
        pool::threads(),
        cfg.dim,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.hidden_dim,
        cfg.vocab,
        opts.batch,
        opts.kv_type,
    ));
    fe.info(&format!("memory: {}", engine.slot_memory(opts)?));
    let stops: Vec<String> = engine
        .stop_set()
        .tokens()
        .iter()
        .map(|t| {
            let text = engine
                .tokenizer()
                .and_then(|tok| tok.token_bytes(t.id))
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            format!(
                "{} {text:?} ({})",
                t.id,
                crate::format::mlt_chat::source_names(t.sources).join(", ")
            )
        })
        .collect();
    fe.info(&format!(
        "stop ids: {}",
        if stops.is_empty() {
            "none".to_string()
        } else {
            stops.join("; ")
        }
    ));
    Ok(())
}

/// One `--logprobs` line: `{"id": ID, "token": TEXT, "logprob": LP, "top": [{"id", "token",
/// "logprob"}, ...]}` (`token` is null without a tokenizer; a log-probability of −∞ is
/// null).
pub fn logprobs_json(engine: &Engine, id: u32, lp: &Logprobs) -> String {
    let text = |id: u32| {
        engine
            .tokenizer()
            .map(|t| String::from_utf8_lossy(&t.decode(&[id])).into_owned())
    };
    let top: Vec<serde_json::Value> = lp
        .top
        .iter()
        .map(|&(i, l)| serde_json::json!({"id": i, "token": text(i), "logprob": l}))
        .collect();
    serde_json::json!({"id": id, "token": text(id), "logprob": lp.chosen, "top": top}).to_string()
}

/// Parses `--logit-bias ID=BIAS` (BIAS a number or `-inf`).
pub fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: give ID=BIAS, e.g. 2=-inf or 504=1.5"))?;
    let id = id
        .trim()
        .parse::<u32>()
        .map_err(|e| format!("{s:?}: the id {id:?}: {e}"))?;
    let bias = bias
        .trim()
        .parse::<f32>()
        .map_err(|e| format!("{s:?}: the bias {bias:?}: {e}"))?;
    if bias.is_nan() || bias == f32::INFINITY {
        return Err(format!(
            "{s:?}: a bias is a number or -inf (never this token)"
        ));
    }
    Ok((id, bias))
}

/// Runs mlb-run: validates `o`, loads the model, and generates (or measures, or writes
/// the prompt's logits); shows what it makes through `fe`.
pub fn run(o: &RunOptions, fe: &mut dyn Frontend) -> Result<Outcome, RunError> {
    o.validate()?;
    if let Some(note) = o.model.start_pool() {
        fe.info(&format!("mlb-run: note: {note}"));
    }
    check_outputs(o)?;
    let t_load = Instant::now();
    let engine = o.model.load()?;
    if let Some(c) = &o.chat {
        return chat_run::run(o, c, &engine, fe, t_load.elapsed().as_secs_f64());
    }
    let prompt = prompt_ids(o, &engine)?;
    if let Some(m) = &o.measure {
        // Each chunk starts with BOS when the tokenizer adds one to a text.
        let bos = match o.prompt {
            Prompt::Ids(_) => None,
            _ => engine.bos_added(),
        };
        return measure::run(o, m, &engine, bos, &prompt, fe).map(Outcome::Measured);
    }
    let opts = o.model.session_options(o.batch.max(1));
    let mut s = engine.session(&opts)?;
    let load_secs = t_load.elapsed().as_secs_f64();
    if o.verbose {
        note_verbose(&engine, s.ctx(), &opts, load_secs, fe)?;
    }

    // The prompt.
    let t0 = Instant::now();
    match &o.logits {
        Some(path) => {
            let mut file = LogitsFile::create(path)?;
            let mut sink = |_: usize, row: &[f32]| file.row(row);
            let each: LogitsSink = &mut sink;
            s.feed_with(&prompt, Some(each))?;
            file.finish(path)?;
        }
        None => {
            s.feed(&prompt)?;
        }
    }
    let prompt_secs = t0.elapsed().as_secs_f64();

    // The generation.
    let n_gen = o.n_predict.unwrap_or(if o.logits.is_some() {
        0
    } else {
        super::DEFAULT_MAX_TOKENS
    });
    let gopts = GenerateOptions {
        max_tokens: n_gen,
        sampling: o.sampling_opts(),
        ignore_eos: o.ignore_eos,
        stop_ids: Vec::new(),
        stop_strings: o.stop_strings.clone(),
    };
    let t1 = Instant::now();
    let mut failed = None;
    let g = s.generate(&gopts, |step| {
        if let (Some(_), Some(lp)) = (o.logprobs, &step.logprobs) {
            fe.info(&logprobs_json(&engine, step.id, lp));
        }
        match fe.text(&step.text) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failed = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(e) = failed {
        return Err(RunError::Stdout(e));
    }
    let nl = if n_gen > 0 { "\n" } else { "" };
    fe.text(&format!("{}{nl}", g.tail))
        .map_err(RunError::Stdout)?;
    let gen_secs = t1.elapsed().as_secs_f64();

    Ok(Outcome::Generated(Summary {
        prompt_tokens: prompt.len(),
        prompt_secs,
        generated: g.tokens.len(),
        gen_secs,
        stop: g.stop,
        peak_rss_kib: peak_rss_kib(),
        kv_bytes: s.state().kv_bytes(),
        ctx: s.ctx(),
        delta_bytes: s.state().delta_bytes(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked_before_any_file_is_read() {
        let ok = RunOptions::new("/nonexistent/m.mlb");
        assert!(ok.validate().is_ok());
        let mut o = ok.clone();
        o.model.threads = Some(0);
        let e = o.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "--threads = 0: at least one thread is needed"
        );
        let mut o = ok.clone();
        o.sampling.temp = -1.0;
        assert_eq!(
            o.validate().unwrap_err().to_string(),
            "--temp = -1: must be a finite number ≥ 0 (0 is greedy)"
        );
        let mut o = ok.clone();
        o.sampling.top_p = 0.0;
        assert_eq!(
            o.validate().unwrap_err().to_string(),
            "--top-p = 0: must be in (0, 1]"
        );
        let mut o = ok.clone();
        o.measure = Some(Measure {
            chunks: Some(0),
            ..Measure::new(measure::Mode::Perplexity)
        });
        assert_eq!(
            o.validate().unwrap_err().to_string(),
            "--chunks = 0: give a number of chunks of at least 1"
        );
        o.measure = Some(Measure::new(measure::Mode::Imatrix {
            output: "x.mli".into(),
            save_every: Some(0),
        }));
        assert!(matches!(
            o.validate(),
            Err(RunError::BadOption {
                name: "--save-every",
                ..
            })
        ));
        // The run refuses before it opens the model.
        struct Null;
        impl Frontend for Null {
            fn text(&mut self, _: &str) -> std::io::Result<()> {
                Ok(())
            }
        }
        assert!(matches!(
            run(&o, &mut Null),
            Err(RunError::BadOption { .. })
        ));
        assert!(matches!(
            run(&ok, &mut Null),
            Err(RunError::Session(SessionError::Format(_)))
        ));
        assert_eq!(run(&ok, &mut Null).unwrap_err().exit_code(), 1);
    }

    #[test]
    fn summary_lines() {
        let s = Summary {
            prompt_tokens: 3,
            prompt_secs: 0.5,
            generated: 4,
            gen_secs: 0.0,
            stop: StopReason::StopId(2),
            peak_rss_kib: Some(2048),
            kv_bytes: 1 << 20,
            ctx: 64,
            delta_bytes: 0,
        };
        assert_eq!(
            s.to_string(),
            "prompt: 3 tokens in 0.500 s (6.0 tok/s); generated: 4 tokens in 0.000 s (- tok/s) (stop id 2)\n\
             memory: peak RSS 2.0 MiB; KV cache 1.0 MiB (64 positions)"
        );
        let s = Summary {
            stop: StopReason::ContextFull,
            peak_rss_kib: None,
            delta_bytes: 3 << 19,
            ..s
        };
        let t = s.to_string();
        assert!(t.contains("(context full)\nmemory: peak RSS ?;"), "{t}");
        assert!(t.ends_with("; linear-attention state 1.5 MiB"), "{t}");
    }
}
