//! The checkpoint's tensors behind the spec's arrays: every array mapped to its
//! tensor through the architecture's name table ([`source`](super::arch::HfArch::source)) and checked
//! (presence, dtype, shape) before anything is written; every tensor used or knowingly
//! skipped; then read as the write asks ([`Arrays`]): rows upcast to f32, gathered
//! (the RoPE permutation, Qwen3.5's q/gate split), the +1 of (1 + w) norms, quantized.

use std::ops::Range;

use super::arch::{self, Transform};
use super::checkpoint::{Checkpoint, DType, TensorInfo};
use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::convert::pipeline::imatrix::importance;
use crate::convert::pipeline::permute::RowMap;
use crate::convert::pipeline::stream::{check_finite, Arrays};
use crate::format::mlb::{Kind, Tensor};
use crate::format::mli::Mli;
use crate::quant::QuantError;

/// One spec array and where it comes from.
pub struct Source {
    pub hf: String,
    pub map: RowMap,
    /// Output rows and elements per row (vectors: len × 1).
    pub rows: usize,
    pub row_len: usize,
    /// Add 1 to every value ((1 + w) norms).
    pub plus_one: bool,
    /// Importance per input channel (Q4_0 search with an imatrix).
    pub imp: Option<Vec<f32>>,
}

/// The prefix of the text model's tensors and of its classifier.
pub fn text_prefix(ck: &Checkpoint) -> Result<(String, String)> {
    const CANDIDATES: [(&str, &str); 4] = [
        ("model.", ""),
        ("model.language_model.", ""),
        ("language_model.model.", "language_model."),
        ("", ""),
    ];
    for (p, h) in CANDIDATES {
        if ck.contains(&format!("{p}embed_tokens.weight")) {
            return Ok((p.to_string(), h.to_string()));
        }
    }
    Err(ConvertError::checkpoint(
        ck.first_path(),
        "no embed_tokens.weight tensor (looked for model., model.language_model. and language_model.model. prefixes)",
    ))
}

/// Maps every spec array to its source and checks presence, dtype and shape.
pub fn sources(
    ck: &Checkpoint,
    d: &ModelDesc,
    tensors: &[Tensor],
    imatrix: Option<&Mli>,
) -> Result<Vec<Option<Source>>> {
    let (prefix, head_prefix) = text_prefix(ck)?;
    let (hd, rot) = (d.dims.head_dim, d.rope.rot_dim);
    let names = arch::by_arch(d.arch);
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        if let Kind::U8 { .. } = t.kind {
            out.push(None);
            continue;
        }
        let spec = t.name.name;
        let (rel, transform) = names.source(spec).ok_or_else(|| {
            ConvertError::checkpoint(
                ck.first_path(),
                format!("{}: no source for spec array {spec}", d.arch.name),
            )
        })?;
        let hf = match (t.name.layer, spec) {
            (Some(l), _) => format!("{prefix}layers.{l}.{rel}"),
            (None, "wcls") => format!("{head_prefix}{rel}"),
            (None, _) => format!("{prefix}{rel}"),
        };
        let (rows, row_len, is_mat) = match t.kind {
            Kind::Mat { rows, cols, .. } => (rows, cols, true),
            Kind::F32 { len } => match transform {
                Transform::Conv => {
                    let k = d.linear.map(|l| l.conv).unwrap_or(1);
                    (len / k, k, false)
                }
                _ => (len, 1, false),
            },
            Kind::U8 { .. } => unreachable!(),
        };
        // A layer without RoPE (layer flag bit 2) has no rotate-half layout to bridge:
        // its wq / wk rows (and bq, bk, q_norm, k_norm) keep the checkpoint's order.
        let rot = match t.name.layer {
            Some(l) if d.layers[l as usize].no_rope => 0,
            _ => rot,
        };
        let map = match transform {
            Transform::Rope | Transform::RopeNorm if rot > 0 => RowMap::Rope { head_dim: hd, rot },
            Transform::GateQuery => RowMap::GateQuery { head_dim: hd, rot },
            Transform::GateGate => RowMap::GateGate { head_dim: hd },
            _ => RowMap::Identity,
        };
        // Expected source shape.
        let src_rows = map.src_rows(rows);
        let want: Vec<usize> = match (transform, is_mat) {
            (Transform::Conv, _) => vec![rows, 1, row_len],
            (_, true) => vec![src_rows, row_len],
            (_, false) => vec![src_rows],
        };
        let info = ck.get(&hf).ok_or_else(|| {
            ConvertError::checkpoint(
                ck.first_path(),
                format!("tensor {hf} is missing (needed for {})", t.name),
            )
        })?;
        let file = ck.path_of(info);
        if info.dtype.is_none() {
            return Err(ConvertError::tensor(
                file,
                &hf,
                format!(
                    "dtype {} is not supported (expected BF16, F16 or F32)",
                    info.dtype_name
                ),
            ));
        }
        if info.shape != want {
            return Err(ConvertError::tensor(
                file,
                &hf,
                format!(
                    "shape {:?}, expected {:?} (for {})",
                    info.shape, want, t.name
                ),
            ));
        }
        let plus_one =
            d.arch.norm_plus_one && matches!(transform, Transform::Norm | Transform::RopeNorm);
        // The searching quantizers (Q4_0 search, the block types) use it; the others
        // ignore it.
        let imp = match (imatrix, t.kind) {
            (Some(m), Kind::Mat { cols, .. }) => importance(m, t, cols, d.vocab.tied),
            _ => None,
        };
        out.push(Some(Source {
            hf,
            map,
            rows,
            row_len,
            plus_one,
            imp,
        }));
    }
    Ok(out)
}

