//! Which type each matrix gets: the `--wtype` default (with `--q8` classes in a Q4_0
//! model), overridden per matrix class or per tensor by a [`TypePlan`].
//!
//! A matrix's type is the last rule naming the tensor itself, else the last rule
//! naming one of its classes, else the default. The converter writes a uniform file
//! (header `wtype`, and `q8_mask` for Q4_0) when the result is what the default alone
//! gives, and a mixed file (`wtype` 128, a type table) otherwise. Issue 16's
//! `--target-bpw` fills a plan with one tensor rule per matrix.
//!
//! A K type needs rows of whole 256-weight super-blocks: on other rows [`fallback`]
//! gives the 32-weight type of the same size ([`fall_back`] applies it with a note).

use std::fmt;

use crate::format::mlb::header::q8_class;
use crate::format::mlb::layout::class_wtype;
use crate::format::mlb::{Kind, Tensor};
use crate::format::WType;
use crate::quant;

/// The matrices a rule picks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Select {
    /// Every matrix with this `q8_mask` class bit (`tok_emb`, `wcls`, `wqk`, `wv`, `wo`,
    /// `w13`, `w2`; with a shared classifier tok_emb has the `wcls` bit too).
    Class(u32),
    /// Every matrix of a group of a mixture-of-experts layer ([`GROUPS`]: `experts`,
    /// `shared_expert`), which share the dense FFN's classes.
    Group(&'static str),
    /// One tensor by its name (`tok_emb`, `layers.3.w2`, `layers.0.lb`).
    Tensor(String),
}

/// Groups of a mixture-of-experts layer's matrices, by array name: the routed experts
/// and the shared expert, each a class of its own for `--types` (the router is F32).
pub const GROUPS: [(&str, &[&str]); 2] = [
    ("experts", &["ew1", "ew2", "ew3"]),
    ("shared_expert", &["sw1", "sw2", "sw3"]),
];

/// The matrices of `tensors` in array order with their class and shape.
pub fn matrices(tensors: &[Tensor]) -> impl Iterator<Item = (&Tensor, usize, usize, u32)> {
    tensors.iter().filter_map(|t| match t.kind {
        Kind::Mat {
            rows, cols, class, ..
        } => Some((t, rows, cols, class)),
        _ => None,
    })
}

/// The group matrix `name` (an array name such as `ew1`) belongs to.
pub fn group_of(name: &str) -> Option<&'static str> {
    GROUPS
        .iter()
        .find(|(_, names)| names.contains(&name))
        .map(|&(g, _)| g)
}

/// One override: the matrices `select` picks are stored as `wtype`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeRule {
    pub select: Select,
    pub wtype: WType,
}

/// Per-matrix type overrides, in order (later rules win among rules of one kind).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TypePlan {
    pub rules: Vec<TypeRule>,
}

impl fmt::Display for Select {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Select::Class(bit) => f.write_str(q8_class::names(*bit).first().unwrap_or(&"?")),
            Select::Group(g) => f.write_str(g),
            Select::Tensor(name) => f.write_str(name),
        }
    }
}

