//! The `.mlb` report: every header field under its spec name with its meaning, the
//! derived dimensions, the per-layer flags, the tensor table, totals and the verdict.

use std::fmt::Write;

use serde_json::{json, Map, Value};

use crate::format::mlb::header::{
    act, layer_flag, q8_class, rope_type, wtype, FieldValue, FIELDS, FIELDS_END,
};
use crate::format::mlb::{Kind, Mlb, Tensor, HEADER_SIZE};
use crate::format::WType;

/// An f32 as a JSON number with its shortest decimal form (1e-5, not 9.99e-6).
pub fn json_f32(v: f32) -> serde_json::Value {
    let s = format!("{v}");
    match s.parse::<f64>().ok().and_then(serde_json::Number::from_f64) {
        Some(n) => serde_json::Value::Number(n),
        None => serde_json::Value::String(s),
    }
}

/// Bytes as `12.3 MiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The decoded meaning of a field's value, where it has one (e.g. `llama3`).
fn meaning(name: &str, v: FieldValue) -> Option<String> {
    let FieldValue::U32(u) = v else { return None };
    Some(match name {
        "wtype" => wtype::name(u)?.into(),
        "rope_type" => rope_type::name(u).into(),
        "act" => act::name(u).into(),
        "q8_mask" if u != 0 => q8_class::names(u).join(", "),
        _ => return None,
    })
}

fn value_text(v: FieldValue) -> String {
    match v {
        FieldValue::U32(u) => u.to_string(),
        FieldValue::F32(f) => format!("{f}"),
    }
}

fn shape(t: &Tensor) -> Vec<usize> {
    match t.kind {
        Kind::U8 { len } | Kind::F32 { len } => vec![len],
        Kind::Mat { rows, cols, .. } => vec![rows, cols],
    }
}

fn type_name(t: &Tensor) -> &'static str {
    match t.kind {
        Kind::U8 { .. } => "U8",
        Kind::F32 { .. } => "F32",
        Kind::Mat { wtype, .. } => wtype.name(),
    }
}

/// Parameters, bytes of weights and bits per weight of the quantized matrices.
struct Totals {
    params: u64,
    file_bytes: u64,
    mat_params: u64,
    mat_bytes: u64,
}

fn totals(m: &Mlb) -> Totals {
    let l = m.layout();
    let mut t = Totals {
        params: l.params(),
        file_bytes: m.bytes().len() as u64,
        mat_params: 0,
        mat_bytes: 0,
    };
    for x in &l.tensors {
        if let Kind::Mat { .. } = x.kind {
            t.mat_params += x.params();
            t.mat_bytes += x.stored_bytes();
        }
    }
    t
}

fn bpw(t: &Totals) -> f64 {
    bits_per_weight(t.mat_bytes, t.mat_params)
}

fn bits_per_weight(bytes: u64, params: u64) -> f64 {
    if params == 0 {
        0.0
    } else {
        bytes as f64 * 8.0 / params as f64
    }
}

/// The matrices of one weight type: count, weights, bytes (scales included).
struct TypeTotals {
    wtype: WType,
    matrices: usize,
    params: u64,
    bytes: u64,
}

/// Per weight type, in code order (only the types present).
fn type_totals(m: &Mlb) -> Vec<TypeTotals> {
    let mut v: Vec<TypeTotals> = WType::ALL
        .into_iter()
        .map(|wtype| TypeTotals {
            wtype,
            matrices: 0,
            params: 0,
            bytes: 0,
        })
        .collect();
    for t in &m.layout().tensors {
        if let Kind::Mat { wtype, .. } = t.kind {
            let e = v.iter_mut().find(|e| e.wtype == wtype).expect("every type");
            e.matrices += 1;
            e.params += t.params();
            e.bytes += t.stored_bytes();
        }
    }
    v.retain(|e| e.matrices > 0);
    v
}

/// Bytes past the last array from which [`warnings`] reports them: a writer may pad
/// the file to the next 64-byte boundary (at most 63 bytes), never more.
pub const UNACCOUNTED_WARN: u64 = 64;

/// What a valid file holds that the spec's readers ignore but a user should know: a
/// non-zero byte in the header padding (offsets 160–255) is a field this reader does not
/// know, written by a newer converter, and the file may not run as that writer meant;
/// a file that goes on [`UNACCOUNTED_WARN`] bytes or more past the arrays the header
/// implies has a header that does not describe it (e.g. wtype or shared_classifier
/// changed: the arrays it implies are smaller than the ones written).
pub fn warnings(m: &Mlb) -> Vec<String> {
    let mut w = Vec::new();
    let pad = &m.bytes()[FIELDS_END..HEADER_SIZE];
    if let Some(i) = pad.iter().position(|&b| b != 0) {
        w.push(format!(
            "header padding at offset {} = {:#04x} (offsets {FIELDS_END}–{} must be zero): \
             a field this reader does not know, from a newer writer?",
            FIELDS_END + i,
            pad[i],
            HEADER_SIZE - 1
        ));
    }
    let (end, len) = (m.layout().end, m.bytes().len() as u64);
    if len.saturating_sub(end) >= UNACCOUNTED_WARN {
        w.push(format!(
            "{} bytes past the last array: the arrays the header implies end at byte {end} \
             of {len} (more than a 64-byte padding); a header field (wtype, q8_mask, \
             scale_f16, shared_classifier, a dimension) may not match the arrays written",
            len - end
        ));
    }
    w
}

