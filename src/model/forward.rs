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
//!   (a mixture of experts: the chosen experts' FFNs, weighted; see `moe`)
//! logits = final_cap·tanh(Wcls rmsnorm(x, final_norm) / final_cap)
//! ```
//!
//! Attention variants: q/k norms per head or over the whole projection (qk_norm 2),
//! an output bias `bo` (qkv_bias 2), and a sink logit per head in the softmax
//! (attn_sinks; the kernels' `Query::sink`).
//!
//! Every matrix input goes to the kernels as f32 rows ([`Kernels::project`]): BF16 / F16
//! matrices take them as they are, the quantized types as Q8_0 activations ([`QActs`]),
//! quantized once per input however many matrices share it.
//! Each position's arithmetic is the same whether it comes in a batch or alone, and the
//! kernels' matmul and matvec give the same bits, so prefill and token-by-token decoding
//! produce identical logits; so does any thread count.
//!
//! A step's rows need not be one sequence's: [`Model::forward_batch`] runs the tokens of
//! several sequences, each with its own [`State`] (caches, delta states, position),
//! through every matrix together. The rows of a step are cut into segments (`Seg`), one
//! per sequence; everything but the mixer works on rows whatever their sequence, and
//! the mixer runs each segment against its own caches and delta states. So each
//! sequence's logits are those it gets alone.

mod attention;
mod moe;
mod moe_scratch;

use std::any::Any;

use super::config::{Act, Config, LayerKind};
use super::delta::DeltaState;
use super::error::{ModelError, Result};
use super::kv::{KvType, LayerCache};
use super::observer::{tap, Collector, Input, Observer};
use super::ops::{add, for_rows, rmsnorm_rows, Zeros};
use super::rope::RopeTable;
use super::weights::{FfnWeights, LinearWeights, MixerWeights, Packs, Weights};
use crate::format::mlb::Mlb;
use crate::format::mli::Mli;
use crate::kernels::{self, HalfActs, Kernels, QActs, TILE_QUERIES};

/// The default context is max_seq, capped at this.
pub const DEFAULT_CTX_CAP: usize = 4096;
/// Default tokens per prefill chunk.
pub const DEFAULT_BATCH: usize = 512;
/// Rows of logits per classifier matmul when every position's logits are wanted.
const LOGIT_ROWS: usize = 16;
/// Rows of logits per classifier matmul of a batched step (its sequences' last tokens
/// share one pass over the classifier).
const BATCH_LOGIT_ROWS: usize = 64;

/// Called with each position and its logits (vocab values).
pub type LogitsSink<'f> = &'f mut dyn FnMut(usize, &[f32]);

/// Called by [`Model::forward_batch`] with a sequence's index, a position and its
/// logits (vocab values).
pub type BatchSink<'f> = &'f mut dyn FnMut(usize, usize, &[f32]);

/// Called with each position and its final hidden state (dim values).
pub type HiddenSink<'f> = &'f mut dyn FnMut(usize, &[f32]);

/// What a sequence of a batched step ([`Model::forward_batch_with`]) gives its sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    /// The logits after its last id (vocab values).
    #[default]
    LastLogits,
    /// The logits after each of its ids (speculative decoding checks a draft with them).
    AllLogits,
    /// The final hidden state `rmsnorm(x, final_norm)` (dim values: the classifier's
    /// input) after its last id; no logits are computed.
    LastHidden,
    /// The final hidden state after each of its ids (embeddings with mean pooling).
    AllHidden,
}

impl Output {
    /// Every position's rows, not only the last.
    pub fn every(self) -> bool {
        matches!(self, Output::AllLogits | Output::AllHidden)
    }

    /// Hidden states instead of logits.
    pub fn hidden(self) -> bool {
        matches!(self, Output::LastHidden | Output::AllHidden)
    }
}

/// How a [`State`] is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateOptions {
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
    /// How the KV caches store keys and values: f32, f16 or Q8_0 (docs/kernels.md,
    /// "KV cache types").
    pub kv_type: KvType,
    /// Slots a sliding layer's ring keeps beyond its window: with `spare` ≥ r − 1 the
    /// session can always be truncated back by r positions (speculative decoding drops
    /// rejected drafts so). The same bits as without: a ring of any size ≥ the window
    /// gives the bits of masked full attention.
    pub spare: usize,
}

