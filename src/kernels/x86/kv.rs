//! Attention over f16 and Q8_0 KV caches (`scalar::kv`): the kernels of
//! `x86::attention`, reading rows that are widened to f32 as they are loaded into a
//! register, exactly as the reference widens them, so every tier gives the reference's
//! bits and only the cache's rounding at storage differs from an f32 cache.
//!
//! * f16: `vcvtph2ps` (F16C, or its zmm form in AVX-512 F): exact, as the reference's
//!   software conversion (stored NaNs are quiet, so both read them back alike).
//! * Q8_0: the quants sign-extended to i32 (`vpmovsxbd`), converted (`vcvtdq2ps`,
//!   exact) and multiplied by the block's scale: `q · d`, one rounded multiply, as
//!   `quant::dequant_row`. A head's values are whole blocks (the cache pads a head to a
//!   multiple of 32), so 8 or 16 values at a multiple of 8 or 16 share one scale.

use std::arch::x86_64::*;

use super::attention::{attend_entry, attend_many, attend_one, head_size, Row, Rows, Src};
use super::simd::{f16x16, f16x8};
use crate::format::wtype::QK;
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::attention::{KvView, Query};
use crate::kernels::scalar::kv::{widen_f16, KvData};
use crate::kernels::tier::Tier;

/// A row of f16 bits.
#[derive(Clone, Copy)]
pub(crate) struct F16Row<'a>(&'a [u16]);

impl Row for F16Row<'_> {
    #[inline(always)]
    unsafe fn ld8(self, j: usize) -> __m256 {
        debug_assert!(j + 8 <= self.0.len());
        // SAFETY: j + 8 <= hd (the trait contract); F16C in the caller.
        unsafe { f16x8(self.0.as_ptr().add(j).cast()) }
    }
    #[inline(always)]
    unsafe fn ld16(self, j: usize) -> __m512 {
        debug_assert!(j + 16 <= self.0.len());
        // SAFETY: j + 16 <= hd (the trait contract); AVX-512 F in the caller.
        unsafe { f16x16(self.0.as_ptr().add(j).cast()) }
    }
    #[inline(always)]
    fn get(self, j: usize) -> f32 {
        widen_f16(self.0[j])
    }
}

/// A row of Q8_0 quants with its scales (one per 32 quants, the row starting a block).
#[derive(Clone, Copy)]
struct Q8Row<'a> {
    q: &'a [i8],
    d: &'a [f32],
}

/// Values `j..j + $n` of the [`Q8Row`] `$r` in the register of the width whose
/// intrinsics are given: the quants loaded by `$load`, sign-extended (`$cvt_i32`),
/// converted (`$cvt_ps`) and multiplied by their block's scale. A macro for
/// [`Row::ld8`] and [`Row::ld16`].
macro_rules! q8_load {
    ($r:expr, $j:expr, $n:literal, $load:ident, $cvt_i32:ident, $cvt_ps:ident, $mul:ident, $set1:ident) => {{
        let (r, j): (Q8Row, usize) = ($r, $j);
        debug_assert!(j + $n <= r.q.len() && j / QK < r.d.len());
        let b = $load(r.q.as_ptr().add(j) as *const __m128i);
        let x = $cvt_ps($cvt_i32(b));
        $mul(x, $set1(*r.d.get_unchecked(j / QK)))
    }};
}

impl Row for Q8Row<'_> {
    #[inline(always)]
    unsafe fn ld8(self, j: usize) -> __m256 {
        // SAFETY: j + 8 <= hd (the trait contract) and the row has a scale per 32 of
        // its values; AVX2 in the caller.
        unsafe {
            q8_load!(
                self,
                j,
                8,
                _mm_loadl_epi64,
                _mm256_cvtepi8_epi32,
                _mm256_cvtepi32_ps,
                _mm256_mul_ps,
                _mm256_set1_ps
            )
        }
    }
    #[inline(always)]
    unsafe fn ld16(self, j: usize) -> __m512 {
        // SAFETY: as `ld8` with j + 16 <= hd; AVX-512 F in the caller.
        unsafe {
            q8_load!(
                self,
                j,
                16,
                _mm_loadu_si128,
                _mm512_cvtepi8_epi32,
                _mm512_cvtepi32_ps,
                _mm512_mul_ps,
                _mm512_set1_ps
            )
        }
    }
    #[inline(always)]
    fn get(self, j: usize) -> f32 {
        self.q[j] as f32 * self.d[j / QK]
    }
}

impl<'a> Src for Rows<'a, u16> {
    type R = F16Row<'a>;
    #[inline(always)]
    fn row(self, slot: usize) -> F16Row<'a> {
        F16Row(self.slice(slot))
    }
}

/// The rows of one kv head of a Q8_0 cache: the quants' rows (`stride` and `off`
/// multiples of 32) and the scales of every array's block.
#[derive(Clone, Copy)]
struct Q8Src<'a> {
    q: Rows<'a, i8>,
    d: &'a [f32],
}

impl<'a> Src for Q8Src<'a> {
    type R = Q8Row<'a>;
    #[inline(always)]
    fn row(self, slot: usize) -> Q8Row<'a> {
        let b = self.q.start(slot) / QK;
        Q8Row {
            q: self.q.slice(slot),
            d: &self.d[b..b + self.q.hd.div_ceil(QK)],
        }
    }
}

/// The f16 kv head `kv` shows. Panics unless both arrays are f16.
#[inline(always)]
fn f16_srcs<'a>(kv: &KvView<'a>, hd: usize) -> (Rows<'a, u16>, Rows<'a, u16>) {
    let (KvData::F16(k), KvData::F16(v)) = (kv.k, kv.v) else {
        panic!("f16 attention on a {} cache", kv.k.kv_type());
    };
    Rows::pair(kv, k, v, hd)
}

/// The Q8_0 kv head `kv` shows. Panics unless both arrays are Q8_0.
#[inline(always)]
fn q8_srcs<'a>(kv: &KvView<'a>, hd: usize) -> (Q8Src<'a>, Q8Src<'a>) {
    let (KvData::Q8_0 { q: kq, d: kd }, KvData::Q8_0 { q: vq, d: vd }) = (kv.k, kv.v) else {
        panic!("Q8_0 attention on a {} cache", kv.k.kv_type());
    };
    let (qk, qv) = Rows::pair(kv, kq, vq, hd);
    (Q8Src { q: qk, d: kd }, Q8Src { q: qv, d: vd })
}

attend_entry!(
    /// The AVX2 tier's attention over an f16 cache (see `table::AttendFn`).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; the shapes as `Kernels::attend` checks them.
    attend_f16_avx2, Avx2, "avx2,f16c", f16_srcs, false, false
);

attend_entry!(
    /// The AVX-512 tiers' attention over an f16 cache.
    ///
    /// # Safety
    /// The CPU must support AVX2, AVX-512 F and F16C; the shapes as `Kernels::attend`
    /// checks them.
    attend_f16_avx512, Avx512, "avx2,avx512f,f16c", f16_srcs, true, true
);

attend_entry!(
    /// The AVX2 tier's attention over a Q8_0 cache.
    ///
    /// # Safety
    /// The CPU must support AVX2; the shapes as `Kernels::attend` checks them.
    attend_q8_avx2, Avx2, "avx2", q8_srcs, false, false
);

attend_entry!(
    /// The AVX-512 tiers' attention over a Q8_0 cache.
    ///
    /// # Safety
    /// The CPU must support AVX2, AVX-512 F and F16C; the shapes as `Kernels::attend`
    /// checks them.
    attend_q8_avx512, Avx512, "avx2,avx512f,f16c", q8_srcs, true, true
);
