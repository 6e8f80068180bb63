//! The OpenAI-compatible JSON of mlb-serve: requests read and checked into a
//! [`Request`], responses, stream chunks and errors built as OpenAI's API shapes them
//! (`openai-python`'s `ChatCompletion`, `ChatCompletionChunk`, `Completion`,
//! `CompletionUsage`, `ChatCompletionTokenLogprob`; errors as
//! `{"error": {"message", "type", "param", "code"}}`).
//!
//! Unknown request fields are ignored (as llama-server and vLLM do); known fields the
//! server cannot honour (`n` > 1, `functions`, `echo`, `suffix`, `best_of` > 1) are
//! refused with a 400 naming the field, never silently dropped. The fields that shape
//! the output (`response_format`, `grammar`, `regex`, `tools`, `tool_choice`,
//! `parallel_tool_calls`) are read in `structured`.

use std::fmt;

use axum::http::StatusCode;
use minijinja::value::ValueKind;
use serde::Deserialize;
use serde_json::{json, Value as Json};

use super::structured::{self, Structured, StructuredError};
use crate::chat::tools::normalize_tool_calls;
use crate::chat::{ChatError, Message, RenderOptions, Value};
use crate::model::SamplerOptions;
use crate::tokenizer::Tokenizer;

/// Most stop strings a request may give.
pub const MAX_STOP: usize = 16;
/// Most alternatives per token in `top_logprobs` (chat; OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most alternatives per token in a completion's `logprobs` (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;
/// `max_tokens` of /v1/completions when the request gives none (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// An error answered as OpenAI answers it: a status and
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503: busy or shutting down).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            code: Some("invalid_value"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// An `invalid_request_error` with any status.
    pub fn new_status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError::new(status, "invalid_request_error", message)
    }

    /// 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn missing(param: &str) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            code: Some("missing_required_parameter"),
            ..ApiError::bad_request(format!("Missing required parameter: '{param}'."))
        }
    }

    /// 400: the prompt and the tokens asked for do not fit the context.
    pub fn context(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            code: Some("context_length_exceeded"),
            ..ApiError::bad_request(message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    pub fn method_not_allowed(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            code: Some("request_too_large"),
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("The request body is larger than this server takes ({limit} bytes)."),
            )
        }
    }

    pub fn unauthorized(given: bool) -> ApiError {
        if given {
            ApiError {
                code: Some("invalid_api_key"),
                ..ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid_request_error",
                    "Incorrect API key provided.",
                )
            }
        } else {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        }
    }

    /// 503 with `Retry-After`: every slot and queue place is taken.
    pub fn busy(slots: usize, queue: usize) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!(
                    "The server is busy ({slots} slots and {queue} queue places taken); please try again later."
                ),
            )
        }
    }

    /// 503: the server is shutting down.
    pub fn shutting_down() -> ApiError {
        ApiError {
            retry_after: Some(5),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "The server is shutting down.",
            )
        }
    }

    /// 500: something failed inside the server (the message says what).
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> Json {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<StructuredError> for ApiError {
    fn from(e: StructuredError) -> ApiError {
        match e {
            StructuredError::Field {
                param,
                message,
                code,
            } => ApiError {
                code: Some(code),
                ..ApiError::invalid(&param, message)
            },
            StructuredError::Engine(message) => ApiError::internal(message),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

/// Which generation endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// POST /v1/chat/completions
    Chat,
    /// POST /v1/completions
    Completion,
}

impl Endpoint {
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
        }
    }
}

/// Where a request's prompt comes from.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// A conversation for the model's chat template.
    Chat(Vec<Message>, RenderOptions),
    /// Text, encoded as the tokenizer encodes a text (with its BOS, if it adds one).
    Text(String),
    /// Token ids as given.
    Ids(Vec<u32>),
}