impl Default for StateOptions {
    fn default() -> Self {
        StateOptions {
            ctx: None,
            batch: DEFAULT_BATCH,
            ring: true,
            imatrix: false,
            kv_type: KvType::F32,
            spare: 0,
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
    /// What BF16 matrices multiply ([`Model::with_half_acts`]).
    half_acts: HalfActs,
}

/// One sequence's forward-pass state, allocated once (llama2.c's RunState): what the
/// sequence holds (position, KV caches, delta states) and the buffers of a step of up
/// to `cap` of its tokens. `ctx` is the KV positions.
pub struct State {
    seq: Seq,
    buf: Scratch,
}

/// What a sequence holds between steps.
struct Seq {
    ctx: usize,
    /// Positions processed so far.
    pos: usize,
    /// Per layer: the KV cache of an attention layer.
    caches: Vec<Option<LayerCache>>,
    /// Per layer: the state of a linear-attention layer.
    delta: Vec<Option<DeltaState>>,
    /// Sees every matrix input (see `imatrix`); `None` normally.
    observer: Option<Box<dyn Observer>>,
}

/// Every buffer a step writes, for up to `cap` rows (tokens of one sequence, or of
/// several in a batched step), allocated once.
struct Scratch {
    cap: usize,
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
    /// cap × rot_dim: cos, sin per pair of the global table at each row's position.
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
    /// logit_rows × vocab: logits.
    logits: Vec<f32>,
    /// min(cap, LOGIT_ROWS), or BATCH_LOGIT_ROWS for a batch.
    logit_rows: usize,
    /// Q8_0 activations of the current matrix input (sized for the widest once).
    qa: QActs,
    /// The mixture-of-experts FFNs' buffers (empty without them).
    moe: moe_scratch::MoeScratch,
}

/// The buffers of [`Model::forward_batch`]'s steps, shared by the sequences of a step
/// (made by [`Model::batch_scratch`], allocated once): room for `tokens()` rows of a
/// step, and attention scores for sequences of up to the context it was made for.
pub struct BatchScratch {
    buf: Scratch,
    ctx: usize,
    /// The step's ids, row by row.
    toks: Vec<u32>,
}

impl BatchScratch {
    /// Most tokens of one step (a longer batch runs as several steps).
    pub fn tokens(&self) -> usize {
        self.buf.cap
    }

    /// The longest context of the sequences it can run.
    pub fn ctx(&self) -> usize {
        self.ctx
    }
}

/// The rows `r0..r0 + n` of a step: one sequence's tokens at positions `p0..p0 + n`.
struct Seg<'s> {
    seq: &'s mut Seq,
    r0: usize,
    n: usize,
    p0: usize,
}

/// Shows the observers the rows of `rows` (one row per step row, each as wide as the
/// input): each segment's observer its own rows.
fn tap_rows(segs: &mut [Seg], layer: usize, input: Input, rows: &[f32]) {
    let total: usize = segs.iter().map(|s| s.n).sum();
    let w = rows.len() / total.max(1);
    for s in segs.iter_mut() {
        tap(
            &mut s.seq.observer,
            layer,
            input,
            &rows[s.r0 * w..(s.r0 + s.n) * w],
        );
    }
}

impl State {
    /// Positions processed so far.
    pub fn pos(&self) -> usize {
        self.seq.pos
    }

    /// KV positions.
    pub fn ctx(&self) -> usize {
        self.seq.ctx
    }

    /// Bytes of the KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.seq
            .caches
            .iter()
            .flatten()
            .map(LayerCache::bytes)
            .sum()
    }

    /// Bytes of the linear-attention states.
    pub fn delta_bytes(&self) -> usize {
        self.seq.delta.iter().flatten().map(DeltaState::bytes).sum()
    }

    /// The importance sums so far (with `StateOptions::imatrix`, or a [`Collector`] set as
    /// the observer).
    pub fn imatrix(&self) -> Option<&Mli> {
        let o: &dyn Any = self.seq.observer.as_deref()?;
        o.downcast_ref::<Collector>().map(Collector::mli)
    }

    /// Back to an empty context.
    pub fn reset(&mut self) {
        self.seq.pos = 0;
        for d in self.seq.delta.iter_mut().flatten() {
            d.reset();
        }
    }

    /// Per layer: the KV cache or the linear-attention state (for the session's
    /// snapshots, `crate::session`).
    pub(crate) fn layer_states(&self) -> (&[Option<LayerCache>], &[Option<DeltaState>]) {
        (&self.seq.caches, &self.seq.delta)
    }

    /// [`State::layer_states`], writable, with the position.
    pub(crate) fn layer_states_mut(
        &mut self,
    ) -> (
        &mut usize,
        &mut [Option<LayerCache>],
        &mut [Option<DeltaState>],
    ) {
        let s = &mut self.seq;
        (&mut s.pos, &mut s.caches, &mut s.delta)
    }

