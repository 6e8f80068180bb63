//! End-to-end checks on the real checkpoints of shared/tools/real-checkpoints.sh.
//!
//! Run with `KRAFLA_REAL_DIR=/path/to/out cargo test --release real -- --nocapture`
//! after `python scripts/real_reference.py $KRAFLA_REAL_DIR` wrote greedy.json beside
//! each model. Without KRAFLA_REAL_DIR the tests say so and pass (they are slow and need
//! ~800 MB of checkpoints that stay out of the repository).

use std::path::PathBuf;
use std::process::Command;

use krafla::format::mlb::Mlb;
use krafla::model::sampler::argmax;
use krafla::model::{Model, Options};
use krafla::tokenizer::Tokenizer;

use crate::util::{bin_path, mlt_convert};

/// Logit margin below which the reference's choice is a near-tie.
const NEAR_TIE: f64 = 0.2;

fn real_dir() -> Option<PathBuf> {
    let d = PathBuf::from(std::env::var_os("KRAFLA_REAL_DIR")?);
    d.exists().then_some(d)
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Greedy continuations at Q8_0 against transformers' float32 greedy output. Every
/// continuation must agree at least up to the first position where transformers' own
/// top-1/top-2 margin is below [`NEAR_TIE`] (there a Q8_0 model may legitimately pick
/// the runner-up); the count of full 16-id agreements is printed (issue 5 asks for 4 of
/// 5; see docs/runtime.md for the figures).
#[test]
fn real_checkpoints_greedy_q8_0() {
    let Some(real) = real_dir() else {
        eprintln!("SKIP real_checkpoints_greedy_q8_0: set KRAFLA_REAL_DIR to the output of shared/tools/real-checkpoints.sh");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    for name in ["smollm2-135m", "gemma3-270m"] {
        let src = real.join(name);
        let refs = src.join("greedy.json");
        if !refs.exists() {
            eprintln!(
                "SKIP {name}: no {} (run scripts/real_reference.py)",
                refs.display()
            );
            continue;
        }
        let mlb = tmp.path().join(format!("{name}.mlb"));
        let o = Command::new(bin_path("mlb-convert"))
            .arg(&src)
            .args(["--wtype", "q8_0", "-o"])
            .arg(&mlb)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let mlt = tmp.path().join(format!("{name}.mlt"));
        mlt_convert(&src.join("tokenizer.json"), &mlt);
        let tok = Tokenizer::from_path(&mlt).unwrap();
        let m = Mlb::open(&mlb).unwrap();
        let model = Model::new(&m).unwrap();
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&refs).unwrap()).unwrap();
        let mut full = 0;
        for c in g["cases"].as_array().unwrap() {
            let prompt = c["prompt"].as_str().unwrap();
            let pids = ids(&c["prompt_ids"]);
            let want = ids(&c["greedy_ids"]);
            assert_eq!(
                tok.encode(prompt),
                pids,
                "{name}: tokenizer ids of {prompt:?}"
            );
            let opts = Options {
                ctx: Some(256),
                ..Options::default()
            };
            let mut st = model.state(&opts).unwrap();
            let mut logits = model.prefill(&mut st, &pids, None).unwrap().to_vec();
            let mut got = Vec::new();
            for _ in 0..want.len() {
                let next = argmax(&logits);
                got.push(next);
                logits = model.decode(&mut st, next).unwrap().to_vec();
            }
            let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let margins: Vec<f64> = c["margins"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_f64().unwrap())
                .collect();
            let first_tie = margins
                .iter()
                .position(|&m| m < NEAR_TIE)
                .unwrap_or(want.len());
            let diverged = match margins.get(same) {
                Some(m) if same < want.len() => {
                    format!("diverges at {same}, where the f32 top-1/top-2 margin is {m:.3}")
                }
                _ => "no divergence".to_string(),
            };
            eprintln!(
                "{name} {prompt:?}: {same}/{} ids as transformers f32 ({diverged}; first near-tie at {first_tie}); krafla: {:?}",
                want.len(),
                String::from_utf8_lossy(&tok.decode(&got))
            );
            assert!(
                same >= first_tie,
                "{name} {prompt:?}: diverges at {same}, before the first near-tie at {first_tie}"
            );
            if same == want.len() {
                full += 1;
            }
        }
        eprintln!("{name}: {full}/5 prompts agree on all 16 ids");
    }
}

// ---- issue 17: chat on the real checkpoints (mlb-run --chat's library path) ----

mod chat {
    use std::ops::ControlFlow;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use krafla::chat::Message;
    use krafla::model::{Options, SamplerOpts};
    use krafla::session::{
        ChatEvent, ChatOptions, ChatSession, Engine, GenerateOptions, LoadOptions, StopReason,
    };

    use super::real_dir;
    use crate::util::{bin_path, testdata};