/// A generation request, read and checked.
#[derive(Debug, Clone)]
pub struct Request {
    pub endpoint: Endpoint,
    pub prompt: Prompt,
    /// `None`: the endpoint's default.
    pub max_tokens: Option<usize>,
    pub sampling: SamplerOptions,
    /// Whether `seed` was given (otherwise the server picks one).
    pub seeded: bool,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// The output's format and the tools (`structured`).
    pub structured: Structured,
}

/// The fields of both endpoints as JSON gives them (checked in [`parse`]). Fields with
/// several shapes (`prompt`, `stop`, `logprobs`) are read as JSON values.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Fields {
    #[allow(dead_code)]
    model: Option<String>,
    messages: Option<Json>,
    prompt: Option<Json>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<Json>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    logprobs: Option<Json>,
    top_logprobs: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    echo: Option<bool>,
    best_of: Option<i64>,
    suffix: Option<String>,
    tools: Option<Json>,
    tool_choice: Option<Json>,
    parallel_tool_calls: Option<bool>,
    functions: Option<Json>,
    response_format: Option<Json>,
    grammar: Option<Json>,
    regex: Option<Json>,
    reasoning_effort: Option<Json>,
    chat_template_kwargs: Option<serde_json::Map<String, Json>>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The parts of a chat request that go to the template, read a second time as template
/// values (which keep the key order of the JSON, as Python's dicts do).
#[derive(Deserialize)]
struct ChatParts {
    messages: Value,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<Value>,
    #[serde(default)]
    reasoning_effort: Option<Value>,
}

/// A body that is not the JSON the endpoint takes, as OpenAI words it.
fn json_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if !inner.is_data() {
        return ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {inner}. The API expects a JSON object."
        ));
    }
    // A top-level list reaches serde's sequence form of a struct: its path is `[i]`.
    if path == "." || path.is_empty() || path.starts_with('[') {
        return ApiError::bad_request(format!("The request body must be a JSON object ({inner})."));
    }
    ApiError {
        code: Some("invalid_type"),
        ..ApiError::invalid(&path, format!("Invalid type for '{path}': {inner}."))
    }
}

/// Reads a JSON body into `T`, naming the field of a type error.
pub fn from_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let v = serde_path_to_error::deserialize(&mut de).map_err(json_error)?;
    de.end().map_err(|e| {
        ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {e}."
        ))
    })?;
    Ok(v)
}

/// A number field within `lo..=hi` (default `def`).
fn ranged(name: &str, v: Option<f64>, def: f32, lo: f64, hi: f64) -> Result<f32, ApiError> {
    match v {
        None => Ok(def),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x as f32),
        Some(x) => Err(ApiError::invalid(
            name,
            format!("'{name}' = {x}: must be between {lo} and {hi}."),
        )),
    }
}

/// `stop`: null, a string, or a list of strings (empty strings ignored).
fn stop_strings(v: Option<&Json>) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Json> = match v {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::String(s)) if s.is_empty() => return Ok(Vec::new()),
        Some(Json::String(s)) => return Ok(vec![s.clone()]),
        Some(Json::Array(a)) => a.iter().collect(),
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!("'stop' = {other}: must be a string or a list of strings."),
            ))
        }
    };
    if list.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("'stop' has {} strings: at most {MAX_STOP}.", list.len()),
        ));
    }
    let mut out = Vec::new();
    for (i, s) in list.into_iter().enumerate() {
        match s {
            Json::String(s) if s.is_empty() => {}
            Json::String(s) => out.push(s.clone()),
            other => {
                return Err(ApiError::invalid(
                    "stop",
                    format!("'stop[{i}]' = {other}: must be a string."),
                ))
            }
        }
    }
    Ok(out)
}

