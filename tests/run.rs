//! The model runtime: against an independent naive forward on synthetic files (every
//! header feature), prefill against decoding, the sliding-window ring against full
//! masked attention, every kernel tier, errors, the `mlb-run` command, and the
//! fixtures' transformers logits (through `mlb-convert`).

mod fixtures;
mod moe_fixtures;
pub mod reference;

use std::path::{Path, PathBuf};

use krafla::format::mlb::header::{layer_flag, q8_class, qk_norm, rope_type, wtype};
use krafla::format::mlb::layout::Layout;
use krafla::format::mlb::validate::validate;
use krafla::format::mlb::{Header, Mlb};
use krafla::format::WType;
use krafla::kernels::counters::{self, Op};
use krafla::kernels::pool::Pool;
use krafla::kernels::{self, HalfActs, Kernels, Tier};
use krafla::model::observer::{Input, Observer};
use krafla::model::{Model, ModelError, Packs, StateOptions};
use krafla::synth::{
    llama3_rope, qwen35_hybrid, synth_file, synth_mixed, tiny_header, tiny_moe, yarn_rope,
};

use crate::util::tiers;
use crate::util::tool::tool;

/// A synthetic case: name, header, layer flags.
pub struct Case {
    pub name: &'static str,
    pub h: Header,
    pub flags: Vec<u8>,
}

impl Case {
    /// The same model stored as type `t` under `name`; a mixed file takes f16 scales.
    fn stored_as(&self, name: &'static str, t: u32) -> Case {
        let mut h = self.h;
        h.wtype = t;
        h.scale_f16 = u32::from(t == wtype::MIXED);
        Case {
            name,
            h,
            flags: self.flags.clone(),
        }
    }
}

/// Headers covering every feature of the spec.
pub fn cases() -> Vec<Case> {
    let case = |name, flags: Vec<u8>, edit: fn(&mut Header)| {
        let mut h = tiny_header();
        edit(&mut h);
        Case { name, h, flags }
    };
    let sl = layer_flag::SLIDING | layer_flag::LOCAL_ROPE;
    let mut v = vec![
        case("llama_gqa", vec![], |_| {}),
        case("mistral_sliding_all", vec![], |h| {
            h.sliding_window = 5;
        }),
        case("qwen2_bias_tied_llama3", vec![], |h| {
            h.qkv_bias = 1;
            h.shared_classifier = 1;
            llama3_rope(h, 32);
        }),
        case("qwen3_headdim_qknorm_linear_f16", vec![], |h| {
            h.head_dim = 32;
            h.qk_norm = 1;
            h.rope_type = rope_type::LINEAR;
            h.rope_factor = 4.0;
            h.scale_f16 = 1;
        }),
        case("gemma2_softcaps", vec![layer_flag::SLIDING, 0], |h| {
            h.act = 1;
            h.post_norms = 1;
            h.embed_scale = 8.0;
            h.attn_scale = 0.2;
            h.attn_softcap = 5.0;
            h.final_softcap = 3.0;
            h.sliding_window = 4;
            h.layer_flags = 1;
        }),
        case("gemma3_local_yarn_q4", vec![sl, 0, sl], |h| {
            h.n_layers = 3;
            h.act = 1;
            h.post_norms = 1;
            h.qk_norm = 1;
            h.embed_scale = 8.0;
            h.rope_theta = 1e6;
            h.rope_local_theta = 10000.0;
            yarn_rope(h, 16, 1.2);
            h.sliding_window = 5;
            h.layer_flags = 1;
            h.wtype = wtype::Q4_0;
            h.q8_mask = q8_class::TOK_EMB | q8_class::WO;
            h.shared_classifier = 1;
        }),
        case("smollm3_norope_q4", vec![0, layer_flag::NO_ROPE, 0], |h| {
            h.n_layers = 3;
            h.layer_flags = 1;
            h.wtype = wtype::Q4_0;
        }),
        case(
            "qwen3_5_delta_gate_partial",
            vec![layer_flag::LINEAR, 0, layer_flag::LINEAR],
            |h| {
                h.n_layers = 3;
                qwen35_hybrid(h);
            },
        ),
    ];
    // 2-byte float weights (f32 activations): BF16 with biases, q/k norms and a tied
    // classifier; F16 with Gemma 2's softcaps, GELU and sliding layers; BF16 with the
    // delta rule (lb and la BF16 too); and a mixed file of all four types (below).
    v.push(case("bf16_bias_qknorm_tied", vec![], |h| {
        h.wtype = wtype::BF16;
        h.qkv_bias = 1;
        h.shared_classifier = 1;
        h.head_dim = 32;
        h.qk_norm = 1;
    }));
    let stored = [
        v[4].stored_as("f16_gemma2_softcaps", wtype::F16),
        v[7].stored_as("bf16_qwen3_5_delta", wtype::BF16),
        v[7].stored_as("mixed_all_types_delta_f16_scales", wtype::MIXED),
    ];
    v.extend(stored);
    v.extend(moe_cases());
    v
}

