//! The covariance observer (`mlb-run --imatrix F --covariance`): besides the importance
//! sums of the [`Collector`], the full `H = Σ x xᵀ` of every matrix input, per layer
//! slot (Attn, Wo, W13, W2), per routed expert's ew2 input and for the classifier, as
//! the MLI covariance section ([`crate::format::mli::cov`]) stores it:
//!
//! ```text
//! H[i][j] += (x_i as f64) · (x_j as f64)      for every row x, every j ≥ i
//! ```
//!
//! Each entry is summed in f64 in row order (products of f32 are exact in f64), so
//! the result depends neither on the thread count nor on how the rows are batched.
//! Memory: `4·n(n+1)` bytes per slot of n channels (the upper triangle in f64);
//! arithmetic: `n(n+1)/2` multiply-adds per row and slot.

use super::config::{Config, LayerKind};
use super::observer::{Collector, Input, Observer};
use crate::format::mli::cov::{self as mli_cov, CovData, CovSlot};
use crate::format::mli::{Mli, Slot};
use crate::kernels::pool;

/// One input's running `H` (upper triangle packed by rows, f64) and its row count.
#[derive(Debug, Clone)]
pub struct CovAccum {
    pub n: usize,
    pub tokens: u64,
    pub tri: Vec<f64>,
}

/// Rows of H per task: a band of the triangle, computed as one dense product.
const BAND: usize = 64;

impl CovAccum {
    pub fn new(n: usize) -> CovAccum {
        CovAccum {
            n,
            tokens: 0,
            tri: vec![0.0; n * (n + 1) / 2],
        }
    }

    /// Adds `Σ x xᵀ` of `rows` (rows of n values) in row order.
    ///
    /// As the kernel table's f64 product `C −= E·U` with `E = −Xᵀ` and `U = X`: each
    /// element takes `fma(x_pi, x_pj, h)` for the rows p in order, and a product of two
    /// f32 values is exact in f64, so the bits are the plain sums' (`h += x_pi · x_pj`).
    pub fn add(&mut self, rows: &[f32]) {
        let n = self.n;
        debug_assert_eq!(rows.len() % n, 0);
        let t = rows.len() / n;
        if t == 0 {
            return;
        }
        self.tokens += t as u64;
        let x: Vec<f64> = rows.iter().map(|&v| v as f64).collect();
        let mut neg_xt = vec![0f64; n * t];
        for (p, r) in rows.chunks_exact(n).enumerate() {
            for (i, &v) in r.iter().enumerate() {
                neg_xt[i * t + p] = -(v as f64);
            }
        }
        // Split the triangle into bands of BAND rows; each task owns one band.
        let mut bands: Vec<std::sync::Mutex<(usize, &mut [f64])>> = Vec::new();
        let mut rest: &mut [f64] = &mut self.tri;
        for i0 in (0..n).step_by(BAND) {
            let i1 = (i0 + BAND).min(n);
            // Rows i0..i1 hold columns i..n each.
            let len: usize = (i0..i1).map(|i| n - i).sum();
            let (head, tail) = rest.split_at_mut(len);
            bands.push(std::sync::Mutex::new((i0, head)));
            rest = tail;
        }
        let (x, neg_xt) = (&x, &neg_xt);
        pool::run(bands.len(), |b| {
            let mut band = bands[b].lock().expect("one task per band");
            let (i0, ref mut tri) = *band;
            let (m, w) = ((n - i0).min(BAND), n - i0);
            // The band as a dense m × w block (columns i0..n); left of the diagonal
            // is scratch.
            let mut c = vec![0f64; m * w];
            let mut at = 0;
            for a in 0..m {
                c[a * w + a..(a + 1) * w].copy_from_slice(&tri[at..at + w - a]);
                at += w - a;
            }
            crate::kernels::sub_product(
                [m, t, w],
                (&neg_xt[i0 * t..], t),
                (&x[i0..], n),
                (&mut c, w),
            );
            let mut at = 0;
            for a in 0..m {
                tri[at..at + w - a].copy_from_slice(&c[a * w + a..(a + 1) * w]);
                at += w - a;
            }
        });
    }
}

/// The observer of `--covariance`: the [`Collector`]'s sums and every input's `H`.
pub struct CovCollector {
    sums: Collector,
    /// Per layer: Attn, Wo, W13 and W2 (a dense layer's w2 input; in a MoE layer the
    /// shared expert's sw2 input, `None` without one).
    layers: Vec<[Option<CovAccum>; 4]>,
    /// Per layer and routed expert: its ew2 input, made when a token first reaches it
    /// (empty for a dense layer). The ew1/ew3 inputs have no per-expert `H`: dim × dim
    /// per expert would be E·dim² (at Qwen3-30B-A3B's 48 layers × 128 experts, 103 GB of
    /// accumulators), each filled by a few tokens; they take the layer's W13 (every
    /// token's FFN input, of which the router only chooses).
    experts: Vec<Vec<Option<CovAccum>>>,
    expert_hidden: usize,
    cls: CovAccum,
    /// lout's input feeds the Wo slot (V·dv = q_dim).
    lout_in_wo: bool,
}

/// The section's entry of accumulator `a`.
fn entry(layer: Option<usize>, slot: CovSlot, expert: Option<u32>, a: &CovAccum) -> CovData<'_> {
    CovData {
        layer,
        slot,
        expert,
        tokens: a.tokens,
        n: a.n,
        tri: &a.tri,
    }
}

/// Bytes of one input's accumulator of n channels.
fn tri_bytes(n: usize) -> u64 {
    (n * (n + 1) / 2 * 8) as u64
}

