//! f32 activations × BF16 / F16 weights through the kernel table: each tier's entries
//! ([`HalfKernels`]: the scalar reference [`super::scalar_half`], AVX2 + FMA + F16C,
//! AVX-512 F in `x86::half`), their scheduling over the pool, and the calls the forward
//! pass makes for any matrix input ([`Kernels::project`]): f32 rows for 2-byte float
//! weights, Q8_0 activations (quantized once per input) for every other type.
//!
//! The arithmetic is the contract of `docs/kernels.md` ("2-byte float weights"): per
//! output, 16 lanes of fused multiply-adds in column order (lane `c % 16`), lanes `i`
//! and `i + 8` added, then the quantized kernels' 8-lane tree. Every (row, token)
//! output is its own chain, so a kernel may tile rows and tokens freely; every tier and
//! every thread count gives the bits of [`super::scalar_half::dot_half`].
//!
//! Prefill: a task's rows are taken in sub-blocks of [`SUB_ROWS`] (their weights stay
//! in L2) and run against tiles of [`HALF_TILE`] tokens; inside a call the kernels widen
//! each 16 weights once for a micro-tile of tokens (AVX-512: 4 rows × 6 tokens, AVX2:
//! 2 × 3). Decode (one token): a task's rows in one call, the weights streamed with a
//! software prefetch ahead of the rows in flight, as the packed quantized kernels do.

use super::{pool, rows_per_task, Kernels, QActs, QMat, ShapeError, SharedOut, WType, SUB_ROWS};
use crate::quant::QK;

/// `y[t·ld + r]` = weight row `r` · activation token `t`, for the `rows` rows of `w`
/// (`rows × cols` 2-byte floats, little-endian bytes) and the `x.len() / cols` tokens
/// of `x`.
pub(crate) type HalfFn =
    unsafe fn(rows: usize, cols: usize, w: &[u8], x: &[f32], y: *mut f32, ld: usize);

/// A tier's kernels for the 2-byte float types. They take f32 activations, not
/// [`QActs`], so they sit beside the quantized types' `MatKernels` rather than in them.
#[derive(Clone, Copy)]
pub(crate) struct HalfKernels {
    pub bf16: HalfFn,
    pub f16: HalfFn,
}

/// The scalar reference's entries.
pub(crate) const SCALAR: HalfKernels = HalfKernels {
    bf16: super::scalar_half::tile_bf16,
    f16: super::scalar_half::tile_f16,
};

/// Tokens per kernel call in prefill: the activations of a tile (24 × 2048 f32 =
/// 192 KiB at most for these models) and a sub-block of weight rows stay in L2.
pub const HALF_TILE: usize = 24;

impl HalfKernels {
    fn get(&self, t: WType) -> Option<HalfFn> {
        match t {
            WType::BF16 => Some(self.bf16),
            WType::F16 => Some(self.f16),
            _ => None,
        }
    }
}

impl<'a> QMat<'a> {
    /// A BF16 / F16 matrix: `w` holds `rows × cols` 2-byte floats, row-major,
    /// little-endian; `cols` a positive multiple of 32 as in a file.
    pub fn new_half(
        wtype: WType,
        rows: usize,
        cols: usize,
        w: &'a [u8],
    ) -> Result<Self, ShapeError> {
        if !wtype.is_half() {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype}: not a 2-byte float type"
            )));
        }
        if rows == 0 || cols == 0 || !cols.is_multiple_of(QK) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols}: rows and cols must be > 0 and cols a multiple of {QK}"
            )));
        }
        let len = rows.checked_mul(cols).and_then(|v| v.checked_mul(2));
        if len != Some(w.len()) {
            return Err(ShapeError(format!(
                "matrix {rows}x{cols} {wtype}: {} bytes, expected {len:?}",
                w.len()
            )));
        }
        Ok(QMat {
            wtype,
            rows,
            cols,
            q: w,
            d: &[],
            d16: &[],
            pk: None,
        })
    }
}

/// One product of 2-byte float weights cut into pool tasks (run by [`run_plans`]).
struct Plan<'a> {
    f: HalfFn,
    w: &'a [u8],
    rows: usize,
    cols: usize,
    x: &'a [f32],
    n: usize,
    /// Rows per task.
    chunk: usize,
    tasks: usize,
    out: SharedOut,
}