/// Every checkpoint tensor must be used or knowingly skipped: a tensor the converter
/// would silently drop may carry math the file cannot express.
pub fn check_leftovers(
    ck: &Checkpoint,
    d: &ModelDesc,
    sources: &[Option<Source>],
    prefix: &str,
    notes: &mut Vec<String>,
) -> Result<()> {
    let used: std::collections::HashSet<&str> =
        sources.iter().flatten().map(|s| s.hf.as_str()).collect();
    const SKIP_PREFIXES: [&str; 7] = [
        "vision_tower.",
        "multi_modal_projector.",
        "model.visual.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "visual.",
        "mtp.",
    ];
    let mut skipped = 0usize;
    let mut mtp = 0usize;
    for name in ck.names() {
        if used.contains(name) || name.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        if d.vocab.tied && name.ends_with("lm_head.weight") {
            // Tied: transformers uses embed_tokens as the classifier and ignores this.
            notes.push(tied_head_note(
                ck,
                name,
                &format!("{prefix}embed_tokens.weight"),
            ));
            continue;
        }
        if SKIP_PREFIXES.iter().any(|p| name.starts_with(p)) && !name.starts_with(prefix) {
            if name.starts_with("mtp.") {
                mtp += 1;
            } else {
                skipped += 1;
            }
            continue;
        }
        let info = ck.get(name).expect("listed");
        return Err(ConvertError::tensor(
            ck.path_of(info),
            name,
            format!(
                "not used by a {} model: refusing to drop it silently",
                d.arch.name
            ),
        ));
    }
    if skipped > 0 {
        notes.push(format!(
            "skipped {skipped} vision tower / projector tensors"
        ));
    }
    if mtp > 0 {
        notes.push(format!(
            "skipped {mtp} multi-token-prediction (mtp.*) tensors"
        ));
    }
    Ok(())
}

/// The note for a classifier tensor `head` that a tied model does not use: whether it
/// holds the same values as the embeddings `emb` (nothing is lost) or not (dropped,
/// as transformers drops it; docs/convert.md).
fn tied_head_note(ck: &Checkpoint, head: &str, emb: &str) -> String {
    let same = match (ck.get(head), ck.get(emb)) {
        (Some(h), Some(e)) => {
            let same = h.dtype_name == e.dtype_name
                && h.shape == e.shape
                && ck.raw_bytes(h) == ck.raw_bytes(e);
            ck.release_all(h);
            same
        }
        _ => false,
    };
    if same {
        format!("{head} is a copy of {emb} (tie_word_embeddings = true): stored once, as the shared classifier")
    } else {
        format!(
            "{head} differs from {emb} and is dropped: tie_word_embeddings = true makes {emb} the classifier, as in transformers (set it to false in config.json to convert {head} as the classifier)"
        )
    }
}

