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
//! An entry also carries what a lock-free reader needs, so that a read hit touches no other
//! DRAM line: the low bits of the slot's generation (an entry that comes back with the same
//! slot after the slot was recycled differs in them), a *hidden* flag (inserted, but the slot's
//! data and metadata entry are not durable yet: readers take the locked path) and the CLOCK
//! reference bit (set by readers, cleared by the sweeping hand; not part of the entry's
//! identity). From the least significant bit:
//!
//! ```text
//! | slot: slot_bits | ref: 1 | hidden: 1 | generation: generation_bits | choice: 2 | tag |
//! ```
//!
//! `slot_bits` holds the slot count, the tag's width follows from the bucket count (a 40-bit
//! `h` divided by it), and the generation takes the rest: at least [`GENERATION_BITS_MIN`].
//!
//! Entries never move: an insert fills an empty entry, an overwrite replaces the slot in place
//! with one store, a removal empties it. A reader therefore never misses a block that is
//! present for the whole duration of its lookup.

use strength_reduce::StrengthReducedU64;

use crate::error::{Error, Result};
use crate::sync::{AtomicU64, Ordering, Table, zeroed_table};

const WAYS: usize = 8;
/// An empty entry. Real entries never are zero: their choice field is 1..=3.
const EMPTY: u64 = 0;
const LBA_BITS: u32 = 40;
const LBA_MASK: u64 = (1 << LBA_BITS) - 1;
/// Fraction of index entries in use when the cache is full.
const LOAD_FACTOR: f64 = 0.75;
const MIN_BUCKETS: u64 = 1024;
const CHOICES: usize = 3;
/// The fewest slot-generation bits an entry keeps, whatever the geometry (it keeps 17 or 18).
/// A reader's copy is wrongly accepted only if its slot was recycled a multiple of
/// 2^generation_bits times during the copy, back to the same block.
pub(crate) const GENERATION_BITS_MIN: u32 = 16;

/// Where a block's entry was found, and what it held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) slot: u32,
    /// Inserted, not yet revealed: the slot's data or entry may not be durable.
    pub(crate) hidden: bool,
    /// The CLOCK reference bit.
    pub(crate) referenced: bool,
    bucket: usize,
    way: usize,
    value: u64,
}

/// Every candidate bucket is full: these slots occupy them.
pub(crate) struct IndexFull {
    pub(crate) occupants: Vec<u32>,
}

/// Where a block's entry may be: its candidate buckets and its tag. Computing it mixes and
/// divides the block number; a request that needs it more than once keeps it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Key {
    buckets: [usize; CHOICES],
    tag: u64,
}

/// The bit layout of an entry (see the module docs).
#[derive(Clone, Copy)]
struct Layout {
    slot_bits: u32,
    generation_bits: u32,
    /// Ones from `identity_shift` up: a stored field, not a shift, so that the lookup's
    /// per-entry test stays one AND with a register (a shift by a variable count costs
    /// several micro-operations on x86 without BMI2).
    identity_mask: u64,
}

