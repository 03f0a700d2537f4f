//! The DRAM index from backing block to slot: lock-free lookups, updates under the block's
//! stripe lock, fixed capacity.
//!
//! Layout: buckets of eight 8-byte entries (one cache line). A block number is mixed by a
//! bijection on 40 bits into `h`; its three candidate buckets are `b1 = h % buckets` and two
//! more derived from `b1` and `tag = h / buckets`. An entry stores `tag`, which of the three
//! buckets it is in, and the slot — so bucket and entry together *are* the block number, and no
//! block number is kept per slot in DRAM. Inserts go to the emptiest candidate ("d choices",
//! d = 3: the fullest bucket stays within about ln ln n / ln 3 of the mean), which keeps
//! overflow negligible at the 75 % load the table is sized for; when all three are full the
//! caller evicts one of their blocks.
//!
//! Entries never move: an insert fills an empty entry, an overwrite replaces the slot in place
//! with one compare-and-swap, a removal empties it. A reader therefore never misses a block
//! that is present for the whole duration of its lookup.

use strength_reduce::StrengthReducedU64;

use crate::error::Result;
use crate::sync::{AtomicU64, Ordering, Table, zeroed_table};

const WAYS: usize = 8;
/// An empty entry. Real entries never are zero: their choice field is 1..=3.
const EMPTY: u64 = 0;
const LBA_MASK: u64 = (1 << 40) - 1;
/// Fraction of index entries in use when the cache is full.
const LOAD_FACTOR: f64 = 0.75;
const MIN_BUCKETS: u64 = 1024;
const CHOICES: usize = 3;

/// Where a block's entry was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) slot: u32,
    bucket: usize,
    way: usize,
    value: u64,
}

/// Every candidate bucket is full: these slots occupy them.
pub(crate) struct IndexFull {
    pub(crate) occupants: Vec<u32>,
}

#[derive(Clone, Copy)]
struct Key {
    buckets: [usize; CHOICES],
    tag: u64,
}

impl Key {
    fn entry(&self, choice: usize, slot: u32) -> u64 {
        (self.tag << 34) | (choice as u64 + 1) << 32 | u64::from(slot)
    }
    fn matches(&self, choice: usize, value: u64) -> bool {
        value >> 32 == (self.tag << 2 | (choice as u64 + 1))
    }
}

/// A bijection on 40-bit integers that spreads consecutive block numbers.
fn mix40(lba: u64) -> u64 {
    let mut x = lba & LBA_MASK;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15 | 1) & LBA_MASK;
    x ^= x >> 20;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9 | 1) & LBA_MASK;
    x ^= x >> 19;
    x
}

pub(crate) struct Index {
    /// `WAYS` entries per bucket, bucket after bucket; a bucket is one cache line (the table
    /// starts on a page boundary).
    words: Table<AtomicU64>,
    /// The bucket count and the bucket count less one, as fast divisors.
    bucket_count: StrengthReducedU64,
    bucket_count_less_one: StrengthReducedU64,
}

impl Index {
    /// An empty index for `slot_count` slots.
    pub(crate) fn new(slot_count: u32) -> Result<Self> {
        let wanted = (f64::from(slot_count) / (WAYS as f64 * LOAD_FACTOR)).ceil() as u64;
        let count = wanted.max(MIN_BUCKETS) as usize;
        Ok(Self {
            words: zeroed_table(count * WAYS)?,
            bucket_count: StrengthReducedU64::new(count as u64),
            bucket_count_less_one: StrengthReducedU64::new(count as u64 - 1),
        })
    }

    /// DRAM bytes used.
    pub(crate) fn bytes(&self) -> usize {
        self.words.len() * std::mem::size_of::<AtomicU64>()
    }

    fn bucket(&self, bucket: usize) -> &[AtomicU64; WAYS] {
        self.words[bucket * WAYS..][..WAYS].try_into().expect("a bucket is WAYS entries")
    }

    #[inline]
    fn key(&self, lba: u64) -> Key {
        assert!(lba <= LBA_MASK, "block {lba} exceeds 40 bits");
        let n = (self.words.len() / WAYS) as u64;
        let h = mix40(lba);
        let (tag, b1) = StrengthReducedU64::div_rem(h, self.bucket_count);
        // tag < 2^40 / 1024 = 2^30: with 2 choice bits (1..=3, never 0) and 32 slot bits it
        // fills 64 bits and never equals EMPTY.
        let step = 1 + tag % self.bucket_count_less_one;
        // b1 < n and step < n: reduce by subtraction, not division.
        let wrap = |x: u64| if x >= n { x - n } else { x };
        let b2 = wrap(b1 + step);
        let b3 = wrap(wrap(b2 + step) + 1);
        Key { buckets: [b1 as usize, b2 as usize, b3 as usize], tag }
    }

    /// The candidate buckets of `lba` (tests build colliding block sets with it).
    #[cfg(all(test, not(feature = "shuttle")))]
    pub(crate) fn candidate_buckets(&self, lba: u64) -> [usize; CHOICES] {
        self.key(lba).buckets
    }

    /// Starts loading `lba`'s candidate buckets into the CPU cache (a hint; see `lookup`).
    #[inline]
    pub(crate) fn prefetch(&self, lba: u64) {
        for bucket in self.key(lba).buckets {
            pmcache_media::prefetch(&self.bucket(bucket)[0] as *const AtomicU64);
        }
    }

