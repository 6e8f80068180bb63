//! The quantizers' tests of thread-count independence: the bytes never depend on it.

/// `f`'s results in rayon pools of 1, 2 and 3 threads.
pub(crate) fn on_1_to_3_threads<T: Send>(f: impl Fn() -> T + Send + Sync) -> Vec<T> {
    (1..=3)
        .map(|n| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build();
            pool.unwrap().install(&f)
        })
        .collect()
}
