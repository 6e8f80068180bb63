//! The session API in one page: load a model once, run two sequences over it, use a
//! snapshot to answer two continuations of one prompt without prefilling it twice.
//!
//! ```sh
//! cargo run --release --example generate -- model.mlb "The capital of France is"
//! ```
//!
//! The tokenizer is the `.mlt` of the same name beside the model.

use std::ops::ControlFlow;
use std::process::ExitCode;

use krafla::model::{SamplerOptions, StateOptions};
use krafla::session::{Engine, GenerateOptions, LoadOptions, SessionError};

fn run(model: &str, prompt: &str) -> Result<(), SessionError> {
    let engine = Engine::load(&LoadOptions::new(model))?;
    let mut s = engine.session(&StateOptions::default())?;
    s.feed_text(prompt)?;
    let after_prompt = s.snapshot();

    for (name, sampling) in [
        ("greedy", SamplerOptions::default()),
        (
            "sampled",
            SamplerOptions {
                temp: 0.8,
                top_p: 0.95,
                seed: 42,
                ..SamplerOptions::default()
            },
        ),
    ] {
        // Back to the end of the prompt: no prefill again.
        s.restore(&after_prompt)?;
        let opts = GenerateOptions {
            max_tokens: 32,
            sampling,
            stop_ids: engine.stop_ids(),
            ..GenerateOptions::default()
        };
        print!("[{name}] {prompt}");
        let g = s.generate(&opts, |step| {
            print!("{}", step.text);
            ControlFlow::Continue(())
        })?;
        println!("{}", g.tail);
        eprintln!(
            "[{name}] {} tokens, stop: {:?}, position {}",
            g.tokens.len(),
            g.stop,
            s.pos()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(model) = args.first() else {
        eprintln!("usage: generate MODEL.mlb [PROMPT]");
        return ExitCode::from(2);
    };
    let prompt = args
        .get(1)
        .map_or("The capital of France is", String::as_str);
    match run(model, prompt) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("generate: {e}");
            ExitCode::FAILURE
        }
    }
}
