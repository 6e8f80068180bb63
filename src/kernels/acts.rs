//! The activations the matrix products take, data only: [`QActs`] (a step's rows
//! quantized to Q8_0, with what the kernels derive from the quants: block sums, the
//! Q4_0 arrangement, copies interleaved per packed tile), [`ActTile`] (consecutive
//! tokens of it as a micro-kernel sees them) and [`HalfActs`] (what BF16 weights
//! multiply). The table's quantizer fills a [`QActs`] (`Kernels::quantize_acts`).

use std::fmt;
use std::str::FromStr;

use super::error::ShapeError;
use super::pool;
use crate::format::wtype::QK;

/// Most tokens one row-major micro-kernel call handles (a tile shares each weight block
/// load).
pub const TILE_TOKENS: usize = 4;

/// Most tokens per packed micro-kernel call. (16 measured slower for the block types'
/// VNNI kernel: 0.7× Q4_K's and Q6_K's batch throughput on an Ice Lake Xeon.)
pub const PACKED_TILE: usize = 8;

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
    /// (`scalar::blocks::act_xs`), once per token instead of once per row.
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
    /// Where the segments start and end (ascending, from 0 to `n`): each segment's
    /// packed tiles run from its own start (one segment by default). A grouped step
    /// quantizes the rows of several experts at once, one segment each.
    bounds: Vec<usize>,
}

/// Values per pool task when quantizing many tokens.
pub(super) const QUANT_PAR_VALUES: usize = 32768;

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

/// The packed tiles `tiles` (start, tokens; consecutive, the first at `t0`) of `src`
/// (`w` values per block, `nb` blocks per token) into `dst`, interleaved per tile: in
/// the tile of tokens `u..u + k`, block `b` of token `u + t` goes to block
/// `(u − t0)·nb + b·k + t` (see [`ActTile::iq`]).
fn interleave<T: Copy>(src: &[T], w: usize, nb: usize, tiles: &[(usize, usize)], dst: &mut [T]) {
    let Some(&(t0, _)) = tiles.first() else {
        return;
    };
    for &(u, k) in tiles {
        for t in 0..k {
            for b in 0..nb {
                let (from, to) = ((u + t) * nb + b, (u - t0) * nb + b * k + t);
                dst[to * w..(to + 1) * w].copy_from_slice(&src[from * w..(from + 1) * w]);
            }
        }
    }
}

/// The packed tiles of segments `bounds`: each segment's tokens in runs of
/// [`PACKED_TILE`] from its start, the last shorter; (start, tokens).
fn packed_tiles(bounds: &[usize]) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for s in bounds.windows(2) {
        for u in (s[0]..s[1]).step_by(PACKED_TILE) {
            v.push((u, PACKED_TILE.min(s[1] - u)));
        }
    }
    v
}

/// The first `len` values of `v`; `v` keeps the rest.
fn split<'a, T>(v: &mut &'a mut [T], len: usize) -> &'a mut [T] {
    let (a, b) = std::mem::take(v).split_at_mut(len);
    *v = b;
    a
}

/// One pool task of [`QActs::derive`]: whole packed tiles, from token `t0`, and their
/// parts of the per-token Q4_0 arrangement and of the interleaved arrays.
struct Unit<'a> {
    tiles: &'a [(usize, usize)],
    q4: &'a mut [i8],
    iq: &'a mut [i8],
    id: &'a mut [f32],
    is: &'a mut [i32],
    ih: &'a mut [i32],
    ixs: &'a mut [f32],
}