impl Layout {
    /// The layout for `slot_count` slots in `bucket_count` buckets, if there is at least one
    /// and its entries keep at least [`GENERATION_BITS_MIN`] generation bits (the fewer the
    /// buckets, the wider the tag).
    fn new(slot_count: u32, bucket_count: u64) -> Option<Self> {
        let bits = |max: u64| u64::BITS - max.leading_zeros();
        // Every slot number fits, with room to spare: `slot_count` itself fits.
        let slot_bits = bits(u64::from(slot_count)).max(1);
        let tag_bits = bits(LBA_MASK.checked_div(bucket_count)?);
        let generation_bits = (u64::BITS - tag_bits - 2 - 2).checked_sub(slot_bits)?;
        if generation_bits < GENERATION_BITS_MIN {
            return None;
        }
        let layout = Self { slot_bits, generation_bits, identity_mask: 0 };
        Some(Self { identity_mask: !0u64 << layout.identity_shift(), ..layout })
    }
    fn ref_bit(self) -> u64 {
        1 << self.slot_bits
    }
    fn hidden_bit(self) -> u64 {
        1 << (self.slot_bits + 1)
    }
    fn generation_shift(self) -> u32 {
        self.slot_bits + 2
    }
    fn identity_shift(self) -> u32 {
        self.generation_shift() + self.generation_bits
    }
    fn entry(self, key: &Key, choice: usize, slot: u32, generation: u32, hidden: bool) -> u64 {
        self.identity_bits(key, choice) | self.mapping(slot, generation, hidden)
    }
    /// The bits below the block's identity: slot, generation, hidden (the reference bit clear).
    fn mapping(self, slot: u32, generation: u32, hidden: bool) -> u64 {
        let generation = u64::from(generation) & ((1 << self.generation_bits) - 1);
        generation << self.generation_shift()
            | if hidden { self.hidden_bit() } else { 0 }
            | u64::from(slot)
    }
    /// The block's identity bits (tag and choice) in place, every bit below them clear.
    fn identity_bits(self, key: &Key, choice: usize) -> u64 {
        (key.tag << 2 | (choice as u64 + 1)) << self.identity_shift()
    }
    fn slot(self, value: u64) -> u32 {
        (value & ((1 << self.slot_bits) - 1)) as u32
    }
    /// The entry without its reference bit: what identifies one incarnation of the mapping.
    fn identity(self, value: u64) -> u64 {
        value & !self.ref_bit()
    }
}

/// Buckets for `slot_count` slots: a full cache fills [`LOAD_FACTOR`] of the entries.
fn bucket_count(slot_count: u32) -> u64 {
    let wanted = (f64::from(slot_count) / (WAYS as f64 * LOAD_FACTOR)).ceil() as u64;
    wanted.max(MIN_BUCKETS)
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

/// mix40's inverse, built step by step from its definition: undo each xor-shift, and multiply
/// by each odd multiplier's inverse modulo 2^40.
fn unmix40(h: u64) -> u64 {
    let unshift = |y: u64, s: u32| (0..LBA_BITS).step_by(s as usize).fold(0, |x, at| x ^ y >> at);
    let inverse =
        |c: u64| (0..6).fold(c, |i: u64, _| i.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(i))));
    let mut x = unshift(h, 19);
    x = x.wrapping_mul(inverse(0xBF58_476D_1CE4_E5B9)) & LBA_MASK;
    x = unshift(x, 20);
    x.wrapping_mul(inverse(0x9E37_79B9_7F4A_7C15)) & LBA_MASK
}

pub(crate) struct Index {
    /// The buckets, `WAYS` entries each; a bucket is one cache line (the table starts on a
    /// page boundary).
    buckets: Table<[AtomicU64; WAYS]>,
    /// The bucket count, as a fast divisor.
    bucket_count: StrengthReducedU64,
    layout: Layout,
}

impl Index {
    /// An empty index for `slot_count` slots, sized for them.
    #[cfg(all(test, not(feature = "shuttle")))]
    pub(crate) fn new(slot_count: u32) -> Result<Self> {
        Self::with_buckets(slot_count, None)
    }

    /// An empty index for `slot_count` slots in `buckets` buckets (`None`: sized for them; see
    /// `Config::index_buckets`).
    pub(crate) fn with_buckets(slot_count: u32, buckets: Option<u64>) -> Result<Self> {
        let count = buckets.unwrap_or_else(|| bucket_count(slot_count));
        let layout = Layout::new(slot_count, count).ok_or_else(|| {
            Error::Config(format!(
                "an index of {count} buckets is too small for {slot_count} slots (its entries \
                 would keep fewer than {GENERATION_BITS_MIN} slot-generation bits)"
            ))
        })?;
        Ok(Self {
            buckets: zeroed_table(count as usize)?,
            bucket_count: StrengthReducedU64::new(count),
            layout,
        })
    }

