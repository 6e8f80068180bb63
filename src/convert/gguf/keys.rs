//! A model description → llama.cpp's metadata keys (`mlb-export`), one section at a
//! time: what llama.cpp computes on its own must be what the header says
//! ([`Keys::llama_cpp_computes`]), then `general`, `dims`, `rope` (Llama 3 scaling as
//! `rope_freqs` factors), the family's `scales`, the sliding `window` and the delta
//! rule's `linear` keys. Each key is what [`super::desc`] reads back to the same
//! description; what it would read differently is refused by the header field's name.

use std::path::Path;

use super::arch::{GgufArch, RopeRows};
use super::rope::llama3_factors;
use crate::convert::arch::Scales;
use crate::convert::desc::{ModelDesc, RopeScaling};
use crate::convert::error::{ConvertError, Result};
use crate::format::gguf::{MetaValue, ValueType};
use crate::format::mlb::header::{
    act, layer_flag, moe_flag, moe_gating, pooling, qkv_bias, rope_type, Header,
};

/// The keys of one GGUF architecture, in the order they are written.
pub struct Keys<'a> {
    /// The `.mlb` file (errors name it).
    pub input: &'a Path,
    pub ga: &'static GgufArch,
    pub desc: &'a ModelDesc,
    /// The header the description was read from, for the family's own fields.
    pub header: &'a Header,
    /// The header's layer flag bytes (errors show them as stored).
    pub flags: &'a [u8],
    pub kv: Vec<(String, MetaValue)>,
}

fn field(input: &Path, f: &str, v: impl std::fmt::Display, msg: impl Into<String>) -> ConvertError {
    ConvertError::config(input, f, v, msg)
}

