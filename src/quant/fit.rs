//! Weighted least-squares fits shared by the GGUF block quantizers ([`super::kquants`],
//! [`super::blocks32`]).
//!
//! Every quantizer minimizes the weighted squared error `Σ w_i (x_i − x̂_i)²` of a
//! block, where `x̂` is what the stored bits dequantize to. The element weights are
//!
//! ```text
//! w_i = imp_c · sqrt(s² + x_i²)
//! ```
//!
//! with `imp_c` the importance of the element's input channel (the imatrix, normalized
//! to mean 1 and floored at 0.001 by the caller; 1 without one) and `s²` the row's mean
//! square: the output error of `W·a` is `Σ_c Δ_c² E[a_c²]` when the inputs are
//! uncorrelated, which is what `imp` estimates; `sqrt(s² + x²)` leans towards the large
//! weights, which carry the outlier features (llama.cpp's weighting, also used by the
//! Q4_0 search with an imatrix). Q2_K takes `(s² + x²)^¼` instead ([`magnitude`]).
//!
//! Two fits, each a search over candidate scales followed by a weighted least-squares
//! solve for the levels it produced:
//!
//! * [`fit_symmetric`]: `x ≈ d·v[l]` for a level set `v` (uniform integers or a table);
//! * [`fit_affine`]: `x ≈ d·l + mn` with `l` in `0..=nmax` (optionally `mn ≤ 0`).
//!
//! Everything is f32 arithmetic in element order, so a block's result is a pure
//! function of its values and weights (the same on every thread and machine).

use crate::format::wtype::WType;

/// Fills `w` with the weights of row `x`: `imp_c · sqrt(s² + x_c²)`, `imp = 1` without
/// an imatrix. A row whose weights are all zero (an all-zero row) gets weight 1
/// everywhere.
pub fn row_weights(x: &[f32], imp: Option<&[f32]>, w: &mut Vec<f32>) {
    row_weights_of(None, x, imp, w)
}

/// [`row_weights`] for a matrix of type `t`: the magnitude factor is [`magnitude`]'s.
pub fn row_weights_for(t: WType, x: &[f32], imp: Option<&[f32]>, w: &mut Vec<f32>) {
    row_weights_of(Some(t), x, imp, w)
}

fn row_weights_of(t: Option<WType>, x: &[f32], imp: Option<&[f32]>, w: &mut Vec<f32>) {
    let s2 = x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    let mag = |v: f32| match t {
        Some(t) => magnitude(t, s2, v),
        None => (s2 + v * v).sqrt(),
    };
    w.clear();
    match imp {
        Some(imp) => w.extend(x.iter().zip(imp).map(|(&v, i)| i * mag(v))),
        None => w.extend(x.iter().map(|&v| mag(v))),
    }
    if w.iter().all(|&v| v == 0.0) {
        w.fill(1.0);
    }
}

/// The magnitude factor of an element's weight in a matrix of type `t` (`s2`: its row's
/// mean square): `sqrt(s² + x²)`, llama.cpp's, for every type but Q2_K, which takes its
/// square root, `(s² + x²)^¼`. Q2_K's four levels cannot follow the large weights
/// anyway, and leaning on them less lowered its output error on held-out text
/// (SmolLM2-135M's down projections, with the imatrix: exponent ½ 0.587%, ¼ 0.574%,
/// 0 0.580%; [`super::lowbit`]).
#[inline]
pub fn magnitude(t: WType, s2: f32, v: f32) -> f32 {
    let m = (s2 + v * v).sqrt();
    if t == WType::Q2_K {
        m.sqrt()
    } else {
        m
    }
}

/// The values a symmetric type's levels stand for.
#[derive(Debug, Clone, Copy)]
pub enum Levels {
    /// The integers `lo..=hi` (index `l` stands for `lo + l`).
    Uniform { lo: i32, hi: i32 },
    /// A sorted table of 16 values (index = nibble).
    Table(&'static [i8; 16]),
}

impl Levels {
    /// Number of levels.
    pub fn len(&self) -> usize {
        match *self {
            Levels::Uniform { lo, hi } => (hi - lo + 1) as usize,
            Levels::Table(t) => t.len(),
        }
    }