/// `prompt` of /v1/completions: a string, a list of one string, a list of token ids, or
/// a list of one list of ids.
fn prompt_of(v: Option<&Json>) -> Result<Prompt, ApiError> {
    let ids = |a: &[Json]| -> Option<Vec<u32>> {
        a.iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    let one = || ApiError::invalid("prompt", "Only one prompt per request is supported.");
    match v {
        None | Some(Json::Null) => Err(ApiError::missing("prompt")),
        Some(Json::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Json::Array(a)) => match a.as_slice() {
            [] => Err(ApiError::invalid("prompt", "'prompt' is an empty list.")),
            [Json::String(s)] => Ok(Prompt::Text(s.clone())),
            [Json::Array(inner)] => ids(inner).map(Prompt::Ids).ok_or_else(|| {
                ApiError::invalid("prompt", "'prompt' must be a list of token ids (integers).")
            }),
            [Json::String(_) | Json::Array(_), ..] => Err(one()),
            _ => ids(a).map(Prompt::Ids).ok_or_else(|| {
                ApiError::invalid(
                    "prompt",
                    "'prompt' must be a string, a list of token ids, or a list of one of them.",
                )
            }),
        },
        Some(other) => Err(ApiError::invalid(
            "prompt",
            format!("'prompt' = {other}: must be a string or a list of token ids."),
        )),
    }
}

/// A chat template error. The template compiled at start, and the request's messages
/// were checked before rendering, so a template that raises or fails on this
/// conversation refuses the request: 400 about `messages`; a rendering longer than the
/// context can hold: 400 `context_length_exceeded`. A template that runs out of its
/// render budget (fuel) on a request the context can hold is the template's fault: 500.
pub fn chat_error(e: &ChatError) -> ApiError {
    match e {
        ChatError::Input { field, .. } => ApiError::invalid(field, e.to_string()),
        ChatError::Raised { .. } | ChatError::Render { .. } => {
            ApiError::invalid("messages", e.to_string())
        }
        ChatError::TooLong { .. } => ApiError::context("messages", e.to_string()),
        ChatError::NoTemplate { .. } => ApiError::not_found(e.to_string()),
        ChatError::Budget { .. } => ApiError {
            code: Some("template_budget_exceeded"),
            ..ApiError::internal(e.to_string())
        },
        ChatError::Syntax { .. } => ApiError::internal(e.to_string()),
    }
}

/// 400 `invalid_type` about one field.
fn invalid_type(param: &str, message: String) -> ApiError {
    ApiError {
        code: Some("invalid_type"),
        ..ApiError::invalid(param, message)
    }
}

/// Checks a message's shape as OpenAI does before the template sees it: `content` is a
/// string, a list of parts, or (an assistant's, beside `tool_calls` or
/// `function_call`) null or absent; `name` is a string; `tool_calls` a list.
fn check_shape(m: &Message, field: &str) -> Result<(), ApiError> {
    let given = |k: &str| m.get(k).filter(|v| !v.is_none() && !v.is_undefined());
    for (key, kind, what) in [
        ("name", ValueKind::String, "a string"),
        ("tool_calls", ValueKind::Seq, "a list"),
        ("tool_call_id", ValueKind::String, "a string"),
    ] {
        if let Some(v) = given(key).filter(|v| v.kind() != kind) {
            return Err(invalid_type(
                &format!("{field}.{key}"),
                format!(
                    "Invalid type for '{field}.{key}': expected {what}, got {}.",
                    v.kind()
                ),
            ));
        }
    }
    match given("content") {
        None => {
            let calls = given("tool_calls").is_some() || given("function_call").is_some();
            if m.role() == "assistant" && calls {
                Ok(())
            } else {
                Err(ApiError {
                    param: Some(format!("{field}.content")),
                    code: Some("missing_required_parameter"),
                    ..ApiError::bad_request(format!(
                        "Missing required parameter: '{field}.content' (only an assistant message with 'tool_calls' may leave it out or null)."
                    ))
                })
            }
        }
        Some(c) if matches!(c.kind(), ValueKind::String | ValueKind::Seq) => Ok(()),
        Some(c) => Err(invalid_type(
            &format!("{field}.content"),
            format!(
                "Invalid type for '{field}.content': expected a string or a list of content parts, got {} ({c}).",
                c.kind()
            ),
        )),
    }
}

/// One message as the template gets it; content given as a list of text parts becomes
/// their texts joined by newlines (other parts are refused).
fn message(v: &Value, i: usize) -> Result<Message, ApiError> {
    let field = format!("messages[{i}]");
    let mut m = Message::from_value(v, &field).map_err(|e| chat_error(&e))?;
    check_shape(&m, &field)?;
    normalize_tool_calls(&mut m);
    if let Some(c) = m
        .get("content")
        .filter(|c| c.kind() == ValueKind::Seq)
        .cloned()
    {
        let mut texts = Vec::new();
        for (j, part) in c
            .try_iter()
            .map_err(|e| ApiError::invalid(&field, e.to_string()))?
            .enumerate()
        {
            let get = |k: &str| part.get_attr(k).ok().filter(|x| !x.is_undefined());
            let kind = get("type").map(|t| t.to_string()).unwrap_or_default();
            match (kind.as_str(), get("text").and_then(|t| t.as_str().map(str::to_string))) {
                ("text", Some(t)) => texts.push(t),
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{field}.content[{j}]"),
                        format!(
                            "'{field}.content[{j}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, not type '{kind}'."
                        ),
                    ))
                }
            }
        }
        m.set("content", Value::from(texts.join("\n")));
    }
    Ok(m)
}

