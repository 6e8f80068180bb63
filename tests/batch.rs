//! Continuous batching and KV cache types: several sequences through one forward step
//! (`Model::forward_batch`, `session::feed_batch`) give each sequence the bits it gets
//! alone, on every synthetic case and on converted fixtures (sliding windows, softcaps,
//! the delta rule), every tier, 1-3 threads, packed and not, every KV cache type;
//! errors name the sequence and change nothing; f16 and Q8_0 caches stay close to f32.

use krafla::format::mlb::header::wtype;
use krafla::format::mlb::Mlb;
use krafla::kernels::counters::{self, Op};
use krafla::kernels::pool::Pool;
use krafla::kernels::{self, KvType, Tier};
use krafla::model::{Model, ModelError, Packs, State, StateOptions};
use krafla::session::{feed_batch, Engine, Session, SessionError};

use crate::run::{all_logits, cases, load, nrmse, opts, tokens, top1, write_case};
use crate::util::fixtures::{convert, read_f32, with_reference};
use crate::util::tool::tool;
use crate::util::{testdata, tiers};

/// xorshift64 in 0..n.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// A schedule of batched steps: each sequence's ids, and per step how many of its next
/// ids each sequence feeds (0: skipped; 1: a decode step; more: a prefill chunk).
struct Plan {
    ids: Vec<Vec<u32>>,
    steps: Vec<Vec<usize>>,
}

/// `n` sequences of 6..30 ids; each step, a sequence with ids left takes 0, 1 (most
/// often) or a chunk of 2..9.
fn plan(vocab: u32, n: usize, seed: u64) -> Plan {
    let mut r = Rng(seed | 1);
    let ids: Vec<Vec<u32>> = (0..n)
        .map(|i| tokens(vocab, 6 + r.below(25), seed + 7 * i as u64))
        .collect();
    let mut done = vec![0; n];
    let mut steps = Vec::new();
    while done.iter().zip(&ids).any(|(&d, l)| d < l.len()) {
        let step: Vec<usize> = (0..n)
            .map(|i| {
                let left = ids[i].len() - done[i];
                let want = match r.below(6) {
                    0 => 0,
                    1..=3 => 1,
                    _ => 2 + r.below(8),
                };
                want.min(left)
            })
            .collect();
        for (d, s) in done.iter_mut().zip(&step) {
            *d += s;
        }
        steps.push(step);
    }
    Plan { ids, steps }
}

/// Runs `p` through `forward_batch` (steps of at most `budget` tokens per pass) and
/// checks each sequence's logits against `want` (every position's logits of the
/// sequence alone): the last fed position's after every step, or with `every` all of
/// them. Returns nothing; panics naming `what`, the step and the sequence.
fn run_plan(
    m: &Model,
    o: &StateOptions,
    p: &Plan,
    want: &[Vec<f32>],
    budget: usize,
    every: bool,
    what: &str,
) {
    let vocab = m.cfg.vocab;
    let mut states: Vec<State> = p.ids.iter().map(|_| m.state(o).unwrap()).collect();
    let ctx = states[0].ctx();
    let mut bs = m.batch_scratch(budget, Some(ctx)).unwrap();
    let mut done = vec![0; p.ids.len()];
    for (si, step) in p.steps.iter().enumerate() {
        let mut got: Vec<Vec<(usize, Vec<f32>)>> = vec![Vec::new(); p.ids.len()];
        {
            let mut seqs: Vec<(&mut State, &[u32])> = states
                .iter_mut()
                .enumerate()
                .map(|(i, st)| (st, &p.ids[i][done[i]..done[i] + step[i]]))
                .collect();
            let mut sink = |i: usize, pos: usize, l: &[f32]| got[i].push((pos, l.to_vec()));
            m.forward_batch(&mut bs, &mut seqs, every, &mut sink)
                .unwrap();
        }
        for (i, &n) in step.iter().enumerate() {
            let at = format!("{what}: step {si}, sequence {i}");
            let positions: Vec<usize> = match (n, every) {
                (0, _) => vec![],
                (_, true) => (done[i]..done[i] + n).collect(),
                (_, false) => vec![done[i] + n - 1],
            };
            assert_eq!(
                got[i].iter().map(|g| g.0).collect::<Vec<_>>(),
                positions,
                "{at}: positions given to the sink"
            );
            for (pos, l) in &got[i] {
                let w = &want[i][pos * vocab..(pos + 1) * vocab];
                assert!(
                    l[..] == w[..],
                    "{at}: logits of position {pos} differ from alone"
                );
            }
            done[i] += n;
            assert_eq!(states[i].pos(), done[i], "{at}: position");
        }
    }
}

