//! Hugging Face checkpoint folder → one `.mlb` file.
//!
//! [`run`] reads `config.json` ([`config`]), maps the checkpoint's tensors to the
//! spec's arrays through the architecture's table ([`arch`], [`permute`]), checks every
//! tensor's presence, dtype and shape before writing anything, then streams: for each
//! array in spec order, read rows and upcast to f32 → transform (RoPE permutation,
//! the +1 of (1 + w) norms, Qwen3.5's q/gate split) → quantize or round to BF16/F16
//! (rayon over rows) → write → drop. Each matrix's type comes from `--wtype` and a
//! [`TypePlan`] ([`plan`]); a plan that mixes types gives a mixed file. Large matrices
//! go in row chunks, so peak memory stays near one chunk
//! plus its quantized form; quantization is per row, so the bytes do not depend on the
//! chunk size or the thread count.
//!
//! The output goes through [`AtomicFile`]: it gets its name only on success, and on any
//! error (or a kill) an existing target is untouched.

use std::io::BufWriter;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::arch::Transform;
use super::checkpoint::{Checkpoint, DType, TensorInfo};
use super::config::{self, ModelDesc};
use crate::atomic::AtomicFile;
use crate::convert::error::{ConvertError, Result};
use crate::convert::options::{default_output, Options, DEFAULT_Q4_Q8_MASK};
use crate::convert::pipeline::imatrix::{importance, load_imatrix};
use crate::convert::pipeline::mix;
use crate::convert::pipeline::permute::RowMap;
use crate::convert::pipeline::plan::{self, fall_back, TypePlan};
use crate::convert::pipeline::stream::{announce, check_finite, for_row_chunks, new_writer};
use crate::convert::summary::{Progress, Summary};
use crate::format::mlb::header::{wtype, Header};
use crate::format::mlb::{Kind, MlbWriter, Tensor};
use crate::format::mli::Mli;
use crate::format::WType;
use crate::quant::{quantize, Q4Rule, QuantError, QuantOpts};

/// One spec array and where it comes from.
struct Source {
    hf: String,
    map: RowMap,
    /// Output rows and elements per row (vectors: len × 1).
    rows: usize,
    row_len: usize,
    /// Add 1 to every value ((1 + w) norms).
    plus_one: bool,
    /// Importance per input channel (Q4_0 search with an imatrix).
    imp: Option<Vec<f32>>,
}

