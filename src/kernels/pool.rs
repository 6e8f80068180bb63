//! The runtime's fork-join thread pool: `run(n, f)` calls `f(0..n)` on all threads and
//! returns when every call has finished.
//!
//! A decoded token is a few hundred short parallel steps (each matrix, each layer's
//! attention), microseconds apart. A general pool (rayon) puts its workers to sleep and
//! wakes them with a futex per step, which costs as much as a small step. Here the
//! workers spin on an atomic between steps, so a step starts within a cache-line
//! transfer, and sleep on a condition variable only after [`SPIN`] without work: an
//! idle runtime (waiting on stdin, between runs) uses no CPU.
//!
//! Each thread (the caller too) owns a contiguous run of the step's tasks and claims
//! them in order from its front, so the consecutive tasks of a matrix (consecutive
//! rows) stay on one thread and its prefetches run on into its own next task. A thread
//! whose run is empty takes the back half of the fullest other run, so uneven tasks
//! still balance themselves, in ever smaller pieces. Which thread computes a task never
//! changes what the task computes, so results do not depend on the thread count.
//!
//! `run` from inside a task, or while another thread is running a step, runs the
//! tasks on the calling thread (same results, no deadlock).

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a worker keeps spinning after its last task before it sleeps.
pub const SPIN: Duration = Duration::from_millis(2);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// Bits of a task index in a [`Run`] word.
const IDX_BITS: u32 = 20;
const IDX_MASK: u64 = (1 << IDX_BITS) - 1;
/// Most tasks per step.
pub const MAX_TASKS: usize = 1 << IDX_BITS;
/// Most threads a caller should ask for: far above any core count, far below the
/// tens of thousands of spinning threads a mistyped `--threads` would start.
pub const MAX_THREADS: usize = 1024;

/// One thread's run of tasks in one word: the step's epoch (bits 40..64), the front
/// (next unclaimed task, 20..40) and the back (one past its last, 0..20), so a claim is
/// checked against the run of its own step and a claim made for an old step fails. Two
/// lines apart, so that claims on one thread's run do not move another's line.
#[repr(align(128))]
struct Run(AtomicU64);

/// Packs a [`Run`] word.
fn run_word(epoch: u64, front: u64, back: u64) -> u64 {
    epoch << (2 * IDX_BITS) | front << IDX_BITS | back
}

/// A [`Run`] word's epoch, front and back.
fn run_parts(w: u64) -> (u64, u64, u64) {
    (
        w >> (2 * IDX_BITS),
        (w >> IDX_BITS) & IDX_MASK,
        w & IDX_MASK,
    )
}

