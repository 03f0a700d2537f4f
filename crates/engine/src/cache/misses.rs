//! Read misses in flight: a miss is started (its backing read queued on the lane's own I/O
//! queue) and completed later, so that the lane's caller — an NBD connection, a ublk queue —
//! answers the hits behind it at once and every miss when its own read is done, whatever else
//! is in flight.
//!
//! No lock is held while a miss's backing read is in flight. Under its stripe, the start looks
//! the block up once more (a writer or another lane's miss may have cached it: a hit after
//! all) and notes the stripe's change count; the completion takes the stripe again and
//! - serves the cached copy if the block was cached meanwhile (a write that overlapped the
//!   read, or another lane's admission: either is a valid answer for a read in flight beside
//!   it);
//! - admits the data it read (inserted and persisted exactly as a single miss does) only if
//!   nothing else took the stripe meanwhile (its change count is the one noted): a write that
//!   went around the cache, a TRIM or zeroes passed down, an insert later evicted, all take
//!   the stripe and count, and any of them could make the read's data stale;
//! - otherwise serves the data it read without admitting it.
//!
//! Admission slots are reserved before the stripe is taken at the start (reserving may
//! reclaim, which takes stripes), and a completion holds one stripe only, so the engine's
//! deadlock rule (never wait for a stripe while holding one) holds with any number of misses
//! in flight. The cost of not holding the stripe is an admission given up now and then.

use std::os::fd::BorrowedFd;

use pmcache_backing::{IoBuf, IoCompletion, IoQueue, IoRequest};

use super::*;

/// A lane's queue for its read misses, opened at its first miss on the thread that drives it
/// (an io_uring queue belongs to one thread).
pub(crate) enum MissQueue {
    /// Not opened yet.
    Unopened,
    /// Open for the thread `thread`, with its free block buffers (allocated as misses need
    /// them, at most [`READS_PENDING_MAX`]).
    Open { queue: Box<dyn IoQueue>, thread: std::thread::ThreadId, buffers: Vec<IoBuf> },
    /// The backing store has no queue: misses are read one at a time.
    Unavailable,
}

/// Read misses one lane has in flight at most; a miss beyond them is read on the spot.
pub const READS_PENDING_MAX: usize = 64;

/// A read that [`Lane::read_start`] began: answered, or in flight.
#[derive(Debug)]
pub enum ReadStart {
    /// Answered: the data is in the caller's buffer (or the read failed).
    Done(Result<()>),
    /// A miss in flight; [`Lane::complete`] hands its data over with this ticket.
    Pending(Ticket),
}

/// Names a request in flight (a read miss, a write-through) until its completion is handed
/// over; unique among a lane's requests in flight, and below [`READS_PENDING_MAX`] (a
/// frontend may index a table by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(pub(super) u32);

impl Ticket {
    /// Its place in a table of [`READS_PENDING_MAX`] entries.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A request a lane has in flight on its queue.
pub(super) enum InFlight {
    /// A read miss.
    Read(ReadInFlight),
    /// A read miss of several blocks (`spans.rs`).
    Span(super::spans::SpanInFlight),
    /// A write-through or write-around (`through.rs`).
    Write(super::through::WriteInFlight),
}

/// A buffer of `len` bytes from the queue's free buffers, or a new one.
pub(super) fn take_buffer(buffers: &mut Vec<IoBuf>, len: usize) -> IoBuf {
    match buffers.pop() {
        Some(mut buf) if buf.capacity() >= len => {
            buf.set_len(len);
            buf
        }
        _ => IoBuf::new(len),
    }
}

/// One miss in flight.
pub(super) struct ReadInFlight {
    lba: u64,
    /// The requested bytes within the block.
    in_block: usize,
    len: usize,
    /// Its admission slot, if it is to be admitted.
    slot: Option<u32>,
    /// Admissible (not beyond the sequential cutoff): which counter a bypass bumps.
    may_admit: bool,
    /// Judged cold by the n-hit policy (counted in `read_misses_cold` too).
    cold: bool,
    /// Its stripe's change count when the read was queued.
    changes: u64,
}

/// The requests a lane has in flight (read misses, write-throughs), by ticket.
pub(crate) struct MissesInFlight {
    pub(super) table: Vec<Option<InFlight>>,
    pub(super) free: Vec<u32>,
    /// Completions reaped, being served.
    reaped: Vec<IoCompletion>,
    /// Reads that completed while the lane waited for its own writes (`through.rs`), to be
    /// served at the next [`Lane::complete`].
    pub(super) reads_reaped_early: Vec<IoCompletion>,
    /// Answers not handed over yet: writes finished while the lane waited for its own
    /// writes, and requests failed with their queue.
    pub(super) answered_early: Vec<(u32, Result<()>)>,
    /// Admission slots held by reads of several blocks in flight (`spans.rs`), at most
    /// [`READS_PENDING_MAX`]: as many as single-block misses can hold.
    pub(super) span_slots: usize,
}

impl MissesInFlight {
    pub(crate) fn new() -> Self {
        Self {
            table: (0..READS_PENDING_MAX).map(|_| None).collect(),
            free: (0..READS_PENDING_MAX as u32).rev().collect(),
            reaped: Vec::with_capacity(READS_PENDING_MAX),
            reads_reaped_early: Vec::with_capacity(READS_PENDING_MAX),
            answered_early: Vec::with_capacity(READS_PENDING_MAX),
            span_slots: 0,
        }
    }