    /// DRAM bytes used.
    pub(crate) fn bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<[AtomicU64; WAYS]>()
    }

    /// Entries in use, hidden ones included (for `Engine::audit`).
    pub(crate) fn occupied(&self) -> usize {
        let buckets = self.buckets.iter();
        buckets.map(|b| b.iter().filter(|e| e.load(Ordering::Acquire) != EMPTY).count()).sum()
    }

    /// Slot-generation bits each entry keeps.
    #[cfg(all(test, not(feature = "shuttle")))]
    pub(crate) fn generation_bits(&self) -> u32 {
        self.layout.generation_bits
    }

    fn bucket(&self, bucket: usize) -> &[AtomicU64; WAYS] {
        &self.buckets[bucket]
    }

    /// `lba`'s candidate buckets and tag.
    #[inline]
    pub(crate) fn key(&self, lba: u64) -> Key {
        assert!(lba <= LBA_MASK, "block {lba} exceeds 40 bits");
        let n = self.buckets.len() as u64;
        let h = mix40(lba);
        let (tag, b1) = StrengthReducedU64::div_rem(h, self.bucket_count);
        // The step to the other candidates, in 1..n, from the tag alone (so an entry's bucket
        // and choice give back `b1`): the tag spread over 64 bits, scaled to n - 1.
        let spread = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let step = 1 + ((u128::from(spread) * u128::from(n - 1)) >> 64) as u64;
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

    /// Starts loading the candidate buckets of a block's `key` into the CPU cache (a hint;
    /// see `lookup`).
    #[inline]
    pub(crate) fn prefetch_key(&self, key: &Key) {
        for bucket in key.buckets {
            pmcache_media::prefetch(&self.bucket(bucket)[0] as *const AtomicU64);
        }
    }

    /// Finds the entry of `lba`, without locks. It may be hidden (see [`Found::hidden`]).
    #[inline]
    pub(crate) fn lookup(&self, lba: u64) -> Option<Found> {
        let key = self.key(lba);
        // Start every candidate bucket before scanning any, so their cache misses overlap
        // instead of queueing behind one another.
        self.prefetch_key(&key);
        self.lookup_key(&key)
    }

    /// [`Index::lookup`] with the key computed and its buckets already started with
    /// [`Index::prefetch_key`] (every caller does so well ahead, to overlap the misses with
    /// other work).
    #[inline]
    pub(crate) fn lookup_key(&self, key: &Key) -> Option<Found> {
        let layout = self.layout;
        for (choice, &bucket) in key.buckets.iter().enumerate() {
            let wanted = layout.identity_bits(key, choice);
            for (way, entry) in self.bucket(bucket).iter().enumerate() {
                let value = entry.load(Ordering::Acquire);
                if value & layout.identity_mask == wanted {
                    return Some(Found {
                        slot: layout.slot(value),
                        hidden: value & layout.hidden_bit() != 0,
                        referenced: value & layout.ref_bit() != 0,
                        bucket,
                        way,
                        value,
                    });
                }
            }
        }
        None
    }

    /// Every entry whose slot `wanted` picks, with the block it maps (a pass over the whole
    /// table: for the rare moments a slot is known and its block is not — a lost page of
    /// metadata entries, `cache/checked.rs`). An entry's bucket, choice and tag give back the
    /// block number: `b1` from the bucket and the tag's step, then the mixed number, then
    /// the block. Entries that change during the pass are seen as they were when read.
    pub(crate) fn mappings_where(&self, wanted: impl Fn(u32) -> bool) -> Vec<(u64, Found)> {
        let layout = self.layout;
        let n = self.buckets.len() as u64;
        let mut found = Vec::new();
        for (bucket, entries) in self.buckets.iter().enumerate() {
            for (way, entry) in entries.iter().enumerate() {
                let value = entry.load(Ordering::Acquire);
                if value == EMPTY || !wanted(layout.slot(value)) {
                    continue;
                }
                let identity = value >> layout.identity_shift();
                let (tag, choice) = (identity >> 2, (identity & 0b11) as usize - 1);
                let spread = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let step = 1 + ((u128::from(spread) * u128::from(n - 1)) >> 64) as u64;
                let back = [0, step, 2 * step + 1][choice] % n;
                let b1 = (bucket as u64 + n - back) % n;
                let lba = unmix40(tag * n + b1);
                debug_assert_eq!(self.key(lba).buckets[choice], bucket, "block {lba}");
                found.push((
                    lba,
                    Found {
                        slot: layout.slot(value),
                        hidden: value & layout.hidden_bit() != 0,
                        referenced: value & layout.ref_bit() != 0,
                        bucket,
                        way,
                        value,
                    },
                ));
            }
        }
        found
    }

    /// Whether the entry found earlier is still in place: the same slot, the same slot
    /// generation (its reference bit may have changed).
    #[inline]
    pub(crate) fn still_holds(&self, found: &Found) -> bool {
        let now = self.bucket(found.bucket)[found.way].load(Ordering::Acquire);
        self.layout.identity(now) == self.layout.identity(found.value)
    }

    /// Adds `lba -> slot`, hidden from lock-free readers until [`Index::replace`] is called on
    /// the entry it returns. The caller holds `lba`'s stripe lock and `lba` is not present.
    pub(crate) fn insert(&self, lba: u64, slot: u32) -> std::result::Result<Found, IndexFull> {
        self.insert_entry(&self.key(lba), slot, 0, true)
    }

    /// [`Index::insert`] with the key computed.
    pub(crate) fn insert_key(&self, key: &Key, slot: u32) -> std::result::Result<Found, IndexFull> {
        self.insert_entry(key, slot, 0, true)
    }

    /// Adds `lba -> slot` visible at once, with the slot's `generation`: for recovery, which
    /// runs before any reader.
    pub(crate) fn insert_visible(
        &self,
        lba: u64,
        slot: u32,
        generation: u32,
    ) -> std::result::Result<(), IndexFull> {
        self.insert_entry(&self.key(lba), slot, generation, false).map(|_| ())
    }

    fn insert_entry(
        &self,
        key: &Key,
        slot: u32,
        generation: u32,
        hidden: bool,
    ) -> std::result::Result<Found, IndexFull> {
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
                    .map(|v| self.layout.slot(v))
                    .collect();
                return Err(IndexFull { occupants });
            }
            let choice = (0..CHOICES).min_by_key(|&c| used[c]).expect("choices");
            let bucket = key.buckets[choice];
            let value = self.layout.entry(key, choice, slot, generation, hidden);
            for (way, entry) in self.bucket(bucket).iter().enumerate() {
                if entry.compare_exchange(EMPTY, value, Ordering::AcqRel, Ordering::Relaxed).is_ok()
                {
                    return Ok(Found { slot, hidden, referenced: false, bucket, way, value });
                }
            }
            // Another block took the last empty entry meanwhile: look again.
        }
    }

    /// Points a present entry at `new_slot` (durable, like its metadata entry), with that
    /// slot's `generation`, in one atomic store. The entry is the block's current mapping, or
    /// the hidden one `insert` returned, which this reveals. The caller holds the block's
    /// stripe lock, and only holders of that lock write an entry holding the block, so no
    /// compare-and-swap (a locked instruction, which would wait for outstanding persists) is
    /// needed: inserts of other blocks only ever claim *empty* entries, and readers only set
    /// the reference bit. The new incarnation keeps the reference bit `found` saw: a block
    /// that was read stays marked when it is overwritten, so its next hits find the bit set
    /// and need no locked instruction (a bit a reader set after `found` was read may be
    /// dropped, which only costs the block a chance; the hand clears bits the same way).
    pub(crate) fn replace(&self, found: &Found, new_slot: u32, generation: u32) {
        let layout = self.layout;
        let identity = found.value & layout.identity_mask;
        let referenced = found.value & layout.ref_bit();
        self.store_over(found, identity | referenced | layout.mapping(new_slot, generation, false));
    }

    /// Removes a present entry. The caller holds the stripe (see `replace`).
    pub(crate) fn remove(&self, found: &Found) {
        self.store_over(found, EMPTY);
    }

    fn store_over(&self, found: &Found, value: u64) {
        let entry = &self.bucket(found.bucket)[found.way];
        assert_eq!(
            self.layout.identity(entry.load(Ordering::Relaxed)),
            self.layout.identity(found.value),
            "index entry changed under its stripe lock"
        );
        entry.store(value, Ordering::Release);
    }

    /// Sets the entry's reference bit (CLOCK) if the lookup saw it clear and the entry is
    /// still exactly what it saw. A lock-free reader calls this without the block's stripe, so
    /// the entry may have been removed or reused since its copy validated: a blind `fetch_or`
    /// would then set the bit in an empty entry (a "ghost" that no insert claims and no
    /// removal reaches) or on another block. A compare-and-swap, like `clear_reference`,
    /// costs the same locked instruction; a lost race only loses the mark.
    #[inline]
    pub(crate) fn touch(&self, found: &Found) {
        if !found.referenced {
            let _ = self.bucket(found.bucket)[found.way].compare_exchange(
                found.value,
                found.value | self.layout.ref_bit(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Clears the reference bit if the entry is still exactly what `found` saw.
    pub(crate) fn clear_reference(&self, found: &Found) {
        let _ = self.bucket(found.bucket)[found.way].compare_exchange(
            found.value,
            found.value & !self.layout.ref_bit(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
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
        // And every single bit, alone and on a base: an even multiplier would merge x and
        // x + 2^39.
        let lbas: std::collections::BTreeSet<u64> =
            lbas.into_iter().chain((0..40).flat_map(|bit| [1 << bit, 12_345 | 1 << bit])).collect();
        for &lba in &lbas {
            assert!(mix40(lba) <= LBA_MASK, "block {lba} mixed past 40 bits");
            assert!(seen.insert(mix40(lba)), "collision at {lba}");
        }
    }

    /// Every block number of 40 bits comes back from its mixed value: mix40 is a bijection,
    /// so two blocks never share an index identity.
    #[test]
    fn mix40_has_an_inverse() {
        let lbas = (0..100_000u64).chain((0..40).map(|bit| 1 << bit)).chain([LBA_MASK]);
        for lba in
            lbas.chain((0..100_000u64).map(|i| i.wrapping_mul(0x2545_F491_4F6C_DD1D) & LBA_MASK))
        {
            assert_eq!(unmix40(mix40(lba)), lba, "block {lba}");
        }
    }

    /// Every entry comes back with its block from a pass over the table, whichever of its
    /// three buckets it went to, and only the slots asked for.
    #[test]
    fn a_pass_over_the_table_gives_back_each_slots_block() {
        for buckets in [1024u64, 1031, 4099] {
            let index = Index::with_buckets(3000, Some(buckets)).unwrap();
            let mut rng = 0x9E37_79B9_u64;
            let mut present = HashMap::new();
            let mut choices = std::collections::HashSet::new();
            while present.len() < 3000 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let lba = rng & LBA_MASK;
                let slot = present.len() as u32;
                if present.contains_key(&lba) {
                    continue;
                }
                if let Ok(found) = index.insert(lba, slot) {
                    index.replace(&found, slot, slot % 7);
                    choices.insert(index.key(lba).buckets.iter().position(|&b| b == found.bucket));
                    present.insert(lba, slot);
                } else {
                    break;
                }
            }
            assert_eq!(choices.len(), 3, "every choice used with {buckets} buckets");
            let all = index.mappings_where(|_| true);
            assert_eq!(all.len(), present.len());
            for (lba, found) in &all {
                assert_eq!(present.get(lba), Some(&found.slot), "block {lba}");
                assert_eq!(index.lookup(*lba), Some(*found));
            }
            let odd = index.mappings_where(|slot| slot % 2 == 1);
            assert_eq!(odd.len(), present.values().filter(|&&s| s % 2 == 1).count());
        }
    }

    /// A key's buckets are in the table, its first two distinct, and its first bucket and tag
    /// give back the mixed block number: two blocks never share an identity.
    #[test]
    fn keys_stay_in_the_table_and_identify_their_block() {
        for buckets in [1024u64, 1025, 4099, 43_691] {
            let index = Index::with_buckets(1000, Some(buckets)).unwrap();
            let lbas = (0..20_000u64).chain((0..20_000).map(|i| LBA_MASK - i * 7_919));
            for lba in lbas.chain((1..40).map(|bit| 1 << bit)) {
                let key = index.key(lba);
                assert!(key.buckets.iter().all(|&b| (b as u64) < buckets), "{lba}: {key:?}");
                assert_ne!(key.buckets[0], key.buckets[1], "{lba}");
                assert_eq!(key.tag * buckets + key.buckets[0] as u64, mix40(lba), "{lba}");
                assert!(key.tag <= LBA_MASK / buckets, "{lba}: tag {}", key.tag);
            }
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
                Ok(_) => {
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
        let other_slot = (slot + 1) % slots;
        index.replace(&found, other_slot, 3);
        assert_eq!(index.lookup(lba).unwrap().slot, other_slot);
        index.remove(&index.lookup(lba).unwrap());
        assert!(index.lookup(lba).is_none());
        assert!(present.keys().filter(|&&l| l != lba).all(|&l| index.lookup(l).is_some()));
    }

    #[test]
    fn an_entry_tells_a_recycled_slot_apart_by_its_generation() {
        let index = Index::new(1000).unwrap();
        let (lba, slot) = (77, 5);
        let inserted = index.insert(lba, slot).map_err(|_| "full").unwrap();
        let hidden = index.lookup(lba).unwrap();
        assert_eq!(hidden, inserted);
        assert!(hidden.hidden && hidden.slot == slot, "an inserted entry starts hidden");
        index.replace(&hidden, slot, 7);
        let first = index.lookup(lba).unwrap();
        assert!(!first.hidden && !first.referenced && first.slot == slot);
        assert!(!index.still_holds(&hidden), "revealing changes the entry");
        // A reader's reference bit is not part of the entry's identity.
        index.touch(&first);
        let touched = index.lookup(lba).unwrap();
        assert!(touched.referenced && index.still_holds(&first));
        index.clear_reference(&touched);
        assert!(!index.lookup(lba).unwrap().referenced);
        // The block moves away and comes back to the same slot, which was freed (a new
        // generation) meanwhile: a reader holding the first entry must not validate.
        index.replace(&index.lookup(lba).unwrap(), 6, 0);
        index.replace(&index.lookup(lba).unwrap(), slot, 8);
        assert_eq!(index.lookup(lba).unwrap().slot, slot);
        assert!(!index.still_holds(&first));
        // Every generation bit the entry keeps tells two incarnations apart, and none spills
        // into the block's identity.
        for bit in 0..index.generation_bits() {
            index.replace(&index.lookup(lba).unwrap(), slot, 5);
            let seen = index.lookup(lba).unwrap();
            index.replace(&seen, slot, 5 ^ (1 << bit));
            assert!(!index.still_holds(&seen), "generation bit {bit}");
            assert_eq!(index.lookup(lba).map(|f| f.slot), Some(slot), "generation bit {bit}");
        }
        index.replace(&index.lookup(lba).unwrap(), slot, 8);
        // Only a generation that wrapped around all its bits looks the same.
        let wrapped = 7 + (1u32 << index.generation_bits());
        index.replace(&index.lookup(lba).unwrap(), slot, wrapped);
        assert!(index.still_holds(&first));
        // A replacement keeps the reference bit it replaced, set or clear.
        index.touch(&index.lookup(lba).unwrap());
        index.replace(&index.lookup(lba).unwrap(), 6, 1);
        let kept = index.lookup(lba).unwrap();
        assert!(kept.referenced && kept.slot == 6);
        index.clear_reference(&kept);
        index.replace(&index.lookup(lba).unwrap(), 7, 2);
        assert!(!index.lookup(lba).unwrap().referenced);
    }

    /// A reader marks the entry it copied from after validating its copy, and the entry may
    /// be removed in between (evicted, trimmed or invalidated under its stripe, which the
    /// reader does not take). The mark must then change nothing: a reference bit set in an
    /// empty entry would leave a "ghost" that no insert claims and no removal reaches, and
    /// that a full bucket reports as an occupant in slot 0. Nor may a mark land on another
    /// block that took the entry meanwhile.
    #[test]
    fn a_mark_after_its_entry_changed_leaves_the_entry_alone() {
        // 2 buckets of 8 entries, every block's candidates among them.
        let index = Index::with_buckets(20, Some(2)).expect("an index");
        let reveal = |lba: u64, slot: u32| {
            let hidden = index.insert(lba, slot).map_err(|_| "full").expect("room");
            index.replace(&hidden, slot, 1);
            index.lookup(lba).expect("revealed")
        };
        let seen = reveal(3, 4);
        assert!(!seen.referenced);
        index.remove(&seen);
        index.touch(&seen);
        assert_eq!(index.occupied(), 0, "the mark left a ghost");
        // Every entry can be claimed again.
        for lba in 100..100 + 2 * WAYS as u64 {
            reveal(lba, lba as u32 % 16);
        }
        assert!(index.insert(200, 0).is_err(), "16 entries, all in use");

        // Removed and taken by another block before the mark: the other block stays unmarked.
        let index = Index::with_buckets(20, Some(2)).expect("an index");
        let hidden = index.insert(3, 4).map_err(|_| "full").expect("room");
        index.replace(&hidden, 4, 1);
        let seen = index.lookup(3).expect("revealed");
        index.remove(&seen);
        for lba in 100..100 + 2 * WAYS as u64 {
            let other = index.insert(lba, 5).map_err(|_| "full").expect("room");
            index.replace(&other, 5, 1);
        }
        index.touch(&seen);
        for lba in 100..100 + 2 * WAYS as u64 {
            assert!(!index.lookup(lba).expect("present").referenced, "block {lba} marked");
        }
    }

    #[test]
    fn every_geometry_keeps_enough_generation_bits() {
        for slot_count in [1, 16, 6144, 6145, 1 << 20, 1 << 28, u32::MAX] {
            let layout = Layout::new(slot_count, bucket_count(slot_count)).expect("a layout");
            assert!(layout.generation_bits >= GENERATION_BITS_MIN, "{slot_count} slots");
            // The largest slot number and the largest tag fit beside it.
            let key = Key { buckets: [0; CHOICES], tag: LBA_MASK / bucket_count(slot_count) };
            let value = layout.entry(&key, 2, slot_count - 1, u32::MAX, false);
            assert_eq!(layout.slot(value), slot_count - 1);
            assert_eq!(value >> layout.identity_shift(), key.tag << 2 | 3, "the tag fits");
            assert_eq!(value & layout.hidden_bit(), 0);
        }
    }

    #[test]
    fn an_index_too_small_for_its_slots_is_a_configuration_error() {
        // 20 slots (5 slot bits): 2 buckets leave a 39-bit tag and 16 generation bits, 1
        // bucket 15.
        let index = Index::with_buckets(20, Some(2)).expect("2 buckets for 20 slots");
        assert_eq!(index.generation_bits(), GENERATION_BITS_MIN);
        for buckets in [0, 1] {
            let err = Index::with_buckets(20, Some(buckets)).map(|_| ()).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{buckets} buckets: {err}");
            assert!(err.to_string().contains("too small"), "{err}");
        }
    }
}
