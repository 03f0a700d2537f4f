//! Attaching an existing cache: the index, free space and dirty set are rebuilt from the
//! medium alone (the cache is its own journal; there is no separate log).
//!
//! Rules (docs/DURABILITY.md, "Recovery"):
//! - the newest entry (largest sequence number) of each block wins; older ones are freed;
//!   a second copy under the same number is corrupt (each number is issued once);
//! - torn and corrupt entries are dropped, counted and reported — never trusted;
//! - a clean entry newer than the synced sequence number may be newer than what the backing
//!   store durably holds, so it becomes dirty (and is written back later);
//! - everything else that was clean stays cached and clean.

use pmcache_backing::BackingStore;
use pmcache_media::Medium;

use std::ops::Range;

use crate::cache::{Engine, first_seq_after, read_shutdown_state};
use crate::clock::Clock;
use crate::config::Config;
use crate::error::Result;
use crate::format::{BlockState, DecodedEntry, ENTRY_BYTES, SlotEntry};
use crate::layout::Layout;
use crate::slots::SlotState;
use crate::sync::Ordering;

/// What recovery found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Slots scanned.
    pub slots: u64,
    /// Blocks kept clean.
    pub clean: u64,
    /// Blocks kept dirty (including those made dirty by the synced rule).
    pub dirty: u64,
    /// Clean entries newer than the synced sequence, now dirty.
    pub clean_made_dirty: u64,
    /// Older copies of a block dropped in favour of a newer one.
    pub superseded: u64,
    /// Entries torn by a power cut (dropped).
    pub torn: u64,
    /// Entries that fail validation, or that repeat the sequence number of another copy of
    /// their block (dropped; each number is issued once, so only corruption makes such a pair,
    /// and the copy in the lower slot is the one kept).
    pub corrupt: u64,
    /// Whether the previous shutdown was clean.
    pub was_clean_shutdown: bool,
    /// Whether the synced sequence word was corrupt (beyond `format::SEQ_MAX`): taken as 0,
    /// so every clean entry was made dirty.
    pub synced_seq_invalid: bool,
    /// Entries not trusted because they lie on a range of the medium recorded lost
    /// (`cache/checked.rs`): every one in a settled range (not read), and the clean ones no
    /// newer than the synced sequence number in a range still pending.
    pub lost_entries: u64,
    /// Time taken, in nanoseconds.
    pub duration_ns: u64,
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Attaches the cache on `medium`: validates the superblock against the medium and
    /// `backing`, rebuilds all DRAM state from the medium, and returns what it found.
    pub fn open(
        medium: M,
        backing: B,
        clock: C,
        config: &Config,
    ) -> Result<(Self, RecoveryReport)> {
        let started_ns = clock.now_ns();
        let (layout, superblock) = Layout::read(&medium)?;
        superblock.check_backing(&backing.identity())?;
        let (was_clean_shutdown, synced_seq, synced_seq_invalid) = read_shutdown_state(&medium)?;
        let mut engine =
            Self::assemble(medium, backing, clock, config, superblock, layout, synced_seq)?;
        let mut report = engine.rebuild(synced_seq)?;
        report.was_clean_shutdown = was_clean_shutdown;
        report.synced_seq_invalid = synced_seq_invalid;
        engine.recovered_dirty = report.dirty;
        engine.mark_attached();
        // Lost ranges not settled (recorded pending, or reported by the medium now) are
        // settled before the first request (`cache/checked.rs`); if that cannot be done now
        // (the backing store refusing), the first allocations try again.
        if !engine.pools.lost.unsettled().is_empty() {
            engine.lane()?.settle_lost_ranges(None, None);
        }
        report.duration_ns = engine.clock.now_ns().saturating_sub(started_ns);
        Ok((engine, report))
    }

    fn rebuild(&mut self, synced_seq: u64) -> Result<RecoveryReport> {
        let slot_count = self.slots.len();
        let mut report = RecoveryReport { slots: u64::from(slot_count), ..Default::default() };
        let mut free = Vec::new();
        // Copies whose block found its index buckets full: settled after the scan.
        let mut overflow = Vec::new();
        let mut max_seq = synced_seq;
        // Ranges recorded lost: their entries are not trusted, or not all (`checked.rs`).
        let lost = self.recorded_lost_ranges();
        for slot in 0..slot_count {
            let lost_here = if lost.is_empty() {
                None
            } else {
                lost_entry(&lost, self.layout.entry_offset(slot))
            };
            match lost_here {
                Some(true) => {
                    report.lost_entries += 1;
                    continue;
                }
                Some(false) => {
                    if let DecodedEntry::Valid(entry) = self.read_entry(slot)
                        && entry.state == BlockState::Clean
                        && entry.seq <= synced_seq
                    {
                        report.lost_entries += 1;
                        continue;
                    }
                }
                None => {}
            }
            let mut entry = match self.read_entry(slot) {
                DecodedEntry::Free => {
                    // A free slot's word 1 may hold the sequence number of a new entry whose
                    // word 0 a power cut lost. Zeroed (durable at the scan's fence), so that
                    // the next entry written here starts from a durably free pair: torn, it
                    // then reads as torn, never as corrupt (docs/FORMAT.md, torn updates).
                    if self.medium.load_u64(self.layout.entry_offset(slot) + 8) != 0 {
                        self.clear_entry(slot);
                    }
                    free.push(slot);
                    continue;
                }
                DecodedEntry::Torn => {
                    report.torn += 1;
                    self.clear_entry(slot);
                    free.push(slot);
                    continue;
                }
                DecodedEntry::Corrupt => {
                    report.corrupt += 1;
                    self.clear_entry(slot);
                    free.push(slot);
                    continue;
                }
                DecodedEntry::Valid(entry) if entry.lba >= self.backing_blocks => {
                    report.corrupt += 1;
                    self.clear_entry(slot);
                    free.push(slot);
                    continue;
                }
                DecodedEntry::Valid(entry) => entry,
            };
            max_seq = max_seq.max(entry.seq);
            // The synced rule first, so that everything below (which entry wins, which may be
            // dropped to make room) sees the state the block is really in.
            let made_dirty = entry.state == BlockState::Clean && entry.seq > synced_seq;
            if made_dirty {
                entry.state = BlockState::Dirty;
            }
            if let Some(found) = self.index.lookup(entry.lba) {
                let DecodedEntry::Valid(other) = self.read_entry(found.slot) else {
                    unreachable!("an indexed slot holds a valid entry")
                };
                if other.seq == entry.seq {
                    report.corrupt += 1;
                } else {
                    report.superseded += 1;
                }
                if other.seq >= entry.seq {
                    self.clear_entry(slot);
                    free.push(slot);
                    continue;
                }
                self.index.replace(&found, slot, self.slots.generation(slot));
                self.clear_entry(found.slot);
                self.slots.free(found.slot);
                free.push(found.slot);
            } else if self
                .index
                .insert_visible(entry.lba, slot, self.slots.generation(slot))
                .is_err()
            {
                // Every candidate index bucket is full (vanishingly rare at the index's load
                // factor). Buckets only fill up during the scan, so every copy of this block
                // ends up here: settled once the scan is done.
                overflow.push((slot, entry, made_dirty));
                continue;
            }
            self.keep_recovered(slot, &entry, made_dirty, &mut report);
        }
        if !overflow.is_empty() {
            self.settle_overflow(overflow, &mut free, &mut report)?;
        }
        self.medium.drain();
        for slot in 0..slot_count {
            match self.slots.load(slot).state() {
                SlotState::Clean => report.clean += 1,
                SlotState::Dirty => report.dirty += 1,
                SlotState::Free => {}
            }
        }
        self.next_seq.store(first_seq_after(max_seq), Ordering::SeqCst);
        // Slots touching a range recorded lost, or one the medium reports now, are not used
        // again (a cached block there stays until the range is settled: `checked.rs`).
        self.register_lost_ranges(&lost);
        self.pools.put_all(&free);
        Ok(report)
    }

    /// Publishes a recovered copy that is now indexed (its entry rewritten dirty if the synced
    /// rule made it so).
    fn keep_recovered(
        &mut self,
        slot: u32,
        entry: &SlotEntry,
        made_dirty: bool,
        report: &mut RecoveryReport,
    ) {
        if made_dirty {
            let at = self.layout.entry_offset(slot);
            self.medium.store_u64(at, entry.encode().0);
            self.medium.flush(at, 8);
            report.clean_made_dirty += 1;
        }
        self.slots.publish(
            slot,
            match entry.state {
                BlockState::Clean => SlotState::Clean,
                BlockState::Dirty => SlotState::Dirty,
            },
        );
    }

    /// Settles the copies whose index buckets were full during the scan (`overflow`: slot,
    /// entry, made dirty by the synced rule). The older copies of each block are cleared;
    /// then one fence makes every clearing so far durable (these, and the superseded copies
    /// the scan cleared) before any block's last copy is let go for room — invariant 2: an
    /// older copy must not come back after its block's newest is gone, and two write-backs
    /// under one fence are not ordered. Then each block's newest copy is kept if it is dirty
    /// (in place of a clean occupant of its buckets, or written back to the backing store and
    /// let go when every occupant is dirty) and let go if it is clean (the backing store
    /// holds its data).
    fn settle_overflow(
        &mut self,
        mut overflow: Vec<(u32, SlotEntry, bool)>,
        free: &mut Vec<u32>,
        report: &mut RecoveryReport,
    ) -> Result<()> {
        overflow.sort_unstable_by_key(|&(slot, entry, _)| {
            (entry.lba, std::cmp::Reverse(entry.seq), slot)
        });
        let mut newest: Vec<(u32, SlotEntry, bool)> = Vec::with_capacity(overflow.len());
        for &(slot, entry, made_dirty) in &overflow {
            // Sorted newest first per block: the copy kept is the last one pushed.
            if let Some(&(_, kept, _)) = newest.last().filter(|(_, kept, _)| kept.lba == entry.lba)
            {
                // As in the scan: the same number as the copy kept is corruption.
                if kept.seq == entry.seq {
                    report.corrupt += 1;
                } else {
                    report.superseded += 1;
                }
                self.clear_entry(slot);
                free.push(slot);
            } else {
                newest.push((slot, entry, made_dirty));
            }
        }
        self.medium.drain();
        for (slot, entry, made_dirty) in newest {
            if self.make_room_at_recovery(&entry, slot, free)? {
                self.keep_recovered(slot, &entry, made_dirty, report);
            }
        }
        Ok(())
    }

    /// For the newest copy of a block whose index buckets are full (every older copy of it,
    /// and of every indexed block, durably gone): frees a clean occupant and indexes the copy
    /// if it is dirty, or lets it go (written back first if dirty and every occupant is
    /// dirty). Returns whether the copy is now indexed.
    fn make_room_at_recovery(
        &mut self,
        entry: &SlotEntry,
        slot: u32,
        free: &mut Vec<u32>,
    ) -> Result<bool> {
        if entry.state == BlockState::Clean {
            self.clear_entry(slot);
            free.push(slot);
            return Ok(false);
        }
        loop {
            let Err(full) = self.index.insert_visible(entry.lba, slot, self.slots.generation(slot))
            else {
                return Ok(true);
            };
            let victim = full
                .occupants
                .iter()
                .copied()
                .find(|&s| self.slots.load(s).state() == SlotState::Clean);
            let Some(victim) = victim else {
                // Every occupant is dirty: write this block back and let it go.
                let mut data = vec![0u8; self.layout.block_size as usize];
                self.read_block_checked(slot, &mut data)
                    .map_err(|why| crate::Error::CachedBlockUnreadable { lba: entry.lba, why })?;
                let offset = entry.lba * u64::from(self.layout.block_size);
                self.backing.write_at(&data, offset)?;
                self.backing.flush()?;
                self.clear_entry(slot);
                free.push(slot);
                return Ok(false);
            };
            let DecodedEntry::Valid(victim_entry) = self.read_entry(victim) else {
                unreachable!("an indexed slot holds a valid entry")
            };
            let found = self.index.lookup(victim_entry.lba).expect("victim is indexed");
            self.index.remove(&found);
            self.clear_entry(victim);
            self.slots.free(victim);
            free.push(victim);
        }
    }
}

