//! Weight and activation quantizers, exactly the spec's float32 operations.
//!
//! Blocks are 32 consecutive values of a row. Q8_0 stores one int8 per value and a
//! scale `d` per block; Q4_0 stores two 4-bit levels per byte and a scale per block.
//! BF16 and F16 store every value as a 2-byte float, rounded to nearest even
//! ([`crate::format::half_float`]). Matrices are quantized row by row in parallel (rayon); every row is a
//! pure function of its values, so the bytes do not depend on the thread count.

pub mod blocks;
pub mod blocks32;
pub mod codebook;
pub mod codebook_fit;
pub mod codebook_search;
pub mod error;
pub mod feedback;
pub mod fit;
pub mod kquants;
pub mod lowbit;
pub mod mxfp4;
pub mod q4_0;
pub mod q8_0;
#[cfg(test)]
pub(crate) mod threads;

use rayon::prelude::*;

use crate::format::half_float;
use crate::format::mat::QMat;
pub use crate::format::mat::{Quantized, Scales};
use error::check_matrix;
pub use error::QuantError;

pub use crate::format::wtype::{WType, QK};

/// How Q4_0 blocks are rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q4Rule {
    /// The least-squares search over 13 levels (the spec's tools/mlb.py).
    Search,
    /// llama.cpp's rule: d = max / -8, level = min(trunc(x / d + 8.5), 15).
    Round,
}

/// Options of [`quantize`].
#[derive(Debug, Clone, Copy)]
pub struct QuantOptions<'a> {
    pub scale_f16: bool,
    pub q4_rule: Q4Rule,
    /// Importance of each input channel (cols values, floored at 0.001 by the caller):
    /// weights the Q4_0 search by imp × sqrt(s² + x²).
    pub imatrix: Option<&'a [f32]>,
}

impl Default for QuantOptions<'_> {
    fn default() -> Self {
        QuantOptions {
            scale_f16: false,
            q4_rule: Q4Rule::Search,
            imatrix: None,
        }
    }
}

/// Whether [`quantize`] writes `wtype` (every type does now).
pub fn can_quantize(wtype: WType) -> bool {
    !blocks::is_block_type(wtype) || blocks::has_quantizer(wtype)
}

/// The `--wtype` names of the types [`quantize`] writes, comma-separated.
pub fn quantizable_names() -> String {
    let names: Vec<_> = WType::ALL
        .into_iter()
        .filter(|&t| can_quantize(t))
        .map(|t| t.cli_name())
        .collect();
    names.join(", ")
}

/// The type named `s` if [`quantize`] writes it; else why not, in one line.
pub fn quantizable_type(s: &str) -> Result<WType, String> {
    match WType::from_cli_name(s) {
        Some(t) if can_quantize(t) => Ok(t),
        Some(t) => Err(format!(
            "{t}: Krafla reads {t} (GGUF import) but has no quantizer for it yet (quantizable: {})",
            quantizable_names()
        )),
        None => Err(format!(
            "unknown weight type '{s}' (known: {})",
            quantizable_names()
        )),
    }
}

/// Quantizes a rows × cols matrix (row-major f32) to `wtype`.
pub fn quantize(
    wtype: WType,
    rows: usize,
    cols: usize,
    x: &[f32],
    opts: &QuantOptions,
) -> Result<Quantized, QuantError> {
    if blocks::is_block_type(wtype) {
        let q = blocks::quantize_matrix(wtype, rows, cols, x, opts.imatrix)?;
        let d = Scales::F32(Vec::new());
        return Ok(Quantized {
            wtype,
            rows,
            cols,
            q,
            d,
        });
    }
    check_matrix(rows, cols, QK, x)?;
    if wtype.is_half() {
        return quantize_half(wtype, rows, cols, x);
    }
    if let Some(imp) = opts.imatrix {
        assert_eq!(imp.len(), cols, "imatrix length must equal cols");
    }
    let nb = cols / QK;
    let qrow = wtype.row_bytes(cols);
    let mut q = vec![0u8; rows * qrow];
    let mut d32 = vec![0f32; if opts.scale_f16 { 0 } else { rows * nb }];
    let mut d16 = vec![0u16; if opts.scale_f16 { rows * nb } else { 0 }];
    // One row per task: per-row results are independent of scheduling.
    let rows_iter = x.par_chunks(cols).zip(q.par_chunks_mut(qrow)).enumerate();
    let res: Result<(), QuantError> = if opts.scale_f16 {
        rows_iter
            .zip(d16.par_chunks_mut(nb))
            .try_for_each(|((r, (xr, qr)), dr)| {
                quantize_row(wtype, xr, qr, RowScales::F16(dr), opts)
                    .map_err(|(block, d)| QuantError::ScaleOverflow { row: r, block, d })
            })
    } else {
        rows_iter
            .zip(d32.par_chunks_mut(nb))
            .try_for_each(|((r, (xr, qr)), dr)| {
                quantize_row(wtype, xr, qr, RowScales::F32(dr), opts)
                    .map_err(|(block, d)| QuantError::ScaleOverflow { row: r, block, d })
            })
    };
    res?;
    let d = if opts.scale_f16 {
        Scales::F16(d16)
    } else {
        Scales::F32(d32)
    };
    Ok(Quantized {
        wtype,
        rows,
        cols,
        q,
        d,
    })
}

