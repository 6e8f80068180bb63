//! [`RunOptions`]: every option of `mlb-run`, with the library's defaults and checks,
//! and the options of its modes ([`MeasureOptions`], [`ChatRunOptions`]).

use std::path::PathBuf;

use super::error::RunError;
use crate::model::forward::DEFAULT_BATCH;
use crate::model::SamplerOptions;
use crate::session::speculative::SpecOptions;
use crate::session::{ModelOptions, SessionError};

/// `--temp` default.
pub const DEFAULT_TEMP: f32 = 0.8;
/// `--top-k` default.
pub const DEFAULT_TOP_K: usize = 40;
/// `--top-p` default.
pub const DEFAULT_TOP_P: f32 = 0.95;

/// Where the prompt comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptSource {
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
    pub prompt: PromptSource,
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
    pub measure: Option<MeasureOptions>,
    /// Keep generating past the stop set (always `n_predict` tokens).
    pub ignore_eos: bool,
    /// Texts that end the generation (`--stop`); the output stops before them.
    pub stop_strings: Vec<String>,
    /// Print each sampled token's log-probability and this many alternatives
    /// (`--logprobs N`), one JSON line per token on stderr.
    pub logprobs: Option<usize>,
    /// Chat with the model (`--chat`): the prompt is a conversation.
    pub chat: Option<ChatRunOptions>,
    /// Decode speculatively (`--lookup`, `--draft MODEL.mlb`).
    pub spec: Option<SpecOptions>,
}

impl RunOptions {
    /// mlb-run's defaults for `model`, prompt from stdin.
    pub fn new(model: impl Into<PathBuf>) -> RunOptions {
        RunOptions {
            model: ModelOptions::new(model),
            prompt: PromptSource::Stdin,
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
            spec: None,
        }
    }

    /// The sampler's options, with `--logprobs`.
    pub fn sampler_options(&self) -> SamplerOptions {
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
        let measure = (
            self.measure.is_some(),
            "--imatrix, --perplexity, --kl-divergence",
        );
        if let Some(s) = &self.spec {
            s.validate()?;
            refuse_with(
                "cannot be used with --lookup or --draft",
                &[(self.chat.is_some(), "--chat"), measure],
            )?;
        }
        if self.chat.is_some() {
            refuse_with(
                "cannot be used with --chat",
                &[
                    (matches!(self.prompt, PromptSource::Ids(_)), "--tokens"),
                    (self.logits.is_some(), "--logits"),
                    measure,
                ],
            )?;
        }
        Ok(())
    }
}

/// The first of `options` given (true) cannot be used with a mode: `rule` says which.
fn refuse_with(rule: &'static str, options: &[(bool, &'static str)]) -> Result<(), RunError> {
    match options.iter().find(|o| o.0) {
        Some(&(_, name)) => Err(RunError::BadOption {
            name,
            value: "(given)".into(),
            rule,
        }),
        None => Ok(()),
    }
}

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeasureMode {
    /// Sum the squared inputs of every matrix into an MLI1 file, also written every
    /// `save_every` chunks.
    Imatrix {
        output: PathBuf,
        save_every: Option<usize>,
        /// Also the full covariance of every matrix input (the MLI covariance section).
        covariance: bool,
    },
    /// The perplexity of the text.
    Perplexity,
    /// KL(reference ‖ model) and both perplexities.
    KlDivergence { reference: PathBuf },
}

/// A measurement (`--imatrix`, `--perplexity`, `--kl-divergence`) and its options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeasureOptions {
    pub mode: MeasureMode,
    /// Stop after this many chunks.
    pub chunks: Option<usize>,
    /// The report as one JSON object.
    pub json: bool,
}

impl MeasureOptions {
    pub fn new(mode: MeasureMode) -> MeasureOptions {
        MeasureOptions {
            mode,
            chunks: None,
            json: false,
        }
    }

    /// Checks the counts (at least one chunk).
    pub fn validate(&self) -> Result<(), RunError> {
        let zero = |name| {
            Err(RunError::BadOption {
                name,
                value: "0".into(),
                rule: "give a number of chunks of at least 1",
            })
        };
        if let MeasureMode::Imatrix {
            save_every: Some(0),
            ..
        } = self.mode
        {
            return zero("--save-every");
        }
        if self.chunks == Some(0) {
            return zero("--chunks");
        }
        Ok(())
    }
}

/// What `--chat` adds to mlb-run's options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatRunOptions {
    /// The system prompt (`--system`).
    pub system: Option<String>,
    /// Drop the oldest turns when the context is full (`--context-shift`).
    pub context_shift: bool,
    /// Read turns line by line through
    /// [`RunFrontend::read_line`](super::frontend::RunFrontend::read_line).
    pub interactive: bool,
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
        o.measure = Some(MeasureOptions {
            chunks: Some(0),
            ..MeasureOptions::new(MeasureMode::Perplexity)
        });
        assert_eq!(
            o.validate().unwrap_err().to_string(),
            "--chunks = 0: give a number of chunks of at least 1"
        );
        o.measure = Some(MeasureOptions::new(MeasureMode::Imatrix {
            output: "x.mli".into(),
            save_every: Some(0),
            covariance: false,
        }));
        assert!(matches!(
            o.validate(),
            Err(RunError::BadOption {
                name: "--save-every",
                ..
            })
        ));
    }
}