/// Mixtures of experts: Qwen3-MoE's softmax top-k renormalised with a gated shared
/// expert (and router and expert biases) beside a dense layer; OLMoE's top-k without
/// renormalisation and q/k norms over the whole projection, every layer MoE, Q4_0 (the
/// packed kernels' row ranges), 8 experts of which 3 per token; gpt-oss's top-k
/// softmax with biases, the clamped SwiGLU, attention sinks, the o bias, sliding
/// layers and unrounded YaRN; the first also in BF16 and as a mixed file.
pub fn moe_cases() -> Vec<Case> {
    let moe = layer_flag::MOE;
    let case = |name, flags: Vec<u8>, edit: fn(&mut Header)| {
        let mut h = tiny_header();
        tiny_moe(&mut h);
        edit(&mut h);
        Case { name, h, flags }
    };
    let mut v = vec![
        case("qwen3_moe_shared_gate_biases", vec![0, moe], |_| {}),
        case("olmoe_whole_qknorm_q4", vec![moe, moe], |h| {
            h.n_experts = 8;
            h.n_experts_used = 3;
            h.hidden_dim = 32;
            h.moe_gating = 0;
            h.shared_hidden = 0;
            h.moe_flags = 0;
            h.qk_norm = qk_norm::WHOLE;
            h.wtype = wtype::Q4_0;
        }),
        case(
            "gpt_oss_sinks_bo_swiglu_yarn",
            vec![moe | layer_flag::SLIDING, moe],
            |h| {
                h.hidden_dim = 32;
                h.moe_gating = 2;
                h.shared_hidden = 0;
                h.moe_flags = 3;
                h.swiglu_limit = 3.0;
                h.swiglu_alpha = 1.702;
                h.qkv_bias = 2;
                h.attn_sinks = 1;
                h.sliding_window = 4;
                yarn_rope(h, 16, 1.1);
                h.rope_type = rope_type::YARN_UNROUNDED;
            },
        ),
    ];
    let stored = [
        v[0].stored_as("bf16_qwen3_moe", wtype::BF16),
        v[0].stored_as("mixed_qwen3_moe_f16_scales", wtype::MIXED),
    ];
    v.extend(stored);
    v
}

/// The types of a mixed case's matrices, in array order: BF16, Q8_0, F16, Q4_0 in turn,
/// so that q/k/v, gate/up and the delta rule's four inputs mix 2-byte float and
/// quantized matrices that share an input.
pub fn mixed_types(h: &Header, flags: &[u8]) -> Vec<WType> {
    let d = validate(h).expect("valid synthetic header");
    let n = Layout::matrix_count(h, &d, flags).expect("valid synthetic layout");
    let cycle = [WType::BF16, WType::Q8_0, WType::F16, WType::Q4_0];
    (0..n).map(|i| cycle[i % 4]).collect()
}

/// The case's file.
pub fn file(c: &Case, seed: u64) -> Vec<u8> {
    if c.h.wtype == wtype::MIXED {
        synth_mixed(&c.h, &c.flags, &mixed_types(&c.h, &c.flags), seed)
    } else {
        synth_file(&c.h, &c.flags, seed)
    }
}

/// The default options with a context of `ctx` positions.
pub fn opts(ctx: usize) -> StateOptions {
    StateOptions {
        ctx: Some(ctx),
        ..StateOptions::default()
    }
}

/// Writes synthetic case `i` of [`cases`] (not a mixed one: [`synth_file`]) with
/// weights of `seed` to `dir/m.mlb`; returns its path.
pub fn write_case(dir: &Path, i: usize, seed: u64) -> PathBuf {
    let c = &cases()[i];
    let path = dir.join("m.mlb");
    std::fs::write(&path, synth_file(&c.h, &c.flags, seed)).unwrap();
    path
}

/// The case's file, loaded.
pub fn load(c: &Case, seed: u64) -> Mlb {
    Mlb::from_bytes(&file(c, seed)).expect("synthetic file is valid")
}

pub fn tokens(vocab: u32, n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// Every position's logits, prefilled with `opts`.
pub fn all_logits(m: &Model, opts: &StateOptions, toks: &[u32]) -> Vec<f32> {
    let mut st = m.state(opts).unwrap();
    let mut out = Vec::new();
    let mut each = |_: usize, l: &[f32]| out.extend_from_slice(l);
    m.prefill(&mut st, toks, Some(&mut each)).unwrap();
    out
}

/// RMS error over the reference's standard deviation.
pub fn nrmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let n = want.len() as f64;
    let mean = want.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = want.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let err = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum::<f64>()
        / n;
    (err / var).sqrt()
}

/// Share of positions whose top-1 token agrees.
pub fn top1(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    let am = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0
    };
    let rows = want.len() / vocab;
    let same = got
        .chunks(vocab)
        .zip(want.chunks(vocab))
        .filter(|(a, b)| am(a) == am(b))
        .count();
    same as f64 / rows as f64
}

