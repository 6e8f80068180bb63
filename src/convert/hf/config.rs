//! config.json → a typed model description and the `.mlb` header fields.
//!
//! Both styles found on the Hub are read: the current one (`rope_parameters`, nested
//! per layer type for Gemma 3, `layer_types`) and the older one (`rope_theta` and
//! `rope_scaling` at the top level, Gemma 3's `rope_local_base_freq` and
//! `sliding_window_pattern`, SmolLM3's `no_rope_layers`). Multimodal wrappers
//! (`text_config`) are read through their text model.
//!
//! Formulas, as transformers computes them:
//! - partial rotary: rot_dim = head_dim · partial_rotary_factor; the spec's pair
//!   frequency is rope_theta^(-2i/head_dim) while transformers uses
//!   theta^(-2i/rot_dim), so the header stores rope_theta = theta^(head_dim/rot_dim).
//! - yarn: attention_factor from the config, else get_mscale(f, mscale) /
//!   get_mscale(f, mscale_all_dim) when both are set, else 0.1·ln f + 1 (1 for f ≤ 1);
//!   beta_fast 32 and beta_slow 1 by default; factor = max_pos / orig when null.
//! - Gemma: embed_scale = sqrt(dim), attn_scale = query_pre_attn_scalar^-0.5.
//!
//! Keys that change the math in a way the format cannot express are refused by name.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use super::arch::LinearDims;
use super::arch::{self, Arch, DefaultLayerTypes, Window};
use crate::convert::error::{ConvertError, Result};
use crate::format::mlb::header::{act, layer_flag, rope_type, Header};
use crate::format::mlb::validate::{DIM_LIMIT, SEQ_LIMIT};

/// RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low: f64,
        high: f64,
        orig: u32,
    },
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        orig: u32,
        attn_factor: f64,
    },
}

/// One layer's flags, as the header's per-layer flag byte stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerFlags {
    pub linear: bool,
    pub sliding: bool,
    pub local_rope: bool,
    pub no_rope: bool,
}

impl LayerFlags {
    /// The flag byte.
    pub fn bits(self) -> u8 {
        let mut f = 0;
        if self.sliding {
            f |= layer_flag::SLIDING;
        }
        if self.local_rope {
            f |= layer_flag::LOCAL_ROPE;
        }
        if self.no_rope {
            f |= layer_flag::NO_ROPE;
        }
        if self.linear {
            f |= layer_flag::LINEAR;
        }
        f
    }
}

/// What the converter needs to know about the model.
#[derive(Debug, Clone)]
pub struct ModelDesc {
    pub arch: &'static Arch,
    /// The wrapper's model_type when the config is multimodal.
    pub wrapper: Option<String>,
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub hidden_dim: usize,
    pub vocab: usize,
    pub max_seq: usize,
    pub norm_eps: f64,
    /// RoPE base as transformers uses it (before the partial-rotary rewrite).
    pub rope_theta: f64,
    pub rope: RopeScaling,
    pub rope_local_theta: Option<f64>,
    /// Rotated dimensions per head (head_dim when all).
    pub rot_dim: usize,
    pub layers: Vec<LayerFlags>,
    pub sliding_window: Option<usize>,
    pub tied: bool,
    pub act: u32,
    pub attn_scale: Option<f64>,
    pub attn_softcap: Option<f64>,
    pub final_softcap: Option<f64>,
    pub linear: Option<LinearDims>,
    /// Remarks for the user (skipped parts, clamped values).
    pub notes: Vec<String>,
}

/// Reads config.json keys with errors that name the file, key and value.
struct Cfg<'a> {
    file: &'a Path,
    /// Prefix of key names in messages (`text_config.` for wrappers).
    prefix: &'a str,
    m: &'a Map<String, Value>,
}

impl<'a> Cfg<'a> {
    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    fn err(&self, k: &str, v: impl std::fmt::Display, msg: impl Into<String>) -> ConvertError {
        ConvertError::config(self.file, self.key(k), v, msg)
    }

    fn get(&self, k: &str) -> Option<&'a Value> {
        match self.m.get(k) {
            Some(Value::Null) | None => None,
            v => v,
        }
    }

    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.err(k, v, "must be a non-negative integer")),
        }
    }

    fn usize_req(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?
            .ok_or_else(|| self.err(k, "missing", "required key"))
    }

    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        f64_in(self, self.m, k)
    }

    fn bool_opt(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(k, v, "must be true or false")),
        }
    }

    /// The value `v` of key `k` as a list of one entry per layer (`n`).
    fn layer_list(&self, k: &str, v: &'a Value, n: usize) -> Result<&'a Vec<Value>> {
        let a = v
            .as_array()
            .ok_or_else(|| self.err(k, v, "must be a list"))?;
        if a.len() != n {
            return Err(self.err(
                k,
                format!("{} entries", a.len()),
                format!("must have num_hidden_layers ({n}) entries"),
            ));
        }
        Ok(a)
    }

    fn str_opt(&self, k: &str) -> Result<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(k, v, "must be a string")),
        }
    }
}

