//! The cache: [`Engine`] owns the medium, the backing store and the shared DRAM structures;
//! a [`Lane`] is one thread's (or one queue's) handle with its own free slots, scratch block
//! and counters. All data paths are methods of `Lane`.
//!
//! Concurrency protocol (docs/ARCHITECTURE.md has the long form):
//! - Read hits take no lock: index lookup, copy, index entry again (it carries the slot's
//!   generation: a seqlock on the mapping, with no other DRAM line read).
//! - Every change to which slot holds block `b`, and every state change of that slot, happens
//!   under `b`'s stripe lock. Slot allocation never holds a stripe lock (it may evict and write
//!   back other blocks), so the data paths allocate first and lock second.
//! - A freed slot is reused only after the freeing lane has fenced its cleared metadata entry.
//!
//! Durability protocol: docs/DURABILITY.md.

use std::time::{SystemTime, UNIX_EPOCH};

use crossbeam_utils::CachePadded;
use pmcache_backing::{BackingError, BackingStore};
use pmcache_media::{Medium, MemberSpan};
use rand::RngCore;
use smallvec::SmallVec;

use crate::abort::AbortOnUnwind;
use crate::admission::Admission;
use crate::clock::Clock;
use crate::config::{CacheMode, Config};
use crate::error::{Error, Result};
use crate::eviction::{EvictionPolicy, Sweep};
use crate::format::{
    self, BlockState, DecodedEntry, Membership, SHUTDOWN_CLEAN, SHUTDOWN_DIRTY,
    SHUTDOWN_WORD_OFFSET, SUPERBLOCK_BYTES, SYNCED_SEQ_OFFSET, SlotEntry, Superblock,
};
use crate::freepool::Pools;
use crate::health::{BackingHealth, BackingOp};
use crate::index::{Found, Index};
use crate::layout::{Layout, Member};
use crate::placement::{MemberCounters, MemberStats, Placement};
use crate::slots::{SlotState, SlotTable, SlotWord};
use crate::stats::{LaneCounters, PaddedCounters, Stats, bump};
use crate::sync::{
    AtomicBool, AtomicU32, AtomicU64, Mutex, MutexGuard, Ordering, fence, lock, try_lock,
};

mod alloc;
mod batch;
mod checked;
mod cleaner;
mod extents;
mod inline_writeback;
mod invalidate;
mod lifecycle;
mod misses;
mod mode;
mod ordering;
mod persist;
mod read;
mod shared;
mod spans;
#[cfg(all(test, not(feature = "shuttle")))]
mod tests;
mod through;
mod through_runs;
mod write;
mod zeroes;

pub use batch::{READ_DATA_PREFETCH_AHEAD, ReadRequest, WriteRequest};
use cleaner::CleanerShared;
pub use cleaner::{BatchOutcome, Cleaner};
use inline_writeback::WrittenBack;
pub use misses::{READS_PENDING_MAX, ReadStart, Ticket};
pub use spans::MISS_SPAN_BLOCKS_MAX;
pub use through::WriteStart;

/// Read hits a lane of a cache of several members counts local or remote between asking which
/// node its thread runs on (a `sched_getcpu`; it also asks at every refill of its free run).
const NODE_CHECK_READS: u32 = 256;
/// Slots a lane examines per claim of the CLOCK hand.
const HAND_CHUNK: u64 = 32;
/// Lock-free read attempts before a reader takes the stripe lock.
const READ_ATTEMPTS: usize = 4;
/// Dirty slots written back per batch by `drain`.
const DRAIN_BATCH: usize = 256;
/// Backing-store writes in a row a write-back lets fail before it leaves the rest of its
/// victims dirty (see `Lane::write_back`), and refused write-backs a reclaim lets pass, over
/// its batches, before it gives up with the backing store's error: a few bad blocks do not
/// stop the cache, and a dead device's timeouts are not waited out for every dirty block.
const WRITE_BACK_FAILURES_MAX: usize = 8;
/// Batches in a row a drain lets write back nothing, with an error, before it stops.
const DRAIN_FAILED_BATCHES_MAX: usize = 2;
/// How long a drain waits for blocks kept busy by writes of them to the backing store in
/// flight on other lanes before it gives up on them ([`Error::DrainBusy`]).
const DRAIN_BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
/// Slots a lane frees before it returns them to the pool. Returning is a lock and one bit per
/// slot set in the pool's bitmap; at 256 a write in 256 paid a few microseconds for it, at 16
/// or 32 nothing shows (docs/PERFORMANCE.md, `bench core`).
const FREED_SPILL_MAX: usize = 32;

