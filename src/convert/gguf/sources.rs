//! The GGUF file's tensors behind the spec's arrays: every array mapped to its tensor
//! through the architecture's name table and checked (type, shape) before anything is
//! written, with how its data becomes the array ([`Action`]); then read as the write
//! asks ([`Arrays`]): blocks copied, or floats read (and quantized again).

use std::ops::Range;
use std::path::Path;

use super::arch::{self, GgufArch, Transform};
use super::types::copy_type;
use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::convert::pipeline::imatrix::{CovFile, Weighting};
use crate::convert::pipeline::stream::{check_finite, Arrays};
use crate::format::gguf::{dequant, GgmlType, GgufView, TensorInfo};
use crate::format::mlb::{Kind, Layout, Tensor, WriteError};
use crate::format::WType;
use crate::quant::feedback::Feedback;
use crate::quant::{QuantError, Quantized, Scales};

/// Where one spec array comes from.
pub struct Source<'a> {
    pub t: &'a TensorInfo<'a>,
    /// Source row of each output row; `None`: row r is row r.
    pub rows_from: Option<Vec<usize>>,
    /// Source column of each output column (Qwen3.5's ssm_out); `None`: as stored.
    pub cols_from: Option<Vec<usize>>,
    /// A_log = ln(−x) of each value (Qwen3.5's ssm_a).
    pub neg_exp: bool,
    /// Output rows and elements per row (vectors: len × 1).
    pub rows: usize,
    pub row_len: usize,
    pub action: Action,
    /// The imatrix's weighting (requantized matrices only).
    pub w: Weighting,
}

/// How a tensor's data becomes the array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Float vector: read exactly (F32, F16, BF16).
    Floats,
    /// Blocks copied as they are.
    Copy,
    /// Dequantized, then quantized to the array's type.
    Requant,
}

impl Source<'_> {
    fn src(&self, r: usize) -> usize {
        self.rows_from.as_ref().map_or(r, |m| m[r])
    }
}

/// The GGUF tensor behind spec tensor `t`.
pub fn source_of<'a>(
    path: &Path,
    v: &'a GgufView<'a>,
    ga: &GgufArch,
    t: &Tensor,
) -> Result<(&'a TensorInfo<'a>, Transform)> {
    let (name, tr) = ga.tensor_name(t.name.name, t.name.layer).ok_or_else(|| {
        ConvertError::checkpoint(
            path,
            format!("{}: no GGUF tensor for spec array {}", ga.name, t.name),
        )
    })?;
    let info = v.tensor(&name).ok_or_else(|| {
        ConvertError::checkpoint(
            path,
            format!("tensor {name} is missing (needed for {})", t.name),
        )
    })?;
    Ok((info, tr))
}

/// Maps every spec array to its GGUF tensor and checks types and shapes.
pub fn sources<'a>(
    path: &Path,
    v: &'a GgufView<'a>,
    ga: &GgufArch,
    d: &ModelDesc,
    layout: &Layout,
) -> Result<Vec<Option<Source<'a>>>> {
    let g = arch::Geometry::of(d, ga);
    let (dv, conv) = d.linear.map_or((1, 1), |l| (l.v_dim, l.conv));
    let mut out = Vec::with_capacity(layout.tensors.len());
    for t in &layout.tensors {
        if let Kind::U8 { .. } = t.kind {
            out.push(None);
            continue;
        }
        let (info, tr) = source_of(path, v, ga, t)?;
        let (rows, row_len) = match (t.kind, tr) {
            (Kind::Mat { rows, cols, .. }, _) => (rows, cols),
            (Kind::F32 { len }, Transform::VConv) => (len / conv, conv),
            (Kind::F32 { len }, _) => (len, 1),
            (Kind::U8 { .. }, _) => unreachable!(),
        };
        let src_rows = tr.src_rows(rows);
        let no_rope = t.name.layer.is_some_and(|l| d.layers[l as usize].no_rope);
        let rows_from: Option<Vec<usize>> = tr
            .moves_rows_in(&g, no_rope)
            .then(|| (0..rows).map(|r| tr.src_row_in(&g, r, no_rope)).collect());
        let cols_from: Option<Vec<usize>> =
            (tr == Transform::VCols).then(|| (0..row_len).map(|c| tr.src_col(&g, c)).collect());
        let n_experts = d.moe.map_or(1, |m| m.n_experts);
        let want: Vec<u64> = match (t.kind, tr.dims(rows, row_len, n_experts)) {
            (_, Some(dims)) => dims,
            (Kind::Mat { .. }, _) => vec![row_len as u64, src_rows as u64],
            (_, None) if tr == Transform::VConv => vec![row_len as u64, src_rows as u64],
            _ => vec![rows as u64],
        };
        // Per-expert vectors (a router [dim, E], biases [w, E]) are read row by row.
        let (rows, row_len) = match (t.kind, tr) {
            (Kind::F32 { len }, Transform::Experts) => (n_experts, len / n_experts),
            _ => (rows, row_len),
        };
        if info.shape() != want.as_slice() {
            return Err(ConvertError::tensor(
                path,
                info.name,
                format!(
                    "shape {}, expected {want:?} (for {})",
                    info.shape_text(),
                    t.name
                ),
            ));
        }
        let action = match t.kind {
            Kind::F32 { .. } => match info.ty {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Action::Floats,
                ty => {
                    return Err(ConvertError::tensor(
                        path,
                        info.name,
                        format!("type {ty}: expected F32, F16 or BF16 for {}", t.name),
                    ))
                }
            },
            Kind::Mat { wtype, .. } => {
                let same = copy_type(info.ty) == Some(wtype);
                let movable = cols_from.is_none() || dv.is_multiple_of(wtype.block_weights());
                if same && movable {
                    Action::Copy
                } else if dequant::supported(info.ty) {
                    Action::Requant
                } else {
                    return Err(ConvertError::tensor(
                        path,
                        info.name,
                        format!(
                            "type {}: not one Krafla can read, even to requantize",
                            info.ty
                        ),
                    ));
                }
            }
            Kind::U8 { .. } => unreachable!(),
        };
        out.push(Some(Source {
            t: info,
            rows_from,
            cols_from,
            neg_exp: tr == Transform::NegExpA,
            rows,
            row_len,
            action,
            w: Weighting::default(),
        }));
    }
    Ok(out)
}

