//! The forward pass: one code path for every architecture, driven by [`Config`] and
//! each layer's [`LayerKind`].
//!
//! For a chunk of tokens at positions `p0..p0+n` (prefill: the whole chunk at once
//! through `matmul`; decode: `n = 1`):
//!
//! ```text
//! x = dequant(tok_emb[token]) · embed_scale
//! per layer:
//!   h = rmsnorm(x, attn_norm)                       rmsnorm(x) = x / sqrt(mean(x²) + eps) · w
//!   attention:  q = Wq h (+bq), k = Wk h (+bk), v = Wv h (+bv)
//!               q, k per head: rmsnorm(q_norm / k_norm), then RoPE (global, local or none)
//!               a_h = Σ_s softmax_s(cap·tanh(attn_scale·q_h·k_s / cap)) v_s   over visible s
//!               (s ≤ t, and t − s < window on sliding layers; head h uses kv head h / (H/KV))
//!               o = Wo (a ⊙ sigmoid(Wg h))              (the gate only with attn_gate)
//!   linear:     o = lout(gated delta rule(lqkv h, lz h, lb h, la h))   (see `delta`)
//!   x = x + post_attn_norm(o)                           (the post norm only with post_norms)
//!   h = rmsnorm(x, ffn_norm)
//!   x = x + post_ffn_norm(W2 (act(W1 h) ⊙ W3 h))        act = SiLU or GELU (tanh)
//! logits = final_cap·tanh(Wcls rmsnorm(x, final_norm) / final_cap)
//! ```
//!
//! Every matrix input is quantized to Q8_0 ([`QActs`]) and multiplied by the kernels.
//! Each position's arithmetic is the same whether it comes in a batch or alone, and the
//! kernels' matmul and matvec give the same bits, so prefill and token-by-token decoding
//! produce identical logits; so does any thread count.

use crate::kernels::pool;

use super::attention::{attend_many, Query, TILE_QUERIES};
use super::config::{Act, Config, LayerKind, RopeSel};
use super::delta::DeltaState;
use super::imatrix::{tap, Collector, Input, Observer};
use super::kv::LayerCache;
use super::rope::{self, RopeTable};
use super::weights::{AttnWeights, LinearWeights, MixerWeights, Packs, Weights};
use super::{ModelError, Result};
use crate::format::mlb::Mlb;
use crate::format::mli::Mli;
use crate::kernels::{self, Kernels, QActs};

/// The default context is max_seq, capped at this.
pub const DEFAULT_CTX_CAP: usize = 4096;
/// Default tokens per prefill chunk.
pub const DEFAULT_BATCH: usize = 512;
/// Rows of logits per classifier matmul when every position's logits are wanted.
const LOGIT_ROWS: usize = 16;
/// Below this many multiply-adds, element-wise and attention work stays on one thread.
const PAR_MIN: usize = 1 << 15;

/// Called with each position and its logits (vocab values).
pub type LogitsSink<'f> = &'f mut dyn FnMut(usize, &[f32]);

/// How a [`State`] is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// KV cache positions; `None`: max_seq capped at [`DEFAULT_CTX_CAP`].
    pub ctx: Option<usize>,
    /// Most tokens per prefill matmul.
    pub batch: usize,
    /// Sliding layers keep a ring of their window (true), or the whole context masked
    /// to the window (false; for tests: the same results with more memory).
    pub ring: bool,
    /// Sum the squares of every matrix input per channel (an MLI1 importance matrix):
    /// the state starts with a [`Collector`] as its observer.
    pub imatrix: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ctx: None,
            batch: DEFAULT_BATCH,
            ring: true,
            imatrix: false,
        }
    }
}

/// A loaded model: its configuration, borrowed weights and RoPE tables.
pub struct Model<'a> {
    pub cfg: Config,
    pub w: Weights<'a>,
    /// rope_theta with the header's scaling.
    global: RopeTable,
    /// rope_local_theta, unscaled (only when a layer uses it).
    local: Option<RopeTable>,
}

