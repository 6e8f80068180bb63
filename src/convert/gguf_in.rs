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

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::arch;
use super::config::{LayerFlags, LinearDims, ModelDesc, RopeScaling};
use super::error::{ConvertError, Result};
use super::gguf_arch::{self, GgufArch, NoRope, RopeRows, Swa, Transform};
use super::DEFAULT_Q4_Q8_MASK;
use super::{for_row_chunks, importance, load_imatrix, Options, Progress, Summary, WType};
use crate::atomic::AtomicFile;
use crate::format::gguf::{self, dequant, Array, GgmlType, GgufView, TensorInfo, Value};
use crate::format::mlb::header::{act, q8_class, wtype, Header};
use crate::format::mlb::validate::SEQ_LIMIT;
use crate::format::mlb::{Kind, Tensor, WriteError};
use crate::quant::{quantize, Q4Rule, QuantOpts, Quantized, Scales};

/// Whether `path` is a GGUF file (by its magic).
pub fn is_gguf_file(path: &Path) -> bool {
    use std::io::Read;
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|_| gguf::is_gguf(&magic))
        .unwrap_or(false)
}

/// `<stem>.mlb` beside the GGUF file.
pub fn default_output(input: &Path) -> PathBuf {
    input.with_extension("mlb")
}

/// Maps a GGUF file read-only.
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let f = File::open(path).map_err(|e| ConvertError::io(path, e))?;
    // SAFETY: a read-only map of an input file that is not expected to change while it
    // is converted (the mmap caveat of every loader, docs/reliability.md).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ConvertError::io(path, e))
}

/// Parses a mapped GGUF file, naming the file in errors.
pub(crate) fn parse_file<'a>(path: &Path, bytes: &'a [u8]) -> Result<GgufView<'a>> {
    gguf::parse(bytes).map_err(|e| ConvertError::checkpoint(path, e.to_string()))
}

/// Reads metadata keys of one architecture, remembering which were read.
pub(crate) struct Meta<'v, 'a> {
    pub v: &'v GgufView<'a>,
    pub file: &'v Path,
    pub arch: &'static str,
    used: RefCell<BTreeSet<String>>,
}

impl<'v, 'a> Meta<'v, 'a> {
    pub fn new(v: &'v GgufView<'a>, file: &'v Path, arch: &'static str) -> Self {
        Meta {
            v,
            file,
            arch,
            used: RefCell::new(BTreeSet::new()),
        }
    }

    pub fn full(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub fn err(
        &self,
        suffix: &str,
        v: impl std::fmt::Display,
        msg: impl Into<String>,
    ) -> ConvertError {
        ConvertError::config(self.file, self.full(suffix), v, msg)
    }

    pub fn get(&self, suffix: &str) -> Option<Value<'a>> {
        let k = self.full(suffix);
        let v = self.v.get(&k).copied();
        self.used.borrow_mut().insert(k);
        v
    }

    /// The value of `suffix` as `read` reads it; one it cannot read is refused with `rule`.
    fn typed<T>(
        &self,
        suffix: &str,
        read: impl FnOnce(Value<'a>) -> Option<T>,
        rule: &str,
    ) -> Result<Option<T>> {
        self.get(suffix)
            .map(|v| read(v).ok_or_else(|| self.err(suffix, v, rule)))
            .transpose()
    }

    pub fn u64_opt(&self, suffix: &str) -> Result<Option<u64>> {
        self.typed(suffix, |v| v.as_u64(), "must be a non-negative integer")
    }

    /// Refuses an integer key that is set to anything but `want` (what the file's
    /// other facts give): `rule` says why.
    pub fn u64_eq(&self, suffix: &str, want: usize, rule: String) -> Result<()> {
        match self.u64_opt(suffix)? {
            Some(x) if x as usize != want => Err(self.err(suffix, x, rule)),
            _ => Ok(()),
        }
    }

    pub fn u64_req(&self, suffix: &str) -> Result<u64> {
        self.u64_opt(suffix)?
            .ok_or_else(|| self.err(suffix, "missing", "required key"))
    }

    pub fn f64_opt(&self, suffix: &str) -> Result<Option<f64>> {
        let finite = |v: Value<'a>| {
            v.as_f64()
                .or_else(|| v.as_i64().map(|i| i as f64))
                .filter(|x| x.is_finite())
        };
        self.typed(suffix, finite, "must be a finite number")
    }