    /// Shows every following matrix input to `o`.
    pub fn set_observer(&mut self, o: Box<dyn Observer>) {
        self.seq.observer = Some(o);
    }

    /// Removes the observer.
    pub fn take_observer(&mut self) -> Option<Box<dyn Observer>> {
        self.seq.observer.take()
    }

    /// Removes the observer if it is a `T`.
    pub fn take_observer_as<T: Observer>(&mut self) -> Option<Box<T>> {
        let o = self.seq.observer.take()?;
        let any: Box<dyn Any> = o;
        any.downcast::<T>().ok()
    }
}

/// `xb = rmsnorm(x, norm)` over the step's `len` values: a branch's input, shown to
/// the observers as input `at` (layer, which input).
fn branch_input(
    k: &Kernels,
    st: &mut Scratch,
    segs: &mut [Seg],
    len: usize,
    norm: &[f32],
    c: &Config,
    at: (usize, Input),
) {
    let (x, xb) = (&st.x[..len], &mut st.xb[..len]);
    rmsnorm_rows(k, xb, x, norm, c.dim, c.norm_eps);
    tap_rows(segs, at.0, at.1, xb);
}

/// `x += post_norm(xb2)` over the chunk's `len` values: a branch's output, through its
/// post norm when the layer has one, added to the residual stream.
fn residual(k: &Kernels, st: &mut Scratch, len: usize, post_norm: Option<&[f32]>, c: &Config) {
    if let Some(w) = post_norm {
        for_rows(&mut st.xb2[..len], c.dim, |_, r| {
            k.rmsnorm_inplace(r, w, c.norm_eps)
        });
    }
    add(&mut st.x[..len], &st.xb2[..len]);
}