pub(crate) struct LaneSlot {
    in_use: AtomicBool,
    counters: PaddedCounters,
    /// Fences the lane has completed. Other lanes read it to tell whether the zeroing of an
    /// entry this lane superseded is durable yet: see [`Stripe`]. It only ever grows, across
    /// every `Lane` that holds this slot in turn, and is never reset: other lanes keep their
    /// readings of it (`Lane::unfenced_free`), which stay proof of a fence only because of that.
    fences: CachePadded<AtomicU64>,
    /// Reads and writes of each member by this lane, local or remote (`placement.rs`).
    members: Box<[MemberCounters]>,
    /// The mode word the lane's write request in progress pinned, 0 for none
    /// (`cache/mode.rs`).
    mode_pin: CachePadded<AtomicU64>,
}

/// A lock over a set of blocks, and the one superseded entry of them that may not be durably
/// zeroed yet.
///
/// A write that replaces a block's copy zeroes the old copy's entry after releasing the
/// stripe and leaves its durability to the lane's next fence: the new entry is durable, so if
/// the old one survives a power cut, recovery discards it as older. That stays true only while
/// the new entry exists. Whoever removes a block's newest entry without writing a newer one
/// (eviction, trim, invalidation), or records another pending free in its place, holds the
/// stripe and first settles the pending one (`Engine::settle_pending_free`): it clears the
/// entry's word 0 itself if the zeroing lane has not yet, flushes the line, and its own fence
/// makes that durable. (Flushing alone is not enough: the zeroes may not be stored yet, or
/// sit in the zeroing core's write-combining buffer, which no other core's flush reaches.)
/// The pending entry is known to be durable once the lane that superseded it has fenced since
/// (its [`LaneSlot::fences`] moved past the recorded count): a lane's fence first zeroes every
/// entry it superseded and not yet zeroed, a fence makes the issuing thread's stores and
/// flushes durable, and a lane is driven by one thread at a time.
pub(crate) struct Stripe {
    /// Held while one of the stripe's blocks changes. It holds the last sequence number issued
    /// to a block of the stripe, so that a block's sequence numbers grow in lock order
    /// whichever lane issues them.
    lock: Mutex<u64>,
    /// The superseded slot whose zeroed entry may not be durable: `(lane + 1) << 32 | slot`,
    /// 0 for none. Read and written under `lock` only.
    pending_free: AtomicU64,
    /// The superseding lane's fence count when it recorded `pending_free`. Under `lock` only.
    pending_free_fences: AtomicU64,
    /// Copies of the stripe's blocks the cleaner has on their way to the backing store
    /// (raised under `lock`, lowered without it at completion). Whoever else writes or
    /// discards one of the stripe's blocks on the backing store waits for zero first
    /// (`cache/ordering.rs`).
    cleaning: AtomicU32,
    /// Write-throughs and write-arounds lanes have on their way to the backing store for the
    /// stripe's blocks (`through.rs`), raised and lowered under `lock`. Whoever else writes
    /// or discards one of the stripe's blocks on the backing store, or cleans one, waits for
    /// zero first — *without* holding the stripe (the lane that lowers it takes the stripe
    /// to do so): `Lane::lock_stripe_for_backing`.
    writing: AtomicU32,
    /// How many times the stripe changed: every lock but a read miss's (`misses.rs`), and
    /// every write-through's completion (`through.rs`). A miss or a write-through admits its
    /// data only if this did not move while it was in flight. Changed and read under `lock`
    /// only.
    changes: AtomicU64,
}

