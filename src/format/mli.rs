//! MLI1 importance-matrix files: per input channel sums of squared activations,
//! written by `mlb-run --imatrix` and read by `mlb-convert --imatrix`.
//!
//! A 40-byte header, then little-endian f64 sums: for each layer the input of
//! wq/wk/wv (dim), of wo (q_dim), of w1/w3 (dim) and of w2 (hidden_dim); then the
//! classifier's input (dim).
//!
//! **Krafla**: with bit 16 of the version set, a covariance section follows the sums
//! ([`super::mli_cov`]); [`Mli::covariance`] is its table.

use crate::format::error::{FormatError, Result};
use crate::format::mli_cov::{self, CovSlot, Covariance};

pub const MAGIC: [u8; 4] = *b"MLI1";
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 40;
const DIM_LIMIT: u32 = 65536;

/// The matrix inputs an imatrix sums, per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Input of wq, wk, wv (and wg, lqkv, lz, lb, la): dim channels.
    Attn,
    /// Input of wo (and lout): q_dim channels.
    Wo,
    /// Input of w1 and w3: dim channels.
    W13,
    /// Input of w2: hidden_dim channels.
    W2,
}

/// An importance matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Mli {
    pub n_layers: usize,
    pub dim: usize,
    pub hidden_dim: usize,
    /// The wo input width (q_dim); stored as 0 when it equals dim.
    pub q_dim: usize,
    /// Tokens summed into the layers.
    pub tokens: u64,
    /// Tokens summed into the classifier.
    pub cls_tokens: u64,
    /// All sums, in file order.
    pub sums: Vec<f64>,
    /// The covariance section's table (version bit 16), when the file has one.
    pub covariance: Option<Covariance>,
}

impl Mli {
    /// A zeroed matrix for these dimensions.
    pub fn new(n_layers: usize, dim: usize, hidden_dim: usize, q_dim: usize) -> Mli {
        let len = n_layers * (2 * dim + q_dim + hidden_dim) + dim;
        Mli {
            n_layers,
            dim,
            hidden_dim,
            q_dim,
            tokens: 0,
            cls_tokens: 0,
            sums: vec![0.0; len],
            covariance: None,
        }
    }

    fn per_layer(&self) -> usize {
        2 * self.dim + self.q_dim + self.hidden_dim
    }

    fn range(&self, layer: usize, slot: Slot) -> std::ops::Range<usize> {
        let base = layer * self.per_layer();
        let (off, len) = match slot {
            Slot::Attn => (0, self.dim),
            Slot::Wo => (self.dim, self.q_dim),
            Slot::W13 => (self.dim + self.q_dim, self.dim),
            Slot::W2 => (2 * self.dim + self.q_dim, self.hidden_dim),
        };
        base + off..base + off + len
    }

    /// Sums of one layer's matrix input.
    pub fn slot(&self, layer: usize, slot: Slot) -> &[f64] {
        &self.sums[self.range(layer, slot)]
    }

    pub fn slot_mut(&mut self, layer: usize, slot: Slot) -> &mut [f64] {
        let r = self.range(layer, slot);
        &mut self.sums[r]
    }

    /// Sums of the classifier's input.
    pub fn cls(&self) -> &[f64] {
        &self.sums[self.n_layers * self.per_layer()..]
    }

    pub fn cls_mut(&mut self) -> &mut [f64] {
        let s = self.n_layers * self.per_layer();
        &mut self.sums[s..]
    }

    /// Importance of each channel of `sums` over `tokens`: the channel's mean square
    /// over the mean of all channels, floored at 0.001 (the spec's weighting).
    pub fn importance(sums: &[f64], tokens: u64) -> Vec<f32> {
        let n = tokens.max(1) as f64;
        let mean_sq: Vec<f64> = sums.iter().map(|s| s / n).collect();
        let avg = mean_sq.iter().sum::<f64>() / mean_sq.len().max(1) as f64;
        mean_sq
            .iter()
            .map(|&m| {
                if avg > 0.0 {
                    ((m / avg) as f32).max(0.001)
                } else {
                    1.0
                }
            })
            .collect()
    }

    /// The width of a covariance slot's input.
    pub fn cov_width(&self, slot: CovSlot) -> usize {
        match slot {
            CovSlot::Layer(Slot::Wo) => self.q_dim,
            CovSlot::Layer(Slot::W2) => self.hidden_dim,
            CovSlot::Layer(Slot::Attn | Slot::W13) | CovSlot::Cls => self.dim,
        }
    }

    /// The file's bytes: header and sums (a covariance section is appended by
    /// [`mli_cov::write`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_SIZE + 8 * self.sums.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        for v in [self.n_layers, self.dim, self.hidden_dim] {
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        let q = if self.q_dim == self.dim {
            0
        } else {
            self.q_dim as u32
        };
        b.extend_from_slice(&q.to_le_bytes());
        b.extend_from_slice(&self.tokens.to_le_bytes());
        b.extend_from_slice(&self.cls_tokens.to_le_bytes());
        for s in &self.sums {
            b.extend_from_slice(&s.to_le_bytes());
        }
        b
    }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

