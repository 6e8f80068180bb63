//! Calibration and quality measurement: `mlb-run --imatrix` (counts, dimensions, an
//! independent computation of every slot on a synthetic model), the imatrix's effect
//! on `mlb-convert`'s Q4_0 search (lower importance-weighted error against the
//! checkpoint's weights), and `mlb-run --perplexity` / `--kl-divergence` against
//! values computed here from every position's logits.

use std::path::{Path, PathBuf};

use krafla::format::mlb::{Mixer, Mlb};
use krafla::format::mli::{self, Mli, Slot};
use krafla::kernels::QMat;
use krafla::model::eval::{self, log_softmax};
use krafla::model::imatrix::{self, Collector};
use krafla::model::sampler;
use krafla::model::{Model, StateOptions};
use krafla::synth::{synth_file, tiny_header};

use crate::run::opts;
use crate::run::reference::{mv, rms};
use crate::util::fixtures::{convert, convert_tokenizer, requantize_args};
use crate::util::testdata;
use crate::util::tool::{tool, Tool};

/// The default model converted to `dir/default-<wtype>.mlb` with `args`, and its
/// tokenizer beside it (`.mlt` of the same name).
fn default_model(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let out = dir.join(format!("{name}.mlb"));
    convert(&testdata().join("default"), &out, args);
    convert_tokenizer(
        &testdata().join("default/tokenizer.json"),
        &out.with_extension("mlt"),
    );
    out
}

fn corpus() -> PathBuf {
    testdata().join("tokenizers/corpus.txt")
}

/// `mlb-run <model> <args>`, to run.
fn run(model: &Path, args: &[&str]) -> Tool {
    let mut t = tool("mlb-run");
    t.arg(model).args(args);
    t
}