impl Stripe {
    /// Locks the stripe for a change, counted in `changes`.
    fn lock(&self) -> MutexGuard<'_, u64> {
        let guard = lock(&self.lock);
        self.changes.fetch_add(1, Ordering::Relaxed);
        guard
    }

    /// [`Stripe::lock`] if no one holds it.
    fn try_lock(&self) -> Option<MutexGuard<'_, u64>> {
        let guard = try_lock(&self.lock)?;
        self.changes.fetch_add(1, Ordering::Relaxed);
        Some(guard)
    }

    /// Locks the stripe for a read miss's start or completion, not counted: a miss only adds
    /// a block no one had cached, which no other miss in flight can have read stale.
    fn lock_unchanged(&self) -> MutexGuard<'_, u64> {
        lock(&self.lock)
    }

    /// The change count (the caller holds the lock).
    fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }
}

/// The cache engine, generic over its medium, backing store and clock.
pub struct Engine<M: Medium, B: BackingStore, C: Clock> {
    pub(crate) medium: M,
    pub(crate) backing: B,
    pub(crate) clock: C,
    /// Member 0's superblock (every member has the cache's uuid and backing store).
    pub(crate) superblock: Superblock,
    pub(crate) layout: Layout,
    pub(crate) backing_blocks: u64,
    pub(crate) slots: SlotTable,
    pub(crate) index: Index,
    /// Block locks (a block's stripe is a hash of its number), with their pending frees.
    stripes: Box<[CachePadded<Stripe>]>,
    /// Free slots, a pool per member.
    pub(crate) pools: Pools,
    /// A CLOCK hand per member: the slot it points at, counted in its member.
    hands: Box<[CachePadded<AtomicU64>]>,
    placement: Placement,
    pub(crate) next_seq: AtomicU64,
    synced_seq: Mutex<u64>,
    backing_writes: AtomicU64,
    backing_writes_synced: AtomicU64,
    /// Backing-store operations that failed (for `Stats::backing_errors`; cold path).
    backing_errors: AtomicU64,
    /// What the last backing-store operations did (for `Stats::backing`).
    pub(crate) backing_health: crate::health::HealthTracker,
    /// Set when an `fdatasync` of the backing store failed (see `sync_backing`).
    backing_sync_failed: AtomicBool,
    lanes: Box<[LaneSlot]>,
    /// Set by `shutdown`: no new lanes.
    closed: AtomicBool,
    /// Held while a lane is handed out and while `shutdown` checks for open lanes and marks
    /// the cache shut down, so that neither passes the other: a lane taken after the check
    /// would run on a cache already marked cleanly shut down.
    lifecycle: Mutex<()>,
    /// The cache mode and how many times it switched (`cache/mode.rs`).
    mode: AtomicU64,
    /// Held by a mode switch while it waits for the requests of the old mode.
    mode_switch: Mutex<()>,
    /// The rare side pays the frequent side's fences (`pmcache_media::barrier`): a mode
    /// switch those of the pins (`cache/mode.rs`), a medium losing a range those of the
    /// writes that check their stores landed (`cache/checked.rs`), so lanes fence with a
    /// compiler fence only. False where the kernel offers no expedited membarrier, and under
    /// shuttle.
    fence_asymmetric: bool,
    admission: Admission,
    eviction: &'static dyn EvictionPolicy,
    /// The background cleaner's shared state (`cache/cleaner/`).
    cleaner: CleanerShared,
    /// `eviction.marks_hits()`, read once: every read hit asks.
    marks_hits: bool,
    /// The CRC32C of a block of zeroes (the checksum of a zeroed slot: `checked.rs`).
    zero_block_crc: u32,
    pub(crate) recovered_dirty: u64,
    lane_free_max: usize,
    /// Slots a lane takes from the pool at once, in address order.
    refill_batch: usize,
    /// Slots a lane frees before it returns them to the pool, all at once.
    freed_spill: usize,
    /// Writes a lane commits as one group at most: a lane holds this many allocated slots at
    /// once, so all lanes' groups together never hold more than half the cache (their free
    /// runs and freed slots are bounded apart: `refill_batch`, `freed_spill`).
    group_max: usize,
    /// Whole blocks from which a write-zeroes in a write-back mode zeroes uncached blocks on
    /// the backing store (`cache/zeroes.rs`).
    zero_through_blocks_min: AtomicU64,
}