/// Everything a forward pass writes, allocated once (llama2.c's RunState). `cap` is
/// the most tokens per chunk, `ctx` the KV positions.
pub struct State {
    ctx: usize,
    cap: usize,
    /// Positions processed so far.
    pos: usize,
    /// cap × dim: the residual stream.
    x: Vec<f32>,
    /// cap × dim: the normalized input of a branch (and of the classifier).
    xb: Vec<f32>,
    /// cap × dim: a branch's output (Wo / lout / W2).
    xb2: Vec<f32>,
    /// cap × q_dim: queries.
    q: Vec<f32>,
    /// cap × q_dim: attention gate pre-activations (attn_gate only, else empty).
    gate: Vec<f32>,
    /// cap × kv_dim: keys of the chunk.
    kb: Vec<f32>,
    /// cap × kv_dim: values of the chunk.
    vb: Vec<f32>,
    /// cap × max(q_dim, V·dv): the mixer's output before Wo / lout.
    mix: Vec<f32>,
    /// cap × hidden_dim: act(W1 h), then the product with W3 h.
    hb: Vec<f32>,
    /// cap × hidden_dim: W3 h.
    hb2: Vec<f32>,
    /// (max(cap + TILE_QUERIES, n_heads) × group) × att_len: attention scores, a row per
    /// head (decode) or per query of a prompt tile.
    att: Vec<f32>,
    /// Longest visible span of any attention layer.
    att_len: usize,
    /// cap × rot_dim: cos, sin per pair of the global table at each chunk position.
    cs_global: Vec<f32>,
    /// cap × rot_dim: the same for the local table (empty without local layers).
    cs_local: Vec<f32>,
    /// cap × (2·K·dk + V·dv): linear attention q, k, v channels.
    lqkv: Vec<f32>,
    /// cap × V·dv: linear attention output gate z.
    lz: Vec<f32>,
    /// cap × V: linear attention β pre-activations.
    lb: Vec<f32>,
    /// cap × V: linear attention decay pre-activations.
    la: Vec<f32>,
    /// min(cap, LOGIT_ROWS) × vocab: logits.
    logits: Vec<f32>,
    /// Q8_0 activations of the current matrix input (sized for the widest once).
    qa: QActs,
    /// Per layer: the KV cache of an attention layer.
    caches: Vec<Option<LayerCache>>,
    /// Per layer: the state of a linear-attention layer.
    delta: Vec<Option<DeltaState>>,
    /// Sees every matrix input (see `imatrix`); `None` normally.
    pub(crate) observer: Option<Box<dyn Observer>>,
}

impl State {
    /// Positions processed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// KV positions.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Bytes of the KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().flatten().map(LayerCache::bytes).sum()
    }

    /// Bytes of the linear-attention states.
    pub fn delta_bytes(&self) -> usize {
        self.delta.iter().flatten().map(DeltaState::bytes).sum()
    }

    /// The importance sums so far (with `Options::imatrix`, or a [`Collector`] set as
    /// the observer).
    pub fn imatrix(&self) -> Option<&Mli> {
        let o: &dyn std::any::Any = self.observer.as_deref()?;
        o.downcast_ref::<Collector>().map(Collector::mli)
    }

    /// Back to an empty context.
    pub fn reset(&mut self) {
        self.pos = 0;
        for d in self.delta.iter_mut().flatten() {
            d.reset();
        }
    }

    /// Per layer: the KV cache or the linear-attention state (for the session's
    /// snapshots, `crate::session`).
    pub(crate) fn layer_states(&self) -> (&[Option<LayerCache>], &[Option<DeltaState>]) {
        (&self.caches, &self.delta)
    }

    /// [`State::layer_states`], writable, with the position.
    pub(crate) fn layer_states_mut(
        &mut self,
    ) -> (
        &mut usize,
        &mut [Option<LayerCache>],
        &mut [Option<DeltaState>],
    ) {
        (&mut self.pos, &mut self.caches, &mut self.delta)
    }
}

/// Dot product with 8 partial sums in a fixed order: element `i` of each group of 8
/// goes to `acc[i]`, then `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`, then the tail
/// in order. The AVX2 attention computes exactly the same operations on one register.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    reduce8(acc, ra, rb)
}

