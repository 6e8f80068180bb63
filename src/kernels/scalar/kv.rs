//! KV cache storage types, the reference: how keys and values are rounded when a cache
//! stores them, and how attention reads them back.
//!
//! | type | a stored value | widened to f32 by |
//! |---|---|---|
//! | `f32` | the value | nothing |
//! | `f16` | IEEE binary16, rounded to nearest, ties to even (overflow to ±inf, NaN quiet) | the exact conversion |
//! | `q8_0` | per head, blocks of 32 values (a head of `hd` values padded with zeros to a multiple of 32): the spec's Q8_0 quantizer, as for activations (`d = amax / 127` kept in f32, `q = trunc(v · (127 / amax) + copysign(0.5, v))` clamped to ±127; `amax < 1e-30`: all 0) | `q · d`, one f32 multiply |
//!
//! Attention ([`super::attention`]) widens each key and value row it reads and then
//! runs exactly the f32 contract on the widened values, so the only difference between
//! the types is the rounding at storage: attention over an f16 or Q8_0 cache gives the
//! bits of f32 attention over the widened cache, on every tier.

use std::fmt;
use std::str::FromStr;

use crate::format::wtype::QK;

/// How a KV cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvType {
    /// 4 bytes per value.
    #[default]
    F32,
    /// 2 bytes per value.
    F16,
    /// 1 byte per value and an f32 scale per 32 (1.125 bytes per value; a head whose
    /// size is not a multiple of 32 is padded to one).
    Q8_0,
}

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// The name `--kv-type` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Values a slot stores per head of `hd` values (padding included).
    pub fn head_stride(self, hd: usize) -> usize {
        match self {
            KvType::Q8_0 => hd.next_multiple_of(QK),
            _ => hd,
        }
    }

    /// Bytes of one position's keys (or values) of `heads` heads of `hd` values.
    pub fn row_bytes(self, heads: usize, hd: usize) -> usize {
        let n = heads * self.head_stride(hd);
        match self {
            KvType::F32 => 4 * n,
            KvType::F16 => 2 * n,
            KvType::Q8_0 => n + 4 * (n / QK),
        }
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("unknown KV cache type '{s}' (f32, f16 or q8_0)"))
    }
}

/// The keys or the values of a cache as the kernels read them: `cap × stride` values
/// (Q8_0: quants, and a scale per 32 of them).
#[derive(Debug, Clone, Copy)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    /// f16 bits.
    F16(&'a [u16]),
    Q8_0 {
        q: &'a [i8],
        d: &'a [f32],
    },
}

impl<'a> KvData<'a> {
    pub fn kv_type(&self) -> KvType {
        match self {
            KvData::F32(_) => KvType::F32,
            KvData::F16(_) => KvType::F16,
            KvData::Q8_0 { .. } => KvType::Q8_0,
        }
    }

    /// Values held (quants for Q8_0).
    pub fn len(&self) -> usize {
        match self {
            KvData::F32(x) => x.len(),
            KvData::F16(x) => x.len(),
            KvData::Q8_0 { q, .. } => q.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the arrays agree (Q8_0: a scale per 32 quants).
    pub fn consistent(&self) -> bool {
        match self {
            KvData::Q8_0 { q, d } => q.len() == d.len() * QK,
            _ => true,
        }
    }

    /// The `n` values from `at` in f32: borrowed (f32), or widened into `buf` (its
    /// first `n` values). For Q8_0, `at` is a multiple of 32.
    #[inline]
    pub fn row<'b>(&self, at: usize, n: usize, buf: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            KvData::F32(x) => &x[at..at + n],
            KvData::F16(x) => {
                let out = &mut buf[..n];
                for (o, &h) in out.iter_mut().zip(&x[at..at + n]) {
                    *o = widen_f16(h);
                }
                out
            }
            KvData::Q8_0 { q, d } => {
                let out = &mut buf[..n];
                let d = &d[at / QK..];
                for (j, (o, &v)) in out.iter_mut().zip(&q[at..at + n]).enumerate() {
                    *o = v as f32 * d[j / QK];
                }
                out
            }
        }
    }
}

/// f32 to f16 bits, rounded to nearest with ties to even; overflow gives ±inf, NaN a
/// quiet NaN (so that every widening, software or F16C, reads it back the same).
#[inline]
pub fn round_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// f16 bits to f32, exactly.
#[inline]
pub fn widen_f16(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32_const()
}

/// Stores `x` as f16 bits into `out` (same length).
pub fn store_f16(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len(), "store_f16 lengths");
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round_f16(v);
    }
}

/// Stores `x` (heads of `hd` values) as Q8_0: each head copied into `pad` (its stride,
/// `hd` rounded up to 32, the rest zeros) and quantized by `quantize` (a tier's
/// activation quantizer: the spec's Q8_0 rounding, the same bits on every tier) into its
/// part of `q` (a stride per head) and `d` (a scale per 32).
///
/// Panics if the lengths disagree.
pub fn store_q8_0(
    x: &[f32],
    hd: usize,
    pad: &mut [f32],
    q: &mut [i8],
    d: &mut [f32],
    mut quantize: impl FnMut(&[f32], &mut [i8], &mut [f32]),
) {
    let hs = KvType::Q8_0.head_stride(hd);
    assert!(
        hd > 0
            && x.len().is_multiple_of(hd)
            && pad.len() == hs
            && q.len() == x.len() / hd * hs
            && d.len() * QK == q.len(),
        "store_q8_0: {} values, head {hd}, pad {}, q {}, d {}",
        x.len(),
        pad.len(),
        q.len(),
        d.len()
    );
    pad[hd..].fill(0.0);
    for ((h, qh), dh) in x
        .chunks_exact(hd)
        .zip(q.chunks_exact_mut(hs))
        .zip(d.chunks_exact_mut(hs / QK))
    {
        pad[..hd].copy_from_slice(h);
        quantize(pad, qh, dh);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounds_to_nearest_even() {
        // 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): even is 1.
        assert_eq!(widen_f16(round_f16(1.0 + 2f32.powi(-11))), 1.0);
        // 1 + 3·2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: even is the latter.
        assert_eq!(
            widen_f16(round_f16(1.0 + 3.0 * 2f32.powi(-11))),
            1.0 + 2f32.powi(-9)
        );
        assert_eq!(widen_f16(round_f16(1e6)), f32::INFINITY);
        assert_eq!(widen_f16(round_f16(-0.0)).to_bits(), (-0.0f32).to_bits());
        // Subnormal f16s are exact.
        assert_eq!(widen_f16(round_f16(2f32.powi(-24))), 2f32.powi(-24));
        // NaN comes back quiet.
        let n = round_f16(f32::from_bits(0x7f80_0001));
        assert!(widen_f16(n).is_nan() && n & 0x0200 != 0);
    }

    #[test]
    fn type_names_and_sizes() {
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
        }
        assert!("q4_0".parse::<KvType>().is_err());
        assert_eq!(KvType::F32.row_bytes(3, 64), 768);
        assert_eq!(KvType::F16.row_bytes(3, 64), 384);
        assert_eq!(KvType::Q8_0.row_bytes(3, 64), 192 + 24);
        // A head of 16 is padded to 32.
        assert_eq!(KvType::Q8_0.row_bytes(2, 16), 64 + 8);
    }
}
