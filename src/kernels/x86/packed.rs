//! Micro-kernels for packed weights ([`crate::kernels::packed`]), AVX-512 VNNI: one zmm
//! lane per row of a 16-row group, so `isum_b` of 16 rows comes out of 8 `vpdpbusd` per
//! block and token with no reduction across lanes.
//!
//! Per block and token: the accumulator starts at the offset correction (`−128·Σx` for
//! Q8_0, whose packed levels are `w + 128`; `−8·Σx` for Q4_0 nibbles), `vpdpbusd` adds
//! the 8 groups of 4 products with the activation bytes broadcast from memory, and the
//! float step is the contract's `acc += (dw·dx)·isum` on 16 rows at once. One lane's
//! accumulator runs over its blocks (b ≡ l mod 8, in order, which is how the packed
//! buffer stores them) before the next lane's; the 8 lane results are then combined by
//! the contract's tree. Exactness: `|Σ (w+128)·x| ≤ 32·255·127 < 2^31`.

use core::arch::x86_64::*;

use crate::kernels::packed::{block_bytes, PackedView, GROUP};
use crate::kernels::{ActTile, WType, LANES};
use crate::quant::QK;

/// Most tokens per call: the accumulators and the block's weights stay in registers.
pub const TILE: usize = 8;

/// One group of 16 rows against `T` tokens; writes `y[t·ld + 16g + j]` for real rows.
#[inline(always)]
unsafe fn group<const IS_Q4: bool, const F16: bool, const T: usize>(
    p: &PackedView,
    g: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    let nb = p.nb;
    let cols = nb * QK;
    let bb = block_bytes(if IS_Q4 { WType::Q4_0 } else { WType::Q8_0 });
    let ss = if F16 { 2 } else { 4 };
    // SAFETY: the caller guarantees g < groups, `x` holds T tokens of nb blocks, and y
    // has room for T rows of ld ≥ rows outputs; every pointer below stays inside those.
    unsafe {
        let qg = p.q.as_ptr().add(g * nb * bb);
        let sg = p.s.as_ptr().add(g * nb * GROUP * ss);
        let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
        let zero = _mm512_setzero_ps();
        let mut lanes = [[zero; T]; LANES];
        let mut pos = 0;
        for (l, lane) in lanes.iter_mut().enumerate().take(nb) {
            let mut acc = [zero; T];
            let mut b = l;
            while b < nb {
                let wp = qg.add(pos * bb);
                let dw = if F16 {
                    _mm512_cvtph_ps(_mm256_loadu_si256(sg.add(pos * 32) as *const __m256i))
                } else {
                    _mm512_loadu_ps(sg.add(pos * 64) as *const f32)
                };
                // The block's 16 rows as u8 vectors: chunk k pairs with x[4k..4k+4].
                let mut w = [_mm512_setzero_si512(); 8];
                if IS_Q4 {
                    let m = _mm512_set1_epi8(0x0F);
                    for k in 0..4 {
                        let v = _mm512_load_si512(wp.add(64 * k) as *const _);
                        w[k] = _mm512_and_si512(v, m);
                        w[4 + k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
                    }
                } else {
                    for (k, wk) in w.iter_mut().enumerate() {
                        *wk = _mm512_load_si512(wp.add(64 * k) as *const _);
                    }
                }
                for (t, acc_t) in acc.iter_mut().enumerate() {
                    let xb = xq.add(t * cols + b * QK) as *const i32;
                    let s = *xs.add(t * nb + b);
                    let corr = if IS_Q4 { -8 * s } else { -128 * s };
                    // Two chains of 4 halve the dependent `vpdpbusd` latency.
                    let mut i0 = _mm512_set1_epi32(corr);
                    let mut i1 = _mm512_setzero_si512();
                    for k in 0..4 {
                        // Q4: w[k] (low nibbles) are elements 4k.., w[4+k] are 16+4k...
                        // Q8: w[k] are elements 4k.., w[4+k] are 16+4k.. too.
                        let x0 = _mm512_set1_epi32(xb.add(k).read_unaligned());
                        let x1 = _mm512_set1_epi32(xb.add(4 + k).read_unaligned());
                        i0 = _mm512_dpbusd_epi32(i0, w[k], x0);
                        i1 = _mm512_dpbusd_epi32(i1, w[4 + k], x1);
                    }
                    let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(t * nb + b)));
                    *acc_t = _mm512_add_ps(*acc_t, _mm512_mul_ps(d, isum));
                }
                pos += 1;
                b += LANES;
            }
            *lane = acc;
        }
        let r0 = g * GROUP;
        let valid = (p.rows - r0).min(GROUP);
        let mask: __mmask16 = if valid == GROUP {
            !0
        } else {
            (1u16 << valid) - 1
        };
        #[allow(clippy::needless_range_loop)] // t indexes the inner arrays of `lanes`
        for t in 0..T {
            let a = |l: usize| lanes[l][t];
            let h0 = _mm512_add_ps(_mm512_add_ps(a(0), a(4)), _mm512_add_ps(a(2), a(6)));
            let h1 = _mm512_add_ps(_mm512_add_ps(a(1), a(5)), _mm512_add_ps(a(3), a(7)));
            _mm512_mask_storeu_ps(y.add(t * ld + r0), mask, _mm512_add_ps(h0, h1));
        }
    }
}

