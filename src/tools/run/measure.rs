//! mlb-run's measurements: `--imatrix FILE.mli`, `--perplexity` and `--kl-divergence
//! REF.mlb` over the text cut into chunks of `--ctx` tokens ([`crate::model::eval`] and
//! [`crate::model::imatrix`] do the arithmetic; this drives them and writes the
//! report, as text or JSON).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use super::error::RunError;
use super::frontend::RunFrontend;
use super::options::{MeasureMode, MeasureOptions, RunOptions};
use crate::format::mlb::Mlb;
use crate::kernels;
use crate::model::covariance::CovCollector;
use crate::model::eval::{self, KlReport, PplReport};
use crate::model::{imatrix, LayerKind, Model, Packs, StateOptions};
use crate::session::{Engine, SessionError};

/// Chunk length when `--ctx` is not given (llama.cpp's perplexity default).
pub const DEFAULT_EVAL_CTX: usize = 512;

fn num(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// The reference model of `--kl-divergence`, its errors prefixed with its path.
fn reference_engine(o: &RunOptions, path: &Path, mlb: Mlb) -> Result<Engine, RunError> {
    let wrap = |err: SessionError| RunError::Reference {
        path: path.to_path_buf(),
        err: Box::new(err),
    };
    let packs = if o.model.pack {
        Packs::new(&mlb, &kernels::kernels()).map_err(|e| wrap(SessionError::Format(e)))?
    } else {
        Packs::none()
    };
    Engine::new(mlb, packs, None).map_err(wrap)
}

/// Runs the measurement `m` on `tokens` (each chunk starts with `bos` when given) and
/// returns its report.
pub(super) fn run(
    o: &RunOptions,
    m: &MeasureOptions,
    engine: &Engine,
    bos: Option<u32>,
    tokens: &[u32],
    fe: &mut dyn RunFrontend,
) -> Result<String, RunError> {
    let model = engine.model();
    let ctx = o
        .model
        .ctx
        .unwrap_or(DEFAULT_EVAL_CTX.min(model.cfg.max_seq));
    let opts = StateOptions {
        ctx: Some(ctx),
        ..o.model.session_options(o.batch.max(1))
    };
    model.context(&opts).map_err(SessionError::Model)?;
    // The reference first: a missing file is reported before the text.
    let ref_mlb = match &m.mode {
        MeasureMode::KlDivergence { reference } => {
            Some(Mlb::open(reference).map_err(SessionError::Format)?)
        }
        _ => None,
    };
    let imatrix_mode = matches!(m.mode, MeasureMode::Imatrix { .. });
    let chunks = match eval::chunks(tokens, ctx, bos, m.chunks) {
        // A calibration text shorter than one chunk still gives an imatrix.
        Err(eval::EvalError::TooFewTokens { .. }) if imatrix_mode && !tokens.is_empty() => {
            vec![tokens.to_vec()]
        }
        r => r?,
    };
    let n = chunks.len();
    let ctx = chunks[0].len();
    let model_name = o.model.path.display().to_string();
    let scope = format!(
        "{n} chunks × {ctx} tokens{}; scored: the second half of each chunk (positions {}..{} predict the next token)",
        if bos.is_some() { " (each starts with BOS)" } else { "" },
        eval::first_scored(ctx),
        ctx.saturating_sub(1)
    );
    match (&m.mode, ref_mlb) {
        (
            MeasureMode::Imatrix {
                output,
                save_every,
                covariance,
            },
            _,
        ) => {
            let save = Save {
                path: output,
                every: *save_every,
                covariance: *covariance,
            };
            imatrix_report(o, m, model, &opts, &chunks, &save, &scope, fe)
        }
        (MeasureMode::KlDivergence { reference }, Some(rm)) => {
            let reference_engine = reference_engine(o, reference, rm)?;
            fe.chunks_start(n);
            let rep = eval::kl_divergence(
                reference_engine.model(),
                model,
                &opts,
                &chunks,
                |done, k| fe.chunks_done(done, Some(&format!("mean KL {:.5}", k.mean()))),
            )?;
            fe.chunks_end();
            Ok(kl_report(
                m,
                &model_name,
                &reference.display().to_string(),
                &scope,
                &rep,
            ))
        }
        _ => {
            fe.chunks_start(n);
            let rep = eval::perplexity(model, &opts, &chunks, |done, s| {
                fe.chunks_done(done, Some(&format!("PPL {:.4}", s.ppl())))
            })?;
            fe.chunks_end();
            Ok(ppl_report(m, &model_name, &scope, &rep))
        }
    }
}

/// Where `--imatrix` writes and what.
struct Save<'a> {
    path: &'a Path,
    every: Option<usize>,
    covariance: bool,
}

