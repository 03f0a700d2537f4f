//! Stackable wrappers over any [`BackingStore`] for tests and experiments: added latency
//! ([`LatencyStore`], to emulate an HDD or a slower SSD on a fast file), a throughput/IOPS
//! throttle ([`ThrottleStore`]) and fault injection ([`FaultStore`]: errors on the N-th I/O, on
//! an address range or with a probability; torn/short transfers).
//!
//! They wrap the synchronous interface, which is what the cache engine drives. Their
//! [`BackingStore::open_queue`] is the default (refused); for a queue over a wrapped store use
//! [`crate::SyncQueue`]. Randomness comes from a seed given at construction, so a failing test
//! replays.

mod fault;
mod latency;
mod throttle;

pub use fault::{FaultAction, FaultRule, FaultStore, FaultTrigger};
pub use latency::{LatencyDist, LatencyStore};
pub use throttle::ThrottleStore;

#[cfg(doc)]
use crate::BackingStore;

/// Which operations a wrapper acts on (a bit set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpMask(u8);

impl OpMask {
    /// Reads.
    pub const READ: OpMask = OpMask(1);
    /// Writes.
    pub const WRITE: OpMask = OpMask(2);
    /// Flushes.
    pub const FLUSH: OpMask = OpMask(4);
    /// Discards and write-zeroes.
    pub const DISCARD: OpMask = OpMask(8);
    /// Reads and writes.
    pub const DATA: OpMask = OpMask(1 | 2);
    /// Everything.
    pub const ALL: OpMask = OpMask(1 | 2 | 4 | 8);

    /// Whether `self` includes every operation in `other`.
    pub fn contains(self, other: OpMask) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for OpMask {
    type Output = OpMask;
    fn bitor(self, rhs: OpMask) -> OpMask {
        OpMask(self.0 | rhs.0)
    }
}

/// Waits until `deadline`: sleeps for most of the time, then spins for the last stretch so
/// microsecond latencies are honoured (the scheduler's sleep granularity is ~50-100 µs).
pub(crate) fn wait_until(deadline: std::time::Instant) {
    const SPIN: std::time::Duration = std::time::Duration::from_micros(150);
    loop {
        let now = std::time::Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > SPIN {
            std::thread::sleep(left - SPIN);
        } else {
            std::hint::spin_loop();
        }
    }
}