/// Appends output rows `rows` of `s` as f32 to `buf`.
pub fn read_rows(
    ck: &Checkpoint,
    info: &TensorInfo,
    dtype: DType,
    s: &Source,
    rows: Range<usize>,
    buf: &mut Vec<f32>,
) {
    if s.map.is_identity() {
        ck.read_rows(info, dtype, s.row_len, rows, buf);
    } else {
        for r in rows {
            let src = s.map.src(r);
            ck.read_rows(info, dtype, s.row_len, src..src + 1, buf);
        }
    }
}

/// A quantizer's refusal of rows from `r0` of `s`, naming the checkpoint's row.
pub fn quant_error(
    ck: &Checkpoint,
    info: &TensorInfo,
    s: &Source,
    r0: usize,
    e: QuantError,
) -> ConvertError {
    let msg = match e {
        QuantError::NonFinite { row, col, value } => format!(
            "weight [{}, {col}] is {value}: weights must be finite",
            s.map.src(r0 + row)
        ),
        QuantError::ScaleOverflow { row, block, d } => format!(
            "row {} block {block}: scale {d} is above 65504 and cannot be stored as f16 (drop --f16-scales)",
            s.map.src(r0 + row)
        ),
        QuantError::OutOfRange {
            row,
            col,
            value,
            wtype,
        } => format!(
            "weight [{}, {col}] is {value}: beyond the {wtype} range (largest finite {}); store this matrix in another type (--types)",
            s.map.src(r0 + row),
            crate::quant::half_float::max_finite(wtype)
        ),
        QuantError::BlockScaleOverflow {
            wtype,
            row,
            block,
            d,
        } => format!(
            "row {} block {block}: scale {d} is above 65504 and cannot be stored in {wtype}'s f16 scales",
            s.map.src(r0 + row)
        ),
        QuantError::Shape { rows, cols, len } => {
            format!("{rows}×{cols} with {len} values: cols must be a multiple of 32")
        }
    };
    ConvertError::tensor(ck.path_of(info), &s.hf, msg)
}

/// A checkpoint's arrays as the write asks for them.
pub struct CheckpointArrays<'a> {
    pub ck: &'a Checkpoint,
    pub sources: &'a [Option<Source>],
}

impl CheckpointArrays<'_> {
    fn source(&self, i: usize) -> (&Source, &TensorInfo, DType) {
        let s = self.sources[i].as_ref().expect("planned");
        let info = self.ck.get(&s.hf).expect("planned");
        (s, info, info.dtype.expect("planned"))
    }
}

impl Arrays for CheckpointArrays<'_> {
    fn floats(&self, i: usize, buf: &mut Vec<f32>) -> Result<()> {
        let (s, info, dtype) = self.source(i);
        read_rows(self.ck, info, dtype, s, 0..s.rows, buf);
        if s.plus_one {
            for v in buf.iter_mut() {
                *v += 1.0;
            }
        }
        check_finite(buf, self.ck.path_of(info), &s.hf)?;
        self.ck.release(info, s.row_len, 0..s.map.src_rows(s.rows));
        Ok(())
    }

    fn read(&self, i: usize, rows: Range<usize>, buf: &mut Vec<f32>) {
        let (s, info, dtype) = self.source(i);
        read_rows(self.ck, info, dtype, s, rows, buf);
    }

    fn importance(&self, i: usize) -> Option<&[f32]> {
        self.source(i).0.imp.as_deref()
    }

    fn quant_error(&self, i: usize, r0: usize, e: QuantError) -> ConvertError {
        let (s, info, _) = self.source(i);
        quant_error(self.ck, info, s, r0, e)
    }

    /// Rows read in order: their pages go chunk by chunk (a gather's in `done`).
    fn written(&self, i: usize, rows: Range<usize>) {
        let (s, info, _) = self.source(i);
        if s.map.is_identity() {
            self.ck.release(info, s.row_len, rows);
        }
    }

    fn done(&self, i: usize) {
        let (s, info, _) = self.source(i);
        if !s.map.is_identity() {
            self.ck.release(info, s.row_len, 0..s.map.src_rows(s.rows));
        }
    }
}
