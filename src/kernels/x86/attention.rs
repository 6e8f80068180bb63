//! AVX2 and AVX-512 F attention (`scalar::attention`'s arithmetic): the same f32
//! operations per output in the same order (no FMA), so the same bits. The speed comes
//! from the order of work: scores for eight keys at a time (eight add chains, reduced
//! together through an 8×8 transpose), the weighted values summed over all positions
//! in registers for 64 dimensions at a time (128 in zmm), and, for a tile of queries of
//! one kv head, blocks of 64 key and value rows streamed once for the whole tile. With
//! AVX-512 F, two queries of one position share a zmm for their scores (each half the
//! same 8-lane chain) and up to four sum their values together, one load of a row
//! serving all; a tile's softmax sums run eight queries side by side.
//!
//! The kernels read the cache's rows through [`Src`] / [`Row`]: f32 rows as they are,
//! f16 and Q8_0 rows (`x86::kv`) widened to f32 as they are loaded into a
//! register, with the reference's widening, so every cache type runs this same code.

use std::arch::x86_64::*;

use super::math::{exp_all, exp_all16, max_all};
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::attention::{
    softmax, softmax_exp, with_sink, KvView, Query, SoftmaxMath, TILE_QUERIES,
};
use crate::kernels::scalar::kv::KvData;
use crate::kernels::scalar::math::reduce8;
use crate::kernels::tier::Tier;

/// One cached row of a kv head (`hd` values) as the kernels load it: 8 or 16 values
/// into a register, or one value, each in f32 with the reference's widening.
pub(crate) trait Row: Copy {
    /// Values `j..j + 8` (a multiple of 8).
    ///
    /// # Safety
    /// `j + 8 <= hd`; the CPU has the features the row type needs (AVX2, and F16C for
    /// f16 rows), and the caller is compiled with them.
    unsafe fn ld8(self, j: usize) -> __m256;
    /// Values `j..j + 16` (a multiple of 16).
    ///
    /// # Safety
    /// As [`Row::ld8`] with `j + 16 <= hd`, and AVX-512 F.
    unsafe fn ld16(self, j: usize) -> __m512;
    /// Value `j < hd`.
    fn get(self, j: usize) -> f32;
}

/// Where a kv head's rows are: the row of a slot.
pub(crate) trait Src: Copy {
    type R: Row;
    fn row(self, slot: usize) -> Self::R;
}

/// An f32 row.
#[derive(Clone, Copy)]
pub(crate) struct F32Row<'a>(&'a [f32]);

impl Row for F32Row<'_> {
    #[inline(always)]
    unsafe fn ld8(self, j: usize) -> __m256 {
        debug_assert!(j + 8 <= self.0.len());
        // SAFETY: j + 8 <= hd (the trait contract).
        unsafe { _mm256_loadu_ps(self.0.as_ptr().add(j)) }
    }
    #[inline(always)]
    unsafe fn ld16(self, j: usize) -> __m512 {
        debug_assert!(j + 16 <= self.0.len());
        // SAFETY: j + 16 <= hd (the trait contract).
        unsafe { _mm512_loadu_ps(self.0.as_ptr().add(j)) }
    }
    #[inline(always)]
    fn get(self, j: usize) -> f32 {
        self.0[j]
    }
}

/// The rows of one kv head in one array of a cache: slot `s`'s row is the `hd` values
/// from `s·stride + off`. Of f32 (or f16 bits) it is the [`Src`] of its rows.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a, T> {
    x: &'a [T],
    stride: usize,
    off: usize,
    pub(crate) hd: usize,
}

impl<'a, T> Rows<'a, T> {
    /// The rows of the head `kv` shows (of `hd` values) in its arrays `k` and `v`.
    #[inline(always)]
    pub(crate) fn pair(kv: &KvView, k: &'a [T], v: &'a [T], hd: usize) -> (Self, Self) {
        let rows = |x| Rows {
            x,
            stride: kv.stride,
            off: kv.off,
            hd,
        };
        (rows(k), rows(v))
    }

    /// Where slot `slot`'s row starts.
    #[inline(always)]
    pub(crate) fn start(&self, slot: usize) -> usize {
        slot * self.stride + self.off
    }

    /// Slot `slot`'s row.
    #[inline(always)]
    pub(crate) fn slice(&self, slot: usize) -> &'a [T] {
        let at = self.start(slot);
        &self.x[at..at + self.hd]
    }
}

impl<'a> Src for Rows<'a, f32> {
    type R = F32Row<'a>;
    #[inline(always)]
    fn row(self, slot: usize) -> F32Row<'a> {
        F32Row(self.slice(slot))
    }
}

