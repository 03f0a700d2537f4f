//! Child processes and signals: interrupts end an experiment through its error path, and
//! no child outlives it.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

/// Set by SIGINT or SIGTERM once [`catch_interrupts`] ran.
static INTERRUPTED: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);

/// From now on SIGINT and SIGTERM end the experiment at its next step through its error path,
/// which stops the servers and fio and removes the files, instead of ending the process at
/// once. (A terminal's Ctrl-C reaches the servers and fio too: they stop by themselves.)
pub(crate) fn catch_interrupts() {
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registering fails only for signals that cannot be caught (SIGKILL, SIGSTOP).
        let registered = signal_hook::flag::register(signal, Arc::clone(&INTERRUPTED));
        assert!(registered.is_ok(), "SIGINT and SIGTERM can be caught: {registered:?}");
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

/// Sends `signal` to `pid` (a child that already ended is not an error).
pub(crate) fn send_signal(pid: u32, signal: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        let _gone = rustix::process::kill_process(pid, signal);
    }
}

/// Makes a spawned child receive SIGTERM when the thread that spawned it ends (the bench
/// killed, or panicking through a path that skips the server's guard).
pub(super) fn terminate_with_parent(command: &mut Command) {
    // SAFETY: the closure runs between fork and exec and makes one prctl(2) system call,
    // which is async-signal-safe, and allocates nothing (an error is an errno).
    unsafe {
        command.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(Signal::TERM))
                .map_err(std::io::Error::from)
        });
    }
}

/// The last lines of a log file, for error messages.
pub(crate) fn log_tail(path: &Path) -> String {
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
