//! GGUF file → one `.mlb` file (`mlb-convert model.gguf`).
//!
//! The GGUF's metadata becomes a [`ModelDesc`] with the meaning llama.cpp gives it
//! (defaults, per-architecture rules such as Gemma's attention scale and sliding-layer
//! pattern, SmolLM3's no-RoPE layers), and [`ModelDesc::header`] turns that into the
//! header exactly as for a Hugging Face checkpoint. Keys under the architecture's prefix
//! that the converter does not read are refused by name: they may change the math.
//!
//! Tensors, by type:
//! - Matrices of a type Krafla stores ([`copy_type`]: Q8_0, Q4_0, F16, BF16, Q4_K,
//!   Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, IQ4_NL) are copied block by block. Q8_0/Q4_0: a GGUF
//!   block is an f16 scale `d` followed by the quants, the `.mlb` stores the quants
//!   array then the scales array (f16, `scale_f16 = 1`); the others are GGUF's own
//!   blocks (or 2-byte floats) in both. Nothing is rounded. q/k rows of NEOX
//!   architectures are permuted as whole rows (`gguf_arch`), which moves blocks
//!   without changing them.
//! - F32, F16 and BF16 vectors (norms, biases) become F32 exactly.
//! - Any other matrix type (F32 matrices, Q2_K, Q3_K, ...) is dequantized and quantized
//!   again by Krafla's quantizer only with `--requantize TYPE`; without it the
//!   conversion is refused naming the tensor and its type. `--requantize` also
//!   quantizes the F16/BF16 matrices (a float GGUF is what one quantizes); blocks of
//!   Krafla's types are always copied.
//!
//! Each matrix keeps its type; a requantized one takes the `--requantize` type (Q8_0 in
//! the `--q8` classes of a Q4_0 target, default `wcls`, as for checkpoints). The file
//! is uniform (header `wtype`, `q8_mask` for Q4_0) when a header states those types,
//! else mixed (`wtype` 128 with a type table).

use std::collections::HashMap;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::arch::{self, GgufArch, RopeRows, Transform};
use super::desc::{describe, Described};
use super::file::{map_file, parse_file};
use super::meta::Meta;
use super::types::copy_type;
use crate::atomic::AtomicFile;
use crate::convert::error::{ConvertError, Result};
use crate::convert::hf::config::ModelDesc;
use crate::convert::options::{Options, DEFAULT_Q4_Q8_MASK};
use crate::convert::pipeline::imatrix::{importance, load_imatrix};
use crate::convert::pipeline::plan::{matrix_types, TypePlan};
use crate::convert::pipeline::stream::{announce, check_finite, for_row_chunks, new_writer};
use crate::convert::summary::{Progress, Summary};
use crate::format::gguf::{dequant, GgmlType, GgufView, TensorInfo};
use crate::format::mlb::header::{q8_class, wtype, Header};
use crate::format::mlb::{Kind, Tensor, WriteError};
use crate::format::WType;
use crate::quant::{quantize, Q4Rule, QuantOpts, Quantized, Scales};

/// `<stem>.mlb` beside the GGUF file.
pub fn default_output(input: &Path) -> PathBuf {
    input.with_extension("mlb")
}

/// Where one spec array comes from.
struct Source<'a> {
    t: &'a TensorInfo<'a>,
    /// Source row of each output row; `None`: row r is row r.
    rows_from: Option<Vec<usize>>,
    /// Source column of each output column (Qwen3.5's ssm_out); `None`: as stored.
    cols_from: Option<Vec<usize>>,
    /// A_log = ln(−x) of each value (Qwen3.5's ssm_a).
    neg_exp: bool,
    /// Output rows and elements per row (vectors: len × 1).
    rows: usize,
    row_len: usize,
    action: Action,
    imp: Option<Vec<f32>>,
}

/// How a tensor's data becomes the array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
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