/// The kv head `kv` shows, as [`Src`]s of f32 rows.
///
/// Panics unless both arrays are f32.
#[inline(always)]
fn f32_srcs<'a>(kv: &KvView<'a>, hd: usize) -> (Rows<'a, f32>, Rows<'a, f32>) {
    let (KvData::F32(k), KvData::F32(v)) = (kv.k, kv.v) else {
        panic!("f32 attention on a {} cache", kv.k.kv_type());
    };
    Rows::pair(kv, k, v, hd)
}

/// The head size of a tile (every query has it; `Kernels::attend` checks).
#[inline(always)]
pub(crate) fn head_size(qs: &[Query]) -> usize {
    qs.first().map_or(0, |q| q.q.len())
}

/// An attention entry (see `table::AttendFn`) compiled with `$feat`: the tier's call
/// count, the cache's row sources from `$srcs`, then, with `PAIRS` and `WIDE` as given,
/// the tile blocked over positions ([`attend_many`]) when no query's positions wrap
/// around the cache's ring, else each query alone ([`attend_one`]).
macro_rules! attend_entry {
    ($(#[$doc:meta])* $name:ident, $tier:ident, $feat:literal, $srcs:ident, $pairs:literal, $wide:literal) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        pub unsafe fn $name(qs: &mut [Query], kv: &KvView, scale: f32, softcap: f32) {
            count(Tier::$tier, Op::Attend);
            let (ks, vs) = $srcs(kv, head_size(qs));
            // SAFETY: the CPU features are enabled on this function (its contract);
            // `attend_many` only when every position is below cap.
            unsafe {
                if qs.iter().all(|q| q.pos < kv.cap) {
                    attend_many::<$pairs, $wide, _>(qs, kv, ks, vs, scale, softcap)
                } else {
                    for q in qs {
                        attend_one::<$pairs, $wide, _>(q, kv, ks, vs, scale, softcap)
                    }
                }
            }
        }
    };
}
pub(super) use attend_entry;

attend_entry!(
    /// The AVX2 tier's attention entry (see `table::AttendFn`).
    ///
    /// # Safety
    /// The CPU must support AVX2; the shapes as `Kernels::attend` checks them.
    attend_avx2, Avx2, "avx2", f32_srcs, false, false
);

attend_entry!(
    /// The AVX-512 tiers' attention entry for f32 caches: query pairs for the scores, ymm
    /// value sums. Measured on Zen 5 (perf samples of 512-token prefills): zmm value sums
    /// took about 25% more attention time than ymm over f32 rows (SmolLM2), and the pairs
    /// 12% less than single queries (llama1b, 4 query heads per kv head); over f16 and Q8_0
    /// rows, which widen as they load, zmm sums were 10-20% faster, so `kv`'s entries
    /// keep them. Every order gives the contract's bits.
    ///
    /// # Safety
    /// The CPU must support AVX2 and AVX-512 F; the shapes as `Kernels::attend` checks them.
    attend_avx512, Avx512, "avx2,avx512f", f32_srcs, true, false
);

/// The slice maximum and `exp` of `x86::math` for `scalar::attention::softmax`: `exp` 16
/// lanes at a time when `Z` (AVX-512 F), else 8. Used only by [`softmax_ymm`] and
/// [`softmax_zmm`] (and their `_exp` forms), which are compiled with those features.
struct X86Math<const Z: bool>;

impl<const Z: bool> SoftmaxMath for X86Math<Z> {
    #[inline(always)]
    fn max(v: &[f32]) -> f32 {
        // SAFETY: only reached from `softmax_ymm` / `softmax_zmm` (AVX2).
        unsafe { max_all(v) }
    }

    #[inline(always)]
    fn exp(v: &mut [f32]) {
        // SAFETY: as for `max`; AVX-512 F when Z.
        unsafe {
            if Z {
                exp_all16(v)
            } else {
                exp_all(v)
            }
        }
    }
}

/// The softmax of `scalar::attention` with this tier's max and exp on ymm.
#[target_feature(enable = "avx2")]
#[inline]
fn softmax_ymm(att: &mut [f32], softcap: f32, sink: Option<f32>) -> f32 {
    softmax::<X86Math<false>>(att, softcap, sink)
}

/// [`softmax_ymm`] with `exp` on zmm (AVX-512 F).
#[target_feature(enable = "avx2,avx512f")]
#[inline]
fn softmax_zmm(att: &mut [f32], softcap: f32, sink: Option<f32>) -> f32 {
    softmax::<X86Math<true>>(att, softcap, sink)
}

