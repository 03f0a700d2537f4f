//! A lane's persistence steps: every fence it issues, its entry stores, the zeroing of
//! superseded entries, the synced sequence number and the lane's sequence numbers.

use super::*;

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    pub(super) fn fence(&mut self) {
        // Superseded slots' entries not zeroed yet are zeroed now and made durable by this
        // fence, which waits for them together with whatever it was issued for (see
        // `free_superseded`): after any fence of this lane, all its zeroings are durable.
        for slot in self.frees_unzeroed.drain(..) {
            self.engine.zero_superseded_entry(slot);
        }
        self.engine.medium.drain();
        self.frees_unfenced = false;
        self.freed_durable = self.freed.len();
        // Counted after the drain: another lane that sees the count knows the drain is done.
        let fences = &self.shared.fences;
        fences.store(fences.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// Zeroes the entries of the slots superseded under stripes now released, and starts their
    /// write-back: after the release, since a store or write-back still in flight would make
    /// the stripe's unlock, a locked instruction, wait for it (docs/PERFORMANCE.md,
    /// `bench core`). They complete while the lane does other work; the lane's next fence makes them
    /// durable, and until then a lane that needs one durable settles it itself (`Stripe`).
    pub(super) fn zero_superseded_entries(&mut self) {
        for slot in self.frees_unzeroed.drain(..) {
            self.engine.zero_superseded_entry(slot);
            self.frees_unfenced = true;
        }
    }

    /// Whether entries of slots this lane superseded may not be durably zero yet (not zeroed,
    /// or zeroed and not fenced since): its next fence makes them so.
    pub(super) fn zeroings_pending(&self) -> bool {
        !self.frees_unzeroed.is_empty() || self.frees_unfenced
    }

    /// The slot of `stripe`'s pending free if its zeroed entry may not be durable yet: the
    /// lane that zeroed it has not fenced since. The caller holds the stripe.
    ///
    /// The zeroing lane's fence count is read only when this lane's last reading of it does
    /// not already show a fence since: a count only grows, and the counter's line, which its
    /// lane writes at every fence, would otherwise move between cores on most writes.
    pub(super) fn unfenced_free(&mut self, stripe: usize) -> Option<u32> {
        let record = &self.engine.stripes[stripe];
        let tagged = record.pending_free.load(Ordering::Relaxed);
        if tagged == 0 {
            return None;
        }
        let lane = (tagged >> 32) as usize - 1;
        let recorded = record.pending_free_fences.load(Ordering::Relaxed);
        if self.fences_seen[lane] > recorded {
            return None;
        }
        let fences = self.engine.lanes[lane].fences.load(Ordering::Acquire);
        self.fences_seen[lane] = fences;
        (fences == recorded).then_some(tagged as u32)
    }

    pub(super) fn write_data(&mut self, slot: u32, data: &[u8]) {
        let at = self.engine.layout.data_offset(slot);
        self.engine.medium.write_flush(at, data);
        self.engine.store_data_crc(slot, data);
        self.fence();
    }

    pub(super) fn persist_entry(&mut self, slot: u32, entry: SlotEntry) {
        self.store_entry(slot, entry);
        self.fence();
    }

    /// Stores a slot's entry and starts its write-back (a medium may store it non-temporally);
    /// durable after a fence. The slot's entry is durably free before, so a power cut that
    /// keeps one word without the other leaves a pair that reads as free or as torn, whichever
    /// word it kept (docs/FORMAT.md, torn updates).
    pub(super) fn store_entry(&self, slot: u32, entry: SlotEntry) {
        let at = self.engine.layout.entry_offset(slot);
        let (word0, word1) = entry.encode();
        self.engine.medium.store_pair_flush(at, word0, word1);
    }

    /// Rewrites word 0 of a live entry (state change); flushed, durable after a fence.
    pub(super) fn rewrite_entry_state(&self, slot: u32, entry: SlotEntry) {
        let at = self.engine.layout.entry_offset(slot);
        self.engine.medium.store_u64(at, entry.encode().0);
        self.engine.medium.flush(at, 8);
    }

    pub(super) fn advance_synced_seq(&mut self, sample: u64) {
        let engine = self.engine;
        let mut synced = lock(&engine.synced_seq);
        // Never past a failed sync (see `sync_backing`).
        if sample > *synced && !engine.backing_sync_failed.load(Ordering::SeqCst) {
            engine.medium.store_u64(SYNCED_SEQ_OFFSET, format::encode_synced_seq(sample));
            engine.medium.flush(SYNCED_SEQ_OFFSET, 8);
            self.fence();
            *synced = sample;
        }
    }

    /// A sequence number for a write-back entry, from this lane's range (refilled from the
    /// global counter 1024 at a time, so writers share no counter), above every number issued
    /// to the stripe. Write-back entries are dirty: the synced rule does not look at them. A
    /// number past the lane's range (the stripe's last is above it) moves the global counter
    /// past it too, so that [`Engine::last_issued_seq`] stays at or above every number issued
    /// (a drain tells the blocks dirty at its start by it).
    pub(super) fn local_seq(&mut self, stripe_last: &mut u64) -> u64 {
        const RANGE: u64 = 1024;
        if self.seq_next >= self.seq_end {
            self.seq_next = self.engine.next_seq.fetch_add(RANGE, Ordering::SeqCst);
            self.seq_end = self.seq_next + RANGE;
        }
        let seq = first_seq_after(self.seq_next.max(*stripe_last + 1) - 1);
        if seq >= self.seq_end {
            self.engine.next_seq.fetch_max(seq + 1, Ordering::SeqCst);
        }
        self.seq_next = seq + 1;
        *stripe_last = seq;
        seq
    }
}
