//! mlb-serve: an OpenAI-compatible HTTP server over the session API.
//!
//! - [`api`]: the JSON of requests, responses, stream chunks and errors;
//! - `http`: axum on tokio: routes, handlers, server-sent events, the API key check;
//! - `conn`: the accept loop: the connection cap, the head and body timeouts, the
//!   two-stage shutdown;
//! - `scheduler`: the model's own thread: `parallel` slots (each a
//!   [`Session`](crate::session::Session) over the one [`Engine`]), continuous batching
//!   (every step runs each busy slot's next ids through one call), chunked prefill,
//!   prefix reuse, cancellation and shutdown.
//!
//! The async runtime never runs the model: handlers send a request to the model thread
//! over a channel and get its tokens back on another, so a forward pass never blocks the
//! HTTP side and the HTTP side never slows a step.
//!
//! [`serve`] is the whole server as one call: [`ServeOptions`] in, `Ok(())` after a
//! clean shutdown (SIGINT/SIGTERM), or a typed [`ServeError`].

pub mod api;
mod conn;
mod http;
mod scheduler;
pub mod structured;

pub use scheduler::step_all;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::chat::{Chat, ChatError, RenderBudget, StopSet};
use crate::format::mlt::Mlt;
use crate::format::FormatError;
use crate::kernels::pool;
use crate::model::StateOptions;
use crate::session::{Engine, LoadOptions, ModelOptions, SessionError, TokenizerSource};
use scheduler::{Msg, Shared, SlotsConfig};

/// `--port` default.
pub const DEFAULT_PORT: u16 = 8080;
/// Prompt ids per step over all slots (`--prefill-chunk` default).
pub const DEFAULT_PREFILL_CHUNK: usize = 256;
/// Requests that may wait for a slot (`--queue` default).
pub const DEFAULT_QUEUE: usize = 64;
/// Largest request body (`--max-body` default).
pub const DEFAULT_MAX_BODY: usize = 8 << 20;
/// How long running requests may finish after SIGINT/SIGTERM.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Most slots.
pub const MAX_PARALLEL: usize = 256;
/// Most queue places (`--queue`).
pub const MAX_QUEUE: usize = 1 << 16;
/// Connections open at once (`--max-connections` default; kept below the descriptor
/// limit).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// How long a connection may take to send a request head, counted from when the server
/// waits for one (`--header-timeout` default; also the keep-alive idle timeout).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a handler waits for a request's whole body (`--body-timeout` default).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// After the first signal, connections not running a request are closed this late.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(3);
/// A prompt's text may have at most this many bytes per position of the context times
/// the tokenizer's longest token before it is refused unencoded (no text of that size
/// can encode to fewer ids than the context has positions).
pub const PROMPT_BYTES_SLACK: usize = 4;

/// The KV cache's element type (`--kv-type`): the engine's.
pub use crate::model::KvType;

/// Every option of mlb-serve, with its defaults ([`ServeOptions::new`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ServeOptions {
    /// The model, the tokenizer (the server needs one), `--ctx` (positions per slot),
    /// `--threads` (the model's), `--kv-type`, `--no-pack`, `--bf16-activations`.
    pub model: ModelOptions,
    /// Address to listen on (a name or an IP; default 127.0.0.1).
    pub host: String,
    /// 0: any free port (the one taken is printed).
    pub port: u16,
    /// Slots: sequences run together.
    pub parallel: usize,
    /// Requests need `Authorization: Bearer KEY` (all routes but /health).
    pub api_key: Option<String>,
    /// Requests that may wait for a free slot; more get 503 with Retry-After.
    pub queue: usize,
    /// Prompt ids per step over all slots.
    pub prefill_chunk: usize,
    /// Largest request body in bytes; larger get 413.
    pub max_body: usize,
    /// The model's name in responses (default: the file name without `.mlb`).
    pub alias: Option<String>,
    /// How long running requests may finish after the first SIGINT/SIGTERM.
    pub grace: Duration,
    /// Connections open at once (then kept [`conn::FD_RESERVE`] below the descriptor
    /// limit).
    pub max_connections: usize,
    /// How long a connection may take to send a request head (also the keep-alive idle
    /// timeout).
    pub header_timeout: Duration,
    /// How long a handler waits for a request's whole body (then 408).
    pub body_timeout: Duration,
    /// Fuel of one chat template rendering (`chat::budget`).
    pub template_fuel: u64,
}

