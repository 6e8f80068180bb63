//! Quantization error per bit of every weight type (not a timing):
//! `cargo bench --bench quant_error [-- CKPT_DIR [IMATRIX.mli]]`.
//!
//! Prints markdown tables, one per group of matrices: for each type its bits per weight
//! (scales included; Q8_0 and Q4_0 with f16 scales), the relative RMSE
//! `sqrt(Σ(x − x̂)² / Σx²)` and its SNR in dB, the importance-weighted relative error
//! `sqrt(Σ imp_c (x − x̂)² / Σ imp_c x²)` (the output error of `W·a` when the inputs are
//! uncorrelated with mean squares `imp`) quantized without and with the imatrix, and
//! `bpw − SNR / 6.02`: bits spent beyond the 6.02 dB per bit of an ideal uniform
//! quantizer (lower is better; the differences between types compare them per bit).
//!
//! Groups: a synthetic heavy-tailed matrix with outlier channels and a random
//! importance (always); with `CKPT_DIR` (a Llama-style checkpoint, e.g. SmolLM2-135M),
//! its `down_proj` matrices, its other layer matrices and its embedding, `MLI` (from
//! `mlb-run --imatrix`) giving the importance (else the synthetic groups' only).
//! Matrices are sampled: groups of 4 consecutive rows, evenly spaced, at most
//! `KRAFLA_QERR_ROWS` (default 128) rows per matrix. K types need rows of a multiple
//! of 256: for narrower matrices (576 columns) `k` consecutive rows are joined into one
//! of `k·cols` (2304 = 4·576 = 9·256), marked `†`; sub-blocks of 32 still lie inside a
//! row, super-blocks span 2 or 3 rows.

use std::path::Path;

use krafla::convert::hf::checkpoint::Checkpoint;
use krafla::format::mli::{self, Mli, Slot};
use krafla::quant::{self, Q4Rule, QuantOptions, WType};
use krafla::rng::Rng;

/// One matrix to measure: `rows × cols` values and the importance of its columns.
struct Mat {
    rows: usize,
    cols: usize,
    x: Vec<f32>,
    imp: Option<Vec<f32>>,
}

const TYPES: [WType; 10] = [
    WType::Q8_0,
    WType::Q6_K,
    WType::Q6_0,
    WType::Q5_1,
    WType::Q5_K,
    WType::Q5_0,
    WType::Q4_1,
    WType::Q4_K,
    WType::IQ4_NL,
    WType::Q4_0,
];

/// Bits per weight, scales included (Q8_0 / Q4_0 with f16 scales).
fn bpw(t: WType) -> f64 {
    let scale = if matches!(t, WType::Q8_0 | WType::Q4_0) {
        16.0
    } else {
        0.0
    };
    (8.0 * t.block_bytes() as f64 + scale) / t.block_weights() as f64
}

#[derive(Default, Clone, Copy)]
struct Sums {
    e: f64,
    x: f64,
    ew: f64,
    xw: f64,
}

/// Quantizes `m` to `t` (joining rows for K types when needed) and adds its errors.
fn measure(m: &Mat, t: WType, use_imatrix: bool, s: &mut Sums) -> bool {
    let bw = t.block_weights();
    let mut k = 1;
    while !(k * m.cols).is_multiple_of(bw) {
        k += 1;
    }
    let rows = m.rows / k * k;
    if rows == 0 {
        return false;
    }
    let (r2, c2) = (rows / k, m.cols * k);
    let x = &m.x[..rows * m.cols];
    let imp: Option<Vec<f32>> = m.imp.as_ref().map(|i| i.repeat(k));
    let opts = QuantOptions {
        scale_f16: true,
        q4_rule: Q4Rule::Search,
        imatrix: if use_imatrix { imp.as_deref() } else { None },
    };
    let q = quant::quantize(t, r2, c2, x, &opts).expect("quantize");
    let mut xq = vec![0f32; q.rows * q.cols];
    let m = q.view();
    for (r, row) in xq.chunks_exact_mut(q.cols).enumerate() {
        krafla::quant::dequant_mat_row(&m, r, row);
    }
    for (i, (&a, &b)) in x.iter().zip(&xq).enumerate() {
        let (a, b) = (a as f64, b as f64);
        let w = imp.as_ref().map_or(1.0, |v| v[i % c2] as f64);
        s.e += (a - b) * (a - b);
        s.x += a * a;
        s.ew += w * (a - b) * (a - b);
        s.xw += w * a * a;
    }
    k > 1
}