/// Every position's logits of each sequence of `p`, each run alone.
fn alone(m: &Model, o: &StateOptions, p: &Plan) -> Vec<Vec<f32>> {
    p.ids.iter().map(|ids| all_logits(m, o, ids)).collect()
}

fn with_kv(t: KvType) -> StateOptions {
    StateOptions {
        kv_type: t,
        ..StateOptions::default()
    }
}

/// 1 to 8 sequences on every synthetic case (GQA, sliding windows and rings that wrap,
/// softcaps, GELU, f16 scales, Q4_0, no-RoPE layers, the delta rule), every KV cache
/// type: each sequence's logits are its own, whatever runs beside it; also with a
/// budget of 5 tokens per pass (a step cut into several passes) and with every
/// position's logits.
#[test]
fn batched_steps_give_each_sequence_its_own_bits() {
    for c in cases() {
        let mlb = load(&c, 31);
        let m = Model::new(&mlb).unwrap();
        for t in KvType::ALL {
            let o = with_kv(t);
            for n in [1, 2, 3, 5, 8] {
                let p = plan(c.h.vocab, n, 100 + n as u64);
                let want = alone(&m, &o, &p);
                let what = format!("{} {t} cache, {n} sequences", c.name);
                run_plan(&m, &o, &p, &want, 64, false, &what);
                if n == 5 {
                    run_plan(&m, &o, &p, &want, 5, false, &format!("{what}, budget 5"));
                    run_plan(
                        &m,
                        &o,
                        &p,
                        &want,
                        64,
                        true,
                        &format!("{what}, every position"),
                    );
                }
            }
        }
    }
}

/// The same on every tier, 1-3 threads, read from the map and packed (the AVX-512 VNNI
/// tier packs Q8_0 and Q4_0, AVX2 and AVX-512 Q4_0).
#[test]
fn batched_steps_agree_on_every_tier_and_thread_count() {
    let pools = tiers::pools();
    for c in cases() {
        let mlb = load(&c, 37);
        let m = Model::new(&mlb).unwrap();
        let p = plan(c.h.vocab, 4, 9);
        for t in [KvType::F32, KvType::Q8_0] {
            let o = with_kv(t);
            let want = kernels::with_tier(Tier::Scalar, || alone(&m, &o, &p)).unwrap();
            tiers::on_every_tier(&pools, &mlb, &m, |_, model, what| {
                let what = format!("{} {t}: {what}", c.name);
                run_plan(model, &o, &p, &want, 64, false, &what)
            });
        }
    }
}

/// Converted fixtures with sliding windows and softcaps (Gemma 2, Gemma 3, Mistral) and
/// Qwen3.5's delta rule: batched steps of up to 8 sequences against each alone, every
/// tier, 1-3 threads, read from the map and packed, f32 and Q8_0 caches.
#[test]
fn fixtures_batched_give_each_sequence_its_own_bits() {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let pools = tiers::pools();
    for name in ["gemma2", "gemma3_text", "mistral_sliding", "qwen3_5_text"] {
        let dir = root.join(name);
        if !dir.join("config.json").exists() {
            eprintln!("SKIP: no fixture {}", dir.display());
            continue;
        }
        for (quant, args) in [
            ("q8_0", &["--wtype", "q8_0"][..]),
            ("q4_0", &["--wtype", "q4_0", "--f16-scales"][..]),
        ] {
            let out = tmp.path().join(format!("{name}.{quant}.mlb"));
            convert(&dir, &out, args);
            let mlb = Mlb::open(&out).unwrap();
            let m = Model::new(&mlb).unwrap();
            let p = plan(m.cfg.vocab as u32, 8, 77);
            for t in [KvType::F32, KvType::Q8_0] {
                let o = with_kv(t);
                let want = kernels::with_tier(Tier::Scalar, || alone(&m, &o, &p)).unwrap();
                tiers::on_every_tier(&pools, &mlb, &m, |_, model, what| {
                    let what = format!("{name} {quant} {t}: {what}");
                    run_plan(model, &o, &p, &want, 512, false, &what)
                });
            }
        }
    }
}

