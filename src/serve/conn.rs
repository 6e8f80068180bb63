//! Connections: the accept loop of mlb-serve, with the limits that keep one client
//! from starving the others, and the two-stage shutdown.
//!
//! - **Descriptors**: at start the soft `RLIMIT_NOFILE` is raised to the hard limit,
//!   and at most `max_connections` connections are open at once, kept
//!   [`FD_RESERVE`] below that limit, so that `accept` never fails for want of a
//!   descriptor (the model file, the runtime and the log need a few).
//! - **A full house**: a new connection closes the oldest one that is not running a
//!   request (one that sent nothing, a slow head, a half-sent body, an idle keep-alive),
//!   so idle connections cannot lock others out; if every connection runs a request the
//!   new one is closed.
//! - **Head timeout** (hyper's `header_read_timeout`): a connection waiting for a
//!   request head (a new one that sends nothing, a slow sender, a keep-alive connection
//!   between requests, i.e. the idle timeout) is closed after `header_timeout`.
//! - **Body timeout**: a handler reads the whole body within `body_timeout`, else 408.
//! - **Shutdown** ([`Stop`]): at `Draining` no connection is accepted, every connection
//!   is told to close when idle (hyper's graceful shutdown); those not running a request
//!   (say, holding a half-sent request) are closed after `drain`; those running one may
//!   go on until the scheduler's grace has passed (then their request is cancelled),
//!   plus [`AFTER_GRACE`]. At `Now` (the second signal) every request is cancelled and
//!   every connection closed within [`CANCELLED_FLUSH`] (time for a cancelled stream to
//!   send its error event and `[DONE]`).
//!
//! "Running a request" is a [`Running`] guard a handler holds from the moment it has
//! read the body until its response (a stream included) has ended.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service;

/// Descriptors kept free below the soft limit for everything but connections.
pub const FD_RESERVE: u64 = 64;
/// How long connections running a request may outlive the scheduler's grace.
pub const AFTER_GRACE: Duration = Duration::from_secs(2);
/// At the second signal: how long a cancelled request may take to send its end.
pub const CANCELLED_FLUSH: Duration = Duration::from_millis(500);

/// The server's shutdown stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Running,
    /// First signal: accept nothing, close connections as they become idle.
    Draining,
    /// Second signal: close everything.
    Now,
}

/// The connection limits (`ServeOptions`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    /// After the first signal: connections not running a request are closed then.
    pub drain: Duration,
    /// The scheduler's grace for running requests.
    pub grace: Duration,
}

/// One open connection, as handlers and the accept loop see it.
#[derive(Debug)]
pub struct Conn {
    /// Requests it is running (handlers' [`Running`] guards).
    running: AtomicUsize,
    /// Told to close (evicted to make room, or forced at shutdown).
    close: Notify,
}

impl Conn {
    /// Marks a request running on this connection until the guard drops.
    pub fn running(self: &Arc<Self>) -> Running {
        self.running.fetch_add(1, SeqCst);
        Running(self.clone())
    }

    fn is_running(&self) -> bool {
        self.running.load(SeqCst) > 0
    }
}

/// A request running on a connection; see the module docs.
#[derive(Debug)]
pub struct Running(Arc<Conn>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, SeqCst);
    }
}

/// Raises the soft descriptor limit to the hard one; returns the soft limit now in
/// force (`None` where it cannot be read).
pub fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `r` is a valid rlimit the call writes into.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            return None;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            // SAFETY: `raised` is a valid rlimit the call reads.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
        // rlim_t is u64 on Linux, not everywhere.
        #[allow(clippy::unnecessary_cast)]
        Some(r.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    None
}

/// The connection cap: `wanted`, kept [`FD_RESERVE`] below the descriptor limit.
pub fn connection_cap(wanted: usize, fd_limit: Option<u64>) -> usize {
    match fd_limit {
        Some(l) => {
            let room = l.saturating_sub(FD_RESERVE).max(l / 2).max(1);
            wanted.min(usize::try_from(room).unwrap_or(usize::MAX))
        }
        None => wanted,
    }
}