impl QActs {
    /// Fills what the kernels derive from `q` and `d`: `s`, `h`, `xs`, `q4` and the
    /// interleaved `iq`, `id`, `is`, `ih`, `ixs`. A prompt's worth is split over the pool in
    /// whole packed tiles of tokens (each value is computed alone: no bit changes).
    pub(super) fn derive(&mut self) {
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
        // Units of whole tiles of about `per` tokens (with one segment: `per` tokens,
        // a multiple of the tile).
        let tiles = packed_tiles(&self.bounds);
        let mut cuts = vec![0];
        for (i, &(u, _)) in tiles.iter().enumerate() {
            if u - tiles[cuts[cuts.len() - 1]].0 >= per {
                cuts.push(i);
            }
        }
        cuts.push(tiles.len());
        let (mut q4, mut iq) = (&mut self.q4[..], &mut self.iq[..]);
        let (mut id, mut is) = (&mut self.id[..], &mut self.is[..]);
        let (mut ih, mut ixs) = (&mut self.ih[..], &mut self.ixs[..]);
        let mut units = Vec::with_capacity(cuts.len());
        for c in cuts.windows(2) {
            let tl = &tiles[c[0]..c[1]];
            let t: usize = tl.iter().map(|&(_, k)| k).sum();
            let (bq, bb) = (t * cols, t * nb);
            units.push(Unit {
                tiles: tl,
                q4: split(&mut q4, t * l4),
                iq: split(&mut iq, bq),
                id: split(&mut id, bb),
                is: split(&mut is, bb),
                ih: split(&mut ih, bb),
                ixs: split(&mut ixs, bb),
            });
        }
        let (s, h, xs) = (&self.s, &self.h, &self.xs);
        par.for_chunks(&mut units, 1, |_, u| {
            let u = &mut u[0];
            let t0 = u.tiles[0].0;
            for (t, ot) in u.q4.chunks_exact_mut(l4).enumerate() {
                arrange_q4(&q[(t0 + t) * cols..(t0 + t + 1) * cols], ot);
            }
            interleave(q, QK, nb, u.tiles, u.iq);
            interleave(d, 1, nb, u.tiles, u.id);
            interleave(s, 1, nb, u.tiles, u.is);
            interleave(h, 1, nb, u.tiles, u.ih);
            interleave(xs, 1, nb, u.tiles, u.ixs);
        });
    }

    /// An empty set (n = 0); `Kernels::quantize_acts` fills it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Shapes the buffers for `n` tokens of `cols` values and gives the quants and
    /// scales to fill (the table's quantizer does), before [`QActs::derive`].
    /// `bounds`: the segments' ends from 0 to n (see [`QActs::segment_tiles`]); empty:
    /// one segment.
    ///
    /// Panics unless `bounds` (when given) ascends from 0 to `n`.
    pub(super) fn shape(
        &mut self,
        n: usize,
        cols: usize,
        bounds: &[usize],
    ) -> (&mut [i8], &mut [f32]) {
        self.n = n;
        self.cols = cols;
        self.bounds.clear();
        if bounds.is_empty() {
            self.bounds.extend([0, n]);
        } else {
            assert!(
                bounds[0] == 0 && bounds[bounds.len() - 1] == n && bounds.is_sorted(),
                "segment bounds {bounds:?} of {n} tokens"
            );
            self.bounds.extend_from_slice(bounds);
        }
        self.q.resize(n * cols, 0);
        self.d.resize(n * cols / QK, 0.0);
        (&mut self.q, &mut self.d)
    }

    /// The buffer of the input rounded to BF16 (for BF16 weights under
    /// [`HalfActs::Bf16`]), kept with the quants so that it is allocated once.
    pub(super) fn bf16_buf(&mut self) -> &mut Vec<u16> {
        &mut self.b16
    }