/// A sequence that cannot take its ids (a full context, an id out of range) fails the
/// whole batch before anything runs, naming it; no state changes.
#[test]
fn batch_errors_name_the_sequence_and_change_nothing() {
    let c = &cases()[1];
    let mlb = load(c, 3);
    let m = Model::new(&mlb).unwrap();
    let o = opts(10);
    let mut a = m.state(&o).unwrap();
    let mut b = m.state(&o).unwrap();
    m.prefill(&mut b, &[1; 8], None).unwrap();
    let mut bs = m.batch_scratch(16, Some(10)).unwrap();
    let calls = std::cell::Cell::new(0);
    let mut sink = |_: usize, _: usize, _: &[f32]| calls.set(calls.get() + 1);
    let e = m
        .forward_batch(
            &mut bs,
            &mut [(&mut a, &[1, 2][..]), (&mut b, &[3, 4, 5][..])],
            false,
            &mut sink,
        )
        .unwrap_err();
    assert_eq!(
        e,
        ModelError::InBatch {
            index: 1,
            error: Box::new(ModelError::ContextFull {
                needed: 11,
                ctx: 10
            })
        }
    );
    assert!(
        e.to_string().starts_with("sequence 1 of the batch: "),
        "{e}"
    );
    let bad = c.h.vocab;
    let e = m
        .forward_batch(
            &mut bs,
            &mut [(&mut a, &[1, bad][..]), (&mut b, &[][..])],
            false,
            &mut sink,
        )
        .unwrap_err();
    assert!(matches!(
        e,
        ModelError::InBatch { index: 0, ref error } if matches!(**error, ModelError::TokenOutOfRange { index: 1, .. })
    ));
    assert_eq!((a.pos(), b.pos(), calls.get()), (0, 8, 0));
    // A state of a larger context than the buffers were made for.
    let big = m.state(&opts(20)).unwrap();
    let mut big = big;
    let mut small = m.batch_scratch(4, Some(4)).unwrap();
    let e = m
        .forward_batch(&mut small, &mut [(&mut big, &[1][..])], false, &mut sink)
        .unwrap_err();
    assert!(matches!(e, ModelError::InBatch { index: 0, .. }), "{e}");
    assert_eq!(big.pos(), 0);
    // Nothing was harmed: the batch then runs, equal to each alone.
    let mut got = vec![Vec::new(); 2];
    let mut sink = |i: usize, _: usize, l: &[f32]| got[i] = l.to_vec();
    m.forward_batch(
        &mut bs,
        &mut [(&mut a, &[1, 2][..]), (&mut b, &[3][..])],
        false,
        &mut sink,
    )
    .unwrap();
    let want_a = all_logits(&m, &o, &[1, 2]);
    let want_b = all_logits(&m, &o, &[1, 1, 1, 1, 1, 1, 1, 1, 3]);
    let v = m.cfg.vocab;
    assert!(got[0][..] == want_a[v..] && got[1][..] == want_b[8 * v..]);
}

fn engine(seed: u64) -> Engine {
    let c = &cases()[7];
    Engine::new(load(c, seed), Packs::none(), None).unwrap()
}

