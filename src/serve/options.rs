//! [`ServeOptions`]: every option of mlb-serve, with its defaults and its check (the
//! binary only fills it in).

use std::path::PathBuf;
use std::time::Duration;

use super::error::ServeError;
use crate::model::StateOptions;
use crate::session::speculative::SpecOptions;
use crate::session::{ModelOptions, Pooling};

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
/// Ids over all inputs of one /v1/embeddings request (`--max-embed-tokens` default).
pub const DEFAULT_MAX_EMBED_TOKENS: usize = 65_536;
/// A prompt's text may have at most this many bytes per position of the context times
/// the tokenizer's longest token before it is refused unencoded (no text of that size
/// can encode to fewer ids than the context has positions).
pub const PROMPT_BYTES_SLACK: usize = 4;

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
    /// Connections open at once (then kept `conn::FD_RESERVE` below the descriptor
    /// limit).
    pub max_connections: usize,
    /// How long a connection may take to send a request head (also the keep-alive idle
    /// timeout).
    pub header_timeout: Duration,
    /// How long a handler waits for a request's whole body (then 408).
    pub body_timeout: Duration,
    /// Fuel of one chat template rendering (`chat::budget`).
    pub template_fuel: u64,
    /// How /v1/embeddings pools hidden states (`--pooling`; `None`: the model's).
    pub pooling: Option<Pooling>,
    /// Speculative decoding (`--lookup`, `--draft MODEL.mlb`), off by default.
    pub spec: Option<SpecOptions>,
    /// Most ids over all inputs of one /v1/embeddings request (more: 400).
    pub max_embed_tokens: usize,
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
            pooling: None,
            spec: None,
            max_embed_tokens: DEFAULT_MAX_EMBED_TOKENS,
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
        if let Some(s) = &self.spec {
            s.validate()?;
        }
        if self.queue > MAX_QUEUE {
            return bad(
                "--queue",
                self.queue.to_string(),
                &format!("at most {MAX_QUEUE}"),
            );
        }
        if self.max_embed_tokens == 0 {
            return bad("--max-embed-tokens", "0".into(), "at least 1");
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
    pub(super) fn session_options(&self) -> StateOptions {
        StateOptions {
            spare: self.spec.as_ref().map_or(0, SpecOptions::spare),
            ..self.model.session_options(self.prefill_chunk)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::KvType;
    use crate::session::SessionError;

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
}