fn f64_in(c: &Cfg, m: &Map<String, Value>, k: &str) -> Result<Option<f64>> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| c.err(k, v, "must be a number")),
    }
}

/// Keys of mixture-of-experts and other math the format cannot express: refused when
/// set to anything but null, 0 or false.
const UNSUPPORTED_KEYS: &[(&str, &str)] = &[
    ("num_experts", "mixture of experts is not supported"),
    ("num_local_experts", "mixture of experts is not supported"),
    ("n_routed_experts", "mixture of experts is not supported"),
    ("n_shared_experts", "mixture of experts is not supported"),
    (
        "moe_intermediate_size",
        "mixture of experts is not supported",
    ),
    (
        "shared_expert_intermediate_size",
        "mixture of experts is not supported",
    ),
    ("mlp_bias", "MLP biases cannot be stored in an .mlb file"),
    (
        "use_bidirectional_attention",
        "bidirectional attention is not supported",
    ),
    ("qk_layernorm", "this q/k layer norm is not supported"),
    ("logits_scaling", "logit scaling is not supported"),
    ("logit_scale", "logit scaling is not supported"),
    (
        "embedding_multiplier",
        "embedding multipliers are not supported",
    ),
    (
        "residual_multiplier",
        "residual multipliers are not supported",
    ),
    (
        "attention_multiplier",
        "attention multipliers are not supported",
    ),
    ("clip_qkv", "q/k/v clipping is not supported"),
];

fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        _ => true,
    }
}