/// The shared state.
struct Shared {
    /// The epoch of the latest step: a worker starts claiming when it changes.
    epoch: AtomicU64,
    /// Per thread (the caller at 0, worker k at k): its run of the current step.
    runs: Box<[Run]>,
    /// The step's task: the address of a `&Task` on the submitter's stack; written
    /// before `epoch` publishes the step, read only after a successful claim.
    task: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

impl Shared {
    fn new(threads: usize) -> Shared {
        Shared {
            epoch: AtomicU64::new(0),
            runs: (0..threads).map(|_| Run(AtomicU64::new(0))).collect(),
            task: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        }
    }
}

/// A fixed set of worker threads; see the module docs.
pub struct Pool {
    shared: &'static Shared,
    threads: usize,
    /// Threads asked for and why not all started (a process or thread limit), if so.
    short: Option<(usize, String)>,
    /// One step at a time; a second caller runs its tasks itself.
    submit: Mutex<()>,
}

thread_local! {
    /// Set on pool workers and on a caller inside `run`: nested calls run inline.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

static THREADS: AtomicUsize = AtomicUsize::new(0);
static POOL: OnceLock<Pool> = OnceLock::new();

/// Sets the number of threads of the global pool (callers included); only before its
/// first use. Returns false if the pool already exists with another size.
pub fn set_threads(n: usize) -> bool {
    let n = n.max(1);
    THREADS.store(n, SeqCst);
    POOL.get().is_none_or(|p| p.threads == n)
}

/// The global pool: [`set_threads`], else `RAYON_NUM_THREADS`, else all cores.
pub fn global() -> &'static Pool {
    POOL.get_or_init(|| {
        let n = match THREADS.load(SeqCst) {
            0 => std::env::var("RAYON_NUM_THREADS")
                .ok()
                .and_then(|s| s.parse().ok())
                .filter(|&n: &usize| n > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            n => n,
        };
        Pool::new(n)
    })
}

thread_local! {
    /// The pool [`Pool::install`] set on this thread.
    static CURRENT: Cell<Option<&'static Pool>> = const { Cell::new(None) };
}

/// The pool the free functions use on this thread: the installed one, else the global.
pub fn current() -> &'static Pool {
    CURRENT.get().unwrap_or_else(global)
}

/// The current pool's thread count.
pub fn threads() -> usize {
    current().threads
}

/// `f(i)` for `i in 0..n` on the current pool.
pub fn run(n: usize, f: impl Fn(usize) + Sync) {
    current().run(n, &f)
}

/// `f(i, chunk_i)` for the chunks of `size` elements of `buf` (the last may be
/// shorter), in parallel on the current pool.
pub fn for_chunks<T: Send>(buf: &mut [T], size: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    parallel_if(true).for_chunks(buf, size, f)
}

/// `f(i, a_i, b_i)` over the chunks of `a` (of `sa`) and `b` (of `sb`) side by side, as
/// many as the shorter has; in parallel on the current pool.
pub fn for_chunks2<A: Send, B: Send>(
    a: &mut [A],
    sa: usize,
    b: &mut [B],
    sb: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync,
) {
    parallel_if(true).for_chunks2((a, sa), (b, sb), f)
}

/// [`for_chunks2`] with three slices.
pub fn for_chunks3<A: Send, B: Send, C: Send>(
    (a, sa): (&mut [A], usize),
    (b, sb): (&mut [B], usize),
    (c, sc): (&mut [C], usize),
    f: impl Fn(usize, &mut [A], &mut [B], &mut [C]) + Sync,
) {
    parallel_if(true).for_chunks3((a, sa), (b, sb), (c, sc), f)
}

/// A step that is worth spreading over the pool only above some amount of work (a step
/// costs microseconds to start and to join): `parallel_if(work >= MIN).for_chunks(..)`
/// runs on the current pool when the condition holds, else makes the same calls in
/// order on the calling thread. The calls, and so the results, are the same either way.
#[derive(Debug, Clone, Copy)]
pub struct MaybeParallel(bool);

/// See [`MaybeParallel`].
pub fn parallel_if(parallel: bool) -> MaybeParallel {
    MaybeParallel(parallel)
}

impl MaybeParallel {
    /// `f(i)` for `i in 0..n`: [`run`], or in order here.
    pub fn run(self, n: usize, f: impl Fn(usize) + Sync) {
        if self.0 {
            run(n, f)
        } else {
            (0..n).for_each(f)
        }
    }

    /// [`for_chunks`], or in order here.
    pub fn for_chunks<T: Send>(
        self,
        buf: &mut [T],
        size: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let a = Parts::new(buf, size);
        // SAFETY: each index runs once (on the pool or here), so every chunk is
        // borrowed by one call.
        self.run(a.count(), |i| f(i, unsafe { a.get(i) }));
    }

    /// [`for_chunks2`], or in order here.
    pub fn for_chunks2<A: Send, B: Send>(
        self,
        (a, sa): (&mut [A], usize),
        (b, sb): (&mut [B], usize),
        f: impl Fn(usize, &mut [A], &mut [B]) + Sync,
    ) {
        let (a, b) = (Parts::new(a, sa), Parts::new(b, sb));
        // SAFETY: as in `for_chunks`.
        self.run(a.count().min(b.count()), |i| unsafe {
            f(i, a.get(i), b.get(i))
        });
    }

    /// [`for_chunks3`], or in order here.
    pub fn for_chunks3<A: Send, B: Send, C: Send>(
        self,
        (a, sa): (&mut [A], usize),
        (b, sb): (&mut [B], usize),
        (c, sc): (&mut [C], usize),
        f: impl Fn(usize, &mut [A], &mut [B], &mut [C]) + Sync,
    ) {
        let (a, b, c) = (Parts::new(a, sa), Parts::new(b, sb), Parts::new(c, sc));
        let n = a.count().min(b.count()).min(c.count());
        // SAFETY: as in `for_chunks`.
        self.run(n, |i| unsafe { f(i, a.get(i), b.get(i), c.get(i)) });
    }
}

/// A mutable slice cut into chunks that tasks take by index.
struct Parts<'a, T> {
    ptr: *mut T,
    len: usize,
    size: usize,
    _buf: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: a `Parts` hands out disjoint `&mut [T]` (see `get`), like `chunks_mut` across
// threads, which needs `T: Send`.
unsafe impl<T: Send> Sync for Parts<'_, T> {}

impl<'a, T> Parts<'a, T> {
    fn new(buf: &'a mut [T], size: usize) -> Self {
        assert!(size > 0, "chunk size 0");
        Parts {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            size,
            _buf: std::marker::PhantomData,
        }
    }

