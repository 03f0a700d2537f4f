//! Read misses of several blocks: one backing read for the whole request.
//!
//! A request of several blocks that is not all lock-free hits — a database page of 8 KiB, a
//! readahead window — is read from the backing store with one request covering all of its
//! blocks, in flight like a single-block miss (`misses.rs`), instead of block by block on the
//! caller's thread. Each block is then served and admitted as a single miss would be:
//!
//! - At the start, under each block's stripe in turn (one stripe held at a time), the block
//!   is looked up, its admission slot (reserved before the stripe is taken) kept only if the
//!   block is not cached and no write of its stripe is on its way to the store, and the
//!   stripe's change count noted.
//! - At the completion, under each block's stripe in turn: a block cached now is served from
//!   the cache; a block that is not cached now is served from the data read — admitted if its
//!   slot is kept and its stripe did not change — unless it was cached at the start. Such a
//!   block was evicted while the read was in flight: the cached copy may have been newer than
//!   what the store held when it was read, so it is read again, on the ordinary path.
//!
//! A block cached at the start is read from the store with the others (one request either
//! way) and its data discarded.

use pmcache_backing::{IoCompletion, IoRequest};

use super::misses::{InFlight, MissQueue, READS_PENDING_MAX, ReadStart, Ticket, take_buffer};
use super::*;

/// Blocks one backing read of a read miss covers at most: a request of more blocks is read on
/// the ordinary path.
pub const MISS_SPAN_BLOCKS_MAX: u64 = 64;

/// A block of a span in flight.
#[derive(Clone, Copy, Debug)]
pub(super) struct SpanBlock {
    /// Its admission slot, if it is to be admitted.
    slot: Option<u32>,
    /// Its stripe's change count when the read was queued.
    changes: u64,
    /// Cached when the read was queued: the data read is not its answer.
    cached: bool,
    /// Judged cold by the n-hit policy.
    cold: bool,
}

/// A read of several blocks in flight.
pub(super) struct SpanInFlight {
    /// The first block.
    pub(super) lba: u64,
    /// The requested bytes within the first block.
    in_block: usize,
    /// The requested bytes.
    len: usize,
    /// Admissible (not beyond the sequential cutoff): which counter a bypass bumps.
    may_admit: bool,
    /// Its blocks, from `lba` on.
    pub(super) blocks: SmallVec<[SpanBlock; 4]>,
}

