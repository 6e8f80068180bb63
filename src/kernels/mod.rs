//! Every SIMD path of the crate, reached through one table per instruction-set tier
//! ([`Kernels`]) chosen once: the quantized matrix products `y = W·x` (Q8_0 / Q4_0
//! weights, Q8_0 activations), f32 activations × BF16 / F16 weights ([`half`]: their
//! own contract, 16 lanes of fused multiply-adds), the activation quantizer, f16 scale
//! conversion, and the
//! f32 work of a forward pass: attention (scores, softmax, value sums), `exp`,
//! SiLU / GELU, the maximum of a slice and the gated delta rule's head step. Forcing a
//! tier (`KRAFLA_KERNEL`, [`with_tier`], [`Kernels::for_tier`]) forces all of it; the
//! call [`counters`] let a test see which tier's code ran.
//!
//! The arithmetic contract of the matrix products (also in `docs/kernels.md`),
//! identical in every tier:
//!
//! * per block `b` of 32 columns, `isum_b = Σ q_w·q_x` exactly in i32 (|isum| < 2^24,
//!   so `isum_b as f32` is exact);
//! * per output, [`LANES`] = 8 partial sums `acc[0..8] = +0.0`; block `b`, in increasing
//!   order, does `acc[b % 8] += (d_w[b] · d_x[b]) · (isum_b as f32)`, every operation a
//!   separately rounded f32 operation (no FMA);
//! * the result is `((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))`.
//!
//! The GGUF block types (Q4_K … Q6_0, [`scalar_k`]) keep these lanes and this tree but
//! fuse their step (`acc = fma(dw·dx, isum, acc)`, then the minimum term's fma).
//!
//! [`scalar`] is the reference of the matrix products, [`scalar_math`], [`scalar_attn`]
//! and [`scalar_delta`] of the f32 kernels; every SIMD tier (AVX2, AVX-512, AVX-512
//! VNNI, NEON) gives the same bits. The tier is chosen once at run time from the CPU's features and can be
//! lowered with `KRAFLA_KERNEL=scalar|avx2|avx512|avx512vnni|neon`.
//!
//! Rows are independent, so the results do not depend on the thread count or on how
//! rows are split between tasks of the thread pool ([`pool`]).

use std::cell::Cell;
use std::fmt;
use std::sync::OnceLock;

pub use crate::format::{QMat, ShapeError, WType};
use crate::quant::QK;

pub mod counters;
pub mod half;
pub mod hugebuf;
pub mod mat;
pub mod packed;
pub mod packed_blocks;
pub mod pool;
pub mod scalar;
pub mod scalar_attn;
pub mod scalar_bf16dot;
pub mod scalar_delta;
pub mod scalar_half;
pub mod scalar_k;
pub mod scalar_kv;
pub mod scalar_math;

pub use half::HalfActs;
pub use mat::WeightMat;
pub use packed::PackedMat;
use packed_blocks::for_block_type;
pub use scalar_attn::{KvView, Query, TILE_QUERIES};
pub use scalar_delta::DeltaHead;
pub use scalar_kv::{KvData, KvType};

#[cfg(target_arch = "x86_64")]
pub mod x86;

#[cfg(target_arch = "aarch64")]
pub mod arm;

/// Partial sums per output in the contract: block `b` goes to lane `b % LANES`.
pub const LANES: usize = 8;

/// Most tokens one micro-kernel call handles (a tile shares each weight block load).
pub const TILE_TOKENS: usize = 4;

/// The f32 scales of rows `r0..r1` of `w`: borrowed, or converted from f16 into `buf`
/// with a tier's conversion `f16` (exact in every tier).
#[inline]
fn scales<'a: 'b, 'b>(
    w: &QMat<'a>,
    r0: usize,
    r1: usize,
    buf: &'b mut Vec<f32>,
    f16: F16Fn,
) -> &'b [f32] {
    let nb = w.blocks();
    if !w.wtype.has_scales() {
        return &[]; // GGUF block types carry their scales inside the blocks
    }
    if w.d16.is_empty() {
        return &w.d[r0 * nb..r1 * nb];
    }
    let src = &w.d16[r0 * nb..r1 * nb];
    buf.resize(src.len(), 0.0);
    // SAFETY: `f16` comes from a tier the CPU supports; the lengths agree.
    unsafe { f16(src, buf) };
    buf
}

/// Q8_0 activations of `n` rows (tokens) of `cols` values; buffers are reused.
#[derive(Debug, Clone, Default)]
pub struct QActs {
    n: usize,
    cols: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    /// Block sums `Σ q` (for the VNNI kernels' `u8 × s8` offset correction).
    s: Vec<i32>,
    /// `q` rearranged per [`q4_layout_len`] (for the VNNI Q4_0 kernel).
    q4: Vec<i8>,
    /// Sums of the first 16 quants of each block (Q6_K's half-block offset correction).
    h: Vec<i32>,
    /// `d · (s as f32)` per block: the minimum term's factor of the affine block types
    /// (`scalar_k::act_xs`), once per token instead of once per row.
    xs: Vec<f32>,
    /// The f32 input rounded to BF16, for BF16 weights under `HalfActs::Bf16`.
    b16: Vec<u16>,
    /// `q`, `d`, `s`, `h` and `xs` interleaved per tile of [`PACKED_TILE`] tokens (see
    /// [`ActTile::iq`]).
    iq: Vec<i8>,
    id: Vec<f32>,
    is: Vec<i32>,
    ih: Vec<i32>,
    ixs: Vec<f32>,
}

/// Values per pool task when quantizing many tokens.
const QUANT_PAR_VALUES: usize = 32768;

/// Bytes per token of the Q4_0 arrangement of activations: 128 per group of 4 blocks.
pub fn q4_layout_len(cols: usize) -> usize {
    (cols / QK).div_ceil(4) * 128
}

/// One token's quants in the Q4_0 arrangement: block `j` of group `g` (4 blocks) puts
/// elements 0..16 at `128g + 16j` and 16..32 at `128g + 64 + 16j`, matching the low and
/// high nibbles of a 64-byte load of 4 Q4_0 blocks. Padding is zero.
fn arrange_q4(q: &[i8], out: &mut [i8]) {
    out.fill(0);
    for (b, qb) in q.chunks_exact(QK).enumerate() {
        let at = 128 * (b / 4) + 16 * (b % 4);
        out[at..at + 16].copy_from_slice(&qb[..16]);
        out[at + 64..at + 80].copy_from_slice(&qb[16..]);
    }
}

/// Tokens `t0..` of `src` (`w` values per block, `nb` blocks per token; as many tokens
/// as `dst` has room for, `t0` at a tile start) into `dst`, interleaved per tile of
/// [`PACKED_TILE`] tokens: in the tile of tokens `u..u + k`, block `b` of token `u + t`
/// goes to block `(u − t0)·nb + b·k + t` (see [`ActTile::iq`]).
fn interleave<T: Copy>(src: &[T], w: usize, nb: usize, t0: usize, dst: &mut [T]) {
    let n = dst.len() / (nb * w);
    for u in (0..n).step_by(PACKED_TILE) {
        let k = PACKED_TILE.min(n - u);
        for t in 0..k {
            for b in 0..nb {
                let (from, to) = ((t0 + u + t) * nb + b, u * nb + b * k + t);
                dst[to * w..(to + 1) * w].copy_from_slice(&src[from * w..(from + 1) * w]);
            }
        }
    }
}

