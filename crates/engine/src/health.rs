//! The backing store's health as the engine has seen it: which kinds of operation are failing
//! (reads, writes, flushes), and how (out of reach, or refusing), for `stats` and for an
//! operator watching a cache whose backing store is a network service or a failing disk.
//!
//! A failure is recorded where it is counted (`backing_failed`, a cold path) under the kind
//! of operation that failed; a success clears it where the engine completes backing-store work
//! anyway (a read from the store, a write, a sync, a write-back batch), behind one relaxed load
//! of a flag that is false while all is well (`Engine::backing_succeeded`). What a success
//! clears:
//!
//! - a failed write: a write that succeeds; or any success while no dirty block waits for the
//!   store. While dirty blocks wait, the cleaner retries their write-back until it succeeds, so
//!   a store whose writes fail is reported failing while its reads and flushes succeed — a
//!   successful `fdatasync` does not hide a write-back that keeps failing. With none waiting
//!   (write-through: the failed write was the client's, answered with the error and not
//!   retried), the store answering again is all there is to know;
//! - a failed flush: a flush that succeeds (flushes recur);
//! - a failed read, or a failure of no particular kind (a whole queue's): any success, since
//!   neither is retried.
//!
//! Every change of the state (the first failure, a kind of operation failing or healing, the
//! last failure cleared) advances a change count a watcher can wait on
//! (`Engine::wait_backing_health`), so a server logs each change as it happens rather than
//! polling `stats`.

use std::time::{Duration, Instant};

use pmcache_backing::BackingError;

use crate::sync::{AtomicBool, Condvar, Mutex, Ordering, lock, wait_timeout};

/// What the last backing-store operations did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum BackingState {
    /// The last ones succeeded (or none failed yet).
    #[default]
    Ok,
    /// The last one of some kind failed: the store answered with an error.
    Failing,
    /// The last one of some kind failed because the store could not be reached (timed out,
    /// connection lost): a network store or its servers are down.
    Unreachable,
}

impl BackingState {
    /// The name stats use.
    pub fn name(self) -> &'static str {
        match self {
            BackingState::Ok => "ok",
            BackingState::Failing => "failing",
            BackingState::Unreachable => "unreachable",
        }
    }
}

/// The kind of a backing-store operation, as health is tracked per kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingOp {
    /// Reads (misses, read-modify-write fills).
    Read,
    /// Writes: write-through and write-around writes, write-back, write-zeroes, discards.
    Write,
    /// Flushes (`fdatasync`).
    Flush,
    /// Anything else: extent queries, a queue failing as a whole.
    Other,
}

impl BackingOp {
    const ALL: [BackingOp; 4] =
        [BackingOp::Read, BackingOp::Write, BackingOp::Flush, BackingOp::Other];

    /// The name stats and logs use.
    pub fn name(self) -> &'static str {
        match self {
            BackingOp::Read => "reads",
            BackingOp::Write => "writes",
            BackingOp::Flush => "flushes",
            BackingOp::Other => "other operations",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The backing store's health, as `Engine::stats` reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BackingHealth {
    /// The state: the worst of the kinds of operation failing.
    pub state: BackingState,
    /// The kinds of operation whose last attempt failed, in the order read, write, flush,
    /// other (empty while `Ok`).
    pub failing: Vec<BackingOp>,
    /// The last failure's message, while the state is not `Ok`.
    pub last_error: Option<String>,
    /// For how long operations have been failing, in milliseconds (0 while `Ok`).
    pub failing_ms: u64,
}

impl BackingHealth {
    /// The failing kinds as words: "writes", "reads and writes", "reads, writes and flushes".
    pub fn failing_names(&self) -> String {
        let names: Vec<&str> = self.failing.iter().map(|op| op.name()).collect();
        match names.split_last() {
            None => String::new(),
            Some((last, [])) => (*last).to_string(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        }
    }
}

#[derive(Debug, Default)]
struct Failures {
    /// Per kind of operation: its state (`Ok` while its last attempt succeeded).
    states: [BackingState; 4],
    /// The last failure's message.
    message: String,
    /// When the operations started failing (the first failure since all was well).
    since: Option<Instant>,
    /// Changes of `states` so far.
    changes: u64,
}

impl Failures {
    fn health(&self) -> BackingHealth {
        let state = self.states.iter().copied().max().unwrap_or_default();
        if state == BackingState::Ok {
            return BackingHealth::default();
        }
        BackingHealth {
            state,
            failing: BackingOp::ALL
                .into_iter()
                .filter(|op| self.states[op.index()] != BackingState::Ok)
                .collect(),
            last_error: Some(self.message.clone()),
            failing_ms: self.since.map_or(0, |t| t.elapsed().as_millis() as u64),
        }
    }
}

/// The engine's record (see the module).
#[derive(Debug)]
pub(crate) struct HealthTracker {
    failing: AtomicBool,
    failures: Mutex<Failures>,
    changed: Condvar,
}

impl HealthTracker {
    pub(crate) fn new() -> Self {
        Self {
            failing: AtomicBool::new(false),
            failures: Mutex::new(Failures::default()),
            changed: Condvar::new(),
        }
    }

