//! The fixtures' transformers logits: each tiny checkpoint converted by `mlb-convert`
//! (Q8_0; Q4_0 with the round rule and no Q8_0 classes) and run by the runtime, against
//! `logits.sim_q8_0.bin` / `logits.sim_q4_0.bin` (the same forward with the format's
//! rounding) and, for the record, `logits.f32.bin`.

use std::path::{Path, PathBuf};

use krafla::format::mlb::Mlb;
use krafla::kernels::HalfActs;
use krafla::model::{Model, StateOptions};

use super::{all_logits, nrmse, same_bits_on_every_tier, scalar_bits, top1};
use crate::util::fixtures::{
    convert, convert_tokenizer, fixture_dirs, ids, read_f32, reference, with_reference,
};
use crate::util::tiers;
use crate::util::tool::tool;

/// Bounds against the simulated quantized forward (noise floor ≈ 0.02).
const MAX_NRMSE: f64 = 0.05;
const MIN_TOP1: f64 = 0.9;

pub fn testdata() -> PathBuf {
    std::env::var_os("KRAFLA_TESTDATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata"))
}

/// A fixture and its reference: reference.json, its tokens, the vocabulary size and
/// transformers' f32 logits (`logits.f32.bin`).
struct Fixture {
    dir: PathBuf,
    name: String,
    r: serde_json::Value,
    toks: Vec<u32>,
    vocab: usize,
    f32_ref: Vec<f32>,
}

/// The fixture in `dir`; `None` (with a SKIP line) without its reference.json.
fn fixture(dir: &Path) -> Option<Fixture> {
    let (r, toks) = reference(dir)?;
    Some(Fixture {
        dir: dir.to_path_buf(),
        name: dir.file_name().unwrap().to_string_lossy().into_owned(),
        vocab: r["vocab"].as_u64().unwrap() as usize,
        f32_ref: read_f32(&dir.join("logits.f32.bin")),
        r,
        toks,
    })
}

/// Every fixture of testdata/models with a reference, sorted, each read as the loop
/// reaches it; `None` (with a SKIP line) without the folder.
fn all_fixtures() -> Option<impl Iterator<Item = Fixture>> {
    let dirs = fixture_dirs(&testdata().join("models"))?;
    // The mixture-of-experts fixtures (with routing.json) have their own test, with
    // the runtime that runs them (tests/run/moe_fixtures.rs).
    let dirs = dirs
        .into_iter()
        .filter(|d| !d.join("routing.json").exists());
    Some(dirs.map(|d| fixture(&d).unwrap()))
}

struct Row {
    name: String,
    quant: &'static str,
    vs_sim: f64,
    top1_sim: f64,
    vs_f32: f64,
    top1_f32: f64,
}

/// The runtime's logits on `toks` from the fixture `name` converted to `out`, with
/// `acts` activations.
fn logits_of(out: &Path, name: &str, acts: HalfActs, toks: &[u32]) -> Vec<f32> {
    let m = Mlb::open(out).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model = Model::new(&m).unwrap().with_half_acts(acts);
    all_logits(&model, &StateOptions::default(), toks)
}