    pub fn str_opt(&self, suffix: &str) -> Result<Option<&'a str>> {
        self.typed(suffix, |v| v.as_str(), "must be a string")
    }

    /// Refuses the array `a` under `suffix` unless it has one entry per layer (`n`);
    /// `what` starts the message.
    fn check_layers(&self, suffix: &str, a: Array<'a>, n: usize, what: &str) -> Result<()> {
        if a.len != n {
            return Err(self.err(
                suffix,
                Value::Array(a),
                format!("{what}must have block_count ({n}) entries"),
            ));
        }
        Ok(())
    }

    /// A per-layer integer: one value, or an array of `n` values that must all agree.
    pub fn uniform(&self, suffix: &str, n: usize) -> Result<Option<u64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some(Value::Array(a)) => {
                self.check_layers(suffix, a, n, "a per-layer array ")?;
                let vals: Option<Vec<u64>> = a.iter().map(|x| x.as_u64()).collect();
                match vals.as_deref() {
                    Some([first, rest @ ..]) if rest.iter().all(|x| x == first) => Ok(Some(*first)),
                    Some(_) => Err(self.err(
                        suffix,
                        Value::Array(a),
                        "differs between layers: the .mlb format has one value for every layer",
                    )),
                    None => Err(self.err(suffix, Value::Array(a), "must hold integers")),
                }
            }
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(suffix, v, "must be a non-negative integer")),
        }
    }

    /// Keys under the architecture's prefix that nothing read and the table does not
    /// know: the first one, if any.
    pub fn unknown_key(&self, ga: &GgufArch) -> Option<(String, String)> {
        let prefix = format!("{}.", self.arch);
        let used = self.used.borrow();
        self.v.kvs.iter().find_map(|kv| {
            let suffix = kv.key.strip_prefix(&prefix)?;
            (!used.contains(kv.key) && !ga.knows_key(suffix))
                .then(|| (kv.key.to_string(), kv.value.to_string()))
        })
    }
}

/// What a GGUF file describes, beyond the header fields.
struct Described {
    desc: ModelDesc,
    /// GGUF tensors consumed by the description (rope_freqs).
    consumed: Vec<String>,
}

fn usize_of(m: &Meta, suffix: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| m.err(suffix, v, "too large"))
}

