//! The session API (`krafla::session`): feeding, generation and its stop reasons,
//! snapshots, truncation and rewinding, against the model's own prefill on every
//! synthetic case (attention, sliding rings, Qwen3.5's delta rule); seeded sampling
//! on every tier and thread count; mlb-run with no EOS known.

use std::ops::ControlFlow;

use krafla::format::mlb::header::layer_flag;
use krafla::format::mlb::Mlb;
use krafla::kernels::pool::Pool;
use krafla::kernels::{self, Tier};
use krafla::model::{Model, Packs, Sampler, SamplerOptions, StateOptions};
use krafla::session::{
    Engine, GenerateOptions, Generation, LoadOptions, Session, SessionError, StopReason,
};
use krafla::tokenizer::Tokenizer;

use crate::run::{all_logits, cases, load, opts, tokens, write_case, Case};
use crate::util::testdata;
use crate::util::tool::tool;

fn engine(c: &Case, seed: u64) -> Engine {
    Engine::new(load(c, seed), Packs::none(), None).unwrap()
}

/// The logits of the last of `ids`, prefilled fresh.
fn fresh(m: &Model, o: &StateOptions, ids: &[u32]) -> Vec<f32> {
    let mut st = m.state(o).unwrap();
    m.prefill(&mut st, ids, None).unwrap().to_vec()
}

/// mlb-run's generation loop before the session API: sample, stop at `eos`, decode.
fn old_loop(m: &Model, prompt: &[u32], n: usize, so: SamplerOptions, eos: Option<u32>) -> Vec<u32> {
    let mut st = m.state(&StateOptions::default()).unwrap();
    let mut logits = m.prefill(&mut st, prompt, None).unwrap().to_vec();
    let mut sampler = Sampler::new(so);
    let mut out = Vec::new();
    for i in 0..n {
        let next = sampler.sample(&logits);
        out.push(next);
        if Some(next) == eos || i + 1 == n || st.pos() >= st.ctx() {
            break;
        }
        logits = m.decode(&mut st, next).unwrap().to_vec();
    }
    out
}

fn generate(s: &mut Session, o: &GenerateOptions) -> Generation {
    s.generate(o, |_| ControlFlow::Continue(())).unwrap()
}

fn sampling(seed: u64) -> SamplerOptions {
    SamplerOptions {
        temp: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed,
        ..SamplerOptions::default()
    }
}

#[test]
fn feeding_gives_the_bits_of_prefill() {
    for c in cases() {
        let e = engine(&c, 11);
        let toks = tokens(c.h.vocab, 19, 5);
        let want = all_logits(e.model(), &StateOptions::default(), &toks);
        let v = c.h.vocab as usize;
        let mut s = e.session(&StateOptions::default()).unwrap();
        let mut got = Vec::new();
        // Two chunks, then one by one: every position's logits.
        let mut each = |_: usize, l: &[f32]| got.extend_from_slice(l);
        s.feed_with(&toks[..7], Some(&mut each)).unwrap();
        s.feed_with(&toks[7..12], Some(&mut each)).unwrap();
        for &t in &toks[12..] {
            let l = s.feed(&[t]).unwrap().to_vec();
            got.extend_from_slice(&l);
        }
        assert!(got == want, "{}", c.name);
        assert!(s.logits().unwrap() == &want[want.len() - v..], "{}", c.name);
        assert_eq!((s.pos(), s.tokens()), (19, &toks[..]), "{}", c.name);
        let other = (toks[2] + 1) % c.h.vocab;
        assert_eq!(s.common_prefix(&[toks[0], toks[1], other]), 2);
    }
}