#[test]
fn fixtures_match_transformers() {
    let Some(fixtures) = all_fixtures() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for f in fixtures {
        let (dir, name, toks, vocab, f32_ref) = (&f.dir, &f.name, &f.toks, f.vocab, &f.f32_ref);
        for (quant, args, sim) in [
            ("q8_0", &["--wtype", "q8_0"][..], "logits.sim_q8_0.bin"),
            (
                "q4_0",
                &["--wtype", "q4_0", "--q4-rule", "round", "--q8", "none"][..],
                "logits.sim_q4_0.bin",
            ),
        ] {
            let out = tmp.path().join(format!("{name}.{quant}.mlb"));
            convert(dir, &out, args);
            let got = logits_of(&out, name, HalfActs::F32, toks);
            let sim_ref = read_f32(&dir.join(sim));
            let row = Row {
                name: name.clone(),
                quant,
                vs_sim: nrmse(&got, &sim_ref),
                top1_sim: top1(&got, &sim_ref, vocab),
                vs_f32: nrmse(&got, f32_ref),
                top1_f32: top1(&got, f32_ref, vocab),
            };
            if row.vs_sim >= MAX_NRMSE || row.top1_sim <= MIN_TOP1 {
                failures.push(format!(
                    "{name} {quant}: nRMSE {:.4} top-1 {:.3}",
                    row.vs_sim, row.top1_sim
                ));
            }
            rows.push(row);
        }
    }
    eprintln!(
        "{:34} {:5} {:>10} {:>8} {:>10} {:>8}",
        "fixture", "quant", "nRMSE sim", "top1", "nRMSE f32", "top1"
    );
    for r in &rows {
        eprintln!(
            "{:34} {:5} {:>10.5} {:>8.3} {:>10.4} {:>8.3}",
            r.name, r.quant, r.vs_sim, r.top1_sim, r.vs_f32, r.top1_f32
        );
    }
    assert!(failures.is_empty(), "fixtures off: {failures:#?}");
}

/// Scalar == every kernel tier, end to end, on converted fixtures that cover GQA and
/// q/k norms, sliding windows and local RoPE (Gemma 3, Mistral), softcaps and GELU
/// (Gemma 2), no-RoPE layers (SmolLM3) and the delta rule (Qwen3.5): prefill and
/// decode, 1 to 3 threads, read from the map and packed, Q8_0 and Q4_0 with f16 scales,
/// BF16, F16 and a mixed file of BF16, F16, Q8_0 and Q4_0 matrices.
#[test]
fn fixture_tiers_give_the_same_bits() {
    let names = [
        "gemma2",
        "gemma3_text",
        "mistral_sliding",
        "qwen3_5_text",
        "smollm3",
    ];
    fixture_tiers_agree(
        &names,
        &[
            ("q8_0", &["--wtype", "q8_0"]),
            ("q4_0", &["--wtype", "q4_0", "--f16-scales"]),
            ("bf16", &["--wtype", "bf16"]),
            ("f16", &["--wtype", "f16"]),
            // A mixed file: 2-byte floats and quantized matrices sharing inputs.
            (
                "mixed",
                &[
                    "--wtype",
                    "bf16",
                    "--types",
                    "wv=q8_0,w13=f16,w2=q4_0,wcls=q8_0",
                ],
            ),
        ],
        usize::MAX,
    );
}

