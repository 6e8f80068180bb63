//! `.mlb` (+ its `.mlt`) → a GGUF file llama.cpp loads (`mlb-export`).
//!
//! The inverse of [`super::import`], so the round trip `.mlb → GGUF → .mlb` gives the
//! same bytes for f16-scale Q8_0/Q4_0 files. The header is read back into the model
//! description ([`ModelDesc::from_header`], checked as every reader's is); the
//! architecture is the most specific one whose features the header has
//! ([`arch::by_features`]: attention sinks → gpt-oss, an attention gate → qwen35, post
//! norms and q/k norms → gemma3, post norms → gemma2, q/k/v biases → qwen2, q/k norms →
//! qwen3, no-RoPE layers → smollm3, otherwise llama; with experts the MoE rows); the
//! description becomes llama.cpp's keys
//! ([`super::keys`]), the tokenizer its `tokenizer.*` keys, tensors get llama.cpp's
//! names and, for NEOX architectures, Hugging Face's rotate-half row order back.
//! Q8_0/Q4_0 matrices become GGUF blocks (f16 scale, then the quants), other types'
//! blocks stay as they are, F32 arrays stay F32; Llama 3 RoPE becomes llama.cpp's
//! `rope_freqs` factors. What llama.cpp cannot run as the header says (a sliding window
//! on a Llama, an attention scale llama.cpp would compute differently, f32 scales that
//! f16 cannot hold, ...) is refused by field name rather than written wrong.

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use super::arch::{self, Features, GgufArch, Transform};
use super::keys::{any_no_rope, Keys};
use super::tokenizer;
use super::types::{file_type, ggml_type};
use crate::atomic::AtomicFile;
use crate::convert::desc::ModelDesc;
use crate::convert::error::{ConvertError, DescField, Result};
use crate::format::gguf::{GgmlType, GgufWriter, MetaValue, TensorSpec};
use crate::format::mlb::header::qk_norm;
use crate::format::mlb::{Kind, Mlb, WType};
use crate::format::mlt::Mlt;
use crate::quant::QK;

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub input: PathBuf,
    /// The tokenizer; `None`: the `.mlt` of the same name beside the model.
    pub tokenizer: Option<PathBuf>,
    /// `None`: `<stem>.gguf` beside the model.
    pub output: Option<PathBuf>,
    /// `general.name`; `None`: the file's stem.
    pub name: Option<String>,
}

/// One GGUF tensor: the (.mlb array, row) of each of its rows.
struct Out {
    spec: TensorSpec,
    /// Empty for rope_freqs.
    fill: Vec<(usize, usize)>,
    row_len: usize,
    mat: Option<WType>,
    /// ssm_out: the .mlb block of each GGUF block of a row.
    col_blocks: Option<Vec<usize>>,
    /// ssm_a = −exp(A_log).
    neg_exp: bool,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    pub output: PathBuf,
    pub arch: &'static str,
    pub tensors: usize,
    pub file_bytes: u64,
}

fn field(input: &Path, f: &str, v: impl std::fmt::Display, msg: impl Into<String>) -> ConvertError {
    ConvertError::config(input, f, v, msg)
}

/// Exports `opts.input`.
pub fn export(opts: &ExportOptions) -> Result<ExportSummary> {
    let input = &opts.input;
    let m = Mlb::open(input).map_err(|e| ConvertError::Format {
        file: input.clone(),
        err: Box::new(e),
    })?;
    let tok_path = opts
        .tokenizer
        .clone()
        .unwrap_or_else(|| input.with_extension("mlt"));
    let mlt = Mlt::load(&tok_path).map_err(|e| {
        ConvertError::checkpoint(
            &tok_path,
            format!("{e} (the tokenizer is needed: pass --tokenizer FILE.mlt)"),
        )
    })?;
    let flags: Vec<u8> = (0..m.dims().n_layers).map(|l| m.layer_flags(l)).collect();
    let (ga, desc) = describe(input, &m, &flags)?;
    let mut keys = Keys {
        input,
        ga,
        desc: &desc,
        header: m.header(),
        flags: &flags,
        kv: Vec::new(),
    };
    keys.llama_cpp_computes()?;
    keys.general(opts.name.clone().unwrap_or_else(|| {
        input
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }));
    keys.dims()?;
    let rope_freqs = keys.rope()?;
    keys.scales();
    keys.window()?;
    keys.linear();
    keys.experts()?;
    let mut kv = keys.kv;
    kv.push(("general.file_type".into(), MetaValue::U32(file_type(&m))));
    kv.push(("general.quantization_version".into(), MetaValue::U32(2)));
    kv.extend(tokenizer_kvs(&mlt, &tok_path, ga.name, desc.vocab.size)?);
    let outs = plan(input, ga, &desc, &m, rope_freqs.as_ref())?;

    let out = opts
        .output
        .clone()
        .unwrap_or_else(|| input.with_extension("gguf"));
    crate::atomic::check_not_input(&out, &[input, tok_path.as_path()])
        .map_err(|e| ConvertError::options("-o", format!("{}: {e}", out.display())))?;
    let mut file = AtomicFile::create(&out).map_err(|e| ConvertError::io(&out, e))?;
    write(
        input,
        &out,
        &mut file,
        &kv,
        &outs,
        &m,
        rope_freqs.as_deref(),
    )?;
    file.commit().map_err(|e| ConvertError::io(&out, e))?;
    Ok(ExportSummary {
        output: out.clone(),
        arch: ga.name,
        tensors: outs.len(),
        file_bytes: std::fs::metadata(&out).map(|x| x.len()).unwrap_or(0),
    })
}

