//! Speculative decoding (`krafla::session::speculative`): greedy output identical to
//! plain decoding, with lookup drafts and draft models (one that always agrees, one
//! that rarely does), on every synthetic case (sliding rings, the delta rule's
//! snapshots), on converted fixtures (a Q4_0 draft for its Q8_0 model) and on the
//! default model through mlb-run; the session left as plain decoding leaves it;
//! sampling with a draft equal to the model keeps every draft; refusals.

use std::ops::ControlFlow;

use krafla::model::{Packs, SamplerOptions, StateOptions};
use krafla::session::speculative::{check_draft, DraftSource, SpecOptions, SpecStats, Speculator};
use krafla::session::{Engine, GenerateOptions, Generation, LoadOptions, Session};

use crate::run::{cases, load, tokens};
use crate::util::fixtures::{convert, convert_tokenizer, with_reference};
use crate::util::testdata;
use crate::util::tool::tool;

fn engine_of(c: usize, seed: u64) -> Engine {
    Engine::new(load(&cases()[c], seed), Packs::none(), None).unwrap()
}

/// A prompt that repeats itself, so that lookup finds n-grams to draft.
fn repetitive(vocab: u32, seed: u64) -> Vec<u32> {
    let base = tokens(vocab, 7, seed);
    [
        &base[..],
        &tokens(vocab, 3, seed + 1),
        &base[..],
        &base[..4],
    ]
    .concat()
}

fn greedy(max_tokens: usize, repeat_penalty: f32) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: SamplerOptions {
            repeat_penalty,
            ..SamplerOptions::default()
        },
        ignore_eos: true,
        stop_ids: Vec::new(),
        stop_strings: Vec::new(),
    }
}

fn plain(s: &mut Session, o: &GenerateOptions) -> Generation {
    s.generate(o, |_| ControlFlow::Continue(())).unwrap()
}

/// Generates with `spec`; also checks that the steps seen are the generation's.
fn speculative(s: &mut Session, o: &GenerateOptions, spec: &mut Speculator) -> Generation {
    let mut seen = Vec::new();
    let g = s
        .generate_speculative(o, spec, |st| {
            seen.push(st.id);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(seen, g.tokens);
    g
}

/// Lookup drafts, or `draft`'s, for session `s` (made with `o`).
fn speculator<'d>(
    spec: &SpecOptions,
    draft: Option<&'d Engine>,
    s: &Session,
    o: &StateOptions,
    go: &GenerateOptions,
) -> Speculator<'d> {
    let state = StateOptions {
        ctx: Some(s.ctx()),
        ..*o
    };
    match draft {
        Some(d) => Speculator::with_model(spec, d, &state, &go.sampling).unwrap(),
        None => Speculator::lookup(spec),
    }
}

/// After a generation, two sessions that should hold the same state: the same ids, and
/// the same logits for the same next id (the caches rolled back exactly).
fn same_state(a: &mut Session, b: &mut Session, next: u32, what: &str) {
    assert_eq!(a.tokens(), b.tokens(), "{what}: ids held");
    assert!(a.logits().is_none() && b.logits().is_none(), "{what}");
    let la = a.feed(&[next]).unwrap().to_vec();
    let lb = b.feed(&[next]).unwrap().to_vec();
    assert!(la == lb, "{what}: logits after the generation differ");
}