    /// Values `a..b` of the BF16 rounding (empty when the input was not rounded).
    pub(super) fn b16_rows(&self, a: usize, b: usize) -> &[u16] {
        self.b16.get(a..b).unwrap_or(&[])
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
            bounds: vec![0, n],
        };
        a.derive();
        Ok(a)
    }

    /// These activations cut into tiles of `size` tokens (the last may be shorter).
    #[cfg(test)]
    pub(super) fn tiles(&self, size: usize) -> Vec<ActTile<'_>> {
        self.tiles_of(0, self.n, size)
    }

    /// Segments (one unless quantized by segments, `Kernels::quantize_acts_in`).
    pub fn segments(&self) -> usize {
        self.bounds.len().saturating_sub(1)
    }

    /// The tokens of segment `seg`.
    pub fn segment(&self, seg: usize) -> std::ops::Range<usize> {
        self.bounds[seg]..self.bounds[seg + 1]
    }

    /// Segment `seg`'s tokens cut into tiles of `size` tokens from its start (the last
    /// may be shorter): with [`PACKED_TILE`], the packed kernels' tiles.
    pub(super) fn segment_tiles(&self, seg: usize, size: usize) -> Vec<ActTile<'_>> {
        let r = self.segment(seg);
        self.tiles_of(r.start, r.end, size)
    }

    /// Tokens `a..b` (a segment, or all of one segment) in tiles of `size` from `a`.
    fn tiles_of(&self, a: usize, b: usize, size: usize) -> Vec<ActTile<'_>> {
        let nb = self.cols / QK;
        let all = ActTile {
            q: &self.q,
            d: &self.d,
            s: &self.s,
            q4: &self.q4,
            h: &self.h,
            xs: &self.xs,
            iq: &self.iq,
            id: &self.id,
            is: &self.is,
            ih: &self.ih,
            ixs: &self.ixs,
            stream: b - a <= size,
        };
        (a..b)
            .step_by(size)
            .map(|t0| {
                let t1 = (t0 + size).min(b);
                all.tokens(nb, t0, t1, self.is_packed_tile(t0, t1))
            })
            .collect()
    }

    /// Whether tokens `t0..t1` are one of the packed tiles (whose interleaved copies
    /// exist).
    fn is_packed_tile(&self, t0: usize, t1: usize) -> bool {
        // The segment holding t0: the last bound at or below it with room after it.
        let i = self.bounds.partition_point(|&b| b <= t0);
        let Some(&a) = i.checked_sub(1).and_then(|i| self.bounds.get(i)) else {
            return false;
        };
        let b = self.bounds.get(i).copied().unwrap_or(a);
        (t0 - a).is_multiple_of(PACKED_TILE) && t1 == (t0 + PACKED_TILE).min(b)
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
    /// Tokens `t0..t1` of this tile (all of a [`QActs`]), of `nb` blocks each, with the
    /// interleaved copies when they are one packed tile (`packed`).
    fn tokens(&self, nb: usize, t0: usize, t1: usize, packed: bool) -> ActTile<'a> {
        let (cols, l4) = (nb * QK, q4_layout_len(nb * QK));
        let blocks = t0 * nb..t1 * nb;
        // The interleaved arrays hold whole packed tiles: only such a tile keeps them.
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

/// What BF16 weights multiply: f32 activations (the default contract: every product
/// exact, one rounding per term), or activations rounded to BF16 (`vdpbf16ps`'s
/// arithmetic, as llama.cpp computes; about twice the prompt speed where the CPU has
/// AVX-512 BF16). F16 weights always take f32 activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HalfActs {
    #[default]
    F32,
    Bf16,
}

impl fmt::Display for HalfActs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HalfActs::F32 => "f32",
            HalfActs::Bf16 => "bf16",
        })
    }
}

impl FromStr for HalfActs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(HalfActs::F32),
            "bf16" => Ok(HalfActs::Bf16),
            _ => Err(format!(
                "activations for BF16 weights: {s:?} is not f32 or bf16"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let packed = a.tiles(PACKED_TILE);
        assert_eq!(
            packed.iter().map(|t| t.iq.len()).collect::<Vec<_>>(),
            [8 * 64, 2 * 64]
        );
        assert_eq!(packed[1].id, &a.id[16..20]);
        let fours = a.tiles(4);
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
        // The scalar reference's quantizer: `q8_0::quantize_block` per block.
        let (mut q, mut d) = (vec![0i8; n * cols], vec![0f32; n * cols / QK]);
        for ((xb, qb), db) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(&mut d) {
            *db = crate::quant::q8_0::quantize_block(xb, qb);
        }
        let on = |threads: usize| {
            pool::Pool::leak(threads)
                .install(|| QActs::from_parts(n, cols, q.clone(), d.clone()).unwrap())
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
}