impl Keys<'_> {
    fn err(&self, f: &str, v: impl std::fmt::Display, msg: impl Into<String>) -> ConvertError {
        field(self.input, f, v, msg)
    }

    fn push(&mut self, suffix: &str, v: MetaValue) {
        self.kv.push((format!("{}.{suffix}", self.ga.name), v));
    }

    /// Refuses what llama.cpp computes on its own differently from the header: the
    /// attention gate, the value-head size, the output bias and sinks, the activation,
    /// the scales, the window, q/k norms, the no-RoPE layers.
    pub fn llama_cpp_computes(&self) -> Result<()> {
        let (h, d, ga, a) = (self.header, self.desc, self.ga, self.ga.name);
        if ga.arch.attn_gate && h.attn_gate == 0 {
            return Err(self.err(
                "attn_gate",
                0,
                format!("llama.cpp's {a} gates every attention layer"),
            ));
        }
        if let Some(l) = d.linear.filter(|l| l.k_dim != l.v_dim) {
            return Err(self.err(
                "lin_v_dim",
                l.v_dim,
                format!(
                    "llama.cpp's {a} has value heads of the key head size ({})",
                    l.k_dim
                ),
            ));
        }
        // (field, value, whether the header has it, whether llama.cpp's family does):
        // tensors llama.cpp's architecture requires, or would drop.
        let tensors = [
            (
                "qkv_bias",
                h.qkv_bias,
                h.qkv_bias == qkv_bias::QKVO,
                ga.arch.o_bias,
                "the output projection's bias",
            ),
            (
                "attn_sinks",
                h.attn_sinks,
                h.attn_sinks != 0,
                ga.arch.attn_sinks,
                "attention sinks",
            ),
        ];
        if let Some((f, v, _, want, what)) = tensors.into_iter().find(|x| x.2 != x.3) {
            let has = if want { "needs" } else { "has no" };
            return Err(self.err(f, v, format!("llama.cpp's {a} {has} {what}")));
        }
        if d.ffn.act != ga.act {
            return Err(self.err("act", h.act, format!("{a} uses {}", act::name(ga.act))));
        }
        match ga.arch.scales {
            Scales::Gemma => self.gemma_scales()?,
            Scales::None => self.no_scales()?,
        }
        for (l, (flags, &f)) in d.layers.iter().zip(self.flags).enumerate() {
            let want_no_rope = ga.no_rope_every.is_some_and(|k| (l + 1) % k == 0);
            if flags.no_rope != want_no_rope {
                return Err(self.err(
                    &format!("layer_flags[{l}]"),
                    f,
                    format!("llama.cpp's {a} has no RoPE exactly on every fourth layer"),
                ));
            }
        }
        Ok(())
    }

    /// Gemma: embeddings by sqrt(dim), the attention scale llama.cpp computes, an
    /// attention softcap only where it reads one.
    fn gemma_scales(&self) -> Result<()> {
        let (h, d, a) = (self.header, self.desc, self.ga.name);
        let sqrt_dim = (d.dims.dim as f32).sqrt();
        if h.embed_scale != sqrt_dim {
            return Err(self.err(
                "embed_scale",
                h.embed_scale,
                format!("llama.cpp's {a} scales embeddings by sqrt(dim) = {sqrt_dim}"),
            ));
        }
        let (hd, want) = self.ga.attn_scale(&d.dims);
        let want = want as f32;
        if h.attn_scale != want {
            return Err(self.err(
                "attn_scale",
                h.attn_scale,
                format!("llama.cpp's {a} computes 1/sqrt({hd}) = {want}"),
            ));
        }
        if self.ga.softcaps.attn.is_none() && h.attn_softcap != 0.0 {
            return Err(self.err(
                "attn_softcap",
                h.attn_softcap,
                format!("llama.cpp's {a} has no attention softcap"),
            ));
        }
        Ok(())
    }

    /// Other families: no extra scales, no window, q/k norms only where llama.cpp has
    /// them.
    fn no_scales(&self) -> Result<()> {
        let (h, d, a) = (self.header, self.desc, self.ga.name);
        for (f, v) in [
            ("embed_scale", h.embed_scale),
            ("attn_softcap", h.attn_softcap),
            ("final_softcap", h.final_softcap),
        ] {
            if v != 0.0 && !(f == "embed_scale" && v == 1.0) {
                return Err(self.err(f, v, format!("llama.cpp's {a} has no such factor")));
            }
        }
        let default = (1.0 / (d.dims.head_dim as f64).sqrt()) as f32;
        if h.attn_scale != 0.0 && h.attn_scale != default {
            return Err(self.err(
                "attn_scale",
                h.attn_scale,
                format!("llama.cpp's {a} uses 1/sqrt(head_dim)"),
            ));
        }
        if self.ga.swa.is_none() && d.layers.iter().any(|l| l.sliding) {
            return Err(self.err(
                "sliding_window",
                h.sliding_window,
                format!("llama.cpp's {a} has no sliding window"),
            ));
        }
        if h.qk_norm != 0 && !self.ga.arch.qk_norm {
            return Err(self.err("qk_norm", 1, format!("llama.cpp's {a} has no q/k norm")));
        }
        Ok(())
    }

    /// `general.*`: the architecture, the type and the name.
    pub fn general(&mut self, name: String) {
        self.kv.extend([
            (
                "general.architecture".into(),
                MetaValue::Str(self.ga.name.into()),
            ),
            ("general.type".into(), MetaValue::Str("model".into())),
            ("general.name".into(), MetaValue::Str(name)),
        ]);
    }

    /// The sizes, the base and the rotated dimensions. The header stores a partial
    /// rotary's base as θ^(head_dim/rot_dim) (the spec's exponent); llama.cpp's is θ
    /// itself: refused when it would not read back the same.
    pub fn dims(&mut self) -> Result<()> {
        let (d, h) = (self.desc, self.header);
        let (hd, rot) = (d.dims.head_dim, d.rope.rot_dim);
        let rope_base = d.rope.theta as f32;
        if rot < hd && ((rope_base as f64).powf(hd as f64 / rot as f64) as f32) != h.rope_theta {
            return Err(self.err(
                "rope_theta",
                h.rope_theta,
                format!("not θ^({hd}/{rot}) of an f32 θ"),
            ));
        }
        let u = |x: usize| MetaValue::U32(x as u32);
        for (k, v) in [
            ("block_count", u(d.dims.n_layers)),
            ("context_length", u(d.dims.max_seq)),
            ("embedding_length", u(d.dims.dim)),
            ("feed_forward_length", u(d.ffn.hidden_dim)),
            ("attention.head_count", u(d.dims.n_heads)),
            ("attention.head_count_kv", u(d.dims.n_kv_heads)),
            ("rope.freq_base", MetaValue::F32(rope_base)),
            (
                "attention.layer_norm_rms_epsilon",
                MetaValue::F32(d.norm_eps as f32),
            ),
            ("attention.key_length", u(hd)),
            ("attention.value_length", u(hd)),
            ("rope.dimension_count", u(rot)),
            ("vocab_size", u(d.vocab.size)),
        ] {
            self.push(k, v);
        }
        // The pooling hint as llama.cpp's pooling_type (1 mean, 2 cls, 3 last).
        let pooling_type = match h.pooling {
            pooling::MEAN => Some(1),
            pooling::CLS => Some(2),
            pooling::LAST => Some(3),
            _ => None,
        };
        if let Some(p) = pooling_type {
            self.push("pooling_type", MetaValue::U32(p));
        }
        Ok(())
    }

    /// RoPE scaling: linear and yarn as keys, Llama 3 as llama.cpp's per-frequency
    /// factors (returned: the `rope_freqs.weight` tensor).
    pub fn rope(&mut self) -> Result<Option<Vec<f32>>> {
        let (d, a) = (self.desc, self.ga.name);
        match d.rope.scaling {
            RopeScaling::None => Ok(None),
            RopeScaling::Linear { factor } => {
                self.push("rope.scaling.type", MetaValue::Str("linear".into()));
                self.push("rope.scaling.factor", MetaValue::F32(factor as f32));
                Ok(None)
            }
            RopeScaling::Yarn(y) => {
                let (factor, attn_factor) = (y.factor, y.attn_factor);
                let (bf, bs) = (y.beta_fast as f32, y.beta_slow as f32);
                if bf != 32.0 || bs != 1.0 {
                    return Err(self.err("rope_low_freq_factor", bf, format!("llama.cpp's {a} uses yarn's beta_fast 32 and beta_slow 1 (this file: {bf} and {bs})")));
                }
                let mscale = if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * factor.ln() + 1.0
                };
                // llama.cpp multiplies get_mscale(f) by rope.scaling.attn_factor (default 1).
                let attn = (attn_factor / mscale) as f32;
                if (mscale * attn as f64) as f32 != attn_factor as f32 {
                    return Err(self.err(
                        "rope_attn_factor",
                        attn_factor as f32,
                        "not expressible as llama.cpp's yarn attention factor",
                    ));
                }
                self.push("rope.scaling.type", MetaValue::Str("yarn".into()));
                self.push("rope.scaling.factor", MetaValue::F32(factor as f32));
                self.push(
                    "rope.scaling.original_context_length",
                    MetaValue::U32(y.orig),
                );
                if attn != 1.0 {
                    self.push("rope.scaling.attn_factor", MetaValue::F32(attn));
                }
                Ok(None)
            }
            RopeScaling::Llama3 {
                factor,
                low,
                high,
                orig,
            } => {
                if self.ga.rows != RopeRows::Interleaved || self.ga.arch.scales == Scales::Gemma {
                    return Err(self.err(
                        "rope_type",
                        "llama3",
                        format!("llama.cpp's {a} takes no frequency factors"),
                    ));
                }
                // llama.cpp's converter: divisor per pair of the head (generate_extra_tensors).
                let factors = llama3_factors(
                    d.rope.theta,
                    d.dims.head_dim,
                    factor,
                    low,
                    high,
                    orig as f64,
                );
                self.push("rope.scaling.original_context_length", MetaValue::U32(orig));
                Ok(Some(factors))
            }
        }
    }

    /// The softcaps the architecture reads.
    pub fn scales(&mut self) {
        let (s, caps) = (self.desc.scales, self.ga.softcaps);
        if caps.attn.is_some() {
            let v = s.attn_softcap.unwrap_or(0.0) as f32;
            self.push("attn_logit_softcapping", MetaValue::F32(v));
        }
        if caps.final_.is_some() {
            let v = s.final_softcap.unwrap_or(0.0) as f32;
            self.push("final_logit_softcapping", MetaValue::F32(v));
        }
    }

    /// The window and its layers, and the sliding layers' local base: llama.cpp uses
    /// the local base on exactly the sliding layers.
    pub fn window(&mut self) -> Result<()> {
        let Some(swa) = self.ga.swa else {
            return Ok(());
        };
        let (d, h, a) = (self.desc, self.header, self.ga.name);
        let n = d.dims.n_layers;
        let window: Vec<bool> = d.layers.iter().map(|l| l.sliding).collect();
        let local: Vec<bool> = d.layers.iter().map(|l| l.local_rope).collect();
        let w = d.sliding_window.unwrap_or(0);
        let any = window.iter().any(|&s| s) && w != 0;
        let bools = |v: &[bool]| {
            MetaValue::Array(
                ValueType::Bool,
                v.iter().map(|&b| MetaValue::Bool(b)).collect(),
            )
        };
        if any {
            self.push("attention.sliding_window", MetaValue::U32(w as u32));
            self.push("attention.sliding_window_pattern", bools(&window));
        } else if swa.always {
            // A window that covers no layer (llama.cpp's gpt-oss requires the window's
            // key: 0, which reads back as none; Gemma 2's has a default).
            if swa.default_window == 0 {
                self.push("attention.sliding_window", MetaValue::U32(0));
            }
            self.push("attention.sliding_window_pattern", bools(&vec![false; n]));
        }
        let uses_local = local.iter().any(|&l| l);
        if uses_local && (local != window || !any) {
            return Err(self.err(
                "layer_flags",
                format!("{:?}", self.flags),
                format!("llama.cpp's {a} uses the local RoPE base on exactly the sliding layers"),
            ));
        }
        if uses_local {
            let base = d.rope.local_theta.unwrap_or(0.0) as f32;
            self.push("rope.freq_base_swa", MetaValue::F32(base));
        } else if swa.default_local_base.is_some() && any {
            return Err(self.err(
                "rope_local_theta",
                h.rope_local_theta,
                format!("llama.cpp's {a} sliding layers use a local RoPE base"),
            ));
        }
        if swa.linear_scaling_only
            && uses_local
            && h.rope_type != rope_type::PLAIN
            && h.rope_type != rope_type::LINEAR
        {
            return Err(self.err(
                "rope_type",
                h.rope_type,
                format!("{a}: only linear scaling of the global layers"),
            ));
        }
        Ok(())
    }

    /// Interleaved multimodal RoPE sections and the delta rule's layers and sizes.
    pub fn linear(&mut self) {
        let d = self.desc;
        if self.ga.rope_sections {
            // Three near-equal sections cover every rotated pair (llama.cpp's default
            // [11, 11, 10] for 32 pairs); text positions are equal.
            let n = d.rope.rot_dim as i32 / 2;
            let a0 = (n + 2) / 3;
            let b0 = (n - a0 + 1) / 2;
            let sections = [a0, b0, n - a0 - b0, 0].map(MetaValue::I32);
            self.push(
                "rope.dimension_sections",
                MetaValue::Array(ValueType::I32, sections.to_vec()),
            );
        }
        if !self.ga.arch.linear_attention {
            return;
        }
        let lin = d.layers.iter().map(|l| MetaValue::Bool(l.linear)).collect();
        self.push(
            "attention.recurrent_layers",
            MetaValue::Array(ValueType::Bool, lin),
        );
        if let Some(l) = d.linear {
            let u = |x: usize| MetaValue::U32(x as u32);
            self.push("ssm.conv_kernel", u(l.conv));
            self.push("ssm.state_size", u(l.k_dim));
            self.push("ssm.group_count", u(l.k_heads));
            self.push("ssm.time_step_rank", u(l.v_heads));
            self.push("ssm.inner_size", u(l.v_heads * l.v_dim));
        }
    }
}