#[test]
fn synthetic_matches_naive_reference() {
    for c in cases() {
        let m = load(&c, 7);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 20, 3);
        let got = all_logits(&model, &StateOptions::default(), &toks);
        let want = reference::logits(&m, &toks);
        let v = c.h.vocab as usize;
        let e = nrmse(&got, &want);
        let t1 = top1(&got, &want, v);
        // Only float rounding differs, so most positions agree to ~1e-7; a Q8_0 input
        // rounding the other way at a boundary shows at a few positions (~1e-3), while
        // a real mistake (pairing, offset, mask) shows at every position, above 1e-2.
        let exact = got
            .chunks(v)
            .zip(want.chunks(v))
            .filter(|(a, b)| nrmse(a, b) < 1e-5)
            .count();
        eprintln!(
            "{:36} nrmse {e:.2e} top1 {t1:.2} exact positions {exact}/20",
            c.name
        );
        assert!(e < 2e-2, "{}: nrmse {e}", c.name);
        assert!(
            exact >= 15,
            "{}: only {exact} of 20 positions agree",
            c.name
        );
        assert!(t1 >= 0.9, "{}: top-1 {t1}", c.name);
    }
}

/// Records the experts the router chose: per layer and position, in the order chosen.
#[derive(Default)]
pub struct Routes(pub std::collections::BTreeMap<(usize, usize), Vec<usize>>);

impl Observer for Routes {
    fn observe(&mut self, _: usize, _: Input, _: &[f32]) {}

    fn routed(&mut self, layer: usize, pos: usize, k: usize, ids: &[u32]) {
        for (i, c) in ids.chunks(k).enumerate() {
            let c = c.iter().map(|&e| e as usize).collect();
            assert!(self.0.insert((layer, pos + i), c).is_none());
        }
    }
}

/// Every position's routes of `toks`, prefilled in chunks of `batch` (or decoded).
pub fn routes(m: &Model, toks: &[u32], batch: usize, decode: bool) -> Routes {
    let mut st = m
        .state(&StateOptions {
            batch,
            ..StateOptions::default()
        })
        .unwrap();
    st.set_observer(Box::<Routes>::default());
    if decode {
        for &t in toks {
            m.decode(&mut st, t).unwrap();
        }
    } else {
        m.prefill(&mut st, toks, None).unwrap();
    }
    *st.take_observer_as::<Routes>().unwrap()
}

/// The mixture-of-experts cases route every position as the naive reference does (the
/// same experts in the same order), in a prompt, in chunks and decoding.
#[test]
fn routing_matches_naive_reference() {
    for c in moe_cases() {
        let m = load(&c, 7);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 20, 3);
        let (_, want) = reference::logits_routed(&m, &toks);
        let layers: Vec<usize> = (0..c.flags.len())
            .filter(|&l| c.flags[l] & layer_flag::MOE != 0)
            .collect();
        assert_eq!(want.len(), layers.len());
        for (batch, decode) in [(512, false), (7, false), (1, true)] {
            let got = routes(&model, &toks, batch, decode);
            assert_eq!(got.0.len(), layers.len() * toks.len(), "{}", c.name);
            for (i, &l) in layers.iter().enumerate() {
                for (pos, w) in want[i].iter().enumerate() {
                    assert_eq!(
                        &got.0[&(l, pos)],
                        w,
                        "{}: layer {l} position {pos} (batch {batch}, decode {decode})",
                        c.name
                    );
                }
            }
        }
    }
}

#[test]
fn prefill_equals_decode_bit_for_bit() {
    for c in cases() {
        let m = load(&c, 11);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 19, 5);
        let (batch, dec) = prefill_and_decode(&model, &toks);
        assert!(batch == dec, "{}: decode differs from prefill", c.name);
        // Chunks of 7 (a ring that wraps inside a chunk) give the same bits.
        let chunked = all_logits(
            &model,
            &StateOptions {
                batch: 7,
                ..StateOptions::default()
            },
            &toks,
        );
        assert!(batch == chunked, "{}: chunked prefill differs", c.name);
        // The last logits returned by prefill are the last row.
        let mut st = model.state(&StateOptions::default()).unwrap();
        let last = model.prefill(&mut st, &toks, None).unwrap().to_vec();
        assert!(last[..] == batch[batch.len() - last.len()..], "{}", c.name);
    }
}

#[test]
fn ring_buffer_equals_masked_full_attention() {
    for c in cases().into_iter().filter(|c| c.h.sliding_window > 0) {
        let m = load(&c, 13);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 30, 9);
        let ring = StateOptions::default();
        let full = StateOptions {
            ring: false,
            ..StateOptions::default()
        };
        let a = all_logits(&model, &ring, &toks);
        let b = all_logits(&model, &full, &toks);
        assert!(
            a == b,
            "{}: ring differs from masked full attention",
            c.name
        );
        let sr = model.state(&ring).unwrap();
        let sf = model.state(&full).unwrap();
        assert!(
            sr.kv_bytes() < sf.kv_bytes(),
            "{}: the ring keeps only its window",
            c.name
        );
        // Decoding through the ring past several wraps.
        assert!(a == all_decoded(&model, &ring, &toks), "{}", c.name);
    }
}