    fn count(&self) -> usize {
        self.len.div_ceil(self.size)
    }

    /// Chunk `i`.
    ///
    /// # Safety
    /// `i < count()`, and no chunk is taken twice while the other borrow lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, i: usize) -> &'a mut [T] {
        debug_assert!(i < self.count());
        let at = i * self.size;
        let n = self.size.min(self.len - at);
        // SAFETY: `at + n <= len` inside the buffer borrowed for 'a; disjoint by the
        // caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), n) }
    }
}

/// Starts one worker thread named `name` running `f`.
type Spawn<'a> = dyn FnMut(String, Box<dyn FnOnce() + Send>) -> std::io::Result<()> + 'a;

impl Pool {
    /// A pool of `threads` threads in all: the caller and `threads − 1` workers. Where a
    /// worker cannot be started (a process or thread limit, as in many containers), the
    /// pool runs with the threads it got; [`Pool::shortfall`] says so.
    pub fn new(threads: usize) -> Pool {
        Self::with_spawn(threads, &mut |name, f| {
            std::thread::Builder::new().name(name).spawn(f).map(drop)
        })
    }

    fn with_spawn(threads: usize, spawn: &mut Spawn) -> Pool {
        let wanted = threads.max(1);
        let shared: &'static Shared = Box::leak(Box::new(Shared::new(wanted)));
        let mut threads = 1;
        let mut short = None;
        while threads < wanted {
            match spawn(
                format!("krafla-{threads}"),
                Box::new({
                    let me = threads;
                    move || worker(shared, me)
                }),
            ) {
                Ok(()) => threads += 1,
                Err(e) => {
                    short = Some((wanted, e.to_string()));
                    break;
                }
            }
        }
        Pool {
            shared,
            threads,
            short,
            submit: Mutex::new(()),
        }
    }

    /// When fewer threads than asked for could be started: one line saying how many
    /// run and why (e.g. "started 1 of 8 threads (Resource temporarily unavailable
    /// (os error 11)): running on 1").
    pub fn shortfall(&self) -> Option<String> {
        self.short.as_ref().map(|(wanted, why)| {
            format!(
                "started {} of {wanted} threads ({why}): running on {}",
                self.threads, self.threads
            )
        })
    }

    /// A pool that lives as long as the process (for [`Pool::install`]; tests and
    /// benchmarks that compare thread counts).
    pub fn leak(threads: usize) -> &'static Pool {
        Box::leak(Box::new(Pool::new(threads)))
    }

    /// Runs `f` with this pool as the current one on this thread.
    pub fn install<R>(&'static self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<&'static Pool>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.set(self.0);
            }
        }
        let _restore = Restore(CURRENT.replace(Some(self)));
        f()
    }

    /// Threads in all, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(i)` for every `i in 0..n`, spread over the pool; returns when all are
    /// done. A panic in a task is raised again here.
    pub fn run<'a>(&self, n: usize, f: &'a Task<'a>) {
        if n == 0 {
            return;
        }
        let inline = || (0..n).for_each(f);
        if n == 1 || self.threads == 1 || INSIDE.get() {
            return inline();
        }
        let Ok(_guard) = self.submit.try_lock() else {
            return inline();
        };
        assert!(n <= MAX_TASKS, "{n} tasks: at most {MAX_TASKS} per step");
        let s = self.shared;
        // Workers dereference this address only for a task they claimed in this step,
        // and this function does not return (so `f` and `fref` live) until every
        // claimed task is done.
        let fref: &Task<'a> = f;
        s.task.store(&fref as *const &Task<'a> as usize, Relaxed);
        s.done.store(0, Relaxed);
        let epoch = s.epoch.load(Relaxed).wrapping_add(1) & EPOCH_MASK;
        let (n, t) = (n as u64, self.threads as u64);
        for (k, r) in (0..t).zip(&s.runs) {
            r.0.store(run_word(epoch, n * k / t, n * (k + 1) / t), Relaxed);
        }
        // Publishes the runs with the epoch (workers load it with Acquire).
        s.epoch.store(epoch, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _l = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        INSIDE.set(true);
        work(s, epoch, 0);
        INSIDE.set(false);
        let mut spins = 0u32;
        while (s.done.load(Acquire) as u64) < n {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1 << 14) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if s.panicked.swap(false, SeqCst) {
            panic!("a thread pool task panicked");
        }
    }
}