/// Reads `dir/config.json`.
pub fn load(dir: &Path) -> Result<ModelDesc> {
    let file: PathBuf = dir.join("config.json");
    let text = crate::input::read_to_string(&file).map_err(|e| ConvertError::io(&file, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| {
        ConvertError::config(&file, "config.json", "?", format!("not valid JSON: {e}"))
    })?;
    parse(&file, &v)
}

/// Parses a config.json value (`file` names it in errors).
pub fn parse(file: &Path, v: &Value) -> Result<ModelDesc> {
    let top = v
        .as_object()
        .ok_or_else(|| ConvertError::config(file, "config.json", "?", "must be a JSON object"))?;
    let top_cfg = Cfg {
        file,
        prefix: "",
        m: top,
    };
    let mt = top_cfg
        .str_opt("model_type")?
        .ok_or_else(|| top_cfg.err("model_type", "missing", "required key"))?;
    let known = || arch::model_types().join(", ");
    let (arch, cfg, wrapper) = if let Some(a) = arch::by_wrapper(mt) {
        let tc = top
            .get("text_config")
            .and_then(|t| t.as_object())
            .ok_or_else(|| {
                top_cfg.err(
                    "text_config",
                    "missing",
                    format!("a {mt} checkpoint needs its text model's config"),
                )
            })?;
        let c = Cfg {
            file,
            prefix: "text_config.",
            m: tc,
        };
        let tmt = c.str_opt("model_type")?.unwrap_or(a.name);
        if arch::by_model_type(tmt).map(|x| x.name) != Some(a.name) {
            return Err(c.err(
                "model_type",
                tmt,
                format!("a {mt} wrapper must hold a {} text model", a.name),
            ));
        }
        (a, c, Some(mt.to_string()))
    } else if let Some(a) = arch::by_model_type(mt) {
        (a, top_cfg, None)
    } else {
        return Err(top_cfg.err(
            "model_type",
            mt,
            format!("unknown architecture (supported: {})", known()),
        ));
    };
    describe(arch, &cfg, top, wrapper)
}

fn describe(
    arch: &'static Arch,
    c: &Cfg,
    top: &Map<String, Value>,
    wrapper: Option<String>,
) -> Result<ModelDesc> {
    let mut notes = Vec::new();
    for (k, why) in UNSUPPORTED_KEYS {
        if let Some(v) = c.m.get(*k) {
            if is_set(v) {
                return Err(c.err(k, v, *why));
            }
        }
    }
    // q/k/v/o biases: only Qwen2's q/k/v biases have a place in the format.
    if c.bool_opt("attention_bias")? == Some(true) {
        return Err(c.err(
            "attention_bias",
            true,
            "biases on the attention projections (o_proj included) cannot be stored",
        ));
    }
    if let Some(tp) = c.usize_opt("pretraining_tp")? {
        if tp > 1 {
            notes.push(format!(
                "{}pretraining_tp = {tp} ignored (transformers ignores it too)",
                c.prefix
            ));
        }
    }

    let dim = c.usize_req("hidden_size")?;
    let n_layers = c.usize_req("num_hidden_layers")?;
    let n_heads = c.usize_req("num_attention_heads")?;
    let n_kv_heads = c.usize_opt("num_key_value_heads")?.unwrap_or(n_heads);
    let hidden_dim = c.usize_req("intermediate_size")?;
    let vocab = c.usize_req("vocab_size")?;
    if n_heads == 0 || n_layers == 0 {
        return Err(c.err("num_attention_heads", n_heads, "must not be zero"));
    }
    let head_dim = match c.usize_opt("head_dim")? {
        Some(h) => h,
        None => arch.default_head_dim.unwrap_or(dim / n_heads),
    };
    // The format's limits, before anything is allocated per layer or per token.
    for (k, v, limit) in [
        ("hidden_size", dim, DIM_LIMIT),
        ("num_hidden_layers", n_layers, DIM_LIMIT),
        ("num_attention_heads", n_heads, DIM_LIMIT),
        ("num_key_value_heads", n_kv_heads, DIM_LIMIT),
        ("intermediate_size", hidden_dim, DIM_LIMIT),
        ("head_dim", head_dim, DIM_LIMIT),
        ("vocab_size", vocab, SEQ_LIMIT),
    ] {
        if v > limit as usize {
            return Err(c.err(k, v, format!("above the format's limit {limit}")));
        }
    }
    let mut max_seq = c
        .usize_opt("max_position_embeddings")?
        .unwrap_or(arch.default_max_pos);
    if max_seq > SEQ_LIMIT as usize {
        notes.push(format!(
            "max_position_embeddings {max_seq} clamped to the format's limit {SEQ_LIMIT}"
        ));
        max_seq = SEQ_LIMIT as usize;
    }
    let norm_eps = c.f64_opt("rms_norm_eps")?.unwrap_or(arch.default_rms_eps);

    // Activation.
    let act_name = c.str_opt(arch.act_key)?.unwrap_or(arch.default_act);
    let act = match act_name {
        "silu" | "swish" => act::SILU,
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_tanh" => act::GELU_TANH,
        other => {
            return Err(c.err(
                arch.act_key,
                other,
                "unsupported activation (silu or gelu_pytorch_tanh)",
            ))
        }
    };
    if arch.qwen35 && act != act::SILU {
        return Err(c.err(
            arch.act_key,
            act_name,
            "Qwen3.5's delta rule and MLP need silu",
        ));
    }

    // Tied classifier: the wrapper's key decides for a multimodal model.
    let tied = match top.get("tie_word_embeddings") {
        Some(Value::Bool(b)) if wrapper.is_some() => *b,
        _ => c
            .bool_opt("tie_word_embeddings")?
            .unwrap_or(arch.default_tie),
    };

    // Layer types.
    let layer_types = layer_types(arch, c, n_layers)?;

    // RoPE.
    let rope_src = RopeSource::read(arch, c)?;
    let (global, local) = match &rope_src {
        RopeSource::Single(m, key) => (rope_params(c, m, key, max_seq)?, None),
        RopeSource::PerLayerType { full, sliding } => (
            rope_params(c, &full.0, &full.1, max_seq)?,
            Some(rope_params(c, &sliding.0, &sliding.1, max_seq)?),
        ),
    };
    let prf = global.partial_rotary.unwrap_or(arch.default_partial_rotary);
    let rot_dim = (head_dim as f64 * prf) as usize;
    if rot_dim == 0 || rot_dim > head_dim || !rot_dim.is_multiple_of(2) {
        return Err(c.err(
            "partial_rotary_factor",
            prf,
            format!("gives rot_dim {rot_dim}: must be even and in 1..=head_dim ({head_dim})"),
        ));
    }
    if rot_dim < head_dim && !arch.qwen35 {
        return Err(c.err(
            "partial_rotary_factor",
            prf,
            format!("partial rotary is not supported for {}", arch.name),
        ));
    }
    if rot_dim < head_dim && matches!(global.scaling, RopeScaling::Yarn { .. }) {
        return Err(c.err(
            "rope_type",
            "yarn",
            "yarn with partial rotary is not expressible in the format",
        ));
    }
    let rope_local_theta = match (&local, arch.default_local_theta) {
        (Some(l), _) => {
            if l.scaling != RopeScaling::None {
                return Err(c.err(
                    "rope_parameters.sliding_attention.rope_type",
                    format!("{:?}", l.scaling),
                    "the local RoPE of sliding layers must be unscaled",
                ));
            }
            Some(
                l.theta
                    .unwrap_or(arch.default_local_theta.unwrap_or(10_000.0)),
            )
        }
        (None, Some(d)) => Some(c.f64_opt("rope_local_base_freq")?.unwrap_or(d)),
        (None, None) => None,
    };
    let rope_theta = global.theta.unwrap_or(arch.default_theta);

    // Sliding window.
    let window = c.usize_opt("sliding_window")?.filter(|&w| w > 0);
    let use_sw = c.bool_opt("use_sliding_window")?.unwrap_or(false);
    let window = match arch.window {
        Window::None => None,
        Window::AllLayers | Window::LayerTypes => window,
        Window::LayerTypesIfUsed => window.filter(|_| use_sw),
    };
    if let Some(w) = window {
        if w > SEQ_LIMIT as usize {
            return Err(c.err("sliding_window", w, "above the format's limit 2^24"));
        }
    }

    // SmolLM3's no-RoPE layers: no_rope_layers[i] = 1 means the layer uses RoPE.
    let no_rope = if arch.no_rope_layers {
        smollm3_rope_layers(c, n_layers)?
            .into_iter()
            .map(|r| !r)
            .collect()
    } else {
        vec![false; n_layers]
    };

    let mut layers = Vec::with_capacity(n_layers);
    for (i, t) in layer_types.iter().enumerate() {
        let mut k = LayerFlags::default();
        match t.as_str() {
            "full_attention" => {}
            "sliding_attention" => {
                k.sliding = window.is_some() && arch.window != Window::None;
                k.local_rope = rope_local_theta.is_some();
            }
            "linear_attention" if arch.qwen35 => k.linear = true,
            other => {
                return Err(c.err(
                    &format!("layer_types[{i}]"),
                    other,
                    format!("unsupported layer type for {}", arch.name),
                ))
            }
        }
        if arch.window == Window::AllLayers && window.is_some() {
            k.sliding = true;
        }
        k.no_rope = no_rope[i];
        layers.push(k);
    }

    // Gemma's scales and softcaps.
    let (attn_scale, attn_softcap, final_softcap) = if arch.gemma {
        let q = c.f64_opt("query_pre_attn_scalar")?.unwrap_or(256.0);
        if q <= 0.0 {
            return Err(c.err("query_pre_attn_scalar", q, "must be > 0"));
        }
        let cap = |k: &str, d: Option<f64>| -> Result<Option<f64>> {
            match c.m.get(k) {
                None => Ok(d),
                Some(Value::Null) => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x >= 0.0 => Ok(Some(x).filter(|&x| x > 0.0)),
                    _ => Err(c.err(k, v, "must be a number ≥ 0 or null")),
                },
            }
        };
        (
            Some(q.powf(-0.5)),
            cap("attn_logit_softcapping", arch.default_softcaps.0)?,
            cap("final_logit_softcapping", arch.default_softcaps.1)?,
        )
    } else {
        for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(v) = c.m.get(k) {
                if is_set(v) {
                    return Err(c.err(k, v, format!("softcapping is not part of {}", arch.name)));
                }
            }
        }
        (None, None, None)
    };

    let linear = match arch.default_linear {
        Some(def) => {
            let dim = |k: &str, default: usize| -> Result<usize> {
                let v = c.usize_opt(k)?.unwrap_or(default);
                if v > DIM_LIMIT as usize {
                    return Err(c.err(k, v, format!("above the format's limit {DIM_LIMIT}")));
                }
                Ok(v)
            };
            Some(LinearDims {
                k_heads: dim("linear_num_key_heads", def.k_heads)?,
                v_heads: dim("linear_num_value_heads", def.v_heads)?,
                k_dim: dim("linear_key_head_dim", def.k_dim)?,
                v_dim: dim("linear_value_head_dim", def.v_dim)?,
                conv: dim("linear_conv_kernel_dim", def.conv)?,
            })
            .filter(|_| layers.iter().any(|l| l.linear))
        }
        None => None,
    };

    if let Some(w) = &wrapper {
        notes.push(format!(
            "{w} is a multimodal checkpoint: converting its text model ({}), not its vision tower",
            arch.name
        ));
    }

    Ok(ModelDesc {
        arch,
        wrapper,
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
        rope: global.scaling,
        rope_local_theta,
        rot_dim,
        layers,
        sliding_window: window,
        tied,
        act,
        attn_scale,
        attn_softcap,
        final_softcap,
        linear,
        notes,
    })
}

