//! `.mlb` (+ its `.mlt`) → a GGUF file llama.cpp loads (`mlb-export`).
//!
//! The inverse of [`super::gguf_in`], so the round trip `.mlb → GGUF → .mlb` gives the
//! same bytes for f16-scale Q8_0/Q4_0 files: the architecture is named from the header
//! (Gemma 3: post norms and q/k norms; Gemma 2: post norms; Qwen2: q/k/v biases; Qwen3:
//! q/k norms; SmolLM3: no-RoPE layers; otherwise Llama), its fields become llama.cpp's
//! keys, tensors get llama.cpp's names and, for NEOX architectures, Hugging Face's
//! rotate-half row order back. Q8_0/Q4_0 matrices become GGUF blocks (f16 scale, then
//! the quants), F32 arrays stay F32; Llama 3 RoPE becomes llama.cpp's `rope_freqs`
//! factors. What llama.cpp cannot run as the header says (a sliding window on a Llama,
//! an attention scale llama.cpp would compute differently, f32 scales that f16 cannot
//! hold, ...) is refused by field name rather than written wrong.

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use super::error::{ConvertError, Result};
use super::gguf_arch::{self, GgufArch, NoRope, RopeRows, Swa, Transform};
use super::gguf_in::llama3_factors;
use super::gguf_tok;
use crate::atomic::AtomicFile;
use crate::format::gguf::{GgmlType, GgufWriter, MetaValue, TensorSpec, ValueType};
use crate::format::mlb::header::{act, layer_flag, rope_type};
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

