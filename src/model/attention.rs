//! One head's attention over the KV cache: scores, softmax, weighted values.
//!
//! The arithmetic (which every path must reproduce bit for bit):
//!
//! ```text
//! s_i = dot(q, k_i) · scale            dot: 8 partial sums, see `forward::dot`
//! s_i = cap · tanh(s_i / cap)          when softcap > 0
//! e_i = exp(s_i − max_i s_i);  sum = Σ e_i   (in position order)
//! out[d] = (Σ_i e_i · v_i[d]) · (1 / sum)    (the Σ in position order, from +0.0)
//! ```
//!
//! Speed comes from the order of work, not from other arithmetic: scores are taken for
//! four positions at a time (four independent dependency chains instead of one), and the
//! weighted values are summed for 32 dimensions at a time over all positions in
//! registers, instead of loading and storing `out` once per position.

use super::forward::{dot, reduce8};
use super::kv::LayerCache;

/// Attention of the query `q` (one head, `q.len()` = head_dim) at position `pos` over
/// the cached keys and values at offset `off` of each slot: scores in `att`, the
/// result in `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    q: &[f32],
    cache: &LayerCache,
    off: usize,
    pos: usize,
    scale: f32,
    softcap: f32,
    att: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2::attend(q, cache, off, pos, scale, softcap, att, out) };
    }
    attend_scalar(q, cache, off, pos, scale, softcap, att, out)
}

/// The reference path (also the one on CPUs without AVX2).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_scalar(
    q: &[f32],
    cache: &LayerCache,
    off: usize,
    pos: usize,
    scale: f32,
    softcap: f32,
    att: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    let rows = Rows::new(cache, off, pos, hd);
    let att = &mut att[..rows.len];
    for (i, a) in att.iter_mut().enumerate() {
        *a = dot(q, rows.k(i)) * scale;
    }
    let sum = softmax(att, softcap);
    out.fill(0.0);
    for (i, &p) in att.iter().enumerate() {
        for (o, &v) in out.iter_mut().zip(rows.v(i)) {
            *o += p * v;
        }
    }
    let inv = 1.0 / sum;
    for o in out {
        *o *= inv;
    }
}

/// The visible positions' key and value rows, in position order.
struct Rows<'a> {
    k: &'a [f32],
    v: &'a [f32],
    /// Slot of the first visible position.
    first: usize,
    cap: usize,
    stride: usize,
    off: usize,
    hd: usize,
    len: usize,
}

impl<'a> Rows<'a> {
    fn new(cache: &'a LayerCache, off: usize, pos: usize, hd: usize) -> Rows<'a> {
        let s0 = cache.first_visible(pos);
        Rows {
            k: &cache.k,
            v: &cache.v,
            first: s0 % cache.cap,
            cap: cache.cap,
            stride: cache.kv_dim,
            off,
            hd,
            len: pos + 1 - s0,
        }
    }

    /// Start of the row of the `i`-th visible position.
    #[inline(always)]
    fn at(&self, i: usize) -> usize {
        let mut slot = self.first + i;
        if slot >= self.cap {
            slot -= self.cap;
        }
        slot * self.stride + self.off
    }

    #[inline(always)]
    fn k(&self, i: usize) -> &'a [f32] {
        let at = self.at(i);
        &self.k[at..at + self.hd]
    }

    #[inline(always)]
    fn v(&self, i: usize) -> &'a [f32] {
        let at = self.at(i);
        &self.v[at..at + self.hd]
    }
}

