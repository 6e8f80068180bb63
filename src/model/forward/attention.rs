//! A softmax-attention layer's mixer for a chunk of tokens, as work is scheduled: the
//! q/k/v(/gate) projections in one step, per token the biases, q/k norms (per head, or
//! over the whole projection) and RoPE, the keys and values into the cache, the
//! kernels' attention over the pool (with each head's sink logit, if any), the output
//! gate, wo and its bias. The arithmetic of attention itself (scores, softmax, value sums) is the
//! kernels' (the scalar reference and the tiers' versions), reached through
//! [`Kernels::attend`].
//!
//! Scheduling never splits one query's work, so neither the thread count nor the
//! grouping of queries changes a bit:
//!
//! * a prompt chunk whose positions fit the cache without wrapping is stored whole, then
//!   attended in tiles of tokens in parallel; per tile and kv head, one kernel call takes
//!   the query heads of that kv head for every token of the tile, so each block of keys
//!   and values is read once for up to [`TILE_QUERIES`] queries;
//! * a single token (decode), or a chunk in which a sliding layer's ring wraps, is
//!   stored and attended token by token, the heads in parallel: a task takes `per` query
//!   heads of one kv head (the most that still gives every thread a task), reading their
//!   keys and values once;
//! * in a batched step, each sequence's rows (a segment) run against its own cache as
//!   above, except that the single tokens of decoding sequences (the step's first
//!   segments) are attended in one parallel step for all of them.

use super::{tap_rows, Model, Scratch, Seg};
use crate::kernels::{pool, Kernels, Query, TILE_QUERIES};
use crate::model::config::RopeSel;
use crate::model::kv::LayerCache;
use crate::model::observer::Input;
use crate::model::ops::{add, sigmoid, PAR_MIN};
use crate::model::rope;
use crate::model::weights::AttnWeights;

/// The attention of one chunk: its queries and the layer's shape.
struct Heads<'a> {
    k: &'a Kernels,
    /// n × q_dim: the chunk's queries (normed, rotated).
    q: &'a [f32],
    /// The chunk's first position (unused for [`Heads::singles`]).
    p0: usize,
    hd: usize,
    qd: usize,
    n_heads: usize,
    n_kv_heads: usize,
    /// Query heads per kv head.
    group: usize,
    /// Length of a row of scores.
    al: usize,
    scale: f32,
    softcap: f32,
    /// n_heads sink logits (attn_sinks).
    sinks: Option<&'a [f32]>,
}