/// [`softmax_ymm`] without its sum (`scalar::attention::softmax_exp`): the sink's term.
#[target_feature(enable = "avx2")]
#[inline]
fn softmax_exp_ymm(att: &mut [f32], softcap: f32, sink: Option<f32>) -> Option<f32> {
    softmax_exp::<X86Math<false>>(att, softcap, sink)
}

/// [`softmax_zmm`] without its sum.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
fn softmax_exp_zmm(att: &mut [f32], softcap: f32, sink: Option<f32>) -> Option<f32> {
    softmax_exp::<X86Math<true>>(att, softcap, sink)
}

/// Queries whose softmax sums [`sums`] runs side by side.
const SUM_CHAINS: usize = 8;

/// Each row's sum in position order from +0.0 (the softmax's), the rows' chains
/// interleaved: one chain alone waits an add's latency per position.
#[inline(always)]
fn sums(rows: &[&[f32]; SUM_CHAINS]) -> [f32; SUM_CHAINS] {
    let common = rows.iter().map(|r| r.len()).min().unwrap_or(0);
    let mut s = [0f32; SUM_CHAINS];
    for i in 0..common {
        for (s, r) in s.iter_mut().zip(rows) {
            *s += r[i];
        }
    }
    for (s, r) in s.iter_mut().zip(rows) {
        for &a in &r[common..] {
            *s += a;
        }
    }
    s
}

/// One query (any slots, a ring included): `scalar::attention::attend_one` in AVX2; keys and
/// values from `ks` and `vs` (the view gives the window and the slots).
///
/// A lone query has no pair to score with; `PAIRS` (as `WIDE`) only says that AVX-512 F
/// is there, for the softmax's 16-lane `exp`, as in [`attend_many`].
///
/// # Safety
/// The CPU has AVX2 (and AVX-512 F when `PAIRS` or `WIDE`) and what `S` needs; the
/// caller is compiled with them.
#[inline(always)]
pub(crate) unsafe fn attend_one<const PAIRS: bool, const WIDE: bool, S: Src>(
    query: &mut Query,
    kv: &KvView,
    ks: S,
    vs: S,
    scale: f32,
    softcap: f32,
) {
    let (q, att, out) = (query.q, &mut *query.att, &mut *query.out);
    let rows = kv.rows(query.pos, q.len());
    let att = &mut att[..rows.len];
    // SAFETY: AVX2 (this function's contract); every row has q.len() values.
    unsafe { scores(q, |i| ks.row(rows.slot(i)), scale, att) };
    // SAFETY: AVX2, and AVX-512 F when PAIRS or WIDE (this function's contract).
    let sum = unsafe {
        if PAIRS || WIDE {
            softmax_zmm(att, softcap, query.sink)
        } else {
            softmax_ymm(att, softcap, query.sink)
        }
    };
    let inv = 1.0 / sum;
    out.fill(0.0);
    // SAFETY: as above; out has q.len() values.
    unsafe { values::<WIDE, _>(att, |i| vs.row(rows.slot(i)), out) };
    for o in out {
        *o *= inv;
    }
}

/// Positions per block of [`attend_many`]: the block's keys (or values) stay in L1
/// while every query of the tile uses them.
const BLOCK: usize = 64;