/// Bytes asked of `z`, as the text of an allocation error.
fn bytes_text(z: &Zeros) -> String {
    match z.bytes() {
        Some(b) => format!("{b} bytes"),
        None => "more bytes than a 128-bit count holds".into(),
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
            half_acts: HalfActs::F32,
        })
    }

    /// This model with its BF16 matrices multiplying `a` activations: f32 (the
    /// default: exact products) or rounded to BF16 (docs/kernels.md, "BF16
    /// activations": llama.cpp's arithmetic, `vdpbf16ps`). Other types are unaffected.
    pub fn with_half_acts(mut self, a: HalfActs) -> Model<'a> {
        self.set_half_acts(a);
        self
    }

    /// [`Model::with_half_acts`] in place.
    pub fn set_half_acts(&mut self, a: HalfActs) {
        self.half_acts = a;
    }

    /// What the model's BF16 matrices multiply.
    pub fn half_acts(&self) -> HalfActs {
        self.half_acts
    }

    /// The kernels a step runs: the active tier's, with this model's activations.
    fn kernels(&self) -> Kernels {
        kernels::kernels().with_half_acts(self.half_acts)
    }

    /// The context a [`State`] with `opts` gets; `BadOption` if it cannot be used.
    pub fn context(&self, opts: &StateOptions) -> Result<usize> {
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
    pub fn state(&self, opts: &StateOptions) -> Result<State> {
        let ctx = self.context(opts)?;
        let cap = opts.batch.clamp(1, ctx);
        let make = |z: &mut Zeros| State {
            seq: self.seq(opts, ctx, z),
            buf: self.scratch(cap, self.att_len(ctx), cap.min(LOGIT_ROWS), z),
        };
        self.allocate(make, |st| &mut st.buf).map_err(|bytes| ModelError::BadOption {
            name: "--ctx",
            value: ctx.to_string(),
            rule: format!(
                "the KV cache and buffers of this context need {bytes}, more than can be allocated here: lower --ctx (or --batch)"
            ),
        })
    }

    /// The buffers of [`Model::forward_batch`] for steps of up to `tokens` rows and
    /// sequences of up to `ctx` positions (`None`: the default context), allocated once
    /// (fallibly, like [`Model::state`]).
    pub fn batch_scratch(&self, tokens: usize, ctx: Option<usize>) -> Result<BatchScratch> {
        let ctx = self.context(&StateOptions {
            ctx,
            ..StateOptions::default()
        })?;
        let cap = tokens.max(1);
        let make = |z: &mut Zeros| BatchScratch {
            buf: self.scratch(cap, self.att_len(ctx), cap.min(BATCH_LOGIT_ROWS), z),
            ctx,
            toks: Vec::new(),
        };
        let mut bs = self
            .allocate(make, |b| &mut b.buf)
            .map_err(|bytes| ModelError::BadOption {
                name: "batch",
                value: tokens.to_string(),
                rule: format!(
                    "the buffers of a batched step of this many tokens (context {ctx}) need {bytes}, more than can be allocated here"
                ),
            })?;
        bs.toks
            .try_reserve_exact(cap)
            .map_err(|_| ModelError::BadOption {
                name: "batch",
                value: tokens.to_string(),
                rule: "cannot allocate the ids of a step".into(),
            })?;
        Ok(bs)
    }

    /// Bytes of a [`BatchScratch`] for `tokens` rows and a context of `ctx` (counted,
    /// not allocated).
    pub fn batch_scratch_bytes(&self, tokens: usize, ctx: usize) -> Option<u128> {
        let mut z = Zeros::counting();
        let cap = tokens.max(1);
        self.scratch(cap, self.att_len(ctx), cap.min(BATCH_LOGIT_ROWS), &mut z);
        z.add(Some(cap as u128 * 4));
        z.bytes()
    }

    /// Memory of one sequence's [`State`] with `opts` (computed, not allocated): the KV
    /// caches (and per position), the delta states, the step buffers.
    pub fn slot_memory(&self, opts: &StateOptions) -> Result<SlotMemory> {
        let ctx = self.context(opts)?;
        let cap = opts.batch.clamp(1, ctx);
        let c = &self.cfg;
        let row = opts.kv_type.row_bytes(c.n_kv_heads, c.head_dim) as u128 * 2;
        let (mut kv, mut full, mut delta) = (0u128, 0, 0u128);
        for l in &c.layers {
            match *l {
                LayerKind::Attention { window, .. } => {
                    let slots = match window {
                        Some(w) if opts.ring => w.saturating_add(opts.spare).min(ctx),
                        _ => ctx,
                    };
                    kv += slots as u128 * row;
                    full += usize::from(window.is_none());
                }
                LayerKind::Linear => delta += DeltaState::bytes_for(c) as u128,
            }
        }
        let mut z = Zeros::counting();
        self.scratch(cap, self.att_len(ctx), cap.min(LOGIT_ROWS), &mut z);
        Ok(SlotMemory {
            ctx,
            kv_type: opts.kv_type,
            kv_per_position: full * row as usize,
            kv,
            delta,
            buffers: z.bytes().unwrap_or(u128::MAX),
        })
    }

    /// Counts the bytes `make` asks for, then allocates them (zeroed, without aborting);
    /// the scratch's `qa` is sized last by quantizing a zero input of the widest matrix
    /// input. `Err` with the bytes needed when they cannot be allocated.
    fn allocate<T>(
        &self,
        make: impl Fn(&mut Zeros) -> T,
        scratch: impl Fn(&mut T) -> &mut Scratch,
    ) -> std::result::Result<T, String> {
        let mut count = Zeros::counting();
        make(&mut count);
        let mut alloc = Zeros::allocating();
        let mut t = make(&mut alloc);
        let s = scratch(&mut t);
        let (rows, cols) = self.widest_input(s.cap);
        let x0 = alloc.take(&[rows, cols]);
        let sh = self
            .cfg
            .moe
            .map_or(0, |m| m.shared_hidden)
            .max(self.cfg.dim);
        let x1 = alloc.take(&[if self.cfg.has_moe() { s.cap } else { 0 }, sh]);
        if alloc.ok() {
            let k = kernels::kernels();
            k.quantize_acts(&x0, cols, &mut s.qa);
            if !x1.is_empty() {
                k.quantize_acts(&x1, sh, &mut s.moe.qa);
            }
            return Ok(t);
        }
        Err(bytes_text(&count))
    }

    /// The largest matrix input of a step of `cap` rows, as (rows, cols): `cap` rows of
    /// the widest of dim, hidden_dim, q_dim and the delta rule's V·dv, or a mixture of
    /// experts' gathered rows (`cap · k` of dim, or of expert_hidden for the downs).
    fn widest_input(&self, cap: usize) -> (usize, usize) {
        let c = &self.cfg;
        let widest = c.dim.max(c.hidden_dim).max(c.q_dim).max(c.lin_v_total);
        let (k, eh) = c
            .moe
            .filter(|_| c.has_moe())
            .map_or((0, 0), |m| (m.k, m.expert_hidden));
        let gathered = c.dim.max(eh);
        if cap * k * gathered > cap * widest {
            (cap * k, gathered)
        } else {
            (cap, widest)
        }
    }

    /// The longest span a query of any attention layer sees in a context of `ctx`.
    fn att_len(&self, ctx: usize) -> usize {
        let spans = self.cfg.layers.iter().map(|l| match *l {
            LayerKind::Attention { window, .. } => window.unwrap_or(ctx).min(ctx),
            LayerKind::Linear => 0,
        });
        spans.max().unwrap_or(0).max(1)
    }

    /// A sequence's caches and delta states for `ctx` positions, from `z`.
    fn seq(&self, opts: &StateOptions, ctx: usize, z: &mut Zeros) -> Seq {
        let c = &self.cfg;
        let caches: Vec<Option<LayerCache>> = c
            .layers
            .iter()
            .map(|l| match *l {
                LayerKind::Attention { window, .. } => {
                    let slots = match window {
                        Some(w) if opts.ring => w.saturating_add(opts.spare).min(ctx),
                        _ => ctx,
                    };
                    Some(LayerCache::new_in(
                        opts.kv_type,
                        slots,
                        c.n_kv_heads,
                        c.head_dim,
                        window,
                        z,
                    ))
                }
                LayerKind::Linear => None,
            })
            .collect();
        let delta = c
            .layers
            .iter()
            .map(|l| (*l == LayerKind::Linear).then(|| DeltaState::new(c, z)))
            .collect();
        Seq {
            ctx,
            pos: 0,
            caches,
            delta,
            observer: opts
                .imatrix
                .then(|| Box::new(Collector::new(c)) as Box<dyn Observer>),
        }
    }

    /// The buffers of a step of `cap` rows with scores of `att_len` and `logit_rows`
    /// rows of logits, from `z` (empty when counting).
    fn scratch(&self, cap: usize, att_len: usize, logit_rows: usize, z: &mut Zeros) -> Scratch {
        let c = &self.cfg;
        let group = c.n_heads / c.n_kv_heads.max(1);
        let mix_w = c.q_dim.max(c.lin_v_total);
        // hidden_dim is unused when every FFN is a mixture of experts.
        let dense_hidden = if c.moe_layers.contains(&false) {
            c.hidden_dim
        } else {
            0
        };
        // `qa` (sized by `allocate`): a zero input of the widest matrix input, 4 bytes
        // per value, and its quants, their Q4_0 arrangement and their interleaved copy
        // (a byte per value each), and eight 4-byte values per block of 32 (the scale,
        // the two sums and the minimum factor, and their interleaved copies); the
        // shared expert's `moe.qa` likewise.
        let (rows, cols) = self.widest_input(cap);
        z.add(Some(rows as u128 * cols as u128 * 8));
        if c.has_moe() {
            let sh = c.moe.map_or(0, |m| m.shared_hidden).max(c.dim);
            z.add(Some(cap as u128 * sh as u128 * 8));
        }
        Scratch {
            cap,
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
            hb: z.take(&[cap, dense_hidden]),
            hb2: z.take(&[cap, dense_hidden]),
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
            logits: z.take(&[logit_rows, c.vocab]),
            logit_rows,
            qa: QActs::new(),
            moe: moe_scratch::MoeScratch::new(
                c.moe.as_ref().filter(|_| c.has_moe()),
                cap,
                c.dim,
                z,
            ),
        }
    }

    /// Checks that `tokens` can follow what `seq` holds.
    fn check(&self, seq: &Seq, tokens: &[u32]) -> Result<()> {
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
        let needed = seq.pos + tokens.len();
        if needed > seq.ctx {
            return Err(ModelError::ContextFull {
                needed,
                ctx: seq.ctx,
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
        let vocab = self.cfg.vocab;
        let mut last = 0;
        let mut rows = [(0, 0); LOGIT_ROWS];
        let every = each.is_some();
        self.run_chunks(&mut *st, tokens, every, |k, buf, segs, wanted, p0| {
            let (mut r0, n) = (wanted.start, wanted.end);
            while r0 < n {
                let r1 = (r0 + buf.logit_rows).min(n);
                for (row, r) in rows.iter_mut().zip(r0..r1) {
                    *row = (0, r);
                }
                self.classify(k, buf, segs, &rows[..r1 - r0]);
                if let Some(f) = each.as_mut() {
                    for r in r0..r1 {
                        f(p0 + r, &buf.logits[(r - r0) * vocab..(r - r0 + 1) * vocab]);
                    }
                }
                last = r1 - r0 - 1;
                r0 = r1;
            }
        })?;
        Ok(&st.buf.logits[last * vocab..(last + 1) * vocab])
    }

    /// One token after what `st` holds; returns its logits.
    pub fn decode<'s>(&self, st: &'s mut State, token: u32) -> Result<&'s [f32]> {
        self.prefill(st, &[token], None)
    }

    /// Runs `tokens` after what `st` holds, like [`Model::prefill`], and passes the
    /// final hidden state `rmsnorm(x, final_norm)` (dim values, the classifier's input)
    /// of the last token, or of every token with `every`, to `sink` with its position.
    /// The classifier does not run: this is the same pass, stopped before it
    /// (embeddings).
    pub fn prefill_hidden(
        &self,
        st: &mut State,
        tokens: &[u32],
        every: bool,
        sink: HiddenSink,
    ) -> Result<()> {
        let d = self.cfg.dim;
        self.run_chunks(st, tokens, every, |k, buf, _, wanted, p0| {
            let rows: Vec<(usize, usize)> = wanted.clone().map(|r| (0, r)).collect();
            self.final_norm(k, buf, &rows);
            for (j, r) in wanted.enumerate() {
                sink(p0 + r, &buf.xb[j * d..(j + 1) * d]);
            }
        })
    }

    /// Runs `tokens` after what `st` holds in chunks of at most its `cap` tokens; after
    /// each chunk (of positions `p0..`), `take(kernels, buffers, segments, rows, p0)`
    /// gets the rows of it that are wanted: all with `every`, else the last chunk's
    /// last row.
    fn run_chunks(
        &self,
        st: &mut State,
        tokens: &[u32],
        every: bool,
        mut take: impl FnMut(&Kernels, &mut Scratch, &mut [Seg], std::ops::Range<usize>, usize),
    ) -> Result<()> {
        self.check(&st.seq, tokens)?;
        let k = self.kernels();
        let State { seq, buf } = st;
        let chunks = tokens.chunks(buf.cap);
        let n_chunks = chunks.len();
        for (ci, chunk) in chunks.enumerate() {
            let (n, p0) = (chunk.len(), seq.pos);
            let mut segs = [Seg {
                seq: &mut *seq,
                r0: 0,
                n,
                p0,
            }];
            self.layers(&k, buf, &mut segs, chunk);
            let first = match (every, ci + 1 == n_chunks) {
                (true, _) => 0,
                (false, true) => n - 1,
                (false, false) => continue,
            };
            take(&k, buf, &mut segs, first..n, p0);
        }
        Ok(())
    }

    /// Several sequences at once: sequence `i` runs `seqs[i].1` after what its state
    /// holds (an empty list: it is skipped). The tokens of all sequences go through
    /// every matrix together (one quantization and one product per matrix for all of
    /// them, so the weights are read once per step), each sequence's mixer against its
    /// own caches and delta states; the classifier runs over each sequence's last token
    /// (every token with `every`), and `sink(i, pos, logits)` gets them. Each
    /// sequence's logits are bit-identical to those [`Model::prefill`] gives it alone.
    ///
    /// Every sequence is checked first (ids in the vocabulary, room in its context,
    /// `bs` made for its context): an error is `InBatch` naming the sequence, and no
    /// state has changed. A batch of more tokens than `bs.tokens()` runs as several
    /// steps, single tokens (decoding sequences) first.
    pub fn forward_batch(
        &self,
        bs: &mut BatchScratch,
        seqs: &mut [(&mut State, &[u32])],
        every: bool,
        sink: BatchSink,
    ) -> Result<()> {
        let out = if every {
            Output::AllLogits
        } else {
            Output::LastLogits
        };
        self.forward_batch_with(bs, seqs, &vec![out; seqs.len()], sink)
    }

    /// [`Model::forward_batch`] with what each sequence gives back chosen per sequence
    /// (`outputs[i]`): its last or every position's logits (vocab values), or its last
    /// or every position's final hidden state (dim values; the classifier does not run
    /// for them). A sequence's rows reach `sink` in position order, bit-identical to
    /// those [`Model::prefill`] and [`Model::prefill_hidden`] give it alone.
    pub fn forward_batch_with(
        &self,
        bs: &mut BatchScratch,
        seqs: &mut [(&mut State, &[u32])],
        outputs: &[Output],
        sink: BatchSink,
    ) -> Result<()> {
        if outputs.len() != seqs.len() {
            return Err(ModelError::BadOption {
                name: "outputs",
                value: format!("{} for {} sequences", outputs.len(), seqs.len()),
                rule: "one output kind per sequence".into(),
            });
        }
        for (i, (st, ids)) in seqs.iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            let in_batch = |e| ModelError::InBatch {
                index: i,
                error: Box::new(e),
            };
            self.check(&st.seq, ids).map_err(in_batch)?;
            if self.att_len(st.seq.ctx) > bs.buf.att_len {
                return Err(in_batch(ModelError::BadOption {
                    name: "ctx",
                    value: st.seq.ctx.to_string(),
                    rule: format!("the batch's buffers were made for a context of {}", bs.ctx),
                }));
            }
        }
        let k = self.kernels();
        let vocab = self.cfg.vocab;
        let ids: Vec<&[u32]> = seqs.iter().map(|(_, ids)| *ids).collect();
        let mut done = vec![0usize; seqs.len()];
        loop {
            // The step: (sequence, first id, ids), single tokens first, up to the budget.
            let mut plan = Vec::new();
            let mut budget = bs.buf.cap;
            for single in [true, false] {
                for (i, ids) in ids.iter().enumerate() {
                    let left = ids.len() - done[i];
                    if left > 0 && (left == 1) == single && budget > 0 {
                        let n = left.min(budget);
                        plan.push((i, done[i], n));
                        budget -= n;
                    }
                }
            }
            if plan.is_empty() {
                return Ok(());
            }
            let mut parts: Vec<Option<&mut Seq>> =
                seqs.iter_mut().map(|(st, _)| Some(&mut st.seq)).collect();
            let BatchScratch { buf, toks, .. } = &mut *bs;
            toks.clear();
            let mut segs = Vec::with_capacity(plan.len());
            for &(i, from, n) in &plan {
                let seq = parts[i].take().expect("a sequence once per step");
                toks.extend_from_slice(&ids[i][from..from + n]);
                segs.push(Seg {
                    p0: seq.pos,
                    seq,
                    r0: toks.len() - n,
                    n,
                });
            }
            self.layers(&k, buf, &mut segs, toks);
            // Rows wanted: each sequence's last, or all of them; logits or hidden states.
            let rows_of = |hidden: bool| -> Vec<(usize, usize)> {
                segs.iter()
                    .enumerate()
                    .filter(|&(s, _)| outputs[plan[s].0].hidden() == hidden)
                    .flat_map(|(s, g)| {
                        let (i, from, n) = plan[s];
                        let t0 = match (outputs[i].every(), from + n == ids[i].len()) {
                            (true, _) => 0,
                            (false, true) => n - 1,
                            (false, false) => n,
                        };
                        (t0..n).map(move |t| (s, g.r0 + t))
                    })
                    .collect()
            };
            let (want, hidden) = (rows_of(false), rows_of(true));
            for rows in want.chunks(buf.logit_rows) {
                self.classify(&k, buf, &mut segs, rows);
                for (j, &(s, r)) in rows.iter().enumerate() {
                    let g = &segs[s];
                    sink(
                        plan[s].0,
                        g.p0 + (r - g.r0),
                        &buf.logits[j * vocab..(j + 1) * vocab],
                    );
                }
            }
            let d = self.cfg.dim;
            for rows in hidden.chunks(buf.cap) {
                self.final_norm(&k, buf, rows);
                for (j, &(s, r)) in rows.iter().enumerate() {
                    let g = &segs[s];
                    sink(plan[s].0, g.p0 + (r - g.r0), &buf.xb[j * d..(j + 1) * d]);
                }
            }
            for &(i, _, n) in &plan {
                done[i] += n;
            }
        }
    }

    /// The final hidden states `rmsnorm(x, final_norm)` of the step rows `rows`
    /// (segment, row; whose residual stream is in `st.x`) into `st.xb`, a row each.
    fn final_norm(&self, k: &Kernels, st: &mut Scratch, rows: &[(usize, usize)]) {
        let d = self.cfg.dim;
        let (x, w, eps) = (&st.x, self.w.final_norm, self.cfg.norm_eps);
        for_rows(&mut st.xb[..rows.len() * d], d, |i, o| {
            let r = rows[i].1;
            k.rmsnorm(o, &x[r * d..(r + 1) * d], w, eps)
        });
    }

    /// Logits of the step rows `rows` (segment, row; whose residual stream is in
    /// `st.x`) into `st.logits`, a row each.
    fn classify(&self, k: &Kernels, st: &mut Scratch, segs: &mut [Seg], rows: &[(usize, usize)]) {
        let (d, v) = (self.cfg.dim, self.cfg.vocab);
        let m = rows.len();
        self.final_norm(k, st, rows);
        // Each sequence's observer sees its rows (consecutive in `rows`).
        let mut i0 = 0;
        while i0 < m {
            let s = rows[i0].0;
            let i1 = i0 + rows[i0..].iter().take_while(|r| r.0 == s).count();
            tap(
                &mut segs[s].seq.observer,
                0,
                Input::Cls,
                &st.xb[i0 * d..i1 * d],
            );
            i0 = i1;
        }
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

    /// Embeds `toks` (the step's rows: segment `s` holds rows `r0..r0 + n` at its
    /// positions `p0..`) and runs every layer; the residual stream is left in `st.x`
    /// and each sequence's position advances.
    fn layers(&self, k: &Kernels, st: &mut Scratch, segs: &mut [Seg], toks: &[u32]) {
        let c = &self.cfg;
        let (n, d, hid) = (toks.len(), c.dim, c.hidden_dim);
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
        for s in segs.iter() {
            for t in s.r0..s.r0 + s.n {
                let pos = s.p0 + (t - s.r0);
                self.global
                    .cos_sin(pos, &mut st.cs_global[t * rd..(t + 1) * rd]);
                if let Some(loc) = &self.local {
                    loc.cos_sin(pos, &mut st.cs_local[t * rd..(t + 1) * rd]);
                }
            }
        }
        for (l, lw) in self.w.layers.iter().enumerate() {
            branch_input(k, st, segs, n * d, lw.attn_norm, c, (l, Input::Attn));
            match (&lw.mixer, c.layers[l]) {
                (MixerWeights::Attention(a), LayerKind::Attention { rope, .. }) => {
                    self.attention(k, st, segs, l, a, rope, n)
                }
                (MixerWeights::Linear(lin), _) => self.linear(k, st, segs, l, lin, n),
                _ => unreachable!("layout and config agree on layer kinds"),
            }
            residual(k, st, n * d, lw.post_attn_norm, c);
            branch_input(k, st, segs, n * d, lw.ffn_norm, c, (l, Input::W13));
            match &lw.ffn {
                FfnWeights::Dense(f) => {
                    // W2 (act(W1 h) ⊙ W3 h).
                    k.project_each(
                        &[&f.w1, &f.w3],
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
                    tap_rows(segs, l, Input::W2, &st.hb[..n * hid]);
                    k.project(&f.w2, &st.hb[..n * hid], &mut st.qa, &mut st.xb2[..n * d]);
                }
                FfnWeights::Moe(mw) => self.moe(k, st, segs, l, mw, n),
            }
            residual(k, st, n * d, lw.post_ffn_norm, c);
        }
        for s in segs.iter_mut() {
            s.seq.pos += s.n;
        }
    }

    /// The gated delta rule of layer `l` for the step's `n` rows (input in `st.xb`,
    /// output in `st.xb2`), each segment's rows in order against its own state.
    fn linear(
        &self,
        k: &Kernels,
        st: &mut Scratch,
        segs: &mut [Seg],
        l: usize,
        w: &LinearWeights,
        n: usize,
    ) {
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
        for s in segs.iter_mut() {
            let ds = s.seq.delta[l].as_mut().expect("linear layer has a state");
            for t in s.r0..s.r0 + s.n {
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
        }
        tap_rows(segs, l, Input::LinOut, &st.mix[..n * lv]);
        k.project(&w.lout, &st.mix[..n * lv], &mut st.qa, &mut st.xb2[..n * d]);
    }
}

/// What one sequence's [`State`] takes in memory ([`Model::slot_memory`]): a server
/// prints it for its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotMemory {
    pub ctx: usize,
    pub kv_type: KvType,
    /// Bytes of keys and values per position over the full-attention layers.
    pub kv_per_position: usize,
    /// Bytes of all KV caches (sliding layers' rings included).
    pub kv: u128,
    /// Bytes of the linear-attention states.
    pub delta: u128,
    /// Bytes of the step buffers (scores, activations, logits; untouched pages of
    /// them take no memory).
    pub buffers: u128,
}

impl SlotMemory {
    /// Everything.
    pub fn total(&self) -> u128 {
        self.kv + self.delta + self.buffers
    }
}

impl std::fmt::Display for SlotMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u128| b as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "KV cache {} {:.1} MiB ({} bytes per position, {} positions)",
            self.kv_type,
            mib(self.kv),
            self.kv_per_position,
            self.ctx
        )?;
        if self.delta > 0 {
            write!(f, ", linear-attention state {:.1} MiB", mib(self.delta))?;
        }
        write!(f, ", buffers {:.1} MiB", mib(self.buffers))
    }
}
