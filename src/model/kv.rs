//! The KV cache: per attention layer, `cap` slots of keys and values, stored as f32,
//! f16 or Q8_0 ([`KvType`]; the rounding, [`Kernels::store_kv_f16`] and
//! [`Kernels::store_kv_q8_0`], and how attention reads each back: docs/kernels.md "KV
//! cache types").
//!
//! Position `p` lives in slot `p mod cap`. A full-attention layer has `cap = ctx`, so
//! the slot is the position. A sliding layer of window `w` attends to positions `s`
//! with `p − s < w` and keeps only `cap = min(w, ctx)` slots: a ring buffer, whose
//! oldest slot is overwritten by the newest position. Linear-attention layers have no
//! cache (their state is in [`super::delta`]).
//!
//! A slot holds the `n_kv_heads` heads one after the other, each in
//! `kv_type.head_stride(head_dim)` values (Q8_0 pads a head to a multiple of 32 with
//! zeros, so that every head is whole blocks).

pub use crate::kernels::KvType;

use super::ops::Zeros;
use crate::kernels::{Kernels, KvData, KvView};
use crate::quant::QK;

/// The keys (or the values) of one layer, as stored: `cap × stride` values.
#[derive(Debug, Clone, PartialEq)]
pub enum KvBuf {
    F32(Vec<f32>),
    /// f16 bits.
    F16(Vec<u16>),
    /// Quants, and an f32 scale per 32 of them.
    Q8_0 {
        q: Vec<i8>,
        d: Vec<f32>,
    },
}

impl KvBuf {
    /// `n` zeroed values of type `t` from `z`.
    fn zeros(t: KvType, n: usize, z: &mut Zeros) -> KvBuf {
        match t {
            KvType::F32 => KvBuf::F32(z.take(&[n])),
            KvType::F16 => KvBuf::F16(z.take_of(&[n])),
            KvType::Q8_0 => KvBuf::Q8_0 {
                q: z.take_of(&[n]),
                d: z.take(&[n / QK]),
            },
        }
    }

    pub fn kv_type(&self) -> KvType {
        self.data().kv_type()
    }

    /// Values held (quants for Q8_0).
    pub fn len(&self) -> usize {
        self.data().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            KvBuf::F32(x) => 4 * x.len(),
            KvBuf::F16(x) => 2 * x.len(),
            KvBuf::Q8_0 { q, d } => q.len() + 4 * d.len(),
        }
    }

    /// As the kernels read it.
    pub fn data(&self) -> KvData<'_> {
        match self {
            KvBuf::F32(x) => KvData::F32(x),
            KvBuf::F16(x) => KvData::F16(x),
            KvBuf::Q8_0 { q, d } => KvData::Q8_0 { q, d },
        }
    }

    /// Copies `src` (of the same type and length) into this buffer.
    ///
    /// Panics if they differ in type or length.
    pub fn copy_from(&mut self, src: &KvBuf) {
        match (self, src) {
            (KvBuf::F32(a), KvBuf::F32(b)) => a.copy_from_slice(b),
            (KvBuf::F16(a), KvBuf::F16(b)) => a.copy_from_slice(b),
            (KvBuf::Q8_0 { q, d }, KvBuf::Q8_0 { q: bq, d: bd }) => {
                q.copy_from_slice(bq);
                d.copy_from_slice(bd);
            }
            (a, b) => panic!("copy of a {} cache into a {} one", b.kv_type(), a.kv_type()),
        }
    }
}

/// One layer's keys and values.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// cap × stride: the key of position p at slot p % cap.
    pub k: KvBuf,
    /// cap × stride: the value of position p at slot p % cap.
    pub v: KvBuf,
    /// Slots.
    pub cap: usize,
    /// Sliding window (None: full attention).
    pub window: Option<usize>,
    /// Values of a position's keys (n_kv_heads × head_dim).
    pub kv_dim: usize,
    /// Values per head.
    head_dim: usize,
    /// Values a slot stores per head (head_dim, padded to 32 for Q8_0).
    head_stride: usize,
    /// A head padded to `head_stride` (Q8_0 only).
    pad: Vec<f32>,
}

impl LayerCache {
    /// A zeroed f32 cache of `cap` slots of one head of `kv_dim` values.
    pub fn new(cap: usize, kv_dim: usize, window: Option<usize>) -> LayerCache {
        LayerCache::new_in(
            KvType::F32,
            cap,
            1,
            kv_dim,
            window,
            &mut Zeros::allocating(),
        )
    }

