//! The pools of free slots, one per member of the cache: each a bitmap (one bit per slot)
//! behind a mutex, taken from and returned to in batches by lanes, so the lock is amortised
//! over many allocations. Beside them, the slots retired for good (on ranges of the medium
//! that lost their poisoned lines) and those ranges ([`LostRanges`]).

use std::ops::Range;
use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicBool, AtomicU64, Mutex, Ordering, lock};

struct Bits {
    words: Vec<u64>,
    cursor: usize,
    free: u64,
}

pub(crate) struct FreePool {
    bits: Mutex<Bits>,
    slot_count: u32,
}

/// One pool per member, over the cache's slot numbers.
pub(crate) struct Pools {
    /// Each member's pool with its first slot, in member order.
    pools: Box<[(u32, CachePadded<FreePool>)]>,
    /// The slots of all members.
    slot_count: u32,
    /// One bit per slot retired for good — its data, checksum or metadata entry lies on a
    /// range of the medium that lost its contents: never handed out again while the engine
    /// runs (a slot retired while it holds a block is kept out when it is freed, and one a
    /// lane holds in its lists is dropped when it comes up). Made at the first retirement.
    retired: OnceLock<Box<[AtomicU64]>>,
    /// How many are retired: a slot's bit is looked at only when this is not 0.
    retired_count: AtomicU64,
    /// The ranges of the medium lost so far.
    pub(crate) lost: LostRanges,
}

impl Pools {
    /// Empty pools for members of these `(first slot, slot count)`.
    pub(crate) fn new(members: impl IntoIterator<Item = (u32, u32)>) -> Self {
        let pools: Box<[(u32, CachePadded<FreePool>)]> = members
            .into_iter()
            .map(|(first, count)| (first, CachePadded::new(FreePool::new(count))))
            .collect();
        let slot_count = pools.last().map_or(0, |(first, pool)| first + pool.slot_count());
        Self {
            pools,
            slot_count,
            retired: OnceLock::new(),
            retired_count: AtomicU64::new(0),
            lost: LostRanges::default(),
        }
    }

    /// Keeps `slot` out of the pools from now on (taken out if it is in one). Returns whether
    /// it was not retired before.
    pub(crate) fn retire(&self, slot: u32) -> bool {
        let bits = self.retired.get_or_init(|| {
            (0..(self.slot_count as usize).div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
        });
        let bit = 1u64 << (slot % 64);
        if bits[slot as usize / 64].fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return false;
        }
        self.retired_count.fetch_add(1, Ordering::AcqRel);
        let (pool, at) = self.of(slot);
        pool.remove(at);
        true
    }

    /// Whether `slot` is retired: one load while none is, two otherwise (no lock: a lane asks
    /// at every allocation once one is).
    #[inline]
    pub(crate) fn is_retired(&self, slot: u32) -> bool {
        self.retired_count.load(Ordering::Acquire) != 0
            && self.retired.get().is_some_and(|bits| {
                bits[slot as usize / 64].load(Ordering::Acquire) & 1 << (slot % 64) != 0
            })
    }

    /// How many slots are retired.
    pub(crate) fn retired(&self) -> u64 {
        self.retired_count.load(Ordering::Acquire)
    }