/// Groups `g0..g1` for `T` tokens.
#[inline(always)]
unsafe fn groups<const IS_Q4: bool, const F16: bool, const T: usize>(
    p: &PackedView,
    g0: usize,
    g1: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    for g in g0..g1 {
        // SAFETY: forwarded caller contract.
        unsafe { group::<IS_Q4, F16, T>(p, g, x, y, ld) }
    }
}

/// Token-count and scale-type dispatch.
#[inline(always)]
unsafe fn any<const IS_Q4: bool>(
    p: &PackedView,
    g0: usize,
    g1: usize,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    let nt = x.d.len() / p.nb;
    debug_assert!((1..=TILE).contains(&nt));
    debug_assert!(x.q.len() == nt * p.nb * QK && x.s.len() == nt * p.nb);
    macro_rules! go {
        ($f16:literal) => {
            match nt {
                1 => groups::<IS_Q4, $f16, 1>(p, g0, g1, x, y, ld),
                2 => groups::<IS_Q4, $f16, 2>(p, g0, g1, x, y, ld),
                3 => groups::<IS_Q4, $f16, 3>(p, g0, g1, x, y, ld),
                4 => groups::<IS_Q4, $f16, 4>(p, g0, g1, x, y, ld),
                5 => groups::<IS_Q4, $f16, 5>(p, g0, g1, x, y, ld),
                6 => groups::<IS_Q4, $f16, 6>(p, g0, g1, x, y, ld),
                7 => groups::<IS_Q4, $f16, 7>(p, g0, g1, x, y, ld),
                _ => groups::<IS_Q4, $f16, 8>(p, g0, g1, x, y, ld),
            }
        };
    }
    // SAFETY: forwarded caller contract.
    unsafe {
        if p.f16 {
            go!(true)
        } else {
            go!(false)
        }
    }
}

/// Packed Q8_0, AVX-512 VNNI (see `kernels::PackedFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI; `p` is a Q8_0 packed view, `g0 ≤ g1 ≤
/// groups`, `x` holds 1..=8 tokens of `p.nb` blocks, `y[t·ld + r]` is writable for
/// every token `t` and row `r < p.rows` of the groups.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn q8_vnni(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { any::<false>(p, g0, g1, x, y, ld) }
}

/// Packed Q4_0, AVX-512 VNNI (see `kernels::PackedFn`).
///
/// # Safety
/// As [`q8_vnni`], for a Q4_0 packed view.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn q4_vnni(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { any::<true>(p, g0, g1, x, y, ld) }
}
