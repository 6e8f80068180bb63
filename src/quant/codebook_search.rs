//! The nearest entry of a codebook grid under a weighted error, without scanning the
//! grid: what [`super::codebook_fit`] asks for every group at every scale it tries.
//!
//! A grid entry `e` is a point of the product lattice `L^dim`: its value `i` is level
//! `lv[e][i]` of the type's few levels `L` (3 for IQ2_* and IQ1_M, 8 for IQ3_*). For a
//! group's scaled target `u` (the target over the scale) and element weights `w ≥ 0`,
//! the cost of `e` is separable:
//!
//! ```text
//! cost(e) = Σ_i c_i(lv[e][i]),   c_i(l) = w_i·(u_i − L_l)²
//! ```
//!
//! so the best point of the whole lattice is `p`, each coordinate at its nearest level
//! (cost `base`). Let `δ_i ≥ 0` be what coordinate `i` loses at its second-nearest
//! level (always a neighbour of `p_i`). An entry that differs from `p` in `h`
//! coordinates costs at least `base` plus the `h` smallest `δ_i`. Hence:
//!
//! 1. `p` on the grid: it is the answer (exact: no entry can cost less than `base`).
//! 2. Else the entries near `p` (listed per lattice point when the grid is first used,
//!    ascending) are scored: those within Hamming distance `R` whose values are each at
//!    most `S` levels from `p`'s. Every other entry changes more than `R` values, so
//!    costs at least `base` plus the `R + 1` smallest `δ_i`, or moves a value more than
//!    `S` levels, so costs at least `base` plus the least loss of a value `S + 1` levels
//!    away (a value's cost grows away from its nearest level): `bound` is the smaller.
//!    If the list's best is within `bound` (or a cost to beat already is), it is the
//!    answer (exact). R = 3 for IQ2_XXS, 2 for IQ2_XS, IQ2_S, IQ1_M (S = 2: any
//!    level); S = 1 for IQ3_* (R = 4: any number of values).
//! 3. Else a depth-first scan of the grid in lexicographic order that skips every
//!    subtree whose prefix cost plus the least cost of the values left cannot beat the
//!    best so far (exact too).
//!
//! So the answer is always the grid's minimum. "Exact" is up to f32 rounding of the
//! costs (each a sum of `dim` table values in coordinate order): at a near-tie (costs
//! equal to ~1e-6 relative) another entry of the same cost may be returned; among
//! exactly equal costs in a list or scan the lowest index wins. The result is a pure
//! function of `u` and `w`, whatever the thread count.
//!
//! IQ1_M's values are `8g ± 1` with `g` from a grid of {−1, 0, 1}: one lattice, searched
//! once per shift with that shift's levels (−7, 1, 9 and −9, −1, 7).

use std::sync::OnceLock;

use crate::format::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
};
use crate::format::wtype::WType;

/// The most coordinates per entry and levels per coordinate.
const MAX_DIM: usize = 8;
const MAX_LEVELS: usize = 8;
/// A lattice point that is not a grid entry.
const OFF: u16 = u16::MAX;

/// A codebook grid as points of its product lattice, with the neighbour lists.
pub struct Lattice {
    /// Values per entry (8, or 4 for IQ3_*).
    pub dim: usize,
    /// The levels, ascending (IQ1_M: the grid's −1, 0, 1).
    pub levels: Vec<f32>,
    /// `lv[e·dim + i]`: the level index of value `i` of entry `e`.
    lv: Vec<u8>,
    /// Per lattice point (`Σ p_i·nl^i`): its entry, or `OFF`.
    at: Vec<u16>,
    /// The lists' Hamming radius and largest step (in levels) of a value.
    radius: usize,
    max_step: usize,
    /// The entries near lattice point `k` (within `radius` and `max_step`):
    /// `near[start[k]..start[k + 1]]`,
    /// ascending (empty for the points on the grid, which need none).
    start: Vec<u32>,
    near: Vec<u16>,
    /// The entries in lexicographic order of their level indices (value 0 first):
    /// `order[j]` is the entry at position `j`, `slv[j·dim + i]` its level indices.
    order: Vec<u16>,
    slv: Vec<u8>,
    /// `skip[j·dim + k]`: the first position after `j` whose first `k + 1` level
    /// indices differ from `j`'s (the end of `j`'s subtree at depth `k`).
    skip: Vec<u16>,
}