impl Keys<'_> {
    /// The experts' keys, refusing what llama.cpp's architecture computes otherwise:
    /// its routing, experts in every layer, exactly the family's router and expert
    /// biases (which llama.cpp's gpt-oss requires and the others lack), its clamped
    /// SwiGLU's constants.
    pub fn experts(&mut self) -> Result<()> {
        let (d, h, a) = (self.desc, self.header, self.ga.name);
        let Some(e) = d.moe else {
            return Ok(());
        };
        let want = self
            .ga
            .arch
            .moe
            .and_then(|m| m.gating)
            .or(self.ga.moe_gating);
        if let Some(g) = want.filter(|&g| g != e.gating) {
            return Err(self.err(
                "moe_gating",
                e.gating,
                format!("llama.cpp's {a} routes by {}", moe_gating::name(g)),
            ));
        }
        if let Some(l) = d.layers.iter().position(|l| !l.moe) {
            return Err(self.err(
                &format!("layer_flags[{l}]"),
                self.flags[l],
                format!("llama.cpp's {a} has experts in every layer"),
            ));
        }
        let fam = self.ga.arch;
        let bit = |on: bool, b: u32| if on { b } else { 0 };
        let biases = fam.moe.map_or(0, |m| {
            bit(m.router_bias, moe_flag::ROUTER_BIAS) | bit(m.expert_bias, moe_flag::EXPERT_BIAS)
        });
        if h.moe_flags & !moe_flag::SHARED_GATE != biases {
            let want = match moe_flag::names(biases).join(" and ") {
                n if n.is_empty() => "no router or expert biases".to_string(),
                n => format!("exactly these biases: {n}"),
            };
            return Err(self.err(
                "moe_flags",
                h.moe_flags,
                format!("llama.cpp's {a} has {want}"),
            ));
        }
        if e.swiglu != self.ga.swiglu {
            let msg = match self.ga.swiglu {
                Some((limit, alpha)) => format!(
                    "llama.cpp's {a} clamps its SwiGLU at {limit} with alpha {alpha} (constants of its graph)"
                ),
                None => format!("llama.cpp's {a} has no clamped SwiGLU"),
            };
            return Err(self.err("swiglu_limit", h.swiglu_limit, msg));
        }
        if e.shared_hidden > 0 && h.moe_flags & moe_flag::SHARED_GATE == 0 {
            return Err(self.err(
                "moe_flags",
                h.moe_flags,
                format!("llama.cpp's {a} gates its shared expert"),
            ));
        }
        let u = |x: usize| MetaValue::U32(x as u32);
        self.push("expert_count", u(e.n_experts));
        self.push("expert_used_count", u(e.n_used));
        self.push("expert_feed_forward_length", u(e.expert_hidden));
        if e.shared_hidden > 0 {
            self.push("expert_shared_feed_forward_length", u(e.shared_hidden));
        }
        Ok(())
    }
}

/// Whether some layer of `flags` has no RoPE (export's choice of architecture).
pub fn any_no_rope(flags: &[u8]) -> bool {
    flags.iter().any(|f| f & layer_flag::NO_ROPE != 0)
}