/// `feed_batch` leaves every session as `feed` leaves it: logits, position, held ids;
/// a skipped session keeps its logits; snapshots and truncation work after it; the
/// result borrows the sessions' own logits.
#[test]
fn feed_batch_is_feed_for_each_session() {
    for c in cases() {
        let e = Engine::new(load(&c, 41), Packs::none(), None).unwrap();
        let o = StateOptions::default();
        let ids: Vec<Vec<u32>> = (0..4)
            .map(|i| tokens(c.h.vocab, 9 + i, 50 + i as u64))
            .collect();
        let mut alone: Vec<Session> = (0..4).map(|_| e.session(&o).unwrap()).collect();
        let mut batch: Vec<Session> = (0..4).map(|_| e.session(&o).unwrap()).collect();
        // Step 1: prompts of different lengths; step 2: session 1 skipped, the others
        // one id; step 3: only session 1, a chunk.
        let schedule: [[std::ops::Range<usize>; 4]; 3] = [
            [0..4, 0..2, 0..7, 0..1],
            [4..5, 2..2, 7..8, 1..2],
            [5..5, 2..6, 8..8, 2..2],
        ];
        for (si, step) in schedule.iter().enumerate() {
            let lists: Vec<&[u32]> = step
                .iter()
                .enumerate()
                .map(|(i, r)| &ids[i][r.clone()])
                .collect();
            for (s, l) in alone.iter_mut().zip(&lists) {
                if !l.is_empty() {
                    s.feed(l).unwrap();
                }
            }
            let before: Vec<Option<Vec<f32>>> = batch
                .iter()
                .map(|s| s.logits().map(<[f32]>::to_vec))
                .collect();
            let mut refs: Vec<&mut Session> = batch.iter_mut().collect();
            let got = feed_batch(&mut refs, &lists).unwrap();
            for (i, g) in got.iter().enumerate() {
                let at = format!("{}: step {si}, session {i}", c.name);
                match g {
                    Some(l) => assert!(*l == alone[i].logits().unwrap(), "{at}"),
                    None => assert!(lists[i].is_empty(), "{at}"),
                }
            }
            drop(got);
            for (i, s) in batch.iter().enumerate() {
                let at = format!("{}: step {si}, session {i}", c.name);
                assert_eq!(
                    (s.pos(), s.tokens()),
                    (alone[i].pos(), alone[i].tokens()),
                    "{at}"
                );
                if lists[i].is_empty() {
                    assert_eq!(s.logits().map(<[f32]>::to_vec), before[i], "{at}: skipped");
                } else {
                    assert!(s.logits() == alone[i].logits(), "{at}");
                }
            }
        }
        // A rewind after batched steps gives a fresh prefill's bits.
        let snap = batch[2].snapshot();
        let mut refs: Vec<&mut Session> = batch.iter_mut().collect();
        feed_batch(&mut refs, &[&[], &[], &[3, 4], &[]]).unwrap();
        batch[2].restore(&snap).unwrap();
        batch[2].feed(&[5]).unwrap();
        let mut fresh = e.session(&o).unwrap();
        fresh.feed(&[&ids[2][..8], &[5]].concat()).unwrap();
        assert!(batch[2].logits() == fresh.logits(), "{}", c.name);
    }
}

/// Errors of `feed_batch` name the session and leave every session as it was; sessions
/// of two engines cannot share a batch.
#[test]
fn feed_batch_errors() {
    let e = engine(5);
    let o = opts(6);
    let mut a = e.session(&o).unwrap();
    let mut b = e.session(&o).unwrap();
    a.feed(&[1, 2]).unwrap();
    let la = a.logits().unwrap().to_vec();
    let mut refs = vec![&mut a, &mut b];
    let err = feed_batch(&mut refs, &[&[3], &[1; 7]]).unwrap_err();
    assert!(
        matches!(&err, SessionError::InBatch { index: 1, error } if matches!(**error, SessionError::Model(ModelError::ContextFull { needed: 7, ctx: 6 }))),
        "{err:?}"
    );
    assert_eq!(err.to_string().lines().count(), 1);
    assert!(
        err.to_string()
            .starts_with("session 1 of the batch: prompt needs 7 positions"),
        "{err}"
    );
    assert_eq!((a.pos(), b.pos(), a.tokens()), (2, 0, &[1, 2][..]));
    assert!(a.logits().unwrap() == la.as_slice() && b.logits().is_none());
    let mut refs = vec![&mut a, &mut b];
    assert!(matches!(
        feed_batch(&mut refs, &[&[3]]),
        Err(SessionError::BadOption { name: "ids", .. })
    ));
    let other = engine(5);
    let mut c = other.session(&o).unwrap();
    let mut refs = vec![&mut a, &mut c];
    assert!(matches!(
        feed_batch(&mut refs, &[&[3], &[4]]),
        Err(SessionError::InBatch { index: 1, .. })
    ));
    assert_eq!((a.pos(), c.pos()), (2, 0));
    // Nothing to feed: nothing runs, every result None.
    let mut refs = vec![&mut a];
    assert_eq!(feed_batch(&mut refs, &[&[]]).unwrap(), vec![None]);
    let mut none: Vec<&mut Session> = Vec::new();
    assert!(feed_batch(&mut none, &[]).unwrap().is_empty());
}

