//! `C −= E·U` in f64, the reference: error feedback's one matrix product (its lazy
//! batch update and its blocked factorization, `quant::feedback`). `C` is m × n, `E`
//! m × k, `U` k × n, each row-major with its own row stride; per element, in this order:
//!
//! ```text
//! c_ij = fma(−e_ip, u_pj, c_ij)        p = 0, 1, …, k − 1
//! ```
//!
//! one rounding per step (`f64::mul_add`). The work runs in tiles of `MR` rows × `NR`
//! columns held in registers (the last rows and columns in tiles of one), the loop over
//! a tile's columns vectorizes; the SIMD tiers run this very code compiled for their
//! instruction set with wider tiles. Each element's steps stay the same, so the bits
//! do, whatever the tile.
//!
//! The sequential updates inside a window use [`sub_scaled`]: `y_k −= a·x_k`, the
//! product rounded, then the difference (two roundings, no fusion), which every tier's
//! wider registers compute the same.

use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// A row-major f64 matrix operand: its values and row stride.
pub type Rows<'a> = (&'a [f64], usize);

/// The operands' dimensions `[m, k, n]`.
pub type Dims = [usize; 3];

/// Whether the operands hold `[m, k, n]` with their strides (the table checks it).
pub fn fits(d: Dims, e: Rows, u: Rows, c: (&[f64], usize)) -> bool {
    let [m, k, n] = d;
    let holds = |(v, ld): (&[f64], usize), rows: usize, cols: usize| {
        rows == 0 || cols == 0 || (ld >= cols && (rows - 1) * ld + cols <= v.len())
    };
    holds(e, m, k) && holds(u, k, n) && holds(c, m, n)
}

/// One tile: rows `i0..i0 + MR`, columns `j0..j0 + NR`.
#[inline(always)]
fn tile<const MR: usize, const NR: usize>(
    (i0, j0): (usize, usize),
    k: usize,
    (e, lde): Rows,
    (u, ldu): Rows,
    (c, ldc): (&mut [f64], usize),
) {
    let mut acc = [[0f64; NR]; MR];
    for (r, a) in acc.iter_mut().enumerate() {
        a.copy_from_slice(&c[(i0 + r) * ldc + j0..][..NR]);
    }
    let erow: [&[f64]; MR] = std::array::from_fn(|r| &e[(i0 + r) * lde..][..k]);
    for p in 0..k {
        let ur: &[f64; NR] = u[p * ldu + j0..][..NR].try_into().expect("NR columns");
        for (a, er) in acc.iter_mut().zip(&erow) {
            let x = -er[p];
            for (o, &y) in a.iter_mut().zip(ur) {
                *o = x.mul_add(y, *o);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        c[(i0 + r) * ldc + j0..][..NR].copy_from_slice(a);
    }
}

/// Depth of a packed strip of `U`: `KC × NR` values (16 KiB at NR = 8) stay in L1 for
/// every row tile of a column tile.
const KC: usize = 256;

/// Values of `U` packed per block of column tiles (192 KiB): the block stays in L2 while
/// every row tile runs across it.
const BLOCK_VALUES: usize = 24 * 1024;

/// `C −= E·U` in tiles of `MR × NR`; shapes as [`fits`] checks them.
///
/// The columns go in blocks, the block's `U` in strips of `KC` rows: when more than one
/// row tile reads a strip it is first copied to a contiguous buffer, each column tile's
/// part after the other (`U`'s rows are thousands of f64 apart, a power of two, so read
/// in place a strip's rows fall into one cache set and miss on every use). Each row
/// tile then runs across the block's column tiles, so that it reads its rows of `C`
/// in order (a column tile at a time down all the rows, `C`'s rows, also a power of two
/// apart, were as many streams as rows and missed the prefetcher). A tile's
/// accumulators go back to `C` between strips, exactly (f64 in, f64 out), so each
/// element's chain of steps is unchanged.
#[inline(always)]
pub fn tiled<const MR: usize, const NR: usize>(
    d: Dims,
    e: Rows,
    (u, ldu): Rows,
    (c, ldc): (&mut [f64], usize),
) {
    let [m, k, n] = d;
    let pack = m > MR;
    let full = n / NR * NR;
    let mut strip = Vec::new();
    for p0 in (0..k).step_by(KC) {
        let kc = KC.min(k - p0);
        let e = (&e.0[p0..], e.1);
        let nc = (BLOCK_VALUES / kc / NR).max(1) * NR;
        for jb in (0..full).step_by(nc) {
            let je = (jb + nc).min(full);
            // Column tile t's strip starts at t·ts: one tile row more than it holds, so
            // that the strips do not start a power of two apart either.
            let ts = (kc + 1) * NR;
            if pack {
                // Read along U's rows (tile t's row p lands at t·ts + p·NR): the
                // prefetcher follows kc rows, not kc × tiles separate lines.
                strip.resize(ts * (je - jb) / NR, 0.0);
                for p in 0..kc {
                    let row = &u[(p0 + p) * ldu + jb..][..je - jb];
                    for (t, v) in row.chunks_exact(NR).enumerate() {
                        strip[t * ts + p * NR..][..NR].copy_from_slice(v);
                    }
                }
            }
            let us = |j0: usize| match pack {
                true => (&strip[(j0 - jb) / NR * ts..], NR),
                false => (&u[p0 * ldu + j0..], ldu),
            };
            let mut i0 = 0;
            while i0 + MR <= m {
                for j0 in (jb..je).step_by(NR) {
                    tile::<MR, NR>((i0, 0), kc, e, us(j0), (&mut c[j0..], ldc));
                }
                i0 += MR;
            }
            while i0 < m {
                for j0 in (jb..je).step_by(NR) {
                    tile::<1, NR>((i0, 0), kc, e, us(j0), (&mut c[j0..], ldc));
                }
                i0 += 1;
            }
        }
    }
    for j0 in full..n {
        for i in 0..m {
            tile::<1, 1>((i, j0), k, e, (u, ldu), (c, ldc));
        }
    }
}

/// `y_k = y_k − a·x_k` for every k (`x` at least as long as `y`): the product rounded to
/// f64, then the difference. Generic in nothing, so that each tier compiles this very
/// loop for its registers: unfused, the bits do not depend on the width.
#[inline(always)]
pub fn scaled(a: f64, x: &[f64], y: &mut [f64]) {
    debug_assert!(x.len() >= y.len(), "sub_scaled: x shorter than y");
    for (o, &v) in y.iter_mut().zip(x) {
        *o -= a * v;
    }
}

/// The scalar tier's `y −= a·x` (see [`scaled`]).
pub fn sub_scaled(a: f64, x: &[f64], y: &mut [f64]) {
    count(Tier::Scalar, Op::SubProduct);
    scaled(a, x, y)
}

/// The scalar tier's entry (see `table::SubProductFn`).
pub fn sub_product(d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize)) {
    count(Tier::Scalar, Op::SubProduct);
    tiled::<4, 4>(d, e, u, c)
}