/// Reads and checks a generation request for `endpoint` (`vocab`: the model's, for
/// token ids and logit biases).
pub fn parse(body: &[u8], endpoint: Endpoint, vocab: usize) -> Result<Request, ApiError> {
    let f: Fields = from_json(body)?;
    if let Some(n) = f.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            format!("'n' = {n}: this server makes one choice per request (n = 1)."),
        ));
    }
    let structured = structured::parse(
        &structured::Fields {
            response_format: f.response_format.as_ref(),
            grammar: f.grammar.as_ref(),
            regex: f.regex.as_ref(),
            tools: f.tools.as_ref(),
            tool_choice: f.tool_choice.as_ref(),
            parallel_tool_calls: f.parallel_tool_calls,
            reasoning_effort: f.reasoning_effort.as_ref(),
            chat_template_kwargs: f.chat_template_kwargs.as_ref(),
        },
        endpoint == Endpoint::Chat,
    )?;
    let prompt = match endpoint {
        Endpoint::Chat => {
            match &f.messages {
                None | Some(Json::Null) => return Err(ApiError::missing("messages")),
                Some(Json::Array(a)) if a.is_empty() => {
                    return Err(ApiError::invalid(
                        "messages",
                        "'messages' is an empty list.",
                    ))
                }
                Some(Json::Array(_)) => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        "messages",
                        format!("'messages' must be a list of message objects, not {other}."),
                    ))
                }
            }
            if f.functions
                .as_ref()
                .is_some_and(|t| !t.is_null() && t != &json!([]))
            {
                return Err(ApiError::invalid(
                    "functions",
                    "'functions' (deprecated) is not supported: give 'tools'.",
                ));
            }
            let parts: ChatParts = from_json(body)?;
            let mut messages = Vec::new();
            for (i, m) in parts
                .messages
                .try_iter()
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?
                .enumerate()
            {
                messages.push(message(&m, i)?);
            }
            let cont = f.continue_final_message.unwrap_or(false);
            let mut opts = RenderOptions {
                add_generation_prompt: f.add_generation_prompt.unwrap_or(!cont),
                continue_final_message: cont,
                ..RenderOptions::default()
            };
            if opts.add_generation_prompt && cont {
                return Err(ApiError::invalid(
                    "continue_final_message",
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                ));
            }
            // As transformers passes them: `tools` as given; the choice and parallelism,
            // which only some templates read, as template variables when given.
            if structured.tools.is_some() {
                opts.tools = parts.tools;
            }
            if let Some(kw) = parts.chat_template_kwargs.filter(|k| !k.is_none()) {
                if kw.kind() != ValueKind::Map {
                    return Err(ApiError::invalid(
                        "chat_template_kwargs",
                        "'chat_template_kwargs' must be an object.",
                    ));
                }
                for key in kw
                    .try_iter()
                    .map_err(|e| ApiError::invalid("chat_template_kwargs", e.to_string()))?
                {
                    if let Some(k) = key.as_str() {
                        opts.set(k, kw.get_item(&key).unwrap_or_default());
                    }
                }
            }
            // OpenAI's `reasoning_effort` is gpt-oss's template variable of that name
            // (as vLLM passes it); other templates do not read it. The top-level fields
            // are set after the kwargs, so they win over a kwarg of the same name, as
            // the grammar reads them (`structured::reasoning_effort`).
            for (k, v) in [
                ("tool_choice", parts.tool_choice),
                ("parallel_tool_calls", parts.parallel_tool_calls),
                ("reasoning_effort", parts.reasoning_effort),
            ] {
                if let Some(v) = v.filter(|v| !v.is_none()) {
                    opts.set(k, v);
                }
            }
            Prompt::Chat(messages, opts)
        }
        Endpoint::Completion => {
            if f.echo == Some(true) {
                return Err(ApiError::invalid("echo", "'echo' is not supported."));
            }
            if f.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
                return Err(ApiError::invalid("suffix", "'suffix' is not supported."));
            }
            if let Some(b) = f.best_of.filter(|&b| b != 1) {
                return Err(ApiError::invalid(
                    "best_of",
                    format!(
                        "'best_of' = {b}: this server makes one choice per request (best_of = 1)."
                    ),
                ));
            }
            let p = prompt_of(f.prompt.as_ref())?;
            if let Prompt::Ids(ids) = &p {
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab)
                {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!("'prompt[{i}]' = {id}: token ids must be below the model's vocabulary ({vocab})."),
                    ));
                }
            }
            p
        }
    };
    let (max_name, max) = match endpoint {
        Endpoint::Chat => match f.max_completion_tokens {
            Some(m) => ("max_completion_tokens", Some(m)),
            None => ("max_tokens", f.max_tokens),
        },
        Endpoint::Completion => ("max_tokens", f.max_tokens),
    };
    let max_tokens = match max {
        None => None,
        Some(m) if m >= 1 => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        Some(m) => {
            return Err(ApiError::invalid(
                max_name,
                format!("'{max_name}' = {m}: must be at least 1."),
            ))
        }
    };
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("'top_k' = {k}: must be at least 1 (0 or -1: no limit)."),
            ))
        }
    };
    let top_p = match f.top_p {
        Some(p) if !(p > 0.0 && p <= 1.0) => {
            return Err(ApiError::invalid(
                "top_p",
                format!("'top_p' = {p}: must be above 0 and at most 1."),
            ))
        }
        p => p.unwrap_or(1.0) as f32,
    };
    let repeat = match f.repetition_penalty {
        Some(r) if !(r > 0.0 && r.is_finite()) => {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("'repetition_penalty' = {r}: must be above 0 (1: off)."),
            ))
        }
        r => r.unwrap_or(1.0) as f32,
    };
    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Chat => {
            let on = match &f.logprobs {
                None | Some(Json::Null) => false,
                Some(Json::Bool(b)) => *b,
                Some(other) => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!("'logprobs' = {other}: must be true or false."),
                    ))
                }
            };
            let top = match f.top_logprobs {
                None => 0,
                Some(t) if (0..=MAX_TOP_LOGPROBS as i64).contains(&t) => t as usize,
                Some(t) => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        format!("'top_logprobs' = {t}: must be between 0 and {MAX_TOP_LOGPROBS}."),
                    ))
                }
            };
            if top > 0 && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs' set to true.",
                ));
            }
            (on, top)
        }
        Endpoint::Completion => match &f.logprobs {
            None | Some(Json::Null) => (false, 0),
            Some(v) => match v.as_u64().filter(|&n| n <= MAX_COMPLETION_LOGPROBS as u64) {
                Some(n) => (true, n as usize),
                None => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!("'logprobs' = {v}: must be an integer between 0 and {MAX_COMPLETION_LOGPROBS}."),
                    ))
                }
            },
        },
    };
    let mut logit_bias = Vec::new();
    for (k, &b) in f.logit_bias.iter().flatten() {
        let id = k.parse::<u32>().ok().filter(|&id| (id as usize) < vocab).ok_or_else(|| {
            ApiError::invalid(
                "logit_bias",
                format!("'logit_bias' key '{k}': must be a token id below the model's vocabulary ({vocab})."),
            )
        })?;
        if !(-100.0..=100.0).contains(&b) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("'logit_bias' of {k} = {b}: must be between -100 and 100."),
            ));
        }
        logit_bias.push((id, b as f32));
    }
    let sampling = SamplerOptions {
        temp: ranged("temperature", f.temperature, 1.0, 0.0, 2.0)?,
        top_k,
        top_p,
        min_p: ranged("min_p", f.min_p, 0.0, 0.0, 1.0)?,
        seed: f.seed.unwrap_or(0) as u64,
        repeat_penalty: repeat,
        presence_penalty: ranged("presence_penalty", f.presence_penalty, 0.0, -2.0, 2.0)?,
        frequency_penalty: ranged("frequency_penalty", f.frequency_penalty, 0.0, -2.0, 2.0)?,
        logit_bias,
        logprobs,
        top_logprobs,
        ..SamplerOptions::default()
    };
    let stream = f.stream.unwrap_or(false);
    Ok(Request {
        endpoint,
        prompt,
        max_tokens,
        sampling,
        seeded: f.seed.is_some(),
        stop: stop_strings(f.stop.as_ref())?,
        stream,
        include_usage: stream
            && f.stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        structured,
    })
}

