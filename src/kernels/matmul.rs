//! The matrix products through the table, and the one scheduler that cuts them into
//! tasks of the thread pool ([`super::pool`]): `y = W·x` for every weight type, and the
//! calls the forward pass makes for any matrix input ([`Kernels::project`]): f32 rows
//! for 2-byte float weights, Q8_0 activations (quantized once per input,
//! [`Kernels::quantize_acts`]) for every other type.
//!
//! Rows are independent and every (row, token) output is its own chain of the contract
//! (docs/kernels.md), so the results depend neither on the thread count nor on how rows
//! are split between tasks:
//!
//! * row-major quantized matrices: a task takes [`rows_per_task`] rows, in sub-blocks of
//!   [`SUB_ROWS`] whose weights stay in L1/L2 across the tiles of
//!   [`TILE_TOKENS`] tokens (f16 scales converted per sub-block);
//! * products that run as one pool step ([`Plan`], [`run_plans`]): packed matrices
//!   (tasks of 16-row groups in sub-blocks of [`SUB_BYTES`] of weights, against tiles of
//!   [`PACKED_TILE`] tokens) and BF16 / F16 matrices (tasks of rows in sub-blocks of
//!   [`SUB_ROWS`], against tiles of [`HALF_TILE`] tokens); matrices that share an input
//!   (q/k/v, gate/up) put all their tasks in one list, so a decode step waits at one
//!   barrier instead of several.
//!
//! BF16 weights can take activations rounded to BF16 ([`HalfActs::Bf16`], opt-in: the
//! contract of `docs/kernels.md`, "BF16 activations", which is `vdpbf16ps`): the input
//! is rounded once per projection ([`round_bf16_slice`]) and the tier's `DotFn` runs
//! it; the reference `scalar::bf16dot` gives its bits.

use std::cell::RefCell;

use super::acts::{ActTile, HalfActs, QActs, PACKED_TILE, QUANT_PAR_VALUES, TILE_TOKENS};
use super::mat::WeightMat;
use super::packed::{DecodedView, Line, PackedRows, PackedView, DECODED_LINES, GROUP};
use super::pool;
use super::scalar::bf16dot::round_bf16_slice;
use super::table::{kernels, DecodedKernels, DotFn, F16Fn, HalfFn, Kernels, PackedFn, TileFn};
use crate::format::mat::QMat;
use crate::format::wtype::{WType, QK};

/// Rows per sub-block of a multi-token task (its weights, ~40 KB for 576 Q8_0 columns,
/// are reused by every token tile).
const SUB_ROWS: usize = 64;

/// Tokens per kernel call of a 2-byte float product in prefill: the activations of a
/// tile (24 × 2048 f32 = 192 KiB at most for these models) and a sub-block of weight
/// rows stay in L2.
pub const HALF_TILE: usize = 24;

/// Weight bytes per sub-block of a packed task: a sub-block's groups are read by every
/// token tile of a prompt, so they should stay in L2, with room for the tile's
/// activations (a 512 KiB L2 on Zen 3 is the smallest of the hosts here).
const SUB_BYTES: usize = 256 << 10;

/// Values per pool task when rounding many tokens to BF16.
const ROUND_PAR_VALUES: usize = 65536;

thread_local! {
    /// Scales of one sub-block of rows converted from f16 (f16-scale files).
    static SCALES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// One sub-block of a codebook matrix's rows, decoded ([`DecodedPlan`]).
    static DECODED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

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

/// Groups per sub-block of a packed task whose groups take `group_bytes` each: as many
/// as [`SUB_BYTES`] holds, at least 64 rows. More rows per sub-block read the prompt's
/// activations (which outgrow L2 from a few hundred tokens) fewer times.
fn sub_groups(group_bytes: usize) -> usize {
    (SUB_BYTES / group_bytes.max(1)).max(SUB_ROWS / GROUP)
}

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

/// How a product over 16-row groups is cut into pool tasks, shared by the packed and the
/// decoded products: runs of groups per task, each run in sub-blocks whose weights stay in
/// cache across the input's tiles of [`PACKED_TILE`] tokens.
struct GroupTasks<'a> {
    /// The input's tiles of [`PACKED_TILE`] tokens.
    tiles: &'a [ActTile<'a>],
    groups: usize,
    /// Groups per task.
    per_task: usize,
    /// Groups per sub-block of a task (see [`sub_groups`]).
    sub: usize,
    tasks: usize,
    out: SharedOut,
    rows: usize,
}