/// Converts the checkpoint folder `opts.input` (called by [`crate::convert::convert`]
/// inside its thread pool).
pub fn run(
    opts: &Options,
    thread_note: Option<String>,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary> {
    let t0 = Instant::now();
    let dir = &opts.input;
    if !dir.is_dir() {
        return Err(ConvertError::checkpoint(
            dir,
            "not a folder (expected a Hugging Face checkpoint folder or a GGUF file)",
        ));
    }
    let desc = config::load(dir)?;
    let mut notes: Vec<String> = thread_note.into_iter().chain(desc.notes.clone()).collect();
    let ck = Checkpoint::open(dir)?;

    // The output: a file name that is none of the inputs (checked before any work).
    let out = opts
        .output
        .clone()
        .unwrap_or_else(|| default_output(dir, opts.wtype));
    if out.file_name().is_none() || out.is_dir() {
        return Err(ConvertError::options(
            "-o",
            format!("{} is not a file name", out.display()),
        ));
    }
    let cfg_file = dir.join("config.json");
    let mut inputs: Vec<&Path> = vec![&cfg_file];
    inputs.extend(ck.files());
    inputs.extend(opts.imatrix.as_deref());
    crate::atomic::check_not_input(&out, &inputs).map_err(|e| ConvertError::io(&out, e))?;

    // Options → header fields.
    let (mut header, flags) = desc.header();
    if let Some(x) = opts.target_bpw {
        if !(x.is_finite() && (1.0..=32.0).contains(&x)) {
            return Err(ConvertError::options(
                "--target-bpw",
                format!("{x}: expected bits per weight between 1 and 32"),
            ));
        }
        if opts.q8_mask.is_some() {
            return Err(ConvertError::options(
                "--q8",
                "does not apply with --target-bpw (the mix chooses every matrix's type; --types pins some)",
            ));
        }
    }
    let mut mask = match opts.wtype {
        WType::Q4_0 if opts.target_bpw.is_none() => opts.q8_mask.unwrap_or(DEFAULT_Q4_Q8_MASK),
        t => {
            if opts.q8_mask.is_some_and(|m| m != 0) {
                return Err(ConvertError::options(
                    "--q8",
                    format!(
                        "only applies to --wtype q4_0 (a {t} model stores every matrix as {t}; --types sets other types)"
                    ),
                ));
            }
            0
        }
    };
    header.wtype = opts.wtype.code();
    header.q8_mask = mask;
    let cfg_file = dir.join("config.json");
    let format_err = |e| ConvertError::write(&cfg_file, dir, e);
    // The uniform layout names the matrices the plan picks from; validating the header
    // here refuses a model the format cannot hold before any file is created.
    // A K type's 256-weight rows are checked per matrix below (rows that are not whole
    // super-blocks fall back): the shapes are validated as Q8_0.
    let mut shape_header = header;
    if crate::quant::blocks::is_block_type(opts.wtype) {
        shape_header.wtype = WType::Q8_0.code();
    }
    let uniform = MlbWriter::new(std::io::sink(), &shape_header, &flags)
        .map_err(format_err)?
        .layout()
        .clone();
    opts.types
        .check_names(&uniform.tensors)
        .map_err(|m| ConvertError::options("--types", m))?;
    let mut types = plan::matrix_types(&uniform.tensors, header.wtype, mask, &opts.types);
    let is_block = crate::quant::blocks::is_block_type;
    // lb and la (the delta rule's gates) stay Q8_0 in a block-type model, as the spec
    // keeps them in a Q4_0 one, unless a tensor rule names them.
    for ((t, _, _, class), ty) in mix::matrices(&uniform.tensors).zip(types.iter_mut()) {
        if class == 0 && is_block(opts.wtype) && !opts.types.names(t) {
            *ty = WType::Q8_0;
        }
    }
    let q4_rule = opts.q4_rule.unwrap_or(desc.arch.default_q4_rule);
    // --target-bpw's candidates are block types, which the imatrix weights.
    let searched = |t: &WType| is_block(*t) || (*t == WType::Q4_0 && q4_rule == Q4Rule::Search);
    if opts.imatrix.is_some() && opts.target_bpw.is_none() && !types.iter().any(searched) {
        return Err(ConvertError::options(
            "--imatrix",
            "weights the searching quantizers only: use it with Q4_0 matrices and --q4-rule search, or with the block types (q4_k, ..., q6_0)",
        ));
    }
    let imatrix = match &opts.imatrix {
        None => None,
        Some(p) => Some(load_imatrix(p, &desc)?),
    };
    let mut mix_rows = Vec::new();
    if let Some(bpw) = opts.target_bpw {
        let fixed: Vec<Option<WType>> = mix::matrices(&uniform.tensors)
            .map(|(t, _, _, class)| match opts.types.rule_for(t) {
                Some(ty) => Some(ty),
                None if class == 0 => Some(WType::Q8_0),
                None => None,
            })
            .collect();
        let sources = plan(&ck, &desc, &uniform.tensors, imatrix.as_ref())?;
        mix_rows = measure_mix(
            &ck,
            &desc,
            &uniform.tensors,
            &sources,
            &fixed,
            opts,
            progress,
        )?;
        let weights: u64 = mix_rows.iter().map(|r| (r.rows * r.cols) as u64).sum();
        let budget = (bpw * weights as f64 / 8.0).floor() as u64;
        mix::allocate(&mut mix_rows, budget).map_err(|least| {
            ConvertError::options(
                "--target-bpw",
                format!(
                    "{bpw}: below the smallest mix this model takes ({least:.3} bits per weight)"
                ),
            )
        })?;
        types = mix_rows.iter().map(|r| r.chosen).collect();
    }
    fall_back(&uniform.tensors, &mut types, &mut notes);
    let mut mixed =
        types != plan::matrix_types(&uniform.tensors, header.wtype, mask, &TypePlan::default());
    // One type for every matrix after all (a fallback or a mix that chose one type): a
    // uniform file of that type.
    if mixed && types.iter().all(|&t| t == types[0]) {
        (mixed, header.wtype, mask) = (false, types[0].code(), 0);
    }
    let has = |t: WType| types.contains(&t);
    // A --target-bpw file stores the scales of Q8_0 (and of pinned Q4_0) as f16, as GGUF
    // does (8.5 bits per weight), which is what the budget counted (mix::matrix_bytes).
    let scale_f16 =
        opts.scale_f16 || (opts.target_bpw.is_some() && types.iter().any(|t| t.has_scales()));
    if opts.scale_f16 && !types.iter().any(|t| t.has_scales()) {
        return Err(ConvertError::options(
            "--f16-scales",
            "no matrix of this model has a scale array (Q8_0 and Q4_0 do; BF16 and F16 have no scales, the block types such as Q4_K keep theirs inside the blocks)",
        ));
    }
    header.scale_f16 = scale_f16 as u32;
    if mixed {
        header.wtype = wtype::MIXED;
        header.q8_mask = 0;
    } else {
        header.q8_mask = mask;
    }

    // The final layout (with the type table of a mixed file).
    let mixed_types = mixed.then_some(types.as_slice());
    let layout = new_writer(std::io::sink(), &header, &flags, mixed_types)
        .map_err(format_err)?
        .layout()
        .clone();

    let prefix = text_prefix(&ck)?.0;
    let sources = plan(&ck, &desc, &layout.tensors, imatrix.as_ref())?;
    check_leftovers(&ck, &desc, &sources, &prefix, &mut notes)?;
    if let Some(m) = &imatrix {
        if m.cls_tokens == 0 {
            let cls = if desc.tied {
                "tok_emb (the shared classifier)"
            } else {
                "wcls"
            };
            notes.push(format!(
                "the imatrix has no classifier tokens: {cls} is quantized without it"
            ));
        }
    }

    let total = layout.end;
    announce(progress, &layout, &notes);

    // A temporary file beside the target, renamed on success.
    let mut file = AtomicFile::create(&out).map_err(|e| ConvertError::io(&out, e))?;
    let job = Job {
        ck: &ck,
        mixed_types,
        tensors: &layout.tensors,
        sources: &sources,
        scale_f16,
        q4_rule,
        out: &out,
        cancel: opts.cancel,
    };
    // On an error `file` is dropped uncommitted: the target stays as it was.
    write_all(&job, &header, &flags, &mut file, progress)?;
    file.commit().map_err(|e| ConvertError::io(&out, e))?;
    let file_bytes = std::fs::metadata(&out)
        .ok()
        .filter(|m| m.is_file()) // a device given as the output has no length
        .map_or(total, |m| m.len());
    Ok(Summary {
        file_bytes,
        notes,
        q4_rule: has(WType::Q4_0).then_some(q4_rule),
        mix: mix_rows,
        ..Summary::of_layout(out, desc.arch.name, header, &layout, t0)
    })
}

/// Measures every matrix of `tensors` (the uniform layout) in its candidate types on
/// sampled rows ([`mix`]); `fixed` gives the matrices whose type is not chosen.
fn measure_mix(
    ck: &Checkpoint,
    d: &ModelDesc,
    tensors: &[Tensor],
    sources: &[Option<Source>],
    fixed: &[Option<WType>],
    opts: &Options,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Vec<mix::MixRow>> {
    let sens = mix::SENSITIVITY;
    let free = fixed.iter().filter(|f| f.is_none()).count();
    progress(Progress::Note(&format!(
        "--target-bpw {}: measuring {free} matrices in 4 types each ({} rows of each)",
        opts.target_bpw.unwrap_or(0.0),
        mix::SAMPLE_ROWS
    )));
    let mut rows_out = Vec::new();
    let mut buf: Vec<f32> = Vec::new();
    let mats = tensors
        .iter()
        .zip(sources)
        .filter(|(t, _)| matches!(t.kind, Kind::Mat { .. }));
    for (index, ((t, s), fix)) in mats.zip(fixed).enumerate() {
        if opts.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(ConvertError::Interrupted);
        }
        let Kind::Mat {
            rows, cols, class, ..
        } = t.kind
        else {
            unreachable!("filtered")
        };
        let s = s.as_ref().expect("matrices have sources");
        let mut row = mix::MixRow {
            index,
            name: t.name.to_string(),
            class,
            layer: t.name.layer,
            rows,
            cols,
            cands: Vec::new(),
            weight: sens.class(class) * sens.band(t.name.layer, d.n_layers),
            fixed: *fix,
            chosen: fix.unwrap_or(WType::Q8_0),
        };
        if fix.is_none() {
            let info = ck.get(&s.hf).expect("planned");
            let dtype = info.dtype.expect("planned");
            let k = rows.min(mix::SAMPLE_ROWS);
            buf.clear();
            for j in 0..k {
                let r = j * rows / k;
                read_rows(ck, info, dtype, s, r..r + 1, &mut buf);
            }
            if let Some(j) = buf.iter().position(|v| !v.is_finite()) {
                let e = QuantError::NonFinite {
                    row: j / cols * rows / k,
                    col: j % cols,
                    value: buf[j],
                };
                return Err(quant_error(ck, info, s, 0, e));
            }
            for &ty in mix::candidates(cols) {
                let e = mix::rel_error(ty, k, cols, &buf, s.imp.as_deref());
                row.cands.push((ty, mix::matrix_bytes(ty, rows, cols), e));
            }
            ck.release_all(info);
        }
        rows_out.push(row);
    }
    Ok(rows_out)
}

/// The prefix of the text model's tensors and of its classifier.
fn text_prefix(ck: &Checkpoint) -> Result<(String, String)> {
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
fn plan(
    ck: &Checkpoint,
    d: &ModelDesc,
    tensors: &[Tensor],
    imatrix: Option<&Mli>,
) -> Result<Vec<Option<Source>>> {
    let (prefix, head_prefix) = text_prefix(ck)?;
    let (hd, rot) = (d.head_dim, d.rot_dim);
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        if let Kind::U8 { .. } = t.kind {
            out.push(None);
            continue;
        }
        let spec = t.name.name;
        let (rel, transform) = d.arch.source(spec).ok_or_else(|| {
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
            (Some(m), Kind::Mat { cols, .. }) => importance(m, t, cols, d.tied),
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
fn check_leftovers(
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
        if d.tied && name.ends_with("lm_head.weight") {
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

/// What [`write_all`] writes.
struct Job<'a> {
    ck: &'a Checkpoint,
    /// Every matrix's type, for a mixed file.
    mixed_types: Option<&'a [WType]>,
    tensors: &'a [Tensor],
    sources: &'a [Option<Source>],
    scale_f16: bool,
    q4_rule: Q4Rule,
    out: &'a Path,
    cancel: Option<&'a AtomicBool>,
}

fn write_all(
    job: &Job,
    header: &Header,
    flags: &[u8],
    file: &mut AtomicFile,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<()> {
    let Job {
        ck,
        mixed_types,
        tensors,
        sources,
        scale_f16,
        q4_rule,
        out,
        cancel,
    } = *job;
    let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Relaxed));
    let werr = |e| ConvertError::write(out, out, e);
    let mut w = new_writer(
        BufWriter::with_capacity(1 << 20, file),
        header,
        flags,
        mixed_types,
    )
    .map_err(werr)?;
    let mut buf: Vec<f32> = Vec::new();
    for (i, (t, s)) in tensors.iter().zip(sources).enumerate() {
        let name = t.name.to_string();
        if cancelled() {
            return Err(ConvertError::Interrupted);
        }
        if let Some(s) = s {
            let info = ck.get(&s.hf).expect("planned");
            let dtype = info.dtype.expect("planned");
            match t.kind {
                Kind::F32 { .. } => {
                    buf.clear();
                    read_rows(ck, info, dtype, s, 0..s.rows, &mut buf);
                    if s.plus_one {
                        for v in buf.iter_mut() {
                            *v += 1.0;
                        }
                    }
                    check_finite(&buf, ck.path_of(info), &s.hf)?;
                    w.write_f32(&buf).map_err(werr)?;
                    ck.release(info, s.row_len, 0..s.map.src_rows(s.rows));
                }
                Kind::Mat {
                    wtype, rows, cols, ..
                } => {
                    let qopts = QuantOpts {
                        scale_f16,
                        q4_rule,
                        imatrix: s.imp.as_deref(),
                    };
                    for_row_chunks(rows, cols, cancel, |r| {
                        buf.clear();
                        read_rows(ck, info, dtype, s, r.clone(), &mut buf);
                        let m = quantize(wtype, r.len(), cols, &buf, &qopts)
                            .map_err(|e| quant_error(ck, info, s, r.start, e))?;
                        w.write_mat_rows(&m).map_err(werr)?;
                        if s.map.is_identity() {
                            ck.release(info, s.row_len, r);
                        }
                        Ok(())
                    })?;
                    if !s.map.is_identity() {
                        ck.release(info, s.row_len, 0..s.map.src_rows(rows));
                    }
                }
                Kind::U8 { .. } => unreachable!(),
            }
        }
        progress(Progress::Tensor {
            index: i,
            name: &name,
            bytes_done: t.end(),
        });
    }
    w.finish()
        .map_err(werr)?
        .into_inner()
        .map_err(|e| ConvertError::io(out, e.into_error()))?;
    Ok(())
}

/// Appends output rows `rows` of `s` as f32 to `buf`.
fn read_rows(
    ck: &Checkpoint,
    info: &TensorInfo,
    dtype: DType,
    s: &Source,
    rows: std::ops::Range<usize>,
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

fn quant_error(
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
