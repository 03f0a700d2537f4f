//! Cached data read back with its checks: the medium may not return a line (poisoned: a PM
//! device's uncorrectable error), and in a cache formatted with data checksums
//! (`Config::data_crc`) each slot's data must match the CRC32C written with it.
//!
//! Every read of a slot's data — a hit, a partial write's merge, a write-back — goes through
//! here. A block that fails is never served: a clean one is dropped from the cache and read
//! from the backing store, which has it; a dirty one (the only copy) fails its request with
//! [`Error::CachedBlockUnreadable`], stays dirty and is not written back.
//!
//! # Lost ranges
//!
//! A poisoned line takes more than itself with it. The mapped medium replaces the whole page
//! (or the mapping's granule: `pmcache_media::PmemFile::poison_granule_bytes`) around a
//! poisoned line with zeroed private memory: from then on every byte of it reads as zero, and
//! what is stored there never reaches the medium. Such a *lost range* is listed by
//! [`Medium::poisoned_ranges`]. It may hold other slots' data (blocks under 4 KiB), other
//! slots' checksums, and metadata entries (the checksum array follows the entries without a
//! page boundary between them). The engine deals with it as soon as it hears of it (a read
//! that fails with [`Unreadable::Poisoned`], or the medium's list at attach):
//!
//! 1. *Registered*: every slot whose data, checksum or entry lies in the range is retired (no
//!    block is placed there again, nothing is stored there again), and the range is written
//!    to the medium's record of lost ranges, *pending*, durably, before anything else.
//! 2. *Settled*, under the stripes of every block in those slots (only tried, never waited
//!    for: a busy stripe puts it off to a later allocation): each dirty block whose data can
//!    still be read (checked against its checksum where that is not lost) is written back to
//!    the backing store; one sync makes those and every clean block durable there. Then the
//!    record says *settled* for each range that holds no dirty block left unwritten, and the
//!    blocks are dropped — except a dirty block whose data is lost or was refused (its only
//!    copy: it stays, unreadable, marked refused), and a block whose entry lies in a range
//!    still pending.
//!
//! At the next attach (`recovery.rs`) the record decides what entries in a lost range are
//! worth: in a settled range, nothing — they are not even read (their blocks were written
//! back before the range was settled; their removal since never reached the medium, so they
//! may be stale). In a pending range (the process stopped before it was settled), a clean
//! entry at or below the synced sequence number is not trusted (the backing store holds that
//! data or newer), every other entry is trusted as usual (it may be a dirty block's only
//! copy); the range is then settled at once. Every slot touching a recorded range is retired.
//!
//! The record is 384 words in member 0's superblock page (bytes 1024..4096, which format
//! does not write). Each word names an aligned power-of-two run of cache lines, with a check
//! that binds it to the cache's uuid: a word left there by an earlier cache on the medium, or
//! a corrupt one, names nothing and is free. A range holding entries that cannot be recorded
//! (the record full, or the record's own page lost) stops the process: the next start must
//! not trust what that range held.

use super::*;
use crate::error::Unreadable;
use crate::format::{DATA_CRC_BYTES, ENTRY_BYTES};
use crate::freepool::Lost;
use crate::recovery::{
    LOST_LINE_BITS, LOST_RECORD_OFFSET, LOST_RECORD_WORDS, decode_lost_word, line_runs, lost_word,
    read_lost_record,
};
use std::ops::Range;

/// Allocations let pass after a settling that found a stripe busy, and after one the backing
/// store (or an unreadable dirty block in an entry range) stopped.
const SETTLE_RETRY_BUSY: u64 = 16;
const SETTLE_RETRY_FAILED: u64 = 1024;

/// `range` widened to whole cache lines.
fn whole_lines(range: Range<u64>) -> Range<u64> {
    let line = pmcache_media::CACHE_LINE_BYTES;
    range.start / line * line..range.end.div_ceil(line) * line
}

