//! Scalar reference of `y = W·x` for the GGUF block types (Q4_K, Q5_K, Q6_K, Q4_1, Q5_0,
//! Q5_1, IQ4_NL, Q6_0, MXFP4, Q2_K, Q3_K, IQ4_XS) against the runtime's Q8_0 activations:
//! the arithmetic contract
//! of `docs/kernels.md` ("GGUF block types") written out plainly: the scalar tier's
//! entries of the kernel table ([`tile`]), and the bits every SIMD tier gives.
//!
//! Per 32-weight block `b` of a row (a Q4_K / Q5_K sub-block, a half of a Q6_K
//! super-block's 16 sub-blocks... i.e. the 32 weights that meet activation block `b`):
//!
//! ```text
//! isum_b  exact i32: Σ q·qx (Q6_K: sc_2k·Σ_lo + sc_2k+1·Σ_hi, each Σ over 16)
//! dw_b    f32, exact from the stored bits: d·sc (K types), d (the others),
//!         2^(e − 128) (MXFP4), d·(ls − 32) (IQ4_XS)
//! symmetric: acc[b % 8] = fma(dw_b · dx_b, isum_b as f32, acc[b % 8])
//! affine:    acc[b % 8] = fma(mw_b, xs_b, fma(dw_b · dx_b, isum_b as f32, acc[b % 8]))
//!            mw_b = −(dmin·m) (Q4_K, Q5_K) or m (Q4_1, Q5_1); xs_b = dx_b · (Σ qx as f32)
//! halves (Q3_K, Q2_K: a scale per 16 weights; Σ_lo, Σ_hi exact i32 over each half):
//!            v_b = fma(d·sc_hi, Σ_hi as f32, (d·sc_lo)·(Σ_lo as f32))             Q3_K
//!            v_b = fma(d·sc_hi, Σ_hi, fma(d·sc_lo, Σ_lo, mt_b))                    Q2_K
//!            mt_b = fma(−dmin·m_hi, (s_b − h_b) as f32, (−dmin·m_lo)·(h_b as f32))
//!            acc[b % 8] = fma(dx_b, v_b, acc[b % 8])
//! y = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))
//! ```
//!
//! every f32 operation rounded once, in the order written: `fma` is one fused
//! multiply-add (`f32::mul_add`), the rest are plain multiplies and adds. The fused steps
//! are the one departure from the Q8_0 / Q4_0 contract: they take two of the affine
//! step's five float operations off the prompt kernels' vector pipes.

use super::tiles::{block_rows, reduce_lanes, LANES};
use crate::format::wtype::{WType, QK, QK_K};
use crate::kernels::acts::{ActTile, QActs};
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;
use crate::quant::blocks32::{self, Kind, IQ4NL_VALUES};
use crate::quant::fit::Levels;
use crate::quant::{blocks, codebook, kquants, lowbit, mxfp4};

/// How a type's per-block float factors are stored (the packed layout's scales,
/// `kernels::packed`, keep them so).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleKind {
    /// One f16 `d` per block: `dw = d`.
    D,
    /// f16 `d` and `m` per block (Q4_1, Q5_1): `dw = d`, `mw = m`.
    DMin,
    /// 6-bit `sc`, `m` per block under f16 `d`, `dmin` per super-block (Q4_K, Q5_K):
    /// `dw = d·sc`, `mw = −(dmin·m)`.
    K45,
    /// int8 scales of the block's two halves under an f16 `d` per super-block (Q6_K):
    /// `isum = sc_lo·Σ_lo + sc_hi·Σ_hi`, `dw = d`.
    K6,
    /// An E8M0 exponent per block (MXFP4): `dw = 2^(e − 128)`.
    E8M0,
    /// A signed 6-bit scale `ls − 32` per block under an f16 `d` per super-block
    /// (IQ4_XS): `dw = d·(ls − 32)`.
    KXs,
    /// Signed 6-bit scales of the block's two halves under an f16 `d` per super-block
    /// (Q3_K): the halves' step `v = fma(d·sc_hi, Σ_hi, (d·sc_lo)·Σ_lo)`.
    K3,
    /// 4-bit scales and minimums of the block's two halves under f16 `d`, `dmin` per
    /// super-block (Q2_K): the halves' step with the minimum term `mt`.
    K2,
}