/// The human-readable report.
pub fn report_text(m: &Mlb, file_name: &str) -> String {
    let h = m.header();
    let d = m.dims();
    let l = m.layout();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{file_name}: MLB1 model, {}",
        human_bytes(m.bytes().len() as u64)
    );
    let _ = writeln!(s, "\nheader");
    let _ = writeln!(s, "  {:<22} {:<16} magic number", "magic", "MLB1");
    for f in FIELDS {
        let v = h.get(f.name).expect("every FIELDS entry is a field");
        let mut val = value_text(v);
        if let Some(m) = meaning(f.name, v) {
            val = format!("{val} ({m})");
        }
        let _ = writeln!(s, "  {:<22} {:<16} {}", f.name, val, f.doc);
    }
    let _ = writeln!(s, "\nderived");
    let _ = writeln!(
        s,
        "  head_dim {}  q_dim {}  kv_dim {}  rot_dim {}",
        d.head_dim, d.q_dim, d.kv_dim, d.rot_dim
    );
    if d.lin_qkv != 0 {
        let _ = writeln!(
            s,
            "  linear attention: qkv channels {}  value channels {}",
            d.lin_qkv, d.lin_v_total
        );
    }
    let _ = writeln!(s, "\nlayers");
    for i in 0..d.n_layers {
        let f = m.layer_flags(i);
        let mut names = layer_flag::names(f);
        if h.layer_flags == 0 && h.sliding_window != 0 {
            names.push("sliding (all layers)");
        }
        let desc = if names.is_empty() {
            "full attention".to_string()
        } else {
            names.join(", ")
        };
        let _ = writeln!(s, "  {i:>3}  {desc}");
    }
    let _ = writeln!(s, "\ntensors");
    let _ = writeln!(
        s,
        "  {:<26} {:>12} {:>14} {:>5} {:>12}",
        "name", "offset", "shape", "type", "bytes"
    );
    for t in &l.tensors {
        let shp = shape(t)
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(" × ");
        let _ = writeln!(
            s,
            "  {:<26} {:>12} {:>14} {:>5} {:>12}",
            t.name.to_string(),
            t.offset,
            shp,
            type_name(t),
            t.stored_bytes()
        );
    }
    if h.shared_classifier != 0 {
        let _ = writeln!(s, "  (classifier shared with tok_emb)");
    }
    let t = totals(m);
    let _ = writeln!(s, "\ntotals");
    let _ = writeln!(s, "  parameters       {}", t.params);
    let _ = writeln!(
        s,
        "  file bytes       {} ({})",
        t.file_bytes,
        human_bytes(t.file_bytes)
    );
    let _ = writeln!(
        s,
        "  bits per weight  {:.3} (all matrices, scales included)",
        bpw(&t)
    );
    let types = type_totals(m);
    if types.len() > 1 {
        let _ = writeln!(s, "\nweight types");
        let _ = writeln!(
            s,
            "  {:<6} {:>8} {:>13} {:>13} {:>15}",
            "type", "matrices", "weights", "bytes", "bits per weight"
        );
        for e in &types {
            let _ = writeln!(
                s,
                "  {:<6} {:>8} {:>13} {:>13} {:>15.3}",
                e.wtype.name(),
                e.matrices,
                e.params,
                e.bytes,
                bits_per_weight(e.bytes, e.params)
            );
        }
    }
    let w = warnings(m);
    if w.is_empty() {
        let _ = writeln!(s, "\nverdict: valid");
    } else {
        let _ = writeln!(s, "\nwarnings");
        for x in &w {
            let _ = writeln!(s, "  {x}");
        }
        let _ = writeln!(s, "\nverdict: valid, {} warning(s)", w.len());
    }
    s
}