// ----- The record of lost ranges (see `cache/checked.rs`) -----

/// Where the record of lost ranges starts in member 0's superblock page.
pub(crate) const LOST_RECORD_OFFSET: u64 = 1024;
/// Words of the record: the rest of the superblock page.
pub(crate) const LOST_RECORD_WORDS: u64 =
    (crate::format::SUPERBLOCK_BYTES - LOST_RECORD_OFFSET) / 8;
/// A record word: the first cache line of the run (40 bits: 64 TiB), log2 of its lines (5
/// bits), settled (1 bit), check (18 bits).
pub(crate) const LOST_LINE_BITS: u32 = 40;
const LOST_SIZE_SHIFT: u32 = 40;
const LOST_SETTLED_BIT: u64 = 1 << 45;
const LOST_CHECK_SHIFT: u32 = 46;

/// The record word for the run of `2^lines_log2` cache lines from line `first_line`.
pub(crate) fn lost_word(uuid: &[u8; 16], first_line: u64, lines_log2: u32, settled: bool) -> u64 {
    let body = first_line
        | u64::from(lines_log2) << LOST_SIZE_SHIFT
        | if settled { LOST_SETTLED_BIT } else { 0 };
    body | lost_check(uuid, body) << LOST_CHECK_SHIFT
}

