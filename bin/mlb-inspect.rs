//! mlb-inspect: dump and validate `.mlb`, `.mlt` and `.mli` files.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use krafla::format::error::FormatError;
use krafla::format::mlb::Mlb;
use krafla::format::mli;
use krafla::format::mlt::Mlt;
use krafla::inspect::{self, FileKind};
use krafla::tokenizer::{self, Tokenizer};

/// Dump and validate Krafla files: models (.mlb), tokenizers (.mlt) and importance
/// matrices (.mli). Exits non-zero with the spec's status (ML_E_IO, ML_E_FORMAT,
/// ML_E_SHAPE) when the file is invalid.
#[derive(Parser, Debug)]
#[command(name = "mlb-inspect", version)]
struct Args {
    /// The file to inspect (its kind is found from its magic number).
    file: PathBuf,
    /// Print one JSON object instead of the human-readable report.
    #[arg(long)]
    json: bool,
    /// .mlb: statistics of one tensor (e.g. `layers.0.wq`) instead of the report.
    #[arg(long, value_name = "NAME")]
    tensor: Option<String>,
    /// .mlt: read UTF-8 text on stdin, print its token ids as one JSON array.
    #[arg(long, conflicts_with_all = ["decode", "tensor"])]
    encode: bool,
    /// .mlt: read a JSON array of ids (or whitespace-separated ids) on stdin, print the text.
    #[arg(long, conflicts_with = "tensor")]
    decode: bool,
    /// .mlt: render the conversation in FILE (`{"messages": [...], "add_generation_prompt":
    /// true, ...}`) with the chat template, print its token ids as one JSON array.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["encode", "decode", "tensor"])]
    chat: Option<PathBuf>,
    /// With --chat: print the rendered text instead of the ids.
    #[arg(long, requires = "chat")]
    chat_text: bool,
}

fn run(args: &Args) -> Result<(), String> {
    let err = |e: FormatError| e.in_file(&args.file).to_string();
    let name = args.file.display().to_string();
    // Mapped, not read: a model larger than free memory is inspected as mlb-run maps
    // it, and a FIFO or device is refused (krafla::input).
    krafla::signals::report_sigbus("mlb-inspect", &args.file);
    // SAFETY: read-only map; see krafla::input::map (the mmap caveat: a truncation by
    // another process ends the tool with one line, through the SIGBUS handler).
    let map = unsafe { krafla::input::map(&args.file) }
        .map_err(|e| FormatError::io(&args.file, &e).to_string())?;
    let bytes: &[u8] = &map;
    let kind = inspect::detect(bytes).map_err(err)?;
    if (args.encode || args.decode || args.chat.is_some()) && kind != FileKind::Mlt {
        return Err(format!(
            "{name}: --encode, --decode and --chat need a tokenizer (.mlt) file"
        ));
    }
    if args.tensor.is_some() && kind != FileKind::Mlb {
        return Err(format!("{name}: --tensor needs a model (.mlb) file"));
    }
    let out = match kind {
        FileKind::Mlb => {
            drop(map);
            let m = Mlb::open(&args.file).map_err(|e| e.to_string())?;
            if let Some(t) = &args.tensor {
                let st = inspect::mlb::tensor_stats(&m, t)
                    .ok_or_else(|| format!("{name}: no tensor named '{t}' (see the tensor table of mlb-inspect {name})"))?;
                if args.json {
                    st.json().to_string() + "\n"
                } else {
                    st.text()
                }
            } else if args.json {
                inspect::mlb::report_json(&m, &name).to_string() + "\n"
            } else {
                inspect::mlb::report_text(&m, &name)
            }
        }
        FileKind::Mli => {
            let m = mli::parse(bytes).map_err(err)?;
            if args.json {
                inspect::mli::report_json(&m, &name).to_string() + "\n"
            } else {
                inspect::mli::report_text(&m, &name)
            }
        }
        FileKind::Mlt => return inspect_mlt(args, bytes, &name),
    };
    krafla::out!("{out}");
    Ok(())
}

fn inspect_mlt(args: &Args, bytes: &[u8], name: &str) -> Result<(), String> {
    let err = |e: FormatError| e.in_file(&args.file).to_string();
    let mlt = Mlt::parse(bytes).map_err(err)?;
    // The loader's own checks: "valid" means mlb-run can load it.
    let tok = Tokenizer::from_mlt(&mlt).map_err(err)?;
    if let Some(file) = &args.chat {
        let json =
            std::fs::read_to_string(file).map_err(|e| FormatError::io(file, &e).to_string())?;
        let (text, ids) = krafla::chat::render_json(&mlt, &tok, &json).map_err(|e| match e {
            // A bad conversation names its file; a template failure names the .mlt.
            krafla::chat::ChatError::Input { .. } => format!("{}: {e}", file.display()),
            _ => format!("{name}: {e}"),
        })?;
        if args.chat_text {
            krafla::out!("{text}");
        } else {
            krafla::outln!("{}", serde_json::to_string(&ids).unwrap_or_default());
        }
        return Ok(());
    }
    if args.encode || args.decode {
        let mut input = Vec::new();
        std::io::stdin()
            .read_to_end(&mut input)
            .map_err(|e| format!("stdin: {e}"))?;
        if args.encode {
            let text =
                String::from_utf8(input).map_err(|e| format!("stdin: not UTF-8 text ({e})"))?;
            krafla::outln!("{}", tokenizer::encode_to_json(&tok, &text));
        } else {
            let text = String::from_utf8_lossy(&input);
            let ids =
                tokenizer::parse_ids(&text, tok.n_vocab()).map_err(|e| format!("stdin: {e}"))?;
            let out = tok.decode(&ids);
            std::io::stdout()
                .write_all(&out)
                .map_err(|e| format!("stdout: {e}"))?;
        }
        return Ok(());
    }
    let (text, json) = tokenizer::describe(&mlt);
    if args.json {
        let mut json = json;
        json["file"] = serde_json::Value::String(name.to_string());
        krafla::outln!("{json}");
    } else {
        krafla::out!("{name}: {text}");
        krafla::outln!("\nverdict: valid");
    }
    Ok(())
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlb-inspect: {e}");
            ExitCode::FAILURE
        }
    }
}
