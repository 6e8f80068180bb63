//! mlt-convert: tokenizer.json (+ tokenizer_config.json beside it), or a GGUF file's
//! tokenizer metadata, → MLT1.

use clap::Parser;
use krafla::tokenizer::from_hf::{convert_file, Options};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    version,
    about = "Convert a Hugging Face tokenizer.json, or the tokenizer of a GGUF file, to an MLT1 tokenizer file"
)]
struct Args {
    /// The tokenizer.json (or GGUF file) to convert.
    input: PathBuf,
    /// The .mlt file to write.
    #[arg(short, long)]
    output: PathBuf,
    /// BOS token text, overriding tokenizer_config.json.
    #[arg(long)]
    bos: Option<String>,
    /// EOS token text, overriding tokenizer_config.json.
    #[arg(long)]
    eos: Option<String>,
    /// Print nothing on success.
    #[arg(short, long)]
    quiet: bool,
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let a = Args::parse();
    let opts = Options {
        bos: a.bos,
        eos: a.eos,
    };
    let res = if krafla::convert::gguf_in::is_gguf_file(&a.input) {
        krafla::convert::gguf_tok::convert_file(
            &a.input,
            &a.output,
            opts.bos.as_deref(),
            opts.eos.as_deref(),
        )
    } else {
        convert_file(&a.input, &a.output, &opts)
    };
    match res {
        Ok(m) => {
            if !a.quiet {
                let (text, _) = krafla::tokenizer::describe(&m);
                eprintln!(
                    "wrote {}\n{}",
                    a.output.display(),
                    text.lines().take(6).collect::<Vec<_>>().join("\n")
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlt-convert: {e}");
            ExitCode::FAILURE
        }
    }
}
