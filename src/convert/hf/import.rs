//! Hugging Face checkpoint folder → one `.mlb` file.
//!
//! [`run`] reads `config.json` into the model description ([`config`]), maps the
//! checkpoint's tensors to the spec's arrays and checks every tensor's presence, dtype
//! and shape before writing anything ([`sources`]), chooses every matrix's type
//! (`--wtype`, the `--q8` classes and a [`TypePlan`], or a `--target-bpw` mix; a plan
//! that mixes types gives a mixed file), then streams the arrays in spec order
//! ([`stream`]): read rows and upcast to f32 → transform (RoPE permutation, the +1 of
//! (1 + w) norms, Qwen3.5's q/gate split) → quantize or round to BF16/F16 (rayon over
//! rows) → write → drop.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use super::checkpoint::Checkpoint;
use super::config;
use super::sources::{
    check_leftovers, quant_error, read_rows, release_rows, sources, text_prefix, CheckpointArrays,
    Source, Stack,
};
use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::convert::gguf::types::gguf_only;
use crate::convert::options::{default_output, ConvertOptions, DEFAULT_Q4_Q8_MASK};
use crate::convert::pipeline::imatrix::{load_imatrix, unrouted_warnings, CovFile};
use crate::convert::pipeline::mix;
use crate::convert::pipeline::plan::{self, fall_back, TypePlan};
use crate::convert::pipeline::stream::Progress;
use crate::convert::pipeline::stream::{self, announce, check_output_name, new_writer, Target};
use crate::convert::summary::Summary;
use crate::format::mlb::header::{wtype, Header};
use crate::format::mlb::{Kind, Layout, MlbWriter, Tensor};
use crate::format::mli::Mli;
use crate::format::WType;
use crate::quant::blocks::is_block_type;
use crate::quant::feedback::Feedback;
use crate::quant::{Q4Rule, QuantError};

/// Converts the checkpoint folder `opts.input` (called by [`crate::convert::convert`]
/// inside its thread pool).
pub fn run(
    opts: &ConvertOptions,
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
    let out = output(opts, &ck)?;

    // Options → header fields, the uniform layout, every matrix's type.
    let (mut header, flags) = desc.header();
    let mut mask = q8_mask(opts)?;
    header.wtype = opts.wtype().code();
    header.q8_mask = mask;
    let uniform = uniform_layout(dir, &header, &flags, opts.wtype())?;
    let mut types = wtype_types(opts, &uniform, header.wtype, mask)?;
    let q4_rule = opts.q4_rule.unwrap_or(desc.arch.default_q4_rule);
    let imatrix = imatrix(opts, &desc, &types, q4_rule)?;
    let cov = match (&imatrix, &opts.imatrix) {
        (Some(m), Some(p)) => CovFile::load(p, m, opts.feedback)?,
        _ => None,
    };
    if let Some(c) = &cov {
        notes.extend(c.notes(opts.error_feedback));
    }
    let mut mix_rows = Vec::new();
    if let Some(bpw) = opts.target_bpw {
        let ctx = MixContext {
            ck: &ck,
            desc: &desc,
            tensors: &uniform.tensors,
            imatrix: imatrix.as_ref(),
            cov: cov.as_ref(),
            opts,
        };
        mix_rows = mix_types(&ctx, bpw, progress)?;
        types = mix_rows.iter().map(|r| r.chosen).collect();
    }
    fall_back(&uniform.tensors, &mut types, opts.gguf_types, &mut notes);
    if opts.gguf_types {
        gguf_only(&uniform.tensors, &types)?;
    }
    let mixed = settle_header(opts, &uniform, &types, &mut header, &mut mask)?;

    // The final layout (with the type table of a mixed file) and its sources.
    let mixed_types = mixed.then_some(types.as_slice());
    let layout = new_writer(std::io::sink(), &header, &flags, mixed_types)
        .map_err(|e| config_error(dir, e))?
        .layout()
        .clone();
    let prefix = text_prefix(&ck)?.0;
    let sources = sources(&ck, &desc, &layout.tensors, imatrix.as_ref(), cov.as_ref())?;
    check_leftovers(&ck, &desc, &sources, &prefix, &mut notes)?;
    mxfp4_note(&sources, &layout, &mut notes);
    if let Some(m) = &imatrix {
        if m.cls_tokens == 0 {
            let cls = if desc.vocab.tied {
                "tok_emb (the shared classifier)"
            } else {
                "wcls"
            };
            notes.push(format!(
                "the imatrix has no classifier tokens: {cls} is quantized without it"
            ));
        }
    }

    announce(progress, &layout, &notes);
    if let Some(m) = &imatrix {
        for w in unrouted_warnings(m) {
            progress(Progress::Warning(&w));
        }
    }
    let target = Target {
        out: &out,
        header: &header,
        flags: &flags,
        mixed_types,
        cancel: opts.cancel,
        q4_rule,
    };
    let arrays = CheckpointArrays {
        ck: &ck,
        sources: &sources,
        cov: cov.as_ref().filter(|_| opts.error_feedback),
    };
    let file_bytes = stream::write_file(&target, &layout, &arrays, progress)?;
    Ok(Summary {
        file_bytes,
        notes,
        q4_rule: types.contains(&WType::Q4_0).then_some(q4_rule),
        mix: mix_rows,
        ..Summary::of_layout(out, desc.arch.name, header, &layout, t0)
    })
}