impl Heads<'_> {
    /// Query head `h` of chunk token `t`, into `out` with scores in `att`.
    fn query<'q>(
        &'q self,
        t: usize,
        h: usize,
        out: &'q mut [f32],
        att: &'q mut [f32],
    ) -> Query<'q> {
        self.query_at(t, h, self.p0 + t, out, att)
    }

    /// [`Heads::query`] at position `pos`.
    fn query_at<'q>(
        &'q self,
        t: usize,
        h: usize,
        pos: usize,
        out: &'q mut [f32],
        att: &'q mut [f32],
    ) -> Query<'q> {
        let at = t * self.qd + h * self.hd;
        Query {
            q: &self.q[at..at + self.hd],
            pos,
            att,
            out,
            sink: self.sinks.map(|s| s[h]),
        }
    }

    /// Query heads per task when `tokens` tokens are attended at once: the most (a
    /// divisor of the group) that still gives every thread a task.
    fn per(&self, tokens: usize) -> usize {
        (1..=self.group)
            .rev()
            .find(|&d| {
                self.group.is_multiple_of(d)
                    && tokens * self.n_kv_heads * (self.group / d) >= pool::threads()
            })
            .unwrap_or(1)
    }

    /// Every head of the tile of tokens `t0..` whose outputs are `out` (tokens × q_dim):
    /// per kv head, its query heads of every token of the tile in one kernel call, the
    /// scores in rows of `att`.
    fn tile(&self, cache: &LayerCache, t0: usize, out: &mut [f32], att: &mut [f32]) {
        let nt = out.len() / self.qd;
        let mut outs: Vec<Option<&mut [f32]>> = out.chunks_exact_mut(self.hd).map(Some).collect();
        for g in 0..self.n_kv_heads {
            let mut rows = att.chunks_exact_mut(self.al);
            let mut qs = Vec::with_capacity(nt * self.group);
            for t in 0..nt {
                for h in g * self.group..(g + 1) * self.group {
                    let o = outs[t * self.n_heads + h].take().expect("each head once");
                    let s = rows.next().expect("a row of scores per query of the tile");
                    qs.push(self.query(t0 + t, h, o, s));
                }
            }
            self.k
                .attend(&mut qs, &cache.head(g), self.scale, self.softcap);
        }
    }

    /// Every head of chunk token `t` (outputs `out`, q_dim), in parallel above
    /// [`PAR_MIN`]: a task takes `per` query heads of one kv head.
    fn token(&self, cache: &LayerCache, t: usize, out: &mut [f32], att: &mut [f32]) {
        let per = self.per(1);
        let pos = self.p0 + t;
        let visible = pos + 1 - cache.first_visible(pos);
        let (hd, al) = (self.hd, self.al);
        pool::parallel_if(visible * self.qd >= PAR_MIN).for_chunks2(
            (out, per * hd),
            (att, per * al),
            |i, o, s| {
                let h0 = i * per;
                let mut qs: Vec<Query> = o
                    .chunks_exact_mut(hd)
                    .zip(s.chunks_exact_mut(al))
                    .enumerate()
                    .map(|(j, (o, s))| self.query(t, h0 + j, o, s))
                    .collect();
                let kv = cache.head(h0 / self.group);
                self.k.attend(&mut qs, &kv, self.scale, self.softcap);
            },
        );
    }

    /// Token `t` of this step's queries belongs to a sequence with cache `caches[t]` at
    /// position `pos[t]`: every head of every token (outputs `out`, a q_dim row each)
    /// in one parallel step above [`PAR_MIN`], a task taking `per` query heads of one
    /// kv head of one token. `att` holds at least n_heads rows of scores per token.
    fn singles(&self, caches: &[&LayerCache], pos: &[usize], out: &mut [f32], att: &mut [f32]) {
        let n = caches.len();
        let per = self.per(n);
        let tasks = self.n_heads / per;
        let (hd, al) = (self.hd, self.al);
        let work: usize = caches
            .iter()
            .zip(pos)
            .map(|(c, &p)| p + 1 - c.first_visible(p))
            .sum();
        pool::parallel_if(work * self.qd >= PAR_MIN).for_chunks2(
            (out, per * hd),
            (&mut att[..n * self.n_heads * al], per * al),
            |i, o, s| {
                let (t, h0) = (i / tasks, (i % tasks) * per);
                let mut qs: Vec<Query> = o
                    .chunks_exact_mut(hd)
                    .zip(s.chunks_exact_mut(al))
                    .enumerate()
                    .map(|(j, (o, s))| self.query_at(t, h0 + j, pos[t], o, s))
                    .collect();
                let kv = caches[t].head(h0 / self.group);
                self.k.attend(&mut qs, &kv, self.scale, self.softcap);
            },
        );
    }
}