/// Why a generation ended, as `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    /// The reply ended after tool calls.
    ToolCalls,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// A sampled token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt: usize,
    pub completion: usize,
    /// Prompt tokens the slot already held (not computed again).
    pub cached: usize,
}

impl Usage {
    pub fn json(&self) -> Json {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// What every response object of one request repeats.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    /// Logprobs asked for (the shape of the `logprobs` field).
    pub logprobs: bool,
}

/// A token's text for logprobs: its bytes, as text (invalid UTF-8 replaced) and as a
/// list of byte values.
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let mut b = Vec::new();
    tok.piece(id, &mut b);
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// The `logprobs` of a choice (or a chunk) holding these tokens: `null` when not asked
/// for; chat: `{"content": [...], "refusal": null}`; completions: `{"tokens",
/// "token_logprobs", "top_logprobs", "text_offset"}` (`offset`: the characters of
/// completion text before the first of them).
pub fn logprobs_json(meta: &Meta, tok: &Tokenizer, lps: &[TokenLogprob], offset: usize) -> Json {
    if !meta.logprobs {
        return Json::Null;
    }
    match meta.endpoint {
        Endpoint::Chat => {
            let content: Vec<Json> = lps
                .iter()
                .map(|lp| {
                    let (text, bytes) = token_text(tok, lp.id);
                    let top: Vec<Json> = lp
                        .top
                        .iter()
                        .map(|&(id, l)| {
                            let (t, b) = token_text(tok, id);
                            json!({"token": t, "logprob": l, "bytes": b})
                        })
                        .collect();
                    json!({"token": text, "logprob": lp.logprob, "bytes": bytes, "top_logprobs": top})
                })
                .collect();
            json!({"content": content, "refusal": null})
        }
        Endpoint::Completion => {
            let mut tokens = Vec::new();
            let mut values = Vec::new();
            let mut tops = Vec::new();
            let mut offsets = Vec::new();
            let mut at = offset;
            for lp in lps {
                let (text, _) = token_text(tok, lp.id);
                offsets.push(at);
                at += text.chars().count();
                tokens.push(text);
                values.push(lp.logprob);
                let top: serde_json::Map<String, Json> = lp
                    .top
                    .iter()
                    .map(|&(id, l)| (token_text(tok, id).0, json!(l)))
                    .collect();
                tops.push(Json::Object(top));
            }
            json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
        }
    }
}

/// The whole response of a request that did not stream.
pub fn response(meta: &Meta, text: &str, finish: Finish, usage: &Usage, logprobs: Json) -> Json {
    match meta.endpoint {
        Endpoint::Chat => json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": logprobs,
                "finish_reason": finish.as_str(),
            }],
            "usage": usage.json(),
        }),
        Endpoint::Completion => json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{
                "text": text,
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": finish.as_str(),
            }],
            "usage": usage.json(),
        }),
    }
}

