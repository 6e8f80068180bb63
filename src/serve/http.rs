//! The HTTP edge of mlb-serve: axum routes and handlers, server-sent event streams,
//! the API key check. Handlers read the body (within the body timeout), check the
//! request, render and encode its prompt (on tokio's blocking pool, at most one per core
//! at once, and only once the request has its place in the queue), and hand it to the
//! model thread through a channel; the model's events come back on a channel of the
//! request's own. From the body read to the response's end the connection counts as
//! running a request (`conn::Running`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, FailedToBufferBody};
use axum::extract::{DefaultBodyLimit, FromRequest, State};
use axum::http::header::{AUTHORIZATION, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, StreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, ApiError, Endpoint, Meta, Prompt, Request, TokenLogprob};
use super::conn::{Conn, Running};
use super::embed::{self as embed_api, Input};
use super::metrics::Metrics;
use super::scheduler::{Event, Job, Msg, Shared, Work};
use super::structured::{self, GrammarEngine};
use crate::chat::harmony;
use crate::chat::tools::{ToolEvent, ToolFormat, ToolParser};
use crate::chat::Chat;
use crate::session::{Engine, GenerateOptions, Pooling};

/// What every handler shares.
pub struct App {
    /// Compiles requests' grammars (structured output, required tool calls).
    pub grammar: GrammarEngine,
    pub engine: Arc<Engine>,
    /// The tokenizer's chat template and stop set (`None`: no template).
    pub chat: Option<Chat>,
    /// Ids that end a generation (the `.mlt`'s stop set).
    pub stop_ids: Vec<u32>,
    pub tx: Sender<Msg>,
    pub shared: Arc<Shared>,
    /// The model's name in responses and /v1/models.
    pub model: String,
    /// The tokenizer file (named in errors).
    pub tokenizer: String,
    /// When the model was loaded (Unix seconds).
    pub created: u64,
    /// SHA-256 of the API key, if one is needed.
    pub key: Option<Vec<u8>>,
    pub ctx: usize,
    pub parallel: usize,
    pub queue: usize,
    pub max_body: usize,
    /// How long a handler waits for the whole body.
    pub body_timeout: std::time::Duration,
    /// Longest prompt text (a completion's, a chat's rendering) encoded: any longer
    /// cannot fit the context.
    pub max_prompt_bytes: usize,
    /// Most ids over all inputs of one embeddings request, and most text bytes (any
    /// more cannot encode to fewer ids).
    pub max_embed_tokens: usize,
    pub max_embed_bytes: usize,
    /// Permits for CPU work on the blocking pool (rendering, encoding): one per core.
    pub cpu: Arc<tokio::sync::Semaphore>,
    /// Per-process random bits for ids and seeds.
    pub salt: u64,
    pub counter: AtomicU64,
    /// What /metrics reports.
    pub metrics: Arc<Metrics>,
    /// How /v1/embeddings pools (`--pooling`, else the model's).
    pub pooling: Pooling,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// splitmix64: spreads a counter over 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl App {
    /// A fresh number for ids and seeds.
    fn next(&self) -> u64 {
        mix(self.salt ^ self.counter.fetch_add(1, Relaxed))
    }

    /// A fresh tool call id, of the form the template's family takes.
    fn call_id(&self, format: ToolFormat) -> String {
        format.call_id(self.next())
    }

    fn tokenizer(&self) -> &crate::tokenizer::Tokenizer {
        self.engine
            .tokenizer()
            .expect("mlb-serve loads a tokenizer at start")
    }