impl ServeOptions {
    /// The defaults for `model`.
    pub fn new(model: impl Into<PathBuf>) -> ServeOptions {
        ServeOptions {
            model: ModelOptions::new(model),
            host: "127.0.0.1".into(),
            port: DEFAULT_PORT,
            parallel: 1,
            api_key: None,
            queue: DEFAULT_QUEUE,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            max_body: DEFAULT_MAX_BODY,
            alias: None,
            grace: SHUTDOWN_GRACE,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            template_fuel: crate::chat::budget::DEFAULT_FUEL,
        }
    }

    /// Checks what can be checked without the files.
    pub fn validate(&self) -> Result<(), ServeError> {
        let bad = |name, value: String, rule: &str| {
            Err(ServeError::BadOption {
                name,
                value,
                rule: rule.into(),
            })
        };
        if !(1..=MAX_PARALLEL).contains(&self.parallel) {
            return bad(
                "--parallel",
                self.parallel.to_string(),
                "must be between 1 and 256",
            );
        }
        self.model.validate()?;
        if self.queue > MAX_QUEUE {
            return bad(
                "--queue",
                self.queue.to_string(),
                &format!("at most {MAX_QUEUE}"),
            );
        }
        if self.max_connections == 0 {
            return bad("--max-connections", "0".into(), "at least 1");
        }
        for (name, d) in [
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
        ] {
            if d.is_zero() {
                return bad(name, "0".into(), "at least 1 second");
            }
        }
        if self.template_fuel < 10_000 {
            return bad(
                "--template-fuel",
                self.template_fuel.to_string(),
                "at least 10000",
            );
        }
        if self.prefill_chunk == 0 {
            return bad("--prefill-chunk", "0".into(), "at least one id per step");
        }
        if self.max_body < 1024 {
            return bad(
                "--max-body",
                self.max_body.to_string(),
                "at least 1024 bytes",
            );
        }
        if self.host.is_empty() {
            return bad("--host", "\"\"".into(), "an address is needed");
        }
        if self.api_key.as_deref() == Some("") {
            return bad(
                "--api-key",
                "\"\"".into(),
                "an empty key would let anyone in",
            );
        }
        if self.alias.as_deref() == Some("") {
            return bad("--alias", "\"\"".into(), "a model name cannot be empty");
        }
        Ok(())
    }

    /// The tokenizer file: `--tokenizer`, else the `.mlt` beside the model.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.model.tokenizer_path()
    }

    /// The slots' session options: a step reads at most `prefill_chunk` prompt ids into
    /// one slot.
    fn session_options(&self) -> StateOptions {
        self.model.session_options(self.prefill_chunk)
    }
}

/// Why mlb-serve could not start (or stopped): one line each.
#[derive(Debug)]
pub enum ServeError {
    BadOption {
        name: &'static str,
        value: String,
        rule: String,
    },
    /// Loading the model or making the slots.
    Session(SessionError),
    /// The tokenizer file does not exist (the server needs one).
    NoTokenizer { expected: PathBuf },
    /// The tokenizer file is invalid.
    Tokenizer {
        path: PathBuf,
        err: Box<FormatError>,
    },
    /// Its chat template does not compile.
    Chat { path: PathBuf, err: ChatError },
    /// The address cannot be listened on.
    Listen { addr: String, err: std::io::Error },
    /// A thread or the async runtime could not be started, or the server failed.
    Thread(String),
}

impl fmt::Display for ServeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServeError::BadOption { name, value, rule } => write!(f, "{name} = {value}: {rule}"),
            ServeError::Session(e) => write!(f, "{e}"),
            ServeError::NoTokenizer { expected } => write!(
                f,
                "no tokenizer: {} does not exist; mlb-serve needs one (--tokenizer FILE.mlt)",
                expected.display()
            ),
            ServeError::Tokenizer { path, err } => write!(f, "{}: {err}", path.display()),
            ServeError::Chat { path, err } => write!(f, "{}: {err}", path.display()),
            ServeError::Listen { addr, err } => write!(f, "cannot listen on {addr}: {err}"),
            ServeError::Thread(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ServeError {}

impl From<SessionError> for ServeError {
    fn from(e: SessionError) -> Self {
        ServeError::Session(e)
    }
}

/// What the server shows as it runs (the binary prints it).
pub trait Frontend: Send + Sync {
    /// The server listens: print the address (and the memory per slot).
    fn ready(&self, ready: &Ready);
    /// One line for the log (a finished request, shutdown).
    fn log(&self, line: &str);
}

/// The server at start: where it listens and what each slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    pub addr: SocketAddr,
    pub model: String,
    pub slots: usize,
    /// Positions per slot.
    pub ctx: usize,
    /// Bytes of one slot's KV cache.
    pub kv_bytes: usize,
    /// Bytes of one slot's linear-attention state.
    pub delta_bytes: usize,
    pub chat: bool,
    pub threads: usize,
}