/// What happens to the checkpoint's MXFP4 experts: copied (stored as MXFP4), or
/// decoded and quantized to another type, with the flag that would copy them.
fn mxfp4_note(sources: &[Option<Source>], layout: &Layout, notes: &mut Vec<String>) {
    let (mut copied, mut decoded) = (0, Vec::new());
    for (s, t) in sources.iter().zip(&layout.tensors) {
        let (Some(s), Kind::Mat { wtype, .. }) = (s, t.kind) else {
            continue;
        };
        if s.copies(wtype) {
            copied += 1;
        } else if matches!(s.stack, Stack::Mxfp4 { .. }) && !decoded.contains(&wtype) {
            decoded.push(wtype);
        }
    }
    if copied > 0 {
        notes.push(format!(
            "{copied} expert matrices: the checkpoint's MXFP4 blocks copied as they are (lossless)"
        ));
    }
    if !decoded.is_empty() {
        let to: Vec<String> = decoded.iter().map(|w| w.to_string()).collect();
        notes.push(format!(
            "the checkpoint's MXFP4 experts are decoded and stored as {}; --types experts=mxfp4 keeps their blocks as they are (lossless)",
            to.join(", ")
        ));
    }
}

/// The output: a file name that is none of the inputs (checked before any work).
fn output(opts: &ConvertOptions, ck: &Checkpoint) -> Result<PathBuf> {
    let dir = &opts.input;
    let out = opts
        .output
        .clone()
        .unwrap_or_else(|| default_output(dir, opts.wtype()));
    check_output_name(&out)?;
    let cfg_file = dir.join("config.json");
    let mut inputs: Vec<&Path> = vec![&cfg_file];
    inputs.extend(ck.files());
    inputs.extend(opts.imatrix.as_deref());
    crate::atomic::check_not_input(&out, &inputs).map_err(|e| ConvertError::io(&out, e))?;
    Ok(out)
}

/// The format refusing the header built from `dir`'s config.json.
fn config_error(dir: &Path, e: crate::format::mlb::WriteError) -> ConvertError {
    ConvertError::write(&dir.join("config.json"), dir, e)
}

/// The header's `q8_mask` from `--q8` (Q4_0's default: the classifier), refused where
/// it does not apply; `--target-bpw` checked on the way.
fn q8_mask(opts: &ConvertOptions) -> Result<u32> {
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
    match opts.wtype() {
        WType::Q4_0 if opts.target_bpw.is_none() => Ok(opts.q8_mask.unwrap_or(DEFAULT_Q4_Q8_MASK)),
        t => {
            if opts.q8_mask.is_some_and(|m| m != 0) {
                return Err(ConvertError::options(
                    "--q8",
                    format!(
                        "only applies to --wtype q4_0 (a {t} model stores every matrix as {t}; --types sets other types)"
                    ),
                ));
            }
            Ok(0)
        }
    }
}

/// The uniform layout of `header`: it names the matrices the plan picks from, and
/// validating the header here refuses a model the format cannot hold before any file
/// is created. A K type's 256-weight rows are checked per matrix later (rows that are
/// not whole super-blocks fall back): the shapes are validated as Q8_0.
fn uniform_layout(dir: &Path, header: &Header, flags: &[u8], wtype: WType) -> Result<Layout> {
    let mut shape_header = *header;
    if is_block_type(wtype) {
        shape_header.wtype = WType::Q8_0.code();
    }
    Ok(MlbWriter::new(std::io::sink(), &shape_header, flags)
        .map_err(|e| config_error(dir, e))?
        .layout()
        .clone())
}

