//! Kernel throughput per tier: `cargo bench --bench kernels [-- FILTER]`.
//!
//! Prints a markdown table: matvec (one token) and matmul (`KRAFLA_BENCH_N` tokens,
//! default 32) time per call, GFLOP/s (2·rows·cols·n) and GB/s of weight bytes (q + d)
//! per call, for each supported tier at 1 and 2 threads. The weights stay in cache
//! between calls when they fit (L2 is 2 MB per core here), so small shapes show cache
//! bandwidth, the 49152×576 classifier shows L3/DRAM bandwidth, Gemma 3's 262144×640
//! (168 MB at Q8_0) mostly DRAM bandwidth. BF16 and F16 rows: f32 activations
//! (`Kernels::matmul_f32`), GB/s of the 2-byte weights, on every shape and on Llama
//! 3.2 1B's FFN shapes (8192×2048, 2048×8192: 32 MB each as BF16, DRAM-bound); BF16
//! also with BF16 activations (`HalfActs::Bf16`, `--bf16-activations`: tier "… bf16-acts").
//! The GGUF block types (Q4_K, Q5_K, Q6_K, IQ4_NL, beside Q4_0 of the same shape), random
//! levels and finite scales, packed and row-major: on Llama 3.2 1B's FFN shapes.

use std::hint::black_box;
use std::time::{Duration, Instant};

use krafla::kernels::pool::Pool;
use krafla::kernels::{self, HalfActs, Kernels, PackedMat, QActs, QMat, WType, WeightMat};
use krafla::quant::QK;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Seconds per call: the fastest of repeated batches (~0.2 ms each) over at least `min`,
/// after one warm-up call. The minimum filters out time slices lost to other processes
/// on a shared machine.
fn time(min: Duration, mut f: impl FnMut()) -> f64 {
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().as_secs_f64();
    let per_batch = ((2e-4 / once.max(1e-9)) as u32).clamp(1, 1000);
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut batches = 0;
    while start.elapsed() < min || batches < 3 {
        let t = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / per_batch as f64);
        batches += 1;
    }
    best
}

/// What every row of the table shares: the name filter, the least time per measurement,
/// the batch size and the pools of 1 and 2 threads.
struct Bench {
    filter: Vec<String>,
    min: Duration,
    n_batch: usize,
    pools: [(usize, &'static Pool); 2],
}

impl Bench {
    /// Whether the filter leaves out the row labelled `label`.
    fn skips(&self, label: &str) -> bool {
        !self.filter.is_empty() && !self.filter.iter().any(|f| label.contains(f.as_str()))
    }

    /// Unless the filter leaves it out, times `decode` (one token) and `batch`
    /// (`n_batch` tokens) of a `wtype` matrix of `shape` on `tier` at 1 and 2 threads
    /// and prints a row each (`bytes` of weights read per product).
    fn rows(
        &self,
        (name, rows, cols): (&str, usize, usize),
        wtype: WType,
        tier: &str,
        bytes: f64,
        mut decode: impl FnMut(),
        mut batch: impl FnMut(),
    ) {
        if self.skips(&format!("{name} {rows}x{cols} {wtype:?} {tier}")) {
            return;
        }
        for (threads, pool) in self.pools {
            let tv = pool.install(|| time(self.min, &mut decode));
            let tm = pool.install(|| time(self.min, &mut batch));
            let at = format!("{name} {rows}×{cols} | {wtype:?} | {tier} | {threads}");
            print_row(&at, rows * cols, bytes, self.n_batch, tv, tm);
        }
    }
}

/// The environment variable `name` parsed, or `default` when unset or unparsable.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let n_batch: usize = env_or("KRAFLA_BENCH_N", 32);
    let shapes = [
        ("smollm2 qkv/o", 576, 576),
        ("smollm2 up/gate", 1536, 576),
        ("smollm2 down", 576, 1536),
        ("gemma3 attn", 640, 640),
        ("gemma3 up", 2048, 640),
        ("classifier", 49152, 576),
        ("gemma3 classifier", 262144, 640),
        ("llama1b up", 8192, 2048),
        ("llama1b down", 2048, 8192),
    ];
    let min = Duration::from_millis(env_or("KRAFLA_BENCH_MS", 150));
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    let b = Bench {
        filter,
        min,
        n_batch,
        pools: [(1, Pool::leak(1)), (2, Pool::leak(2))],
    };
    println!("| shape | type | tier | threads | matvec µs | matvec GFLOP/s | matvec GB/s | matmul n={n_batch} ms | matmul GFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, rows, cols) in shapes {
        // Llama 1B's shapes for the 2-byte float types only.
        let quantized = if name.starts_with("llama1b") {
            &[][..]
        } else {
            &[WType::Q8_0, WType::Q4_0][..]
        };
        for &wtype in quantized {
            let q: Vec<u8> = (0..rows * wtype.row_bytes(cols))
                .map(|_| rng.next() as u8 & 0x7F)
                .collect();
            let d: Vec<f32> = (0..rows * cols / QK).map(|_| rng.unit() * 0.01).collect();
            let w = QMat::new(wtype, rows, cols, &q, &d).expect("shape");
            let bytes = (q.len() + 4 * d.len()) as f64;
            quant_rows(&b, &mut rng, name, &w, bytes);
        }
        half_rows(&b, &mut rng, (name, rows, cols));
        if name.starts_with("llama1b") {
            block_rows(&b, &mut rng, (name, rows, cols));
        }
    }
}

/// The tiers' product functions on `w` and its packed form, labelled.
fn variants<'w>(
    w: &'w WeightMat<'w>,
    wp: &'w WeightMat<'w>,
) -> Vec<(Kernels, String, &'w WeightMat<'w>)> {
    let mut v = Vec::new();
    for t in kernels::supported_tiers() {
        let k = Kernels::for_tier(t).expect("supported");
        v.push((k, t.to_string(), w));
        if k.packs() {
            v.push((k, format!("{t}+packed"), wp));
        }
    }
    v
}

