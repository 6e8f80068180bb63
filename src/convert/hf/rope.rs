//! config.json's RoPE parameters, in both styles found on the Hub: the current one
//! (`rope_parameters`, nested per layer type for Gemma 3) and the older one
//! (`rope_theta` and `rope_scaling` at the top level, Gemma 3's `rope_local_base_freq`).
//!
//! Formulas, as transformers computes them:
//! - partial rotary: rot_dim = head_dim · partial_rotary_factor.
//! - yarn: attention_factor from the config, else get_mscale(f, mscale) /
//!   get_mscale(f, mscale_all_dim) when both are set, else 0.1·ln f + 1 (1 for f ≤ 1);
//!   beta_fast 32 and beta_slow 1 by default; factor = max_pos / orig when null.

use serde_json::{Map, Value};

use super::arch::HfArch;
use super::json::Cfg;
use crate::convert::desc::{Rope, RopeScaling, Yarn};
use crate::convert::error::Result;

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
    fn read(arch: &HfArch, c: &Cfg) -> Result<RopeSource> {
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
                        format!("{} has one RoPE for every layer", arch.arch.name),
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

/// One RoPE dict of config.json (`key` names it in errors), read with `max_pos`, the
/// model's context.
struct RopeDict<'a> {
    c: &'a Cfg<'a>,
    m: &'a Map<String, Value>,
    key: &'a str,
    max_pos: usize,
}

impl RopeDict<'_> {
    fn k(&self, x: &str) -> String {
        format!("{}.{x}", self.key)
    }

    fn num(&self, x: &str) -> Result<Option<f64>> {
        match self.m.get(x) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.c.err(&self.k(x), v, "must be a number")),
        }
    }

    /// The original context; transformers gives a top-level
    /// original_max_position_embeddings priority.
    fn orig(&self) -> Result<u32> {
        let top = self.c.usize_opt("original_max_position_embeddings")?;
        let inner = self
            .num("original_max_position_embeddings")?
            .map(|x| x as usize);
        let o = top.or(inner).unwrap_or(self.max_pos);
        if o == 0 || o > u32::MAX as usize {
            return Err(self.c.err(
                &self.k("original_max_position_embeddings"),
                o,
                "must be > 0",
            ));
        }
        Ok(o as u32)
    }

    /// The scaling factor that rope type `ty` requires.
    fn factor_req(&self, ty: &str) -> Result<f64> {
        let f = self.num("factor")?.ok_or_else(|| {
            self.c.err(
                &self.k("factor"),
                "missing",
                format!("required for rope_type {ty}"),
            )
        })?;
        if f <= 0.0 || !f.is_finite() {
            return Err(self.c.err(&self.k("factor"), f, "must be > 0"));
        }
        Ok(f)
    }
}

fn rope_params(c: &Cfg, m: &Map<String, Value>, key: &str, max_pos: usize) -> Result<RopeParams> {
    let d = RopeDict { c, m, key, max_pos };
    let ty = match m.get("rope_type").or_else(|| m.get("type")) {
        None | Some(Value::Null) => "default".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(c.err(&d.k("rope_type"), v, "must be a string")),
    };
    for name in m.keys() {
        if !ROPE_KEYS.contains(&name.as_str()) {
            return Err(c.err(
                &d.k(name),
                &m[name],
                "unknown RoPE parameter: it may change the frequencies, refusing",
            ));
        }
    }
    let theta = d.num("rope_theta")?;
    if let Some(t) = theta {
        if t <= 0.0 || !t.is_finite() {
            return Err(c.err(&d.k("rope_theta"), t, "must be > 0"));
        }
    }
    let partial_rotary = d.num("partial_rotary_factor")?;
    let scaling = match ty.as_str() {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: d.factor_req(&ty)?,
        },
        "llama3" => llama3(&d, &ty)?,
        "yarn" => yarn(&d)?,
        other => {
            return Err(c.err(
                &d.k("rope_type"),
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

/// Llama 3's frequency bands.
fn llama3(d: &RopeDict, ty: &str) -> Result<RopeScaling> {
    let low = d.num("low_freq_factor")?.ok_or_else(|| {
        d.c.err(&d.k("low_freq_factor"), "missing", "required for llama3")
    })?;
    let high = d.num("high_freq_factor")?.ok_or_else(|| {
        d.c.err(&d.k("high_freq_factor"), "missing", "required for llama3")
    })?;
    Ok(RopeScaling::Llama3 {
        factor: d.factor_req(ty)?,
        low,
        high,
        orig: d.orig()?,
    })
}

/// Yarn, as transformers computes its defaults: the factor from the lengths, the
/// attention factor from the mscales, betas 32 and 1.
fn yarn(d: &RopeDict) -> Result<RopeScaling> {
    // gpt-oss's `truncate: false` leaves the correction range unrounded (rope_type 4).
    let truncate = match d.m.get("truncate") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(d.c.err(&d.k("truncate"), v, "must be true or false")),
    };
    let orig = d.orig()?;
    let factor = match d.num("factor")? {
        Some(f) if f > 0.0 => f,
        Some(f) => return Err(d.c.err(&d.k("factor"), f, "must be > 0")),
        None => d.max_pos as f64 / orig as f64,
    };
    let get_mscale = |s: f64, ms: f64| {
        if s <= 1.0 {
            1.0
        } else {
            0.1 * ms * s.ln() + 1.0
        }
    };
    let attn_factor = match d.num("attention_factor")? {
        Some(a) => a,
        None => {
            let ms = d.num("mscale")?.unwrap_or(0.0);
            let msa = d.num("mscale_all_dim")?.unwrap_or(0.0);
            if ms != 0.0 && msa != 0.0 {
                get_mscale(factor, ms) / get_mscale(factor, msa)
            } else {
                get_mscale(factor, 1.0)
            }
        }
    };
    // transformers: `beta_fast or 32`, `beta_slow or 1` (0 also means the default).
    let bf = d.num("beta_fast")?.filter(|&x| x != 0.0).unwrap_or(32.0);
    let bs = d.num("beta_slow")?.filter(|&x| x != 0.0).unwrap_or(1.0);
    Ok(RopeScaling::Yarn(Yarn {
        factor,
        beta_fast: bf,
        beta_slow: bs,
        orig,
        attn_factor,
        truncate,
    }))
}

/// The `rope` section: the base, the scaling, the rotated dimensions and the sliding
/// layers' local base; with the partial_rotary_factor that gave rot_dim (errors about
/// rot_dim name it).
pub fn rope(arch: &HfArch, c: &Cfg, head_dim: usize, max_seq: usize) -> Result<(Rope, f64)> {
    let (global, local) = match RopeSource::read(arch, c)? {
        RopeSource::Single(m, key) => (rope_params(c, &m, &key, max_seq)?, None),
        RopeSource::PerLayerType { full, sliding } => (
            rope_params(c, &full.0, &full.1, max_seq)?,
            Some(rope_params(c, &sliding.0, &sliding.1, max_seq)?),
        ),
    };
    let prf = global.partial_rotary.unwrap_or(arch.default_partial_rotary);
    let local_theta = match (&local, arch.default_local_theta) {
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
    let rope = Rope {
        theta: global.theta.unwrap_or(arch.default_theta),
        scaling: global.scaling,
        local_theta,
        rot_dim: (head_dim as f64 * prf) as usize,
    };
    Ok((rope, prf))
}