fn table(title: &str, mats: &[Mat]) {
    let has_imp = mats.iter().all(|m| m.imp.is_some());
    let n: usize = mats.iter().map(|m| m.rows * m.cols).sum();
    println!("\n### {title} ({} matrices, {n} weights)\n", mats.len());
    println!(
        "| type | bpw | rel. RMSE | SNR dB | bpw − SNR/6.02 | imp.-weighted rel. err. (plain search) | (imatrix search) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for t in TYPES {
        let (mut plain, mut with) = (Sums::default(), Sums::default());
        let mut joined = false;
        for m in mats {
            joined |= measure(m, t, false, &mut plain);
            if has_imp {
                measure(m, t, true, &mut with);
            }
        }
        let rel = (plain.e / plain.x).sqrt();
        let relw = (plain.ew / plain.xw).sqrt();
        let snr = -20.0 * rel.log10();
        println!(
            "| {}{} | {:.3} | {:.5} | {:.2} | {:.3} | {:.5} | {} |",
            t.name(),
            if joined { " †" } else { "" },
            bpw(t),
            rel,
            snr,
            bpw(t) - snr / 6.02,
            relw,
            if has_imp {
                format!("{:.5}", (with.ew / with.xw).sqrt())
            } else {
                "–".into()
            },
        );
    }
}

/// Up to `max` rows of `rows`, in groups of 4 consecutive rows, evenly spaced.
fn sample_rows(rows: usize, max: usize) -> Vec<usize> {
    if rows <= max {
        return (0..rows).collect();
    }
    let groups = max / 4;
    let step = rows / 4 / groups;
    (0..groups)
        .flat_map(|g| (0..4).map(move |i| 4 * g * step + i))
        .collect()
}

fn synthetic(rows: usize, cols: usize, seed: u64) -> Mat {
    let mut rng = Rng(seed);
    // Laplace values, 2% of them 6× wider; columns with spread scales (outlier channels);
    // an importance that is log-normal and heavier on the wide columns.
    let cs: Vec<f64> = (0..cols)
        .map(|_| 0.5 + 3.0 * rng.next_f64().powi(4))
        .collect();
    let imp: Vec<f32> = (0..cols)
        .map(|c| ((2.0 * (rng.next_f64() - 0.5)).exp() * cs[c]) as f32)
        .collect();
    let mean = imp.iter().sum::<f32>() / cols as f32;
    let x = (0..rows * cols)
        .map(|i| {
            let v = -(1.0 - rng.next_f64()).ln() * if rng.next_f64() < 0.5 { -1.0 } else { 1.0 };
            let v = if rng.next_f64() < 0.02 { v * 6.0 } else { v };
            (v * 0.02 * cs[i % cols]) as f32
        })
        .collect();
    Mat {
        rows,
        cols,
        x,
        imp: Some(imp.iter().map(|v| (v / mean).max(0.001)).collect()),
    }
}

fn load(ck: &Checkpoint, name: &str, imp: Option<Vec<f32>>, max_rows: usize) -> Option<Mat> {
    let t = ck.get(name)?;
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let mut x = Vec::new();
    let picked = sample_rows(rows, max_rows);
    for &r in &picked {
        ck.read_rows(t, t.dtype?, cols, r..r + 1, &mut x);
    }
    Some(Mat {
        rows: picked.len(),
        cols,
        x,
        imp,
    })
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let max_rows: usize = std::env::var("KRAFLA_QERR_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    println!("# Quantization error per bit (benches/quant_error.rs)");
    table(
        "synthetic: Laplace with 2% outliers, outlier channels, 256 × 1536",
        &[synthetic(256, 1536, 7)],
    );
    let Some(dir) = args.first() else {
        println!("\n(pass a checkpoint folder, and an .mli, for the real-weight groups)");
        return;
    };
    let ck = Checkpoint::open(Path::new(dir)).expect("checkpoint");
    let m: Option<Mli> = args
        .get(1)
        .map(|p| mli::parse(&std::fs::read(p).expect("read imatrix")).expect("parse imatrix"));
    let slot = |l: usize, s: Slot| m.as_ref().map(|m| Mli::importance(m.slot(l, s), m.tokens));
    let (mut down, mut other) = (Vec::new(), Vec::new());
    for l in 0.. {
        let p = format!("model.layers.{l}.");
        if !ck.contains(&format!("{p}mlp.down_proj.weight")) {
            break;
        }
        down.extend(load(
            &ck,
            &format!("{p}mlp.down_proj.weight"),
            slot(l, Slot::W2),
            max_rows,
        ));
        for (n, s) in [
            ("self_attn.q_proj", Slot::Attn),
            ("self_attn.k_proj", Slot::Attn),
            ("self_attn.v_proj", Slot::Attn),
            ("self_attn.o_proj", Slot::Wo),
            ("mlp.gate_proj", Slot::W13),
            ("mlp.up_proj", Slot::W13),
        ] {
            other.extend(load(&ck, &format!("{p}{n}.weight"), slot(l, s), max_rows));
        }
    }
    table("checkpoint: every layer's down_proj", &down);
    table("checkpoint: every layer's q, k, v, o, gate, up", &other);
    let cls = m
        .as_ref()
        .filter(|m| m.cls_tokens > 0)
        .map(|m| Mli::importance(m.cls(), m.cls_tokens));
    let emb: Vec<Mat> = load(&ck, "model.embed_tokens.weight", cls, 16 * max_rows)
        .into_iter()
        .collect();
    table(
        "checkpoint: embed_tokens (the tied classifier's importance)",
        &emb,
    );
}
