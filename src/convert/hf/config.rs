//! config.json → the model description, one section at a time: refusals, `dims`,
//! `ffn`, `vocab`, `rope` ([`super::rope`]), the sliding window, `layers`, the family's
//! scales and the delta rule's `linear` dimensions; then the description's own rules
//! ([`ModelDesc::check`]), with errors under config.json's keys.
//!
//! Both styles found on the Hub are read: the current one (`rope_parameters`, nested
//! per layer type for Gemma 3, `layer_types`) and the older one (`rope_theta` and
//! `rope_scaling` at the top level, Gemma 3's `rope_local_base_freq` and
//! `sliding_window_pattern`, SmolLM3's `no_rope_layers`). Multimodal wrappers
//! (`text_config`) are read through their text model.
//!
//! Gemma: attn_scale = query_pre_attn_scalar^-0.5 (embed_scale = sqrt(dim) is the
//! header's, from the family).
//!
//! Keys that change the math in a way the format cannot express are refused by name.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::arch::{self, DefaultLayerTypes, HfArch, HfMoe, Window};
use super::json::Cfg;
use super::rope::rope;
use crate::convert::arch::Scales;
use crate::convert::desc::{AttnScales, Dims, Ffn, LayerFlags, LinearDims, ModelDesc, Moe, Vocab};
use crate::convert::error::{ConvertError, DescField, Result};
use crate::format::mlb::header::{act, moe_gating, pooling};
use crate::format::mlb::validate::{DIM_LIMIT, SEQ_LIMIT};

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
    let mut desc = parse(&file, &v)?;
    desc.pooling = super::pooling::pooling_of(dir, &mut desc.notes)?;
    Ok(desc)
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
        let tmt = c.str_opt("model_type")?.unwrap_or(a.arch.name);
        if arch::by_model_type(tmt).map(|x| x.arch.name) != Some(a.arch.name) {
            return Err(c.err(
                "model_type",
                tmt,
                format!("a {mt} wrapper must hold a {} text model", a.arch.name),
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

/// The description of the text model `arch` whose keys `c` reads (`top`: the file's
/// object, which holds a wrapper's own keys).
fn describe(
    arch: &'static HfArch,
    c: &Cfg,
    top: &Map<String, Value>,
    wrapper: Option<String>,
) -> Result<ModelDesc> {
    let mut notes = Vec::new();
    refusals(arch, c, &mut notes)?;
    let dims = dims(arch, c, &mut notes)?;
    let (moe, moe_layers) = moe(arch, c, dims.n_layers)?;
    let (ffn, act_name) = ffn(arch, c, moe.as_ref(), &moe_layers)?;
    let vocab = vocab(arch, c, top, wrapper.is_some())?;
    let norm_eps = c.f64_opt("rms_norm_eps")?.unwrap_or(arch.default_rms_eps);
    let (rope, prf) = rope(arch, c, dims.head_dim, dims.max_seq)?;
    let sliding_window = window(arch, c)?;
    let mut layers = layers(arch, c, dims.n_layers, sliding_window, rope.local_theta)?;
    for (l, m) in layers.iter_mut().zip(&moe_layers) {
        l.moe = *m;
    }
    let scales = scales(arch, c)?;
    let linear = linear(arch, c, &layers)?;
    if let Some(w) = &wrapper {
        notes.push(format!(
            "{w} is a multimodal checkpoint: converting its text model ({}), not its vision tower",
            arch.arch.name
        ));
    }
    let desc = ModelDesc {
        arch: arch.arch,
        wrapper,
        dims,
        ffn,
        vocab,
        norm_eps,
        rope,
        sliding_window,
        layers,
        scales,
        linear,
        moe,
        pooling: pooling::NONE,
        notes,
    };
    let hm = arch.moe.as_ref();
    desc.check().map_err(|e| {
        let (key, value) = match e.field {
            DescField::RotDim => ("partial_rotary_factor", Some(prf.to_string())),
            DescField::RopeScaling => ("rope_type", None),
            DescField::Act => (arch.act_key, Some(act_name.to_string())),
            DescField::SlidingWindow => ("sliding_window", None),
            DescField::Layers => ("layer_types", None),
            DescField::Experts => (experts_key(hm, c), None),
            DescField::ExpertsUsed => ("num_experts_per_tok", None),
            DescField::ExpertHidden => (hm.map_or("", |m| m.hidden_key), None),
            DescField::SharedHidden => (hm.and_then(|m| m.shared_key).map_or("", |(k, _)| k), None),
        };
        e.at(c.file, c.key(key), value)
    })?;
    Ok(desc)
}

/// Keys the format cannot express (mixture of experts in a family without it, biases
/// the format lacks), and notes on keys transformers ignores.
fn refusals(arch: &HfArch, c: &Cfg, notes: &mut Vec<String>) -> Result<()> {
    // The experts' own keys, in a family that reads them.
    let read = |k: &str| {
        arch.moe.as_ref().is_some_and(|m| {
            EXPERTS_KEYS.contains(&k)
                || k == m.hidden_key
                || m.shared_key.is_some_and(|(s, _)| s == k)
        })
    };
    for (k, why) in UNSUPPORTED_KEYS {
        if read(k) {
            continue;
        }
        if let Some(v) = c.m.get(*k) {
            if is_set(v) {
                return Err(c.err(k, v, *why));
            }
        }
    }
    // q/k/v/o biases: Qwen2's q/k/v biases and gpt-oss's q/k/v/o have a place in the
    // format.
    if c.bool_opt("attention_bias")? == Some(true) && !arch.arch.o_bias {
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
    Ok(())
}

/// A size key within the format's `limit`, checked before anything is allocated per
/// layer or per token.
fn within(c: &Cfg, k: &str, v: usize, limit: u32) -> Result<usize> {
    if v > limit as usize {
        return Err(c.err(k, v, format!("above the format's limit {limit}")));
    }
    Ok(v)
}

/// The `dims` section: width, layers, heads, head size, context.
fn dims(arch: &HfArch, c: &Cfg, notes: &mut Vec<String>) -> Result<Dims> {
    let dim = c.usize_req("hidden_size")?;
    let n_layers = c.usize_req("num_hidden_layers")?;
    let n_heads = c.usize_req("num_attention_heads")?;
    let n_kv_heads = c.usize_opt("num_key_value_heads")?.unwrap_or(n_heads);
    if n_heads == 0 || n_layers == 0 {
        return Err(c.err("num_attention_heads", n_heads, "must not be zero"));
    }
    let head_dim = match c.usize_opt("head_dim")? {
        Some(h) => h,
        None => arch.default_head_dim.unwrap_or(dim / n_heads),
    };
    let mut max_seq = c
        .usize_opt("max_position_embeddings")?
        .unwrap_or(arch.default_max_pos);
    if max_seq > SEQ_LIMIT as usize {
        notes.push(format!(
            "max_position_embeddings {max_seq} clamped to the format's limit {SEQ_LIMIT}"
        ));
        max_seq = SEQ_LIMIT as usize;
    }
    Ok(Dims {
        dim: within(c, "hidden_size", dim, DIM_LIMIT)?,
        n_layers: within(c, "num_hidden_layers", n_layers, DIM_LIMIT)?,
        n_heads: within(c, "num_attention_heads", n_heads, DIM_LIMIT)?,
        n_kv_heads: within(c, "num_key_value_heads", n_kv_heads, DIM_LIMIT)?,
        head_dim: within(c, "head_dim", head_dim, DIM_LIMIT)?,
        max_seq,
    })
}

/// The `ffn` section: the MLP's width and activation (with the activation's name as
/// config.json spells it). With experts in every layer the width is the experts'
/// (the header's hidden_dim is then not used); with some dense layers it is theirs.
fn ffn<'a>(
    arch: &HfArch,
    c: &Cfg<'a>,
    moe: Option<&Moe>,
    moe_layers: &[bool],
) -> Result<(Ffn, &'a str)> {
    let hidden_dim = match moe {
        Some(m) if moe_layers.iter().all(|&x| x) => m.expert_hidden,
        _ => c.usize_req("intermediate_size")?,
    };
    let hidden_dim = within(c, "intermediate_size", hidden_dim, DIM_LIMIT)?;
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
    Ok((Ffn { hidden_dim, act }, act_name))
}

/// The `vocab` section: its size, and whether the classifier is the embedding (the
/// wrapper's key decides for a multimodal model).
fn vocab(arch: &HfArch, c: &Cfg, top: &Map<String, Value>, wrapped: bool) -> Result<Vocab> {
    let size = c.usize_req("vocab_size")?;
    let size = within(c, "vocab_size", size, SEQ_LIMIT)?;
    let tied = match top.get("tie_word_embeddings") {
        Some(Value::Bool(b)) if wrapped => *b,
        _ => c
            .bool_opt("tie_word_embeddings")?
            .unwrap_or(arch.default_tie),
    };
    Ok(Vocab { size, tied })
}

/// The sliding window, where the architecture uses one.
fn window(arch: &HfArch, c: &Cfg) -> Result<Option<usize>> {
    let window = c.usize_opt("sliding_window")?.filter(|&w| w > 0);
    let use_sw = c.bool_opt("use_sliding_window")?.unwrap_or(false);
    Ok(match arch.window {
        Window::None => None,
        Window::AllLayers | Window::LayerTypes => window,
        Window::LayerTypesIfUsed | Window::AllLayersIfUsed => window.filter(|_| use_sw),
    })
}

/// The keys of the number of experts: transformers 5 writes `num_local_experts` for
/// classes that read `num_experts` (and the older configs the other way round).
const EXPERTS_KEYS: [&str; 2] = ["num_experts", "num_local_experts"];

/// The key config.json gives the number of experts under.
fn experts_key(m: Option<&HfMoe>, c: &Cfg) -> &'static str {
    let Some(m) = m else { return "num_experts" };
    let other = EXPERTS_KEYS.into_iter().find(|k| *k != m.experts_key);
    match other {
        Some(o) if !c.m.contains_key(m.experts_key) && c.m.contains_key(o) => o,
        _ => m.experts_key,
    }
}

/// The `moe` section: the experts' sizes and routing, and which layers have them
/// (Qwen3-MoE: not the `mlp_only_layers`, and every `decoder_sparse_step`-th).
fn moe(arch: &HfArch, c: &Cfg, n: usize) -> Result<(Option<Moe>, Vec<bool>)> {
    let (Some(hm), Some(am)) = (arch.moe.as_ref(), arch.arch.moe) else {
        return Ok((None, vec![false; n]));
    };
    let size = |k: &str, default: usize| -> Result<usize> {
        within(c, k, c.usize_opt(k)?.unwrap_or(default), DIM_LIMIT)
    };
    let ek = experts_key(Some(hm), c);
    let n_experts = size(ek, hm.default_experts)?;
    let n_used = size("num_experts_per_tok", hm.default_used)?;
    let expert_hidden = size(hm.hidden_key, hm.default_hidden)?;
    let shared_hidden = match hm.shared_key {
        Some((k, d)) => size(k, d)?,
        None => 0,
    };
    let gating = match am.gating {
        Some(g) => g,
        None => {
            let norm = c
                .bool_opt("norm_topk_prob")?
                .unwrap_or(hm.default_norm_topk);
            if norm {
                moe_gating::SOFTMAX_TOPK_NORM
            } else {
                moe_gating::SOFTMAX_TOPK
            }
        }
    };
    let swiglu = match hm.default_swiglu {
        Some((limit, alpha)) => {
            let limit = c.f64_opt("swiglu_limit")?.unwrap_or(limit);
            let alpha = c.f64_opt("swiglu_alpha")?.unwrap_or(alpha);
            if !(limit > 0.0 && limit.is_finite()) {
                return Err(c.err("swiglu_limit", limit, "must be a finite number > 0"));
            }
            if !(alpha > 0.0 && alpha.is_finite()) {
                return Err(c.err("swiglu_alpha", alpha, "must be a finite number > 0"));
            }
            Some((limit as f32, alpha as f32))
        }
        None => None,
    };
    let layers = if hm.sparse_layers {
        let step = c.usize_opt("decoder_sparse_step")?.unwrap_or(1);
        if step == 0 {
            return Err(c.err("decoder_sparse_step", 0, "must be ≥ 1"));
        }
        let only = match c.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_u64().map(|x| x as usize).ok_or_else(|| {
                        c.err(&format!("mlp_only_layers[{i}]"), x, "must be a layer index")
                    })
                })
                .collect::<Result<Vec<usize>>>()?,
            Some(v) => return Err(c.err("mlp_only_layers", v, "must be a list of layer indices")),
        };
        (0..n)
            .map(|i| !only.contains(&i) && (i + 1) % step == 0)
            .collect()
    } else {
        vec![true; n]
    };
    let moe = Moe {
        n_experts,
        n_used,
        expert_hidden,
        gating,
        shared_hidden,
        swiglu,
    };
    Ok((layers.iter().any(|&m| m).then_some(moe), layers))
}