    /// Records a failed operation of kind `op`.
    pub(crate) fn failed(&self, op: BackingOp, error: &BackingError) {
        let mut failures = lock(&self.failures);
        let state =
            if error.is_unreachable() { BackingState::Unreachable } else { BackingState::Failing };
        failures.message = error.to_string();
        failures.since.get_or_insert_with(Instant::now);
        if failures.states[op.index()] != state {
            failures.states[op.index()] = state;
            failures.changes += 1;
            self.changed.notify_all();
        }
        self.failing.store(true, Ordering::Release);
    }

    /// Whether some kind of operation is failing: the one relaxed load a success pays while
    /// all is well.
    #[inline]
    pub(crate) fn failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// Records a successful operation of kind `op`, `nothing_dirty` when no dirty block waits
    /// for the store: clears what it answers for (see the module).
    #[cold]
    pub(crate) fn cleared(&self, op: BackingOp, nothing_dirty: bool) {
        let mut failures = lock(&self.failures);
        let mut changed = false;
        let write = (op == BackingOp::Write || nothing_dirty).then_some(BackingOp::Write);
        for kind in
            [Some(op), Some(BackingOp::Read), Some(BackingOp::Other), write].into_iter().flatten()
        {
            if failures.states[kind.index()] != BackingState::Ok {
                failures.states[kind.index()] = BackingState::Ok;
                changed = true;
            }
        }
        if !changed {
            return;
        }
        failures.changes += 1;
        if failures.states.iter().all(|s| *s == BackingState::Ok) {
            failures.since = None;
            failures.message.clear();
            self.failing.store(false, Ordering::Release);
        }
        self.changed.notify_all();
    }

    /// The health now.
    pub(crate) fn health(&self) -> BackingHealth {
        lock(&self.failures).health()
    }

    /// Wakes every waiter of [`Self::wait_change`] (a watcher being stopped).
    pub(crate) fn wake(&self) {
        let _failures = lock(&self.failures);
        self.changed.notify_all();
    }

