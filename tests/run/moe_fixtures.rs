//! The mixture-of-experts fixtures against transformers (`testdata/make_fixtures.py`:
//! Qwen3-MoE, OLMoE, Mixtral, gpt-oss, Qwen3.5-MoE): each converted by `mlb-convert` and
//! run on every prompt of its routing.json: in BF16 within nRMSE 0.02 of transformers'
//! f32 logits, with the same experts at every MoE layer and position as transformers'
//! routers chose; in Q8_0 within 0.05 of them and of the simulated Q8_0 forward; and
//! every tier equal to scalar on one Q4_0 file.

use std::path::Path;

use krafla::format::mlb::Mlb;
use krafla::model::{Model, StateOptions};

use super::fixtures::{fixture_tiers_agree, testdata};
use super::{all_logits, nrmse, routes};
use crate::util::fixtures::{convert, ids, read_f32, with_reference};

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

/// The positions whose experts differ from transformers' at some MoE layer (compared
/// as sets), each with a line naming the layer and both choices.
fn route_diffs(model: &Model, toks: &[u32], layers: &Routing) -> Vec<(usize, String)> {
    let r = routes(model, toks, 512, false);
    let mut out = Vec::new();
    for (l, pos) in layers {
        for (p, want) in pos.iter().enumerate() {
            let mut a = r.0[&(*l, p)].clone();
            let mut b = want.clone();
            a.sort();
            b.sort();
            if a != b {
                out.push((
                    p,
                    format!("layer {l} position {p}: experts {a:?}, transformers {b:?}"),
                ));
            }
        }
    }
    out
}

/// The rows of `v` (of `vocab`) whose position is not in `skip`.
fn rows_except(v: &[f32], vocab: usize, skip: &[usize]) -> Vec<f32> {
    v.chunks(vocab)
        .enumerate()
        .filter(|(p, _)| !skip.contains(p))
        .flat_map(|(_, r)| r.iter().copied())
        .collect()
}

/// BF16: within nRMSE 0.02 of transformers' f32 logits on every prompt, with the same
/// experts at every MoE layer and position. Q8_0: within 0.05 of them and of the
/// simulated Q8_0 forward; a quantized model may pick another expert where two were
/// nearly tied (a discrete flip that moves that position's logits far more than the
/// rounding does), so such positions are named and left out of its nRMSE, and at most
/// one in five may flip (the tiny fixtures flip 0 to 4 of 32 positions at Q8_0, and
/// prompt 0 matches the simulated Q8_0 forward, which makes the same choices).
#[test]
fn moe_fixtures_match_transformers() {
    let root = testdata().join("models");
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (name, dir, _) in with_reference(&root, &NAMES) {
        let ps = prompts(&dir);
        for (quant, max) in [("bf16", 0.02), ("q8_0", 0.05)] {
            let out = tmp.path().join(format!("{name}.{quant}.mlb"));
            convert(&dir, &out, &["--wtype", quant]);
            let m = Mlb::open(&out).unwrap();
            let model = Model::new(&m).unwrap();
            let vocab = model.cfg.vocab;
            for (i, (toks, want, layers)) in ps.iter().enumerate() {
                let got = all_logits(&model, &StateOptions::default(), toks);
                let diffs = route_diffs(&model, toks, layers);
                for (_, d) in &diffs {
                    eprintln!("{name:20} {quant:5} prompt {i}: {d}");
                }
                let mut flipped: Vec<usize> = diffs.iter().map(|d| d.0).collect();
                flipped.dedup();
                if quant == "bf16" && !diffs.is_empty() || 5 * flipped.len() > toks.len() {
                    failures.push(format!(
                        "{name} {quant} prompt {i}: {} routes differ",
                        diffs.len()
                    ));
                }
                let e = nrmse(
                    &rows_except(&got, vocab, &flipped),
                    &rows_except(want, vocab, &flipped),
                );
                eprintln!(
                    "{name:20} {quant:5} prompt {i}: nRMSE {e:.5} vs transformers f32 \
                     ({} positions flipped, left out)",
                    flipped.len()
                );
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
            }
        }
    }
    assert!(failures.is_empty(), "MoE fixtures off: {failures:#?}");
}

/// Scalar == every tier, prefill and decode, 1-3 threads, map and packed, on each MoE
/// fixture at Q4_0 (the packed kernels' expert row ranges) and BF16.
#[test]
fn moe_fixture_tiers_give_the_same_bits() {
    fixture_tiers_agree(
        &NAMES,
        &[
            ("q4_0", &["--wtype", "q4_0"]),
            ("bf16", &["--wtype", "bf16"]),
        ],
        12,
    );
}