/// The best entry found and its cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Found {
    pub entry: usize,
    pub cost: f32,
}

/// Which step of the module doc answered (tests and statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    OnGrid,
    List,
    Scan,
}

impl Lattice {
    fn new(dim: usize, (radius, max_step): (usize, usize), entries: &[Vec<i8>]) -> Lattice {
        let mut levels: Vec<i8> = entries.iter().flatten().copied().collect();
        levels.sort_unstable();
        levels.dedup();
        assert!(levels.len() <= MAX_LEVELS && dim <= MAX_DIM);
        let nl = levels.len();
        let lv: Vec<u8> = entries
            .iter()
            .flat_map(|e| e.iter().map(|v| levels.binary_search(v).unwrap() as u8))
            .collect();
        let points = nl.pow(dim as u32);
        let key = |e: usize| {
            lv[e * dim..(e + 1) * dim]
                .iter()
                .rev()
                .fold(0, |k, &l| k * nl + l as usize)
        };
        let mut at = vec![OFF; points];
        for e in 0..entries.len() {
            at[key(e)] = e as u16;
        }
        let (mut start, mut near) = (Vec::with_capacity(points + 1), Vec::new());
        let mut digits = [0u8; MAX_DIM];
        for (k, &ak) in at.iter().enumerate() {
            start.push(near.len() as u32);
            if ak != OFF {
                continue;
            }
            let mut r = k;
            for d in digits.iter_mut().take(dim) {
                *d = (r % nl) as u8;
                r /= nl;
            }
            for e in 0..entries.len() {
                let g = &lv[e * dim..(e + 1) * dim];
                let steps = g.iter().zip(&digits).map(|(&a, &b)| a.abs_diff(b) as usize);
                if steps.clone().filter(|&d| d > 0).count() <= radius
                    && steps.max() <= Some(max_step)
                {
                    near.push(e as u16);
                }
            }
        }
        start.push(near.len() as u32);
        let n = entries.len();
        let mut order: Vec<u16> = (0..n as u16).collect();
        order.sort_by_key(|&e| &lv[e as usize * dim..(e as usize + 1) * dim]);
        let slv: Vec<u8> = order
            .iter()
            .flat_map(|&e| lv[e as usize * dim..(e as usize + 1) * dim].iter().copied())
            .collect();
        let mut skip = vec![n as u16; n * dim];
        for j in (0..n.saturating_sub(1)).rev() {
            for k in 0..dim {
                let same =
                    slv[j * dim..j * dim + k + 1] == slv[(j + 1) * dim..(j + 1) * dim + k + 1];
                skip[j * dim + k] = if same {
                    skip[(j + 1) * dim + k]
                } else {
                    j as u16 + 1
                };
            }
        }
        Lattice {
            dim,
            levels: levels.iter().map(|&l| l as f32).collect(),
            lv,
            at,
            radius,
            max_step,
            start,
            near,
            order,
            slv,
            skip,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.lv.len() / self.dim
    }

    /// Whether the grid has no entries (never, for the IQ grids).
    pub fn is_empty(&self) -> bool {
        self.lv.is_empty()
    }

    /// Level index of value `i` of entry `e`.
    pub fn level(&self, e: usize, i: usize) -> usize {
        self.lv[e * self.dim + i] as usize
    }

    /// The entry of least `Σ w_i (u_i − vals[lv_i])²` if that cost is below `beat`
    /// (else `None`), and the step that found it. `vals` are the values of the levels
    /// (ascending, as many as [`Lattice::levels`]); `u`, `w` are `dim` long, `w ≥ 0`, all
    /// finite.
    pub fn nearest(&self, vals: &[f32], u: &[f32], w: &[f32], beat: f32) -> Option<(Found, Step)> {
        // The grids' two shapes, each with its loops unrolled: this runs hundreds of
        // times per block.
        match (self.dim, vals.len()) {
            (8, 3) => self.nearest_in::<8, 3>(vals, u, w, beat),
            (4, 8) => self.nearest_in::<4, 8>(vals, u, w, beat),
            (d, l) => unreachable!("no codebook grid has {d} values of {l} levels"),
        }
    }

    fn nearest_in<const D: usize, const NL: usize>(
        &self,
        vals: &[f32],
        u: &[f32],
        w: &[f32],
        beat: f32,
    ) -> Option<(Found, Step)> {
        let vals: &[f32; NL] = vals.try_into().expect("one value per level");
        let u: &[f32; D] = u.try_into().expect("one target per value");
        let w: &[f32; D] = w.try_into().expect("one weight per value");
        // Rows of MAX_LEVELS: a level index masked to 3 bits needs no bounds check.
        let mut c = [[0f32; MAX_LEVELS]; MAX_DIM];
        let mut delta = [0f32; D];
        // What a value loses `max_step + 1` levels away from its nearest (the least).
        let mut far = f32::INFINITY;
        // suffix[k]: the least cost of values k.. (each at its nearest level).
        let mut suffix = [0f32; MAX_DIM + 1];
        let (mut base, mut key, mut stride) = (0f32, 0usize, 1usize);
        for i in 0..D {
            let ci = &mut c[i];
            let mut p = 0;
            for l in 0..NL {
                let d = u[i] - vals[l];
                ci[l] = w[i] * d * d;
                if ci[l] < ci[p] {
                    p = l;
                }
            }
            // The second-nearest level is next to the nearest (the levels are sorted).
            let left = if p > 0 { ci[p - 1] } else { f32::INFINITY };
            let right = if p + 1 < NL { ci[p + 1] } else { f32::INFINITY };
            delta[i] = left.min(right) - ci[p];
            let k = self.max_step + 1;
            let left = if p >= k { ci[p - k] } else { f32::INFINITY };
            let right = if p + k < NL { ci[p + k] } else { f32::INFINITY };
            far = far.min(left.min(right) - ci[p]);
            suffix[i] = ci[p];
            base += ci[p];
            key += p * stride;
            stride *= NL;
        }
        let lv: &[[u8; D]] = self.lv.as_chunks().0;
        let cost = |e: usize| -> f32 {
            lv[e]
                .iter()
                .zip(&c)
                .map(|(&l, ci)| ci[l as usize & (MAX_LEVELS - 1)])
                .sum()
        };
        for i in (0..D).rev() {
            suffix[i] += suffix[i + 1];
        }
        let found = |entry, cost: f32, step| {
            #[cfg(test)]
            STEPS.with(|s| s.set(s.get() + [1, 1 << 21, 1 << 42][step as usize]));
            (cost < beat).then_some((Found { entry, cost }, step))
        };
        let on = self.at[key];
        if on != OFF {
            return found(on as usize, cost(on as usize), Step::OnGrid);
        }
        let mut best = Found {
            entry: 0,
            cost: f32::INFINITY,
        };
        for &e in &self.near[self.start[key] as usize..self.start[key + 1] as usize] {
            let v = cost(e as usize);
            if v < best.cost {
                best = Found {
                    entry: e as usize,
                    cost: v,
                };
            }
        }
        // An entry off the list changes more than `radius` values, or one value by more
        // than `max_step` levels (each value's cost grows away from its nearest level).
        let hamming = if self.radius < D {
            // The radius + 1 smallest losses, ascending (a selection: no sort call).
            for k in 0..=self.radius {
                let m = (k..D).fold(k, |m, j| if delta[j] < delta[m] { j } else { m });
                delta.swap(k, m);
            }
            delta[..=self.radius].iter().sum::<f32>()
        } else {
            f32::INFINITY
        };
        let bound = base + hamming.min(far);
        if best.cost <= bound || beat <= bound {
            return found(best.entry, best.cost, Step::List);
        }
        if beat < best.cost {
            best = Found {
                entry: usize::MAX,
                cost: beat,
            };
        }
        let e = self.pruned_scan::<D>(&c, &suffix, best);
        found(e.entry, e.cost, Step::Scan)
    }

    /// Depth-first over the entries in lexicographic order, from `best`: a subtree is
    /// skipped as soon as its prefix cost plus the least cost of the values left
    /// (`suffix`) cannot go below the best so far. Exact: every entry it skips costs at
    /// least that much (up to f32 rounding).
    fn pruned_scan<const D: usize>(
        &self,
        c: &[[f32; MAX_LEVELS]; MAX_DIM],
        suffix: &[f32],
        mut best: Found,
    ) -> Found {
        let n = self.order.len();
        let slv: &[[u8; D]] = self.slv.as_chunks().0;
        let skip: &[[u16; D]] = self.skip.as_chunks().0;
        let mut j = 0;
        'entries: while j < n {
            let mut acc = 0f32;
            for k in 0..D {
                acc += c[k][slv[j][k] as usize & (MAX_LEVELS - 1)];
                if acc + suffix[k + 1] >= best.cost {
                    j = skip[j][k] as usize;
                    continue 'entries;
                }
            }
            best = Found {
                entry: self.order[j] as usize,
                cost: acc,
            };
            j += 1;
        }
        best
    }