/// Every synthetic case, greedy (plain and with a repetition penalty): lookup drafts,
/// a draft model that is the model itself (every draft kept), and one of other weights
/// (most refused) give the ids plain decoding gives, and leave the session as it.
#[test]
fn greedy_speculation_gives_the_plain_ids_on_every_case() {
    let spec = SpecOptions {
        draft_max: 5,
        p_min: 0.0,
        ..SpecOptions::new(DraftSource::Lookup)
    };
    let other = engine_of(0, 99);
    for (ci, c) in cases().iter().enumerate() {
        let e = engine_of(ci, 31);
        let same = engine_of(ci, 31);
        let o = StateOptions {
            spare: spec.spare(),
            ..StateOptions::default()
        };
        let prompt = repetitive(c.h.vocab, 40 + ci as u64);
        let mut drafts: Vec<(&str, Option<&Engine>)> = vec![("lookup", None)];
        if check_draft(&e, &same).is_ok() {
            drafts.push(("itself", Some(&same)));
        }
        if check_draft(&e, &other).is_ok() {
            drafts.push(("other", Some(&other)));
        }
        for penalty in [1.0, 1.3] {
            let go = greedy(40, penalty);
            for &(name, d) in &drafts {
                let what = format!("{} penalty {penalty} draft {name}", c.name);
                let mut a = e.session(&o).unwrap();
                a.feed(&prompt).unwrap();
                let want = plain(&mut a, &go);
                let mut b = e.session(&o).unwrap();
                b.feed(&prompt).unwrap();
                let mut sp = speculator(&spec, d, &b, &o, &go);
                let got = speculative(&mut b, &go, &mut sp);
                assert_eq!(got.tokens, want.tokens, "{what}");
                assert_eq!(got.stop, want.stop, "{what}");
                // (A repetition penalty over the whole window keeps a tiny model from
                // repeating any id: lookup then has nothing to draft.)
                if penalty == 1.0 || d.is_some() {
                    assert!(sp.stats.rounds > 0, "{what}: {:?}", sp.stats);
                }
                if name == "itself" {
                    assert_eq!(sp.stats.accepted, sp.stats.drafted, "{what}");
                }
                same_state(&mut a, &mut b, 5, &what);
            }
        }
    }
}

/// Sampling with a draft model equal to the model: p = q at every position, so every
/// draft is kept; the counts add up; the same seed gives the same ids twice.
#[test]
fn sampling_with_an_identical_draft_keeps_every_draft() {
    let e = engine_of(0, 3);
    let same = engine_of(0, 3);
    let spec = SpecOptions {
        draft_max: 4,
        p_min: 0.0,
        ..SpecOptions::new(DraftSource::Model("same".into()))
    };
    let go = GenerateOptions {
        sampling: SamplerOptions {
            temp: 0.9,
            top_k: 20,
            top_p: 0.95,
            seed: 11,
            ..SamplerOptions::default()
        },
        ..greedy(30, 1.0)
    };
    let o = StateOptions::default();
    let run = || {
        let mut s = e.session(&o).unwrap();
        s.feed(&[1, 5, 9]).unwrap();
        let state = StateOptions {
            ctx: Some(s.ctx()),
            ..o
        };
        let mut sp = Speculator::with_model(&spec, &same, &state, &go.sampling).unwrap();
        let g = speculative(&mut s, &go, &mut sp);
        (g, sp.stats)
    };
    let (g, st) = run();
    assert_eq!(g.tokens.len(), 30);
    assert!(st.drafted > 0 && st.accepted == st.drafted, "{st:?}");
    assert_eq!(run().0.tokens, g.tokens, "seeded: the same ids again");
    let _ = SpecStats::default().acceptance();
}

/// A draft model must share the vocabulary and be rolled back by truncation.
#[test]
fn draft_models_are_checked() {
    let cs = cases();
    let delta = cs
        .iter()
        .position(|c| c.name.contains("delta"))
        .expect("a delta-rule case");
    let e = engine_of(0, 1);
    let why = check_draft(&e, &engine_of(delta, 1)).unwrap_err();
    assert!(why.contains("linear-attention"), "{why}");
    let mut h = cs[0].h;
    h.vocab = 128;
    let other = Engine::new(
        krafla::format::mlb::Mlb::from_bytes(&krafla::synth::synth_file(&h, &[], 1)).unwrap(),
        Packs::none(),
        None,
    )
    .unwrap();
    let why = check_draft(&e, &other).unwrap_err();
    assert!(why.contains("vocab"), "{why}");
    assert!(SpecOptions {
        draft_max: 0,
        ..SpecOptions::new(DraftSource::Lookup)
    }
    .validate()
    .is_err());
}

