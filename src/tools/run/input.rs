//! Reading `mlb-run`'s prompt: the text of `--file` or stdin, and the prompt's ids.

use std::io::Read;
use std::path::Path;

use super::error::RunError;
use super::options::{PromptSource, RunOptions};
use crate::session::Engine;

/// The text of `file`, or of stdin without one.
pub fn read_text(file: Option<&Path>) -> Result<String, RunError> {
    match file {
        Some(f) => std::fs::read_to_string(f).map_err(|err| RunError::Read {
            what: f.display().to_string(),
            err,
        }),
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|err| RunError::Read {
                    what: "stdin".into(),
                    err,
                })?;
            Ok(s)
        }
    }
}

/// The prompt's ids.
pub fn prompt_ids(o: &RunOptions, engine: &Engine) -> Result<Vec<u32>, RunError> {
    let text = match &o.prompt {
        PromptSource::Ids(ids) => {
            return crate::tokenizer::parse_ids(ids, engine.config().vocab).map_err(RunError::Ids)
        }
        PromptSource::Text(t) => t.clone(),
        PromptSource::File(f) => read_text(Some(f))?,
        PromptSource::Stdin => read_text(None)?,
    };
    match engine.tokenizer() {
        Some(t) => Ok(t.encode(&text)),
        None => Err(RunError::NoTokenizer {
            expected: o.model.path.with_extension("mlt"),
        }),
    }
}