impl CovCollector {
    pub fn new(cfg: &Config) -> CovCollector {
        let sums = Collector::new(cfg);
        let lout_in_wo = !cfg.layers.contains(&LayerKind::Linear) || sums.lout_in_wo();
        let layers = (0..cfg.n_layers)
            .map(|l| Self::widths(cfg, l).map(|n| n.map(CovAccum::new)))
            .collect();
        let n_experts = cfg.moe.as_ref().map_or(0, |m| m.n_experts);
        let experts = (0..cfg.n_layers)
            .map(|l| match cfg.moe_layers.get(l) {
                Some(true) => vec![None; n_experts],
                _ => Vec::new(),
            })
            .collect();
        CovCollector {
            sums,
            layers,
            experts,
            expert_hidden: cfg.moe.as_ref().map_or(0, |m| m.expert_hidden),
            cls: CovAccum::new(cfg.dim),
            lout_in_wo,
        }
    }

    /// The widths of layer `l`'s Attn, Wo, W13 and W2 inputs; W2 is the dense w2's, or in
    /// a MoE layer the shared expert's sw2's (`None` without one).
    fn widths(cfg: &Config, l: usize) -> [Option<usize>; 4] {
        let w2 = match (cfg.moe_layers.get(l), &cfg.moe) {
            (Some(true), Some(m)) => (m.shared_hidden > 0).then_some(m.shared_hidden),
            _ => Some(cfg.hidden_dim),
        };
        [Some(cfg.dim), Some(cfg.q_dim), Some(cfg.dim), w2]
    }

    /// Bytes its accumulators take for the model `cfg` at most (every expert reached).
    pub fn memory(cfg: &Config) -> u64 {
        let experts = cfg
            .moe
            .as_ref()
            .map_or(0, |m| m.n_experts as u64 * tri_bytes(m.expert_hidden));
        (0..cfg.n_layers)
            .map(|l| {
                let slots: u64 = Self::widths(cfg, l)
                    .iter()
                    .flatten()
                    .map(|&n| tri_bytes(n))
                    .sum();
                let moe = cfg.moe_layers.get(l) == Some(&true);
                slots + if moe { experts } else { 0 }
            })
            .sum::<u64>()
            + tri_bytes(cfg.dim)
    }

    pub fn mli(&self) -> &Mli {
        self.sums.mli()
    }

    /// The MLI file's bytes: the sums, then the covariance section (inputs that saw no
    /// rows are left out).
    pub fn to_bytes(&self) -> Vec<u8> {
        const SLOTS: [Slot; 4] = [Slot::Attn, Slot::Wo, Slot::W13, Slot::W2];
        let mut data: Vec<CovData> = Vec::new();
        for (l, (accs, experts)) in self.layers.iter().zip(&self.experts).enumerate() {
            for (slot, a) in SLOTS.iter().zip(accs) {
                if let Some(a) = a.as_ref().filter(|a| a.tokens > 0) {
                    data.push(entry(Some(l), CovSlot::Layer(*slot), None, a));
                }
            }
            for (e, a) in experts.iter().enumerate() {
                if let Some(a) = a.as_ref().filter(|a| a.tokens > 0) {
                    data.push(entry(Some(l), CovSlot::Layer(Slot::W2), Some(e as u32), a));
                }
            }
        }
        if self.cls.tokens > 0 {
            data.push(entry(None, CovSlot::Cls, None, &self.cls));
        }
        let body = self.sums.mli().to_bytes();
        if data.is_empty() {
            return body;
        }
        mli_cov::write(body, &data)
    }
}

impl Observer for CovCollector {
    fn observe(&mut self, layer: usize, input: Input, rows: &[f32]) {
        self.sums.observe(layer, input, rows);
        let slots = &mut self.layers[layer];
        let acc = match input {
            Input::Attn => slots[0].as_mut(),
            Input::Wo => slots[1].as_mut(),
            Input::LinOut if self.lout_in_wo => slots[1].as_mut(),
            Input::W13 => slots[2].as_mut(),
            Input::W2 | Input::SharedHidden => slots[3].as_mut(),
            Input::Cls => Some(&mut self.cls),
            Input::ExpertHidden(e) => {
                let eh = self.expert_hidden;
                self.experts[layer]
                    .get_mut(e as usize)
                    .map(|a| a.get_or_insert_with(|| CovAccum::new(eh)))
            }
            // lout's input of another width has no slot; the experts' ew1/ew3 take
            // the layer's W13 (the struct's note).
            Input::LinOut | Input::ExpertIn(_) => None,
        };
        if let Some(acc) = acc {
            acc.add(rows);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain sums, for widths that are and are not whole tiles, and in
    /// batches: the same bits however the rows are split.
    #[test]
    fn packed_products_match_the_plain_sum() {
        for n in [1, 5, 8, 13, 36, 70, 131] {
            let t = 11;
            let x: Vec<f32> = (0..t * n)
                .map(|k| ((k * 37 % 23) as f32 - 11.0) * 0.37)
                .collect();
            let mut a = CovAccum::new(n);
            a.add(&x);
            let mut b = CovAccum::new(n);
            b.add(&x[..4 * n]);
            b.add(&x[4 * n..]);
            let mut k = 0;
            for i in 0..n {
                for j in i..n {
                    let mut s = 0f64;
                    for r in 0..t {
                        s += x[r * n + i] as f64 * x[r * n + j] as f64;
                    }
                    assert_eq!(a.tri[k].to_bits(), s.to_bits(), "n {n} ({i}, {j})");
                    k += 1;
                }
            }
            assert_eq!(a.tri, b.tri);
            assert_eq!((a.tokens, b.tokens), (t as u64, t as u64));
        }
    }
}