    /// The exhaustive answer to [`Lattice::nearest`] with `beat = ∞`, the first entry
    /// on ties (tests).
    pub fn scan(&self, vals: &[f32], u: &[f32], w: &[f32]) -> Found {
        let mut best = Found {
            entry: 0,
            cost: f32::INFINITY,
        };
        for e in 0..self.len() {
            let v = (0..self.dim)
                .map(|i| {
                    let d = u[i] - vals[self.level(e, i)];
                    w[i] * d * d
                })
                .sum();
            if v < best.cost {
                best = Found { entry: e, cost: v };
            }
        }
        best
    }
}

#[cfg(test)]
thread_local! {
    /// How often each step answered on this thread: 21 bits each, OnGrid lowest.
    pub static STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Each type's lists: Hamming radius and largest step of a value (in levels). The 3-level
/// grids list every entry within the radius; the 8-level grids those one level from
/// `p` in each value, whose bound (a value two levels away) is rarely beaten. Chosen for
/// few scans (step 3) on Gaussian rows at the scales the quantizer tries (the
/// quantizer's test prints the shares).
fn radius(t: WType) -> (usize, usize) {
    match t {
        WType::IQ2_XXS => (3, 2),
        WType::IQ2_XS | WType::IQ2_S | WType::IQ1_M => (2, 2),
        WType::IQ3_XXS | WType::IQ3_S => (4, 1),
        t => panic!("{t} is not a codebook type"),
    }
}

/// The lattice of codebook type `t`'s grid, built on first use.
pub fn lattice(t: WType) -> &'static Lattice {
    static LATTICES: [OnceLock<Lattice>; 6] = [const { OnceLock::new() }; 6];
    let slot = WType::CODEBOOKS
        .iter()
        .position(|&c| c == t)
        .expect("a codebook type");
    let bytes =
        |e: u64, n: usize| -> Vec<i8> { (0..n).map(|i| (e >> (8 * i)) as u8 as i8).collect() };
    let of8 = |g: &[u64]| g.iter().map(|&e| bytes(e, 8)).collect::<Vec<_>>();
    let of4 = |g: &[u32]| g.iter().map(|&e| bytes(e as u64, 4)).collect::<Vec<_>>();
    LATTICES[slot].get_or_init(|| match t {
        WType::IQ2_XXS => Lattice::new(8, radius(t), &of8(&IQ2XXS_GRID)),
        WType::IQ2_XS => Lattice::new(8, radius(t), &of8(&IQ2XS_GRID)),
        WType::IQ2_S => Lattice::new(8, radius(t), &of8(&IQ2S_GRID)),
        WType::IQ3_XXS => Lattice::new(4, radius(t), &of4(&IQ3XXS_GRID)),
        WType::IQ3_S => Lattice::new(4, radius(t), &of4(&IQ3S_GRID)),
        WType::IQ1_M => Lattice::new(8, radius(t), &of8(&IQ1S_GRID)),
        t => panic!("{t} is not a codebook type"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Targets spread over and beyond the levels, weights like `fit::row_weights`'
    /// (some zero, as an imatrix can make them).
    fn random_case(rng: &mut Rng, lat: &Lattice, vals: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (lo, hi) = (vals[0], vals[vals.len() - 1]);
        let span = hi - lo;
        let u = (0..lat.dim)
            .map(|_| lo - 0.1 * span + 1.2 * span * (rng.next_f32() + 1.0) / 2.0)
            .collect();
        let w = (0..lat.dim)
            .map(|_| {
                let r = rng.next_f32();
                if r < -0.9 {
                    0.0
                } else {
                    0.2 + (r + 1.0) * (r + 1.0)
                }
            })
            .collect();
        (u, w)
    }

    /// The search returns the exhaustive scan's entry on random targets (its cost within
    /// f32 rounding where another entry ties: zero weights make exact ties), every step
    /// is taken, and a cost to beat is honoured.
    #[test]
    fn nearest_agrees_with_the_scan() {
        let mut rng = Rng(0x510e527fade682d1);
        for &t in WType::CODEBOOKS {
            let lat = lattice(t);
            let shifts: Vec<Vec<f32>> = if t == WType::IQ1_M {
                [1.0, -1.0]
                    .iter()
                    .map(|s| lat.levels.iter().map(|g| 8.0 * g + s).collect())
                    .collect()
            } else {
                vec![lat.levels.clone()]
            };
            let mut steps = [0usize; 3];
            let mut other = 0;
            let n = 20000;
            for k in 0..n {
                let vals = &shifts[k % shifts.len()];
                let (u, w) = random_case(&mut rng, lat, vals);
                let want = lat.scan(vals, &u, &w);
                let (got, step) = lat.nearest(vals, &u, &w, f32::INFINITY).unwrap();
                steps[step as usize] += 1;
                if got.entry != want.entry {
                    other += 1;
                    let tol = 1e-5 * want.cost.max(1e-3);
                    assert!(
                        got.cost <= want.cost + tol,
                        "{t}: entry {} cost {} against the scan's {} cost {}",
                        got.entry,
                        got.cost,
                        want.entry,
                        want.cost
                    );
                }
                let beat = want.cost * 0.999;
                assert!(lat.nearest(vals, &u, &w, beat).is_none(), "{t}: beat");
            }
            eprintln!(
                "{t}: on grid {}, list {}, scan {} of {n}; {other} ties answered otherwise",
                steps[0], steps[1], steps[2]
            );
            assert!(steps.iter().all(|&s| s > 0), "{t}: steps {steps:?}");
        }
    }

    #[test]
    fn lattices_hold_their_grids() {
        for &t in WType::CODEBOOKS {
            let lat = lattice(t);
            let nl = lat.levels.len();
            assert_eq!(
                lat.at.iter().filter(|&&e| e != OFF).count(),
                lat.len(),
                "{t}"
            );
            for e in 0..lat.len() {
                let k = (0..lat.dim).rev().fold(0, |k, i| k * nl + lat.level(e, i));
                assert_eq!(lat.at[k] as usize, e, "{t}");
            }
            // A point's list holds exactly the entries within the radius and step.
            let k = lat.at.iter().position(|&e| e == OFF).unwrap();
            let mut r = k;
            let p: Vec<usize> = (0..lat.dim)
                .map(|_| {
                    let d = r % nl;
                    r /= nl;
                    d
                })
                .collect();
            let within: Vec<u16> = (0..lat.len())
                .filter(|&e| {
                    let steps = (0..lat.dim).map(|i| lat.level(e, i).abs_diff(p[i]));
                    steps.clone().filter(|&d| d > 0).count() <= lat.radius
                        && steps.max() <= Some(lat.max_step)
                })
                .map(|e| e as u16)
                .collect();
            assert_eq!(
                lat.near[lat.start[k] as usize..lat.start[k + 1] as usize],
                within[..],
                "{t}"
            );
        }
    }
}