impl<'a> GroupTasks<'a> {
    /// The tasks of a `rows × cols` matrix whose groups take `group_bytes` each, times the
    /// `n` tokens of `tiles` into `y` (panics if `y` is not `n × rows`).
    fn new(
        rows: usize,
        cols: usize,
        group_bytes: usize,
        tiles: &'a [ActTile<'a>],
        n: usize,
        y: &mut [f32],
    ) -> Self {
        assert_eq!(y.len(), n * rows, "y length vs n x rows");
        let groups = rows.div_ceil(GROUP);
        let per_task = rows_per_task(rows, cols * n).div_ceil(GROUP);
        GroupTasks {
            tiles,
            groups,
            per_task,
            sub: sub_groups(group_bytes),
            tasks: if n == 0 { 0 } else { groups.div_ceil(per_task) },
            out: SharedOut(y.as_mut_ptr()),
            rows,
        }
    }

    /// Task `i`'s sub-blocks of groups, `(s0, s1)` in order.
    fn sub_blocks(&self, i: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let g1 = ((i + 1) * self.per_task).min(self.groups);
        (i * self.per_task..g1)
            .step_by(self.sub)
            .map(move |s0| (s0, (s0 + self.sub).min(g1)))
    }

    /// Where tile `k`'s outputs start: row `k·PACKED_TILE` of y (n × rows).
    fn tile_out(&self, k: usize) -> *mut f32 {
        self.out.at(k * PACKED_TILE * self.rows)
    }
}

/// One packed matrix product cut into pool tasks (runs of 16-row groups).
struct PackedPlan<'a> {
    f: PackedFn,
    v: PackedView<'a>,
    g: GroupTasks<'a>,
}

impl<'a> PackedPlan<'a> {
    /// The product of `p` and the `n` tokens of `tiles` (of [`PACKED_TILE`]) into `y`;
    /// checks the shapes like [`Kernels::matmul`] (panics on a mismatch).
    fn new(
        f: PackedFn,
        p: PackedRows<'a>,
        cols: usize,
        tiles: &'a [ActTile<'a>],
        n: usize,
        y: &mut [f32],
    ) -> Self {
        assert_eq!(cols, p.cols(), "activation cols vs matrix cols");
        let group_bytes = p.bytes() / p.groups().max(1);
        PackedPlan {
            f,
            v: p.view(),
            g: GroupTasks::new(p.rows(), p.cols(), group_bytes, tiles, n, y),
        }
    }

    /// Task `i`: its groups in sub-blocks whose weights stay in cache across the token
    /// tiles.
    fn run(&self, i: usize) {
        for (s0, s1) in self.g.sub_blocks(i) {
            for (k, xt) in self.g.tiles.iter().enumerate() {
                // SAFETY: a supported tier's kernel; `xt` holds 1..=PACKED_TILE tokens
                // of `v.nb` blocks; tile k's outputs start at row k·PACKED_TILE of y
                // (n × rows, checked in `new`) and task i alone writes rows of groups
                // s0..s1.
                unsafe { (self.f)(&self.v, s0, s1, xt, self.g.tile_out(k), self.g.rows) };
            }
        }
    }
}

/// One product of a row-major quantized matrix cut into pool tasks (runs of rows): a
/// task takes its rows in sub-blocks of [`SUB_ROWS`] whose weights stay in L1/L2 across
/// the tiles of [`TILE_TOKENS`] tokens (f16 scales converted per sub-block); a decode
/// task (one token) with f32 scales takes its rows in one kernel call.
struct RowPlan<'a> {
    tile: TileFn,
    f16: F16Fn,
    w: QMat<'a>,
    /// The input's tiles of [`TILE_TOKENS`] tokens.
    tiles: &'a [ActTile<'a>],
    n: usize,
    /// Rows per task.
    chunk: usize,
    tasks: usize,
    out: SharedOut,
}

