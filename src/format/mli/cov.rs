//! **Krafla** extension of MLI1: the covariance section (version bit 16), the full
//! `H = Σ x xᵀ` of every matrix input, written by `mlb-run --imatrix F --covariance`
//! and used by `mlb-convert --imatrix F` for error feedback ([`crate::quant::feedback`]).
//!
//! After the body the version implies, little-endian:
//!
//! ```text
//! n_entries  u32                       1..=2^20
//! reserved   u32                       0
//! entries    n_entries × 24 bytes      layer u32 (0xFFFFFFFF: the classifier),
//!                                      slot u32 (0 Attn, 1 Wo, 2 W13, 3 W2, 4 classifier),
//!                                      expert u32 (0xFFFFFFFF: not an expert's),
//!                                      n u32 (channels), tokens u64 (rows summed)
//! values     per entry, in order: f32[n(n+1)/2], the upper triangle of H packed by
//!            rows: (i, j ≥ i) at i·n − i(i−1)/2 + (j − i)
//! ```
//!
//! Entries are strictly increasing in (layer, slot, expert); `n` is the input's width;
//! every value finite and every diagonal value ≥ 0.
//!
//! In a mixture-of-experts layer (a version-2 file's `moe_layers`) the W13 entry is the
//! FFN input of every token (the router's, the shared expert's sw1/sw3 and, pooled, the
//! routed experts' ew1/ew3), the W2 entry with expert `e` (below `n_experts`) is routed
//! expert e's ew2 input over the tokens routed to it (`expert_hidden` wide), and the W2
//! entry without an expert is the shared expert's sw2 input (`shared_hidden` wide; none
//! without a shared expert). An expert index anywhere else is refused.

use super::slot::Slot;
use crate::format::error::{FormatError, Result};

/// The version bit that says a covariance section follows the body.
pub const FLAG: u32 = 1 << 16;
/// The layer (and expert) field of an entry that has none.
pub const NONE: u32 = u32::MAX;
const MAX_ENTRIES: u32 = 1 << 20;
const ENTRY_BYTES: usize = 24;

/// Which input an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CovSlot {
    Layer(Slot),
    /// The classifier's input.
    Cls,
}

impl CovSlot {
    /// The slot's code in the file.
    pub fn code(self) -> u32 {
        match self {
            CovSlot::Layer(Slot::Attn) => 0,
            CovSlot::Layer(Slot::Wo) => 1,
            CovSlot::Layer(Slot::W13) => 2,
            CovSlot::Layer(Slot::W2) => 3,
            CovSlot::Cls => 4,
        }
    }

    fn from_code(c: u32) -> Option<CovSlot> {
        Some(match c {
            0 => CovSlot::Layer(Slot::Attn),
            1 => CovSlot::Layer(Slot::Wo),
            2 => CovSlot::Layer(Slot::W13),
            3 => CovSlot::Layer(Slot::W2),
            4 => CovSlot::Cls,
            _ => return None,
        })
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            CovSlot::Layer(Slot::Attn) => "attn",
            CovSlot::Layer(Slot::Wo) => "wo",
            CovSlot::Layer(Slot::W13) => "w13",
            CovSlot::Layer(Slot::W2) => "w2",
            CovSlot::Cls => "classifier",
        }
    }
}

/// One entry of the section: which input, its width and where its values are.
#[derive(Debug, Clone, PartialEq)]
pub struct CovEntry {
    /// `None`: the classifier.
    pub layer: Option<usize>,
    pub slot: CovSlot,
    /// `Some(e)`: routed expert e's ew2 input (a MoE layer's W2 slot).
    pub expert: Option<u32>,
    /// Channels (H is n × n).
    pub n: usize,
    /// Rows summed into it.
    pub tokens: u64,
    /// Byte offset of its packed values in the file.
    pub offset: usize,
}