impl Ready {
    /// `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

impl fmt::Display for Ready {
    /// The start-up summary: model, slots and the memory of each.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per = self.kv_bytes + self.delta_bytes;
        write!(
            f,
            "{}: {} slot{} of {} positions; memory per slot: KV cache {}",
            self.model,
            self.slots,
            if self.slots == 1 { "" } else { "s" },
            self.ctx,
            mib(self.kv_bytes)
        )?;
        if self.delta_bytes > 0 {
            write!(f, " + linear-attention state {}", mib(self.delta_bytes))?;
        }
        write!(
            f,
            " ({} for all slots); chat template: {}; {} thread{}",
            mib(per * self.slots),
            if self.chat { "yes" } else { "none" },
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        )
    }
}

/// SIGINT and SIGTERM, listened for from their creation on.
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Catches the signals from now on (needs the runtime).
    fn new() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals {
                term: signal(SignalKind::terminate()).ok(),
                int: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// The next SIGINT or SIGTERM.
    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            async fn one(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                _ = one(&mut self.term) => {}
                _ = one(&mut self.int) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs the server until SIGINT or SIGTERM: loads the model and tokenizer, makes the
/// slots, listens, tells `fe` it is ready, and answers requests. At the first signal it
/// stops accepting connections and requests, answers queued requests with 503, lets
/// running ones finish (for at most [`ServeOptions::grace`]; a second signal cancels
/// them at once), and returns when every connection has closed.
pub fn serve(o: &ServeOptions, fe: Arc<dyn Frontend>) -> Result<(), ServeError> {
    o.validate()?;
    if let Some(note) = o.model.start_pool() {
        fe.log(&format!("note: {note}"));
    }
    let tok_path = o.tokenizer_path();
    if o.model.tokenizer.is_none() && !tok_path.exists() {
        return Err(ServeError::NoTokenizer { expected: tok_path });
    }
    let engine = Engine::load(&LoadOptions {
        tokenizer: TokenizerSource::File(tok_path.clone()),
        ..o.model.load_options()
    })?;
    let mlt = Mlt::load(&tok_path).map_err(|err| ServeError::Tokenizer {
        path: tok_path.clone(),
        err: Box::new(err),
    })?;
    let mut chat = Chat::from_mlt(&mlt).map_err(|err| ServeError::Chat {
        path: tok_path.clone(),
        err,
    })?;
    let stop_ids: Vec<u32> = match &chat {
        Some(c) => c.stop().ids().collect(),
        None => StopSet::from_mlt(&mlt).ids().collect(),
    };
    drop(mlt);
    let model = o.alias.clone().unwrap_or_else(|| {
        o.model
            .path
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    let engine = Arc::new(engine);
    let shared = Arc::new(Shared::new(o.parallel.saturating_add(o.queue)));
    let cfg = SlotsConfig {
        parallel: o.parallel,
        model: o.session_options(),
        prefill_chunk: o.prefill_chunk,
        grace: o.grace,
    };
    let (tx, thread, info) = scheduler::start(engine.clone(), cfg, shared.clone(), fe.clone())?;
    // No prompt text longer than this can fit the context (every id covers at most the
    // longest token's bytes; the slack covers normalization).
    let longest = {
        let t = engine.tokenizer().expect("mlb-serve loads a tokenizer");
        (0..t.n_vocab() as u32)
            .filter_map(|id| t.token_bytes(id).map(<[u8]>::len))
            .max()
            .unwrap_or(1)
            .max(1)
    };
    let max_prompt_bytes = info
        .ctx
        .saturating_mul(longest)
        .saturating_mul(PROMPT_BYTES_SLACK)
        .max(4096);
    if let Some(c) = &mut chat {
        c.set_budget(RenderBudget {
            fuel: o.template_fuel,
            max_output: max_prompt_bytes,
        });
    }
    let fd_limit = conn::raise_fd_limit();
    let limits = conn::ConnLimits {
        max_connections: conn::connection_cap(o.max_connections, fd_limit),
        header_timeout: o.header_timeout,
        drain: SHUTDOWN_DRAIN,
        grace: o.grace,
    };
    // Renders and encodes run on the blocking pool, at most one per core at once.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Template renders nest as deep as minijinja's recursion limit allows.
        .thread_stack_size(8 << 20)
        .thread_name("mlb-serve-http")
        .enable_all()
        .build()
        .map_err(|e| ServeError::Thread(format!("cannot start the async runtime: {e}")))?;
    let salt = {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let app = Arc::new(http::App {
        grammar: structured::GrammarEngine::new(engine.clone(), stop_ids.clone()),
        engine,
        chat,
        stop_ids,
        tx: tx.clone(),
        shared: shared.clone(),
        model: model.clone(),
        tokenizer: tok_path.display().to_string(),
        created: http::unix_now(),
        key: o
            .api_key
            .as_ref()
            .map(|k| Sha256::digest(k.as_bytes()).to_vec()),
        ctx: info.ctx,
        parallel: o.parallel,
        queue: o.queue,
        max_body: o.max_body,
        body_timeout: o.body_timeout,
        max_prompt_bytes,
        cpu: Arc::new(tokio::sync::Semaphore::new(cores)),
        salt,
        counter: AtomicU64::new(0),
    });
    let has_chat = app.chat.is_some();
    let result = rt.block_on(async {
        // Before "listening": a signal from then on is a shutdown, not a kill.
        let mut signals = Signals::new();
        let addr = format!("{}:{}", o.host, o.port);
        let listener = tokio::net::TcpListener::bind((o.host.as_str(), o.port))
            .await
            .map_err(|err| ServeError::Listen {
                addr: addr.clone(),
                err,
            })?;
        let local = listener
            .local_addr()
            .map_err(|err| ServeError::Listen { addr, err })?;
        fe.ready(&Ready {
            addr: local,
            model,
            slots: o.parallel,
            ctx: info.ctx,
            kv_bytes: info.kv_bytes,
            delta_bytes: info.delta_bytes,
            chat: has_chat,
            threads: pool::threads(),
        });
        let (fe2, shared2, tx2) = (fe.clone(), shared.clone(), tx.clone());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(conn::Stop::Running);
        // First signal: drain; second: cancel and close everything.
        tokio::spawn(async move {
            signals.recv().await;
            let running = shared2.processing.load(SeqCst);
            fe2.log(&format!(
                "shutting down: {running} running request{} may finish (a second signal cancels them)",
                if running == 1 { "" } else { "s" }
            ));
            shared2.draining.store(true, SeqCst);
            let _ = tx2.send(Msg::Drain);
            let _ = stop_tx.send(conn::Stop::Draining);
            signals.recv().await;
            fe2.log("second signal: cancelling every request and closing every connection");
            let _ = tx2.send(Msg::CancelAll);
            let _ = stop_tx.send(conn::Stop::Now);
        });
        conn::serve(listener, http::router(app), limits, stop_rx).await;
        Ok(())
    });
    // Every handler has finished; with the last sender gone the model thread ends.
    drop(tx);
    rt.shutdown_timeout(Duration::from_secs(1));
    let _ = thread.join();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked() {
        let ok = ServeOptions::new("m.mlb");
        assert!(ok.validate().is_ok());
        for (o, name) in [
            (
                ServeOptions {
                    parallel: 0,
                    ..ok.clone()
                },
                "--parallel",
            ),
            (
                ServeOptions {
                    parallel: 257,
                    ..ok.clone()
                },
                "--parallel",
            ),
            (
                ServeOptions {
                    prefill_chunk: 0,
                    ..ok.clone()
                },
                "--prefill-chunk",
            ),
            (
                ServeOptions {
                    max_body: 10,
                    ..ok.clone()
                },
                "--max-body",
            ),
            (
                ServeOptions {
                    api_key: Some(String::new()),
                    ..ok.clone()
                },
                "--api-key",
            ),
        ] {
            match o.validate() {
                Err(ServeError::BadOption { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        // The model's options are the session API's to check.
        let mut o = ok.clone();
        o.model.threads = Some(0);
        assert!(matches!(
            o.validate(),
            Err(ServeError::Session(SessionError::BadOption {
                name: "--threads",
                ..
            }))
        ));
        assert_eq!("Q8_0".parse::<KvType>(), Ok(KvType::Q8_0));
        assert!("f8".parse::<KvType>().is_err());
    }

    #[test]
    fn the_summary_names_the_memory_per_slot() {
        let r = Ready {
            addr: "127.0.0.1:8080".parse().unwrap(),
            model: "m".into(),
            slots: 4,
            ctx: 256,
            kv_bytes: 1 << 20,
            delta_bytes: 0,
            chat: false,
            threads: 2,
        };
        assert_eq!(r.url(), "http://127.0.0.1:8080");
        assert_eq!(
            r.to_string(),
            "m: 4 slots of 256 positions; memory per slot: KV cache 1.0 MiB (4.0 MiB for all slots); chat template: none; 2 threads"
        );
    }
}
