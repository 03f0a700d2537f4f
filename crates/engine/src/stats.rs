//! Statistics: per-lane counters written only by their lane (plain load + store, no locked
//! instructions on the hot path) and summed when read.

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Counters of one lane.
        #[derive(Default)]
        pub(crate) struct LaneCounters { $(pub(crate) $name: AtomicU64,)* }

        /// Engine statistics, summed over lanes.
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct Stats {
            $($(#[$doc])* pub $name: u64,)*
            /// Slots holding dirty blocks.
            pub dirty_slots: u64,
            /// Slots in the cache.
            pub slot_count: u64,
            /// Cache block size in bytes.
            pub block_size: u32,
            /// DRAM bytes the engine uses per slot (slot table + index + fixed tables).
            pub dram_bytes_per_slot: f64,
            /// Slots no longer used: their data lies on poisoned lines of the medium.
            pub retired_slots: u64,
            /// Backing-store operations that failed (reads, writes, write-backs, flushes,
            /// discards): each reached its caller as an error, or left its block dirty.
            pub backing_errors: u64,
            /// The backing store's health: the last operations' outcome.
            pub backing: crate::BackingHealth,
            /// The background cleaner's figures.
            pub cleaner: crate::cleaner_policy::CleanerStats,
        }

        impl LaneCounters {
            pub(crate) fn add_to(&self, stats: &mut Stats) {
                // Wrapping: `dirty_delta` counts down as well as up (a lane's share may be
                // "negative"), so the sum of the lanes' shares wraps by design.
                $(stats.$name = stats.$name.wrapping_add(self.$name.load(Ordering::Relaxed));)*
            }
        }

        impl Stats {
            /// `(name, value)` pairs of every counter, for tables and exporters.
            pub fn counters(&self) -> Vec<(&'static str, u64)> {
                let all = [$((stringify!($name), self.$name),)* ("dirty_slots", self.dirty_slots), ("slot_count", self.slot_count), ("backing_errors", self.backing_errors), ("retired_slots", self.retired_slots)];
                // `dirty_delta` is bookkeeping behind `dirty_slots`, not a figure.
                all.into_iter().filter(|(name, _)| *name != "dirty_delta").collect()
            }
        }
    };
}

counters! {
    /// Blocks read from the cache.
    read_hits,
    /// Blocks read from the backing store and admitted.
    read_misses_admitted,
    /// Blocks read from the backing store and not admitted: the mode does not admit reads, or
    /// the admission policy (n-hit) said no.
    read_misses_bypassed,
    /// Blocks read from the backing store and not admitted: beyond the sequential cutoff.
    read_misses_sequential,
    /// Of `read_misses_bypassed`, those the n-hit policy judged cold (missed too few times
    /// yet to be admitted).
    read_misses_cold,
    /// Lock-free read attempts that saw a slot change under them and retried.
    read_retries,
    /// Blocks written.
    writes,
    /// Blocks written that were already cached (overwritten out of place).
    write_hits,
    /// Blocks written by group commits (`Lane::write_batch`: writes a frontend had in flight
    /// together, sharing their fences); also counted in `writes`.
    group_writes,
    /// Times a group-commit write found its stripe held by another lane and was put off to a
    /// later round of its group (a measure of write contention).
    group_stripe_waits,
    /// Blocks trimmed.
    trims,
    /// Bytes returned to readers.
    bytes_read,
    /// Bytes accepted from writers.
    bytes_written,
    /// Flush requests.
    flushes,
    /// Clean blocks evicted.
    evictions,
    /// Dirty blocks written back.
    writebacks,
    /// Times a block new to the cache found all three of its candidate index buckets full
    /// (counted once per try: a try that waits for a busy occupant's stripe counts again).
    index_conflicts,
    /// Cached blocks whose data did not match its checksum when read (a cache formatted with
    /// `--data-crc`).
    data_crc_mismatches,
    /// Cached blocks that could not be read: their data lies on a poisoned line.
    medium_read_errors,
    /// Of the blocks that failed a checksum or a read, the clean ones: dropped from the cache
    /// and read from the backing store instead.
    unreadable_clean,
    /// Of the blocks that failed a checksum or a read, the dirty ones: the request got an
    /// error (never other data), and the block stays dirty, not written back.
    unreadable_dirty,
    /// Writes and admissions whose stores went to a range of the medium lost while they ran
    /// (`cache/checked.rs`): each write ran again in another slot, each admission was not
    /// made.
    unlanded_stores,
    /// Dirty-slot increments minus decrements made by this lane (wrapping).
    dirty_delta,
}

/// A lane's counters on their own cache line.
pub(crate) type PaddedCounters = CachePadded<LaneCounters>;

/// Adds `n` to a counter only this lane writes.
pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}
