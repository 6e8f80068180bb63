//! GGUF tensor types ↔ `.mlb` weight types: the types whose blocks are copied as they
//! are, both ways.

use crate::convert::error::{ConvertError, Result};
use crate::format::gguf::GgmlType;
use crate::format::mlb::{Kind, Mlb, Tensor};
use crate::format::WType;

/// Each `.mlb` weight type's GGUF type, whose blocks (or 2-byte floats) have the same
/// bits (Krafla's Q6_0 has none), and llama.cpp's `llama_ftype` of a file mostly of
/// it. One row per type: a new type (GGUF's low-bit ones) is a row here.
fn gguf_of(w: WType) -> (Option<GgmlType>, u32) {
    match w {
        WType::Q8_0 => (Some(GgmlType::Q8_0), 7),
        WType::Q4_0 => (Some(GgmlType::Q4_0), 2),
        WType::F16 => (Some(GgmlType::F16), 1),
        WType::BF16 => (Some(GgmlType::BF16), 32),
        WType::Q4_1 => (Some(GgmlType::Q4_1), 3),
        WType::Q5_0 => (Some(GgmlType::Q5_0), 8),
        WType::Q5_1 => (Some(GgmlType::Q5_1), 9),
        WType::Q4_K => (Some(GgmlType::Q4_K), 14),
        WType::Q5_K => (Some(GgmlType::Q5_K), 16),
        WType::Q6_K => (Some(GgmlType::Q6_K), 18),
        WType::IQ4_NL => (Some(GgmlType::IQ4_NL), 25),
        WType::Q6_0 => (None, 7),
        // MOSTLY_MXFP4_MOE, MOSTLY_Q2_K, MOSTLY_Q3_K_S, MOSTLY_IQ4_XS.
        WType::MXFP4 => (Some(GgmlType::MXFP4), 38),
        WType::Q2_K => (Some(GgmlType::Q2_K), 10),
        WType::Q3_K => (Some(GgmlType::Q3_K), 11),
        WType::IQ4_XS => (Some(GgmlType::IQ4_XS), 30),
        // MOSTLY_IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M.
        WType::IQ3_XXS => (Some(GgmlType::IQ3_XXS), 23),
        WType::IQ3_S => (Some(GgmlType::IQ3_S), 26),
        WType::IQ2_XXS => (Some(GgmlType::IQ2_XXS), 19),
        WType::IQ2_XS => (Some(GgmlType::IQ2_XS), 20),
        WType::IQ2_S => (Some(GgmlType::IQ2_S), 28),
        WType::IQ1_M => (Some(GgmlType::IQ1_M), 31),
    }
}

/// The GGUF type of an `.mlb` matrix type.
pub fn ggml_type(w: WType) -> Option<GgmlType> {
    gguf_of(w).0
}

/// The `.mlb` type a GGUF matrix type is stored as, bits unchanged, if Krafla has it.
pub fn copy_type(ty: GgmlType) -> Option<WType> {
    WType::ALL.into_iter().find(|&w| ggml_type(w) == Some(ty))
}

/// `--gguf-types`: refuses a type GGUF lacks (`types`: every matrix's, in array order),
/// naming the first matrix that has it.
pub fn gguf_only(tensors: &[Tensor], types: &[WType]) -> Result<()> {
    let mats = tensors
        .iter()
        .filter(|t| matches!(t.kind, Kind::Mat { .. }));
    match mats.zip(types).find(|(_, &ty)| ggml_type(ty).is_none()) {
        Some((t, ty)) => Err(ConvertError::options(
            "--gguf-types",
            format!("{} would be {ty}, which GGUF does not have (choose a type GGUF has, e.g. Q8_0 or Q6_K)", t.name),
        )),
        None => Ok(()),
    }
}

/// `general.file_type` (llama.cpp's `llama_ftype`, informational): the type of the most
/// matrices (the first of them on a tie).
pub fn file_type(m: &Mlb) -> u32 {
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
    gguf_of(most).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::pipeline::mix::candidates;

    #[test]
    fn mix_candidates_are_gguf_types() {
        // Every candidate of a mix is a GGUF type, but Q6_0 where rows are not whole
        // super-blocks and GGUF's types were not asked for.
        for (cols, gguf) in [(512, false), (512, true), (576, false), (576, true)] {
            let foreign: Vec<WType> = candidates(cols, gguf)
                .iter()
                .copied()
                .filter(|&t| ggml_type(t).is_none())
                .collect();
            let expect: &[WType] = if gguf || cols % 256 == 0 {
                &[]
            } else {
                &[WType::Q6_0]
            };
            assert_eq!(foreign, expect, "{cols} {gguf}");
        }
    }
}