    /// Requests started and not handed over yet.
    pub(super) fn count(&self) -> usize {
        READS_PENDING_MAX - self.free.len()
    }

    /// Requests whose queue completion has not been reaped yet.
    fn on_queue(&self) -> usize {
        self.count() - self.reads_reaped_early.len() - self.answered_early.len()
    }
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Starts a read of `buf.len()` bytes at `offset`: a hit (or a read the queue cannot
    /// take: across blocks, out of range, a store without a queue) is answered at once into
    /// `buf`; a single-block miss is queued and answered by [`Lane::complete`].
    pub fn read_start(&mut self, offset: u64, buf: &mut [u8]) -> ReadStart {
        let _unwind = AbortOnUnwind::new("Lane::read_start");
        self.engine.cleaner.follow_writer_nice(false);
        let block = self.block_bytes();
        if !self.single_block_in_range(offset, buf.len() as u64) {
            if !self.spans_blocks_in_range(offset, buf.len() as u64) {
                return ReadStart::Done(self.read(offset, buf));
            }
            if self.span_hits(offset, buf) {
                return ReadStart::Done(Ok(()));
            }
            let started = self.start_span_miss(offset, buf);
            self.submit_misses();
            return started;
        }
        let (lba, in_block) = (block_of(offset, block), offset_in_block(offset, block) as usize);
        if self.read_hit(lba, in_block, buf) {
            bump(&self.counters().bytes_read, buf.len() as u64);
            return ReadStart::Done(Ok(()));
        }
        let started = self.start_miss(offset, buf);
        self.submit_misses();
        started
    }

    /// Whether a read is of one block and within the device (what the queue takes).
    pub(super) fn single_block_in_range(&self, offset: u64, len: u64) -> bool {
        let block = self.block_bytes();
        offset.checked_add(len).is_some_and(|end| end <= self.engine.size_bytes())
            && len > 0
            && block_of(offset, block) == block_of(offset + len - 1, block)
    }

    /// Starts a single-block, in-range read that was not a lock-free hit; the queue is
    /// submitted by the caller.
    pub(super) fn start_miss(&mut self, offset: u64, out: &mut [u8]) -> ReadStart {
        let engine = self.engine;
        if self.misses.free.is_empty() || !self.miss_queue_ready() {
            return ReadStart::Done(self.read(offset, out));
        }
        let block = self.block_bytes();
        let (lba, in_block) = (block_of(offset, block), offset_in_block(offset, block) as usize);
        let tail = engine.admission.note_request(offset, out.len() as u64, engine.clock.now_ns())
            && engine.scan_bypasses();
        let may_admit = !tail;
        let admissible = may_admit && engine.mode().admits_reads();
        let admit = admissible && engine.admission.admit_block(lba);
        let cold = admissible && !admit;
        // Reserved before the stripe is taken: reserving may reclaim, which takes stripes.
        let slot = self.reserve_for_admission(admit);
        let stripe = &engine.stripes[engine.stripe_index(lba)];
        let guard = stripe.lock_unchanged();
        if let Some(found) = engine.index.lookup(lba) {
            // Cached meanwhile (a writer, or another lane's miss): a hit after all.
            let read = engine.read_slot_checked(found.slot, in_block, out, &mut self.checked_block);
            drop(guard);
            if let Some(slot) = slot {
                self.give_back(slot);
            }
            if read.is_err() {
                // A copy that fails its check: the ordinary path deals with it.
                return ReadStart::Done(self.read(offset, out));
            }
            bump(&self.counters().read_hits, 1);
            self.count_read(found.slot, 1);
            bump(&self.counters().bytes_read, out.len() as u64);
            return ReadStart::Done(Ok(()));
        }
        // A write in flight on the stripe may land before or after this read: its data may
        // be served (the two overlap), not admitted.
        let slot = match slot {
            Some(slot) if stripe.writing.load(Ordering::Relaxed) != 0 => {
                self.give_back(slot);
                None
            }
            slot => slot,
        };
        let changes = stripe.changes();
        drop(guard);
        let ticket = self.misses.free.pop().expect("checked not empty");
        let MissQueue::Open { queue, buffers, .. } = &mut self.miss_queue else {
            unreachable!("the miss queue was checked open");
        };
        let buf = take_buffer(buffers, block as usize);
        if let Err(request) = queue.push(IoRequest::read(lba * block, buf, u64::from(ticket))) {
            // The queue holds READS_PENDING_MAX requests and the table has room.
            panic!("the miss queue refused read {} with room for it", request.user_data);
        }
        let len = out.len();
        self.misses.table[ticket as usize] = Some(InFlight::Read(ReadInFlight {
            lba,
            in_block,
            len,
            slot,
            may_admit,
            cold,
            changes,
        }));
        ReadStart::Pending(Ticket(ticket))
    }

    /// Passes the misses queued so far to the backing store. A queue that fails as a whole
    /// fails the misses in flight on it (`fail_misses`).
    pub(super) fn submit_misses(&mut self) {
        if let MissQueue::Open { queue, .. } = &mut self.miss_queue
            && let Err(e) = queue.submit()
        {
            self.queue_failed(e);
        }
    }

    /// Requests in flight (read misses, write-throughs): started and not handed over by
    /// [`Lane::complete`] yet.
    pub fn pending(&self) -> usize {
        self.misses.count()
    }

    /// A file descriptor that polls readable when a request in flight may have completed (a
    /// wake-up may find none), or `None` when the backing store's queue offers none: the
    /// caller then waits in [`Lane::complete`]. It covers completions the lane has not seen
    /// yet: a caller calls [`Lane::complete`] (with 0) after its other calls on the lane and
    /// before it waits, for those the lane saw meanwhile.
    pub fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.miss_queue {
            MissQueue::Open { queue, .. } => queue.completion_fd(),
            _ => None,
        }
    }

