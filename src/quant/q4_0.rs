//! Q4_0 weight quantization: the least-squares search, llama.cpp's round rule and
//! imatrix weighting.
//!
//! Levels are 4-bit nibbles n in 0..=15 standing for n − 8; byte j of a 16-byte block
//! holds element j in its low nibble and element j + 16 in its high nibble.
//!
//! The search maps the block's largest-magnitude element m to each level L in
//! −6.0, −6.2, …, −8.4 (13 candidates): id = L / m, l_i = clamp(round(x_i · id), −8, 7)
//! with round half away from zero, then d = Σ w l x / Σ w l² (weighted least squares)
//! and err = Σ w (x − d l)²; the first candidate with the smallest error wins. Weights
//! are w = x² by default, or imp × sqrt(s² + x²) with an importance matrix (s² the
//! row's mean square). Blocks with max |x| < 1e-6 are divided by it before fitting
//! and d multiplied back, so the float32 squares and cubes do not underflow.

use crate::format::wtype::QK;

/// Candidate levels for the block's largest-magnitude element.
const N_CANDIDATES: usize = 13;
/// Below this block maximum, values are scaled to max 1 before the fit.
const TINY: f32 = 1e-6;

/// The element of largest magnitude (the first one among equals).
fn signed_max(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut m = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            m = v;
        }
    }
    m
}

/// The level of element `j` (0..32) of a 16-byte block: `nibble − 8`.
#[inline(always)]
pub fn level(q: &[u8], j: usize) -> i32 {
    let byte = q[j % (QK / 2)];
    let nib = if j < QK / 2 { byte & 0x0F } else { byte >> 4 };
    nib as i32 - 8
}

/// Dequantizes one 16-byte block: `out[j] = level(j) · d`, one f32 multiply.
#[inline]
pub fn dequant_block(q: &[u8], d: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = level(q, j) as f32 * d;
    }
}

fn pack(levels: &[u8; QK], q: &mut [u8]) {
    for j in 0..QK / 2 {
        q[j] = levels[j] | (levels[j + QK / 2] << 4);
    }
}