    /// The prompt's ids: the chat template rendered and encoded (no BOS added), or the
    /// text encoded (with the tokenizer's BOS), or the ids given.
    fn prompt_ids(&self, req: &Request) -> Result<Vec<u32>, ApiError> {
        match &req.prompt {
            Prompt::Chat(messages, opts) => {
                let chat = self.chat.as_ref().ok_or_else(|| self.no_template())?;
                chat.encode(self.tokenizer(), messages, opts)
                    .map_err(|e| api::chat_error(&e))
            }
            Prompt::Text(t) if t.len() > self.max_prompt_bytes => Err(ApiError::context(
                "prompt",
                format!(
                    "This model's maximum context length is {} tokens, and your prompt of {} bytes cannot encode to fewer (at most {} bytes can fit). Please reduce the length of the prompt.",
                    self.ctx,
                    t.len(),
                    self.max_prompt_bytes
                ),
            )),
            Prompt::Text(t) => Ok(self.tokenizer().encode(t)),
            Prompt::Ids(ids) => Ok(ids.clone()),
        }
    }

    /// The ids of embedding input `i`: at least one, and at most the context.
    fn embed_ids(&self, i: usize, input: &Input) -> Result<Vec<u32>, ApiError> {
        let too_long = |what: String| {
            ApiError::context(
                "input",
                format!(
                    "This model's maximum context length is {} tokens, and input {i} {what}. Please reduce the length of the input.",
                    self.ctx
                ),
            )
        };
        let ids = match input {
            Input::Text(t) if t.len() > self.max_prompt_bytes => {
                return Err(too_long(format!(
                    "has {} bytes, which cannot encode to fewer",
                    t.len()
                )))
            }
            Input::Text(t) => self.tokenizer().encode(t),
            Input::Ids(ids) => ids.clone(),
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(
                "input",
                format!("Input {i} encodes to no tokens: there is nothing to embed."),
            ));
        }
        if ids.len() > self.ctx {
            return Err(too_long(format!("has {} tokens", ids.len())));
        }
        Ok(ids)
    }

    /// 404, as OpenAI answers a chat request to a model that only completes text.
    fn no_template(&self) -> ApiError {
        ApiError {
            param: Some("model".into()),
            ..ApiError::not_found(format!(
                "This model has no chat template ({} has none), so /v1/chat/completions cannot render a conversation; use /v1/completions, or give the tokenizer a template (mlt-convert --chat-template FILE).",
                self.tokenizer
            ))
        }
    }

    /// The generation's options, checked against the context.
    fn gen_options(&self, req: &Request, n: usize) -> Result<GenerateOptions, ApiError> {
        let what = match req.endpoint {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
        };
        if n == 0 {
            return Err(ApiError::invalid(what, "The prompt is empty (no tokens)."));
        }
        let ctx = self.ctx;
        if n >= ctx {
            return Err(ApiError::context(
                what,
                format!(
                    "This model's maximum context length is {ctx} tokens. However, your {what} resulted in {n} tokens, and at least one must be left to generate. Please reduce the length of the {what}."
                ),
            ));
        }
        let room = ctx - n;
        let max_tokens = match req.max_tokens {
            Some(m) if m > room => {
                return Err(ApiError::context(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({n} in the {what}, {m} in the completion). Please reduce the length of the {what} or completion.",
                        n.saturating_add(m)
                    ),
                ))
            }
            Some(m) => m,
            None => match req.endpoint {
                Endpoint::Chat => room,
                Endpoint::Completion => api::DEFAULT_COMPLETION_TOKENS.min(room),
            },
        };
        let mut sampling = req.sampling.clone();
        if !req.seeded {
            sampling.seed = self.next();
        }
        sampling
            .validate(Some(self.engine.config().vocab))
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(GenerateOptions {
            max_tokens,
            sampling,
            stop_ids: self.stop_ids.clone(),
            stop_strings: req.stop.clone(),
            ignore_eos: false,
        })
    }
}

/// The router with every route, the API key check and the body limit.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .layer(middleware::from_fn_with_state(app.clone(), count))
        .layer(DefaultBodyLimit::max(app.max_body))
        .with_state(app)
}

