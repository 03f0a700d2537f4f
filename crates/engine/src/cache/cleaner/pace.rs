//! Writers' pacing above the throttle threshold (`CleanerConfig::throttle_pct`): a shared
//! schedule of turns, one per block written, spaced at a pace that falls linearly with the
//! clean share left, from the cleaner's measured write-back rate at the threshold to a
//! twentieth of it at 100 % dirty. A turn is a block the write makes dirty: an overwrite of
//! a block that is dirty already adds nothing for the cleaner to write back, and takes none.
//!
//! The cleaner sets the rate and the threshold at each turn of its loop. The pace itself is
//! refreshed from the dirty level by the writers too, at most once per `REFRESH_NS`: a
//! cleaner waiting on a slow flush does not turn its loop, and a pace set before the wait
//! would let writers spend the clean slots left at the old rate, then stall on the flush.
//! Following the dirty level, the pace slows as the reserve shrinks, so that a stall is what
//! the pacing could not absorb rather than the length of a sync.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::sync::AtomicU64;

/// Longest a paced writer waits for its turn (a debt beyond it is forgiven: stalls bound the
/// rest), in nanoseconds.
const WAIT_MAX_NS: u64 = 50_000_000;
/// Waits shorter than this are not slept (the sleep itself costs about as much): the debt
/// stays in the schedule and a later write waits for it.
const SLEEP_MIN_NS: u64 = 20_000;
/// Least time between two refreshes of the pace from the dirty level by writers.
const REFRESH_NS: u64 = 1_000_000;
/// The slowest pace, as a share of the write-back rate (at 100 % dirty).
const SCALE_MIN: f64 = 0.05;

/// The pacing state shared by the cleaner and the writers.
pub(super) struct Pace {
    /// Nanoseconds per block at the throttle threshold, `1e9 / write-back rate` (0: writers
    /// are not paced).
    base_ns_per_block: AtomicU64,
    /// The dirty share where pacing starts, in millionths.
    start_ppm: AtomicU64,
    /// Nanoseconds of schedule per block now (0: not paced now).
    ns_per_block: AtomicU64,
    /// The schedule's next free turn, and the last refresh of `ns_per_block`, in nanoseconds
    /// since `epoch`.
    next_ns: AtomicU64,
    refreshed_ns: AtomicU64,
    epoch: Instant,
    throttled_writes: AtomicU64,
    throttle_ns_total: AtomicU64,
}

/// Nanoseconds per block at `share` dirty: none below `start`; above it, the rate (as
/// `base_ns_per_block`) scaled down linearly with the clean share left.
fn ns_per_block_at(base_ns_per_block: u64, start: f64, share: f64) -> u64 {
    if base_ns_per_block == 0 || share < start {
        return 0;
    }
    let scale = ((1.0 - share) / (1.0 - start).max(1e-6)).clamp(SCALE_MIN, 1.0);
    ((base_ns_per_block as f64 / scale) as u64).max(1)
}