/// The `layers` section: each layer's kind (`layer_types`), window and RoPE flags.
fn layers(
    arch: &HfArch,
    c: &Cfg,
    n_layers: usize,
    window: Option<usize>,
    local_theta: Option<f64>,
) -> Result<Vec<LayerFlags>> {
    let layer_types = layer_types(arch, c, n_layers)?;
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
                k.local_rope = local_theta.is_some();
            }
            "linear_attention" if arch.arch.linear_attention => k.linear = true,
            other => {
                return Err(c.err(
                    &format!("layer_types[{i}]"),
                    other,
                    format!("unsupported layer type for {}", arch.arch.name),
                ))
            }
        }
        if matches!(arch.window, Window::AllLayers | Window::AllLayersIfUsed) && window.is_some() {
            k.sliding = true;
        }
        k.no_rope = no_rope[i];
        layers.push(k);
    }
    Ok(layers)
}

/// The family's attention scales: Gemma's query_pre_attn_scalar and softcaps; other
/// families refuse softcaps.
fn scales(arch: &HfArch, c: &Cfg) -> Result<AttnScales> {
    match arch.arch.scales {
        Scales::Gemma => {
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
            Ok(AttnScales {
                attn: Some(q.powf(-0.5)),
                attn_softcap: cap("attn_logit_softcapping", arch.default_softcaps.0)?,
                final_softcap: cap("final_logit_softcapping", arch.default_softcaps.1)?,
            })
        }
        Scales::None => {
            for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
                if let Some(v) = c.m.get(k) {
                    if is_set(v) {
                        return Err(c.err(
                            k,
                            v,
                            format!("softcapping is not part of {}", arch.arch.name),
                        ));
                    }
                }
            }
            Ok(AttnScales::default())
        }
    }
}

