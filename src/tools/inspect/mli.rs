//! The `.mli` report: header, token counts and a per-layer summary of the sums.

use std::fmt::Write;

use serde_json::{json, Value};

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
    let _ = writeln!(s, "\nverdict: valid");
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
            "magic": "MLI1", "version": 1, "n_layers": m.n_layers, "dim": m.dim,
            "hidden_dim": m.hidden_dim, "q_dim": if m.q_dim == m.dim { 0 } else { m.q_dim },
            "tokens": m.tokens, "cls_tokens": m.cls_tokens,
        },
        "layers": layers,
        "classifier": {"mean": mean, "max": max},
    })
}
