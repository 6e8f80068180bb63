//! The checkpoint's tensors behind the spec's arrays: every array mapped to its
//! tensor through the architecture's name table ([`source`](super::arch::HfArch::source)) and checked
//! (presence, dtype, shape) before anything is written; every tensor used or knowingly
//! skipped; then read as the write asks ([`Arrays`]): rows upcast to f32, gathered
//! (the RoPE permutation, Qwen3.5's q/gate split), the +1 of (1 + w) norms, quantized.

use std::ops::Range;

use super::arch::{self, Transform};
use super::checkpoint::Checkpoint;
use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::convert::pipeline::imatrix::{CovFile, Weighting};
use crate::convert::pipeline::permute::RowMap;
use crate::convert::pipeline::stream::Arrays;
use crate::format::mlb::{Kind, Tensor};
use crate::format::mli::Mli;
use crate::format::WType;
use crate::quant::feedback::Feedback;
use crate::quant::{mxfp4, QuantError, Quantized, Scales};

/// One spec array and where it comes from.
pub struct Source {
    /// The tensor (expert 0's, for one tensor per expert).
    pub hf: String,
    /// How the experts' rows are stacked ([`Stack::One`] for any other array).
    pub stack: Stack,
    pub map: RowMap,
    /// Output rows and elements per row (vectors: len × 1).
    pub rows: usize,
    pub row_len: usize,
    /// Add 1 to every value ((1 + w) norms).
    pub plus_one: bool,
    /// The imatrix's weighting.
    pub w: Weighting,
}

/// Where a stacked expert array's rows come from: expert e's `per` rows are output rows
/// `e·per..(e+1)·per`, each read on its own (never the whole stack at once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stack {
    /// One tensor, row for row.
    One,
    /// One tensor per expert (`names[e]`), `per` rows each.
    PerExpert { names: Vec<String>, per: usize },
    /// One tensor [E, in, width] stored input-major (`in` = the row length; 1 for a
    /// vector [E, width]): row i of expert e is column `first + step·i` of slice e.
    Transposed(Strided),
    /// MXFP4 `{hf}` blocks [E, width, in/32, 16] (two FP4 codes a byte, the first in the
    /// low nibble) and `scales` [E, width, in/32] (E8M0: 2^(s − 127)): row i of expert e
    /// is row `first + step·i` of slice e, dequantized exactly to f32.
    Mxfp4 { scales: String, at: Strided },
}

/// Where the experts of one tensor keep their rows: `per` each, row i of expert e at
/// `first + step·i` of the expert's `width` (columns of a transposed tensor, rows of
/// MXFP4 blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strided {
    pub per: usize,
    pub width: usize,
    pub first: usize,
    pub step: usize,
}

impl Strided {
    /// Row `i` of an expert: its place in the expert's `width`.
    fn local(&self, i: usize) -> usize {
        self.first + self.step * i
    }

    /// Row `i` of expert `e`: its place in all experts' `E·width`.
    fn of(&self, e: usize, i: usize) -> usize {
        e * self.width + self.local(i)
    }
}

/// The FP4 (E2M1) values of MXFP4's codes (OCP MX; GGUF's kvalues_mxfp4 × 0.5).
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

impl Source {
    /// Whether the array's blocks are copied as they are when it is stored as `wtype`:
    /// MXFP4 experts stored as MXFP4 (lossless, never decoded).
    pub fn copies(&self, wtype: WType) -> bool {
        wtype == WType::MXFP4 && matches!(self.stack, Stack::Mxfp4 { .. }) && self.map.is_identity()
    }

    /// Every checkpoint tensor the array reads.
    pub fn tensors(&self) -> Vec<&str> {
        match &self.stack {
            Stack::PerExpert { names, .. } => names.iter().map(String::as_str).collect(),
            Stack::Mxfp4 { scales, .. } => vec![self.hf.as_str(), scales.as_str()],
            _ => vec![self.hf.as_str()],
        }
    }