/// Every position's logits, decoded token by token with `opts`.
pub fn all_decoded(m: &Model, opts: &StateOptions, toks: &[u32]) -> Vec<f32> {
    let mut st = m.state(opts).unwrap();
    let mut out = Vec::new();
    for &t in toks {
        out.extend_from_slice(m.decode(&mut st, t).unwrap());
    }
    out
}

/// Every position's logits by prefill, and by decoding token by token.
pub fn prefill_and_decode(m: &Model, toks: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let opts = StateOptions::default();
    (all_logits(m, &opts, toks), all_decoded(m, &opts, toks))
}

/// The scalar tier's prefill logits of `toks` on `model` (in `pool`), asserted equal to
/// its decode's; `what` names the case in the message.
pub fn scalar_bits(pool: &'static Pool, model: &Model, toks: &[u32], what: &str) -> Vec<f32> {
    let (base, dec) = pool
        .install(|| kernels::with_tier(Tier::Scalar, || prefill_and_decode(model, toks)))
        .unwrap();
    assert!(base == dec, "{what}: scalar decode differs from prefill");
    base
}

/// Prefill and decode of `toks` give `base` (the scalar bits) on every tier, thread
/// count and weight layout of [`tiers::on_every_tier`]; `what` names the case in the
/// messages. Returns the tiers that packed some matrix of `m`.
pub fn same_bits_on_every_tier(
    pools: &[&'static Pool],
    m: &Mlb,
    model: &Model,
    toks: &[u32],
    base: &[f32],
    what: &str,
) -> Vec<Tier> {
    tiers::on_every_tier(pools, m, model, |_, model, how| {
        let (p, d) = prefill_and_decode(model, toks);
        assert!(p == base, "{what}: {how}: prefill differs from scalar");
        assert!(d == base, "{what}: {how}: decode differs from scalar");
    })
}

/// Scalar == every tier, end to end: prefill and decode, 1, 2 and 3 threads, with and
/// without packed weights, on every synthetic case (attention with GQA, sliding windows
/// and a ring, softcaps, GELU, f16 scales, Q4_0, no-RoPE layers, the delta rule).
#[test]
fn every_tier_gives_the_same_bits() {
    let tiers = kernels::supported_tiers();
    eprintln!("tiers: {tiers:?}");
    let pools = tiers::pools();
    let mut packed_cases = Vec::new();
    for c in cases() {
        let m = load(&c, 17);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 12, 1);
        let base = scalar_bits(pools[0], &model, &toks, c.name);
        packed_cases.extend(same_bits_on_every_tier(
            &pools, &m, &model, &toks, &base, c.name,
        ));
    }
    // Every tier with packed kernels ran packed on some case (Q4_0 and Q8_0 files).
    for t in tiers {
        if Kernels::for_tier(t).unwrap().packs() {
            assert!(packed_cases.contains(&t), "tier {t} never ran packed");
        }
    }
}

/// BF16 activations (`HalfActs::Bf16`): scalar == every tier end to end on the cases with
/// BF16 matrices (BF16 with biases and q/k norms, BF16 with the delta rule, the mixed
/// file), prefill == decode, and the results differ from f32 activations' (the option
/// reaches the products).
#[test]
fn bf16_activations_give_the_same_bits_on_every_tier() {
    let pools = tiers::pools();
    let mut cased = 0;
    for c in cases()
        .into_iter()
        .filter(|c| c.name.starts_with("bf16") || c.name.starts_with("mixed"))
    {
        let m = load(&c, 23);
        let exact = Model::new(&m).unwrap();
        let model = Model::new(&m).unwrap().with_half_acts(HalfActs::Bf16);
        let toks = tokens(c.h.vocab, 11, 2);
        let base = scalar_bits(pools[0], &model, &toks, c.name);
        let (f32_acts, _) = pools[0]
            .install(|| kernels::with_tier(Tier::Scalar, || prefill_and_decode(&exact, &toks)))
            .unwrap();
        assert!(
            base != f32_acts,
            "{}: BF16 activations changed nothing",
            c.name
        );
        same_bits_on_every_tier(&pools, &m, &model, &toks, &base, c.name);
        cased += 1;
    }
    assert_eq!(cased, 5);
}

