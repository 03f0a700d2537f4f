//! The cleaner's batches: the scan of the slot table, the copies, the queued writes, the
//! pipelined flush and the clean marks (see the module above for the protocol).

use super::*;

impl<M: Medium, B: BackingStore, C: Clock> Cleaner<'_, M, B, C> {
    /// Writes back every dirty block it can, batch after batch at full speed, and returns the
    /// blocks cleaned; stops at a batch that cleans nothing (the first error then, if any).
    /// Like every batch, it must run on the thread that first used the cleaner's queue (an
    /// io_uring queue refuses other threads): before `run`, or on `run`'s thread.
    pub fn drain(&mut self) -> Result<u64> {
        let _unwind = AbortOnUnwind::new("Cleaner::drain");
        let mut cleaned = 0;
        loop {
            let outcome = self.step(self.config.batch_blocks);
            cleaned += outcome.cleaned;
            if outcome.cleaned == 0 && self.syncing.is_none() {
                if outcome.failed > 0 {
                    return Err(Error::WriteBackIncomplete {
                        failed: outcome.failed,
                        cleaned,
                        unreadable: outcome.unreadable,
                    });
                }
                if !outcome.found_dirty || self.engine().dirty_slots() == 0 {
                    return Ok(cleaned);
                }
            }
        }
    }

    /// Fills the candidate list from the slot table: dirty blocks (those the backing store
    /// refused before only when there are no others), in the policy's order.
    fn scan(&mut self) {
        let engine = self.lane.engine;
        let slot_count = engine.slots.len();
        self.candidates.clear();
        self.refused.clear();
        self.next_candidate = 0;
        let capacity = self.candidates.capacity();
        for i in 0..slot_count {
            let slot =
                ((u64::from(self.scan_cursor) + u64::from(i)) % u64::from(slot_count)) as u32;
            let word = engine.slots.load(slot);
            if word.state() != SlotState::Dirty {
                continue;
            }
            let DecodedEntry::Valid(entry) = engine.read_entry(slot) else { continue };
            let candidate = Candidate { lba: entry.lba, seq: entry.seq, slot };
            if word.write_back_refused() {
                if self.refused.len() < self.refused.capacity() {
                    self.refused.push(candidate);
                }
            } else {
                self.candidates.push(candidate);
                if self.candidates.len() == capacity {
                    self.scan_cursor = slot.wrapping_add(1) % slot_count;
                    break;
                }
            }
        }
        if self.candidates.is_empty() {
            self.candidates.append(&mut self.refused);
        }
        self.config.order.policy().order(&mut self.candidates, self.resume_lba);
    }

    /// One batch: up to `max_blocks` dirty blocks copied and written back (adjacent ones
    /// merged, up to `queue_depth` writes in flight), synced and marked clean before it
    /// returns (with the batch before, if one was still syncing).
    pub fn clean_batch(&mut self, max_blocks: usize) -> BatchOutcome {
        let _unwind = AbortOnUnwind::new("Cleaner::clean_batch");
        let mut outcome = self.step(max_blocks);
        let settled = self.settle();
        outcome.cleaned += settled.cleaned;
        outcome.superseded += settled.superseded;
        outcome.failed += settled.failed;
        outcome
    }

    /// Completes the batch still syncing, if one is: waits for its flush and marks it clean.
    pub fn settle(&mut self) -> BatchOutcome {
        let _unwind = AbortOnUnwind::new("Cleaner::settle");
        let mut outcome = BatchOutcome::default();
        if self.syncing.is_some() {
            while self.syncing.as_ref().is_some_and(|s| s.result.is_none()) {
                self.reap(1, &mut outcome);
            }
            self.complete_sync(&mut outcome);
            self.publish(&outcome);
        }
        outcome
    }

    /// One step of the pipeline: copies and writes a batch while the previous batch's flush
    /// runs; then marks the previous batch clean and sends this one's flush.
    pub(super) fn step(&mut self, max_blocks: usize) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        if self.next_candidate >= self.candidates.len() {
            self.scan();
        }
        if !self.candidates.is_empty() {
            outcome.found_dirty = true;
            self.write_batch(max_blocks, &mut outcome);
        }
        // This batch's writes and the previous batch's flush, all completed.
        while self.free_buffers.len() < self.buffers.len()
            || self.syncing.as_ref().is_some_and(|s| s.result.is_none())
        {
            self.reap(1, &mut outcome);
        }
        self.complete_sync(&mut outcome);
        self.start_sync(&mut outcome);
        self.publish(&outcome);
        outcome
    }

    /// Copies up to `max_blocks` candidates and sends them to the backing store.
    fn write_batch(&mut self, max_blocks: usize, outcome: &mut BatchOutcome) {
        let engine = self.lane.engine;
        let block = u64::from(engine.layout.block_size);
        let merge = self.config.merge_blocks.min(self.buffer_blocks);
        self.in_batch.clear();
        self.succeeded.clear();
        self.failed.clear();
        let mut copied = 0;
        let mut open_run: Option<usize> = None;
        // The open run holds a block the backing store refused before: it takes no other.
        let mut open_run_refused = false;
        while copied < max_blocks && self.next_candidate < self.candidates.len() {
            let candidate = self.candidates[self.next_candidate];
            self.next_candidate += 1;
            if self.in_batch.contains(&candidate.lba) || self.syncing_lbas.contains(&candidate.lba)
            {
                continue;
            }
            // An open run takes the block if it is empty, or if the block follows its last one
            // and neither was refused before: a refused block goes back alone, so that a bad
            // block never fails the write of a good neighbour.
            let refused = engine.slots.load(candidate.slot).write_back_refused();
            let extends = open_run.is_some_and(|run| {
                let len = self.runs[run].len() as u64;
                len == 0
                    || (!refused
                        && !open_run_refused
                        && len < merge as u64
                        && self.run_first_lba[run] + len == candidate.lba)
            });
            if !extends {
                if let Some(run) = open_run.take() {
                    self.issue(run, outcome);
                }
                open_run = Some(self.free_buffer(outcome));
            }
            let run = open_run.expect("a run is open");
            let stripe = engine.stripe_index(candidate.lba);
            // Only tried: a stripe's holder may be waiting for this cleaner's writes.
            let Some(guard) = engine.stripes[stripe].try_lock() else { continue };
            if engine.stripes[stripe].writing.load(Ordering::Relaxed) != 0 {
                // A lane's write-through of the stripe is in flight (`through.rs`).
                continue;
            }
            let word = engine.slots.load(candidate.slot);
            let current = match engine.read_entry(candidate.slot) {
                DecodedEntry::Valid(entry)
                    if word.state() == SlotState::Dirty
                        && entry.lba == candidate.lba
                        && entry.seq == candidate.seq =>
                {
                    entry
                }
                _ => continue,
            };
            let index = self.runs[run].len();
            if index == 0 {
                self.run_first_lba[run] = candidate.lba;
            }
            let buffer = self.buffers[run].as_mut().expect("an open run's buffer is here");
            let at = index * block as usize;
            let copy = &mut buffer[at..at + block as usize];
            if let Err(why) = engine.read_block_checked(candidate.slot, copy) {
                // The block's only copy cannot be read: it stays dirty, marked, and counts
                // as failed (a drain ends with an error rather than trying it forever).
                // Unless the read met a poisoned line whose lost range, settled at once,
                // wrote the block back.
                if self.lane.note_unreadable(candidate.slot, why) {
                    outcome.failed += 1;
                    outcome.unreadable += 1;
                }
                continue;
            }
            engine.stripes[stripe].cleaning.fetch_add(1, Ordering::AcqRel);
            drop(guard);
            open_run_refused = (index > 0 && open_run_refused) || word.write_back_refused();
            self.runs[run].push((candidate.slot, word, current));
            self.in_batch.insert(candidate.lba);
            self.resume_lba = candidate.lba + 1;
            copied += 1;
            outcome.copied += 1;
        }
        if let Some(run) = open_run {
            if self.runs[run].is_empty() {
                self.free_buffers.push(run);
            } else {
                self.issue(run, outcome);
            }
        }
    }

    /// A buffer for a new run, reaping completions until one is free.
    fn free_buffer(&mut self, outcome: &mut BatchOutcome) -> usize {
        loop {
            if let Some(run) = self.free_buffers.pop() {
                self.runs[run].clear();
                let len = self.buffer_blocks * self.lane.engine.layout.block_size as usize;
                self.buffers[run].as_mut().expect("a free buffer is here").set_len(len);
                return run;
            }
            self.reap(1, outcome);
        }
    }

    /// Sends run `run`'s buffer to the backing store.
    fn issue(&mut self, run: usize, outcome: &mut BatchOutcome) {
        let engine = self.lane.engine;
        let block = engine.layout.block_size as usize;
        let mut buf = self.buffers[run].take().expect("issued once");
        buf.set_len(self.runs[run].len() * block);
        let offset = self.run_first_lba[run] * block as u64;
        engine.backing_writes.fetch_add(1, Ordering::SeqCst);
        outcome.writes += 1;
        match self.queue.as_mut() {
            Some(queue) => {
                let request = IoRequest::write(offset, buf, run as u64);
                if let Err(request) = queue.push(request) {
                    // The queue holds at most one write per buffer: never full here.
                    unreachable_queue_full(request);
                }
            }
            None => {
                let result = engine.backing.write_at(&buf, offset);
                self.direct_done.push(IoCompletion {
                    user_data: run as u64,
                    op: pmcache_backing::IoOp::Write,
                    offset,
                    buf,
                    result,
                });
            }
        }
    }

    /// Collects at least `min` completions (fewer if fewer are in flight).
    fn reap(&mut self, min: usize, outcome: &mut BatchOutcome) {
        let engine = self.lane.engine;
        self.completions.clear();
        match self.queue.as_mut() {
            Some(queue) => {
                if let Err(e) = queue.reap(min, &mut self.completions) {
                    // The queue itself failed (not one request): its writes' outcomes are
                    // unknown, so wait them out on later calls; nothing in flight is counted
                    // as written. A queue that keeps failing is given up.
                    let _counted = engine.backing_failed(BackingOp::Other, e);
                    self.queue_failures += 1;
                    if self.queue_failures >= QUEUE_FAILURES_MAX {
                        self.abandon_queue();
                    } else {
                        std::thread::sleep(Duration::from_millis(1 << self.queue_failures.min(6)));
                    }
                    return;
                }
                self.queue_failures = 0;
            }
            None => self.completions.append(&mut self.direct_done),
        }
        for completion in std::mem::take(&mut self.completions) {
            if completion.user_data == FLUSH_TAG {
                let syncing = self.syncing.as_mut().expect("a flush completes for a batch");
                syncing.result = Some(completion.result);
                continue;
            }
            let run = completion.user_data as usize;
            for &(slot, word, entry) in &self.runs[run] {
                let stripe = engine.stripe_index(entry.lba);
                engine.stripes[stripe].cleaning.fetch_sub(1, Ordering::AcqRel);
                if completion.result.is_ok() {
                    self.succeeded.push((slot, word, entry));
                } else {
                    self.failed.push((slot, word, entry));
                }
            }
            if let Err(e) = completion.result {
                engine.backing_failed(BackingOp::Write, e);
                outcome.failed += self.runs[run].len() as u64;
            }
            let mut buf = completion.buf;
            buf.set_len(0);
            self.buffers[run] = Some(buf);
            self.runs[run].clear();
            self.free_buffers.push(run);
        }
    }

    /// Gives the queue up after it failed [`QUEUE_FAILURES_MAX`] times in a row: it is dropped
    /// (the engines' queues wait, when dropped, for what the kernel still holds), every copy
    /// it had in flight is ended unwritten (its stripe's `cleaning` count lowered, its block
    /// left dirty for a later batch), a flush in flight is made again synchronously, and the
    /// cleaner writes synchronously from then on.
    fn abandon_queue(&mut self) {
        let engine = self.lane.engine;
        drop(self.queue.take());
        let bytes = self.buffer_blocks * engine.layout.block_size as usize;
        for run in 0..self.buffers.len() {
            if self.buffers[run].is_some() {
                continue;
            }
            for &(_, _, entry) in &self.runs[run] {
                engine.stripes[engine.stripe_index(entry.lba)]
                    .cleaning
                    .fetch_sub(1, Ordering::AcqRel);
                // Left dirty as it is: the backing store did not refuse it.
                self.in_batch.remove(&entry.lba);
            }
            self.runs[run].clear();
            self.buffers[run] = Some(IoBuf::new(bytes));
            self.free_buffers.push(run);
        }
        if let Some(syncing) = self.syncing.as_mut().filter(|s| s.result.is_none()) {
            // Its writes had all completed before it was sent: a flush now covers them.
            syncing.result = Some(engine.backing.flush());
        }
        lock(&engine.cleaner.status).errors += 1;
    }

    /// After every write of the batch completed: marks the refused blocks, and sends the
    /// flush of those written (synchronously for a store without a queue).
    fn start_sync(&mut self, outcome: &mut BatchOutcome) {
        let engine = self.lane.engine;
        for &(slot, seen, entry) in &self.failed {
            let _guard = engine.lock_stripe(entry.lba);
            let now = engine.slots.load(slot);
            if now.same_incarnation(seen) && now.state() == SlotState::Dirty {
                engine.slots.mark_write_back_refused(slot, now);
            }
        }
        if !self.failed.is_empty() {
            lock(&engine.cleaner.status).errors += 1;
        }
        self.failed.clear();
        if self.succeeded.is_empty() {
            return;
        }
        assert!(self.syncing.is_none(), "one batch syncs at a time");
        let seq_sample = engine.last_issued_seq();
        let Ok(ticket) = engine.begin_sync() else {
            outcome.failed += self.succeeded.len() as u64;
            lock(&engine.cleaner.status).errors += 1;
            self.succeeded.clear();
            return;
        };
        let blocks = std::mem::replace(&mut self.succeeded, std::mem::take(&mut self.spare_blocks));
        self.syncing_lbas.clear();
        self.syncing_lbas.extend(blocks.iter().map(|&(_, _, entry)| entry.lba));
        let mut syncing = SyncInFlight { blocks, ticket, seq_sample, result: None };
        match self.queue.as_mut() {
            Some(queue) => {
                if let Err(request) = queue.push(IoRequest::flush(FLUSH_TAG)) {
                    // The queue has a place for the flush beside every write buffer.
                    unreachable_queue_full(request);
                }
            }
            None => syncing.result = Some(engine.backing.flush()),
        }
        self.syncing = Some(syncing);
    }

    /// After the syncing batch's flush completed: marks its blocks clean (each only if its
    /// slot is unchanged) and advances the synced sequence. While writers stall for slots,
    /// the blocks are evicted too and their slots go straight to the free pool: the cache is
    /// then all dirty but for them (any eviction would pick them), and a stalled writer takes
    /// a slot from the pool at once instead of searching the slot table for the few clean
    /// ones, where one writer can keep missing them while others take them.
    fn complete_sync(&mut self, outcome: &mut BatchOutcome) {
        let Some(syncing) = self.syncing.take() else { return };
        let engine = self.lane.engine;
        let evict = engine.cleaner.stalled_writers.load(Ordering::SeqCst) > 0;
        let mut evicted = 0u64;
        let SyncInFlight { mut blocks, ticket, seq_sample, result } = syncing;
        let result = result.expect("the flush completed");
        self.syncing_lbas.clear();
        if engine.end_sync(ticket, result).is_err() {
            outcome.failed += blocks.len() as u64;
            lock(&engine.cleaner.status).errors += 1;
        } else {
            let mut cleaned = 0u64;
            for &(slot, seen, entry) in &blocks {
                let _guard = engine.lock_stripe(entry.lba);
                let now = engine.slots.load(slot);
                if now.same_incarnation(seen) && now.state() == SlotState::Dirty {
                    self.lane
                        .rewrite_entry_state(slot, SlotEntry { state: BlockState::Clean, ..entry });
                    engine.slots.set_clean(slot);
                    cleaned += 1;
                    // Written back and synced: evicting it loses nothing.
                    let stripe = engine.stripe_index(entry.lba);
                    if evict && self.lane.try_evict(slot, engine.slots.load(slot), Some(stripe)) {
                        evicted += 1;
                    }
                } else {
                    outcome.superseded += 1;
                }
            }
            self.lane.fence();
            if evicted > 0 {
                // Durably free after the fence: to the pool, for the stalled writers.
                self.lane.return_durable_freed();
                lock(&engine.cleaner.status).blocks_evicted_for_writers += evicted;
            }
            self.lane.advance_synced_seq(seq_sample);
            let counters = self.lane.counters();
            bump(&counters.writebacks, cleaned);
            bump(&counters.dirty_delta, cleaned.wrapping_neg());
            outcome.cleaned += cleaned;
        }
        blocks.clear();
        self.spare_blocks = blocks;
    }

    /// Adds a step's figures to the cleaner's, and wakes stalled writers when slots came
    /// clean.
    fn publish(&self, outcome: &BatchOutcome) {
        let shared = &self.lane.engine.cleaner;
        let mut status = lock(&shared.status);
        if outcome.writes > 0 {
            status.batches += 1;
        }
        status.writes_issued += outcome.writes;
        status.blocks_cleaned += outcome.cleaned;
        status.blocks_superseded += outcome.superseded;
        drop(status);
        if outcome.cleaned > 0 {
            shared.advance_progress();
        }
    }
}
#[cold]
fn unreachable_queue_full(request: IoRequest) -> ! {
    panic!("the cleaner's queue refused write {} with a buffer free", request.user_data)
}