/// The model a GGUF file describes, as llama.cpp reads it.
fn describe(m: &Meta, ga: &'static GgufArch, notes: &mut Vec<String>) -> Result<Described> {
    let v = m.v;
    let arch = arch::ARCHS
        .iter()
        .find(|a| a.name == ga.krafla)
        .expect("every GGUF architecture maps to a Krafla one");
    let n_layers = usize_of(m, "block_count", m.u64_req("block_count")?)?;
    if n_layers == 0 || n_layers > 65536 {
        return Err(m.err("block_count", n_layers, "must be 1 to 65536"));
    }
    let dim = usize_of(m, "embedding_length", m.u64_req("embedding_length")?)?;
    let hidden_dim = m
        .uniform("feed_forward_length", n_layers)?
        .ok_or_else(|| m.err("feed_forward_length", "missing", "required key"))?;
    let hidden_dim = usize_of(m, "feed_forward_length", hidden_dim)?;
    let n_heads = m
        .uniform("attention.head_count", n_layers)?
        .ok_or_else(|| m.err("attention.head_count", "missing", "required key"))?;
    let n_heads = usize_of(m, "attention.head_count", n_heads)?;
    if n_heads == 0 {
        return Err(m.err("attention.head_count", 0, "must not be zero"));
    }
    let n_kv_heads = match m.uniform("attention.head_count_kv", n_layers)? {
        Some(k) => usize_of(m, "attention.head_count_kv", k)?,
        None => n_heads,
    };
    let head_dim = match m.u64_opt("attention.key_length")? {
        Some(k) => usize_of(m, "attention.key_length", k)?,
        None => dim / n_heads,
    };
    m.u64_eq(
        "attention.value_length",
        head_dim,
        format!("must equal the key length {head_dim}: the format has one head size"),
    )?;
    let rot_dim = match m.u64_opt("rope.dimension_count")? {
        Some(r) => usize_of(m, "rope.dimension_count", r)?,
        None => head_dim,
    };
    if rot_dim != head_dim && !arch.qwen35 {
        return Err(m.err(
            "rope.dimension_count",
            rot_dim,
            format!(
                "partial rotary (head size {head_dim}) is not supported for {}",
                ga.name
            ),
        ));
    }
    if rot_dim == 0 || rot_dim > head_dim || rot_dim % 2 != 0 {
        return Err(m.err(
            "rope.dimension_count",
            rot_dim,
            format!("must be even and in 1..={head_dim}"),
        ));
    }
    let ctx = m.u64_req("context_length")?;
    let max_seq = if ctx > SEQ_LIMIT as u64 {
        notes.push(format!(
            "{} {ctx} clamped to the format's limit {SEQ_LIMIT}",
            m.full("context_length")
        ));
        SEQ_LIMIT as usize
    } else {
        ctx as usize
    };
    let norm_eps = m
        .f64_opt("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| {
            m.err(
                "attention.layer_norm_rms_epsilon",
                "missing",
                "required key",
            )
        })?;
    // llama.cpp's default base is 10000.
    let rope_theta = m.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    if rope_theta <= 0.0 {
        return Err(m.err("rope.freq_base", rope_theta, "must be > 0"));
    }

    // Vocabulary and classifier from the tensors.
    let emb = v
        .tensor("token_embd.weight")
        .ok_or_else(|| ConvertError::checkpoint(m.file, "tensor token_embd.weight is missing"))?;
    let vocab = emb.rows() as usize;
    m.u64_eq(
        "vocab_size",
        vocab,
        format!("differs from token_embd.weight's {vocab} rows"),
    )?;
    let tied = v.tensor("output.weight").is_none();

    // RoPE scaling as llama.cpp applies it.
    let mut consumed = Vec::new();
    let mut rope = rope_scaling(m, ctx)?;
    if let Some(t) = v.tensor("rope_freqs.weight") {
        if rope != RopeScaling::None {
            return Err(ConvertError::tensor(
                m.file,
                t.name,
                "per-frequency factors together with a RoPE scaling type cannot be expressed",
            ));
        }
        let mut factors = vec![0f32; t.cols() as usize];
        if t.rows() != 1
            || t.cols() as usize != head_dim / 2
            || !dequant::dequantize_row(t.ty, v.data(t), &mut factors)
        {
            return Err(ConvertError::tensor(
                m.file,
                t.name,
                format!(
                    "{} {}: expected {} F32 frequency factors",
                    t.ty,
                    t.shape_text(),
                    head_dim / 2
                ),
            ));
        }
        let orig = m
            .u64_opt("rope.scaling.original_context_length")?
            .unwrap_or(8192)
            .clamp(1, u32::MAX as u64) as u32;
        rope = llama3_from_factors(rope_theta, head_dim, &factors, orig)
            .map_err(|msg| ConvertError::tensor(m.file, t.name, msg))?;
        consumed.push(t.name.to_string());
    }
    let _ = m.get("rope.scaling.finetuned"); // no effect on the math

    // Layers.
    let mut layers = vec![LayerFlags::default(); n_layers];
    if ga.no_rope == NoRope::Every4th {
        for (i, l) in layers.iter_mut().enumerate() {
            l.no_rope = (i + 1) % 4 == 0;
        }
    }
    let (mut sliding_window, mut rope_local_theta) = (None, None);
    let (mut attn_scale, mut attn_softcap, mut final_softcap) = (None, None, None);
    if arch.gemma {
        // llama.cpp: 1/sqrt(head size), except the 27B models (46 layers for Gemma 2,
        // 62 for Gemma 3): 1/sqrt(dim / n_heads). query_pre_attn_scalar is not stored.
        let big =
            (ga.swa == Swa::Gemma2 && n_layers == 46) || (ga.swa == Swa::Gemma3 && n_layers == 62);
        let d = if big { dim / n_heads } else { head_dim };
        attn_scale = Some(1.0 / (d as f64).sqrt());
        let cap = |suffix: &str, default: f64| -> Result<Option<f64>> {
            let c = m.f64_opt(suffix)?.unwrap_or(default);
            if c < 0.0 {
                return Err(m.err(suffix, c, "must be ≥ 0"));
            }
            Ok((c > 0.0).then_some(c))
        };
        match ga.swa {
            Swa::Gemma2 => {
                attn_softcap = cap("attn_logit_softcapping", 50.0)?;
                final_softcap = cap("final_logit_softcapping", 30.0)?;
            }
            _ => final_softcap = cap("final_logit_softcapping", 0.0)?,
        }
    }
    match ga.swa {
        Swa::None => {}
        Swa::Gemma2 | Swa::Gemma3 => {
            let (default_window, default_pattern) = if ga.swa == Swa::Gemma2 {
                (4096, 2)
            } else {
                (0, 6)
            };
            let w = m
                .u64_opt("attention.sliding_window")?
                .unwrap_or(default_window);
            if w > SEQ_LIMIT as u64 {
                return Err(m.err(
                    "attention.sliding_window",
                    w,
                    "above the format's limit 2^24",
                ));
            }
            if w > 0 {
                let swa = swa_layers(m, n_layers, default_pattern)?;
                let base_swa = m.f64_opt("rope.freq_base_swa")?;
                let local = match ga.swa {
                    Swa::Gemma2 => base_swa.filter(|&b| b != rope_theta),
                    _ => Some(base_swa.unwrap_or(10_000.0)),
                };
                if let Some(b) = local {
                    if b <= 0.0 {
                        return Err(m.err("rope.freq_base_swa", b, "must be > 0"));
                    }
                }
                for (l, s) in layers.iter_mut().zip(&swa) {
                    l.sliding = *s;
                    l.local_rope = *s && local.is_some();
                }
                sliding_window = Some(w as usize);
                rope_local_theta = local;
            }
        }
    }
    let mut linear = None;
    if arch.qwen35 {
        // Text positions: every mrope section rotates by the same position.
        // ggml's interleaved sections: pair i takes section sector = i mod Σ; sector
        // s % 3 = 0, 1, 2 rotates by position t, h, w below 3·section, else by the fourth
        // position, 0 for text. Every rotated pair must get t, h or w.
        if let Some(v) = m.get("rope.dimension_sections") {
            let sec: Option<Vec<i64>> = v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_i64()).collect());
            let sec = sec
                .filter(|s| s.len() == 4 && s.iter().all(|&x| x >= 0))
                .ok_or_else(|| {
                    m.err(
                        "rope.dimension_sections",
                        v,
                        "must be 4 non-negative integers",
                    )
                })?;
            let sum: i64 = sec.iter().sum();
            let covered = |i: i64| {
                let s = if sum > 0 { i % sum } else { return false };
                (s % 3 == 0 && s < 3 * sec[0])
                    || (s % 3 == 1 && s < 3 * sec[1])
                    || (s % 3 == 2 && s < 3 * sec[2])
            };
            if let Some(i) = (0..rot_dim as i64 / 2).find(|&i| !covered(i)) {
                return Err(m.err(
                    "rope.dimension_sections",
                    v,
                    format!("leaves rotary pair {i} unrotated for text (llama.cpp's fourth position is 0)"),
                ));
            }
        }
        let recurrent: Vec<bool> = match m.get("attention.recurrent_layers") {
            Some(Value::Array(a)) if a.len == n_layers => a
                .iter()
                .map(|x| {
                    x.as_bool().ok_or_else(|| {
                        m.err(
                            "attention.recurrent_layers",
                            Value::Array(a),
                            "must hold booleans",
                        )
                    })
                })
                .collect::<Result<_>>()?,
            Some(v) => {
                return Err(m.err(
                    "attention.recurrent_layers",
                    v,
                    format!("must be {n_layers} booleans"),
                ))
            }
            None => {
                let p = m.u64_opt("full_attention_interval")?.unwrap_or(4);
                if p == 0 {
                    return Err(m.err("full_attention_interval", 0, "must be ≥ 1"));
                }
                (0..n_layers as u64).map(|i| (i + 1) % p != 0).collect()
            }
        };
        let _ = m.get("full_attention_interval");
        for (l, r) in layers.iter_mut().zip(&recurrent) {
            l.linear = *r;
        }
        if recurrent.iter().any(|&r| r) {
            let g = |k: &str| -> Result<usize> {
                let v = m.u64_req(k)?;
                usize::try_from(v).map_err(|_| m.err(k, v, "too large"))
            };
            let (k_heads, v_heads, k_dim, conv) = (
                g("ssm.group_count")?,
                g("ssm.time_step_rank")?,
                g("ssm.state_size")?,
                g("ssm.conv_kernel")?,
            );
            let inner = g("ssm.inner_size")?;
            if v_heads == 0 || k_heads == 0 || v_heads % k_heads != 0 || inner != v_heads * k_dim {
                return Err(m.err(
                    "ssm.inner_size",
                    inner,
                    format!(
                        "must be time_step_rank ({v_heads}) × state_size ({k_dim}), with group_count ({k_heads}) dividing time_step_rank (llama.cpp's value heads are key-head sized)"
                    ),
                ));
            }
            linear = Some(LinearDims {
                k_heads,
                v_heads,
                k_dim,
                v_dim: k_dim,
                conv,
            });
        } else {
            for k in [
                "ssm.conv_kernel",
                "ssm.state_size",
                "ssm.group_count",
                "ssm.time_step_rank",
                "ssm.inner_size",
            ] {
                let _ = m.get(k);
            }
        }
    }
    let desc = ModelDesc {
        arch,
        wrapper: None,
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        hidden_dim,
        vocab,
        max_seq,
        norm_eps,
        rope_theta,
        rope,
        rope_local_theta,
        rot_dim,
        layers,
        sliding_window,
        tied,
        act: if arch.gemma {
            act::GELU_TANH
        } else {
            act::SILU
        },
        attn_scale,
        attn_softcap,
        final_softcap,
        linear,
        notes: Vec::new(),
    };
    Ok(Described { desc, consumed })
}