/// The GGUF architecture of `m` (with its layer flag bytes `flags`) and the
/// description its header gives, checked as every reader's.
fn describe(input: &Path, m: &Mlb, flags: &[u8]) -> Result<(&'static GgufArch, ModelDesc)> {
    let h = m.header();
    let ga = arch::by_features(Features {
        gated: h.attn_gate != 0 || h.lin_k_heads != 0,
        post_norms: h.post_norms != 0,
        qk_norm: h.qk_norm != 0,
        qkv_bias: h.qkv_bias != 0,
        no_rope: any_no_rope(flags),
        experts: h.n_experts != 0,
        qk_norm_whole: h.qk_norm == qk_norm::WHOLE,
        sinks: h.attn_sinks != 0,
    });
    let desc = ModelDesc::from_header(ga.arch, h, m.dims(), flags);
    desc.check().map_err(|e| {
        let key = match e.field {
            DescField::RotDim => "rot_dim",
            DescField::RopeScaling => "rope_type",
            DescField::Act => "act",
            DescField::SlidingWindow => "sliding_window",
            DescField::Layers => "layer_flags",
            DescField::Experts => "n_experts",
            DescField::ExpertsUsed => "n_experts_used",
            DescField::ExpertHidden => "expert_hidden",
            DescField::SharedHidden => "shared_hidden",
        };
        e.at(input, key, None)
    })?;
    Ok((ga, desc))
}

/// The `tokenizer.*` keys of `mlt` (read from `path`), one token per embedding row:
/// padded as convert_hf_to_gguf.py pads, as llama.cpp wants.
fn tokenizer_kvs(
    mlt: &Mlt,
    path: &Path,
    arch: &str,
    vocab: usize,
) -> Result<Vec<(String, MetaValue)>> {
    let tok = tokenizer::gguf_tokenizer_kvs(mlt, arch)
        .map_err(|e| ConvertError::checkpoint(path, e.to_string()))?;
    if mlt.tokens.len() > vocab {
        return Err(ConvertError::checkpoint(
            path,
            format!("{} tokens for a model of {vocab} rows", mlt.tokens.len()),
        ));
    }
    let pad = |k: &str, v: MetaValue| match (k, v) {
        ("tokenizer.ggml.tokens", MetaValue::Array(t, mut items)) => {
            for i in items.len()..vocab {
                items.push(MetaValue::Str(format!("[PAD{i}]")));
            }
            MetaValue::Array(t, items)
        }
        ("tokenizer.ggml.token_type", MetaValue::Array(t, mut items)) => {
            items.resize(vocab, MetaValue::I32(5));
            MetaValue::Array(t, items)
        }
        ("tokenizer.ggml.scores", MetaValue::Array(t, mut items)) => {
            items.resize(vocab, MetaValue::F32(-1000.0));
            MetaValue::Array(t, items)
        }
        (_, v) => v,
    };
    Ok(tok
        .into_iter()
        .map(|(k, v)| {
            let v = pad(&k, v);
            (k, v)
        })
        .collect())
}