    /// Always false (a level set has at least two levels).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The value of level index `l`.
    #[inline(always)]
    pub fn value(&self, l: u8) -> f32 {
        match *self {
            Levels::Uniform { lo, .. } => (lo + l as i32) as f32,
            Levels::Table(t) => t[l as usize] as f32,
        }
    }

    /// Smallest and largest value.
    fn ends(&self) -> (f32, f32) {
        (self.value(0), self.value(self.len() as u8 - 1))
    }

    /// The index of the level nearest to `v` (uniform: round half away from zero,
    /// clamped; table: the lower of two levels at an exact midpoint).
    #[inline(always)]
    pub fn nearest(&self, v: f32) -> u8 {
        match *self {
            Levels::Uniform { lo, hi } => (v.round().clamp(lo as f32, hi as f32) as i32 - lo) as u8,
            Levels::Table(t) => {
                let mut l = 0u8;
                for k in 1..16 {
                    // Midpoints of integers are exact in f32.
                    let mid = (t[k - 1] as f32 + t[k] as f32) * 0.5;
                    l += (v > mid) as u8;
                }
                l
            }
        }
    }
}

/// The element of largest magnitude (the first one among equals), and that magnitude.
pub fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut m, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            m = v;
        }
    }
    (m, amax)
}

/// Weighted error `Σ w (x − d·v[l])²` of a symmetric block.
pub fn err_symmetric(x: &[f32], w: &[f32], lv: &Levels, d: f32, l: &[u8]) -> f32 {
    let mut e = 0.0f32;
    for i in 0..x.len() {
        let r = x[i] - d * lv.value(l[i]);
        e += w[i] * r * r;
    }
    e
}

/// The weighted least-squares scale `d = Σ w x v[l] / Σ w v[l]²` for the levels `l`,
/// with its error `err_symmetric`; `None` when `Σ w v[l]² ≤ 0`.
pub(super) fn solve_symmetric(x: &[f32], w: &[f32], lv: &Levels, l: &[u8]) -> Option<(f32, f32)> {
    let (mut sxv, mut svv) = (0.0f32, 0.0f32);
    for i in 0..x.len() {
        let v = lv.value(l[i]);
        sxv += w[i] * x[i] * v;
        svv += w[i] * v * v;
    }
    if svv <= 0.0 {
        return None;
    }
    let d = sxv / svv;
    Some((d, err_symmetric(x, w, lv, d, l)))
}

/// Levels nearest to `x / d` (all level 0's nearest-to-zero index when `d` is 0).
pub fn assign_symmetric(x: &[f32], lv: &Levels, d: f32, l: &mut [u8]) {
    if d == 0.0 {
        l.fill(lv.nearest(0.0));
        return;
    }
    for (o, &v) in l.iter_mut().zip(x) {
        *o = lv.nearest(v / d);
    }
}

/// Candidate positions of the largest-magnitude element, relative to the extreme
/// level it maps to: 1.04, 1.02, …, 0.82 of it (12 per side).
const SYM_CANDIDATES: usize = 12;