    /// Finds the slot holding `lba`, without locks.
    #[inline]
    pub(crate) fn lookup(&self, lba: u64) -> Option<Found> {
        let key = self.key(lba);
        // Touch every candidate bucket before scanning any, so their cache misses overlap
        // instead of queueing behind one another.
        let heads = key.buckets.map(|b| self.bucket(b)[0].load(Ordering::Relaxed));
        std::hint::black_box(heads);
        for (choice, &bucket) in key.buckets.iter().enumerate() {
            for (way, entry) in self.bucket(bucket).iter().enumerate() {
                let value = entry.load(Ordering::Acquire);
                if key.matches(choice, value) {
                    return Some(Found { slot: value as u32, bucket, way, value });
                }
            }
        }
        None
    }

    /// Whether the entry found earlier is still in place, unchanged.
    #[inline]
    pub(crate) fn still_holds(&self, found: &Found) -> bool {
        self.bucket(found.bucket)[found.way].load(Ordering::Acquire) == found.value
    }

    /// Adds `lba -> slot`. The caller holds `lba`'s stripe lock and `lba` is not present.
    pub(crate) fn insert(&self, lba: u64, slot: u32) -> std::result::Result<(), IndexFull> {
        let key = self.key(lba);
        loop {
            let used = key.buckets.map(|b| {
                self.bucket(b).iter().filter(|e| e.load(Ordering::Relaxed) != EMPTY).count()
            });
            if used.iter().all(|&u| u == WAYS) {
                let occupants = key
                    .buckets
                    .iter()
                    .flat_map(|&b| self.bucket(b).iter())
                    .map(|e| e.load(Ordering::Acquire))
                    .filter(|&v| v != EMPTY)
                    .map(|v| v as u32)
                    .collect();
                return Err(IndexFull { occupants });
            }
            let choice = (0..CHOICES).min_by_key(|&c| used[c]).expect("choices");
            for entry in self.bucket(key.buckets[choice]) {
                if entry
                    .compare_exchange(
                        EMPTY,
                        key.entry(choice, slot),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    return Ok(());
                }
            }
            // Another block took the last empty entry meanwhile: look again.
        }
    }

    /// Replaces the slot of a present entry in one atomic store. The caller holds the block's
    /// stripe lock, and only holders of that lock write an entry holding the block, so no
    /// compare-and-swap (a locked instruction, which would wait for outstanding persists) is
    /// needed; inserts of other blocks only ever claim *empty* entries.
    pub(crate) fn replace(&self, found: &Found, new_slot: u32) {
        self.store_over(found, (found.value & !0xffff_ffff) | u64::from(new_slot));
    }

    /// Removes a present entry. The caller holds the stripe (see `replace`).
    pub(crate) fn remove(&self, found: &Found) {
        self.store_over(found, EMPTY);
    }

    fn store_over(&self, found: &Found, value: u64) {
        let entry = &self.bucket(found.bucket)[found.way];
        assert_eq!(
            entry.load(Ordering::Relaxed),
            found.value,
            "index entry changed under its stripe lock"
        );
        entry.store(value, Ordering::Release);
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn mix40_is_a_bijection_on_a_sample() {
        let mut seen = std::collections::HashSet::new();
        let lbas: std::collections::BTreeSet<u64> =
            (0..1u64 << 40).step_by((1 << 40) / 200_003).chain(0..100_000).collect();
        for &lba in &lbas {
            assert!(seen.insert(mix40(lba)), "collision at {lba}");
        }
    }

    fn fill(slots: u32, mut next_lba: impl FnMut() -> u64) -> (Index, HashMap<u64, u32>, u32) {
        let index = Index::new(slots).unwrap();
        let mut present = HashMap::new();
        let mut overflows = 0;
        while present.len() < slots as usize {
            let lba = next_lba() & LBA_MASK;
            if present.contains_key(&lba) {
                continue;
            }
            let slot = present.len() as u32;
            match index.insert(lba, slot) {
                Ok(()) => {
                    present.insert(lba, slot);
                }
                Err(_) => overflows += 1,
            }
        }
        (index, present, overflows)
    }

    #[test]
    fn holds_a_full_cache_without_overflow() {
        let slots = 200_000u32;
        let mut sequential = 1_000_000u64;
        let (_, _, overflows) = fill(slots, || {
            sequential += 1;
            sequential
        });
        assert_eq!(overflows, 0, "sequential blocks overflowed the index");
        let mut rng = 0x1234_5678_u64;
        let (index, present, overflows) = fill(slots, || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        });
        assert_eq!(overflows, 0, "random blocks overflowed the index");
        for (&lba, &slot) in &present {
            assert_eq!(index.lookup(lba).map(|f| f.slot), Some(slot));
        }
        assert!(index.bytes() as f64 / f64::from(slots) <= 11.0, "{} B/slot", index.bytes());
        // Replace and remove keep every other block findable.
        let (&lba, &slot) = present.iter().next().unwrap();
        let found = index.lookup(lba).unwrap();
        index.replace(&found, slot + 1_000_000);
        assert_eq!(index.lookup(lba).unwrap().slot, slot + 1_000_000);
        index.remove(&index.lookup(lba).unwrap());
        assert!(index.lookup(lba).is_none());
        assert!(present.keys().filter(|&&l| l != lba).all(|&l| index.lookup(l).is_some()));
    }
}