/// Rounds a matrix to BF16 or F16 (finite `x`): rows in parallel, the first value out
/// of range (in row-major order) is the error.
fn quantize_half(
    wtype: WType,
    rows: usize,
    cols: usize,
    x: &[f32],
) -> Result<Quantized, QuantError> {
    let mut w = vec![0u16; x.len()];
    let bad: Option<usize> = x
        .par_chunks(cols)
        .zip(w.par_chunks_mut(cols))
        .enumerate()
        .filter_map(|(r, (xr, wr))| {
            half_float::to_half(wtype, xr, wr)
                .err()
                .map(|c| r * cols + c)
        })
        .min();
    if let Some(i) = bad {
        return Err(QuantError::OutOfRange {
            row: i / cols,
            col: i % cols,
            value: x[i],
            wtype,
        });
    }
    Ok(Quantized {
        wtype,
        rows,
        cols,
        q: w.iter().flat_map(|b| b.to_le_bytes()).collect(),
        d: Scales::F32(Vec::new()),
    })
}

/// Where a row's scales go.
enum RowScales<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [u16]),
}

/// Quantizes one row; on a scale that f16 cannot hold returns (block, d).
fn quantize_row(
    wtype: WType,
    x: &[f32],
    q: &mut [u8],
    d: RowScales,
    opts: &QuantOptions,
) -> Result<(), (usize, f32)> {
    let f16 = matches!(d, RowScales::F16(_));
    let mut scales = Vec::with_capacity(x.len() / QK);
    match wtype {
        WType::Q8_0 => {
            for (b, (xb, qb)) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
                let mut qi = [0i8; QK];
                let s = if f16 {
                    match q8_0::quantize_block_f16(xb, &mut qi) {
                        Some(h) => h.to_f32(),
                        None => {
                            return Err((b, xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0))
                        }
                    }
                } else {
                    q8_0::quantize_block(xb, &mut qi)
                };
                for (o, v) in qb.iter_mut().zip(qi) {
                    *o = v as u8;
                }
                scales.push(s);
            }
        }
        WType::Q4_0 => {
            let weights = q4_0::RowWeights::new(x, opts.imatrix);
            for (b, (xb, qb)) in x
                .chunks_exact(QK)
                .zip(q.chunks_exact_mut(QK / 2))
                .enumerate()
            {
                let s = match opts.q4_rule {
                    Q4Rule::Round => q4_0::quantize_block_round(xb, qb),
                    Q4Rule::Search => {
                        q4_0::quantize_block_search(xb, weights.block(b).as_ref(), qb)
                    }
                };
                if f16 && s.abs() > 65504.0 {
                    return Err((b, s));
                }
                scales.push(s);
            }
        }
        WType::BF16 | WType::F16 => unreachable!("quantize_half rounds 2-byte float types"),
        t => unreachable!("{t} is quantized by quant::blocks"),
    }
    match d {
        RowScales::F32(d) => d.copy_from_slice(&scales),
        RowScales::F16(d) => {
            for (o, s) in d.iter_mut().zip(scales) {
                *o = half::f16::from_f32(s).to_bits();
            }
        }
    }
    Ok(())
}

/// Dequantizes row `r` of `w` into `out` (`cols` values) by [`dequant_row`]; f16
/// scales are widened in software (exact, the bits every kernel tier's conversion
/// gives). The runtime's `Kernels::dequant_row` reads a packed copy when there is one.
///
/// Panics if `r >= w.rows` or `out.len() != w.cols`.
pub fn dequant_mat_row(w: &QMat, r: usize, out: &mut [f32]) {
    assert!(r < w.rows, "row {r} of {}", w.rows);
    assert_eq!(out.len(), w.cols, "out length vs cols");
    let nb = w.blocks();
    let widened: Vec<f32>;
    let d = if !w.wtype.has_scales() {
        &[][..] // BF16, F16 and the GGUF block types carry no scale array
    } else if w.d16.is_empty() {
        &w.d[r * nb..(r + 1) * nb]
    } else {
        widened = w.d16[r * nb..(r + 1) * nb]
            .iter()
            .map(|&h| half::f16::from_bits(h).to_f32_const())
            .collect();
        &widened[..]
    };
    dequant_row(w.wtype, w.row_q(r), d, out)
}

/// The whole matrix dequantized, row-major ([`dequant_mat_row`] per row).
pub fn dequant_matrix(w: &QMat) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    if w.cols > 0 {
        for (r, o) in out.chunks_exact_mut(w.cols).enumerate() {
            dequant_mat_row(w, r, o);
        }
    }
    out
}

/// Dequantizes one row (`q`: its bytes in the matrix's first array, `d`: its scales,
/// `out`: its values): `w = level · d` per block, one f32 multiply
/// ([`q8_0::dequant_block`], [`q4_0::dequant_block`]); the 2-byte floats widened (`d`
/// unused); a GGUF block type by its own rule (`d` unused). The one dequantization of
/// the crate: the converter's statistics, `mlb-inspect` and the runtime's embedding rows
/// all use it.
pub fn dequant_row(wtype: WType, q: &[u8], d: &[f32], out: &mut [f32]) {
    if wtype.is_half() {
        for (o, c) in out.iter_mut().zip(q.chunks_exact(2)) {
            *o = half_float::to_f32(wtype, u16::from_le_bytes([c[0], c[1]]));
        }
        return;
    }
    if blocks::is_block_type(wtype) {
        return blocks::dequant_row(wtype, q, out);
    }
    let per = wtype.block_bytes();
    let blocks = out.chunks_exact_mut(QK).zip(q.chunks_exact(per)).zip(d);
    match wtype {
        WType::Q8_0 => blocks.for_each(|((o, qb), &s)| q8_0::dequant_block(qb, s, o)),
        WType::Q4_0 => blocks.for_each(|((o, qb), &s)| q4_0::dequant_block(qb, s, o)),
        t => unreachable!("{t} is handled above"),
    }
}
