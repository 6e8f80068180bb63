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

/// `C −= E·U` in tiles of `MR × NR`; shapes as [`fits`] checks them.
///
/// Each column tile's strip of `U` goes through `KC` rows at a time. When more than one
/// row tile reads it, it is first copied to a contiguous buffer: `U`'s rows are
/// thousands of f64 apart (a power of two), so read in place the strip's rows fall into
/// one cache set and miss on every use. A tile's accumulators go back to `C` between
/// strips, exactly (f64 in, f64 out), so each element's chain of steps is unchanged.
#[inline(always)]
pub fn tiled<const MR: usize, const NR: usize>(
    d: Dims,
    e: Rows,
    (u, ldu): Rows,
    (c, ldc): (&mut [f64], usize),
) {
    let [m, k, n] = d;
    let pack = m > MR;
    let mut strip = Vec::new();
    // Column tiles outside, row tiles inside: a tile's strip of U is read from the
    // cache for every row tile.
    let mut j0 = 0;
    while j0 + NR <= n {
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            let e = (&e.0[p0..], e.1);
            let us = if pack {
                strip.clear();
                for p in p0..p0 + kc {
                    strip.extend_from_slice(&u[p * ldu + j0..][..NR]);
                }
                (&strip[..], NR)
            } else {
                (&u[p0 * ldu + j0..], ldu)
            };
            let cs = &mut c[j0..];
            let mut i0 = 0;
            while i0 + MR <= m {
                tile::<MR, NR>((i0, 0), kc, e, us, (&mut *cs, ldc));
                i0 += MR;
            }
            while i0 < m {
                tile::<1, NR>((i0, 0), kc, e, us, (&mut *cs, ldc));
                i0 += 1;
            }
        }
        j0 += NR;
    }
    while j0 < n {
        for i in 0..m {
            tile::<1, 1>((i, j0), k, e, (u, ldu), (c, ldc));
        }
        j0 += 1;
    }
}

/// The scalar tier's entry (see `table::SubProductFn`).
pub fn sub_product(d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize)) {
    count(Tier::Scalar, Op::SubProduct);
    tiled::<4, 4>(d, e, u, c)
}
