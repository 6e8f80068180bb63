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
//! Every matrix input goes to the kernels as f32 rows ([`Kernels::project`]): BF16 / F16
//! matrices take them as they are, the quantized types as Q8_0 activations ([`QActs`]),
//! quantized once per input however many matrices share it.
//! Each position's arithmetic is the same whether it comes in a batch or alone, and the
//! kernels' matmul and matvec give the same bits, so prefill and token-by-token decoding
//! produce identical logits; so does any thread count.

mod attention;

use std::any::Any;

use super::config::{Act, Config, LayerKind};
use super::delta::DeltaState;
use super::kv::LayerCache;
use super::observer::{tap, Collector, Input, Observer};
use super::ops::{add, for_rows, rmsnorm_inplace, rmsnorm_rows, Zeros};
use super::rope::RopeTable;
use super::weights::{LinearWeights, MixerWeights, Packs, Weights};
use super::{ModelError, Result};
use crate::format::mlb::Mlb;
use crate::format::mli::Mli;
use crate::kernels::{self, Kernels, QActs, TILE_QUERIES};

/// The default context is max_seq, capped at this.
pub const DEFAULT_CTX_CAP: usize = 4096;
/// Default tokens per prefill chunk.
pub const DEFAULT_BATCH: usize = 512;
/// Rows of logits per classifier matmul when every position's logits are wanted.
const LOGIT_ROWS: usize = 16;

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
    observer: Option<Box<dyn Observer>>,
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
        let o: &dyn Any = self.observer.as_deref()?;
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

    /// Shows every following matrix input to `o`.
    pub fn set_observer(&mut self, o: Box<dyn Observer>) {
        self.observer = Some(o);
    }

    /// Removes the observer.
    pub fn take_observer(&mut self) -> Option<Box<dyn Observer>> {
        self.observer.take()
    }

    /// Removes the observer if it is a `T`.
    pub fn take_observer_as<T: Observer>(&mut self) -> Option<Box<T>> {
        let o = self.observer.take()?;
        let any: Box<dyn Any> = o;
        any.downcast::<T>().ok()
    }
}

/// `xb = rmsnorm(x, norm)` over the chunk's `len` values: a branch's input, shown to
/// the observer as input `at` (layer, which input).
fn branch_input(st: &mut State, len: usize, norm: &[f32], c: &Config, at: (usize, Input)) {
    let (x, xb) = (&st.x[..len], &mut st.xb[..len]);
    rmsnorm_rows(xb, x, norm, c.dim, c.norm_eps);
    tap(&mut st.observer, at.0, at.1, xb);
}