    /// `slots` without the retired ones (all of them, at the cost of one load, while none is).
    fn usable<'s>(&self, slots: &'s [u32]) -> std::borrow::Cow<'s, [u32]> {
        if self.retired_count.load(Ordering::Acquire) == 0 {
            return std::borrow::Cow::Borrowed(slots);
        }
        slots.iter().copied().filter(|&slot| !self.is_retired(slot)).collect()
    }

    /// The pool holding `slot`, and the slot's number in it.
    fn of(&self, slot: u32) -> (&FreePool, u32) {
        let index = if self.pools.len() == 1 {
            0
        } else {
            self.pools.partition_point(|(first, _)| *first <= slot) - 1
        };
        let (first, pool) = &self.pools[index];
        (pool, slot - first)
    }

    /// DRAM bytes of every bitmap.
    pub(crate) fn bytes(&self) -> usize {
        self.pools.iter().map(|(_, pool)| pool.bytes()).sum()
    }

    /// Whether `slot` is in its pool (for `Engine::audit`).
    pub(crate) fn holds(&self, slot: u32) -> bool {
        let (pool, at) = self.of(slot);
        pool.holds(at)
    }

    /// How many slots the pools hold (for `Engine::audit`).
    pub(crate) fn len(&self) -> u64 {
        self.pools.iter().map(|(_, pool)| pool.len()).sum()
    }

    /// Returns free slots, each to its member's pool (their metadata entries are durably
    /// free).
    pub(crate) fn put(&self, slots: impl IntoIterator<Item = u32>) {
        if self.retired_count.load(Ordering::Acquire) != 0 {
            let slots: Vec<u32> = slots.into_iter().collect();
            return self.put_usable(&self.usable(&slots));
        }
        self.put_usable_iter(slots)
    }

    fn put_usable(&self, slots: &[u32]) {
        self.put_usable_iter(slots.iter().copied())
    }

    fn put_usable_iter(&self, slots: impl IntoIterator<Item = u32>) {
        if let [(first, pool)] = &self.pools[..] {
            return pool.put(slots.into_iter().map(|slot| slot - first));
        }
        for slot in slots {
            let (pool, at) = self.of(slot);
            pool.put([at]);
        }
    }

    /// Returns free slots to their pools: [`Pools::put`] for a batch, one lock per member it
    /// holds slots of.
    pub(crate) fn put_all(&self, slots: &[u32]) {
        let slots = &*self.usable(slots);
        if self.pools.len() == 1 {
            return self.put_usable(slots);
        }
        for (index, (first, pool)) in self.pools.iter().enumerate() {
            let end = self.pools.get(index + 1).map_or(u32::MAX, |(next, _)| *next);
            let mut mine = slots.iter().filter(|&&s| (*first..end).contains(&s)).peekable();
            if mine.peek().is_some() {
                pool.put(mine.map(|&slot| slot - first));
            }
        }
    }

    /// Moves up to `max` free slots of member `member` into `out` (see [`FreePool::take`]).
    pub(crate) fn take(&self, member: usize, max: usize, out: &mut Vec<u32>) -> usize {
        let (first, pool) = &self.pools[member];
        let start = out.len();
        let taken = pool.take(max, out);
        if *first != 0 {
            out[start..].iter_mut().for_each(|slot| *slot += first);
        }
        taken
    }

    /// How many free slots member `member`'s pool holds.
    pub(crate) fn len_of(&self, member: usize) -> u64 {
        self.pools[member].1.len()
    }
}

impl FreePool {
    pub(crate) fn new(slot_count: u32) -> Self {
        let words = vec![0u64; (slot_count as usize).div_ceil(64)];
        Self { bits: Mutex::new(Bits { words, cursor: 0, free: 0 }), slot_count }
    }

    /// The slots the pool is for.
    fn slot_count(&self) -> u32 {
        self.slot_count
    }

    pub(crate) fn bytes(&self) -> usize {
        lock(&self.bits).words.len() * 8
    }

    /// Whether `slot` is in the pool (for `Engine::audit`).
    pub(crate) fn holds(&self, slot: u32) -> bool {
        lock(&self.bits).words[slot as usize / 64] & (1 << (slot % 64)) != 0
    }

    /// How many slots the pool holds (for `Engine::audit`).
    pub(crate) fn len(&self) -> u64 {
        lock(&self.bits).free
    }

    /// Returns free slots (their metadata entries are durably free).
    pub(crate) fn put(&self, slots: impl IntoIterator<Item = u32>) {
        let mut bits = lock(&self.bits);
        for slot in slots {
            let (word, bit) = (slot as usize / 64, slot % 64);
            assert!(bits.words[word] & (1 << bit) == 0, "slot {slot} freed twice");
            bits.words[word] |= 1 << bit;
            bits.free += 1;
        }
    }

    /// Takes `slot` out of the pool if it is there.
    fn remove(&self, slot: u32) {
        let mut bits = lock(&self.bits);
        let (word, bit) = (slot as usize / 64, slot % 64);
        if bits.words[word] & (1 << bit) != 0 {
            bits.words[word] &= !(1 << bit);
            bits.free -= 1;
        }
    }

    /// Moves up to `max` free slots into `out`, lowest first from the cursor (so a lane gets a
    /// contiguous run when the cache is fresh). Returns how many.
    pub(crate) fn take(&self, max: usize, out: &mut Vec<u32>) -> usize {
        let mut bits = lock(&self.bits);
        let mut taken = 0;
        let words = bits.words.len();
        let mut scanned = 0;
        while taken < max && bits.free > 0 && scanned <= words {
            let at = bits.cursor;
            while bits.words[at] != 0 && taken < max {
                let bit = bits.words[at].trailing_zeros();
                bits.words[at] &= !(1 << bit);
                bits.free -= 1;
                out.push((at * 64) as u32 + bit);
                taken += 1;
            }
            if bits.words[at] == 0 {
                bits.cursor = (at + 1) % words;
                scanned += 1;
            }
        }
        // Hand out the lowest first when popping from the end.
        let start = out.len() - taken;
        out[start..].reverse();
        taken
    }
}

