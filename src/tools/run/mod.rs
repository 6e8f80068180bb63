//! `mlb-run` as one library call: [`RunOptions`] (every flag, validated there), [`run`]
//! (load, read the prompt, then generate ([`generate`]: with the optional `--logits`
//! file), measure ([`measure`]: `--imatrix`, `--perplexity`, `--kl-divergence`) or chat
//! ([`chat`]: `--chat`)) and [`RunError`] (typed, one line each, an exit code).
//!
//! What the command shows goes through a [`RunFrontend`] (generated text to stdout,
//! `--verbose` lines and progress to stderr; the interactive chat's lines come from it),
//! so the binary stays a flag parser. All of it is built on the session API
//! ([`crate::session`]), which does not know this module.

pub mod chat;
pub mod error;
pub mod frontend;
pub mod generate;
pub mod input;
pub mod measure;
pub mod options;
pub mod report;

use std::time::Instant;

use error::RunError;
use frontend::RunFrontend;
use options::{MeasureMode, PromptSource, RunOptions};
use report::Outcome;

/// Refuses an output (`--logits`, `--imatrix`) that is one of the inputs (the model,
/// the tokenizer, the `--kl-divergence` reference, the prompt file).
fn check_outputs(o: &RunOptions) -> Result<(), RunError> {
    let tokenizer = o.model.tokenizer_path();
    let mut inputs = vec![o.model.path.as_path(), &tokenizer];
    if let PromptSource::File(f) = &o.prompt {
        inputs.push(f);
    }
    let mut outputs = vec![("--logits", o.logits.as_deref())];
    if let Some(m) = &o.measure {
        match &m.mode {
            MeasureMode::KlDivergence { reference } => inputs.push(reference),
            MeasureMode::Imatrix { output, .. } => outputs.push(("--imatrix", Some(output))),
            MeasureMode::Perplexity => {}
        }
    }
    for (option, out) in outputs {
        if let Some(path) = out {
            crate::atomic::check_not_input(path, &inputs).map_err(|err| {
                RunError::OutputIsInput {
                    option,
                    path: path.to_path_buf(),
                    err,
                }
            })?;
        }
    }
    Ok(())
}

/// Runs mlb-run: validates `o`, loads the model, and generates (or measures, or writes
/// the prompt's logits); shows what it makes through `fe`.
pub fn run(o: &RunOptions, fe: &mut dyn RunFrontend) -> Result<Outcome, RunError> {
    o.validate()?;
    if let Some(note) = o.model.start_pool() {
        fe.info(&format!("mlb-run: note: {note}"));
    }
    check_outputs(o)?;
    let t_load = Instant::now();
    let engine = o.model.load()?;
    if let Some(c) = &o.chat {
        return chat::run(o, c, &engine, fe, t_load.elapsed().as_secs_f64());
    }
    let prompt = input::prompt_ids(o, &engine)?;
    if let Some(m) = &o.measure {
        // Each chunk starts with BOS when the tokenizer adds one to a text.
        let bos = match o.prompt {
            PromptSource::Ids(_) => None,
            _ => engine.bos_added(),
        };
        return measure::run(o, m, &engine, bos, &prompt, fe).map(Outcome::Measured);
    }
    generate::run(o, &engine, &prompt, fe, t_load)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::SessionError;
    use options::MeasureOptions;

    #[test]
    fn the_run_refuses_before_it_opens_the_model() {
        struct Null;
        impl RunFrontend for Null {
            fn text(&mut self, _: &str) -> std::io::Result<()> {
                Ok(())
            }
        }
        let ok = RunOptions::new("/nonexistent/m.mlb");
        let mut o = ok.clone();
        o.measure = Some(MeasureOptions::new(MeasureMode::Imatrix {
            output: "x.mli".into(),
            save_every: Some(0),
            covariance: false,
        }));
        assert!(matches!(
            run(&o, &mut Null),
            Err(RunError::BadOption { .. })
        ));
        assert!(matches!(
            run(&ok, &mut Null),
            Err(RunError::Session(SessionError::Format(_)))
        ));
        assert_eq!(run(&ok, &mut Null).unwrap_err().exit_code(), 1);
    }
}