impl SpanInFlight {
    /// The admission slots it holds.
    pub(super) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.blocks.iter().filter_map(|b| b.slot)
    }
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Whether a read of `len` bytes at `offset` is one a span takes: within the device, over
    /// 2 to [`MISS_SPAN_BLOCKS_MAX`] blocks.
    pub(super) fn spans_blocks_in_range(&self, offset: u64, len: u64) -> bool {
        let block = self.block_bytes();
        let Some(end) = offset.checked_add(len) else { return false };
        if end > self.engine.size_bytes() || len == 0 {
            return false;
        }
        let blocks = block_of(end - 1, block) - block_of(offset, block) + 1;
        (2..=MISS_SPAN_BLOCKS_MAX).contains(&blocks)
    }

    /// Lock-free hits of every block of a read of several blocks, into `buf`; false at the
    /// first block that is not one (`buf` then holds part of the answer, which the caller
    /// discards).
    pub(super) fn span_hits(&mut self, offset: u64, buf: &mut [u8]) -> bool {
        let mut done = 0;
        while done < buf.len() {
            match self.hits_at(offset, buf, done) {
                0 => return false,
                hit => done += hit,
            }
        }
        bump(&self.counters().bytes_read, buf.len() as u64);
        true
    }

    /// Starts a read of several blocks that was not all lock-free hits (see the module docs);
    /// the queue is submitted by the caller.
    pub(super) fn start_span_miss(&mut self, offset: u64, out: &mut [u8]) -> ReadStart {
        let engine = self.engine;
        if self.misses.free.is_empty() || !self.miss_queue_ready() {
            return ReadStart::Done(self.read(offset, out));
        }
        let block = self.block_bytes();
        let (first, in_block) = (block_of(offset, block), offset_in_block(offset, block) as usize);
        let last = block_of(offset + out.len() as u64 - 1, block);
        let tail = engine.admission.note_request(offset, out.len() as u64, engine.clock.now_ns())
            && engine.scan_bypasses();
        let may_admit = !tail;
        let blocks = self.note_span(first, last - first + 1, may_admit);
        if blocks.iter().all(|b| b.cached) {
            // Every block cached meanwhile: the ordinary path copies them.
            return ReadStart::Done(self.read(offset, out));
        }
        let ticket = self.misses.free.pop().expect("checked not empty");
        let MissQueue::Open { queue, buffers, .. } = &mut self.miss_queue else {
            unreachable!("the miss queue was checked open");
        };
        let buf = take_buffer(buffers, blocks.len() * block as usize);
        if let Err(request) = queue.push(IoRequest::read(first * block, buf, u64::from(ticket))) {
            // The queue holds READS_PENDING_MAX requests and the table has room.
            panic!("the miss queue refused read {} with room for it", request.user_data);
        }
        let len = out.len();
        self.misses.table[ticket as usize] =
            Some(InFlight::Span(SpanInFlight { lba: first, in_block, len, may_admit, blocks }));
        ReadStart::Pending(Ticket(ticket))
    }

    /// Reads `out.len() / block` whole blocks from `first` on, none of them a lock-free hit
    /// a moment ago, with one backing read on the caller's thread (the ordinary path's misses
    /// of several blocks), served as a span in flight is.
    pub(super) fn read_span_now(
        &mut self,
        first: u64,
        out: &mut [u8],
        may_admit: bool,
    ) -> Result<()> {
        let block = self.block_bytes();
        let span = SpanInFlight {
            lba: first,
            in_block: 0,
            len: out.len(),
            may_admit,
            blocks: self.note_span(first, out.len() as u64 / block, may_admit),
        };
        if let Err(e) = self.engine.backing_read(out, first * block) {
            self.give_back_span_slots(&span);
            return Err(e);
        }
        self.serve_span(&span, out)
    }

    /// Gives back every admission slot `span` holds (its read failed).
    pub(super) fn give_back_span_slots(&mut self, span: &SpanInFlight) {
        for slot in span.slots() {
            self.misses.span_slots -= 1;
            self.give_back(slot);
        }
    }

    /// The start of a span's blocks (see the module docs), `count` of them from `first` on.
    fn note_span(&mut self, first: u64, count: u64, may_admit: bool) -> SmallVec<[SpanBlock; 4]> {
        let engine = self.engine;
        let mut blocks: SmallVec<[SpanBlock; 4]> = SmallVec::new();
        for lba in first..first + count {
            // Admission is decided for blocks that are not cached (a policy may count the
            // decision); under the stripe the lookup is made again.
            let admissible =
                may_admit && engine.mode().admits_reads() && engine.index.lookup(lba).is_none();
            let admit = admissible && engine.admission.admit_block(lba);
            let cold = admissible && !admit;
            // Reserved before the stripe is taken: reserving may reclaim, which takes stripes.
            // The slots spans hold are bounded: a block beyond them is served, not admitted.
            let room = self.misses.span_slots < READS_PENDING_MAX;
            let mut slot = self.reserve_for_admission(admit && room);
            self.misses.span_slots += usize::from(slot.is_some());
            let stripe = &engine.stripes[engine.stripe_index(lba)];
            let guard = stripe.lock_unchanged();
            let cached = engine.index.lookup(lba).is_some();
            // A write in flight on the stripe may land before or after this read: its data
            // may be served (the two overlap), not admitted.
            if cached || stripe.writing.load(Ordering::Relaxed) != 0 {
                slot = slot.and_then(|slot| {
                    self.misses.span_slots -= 1;
                    self.give_back(slot);
                    None
                });
            }
            let changes = stripe.changes();
            drop(guard);
            blocks.push(SpanBlock { slot, changes, cached, cold });
        }
        blocks
    }

    /// Serves a completed read of several blocks (see the module docs).
    pub(super) fn finish_span(
        &mut self,
        completion: IoCompletion,
        done: &mut dyn FnMut(Ticket, Result<&[u8]>),
    ) {
        let ticket = u32::try_from(completion.user_data).expect("a ticket");
        let Some(InFlight::Span(span)) = self.misses.table[ticket as usize].take() else {
            panic!("a span completion for ticket {ticket}, which is no span in flight");
        };
        self.misses.free.push(ticket);
        let IoCompletion { mut buf, result, .. } = completion;
        let outcome = match result {
            Err(e) => {
                let error = self.engine.backing_failed(BackingOp::Read, e);
                self.give_back_span_slots(&span);
                Err(error)
            }
            Ok(()) => {
                self.engine.backing_succeeded(BackingOp::Read);
                self.serve_span(&span, &mut buf)
            }
        };
        match outcome {
            Ok(()) => {
                bump(&self.counters().bytes_read, span.len as u64);
                done(Ticket(ticket), Ok(&buf[span.in_block..span.in_block + span.len]))
            }
            Err(e) => done(Ticket(ticket), Err(e)),
        }
        if let MissQueue::Open { buffers, .. } = &mut self.miss_queue {
            buffers.push(buf);
        }
    }

    /// Puts each block's answer into its place in `data` (the span's blocks as read from the
    /// store), admitting what may be; every slot of the span is used or given back.
    fn serve_span(&mut self, span: &SpanInFlight, data: &mut [u8]) -> Result<()> {
        let engine = self.engine;
        let block = self.block_bytes() as usize;
        let mut outcome = Ok(());
        self.misses.span_slots -= span.slots().count();
        for (i, (b, chunk)) in span.blocks.iter().zip(data.chunks_mut(block)).enumerate() {
            let lba = span.lba + i as u64;
            if outcome.is_err() {
                if let Some(slot) = b.slot {
                    self.give_back(slot);
                }
                continue;
            }
            let stripe = &engine.stripes[engine.stripe_index(lba)];
            let mut guard = stripe.lock_unchanged();
            let mut admitted = false;
            let mut served = Served::Stored;
            if let Some(found) = engine.index.lookup(lba) {
                match engine.read_block_checked(found.slot, chunk) {
                    Ok(()) => {
                        served = Served::Cached;
                        self.count_read(found.slot, 1);
                    }
                    // A clean copy that cannot be read is dropped (the store holds its data);
                    // a dirty one is the read's error.
                    Err(why) => match self.unreadable(lba, found.slot, why) {
                        Err(e) => outcome = Err(e),
                        Ok(()) if b.cached => served = Served::ReadAgain,
                        Ok(()) => {}
                    },
                }
            } else if b.cached {
                served = Served::ReadAgain;
            } else if let Some(slot) = b.slot.filter(|_| stripe.changes() == b.changes) {
                admitted = match self.index_insert_optional(lba, slot) {
                    Ok(Some(inserted)) => {
                        // The sequence number is taken after the backing read completed (the
                        // synced rule).
                        let seq = engine.global_seq(&mut guard);
                        self.write_data(slot, chunk);
                        self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
                        // Given back below if it is not revealed.
                        self.reveal_clean_copy(&inserted, slot)
                    }
                    Ok(None) | Err(_) => false,
                };
            }
            drop(guard);
            if let Some(slot) = b.slot.filter(|_| !admitted) {
                self.give_back(slot);
            }
            if served == Served::ReadAgain {
                // Counted by the ordinary path.
                if let Err(e) = self.read_locked(lba, 0, chunk, span.may_admit) {
                    outcome = Err(e);
                }
                continue;
            }
            if outcome.is_err() {
                continue;
            }
            let counters = self.counters();
            bump(
                if served == Served::Cached {
                    &counters.read_hits
                } else if admitted {
                    &counters.read_misses_admitted
                } else if span.may_admit {
                    &counters.read_misses_bypassed
                } else {
                    &counters.read_misses_sequential
                },
                1,
            );
            if b.cold && served == Served::Stored && !admitted {
                bump(&counters.read_misses_cold, 1);
            }
        }
        outcome
    }
}

/// Where a block of a span was answered from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    /// The data read from the backing store.
    Stored,
    /// The cache.
    Cached,
    /// Neither: read again on the ordinary path.
    ReadAgain,
}