impl QActs {
    /// Fills what the kernels derive from `q` and `d`: `s`, `h`, `xs`, `q4` and the
    /// interleaved `iq`, `id`, `is`, `ih`, `ixs`. A prompt's worth is split over the pool in
    /// whole packed tiles of tokens (each value is computed alone: no bit changes).
    fn derive(&mut self) {
        let (n, cols) = (self.n, self.cols);
        let (nb, l4, blocks) = (cols / QK, q4_layout_len(cols), self.d.len());
        self.s.resize(blocks, 0);
        self.h.resize(blocks, 0);
        self.xs.resize(blocks, 0.0);
        self.q4.resize(n * l4, 0);
        self.iq.resize(self.q.len(), 0);
        self.id.resize(blocks, 0.0);
        self.is.resize(blocks, 0);
        self.ih.resize(blocks, 0);
        self.ixs.resize(blocks, 0.0);
        let per = (QUANT_PAR_VALUES / cols)
            .next_multiple_of(PACKED_TILE)
            .max(PACKED_TILE);
        let par = pool::parallel_if(n > per && pool::threads() > 1);
        let (q, d) = (&self.q, &self.d);
        let sum = |b: &[i8]| b.iter().map(|&v| v as i32).sum::<i32>();
        let bs = per * nb;
        par.for_chunks3(
            (&mut self.s, bs),
            (&mut self.h, bs),
            (&mut self.xs, bs),
            |i, s, h, xs| {
                for (j, ((s, h), xs)) in s.iter_mut().zip(h).zip(xs).enumerate() {
                    let b = i * bs + j;
                    let qb = &q[b * QK..(b + 1) * QK];
                    (*s, *h) = (sum(qb), sum(&qb[..QK / 2]));
                    *xs = d[b] * *s as f32;
                }
            },
        );
        let (s, h, xs) = (&self.s, &self.h, &self.xs);
        let (q4, iq) = ((&mut self.q4[..], per * l4), (&mut self.iq[..], per * cols));
        par.for_chunks3(q4, iq, (&mut self.is, bs), |i, q4, iq, is| {
            let t0 = i * per;
            for (t, ot) in q4.chunks_exact_mut(l4).enumerate() {
                arrange_q4(&q[(t0 + t) * cols..(t0 + t + 1) * cols], ot);
            }
            interleave(q, QK, nb, t0, iq);
            interleave(s, 1, nb, t0, is);
        });
        let (id, ih) = ((&mut self.id[..], bs), (&mut self.ih[..], bs));
        par.for_chunks3(id, ih, (&mut self.ixs, bs), |i, id, ih, ixs| {
            interleave(d, 1, nb, i * per, id);
            interleave(h, 1, nb, i * per, ih);
            interleave(xs, 1, nb, i * per, ixs);
        });
    }

    /// An empty set (n = 0); fill it with [`QActs::quantize`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes `x` (`n × cols`, row-major) with the active tier.
    ///
    /// Panics if `cols` is not a positive multiple of 32 or does not divide `x.len()`.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.quantize_with(&kernels(), x, cols);
    }

    /// [`QActs::quantize`] with an explicit kernel set.
    pub fn quantize_with(&mut self, k: &Kernels, x: &[f32], cols: usize) {
        assert!(
            cols > 0 && cols.is_multiple_of(QK),
            "cols {cols} must be a positive multiple of {QK}"
        );
        assert_eq!(
            x.len() % cols,
            0,
            "x has {} values, not a multiple of cols {cols}",
            x.len()
        );
        self.n = x.len() / cols;
        self.cols = cols;
        self.q.resize(x.len(), 0);
        self.d.resize(x.len() / QK, 0.0);
        // A prompt chunk (e.g. 512 × 1536 values) is quantized by the pool, whole tokens
        // per task: blocks are independent, so the bits are the same.
        let per = (QUANT_PAR_VALUES / cols).max(1);
        if self.n > per && pool::threads() > 1 {
            let (xs, qs, ds) = (per * cols, per * cols, per * cols / QK);
            pool::for_chunks2(&mut self.q, qs, &mut self.d, ds, |i, q, d| {
                k.quantize_act(&x[i * xs..i * xs + q.len()], q, d);
            });
        } else {
            k.quantize_act(x, &mut self.q, &mut self.d);
        }
        self.derive();
    }

    /// Takes already quantized activations (e.g. from a test); checks the lengths.
    pub fn from_parts(n: usize, cols: usize, q: Vec<i8>, d: Vec<f32>) -> Result<Self, ShapeError> {
        if cols == 0
            || !cols.is_multiple_of(QK)
            || Some(q.len()) != n.checked_mul(cols)
            || d.len() * QK != q.len()
        {
            return Err(ShapeError(format!(
                "activations {n}x{cols}: q has {} and d {} values",
                q.len(),
                d.len()
            )));
        }
        let mut a = QActs {
            n,
            cols,
            q,
            d,
            s: Vec::new(),
            q4: Vec::new(),
            h: Vec::new(),
            xs: Vec::new(),
            b16: Vec::new(),
            iq: Vec::new(),
            id: Vec::new(),
            is: Vec::new(),
            ih: Vec::new(),
            ixs: Vec::new(),
        };
        a.derive();
        Ok(a)
    }

    /// Tokens (rows).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Values per token.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `n·cols` quants, token-major.
    pub fn q(&self) -> &[i8] {
        &self.q
    }

    /// `n·cols/32` scales, token-major.
    pub fn d(&self) -> &[f32] {
        &self.d
    }
}

/// An instruction-set tier; each has its own micro-kernels with identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Scalar,
    Avx2,
    Avx512,
    Avx512Vnni,
    /// AVX-512 VNNI's kernels, and `vdpbf16ps` for BF16 weights × BF16 activations.
    Avx512Bf16,
    Neon,
}

impl Tier {
    /// Every tier, lowest first.
    pub const ALL: [Tier; 6] = [
        Tier::Scalar,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Vnni,
        Tier::Avx512Bf16,
        Tier::Neon,
    ];

    /// The name `KRAFLA_KERNEL` takes.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Vnni => "avx512vnni",
            Tier::Avx512Bf16 => "avx512bf16",
            Tier::Neon => "neon",
        }
    }

    /// Parses a `KRAFLA_KERNEL` value.
    pub fn from_name(s: &str) -> Option<Tier> {
        Tier::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Quantizes whole blocks: `x.len() = q.len() = 32·d.len()`.
type QuantFn = unsafe fn(x: &[f32], q: &mut [i8], d: &mut [f32]);

/// Dots `rows` consecutive weight rows (`wq`, `wd`: `rows` rows of quants and scales)
/// with the `nt = out.len() / rows` ≤ [`TILE_TOKENS`] tokens of `x`: `out[r·nt + t]`.
type TileFn = unsafe fn(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]);