impl<'a> RowPlan<'a> {
    /// Checks the shapes like [`Kernels::matmul`] (panics on a mismatch).
    fn new(
        tile: TileFn,
        f16: F16Fn,
        w: QMat<'a>,
        cols: usize,
        tiles: &'a [ActTile<'a>],
        n: usize,
        y: &mut [f32],
    ) -> Self {
        assert_eq!(cols, w.cols, "activation cols vs matrix cols");
        assert_eq!(y.len(), n * w.rows, "y length vs n x rows");
        let chunk = rows_per_task(w.rows, w.cols * n);
        RowPlan {
            tile,
            f16,
            w,
            tiles,
            n,
            chunk,
            tasks: if n == 0 { 0 } else { w.rows.div_ceil(chunk) },
            out: SharedOut(y.as_mut_ptr()),
        }
    }

    /// Task `i`: rows `i·chunk..`, all tokens.
    fn run(&self, i: usize) {
        let (w, tile) = (&self.w, self.tile);
        let (rb, nb) = (w.wtype.row_bytes(w.cols), w.blocks());
        let r0 = i * self.chunk;
        let r1 = (r0 + self.chunk).min(w.rows);
        if self.n == 1 {
            // f16 scales are converted per sub-block of rows into a per-thread buffer;
            // f32 scales are borrowed, so the task takes its rows in one kernel call.
            let step = if w.d16.is_empty() { w.rows } else { SUB_ROWS };
            // SAFETY: with one token y holds `rows` outputs; task i alone writes r0..r1.
            let yc = unsafe { std::slice::from_raw_parts_mut(self.out.at(r0), r1 - r0) };
            SCALES.with_borrow_mut(|buf| {
                for (j, ys) in yc.chunks_mut(step).enumerate() {
                    let s0 = r0 + j * step;
                    let s1 = s0 + ys.len();
                    let wd = scales(w, s0, s1, buf, self.f16);
                    // SAFETY: a supported tier's kernel; slices sized per `TileFn`.
                    unsafe { tile(ys.len(), &w.q[s0 * rb..s1 * rb], wd, &self.tiles[0], ys) };
                }
            });
            return;
        }
        // Each tile's outputs go through a small buffer and are written in runs per token.
        let mut buf = [0.0f32; SUB_ROWS * TILE_TOKENS];
        SCALES.with_borrow_mut(|sbuf| {
            for s0 in (r0..r1).step_by(SUB_ROWS) {
                let nr = SUB_ROWS.min(r1 - s0);
                let wq = &w.q[s0 * rb..(s0 + nr) * rb];
                let wd = scales(w, s0, s0 + nr, sbuf, self.f16);
                for (k, xt) in self.tiles.iter().enumerate() {
                    let nt = xt.d.len() / nb;
                    let b = &mut buf[..nr * nt];
                    // SAFETY: a supported tier's kernel; slices sized per `TileFn`.
                    unsafe { tile(nr, wq, wd, xt, b) };
                    for t in 0..nt {
                        let row0 = (k * TILE_TOKENS + t) * w.rows + s0;
                        for j in 0..nr {
                            // SAFETY: token k·TILE_TOKENS + t < n and s0 + j < r1 ≤ rows,
                            // so the index is inside y; task i alone writes its rows.
                            unsafe { self.out.write(row0 + j, b[j * nt + t]) };
                        }
                    }
                }
            }
        });
    }
}

/// One product of a codebook matrix and several tokens cut into pool tasks (runs of
/// 16-row groups): a task decodes its groups in sub-blocks of about [`SUB_BYTES`] of
/// decoded levels, each once, into a per-thread buffer, and runs every tile of
/// [`PACKED_TILE`] tokens on it. (The row-major kernel decodes a row's blocks again for
/// every tile of [`TILE_TOKENS`] tokens: 0.11× llama.cpp's prompt speed.)
struct DecodedPlan<'a> {
    k: DecodedKernels,
    w: QMat<'a>,
    g: GroupTasks<'a>,
}

