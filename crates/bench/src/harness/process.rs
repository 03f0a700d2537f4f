//! Child processes and signals: interrupts end an experiment through its error path, and
//! no child outlives it.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_interrupt(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM end the experiment at its next step through its error path,
/// which stops the servers and fio and removes the files, instead of ending the process at
/// once. (A terminal's Ctrl-C reaches the servers and fio too: they stop by themselves.)
pub(crate) fn catch_interrupts() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe; the action
    // is zeroed (a valid empty mask and no flags) before its fields are set.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = note_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &action, std::ptr::null_mut());
    }
}

/// Whether SIGINT or SIGTERM arrived (after [`catch_interrupts`]).
pub(crate) fn was_interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// An error once SIGINT or SIGTERM arrived.
pub(crate) fn check_interrupted() -> Result<(), String> {
    if was_interrupted() { Err("interrupted".into()) } else { Ok(()) }
}

/// Sends `signal` to `pid`.
pub(crate) fn send_signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory effects in this process; a stale pid only yields ESRCH.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// Makes a spawned child receive SIGTERM when the thread that spawned it ends (the bench
/// killed, or panicking through a path that skips the server's guard).
pub(super) fn terminate_with_parent(command: &mut Command) {
    // SAFETY: the closure runs between fork and exec and calls only prctl(2), which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The last lines of a log file, for error messages.
pub(super) fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(6)..].join(" | ");
    if tail.is_empty() { "(no output)".into() } else { tail }
}

/// Waits for `child` until `deadline` (or, if `interruptible`, until SIGINT or SIGTERM
/// arrives); `None` if it still runs.
pub(super) fn wait_until(
    child: &mut Child,
    deadline: Instant,
    interruptible: bool,
) -> Option<ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if interruptible && was_interrupted() => return None,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) | Err(_) => return None,
        }
    }
}