/// A range of the medium that lost its contents (a poisoned line took the page, or the
/// mapping's granule, around it: `cache/checked.rs`): what is stored there no longer reaches
/// the medium. Every slot whose data, checksum or metadata entry lies in it is retired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lost {
    /// Medium offsets, cache-line aligned.
    pub(crate) range: Range<u64>,
    /// The slots that touch it, ascending.
    pub(crate) slots: Vec<u32>,
    /// Whether its blocks were dealt with and the medium's record says so (`checked.rs`).
    pub(crate) settled: bool,
}

/// The ranges of the medium lost so far.
pub(crate) struct LostRanges {
    ranges: Mutex<Vec<Lost>>,
    /// Held while the medium's record of lost ranges is written (`cache/checked.rs`).
    pub(crate) record_lock: Mutex<()>,
    /// How many there are: 0 on a healthy medium, where every question is one load.
    count: AtomicU64,
    /// Whether one is not settled yet.
    unsettled: AtomicBool,
    /// Allocations to let pass before the next try to settle them (after a try that could
    /// not: busy stripes, a backing store that refused).
    skip: AtomicU64,
    /// The medium's count of losses ([`pmcache_media::Medium::losses`]) when every loss it
    /// counted was last known registered here (`cache/checked.rs`, stores that landed).
    pub(crate) losses_known: AtomicU64,
}

impl Default for LostRanges {
    fn default() -> Self {
        Self {
            ranges: Mutex::new(Vec::new()),
            record_lock: Mutex::new(()),
            count: AtomicU64::new(0),
            unsettled: AtomicBool::new(false),
            skip: AtomicU64::new(0),
            losses_known: AtomicU64::new(0),
        }
    }
}

impl LostRanges {
    /// Whether no range is lost.
    pub(crate) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Whether `range` lies inside one already known.
    pub(crate) fn covers(&self, range: &Range<u64>) -> bool {
        !self.is_empty()
            && lock(&self.ranges)
                .iter()
                .any(|lost| lost.range.start <= range.start && range.end <= lost.range.end)
    }

    /// Adds a range (its slots retired by the caller).
    pub(crate) fn add(&self, lost: Lost) {
        let mut ranges = lock(&self.ranges);
        if !lost.settled {
            self.unsettled.store(true, Ordering::Release);
            self.skip.store(0, Ordering::Release);
        }
        ranges.push(lost);
        self.count.store(ranges.len() as u64, Ordering::Release);
    }

    /// The ranges not settled yet.
    pub(crate) fn unsettled(&self) -> Vec<Lost> {
        if !self.unsettled.load(Ordering::Acquire) {
            return Vec::new();
        }
        lock(&self.ranges).iter().filter(|lost| !lost.settled).cloned().collect()
    }

    /// Records that `range` is settled.
    pub(crate) fn settle(&self, range: &Range<u64>) {
        let mut ranges = lock(&self.ranges);
        for lost in ranges.iter_mut().filter(|lost| lost.range == *range) {
            lost.settled = true;
        }
        self.unsettled.store(ranges.iter().any(|lost| !lost.settled), Ordering::Release);
    }

    /// Whether `offset..offset + len` overlaps a lost range (`unsettled_only`: one not
    /// settled yet).
    pub(crate) fn touches(&self, offset: u64, len: u64, unsettled_only: bool) -> bool {
        !self.is_empty()
            && lock(&self.ranges).iter().any(|lost| {
                (!unsettled_only || !lost.settled)
                    && lost.range.start < offset + len
                    && offset < lost.range.end
            })
    }

    /// Whether an allocation should try to settle the unsettled ranges now: one load while
    /// every range is settled.
    #[inline]
    pub(crate) fn settle_due(&self) -> bool {
        if !self.unsettled.load(Ordering::Acquire) {
            return false;
        }
        self.skip.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_err()
    }