/// The indices `0..count` of an array of `stride`-byte items from `area` whose items overlap
/// `range` (offsets of one member).
fn overlapping(area: u64, stride: u64, count: u64, range: &Range<u64>) -> Range<u64> {
    if range.end <= area || count == 0 {
        return 0..0;
    }
    let end = (range.end - area).div_ceil(stride).min(count);
    let first = (range.start.saturating_sub(area) / stride).min(end);
    first..end
}

fn poisoned(p: pmcache_media::Poisoned) -> Unreadable {
    Unreadable::Poisoned { offset: p.offset }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Writes the checksum of `data`, the block just written to free `slot`, and starts its
    /// write-back, so that the fence that makes the data durable makes it durable too (before
    /// the slot's entry). Nothing without data checksums.
    #[inline]
    pub(super) fn store_data_crc(&self, slot: u32, data: &[u8]) {
        if self.layout.data_crc() {
            self.store_crc(slot, crc32c::crc32c(data));
        }
    }

    /// [`Engine::store_data_crc`] for a block of zeroes.
    #[inline]
    pub(super) fn store_zero_block_crc(&self, slot: u32) {
        if self.layout.data_crc() {
            self.store_crc(slot, self.zero_block_crc);
        }
    }

    /// Starts loading the line of `slot`'s checksum for a store to it (a cache with data
    /// checksums): the miss overlaps the data's copy.
    #[inline]
    pub(super) fn prefetch_crc_store(&self, slot: u32) {
        if self.layout.data_crc() {
            self.medium.prefetch(self.layout.crc_offset(slot), DATA_CRC_BYTES);
        }
    }

    fn store_crc(&self, slot: u32, crc: u32) {
        let at = self.layout.crc_offset(slot);
        self.medium.write(at, &crc.to_le_bytes());
        self.medium.flush(at, DATA_CRC_BYTES);
    }

    /// The checksum stored for `slot` (a cache with data checksums).
    #[inline]
    pub(super) fn stored_crc(&self, slot: u32) -> std::result::Result<u32, Unreadable> {
        let mut stored = [0u8; DATA_CRC_BYTES as usize];
        self.medium.read_checked(self.layout.crc_offset(slot), &mut stored).map_err(poisoned)?;
        Ok(u32::from_le_bytes(stored))
    }

    /// Checks a whole block against the checksum `stored` for it.
    #[inline]
    pub(super) fn verify(data: &[u8], stored: u32) -> std::result::Result<(), Unreadable> {
        let computed = crc32c::crc32c(data);
        if computed == stored { Ok(()) } else { Err(Unreadable::Mismatch { stored, computed }) }
    }

    /// Reads `slot`'s whole block into `out` and checks it. The caller holds the block's
    /// stripe (or otherwise knows the slot keeps its block meanwhile).
    pub(crate) fn read_block_checked(
        &self,
        slot: u32,
        out: &mut [u8],
    ) -> std::result::Result<(), Unreadable> {
        self.medium.read_checked(self.layout.data_offset(slot), out).map_err(poisoned)?;
        if self.layout.data_crc() {
            Self::verify(out, self.stored_crc(slot)?)?;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes at `in_block` of `slot`'s block and checks them, as
    /// [`Engine::read_block_checked`]; with data checksums a part of a block is read whole
    /// into `whole` (a block) first.
    pub(super) fn read_slot_checked(
        &self,
        slot: u32,
        in_block: usize,
        out: &mut [u8],
        whole: &mut [u8],
    ) -> std::result::Result<(), Unreadable> {
        if !self.layout.data_crc() {
            let at = self.layout.data_offset(slot) + in_block as u64;
            return self.medium.read_checked(at, out).map_err(poisoned);
        }
        if out.len() == whole.len() {
            return self.read_block_checked(slot, out);
        }
        self.read_block_checked(slot, whole)?;
        out.copy_from_slice(&whole[in_block..in_block + out.len()]);
        Ok(())
    }

    /// Registers the ranges the medium reports lost (at format: its own list), retiring every
    /// slot touching them; the first allocation settles them. Returns how many slots were
    /// retired.
    pub(crate) fn retire_poisoned_slots(&self) -> u64 {
        let before = self.pools.retired();
        self.register_lost_ranges(&[]);
        self.pools.retired() - before
    }

    /// Registers lost ranges not known yet (see the module): those `recorded` on the medium
    /// (at attach, with whether each is settled) and those the medium reports now. Each
    /// one's slots are retired, and a new one is recorded pending before anything else.
    ///
    /// # Panics
    /// When a new range holding metadata entries cannot be recorded (the record full, or its
    /// own page lost): a fail-stop, since the next start would trust what the range held.
    pub(crate) fn register_lost_ranges(&self, recorded: &[(Range<u64>, bool)]) {
        // Read before the medium's list: every loss it counts is in the list read after.
        let losses = self.medium.losses();
        let on_record = recorded.iter().map(|(range, settled)| (range.clone(), *settled, true));
        let reported = self.medium.poisoned_ranges().into_iter();
        let reported = reported.map(|range| (whole_lines(range), false, false));
        for (range, settled, on_record) in on_record.chain(reported) {
            if range.is_empty() || self.pools.lost.covers(&range) {
                continue;
            }
            let slots = self.slots_touching(&range);
            for &slot in &slots {
                self.pools.retire(slot);
            }
            let recorded = on_record || self.record_lost(&range, false);
            if !recorded && self.holds_entries(&range) {
                panic!(
                    "the cache medium lost bytes {range:?}, which hold metadata entries, and the \
                     record of lost ranges cannot take it (full, or itself lost): stopping, so \
                     that the next start does not trust the entries there"
                );
            }
            self.pools.lost.add(Lost { range, slots, settled });
        }
        self.pools.lost.losses_known.fetch_max(losses, Ordering::AcqRel);
    }

    /// Writes `range` into the medium's record of lost ranges (see the module), pending or
    /// `settled`, and makes it durable. False if it cannot be: the record is full, or lies in
    /// a lost range itself (its stores would not reach the medium), or the range lies beyond
    /// what a word names.
    fn record_lost(&self, range: &Range<u64>, settled: bool) -> bool {
        let record = self.layout.members()[0].base + LOST_RECORD_OFFSET;
        let record_len = LOST_RECORD_WORDS * 8;
        if (range.start < record + record_len && record < range.end)
            || self.pools.lost.touches(record, record_len, false)
        {
            return false;
        }
        let _one_writer = lock(&self.pools.lost.record_lock);
        let uuid = self.superblock.uuid;
        for (first_line, lines_log2) in line_runs(range) {
            if first_line >> LOST_LINE_BITS != 0 {
                return false;
            }
            let (mut same, mut unused) = (None, None);
            for i in 0..LOST_RECORD_WORDS {
                let at = record + 8 * i;
                match decode_lost_word(&uuid, self.medium.load_u64(at)) {
                    Some((first, log2, _)) if (first, log2) == (first_line, lines_log2) => {
                        same = Some(at);
                        break;
                    }
                    Some(_) => {}
                    None => {
                        unused.get_or_insert(at);
                    }
                }
            }
            let Some(at) = same.or(unused) else { return false };
            self.medium.store_u64(at, lost_word(&uuid, first_line, lines_log2, settled));
            self.medium.persist(at, 8);
        }
        true
    }

    /// The ranges the medium's record names (see the module), with whether each is settled.
    pub(crate) fn recorded_lost_ranges(&self) -> Vec<(Range<u64>, bool)> {
        let record = self.layout.members()[0].base + LOST_RECORD_OFFSET;
        read_lost_record(&self.medium, record, &self.superblock.uuid)
    }

    /// Whether `range` holds metadata entries of some member.
    fn holds_entries(&self, range: &Range<u64>) -> bool {
        self.layout.members().iter().any(|member| {
            let entries = member.base + member.geometry.meta_offset;
            let end = entries + ENTRY_BYTES * member.geometry.slot_count;
            range.start < end && entries < range.end
        })
    }

    /// The slots whose data, checksum or metadata entry overlaps `range`, ascending.
    pub(crate) fn slots_touching(&self, range: &Range<u64>) -> Vec<u32> {
        let mut slots = Vec::new();
        for member in self.layout.members() {
            let geometry = &member.geometry;
            let span = member.base..member.base + geometry.medium_bytes;
            if range.end <= span.start || span.end <= range.start {
                continue;
            }
            let relative =
                range.start.max(span.start) - member.base..range.end.min(span.end) - member.base;
            let count = geometry.slot_count;
            let mut areas = vec![
                (geometry.meta_offset, ENTRY_BYTES),
                (geometry.data_offset, u64::from(geometry.block_size)),
            ];
            if geometry.data_crc {
                areas.push((geometry.meta_offset + ENTRY_BYTES * count, DATA_CRC_BYTES));
            }
            for (area, stride) in areas {
                let indices = overlapping(area, stride, count, &relative);
                slots.extend(indices.map(|i| member.first_slot + i as u32));
            }
        }
        slots.sort_unstable();
        slots.dedup();
        slots
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Whether what this lane stored for `slot` since it took the slot — data, checksum,
    /// entry, all fenced — reached the medium: false if a range they lie on was lost
    /// meanwhile (the stores went to the replacement, see the module). A write asks before
    /// it switches its block in, an admission before it publishes its copy. The cost while
    /// the medium has lost nothing new: a compiler fence and three loads (the losing side
    /// fences every thread: `Medium::losses`).
    #[inline]
    pub(super) fn stores_landed(&self, slot: u32) -> bool {
        let engine = self.engine;
        if engine.fence_asymmetric {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        let losses = engine.medium.losses();
        if losses == engine.pools.lost.losses_known.load(Ordering::Acquire)
            && !engine.pools.is_retired(slot)
        {
            return true;
        }
        engine.register_lost_ranges(&[]);
        !engine.pools.is_retired(slot)
    }

    /// Lets go of `slot`, taken for a block whose stores did not all land (see
    /// [`Lane::stores_landed`]): its entry is cleared durably where it is not lost itself (it
    /// may have landed without the data), and the slot goes back to the lane, which drops it
    /// (retired). The caller holds the stripe the slot's block was for and has taken back
    /// any index entry it made for it.
    pub(super) fn abandon_unlanded(&mut self, slot: u32) {
        self.abandon_unlanded_entry(slot);
        self.give_back(slot);
    }

    /// Makes the clean copy in `slot` (data and entry persisted) the block's, through the
    /// index entry `replaced` (the hidden one inserted for it, or the copy it replaces), if
    /// its stores landed (see [`Lane::stores_landed`]): true. Otherwise takes `replaced` out
    /// of the index and clears the slot's entry where it landed: false, and the caller gives
    /// the slot back (a replaced copy's slot is the caller's to free either way). The caller
    /// holds the block's stripe.
    pub(super) fn reveal_clean_copy(&mut self, replaced: &Found, slot: u32) -> bool {
        let engine = self.engine;
        if self.stores_landed(slot) {
            engine.index.replace(replaced, slot, engine.slots.generation(slot));
            engine.slots.publish(slot, SlotState::Clean);
            return true;
        }
        engine.index.remove(replaced);
        self.abandon_unlanded_entry(slot);
        false
    }

    /// [`Lane::abandon_unlanded`] but for giving the slot back, which the caller does.
    pub(super) fn abandon_unlanded_entry(&mut self, slot: u32) {
        let engine = self.engine;
        let entry_at = engine.layout.entry_offset(slot);
        if !engine.pools.lost.touches(entry_at, ENTRY_BYTES, false) {
            engine.clear_entry(slot);
            self.fence();
        }
        bump(&self.counters().unlanded_stores, 1);
    }

    /// Counts `slot`'s failed check (`why`); for a poisoned line, retires the slot and deals
    /// with the range of the medium the line took with it (see the module); marks a dirty
    /// slot so that reclaim tries it after every other dirty one. The caller holds the stripe
    /// of the block in it. Returns whether it is dirty (the block's only copy).
    pub(super) fn note_unreadable(&mut self, slot: u32, why: Unreadable) -> bool {
        let engine = self.engine;
        let counters = self.counters();
        match why {
            Unreadable::Poisoned { .. } => {
                bump(&counters.medium_read_errors, 1);
                engine.pools.retire(slot);
                // The line took a range of the medium with it: every block there is dealt
                // with now (see the module), this one too if it can be written back — it is
                // then clean, and the caller drops it like any clean block that fails.
                engine.register_lost_ranges(&[]);
                self.settle_lost_ranges(Some(slot), None);
            }
            Unreadable::Mismatch { .. } => bump(&counters.data_crc_mismatches, 1),
        }
        let word = engine.slots.load(slot);
        if word.state() == SlotState::Dirty {
            bump(&counters.unreadable_dirty, 1);
            if !word.write_back_refused() {
                engine.slots.mark_write_back_refused(slot, word);
            }
            return true;
        }
        assert_eq!(word.state(), SlotState::Clean, "an unreadable slot {slot} that holds nothing");
        bump(&counters.unreadable_clean, 1);
        false
    }

    /// `lba`'s cached copy in `slot` failed its check (`why`); the caller holds `lba`'s
    /// stripe. A clean copy is dropped (the backing store has the block: the caller reads it
    /// there) and `Ok` returned. A dirty one is the block's only copy: the error names it.
    pub(super) fn unreadable(&mut self, lba: u64, slot: u32, why: Unreadable) -> Result<()> {
        if self.note_unreadable(slot, why) {
            return Err(Error::CachedBlockUnreadable { lba, why });
        }
        let engine = self.engine;
        let found = engine.index.lookup(lba).filter(|found| found.slot == slot);
        engine.index.remove(&found.expect("a clean slot read under its stripe is indexed"));
        self.free_slot(lba, slot);
        Ok(())
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Settles the lost ranges not settled yet (see the module): writes back the dirty blocks
    /// touching them whose data can still be read, syncs, records each range settled that
    /// has no dirty block left unwritten in its entries, and drops the blocks. `held_slot` is
    /// a slot whose block's stripe the caller holds (it is not dropped here: the caller
    /// does, if it came back clean), `held_stripe` a stripe it holds. Every other stripe is
    /// only tried: when one is busy, or a write of its blocks to the backing store is in
    /// flight, nothing changes (but for the caller's block, see `settle_held_alone`) and a
    /// later allocation tries again. Returns whether every range is settled.
    pub(crate) fn settle_lost_ranges(
        &mut self,
        held_slot: Option<u32>,
        held_stripe: Option<usize>,
    ) -> bool {
        let engine = self.engine;
        let unsettled = engine.pools.lost.unsettled();
        if unsettled.is_empty() {
            // Every range is settled, but the caller's block may have been written there
            // since, by a write that took its slot just before the range was lost.
            if let Some(slot) = held_slot.filter(|&slot| engine.pools.is_retired(slot)) {
                let mappings = engine.index.mappings_where(|s| s == slot);
                self.settle_held_alone(held_slot, &mappings);
            }
            return true;
        }
        let mut slots: Vec<u32> = unsettled.iter().flat_map(|l| l.slots.iter().copied()).collect();
        slots.sort_unstable();
        slots.dedup();
        let wanted = |slot: u32| slots.binary_search(&slot).is_ok();
        let mappings = engine.index.mappings_where(wanted);
        let held = held_stripe.or_else(|| {
            let slot = held_slot?;
            let &(lba, _) = mappings.iter().find(|(_, found)| found.slot == slot)?;
            Some(engine.stripe_index(lba))
        });
        let mut stripes: Vec<usize> =
            mappings.iter().map(|&(lba, _)| engine.stripe_index(lba)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let mut guards = Vec::with_capacity(stripes.len());
        for &stripe in &stripes {
            if Some(stripe) == held {
                continue;
            }
            match engine.stripes[stripe].try_lock() {
                Some(guard) => guards.push(guard),
                None => {
                    drop(guards);
                    return self.settle_held_alone(held_slot, &mappings);
                }
            }
        }
        // Under the stripes the blocks stay where they are: found again, each of a stripe
        // held, none half inserted, none with a write to the backing store in flight.
        let mappings = engine.index.mappings_where(wanted);
        let busy = stripes.iter().any(|&stripe| {
            let stripe = &engine.stripes[stripe];
            stripe.cleaning.load(Ordering::Acquire) != 0
                || stripe.writing.load(Ordering::Acquire) != 0
        });
        let strays = mappings.iter().any(|(lba, found)| {
            found.hidden || stripes.binary_search(&engine.stripe_index(*lba)).is_err()
        });
        if busy || strays {
            drop(guards);
            return self.settle_held_alone(held_slot, &mappings);
        }

        let sample = engine.last_issued_seq();
        let mut data = vec![0u8; engine.layout.block_size as usize];
        let mut unwritten = Vec::new();
        let mut written = Vec::new();
        for &(lba, found) in &mappings {
            if engine.slots.load(found.slot).state() != SlotState::Dirty {
                continue;
            }
            match self.copy_to_backing(lba, found.slot, &mut data) {
                Ok(()) => written.push(found.slot),
                Err(()) => unwritten.push(found.slot),
            }
        }
        if !mappings.is_empty() && engine.sync_backing().is_err() {
            drop(guards);
            return Self::settle_later(engine, SETTLE_RETRY_FAILED);
        }
        for &slot in &written {
            let entry_at = engine.layout.entry_offset(slot);
            if !engine.pools.lost.touches(entry_at, ENTRY_BYTES, false)
                && let DecodedEntry::Valid(entry) = engine.read_entry(slot)
            {
                self.rewrite_entry_state(slot, SlotEntry { state: BlockState::Clean, ..entry });
            }
            engine.slots.set_clean(slot);
        }
        bump(&self.counters().dirty_delta, (written.len() as u64).wrapping_neg());
        if !mappings.is_empty() {
            self.fence();
            self.advance_synced_seq(sample);
        }

        // A range is settled once no dirty block whose entry lies in it is left unwritten.
        for lost in &unsettled {
            let stuck = unwritten.iter().any(|&slot| {
                let at = engine.layout.entry_offset(slot);
                lost.range.start < at + ENTRY_BYTES && at < lost.range.end
            });
            if stuck {
                continue;
            }
            if !engine.record_lost(&lost.range, true) && engine.holds_entries(&lost.range) {
                panic!(
                    "the record of lost ranges cannot take bytes {:?} as settled (its own page \
                     lost): stopping, so that the next start does not trust the entries there",
                    lost.range
                );
            }
            engine.pools.lost.settle(&lost.range);
        }
        // The blocks go, but: a block whose entry lies in a range still pending (its removal
        // would not reach the medium, and the next start trusts that range's dirty entries),
        // a dirty block that could not be written back (the only copy of its data: it stays,
        // unreadable or refused, marked), and the caller's.
        for &(lba, found) in &mappings {
            let slot = found.slot;
            let entry_at = engine.layout.entry_offset(slot);
            if engine.pools.lost.touches(entry_at, ENTRY_BYTES, true) {
                continue;
            }
            let word = engine.slots.load(slot);
            if word.state() == SlotState::Dirty {
                if !word.write_back_refused() {
                    engine.slots.mark_write_back_refused(slot, word);
                }
                continue;
            }
            if Some(slot) == held_slot {
                continue;
            }
            engine.index.remove(&found);
            self.free_slot(lba, slot);
        }
        drop(guards);
        if engine.pools.lost.unsettled().is_empty() {
            true
        } else {
            // A new range found meanwhile is settled at the next allocation; one stuck on a
            // block it could not write back, after many.
            let retry = if unwritten.is_empty() { 0 } else { SETTLE_RETRY_FAILED };
            Self::settle_later(engine, retry)
        }
    }

    /// Settling put off for a busy stripe (or every range settled already): the caller's
    /// block alone (`held_slot`, its stripe held) is written back now if it is dirty and its
    /// data can still be read, so that it no longer fails its reads and its write-backs, and
    /// a reclaim can evict it. It stays where it is until the range is settled. Returns false
    /// (not settled).
    fn settle_held_alone(&mut self, held_slot: Option<u32>, mappings: &[(u64, Found)]) -> bool {
        let engine = self.engine;
        let held = held_slot.and_then(|slot| mappings.iter().find(|(_, found)| found.slot == slot));
        if let Some(&(lba, found)) = held {
            let stripe = &engine.stripes[engine.stripe_index(lba)];
            let quiet = stripe.cleaning.load(Ordering::Acquire) == 0
                && stripe.writing.load(Ordering::Acquire) == 0;
            let dirty = engine.slots.load(found.slot).state() == SlotState::Dirty;
            let mut data = vec![0u8; engine.layout.block_size as usize];
            if quiet
                && dirty
                && engine.index.still_holds(&found)
                && self.copy_to_backing(lba, found.slot, &mut data).is_ok()
                && engine.sync_backing().is_ok()
            {
                let entry_at = engine.layout.entry_offset(found.slot);
                if !engine.pools.lost.touches(entry_at, ENTRY_BYTES, false)
                    && let DecodedEntry::Valid(entry) = engine.read_entry(found.slot)
                {
                    self.rewrite_entry_state(
                        found.slot,
                        SlotEntry { state: BlockState::Clean, ..entry },
                    );
                }
                engine.slots.set_clean(found.slot);
                bump(&self.counters().dirty_delta, 1u64.wrapping_neg());
                self.fence();
            }
        }
        Self::settle_later(engine, SETTLE_RETRY_BUSY)
    }

    /// Puts settling off for `allocations` allocations; returns false (not settled).
    fn settle_later(engine: &Engine<M, B, C>, allocations: u64) -> bool {
        engine.pools.lost.try_again_after(allocations);
        false
    }

    /// Writes dirty `lba`'s data in `slot` to the backing store (the caller holds its
    /// stripe, with no write of it in flight), if it can still be read: its data not lost,
    /// and checked against its checksum unless that is lost (then it is written unchecked,
    /// as in a cache without checksums). A read that meets a newly poisoned line registers
    /// the range it took.
    fn copy_to_backing(
        &mut self,
        lba: u64,
        slot: u32,
        data: &mut [u8],
    ) -> std::result::Result<(), ()> {
        let engine = self.engine;
        let block = u64::from(engine.layout.block_size);
        let data_at = engine.layout.data_offset(slot);
        if engine.pools.lost.touches(data_at, block, false) {
            return Err(());
        }
        if engine.medium.read_checked(data_at, data).is_err() {
            engine.register_lost_ranges(&[]);
            return Err(());
        }
        if engine.layout.data_crc()
            && !engine.pools.lost.touches(engine.layout.crc_offset(slot), DATA_CRC_BYTES, false)
        {
            let checked =
                engine.stored_crc(slot).and_then(|stored| Engine::<M, B, C>::verify(data, stored));
            if checked.is_err() {
                engine.register_lost_ranges(&[]);
                return Err(());
            }
        }
        let held = StripeGuard::AlreadyHeld;
        let turn = engine.backing_turn(lba, &held);
        engine.backing_write(data, lba * block, &turn).map_err(|_| ())
    }
}