/// llama.cpp's rule: d = m / −8, nibble = min(trunc(x · (1/d) + 8.5), 15). Returns d.
pub fn quantize_block_round(x: &[f32], q: &mut [u8]) -> f32 {
    debug_assert_eq!(x.len(), QK);
    let d = signed_max(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut levels = [0u8; QK];
    for (l, &v) in levels.iter_mut().zip(x) {
        // x · id lies in [−8, 8], so the sum is positive and the cast truncates.
        *l = ((v * id + 8.5) as u8).min(15);
    }
    pack(&levels, q);
    d
}

/// Per-element weights of one row for the search.
pub struct RowWeights<'a> {
    x: &'a [f32],
    /// imatrix importance per column and the row's mean square, when weighting by it.
    imatrix: Option<(&'a [f32], f32)>,
}

impl<'a> RowWeights<'a> {
    pub fn new(x: &'a [f32], imatrix: Option<&'a [f32]>) -> Self {
        let imatrix = imatrix.map(|imp| {
            let s2 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
            (imp, s2)
        });
        RowWeights { x, imatrix }
    }

    /// imatrix weights of block `b`, or `None` for the default x² weights.
    pub fn block(&self, b: usize) -> Option<[f32; QK]> {
        let (imp, s2) = self.imatrix?;
        let xb = &self.x[b * QK..(b + 1) * QK];
        let ib = &imp[b * QK..(b + 1) * QK];
        let mut w = [0f32; QK];
        for ((o, &v), &i) in w.iter_mut().zip(xb).zip(ib) {
            *o = i * (s2 + v * v).sqrt();
        }
        Some(w)
    }
}

/// The weighted least-squares search. `w` are imatrix element weights, or `None` for
/// x². Returns d.
pub fn quantize_block_search(x: &[f32], w: Option<&[f32; QK]>, q: &mut [u8]) -> f32 {
    debug_assert_eq!(x.len(), QK);
    let m = signed_max(x);
    if m == 0.0 {
        pack(&[8; QK], q);
        return 0.0;
    }
    // Tiny blocks: fit x / |m| (max magnitude 1) and scale d back.
    let back = if m.abs() < TINY { m.abs() } else { 1.0 };
    let mut xs = [0f32; QK];
    for (o, &v) in xs.iter_mut().zip(x) {
        *o = if back != 1.0 { v / back } else { v };
    }
    // x² weights come from the (scaled) values; imatrix weights are a per-block
    // factor away from any scaling, which moves neither d nor the argmin.
    let ww = match w {
        Some(w) => *w,
        None => xs.map(|v| v * v),
    };
    let ms = signed_max(&xs);
    let mut best_err = f32::INFINITY;
    let mut best_d = 0.0f32;
    let mut best = [0i8; QK];
    for k in 0..N_CANDIDATES {
        let level = -6.0f32 - 0.2f32 * k as f32;
        let id = level / ms;
        let mut l = [0i8; QK];
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for i in 0..QK {
            let li = (xs[i] * id).round().clamp(-8.0, 7.0);
            l[i] = li as i8;
            sumlx += ww[i] * xs[i] * li;
            suml2 += ww[i] * li * li;
        }
        if suml2 <= 0.0 {
            continue;
        }
        let d = sumlx / suml2;
        let mut err = 0.0f32;
        for i in 0..QK {
            let e = xs[i] - d * l[i] as f32;
            err += ww[i] * e * e;
        }
        if err < best_err {
            best_err = err;
            best_d = d;
            best = l;
        }
    }
    if !best_err.is_finite() {
        // Every weight was zero (only possible with a zero imatrix): fall back to the
        // plain mapping of m to −8.
        return quantize_block_round(x, q);
    }
    let mut levels = [0u8; QK];
    for (o, &l) in levels.iter_mut().zip(&best) {
        *o = (l + 8) as u8;
    }
    pack(&levels, q);
    best_d * back
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unpack(q: &[u8]) -> [i32; QK] {
        std::array::from_fn(|j| level(q, j))
    }

    #[test]
    fn nibble_layout() {
        let mut w = [0u8; 16];
        w[0] = 0xF0; // element 0 = 0 → -8, element 16 = 15 → 7
        w[3] = 0x29; // element 3 = 9 → 1, element 19 = 2 → -6
        assert_eq!(level(&w, 0), -8);
        assert_eq!(level(&w, 16), 7);
        assert_eq!(level(&w, 3), 1);
        assert_eq!(level(&w, 19), -6);
        assert_eq!(level(&w, 1), -8);
        let mut out = [0f32; QK];
        dequant_block(&w, 0.5, &mut out);
        assert_eq!((out[0], out[16], out[3], out[19]), (-4.0, 3.5, 0.5, -3.0));
    }

    fn block(seed: u32) -> [f32; QK] {
        let mut s = seed;
        let mut x = [0f32; QK];
        for v in x.iter_mut() {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            *v = (s as f32 / u32::MAX as f32) * 2.0 - 1.0;
        }
        x
    }

    #[test]
    fn round_rule_matches_llama_cpp() {
        let mut x = [0f32; QK];
        x[0] = -2.0; // m = -2 → d = 0.25, id = 4
        x[1] = 1.0; // 4 + 8.5 = 12.5 → 12
        x[2] = 2.0; // 8 + 8.5 → 16 → clamped to 15
        x[16] = -0.3; // -1.2 + 8.5 = 7.3 → 7
        let mut q = [0u8; 16];
        let d = quantize_block_round(&x, &mut q);
        assert_eq!(d, 0.25);
        let l = unpack(&q);
        assert_eq!(l[0], -8);
        assert_eq!(l[1], 4);
        assert_eq!(l[2], 7);
        assert_eq!(l[16], -1);
        assert_eq!(l[3], 0);
    }

    #[test]
    fn search_is_no_worse_than_round() {
        for seed in 1..200u32 {
            let x = block(seed * 7919);
            let mut w = [0f32; QK];
            for (o, v) in w.iter_mut().zip(&x) {
                *o = v * v;
            }
            let (mut qs, mut qr) = ([0u8; 16], [0u8; 16]);
            let ds = quantize_block_search(&x, None, &mut qs);
            let dr = quantize_block_round(&x, &mut qr);
            let err = |q: &[u8], d: f32| {
                let l = unpack(q);
                (0..QK)
                    .map(|i| w[i] * (x[i] - d * l[i] as f32).powi(2))
                    .sum::<f32>()
            };
            assert!(err(&qs, ds) <= err(&qr, dr) * 1.0001, "seed {seed}");
        }
    }

    #[test]
    fn search_maps_max_to_a_candidate_level() {
        let x = block(42);
        let mut q = [0u8; 16];
        let d = quantize_block_search(&x, None, &mut q);
        let l = unpack(&q);
        let (im, _) =
            x.iter().enumerate().fold(
                (0, 0f32),
                |a, (i, v)| if v.abs() > a.1 { (i, v.abs()) } else { a },
            );
        // The max element lands on level -6..-8 (the sign of d carries its sign).
        assert!((-8..=-6).contains(&l[im]), "level {}", l[im]);
        assert!(d * x[im] < 0.0);
    }

    #[test]
    fn tiny_block_scales_back() {
        let x = block(3);
        let mut tiny = [0f32; QK];
        for (o, v) in tiny.iter_mut().zip(&x) {
            *o = v * 1e-8;
        }
        let (mut qa, mut qb) = ([0u8; 16], [0u8; 16]);
        let da = quantize_block_search(&x, None, &mut qa);
        let db = quantize_block_search(&tiny, None, &mut qb);
        assert_eq!(qa, qb);
        let rel = ((db / 1e-8) - da).abs() / da.abs();
        assert!(rel < 1e-5, "{da} {db}");
    }

    #[test]
    fn zero_block() {
        let mut q = [0u8; 16];
        assert_eq!(quantize_block_search(&[0.0; QK], None, &mut q), 0.0);
        assert!(q.iter().all(|&b| b == 0x88));
        assert_eq!(quantize_block_round(&[0.0; QK], &mut q), 0.0);
        assert!(q.iter().all(|&b| b == 0x88));
    }
}
