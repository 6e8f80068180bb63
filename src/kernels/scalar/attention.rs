//! Attention of queries over a KV cache, the reference: scores, softmax, weighted values.
//!
//! Per query `q` (head_dim values) at position `t`, over the visible positions `s` (the
//! cache's window: `t − s < window`, else all `s ≤ t`) in position order:
//!
//! ```text
//! s_i = dot(q, k_i) · scale            dot: math::dot (8 lanes, the tree, the tail)
//! s_i = cap · tanh(s_i / cap)          when softcap > 0 (libm tanhf, the same on every tier)
//! m   = max_i s_i                      (math::max; any order gives the maximum)
//! m   = max(m, sink)                   with a sink logit (f32::max)
//! e_i = exp(s_i − m)                   (math::exp)
//! sum = Σ e_i                          in position order, from +0.0
//! sum = sum + exp(sink − m)            with a sink logit
//! out[d] = (Σ_i e_i · v_i[d]) · (1 / sum)   each Σ in position order, from +0.0
//! ```
//!
//! A sink (gpt-oss's learned per-head logit) is a softmax term with no value: it takes
//! its share of the denominator and nothing else.
//!
//! Every operation is a separately rounded f32 operation (no FMA). SIMD tiers change the
//! order of work only (several keys, dimensions or queries at a time), never the
//! operations of one output, so they give these bits.
//!
//! A cache of f16 or Q8_0 values ([`super::kv`]) is read by widening each key and
//! value row to f32 (exact for f16; `q · d` for Q8_0), then exactly the above.

use super::kv::KvData;
use super::math::{dot, exp, max};
use crate::kernels::counters::{count, Op};
use crate::kernels::tier::Tier;

/// Most queries a tier's attention kernel takes per call (`Kernels::attend` cuts longer
/// lists).
pub const TILE_QUERIES: usize = 32;

/// One query: `q` (head_dim values) at position `pos`; `att` holds at least its visible
/// span (scratch for the scores), `out` gets head_dim values; `sink`, the head's sink
/// logit if it has one (attention sinks).
pub struct Query<'a> {
    pub q: &'a [f32],
    pub pos: usize,
    pub att: &'a mut [f32],
    pub out: &'a mut [f32],
    pub sink: Option<f32>,
}

/// The keys and values of one kv head, as the KV cache stores them: `k` and `v` hold
/// `cap` slots of `stride` values (f32, f16 or Q8_0, both of one type), position `p` in
/// slot `p % cap`, this head's values at offset `off` of a slot (for Q8_0, `stride` and
/// `off` are multiples of 32); a query at `t` sees positions `s` with `t − s < window`
/// (every earlier one without a window).
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub window: Option<usize>,
    pub cap: usize,
    pub stride: usize,
    pub off: usize,
}

impl<'a> KvView<'a> {
    /// The first position that position `pos` attends to.
    #[inline]
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// The key and value rows (`hd` values) of the positions `pos` sees.
    #[inline]
    pub(crate) fn rows(&self, pos: usize, hd: usize) -> Rows<'a> {
        let s0 = self.first_visible(pos);
        Rows {
            k: self.k,
            v: self.v,
            first: s0 % self.cap,
            cap: self.cap,
            stride: self.stride,
            off: self.off,
            hd,
            len: pos + 1 - s0,
        }
    }
}

/// The visible positions' key and value rows, in position order.
pub(crate) struct Rows<'a> {
    k: KvData<'a>,
    v: KvData<'a>,
    /// Slot of the first visible position.
    first: usize,
    cap: usize,
    stride: usize,
    off: usize,
    hd: usize,
    /// Visible positions.
    pub len: usize,
}

impl<'a> Rows<'a> {
    /// The slot of the `i`-th visible position.
    #[inline(always)]
    pub fn slot(&self, i: usize) -> usize {
        let slot = self.first + i;
        if slot >= self.cap {
            slot - self.cap
        } else {
            slot
        }
    }

    /// Start of the row of the `i`-th visible position.
    #[inline(always)]
    fn at(&self, i: usize) -> usize {
        self.slot(i) * self.stride + self.off
    }

