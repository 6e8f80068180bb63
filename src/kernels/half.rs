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
//! BF16 weights can instead take activations rounded to BF16 ([`HalfActs::Bf16`], opt-in:
//! the contract of `docs/kernels.md`, "BF16 activations", which is `vdpbf16ps`): the
//! input is rounded once per projection ([`super::scalar_bf16dot::round_bf16`]) and the
//! tier's [`DotFn`] runs it; the reference [`super::scalar_bf16dot`] gives its bits.
//!
//! Prefill: a task's rows are taken in sub-blocks of [`SUB_ROWS`] (their weights stay
//! in L2) and run against tiles of [`HALF_TILE`] tokens; inside a call the kernels widen
//! each 16 weights once for a micro-tile of tokens (AVX-512: 4 rows × 6 tokens, AVX2:
//! 2 × 3). Decode (one token): a task's rows in one call, the weights streamed with a
//! software prefetch ahead of the rows in flight, as the packed quantized kernels do.

use std::fmt;
use std::str::FromStr;

use super::scalar_bf16dot::round_bf16_slice;
use super::{pool, rows_per_task, Kernels, QActs, QMat, SharedOut, WType, WeightMat, SUB_ROWS};

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

/// `y[t·ld + r]` = weight row `r` · activation token `t`, for the `rows` rows of `w`
/// (`rows × cols` 2-byte floats, little-endian bytes) and the `x.len() / cols` tokens
/// of `x`.
pub(crate) type HalfFn =
    unsafe fn(rows: usize, cols: usize, w: &[u8], x: &[f32], y: *mut f32, ld: usize);

/// `y[t·ld + r]` = BF16 weight row `r` · token `t` of `x` (BF16 bits, `cols` per token)
/// by the BF16-activation contract; otherwise as [`HalfFn`].
pub(crate) type DotFn =
    unsafe fn(rows: usize, cols: usize, w: &[u8], x: &[u16], y: *mut f32, ld: usize);

/// A tier's kernels for the 2-byte float types. They take f32 (or BF16) activations,
/// not [`QActs`]' quants, so they sit beside the quantized types' `MatKernels`.
#[derive(Clone, Copy)]
pub(crate) struct HalfKernels {
    pub bf16: HalfFn,
    pub f16: HalfFn,
    /// BF16 weights × BF16 activations ([`HalfActs::Bf16`]).
    pub bf16_dot: DotFn,
}

/// The scalar reference's entries.
pub(crate) const SCALAR: HalfKernels = HalfKernels {
    bf16: super::scalar_half::tile_bf16,
    f16: super::scalar_half::tile_f16,
    bf16_dot: super::scalar_bf16dot::tile,
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

/// A kernel and the activations it takes.
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
    /// The kernel's contract ([`HalfFn`]) for `w`, those tokens, `y` and `ld`.
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

/// One product of 2-byte float weights cut into pool tasks (run by [`run_plans`]).
struct Plan<'a> {
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

impl<'a> Plan<'a> {
    /// Checks the shapes (panics on a mismatch, like [`Kernels::matmul`]).
    fn new(w: &'a QMat, x: Input<'a>, y: &mut [f32]) -> Self {
        let (rows, cols) = (w.rows, w.cols);
        assert_eq!(x.len() % cols, 0, "activations vs matrix cols");
        let n = x.len() / cols;
        assert_eq!(y.len(), n * rows, "y length vs n x rows");
        assert_eq!(w.q.len(), rows * cols * 2, "weights vs rows x cols");
        let chunk = rows_per_task(rows, cols * n);
        Plan {
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

/// Values per pool task when rounding many tokens to BF16.
const ROUND_PAR_VALUES: usize = 65536;

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
    /// The tier's kernel for 2-byte float weights of type `t` and f32 activations;
    /// `None` for other types.
    pub(crate) fn half_fn(&self, t: WType) -> Option<HalfFn> {
        self.half.get(t)
    }

    /// What BF16 weights multiply under these kernels (see [`Kernels::with_half_acts`]).
    pub fn half_acts(&self) -> HalfActs {
        self.half_acts
    }

    /// These kernels with BF16 weights multiplying `a` activations: [`HalfActs::F32`]
    /// (the default) or [`HalfActs::Bf16`] (docs/kernels.md, "BF16 activations").
    pub fn with_half_acts(self, a: HalfActs) -> Kernels {
        Kernels {
            half_acts: a,
            ..self
        }
    }

    fn takes(&self, t: WType) -> Takes {
        match t {
            WType::BF16 if self.half_acts == HalfActs::Bf16 => Takes::Bf16,
            t if t.is_half() => Takes::F32,
            _ => Takes::Q8,
        }
    }

    /// The plan of `w` (a 2-byte float matrix) on the f32 input `x`, or on its BF16
    /// rounding `xb` when `w` takes that.
    fn plan<'a>(&self, w: &'a WeightMat, x: &'a [f32], xb: &'a [u16], y: &mut [f32]) -> Plan<'a> {
        let w = &w.mat;
        let input = match self.takes(w.wtype) {
            Takes::Bf16 => Input::Bf16(self.half.bf16_dot, xb),
            Takes::F32 => Input::F32(self.half_fn(w.wtype).expect("a 2-byte float type"), x),
            Takes::Q8 => panic!("matmul_f32 takes BF16 / F16 weights, not {}", w.wtype),
        };
        Plan::new(w, input, y)
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
        run_plans(&[Plan::new(&w.mat, Input::Bf16(self.half.bf16_dot, x), y)]);
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
            .map(|(w, y)| self.plan(w, x, xb, y))
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
    /// activations and not at all when none does (rounded to BF16 likewise); the
    /// quantized ones run as one step ([`Kernels::matmul_each`]), the 2-byte float ones
    /// as another.
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
        let q8 = ws
            .iter()
            .filter(|w| self.takes(w.mat.wtype) == Takes::Q8)
            .count();
        if q8 == ws.len() {
            qa.quantize_with(self, x, first.mat.cols);
            return self.matmul_each(ws, qa, ys);
        }
        if q8 == 0 {
            return self.half_each(ws, x, &mut qa.b16, ys);
        }
        // A mixed file: each kind in its own step.
        let (mut qw, mut qy, mut hw, mut hy) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            if self.takes(w.mat.wtype) == Takes::Q8 {
                qw.push(*w);
                qy.push(&mut **y);
            } else {
                hw.push(*w);
                hy.push(&mut **y);
            }
        }
        qa.quantize_with(self, x, first.mat.cols);
        self.matmul_each(&qw, qa, &mut qy);
        self.half_each(&hw, x, &mut qa.b16, &mut hy);
    }
}