/// The engine's batch buffers: made at the first step, grown for a larger step or
/// context, or reserved up front; a step beyond the reserved budget runs in passes.
#[test]
fn feed_batch_buffers_grow_and_reserve() {
    let e = engine(9);
    let small = opts(8);
    let mut a = e.session(&small).unwrap();
    let mut b = e.session(&StateOptions::default()).unwrap();
    let mut wa = e.session(&small).unwrap();
    let mut wb = e.session(&StateOptions::default()).unwrap();
    let bytes = e.reserve_batch(3, Some(8)).unwrap();
    assert!(bytes > 0);
    // 2 + 5 tokens with a budget of 3: three passes; b's context is larger than 8: the
    // buffers grow.
    let mut refs = vec![&mut a, &mut b];
    let got: Vec<Option<Vec<f32>>> = feed_batch(&mut refs, &[&[1, 2], &[3, 4, 5, 6, 7]])
        .unwrap()
        .into_iter()
        .map(|l| l.map(<[f32]>::to_vec))
        .collect();
    wa.feed(&[1, 2]).unwrap();
    wb.feed(&[3, 4, 5, 6, 7]).unwrap();
    assert!(got[0].as_deref() == wa.logits() && got[1].as_deref() == wb.logits());
    assert_eq!((a.pos(), b.pos()), (2, 5));
}

/// A forced tier runs its own attention kernels for f16 and Q8_0 caches (the call
/// counters of debug builds), and the scalar tier no SIMD at all.
#[test]
fn kv_types_run_the_forced_tiers_kernels() {
    if crate::util::skip_without_counters() {
        return;
    }
    let pool = Pool::leak(1);
    let c = &cases()[4];
    let mlb = load(c, 2);
    let m = Model::new(&mlb).unwrap();
    let toks = tokens(c.h.vocab, 9, 3);
    for t in [KvType::F16, KvType::Q8_0] {
        for tier in kernels::supported_tiers() {
            counters::take();
            pool.install(|| kernels::with_tier(tier, || all_logits(&m, &with_kv(t), &toks)))
                .unwrap();
            let calls = counters::take();
            let (scalar, simd) = (calls.get(Tier::Scalar, Op::Attend), calls.simd(Op::Attend));
            match tier {
                Tier::Scalar | Tier::Neon => {
                    assert!(scalar > 0 && simd == 0, "{t} {tier}: {calls:?}")
                }
                _ => assert!(scalar == 0 && simd > 0, "{t} {tier}: {calls:?}"),
            }
            for op in Op::ALL {
                if tier == Tier::Scalar {
                    assert_eq!(calls.simd(op), 0, "{t}: the scalar tier ran SIMD {op:?}");
                }
            }
        }
    }
}

/// f16 and Q8_0 caches on the converted fixtures (Q8_0 weights) against transformers'
/// forward with the format's rounding (`logits.sim_q8_0.bin`, which the f32 cache
/// matches to ~1e-3): nRMSE of every position's logits and top-1 agreement. Any change
/// to keys and values flips some Q8_0 activation codes downstream, so even f16 (11
/// significant bits) moves the logits by about the activations' own rounding noise
/// (measured 0.009-0.016 nRMSE for f16, 0.011-0.021 for Q8_0); what matters is that
/// neither type moves them further than that noise: at most 0.025 above the f32
/// cache's error and under the fixtures' bound (0.05), top-1 at least 0.9. A cache that loses its values (zeros,
/// another position's rows) is far outside this (nRMSE ~1).
#[test]
fn kv_types_stay_close_to_transformers() {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    let names = [
        "gemma2",
        "gemma3_text",
        "llama",
        "mistral_sliding",
        "qwen3",
        "qwen3_5_text",
        "smollm3",
    ];
    for (name, dir, toks) in with_reference(&root, &names) {
        let sim = read_f32(&dir.join("logits.sim_q8_0.bin"));
        let out = tmp.path().join(format!("{name}.mlb"));
        convert(&dir, &out, &["--wtype", "q8_0"]);
        let mlb = Mlb::open(&out).unwrap();
        let m = Model::new(&mlb).unwrap();
        let v = m.cfg.vocab;
        let base = all_logits(&m, &StateOptions::default(), &toks);
        let base_err = nrmse(&base, &sim);
        for t in KvType::ALL {
            let got = all_logits(&m, &with_kv(t), &toks);
            rows.push((
                name,
                t,
                nrmse(&got, &sim),
                top1(&got, &sim, v),
                nrmse(&got, &base),
                base_err,
            ));
        }
    }
    eprintln!(
        "{:16} {:5} {:>10} {:>6} {:>12}",
        "fixture", "kv", "nRMSE sim", "top-1", "nRMSE vs f32"
    );
    for (name, t, e, t1, vf, _) in &rows {
        eprintln!("{name:16} {t:5} {e:>10.6} {t1:>6.3} {vf:>12.6}");
    }
    assert!(!rows.is_empty(), "no fixtures under {}", root.display());
    for (name, t, e, t1, _, base_err) in rows {
        assert!(
            e < 0.05 && e <= base_err + 0.025 && t1 >= 0.9,
            "{name} {t} cache: nRMSE {e} (f32 cache {base_err}), top-1 {t1}"
        );
    }
}