/// Dots groups `g0..g1` of a packed matrix with the 1..=[`PACKED_TILE`] tokens of `x`:
/// `y[t·ld + r]` for every real row `r` of those groups.
type PackedFn =
    unsafe fn(p: &packed::PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize);

/// Most tokens per packed micro-kernel call. (16 measured slower for the block types'
/// VNNI kernel: 0.7× Q4_K's and Q6_K's batch throughput on an Ice Lake Xeon.)
pub const PACKED_TILE: usize = 8;

/// f16 bits to f32, exactly: `src.len() == dst.len()`.
type F16Fn = unsafe fn(src: &[u16], dst: &mut [f32]);

/// Attention of at most [`TILE_QUERIES`] queries of one kv head (shapes checked by
/// [`Kernels::attend`]).
type AttendFn = unsafe fn(qs: &mut [Query], kv: &KvView, scale: f32, softcap: f32);

/// An element-wise map of a slice in place.
type SliceFn = unsafe fn(v: &mut [f32]);

/// A reduction of a slice to one value.
type ReduceFn = unsafe fn(v: &[f32]) -> f32;

/// `g[i] = act(g[i]) · u[i]`.
type ActFn = unsafe fn(g: &mut [f32], u: &[f32]);

/// The delta rule's step of one head: state (dk × dv), output (dv), scratch (dv).
type DeltaFn = unsafe fn(x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]);

/// Calls `f(wq_r, wd_r, out_r)` for each of `rows` rows: the tiers' row loop.
#[inline(always)]
pub(crate) fn for_rows(
    rows: usize,
    wq: &[u8],
    wd: &[f32],
    out: &mut [f32],
    mut f: impl FnMut(&[u8], &[f32], &mut [f32]),
) {
    debug_assert!(rows > 0 && wq.len().is_multiple_of(rows) && wd.len().is_multiple_of(rows));
    debug_assert_eq!(out.len() % rows, 0);
    let (rb, nb, nt) = (wq.len() / rows, wd.len() / rows, out.len() / rows);
    let it = wq
        .chunks_exact(rb)
        .zip(wd.chunks_exact(nb))
        .zip(out.chunks_exact_mut(nt));
    for ((q, d), o) in it {
        f(q, d, o);
    }
}

/// Consecutive tokens of a [`QActs`] as the micro-kernels see them.
pub struct ActTile<'a> {
    /// `cols` quants per token.
    pub q: &'a [i8],
    /// `cols/32` scales per token.
    pub d: &'a [f32],
    /// `cols/32` block sums `Σ q` per token.
    pub s: &'a [i32],
    /// The quants rearranged for Q4_0 kernels, [`q4_layout_len`]`(cols)` per token.
    pub q4: &'a [i8],
    /// `cols/32` sums of each block's first 16 quants per token (Q6_K).
    pub h: &'a [i32],
    /// `cols/32` minimum-term factors `d · (s as f32)` per token (affine block types).
    pub xs: &'a [f32],
    /// A packed tile's quants block by block: block `b` of the tile's `k`-th token at
    /// `(b·n + k)·32` for the tile's `n` tokens, so that a kernel reaches every token of
    /// a block at a constant offset from one pointer. With the token stride a runtime
    /// value, eight tokens' pointers (and their scales') do not fit in the registers:
    /// the VNNI Q5_K kernel's loop ran 227 instructions per block position for 8 tokens
    /// with 20 stack accesses, against 192 and 4 this way. Empty in tiles other than
    /// the packed ones (tokens `8i..8i + 8`, or the last `8i..n`).
    pub iq: &'a [i8],
    /// `d` in the order of `iq` (block `b`, token `k` at `b·n + k`).
    pub id: &'a [f32],
    /// `s` in the order of `iq`.
    pub is: &'a [i32],
    /// `h` in the order of `iq`.
    pub ih: &'a [i32],
    /// `xs` in the order of `iq`.
    pub ixs: &'a [f32],
    /// The product's only tile (decode, a batched decode step, a short prompt): its
    /// weights stream from memory once, so the packed kernels prefetch them. Later tiles
    /// of a prefill find them cached.
    pub stream: bool,
}

impl<'a> ActTile<'a> {
    /// Tokens `t0..t1` of this tile (all of a [`QActs`]), of `nb` blocks each.
    pub fn tokens(&self, nb: usize, t0: usize, t1: usize) -> ActTile<'a> {
        let (cols, l4) = (nb * QK, q4_layout_len(nb * QK));
        let blocks = t0 * nb..t1 * nb;
        // The interleaved arrays hold whole packed tiles: only such a tile keeps them.
        let n = self.d.len() / nb.max(1);
        let packed = t0.is_multiple_of(PACKED_TILE) && (t1 - t0 == PACKED_TILE || t1 == n);
        let (inter_q, inter) = match packed {
            true => (t0 * cols..t1 * cols, blocks.clone()),
            false => (0..0, 0..0),
        };
        ActTile {
            q: &self.q[t0 * cols..t1 * cols],
            d: &self.d[blocks.clone()],
            s: &self.s[blocks.clone()],
            q4: &self.q4[t0 * l4..t1 * l4],
            h: &self.h[blocks.clone()],
            xs: &self.xs[blocks.clone()],
            iq: &self.iq[inter_q],
            id: &self.id[inter.clone()],
            is: &self.is[inter.clone()],
            ih: &self.ih[inter.clone()],
            ixs: &self.ixs[inter],
            stream: self.stream,
        }
    }
}

/// One weight type's matrix kernels in a tier: the row-major micro-kernel, and the
/// packed one where the tier has it. A new weight type adds an entry to every tier
/// (see docs/architecture.md, "How to add a weight type").
#[derive(Clone, Copy)]
struct MatKernels {
    tile: TileFn,
    packed: Option<PackedFn>,
}

/// Weight types, and so entries of [`Kernels::mats`].
const N_WTYPES: usize = WType::ALL.len();

// `Kernels::mats` is indexed by `WType as usize`: `WType::ALL` lists the types in that order.
const _: () = {
    let mut i = 0;
    while i < N_WTYPES {
        assert!(WType::ALL[i] as usize == i);
        i += 1;
    }
};

/// The matrix kernels of every weight type, from `f` (an exhaustive `match` on the
/// type, so that a new type cannot be left without kernels).
fn per_type(f: impl Fn(WType) -> Option<MatKernels>) -> [Option<MatKernels>; N_WTYPES] {
    std::array::from_fn(|i| f(WType::ALL[i]))
}

/// A tier's f32 kernels.
#[derive(Clone, Copy)]
struct F32Kernels {
    /// Attention over an f32 cache.
    attend: AttendFn,
    /// Attention over an f16 cache.
    attend_f16: AttendFn,
    /// Attention over a Q8_0 cache.
    attend_q8: AttendFn,
    exp: SliceFn,
    max: ReduceFn,
    silu_mul: ActFn,
    gelu_mul: ActFn,
    delta: DeltaFn,
}