    /// Waits up to `timeout` for the health to change after change number `seen`; returns the
    /// change number now and the health then (at once if it changed since `seen`).
    pub(crate) fn wait_change(&self, seen: u64, timeout: Duration) -> (u64, BackingHealth) {
        let deadline = Instant::now() + timeout;
        let mut failures = lock(&self.failures);
        while failures.changes == seen {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            failures = wait_timeout(&self.changed, failures, deadline - now);
        }
        (failures.changes, failures.health())
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    fn error(op: &'static str, errno: i32) -> BackingError {
        BackingError::Io {
            op,
            offset: 4096,
            len: 4096,
            source: std::io::Error::from_raw_os_error(errno),
        }
    }

    /// A timeout reads as unreachable, another error as failing, each with its message and
    /// the time since the first failure; a success of the kind that failed clears it.
    #[test]
    fn failures_are_told_apart_and_cleared_by_a_success_of_their_kind() {
        let tracker = HealthTracker::new();
        assert_eq!(tracker.health(), BackingHealth::default());
        tracker.failed(BackingOp::Write, &error("write", libc::EIO));
        let health = tracker.health();
        assert_eq!(health.state, BackingState::Failing);
        assert!(health.last_error.as_deref().is_some_and(|m| m.contains("write at byte 4096")));
        std::thread::sleep(std::time::Duration::from_millis(20));
        tracker.failed(BackingOp::Write, &error("write", libc::ETIMEDOUT));
        let health = tracker.health();
        assert_eq!(health.state.name(), "unreachable");
        assert!(health.failing_ms >= 20, "counted from the first failure: {health:?}");
        tracker.cleared(BackingOp::Write, false);
        assert_eq!(tracker.health(), BackingHealth::default());
    }

    /// Writes and flushes failing stay reported while other kinds succeed; a failed read and
    /// a failure of no particular kind are cleared by any success; the worst kind is the state.
    #[test]
    fn a_success_of_another_kind_leaves_a_write_or_flush_failure_reported() {
        let tracker = HealthTracker::new();
        tracker.failed(BackingOp::Write, &error("write", libc::EIO));
        tracker.failed(BackingOp::Other, &error("submit", libc::ETIMEDOUT));
        assert_eq!(tracker.health().state, BackingState::Unreachable);
        assert_eq!(tracker.health().failing_names(), "writes and other operations");
        tracker.cleared(BackingOp::Read, false);
        tracker.cleared(BackingOp::Flush, false);
        let health = tracker.health();
        assert_eq!(health.state, BackingState::Failing, "{health:?}");
        assert_eq!(health.failing, vec![BackingOp::Write]);
        assert_eq!(health.failing_names(), "writes");
        tracker.failed(BackingOp::Flush, &error("flush", libc::EIO));
        tracker.failed(BackingOp::Read, &error("read", libc::EIO));
        assert_eq!(tracker.health().failing_names(), "reads, writes and flushes");
        tracker.cleared(BackingOp::Write, false);
        assert_eq!(tracker.health().failing, vec![BackingOp::Flush], "a write answers for reads");
        tracker.cleared(BackingOp::Flush, false);
        assert_eq!(tracker.health(), BackingHealth::default());
    }

    /// With no dirty block waiting for the store, a failed write (a client's, not retried) is
    /// cleared by any success: the store answers again.
    #[test]
    fn with_nothing_dirty_any_success_clears_a_failed_write() {
        let tracker = HealthTracker::new();
        tracker.failed(BackingOp::Write, &error("write", libc::EIO));
        tracker.failed(BackingOp::Flush, &error("flush", libc::EIO));
        tracker.cleared(BackingOp::Read, true);
        assert_eq!(tracker.health().failing, vec![BackingOp::Flush], "a flush answers for flushes");
        tracker.cleared(BackingOp::Flush, true);
        assert_eq!(tracker.health(), BackingHealth::default());
    }

    /// A watcher sees each change once: the first failure, a further kind failing, the
    /// recovery; a repeated failure of a kind already failing is no change.
    #[test]
    fn a_watcher_sees_each_change() {
        let tracker = HealthTracker::new();
        let short = Duration::from_millis(10);
        let (seen, health) = tracker.wait_change(0, short);
        assert_eq!((seen, health.state), (0, BackingState::Ok), "no change yet");
        tracker.failed(BackingOp::Write, &error("write", libc::EIO));
        let (seen, health) = tracker.wait_change(seen, short);
        assert_eq!((seen, health.failing_names().as_str()), (1, "writes"));
        tracker.failed(BackingOp::Write, &error("write", libc::EIO));
        assert_eq!(tracker.wait_change(seen, short).0, seen, "the same failure again");
        tracker.failed(BackingOp::Read, &error("read", libc::EIO));
        let (seen, health) = tracker.wait_change(seen, short);
        assert_eq!((seen, health.failing_names().as_str()), (2, "reads and writes"));
        let waiter = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| tracker.wait_change(seen, Duration::from_secs(30)));
            std::thread::sleep(short);
            tracker.cleared(BackingOp::Read, false);
            waiter.join().expect("the watcher")
        });
        assert_eq!((waiter.0, waiter.1.failing_names().as_str()), (3, "writes"));
        tracker.cleared(BackingOp::Write, false);
        assert_eq!(tracker.wait_change(3, short), (4, BackingHealth::default()));
    }
}