/// Fits `x ≈ d·v[l]`: returns the f32 `d` (not rounded to storage precision) and the
/// levels in `l`.
///
/// The largest-magnitude element `m` is mapped to 1.04, 1.02, …, 0.82 times the lowest
/// level and, as separate candidates, the highest level (`id = t / m`); each candidate's
/// levels are `nearest(x_i · id)`, its `d` the weighted least-squares solution
/// `Σ w x v / Σ w v²`, and the first candidate with the smallest error wins. Two rounds
/// of re-assigning the levels to the winner's `d` and solving again follow, kept only
/// when they lower the error. An all-zero block gives `d = 0`.
pub fn fit_symmetric(x: &[f32], w: &[f32], lv: &Levels, l: &mut [u8]) -> f32 {
    let n = x.len();
    let (m, amax) = signed_max(x);
    if amax == 0.0 {
        l.fill(lv.nearest(0.0));
        return 0.0;
    }
    let (vlo, vhi) = lv.ends();
    // (error, d) of the best candidate so far.
    let mut best = (f32::INFINITY, 0.0f32);
    let mut cand = [0u8; 32];
    let cand = &mut cand[..n];
    for end in [vlo, vhi] {
        for k in 0..SYM_CANDIDATES {
            let t = end * (1.04 - 0.02 * k as f32);
            let id = t / m;
            for (c, &v) in cand.iter_mut().zip(x) {
                *c = lv.nearest(v * id);
            }
            let fit = solve_symmetric(x, w, lv, cand).map(|(d, e)| (e, d));
            keep_if_lower(fit, cand, &mut best, l);
        }
    }
    if !best.0.is_finite() {
        // Every weight is zero where the levels are non-zero: plain max mapping.
        let d = m / vlo;
        assign_symmetric(x, lv, d, l);
        return d;
    }
    for _ in 0..2 {
        assign_symmetric(x, lv, best.1, cand);
        let fit = solve_symmetric(x, w, lv, cand).map(|(d, e)| (e, d));
        if !keep_if_lower(fit, cand, &mut best, l) {
            break;
        }
    }
    best.1
}

/// Keeps the candidate levels `cand` in `l` and their (error, fit) in `best` when a fit
/// was found and its error is below `best`'s (the first of equal errors stays); whether
/// it did.
fn keep_if_lower<F>(fit: Option<(f32, F)>, cand: &[u8], best: &mut (f32, F), l: &mut [u8]) -> bool {
    match fit {
        Some((e, f)) if e < best.0 => {
            *best = (e, f);
            l.copy_from_slice(cand);
            true
        }
        _ => false,
    }
}

/// The f16 values next to `v` (below, nearest, above), as f32; only finite ones.
pub fn f16_neighbours(v: f32) -> impl Iterator<Item = f32> {
    let h = half::f16::from_f32(v);
    let b = h.to_bits();
    let down = if b & 0x7fff == 0 {
        None
    } else {
        Some(half::f16::from_bits(b - 1))
    };
    let up = Some(half::f16::from_bits(b.wrapping_add(1)));
    [down, Some(h), up]
        .into_iter()
        .flatten()
        .map(|h| h.to_f32())
        .filter(|v| v.is_finite())
}

/// [`fit_symmetric`] for a type that stores `d` as f16: tries the f16 values nearest
/// the fitted `d` and next to it, each with the levels re-assigned to it, and returns
/// the one with the smallest weighted error (its levels in `l`). `None` if `d` does not
/// fit in an f16.
pub fn fit_symmetric_f16(x: &[f32], w: &[f32], lv: &Levels, l: &mut [u8]) -> Option<f32> {
    let d = fit_symmetric(x, w, lv, l);
    if !half::f16::from_f32(d).to_f32().is_finite() {
        return None;
    }
    let mut best = (f32::INFINITY, 0.0f32);
    let mut cand = [0u8; 32];
    let cand = &mut cand[..x.len()];
    for d16 in f16_neighbours(d) {
        assign_symmetric(x, lv, d16, cand);
        let e = err_symmetric(x, w, lv, d16, cand);
        if e < best.0 {
            best = (e, d16);
            l.copy_from_slice(cand);
        }
    }
    Some(best.1)
}

/// Weighted error `Σ w (x − (d·l + mn))²` of an affine block.
pub fn err_affine(x: &[f32], w: &[f32], d: f32, mn: f32, l: &[u8]) -> f32 {
    let mut e = 0.0f32;
    for i in 0..x.len() {
        let r = x[i] - (d * l[i] as f32 + mn);
        e += w[i] * r * r;
    }
    e
}

