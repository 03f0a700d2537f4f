//! What every data path shares on the engine: stripe locks and their pending frees, sequence
//! numbers, metadata entries, and the calls to the backing store that count and sync writes.

use super::*;

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    pub(crate) fn stripe_index(&self, lba: u64) -> usize {
        (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & (self.stripes.len() - 1)
    }

    /// Starts loading `lba`'s stripe lock into the CPU cache (a hint).
    pub(super) fn prefetch_stripe(&self, stripe: usize) {
        pmcache_media::prefetch(&*self.stripes[stripe] as *const Stripe);
    }

    /// Starts loading the lines a write touches for `slot`, the new copy's or the one it
    /// replaces: its DRAM word, and its entry's line only where the entry store (the new
    /// entry, or the replaced one's zeroes) needs it — not where entries are stored
    /// non-temporally, which would then have to evict it.
    pub(super) fn prefetch_slot_for_entry_store(&self, slot: u32) {
        self.slots.prefetch(slot);
        self.medium.prefetch_pair_store(self.layout.entry_offset(slot));
    }

    pub(super) fn lock_stripe(&self, lba: u64) -> MutexGuard<'_, u64> {
        self.lock_stripe_index(self.stripe_index(lba))
    }

    /// Locks the stripe at `stripe` (a request that knows its stripe index already).
    pub(super) fn lock_stripe_index(&self, stripe: usize) -> MutexGuard<'_, u64> {
        self.stripes[stripe].lock()
    }

    /// Makes the zeroing of `slot`'s entry, the pending free of `stripe` (held by the caller)
    /// recorded by a lane that has not fenced since, durable at the caller's next fence —
    /// whether that lane has stored its zeroes yet or not (it stores them after releasing the
    /// stripe, and possibly non-temporally, where no other core's flush reaches them: see
    /// [`Stripe`]).
    ///
    /// Word 0 still naming a block of this stripe can only be the superseded entry: no nonzero
    /// word 0 of the stripe's blocks is written while the caller holds it, and a reuse of the
    /// slot completed before the caller took the stripe would show in the lane's fence count
    /// (`unfenced_free` reads it under the stripe). A reuse can still happen *meanwhile* —
    /// the lane fences, the slot goes to the pool and another lane fills it — but only for a
    /// block of another stripe. So word 0 is cleared by a compare-and-swap against the value
    /// read, never by a plain store: between the load and a store, such a reuse could put a
    /// live entry there, which the store would destroy. (No ABA: the same word 0 again would
    /// be an entry of the same block, which needs this stripe.) The swap fails harmlessly if
    /// the lane's zeroes or a reuse land first; a slot already zeroed, or reused for another
    /// stripe's block, is left as it is. Either way the line is flushed, so a zeroing already
    /// visible becomes durable too.
    pub(super) fn settle_pending_free(&self, stripe: usize, slot: u32) {
        let at = self.layout.entry_offset(slot);
        let word0 = self.medium.load_u64(at);
        if word0 != 0 && self.stripe_index(format::word0_lba(word0)) == stripe {
            self.medium.compare_exchange_u64(at, word0, 0);
        }
        self.medium.flush(at, 16);
    }

    /// Stores zeroes over a superseded slot's entry and starts their write-back (with a
    /// medium's entry store: non-temporal where it stores entries so), durable at the
    /// caller's next fence.
    pub(super) fn zero_superseded_entry(&self, slot: u32) {
        self.medium.store_pair_flush(self.layout.entry_offset(slot), 0, 0);
    }

    /// Locks `lba`'s stripe without waiting, unless it is the stripe `held` by the caller.
    pub(super) fn try_lock_stripe(&self, lba: u64, held: Option<usize>) -> Option<StripeGuard<'_>> {
        let stripe = self.stripe_index(lba);
        if held == Some(stripe) {
            return Some(StripeGuard::AlreadyHeld);
        }
        self.stripes[stripe].try_lock().map(StripeGuard::Locked)
    }

    /// The stripe lock of `lba` for a write-back: waited for when the caller holds no stripe,
    /// only tried when it holds `held` (so two write-backs never wait on each other).
    pub(super) fn lock_stripe_for_write_back(
        &self,
        lba: u64,
        held: Option<usize>,
    ) -> Option<StripeGuard<'_>> {
        match held {
            None => Some(StripeGuard::Locked(self.lock_stripe(lba))),
            Some(_) => self.try_lock_stripe(lba, held),
        }
    }

    /// Issues a sequence number from the global counter, for an entry whose backing I/O has
    /// completed (clean entries: the synced rule needs the global order), above every number
    /// issued to the stripe (`stripe_last`, held under the stripe lock).
    pub(super) fn global_seq(&self, stripe_last: &mut u64) -> u64 {
        let fetched = loop {
            let seq = self.next_seq.fetch_add(1, Ordering::SeqCst);
            if format::is_issuable_seq(seq) {
                break seq;
            }
        };
        let seq = first_seq_after(fetched.max(*stripe_last + 1) - 1);
        if seq != fetched {
            self.next_seq.fetch_max(seq + 1, Ordering::SeqCst);
        }
        *stripe_last = seq;
        seq
    }

    pub(super) fn last_issued_seq(&self) -> u64 {
        self.next_seq.load(Ordering::SeqCst) - 1
    }

    pub(crate) fn read_entry(&self, slot: u32) -> DecodedEntry {
        let at = self.layout.entry_offset(slot);
        SlotEntry::decode(self.medium.load_u64(at), self.medium.load_u64(at + 8))
    }

    /// Stores a cleared (free) entry and starts its write-back; durable after a fence.
    pub(crate) fn clear_entry(&self, slot: u32) {
        let at = self.layout.entry_offset(slot);
        self.medium.store_u64(at, 0);
        self.medium.store_u64(at + 8, 0);
        self.medium.flush(at, 16);
    }

    /// Counts a failed backing-store operation of kind `op` and makes its error the engine's.
    pub(super) fn backing_failed(&self, op: BackingOp, error: BackingError) -> Error {
        self.backing_errors.fetch_add(1, Ordering::Relaxed);
        self.backing_health.failed(op, &error);
        error.into()
    }

    /// Records a successful backing-store operation of kind `op` in the health: one relaxed
    /// load while all is well (`crate::health`).
    #[inline]
    pub(super) fn backing_succeeded(&self, op: BackingOp) {
        if self.backing_health.failing() {
            self.backing_health.cleared(op, self.dirty_slots() == 0);
        }
    }

    /// The outcome of a backing-store operation of kind `op`: a success is recorded in the
    /// health, a failure is counted and becomes the engine's error.
    pub(super) fn backing_outcome(
        &self,
        op: BackingOp,
        result: std::result::Result<(), BackingError>,
    ) -> Result<()> {
        match result {
            Ok(()) => {
                self.backing_succeeded(op);
                Ok(())
            }
            Err(e) => Err(self.backing_failed(op, e)),
        }
    }

    /// Waits up to `timeout` for the backing store's health to change after change number
    /// `seen` (0 at the start); returns the change number now and the health. A server's
    /// watcher logs each change as it happens (see `crate::health`).
    pub fn wait_backing_health(
        &self,
        seen: u64,
        timeout: std::time::Duration,
    ) -> (u64, BackingHealth) {
        self.backing_health.wait_change(seen, timeout)
    }

    /// Wakes every [`Self::wait_backing_health`] waiting now (a watcher told to stop).
    pub fn wake_backing_health_watchers(&self) {
        self.backing_health.wake();
    }

    pub(super) fn backing_read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let result = self.backing.read_at(buf, offset);
        self.backing_outcome(BackingOp::Read, result)
    }

    /// `fdatasync`s the backing store, noting which writes it covered.
    ///
    /// After one fails, every later one fails too, until the engine is attached again (unless
    /// the store says a failed flush loses nothing: `BackingStore::failed_flush_loses_writes`): Linux
    /// reports a write-back error to one `fdatasync` and then drops the pages, so a later
    /// success would not mean that the writes before it are on the store, and the synced rule
    /// would trust clean blocks the store lost. Attaching again re-dirties every clean block
    /// newer than the last good sync (`synced_seq`), which is written back once more.
    pub(super) fn sync_backing(&self) -> Result<()> {
        let ticket = self.begin_sync()?;
        let result = self.backing.flush();
        self.end_sync(ticket, result)
    }

    /// The first half of a sync of the backing store whose flush is issued separately (the
    /// cleaner's, through its queue): refuses after a failed sync, and notes the writes the
    /// flush will cover — those issued before it.
    pub(super) fn begin_sync(&self) -> Result<SyncTicket> {
        if self.backing_sync_failed.load(Ordering::SeqCst) {
            self.backing_errors.fetch_add(1, Ordering::Relaxed);
            return Err(Error::BackingSyncFailedBefore);
        }
        Ok(SyncTicket { writes: self.backing_writes.load(Ordering::SeqCst) })
    }

    /// The second half: a failed flush fails every later sync too (after a failed fsync the
    /// kernel may have dropped the dirty pages it could not write), unless the store says a
    /// failed flush loses nothing.
    pub(super) fn end_sync(
        &self,
        ticket: SyncTicket,
        result: std::result::Result<(), BackingError>,
    ) -> Result<()> {
        if let Err(e) = result {
            if self.backing.failed_flush_loses_writes() {
                self.backing_sync_failed.store(true, Ordering::SeqCst);
            }
            return Err(self.backing_failed(BackingOp::Flush, e));
        }
        self.backing_writes_synced.fetch_max(ticket.writes, Ordering::SeqCst);
        self.backing_succeeded(BackingOp::Flush);
        Ok(())
    }

    pub(super) fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        let size_bytes = self.size_bytes();
        match offset.checked_add(len) {
            Some(end) if end <= size_bytes => Ok(()),
            _ => Err(Error::OutOfRange { op, offset, len, size_bytes }),
        }
    }
}

/// What a sync in progress covers (see [`Engine::begin_sync`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct SyncTicket {
    /// Backing writes issued before the flush.
    writes: u64,
}
