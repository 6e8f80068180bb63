//! GGUF file → one `.mlb` file (`mlb-convert model.gguf`).
//!
//! The GGUF's metadata becomes the model description with the meaning llama.cpp gives it
//! ([`super::desc`]: defaults, per-architecture rules such as Gemma's attention scale and
//! sliding-layer pattern, SmolLM3's no-RoPE layers), and
//! [`ModelDesc::header`](crate::convert::desc::ModelDesc::header) turns that into the
//! header exactly as for a Hugging Face checkpoint. Keys under the architecture's prefix
//! that the converter does not read are refused by name: they may change the math.
//! The tensors behind the arrays are found and checked by [`super::sources`], then
//! written by the shared [`stream`].
//!
//! Tensors, by type:
//! - Matrices of a type Krafla stores ([`copy_type`]: Q8_0, Q4_0, F16, BF16, Q4_K,
//!   Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS, MXFP4, and the IQ codebook
//!   types IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M) are copied block by
//!   block. Q8_0/Q4_0: a GGUF
//!   block is an f16 scale `d` followed by the quants, the `.mlb` stores the quants
//!   array then the scales array (f16, `scale_f16 = 1`); the others are GGUF's own
//!   blocks (or 2-byte floats) in both. Nothing is rounded. q/k rows of NEOX
//!   architectures are permuted as whole rows ([`super::arch`]), which moves blocks
//!   without changing them.
//! - F32, F16 and BF16 vectors (norms, biases) become F32 exactly.
//! - Any other matrix type (F32 matrices, Q8_K, ...) is dequantized and quantized again
//!   by Krafla's quantizer only with `--requantize TYPE`; without it the conversion is
//!   refused naming the tensor and its type. `--requantize` also quantizes the F16/BF16
//!   matrices (a float GGUF is what one quantizes); blocks of Krafla's types are always
//!   copied.
//! - A matrix a `--types` rule names (a class, a group such as `experts`, a tensor) takes
//!   the rule's type: dequantized and quantized again, unless its blocks already are of
//!   that type (copied then). Routers are F32 arrays, never quantized.
//!
//! A requantized matrix takes its rule's type, else the `--requantize` type (Q8_0 in the
//! `--q8` classes of a Q4_0 target, default `wcls`, as for checkpoints); a 256-weight
//! type on rows that are not whole super-blocks falls back as for a checkpoint
//! ([`fall_back`], with its note). `--imatrix` weights the requantized matrices (with
//! error feedback where it has their input's covariance). The file is uniform (header
//! `wtype`, `q8_mask` for Q4_0) when a header states those types, else mixed (`wtype`
//! 128 with a type table). `--wtype`, `--target-bpw` and `--preset` choose a
//! checkpoint's types: refused here by name.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::arch::{self, GgufArch, Transform};
use super::desc::{describe, Described};
use super::file::{map_file, parse_file};
use super::meta::Meta;
use super::sources::{source_of, sources, Action, GgufArrays, Source};
use super::types::{copy_type, ggml_type, gguf_only};
use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, Result};
use crate::convert::options::{ConvertOptions, DEFAULT_Q4_Q8_MASK};
use crate::convert::pipeline::imatrix::{load_imatrix, unrouted_warnings, CovFile, Weighting};
use crate::convert::pipeline::plan::{self, fall_back, matrix_types, TypePlan};
use crate::convert::pipeline::stream::Progress;
use crate::convert::pipeline::stream::{self, announce, check_output_name, new_writer, Target};
use crate::convert::summary::Summary;
use crate::format::gguf::{GgmlType, GgufView};
use crate::format::mlb::header::{q8_class, wtype, Header};
use crate::format::mlb::{Kind, Layout};
use crate::format::mli::Mli;
use crate::format::WType;
use crate::quant::blocks::is_block_type;
use crate::quant::Q4Rule;

/// `<stem>.mlb` beside the GGUF file.
pub fn default_output(input: &Path) -> PathBuf {
    input.with_extension("mlb")
}