/// With `--api-key`, every route but /health needs `Authorization: Bearer KEY`. The
/// given key's SHA-256 is compared with the key's in constant time (no early exit on
/// the first differing byte, and no length to learn).
async fn auth(State(app): State<Arc<App>>, req: axum::extract::Request, next: Next) -> Response {
    let Some(want) = &app.key else {
        return next.run(req).await;
    };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let header = req.headers().get(AUTHORIZATION);
    let key = header
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, k)| k.trim());
    match key {
        Some(k) if bool::from(Sha256::digest(k.as_bytes()).as_slice().ct_eq(want)) => {
            next.run(req).await
        }
        _ => ApiError::unauthorized(header.is_some()).into_response(),
    }
}

/// Counts every answer by route and status (/metrics); unknown routes count as
/// `other`, so a scan of random paths adds one series, not one per path.
async fn count(State(app): State<Arc<App>>, req: axum::extract::Request, next: Next) -> Response {
    const ROUTES: [&str; 9] = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "other",
    ];
    let path = req.uri().path();
    let route = ROUTES.iter().find(|&&r| r == path).unwrap_or(&"other");
    let r = next.run(req).await;
    app.metrics.request(route, r.status().as_u16());
    r
}

async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::not_found(format!("Invalid URL ({method} {})", uri.path())).into_response()
}

async fn not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::method_not_allowed(format!(
        "Method {method} is not allowed for {}.",
        uri.path()
    ))
    .into_response()
}

/// A request's body, read within the body timeout (else 408), and its connection
/// (absent when the router is used without `conn`).
async fn read_body(
    app: &App,
    req: axum::extract::Request,
) -> Result<(Bytes, Option<Arc<Conn>>), ApiError> {
    let conn = req.extensions().get::<Arc<Conn>>().cloned();
    let body = tokio::time::timeout(app.body_timeout, Bytes::from_request(req, &()))
        .await
        .map_err(|_| ApiError {
            code: Some("request_timeout"),
            ..ApiError::new_status(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "The request body did not arrive within {} s.",
                    app.body_timeout.as_secs()
                ),
            )
        })?;
    Ok((body_of(body, app.max_body)?, conn))
}

/// The body, or 413 past the size limit.
fn body_of(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    match b {
        Ok(b) => Ok(b),
        Err(BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_))) => {
            Err(ApiError::too_large(limit))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "The request body could not be read: {}",
            e.body_text()
        ))),
    }
}

/// The body as the JSON of a request: 408 past the body timeout, 413 past the size
/// limit, 400 if it is not one; with the request marked running on its connection.
async fn json_body<T: DeserializeOwned>(
    app: &App,
    req: axum::extract::Request,
) -> Result<(T, Option<Running>), ApiError> {
    let (body, conn) = read_body(app, req).await?;
    Ok((api::from_json(&body)?, conn.map(|c| c.running())))
}

/// The one model, with its context (`context_length`: positions per slot, what a
/// request's prompt and completion share; `meta`: llama-server's fields, `n_ctx_train`
/// the model's own longest context).
async fn models(State(app): State<Arc<App>>) -> Response {
    let c = app.engine.config();
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.model,
            "object": "model",
            "created": app.created,
            "owned_by": "krafla",
            "context_length": app.ctx,
            "meta": {
                "n_ctx": app.ctx,
                "n_ctx_train": c.max_seq,
                "n_vocab": c.vocab,
                "n_embd": c.dim,
                "n_params": null,
                "slots": app.parallel,
            },
        }],
    }))
    .into_response()
}

/// Prometheus' text format (`metrics`).
async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let busy = app.shared.processing.load(Relaxed);
    Json(json!({
        "status": "ok",
        "slots_idle": app.parallel.saturating_sub(busy),
        "slots_processing": busy,
        "requests_queued": app.shared.queued.load(Relaxed),
    }))
    .into_response()
}

fn yes() -> bool {
    true
}