impl<'a> DecodedPlan<'a> {
    /// Checks the shapes like [`Kernels::matmul`] (panics on a mismatch).
    fn new(
        k: DecodedKernels,
        w: QMat<'a>,
        cols: usize,
        tiles: &'a [ActTile<'a>],
        n: usize,
        y: &mut [f32],
    ) -> Self {
        assert_eq!(cols, w.cols, "activation cols vs matrix cols");
        let group_bytes = w.blocks() * DECODED_LINES * 64;
        DecodedPlan {
            k,
            w,
            g: GroupTasks::new(w.rows, w.cols, group_bytes, tiles, n, y),
        }
    }

    /// Task `i`: its groups in sub-blocks, each decoded once for all tiles.
    fn run(&self, i: usize) {
        let (w, nb) = (&self.w, self.w.blocks());
        DECODED.with_borrow_mut(|buf| {
            for (s0, s1) in self.g.sub_blocks(i) {
                buf.resize((s1 - s0) * nb * DECODED_LINES, Line([0; 64]));
                // SAFETY: a supported tier's kernel; `buf` holds the groups' lines.
                unsafe { (self.k.decode)(w.q, w.rows, w.cols, s0, s1, buf) };
                let v = DecodedView {
                    lines: buf,
                    nb,
                    g0: s0,
                    g1: s1,
                    rows: w.rows,
                };
                for (k, xt) in self.g.tiles.iter().enumerate() {
                    // SAFETY: a supported tier's kernel; tile k's outputs start at row
                    // k·PACKED_TILE of y (n × rows, checked in `new`) and task i alone
                    // writes the rows of groups s0..s1.
                    unsafe { (self.k.run)(&v, xt, self.g.tile_out(k), w.rows) };
                }
            }
        });
    }
}

/// A 2-byte float kernel and the activations it takes.
#[derive(Clone, Copy)]
enum Input<'a> {
    F32(HalfFn, &'a [f32]),
    Bf16(DotFn, &'a [u16]),
}

impl Input<'_> {
    /// Values in all.
    fn len(&self) -> usize {
        match self {
            Input::F32(_, x) => x.len(),
            Input::Bf16(_, x) => x.len(),
        }
    }

    /// Runs the kernel on tokens `t0..t1`.
    ///
    /// # Safety
    /// The kernel's contract (`HalfFn`) for `w`, those tokens, `y` and `ld`.
    unsafe fn run(&self, t0: usize, t1: usize, cols: usize, w: &[u8], y: *mut f32, ld: usize) {
        let rows = w.len() / (2 * cols);
        // SAFETY: forwarded caller contract.
        unsafe {
            match *self {
                Input::F32(f, x) => f(rows, cols, w, &x[t0 * cols..t1 * cols], y, ld),
                Input::Bf16(f, x) => f(rows, cols, w, &x[t0 * cols..t1 * cols], y, ld),
            }
        }
    }
}

/// One product of 2-byte float weights cut into pool tasks (runs of rows).
struct HalfPlan<'a> {
    x: Input<'a>,
    w: &'a [u8],
    rows: usize,
    cols: usize,
    n: usize,
    /// Rows per task.
    chunk: usize,
    tasks: usize,
    out: SharedOut,
}

impl<'a> HalfPlan<'a> {
    /// Checks the shapes (panics on a mismatch, like [`Kernels::matmul`]).
    fn new(w: &'a QMat, x: Input<'a>, y: &mut [f32]) -> Self {
        let (rows, cols) = (w.rows, w.cols);
        assert_eq!(x.len() % cols, 0, "activations vs matrix cols");
        let n = x.len() / cols;
        assert_eq!(y.len(), n * rows, "y length vs n x rows");
        assert_eq!(w.q.len(), rows * cols * 2, "weights vs rows x cols");
        let chunk = rows_per_task(rows, cols * n);
        HalfPlan {
            x,
            w: w.q,
            rows,
            cols,
            n,
            chunk,
            tasks: if n == 0 { 0 } else { rows.div_ceil(chunk) },
            out: SharedOut(y.as_mut_ptr()),
        }
    }

