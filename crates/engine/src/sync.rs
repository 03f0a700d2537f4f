//! The engine's atomics and locks, routed through `shuttle` when the `shuttle` feature is on so
//! that the concurrency tests explore interleavings of the production code.

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::{Mutex, MutexGuard};

#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::{Mutex, MutexGuard};

pub(crate) use std::sync::atomic::{Ordering, fence};

/// Locks `mutex`, ignoring poisoning: the engine's critical sections keep their invariants
/// with `assert!`, so a panic elsewhere does not leave the protected data inconsistent.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Lets other threads run (a scheduling point under shuttle).
pub(crate) fn yield_now() {
    #[cfg(feature = "shuttle")]
    shuttle::thread::yield_now();
    #[cfg(not(feature = "shuttle"))]
    std::thread::yield_now();
}