/// `layer_types` from the config or as transformers fills it in.
fn layer_types(arch: &Arch, c: &Cfg, n: usize) -> Result<Vec<String>> {
    if let Some(v) = c.get("layer_types") {
        if arch.window == Window::AllLayers {
            // Mistral's modeling ignores layer_types (transformers warns about it).
            return Ok(vec!["full_attention".into(); n]);
        }
        let a = c.layer_list("layer_types", v, n)?;
        return a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| c.err(&format!("layer_types[{i}]"), t, "must be a string"))
            })
            .collect();
    }
    let full = || "full_attention".to_string();
    let sliding = || "sliding_attention".to_string();
    Ok(match arch.default_layer_types {
        DefaultLayerTypes::Full => vec![full(); n],
        DefaultLayerTypes::MaxWindowLayers => {
            let used = c.bool_opt("use_sliding_window")?.unwrap_or(false)
                && c.usize_opt("sliding_window")?.is_some();
            let from = c.usize_opt("max_window_layers")?.unwrap_or(28);
            (0..n)
                .map(|i| if used && i >= from { sliding() } else { full() })
                .collect()
        }
        DefaultLayerTypes::Alternate => (0..n)
            .map(|i| if (i + 1) % 2 != 0 { sliding() } else { full() })
            .collect(),
        DefaultLayerTypes::Pattern => {
            // transformers reads the legacy key `sliding_window_pattern` (default 6).
            let p = c.usize_opt("sliding_window_pattern")?.unwrap_or(6);
            if p == 0 {
                return Err(c.err("sliding_window_pattern", 0, "must be ≥ 1"));
            }
            (0..n)
                .map(|i| if (i + 1) % p != 0 { sliding() } else { full() })
                .collect()
        }
        DefaultLayerTypes::SmolLM3 => {
            let used = c.bool_opt("use_sliding_window")?.unwrap_or(false)
                && c.usize_opt("sliding_window")?.is_some();
            let rope = smollm3_rope_layers(c, n)?;
            (0..n)
                .map(|i| if used && !rope[i] { sliding() } else { full() })
                .collect()
        }
        DefaultLayerTypes::LinearInterval => {
            let p = c.usize_opt("full_attention_interval")?.unwrap_or(4);
            if p == 0 {
                return Err(c.err("full_attention_interval", 0, "must be ≥ 1"));
            }
            (0..n)
                .map(|i| {
                    if (i + 1) % p != 0 {
                        "linear_attention".to_string()
                    } else {
                        full()
                    }
                })
                .collect()
        }
    })
}

