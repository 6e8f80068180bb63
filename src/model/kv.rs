//! The KV cache: per attention layer, `cap × kv_dim` keys and values in f32.
//!
//! Position `p` lives in slot `p mod cap`. A full-attention layer has `cap = ctx`, so
//! the slot is the position. A sliding layer of window `w` attends to positions `s`
//! with `p − s < w` and keeps only `cap = min(w, ctx)` slots: a ring buffer, whose
//! oldest slot is overwritten by the newest position. Linear-attention layers have no
//! cache (their state is in [`super::delta`]).

use crate::kernels::KvView;

/// One layer's keys and values.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// cap × kv_dim: the key of position p at slot p % cap.
    pub k: Vec<f32>,
    /// cap × kv_dim: the value of position p at slot p % cap.
    pub v: Vec<f32>,
    /// Slots.
    pub cap: usize,
    /// Sliding window (None: full attention).
    pub window: Option<usize>,
    pub kv_dim: usize,
}

impl LayerCache {
    /// A cache of `cap` slots.
    pub fn new(cap: usize, kv_dim: usize, window: Option<usize>) -> LayerCache {
        LayerCache {
            k: vec![0.0; cap * kv_dim],
            v: vec![0.0; cap * kv_dim],
            cap,
            window,
            kv_dim,
        }
    }

    /// Stores the key and value of position `pos`.
    pub fn store(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let s = (pos % self.cap) * self.kv_dim;
        self.k[s..s + self.kv_dim].copy_from_slice(k);
        self.v[s..s + self.kv_dim].copy_from_slice(v);
    }

    /// The first position that position `pos` attends to.
    pub fn first_visible(&self, pos: usize) -> usize {
        self.view(0).first_visible(pos)
    }

    /// The keys and values of the kv head at offset `off` of each slot, as the
    /// kernels' attention reads them.
    pub fn view(&self, off: usize) -> KvView<'_> {
        KvView {
            k: &self.k,
            v: &self.v,
            cap: self.cap,
            stride: self.kv_dim,
            off,
            window: self.window,
        }
    }

    /// The key of position `p` (kv_dim values).
    #[inline]
    pub fn key(&self, p: usize) -> &[f32] {
        let s = (p % self.cap) * self.kv_dim;
        &self.k[s..s + self.kv_dim]
    }

    /// The value of position `p` (kv_dim values).
    #[inline]
    pub fn value(&self, p: usize) -> &[f32] {
        let s = (p % self.cap) * self.kv_dim;
        &self.v[s..s + self.kv_dim]
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<f32>()
    }
}