    /// The tensor and its row (or element) behind output row `r`, for messages.
    pub fn origin(&self, r: usize) -> (String, String) {
        let src = self.map.src(r);
        match &self.stack {
            Stack::One => (self.hf.clone(), src.to_string()),
            Stack::PerExpert { names, per } => (names[r / per].clone(), (r % per).to_string()),
            Stack::Transposed(at) => (
                self.hf.clone(),
                format!("expert {}, column {}", r / at.per, at.local(r % at.per)),
            ),
            Stack::Mxfp4 { at, .. } => (
                self.hf.clone(),
                format!("expert {}, row {}", r / at.per, at.local(r % at.per)),
            ),
        }
    }
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
    cov: Option<&CovFile>,
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
        let n_experts = d.moe.map_or(1, |m| m.n_experts);
        let per = rows / n_experts;
        let (stack, checks) = match transform {
            Transform::Experts => {
                let names: Vec<String> = (0..n_experts)
                    .map(|e| hf.replace("{e}", &e.to_string()))
                    .collect();
                let want = if is_mat {
                    vec![per, row_len]
                } else {
                    vec![per]
                };
                let checks = names
                    .iter()
                    .map(|n| (n.clone(), want.clone(), false))
                    .collect();
                (Stack::PerExpert { names, per }, checks)
            }
            Transform::ExpertsT { first, step } => {
                let width = per * step;
                let at = Strided {
                    per,
                    width,
                    first,
                    step,
                };
                let blocks = format!("{hf}_blocks");
                if is_mat && !ck.contains(&hf) && ck.contains(&blocks) {
                    let scales = format!("{hf}_scales");
                    let nb = row_len / 32;
                    let checks = vec![
                        (blocks.clone(), vec![n_experts, width, nb, 16], true),
                        (scales.clone(), vec![n_experts, width, nb], true),
                    ];
                    (Stack::Mxfp4 { scales, at }, checks)
                } else {
                    let want = if is_mat {
                        vec![n_experts, row_len, width]
                    } else {
                        vec![n_experts, width]
                    };
                    (Stack::Transposed(at), vec![(hf.clone(), want, false)])
                }
            }
            _ => {
                // Expected source shape.
                let src_rows = map.src_rows(rows);
                let want: Vec<usize> = match (transform, is_mat) {
                    (Transform::Conv, _) => vec![rows, 1, row_len],
                    (Transform::Flat, _) => vec![rows / d.dims.dim, d.dims.dim],
                    (_, true) => vec![src_rows, row_len],
                    (_, false) => vec![src_rows],
                };
                (Stack::One, vec![(hf.clone(), want, false)])
            }
        };
        let hf = match &stack {
            Stack::PerExpert { names, .. } => names[0].clone(),
            Stack::Mxfp4 { .. } => format!("{hf}_blocks"),
            _ => hf,
        };
        for (name, want, bytes) in checks {
            check_tensor(ck, &name, &want, bytes, t)?;
        }
        let plus_one =
            d.arch.norm_plus_one && matches!(transform, Transform::Norm | Transform::RopeNorm);
        // The searching quantizers (Q4_0 search, the block types) use it; the others
        // ignore it.
        let w = match (imatrix, t.kind) {
            (Some(m), Kind::Mat { rows, cols, .. }) => {
                Weighting::new(m, cov, t, (rows, cols), d.vocab.tied)
            }
            _ => Weighting::default(),
        };
        out.push(Some(Source {
            hf,
            stack,
            map,
            rows,
            row_len,
            plus_one,
            w,
        }));
    }
    Ok(out)
}

