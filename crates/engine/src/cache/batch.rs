//! Batches: several requests handed over at once, as a frontend with a queue (an NBD
//! connection with requests in flight, a ublk or io_uring queue) has them.
//!
//! - Reads are software-pipelined in three passes over up to [`READ_CHUNK`] of them: prefetch
//!   every index bucket, look every block up, then copy and validate each exactly as a single
//!   lock-free hit does, starting the data of the read [`READ_DATA_PREFETCH_AHEAD`] places
//!   further on. The chunk's misses are then started together on the lane's I/O queue and
//!   answered as each completes (`misses.rs`).
//! - Whole-block writes in write-back mode are group-committed: the data of up to
//!   [`GROUP_MAX`] writes to distinct blocks is copied and made durable with one fence
//!   (before any stripe is locked), then their metadata entries with one fence, in rounds
//!   when another lane holds some of their stripes; the entries of the copies they replace are
//!   zeroed once the stripes are released, durable at the lane's next fence (their stripes
//!   record them: see `Stripe`) —
//!   two fences for the group (one more per extra round) instead of two per write. Every
//!   write goes through the same persist steps in the same order as alone (docs/DURABILITY.md,
//!   "Group commit"), so a crash anywhere leaves each write of the group wholly old or wholly
//!   new, and none of them was acknowledged yet.
//!
//! Requests keep their order where it matters: a group only holds writes to distinct blocks,
//! and a request that cannot join it (a partial block, another mode, a block already in the
//! group) first commits the group, then runs alone.

use pmcache_backing::BackingStore;
use pmcache_media::Medium;

use super::{Lane, ReadStart, block_of, offset_in_block};
use crate::abort::AbortOnUnwind;
use crate::clock::Clock;
use crate::config::CacheMode;
use crate::error::Result;
use crate::format::{BlockState, SlotEntry};
use crate::index::{Found, Key};
use crate::stats::bump;
use crate::sync::MutexGuard;
use smallvec::SmallVec;

/// Reads pipelined together at most (and so misses queued together at most).
pub(crate) const READ_CHUNK: usize = 32;

/// How many reads ahead of the one being copied a batch starts loading its data (measured
/// best on DRAM-emulated PM; `pmcache bench core`'s batched floor uses the same distance).
pub const READ_DATA_PREFETCH_AHEAD: usize = 2;

/// Writes committed together at most.
pub(crate) const GROUP_MAX: usize = 32;

/// One read of a batch.
pub struct ReadRequest<'a> {
    /// Byte offset on the device.
    pub offset: u64,
    /// Where the bytes go; its length is the read's length.
    pub buf: &'a mut [u8],
}

/// One write of a batch.
pub struct WriteRequest<'a> {
    /// Byte offset on the device.
    pub offset: u64,
    /// The bytes to write.
    pub data: &'a [u8],
    /// Durable on return in every mode (see `Lane::write`).
    pub fua: bool,
}

