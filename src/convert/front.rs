//! The front door: [`convert`] starts the thread pool, then reads a GGUF file or a
//! Hugging Face checkpoint folder.

use super::error::{ConvertError, Result};
use super::gguf;
use super::hf;
use super::options::ConvertOptions;
use super::pipeline::stream::Progress;
use super::summary::Summary;

/// Converts a checkpoint folder; `progress` is called as the conversion advances.
pub fn convert(
    opts: &ConvertOptions,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary> {
    match opts.threads {
        Some(0) => return Err(ConvertError::options("--threads", "must be at least 1")),
        Some(n) if n > crate::kernels::pool::MAX_THREADS => {
            let max = crate::kernels::pool::MAX_THREADS;
            return Err(ConvertError::options(
                "--threads",
                format!("at most {max} (got {n})"),
            ));
        }
        _ => {}
    }
    let (pool, note) = thread_pool(opts.threads);
    let pool = pool?;
    pool.install(|| run_any(opts, note, progress))
}

/// The rayon pool of `threads` threads (`None`: rayon's default). Where threads cannot
/// be started (a process limit in a container), the conversion runs on the calling
/// thread alone, with a note saying so: the output does not depend on the thread
/// count, and rayon's global pool would panic instead.
fn thread_pool(threads: Option<usize>) -> (Result<rayon::ThreadPool>, Option<String>) {
    let want = threads.unwrap_or(0);
    let e = match rayon::ThreadPoolBuilder::new().num_threads(want).build() {
        Ok(p) => return (Ok(p), None),
        Err(e) => e,
    };
    let n = match want {
        0 => "worker".to_string(),
        n => n.to_string(),
    };
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build()
        .map_err(|e1| {
            ConvertError::options("--threads", format!("cannot start threads: {e}; {e1}"))
        });
    let note = format!("could not start {n} threads ({e}): converting on one thread");
    (one, Some(note))
}

/// A GGUF file or a checkpoint folder.
fn run_any(
    opts: &ConvertOptions,
    thread_note: Option<String>,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Summary> {
    if gguf::file::is_gguf_file(&opts.input) {
        return gguf::import::run(opts, progress);
    }
    if opts.requantize.is_some() {
        return Err(ConvertError::options(
            "--requantize",
            "applies to GGUF input only",
        ));
    }
    hf::import::run(opts, thread_note, progress)
}
