//! mlb-serve: an OpenAI-compatible HTTP server for a `.mlb` model.
//!
//! Thin: flags → `krafla::serve::ServeOptions` → `krafla::serve::serve` → exit code (0
//! after a clean shutdown on SIGINT/SIGTERM; 1 with one line on stderr; 2 for bad
//! usage). `listening on http://HOST:PORT` goes to stdout when the server is ready; the
//! summary and one line per request go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use krafla::cli::{count, HalfActsArgs, SpecArgs};
use krafla::serve::{Frontend, KvType, Ready, ServeOptions};
use krafla::session::Pooling;

#[derive(Parser)]
#[command(
    version,
    about = "Serve a .mlb model over an OpenAI-compatible HTTP API",
    after_help = "Routes: POST /v1/chat/completions, POST /v1/completions (streaming or not), POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize. The chat template and stop set come from the tokenizer (.mlt). SIGINT/SIGTERM: stop accepting, let running requests finish, exit 0 (a second signal cancels them)."
)]
struct Args {
    /// The model file.
    model: PathBuf,
    /// The tokenizer (default: the .mlt of the same name beside the model).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = krafla::serve::DEFAULT_PORT)]
    port: u16,
    /// Slots: requests run together (each with its own KV cache).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    parallel: usize,
    /// KV cache positions per slot (default: max_seq, capped at 4096).
    #[arg(long, allow_negative_numbers = true)]
    ctx: Option<usize>,
    /// Model threads (default: all cores).
    #[arg(long, allow_negative_numbers = true)]
    threads: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "MLB_SERVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// KV cache type: f32, f16 or q8_0.
    #[arg(long, default_value = "f32")]
    kv_type: KvType,
    /// Requests that may wait for a slot; more get 503 with Retry-After.
    #[arg(long, default_value_t = krafla::serve::DEFAULT_QUEUE, allow_negative_numbers = true)]
    queue: usize,
    /// Prompt tokens read per step over all slots (long prompts are read in chunks
    /// between decode steps).
    #[arg(long, default_value_t = krafla::serve::DEFAULT_PREFILL_CHUNK, allow_negative_numbers = true, value_parser = count(1..=1 << 20))]
    prefill_chunk: usize,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = krafla::serve::DEFAULT_MAX_BODY, allow_negative_numbers = true, value_parser = count(1024..=1 << 30))]
    max_body: usize,
    /// Connections open at once (kept 64 below the descriptor limit, whose soft value is
    /// raised to the hard one at start); when full, a new connection closes the oldest
    /// one not running a request.
    #[arg(long, default_value_t = krafla::serve::DEFAULT_MAX_CONNECTIONS, allow_negative_numbers = true, value_parser = count(1..=1 << 20))]
    max_connections: usize,
    /// Seconds a connection may take to send a request head, counted from when the
    /// server waits for one (a new connection, or a keep-alive one between requests).
    #[arg(long, value_name = "SECS", allow_negative_numbers = true, default_value_t = krafla::serve::DEFAULT_HEADER_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    header_timeout: u64,
    /// Seconds a request's body may take to arrive (then 408).
    #[arg(long, value_name = "SECS", allow_negative_numbers = true, default_value_t = krafla::serve::DEFAULT_BODY_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    body_timeout: u64,
    /// Fuel of one chat template rendering: one per instruction, one per 64 bytes of
    /// data the template creates (so it bounds time and memory: 4000000 is 256 MiB).
    #[arg(long, env = "MLB_SERVE_TEMPLATE_FUEL", allow_negative_numbers = true, default_value_t = krafla::chat::budget::DEFAULT_FUEL, value_parser = clap::value_parser!(u64).range(10_000..=1 << 32))]
    template_fuel: u64,
    /// The model's name in responses and /v1/models (default: the file name).
    #[arg(long)]
    alias: Option<String>,
    /// Read the weights from the mapped file as they are: no packed or huge-page copy
    /// at load.
    #[arg(long)]
    no_pack: bool,
    #[command(flatten)]
    acts: HalfActsArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// How /v1/embeddings pools a text's final hidden states: mean (over every
    /// token), last (the last token's) or cls (the first token's). Default: the
    /// model's (its .mlb's pooling, from sentence-transformers' config), else last.
    #[arg(long, value_name = "mean|last|cls")]
    pooling: Option<Pooling>,
    /// Most tokens over all inputs of one /v1/embeddings request (more: 400; each
    /// input also fits the context, and a request has at most 2048 inputs).
    #[arg(long, value_name = "N", default_value_t = krafla::serve::DEFAULT_MAX_EMBED_TOKENS, allow_negative_numbers = true, value_parser = count(1..=1 << 24))]
    max_embed_tokens: usize,
}

impl Args {
    fn into_options(self) -> ServeOptions {
        let mut o = ServeOptions::new(self.model);
        o.model.tokenizer = self.tokenizer;
        o.host = self.host;
        o.port = self.port;
        o.parallel = self.parallel;
        o.model.ctx = self.ctx;
        o.model.threads = self.threads;
        o.api_key = self.api_key;
        o.model.kv_type = self.kv_type;
        o.queue = self.queue;
        o.prefill_chunk = self.prefill_chunk;
        o.max_body = self.max_body;
        o.max_connections = self.max_connections;
        o.header_timeout = std::time::Duration::from_secs(self.header_timeout);
        o.body_timeout = std::time::Duration::from_secs(self.body_timeout);
        o.template_fuel = self.template_fuel;
        o.alias = self.alias;
        o.model.pack = !self.no_pack;
        o.spec = self.spec.options();
        o.pooling = self.pooling;
        o.max_embed_tokens = self.max_embed_tokens;
        self.acts.apply(&mut o.model);
        o
    }
}

/// `listening on` to stdout, everything else to stderr.
struct Terminal;

impl Frontend for Terminal {
    fn ready(&self, r: &Ready) {
        self.log(&r.to_string());
        // A closed stdout is no reason to stop serving.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on {}", r.url()).and_then(|()| out.flush());
    }

    fn log(&self, line: &str) {
        // A closed stderr neither: the line is lost, the server goes on.
        let _ = writeln!(std::io::stderr(), "mlb-serve: {line}");
    }
}

fn main() -> ExitCode {
    // No default_sigpipe here: a client that closes its socket must give the server an
    // EPIPE error, not end the process.
    let opts = krafla::cli::parse_args::<Args>().into_options();
    krafla::signals::report_sigbus("mlb-serve", &opts.model.path);
    match krafla::serve::serve(&opts, Arc::new(Terminal)) {
        Ok(()) => {
            eprintln!("mlb-serve: shut down");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlb-serve: {e}");
            ExitCode::from(1)
        }
    }
}