impl Pace {
    pub(super) fn new() -> Self {
        Self {
            base_ns_per_block: AtomicU64::new(0),
            start_ppm: AtomicU64::new(0),
            ns_per_block: AtomicU64::new(0),
            next_ns: AtomicU64::new(0),
            refreshed_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            throttled_writes: AtomicU64::new(0),
            throttle_ns_total: AtomicU64::new(0),
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Paces writers from the threshold `start` (a dirty share) at `rate_blocks_per_s`
    /// (0: not at all), with `share` dirty now.
    pub(super) fn set(&self, rate_blocks_per_s: f64, start: f64, share: f64) {
        let base =
            if rate_blocks_per_s > 0.0 { (1e9 / rate_blocks_per_s).max(1.0) as u64 } else { 0 };
        self.start_ppm.store((start * 1e6) as u64, Ordering::Relaxed);
        self.base_ns_per_block.store(base, Ordering::Relaxed);
        self.ns_per_block.store(ns_per_block_at(base, start, share), Ordering::Relaxed);
        self.refreshed_ns.store(self.now_ns(), Ordering::Relaxed);
    }

    /// Writers are not paced.
    pub(super) fn off(&self) {
        self.base_ns_per_block.store(0, Ordering::SeqCst);
        self.ns_per_block.store(0, Ordering::SeqCst);
    }

    /// Takes the next `blocks()` turns of the schedule and sleeps until the first; `share`
    /// gives the dirty share now when the pace is due for a refresh. `blocks` is asked only
    /// while writers are paced; none takes no turn. One relaxed load while pacing is off
    /// ([`Pace::off`]); that and the clock below the threshold.
    pub(super) fn take(&self, blocks: impl FnOnce() -> u64, share: impl FnOnce() -> f64) {
        let base = self.base_ns_per_block.load(Ordering::Relaxed);
        if base == 0 {
            return;
        }
        let now = self.now_ns();
        let refreshed = self.refreshed_ns.load(Ordering::Relaxed);
        let mut per_block = self.ns_per_block.load(Ordering::Relaxed);
        if now.saturating_sub(refreshed) >= REFRESH_NS
            && self
                .refreshed_ns
                .compare_exchange(refreshed, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let start = self.start_ppm.load(Ordering::Relaxed) as f64 / 1e6;
            per_block = ns_per_block_at(base, start, share());
            self.ns_per_block.store(per_block, Ordering::Relaxed);
        }
        if per_block == 0 {
            return;
        }
        let blocks = blocks();
        if blocks == 0 {
            return;
        }
        let cost = per_block.saturating_mul(blocks);
        let mut next = self.next_ns.load(Ordering::Relaxed);
        let start = loop {
            let start = next.clamp(now, now + WAIT_MAX_NS);
            match self.next_ns.compare_exchange_weak(
                next,
                start + cost,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break start,
                Err(seen) => next = seen,
            }
        };
        let wait_ns = start - now;
        if wait_ns >= SLEEP_MIN_NS {
            std::thread::sleep(Duration::from_nanos(wait_ns));
            self.throttled_writes.fetch_add(1, Ordering::Relaxed);
            self.throttle_ns_total.fetch_add(wait_ns, Ordering::Relaxed);
        }
    }

    /// The pace now in blocks per second (0: not paced), the writes that waited for their
    /// turn and their total wait in nanoseconds.
    pub(super) fn figures(&self) -> (f64, u64, u64) {
        let per_block = self.ns_per_block.load(Ordering::Relaxed);
        (
            if per_block == 0 { 0.0 } else { 1e9 / per_block as f64 },
            self.throttled_writes.load(Ordering::Relaxed),
            self.throttle_ns_total.load(Ordering::Relaxed),
        )
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    #[test]
    fn the_pace_falls_linearly_with_the_clean_share_to_a_floor() {
        // 100 K blocks/s from 80 % dirty.
        let base = 10_000;
        assert_eq!(ns_per_block_at(base, 0.8, 0.79), 0, "below the threshold");
        assert_eq!(ns_per_block_at(0, 0.8, 0.95), 0, "no rate measured");
        assert_eq!(ns_per_block_at(base, 0.8, 0.8), 10_000, "the rate at the threshold");
        assert_eq!(ns_per_block_at(base, 0.8, 0.9), 20_000, "half the rate halfway");
        assert_eq!(ns_per_block_at(base, 0.8, 1.0), 200_000, "a twentieth when full");
    }

    #[test]
    fn writers_refresh_the_pace_from_the_dirty_level() {
        let pace = Pace::new();
        pace.set(100_000.0, 0.8, 0.8);
        assert_eq!(pace.figures().0.round(), 100_000.0);
        std::thread::sleep(Duration::from_nanos(REFRESH_NS));
        pace.take(|| 1, || 0.9);
        assert_eq!(pace.figures().0.round(), 50_000.0, "refreshed at 90 % dirty");
        pace.off();
        pace.take(|| panic!("asked while off"), || panic!("asked while off"));
        assert_eq!(pace.figures().0, 0.0);
    }
}
