//! Micro-kernels for packed weights ([`crate::kernels::packed`]). AVX-512 VNNI (Q8_0 and
//! Q4_0): one zmm lane per row of a 16-row group, so `isum_b` of 16 rows comes out of 8
//! `vpdpbusd` per block and token with no reduction across lanes. AVX2 (Q4_0 only, for
//! the AVX2 and AVX-512 BW tiers): the same with a ymm per half group, below.
//!
//! Per block and token: the accumulator starts at the offset correction (`−128·Σx` for
//! Q8_0, whose packed levels are `w + 128`; `−8·Σx` for Q4_0 nibbles), `vpdpbusd` adds
//! the 8 groups of 4 products with the activation bytes broadcast from memory, and the
//! float step is the contract's `acc += (dw·dx)·isum` on 16 rows at once. One lane's
//! accumulator runs over its blocks (b ≡ l mod 8, in order, which is how the packed
//! buffer stores them) before the next lane's; the 8 lane results are then combined by
//! the contract's tree. Exactness: `|Σ (w+128)·x| ≤ 32·255·127 < 2^31`.

use core::arch::x86_64::*;

use crate::kernels::counters::{count, Op};
use crate::kernels::packed::{block_bytes, lane_start, PackedView, GROUP};
use crate::kernels::{ActTile, Tier, WType, LANES, PACKED_TILE};
use crate::quant::QK;

/// How far ahead a decode call (one token) prefetches the weights it streams: with the
/// hardware prefetcher alone, generation was 30-40% slower (alternating runs of Gemma 3
/// and SmolLM2 at Q4_0; docs/kernels.md). Prefill calls reuse cached weights and skip it.
const PF_DIST: usize = 4096;

/// Prefetches the `bytes` (whole lines) that follow `p + PF_DIST`.
#[inline(always)]
pub(super) unsafe fn prefetch(p: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch never faults, even past the end of the buffer.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PF_DIST + line) as *const i8) };
    }
}

/// The contract's tree over the 8 lanes, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 +
/// l7))`, with `$lane(l)` run just before its pair needs it. A macro, not a function
/// taking closures: the lanes must inline into the `#[target_feature]` kernels.
macro_rules! lane_tree {
    ($lane:expr, $add:expr) => {{
        let (ln, add) = (&$lane, &$add);
        let h0 = add(add(ln(0), ln(4)), add(ln(2), ln(6)));
        let h1 = add(add(ln(1), ln(5)), add(ln(3), ln(7)));
        add(h0, h1)
    }};
}
pub(super) use lane_tree;

/// A vector width of the packed kernels: a zmm holds a group's 16 rows, a ymm half a
/// group (8 rows, at byte offset `16·h` of f16 scales and `32·h` of each quant chunk).
/// The shared pieces below are generic over it; each method is one instruction (or a
/// fixed pair), so a kernel gets the same instructions as if it named them itself.
pub(super) trait Width {
    /// `ROWS` f32 lanes.
    type F: Copy;
    /// `4·ROWS` bytes / `ROWS` i32 lanes.
    type I: Copy;
    /// Rows per vector.
    const ROWS: usize;
    /// # Safety (every method)
    /// The CPU has the width's features (AVX-512 F/BW for zmm, AVX2 and F16C for ymm)
    /// and the caller is compiled with them; pointers have the bytes read.
    unsafe fn zero_f() -> Self::F;
    unsafe fn zero_i() -> Self::I;
    /// The quant bytes of the rows at `p` (zmm: a 64-byte aligned chunk).
    unsafe fn load_q(p: *const u8) -> Self::I;
    unsafe fn splat8(v: i8) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    /// `a | (b & m)`.
    unsafe fn or_and(a: Self::I, b: Self::I, m: Self::I) -> Self::I;
    /// 16-bit lanes shifted left by `N` (1 to 4).
    unsafe fn slli<const N: i32>(a: Self::I) -> Self::I;
    /// 16-bit lanes shifted right (logical) by `N` (1 to 4).
    unsafe fn srli<const N: i32>(a: Self::I) -> Self::I;
    /// `ROWS` f16 at `p` as f32.
    unsafe fn h16(p: *const u8) -> Self::F;
    /// `ROWS` u8 at `p` as f32.
    unsafe fn u8_f32(p: *const u8) -> Self::F;
    /// `ROWS` i8 at `p` as i32.
    unsafe fn i8_i32(p: *const u8) -> Self::I;
    unsafe fn splat(v: f32) -> Self::F;
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// i32 lanes as f32.
    unsafe fn cvt(a: Self::I) -> Self::F;
    /// `−a` (the sign bit flipped).
    unsafe fn neg(a: Self::F) -> Self::F;
}