#[inline(always)]
pub(crate) fn reduce8(acc: [f32; 8], ra: &[f32], rb: &[f32]) -> f32 {
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out = x / sqrt(mean(x²) + eps) · w`.
#[inline]
pub(crate) fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, &xv), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = xv * inv * wv;
    }
}

/// [`rmsnorm`] in place.
#[inline(always)]
pub(crate) fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for (xv, &wv) in x.iter_mut().zip(w) {
        *xv = *xv * inv * wv;
    }
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Runs `f(row_index, row)` over the rows of `buf` (rows of `width`), in parallel when
/// there is enough work. Rows are independent, so the result is the same either way.
fn for_rows(buf: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if buf.len() >= PAR_MIN && buf.len() > width {
        pool::for_chunks(buf, width, f);
    } else {
        buf.chunks_mut(width).enumerate().for_each(|(i, r)| f(i, r));
    }
}

/// `out[r] = rmsnorm(x[r], w)` for every row.
fn rmsnorm_rows(out: &mut [f32], x: &[f32], w: &[f32], width: usize, eps: f32) {
    for_rows(out, width, |i, o| {
        rmsnorm(o, &x[i * width..(i + 1) * width], w, eps)
    });
}

/// `x += y`.
fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl<'a> Model<'a> {
    /// The model of a validated file: configuration and borrowed weights, read from
    /// the map (see [`Model::with_packs`] for the packed layout).
    pub fn new(m: &'a Mlb) -> Result<Model<'a>> {
        Model::with_packs(m, &super::weights::NO_PACKS)
    }

    /// [`Model::new`] with the matrices' packed forms from `packs` (made by
    /// [`Packs::new`] for the tier that will run the model): same results, faster on
    /// tiers with packed kernels.
    pub fn with_packs(m: &'a Mlb, packs: &'a Packs) -> Result<Model<'a>> {
        let cfg = Config::new(m.header(), m.dims(), &m.parsed.flags);
        let w = Weights::new(m, packs)?;
        let global = RopeTable::global(&cfg.rope, cfg.head_dim, cfg.rot_dim);
        let local = cfg
            .has_local_rope()
            .then(|| RopeTable::local(&cfg.rope, cfg.head_dim, cfg.rot_dim));
        Ok(Model {
            cfg,
            w,
            global,
            local,
        })
    }

    /// The context a [`State`] with `opts` gets; `BadOption` if it cannot be used.
    pub fn context(&self, opts: &Options) -> Result<usize> {
        let max = self.cfg.max_seq;
        match opts.ctx {
            None => Ok(max.min(DEFAULT_CTX_CAP)),
            Some(0) => Err(ModelError::BadOption {
                name: "--ctx",
                value: "0".into(),
                rule: "the context must hold at least one position".into(),
            }),
            Some(n) if n > max => Err(ModelError::BadOption {
                name: "--ctx",
                value: n.to_string(),
                rule: format!("above the model's max_seq ({max})"),
            }),
            Some(n) => Ok(n),
        }
    }

    /// Allocates every buffer of a forward pass once.
    pub fn state(&self, opts: &Options) -> Result<State> {
        let c = &self.cfg;
        let ctx = self.context(opts)?;
        let cap = opts.batch.clamp(1, ctx);
        let group = c.n_heads / c.n_kv_heads.max(1);
        let mut att_len = 0;
        let caches: Vec<Option<LayerCache>> = c
            .layers
            .iter()
            .map(|l| match *l {
                LayerKind::Attention { window, .. } => {
                    let slots = match window {
                        Some(w) if opts.ring => w.min(ctx),
                        _ => ctx,
                    };
                    att_len = att_len.max(window.unwrap_or(ctx).min(ctx));
                    Some(LayerCache::new(slots, c.kv_dim, window))
                }
                LayerKind::Linear => None,
            })
            .collect();
        let delta = c
            .layers
            .iter()
            .map(|l| (*l == LayerKind::Linear).then(|| DeltaState::new(c)))
            .collect();
        let mix_w = c.q_dim.max(c.lin_v_total);
        let widest = c.dim.max(c.hidden_dim).max(mix_w);
        let mut qa = QActs::new();
        qa.quantize_with(&kernels::kernels(), &vec![0.0; cap * widest], widest);
        let v = |w: usize| vec![0.0f32; cap * w];
        Ok(State {
            ctx,
            cap,
            pos: 0,
            x: v(c.dim),
            xb: v(c.dim),
            xb2: v(c.dim),
            q: v(c.q_dim),
            gate: if c.attn_gate { v(c.q_dim) } else { Vec::new() },
            kb: v(c.kv_dim),
            vb: v(c.kv_dim),
            mix: v(mix_w),
            hb: v(c.hidden_dim),
            hb2: v(c.hidden_dim),
            // Decode: a row per head; prefill: a row per query of each tile.
            att: vec![0.0; (cap + TILE_QUERIES).max(c.n_heads) * group * att_len.max(1)],
            att_len: att_len.max(1),
            cs_global: v(c.rot_dim),
            cs_local: if self.local.is_some() {
                v(c.rot_dim)
            } else {
                Vec::new()
            },
            lqkv: v(c.lin_qkv),
            lz: v(c.lin_v_total),
            lb: v(c.lin_v_heads),
            la: v(c.lin_v_heads),
            logits: vec![0.0; cap.min(LOGIT_ROWS) * c.vocab],
            qa,
            caches,
            delta,
            observer: opts
                .imatrix
                .then(|| Box::new(Collector::new(c)) as Box<dyn Observer>),
        })
    }

    /// Checks that `tokens` can follow what `st` holds.
    fn check(&self, st: &State, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(ModelError::BadOption {
                name: "prompt",
                value: "empty".into(),
                rule: "at least one token is needed".into(),
            });
        }
        if let Some((index, &id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.cfg.vocab)
        {
            return Err(ModelError::TokenOutOfRange {
                index,
                id,
                vocab: self.cfg.vocab,
            });
        }
        let needed = st.pos + tokens.len();
        if needed > st.ctx {
            return Err(ModelError::ContextFull {
                needed,
                ctx: st.ctx,
            });
        }
        Ok(())
    }

    /// Runs `tokens` after what `st` holds, in chunks of at most `batch` tokens, and
    /// returns the logits of the last one. With `each`, every position's logits are
    /// computed and passed to it with the position.
    pub fn prefill<'s>(
        &self,
        st: &'s mut State,
        tokens: &[u32],
        mut each: Option<LogitsSink>,
    ) -> Result<&'s [f32]> {
        self.check(st, tokens)?;
        let k = kernels::kernels();
        let vocab = self.cfg.vocab;
        let mut last = 0;
        let chunks = tokens.chunks(st.cap);
        let n_chunks = chunks.len();
        for (ci, chunk) in chunks.enumerate() {
            let p0 = st.pos;
            self.layers(&k, st, chunk);
            let n = chunk.len();
            let first = match each {
                Some(_) => 0,
                None if ci + 1 == n_chunks => n - 1,
                None => n,
            };
            let mut r0 = first;
            while r0 < n {
                let r1 = (r0 + LOGIT_ROWS).min(n);
                self.classify(&k, st, r0, r1);
                if let Some(f) = each.as_mut() {
                    for r in r0..r1 {
                        f(p0 + r, &st.logits[(r - r0) * vocab..(r - r0 + 1) * vocab]);
                    }
                }
                last = r1 - r0 - 1;
                r0 = r1;
            }
        }
        Ok(&st.logits[last * vocab..(last + 1) * vocab])
    }

    /// One token after what `st` holds; returns its logits.
    pub fn decode<'s>(&self, st: &'s mut State, token: u32) -> Result<&'s [f32]> {
        self.prefill(st, &[token], None)
    }

    /// Logits of chunk rows `r0..r1` (whose residual stream is in `st.x`) into `st.logits`.
    fn classify(&self, k: &Kernels, st: &mut State, r0: usize, r1: usize) {
        let (d, v) = (self.cfg.dim, self.cfg.vocab);
        let m = r1 - r0;
        rmsnorm_rows(
            &mut st.xb[..m * d],
            &st.x[r0 * d..r1 * d],
            self.w.final_norm,
            d,
            self.cfg.norm_eps,
        );
        tap(&mut st.observer, 0, Input::Cls, &st.xb[..m * d]);
        st.qa.quantize_with(k, &st.xb[..m * d], d);
        let out = &mut st.logits[..m * v];
        k.matmul(&self.w.wcls, &st.qa, out);
        let cap = self.cfg.final_softcap;
        if cap > 0.0 {
            for_rows(out, v, |_, row| {
                for l in row {
                    *l = cap * (*l / cap).tanh();
                }
            });
        }
    }

    /// Embeds `toks` at positions `st.pos..` and runs every layer; the residual stream
    /// is left in `st.x` and `st.pos` advances.
    fn layers(&self, k: &Kernels, st: &mut State, toks: &[u32]) {
        let c = &self.cfg;
        let (n, d, hid) = (toks.len(), c.dim, c.hidden_dim);
        let p0 = st.pos;
        let es = c.embed_scale;
        for (row, &t) in st.x[..n * d].chunks_exact_mut(d).zip(toks) {
            kernels::dequant_row(&self.w.tok_emb, t as usize, row);
            if es != 1.0 {
                for v in row {
                    *v *= es;
                }
            }
        }
        let rd = c.rot_dim;
        for t in 0..n {
            self.global
                .cos_sin(p0 + t, &mut st.cs_global[t * rd..(t + 1) * rd]);
            if let Some(loc) = &self.local {
                loc.cos_sin(p0 + t, &mut st.cs_local[t * rd..(t + 1) * rd]);
            }
        }
        for (l, lw) in self.w.layers.iter().enumerate() {
            rmsnorm_rows(
                &mut st.xb[..n * d],
                &st.x[..n * d],
                lw.attn_norm,
                d,
                c.norm_eps,
            );
            tap(&mut st.observer, l, Input::Attn, &st.xb[..n * d]);
            match (&lw.mixer, c.layers[l]) {
                (MixerWeights::Attention(a), LayerKind::Attention { rope, .. }) => {
                    self.attention(k, st, l, a, rope, n, p0)
                }
                (MixerWeights::Linear(lin), _) => self.linear(k, st, l, lin, n),
                _ => unreachable!("layout and config agree on layer kinds"),
            }
            if let Some(w) = lw.post_attn_norm {
                for_rows(&mut st.xb2[..n * d], d, |_, r| {
                    rmsnorm_inplace(r, w, c.norm_eps)
                });
            }
            add(&mut st.x[..n * d], &st.xb2[..n * d]);
            // FFN: W2 (act(W1 h) ⊙ W3 h).
            rmsnorm_rows(
                &mut st.xb[..n * d],
                &st.x[..n * d],
                lw.ffn_norm,
                d,
                c.norm_eps,
            );
            tap(&mut st.observer, l, Input::W13, &st.xb[..n * d]);
            st.qa.quantize_with(k, &st.xb[..n * d], d);
            k.matmul_each(
                &[&lw.w1, &lw.w3],
                &st.qa,
                &mut [&mut st.hb[..n * hid], &mut st.hb2[..n * hid]],
            );
            let up = &st.hb2[..n * hid];
            let act = c.act;
            for_rows(&mut st.hb[..n * hid], hid, |i, r| {
                let u = &up[i * hid..(i + 1) * hid];
                match act {
                    Act::Silu => super::vmath::silu_mul(r, u),
                    Act::GeluTanh => super::vmath::gelu_mul(r, u),
                }
            });
            tap(&mut st.observer, l, Input::W2, &st.hb[..n * hid]);
            st.qa.quantize_with(k, &st.hb[..n * hid], hid);
            k.matmul(&lw.w2, &st.qa, &mut st.xb2[..n * d]);
            if let Some(w) = lw.post_ffn_norm {
                for_rows(&mut st.xb2[..n * d], d, |_, r| {
                    rmsnorm_inplace(r, w, c.norm_eps)
                });
            }
            add(&mut st.x[..n * d], &st.xb2[..n * d]);
        }
        st.pos += n;
    }

    /// Softmax attention of layer `l` for the chunk's `n` tokens (input in `st.xb`,
    /// output in `st.xb2`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
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
        let (d, hd, qd, kvd) = (c.dim, c.head_dim, c.q_dim, c.kv_dim);
        st.qa.quantize_with(k, &st.xb[..n * d], d);
        let (q, kb, vb) = (
            &mut st.q[..n * qd],
            &mut st.kb[..n * kvd],
            &mut st.vb[..n * kvd],
        );
        match &a.wg {
            Some(wg) => k.matmul_each(
                &[&a.wq, &a.wk, &a.wv, wg],
                &st.qa,
                &mut [q, kb, vb, &mut st.gate[..n * qd]],
            ),
            None => k.matmul_each(&[&a.wq, &a.wk, &a.wv], &st.qa, &mut [q, kb, vb]),
        }
        // Biases, per-head q/k norms, RoPE: per token.
        let rd = c.rot_dim;
        let cs: Option<&[f32]> = match rope {
            RopeSel::Global => Some(&st.cs_global),
            RopeSel::Local => Some(&st.cs_local),
            RopeSel::None => None,
        };
        let eps = c.norm_eps;
        let prep = |t: usize, q: &mut [f32], kr: &mut [f32], v: &mut [f32]| {
            if let Some(b) = a.bq {
                add(q, b);
            }
            if let Some(b) = a.bk {
                add(kr, b);
            }
            if let Some(b) = a.bv {
                add(v, b);
            }
            if let Some(w) = a.q_norm {
                q.chunks_exact_mut(hd)
                    .for_each(|h| rmsnorm_inplace(h, w, eps));
            }
            if let Some(w) = a.k_norm {
                kr.chunks_exact_mut(hd)
                    .for_each(|h| rmsnorm_inplace(h, w, eps));
            }
            if let Some(cs) = cs {
                let cs = &cs[t * rd..(t + 1) * rd];
                rope::apply(q, hd, cs);
                rope::apply(kr, hd, cs);
            }
        };
        let (q, kb, vb) = (
            &mut st.q[..n * qd],
            &mut st.kb[..n * kvd],
            &mut st.vb[..n * kvd],
        );
        if n * qd >= PAR_MIN {
            pool::for_chunks3((q, qd), (kb, kvd), (vb, kvd), prep);
        } else {
            q.chunks_mut(qd)
                .zip(kb.chunks_mut(kvd))
                .zip(vb.chunks_mut(kvd))
                .enumerate()
                .for_each(|(t, ((q, kr), v))| prep(t, q, kr, v));
        }

        // Scores and weighted values.
        let cache = st.caches[l].as_mut().expect("attention layer has a cache");
        let group = c.n_heads / c.n_kv_heads;
        let (scale, softcap) = (c.attn_scale, c.attn_softcap);
        let al = st.att_len;
        let q = &st.q[..n * qd];
        let mix = &mut st.mix[..n * qd];
        // Tokens t0.. of a prompt tile, all heads: per kv head, its query heads of every
        // token of the tile at once (`attend_many`), scores in rows of `att`.
        let tile_tokens = (TILE_QUERIES / group).max(1);
        let tile = |cache: &LayerCache, t0: usize, out: &mut [f32], att: &mut [f32]| {
            let nt = out.len() / qd;
            let mut outs: Vec<Option<&mut [f32]>> = out.chunks_exact_mut(hd).map(Some).collect();
            for g in 0..c.n_kv_heads {
                let mut qs = Vec::with_capacity(nt * group);
                for ((t, h), s) in (0..nt)
                    .flat_map(|t| (g * group..(g + 1) * group).map(move |h| (t, h)))
                    .zip(att.chunks_exact_mut(al))
                {
                    let tq = (t0 + t) * qd + h * hd;
                    qs.push(Query {
                        q: &q[tq..tq + hd],
                        pos: p0 + t0 + t,
                        att: s,
                        out: outs[t * c.n_heads + h].take().expect("each head once"),
                    });
                }
                attend_many(&mut qs, cache, g * hd, scale, softcap);
            }
        };
        // All heads of token t, in parallel (scores in rows of `att`). A task takes `per`
        // query heads of one kv head, so that it reads their keys and values once; `per`
        // divides the group and is as large as still gives every thread a task.
        let per = (1..=group)
            .rev()
            .find(|&d| group.is_multiple_of(d) && c.n_kv_heads * (group / d) >= pool::threads())
            .unwrap_or(1);
        let heads = |cache: &LayerCache, t: usize, out: &mut [f32], att: &mut [f32]| {
            let visible = p0 + t + 1 - cache.first_visible(p0 + t);
            let go = |i: usize, o: &mut [f32], s: &mut [f32]| {
                let h0 = i * per;
                let mut qs: Vec<Query> = o
                    .chunks_exact_mut(hd)
                    .zip(s.chunks_exact_mut(al))
                    .enumerate()
                    .map(|(j, (o, s))| {
                        let at = t * qd + (h0 + j) * hd;
                        Query {
                            q: &q[at..at + hd],
                            pos: p0 + t,
                            att: s,
                            out: o,
                        }
                    })
                    .collect();
                attend_many(&mut qs, cache, (h0 / group) * hd, scale, softcap);
            };
            if visible * qd >= PAR_MIN {
                pool::for_chunks2(out, per * hd, att, per * al, go);
            } else {
                out.chunks_mut(per * hd)
                    .zip(att.chunks_mut(per * al))
                    .enumerate()
                    .for_each(|(i, (o, s))| go(i, o, s));
            }
        };
        if p0 + n <= cache.cap {
            // No slot of this chunk overwrites one that an earlier token still needs:
            // store the whole chunk, then run the tokens in parallel.
            for t in 0..n {
                cache.store(
                    p0 + t,
                    &st.kb[t * kvd..(t + 1) * kvd],
                    &st.vb[t * kvd..(t + 1) * kvd],
                );
            }
            let cache = &*cache;
            if n == 1 {
                heads(cache, 0, mix, &mut st.att);
            } else {
                let work = n * (p0 + n) * qd;
                let (tq, ta) = (tile_tokens * qd, tile_tokens * group * al);
                let run =
                    |i: usize, o: &mut [f32], s: &mut [f32]| tile(cache, i * tile_tokens, o, s);
                if work >= PAR_MIN {
                    pool::for_chunks2(mix, tq, &mut st.att, ta, run);
                } else {
                    mix.chunks_mut(tq)
                        .zip(st.att.chunks_mut(ta))
                        .enumerate()
                        .for_each(|(i, (o, s))| run(i, o, s));
                }
            }
        } else {
            // A ring that wraps inside the chunk: store and attend token by token.
            for t in 0..n {
                cache.store(
                    p0 + t,
                    &st.kb[t * kvd..(t + 1) * kvd],
                    &st.vb[t * kvd..(t + 1) * kvd],
                );
                heads(cache, t, &mut mix[t * qd..(t + 1) * qd], &mut st.att);
            }
        }
        if c.attn_gate {
            for (m, &g) in mix.iter_mut().zip(&st.gate[..n * qd]) {
                *m *= sigmoid(g);
            }
        }
        tap(&mut st.observer, l, Input::Wo, mix);
        st.qa.quantize_with(k, mix, qd);
        k.matmul(&a.wo, &st.qa, &mut st.xb2[..n * d]);
    }

    /// The gated delta rule of layer `l` for the chunk's `n` tokens (input in `st.xb`,
    /// output in `st.xb2`).
    fn linear(&self, k: &Kernels, st: &mut State, l: usize, w: &LinearWeights, n: usize) {
        let c = &self.cfg;
        let (d, lq, lv, vh) = (c.dim, c.lin_qkv, c.lin_v_total, c.lin_v_heads);
        st.qa.quantize_with(k, &st.xb[..n * d], d);
        k.matmul_each(
            &[&w.lqkv, &w.lz, &w.lb, &w.la],
            &st.qa,
            &mut [
                &mut st.lqkv[..n * lq],
                &mut st.lz[..n * lv],
                &mut st.lb[..n * vh],
                &mut st.la[..n * vh],
            ],
        );
        let ds = st.delta[l].as_mut().expect("linear layer has a state");
        for t in 0..n {
            ds.step(
                c,
                w,
                &mut st.lqkv[t * lq..(t + 1) * lq],
                &st.lz[t * lv..(t + 1) * lv],
                &st.lb[t * vh..(t + 1) * vh],
                &st.la[t * vh..(t + 1) * vh],
                &mut st.mix[t * lv..(t + 1) * lv],
            );
        }
        tap(&mut st.observer, l, Input::LinOut, &st.mix[..n * lv]);
        st.qa.quantize_with(k, &st.mix[..n * lv], lv);
        k.matmul(&w.lout, &st.qa, &mut st.xb2[..n * d]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_is_accurate() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let mut r = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        for n in [0usize, 1, 7, 8, 9, 16, 63, 64, 65, 130, 256] {
            let a: Vec<f32> = (0..n).map(|_| r() * 100.0).collect();
            let b: Vec<f32> = (0..n).map(|_| r()).collect();
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - exact).abs() < 1e-3 * (1.0 + exact.abs()));
        }
    }
}
