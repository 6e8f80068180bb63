//! The tools' one signal path (libc, Unix; no-ops elsewhere).
//!
//! - [`default_sigpipe`]: writing to a closed pipe ends the process quietly, as it does
//!   C tools (`mlb-inspect f.mlb | head`); every binary calls it first.
//! - [`stop_on_interrupt`]: SIGINT and SIGTERM set a flag that long work polls
//!   (mlb-convert stops at the next row chunk, removes its temporary file, exits 130).
//! - [`flag_on_sigint`]: SIGINT alone sets a flag (the interactive chat's Ctrl-C stops
//!   a reply).
//! - [`report_sigbus`]: a mapped model file that another process truncates raises
//!   SIGBUS on the next read past its new end; the handler writes one prepared line and
//!   exits 1 instead of a bare "Bus error" (docs/reliability.md).
//!
//! Handlers only do async-signal-safe things: an atomic store, `write(2)`, `_exit(2)`.

use std::path::Path;
use std::sync::atomic::AtomicBool;

/// Makes writing to a closed pipe end the process quietly (Rust ignores SIGPIPE by
/// default, which turns it into an EPIPE error).
pub fn default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Routes SIGINT and SIGTERM to `flag`: the first of either sets it (and nothing else
/// happens; the work polling the flag decides how to stop).
pub fn stop_on_interrupt(flag: &'static AtomicBool) {
    #[cfg(unix)]
    unix::stop_on_interrupt(flag);
    #[cfg(not(unix))]
    let _ = flag;
}

/// Routes SIGINT (Ctrl-C) alone to `flag` (SIGTERM keeps ending the process): the
/// interactive chat stops the reply being generated.
pub fn flag_on_sigint(flag: &'static AtomicBool) {
    #[cfg(unix)]
    unix::flag_on_sigint(flag);
    #[cfg(not(unix))]
    let _ = flag;
}

/// From now on a SIGBUS prints `PROGRAM: ML_E_IO: PATH: the file was truncated or
/// changed while in use (SIGBUS)` and exits with status 1. The first call wins.
pub fn report_sigbus(program: &str, path: &Path) {
    let msg = format!(
        "{program}: ML_E_IO: {}: the file was truncated or changed while in use (SIGBUS)\n",
        path.display()
    );
    #[cfg(unix)]
    unix::report_sigbus(msg);
    #[cfg(not(unix))]
    let _ = msg;
}

#[cfg(unix)]
mod unix {
    use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
    use std::sync::OnceLock;

    static STOP: AtomicPtr<AtomicBool> = AtomicPtr::new(std::ptr::null_mut());
    static SIGBUS_MSG: OnceLock<Vec<u8>> = OnceLock::new();

    extern "C" fn on_interrupt(_: libc::c_int) {
        let p = STOP.load(Ordering::Relaxed);
        if !p.is_null() {
            // SAFETY: p came from a &'static AtomicBool; an atomic store is
            // async-signal-safe.
            unsafe { (*p).store(true, Ordering::Relaxed) };
        }
    }

    extern "C" fn on_sigbus(_: libc::c_int) {
        if let Some(m) = SIGBUS_MSG.get() {
            // SAFETY: m is a live, initialized buffer; write(2) is async-signal-safe.
            unsafe { libc::write(2, m.as_ptr().cast(), m.len()) };
        }
        // SAFETY: _exit ends the process without running any user code.
        unsafe { libc::_exit(1) }
    }

    fn install(sig: libc::c_int, handler: extern "C" fn(libc::c_int)) {
        // SAFETY: the handlers above only call async-signal-safe functions.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }

    pub fn stop_on_interrupt(flag: &'static AtomicBool) {
        STOP.store((flag as *const AtomicBool).cast_mut(), Ordering::Relaxed);
        install(libc::SIGINT, on_interrupt);
        install(libc::SIGTERM, on_interrupt);
    }

    pub fn flag_on_sigint(flag: &'static AtomicBool) {
        STOP.store((flag as *const AtomicBool).cast_mut(), Ordering::Relaxed);
        install(libc::SIGINT, on_interrupt);
    }

    pub fn report_sigbus(msg: String) {
        if SIGBUS_MSG.set(msg.into_bytes()).is_ok() {
            install(libc::SIGBUS, on_sigbus);
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn sigterm_sets_the_flag() {
        static FLAG: AtomicBool = AtomicBool::new(false);
        stop_on_interrupt(&FLAG);
        // SAFETY: raise(3) delivers the signal to this thread; the handler only stores.
        unsafe { libc::raise(libc::SIGTERM) };
        assert!(FLAG.load(Ordering::Relaxed));
        // SAFETY: back to the default disposition for the rest of the test binary.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
        }
    }
}
