//! Memory read bandwidth: `cargo bench --bench membw [-- --threads N --mib M --reps R]`.
//!
//! Each of N threads (default 2) sums its own contiguous slice of one M MiB buffer
//! (default 2048 MiB, several times the 300 MiB L3 this VM reports), R times (default 7)
//! after a warm-up pass; every pass is timed from the first thread's start (after a barrier) to the last
//! thread's end, as each thread records them.
//! Prints the best and the median pass as GB/s (10^9 bytes/s) and, last, one line
//! `read_bandwidth_gbs=X` (the median) for scripts/bench.sh.
//!
//! This is the bound used for generation: a decode step reads every weight once, so
//! tokens/s cannot exceed bandwidth / weight bytes while the weights do not fit in cache.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::Instant;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} {v}: not a number"))
        })
        .unwrap_or(default)
}

/// Sum of the slice with 8 independent accumulators, so the loop is bound by loads,
/// not by one add chain.
fn sum(xs: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    let mut s = rest.iter().fold(0u64, |a, &x| a.wrapping_add(x));
    for a in acc {
        s = s.wrapping_add(a);
    }
    s
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads = arg(&args, "--threads", 2).max(1);
    let mib = arg(&args, "--mib", 2048).max(1);
    let reps = arg(&args, "--reps", 7).max(1);
    let n = mib * 1024 * 1024 / 8;
    // Touch every page (from its own thread, as the readers will) so no pass pays for
    // page faults.
    let mut buf = vec![0u64; n];
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for (t, part) in buf.chunks_mut(per).enumerate() {
            s.spawn(move || {
                for (i, x) in part.iter_mut().enumerate() {
                    *x = (t * per + i) as u64;
                }
            });
        }
    });
    let buf = Arc::new(buf);
    let bytes = (n * 8) as f64;
    let mut secs = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let start = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let buf = Arc::clone(&buf);
                let start = Arc::clone(&start);
                std::thread::spawn(move || {
                    let lo = (t * per).min(n);
                    let hi = ((t + 1) * per).min(n);
                    start.wait();
                    let t0 = Instant::now();
                    black_box(sum(black_box(&buf[lo..hi])));
                    (t0, Instant::now())
                })
            })
            .collect();
        let spans: Vec<(Instant, Instant)> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        // The pass: from the first thread's start to the last one's end.
        let t0 = spans.iter().map(|s| s.0).min().unwrap();
        let t1 = spans.iter().map(|s| s.1).max().unwrap();
        let dt = (t1 - t0).as_secs_f64();
        if rep > 0 {
            secs.push(dt);
        }
    }
    secs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let best = bytes / secs[0] / 1e9;
    let median = bytes / secs[secs.len() / 2] / 1e9;
    println!(
        "read bandwidth: {threads} threads, {mib} MiB buffer, {reps} passes: best {best:.1} GB/s, median {median:.1} GB/s"
    );
    println!("read_bandwidth_gbs={median:.2}");
}