/// At most [`TILE_QUERIES`] queries of one kv head, blocked over positions; each
/// query's bits are those of [`attend_one`] (scores are independent; each value sum
/// runs in position order whatever the blocking).
///
/// # Safety
/// The CPU has AVX2 (and AVX-512 F when `PAIRS` or `WIDE`) and what `S` needs; every query's
/// position is below `kv.cap`; every query and `out` has the same length.
#[inline(always)]
pub(crate) unsafe fn attend_many<const PAIRS: bool, const WIDE: bool, S: Src>(
    qs: &mut [Query],
    kv: &KvView,
    ks: S,
    vs: S,
    scale: f32,
    softcap: f32,
) {
    debug_assert!(qs.len() <= TILE_QUERIES);
    let Some(hd) = qs.first().map(|q| q.q.len()) else {
        return;
    };
    // With every position below cap, position p is in slot p.
    let k = |p: usize| ks.row(p);
    let v = |p: usize| vs.row(p);
    let lo = qs
        .iter()
        .map(|q| kv.first_visible(q.pos))
        .min()
        .unwrap_or(0);
    let hi = qs.iter().map(|q| q.pos).max().unwrap_or(0);
    // The part of block b0..b0+BLOCK that query q sees: positions s..e.
    let span = |q: &Query, b0: usize| {
        let s = kv.first_visible(q.pos).max(b0);
        let e = (q.pos + 1).min(b0 + BLOCK);
        (s, e)
    };
    // Two queries of one position (heads sharing this kv head) take their scores
    // together with AVX-512 F: one zmm holds both queries' 8 partial sums.
    let pairs = PAIRS && hd % 8 == 0 && hd / 8 <= PAIR_MAX_CHUNKS;
    for b0 in (lo..=hi).step_by(BLOCK) {
        let mut rest = &mut qs[..];
        while let Some((q, tail)) = rest.split_first_mut() {
            let (s, e) = span(q, b0);
            let f = kv.first_visible(q.pos);
            if let (true, Some(q2)) = (pairs && s < e, tail.first_mut()) {
                if q2.pos == q.pos {
                    let (a, b) = (&mut q.att[s - f..e - f], &mut q2.att[s - f..e - f]);
                    // SAFETY: AVX-512 F and AVX2 (PAIRS, this function's contract); rows
                    // of hd values, hd a multiple of 8 within the pair buffer.
                    unsafe { scores_pair(q.q, q2.q, |i| k(s + i), scale, a, b) };
                    rest = &mut tail[1..];
                    continue;
                }
            }
            if s < e {
                // SAFETY: AVX2; rows of hd values.
                unsafe { scores(q.q, |i| k(s + i), scale, &mut q.att[s - f..e - f]) };
            }
            rest = tail;
        }
    }
    let mut inv = [0f32; TILE_QUERIES];
    let mut e_sink = [None; TILE_QUERIES];
    for (q, e) in qs.iter_mut().zip(&mut e_sink) {
        let n = q.pos + 1 - kv.first_visible(q.pos);
        let att = &mut q.att[..n];
        // SAFETY: AVX2, and AVX-512 F when PAIRS or WIDE (this function's contract).
        *e = unsafe {
            if PAIRS || WIDE {
                softmax_exp_zmm(att, softcap, q.sink)
            } else {
                softmax_exp_ymm(att, softcap, q.sink)
            }
        };
        q.out.fill(0.0);
    }
    let chunks = qs.chunks(SUM_CHAINS).zip(e_sink.chunks(SUM_CHAINS));
    for ((qs, es), inv) in chunks.zip(inv.chunks_mut(SUM_CHAINS)) {
        // A chunk short of SUM_CHAINS queries repeats its first (the extra sums unused).
        let rows: [&[f32]; SUM_CHAINS] = std::array::from_fn(|i| {
            let q = qs.get(i).unwrap_or(&qs[0]);
            &q.att[..q.pos + 1 - kv.first_visible(q.pos)]
        });
        for ((iv, sum), &e) in inv.iter_mut().zip(sums(&rows)).zip(es) {
            *iv = 1.0 / with_sink(sum, e);
        }
    }
    // Queries of one position (heads sharing this kv head) see the same positions: with
    // AVX-512 F up to GROUP_MAX of them sum their values together, each loaded row
    // serving all of them (each query's sums still its own chains in position order).
    let grouped = PAIRS && hd.is_multiple_of(GROUP_DIMS);
    for b0 in (lo..=hi).step_by(BLOCK) {
        let mut rest = &mut qs[..];
        while let Some(pos) = rest.first().map(|q| q.pos) {
            let g = if grouped {
                rest.iter()
                    .take(GROUP_MAX)
                    .take_while(|q| q.pos == pos)
                    .count()
            } else {
                1
            };
            let (grp, tail) = std::mem::take(&mut rest).split_at_mut(g);
            rest = tail;
            let (s, e) = span(&grp[0], b0);
            if s >= e {
                continue;
            }
            let f = kv.first_visible(pos);
            if g == 1 {
                let q = &mut grp[0];
                // SAFETY: AVX2 (AVX-512 F when WIDE); rows and out of hd values.
                unsafe { values::<WIDE, _>(&q.att[s - f..e - f], |i| v(s + i), q.out) };
                continue;
            }
            let outs: [*mut f32; GROUP_MAX] = std::array::from_fn(|i| {
                grp.get_mut(i)
                    .map_or(std::ptr::null_mut(), |q| q.out.as_mut_ptr())
            });
            let atts: [*const f32; GROUP_MAX] = std::array::from_fn(|i| {
                grp.get(i)
                    .map_or(std::ptr::null(), |q| q.att[s - f..].as_ptr())
            });
            // SAFETY: AVX-512 F and AVX2 (PAIRS, this function's contract); the first g
            // pointers are those of distinct queries: outs of hd values (a multiple of
            // GROUP_DIMS), atts of e - s scores; rows of hd values.
            unsafe {
                match g {
                    2 => values_group::<_, 2>(&atts, |i| v(s + i), &outs, e - s, hd),
                    3 => values_group::<_, 3>(&atts, |i| v(s + i), &outs, e - s, hd),
                    _ => values_group::<_, 4>(&atts, |i| v(s + i), &outs, e - s, hd),
                }
            }
        }
    }
    for (q, &iv) in qs.iter_mut().zip(&inv) {
        for o in q.out.iter_mut() {
            *o *= iv;
        }
    }
}

