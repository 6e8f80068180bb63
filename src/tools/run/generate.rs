//! `mlb-run`'s generation: prefill the prompt (writing every position's logits to the
//! `--logits` file when asked), then sample and stream the text through the frontend.

use std::io::{BufWriter, Write};
use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use super::error::RunError;
use super::frontend::RunFrontend;
use super::options::RunOptions;
use super::report::{logprobs_json, note_verbose, peak_rss_kib, GenerationSummary, Outcome};
use crate::atomic::AtomicFile;
use crate::model::forward::LogitsSink;
use crate::model::StateOptions;
use crate::session::speculative::{load_draft, DraftSource, SpecOptions, Speculator};
use crate::session::{Engine, GenerateOptions, Step, DEFAULT_MAX_TOKENS};

/// Writes the logits of every prompt position; the file appears only when all are
/// written (dropped unfinished, on any error, it leaves nothing).
struct LogitsFile {
    out: BufWriter<AtomicFile>,
    err: Option<std::io::Error>,
}

impl LogitsFile {
    fn create(path: &Path) -> Result<LogitsFile, RunError> {
        let f = AtomicFile::create(path).map_err(|err| RunError::Logits {
            path: path.to_path_buf(),
            err,
        })?;
        Ok(LogitsFile {
            out: BufWriter::new(f),
            err: None,
        })
    }

    fn row(&mut self, row: &[f32]) {
        if self.err.is_some() {
            return;
        }
        let mut buf = Vec::with_capacity(row.len() * 4);
        for v in row {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        if let Err(e) = self.out.write_all(&buf) {
            self.err = Some(e);
        }
    }

    fn finish(self, path: &Path) -> Result<(), RunError> {
        let fail = |err: std::io::Error| RunError::Logits {
            path: path.to_path_buf(),
            err,
        };
        if let Some(e) = self.err {
            return Err(fail(e));
        }
        let f = self.out.into_inner().map_err(|e| fail(e.into_error()))?;
        f.commit().map_err(fail)
    }
}

/// Generates from `prompt` over the loaded `engine` (loading began at `t_load`).
pub(super) fn run(
    o: &RunOptions,
    engine: &Engine,
    prompt: &[u32],
    fe: &mut dyn RunFrontend,
    t_load: Instant,
) -> Result<Outcome, RunError> {
    let opts = StateOptions {
        spare: o.spec.as_ref().map_or(0, SpecOptions::spare),
        ..o.model.session_options(o.batch.max(1))
    };
    let mut s = engine.session(&opts)?;
    // A draft model, loaded and checked against the model before the prompt runs.
    let draft = match o.spec.as_ref().map(|sp| &sp.source) {
        Some(DraftSource::Model(path)) => {
            Some(load_draft(engine, path, o.model.pack, o.model.half_acts)?)
        }
        _ => None,
    };
    let load_secs = t_load.elapsed().as_secs_f64();
    if o.verbose {
        note_verbose(engine, s.ctx(), &opts, load_secs, fe)?;
    }

    // The prompt.
    let t0 = Instant::now();
    match &o.logits {
        Some(path) => {
            let mut file = LogitsFile::create(path)?;
            let mut sink = |_: usize, row: &[f32]| file.row(row);
            let each: LogitsSink = &mut sink;
            s.feed_with(prompt, Some(each))?;
            file.finish(path)?;
        }
        None => {
            s.feed(prompt)?;
        }
    }
    let prompt_secs = t0.elapsed().as_secs_f64();

    // The generation.
    let n_gen = o.n_predict.unwrap_or(if o.logits.is_some() {
        0
    } else {
        DEFAULT_MAX_TOKENS
    });
    let gopts = GenerateOptions {
        max_tokens: n_gen,
        sampling: o.sampler_options(),
        ignore_eos: o.ignore_eos,
        stop_ids: Vec::new(),
        stop_strings: o.stop_strings.clone(),
    };
    let t1 = Instant::now();
    let mut failed = None;
    let mut on = |step: &Step| {
        if let (Some(_), Some(lp)) = (o.logprobs, &step.logprobs) {
            fe.info(&logprobs_json(engine, step.id, lp));
        }
        match fe.text(&step.text) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failed = Some(e);
                ControlFlow::Break(())
            }
        }
    };
    let mut spec_stats = None;
    let g = match &o.spec {
        None => s.generate(&gopts, on)?,
        Some(sp) => {
            let state = StateOptions {
                ctx: Some(s.ctx()),
                ..opts
            };
            let mut spec = match &draft {
                Some(d) => Speculator::with_model(sp, d, &state, &gopts.sampling)?,
                None => Speculator::lookup(sp),
            };
            let g = s.generate_speculative(&gopts, &mut spec, &mut on)?;
            spec_stats = Some(spec.stats);
            g
        }
    };
    if let Some(e) = failed {
        return Err(RunError::Stdout(e));
    }
    let nl = if n_gen > 0 { "\n" } else { "" };
    fe.text(&format!("{}{nl}", g.tail))
        .map_err(RunError::Stdout)?;
    let gen_secs = t1.elapsed().as_secs_f64();

    Ok(Outcome::Generated(GenerationSummary {
        prompt_tokens: prompt.len(),
        prompt_secs,
        generated: g.tokens.len(),
        gen_secs,
        stop: g.stop,
        peak_rss_kib: peak_rss_kib(),
        kv_bytes: s.state().kv_bytes(),
        ctx: s.ctx(),
        delta_bytes: s.state().delta_bytes(),
        spec: spec_stats,
    }))
}