/// Memory per slot: the KV cache of each type for a context, its bytes per position,
/// the sum of a session's actual buffers.
#[test]
fn slot_memory_reports_each_kv_type() {
    let c = &cases()[0];
    let e = Engine::new(load(c, 1), Packs::none(), None).unwrap();
    let cfg = e.config().clone();
    let mut f32_kv = None;
    for t in KvType::ALL {
        let o = StateOptions {
            ctx: Some(32),
            kv_type: t,
            ..StateOptions::default()
        };
        let mem = e.slot_memory(&o).unwrap();
        let s = e.session(&o).unwrap();
        assert_eq!(mem.kv, s.state().kv_bytes() as u128, "{t}");
        let per_head = match t {
            KvType::F32 => 4 * cfg.head_dim,
            KvType::F16 => 2 * cfg.head_dim,
            KvType::Q8_0 => cfg.head_dim.next_multiple_of(32) * 9 / 8,
        };
        assert_eq!(
            mem.kv_per_position,
            2 * cfg.n_kv_heads * per_head * cfg.n_layers,
            "{t}"
        );
        assert_eq!(mem.kv, 32 * mem.kv_per_position as u128, "{t}");
        // f16 and Q8_0 take less than f32 (Q8_0 pads a head to 32 values, so on heads
        // under 32 it may take more than f16).
        let f32_kv = *f32_kv.get_or_insert(mem.kv);
        assert!(
            (t == KvType::F32 || mem.kv < f32_kv) && mem.buffers > 0,
            "{t}"
        );
        let text = mem.to_string();
        assert!(
            text.contains(&format!("KV cache {t}")) && text.contains("32 positions"),
            "{text}"
        );
    }
}

/// Feeds `a` alone (the reference for a batched session).
fn feed_alone(s: &mut Session, ids: &[u32]) -> Vec<f32> {
    s.feed(ids).unwrap().to_vec()
}

/// A long prompt fed in chunks of 8 between decode steps of two other sessions (one
/// `feed_batch` per step, each decoding session one id) ends with the logits of one
/// prefill of the whole prompt, and the decoding sessions get theirs alone; also with a
/// batch budget of 3 tokens (every step cut into passes). Every synthetic case (sliding
/// rings that wrap, the delta rule, ...), every KV cache type.
#[test]
fn chunked_prefill_beside_decoding_sessions_equals_one_prefill() {
    for c in cases() {
        for t in KvType::ALL {
            for budget in [None, Some(3)] {
                let e = Engine::new(load(&c, 43), Packs::none(), None).unwrap();
                if let Some(b) = budget {
                    e.reserve_batch(b, None).unwrap();
                }
                let o = with_kv(t);
                let at = format!("{} {t} cache, budget {budget:?}", c.name);
                let prompt = tokens(c.h.vocab, 37, 5);
                let mut long = e.session(&o).unwrap();
                let mut dec: Vec<Session> = (0..2).map(|_| e.session(&o).unwrap()).collect();
                let mut solo: Vec<Session> = (0..2).map(|_| e.session(&o).unwrap()).collect();
                for (i, (d, s)) in dec.iter_mut().zip(&mut solo).enumerate() {
                    let p = tokens(c.h.vocab, 3 + 4 * i, 60 + i as u64);
                    d.feed(&p).unwrap();
                    s.feed(&p).unwrap();
                }
                let stream: Vec<Vec<u32>> = (0..2).map(|i| tokens(c.h.vocab, 5, 70 + i)).collect();
                for (step, chunk) in prompt.chunks(8).enumerate() {
                    let [d0, d1] = &mut dec[..] else {
                        unreachable!()
                    };
                    let mut refs = vec![&mut long, d0, d1];
                    let one = |i: usize| &stream[i][step..step + 1];
                    feed_batch(&mut refs, &[chunk, one(0), one(1)]).unwrap();
                    for (i, (d, s)) in dec.iter().zip(&mut solo).enumerate() {
                        let want = feed_alone(s, one(i));
                        assert!(
                            d.logits() == Some(&want[..]),
                            "{at}: step {step}, session {}",
                            i + 1
                        );
                    }
                }
                let mut fresh = e.session(&o).unwrap();
                let want = feed_alone(&mut fresh, &prompt);
                assert_eq!(long.tokens(), &prompt[..], "{at}");
                assert!(long.logits() == Some(&want[..]), "{at}: the chunked prompt");
            }
        }
    }
}