    /// Hands over completed requests, waiting until at least `min` were (fewer only if fewer
    /// are in flight; `0` never waits): a read miss is admitted or not (see the module docs)
    /// and handed to `done` with its ticket and the bytes the read asked for; a write with its
    /// ticket and no bytes (or its error). Returns how many were handed over.
    pub fn complete(&mut self, min: usize, done: &mut dyn FnMut(Ticket, Result<&[u8]>)) -> usize {
        let _unwind = AbortOnUnwind::new("Lane::complete");
        let min = min.min(self.misses.count());
        let mut served = self.hand_over_answered_early(done);
        let mut early = std::mem::take(&mut self.misses.reads_reaped_early);
        for completion in early.drain(..) {
            self.finish_request(completion, done);
            served += 1;
        }
        self.misses.reads_reaped_early = early;
        loop {
            if served >= min && min > 0 {
                return served;
            }
            let mut reaped = std::mem::take(&mut self.misses.reaped);
            let got = match &mut self.miss_queue {
                MissQueue::Open { queue, .. } if self.misses.on_queue() > 0 => {
                    queue.reap(min.saturating_sub(served), &mut reaped)
                }
                _ => Ok(0),
            };
            for completion in reaped.drain(..) {
                self.finish_request(completion, done);
                served += 1;
            }
            self.misses.reaped = reaped;
            match got {
                Err(e) => {
                    self.fail_queue_early(e);
                    return served + self.hand_over_answered_early(done);
                }
                Ok(_) if served >= min => return served,
                Ok(_) => {}
            }
        }
    }

    /// Hands over the answers kept in `answered_early` (their tickets freed), keeping the
    /// list's room. Returns how many.
    fn hand_over_answered_early(&mut self, done: &mut dyn FnMut(Ticket, Result<&[u8]>)) -> usize {
        let mut answered = std::mem::take(&mut self.misses.answered_early);
        let handed = answered.len();
        for (ticket, result) in answered.drain(..) {
            self.misses.free.push(ticket);
            done(Ticket(ticket), result.map(|()| &[][..]));
        }
        self.misses.answered_early = answered;
        handed
    }