/// The GGUF tensors: each gathers its rows from one or more `.mlb` arrays (the inverse
/// of the import's gathers; Qwen3.5's attn_q from wq and wg), after `rope_freqs`.
fn plan(
    input: &Path,
    ga: &GgufArch,
    d: &ModelDesc,
    m: &Mlb,
    rope_freqs: Option<&Vec<f32>>,
) -> Result<Vec<Out>> {
    let g = arch::Geometry::of(d, ga);
    let mut outs: Vec<Out> = Vec::new();
    if let Some(f) = rope_freqs {
        outs.push(Out {
            spec: TensorSpec::vector("rope_freqs.weight", f.len() as u64, GgmlType::F32),
            fill: Vec::new(),
            row_len: f.len(),
            mat: None,
            col_blocks: None,
            neg_exp: false,
        });
    }
    for (idx, t) in m.layout().tensors.iter().enumerate() {
        let (name, tr) = match t.kind {
            Kind::U8 { .. } => continue,
            _ => ga.tensor_name(t.name.name, t.name.layer).ok_or_else(|| {
                field(
                    input,
                    &t.name.to_string(),
                    "",
                    format!("no {} tensor for it", ga.name),
                )
            })?,
        };
        let (rows, row_len, mat) = match (t.kind, tr) {
            (
                Kind::Mat {
                    wtype, rows, cols, ..
                },
                _,
            ) => (rows, cols, Some(wtype)),
            (Kind::F32 { len }, Transform::VConv) => {
                let conv = d.linear.map_or(0, |l| l.conv);
                (len / conv, conv, None)
            }
            (Kind::F32 { len }, _) => (len, 1, None),
            (Kind::U8 { .. }, _) => unreachable!(),
        };
        let g_rows = tr.src_rows(rows);
        let at = match outs.iter().position(|o| o.spec.name == name) {
            Some(i) => i,
            None => {
                let what = t.name.to_string();
                let mut o = new_out(input, &what, name.clone(), tr, &g, g_rows, row_len, mat)?;
                // The experts' stacks and routers are 3-D and 2-D in llama.cpp.
                let n_experts = d.moe.map_or(1, |e| e.n_experts);
                if let Some(dims) = tr.dims(rows, row_len, n_experts) {
                    o.spec.dims = dims;
                }
                outs.push(o);
                outs.len() - 1
            }
        };
        let o = &mut outs[at];
        if o.mat != mat || o.row_len != row_len || o.fill.len() != g_rows {
            return Err(field(
                input,
                &t.name.to_string(),
                "",
                format!("does not fit {name} beside the arrays already in it"),
            ));
        }
        let no_rope = t.name.layer.is_some_and(|l| d.layers[l as usize].no_rope);
        for r in 0..rows {
            o.fill[tr.src_row_in(&g, r, no_rope)] = (idx, r);
        }
    }
    if let Some(o) = outs
        .iter()
        .find(|o| o.fill.iter().any(|&(i, _)| i == usize::MAX))
    {
        return Err(field(input, &o.spec.name, "", "not every row has a source"));
    }
    Ok(outs)
}

/// GGUF tensor `name` of `g_rows` rows of `row_len`, first met as `.mlb` array `what`
/// (a matrix of type `mat`, or floats) through `tr`: its type, and for ssm_out the
/// `.mlb` block of each GGUF block (whole blocks only).
#[allow(clippy::too_many_arguments)]
fn new_out(
    input: &Path,
    what: &str,
    name: String,
    tr: Transform,
    g: &arch::Geometry,
    g_rows: usize,
    row_len: usize,
    mat: Option<WType>,
) -> Result<Out> {
    let spec = match mat {
        Some(q) => TensorSpec::matrix(
            name,
            g_rows as u64,
            row_len as u64,
            ggml_type(q).ok_or_else(|| {
                field(
                    input,
                    what,
                    q,
                    "llama.cpp has no such type (convert with another --types)",
                )
            })?,
        ),
        None if row_len > 1 => {
            TensorSpec::matrix(name, g_rows as u64, row_len as u64, GgmlType::F32)
        }
        None => TensorSpec::vector(name, g_rows as u64, GgmlType::F32),
    };
    let col_blocks = if tr == Transform::VCols {
        let bw = mat.map_or(QK, |q| q.block_weights());
        if mat.is_some() && !g.v_dim.is_multiple_of(bw) {
            return Err(field(
                input,
                what,
                format!("value heads of {}", g.v_dim),
                format!("llama.cpp's column order moves value heads, which would split the {bw}-value blocks"),
            ));
        }
        // GGUF block j holds the .mlb block whose first column lands there.
        let nb = row_len / bw;
        let mut inv = vec![0usize; nb];
        for b in 0..nb {
            inv[tr.src_col(g, b * bw) / bw] = b;
        }
        Some(inv)
    } else {
        None
    };
    Ok(Out {
        spec,
        fill: vec![(usize::MAX, 0); g_rows],
        row_len,
        mat,
        col_blocks,
        neg_exp: tr == Transform::NegExpA,
    })
}