/// zmm: a whole group.
pub(super) struct Z;
/// ymm: half a group.
pub(super) struct Y;

/// The [`Width`] methods that are one intrinsic of the width (register-only), from
/// the intrinsics' names: the two impls differ in nothing else there.
macro_rules! simple_ops {
    ($f:ty, $i:ty; $zero_f:ident, $zero_i:ident, $set1_8:ident, $and:ident, $or:ident,
     $set1:ident, $add:ident, $mul:ident, $cvt:ident) => {
        #[inline(always)]
        unsafe fn zero_f() -> $f {
            // SAFETY: register-only (the trait contract); likewise below.
            unsafe { $zero_f() }
        }
        #[inline(always)]
        unsafe fn zero_i() -> $i {
            // SAFETY: the trait contract.
            unsafe { $zero_i() }
        }
        #[inline(always)]
        unsafe fn splat8(v: i8) -> $i {
            // SAFETY: the trait contract.
            unsafe { $set1_8(v) }
        }
        #[inline(always)]
        unsafe fn and(a: $i, b: $i) -> $i {
            // SAFETY: the trait contract.
            unsafe { $and(a, b) }
        }
        #[inline(always)]
        unsafe fn or_and(a: $i, b: $i, m: $i) -> $i {
            // SAFETY: the trait contract.
            unsafe { $or(a, $and(b, m)) }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> $f {
            // SAFETY: the trait contract.
            unsafe { $set1(v) }
        }
        #[inline(always)]
        unsafe fn add(a: $f, b: $f) -> $f {
            // SAFETY: the trait contract.
            unsafe { $add(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: $f, b: $f) -> $f {
            // SAFETY: the trait contract.
            unsafe { $mul(a, b) }
        }
        #[inline(always)]
        unsafe fn cvt(a: $i) -> $f {
            // SAFETY: the trait contract.
            unsafe { $cvt(a) }
        }
    };
}

impl Width for Z {
    type F = __m512;
    type I = __m512i;
    const ROWS: usize = GROUP;
    simple_ops!(
        __m512, __m512i; _mm512_setzero_ps, _mm512_setzero_si512, _mm512_set1_epi8,
        _mm512_and_si512, _mm512_or_si512, _mm512_set1_ps, _mm512_add_ps, _mm512_mul_ps,
        _mm512_cvtepi32_ps
    );
    #[inline(always)]
    unsafe fn load_q(p: *const u8) -> __m512i {
        // SAFETY: 64 readable bytes, 64-aligned (the packed layout; trait contract).
        unsafe { _mm512_load_si512(p as *const _) }
    }
    #[inline(always)]
    unsafe fn slli<const N: i32>(a: __m512i) -> __m512i {
        // SAFETY: the trait contract. The AVX-512 intrinsic counts in u32: one arm per
        // count, chosen at compile time.
        unsafe {
            match N {
                1 => _mm512_slli_epi16::<1>(a),
                2 => _mm512_slli_epi16::<2>(a),
                3 => _mm512_slli_epi16::<3>(a),
                4 => _mm512_slli_epi16::<4>(a),
                _ => unreachable!("shift count"),
            }
        }
    }
    #[inline(always)]
    unsafe fn srli<const N: i32>(a: __m512i) -> __m512i {
        // SAFETY: as for `slli`.
        unsafe {
            match N {
                1 => _mm512_srli_epi16::<1>(a),
                2 => _mm512_srli_epi16::<2>(a),
                3 => _mm512_srli_epi16::<3>(a),
                4 => _mm512_srli_epi16::<4>(a),
                _ => unreachable!("shift count"),
            }
        }
    }
    #[inline(always)]
    unsafe fn h16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes (the trait contract).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn u8_f32(p: *const u8) -> __m512 {
        // SAFETY: 16 readable bytes (the trait contract).
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }
    #[inline(always)]
    unsafe fn i8_i32(p: *const u8) -> __m512i {
        // SAFETY: 16 readable bytes (the trait contract).
        unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn neg(a: __m512) -> __m512 {
        // SAFETY: the trait contract. An integer xor: `vxorps` on zmm needs AVX-512 DQ.
        unsafe {
            let neg = _mm512_set1_ps(-0.0);
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(a),
                _mm512_castps_si512(neg),
            ))
        }
    }
}

impl Width for Y {
    type F = __m256;
    type I = __m256i;
    const ROWS: usize = 8;
    simple_ops!(
        __m256, __m256i; _mm256_setzero_ps, _mm256_setzero_si256, _mm256_set1_epi8,
        _mm256_and_si256, _mm256_or_si256, _mm256_set1_ps, _mm256_add_ps, _mm256_mul_ps,
        _mm256_cvtepi32_ps
    );
    #[inline(always)]
    unsafe fn load_q(p: *const u8) -> __m256i {
        // SAFETY: 32 readable bytes (the trait contract).
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn slli<const N: i32>(a: __m256i) -> __m256i {
        // SAFETY: the trait contract.
        unsafe { _mm256_slli_epi16::<N>(a) }
    }
    #[inline(always)]
    unsafe fn srli<const N: i32>(a: __m256i) -> __m256i {
        // SAFETY: the trait contract.
        unsafe { _mm256_srli_epi16::<N>(a) }
    }
    #[inline(always)]
    unsafe fn h16(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes (the trait contract).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn u8_f32(p: *const u8) -> __m256 {
        // SAFETY: 8 readable bytes (the trait contract).
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }
    #[inline(always)]
    unsafe fn i8_i32(p: *const u8) -> __m256i {
        // SAFETY: 8 readable bytes (the trait contract).
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn neg(a: __m256) -> __m256 {
        // SAFETY: the trait contract.
        unsafe { _mm256_xor_ps(a, _mm256_set1_ps(-0.0)) }
    }
}

/// The low and high nibbles of the 4 quant chunks at `wp` (64 bytes apart): `lo[k]`
/// pairs with activation bytes `4k..4k+4`, `hi[k]` with `16+4k..`.
#[inline(always)]
pub(super) unsafe fn nibbles<V: Width>(wp: *const u8) -> ([V::I; 4], [V::I; 4]) {
    // SAFETY: the 4 chunks are readable (the caller's contract).
    unsafe {
        let m4 = V::splat8(0x0F);
        let zero = V::zero_i();
        let (mut lo, mut hi) = ([zero; 4], [zero; 4]);
        for k in 0..4 {
            let v = V::load_q(wp.add(64 * k));
            lo[k] = V::and(v, m4);
            hi[k] = V::and(V::srli::<4>(v), m4);
        }
        (lo, hi)
    }
}

/// The contract's float step of one block and token on a vector of rows: `acc +
/// (dw·dx)·isum`, plus `mw·(dx·s)` when `affine` (a constant of the block type;
/// `s` the block's activation sum).
#[inline(always)]
pub(super) unsafe fn float_step<V: Width>(
    affine: bool,
    acc: V::F,
    dw: V::F,
    mw: V::F,
    isum: V::I,
    dx: f32,
    s: i32,
) -> V::F {
    // SAFETY: register-only (the `Width` contract).
    unsafe {
        let d = V::mul(dw, V::splat(dx));
        let mut term = V::mul(d, V::cvt(isum));
        if affine {
            let xsum = V::splat(dx * s as f32);
            term = V::add(term, V::mul(mw, xsum));
        }
        V::add(acc, term)
    }
}

/// Lane `l`'s accumulators for `T` tokens: blocks `l, l + 8, …` of one group, which the
/// packed buffer stores from block position `pos` on. All zero when `l ≥ nb`.
#[inline(always)]
unsafe fn lane<const IS_Q4: bool, const F16: bool, const T: usize>(
    qg: *const u8,
    sg: *const u8,
    x: &ActTile,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    let cols = nb * QK;
    let bb = block_bytes(if IS_Q4 { WType::Q4_0 } else { WType::Q8_0 });
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `group`): blocks of this group and T tokens.
    unsafe {
        let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
        let mut acc = [_mm512_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = qg.add(pos * bb);
            if T == 1 {
                prefetch(wp, bb);
            }
            let dw = if F16 {
                Z::h16(sg.add(pos * 32))
            } else {
                _mm512_loadu_ps(sg.add(pos * 64) as *const f32)
            };
            // The block's 16 rows as u8 vectors: lo[k] pairs with x[4k..4k+4] and
            // hi[k] with x[16+4k..] (Q4: low and high nibbles of chunk k; Q8: chunks).
            let (lo, hi) = if IS_Q4 {
                nibbles::<Z>(wp)
            } else {
                let (mut lo, mut hi) = ([Z::zero_i(); 4], [Z::zero_i(); 4]);
                for (k, v) in lo.iter_mut().enumerate() {
                    *v = Z::load_q(wp.add(64 * k));
                }
                for (k, v) in hi.iter_mut().enumerate() {
                    *v = Z::load_q(wp.add(64 * (4 + k)));
                }
                (lo, hi)
            };
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add(t * cols + b * QK) as *const i32;
                let s = *xs.add(t * nb + b);
                let corr = if IS_Q4 { -8 * s } else { -128 * s };
                let (i0, i1) = dot_chains(corr, 0, &lo, &hi, xb);
                let isum = _mm512_add_epi32(i0, i1);
                let dx = *xd.add(t * nb + b);
                *acc_t = float_step::<Z>(false, *acc_t, dw, dw, isum, dx, s);
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// `Σ lo·x` and `Σ hi·x` of one block and token (`x` at `xb`), started at `c0` and
/// `c1`: two chains of 4 `vpdpbusd`, which also halve the dependent latency.
#[inline(always)]
pub(super) unsafe fn dot_chains(
    c0: i32,
    c1: i32,
    lo: &[__m512i; 4],
    hi: &[__m512i; 4],
    xb: *const i32,
) -> (__m512i, __m512i) {
    // SAFETY: the block's 32 activation bytes at `xb` (the caller's contract);
    // AVX-512 VNNI in the caller.
    unsafe {
        let mut i0 = _mm512_set1_epi32(c0);
        let mut i1 = _mm512_set1_epi32(c1);
        for k in 0..4 {
            let x0 = _mm512_set1_epi32(xb.add(k).read_unaligned());
            let x1 = _mm512_set1_epi32(xb.add(4 + k).read_unaligned());
            i0 = _mm512_dpbusd_epi32(i0, lo[k], x0);
            i1 = _mm512_dpbusd_epi32(i1, hi[k], x1);
        }
        (i0, i1)
    }
}

/// `a[t] + b[t]` for every token.
#[inline(always)]
pub(super) fn add512<const T: usize>(a: [__m512; T], b: [__m512; T]) -> [__m512; T] {
    // SAFETY: register-only AVX-512 F op; every caller is compiled with it.
    std::array::from_fn(|t| unsafe { _mm512_add_ps(a[t], b[t]) })
}

/// `a[t] + b[t]` for every token.
#[inline(always)]
pub(super) fn add256<const T: usize>(a: [__m256; T], b: [__m256; T]) -> [__m256; T] {
    // SAFETY: register-only AVX op; every caller is compiled with AVX2.
    std::array::from_fn(|t| unsafe { _mm256_add_ps(a[t], b[t]) })
}

/// Stores group `g`'s 16 rows for `T` tokens, `y[t·ld + 16g + j]`, real rows only.
///
/// # Safety
/// AVX-512 F; `y` has room for `T` rows of `ld ≥ rows` outputs.
#[inline(always)]
pub(super) unsafe fn store16<const T: usize>(
    r: &[__m512; T],
    rows: usize,
    g: usize,
    y: *mut f32,
    ld: usize,
) {
    let r0 = g * GROUP;
    let valid = (rows - r0).min(GROUP);
    let mask: __mmask16 = if valid == GROUP {
        !0
    } else {
        (1u16 << valid) - 1
    };
    for (t, v) in r.iter().enumerate() {
        // SAFETY: the caller's contract; masked-off rows are not written.
        unsafe { _mm512_mask_storeu_ps(y.add(t * ld + r0), mask, *v) };
    }
}

/// Stores half group rows `r0..r0 + 8` for tokens `t0..t0 + T`, real rows only.
///
/// # Safety
/// AVX; `r0 < rows`; `y` has room for the tokens' rows of `ld ≥ rows` outputs.
#[inline(always)]
pub(super) unsafe fn store8<const T: usize>(
    r: &[__m256; T],
    rows: usize,
    r0: usize,
    t0: usize,
    y: *mut f32,
    ld: usize,
) {
    let valid = (rows - r0).min(8);
    for (i, v) in r.iter().enumerate() {
        // SAFETY: the caller's contract; only the `valid` real rows are written.
        unsafe {
            let out = y.add((t0 + i) * ld + r0);
            if valid == 8 {
                _mm256_storeu_ps(out, *v);
            } else {
                let mut tmp = [0f32; 8];
                _mm256_storeu_ps(tmp.as_mut_ptr(), *v);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, valid);
            }
        }
    }
}

/// A packed kernel's work on group `g` for tokens `t0..t0 + T`; `T` is a const, so
/// each token count gets its own inlined copy. The drivers below choose `T`.
pub(super) trait GroupFn {
    /// # Safety
    /// `g < groups`, tokens `t0..t0 + T` exist: the kernel's caller contract.
    unsafe fn group<const T: usize>(&self, g: usize, t0: usize);
}

/// Groups `g0..g1` against all `nt ≤ 8` tokens at once (the zmm kernels).
///
/// # Safety
/// The kernel's caller contract, for `nt` tokens.
#[inline(always)]
pub(super) unsafe fn all_tokens<K: GroupFn>(k: &K, g0: usize, g1: usize, nt: usize) {
    debug_assert!((1..=PACKED_TILE).contains(&nt));
    macro_rules! go {
        ($t:literal) => {
            for g in g0..g1 {
                // SAFETY: forwarded caller contract.
                unsafe { k.group::<$t>(g, 0) }
            }
        };
    }
    match nt {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        4 => go!(4),
        5 => go!(5),
        6 => go!(6),
        7 => go!(7),
        _ => go!(8),
    }
}

/// Most tokens per inner pass of the ymm kernels: 8 weight vectors and 4 accumulators
/// in 16 ymm.
const PASS: usize = 4;

/// Groups `g0..g1`, each against all `nt` tokens in passes of at most [`PASS`] (the
/// ymm kernels).
///
/// # Safety
/// The kernel's caller contract, for `nt` tokens.
#[inline(always)]
pub(super) unsafe fn token_passes<K: GroupFn>(k: &K, g0: usize, g1: usize, nt: usize) {
    for g in g0..g1 {
        let mut t0 = 0;
        while t0 < nt {
            let n = (nt - t0).min(PASS);
            // SAFETY: forwarded caller contract; tokens t0..t0 + n exist.
            unsafe {
                match n {
                    1 => k.group::<1>(g, t0),
                    2 => k.group::<2>(g, t0),
                    3 => k.group::<3>(g, t0),
                    _ => k.group::<4>(g, t0),
                }
            }
            t0 += n;
        }
    }
}

/// A Q8_0 or Q4_0 packed view with its tokens and outputs.
struct Job<'a, const IS_Q4: bool, const F16: bool> {
    p: &'a PackedView<'a>,
    x: &'a ActTile<'a>,
    y: *mut f32,
    ld: usize,
}

impl<const IS_Q4: bool, const F16: bool> Job<'_, IS_Q4, F16> {
    /// Group `g`'s quants and scales.
    ///
    /// # Safety
    /// `g < groups`.
    #[inline(always)]
    unsafe fn at(&self, g: usize) -> (*const u8, *const u8) {
        let nb = self.p.nb;
        let bb = block_bytes(if IS_Q4 { WType::Q4_0 } else { WType::Q8_0 });
        let ss = if F16 { 2 } else { 4 };
        // SAFETY: group g's records are inside both regions (the caller's contract).
        unsafe {
            (
                self.p.q.as_ptr().add(g * nb * bb),
                self.p.s.as_ptr().add(g * nb * GROUP * ss),
            )
        }
    }
}

/// The AVX2 kernel's job: the same fields, the ymm group function.
struct Avx2Job<'a, const F16: bool>(Job<'a, true, F16>);

/// VNNI: one group of 16 rows, the lanes combined by `lane_tree!`.
impl<const IS_Q4: bool, const F16: bool> GroupFn for Job<'_, IS_Q4, F16> {
    #[inline(always)]
    unsafe fn group<const T: usize>(&self, g: usize, _t0: usize) {
        let (x, nb) = (self.x, self.p.nb);
        // SAFETY: the caller guarantees g < groups, `x` holds T tokens of nb blocks, and
        // y has room for T rows of ld ≥ rows outputs; every pointer stays inside those.
        unsafe {
            let (qg, sg) = self.at(g);
            let r = lane_tree!(|l: usize| lane::<IS_Q4, F16, T>(qg, sg, x, nb, l), add512);
            store16(&r, self.p.rows, g, self.y, self.ld);
        }
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
    debug_assert!(x.q.len() == nt * p.nb * QK && x.s.len() == nt * p.nb);
    // SAFETY: forwarded caller contract.
    unsafe {
        if p.f16 {
            all_tokens(&Job::<IS_Q4, true> { p, x, y, ld }, g0, g1, nt)
        } else {
            all_tokens(&Job::<IS_Q4, false> { p, x, y, ld }, g0, g1, nt)
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
    count(Tier::Avx512Vnni, Op::Packed);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { any::<false>(p, g0, g1, x, y, ld) }
}

/// Packed Q4_0, AVX-512 VNNI (see `kernels::PackedFn`).
///
/// # Safety
/// As [`q8_vnni`], for a Q4_0 packed view.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
pub unsafe fn q4_vnni(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx512Vnni, Op::Packed);
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe { any::<true>(p, g0, g1, x, y, ld) }
}

/// The AVX2 packed kernel: Q4_0 (F16C for f16 scales).
pub fn has_avx2_packed() -> bool {
    super::has_avx2() && is_x86_feature_detected!("f16c")
}

/// AVX2, Q4_0: a group as two halves of 8 rows (a ymm lane per row). Per block, half
/// and token: 8 `vpmaddubsw` of the nibbles (u8) with the broadcast activation bytes
/// (s8), summed in i16, which is exact: each lane adds 16 products of at most 15·127,
/// ≤ 30480 < 2^15; one `vpmaddwd` by 1 gives the row's `Σ nibble·x`, then `− 8·Σx`.
/// The float step and the lane order are the VNNI kernel's.
mod avx2q4 {
    use super::*;

    /// Lane `l` of half `h` of one group for `T` tokens (see [`super::lane`]).
    #[inline(always)]
    unsafe fn lane<const F16: bool, const T: usize>(
        qg: *const u8,
        sg: *const u8,
        x: &ActTile,
        t0: usize,
        nb: usize,
        h: usize,
        l: usize,
    ) -> [__m256; T] {
        let cols = nb * QK;
        let bb = block_bytes(WType::Q4_0);
        let mut pos = lane_start(nb, l);
        // SAFETY: the caller's contract (see `group`): blocks of this group, tokens
        // t0..t0 + T of `x`.
        unsafe {
            let (xq, xd, xs) = (x.q.as_ptr(), x.d.as_ptr(), x.s.as_ptr());
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); T];
            let mut b = l;
            while b < nb {
                let wp = qg.add(pos * bb + 32 * h);
                if T == 1 && h == 0 {
                    // The first half's pass reads every line of the block.
                    prefetch(wp, bb);
                }
                let dw = if F16 {
                    Y::h16(sg.add(pos * 32 + 16 * h))
                } else {
                    _mm256_loadu_ps(sg.add(pos * 64 + 32 * h) as *const f32)
                };
                let (lo, hi) = nibbles::<Y>(wp);
                let w = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                for (i, acc_t) in acc.iter_mut().enumerate() {
                    let t = t0 + i;
                    let xb = xq.add(t * cols + b * QK) as *const i32;
                    let mut s16 = _mm256_setzero_si256();
                    for (k, wk) in w.iter().enumerate() {
                        let xv = _mm256_set1_epi32(xb.add(k).read_unaligned());
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wk, xv));
                    }
                    let s = *xs.add(t * nb + b);
                    let corr = _mm256_set1_epi32(-8 * s);
                    let isum = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), corr);
                    let dx = *xd.add(t * nb + b);
                    *acc_t = float_step::<Y>(false, *acc_t, dw, dw, isum, dx, s);
                }
                pos += 1;
                b += LANES;
            }
            acc
        }
    }

    /// Tokens `t0..t0 + T` of group `g`, both halves.
    impl<const F16: bool> GroupFn for Avx2Job<'_, F16> {
        #[inline(always)]
        unsafe fn group<const T: usize>(&self, g: usize, t0: usize) {
            let (p, x) = (self.0.p, self.0.x);
            // SAFETY: as in `Job::group`, for tokens t0..t0 + T.
            unsafe {
                let (qg, sg) = self.0.at(g);
                for h in 0..2 {
                    let r0 = g * GROUP + 8 * h;
                    if r0 >= p.rows {
                        break;
                    }
                    let r =
                        lane_tree!(|l: usize| lane::<F16, T>(qg, sg, x, t0, p.nb, h, l), add256);
                    store8(&r, p.rows, r0, t0, self.0.y, self.0.ld);
                }
            }
        }
    }
}

/// Packed Q4_0, AVX2 (see `kernels::PackedFn`).
///
/// # Safety
/// The CPU has AVX2 and F16C; otherwise as [`q8_vnni`], for a Q4_0 packed view.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q4_avx2(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx2, Op::Packed);
    debug_assert!(x.q.len() == x.d.len() * QK && x.s.len() == x.d.len());
    let nt = x.d.len() / p.nb;
    // SAFETY: forwarded caller contract; features enabled on this function.
    unsafe {
        if p.f16 {
            token_passes(&Avx2Job(Job::<true, true> { p, x, y, ld }), g0, g1, nt)
        } else {
            token_passes(&Avx2Job(Job::<true, false> { p, x, y, ld }), g0, g1, nt)
        }
    }
}
