//! The cleaner's policy: its settings, the order it writes dirty blocks back in, its rate
//! controller and its thread priority, and what it reports. The mechanism that runs them on
//! the engine's internals — the thread's loop, its batches, its pacing of writers — is
//! `cache/cleaner/`; the write-back a writer or a flush does inline is
//! `cache/inline_writeback.rs`.

pub mod config;
pub mod policy;
pub mod priority;
pub mod rate;

pub use config::{Adaptive, CLEANER_KEYS, CleanerConfig, DirtyThresholds, WriteBackOrder};
pub use policy::{Candidate, LbaSorted, NoWriteBack, OldestFirst, WriteBackPolicy};
pub use rate::{RateController, RateTerms};

/// Stall times are counted in buckets of powers of two microseconds: bucket `i` holds stalls
/// of `[2^i, 2^(i+1))` µs (bucket 0 also those under 1 µs), the last one everything longer.
pub const STALL_BUCKETS: usize = 32;

/// What the cleaner reports, in `Stats::cleaner`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CleanerStats {
    /// Whether a cleaner thread runs.
    pub running: bool,
    /// Write-back order in force (`lba`, `oldest`, `none`).
    pub order: &'static str,
    /// `off`, `boost` or `boost-pid`.
    pub adaptive: &'static str,
    /// What the cleaner does now: `resting`, `rate` (PID), `idle` (foreground quiet),
    /// `full` (above the high watermark or writers stalled), `failing` (backing errors),
    /// `stopped`.
    pub phase: &'static str,
    /// Target dirty blocks.
    pub target_blocks: u64,
    /// Dirty blocks at which full speed starts and stops.
    pub high_blocks: u64,
    /// See `high_blocks`.
    pub low_blocks: u64,
    /// The rate controller's last step (blocks per second; zero outside `rate`).
    pub rate: RateTerms,
    /// Batches written back (one `fdatasync` each).
    pub batches: u64,
    /// Blocks written back and marked clean.
    pub blocks_cleaned: u64,
    /// Backing writes issued (adjacent blocks merged into one).
    pub writes_issued: u64,
    /// Blocks copied for write-back that an overwrite made stale before they could be marked
    /// clean (they stay dirty with the newer data).
    pub blocks_superseded: u64,
    /// Blocks evicted as soon as they were clean, their slots handed to writers stalled for
    /// one.
    pub blocks_evicted_for_writers: u64,
    /// Backing writes or syncs that failed.
    pub errors: u64,
    /// Times the cleaner's priority was raised, and nanoseconds spent raised.
    pub boosts: u64,
    /// See `boosts`.
    pub boosted_ns: u64,
    /// Whether it is raised now.
    pub boosted: bool,
    /// Why priority is not adapted, when it cannot be (no CAP_SYS_NICE).
    pub priority_note: Option<String>,
    /// Writes that found no free or clean slot and waited for the cleaner (paper 002's
    /// failed insertions).
    pub stalls: u64,
    /// Their total waiting time, nanoseconds.
    pub stall_ns_total: u64,
    /// The longest, nanoseconds.
    pub stall_ns_max: u64,
    /// Stalls by duration, `STALL_BUCKETS` power-of-two microsecond buckets.
    pub stall_histogram: Vec<u64>,
    /// Stalls that ended in an error because the cleaner made no progress in time.
    pub stall_timeouts: u64,
    /// Writes that fell back to writing back inline (no cleaner, or a failing one).
    pub inline_fallbacks: u64,
    /// The pace writers are held to (blocks per second; 0: not paced), and the writes that
    /// waited for their turn and how long in all (`CleanerConfig::throttle_pct`).
    pub pace_blocks_per_s: f64,
    /// See `pace_blocks_per_s`.
    pub throttled_writes: u64,
    /// See `pace_blocks_per_s`.
    pub throttle_ns_total: u64,
}

impl CleanerStats {
    /// The stall time below which `q` (0..=1) of the stalls fall, in nanoseconds: the upper
    /// bound of the histogram bucket that holds that quantile; 0 without stalls.
    pub fn stall_ns_quantile(&self, q: f64) -> u64 {
        let total: u64 = self.stall_histogram.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (bucket, &n) in self.stall_histogram.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return (1u64 << (bucket + 1)).saturating_mul(1000).min(self.stall_ns_max.max(1));
            }
        }
        self.stall_ns_max
    }
}

/// The histogram bucket of a stall of `ns` nanoseconds.
pub fn stall_bucket(ns: u64) -> usize {
    let us = ns / 1000;
    if us == 0 { 0 } else { (us.ilog2() as usize).min(STALL_BUCKETS - 1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stall_quantiles_come_from_the_buckets() {
        assert_eq!((stall_bucket(0), stall_bucket(999), stall_bucket(1000)), (0, 0, 0));
        assert_eq!((stall_bucket(2000), stall_bucket(1 << 40)), (1, 30));
        let mut stats =
            CleanerStats { stall_histogram: vec![0; STALL_BUCKETS], ..Default::default() };
        assert_eq!(stats.stall_ns_quantile(0.99), 0);
        for ns in [500, 1500, 3000, 3000, 100_000] {
            stats.stall_histogram[stall_bucket(ns)] += 1;
            stats.stall_ns_max = stats.stall_ns_max.max(ns);
        }
        assert_eq!(stats.stall_ns_quantile(0.5), 4000, "the median is in [2, 4) µs");
        assert_eq!(stats.stall_ns_quantile(0.99), 100_000, "capped by the longest");
    }
}