/// Appends output rows `rows` of `s` as f32 to `buf` (any type dequant reads).
fn read_floats(v: &GgufView, s: &Source, rows: Range<usize>, buf: &mut Vec<f32>) {
    let data = v.data(s.t);
    let rb = s.t.row_bytes() as usize;
    let cols = s.t.cols() as usize;
    let start = buf.len();
    let n = rows.len() * s.row_len;
    buf.resize(start + n, 0.0);
    if s.t.rows() == 1 {
        // A vector: output "rows" are its elements.
        let mut all = vec![0f32; cols];
        dequant::dequantize_row(s.t.ty, data, &mut all);
        for (o, r) in buf[start..].iter_mut().zip(rows) {
            *o = all[s.src(r)];
        }
    } else {
        let mut tmp = vec![0f32; if s.cols_from.is_some() { s.row_len } else { 0 }];
        for (o, r) in buf[start..].chunks_exact_mut(s.row_len).zip(rows) {
            let src = s.src(r);
            let row = &data[src * rb..(src + 1) * rb];
            match &s.cols_from {
                None => {
                    let ok = dequant::dequantize_row(s.t.ty, row, o);
                    debug_assert!(ok, "planned types are readable");
                }
                Some(cf) => {
                    dequant::dequantize_row(s.t.ty, row, &mut tmp);
                    for (x, &c) in o.iter_mut().zip(cf) {
                        *x = tmp[c];
                    }
                }
            }
        }
    }
    if s.neg_exp {
        // ssm_a = −exp(A_log): A_log = ln(−ssm_a); a non-negative ssm_a stays as a NaN
        // for the finiteness check to name.
        for x in &mut buf[start..] {
            *x = if *x < 0.0 {
                (-(*x as f64)).ln() as f32
            } else {
                f32::NAN
            };
        }
    }
}

/// Output rows `rows` of a tensor whose type the `.mlb` has, blocks copied: Q8_0/Q4_0
/// blocks split into quants and scales, other types' blocks (and 2-byte floats) as
/// they are.
fn copy_rows(
    v: &GgufView,
    s: &Source,
    wtype: WType,
    cols: usize,
    rows: Range<usize>,
    scale_f16: bool,
) -> Quantized {
    let data = v.data(s.t);
    let rb = s.t.row_bytes() as usize;
    let qb = wtype.block_bytes();
    let bw = wtype.block_weights();
    let nb = cols / bw;
    let n = rows.len();
    // The GGUF block: Q8_0/Q4_0 carry their f16 scale in front.
    let gb = if wtype.has_scales() { 2 + qb } else { qb };
    let mut q = Vec::with_capacity(n * nb * qb);
    let mut d16 = Vec::with_capacity(if wtype.has_scales() { n * nb } else { 0 });
    for r in rows {
        let src = s.src(r);
        let row = &data[src * rb..(src + 1) * rb];
        for b in 0..nb {
            // Columns moved by whole blocks (checked when planned).
            let sb = s.cols_from.as_ref().map_or(b, |cf| cf[b * bw] / bw);
            let blk = &row[sb * gb..(sb + 1) * gb];
            if wtype.has_scales() {
                d16.push(u16::from_le_bytes([blk[0], blk[1]]));
                q.extend_from_slice(&blk[2..]);
            } else {
                q.extend_from_slice(blk);
            }
        }
    }
    let d = if scale_f16 && wtype.has_scales() {
        Scales::F16(d16)
    } else {
        Scales::F32(
            d16.iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect(),
        )
    };
    Quantized {
        wtype,
        rows: n,
        cols,
        q,
        d,
    }
}

