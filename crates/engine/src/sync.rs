//! The engine's atomics and locks, routed through `shuttle` when the `shuttle` feature is on so
//! that the concurrency tests explore interleavings of the production code.

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

use std::sync::TryLockError;
pub(crate) use std::sync::atomic::{Ordering, fence};

/// Locks `mutex`. A poisoned lock aborts the process: a thread panicked while holding it, so
/// what it protects may be half changed (`crate::abort`).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|_| crate::abort::poisoned())
}

/// Locks `mutex` if no one holds it; aborts the process if it is poisoned, as [`lock`].
pub(crate) fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::WouldBlock) => None,
        Err(TryLockError::Poisoned(_)) => crate::abort::poisoned(),
    }
}

/// Waits on `condvar` for up to `timeout`, as `Condvar::wait_timeout`; aborts the process if
/// the lock is poisoned, as [`lock`].
pub(crate) fn wait_timeout<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: std::time::Duration,
) -> MutexGuard<'a, T> {
    condvar.wait_timeout(guard, timeout).map_or_else(|_| crate::abort::poisoned(), |(g, _)| g)
}

/// Lets other threads run (a scheduling point under shuttle).
pub(crate) fn yield_now() {
    #[cfg(feature = "shuttle")]
    shuttle::thread::yield_now();
    #[cfg(not(feature = "shuttle"))]
    std::thread::yield_now();
}

/// A fixed array of atomics for the engine's DRAM tables: zeroed, in huge pages where the
/// kernel gives them (see `pmcache_media::DramTable`); a plain boxed slice under shuttle.
#[cfg(not(feature = "shuttle"))]
pub(crate) type Table<T> = pmcache_media::DramTable<T>;
#[cfg(feature = "shuttle")]
pub(crate) type Table<T> = Box<[T]>;

/// `len` atomics, each zero.
#[cfg(not(feature = "shuttle"))]
pub(crate) fn zeroed_table<T: pmcache_media::ZeroValid>(
    len: usize,
) -> crate::error::Result<Table<T>> {
    Ok(pmcache_media::DramTable::zeroed(len)?)
}

/// `len` atomics, each zero.
#[cfg(feature = "shuttle")]
pub(crate) fn zeroed_table<T: ZeroedAtomic>(len: usize) -> crate::error::Result<Table<T>> {
    Ok((0..len).map(|_| T::zero()).collect())
}

/// Atomics a shuttle table can hold.
#[cfg(feature = "shuttle")]
pub(crate) trait ZeroedAtomic {
    fn zero() -> Self;
}
#[cfg(feature = "shuttle")]
impl ZeroedAtomic for AtomicU64 {
    fn zero() -> Self {
        AtomicU64::new(0)
    }
}
#[cfg(feature = "shuttle")]
impl ZeroedAtomic for AtomicU32 {
    fn zero() -> Self {
        AtomicU32::new(0)
    }
}
#[cfg(feature = "shuttle")]
impl<T: ZeroedAtomic, const N: usize> ZeroedAtomic for [T; N] {
    fn zero() -> Self {
        std::array::from_fn(|_| T::zero())
    }
}
