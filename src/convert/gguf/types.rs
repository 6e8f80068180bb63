//! GGUF tensor types ↔ `.mlb` weight types: the types whose blocks are copied as they
//! are, both ways.

use crate::format::gguf::GgmlType;
use crate::format::mlb::{Kind, Mlb};
use crate::format::WType;

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
    })
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
    }
}