/// llama-server's /tokenize.
#[derive(Deserialize)]
struct TokenizeRequest {
    content: String,
    /// Put the tokenizer's BOS first (as it does for a text).
    #[serde(default)]
    add_special: bool,
    /// Match special tokens in the text (always done).
    #[serde(default = "yes")]
    parse_special: bool,
    /// Each id with its text.
    #[serde(default)]
    with_pieces: bool,
}

/// llama-server's /detokenize.
#[derive(Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

/// Runs `f` on tokio's blocking pool (tokenizing and rendering are CPU work), holding
/// one of the per-core permits, so that no more run at once than there are cores.
async fn blocking<T: Send + 'static>(
    app: &App,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let permit = app
        .cpu
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::shutting_down())?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        f()
    })
    .await
    .map_err(|e| ApiError::internal(format!("a worker failed: {e}")))?
}

async fn tokenize(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let (req, _running): (TokenizeRequest, _) = json_body(&app, req).await?;
    if !req.parse_special {
        return Err(ApiError::invalid(
            "parse_special",
            "'parse_special' = false is not supported: special tokens in the text are always matched.",
        ));
    }
    let a = app.clone();
    let out = blocking(&app, move || {
        let tok = a.tokenizer();
        let ids = tok.encode_with(&req.content, req.add_special);
        Ok(if req.with_pieces {
            let pieces: Vec<serde_json::Value> = ids
                .iter()
                .map(|&id| {
                    let mut b = Vec::new();
                    tok.piece(id, &mut b);
                    let piece = match String::from_utf8(b) {
                        Ok(s) => json!(s),
                        Err(e) => json!(e.into_bytes()),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect();
            json!({ "tokens": pieces })
        } else {
            json!({ "tokens": ids })
        })
    })
    .await?;
    Ok(Json(out).into_response())
}

async fn detokenize(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let (req, _running): (DetokenizeRequest, _) = json_body(&app, req).await?;
    let n = app.tokenizer().n_vocab();
    if let Some((i, id)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= n)
    {
        return Err(ApiError::invalid(
            "tokens",
            format!("'tokens[{i}]' = {id}: ids must be below the tokenizer's vocabulary ({n})."),
        ));
    }
    let a = app.clone();
    let text = blocking(&app, move || {
        Ok(String::from_utf8_lossy(&a.tokenizer().decode(&req.tokens)).into_owned())
    })
    .await?;
    Ok(Json(json!({ "content": text })).into_response())
}

async fn chat(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    generate(app, Endpoint::Chat, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    generate(app, Endpoint::Completion, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A generation request: checked, queued for the model thread, answered whole or as
/// a stream once a slot has taken it.
async fn generate(
    app: Arc<App>,
    endpoint: Endpoint,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let (body, conn) = read_body(&app, req).await?;
    let running = conn.map(|c| c.running());
    if endpoint == Endpoint::Chat && app.chat.is_none() {
        return Err(app.no_template());
    }
    let mut req = api::parse(&body, endpoint, app.engine.config().vocab)?;
    if app.shared.draining.load(Relaxed) {
        return Err(ApiError::shutting_down());
    }
    let ticket = app
        .shared
        .ticket()
        .ok_or_else(|| ApiError::busy(app.parallel, app.queue))?;
    let a = app.clone();
    let format = structured::tool_format(app.chat.as_ref());
    if let (ToolFormat::Harmony, Prompt::Chat(messages, _)) = (format, &mut req.prompt) {
        messages.iter_mut().for_each(harmony::adjust_message);
    }
    let (req, ids, gen, constraint) = blocking(&app, move || {
        let ids = a.prompt_ids(&req)?;
        let gen = a.gen_options(&req, ids.len())?;
        let c = a
            .grammar
            .constraint(&req.structured, format, gen.max_tokens)?;
        Ok((req, ids, gen, c))
    })
    .await?;
    let (constraint, grammar_field) = constraint.map_or((None, None), |(c, f)| (Some(c), Some(f)));
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let meta = Meta {
        id: format!("{prefix}-{:016x}", app.next()),
        created: unix_now(),
        model: app.model.clone(),
        endpoint,
        logprobs: req.sampling.logprobs,
    };
    let (events, mut rx) = unbounded_channel();
    app.tx
        .send(Msg::Job(Box::new(Job {
            ids,
            work: Work::Generate(gen),
            constraint,
            grammar_field,
            events,
            label: endpoint.name(),
            ticket: Arc::new(ticket),
        })))
        .map_err(|_| ApiError::shutting_down())?;
    match rx.recv().await {
        Some(Event::Started) => {}
        Some(Event::Failed(e)) => return Err(e),
        _ => return Err(ApiError::internal("the model thread dropped the request")),
    }
    // Tool calls are read out of a chat's reply unless tool_choice is none; harmony's
    // channels always.
    let tools = match endpoint {
        Endpoint::Chat => req.structured.reader(format).map(|p| (p, format)),
        Endpoint::Completion => None,
    };
    if req.stream {
        Ok(stream_response(
            app,
            meta,
            req.include_usage,
            rx,
            running,
            tools,
        ))
    } else {
        collect(app, meta, rx, tools).await
    }
}

/// /v1/embeddings: each input is encoded (on the blocking pool), checked against the
/// context, and queued as a job of its own (sharing the request's queue place), so the
/// inputs run in any free slots, batched with the other requests' steps; the answer
/// comes when all are pooled.
async fn embeddings(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let (body, conn) = read_body(&app, req).await?;
    let _running = conn.map(|c| c.running());
    let c = app.engine.config();
    let req = embed_api::parse(&body, c.vocab, c.dim)?;
    // The request's budget, by bytes before encoding, by ids after.
    let over = |what: String| {
        ApiError::invalid(
            "input",
            format!(
                "The inputs {what}: at most {} tokens over all inputs of one request (--max-embed-tokens). Please send fewer or shorter inputs.",
                app.max_embed_tokens
            ),
        )
    };
    let bytes: usize = req.inputs.iter().map(Input::size).sum();
    if bytes > app.max_embed_bytes {
        return Err(over(format!(
            "have {bytes} bytes and token ids, which cannot encode to fewer tokens"
        )));
    }
    if app.shared.draining.load(Relaxed) {
        return Err(ApiError::shutting_down());
    }
    let ticket = Arc::new(
        app.shared
            .ticket()
            .ok_or_else(|| ApiError::busy(app.parallel, app.queue))?,
    );
    let a = app.clone();
    let (req, ids) = blocking(&app, move || {
        let ids = req
            .inputs
            .iter()
            .enumerate()
            .map(|(i, input)| a.embed_ids(i, input))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((req, ids))
    })
    .await?;
    let total: usize = ids.iter().map(Vec::len).sum();
    if total > app.max_embed_tokens {
        return Err(over(format!("have {total} tokens")));
    }
    let n = ids.len();
    let (events, mut rx) = unbounded_channel();
    for (index, ids) in ids.into_iter().enumerate() {
        app.tx
            .send(Msg::Job(Box::new(Job {
                ids,
                work: Work::Embed {
                    pooling: app.pooling,
                    index,
                },
                constraint: None,
                grammar_field: None,
                events: events.clone(),
                label: "embedding",
                ticket: ticket.clone(),
            })))
            .map_err(|_| ApiError::shutting_down())?;
    }
    drop(events);
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; n];
    let mut tokens = 0;
    let mut done = 0;
    while done < n {
        match rx.recv().await {
            Some(Event::Embedding {
                index,
                vector,
                tokens: t,
            }) => {
                vectors[index] = Some(embed_api::finish(&req, vector));
                tokens += t;
                done += 1;
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(_) => {}
            None => return Err(ApiError::internal("the model thread dropped the request")),
        }
    }
    let vectors: Vec<Vec<f32>> = vectors.into_iter().flatten().collect();
    Ok(Json(embed_api::response(&app.model, &req, &vectors, tokens)).into_response())
}

/// The whole answer of a request that does not stream.
async fn collect(
    app: Arc<App>,
    meta: Meta,
    mut rx: UnboundedReceiver<Event>,
    tools: Option<(ToolParser, ToolFormat)>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started => {}
            Event::Token { text: t, logprob } => {
                text.push_str(&t);
                lps.extend(logprob);
            }
            Event::Done {
                finish,
                usage,
                tail,
            } => {
                text.push_str(&tail);
                let lp = api::logprobs_json(&meta, app.tokenizer(), &lps, 0);
                let mut resp = api::response(&meta, &text, finish, &usage, lp);
                if let Some((mut p, format)) = tools {
                    let mut evs = p.push(&text);
                    evs.extend(p.finish());
                    let (mut content, mut reasoning) = (String::new(), String::new());
                    for e in evs {
                        match e {
                            ToolEvent::Content(t) => content.push_str(&t),
                            ToolEvent::Reasoning(t) => reasoning.push_str(&t),
                            ToolEvent::Start { .. } | ToolEvent::Arguments { .. } => {}
                        }
                    }
                    let calls: Vec<_> = p
                        .calls()
                        .iter()
                        .map(|c| (app.call_id(format), c.clone()))
                        .collect();
                    structured::read_message(&mut resp, content, reasoning, &calls);
                }
                return Ok(Json(resp).into_response());
            }
            Event::Failed(e) => return Err(e),
            Event::Embedding { .. } => {}
        }
    }
    Err(ApiError::internal("the model thread dropped the request"))
}

/// A stream's state between events.
struct Streaming {
    app: Arc<App>,
    meta: Meta,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
    /// Logprobs of tokens whose text has not been sent yet.
    lps: Vec<TokenLogprob>,
    /// Characters of completion text sent (the completions' `text_offset`).
    offset: usize,
    done: bool,
    /// Reads tool calls out of the text (tools given, tool_choice not none) or
    /// harmony's channels, with the ids of the calls begun and the ids' format.
    tools: Option<(ToolParser, Vec<String>, ToolFormat)>,
    /// The connection runs this request until the stream ends.
    _running: Option<Running>,
}

impl Streaming {
    /// The chunk carrying `text` and the pending logprobs.
    fn chunk(&mut self, text: &str, finish: Option<api::Finish>) -> String {
        let lp = api::logprobs_json(&self.meta, self.app.tokenizer(), &self.lps, self.offset);
        self.lps.clear();
        self.offset += text.chars().count();
        api::chunk(
            &self.meta,
            Some(text).filter(|t| !t.is_empty() || self.meta.endpoint == Endpoint::Completion),
            false,
            finish,
            lp,
            self.include_usage,
        )
        .to_string()
    }

    /// A chunk whose delta carries `tool_calls` (and the pending logprobs).
    fn tool_chunk(&mut self, calls: serde_json::Value) -> String {
        let lp = api::logprobs_json(&self.meta, self.app.tokenizer(), &self.lps, self.offset);
        self.lps.clear();
        let mut c = api::chunk(&self.meta, None, false, None, lp, self.include_usage);
        c["choices"][0]["delta"]["tool_calls"] = calls;
        c.to_string()
    }

    /// A chunk whose delta carries reasoning (`reasoning_content`, as llama-server and
    /// vLLM stream it) and the pending logprobs.
    fn reasoning_chunk(&mut self, text: &str) -> String {
        let lp = api::logprobs_json(&self.meta, self.app.tokenizer(), &self.lps, self.offset);
        self.lps.clear();
        let mut c = api::chunk(&self.meta, None, false, None, lp, self.include_usage);
        c["choices"][0]["delta"]["reasoning_content"] = json!(text);
        c.to_string()
    }

    /// The chunks of new reply text: as it is, or through the tool-call reader
    /// (`end`: the text is complete).
    fn text(&mut self, text: &str, end: bool) -> Vec<String> {
        let Some((p, _, _)) = &mut self.tools else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![self.chunk(text, None)]
            };
        };
        let mut evs = p.push(text);
        if end {
            evs.extend(p.finish());
        }
        let mut out = Vec::new();
        for ev in evs {
            match ev {
                ToolEvent::Content(t) => out.push(self.chunk(&t, None)),
                ToolEvent::Reasoning(t) => out.push(self.reasoning_chunk(&t)),
                ToolEvent::Start { index, name } => {
                    let Some((_, ids, format)) = &mut self.tools else {
                        continue;
                    };
                    let id = self.app.call_id(*format);
                    let delta = structured::start_delta(index, &id, &name);
                    ids.push(id);
                    out.push(self.tool_chunk(delta));
                }
                ToolEvent::Arguments { index, delta } => {
                    out.push(self.tool_chunk(structured::arguments_delta(index, &delta)))
                }
            }
        }
        out
    }

    /// The SSE data of one model event.
    fn on(&mut self, ev: Option<Event>) -> Vec<String> {
        match ev {
            Some(Event::Started | Event::Embedding { .. }) => Vec::new(),
            Some(Event::Token { text, logprob }) => {
                self.lps.extend(logprob);
                self.text(&text, false)
            }
            Some(Event::Done {
                finish,
                usage,
                tail,
            }) => {
                self.done = true;
                let mut out = Vec::new();
                match self.meta.endpoint {
                    Endpoint::Chat => {
                        out.extend(self.text(&tail, true));
                        let called = self
                            .tools
                            .as_ref()
                            .is_some_and(|(_, ids, _)| !ids.is_empty());
                        let finish = match finish {
                            api::Finish::Stop if called => api::Finish::ToolCalls,
                            f => f,
                        };
                        out.push(self.chunk("", Some(finish)));
                    }
                    Endpoint::Completion => out.push(self.chunk(&tail, Some(finish))),
                }
                if self.include_usage {
                    out.push(api::usage_chunk(&self.meta, &usage).to_string());
                }
                out.push("[DONE]".into());
                out
            }
            Some(Event::Failed(e)) => {
                self.done = true;
                vec![e.body().to_string(), "[DONE]".into()]
            }
            None => {
                self.done = true;
                let e = ApiError::internal("the model thread dropped the request");
                vec![e.body().to_string(), "[DONE]".into()]
            }
        }
    }
}

/// Server-sent events: OpenAI's chunks (the chat's first carries the role), ending in
/// `data: [DONE]`; an error after the stream has begun is an `{"error": ...}` event.
fn stream_response(
    app: Arc<App>,
    meta: Meta,
    include_usage: bool,
    rx: UnboundedReceiver<Event>,
    running: Option<Running>,
    tools: Option<(ToolParser, ToolFormat)>,
) -> Response {
    let head = match meta.endpoint {
        Endpoint::Chat => vec![api::chunk(
            &meta,
            Some(""),
            true,
            None,
            serde_json::Value::Null,
            include_usage,
        )
        .to_string()],
        Endpoint::Completion => Vec::new(),
    };
    let st = Streaming {
        app,
        meta,
        rx,
        include_usage,
        lps: Vec::new(),
        offset: 0,
        done: false,
        tools: tools.map(|(p, f)| (p, Vec::new(), f)),
        _running: running,
    };
    let body = stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let ev = st.rx.recv().await;
        let out = st.on(ev);
        Some((out, st))
    })
    .flat_map(stream::iter);
    let events = stream::iter(head)
        .chain(body)
        .map(|data| Ok::<_, Infallible>(SseEvent::default().data(data)));
    Sse::new(events).into_response()
}
