//! The `.mli` report: header, token counts and a per-layer summary of the sums; with a
//! covariance section, its size and a summary of every input's covariance.

use std::fmt::Write;

use serde_json::{json, Value};

use crate::format::mli::cov::{self as mli_cov, CovEntry};
use crate::format::mli::{Mli, Slot};

const SLOTS: [(Slot, &str); 4] = [
    (Slot::Attn, "attn_in"),
    (Slot::Wo, "wo_in"),
    (Slot::W13, "ffn_in"),
    (Slot::W2, "w2_in"),
];

/// Mean of the per-channel mean squares (sums over tokens), and its maximum.
fn summary(sums: &[f64], tokens: u64) -> (f64, f64) {
    let n = tokens.max(1) as f64;
    let mean = sums.iter().sum::<f64>() / sums.len().max(1) as f64 / n;
    let max = sums.iter().cloned().fold(0.0, f64::max) / n;
    (mean, max)
}

/// The report up to the verdict (the caller adds the covariance lines and the verdict).
pub fn report_text(m: &Mli, file_name: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{file_name}: MLI1 importance matrix");
    let _ = writeln!(s, "  n_layers    {}", m.n_layers);
    let _ = writeln!(s, "  dim         {}", m.dim);
    let _ = writeln!(s, "  hidden_dim  {}", m.hidden_dim);
    let _ = writeln!(s, "  q_dim       {}", m.q_dim);
    let _ = writeln!(
        s,
        "  tokens      {} (layers), {} (classifier)",
        m.tokens, m.cls_tokens
    );
    let _ = writeln!(
        s,
        "\nmean square of each matrix input (mean / max over channels)"
    );
    for l in 0..m.n_layers {
        let mut line = format!("  {l:>3}");
        for (slot, name) in SLOTS {
            let (mean, max) = summary(m.slot(l, slot), m.tokens);
            let _ = write!(line, "  {name} {mean:.4e} / {max:.4e}");
        }
        let _ = writeln!(s, "{line}");
    }
    let (mean, max) = summary(m.cls(), m.cls_tokens);
    let _ = writeln!(s, "  cls  cls_in {mean:.4e} / {max:.4e}");
    s
}

pub fn report_json(m: &Mli, file_name: &str) -> Value {
    let layers: Vec<Value> = (0..m.n_layers)
        .map(|l| {
            let mut o = json!({"index": l});
            for (slot, name) in SLOTS {
                let (mean, max) = summary(m.slot(l, slot), m.tokens);
                o[name] = json!({"mean": mean, "max": max});
            }
            o
        })
        .collect();
    let (mean, max) = summary(m.cls(), m.cls_tokens);
    json!({
        "file": file_name,
        "format": "MLI1",
        "valid": true,
        "header": {
            "magic": "MLI1",
            "version": version(m),
            "n_layers": m.n_layers, "dim": m.dim,
            "hidden_dim": m.hidden_dim, "q_dim": if m.q_dim == m.dim { 0 } else { m.q_dim },
            "tokens": m.tokens, "cls_tokens": m.cls_tokens,
        },
        "layers": layers,
        "classifier": {"mean": mean, "max": max},
    })
}

/// One covariance entry's summary: the mean square per channel (trace / n / rows) and
/// the mean |correlation| between distinct channels (`H_ij / sqrt(H_ii H_jj)`, over the
/// pairs whose channels both saw input).
fn cov_summary(bytes: &[u8], e: &CovEntry) -> (f64, f64) {
    let tri = mli_cov::values(bytes, e);
    let n = e.n;
    let mut diag = Vec::with_capacity(n);
    let mut at = 0;
    for i in 0..n {
        diag.push(tri[at]);
        at += n - i;
    }
    let ms = diag.iter().sum::<f64>() / n as f64 / e.tokens.max(1) as f64;
    let (mut sum, mut pairs) = (0f64, 0u64);
    let mut at = 0;
    for i in 0..n {
        for j in i..n {
            if j > i && diag[i] > 0.0 && diag[j] > 0.0 {
                sum += (tri[at] / (diag[i] * diag[j]).sqrt()).abs();
                pairs += 1;
            }
            at += 1;
        }
    }
    (ms, if pairs > 0 { sum / pairs as f64 } else { 0.0 })
}

/// The covariance section's lines (empty without one).
pub fn cov_text(m: &Mli, bytes: &[u8]) -> String {
    let Some(c) = &m.covariance else {
        return String::new();
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\ncovariance section (version bit 16): {} inputs, {} bytes of values (f32, upper triangles)",
        c.entries.len(),
        c.value_bytes()
    );
    let _ = writeln!(
        s,
        "per input: channels × channels, rows summed, mean square, mean |correlation| off the diagonal"
    );
    // A MoE layer's experts' entries (one per routed expert) make one line: their
    // count, the least and most rows, and the means of their figures.
    let mut i = 0;
    while i < c.entries.len() {
        let e = &c.entries[i];
        let group = c.entries[i..]
            .iter()
            .take_while(|x| x.expert.is_some() && (x.layer, x.slot) == (e.layer, e.slot))
            .count()
            .max(1);
        let g = &c.entries[i..i + group];
        let figures: Vec<(f64, f64)> = g.iter().map(|x| cov_summary(bytes, x)).collect();
        let mean = |f: fn(&(f64, f64)) -> f64| figures.iter().map(f).sum::<f64>() / group as f64;
        let (ms, corr) = (mean(|x| x.0), mean(|x| x.1));
        let layer = e.layer.map_or("cls".to_string(), |l| format!("{l:>3}"));
        let (name, rows) = match e.expert {
            None => (e.slot.name().to_string(), format!("{} rows", e.tokens)),
            Some(_) => {
                let t = g.iter().map(|x| x.tokens);
                let (lo, hi) = (t.clone().min().unwrap_or(0), t.max().unwrap_or(0));
                let name = format!("{} ×{group} experts", e.slot.name());
                (name, format!("{lo}-{hi} rows"))
            }
        };
        let _ = writeln!(
            s,
            "  {layer}  {name:<15} {:>5} × {:<5} {rows:>15}  {ms:.4e}  {corr:.4}",
            e.n, e.n,
        );
        i += group;
    }
    s
}

/// The header's version: 1, or 2 with the experts' sums, plus the covariance bit.
fn version(m: &Mli) -> u32 {
    let base = if m.moe.is_some() { 2 } else { 1 };
    base | if m.covariance.is_some() {
        mli_cov::FLAG
    } else {
        0
    }
}

/// The covariance section as JSON (`null` without one).
pub fn cov_json(m: &Mli, bytes: &[u8]) -> Value {
    let Some(c) = &m.covariance else {
        return Value::Null;
    };
    let entries: Vec<Value> = c
        .entries
        .iter()
        .map(|e| {
            let (ms, corr) = cov_summary(bytes, e);
            json!({
                "layer": e.layer, "slot": e.slot.name(), "expert": e.expert, "n": e.n,
                "tokens": e.tokens,
                "mean_square": ms, "mean_abs_correlation": corr,
            })
        })
        .collect();
    json!({"value_bytes": c.value_bytes(), "entries": entries})
}
