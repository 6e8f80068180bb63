//! `mlb-inspect` as one library call: the binary parses flags into [`InspectOptions`],
//! calls [`run`], writes the bytes it returns and maps an [`InspectError`] to one line
//! and exit 1.
//!
//! Human and JSON reports of `.mlb` ([`mlb`]), `.mlt` ([`mlt`], its chat section
//! [`mlt_chat`]) and `.mli` ([`mli`]) files. Reports are built from the same validated
//! views the tools load, so what inspect calls valid is exactly what the runtime accepts.

pub mod error;
pub mod mlb;
pub mod mli;
pub mod mlt;
pub mod mlt_chat;
pub mod options;

use std::io::Read;
use std::path::Path;

use crate::chat::ChatError;
use crate::format::mlb::Mlb;
use crate::format::mlt::Mlt;
use crate::format::FormatError;
use crate::tokenizer::{self, Tokenizer};
use error::InspectError;
use options::{Action, InspectOptions};

/// Which format a file is, by its magic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Mlb,
    Mlt,
    Mli,
}

/// Identifies a file by its first four bytes.
pub fn detect(bytes: &[u8]) -> crate::format::Result<FileKind> {
    match bytes.get(..4) {
        Some(b"MLB1") => Ok(FileKind::Mlb),
        Some(b"MLT1") => Ok(FileKind::Mlt),
        Some(b"MLI1") => Ok(FileKind::Mli),
        Some(m) => Err(FormatError::format(
            "magic",
            format!("{:?}", String::from_utf8_lossy(m)),
            "not an .mlb (MLB1), .mlt (MLT1) or .mli (MLI1) file",
        )),
        None => Err(FormatError::format(
            "file",
            format!("{} bytes", bytes.len()),
            "too short to hold a magic number",
        )),
    }
}

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
    let kind = detect(bytes).map_err(in_file)?;
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
            let m = crate::format::mli::parse(bytes).map_err(in_file)?;
            if opts.json {
                let mut v = mli::report_json(&m, &name);
                if m.covariance.is_some() {
                    v["covariance"] = mli::cov_json(&m, bytes);
                }
                v.to_string() + "\n"
            } else {
                mli::report_text(&m, &name) + &mli::cov_text(&m, bytes) + "\nverdict: valid\n"
            }
        }
        FileKind::Mlt => return mlt_action(opts, bytes, &name, input),
    };
    Ok(text.into_bytes())
}

/// .mlb: the report, or `--tensor`'s statistics.
fn mlb_report(m: &Mlb, name: &str, opts: &InspectOptions) -> Result<String> {
    Ok(match &opts.action {
        Action::Tensor(t) => {
            let st = mlb::tensor_stats(m, t).ok_or_else(|| InspectError::NoTensor {
                file: opts.file.clone(),
                name: t.clone(),
            })?;
            if opts.json {
                st.json().to_string() + "\n"
            } else {
                st.text()
            }
        }
        _ if opts.json => mlb::report_json(m, name).to_string() + "\n",
        _ => mlb::report_text(m, name),
    })
}

/// .mlt: the report, `--encode`, `--decode` or `--chat`.
fn mlt_action(
    opts: &InspectOptions,
    bytes: &[u8],
    name: &str,
    input: &mut dyn Read,
) -> Result<Vec<u8>> {
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
        Action::Chat { file, text } => render_chat(&mlt, &tok, &opts.file, file, *text),
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
            let (text, mut json) = mlt::describe(&mlt);
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

/// `--chat FILE`: the conversation rendered with the file's template, as ids or text.
fn render_chat(
    mlt: &Mlt,
    tok: &Tokenizer,
    mlt_file: &Path,
    file: &Path,
    text: bool,
) -> Result<Vec<u8>> {
    let json = std::fs::read_to_string(file)
        .map_err(|e| InspectError::Format(FormatError::io(file, &e)))?;
    let (rendered, ids) = mlt_chat::render_json(mlt, tok, &json).map_err(|error| {
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
    use crate::synth::{synth_file, tiny_header};
    use std::path::PathBuf;

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
        assert_eq!(text, mlb::report_text(&m, &name).into_bytes());
        let json = run(&opts(&path, true, Action::Report), &mut std::io::empty()).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v, mlb::report_json(&m, &name));
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