/// The reference f32 kernels (every tier without SIMD versions of them).
const SCALAR_F32: F32Kernels = F32Kernels {
    attend: scalar_attn::attend,
    attend_f16: scalar_attn::attend,
    attend_q8: scalar_attn::attend,
    exp: scalar_math::exp_slice,
    max: scalar_math::max_slice,
    silu_mul: scalar_math::silu_mul,
    gelu_mul: scalar_math::gelu_mul,
    delta: scalar_delta::delta_head,
};

/// One tier's kernels: every SIMD path of the crate. Only built for tiers the CPU
/// supports, which is what makes calling its `unsafe fn` pointers sound.
#[derive(Clone, Copy)]
pub struct Kernels {
    tier: Tier,
    quant: QuantFn,
    f16: F16Fn,
    /// Per weight type, at `WType as usize`.
    /// By `WType as usize`; `None`: the tier has no kernel for that type.
    mats: [Option<MatKernels>; N_WTYPES],
    /// BF16 / F16 weights × f32 (or BF16) activations.
    half: half::HalfKernels,
    /// What BF16 weights multiply (`Kernels::with_half_acts`).
    half_acts: half::HalfActs,
    f32: F32Kernels,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Kernels({})", self.tier)
    }
}

/// The x86 tiers' table (`base`: the scalar one with the tier set). AVX2 code serves
/// every x86 tier where nothing wider exists (the activation quantizer, exp, SiLU,
/// GELU, the delta rule's step); the AVX-512 tiers add their own matrix kernels and
/// attention.
#[cfg(target_arch = "x86_64")]
fn x86_kernels(t: Tier, base: Kernels) -> Kernels {
    use x86::{attention, attention_kv as akv, avx2, avx512, math, packed as xp};
    // The AVX2 packed Q4_0 kernel (it needs F16C) serves the AVX2 and AVX-512 BW tiers.
    let q4_avx2 = xp::has_avx2_packed().then_some(xp::q4_avx2 as PackedFn);
    // Per tier: the Q8_0 and Q4_0 tile kernels, their packed ones, and whether the
    // block types' packed kernels are the VNNI ones.
    type Row = (TileFn, Option<PackedFn>, TileFn, Option<PackedFn>, bool);
    let (q8, q8_packed, q4, q4_packed, vnni): Row = match t {
        Tier::Avx2 => (avx2::tile_q8, None, avx2::tile_q4, q4_avx2, false),
        Tier::Avx512 => (avx512::tile_q8_bw, None, avx512::tile_q4_bw, q4_avx2, false),
        _ => (
            avx512::tile_q8_vnni,
            Some(xp::q8_vnni),
            avx512::tile_q4_vnni,
            Some(xp::q4_vnni),
            true,
        ),
    };
    let mats = per_type(|w| match w {
        WType::Q8_0 => Some(MatKernels {
            tile: q8,
            packed: q8_packed,
        }),
        WType::Q4_0 => Some(MatKernels {
            tile: q4,
            packed: q4_packed,
        }),
        _ => x86_blocks(w, vnni),
    });
    let (attend, attend_f16, attend_q8) = match t {
        Tier::Avx2 => (
            attention::attend_avx2 as AttendFn,
            if x86::has_f16c() {
                akv::attend_f16_avx2 as AttendFn
            } else {
                base.f32.attend_f16
            },
            akv::attend_q8_avx2 as AttendFn,
        ),
        // The AVX-512 tiers need F16C (`x86::has_avx512`).
        _ => (
            attention::attend_avx512 as AttendFn,
            akv::attend_f16_avx512 as AttendFn,
            akv::attend_q8_avx512 as AttendFn,
        ),
    };
    Kernels {
        quant: avx2::quantize_act,
        f16: if x86::has_f16c() {
            x86::f16_to_f32
        } else {
            base.f16
        },
        mats,
        half: x86::half::kernels(t).unwrap_or(base.half),
        f32: F32Kernels {
            attend,
            attend_f16,
            attend_q8,
            exp: if t == Tier::Avx2 {
                math::exp_slice
            } else {
                math::exp_slice512
            },
            max: math::max_slice,
            silu_mul: math::silu_mul,
            gelu_mul: math::gelu_mul,
            delta: math::delta_head,
        },
        ..base
    }
}

/// An x86 tier's entry of a GGUF block type (`None` for other types): the AVX2 row-major
/// kernel, and the packed one of VNNI (`vnni`) or AVX2. They need F16C and FMA (the
/// contract's fused step; every AVX2 CPU made has both); without them the type keeps the
/// scalar reference's entry.
#[cfg(target_arch = "x86_64")]
fn x86_blocks(w: WType, vnni: bool) -> Option<MatKernels> {
    use x86::{blocks as xb, packed_blocks as xpb};
    if !x86::has_avx2_fma() {
        return scalar_blocks(w);
    }
    for_block_type!(w, |B| MatKernels {
        tile: xb::tile::<B>,
        packed: Some(if vnni {
            xpb::vnni::<B> as PackedFn
        } else {
            xpb::avx2::<B>
        }),
    })
}