impl TypePlan {
    /// Parses `--types`: comma-separated `TARGET=TYPE`, a target being a class name
    /// (`tok_emb, wcls, wqk, wv, wo, w13, w2`), a group of a mixture of experts
    /// (`experts`, `shared_expert`) or a tensor name (`layers.3.w2`), a
    /// type by its `--wtype` name (`q8_0, q4_0, bf16, f16, q4_k, …, q6_0`). Tensor names are checked against the model later.
    pub fn parse(s: &str) -> Result<TypePlan, String> {
        let mut rules = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (target, ty) = part
                .split_once('=')
                .ok_or_else(|| format!("'{part}': expected TARGET=TYPE, e.g. tok_emb=q8_0"))?;
            let (target, ty) = (target.trim(), ty.trim());
            let wtype = quant::quantizable_type(ty).map_err(|e| format!("'{part}': {e}"))?;
            let group = GROUPS.iter().find(|(g, _)| *g == target);
            let select = match q8_class::NAMES.iter().find(|(_, n)| *n == target) {
                Some((bit, _)) => Select::Class(*bit),
                None if group.is_some() => Select::Group(group.expect("found").0),
                None if target.starts_with("layers.") => Select::Tensor(target.to_string()),
                None => {
                    let known: Vec<_> = q8_class::NAMES
                        .iter()
                        .map(|(_, n)| *n)
                        .chain(GROUPS.iter().map(|(g, _)| *g))
                        .collect();
                    return Err(format!(
                        "'{part}': unknown target '{target}' (a class: {}, or a tensor name such as layers.0.w2)",
                        known.join(", ")
                    ));
                }
            };
            rules.push(TypeRule { select, wtype });
        }
        Ok(TypePlan { rules })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The type of matrix `t` given the default `base` (the header's rule).
    pub fn resolve(&self, t: &Tensor, base: WType) -> WType {
        self.rule_for(t).unwrap_or(base)
    }

    /// The type a rule gives matrix `t`, if any rule picks it.
    pub fn rule_for(&self, t: &Tensor) -> Option<WType> {
        let Kind::Mat { class, .. } = t.kind else {
            return None;
        };
        let name = t.name.to_string();
        let by = |want: &dyn Fn(&Select) -> bool| {
            self.rules
                .iter()
                .rev()
                .find(|r| want(&r.select))
                .map(|r| r.wtype)
        };
        let group = group_of(t.name.name);
        by(&|s| matches!(s, Select::Tensor(n) if *n == name))
            .or_else(|| by(&|s| matches!(s, Select::Group(g) if Some(*g) == group)))
            .or_else(|| by(&|s| matches!(s, Select::Class(b) if class & b != 0)))
    }

    /// Whether a tensor rule names `t` itself.
    pub fn names(&self, t: &Tensor) -> bool {
        let name = t.name.to_string();
        self.rules
            .iter()
            .any(|r| matches!(&r.select, Select::Tensor(n) if *n == name))
    }

    /// Every tensor rule's name must be a matrix of the model.
    pub fn check_names(&self, tensors: &[Tensor]) -> Result<(), String> {
        for r in &self.rules {
            if let Select::Tensor(n) = &r.select {
                let found = tensors
                    .iter()
                    .any(|t| matches!(t.kind, Kind::Mat { .. }) && t.name.to_string() == *n);
                if !found {
                    return Err(format!(
                        "'{n}={}': the model has no matrix named {n}",
                        r.wtype.cli_name()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The type of every matrix of `tensors` (a uniform layout of `wtype` and `q8_mask`),
/// in array order, with `plan` applied.
pub fn matrix_types(tensors: &[Tensor], wtype: u32, q8_mask: u32, plan: &TypePlan) -> Vec<WType> {
    tensors
        .iter()
        .filter_map(|t| match t.kind {
            Kind::Mat { class, .. } => Some(plan.resolve(t, class_wtype(wtype, q8_mask, class))),
            _ => None,
        })
        .collect()
}

/// The 32-weight type of the same size as K type `t`, for rows that are not a multiple
/// of 256 (llama.cpp falls back too, silently, and to larger types: Q4_K → Q5_0, Q5_K →
/// Q5_1, Q6_K → Q8_0); below 4.5 bits (Q2_K, Q3_K, IQ4_XS and the codebook types
/// IQ3_XXS … IQ1_M) IQ4_NL, as llama.cpp does;
/// other types as they are. With `gguf` (only GGUF's types) Q6_K falls back to Q8_0,
/// as llama.cpp's does, since GGUF has no Q6_0.
pub fn fallback(t: WType, gguf: bool) -> WType {
    match t {
        WType::Q4_K
        | WType::Q2_K
        | WType::Q3_K
        | WType::IQ4_XS
        | WType::IQ3_XXS
        | WType::IQ3_S
        | WType::IQ2_XXS
        | WType::IQ2_XS
        | WType::IQ2_S
        | WType::IQ1_M => WType::IQ4_NL,
        WType::Q5_K => WType::Q5_0,
        WType::Q6_K if gguf => WType::Q8_0,
        WType::Q6_K => WType::Q6_0,
        t => t,
    }
}

/// Replaces K types on matrices whose rows are not a multiple of 256 by [`fallback`]
/// (`gguf`: GGUF's types only), with one note per replacement naming the matrices.
pub fn fall_back(tensors: &[Tensor], types: &mut [WType], gguf: bool, notes: &mut Vec<String>) {
    let mut moved: Vec<(WType, Vec<String>)> = Vec::new();
    for ((t, _, cols, _), ty) in matrices(tensors).zip(types.iter_mut()) {
        if cols % ty.block_weights() == 0 {
            continue;
        }
        let name = match t.name.layer {
            Some(_) => format!("layers.*.{}", t.name.name),
            None => t.name.name.to_string(),
        };
        match moved.iter_mut().find(|(k, _)| *k == *ty) {
            Some((_, names)) if names.contains(&name) => {}
            Some((_, names)) => names.push(name),
            None => moved.push((*ty, vec![name])),
        }
        *ty = fallback(*ty, gguf);
    }
    for (k, names) in moved {
        let f = fallback(k, gguf);
        let bpw = |t: WType| (t.block_bytes() * 8) as f64 / t.block_weights() as f64;
        let which = if bpw(f) == bpw(k) {
            "the 32-weight type of the same size"
        } else {
            "llama.cpp's fallback for it too"
        };
        notes.push(format!(
            "{k} needs rows of whole 256-weight super-blocks: {} stored as {f}, {which} ({:.1} bits per weight)",
            names.join(", "),
            bpw(f),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mlb::header::wtype;
    use crate::format::mlb::{validate, Layout};
    use crate::synth::tiny_header;

    #[test]
    fn parse_rules() {
        let p = TypePlan::parse("tok_emb=q8_0, layers.1.w2=F16,wqk=q4_0").unwrap();
        assert_eq!(
            p.rules,
            vec![
                TypeRule {
                    select: Select::Class(q8_class::TOK_EMB),
                    wtype: WType::Q8_0
                },
                TypeRule {
                    select: Select::Tensor("layers.1.w2".into()),
                    wtype: WType::F16
                },
                TypeRule {
                    select: Select::Class(q8_class::WQK),
                    wtype: WType::Q4_0
                },
            ]
        );
        assert!(TypePlan::parse("").unwrap().is_empty());
        assert!(TypePlan::parse("tok_emb")
            .unwrap_err()
            .contains("TARGET=TYPE"));
        assert!(TypePlan::parse("tok_emb=q9_z")
            .unwrap_err()
            .contains("q9_z"));
        assert!(TypePlan::parse("wq=bf16").unwrap_err().contains("'wq'"));
    }

    #[test]
    fn tensor_rules_beat_class_rules_and_later_rules_win() {
        let mut h = tiny_header();
        h.shared_classifier = 1;
        let d = validate(&h).unwrap();
        let l = Layout::new(&h, &d, &[]).unwrap();
        let p = TypePlan::parse("layers.0.w2=q8_0,w2=f16,w2=q4_0,wcls=q8_0").unwrap();
        let types = matrix_types(&l.tensors, wtype::BF16, 0, &p);
        let names: Vec<String> = l
            .tensors
            .iter()
            .filter(|t| matches!(t.kind, Kind::Mat { .. }))
            .map(|t| t.name.to_string())
            .collect();
        let of = |n: &str| types[names.iter().position(|x| x == n).unwrap()];
        assert_eq!(of("layers.0.w2"), WType::Q8_0);
        assert_eq!(of("layers.1.w2"), WType::Q4_0);
        assert_eq!(of("layers.1.wq"), WType::BF16);
        // The shared classifier is tok_emb: the wcls class picks it.
        assert_eq!(of("tok_emb"), WType::Q8_0);
        assert!(p.check_names(&l.tensors).is_ok());
        let bad = TypePlan::parse("layers.7.w2=q8_0").unwrap();
        assert!(bad
            .check_names(&l.tensors)
            .unwrap_err()
            .contains("layers.7.w2"));
        let norm = TypePlan::parse("layers.0.attn_norm=q8_0").unwrap();
        assert!(norm.check_names(&l.tensors).is_err());
    }
}
