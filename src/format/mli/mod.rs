//! MLI1 importance-matrix files: per input channel sums of squared activations,
//! written by `mlb-run --imatrix` and read by `mlb-convert --imatrix`.
//!
//! A 40-byte header, then little-endian f64 sums: for each layer the input of
//! wq/wk/wv (dim), of wo (q_dim), of w1/w3 (dim) and of w2 (hidden_dim); then the
//! classifier's input (dim).
//!
//! **Krafla**, version 2 (a model with mixture-of-experts layers): the version-1 body,
//! then per MoE layer the count of tokens routed to each expert and the sums of each
//! expert's own inputs (ew1/ew3, ew2) and of the shared expert's sw2 ([`MoeSums`];
//! docs/file-format.md, "MLI").
//!
//! **Krafla**: with bit 16 of the version set, a covariance section follows the sums
//! ([`cov`]); [`Mli::covariance`] is its table.

pub mod cov;
#[cfg(test)]
mod cov_tests;
pub mod slot;

use crate::format::error::{FormatError, Result};
use cov::{CovSlot, Covariance};
pub use slot::Slot;

pub const MAGIC: [u8; 4] = *b"MLI1";
pub const VERSION: u32 = 1;
/// The version of a file with the mixture-of-experts extension.
pub const VERSION_MOE: u32 = 2;
pub const HEADER_SIZE: usize = 40;
const DIM_LIMIT: u32 = 65536;

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
    /// The experts' sums of a mixture-of-experts model (version 2).
    pub moe: Option<MoeSums>,
}

/// Which input of a routed expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertSlot {
    /// The input of the expert's ew1 and ew3 rows (its tokens' FFN inputs): dim.
    In,
    /// The input of its ew2 rows: expert_hidden.
    Hidden,
}

/// The sums of the routed and shared experts of a model's MoE layers.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSums {
    pub n_experts: usize,
    pub dim: usize,
    pub expert_hidden: usize,
    /// 0 without a shared expert.
    pub shared_hidden: usize,
    /// The MoE layers, ascending.
    pub layers: Vec<usize>,
    /// Per MoE layer and expert: the tokens routed to it.
    pub tokens: Vec<u64>,
    /// Per MoE layer: per expert its ew1/ew3 input (dim) then its ew2 input
    /// (expert_hidden), then the shared expert's sw2 input (shared_hidden).
    pub sums: Vec<f64>,
}

impl MoeSums {
    /// Zeroed sums for the MoE layers `layers`.
    pub fn new(
        layers: Vec<usize>,
        n_experts: usize,
        dim: usize,
        expert_hidden: usize,
        shared_hidden: usize,
    ) -> MoeSums {
        let mut m = MoeSums {
            n_experts,
            dim,
            expert_hidden,
            shared_hidden,
            layers,
            tokens: Vec::new(),
            sums: Vec::new(),
        };
        m.tokens = vec![0; m.layers.len() * n_experts];
        m.sums = vec![0.0; m.layers.len() * m.per_layer()];
        m
    }

    fn per_layer(&self) -> usize {
        self.n_experts * (self.dim + self.expert_hidden) + self.shared_hidden
    }

    /// The index of `layer` among the MoE layers.
    fn nth(&self, layer: usize) -> Option<usize> {
        self.layers.binary_search(&layer).ok()
    }

    fn range(&self, layer: usize, e: usize, slot: ExpertSlot) -> Option<std::ops::Range<usize>> {
        let i = self.nth(layer)?;
        let at = i * self.per_layer() + e * (self.dim + self.expert_hidden);
        Some(match slot {
            ExpertSlot::In => at..at + self.dim,
            ExpertSlot::Hidden => at + self.dim..at + self.dim + self.expert_hidden,
        })
    }

    /// Expert `e`'s sums in layer `layer` (`None`: not a MoE layer).
    pub fn expert(&self, layer: usize, e: usize, slot: ExpertSlot) -> Option<&[f64]> {
        Some(&self.sums[self.range(layer, e, slot)?])
    }

    pub fn expert_mut(&mut self, layer: usize, e: usize, slot: ExpertSlot) -> Option<&mut [f64]> {
        let r = self.range(layer, e, slot)?;
        Some(&mut self.sums[r])
    }

