//! Krafla's quantizer for GGUF's codebook types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S,
//! IQ1_M): the bytes [`super::codebook`] decodes.
//!
//! Every type stores `w = dw_j·v`, `v` a grid entry (with signs) per group of 8 weights
//! (4 for IQ3_*), `dw_j = d·k·(ls_j + 0.5)` per sub-block `j` of 16 or 32 weights,
//! `ls_j` in `0..=nmax`, `d` an f16. A block minimizes `Σ w_i (x_i − dw·v_i)²` (the
//! element weights of [`super::fit`]) in five steps:
//!
//! 1. **Signs** (IQ1_M has none: its grid is signed): from the weights. Where the stored
//!    pattern must have even parity (IQ2_XXS, IQ2_XS, IQ3_XXS: KSIGNS' 7 bits + parity),
//!    an odd pattern flips the sign of its element with the smallest `w·|x|`, whose target
//!    becomes `−|x|`.
//! 2. **Best entries at a scale** `s`: per group, the entry of least `Σ w (t − s·v)²`
//!    (`t` the signed target), found by [`super::codebook_search`] as the grid point
//!    nearest `t/s` under the weights: lattice rounding, a short neighbour list, and a
//!    pruned scan only when the list's answer is not certified. Exact (the exhaustive
//!    scan's minimum, up to f32 rounding at near-ties), without scoring every entry.
//!    Its sums `A = Σ w t v`, `B = Σ w v²` feed the scale fits. IQ1_M's entry `e` with
//!    shift `±1` is `v = 8g ± 1`: one search per shift.
//! 3. **Sub-block scales**: a few starting scales (the largest `|x|` mapped near the
//!    grid's largest level), each with its best entries and the least-squares scale
//!    `ΣA/ΣB` for them; the largest `(ΣA)²/ΣB` wins, then one more assignment at that
//!    scale.
//! 4. **Super-block**: `d` (f16) and the codes `ls_j` by a weighted least-squares fit of
//!    the sub-block scales (weights `ΣB`: the error of a scale change), as the K types.
//! 5. **Re-assignment**: per sub-block, the codes next to the chosen one, each with its
//!    entries re-chosen under the stored `dw`; the smallest error is kept.
//!
//! Error feedback runs step 5's entry choice once more, 8 weights at a time on values
//! its compensation has moved ([`Regroup`]).
//!
//! All of it is f32 in a fixed order per block: a pure function of the block's values
//! and weights, the same at any thread count.

use super::codebook::max_level;
use super::codebook_search::lattice;
use super::kquants::{fit_scale_codes, put_f16};
use crate::format::wtype::{WType, QK_K};

/// How a type stores its signs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Signs {
    /// A KSIGNS index: 7 free bits per 8 weights, the 8th their parity.
    Parity,
    /// 8 free bits per 8 weights.
    Free,
    /// None: the grid is signed (IQ1_M).
    InGrid,
}

/// The shape of a codebook type's block.
struct Spec {
    /// Weights per grid entry (8, or 4 for IQ3_*).
    group: usize,
    /// Weights per scale code.
    sub: usize,
    /// `dw = d·k·(ls + 0.5)`.
    k: f32,
    /// Largest scale code.
    nmax: u8,
    signs: Signs,
    /// Starting scales tried per sub-block (fewer for the large grids, from when each cost
    /// a scan of the grid; kept, so the results stayed those of the exhaustive scan).
    starts: usize,
}

fn spec(t: WType) -> Spec {
    let (group, sub, k, nmax, signs, starts) = match t {
        WType::IQ2_XXS => (8, 32, 0.25, 15, Signs::Parity, 7),
        WType::IQ2_XS => (8, 16, 0.25, 15, Signs::Parity, 5),
        WType::IQ2_S => (8, 16, 0.25, 15, Signs::Free, 5),
        WType::IQ3_XXS => (4, 32, 0.5, 15, Signs::Parity, 7),
        WType::IQ3_S => (4, 32, 2.0, 15, Signs::Free, 7),
        WType::IQ1_M => (8, 16, 0.25, 7, Signs::InGrid, 3),
        t => panic!("{t} is not a codebook type"),
    };
    Spec {
        group,
        sub,
        k,
        nmax,
        signs,
        starts,
    }
}