/// Converts a GGUF file (called by [`super::convert`] inside its thread pool).
pub fn run(opts: &Options, progress: &mut (dyn FnMut(Progress) + Send)) -> Result<Summary> {
    let t0 = Instant::now();
    let path = &opts.input;
    if opts.target_bpw.is_some() {
        return Err(ConvertError::options(
            "--target-bpw",
            "measures a checkpoint's weights: convert the GGUF's own types, or use --requantize TYPE",
        ));
    }
    let map = map_file(path)?;
    let v = parse_file(path, &map)?;
    let mut notes = Vec::new();

    let arch_name = v
        .get("general.architecture")
        .and_then(|x| x.as_str())
        .ok_or_else(|| {
            ConvertError::config(path, "general.architecture", "missing", "required key")
        })?;
    let ga = arch::by_name(arch_name).ok_or_else(|| {
        ConvertError::config(
            path,
            "general.architecture",
            arch_name,
            format!(
                "unknown or unsupported architecture (supported: {})",
                arch::names().join(", ")
            ),
        )
    })?;
    if let Some(n) = v.get("split.count").and_then(|x| x.as_u64()) {
        if n > 1 {
            return Err(ConvertError::config(
                path,
                "split.count",
                n,
                "a split GGUF: merge the parts first (llama-gguf-split --merge)",
            ));
        }
    }
    let m = Meta::new(&v, path, ga.name);
    let Described { desc, consumed } = describe(&m, ga, &mut notes)?;
    if let Some((k, val)) = m.unknown_key(ga) {
        return Err(ConvertError::config(
            path,
            k,
            val,
            "unknown key: it may change the math, refusing",
        ));
    }

    let gemma3 = desc.arch.name == "gemma3_text";
    let q4_rule = opts.q4_rule.unwrap_or(if gemma3 {
        Q4Rule::Round
    } else {
        Q4Rule::Search
    });

    // A provisional layout gives every matrix its class.
    let (mut header, flags) = desc.header();
    header.wtype = wtype::Q4_0;
    header.scale_f16 = 1;
    let probe = probe_layout(path, &header, &flags, None)?;
    let lin_v_dim = desc.linear.map_or(0, |l| l.v_dim);
    let (wt, mask, mixed) = choose_types(path, &v, ga, &probe, opts, lin_v_dim)?;
    header.wtype = wt;
    header.q8_mask = mask;
    let layout = probe_layout(path, &header, &flags, mixed.as_deref())?;
    let mut sources = plan(path, &v, ga, &desc, &layout)?;
    // Copied Q8_0/Q4_0 blocks hold f16 scales.
    let mut any_scales = false;
    let mut scale_copy = false;
    for (s, t) in sources.iter().zip(&layout.tensors) {
        if let (Some(s), Kind::Mat { wtype, .. }) = (s, t.kind) {
            any_scales |= wtype.has_scales();
            scale_copy |= wtype.has_scales() && s.action == Action::Copy;
        }
    }
    header.scale_f16 = (any_scales && (opts.scale_f16 || scale_copy)) as u32;
    let layout = probe_layout(path, &header, &flags, mixed.as_deref())?;

    // Requantization needs the flag; say what it does.
    let requant: Vec<String> = sources
        .iter()
        .flatten()
        .filter(|s| s.action == Action::Requant)
        .map(|s| format!("{} ({})", s.t.name, s.t.ty))
        .collect();
    if !requant.is_empty() {
        if opts.requantize.is_none() {
            unreachable!("choose_types refuses without --requantize");
        }
        notes.push(format!(
            "requantized {} tensor(s) Krafla cannot store as they are (dequantized, then quantized again: not lossless): {}",
            requant.len(),
            summarize(&requant)
        ));
    }

    let requant_q4 = sources.iter().zip(&layout.tensors).any(|(s, t)| {
        s.as_ref().is_some_and(|s| s.action == Action::Requant)
            && matches!(
                t.kind,
                Kind::Mat {
                    wtype: WType::Q4_0,
                    ..
                }
            )
    });
    let imatrix = match &opts.imatrix {
        None => None,
        Some(p) => {
            if !requant_q4 || q4_rule != Q4Rule::Search {
                return Err(ConvertError::options(
                    "--imatrix",
                    "weights the Q4_0 search of requantized tensors only: use it with --requantize q4_0 --q4-rule search",
                ));
            }
            Some(load_imatrix(p, &desc)?)
        }
    };
    if let Some(mli) = &imatrix {
        for (s, t) in sources.iter_mut().zip(&layout.tensors) {
            if let (
                Some(s),
                Kind::Mat {
                    wtype: WType::Q4_0,
                    cols,
                    ..
                },
            ) = (s.as_mut(), t.kind)
            {
                if s.action == Action::Requant {
                    s.imp = importance(mli, t, cols, desc.tied);
                }
            }
        }
    }

    // Every tensor of the file is used (or knowingly consumed).
    let mut used: HashMap<&str, ()> = sources.iter().flatten().map(|s| (s.t.name, ())).collect();
    for c in &consumed {
        used.insert(c.as_str(), ());
    }
    if let Some(t) = v.tensors.iter().find(|t| !used.contains_key(t.name)) {
        return Err(ConvertError::tensor(
            path,
            t.name,
            format!(
                "not used by a {} model: refusing to drop it silently",
                ga.name
            ),
        ));
    }

    let total = layout.end;
    announce(progress, &layout, &notes);

    let out = opts.output.clone().unwrap_or_else(|| default_output(path));
    if out.file_name().is_none() || out.is_dir() {
        return Err(ConvertError::options(
            "-o",
            format!("{} is not a file name", out.display()),
        ));
    }
    crate::atomic::check_not_input(&out, &[path])
        .map_err(|e| ConvertError::options("-o", format!("{}: {e}", out.display())))?;
    let mut file = AtomicFile::create(&out).map_err(|e| ConvertError::io(&out, e))?;
    {
        let werr = |e| ConvertError::write(&out, &out, e);
        let mut w = new_writer(
            BufWriter::with_capacity(1 << 20, &mut file),
            &header,
            &flags,
            mixed.as_deref(),
        )
        .map_err(werr)?;
        let cancelled = || opts.cancel.is_some_and(|c| c.load(Ordering::Relaxed));
        let mut buf: Vec<f32> = Vec::new();
        for (i, (t, s)) in layout.tensors.iter().zip(&sources).enumerate() {
            if cancelled() {
                return Err(ConvertError::Interrupted);
            }
            if let Some(s) = s {
                match t.kind {
                    Kind::F32 { .. } => {
                        buf.clear();
                        read_floats(&v, s, 0..s.rows, &mut buf);
                        check_finite(&buf, path, s.t.name)?;
                        w.write_f32(&buf).map_err(werr)?;
                    }
                    Kind::Mat {
                        wtype, rows, cols, ..
                    } => {
                        for_row_chunks(rows, cols, opts.cancel, |r| {
                            let chunk = match s.action {
                                Action::Copy => {
                                    copy_rows(&v, s, wtype, cols, r, header.scale_f16 != 0)
                                }
                                _ => {
                                    buf.clear();
                                    read_floats(&v, s, r.clone(), &mut buf);
                                    let qopts = QuantOpts {
                                        scale_f16: header.scale_f16 != 0,
                                        q4_rule,
                                        imatrix: s.imp.as_deref(),
                                    };
                                    quantize(wtype, r.len(), cols, &buf, &qopts).map_err(|e| {
                                        ConvertError::tensor(
                                            path,
                                            s.t.name,
                                            format!("rows from {}: {e}", r.start),
                                        )
                                    })?
                                }
                            };
                            w.write_mat_rows(&chunk).map_err(|e| match e {
                                WriteError::Format(err) => ConvertError::tensor(
                                    path,
                                    s.t.name,
                                    format!("{}: {}", err.value, err.rule),
                                ),
                                e => werr(e),
                            })
                        })?;
                    }
                    Kind::U8 { .. } => unreachable!("layer flags are written by the writer"),
                }
            }
            progress(Progress::Tensor {
                index: i,
                name: &t.name.to_string(),
                bytes_done: t.end(),
            });
        }
        w.finish()
            .map_err(werr)?
            .into_inner()
            .map_err(|e| ConvertError::io(&out, e.into_error()))?;
    }
    file.commit().map_err(|e| ConvertError::io(&out, e))?;
    let file_bytes = std::fs::metadata(&out).map(|x| x.len()).unwrap_or(total);
    Ok(Summary {
        file_bytes,
        notes,
        q4_rule: requant_q4.then_some(q4_rule),
        ..Summary::of_layout(out, desc.arch.name, header, &layout, t0)
    })
}