    /// The key of the `i`-th visible position in f32 (widened into `buf` unless the
    /// cache is f32).
    #[inline(always)]
    pub fn k<'b>(&self, i: usize, buf: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        self.k.row(self.at(i), self.hd, buf)
    }

    /// The value of the `i`-th visible position, as [`Rows::k`].
    #[inline(always)]
    pub fn v<'b>(&self, i: usize, buf: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        self.v.row(self.at(i), self.hd, buf)
    }
}

/// Head sizes up to this widen their rows on the stack.
const STACK_ROW: usize = 512;

/// The slice maximum and `exp` a tier's softmax runs (with the bits of
/// [`math::max`](super::math::max) and [`math::exp`](exp)). A trait
/// with `#[inline(always)]` methods rather than closures, so that a SIMD tier's
/// versions inline into its `#[target_feature]` kernel.
pub(crate) trait SoftmaxMath {
    fn max(v: &[f32]) -> f32;
    fn exp(v: &mut [f32]);
}

/// The reference's.
pub(crate) struct ScalarMath;

impl SoftmaxMath for ScalarMath {
    #[inline(always)]
    fn max(v: &[f32]) -> f32 {
        max(v)
    }

    #[inline(always)]
    fn exp(v: &mut [f32]) {
        for x in v {
            *x = exp(*x);
        }
    }
}

/// Softcap, then `att = exp(att − max)` in place (the maximum taken with the sink
/// logit, if any); returns the sum (in order, then the sink's term).
#[inline(always)]
pub(crate) fn softmax<M: SoftmaxMath>(att: &mut [f32], softcap: f32, sink: Option<f32>) -> f32 {
    let e_sink = softmax_exp::<M>(att, softcap, sink);
    let mut sum = 0.0f32;
    for &a in att.iter() {
        sum += a;
    }
    with_sink(sum, e_sink)
}

/// [`softmax`] without its sum: a tile's kernel sums several queries' rows at once.
/// Returns the sink's term `exp(sink − m)`, if there is a sink.
#[inline(always)]
pub(crate) fn softmax_exp<M: SoftmaxMath>(
    att: &mut [f32],
    softcap: f32,
    sink: Option<f32>,
) -> Option<f32> {
    if softcap > 0.0 {
        for a in att.iter_mut() {
            *a = softcap * (*a / softcap).tanh();
        }
    }
    let mut m = M::max(att);
    if let Some(s) = sink {
        m = m.max(s);
    }
    for a in att.iter_mut() {
        *a -= m;
    }
    M::exp(att);
    sink.map(|s| exp(s - m))
}

/// The softmax's denominator: the scores' sum, then the sink's term if any.
#[inline(always)]
pub(crate) fn with_sink(sum: f32, e_sink: Option<f32>) -> f32 {
    match e_sink {
        Some(e) => sum + e,
        None => sum,
    }
}

/// The reference for one query; see the module docs.
pub fn attend_one(query: &mut Query, kv: &KvView, scale: f32, softcap: f32) {
    let (q, att, out) = (query.q, &mut *query.att, &mut *query.out);
    let rows = kv.rows(query.pos, q.len());
    let att = &mut att[..rows.len];
    let mut stack = [0f32; STACK_ROW];
    let mut heap = Vec::new();
    let buf = if q.len() <= STACK_ROW {
        &mut stack[..]
    } else {
        heap.resize(q.len(), 0.0);
        &mut heap[..]
    };
    for (i, a) in att.iter_mut().enumerate() {
        *a = dot(q, rows.k(i, buf)) * scale;
    }
    let sum = softmax::<ScalarMath>(att, softcap, query.sink);
    out.fill(0.0);
    for (i, &p) in att.iter().enumerate() {
        for (o, &v) in out.iter_mut().zip(rows.v(i, buf)) {
            *o += p * v;
        }
    }
    let inv = 1.0 / sum;
    for o in out {
        *o *= inv;
    }
}

/// The scalar tier's attention entry (see `table::AttendFn`): each query alone.
pub fn attend(qs: &mut [Query], kv: &KvView, scale: f32, softcap: f32) {
    count(Tier::Scalar, Op::Attend);
    for q in qs {
        attend_one(q, kv, scale, softcap);
    }
}