#[test]
fn generation_equals_the_old_loop() {
    for c in cases() {
        let e = engine(&c, 3);
        let prompt = tokens(c.h.vocab, 6, 8);
        for so in [SamplerOptions::default(), sampling(42)] {
            let want = old_loop(e.model(), &prompt, 12, so.clone(), None);
            let mut s = e.session(&StateOptions::default()).unwrap();
            s.feed(&prompt).unwrap();
            let o = GenerateOptions {
                max_tokens: 12,
                sampling: so.clone(),
                ..GenerateOptions::default()
            };
            let g = generate(&mut s, &o);
            assert_eq!(g.tokens, want, "{}", c.name);
            assert_eq!(g.stop, StopReason::Length);
            // The last token is not fed; the session holds the prompt and the rest.
            assert_eq!(s.tokens(), [&prompt[..], &want[..11]].concat());
            assert!(s.logits().is_none());
            // Without a tokenizer the text is the ids.
            let ids: Vec<String> = want.iter().map(u32::to_string).collect();
            assert_eq!(g.text, ids.join(" "));
            // A stop id: the same tokens up to its first appearance, which ends it.
            let stop = want[4];
            let first = want.iter().position(|&t| t == stop).unwrap();
            let mut s = e.session(&StateOptions::default()).unwrap();
            s.feed(&prompt).unwrap();
            let g = generate(
                &mut s,
                &GenerateOptions {
                    stop_ids: vec![stop],
                    ..o
                },
            );
            assert_eq!(g.tokens, want[..=first], "{}", c.name);
            assert_eq!(g.stop, StopReason::StopId(stop));
            assert_eq!(
                want[..=first],
                old_loop(e.model(), &prompt, 12, so.clone(), Some(stop))
            );
        }
    }
}