/// IQ1_M's values `8g ± 1` of its grid levels `g` (−1, 0, 1): shift +1, then −1.
const IQ1M_VALUES: [[f32; 3]; 2] = [[-7.0, 1.0, 9.0], [-9.0, -1.0, 7.0]];

/// The best candidate of one group (targets `tg`, weights `w`) at scale `s`: the grid
/// entry (IQ1_M: entry `e` with shift +1 is `2e`, with −1 `2e + 1`) of least
/// `Σ w (t − s·v)²`, by [`super::codebook_search::Lattice::nearest`] on `u = t/s` (the same minimizer, exact:
/// see `codebook_search`), and its sums `(Σ w t v, Σ w v²)`.
fn best_at(t: WType, s: f32, tg: &[f32], w: &[f32]) -> (u16, f32, f32) {
    let lat = lattice(t);
    let mut u = [0f32; 8];
    if s > 0.0 {
        // A scale far below the targets (never chosen) must not overflow the costs.
        for (o, &x) in u.iter_mut().zip(tg) {
            *o = (x / s).clamp(-1e4, 1e4);
        }
    }
    let u = &u[..tg.len()];
    let (cand, vals) = if t == WType::IQ1_M {
        let [plus, minus] = &IQ1M_VALUES;
        let p = lat.nearest(plus, u, w, f32::INFINITY).map(|f| f.0);
        let beat = p.map_or(f32::INFINITY, |f| f.cost);
        match (lat.nearest(minus, u, w, beat), p) {
            (Some((m, _)), _) => (2 * m.entry + 1, &minus[..]),
            (None, p) => (2 * p.map_or(0, |f| f.entry), &plus[..]),
        }
    } else {
        let e = lat.nearest(&lat.levels, u, w, f32::INFINITY);
        (e.map_or(0, |f| f.0.entry), &lat.levels[..])
    };
    let e = if t == WType::IQ1_M { cand / 2 } else { cand };
    let (mut sa, mut sb) = (0f32, 0f32);
    for (i, (&ti, &wi)) in tg.iter().zip(w).enumerate() {
        let v = vals[lat.level(e, i)];
        sa += wi * ti * v;
        sb += wi * v * v;
    }
    (cand as u16, sa, sb)
}

/// A scale code whose value is `c + 0.5` ([`fit_scale_codes`]' code type).
#[derive(Clone, Copy, Default)]
struct HalfCode(u8);

impl From<HalfCode> for f32 {
    fn from(c: HalfCode) -> f32 {
        c.0 as f32 + 0.5
    }
}

/// `d` (f16 value) and the codes `0..=nmax` of the sub-block scales `s` (already over
/// `k`) with error weights `ws`; unused sub-blocks have weight 0.
fn super_scale(s: &[f32; 16], ws: &[f32; 16], nmax: u8) -> (f32, [u8; 16]) {
    let smax = s.iter().fold(0.0f32, |m, &v| m.max(v));
    if smax <= 0.0 {
        return (0.0, [0; 16]);
    }
    let top = nmax as f32;
    let codes = |d: f32| -> [HalfCode; 16] {
        let mut c = [HalfCode(0); 16];
        if d > 0.0 {
            for (o, &v) in c.iter_mut().zip(s) {
                *o = HalfCode((v / d - 0.5).round().clamp(0.0, top) as u8);
            }
        }
        c
    };
    let starts = (0..8).map(|k| smax / (top + 0.5 - 0.5 * k as f32));
    let (d, c) = fit_scale_codes(s, ws, starts, codes);
    (d, c.map(|c| c.0))
}

/// Step 1 for 8 weights `x` (element weights `w`): their sign bits (0 for IQ1_M, whose
/// grid is signed) and into `ts` the targets the grid entries approximate.
fn signs8(signs: Signs, x: &[f32], w: &[f32], ts: &mut [f32]) -> u8 {
    if signs == Signs::InGrid {
        ts.copy_from_slice(x);
        return 0;
    }
    let mut m = 0u8;
    for (i, (&v, o)) in x.iter().zip(ts.iter_mut()).enumerate() {
        *o = v.abs();
        m |= ((v < 0.0) as u8) << i;
    }
    if signs == Signs::Parity && m.count_ones() % 2 == 1 {
        let mut cheap = 0;
        for i in 1..8 {
            if w[i] * ts[i] < w[cheap] * ts[cheap] {
                cheap = i;
            }
        }
        m ^= 1 << cheap;
        ts[cheap] = -ts[cheap];
    }
    m
}

