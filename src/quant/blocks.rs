//! Matrices of the GGUF block types (the K types of [`super::kquants`], the 32-weight
//! types of [`super::blocks32`], MXFP4 ([`super::mxfp4`]), and Q2_K, Q3_K, IQ4_XS
//! ([`super::lowbit`]), the codebook types of [`super::codebook`], quantized by [`super::codebook_fit`]): one array of `rows × cols / block_weights` blocks,
//! row-major, each block its GGUF bytes with its scales inside (no scale array).
//!
//! Rows are quantized in parallel (rayon), each a pure function of its values and the
//! imatrix, so the bytes do not depend on the thread count.

use rayon::prelude::*;

use super::error::{check_matrix, QuantError};
use super::{blocks32, codebook, codebook_fit, fit, kquants, lowbit, mxfp4};
use crate::format::wtype::WType;

/// Whether `t` is stored as GGUF blocks with their scales inside.
pub fn is_block_type(t: WType) -> bool {
    kquants::is_k(t)
        || blocks32::is_block32(t)
        || lowbit::is_lowbit(t)
        || t == WType::MXFP4
        || codebook::is_codebook(t)
}

/// Whether Krafla can quantize to block type `t` (every block type now).
pub fn has_quantizer(t: WType) -> bool {
    is_block_type(t)
}

/// Dequantizes one block of `t` (`q`: its bytes) into `out` (its weights).
pub fn dequant_block(t: WType, q: &[u8], out: &mut [f32]) {
    match t {
        WType::Q4_K | WType::Q5_K | WType::Q6_K => kquants::dequant_block(t, q, out),
        WType::Q4_1 | WType::Q5_0 | WType::Q5_1 | WType::IQ4_NL | WType::Q6_0 => {
            blocks32::dequant_block(t, q, out)
        }
        WType::MXFP4 => mxfp4::dequant_block(q, out),
        WType::Q2_K | WType::Q3_K | WType::IQ4_XS => lowbit::dequant_block(t, q, out),
        WType::IQ3_XXS
        | WType::IQ3_S
        | WType::IQ2_XXS
        | WType::IQ2_XS
        | WType::IQ2_S
        | WType::IQ1_M => codebook::dequant_block(t, q, out),
        WType::Q8_0 | WType::Q4_0 | WType::BF16 | WType::F16 => {
            panic!("{t} is not a GGUF block type")
        }
    }
}

/// Quantizes one block of `t` (`x`, element weights `w`) into `out`. `Err(v)` when a
/// scale `v` does not fit in an f16.
///
/// Panics for a type without a quantizer ([`has_quantizer`]).
pub fn quantize_block(t: WType, x: &[f32], w: &[f32], out: &mut [u8]) -> Result<(), f32> {
    match t {
        WType::Q4_K | WType::Q5_K | WType::Q6_K => kquants::quantize_block(t, x, w, out),
        WType::Q4_1 | WType::Q5_0 | WType::Q5_1 | WType::IQ4_NL | WType::Q6_0 => {
            blocks32::quantize_block(t, x, w, out)
        }
        WType::MXFP4 => {
            mxfp4::quantize_block(x, w, out);
            Ok(())
        }
        WType::Q2_K | WType::Q3_K | WType::IQ4_XS => lowbit::quantize_block(t, x, w, out),
        WType::IQ3_XXS
        | WType::IQ3_S
        | WType::IQ2_XXS
        | WType::IQ2_XS
        | WType::IQ2_S
        | WType::IQ1_M => codebook_fit::quantize_block(t, x, w, out),
        WType::Q8_0 | WType::Q4_0 | WType::BF16 | WType::F16 => {
            panic!("{t} has no block quantizer")
        }
    }
}

/// Dequantizes one row (`q` = its blocks) into `out` (`cols` values).
pub fn dequant_row(t: WType, q: &[u8], out: &mut [f32]) {
    let (bw, bb) = (t.block_weights(), t.block_bytes());
    debug_assert_eq!(q.len() / bb * bw, out.len());
    for (ob, qb) in out.chunks_exact_mut(bw).zip(q.chunks_exact(bb)) {
        dequant_block(t, qb, ob);
    }
}