/// `mlb-run <model> --file <the tokenizers' corpus> --imatrix <out> <extra>`: its stdout.
fn imatrix(model: &Path, out: &Path, extra: &[&str]) -> String {
    let corpus = corpus();
    let mut args = vec![
        "--file",
        corpus.to_str().unwrap(),
        "--imatrix",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(model, &args).ok().stdout
}

fn slots(m: &Mli) -> Vec<(String, &[f64])> {
    let mut v = Vec::new();
    for l in 0..m.n_layers {
        for (s, n) in [
            (Slot::Attn, "attn"),
            (Slot::Wo, "wo"),
            (Slot::W13, "w13"),
            (Slot::W2, "w2"),
        ] {
            v.push((format!("layer {l} {n}"), m.slot(l, s)));
        }
    }
    v.push(("classifier".into(), m.cls()));
    v
}

/// `mlb-run --imatrix`: header, token counts, non-negative non-zero sums, the
/// periodic save, and the same matrix as the library's `collect`.
#[test]
fn imatrix_file_counts_and_dimensions() {
    let tmp = tempfile::tempdir().unwrap();
    let model = default_model(tmp.path(), "q8", &[]);
    let out = tmp.path().join("cal.mli");
    let stdout = imatrix(
        &model,
        &out,
        &["--ctx", "32", "--chunks", "3", "--save-every", "1"],
    );
    assert!(stdout.contains("perplexity"), "{stdout}");
    assert!(stdout.contains("96 layer tokens"), "{stdout}");
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..4], b"MLI1");
    let m = mli::parse(&bytes).unwrap();
    assert_eq!(
        (m.n_layers, m.dim, m.hidden_dim, m.q_dim),
        (4, 128, 384, 128)
    );
    assert_eq!(u32::from_le_bytes(bytes[20..24].try_into().unwrap()), 0);
    assert_eq!(m.tokens, 3 * 32);
    assert_eq!(m.cls_tokens, 3 * 32);
    for (name, s) in slots(&m) {
        assert!(s.iter().all(|&v| v >= 0.0), "{name}");
        assert!(s.iter().sum::<f64>() > 0.0, "{name} is all zero");
    }
    // Only the file is left in the folder besides the model (no temporary files).
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // The library on the same chunks gives the same sums.
    let tok = krafla::tokenizer::Tokenizer::from_path(&model.with_extension("mlt")).unwrap();
    let text = std::fs::read_to_string(corpus()).unwrap();
    let ids = tok.encode(&text);
    let bos = tok.bos().filter(|b| tok.encode("").first() == Some(b));
    let chunks = eval::chunks(&ids, 32, bos, Some(3)).unwrap();
    let mlb = Mlb::open(&model).unwrap();
    let mdl = Model::new(&mlb).unwrap();
    let opts = opts(32);
    let mut saves = 0;
    let (lib, stats) = imatrix::collect(&mdl, &opts, &chunks, |_, _| {
        saves += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(saves, 3);
    assert_eq!(lib, m);
    // Scored positions: 15..31 of each chunk of 32.
    assert_eq!(stats.nll.n, 3 * 15);

    // A text shorter than one chunk runs as one chunk; for a perplexity it is an
    // error, one line naming --ctx.
    let short = tmp.path().join("short.mli");
    run(
        &model,
        &[
            "--prompt",
            "hello world",
            "--imatrix",
            short.to_str().unwrap(),
        ],
    )
    .ok();
    let sm = mli::parse(&std::fs::read(&short).unwrap()).unwrap();
    let n = tok.encode("hello world").len() as u64;
    assert_eq!((sm.tokens, sm.cls_tokens), (n, n));
    let e = run(
        &model,
        &["--prompt", "hello", "--perplexity", "--ctx", "64"],
    )
    .fails();
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    assert!(e.contains("--ctx 64"), "{e}");
}

fn add_sq(s: &mut [f64], x: &[f64]) {
    s.iter_mut().zip(x).for_each(|(s, v)| *s += v * v);
}

/// Every slot of a synthetic Llama, from chunks of one token: at position 0 attention
/// is the token's own value vector, so the whole forward is a few matrix products,
/// computed here in f64 without the runtime.
#[test]
fn imatrix_slots_match_an_independent_forward() {
    let h = tiny_header();
    let bytes = synth_file(&h, &[], 41);
    let m = Mlb::from_bytes(&bytes).unwrap();
    let d = *m.dims();
    let lay = m.layout().clone();
    let toks: Vec<u32> = vec![5, 17, 3, 88, 42, 17, 60];
    let mut want = Mli::new(d.n_layers, d.dim, d.hidden_dim, d.n_heads * d.head_dim);
    for &t in &toks {
        let mut row = vec![0f32; d.dim];
        krafla::quant::dequant_mat_row(&m.mat(lay.tok_emb), t as usize, &mut row);
        let mut x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        for (l, li) in lay.layers.iter().enumerate() {
            let xn = rms(&x, m.f32s(li.attn_norm), h.norm_eps);
            add_sq(want.slot_mut(l, Slot::Attn), &xn);
            let Mixer::Attention(a) = &li.mixer else {
                panic!("attention layers only")
            };
            let v = mv(&m.mat(a.wv), &xn);
            let group = d.n_heads / d.n_kv_heads;
            let att: Vec<f64> = (0..d.n_heads)
                .flat_map(|hh| {
                    let k = hh / group;
                    v[k * d.head_dim..(k + 1) * d.head_dim].to_vec()
                })
                .collect();
            add_sq(want.slot_mut(l, Slot::Wo), &att);
            let o = mv(&m.mat(a.wo), &att);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let hn = rms(&x, m.f32s(li.ffn_norm), h.norm_eps);
            add_sq(want.slot_mut(l, Slot::W13), &hn);
            let (w1, w2, w3) = li.dense().expect("a dense FFN");
            let g = mv(&m.mat(w1), &hn);
            let u = mv(&m.mat(w3), &hn);
            let hid: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            add_sq(want.slot_mut(l, Slot::W2), &hid);
            let o = mv(&m.mat(w2), &hid);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        }
        add_sq(want.cls_mut(), &rms(&x, m.f32s(lay.final_norm), h.norm_eps));
    }
    let model = Model::new(&m).unwrap();
    let chunks: Vec<Vec<u32>> = toks.iter().map(|&t| vec![t]).collect();
    let opts = opts(1);
    let (got, stats) = imatrix::collect(&model, &opts, &chunks, |_, _| Ok(())).unwrap();
    assert_eq!(got.tokens, toks.len() as u64);
    assert_eq!(got.cls_tokens, toks.len() as u64);
    assert_eq!(stats.nll.n, 0, "a chunk of one token scores nothing");
    for ((name, g), (_, w)) in slots(&got).into_iter().zip(slots(&want)) {
        let num: f64 = g.iter().zip(w).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f64 = w.iter().map(|b| b * b).sum();
        let rel = (num / den).sqrt();
        assert!(rel < 1e-4, "{name}: relative error {rel}");
    }

    // The observer sees nothing once taken off, and classifier rows only where logits
    // are computed: a prefill without logits classifies its last position alone.
    let mut st = model.state(&StateOptions::default()).unwrap();
    st.set_observer(Box::new(Collector::new(&model.cfg)));
    model.prefill(&mut st, &toks, None).unwrap();
    let c = st.take_observer_as::<Collector>().unwrap().into_mli();
    assert_eq!((c.tokens, c.cls_tokens), (toks.len() as u64, 1));
    model.prefill(&mut st, &[1], None).unwrap();
    assert!(st.take_observer().is_none());
}

/// Reads a bf16 / f32 tensor of a safetensors file as f32.
/// A matrix of the default model's attention layers in two `.mlb` files of it: its
/// layer, Hugging Face name and imatrix slot, and its index in each file.
struct LayerMat {
    l: usize,
    hf: &'static str,
    slot: Slot,
    a: usize,
    b: usize,
}

/// The v, o and FFN matrices of layers `0..n_layers` in `a` and `b`, layer by layer.
fn layer_mats(a: &Mlb, b: &Mlb, n_layers: usize) -> Vec<LayerMat> {
    let mut v = Vec::new();
    for l in 0..n_layers {
        let (al, bl) = (&a.layout().layers[l], &b.layout().layers[l]);
        let (Mixer::Attention(aa), Mixer::Attention(ba)) = (&al.mixer, &bl.mixer) else {
            panic!("attention layers only")
        };
        let (ad, bd) = (al.dense().unwrap(), bl.dense().unwrap());
        for (hf, a, b, slot) in [
            ("self_attn.v_proj", aa.wv, ba.wv, Slot::Attn),
            ("self_attn.o_proj", aa.wo, ba.wo, Slot::Wo),
            ("mlp.gate_proj", ad.0, bd.0, Slot::W13),
            ("mlp.up_proj", ad.2, bd.2, Slot::W13),
            ("mlp.down_proj", ad.1, bd.1, Slot::W2),
        ] {
            v.push(LayerMat { l, hf, slot, a, b });
        }
    }
    v
}

fn st_tensor(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    let t = st.tensor(name).unwrap();
    let v = match t.dtype() {
        safetensors::Dtype::BF16 => t
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F32 => crate::util::fixtures::f32s(t.data()),
        d => panic!("{name}: dtype {d:?}"),
    };
    (t.shape().to_vec(), v)
}

/// `Σ_rows Σ_j imp_j (w − ŵ)²` of a quantized matrix against the original weights,
/// and the same over the tenth of the channels with the highest importance.
fn weighted_err(m: &QMat, w: &[f32], imp: &[f32]) -> (f64, f64) {
    let mut order: Vec<usize> = (0..imp.len()).collect();
    order.sort_by(|&a, &b| imp[b].total_cmp(&imp[a]));
    let top = &order[..imp.len() / 10];
    let mut row = vec![0f32; m.cols];
    let (mut all, mut hi) = (0.0, 0.0);
    for r in 0..m.rows {
        krafla::quant::dequant_mat_row(m, r, &mut row);
        let src = &w[r * m.cols..(r + 1) * m.cols];
        for j in 0..m.cols {
            all += imp[j] as f64 * ((src[j] - row[j]) as f64).powi(2);
        }
        for &j in top {
            hi += imp[j] as f64 * ((src[j] - row[j]) as f64).powi(2);
        }
    }
    (all, hi)
}

/// An imatrix from the default model's own calibration run makes `mlb-convert`'s
/// Q4_0 search trade error on unimportant channels for less error on important ones:
/// the importance-weighted squared error against the checkpoint's weights goes down
/// for every matrix it weights, and most on the top tenth of channels.
#[test]
fn imatrix_lowers_the_weighted_q4_error() {
    let tmp = tempfile::tempdir().unwrap();
    let q8 = default_model(tmp.path(), "q8", &[]);
    let mli_path = tmp.path().join("cal.mli");
    imatrix(&q8, &mli_path, &["--ctx", "64"]);
    let im = mli::parse(&std::fs::read(&mli_path).unwrap()).unwrap();
    let q4 = ["--wtype", "q4_0", "--q4-rule", "search", "--q8", "none"];
    let plain = default_model(tmp.path(), "plain", &q4);
    let mut wq = q4.to_vec();
    wq.extend(["--imatrix", mli_path.to_str().unwrap()]);
    let weighted = default_model(tmp.path(), "weighted", &wq);
    let (pm, wm) = (Mlb::open(&plain).unwrap(), Mlb::open(&weighted).unwrap());
    let st = testdata().join("default/model.safetensors");
    let mut rows = Vec::new();
    for m in layer_mats(&pm, &wm, im.n_layers) {
        let (_, w) = st_tensor(&st, &format!("model.layers.{}.{}.weight", m.l, m.hf));
        let imp = Mli::importance(im.slot(m.l, m.slot), im.tokens);
        let p = weighted_err(&pm.mat(m.a), &w, &imp);
        let q = weighted_err(&wm.mat(m.b), &w, &imp);
        rows.push((format!("layer {} {}", m.l, m.hf), p, q));
    }
    // The tied classifier (tok_emb) is weighted by the classifier input.
    let (_, w) = st_tensor(&st, "model.embed_tokens.weight");
    let imp = Mli::importance(im.cls(), im.cls_tokens);
    let p = weighted_err(&pm.mat(pm.layout().tok_emb), &w, &imp);
    let q = weighted_err(&wm.mat(wm.layout().tok_emb), &w, &imp);
    rows.push(("tok_emb (tied classifier)".into(), p, q));
    for (name, p, q) in &rows {
        eprintln!(
            "{name}: weighted error {:.4e} → {:.4e} ({:+.1}%), top tenth {:.4e} → {:.4e} ({:+.1}%)",
            p.0,
            q.0,
            100.0 * (q.0 / p.0 - 1.0),
            p.1,
            q.1,
            100.0 * (q.1 / p.1 - 1.0)
        );
        assert!(q.0 < p.0, "{name}: {} ≥ {}", q.0, p.0);
        assert!(q.1 < p.1, "{name}: top tenth {} ≥ {}", q.1, p.1);
    }

    // An all-zero slot (layer 0's Wo) and no classifier tokens: those matrices fall
    // back to the unweighted search, the others keep their weighting.
    let mut z = im.clone();
    z.slot_mut(0, Slot::Wo).fill(0.0);
    z.cls_tokens = 0;
    z.cls_mut().fill(0.0);
    let z_path = tmp.path().join("zero.mli");
    std::fs::write(&z_path, z.to_bytes()).unwrap();
    let mut zq = q4.to_vec();
    zq.extend(["--imatrix", z_path.to_str().unwrap()]);
    let zm = Mlb::open(&default_model(tmp.path(), "zero", &zq)).unwrap();
    let all = |m: &QMat| -> Vec<f32> {
        let mut row = vec![0f32; m.cols];
        (0..m.rows)
            .flat_map(|r| {
                krafla::quant::dequant_mat_row(m, r, &mut row);
                row.clone()
            })
            .collect()
    };
    let wo = |m: &Mlb| match &m.layout().layers[0].mixer {
        Mixer::Attention(a) => a.wo,
        _ => unreachable!(),
    };
    let w2 = |m: &Mlb| m.layout().layers[0].dense().unwrap().1;
    let emb = |m: &Mlb| m.layout().tok_emb;
    assert!(all(&zm.mat(wo(&zm))) == all(&pm.mat(wo(&pm))));
    assert!(all(&zm.mat(emb(&zm))) == all(&pm.mat(emb(&pm))));
    assert!(all(&zm.mat(w2(&zm))) == all(&wm.mat(w2(&wm))));
    assert!(all(&zm.mat(w2(&zm))) != all(&pm.mat(w2(&pm))));
}

/// `tr(ΔW H ΔWᵀ)` of a quantized matrix against the original weights, H n × n.
fn output_err(m: &QMat, w: &[f32], h: &[f64]) -> f64 {
    let n = m.cols;
    let mut row = vec![0f32; n];
    let mut e = 0.0;
    for r in 0..m.rows {
        krafla::quant::dequant_mat_row(m, r, &mut row);
        let d: Vec<f64> = (0..n).map(|j| (w[r * n + j] - row[j]) as f64).collect();
        for i in 0..n {
            e += d[i] * (0..n).map(|j| h[i * n + j] * d[j]).sum::<f64>();
        }
    }
    e
}

/// `mlb-run --imatrix --covariance`: a covariance for every input whose diagonal is the
/// body's sums; mlb-convert's error feedback lowers the output error tr(ΔW H ΔWᵀ) of
/// the matrices it quantizes, gives the same bytes at 1 and 2 threads, and
/// `--no-error-feedback` gives the bytes of the imatrix without covariances.
#[test]
fn covariance_and_error_feedback() {
    use krafla::format::mli::cov::{self as mli_cov, CovSlot};
    let tmp = tempfile::tempdir().unwrap();
    let q8 = default_model(tmp.path(), "q8", &[]);
    let cov_path = tmp.path().join("cov.mli");
    let out = imatrix(&q8, &cov_path, &["--ctx", "64", "--covariance"]);
    assert!(out.contains("covariance:"), "{out}");
    let bytes = std::fs::read(&cov_path).unwrap();
    let im = mli::parse(&bytes).unwrap();
    let cov = im.covariance.clone().expect("a covariance section");
    assert_eq!(cov.entries.len(), 4 * im.n_layers + 1);
    let h_of = |layer: Option<usize>, slot: CovSlot| -> Vec<f64> {
        let e = cov.find(layer, slot).unwrap();
        let tri = mli_cov::values(&bytes, e);
        let n = e.n;
        let mut h = vec![0f64; n * n];
        let mut at = 0;
        for i in 0..n {
            for j in i..n {
                (h[i * n + j], h[j * n + i]) = (tri[at], tri[at]);
                at += 1;
            }
        }
        h
    };
    for l in 0..im.n_layers {
        for slot in [Slot::Attn, Slot::Wo, Slot::W13, Slot::W2] {
            let h = h_of(Some(l), CovSlot::Layer(slot));
            let sums = im.slot(l, slot);
            let n = sums.len();
            for (i, &s) in sums.iter().enumerate() {
                let d = h[i * n + i];
                assert!(
                    (d - s).abs() <= 1e-6 * s.max(1e-30),
                    "layer {l} {slot:?} {i}: {d} vs {s}"
                );
            }
        }
    }
    let o = tool("mlb-inspect").arg(&cov_path).ok();
    assert!(o.stdout.contains("covariance section"), "{}", o.stdout);

    let q4 = ["--wtype", "q4_0", "--q4-rule", "search", "--q8", "none"];
    let with = |extra: &[&str], name: &str| {
        let mut a = q4.to_vec();
        a.extend(["--imatrix", cov_path.to_str().unwrap()]);
        a.extend_from_slice(extra);
        default_model(tmp.path(), name, &a)
    };
    let fed = with(&[], "fed");
    // The test's few calibration tokens per channel: the converter says so.
    let mut a = q4.to_vec();
    a.extend(["--imatrix", cov_path.to_str().unwrap()]);
    let e = convert(
        &testdata().join("default"),
        &tmp.path().join("thin.mlb"),
        &a,
    )
    .stderr;
    assert!(e.contains("warning: a covariance of"), "{e}");
    for (flag, v) in [("--feedback-shrink", "1.5"), ("--feedback-damp", "0")] {
        let e = tool("mlb-convert")
            .arg(testdata().join("default"))
            .args(["-o", tmp.path().join("bad.mlb").to_str().unwrap()])
            .args(a.iter().copied().chain([flag, v]))
            .fails();
        assert!(e.contains(flag) && e.contains(v), "{e}");
    }
    let fed2 = with(&["--threads", "1"], "fed1");
    assert_eq!(std::fs::read(&fed).unwrap(), std::fs::read(&fed2).unwrap());
    let off = with(&["--no-error-feedback"], "off");
    let body_path = tmp.path().join("body.mli");
    std::fs::write(&body_path, im.to_bytes()).unwrap();
    let mut a = q4.to_vec();
    a.extend(["--imatrix", body_path.to_str().unwrap()]);
    let body = default_model(tmp.path(), "body", &a);
    assert_eq!(std::fs::read(&off).unwrap(), std::fs::read(&body).unwrap());

    let (fm, om) = (Mlb::open(&fed).unwrap(), Mlb::open(&off).unwrap());
    let st = testdata().join("default/model.safetensors");
    let (mut tot_f, mut tot_o) = (0.0, 0.0);
    let mats = layer_mats(&fm, &om, im.n_layers);
    for m in mats.iter().filter(|m| m.hf != "mlp.up_proj") {
        let (l, hf) = (m.l, m.hf);
        let (_, w) = st_tensor(&st, &format!("model.layers.{l}.{hf}.weight"));
        let h = h_of(Some(l), CovSlot::Layer(m.slot));
        let (ef, eo) = (
            output_err(&fm.mat(m.a), &w, &h),
            output_err(&om.mat(m.b), &w, &h),
        );
        eprintln!(
            "layer {l} {hf}: output error {eo:.4e} → {ef:.4e} ({:.3})",
            ef / eo
        );
        (tot_f, tot_o) = (tot_f + ef, tot_o + eo);
    }
    eprintln!(
        "all: output error {tot_o:.4e} → {tot_f:.4e} ({:.3})",
        tot_f / tot_o
    );
    assert!(tot_f < 0.9 * tot_o, "{tot_f} vs {tot_o}");
}

/// Every position's logits of one chunk, run alone.
fn chunk_logits(model: &Model, chunk: &[u32]) -> Vec<f32> {
    let mut st = model.state(&StateOptions::default()).unwrap();
    let mut out = Vec::new();
    let mut sink = |_: usize, l: &[f32]| out.extend_from_slice(l);
    model.prefill(&mut st, chunk, Some(&mut sink)).unwrap();
    out
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("{e}: {s}"))
}