/// Prefix reuse in a batch: a session that ran a prompt and generated (batched steps
/// beside another session) takes a new prompt that shares a prefix with what it holds:
/// it goes back to the common prefix ([`Session::rewind`]: free for full attention,
/// from a snapshot for the delta rule or a wrapped ring) and feeds only the rest in a
/// batched step; its logits are a fresh prefill's of the new prompt. Then a prompt
/// that extends what it holds feeds only the extension. Every synthetic case, every KV
/// cache type.
#[test]
fn prefix_reuse_in_a_batch_equals_a_fresh_prefill() {
    for c in cases() {
        for t in KvType::ALL {
            let e = Engine::new(load(&c, 47), Packs::none(), None).unwrap();
            let o = with_kv(t);
            let at = format!("{} {t} cache", c.name);
            let v = c.h.vocab;
            let (mut a, mut b) = (e.session(&o).unwrap(), e.session(&o).unwrap());
            b.feed(&tokens(v, 4, 3)).unwrap();
            let turn1 = tokens(v, 20, 11);
            let gen = tokens(v, 5, 12);
            let other = tokens(v, 12, 13);
            let mut snaps = Vec::new();
            feed_batch(&mut [&mut a, &mut b], &[&turn1, &other[..1]]).unwrap();
            snaps.push(a.snapshot());
            for (i, g) in gen.iter().enumerate() {
                feed_batch(&mut [&mut a, &mut b], &[&[*g], &other[1 + i..2 + i]]).unwrap();
            }
            // Turn 2 shares the first prompt and 3 generated ids.
            let p2 = [&turn1[..], &gen[..3], &tokens(v, 9, 14)].concat();
            let n = a.common_prefix(&p2);
            assert_eq!(n, 23, "{at}");
            let refed = a.rewind(n, &snaps).unwrap();
            if c.name == "llama_gqa" {
                assert_eq!(refed, 0, "{at}: full attention rewinds for free");
            }
            assert!(
                refed <= 3,
                "{at}: fed {refed} ids again, the snapshot is at 20"
            );
            feed_batch(&mut [&mut a, &mut b], &[&p2[n..], &other[6..7]]).unwrap();
            let want = feed_alone(&mut e.session(&o).unwrap(), &p2);
            assert_eq!(a.tokens(), &p2[..], "{at}");
            assert!(a.logits() == Some(&want[..]), "{at}: turn 2");
            // Turn 3 extends turn 2: nothing to go back over.
            let p3 = [&p2[..], &tokens(v, 4, 15)].concat();
            assert_eq!(a.common_prefix(&p3), p2.len(), "{at}");
            feed_batch(&mut [&mut a, &mut b], &[&p3[p2.len()..], &other[7..8]]).unwrap();
            let want = feed_alone(&mut e.session(&o).unwrap(), &p3);
            assert!(a.logits() == Some(&want[..]), "{at}: turn 3");
            // b, beside all of it, has the logits of its own ids alone.
            let want = feed_alone(&mut e.session(&o).unwrap(), b.tokens());
            assert!(b.logits() == Some(&want[..]), "{at}: the other session");
        }
    }
}

/// `mlb-run --kv-type` on every tier forced by `KRAFLA_KERNEL`: the `--logits` file of
/// each cache type is the library's scalar logits for that type, bit for bit (and f16
/// and Q8_0 differ from f32, so the flag reaches the cache); `--verbose` names the
/// type and the memory of the session; an unknown type is one line and exit 2.
#[test]
fn mlb_run_kv_type_on_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_case(dir.path(), 4, 19);
    let bytes = std::fs::read(&path).unwrap();
    let toks = [1u32, 5, 9, 33, 2, 7, 4, 8, 3];
    let list = toks.map(|t| t.to_string()).join(" ");
    let mlb = Mlb::from_bytes(&bytes).unwrap();
    let m = Model::new(&mlb).unwrap();
    let f32_logits = all_logits(&m, &StateOptions::default(), &toks);
    let out = dir.path().join("logits.bin");
    for t in KvType::ALL {
        let want = kernels::with_tier(Tier::Scalar, || all_logits(&m, &with_kv(t), &toks)).unwrap();
        assert_eq!(t == KvType::F32, want == f32_logits, "{t}");
        for tier in kernels::supported_tiers() {
            let err = tool("mlb-run")
                .arg(&path)
                .args([
                    "--tokens",
                    &list,
                    "--kv-type",
                    t.name(),
                    "--verbose",
                    "--logits",
                ])
                .arg(&out)
                .env("KRAFLA_KERNEL", tier.name())
                .ok()
                .stderr;
            assert!(err.contains(&format!("kv {t}")), "{t} {tier}: {err}");
            assert!(
                err.contains(&format!("memory: KV cache {t} ")),
                "{t} {tier}: {err}"
            );
            let got = read_f32(&out);
            assert!(
                got.len() == want.len()
                    && got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{t} {tier}"
            );
        }
    }
    let err = tool("mlb-run")
        .arg(&path)
        .args(["--tokens", "1 2", "--kv-type", "q4_0"])
        .fails_with(2);
    assert!(err.contains("q4_0") && err.contains("--kv-type"), "{err}");
}