    /// Hands over one completed request: a read miss served, a write finished.
    fn finish_request(
        &mut self,
        completion: IoCompletion,
        done: &mut dyn FnMut(Ticket, Result<&[u8]>),
    ) {
        let ticket = u32::try_from(completion.user_data).expect("a ticket");
        match self.misses.table[ticket as usize] {
            Some(InFlight::Read(_)) => self.finish_miss(completion, done),
            Some(InFlight::Span(_)) => self.finish_span(completion, done),
            Some(InFlight::Write(_)) => {
                let result = self.finish_write(completion);
                self.misses.free.push(ticket);
                done(Ticket(ticket), result.map(|()| &[][..]));
            }
            None => panic!("a completion for ticket {ticket}, which is not in flight"),
        }
    }

    /// Reaps the queue, waiting for at least `min` completions, while the lane's caller is
    /// not there to take them (the lane waits for its own writes, `through.rs`): writes are
    /// finished at once, their answers kept, and reads kept whole, for the next
    /// [`Lane::complete`]. A queue that fails as a whole is left for that call to report.
    pub(super) fn reap_early(&mut self, min: usize) {
        let mut reaped = std::mem::take(&mut self.misses.reaped);
        let got = match &mut self.miss_queue {
            MissQueue::Open { queue, .. } => {
                queue.reap(min.min(self.misses.on_queue()), &mut reaped)
            }
            _ => Ok(0),
        };
        for completion in reaped.drain(..) {
            let ticket = u32::try_from(completion.user_data).expect("a ticket");
            match self.misses.table[ticket as usize] {
                Some(InFlight::Read(_) | InFlight::Span(_)) => {
                    self.misses.reads_reaped_early.push(completion)
                }
                Some(InFlight::Write(_)) => {
                    let result = self.finish_write(completion);
                    self.misses.answered_early.push((ticket, result));
                }
                None => panic!("a completion for ticket {ticket}, which is not in flight"),
            }
        }
        self.misses.reaped = reaped;
        if let Err(e) = got {
            self.fail_queue_early(e);
        }
    }

    /// Serves one completed miss: under its stripe, from the cache if the block was cached
    /// meanwhile, else from the data read (admitted if its slot is reserved and the stripe
    /// did not change).
    fn finish_miss(
        &mut self,
        completion: IoCompletion,
        done: &mut dyn FnMut(Ticket, Result<&[u8]>),
    ) {
        let engine = self.engine;
        let ticket = u32::try_from(completion.user_data).expect("a ticket");
        let Some(InFlight::Read(ReadInFlight {
            lba,
            in_block,
            len,
            slot,
            may_admit,
            cold,
            changes,
        })) = self.misses.table[ticket as usize].take()
        else {
            panic!("a read completion for ticket {ticket}, which is no read in flight");
        };
        self.misses.free.push(ticket);
        let IoCompletion { mut buf, result, .. } = completion;
        let counters = self.counters();
        let mut admitted = false;
        let mut cached = false;
        let mut unreadable = None;
        let outcome = match result {
            Err(e) => Err(engine.backing_failed(BackingOp::Read, e)),
            Ok(()) => {
                engine.backing_succeeded(BackingOp::Read);
                let stripe = &engine.stripes[engine.stripe_index(lba)];
                let mut guard = stripe.lock_unchanged();
                if let Some(found) = engine.index.lookup(lba) {
                    // Cached while the read was in flight: the cached copy is the answer. If
                    // it cannot be read, a clean one is dropped and the backing store's, just
                    // read, is (the two overlapped); a dirty one is the read's error.
                    let mut cached_copy = std::mem::take(&mut self.block);
                    match engine.read_block_checked(found.slot, &mut cached_copy) {
                        Ok(()) => {
                            buf.copy_from_slice(&cached_copy);
                            cached = true;
                            self.count_read(found.slot, 1);
                        }
                        Err(why) => {
                            unreadable = self.unreadable(lba, found.slot, why).err();
                        }
                    }
                    self.block = cached_copy;
                } else if let Some(slot) = slot.filter(|_| stripe.changes() == changes) {
                    admitted = match self.index_insert_optional(lba, slot) {
                        Ok(Some(inserted)) => {
                            // The sequence number is taken after the backing read completed
                            // (the synced rule).
                            let seq = engine.global_seq(&mut guard);
                            self.write_data(slot, &buf);
                            self.persist_entry(
                                slot,
                                SlotEntry { lba, state: BlockState::Clean, seq },
                            );
                            // Given back below if it is not revealed.
                            self.reveal_clean_copy(&inserted, slot)
                        }
                        Ok(None) | Err(_) => false,
                    };
                }
                drop(guard);
                unreadable.map_or(Ok(()), Err)
            }
        };
        if let Some(slot) = slot.filter(|_| !admitted) {
            self.give_back(slot);
        }
        if outcome.is_ok() {
            bump(&counters.bytes_read, len as u64);
            bump(
                if cached {
                    &counters.read_hits
                } else if admitted {
                    &counters.read_misses_admitted
                } else if may_admit {
                    &counters.read_misses_bypassed
                } else {
                    &counters.read_misses_sequential
                },
                1,
            );
            if cold && !cached && !admitted {
                bump(&counters.read_misses_cold, 1);
            }
        }
        match outcome {
            Ok(()) => done(Ticket(ticket), Ok(&buf[in_block..in_block + len])),
            Err(e) => done(Ticket(ticket), Err(e)),
        }
        if let MissQueue::Open { buffers, .. } = &mut self.miss_queue {
            buffers.push(buf);
        }
    }