/// `--perplexity` and `--kl-divergence` against the definitions applied here to
/// every position's logits of each chunk run alone; a model against itself has KL 0.
#[test]
fn perplexity_and_kl_divergence_match_the_definitions() {
    let tmp = tempfile::tempdir().unwrap();
    let q8 = default_model(tmp.path(), "q8", &[]);
    let q4 = default_model(tmp.path(), "q4", &["--wtype", "q4_0", "--q8", "none"]);
    kl_matches_the_definitions(&q8, &q4);
    // Errors: one line, non-zero.
    for (args, needle) in [
        (
            vec!["--tokens", "1 2 3", "--perplexity", "--ctx", "1"],
            "--ctx",
        ),
        (
            vec!["--tokens", "1 2 3", "--kl-divergence", "/nonexistent/r.mlb"],
            "r.mlb",
        ),
        (
            vec!["--tokens", "1 2 3", "--perplexity", "--chunks", "0"],
            "--chunks",
        ),
    ] {
        let e = run(&q4, &args).fails();
        assert_eq!(e.trim().lines().count(), 1, "{args:?}: {e}");
        assert!(e.contains(needle), "{args:?}: {e}");
    }
}

/// `--kl-divergence` with the unquantized model as the reference (issue 15): a BF16
/// reference for Q4_0 and Q8_0 files, a mixed reference (BF16 with Q8_0 w2 and F16
/// w13), and a mixed model against the BF16 one, each against the definitions.
#[test]
fn kl_divergence_against_bf16_and_mixed_references() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = default_model(tmp.path(), "bf16", &["--wtype", "bf16"]);
    let q4 = default_model(tmp.path(), "q4", &["--wtype", "q4_0", "--q8", "none"]);
    let q8 = default_model(tmp.path(), "q8", &[]);
    let mixed = default_model(
        tmp.path(),
        "mixed",
        &["--wtype", "bf16", "--types", "w2=q8_0,w13=f16"],
    );
    kl_matches_the_definitions(&bf16, &q4);
    kl_matches_the_definitions(&bf16, &q8);
    kl_matches_the_definitions(&mixed, &q4);
    kl_matches_the_definitions(&bf16, &mixed);
}

