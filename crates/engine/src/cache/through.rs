//! Write-throughs and write-arounds in flight: a whole-block write in either mode is started
//! (its backing write queued on the lane's own I/O queue, beside its read misses) and
//! completed later, so that the lane's caller answers the requests behind it at once.
//!
//! The start does under the block's stripe what the synchronous path does before its backing
//! write (`write.rs`, `write_block_backing`): it waits until no copy of the stripe's blocks is
//! on its way to the backing store, drops a clean cached copy durably, and queues the write.
//! Before releasing the stripe it raises the stripe's `writing` count and notes its change
//! count. The completion takes the stripe again, admits the data written as a clean copy
//! (write-through) only if nothing else took the stripe meanwhile, counts the backing write
//! for the next flush, and lowers `writing`.
//!
//! While `writing` is raised, nobody else writes, discards or cleans one of the stripe's
//! blocks on the backing store (two writes of one block in flight could land in either
//! order), and a read miss of the stripe is not admitted. Unlike the cleaner's copies, this
//! is waited for *without* holding the stripe: the lane that lowers the count takes the
//! stripe to do so, and it may be waiting for that very stripe. A lane that waits for its
//! own writes reaps them (`reap_early`), keeping their answers for its caller.
//!
//! A write the synchronous path serves better goes there: a partial block (read, modify,
//! write), FUA, a block with a dirty copy (dropped only once the new data is synced), and
//! write-back modes, whose writes never wait for the backing store.

use std::time::Duration;

use pmcache_backing::{IoCompletion, IoRequest};

use super::batch::WriteRequest;
use super::misses::{InFlight, MissQueue};
use super::ordering::RangeHold;
use super::*;

/// A write that [`Lane::write_start`] began: answered, or in flight.
#[derive(Debug)]
pub enum WriteStart {
    /// Answered: written as the cache mode says (or failed).
    Done(Result<()>),
    /// In flight; [`Lane::complete`] hands its result over with this ticket.
    Pending(Ticket),
}

/// One write-through or write-around in flight.
pub(super) struct WriteInFlight {
    pub(super) lba: u64,
    /// Its admission slot (write-through).
    slot: Option<u32>,
    /// Its stripe's change count when the write was queued.
    changes: u64,
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Starts a write of `data` at byte `offset`. In write-through and write-around modes a
    /// whole, aligned block without FUA is queued and answered by [`Lane::complete`] once the
    /// backing store has it; any other write is done at once, as [`Lane::write`] does it.
    pub fn write_start(&mut self, offset: u64, data: &[u8], fua: bool) -> WriteStart {
        let _unwind = AbortOnUnwind::new("Lane::write_start");
        self.engine.cleaner.follow_writer_nice(true);
        self.pin_mode();
        let started = self.start_write(offset, data, fua);
        self.unpin_mode();
        self.submit_misses();
        started
    }

