//! mlb-export: an `.mlb` file and its `.mlt` tokenizer → a GGUF file llama.cpp loads.
//!
//! Thin: parses the options, calls `krafla::convert::gguf::export::export`, prints one line.
//! Exit 0 on success, 1 on an error (one line on stderr naming the file, field or
//! tensor and the value), 2 on bad usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use krafla::convert::gguf::export::{export, ExportOptions};

/// Export an .mlb model (every weight type GGUF has; Q6_0 is refused) and its tokenizer as a GGUF file for llama.cpp.
#[derive(Debug, Parser)]
#[command(name = "mlb-export", version)]
struct Cli {
    /// The model
    model: PathBuf,
    /// Tokenizer [default: the .mlt of the same name beside the model]
    #[arg(long, value_name = "FILE.mlt")]
    tokenizer: Option<PathBuf>,
    /// Output file [default: the model's name with .gguf]
    #[arg(short, long, value_name = "OUT.gguf")]
    output: Option<PathBuf>,
    /// general.name of the GGUF [default: the model's file name]
    #[arg(long)]
    name: Option<String>,
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let cli = Cli::parse();
    let opts = ExportOptions {
        input: cli.model,
        tokenizer: cli.tokenizer,
        output: cli.output,
        name: cli.name,
    };
    match export(&opts) {
        Ok(s) => {
            krafla::outln!(
                "{}: {} GGUF, {} tensors, {:.1} MB",
                s.output.display(),
                s.arch,
                s.tensors,
                s.file_bytes as f64 / 1e6
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlb-export: {e}");
            ExitCode::from(1)
        }
    }
}