/// `model --kl-divergence reference` (and `--perplexity`) against the definitions.
fn kl_matches_the_definitions(reference: &Path, model: &Path) {
    let (q8, q4) = (reference, model);
    let text = corpus();
    let common = [
        "--file",
        text.to_str().unwrap(),
        "--ctx",
        "48",
        "--chunks",
        "4",
    ];
    let mut a = common.to_vec();
    a.extend(["--perplexity", "--json"]);
    let ppl = json(&run(q4, &a).ok().stdout);
    let mut a = common.to_vec();
    a.extend(["--kl-divergence", q8.to_str().unwrap(), "--json"]);
    let kl = json(&run(q4, &a).ok().stdout);
    let mut a = common.to_vec();
    a.extend(["--kl-divergence", q8.to_str().unwrap()]);
    let self_kl = json(
        &run(q8, &{
            let mut b = a.clone();
            b.push("--json");
            b
        })
        .ok()
        .stdout,
    );
    let text_out = run(q4, &a).ok().stdout;
    assert!(text_out.contains("KL(ref ‖ model)") && text_out.contains("top-1"));
    assert!(text_out.contains("second half"), "{text_out}");

    // The definitions, from full logits.
    let tok = krafla::tokenizer::Tokenizer::from_path(&q8.with_extension("mlt")).unwrap();
    let ids = tok.encode(&std::fs::read_to_string(&text).unwrap());
    let bos = tok.bos().filter(|b| tok.encode("").first() == Some(b));
    let chunks = eval::chunks(&ids, 48, bos, Some(4)).unwrap();
    let (m8, m4) = (Mlb::open(q8).unwrap(), Mlb::open(q4).unwrap());
    let (r, m) = (Model::new(&m8).unwrap(), Model::new(&m4).unwrap());
    let v = m.cfg.vocab;
    let (mut nll, mut nll_ref, mut kls, mut agree) = (vec![], vec![], vec![], 0);
    for c in &chunks {
        let (lr, lm) = (chunk_logits(&r, c), chunk_logits(&m, c));
        for i in 24..47 {
            let (rr, rm) = (&lr[i * v..(i + 1) * v], &lm[i * v..(i + 1) * v]);
            let (mut pr, mut pm) = (vec![], vec![]);
            log_softmax(rr, &mut pr);
            log_softmax(rm, &mut pm);
            let t = c[i + 1] as usize;
            nll.push(-pm[t]);
            nll_ref.push(-pr[t]);
            kls.push(
                pr.iter()
                    .zip(&pm)
                    .map(|(a, b)| a.exp() * (a - b))
                    .sum::<f64>(),
            );
            agree += (sampler::argmax(rr) == sampler::argmax(rm)) as u64;
        }
    }
    let n = kls.len() as f64;
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let close = |a: f64, b: f64, what: &str| {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
            "{what}: {a} vs {b}"
        )
    };
    assert_eq!(ppl["positions"].as_u64().unwrap(), 4 * 23);
    close(ppl["ppl"].as_f64().unwrap(), mean(&nll).exp(), "ppl");
    close(kl["ppl"].as_f64().unwrap(), mean(&nll).exp(), "kl ppl");
    close(
        kl["ppl_ref"].as_f64().unwrap(),
        mean(&nll_ref).exp(),
        "ppl_ref",
    );
    let km = mean(&kls);
    close(kl["kl_mean"].as_f64().unwrap(), km, "kl_mean");
    let sd = (kls.iter().map(|k| (k - km).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    close(kl["kl_ci95"].as_f64().unwrap(), 1.96 * sd / n.sqrt(), "ci");
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    close(
        kl["kl_p99"].as_f64().unwrap(),
        sorted[(0.99 * n).ceil() as usize - 1],
        "p99",
    );
    close(kl["top1"].as_f64().unwrap(), agree as f64 / n, "top1");
    assert!(
        km > 0.0,
        "{} against {}: KL 0",
        model.display(),
        reference.display()
    );
    assert_eq!(self_kl["kl_mean"].as_f64().unwrap(), 0.0);
    assert_eq!(self_kl["top1"].as_f64().unwrap(), 1.0);
    assert_eq!(self_kl["ppl"], self_kl["ppl_ref"]);
}

/// Qwen3.5's linear-attention layers: lqkv/lz/lb/la share the Attn slot; lout's input
/// (V·dv = 64 channels here, q_dim = 128) has no slot of its width, so the Wo slot of
/// those layers stays zero and mlb-convert quantizes lout by the unweighted search.
#[test]
fn imatrix_linear_attention_slots() {
    let tmp = tempfile::tempdir().unwrap();
    let src = testdata().join("models/qwen3_5_text");
    let conv = |out: &Path, extra: &[&str]| {
        convert(&src, out, extra);
    };
    let q8 = tmp.path().join("q8.mlb");
    conv(&q8, &["--wtype", "q8_0"]);
    let reference: serde_json::Value =
        json(&std::fs::read_to_string(src.join("reference.json")).unwrap());
    let toks: Vec<String> = reference["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect();
    let mli_path = tmp.path().join("q.mli");
    run(
        &q8,
        &[
            "--tokens",
            &toks.join(" "),
            "--imatrix",
            mli_path.to_str().unwrap(),
            "--ctx",
            "32",
        ],
    )
    .ok();
    let m = mli::parse(&std::fs::read(&mli_path).unwrap()).unwrap();
    let model = Mlb::open(&q8).unwrap();
    for l in 0..m.n_layers {
        let linear = matches!(model.layout().layers[l].mixer, Mixer::Linear(_));
        assert!(
            m.slot(l, Slot::Attn).iter().any(|&s| s > 0.0),
            "layer {l} Attn slot empty"
        );
        let wo_sum: f64 = m.slot(l, Slot::Wo).iter().sum();
        assert_eq!(
            wo_sum == 0.0,
            linear,
            "layer {l}: Wo slot {wo_sum}, linear {linear}"
        );
    }
    let plain = tmp.path().join("plain.mlb");
    let weighted = tmp.path().join("weighted.mlb");
    let q4 = ["--wtype", "q4_0", "--q8", "none", "--q4-rule", "search"];
    conv(&plain, &q4);
    conv(
        &weighted,
        &[&q4[..], &["--imatrix", mli_path.to_str().unwrap()]].concat(),
    );
    let (p, w) = (Mlb::open(&plain).unwrap(), Mlb::open(&weighted).unwrap());
    let bytes = |m: &Mlb, name: &str| {
        let t = m.layout().find(name).unwrap();
        m.bytes()[t.offset as usize..t.end() as usize].to_vec()
    };
    assert_eq!(
        bytes(&p, "layers.0.lout"),
        bytes(&w, "layers.0.lout"),
        "lout falls back to the unweighted search"
    );
    assert_ne!(
        bytes(&p, "layers.0.lqkv"),
        bytes(&w, "layers.0.lqkv"),
        "lqkv is weighted by the Attn slot"
    );
    assert_ne!(
        bytes(&p, "layers.2.wo"),
        bytes(&w, "layers.2.wo"),
        "full-attention wo is weighted"
    );
}

/// Test model `name`'s folder and its BF16 conversion in `tmp` (the checkpoint's
/// values exactly: the fixtures are bf16).
fn exact_bf16(name: &str, tmp: &Path) -> (PathBuf, PathBuf) {
    let dir = testdata().join("models").join(name);
    let exact = tmp.join("bf16.mlb");
    convert(&dir, &exact, &["--wtype", "bf16"]);
    (dir, exact)
}

/// Per-expert importance (an MLI version-2 file) in `mlb-convert --imatrix`: each
/// expert's ew1/ew3 and ew2 rows are quantized with its own sums over the tokens routed
/// to it; an expert no token reached takes the layer's pooled FFN input (W13) for
/// ew1/ew3 and no weights for ew2, and a warning names its layer and number. Checked
/// against `quant::quantize` on the checkpoint's values (the BF16 conversion's, exact),
/// and against the pooled importance, which gives other bytes.
#[test]
fn imatrix_weighs_each_expert_by_its_own_inputs() {
    use krafla::format::mlb::Kind;
    use krafla::format::mli::{ExpertSlot, MoeSums};
    use krafla::quant::{dequant_mat_row, quantize, Q4Rule, QuantOptions};
    let tmp = tempfile::tempdir().unwrap();
    let (dir, exact) = exact_bf16("olmoe", tmp.path());
    let b = Mlb::open(&exact).unwrap();
    let (d, h) = (*b.dims(), *b.header());
    let (n_experts, eh) = (h.n_experts as usize, h.expert_hidden as usize);
    // Sums that differ by layer, slot, channel and expert; expert 1 of layer 0 unrouted.
    let mut mli = Mli::new(d.n_layers, d.dim, d.hidden_dim, d.q_dim);
    (mli.tokens, mli.cls_tokens) = (10, 10);
    for l in 0..d.n_layers {
        for (k, slot) in [Slot::Attn, Slot::Wo, Slot::W13, Slot::W2]
            .into_iter()
            .enumerate()
        {
            for (j, s) in mli.slot_mut(l, slot).iter_mut().enumerate() {
                *s = (1 + (j * 7 + l * 3 + k) % 11) as f64;
            }
        }
    }
    for (j, s) in mli.cls_mut().iter_mut().enumerate() {
        *s = (1 + j % 5) as f64;
    }
    let layers: Vec<usize> = (0..d.n_layers).collect();
    let mut x = MoeSums::new(layers, n_experts, d.dim, eh, 0);
    let unrouted = |l: usize, e: usize| (l, e) == (0, 1);
    for l in 0..d.n_layers {
        for e in 0..n_experts {
            let n = if unrouted(l, e) { 0 } else { 3 + e as u64 };
            *x.tokens_mut(l, e).unwrap() = n;
            for slot in [ExpertSlot::In, ExpertSlot::Hidden] {
                for (j, s) in x.expert_mut(l, e, slot).unwrap().iter_mut().enumerate() {
                    *s = n as f64 * (1 + (j * (e + 2) + l) % 13) as f64;
                }
            }
        }
    }
    let mli = mli.with_moe(x.clone());
    let path = tmp.path().join("moe.mli");
    std::fs::write(&path, mli.to_bytes()).unwrap();
    let q4 = tmp.path().join("q4.mlb");
    let p = path.to_str().unwrap();
    let log = convert(&dir, &q4, &["--wtype", "q4_0", "--imatrix", p]).stderr;
    let warnings: Vec<&str> = log.lines().filter(|l| l.starts_with("warning:")).collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains("layer 0 expert 1 was never routed"),
        "{log}"
    );

    let m = Mlb::open(&q4).unwrap();
    let mut pooled_differs = false;
    for (i, t) in m.layout().tensors.iter().enumerate() {
        let (Some(l), Kind::Mat { rows, cols, .. }) = (t.name.layer, t.kind) else {
            continue;
        };
        let l = l as usize;
        let slot = match t.name.name {
            "ew1" | "ew3" => ExpertSlot::In,
            "ew2" => ExpertSlot::Hidden,
            _ => continue,
        };
        let pooled = Mli::importance(mli.slot(l, Slot::W13), mli.tokens);
        let per = rows / n_experts;
        let (got, exact) = (m.mat(i), b.mat(i));
        for e in 0..n_experts {
            let imp = match (unrouted(l, e), slot) {
                (true, ExpertSlot::In) => Some(pooled.clone()),
                (true, ExpertSlot::Hidden) => None,
                (false, _) => Some(Mli::importance(
                    x.expert(l, e, slot).unwrap(),
                    x.tokens(l, e).unwrap(),
                )),
            };
            let mut w = vec![0f32; per * cols];
            for (r, row) in w.chunks_exact_mut(cols).enumerate() {
                dequant_mat_row(&exact, e * per + r, row);
            }
            let q = |imp: Option<&[f32]>| {
                let opts = QuantOptions {
                    q4_rule: Q4Rule::Search,
                    imatrix: imp,
                    ..QuantOptions::default()
                };
                quantize(got.wtype, per, cols, &w, &opts).unwrap()
            };
            let want = q(imp.as_deref());
            let (rb, nb) = (cols / 2, cols / 32);
            let what = format!("{} expert {e}", t.name);
            assert_eq!(
                &got.q[e * per * rb..(e + 1) * per * rb],
                &want.q[..],
                "{what}"
            );
            let ds = match &want.d {
                krafla::quant::Scales::F32(v) => v.clone(),
                s => panic!("{what}: {s:?}"),
            };
            assert_eq!(&got.d[e * per * nb..(e + 1) * per * nb], &ds[..], "{what}");
            if slot == ExpertSlot::In && !unrouted(l, e) {
                pooled_differs |= q(Some(&pooled)).q != want.q;
            }
        }
    }
    assert!(pooled_differs, "the experts' own sums changed no block");

    // Experts' sums of another model: one line naming the field.
    let other = Mli::new(d.n_layers, d.dim, d.hidden_dim, d.q_dim);
    let other = Mli {
        tokens: 10,
        ..other
    }
    .with_moe(MoeSums::new(
        (0..d.n_layers).collect(),
        n_experts + 1,
        d.dim,
        eh,
        0,
    ));
    std::fs::write(&path, other.to_bytes()).unwrap();
    let out = tmp.path().join("refused.mlb");
    let e = crate::util::tool::mlb_convert(&dir, &out)
        .args(["--wtype", "q4_0", "--imatrix", p])
        .fails();
    assert!(
        e.contains("n_experts") && e.contains(&format!("{}", n_experts + 1)),
        "{e}"
    );
    assert!(!out.exists());
}

/// Error feedback on mixture-of-experts layers, from `mlb-run --imatrix --covariance`
/// on the qwen3_5_moe_text fixture (routed experts and a shared expert): each routed
/// expert's ew2 rows take its own input's covariance (none if no token reached it), its
/// ew1/ew3 rows the layer's FFN input at its own channel scales, sw1/sw3 the FFN input
/// and sw2 the shared expert's input. Checked against `feedback::quantize` on the
/// checkpoint's values (the BF16 conversion's, exact) with factors built here (the
/// scales written out, the plain product); the bytes do not depend on the thread count.
#[test]
fn error_feedback_per_expert() {
    use krafla::format::mlb::Kind;
    use krafla::format::mli::cov::{self as mli_cov, CovSlot};
    use krafla::format::mli::ExpertSlot;
    use krafla::quant::feedback::{self, Feedback, Prior, PLAIN};
    use krafla::quant::{dequant_mat_row, Q4Rule, QuantOptions, Scales};
    let tmp = tempfile::tempdir().unwrap();
    let (dir, exact) = exact_bf16("qwen3_5_moe_text", tmp.path());
    let cov_path = tmp.path().join("cov.mli");
    let toks: Vec<String> = (0..60).map(|i| ((i * 37 + 5) % 256).to_string()).collect();
    let p = cov_path.to_str().unwrap();
    run(
        &exact,
        &["--tokens", &toks.join(" "), "--imatrix", p, "--covariance"],
    )
    .ok();
    let bytes = std::fs::read(&cov_path).unwrap();
    let m = mli::parse(&bytes).unwrap();
    let (x, cov) = (m.moe.as_ref().unwrap(), m.covariance.as_ref().unwrap());
    let fb_of = |e: &mli_cov::CovEntry| {
        let v = mli_cov::values(&bytes, e);
        Feedback::from_packed(e.n, &v, Prior::default(), PLAIN).unwrap()
    };
    let q4 = [
        "--wtype",
        "q4_0",
        "--q4-rule",
        "search",
        "--q8",
        "none",
        "--imatrix",
        p,
    ];
    let fed = tmp.path().join("fed.mlb");
    let log = convert(&dir, &fed, &q4).stderr;
    assert!(log.contains("quantizing with error feedback"), "{log}");
    let one = tmp.path().join("fed1.mlb");
    convert(&dir, &one, &[&q4[..], &["--threads", "1"]].concat());
    assert_eq!(std::fs::read(&fed).unwrap(), std::fs::read(&one).unwrap());

    let (b, got) = (Mlb::open(&exact).unwrap(), Mlb::open(&fed).unwrap());
    let (mut checked, mut own, mut rescaled) = (0, 0, 0);
    for (i, t) in got.layout().tensors.iter().enumerate() {
        let (Some(l), Kind::Mat { rows, cols, .. }) = (t.name.layer, t.kind) else {
            continue;
        };
        let l = l as usize;
        let name = t.name.name;
        let w13 = cov.find(Some(l), CovSlot::Layer(Slot::W13));
        let pooled_imp = Mli::importance(m.slot(l, Slot::W13), m.tokens);
        // Per stack part (an expert, or the whole shared matrix): rows, importance, feedback.
        let parts: Vec<(usize, Option<Vec<f32>>, Option<Feedback>)> = match name {
            "ew2" => (0..x.n_experts)
                .map(|e| {
                    let n = x.tokens(l, e).unwrap();
                    let imp = (n > 0)
                        .then(|| Mli::importance(x.expert(l, e, ExpertSlot::Hidden).unwrap(), n));
                    let entry = cov.find_expert(Some(l), CovSlot::Layer(Slot::W2), Some(e as u32));
                    assert_eq!(entry.is_some(), n > 0, "layer {l} expert {e}");
                    own += entry.is_some() as usize;
                    (rows / x.n_experts, imp, entry.map(fb_of))
                })
                .collect(),
            "ew1" | "ew3" => (0..x.n_experts)
                .map(|e| {
                    let n = x.tokens(l, e).unwrap();
                    let pooled = fb_of(w13.unwrap());
                    if n == 0 {
                        return (rows / x.n_experts, Some(pooled_imp.clone()), Some(pooled));
                    }
                    let s = x.expert(l, e, ExpertSlot::In).unwrap();
                    let all = m.slot(l, Slot::W13);
                    let r: Vec<f64> = (0..cols)
                        .map(|c| match all[c] > 0.0 {
                            true => ((s[c] / n as f64) / (all[c] / m.tokens as f64))
                                .sqrt()
                                .max(1e-3),
                            false => 1.0,
                        })
                        .collect();
                    rescaled += 1;
                    (
                        rows / x.n_experts,
                        Some(Mli::importance(s, n)),
                        Some(pooled.rescaled(&r)),
                    )
                })
                .collect(),
            "sw1" | "sw3" => vec![(rows, Some(pooled_imp), w13.map(fb_of))],
            "sw2" => vec![(
                rows,
                Some(Mli::importance(x.shared(l).unwrap(), m.tokens)),
                cov.find(Some(l), CovSlot::Layer(Slot::W2)).map(fb_of),
            )],
            _ => continue,
        };
        assert!(
            parts.iter().all(|p| p.2.is_some()) || name == "ew2",
            "{name}"
        );
        let (q, exact) = (got.mat(i), b.mat(i));
        let (rb, nb) = (cols / 2, cols / 32);
        let mut r0 = 0;
        for (k, (per, imp, fb)) in parts.iter().enumerate() {
            let mut w = vec![0f32; per * cols];
            for (r, row) in w.chunks_exact_mut(cols).enumerate() {
                dequant_mat_row(&exact, r0 + r, row);
            }
            let opts = QuantOptions {
                q4_rule: Q4Rule::Search,
                imatrix: imp.as_deref(),
                ..QuantOptions::default()
            };
            let want = feedback::quantize(q.wtype, *per, cols, &w, &opts, fb.as_ref()).unwrap();
            let what = format!("layer {l} {name} part {k}");
            assert_eq!(&q.q[r0 * rb..(r0 + per) * rb], &want.q[..], "{what}");
            let Scales::F32(ds) = &want.d else {
                panic!("{what}: {:?}", want.d)
            };
            assert_eq!(&q.d[r0 * nb..(r0 + per) * nb], &ds[..], "{what}");
            r0 += per;
            checked += 1;
        }
    }
    assert!(
        checked > 0 && own > 0 && rescaled > 0,
        "{checked} {own} {rescaled}"
    );

    // Without error feedback the experts' rows come out otherwise.
    let off = tmp.path().join("off.mlb");
    convert(&dir, &off, &[&q4[..], &["--no-error-feedback"]].concat());
    let o = Mlb::open(&off).unwrap();
    let differs = |name: &str| {
        let i = o
            .layout()
            .tensors
            .iter()
            .position(|t| t.name.name == name)
            .unwrap();
        o.mat(i).q != got.mat(i).q
    };
    assert!(differs("ew1") && differs("ew2"));
}

/// An imatrix weights a GGUF's requantized matrices as it weights a checkpoint's: the
/// default model exported from BF16 to GGUF and requantized (`--requantize`, `--types`)
/// with an imatrix that has covariances gives the checkpoint's conversion with it, bit
/// for bit, with and without error feedback; the imatrix changes the bytes; and a
/// GGUF whose blocks are all copied refuses it.
#[test]
fn gguf_requantized_with_imatrix_equals_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let q8 = default_model(tmp.path(), "q8", &[]);
    let cov_path = tmp.path().join("cov.mli");
    imatrix(&q8, &cov_path, &["--ctx", "64", "--covariance"]);
    let im = cov_path.to_str().unwrap();
    let bf16 = default_model(tmp.path(), "bf16", &["--wtype", "bf16"]);
    let gguf = tmp.path().join("bf16.gguf");
    crate::util::tool::mlb_export(&bf16, &gguf).ok();
    let ck = testdata().join("default");
    let bytes = |src: &Path, name: &str, args: &[&str]| {
        let out = tmp.path().join(format!("{name}.mlb"));
        convert(src, &out, args);
        std::fs::read(&out).unwrap()
    };
    let q4 = ["--q4-rule", "search", "--q8", "none"];
    let cases = [
        ("q4_k", requantize_args("q4_k", &[])),
        (
            "q4_k-off",
            requantize_args("q4_k", &["--no-error-feedback"]),
        ),
        ("q4_0", requantize_args("q4_0", &q4)),
        (
            "types",
            (
                vec!["--types", "w2=q5_k,wqk=q4_k"],
                vec!["--wtype", "bf16", "--types", "w2=q5_k,wqk=q4_k"],
            ),
        ),
    ];
    let mut seen = Vec::new();
    for (name, (g, h)) in cases {
        let (gi, hi) = (
            [&g[..], &["--imatrix", im]].concat(),
            [&h[..], &["--imatrix", im]].concat(),
        );
        let got = bytes(&gguf, &format!("{name}.gguf"), &gi);
        let want = bytes(&ck, &format!("{name}.hf"), &hi);
        assert!(got == want, "{name}: GGUF and checkpoint differ");
        let g: Vec<&str> = g
            .into_iter()
            .filter(|a| *a != "--no-error-feedback")
            .collect();
        let plain = bytes(&gguf, &format!("{name}.plain"), &g);
        assert!(got != plain, "{name}: the imatrix changed nothing");
        seen.push(got);
    }
    assert!(seen[0] != seen[1], "error feedback changed nothing");
    let e = crate::util::tool::mlb_convert(&gguf, &tmp.path().join("x.mlb"))
        .args(["--imatrix", im])
        .fails();
    assert!(e.contains("--imatrix") && e.contains("requantized"), "{e}");
}