/// The open connections, oldest first.
#[derive(Default)]
struct Registry {
    next: u64,
    open: BTreeMap<u64, Arc<Conn>>,
}

impl Registry {
    /// Makes room for one more under `cap`: closes the oldest connection not running a
    /// request. `false` if every one is running one.
    fn make_room(&mut self, cap: usize) -> bool {
        if self.open.len() < cap {
            return true;
        }
        let Some((&id, _)) = self.open.iter().find(|(_, c)| !c.is_running()) else {
            return false;
        };
        if let Some(c) = self.open.remove(&id) {
            c.close.notify_one();
        }
        true
    }
}

/// Removes a connection from the registry when its task ends.
struct Leave(Arc<Mutex<Registry>>, u64);

impl Drop for Leave {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .open
            .remove(&self.1);
    }
}

/// Serves `router` on `listener` until `stop` is [`Stop::Draining`] and every
/// connection has closed (see the module docs).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<Stop>,
) {
    let registry = Arc::new(Mutex::new(Registry::default()));
    let mut tasks = JoinSet::new();
    loop {
        if *stop.borrow() != Stop::Running {
            break;
        }
        let stream = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => continue,
            // Reap finished connection tasks as we go.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let stream = match stream {
            Ok((s, _)) => s,
            Err(_) => {
                // Out of descriptors (or an aborted handshake): make room and retry.
                registry
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .make_room(0);
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let conn = Arc::new(Conn {
            running: AtomicUsize::new(0),
            close: Notify::new(),
        });
        let leave = {
            let mut r = registry.lock().unwrap_or_else(|e| e.into_inner());
            if !r.make_room(limits.max_connections) {
                // Every connection runs a request: this one is closed unanswered.
                continue;
            }
            let id = r.next;
            r.next += 1;
            r.open.insert(id, conn.clone());
            Leave(registry.clone(), id)
        };
        let _ = stream.set_nodelay(true);
        tasks.spawn(connection(
            stream,
            router.clone(),
            conn,
            limits,
            stop.clone(),
            leave,
        ));
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}

/// One connection's task: hyper's HTTP/1 with the head timeout, the request's
/// [`Conn`] in its extensions, closed as the module docs say.
async fn connection(
    stream: tokio::net::TcpStream,
    router: Router,
    conn: Arc<Conn>,
    limits: ConnLimits,
    mut stop: watch::Receiver<Stop>,
    _leave: Leave,
) {
    let c = conn.clone();
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(c.clone());
        let mut router = router.clone();
        async move { router.call(req).await }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let http = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(http);
    // After the first signal: when idle connections and all connections go.
    let mut idle_by: Option<Instant> = None;
    let mut all_by: Option<Instant> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut stages_over = false;
    loop {
        let stage = *stop.borrow();
        match stage {
            // A cancelled request still sends its error event and `[DONE]`: hyper may
            // hold them unwritten after the handler's stream (and its guard) has ended,
            // so every connection gets the same short deadline, and one whose response
            // is done and flushed ends sooner (hyper closes it: graceful shutdown).
            Stop::Now => {
                if idle_by.is_none() {
                    http.as_mut().graceful_shutdown();
                }
                let soon = Instant::now() + CANCELLED_FLUSH;
                if all_by.is_none_or(|t| t > soon) {
                    idle_by = Some(soon);
                    all_by = Some(soon);
                }
            }
            Stop::Draining if idle_by.is_none() => {
                http.as_mut().graceful_shutdown();
                let now = Instant::now();
                idle_by = Some(now + limits.drain);
                all_by = Some(now + limits.grace + AFTER_GRACE);
            }
            _ => {}
        }
        let now = Instant::now();
        if idle_by.is_some_and(|t| now >= t) && !conn.is_running() {
            return;
        }
        if all_by.is_some_and(|t| now >= t) {
            return;
        }
        tokio::select! {
            _ = http.as_mut() => return,
            _ = conn.close.notified() => return,
            // The signal task drops its sender after the last stage (`Now`): the stage
            // stays what it was, and the deadlines above end the connection.
            r = stop.changed(), if !stages_over => stages_over = r.is_err(),
            _ = tick.tick(), if idle_by.is_some() => {}
        }
    }
}