/// SmolLM3: whether each layer uses RoPE (`no_rope_layers[i]` = 1: it does).
fn smollm3_rope_layers(c: &Cfg, n: usize) -> Result<Vec<bool>> {
    match c.get("no_rope_layers") {
        Some(v) => {
            let a = c.layer_list("no_rope_layers", v, n)?;
            a.iter()
                .enumerate()
                .map(|(i, x)| match x.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(c.err(&format!("no_rope_layers[{i}]"), x, "must be 0 or 1")),
                })
                .collect()
        }
        None => {
            let k = c.usize_opt("no_rope_layer_interval")?.unwrap_or(4);
            if k == 0 {
                return Err(c.err("no_rope_layer_interval", 0, "must be ≥ 1"));
            }
            Ok((0..n).map(|i| (i + 1) % k != 0).collect())
        }
    }
}

/// Where the RoPE parameters come from.
enum RopeSource {
    /// One dict (rope_parameters, or rope_scaling merged with rope_theta) and its key name.
    Single(Map<String, Value>, String),
    /// Gemma 3: per layer type.
    PerLayerType {
        full: (Map<String, Value>, String),
        sliding: (Map<String, Value>, String),
    },
}

impl RopeSource {
    fn read(arch: &Arch, c: &Cfg) -> Result<RopeSource> {
        let rp = c.get("rope_parameters");
        let nested = |m: &Map<String, Value>| {
            m.contains_key("full_attention") || m.contains_key("sliding_attention")
        };
        let top_theta = c.get("rope_theta").cloned();
        let top_prf = c.get("partial_rotary_factor").cloned();
        let with_top = |mut m: Map<String, Value>| {
            if let Some(t) = &top_theta {
                m.entry("rope_theta").or_insert(t.clone());
            }
            if let Some(p) = &top_prf {
                m.entry("partial_rotary_factor").or_insert(p.clone());
            }
            m
        };
        match rp {
            Some(Value::Object(m)) if nested(m) => {
                let part = |k: &str| -> Result<(Map<String, Value>, String)> {
                    let name = format!("rope_parameters.{k}");
                    match m.get(k) {
                        None | Some(Value::Null) => Ok((Map::new(), name)),
                        Some(Value::Object(x)) => Ok((x.clone(), name)),
                        Some(v) => Err(c.err(&name, v, "must be an object")),
                    }
                };
                let (full, fname) = part("full_attention")?;
                let (sliding, sname) = part("sliding_attention")?;
                if arch.default_local_theta.is_none() {
                    return Err(c.err(
                        "rope_parameters",
                        "per layer type",
                        format!("{} has one RoPE for every layer", arch.name),
                    ));
                }
                Ok(RopeSource::PerLayerType {
                    full: (with_top(full), fname),
                    sliding: (sliding, sname),
                })
            }
            Some(Value::Object(m)) => Ok(RopeSource::Single(
                with_top(m.clone()),
                "rope_parameters".into(),
            )),
            Some(v) => Err(c.err("rope_parameters", v, "must be an object")),
            None => {
                // The older style: rope_theta and rope_scaling at the top level.
                let m = match c.get("rope_scaling") {
                    None => Map::new(),
                    Some(Value::Object(m)) => m.clone(),
                    Some(v) => return Err(c.err("rope_scaling", v, "must be an object or null")),
                };
                let m = with_top(m);
                if arch.default_local_theta.is_some() {
                    // Gemma 3: rope_scaling applies to the full-attention layers, the
                    // sliding ones use rope_local_base_freq.
                    let mut s = Map::new();
                    if let Some(t) = c.get("rope_local_base_freq") {
                        s.insert("rope_theta".into(), t.clone());
                    }
                    return Ok(RopeSource::PerLayerType {
                        full: (m, "rope_scaling".into()),
                        sliding: (s, "rope_local_base_freq".into()),
                    });
                }
                Ok(RopeSource::Single(m, "rope_scaling".into()))
            }
        }
    }
}