impl CovEntry {
    /// Values in its packed triangle.
    pub fn len(&self) -> usize {
        self.n * (self.n + 1) / 2
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The sort key of the file's order.
    fn key(&self) -> (u32, u32, u32) {
        (
            self.layer.map_or(NONE, |l| l as u32),
            self.slot.code(),
            self.expert.unwrap_or(NONE),
        )
    }
}

/// The section's table of entries (the values stay in the file: a reader takes one
/// matrix at a time with [`values`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Covariance {
    pub entries: Vec<CovEntry>,
}

impl Covariance {
    /// The entry of a layer's input (`None` for the classifier's).
    pub fn find(&self, layer: Option<usize>, slot: CovSlot) -> Option<&CovEntry> {
        self.find_expert(layer, slot, None)
    }

    /// The entry of an input of expert `expert` (`None`: of no expert).
    pub fn find_expert(
        &self,
        layer: Option<usize>,
        slot: CovSlot,
        expert: Option<u32>,
    ) -> Option<&CovEntry> {
        self.entries
            .iter()
            .find(|e| e.layer == layer && e.slot == slot && e.expert == expert)
    }

    /// Bytes of all values.
    pub fn value_bytes(&self) -> u64 {
        self.entries.iter().map(|e| 4 * e.len() as u64).sum()
    }
}

pub(super) fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

/// The packed values of entry `e` of the file `file` as f64.
pub fn values(file: &[u8], e: &CovEntry) -> Vec<f64> {
    file[e.offset..e.offset + 4 * e.len()]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64)
        .collect()
}

/// Reads and checks the section `b[at..]` of a file (the whole file `b`, so offsets are
/// absolute) against `n_layers` and the body's widths: `width(layer, slot, expert)` is
/// the input's, or why the body has no such input.
pub fn parse(
    b: &[u8],
    at: usize,
    n_layers: usize,
    width: impl Fn(Option<usize>, CovSlot, Option<u32>) -> std::result::Result<usize, String>,
) -> Result<Covariance> {
    let short = |what: &str| {
        FormatError::format(
            "covariance",
            format!("{} bytes after the sums", b.len() - at),
            format!("too short for {what}"),
        )
    };
    if b.len() - at < 8 {
        return Err(short("the section header"));
    }
    let count = u32_at(b, at);
    if count == 0 || count > MAX_ENTRIES {
        return Err(FormatError::format(
            "covariance.n_entries",
            count,
            "must be in 1..=1048576",
        ));
    }
    let reserved = u32_at(b, at + 4);
    if reserved != 0 {
        return Err(FormatError::format(
            "covariance.reserved",
            reserved,
            "must be 0",
        ));
    }
    let table = at + 8;
    let count = count as usize;
    if ((b.len() - table) as u64) < (count * ENTRY_BYTES) as u64 {
        return Err(short(&format!("{count} entries")));
    }
    let mut off = (table + count * ENTRY_BYTES) as u64;
    let mut entries: Vec<CovEntry> = Vec::with_capacity(count);
    for i in 0..count {
        let e = table + i * ENTRY_BYTES;
        let field = |f: &str| format!("covariance.entries[{i}].{f}");
        let (layer, slot, expert, n) = (
            u32_at(b, e),
            u32_at(b, e + 4),
            u32_at(b, e + 8),
            u32_at(b, e + 12),
        );
        let tokens = u64::from_le_bytes(b[e + 16..e + 24].try_into().expect("8 bytes"));
        let slot = CovSlot::from_code(slot)
            .ok_or_else(|| FormatError::format(field("slot"), slot, "must be 0..=4"))?;
        let layer = match (slot, layer) {
            (CovSlot::Cls, NONE) => None,
            (CovSlot::Cls, l) => {
                return Err(FormatError::format(
                    field("layer"),
                    l,
                    "the classifier's entry has layer 0xFFFFFFFF",
                ))
            }
            (_, l) if (l as usize) < n_layers => Some(l as usize),
            (_, l) => {
                return Err(FormatError::format(
                    field("layer"),
                    l,
                    format!("must be below n_layers ({n_layers})"),
                ))
            }
        };
        let expert = (expert != NONE).then_some(expert);
        let want = width(layer, slot, expert).map_err(|rule| {
            FormatError::format(
                field("expert"),
                expert.map_or("0xFFFFFFFF".to_string(), |e| e.to_string()),
                rule,
            )
        })?;
        if n as usize != want {
            return Err(FormatError::shape(
                field("n"),
                n,
                format!("the {} input has {want} channels", slot.name()),
            ));
        }
        let entry = CovEntry {
            layer,
            slot,
            expert,
            n: n as usize,
            tokens,
            offset: off as usize,
        };
        if let Some(prev) = entries.last() {
            if entry.key() <= prev.key() {
                return Err(FormatError::format(
                    field("layer"),
                    format!(
                        "({}, {}, {})",
                        layer.map_or(NONE, |l| l as u32),
                        slot.code(),
                        expert.unwrap_or(NONE)
                    ),
                    "entries must be strictly increasing in (layer, slot, expert)",
                ));
            }
        }
        // n ≤ 65536: ≤ 2^31 values per entry, ≤ 2^20 entries: no overflow in u64.
        off += 4 * entry.len() as u64;
        entries.push(entry);
    }
    if b.len() as u64 != off {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", b.len()),
            format!("the covariance section implies {off} bytes"),
        ));
    }
    for (i, e) in entries.iter().enumerate() {
        let vals = &b[e.offset..e.offset + 4 * e.len()];
        let at = |k: usize| f32::from_le_bytes(vals[4 * k..4 * k + 4].try_into().expect("4"));
        let bad = |k: usize, v: f32| {
            FormatError::format(
                format!("covariance.entries[{i}].values[{k}]"),
                v,
                "must be finite (and ≥ 0 on the diagonal)",
            )
        };
        if let Some(k) = (0..e.len()).find(|&k| !at(k).is_finite()) {
            return Err(bad(k, at(k)));
        }
        // Row r's diagonal opens it: at r·n − r(r−1)/2.
        let mut k = 0;
        for r in 0..e.n {
            if at(k) < 0.0 {
                return Err(bad(k, at(k)));
            }
            k += e.n - r;
        }
    }
    Ok(Covariance { entries })
}

