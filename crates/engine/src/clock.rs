//! Time as a parameter: the engine asks a [`Clock`], so tests can use a fake one.

use std::time::Instant;

/// A monotonic clock.
pub trait Clock: Send + Sync {
    /// Nanoseconds since an arbitrary, fixed origin.
    fn now_ns(&self) -> u64;
}

/// The system's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self { origin: Instant::now() }
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ns: std::sync::atomic::AtomicU64,
}

impl ManualClock {
    /// Moves time forward.
    pub fn advance_ns(&self, ns: u64) {
        self.now_ns.fetch_add(ns, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now_ns.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }
}