    /// The shared expert's sw2 input sums in layer `layer`.
    pub fn shared(&self, layer: usize) -> Option<&[f64]> {
        let end = (self.nth(layer)? + 1) * self.per_layer();
        Some(&self.sums[end - self.shared_hidden..end])
    }

    pub fn shared_mut(&mut self, layer: usize) -> Option<&mut [f64]> {
        let end = (self.nth(layer)? + 1) * self.per_layer();
        Some(&mut self.sums[end - self.shared_hidden..end])
    }

    /// Tokens routed to expert `e` of layer `layer`.
    pub fn tokens(&self, layer: usize, e: usize) -> Option<u64> {
        Some(self.tokens[self.nth(layer)? * self.n_experts + e])
    }

    pub fn tokens_mut(&mut self, layer: usize, e: usize) -> Option<&mut u64> {
        let i = self.nth(layer)? * self.n_experts + e;
        Some(&mut self.tokens[i])
    }

    /// The experts no token was routed to, as (layer, expert): they have no sums of
    /// their own (`mlb-convert` warns and falls back, docs/calibration.md).
    pub fn unrouted(&self) -> Vec<(usize, usize)> {
        let e = self.n_experts;
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, &l)| (0..e).map(move |x| (i, l, x)))
            .filter(|&(i, _, x)| self.tokens[i * e + x] == 0)
            .map(|(_, l, x)| (l, x))
            .collect()
    }
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
            moe: None,
        }
    }

    /// This matrix with the experts' sums `moe` (a version-2 file).
    pub fn with_moe(self, moe: MoeSums) -> Mli {
        Mli {
            moe: Some(moe),
            ..self
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

    /// The width of a covariance entry's input ([`cov`]'s note: in a MoE layer the W2
    /// slot holds the experts' ew2 inputs and the shared expert's sw2 input), or why the
    /// model has no such input.
    pub fn cov_width(
        &self,
        layer: Option<usize>,
        slot: CovSlot,
        expert: Option<u32>,
    ) -> std::result::Result<usize, String> {
        let moe = self
            .moe
            .as_ref()
            .filter(|x| layer.is_some_and(|l| x.layers.contains(&l)));
        match (slot, moe, expert) {
            (CovSlot::Layer(Slot::W2), Some(x), Some(e)) if (e as usize) < x.n_experts => {
                Ok(x.expert_hidden)
            }
            (CovSlot::Layer(Slot::W2), Some(x), Some(_)) => {
                Err(format!("must be below n_experts ({})", x.n_experts))
            }
            (CovSlot::Layer(Slot::W2), Some(x), None) if x.shared_hidden > 0 => Ok(x.shared_hidden),
            (CovSlot::Layer(Slot::W2), Some(_), None) => Err(
                "a mixture-of-experts layer without a shared expert has no W2 input of no expert"
                    .into(),
            ),
            (_, Some(_), Some(_)) => {
                Err("per-expert covariances are defined for the W2 slot only".into())
            }
            (_, None, Some(_)) => Err("only a mixture-of-experts layer has experts".into()),
            (CovSlot::Layer(Slot::Wo), ..) => Ok(self.q_dim),
            (CovSlot::Layer(Slot::W2), ..) => Ok(self.hidden_dim),
            (CovSlot::Layer(Slot::Attn | Slot::W13) | CovSlot::Cls, ..) => Ok(self.dim),
        }
    }

    /// The file's bytes: header and sums (a covariance section is appended by
    /// [`cov::write`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_SIZE + 8 * self.sums.len());
        b.extend_from_slice(&MAGIC);
        let version = if self.moe.is_some() {
            VERSION_MOE
        } else {
            VERSION
        };
        b.extend_from_slice(&version.to_le_bytes());
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
        if let Some(m) = &self.moe {
            let n = m.layers.len();
            for v in [m.n_experts, m.expert_hidden, m.shared_hidden, n] {
                b.extend_from_slice(&(v as u32).to_le_bytes());
            }
            for &l in &m.layers {
                b.extend_from_slice(&(l as u32).to_le_bytes());
            }
            if n % 2 == 1 {
                b.extend_from_slice(&0u32.to_le_bytes());
            }
            for i in 0..n {
                for t in &m.tokens[i * m.n_experts..(i + 1) * m.n_experts] {
                    b.extend_from_slice(&t.to_le_bytes());
                }
                for s in &m.sums[i * m.per_layer()..(i + 1) * m.per_layer()] {
                    b.extend_from_slice(&s.to_le_bytes());
                }
            }
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
    let with_cov = version & cov::FLAG != 0;
    let base = version & !cov::FLAG;
    if base != VERSION && base != VERSION_MOE {
        return Err(FormatError::format(
            "version",
            version,
            "must be 1 or 2 (and bit 16 for a covariance section)",
        ));
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
    let body = HEADER_SIZE as u64 + 8 * count;
    let moe = match base {
        VERSION_MOE => Some(parse_moe(b, body as usize, (n_layers, d), with_cov)?),
        _ => None,
    };
    let want = body + moe.as_ref().map_or(0, |(_, len)| *len as u64);
    if b.len() as u64 != want && !(with_cov && b.len() as u64 > want) {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", b.len()),
            format!("the header implies {want} bytes ({count} sums)"),
        ));
    }
    let sums = f64s(&b[HEADER_SIZE..body as usize], "sums")?;
    let mut m = Mli {
        n_layers,
        dim: d,
        hidden_dim,
        q_dim,
        tokens,
        cls_tokens,
        sums,
        moe: moe.map(|(m, _)| m),
        covariance: None,
    };
    if with_cov {
        let cov = cov::parse(b, want as usize, n_layers, |l, s, e| m.cov_width(l, s, e))?;
        m.covariance = Some(cov);
    }
    Ok(m)
}

/// Little-endian f64s, each finite and ≥ 0 (`what[i]` names a bad one).
fn f64s(b: &[u8], what: &str) -> Result<Vec<f64>> {
    let v: Vec<f64> = b
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    if let Some(i) = v.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
        return Err(FormatError::format(
            format!("{what}[{i}]"),
            v[i],
            "sums of squares must be finite and ≥ 0",
        ));
    }
    Ok(v)
}