/// Checks that tensor `name` is present with shape `want` and a float dtype (`bytes`:
/// raw bytes, U8, for MXFP4's blocks and scales).
fn check_tensor(
    ck: &Checkpoint,
    name: &str,
    want: &[usize],
    bytes: bool,
    t: &Tensor,
) -> Result<()> {
    let info = ck.get(name).ok_or_else(|| {
        ConvertError::checkpoint(
            ck.first_path(),
            format!("tensor {name} is missing (needed for {})", t.name),
        )
    })?;
    let file = ck.path_of(info);
    let ok_dtype = match bytes {
        true => info.dtype_name == "U8",
        false => info.dtype.is_some(),
    };
    if !ok_dtype {
        let expected = if bytes { "U8" } else { "BF16, F16 or F32" };
        return Err(ConvertError::tensor(
            file,
            name,
            format!(
                "dtype {} is not supported (expected {expected})",
                info.dtype_name
            ),
        ));
    }
    if info.shape != want {
        return Err(ConvertError::tensor(
            file,
            name,
            format!(
                "shape {:?}, expected {:?} (for {})",
                info.shape, want, t.name
            ),
        ));
    }
    Ok(())
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
        sources.iter().flatten().flat_map(|s| s.tensors()).collect();
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
pub fn read_rows(ck: &Checkpoint, s: &Source, rows: Range<usize>, buf: &mut Vec<f32>) {
    let get = |name: &str| {
        let info = ck.get(name).expect("planned");
        (info, info.dtype)
    };
    match &s.stack {
        Stack::One => {
            let (info, dtype) = get(&s.hf);
            let dtype = dtype.expect("planned");
            if s.map.is_identity() {
                ck.read_rows(info, dtype, s.row_len, rows, buf);
            } else {
                for r in rows {
                    let src = s.map.src(r);
                    ck.read_rows(info, dtype, s.row_len, src..src + 1, buf);
                }
            }
        }
        Stack::PerExpert { names, per } => {
            for (e, local) in segments(rows, *per) {
                let (info, dtype) = get(&names[e]);
                ck.read_rows(info, dtype.expect("planned"), s.row_len, local, buf);
            }
        }
        Stack::Transposed(st) => {
            let (info, dtype) = get(&s.hf);
            let dtype = dtype.expect("planned");
            let cols = s.row_len;
            let step = st.step;
            let mut tmp = Vec::new();
            for (e, local) in segments(rows, st.per) {
                // Column c of the output rows is a strided run of input row c.
                let (n, base) = (local.len(), buf.len());
                buf.resize(base + n * cols, 0.0);
                for c in 0..cols {
                    tmp.clear();
                    let at = (e * cols + c) * st.width + st.local(local.start);
                    ck.read_rows(info, dtype, 1, at..at + step * (n - 1) + 1, &mut tmp);
                    for j in 0..n {
                        buf[base + j * cols + c] = tmp[j * step];
                    }
                }
            }
        }
        Stack::Mxfp4 { scales, at } => {
            let (blocks, _) = get(&s.hf);
            let (sc, _) = get(scales);
            let (blocks, sc) = (ck.raw_bytes(blocks), ck.raw_bytes(sc));
            let nb = s.row_len / 32;
            for (e, local) in segments(rows, at.per) {
                for i in local {
                    let r = at.of(e, i);
                    let q = &blocks[r * nb * 16..(r + 1) * nb * 16];
                    for (b, &x) in sc[r * nb..(r + 1) * nb].iter().enumerate() {
                        // E8M0: 2^(x − 127); 255 is NaN, refused as a non-finite weight.
                        let d = match x {
                            255 => f32::NAN,
                            x => 2f32.powi(x as i32 - 127),
                        };
                        for &byte in &q[b * 16..(b + 1) * 16] {
                            buf.push(FP4_VALUES[(byte & 15) as usize] * d);
                            buf.push(FP4_VALUES[(byte >> 4) as usize] * d);
                        }
                    }
                }
            }
        }
    }
}

/// Output rows `rows` of an MXFP4 stack `s` as the `.mlb`'s MXFP4 blocks (GGUF's
/// `block_mxfp4`), bits unchanged: per block of 32 the checkpoint's E8M0 scale byte,
/// then its 16 code bytes moved from OCP's consecutive pairs to GGUF's halves
/// ([`mxfp4::qs_from_pairs`]). A scale of 255 (E8M0's NaN) is refused, as the decoding
/// path refuses the NaN weights it gives.
fn mxfp4_rows(ck: &Checkpoint, s: &Source, rows: Range<usize>) -> Result<Option<Quantized>> {
    let Stack::Mxfp4 { scales, at } = &s.stack else {
        return Ok(None);
    };
    let (bi, si) = (
        ck.get(&s.hf).expect("planned"),
        ck.get(scales).expect("planned"),
    );
    let (blocks, sc) = (ck.raw_bytes(bi), ck.raw_bytes(si));
    let nb = s.row_len / 32;
    let mut q = Vec::with_capacity(rows.len() * nb * 17);
    for (e, local) in segments(rows.clone(), at.per) {
        for i in local {
            let r = at.of(e, i);
            for b in 0..nb {
                let x = sc[r * nb + b];
                if x == 255 {
                    return Err(ConvertError::tensor(
                        ck.path_of(si),
                        scales,
                        format!("expert {e}, row {}, block {b}: scale 255 is E8M0's NaN: weights must be finite", at.local(i)),
                    ));
                }
                q.push(x);
                let at = (r * nb + b) * 16;
                q.extend_from_slice(&mxfp4::qs_from_pairs(&blocks[at..at + 16]));
            }
        }
    }
    Ok(Some(Quantized {
        wtype: WType::MXFP4,
        rows: rows.len(),
        cols: s.row_len,
        q,
        d: Scales::F32(Vec::new()),
    }))
}

/// Starts reading the pages output rows `rows` of `s` will read (see
/// [`Checkpoint::prefetch`]); the layouts read by strides or gathers are left to the
/// kernel's own read-ahead.
pub fn prefetch_rows(ck: &Checkpoint, s: &Source, rows: Range<usize>) {
    let get = |name: &str| ck.get(name).expect("planned");
    match &s.stack {
        Stack::One if s.map.is_identity() => ck.prefetch(get(&s.hf), s.row_len, rows),
        Stack::PerExpert { names, per } => {
            for (e, local) in segments(rows, *per) {
                ck.prefetch(get(&names[e]), s.row_len, local);
            }
        }
        _ => {}
    }
}

/// Drops the pages output rows `rows` of `s` read (see [`Checkpoint::release`]).
pub fn release_rows(ck: &Checkpoint, s: &Source, rows: Range<usize>) {
    let get = |name: &str| ck.get(name).expect("planned");
    match &s.stack {
        Stack::One => {
            let rows = match s.map.is_identity() {
                true => rows,
                false => 0..s.map.src_rows(s.rows),
            };
            ck.release(get(&s.hf), s.row_len, rows);
        }
        Stack::PerExpert { names, per } => {
            for (e, local) in segments(rows, *per) {
                ck.release(get(&names[e]), s.row_len, local);
            }
        }
        Stack::Transposed(at) => {
            for (e, _) in segments(rows, at.per) {
                ck.release(get(&s.hf), s.row_len * at.width, e..e + 1);
            }
        }
        Stack::Mxfp4 { scales, at } => {
            let nb = s.row_len / 32;
            for (e, local) in segments(rows, at.per) {
                let (lo, hi) = (local.start, local.end - 1);
                let r0 = at.of(e, lo);
                let r1 = at.of(e, hi) + 1;
                ck.release_bytes(get(&s.hf), r0 * nb * 16..r1 * nb * 16);
                ck.release_bytes(get(scales), r0 * nb..r1 * nb);
            }
        }
    }
}

/// `rows` cut at the experts' boundaries: (expert, its local rows), `per` rows each.
fn segments(rows: Range<usize>, per: usize) -> impl Iterator<Item = (usize, Range<usize>)> {
    let mut r = rows.start;
    std::iter::from_fn(move || {
        if r >= rows.end {
            return None;
        }
        let (e, i) = (r / per, r % per);
        let n = (per - i).min(rows.end - r);
        r += n;
        Some((e, i..i + n))
    })
}

/// A quantizer's refusal of rows from `r0` of `s`, naming the checkpoint's tensor
/// and row.
pub fn quant_error(ck: &Checkpoint, s: &Source, r0: usize, e: QuantError) -> ConvertError {
    let row = match e {
        QuantError::NonFinite { row, .. }
        | QuantError::ScaleOverflow { row, .. }
        | QuantError::OutOfRange { row, .. }
        | QuantError::BlockScaleOverflow { row, .. } => row,
        QuantError::Shape { .. } | QuantError::NoQuantizer { .. } => 0,
    };
    let (hf, src) = s.origin(r0 + row);
    let msg = match e {
        QuantError::NonFinite { col, value, .. } => {
            format!("weight [{src}, {col}] is {value}: weights must be finite")
        }
        QuantError::ScaleOverflow { block, d, .. } => format!(
            "row {src} block {block}: scale {d} is above 65504 and cannot be stored as f16 (drop --f16-scales)"
        ),
        QuantError::OutOfRange {
            col, value, wtype, ..
        } => format!(
            "weight [{src}, {col}] is {value}: beyond the {wtype} range (largest finite {}); store this matrix in another type (--types)",
            crate::format::half_float::max_finite(wtype)
        ),
        QuantError::BlockScaleOverflow {
            wtype, block, d, ..
        } => format!(
            "row {src} block {block}: scale {d} is above 65504 and cannot be stored in {wtype}'s f16 scales"
        ),
        QuantError::Shape { rows, cols, len } => {
            format!("{rows}×{cols} with {len} values: cols must be a multiple of 32")
        }
        QuantError::NoQuantizer { .. } => e.to_string(),
    };
    let info = ck.get(&hf).expect("planned");
    ConvertError::tensor(ck.path_of(info), &hf, msg)
}

/// A checkpoint's arrays as the write asks for them.
pub struct CheckpointArrays<'a> {
    pub ck: &'a Checkpoint,
    pub sources: &'a [Option<Source>],
    /// The imatrix's covariance section, for error feedback (`None`: off).
    pub cov: Option<&'a CovFile>,
}