/// The `linear` section: the delta rule's dimensions, when some layer has it.
fn linear(arch: &HfArch, c: &Cfg, layers: &[LayerFlags]) -> Result<Option<LinearDims>> {
    let Some(def) = arch.default_linear else {
        return Ok(None);
    };
    let dim = |k: &str, default: usize| -> Result<usize> {
        within(c, k, c.usize_opt(k)?.unwrap_or(default), DIM_LIMIT)
    };
    Ok(Some(LinearDims {
        k_heads: dim("linear_num_key_heads", def.k_heads)?,
        v_heads: dim("linear_num_value_heads", def.v_heads)?,
        k_dim: dim("linear_key_head_dim", def.k_dim)?,
        v_dim: dim("linear_value_head_dim", def.v_dim)?,
        conv: dim("linear_conv_kernel_dim", def.conv)?,
    })
    .filter(|_| layers.iter().any(|l| l.linear)))
}

/// `layer_types` from the config or as transformers fills it in.
fn layer_types(arch: &HfArch, c: &Cfg, n: usize) -> Result<Vec<String>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::desc::RopeScaling;
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
        let RopeScaling::Yarn(y) = d.rope.scaling else {
            panic!("{:?}", d.rope.scaling)
        };
        assert_eq!(
            (y.factor, y.orig, y.beta_fast, y.beta_slow),
            (4.0, 32, 32.0, 1.0)
        );
        assert!((y.attn_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn truncate_false_is_rope_type_4_and_unknown_rope_keys_are_refused() {
        let mut v = base("llama");
        v["rope_parameters"] = json!({"rope_type": "yarn", "factor": 2.0, "truncate": false});
        assert_eq!(desc(v).unwrap().header().0.rope_type, 4);
        let mut v = base("llama");
        v["rope_parameters"] = json!({"rope_type": "yarn", "factor": 2.0, "truncate": 1});
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
        assert_eq!(d.rope.rot_dim, 8);
    }

    #[test]
    fn mistral_window_covers_every_layer_without_flags() {
        let mut v = base("mistral");
        v["sliding_window"] = json!(8);
        let (h, flags) = desc(v).unwrap().header();
        assert_eq!((h.sliding_window, h.layer_flags), (8, 0));
        assert!(flags.is_empty());
    }

    /// The experts' fields from each MoE family's keys: Qwen3-MoE's dense layers,
    /// OLMoE's default gating, gpt-oss's SwiGLU defaults; and the refusals, by key.
    #[test]
    fn moe_sections() {
        let mut v = base("qwen3_moe");
        v["num_experts"] = json!(8);
        v["num_experts_per_tok"] = json!(2);
        v["moe_intermediate_size"] = json!(32);
        v["mlp_only_layers"] = json!([1]);
        v["decoder_sparse_step"] = json!(1);
        v["norm_topk_prob"] = json!(true);
        let (h, flags) = desc(v.clone()).unwrap().header();
        assert_eq!(flags, vec![16, 0, 16, 16]);
        assert_eq!(
            (
                h.n_experts,
                h.n_experts_used,
                h.expert_hidden,
                h.moe_gating,
                h.hidden_dim
            ),
            (8, 2, 32, 1, 128)
        );
        v["num_experts_per_tok"] = json!(9);
        let e = desc(v.clone()).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok = 9"), "{e}");
        v["num_experts_per_tok"] = json!(2);
        v["moe_intermediate_size"] = json!(40);
        let e = desc(v).unwrap_err().to_string();
        assert!(e.contains("moe_intermediate_size = 40"), "{e}");
        let mut v = base("olmoe");
        v["intermediate_size"] = json!(32);
        let (h, _) = desc(v).unwrap().header();
        assert_eq!(
            (h.n_experts, h.moe_gating, h.qk_norm, h.hidden_dim),
            (64, 0, 2, 32)
        );
        let mut v = base("gpt_oss");
        v["intermediate_size"] = json!(32);
        v["attention_bias"] = json!(true);
        let (h, _) = desc(v).unwrap().header();
        assert_eq!(
            (h.moe_gating, h.moe_flags, h.qkv_bias, h.attn_sinks),
            (2, 3, 2, 1)
        );
        assert_eq!((h.swiglu_limit, h.swiglu_alpha), (7.0, 1.702));
        // Experts keys in a dense family stay refused.
        let mut v = base("qwen3");
        v["num_experts"] = json!(8);
        assert!(desc(v).unwrap_err().to_string().contains("num_experts"));
    }

    #[test]
    fn gemma2_defaults_softcaps() {
        let d = desc(base("gemma2")).unwrap();
        assert_eq!(
            (d.scales.attn_softcap, d.scales.final_softcap),
            (Some(50.0), Some(30.0))
        );
        let mut v = base("gemma2");
        v["attn_logit_softcapping"] = Value::Null;
        assert_eq!(desc(v).unwrap().scales.attn_softcap, None);
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
        let e = desc(base("granitemoe")).unwrap_err().to_string();
        assert!(e.contains("model_type = granitemoe"), "{e}");
        let mut v = base("llama");
        v["partial_rotary_factor"] = json!(0.5);
        assert!(desc(v)
            .unwrap_err()
            .to_string()
            .contains("partial_rotary_factor"));
    }
}