/// Converted fixtures (sliding windows, softcaps, the delta rule): a Q4_0 copy drafting
/// for the Q8_0 model, and lookup, greedy: the plain ids.
#[test]
fn fixtures_q4_0_drafts_for_q8_0_give_the_plain_ids() {
    let root = testdata().join("models");
    let names = [
        "llama",
        "gemma2",
        "gemma3_text",
        "mistral_sliding",
        "qwen3",
        "qwen3_5_text",
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (name, dir, toks) in with_reference(&root, &names) {
        let q8 = tmp.path().join(format!("{name}-q8.mlb"));
        let q4 = tmp.path().join(format!("{name}-q4.mlb"));
        convert(&dir, &q8, &["--wtype", "q8_0"]);
        convert(&dir, &q4, &["--wtype", "q4_0"]);
        let e = Engine::load(&LoadOptions::new(&q8)).unwrap();
        let d = Engine::load(&LoadOptions::new(&q4)).unwrap();
        let spec = SpecOptions {
            draft_max: 6,
            p_min: 0.0,
            ..SpecOptions::new(DraftSource::Lookup)
        };
        let o = StateOptions {
            spare: spec.spare(),
            ..StateOptions::default()
        };
        let prompt = &toks[..toks.len().min(12)];
        let go = greedy(48, 1.0);
        let mut sources = vec![None];
        if check_draft(&e, &d).is_ok() {
            sources.push(Some(&d));
        }
        for src in sources {
            let what = format!(
                "{name}: draft {}",
                if src.is_some() { "q4_0" } else { "lookup" }
            );
            let mut a = e.session(&o).unwrap();
            a.feed(prompt).unwrap();
            let want = plain(&mut a, &go);
            let mut b = e.session(&o).unwrap();
            b.feed(prompt).unwrap();
            let mut sp = speculator(&spec, src, &b, &o, &go);
            let got = speculative(&mut b, &go, &mut sp);
            assert_eq!(got.tokens, want.tokens, "{what} ({:?})", sp.stats);
            same_state(&mut a, &mut b, 3, &what);
        }
    }
}

/// The bundled default model through mlb-run: `--lookup` and `--draft` (its Q4_0
/// conversion) print the text plain greedy decoding prints, and a line of counts.
#[test]
fn mlb_run_speculative_prints_the_plain_text() {
    let src = testdata().join("default");
    let tmp = tempfile::tempdir().unwrap();
    let (mlb, q4) = (tmp.path().join("m.mlb"), tmp.path().join("d.mlb"));
    convert(&src, &mlb, &["--wtype", "q8_0"]);
    convert(&src, &q4, &["--wtype", "q4_0"]);
    let tok = src.join("tokenizer.json");
    for out in [tmp.path().join("m.mlt"), tmp.path().join("d.mlt")] {
        convert_tokenizer(&tok, &out);
    }
    let run = |extra: &[&str]| {
        let r = tool("mlb-run")
            .arg(&mlb)
            .args([
                "--prompt",
                "def f(x):\n    return x\n\ndef g(x):\n    return",
                "-n",
                "40",
                "--temp",
                "0",
                "--ignore-eos",
            ])
            .args(extra)
            .ok();
        (r.stdout, r.stderr)
    };
    let (want, _) = run(&[]);
    for extra in [
        vec!["--lookup"],
        vec!["--draft", q4.to_str().unwrap(), "--draft-max", "4"],
    ] {
        let (got, err) = run(&extra);
        assert_eq!(got, want, "{extra:?}");
        assert!(err.contains("speculative: "), "{extra:?}: {err}");
    }
    // A draft of another vocabulary is refused in one line.
    let other = tmp.path().join("other.mlb");
    std::fs::write(&other, krafla::synth::synth_file(&cases()[0].h, &[], 1)).unwrap();
    let err = tool("mlb-run")
        .arg(&mlb)
        .args(["--prompt", "a", "-n", "2", "--draft"])
        .arg(&other)
        .fails_with(1);
    assert!(err.contains("--draft") && err.contains("vocab"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