    /// The queue failed as a whole (not one request): it is not used again (dropping it
    /// waits for what the kernel still holds), and every request in flight on it fails with
    /// `error`, its answer kept for the next [`Lane::complete`].
    fn fail_queue_early(&mut self, error: pmcache_backing::BackingError) {
        let why = error.to_string();
        let _counted = self.engine.backing_failed(BackingOp::Other, error);
        self.miss_queue = MissQueue::Unavailable;
        let block = self.block_bytes();
        let answered: Vec<u32> = self.misses.answered_early.iter().map(|(t, _)| *t).collect();
        let reaped: Vec<u32> = self
            .misses
            .reads_reaped_early
            .iter()
            .map(|c| u32::try_from(c.user_data).expect("a ticket"))
            .collect();
        for ticket in 0..READS_PENDING_MAX as u32 {
            if answered.contains(&ticket) || reaped.contains(&ticket) {
                continue;
            }
            let (op, lba, slot) = match self.misses.table[ticket as usize].take() {
                None => continue,
                Some(InFlight::Read(miss)) => ("read", miss.lba, miss.slot),
                Some(InFlight::Span(span)) => {
                    self.give_back_span_slots(&span);
                    ("read", span.lba, None)
                }
                Some(InFlight::Write(write)) => {
                    let lba = write.lba;
                    ("write", lba, self.abandon_write(write))
                }
            };
            if let Some(slot) = slot {
                self.give_back(slot);
            }
            let source = std::io::Error::other(format!("the backing queue failed: {why}"));
            let error =
                pmcache_backing::BackingError::Io { op, offset: lba * block, len: block, source };
            self.misses.answered_early.push((ticket, Err(error.into())));
        }
    }

    /// A submit failed: the requests in flight fail when next completed (`complete` reaps
    /// the queue's error again, or their completions).
    fn queue_failed(&mut self, error: pmcache_backing::BackingError) {
        if self.misses.count() == 0 {
            let _counted = self.engine.backing_failed(BackingOp::Other, error);
            self.miss_queue = MissQueue::Unavailable;
        }
    }

    /// Completes every request in flight, dropping the answers (a lane given back with
    /// requests in flight: the frontend went away).
    pub(super) fn drain_misses(&mut self) {
        while self.misses.count() > 0 {
            self.complete(self.misses.count(), &mut |_, _| {});
        }
    }

    /// Whether the lane's miss queue is open for the calling thread (opening it if needed).
    pub(super) fn miss_queue_ready(&mut self) -> bool {
        let thread = std::thread::current().id();
        match &self.miss_queue {
            MissQueue::Unavailable => return false,
            MissQueue::Open { thread: owner, .. } if *owner == thread => return true,
            // Another thread drove this lane before: its queue goes (a lane changes threads
            // with no miss in flight), and this thread opens its own.
            _ => assert_eq!(self.misses.count(), 0, "a lane changed threads with misses in flight"),
        }
        self.miss_queue = match self.engine.backing.open_queue(READS_PENDING_MAX) {
            Ok(queue) => MissQueue::Open { queue, thread, buffers: Vec::new() },
            Err(_) => MissQueue::Unavailable,
        };
        matches!(self.miss_queue, MissQueue::Open { .. })
    }
}