/// Quantizes one row `x` with importance `imp` (one per column, or `None`) into `out`
/// ([`WType::row_bytes`] bytes). `Err((block, v))` when a scale `v` of block `block`
/// does not fit in an f16.
pub fn quantize_row(
    t: WType,
    x: &[f32],
    imp: Option<&[f32]>,
    out: &mut [u8],
) -> Result<(), (usize, f32)> {
    let (bw, bb) = (t.block_weights(), t.block_bytes());
    let mut w = Vec::with_capacity(x.len());
    fit::row_weights_for(t, x, imp, &mut w);
    let blocks = x.chunks_exact(bw).zip(w.chunks_exact(bw));
    for (i, ((xb, wb), ob)) in blocks.zip(out.chunks_exact_mut(bb)).enumerate() {
        quantize_block(t, xb, wb, ob).map_err(|v| (i, v))?;
    }
    Ok(())
}

/// Quantizes a rows × cols matrix (row-major f32, finite) to block type `t`.
///
/// `cols` must be a positive multiple of `t.block_weights()`; `imatrix`, when given,
/// has one importance per column.
pub fn quantize_matrix(
    t: WType,
    rows: usize,
    cols: usize,
    x: &[f32],
    imatrix: Option<&[f32]>,
) -> Result<Vec<u8>, QuantError> {
    assert!(is_block_type(t), "{t} is not a GGUF block type");
    if !has_quantizer(t) {
        return Err(QuantError::NoQuantizer { wtype: t });
    }
    check_matrix(rows, cols, t.block_weights(), x)?;
    if let Some(imp) = imatrix {
        assert_eq!(imp.len(), cols, "imatrix length must equal cols");
    }
    let rb = t.row_bytes(cols);
    let mut q = vec![0u8; rows * rb];
    x.par_chunks(cols)
        .zip(q.par_chunks_mut(rb))
        .enumerate()
        .try_for_each(|(r, (xr, qr))| {
            quantize_row(t, xr, imatrix, qr).map_err(|(block, d)| QuantError::BlockScaleOverflow {
                wtype: t,
                row: r,
                block,
                d,
            })
        })?;
    Ok(q)
}