/// Gemma's sliding layers: `attention.sliding_window_pattern` as a per-layer bool
/// array, or a period n (layer i slides when i % n < n - 1), default `default`.
fn swa_layers(m: &Meta, n: usize, default: u64) -> Result<Vec<bool>> {
    let key = "attention.sliding_window_pattern";
    match m.get(key) {
        Some(Value::Array(a)) => {
            m.check_layers(key, a, n, "")?;
            a.iter()
                .map(|x| match x {
                    Value::Bool(b) => Ok(b),
                    other => other
                        .as_u64()
                        .filter(|&v| v <= 1)
                        .map(|v| v == 1)
                        .ok_or_else(|| m.err(key, Value::Array(a), "must hold booleans")),
                })
                .collect()
        }
        Some(v) => {
            let p = v
                .as_u64()
                .ok_or_else(|| m.err(key, v, "must be an integer or a list of booleans"))?;
            Ok((0..n as u64).map(|i| p == 0 || i % p < p - 1).collect())
        }
        None => Ok((0..n as u64).map(|i| i % default < default - 1).collect()),
    }
}

/// `rope.scaling.*` as llama.cpp reads it: type default "linear", factor 0 means none;
/// yarn's attention factor is get_mscale(f) times `rope.scaling.attn_factor`, its betas
/// 32 and 1 (llama.cpp reads no yarn_* key for these architectures: such keys are
/// refused rather than guessed at).
fn rope_scaling(m: &Meta, ctx: u64) -> Result<RopeScaling> {
    let ty = m.str_opt("rope.scaling.type")?.unwrap_or("linear");
    let factor = match m.f64_opt("rope.scaling.factor")? {
        Some(f) => Some(f),
        None => m.f64_opt("rope.scale_linear")?,
    }
    .unwrap_or(0.0);
    let attn = m.f64_opt("rope.scaling.attn_factor")?;
    for k in [
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.yarn_log_multiplier",
        "rope.scaling.yarn_ext_factor",
    ] {
        if let Some(v) = m.v.get(&m.full(k)) {
            return Err(m.err(
                k,
                v,
                format!(
                    "llama.cpp ignores this key for {}; refusing rather than guessing which RoPE the model needs",
                    m.arch
                ),
            ));
        }
    }
    if factor < 0.0 {
        return Err(m.err("rope.scaling.factor", factor, "must be ≥ 0"));
    }
    let scaling = match ty {
        "none" => RopeScaling::None,
        "linear" if factor == 0.0 || factor == 1.0 => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => {
            if factor == 0.0 {
                return Err(m.err("rope.scaling.factor", "missing", "yarn needs a factor"));
            }
            let orig = m
                .u64_opt("rope.scaling.original_context_length")?
                .unwrap_or(ctx);
            if orig == 0 || orig > u32::MAX as u64 {
                return Err(m.err("rope.scaling.original_context_length", orig, "must be > 0"));
            }
            let mscale = if factor <= 1.0 {
                1.0
            } else {
                0.1 * factor.ln() + 1.0
            };
            RopeScaling::Yarn {
                factor,
                beta_fast: 32.0,
                beta_slow: 1.0,
                orig: orig as u32,
                attn_factor: mscale * attn.unwrap_or(1.0),
            }
        }
        other => {
            return Err(m.err(
                "rope.scaling.type",
                format!("{other:?}"),
                "unsupported RoPE scaling (none, linear or yarn)",
            ))
        }
    };
    if attn.is_some() && !matches!(scaling, RopeScaling::Yarn { .. }) && attn != Some(1.0) {
        return Err(m.err(
            "rope.scaling.attn_factor",
            attn.unwrap_or(0.0),
            "a RoPE attention factor without yarn cannot be expressed",
        ));
    }
    Ok(scaling)
}

