//! The mixture-of-experts fixtures against transformers (`testdata/make_fixtures.py`:
//! Qwen3-MoE, OLMoE, Mixtral, gpt-oss, Qwen3.5-MoE): each converted by `mlb-convert` and
//! run on every prompt of its routing.json: in BF16 within nRMSE 0.02 of transformers'
//! f32 logits, with the same experts at every MoE layer and position as transformers'
//! routers chose; in Q8_0 within 0.05 of them and of the simulated Q8_0 forward; and
//! every tier equal to scalar on one Q4_0 file.

use std::path::Path;

use krafla::format::mlb::Mlb;
use krafla::model::{Model, StateOptions};

use super::fixtures::testdata;
use super::{all_logits, nrmse, routes, same_bits_on_every_tier, scalar_bits};
use crate::util::fixtures::{convert, ids, read_f32, with_reference};
use crate::util::tiers;

/// The MoE fixtures (those present in testdata/models run).
const NAMES: [&str; 6] = [
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "gpt_oss",
    "qwen3_5_moe_text",
    "gpt_oss_mxfp4",
];

/// Per MoE layer, per position the chosen experts (in transformers' order).
type Routing = Vec<(usize, Vec<Vec<usize>>)>;

/// Each prompt of the fixture's routing.json: its tokens, transformers' f32 logits and
/// its routes.
fn prompts(dir: &Path) -> Vec<(Vec<u32>, Vec<f32>, Routing)> {
    let text = std::fs::read_to_string(dir.join("routing.json")).unwrap();
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    let list = r["prompts"].as_array().unwrap();
    list.iter()
        .enumerate()
        .map(|(i, p)| {
            let file = match i {
                0 => "logits.f32.bin".to_string(),
                _ => format!("logits.f32.p{i}.bin"),
            };
            let mut layers: Routing = p["layers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(l, pos)| {
                    let pos = pos.as_array().unwrap();
                    let ids = pos
                        .iter()
                        .map(|e| ids(e).into_iter().map(|x| x as usize).collect())
                        .collect();
                    (l.parse().unwrap(), ids)
                })
                .collect();
            layers.sort_by_key(|x| x.0);
            (ids(&p["tokens"]), read_f32(&dir.join(file)), layers)
        })
        .collect()
}

#[test]
fn moe_fixtures_match_transformers() {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (name, dir, _) in with_reference(&root, &NAMES) {
        let ps = prompts(&dir);
        for (quant, max) in [("bf16", 0.02), ("q8_0", 0.05)] {
            let out = tmp.path().join(format!("{name}.{quant}.mlb"));
            convert(&dir, &out, &["--wtype", quant]).unwrap_or_else(|e| panic!("{name}: {e}"));
            let m = Mlb::open(&out).unwrap();
            let model = Model::new(&m).unwrap();
            for (i, (toks, want, layers)) in ps.iter().enumerate() {
                let got = all_logits(&model, &StateOptions::default(), toks);
                let e = nrmse(&got, want);
                eprintln!("{name:20} {quant:5} prompt {i}: nRMSE {e:.5} vs transformers f32");
                if e > max {
                    failures.push(format!("{name} {quant} prompt {i}: nRMSE {e:.4}"));
                }
                if i == 0 && quant == "q8_0" {
                    let sim = read_f32(&dir.join("logits.sim_q8_0.bin"));
                    let e = nrmse(&got, &sim);
                    eprintln!("{name:20} {quant:5} prompt 0: nRMSE {e:.5} vs simulated Q8_0");
                    if e > 0.05 {
                        failures.push(format!("{name} q8_0: nRMSE {e:.4} vs simulated"));
                    }
                }
                if quant != "bf16" {
                    continue;
                }
                // The same experts as transformers' routers, at every layer and position.
                let r = routes(&model, toks, 512, false);
                for (l, pos) in layers {
                    for (p, want) in pos.iter().enumerate() {
                        let mut a = r.0[&(*l, p)].clone();
                        let mut b = want.clone();
                        a.sort();
                        b.sort();
                        if a != b {
                            failures.push(format!(
                                "{name} prompt {i}: layer {l} position {p}: experts {a:?}, \
                                 transformers {b:?}"
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "MoE fixtures off: {failures:#?}");
}

/// Scalar == every tier, prefill and decode, 1-3 threads, map and packed, on each MoE
/// fixture at Q4_0 (the packed kernels' expert row ranges) and BF16.
#[test]
fn moe_fixture_tiers_give_the_same_bits() {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let pools = tiers::pools();
    for (name, dir, toks) in with_reference(&root, &NAMES) {
        for quant in ["q4_0", "bf16"] {
            let out = tmp.path().join(format!("{name}.{quant}.mlb"));
            convert(&dir, &out, &["--wtype", quant]).unwrap_or_else(|e| panic!("{name}: {e}"));
            let m = Mlb::open(&out).unwrap();
            let model = Model::new(&m).unwrap();
            let what = format!("{name} {quant}");
            let toks = &toks[..12];
            let base = scalar_bits(pools[0], &model, toks, &what);
            same_bits_on_every_tier(&pools, &m, &model, toks, &base, &what);
        }
    }
}