/// Quantizes one block of codebook type `t` (256 values `x`, element weights `w`) into
/// `out` ([`WType::block_bytes`] bytes). `Err(v)` when the super-scale `v` does not fit
/// in an f16.
pub fn quantize_block(t: WType, x: &[f32], w: &[f32], out: &mut [u8]) -> Result<(), f32> {
    debug_assert_eq!(x.len(), QK_K);
    let sp = spec(t);
    // Targets (the magnitudes the grid approximates) and the sign bits of each 8.
    let mut tg = [0f32; QK_K];
    let mut sgn = [0u8; QK_K / 8];
    for (k, m) in sgn.iter_mut().enumerate() {
        let r = 8 * k..8 * k + 8;
        *m = signs8(sp.signs, &x[r.clone()], &w[r.clone()], &mut tg[r]);
    }
    let gps = sp.sub / sp.group;
    let nsub = QK_K / sp.sub;
    let mut idx = [0u16; QK_K / 4];
    let mut tmp = [0u16; 8];
    let (mut s, mut ws) = ([0f32; 16], [0f32; 16]);
    // Assigns sub-block j's groups at scale `sc` into `into`; returns (ΣA, ΣB).
    let assign = |j: usize, sc: f32, into: &mut [u16]| -> (f32, f32) {
        let (mut sa, mut sb) = (0f32, 0f32);
        for (q, o) in into.iter_mut().enumerate().take(gps) {
            let r = (j * gps + q) * sp.group..(j * gps + q + 1) * sp.group;
            let (e, a, b) = best_at(t, sc, &tg[r.clone()], &w[r]);
            *o = e;
            sa += a;
            sb += b;
        }
        (sa, sb)
    };
    let gmax = max_level(t) as f32;
    for j in 0..nsub {
        let amax = x[j * sp.sub..(j + 1) * sp.sub]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let mut best = (0f32, 0f32, 0f32);
        let tries = (0..sp.starts).map(|i| {
            let r = 0.6 + 0.6 * i as f32 / (sp.starts - 1) as f32;
            amax / (gmax * r)
        });
        for sc in tries {
            let (sa, sb) = assign(j, sc, &mut tmp);
            if sa > 0.0 && sb > 0.0 && sa * sa / sb > best.0 {
                best = (sa * sa / sb, sa / sb, sb);
            }
        }
        if best.1 > 0.0 {
            let (sa, sb) = assign(j, best.1, &mut tmp);
            if sa > 0.0 && sb > 0.0 && sa * sa / sb >= best.0 {
                best = (sa * sa / sb, sa / sb, sb);
            }
        }
        (s[j], ws[j]) = (best.1 / sp.k, best.2);
    }
    let smax = s.iter().fold(0f32, |m, &v| m.max(v));
    let top = smax / (sp.nmax as f32 + 0.5);
    if !half::f16::from_f32(top).to_f32().is_finite() {
        return Err(top);
    }
    let (d, mut codes) = super_scale(&s, &ws, sp.nmax);
    for j in 0..nsub {
        let c0 = codes[j] as i32;
        let mut best = f32::INFINITY;
        for c in (c0 - 1).max(0)..=(c0 + 1).min(sp.nmax as i32) {
            let dw = d * sp.k * (c as f32 + 0.5);
            let (sa, sb) = assign(j, dw, &mut tmp);
            let err = dw * dw * sb - 2.0 * dw * sa;
            if err < best {
                best = err;
                codes[j] = c as u8;
                idx[j * gps..(j + 1) * gps].copy_from_slice(&tmp[..gps]);
            }
        }
    }
    out[..t.block_bytes()].fill(0);
    pack(t, d, &codes, &idx, &sgn, out);
    Ok(())
}

