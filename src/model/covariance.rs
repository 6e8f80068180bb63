//! The covariance observer (`mlb-run --imatrix F --covariance`): besides the importance
//! sums of the [`Collector`], the full `H = Σ x xᵀ` of every matrix input, per layer
//! slot (Attn, Wo, W13, W2) and for the classifier, as the MLI covariance section
//! ([`crate::format::mli::cov`]) stores it:
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

/// Rows of H per task; a tile is ROWS × COLS entries kept in registers over the rows
/// of x.
const ROWS: usize = 4;
const COLS: usize = 8;

impl CovAccum {
    pub fn new(n: usize) -> CovAccum {
        CovAccum {
            n,
            tokens: 0,
            tri: vec![0.0; n * (n + 1) / 2],
        }
    }

    /// Offset of row `i` in the packed triangle.
    fn row_start(&self, i: usize) -> usize {
        i * self.n - i * i.saturating_sub(1) / 2
    }

    /// Adds `Σ x xᵀ` of `rows` (rows of n values) in row order.
    pub fn add(&mut self, rows: &[f32]) {
        let n = self.n;
        debug_assert_eq!(rows.len() % n, 0);
        let t = rows.len() / n;
        if t == 0 {
            return;
        }
        self.tokens += t as u64;
        // x as f64, each row padded with zeros to a whole tile.
        let np = n.div_ceil(COLS) * COLS;
        let mut x = vec![0f64; t * np];
        for (xr, r) in x.chunks_exact_mut(np).zip(rows.chunks_exact(n)) {
            for (o, &v) in xr.iter_mut().zip(r) {
                *o = v as f64;
            }
        }
        // Split the triangle into groups of ROWS rows; each task owns one group.
        let starts: Vec<usize> = (0..n).map(|i| self.row_start(i)).collect();
        let mut groups: Vec<std::sync::Mutex<&mut [f64]>> = Vec::new();
        let mut rest: &mut [f64] = &mut self.tri;
        for g in (0..n).step_by(ROWS) {
            let end = if g + ROWS < n {
                starts[g + ROWS]
            } else {
                starts[n - 1] + 1
            };
            let (head, tail) = rest.split_at_mut(end - starts[g]);
            groups.push(std::sync::Mutex::new(head));
            rest = tail;
        }
        let x = &x;
        pool::run(groups.len(), |gi| {
            let mut tri = groups[gi].lock().expect("one task per group");
            add_group(&mut tri, n, np, gi * ROWS, x, t);
        });
    }
}

/// Adds the products of rows `i0..i0 + ROWS` (those below n) of H: `tri` holds those
/// rows of the packed triangle, `x` the `t` rows padded to `np`.
fn add_group(tri: &mut [f64], n: usize, np: usize, i0: usize, x: &[f64], t: usize) {
    let ra = ROWS.min(n - i0);
    // Offsets of the group's rows within `tri`; row i holds columns i..n.
    let mut off = [0usize; ROWS];
    for a in 1..ra {
        off[a] = off[a - 1] + (n - (i0 + a - 1));
    }
    let mut j0 = i0 - i0 % COLS;
    while j0 < n {
        let mut acc = [[0f64; COLS]; ROWS];
        for (a, acc_a) in acc.iter_mut().enumerate().take(ra) {
            for (b, v) in acc_a.iter_mut().enumerate() {
                let (i, j) = (i0 + a, j0 + b);
                if j >= i && j < n {
                    *v = tri[off[a] + j - i];
                }
            }
        }
        for xr in x.chunks_exact(np).take(t) {
            let xj: &[f64; COLS] = xr[j0..j0 + COLS].try_into().expect("a padded tile");
            for (a, acc_a) in acc.iter_mut().enumerate().take(ra) {
                let xi = xr[i0 + a];
                for (v, &xb) in acc_a.iter_mut().zip(xj) {
                    *v += xi * xb;
                }
            }
        }
        for (a, acc_a) in acc.iter().enumerate().take(ra) {
            for (b, &v) in acc_a.iter().enumerate() {
                let (i, j) = (i0 + a, j0 + b);
                if j >= i && j < n {
                    tri[off[a] + j - i] = v;
                }
            }
        }
        j0 += COLS;
    }
}

/// The observer of `--covariance`: the [`Collector`]'s sums and every input's `H`.
pub struct CovCollector {
    sums: Collector,
    /// Per layer: Attn, Wo, W13, W2.
    layers: Vec<[CovAccum; 4]>,
    cls: CovAccum,
    /// lout's input feeds the Wo slot (V·dv = q_dim).
    lout_in_wo: bool,
}

impl CovCollector {
    pub fn new(cfg: &Config) -> CovCollector {
        let sums = Collector::new(cfg);
        let lout_in_wo = !cfg.layers.contains(&LayerKind::Linear) || sums.lout_in_wo();
        let (d, q, h) = (cfg.dim, cfg.q_dim, cfg.hidden_dim);
        CovCollector {
            sums,
            layers: (0..cfg.n_layers)
                .map(|_| {
                    [
                        CovAccum::new(d),
                        CovAccum::new(q),
                        CovAccum::new(d),
                        CovAccum::new(h),
                    ]
                })
                .collect(),
            cls: CovAccum::new(d),
            lout_in_wo,
        }
    }

    /// Bytes its accumulators take for the model `cfg`.
    pub fn memory(cfg: &Config) -> u64 {
        let tri = |n: usize| (n * (n + 1) / 2 * 8) as u64;
        let (d, q, h) = (cfg.dim, cfg.q_dim, cfg.hidden_dim);
        cfg.n_layers as u64 * (2 * tri(d) + tri(q) + tri(h)) + tri(d)
    }

    pub fn mli(&self) -> &Mli {
        self.sums.mli()
    }

    /// The MLI file's bytes: the sums, then the covariance section (inputs that saw no
    /// rows are left out).
    pub fn to_bytes(&self) -> Vec<u8> {
        const SLOTS: [Slot; 4] = [Slot::Attn, Slot::Wo, Slot::W13, Slot::W2];
        let mut data: Vec<CovData> = Vec::new();
        for (l, accs) in self.layers.iter().enumerate() {
            for (slot, a) in SLOTS.iter().zip(accs) {
                if a.tokens > 0 {
                    data.push(CovData {
                        layer: Some(l),
                        slot: CovSlot::Layer(*slot),
                        tokens: a.tokens,
                        n: a.n,
                        tri: &a.tri,
                    });
                }
            }
        }
        if self.cls.tokens > 0 {
            data.push(CovData {
                layer: None,
                slot: CovSlot::Cls,
                tokens: self.cls.tokens,
                n: self.cls.n,
                tri: &self.cls.tri,
            });
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
        let acc = match input {
            Input::Attn => &mut self.layers[layer][0],
            Input::Wo => &mut self.layers[layer][1],
            Input::LinOut if self.lout_in_wo => &mut self.layers[layer][1],
            Input::W13 => &mut self.layers[layer][2],
            Input::W2 => &mut self.layers[layer][3],
            Input::Cls => &mut self.cls,
            // lout's input of another width has no slot; experts' inputs have none yet.
            #[allow(unreachable_patterns)]
            _ => return,
        };
        acc.add(rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain sums, for widths that are and are not whole tiles, and in
    /// batches: the same bits however the rows are split.
    #[test]
    fn packed_products_match_the_plain_sum() {
        for n in [1, 5, 8, 13, 36] {
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