/// A GGUF file's arrays as the write asks for them.
pub struct GgufArrays<'a> {
    pub v: &'a GgufView<'a>,
    pub path: &'a Path,
    pub sources: &'a [Option<Source<'a>>],
    /// Copied Q8_0/Q4_0 scales stay f16 (else they are widened).
    pub scale_f16: bool,
    /// The imatrix's covariance section, for error feedback (`None`: off).
    pub cov: Option<&'a CovFile>,
}

impl GgufArrays<'_> {
    fn source(&self, i: usize) -> &Source<'_> {
        self.sources[i].as_ref().expect("planned")
    }
}

impl Arrays for GgufArrays<'_> {
    fn floats(&self, i: usize, buf: &mut Vec<f32>) -> Result<()> {
        let s = self.source(i);
        read_floats(self.v, s, 0..s.rows, buf);
        check_finite(buf, self.path, s.t.name)
    }

    fn copied(
        &self,
        i: usize,
        wtype: WType,
        cols: usize,
        rows: Range<usize>,
    ) -> Result<Option<Quantized>> {
        let s = self.source(i);
        Ok((s.action == Action::Copy)
            .then(|| copy_rows(self.v, s, wtype, cols, rows, self.scale_f16)))
    }

    fn read(&self, i: usize, rows: Range<usize>, buf: &mut Vec<f32>) {
        read_floats(self.v, self.source(i), rows, buf);
    }

    fn importance(&self, i: usize, row: usize) -> (Option<&[f32]>, usize) {
        self.source(i).w.importance(row)
    }

    fn feedback(&self, i: usize, row: usize) -> (Option<std::sync::Arc<Feedback>>, usize) {
        self.source(i).w.feedback(self.cov, row)
    }

    fn quant_error(&self, i: usize, r0: usize, e: QuantError) -> ConvertError {
        ConvertError::tensor(
            self.path,
            self.source(i).t.name,
            format!("rows from {r0}: {e}"),
        )
    }

    /// Blocks the format refuses are the file's: named by its tensor.
    fn refused(&self, i: usize, out: &Path, e: WriteError) -> ConvertError {
        match e {
            WriteError::Format(err) => ConvertError::tensor(
                self.path,
                self.source(i).t.name,
                format!("{}: {}", err.value, err.rule),
            ),
            e => ConvertError::write(out, out, e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::gguf::types::ggml_type;
    use crate::format::gguf;

    #[test]
    fn blocks_of_every_copied_type_move_whole() {
        // K-quant blocks need 256-value rows, which the fixtures lack: random blocks
        // (any bytes: copying never reads them), rows permuted, then value-head
        // columns moved by whole blocks. Every type GGUF has whose blocks copy whole
        // (Q8_0 and Q4_0 move their scales apart: the fixtures cover those).
        for w in WType::ALL.into_iter().filter(|w| !w.has_scales()) {
            let Some(ty) = ggml_type(w) else { continue };
            assert_eq!(copy_type(ty), Some(w));
            let (rows, cols) = (3usize, 512usize);
            let rb = w.row_bytes(cols);
            let data: Vec<u8> = (0..rows * rb).map(|i| (i * 7 + i / 251) as u8).collect();
            let spec = gguf::TensorSpec::matrix("m", rows as u64, cols as u64, ty);
            let mut wr = gguf::GgufWriter::new(Vec::new(), &[], vec![spec]).unwrap();
            wr.write_data(&data).unwrap();
            let bytes = wr.finish().unwrap();
            let v = gguf::parse(&bytes).unwrap();
            let order = [2usize, 0, 1];
            let mut s = Source {
                t: &v.tensors[0],
                rows_from: Some(order.to_vec()),
                cols_from: None,
                neg_exp: false,
                rows,
                row_len: cols,
                action: Action::Copy,
                w: Weighting::default(),
            };
            let q = copy_rows(&v, &s, w, cols, 0..rows, false);
            let want: Vec<u8> = order
                .iter()
                .flat_map(|&r| data[r * rb..(r + 1) * rb].to_vec())
                .collect();
            assert_eq!(q.q, want, "{w}");
            assert_eq!((q.rows, q.cols), (rows, cols));
            // Two halves of 256 columns swapped: whole blocks of every type.
            s.rows_from = None;
            s.cols_from = Some((0..cols).map(|c| (c + 256) % cols).collect());
            let q = copy_rows(&v, &s, w, cols, 1..2, false);
            let half = rb / 2;
            let row = &data[rb..2 * rb];
            assert_eq!(q.q, [&row[half..], &row[..half]].concat(), "{w}");
        }
    }
}