/// A block of codebook type `t` whose entries are chosen again, 8 weights at a time in
/// column order, under the scales it stores: GPTQ's rounding inside the block. Error
/// feedback (`super::feedback`) drives it: before each 8 it hands over their values with
/// the errors of the weights before them compensated. The block search rounds every
/// group against the values as they came in; this is what it misses.
pub struct Regroup {
    t: WType,
    signs: Signs,
    /// Weights per grid entry.
    group: usize,
    d: f32,
    codes: [u8; 16],
    /// The stored scale of each 16 weights (what the decoder multiplies by).
    dw: [f32; QK_K / 16],
    idx: [u16; QK_K / 4],
    sgn: [u8; QK_K / 8],
}

impl Regroup {
    /// Takes the scales of block `b` (of type `t`); its entries and signs are chosen
    /// again by [`Regroup::round8`].
    pub fn new(t: WType, b: &[u8]) -> Regroup {
        let sp = spec(t);
        let (d, codes) = super::codebook::scale_codes(t, b);
        Regroup {
            t,
            signs: sp.signs,
            group: sp.group,
            d,
            codes,
            dw: super::codebook::dw_of(t, (d, codes)),
            idx: [0; QK_K / 4],
            sgn: [0; QK_K / 8],
        }
    }

    /// Chooses the signs and grid entries of weights `8k..8k + 8` for their values `x`
    /// (element weights `w`) at the stored scale, as step 5 does, and writes into `deq`
    /// what they will dequantize to.
    pub fn round8(&mut self, k: usize, x: &[f32], w: &[f32], deq: &mut [f32]) {
        let t = self.t;
        let mut tg = [0f32; 8];
        let m = signs8(self.signs, x, w, &mut tg);
        self.sgn[k] = m;
        let dw = self.dw[k / 2];
        let lat = lattice(t);
        let g = self.group;
        for q in 0..8 / g {
            let r = q * g..(q + 1) * g;
            let (cand, _, _) = best_at(t, dw, &tg[r.clone()], &w[r.clone()]);
            self.idx[k * 8 / g + q] = cand;
            let (e, vals) = if t == WType::IQ1_M {
                (cand as usize / 2, &IQ1M_VALUES[cand as usize % 2][..])
            } else {
                (cand as usize, &lat.levels[..])
            };
            for i in r {
                let v = vals[lat.level(e, i - q * g)];
                // The decoder's product: its scale times the signed integer level.
                deq[i] = dw * if m >> i & 1 != 0 { -v } else { v };
            }
        }
    }

    /// Writes the block: the scales it came with, the entries and signs chosen.
    pub fn pack(&self, out: &mut [u8]) {
        out[..self.t.block_bytes()].fill(0);
        pack(self.t, self.d, &self.codes, &self.idx, &self.sgn, out);
    }
}