impl Model<'_> {
    /// Softmax attention of layer `l` for the step's `n` rows, each segment at its own
    /// positions against its own cache (input in `st.xb`, output in `st.xb2`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        k: &Kernels,
        st: &mut Scratch,
        segs: &mut [Seg],
        l: usize,
        a: &AttnWeights,
        rope: RopeSel,
        n: usize,
    ) {
        let c = &self.cfg;
        let (d, qd, kvd) = (c.dim, c.q_dim, c.kv_dim);
        // q, k, v (and the gate) as one step.
        let (x, qa) = (&st.xb[..n * d], &mut st.qa);
        let (q, kb, vb) = (
            &mut st.q[..n * qd],
            &mut st.kb[..n * kvd],
            &mut st.vb[..n * kvd],
        );
        match &a.wg {
            Some(wg) => k.project_each(
                &[&a.wq, &a.wk, &a.wv, wg],
                x,
                qa,
                &mut [q, kb, vb, &mut st.gate[..n * qd]],
            ),
            None => k.project_each(&[&a.wq, &a.wk, &a.wv], x, qa, &mut [q, kb, vb]),
        }
        self.prepare(k, st, a, rope, n);

        let shape = |q, p0| Heads {
            k,
            q,
            p0,
            hd: c.head_dim,
            qd,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            group: c.n_heads / c.n_kv_heads,
            al: st.att_len,
            scale: c.attn_scale,
            softcap: c.attn_softcap,
            sinks: a.sinks,
        };
        let kv = |t: usize| {
            (
                &st.kb[t * kvd..(t + 1) * kvd],
                &st.vb[t * kvd..(t + 1) * kvd],
            )
        };
        let mix = &mut st.mix[..n * qd];
        let att = &mut st.att;
        // Decoding sequences (one token each, the first segments): stored, then
        // attended together, as many at a time as `att` holds scores for.
        let singles = segs.iter().take_while(|s| s.n == 1).count();
        let (ones, rest) = segs.split_at_mut(if singles > 1 { singles } else { 0 });
        if !ones.is_empty() {
            for s in ones.iter_mut() {
                let (kr, vr) = kv(s.r0);
                let cache = s.seq.caches[l]
                    .as_mut()
                    .expect("attention layer has a cache");
                cache.store(k, s.p0, kr, vr);
            }
            let fit = (att.len() / (st.att_len * c.n_heads)).max(1);
            for (i, group) in ones.chunks(fit).enumerate() {
                let caches: Vec<&LayerCache> = group
                    .iter()
                    .map(|s| {
                        s.seq.caches[l]
                            .as_ref()
                            .expect("attention layer has a cache")
                    })
                    .collect();
                let pos: Vec<usize> = group.iter().map(|s| s.p0).collect();
                let rows = i * fit * qd..(i * fit + group.len()) * qd;
                let heads = shape(&st.q[rows.clone()], 0);
                heads.singles(&caches, &pos, &mut mix[rows], att);
            }
        }
        for s in rest.iter_mut() {
            let (r0, n, p0) = (s.r0, s.n, s.p0);
            let cache = s.seq.caches[l]
                .as_mut()
                .expect("attention layer has a cache");
            let heads = shape(&st.q[r0 * qd..(r0 + n) * qd], p0);
            let mix = &mut mix[r0 * qd..(r0 + n) * qd];
            if p0 + n <= cache.cap {
                // No slot of this chunk overwrites one that an earlier token still needs:
                // store the whole chunk, then run the tokens in parallel.
                for t in 0..n {
                    let (kr, vr) = kv(r0 + t);
                    cache.store(k, p0 + t, kr, vr);
                }
                let cache = &*cache;
                if n == 1 {
                    heads.token(cache, 0, mix, att);
                } else {
                    let tile = (TILE_QUERIES / heads.group).max(1);
                    pool::parallel_if(n * (p0 + n) * qd >= PAR_MIN).for_chunks2(
                        (mix, tile * qd),
                        (&mut att[..], tile * heads.group * heads.al),
                        |i, o, s| heads.tile(cache, i * tile, o, s),
                    );
                }
            } else {
                // A ring that wraps inside the chunk: store and attend token by token.
                for t in 0..n {
                    let (kr, vr) = kv(r0 + t);
                    cache.store(k, p0 + t, kr, vr);
                    heads.token(cache, t, &mut mix[t * qd..(t + 1) * qd], att);
                }
            }
        }
        if c.attn_gate {
            for (m, &g) in mix.iter_mut().zip(&st.gate[..n * qd]) {
                *m *= sigmoid(g);
            }
        }
        tap_rows(segs, l, Input::Wo, mix);
        let out = &mut st.xb2[..n * d];
        k.project(&a.wo, mix, &mut st.qa, out);
        if let Some(bo) = a.bo {
            out.chunks_exact_mut(d).for_each(|r| add(r, bo));
        }
    }

    /// Per token of the chunk: the biases, the per-head q/k norms and RoPE on `st.q`
    /// and `st.kb` (`st.vb` gets its bias).
    fn prepare(&self, k: &Kernels, st: &mut Scratch, a: &AttnWeights, rope: RopeSel, n: usize) {
        let c = &self.cfg;
        let (hd, qd, kvd, rd, eps) = (c.head_dim, c.q_dim, c.kv_dim, c.rot_dim, c.norm_eps);
        let whole = c.qk_norm_whole;
        let cs: Option<&[f32]> = match rope {
            RopeSel::Global => Some(&st.cs_global),
            RopeSel::Local => Some(&st.cs_local),
            RopeSel::None => None,
        };
        let prep = |t: usize, q: &mut [f32], kr: &mut [f32], v: &mut [f32]| {
            for (x, b) in [(&mut *q, a.bq), (&mut *kr, a.bk), (&mut *v, a.bv)] {
                if let Some(b) = b {
                    add(x, b);
                }
            }
            for (x, w) in [(&mut *q, a.q_norm), (&mut *kr, a.k_norm)] {
                match w {
                    // Over the whole projection (qk_norm 2).
                    Some(w) if whole => k.rmsnorm_inplace(x, w, eps),
                    Some(w) => x
                        .chunks_exact_mut(hd)
                        .for_each(|h| k.rmsnorm_inplace(h, w, eps)),
                    None => {}
                }
            }
            if let Some(cs) = cs {
                let cs = &cs[t * rd..(t + 1) * rd];
                rope::apply(q, hd, cs);
                rope::apply(kr, hd, cs);
            }
        };
        pool::parallel_if(n * qd >= PAR_MIN).for_chunks3(
            (&mut st.q[..n * qd], qd),
            (&mut st.kb[..n * kvd], kvd),
            (&mut st.vb[..n * kvd], kvd),
            prep,
        );
    }
}
