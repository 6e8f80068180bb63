//! What `mlb-inspect` does, as one library call: the binary parses flags into
//! [`InspectOptions`], calls [`run`], writes the bytes it returns and maps an
//! [`InspectError`] to one line and exit 1.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::FileKind;
use crate::chat::ChatError;
use crate::format::error::FormatError;
use crate::format::mlb::Mlb;
use crate::format::mli;
use crate::format::mlt::Mlt;
use crate::tokenizer::{self, Tokenizer};

/// What to print about the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The report of any kind of file (`--json`: one JSON object).
    Report,
    /// .mlb: statistics of one tensor.
    Tensor(String),
    /// .mlt: token ids of the UTF-8 text on the input, as one JSON array.
    Encode,
    /// .mlt: the text of the ids on the input (a JSON array or whitespace-separated).
    Decode,
    /// .mlt: the conversation in `file` rendered with the chat template: its ids, or
    /// the text when `text`.
    Chat { file: PathBuf, text: bool },
}

/// A checked `mlb-inspect` command line.
#[derive(Debug, Clone)]
pub struct InspectOptions {
    pub file: PathBuf,
    pub json: bool,
    pub action: Action,
}

/// Why `mlb-inspect` failed; `Display` is the one line it prints.
#[derive(Debug)]
pub enum InspectError {
    /// The file (or the conversation file) cannot be read or is invalid.
    Format(FormatError),
    /// The action does not apply to this kind of file.
    Usage {
        file: PathBuf,
        message: &'static str,
    },
    /// `--tensor NAME` names no tensor of the model.
    NoTensor { file: PathBuf, name: String },
    /// The conversation or the template failed: named by `file` (the conversation
    /// for a bad message list, the .mlt for a template failure).
    Chat { file: PathBuf, error: ChatError },
    /// The input on stdin is not what the action reads.
    Stdin(String),
}

impl fmt::Display for InspectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InspectError::Format(e) => e.fmt(f),
            InspectError::Usage { file, message } => write!(f, "{}: {message}", file.display()),
            InspectError::NoTensor { file, name } => {
                let file = file.display();
                write!(
                    f,
                    "{file}: no tensor named '{name}' (see the tensor table of mlb-inspect {file})"
                )
            }
            InspectError::Chat { file, error } => write!(f, "{}: {error}", file.display()),
            InspectError::Stdin(e) => write!(f, "stdin: {e}"),
        }
    }
}

impl std::error::Error for InspectError {}

type Result<T> = std::result::Result<T, InspectError>;

/// Inspects `opts.file` and returns what to print; `input` is read only by
/// [`Action::Encode`] and [`Action::Decode`].
pub fn run(opts: &InspectOptions, input: &mut dyn Read) -> Result<Vec<u8>> {
    let path = opts.file.as_path();
    let in_file = |e: FormatError| InspectError::Format(e.in_file(path));
    // Mapped, not read: a model larger than free memory is inspected as mlb-run maps
    // it, and a FIFO or device is refused (crate::input).
    // SAFETY: read-only map; see crate::input::map (the mmap caveat: a truncation by
    // another process ends the tool with one line, through the SIGBUS handler the
    // binary installs).
    let map = unsafe { crate::input::map(path) }
        .map_err(|e| InspectError::Format(FormatError::io(path, &e)))?;
    let bytes: &[u8] = &map;
    let kind = super::detect(bytes).map_err(in_file)?;
    let usage = |message| InspectError::Usage {
        file: path.to_path_buf(),
        message,
    };
    match (&opts.action, kind) {
        (Action::Encode | Action::Decode | Action::Chat { .. }, k) if k != FileKind::Mlt => {
            return Err(usage(
                "--encode, --decode and --chat need a tokenizer (.mlt) file",
            ))
        }
        (Action::Tensor(_), k) if k != FileKind::Mlb => {
            return Err(usage("--tensor needs a model (.mlb) file"))
        }
        _ => {}
    }
    let name = path.display().to_string();
    let text = match kind {
        FileKind::Mlb => {
            drop(map);
            let m = Mlb::open(path).map_err(InspectError::Format)?;
            mlb_report(&m, &name, opts)?
        }
        FileKind::Mli => {
            let m = mli::parse(bytes).map_err(in_file)?;
            if opts.json {
                super::mli::report_json(&m, &name).to_string() + "\n"
            } else {
                super::mli::report_text(&m, &name)
            }
        }
        FileKind::Mlt => return mlt(opts, bytes, &name, input),
    };
    Ok(text.into_bytes())
}