/// The JSON report: `header` has every field under its spec name as a plain number.
pub fn report_json(m: &Mlb, file_name: &str) -> Value {
    let h = m.header();
    let d = m.dims();
    let l = m.layout();
    let mut header = Map::new();
    header.insert("magic".into(), json!("MLB1"));
    for f in FIELDS {
        let v = match h.get(f.name).expect("field") {
            FieldValue::U32(u) => json!(u),
            FieldValue::F32(x) => json_f32(x),
        };
        header.insert(f.name.into(), v);
    }
    let layers: Vec<Value> = (0..d.n_layers)
        .map(|i| {
            let f = m.layer_flags(i);
            json!({"index": i, "flags": f, "names": layer_flag::names(f)})
        })
        .collect();
    let tensors: Vec<Value> = l
        .tensors
        .iter()
        .map(|t| {
            let mut o = json!({
                "name": t.name.to_string(),
                "offset": t.offset,
                "shape": shape(t),
                "type": type_name(t),
                "bytes": t.stored_bytes(),
            });
            if let Kind::Mat {
                d_offset, d_bytes, ..
            } = t.kind
            {
                o["scales_offset"] = json!(d_offset);
                o["scales_bytes"] = json!(d_bytes);
            }
            o
        })
        .collect();
    let t = totals(m);
    let types: Vec<Value> = type_totals(m)
        .iter()
        .map(|e| {
            json!({
                "type": e.wtype.name(),
                "matrices": e.matrices,
                "parameters": e.params,
                "bytes": e.bytes,
                "bits_per_weight": (bits_per_weight(e.bytes, e.params) * 1000.0).round() / 1000.0,
            })
        })
        .collect();
    json!({
        "file": file_name,
        "format": "MLB1",
        "valid": true,
        "warnings": warnings(m),
        "header": header,
        "derived": {
            "head_dim": d.head_dim, "q_dim": d.q_dim, "kv_dim": d.kv_dim, "rot_dim": d.rot_dim,
            "lin_qkv": d.lin_qkv, "lin_v_total": d.lin_v_total,
        },
        "layers": layers,
        "tensors": tensors,
        "totals": {
            "parameters": t.params,
            "file_bytes": t.file_bytes,
            "bits_per_weight": (bpw(&t) * 1000.0).round() / 1000.0,
            "types": types,
        },
    })
}

/// Statistics of one tensor's (dequantized) values.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorStats {
    pub name: String,
    pub count: u64,
    pub min: f32,
    pub max: f32,
    pub mean: f64,
    pub rms: f64,
    /// Blocks whose values are all zero (block-quantized matrices only, not BF16/F16).
    pub zero_blocks: Option<u64>,
    pub blocks: Option<u64>,
}

/// Statistics of the tensor named `name`, or `None` if there is none.
pub fn tensor_stats(m: &Mlb, name: &str) -> Option<TensorStats> {
    let l = m.layout();
    let idx = l.tensors.iter().position(|t| t.name.to_string() == name)?;
    let t = &l.tensors[idx];
    let mut st = TensorStats {
        name: name.to_string(),
        count: 0,
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
        mean: 0.0,
        rms: 0.0,
        zero_blocks: None,
        blocks: None,
    };
    let (mut sum, mut sq, mut count) = (0f64, 0f64, 0u64);
    let mut add = |v: f32| {
        count += 1;
        st.min = st.min.min(v);
        st.max = st.max.max(v);
        sum += v as f64;
        sq += v as f64 * v as f64;
    };
    let mut zero_blocks = 0u64;
    match t.kind {
        Kind::U8 { len } => {
            for &b in &m.bytes()[t.offset as usize..t.offset as usize + len] {
                add(b as f32);
            }
        }
        Kind::F32 { .. } => m.f32s(idx).iter().for_each(|&v| add(v)),
        Kind::Mat {
            wtype, rows, cols, ..
        } => {
            let mr = m.mat(idx);
            let bw = wtype.block_weights();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                crate::quant::dequant_mat_row(&mr, r, &mut row);
                for b in row.chunks_exact(bw) {
                    if b.iter().all(|&v| v == 0.0) {
                        zero_blocks += 1;
                    }
                }
                row.iter().for_each(|&v| add(v));
            }
            if bw > 1 {
                st.zero_blocks = Some(zero_blocks);
                st.blocks = Some((rows * cols / bw) as u64);
            }
        }
    }
    st.count = count;
    let n = st.count.max(1) as f64;
    st.mean = sum / n;
    st.rms = (sq / n).sqrt();
    Some(st)
}

impl TensorStats {
    pub fn text(&self) -> String {
        let mut s = format!(
            "{}: {} values\n  min {}\n  max {}\n  mean {:.6e}\n  rms {:.6e}\n",
            self.name, self.count, self.min, self.max, self.mean, self.rms
        );
        if let (Some(z), Some(b)) = (self.zero_blocks, self.blocks) {
            let _ = writeln!(s, "  zero blocks {z} of {b}");
        }
        s
    }

    pub fn json(&self) -> Value {
        json!({
            "name": self.name, "count": self.count, "min": json_f32(self.min), "max": json_f32(self.max),
            "mean": self.mean, "rms": self.rms, "zero_blocks": self.zero_blocks, "blocks": self.blocks,
        })
    }
}