    /// Starts every write of `writes`, in order (see [`Lane::write_start`]): in write-back
    /// modes all are answered at once, as [`Lane::write_batch`] writes them (group commit);
    /// otherwise each whole block is queued, the queue submitted once. Writes to the same
    /// block take effect in batch order. `started` receives one [`WriteStart`] per write.
    pub fn write_batch_start(
        &mut self,
        writes: &[WriteRequest<'_>],
        started: &mut Vec<WriteStart>,
    ) {
        let _unwind = AbortOnUnwind::new("Lane::write_batch_start");
        self.engine.cleaner.follow_writer_nice(true);
        started.clear();
        // One mode for the whole batch: a switch waits for its start (`cache/mode.rs`).
        let mode = self.pin_mode();
        if writes.len() > 1 && mode.writes_back() {
            let mut outcomes = std::mem::take(&mut self.write_outcomes);
            self.write_batch(writes, &mut outcomes);
            started.extend(outcomes.drain(..).map(WriteStart::Done));
            self.write_outcomes = outcomes;
        } else {
            // One write (no group to commit), or writes that may go to the backing store.
            for w in writes {
                started.push(self.start_write(w.offset, w.data, w.fua));
            }
        }
        self.unpin_mode();
        self.submit_misses();
    }

    /// Write-through and write-around [`Lane::write_batch`] with nothing else in flight:
    /// started together, then waited for.
    pub(super) fn write_batch_through(
        &mut self,
        writes: &[WriteRequest<'_>],
        outcomes: &mut Vec<Result<()>>,
    ) {
        assert_eq!(self.pending(), 0, "a write batch waited for with requests in flight");
        let mut started = std::mem::take(&mut self.write_starts);
        self.write_batch_start(writes, &mut started);
        outcomes.clear();
        // Where each write's answer goes: its ticket's request.
        let mut waiting = [usize::MAX; super::misses::READS_PENDING_MAX];
        for (i, s) in started.drain(..).enumerate() {
            outcomes.push(match s {
                WriteStart::Done(result) => result,
                WriteStart::Pending(ticket) => {
                    waiting[ticket.index()] = i;
                    Ok(())
                }
            });
        }
        self.write_starts = started;
        while self.pending() > 0 {
            self.complete(1, &mut |ticket, result| {
                outcomes[waiting[ticket.index()]] = result.map(|_| ());
            });
        }
    }

    /// [`Lane::write_start`] without the submit.
    fn start_write(&mut self, offset: u64, data: &[u8], fua: bool) -> WriteStart {
        let engine = self.engine;
        let mode = self.pinned_mode();
        let block = self.block_bytes();
        let whole_block = data.len() as u64 == block
            && offset.is_multiple_of(block)
            && offset.checked_add(block).is_some_and(|end| end <= engine.size_bytes());
        if mode.writes_back()
            || fua
            || !whole_block
            || self.misses.free.is_empty()
            || !self.miss_queue_ready()
        {
            return WriteStart::Done(self.write(offset, data, fua));
        }
        let lba = offset / block;
        // Reserved before the stripe is taken: reserving may reclaim, which takes stripes.
        let slot = self.reserve_for_admission(mode == CacheMode::WriteThrough);
        let guard = self.lock_stripe_for_backing(lba);
        let stripe = &engine.stripes[engine.stripe_index(lba)];
        let old = engine.index.lookup(lba);
        if old.is_some_and(|f| engine.slots.load(f.slot).state() == SlotState::Dirty) {
            drop(guard);
            if let Some(slot) = slot {
                self.give_back(slot);
            }
            return WriteStart::Done(self.write(offset, data, fua));
        }
        // An older copy of the block may be on its way from the cleaner: it lands first.
        let turn = engine.backing_turn(lba, &guard);
        if let Some(found) = old {
            // Dropped durably before the backing store changes.
            engine.index.remove(&found);
            self.free_slot(lba, found.slot);
        }
        let ticket = self.misses.free.pop().expect("checked not empty");
        let MissQueue::Open { queue, buffers, .. } = &mut self.miss_queue else {
            unreachable!("the lane's queue was checked open");
        };
        let mut buf = super::misses::take_buffer(buffers, block as usize);
        buf.copy_from_slice(data);
        engine.queue_backing_write(
            queue.as_mut(),
            IoRequest::write(offset, buf, u64::from(ticket)),
            &turn,
        );
        stripe.writing.fetch_add(1, Ordering::Relaxed);
        let changes = stripe.changes();
        drop(guard);
        self.misses.table[ticket as usize] =
            Some(InFlight::Write(WriteInFlight { lba, slot, changes }));
        let counters = self.counters();
        bump(&counters.writes, 1);
        bump(&counters.bytes_written, block);
        if old.is_some() {
            bump(&counters.write_hits, 1);
        }
        WriteStart::Pending(Ticket(ticket))
    }

    /// Finishes a write whose backing write completed (see the module docs); its ticket stays
    /// taken until its answer is handed over. Returns the write's result.
    pub(super) fn finish_write(&mut self, completion: IoCompletion) -> Result<()> {
        let engine = self.engine;
        let ticket = u32::try_from(completion.user_data).expect("a ticket");
        let Some(InFlight::Write(WriteInFlight { lba, slot, changes })) =
            self.misses.table[ticket as usize].take()
        else {
            panic!("a write completion for ticket {ticket}, which is no write in flight");
        };
        let IoCompletion { buf, result, .. } = completion;
        // Counted for the next flush, a failed write too: it may have changed part of its
        // block. Counted before its answer: a flush after the answer syncs it.
        engine.backing_writes.fetch_add(1, Ordering::SeqCst);
        let stripe = &engine.stripes[engine.stripe_index(lba)];
        let mut guard = stripe.lock_unchanged();
        let mut admitted = false;
        if let (Ok(()), Some(slot)) = (&result, slot)
            && stripe.changes() == changes
            && engine.index.lookup(lba).is_none()
            && let Ok(Some(inserted)) = self.index_insert_optional(lba, slot)
        {
            // The sequence number is taken after the backing write completed (the synced
            // rule), as the synchronous path takes it.
            let seq = engine.global_seq(&mut guard);
            self.write_data(slot, &buf);
            self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
            // Given back below if it is not revealed.
            admitted = self.reveal_clean_copy(&inserted, slot);
        }
        stripe.writing.fetch_sub(1, Ordering::Relaxed);
        stripe.changes.fetch_add(1, Ordering::Relaxed);
        drop(guard);
        if let Some(slot) = slot.filter(|_| !admitted) {
            self.give_back(slot);
        }
        if let MissQueue::Open { buffers, .. } = &mut self.miss_queue {
            buffers.push(buf);
        }
        engine.backing_outcome(BackingOp::Write, result)
    }

    /// Ends a write whose queue failed as a whole and was dropped (nothing of it is in flight
    /// any more): its stripe's count is lowered, and its admission slot returned to the
    /// caller to give back.
    pub(super) fn abandon_write(&mut self, write: WriteInFlight) -> Option<u32> {
        let engine = self.engine;
        engine.backing_writes.fetch_add(1, Ordering::SeqCst);
        let stripe = &engine.stripes[engine.stripe_index(write.lba)];
        let guard = stripe.lock_unchanged();
        stripe.writing.fetch_sub(1, Ordering::Relaxed);
        stripe.changes.fetch_add(1, Ordering::Relaxed);
        drop(guard);
        write.slot
    }

    /// Locks the stripe of block `lba` once no write-through of its blocks is in flight, for
    /// a write of the backing store (see the module docs).
    pub(super) fn lock_stripe_for_backing(&mut self, lba: u64) -> MutexGuard<'e, u64> {
        let engine = self.engine;
        let stripe = engine.stripe_index(lba);
        let mut waits = 0;
        loop {
            let guard = engine.lock_stripe_index(stripe);
            if engine.stripes[stripe].writing.load(Ordering::Relaxed) == 0 {
                return guard;
            }
            drop(guard);
            self.wait_for_writes(&mut waits);
        }
    }

    /// [`Engine::hold_range`] once no write-through of the blocks held is in flight.
    pub(super) fn hold_range_for_backing(
        &mut self,
        first: u64,
        end: u64,
        max_blocks: u64,
    ) -> RangeHold<'e> {
        let engine = self.engine;
        let mut waits = 0;
        loop {
            let hold = engine.hold_range(first, end, max_blocks);
            let busy = hold
                .stripes()
                .iter()
                .find(|&&s| engine.stripes[s].writing.load(Ordering::Relaxed) != 0);
            if busy.is_none() {
                return hold;
            }
            drop(hold);
            self.wait_for_writes(&mut waits);
        }
    }

    /// One wait, holding no stripe, for the write-throughs in flight on a stripe. While this
    /// lane has writes of its own in flight — on that stripe or any other — it reaps them
    /// (their answers kept for its caller): two lanes each waiting for a stripe the other is
    /// writing must not wait for each other. Otherwise the other lanes are given time.
    pub(super) fn wait_for_writes(&mut self, waits: &mut u32) {
        let own = self.misses.table.iter().flatten().any(|r| matches!(r, InFlight::Write(_)));
        if own {
            self.reap_early(1);
            return;
        }
        *waits += 1;
        if *waits < 64 {
            crate::sync::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}
