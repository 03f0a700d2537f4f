//! Queued read misses: the misses of one read batch go to the backing store together, through
//! the lane's own I/O queue, so that a frontend with many reads in flight (an NBD connection's
//! pipelined requests, a ublk queue) keeps as many in flight at the backing store.
//!
//! Each miss follows the single read's protocol (`read_locked`), with its I/O overlapped with
//! the others': its admission slot is reserved first (before any stripe is held: reserving may
//! reclaim, which takes stripes), then its stripe is *tried* — a stripe another lane holds, or
//! that an earlier miss of the batch holds, sends the miss to the single path after the batch
//! — and, stripe held, the block is looked up once more (a writer or another miss may have
//! cached it meanwhile) and its read queued. Once every read completed, each admitted block is
//! inserted and persisted under its stripe exactly as a single miss is, with one difference:
//! making index room never waits on a stripe this lane holds (`index_insert_optional`: the
//! block is then served uncached). While a batch holds stripes it waits only for its own
//! I/O, never for a lock, so holding several cannot deadlock.

use pmcache_backing::{IoBuf, IoCompletion, IoQueue, IoRequest};
use smallvec::SmallVec;

use super::*;
use crate::sync::MutexGuard;

/// A lane's queue for its read misses, opened at its first batch of misses on the thread
/// that drives it (an io_uring queue belongs to one thread).
pub(crate) enum MissQueue {
    /// Not opened yet.
    Unopened,
    /// Open for the thread `thread`, with its free block buffers.
    Open { queue: Box<dyn IoQueue>, thread: std::thread::ThreadId, buffers: Vec<IoBuf> },
    /// The backing store has no queue: misses are read one at a time.
    Unavailable,
}

/// Misses read together at most (the queue's depth).
pub(crate) const MISS_BATCH_MAX: usize = 32;

/// A miss's plan before its stripe is tried: its place in the chunk, its block, whether it
/// is admissible, and its admission slot.
struct Planned {
    at: usize,
    lba: u64,
    may_admit: bool,
    slot: Option<u32>,
}