fn dim(field: &str, v: u32) -> Result<usize> {
    if v == 0 || v > DIM_LIMIT {
        return Err(FormatError::shape(field, v, "must be in 1..=65536"));
    }
    Ok(v as usize)
}

/// Validates and reads an MLI1 file.
pub fn parse(b: &[u8]) -> Result<Mli> {
    if b.len() < HEADER_SIZE {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", b.len()),
            "shorter than the 40-byte MLI1 header",
        ));
    }
    if b[..4] != MAGIC {
        return Err(FormatError::format(
            "magic",
            format!("{:?}", String::from_utf8_lossy(&b[..4])),
            "must be \"MLI1\"",
        ));
    }
    let version = u32_at(b, 4);
    let with_cov = version & mli_cov::FLAG != 0;
    if version & !mli_cov::FLAG != VERSION {
        return Err(FormatError::format("version", version, "must be 1"));
    }
    let n_layers = dim("n_layers", u32_at(b, 8))?;
    let d = dim("dim", u32_at(b, 12))?;
    let hidden_dim = dim("hidden_dim", u32_at(b, 16))?;
    let q_raw = u32_at(b, 20);
    let q_dim = if q_raw == 0 { d } else { dim("q_dim", q_raw)? };
    let tokens = u64_at(b, 24);
    let cls_tokens = u64_at(b, 32);
    // ≤ 2^16 · 2^18 + 2^16 values: no overflow in u64; compare before allocating.
    let count = n_layers as u64 * (2 * d + q_dim + hidden_dim) as u64 + d as u64;
    let want = HEADER_SIZE as u64 + 8 * count;
    if b.len() as u64 != want && !(with_cov && b.len() as u64 > want) {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", b.len()),
            format!("the header implies {want} bytes ({count} sums)"),
        ));
    }
    let body = want as usize;
    let sums: Vec<f64> = b[HEADER_SIZE..body]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    if let Some(i) = sums.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
        return Err(FormatError::format(
            format!("sums[{i}]"),
            sums[i],
            "sums of squares must be finite and ≥ 0",
        ));
    }
    let mut m = Mli {
        n_layers,
        dim: d,
        hidden_dim,
        q_dim,
        tokens,
        cls_tokens,
        sums,
        covariance: None,
    };
    if with_cov {
        let cov = mli_cov::parse(b, body, n_layers, |s| m.cov_width(s))?;
        m.covariance = Some(cov);
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Status;

    fn sample() -> Mli {
        let mut m = Mli::new(2, 32, 64, 64);
        for (i, s) in m.sums.iter_mut().enumerate() {
            *s = i as f64;
        }
        m.tokens = 10;
        m.cls_tokens = 7;
        m
    }

    #[test]
    fn roundtrip_and_slots() {
        let m = sample();
        let b = m.to_bytes();
        assert_eq!(b.len(), 40 + 8 * (2 * (32 + 64 + 32 + 64) + 32));
        let p = parse(&b).unwrap();
        assert_eq!(p, m);
        assert_eq!(p.slot(1, Slot::Attn)[0], 192.0);
        assert_eq!(p.slot(0, Slot::Wo).len(), 64);
        assert_eq!(p.slot(0, Slot::W2)[0], 128.0);
        assert_eq!(p.cls().len(), 32);
    }

    #[test]
    fn q_dim_equal_to_dim_is_stored_as_zero() {
        let m = Mli::new(1, 32, 32, 32);
        assert_eq!(u32_at(&m.to_bytes(), 20), 0);
    }

    #[test]
    fn errors() {
        let good = sample().to_bytes();
        let st = |b: &[u8]| parse(b).unwrap_err().status;
        assert_eq!(st(&good[..39]), Status::Format);
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(st(&b), Status::Format);
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(st(&b), Status::Format);
        let mut b = good.clone();
        b[12..16].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(st(&b), Status::Shape);
        assert_eq!(st(&good[..good.len() - 8]), Status::Format);
        let mut b = good.clone();
        let n = b.len();
        b[n - 8..].copy_from_slice(&(-1.0f64).to_le_bytes());
        let e = parse(&b).unwrap_err();
        assert_eq!(e.status, Status::Format);
        assert!(e.field.starts_with("sums["));
        // A header claiming the largest sizes fails on the length, before allocating.
        let mut b = good;
        for off in [8, 12, 16, 20] {
            b[off..off + 4].copy_from_slice(&65536u32.to_le_bytes());
        }
        assert_eq!(st(&b), Status::Format);
    }

    #[test]
    fn importance_floor() {
        let imp = Mli::importance(&[0.0, 10.0, 30.0, 0.0], 5);
        assert_eq!(imp, vec![0.001, 1.0, 3.0, 0.001]);
    }
}