struct RopeParams {
    theta: Option<f64>,
    partial_rotary: Option<f64>,
    scaling: RopeScaling,
}

/// Keys of a RoPE dict that transformers reads and we understand (others that change
/// the frequencies are refused).
const ROPE_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
    // Qwen3.5's multimodal RoPE: plain RoPE for text (all position components equal).
    "mrope_section",
    "mrope_interleaved",
];

fn rope_params(c: &Cfg, m: &Map<String, Value>, key: &str, max_pos: usize) -> Result<RopeParams> {
    let k = |x: &str| format!("{key}.{x}");
    let num = |x: &str| -> Result<Option<f64>> {
        match m.get(x) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| c.err(&k(x), v, "must be a number")),
        }
    };
    let ty = match m.get("rope_type").or_else(|| m.get("type")) {
        None | Some(Value::Null) => "default".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(c.err(&k("rope_type"), v, "must be a string")),
    };
    for name in m.keys() {
        if !ROPE_KEYS.contains(&name.as_str()) {
            return Err(c.err(
                &k(name),
                &m[name],
                "unknown RoPE parameter: it may change the frequencies, refusing",
            ));
        }
    }
    let theta = num("rope_theta")?;
    if let Some(t) = theta {
        if t <= 0.0 || !t.is_finite() {
            return Err(c.err(&k("rope_theta"), t, "must be > 0"));
        }
    }
    let partial_rotary = num("partial_rotary_factor")?;
    let orig = || -> Result<u32> {
        // transformers gives a top-level original_max_position_embeddings priority.
        let top = c.usize_opt("original_max_position_embeddings")?;
        let inner = num("original_max_position_embeddings")?.map(|x| x as usize);
        let o = top.or(inner).unwrap_or(max_pos);
        if o == 0 || o > u32::MAX as usize {
            return Err(c.err(&k("original_max_position_embeddings"), o, "must be > 0"));
        }
        Ok(o as u32)
    };
    let factor_req = || -> Result<f64> {
        let f = num("factor")?.ok_or_else(|| {
            c.err(
                &k("factor"),
                "missing",
                format!("required for rope_type {ty}"),
            )
        })?;
        if f <= 0.0 || !f.is_finite() {
            return Err(c.err(&k("factor"), f, "must be > 0"));
        }
        Ok(f)
    };
    let scaling = match ty.as_str() {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: factor_req()?,
        },
        "llama3" => {
            let low = num("low_freq_factor")?
                .ok_or_else(|| c.err(&k("low_freq_factor"), "missing", "required for llama3"))?;
            let high = num("high_freq_factor")?
                .ok_or_else(|| c.err(&k("high_freq_factor"), "missing", "required for llama3"))?;
            RopeScaling::Llama3 {
                factor: factor_req()?,
                low,
                high,
                orig: orig()?,
            }
        }
        "yarn" => {
            if let Some(v) = m.get("truncate") {
                if v != &Value::Bool(true) && !v.is_null() {
                    return Err(c.err(
                        &k("truncate"),
                        v,
                        "yarn without truncation is not the spec's yarn",
                    ));
                }
            }
            let orig = orig()?;
            let factor = match num("factor")? {
                Some(f) if f > 0.0 => f,
                Some(f) => return Err(c.err(&k("factor"), f, "must be > 0")),
                None => max_pos as f64 / orig as f64,
            };
            let get_mscale = |s: f64, ms: f64| {
                if s <= 1.0 {
                    1.0
                } else {
                    0.1 * ms * s.ln() + 1.0
                }
            };
            let attn_factor = match num("attention_factor")? {
                Some(a) => a,
                None => {
                    let ms = num("mscale")?.unwrap_or(0.0);
                    let msa = num("mscale_all_dim")?.unwrap_or(0.0);
                    if ms != 0.0 && msa != 0.0 {
                        get_mscale(factor, ms) / get_mscale(factor, msa)
                    } else {
                        get_mscale(factor, 1.0)
                    }
                }
            };
            // transformers: `beta_fast or 32`, `beta_slow or 1` (0 also means the default).
            let bf = num("beta_fast")?.filter(|&x| x != 0.0).unwrap_or(32.0);
            let bs = num("beta_slow")?.filter(|&x| x != 0.0).unwrap_or(1.0);
            RopeScaling::Yarn {
                factor,
                beta_fast: bf,
                beta_slow: bs,
                orig,
                attn_factor,
            }
        }
        other => {
            return Err(c.err(
                &k("rope_type"),
                other,
                "unsupported RoPE type (default, linear, llama3 or yarn)",
            ))
        }
    };
    Ok(RopeParams {
        theta,
        partial_rotary,
        scaling,
    })
}