#[test]
fn stop_reasons() {
    let c = &cases()[0];
    let e = engine(c, 5);
    let prompt = tokens(c.h.vocab, 5, 2);
    let mut s = e.session(&opts(8)).unwrap();
    s.feed(&prompt).unwrap();
    let snap = s.snapshot();
    // The context: positions 5, 6, 7 are fed, the fourth token finds it full.
    let g = generate(&mut s, &GenerateOptions::default());
    assert_eq!(
        (g.stop, g.tokens.len(), s.pos()),
        (StopReason::ContextFull, 4, 8)
    );
    // Cancelled by the caller after two steps.
    s.restore(&snap).unwrap();
    let mut n = 0;
    let g = s
        .generate(&GenerateOptions::default(), |_| {
            n += 1;
            if n == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!((g.stop, g.tokens.len()), (StopReason::Cancelled, 2));
    // Generating again needs logits: feed the last token first.
    assert_eq!(
        s.generate(&GenerateOptions::default(), |_| ControlFlow::Continue(()))
            .unwrap_err(),
        SessionError::NoLogits
    );
    // Zero tokens: nothing sampled, the logits kept.
    s.restore(&snap).unwrap();
    let none = GenerateOptions {
        max_tokens: 0,
        ..GenerateOptions::default()
    };
    let g = generate(&mut s, &none);
    assert_eq!((g.stop, g.tokens.len()), (StopReason::Length, 0));
    assert!(s.logits().is_some());
    // A stop string (here over the ids' text): the text ends before it.
    let mut s = e.session(&StateOptions::default()).unwrap();
    s.feed(&prompt).unwrap();
    let snap = s.snapshot();
    let free = generate(&mut s, &GenerateOptions::default());
    let stop = format!(" {}", free.tokens[3]);
    let at = free.text.find(&stop).unwrap();
    assert!(at > 0);
    s.restore(&snap).unwrap();
    let g = generate(
        &mut s,
        &GenerateOptions {
            stop_strings: vec!["never there".into(), stop.clone()],
            ..GenerateOptions::default()
        },
    );
    assert_eq!(g.stop, StopReason::StopString(1));
    assert_eq!(g.text, free.text[..at]);
    assert!(g.tokens.len() <= 4 && free.tokens.starts_with(&g.tokens));
    // Bad options are refused before anything runs.
    let bad = GenerateOptions {
        stop_strings: vec![String::new()],
        ..GenerateOptions::default()
    };
    assert!(matches!(
        s.generate(&bad, |_| ControlFlow::Continue(())),
        Err(SessionError::BadOption { name: "stop", .. })
    ));
    let bad = GenerateOptions {
        sampling: SamplerOptions {
            logit_bias: vec![(c.h.vocab, 1.0)],
            ..SamplerOptions::default()
        },
        ..GenerateOptions::default()
    };
    assert!(matches!(
        s.generate(&bad, |_| ControlFlow::Continue(())),
        Err(SessionError::Sampling(_))
    ));
}

#[test]
fn snapshot_restore_truncate_and_rewind_give_the_bits_of_a_fresh_prefill() {
    for c in cases() {
        let e = engine(&c, 13);
        let m = e.model();
        let o = StateOptions::default();
        let a = tokens(c.h.vocab, 9, 21);
        let b = tokens(c.h.vocab, 8, 22);
        let d = tokens(c.h.vocab, 6, 23);
        let cat = |x: &[u32], y: &[u32]| [x, y].concat();
        // The session's logits are the bits of a fresh prefill of `ids`.
        let assert_fresh = |s: &Session, ids: &[u32]| {
            assert!(s.logits().unwrap() == fresh(m, &o, ids), "{}", c.name);
        };
        let mut s = e.session(&o).unwrap();
        s.feed(&a).unwrap();
        let snap = s.snapshot();
        assert_eq!(snap.pos(), 9);
        s.feed(&b).unwrap();
        assert_fresh(&s, &cat(&a, &b));
        // Restore: the logits and the next feed as if b had never come.
        s.restore(&snap).unwrap();
        assert_eq!(s.tokens(), &a[..]);
        assert_fresh(&s, &a);
        s.feed(&d).unwrap();
        assert_fresh(&s, &cat(&a, &d));
        // Again: positions before the snapshot were never rewritten.
        s.restore(&snap).unwrap();
        s.feed(&b[..3]).unwrap();
        assert_fresh(&s, &cat(&a, &b[..3]));
        // Truncation: free where the state allows it (no linear-attention layer, no
        // ring that has wrapped since position 5).
        let exact = !c.flags.contains(&layer_flag::LINEAR) && c.h.sliding_window == 0;
        let pos = s.pos();
        let r = s.truncate(5);
        assert_eq!(r.is_ok(), exact, "{}: {r:?}", c.name);
        if !exact {
            assert!(matches!(r, Err(SessionError::Truncate { to: 5, .. })));
            assert_eq!(s.pos(), pos, "a refused truncation changes nothing");
        } else {
            assert!(s.logits().is_none());
            s.feed(&d).unwrap();
            assert_fresh(&s, &cat(&a[..5], &d));
            // The snapshot's ids were rewritten from position 5 on.
            assert!(matches!(
                s.restore(&snap),
                Err(SessionError::SnapshotStale { pos: 9, .. })
            ));
            s.truncate(5).unwrap();
            s.feed(&a[5..]).unwrap();
            s.restore(&snap).unwrap();
        }
        // Rewind reaches any position: through the snapshot, or from the start.
        let mut s = e.session(&o).unwrap();
        s.feed(&cat(&a, &b)).unwrap();
        let refed = s.rewind(12, std::slice::from_ref(&snap)).unwrap();
        assert_eq!(refed, if exact { 0 } else { 3 }, "{}", c.name);
        s.feed(&d).unwrap();
        assert_fresh(&s, &cat(&cat(&a, &b[..3]), &d));
        let refed = s.rewind(4, &[]).unwrap();
        assert_eq!(refed, if exact { 0 } else { 4 }, "{}", c.name);
        s.feed(&d).unwrap();
        assert_fresh(&s, &cat(&a[..4], &d));
        assert!(s.truncate(s.pos() + 1).is_err());
        s.truncate(0).unwrap();
        s.feed(&d).unwrap();
        assert_fresh(&s, &d);
    }
}

#[test]
fn a_wrapped_ring_truncates_only_through_a_snapshot() {
    // Every layer slides over 5 positions in a ring of 5 slots.
    let c = &cases()[1];
    assert_eq!(c.h.sliding_window, 5);
    let e = engine(c, 17);
    let o = StateOptions::default();
    let ids = tokens(c.h.vocab, 14, 3);
    let mut s = e.session(&o).unwrap();
    s.feed(&ids[..6]).unwrap();
    let snap = s.snapshot();
    assert!(snap.bytes() > 0, "the rings are copied");
    s.feed(&ids[6..]).unwrap();
    // Position 6 would need 2..5, long overwritten; 13 needs 9..12, still there.
    assert!(matches!(
        s.truncate(6),
        Err(SessionError::Truncate { to: 6, pos: 14, .. })
    ));
    s.truncate(13).unwrap();
    s.feed(&[1]).unwrap();
    let want = fresh(e.model(), &o, &[&ids[..13], &[1]].concat());
    assert!(s.logits().unwrap() == want);
    assert_eq!(s.rewind(6, &[snap]).unwrap(), 0);
    s.feed(&[2, 3]).unwrap();
    let want = fresh(e.model(), &o, &[&ids[..6], &[2, 3]].concat());
    assert!(s.logits().unwrap() == want);
    // Not full ring (ring: false): truncation is free.
    let full = StateOptions { ring: false, ..o };
    let mut s = e.session(&full).unwrap();
    s.feed(&ids).unwrap();
    s.truncate(6).unwrap();
    s.feed(&[2, 3]).unwrap();
    assert!(s.logits().unwrap() == want);
}

#[test]
fn snapshots_belong_to_their_engine_and_layout() {
    let c = &cases()[7];
    let (e1, e2) = (engine(c, 1), engine(c, 1));
    let mut s1 = e1.session(&StateOptions::default()).unwrap();
    s1.feed(&[1, 2, 3]).unwrap();
    let snap = s1.snapshot();
    let mut s2 = e2.session(&StateOptions::default()).unwrap();
    assert_eq!(
        s2.restore(&snap).unwrap_err(),
        SessionError::SnapshotMismatch
    );
    let mut small = e1.session(&opts(16)).unwrap();
    assert_eq!(
        small.restore(&snap).unwrap_err(),
        SessionError::SnapshotMismatch
    );
    // Another session of the same engine: its full-attention layer (layer 1) must
    // still hold the snapshot's ids.
    let mut other = e1.session(&StateOptions::default()).unwrap();
    assert!(matches!(
        other.restore(&snap),
        Err(SessionError::SnapshotStale { .. })
    ));
    other.feed(&[1, 2, 3, 4]).unwrap();
    other.restore(&snap).unwrap();
    assert!(other.logits() == s1.logits());
}

#[test]
fn sessions_over_one_engine_are_independent() {
    let c = &cases()[5];
    let e = engine(c, 9);
    let (p, q) = (tokens(c.h.vocab, 7, 1), tokens(c.h.vocab, 5, 2));
    let go = GenerateOptions {
        max_tokens: 10,
        sampling: sampling(3),
        ..GenerateOptions::default()
    };
    let alone = |ids: &[u32]| {
        let mut s = e.session(&StateOptions::default()).unwrap();
        s.feed(ids).unwrap();
        generate(&mut s, &go).tokens
    };
    let (wp, wq) = (alone(&p), alone(&q));
    // Interleaved on one thread, step by step.
    let mut a = e.session(&StateOptions::default()).unwrap();
    let mut b = e.session(&StateOptions::default()).unwrap();
    a.feed(&p[..3]).unwrap();
    b.feed(&q).unwrap();
    a.feed(&p[3..]).unwrap();
    assert_eq!(generate(&mut a, &go).tokens, wp);
    assert_eq!(generate(&mut b, &go).tokens, wq);
    // On two threads at once.
    std::thread::scope(|sc| {
        let ta = sc.spawn(|| alone(&p));
        let tb = sc.spawn(|| alone(&q));
        assert_eq!(ta.join().unwrap(), wp);
        assert_eq!(tb.join().unwrap(), wq);
    });
}

#[test]
fn seeded_sampling_is_the_same_on_every_tier_and_thread_count() {
    let so = SamplerOptions {
        temp: 1.5,
        top_k: 0,
        top_p: 0.95,
        min_p: 0.02,
        seed: 7,
        repeat_penalty: 1.3,
        presence_penalty: 1.0,
        frequency_penalty: 0.5,
        logit_bias: vec![(3, 1.0)],
        logprobs: true,
        top_logprobs: 2,
        ..SamplerOptions::default()
    };
    for c in [&cases()[3], &cases()[7]] {
        let m = load(c, 4);
        let prompt = tokens(c.h.vocab, 6, 9);
        let run = |packed: bool| {
            let mlb = Mlb::from_bytes(m.bytes()).unwrap();
            let packs = match packed {
                true => Packs::new(&mlb, &kernels::kernels()).unwrap(),
                false => Packs::none(),
            };
            let e = Engine::new(mlb, packs, None).unwrap();
            let mut s = e.session(&StateOptions::default()).unwrap();
            s.feed(&prompt).unwrap();
            let mut lps = Vec::new();
            let g = s
                .generate(
                    &GenerateOptions {
                        max_tokens: 16,
                        sampling: so.clone(),
                        ..GenerateOptions::default()
                    },
                    |st| {
                        lps.push(st.logprobs.clone().unwrap());
                        ControlFlow::Continue(())
                    },
                )
                .unwrap();
            (g.tokens, lps)
        };
        let base = kernels::with_tier(Tier::Scalar, || run(false)).unwrap();
        let distinct: std::collections::BTreeSet<_> = base.0.iter().collect();
        assert!(distinct.len() > 3, "{}: {:?}", c.name, base.0);
        for t in kernels::supported_tiers() {
            for packed in [false, true] {
                let got = kernels::with_tier(t, || run(packed)).unwrap();
                assert!(got == base, "{}: tier {t}, packed {packed}", c.name);
            }
        }
        for threads in [1, 2, 3] {
            let got = Pool::leak(threads).install(|| run(true));
            assert!(got == base, "{}: {threads} threads", c.name);
        }
    }
}

/// The bundled default model through the session: the old loop's ids (greedy and
/// seeded), and mlb-run's text for them.
#[test]
fn default_model_through_the_session() {
    let dir = testdata().join("default");
    let tmp = tempfile::tempdir().unwrap();
    let mlb = tmp.path().join("default.mlb");
    let mlt = tmp.path().join("default.mlt");
    for (bin, out) in [("mlb-convert", &mlb), ("mlt-convert", &mlt)] {
        let src = if bin == "mlb-convert" {
            dir.clone()
        } else {
            dir.join("tokenizer.json")
        };
        tool(bin).arg(&src).arg("-o").arg(out).ok();
    }
    let e = Engine::load(&LoadOptions::new(&mlb)).unwrap();
    let tok = Tokenizer::from_path(&mlt).unwrap();
    assert_eq!(e.stop_ids(), tok.eos().into_iter().collect::<Vec<_>>());
    let prompt = "The Python interpreter";
    let ids = tok.encode(prompt);
    for so in [SamplerOptions::default(), sampling(1)] {
        let want = old_loop(e.model(), &ids, 24, so.clone(), tok.eos());
        let mut s = e.session(&StateOptions::default()).unwrap();
        s.feed_text(prompt).unwrap();
        assert_eq!(s.tokens(), &ids[..]);
        let g = generate(
            &mut s,
            &GenerateOptions {
                max_tokens: 24,
                sampling: so.clone(),
                ignore_eos: false,
                stop_ids: e.stop_ids(),
                stop_strings: Vec::new(),
            },
        );
        assert_eq!(g.tokens, want);
        let upto: Vec<u32> = want
            .iter()
            .copied()
            .take_while(|&t| Some(t) != tok.eos())
            .collect();
        assert_eq!(g.text, String::from_utf8_lossy(&tok.decode(&upto)));
        let o = tool("mlb-run")
            .arg(&mlb)
            .args([
                "--prompt",
                prompt,
                "-n",
                "24",
                "--seed",
                &so.seed.to_string(),
            ])
            .args([
                "--temp",
                &so.temp.to_string(),
                "--top-k",
                &so.top_k.to_string(),
            ])
            .args(["--top-p", &so.top_p.to_string()])
            .ok();
        assert_eq!(
            String::from_utf8(o.stdout_bytes).unwrap(),
            format!("{}\n", g.text)
        );
    }
    // A later text is fed without the BOS the tokenizer puts first.
    let mut s = e.session(&StateOptions::default()).unwrap();
    s.feed_text("The").unwrap();
    s.feed_text(" Python interpreter").unwrap();
    let bos = e.bos_added();
    let mut want = tok.encode("The");
    let more = tok.encode(" Python interpreter");
    want.extend(&more[bos.is_some() as usize..]);
    assert_eq!(s.tokens(), &want[..]);
}

/// With no EOS known (no tokenizer), no id ends a generation: not even id 2, which
/// mlb-run used to take for EOS.
#[test]
fn mlb_run_without_eos_stops_only_at_n() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_case(dir.path(), 0, 5);
    let mut saw_two = false;
    for seed in 0..20 {
        let o = tool("mlb-run")
            .arg(&path)
            .args([
                "--tokens",
                "1 5 9",
                "-n",
                "40",
                "--temp",
                "1.5",
                "--top-k",
                "0",
                "--top-p",
                "1",
                "--seed",
                &seed.to_string(),
            ])
            .ok()
            .stdout_bytes;
        let o = String::from_utf8(o).unwrap();
        let ids: Vec<&str> = o.split_whitespace().collect();
        assert_eq!(ids.len(), 40, "seed {seed}: {o}");
        saw_two |= ids[..39].contains(&"2");
    }
    assert!(
        saw_two,
        "id 2 was never sampled before the end: the test shows nothing"
    );
}

#[test]
fn mlb_run_help_snapshot() {
    insta::assert_snapshot!(tool("mlb-run").arg("--help").ok().stdout);
}