fn lost_check(uuid: &[u8; 16], body: u64) -> u64 {
    let mut bytes = [0u8; 32];
    bytes[..16].copy_from_slice(uuid);
    bytes[16..24].copy_from_slice(&body.to_le_bytes());
    bytes[24..].copy_from_slice(b"PMLOST\0\x01");
    u64::from(crc32c::crc32c(&bytes)) & ((1 << (64 - LOST_CHECK_SHIFT)) - 1)
}

/// What a record word says, if it is one of this cache's: the run's first line, log2 of its
/// lines, and whether it is settled.
pub(crate) fn decode_lost_word(uuid: &[u8; 16], word: u64) -> Option<(u64, u32, bool)> {
    let body = word & ((1 << LOST_CHECK_SHIFT) - 1);
    if word == 0 || word >> LOST_CHECK_SHIFT != lost_check(uuid, body) {
        return None;
    }
    let first_line = body & ((1 << LOST_LINE_BITS) - 1);
    let lines_log2 = ((body >> LOST_SIZE_SHIFT) & 0b1_1111) as u32;
    Some((first_line, lines_log2, body & LOST_SETTLED_BIT != 0))
}

/// `range`, widened to whole cache lines, as aligned power-of-two runs of lines: (first line,
/// log2 of its lines). A page or a mapping's granule is one run.
pub(crate) fn line_runs(range: &Range<u64>) -> Vec<(u64, u32)> {
    let line = pmcache_media::CACHE_LINE_BYTES;
    let (mut at, end) = (range.start / line, range.end.div_ceil(line));
    let mut runs = Vec::new();
    while at < end {
        let aligned = if at == 0 { 31 } else { at.trailing_zeros().min(31) };
        let fits = (end - at).ilog2().min(31);
        let log2 = aligned.min(fits);
        runs.push((at, log2));
        at += 1 << log2;
    }
    runs
}