/// Converts a GGUF file (called by [`crate::convert::convert`] inside its thread pool).
pub fn run(opts: &ConvertOptions, progress: &mut (dyn FnMut(Progress) + Send)) -> Result<Summary> {
    let t0 = Instant::now();
    let path = &opts.input;
    if opts.target_bpw.is_some() {
        return Err(ConvertError::options(
            "--target-bpw (or --preset)",
            "measures a checkpoint folder's weights: convert a GGUF's own types, or choose some with --types CLASS=TYPE or --requantize TYPE",
        ));
    }
    if let Some(w) = opts.wtype {
        return Err(ConvertError::options(
            "--wtype",
            format!(
                "a GGUF's matrices keep their own types: --types CLASS={w} requantizes the matrices of some classes (e.g. experts={w}), --requantize {w} the float ones and those of types Krafla lacks",
                w = w.cli_name()
            ),
        ));
    }
    if let Some(t) = opts
        .requantize
        .filter(|&t| opts.gguf_types && ggml_type(t).is_none())
    {
        return Err(ConvertError::options(
            "--gguf-types",
            format!("--requantize {t}: GGUF does not have {t} (choose a type GGUF has, e.g. Q8_0 or Q6_K)"),
        ));
    }
    let map = map_file(path)?;
    let v = parse_file(path, &map)?;
    let mut notes = Vec::new();
    let ga = architecture(path, &v)?;
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
    let q4_rule = opts.q4_rule.unwrap_or(desc.arch.default_q4_rule);

    let (mut header, flags) = desc.header();
    let (mixed, layout, mut sources) = plan(&v, ga, &desc, opts, &mut header, &flags, &mut notes)?;
    requant_note(&sources, &layout, &opts.types, &mut notes);
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
    let mut warnings = Vec::new();
    let mut cov = None;
    if let (Some(mli), Some(p)) = (
        imatrix(opts, &sources, &layout, q4_rule, &desc)?,
        &opts.imatrix,
    ) {
        cov = CovFile::load(p, &mli, opts.feedback)?;
        if let Some(c) = &cov {
            notes.extend(c.notes(opts.error_feedback));
        }
        let feedback = cov.as_ref().filter(|_| opts.error_feedback);
        weigh(&mli, feedback, &mut sources, &layout, desc.vocab.tied);
        warnings = unrouted_warnings(&mli);
    }
    check_all_used(path, ga, &v, &sources, &consumed)?;

    announce(progress, &layout, &notes);
    for w in &warnings {
        progress(Progress::Warning(w));
    }
    let out = opts.output.clone().unwrap_or_else(|| default_output(path));
    check_output_name(&out)?;
    let inputs: Vec<&Path> = [path.as_path()]
        .into_iter()
        .chain(opts.imatrix.as_deref())
        .collect();
    crate::atomic::check_not_input(&out, &inputs)
        .map_err(|e| ConvertError::options("-o", format!("{}: {e}", out.display())))?;
    let target = Target {
        out: &out,
        header: &header,
        flags: &flags,
        mixed_types: mixed.as_deref(),
        cancel: opts.cancel,
        q4_rule,
    };
    let arrays = GgufArrays {
        v: &v,
        path,
        sources: &sources,
        scale_f16: header.scale_f16 != 0,
        cov: cov.as_ref().filter(|_| opts.error_feedback),
    };
    let file_bytes = stream::write_file(&target, &layout, &arrays, progress)?;
    Ok(Summary {
        file_bytes,
        notes,
        q4_rule: requant_q4.then_some(q4_rule),
        ..Summary::of_layout(out, desc.arch.name, header, &layout, t0)
    })
}

/// What [`plan`] decides: the type table of a mixed file (`None`: the header states
/// the types), the layout, and the tensor behind each array.
type Plan<'a> = (Option<Vec<WType>>, Layout, Vec<Option<Source<'a>>>);

/// Every matrix's type (the header's `wtype`, `q8_mask` and `scale_f16`, or the type
/// table of a mixed file), and the layout with the tensor behind each array; `notes`
/// gets the fallbacks of rows that are not whole super-blocks.
fn plan<'a>(
    v: &'a GgufView<'a>,
    ga: &GgufArch,
    desc: &ModelDesc,
    opts: &ConvertOptions,
    header: &mut Header,
    flags: &[u8],
    notes: &mut Vec<String>,
) -> Result<Plan<'a>> {
    let path = &opts.input;
    // A provisional layout gives every matrix its class.
    header.wtype = wtype::Q4_0;
    header.scale_f16 = 1;
    let probe = probe_layout(path, header, flags, None)?;
    let lin_v_dim = desc.linear.map_or(0, |l| l.v_dim);
    let mut types = matrix_types_of(path, v, ga, &probe, opts, lin_v_dim)?;
    fall_back(&probe.tensors, &mut types, opts.gguf_types, notes);
    if opts.gguf_types {
        gguf_only(&probe.tensors, &types)?;
    }
    let (wt, mask, mixed) = header_types(&probe, opts, types);
    header.wtype = wt;
    header.q8_mask = mask;
    // Scale-free types only (a BF16 GGUF's own matrices): no scale array to be f16.
    let scaled = match &mixed {
        Some(types) => types.iter().any(|w| w.has_scales()),
        None => WType::from_code(wt).is_none_or(|w| w.has_scales()),
    };
    header.scale_f16 &= scaled as u32;
    let layout = probe_layout(path, header, flags, mixed.as_deref())?;
    let sources = sources(path, v, ga, desc, &layout)?;
    // Copied Q8_0/Q4_0 blocks hold f16 scales.
    let mut any_scales = false;
    let mut scale_copy = false;
    for (s, t) in sources.iter().zip(&layout.tensors) {
        if let (Some(s), Kind::Mat { wtype, .. }) = (s, t.kind) {
            any_scales |= wtype.has_scales();
            scale_copy |= wtype.has_scales() && s.action == Action::Copy;
        }
    }
    // `--gguf-types`: GGUF's Q8_0/Q4_0 blocks hold f16 scales, as for a checkpoint.
    header.scale_f16 = (any_scales && (opts.scale_f16 || opts.gguf_types || scale_copy)) as u32;
    let layout = probe_layout(path, header, flags, mixed.as_deref())?;
    Ok((mixed, layout, sources))
}