/// Block-type rows of one shape: random level bytes, every f16 scale field finite.
fn block_rows(b: &Bench, rng: &mut Rng, (name, rows, cols): (&str, usize, usize)) {
    for wtype in [
        WType::Q4_0,
        WType::Q4_K,
        WType::Q5_K,
        WType::Q6_K,
        WType::IQ4_NL,
    ] {
        let mut q: Vec<u8> = (0..rows * wtype.row_bytes(cols))
            .map(|_| rng.next() as u8)
            .collect();
        // Offsets of each block's f16 fields: d, and dmin for the types with a minimum.
        let fields: &[usize] = match wtype {
            WType::Q4_0 => &[],
            WType::Q4_K | WType::Q5_K => &[0, 2],
            WType::Q6_K => &[208],
            _ => &[0],
        };
        for blk in q.chunks_exact_mut(wtype.block_bytes()) {
            for &at in fields {
                let v = half::f16::from_f32(rng.unit() * 0.05);
                blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        // Q4_0's scales are an array beside the levels, as the runtime holds them.
        let d: Vec<f32> = (0..rows * cols / QK).map(|_| rng.unit() * 0.01).collect();
        let w = if wtype == WType::Q4_0 {
            QMat::new(wtype, rows, cols, &q, &d)
        } else {
            QMat::new_blocks(wtype, rows, cols, &q)
        }
        .expect("shape");
        quant_rows(b, rng, name, &w, q.len() as f64);
    }
}

/// The rows of one quantized matrix `w` (`bytes` of weights read per product): random
/// activations of one token and of `n_batch`, `matvec` and `matmul` on every tier and
/// its packed form.
fn quant_rows(b: &Bench, rng: &mut Rng, name: &str, w: &QMat<'_>, bytes: f64) {
    let (wtype, rows, cols, n_batch) = (w.wtype, w.rows, w.cols, b.n_batch);
    let x1: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
    let xn: Vec<f32> = (0..cols * n_batch).map(|_| rng.unit()).collect();
    let (mut a1, mut an) = (QActs::new(), QActs::new());
    kernels::quantize_acts(&x1, cols, &mut a1);
    kernels::quantize_acts(&xn, cols, &mut an);
    let (mut y1, mut yn) = (vec![0f32; rows], vec![0f32; rows * n_batch]);
    let packed = PackedMat::new(w).expect("memory for the packed copy");
    let w = WeightMat::from(*w);
    let wp = w.with_packed(&packed).expect("packed");
    for (k, tier, w) in variants(&w, &wp) {
        b.rows(
            (name, rows, cols),
            wtype,
            &tier,
            bytes,
            || k.matvec(w, &a1, black_box(&mut y1)),
            || k.matmul(w, &an, black_box(&mut yn)),
        );
    }
}

/// One table row: `at` (shape, type, tier, threads), then the decode product's time
/// (`tv` s, one token), GFLOP/s and GB/s of weights read, and the batch product's time
/// (`tm` s, `n_batch` tokens) and GFLOP/s, for `weights` multiply-adds per token.
fn print_row(at: &str, weights: usize, bytes: f64, n_batch: usize, tv: f64, tm: f64) {
    let flop = 2.0 * weights as f64;
    println!(
        "| {at} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} |",
        tv * 1e6,
        flop / tv * 1e-9,
        bytes / tv * 1e-9,
        tm * 1e3,
        flop * n_batch as f64 / tm * 1e-9
    );
}

/// BF16 / F16 rows of one shape: `matmul_f32` with one token and with `n_batch`.
fn half_rows(b: &Bench, rng: &mut Rng, (name, rows, cols): (&str, usize, usize)) {
    let n_batch = b.n_batch;
    for wtype in [WType::BF16, WType::F16] {
        let q: Vec<u8> = (0..rows * cols)
            .flat_map(|_| krafla::format::half_float::round(wtype, rng.unit() * 0.05).to_le_bytes())
            .collect();
        let w = WeightMat::from(QMat::new_half(wtype, rows, cols, &q).expect("shape"));
        let bytes = q.len() as f64;
        let x1: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
        let xn: Vec<f32> = (0..cols * n_batch).map(|_| rng.unit()).collect();
        let mut y1 = vec![0f32; rows];
        let mut yn = vec![0f32; rows * n_batch];
        for t in kernels::supported_tiers() {
            let k = Kernels::for_tier(t).expect("supported");
            b.rows(
                (name, rows, cols),
                wtype,
                &t.to_string(),
                bytes,
                || k.matmul_f32(&w, &x1, black_box(&mut y1)),
                || k.matmul_f32(&w, &xn, black_box(&mut yn)),
            );
            if wtype == WType::BF16 {
                // `--bf16-activations`: the runtime's path, the activations rounded to
                // BF16 and `vdpbf16ps` (or its emulation).
                let kb = k.with_half_acts(HalfActs::Bf16);
                b.rows(
                    (name, rows, cols),
                    wtype,
                    &format!("{t} bf16-acts"),
                    bytes,
                    || kb.matmul_f32(&w, &x1, black_box(&mut y1)),
                    || kb.matmul_f32(&w, &xn, black_box(&mut yn)),
                );
            }
        }
    }
}
