//! [`serve`]: the whole server as one call: load, make the slots, listen, answer,
//! shut down.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::error::ServeError;
use super::frontend::{Frontend, Ready};
use super::metrics::Metrics;
use super::options::{ServeOptions, PROMPT_BYTES_SLACK, SHUTDOWN_DRAIN};
use super::scheduler::{self, Msg, Shared, SlotsOptions};
use super::{conn, http, structured};
use crate::chat::{Chat, RenderBudget, StopSet};
use crate::format::mlt::Mlt;
use crate::kernels::pool;
use crate::session::speculative::{load_draft, DraftSource, SpecOptions};
use crate::session::{Engine, LoadOptions, TokenizerSource};

/// The start-up summary's words for the speculation.
fn spec_summary(s: &SpecOptions) -> String {
    match &s.source {
        DraftSource::Lookup => format!(
            "lookup drafts (n-grams up to {}), up to {} per step",
            s.ngram, s.draft_max
        ),
        DraftSource::Model(p) => format!(
            "draft model {}, up to {} per step (p-min {})",
            p.display(),
            s.draft_max,
            s.p_min
        ),
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
    let draft = match o.spec.as_ref().map(|s| &s.source) {
        Some(DraftSource::Model(path)) => Some(Arc::new(load_draft(
            &engine,
            path,
            o.model.pack,
            o.model.half_acts,
        )?)),
        _ => None,
    };
    let pooling = o.pooling.unwrap_or_else(|| engine.pooling());
    let engine = Arc::new(engine);
    let shared = Arc::new(Shared::new(o.parallel.saturating_add(o.queue)));
    let state = o.session_options();
    let metrics = Arc::new(Metrics::new(
        o.parallel,
        engine.model().context(&state).unwrap_or(0),
    ));
    let cfg = SlotsOptions {
        parallel: o.parallel,
        model: state,
        prefill_chunk: o.prefill_chunk,
        grace: o.grace,
        spec: o.spec.clone(),
    };
    let (tx, thread, info) = scheduler::start(
        engine.clone(),
        draft,
        cfg,
        shared.clone(),
        metrics.clone(),
        fe.clone(),
    )?;
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
        max_embed_tokens: o.max_embed_tokens,
        max_embed_bytes: o
            .max_embed_tokens
            .saturating_mul(longest)
            .saturating_mul(PROMPT_BYTES_SLACK)
            .max(4096),
        cpu: Arc::new(tokio::sync::Semaphore::new(cores)),
        salt,
        counter: AtomicU64::new(0),
        metrics,
        pooling,
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
            spec: o.spec.as_ref().map(spec_summary),
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