/// Writes zeroes over a medium range and persists them.
/// Checks that a cache of `slot_count` slots of `block_size` bytes can serve a backing store
/// of `backing_bytes` with `config`; returns the backing store's block count.
fn check_fit(block_size: u32, slot_count: u64, backing_bytes: u64, config: &Config) -> Result<u64> {
    let block = u64::from(block_size);
    if !backing_bytes.is_multiple_of(block) || backing_bytes == 0 {
        return Err(Error::Config(format!(
            "the backing store is {backing_bytes} bytes, not a non-zero multiple of the {block}-byte cache block"
        )));
    }
    let backing_blocks = backing_bytes / block;
    if backing_blocks > format::MAX_BACKING_BLOCKS {
        return Err(Error::Config(format!(
            "the backing store has {backing_blocks} blocks; at most 2^40 are supported"
        )));
    }
    if config.max_lanes == 0 {
        return Err(Error::Config("max_lanes is 0: a cache needs at least one lane".into()));
    }
    if slot_count < 4 * config.max_lanes as u64 {
        return Err(Error::Config(format!(
            "a cache of {} slots is too small for {} lanes (need 4 slots per lane: a larger \
             medium, or fewer lanes)",
            slot_count, config.max_lanes
        )));
    }
    Ok(backing_blocks)
}

fn zero_range<M: Medium>(medium: &M, offset: u64, len: u64) {
    let zeroes = vec![0u8; 1 << 20];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeroes.len() as u64);
        medium.write(offset + done, &zeroes[..n as usize]);
        medium.flush(offset + done, n);
        done += n;
    }
    medium.drain();
}

/// The first issuable sequence number greater than `seq`.
pub(crate) fn first_seq_after(seq: u64) -> u64 {
    let mut next = seq + 1;
    while !format::is_issuable_seq(next) {
        next += 1;
    }
    next
}

/// One thread's (or queue's) handle on the engine. A lane's fences make the flushes it issued
/// durable, and other lanes rely on that (see [`Stripe`]), so a lane is driven by one thread at
/// a time; handing it to another thread goes through a synchronizing hand-off (on x86 a locked
/// instruction, which orders cache-line write-backs like a fence).
pub struct Lane<'e, M: Medium, B: BackingStore, C: Clock> {
    engine: &'e Engine<M, B, C>,
    id: usize,
    /// `engine.lanes[id]`: this lane's counters and fence count, reached without an index.
    shared: &'e LaneSlot,
    /// Free slots taken from the pool, popped in address order (see `alloc`), and slots taken
    /// but not used. Their entries are durably zeroed.
    free: Vec<u32>,
    /// Slots this lane freed, on their way back to the pool. A superseded slot's zeroing may
    /// still wait for this lane's next fence (see [`Stripe`]); the first `freed_durable` were
    /// freed before the last fence, so their zeroed entries are durable.
    freed: Vec<u32>,
    freed_durable: usize,
    /// This lane's range of sequence numbers for write-back entries: `seq_next..seq_end`.
    seq_next: u64,
    seq_end: u64,
    /// One block: a read miss's data on its way to the caller and its slot, a partial write's
    /// merge, a write-through's admitted copy. It may hold such a block while index room is
    /// made, so `write_back` never uses it.
    block: Vec<u8>,
    /// One block: what `write_back` copies from a dirty slot to the backing store.
    write_back_block: Vec<u8>,
    /// One block, in a cache with data checksums (empty otherwise): where a read of part of a
    /// block copies the whole block to check it (`checked.rs`).
    checked_block: Vec<u8>,
    scratch_slots: Vec<u32>,
    /// Dirty slots whose write-back the backing store refused, seen by a reclaim's hand
    /// (tried only when it saw no other dirty slot).
    scratch_refused: Vec<u32>,
    written: Vec<(u32, SlotWord, SlotEntry)>,
    /// Superseded slots whose entries are not zeroed yet: zeroed once their stripes are
    /// released, or by this lane's next fence, whichever comes first (see [`Stripe`]);
    /// dropping the lane fences if any are left.
    frees_unzeroed: Vec<u32>,
    /// A batch's group of writes, the writes a commit round defers to the next one, and the
    /// requests that run alone (`batch.rs`): sized at start, reused by every batch.
    group: Vec<batch::GroupWrite>,
    group_next: Vec<batch::GroupWrite>,
    group_alone: Vec<usize>,
    /// Entries zeroed once their stripes were released (`zero_superseded_entries`), not yet
    /// fenced: the next fence waits for them.
    frees_unfenced: bool,
    /// Each lane's fence count as this lane last read it (see `unfenced_free`).
    fences_seen: Box<[u64]>,
    /// The queue this lane's batched read misses go through (`misses.rs`).
    miss_queue: misses::MissQueue,
    /// The read misses in flight on `miss_queue`, by ticket.
    misses: misses::MissesInFlight,
    /// `read_batch`'s starts, reused by every call (empty between calls).
    read_starts: Vec<ReadStart>,
    /// `write_batch`'s starts and `write_batch_start`'s outcomes, reused likewise.
    write_starts: Vec<WriteStart>,
    write_outcomes: Vec<Result<()>>,
    /// The mode its write request in progress pinned, and how many nested requests share the
    /// pin (`cache/mode.rs`).
    mode_pinned: Option<CacheMode>,
    mode_pins: u32,
    /// The node this lane's thread ran on at its last refill (or node check): its reads and
    /// writes of the members on that node count as local.
    node: Option<u32>,
    /// Free runs taken so far (interleaved placement starts each at the next member).
    refills: usize,
    /// Read hits counted since the lane last asked which node it runs on.
    reads_since_node_check: u32,
}