    /// A cache of `t` for `cap` slots of `heads` heads of `head_dim` values, its
    /// buffers from `z` (empty when `z` only counts).
    pub(crate) fn new_in(
        t: KvType,
        cap: usize,
        heads: usize,
        head_dim: usize,
        window: Option<usize>,
        z: &mut Zeros,
    ) -> LayerCache {
        let head_stride = t.head_stride(head_dim);
        let n = cap.saturating_mul(heads).saturating_mul(head_stride);
        LayerCache {
            k: KvBuf::zeros(t, n, z),
            v: KvBuf::zeros(t, n, z),
            cap,
            window,
            kv_dim: heads * head_dim,
            head_dim,
            head_stride,
            pad: if t == KvType::Q8_0 {
                vec![0.0; head_stride]
            } else {
                Vec::new()
            },
        }
    }

    pub fn kv_type(&self) -> KvType {
        self.k.kv_type()
    }

    /// Values a slot stores (padding included).
    fn stride(&self) -> usize {
        self.kv_dim / self.head_dim * self.head_stride
    }

    /// Stores the key and value of position `pos` (`kv_dim` values each), rounded to
    /// the cache's type (Q8_0 with `k`'s activation quantizer).
    pub fn store(&mut self, k: &Kernels, pos: usize, kr: &[f32], vr: &[f32]) {
        let (sw, hd) = (self.stride(), self.head_dim);
        let s = (pos % self.cap) * sw;
        for (buf, x) in [(&mut self.k, kr), (&mut self.v, vr)] {
            match buf {
                KvBuf::F32(b) => b[s..s + sw].copy_from_slice(x),
                KvBuf::F16(b) => k.store_kv_f16(x, &mut b[s..s + sw]),
                KvBuf::Q8_0 { q, d } => k.store_kv_q8_0(
                    x,
                    hd,
                    &mut self.pad,
                    &mut q[s..s + sw],
                    &mut d[s / QK..(s + sw) / QK],
                ),
            }
        }
    }

    /// The first position that position `pos` attends to.
    pub fn first_visible(&self, pos: usize) -> usize {
        self.head(0).first_visible(pos)
    }

    /// The keys and values of kv head `g`, as the kernels' attention reads them.
    pub fn head(&self, g: usize) -> KvView<'_> {
        KvView {
            k: self.k.data(),
            v: self.v.data(),
            cap: self.cap,
            stride: self.stride(),
            off: g * self.head_stride,
            window: self.window,
        }
    }

    /// The key of position `p` (`kv_dim` values), widened to f32.
    pub fn key(&self, p: usize) -> Vec<f32> {
        self.widen(self.k.data(), p)
    }

    /// The value of position `p` (`kv_dim` values), widened to f32.
    pub fn value(&self, p: usize) -> Vec<f32> {
        self.widen(self.v.data(), p)
    }

    fn widen(&self, x: KvData, p: usize) -> Vec<f32> {
        let (sw, hd, hs) = (self.stride(), self.head_dim, self.head_stride);
        let s = (p % self.cap) * sw;
        let mut out = vec![0.0; self.kv_dim];
        let mut buf = vec![0.0; hd];
        for (g, o) in out.chunks_exact_mut(hd).enumerate() {
            o.copy_from_slice(x.row(s + g * hs, hd, &mut buf));
        }
        out
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_round_by_type() {
        let k = crate::kernels::kernels();
        let (heads, hd) = (2, 40);
        let x: Vec<f32> = (0..heads * hd).map(|i| (i as f32 - 37.0) * 0.173).collect();
        let y: Vec<f32> = x.iter().map(|v| -v * 3.0).collect();
        for t in KvType::ALL {
            let mut c = LayerCache::new_in(t, 3, heads, hd, None, &mut Zeros::allocating());
            c.store(&k, 4, &x, &y);
            let (kk, vv) = (c.key(4), c.value(1));
            match t {
                KvType::F32 => assert!(kk == x && vv == y),
                KvType::F16 => {
                    // Rounded to nearest even, widened back exactly.
                    let r: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
                    assert!(kk == r);
                }
                KvType::Q8_0 => {
                    // Each head quantized alone, padded: the scale is its amax / 127.
                    for (g, h) in x.chunks(hd).enumerate() {
                        let got = &kk[g * hd..(g + 1) * hd];
                        for b in 0..hd.div_ceil(QK) {
                            let blk = &h[b * QK..((b + 1) * QK).min(hd)];
                            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                            let d = amax / 127.0;
                            for (j, &v) in blk.iter().enumerate() {
                                let e = (got[b * QK + j] - v).abs();
                                assert!(
                                    e <= d * 0.5 + 1e-6,
                                    "{t} head {g}: {v} -> {}",
                                    got[b * QK + j]
                                );
                            }
                        }
                    }
                }
            }
            assert_eq!(c.bytes(), 2 * 3 * t.row_bytes(heads, hd), "{t}");
        }
    }
}
