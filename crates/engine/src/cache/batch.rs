//! Batches: several requests handed over at once, as a frontend with a queue (an NBD
//! connection with requests in flight, a ublk or io_uring queue) has them.
//!
//! - Reads are software-pipelined in three passes over up to [`READ_CHUNK`] of them: prefetch
//!   every index bucket, look every block up, then copy and validate each exactly as a single
//!   lock-free hit does, starting the data of the read [`READ_DATA_PREFETCH_AHEAD`] places
//!   further on.
//! - Whole-block writes in write-back mode are group-committed: the data of up to
//!   [`GROUP_MAX`] writes to distinct blocks is copied and made durable with one fence
//!   (before any stripe is locked), then their metadata entries with one fence, in rounds
//!   when another lane holds some of their stripes; the entries of the copies they replace are
//!   zeroed and left to the lane's next fence (their stripes record them: see `Stripe`) —
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

use super::{Lane, block_of, offset_in_block};
use crate::clock::Clock;
use crate::error::Result;
use crate::format::{BlockState, SlotEntry};
use crate::index::{Found, Key};
use crate::stats::bump;
use crate::sync::MutexGuard;
use smallvec::SmallVec;

/// Reads pipelined together at most.
const READ_CHUNK: usize = 32;

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
    /// Reads every request of `reads`, pipelining their cache misses; `outcomes` receives one
    /// result per request, in order.
    pub fn read_batch(&mut self, reads: &mut [ReadRequest<'_>], outcomes: &mut Vec<Result<()>>) {
        outcomes.clear();
        for chunk in reads.chunks_mut(READ_CHUNK) {
            self.read_chunk(chunk, outcomes);
        }
    }

    /// Up to [`READ_CHUNK`] reads in three passes, as a hand-pipelined loop: prefetch every
    /// read's index buckets; look every block up; then copy and validate each, prefetching the
    /// data of a read a little further on. The misses of one pass overlap each other instead of each read waiting
    /// for its own in turn. A read that is not a lock-free hit of one block (a miss, a raced
    /// copy, a read across blocks or out of range) takes the ordinary `read` path.
    fn read_chunk(&mut self, reads: &mut [ReadRequest<'_>], outcomes: &mut Vec<Result<()>>) {
        let engine = self.engine;
        let block = self.block_bytes();
        let size_bytes = engine.size_bytes();
        let single_block = |r: &ReadRequest<'_>| {
            let len = r.buf.len() as u64;
            r.offset.checked_add(len).is_some_and(|end| end <= size_bytes)
                && len > 0
                && block_of(r.offset, block) == block_of(r.offset + len - 1, block)
        };
        let mut keys = [None; READ_CHUNK];
        for (r, k) in reads.iter().zip(keys.iter_mut()).filter(|(r, _)| single_block(r)) {
            let key = engine.index.key(block_of(r.offset, block));
            engine.index.prefetch_key(&key);
            *k = Some(key);
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
                engine.medium.prefetch(engine.geometry.data_offset(hit.slot), block);
            }
        };
        (0..READ_DATA_PREFETCH_AHEAD).for_each(prefetch_data);
        for (i, (r, f)) in reads.iter_mut().zip(found).enumerate() {
            prefetch_data(i + READ_DATA_PREFETCH_AHEAD);
            let hit = f.is_some_and(|hit| {
                self.copy_validated(&hit, offset_in_block(r.offset, block) as usize, r.buf)
            });
            if hit {
                bump(&self.counters().bytes_read, r.buf.len() as u64);
                outcomes.push(Ok(()));
            } else {
                outcomes.push(self.read(r.offset, r.buf));
            }
        }
    }

    /// Writes every request of `writes`, group-committing whole-block writes in write-back
    /// mode; `outcomes` receives one result per request, in order. Each write is durable (in
    /// write-back mode, or with `fua`) when this returns, as with `write`.
    pub fn write_batch(&mut self, writes: &[WriteRequest<'_>], outcomes: &mut Vec<Result<()>>) {
        let block = self.block_bytes();
        let group_max = self.engine.group_max;
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
            let joins = self.engine.mode().writes_back()
                && offset_in_block(w.offset, block) == 0
                && w.data.len() as u64 == block
                && lba < self.engine.backing_blocks;
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
        for g in group.iter_mut() {
            match self.alloc() {
                Ok(slot) => {
                    g.slot = slot;
                    allocated += 1;
                }
                Err(_) => break,
            }
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
            engine.medium.write_flush(engine.geometry.data_offset(g.slot), writes[g.request].data);
        }
        // Every metadata line the group will touch is a cache miss at a random place: start
        // them all while the fence waits for the data's stores to drain (loads pass it).
        for g in group.iter() {
            engine.prefetch_stripe(g.stripe);
            engine.index.prefetch_key(&g.key);
            engine.prefetch_slot(g.slot);
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
        let mut guards: SmallVec<[(usize, MutexGuard<'e, u64>); GROUP_MAX]> = SmallVec::new();
        // In place (`retain_mut` moves a write only once an earlier one has left).
        group.retain_mut(|g| {
            let held = guards.iter().position(|(stripe, _)| *stripe == g.stripe);
            g.guard = match held {
                Some(at) => at,
                None => {
                    let guard = if guards.is_empty() {
                        Some(engine.lock_stripe_index(g.stripe))
                    } else {
                        engine.stripes[g.stripe].lock.try_lock().ok()
                    };
                    let Some(guard) = guard else {
                        bump(&self.counters().group_stripe_waits, 1);
                        busy.push(*g);
                        return false;
                    };
                    guards.push((g.stripe, guard));
                    guards.len() - 1
                }
            };
            true
        });
        // Sequence numbers under the stripes; the copies being replaced are known now: start
        // loading their slot words and entries too.
        for g in group.iter_mut() {
            g.seq = self.local_seq(&mut guards[g.guard].1);
            g.entry = engine.index.lookup_key(&g.key);
            if let Some(found) = g.entry {
                engine.prefetch_slot(found.slot);
            }
        }
        // Entries; one fence makes every entry durable. A block new to the cache needs an
        // index entry first; if its buckets are full it runs alone (which evicts for room).
        group.retain_mut(|g| {
            if g.entry.is_none() {
                match engine.index.insert_key(&g.key, g.slot) {
                    Ok(inserted) => g.entry = Some(inserted),
                    Err(_) => {
                        self.give_back(g.slot);
                        alone.push(g.request);
                        return false;
                    }
                }
            }
            self.store_entry(
                g.slot,
                SlotEntry { lba: g.lba, state: BlockState::Dirty, seq: g.seq },
            );
            true
        });
        if group.is_empty() {
            return;
        }
        self.fence();
        // Visible: switch the index, publish, zero the replaced copies' entries — not fenced:
        // each becomes its stripe's pending free (see `Stripe`); a fence only if one of those
        // stripes still had an earlier pending free that was not durable.
        let mut must_fence = false;
        for g in group.iter() {
            let entry = g.entry.expect("found or inserted under the stripe");
            must_fence |= self.switch_in_dirty(g.stripe, g.slot, entry);
        }
        if must_fence {
            self.fence();
        }
        drop(guards);
        self.start_freed_write_backs();
        for g in group.iter() {
            if let Some(replaced) = g.entry.filter(|e| !e.hidden) {
                self.keep_free(replaced.slot);
            }
        }
        let block = self.block_bytes();
        let counters = self.counters();
        bump(&counters.writes, group.len() as u64);
        bump(&counters.group_writes, group.len() as u64);
        bump(&counters.bytes_written, group.len() as u64 * block);
        group.clear();
    }
}
