//! Writing dirty blocks back inline, on the writer's or caller's own lane: the write-back of
//! reclaim and index room, flush and drain (the background cleaner is `cache/cleaner/`).

use super::*;

/// What a write-back did: the blocks it cleaned, and the first error. A block the backing
/// store refused is skipped and stays dirty while the others are written; a failed sync
/// cleans none.
pub(super) struct WrittenBack {
    pub(super) cleaned: usize,
    /// Blocks whose backing write failed (each now marked refused, see `SlotWord`).
    pub(super) refused: usize,
    /// The sync after the writes failed (or an earlier one had): nothing is cleaned until
    /// the cache is attached again.
    pub(super) sync_failed: bool,
    pub(super) error: Option<Error>,
}

impl WrittenBack {
    /// The blocks cleaned, or the error when none was.
    pub(super) fn into_result(self) -> Result<usize> {
        match self.error {
            Some(e) if self.cleaned == 0 => Err(e),
            _ => Ok(self.cleaned),
        }
    }
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// `held` is a stripe the caller holds (other stripes are then only tried, never waited on).
    pub(super) fn write_back(&mut self, victims: &[u32], held: Option<usize>) -> WrittenBack {
        let engine = self.engine;
        let block = self.block_bytes();
        let mut error = None;
        let mut failures_in_a_row = 0;
        let mut refused = 0;
        self.written.clear();
        for &slot in victims {
            if failures_in_a_row == WRITE_BACK_FAILURES_MAX {
                // A dead device: the rest stay dirty, and nobody waits out its timeouts for
                // every one of them.
                break;
            }
            let seen = engine.slots.load(slot);
            if seen.state() != SlotState::Dirty {
                continue;
            }
            let DecodedEntry::Valid(entry) = engine.read_entry(slot) else {
                continue;
            };
            let Some(guard) = engine.lock_stripe_for_write_back(entry.lba, held) else {
                continue;
            };
            let now = engine.slots.load(slot);
            if !(now.same_incarnation(seen) && now.state() == SlotState::Dirty) {
                continue;
            }
            if engine.stripes[engine.stripe_index(entry.lba)].writing.load(Ordering::Relaxed) != 0 {
                // A write-through of the stripe is in flight: the block waits for a later turn.
                continue;
            }
            // An older copy of the block may be on its way from the cleaner: it lands first.
            let turn = engine.backing_turn(entry.lba, &guard);
            if let Err(why) = engine.read_block_checked(slot, &mut self.write_back_block) {
                // The block's only copy cannot be read: it stays dirty (marked), and the
                // caller hears of it; the others are still written back. Unless the read met
                // a poisoned line whose lost range, settled at once, wrote the block back.
                if self.note_unreadable(slot, why) {
                    error.get_or_insert(Error::CachedBlockUnreadable { lba: entry.lba, why });
                    refused += 1;
                }
                continue;
            }
            if let Err(e) = engine.backing_write(&self.write_back_block, entry.lba * block, &turn) {
                // This block stays dirty (its copy here is the one that counts); the others
                // are still written back, so one bad block of the backing store does not stop
                // the cache from freeing space or draining the rest. Reclaim tries it again
                // only after the dirty blocks not refused yet.
                engine.slots.mark_write_back_refused(slot, now);
                error.get_or_insert(e);
                failures_in_a_row += 1;
                refused += 1;
                continue;
            }
            failures_in_a_row = 0;
            drop(guard);
            self.written.push((slot, now, entry));
        }
        if self.written.is_empty() {
            return WrittenBack { cleaned: 0, refused, sync_failed: false, error };
        }
        let sample = engine.last_issued_seq();
        if let Err(e) = engine.sync_backing() {
            return WrittenBack { cleaned: 0, refused, sync_failed: true, error: Some(e) };
        }
        let written = std::mem::take(&mut self.written);
        let mut cleaned = 0;
        for &(slot, seen, entry) in &written {
            let Some(_guard) = engine.lock_stripe_for_write_back(entry.lba, held) else {
                continue;
            };
            let now = engine.slots.load(slot);
            if now.same_incarnation(seen) && now.state() == SlotState::Dirty {
                self.rewrite_entry_state(slot, SlotEntry { state: BlockState::Clean, ..entry });
                engine.slots.set_clean(slot);
                cleaned += 1;
            }
        }
        self.written = written;
        self.fence();
        self.advance_synced_seq(sample);
        let counters = self.counters();
        bump(&counters.writebacks, cleaned);
        bump(&counters.dirty_delta, cleaned.wrapping_neg());
        WrittenBack { cleaned: cleaned as usize, refused, sync_failed: false, error }
    }