/// One miss of a batch on its way.
struct Miss<'e> {
    /// Its place in the chunk.
    request: usize,
    lba: u64,
    in_block: usize,
    /// Its admission slot, if it is to be admitted.
    slot: Option<u32>,
    /// Admissible (not beyond the sequential cutoff): which counter a bypass bumps.
    may_admit: bool,
    guard: MutexGuard<'e, u64>,
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Reads the misses of a chunk (`misses`: positions in `reads` of single-block, in-range
    /// reads that were not lock-free hits), storing each one's result at
    /// `outcomes[base + position]`. Misses that cannot go in the queued batch take the single
    /// read path afterwards.
    pub(super) fn read_misses(
        &mut self,
        reads: &mut [ReadRequest<'_>],
        misses: &[usize],
        base: usize,
        outcomes: &mut [Result<()>],
    ) {
        const _: () = assert!(MISS_BATCH_MAX >= super::batch::READ_CHUNK);
        let engine = self.engine;
        let queued = misses.len() >= 2 && self.miss_queue_ready();
        if !queued {
            for &at in misses {
                let r = &mut reads[at];
                outcomes[base + at] = self.read(r.offset, r.buf);
            }
            return;
        }
        let block = self.block_bytes();
        // Admission decisions and slots first: reserving may reclaim, which takes stripes.
        let mut planned: SmallVec<[Planned; MISS_BATCH_MAX]> = SmallVec::new();
        for &at in misses.iter().take(MISS_BATCH_MAX) {
            let r = &reads[at];
            let lba = block_of(r.offset, block);
            let tail =
                engine.admission.note_request(r.offset, r.buf.len() as u64, engine.clock.now_ns());
            let may_admit = !tail;
            let admit =
                may_admit && engine.mode().admits_reads() && engine.admission.admit_block(lba);
            planned.push(Planned { at, lba, may_admit, slot: self.reserve_for_admission(admit) });
        }
        let mut later: SmallVec<[usize; MISS_BATCH_MAX]> =
            misses.iter().skip(MISS_BATCH_MAX).copied().collect();
        let mut batch: SmallVec<[Miss<'e>; MISS_BATCH_MAX]> = SmallVec::new();
        for Planned { at, lba, may_admit, slot } in planned {
            let stripe = engine.stripe_index(lba);
            // Tried only: this lane may hold it for an earlier miss, another lane may hold it
            // while it waits for something this batch holds.
            let Some(guard) = try_lock(&engine.stripes[stripe].lock) else {
                if let Some(slot) = slot {
                    self.give_back(slot);
                }
                later.push(at);
                continue;
            };
            let in_block = offset_in_block(reads[at].offset, block) as usize;
            if let Some(found) = engine.index.lookup(lba) {
                // Cached meanwhile (a writer, or another lane's miss): a hit after all.
                let r = &mut reads[at];
                engine
                    .medium
                    .read(engine.geometry.data_offset(found.slot) + in_block as u64, r.buf);
                drop(guard);
                if let Some(slot) = slot {
                    self.give_back(slot);
                }
                bump(&self.counters().read_hits, 1);
                bump(&self.counters().bytes_read, r.buf.len() as u64);
                outcomes[base + at] = Ok(());
                continue;
            }
            batch.push(Miss { request: at, lba, in_block, slot, may_admit, guard });
        }
        let mut completions: Vec<IoCompletion> = Vec::with_capacity(batch.len());
        if let Err(e) = self.run_miss_queue(&batch, &mut completions) {
            // The queue failed as a whole (not one read): it is not used again, and the
            // batch's misses take the single path.
            let _counted = engine.backing_failed(e);
            self.miss_queue = MissQueue::Unavailable;
            for miss in batch {
                drop(miss.guard);
                if let Some(slot) = miss.slot {
                    self.give_back(slot);
                }
                later.push(miss.request);
            }
        } else {
            // Completions carry their miss's position in `batch`.
            completions.sort_unstable_by_key(|c| c.user_data);
            for (miss, completion) in batch.into_iter().zip(completions.drain(..)) {
                let at = miss.request;
                let result = self.finish_miss(miss, completion, reads[at].buf);
                if result.is_ok() {
                    bump(&self.counters().bytes_read, reads[at].buf.len() as u64);
                }
                outcomes[base + at] = result;
            }
        }
        for at in later {
            let r = &mut reads[at];
            outcomes[base + at] = self.read(r.offset, r.buf);
        }
    }

    /// Whether the lane's miss queue is open for the calling thread (opening it if needed).
    fn miss_queue_ready(&mut self) -> bool {
        let thread = std::thread::current().id();
        match &self.miss_queue {
            MissQueue::Unavailable => return false,
            MissQueue::Open { thread: owner, .. } if *owner == thread => return true,
            // Another thread drove this lane before: its queue goes (nothing is in flight
            // between batches), and this thread opens its own.
            _ => {}
        }
        let block = self.block_bytes() as usize;
        self.miss_queue = match self.engine.backing.open_queue(MISS_BATCH_MAX) {
            Ok(queue) => MissQueue::Open {
                queue,
                thread,
                buffers: (0..MISS_BATCH_MAX).map(|_| IoBuf::new(block)).collect(),
            },
            Err(_) => MissQueue::Unavailable,
        };
        matches!(self.miss_queue, MissQueue::Open { .. })
    }

    /// Reads every block of `batch` through the miss queue; `completions` receives one per
    /// miss (`user_data`: its position in `batch`). An error: the queue itself failed.
    fn run_miss_queue(
        &mut self,
        batch: &[Miss<'e>],
        completions: &mut Vec<IoCompletion>,
    ) -> std::result::Result<(), pmcache_backing::BackingError> {
        let block = self.block_bytes();
        let MissQueue::Open { queue, buffers, .. } = &mut self.miss_queue else {
            unreachable!("the miss queue was checked open");
        };
        for (i, miss) in batch.iter().enumerate() {
            let buf = buffers.pop().expect("one buffer per miss of a batch");
            if let Err(request) = queue.push(IoRequest::read(miss.lba * block, buf, i as u64)) {
                // The queue holds MISS_BATCH_MAX requests and a batch has no more.
                panic!("the miss queue refused read {} with room for it", request.user_data);
            }
        }
        queue.submit()?;
        while completions.len() < batch.len() {
            queue.reap(batch.len() - completions.len(), completions)?;
        }
        Ok(())
    }

    /// Serves one completed miss (and admits it if it has a slot), under its stripe.
    fn finish_miss(
        &mut self,
        miss: Miss<'e>,
        completion: IoCompletion,
        out: &mut [u8],
    ) -> Result<()> {
        let engine = self.engine;
        let Miss { lba, in_block, slot, may_admit, mut guard, .. } = miss;
        let IoCompletion { buf, result, .. } = completion;
        let outcome = match result {
            Err(e) => Err(engine.backing_failed(e)),
            Ok(()) => {
                out.copy_from_slice(&buf[in_block..in_block + out.len()]);
                Ok(())
            }
        };
        let admitted = match (slot, &outcome) {
            (Some(slot), Ok(())) => match self.index_insert_optional(lba, slot) {
                Ok(Some(inserted)) => {
                    // The sequence number is taken after the backing read completed (the
                    // synced rule).
                    let seq = engine.global_seq(&mut guard);
                    self.write_data(slot, &buf);
                    self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
                    engine.index.replace(&inserted, slot, engine.slots.generation(slot));
                    engine.slots.publish(slot, SlotState::Clean);
                    true
                }
                Ok(None) | Err(_) => {
                    self.give_back(slot);
                    false
                }
            },
            (Some(slot), Err(_)) => {
                self.give_back(slot);
                false
            }
            (None, _) => false,
        };
        drop(guard);
        if let MissQueue::Open { buffers, .. } = &mut self.miss_queue {
            buffers.push(buf);
        }
        if outcome.is_ok() {
            let counters = self.counters();
            bump(
                if admitted {
                    &counters.read_misses_admitted
                } else if may_admit {
                    &counters.read_misses_bypassed
                } else {
                    &counters.read_misses_sequential
                },
                1,
            );
        }
        outcome
    }
}