/// Forcing a tier forces the whole forward pass: the scalar tier runs no SIMD code at
/// all, and a SIMD tier runs its own kernels (for every kind of work on x86) and none
/// of a higher tier (the call counters of debug builds; one thread, so every call is
/// counted on this one).
#[test]
fn forced_tier_runs_only_its_kernels() {
    if crate::util::skip_without_counters() {
        return;
    }
    let pool = Pool::leak(1);
    // The work of a forward pass, each kind of it on every synthetic case set (Delta:
    // the Qwen3.5 case; F16: the f16-scale case; Half: the BF16, F16 and mixed cases;
    // Packed only where the tier packs).
    let work = [
        Op::Quantize,
        Op::Tile,
        Op::Half,
        Op::Attend,
        Op::Act,
        Op::Delta,
        Op::F16,
    ];
    for t in kernels::supported_tiers() {
        let k = Kernels::for_tier(t).unwrap();
        let mut calls = Vec::new();
        for c in cases() {
            let m = load(&c, 5);
            let packs = Packs::new(&m, &k).unwrap();
            let toks = tokens(c.h.vocab, 9, 4);
            counters::take();
            pool.install(|| {
                kernels::with_tier(t, || {
                    for model in [
                        Model::new(&m).unwrap(),
                        Model::with_packs(&m, &packs).unwrap(),
                        Model::new(&m).unwrap().with_half_acts(HalfActs::Bf16),
                    ] {
                        prefill_and_decode(&model, &toks);
                    }
                })
            })
            .unwrap();
            calls.push((c.name, counters::take()));
        }
        let total =
            |f: &dyn Fn(&counters::Calls) -> u64| calls.iter().map(|(_, c)| f(c)).sum::<u64>();
        for (name, c) in &calls {
            for u in Tier::ALL.into_iter().filter(|&u| u > t) {
                assert_eq!(
                    c.of_tier(u),
                    0,
                    "{name}: tier {t} ran code of tier {u}: {c:?}"
                );
            }
            if t == Tier::Scalar {
                for op in Op::ALL {
                    assert_eq!(c.simd(op), 0, "{name}: the scalar tier ran SIMD {op:?}");
                }
            }
        }
        assert!(
            total(&|c| c.of_tier(t)) > 0,
            "tier {t} never ran its own code"
        );
        let simd_f32 = cfg!(target_arch = "x86_64") && t != Tier::Scalar;
        for op in work {
            let (scalar, simd) = (total(&|c| c.get(Tier::Scalar, op)), total(&|c| c.simd(op)));
            match t {
                Tier::Scalar => assert!(scalar > 0, "scalar tier: no {op:?} ran"),
                _ if simd_f32 => {
                    assert!(simd > 0, "tier {t}: {op:?} never ran in SIMD");
                    assert_eq!(scalar, 0, "tier {t}: {op:?} ran scalar code");
                }
                _ => assert!(scalar + simd > 0, "tier {t}: no {op:?} ran"),
            }
        }
        if k.packs() {
            assert!(
                total(&|c| c.simd(Op::Packed)) > 0,
                "tier {t}: no packed kernel ran"
            );
        }
        // BF16 activations: `vdpbf16ps` on its tier, its emulation on the other x86
        // SIMD tiers, the reference on the scalar tier (and NEON).
        let (scalar, simd) = (
            total(&|c| c.get(Tier::Scalar, Op::Dot)),
            total(&|c| c.simd(Op::Dot)),
        );
        assert!(
            (simd > 0, scalar > 0) == (simd_f32, !simd_f32),
            "tier {t}: BF16 activations: {scalar} scalar, {simd} SIMD calls"
        );
    }
}

#[test]
fn thread_count_does_not_change_bits() {
    let c = &cases()[7];
    let m = load(c, 19);
    let model = Model::new(&m).unwrap();
    let toks = tokens(c.h.vocab, 40, 2);
    let a = Pool::leak(1).install(|| all_logits(&model, &StateOptions::default(), &toks));
    // Packed weights (where the tier has packed kernels) run q/k/v and gate/up as one
    // parallel step: still the same bits for any thread count.
    let packs = Packs::new(&m, &kernels::kernels()).unwrap();
    let packed = Model::with_packs(&m, &packs).unwrap();
    for threads in [2, 3] {
        let b = Pool::leak(threads).install(|| all_logits(&model, &StateOptions::default(), &toks));
        assert!(a == b, "{threads} threads");
        let p =
            Pool::leak(threads).install(|| all_logits(&packed, &StateOptions::default(), &toks));
        assert!(a == p, "{threads} threads, packed");
    }
}

#[test]
fn errors_are_typed() {
    let c = &cases()[0];
    let m = load(c, 1);
    let model = Model::new(&m).unwrap();
    let ctx8 = opts(8);
    let mut st = model.state(&ctx8).unwrap();
    let e = model.prefill(&mut st, &[1; 9], None).unwrap_err();
    assert_eq!(e, ModelError::ContextFull { needed: 9, ctx: 8 });
    let e = model
        .prefill(&mut st, &[1, 2, c.h.vocab], None)
        .unwrap_err();
    assert_eq!(
        e,
        ModelError::TokenOutOfRange {
            index: 2,
            id: c.h.vocab,
            vocab: c.h.vocab as usize
        }
    );
    assert_eq!(st.pos(), 0, "a refused prompt leaves the state untouched");
    model.prefill(&mut st, &[1; 8], None).unwrap();
    assert!(matches!(
        model.decode(&mut st, 1),
        Err(ModelError::ContextFull { needed: 9, ctx: 8 })
    ));
    let too_big = opts(c.h.max_seq as usize + 1);
    assert!(matches!(
        model.state(&too_big),
        Err(ModelError::BadOption { name: "--ctx", .. })
    ));
    assert!(model
        .prefill(&mut model.state(&ctx8).unwrap(), &[], None)
        .is_err());
}

