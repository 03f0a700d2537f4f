//! The write paths: write-back (out of place into the cache), write-through, write-around
//! and pass-through, write-zeroes and trim.

use super::batch::GROUP_MAX;
use super::ordering::RANGE_HOLD_BLOCKS_MAX;
use super::*;

/// The unit of data a write carries.
#[derive(Clone, Copy)]
pub(super) enum Payload<'a> {
    Data(&'a [u8]),
    Zeroes(usize),
}

impl Payload<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Payload::Data(d) => d.len(),
            Payload::Zeroes(n) => *n,
        }
    }
    pub(super) fn apply(&self, block: &mut [u8], at: usize) {
        match self {
            Payload::Data(d) => block[at..at + d.len()].copy_from_slice(d),
            Payload::Zeroes(n) => block[at..at + n].fill(0),
        }
    }
}

/// What `Lane::switch_in_dirty` did, for its caller to act on and count.
#[must_use = "a true `must_fence` asks for a fence before the stripe is released"]
#[derive(Clone, Copy)]
pub(super) struct Switched {
    /// The stripe's earlier pending free was not durable: fence before releasing the stripe.
    pub(super) must_fence: bool,
    /// The block had no dirty copy before (a dirty slot more).
    pub(super) newly_dirty: bool,
    /// The block had a copy (a write hit).
    pub(super) hit: bool,
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Writes `data` at byte `offset`. With `fua`, the data is durable on return in every mode
    /// (in write-back and write-only modes it always is).
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::write");
        self.engine.cleaner.follow_writer_nice(true);
        self.engine.check_range("write", offset, data.len() as u64)?;
        let mode = self.pin_mode();
        let written = self.write_in_mode(mode, offset, data, fua);
        self.unpin_mode();
        written
    }

    /// [`Lane::write`] in `mode`, pinned by the caller.
    fn write_in_mode(
        &mut self,
        mode: CacheMode,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<()> {
        let block = self.block_bytes();
        if mode.writes_back()
            && offset_in_block(offset, block) == 0
            && (data.len() as u64).is_multiple_of(block)
            && data.len() as u64 >= 2 * block
        {
            return self.write_blocks_grouped(offset, data);
        }
        if !mode.writes_back()
            && offset_in_block(offset, block) == 0
            && (data.len() as u64).is_multiple_of(block)
            && data.len() as u64 >= 2 * block
        {
            self.write_blocks_backing(offset, data, mode == CacheMode::WriteThrough)?;
            bump(&self.counters().bytes_written, data.len() as u64);
            if fua {
                self.flush()?;
            }
            return Ok(());
        }
        if mode.writes_back() {
            let blocks = pieces(offset, data.len() as u64, self.block_bytes());
            self.engine.pace_writes(blocks.map(|(lba, _, _)| lba));
        }
        let mut done = 0;
        for (lba, in_block, len) in pieces(offset, data.len() as u64, self.block_bytes()) {
            self.write_block(lba, in_block, Payload::Data(&data[done..done + len]))?;
            done += len;
        }
        bump(&self.counters().bytes_written, data.len() as u64);
        if fua && !mode.writes_back() {
            self.flush()?;
        }
        Ok(())
    }

    /// A write-back write of several whole blocks: the blocks are group-committed as a batch
    /// of one-block writes is (`write_batch`: two fences per group rather than two per
    /// block, and consecutive slots, which a later read copies in one piece). Each block is
    /// written whole or not at all at a crash, as alone; the request, as any multi-block
    /// write, is not atomic.
    fn write_blocks_grouped(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let block = self.block_bytes() as usize;
        let mut outcomes = std::mem::take(&mut self.write_outcomes);
        let mut result = Ok(());
        for (chunk_index, chunk) in data.chunks(block * GROUP_MAX).enumerate() {
            let first = offset + (chunk_index * block * GROUP_MAX) as u64;
            let writes: SmallVec<[WriteRequest<'_>; GROUP_MAX]> = chunk
                .chunks(block)
                .enumerate()
                .map(|(i, data)| WriteRequest {
                    offset: first + (i * block) as u64,
                    data,
                    fua: false,
                })
                .collect();
            self.write_batch(&writes, &mut outcomes);
            if let Some(failed) = outcomes.drain(..).find(Result::is_err) {
                result = failed;
                break;
            }
        }
        self.write_outcomes = outcomes;
        result
    }

    /// Writes zeroes over `len` bytes at `offset` (durable on return with `fua`, as `write`).
    pub fn write_zeroes(&mut self, offset: u64, len: u64, fua: bool) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::write_zeroes");
        self.engine.cleaner.follow_writer_nice(true);
        self.engine.check_range("write_zeroes", offset, len)?;
        let mode = self.pin_mode();
        let written = self.write_zeroes_in_mode(mode, offset, len, fua);
        self.unpin_mode();
        written
    }

    /// [`Lane::write_zeroes`] in `mode`, pinned by the caller.
    fn write_zeroes_in_mode(
        &mut self,
        mode: CacheMode,
        offset: u64,
        len: u64,
        fua: bool,
    ) -> Result<()> {
        let block = self.block_bytes();
        let (first, end) = (offset.div_ceil(block), (offset + len) / block);
        let through = self.engine.zero_through_blocks_min.load(Ordering::Relaxed);
        if mode.writes_back() && end > first && end - first >= through {
            // Many whole blocks: bounded work (cache/zeroes.rs); the partial blocks at either
            // end through the cache.
            let (head, tail) = (first * block - offset, offset + len - end * block);
            for (lba, in_block, n) in pieces(offset, head, block) {
                self.write_block(lba, in_block, Payload::Zeroes(n))?;
            }
            self.write_zeroes_through(first, end)?;
            for (lba, in_block, n) in pieces(end * block, tail, block) {
                self.write_block(lba, in_block, Payload::Zeroes(n))?;
            }
            return Ok(());
        }
        for (lba, in_block, n) in pieces(offset, len, block) {
            self.write_block(lba, in_block, Payload::Zeroes(n))?;
        }
        if fua && !mode.writes_back() {
            self.flush()?;
        }
        Ok(())
    }

    pub(super) fn write_block(
        &mut self,
        lba: u64,
        in_block: usize,
        payload: Payload<'_>,
    ) -> Result<()> {
        bump(&self.counters().writes, 1);
        let mode = self.pinned_mode();
        if mode.writes_back() {
            self.write_block_cached(lba, in_block, payload)
        } else {
            self.write_block_backing(lba, in_block, payload, mode == CacheMode::WriteThrough)
        }
    }

    /// Write-back: the new block goes to a free slot, is persisted, then its entry, then the
    /// index switches and the old slot is freed.
    pub(super) fn write_block_cached(
        &mut self,
        lba: u64,
        in_block: usize,
        payload: Payload<'_>,
    ) -> Result<()> {
        let engine = self.engine;
        let slot = self.alloc()?;
        let full = in_block == 0 && payload.len() as u64 == self.block_bytes();
        // A whole block is copied and made durable before the stripe is taken: the slot is
        // this lane's alone and nothing refers to it, and the lock's locked instruction then
        // finds no write-back outstanding to wait for (docs/DURABILITY.md, write-back steps
        // 1–2). The metadata lines this write touches are cache misses at random places: they
        // load while the fence waits for the copy's stores (started before the copy, they
        // slowed it).
        if full {
            let at = engine.layout.data_offset(slot);
            engine.prefetch_crc_store(slot);
            match payload {
                Payload::Data(data) => {
                    engine.medium.write_flush(at, data);
                    engine.store_data_crc(slot, data);
                }
                Payload::Zeroes(_) => {
                    self.block.fill(0);
                    engine.medium.write_flush(at, &self.block);
                    engine.store_zero_block_crc(slot);
                }
            }
        }
        let stripe = engine.stripe_index(lba);
        engine.prefetch_slot_for_entry_store(slot);
        engine.prefetch_stripe(stripe);
        let key = engine.index.key(lba);
        engine.index.prefetch_key(&key);
        // The lane's next write goes to its next slot (address order, see `alloc`): touching
        // that slot's data now walks its page table while this fence waits, instead of on the
        // next write's path. About 10 % of a write (docs/PERFORMANCE.md, `bench core`); its
        // entry line alone gained nothing, and the touch before this write's copy lost.
        if let Some(&next) = self.free.last() {
            engine.medium.prefetch(engine.layout.data_offset(next), 1);
        }
        if full {
            self.fence();
        }
        // A partial block merges with the block's current data: when that is on the backing
        // store with a write of it still in flight (a write-through before a switch to
        // write-back), the write lands first, and the merge reads what it wrote.
        let mut guard =
            if full { engine.lock_stripe_index(stripe) } else { self.lock_stripe_for_backing(lba) };
        let seq = self.local_seq(&mut guard);
        let old = engine.index.lookup_key(&key);
        if let Some(found) = old {
            engine.prefetch_slot_for_entry_store(found.slot);
        }
        if !full {
            if let Err(err) = self.load_block(lba, old.as_ref()) {
                drop(guard);
                self.give_back(slot);
                return Err(err);
            }
            payload.apply(&mut self.block, in_block);
            let merged = std::mem::take(&mut self.block);
            self.write_data(slot, &merged);
            self.block = merged;
        }
        let entry = match old.map_or_else(|| self.index_insert(lba, slot), Ok) {
            Ok(entry) => entry,
            Err(err) => {
                drop(guard);
                self.give_back(slot);
                return Err(err);
            }
        };
        crate::failpoint::mid_write();
        self.persist_entry(slot, SlotEntry { lba, state: BlockState::Dirty, seq });
        if !self.stores_landed(slot) {
            // A range the slot's data, checksum or entry lie on was lost while this write
            // stored there: nothing of the write is visible yet (the block keeps the copy it
            // had), so it runs again in another slot.
            if entry.hidden {
                engine.index.remove(&entry);
            }
            self.abandon_unlanded(slot);
            drop(guard);
            return self.write_block_cached(lba, in_block, payload);
        }
        let switched = self.switch_in_dirty(stripe, slot, entry);
        if switched.must_fence {
            self.fence();
        }
        let counters = self.counters();
        bump(&counters.dirty_delta, u64::from(switched.newly_dirty));
        bump(&counters.write_hits, u64::from(switched.hit));
        if !entry.hidden {
            self.keep_free(entry.slot);
        }
        drop(guard);
        self.zero_superseded_entries();
        Ok(())
    }

    /// Makes the dirty copy of `lba` in `slot` (its entry durable) the visible one: points
    /// `lba`'s index `entry` at `slot` — the entry of the copy it replaces, or the hidden one
    /// inserted for a block new to the cache — publishes `slot`, and frees the replaced copy
    /// as superseded. Shared by single and group writes. The caller holds the stripe, fences
    /// before releasing it if `must_fence` comes back true (see `free_superseded`), hands a
    /// replaced copy's slot (`entry.slot` unless `entry.hidden`) to `keep_free`, and counts
    /// what this returns (a group counts once for all its writes).
    #[inline(always)]
    pub(super) fn switch_in_dirty(&mut self, stripe: usize, slot: u32, entry: Found) -> Switched {
        let engine = self.engine;
        let free_word = engine.slots.load(slot);
        engine.index.replace(&entry, slot, free_word.generation());
        engine.slots.publish_loaded(slot, free_word, SlotState::Dirty);
        if entry.hidden {
            return Switched { must_fence: false, newly_dirty: true, hit: false };
        }
        let (must_fence, old_state) = self.free_superseded(stripe, entry.slot);
        Switched { must_fence, newly_dirty: old_state != SlotState::Dirty, hit: true }
    }

    /// Write-through, write-around and pass-through: the backing store is written under the
    /// block's stripe; a clean cached copy is invalidated durably *before* it changes, a dirty
    /// one only *after* (so a crash never exposes data older than what was acknowledged).
    pub(super) fn write_block_backing(
        &mut self,
        lba: u64,
        in_block: usize,
        payload: Payload<'_>,
        admit: bool,
    ) -> Result<()> {
        let engine = self.engine;
        let block = self.block_bytes();
        let full = in_block == 0 && payload.len() as u64 == block;
        let reserved = self.reserve_for_admission(admit);
        let mut guard = self.lock_stripe_for_backing(lba);
        // An older copy of the block may be on its way from the cleaner: it lands first.
        let turn = engine.backing_turn(lba, &guard);
        let old = engine.index.lookup(lba);
        let old_dirty = old.is_some_and(|f| engine.slots.load(f.slot).state() == SlotState::Dirty);
        let fail = |lane: &mut Self, err: Error| {
            if let Some(slot) = reserved {
                lane.give_back(slot);
            }
            Err(err)
        };
        if !full {
            if let Err(err) = self.load_block(lba, old.as_ref()) {
                drop(guard);
                return fail(self, err);
            }
            payload.apply(&mut self.block, in_block);
        } else if admit {
            self.block.fill(0);
            payload.apply(&mut self.block, 0);
        }
        if let (Some(found), false) = (old, old_dirty) {
            engine.index.remove(&found);
            self.free_slot(lba, found.slot);
        }
        let written = match (full, payload) {
            (true, Payload::Zeroes(_)) => engine.backing_write_zeroes(lba * block, block, &turn),
            (true, Payload::Data(data)) => engine.backing_write(data, lba * block, &turn),
            (false, _) => engine.backing_write(&self.block, lba * block, &turn),
        };
        if let Err(err) = written {
            drop(guard);
            return fail(self, err);
        }
        // A dirty cached copy is the only durable copy of the block's current data: it may be
        // dropped only once the new data is durable on the backing store.
        if old_dirty && let Err(err) = engine.sync_backing() {
            drop(guard);
            return fail(self, err);
        }
        let counters = self.counters();
        match (reserved, old.filter(|_| old_dirty)) {
            (Some(slot), dirty_old) => {
                let entry = match dirty_old.map_or_else(|| self.index_insert(lba, slot), Ok) {
                    Ok(entry) => entry,
                    Err(err) => {
                        drop(guard);
                        // The write itself is done; it is just not cached.
                        let _ = fail(self, err);
                        return Ok(());
                    }
                };
                let seq = engine.global_seq(&mut guard);
                let data = std::mem::take(&mut self.block);
                self.write_data(slot, &data);
                self.block = data;
                self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
                // Not revealed (its stores went to a lost range): not admitted, and a dirty
                // copy it was to replace goes all the same.
                if !self.reveal_clean_copy(&entry, slot) {
                    self.give_back(slot);
                }
                if !entry.hidden {
                    self.free_slot(lba, entry.slot);
                    bump(&counters.dirty_delta, 1u64.wrapping_neg());
                }
            }
            (None, Some(found)) => {
                engine.index.remove(&found);
                self.free_slot(lba, found.slot);
                bump(&counters.dirty_delta, 1u64.wrapping_neg());
            }
            (None, None) => {}
        }
        if old.is_some() {
            bump(&counters.write_hits, 1);
        }
        drop(guard);
        Ok(())
    }

    // ----- trim, flush, drain -----

    /// Discards the whole blocks inside `offset..offset + len` (partial blocks are left as
    /// they are): cached copies are dropped and the range is discarded on the backing store.
    /// Their contents are unspecified until written again.
    ///
    /// Run by run of blocks whose stripes it holds together (`Engine::hold_range`): under
    /// them, once the cleaner's copies of those blocks have landed, the run is discarded on the
    /// backing store and its cached copies dropped. A request racing with the trim on one of
    /// its blocks then runs wholly before or wholly after it there.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::trim");
        let engine = self.engine;
        engine.check_range("trim", offset, len)?;
        let block = self.block_bytes();
        let first = offset.div_ceil(block);
        let end = (offset + len) / block;
        if first >= end {
            return Ok(());
        }
        let mut dropped_dirty = 0u64;
        let mut lba = first;
        let trimmed = loop {
            if lba >= end {
                break Ok(());
            }
            let hold = self.hold_range_for_backing(lba, end, RANGE_HOLD_BLOCKS_MAX);
            let run_end = hold.end();
            if let Err(e) =
                engine.backing_discard(lba * block, (run_end - lba) * block, &hold.turn())
            {
                break Err(e);
            }
            for b in lba..run_end {
                if let Some(found) = engine.index.lookup(b) {
                    if engine.slots.load(found.slot).state() == SlotState::Dirty {
                        dropped_dirty += 1;
                    }
                    engine.index.remove(&found);
                    self.free_slot(b, found.slot);
                }
            }
            drop(hold);
            lba = run_end;
        };
        let counters = self.counters();
        bump(&counters.trims, lba - first);
        bump(&counters.dirty_delta, dropped_dirty.wrapping_neg());
        trimmed
    }
}
