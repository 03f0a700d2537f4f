//! Attaching an existing cache: the index, free space and dirty set are rebuilt from the
//! medium alone (the cache is its own journal; there is no separate log).
//!
//! Rules (docs/DURABILITY.md, "Recovery"):
//! - the newest entry (largest sequence number) of each block wins; older ones are freed;
//! - torn and corrupt entries are dropped, counted and reported — never trusted;
//! - a clean entry newer than the synced sequence number may be newer than what the backing
//!   store durably holds, so it becomes dirty (and is written back later);
//! - everything else that was clean stays cached and clean.

use pmcache_backing::BackingStore;
use pmcache_media::Medium;

use crate::cache::{Engine, first_seq_after, read_shutdown_state};
use crate::clock::Clock;
use crate::config::Config;
use crate::error::Result;
use crate::format::{BlockState, DecodedEntry, HEADER_BYTES, SlotEntry, Superblock};
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
    /// Entries that fail validation (dropped).
    pub corrupt: u64,
    /// Whether the previous shutdown was clean.
    pub was_clean_shutdown: bool,
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
        let superblock = read_superblock(&medium)?;
        superblock.check_backing(&backing.identity())?;
        let (was_clean_shutdown, synced_seq) = read_shutdown_state(&medium)?;
        let mut engine = Self::assemble(medium, backing, clock, config, superblock, synced_seq)?;
        let mut report = engine.rebuild(synced_seq)?;
        report.was_clean_shutdown = was_clean_shutdown;
        engine.recovered_dirty = report.dirty;
        engine.mark_attached();
        report.duration_ns = engine.clock.now_ns().saturating_sub(started_ns);
        Ok((engine, report))
    }

    fn rebuild(&mut self, synced_seq: u64) -> Result<RecoveryReport> {
        let slot_count = self.slots.len();
        let mut report = RecoveryReport { slots: u64::from(slot_count), ..Default::default() };
        let mut free = Vec::new();
        // Blocks whose newest copy so far was let go to make room: block -> its sequence.
        let mut dropped = std::collections::HashMap::new();
        let mut max_seq = synced_seq;
        for slot in 0..slot_count {
            let mut entry = match self.read_entry(slot) {
                DecodedEntry::Free => {
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
            if !dropped.is_empty()
                && dropped.get(&entry.lba).is_some_and(|&newer| newer >= entry.seq)
            {
                // A newer copy of this block was already let go to make room (its data is on
                // the backing store): this older one must not come back in its place.
                report.superseded += 1;
                self.clear_entry(slot);
                free.push(slot);
                continue;
            }
            if let Some(found) = self.index.lookup(entry.lba) {
                report.superseded += 1;
                let DecodedEntry::Valid(other) = self.read_entry(found.slot) else {
                    unreachable!("an indexed slot holds a valid entry")
                };
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
                // factor): a clean block is dropped; a dirty one takes the place of a clean
                // occupant.
                if !self.make_room_at_recovery(&entry, slot, &mut free, &mut dropped)? {
                    continue;
                }
            }
            if made_dirty {
                let at = self.geometry.entry_offset(slot);
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
        self.medium.drain();
        for slot in 0..slot_count {
            match self.slots.load(slot).state() {
                SlotState::Clean => report.clean += 1,
                SlotState::Dirty => report.dirty += 1,
                SlotState::Free => {}
            }
        }
        self.next_seq.store(first_seq_after(max_seq), Ordering::SeqCst);
        self.pool.put(free);
        Ok(report)
    }

    /// Frees a clean occupant of `entry`'s index buckets (or drops `entry` if it is clean).
    /// Returns whether `entry` is now indexed.
    fn make_room_at_recovery(
        &mut self,
        entry: &SlotEntry,
        slot: u32,
        free: &mut Vec<u32>,
        dropped: &mut std::collections::HashMap<u64, u64>,
    ) -> Result<bool> {
        if entry.state == BlockState::Clean {
            self.clear_entry(slot);
            free.push(slot);
            dropped.insert(entry.lba, entry.seq);
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
                // Sixteen dirty neighbours: write this block back and let it go.
                let mut data = vec![0u8; self.geometry.block_size as usize];
                self.medium.read(self.geometry.data_offset(slot), &mut data);
                let offset = entry.lba * u64::from(self.geometry.block_size);
                self.backing.write_at(&data, offset)?;
                self.backing.flush()?;
                self.clear_entry(slot);
                free.push(slot);
                dropped.insert(entry.lba, entry.seq);
                return Ok(false);
            };
            let DecodedEntry::Valid(victim_entry) = self.read_entry(victim) else {
                unreachable!("an indexed slot holds a valid entry")
            };
            let found = self.index.lookup(victim_entry.lba).expect("victim is indexed");
            self.index.remove(&found);
            dropped.insert(victim_entry.lba, victim_entry.seq);
            self.clear_entry(victim);
            self.slots.free(victim);
            free.push(victim);
        }
    }
}

/// What a read-only check of a cache medium found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// The superblock.
    pub superblock: Option<Superblock>,
    /// Whether the last shutdown was clean.
    pub was_clean_shutdown: bool,
    /// The synced sequence number.
    pub synced_seq: u64,
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
    /// Entries that fail validation.
    pub corrupt: u64,
}

/// Verifies a cache medium without changing it: the superblock (as `Engine::open` would) and
/// every metadata entry. A corrupt superblock is an error; corrupt entries are counted.
pub fn check_medium<M: Medium>(medium: &M) -> Result<CheckReport> {
    let superblock = read_superblock(medium)?;
    let (was_clean_shutdown, synced_seq) = read_shutdown_state(medium)?;
    let geometry = superblock.geometry;
    let backing_blocks = superblock.backing.size_bytes / u64::from(geometry.block_size);
    let mut report = CheckReport {
        superblock: Some(superblock),
        was_clean_shutdown,
        synced_seq,
        ..Default::default()
    };
    let mut newest: std::collections::HashMap<u64, (u64, BlockState)> =
        std::collections::HashMap::new();
    for slot in 0..geometry.slot_count as u32 {
        let at = geometry.entry_offset(slot);
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
                    Some(&(seq, _)) if seq >= entry.seq => report.superseded += 1,
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

/// Reads and validates the superblock header of a medium.
fn read_superblock<M: Medium>(medium: &M) -> Result<Superblock> {
    if medium.len_bytes() < HEADER_BYTES as u64 {
        return Err(crate::format::FormatError::BadGeometry(format!(
            "the medium is {} bytes, smaller than a superblock",
            medium.len_bytes()
        ))
        .into());
    }
    let mut header = [0u8; HEADER_BYTES];
    medium.read(0, &mut header);
    Ok(Superblock::decode(&header, medium.len_bytes())?)
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use std::sync::Arc;

    use pmcache_backing::{BackingStore, PsyncFile};
    use pmcache_media::{CrashMedium, CrashSwitch, Medium};

    use crate::MonotonicClock;
    use crate::cache::Engine;
    use crate::config::{CacheMode, Config};
    use crate::format::{BlockState, SUPERBLOCK_BYTES, SYNCED_SEQ_OFFSET, SlotEntry};
    use crate::index::Index;

    const BLOCK: u64 = 4096;

    /// Recovery that must drop a block's newest (clean) copy for want of index room must not
    /// let an older dirty copy of that block, scanned later, take its place: the backing store
    /// holds the newer data.
    #[test]
    fn an_older_copy_does_not_replace_a_newer_one_dropped_for_room() {
        let slots = 64u64;
        let medium_bytes = (SUPERBLOCK_BYTES + slots * 16).next_multiple_of(4096) + slots * BLOCK;
        let medium = Arc::new(CrashMedium::new(medium_bytes, CrashSwitch::new(), 1));
        // 3 x 8 + 1 blocks sharing their three candidate index buckets: one more than fit.
        let slot_count = crate::format::Geometry::for_medium(medium_bytes, BLOCK as u32)
            .unwrap()
            .slot_count as u32;
        let index = Index::new(slot_count).unwrap();
        let target = index.candidate_buckets(0);
        let colliding: Vec<u64> = (0..1u64 << 36)
            .filter(|&lba| index.candidate_buckets(lba) == target)
            .take(25)
            .collect();
        let (fillers, x) = (&colliding[..24], colliding[24]);
        let dir = tempfile::tempdir().unwrap();
        let backing_path = dir.path().join("backing");
        std::fs::File::create(&backing_path).unwrap().set_len((x + 1) * BLOCK).unwrap();
        let config = Config { mode: CacheMode::WriteBack, max_lanes: 2, ..Config::default() };
        let engine = Engine::format(
            medium.clone(),
            PsyncFile::open(&backing_path).unwrap(),
            MonotonicClock::default(),
            &config,
        )
        .expect("format");
        let geometry = engine.superblock().geometry;
        assert_eq!(geometry.slot_count, u64::from(slot_count));
        // The backing store holds x's newest data (0x22), which the cache had as clean.
        engine.backing().write_at(&[0x22; BLOCK as usize], x * BLOCK).unwrap();
        drop(engine);
        let put = |slot: u32, lba: u64, state: BlockState, seq: u64, fill: u8| {
            medium.write(geometry.data_offset(slot), &[fill; BLOCK as usize]);
            let (word0, word1) = SlotEntry { lba, state, seq }.encode();
            let at = geometry.entry_offset(slot);
            medium.store_u64(at + 8, word1);
            medium.store_u64(at, word0);
        };
        for (slot, &lba) in fillers.iter().enumerate() {
            put(slot as u32, lba, BlockState::Clean, 100 + slot as u64, 0x11);
        }
        put(24, x, BlockState::Clean, 300, 0x22); // x's newest copy: clean, dropped for room
        put(25, x, BlockState::Dirty, 200, 0x33); // an older dirty copy a power cut left behind
        medium.store_u64(SYNCED_SEQ_OFFSET, 1000);
        medium.persist(0, medium.len_bytes());
        let (engine, report) = Engine::open(
            medium.clone(),
            PsyncFile::open(&backing_path).unwrap(),
            MonotonicClock::default(),
            &config,
        )
        .expect("recovery");
        assert!(report.superseded >= 1, "{report:?}");
        let mut lane = engine.lane().unwrap();
        let mut got = vec![0u8; BLOCK as usize];
        lane.read(x * BLOCK, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0x22), "block {x} rolled back to {:#x}", got[0]);
    }
}