/// llama.cpp's per-frequency factors for Llama 3 RoPE (`rope_freqs.weight`, the divisor
/// of each pair's frequency, as its converter's generate_extra_tensors makes them): the
/// inverse of [`llama3_from_factors`].
pub(crate) fn llama3_factors(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    orig: f64,
) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let inv = theta.powf(-2.0 * i as f64 / head_dim as f64);
            let wl = 2.0 * std::f64::consts::PI / inv;
            if wl < orig / high {
                1.0
            } else if wl > orig / low {
                factor as f32
            } else {
                let s = (orig / wl - low) / (high - low);
                (1.0 / ((1.0 - s) / factor + s)) as f32
            }
        })
        .collect()
}

/// Llama 3 RoPE parameters that reproduce llama.cpp's per-frequency factors
/// (`rope_freqs.weight`, the divisor of each pair's frequency).
///
/// With wavelength λ_i = 2π / θ^(−2i/d), the factors are 1 (λ < orig/high), f
/// (λ > orig/low), and 1 / ((1 − s)/f + s) between, s = (orig/λ − low)/(high − low):
/// s is a line in 1/λ. The line is fitted through the interpolated factors (and the
/// band edges when fewer than two lie between); `orig` is free (any scale of
/// orig, low, high gives the same factors) and taken from the file or 8192. The fit is
/// accepted only when the spec's formula reproduces every factor to 1e-5.
pub(crate) fn llama3_from_factors(
    theta: f64,
    head_dim: usize,
    factors: &[f32],
    orig: u32,
) -> std::result::Result<RopeScaling, String> {
    let n = factors.len();
    let u: Vec<f64> = (0..n)
        .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64) / (2.0 * std::f64::consts::PI))
        .collect();
    let fs: Vec<f64> = factors.iter().map(|&x| x as f64).collect();
    if fs.iter().any(|&x| !(x.is_finite() && x > 0.0)) {
        return Err("a frequency factor is not finite and positive".into());
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    if fs.iter().all(|&x| close(x, 1.0)) {
        return Ok(RopeScaling::None);
    }
    let f = fs.iter().cloned().fold(0.0f64, f64::max);
    if f <= 1.0 {
        return Err(format!(
            "largest factor {f} is not above 1: not Llama 3 scaling"
        ));
    }
    // Dims are in order of falling frequency: unscaled, interpolated, scaled.
    let unscaled: Vec<usize> = (0..n).filter(|&i| close(fs[i], 1.0)).collect();
    let scaled: Vec<usize> = (0..n).filter(|&i| close(fs[i], f)).collect();
    let mid: Vec<usize> = (0..n)
        .filter(|&i| !close(fs[i], 1.0) && !close(fs[i], f))
        .collect();
    if scaled.is_empty() {
        return Err("no frequency is fully scaled: the factor cannot be determined".into());
    }
    let s_of = |x: f64| (1.0 / x - 1.0 / f) / (1.0 - 1.0 / f);
    let mut pts: Vec<(f64, f64)> = mid.iter().map(|&i| (u[i], s_of(fs[i]))).collect();
    let edge_scaled = (u[*scaled.first().expect("non-empty")], 0.0);
    let edge_unscaled = unscaled.last().map(|&i| (u[i], 1.0));
    let line = |a: (f64, f64), b: (f64, f64)| {
        let alpha = (a.1 - b.1) / (a.0 - b.0);
        (alpha, alpha * a.0 - a.1)
    };
    let (alpha, beta) = match pts.len() {
        0 => match edge_unscaled {
            Some(e) => line(e, edge_scaled),
            None => return Err("only fully scaled frequencies: not Llama 3 scaling".into()),
        },
        1 => {
            let p = pts.remove(0);
            let (a1, b1) = line(p, edge_scaled);
            match edge_unscaled {
                Some(e) if a1 * e.0 - b1 < 1.0 => line(e, p),
                _ => (a1, b1),
            }
        }
        _ => line(pts[0], pts[pts.len() - 1]),
    };
    if !(alpha.is_finite() && alpha > 0.0 && beta.is_finite() && beta > 0.0) {
        return Err("the factors do not follow Llama 3's scaling".into());
    }
    let orig_f = orig as f64;
    let fits = |low: f64, high: f64| -> std::result::Result<(), String> {
        for i in 0..n {
            let wavelen = 1.0 / u[i];
            let want = if wavelen < orig_f / high {
                1.0
            } else if wavelen > orig_f / low {
                f
            } else {
                let s = (orig_f / wavelen - low) / (high - low);
                1.0 / ((1.0 - s) / f + s)
            };
            if (want - fs[i]).abs() > 1e-5 * fs[i] {
                return Err(format!(
                    "factor {i} is {}, Llama 3 scaling with factor {f}, low {low}, high {high}, original context {orig} gives {want}",
                    fs[i]
                ));
            }
        }
        Ok(())
    };
    let mut low = beta * orig_f / alpha;
    let mut high = low + orig_f / alpha;
    fits(low, high)?;
    // The shortest decimals that give the same factors (Llama 3.1's 1 and 4, not
    // 0.99999...): the fit is exact only to float rounding.
    let sig = |x: f64, k: i32| {
        let e = 10f64.powi(k - 1 - x.abs().log10().floor() as i32);
        (x * e).round() / e
    };
    if let Some((l, h)) = (1..=9)
        .map(|k| (sig(low, k), sig(high, k)))
        .find(|&(l, h)| l > 0.0 && h > l && fits(l, h).is_ok())
    {
        (low, high) = (l, h);
    }
    Ok(RopeScaling::Llama3 {
        factor: f,
        low,
        high,
        orig,
    })
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
    let ga = gguf_arch::by_name(arch_name).ok_or_else(|| {
        ConvertError::config(
            path,
            "general.architecture",
            arch_name,
            format!(
                "unknown or unsupported architecture (supported: {})",
                gguf_arch::names().join(", ")
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
    super::announce(progress, &layout, &notes);

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
        let mut w = super::new_writer(
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
                        super::check_finite(&buf, path, s.t.name)?;
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
    let probe = super::new_writer(std::io::sink(), h, flags, mixed)
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

/// The `.mlb` type a GGUF matrix type is stored as, bits unchanged (blocks, or 2-byte
/// floats), if Krafla has it.
pub fn copy_type(ty: GgmlType) -> Option<WType> {
    Some(match ty {
        GgmlType::Q8_0 => WType::Q8_0,
        GgmlType::Q4_0 => WType::Q4_0,
        GgmlType::F16 => WType::F16,
        GgmlType::BF16 => WType::BF16,
        GgmlType::Q4_K => WType::Q4_K,
        GgmlType::Q5_K => WType::Q5_K,
        GgmlType::Q6_K => WType::Q6_K,
        GgmlType::Q4_1 => WType::Q4_1,
        GgmlType::Q5_0 => WType::Q5_0,
        GgmlType::Q5_1 => WType::Q5_1,
        GgmlType::IQ4_NL => WType::IQ4_NL,
        _ => return None,
    })
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
    let uniform = |wt: u32, mask: u32| {
        super::plan::matrix_types(&probe.tensors, wt, mask, &super::plan::TypePlan::default())
            == types
    };
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
pub(crate) fn geometry(d: &ModelDesc, ga: &GgufArch) -> gguf_arch::Geometry {
    gguf_arch::Geometry {
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
            let ty = crate::convert::gguf_out::ggml_type(w).unwrap();
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

    #[test]
    fn llama3_parameters_are_recovered() {
        // Llama 3.1 (head_dim 128): many interpolated frequencies.
        let fs = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        let RopeScaling::Llama3 {
            factor,
            low,
            high,
            orig,
        } = llama3_from_factors(500000.0, 128, &fs, 8192).unwrap()
        else {
            panic!()
        };
        assert_eq!((factor, orig), (8.0, 8192));
        assert!(
            (low - 1.0).abs() < 1e-4 && (high - 4.0).abs() < 1e-3,
            "{low} {high}"
        );
        // The fixture: one interpolated frequency only; any equivalent parameters do.
        let fs = llama3_factors(10000.0, 16, 8.0, 1.0, 4.0, 32.0);
        assert!(llama3_from_factors(10000.0, 16, &fs, 8192).is_ok());
        // All ones: no scaling. Nonsense: refused.
        assert_eq!(
            llama3_from_factors(1e4, 16, &[1.0; 8], 8192).unwrap(),
            RopeScaling::None
        );
        assert!(
            llama3_from_factors(1e4, 16, &[2.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], 8192).is_err()
        );
    }
}