/// The software prefetch hint of each kind of weight stream and the rows BF16/F16 decode
/// reads side by side on the tier in use, as `--verbose` shows them (`x86::prefetch`: chosen per
/// CPU, `KRAFLA_PREFETCH` overrides the hints); `None` off x86.
pub fn prefetch_hints() -> Option<String> {
    #[cfg(target_arch = "x86_64")]
    {
        use x86::prefetch::{hint, Stream};
        let each = Stream::ALL.map(|s| format!("{} {}", s.name(), hint(s).name()));
        let hints = each.join(", ");
        Some(match x86::half::decode_rows(tier()) {
            Some(rows) => format!("{hints}; bf16/f16 decode {rows} rows side by side"),
            None => hints,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Tiers this CPU can run, lowest first (always starts with `Scalar`).
pub fn supported_tiers() -> Vec<Tier> {
    Tier::ALL.iter().copied().filter(|&t| cpu_has(t)).collect()
}

fn cpu_has(t: Tier) -> bool {
    match t {
        Tier::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => x86::has_avx2(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => x86::has_avx512(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Vnni => x86::has_avx512vnni(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Bf16 => x86::has_avx512bf16(),
        #[cfg(target_arch = "aarch64")]
        Tier::Neon => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

impl Kernels {
    /// The kernels of tier `t`, or `None` when this CPU (or build) cannot run it.
    pub fn for_tier(t: Tier) -> Option<Kernels> {
        if !cpu_has(t) {
            return None;
        }
        let s = Kernels {
            tier: t,
            ..scalar_kernels()
        };
        Some(match t {
            Tier::Scalar => s,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 => {
                x86::prefetch::choose_all();
                x86_kernels(t, s)
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => Kernels {
                mats: per_type(|w| match w {
                    WType::Q8_0 => Some(MatKernels {
                        tile: arm::neon::tile_q8,
                        packed: None,
                    }),
                    WType::Q4_0 => Some(MatKernels {
                        tile: arm::neon::tile_q4,
                        packed: None,
                    }),
                    _ => None,
                }),
                ..s
            },
            #[allow(unreachable_patterns)]
            _ => return None,
        })
    }

    /// This set's tier.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Whether this tier reads packed matrices ([`WeightMat::packed`]) of some type.
    pub fn packs(&self) -> bool {
        self.mats.iter().flatten().any(|m| m.packed.is_some())
    }

    /// Whether this tier multiplies matrices of type `t` (a model with a matrix of
    /// another type is refused at load).
    pub fn supports(&self, t: WType) -> bool {
        self.mats[t as usize].is_some() || self.half_fn(t).is_some()
    }

    /// Whether this tier reads packed matrices of type `t`: worth packing those for.
    pub fn packs_type(&self, t: WType) -> bool {
        self.packed_fn(t).is_some()
    }

    fn packed_fn(&self, t: WType) -> Option<PackedFn> {
        self.mats[t as usize].and_then(|m| m.packed)
    }

    /// Attention of queries that share one kv head over `kv`, by the arithmetic of
    /// [`scalar_attn`]: each query's `out` gets the bits the reference gives it alone,
    /// whatever the tier and however the queries are grouped (a tile of prompt tokens
    /// and the query heads of the kv head is read from memory once per block of keys).
    ///
    /// The cache may hold f32, f16 or Q8_0 keys and values ([`KvData`], both of one
    /// type): each row is widened to f32 as the reference does ([`scalar_kv`]), then
    /// the f32 arithmetic runs, so the bits are those of f32 attention over the widened
    /// cache, on every tier.
    ///
    /// Panics unless every query has `q.len() == out.len() == hd` (one head_dim), an
    /// `att` at least as long as its visible span, and a span that fits the cache;
    /// and `kv` holds `cap × stride` keys and values with the head inside a slot (for
    /// Q8_0: a scale per 32, `stride` and `off` multiples of 32).
    pub fn attend(&self, qs: &mut [Query], kv: &KvView, scale: f32, softcap: f32) {
        let Some(hd) = qs.first().map(|q| q.q.len()) else {
            return;
        };
        let ty = kv.k.kv_type();
        let blocks =
            ty != KvType::Q8_0 || (kv.stride.is_multiple_of(QK) && kv.off.is_multiple_of(QK));
        assert!(
            kv.cap > 0
                && kv.off + hd <= kv.stride
                && kv.k.len() == kv.cap * kv.stride
                && kv.v.len() == kv.k.len()
                && kv.v.kv_type() == ty
                && kv.k.consistent()
                && kv.v.consistent()
                && blocks,
            "attend: head at {} of {} in a {ty} cache of {} x {}",
            kv.off,
            kv.stride,
            kv.cap,
            kv.stride
        );
        for q in qs.iter() {
            let span = q.pos + 1 - kv.first_visible(q.pos);
            assert!(
                q.q.len() == hd && q.out.len() == hd && span <= q.att.len() && span <= kv.cap,
                "attend: query of {} values at {} (span {span}, att {}, cap {})",
                q.q.len(),
                q.pos,
                q.att.len(),
                kv.cap
            );
        }
        let f = match ty {
            KvType::F32 => self.f32.attend,
            KvType::F16 => self.f32.attend_f16,
            KvType::Q8_0 => self.f32.attend_q8,
        };
        for tile in qs.chunks_mut(TILE_QUERIES) {
            // SAFETY: a supported tier's kernel; shapes checked above.
            unsafe { f(tile, kv, scale, softcap) }
        }
    }

    /// `v[i] = exp(v[i])` ([`scalar_math::exp`]).
    pub fn exp(&self, v: &mut [f32]) {
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.exp)(v) }
    }

    /// The largest non-NaN value of `v`, −inf when there is none ([`scalar_math::max`]).
    pub fn max(&self, v: &[f32]) -> f32 {
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.max)(v) }
    }

    /// `g[i] = silu(g[i]) · u[i]` ([`scalar_math::silu`]).
    ///
    /// Panics if the lengths differ.
    pub fn silu_mul(&self, g: &mut [f32], u: &[f32]) {
        assert_eq!(g.len(), u.len(), "silu_mul lengths");
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.silu_mul)(g, u) }
    }

    /// `g[i] = gelu_tanh(g[i]) · u[i]` ([`scalar_math::gelu_tanh`]).
    ///
    /// Panics if the lengths differ.
    pub fn gelu_mul(&self, g: &mut [f32], u: &[f32]) {
        assert_eq!(g.len(), u.len(), "gelu_mul lengths");
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.gelu_mul)(g, u) }
    }

    /// The gated delta rule's step of one value head ([`scalar_delta`]): state `s`
    /// (dk × dv), output `o` (dv), scratch `delta` (dv).
    ///
    /// Panics if the lengths disagree.
    pub fn delta_head(&self, x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
        let (dk, dv) = (x.k.len(), o.len());
        assert!(
            x.q.len() == dk
                && s.len() == dk * dv
                && [x.v.len(), x.z.len(), x.lnorm.len(), delta.len()] == [dv; 4],
            "delta_head: dk {dk}, dv {dv}, state {}",
            s.len()
        );
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.delta)(x, s, o, delta) }
    }

    /// Dequantizes row `r` of `w` into `out` (`cols` values): `out[c] = q·d`, one f32
    /// multiply (`quant::dequant_row`), from the packed copy when there is one (the
    /// map's pages of a packed matrix were released), f16 scales converted with this
    /// tier's conversion (exact: the bits of `quant::dequant_mat_row`).
    ///
    /// Panics if `r >= rows` or `out.len() != cols`.
    pub fn dequant_row(&self, w: &WeightMat, r: usize, out: &mut [f32]) {
        let (p, w) = (w.packed, &w.mat);
        assert!(r < w.rows, "row {r} of {}", w.rows);
        assert_eq!(out.len(), w.cols, "out length vs cols");
        let (mut qbuf, mut buf) = (Vec::new(), Vec::new());
        let (q, d) = match p {
            // Packed: the map's pages of this matrix were released; read the copy.
            Some(p) => {
                p.unpack_row(r, &mut qbuf, &mut buf);
                (&qbuf[..], &buf[..])
            }
            // A type without a scale array (BF16, F16, GGUF blocks) carries its own.
            None if !w.wtype.has_scales() => (w.row_q(r), &buf[..]),
            None => (w.row_q(r), scales(w, r, r + 1, &mut buf, self.f16)),
        };
        crate::quant::dequant_row(w.wtype, q, d, out)
    }

    /// Quantizes `x` (a multiple of 32 values) into `q` (same length) and `d` (one per 32).
    ///
    /// Panics if the lengths disagree.
    pub fn quantize_act(&self, x: &[f32], q: &mut [i8], d: &mut [f32]) {
        assert!(
            x.len().is_multiple_of(QK) && q.len() == x.len() && d.len() * QK == x.len(),
            "quantize_act: x {} q {} d {}",
            x.len(),
            q.len(),
            d.len()
        );
        // SAFETY: `self` exists only for a tier the CPU supports; lengths checked above.
        unsafe { (self.quant)(x, q, d) }
    }

    /// `ys[i] = ws[i]·x` for matrices that share their input (q/k/v, gate/up): one
    /// parallel step for all of them when they are packed, so a decode step waits at
    /// one barrier instead of several. Same results as separate [`Kernels::matmul`]s.
    pub fn matmul_each(&self, ws: &[&WeightMat], x: &QActs, ys: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), ys.len(), "matrices vs outputs");
        let packed = |w: &&WeightMat| w.packed.is_some() && self.packs_type(w.mat.wtype);
        if !ws.iter().all(packed) {
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                self.matmul(w, x, y);
            }
            return;
        }
        if x.n() == 0 {
            return;
        }
        let plans: Vec<PackedPlan> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| {
                let (f, p) = (self.packed_fn(w.mat.wtype), w.packed);
                PackedPlan::new(f.expect("checked above"), p.expect("checked above"), x, y)
            })
            .collect();
        run_plans(&plans, x);
    }

    /// `y = W·x` for one token (`x.n() == 1`, `y.len() == w.rows`).
    pub fn matvec(&self, w: &WeightMat, x: &QActs, y: &mut [f32]) {
        assert_eq!(x.n(), 1, "matvec takes one token");
        self.matmul(w, x, y);
    }

    /// `y[t·rows + r] = W[r]·x[t]` for all `n` tokens (token-major output).
    ///
    /// Panics if `x.cols() != w.cols` or `y.len() != x.n()·w.rows`.
    pub fn matmul(&self, w: &WeightMat, x: &QActs, y: &mut [f32]) {
        let (p, w) = (w.packed, &w.mat);
        let n = x.n();
        assert_eq!(x.cols(), w.cols, "activation cols vs matrix cols");
        assert_eq!(y.len(), n * w.rows, "y length vs n x rows");
        if n == 0 {
            return;
        }
        if let (Some(p), Some(f)) = (p, self.packed_fn(w.wtype)) {
            return run_plans(&[PackedPlan::new(f, p, x, y)], x);
        }
        let tile = self.mats[w.wtype as usize]
            .unwrap_or_else(|| panic!("no {} kernel on tier {}", w.wtype, self.tier))
            .tile;
        let chunk = rows_per_task(w.rows, w.cols * n);
        let tiles = token_tiles(x, TILE_TOKENS);
        let (rb, nb) = (w.wtype.row_bytes(w.cols), w.blocks());
        // f16 scales are converted per sub-block of rows into a per-thread buffer; f32
        // scales are borrowed, so a decode task takes its rows in one kernel call.
        let step = if w.d16.is_empty() { w.rows } else { SUB_ROWS };
        if n == 1 {
            // One chunk runs on this thread (`pool::run` of one task).
            pool::for_chunks(y, chunk, |i: usize, yc: &mut [f32]| {
                SCALES.with_borrow_mut(|buf| {
                    for (j, ys) in yc.chunks_mut(step).enumerate() {
                        let s0 = i * chunk + j * step;
                        let s1 = s0 + ys.len();
                        let wd = scales(w, s0, s1, buf, self.f16);
                        // SAFETY: a supported tier's kernel; slices sized per `TileFn`.
                        unsafe { tile(ys.len(), &w.q[s0 * rb..s1 * rb], wd, &tiles[0], ys) };
                    }
                });
            });
            return;
        }
        let out = SharedOut(y.as_mut_ptr());
        let tasks = w.rows.div_ceil(chunk);
        let run = |i: usize| {
            let r1 = ((i + 1) * chunk).min(w.rows);
            // Rows in sub-blocks whose weights stay in L1/L2 across the token tiles; each
            // tile's outputs go through a small buffer and are written in runs per token.
            let mut buf = [0.0f32; SUB_ROWS * TILE_TOKENS];
            SCALES.with_borrow_mut(|sbuf| {
                for s0 in (i * chunk..r1).step_by(SUB_ROWS) {
                    let nr = SUB_ROWS.min(r1 - s0);
                    let wq = &w.q[s0 * rb..(s0 + nr) * rb];
                    let wd = scales(w, s0, s0 + nr, sbuf, self.f16);
                    for (k, xt) in tiles.iter().enumerate() {
                        let nt = xt.d.len() / nb;
                        let b = &mut buf[..nr * nt];
                        // SAFETY: a supported tier's kernel; slices sized per `TileFn`.
                        unsafe { tile(nr, wq, wd, xt, b) };
                        for t in 0..nt {
                            let row0 = (k * TILE_TOKENS + t) * w.rows + s0;
                            for j in 0..nr {
                                // SAFETY: token k·TILE_TOKENS + t < n and s0 + j < r1 ≤ rows,
                                // so the index is inside y; task i alone writes its rows.
                                unsafe { out.write(row0 + j, b[j * nt + t]) };
                            }
                        }
                    }
                }
            });
        };
        pool::run(tasks, run);
    }
}

