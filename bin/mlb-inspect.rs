//! mlb-inspect: dump and validate `.mlb`, `.mlt` and `.mli` files.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use krafla::tools::inspect::options::{Action, InspectOptions};

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

impl Args {
    fn into_options(self) -> InspectOptions {
        let action = if let Some(file) = self.chat {
            Action::Chat {
                file,
                text: self.chat_text,
            }
        } else if self.encode {
            Action::Encode
        } else if self.decode {
            Action::Decode
        } else if let Some(t) = self.tensor {
            Action::Tensor(t)
        } else {
            Action::Report
        };
        InspectOptions {
            file: self.file,
            json: self.json,
            action,
        }
    }
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let opts = Args::parse().into_options();
    // A file truncated while mapped: one line and exit 1, not a crash.
    krafla::signals::report_sigbus("mlb-inspect", &opts.file);
    match krafla::tools::inspect::run(&opts, &mut std::io::stdin().lock()) {
        Ok(out) => {
            krafla::cli::write_stdout_bytes(&out);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlb-inspect: {e}");
            ExitCode::FAILURE
        }
    }
}