/// Most queries of [`values_group`]: four zmm sums each, 16 in all.
const GROUP_MAX: usize = 4;
/// Dimensions per pass of [`values_group`]: four zmm.
const GROUP_DIMS: usize = 64;

/// [`values`] for `G` queries over the same `n` positions: `outs[g][d] += Σ_i
/// atts[g][i] · row(i)[d]`, each sum in position order from out's value, 64 dimensions
/// a pass. One load of a row's chunk serves every query, and the `4·G` independent
/// chains hide the add latency that a single query's four zmm sums wait on.
///
/// # Safety
/// The CPU must support AVX2, AVX-512 F and F16C (every AVX-512 tier does) and what
/// `W` needs; `outs[..G]` are distinct, each `hd` writable floats, `hd` a multiple of
/// [`GROUP_DIMS`]; `atts[..G]` each `n` readable floats; rows have `hd` values.
#[target_feature(enable = "avx2,avx512f,f16c")]
unsafe fn values_group<W: Row, const G: usize>(
    atts: &[*const f32; GROUP_MAX],
    row: impl Fn(usize) -> W,
    outs: &[*mut f32; GROUP_MAX],
    n: usize,
    hd: usize,
) {
    debug_assert!(G <= GROUP_MAX && hd.is_multiple_of(GROUP_DIMS));
    let mut c = 0;
    while c < hd {
        // SAFETY: c + 64 <= hd for every out and row; i < n for every att (the contract).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; G];
            for (a, &o) in acc.iter_mut().zip(outs) {
                for (r, x) in a.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(o.add(c + 16 * r));
                }
            }
            for i in 0..n {
                let w = row(i);
                let x: [__m512; 4] = std::array::from_fn(|r| w.ld16(c + 16 * r));
                for (a, &p) in acc.iter_mut().zip(atts) {
                    let p = _mm512_set1_ps(*p.add(i));
                    for (y, &x) in a.iter_mut().zip(&x) {
                        *y = _mm512_add_ps(*y, _mm512_mul_ps(p, x));
                    }
                }
            }
            for (a, &o) in acc.iter().zip(outs) {
                for (r, &x) in a.iter().enumerate() {
                    _mm512_storeu_ps(o.add(c + 16 * r), x);
                }
            }
        }
        c += GROUP_DIMS;
    }
}

/// `att[i] = dot(q, row(i)) · scale`, eight rows at a time (eight add chains).
#[inline(always)]
unsafe fn scores<R: Row>(q: &[f32], row: impl Fn(usize) -> R, scale: f32, att: &mut [f32]) {
    let hd = q.len();
    let n8 = hd / 8 * 8;
    let n = att.len();
    let mut i = 0;
    while i + 8 <= n {
        let k: [R; 8] = std::array::from_fn(|t| row(i + t));
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut j = 0;
        while j < n8 {
            // SAFETY: j + 8 <= hd = the length of q and of every row.
            unsafe {
                let x = _mm256_loadu_ps(q.as_ptr().add(j));
                for (a, kr) in acc.iter_mut().zip(&k) {
                    let kv = kr.ld8(j);
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(x, kv));
                }
            }
            j += 8;
        }
        if n8 == hd {
            // SAFETY: register ops; att[i..i + 8] exists (i + 8 <= n).
            unsafe {
                let v = _mm256_mul_ps(reduce8x8(&acc), _mm256_set1_ps(scale));
                _mm256_storeu_ps(att.as_mut_ptr().add(i), v);
            }
        } else {
            for (t, (a, kr)) in acc.into_iter().zip(k).enumerate() {
                att[i + t] = finish_row(a, &q[n8..], kr, n8) * scale;
            }
        }
        i += 8;
    }
    while i < n {
        let kr = row(i);
        let mut a = _mm256_setzero_ps();
        let mut j = 0;
        while j < n8 {
            // SAFETY: as above.
            unsafe {
                let x = _mm256_loadu_ps(q.as_ptr().add(j));
                a = _mm256_add_ps(a, _mm256_mul_ps(x, kr.ld8(j)));
            }
            j += 8;
        }
        att[i] = finish_row(a, &q[n8..], kr, n8) * scale;
        i += 1;
    }
}