fn mlb_report(m: &Mlb, name: &str, opts: &InspectOptions) -> Result<String> {
    Ok(match &opts.action {
        Action::Tensor(t) => {
            let st = super::mlb::tensor_stats(m, t).ok_or_else(|| InspectError::NoTensor {
                file: opts.file.clone(),
                name: t.clone(),
            })?;
            if opts.json {
                st.json().to_string() + "\n"
            } else {
                st.text()
            }
        }
        _ if opts.json => super::mlb::report_json(m, name).to_string() + "\n",
        _ => super::mlb::report_text(m, name),
    })
}

fn mlt(opts: &InspectOptions, bytes: &[u8], name: &str, input: &mut dyn Read) -> Result<Vec<u8>> {
    let in_file = |e: FormatError| InspectError::Format(e.in_file(&opts.file));
    let mlt = Mlt::parse(bytes).map_err(in_file)?;
    // The loader's own checks: "valid" means mlb-run can load it.
    let tok = Tokenizer::from_mlt(&mlt).map_err(in_file)?;
    let read_input = |input: &mut dyn Read| {
        let mut buf = Vec::new();
        input
            .read_to_end(&mut buf)
            .map_err(|e| InspectError::Stdin(e.to_string()))?;
        Ok::<_, InspectError>(buf)
    };
    match &opts.action {
        Action::Chat { file, text } => chat(&mlt, &tok, &opts.file, file, *text),
        Action::Encode => {
            let text = String::from_utf8(read_input(input)?)
                .map_err(|e| InspectError::Stdin(format!("not UTF-8 text ({e})")))?;
            Ok((tokenizer::encode_to_json(&tok, &text) + "\n").into_bytes())
        }
        Action::Decode => {
            let buf = read_input(input)?;
            let ids = tokenizer::parse_ids(&String::from_utf8_lossy(&buf), tok.n_vocab())
                .map_err(|e| InspectError::Stdin(e.to_string()))?;
            Ok(tok.decode(&ids))
        }
        Action::Report | Action::Tensor(_) => {
            let (text, mut json) = tokenizer::describe(&mlt);
            Ok(if opts.json {
                json["file"] = serde_json::Value::String(name.to_string());
                format!("{json}\n")
            } else {
                format!("{name}: {text}\nverdict: valid\n")
            }
            .into_bytes())
        }
    }
}

fn chat(mlt: &Mlt, tok: &Tokenizer, mlt_file: &Path, file: &Path, text: bool) -> Result<Vec<u8>> {
    let json = std::fs::read_to_string(file)
        .map_err(|e| InspectError::Format(FormatError::io(file, &e)))?;
    let (rendered, ids) = crate::chat::render_json(mlt, tok, &json).map_err(|error| {
        // A bad conversation names its file; a template failure names the .mlt.
        let file = match error {
            ChatError::Input { .. } => file,
            _ => mlt_file,
        };
        InspectError::Chat {
            file: file.to_path_buf(),
            error,
        }
    })?;
    Ok(if text {
        rendered.into_bytes()
    } else {
        (serde_json::to_string(&ids).unwrap_or_default() + "\n").into_bytes()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mlb::synth::{synth_file, tiny_header};

    fn model() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.mlb");
        std::fs::write(&path, synth_file(&tiny_header(), &[], 1)).unwrap();
        (dir, path)
    }

    fn opts(file: &Path, json: bool, action: Action) -> InspectOptions {
        InspectOptions {
            file: file.to_path_buf(),
            json,
            action,
        }
    }

    #[test]
    fn report_is_the_library_report() {
        let (_dir, path) = model();
        let name = path.display().to_string();
        let m = Mlb::open(&path).unwrap();
        let text = run(&opts(&path, false, Action::Report), &mut std::io::empty()).unwrap();
        assert_eq!(text, super::super::mlb::report_text(&m, &name).into_bytes());
        let json = run(&opts(&path, true, Action::Report), &mut std::io::empty()).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v, super::super::mlb::report_json(&m, &name));
    }

    #[test]
    fn errors_name_the_file_and_what_is_wrong() {
        let (_dir, path) = model();
        let name = path.display();
        let e = run(
            &opts(&path, false, Action::Tensor("layers.9.wq".into())),
            &mut std::io::empty(),
        )
        .unwrap_err();
        assert!(matches!(e, InspectError::NoTensor { .. }), "{e:?}");
        assert!(
            e.to_string()
                .starts_with(&format!("{name}: no tensor named 'layers.9.wq'")),
            "{e}"
        );
        let e = run(&opts(&path, false, Action::Encode), &mut std::io::empty()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("{name}: --encode, --decode and --chat need a tokenizer (.mlt) file")
        );
        let missing = path.with_file_name("missing.mlb");
        let e = run(
            &opts(&missing, false, Action::Report),
            &mut std::io::empty(),
        )
        .unwrap_err();
        assert!(matches!(e, InspectError::Format(_)), "{e:?}");
        assert!(e.to_string().contains("missing.mlb"), "{e}");
    }
}
