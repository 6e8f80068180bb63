//! What `mlb-run` shows besides the generated text: a generation's [`GenerationSummary`]
//! (stderr), the `--verbose` lines ([`note_verbose`]) and the `--logprobs` lines
//! ([`logprobs_json`]).

use std::fmt;

use super::error::RunError;
use super::frontend::RunFrontend;
use crate::format::mlt_chat::source_names;
use crate::kernels::{self, pool};
use crate::model::sampler::Logprobs;
use crate::model::StateOptions;
use crate::session::speculative::SpecStats;
use crate::session::{Engine, StopReason};

/// What a successful run gives back for the binary to show.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A generation's summary (stderr).
    Generated(GenerationSummary),
    /// A measurement's report (stdout, text or JSON).
    Measured(String),
}

/// The speed and memory of a generation: two lines for stderr ([`fmt::Display`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationSummary {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated: usize,
    pub gen_secs: f64,
    pub stop: StopReason,
    pub peak_rss_kib: Option<u64>,
    pub kv_bytes: usize,
    pub ctx: usize,
    pub delta_bytes: usize,
    /// Speculative decoding's counts (`None`: off).
    pub spec: Option<SpecStats>,
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

impl fmt::Display for GenerationSummary {
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
        if let Some(st) = &self.spec {
            writeln!(
                f,
                "speculative: {} drafted, {} kept ({:.1}%), {} checking passes ({:.2} tokens per pass)",
                st.drafted,
                st.accepted,
                100.0 * st.acceptance(),
                st.rounds,
                if st.rounds > 0 {
                    (st.accepted + st.rounds) as f64 / st.rounds as f64
                } else {
                    0.0
                }
            )?;
        }
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

/// The `--verbose` lines: the kernel tier, the threads, the model's shape.
pub fn note_verbose(
    engine: &Engine,
    ctx: usize,
    opts: &StateOptions,
    load_secs: f64,
    fe: &mut dyn RunFrontend,
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
            format!("{} {text:?} ({})", t.id, source_names(t.sources).join(", "))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_lines() {
        let s = GenerationSummary {
            prompt_tokens: 3,
            prompt_secs: 0.5,
            generated: 4,
            gen_secs: 0.0,
            stop: StopReason::StopId(2),
            peak_rss_kib: Some(2048),
            kv_bytes: 1 << 20,
            ctx: 64,
            delta_bytes: 0,
            spec: None,
        };
        assert_eq!(
            s.to_string(),
            "prompt: 3 tokens in 0.500 s (6.0 tok/s); generated: 4 tokens in 0.000 s (- tok/s) (stop id 2)\n\
             memory: peak RSS 2.0 MiB; KV cache 1.0 MiB (64 positions)"
        );
        let s = GenerationSummary {
            stop: StopReason::ContextFull,
            peak_rss_kib: None,
            delta_bytes: 3 << 19,
            ..s
        };
        let t = s.to_string();
        assert!(t.contains("(context full)\nmemory: peak RSS ?;"), "{t}");
        assert!(t.ends_with("; linear-attention state 1.5 MiB"), "{t}");
        let s = GenerationSummary {
            spec: Some(SpecStats {
                rounds: 4,
                drafted: 20,
                accepted: 10,
            }),
            ..s
        };
        assert!(
            s.to_string().contains(
                "\nspeculative: 20 drafted, 10 kept (50.0%), 4 checking passes (3.50 tokens per pass)\n"
            ),
            "{s}"
        );
    }
}