/// gpt-oss's MXFP4 experts asked for as MXFP4 (`--types experts=mxfp4`) are the
/// checkpoint's blocks, copied: per block of 32 its scale byte, then its codes moved
/// from OCP's pairs (element 2k in the low nibble of byte k) to GGUF's halves (element
/// j in the low nibble of byte j, j + 16 in the high one); they hold exactly the values
/// the decoding path stores in BF16; the model routes as transformers does and stays
/// within the Q8_0 bound of its logits (the activations are Q8_0 against MXFP4).
#[test]
fn gpt_oss_mxfp4_experts_are_copied_as_they_are() {
    use krafla::format::mlb::Kind;
    use krafla::quant::dequant_mat_row;
    use safetensors::SafeTensors;
    let dir = testdata().join("models/gpt_oss_mxfp4");
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("copy.mlb");
    let log = convert(
        &dir,
        &copy,
        &["--wtype", "bf16", "--types", "experts=mxfp4"],
    )
    .stderr;
    assert!(log.contains("MXFP4 blocks copied as they are"), "{log}");
    let decoded = tmp.path().join("decoded.mlb");
    let log = convert(&dir, &decoded, &["--wtype", "bf16"]).stderr;
    assert!(log.contains("--types experts=mxfp4 keeps"), "{log}");

    let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let (m, d) = (Mlb::open(&copy).unwrap(), Mlb::open(&decoded).unwrap());
    let mut checked = 0;
    for (i, t) in m.layout().tensors.iter().enumerate() {
        let (Some(l), Kind::Mat { rows, cols, .. }) = (t.name.layer, t.kind) else {
            continue;
        };
        let (hf, first, step) = match t.name.name {
            "ew1" => ("gate_up_proj", 0, 2),
            "ew3" => ("gate_up_proj", 1, 2),
            "ew2" => ("down_proj", 0, 1),
            _ => continue,
        };
        let get = |s: &str| {
            st.tensor(&format!("model.layers.{l}.mlp.experts.{hf}_{s}"))
                .unwrap()
        };
        let (blocks, scales) = (get("blocks"), get("scales"));
        let (w, nb) = (blocks.shape()[1], blocks.shape()[2]);
        let (blocks, scales) = (blocks.data(), scales.data());
        let per = rows / (m.header().n_experts as usize);
        let mut want = Vec::new();
        for r in 0..rows {
            let src = (r / per) * w + first + step * (r % per);
            for b in 0..nb {
                want.push(scales[src * nb + b]);
                let pairs = &blocks[(src * nb + b) * 16..][..16];
                let code = |j: usize| (pairs[j / 2] >> (4 * (j % 2))) & 15;
                want.extend((0..16).map(|j| code(j) | code(j + 16) << 4));
            }
        }
        let mat = m.mat(i);
        // The same array of the decoded (uniform) file: its own index.
        let j = d
            .layout()
            .tensors
            .iter()
            .position(|u| u.name == t.name)
            .unwrap();
        assert_eq!(mat.q, &want[..], "{}", t.name);
        // The same values as the decoding path's (BF16 holds them exactly).
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            dequant_mat_row(&mat, r, &mut a);
            dequant_mat_row(&d.mat(j), r, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x == y), "{} row {r}", t.name);
        }
        checked += 1;
    }
    assert_eq!(checked, 3 * m.dims().n_layers);

    let model = Model::new(&m).unwrap();
    for (i, (toks, want, layers)) in prompts(&dir).iter().enumerate() {
        let diffs = route_diffs(&model, toks, layers);
        assert!(diffs.is_empty(), "prompt {i}: {diffs:?}");
        let e = nrmse(&all_logits(&model, &StateOptions::default(), toks), want);
        eprintln!("gpt_oss_mxfp4 copied experts, prompt {i}: nRMSE {e:.5} vs transformers f32");
        assert!(e < 0.05, "prompt {i}: nRMSE {e}");
    }
}

/// A scale byte of 255 (E8M0's NaN) in an MXFP4 expert: one line naming the file, the
/// scales tensor, expert, row and block when the blocks are copied; the decoding path
/// refuses the NaN weight it gives; no output either way.
#[test]
fn gpt_oss_mxfp4_nan_scale_is_refused() {
    use crate::util::tool::mlb_convert;
    let src = testdata().join("models/gpt_oss_mxfp4");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    // The safetensors header: a u64 length, then JSON with each tensor's data offsets.
    let st = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = "model.layers.1.mlp.experts.down_proj_scales";
    let start = head[name]["data_offsets"][0].as_u64().unwrap() as usize;
    // [E, rows, blocks per row] u8: set the last block of expert 1's last row.
    let shape: Vec<usize> = head[name]["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    let (rows, nb) = (shape[1], shape[2]);
    let (e, r, b) = (1, rows - 1, nb - 1);
    bytes[8 + n + start + (e * rows + r) * nb + b] = 255;
    std::fs::write(&st, bytes).unwrap();
    let out = tmp.path().join("m.mlb");
    let err = mlb_convert(&dir, &out)
        .args(["--wtype", "bf16", "--types", "experts=mxfp4"])
        .fails();
    // (After the note of what was to be copied.)
    let errors = |err: &str| {
        err.lines()
            .filter(|l| l.starts_with("mlb-convert:"))
            .count()
    };
    assert_eq!(errors(&err), 1, "{err}");
    let want = format!("expert {e}, row {r}, block {b}: scale 255 is E8M0's NaN");
    assert!(err.contains(name) && err.contains(&want), "{err}");
    assert!(!out.exists());
    let err = mlb_convert(&dir, &out).args(["--wtype", "bf16"]).fails();
    assert_eq!(errors(&err), 1, "{err}");
    assert!(
        err.contains("down_proj_blocks") && err.contains("NaN"),
        "{err}"
    );
    assert!(!out.exists());
}