const EPOCH_MASK: u64 = (1 << (64 - 2 * IDX_BITS)) - 1;

/// Claims and runs tasks of step `epoch` on thread `me` until none is left: from the
/// front of its own run, then of the back half it took from the fullest other run.
fn work(s: &Shared, epoch: u64, me: usize) {
    let own = &s.runs[me].0;
    let mut cur = own.load(Acquire);
    loop {
        let (e, front, back) = run_parts(cur);
        if e != epoch {
            return;
        }
        if front < back {
            match own.compare_exchange_weak(cur, cur + (1 << IDX_BITS), AcqRel, Acquire) {
                Ok(_) => {
                    // SAFETY: the claim succeeded in this step, so its submitter is
                    // still inside `run` waiting for this task: the function is alive,
                    // and its words, stored before the step was published, are visible
                    // (Acquire).
                    let f: &Task = unsafe { *(s.task.load(Relaxed) as *const &Task) };
                    if catch_unwind(AssertUnwindSafe(|| f(front as usize))).is_err() {
                        s.panicked.store(true, SeqCst);
                    }
                    s.done.fetch_add(1, Release);
                    cur = own.load(Acquire);
                }
                Err(now) => cur = now,
            }
            continue;
        }
        if !steal(s, epoch, me) {
            return;
        }
        cur = own.load(Acquire);
    }
}

/// Moves the back half (at least one task) of the fullest other run of step `epoch` to
/// thread `me`'s empty run; false when every run is empty.
fn steal(s: &Shared, epoch: u64, me: usize) -> bool {
    loop {
        let fullest = (s.runs.iter().enumerate())
            .filter(|&(k, _)| k != me)
            .filter_map(|(k, r)| {
                let w = r.0.load(Acquire);
                let (e, front, back) = run_parts(w);
                (e == epoch && front < back).then_some((k, w, front, back))
            })
            .max_by_key(|&(_, _, front, back)| back - front);
        let Some((k, w, front, back)) = fullest else {
            return false;
        };
        let mid = front + (back - front) / 2;
        if s.runs[k]
            .0
            .compare_exchange(w, run_word(epoch, front, mid), AcqRel, Acquire)
            .is_ok()
        {
            // Nobody else writes an empty run (claims and steals need front < back),
            // and the stolen tasks keep the step open, so this is still its run.
            s.runs[me].0.store(run_word(epoch, mid, back), Release);
            return true;
        }
    }
}