/// The file's architecture (`general.architecture`); a split file is refused.
fn architecture(path: &Path, v: &GgufView) -> Result<&'static GgufArch> {
    let arch_name = v
        .get("general.architecture")
        .and_then(|x| x.as_str())
        .ok_or_else(|| {
            ConvertError::config(path, "general.architecture", "missing", "required key")
        })?;
    // A llama with experts is Mixtral.
    let experts = v
        .get(&format!("{arch_name}.expert_count"))
        .and_then(|x| x.as_u64())
        .is_some_and(|n| n > 0);
    let ga = match arch::by_name_experts(arch_name, experts) {
        Some(ga) => Some(ga),
        None if experts && arch::by_name(arch_name).is_some() => {
            return Err(ConvertError::config(
                path,
                format!("{arch_name}.expert_count"),
                v.get(&format!("{arch_name}.expert_count"))
                    .and_then(|x| x.as_u64())
                    .unwrap_or(0),
                format!("a {arch_name} model with experts is not supported"),
            ));
        }
        None => arch::by_name(arch_name),
    };
    let ga = ga.ok_or_else(|| {
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
    Ok(ga)
}

/// Says which tensors are dequantized and quantized again: those `--types` asks for
/// (with the type each became), and those Krafla cannot store as they are
/// ([`matrix_types_of`] refused them without `--requantize`).
fn requant_note(
    sources: &[Option<Source>],
    layout: &Layout,
    plan: &TypePlan,
    notes: &mut Vec<String>,
) {
    let (mut asked, mut needed) = (Vec::new(), Vec::new());
    for (s, t) in sources.iter().zip(&layout.tensors) {
        let (Some(s), Kind::Mat { wtype, .. }) = (s, t.kind) else {
            continue;
        };
        if s.action != Action::Requant {
            continue;
        }
        match plan.rule_for(t) {
            Some(_) => asked.push(format!("{} ({} to {wtype})", s.t.name, s.t.ty)),
            None => needed.push(format!("{} ({})", s.t.name, s.t.ty)),
        }
    }
    if !asked.is_empty() {
        notes.push(format!(
            "requantized {} tensor(s) as --types asks (dequantized, then quantized again: not lossless): {}",
            asked.len(),
            summarize(&asked)
        ));
    }
    if !needed.is_empty() {
        notes.push(format!(
            "requantized {} tensor(s) Krafla cannot store as they are (dequantized, then quantized again: not lossless): {}",
            needed.len(),
            summarize(&needed)
        ));
    }
}

/// The `--imatrix` file: it weights the searching quantizers (the block types, Q4_0's
/// search) of requantized tensors; copied blocks are not quantized again.
fn imatrix(
    opts: &ConvertOptions,
    sources: &[Option<Source>],
    layout: &Layout,
    q4_rule: Q4Rule,
    desc: &ModelDesc,
) -> Result<Option<Mli>> {
    let Some(p) = &opts.imatrix else {
        return Ok(None);
    };
    let searched = |w: WType| is_block_type(w) || (w == WType::Q4_0 && q4_rule == Q4Rule::Search);
    let used = sources
        .iter()
        .zip(&layout.tensors)
        .any(|(s, t)| match (s, t.kind) {
            (Some(s), Kind::Mat { wtype, .. }) => s.action == Action::Requant && searched(wtype),
            _ => false,
        });
    if !used {
        return Err(ConvertError::options(
            "--imatrix",
            "weights the searching quantizers of requantized tensors only (the block types such as q4_k, or q4_0 with --q4-rule search): use it with --types CLASS=TYPE or --requantize TYPE",
        ));
    }
    Ok(Some(load_imatrix(p, desc)?))
}

/// The importance of the input channels of every requantized matrix (as for a
/// checkpoint, the quantizer of each type decides whether it weighs them), and its
/// input's covariance where `cov` (error feedback) has one.
fn weigh(
    mli: &Mli,
    cov: Option<&CovFile>,
    sources: &mut [Option<Source>],
    layout: &Layout,
    tied: bool,
) {
    for (s, t) in sources.iter_mut().zip(&layout.tensors) {
        if let (Some(s), Kind::Mat { cols, .. }) = (s.as_mut(), t.kind) {
            if s.action == Action::Requant {
                s.w = Weighting::new(mli, cov, t, (s.rows, cols), tied);
            }
        }
    }
}

/// Every tensor of the file is used (or knowingly consumed by the description): one
/// the converter would drop may carry math the file cannot express.
fn check_all_used(
    path: &Path,
    ga: &GgufArch,
    v: &GgufView,
    sources: &[Option<Source>],
    consumed: &[String],
) -> Result<()> {
    let mut used: HashSet<&str> = sources.iter().flatten().map(|s| s.t.name).collect();
    used.extend(consumed.iter().map(String::as_str));
    if let Some(t) = v.tensors.iter().find(|t| !used.contains(t.name)) {
        return Err(ConvertError::tensor(
            path,
            t.name,
            format!(
                "not used by a {} model: refusing to drop it silently",
                ga.name
            ),
        ));
    }
    Ok(())
}

fn summarize(v: &[String]) -> String {
    if v.len() <= 4 {
        v.join(", ")
    } else {
        format!("{}, ... ({} more)", v[..3].join(", "), v.len() - 3)
    }
}

fn probe_layout(path: &Path, h: &Header, flags: &[u8], mixed: Option<&[WType]>) -> Result<Layout> {
    let probe = new_writer(std::io::sink(), h, flags, mixed)
        .map_err(|e| ConvertError::write(path, path, e))?;
    Ok(probe.layout().clone())
}

/// The storage type of every matrix (array order): a `--types` rule's type (the
/// tensor's blocks copied when they already are of it, else requantized), else its
/// GGUF type when Krafla has it (and, for Qwen3.5's ssm_out, whole blocks move with the
/// value heads), else the `--requantize` type (Q8_0 in the `--q8` classes of a Q4_0
/// target, and lb/la of a Q4_0 or block-type target, as for a checkpoint). Rows that are not whole super-blocks fall back later ([`fall_back`]).
fn matrix_types_of(
    path: &Path,
    v: &GgufView,
    ga: &GgufArch,
    probe: &Layout,
    opts: &ConvertOptions,
    lin_v_dim: usize,
) -> Result<Vec<WType>> {
    opts.types
        .check_names(&probe.tensors)
        .map_err(|m| ConvertError::options("--types", m))?;
    let req = opts.requantize;
    let user_mask = q8_mask(opts);
    let mut types = Vec::new();
    for t in &probe.tensors {
        let Kind::Mat { class, .. } = t.kind else {
            continue;
        };
        // [`sources`] copies a tensor whose type is the array's, else requantizes it.
        if let Some(w) = opts.types.rule_for(t) {
            types.push(w);
            continue;
        }
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
                            "{}: Krafla stores F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS, MXFP4, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S and IQ1_M matrices as they are, not this type",
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
                // lb and la (class 0) stay Q8_0 under a block type, as a checkpoint's do.
                match class == 0 && is_block_type(r) {
                    true => WType::Q8_0,
                    false => crate::format::mlb::layout::class_wtype(r.code(), user_mask, class),
                }
            }
        };
        types.push(ty);
    }
    Ok(types)
}

/// `--q8`'s classes: Q8_0 in a `--requantize q4_0` (default the classifier).
fn q8_mask(opts: &ConvertOptions) -> u32 {
    opts.q8_mask.unwrap_or(match opts.requantize {
        Some(WType::Q4_0) => DEFAULT_Q4_Q8_MASK,
        _ => 0,
    })
}

/// The header's `wtype` and `q8_mask` for the matrices' `types`, and the type table
/// when no uniform header states these types.
fn header_types(
    probe: &Layout,
    opts: &ConvertOptions,
    types: Vec<WType>,
) -> (u32, u32, Option<Vec<WType>>) {
    let user_mask = q8_mask(opts);
    let uniform =
        |wt: u32, mask: u32| matrix_types(&probe.tensors, wt, mask, &TypePlan::default()) == types;
    for &w in &types {
        let mask = if w == WType::Q4_0 {
            // The classes of the Q8_0 matrices (a shared classifier's tok_emb: the wcls
            // bit, as `--q8 wcls` writes it).
            let mut mask = 0;
            for ((_, _, _, class), &ty) in plan::matrices(&probe.tensors).zip(&types) {
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
            return (w.code(), mask, None);
        }
    }
    (wtype::MIXED, 0, Some(types))
}