thread_local! {
    /// Scales of one sub-block of rows converted from f16 (f16-scale files).
    static SCALES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows per sub-block of a multi-token task (its weights, ~40 KB for 576 Q8_0 columns,
/// are reused by every token tile).
const SUB_ROWS: usize = 64;

/// `y`'s base pointer, shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

// SAFETY: tasks only write disjoint indices (see `Kernels::matmul`), the slice outlives them.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The address of element `i` (no access).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }

    /// # Safety
    /// `i` is inside the slice and no other thread accesses element `i` concurrently.
    unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *self.0.add(i) = v }
    }
}

/// Rows per pool task: enough work (~64K multiply-adds) to pay for a task, about
/// four tasks per thread, a multiple of 16.
fn rows_per_task(rows: usize, macs_per_row: usize) -> usize {
    let min_rows = (65536 / macs_per_row.max(1)).max(1);
    let per_thread = rows.div_ceil(4 * pool::threads());
    per_thread.max(min_rows).next_multiple_of(16).min(rows)
}

/// One packed matrix product cut into pool tasks (run by [`run_plans`]).
struct PackedPlan<'a> {
    f: PackedFn,
    v: packed::PackedView<'a>,
    groups: usize,
    /// Groups per task.
    per_task: usize,
    /// Groups per sub-block of a task (see [`sub_groups`]).
    sub: usize,
    tasks: usize,
    out: SharedOut,
    rows: usize,
}

impl<'a> PackedPlan<'a> {
    /// Checks the shapes like [`Kernels::matmul`] (panics on a mismatch).
    fn new(f: PackedFn, p: &'a PackedMat, x: &QActs, y: &mut [f32]) -> Self {
        let n = x.n();
        assert_eq!(x.cols(), p.cols, "activation cols vs matrix cols");
        assert_eq!(y.len(), n * p.rows, "y length vs n x rows");
        let groups = p.groups();
        let per_task = rows_per_task(p.rows, p.cols * n).div_ceil(packed::GROUP);
        PackedPlan {
            f,
            v: p.view(),
            groups,
            per_task,
            sub: sub_groups(p.bytes() / groups.max(1)),
            tasks: groups.div_ceil(per_task),
            out: SharedOut(y.as_mut_ptr()),
            rows: p.rows,
        }
    }