    /// Lets `allocations` allocations pass before the next try.
    pub(crate) fn try_again_after(&self, allocations: u64) {
        self.skip.store(allocations, Ordering::Release);
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    #[test]
    fn the_bitmap_takes_one_bit_per_slot_in_whole_words() {
        for (slots, bytes) in [(1, 8), (64, 8), (65, 16), (1 << 20, 1 << 17)] {
            assert_eq!(FreePool::new(slots).bytes(), bytes, "{slots} slots");
        }
    }

    #[test]
    fn slots_come_back_lowest_first_from_the_cursor_at_most_max_at_a_time() {
        let pool = FreePool::new(200);
        pool.put([150, 3, 70, 199, 64]);
        let mut out = vec![7];
        // Popped from the end, the lowest comes first; what `out` held stays.
        assert_eq!(pool.take(3, &mut out), 3);
        assert_eq!(out, [7, 70, 64, 3]);
        assert_eq!((out.pop(), out.pop(), out.pop()), (Some(3), Some(64), Some(70)));
        // The cursor moved past the emptied words: the rest follow, then nothing.
        out.clear();
        assert_eq!(pool.take(10, &mut out), 2);
        assert_eq!(out, [199, 150]);
        assert_eq!(pool.take(10, &mut out), 0);
        // Freed again below the cursor: found after wrapping around.
        pool.put([5]);
        out.clear();
        assert_eq!(pool.take(10, &mut out), 1);
        assert_eq!(out, [5]);
    }

    /// What `Engine::audit` asks: whether a slot is in the pool, and how many are.
    #[test]
    fn the_pool_says_which_slots_it_holds_and_how_many() {
        let pool = FreePool::new(130);
        pool.put([3, 64, 129]);
        assert!(pool.holds(3) && pool.holds(64) && pool.holds(129));
        assert!(!pool.holds(4) && !pool.holds(0) && !pool.holds(65));
        assert_eq!(pool.len(), 3);
        let mut out = Vec::new();
        pool.take(1, &mut out);
        assert_eq!((out, pool.len(), pool.holds(3)), (vec![3], 2, false));
    }

    /// Each member's slots go back to its own pool, by slot number, however they are mixed.
    #[test]
    fn each_slot_goes_back_to_its_members_pool() {
        let pools = Pools::new([(0, 100), (100, 60), (160, 200)]);
        pools.put_all(&[5, 170, 101, 99, 359, 100]);
        pools.put([120, 7]);
        assert_eq!((pools.len_of(0), pools.len_of(1), pools.len_of(2)), (3, 3, 2));
        assert_eq!(pools.len(), 8);
        assert!(pools.holds(100) && pools.holds(359) && !pools.holds(160));
        let mut out = Vec::new();
        assert_eq!(pools.take(1, 10, &mut out), 3);
        assert_eq!(out, [120, 101, 100]);
        out.clear();
        assert_eq!(pools.take(2, 1, &mut out), 1);
        assert_eq!(out, [170]);
        assert_eq!(pools.take(0, 10, &mut out), 3);
        assert_eq!(out, [170, 99, 7, 5]);
    }

    /// A retired slot leaves its pool and never comes back: not when it is returned alone,
    /// nor in a batch, nor in a batch of another member's pool.
    #[test]
    fn a_retired_slot_is_never_handed_out_again() {
        let pools = Pools::new([(0, 64), (64, 64)]);
        pools.put(0..128);
        assert!(pools.retire(5) && !pools.retire(5), "retired once");
        assert!(pools.retire(70));
        assert_eq!((pools.len(), pools.retired()), (126, 2));
        assert!(!pools.holds(5) && !pools.holds(70) && pools.is_retired(70));
        let mut out = Vec::new();
        pools.take(0, 64, &mut out);
        pools.take(1, 64, &mut out);
        assert_eq!(out.len(), 126);
        assert!(!out.contains(&5) && !out.contains(&70));
        pools.put_all(&[5, 6, 70, 71]);
        pools.put([5, 7]);
        assert_eq!(pools.len(), 3, "6, 7 and 71 came back, 5 and 70 did not");
        assert!(!pools.holds(5) && !pools.holds(70) && pools.holds(71));
        assert!(!pools.is_retired(6) && !pools.is_retired(69) && pools.is_retired(5));
    }

    /// A lost range is known until the engine ends; an allocation is asked to settle the
    /// unsettled ones at once, then, after a try that could not, after the allocations it was
    /// told to let pass.
    #[test]
    fn lost_ranges_are_settled_by_allocations_until_they_are() {
        let lost = LostRanges::default();
        assert!(lost.is_empty() && !lost.settle_due() && !lost.touches(0, u64::MAX, false));
        lost.add(Lost { range: 4096..8192, slots: vec![3, 9], settled: false });
        assert!(lost.covers(&(4096..4160)) && !lost.covers(&(4000..4160)));
        assert!(lost.touches(8191, 1, true) && !lost.touches(8192, 64, false));
        assert!(lost.settle_due());
        lost.try_again_after(2);
        assert!(!lost.settle_due() && !lost.settle_due() && lost.settle_due());
        assert_eq!(lost.unsettled().len(), 1);
        lost.settle(&(4096..8192));
        assert!(lost.unsettled().is_empty() && !lost.settle_due());
        assert!(lost.touches(5000, 1, false) && !lost.touches(5000, 1, true));
        assert_eq!(lost.unsettled().len(), 0);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn a_slot_freed_twice_is_a_broken_invariant() {
        let pool = FreePool::new(64);
        pool.put([9, 9]);
    }
}