    /// Task `i`: rows `i·chunk..`, all tokens.
    fn run(&self, i: usize) {
        let (rows, cols, rb) = (self.rows, self.cols, self.cols * 2);
        let r0 = i * self.chunk;
        let r1 = (r0 + self.chunk).min(rows);
        if self.n == 1 {
            // SAFETY: a supported tier's kernel; rows r0..r1 of w, one token; task i
            // alone writes outputs r0..r1 of y (n × rows, checked in `new`).
            unsafe {
                self.x
                    .run(0, 1, cols, &self.w[r0 * rb..r1 * rb], self.out.at(r0), rows)
            };
            return;
        }
        for s0 in (r0..r1).step_by(SUB_ROWS) {
            let s1 = (s0 + SUB_ROWS).min(r1);
            for t0 in (0..self.n).step_by(HALF_TILE) {
                let t1 = (t0 + HALF_TILE).min(self.n);
                // SAFETY: as above; tokens t0..t1 write y[t·rows + r] for rows s0..s1,
                // inside y and written by this task alone.
                unsafe {
                    self.x.run(
                        t0,
                        t1,
                        cols,
                        &self.w[s0 * rb..s1 * rb],
                        self.out.at(t0 * rows + s0),
                        rows,
                    )
                };
            }
        }
    }
}

/// One matrix product of a pool step, cut into tasks.
enum Plan<'a> {
    Packed(PackedPlan<'a>),
    Decoded(DecodedPlan<'a>),
    Rows(RowPlan<'a>),
    Half(HalfPlan<'a>),
}

impl Plan<'_> {
    fn tasks(&self) -> usize {
        match self {
            Plan::Packed(p) => p.g.tasks,
            Plan::Decoded(p) => p.g.tasks,
            Plan::Rows(p) => p.tasks,
            Plan::Half(p) => p.tasks,
        }
    }

    fn run(&self, i: usize) {
        match self {
            Plan::Packed(p) => p.run(i),
            Plan::Decoded(p) => p.run(i),
            Plan::Rows(p) => p.run(i),
            Plan::Half(p) => p.run(i),
        }
    }
}

/// One matrix input of a grouped step ([`Kernels::project_groups`]): `n × cols` f32
/// rows, token-major, cut into segments by `bounds`, and the [`QActs`] that keeps its
/// Q8_0 form (and its BF16 rounding) for the step.
pub struct GroupInput<'a> {
    pub x: &'a [f32],
    pub cols: usize,
    /// Where the segments start and end (ascending, from 0 to n); empty: one segment of
    /// all n rows. A segment is one product's rows (one expert's tokens).
    pub bounds: &'a [usize],
    pub qa: &'a mut QActs,
}

impl GroupInput<'_> {
    /// The rows of segment `seg`.
    fn rows(&self, seg: usize) -> std::ops::Range<usize> {
        match self.bounds {
            [] => 0..self.x.len() / self.cols,
            b => b[seg]..b[seg + 1],
        }
    }
}

/// One product of a grouped step: `y = w · x` for the rows of segment `seg` of input
/// `input` (`y`: those rows × w.rows, token-major).
pub struct GroupProduct<'a, 'w> {
    pub w: &'a WeightMat<'w>,
    pub input: usize,
    pub seg: usize,
    pub y: &'a mut [f32],
}

/// Products as one pool step: every plan's tasks in one list.
fn run_plans(plans: &[Plan]) {
    let total: usize = plans.iter().map(Plan::tasks).sum();
    pool::run(total, |mut i| {
        for p in plans {
            if i < p.tasks() {
                return p.run(i);
            }
            i -= p.tasks();
        }
    });
}

/// What a matrix takes from an f32 input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Takes {
    /// Q8_0 activations (every quantized type).
    Q8,
    /// The f32 rows as they are (BF16 / F16 by the default contract).
    F32,
    /// The rows rounded to BF16 (BF16 weights under [`HalfActs::Bf16`]).
    Bf16,
}

/// `out` = `x` rounded to BF16 ([`round_bf16_slice`]), by the pool for long inputs.
fn round_into(x: &[f32], out: &mut Vec<u16>) {
    out.resize(x.len(), 0);
    pool::parallel_if(x.len() > ROUND_PAR_VALUES && pool::threads() > 1).for_chunks(
        out,
        ROUND_PAR_VALUES,
        |i, o| {
            let at = i * ROUND_PAR_VALUES;
            round_bf16_slice(&x[at..at + o.len()], o);
        },
    );
}