    /// Task `i`: its groups in sub-blocks of [`SUB_GROUPS`] whose weights stay in cache
    /// across the token tiles.
    fn run(&self, i: usize, tiles: &[ActTile]) {
        let g1 = ((i + 1) * self.per_task).min(self.groups);
        for s0 in (i * self.per_task..g1).step_by(self.sub) {
            let s1 = (s0 + self.sub).min(g1);
            for (k, xt) in tiles.iter().enumerate() {
                let y = self.out.at(k * PACKED_TILE * self.rows);
                // SAFETY: a supported tier's kernel; `xt` holds 1..=PACKED_TILE tokens
                // of `v.nb` blocks; tile k's outputs start at row k·PACKED_TILE of y
                // (n × rows, checked in `new`) and task i alone writes rows of groups
                // s0..s1.
                unsafe { (self.f)(&self.v, s0, s1, xt, y, self.rows) };
            }
        }
    }
}

/// Packed products of one input `x` (a single `y = W·x`, or [`Kernels::matmul_each`]'s
/// several) as one pool step: every plan's tasks (runs of 16-row groups) in one list.
fn run_plans(plans: &[PackedPlan], x: &QActs) {
    let tiles = token_tiles(x, PACKED_TILE);
    let total: usize = plans.iter().map(|p| p.tasks).sum();
    pool::run(total, |mut i| {
        for p in plans {
            if i < p.tasks {
                return p.run(i, &tiles);
            }
            i -= p.tasks;
        }
    });
}

/// Weight bytes per sub-block of a packed task: a sub-block's groups are read by every
/// token tile of a prompt, so they should stay in L2, with room for the tile's
/// activations (a 512 KiB L2 on Zen 3 is the smallest of the hosts here).
const SUB_BYTES: usize = 256 << 10;

/// Groups per sub-block of a packed task whose groups take `group_bytes` each: as many
/// as [`SUB_BYTES`] holds, at least 64 rows. More rows per sub-block read the prompt's
/// activations (which outgrow L2 from a few hundred tokens) fewer times.
fn sub_groups(group_bytes: usize) -> usize {
    (SUB_BYTES / group_bytes.max(1)).max(SUB_ROWS / packed::GROUP)
}

/// The activations cut into tiles of `size` tokens (the last may be shorter).
fn token_tiles(x: &QActs, size: usize) -> Vec<ActTile<'_>> {
    let (n, nb) = (x.n(), x.cols() / QK);
    let all = ActTile {
        q: &x.q,
        d: &x.d,
        s: &x.s,
        q4: &x.q4,
        h: &x.h,
        xs: &x.xs,
        iq: &x.iq,
        id: &x.id,
        is: &x.is,
        ih: &x.ih,
        ixs: &x.ixs,
        stream: n <= size,
    };
    (0..n)
        .step_by(size)
        .map(|t0| all.tokens(nb, t0, (t0 + size).min(n)))
        .collect()
}

thread_local! {
    /// A tier forced on this thread by [`with_tier`].
    static FORCED: Cell<Option<Kernels>> = const { Cell::new(None) };
}

/// The tier to use given the supported ones (ascending) and a `KRAFLA_KERNEL` value:
/// the highest supported tier not above the asked one (an unknown name is ignored).
fn choose_tier(supported: &[Tier], asked: Option<&str>) -> Tier {
    let cap = asked.and_then(Tier::from_name);
    let ok = |t: &Tier| cap.is_none_or(|c| *t <= c);
    supported.iter().copied().rfind(ok).unwrap_or(Tier::Scalar)
}

/// The best supported tier, lowered (never raised) by `KRAFLA_KERNEL`; chosen once.
fn detected() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(|| {
        let asked = std::env::var("KRAFLA_KERNEL").ok();
        let t = choose_tier(&supported_tiers(), asked.as_deref());
        Kernels::for_tier(t).unwrap_or_else(scalar_kernels)
    })
}

/// The scalar reference kernels, available everywhere.
fn scalar_kernels() -> Kernels {
    Kernels {
        tier: Tier::Scalar,
        quant: scalar::quantize_act,
        f16: scalar::f16_to_f32,
        mats: per_type(|w| {
            let tile = match w {
                WType::Q8_0 => scalar::tile_q8,
                WType::Q4_0 => scalar::tile_q4,
                _ => return scalar_blocks(w),
            };
            Some(MatKernels { tile, packed: None })
        }),
        half: half::SCALAR,
        half_acts: half::HalfActs::F32,
        f32: SCALAR_F32,
    }
}

/// The scalar reference's entry of a GGUF block type (`None` for other types).
fn scalar_blocks(w: WType) -> Option<MatKernels> {
    for_block_type!(w, |B| MatKernels {
        tile: scalar_k::tile::<B>,
        packed: None,
    })
}

/// The kernels the free functions use: [`with_tier`]'s on this thread, else the detected.
pub fn kernels() -> Kernels {
    FORCED.with(|f| f.get()).unwrap_or(*detected())
}

/// The active tier on this thread.
pub fn tier() -> Tier {
    kernels().tier
}