/// A write in the group being assembled.
#[derive(Clone, Copy)]
pub(crate) struct GroupWrite {
    /// Its position in the batch.
    request: usize,
    lba: u64,
    /// Its index key, computed once.
    key: Key,
    stripe: usize,
    slot: u32,
    seq: u64,
    /// Its block's index entry, found once the stripe is held: the copy it replaces, or
    /// (a block new to the cache) the hidden entry inserted for it.
    entry: Option<Found>,
    /// Where its stripe's guard is in the round's guards.
    guard: usize,
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Reads every request of `reads`, its misses in flight together; `outcomes` receives one
    /// result per request, in order, once every read is answered. No miss may be in flight
    /// on the lane already (mixing this with [`Lane::read_batch_start`] calls).
    pub fn read_batch(&mut self, reads: &mut [ReadRequest<'_>], outcomes: &mut Vec<Result<()>>) {
        assert_eq!(self.pending(), 0, "read_batch with requests in flight");
        let mut started = std::mem::take(&mut self.read_starts);
        self.read_batch_start(reads, &mut started);
        outcomes.clear();
        // Where each miss's answer goes: its ticket's request.
        let mut waiting = [usize::MAX; super::misses::READS_PENDING_MAX];
        for (i, s) in started.drain(..).enumerate() {
            outcomes.push(match s {
                ReadStart::Done(result) => result,
                ReadStart::Pending(ticket) => {
                    waiting[ticket.index()] = i;
                    Ok(())
                }
            });
        }
        while self.pending() > 0 {
            self.complete(1, &mut |ticket, result| {
                let at = waiting[ticket.index()];
                outcomes[at] = result.map(|data| reads[at].buf.copy_from_slice(data));
            });
        }
        self.read_starts = started;
    }

    /// Starts every read of `reads` (see [`Lane::read_start`]): hits answered at once, in
    /// pipelined chunks, misses queued together; `started` receives one [`ReadStart`] per
    /// request, in order.
    pub fn read_batch_start(
        &mut self,
        reads: &mut [ReadRequest<'_>],
        started: &mut Vec<ReadStart>,
    ) {
        let _unwind = AbortOnUnwind::new("Lane::read_batch_start");
        self.engine.cleaner.follow_writer_nice(false);
        started.clear();
        for chunk in reads.chunks_mut(READ_CHUNK) {
            self.read_chunk(chunk, started);
        }
        self.submit_misses();
    }

    /// Up to [`READ_CHUNK`] reads in three passes, as a hand-pipelined loop: prefetch every
    /// read's index buckets; look every block up; then copy and validate each, prefetching the
    /// data of a read a little further on. The chunk's misses are then started together: of
    /// one block (`misses.rs`), or of a read across a few blocks that were not all lock-free
    /// hits (`spans.rs`). A read that is neither (a raced copy, a read across more blocks, out
    /// of range) takes the ordinary `read` path.
    fn read_chunk(&mut self, reads: &mut [ReadRequest<'_>], started: &mut Vec<ReadStart>) {
        let engine = self.engine;
        let block = self.block_bytes();
        let mut keys = [None; READ_CHUNK];
        for (r, k) in reads.iter().zip(keys.iter_mut()) {
            if self.single_block_in_range(r.offset, r.buf.len() as u64) {
                let key = engine.index.key(block_of(r.offset, block));
                engine.index.prefetch_key(&key);
                *k = Some(key);
            }
        }
        let mut found = [None; READ_CHUNK];
        for (k, f) in keys.iter().zip(found.iter_mut()) {
            if let Some(key) = k {
                *f = engine.index.lookup_key(key).filter(|found| !found.hidden);
            }
        }
        // Each copy starts at a random page of the medium: a TLB miss and a cache miss before
        // the hardware prefetcher takes the stream over. Starting the block of the read
        // `READ_DATA_PREFETCH_AHEAD` places further on overlaps those with the copies between.
        let found = &found[..reads.len()];
        let prefetch_data = |at: usize| {
            if let Some(Some(hit)) = found.get(at) {
                engine.medium.prefetch(engine.layout.data_offset(hit.slot), block);
            }
        };
        (0..READ_DATA_PREFETCH_AHEAD).for_each(prefetch_data);
        // Single-block reads that missed are started after the hits.
        let base = started.len();
        let mut misses: SmallVec<[usize; READ_CHUNK]> = SmallVec::new();
        for (i, (r, f)) in reads.iter_mut().zip(found).enumerate() {
            prefetch_data(i + READ_DATA_PREFETCH_AHEAD);
            let hit = f.is_some_and(|hit| {
                let in_block = offset_in_block(r.offset, block) as usize;
                self.copy_validated(&hit, in_block, r.buf) == super::read::HitCopy::Hit
            });
            if hit {
                bump(&self.counters().bytes_read, r.buf.len() as u64);
                started.push(ReadStart::Done(Ok(())));
            } else if keys[i].is_some() {
                misses.push(i);
                started.push(ReadStart::Done(Ok(())));
            } else if self.spans_blocks_in_range(r.offset, r.buf.len() as u64) {
                if self.span_hits(r.offset, r.buf) {
                    started.push(ReadStart::Done(Ok(())));
                } else {
                    misses.push(i);
                    started.push(ReadStart::Done(Ok(())));
                }
            } else {
                started.push(ReadStart::Done(self.read(r.offset, r.buf)));
            }
        }
        for at in misses {
            let r = &mut reads[at];
            started[base + at] = if keys[at].is_some() {
                self.start_miss(r.offset, r.buf)
            } else {
                self.start_span_miss(r.offset, r.buf)
            };
        }
    }

    /// Writes every request of `writes`, group-committing whole-block writes in write-back
    /// mode; `outcomes` receives one result per request, in order. Each write is durable (in
    /// write-back mode, or with `fua`) when this returns, as with `write`.
    pub fn write_batch(&mut self, writes: &[WriteRequest<'_>], outcomes: &mut Vec<Result<()>>) {
        let _unwind = AbortOnUnwind::new("Lane::write_batch");
        self.engine.cleaner.follow_writer_nice(true);
        // One mode for the whole batch: a switch waits for it (`cache/mode.rs`).
        let mode = self.pin_mode();
        self.write_batch_in_mode(mode, writes, outcomes);
        self.unpin_mode();
    }

    /// [`Lane::write_batch`] in `mode`, pinned by the caller.
    fn write_batch_in_mode(
        &mut self,
        mode: CacheMode,
        writes: &[WriteRequest<'_>],
        outcomes: &mut Vec<Result<()>>,
    ) {
        let block = self.block_bytes();
        let group_max = self.engine.group_max;
        let writes_back = mode.writes_back();
        if writes_back {
            self.engine.pace_writes(writes.iter().map(|w| w.offset / block));
        }
        if !writes_back && self.pending() == 0 {
            self.write_batch_through(writes, outcomes);
            return;
        }
        let backing_blocks = self.engine.backing_blocks;
        outcomes.clear();
        outcomes.extend(writes.iter().map(|_| Ok(())));
        // The lane's group buffer (sized at start), taken for the call and given back.
        let mut group = std::mem::take(&mut self.group);
        group.clear();
        // Bit `lba % 64` of every block in the group: the group is searched for a block only
        // when its bit is set.
        let mut grouped_bits = 0u64;
        for (i, w) in writes.iter().enumerate() {
            let lba = block_of(w.offset, block);
            let joins = writes_back
                && offset_in_block(w.offset, block) == 0
                && w.data.len() as u64 == block
                && lba < backing_blocks;
            let bit = 1u64 << (lba % 64);
            let in_group = grouped_bits & bit != 0 && group.iter().any(|g| g.lba == lba);
            if !joins || group.len() == group_max || in_group {
                self.commit_group(&mut group, writes, outcomes);
                grouped_bits = 0;
            }
            if joins {
                grouped_bits |= bit;
                let stripe = self.engine.stripe_index(lba);
                group.push(GroupWrite {
                    request: i,
                    lba,
                    key: self.engine.index.key(lba),
                    stripe,
                    slot: 0,
                    seq: 0,
                    entry: None,
                    guard: 0,
                });
            } else {
                outcomes[i] = self.write(w.offset, w.data, w.fua);
            }
        }
        self.commit_group(&mut group, writes, outcomes);
        self.group = group;
    }

    /// Commits the group (see the module docs) and empties it. Writes that cannot be
    /// committed with it (their block finds no room in the index, no slot could be allocated)
    /// run alone afterwards, before any later request.
    fn commit_group(
        &mut self,
        group: &mut Vec<GroupWrite>,
        writes: &[WriteRequest<'_>],
        outcomes: &mut [Result<()>],
    ) {
        if group.is_empty() {
            return;
        }
        let engine = self.engine;
        let mut alone = std::mem::take(&mut self.group_alone);
        alone.clear();
        // 1. Slots first: allocation may evict or write back, which takes stripe locks.
        let mut allocated = 0;
        while allocated < group.len() {
            let slot = match self.free.pop() {
                Some(slot) => {
                    self.count_write(slot, 1);
                    slot
                }
                None => match self.alloc() {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
            };
            group[allocated].slot = slot;
            allocated += 1;
        }
        if allocated < group.len() {
            // The writes that got no slot run alone (and report the error if it persists).
            alone.extend(group.drain(allocated..).map(|g| g.request));
        }
        // 2. Data, before any stripe is taken: the slots are this lane's alone and nothing
        // refers to them yet (no index entry, no live entry). One fence makes every block
        // durable — and leaves no write-back outstanding for the stripes' locked
        // instructions to wait for.
        for g in group.iter() {
            engine.prefetch_crc_store(g.slot);
        }
        for g in group.iter() {
            let data = writes[g.request].data;
            engine.medium.write_flush(engine.layout.data_offset(g.slot), data);
            engine.store_data_crc(g.slot, data);
        }
        // Every metadata line the group will touch is a cache miss at a random place: start
        // them all while the fence waits for the data's stores to drain (loads pass it).
        for g in group.iter() {
            engine.prefetch_stripe(g.stripe);
            engine.index.prefetch_key(&g.key);
            engine.prefetch_slot_for_entry_store(g.slot);
        }
        self.fence();
        // 3. Entries, in rounds: the first stripe waited for (nothing is held then), the
        // others only tried, so a group never waits while holding a stripe — the engine's
        // deadlock rule. A write whose stripe is busy waits for the next round, which starts
        // with it; every round takes at least its first write out of the group (committed, or
        // sent to run alone).
        let mut next = std::mem::take(&mut self.group_next);
        next.clear();
        while !group.is_empty() {
            self.commit_entries(group, &mut next, &mut alone);
            std::mem::swap(group, &mut next);
        }
        self.group_next = next;
        // 4. The rest, alone, in their batch order.
        alone.sort_unstable();
        for &request in &alone {
            let w = &writes[request];
            outcomes[request] = self.write(w.offset, w.data, w.fua);
        }
        self.group_alone = alone;
    }

    /// One round of a group commit (its data already durable): locks what it can of
    /// `group`'s stripes, persists those writes' entries with one fence and switches
    /// them in; writes whose stripe was busy go to `busy`, writes whose block found no room in
    /// the index to `alone`. Empties `group`.
    fn commit_entries(
        &mut self,
        group: &mut Vec<GroupWrite>,
        busy: &mut Vec<GroupWrite>,
        alone: &mut Vec<usize>,
    ) {
        let engine = self.engine;
        // At most one guard per write of the group: never spills to the heap.
        let mut guards: SmallVec<[MutexGuard<'e, u64>; GROUP_MAX]> = SmallVec::new();
        // Two passes, each keeping the writes that stay in this round at the front, in batch
        // order. First the stripes: no write-back may be outstanding while they are taken (a
        // locked instruction waits for the cache-line write-backs before it), so no entry is
        // stored and flushed until every stripe is held.
        let mut kept = 0;
        for at in 0..group.len() {
            let (earlier, rest) = group.split_at_mut(at);
            let g = &mut rest[0];
            let guard = if guards.is_empty() {
                Some(engine.lock_stripe_index(g.stripe))
            } else {
                engine.stripes[g.stripe].try_lock()
            };
            g.guard = match guard {
                Some(guard) => {
                    guards.push(guard);
                    guards.len() - 1
                }
                // Held by another lane, or by this round for an earlier write of the group
                // (trying a mutex the thread holds fails too: searched only then).
                None => match earlier[..kept].iter().find(|e| e.stripe == g.stripe) {
                    Some(e) => e.guard,
                    None => {
                        bump(&self.counters().group_stripe_waits, 1);
                        busy.push(*g);
                        continue;
                    }
                },
            };
            if kept != at {
                group.swap(kept, at);
            }
            kept += 1;
        }
        group.truncate(kept);
        // Then, under the stripes: the sequence number, the index entry (the copy it replaces,
        // or a hidden one inserted for a block new to the cache), the metadata entry.
        let mut kept = 0;
        for at in 0..group.len() {
            let g = &mut group[at];
            g.seq = self.local_seq(&mut guards[g.guard]);
            let entry = match engine.index.lookup_key(&g.key) {
                Some(found) => {
                    // The replaced copy's slot word and entry are stored to after the fence.
                    engine.prefetch_slot_for_entry_store(found.slot);
                    found
                }
                None => match engine.index.insert_key(&g.key, g.slot) {
                    Ok(inserted) => inserted,
                    // Its buckets are full: it runs alone (which evicts for room).
                    Err(_) => {
                        self.give_back(g.slot);
                        alone.push(g.request);
                        continue;
                    }
                },
            };
            g.entry = Some(entry);
            crate::failpoint::mid_write();
            self.store_entry(
                g.slot,
                SlotEntry { lba: g.lba, state: BlockState::Dirty, seq: g.seq },
            );
            if kept != at {
                group.swap(kept, at);
            }
            kept += 1;
        }
        group.truncate(kept);
        if group.is_empty() {
            return;
        }
        self.fence();
        // A write whose stores went to a range of the medium lost meanwhile is not switched
        // in: it runs again alone, in another slot (`Lane::stores_landed`).
        let mut kept = 0;
        for at in 0..group.len() {
            let g = group[at];
            if !self.stores_landed(g.slot) {
                let entry = g.entry.expect("found or inserted under the stripe");
                if entry.hidden {
                    engine.index.remove(&entry);
                }
                self.abandon_unlanded(g.slot);
                alone.push(g.request);
                continue;
            }
            if kept != at {
                group.swap(kept, at);
            }
            kept += 1;
        }
        group.truncate(kept);
        // Visible: switch the index, publish, free the replaced copies — their entries zeroed
        // after the stripes are released, not fenced: each becomes its stripe's pending free
        // (see `Stripe`); a fence only if one of those stripes still had an earlier pending
        // free that was not durable.
        let mut must_fence = false;
        let mut newly_dirty = 0;
        let mut hits = 0;
        for g in group.iter() {
            let entry = g.entry.expect("found or inserted under the stripe");
            let switched = self.switch_in_dirty(g.stripe, g.slot, entry);
            must_fence |= switched.must_fence;
            newly_dirty += u64::from(switched.newly_dirty);
            hits += u64::from(switched.hit);
        }
        if must_fence {
            self.fence();
        }
        drop(guards);
        self.zero_superseded_entries();
        for g in group.iter() {
            if let Some(replaced) = g.entry.filter(|e| !e.hidden) {
                self.keep_free(replaced.slot);
            }
        }
        let block = self.block_bytes();
        let counters = self.counters();
        let written = group.len() as u64;
        bump(&counters.writes, written);
        bump(&counters.group_writes, written);
        bump(&counters.bytes_written, written * block);
        bump(&counters.dirty_delta, newly_dirty);
        bump(&counters.write_hits, hits);
        group.clear();
    }
}