impl<M: Medium, B: BackingStore, C: Clock> Drop for Lane<'_, M, B, C> {
    fn drop(&mut self) {
        let engine = self.engine;
        self.drain_misses();
        // Zeroed entries this lane left pending become durable on this thread before another
        // thread can drive the lane (and count its fences).
        if self.zeroings_pending() {
            self.fence();
        }
        engine.pools.put(self.free.drain(..).chain(self.freed.drain(..)));
        assert_eq!(self.mode_pins, 0, "a lane dropped inside a write request");
        self.shared.in_use.store(false, Ordering::Release);
    }
}

/// The block holding byte `offset`, for `block`-byte blocks. Block sizes are powers of two
/// (`Geometry::for_medium` refuses others): a shift, not a division, on every request.
#[inline]
pub(crate) fn block_of(offset: u64, block: u64) -> u64 {
    offset >> block.trailing_zeros()
}

/// Where byte `offset` lies in its `block`-byte block (a power of two, as in [`block_of`]).
#[inline]
pub(crate) fn offset_in_block(offset: u64, block: u64) -> u64 {
    offset & (block - 1)
}

/// Splits a byte range into per-block pieces: (block number, offset in block, length).
fn pieces(offset: u64, len: u64, block: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let lba = block_of(at, block);
        let in_block = offset_in_block(at, block);
        let n = (block - in_block).min(end - at);
        at += n;
        Some((lba, in_block as usize, n as usize))
    })
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// The engine this lane belongs to.
    pub fn engine(&self) -> &'e Engine<M, B, C> {
        self.engine
    }

    fn counters(&self) -> &'e LaneCounters {
        &self.shared.counters
    }

    fn block_bytes(&self) -> u64 {
        u64::from(self.engine.layout.block_size)
    }
}

/// A stripe lock, or the knowledge that the caller already holds it.
enum StripeGuard<'a> {
    AlreadyHeld,
    Locked(#[expect(dead_code, reason = "held for its Drop")] MutexGuard<'a, u64>),
}

/// Reads the superblock words that recovery needs.
/// The shutdown word (clean or not) and the synced sequence number, with whether the synced
/// word failed its check: corrupt (or torn), and taken as 0 (every clean entry is then newer
/// than it, made dirty and written back again: safe), never trusted.
pub(crate) fn read_shutdown_state<M: Medium>(medium: &M) -> Result<(bool, u64, bool)> {
    let shutdown = medium.load_u64(SHUTDOWN_WORD_OFFSET);
    let clean = match shutdown {
        SHUTDOWN_CLEAN => true,
        SHUTDOWN_DIRTY => false,
        other => return Err(format::FormatError::BadShutdownWord(other).into()),
    };
    match format::decode_synced_seq(medium.load_u64(SYNCED_SEQ_OFFSET)) {
        Some(synced) => Ok((clean, synced, false)),
        None => Ok((clean, 0, true)),
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Marks the medium as attached (a crash from now on is an unclean shutdown).
    pub(crate) fn mark_attached(&self) {
        self.medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_DIRTY);
        self.medium.persist(SHUTDOWN_WORD_OFFSET, 8);
    }
}