/// Runs `f` with tier `t` forced for the free functions called on this thread (the
/// parallel work they start inherits it). `Err` if the CPU cannot run `t`.
pub fn with_tier<R>(t: Tier, f: impl FnOnce() -> R) -> Result<R, ShapeError> {
    let k =
        Kernels::for_tier(t).ok_or_else(|| ShapeError(format!("tier {t} not supported here")))?;
    let prev = FORCED.with(|c| c.replace(Some(k)));
    struct Restore(Option<Kernels>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(prev);
    Ok(f())
}

/// Quantizes activations with the active tier (see [`Kernels::quantize_act`]).
pub fn quantize_act(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    kernels().quantize_act(x, q, d)
}

/// `y = W·x` for one token with the active tier (see [`Kernels::matvec`]).
pub fn matvec(w: &WeightMat, x: &QActs, y: &mut [f32]) {
    kernels().matvec(w, x, y)
}

/// `y = W·x` for `x.n()` tokens with the active tier (see [`Kernels::matmul`]).
pub fn matmul(w: &WeightMat, x: &QActs, y: &mut [f32]) {
    kernels().matmul(w, x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_blocks_fill_256_kib_and_hold_64_rows() {
        // Q5_K at 2048 columns: 64 positions of 392 bytes a group.
        assert_eq!(sub_groups(64 * 392), 10);
        // Q4_0 and Q8_0 (f16 scales) at 4096 columns.
        assert_eq!(sub_groups(128 * (256 + 32)), 7);
        assert_eq!(sub_groups(128 * (512 + 32)), 4);
        // Wider rows: never fewer than 64 rows; tiny groups: as many as fit.
        assert_eq!(sub_groups(256 * 544), 4);
        assert_eq!(sub_groups(2 * 544), 240);
        assert_eq!(sub_groups(0), 1 << 18);
    }

    /// 10 tokens of 2 blocks: quant `q[32·(2t + b) + i]` is `t·12 + b·4 + i % 4` (small
    /// enough for i8), so a block's token and index are readable from its bytes.
    fn ten_tokens() -> QActs {
        let (n, nb) = (10, 2);
        let q: Vec<i8> = (0..n * nb * QK)
            .map(|j| ((j / (nb * QK)) * 12 + (j / QK % nb) * 4 + j % 4) as i8)
            .collect();
        let d: Vec<f32> = (0..n * nb).map(|b| b as f32 + 0.5).collect();
        QActs::from_parts(n, nb * QK, q, d).unwrap()
    }

    #[test]
    fn interleaved_tiles_put_a_blocks_tokens_together() {
        let a = ten_tokens();
        // Tile 0 (8 tokens): block b of token t at 8b + t; tile 1 (2 tokens) after it:
        // block b of token 8 + t at 16 + 2b + t.
        let at = |t: usize, b: usize| {
            if t < 8 {
                8 * b + t
            } else {
                16 + 2 * b + (t - 8)
            }
        };
        for t in 0..10 {
            for b in 0..2 {
                let (from, to) = (2 * t + b, at(t, b));
                assert_eq!(
                    a.iq[to * QK..(to + 1) * QK],
                    a.q[from * QK..(from + 1) * QK]
                );
                assert_eq!(
                    a.iq[to * QK] as usize,
                    t * 12 + b * 4,
                    "token {t} block {b}"
                );
                assert_eq!(a.id[to].to_bits(), a.d[from].to_bits());
                assert_eq!(
                    (a.is[to], a.ih[to], a.ixs[to].to_bits()),
                    (a.s[from], a.h[from], a.xs[from].to_bits())
                );
            }
        }
        // Packed tiles keep their interleaved slices; tiles cut elsewhere have none,
        // unless one is a packed tile all the same (tokens 8..10, the last).
        let packed = token_tiles(&a, PACKED_TILE);
        assert_eq!(
            packed.iter().map(|t| t.iq.len()).collect::<Vec<_>>(),
            [8 * 64, 2 * 64]
        );
        assert_eq!(packed[1].id, &a.id[16..20]);
        let fours = token_tiles(&a, 4);
        let lens: Vec<_> = fours
            .iter()
            .map(|t| (t.iq.len(), t.id.len(), t.ixs.len()))
            .collect();
        assert_eq!(lens, [(0, 0, 0), (0, 0, 0), (2 * 64, 4, 4)]);
        assert_eq!(fours[2].iq, packed[1].iq);
    }

    #[test]
    fn derive_on_the_pool_matches_one_thread() {
        // 100 tokens of 2048 values: 7 tasks of 16 tokens (two packed tiles each).
        let (n, cols) = (100, 2048);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7919 % 1999) as f32 - 999.0) / 300.0)
            .collect();
        let on = |threads: usize| {
            crate::kernels::pool::Pool::leak(threads).install(|| {
                let mut a = QActs::new();
                a.quantize_with(&scalar_kernels(), &x, cols);
                a
            })
        };
        let (one, two) = (on(1), on(2));
        let f = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            (&one.q, &one.s, &one.h, &one.q4),
            (&two.q, &two.s, &two.h, &two.q4)
        );
        assert_eq!((f(&one.d), f(&one.xs)), (f(&two.d), f(&two.xs)));
        assert_eq!((&one.iq, &one.is, &one.ih), (&two.iq, &two.is, &two.ih));
        assert_eq!((f(&one.id), f(&one.ixs)), (f(&two.id), f(&two.ixs)));
        // The tasks' own parts (the same split runs inline on one thread): every block
        // against a direct computation, e.g. token 37's block 5 in tile 4 (32..40) at
        // 32·64 + 5·8 + 5; the last tile (96..100) has 4 tokens.
        let nb = cols / QK;
        for t in 0..n {
            let (u, k) = (t / 8 * 8, if t >= 96 { 4 } else { 8 });
            for b in 0..nb {
                let (from, to) = (t * nb + b, u * nb + b * k + (t - u));
                let qb = &two.q[from * QK..(from + 1) * QK];
                let sum = |v: &[i8]| v.iter().map(|&x| x as i32).sum::<i32>();
                assert_eq!((two.s[from], two.h[from]), (sum(qb), sum(&qb[..16])));
                assert_eq!(
                    two.xs[from].to_bits(),
                    (two.d[from] * two.s[from] as f32).to_bits()
                );
                assert_eq!(&two.iq[to * QK..(to + 1) * QK], qb, "token {t} block {b}");
                assert_eq!(
                    (two.id[to], two.is[to], two.ih[to], two.ixs[to]),
                    (two.d[from], two.s[from], two.h[from], two.xs[from])
                );
            }
        }
    }

    #[test]
    fn env_var_only_lowers() {
        use Tier::*;
        let x86 = [Scalar, Avx2, Avx512, Avx512Vnni, Avx512Bf16];
        assert_eq!(choose_tier(&x86, None), Avx512Bf16);
        assert_eq!(choose_tier(&x86, Some("avx2")), Avx2);
        assert_eq!(choose_tier(&x86, Some("avx512vnni")), Avx512Vnni);
        assert_eq!(choose_tier(&x86, Some("scalar")), Scalar);
        assert_eq!(choose_tier(&x86, Some("bogus")), Avx512Bf16);
        assert_eq!(choose_tier(&[Scalar, Avx2], Some("avx512vnni")), Avx2);
        assert_eq!(choose_tier(&x86[..4], Some("avx512bf16")), Avx512Vnni);
        // NEON sorts above the x86 tiers but is never in an x86 list.
        assert_eq!(choose_tier(&[Scalar, Neon], Some("avx2")), Scalar);
        assert_eq!(choose_tier(&x86, Some("neon")), Avx512Bf16);
    }

    #[test]
    fn tiers_agree_on_a_small_case() {
        let (rows, cols, n) = (5, 96, 3);
        let q: Vec<u8> = (0..rows * cols)
            .map(|i| ((i * 37 % 255) as i32 - 127) as i8 as u8)
            .collect();
        let d: Vec<f32> = (0..rows * cols / QK)
            .map(|i| 0.01 * (i as f32 - 3.0))
            .collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.3)
            .collect();
        let w = QMat::new(WType::Q8_0, rows, cols, &q, &d).unwrap().into();
        let mut xa = QActs::new();
        xa.quantize_with(&scalar_kernels(), &x, cols);
        let mut y0 = vec![0.0; n * rows];
        scalar_kernels().matmul(&w, &xa, &mut y0);
        for t in supported_tiers() {
            let k = Kernels::for_tier(t).unwrap();
            let mut y = vec![0.0; n * rows];
            k.matmul(&w, &xa, &mut y);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y), bits(&y0), "tier {t}");
        }
    }
}
