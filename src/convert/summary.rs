//! What a conversion reports at the end: a [`Summary`] (as it goes:
//! [`Progress`](super::pipeline::stream::Progress)).

use std::path::PathBuf;
use std::time::Instant;

use super::pipeline::mix::MixRow;
use crate::format::mlb::header::Header;
use crate::format::mlb::{Kind, Layout};
use crate::format::WType;
use crate::quant::Q4Rule;

/// What was written.
#[derive(Debug, Clone)]
pub struct Summary {
    pub output: PathBuf,
    pub arch: &'static str,
    pub header: Header,
    pub params: u64,
    pub file_bytes: u64,
    pub seconds: f64,
    pub notes: Vec<String>,
    /// The Q4_0 rule used, when some matrix is Q4_0.
    pub q4_rule: Option<Q4Rule>,
    /// Matrices per type, in code order (one entry for a uniform file).
    pub types: Vec<(WType, usize)>,
    /// With `target_bpw`: every matrix's measured candidates and choice.
    pub mix: Vec<MixRow>,
    /// Bits per weight of the matrices (as mlb-inspect counts them).
    pub matrix_bpw: f64,
}

impl Summary {
    /// `BF16`, or `mixed (30 BF16, 1 Q8_0)`.
    pub fn type_text(&self) -> String {
        match self.types.as_slice() {
            [(t, _)] => t.name().to_string(),
            all => {
                let parts: Vec<String> = all.iter().map(|(t, n)| format!("{n} {t}")).collect();
                format!("mixed ({})", parts.join(", "))
            }
        }
    }

    /// What any conversion reports of the `layout` it wrote to `output`, `t0` being its
    /// start; the caller sets the rest (file size, notes, Q4_0 rule, mix rows).
    pub(crate) fn of_layout(
        output: PathBuf,
        arch: &'static str,
        header: Header,
        layout: &Layout,
        t0: Instant,
    ) -> Summary {
        Summary {
            output,
            arch,
            header,
            params: layout.params(),
            file_bytes: 0,
            seconds: t0.elapsed().as_secs_f64(),
            notes: Vec::new(),
            q4_rule: None,
            types: type_counts(layout),
            mix: Vec::new(),
            matrix_bpw: matrix_bpw(layout),
        }
    }

    /// File bits per parameter.
    pub fn bits_per_weight(&self) -> f64 {
        if self.params == 0 {
            0.0
        } else {
            self.file_bytes as f64 * 8.0 / self.params as f64
        }
    }
}

/// Bits per weight of all matrices of `layout`, scales included (as mlb-inspect counts).
fn matrix_bpw(layout: &Layout) -> f64 {
    let (mut w, mut b) = (0u64, 0u64);
    for t in layout
        .tensors
        .iter()
        .filter(|t| matches!(t.kind, Kind::Mat { .. }))
    {
        (w, b) = (w + t.params(), b + t.stored_bytes());
    }
    b as f64 * 8.0 / w.max(1) as f64
}

/// Matrices per type in `layout`, in code order (the types present).
fn type_counts(layout: &Layout) -> Vec<(WType, usize)> {
    let mut n = [0usize; WType::ALL.len()];
    for t in &layout.tensors {
        if let Kind::Mat { wtype, .. } = t.kind {
            n[wtype as usize] += 1;
        }
    }
    WType::ALL
        .into_iter()
        .zip(n)
        .filter(|&(_, c)| c > 0)
        .collect()
}