/// The version-2 extension at `at` of a file of `n_layers` layers of `dim`: the
/// experts' sums and the extension's length (the file ends with it unless `more`: a
/// covariance section follows). Checks the lengths before allocating.
fn parse_moe(
    b: &[u8],
    at: usize,
    (n_layers, width): (usize, usize),
    more: bool,
) -> Result<(MoeSums, usize)> {
    let short = || {
        FormatError::format(
            "file",
            format!("{} bytes", b.len()),
            "shorter than its mixture-of-experts section",
        )
    };
    if b.len() < at + 16 {
        return Err(short());
    }
    let n_experts = u32_at(b, at);
    if !(2..=1024).contains(&n_experts) {
        return Err(FormatError::shape(
            "n_experts",
            n_experts,
            "must be in 2..=1024",
        ));
    }
    let eh = dim("expert_hidden", u32_at(b, at + 4))?;
    let sh = match u32_at(b, at + 8) {
        0 => 0,
        v => dim("shared_hidden", v)?,
    };
    let n = u32_at(b, at + 12) as usize;
    if n == 0 || n > n_layers {
        return Err(FormatError::format(
            "moe_layers",
            n,
            "must be in 1..=n_layers",
        ));
    }
    let list = at + 16;
    if b.len() < list + 4 * n {
        return Err(short());
    }
    let layers: Vec<usize> = (0..n).map(|i| u32_at(b, list + 4 * i) as usize).collect();
    if layers.windows(2).any(|w| w[0] >= w[1]) || layers[n - 1] >= n_layers {
        return Err(FormatError::format(
            "moe_layers",
            format!("{layers:?}"),
            "must ascend and name layers of the model",
        ));
    }
    let e = n_experts as usize;
    // ≤ 2^16 layers of 2^10 · (2^17 + 1) + 2^16 values: no overflow in u64.
    let per = 8 * (e as u64 * (1 + width as u64 + eh as u64) + sh as u64);
    let start = list + 4 * n.next_multiple_of(2);
    let len = (start - at) as u64 + n as u64 * per;
    let end = at as u64 + len;
    if b.len() as u64 != end && !(more && b.len() as u64 > end) {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", b.len()),
            format!("the header implies {} bytes", at as u64 + len),
        ));
    }
    let (per, len) = (per as usize, len as usize);
    let mut m = MoeSums::new(layers, e, width, eh, sh);
    for i in 0..n {
        let l = &b[start + i * per..start + (i + 1) * per];
        for (t, c) in m.tokens[i * e..(i + 1) * e]
            .iter_mut()
            .zip(l.chunks_exact(8))
        {
            *t = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        }
        let sums = f64s(&l[8 * e..], "expert_sums")?;
        let pl = m.per_layer();
        m.sums[i * pl..(i + 1) * pl].copy_from_slice(&sums);
    }
    Ok((m, len))
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

    /// A version-2 file: layers 0 and 1 of [`sample`] are MoE layers (or only `layers`),
    /// 3 experts of 32, a shared expert of 32 (or none).
    fn sample_moe(layers: Vec<usize>, shared: usize) -> Mli {
        let mut x = MoeSums::new(layers, 3, 32, 32, shared);
        for (i, s) in x.sums.iter_mut().enumerate() {
            *s = i as f64 * 0.5;
        }
        for (i, t) in x.tokens.iter_mut().enumerate() {
            *t = i as u64 % 3;
        }
        sample().with_moe(x)
    }

    #[test]
    fn moe_roundtrip_and_slots() {
        for (layers, shared) in [(vec![0, 1], 32), (vec![1], 0)] {
            let m = sample_moe(layers.clone(), shared);
            let b = m.to_bytes();
            let n = layers.len();
            let ext = 16 + 4 * n.next_multiple_of(2) + n * (8 * 3 + 8 * (3 * 64 + shared));
            assert_eq!(b.len(), sample().to_bytes().len() + ext);
            assert_eq!(u32_at(&b, 4), VERSION_MOE);
            let p = parse(&b).unwrap();
            assert_eq!(p, m);
            let x = p.moe.as_ref().unwrap();
            let last = *layers.last().unwrap();
            let first = (n - 1) * (192 + shared) + 64;
            assert_eq!(
                x.expert(last, 1, ExpertSlot::In).unwrap()[0],
                first as f64 * 0.5
            );
            assert_eq!(x.expert(last, 2, ExpertSlot::Hidden).unwrap().len(), 32);
            assert_eq!(x.shared(last).unwrap().len(), shared);
            assert_eq!(x.tokens(last, 2), Some(((n - 1) * 3 + 2) as u64 % 3));
            assert!(x.expert(5, 0, ExpertSlot::In).is_none());
        }
        // Experts with no tokens, as (layer, expert).
        let m = sample_moe(vec![0, 1], 0);
        assert_eq!(m.moe.unwrap().unrouted(), vec![(0, 0), (1, 0)]);
    }

    #[test]
    fn moe_errors() {
        let good = sample_moe(vec![0, 1], 32).to_bytes();
        let at = sample().to_bytes().len();
        let st = |b: &[u8]| parse(b).unwrap_err().status;
        assert!(parse(&good).is_ok());
        // Short: in the counts, in the layer list, by one value.
        assert_eq!(st(&good[..at + 8]), Status::Format);
        assert_eq!(st(&good[..at + 20]), Status::Format);
        assert_eq!(st(&good[..good.len() - 8]), Status::Format);
        let set = |off: usize, v: u32| {
            let mut b = good.clone();
            b[off..off + 4].copy_from_slice(&v.to_le_bytes());
            b
        };
        assert_eq!(st(&set(at, 1)), Status::Shape);
        assert_eq!(st(&set(at, 5000)), Status::Shape);
        assert_eq!(st(&set(at + 4, 0)), Status::Shape);
        assert_eq!(st(&set(at + 12, 0)), Status::Format);
        assert_eq!(st(&set(at + 12, 3)), Status::Format);
        // Layers out of order, or past the model's.
        assert_eq!(st(&set(at + 16, 1)), Status::Format);
        assert_eq!(st(&set(at + 20, 2)), Status::Format);
        // A negative sum.
        let mut b = good.clone();
        let n = b.len();
        b[n - 8..].copy_from_slice(&(-1.0f64).to_le_bytes());
        let e = parse(&b).unwrap_err();
        assert!(e.field.starts_with("expert_sums["), "{}", e.field);
        // The largest expert shapes fail on the length, before allocating.
        let mut b = set(at, 1024);
        b[at + 4..at + 8].copy_from_slice(&65536u32.to_le_bytes());
        assert_eq!(st(&b), Status::Format);
    }

    #[test]
    fn importance_floor() {
        let imp = Mli::importance(&[0.0, 10.0, 30.0, 0.0], 5);
        assert_eq!(imp, vec![0.001, 1.0, 3.0, 0.001]);
    }
}