/// Sessions of one engine with different options share a batch: each its own context
/// and KV cache type, each with the bits of its own options alone.
#[test]
fn sessions_of_different_options_share_a_batch() {
    for c in cases() {
        let e = Engine::new(load(&c, 53), Packs::none(), None).unwrap();
        let opts: Vec<StateOptions> = KvType::ALL
            .iter()
            .zip([Some(24), None, Some(40)])
            .map(|(&t, ctx)| StateOptions {
                ctx,
                kv_type: t,
                ..StateOptions::default()
            })
            .collect();
        let mut batch: Vec<Session> = opts.iter().map(|o| e.session(o).unwrap()).collect();
        let ids: Vec<Vec<u32>> = (0..3).map(|i| tokens(c.h.vocab, 20, 80 + i)).collect();
        for (from, to) in [(0, 9), (9, 10), (10, 16), (16, 17)] {
            let lists: Vec<&[u32]> = ids.iter().map(|l| &l[from..to]).collect();
            let mut refs: Vec<&mut Session> = batch.iter_mut().collect();
            feed_batch(&mut refs, &lists).unwrap();
        }
        for (i, (s, o)) in batch.iter().zip(&opts).enumerate() {
            let want = feed_alone(&mut e.session(o).unwrap(), &ids[i][..17]);
            assert!(
                s.logits() == Some(&want[..]),
                "{}: session {i} ({})",
                c.name,
                o.kv_type
            );
        }
    }
}

/// A batched step multiplies each matrix once for all its rows: three decoding
/// sessions and a prefill chunk in one step quantize as many matrix inputs (one per
/// matrix, or per group of matrices sharing an input) as one session's decode step,
/// not four times as many (the call counters of debug builds, one thread; the batch
/// buffers reserved first, as making them quantizes a zero input once to size them).
#[test]
fn a_batched_step_quantizes_each_matrix_input_once() {
    if crate::util::skip_without_counters() {
        return;
    }
    let pool = Pool::leak(1);
    for c in cases() {
        let e = Engine::new(load(&c, 59), Packs::none(), None).unwrap();
        let o = StateOptions::default();
        e.reserve_batch(16, None).unwrap();
        let mut s: Vec<Session> = (0..4).map(|_| e.session(&o).unwrap()).collect();
        for (i, x) in s.iter_mut().enumerate() {
            x.feed(&tokens(c.h.vocab, 3 + i, 90 + i as u64)).unwrap();
        }
        let calls = |f: &mut dyn FnMut()| {
            counters::take();
            pool.install(|| kernels::with_tier(Tier::Scalar, &mut *f))
                .unwrap();
            counters::take().get(Tier::Scalar, Op::Quantize)
        };
        let mut lone = e.session(&o).unwrap();
        lone.feed(&[1, 2]).unwrap();
        let one = calls(&mut || {
            lone.feed(&[3]).unwrap();
        });
        let mut refs: Vec<&mut Session> = s.iter_mut().collect();
        let batched = calls(&mut || {
            feed_batch(&mut refs, &[&[1], &[2], &[3], &[4, 5, 6, 7, 8]]).unwrap();
        });
        // 2-byte float matrices take f32 inputs: such a model quantizes nothing.
        let half = matches!(c.h.wtype, wtype::BF16 | wtype::F16);
        assert!(
            (one > 0 || half) && batched == one,
            "{}: {batched} quantizations, one session {one}",
            c.name
        );
    }
}