/// A model with max_seq 2^24 asked for all of it in one batch: its attention scores
/// alone would take 2^51 bytes, more than any address space.
fn huge_context_model() -> Vec<u8> {
    let mut h = tiny_header();
    h.max_seq = 1 << 24;
    synth_file(&h, &[], 1)
}

/// A context the machine cannot hold is a typed error naming --ctx and the bytes it
/// needs, not an abort on allocation.
#[test]
fn huge_context_is_an_error_not_an_abort() {
    let m = Mlb::from_bytes(&huge_context_model()).unwrap();
    let model = Model::new(&m).unwrap();
    let all = StateOptions {
        ctx: Some(1 << 24),
        batch: 1 << 24,
        ..StateOptions::default()
    };
    let Err(ModelError::BadOption { name, value, rule }) = model.state(&all) else {
        panic!("a 2^51-byte state was allocated");
    };
    assert_eq!((name, value.as_str()), ("--ctx", "16777216"));
    let bytes: u128 = rule
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {rule:?}"));
    assert!(bytes > 1 << 51, "{rule}");
    // A context that fits still works.
    let small = opts(64);
    assert_eq!(model.state(&small).unwrap().ctx(), 64);
}

#[test]
fn default_context_is_max_seq_capped() {
    let c = &cases()[0];
    let m = load(c, 1);
    let model = Model::new(&m).unwrap();
    assert_eq!(
        model.state(&StateOptions::default()).unwrap().ctx(),
        c.h.max_seq as usize
    );
    let mut h = c.h;
    h.max_seq = 10000;
    let m = Mlb::from_bytes(&synth_file(&h, &[], 1)).unwrap();
    let model = Model::new(&m).unwrap();
    assert_eq!(model.state(&StateOptions::default()).unwrap().ctx(), 4096);
    let st = model.state(&opts(8000)).unwrap();
    assert_eq!(st.ctx(), 8000);
}

mod cli {
    use super::*;

    #[test]
    fn huge_context_is_one_line_not_an_abort() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.mlb");
        std::fs::write(&path, huge_context_model()).unwrap();
        let p = path.to_str().unwrap();
        let err = tool("mlb-run")
            .args([
                p, "--tokens", "1 2", "--ctx", "16777216", "--batch", "16777216",
            ])
            .fails();
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--ctx") && err.contains("bytes"), "{err}");
    }

    #[test]
    fn logits_file_matches_library() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_case(dir.path(), 7, 23);
        let bytes = std::fs::read(&path).unwrap();
        let out = dir.path().join("logits.bin");
        tool("mlb-run")
            .args([
                path.to_str().unwrap(),
                "--tokens",
                "1 5 9 33 2 7",
                "--logits",
                out.to_str().unwrap(),
            ])
            .ok();
        let got: Vec<f32> = std::fs::read(&out)
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let m = Mlb::from_bytes(&bytes).unwrap();
        let model = Model::new(&m).unwrap();
        let want = all_logits(&model, &StateOptions::default(), &[1, 5, 9, 33, 2, 7]);
        assert!(got == want);
        // Generation with ids printed (no tokenizer beside the model).
        let args = [
            path.to_str().unwrap(),
            "--tokens",
            "1 5 9",
            "-n",
            "4",
            "--verbose",
        ];
        let o = tool("mlb-run").args(args).ok();
        let (stdout, err) = (o.stdout, o.stderr);
        assert!(err.contains("tok/s") && err.contains("KV cache"), "{err}");
        assert!(err.contains("kernel tier"), "{err}");
        assert!(!stdout.trim().is_empty());
        // The prefetch hints are named, and `KRAFLA_PREFETCH` sets them all without
        // changing what is generated.
        #[cfg(target_arch = "x86_64")]
        {
            assert!(
                err.contains("weight prefetch (KRAFLA_PREFETCH): q4_0/q8_0 "),
                "{err}"
            );
            for h in ["nta", "t0", "t1", "t2"] {
                let o = tool("mlb-run").args(args).env("KRAFLA_PREFETCH", h).ok();
                let want = format!("q4_0/q8_0 {h}, block types {h}, bf16/f16 {h}");
                assert!(o.stderr.contains(&want), "{h}: {}", o.stderr);
                assert_eq!(o.stdout, stdout, "{h}");
            }
        }
    }

    #[test]
    fn errors_are_one_line_and_nonzero() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_case(dir.path(), 0, 3);
        let p = path.to_str().unwrap();
        let bad = dir.path().join("bad.mlb");
        std::fs::write(&bad, b"MLB2").unwrap();
        for (args, needle) in [
            (vec![p, "--tokens", "1 2 3", "--ctx", "2"], "ctx"),
            (vec![p, "--tokens", "1 2 500"], "500"),
            (vec![p, "--prompt", "hello"], "tokenizer"),
            (vec![bad.to_str().unwrap(), "--tokens", "1"], "bad.mlb"),
            (vec!["/nonexistent/x.mlb", "--tokens", "1"], "x.mlb"),
            (vec![p, "--tokens", "1", "--ctx", "100000"], "max_seq"),
            (vec![p, "--tokens", "1", "--top-p", "0"], "top-p"),
            (vec![p, "--tokens", "1", "--temp=-1"], "temp"),
        ] {
            let err = tool("mlb-run").args(&args).fails();
            assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }
}