/// One input's accumulated `H` (upper triangle packed by rows) and its token count, as
/// [`write`] takes it.
pub struct CovData<'a> {
    pub layer: Option<usize>,
    pub slot: CovSlot,
    /// `Some(e)`: routed expert e's input.
    pub expert: Option<u32>,
    pub tokens: u64,
    pub n: usize,
    pub tri: &'a [f64],
}

/// Appends the section for `data` (in any order; written sorted) to `body` (an MLI
/// file's bytes without one) and sets the version's [`FLAG`].
pub fn write(mut body: Vec<u8>, data: &[CovData]) -> Vec<u8> {
    let mut order: Vec<&CovData> = data.iter().collect();
    order.sort_by_key(|d| {
        (
            d.layer.map_or(NONE, |l| l as u32),
            d.slot.code(),
            d.expert.unwrap_or(NONE),
        )
    });
    let version = u32_at(&body, 4) | FLAG;
    body[4..8].copy_from_slice(&version.to_le_bytes());
    let values: usize = order.iter().map(|d| d.tri.len()).sum();
    body.reserve(8 + ENTRY_BYTES * order.len() + 4 * values);
    body.extend_from_slice(&(order.len() as u32).to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    for d in &order {
        assert_eq!(
            d.tri.len(),
            d.n * (d.n + 1) / 2,
            "packed triangle of {}",
            d.n
        );
        for v in [
            d.layer.map_or(NONE, |l| l as u32),
            d.slot.code(),
            d.expert.unwrap_or(NONE),
            d.n as u32,
        ] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        body.extend_from_slice(&d.tokens.to_le_bytes());
    }
    for d in &order {
        for &v in d.tri {
            body.extend_from_slice(&(v as f32).to_le_bytes());
        }
    }
    body
}