/// The ranges the record of the cache `uuid` names, at `record` (member 0's base plus
/// [`LOST_RECORD_OFFSET`]) on `medium`, each with whether it is settled.
pub(crate) fn read_lost_record<M: Medium>(
    medium: &M,
    record: u64,
    uuid: &[u8; 16],
) -> Vec<(Range<u64>, bool)> {
    let line = pmcache_media::CACHE_LINE_BYTES;
    (0..LOST_RECORD_WORDS)
        .filter_map(|i| decode_lost_word(uuid, medium.load_u64(record + 8 * i)))
        .map(|(first, log2, settled)| (first * line..(first + (1 << log2)) * line, settled))
        .collect()
}

/// Whether the entry at `at` lies in one of `ranges`, and if so whether that range is
/// settled (a settled range wins over a pending one it overlaps).
pub(crate) fn lost_entry(ranges: &[(Range<u64>, bool)], at: u64) -> Option<bool> {
    ranges
        .iter()
        .filter(|(range, _)| range.start < at + ENTRY_BYTES && at < range.end)
        .map(|&(_, settled)| settled)
        .max()
}

/// What a read-only check of a cache medium found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// The superblock.
    pub superblock: Option<crate::format::Superblock>,
    /// Whether the last shutdown was clean.
    pub was_clean_shutdown: bool,
    /// The synced sequence number (0 if its word was corrupt).
    pub synced_seq: u64,
    /// Whether the synced sequence word was corrupt (beyond `format::SEQ_MAX`).
    pub synced_seq_invalid: bool,
    /// Free slots.
    pub free: u64,
    /// Valid clean entries (newest of their block).
    pub clean: u64,
    /// Valid dirty entries (newest of their block; includes clean ones that recovery would
    /// make dirty under the synced rule).
    pub dirty: u64,
    /// Older copies that recovery would drop.
    pub superseded: u64,
    /// Torn entries (a power cut mid-update; dropped by recovery, not corruption).
    pub torn: u64,
    /// Entries that fail validation, or that repeat the sequence number of another copy of
    /// their block.
    pub corrupt: u64,
    /// Entries recovery would not trust: on a range recorded lost (see
    /// [`RecoveryReport::lost_entries`]).
    pub lost_entries: u64,
}