#[test]
fn imatrix_sums_every_matrix_input() {
    let c = &cases()[0];
    let m = load(c, 29);
    let model = Model::new(&m).unwrap();
    let toks = tokens(c.h.vocab, 10, 4);
    let opts = StateOptions {
        imatrix: true,
        ..StateOptions::default()
    };
    let mut st = model.state(&opts).unwrap();
    let with = model.prefill(&mut st, &toks, None).unwrap().to_vec();
    let mi = st.imatrix().unwrap();
    assert_eq!((mi.tokens, mi.cls_tokens), (10, 1));
    assert!(mi.sums.iter().all(|&s| s >= 0.0) && mi.sums.iter().any(|&s| s > 0.0));
    // The input of w1/w3 of layer 0 is rmsnorm(x, ffn_norm): mean square ≈ mean w².
    let w13 = mi.slot(0, krafla::format::mli::Slot::W13);
    assert!(w13.iter().all(|&s| s > 0.0));
    // Summing changes no logit.
    let mut plain = model.state(&StateOptions::default()).unwrap();
    assert!(model.prefill(&mut plain, &toks, None).unwrap() == &with[..]);
    // Through mlb-run: a valid MLI1 file for this model.
    let dir = tempfile::tempdir().unwrap();
    let path = write_case(dir.path(), 0, 29);
    let mli = dir.path().join("m.mli");
    tool("mlb-run")
        .arg(&path)
        .args(["--tokens", "1 2 3 4 5", "--imatrix"])
        .arg(&mli)
        .ok();
    let f = krafla::format::mli::parse(&std::fs::read(&mli).unwrap()).unwrap();
    assert_eq!((f.n_layers, f.dim, f.tokens, f.cls_tokens), (2, 64, 5, 5));
}

/// A mixture of experts' importance matrix (MLI1 version 2): per MoE layer, each expert's
/// count is the positions routed to it (as the router chose), the counts sum to k per
/// position, the experts' dim-channel sums add up to k times the layer's W13 slot (every
/// token's FFN input, counted once per chosen expert), every routed expert's hidden sums
/// are positive and an unrouted one's zero; prefill and decode sum the same; and
/// `mlb-run --imatrix` writes such a file.
#[test]
fn imatrix_sums_each_expert() {
    use krafla::format::mli::{ExpertSlot, Slot};
    for (i, c) in moe_cases().iter().enumerate().take(3) {
        let m = load(c, 29);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 12, 4);
        let k = c.h.n_experts_used as usize;
        let mli = |decode: bool| {
            let opts = StateOptions {
                imatrix: true,
                ..StateOptions::default()
            };
            let mut st = model.state(&opts).unwrap();
            if decode {
                for &t in &toks {
                    model.decode(&mut st, t).unwrap();
                }
            } else {
                model.prefill(&mut st, &toks, None).unwrap();
            }
            st.imatrix().unwrap().clone()
        };
        let mi = mli(false);
        // (Decoding runs the classifier at every position, a prompt at its last only.)
        assert!(mli(true).moe == mi.moe, "{}: decode sums differ", c.name);
        let x = mi.moe.as_ref().expect("a version-2 matrix");
        let routes = routes(&model, &toks, 512, false);
        let layers: Vec<usize> = (0..c.flags.len())
            .filter(|&l| c.flags[l] & layer_flag::MOE != 0)
            .collect();
        assert_eq!(x.layers, layers, "{}", c.name);
        for &l in &layers {
            let mut total = 0;
            let mut sum_in = vec![0f64; c.h.dim as usize];
            for e in 0..x.n_experts {
                let n = x.tokens(l, e).unwrap();
                let want = (0..toks.len())
                    .filter(|&p| routes.0[&(l, p)].contains(&e))
                    .count() as u64;
                assert_eq!(n, want, "{}: layer {l} expert {e}", c.name);
                total += n;
                let hid = x.expert(l, e, ExpertSlot::Hidden).unwrap();
                assert_eq!(hid.iter().any(|&s| s > 0.0), n > 0, "{}: {l} {e}", c.name);
                for (a, b) in sum_in
                    .iter_mut()
                    .zip(x.expert(l, e, ExpertSlot::In).unwrap())
                {
                    *a += b;
                }
            }
            assert_eq!(total, (k * toks.len()) as u64, "{}: layer {l}", c.name);
            for (a, &b) in sum_in.iter().zip(mi.slot(l, Slot::W13)) {
                assert!(
                    (a - k as f64 * b).abs() <= 1e-9 * a.abs(),
                    "{}: layer {l}: experts' inputs {a} vs k · W13 {b}",
                    c.name
                );
            }
            assert!(mi.slot(l, Slot::W2).iter().all(|&s| s == 0.0));
            if c.h.shared_hidden > 0 {
                assert!(x.shared(l).unwrap().iter().all(|&s| s > 0.0), "{}", c.name);
            }
        }
        if i == 0 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.mlb");
            std::fs::write(&path, file(c, 29)).unwrap();
            let out = dir.path().join("m.mli");
            let o = std::process::Command::new(env!("CARGO_BIN_EXE_mlb-run"))
                .arg(&path)
                .args(["--tokens", "1 2 3 4 5", "--imatrix"])
                .arg(&out)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let f = krafla::format::mli::parse(&std::fs::read(&out).unwrap()).unwrap();
            let x = f.moe.expect("a version-2 file");
            let n: u64 = (0..x.n_experts).map(|e| x.tokens(1, e).unwrap()).sum();
            assert_eq!((x.layers, n), (vec![1], 5 * k as u64));
        }
    }
}