#[allow(clippy::too_many_arguments)]
fn imatrix_report(
    o: &RunOptions,
    m: &MeasureOptions,
    model: &Model,
    opts: &StateOptions,
    chunks: &[Vec<u32>],
    save: &Save,
    scope: &str,
    fe: &mut dyn RunFrontend,
) -> Result<String, RunError> {
    let (path, every) = (save.path, save.every);
    fe.chunks_start(chunks.len());
    let mut progress = |p: &imatrix::ChunkProgress, bytes: &dyn Fn() -> Vec<u8>| {
        let figure = format!("PPL {:.4}", p.ppl);
        fe.chunks_done(p.done, p.ppl.is_finite().then_some(&figure[..]));
        match every {
            Some(k) if p.done.is_multiple_of(k) && p.done < p.total => {
                imatrix::write_atomic(path, &bytes())
            }
            _ => Ok(()),
        }
    };
    let (mli, stats, cov_bytes) = if save.covariance {
        let c = CovCollector::new(&model.cfg);
        let (c, stats) =
            imatrix::collect_with(model, opts, chunks, c, |p, c| progress(p, &|| c.to_bytes()))?;
        let bytes = c.to_bytes();
        imatrix::write_atomic(path, &bytes)?;
        (c.mli().clone(), stats, Some(bytes.len()))
    } else {
        let (mli, stats) = imatrix::collect(model, opts, chunks, |p, mli| {
            progress(p, &|| mli.to_bytes())
        })?;
        imatrix::write_atomic(path, &mli.to_bytes())?;
        (mli, stats, None)
    };
    fe.chunks_end();
    let cfg = &model.cfg;
    let lout = cfg.layers.contains(&LayerKind::Linear) && cfg.lin_v_total != cfg.q_dim;
    if m.json {
        let v = json!({
            "mode": "imatrix",
            "model": o.model.path.display().to_string(),
            "output": path.display().to_string(),
            "chunks": chunks.len(),
            "ctx": chunks[0].len(),
            "tokens": mli.tokens,
            "cls_tokens": mli.cls_tokens,
            "ppl": num(stats.ppl()),
            "lout_unweighted": lout,
            "covariance_bytes": cov_bytes,
        });
        return Ok(format!("{v}\n"));
    }
    let mut s = String::new();
    let _ = writeln!(s, "model:      {}", o.model.path.display());
    let _ = writeln!(s, "text:       {scope}");
    let _ = writeln!(
        s,
        "imatrix:    {} (MLI1): {} layer tokens, {} classifier tokens; {} layers, dim {}, q_dim {}, hidden_dim {}",
        path.display(),
        mli.tokens,
        mli.cls_tokens,
        mli.n_layers,
        mli.dim,
        mli.q_dim,
        mli.hidden_dim
    );
    if let Some(b) = cov_bytes {
        let _ = writeln!(
            s,
            "covariance: every matrix input's n × n covariance (MLI covariance section): {:.1} MiB of the file, {:.1} MiB of memory while collecting",
            b as f64 / (1u64 << 20) as f64,
            CovCollector::memory(cfg) as f64 / (1u64 << 20) as f64
        );
    }
    if lout {
        let _ = writeln!(
            s,
            "note:       lout's input (V·dv = {}) differs from q_dim: the Wo slot of the linear-attention layers stays zero and mlb-convert quantizes their lout unweighted",
            cfg.lin_v_total
        );
    }
    if stats.nll.n > 0 {
        let _ = writeln!(
            s,
            "perplexity: {:.4} (mean NLL {:.5} ± {:.5}, 95% CI over {} positions)",
            stats.ppl(),
            stats.nll.mean(),
            stats.nll.ci95(),
            stats.nll.n
        );
    }
    Ok(s)
}

fn ppl_report(m: &MeasureOptions, model: &str, scope: &str, r: &PplReport) -> String {
    let s = &r.stats;
    if m.json {
        let v = json!({
            "mode": "perplexity",
            "model": model,
            "chunks": r.chunks,
            "ctx": r.ctx,
            "positions": s.nll.n,
            "ppl": num(s.ppl()),
            "nll_mean": num(s.nll.mean()),
            "nll_ci95": num(s.nll.ci95()),
        });
        return format!("{v}\n");
    }
    format!(
        "model:      {model}\ntext:       {scope}\nperplexity: {:.4} (mean NLL {:.5} ± {:.5}, 95% CI over {} positions)\n",
        s.ppl(),
        s.nll.mean(),
        s.nll.ci95(),
        s.nll.n
    )
}

fn kl_report(
    m: &MeasureOptions,
    model: &str,
    reference: &str,
    scope: &str,
    r: &KlReport,
) -> String {
    if m.json {
        let v = json!({
            "mode": "kl-divergence",
            "model": model,
            "reference": reference,
            "chunks": r.chunks,
            "ctx": r.ctx,
            "positions": r.kl.n,
            "kl_mean": num(r.kl.mean()),
            "kl_ci95": num(r.kl.ci95()),
            "kl_p99": num(r.kl_p99),
            "kl_max": num(r.kl_max),
            "top1": num(r.top1_rate()),
            "ppl": num(r.model.ppl()),
            "ppl_ref": num(r.reference.ppl()),
        });
        return format!("{v}\n");
    }
    let mut s = String::new();
    let _ = writeln!(s, "model:      {model}");
    let _ = writeln!(s, "reference:  {reference}");
    let _ = writeln!(s, "text:       {scope}");
    let _ = writeln!(
        s,
        "KL(ref ‖ model): mean {:.6} ± {:.6} nats (95% CI: 1.96·sd/√n over {} positions); p99 {:.6}; max {:.6}",
        r.kl.mean(),
        r.kl.ci95(),
        r.kl.n,
        r.kl_p99,
        r.kl_max
    );
    let _ = writeln!(
        s,
        "top-1 agreement: {:.2}% ({} of {})",
        100.0 * r.top1_rate(),
        r.top1,
        r.kl.n
    );
    let _ = writeln!(
        s,
        "perplexity: model {:.4}, reference {:.4} (ratio {:.4})",
        r.model.ppl(),
        r.reference.ppl(),
        r.model.ppl() / r.reference.ppl()
    );
    s
}
