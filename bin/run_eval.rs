//! mlb-run's measurement modes: `--imatrix FILE.mli`, `--perplexity` and
//! `--kl-divergence REF.mlb` over the text cut into chunks of `--ctx` tokens (the
//! library's `model::eval` and `model::imatrix` do the work; this prints).

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use krafla::format::mlb::Mlb;
use krafla::model::eval::{self, KlReport, PplReport};
use krafla::model::imatrix;
use krafla::model::{Model, Options};
use serde_json::json;

use super::Args;

/// Chunk length when `--ctx` is not given (llama.cpp's perplexity default).
pub const DEFAULT_EVAL_CTX: usize = 512;

/// Whether `a` asks for a measurement mode.
pub fn wanted(a: &Args) -> bool {
    a.imatrix.is_some() || a.perplexity || a.kl_divergence.is_some()
}

fn bar(n: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} chunks  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

fn num(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// Runs the measurement `a` asks for on `tokens`; `bos` is prepended to every chunk
/// when the tokenizer adds one.
pub fn run(a: &Args, model: &Model, bos: Option<u32>, tokens: &[u32]) -> Result<(), String> {
    let ctx = a.ctx.unwrap_or(DEFAULT_EVAL_CTX.min(model.cfg.max_seq));
    let opts = Options {
        ctx: Some(ctx),
        batch: a.batch.max(1),
        ..Options::default()
    };
    model.context(&opts).map_err(|e| e.to_string())?;
    if a.save_every == Some(0) {
        return Err("--save-every = 0: give a number of chunks of at least 1".into());
    }
    if a.chunks == Some(0) {
        return Err("--chunks = 0: give a number of chunks of at least 1".into());
    }
    // The reference first: a missing file is reported before the text.
    let ref_mlb = match &a.kl_divergence {
        Some(p) => Some(Mlb::open(p).map_err(|e| e.to_string())?),
        None => None,
    };
    let chunks = match eval::chunks(tokens, ctx, bos, a.chunks) {
        // A calibration text shorter than one chunk still gives an imatrix.
        Err(eval::EvalError::TooFewTokens { .. }) if a.imatrix.is_some() && !tokens.is_empty() => {
            vec![tokens.to_vec()]
        }
        r => r.map_err(|e| e.to_string())?,
    };
    let n = chunks.len();
    let ctx = chunks[0].len();
    let model_name = a.model.display().to_string();
    let scope = format!(
        "{n} chunks × {ctx} tokens{}; scored: the second half of each chunk (positions {}..{} predict the next token)",
        if bos.is_some() { " (each starts with BOS)" } else { "" },
        eval::first_scored(ctx),
        ctx.saturating_sub(1)
    );

    if let Some(path) = &a.imatrix {
        return imatrix_mode(a, model, &opts, &chunks, path, &scope);
    }
    if let (Some(rp), Some(rm)) = (&a.kl_divergence, &ref_mlb) {
        let packs = super::load_packs(a, rm).map_err(|e| format!("{}: {e}", rp.display()))?;
        let reference =
            Model::with_packs(rm, &packs).map_err(|e| format!("{}: {e}", rp.display()))?;
        let pb = bar(n);
        let rep = eval::kl_divergence(&reference, model, &opts, &chunks, |done, m| {
            pb.set_position(done as u64);
            pb.set_message(format!("mean KL {:.5}", m.mean()));
        })
        .map_err(|e| e.to_string())?;
        pb.finish_and_clear();
        print_kl(a, &model_name, &rp.display().to_string(), &scope, &rep);
        return Ok(());
    }
    let pb = bar(n);
    let rep = eval::perplexity(model, &opts, &chunks, |done, s| {
        pb.set_position(done as u64);
        pb.set_message(format!("PPL {:.4}", s.ppl()));
    })
    .map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    print_ppl(a, &model_name, &scope, &rep);
    Ok(())
}

fn imatrix_mode(
    a: &Args,
    model: &Model,
    opts: &Options,
    chunks: &[Vec<u32>],
    path: &Path,
    scope: &str,
) -> Result<(), String> {
    let pb = bar(chunks.len());
    let every = a.save_every;
    let (m, stats) = imatrix::collect(model, opts, chunks, |p, m| {
        pb.set_position(p.done as u64);
        if p.ppl.is_finite() {
            pb.set_message(format!("PPL {:.4}", p.ppl));
        }
        match every {
            Some(k) if p.done % k == 0 && p.done < p.total => {
                imatrix::write_atomic(path, &m.to_bytes())
            }
            _ => Ok(()),
        }
    })
    .map_err(|e| e.to_string())?;
    imatrix::write_atomic(path, &m.to_bytes()).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    let lout = model.cfg.layers.contains(&krafla::model::LayerKind::Linear)
        && model.cfg.lin_v_total != model.cfg.q_dim;
    if a.json {
        let v = json!({
            "mode": "imatrix",
            "model": a.model.display().to_string(),
            "output": path.display().to_string(),
            "chunks": chunks.len(),
            "ctx": chunks[0].len(),
            "tokens": m.tokens,
            "cls_tokens": m.cls_tokens,
            "ppl": num(stats.ppl()),
            "lout_unweighted": lout,
        });
        krafla::outln!("{v}");
        return Ok(());
    }
    krafla::outln!("model:      {}", a.model.display());
    krafla::outln!("text:       {scope}");
    krafla::outln!(
        "imatrix:    {} (MLI1): {} layer tokens, {} classifier tokens; {} layers, dim {}, q_dim {}, hidden_dim {}",
        path.display(),
        m.tokens,
        m.cls_tokens,
        m.n_layers,
        m.dim,
        m.q_dim,
        m.hidden_dim
    );
    if lout {
        krafla::outln!(
            "note:       lout's input (V·dv = {}) differs from q_dim: the Wo slot of the linear-attention layers stays zero and mlb-convert quantizes their lout unweighted",
            model.cfg.lin_v_total
        );
    }
    if stats.nll.n > 0 {
        krafla::outln!(
            "perplexity: {:.4} (mean NLL {:.5} ± {:.5}, 95% CI over {} positions)",
            stats.ppl(),
            stats.nll.mean(),
            stats.nll.ci95(),
            stats.nll.n
        );
    }
    Ok(())
}

fn print_ppl(a: &Args, model: &str, scope: &str, r: &PplReport) {
    let s = &r.stats;
    if a.json {
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
        krafla::outln!("{v}");
        return;
    }
    krafla::outln!("model:      {model}");
    krafla::outln!("text:       {scope}");
    krafla::outln!(
        "perplexity: {:.4} (mean NLL {:.5} ± {:.5}, 95% CI over {} positions)",
        s.ppl(),
        s.nll.mean(),
        s.nll.ci95(),
        s.nll.n
    );
}

fn print_kl(a: &Args, model: &str, reference: &str, scope: &str, r: &KlReport) {
    if a.json {
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
        krafla::outln!("{v}");
        return;
    }
    krafla::outln!("model:      {model}");
    krafla::outln!("reference:  {reference}");
    krafla::outln!("text:       {scope}");
    krafla::outln!(
        "KL(ref ‖ model): mean {:.6} ± {:.6} nats (95% CI: 1.96·sd/√n over {} positions); p99 {:.6}; max {:.6}",
        r.kl.mean(),
        r.kl.ci95(),
        r.kl.n,
        r.kl_p99,
        r.kl_max
    );
    krafla::outln!(
        "top-1 agreement: {:.2}% ({} of {})",
        100.0 * r.top1_rate(),
        r.top1,
        r.kl.n
    );
    krafla::outln!(
        "perplexity: model {:.4}, reference {:.4} (ratio {:.4})",
        r.model.ppl(),
        r.reference.ppl(),
        r.model.ppl() / r.reference.ppl()
    );
}
