//! `mlb-convert --wtype <block type>`, `--target-bpw`, `--preset` and `--mix-report`
//! through the binaries, read back by `mlb-inspect --json`: the bits per weight a file
//! reaches, the fallback of the K types on rows that are not whole super-blocks, the
//! budget, determinism at any thread count, and the presets' documented targets.

use std::path::{Path, PathBuf};

use crate::util::fixtures::convert;
use crate::util::tool::{mlb_convert, tool};
use crate::util::{fnv, testdata};

fn model(name: &str) -> PathBuf {
    testdata().join("models").join(name)
}

fn inspect(p: &Path) -> serde_json::Value {
    let out = tool("mlb-inspect").arg(p).arg("--json").ok().stdout;
    serde_json::from_str(&out).unwrap()
}

fn bpw(v: &serde_json::Value) -> f64 {
    v["totals"]["bits_per_weight"].as_f64().unwrap()
}

fn type_names(v: &serde_json::Value) -> Vec<String> {
    v["totals"]["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["type"].as_str().unwrap().to_string())
        .collect()
}

/// Every block type writes a uniform file of its exact size (llama_k256: rows of 256);
/// on 64-wide rows a K type falls back to the 32-weight type of the same size, with a
/// note naming the matrices.
#[test]
fn wtype_block_types_write_uniform_files() {
    let tmp = tempfile::tempdir().unwrap();
    for (ty, name, bits) in [
        ("q4_k", "Q4_K", 4.5),
        ("q5_k", "Q5_K", 5.5),
        ("q6_k", "Q6_K", 6.5625),
        ("q4_1", "Q4_1", 5.0),
        ("q5_0", "Q5_0", 5.5),
        ("q5_1", "Q5_1", 6.0),
        ("iq4_nl", "IQ4_NL", 4.5),
        ("q6_0", "Q6_0", 6.5),
        ("iq3_xxs", "IQ3_XXS", 3.0625),
        ("iq3_s", "IQ3_S", 3.4375),
        ("iq2_xxs", "IQ2_XXS", 2.0625),
        ("iq2_xs", "IQ2_XS", 2.3125),
        ("iq2_s", "IQ2_S", 2.5625),
        ("iq1_m", "IQ1_M", 1.75),
    ] {
        let out = tmp.path().join(format!("{ty}.mlb"));
        convert(&model("llama_k256"), &out, &["--wtype", ty]);
        let v = inspect(&out);
        assert_eq!(type_names(&v), [name], "{ty}");
        assert!((bpw(&v) - bits).abs() < 1e-3, "{ty}: {} bits", bpw(&v));
    }
    let out = tmp.path().join("fallback.mlb");
    let err = convert(&model("llama"), &out, &["--wtype", "q6_k"]).stderr;
    assert!(
        err.contains("Q6_K needs rows of whole 256-weight super-blocks")
            && err.contains("layers.*.w2")
            && err.contains("stored as Q6_0"),
        "{err}"
    );
    let v = inspect(&out);
    assert_eq!(type_names(&v), ["Q6_0"]);
    assert_eq!(
        v["header"]["wtype"].as_u64(),
        Some(12),
        "a uniform Q6_0 file"
    );
}

/// `--target-bpw X`: the file's bits per weight (mlb-inspect's, all matrices with their
/// scales) is at most X and within 0.15 of it, the mix uses more than one type, and
/// the choice grows with X.
#[test]
fn target_bpw_hits_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let mut last = 0.0;
    for x in [2.0, 2.3, 2.8, 3.2, 3.7, 4.3, 4.6, 5.0, 5.5, 6.0, 7.0] {
        let out = tmp.path().join(format!("t{x}.mlb"));
        convert(
            &model("llama_k256"),
            &out,
            &["--target-bpw", &x.to_string()],
        );
        let v = inspect(&out);
        let got = bpw(&v);
        eprintln!(
            "--target-bpw {x}: {got:.3} bits per weight, {:?}",
            type_names(&v)
        );
        assert!(got <= x && got > x - 0.15, "target {x}: {got}");
        assert!(got > last, "target {x}: {got} after {last}");
        last = got;
    }
    // Below the smallest mix (every matrix IQ1_M, or IQ4_NL on rows that are not whole
    // super-blocks): one line naming the option, the target and the least it takes.
    for (name, x, least) in [("llama_k256", "1.7", "1.750"), ("llama", "3", "4.5")] {
        let e = mlb_convert(&model(name), &tmp.path().join("low.mlb"))
            .args(["--target-bpw", x])
            .fails();
        let line = format!("--target-bpw: {x}: below the smallest mix this model takes ({least}");
        assert!(e.contains(&line), "{name}: {e}");
        let errors = e.lines().filter(|l| l.starts_with("mlb-convert:")).count();
        assert_eq!(errors, 1, "{e}");
    }
}