/// [`finish`] with the tail of a row (its values from `from` on, `qt.len() < 8` of them)
/// widened into a stack buffer.
#[inline(always)]
fn finish_row<R: Row>(a: __m256, qt: &[f32], r: R, from: usize) -> f32 {
    let mut t = [0f32; 8];
    for (j, x) in t.iter_mut().enumerate().take(qt.len()) {
        *x = r.get(from + j);
    }
    finish(a, qt, &t[..qt.len()])
}

/// Most 8-value chunks of a head for [`scores_pair`] (head_dim ≤ 256).
const PAIR_MAX_CHUNKS: usize = 32;

/// [`scores`] for two queries `qa`, `qb` over the same rows, into `att_a`, `att_b`:
/// a zmm holds `[qa chunk, qb chunk]` and each key chunk is broadcast to both halves,
/// so each half runs exactly the 8-lane chain of [`scores`] for its query.
///
/// # Safety
/// The CPU must support AVX2, AVX-512 F and F16C (every AVX-512 tier does) and what
/// `R` needs; every row has `qa.len() = qb.len()` values, a multiple of 8 and at most
/// `8·PAIR_MAX_CHUNKS`; `att_a` and `att_b` have one length.
#[target_feature(enable = "avx2,avx512f,f16c")]
unsafe fn scores_pair<R: Row>(
    qa: &[f32],
    qb: &[f32],
    row: impl Fn(usize) -> R,
    scale: f32,
    att_a: &mut [f32],
    att_b: &mut [f32],
) {
    let chunks = qa.len() / 8;
    debug_assert!(qa.len() == qb.len() && qa.len().is_multiple_of(8) && chunks <= PAIR_MAX_CHUNKS);
    debug_assert_eq!(att_a.len(), att_b.len());
    // Only the first `chunks` entries are written and read.
    let mut qp = [std::mem::MaybeUninit::<__m512>::uninit(); PAIR_MAX_CHUNKS];
    for (j, v) in qp.iter_mut().enumerate().take(chunks) {
        // SAFETY: 8j + 8 <= hd for both queries.
        unsafe {
            let lo = _mm256_castps_pd(_mm256_loadu_ps(qa.as_ptr().add(8 * j)));
            let hi = _mm256_castps_pd(_mm256_loadu_ps(qb.as_ptr().add(8 * j)));
            v.write(_mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castpd256_pd512(lo),
                hi,
                1,
            )));
        }
    }
    let n = att_a.len();
    let vscale = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 8 <= n {
        let k: [R; 8] = [
            row(i),
            row(i + 1),
            row(i + 2),
            row(i + 3),
            row(i + 4),
            row(i + 5),
            row(i + 6),
            row(i + 7),
        ];
        let mut acc = [_mm512_setzero_ps(); 8];
        for (j, x) in qp.iter().enumerate().take(chunks) {
            // SAFETY: entry j < chunks was written above; 8j + 8 <= every row's length.
            let x = unsafe { x.assume_init() };
            for (a, kr) in acc.iter_mut().zip(&k) {
                // SAFETY: 8j + 8 <= the row's length (above).
                *a = _mm512_add_ps(*a, _mm512_mul_ps(x, unsafe { key2(*kr, j) }));
            }
        }
        let lo: [__m256; 8] = std::array::from_fn(|t| _mm512_castps512_ps256(acc[t]));
        let hi: [__m256; 8] = std::array::from_fn(|t| {
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))
        });
        // SAFETY: register ops; att_a/att_b[i..i + 8] exist (i + 8 <= n).
        unsafe {
            _mm256_storeu_ps(
                att_a.as_mut_ptr().add(i),
                _mm256_mul_ps(reduce8x8(&lo), vscale),
            );
            _mm256_storeu_ps(
                att_b.as_mut_ptr().add(i),
                _mm256_mul_ps(reduce8x8(&hi), vscale),
            );
        }
        i += 8;
    }
    while i < n {
        let kr = row(i);
        let mut a = _mm512_setzero_ps();
        for (j, x) in qp.iter().enumerate().take(chunks) {
            // SAFETY: as above.
            let x = unsafe { x.assume_init() };
            // SAFETY: 8j + 8 <= the row's length.
            a = _mm512_add_ps(a, _mm512_mul_ps(x, unsafe { key2(kr, j) }));
        }
        let lo = _mm512_castps512_ps256(a);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
        // No tail: hd is a multiple of 8.
        att_a[i] = finish(lo, &[], &[]) * scale;
        att_b[i] = finish(hi, &[], &[]) * scale;
        i += 1;
    }
}

