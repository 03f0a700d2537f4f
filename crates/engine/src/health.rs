//! The backing store's health as the engine has seen it: whether its last operations failed,
//! and how (out of reach, or refusing), for `stats` and for an operator watching a cache whose
//! backing store is a network service.
//!
//! A failure is recorded where it is counted (`backing_failed`, a cold path); success clears
//! it where the engine completes backing-store work anyway (a read from the store, a sync, a
//! write-back batch), behind one relaxed load of a flag that is false while all is well.

use std::time::Instant;

use pmcache_backing::BackingError;

use crate::sync::{AtomicBool, Mutex, Ordering, lock};

/// What the last backing-store operations did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackingState {
    /// The last one succeeded (or none failed yet).
    #[default]
    Ok,
    /// The last one failed: the store answered with an error.
    Failing,
    /// The last one failed because the store could not be reached (timed out, connection
    /// lost): a network store or its servers are down.
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

/// The backing store's health, as `Engine::stats` reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BackingHealth {
    /// The state.
    pub state: BackingState,
    /// The last failure's message, while the state is not `Ok`.
    pub last_error: Option<String>,
    /// For how long operations have been failing, in milliseconds (0 while `Ok`).
    pub failing_ms: u64,
}

#[derive(Debug, Default)]
struct Failure {
    state: BackingState,
    message: String,
    since: Option<Instant>,
}

/// The engine's record (see the module).
#[derive(Debug)]
pub(crate) struct HealthTracker {
    failing: AtomicBool,
    failure: Mutex<Failure>,
}

impl HealthTracker {
    pub(crate) fn new() -> Self {
        Self { failing: AtomicBool::new(false), failure: Mutex::new(Failure::default()) }
    }

    /// Records a failed operation.
    pub(crate) fn failed(&self, error: &BackingError) {
        let mut failure = lock(&self.failure);
        failure.state =
            if error.is_unreachable() { BackingState::Unreachable } else { BackingState::Failing };
        failure.message = error.to_string();
        failure.since.get_or_insert_with(Instant::now);
        self.failing.store(true, Ordering::Release);
    }

    /// Records a successful operation.
    #[inline]
    pub(crate) fn succeeded(&self) {
        if self.failing.load(Ordering::Relaxed) {
            let mut failure = lock(&self.failure);
            *failure = Failure::default();
            self.failing.store(false, Ordering::Release);
        }
    }

    /// The health now.
    pub(crate) fn health(&self) -> BackingHealth {
        let failure = lock(&self.failure);
        match failure.state {
            BackingState::Ok => BackingHealth::default(),
            state => BackingHealth {
                state,
                last_error: Some(failure.message.clone()),
                failing_ms: failure.since.map_or(0, |t| t.elapsed().as_millis() as u64),
            },
        }
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    fn error(errno: i32) -> BackingError {
        BackingError::Io {
            op: "write",
            offset: 4096,
            len: 4096,
            source: std::io::Error::from_raw_os_error(errno),
        }
    }

    /// A timeout reads as unreachable, another error as failing, each with its message and
    /// the time since the first failure; a success clears it all.
    #[test]
    fn failures_are_told_apart_and_cleared_by_a_success() {
        let tracker = HealthTracker::new();
        assert_eq!(tracker.health(), BackingHealth::default());
        tracker.failed(&error(libc::EIO));
        let health = tracker.health();
        assert_eq!(health.state, BackingState::Failing);
        assert!(health.last_error.as_deref().is_some_and(|m| m.contains("write at byte 4096")));
        std::thread::sleep(std::time::Duration::from_millis(20));
        tracker.failed(&error(libc::ETIMEDOUT));
        let health = tracker.health();
        assert_eq!(health.state.name(), "unreachable");
        assert!(health.failing_ms >= 20, "counted from the first failure: {health:?}");
        tracker.succeeded();
        assert_eq!(tracker.health(), BackingHealth::default());
    }
}