/// Each fixture of `names` converted each way of `quants` (a name, mlb-convert's
/// arguments): scalar == every tier ([`same_bits_on_every_tier`]) on its first
/// `max_toks` reference tokens.
pub fn fixture_tiers_agree(names: &[&'static str], quants: &[(&str, &[&str])], max_toks: usize) {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let pools = tiers::pools();
    for (name, dir, toks) in with_reference(&root, names) {
        let toks = &toks[..toks.len().min(max_toks)];
        for (quant, args) in quants {
            let out = tmp.path().join(format!("{name}.{quant}.mlb"));
            convert(&dir, &out, args);
            let m = Mlb::open(&out).unwrap();
            let model = Model::new(&m).unwrap();
            let what = format!("{name} {quant}");
            let base = scalar_bits(pools[0], &model, toks, &what);
            same_bits_on_every_tier(&pools, &m, &model, toks, &base, &what);
        }
    }
}

/// The unquantized weights against the original: every fixture converted to BF16 and
/// to F16 (`--wtype bf16|f16`) and run by the runtime, against transformers' float32
/// forward (`logits.f32.bin`): nRMSE at most [`MAX_NRMSE_HALF`] each (the figures are
/// in docs/runtime.md), BF16 also with BF16 activations (`bf16a`, `HalfActs::Bf16`). A bf16 / f16 checkpoint converts to its own type without loss,
/// so there only the arithmetic differs; an f32 checkpoint (llama_rope_linear,
/// llama_rope_yarn_mscale, qwen3_5_mm) is rounded to 2-byte floats.
#[test]
fn fixtures_bf16_f16_match_transformers_f32() {
    let Some(fixtures) = all_fixtures() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut worst: f64 = 0.0;
    eprintln!(
        "{:34} {:9} {:5} {:>10} {:>8}",
        "fixture", "stored", "type", "nRMSE f32", "top1"
    );
    for f in fixtures {
        let (dir, name, toks, vocab, f32_ref) = (&f.dir, &f.name, &f.toks, f.vocab, &f.f32_ref);
        let r = &f.r;
        for (ty, acts) in [
            ("bf16", HalfActs::F32),
            ("bf16a", HalfActs::Bf16),
            ("f16", HalfActs::F32),
        ] {
            let wt = if ty == "f16" { ty } else { "bf16" };
            let out = tmp.path().join(format!("{name}.{wt}.mlb"));
            if !out.exists() {
                convert(dir, &out, &["--wtype", wt]);
            }
            let got = logits_of(&out, name, acts, toks);
            let (e, t1) = (nrmse(&got, f32_ref), top1(&got, f32_ref, vocab));
            let stored = r["dtype"].as_str().unwrap_or("?");
            eprintln!("{name:34} {stored:9} {ty:5} {e:>10.2e} {t1:>8.3}");
            worst = worst.max(e);
            // Stored in the same type, the weights are the checkpoint's bits: only the
            // order of the f32 arithmetic differs from transformers.
            // (BF16 activations round every matrix input: not lossless.)
            let lossless = matches!((stored, ty), ("bfloat16", "bf16") | ("float16", "f16"));
            // A mixture of experts under BF16 activations may pick another expert where
            // two were nearly tied (as Q8_0 does, tests/run/moe_fixtures.rs): the bound
            // of a quantized file then.
            let moe = dir.join("routing.json").exists();
            let max = if moe && ty == "bf16a" {
                MAX_NRMSE
            } else {
                MAX_NRMSE_HALF
            };
            if e > max || (lossless && e > MAX_NRMSE_LOSSLESS) {
                failures.push(format!("{name} {ty}: nRMSE {e:.6} top-1 {t1:.3}"));
            }
        }
    }
    eprintln!("worst nRMSE {worst:.6}");
    assert!(failures.is_empty(), "fixtures off: {failures:#?}");
}

/// The bound for BF16 / F16 files against transformers' float32 logits.
const MAX_NRMSE_HALF: f64 = 0.01;
/// The bound when the file holds the checkpoint's own bits (f32 rounding only).
const MAX_NRMSE_LOSSLESS: f64 = 1e-4;

/// The bundled default model: its logits on the reference prompt against transformers'
/// f32 forward, greedy continuations against `greedy.json`, and the same through
/// `mlb-run --prompt` with the converted tokenizer beside the model.
#[test]
fn default_model_greedy() {
    let dir = testdata().join("default");
    if !dir.join("reference.json").exists() {
        eprintln!("SKIP: no default model at {}", dir.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mlb = tmp.path().join("default.mlb");
    convert(&dir, &mlb, &["--wtype", "q8_0"]);
    let mlt = tmp.path().join("default.mlt");
    convert_tokenizer(&dir.join("tokenizer.json"), &mlt);
    let tok = krafla::tokenizer::Tokenizer::from_path(&mlt).unwrap();
    let m = Mlb::open(&mlb).unwrap();
    let model = Model::new(&m).unwrap();

    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let toks = ids(&r["tokens"]);
    assert_eq!(tok.encode(r["prompt"].as_str().unwrap()), toks);
    let got = all_logits(&model, &StateOptions::default(), &toks);
    let want = read_f32(&dir.join("logits.f32.bin"));
    let vocab = r["vocab"].as_u64().unwrap() as usize;
    let (e, t1) = (nrmse(&got, &want), top1(&got, &want, vocab));
    eprintln!("default q8_0 vs f32: nRMSE {e:.4} top-1 {t1:.3}");
    assert!(e < MAX_NRMSE && t1 > MIN_TOP1, "nRMSE {e} top-1 {t1}");

    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("greedy.json")).unwrap()).unwrap();
    let mut total = 0;
    for p in g["prompts"].as_array().unwrap() {
        let prompt = p["prompt"].as_str().unwrap();
        let pids = ids(&p["prompt_ids"]);
        let want = ids(&p["generated_ids"]);
        assert_eq!(tok.encode(prompt), pids, "{prompt:?}");
        let mut st = model.state(&StateOptions::default()).unwrap();
        let mut logits = model.prefill(&mut st, &pids, None).unwrap().to_vec();
        let mut gen = Vec::new();
        for _ in 0..want.len() {
            let next = krafla::model::sampler::argmax(&logits);
            gen.push(next);
            logits = model.decode(&mut st, next).unwrap().to_vec();
        }
        let same = gen.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "default greedy {prompt:?}: {same}/{} ids as transformers f32 (min margin {})",
            want.len(),
            p["min_top1_top2_margin"]
        );
        assert!(same >= 16, "{prompt:?}: diverges after {same} ids");
        total += same;
        // The command streams the same continuation as text.
        let o = tool("mlb-run")
            .arg(&mlb)
            .args([
                "--prompt",
                prompt,
                "--temp",
                "0",
                "-n",
                &want.len().to_string(),
            ])
            .ok();
        let text = String::from_utf8(o.stdout_bytes).unwrap();
        let eos = tok.eos();
        let upto: Vec<u32> = gen
            .iter()
            .copied()
            .take_while(|&t| Some(t) != eos)
            .collect();
        let expect = String::from_utf8_lossy(&tok.decode(&upto)).into_owned();
        assert_eq!(text.trim_end_matches('\n'), expect, "{prompt:?}");
    }
    // Quantization may flip a near-tie late in a continuation, not early and not often.
    assert!(total >= 64, "only {total} of 72 greedy ids agree");
}