/// Levels nearest to `(x − mn) / d` in `0..=nmax` (all 0 when `d` is 0).
pub fn assign_affine(x: &[f32], nmax: u8, d: f32, mn: f32, l: &mut [u8]) {
    if d == 0.0 {
        l.fill(0);
        return;
    }
    for (o, &v) in l.iter_mut().zip(x) {
        *o = ((v - mn) / d).round().clamp(0.0, nmax as f32) as u8;
    }
}

/// The weighted least-squares `(d, mn)` for fixed levels; with `min_le_zero`, `mn` is
/// held at 0 when the free solution is positive. `None` when the levels do not
/// determine `d` (all equal, or zero weight).
pub(super) fn solve_affine(
    x: &[f32],
    w: &[f32],
    l: &[u8],
    min_le_zero: bool,
) -> Option<(f32, f32)> {
    let (mut sw, mut sl, mut sll, mut sx, mut slx) = (0.0f32, 0.0f32, 0.0f32, 0.0f32, 0.0f32);
    for i in 0..x.len() {
        let li = l[i] as f32;
        sw += w[i];
        sl += w[i] * li;
        sll += w[i] * li * li;
        sx += w[i] * x[i];
        slx += w[i] * li * x[i];
    }
    let det = sw * sll - sl * sl;
    if det <= 0.0 {
        return None;
    }
    let d = (sw * slx - sx * sl) / det;
    let mn = (sll * sx - sl * slx) / det;
    if min_le_zero && mn > 0.0 {
        return (sll > 0.0).then(|| (slx / sll, 0.0));
    }
    Some((d, mn))
}

/// Steps of the affine search: `iscale = (nmax + δ) / (max − min)`, δ = −1, −0.9, …, 1.
const AFF_STEPS: usize = 21;

/// Fits `x ≈ d·l + mn` with `l` in `0..=nmax`: returns `(d, mn)` in f32 (not rounded to
/// storage precision) and the levels in `l`. With `min_le_zero` (the K types, whose
/// minimum is stored as `−dmin·m` with `m ≥ 0`), `mn ≤ 0`.
///
/// The plain mapping of `[min, max]` (min clamped to ≤ 0 with `min_le_zero`) onto
/// `0..=nmax` is the first candidate; then for each δ the levels
/// `round((x − min)·iscale)` and their weighted least-squares `(d, mn)`; the first
/// smallest error wins, and two rounds of re-assigning and solving follow while they
/// lower it. A constant block gives `d = 0, mn = min`.
pub fn fit_affine(x: &[f32], w: &[f32], nmax: u8, min_le_zero: bool, l: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let mut mn0 = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
    let mx = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if min_le_zero {
        mn0 = mn0.min(0.0);
    }
    if mx <= mn0 {
        l.fill(0);
        return (0.0, mn0);
    }
    let range = mx - mn0;
    // (error, (d, mn)) of the best fit so far, first the plain min/max mapping.
    let d0 = range / nmax as f32;
    assign_affine(x, nmax, d0, mn0, l);
    let mut best = (err_affine(x, w, d0, mn0, l), (d0, mn0));
    // The least-squares (d, mn) of levels and its error.
    let affine = |cand: &[u8]| {
        solve_affine(x, w, cand, min_le_zero)
            .map(|(d, mn)| (err_affine(x, w, d, mn, cand), (d, mn)))
    };
    let mut cand = [0u8; 32];
    let cand = &mut cand[..n];
    for k in 0..AFF_STEPS {
        let iscale = (nmax as f32 - 1.0 + 0.1 * k as f32) / range;
        for i in 0..n {
            cand[i] = ((x[i] - mn0) * iscale).round().clamp(0.0, nmax as f32) as u8;
        }
        keep_if_lower(affine(cand), cand, &mut best, l);
    }
    for _ in 0..2 {
        let (d, mn) = best.1;
        assign_affine(x, nmax, d, mn, cand);
        if !keep_if_lower(affine(cand), cand, &mut best, l) {
            break;
        }
    }
    best.1
}