fn worker(s: &'static Shared, me: usize) {
    INSIDE.set(true);
    let mut seen = 0u64;
    loop {
        // Spin for new work, then sleep until a step is published.
        let t0 = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Acquire);
            if e != seen {
                break e;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && t0.elapsed() > SPIN {
                let mut l = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, SeqCst);
                while s.epoch.load(SeqCst) == seen {
                    l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, SeqCst);
                drop(l);
                break s.epoch.load(Acquire);
            }
            std::hint::spin_loop();
        };
        seen = epoch;
        work(s, epoch, me);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 3, 5] {
            let p = Pool::new(threads);
            for n in [0, 1, 2, 7, 64, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..20 {
                    p.run(n, &|i| {
                        hits[i].fetch_add(1, Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Relaxed) == 20), "{threads} {n}");
            }
        }
    }

    /// A thread takes its own run in order, then halves of the fullest other run from
    /// its back: here thread 0 of three whose others never claim.
    #[test]
    fn a_thread_claims_its_run_in_order_then_steals_back_halves() {
        let s = Shared::new(3);
        let order = Mutex::new(Vec::new());
        let f = |i: usize| order.lock().unwrap().push(i);
        let fref: &Task = &f;
        s.task.store(&fref as *const &Task as usize, Relaxed);
        for (k, (a, b)) in [(0, 4), (4, 9), (9, 11)].into_iter().enumerate() {
            s.runs[k].0.store(run_word(7, a, b), Relaxed);
        }
        work(&s, 7, 0);
        // Its own 0..4; then 6..9, the back half of run 1 (4..9, the fullest); then
        // one task at a time from the fuller of the rest (the later on a tie).
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 6, 7, 8, 10, 5, 9, 4]);
        assert_eq!(s.done.load(Relaxed), 11);
        // Every run is empty; a claim for another step finds nothing.
        assert!((0..3).all(|k| {
            let (_, f, b) = run_parts(s.runs[k].0.load(Relaxed));
            f >= b
        }));
    }

    #[test]
    fn chunk_helpers_cover_every_element_once() {
        let mut a = vec![0u32; 103];
        for_chunks(&mut a, 10, |i, c| {
            c.iter_mut().for_each(|x| *x += i as u32 + 1)
        });
        assert!(a.iter().enumerate().all(|(j, &x)| x == j as u32 / 10 + 1));
        let (mut b, mut c) = (vec![0u8; 40], vec![0u16; 9]);
        for_chunks2(&mut b, 4, &mut c, 1, |i, x, y| {
            x.fill(i as u8);
            y[0] = x.len() as u16;
        });
        assert_eq!(c, [4; 9]);
        assert_eq!(&b[36..], [0; 4], "only as many chunks as the shorter side");
        let (mut x, mut y, mut z) = (vec![0; 6], vec![0; 9], vec![0; 3]);
        for_chunks3((&mut x, 2), (&mut y, 3), (&mut z, 1), |i, a, b, c| {
            a.fill(i);
            b.fill(i);
            c[0] = i;
        });
        assert_eq!(
            (x, y, z),
            (
                vec![0, 0, 1, 1, 2, 2],
                vec![0, 0, 0, 1, 1, 1, 2, 2, 2],
                vec![0, 1, 2]
            )
        );
    }

    #[test]
    fn nested_and_concurrent_runs_complete() {
        let p = std::sync::Arc::new(Pool::new(3));
        let total = AtomicUsize::new(0);
        p.run(4, &|_| {
            p.run(5, &|_| {
                total.fetch_add(1, Relaxed);
            })
        });
        assert_eq!(total.load(Relaxed), 20);
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..200 {
                        p.run(8, &|_| {
                            c.fetch_add(1, Relaxed);
                        });
                    }
                    c.load(Relaxed)
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), 1600);
        }
    }

    #[test]
    fn install_sets_the_current_pool() {
        let p = Pool::leak(3);
        assert_eq!(p.install(threads), 3);
        assert_eq!(Pool::leak(1).install(|| p.install(threads)), 3);
        assert_eq!(threads(), global().threads());
    }

    #[test]
    fn workers_wake_after_sleeping() {
        let p = Pool::new(2);
        let c = AtomicUsize::new(0);
        p.run(4, &|_| {
            c.fetch_add(1, Relaxed);
        });
        std::thread::sleep(SPIN * 3);
        p.run(4, &|_| {
            c.fetch_add(1, Relaxed);
        });
        assert_eq!(c.load(Relaxed), 8);
    }

    /// A thread limit (here: the third spawn fails) gives a smaller pool that works
    /// and says why; it used to panic ("spawn a pool thread").
    #[test]
    fn a_worker_that_cannot_start_leaves_a_smaller_working_pool() {
        for (wanted, ok) in [(4usize, 2usize), (3, 0), (1, 0), (2, 5)] {
            let mut n = 0;
            let p = Pool::with_spawn(wanted, &mut |name, f| {
                n += 1;
                if n > ok {
                    return Err(std::io::Error::from_raw_os_error(11));
                }
                std::thread::Builder::new().name(name).spawn(f).map(drop)
            });
            let got = wanted.min(ok + 1);
            assert_eq!(p.threads(), got, "{wanted} {ok}");
            match p.shortfall() {
                None => assert_eq!(got, wanted),
                Some(s) => {
                    assert!(got < wanted);
                    assert!(
                        s.starts_with(&format!("started {got} of {wanted} threads (")),
                        "{s}"
                    );
                    assert!(s.ends_with(&format!("running on {got}")), "{s}");
                }
            }
            let c = AtomicUsize::new(0);
            p.run(16, &|_| {
                c.fetch_add(1, Relaxed);
            });
            assert_eq!(c.load(Relaxed), 16);
        }
    }

    #[test]
    fn a_panicking_task_is_raised_in_the_caller() {
        let p = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            p.run(8, &|i| assert!(i != 5, "task 5"));
        }));
        assert!(r.is_err());
        // The pool still works.
        let c = AtomicUsize::new(0);
        p.run(8, &|_| {
            c.fetch_add(1, Relaxed);
        });
        assert_eq!(c.load(Relaxed), 8);
    }
}