fn summarize(v: &[String]) -> String {
    if v.len() <= 4 {
        v.join(", ")
    } else {
        format!("{}, ... ({} more)", v[..3].join(", "), v.len() - 3)
    }
}

fn probe_layout(
    path: &Path,
    h: &Header,
    flags: &[u8],
    mixed: Option<&[WType]>,
) -> Result<crate::format::mlb::Layout> {
    let probe = new_writer(std::io::sink(), h, flags, mixed)
        .map_err(|e| ConvertError::write(path, path, e))?;
    Ok(probe.layout().clone())
}

/// The GGUF tensor behind spec tensor `t`.
fn source_of<'a>(
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

/// The storage type of every matrix (array order): its GGUF type when Krafla has it
/// (and, for Qwen3.5's ssm_out, whole blocks move with the value heads), else the
/// `--requantize` type (Q8_0 in the `--q8` classes and lb/la of a Q4_0 target).
/// Returns the header's `wtype` and `q8_mask`, and the type table when no uniform
/// header states these types.
fn choose_types(
    path: &Path,
    v: &GgufView,
    ga: &GgufArch,
    probe: &crate::format::mlb::Layout,
    opts: &Options,
    lin_v_dim: usize,
) -> Result<(u32, u32, Option<Vec<WType>>)> {
    let req = opts.requantize;
    let user_mask = opts.q8_mask.unwrap_or(match req {
        Some(WType::Q4_0) => DEFAULT_Q4_Q8_MASK,
        _ => 0,
    });
    let mut types = Vec::new();
    for t in &probe.tensors {
        let Kind::Mat { class, .. } = t.kind else {
            continue;
        };
        let (info, tr) = source_of(path, v, ga, t)?;
        // Qwen3.5's ssm_out columns move by value heads: whole blocks only when a head
        // is a whole number of blocks.
        let movable =
            |w: WType| tr != Transform::VCols || lin_v_dim.is_multiple_of(w.block_weights());
        // With --requantize, float matrices are quantized (they are the source a
        // user quantizes); without it F16/BF16 ones are kept.
        let float = matches!(info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let ty = match copy_type(info.ty) {
            Some(w) if movable(w) && !(float && req.is_some()) => w,
            copy => {
                let Some(r) = req else {
                    let why = match copy {
                        Some(w) => format!(
                            "{}: its columns move by value heads of {lin_v_dim}, which split the {}-value blocks",
                            info.ty,
                            w.block_weights()
                        ),
                        None => format!(
                            "{}: Krafla stores F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K and Q6_K matrices as they are, not this type",
                            info.ty
                        ),
                    };
                    return Err(ConvertError::tensor(
                        path,
                        info.name,
                        format!(
                            "{why}; convert with --requantize TYPE (e.g. q8_0) to dequantize and quantize it again (not lossless)"
                        ),
                    ));
                };
                crate::format::mlb::layout::class_wtype(r.code(), user_mask, class)
            }
        };
        types.push(ty);
    }
    let uniform =
        |wt: u32, mask: u32| matrix_types(&probe.tensors, wt, mask, &TypePlan::default()) == types;
    for &w in &types {
        let mask = if w == WType::Q4_0 {
            // The classes of the Q8_0 matrices (a shared classifier's tok_emb: the wcls
            // bit, as `--q8 wcls` writes it).
            let mut mask = 0;
            for (t, &ty) in probe
                .tensors
                .iter()
                .filter(|t| matches!(t.kind, Kind::Mat { .. }))
                .zip(&types)
            {
                let Kind::Mat { class, .. } = t.kind else {
                    continue;
                };
                if ty == WType::Q8_0 {
                    mask |= if class & user_mask != 0 {
                        class & user_mask
                    } else if class & q8_class::WCLS != 0 {
                        q8_class::WCLS
                    } else {
                        class
                    };
                }
            }
            mask & q8_class::ALL
        } else {
            0
        };
        if uniform(w.code(), mask) {
            return Ok((w.code(), mask, None));
        }
    }
    Ok((wtype::MIXED, 0, Some(types)))
}

/// Maps every spec array to its GGUF tensor and checks types and shapes.
fn plan<'a>(
    path: &Path,
    v: &'a GgufView<'a>,
    ga: &GgufArch,
    d: &ModelDesc,
    layout: &crate::format::mlb::Layout,
) -> Result<Vec<Option<Source<'a>>>> {
    let g = geometry(d, ga);
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
        let want: Vec<u64> = match (t.kind, tr) {
            (Kind::Mat { .. }, _) | (_, Transform::VConv) => vec![row_len as u64, src_rows as u64],
            _ => vec![rows as u64],
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
            imp: None,
        }));
    }
    Ok(out)
}

