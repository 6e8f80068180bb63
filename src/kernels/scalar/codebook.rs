//! Scalar reference of `y = W·x` for GGUF's codebook types (IQ3_XXS, IQ3_S, IQ2_XXS,
//! IQ2_XS, IQ2_S, IQ1_M) against the runtime's Q8_0 activations: the contract of
//! `docs/kernels.md` ("GGUF codebook types"), the bits every SIMD tier gives.
//!
//! A block decodes to signed integer levels `v` and an exact f32 scale per 16 weights
//! (`quant::codebook::decode`). Per 32-weight block `b` (sub-block `j = b % 8` of its
//! super-block), against activation block `b`:
//!
//! ```text
//! Σ_lo, Σ_hi  exact i32: Σ v·qx over the block's first and last 16 weights
//! a scale per 32 (IQ2_XXS, IQ3_XXS, IQ3_S): isum_b = Σ_lo + Σ_hi
//!             acc[b % 8] = fma(dw_b · dx_b, isum_b as f32, acc[b % 8])
//! a scale per 16 (IQ2_XS, IQ2_S, IQ1_M):
//!             v_b = fma(dw_hi, Σ_hi as f32, dw_lo · (Σ_lo as f32))
//!             acc[b % 8] = fma(dx_b, v_b, acc[b % 8])
//! y = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))
//! ```
//!
//! the steps of IQ4_XS and of Q3_K, with the decoded levels in place of theirs.

use super::tiles::{block_rows, reduce_lanes, LANES};
use crate::format::wtype::{WType, QK, QK_K};
use crate::kernels::acts::ActTile;
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;
use crate::quant::codebook;

/// A codebook type as the kernels see it (one marker type per [`WType`]).
pub trait CodebookTy {
    /// The weight type.
    const W: WType;
}

