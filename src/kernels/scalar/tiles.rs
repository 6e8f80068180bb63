//! The reference of the Q8_0 / Q4_0 matrix products (the tile kernels), written out
//! plainly: every SIMD tier's tiles give these bits.
//!
//! Per output: `acc[b % 8] += (d_w[b]·d_x[b]) · (isum_b as f32)` over blocks in order,
//! then [`reduce_lanes`]; `isum_b` is the exact i32 dot product of the block's quants.

use crate::format::wtype::QK;
use crate::kernels::acts::ActTile;
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// Partial sums per output in the contract: block `b` goes to lane `b % LANES`.
pub const LANES: usize = 8;

/// Calls `f(wq_r, wd_r, out_r)` for each of `rows` rows: the tiers' row loop.
#[inline(always)]
pub(crate) fn for_rows(
    rows: usize,
    wq: &[u8],
    wd: &[f32],
    out: &mut [f32],
    mut f: impl FnMut(&[u8], &[f32], &mut [f32]),
) {
    debug_assert!(rows > 0 && wq.len().is_multiple_of(rows) && wd.len().is_multiple_of(rows));
    debug_assert_eq!(out.len() % rows, 0);
    let (rb, nb, nt) = (wq.len() / rows, wd.len() / rows, out.len() / rows);
    let it = wq
        .chunks_exact(rb)
        .zip(wd.chunks_exact(nb))
        .zip(out.chunks_exact_mut(nt));
    for ((q, d), o) in it {
        f(q, d, o);
    }
}

/// Every row of a block type (`wq`: `rows` rows of blocks with their scales inside)
/// against every token of `x`: `out[r·nt + t] = dot(row r, x's token t)`, `dot` taking
/// the row's blocks and the token's quants and scales.
#[inline(always)]
pub(crate) fn block_rows(
    rows: usize,
    wq: &[u8],
    x: &ActTile,
    out: &mut [f32],
    dot: impl Fn(&[u8], &[i8], &[f32]) -> f32,
) {
    let (nt, rb) = (out.len() / rows, wq.len() / rows);
    let nb = x.d.len() / nt;
    let cols = nb * QK;
    for (wr, o) in wq.chunks_exact(rb).zip(out.chunks_exact_mut(nt)) {
        for (t, y) in o.iter_mut().enumerate() {
            let (xq, xd) = (&x.q[t * cols..(t + 1) * cols], &x.d[t * nb..(t + 1) * nb]);
            *y = dot(wr, xq, xd);
        }
    }
}

/// The contract's fixed reduction tree: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline(always)]
pub fn reduce_lanes(a: [f32; LANES]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// One block's float step: `acc[b % 8] += (dw·dx)·isum`.
#[inline(always)]
pub fn accumulate(acc: &mut [f32; LANES], b: usize, dw: f32, dx: f32, isum: i32) {
    acc[b % LANES] += (dw * dx) * isum as f32;
}

/// Exact dot product of one Q8_0 weight block with one activation block.
#[inline(always)]
pub fn isum_q8(w: &[u8], x: &[i8]) -> i32 {
    w.iter()
        .zip(x)
        .map(|(&a, &b)| a as i8 as i32 * b as i32)
        .sum()
}

/// Exact dot product of one Q4_0 weight block (16 bytes) with one activation block.
#[inline(always)]
pub fn isum_q4(w: &[u8], x: &[i8]) -> i32 {
    let (lo, hi) = x.split_at(QK / 2);
    let mut s = 0i32;
    for ((&b, &xl), &xh) in w.iter().zip(lo).zip(hi) {
        s += ((b & 0x0F) as i32 - 8) * xl as i32 + ((b >> 4) as i32 - 8) * xh as i32;
    }
    s
}

/// The contract for one row against one token, given the per-block integer dot.
#[inline(always)]
fn dot_row(
    wq: &[u8],
    wd: &[f32],
    xq: &[i8],
    xd: &[f32],
    wblock: usize,
    isum: impl Fn(&[u8], &[i8]) -> i32,
) -> f32 {
    let mut acc = [0.0f32; LANES];
    let blocks = wq.chunks_exact(wblock).zip(xq.chunks_exact(QK));
    for (b, (wb, xb)) in blocks.enumerate() {
        accumulate(&mut acc, b, wd[b], xd[b], isum(wb, xb));
    }
    reduce_lanes(acc)
}

/// Q8_0 row · Q8_0 activation row.
pub fn dot_q8(wq: &[u8], wd: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
    dot_row(wq, wd, xq, xd, QK, isum_q8)
}

/// Q4_0 row · Q8_0 activation row.
pub fn dot_q4(wq: &[u8], wd: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
    dot_row(wq, wd, xq, xd, QK / 2, isum_q4)
}

/// Tile kernel (see `TileFn`): Q8_0 rows against a tile of tokens.
pub fn tile_q8(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    tile(rows, wq, wd, x, out, dot_q8)
}

/// Tile kernel (see `TileFn`): Q4_0 rows against a tile of tokens.
pub fn tile_q4(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    tile(rows, wq, wd, x, out, dot_q4)
}

/// A weight row (quants, scales) · an activation row (quants, scales).
type RowDot = fn(&[u8], &[f32], &[i8], &[f32]) -> f32;

/// Every row against every token of the tile with the row dot `dot`.
#[inline(always)]
fn tile(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32], dot: RowDot) {
    count(Tier::Scalar, Op::Tile);
    for_rows(rows, wq, wd, out, |wq, wd, out| {
        let (cols, nb) = (wd.len() * QK, wd.len());
        for (t, o) in out.iter_mut().enumerate() {
            let (xq, xd) = (&x.q[t * cols..(t + 1) * cols], &x.d[t * nb..(t + 1) * nb]);
            *o = dot(wq, wd, xq, xd);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_tree_order() {
        // Values chosen so that a different association gives a different result.
        let a = [1e8f32, 1.0, -1e8, 1.0, 1.0, 0.5, 1.0, 0.25];
        let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
        assert_eq!(reduce_lanes(a), (h[0] + h[2]) + (h[1] + h[3]));
    }

    #[test]
    fn dot_small() {
        let wq: Vec<u8> = (0..64).map(|i| (i as i8 - 32) as u8).collect();
        let xq: Vec<i8> = (0..64).map(|i| (i % 7) as i8 - 3).collect();
        let (wd, xd) = ([0.5f32, 0.25], [2.0f32, 4.0]);
        let i0 = isum_q8(&wq[..32], &xq[..32]);
        let i1 = isum_q8(&wq[32..], &xq[32..]);
        assert_eq!(dot_q8(&wq, &wd, &xq, &xd), i0 as f32 + i1 as f32);
    }
}