impl CheckpointArrays<'_> {
    fn source(&self, i: usize) -> &Source {
        self.sources[i].as_ref().expect("planned")
    }
}

impl Arrays for CheckpointArrays<'_> {
    fn floats(&self, i: usize, buf: &mut Vec<f32>) -> Result<()> {
        let s = self.source(i);
        read_rows(self.ck, s, 0..s.rows, buf);
        if s.plus_one {
            for v in buf.iter_mut() {
                *v += 1.0;
            }
        }
        if let Some(j) = buf.iter().position(|x| !x.is_finite()) {
            let (hf, src) = s.origin(j);
            let info = self.ck.get(&hf).expect("planned");
            let at = match s.stack {
                Stack::One => j.to_string(),
                _ => src,
            };
            return Err(ConvertError::tensor(
                self.ck.path_of(info),
                &hf,
                format!("element {at} is {}: weights must be finite", buf[j]),
            ));
        }
        release_rows(self.ck, s, 0..s.rows);
        Ok(())
    }

    fn copied(
        &self,
        i: usize,
        wtype: WType,
        _cols: usize,
        rows: Range<usize>,
    ) -> Result<Option<Quantized>> {
        let s = self.source(i);
        match s.copies(wtype) {
            true => mxfp4_rows(self.ck, s, rows),
            false => Ok(None),
        }
    }

    fn read(&self, i: usize, rows: Range<usize>, buf: &mut Vec<f32>) {
        let s = self.source(i);
        // The next two chunks of rows (the stream reads a matrix's rows in order, in
        // chunks of one size) come from the disk while this one is quantized and
        // written: the Qwen3-MoE checkpoint's Q8_0 conversion from a cold cache went
        // from 55.8 s to 44.5 s with one chunk ahead, 41.1 s with two
        // (docs/benchmarks-convert.md).
        let next = rows.end..(rows.end + 2 * rows.len()).min(s.rows);
        prefetch_rows(self.ck, s, next);
        read_rows(self.ck, s, rows, buf);
    }

    fn importance(&self, i: usize, row: usize) -> (Option<&[f32]>, usize) {
        self.source(i).w.importance(row)
    }

    fn feedback(&self, i: usize, row: usize) -> (Option<std::sync::Arc<Feedback>>, usize) {
        self.source(i).w.feedback(self.cov, row)
    }

    fn quant_error(&self, i: usize, r0: usize, e: QuantError) -> ConvertError {
        quant_error(self.ck, self.source(i), r0, e)
    }

    /// Rows read in order: their pages go chunk by chunk (a gather's in `done`).
    fn written(&self, i: usize, rows: Range<usize>) {
        let s = self.source(i);
        if s.map.is_identity() {
            release_rows(self.ck, s, rows);
        }
    }

    fn done(&self, i: usize) {
        let s = self.source(i);
        if !s.map.is_identity() {
            release_rows(self.ck, s, 0..s.rows);
        }
    }
}