/// Chunk `j` of a key row in both halves of a zmm.
#[inline(always)]
unsafe fn key2<R: Row>(r: R, j: usize) -> __m512 {
    // SAFETY: 8j + 8 <= the row's length (the caller's bound); AVX-512 F in the caller.
    unsafe {
        let c = _mm256_castps_pd(r.ld8(8 * j));
        _mm512_castpd_ps(_mm512_broadcast_f64x4(c))
    }
}

/// Eight accumulators (one per key) reduced at once, each as `scalar::math::reduce8` does
/// with no tail: an 8×8 transpose puts lane `l` of every key in one vector, then
/// `((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 + c7))` runs on all eight keys.
#[target_feature(enable = "avx")]
#[inline]
fn reduce8x8(r: &[__m256; 8]) -> __m256 {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    // u_l (l < 4): lane l of keys 0..4 in the low half, lane l + 4 in the high.
    let u0 = _mm256_shuffle_ps(t0, t2, 0x44);
    let u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    let u2 = _mm256_shuffle_ps(t1, t3, 0x44);
    let u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    let u4 = _mm256_shuffle_ps(t4, t6, 0x44);
    let u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    let u6 = _mm256_shuffle_ps(t5, t7, 0x44);
    let u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    // c_l: lane l of all eight keys.
    let c0 = _mm256_permute2f128_ps(u0, u4, 0x20);
    let c4 = _mm256_permute2f128_ps(u0, u4, 0x31);
    let c1 = _mm256_permute2f128_ps(u1, u5, 0x20);
    let c5 = _mm256_permute2f128_ps(u1, u5, 0x31);
    let c2 = _mm256_permute2f128_ps(u2, u6, 0x20);
    let c6 = _mm256_permute2f128_ps(u2, u6, 0x31);
    let c3 = _mm256_permute2f128_ps(u3, u7, 0x20);
    let c7 = _mm256_permute2f128_ps(u3, u7, 0x31);
    let h0 = _mm256_add_ps(_mm256_add_ps(c0, c4), _mm256_add_ps(c2, c6));
    let h1 = _mm256_add_ps(_mm256_add_ps(c1, c5), _mm256_add_ps(c3, c7));
    _mm256_add_ps(h0, h1)
}

/// The dot product's lanes reduced as `scalar::math::dot` does, plus its tail (scalar
/// code: no target features needed).
#[inline(always)]
fn finish(a: __m256, qt: &[f32], kt: &[f32]) -> f32 {
    // SAFETY: a __m256 and a [f32; 8] are the same 32 bytes of plain bits.
    let lanes = unsafe { core::mem::transmute::<__m256, [f32; 8]>(a) };
    reduce8(lanes, qt, kt)
}

/// `out[d] += Σ_i att[i] · row(i)[d]`, the sum in position order from out's value;
/// 64 (then 32) dimensions at a time in registers, the rest one by one.
#[inline(always)]
unsafe fn values<const WIDE: bool, R: Row>(
    att: &[f32],
    row: impl Fn(usize) -> R + Copy,
    out: &mut [f32],
) {
    if WIDE {
        // SAFETY: AVX-512 F with WIDE (the caller's contract), AVX2.
        return unsafe { values_wide(att, row, out) };
    }
    // SAFETY: AVX2 (the caller's contract).
    let c = unsafe { values_while::<__m256, R, 8>(att, row, 0, out) };
    // SAFETY: as above.
    let c = unsafe { values_while::<__m256, R, 4>(att, row, c, out) };
    values_tail(att, row, c, out);
}

/// [`values_regs`] with `K` registers of `V` from dimension `c` for as long as they fit
/// in `out`; the first dimension left.
///
/// # Safety
/// The features of [`values_regs`]; the bounds are checked here.
#[inline(always)]
unsafe fn values_while<V: Lanes, R: Row, const K: usize>(
    att: &[f32],
    row: impl Fn(usize) -> R + Copy,
    mut c: usize,
    out: &mut [f32],
) -> usize {
    while c + V::N * K <= out.len() {
        // SAFETY: c + N·K <= hd; the features of this function's contract.
        c = unsafe { values_regs::<V, R, K>(att, row, c, out) };
    }
    c
}

/// `out[d] += Σ_i att[i] · row(i)[d]` for the dimensions `c..` one by one.
#[inline(always)]
fn values_tail<R: Row>(att: &[f32], row: impl Fn(usize) -> R, c: usize, out: &mut [f32]) {
    if c < out.len() {
        let tail = &mut out[c..];
        for (i, &p) in att.iter().enumerate() {
            let r = row(i);
            for (j, o) in tail.iter_mut().enumerate() {
                *o += p * r.get(c + j);
            }
        }
    }
}