impl<'a> Plan<'a> {
    /// Checks the shapes (panics on a mismatch, like [`Kernels::matmul`]).
    fn new(k: &Kernels, w: &'a QMat, x: &'a [f32], y: &mut [f32]) -> Self {
        let f = k
            .half_fn(w.wtype)
            .unwrap_or_else(|| panic!("matmul_f32 takes BF16 / F16 weights, not {}", w.wtype));
        let (rows, cols) = (w.rows, w.cols);
        assert_eq!(x.len() % cols, 0, "activations vs matrix cols");
        let n = x.len() / cols;
        assert_eq!(y.len(), n * rows, "y length vs n x rows");
        assert_eq!(w.q.len(), rows * cols * 2, "weights vs rows x cols");
        let chunk = rows_per_task(rows, cols * n);
        Plan {
            f,
            w: w.q,
            rows,
            cols,
            x,
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
                (self.f)(
                    r1 - r0,
                    cols,
                    &self.w[r0 * rb..r1 * rb],
                    self.x,
                    self.out.at(r0),
                    rows,
                )
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
                    (self.f)(
                        s1 - s0,
                        cols,
                        &self.w[s0 * rb..s1 * rb],
                        &self.x[t0 * cols..t1 * cols],
                        self.out.at(t0 * rows + s0),
                        rows,
                    )
                };
            }
        }
    }
}

/// Products of 2-byte float matrices as one pool step: every plan's tasks in one list.
fn run_plans(plans: &[Plan]) {
    let total: usize = plans.iter().map(|p| p.tasks).sum();
    pool::run(total, |mut i| {
        for p in plans {
            if i < p.tasks {
                return p.run(i);
            }
            i -= p.tasks;
        }
    });
}

/// Whether matrices of type `t` take Q8_0 activations (every type but BF16 / F16).
fn takes_q8(t: WType) -> bool {
    !t.is_half()
}

impl Kernels {
    /// The tier's kernel for 2-byte float weights of type `t`; `None` for other types.
    pub(crate) fn half_fn(&self, t: WType) -> Option<HalfFn> {
        self.half.get(t)
    }

    /// `y[t·rows + r] = W[r]·x[t]` for BF16 / F16 weights `w` and the f32 activations
    /// `x` (`n × cols`, token-major), by the contract of docs/kernels.md ("2-byte float
    /// weights"): the same bits on every tier and at every thread count.
    ///
    /// Panics if `w` is not BF16 / F16, or the shapes disagree.
    pub fn matmul_f32(&self, w: &QMat, x: &[f32], y: &mut [f32]) {
        run_plans(&[Plan::new(self, w, x, y)]);
    }

    /// `ys[i] = ws[i]·x` for 2-byte float matrices that share their input, as one pool
    /// step (one barrier for q/k/v in decode). Same bits as separate
    /// [`Kernels::matmul_f32`]s.
    pub fn matmul_f32_each(&self, ws: &[&QMat], x: &[f32], ys: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), ys.len(), "matrices vs outputs");
        let plans: Vec<Plan> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| Plan::new(self, w, x, y))
            .collect();
        run_plans(&plans);
    }

    /// `y = W·x` for the f32 input `x` (`n × w.cols`) whatever W's type: 2-byte float
    /// weights take `x` as it is ([`Kernels::matmul_f32`]); the others take it
    /// quantized to Q8_0 into `qa` ([`Kernels::matmul`]).
    pub fn project(&self, w: &QMat, x: &[f32], qa: &mut QActs, y: &mut [f32]) {
        if takes_q8(w.wtype) {
            qa.quantize_with(self, x, w.cols);
            self.matmul(w, qa, y);
        } else {
            self.matmul_f32(w, x, y);
        }
    }

    /// [`Kernels::project`] for matrices that share their input (q/k/v, gate/up, the
    /// delta rule's four): `x` is quantized once when any of them takes Q8_0
    /// activations and not at all when none does; the quantized ones run as one step
    /// ([`Kernels::matmul_each`]), the 2-byte float ones as another.
    pub fn project_each(&self, ws: &[&QMat], x: &[f32], qa: &mut QActs, ys: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), ys.len(), "matrices vs outputs");
        let Some(first) = ws.first() else {
            return;
        };
        let q8 = ws.iter().filter(|w| takes_q8(w.wtype)).count();
        if q8 == ws.len() {
            qa.quantize_with(self, x, first.cols);
            return self.matmul_each(ws, qa, ys);
        }
        if q8 == 0 {
            return self.matmul_f32_each(ws, x, ys);
        }
        // A mixed file: each kind in its own step.
        let (mut qw, mut qy, mut hw, mut hy) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            if takes_q8(w.wtype) {
                qw.push(*w);
                qy.push(&mut **y);
            } else {
                hw.push(*w);
                hy.push(&mut **y);
            }
        }
        qa.quantize_with(self, x, first.cols);
        self.matmul_each(&qw, qa, &mut qy);
        self.matmul_f32_each(&hw, x, &mut hy);
    }
}