/// `x += post_norm(xb2)` over the chunk's `len` values: a branch's output, through its
/// post norm when the layer has one, added to the residual stream.
fn residual(st: &mut State, len: usize, post_norm: Option<&[f32]>, c: &Config) {
    if let Some(w) = post_norm {
        for_rows(&mut st.xb2[..len], c.dim, |_, r| {
            rmsnorm_inplace(r, w, c.norm_eps)
        });
    }
    add(&mut st.x[..len], &st.xb2[..len]);
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

    /// Allocates every buffer of a forward pass once. The bytes are summed first
    /// (checked); a context whose buffers cannot be allocated is a `BadOption` naming
    /// `--ctx` and the bytes needed, never an abort.
    pub fn state(&self, opts: &Options) -> Result<State> {
        let ctx = self.context(opts)?;
        let mut count = Zeros::counting();
        self.buffers(opts, ctx, &mut count);
        let mut alloc = Zeros::allocating();
        let mut st = self.buffers(opts, ctx, &mut alloc);
        // `qa` is sized once, last, by quantizing a zero input of the widest matrix
        // input (a chunk of `cap` tokens).
        let widest = self.widest_input();
        let x0 = alloc.take(&[st.cap, widest]);
        if alloc.ok() {
            st.qa.quantize_with(&kernels::kernels(), &x0, widest);
            return Ok(st);
        }
        let bytes = match count.bytes() {
            Some(b) => format!("{b} bytes"),
            None => "more bytes than a 128-bit count holds".into(),
        };
        Err(ModelError::BadOption {
            name: "--ctx",
            value: ctx.to_string(),
            rule: format!(
                "the KV cache and buffers of this context need {bytes}, more than can be allocated here: lower --ctx (or --batch)"
            ),
        })
    }

    /// The widest matrix input: dim, hidden_dim, q_dim or the delta rule's V·dv.
    fn widest_input(&self) -> usize {
        let c = &self.cfg;
        c.dim.max(c.hidden_dim).max(c.q_dim).max(c.lin_v_total)
    }

    /// The state for `ctx` positions with the buffers `z` gives (empty when counting).
    fn buffers(&self, opts: &Options, ctx: usize, z: &mut Zeros) -> State {
        let c = &self.cfg;
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
                    Some(LayerCache {
                        k: z.take(&[slots, c.kv_dim]),
                        v: z.take(&[slots, c.kv_dim]),
                        cap: slots,
                        window,
                        kv_dim: c.kv_dim,
                    })
                }
                LayerKind::Linear => None,
            })
            .collect();
        let delta = c
            .layers
            .iter()
            .map(|l| (*l == LayerKind::Linear).then(|| DeltaState::new(c, z)))
            .collect();
        let att_len = att_len.max(1);
        let mix_w = c.q_dim.max(c.lin_v_total);
        // `qa` (sized by `state`): a zero input of the widest matrix input, 4 bytes per
        // value, and its quants, their Q4_0 arrangement (a byte per value each), and a
        // scale and a sum per block.
        let widest = self.widest_input() as u128;
        z.add(Some(cap as u128 * widest * 25 / 4));
        State {
            ctx,
            cap,
            pos: 0,
            x: z.take(&[cap, c.dim]),
            xb: z.take(&[cap, c.dim]),
            xb2: z.take(&[cap, c.dim]),
            q: z.take(&[cap, c.q_dim]),
            gate: if c.attn_gate {
                z.take(&[cap, c.q_dim])
            } else {
                Vec::new()
            },
            kb: z.take(&[cap, c.kv_dim]),
            vb: z.take(&[cap, c.kv_dim]),
            mix: z.take(&[cap, mix_w]),
            hb: z.take(&[cap, c.hidden_dim]),
            hb2: z.take(&[cap, c.hidden_dim]),
            // Decode: a row per head; prefill: a row per query of each tile.
            att: z.take(&[(cap + TILE_QUERIES).max(c.n_heads), group, att_len]),
            att_len,
            cs_global: z.take(&[cap, c.rot_dim]),
            cs_local: if self.local.is_some() {
                z.take(&[cap, c.rot_dim])
            } else {
                Vec::new()
            },
            lqkv: z.take(&[cap, c.lin_qkv]),
            lz: z.take(&[cap, c.lin_v_total]),
            lb: z.take(&[cap, c.lin_v_heads]),
            la: z.take(&[cap, c.lin_v_heads]),
            logits: z.take(&[cap.min(LOGIT_ROWS), c.vocab]),
            qa: QActs::new(),
            caches,
            delta,
            observer: opts
                .imatrix
                .then(|| Box::new(Collector::new(c)) as Box<dyn Observer>),
        }
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
        let out = &mut st.logits[..m * v];
        k.project(&self.w.wcls, &st.xb[..m * d], &mut st.qa, out);
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
            k.dequant_row(&self.w.tok_emb, t as usize, row);
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
            branch_input(st, n * d, lw.attn_norm, c, (l, Input::Attn));
            match (&lw.mixer, c.layers[l]) {
                (MixerWeights::Attention(a), LayerKind::Attention { rope, .. }) => {
                    self.attention(k, st, l, a, rope, n, p0)
                }
                (MixerWeights::Linear(lin), _) => self.linear(k, st, l, lin, n),
                _ => unreachable!("layout and config agree on layer kinds"),
            }
            residual(st, n * d, lw.post_attn_norm, c);
            // FFN: W2 (act(W1 h) ⊙ W3 h).
            branch_input(st, n * d, lw.ffn_norm, c, (l, Input::W13));
            k.project_each(
                &[&lw.w1, &lw.w3],
                &st.xb[..n * d],
                &mut st.qa,
                &mut [&mut st.hb[..n * hid], &mut st.hb2[..n * hid]],
            );
            let up = &st.hb2[..n * hid];
            let act = c.act;
            for_rows(&mut st.hb[..n * hid], hid, |i, r| {
                let u = &up[i * hid..(i + 1) * hid];
                match act {
                    Act::Silu => k.silu_mul(r, u),
                    Act::GeluTanh => k.gelu_mul(r, u),
                }
            });
            tap(&mut st.observer, l, Input::W2, &st.hb[..n * hid]);
            k.project(&lw.w2, &st.hb[..n * hid], &mut st.qa, &mut st.xb2[..n * d]);
            residual(st, n * d, lw.post_ffn_norm, c);
        }
        st.pos += n;
    }

    /// The gated delta rule of layer `l` for the chunk's `n` tokens (input in `st.xb`,
    /// output in `st.xb2`).
    fn linear(&self, k: &Kernels, st: &mut State, l: usize, w: &LinearWeights, n: usize) {
        let c = &self.cfg;
        let (d, lq, lv, vh) = (c.dim, c.lin_qkv, c.lin_v_total, c.lin_v_heads);
        k.project_each(
            &[&w.lqkv, &w.lz, &w.lb, &w.la],
            &st.xb[..n * d],
            &mut st.qa,
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
                k,
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
        k.project(&w.lout, &st.mix[..n * lv], &mut st.qa, &mut st.xb2[..n * d]);
    }
}