/// Softcap, then `att = exp(att − max)` in place; returns the sum (in order).
#[inline(always)]
fn softmax(att: &mut [f32], softcap: f32) -> f32 {
    let mut max = f32::NEG_INFINITY;
    for a in att.iter_mut() {
        if softcap > 0.0 {
            *a = softcap * (*a / softcap).tanh();
        }
        max = max.max(*a);
    }
    let mut sum = 0.0f32;
    for a in att.iter_mut() {
        *a = (*a - max).exp();
        sum += *a;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{reduce8, softmax, Rows};
    use crate::model::kv::LayerCache;

    /// [`super::attend_scalar`] on AVX2: the same operations (no FMA) in the same order
    /// per output, so the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn attend(
        q: &[f32],
        cache: &LayerCache,
        off: usize,
        pos: usize,
        scale: f32,
        softcap: f32,
        att: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = q.len();
        let rows = Rows::new(cache, off, pos, hd);
        let att = &mut att[..rows.len];
        let n8 = hd / 8 * 8;
        // Scores, four positions at a time.
        let mut i = 0;
        while i + 4 <= rows.len {
            let k = [rows.k(i), rows.k(i + 1), rows.k(i + 2), rows.k(i + 3)];
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut j = 0;
            while j < n8 {
                // SAFETY: j + 8 <= hd = the length of q and of every k row.
                unsafe {
                    let x = _mm256_loadu_ps(q.as_ptr().add(j));
                    for (a, kr) in acc.iter_mut().zip(&k) {
                        *a = _mm256_add_ps(
                            *a,
                            _mm256_mul_ps(x, _mm256_loadu_ps(kr.as_ptr().add(j))),
                        );
                    }
                }
                j += 8;
            }
            for (t, (a, kr)) in acc.into_iter().zip(&k).enumerate() {
                let mut arr = [0f32; 8];
                // SAFETY: arr holds 8 floats.
                unsafe { _mm256_storeu_ps(arr.as_mut_ptr(), a) };
                att[i + t] = reduce8(arr, &q[n8..], &kr[n8..]) * scale;
            }
            i += 4;
        }
        while i < rows.len {
            let kr = rows.k(i);
            let mut a = _mm256_setzero_ps();
            let mut j = 0;
            while j < n8 {
                // SAFETY: as above.
                unsafe {
                    let x = _mm256_loadu_ps(q.as_ptr().add(j));
                    a = _mm256_add_ps(a, _mm256_mul_ps(x, _mm256_loadu_ps(kr.as_ptr().add(j))));
                }
                j += 8;
            }
            let mut arr = [0f32; 8];
            // SAFETY: arr holds 8 floats.
            unsafe { _mm256_storeu_ps(arr.as_mut_ptr(), a) };
            att[i] = reduce8(arr, &q[n8..], &kr[n8..]) * scale;
            i += 1;
        }
        let sum = softmax(att, softcap);
        let inv = 1.0 / sum;
        // Weighted values, 32 dimensions at a time in four registers.
        let mut c = 0;
        while c + 32 <= hd {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (i, &p) in att.iter().enumerate() {
                let pv = _mm256_set1_ps(p);
                let v = rows.v(i);
                for (r, a) in acc.iter_mut().enumerate() {
                    // SAFETY: c + 8r + 8 <= c + 32 <= hd = the row length.
                    let x = unsafe { _mm256_loadu_ps(v.as_ptr().add(c + 8 * r)) };
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, x));
                }
            }
            let iv = _mm256_set1_ps(inv);
            for (r, a) in acc.into_iter().enumerate() {
                // SAFETY: as above, into `out` (hd values).
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * r), _mm256_mul_ps(a, iv)) };
            }
            c += 32;
        }
        if c < hd {
            let tail = &mut out[c..hd];
            tail.fill(0.0);
            for (i, &p) in att.iter().enumerate() {
                for (o, &v) in tail.iter_mut().zip(&rows.v(i)[c..]) {
                    *o += p * v;
                }
            }
            for o in tail {
                *o *= inv;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path gives the scalar bits: head sizes with and without a tail of 8 and of
    /// 32, a ring that wraps, a window, softcap on and off, NaN-free random data.
    #[test]
    fn avx2_attention_is_bit_identical_to_scalar() {
        let mut seed = 0x1234_5678u32;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) * 4.0 - 2.0
        };
        for (hd, heads, cap, window, pos) in [
            (64, 3, 40, None, 37),
            (256, 1, 9, None, 8),
            (40, 2, 20, None, 19),
            (12, 2, 7, Some(7), 30),
            (96, 2, 16, Some(16), 100),
        ] {
            let kvd = hd * heads;
            let mut cache = LayerCache::new(cap, kvd, window);
            for v in cache.k.iter_mut().chain(cache.v.iter_mut()) {
                *v = rnd();
            }
            let q: Vec<f32> = (0..hd).map(|_| rnd()).collect();
            for softcap in [0.0, 20.0] {
                for h in 0..heads {
                    let mut a1 = vec![0.0; cap];
                    let mut o1 = vec![0.0; hd];
                    attend_scalar(&q, &cache, h * hd, pos, 0.125, softcap, &mut a1, &mut o1);
                    let mut a2 = vec![0.0; cap];
                    let mut o2 = vec![0.0; hd];
                    attend(&q, &cache, h * hd, pos, 0.125, softcap, &mut a2, &mut o2);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&o1), bits(&o2), "hd {hd} cap {cap} pos {pos}");
                    assert!(o1.iter().all(|x| x.is_finite()));
                }
            }
        }
    }
}