impl ModelDesc {
    /// The header fields that come from the model (wtype, q8_mask and scale_f16 are
    /// the caller's) and the layer flag bytes (empty without layer flags).
    pub fn header(&self) -> (Header, Vec<u8>) {
        // Saturate: an oversized config value then fails validation instead of wrapping.
        let u = |x: usize| x.min(u32::MAX as usize) as u32;
        let mut h = Header::new();
        h.dim = u(self.dim);
        h.n_layers = u(self.n_layers);
        h.n_heads = u(self.n_heads);
        h.n_kv_heads = u(self.n_kv_heads);
        h.hidden_dim = u(self.hidden_dim);
        h.vocab = u(self.vocab);
        h.max_seq = u(self.max_seq);
        h.norm_eps = self.norm_eps as f32;
        h.shared_classifier = self.tied as u32;
        // head_dim 0 means dim / n_heads: write it only when it differs.
        if !self.dim.is_multiple_of(self.n_heads) || self.dim / self.n_heads != self.head_dim {
            h.head_dim = u(self.head_dim);
        }
        h.qkv_bias = self.arch.qkv_bias as u32;
        h.qk_norm = self.arch.qk_norm as u32;
        h.post_norms = self.arch.post_norms as u32;
        h.act = self.act;
        // Partial rotary: theta^(head_dim / rot_dim) turns the spec's exponent
        // -2i/head_dim into transformers' -2i/rot_dim.
        h.rope_theta = if self.rot_dim < self.head_dim {
            h.rot_dim = u(self.rot_dim);
            self.rope_theta
                .powf(self.head_dim as f64 / self.rot_dim as f64) as f32
        } else {
            self.rope_theta as f32
        };
        // The scaling fields: type, factor, low and high frequency factors (yarn:
        // beta_fast and beta_slow), original context, yarn's attention factor; zero
        // where the type has none.
        let (ty, factor, low, high, orig, attn) = match self.rope {
            RopeScaling::None => (rope_type::PLAIN, 0.0, 0.0, 0.0, 0, 0.0),
            RopeScaling::Linear { factor } => (rope_type::LINEAR, factor, 0.0, 0.0, 0, 0.0),
            RopeScaling::Llama3 {
                factor,
                low,
                high,
                orig,
            } => (rope_type::LLAMA3, factor, low, high, orig, 0.0),
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                orig,
                attn_factor,
            } => (
                rope_type::YARN,
                factor,
                beta_fast,
                beta_slow,
                orig,
                attn_factor,
            ),
        };
        h.rope_type = ty;
        h.rope_factor = factor as f32;
        h.rope_low_freq_factor = low as f32;
        h.rope_high_freq_factor = high as f32;
        h.rope_orig_max_seq = orig;
        h.rope_attn_factor = attn as f32;
        h.sliding_window = u(self.sliding_window.unwrap_or(0));
        let flags: Vec<u8> = self.layers.iter().map(|l| l.bits()).collect();
        if self.layers.iter().any(|l| l.local_rope) {
            h.rope_local_theta = self.rope_local_theta.unwrap_or(0.0) as f32;
        }
        // Layer flags are needed unless every layer is alike and the window, if any,
        // covers every layer.
        let all_plain = flags.iter().all(|&f| f == 0);
        let all_sliding = flags.iter().all(|&f| f == layer_flag::SLIDING);
        let flags = if all_plain || all_sliding {
            if all_plain {
                h.sliding_window = 0;
            }
            Vec::new()
        } else {
            h.layer_flags = 1;
            flags
        };
        if self.arch.gemma {
            h.embed_scale = (self.dim as f32).sqrt();
            h.attn_scale = self.attn_scale.unwrap_or(0.0) as f32;
            h.attn_softcap = self.attn_softcap.unwrap_or(0.0) as f32;
            h.final_softcap = self.final_softcap.unwrap_or(0.0) as f32;
        }
        if self.arch.qwen35 {
            h.attn_gate = 1;
        }
        if let Some(l) = self.linear {
            h.lin_k_heads = u(l.k_heads);
            h.lin_v_heads = u(l.v_heads);
            h.lin_k_dim = u(l.k_dim);
            h.lin_v_dim = u(l.v_dim);
            h.lin_conv = u(l.conv);
        }
        (h, flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn desc(v: Value) -> Result<ModelDesc> {
        parse(Path::new("config.json"), &v)
    }

    fn base(mt: &str) -> Value {
        json!({"model_type": mt, "hidden_size": 64, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 256,
               "max_position_embeddings": 128})
    }

    /// Each size key far above the format's limit fails on the limit, naming the key,
    /// before anything is allocated from it (a per-layer vector of 10^12 entries used
    /// to abort the process).
    #[test]
    fn sizes_above_the_format_limits_fail_before_allocating() {
        for (mt, k) in [
            ("llama", "num_hidden_layers"),
            ("llama", "hidden_size"),
            ("llama", "num_attention_heads"),
            ("llama", "num_key_value_heads"),
            ("llama", "intermediate_size"),
            ("llama", "head_dim"),
            ("llama", "vocab_size"),
            ("gemma3_text", "num_hidden_layers"),
            ("smollm3", "num_hidden_layers"),
            ("qwen3_5_text", "num_hidden_layers"),
            ("qwen3_5_text", "linear_num_value_heads"),
        ] {
            for big in [1u64 << 40, 1_000_000_000_000, u64::MAX] {
                let mut v = base(mt);
                v[k] = json!(big);
                let e = desc(v).unwrap_err().to_string();
                assert!(
                    e.contains(&format!("{k} = {big}: above the format's limit")),
                    "{mt} {k}: {e}"
                );
            }
        }
    }

    #[test]
    fn yarn_factor_from_lengths_and_default_attention_factor() {
        let mut v = base("llama");
        v["rope_parameters"] =
            json!({"rope_type": "yarn", "original_max_position_embeddings": 32, "rope_theta": 1e4});
        let d = desc(v).unwrap();
        let RopeScaling::Yarn {
            factor,
            attn_factor,
            beta_fast,
            beta_slow,
            orig,
        } = d.rope
        else {
            panic!("{:?}", d.rope)
        };
        assert_eq!((factor, orig, beta_fast, beta_slow), (4.0, 32, 32.0, 1.0));
        assert!((attn_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn truncate_false_and_unknown_rope_keys_are_refused() {
        let mut v = base("llama");
        v["rope_parameters"] = json!({"rope_type": "yarn", "factor": 2.0, "truncate": false});
        assert!(desc(v).unwrap_err().to_string().contains("truncate"));
        let mut v = base("llama");
        v["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "short_factor": [1.0]});
        assert!(desc(v).unwrap_err().to_string().contains("short_factor"));
    }

    #[test]
    fn default_layer_types() {
        // Gemma 3 without layer_types: pattern 6 by default (5 sliding, 1 full).
        let mut v = base("gemma3_text");
        v["num_hidden_layers"] = json!(6);
        v["sliding_window"] = json!(16);
        let d = desc(v).unwrap();
        let f: Vec<u8> = d.layers.iter().map(|l| l.bits()).collect();
        assert_eq!(f, vec![3, 3, 3, 3, 3, 0]);
        // Qwen2: sliding from max_window_layers on, only with use_sliding_window.
        let mut v = base("qwen2");
        v["sliding_window"] = json!(16);
        v["max_window_layers"] = json!(2);
        assert!(desc(v.clone()).unwrap().layers.iter().all(|l| !l.sliding));
        v["use_sliding_window"] = json!(true);
        let s: Vec<bool> = desc(v).unwrap().layers.iter().map(|l| l.sliding).collect();
        assert_eq!(s, vec![false, false, true, true]);
        // SmolLM3: every 4th layer has no RoPE by default.
        let d = desc(base("smollm3")).unwrap();
        let n: Vec<bool> = d.layers.iter().map(|l| l.no_rope).collect();
        assert_eq!(n, vec![false, false, false, true]);
        // Qwen3.5: linear attention except every 4th layer; partial rotary 0.25.
        let mut v = base("qwen3_5_text");
        v["head_dim"] = json!(32);
        v["linear_num_key_heads"] = json!(2);
        v["linear_num_value_heads"] = json!(4);
        v["linear_key_head_dim"] = json!(16);
        v["linear_value_head_dim"] = json!(16);
        let d = desc(v).unwrap();
        let l: Vec<bool> = d.layers.iter().map(|l| l.linear).collect();
        assert_eq!(l, vec![true, true, true, false]);
        assert_eq!(d.rot_dim, 8);
    }

    #[test]
    fn mistral_window_covers_every_layer_without_flags() {
        let mut v = base("mistral");
        v["sliding_window"] = json!(8);
        let (h, flags) = desc(v).unwrap().header();
        assert_eq!((h.sliding_window, h.layer_flags), (8, 0));
        assert!(flags.is_empty());
    }

    #[test]
    fn gemma2_defaults_softcaps() {
        let d = desc(base("gemma2")).unwrap();
        assert_eq!((d.attn_softcap, d.final_softcap), (Some(50.0), Some(30.0)));
        let mut v = base("gemma2");
        v["attn_logit_softcapping"] = Value::Null;
        assert_eq!(desc(v).unwrap().attn_softcap, None);
    }

    #[test]
    fn refusals_name_the_key() {
        for (k, val) in [
            ("num_experts", json!(8)),
            ("attention_bias", json!(true)),
            ("use_bidirectional_attention", json!(true)),
        ] {
            let mut v = base("gemma3_text");
            v[k] = val;
            let e = desc(v).unwrap_err().to_string();
            assert!(e.contains(k), "{e}");
        }
        let e = desc(base("mixtral")).unwrap_err().to_string();
        assert!(e.contains("model_type = mixtral"), "{e}");
        let mut v = base("llama");
        v["partial_rotary_factor"] = json!(0.5);
        assert!(desc(v)
            .unwrap_err()
            .to_string()
            .contains("partial_rotary_factor"));
    }
}