/// Dequantizes a whole matrix of block type `t` (tests and statistics).
pub fn dequantize_matrix(t: WType, rows: usize, cols: usize, q: &[u8]) -> Vec<f32> {
    let rb = t.row_bytes(cols);
    let mut out = vec![0f32; rows * cols];
    for (o, qr) in out.chunks_exact_mut(cols).zip(q.chunks_exact(rb)) {
        dequant_row(t, qr, o);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::wtype::QK_K;
    use crate::rng::Rng;

    /// `testdata/gguf_blocks.bin` (made by `testdata/make_gguf_blocks.py`): random blocks
    /// and gguf-py's numpy dequantization of them.
    const FIXTURE: &[u8] = include_bytes!("../../testdata/gguf_blocks.bin");

    fn u32_at(b: &[u8], at: usize) -> usize {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
    }

    #[test]
    fn dequant_matches_gguf_py() {
        assert_eq!(&FIXTURE[..4], b"KQF1");
        let mut at = 8;
        let mut seen = Vec::new();
        for _ in 0..u32_at(FIXTURE, 4) {
            let t = WType::from_code(u32_at(FIXTURE, at) as u32).unwrap();
            let (n, bb, bw) = (
                u32_at(FIXTURE, at + 4),
                u32_at(FIXTURE, at + 8),
                u32_at(FIXTURE, at + 12),
            );
            assert_eq!((bb, bw), (t.block_bytes(), t.block_weights()), "{t}");
            at += 16;
            let q = &FIXTURE[at..at + n * bb];
            at += n * bb;
            let want: Vec<f32> = FIXTURE[at..at + 4 * n * bw]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            at += 4 * n * bw;
            let mut got = vec![0f32; n * bw];
            dequant_row(t, q, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{t} block {} element {}: {g} vs gguf-py {w}",
                    i / bw,
                    i % bw
                );
            }
            seen.push(t);
        }
        assert_eq!(at, FIXTURE.len());
        let all: Vec<WType> = WType::ALL
            .into_iter()
            .filter(|&t| is_block_type(t))
            .collect();
        assert_eq!(seen, all);
    }

    /// Heavy-tailed values (a Laplace-like mix with rare outliers), like weights.
    fn heavy(rng: &mut Rng) -> f32 {
        let v = -(1.0 - rng.next_f64()).ln() * if rng.next_f64() < 0.5 { -1.0 } else { 1.0 };
        let v = if rng.next_f64() < 0.02 { v * 6.0 } else { v };
        (v * 0.02) as f32
    }

    /// Column importances from 0.001 to about 4, skewed low by `power`.
    fn importances(rng: &mut Rng, cols: usize, power: i32) -> Vec<f32> {
        (0..cols)
            .map(|_| (0.001 + 4.0 * rng.next_f64().powi(power)) as f32)
            .collect()
    }

    /// `rows × cols` heavy-tailed values with per-column spread (outlier channels).
    fn matrix(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
        let colscale: Vec<f32> = (0..cols)
            .map(|_| (0.5 + 2.0 * rng.next_f64() * rng.next_f64()) as f32)
            .collect();
        (0..rows * cols)
            .map(|i| heavy(rng) * colscale[i % cols])
            .collect()
    }

    /// A `rows × cols` [`matrix`] and its column [`importances`] (skewed by `power`)
    /// from the generator seeded with `seed`.
    fn sample(seed: u64, rows: usize, cols: usize, power: i32) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng(seed);
        let x = matrix(&mut rng, rows, cols);
        let imp = importances(&mut rng, cols, power);
        (x, imp)
    }

    /// `x` quantized to `t` and back.
    fn round_trip(
        t: WType,
        rows: usize,
        cols: usize,
        x: &[f32],
        imatrix: Option<&[f32]>,
    ) -> Vec<f32> {
        let q = quantize_matrix(t, rows, cols, x, imatrix).unwrap();
        dequantize_matrix(t, rows, cols, &q)
    }

    /// Weighted squared error in f64 of `xhat` against `x`.
    fn werr(x: &[f32], xhat: &[f64], w: &[f32]) -> f64 {
        (0..x.len())
            .map(|i| w[i] as f64 * (x[i] as f64 - xhat[i]).powi(2))
            .sum()
    }

    fn f16r(v: f64) -> f64 {
        half::f16::from_f64(v).to_f64()
    }

    /// Plain rounding of one block (no search), computed independently in f64 from the
    /// type's formula: the baseline every searched block must beat. Returns the
    /// dequantized values.
    fn round_block(t: WType, x: &[f32]) -> Vec<f64> {
        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let signed_max = |x: &[f64]| {
            x.iter()
                .fold(0.0f64, |m, &v| if v.abs() > m.abs() { v } else { m })
        };
        // Each element to the nearest of the levels `d · vals` (the first on a tie; 0
        // where none is nearer than infinity).
        let nearest = |x: &[f64], d: f64, vals: &[f64]| -> Vec<f64> {
            x.iter()
                .map(|&v| {
                    let best = vals.iter().fold(f64::INFINITY, |b, &l| {
                        if (v - d * l).abs() < (v - d * b).abs() {
                            l
                        } else {
                            b
                        }
                    });
                    if best.is_finite() {
                        d * best
                    } else {
                        0.0
                    }
                })
                .collect()
        };
        // A signed code of `v` under scale `d` in -m..m (0 when `d` is 0).
        let code = |v: f64, d: f64, m: f64| {
            if d == 0.0 {
                0.0
            } else {
                (v / d).round().clamp(-m, m - 1.0)
            }
        };
        // d maps the largest-magnitude element to the lowest level.
        let sym = |x: &[f64], vals: &[f64]| nearest(x, f16r(signed_max(x) / vals[0]), vals);
        let affine = |x: &[f64], nmax: f64, d: f64, mn: f64| -> Vec<f64> {
            x.iter()
                .map(|&v| {
                    let l = if d == 0.0 {
                        0.0
                    } else {
                        ((v - mn) / d).round().clamp(0.0, nmax)
                    };
                    d * l + mn
                })
                .collect()
        };
        let uniform = |lo: i32, hi: i32| -> Vec<f64> { (lo..=hi).map(|v| v as f64).collect() };
        // K-quant affine blocks: sub-blocks of `sub` with `nmax` levels each, their scales
        // and negated minima as codes 0..=cmax under two f16 super-scales.
        let sub_affine = |sub: usize, nmax: f64, cmax: f64| -> Vec<f64> {
            let n = x.len() / sub;
            let (mut s, mut mu) = (vec![0f64; n], vec![0f64; n]);
            for j in 0..n {
                let xj = &x[sub * j..sub * (j + 1)];
                let mn = xj.iter().cloned().fold(0.0, f64::min);
                let mx = xj.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                (s[j], mu[j]) = ((mx - mn) / nmax, -mn);
            }
            let d = f16r(s.iter().cloned().fold(0.0, f64::max) / cmax);
            let dm = f16r(mu.iter().cloned().fold(0.0, f64::max) / cmax);
            let code = |v: f64, d: f64| {
                if d == 0.0 {
                    0.0
                } else {
                    (v / d).round().min(cmax)
                }
            };
            (0..n)
                .flat_map(|j| {
                    let xj = &x[sub * j..sub * (j + 1)];
                    affine(xj, nmax, d * code(s[j], d), -(dm * code(mu[j], dm)))
                })
                .collect()
        };
        match t {
            WType::Q5_0 => sym(&x, &uniform(-16, 15)),
            WType::Q6_0 => sym(&x, &uniform(-32, 31)),
            WType::IQ4_NL => {
                let vals: Vec<f64> = blocks32::IQ4NL_VALUES.iter().map(|&v| v as f64).collect();
                sym(&x, &vals)
            }
            WType::Q4_1 | WType::Q5_1 => {
                let nmax = if t == WType::Q4_1 { 15.0 } else { 31.0 };
                let mn = x.iter().cloned().fold(f64::INFINITY, f64::min);
                let mx = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                affine(&x, nmax, f16r((mx - mn) / nmax), f16r(mn))
            }
            WType::Q4_K | WType::Q5_K => {
                let nmax = if t == WType::Q4_K { 15.0 } else { 31.0 };
                sub_affine(32, nmax, 63.0)
            }
            WType::MXFP4 => {
                // gguf-py's quantizer: e = floor(log2(max |x|)) − 2 + 127, nearest level.
                let amax = x.iter().fold(0f64, |m, v| m.max(v.abs()));
                let e = if amax > 0.0 {
                    (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 254.0)
                } else {
                    0.0
                };
                let d = 2f64.powf(e - 128.0);
                let vals: Vec<f64> = mxfp4::KVALUES.iter().map(|&v| v as f64).collect();
                nearest(&x, d, &vals)
            }
            WType::Q2_K => sub_affine(16, 3.0, 15.0),
            WType::Q3_K | WType::IQ4_XS => {
                // Sub-block scales mapping the largest element to the lowest level, then
                // signed 6-bit codes under d = (largest scale) / −32, nearest levels.
                let (sub, vals): (usize, Vec<f64>) = if t == WType::Q3_K {
                    (16, uniform(-4, 3))
                } else {
                    let v = blocks32::IQ4NL_VALUES.iter().map(|&v| v as f64).collect();
                    (32, v)
                };
                let s: Vec<f64> = x.chunks(sub).map(|xj| signed_max(xj) / vals[0]).collect();
                let d = f16r(signed_max(&s) / -32.0);
                (0..256 / sub)
                    .flat_map(|j| {
                        nearest(&x[sub * j..sub * (j + 1)], d * code(s[j], d, 32.0), &vals)
                    })
                    .collect()
            }
            WType::Q6_K => {
                let s: Vec<f64> = x.chunks(16).map(|xj| signed_max(xj) / -32.0).collect();
                let d = f16r(signed_max(&s) / -128.0);
                (0..16)
                    .flat_map(|j| {
                        let dj = d * code(s[j], d, 128.0);
                        x[16 * j..16 * (j + 1)]
                            .iter()
                            .map(move |&v| dj * code(v, dj, 32.0))
                    })
                    .collect()
            }
            t => panic!("{t}"),
        }
    }

    /// The search beats plain rounding on every block, in the weighted error it
    /// minimizes (with and without an imatrix).
    #[test]
    fn search_is_no_worse_than_rounding_on_every_block() {
        let (rows, cols) = (24, 512);
        let (x, imp) = sample(0x2545f4914f6cdd1d, rows, cols, 3);
        for &t in WType::BLOCKS {
            for imatrix in [None, Some(&imp[..])] {
                let xq = round_trip(t, rows, cols, &x, imatrix);
                let bw = t.block_weights();
                let (mut tot_s, mut tot_r) = (0f64, 0f64);
                for r in 0..rows {
                    let xr = &x[r * cols..(r + 1) * cols];
                    let mut w = Vec::new();
                    fit::row_weights_for(t, xr, imatrix, &mut w);
                    for b in 0..cols / bw {
                        let (xb, wb) = (&xr[b * bw..(b + 1) * bw], &w[b * bw..(b + 1) * bw]);
                        let got: Vec<f64> = xq[r * cols + b * bw..][..bw]
                            .iter()
                            .map(|&v| v as f64)
                            .collect();
                        let es = werr(xb, &got, wb);
                        let er = werr(xb, &round_block(t, xb), wb);
                        assert!(
                            es <= er * (1.0 + 1e-6),
                            "{t} imatrix {} row {r} block {b}: searched {es} > rounded {er}",
                            imatrix.is_some()
                        );
                        (tot_s, tot_r) = (tot_s + es, tot_r + er);
                    }
                }
                eprintln!(
                    "{t} imatrix {}: searched/rounded error {:.3}",
                    imatrix.is_some(),
                    tot_s / tot_r
                );
            }
        }
    }

    /// The symmetric 32-weight types against an exhaustive search in f64: every f16
    /// value of `d` (either sign) with `|d|` within a factor 1.5 of `amax / |extreme
    /// level|`, each with every element on its nearest level (optimal for that `d`).
    #[test]
    fn symmetric_search_is_near_the_exhaustive_optimum() {
        let mut rng = Rng(0x853c49e6748fea9b);
        let (rows, cols) = (4, 512);
        let x = matrix(&mut rng, rows, cols);
        for t in [WType::Q5_0, WType::IQ4_NL, WType::Q6_0] {
            let vals: Vec<f64> = match blocks32::kind(t) {
                blocks32::Kind::Symmetric(lv) => {
                    (0..lv.len() as u8).map(|l| lv.value(l) as f64).collect()
                }
                _ => unreachable!(),
            };
            let (vmin, vmax) = (
                vals[0].abs().min(vals[vals.len() - 1].abs()),
                vals[0].abs().max(vals[vals.len() - 1].abs()),
            );
            let xq = round_trip(t, rows, cols, &x, None);
            let (mut worst, mut sum, mut n) = (0f64, 0f64, 0usize);
            for r in 0..rows {
                let xr = &x[r * cols..(r + 1) * cols];
                let mut w = Vec::new();
                fit::row_weights(xr, None, &mut w);
                for b in 0..cols / 32 {
                    let (xb, wb) = (&xr[32 * b..32 * (b + 1)], &w[32 * b..32 * (b + 1)]);
                    let amax = xb.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
                    let (lo, hi) = (amax / (1.5 * vmax), 1.5 * amax / vmin);
                    let mut best = f64::INFINITY;
                    for bits in 0u16..0x7c00 {
                        let d = half::f16::from_bits(bits).to_f64();
                        if d < lo || d > hi {
                            continue;
                        }
                        for d in [d, -d] {
                            let mut e = 0.0;
                            for (&v, &wi) in xb.iter().zip(wb) {
                                let v = v as f64;
                                let r = vals
                                    .iter()
                                    .fold(f64::INFINITY, |m, &l| m.min((v - d * l).abs()));
                                e += wi as f64 * r * r;
                            }
                            best = best.min(e);
                        }
                    }
                    let got: Vec<f64> = xq[r * cols + 32 * b..][..32]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    let ratio = werr(xb, &got, wb) / best;
                    worst = worst.max(ratio);
                    sum += ratio;
                    n += 1;
                }
            }
            eprintln!(
                "{t}: searched / exhaustive optimum: mean {:.4}, worst {:.4}",
                sum / n as f64,
                worst
            );
            assert!(
                sum / n as f64 <= 1.01 && worst <= 1.15,
                "{t}: mean {} worst {worst}",
                sum / n as f64
            );
        }
    }

    /// The same bytes at 1, 2 and 3 threads.
    #[test]
    fn bytes_do_not_depend_on_the_thread_count() {
        use std::hash::{Hash, Hasher};
        let mut rng = Rng(0xda942042e4dd58b5);
        let (rows, cols) = (37, 768);
        let x = matrix(&mut rng, rows, cols);
        let imp: Vec<f32> = (0..cols).map(|_| (0.001 + rng.next_f64()) as f32).collect();
        for &t in WType::BLOCKS.iter().chain(WType::CODEBOOKS) {
            let hashes: Vec<u64> = crate::quant::threads::on_1_to_3_threads(|| {
                let q = quantize_matrix(t, rows, cols, &x, Some(&imp)).unwrap();
                let mut h = std::collections::hash_map::DefaultHasher::new();
                q.hash(&mut h);
                h.finish()
            });
            assert!(hashes.iter().all(|&h| h == hashes[0]), "{t}: {hashes:x?}");
        }
    }

    /// With an imatrix the error it weights is lower than without it (the quantizer
    /// uses it), on a matrix whose channels differ in importance by up to 4000×.
    #[test]
    fn imatrix_lowers_the_importance_weighted_error() {
        let (rows, cols) = (16, 512);
        let (x, imp) = sample(0x9e3779b97f4a7c15, rows, cols, 4);
        for &t in WType::BLOCKS.iter().chain(WType::CODEBOOKS) {
            let e = |imatrix: Option<&[f32]>| -> f64 {
                let xq = round_trip(t, rows, cols, &x, imatrix);
                (0..rows * cols)
                    .map(|i| imp[i % cols] as f64 * (x[i] as f64 - xq[i] as f64).powi(2))
                    .sum()
            };
            let (with, without) = (e(Some(&imp)), e(None));
            eprintln!(
                "{t}: imatrix-weighted error with / without the imatrix {:.3}",
                with / without
            );
            assert!(with < 0.95 * without, "{t}: {with} vs {without}");
        }
    }

    /// A matrix's blocks are searched with its type's weights: Q2_K's magnitude factor
    /// is `(s² + x²)^¼`, every other type's `sqrt(s² + x²)` ([`fit::magnitude`]).
    #[test]
    fn blocks_take_their_types_weights() {
        let (rows, cols) = (4, 512);
        let (x, imp) = sample(0x5851f42d4c957f2d, rows, cols, 3);
        for t in [WType::Q2_K, WType::Q3_K] {
            let q = quantize_matrix(t, rows, cols, &x, Some(&imp)).unwrap();
            let (mut fourth, mut half) = (Vec::new(), Vec::new());
            for xr in x.chunks_exact(cols) {
                let s2 = xr.iter().map(|v| v * v).sum::<f32>() / cols as f32;
                for (b, xb) in xr.chunks_exact(QK_K).enumerate() {
                    let wb = |quarter: bool| -> Vec<f32> {
                        (0..QK_K)
                            .map(|i| {
                                let m = (s2 + xb[i] * xb[i]).sqrt();
                                imp[b * QK_K + i] * if quarter { m.sqrt() } else { m }
                            })
                            .collect()
                    };
                    for (o, p) in [(&mut fourth, true), (&mut half, false)] {
                        let mut ob = vec![0u8; t.block_bytes()];
                        quantize_block(t, xb, &wb(p), &mut ob).unwrap();
                        o.extend(ob);
                    }
                }
            }
            let (want, other) = if t == WType::Q2_K {
                (fourth, half)
            } else {
                (half, fourth)
            };
            assert_eq!(q, want, "{t}");
            assert_ne!(q, other, "{t}: the two weightings should differ here");
        }
    }

    #[test]
    fn shapes_and_values_are_checked() {
        let x = vec![0.5f32; 2 * 256];
        assert!(matches!(
            quantize_matrix(WType::Q4_K, 2, 256, &x[..300], None),
            Err(QuantError::Shape { .. })
        ));
        assert!(matches!(
            quantize_matrix(WType::Q6_K, 4, 128, &x, None),
            Err(QuantError::Shape { .. })
        ));
        assert!(quantize_matrix(WType::Q5_0, 4, 128, &x, None).is_ok());
        let mut y = x.clone();
        y[300] = f32::NAN;
        match quantize_matrix(WType::Q4_K, 2, 256, &y, None) {
            Err(QuantError::NonFinite {
                row: 1,
                col: 44,
                value,
            }) => assert!(value.is_nan()),
            r => panic!("{r:?}"),
        }
        y[300] = 1e9;
        match quantize_matrix(WType::Q4_K, 2, 256, &y, None) {
            Err(
                e @ QuantError::BlockScaleOverflow {
                    row: 1, block: 0, ..
                },
            ) => {
                assert!(e.to_string().contains("Q4_K's f16 scales"), "{e}")
            }
            r => panic!("{r:?}"),
        }
    }
}