/// Writes the GGUF of metadata `kv` and tensors `outs` (from `m`) to `file`.
fn write(
    input: &Path,
    out: &Path,
    file: &mut AtomicFile,
    kv: &[(String, MetaValue)],
    outs: &[Out],
    m: &Mlb,
    rope_freqs: Option<&[f32]>,
) -> Result<()> {
    let werr = |e| ConvertError::write(out, out, e);
    let specs: Vec<TensorSpec> = outs.iter().map(|o| o.spec.clone()).collect();
    let mut w =
        GgufWriter::new(BufWriter::with_capacity(1 << 20, file), kv, specs).map_err(werr)?;
    let mut buf = Vec::new();
    for o in outs {
        if o.fill.is_empty() {
            let f = rope_freqs.expect("rope_freqs planned");
            let b: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.write_data(&b).map_err(werr)?;
            continue;
        }
        for &(idx, r) in &o.fill {
            buf.clear();
            match o.mat {
                None => float_row(m, o, idx, r, &mut buf),
                Some(wtype) if !wtype.has_scales() => block_row(m, o, wtype, idx, r, &mut buf),
                Some(wtype) => scaled_row(input, m, o, wtype, idx, r, &mut buf)?,
            }
            w.write_data(&buf).map_err(werr)?;
        }
    }
    w.finish()
        .map_err(werr)?
        .into_inner()
        .map_err(|e| ConvertError::io(out, e.into_error()))?;
    Ok(())
}

/// Row `r` of F32 array `idx` (ssm_a: −exp of it).
fn float_row(m: &Mlb, o: &Out, idx: usize, r: usize, buf: &mut Vec<u8>) {
    let x = &m.f32s(idx)[r * o.row_len..(r + 1) * o.row_len];
    for &v in x {
        let v = if o.neg_exp { neg_exp(v) } else { v };
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

/// Row `r` of matrix `idx` whose blocks are GGUF's own (or 2-byte floats): the same
/// bytes, blocks in GGUF's column order.
fn block_row(m: &Mlb, o: &Out, wtype: WType, idx: usize, r: usize, buf: &mut Vec<u8>) {
    let mat = m.mat(idx);
    let qb = wtype.block_bytes();
    let nb = mat.cols / wtype.block_weights();
    let row = &mat.q[r * nb * qb..(r + 1) * nb * qb];
    for j in 0..nb {
        let b = o.col_blocks.as_ref().map_or(j, |cb| cb[j]);
        buf.extend_from_slice(&row[b * qb..(b + 1) * qb]);
    }
}

/// Row `r` of a Q8_0/Q4_0 matrix `idx`: each GGUF block is the f16 scale, then the
/// quants; an f32 scale must be an f16 exactly.
fn scaled_row(
    input: &Path,
    m: &Mlb,
    o: &Out,
    wtype: WType,
    idx: usize,
    r: usize,
    buf: &mut Vec<u8>,
) -> Result<()> {
    let mat = m.mat(idx);
    let (cols, q) = (mat.cols, mat.q);
    let nb = cols / QK;
    let qb = wtype.block_bytes();
    let qrow = nb * qb;
    let f16 = m.mat_f16(idx);
    for j in 0..nb {
        let b = o.col_blocks.as_ref().map_or(j, |cb| cb[j]);
        let bits = match f16 {
            Some(s) => s[r * nb + b],
            None => {
                let x = mat.d[r * nb + b];
                let hb = half::f16::from_f32(x);
                if hb.to_f32() != x {
                    return Err(ConvertError::tensor(
                        input,
                        m.layout().tensors[idx].name.to_string(),
                        format!("row {r} block {b}: scale {x} is not an f16 (GGUF blocks hold f16 scales): convert with --f16-scales"),
                    ));
                }
                hb.to_bits()
            }
        };
        buf.extend_from_slice(&bits.to_le_bytes());
        buf.extend_from_slice(&q[r * qrow + b * qb..r * qrow + (b + 1) * qb]);
    }
    Ok(())
}

/// ssm_a = −exp(A_log), as llama.cpp's converter computes it in f32; of the floats
/// within two ulps of it, the nearest one whose ln(−a) (how the import reads it) is
/// A_log again, so that the round trip keeps A_log's bits where such a float exists.
fn neg_exp(x: f32) -> f32 {
    let a = -x.exp();
    if !a.is_finite() || a == 0.0 {
        return a;
    }
    let back = |a: f32| (-(a as f64)).ln() as f32 == x;
    let exact = -(x as f64).exp();
    let mut best: Option<f32> = None;
    for k in -2i32..=2 {
        let c = f32::from_bits((a.to_bits() as i64 + k as i64) as u32);
        if back(c) && best.is_none_or(|b| (c as f64 - exact).abs() < (b as f64 - exact).abs()) {
            best = Some(c);
        }
    }
    best.unwrap_or(a)
}