/// A tokenizer with more tokens than the model's vocabulary is refused in one line.
#[test]
fn tokenizer_larger_than_model_is_refused() {
    let tj = testdata().join("default").join("tokenizer.json");
    if !tj.exists() {
        eprintln!("SKIP: no {}", tj.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mlt = tmp.path().join("big.mlt");
    convert_tokenizer(&tj, &mlt);
    let c = &super::cases()[0];
    let model = tmp.path().join("small.mlb");
    std::fs::write(&model, krafla::synth::synth_file(&c.h, &c.flags, 1)).unwrap();
    let err = tool("mlb-run")
        .arg(&model)
        .arg("--tokenizer")
        .arg(&mlt)
        .args(["--prompt", "hi"])
        .fails();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("big.mlt") && err.contains("n_vocab") && err.contains("96"),
        "{err}"
    );
}

/// The block types (`--wtype q4_k` …) against transformers' f32 forward: every type on
/// `llama_k256` (rows of 256, so the K types fit every matrix), with bounds on the
/// normalized RMSE that sit above the measured values (docs/convert.md), and the error
/// falling as bits rise within each family.
#[test]
fn block_types_match_transformers() {
    let Some(Fixture {
        dir,
        r,
        toks,
        vocab,
        f32_ref,
        ..
    }) = fixture(&testdata().join("models").join("llama_k256"))
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // (type, nRMSE bound): about 1.2× the measured values (q4_k 0.201, q5_k 0.094,
    // q6_k 0.049, q4_1 0.200, q5_0 0.117, q5_1 0.096, iq4_nl 0.212, q6_0 0.059;
    // Q8_0 0.021 and the simulated Q4_0 round 0.240 on the same fixture).
    let bounds = [
        ("q4_k", 0.24),
        ("q5_k", 0.12),
        ("q6_k", 0.06),
        ("q4_1", 0.24),
        ("q5_0", 0.14),
        ("q5_1", 0.12),
        ("iq4_nl", 0.25),
        ("q6_0", 0.07),
    ];
    let mut got_e = Vec::new();
    for (ty, bound) in bounds {
        let out = tmp.path().join(format!("{ty}.mlb"));
        convert(&dir, &out, &["--wtype", ty]);
        let m = Mlb::open(&out).unwrap();
        assert_eq!(
            m.header().wtype,
            krafla::format::WType::from_cli_name(ty).unwrap().code(),
            "{ty}: a uniform file"
        );
        let model = Model::new(&m).unwrap();
        let got = all_logits(&model, &StateOptions::default(), &toks);
        let (e, t1) = (nrmse(&got, &f32_ref), top1(&got, &f32_ref, vocab));
        eprintln!("llama_k256 {ty:7} nRMSE vs f32 {e:.4} top-1 {t1:.3}");
        got_e.push((ty, e, bound, t1));
    }
    for &(ty, e, bound, t1) in &got_e {
        assert!(
            e < bound && t1 > 0.5,
            "{ty}: nRMSE {e} (bound {bound}) top-1 {t1}"
        );
    }
    let e = |t: &str| got_e.iter().find(|x| x.0 == t).unwrap().1;
    // The searching 4.5-bit types beat llama.cpp's Q4_0 rounding (simulated by the
    // fixture script) on the same weights.
    let q4_0 = r["stats"]["nrmse_sim_q4_0"].as_f64().unwrap();
    assert!(
        e("q4_k") < q4_0 && e("iq4_nl") < q4_0,
        "{got_e:?} vs Q4_0 {q4_0}"
    );
    assert!(e("q6_k") < e("q5_k") && e("q5_k") < e("q4_k"), "{got_e:?}");
    assert!(
        e("q6_0") < e("q5_0") && e("q5_0") < e("iq4_nl"),
        "{got_e:?}"
    );
}

/// A mix of all eight block types in one file (classes and one tensor rule) and a K
/// type falling back on 64-wide rows (Gemma 3: sliding windows, local RoPE; Qwen 3.5:
/// the delta rule, lb and la kept Q8_0): scalar == every tier, prefill and decode, 1
/// to 3 threads, from the map and packed; and the mix within reach of transformers.
#[test]
fn block_type_fixtures_give_the_same_bits_on_every_tier() {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let pools = tiers::pools();
    let mix = "tok_emb=q5_1,wqk=q4_k,wv=q6_k,wo=q5_k,w13=iq4_nl,w2=q5_0,wcls=q6_0,layers.1.w2=q4_1";
    for (name, args) in [
        ("llama_k256", &["--types", mix][..]),
        ("gemma3_text", &["--wtype", "q4_k"][..]),
        ("qwen3_5_text", &["--wtype", "q5_k"][..]),
    ] {
        let Some(Fixture {
            dir,
            toks,
            vocab,
            f32_ref,
            ..
        }) = fixture(&root.join(name))
        else {
            continue;
        };
        let out = tmp.path().join(format!("{name}.mlb"));
        convert(&dir, &out, args);
        let m = Mlb::open(&out).unwrap();
        let model = Model::new(&m).unwrap();
        let base = scalar_bits(pools[0], &model, &toks, name);
        let (e, t1) = (nrmse(&base, &f32_ref), top1(&base, &f32_ref, vocab));
        eprintln!("{name} {args:?}: nRMSE vs f32 {e:.4} top-1 {t1:.3}");
        assert!(e < 0.3 && t1 > 0.6, "{name}: nRMSE {e} top-1 {t1}");
        same_bits_on_every_tier(&pools, &m, &model, &toks, &base, name);
    }
}