/// [`fit_affine`] for a type that stores `d` and `mn` as f16 (Q4_1, Q5_1): tries the f16
/// values next to both, each pair with the levels re-assigned to it, and returns the
/// pair with the smallest weighted error. `None` if either does not fit in an f16.
pub fn fit_affine_f16(x: &[f32], w: &[f32], nmax: u8, l: &mut [u8]) -> Option<(f32, f32)> {
    let (d, mn) = fit_affine(x, w, nmax, false, l);
    let finite = |v: f32| half::f16::from_f32(v).to_f32().is_finite();
    if !finite(d) || !finite(mn) {
        return None;
    }
    let mut best = (f32::INFINITY, 0.0f32, 0.0f32);
    let mut cand = [0u8; 32];
    let cand = &mut cand[..x.len()];
    for d16 in f16_neighbours(d) {
        for m16 in f16_neighbours(mn) {
            assign_affine(x, nmax, d16, m16, cand);
            let e = err_affine(x, w, d16, m16, cand);
            if e < best.0 {
                best = (e, d16, m16);
                l.copy_from_slice(cand);
            }
        }
    }
    Some((best.1, best.2))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: [i8; 16] = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];

    #[test]
    fn nearest_levels() {
        let u = Levels::Uniform { lo: -16, hi: 15 };
        assert_eq!(u.nearest(-20.0), 0);
        assert_eq!(u.nearest(2.5), 19); // half away from zero: 3 → index 19
        assert_eq!(u.nearest(99.0), 31);
        let t = Levels::Table(&T);
        assert_eq!(t.nearest(-200.0), 0);
        assert_eq!(t.nearest(-4.5), 7); // midpoint of -10 and 1 → lower
        assert_eq!(t.nearest(-4.4), 8);
        assert_eq!(t.nearest(1000.0), 15);
        for (i, &v) in T.iter().enumerate() {
            assert_eq!(t.nearest(v as f32), i as u8);
        }
    }

    #[test]
    fn exact_grid_is_recovered() {
        // x on a grid of 0.5 with levels -16..15: the fit finds d = ±0.5 exactly.
        let lv = Levels::Uniform { lo: -16, hi: 15 };
        let x: Vec<f32> = (0..32).map(|i| ((i * 7) % 32) as f32 * 0.5 - 8.0).collect();
        let w = vec![1.0; 32];
        let mut l = [0u8; 32];
        let d = fit_symmetric(&x, &w, &lv, &mut l);
        assert_eq!(err_symmetric(&x, &w, &lv, d, &l), 0.0);
        assert_eq!(d.abs(), 0.5);
        let mut l = [0u8; 32];
        let (d, mn) = fit_affine(&x, &w, 31, false, &mut l);
        assert_eq!(err_affine(&x, &w, d, mn, &l), 0.0, "{d} {mn}");
    }

    #[test]
    fn min_le_zero_holds() {
        let x: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.1).collect();
        let w = vec![1.0; 32];
        let mut l = [0u8; 32];
        let (d, mn) = fit_affine(&x, &w, 15, true, &mut l);
        assert!(mn <= 0.0 && d > 0.0, "{d} {mn}");
        let (_, mn) = fit_affine(&x, &w, 15, false, &mut l);
        assert!(mn > 0.9, "{mn}");
    }

    #[test]
    fn f16_neighbours_are_adjacent() {
        let v: Vec<f32> = f16_neighbours(1.0).collect();
        assert_eq!(v, [1.0 - 1.0 / 2048.0, 1.0, 1.0 + 1.0 / 1024.0]);
        let v: Vec<f32> = f16_neighbours(0.0).collect();
        assert_eq!(v[0], 0.0);
        assert_eq!(f16_neighbours(65504.0).count(), 2); // above is infinity
    }
}
