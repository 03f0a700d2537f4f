//! Slot allocation and reclaim: a lane's free run, freed slots on their way back to the
//! pool, the CLOCK/FIFO hand, eviction, and making room in full index buckets.

use super::*;
use cleaner::Stall;

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// A free slot, evicting or writing back if needed. Never called with a stripe lock held.
    ///
    /// Slots come from the pool in address order, a run of `refill_batch` at a time from a
    /// cursor that sweeps the whole cache, and a freed slot goes back to the pool rather than
    /// to the next write: so a lane's consecutive writes land close together on the medium,
    /// their entries mostly on one page of the metadata table, as in a log. Reusing the slot
    /// the previous write freed (a random one) was 10–25 % slower per write
    /// (docs/PERFORMANCE.md, `bench core`). Only when the pool is empty (a full cache) does a
    /// lane reuse the slots it freed itself, before it reclaims.
    ///
    /// In a cache of several members, a run comes from the pool of the member on the lane's
    /// node, else from the nearest member whose pool has slots (`placement.rs`); reclaim, too,
    /// tries the local member's hand first.
    pub(super) fn alloc(&mut self) -> Result<u32> {
        Ok(self.alloc_with(false)?.expect("a needed slot is always found or an error"))
    }

    /// A slot for a block a read miss or a write-through will cache, if `admit`. Caching is
    /// optional there: when no slot can be had at once (every slot dirty: with a cleaner
    /// running, the miss does not wait for it; without one, the backing store failing the
    /// write-back that would free one) the request is served from or written to the backing
    /// store without caching the block, rather than delayed or failed.
    pub(super) fn reserve_for_admission(&mut self, admit: bool) -> Option<u32> {
        if admit { self.alloc_with(true).ok().flatten() } else { None }
    }

    /// `alloc`, or for an `optional` slot `None` rather than a wait for the cleaner.
    ///
    /// Every slot is checked as it is handed out: one retired after this lane took it (a
    /// range of the medium lost meanwhile: `checked.rs`), or retired while it held a block
    /// this lane freed and now takes back, is dropped, so no block is ever placed in one. A
    /// lost range whose blocks are not dealt with yet is dealt with first (no stripe is held
    /// here).
    fn alloc_with(&mut self, optional: bool) -> Result<Option<u32>> {
        let engine = self.engine;
        if engine.pools.lost.settle_due() {
            self.settle_lost_ranges(None, None);
        }
        let mut stall = None;
        loop {
            if let Some(slot) = self.free.pop() {
                if engine.pools.is_retired(slot) {
                    continue;
                }
                self.end_stall(stall);
                self.count_write(slot, 1);
                return Ok(Some(slot));
            }
            if self.freed_durable > 0 {
                self.return_durable_freed();
            }
            if self.refill() {
                continue;
            }
            if !self.freed.is_empty() {
                // The pool is empty (a full cache): this lane reuses the slots it freed itself,
                // rather than hand them to the pool where another lane's allocation could take
                // them first and leave this one to reclaim. (A retired one among them is
                // dropped when it comes up, above, as the pool would not take it back.)
                self.settle_freed();
                self.free.extend(self.freed.drain(..).rev());
                self.freed_durable = 0;
                continue;
            }
            match self.reclaim(&mut stall, optional) {
                Ok(true) => {}
                Ok(false) => {
                    self.end_stall(stall);
                    return Ok(None);
                }
                Err(e) => {
                    self.end_stall(stall);
                    return Err(e);
                }
            }
        }
    }

    /// Returns a slot this lane took but did not use (nothing was written to its entry).
    pub(super) fn give_back(&mut self, slot: u32) {
        self.count_write(slot, -1);
        self.free.push(slot);
    }

    /// Takes a free run from the pools: the local member's first (`placement.rs`). Returns
    /// whether it got any.
    fn refill(&mut self) -> bool {
        let engine = self.engine;
        if engine.placement.single() {
            return engine.pools.take(0, engine.refill_batch, &mut self.free) > 0;
        }
        self.check_node();
        self.refills = self.refills.wrapping_add(1);
        engine.placement.order(self.node, self.refills).into_iter().any(|member| {
            engine.pools.take(usize::from(member), engine.refill_batch, &mut self.free) > 0
        })
    }

    /// Asks which node this lane's thread runs on now.
    pub(super) fn check_node(&mut self) {
        self.node = self.engine.placement.current_node();
        self.reads_since_node_check = 0;
    }

    /// Counts `slots` slots filled at `slot`'s member (`-1`: one taken back unused), local or
    /// remote.
    #[inline]
    pub(super) fn count_write(&self, slot: u32, slots: i64) {
        let member = self.engine.layout.member_of(slot);
        let counters = &self.shared.members[member];
        let counter = if self.engine.placement.is_local(member, self.node) {
            &counters.writes_local
        } else {
            &counters.writes_remote
        };
        bump(counter, slots as u64);
    }

    /// Counts `blocks` blocks read from `slot`'s member, local or remote: in a cache of
    /// several members only (a one-member cache's reads are `Stats::read_hits`). The lane
    /// asks which node it runs on every `NODE_CHECK_READS` reads, and at every refill.
    #[inline]
    pub(super) fn count_read(&mut self, slot: u32, blocks: u64) {
        if !self.engine.placement.single() {
            self.count_read_placed(slot, blocks);
        }
    }

    fn count_read_placed(&mut self, slot: u32, blocks: u64) {
        if self.reads_since_node_check >= NODE_CHECK_READS {
            self.check_node();
        }
        self.reads_since_node_check += 1;
        let member = self.engine.layout.member_of(slot);
        let counters = &self.shared.members[member];
        let counter = if self.engine.placement.is_local(member, self.node) {
            &counters.reads_local
        } else {
            &counters.reads_remote
        };
        bump(counter, blocks);
    }

    /// Frees the slot of block `lba`'s newest copy, which is being dropped (no newer entry
    /// replaces it): new generation in DRAM, entry zeroed and made durable before the stripe
    /// lock (held by the caller) is released — *after* the stripe's pending free (see
    /// [`Stripe`]) is durable, so that no older entry of the block can outlive this one and
    /// come back. Two write-backs under one fence are not ordered: a power cut inside it
    /// could keep this zeroing and lose the older one's.
    pub(super) fn free_slot(&mut self, lba: u64, slot: u32) {
        let engine = self.engine;
        let stripe = engine.stripe_index(lba);
        if let Some(pending) = self.unfenced_free(stripe) {
            engine.settle_pending_free(stripe, pending);
            self.fence();
        }
        engine.slots.free(slot);
        // An entry on a lost range is not stored to: the store would not reach the medium,
        // and the next attach does not trust entries there (`checked.rs`). Only a retired
        // slot's entry can be on one (a load while none is; no lock otherwise).
        let entry_at = engine.layout.entry_offset(slot);
        let entry_lost = engine.pools.is_retired(slot)
            && engine.pools.lost.touches(entry_at, format::ENTRY_BYTES, false);
        if !entry_lost {
            engine.clear_entry(slot);
        }
        self.fence();
        engine.stripes[stripe].pending_free.store(0, Ordering::Relaxed);
        self.keep_free(slot);
    }

    /// Frees a slot whose block `lba` now has a newer, durable entry elsewhere: new generation
    /// in DRAM — it becomes the stripe's pending free (see [`Stripe`]). Its entry is zeroed
    /// once the stripe is released (`zero_superseded_entries`) and made durable by this
    /// lane's next fence, not now: a store or write-back still in flight would make the
    /// stripe's unlock (a locked instruction) wait for it, which costs as much as the fence
    /// saved. Returns true if the caller must fence before releasing the stripe: when the
    /// stripe already had a pending free that is not yet durable, this lane settles it
    /// (`settle_pending_free`) and its fence makes it durable. Also returns the state the slot
    /// had (clean or dirty).
    #[must_use = "a true result asks for a fence before the stripe is released"]
    #[inline(always)]
    pub(super) fn free_superseded(&mut self, stripe: usize, slot: u32) -> (bool, SlotState) {
        let engine = self.engine;
        let earlier = self.unfenced_free(stripe);
        if let Some(pending) = earlier {
            engine.settle_pending_free(stripe, pending);
        }
        if self.frees_unzeroed.len() == self.frees_unzeroed.capacity() {
            // Bounded (a group frees at most `GROUP_MAX` between fences): past it, fence now.
            self.fence();
        }
        let state = engine.slots.free(slot);
        self.frees_unzeroed.push(slot);
        let record = &engine.stripes[stripe];
        record.pending_free.store((self.id as u64 + 1) << 32 | u64::from(slot), Ordering::Relaxed);
        let fences = self.shared.fences.load(Ordering::Relaxed);
        record.pending_free_fences.store(fences, Ordering::Relaxed);
        (earlier.is_some(), state)
    }

    /// Adds a freed slot to the ones on their way back to the pool. Those freed before the
    /// last fence go back once there are `freed_spill` of them; a full list goes back after a
    /// fence of its own (not reached: every write fences before it frees, and a group frees at
    /// most `GROUP_MAX` between fences).
    ///
    /// Only slots with durably zeroed entries reach the pool, so no slot's new entry is ever
    /// written over an old one that is still durable: a power cut could otherwise keep the old
    /// entry's word 0 beside the new entry's word 1, caught only by the entry's check, by
    /// chance.
    pub(super) fn keep_free(&mut self, slot: u32) {
        if self.freed.len() == self.freed.capacity() {
            self.return_freed();
        }
        self.freed.push(slot);
        if self.freed_durable >= self.engine.freed_spill {
            self.return_durable_freed();
        }
    }

    /// Returns the slots freed before this lane's last fence to the pool.
    pub(super) fn return_durable_freed(&mut self) {
        self.engine.pools.put_all(&self.freed[..self.freed_durable]);
        self.freed.drain(..self.freed_durable);
        self.freed_durable = 0;
    }

    /// Returns every slot this lane freed to the pool.
    pub(super) fn return_freed(&mut self) {
        self.settle_freed();
        self.return_durable_freed();
    }

    /// Makes every slot this lane freed durably free: a fence if a zeroing is pending (which
    /// counts them all), else they already are.
    pub(super) fn settle_freed(&mut self) {
        if self.zeroings_pending() {
            self.fence();
        }
        self.freed_durable = self.freed.len();
    }

    /// Evicts clean blocks under the CLOCK (or FIFO) hand of each member in turn, the local
    /// one first (`placement.rs`), until one gives some. When it finds none and a cleaner
    /// runs, waits for the cleaner (a stall, see `wait_for_cleaner`), or for an `optional`
    /// slot returns `Ok(false)` at once (as it does when every slot is being filled); without a cleaner (or with a failing one), writes back
    /// the oldest dirty blocks it passed and evicts those. `Ok(true)`: look for a slot again.
    pub(super) fn reclaim(&mut self, stall: &mut Option<Stall>, optional: bool) -> Result<bool> {
        let engine = self.engine;
        let epoch = self.cleaner_epoch();
        self.scratch_slots.clear();
        self.scratch_refused.clear();
        let order = engine.placement.order(self.node, self.refills);
        if order.into_iter().any(|member| self.evict_under_hand(usize::from(member))) {
            return Ok(true);
        }
        self.reclaim_dirty(stall, optional, epoch)
    }

    /// Sweeps member `member`'s hand over up to twice its slots (at most 8,192), evicting up
    /// to a refill of clean blocks and noting the dirty ones it passes in `scratch_slots` (and
    /// `scratch_refused`). Returns whether it evicted any.
    fn evict_under_hand(&mut self, member: usize) -> bool {
        let engine = self.engine;
        let Member { first_slot, slot_count, .. } = engine.layout.members()[member];
        let slot_count = u64::from(slot_count);
        let budget = (2 * slot_count).clamp(HAND_CHUNK, 8192);
        let want = engine.refill_batch;
        let mut evicted = 0;
        let mut scanned = 0;
        while scanned < budget && evicted < want {
            let start = engine.hands[member].fetch_add(HAND_CHUNK, Ordering::Relaxed);
            for i in 0..HAND_CHUNK {
                let slot = first_slot + ((start + i) % slot_count) as u32;
                let word = engine.slots.load(slot);
                match word.state() {
                    SlotState::Clean => match engine.eviction.sweep(self.referenced(slot)) {
                        Sweep::SecondChance => {}
                        Sweep::Evict => {
                            if evicted < want && self.try_evict(slot, word, None) {
                                evicted += 1;
                            }
                        }
                    },
                    // Refused write-backs apart: a run of them (a bad range of the backing
                    // store, filled in address order) must not fill the candidates.
                    SlotState::Dirty if word.write_back_refused() => {
                        if self.scratch_refused.len() < self.scratch_refused.capacity() {
                            self.scratch_refused.push(slot);
                        }
                    }
                    SlotState::Dirty => {
                        if self.scratch_slots.len() < self.scratch_slots.capacity() {
                            self.scratch_slots.push(slot);
                        }
                    }
                    SlotState::Free => {}
                }
            }
            scanned += HAND_CHUNK;
        }
        evicted > 0
    }

    /// `reclaim` once no hand found a clean block to evict: wait for the cleaner, or write
    /// back the oldest dirty blocks the hands passed.
    fn reclaim_dirty(
        &mut self,
        stall: &mut Option<Stall>,
        optional: bool,
        epoch: u64,
    ) -> Result<bool> {
        let engine = self.engine;
        let want = engine.refill_batch;
        if self.scratch_slots.is_empty() {
            // Only blocks the backing store refused before: try those again (it may take
            // them now). Otherwise they stay out: every reclaim would try the same refused
            // blocks first (a bad range of the device, or a path that fails some requests)
            // while other dirty blocks could make room.
            self.scratch_slots.extend_from_slice(&self.scratch_refused);
        }
        if self.scratch_slots.is_empty() {
            // Every slot is free in another lane's list or being filled. An optional slot
            // does not wait for them: the slots being filled may be this lane's own, held by
            // its misses in flight, which only this thread completes.
            if optional {
                return Ok(false);
            }
            // Let them progress.
            crate::sync::yield_now();
            return Ok(true);
        }
        if self.engine.cleaner_takes_stalls() {
            if optional {
                return Ok(false);
            }
            return self.wait_for_cleaner(stall, epoch);
        }
        let mut dirty = std::mem::take(&mut self.scratch_slots);
        // The hand may pass a slot twice in one reclaim (its budget is up to twice the cache):
        // each dirty slot once, or a refused one would be tried twice in a batch.
        dirty.sort_unstable();
        dirty.dedup();
        // Oldest first. Sequence numbers are read once: other lanes rewrite entries meanwhile,
        // and a sort whose keys change under it has no consistent order.
        let mut by_age: Vec<(u64, u32)> = dirty
            .iter()
            .map(|&slot| match engine.read_entry(slot) {
                DecodedEntry::Valid(entry) => (entry.seq, slot),
                _ => (u64::MAX, slot),
            })
            .collect();
        by_age.sort_unstable();
        // The oldest `want` first; if none of them could be written back (the backing store
        // refusing those blocks), the next oldest, and so on: blocks the backing store takes
        // make room while the ones it refuses stay dirty. A reclaim stops once
        // `WRITE_BACK_FAILURES_MAX` refusals have passed (a dead device's timeouts would add up
        // on every write; a batch that cleans nothing stops at that many in a row, so at most
        // twice that), or at a failed sync (nothing can be cleaned until the cache is attached
        // again). Only when nothing at all is written back is the first error the result.
        let mut first_error = None;
        let mut refused = 0;
        let mut changed = false;
        for chunk in by_age.chunks(want.max(1)) {
            dirty.clear();
            dirty.extend(chunk.iter().map(|&(_, slot)| slot));
            let written = self.write_back(&dirty, None);
            for &slot in &dirty {
                let word = engine.slots.load(slot);
                match word.state() {
                    SlotState::Clean => {
                        changed = true;
                        self.try_evict(slot, word, None);
                    }
                    SlotState::Free => changed = true,
                    SlotState::Dirty => {}
                }
            }
            refused += written.refused;
            match written {
                WrittenBack { cleaned: 0, error: Some(e), refused: chunk_refused, sync_failed } => {
                    first_error.get_or_insert(e);
                    if sync_failed || chunk_refused == 0 || refused >= WRITE_BACK_FAILURES_MAX {
                        break;
                    }
                }
                _ => {
                    first_error = None;
                    break;
                }
            }
        }
        self.scratch_slots = dirty;
        // A victim no longer dirty is progress, whatever else failed: room made, or about to
        // be (evicted here, or by the hand's next sweep if its stripe was busy), or dropped
        // with a lost range it lay on once its data was written back from where it could
        // (`checked.rs`), so the next try looks at other blocks.
        if changed {
            return Ok(true);
        }
        first_error.map_or(Ok(true), Err)
    }

    /// CLOCK's second chance, for the hand passing a clean `slot`: whether its block's index
    /// entry has the reference bit set — in which case the bit is cleared. Lock-free; the
    /// entry is found through the slot's metadata entry, and a slot that changes meanwhile
    /// reads as unreferenced (`try_evict` checks it again under its stripe).
    pub(super) fn referenced(&self, slot: u32) -> bool {
        let engine = self.engine;
        if !engine.marks_hits {
            return false;
        }
        let DecodedEntry::Valid(entry) = engine.read_entry(slot) else {
            return false;
        };
        match engine.index.lookup(entry.lba) {
            Some(found) if found.slot == slot && found.referenced => {
                engine.index.clear_reference(&found);
                true
            }
            _ => false,
        }
    }

    /// Evicts a clean slot if its stripe can be taken without waiting and it is unchanged.
    pub(super) fn try_evict(&mut self, slot: u32, seen: SlotWord, held: Option<usize>) -> bool {
        let engine = self.engine;
        let DecodedEntry::Valid(entry) = engine.read_entry(slot) else {
            return false;
        };
        let Some(_guard) = engine.try_lock_stripe(entry.lba, held) else {
            return false;
        };
        let now = engine.slots.load(slot);
        if !(now.same_incarnation(seen) && now.state() == SlotState::Clean) {
            return false;
        }
        let found = engine.index.lookup(entry.lba);
        assert_eq!(found.map(|f| f.slot), Some(slot), "clean slot {slot} not indexed");
        engine.index.remove(&found.expect("checked"));
        self.free_slot(entry.lba, slot);
        bump(&self.counters().evictions, 1);
        true
    }

    /// Inserts a hidden index entry for `lba` in `slot`, to reveal with `Index::replace`,
    /// making room in a full bucket first (evicting a clean occupant, or writing a dirty one
    /// back). The caller holds `lba`'s stripe; other stripes are only tried, never waited on.
    pub(super) fn index_insert(&mut self, lba: u64, slot: u32) -> Result<Found> {
        loop {
            match self.index_insert_round(lba, slot)? {
                Insert::Done(inserted) => return Ok(inserted),
                Insert::RoomMade => {}
                Insert::Busy => crate::sync::yield_now(),
            }
        }
    }

    /// `index_insert` for an admission that may be given up: `None` when no room could be
    /// made (every occupant of the bucket busy — possibly in a stripe this lane holds for
    /// another block of a batch) rather than a wait for the occupants.
    pub(super) fn index_insert_optional(&mut self, lba: u64, slot: u32) -> Result<Option<Found>> {
        for _ in 0..4 {
            match self.index_insert_round(lba, slot)? {
                Insert::Done(inserted) => return Ok(Some(inserted)),
                Insert::RoomMade => {}
                Insert::Busy => return Ok(None),
            }
        }
        Ok(None)
    }

    /// One try of `index_insert`.
    fn index_insert_round(&mut self, lba: u64, slot: u32) -> Result<Insert> {
        let engine = self.engine;
        let held = Some(engine.stripe_index(lba));
        let full = match engine.index.insert(lba, slot) {
            Ok(inserted) => return Ok(Insert::Done(inserted)),
            Err(full) => full,
        };
        bump(&self.counters().index_conflicts, 1);
        let clean = full.occupants.iter().copied().find(|&s| {
            let word = engine.slots.load(s);
            word.state() == SlotState::Clean && self.try_evict(s, word, held)
        });
        if clean.is_some() {
            return Ok(Insert::RoomMade);
        }
        // No clean occupant could be evicted: write a dirty one back (evicted next round).
        // One whose stripe another lane holds is skipped for the next: this lane holds its
        // own stripe, and two lanes making room in each other's stripes must not wait on each
        // other.
        let mut error = None;
        for &occupant in &full.occupants {
            if engine.slots.load(occupant).state() != SlotState::Dirty {
                continue;
            }
            // One the backing store refuses stays; the next occupant may go instead. One that
            // could not be read may have been written back from where it could (a lost range's
            // block, `checked.rs`): clean, it goes next round like any other.
            let written = self.write_back(&[occupant], held).into_result();
            if matches!(written, Ok(1..)) || engine.slots.load(occupant).state() == SlotState::Clean
            {
                return Ok(Insert::RoomMade);
            }
            if let Err(e) = written {
                error.get_or_insert(e);
            }
        }
        // Occupants on a lost range not settled yet may not be evictable before it is (their
        // entries lost): settle it, this lane's stripe held.
        if full.occupants.iter().any(|&s| engine.pools.is_retired(s))
            && engine.pools.lost.settle_due()
            && self.settle_lost_ranges(None, held)
        {
            return Ok(Insert::RoomMade);
        }
        match error {
            Some(e) => Err(e),
            None => Ok(Insert::Busy),
        }
    }
}

/// What one try of an index insertion did.
enum Insert {
    /// Inserted (hidden, to reveal with `Index::replace`).
    Done(Found),
    /// Room was made: try again.
    RoomMade,
    /// No room could be made now: every occupant is busy.
    Busy,
}