/// The gathers' dimensions of a model.
pub(crate) fn geometry(d: &ModelDesc, ga: &GgufArch) -> arch::Geometry {
    arch::Geometry {
        head_dim: d.head_dim,
        rot_dim: d.rot_dim,
        neox: ga.rows == RopeRows::RotateHalf,
        k_heads: d.linear.map_or(1, |l| l.k_heads),
        per_k: d.linear.map_or(1, |l| l.v_heads / l.k_heads),
        v_dim: d.linear.map_or(1, |l| l.v_dim),
        qk_rows: d.linear.map_or(0, |l| 2 * l.k_heads * l.k_dim),
    }
}

/// Appends output rows `rows` of `s` as f32 to `buf` (any type dequant reads).
fn read_floats(v: &GgufView, s: &Source, rows: std::ops::Range<usize>, buf: &mut Vec<f32>) {
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
    rows: std::ops::Range<usize>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::gguf::types::ggml_type;
    use crate::format::gguf;

    #[test]
    fn blocks_of_every_copied_type_move_whole() {
        // K-quant blocks need 256-value rows, which the fixtures lack: random blocks
        // (any bytes: copying never reads them), rows permuted, then value-head
        // columns moved by whole blocks.
        for w in [
            WType::Q4_K,
            WType::Q5_K,
            WType::Q6_K,
            WType::Q4_1,
            WType::IQ4_NL,
            WType::BF16,
        ] {
            let ty = ggml_type(w).unwrap();
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
                imp: None,
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