/// Every matrix's type from `--wtype`, `--q8` and `--types`. lb and la (the delta
/// rule's gates) stay Q8_0 in a block-type model, as the spec keeps them in a Q4_0
/// one, unless a tensor rule names them.
fn wtype_types(opts: &ConvertOptions, uniform: &Layout, wt: u32, mask: u32) -> Result<Vec<WType>> {
    opts.types
        .check_names(&uniform.tensors)
        .map_err(|m| ConvertError::options("--types", m))?;
    let mut types = plan::matrix_types(&uniform.tensors, wt, mask, &opts.types);
    for ((t, _, _, class), ty) in plan::matrices(&uniform.tensors).zip(types.iter_mut()) {
        if class == 0 && is_block_type(opts.wtype()) && !opts.types.names(t) {
            *ty = WType::Q8_0;
        }
    }
    Ok(types)
}

/// The `--imatrix` file, checked against the model; refused when no quantizer would
/// use it (`--target-bpw`'s candidates are block types, which it weights).
fn imatrix(
    opts: &ConvertOptions,
    desc: &ModelDesc,
    types: &[WType],
    q4_rule: Q4Rule,
) -> Result<Option<Mli>> {
    let searched =
        |t: &WType| is_block_type(*t) || (*t == WType::Q4_0 && q4_rule == Q4Rule::Search);
    if opts.imatrix.is_some() && opts.target_bpw.is_none() && !types.iter().any(searched) {
        return Err(ConvertError::options(
            "--imatrix",
            "weights the searching quantizers only: use it with Q4_0 matrices and --q4-rule search, or with the block types (q4_k, ..., q6_0)",
        ));
    }
    opts.imatrix
        .as_deref()
        .map(|p| load_imatrix(p, desc))
        .transpose()
}

/// What measuring a mix reads.
struct MixContext<'a> {
    ck: &'a Checkpoint,
    desc: &'a ModelDesc,
    /// The uniform layout's arrays.
    tensors: &'a [Tensor],
    imatrix: Option<&'a Mli>,
    /// The imatrix's covariance section: the mix measures the output error with it.
    cov: Option<&'a CovFile>,
    opts: &'a ConvertOptions,
}

