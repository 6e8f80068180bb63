//! Time and error of the IQ codebook quantizers (`quant::codebook_fit`) on one Gaussian
//! matrix: `cargo bench --bench iq_fit [-- ROWS COLS [TYPE ...]]` (default 256 × 8192,
//! every codebook type).
//!
//! Per type and thread count (1, 2): seconds to quantize the matrix (rayon pool of that
//! size, no imatrix) and the relative RMS error `sqrt(Σ(x − x̂)² / Σx²)`, which must not
//! depend on the thread count (the bytes are a pure function of each row).

use std::time::Instant;

use krafla::quant::blocks::{dequantize_matrix, quantize_matrix};
use krafla::quant::WType;
use krafla::rng::{rel_rms, Rng};

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let num = |i: usize, d: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (rows, cols) = (num(0, 256), num(1, 8192));
    let types: Vec<WType> = match args.get(2..) {
        Some(names) if !names.is_empty() => names
            .iter()
            .map(|n| {
                *WType::CODEBOOKS
                    .iter()
                    .find(|t| t.name().eq_ignore_ascii_case(n))
                    .expect("a codebook type name")
            })
            .collect(),
        _ => WType::CODEBOOKS.to_vec(),
    };
    let x = Rng(0x3c6ef372fe94f82b).gaussian(rows * cols);
    println!("{rows} × {cols} Gaussian, no imatrix");
    println!("| type | threads | seconds | rel. RMS |");
    println!("|---|---|---|---|");
    for t in types {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            let start = Instant::now();
            let q = pool
                .install(|| quantize_matrix(t, rows, cols, &x, None))
                .expect("finite scales");
            let secs = start.elapsed().as_secs_f64();
            let e = rel_rms(&x, &dequantize_matrix(t, rows, cols, &q));
            println!("| {t} | {threads} | {secs:.2} | {e:.4} |");
        }
    }
}