/// Writes one block of `t`: super-scale `d`, scale codes, candidate indices per group,
/// sign bytes per 8 weights.
fn pack(t: WType, d: f32, codes: &[u8; 16], idx: &[u16; 64], sgn: &[u8; 32], b: &mut [u8]) {
    // KSIGNS index of a parity-even sign byte: its low 7 bits.
    let ks = |k: usize| (sgn[k] & 127) as u32;
    match t {
        WType::IQ2_XXS | WType::IQ3_XXS => {
            put_f16(b, 0, d);
            let per = if t == WType::IQ2_XXS { 4 } else { 8 };
            for j in 0..8 {
                for i in 0..per {
                    b[2 + 8 * j + i] = idx[per * j + i] as u8;
                }
                let aux = (0..4).fold((codes[j] as u32) << 28, |acc, l| {
                    acc | ks(4 * j + l) << (7 * l)
                });
                let at = if t == WType::IQ2_XXS {
                    2 + 8 * j + 4
                } else {
                    66 + 4 * j
                };
                b[at..at + 4].copy_from_slice(&aux.to_le_bytes());
            }
        }
        WType::IQ2_XS => {
            put_f16(b, 0, d);
            for k in 0..32 {
                let q = idx[k] | (ks(k) as u16) << 9;
                b[2 + 2 * k..4 + 2 * k].copy_from_slice(&q.to_le_bytes());
            }
            for h in 0..16 {
                b[66 + h / 2] |= codes[h] << (4 * (h % 2));
            }
        }
        WType::IQ2_S => {
            put_f16(b, 0, d);
            for k in 0..32 {
                b[2 + k] = idx[k] as u8;
                b[34 + k] = sgn[k];
                b[66 + k / 4] |= ((idx[k] >> 8) as u8 & 3) << (2 * (k % 4));
            }
            for h in 0..16 {
                b[74 + h / 2] |= codes[h] << (4 * (h % 2));
            }
        }
        WType::IQ3_S => {
            put_f16(b, 0, d);
            for i in 0..64 {
                b[2 + i] = idx[i] as u8;
                b[66 + i / 8] |= ((idx[i] >> 8) as u8 & 1) << (i % 8);
            }
            b[74..106].copy_from_slice(sgn);
            for j in 0..8 {
                b[106 + j / 2] |= codes[j] << (4 * (j % 2));
            }
        }
        WType::IQ1_M => {
            for k in 0..32 {
                // Candidate 2e + 1 is entry e with shift −1 (bit 3 of the qh nibble).
                let (e, neg) = (idx[k] as usize / 2, idx[k] as usize % 2);
                b[k] = e as u8;
                b[32 + k / 2] |= (((e >> 8) & 7) as u8 | (neg as u8) << 3) << (4 * (k % 2));
            }
            let dbits = half::f16::from_f32(d).to_bits();
            for m in 0..4 {
                let word = (0..4).fold((dbits >> (4 * m) & 15) << 12, |acc, h| {
                    acc | (codes[4 * m + h] as u16 & 7) << (3 * h)
                });
                b[48 + 2 * m..50 + 2 * m].copy_from_slice(&word.to_le_bytes());
            }
        }
        t => panic!("{t} is not a codebook type"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Row by row through this module's own block quantizer (what quant::blocks does,
    // which imports this module: its matrix functions are not used here).
    fn quantize_matrix(
        t: WType,
        rows: usize,
        cols: usize,
        x: &[f32],
        imp: Option<&[f32]>,
    ) -> Result<Vec<u8>, f32> {
        let (bw, bb) = (t.block_weights(), t.block_bytes());
        let mut q = vec![0u8; rows * cols / bw * bb];
        let mut w = Vec::new();
        for (xr, qr) in x.chunks_exact(cols).zip(q.chunks_exact_mut(cols / bw * bb)) {
            crate::quant::fit::row_weights(xr, imp, &mut w);
            for ((xb, wb), ob) in xr
                .chunks_exact(bw)
                .zip(w.chunks_exact(bw))
                .zip(qr.chunks_exact_mut(bb))
            {
                quantize_block(t, xb, wb, ob)?;
            }
        }
        Ok(q)
    }

    fn dequantize_matrix(t: WType, rows: usize, cols: usize, q: &[u8]) -> Vec<f32> {
        let (bw, bb) = (t.block_weights(), t.block_bytes());
        let mut out = vec![0f32; rows * cols];
        for (o, b) in out.chunks_exact_mut(bw).zip(q.chunks_exact(bb)) {
            crate::quant::codebook::dequant_block(t, b, o);
        }
        out
    }
    use crate::quant::codebook::decode;
    use crate::quant::codebook_search::STEPS;
    use crate::rng::{rel_rms, Rng};

    /// Relative RMS error on Gaussian rows, in order of the types' bits per weight, each
    /// within a bound a little above what this quantizer measured (0.424 IQ1_M, 0.338
    /// IQ2_XXS, 0.290 IQ2_XS, 0.242 IQ2_S, 0.180 IQ3_XXS, 0.133 IQ3_S).
    #[test]
    fn error_falls_with_the_bits() {
        let (rows, cols) = (8, 1024);
        let x = Rng(0x6a09e667f3bcc908).gaussian(rows * cols);
        let order = [
            (WType::IQ1_M, 0.45),
            (WType::IQ2_XXS, 0.36),
            (WType::IQ2_XS, 0.31),
            (WType::IQ2_S, 0.26),
            (WType::IQ3_XXS, 0.20),
            (WType::IQ3_S, 0.15),
        ];
        let mut last = f64::INFINITY;
        for (t, bound) in order {
            STEPS.with(|s| s.set(0));
            let q = quantize_matrix(t, rows, cols, &x, None).unwrap();
            let steps = STEPS.with(|s| s.get());
            let e = rel_rms(&x, &dequantize_matrix(t, rows, cols, &q));
            let [on, list, scan] = [0, 21, 42].map(|b| steps >> b & ((1 << 21) - 1));
            eprintln!(
                "{t}: relative RMS error {e:.4} ({} bytes per 256); searches on grid {on}, \
                 list {list}, pruned scan {scan}",
                t.block_bytes()
            );
            assert!(
                e < bound && e < last,
                "{t}: {e} (bound {bound}, previous {last})"
            );
            last = e;
        }
    }

    /// Regrouping a block on the values it was made from, with their weights, chooses
    /// what step 5 chose: the same bytes. On other values it keeps the scales, and
    /// `deq` is what the written block decodes to, bit for bit.
    #[test]
    fn regroup_keeps_the_scales_and_predicts_the_decode() {
        let x = Rng(0x3c6ef372fe94f82b).gaussian(2 * QK_K);
        let (xa, xb) = x.split_at(QK_K);
        let mut w = Vec::new();
        crate::quant::fit::row_weights(xa, None, &mut w);
        for &t in WType::CODEBOOKS {
            let mut b = vec![0u8; t.block_bytes()];
            quantize_block(t, xa, &w, &mut b).unwrap();
            let mut deq = [0f32; QK_K];
            for (xs, label) in [(xa, "own values"), (xb, "other values")] {
                let mut r = Regroup::new(t, &b);
                for k in 0..QK_K / 8 {
                    let at = 8 * k..8 * k + 8;
                    r.round8(k, &xs[at.clone()], &w[at.clone()], &mut deq[at]);
                }
                let mut out = vec![0xffu8; t.block_bytes()];
                r.pack(&mut out);
                if xs == xa {
                    assert_eq!(out, b, "{t}: {label}");
                }
                assert_eq!(
                    crate::quant::codebook::scales(t, &out),
                    crate::quant::codebook::scales(t, &b),
                    "{t}: {label}"
                );
                let mut dec = [0f32; QK_K];
                crate::quant::codebook::dequant_block(t, &out, &mut dec);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&deq), bits(&dec), "{t}: {label}");
            }
        }
    }

    /// Every block decodes with levels in range, and its signs are the weights' signs
    /// but for at most one per 8 on the even-parity types (none on the free ones).
    #[test]
    fn blocks_decode_with_the_weights_signs() {
        let (rows, cols) = (4, 512);
        let x = Rng(0xbb67ae8584caa73b).gaussian(rows * cols);
        for &t in WType::CODEBOOKS {
            let q = quantize_matrix(t, rows, cols, &x, None).unwrap();
            for (b, blk) in q.chunks_exact(t.block_bytes()).enumerate() {
                let dec = decode(t, blk);
                let xb = &x[256 * b..256 * (b + 1)];
                assert!(
                    dec.dw.iter().all(|d| d.is_finite() && *d > 0.0),
                    "{t} block {b}"
                );
                for k in 0..32 {
                    let v = &dec.v[8 * k..8 * k + 8];
                    assert!(v.iter().all(|&l| (l as i32).abs() <= max_level(t)));
                    let wrong = (0..8)
                        .filter(|&i| (v[i] < 0) != (xb[8 * k + i] < 0.0))
                        .count();
                    match spec(t).signs {
                        Signs::Parity => assert!(wrong <= 1, "{t} block {b} group {k}"),
                        Signs::Free => assert_eq!(wrong, 0, "{t} block {b} group {k}"),
                        Signs::InGrid => {}
                    }
                }
            }
        }
    }

    #[test]
    fn zero_rows_and_huge_scales() {
        let x = vec![0f32; 2 * 256];
        for &t in WType::CODEBOOKS {
            let q = quantize_matrix(t, 2, 256, &x, None).unwrap();
            assert!(
                dequantize_matrix(t, 2, 256, &q).iter().all(|&v| v == 0.0),
                "{t}"
            );
            let mut y = x.clone();
            y[3] = 1e9;
            assert!(quantize_matrix(t, 2, 256, &y, None).is_err(), "{t}");
        }
    }
}