/// `--target-bpw`: every matrix measured in its candidate types and the mix chosen
/// under the budget; the matrices `--types` pins (and lb/la, Q8_0) keep their type.
fn mix_types(
    ctx: &MixContext,
    bpw: f64,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Vec<mix::MixRow>> {
    let fixed: Vec<Option<WType>> = plan::matrices(ctx.tensors)
        .map(|(t, _, _, class)| match ctx.opts.types.rule_for(t) {
            Some(ty) => Some(ty),
            None if class == 0 => Some(WType::Q8_0),
            None => None,
        })
        .collect();
    let too_low = |least: f64| {
        ConvertError::options(
            "--target-bpw",
            format!("{bpw}: below the smallest mix this model takes ({least:.3} bits per weight)"),
        )
    };
    // The smallest mix needs no measurement: refused before the minutes of measuring.
    let (mut weights, mut least) = (0u64, 0u64);
    for ((_, rows, cols, _), fix) in plan::matrices(ctx.tensors).zip(&fixed) {
        let ty = fix.unwrap_or(mix::candidates(cols, ctx.opts.gguf_types)[0]);
        weights += (rows * cols) as u64;
        least += mix::matrix_bytes(ty, rows, cols);
    }
    let budget = (bpw * weights as f64 / 8.0).floor() as u64;
    if least > budget {
        return Err(too_low(least as f64 * 8.0 / weights as f64));
    }
    let sources = sources(ctx.ck, ctx.desc, ctx.tensors, ctx.imatrix, ctx.cov)?;
    let mut rows = measure_mix(ctx, &sources, &fixed, progress)?;
    mix::allocate(&mut rows, budget).map_err(too_low)?;
    // The choice before the long write (`--mix-report` comes after it).
    let used: u64 = rows.iter().map(mix::MixRow::bytes).sum();
    let mut counts: Vec<(WType, usize)> = Vec::new();
    for r in &rows {
        match counts.iter_mut().find(|c| c.0 == r.chosen) {
            Some(c) => c.1 += 1,
            None => counts.push((r.chosen, 1)),
        }
    }
    counts.sort_by_key(|c| mix::matrix_bytes(c.0, 1, 1024)); // smallest type first
    let parts: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    progress(Progress::Note(&format!(
        "--target-bpw {bpw}: the mix takes {:.3} bits per weight: {}",
        used as f64 * 8.0 / weights as f64,
        parts.join(", ")
    )));
    Ok(rows)
}

/// The header's type fields for `types`: uniform when one type (or the `--wtype`
/// default) covers them, else mixed; f16 scales by `--f16-scales`, and in a
/// `--target-bpw` file (8.5 bits per weight for Q8_0, as GGUF and the budget count
/// them). Returns whether the file is mixed.
fn settle_header(
    opts: &ConvertOptions,
    uniform: &Layout,
    types: &[WType],
    header: &mut Header,
    mask: &mut u32,
) -> Result<bool> {
    let mut mixed =
        types != plan::matrix_types(&uniform.tensors, header.wtype, *mask, &TypePlan::default());
    // One type for every matrix after all (a fallback or a mix that chose one type): a
    // uniform file of that type.
    if mixed && types.iter().all(|&t| t == types[0]) {
        (mixed, header.wtype, *mask) = (false, types[0].code(), 0);
    }
    let any_scales = types.iter().any(|t| t.has_scales());
    if opts.scale_f16 && !any_scales {
        return Err(ConvertError::options(
            "--f16-scales",
            "no matrix of this model has a scale array (Q8_0 and Q4_0 do; BF16 and F16 have no scales, the block types such as Q4_K keep theirs inside the blocks)",
        ));
    }
    // GGUF's Q8_0 / Q4_0 blocks hold f16 scales.
    let f16 = opts.target_bpw.is_some() || opts.gguf_types;
    header.scale_f16 = (opts.scale_f16 || (f16 && any_scales)) as u32;
    if mixed {
        header.wtype = wtype::MIXED;
        header.q8_mask = 0;
    } else {
        header.q8_mask = *mask;
    }
    Ok(mixed)
}

/// Measures every matrix of `tensors` (the uniform layout) in its candidate types on
/// sampled rows ([`mix`]); `fixed` gives the matrices whose type is not chosen.
fn measure_mix(
    ctx: &MixContext,
    sources: &[Option<Source>],
    fixed: &[Option<WType>],
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Vec<mix::MixRow>> {
    let (ck, d, tensors, opts) = (ctx.ck, ctx.desc, ctx.tensors, ctx.opts);
    let sens = mix::SENSITIVITY;
    let free = fixed.iter().filter(|f| f.is_none()).count();
    progress(Progress::Note(&format!(
        "--target-bpw {}: measuring {free} matrices in their candidate types ({} rows of each, fewer for the IQ codebook types)",
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
            weight: sens.class(class)
                * sens.group(t.name.name)
                * sens.band(t.name.layer, d.dims.n_layers),
            fixed: *fix,
            chosen: fix.unwrap_or(WType::Q8_0),
        };
        if fix.is_none() {
            let k = rows.min(mix::SAMPLE_ROWS);
            buf.clear();
            for j in 0..k {
                let r = j * rows / k;
                read_rows(ck, s, r..r + 1, &mut buf);
            }
            if let Some(j) = buf.iter().position(|v| !v.is_finite()) {
                let e = QuantError::NonFinite {
                    row: j / cols * rows / k,
                    col: j % cols,
                    value: buf[j],
                };
                return Err(quant_error(ck, s, 0, e));
            }
            // With the input's covariance: the output error, quantized as the file will
            // be (with error feedback unless it is off), on the input's first
            // `FEEDBACK_COLS` channels when it is wider (the window's own factor).
            let measure = ctx.cov.zip(s.w.cov.as_ref()).map(|(c, e)| {
                let w = cols.min(mix::FEEDBACK_COLS);
                let h = c.matrix(e, w);
                let fb = match opts.error_feedback {
                    false => None,
                    true if w == cols => c.feedback(e),
                    true => Feedback::new(w, &h, c.prior, crate::kernels::feedback_kernels())
                        .map(Arc::new),
                };
                let x: Vec<f32> = buf
                    .chunks_exact(cols)
                    .flat_map(|r| &r[..w])
                    .copied()
                    .collect();
                (w, h, fb, x)
            });
            let imp = s.w.imp.as_deref();
            row.cands = mix::candidates(cols, opts.gguf_types)
                .par_iter()
                .map(|&ty| {
                    let e = match &measure {
                        Some((w, h, fb, xw)) => {
                            let (n, x) = mix::sample_for(ty, k, *w, xw);
                            let imp = imp.map(|i| &i[..*w]);
                            mix::output_rel_error(ty, n, *w, &x, imp, h, fb.as_deref())
                        }
                        None => {
                            let (n, x) = mix::sample_for(ty, k, cols, &buf);
                            mix::rel_error(ty, n, cols, &x, imp)
                        }
                    };
                    (ty, mix::matrix_bytes(ty, rows, cols), e)
                })
                .collect();
            release_rows(ck, s, 0..rows);
        }
        rows_out.push(row);
    }
    Ok(rows_out)
}
