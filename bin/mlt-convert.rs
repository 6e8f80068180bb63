//! mlt-convert: tokenizer.json (+ tokenizer_config.json, chat templates and
//! generation_config.json beside it), or a GGUF file's tokenizer metadata, → MLT1.

use clap::Parser;
use krafla::chat::capture::ChatOptions;
use krafla::tokenizer::from_hf::HfTokenizerOptions;
use krafla::tools::mlt_convert::{convert_file, summary, MltConvertOptions};
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
    /// Write no chat section (templates and stop set), even if the folder has a template.
    #[arg(long, conflicts_with_all = ["chat_template", "stop_token"])]
    no_chat: bool,
    /// A Jinja chat template file to use instead of the folder's templates.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// A token (by its text) that also ends a generated turn; repeatable.
    #[arg(long, value_name = "TEXT")]
    stop_token: Vec<String>,
    /// Print nothing on success.
    #[arg(short, long)]
    quiet: bool,
}

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let a = Args::parse();
    let opts = MltConvertOptions {
        tokenizer: HfTokenizerOptions {
            bos: a.bos,
            eos: a.eos,
        },
        chat: ChatOptions {
            disable: a.no_chat,
            template_file: a.chat_template,
            stop_tokens: a.stop_token,
        },
    };
    let res = if krafla::convert::gguf::file::is_gguf_file(&a.input) {
        krafla::convert::gguf::tokenizer::convert_file(
            &a.input,
            &a.output,
            opts.tokenizer.bos.as_deref(),
            opts.tokenizer.eos.as_deref(),
            &opts.chat,
        )
    } else {
        convert_file(&a.input, &a.output, &opts)
    };
    match res {
        Ok(m) => {
            if !a.quiet {
                eprintln!("{}", summary(&m, &a.output));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlt-convert: {e}");
            ExitCode::FAILURE
        }
    }
}
