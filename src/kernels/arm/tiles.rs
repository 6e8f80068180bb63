//! NEON tier (aarch64 baseline): the integer block dot in NEON, the float step in scalar
//! f32 exactly as `scalar::tiles` does it, so the bits match by construction.
//!
//! `isum_b` = widening `vmull_s8` products (|w·x| ≤ 127·128, fits i16) pairwise
//! accumulated into i32 (`vpadalq_s16`) and summed across lanes (`vaddvq_s32`), exact.
//! Each weight block is loaded once per tile of up to `TILE_TOKENS` tokens.

use core::arch::aarch64::*;

use crate::format::wtype::QK;
use crate::kernels::acts::{ActTile, TILE_TOKENS};
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::tiles::{accumulate, for_rows, reduce_lanes, LANES};
use crate::kernels::tier::Tier;

/// Exact dot of 32 levels (`w0` = elements 0..16, `w1` = 16..32) with 32 activations.
#[inline(always)]
unsafe fn isum(w0: int8x16_t, w1: int8x16_t, x: *const i8) -> i32 {
    // SAFETY: 32 readable bytes at `x` (the caller's contract); NEON is baseline.
    unsafe {
        let x0 = vld1q_s8(x);
        let x1 = vld1q_s8(x.add(16));
        let mut s = vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)));
        s = vpadalq_s16(s, vmull_high_s8(w0, x0));
        s = vpadalq_s16(s, vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
        s = vpadalq_s16(s, vmull_high_s8(w1, x1));
        vaddvq_s32(s)
    }
}

/// A Q8_0 block's levels.
#[inline(always)]
unsafe fn load_q8(p: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: 32 readable bytes at `p` (the caller's contract).
    unsafe { (vld1q_s8(p as *const i8), vld1q_s8(p.add(16) as *const i8)) }
}

/// A Q4_0 block's levels: low nibbles are elements 0..16, high nibbles 16..32, minus 8.
#[inline(always)]
unsafe fn load_q4(p: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: 16 readable bytes at `p` (the caller's contract).
    unsafe {
        let v = vld1q_u8(p);
        let eight = vdupq_n_s8(8);
        let lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
        let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
        (vsubq_s8(lo, eight), vsubq_s8(hi, eight))
    }
}

/// One row against `out.len()` ≤ `TILE_TOKENS` tokens.
#[inline(always)]
unsafe fn tile(
    wq: &[u8],
    wd: &[f32],
    xq: &[i8],
    xd: &[f32],
    out: &mut [f32],
    bytes: usize,
    load: unsafe fn(*const u8) -> (int8x16_t, int8x16_t),
) {
    let nb = wd.len();
    let nt = out.len();
    debug_assert!(nt <= TILE_TOKENS && wq.len() == nb * bytes);
    debug_assert!(xq.len() == nt * nb * QK && xd.len() == nt * nb);
    let mut acc = [[0.0f32; LANES]; TILE_TOKENS];
    for b in 0..nb {
        // SAFETY: block b is inside the row and inside every token (lengths above).
        unsafe {
            let (w0, w1) = load(wq.as_ptr().add(b * bytes));
            for (t, acc_t) in acc.iter_mut().enumerate().take(nt) {
                let s = isum(w0, w1, xq.as_ptr().add((t * nb + b) * QK));
                accumulate(acc_t, b, wd[b], xd[t * nb + b], s);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = reduce_lanes(a);
    }
}

/// Q8_0 tile kernel (see `table::TileFn`).
///
/// # Safety
/// Slice lengths as `TileFn` says (NEON is always present on aarch64).
pub unsafe fn tile_q8(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Neon, Op::Tile);
    for_rows(rows, wq, wd, out, |wq, wd, out| {
        // SAFETY: forwarded caller contract.
        unsafe { tile(wq, wd, x.q, x.d, out, QK, load_q8) }
    });
}

/// Q4_0 tile kernel (see `table::TileFn`).
///
/// # Safety
/// Slice lengths as `TileFn` says (NEON is always present on aarch64).
pub unsafe fn tile_q4(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]) {
    count(Tier::Neon, Op::Tile);
    for_rows(rows, wq, wd, out, |wq, wd, out| {
        // SAFETY: forwarded caller contract.
        unsafe { tile(wq, wd, x.q, x.d, out, QK / 2, load_q4) }
    });
}