/// Below 3.5 bits the mix takes IQ codebook types on rows of whole super-blocks,
/// stays within the budget, says what it took before writing, and with `--gguf-types`
/// mlb-export takes the file.
#[test]
fn low_targets_take_codebook_types_and_export() {
    let tmp = tempfile::tempdir().unwrap();
    let codebook = ["IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"];
    for x in ["2.0", "2.5", "3.0"] {
        let out = tmp.path().join(format!("t{x}.mlb"));
        let rep = tmp.path().join(format!("t{x}.json"));
        let err = convert(
            &model("llama_k256"),
            &out,
            &[
                "--target-bpw",
                x,
                "--gguf-types",
                "--mix-report",
                rep.to_str().unwrap(),
            ],
        )
        .stderr;
        assert!(
            err.contains(&format!(
                "--target-bpw {}: the mix takes",
                x.parse::<f64>().unwrap()
            )),
            "{err}"
        );
        let v = inspect(&out);
        assert!(bpw(&v) <= x.parse::<f64>().unwrap(), "{x}: {}", bpw(&v));
        let names = type_names(&v);
        assert!(
            names.iter().any(|n| codebook.contains(&n.as_str())),
            "{x}: {names:?}"
        );
        // Every matrix measured in the codebook types, Q2_K and Q3_K no longer.
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&rep).unwrap()).unwrap();
        for m in r["matrices"].as_array().unwrap() {
            let types: Vec<&str> = m["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["type"].as_str().unwrap())
                .collect();
            assert_eq!(
                types[..6],
                ["iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s"]
            );
            assert!(
                !types.contains(&"q2_k") && !types.contains(&"q3_k"),
                "{types:?}"
            );
        }
        crate::util::fixtures::byte_mlt(&out.with_extension("mlt"));
        crate::util::tool::mlb_export(&out, &out.with_extension("gguf")).ok();
    }
}

/// The same target gives the same bytes at 1, 2 and 3 threads (Gemma 3: K types fall
/// back on its 64-wide rows; Qwen 3.5: lb and la stay Q8_0); a preset is its target.
#[test]
fn target_bpw_deterministic_and_presets_are_their_targets() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama_k256", "gemma3_text", "qwen3_5_text"] {
        let hashes: Vec<u64> = ["1", "2", "3"]
            .iter()
            .map(|n| {
                let out = tmp.path().join(format!("{name}{n}.mlb"));
                convert(&model(name), &out, &["--target-bpw", "5.2", "--threads", n]);
                fnv(&std::fs::read(&out).unwrap())
            })
            .collect();
        assert!(
            hashes.iter().all(|&h| h == hashes[0]),
            "{name}: {hashes:x?}"
        );
    }
    for (preset, x) in [
        ("iq2_m", "2.7"),
        ("q3_k_m", "4.0"),
        ("iq4_xs", "4.25"),
        ("q4_k_m", "4.9"),
        ("q5_k_m", "5.7"),
        ("q6_k", "6.6"),
    ] {
        let (a, b) = (tmp.path().join("a.mlb"), tmp.path().join("b.mlb"));
        convert(&model("llama_k256"), &a, &["--preset", preset]);
        convert(&model("llama_k256"), &b, &["--target-bpw", x]);
        assert_eq!(
            std::fs::read(&a).unwrap(),
            std::fs::read(&b).unwrap(),
            "{preset}"
        );
        assert!(bpw(&inspect(&a)) <= x.parse::<f64>().unwrap(), "{preset}");
    }
    let e = mlb_convert(&model("llama"), &tmp.path().join("p.mlb"))
        .args(["--preset", "q3_x"])
        .fails();
    assert!(e.contains("q3_x") && e.contains("q4_k_m"), "{e}");
}