impl Kernels {
    /// Quantizes `x` (`n × cols`, row-major) into `a` with this tier's activation
    /// quantizer, then derives what the kernels read beside the quants.
    ///
    /// Panics if `cols` is not a positive multiple of 32 or does not divide `x.len()`.
    pub fn quantize_acts(&self, x: &[f32], cols: usize, a: &mut QActs) {
        self.quantize_acts_in(x, cols, &[], a)
    }

    /// [`Kernels::quantize_acts`] of rows cut into segments at `bounds` (ascending
    /// from 0 to n; empty: one segment): the packed kernels' tiles run from each
    /// segment's start ([`QActs::segment`]), so that a segment (one expert's rows of a
    /// grouped step) is multiplied as if quantized alone. The quants are the same.
    ///
    /// Panics as [`Kernels::quantize_acts`], or if `bounds` does not ascend from 0 to n.
    pub fn quantize_acts_in(&self, x: &[f32], cols: usize, bounds: &[usize], a: &mut QActs) {
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
        let n = x.len() / cols;
        let (q, d) = a.shape(n, cols, bounds);
        // A prompt chunk (e.g. 512 × 1536 values) is quantized by the pool, whole tokens
        // per task: blocks are independent, so the bits are the same.
        let per = (QUANT_PAR_VALUES / cols).max(1);
        if n > per && pool::threads() > 1 {
            let (xs, qs, ds) = (per * cols, per * cols, per * cols / QK);
            pool::for_chunks2(q, qs, d, ds, |i, q, d| {
                self.quantize_act(&x[i * xs..i * xs + q.len()], q, d);
            });
        } else {
            self.quantize_act(x, q, d);
        }
        a.derive();
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

    /// `ys[i] = ws[i]·x` for matrices that share their input (q/k/v, gate/up): one
    /// parallel step for all of them, so a decode step waits at one barrier instead of
    /// several. Same results as separate [`Kernels::matmul`]s.
    ///
    /// Panics if a matrix is of a 2-byte float type, or as [`Kernels::matmul`].
    pub fn matmul_each(&self, ws: &[&WeightMat], x: &QActs, ys: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), ys.len(), "matrices vs outputs");
        let tiles: Vec<Vec<ActTile>> = ws.iter().map(|w| self.q8_tiles(w, x, 0, x.n())).collect();
        let plans: Vec<Plan> = ws
            .iter()
            .zip(ys.iter_mut())
            .zip(&tiles)
            .map(|((w, y), t)| self.q8_plan(w, x.cols(), t, x.n(), y))
            .collect();
        run_plans(&plans);
    }

    /// The tiles of segment `seg` (`n` tokens) of `x` that `w` takes: of
    /// [`PACKED_TILE`] tokens for a packed or decoded kernel, else of [`TILE_TOKENS`].
    fn q8_tiles<'x>(&self, w: &WeightMat, x: &'x QActs, seg: usize, n: usize) -> Vec<ActTile<'x>> {
        let packed = w.packed.is_some() && self.packed_fn(w.mat.wtype).is_some();
        let size = if packed || self.decoded_for(w, n).is_some() {
            PACKED_TILE
        } else {
            TILE_TOKENS
        };
        x.segment_tiles(seg, size)
    }

    /// The decoded path for `w` times `n` tokens: a codebook matrix and more than one
    /// token (one token reads each row once, from the map).
    fn decoded_for(&self, w: &WeightMat, n: usize) -> Option<DecodedKernels> {
        (n > 1).then(|| self.decoded_fn(w.mat.wtype)).flatten()
    }

    /// The plan of quantized `w` times the `n` tokens of `tiles` (from
    /// [`Kernels::q8_tiles`]) into `y`.
    fn q8_plan<'a>(
        &self,
        w: &WeightMat<'a>,
        cols: usize,
        tiles: &'a [ActTile<'a>],
        n: usize,
        y: &mut [f32],
    ) -> Plan<'a> {
        if let (Some(p), Some(f)) = (w.packed, self.packed_fn(w.mat.wtype)) {
            return Plan::Packed(PackedPlan::new(f, p, cols, tiles, n, y));
        }
        let m = &w.mat;
        if let Some(k) = self.decoded_for(w, n) {
            return Plan::Decoded(DecodedPlan::new(k, *m, cols, tiles, n, y));
        }
        let tile = self.mats[m.wtype as usize]
            .unwrap_or_else(|| panic!("no {} kernel on tier {}", m.wtype, self.tier()))
            .tile;
        Plan::Rows(RowPlan::new(tile, self.f16, *m, cols, tiles, n, y))
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
        self.matmul_each(&[w], x, &mut [y]);
    }

    /// What a matrix of type `t` takes from an f32 input under these kernels.
    fn takes(&self, t: WType) -> Takes {
        match t {
            WType::BF16 if self.half_acts() == HalfActs::Bf16 => Takes::Bf16,
            t if t.is_half() => Takes::F32,
            _ => Takes::Q8,
        }
    }

    /// The plan of `w` (a 2-byte float matrix) on the f32 input `x`, or on its BF16
    /// rounding `xb` when `w` takes that.
    fn half_plan<'a>(
        &self,
        w: &'a WeightMat,
        x: &'a [f32],
        xb: &'a [u16],
        y: &mut [f32],
    ) -> Plan<'a> {
        let w = &w.mat;
        let input = match self.takes(w.wtype) {
            Takes::Bf16 => Input::Bf16(self.half.bf16_dot, xb),
            Takes::F32 => Input::F32(self.half_fn(w.wtype).expect("a 2-byte float type"), x),
            Takes::Q8 => panic!("matmul_f32 takes BF16 / F16 weights, not {}", w.wtype),
        };
        Plan::Half(HalfPlan::new(w, input, y))
    }

    /// `y[t·rows + r] = W[r]·x[t]` for BF16 / F16 weights `w` and the f32 activations
    /// `x` (`n × cols`, token-major), by the contract of docs/kernels.md ("2-byte float
    /// weights"; BF16 weights under [`HalfActs::Bf16`]: "BF16 activations", `x` rounded
    /// first): the same bits on every tier and at every thread count.
    ///
    /// Panics if `w` is not BF16 / F16, or the shapes disagree.
    pub fn matmul_f32(&self, w: &WeightMat, x: &[f32], y: &mut [f32]) {
        self.matmul_f32_each(&[w], x, &mut [y]);
    }

    /// `ys[i] = ws[i]·x` for 2-byte float matrices that share their input, as one pool
    /// step (one barrier for q/k/v in decode). Same bits as separate
    /// [`Kernels::matmul_f32`]s.
    pub fn matmul_f32_each(&self, ws: &[&WeightMat], x: &[f32], ys: &mut [&mut [f32]]) {
        let mut xb = Vec::new();
        self.half_each(ws, x, &mut xb, ys);
    }

    /// `y[t·rows + r] = W[r]·x[t]` for BF16 weights and activations already rounded to
    /// BF16 (`x`: their bits, `n × cols`), by the BF16-activation contract whatever
    /// [`Kernels::half_acts`] says.
    ///
    /// Panics if `w` is not BF16, or the shapes disagree.
    pub fn matmul_bf16(&self, w: &WeightMat, x: &[u16], y: &mut [f32]) {
        assert_eq!(w.mat.wtype, WType::BF16, "matmul_bf16 takes BF16 weights");
        let input = Input::Bf16(self.half.bf16_dot, x);
        run_plans(&[Plan::Half(HalfPlan::new(&w.mat, input, y))]);
    }

    /// [`Kernels::matmul_f32_each`] with `xb` as the buffer of the BF16 rounding (made
    /// only when a matrix takes it).
    fn half_each(&self, ws: &[&WeightMat], x: &[f32], xb: &mut Vec<u16>, ys: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), ys.len(), "matrices vs outputs");
        if ws.iter().any(|w| self.takes(w.mat.wtype) == Takes::Bf16) {
            round_into(x, xb);
        }
        let plans: Vec<Plan> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| self.half_plan(w, x, xb, y))
            .collect();
        run_plans(&plans);
    }

    /// `y = W·x` for the f32 input `x` (`n × w.cols`) whatever W's type: 2-byte float
    /// weights take `x` as it is, or rounded to BF16 ([`Kernels::matmul_f32`]); the
    /// others take it quantized to Q8_0 into `qa` ([`Kernels::matmul`]).
    pub fn project(&self, w: &WeightMat, x: &[f32], qa: &mut QActs, y: &mut [f32]) {
        self.project_each(&[w], x, qa, &mut [y]);
    }

    /// [`Kernels::project`] for matrices that share their input (q/k/v, gate/up, the
    /// delta rule's four): `x` is quantized once when any of them takes Q8_0
    /// activations and not at all when none does (rounded to BF16 likewise); all of
    /// them run as one step ([`Kernels::project_groups`]).
    pub fn project_each(
        &self,
        ws: &[&WeightMat],
        x: &[f32],
        qa: &mut QActs,
        ys: &mut [&mut [f32]],
    ) {
        assert_eq!(ws.len(), ys.len(), "matrices vs outputs");
        let Some(first) = ws.first() else {
            return;
        };
        let mut inputs = [GroupInput {
            x,
            cols: first.mat.cols,
            bounds: &[],
            qa,
        }];
        let mut prods: Vec<GroupProduct> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| GroupProduct {
                w,
                input: 0,
                seg: 0,
                y,
            })
            .collect();
        self.project_groups(&mut inputs, &mut prods);
    }

    /// Products of several matrices and several inputs as one pool step (a mixture of
    /// experts: each chosen expert's gate and up on its tokens, then each one's down on
    /// its own hidden rows): product `p` multiplies `p.w` by segment `p.seg` of input
    /// `p.input`. Each input is quantized once into its [`QActs`], by segments, when a
    /// matrix takes Q8_0 activations ([`Kernels::quantize_acts_in`]: rounded to BF16
    /// likewise); every output gets the bits of [`Kernels::project`] on its rows alone.
    ///
    /// Panics if a product names a missing input or segment, or the shapes disagree.
    pub fn project_groups(&self, inputs: &mut [GroupInput], prods: &mut [GroupProduct]) {
        let mut takes = vec![(false, false); inputs.len()];
        for p in prods.iter() {
            match self.takes(p.w.mat.wtype) {
                Takes::Q8 => takes[p.input].0 = true,
                Takes::Bf16 => takes[p.input].1 = true,
                Takes::F32 => {}
            }
        }
        for (x, &(q8, b16)) in inputs.iter_mut().zip(&takes) {
            if q8 {
                self.quantize_acts_in(x.x, x.cols, x.bounds, x.qa);
            }
            if b16 {
                round_into(x.x, x.qa.bf16_buf());
            }
        }
        let inputs = &*inputs;
        let tiles: Vec<Vec<ActTile>> = prods
            .iter()
            .map(|p| match self.takes(p.w.mat.wtype) {
                Takes::Q8 => {
                    let n = inputs[p.input].rows(p.seg).len();
                    self.q8_tiles(p.w, inputs[p.input].qa, p.seg, n)
                }
                _ => Vec::new(),
            })
            .collect();
        let plans: Vec<Plan> = prods
            .iter_mut()
            .zip(&tiles)
            .map(|(p, tiles)| {
                let x = &inputs[p.input];
                let r = x.rows(p.seg);
                match self.takes(p.w.mat.wtype) {
                    Takes::Q8 => self.q8_plan(p.w, x.cols, tiles, r.len(), p.y),
                    _ => {
                        let c = x.cols;
                        let xb = x.qa.b16_rows(r.start * c, r.end * c);
                        self.half_plan(p.w, &x.x[r.start * c..r.end * c], xb, p.y)
                    }
                }
            })
            .collect();
        run_plans(&plans);
    }
}

/// Quantizes `x` into `a` with the active tier (see [`Kernels::quantize_acts`]).
pub fn quantize_acts(x: &[f32], cols: usize, a: &mut QActs) {
    kernels().quantize_acts(x, cols, a)
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
}