/// The GGUF architecture an `.mlb` header describes.
fn arch_of(m: &Mlb) -> &'static GgufArch {
    let h = m.header();
    let flags: Vec<u8> = (0..m.dims().n_layers).map(|l| m.layer_flags(l)).collect();
    let name = if h.attn_gate != 0 || h.lin_k_heads != 0 {
        "qwen3_5_text"
    } else if h.post_norms != 0 && h.qk_norm != 0 {
        "gemma3_text"
    } else if h.post_norms != 0 {
        "gemma2"
    } else if h.qkv_bias != 0 {
        "qwen2"
    } else if h.qk_norm != 0 {
        "qwen3"
    } else if flags.iter().any(|f| f & layer_flag::NO_ROPE != 0) {
        "smollm3"
    } else {
        "llama"
    };
    gguf_arch::by_krafla(name).expect("in the table")
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
    let h = *m.header();
    let d = *m.dims();
    let ga = arch_of(&m);
    let a = ga.name;
    let key = |k: &str| format!("{a}.{k}");
    let flags: Vec<u8> = (0..d.n_layers).map(|l| m.layer_flags(l)).collect();

    // What llama.cpp computes on its own must be what the header says.
    let qwen35 = a == "qwen35";
    if h.rot_dim != 0 && h.rot_dim as usize != d.head_dim && !qwen35 {
        return Err(field(
            input,
            "rot_dim",
            h.rot_dim,
            format!("partial rotary cannot be expressed for {a}"),
        ));
    }
    if qwen35 && h.attn_gate == 0 {
        return Err(field(
            input,
            "attn_gate",
            0,
            "llama.cpp's qwen35 gates every attention layer",
        ));
    }
    if qwen35 && h.lin_k_heads != 0 && h.lin_k_dim != h.lin_v_dim {
        return Err(field(
            input,
            "lin_v_dim",
            h.lin_v_dim,
            format!(
                "llama.cpp's qwen35 has value heads of the key head size ({})",
                h.lin_k_dim
            ),
        ));
    }
    let gemma = ga.swa != Swa::None;
    if gemma {
        if h.act != act::GELU_TANH {
            return Err(field(input, "act", h.act, format!("{a} uses GELU (tanh)")));
        }
        if h.embed_scale != (d.dim as f32).sqrt() {
            return Err(field(
                input,
                "embed_scale",
                h.embed_scale,
                format!(
                    "llama.cpp's {a} scales embeddings by sqrt(dim) = {}",
                    (d.dim as f32).sqrt()
                ),
            ));
        }
        let big = (ga.swa == Swa::Gemma2 && d.n_layers == 46)
            || (ga.swa == Swa::Gemma3 && d.n_layers == 62);
        let hd = if big { d.dim / d.n_heads } else { d.head_dim };
        let want = (1.0 / (hd as f64).sqrt()) as f32;
        if h.attn_scale != want {
            return Err(field(
                input,
                "attn_scale",
                h.attn_scale,
                format!("llama.cpp's {a} computes 1/sqrt({hd}) = {want}"),
            ));
        }
        if ga.swa == Swa::Gemma3 && h.attn_softcap != 0.0 {
            return Err(field(
                input,
                "attn_softcap",
                h.attn_softcap,
                "llama.cpp's gemma3 has no attention softcap",
            ));
        }
    } else {
        for (f, v) in [
            ("embed_scale", h.embed_scale),
            ("attn_softcap", h.attn_softcap),
            ("final_softcap", h.final_softcap),
        ] {
            if v != 0.0 && !(f == "embed_scale" && v == 1.0) {
                return Err(field(
                    input,
                    f,
                    v,
                    format!("llama.cpp's {a} has no such factor"),
                ));
            }
        }
        if h.attn_scale != 0.0 && h.attn_scale != (1.0 / (d.head_dim as f64).sqrt()) as f32 {
            return Err(field(
                input,
                "attn_scale",
                h.attn_scale,
                format!("llama.cpp's {a} uses 1/sqrt(head_dim)"),
            ));
        }
        if h.act != act::SILU {
            return Err(field(input, "act", h.act, format!("{a} uses SiLU")));
        }
        if flags.iter().any(|f| f & layer_flag::SLIDING != 0)
            || (h.sliding_window != 0 && h.layer_flags == 0)
        {
            return Err(field(
                input,
                "sliding_window",
                h.sliding_window,
                format!("llama.cpp's {a} has no sliding window"),
            ));
        }
        if h.qk_norm != 0 && !matches!(a, "qwen3" | "qwen35") {
            return Err(field(
                input,
                "qk_norm",
                1,
                format!("llama.cpp's {a} has no q/k norm"),
            ));
        }
    }
    for (l, &f) in flags.iter().enumerate() {
        let want_no_rope = ga.no_rope == NoRope::Every4th && (l + 1) % 4 == 0;
        if (f & layer_flag::NO_ROPE != 0) != want_no_rope {
            return Err(field(
                input,
                &format!("layer_flags[{l}]"),
                f,
                format!("llama.cpp's {a} has no RoPE exactly on every fourth layer"),
            ));
        }
    }

    // The header stores a partial rotary's base as θ^(head_dim/rot_dim) (the spec's
    // exponent); llama.cpp's is θ itself. Refused when it would not read back the same.
    let rope_base = if d.rot_dim < d.head_dim {
        let t = (h.rope_theta as f64).powf(d.rot_dim as f64 / d.head_dim as f64) as f32;
        if ((t as f64).powf(d.head_dim as f64 / d.rot_dim as f64) as f32) != h.rope_theta {
            return Err(field(
                input,
                "rope_theta",
                h.rope_theta,
                format!("not θ^({}/{}) of an f32 θ", d.head_dim, d.rot_dim),
            ));
        }
        t
    } else {
        h.rope_theta
    };

    // Metadata.
    let mut kv: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        (
            "general.name".into(),
            MetaValue::Str(opts.name.clone().unwrap_or_else(|| {
                input
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })),
        ),
        (key("block_count"), MetaValue::U32(h.n_layers)),
        (key("context_length"), MetaValue::U32(h.max_seq)),
        (key("embedding_length"), MetaValue::U32(h.dim)),
        (key("feed_forward_length"), MetaValue::U32(h.hidden_dim)),
        (key("attention.head_count"), MetaValue::U32(h.n_heads)),
        (key("attention.head_count_kv"), MetaValue::U32(h.n_kv_heads)),
        (key("rope.freq_base"), MetaValue::F32(rope_base)),
        (
            key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(h.norm_eps),
        ),
        (
            key("attention.key_length"),
            MetaValue::U32(d.head_dim as u32),
        ),
        (
            key("attention.value_length"),
            MetaValue::U32(d.head_dim as u32),
        ),
        (
            key("rope.dimension_count"),
            MetaValue::U32(d.rot_dim as u32),
        ),
        (key("vocab_size"), MetaValue::U32(h.vocab)),
    ];
    let mut rope_freqs = None;
    match h.rope_type {
        rope_type::PLAIN => {}
        rope_type::LINEAR => {
            kv.push((key("rope.scaling.type"), MetaValue::Str("linear".into())));
            kv.push((key("rope.scaling.factor"), MetaValue::F32(h.rope_factor)));
        }
        rope_type::YARN => {
            if h.rope_low_freq_factor != 32.0 || h.rope_high_freq_factor != 1.0 {
                return Err(field(input, "rope_low_freq_factor", h.rope_low_freq_factor, format!("llama.cpp's {a} uses yarn's beta_fast 32 and beta_slow 1 (this file: {} and {})", h.rope_low_freq_factor, h.rope_high_freq_factor)));
            }
            let f = h.rope_factor as f64;
            let mscale = if f <= 1.0 { 1.0 } else { 0.1 * f.ln() + 1.0 };
            // llama.cpp multiplies get_mscale(f) by rope.scaling.attn_factor (default 1).
            let attn = (h.rope_attn_factor as f64 / mscale) as f32;
            if (mscale * attn as f64) as f32 != h.rope_attn_factor {
                return Err(field(
                    input,
                    "rope_attn_factor",
                    h.rope_attn_factor,
                    "not expressible as llama.cpp's yarn attention factor",
                ));
            }
            kv.push((key("rope.scaling.type"), MetaValue::Str("yarn".into())));
            kv.push((key("rope.scaling.factor"), MetaValue::F32(h.rope_factor)));
            kv.push((
                key("rope.scaling.original_context_length"),
                MetaValue::U32(h.rope_orig_max_seq),
            ));
            if attn != 1.0 {
                kv.push((key("rope.scaling.attn_factor"), MetaValue::F32(attn)));
            }
        }
        rope_type::LLAMA3 => {
            if ga.rows != RopeRows::Interleaved || gemma {
                return Err(field(
                    input,
                    "rope_type",
                    "llama3",
                    format!("llama.cpp's {a} takes no frequency factors"),
                ));
            }
            // llama.cpp's converter: divisor per pair of the head (generate_extra_tensors).
            let factors = llama3_factors(
                h.rope_theta as f64,
                d.head_dim,
                h.rope_factor as f64,
                h.rope_low_freq_factor as f64,
                h.rope_high_freq_factor as f64,
                h.rope_orig_max_seq as f64,
            );
            kv.push((
                key("rope.scaling.original_context_length"),
                MetaValue::U32(h.rope_orig_max_seq),
            ));
            rope_freqs = Some(factors);
        }
        t => return Err(field(input, "rope_type", t, "unknown")),
    }
    if gemma {
        let sliding: Vec<bool> = flags.iter().map(|f| f & layer_flag::SLIDING != 0).collect();
        let local: Vec<bool> = flags
            .iter()
            .map(|f| f & layer_flag::LOCAL_ROPE != 0)
            .collect();
        if ga.swa == Swa::Gemma2 {
            kv.push((
                key("attn_logit_softcapping"),
                MetaValue::F32(h.attn_softcap),
            ));
        }
        kv.push((
            key("final_logit_softcapping"),
            MetaValue::F32(h.final_softcap),
        ));
        let window = if h.layer_flags == 0 && h.sliding_window != 0 {
            // A window on every layer.
            vec![true; d.n_layers]
        } else {
            sliding.clone()
        };
        let any = window.iter().any(|&s| s) && h.sliding_window != 0;
        if any {
            kv.push((
                key("attention.sliding_window"),
                MetaValue::U32(h.sliding_window),
            ));
            kv.push((
                key("attention.sliding_window_pattern"),
                MetaValue::Array(
                    ValueType::Bool,
                    window.iter().map(|&b| MetaValue::Bool(b)).collect(),
                ),
            ));
        } else if ga.swa == Swa::Gemma2 {
            // llama.cpp's Gemma 2 always has a window: make it cover no layer.
            kv.push((
                key("attention.sliding_window_pattern"),
                MetaValue::Array(ValueType::Bool, vec![MetaValue::Bool(false); d.n_layers]),
            ));
        }
        // The sliding layers, and only they, use the local base.
        let uses_local = local.iter().any(|&l| l);
        if uses_local && (local != window || !any) {
            return Err(field(
                input,
                "layer_flags",
                format!("{flags:?}"),
                format!("llama.cpp's {a} uses the local RoPE base on exactly the sliding layers"),
            ));
        }
        match (ga.swa, uses_local) {
            (_, true) => kv.push((
                key("rope.freq_base_swa"),
                MetaValue::F32(h.rope_local_theta),
            )),
            (Swa::Gemma3, false) if any => {
                return Err(field(
                    input,
                    "rope_local_theta",
                    h.rope_local_theta,
                    "llama.cpp's gemma3 sliding layers use a local RoPE base",
                ));
            }
            _ => {}
        }
        if ga.swa == Swa::Gemma3
            && uses_local
            && h.rope_type != rope_type::PLAIN
            && h.rope_type != rope_type::LINEAR
        {
            return Err(field(
                input,
                "rope_type",
                h.rope_type,
                "gemma3: only linear scaling of the global layers",
            ));
        }
    }
    if qwen35 {
        // Interleaved multimodal RoPE: three near-equal sections cover every rotated
        // pair (llama.cpp's default [11, 11, 10] for 32 pairs); text positions are equal.
        let n = d.rot_dim as i32 / 2;
        let a0 = (n + 2) / 3;
        let b0 = (n - a0 + 1) / 2;
        kv.push((
            key("rope.dimension_sections"),
            MetaValue::Array(
                ValueType::I32,
                [a0, b0, n - a0 - b0, 0]
                    .into_iter()
                    .map(MetaValue::I32)
                    .collect(),
            ),
        ));
        let lin: Vec<bool> = flags.iter().map(|f| f & layer_flag::LINEAR != 0).collect();
        kv.push((
            key("attention.recurrent_layers"),
            MetaValue::Array(
                ValueType::Bool,
                lin.iter().map(|&b| MetaValue::Bool(b)).collect(),
            ),
        ));
        if h.lin_k_heads != 0 {
            kv.push((key("ssm.conv_kernel"), MetaValue::U32(h.lin_conv)));
            kv.push((key("ssm.state_size"), MetaValue::U32(h.lin_k_dim)));
            kv.push((key("ssm.group_count"), MetaValue::U32(h.lin_k_heads)));
            kv.push((key("ssm.time_step_rank"), MetaValue::U32(h.lin_v_heads)));
            kv.push((
                key("ssm.inner_size"),
                MetaValue::U32(h.lin_v_heads * h.lin_v_dim),
            ));
        }
    }
    let ftype = file_type(&m);
    kv.push(("general.file_type".into(), MetaValue::U32(ftype)));
    kv.push(("general.quantization_version".into(), MetaValue::U32(2)));
    let tok = gguf_tok::gguf_tokenizer_kvs(&mlt, a)
        .map_err(|e| ConvertError::checkpoint(&tok_path, e.to_string()))?;
    if mlt.tokens.len() > d.vocab {
        return Err(ConvertError::checkpoint(
            &tok_path,
            format!(
                "{} tokens for a model of {} rows",
                mlt.tokens.len(),
                d.vocab
            ),
        ));
    }
    for (k, v) in tok {
        // llama.cpp wants one token per embedding row: pad as convert_hf_to_gguf.py does.
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", MetaValue::Array(t, mut items)) => {
                for i in items.len()..d.vocab {
                    items.push(MetaValue::Str(format!("[PAD{i}]")));
                }
                MetaValue::Array(t, items)
            }
            ("tokenizer.ggml.token_type", MetaValue::Array(t, mut items)) => {
                items.resize(d.vocab, MetaValue::I32(5));
                MetaValue::Array(t, items)
            }
            ("tokenizer.ggml.scores", MetaValue::Array(t, mut items)) => {
                items.resize(d.vocab, MetaValue::F32(-1000.0));
                MetaValue::Array(t, items)
            }
            (_, v) => v,
        };
        kv.push((k, v));
    }

    // Tensors: each GGUF tensor gathers its rows from one or more .mlb arrays (the
    // inverse of the import's gathers; Qwen3.5's attn_q from wq and wg).
    let g = super::gguf_arch::Geometry {
        head_dim: d.head_dim,
        rot_dim: d.rot_dim,
        neox: ga.rows == RopeRows::RotateHalf,
        k_heads: (h.lin_k_heads as usize).max(1),
        per_k: h.lin_v_heads.checked_div(h.lin_k_heads).unwrap_or(1) as usize,
        v_dim: (h.lin_v_dim as usize).max(1),
        qk_rows: 2 * h.lin_k_heads as usize * h.lin_k_dim as usize,
    };
    let layout = m.layout();
    let mut outs: Vec<Out> = Vec::new();
    if let Some(f) = &rope_freqs {
        outs.push(Out {
            spec: TensorSpec::vector("rope_freqs.weight", f.len() as u64, GgmlType::F32),
            fill: Vec::new(),
            row_len: f.len(),
            mat: None,
            col_blocks: None,
            neg_exp: false,
        });
    }
    for (idx, t) in layout.tensors.iter().enumerate() {
        let (name, tr) = match t.kind {
            Kind::U8 { .. } => continue,
            _ => ga.tensor_name(t.name.name, t.name.layer).ok_or_else(|| {
                field(
                    input,
                    &t.name.to_string(),
                    "",
                    format!("no {a} tensor for it"),
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
                (len / h.lin_conv as usize, h.lin_conv as usize, None)
            }
            (Kind::F32 { len }, _) => (len, 1, None),
            (Kind::U8 { .. }, _) => unreachable!(),
        };
        let g_rows = tr.src_rows(rows);
        let at = match outs.iter().position(|o| o.spec.name == name) {
            Some(i) => i,
            None => {
                let spec = match mat {
                    Some(q) => TensorSpec::matrix(
                        name.clone(),
                        g_rows as u64,
                        row_len as u64,
                        ggml_type(q).ok_or_else(|| {
                            field(
                                input,
                                &t.name.to_string(),
                                q,
                                "llama.cpp has no such type (convert with another --types)",
                            )
                        })?,
                    ),
                    None if row_len > 1 => TensorSpec::matrix(
                        name.clone(),
                        g_rows as u64,
                        row_len as u64,
                        GgmlType::F32,
                    ),
                    None => TensorSpec::vector(name.clone(), g_rows as u64, GgmlType::F32),
                };
                let col_blocks = if tr == Transform::VCols {
                    let bw = mat.map_or(QK, |q| q.block_weights());
                    if mat.is_some() && !g.v_dim.is_multiple_of(bw) {
                        return Err(field(input, &t.name.to_string(), format!("value heads of {}", g.v_dim),
                            format!("llama.cpp's column order moves value heads, which would split the {bw}-value blocks")));
                    }
                    // GGUF block j holds the .mlb block whose first column lands there.
                    let nb = row_len / bw;
                    let mut inv = vec![0usize; nb];
                    for b in 0..nb {
                        inv[tr.src_col(&g, b * bw) / bw] = b;
                    }
                    Some(inv)
                } else {
                    None
                };
                outs.push(Out {
                    spec,
                    fill: vec![(usize::MAX, 0); g_rows],
                    row_len,
                    mat,
                    col_blocks,
                    neg_exp: tr == Transform::NegExpA,
                });
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
        let no_rope = t
            .name
            .layer
            .is_some_and(|l| flags[l as usize] & layer_flag::NO_ROPE != 0);
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
    let specs: Vec<TensorSpec> = outs.iter().map(|o| o.spec.clone()).collect();

    let out = opts
        .output
        .clone()
        .unwrap_or_else(|| input.with_extension("gguf"));
    crate::atomic::check_not_input(&out, &[input, tok_path.as_path()])
        .map_err(|e| ConvertError::options("-o", format!("{}: {e}", out.display())))?;
    let mut file = AtomicFile::create(&out).map_err(|e| ConvertError::io(&out, e))?;
    let werr = |e| ConvertError::write(&out, &out, e);
    {
        let mut w = GgufWriter::new(BufWriter::with_capacity(1 << 20, &mut file), &kv, specs)
            .map_err(werr)?;
        let mut buf = Vec::new();
        for o in &outs {
            if o.fill.is_empty() {
                let f = rope_freqs.as_ref().expect("rope_freqs planned");
                let b: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.write_data(&b).map_err(werr)?;
                continue;
            }
            for &(idx, r) in &o.fill {
                buf.clear();
                let t = &layout.tensors[idx];
                match o.mat {
                    None => {
                        let x = &m.f32s(idx)[r * o.row_len..(r + 1) * o.row_len];
                        for &v in x {
                            let v = if o.neg_exp { neg_exp(v) } else { v };
                            buf.extend_from_slice(&v.to_le_bytes());
                        }
                    }
                    Some(wtype) if !wtype.has_scales() => {
                        // GGUF's own blocks (or 2-byte floats): the same bytes.
                        let mat = m.mat(idx);
                        let qb = wtype.block_bytes();
                        let nb = mat.cols / wtype.block_weights();
                        let row = &mat.q[r * nb * qb..(r + 1) * nb * qb];
                        for j in 0..nb {
                            let b = o.col_blocks.as_ref().map_or(j, |cb| cb[j]);
                            buf.extend_from_slice(&row[b * qb..(b + 1) * qb]);
                        }
                    }
                    Some(wtype) => {
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
                                    let x = m.mat(idx).d[r * nb + b];
                                    let hb = half::f16::from_f32(x);
                                    if hb.to_f32() != x {
                                        return Err(ConvertError::tensor(
                                            input,
                                            t.name.to_string(),
                                            format!("row {r} block {b}: scale {x} is not an f16 (GGUF blocks hold f16 scales): convert with --f16-scales"),
                                        ));
                                    }
                                    hb.to_bits()
                                }
                            };
                            buf.extend_from_slice(&bits.to_le_bytes());
                            buf.extend_from_slice(&q[r * qrow + b * qb..r * qrow + (b + 1) * qb]);
                        }
                    }
                }
                w.write_data(&buf).map_err(werr)?;
            }
        }
        w.finish()
            .map_err(werr)?
            .into_inner()
            .map_err(|e| ConvertError::io(&out, e.into_error()))?;
    }
    file.commit().map_err(|e| ConvertError::io(&out, e))?;
    Ok(ExportSummary {
        output: out.clone(),
        arch: a,
        tensors: outs.len(),
        file_bytes: std::fs::metadata(&out).map(|x| x.len()).unwrap_or(0),
    })
}

/// The GGUF type of an `.mlb` matrix type (Krafla's Q6_0 has none).
pub fn ggml_type(w: WType) -> Option<GgmlType> {
    Some(match w {
        WType::Q8_0 => GgmlType::Q8_0,
        WType::Q4_0 => GgmlType::Q4_0,
        WType::F16 => GgmlType::F16,
        WType::BF16 => GgmlType::BF16,
        WType::Q4_K => GgmlType::Q4_K,
        WType::Q5_K => GgmlType::Q5_K,
        WType::Q6_K => GgmlType::Q6_K,
        WType::Q4_1 => GgmlType::Q4_1,
        WType::Q5_0 => GgmlType::Q5_0,
        WType::Q5_1 => GgmlType::Q5_1,
        WType::IQ4_NL => GgmlType::IQ4_NL,
        WType::Q6_0 => return None,
        WType::MXFP4 => GgmlType::MXFP4,
        WType::Q2_K => GgmlType::Q2_K,
        WType::Q3_K => GgmlType::Q3_K,
        WType::IQ4_XS => GgmlType::IQ4_XS,
    })
}

/// `general.file_type` (llama.cpp's `llama_ftype`, informational): the type of the most
/// matrices (the first of them on a tie).
fn file_type(m: &Mlb) -> u32 {
    let mut count: Vec<(WType, usize)> = Vec::new();
    for t in &m.layout().tensors {
        if let Kind::Mat { wtype, .. } = t.kind {
            match count.iter_mut().find(|(w, _)| *w == wtype) {
                Some(c) => c.1 += 1,
                None => count.push((wtype, 1)),
            }
        }
    }
    let most = count
        .iter()
        .fold(None::<(WType, usize)>, |b, &(w, n)| match b {
            Some((_, bn)) if bn >= n => b,
            _ => Some((w, n)),
        })
        .map_or(WType::Q8_0, |(w, _)| w);
    match most {
        WType::Q8_0 => 7,
        WType::Q4_0 => 2,
        WType::F16 => 1,
        WType::BF16 => 32,
        WType::Q4_1 => 3,
        WType::Q5_0 => 8,
        WType::Q5_1 => 9,
        WType::Q4_K => 14,
        WType::Q5_K => 16,
        WType::Q6_K => 18,
        WType::IQ4_NL => 25,
        WType::Q6_0 => 7,
        // MOSTLY_MXFP4_MOE, MOSTLY_Q2_K, MOSTLY_Q3_K_S, MOSTLY_IQ4_XS.
        WType::MXFP4 => 38,
        WType::Q2_K => 10,
        WType::Q3_K => 11,
        WType::IQ4_XS => 30,
    }
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
