//! `mlt-convert` from a Hugging Face folder as one library call: tokenizer.json (and
//! tokenizer_config.json beside it, if present) through [`from_hf::convert`], the chat
//! section from the files beside it ([`capture::attach`]), written atomically. A GGUF
//! file's tokenizer goes through `convert::gguf_tok` instead.

use std::path::Path;

use crate::chat::capture::{self, ChatOptions};
use crate::format::mlt::Mlt;
use crate::format::{FormatError, Result};
use crate::tokenizer::from_hf::{self, HfTokenizerOptions};
use crate::tools::inspect::mlt::describe;

/// Every option of `mlt-convert` besides its input and output.
#[derive(Debug, Default, Clone)]
pub struct MltConvertOptions {
    /// `--bos`, `--eos`.
    pub tokenizer: HfTokenizerOptions,
    /// The chat section (templates and stop set) read beside the input.
    pub chat: ChatOptions,
}

/// Reads `input` (and tokenizer_config.json beside it, if present), converts it, adds
/// the chat section from the files beside it and writes `output` atomically: a
/// temporary file beside it, renamed on success.
pub fn convert_file(input: &Path, output: &Path, opts: &MltConvertOptions) -> Result<Mlt> {
    let json = crate::input::read_to_string(input).map_err(|e| FormatError::io(input, &e))?;
    let cfg_path = input.with_file_name("tokenizer_config.json");
    let cfg = match crate::input::read_to_string(&cfg_path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(FormatError::io(&cfg_path, &e)),
    };
    let tok = &opts.tokenizer;
    let mut mlt = from_hf::convert(&json, cfg.as_deref(), tok).map_err(|e| {
        // Errors about tokenizer_config.json name that file.
        if e.field.starts_with("tokenizer_config")
            || e.field == "bos_token"
            || e.field == "eos_token"
        {
            e.in_file(if cfg.is_some() { &cfg_path } else { input })
        } else {
            e.in_file(input)
        }
    })?;
    capture::attach(
        &mut mlt,
        input,
        cfg.as_deref().map(|c| (cfg_path.as_path(), c)),
        tok.bos.as_deref(),
        tok.eos.as_deref(),
        &opts.chat,
    )?;
    let bytes = mlt.to_bytes().map_err(|e| e.in_file(output))?;
    let read: &[&Path] = match cfg {
        Some(_) => &[input, &cfg_path],
        None => &[input],
    };
    crate::atomic::check_not_input(output, read).map_err(|e| FormatError::io(output, &e))?;
    crate::atomic::write(output, &bytes).map_err(|e| FormatError::io(output, &e))?;
    Ok(mlt)
}

/// What `mlt-convert` prints on success (stderr): the file written, the head of its
/// report ([`describe`]) and its chat section in one line.
pub fn summary(m: &Mlt, output: &Path) -> String {
    let (text, _) = describe(m);
    let mut s = format!(
        "wrote {}\n{}",
        output.display(),
        text.lines().take(6).collect::<Vec<_>>().join("\n")
    );
    if let Some(c) = &m.chat {
        let names: Vec<&str> = c.templates.iter().map(|t| t.name.as_str()).collect();
        let stop: Vec<String> = c.stop.iter().map(|s| s.id.to_string()).collect();
        s.push_str(&format!(
            "\n  chat templates: {}; stop ids: {} (mlb-inspect shows them)",
            names.join(", "),
            stop.join(", ")
        ));
    }
    s
}
