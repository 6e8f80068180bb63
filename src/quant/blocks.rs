//! Matrices of the GGUF block types (the K types of [`super::kquants`] and the 32-weight
//! types of [`super::blocks32`]): one array of `rows × cols / block_weights` blocks,
//! row-major, each block its GGUF bytes with its scales inside (no scale array).
//!
//! Rows are quantized in parallel (rayon), each a pure function of its values and the
//! imatrix, so the bytes do not depend on the thread count.

use rayon::prelude::*;

use super::{blocks32, fit, kquants, QuantError};
use crate::format::wtype::WType;

/// Whether `t` is stored as GGUF blocks with their scales inside.
pub fn is_block_type(t: WType) -> bool {
    kquants::is_k(t) || blocks32::is_block32(t)
}

/// Dequantizes one row (`q` = its blocks) into `out` (`cols` values).
pub fn dequant_row(t: WType, q: &[u8], out: &mut [f32]) {
    let (bw, bb) = (t.block_weights(), t.block_bytes());
    debug_assert_eq!(q.len() / bb * bw, out.len());
    for (ob, qb) in out.chunks_exact_mut(bw).zip(q.chunks_exact(bb)) {
        if kquants::is_k(t) {
            kquants::dequant_block(t, qb, ob);
        } else {
            blocks32::dequant_block(t, qb, ob);
        }
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
    fit::row_weights(x, imp, &mut w);
    let blocks = x.chunks_exact(bw).zip(w.chunks_exact(bw));
    for (i, ((xb, wb), ob)) in blocks.zip(out.chunks_exact_mut(bb)).enumerate() {
        let r = if kquants::is_k(t) {
            kquants::quantize_block(t, xb, wb, ob)
        } else {
            blocks32::quantize_block(t, xb, wb, ob)
        };
        r.map_err(|v| (i, v))?;
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
    if cols == 0
        || !cols.is_multiple_of(t.block_weights())
        || rows.checked_mul(cols) != Some(x.len())
    {
        return Err(QuantError::Shape {
            rows,
            cols,
            len: x.len(),
        });
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite {
            row: i / cols,
            col: i % cols,
            value: x[i],
        });
    }
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
}
