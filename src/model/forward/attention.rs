//! A softmax-attention layer's mixer for a chunk of tokens, as work is scheduled: the
//! q/k/v(/gate) projections in one step, per token the biases, q/k norms and RoPE, the
//! keys and values into the cache, the kernels' attention over the pool, the output
//! gate and wo. The arithmetic of attention itself (scores, softmax, value sums) is the
//! kernels' (`kernels::scalar_attn` and the tiers' versions), reached through
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
//!   keys and values once.

use super::{Model, State};
use crate::kernels::{pool, Kernels, Query, TILE_QUERIES};
use crate::model::config::RopeSel;
use crate::model::kv::LayerCache;
use crate::model::observer::{tap, Input};
use crate::model::ops::{add, rmsnorm_inplace, sigmoid, PAR_MIN};
use crate::model::rope;
use crate::model::weights::AttnWeights;

/// The attention of one chunk: its queries and the layer's shape.
struct Heads<'a> {
    k: &'a Kernels,
    /// n × q_dim: the chunk's queries (normed, rotated).
    q: &'a [f32],
    /// The chunk's first position.
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
        let at = t * self.qd + h * self.hd;
        Query {
            q: &self.q[at..at + self.hd],
            pos: self.p0 + t,
            att,
            out,
        }
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
                .attend(&mut qs, &cache.view(g * self.hd), self.scale, self.softcap);
        }
    }

    /// Every head of chunk token `t` (outputs `out`, q_dim), in parallel above
    /// [`PAR_MIN`]: a task takes `per` query heads of one kv head.
    fn token(&self, cache: &LayerCache, t: usize, out: &mut [f32], att: &mut [f32]) {
        let per = (1..=self.group)
            .rev()
            .find(|&d| {
                self.group.is_multiple_of(d)
                    && self.n_kv_heads * (self.group / d) >= pool::threads()
            })
            .unwrap_or(1);
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
                let kv = cache.view((h0 / self.group) * hd);
                self.k.attend(&mut qs, &kv, self.scale, self.softcap);
            },
        );
    }
}

impl Model<'_> {
    /// Softmax attention of layer `l` for the chunk's `n` tokens at positions `p0..`
    /// (input in `st.xb`, output in `st.xb2`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        k: &Kernels,
        st: &mut State,
        l: usize,
        a: &AttnWeights,
        rope: RopeSel,
        n: usize,
        p0: usize,
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
        self.prepare(st, a, rope, n);

        let cache = st.caches[l].as_mut().expect("attention layer has a cache");
        let heads = Heads {
            k,
            q: &st.q[..n * qd],
            p0,
            hd: c.head_dim,
            qd,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            group: c.n_heads / c.n_kv_heads,
            al: st.att_len,
            scale: c.attn_scale,
            softcap: c.attn_softcap,
        };
        let mix = &mut st.mix[..n * qd];
        let kv = |t: usize| {
            (
                &st.kb[t * kvd..(t + 1) * kvd],
                &st.vb[t * kvd..(t + 1) * kvd],
            )
        };
        if p0 + n <= cache.cap {
            // No slot of this chunk overwrites one that an earlier token still needs:
            // store the whole chunk, then run the tokens in parallel.
            for t in 0..n {
                let (kr, vr) = kv(t);
                cache.store(p0 + t, kr, vr);
            }
            let cache = &*cache;
            if n == 1 {
                heads.token(cache, 0, mix, &mut st.att);
            } else {
                let tile = (TILE_QUERIES / heads.group).max(1);
                pool::parallel_if(n * (p0 + n) * qd >= PAR_MIN).for_chunks2(
                    (mix, tile * qd),
                    (&mut st.att, tile * heads.group * heads.al),
                    |i, o, s| heads.tile(cache, i * tile, o, s),
                );
            }
        } else {
            // A ring that wraps inside the chunk: store and attend token by token.
            for t in 0..n {
                let (kr, vr) = kv(t);
                cache.store(p0 + t, kr, vr);
                heads.token(cache, t, &mut mix[t * qd..(t + 1) * qd], &mut st.att);
            }
        }
        if c.attn_gate {
            for (m, &g) in mix.iter_mut().zip(&st.gate[..n * qd]) {
                *m *= sigmoid(g);
            }
        }
        tap(&mut st.observer, l, Input::Wo, mix);
        k.project(&a.wo, mix, &mut st.qa, &mut st.xb2[..n * d]);
    }

    /// Per token of the chunk: the biases, the per-head q/k norms and RoPE on `st.q`
    /// and `st.kb` (`st.vb` gets its bias).
    fn prepare(&self, st: &mut State, a: &AttnWeights, rope: RopeSel, n: usize) {
        let c = &self.cfg;
        let (hd, qd, kvd, rd, eps) = (c.head_dim, c.q_dim, c.kv_dim, c.rot_dim, c.norm_eps);
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
                if let Some(w) = w {
                    x.chunks_exact_mut(hd)
                        .for_each(|h| rmsnorm_inplace(h, w, eps));
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