/// Verifies a cache medium without changing it: the superblocks of every member (as
/// `Engine::open` would) and every metadata entry. A corrupt superblock or an incomplete set
/// is an error; corrupt entries are counted.
pub fn check_medium<M: Medium>(medium: &M) -> Result<CheckReport> {
    let (layout, superblock) = Layout::read(medium)?;
    let (was_clean_shutdown, synced_seq, synced_seq_invalid) = read_shutdown_state(medium)?;
    let backing_blocks = superblock.backing.size_bytes / u64::from(layout.block_size);
    let mut report = CheckReport {
        superblock: Some(superblock),
        was_clean_shutdown,
        synced_seq,
        synced_seq_invalid,
        ..Default::default()
    };
    let mut newest: std::collections::HashMap<u64, (u64, BlockState)> =
        std::collections::HashMap::new();
    let record = layout.members()[0].base + LOST_RECORD_OFFSET;
    let lost = read_lost_record(medium, record, &superblock.uuid);
    for slot in 0..layout.slot_count as u32 {
        let at = layout.entry_offset(slot);
        match lost_entry(&lost, at) {
            Some(true) => {
                report.lost_entries += 1;
                continue;
            }
            Some(false) => {
                if let DecodedEntry::Valid(entry) =
                    SlotEntry::decode(medium.load_u64(at), medium.load_u64(at + 8))
                    && entry.state == BlockState::Clean
                    && entry.seq <= synced_seq
                {
                    report.lost_entries += 1;
                    continue;
                }
            }
            None => {}
        }
        match SlotEntry::decode(medium.load_u64(at), medium.load_u64(at + 8)) {
            DecodedEntry::Free => report.free += 1,
            DecodedEntry::Torn => report.torn += 1,
            DecodedEntry::Corrupt => report.corrupt += 1,
            DecodedEntry::Valid(entry) if entry.lba >= backing_blocks => report.corrupt += 1,
            DecodedEntry::Valid(entry) => {
                let state = if entry.state == BlockState::Clean && entry.seq > synced_seq {
                    BlockState::Dirty
                } else {
                    entry.state
                };
                match newest.get(&entry.lba) {
                    Some(&(seq, _)) if seq == entry.seq => report.corrupt += 1,
                    Some(&(seq, _)) if seq > entry.seq => report.superseded += 1,
                    Some(_) => {
                        report.superseded += 1;
                        newest.insert(entry.lba, (entry.seq, state));
                    }
                    None => {
                        newest.insert(entry.lba, (entry.seq, state));
                    }
                }
            }
        }
    }
    for &(_, state) in newest.values() {
        match state {
            BlockState::Clean => report.clean += 1,
            BlockState::Dirty => report.dirty += 1,
        }
    }
    Ok(report)
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use std::sync::Arc;

    use pmcache_backing::BackingStore;
    use pmcache_media::{CrashMedium, CrashSwitch, Medium};

    use crate::format::{
        BlockState, DecodedEntry, SHUTDOWN_DIRTY, SHUTDOWN_WORD_OFFSET, SYNCED_SEQ_OFFSET,
        SlotEntry,
    };
    use crate::recovery::{CheckReport, RecoveryReport, check_medium};
    use crate::testing::full_buckets::{
        BACKING_FILL, BLOCK, FullBuckets, SLOTS, TestCache, assert_reads,
    };

    /// A record word of lost ranges names its run of cache lines and whether it is settled,
    /// for its own cache only: another cache's word (one left on the medium by an earlier
    /// format), a zero word and a word with any one bit flipped name nothing.
    #[test]
    fn a_lost_range_word_names_its_run_for_its_cache_only() {
        use super::{decode_lost_word, line_runs, lost_entry, lost_word};
        let (uuid, other) = ([7u8; 16], [8u8; 16]);
        for (first, log2, settled) in [(64, 6, false), (1, 0, true), ((1 << 40) - 1, 0, true)] {
            let word = lost_word(&uuid, first, log2, settled);
            assert_eq!(decode_lost_word(&uuid, word), Some((first, log2, settled)));
            assert_eq!(decode_lost_word(&other, word), None, "another cache's word");
            for bit in 0..64 {
                assert_eq!(decode_lost_word(&uuid, word ^ 1 << bit), None, "bit {bit} flipped");
            }
        }
        assert_eq!(decode_lost_word(&uuid, 0), None);
        // A page is one run; a range is widened to whole lines and cut into aligned runs.
        assert_eq!(line_runs(&(8192..12288)), [(128, 6)]);
        assert_eq!(line_runs(&(2 << 20..4 << 20)), [(1 << 15, 15)]);
        assert_eq!(line_runs(&(100..300)), [(1, 0), (2, 1), (4, 0)]);
        assert_eq!(line_runs(&(0..64)), [(0, 0)]);
        // An entry in a settled range and a pending one is in the settled one.
        let ranges = [(4096..8192, false), (4096..4160, true)];
        assert_eq!(lost_entry(&ranges, 4096 + 16), Some(true));
        assert_eq!(lost_entry(&ranges, 4096 + 64), Some(false));
        assert_eq!(lost_entry(&ranges, 8192), None);
    }

    /// A synced word that fails its check (here: a valid word for 50 with one bit flipped,
    /// which would otherwise read as a far larger number and keep unsynced clean copies
    /// clean) is not trusted: recovery and the check take it as 0 and say so, every clean
    /// entry is made dirty (written back again: safe), and the counters go on from the
    /// entries' numbers.
    #[test]
    fn a_corrupt_synced_word_is_taken_as_zero() {
        let fills = (0..16u64).map(|b| (b, 0xb0 + b as u8));
        let cache = TestCache::new(16, fills, 1);
        let medium = &cache.medium;
        cache.put(0, 1, BlockState::Clean, 10, 0xb1);
        cache.put(1, 2, BlockState::Dirty, 20, 0x22);
        medium.store_u64(SYNCED_SEQ_OFFSET, crate::format::encode_synced_seq(50) ^ 1 << 40);
        medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_DIRTY);
        medium.persist(0, medium.len_bytes());
        let checked = check_medium(medium).expect("check");
        assert!(checked.synced_seq_invalid && checked.synced_seq == 0, "{checked:?}");
        assert_eq!((checked.clean, checked.dirty), (0, 2));
        let (engine, report) = cache.open();
        assert!(report.synced_seq_invalid);
        assert_eq!((report.clean, report.dirty, report.clean_made_dirty), (0, 2, 1));
        let mut lane = engine.lane().expect("lane");
        lane.write(3 * BLOCK, &[0x33; BLOCK as usize], false).expect("write");
        drop(lane);
        let seq = engine.next_seq.load(std::sync::atomic::Ordering::SeqCst);
        assert!(seq > 20 && seq < 1 << 20, "next sequence number {seq}");
        assert_reads(&engine, [(1, 0xb1), (2, 0x22), (3, 0x33)]);
    }

    /// Every kind of metadata entry recovery meets — free, clean (older than the synced
    /// sequence, or equal to it), clean but newer than the synced sequence, dirty, an older
    /// copy scanned before and after its block's newest, torn, failing its check, naming a
    /// block past the backing store, an invalid state — lands in its own field of the report
    /// (and of `check_medium`'s, which changes nothing); the dropped entries are cleared from
    /// the medium, the kept ones serve their data, and the next write's sequence number
    /// follows the largest one recovered.
    #[test]
    fn recovery_sorts_and_counts_every_kind_of_entry() {
        let backing_blocks = 16u64;
        let backing_fill = |lba: u64| 0xb0 + lba as u8;
        let fills = (0..backing_blocks).map(|b| (b, backing_fill(b)));
        let cache = TestCache::new(backing_blocks, fills, 1);
        let (medium, geometry, slots) = (&cache.medium, cache.geometry, SLOTS);
        let put = |slot, lba, state, seq, fill| cache.put(slot, lba, state, seq, fill);
        let put_words = |slot, word0, word1| cache.put_words(slot, word0, word1);
        let synced_seq = 50;
        put(0, 1, BlockState::Clean, 10, backing_fill(1)); // clean, stays clean
        put(1, 2, BlockState::Clean, 60, backing_fill(2)); // clean after the sync: made dirty
        put(2, 3, BlockState::Dirty, 20, 0x33);
        put(3, 4, BlockState::Clean, 30, backing_fill(4)); // older (clean) copy, scanned first
        put(4, 4, BlockState::Dirty, 40, 0x44);
        put(5, 5, BlockState::Dirty, 45, 0x55);
        put(6, 5, BlockState::Clean, 15, backing_fill(5)); // older copy, scanned last
        let (word0, _) = SlotEntry { lba: 6, state: BlockState::Dirty, seq: 70 }.encode();
        put_words(7, word0, 71); // torn: word 1 of another update
        let (word0, word1) = SlotEntry { lba: 7, state: BlockState::Dirty, seq: 33 }.encode();
        put_words(8, word0 ^ 1, word1); // one bit flipped: fails its check
        put(9, backing_blocks, BlockState::Dirty, 34, 0x99); // past the backing store
        put_words(10, u64::MAX, 5); // no such state
        put(11, 9, BlockState::Clean, synced_seq, backing_fill(9)); // clean at the sync: stays
        put(12, 10, BlockState::Clean, 65, backing_fill(10)); // made dirty too
        let decoded = |slot: u32| {
            let at = geometry.entry_offset(slot);
            SlotEntry::decode(medium.load_u64(at), medium.load_u64(at + 8))
        };
        assert_eq!(decoded(7), DecodedEntry::Torn);
        assert_eq!(decoded(8), DecodedEntry::Corrupt);
        assert_eq!(decoded(10), DecodedEntry::Corrupt);
        medium.store_u64(SYNCED_SEQ_OFFSET, crate::format::encode_synced_seq(synced_seq));
        medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_DIRTY);
        medium.persist(0, medium.len_bytes());
        let image_before: Vec<u64> =
            (0..medium.len_bytes() / 8).map(|word| medium.load_u64(word * 8)).collect();

        let checked = check_medium(medium).expect("check");
        assert_eq!(
            CheckReport { superblock: None, ..checked },
            CheckReport {
                superblock: None,
                was_clean_shutdown: false,
                synced_seq,
                synced_seq_invalid: false,
                free: slots - 13,
                clean: 2,
                dirty: 5,
                superseded: 2,
                torn: 1,
                corrupt: 3,
                lost_entries: 0,
            }
        );
        assert_eq!(checked.superblock.map(|sb| sb.geometry), Some(geometry));
        assert!(
            (0..medium.len_bytes() / 8)
                .all(|word| medium.load_u64(word * 8) == image_before[word as usize]),
            "check_medium changed the medium"
        );

        let open = || cache.open();
        let (engine, report) = open();
        assert_eq!(
            RecoveryReport { duration_ns: 0, ..report },
            RecoveryReport {
                slots,
                clean: 2,
                dirty: 5,
                clean_made_dirty: 2,
                superseded: 2,
                torn: 1,
                corrupt: 3,
                was_clean_shutdown: false,
                synced_seq_invalid: false,
                lost_entries: 0,
                duration_ns: 0,
            }
        );
        assert_eq!(engine.stats().dirty_slots, 5);
        for dropped in [3, 6, 7, 8, 9, 10] {
            assert_eq!(decoded(dropped), DecodedEntry::Free, "slot {dropped} not cleared");
        }
        assert_eq!(
            decoded(1),
            DecodedEntry::Valid(SlotEntry { lba: 2, state: BlockState::Dirty, seq: 60 }),
            "the clean copy newer than the sync is dirty on the medium too"
        );
        // The next write-back entry follows the largest recovered sequence number, 65 (the
        // torn entry's 70/71 does not count).
        let mut lane = engine.lane().unwrap();
        lane.write(8 * BLOCK, &[0x88; BLOCK as usize], false).unwrap();
        let written: Vec<SlotEntry> = (0..slots as u32)
            .filter_map(|slot| match decoded(slot) {
                DecodedEntry::Valid(entry) if entry.lba == 8 => Some(entry),
                _ => None,
            })
            .collect();
        assert_eq!(written, [SlotEntry { lba: 8, state: BlockState::Dirty, seq: 66 }]);
        // Blocks 6 and 7 (their entries dropped) miss and are admitted clean, after 66.
        let mut got = vec![0u8; BLOCK as usize];
        for (lba, fill) in [
            (1, backing_fill(1)),
            (2, backing_fill(2)),
            (3, 0x33),
            (4, 0x44),
            (5, 0x55),
            (6, backing_fill(6)),
            (7, backing_fill(7)),
            (8, 0x88),
            (9, backing_fill(9)),
            (10, backing_fill(10)),
        ] {
            lane.read(lba * BLOCK, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == fill), "block {lba}: {:#x}, not {fill:#x}", got[0]);
        }
        drop(lane);
        drop(engine);

        // Attached again: nothing left to drop. The two blocks admitted clean (sequence
        // numbers 67 and 68, past the synced 50) are made dirty.
        let (engine, report) = open();
        assert_eq!(
            RecoveryReport { duration_ns: 0, ..report },
            RecoveryReport {
                slots,
                clean: 2,
                dirty: 8,
                clean_made_dirty: 2,
                was_clean_shutdown: false,
                ..Default::default()
            }
        );
        // A clean shutdown syncs the backing store: every copy is then at or below the synced
        // sequence, and both reports say the shutdown was clean.
        engine.shutdown().unwrap();
        drop(engine);
        let checked = check_medium(medium).expect("check");
        assert!(checked.was_clean_shutdown && checked.synced_seq >= 68, "{checked:?}");
        let (_engine, report) = open();
        assert!(report.was_clean_shutdown && report.clean_made_dirty == 0, "{report:?}");
    }

    /// Recovery that must drop a block's newest (clean) copy for want of index room must not
    /// let an older dirty copy of that block, scanned later, take its place: the backing store
    /// holds the newer data.
    #[test]
    fn an_older_copy_does_not_replace_a_newer_one_dropped_for_room() {
        let cache = FullBuckets::new();
        for (slot, &lba) in cache.fillers.iter().enumerate() {
            cache.cache.put(slot as u32, lba, BlockState::Clean, 100 + slot as u64, BACKING_FILL);
        }
        // x's newest copy: clean (the backing store holds it), dropped for room.
        cache.cache.put(24, cache.x, BlockState::Clean, 300, BACKING_FILL);
        // An older dirty copy a power cut left behind.
        cache.cache.put(25, cache.x, BlockState::Dirty, 200, 0x33);
        let (engine, report) = cache.cache.open();
        assert_eq!(report.superseded, 1, "{report:?}");
        assert_reads(&engine, [(cache.x, BACKING_FILL)]);
    }

    /// Power cut at every persist point of a recovery that must let a block's last copy go
    /// for index room, then recovery again: the block's older copies never come back (the
    /// backing store holds its newest data). Two cases: the newest copy of the block whose
    /// buckets are full is clean and dropped, with an older dirty copy scanned after it; and
    /// a clean occupant evicted for a dirty newcomer, with an older dirty copy of the
    /// occupant scanned before it.
    #[test]
    fn a_power_cut_inside_recovery_never_brings_back_an_older_copy() {
        let cases = [false, true].into_iter().flat_map(|e| (0..16).map(move |seed| (e, seed)));
        for (evicting, seed) in cases {
            let mut finished = false;
            for point in 1.. {
                let cache = FullBuckets::with_seed(seed);
                let (f0, x) = (cache.fillers[0], cache.x);
                let mut expected: Vec<(u64, u8)> = Vec::new();
                if evicting {
                    // f0's only clean copy (slot 1) is the occupant x (dirty) takes the place
                    // of; its older dirty copy sits in slot 0.
                    cache.cache.put(0, f0, BlockState::Dirty, 50, 0x66);
                    for (i, &lba) in cache.fillers.iter().enumerate() {
                        let (state, fill) = if i == 0 {
                            (BlockState::Clean, BACKING_FILL)
                        } else {
                            (BlockState::Dirty, FullBuckets::filler_fill(i))
                        };
                        cache.cache.put(i as u32 + 1, lba, state, 100 + i as u64, fill);
                        expected.push((lba, fill));
                    }
                    cache.cache.put(25, x, BlockState::Dirty, 300, 0x77);
                    expected.push((x, 0x77));
                } else {
                    for (i, &lba) in cache.fillers.iter().enumerate() {
                        cache.cache.put(
                            i as u32,
                            lba,
                            BlockState::Clean,
                            100 + i as u64,
                            BACKING_FILL,
                        );
                        expected.push((lba, BACKING_FILL));
                    }
                    // x's newest copy is clean (let go for room); an older dirty one follows.
                    cache.cache.put(24, x, BlockState::Clean, 300, BACKING_FILL);
                    cache.cache.put(25, x, BlockState::Dirty, 200, 0x33);
                    expected.push((x, BACKING_FILL));
                }
                let medium = &cache.cache.medium;
                medium.persist(0, medium.len_bytes());
                cache.cache.switch.arm(cache.cache.switch.points() + point);
                let opened = cache.cache.open_on(medium.clone());
                if !cache.cache.switch.has_crashed() {
                    assert_reads(&opened.expect("recovery").0, expected);
                    finished = true;
                    break;
                }
                drop(opened);
                let image = medium.crash_image().expect("power was cut");
                let after = Arc::new(CrashMedium::from_image(image, CrashSwitch::new(), seed));
                let (engine, _) = cache.cache.open_on(after).expect("recovery after the cut");
                assert_reads(&engine, expected);
            }
            assert!(finished);
        }
    }

    /// A dirty block that finds its index buckets full at recovery takes the place of a clean
    /// occupant — never of a dirty one, and it is never dropped itself: both would lose
    /// acknowledged data.
    #[test]
    fn a_dirty_block_with_full_buckets_takes_a_clean_occupants_place() {
        let cache = FullBuckets::new();
        // Dirty and clean occupants alternate, a dirty one first.
        let fill =
            |slot: usize| if slot.is_multiple_of(2) { 0x10 + slot as u8 } else { BACKING_FILL };
        for (slot, &lba) in cache.fillers.iter().enumerate() {
            let state = if slot.is_multiple_of(2) { BlockState::Dirty } else { BlockState::Clean };
            cache.cache.put(slot as u32, lba, state, 100 + slot as u64, fill(slot));
        }
        cache.cache.put(24, cache.x, BlockState::Dirty, 300, 0x77);
        let (engine, report) = cache.cache.open();
        assert_eq!((report.dirty, report.clean), (13, 11), "{report:?}");
        let fillers = cache.fillers.iter().enumerate().map(|(slot, &lba)| (lba, fill(slot)));
        assert_reads(&engine, fillers.chain([(cache.x, 0x77)]));
    }

    /// When every occupant of its buckets is dirty too, the block is written back to its place
    /// on the backing store before its copy is let go.
    #[test]
    fn a_dirty_block_among_dirty_occupants_is_written_back_before_it_is_let_go() {
        let cache = FullBuckets::new();
        for (slot, &lba) in cache.fillers.iter().enumerate() {
            cache.cache.put(
                slot as u32,
                lba,
                BlockState::Dirty,
                100 + slot as u64,
                0x10 + slot as u8,
            );
        }
        cache.cache.put(24, cache.x, BlockState::Dirty, 300, 0x77);
        let (engine, report) = cache.cache.open();
        assert_eq!((report.dirty, report.clean), (24, 0), "{report:?}");
        let mut on_backing = vec![0u8; BLOCK as usize];
        engine.backing().read_at(&mut on_backing, cache.x * BLOCK).unwrap();
        assert!(on_backing.iter().all(|&b| b == 0x77), "backing holds {:#x}", on_backing[0]);
        let fillers = cache.fillers.iter().enumerate().map(|(slot, &lba)| (lba, 0x10 + slot as u8));
        assert_reads(&engine, fillers.chain([(cache.x, 0x77)]));
    }

    /// Two copies of a block under one sequence number cannot be ordered; the engine issues
    /// each number once, so only corruption makes such a pair. Recovery (by the index, and
    /// for a block whose buckets are full) and the check count the second copy as corrupt,
    /// not as superseded, and recovery keeps the copy in the lower slot.
    #[test]
    fn two_copies_under_one_sequence_number_are_corruption() {
        let fills = (0..16u64).map(|b| (b, 0xb0 + b as u8));
        let cache = TestCache::new(16, fills, 1);
        cache.put(3, 5, BlockState::Dirty, 40, 0x55);
        cache.put(7, 5, BlockState::Dirty, 40, 0x66);
        cache.put(8, 6, BlockState::Dirty, 41, 0x67);
        cache.put(9, 6, BlockState::Dirty, 42, 0x68); // newer: supersedes, not corrupt
        cache.medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_DIRTY);
        cache.medium.persist(0, cache.medium.len_bytes());
        let checked = check_medium(&cache.medium).expect("check");
        assert_eq!((checked.corrupt, checked.superseded, checked.dirty), (1, 1, 2), "{checked:?}");
        let (engine, report) = cache.open();
        assert_eq!((report.corrupt, report.superseded, report.dirty), (1, 1, 2), "{report:?}");
        assert_reads(&engine, [(5, 0x55), (6, 0x68)]);

        // The same for a block whose index buckets are full: settled after the scan.
        let cache = FullBuckets::new();
        for (slot, &lba) in cache.fillers.iter().enumerate() {
            cache.cache.put(slot as u32, lba, BlockState::Dirty, 100 + slot as u64, 0x10);
        }
        cache.cache.put(30, cache.x, BlockState::Dirty, 300, 0x77);
        cache.cache.put(24, cache.x, BlockState::Dirty, 300, 0x78);
        cache.cache.put(25, cache.x, BlockState::Dirty, 200, 0x79);
        // Two older copies under one number: superseded by the kept one, not corrupt.
        cache.cache.put(26, cache.x, BlockState::Dirty, 200, 0x7a);
        cache.cache.medium.persist(0, cache.cache.medium.len_bytes());
        let checked = check_medium(&cache.cache.medium).expect("check");
        assert_eq!((checked.corrupt, checked.superseded), (1, 2), "{checked:?}");
        let (engine, report) = cache.cache.open();
        assert_eq!((report.corrupt, report.superseded), (1, 2), "{report:?}");
        assert_reads(&engine, [(cache.x, 0x78)]);
    }
}