/// [`values`] with 16 dimensions per register: 128 (then 64, 16) at a time. Each
/// dimension's sum is its own chain in position order, so the width changes nothing
/// in the bits.
///
/// # Safety
/// The CPU must support AVX2, AVX-512 F and F16C (every AVX-512 tier does) and what
/// `R` needs; rows have `out.len()` values.
#[target_feature(enable = "avx2,avx512f,f16c")]
unsafe fn values_wide<R: Row>(att: &[f32], row: impl Fn(usize) -> R + Copy, out: &mut [f32]) {
    let hd = out.len();
    // SAFETY: AVX-512 F and AVX2 (this function's contract).
    let c = unsafe { values_while::<__m512, R, 8>(att, row, 0, out) };
    // SAFETY: as above.
    let c = unsafe { values_while::<__m512, R, 4>(att, row, c, out) };
    // SAFETY: as above.
    let mut c = unsafe { values_while::<__m512, R, 1>(att, row, c, out) };
    if c + 8 <= hd {
        // SAFETY: c + 8 <= hd.
        c = unsafe { values_regs::<__m256, R, 1>(att, row, c, out) };
    }
    values_tail(att, row, c, out);
}

/// A float vector for [`values_regs`]: `ymm` (8 lanes) or `zmm` (16).
trait Lanes: Copy {
    const N: usize;
    /// # Safety
    /// `N` readable floats at `p`; the caller is compiled with the vector's features.
    unsafe fn load(p: *const f32) -> Self;
    /// `N` values of `r` from `j`.
    ///
    /// # Safety
    /// `j + N <= hd`; features as for `load` and `R`'s.
    unsafe fn load_row<R: Row>(r: R, j: usize) -> Self;
    /// # Safety
    /// `N` writable floats at `p`; features as for `load`.
    unsafe fn store(self, p: *mut f32);
    /// # Safety
    /// Features as for `load`.
    unsafe fn splat(v: f32) -> Self;
    /// `self + p·x`, two rounded operations (no FMA).
    ///
    /// # Safety
    /// Features as for `load`.
    unsafe fn add_mul(self, p: Self, x: Self) -> Self;
}

/// [`Lanes`] for one vector type: its lane count, its [`Row`] load and its intrinsics.
macro_rules! impl_lanes {
    ($v:ty, $n:literal, $ld_row:ident, $load:ident, $store:ident, $set1:ident, $add:ident, $mul:ident) => {
        impl Lanes for $v {
            const N: usize = $n;
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                // SAFETY: the trait contract.
                unsafe { $load(p) }
            }
            #[inline(always)]
            unsafe fn load_row<R: Row>(r: R, j: usize) -> Self {
                // SAFETY: the trait contract.
                unsafe { r.$ld_row(j) }
            }
            #[inline(always)]
            unsafe fn store(self, p: *mut f32) {
                // SAFETY: the trait contract.
                unsafe { $store(p, self) }
            }
            #[inline(always)]
            unsafe fn splat(v: f32) -> Self {
                // SAFETY: register-only (the trait contract).
                unsafe { $set1(v) }
            }
            #[inline(always)]
            unsafe fn add_mul(self, p: Self, x: Self) -> Self {
                // SAFETY: register-only (the trait contract).
                unsafe { $add(self, $mul(p, x)) }
            }
        }
    };
}

impl_lanes!(
    __m256,
    8,
    ld8,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_set1_ps,
    _mm256_add_ps,
    _mm256_mul_ps
);
impl_lanes!(
    __m512,
    16,
    ld16,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_set1_ps,
    _mm512_add_ps,
    _mm512_mul_ps
);

/// [`values`] for dimensions `c..c + R·V::N` in `R` registers of `V`; returns the end.
///
/// # Safety
/// `c + R·V::N <= out.len()`, rows have `out.len()` values, the CPU has `V`'s
/// features (the caller is compiled with them).
#[inline(always)]
unsafe fn values_regs<V: Lanes, W: Row, const R: usize>(
    att: &[f32],
    row: impl Fn(usize) -> W,
    c: usize,
    out: &mut [f32],
) -> usize {
    // SAFETY: the bounds and features of this function's contract.
    unsafe {
        let mut acc = [V::splat(0.0); R];
        for (r, a) in acc.iter_mut().enumerate() {
            *a = V::load(out.as_ptr().add(c + V::N * r));
        }
        for (i, &p) in att.iter().enumerate() {
            let pv = V::splat(p);
            let v = row(i);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = a.add_mul(pv, V::load_row(v, c + V::N * r));
            }
        }
        for (r, a) in acc.into_iter().enumerate() {
            a.store(out.as_mut_ptr().add(c + V::N * r));
        }
    }
    c + V::N * R
}