    /// `REAL/name` at Q8_0 in `tmp` with its `.mlt` beside (the chat template `template`
    /// instead of the checkpoint's, if given); `None` (and a SKIP line) without it.
    fn convert(name: &str, tmp: &Path, template: Option<&Path>) -> Option<PathBuf> {
        let Some(real) = real_dir() else {
            eprintln!("SKIP chat {name}: set KRAFLA_REAL_DIR to the output of shared/tools/real-checkpoints.sh");
            return None;
        };
        let src = real.join(name);
        if !src.join("model.safetensors").exists() {
            eprintln!("SKIP chat {name}: no {}", src.display());
            return None;
        }
        let mlb = tmp.join(format!("{name}.mlb"));
        let o = Command::new(bin_path("mlb-convert"))
            .arg(&src)
            .args(["--wtype", "q8_0", "-o"])
            .arg(&mlb)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let mut c = Command::new(bin_path("mlt-convert"));
        c.arg(src.join("tokenizer.json"))
            .arg("-q")
            .arg("-o")
            .arg(mlb.with_extension("mlt"));
        if let Some(t) = template {
            c.arg("--chat-template").arg(t);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        Some(mlb)
    }

    fn greedy(max_tokens: usize) -> ChatOptions {
        ChatOptions {
            generate: GenerateOptions {
                max_tokens,
                sampling: SamplerOpts {
                    temp: 0.0,
                    ..SamplerOpts::default()
                },
                ..GenerateOptions::default()
            },
            ..ChatOptions::default()
        }
    }

    fn quiet(_: ChatEvent<'_>) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }

    /// The id of a special token's text.
    fn id_of(e: &Engine, text: &str) -> u32 {
        let tok = e.tokenizer().unwrap();
        (0..e.config().vocab as u32)
            .find(|&i| tok.token_bytes(i) == Some(text.as_bytes()))
            .unwrap_or_else(|| panic!("no token {text:?}"))
    }

    /// SmolLM2-135M-Instruct answers a fixed question and stops by itself at
    /// `<|im_end|>`; a second turn prefills only its new ids, with the bits of a fresh
    /// prefill of the whole conversation, and stops there too.
    #[test]
    fn real_smollm2_chat_stops_at_im_end() {
        let tmp = tempfile::tempdir().unwrap();
        let Some(mlb) = convert("smollm2-135m", tmp.path(), None) else {
            return;
        };
        let e = Engine::load(&LoadOptions::new(&mlb)).unwrap();
        let im_end = id_of(&e, "<|im_end|>");
        assert!(e.stop_ids().contains(&im_end), "{:?}", e.stop_ids());
        let o = Options {
            ctx: Some(512),
            ..Options::default()
        };
        let mut chat = ChatSession::new(&e, &o, greedy(64)).unwrap();
        let r = chat.say("What is the capital of France?", quiet).unwrap();
        eprintln!("smollm2: {:?} ({:?})", r.text, r.stop);
        assert_eq!(r.stop, StopReason::StopId(im_end), "{:?}", r.text);
        assert!(r.text.contains("Paris"), "{:?}", r.text);
        chat.push(Message::new("user", "And the capital of Germany?"));
        let info = chat.prefill().unwrap();
        let ids = chat.session().tokens().to_vec();
        let mut st = e.model().state(&o).unwrap();
        let fresh = e.model().prefill(&mut st, &ids, None).unwrap().to_vec();
        assert!(
            chat.session().logits().unwrap() == fresh,
            "incremental != fresh"
        );
        assert!(info.fed < ids.len() / 2, "{info:?} of {}", ids.len());
        let r = chat.respond(quiet).unwrap();
        eprintln!("smollm2 turn 2: {:?} ({:?})", r.text, r.stop);
        assert_eq!(r.stop, StopReason::StopId(im_end), "{:?}", r.text);
        assert!(r.text.contains("Berlin"), "{:?}", r.text);
    }

    /// A Gemma 3 conversation (the committed Gemma 3 template) ends at `<end_of_turn>`:
    /// it is in the stop set (from the template), the rendered prompt is Gemma's, and a
    /// generation that reaches it stops there without printing it. The checkpoint of
    /// real-checkpoints.sh is the base (not instruction-tuned) Gemma 3 270M, which does
    /// not write `<end_of_turn>` by itself, so the test says whether it stopped
    /// unforced and then makes it the next token with a logit bias.
    #[test]
    fn real_gemma3_chat_stops_at_end_of_turn() {
        let tmp = tempfile::tempdir().unwrap();
        let template = testdata().join("chat/templates/gemma3.jinja");
        let Some(mlb) = convert("gemma3-270m", tmp.path(), Some(&template)) else {
            return;
        };
        let e = Engine::load(&LoadOptions::new(&mlb)).unwrap();
        let eot = id_of(&e, "<end_of_turn>");
        let sources = e.stop_set().sources(eot);
        assert!(sources.contains(&"end_of_turn"), "{sources:?}");
        let o = Options {
            ctx: Some(512),
            ..Options::default()
        };
        let mut chat = ChatSession::new(&e, &o, greedy(24)).unwrap();
        chat.push(Message::new("user", "What is 2+2?"));
        chat.push(Message::new("assistant", "4"));
        chat.push(Message::new("user", "What is the capital of Italy?"));
        let r = chat.respond(quiet).unwrap();
        eprintln!("gemma3 (unforced): {:?} ({:?})", r.text, r.stop);
        let start = id_of(&e, "<start_of_turn>");
        let toks = chat.session().tokens();
        assert_eq!(&toks[..2], &[id_of(&e, "<bos>"), start]);
        assert_eq!(
            toks.iter().filter(|&&t| t == eot).count(),
            3,
            "one per message"
        );
        let forced = ChatOptions {
            generate: GenerateOptions {
                sampling: SamplerOpts {
                    temp: 0.0,
                    logit_bias: vec![(eot, 1000.0)],
                    ..SamplerOpts::default()
                },
                ..greedy(24).generate
            },
            ..ChatOptions::default()
        };
        let mut chat = ChatSession::new(&e, &o, forced).unwrap();
        let r = chat.say("What is the capital of Italy?", quiet).unwrap();
        assert_eq!(
            (r.stop, &r.tokens[..], &r.text[..]),
            (StopReason::StopId(eot), &[eot][..], "")
        );
    }
}