/// `--gguf-types`: only GGUF's types, so that mlb-export takes the file: a K type on
/// 64-wide rows falls back to a GGUF type (Q6_K to Q8_0, not Q6_0), scales are f16
/// (GGUF's blocks hold f16), a mix never picks Q6_0, and a type GGUF lacks is refused.
#[test]
fn gguf_types_make_files_mlb_export_takes() {
    let tmp = tempfile::tempdir().unwrap();
    let export = |m: &Path| {
        crate::util::fixtures::byte_mlt(&m.with_extension("mlt"));
        crate::util::tool::mlb_export(m, &m.with_extension("gguf"))
    };
    // Without it: Q6_0 (Krafla's), which mlb-export refuses.
    let plain = tmp.path().join("plain.mlb");
    convert(&model("llama"), &plain, &["--wtype", "q6_k"]);
    assert_eq!(type_names(&inspect(&plain)), ["Q6_0"]);
    let e = export(&plain).fails();
    assert!(e.contains("Q6_0"), "{e}");
    let g = tmp.path().join("g.mlb");
    let err = convert(&model("llama"), &g, &["--wtype", "q6_k", "--gguf-types"]).stderr;
    assert!(err.contains("stored as Q8_0"), "{err}");
    let v = inspect(&g);
    assert_eq!(type_names(&v), ["Q8_0"]);
    assert_eq!(v["header"]["scale_f16"].as_u64(), Some(1));
    export(&g).ok();
    // A mix on 64-wide rows: Q6_0 without the flag, never with it.
    let (a, b) = (tmp.path().join("a.mlb"), tmp.path().join("b.mlb"));
    convert(&model("llama"), &a, &["--target-bpw", "6.8"]);
    assert!(type_names(&inspect(&a)).contains(&"Q6_0".to_string()));
    convert(
        &model("llama"),
        &b,
        &["--target-bpw", "6.8", "--gguf-types"],
    );
    let names = type_names(&inspect(&b));
    assert!(!names.contains(&"Q6_0".to_string()), "{names:?}");
    export(&b).ok();
    // A type GGUF lacks, asked for: refused by name.
    let e = mlb_convert(&model("llama"), &tmp.path().join("q6_0.mlb"))
        .args(["--wtype", "q6_0", "--gguf-types"])
        .fails();
    assert!(e.contains("--gguf-types") && e.contains("Q6_0"), "{e}");
}

/// `--mix-report`: per matrix the measured candidates and the choice, which is the type
/// the file stores; `--types` pins a matrix, and Qwen 3.5's lb and la stay Q8_0.
#[test]
fn mix_report_matches_the_file_and_pins_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q.mlb");
    let rep = tmp.path().join("q.json");
    convert(
        &model("qwen3_5_text"),
        &out,
        &[
            "--target-bpw",
            "5.5",
            "--types",
            "layers.0.w2=q8_0",
            "--mix-report",
            rep.to_str().unwrap(),
        ],
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&rep).unwrap()).unwrap();
    let v = inspect(&out);
    let mats: Vec<&serde_json::Value> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t.get("scales_offset").is_some())
        .collect();
    let rows = r["matrices"].as_array().unwrap();
    assert_eq!(rows.len(), mats.len());
    for (row, t) in rows.iter().zip(&mats) {
        let name = row["name"].as_str().unwrap();
        assert_eq!(name, t["name"].as_str().unwrap());
        let chosen = row["chosen"].as_str().unwrap();
        assert!(
            t["type"].as_str().unwrap().eq_ignore_ascii_case(chosen),
            "{name}: report {chosen}, file {}",
            t["type"]
        );
        if name == "layers.0.w2" || name.ends_with(".lb") || name.ends_with(".la") {
            assert_eq!(
                (chosen, row["fixed"].as_bool()),
                ("q8_0", Some(true)),
                "{name}"
            );
        } else {
            // Measured: errors fall as the candidates grow.
            let e: Vec<f64> = row["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["rel_error"].as_f64().unwrap())
                .collect();
            assert!(
                e.len() == 4 && e.windows(2).all(|w| w[0] > w[1]),
                "{name}: {e:?}"
            );
        }
    }
    let e = mlb_convert(&model("llama"), &tmp.path().join("m.mlb"))
        .args(["--mix-report", "x.json"])
        .fails();
    assert!(e.contains("--target-bpw"), "{e}");
}
