//! What the four binaries share about their standard output.
//!
//! `print!` panics when stdout fails (a closed pipe, a full disk behind a redirect). The
//! tools print through [`out!`](crate::out) and [`outln!`](crate::outln) instead: a write
//! error ends the process with one line on stderr and exit status 1, and after
//! [`default_sigpipe`] a closed pipe ends it quietly, as it does C tools
//! (`mlb-inspect f.mlb | head`). Their signals: [`crate::signals`].

use std::io::Write;

use crate::kernels::HalfActs;
use crate::session::{speculative, ModelOptions};

/// Makes writing to a closed pipe end the process quietly; see [`crate::signals`].
pub use crate::signals::default_sigpipe;

/// Writes `s` to stdout and flushes; on an error prints `PROGRAM: stdout: ERROR` and
/// exits with status 1.
pub fn write_stdout(s: &str) {
    write_stdout_bytes(s.as_bytes());
}

/// [`write_stdout`] for bytes that need not be UTF-8 (decoded tokens).
pub fn write_stdout_bytes(b: &[u8]) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_all(b).and_then(|()| o.flush()) {
        eprintln!("{}: stdout: {e}", program());
        std::process::exit(1);
    }
}

/// The running binary's name (for error lines).
fn program() -> String {
    std::env::args()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "krafla".into())
}

/// `print!` that never panics; see the module docs.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::cli::write_stdout(&format!($($t)*)) };
}

/// `println!` that never panics; see the module docs.
#[macro_export]
macro_rules! outln {
    () => { $crate::cli::write_stdout("\n") };
    ($($t:tt)*) => { $crate::cli::write_stdout(&(format!($($t)*) + "\n")) };
}

/// Parses the command line with clap. A value clap refuses (a number out of its flag's
/// range or not a number) is one line on stderr, `PROGRAM: invalid value ...`, exit
/// status 2; every other outcome (help, version, a missing or unknown argument) is
/// clap's own.
pub fn parse_args<T: clap::Parser>() -> T {
    use clap::error::ErrorKind;
    match T::try_parse() {
        Ok(a) => a,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::ValueValidation | ErrorKind::InvalidValue
            ) =>
        {
            let text = e.to_string();
            let line = text.lines().next().unwrap_or("invalid value");
            eprintln!("{}: {}", program(), line.trim_start_matches("error: "));
            std::process::exit(2);
        }
        Err(e) => e.exit(),
    }
}

/// A clap value parser for a count within `range` (`#[arg(value_parser = count(1..=256))]`).
pub fn count(range: std::ops::RangeInclusive<u64>) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(range)
}

/// The speculative decoding flags mlb-run and mlb-serve share
/// (`#[command(flatten)] spec: SpecArgs`).
#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding with prompt lookup: draft the tokens that followed the
    /// latest earlier occurrence of the last n-gram (no second model). Greedy output is
    /// unchanged; sampling keeps its distribution.
    #[arg(long, conflicts_with = "draft")]
    pub lookup: bool,
    /// Speculative decoding with a draft model of the same tokenizer (e.g. a Q4_0 copy
    /// of the model). Greedy output is unchanged; sampling keeps its distribution.
    #[arg(long, value_name = "MODEL.mlb")]
    pub draft: Option<std::path::PathBuf>,
    /// Speculative decoding: most tokens drafted per step.
    #[arg(long, value_name = "N", default_value_t = speculative::DEFAULT_DRAFT_MAX, allow_negative_numbers = true, value_parser = count(1..=64))]
    pub draft_max: usize,
    /// --lookup: the longest n-gram matched (then shorter ones).
    #[arg(long, value_name = "N", default_value_t = speculative::DEFAULT_NGRAM, allow_negative_numbers = true, value_parser = count(1..=16))]
    pub lookup_ngram: usize,
    /// --draft: stop drafting at a token the draft model gives less probability than P.
    #[arg(long, value_name = "P", default_value_t = speculative::DEFAULT_P_MIN, allow_negative_numbers = true)]
    pub draft_p_min: f32,
}

impl SpecArgs {
    /// The options, when speculation is asked for.
    pub fn options(self) -> Option<speculative::SpecOptions> {
        let source = match (self.lookup, self.draft) {
            (true, _) => speculative::DraftSource::Lookup,
            (false, Some(p)) => speculative::DraftSource::Model(p),
            (false, None) => return None,
        };
        Some(speculative::SpecOptions {
            source,
            draft_max: self.draft_max,
            ngram: self.lookup_ngram,
            p_min: self.draft_p_min,
        })
    }
}

/// The activation flag mlb-run and mlb-serve share (`#[command(flatten)] acts: HalfActsArgs`).
#[derive(clap::Args, Debug, Clone)]
pub struct HalfActsArgs {
    /// BF16 weights multiply activations rounded to BF16 (llama.cpp's arithmetic, the
    /// `vdpbf16ps` instruction): about 1.6x the prompt speed on CPUs with AVX-512 BF16,
    /// and slower elsewhere (the same bits, emulated with FMA). Default: f32
    /// activations, every product exact. Other weight types are unaffected.
    #[arg(long)]
    pub bf16_activations: bool,
}

impl HalfActsArgs {
    /// Sets `m.half_acts` when the flag asks for BF16 (otherwise leaves the default).
    pub fn apply(&self, m: &mut ModelOptions) {
        if self.bf16_activations {
            m.half_acts = HalfActs::Bf16;
        }
    }
}