/// One stream chunk: `text` (chat: a delta; `role`: the first chunk's), the finish
/// reason on the last; with `include_usage`, `"usage": null` (the usage comes in a
/// chunk of its own, [`usage_chunk`]).
pub fn chunk(
    meta: &Meta,
    text: Option<&str>,
    role: bool,
    finish: Option<Finish>,
    logprobs: Json,
    include_usage: bool,
) -> Json {
    let finish = finish.map(Finish::as_str);
    let mut c = match meta.endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "id": meta.id,
                "object": "chat.completion.chunk",
                "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
        Endpoint::Completion => json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{"text": text.unwrap_or(""), "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        }),
    };
    if include_usage {
        c["usage"] = Json::Null;
    }
    c
}

/// The last chunk of a stream with `stream_options.include_usage`: no choices, the usage.
pub fn usage_chunk(meta: &Meta, usage: &Usage) -> Json {
    let object = match meta.endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completion => "text_completion",
    };
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage.json(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Request, ApiError> {
        parse(body.as_bytes(), Endpoint::Chat, 100)
    }

    fn completion(body: &str) -> Result<Request, ApiError> {
        parse(body.as_bytes(), Endpoint::Completion, 100)
    }

    fn param(r: Result<Request, ApiError>) -> Option<String> {
        let e = r.expect_err("refused");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{e}");
        e.param
    }

    #[test]
    fn a_chat_request_with_every_field() {
        let r = chat(
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                "min_p": 0.1, "seed": -1, "stop": ["x", ""], "presence_penalty": 1, "frequency_penalty": -1,
                "logit_bias": {"3": -100}, "logprobs": true, "top_logprobs": 2, "stream": true,
                "stream_options": {"include_usage": true}, "n": 1, "tools": [], "unknown": {"a": 1},
                "chat_template_kwargs": {"enable_thinking": false}}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.sampling.temp, 0.5);
        assert_eq!(r.sampling.top_k, 5);
        assert_eq!(r.sampling.seed, u64::MAX);
        assert!(r.seeded && r.stream && r.include_usage);
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert_eq!(r.sampling.logit_bias, vec![(3, -100.0)]);
        assert!(r.sampling.logprobs);
        assert_eq!(r.sampling.top_logprobs, 2);
        let Prompt::Chat(m, o) = r.prompt else {
            panic!()
        };
        assert_eq!(m[0].content(), Some("a\nb"));
        assert!(o.add_generation_prompt);
        assert_eq!(o.kwargs[0].0, "enable_thinking");
    }

    /// `reasoning_effort` from the top level or `chat_template_kwargs`, the top level
    /// first: the template and the grammar framing see the same value.
    #[test]
    fn reasoning_effort_from_either_place() {
        let msgs = r#""messages": [{"role": "user", "content": "x"}]"#;
        for (fields, want) in [
            (r#""reasoning_effort": "none""#, Some("none")),
            (
                r#""chat_template_kwargs": {"reasoning_effort": "none"}"#,
                Some("none"),
            ),
            (
                r#""reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "none"}"#,
                Some("low"),
            ),
            (
                r#""reasoning_effort": null, "chat_template_kwargs": {"reasoning_effort": "none"}"#,
                Some("none"),
            ),
            (
                r#""chat_template_kwargs": {"enable_thinking": false}"#,
                None,
            ),
        ] {
            let r = chat(&format!("{{{msgs}, {fields}}}")).unwrap();
            let Prompt::Chat(_, o) = &r.prompt else {
                panic!()
            };
            let template = o
                .kwargs
                .iter()
                .find(|(k, _)| k == "reasoning_effort")
                .map(|(_, v)| v.to_string());
            assert_eq!(template.as_deref(), want, "{fields}");
            assert_eq!(r.structured.reasoning, want != Some("none"), "{fields}");
        }
    }

    #[test]
    fn completion_prompts() {
        let ids = |b: &str| match completion(b).unwrap().prompt {
            Prompt::Ids(i) => i,
            p => panic!("{p:?}"),
        };
        assert_eq!(ids(r#"{"prompt": [1, 2]}"#), vec![1, 2]);
        assert_eq!(ids(r#"{"prompt": [[3]]}"#), vec![3]);
        assert!(
            matches!(completion(r#"{"prompt": ["t"]}"#).unwrap().prompt, Prompt::Text(t) if t == "t")
        );
        let r = completion(r#"{"prompt": "t", "logprobs": 2}"#).unwrap();
        assert!(r.sampling.logprobs && r.sampling.top_logprobs == 2);
        assert_eq!(r.sampling.temp, 1.0);
        assert!(!r.seeded && !r.include_usage);
    }

    #[test]
    fn refusals_name_the_field() {
        // One bad field beside a valid message.
        for (field, want) in [
            (r#""max_tokens": 0"#, "max_tokens"),
            (r#""max_tokens": "5""#, "max_tokens"),
            (r#""temperature": 3"#, "temperature"),
            (r#""top_p": 0"#, "top_p"),
            (r#""top_k": -2"#, "top_k"),
            (r#""n": 2"#, "n"),
            (r#""stop": 3"#, "stop"),
            (r#""stop": ["a", 1]"#, "stop"),
            (r#""logprobs": 1"#, "logprobs"),
            (r#""top_logprobs": 2"#, "top_logprobs"),
            (r#""logit_bias": {"a": 1}"#, "logit_bias"),
            (r#""logit_bias": {"100": 1}"#, "logit_bias"),
            (r#""tools": [{"type": "function"}]"#, "tools[0].function"),
            (r#""functions": [{"name": "f"}]"#, "functions"),
            (r#""stream": "yes""#, "stream"),
        ] {
            let body = format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {field}}}"#);
            assert_eq!(param(chat(&body)).as_deref(), Some(want), "{body}");
        }
        for (body, want) in [
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                "messages[0].content[0]",
            ),
            (r#"{"messages": [{"content": "x"}]}"#, "messages[0].role"),
            (r#"{"messages": []}"#, "messages"),
            (r#"{"messages": "hi"}"#, "messages"),
            (r#"{}"#, "messages"),
        ] {
            assert_eq!(param(chat(body)).as_deref(), Some(want), "{body}");
        }
        for (body, want) in [
            (r#"{}"#, "prompt"),
            (r#"{"prompt": ["a", "b"]}"#, "prompt"),
            (r#"{"prompt": [1, 100]}"#, "prompt"),
            (r#"{"prompt": [1, -1]}"#, "prompt"),
            (r#"{"prompt": "a", "echo": true}"#, "echo"),
            (r#"{"prompt": "a", "logprobs": 6}"#, "logprobs"),
            (r#"{"prompt": "a", "max_tokens": -1}"#, "max_tokens"),
        ] {
            assert_eq!(param(completion(body)).as_deref(), Some(want), "{body}");
        }
        // Not JSON, not an object, trailing bytes: no field to name.
        for body in ["{", "[1]", "{} x", ""] {
            let e = completion(body).unwrap_err();
            assert_eq!(
                (e.status, e.param),
                (StatusCode::BAD_REQUEST, None),
                "{body}"
            );
        }
    }

    #[test]
    fn error_bodies_have_openais_shape() {
        let e = ApiError::missing("messages");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "Missing required parameter: 'messages'.",
                "type": "invalid_request_error", "param": "messages", "code": "missing_required_parameter"}})
        );
        assert_eq!(ApiError::busy(1, 2).retry_after, Some(1));
    }
}
