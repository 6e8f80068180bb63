//! What the four binaries share about their standard output.
//!
//! `print!` panics when stdout fails (a closed pipe, a full disk behind a redirect). The
//! tools print through [`out!`](crate::out) and [`outln!`](crate::outln) instead: a write
//! error ends the process with one line on stderr and exit status 1, and after
//! [`default_sigpipe`] a closed pipe ends it quietly, as it does C tools
//! (`mlb-inspect f.mlb | head`).

use std::io::Write;

/// Makes writing to a closed pipe end the process quietly (Rust ignores SIGPIPE by
/// default, which turns it into an EPIPE error). Called first thing by every binary.
pub fn default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Writes `s` to stdout and flushes; on an error prints `PROGRAM: stdout: ERROR` and
/// exits with status 1.
pub fn write_stdout(s: &str) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_all(s.as_bytes()).and_then(|()| o.flush()) {
        let prog = std::env::args()
            .next()
            .and_then(|a| {
                std::path::Path::new(&a)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "krafla".into());
        eprintln!("{prog}: stdout: {e}");
        std::process::exit(1);
    }
}

/// `print!` that never panics; see the module docs.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::cli::write_stdout(&format!($($t)*)) };
}

/// `println!` that never panics; see the module docs.
#[macro_export]
macro_rules! outln {
    () => { $crate::cli::write_stdout("\n") };
    ($($t:tt)*) => { $crate::cli::write_stdout(&(format!($($t)*) + "\n")) };
}

/// Makes a SIGBUS (a mapped file truncated by another process while in use) end the
/// process with one line, `TOOL: ML_E_IO: PATH: the file was truncated or changed while
/// in use (SIGBUS)`, and exit status 1, instead of a bare "Bus error". Tools that map
/// their input call it before mapping (docs/reliability.md, the mmap caveat).
#[cfg(unix)]
pub fn exit_on_sigbus(tool: &str, path: &std::path::Path) {
    use std::sync::OnceLock;
    static MSG: OnceLock<Vec<u8>> = OnceLock::new();
    extern "C" fn on_sigbus(_: libc::c_int) {
        // Only async-signal-safe calls: write(2) of a prepared message, then _exit.
        if let Some(m) = MSG.get() {
            // SAFETY: m is a live, initialized buffer.
            unsafe { libc::write(2, m.as_ptr().cast(), m.len()) };
        }
        // SAFETY: _exit ends the process without running any user code.
        unsafe { libc::_exit(1) }
    }
    let msg = format!(
        "{tool}: ML_E_IO: {}: the file was truncated or changed while in use (SIGBUS)\n",
        path.display()
    );
    if MSG.set(msg.into_bytes()).is_ok() {
        // SAFETY: the handler only calls async-signal-safe functions.
        unsafe {
            libc::signal(
                libc::SIGBUS,
                on_sigbus as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
}

/// Does nothing where there is no SIGBUS.
#[cfg(not(unix))]
pub fn exit_on_sigbus(_tool: &str, _path: &std::path::Path) {}