/// `--covariance` on mixture-of-experts models: each routed expert's ew2 input has its
/// own entry (a MoE layer's W2 slot with the expert's index) exactly when a token was
/// routed to it, over its tokens, with the expert's hidden sums as its diagonal; the
/// shared expert's sw2 input is the layer's W2 entry without an expert (none without a
/// shared expert); W13 holds every token's FFN input. The file parses back.
#[test]
fn covariance_of_each_expert() {
    use krafla::format::mli::cov::{self as mli_cov, CovSlot};
    use krafla::format::mli::{parse, ExpertSlot, Slot};
    use krafla::model::covariance::CovCollector;
    let mut seen_shared = false;
    for c in moe_cases().iter().take(3) {
        let m = load(c, 29);
        let model = Model::new(&m).unwrap();
        let toks = tokens(c.h.vocab, 12, 4);
        let opts = StateOptions::default();
        let obs = CovCollector::new(&model.cfg);
        let chunks = [toks.clone()];
        let (obs, _) =
            krafla::model::imatrix::collect_with(&model, &opts, &chunks, obs, |_, _| Ok(()))
                .unwrap();
        let bytes = obs.to_bytes();
        let f = parse(&bytes).unwrap();
        let x = f.moe.as_ref().expect("a version-2 file");
        let cov = f.covariance.as_ref().expect("a covariance section");
        let diag = |e: &mli_cov::CovEntry| -> Vec<f64> {
            let t = mli_cov::values(&bytes, e);
            let mut at = 0;
            (0..e.n)
                .map(|i| {
                    let v = t[at];
                    at += e.n - i;
                    v
                })
                .collect()
        };
        let close = |a: &[f64], b: &[f64], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (i, (&a, &b)) in a.iter().zip(b).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1e-30),
                    "{what} {i}: {a} vs {b}"
                );
            }
        };
        let w2 = CovSlot::Layer(Slot::W2);
        for &l in &x.layers {
            for e in 0..x.n_experts {
                let what = format!("{}: layer {l} expert {e}", c.name);
                let n = x.tokens(l, e).unwrap();
                match cov.find_expert(Some(l), w2, Some(e as u32)) {
                    Some(en) => {
                        assert_eq!((en.n, en.tokens), (x.expert_hidden, n), "{what}");
                        close(
                            &diag(en),
                            x.expert(l, e, ExpertSlot::Hidden).unwrap(),
                            &what,
                        );
                    }
                    None => assert_eq!(n, 0, "{what}: routed, no entry"),
                }
            }
            let shared = cov.find(Some(l), w2);
            assert_eq!(
                shared.is_some(),
                x.shared_hidden > 0,
                "{}: layer {l}",
                c.name
            );
            if let Some(en) = shared {
                seen_shared = true;
                assert_eq!(en.n, x.shared_hidden);
                close(&diag(en), x.shared(l).unwrap(), c.name);
            }
            let w13 = cov.find(Some(l), CovSlot::Layer(Slot::W13)).unwrap();
            close(&diag(w13), f.slot(l, Slot::W13), c.name);
        }
        assert!(
            cov.entries.iter().any(|e| e.expert.is_some()),
            "{}: no expert's entry",
            c.name
        );
        assert!(CovCollector::memory(&model.cfg) > 0);
    }
    assert!(seen_shared, "no case with a shared expert");
}
