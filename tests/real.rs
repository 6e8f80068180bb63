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