/// A GGUF block type as the kernels see it (one marker type per [`WType`]).
pub trait BlockTy {
    /// The weight type.
    const W: WType;
    /// Bits per level: 4, 5 or 6.
    const BITS: u32;
    /// Levels are indices into a table of 16 values ([`BlockTy::TAB`]).
    const TABLE: bool;
    /// The table of a `TABLE` type: IQ4_NL's levels, or MXFP4's.
    const TAB: &'static [i8; 16] = &IQ4NL_VALUES;
    /// The contract's integer offset per block: `isum = Σ q·x − OFF·s_b` (Q5_0: 16,
    /// Q6_0: 32; Q6_K: 32 per half, under the halves' scales; Q3_K: 4 per half; the table
    /// types: 128, for the `T + 128` levels of the VNNI kernels).
    const OFF: i32;
    /// How `dw` (and `mw`) are stored.
    const SC: ScaleKind;
    /// The float step has the minimum term `mw·xs`.
    const AFFINE: bool;
}

macro_rules! block_ty {
    ($(#[$doc:meta])* $name:ident, $w:expr, $bits:expr, $table:expr, $off:expr, $sc:expr, $aff:expr) => {
        $(#[$doc])*
        pub struct $name;
        impl BlockTy for $name {
            const W: WType = $w;
            const BITS: u32 = $bits;
            const TABLE: bool = $table;
            const OFF: i32 = $off;
            const SC: ScaleKind = $sc;
            const AFFINE: bool = $aff;
        }
    };
}

block_ty!(
    /// Q4_K.
    Q4K, WType::Q4_K, 4, false, 0, ScaleKind::K45, true);
block_ty!(
    /// Q5_K.
    Q5K, WType::Q5_K, 5, false, 0, ScaleKind::K45, true);
block_ty!(
    /// Q6_K.
    Q6K, WType::Q6_K, 6, false, 32, ScaleKind::K6, false);
block_ty!(
    /// Q4_1.
    Q41, WType::Q4_1, 4, false, 0, ScaleKind::DMin, true);
block_ty!(
    /// Q5_0.
    Q50, WType::Q5_0, 5, false, 16, ScaleKind::D, false);
block_ty!(
    /// Q5_1.
    Q51, WType::Q5_1, 5, false, 0, ScaleKind::DMin, true);
block_ty!(
    /// IQ4_NL (`OFF` applies to the `T + 128` levels of the VNNI kernels).
    Iq4Nl, WType::IQ4_NL, 4, true, 128, ScaleKind::D, false);
block_ty!(
    /// Q6_0.
    Q60, WType::Q6_0, 6, false, 32, ScaleKind::D, false);
block_ty!(
    /// Q2_K (its minimum term is the halves' step's, not `AFFINE`'s).
    Q2K, WType::Q2_K, 2, false, 0, ScaleKind::K2, false);
block_ty!(
    /// Q3_K (levels stored as `q + 4`).
    Q3K, WType::Q3_K, 3, false, 4, ScaleKind::K3, false);
block_ty!(
    /// IQ4_XS.
    Iq4Xs, WType::IQ4_XS, 4, true, 128, ScaleKind::KXs, false);

/// MXFP4 (`OFF` applies to the `K + 128` levels of the VNNI kernels).
pub struct Mxfp4;
impl BlockTy for Mxfp4 {
    const W: WType = WType::MXFP4;
    const BITS: u32 = 4;
    const TABLE: bool = true;
    const TAB: &'static [i8; 16] = &mxfp4::KVALUES;
    const OFF: i32 = 128;
    const SC: ScaleKind = ScaleKind::E8M0;
    const AFFINE: bool = false;
}

/// `Some($e)` with the marker type of block type `$w` as `$B`, `None` for other types:
/// the one place that lists the block types for the kernel tables.
macro_rules! for_block_type {
    ($w:expr, |$B:ident| $e:expr) => {{
        use $crate::format::wtype::WType;
        use $crate::kernels::scalar::blocks as pb;
        $crate::format::wtype::with_marker!(
            $w,
            |$B| $e,
            {
                Q4_K => pb::Q4K,
                Q5_K => pb::Q5K,
                Q6_K => pb::Q6K,
                Q4_1 => pb::Q41,
                Q5_0 => pb::Q50,
                Q5_1 => pb::Q51,
                IQ4_NL => pb::Iq4Nl,
                Q6_0 => pb::Q60,
                MXFP4 => pb::Mxfp4,
                Q2_K => pb::Q2K,
                Q3_K => pb::Q3K,
                IQ4_XS => pb::Iq4Xs,
            },
            // Not a [`BlockTy`]: the codebook types have their own kernels
            // (`for_codebook_type!`).
            WType::IQ3_XXS
                | WType::IQ3_S
                | WType::IQ2_XXS
                | WType::IQ2_XS
                | WType::IQ2_S
                | WType::IQ1_M
                | WType::Q8_0
                | WType::Q4_0
                | WType::BF16
                | WType::F16
        )
    }};
}
pub(crate) use for_block_type;

/// Exact sum of one activation block's quants (`QActs`' block sum `s`).
#[inline(always)]
pub fn act_sum(x: &[i8]) -> i32 {
    x.iter().map(|&v| v as i32).sum()
}

/// `xs_b = dx_b · (s_b as f32)`: the block's share of the affine types' minimum term.
#[inline(always)]
pub fn act_xs(dx: f32, x: &[i8]) -> f32 {
    dx * act_sum(x) as f32
}

/// The symmetric step: `acc[b % 8] = fma(dw·dx, isum, acc[b % 8])`.
#[inline(always)]
fn step(acc: &mut [f32; LANES], b: usize, dw: f32, dx: f32, isum: i32) {
    let a = &mut acc[b % LANES];
    *a = (dw * dx).mul_add(isum as f32, *a);
}

/// The affine step: `acc[b % 8] = fma(mw, xs, fma(dw·dx, isum, acc[b % 8]))`.
#[inline(always)]
fn step_affine(acc: &mut [f32; LANES], b: usize, dw: f32, dx: f32, isum: i32, mw: f32, xs: f32) {
    let a = &mut acc[b % LANES];
    *a = mw.mul_add(xs, (dw * dx).mul_add(isum as f32, *a));
}

/// The halves' step: `acc[b % 8] = fma(dx, v, acc[b % 8])`.
#[inline(always)]
fn step_halves(acc: &mut [f32; LANES], b: usize, dx: f32, v: f32) {
    let a = &mut acc[b % LANES];
    *a = dx.mul_add(v, *a);
}

/// Exact `Σ T[q_i]·x_i` of table levels against activation quants.
#[inline(always)]
fn isum_table(tab: &[i8; 16], q: &[u8], x: &[i8]) -> i32 {
    q.iter()
        .zip(x)
        .map(|(&l, &v)| tab[l as usize] as i32 * v as i32)
        .sum()
}

/// Exact `Σ q_i·x_i` of unsigned levels against activation quants.
#[inline(always)]
fn isum_u(q: &[u8], x: &[i8]) -> i32 {
    q.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// One row (`w` = its blocks) · one token (`xq`, `xd`: `cols` quants, `cols/32` scales).
pub fn dot(t: WType, w: &[u8], xq: &[i8], xd: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let nb = xd.len();
    match t {
        WType::Q4_K | WType::Q5_K => {
            for (sb, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
                let sub = kquants::sub_scales(wb);
                let q = kquants::levels_q45(t, wb);
                for (j, &(dj, mj)) in sub.iter().enumerate() {
                    let b = sb * (QK_K / QK) + j;
                    let xb = &xq[QK * b..QK * (b + 1)];
                    let isum = isum_u(&q[QK * j..QK * (j + 1)], xb);
                    step_affine(&mut acc, b, dj, xd[b], isum, -mj, act_xs(xd[b], xb));
                }
            }
        }
        WType::Q6_K => {
            for (sb, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
                let (d, sc) = kquants::q6_scales(wb);
                let q = kquants::levels_q6(wb);
                for j in 0..QK_K / QK {
                    let b = sb * (QK_K / QK) + j;
                    let half = |h: usize| -> i32 {
                        let (q, x) = (&q[QK * j + 16 * h..][..16], &xq[QK * b + 16 * h..][..16]);
                        q.iter()
                            .zip(x)
                            .map(|(&l, &v)| (l as i32 - 32) * v as i32)
                            .sum()
                    };
                    let isum = sc[2 * j] as i32 * half(0) + sc[2 * j + 1] as i32 * half(1);
                    step(&mut acc, b, d, xd[b], isum);
                }
            }
        }
        WType::MXFP4 => {
            for (b, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
                let xb = &xq[QK * b..QK * (b + 1)];
                let isum = isum_table(&mxfp4::KVALUES, &mxfp4::unpack(wb), xb);
                step(&mut acc, b, mxfp4::e8m0_half(wb[0]), xd[b], isum);
            }
        }
        WType::IQ4_XS => {
            for (sb, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
                let (d, sc) = lowbit::iq4xs_scales(wb);
                let q = lowbit::levels_iq4xs(wb);
                for j in 0..QK_K / QK {
                    let b = sb * (QK_K / QK) + j;
                    let xb = &xq[QK * b..QK * (b + 1)];
                    let isum = isum_table(&IQ4NL_VALUES, &q[QK * j..QK * (j + 1)], xb);
                    step(&mut acc, b, d * sc[j] as f32, xd[b], isum);
                }
            }
        }
        WType::Q3_K | WType::Q2_K => {
            for (sb, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
                let (d, dmin, sc, m) = if t == WType::Q2_K {
                    let (d, dmin, sc, m) = lowbit::q2_scales(wb);
                    (d, dmin, sc.map(|v| v as i32), m)
                } else {
                    let (d, sc) = lowbit::q3_scales(wb);
                    (d, 0.0, sc.map(|v| v as i32), [0; 16])
                };
                let (q, off) = if t == WType::Q2_K {
                    (lowbit::levels_q2(wb), 0)
                } else {
                    (lowbit::levels_q3(wb), 4)
                };
                for j in 0..QK_K / QK {
                    let b = sb * (QK_K / QK) + j;
                    // Σ (q − off)·x over half `h` of the block, and Σ x.
                    let half = |h: usize| -> (f32, f32) {
                        let (q, x) = (&q[QK * j + 16 * h..][..16], &xq[QK * b + 16 * h..][..16]);
                        let sum = q.iter().zip(x).map(|(&l, &v)| (l as i32 - off) * v as i32);
                        (sum.sum::<i32>() as f32, act_sum(x) as f32)
                    };
                    let ((lo, h_lo), (hi, h_hi)) = (half(0), half(1));
                    let (dl, dh) = (d * sc[2 * j] as f32, d * sc[2 * j + 1] as f32);
                    let v = if t == WType::Q2_K {
                        let (ml, mh) = (-(dmin * m[2 * j] as f32), -(dmin * m[2 * j + 1] as f32));
                        let mt = mh.mul_add(h_hi, ml * h_lo);
                        dh.mul_add(hi, dl.mul_add(lo, mt))
                    } else {
                        dh.mul_add(hi, dl * lo)
                    };
                    step_halves(&mut acc, b, xd[b], v);
                }
            }
        }
        t if blocks32::is_block32(t) => {
            let kind = blocks32::kind(t);
            for (b, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
                let (d, m) = blocks32::scales(t, wb);
                let q = blocks32::unpack(t, wb);
                let xb = &xq[QK * b..QK * (b + 1)];
                match kind {
                    Kind::Symmetric(lv) => {
                        let isum = q
                            .iter()
                            .zip(xb)
                            .map(|(&l, &v)| level_int(&lv, l) * v as i32)
                            .sum();
                        step(&mut acc, b, d, xd[b], isum);
                    }
                    Kind::Affine { .. } => {
                        let isum = isum_u(&q, xb);
                        step_affine(&mut acc, b, d, xd[b], isum, m, act_xs(xd[b], xb));
                    }
                }
            }
        }
        t if codebook::is_codebook(t) => return super::codebook::dot(t, w, xq, xd),
        t => panic!("{t} has its kernels in kernels::scalar::tiles"),
    }
    debug_assert_eq!(nb * QK, xq.len());
    reduce_lanes(acc)
}

/// The integer value of a symmetric level index.
#[inline(always)]
fn level_int(lv: &Levels, l: u8) -> i32 {
    match *lv {
        Levels::Uniform { lo, .. } => lo + l as i32,
        Levels::Table(tab) => tab[l as usize] as i32,
    }
}

/// Tile kernel (see `table::TileFn`) of block type `B`: `rows` rows (`wq`, their
/// blocks; `wd` is empty, the scales are inside) against every token of `x`.
pub fn tile<B: BlockTy>(rows: usize, wq: &[u8], _wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Scalar, Op::Tile);
    block_rows(rows, wq, x, out, |wr, xq, xd| dot(B::W, wr, xq, xd));
}

/// `y[t·rows + r] = W[r]·x[t]` for every token of `x` (`w`: rows × cols of type `t`).
///
/// Panics if the lengths disagree or `t` is not a GGUF block type.
pub fn matmul(t: WType, rows: usize, cols: usize, w: &[u8], x: &QActs, y: &mut [f32]) {
    assert!(blocks::is_block_type(t), "{t} is not a GGUF block type");
    assert!(
        cols > 0 && cols.is_multiple_of(t.block_weights()),
        "cols {cols} for {t}"
    );
    let rb = t.row_bytes(cols);
    assert_eq!(w.len(), rows * rb, "weights of a {rows}x{cols} {t} matrix");
    assert_eq!(x.cols(), cols, "activation width");
    assert_eq!(y.len(), x.n() * rows, "output length");
    let nb = cols / QK;
    for (tok, yt) in y.chunks_exact_mut(rows).enumerate() {
        let xq = &x.q()[tok * cols..(tok + 1) * cols];
        let xd = &x.d()[tok * nb..(tok + 1) * nb];
        for (o, wr) in yt.iter_mut().zip(w.chunks_exact(rb)) {
            *o = dot(t, wr, xq, xd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::{dequantize_matrix, quantize_matrix};
    use crate::rng::Rng;

    fn h(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn q4_1_one_block_by_hand() {
        // d = 0.5, m = -2, levels: element 0 → 3, element 16 → 15, the rest 0.
        let mut w = [0u8; 20];
        w[0..2].copy_from_slice(&h(0.5));
        w[2..4].copy_from_slice(&h(-2.0));
        w[4] = 0xf3;
        let mut xq = [0i8; 32];
        xq[0] = 10;
        xq[16] = -4;
        xq[5] = 7;
        let xd = [0.25f32];
        // isum = 3·10 + 15·(−4) = −30; Σx = 13, xs = 3.25;
        // y = (0.5·0.25)·(−30) + (−2)·3.25 = −3.75 − 6.5.
        assert_eq!(dot(WType::Q4_1, &w, &xq, &xd), -10.25);
    }

    #[test]
    fn q4_k_sub_blocks_by_hand() {
        // d = 1, dmin = 0.5; sub-block 0: sc 2, m 4; sub-block 1: sc 3, m 0.
        let mut w = [0u8; 144];
        w[0..2].copy_from_slice(&h(1.0));
        w[2..4].copy_from_slice(&h(0.5));
        let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
        (sc[0], m[0], sc[1]) = (2, 4, 3);
        kquants::pack_scale_min(&sc, &m, &mut w[4..16]);
        // Sub-block 0 element 1 = 5 (low nibble of qs[1]); sub-block 1 element 1 = 7.
        w[16 + 1] = 0x75;
        let mut xq = vec![0i8; 256];
        let mut xd = vec![1.0f32; 8];
        xq[1] = 2; // block 0: isum = 5·2 = 10, Σx = 2 + 3 = 5
        xq[2] = 3;
        xq[33] = -1; // block 1: isum = 7·(−1) = −7, Σx = −1
        xd[1] = 0.5;
        // block 0: (2·1)·10 + (−2)·(1·5) = 20 − 10 = 10 → lane 0
        // block 1: (3·0.5)·(−7) + (−0)·(0.5·−1) = −10.5 + 0 → lane 1
        assert_eq!(dot(WType::Q4_K, &w, &xq, &xd), 10.0 - 10.5);
    }

    #[test]
    fn q6_k_scales_combine_in_integer() {
        // Sub-blocks 0 and 1 (block 0) with scales 3 and −2; element 0 = 33 (level 1),
        // element 16 = 30 (level −2); every other level 32 (0).
        let mut w = [0u8; 210];
        let mut q = [32u8; 256];
        (q[0], q[16]) = (33, 30);
        for (e, &v) in q.iter().enumerate() {
            let (hh, k, l) = (e / 128, (e % 128) / 32, e % 32);
            w[64 * hh + 32 * (k % 2) + l] |= (v & 15) << (4 * (k / 2));
            w[128 + 32 * hh + l] |= (v >> 4) << (2 * k);
        }
        w[192] = 3;
        w[193] = (-2i8) as u8;
        w[208..210].copy_from_slice(&h(0.25));
        let mut xq = vec![0i8; 256];
        (xq[0], xq[16]) = (5, 7);
        let xd = vec![2.0f32; 8];
        // isum = 3·(1·5) + (−2)·(−2·7) = 15 + 28 = 43; y = (0.25·2)·43.
        assert_eq!(dot(WType::Q6_K, &w, &xq, &xd), 21.5);
    }

    #[test]
    fn lanes_follow_the_contract_tree() {
        // Q5_0 blocks with a single level each, so block b adds exactly v_b to lane b % 8:
        // values chosen so that any other association or lane order rounds differently.
        let vals = [1e8f32, 1.0, -1e8, 1.0, 1.0, 0.5, 1.0, 0.25, 3.0, -7.0];
        let nb = vals.len();
        let mut w = vec![0u8; 22 * nb];
        let mut xq = vec![0i8; 32 * nb];
        for b in 0..nb {
            let wb = &mut w[22 * b..22 * (b + 1)];
            wb[0..2].copy_from_slice(&h(1.0));
            // Element 0: q = 17 (low nibble 1, qh bit 0) → level 1; the others q = 0
            // (level −16) against x = 0.
            wb[2..6].copy_from_slice(&1u32.to_le_bytes());
            wb[6] = 0x01;
            xq[32 * b] = 1;
        }
        let xd: Vec<f32> = vals.to_vec();
        let mut acc = [0f32; 8];
        for (b, &v) in vals.iter().enumerate() {
            acc[b % 8] += (1.0 * v) * 1.0;
        }
        let want = reduce_lanes(acc);
        assert_eq!(dot(WType::Q5_0, &w, &xq, &xd).to_bits(), want.to_bits());
        let seq: f32 = vals.iter().sum();
        assert_ne!(want, seq, "the test values must tell the orders apart");
    }

    /// Block 8 meets block 0 in lane 0: its step is fused into the lane as the contract
    /// says (one rounding per `fma`, the minimum term last), which the values tell apart
    /// from separately rounded steps and from the other order.
    #[test]
    fn steps_are_fused_in_contract_order() {
        // Q5_0: block 0 adds exactly 1 to lane 0; block 8 has level 1 against x = 7.
        let mut w = vec![0u8; 22 * 9];
        let mut xq = vec![0i8; 32 * 9];
        for b in [0, 8] {
            let wb = &mut w[22 * b..22 * (b + 1)];
            wb[0..2].copy_from_slice(&h(1.0));
            wb[2..6].copy_from_slice(&1u32.to_le_bytes());
            wb[6] = 0x01;
        }
        (xq[0], xq[32 * 8]) = (1, 7);
        let mut xd = vec![1.0f32; 9];
        xd[8] = 1.1;
        let got = dot(WType::Q5_0, &w, &xq, &xd);
        let (d, isum) = (1.0f32 * 1.1f32, 7.0f32);
        assert_eq!(got.to_bits(), d.mul_add(isum, 1.0).to_bits());
        assert_ne!(
            got,
            d * isum + 1.0,
            "the values must tell fused from separate"
        );

        // Q4_1: block 0 adds exactly 1 to lane 0; block 8 (d 1, m −2.3) has level 3
        // against x = 3 and level 0 against x = 4.
        let mut w = vec![0u8; 20 * 9];
        let mut xq = vec![0i8; 32 * 9];
        for (b, m, q0) in [(0, 0.0, 1u8), (8, -2.3, 3)] {
            let wb = &mut w[20 * b..20 * (b + 1)];
            wb[0..2].copy_from_slice(&h(1.0));
            wb[2..4].copy_from_slice(&h(m));
            wb[4] = q0;
        }
        xq[0] = 1;
        (xq[32 * 8], xq[32 * 8 + 1]) = (3, 4);
        let got = dot(WType::Q4_1, &w, &xq, &xd);
        let m = half::f16::from_f32(-2.3).to_f32();
        let (isum, xs) = (9.0f32, 1.1f32 * 7.0);
        let want = m.mul_add(xs, d.mul_add(isum, 1.0));
        assert_eq!(got.to_bits(), want.to_bits());
        assert_ne!(got, d * isum + m * xs + 1.0, "fused from separate");
        assert_ne!(
            got,
            d.mul_add(isum, m.mul_add(xs, 1.0)),
            "the minimum term last"
        );
    }

    /// The kernels against an f64 dot of the dequantized weights and activations.
    #[test]
    fn dot_matches_f64_of_dequantized() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        for &t in WType::BLOCKS {
            for &cols in &[256usize, 512, 768] {
                let rows = 5;
                let x: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * 0.1).collect();
                let q = quantize_matrix(t, rows, cols, &x, None).unwrap();
                let wd = dequantize_matrix(t, rows, cols, &q);
                let a: Vec<f32> = (0..2 * cols).map(|_| rng.next_f32() * 3.0).collect();
                // The scalar reference's activation quantizer (`q8_0::quantize_block`).
                let (mut aq, mut ad) = (vec![0i8; a.len()], vec![0f32; a.len() / QK]);
                for ((xb, qb), db) in a.chunks_exact(QK).zip(aq.chunks_exact_mut(QK)).zip(&mut ad) {
                    *db = crate::quant::q8_0::quantize_block(xb, qb);
                }
                let acts = QActs::from_parts(2, cols, aq, ad).unwrap();
                let mut y = vec![0f32; 2 * rows];
                matmul(t, rows, cols, &q, &acts, &mut y);
                for tok in 0..2 {
                    for r in 0..rows {
                        let (mut s, mut sa) = (0f64, 0f64);
                        for c in 0..cols {
                            let xv = acts.q()[tok * cols + c] as f64
                                * acts.d()[tok * cols / 32 + c / 32] as f64;
                            let p = wd[r * cols + c] as f64 * xv;
                            s += p;
                            sa += p.abs();
                        }
                        let got = y[tok * rows + r] as f64;
                        assert!(
                            (got - s).abs() <= 1e-5 * sa + 1e-30,
                            "{t} cols {cols} row {r} tok {tok}: {got} vs {s} (Σ|p| {sa})"
                        );
                    }
                }
            }
        }
    }
}