macro_rules! codebook_ty {
    ($($(#[$doc:meta])* $name:ident = $w:expr;)*) => {$(
        $(#[$doc])*
        pub struct $name;
        impl CodebookTy for $name {
            const W: WType = $w;
        }
    )*};
}

codebook_ty! {
    /// IQ3_XXS.
    Iq3Xxs = WType::IQ3_XXS;
    /// IQ3_S.
    Iq3S = WType::IQ3_S;
    /// IQ2_XXS.
    Iq2Xxs = WType::IQ2_XXS;
    /// IQ2_XS.
    Iq2Xs = WType::IQ2_XS;
    /// IQ2_S.
    Iq2S = WType::IQ2_S;
    /// IQ1_M.
    Iq1M = WType::IQ1_M;
}

/// `Some($e)` with the marker type of codebook type `$w` as `$C`, `None` for other
/// types: the one place that lists the codebook types for the kernel tables.
macro_rules! for_codebook_type {
    ($w:expr, |$C:ident| $e:expr) => {{
        use $crate::kernels::scalar::codebook as cb;
        $crate::format::wtype::with_marker!(
            $w,
            |$C| $e,
            {
                IQ3_XXS => cb::Iq3Xxs,
                IQ3_S => cb::Iq3S,
                IQ2_XXS => cb::Iq2Xxs,
                IQ2_XS => cb::Iq2Xs,
                IQ2_S => cb::Iq2S,
                IQ1_M => cb::Iq1M,
            },
            _
        )
    }};
}
pub(crate) use for_codebook_type;

/// Exact `Σ v_i·x_i` of decoded levels against activation quants.
#[inline(always)]
fn isum(v: &[i8], x: &[i8]) -> i32 {
    v.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// One row (`w` = its blocks) · one token (`xq`, `xd`: `cols` quants, `cols/32` scales).
///
/// Panics if `t` is not a codebook type.
pub fn dot(t: WType, w: &[u8], xq: &[i8], xd: &[f32]) -> f32 {
    let halves = codebook::halves(t);
    let mut acc = [0.0f32; LANES];
    for (sb, wb) in w.chunks_exact(t.block_bytes()).enumerate() {
        let dec = codebook::decode(t, wb);
        for j in 0..QK_K / QK {
            let b = sb * (QK_K / QK) + j;
            let (v, x) = (&dec.v[QK * j..][..QK], &xq[QK * b..][..QK]);
            let (lo, hi) = (isum(&v[..16], &x[..16]), isum(&v[16..], &x[16..]));
            let a = &mut acc[b % LANES];
            if halves {
                let v = dec.dw[2 * j + 1].mul_add(hi as f32, dec.dw[2 * j] * lo as f32);
                *a = xd[b].mul_add(v, *a);
            } else {
                *a = (dec.dw[2 * j] * xd[b]).mul_add((lo + hi) as f32, *a);
            }
        }
    }
    reduce_lanes(acc)
}

/// Tile kernel (see `table::TileFn`) of codebook type `C`: `rows` rows (`wq`, their
/// blocks; `wd` is empty, the scales are inside) against every token of `x`.
pub fn tile<C: CodebookTy>(rows: usize, wq: &[u8], _wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Scalar, Op::Tile);
    block_rows(rows, wq, x, out, |wr, xq, xd| dot(C::W, wr, xq, xd));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One IQ2_XS super-block by hand: the halves' scales meet their own sums.
    #[test]
    fn iq2_xs_halves_by_hand() {
        // d = 1; half 0 of block 0: ls 1 (dw 0.375), half 1: ls 3 (dw 0.875). Group 0
        // (weights 0..8): entry 0 (all 8), no signs; group 2 (weights 16..24): entry 0
        // with sign index 1 (0x81: values 0 and 7 negative).
        let mut w = [0u8; 74];
        w[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        w[2 + 2 * 2..2 + 2 * 2 + 2].copy_from_slice(&(1u16 << 9).to_le_bytes());
        w[66] = 0x31;
        let mut xq = vec![0i8; 256];
        xq[0] = 2; // Σ_lo = 8·2 = 16
        xq[16] = 3; // Σ_hi = −8·3 + 8·1 = −16
        xq[17] = 1;
        let xd = [0.5f32; 8];
        let lo = 0.375f32 * 16.0;
        let v = 0.875f32.mul_add(-16.0, lo);
        assert_eq!(dot(WType::IQ2_XS, &w, &xq, &xd), 0.5 * v);
    }

    /// The kernel against an f64 dot of the dequantized weights (random blocks with
    /// ordinary scales).
    #[test]
    fn dot_matches_f64_of_dequantized() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for t in WType::ALL.into_iter().filter(|&t| codebook::is_codebook(t)) {
            let nsb = 3;
            let mut w: Vec<u8> = (0..nsb * t.block_bytes()).map(|_| next() as u8).collect();
            for blk in w.chunks_exact_mut(t.block_bytes()) {
                if t == WType::IQ1_M {
                    // d = 0.01 in the scale words' top nibbles.
                    let d = half::f16::from_f32(0.01).to_bits();
                    for k in 0..4 {
                        let at = 48 + 2 * k;
                        let lo = u16::from_le_bytes([blk[at], blk[at + 1]]) & 0x0fff;
                        let wd = lo | ((d >> (4 * k)) & 15) << 12;
                        blk[at..at + 2].copy_from_slice(&wd.to_le_bytes());
                    }
                } else {
                    let d = half::f16::from_f32(0.01).to_bits();
                    blk[0..2].copy_from_slice(&d.to_le_bytes());
                }
            }
            let xq: Vec<i8> = (0..nsb * QK_K).map(|_| next() as i8 / 2).collect();
            let xd: Vec<f32> = (0..nsb * 8).map(|i| 0.01 + i as f32 * 0.003).collect();
            let mut wd = vec![0f32; nsb * QK_K];
            for (o, b) in wd
                .chunks_exact_mut(QK_K)
                .zip(w.chunks_exact(t.block_bytes()))
            {
                codebook::dequant_block(t, b, o);
            }
            let (mut want, mut sa) = (0f64, 0f64);
            for (i, (&a, &q)) in wd.iter().zip(&xq).enumerate() {
                let p = a as f64 * q as f64 * xd[i / QK] as f64;
                want += p;
                sa += p.abs();
            }
            let got = dot(t, &w, &xq, &xd) as f64;
            assert!((got - want).abs() <= 1e-5 * sa, "{t}: {got} vs {want}");
        }
    }
}
