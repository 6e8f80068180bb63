//! [`ModelOptions`]: the options every tool over the session API shares (which model,
//! which tokenizer, how it loads, how each session is sized, how many threads), with
//! their defaults, their check, and how they become the engine's and the sessions'
//! options. `mlb-run`'s [`RunOptions`](crate::tools::run::options::RunOptions) and
//! `mlb-serve`'s [`ServeOptions`](crate::serve::ServeOptions) embed it as `model`.

use std::path::PathBuf;

use super::engine::{Engine, LoadOptions, TokenizerSource};
use super::error::SessionError;
use crate::kernels::{pool, HalfActs};
use crate::model::{KvType, StateOptions};

/// Which model and tokenizer, how they load and how their sessions run.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    /// The `.mlb` file.
    pub path: PathBuf,
    /// `None`: the `.mlt` of the same name beside the model.
    pub tokenizer: Option<PathBuf>,
    /// KV positions per session; `None`: max_seq capped at 4096 (512 for a
    /// measurement of mlb-run).
    pub ctx: Option<usize>,
    /// Worker threads; `None`: all cores.
    pub threads: Option<usize>,
    /// How the KV cache stores keys and values.
    pub kv_type: KvType,
    /// Pack the weights for the tier's packed kernels.
    pub pack: bool,
    /// What BF16 matrices multiply (`--bf16-activations`).
    pub half_acts: HalfActs,
}

impl ModelOptions {
    /// The defaults for `path`: the tokenizer beside it, packed, f32 everywhere.
    pub fn new(path: impl Into<PathBuf>) -> ModelOptions {
        ModelOptions {
            path: path.into(),
            tokenizer: None,
            ctx: None,
            threads: None,
            kv_type: KvType::F32,
            pack: true,
            half_acts: HalfActs::F32,
        }
    }

    /// Checks what can be checked without the files (`--threads`).
    pub fn validate(&self) -> Result<(), SessionError> {
        let bad = |value: String, rule| SessionError::BadOption {
            name: "--threads",
            value,
            rule,
        };
        match self.threads {
            Some(0) => Err(bad("0".into(), "at least one thread is needed")),
            Some(t) if t > pool::MAX_THREADS => Err(bad(t.to_string(), "at most 1024")),
            _ => Ok(()),
        }
    }

    /// Sizes the worker pool (`threads`, before its first use); returns its note when
    /// it runs fewer threads than asked for.
    pub fn start_pool(&self) -> Option<String> {
        if let Some(t) = self.threads {
            pool::set_threads(t);
        }
        pool::global().shortfall()
    }

    /// The tokenizer file: `tokenizer`, else the `.mlt` beside the model.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.tokenizer
            .clone()
            .unwrap_or_else(|| self.path.with_extension("mlt"))
    }

    /// How [`Engine::load`] loads the model: the tokenizer from `tokenizer` (which must
    /// load), else the one beside the model if there is one.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            model: self.path.clone(),
            tokenizer: match &self.tokenizer {
                Some(p) => TokenizerSource::File(p.clone()),
                None => TokenizerSource::Beside,
            },
            pack: self.pack,
            half_acts: self.half_acts,
        }
    }

    /// Loads the model ([`ModelOptions::load_options`]).
    pub fn load(&self) -> Result<Engine, SessionError> {
        Engine::load(&self.load_options())
    }

    /// The options of a session that reads at most `batch` prompt ids per pass.
    pub fn session_options(&self, batch: usize) -> StateOptions {
        StateOptions {
            ctx: self.ctx,
            batch,
            kv_type: self.kv_type,
            ..StateOptions::default()
        }
    }
}