    /// Inserts `lba -> slot` into the index, hidden (see `Index::insert`), evicting (or
    /// writing back) a block of the same index buckets when they are full; returns the entry
    /// Makes every acknowledged write durable: syncs the backing store if anything reached it
    /// since the last sync, and records the synced sequence number.
    pub fn flush(&mut self) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::flush");
        let engine = self.engine;
        let sample = engine.last_issued_seq();
        if engine.backing_writes.load(Ordering::SeqCst)
            != engine.backing_writes_synced.load(Ordering::SeqCst)
        {
            engine.sync_backing()?;
        }
        self.advance_synced_seq(sample);
        bump(&self.counters().flushes, 1);
        Ok(())
    }

    /// Writes back every block dirty when it starts and marks it clean; the backing store then
    /// holds every write acknowledged before the call. A block busy meanwhile (a write of it
    /// to the backing store in flight on another lane) is waited for and written back after
    /// it, up to [`DRAIN_BUSY_WAIT`]; a block the backing store refuses stays dirty and is the
    /// error, as are blocks still busy when the wait ends ([`Error::DrainBusy`]): the drain
    /// never answers success while a block dirty at its start is dirty.
    pub fn drain(&mut self) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::drain");
        let engine = self.engine;
        // Every block dirty now has an entry no newer than this; a block dirtied later by a
        // writer beside the drain is that writer's, not the drain's.
        let started_seq = engine.last_issued_seq();
        let started = std::time::Instant::now();
        let mut batch = Vec::with_capacity(DRAIN_BATCH);
        // Everything that can be written back is, and the first failure is the result: a
        // block the backing store refuses stays dirty, and so does nothing else.
        let mut error = None;
        let mut failed_batches = 0;
        let mut waits = 0;
        loop {
            let mut write_back = |lane: &mut Self, batch: &[u32]| {
                let written = lane.write_back(batch, None);
                match written.error {
                    Some(e) => {
                        failed_batches = if written.cleaned == 0 { failed_batches + 1 } else { 0 };
                        error.get_or_insert(e);
                    }
                    None => failed_batches = 0,
                }
                failed_batches < DRAIN_FAILED_BATCHES_MAX
            };
            let mut left = 0u64;
            for slot in 0..engine.slots.len() {
                if !engine.dirty_since_before(slot, started_seq) {
                    continue;
                }
                left += 1;
                batch.push(slot);
                if batch.len() == DRAIN_BATCH {
                    let go_on = write_back(self, &batch);
                    batch.clear();
                    if !go_on {
                        break;
                    }
                }
            }
            if !batch.is_empty() {
                write_back(self, &batch);
                batch.clear();
            }
            if error.is_some() || left == 0 {
                break;
            }
            let busy = engine.dirty_slots_up_to(started_seq);
            if busy == 0 {
                break;
            }
            if started.elapsed() >= DRAIN_BUSY_WAIT {
                let waited_ms = started.elapsed().as_millis() as u64;
                error = Some(Error::DrainBusy { dirty: busy, waited_ms });
                break;
            }
            self.wait_for_writes(&mut waits);
        }
        let flushed = self.flush();
        match error {
            Some(e) => Err(e),
            None => flushed,
        }
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Whether `slot` is dirty with an entry no newer than `seq`.
    fn dirty_since_before(&self, slot: u32, seq: u64) -> bool {
        self.slots.load(slot).state() == SlotState::Dirty
            && matches!(self.read_entry(slot), DecodedEntry::Valid(entry) if entry.seq <= seq)
    }

    /// The slots dirty with an entry no newer than `seq` (a pass over the slot table): the
    /// blocks dirty when a drain that sampled `seq` started, still dirty.
    pub(super) fn dirty_slots_up_to(&self, seq: u64) -> u64 {
        (0..self.slots.len()).filter(|&slot| self.dirty_since_before(slot, seq)).count() as u64
    }
}
