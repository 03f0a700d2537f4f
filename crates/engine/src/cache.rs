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
use pmcache_media::Medium;
use rand::RngCore;

use crate::admission::Admission;
use crate::clock::Clock;
use crate::config::{CacheMode, Config};
use crate::error::{Error, Result};
use crate::eviction::{EvictionPolicy, Sweep};
use crate::format::{
    self, BlockState, DecodedEntry, Geometry, SHUTDOWN_CLEAN, SHUTDOWN_DIRTY, SHUTDOWN_WORD_OFFSET,
    SUPERBLOCK_BYTES, SYNCED_SEQ_OFFSET, SlotEntry, Superblock,
};
use crate::freepool::FreePool;
use crate::index::{Found, Index};
use crate::slots::{SlotState, SlotTable, SlotWord};
use crate::stats::{LaneCounters, PaddedCounters, Stats, bump};
use crate::sync::{AtomicBool, AtomicU8, AtomicU64, Mutex, MutexGuard, Ordering, fence, lock};

mod batch;
pub use batch::{READ_DATA_PREFETCH_AHEAD, ReadRequest, WriteRequest};

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
/// Slots a lane frees before it returns them to the pool. Returning is a lock and one bit per
/// slot set in the pool's bitmap; at 256 a write in 256 paid a few microseconds for it, at 16
/// or 32 nothing shows (docs/PERFORMANCE.md, session 26).
const FREED_SPILL_MAX: usize = 32;

pub(crate) struct LaneSlot {
    in_use: AtomicBool,
    counters: PaddedCounters,
    /// Fences the lane has completed. Other lanes read it to tell whether the zeroing of an
    /// entry this lane superseded is durable yet: see [`Stripe`]. It only ever grows, across
    /// every `Lane` that holds this slot in turn, and is never reset: other lanes keep their
    /// readings of it (`Lane::unfenced_free`), which stay proof of a fence only because of that.
    fences: CachePadded<AtomicU64>,
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
}

/// The cache engine, generic over its medium, backing store and clock.
pub struct Engine<M: Medium, B: BackingStore, C: Clock> {
    pub(crate) medium: M,
    pub(crate) backing: B,
    pub(crate) clock: C,
    pub(crate) superblock: Superblock,
    pub(crate) geometry: Geometry,
    pub(crate) backing_blocks: u64,
    pub(crate) slots: SlotTable,
    pub(crate) index: Index,
    /// Block locks (a block's stripe is a hash of its number), with their pending frees.
    stripes: Box<[CachePadded<Stripe>]>,
    pub(crate) pool: FreePool,
    hand: AtomicU64,
    pub(crate) next_seq: AtomicU64,
    synced_seq: Mutex<u64>,
    backing_writes: AtomicU64,
    backing_writes_synced: AtomicU64,
    /// Backing-store operations that failed (for `Stats::backing_errors`; cold path).
    backing_errors: AtomicU64,
    /// Set when an `fdatasync` of the backing store failed (see `sync_backing`).
    backing_sync_failed: AtomicBool,
    lanes: Box<[LaneSlot]>,
    /// Set by `shutdown`: no new lanes.
    closed: AtomicBool,
    /// Held while a lane is handed out and while `shutdown` checks for open lanes and marks
    /// the cache shut down, so that neither passes the other: a lane taken after the check
    /// would run on a cache already marked cleanly shut down.
    lifecycle: Mutex<()>,
    mode: AtomicU8,
    admission: Admission,
    eviction: &'static dyn EvictionPolicy,
    /// `eviction.marks_hits()`, read once: every read hit asks.
    marks_hits: bool,
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
}

/// The unit of data a write carries.
#[derive(Clone, Copy)]
enum Payload<'a> {
    Data(&'a [u8]),
    Zeroes(usize),
}

impl Payload<'_> {
    fn len(&self) -> usize {
        match self {
            Payload::Data(d) => d.len(),
            Payload::Zeroes(n) => *n,
        }
    }
    fn apply(&self, block: &mut [u8], at: usize) {
        match self {
            Payload::Data(d) => block[at..at + d.len()].copy_from_slice(d),
            Payload::Zeroes(n) => block[at..at + n].fill(0),
        }
    }
}

/// What `Lane::switch_in_dirty` did, for its caller to act on and count.
#[must_use = "a true `must_fence` asks for a fence before the stripe is released"]
#[derive(Clone, Copy)]
struct Switched {
    /// The stripe's earlier pending free was not durable: fence before releasing the stripe.
    must_fence: bool,
    /// The block had no dirty copy before (a dirty slot more).
    newly_dirty: bool,
    /// The block had a copy (a write hit).
    hit: bool,
}

/// A stripe lock, or the knowledge that the caller already holds it.
enum StripeGuard<'a> {
    AlreadyHeld,
    Locked(#[expect(dead_code, reason = "held for its Drop")] MutexGuard<'a, u64>),
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Whether [`Engine::format`] would accept a medium of `medium_bytes` for a backing store
    /// of `backing_bytes` with `config`: the same checks, before any medium exists (so a
    /// frontend can refuse before it creates one).
    pub fn check_format(medium_bytes: u64, backing_bytes: u64, config: &Config) -> Result<()> {
        let geometry = Geometry::for_medium(medium_bytes, config.block_size)?;
        check_fit(&geometry, backing_bytes, config).map(|_| ())
    }

    /// Formats `medium` as an empty cache of `backing` and returns the engine.
    pub fn format(medium: M, backing: B, clock: C, config: &Config) -> Result<Self> {
        let geometry = Geometry::for_medium(medium.len_bytes(), config.block_size)?;
        // Every refusal comes before the first write: a format that cannot serve leaves the
        // medium as it was (an old cache on it included).
        check_fit(&geometry, backing.size_bytes(), config)?;
        let identity = backing.identity();
        let mut uuid = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut uuid);
        let superblock = Superblock {
            uuid,
            geometry,
            backing: identity,
            created_unix_secs: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        // Invalidate any old superblock first, so a crash mid-format leaves no valid cache.
        medium.write(0, &[0u8; format::HEADER_BYTES]);
        medium.persist(0, format::HEADER_BYTES as u64);
        zero_range(&medium, SUPERBLOCK_BYTES, geometry.data_offset - SUPERBLOCK_BYTES);
        medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_DIRTY);
        medium.store_u64(SYNCED_SEQ_OFFSET, format::encode_synced_seq(0));
        medium.persist(SHUTDOWN_WORD_OFFSET, 16);
        medium.write(0, &superblock.encode());
        medium.persist(0, format::HEADER_BYTES as u64);
        let engine = Self::assemble(medium, backing, clock, config, superblock, 0)?;
        engine.pool.put(0..geometry.slot_count as u32);
        Ok(engine)
    }

    /// Builds an engine with empty DRAM structures around a validated superblock.
    pub(crate) fn assemble(
        medium: M,
        backing: B,
        clock: C,
        config: &Config,
        superblock: Superblock,
        synced_seq: u64,
    ) -> Result<Self> {
        let geometry = superblock.geometry;
        let eviction = config.eviction.policy();
        let backing_blocks = check_fit(&geometry, backing.size_bytes(), config)?;
        let slot_count = geometry.slot_count as u32;
        let lane_free_max = (slot_count as usize / (4 * config.max_lanes)).clamp(1, 256);
        let stripe_count = (config.max_lanes * 64).next_power_of_two().max(1024);
        Ok(Self {
            slots: SlotTable::new(slot_count)?,
            index: Index::with_buckets(slot_count, config.index_buckets)?,
            stripes: (0..stripe_count)
                .map(|_| {
                    CachePadded::new(Stripe {
                        lock: Mutex::new(0),
                        pending_free: AtomicU64::new(0),
                        pending_free_fences: AtomicU64::new(0),
                    })
                })
                .collect(),
            pool: FreePool::new(slot_count),
            hand: AtomicU64::new(0),
            next_seq: AtomicU64::new(first_seq_after(synced_seq)),
            synced_seq: Mutex::new(synced_seq),
            // One write counted before any: whatever wrote the backing store before this
            // attach (an earlier process of this cache that stopped without a clean shutdown,
            // or anything else) may have left data in its volatile cache, which the first
            // flush must sync like this engine's own writes.
            backing_writes: AtomicU64::new(1),
            backing_writes_synced: AtomicU64::new(0),
            backing_errors: AtomicU64::new(0),
            backing_sync_failed: AtomicBool::new(false),
            lanes: (0..config.max_lanes)
                .map(|_| LaneSlot {
                    in_use: AtomicBool::new(false),
                    counters: CachePadded::new(LaneCounters::default()),
                    fences: CachePadded::new(AtomicU64::new(0)),
                })
                .collect(),
            closed: AtomicBool::new(false),
            lifecycle: Mutex::new(()),
            mode: AtomicU8::new(config.mode.to_u8()),
            admission: Admission::new(config.admission),
            eviction,
            marks_hits: eviction.marks_hits(),
            recovered_dirty: 0,
            lane_free_max,
            refill_batch: (lane_free_max / 2).clamp(1, 64),
            freed_spill: lane_free_max.min(FREED_SPILL_MAX),
            group_max: (slot_count as usize / (2 * config.max_lanes)).clamp(1, batch::GROUP_MAX),
            medium,
            backing,
            clock,
            superblock,
            geometry,
            backing_blocks,
        })
    }

    /// A handle for one thread or queue. At most `Config::max_lanes` exist at once.
    pub fn lane(&self) -> Result<Lane<'_, M, B, C>> {
        let lifecycle = lock(&self.lifecycle);
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::ShutDown);
        }
        let id = self
            .lanes
            .iter()
            .position(|l| {
                l.in_use.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            })
            .ok_or(Error::TooManyLanes { max_lanes: self.lanes.len() })?;
        drop(lifecycle);
        let lane_list_max = (self.lane_free_max * 2).max(self.freed_spill + 2 * batch::GROUP_MAX);
        Ok(Lane {
            engine: self,
            id,
            shared: &self.lanes[id],
            // Both hold the other's slots at times (`alloc` moves `freed` into `free`).
            free: Vec::with_capacity(lane_list_max),
            freed: Vec::with_capacity(lane_list_max),
            freed_durable: 0,
            seq_next: 0,
            seq_end: 0,
            block: vec![0u8; self.geometry.block_size as usize],
            write_back_block: vec![0u8; self.geometry.block_size as usize],
            scratch_slots: Vec::with_capacity(DRAIN_BATCH),
            scratch_refused: Vec::with_capacity(2 * WRITE_BACK_FAILURES_MAX),
            written: Vec::with_capacity(DRAIN_BATCH),
            frees_unzeroed: Vec::with_capacity(2 * batch::GROUP_MAX),
            group: Vec::with_capacity(self.group_max),
            group_next: Vec::with_capacity(self.group_max),
            group_alone: Vec::with_capacity(self.group_max),
            frees_unfenced: false,
            fences_seen: vec![0; self.lanes.len()].into_boxed_slice(),
        })
    }

    /// The cache mode in force.
    pub fn mode(&self) -> CacheMode {
        CacheMode::from_u8(self.mode.load(Ordering::Relaxed))
    }

    /// Changes the cache mode. Dirty blocks stay dirty until written back.
    pub fn set_mode(&self, mode: CacheMode) {
        self.mode.store(mode.to_u8(), Ordering::Relaxed);
    }

    /// Size of the exported device in bytes (the backing store's size).
    pub fn size_bytes(&self) -> u64 {
        self.backing_blocks * u64::from(self.geometry.block_size)
    }

    /// Cache block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.geometry.block_size
    }

    /// The superblock in use.
    pub fn superblock(&self) -> &Superblock {
        &self.superblock
    }

    /// The medium (for tests and tools).
    pub fn medium(&self) -> &M {
        &self.medium
    }

    /// The backing store.
    pub fn backing(&self) -> &B {
        &self.backing
    }

    /// Summed statistics.
    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        for lane in self.lanes.iter() {
            lane.counters.add_to(&mut stats);
        }
        // The lanes' counters are read one after another, not at one instant: a block made
        // dirty by one lane and cleaned by another between the two reads counts only as
        // cleaned, so the sum can dip below zero (as a signed number) for a moment.
        let dirty = self.recovered_dirty.wrapping_add(stats.dirty_delta) as i64;
        stats.dirty_slots = dirty.max(0) as u64;
        stats.slot_count = self.geometry.slot_count;
        stats.block_size = self.geometry.block_size;
        stats.dram_bytes_per_slot = self.dram_bytes() as f64 / self.geometry.slot_count as f64;
        stats.backing_errors = self.backing_errors.load(Ordering::Relaxed);
        stats
    }

    /// Checks that the engine's DRAM structures agree with the medium and with each other,
    /// for tests and diagnostics; every lane must be dropped (nothing in flight). Each slot
    /// that holds a block has a valid metadata entry in the same state, and the block's index
    /// entry points at it, visible; the index holds no other entry; each free slot is in the
    /// shared pool and the pool holds nothing else. Returns the number of cached blocks, or
    /// what disagrees.
    pub fn audit(&self) -> std::result::Result<u64, String> {
        let open = self.lanes.iter().filter(|l| l.in_use.load(Ordering::Acquire)).count();
        if open > 0 {
            return Err(format!("{open} lanes are open"));
        }
        let (mut cached, mut free) = (0, 0);
        for slot in 0..self.slots.len() {
            let state = self.slots.load(slot).state();
            let expected = match state {
                SlotState::Free => {
                    free += 1;
                    if !self.pool.holds(slot) {
                        return Err(format!("free slot {slot} is not in the pool"));
                    }
                    continue;
                }
                SlotState::Clean => BlockState::Clean,
                SlotState::Dirty => BlockState::Dirty,
            };
            let entry = match self.read_entry(slot) {
                DecodedEntry::Valid(entry) if entry.state == expected => entry,
                other => return Err(format!("{state:?} slot {slot} has the entry {other:?}")),
            };
            match self.index.lookup(entry.lba) {
                Some(found) if found.slot == slot && !found.hidden => cached += 1,
                other => {
                    return Err(format!(
                        "slot {slot} holds block {}, indexed as {other:?}",
                        entry.lba
                    ));
                }
            }
        }
        let indexed = self.index.occupied() as u64;
        if indexed != cached {
            return Err(format!("the index holds {indexed} entries for {cached} cached blocks"));
        }
        let pooled = self.pool.len();
        if pooled != free {
            return Err(format!("the pool holds {pooled} slots for {free} free ones"));
        }
        Ok(cached)
    }

    /// DRAM the engine's structures use, in bytes.
    pub fn dram_bytes(&self) -> usize {
        self.slots.len() as usize * 4
            + self.index.bytes()
            + self.pool.bytes()
            + self.stripes.len() * std::mem::size_of::<CachePadded<Stripe>>()
            + self.lanes.len() * std::mem::size_of::<LaneSlot>()
    }

    /// Marks the cache cleanly shut down (after syncing the backing store). Every lane must
    /// have been dropped; afterwards the engine hands out no lanes (a second call does
    /// nothing). Refused with lanes open, or failed by the backing store's sync, it changes
    /// nothing: the cache keeps serving, and is not marked clean.
    pub fn shutdown(&self) -> Result<()> {
        let _lifecycle = lock(&self.lifecycle);
        if self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        let open = self.lanes.iter().filter(|l| l.in_use.load(Ordering::Acquire)).count();
        if open > 0 {
            return Err(Error::LanesOpen { open });
        }
        self.sync_backing()?;
        let last = self.last_issued_seq();
        let mut synced = lock(&self.synced_seq);
        self.medium.store_u64(SYNCED_SEQ_OFFSET, format::encode_synced_seq(last.max(*synced)));
        *synced = last.max(*synced);
        self.medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_CLEAN);
        self.medium.persist(SHUTDOWN_WORD_OFFSET, 16);
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn stripe_index(&self, lba: u64) -> usize {
        (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & (self.stripes.len() - 1)
    }

    /// Starts loading `lba`'s stripe lock into the CPU cache (a hint).
    fn prefetch_stripe(&self, stripe: usize) {
        pmcache_media::prefetch(&*self.stripes[stripe] as *const Stripe);
    }

    /// Starts loading the lines a write touches for `slot`, the new copy's or the one it
    /// replaces: its DRAM word, and its entry's line only where the entry store (the new
    /// entry, or the replaced one's zeroes) needs it — not where entries are stored
    /// non-temporally, which would then have to evict it.
    fn prefetch_slot_for_entry_store(&self, slot: u32) {
        self.slots.prefetch(slot);
        self.medium.prefetch_pair_store(self.geometry.entry_offset(slot));
    }

    fn lock_stripe(&self, lba: u64) -> MutexGuard<'_, u64> {
        self.lock_stripe_index(self.stripe_index(lba))
    }

    /// Locks the stripe at `stripe` (a request that knows its stripe index already).
    fn lock_stripe_index(&self, stripe: usize) -> MutexGuard<'_, u64> {
        lock(&self.stripes[stripe].lock)
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
    fn settle_pending_free(&self, stripe: usize, slot: u32) {
        let at = self.geometry.entry_offset(slot);
        let word0 = self.medium.load_u64(at);
        if word0 != 0 && self.stripe_index(format::word0_lba(word0)) == stripe {
            self.medium.compare_exchange_u64(at, word0, 0);
        }
        self.medium.flush(at, 16);
    }

    /// Stores zeroes over a superseded slot's entry and starts their write-back (with a
    /// medium's entry store: non-temporal where it stores entries so), durable at the
    /// caller's next fence.
    fn zero_superseded_entry(&self, slot: u32) {
        self.medium.store_pair_flush(self.geometry.entry_offset(slot), 0, 0);
    }

    /// Locks `lba`'s stripe without waiting, unless it is the stripe `held` by the caller.
    fn try_lock_stripe(&self, lba: u64, held: Option<usize>) -> Option<StripeGuard<'_>> {
        let stripe = self.stripe_index(lba);
        if held == Some(stripe) {
            return Some(StripeGuard::AlreadyHeld);
        }
        self.stripes[stripe].lock.try_lock().ok().map(StripeGuard::Locked)
    }

    /// The stripe lock of `lba` for a write-back: waited for when the caller holds no stripe,
    /// only tried when it holds `held` (so two write-backs never wait on each other).
    fn lock_stripe_for_write_back(&self, lba: u64, held: Option<usize>) -> Option<StripeGuard<'_>> {
        match held {
            None => Some(StripeGuard::Locked(self.lock_stripe(lba))),
            Some(_) => self.try_lock_stripe(lba, held),
        }
    }

    /// Issues a sequence number from the global counter, for an entry whose backing I/O has
    /// completed (clean entries: the synced rule needs the global order), above every number
    /// issued to the stripe (`stripe_last`, held under the stripe lock).
    fn global_seq(&self, stripe_last: &mut u64) -> u64 {
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

    fn last_issued_seq(&self) -> u64 {
        self.next_seq.load(Ordering::SeqCst) - 1
    }

    pub(crate) fn read_entry(&self, slot: u32) -> DecodedEntry {
        let at = self.geometry.entry_offset(slot);
        SlotEntry::decode(self.medium.load_u64(at), self.medium.load_u64(at + 8))
    }

    /// Stores a cleared (free) entry and starts its write-back; durable after a fence.
    pub(crate) fn clear_entry(&self, slot: u32) {
        let at = self.geometry.entry_offset(slot);
        self.medium.store_u64(at, 0);
        self.medium.store_u64(at + 8, 0);
        self.medium.flush(at, 16);
    }

    /// Counts a failed backing-store operation and makes its error the engine's.
    fn backing_failed(&self, error: BackingError) -> Error {
        self.backing_errors.fetch_add(1, Ordering::Relaxed);
        error.into()
    }

    fn backing_read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.backing.read_at(buf, offset).map_err(|e| self.backing_failed(e))
    }

    /// Writes the backing store. Every write counts as one a later flush must sync, a failed
    /// one too: it may have changed part of its range (a short write, then an error) before
    /// a read admits that range as a clean block.
    fn backing_write(&self, data: &[u8], offset: u64) -> Result<()> {
        let result = self.backing.write_at(data, offset);
        self.backing_writes.fetch_add(1, Ordering::SeqCst);
        result.map_err(|e| self.backing_failed(e))
    }

    fn backing_write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let result = self.backing.write_zeroes(offset, len);
        self.backing_writes.fetch_add(1, Ordering::SeqCst);
        result.map_err(|e| self.backing_failed(e))
    }

    /// `fdatasync`s the backing store, noting which writes it covered.
    ///
    /// After one fails, every later one fails too, until the engine is attached again: Linux
    /// reports a write-back error to one `fdatasync` and then drops the pages, so a later
    /// success would not mean that the writes before it are on the store, and the synced rule
    /// would trust clean blocks the store lost. Attaching again re-dirties every clean block
    /// newer than the last good sync (`synced_seq`), which is written back once more.
    fn sync_backing(&self) -> Result<()> {
        if self.backing_sync_failed.load(Ordering::SeqCst) {
            self.backing_errors.fetch_add(1, Ordering::Relaxed);
            return Err(Error::BackingSyncFailedBefore);
        }
        let writes = self.backing_writes.load(Ordering::SeqCst);
        if let Err(e) = self.backing.flush() {
            self.backing_sync_failed.store(true, Ordering::SeqCst);
            return Err(self.backing_failed(e));
        }
        self.backing_writes_synced.fetch_max(writes, Ordering::SeqCst);
        Ok(())
    }

    fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        let size_bytes = self.size_bytes();
        match offset.checked_add(len) {
            Some(end) if end <= size_bytes => Ok(()),
            _ => Err(Error::OutOfRange { op, offset, len, size_bytes }),
        }
    }
}

/// Writes zeroes over a medium range and persists them.
/// Checks that a cache of `geometry` can serve a backing store of `backing_bytes` with
/// `config`; returns the backing store's block count.
fn check_fit(geometry: &Geometry, backing_bytes: u64, config: &Config) -> Result<u64> {
    let block = u64::from(geometry.block_size);
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
    if geometry.slot_count < 4 * config.max_lanes as u64 {
        return Err(Error::Config(format!(
            "a cache of {} slots is too small for {} lanes (need 4 slots per lane: a larger \
             medium, or fewer lanes)",
            geometry.slot_count, config.max_lanes
        )));
    }
    Ok(backing_blocks)
}

/// What a write-back did: the blocks it cleaned, and the first error. A block the backing
/// store refused is skipped and stays dirty while the others are written; a failed sync
/// cleans none.
struct WrittenBack {
    cleaned: usize,
    /// Blocks whose backing write failed (each now marked refused, see `SlotWord`).
    refused: usize,
    /// The sync after the writes failed (or an earlier one had): nothing is cleaned until
    /// the cache is attached again.
    sync_failed: bool,
    error: Option<Error>,
}

impl WrittenBack {
    /// The blocks cleaned, or the error when none was.
    fn into_result(self) -> Result<usize> {
        match self.error {
            Some(e) if self.cleaned == 0 => Err(e),
            _ => Ok(self.cleaned),
        }
    }
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
}

impl<M: Medium, B: BackingStore, C: Clock> Drop for Lane<'_, M, B, C> {
    fn drop(&mut self) {
        let engine = self.engine;
        // Zeroed entries this lane left pending become durable on this thread before another
        // thread can drive the lane (and count its fences).
        if self.zeroings_pending() {
            self.fence();
        }
        engine.pool.put(self.free.drain(..).chain(self.freed.drain(..)));
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
        u64::from(self.engine.geometry.block_size)
    }

    // ----- persistence helpers (every fence this lane issues goes through here) -----

    fn fence(&mut self) {
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
    /// the stripe's unlock, a locked instruction, wait for it (docs/PERFORMANCE.md, session
    /// 28). They complete while the lane does other work; the lane's next fence makes them
    /// durable, and until then a lane that needs one durable settles it itself (`Stripe`).
    fn zero_superseded_entries(&mut self) {
        for slot in self.frees_unzeroed.drain(..) {
            self.engine.zero_superseded_entry(slot);
            self.frees_unfenced = true;
        }
    }

    /// Whether entries of slots this lane superseded may not be durably zero yet (not zeroed,
    /// or zeroed and not fenced since): its next fence makes them so.
    fn zeroings_pending(&self) -> bool {
        !self.frees_unzeroed.is_empty() || self.frees_unfenced
    }

    /// The slot of `stripe`'s pending free if its zeroed entry may not be durable yet: the
    /// lane that zeroed it has not fenced since. The caller holds the stripe.
    ///
    /// The zeroing lane's fence count is read only when this lane's last reading of it does
    /// not already show a fence since: a count only grows, and the counter's line, which its
    /// lane writes at every fence, would otherwise move between cores on most writes.
    fn unfenced_free(&mut self, stripe: usize) -> Option<u32> {
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

    fn write_data(&mut self, slot: u32, data: &[u8]) {
        let at = self.engine.geometry.data_offset(slot);
        self.engine.medium.write_flush(at, data);
        self.fence();
    }

    fn persist_entry(&mut self, slot: u32, entry: SlotEntry) {
        self.store_entry(slot, entry);
        self.fence();
    }

    /// Stores a slot's entry and starts its write-back (a medium may store it non-temporally);
    /// durable after a fence. The slot's entry is durably free before, so a power cut that
    /// keeps one word without the other leaves a pair that reads as free or as torn, whichever
    /// word it kept (docs/FORMAT.md, torn updates).
    fn store_entry(&self, slot: u32, entry: SlotEntry) {
        let at = self.engine.geometry.entry_offset(slot);
        let (word0, word1) = entry.encode();
        self.engine.medium.store_pair_flush(at, word0, word1);
    }

    /// Rewrites word 0 of a live entry (state change); flushed, durable after a fence.
    fn rewrite_entry_state(&self, slot: u32, entry: SlotEntry) {
        let at = self.engine.geometry.entry_offset(slot);
        self.engine.medium.store_u64(at, entry.encode().0);
        self.engine.medium.flush(at, 8);
    }

    fn advance_synced_seq(&mut self, sample: u64) {
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
    /// to the stripe. Write-back entries are dirty: the synced rule does not look at them.
    fn local_seq(&mut self, stripe_last: &mut u64) -> u64 {
        const RANGE: u64 = 1024;
        if self.seq_next >= self.seq_end {
            self.seq_next = self.engine.next_seq.fetch_add(RANGE, Ordering::SeqCst);
            self.seq_end = self.seq_next + RANGE;
        }
        let seq = first_seq_after(self.seq_next.max(*stripe_last + 1) - 1);
        self.seq_next = seq + 1;
        *stripe_last = seq;
        seq
    }

    // ----- slot allocation -----

    /// A free slot, evicting or writing back if needed. Never called with a stripe lock held.
    ///
    /// Slots come from the pool in address order, a run of `refill_batch` at a time from a
    /// cursor that sweeps the whole cache, and a freed slot goes back to the pool rather than
    /// to the next write: so a lane's consecutive writes land close together on the medium,
    /// their entries mostly on one page of the metadata table, as in a log. Reusing the slot
    /// the previous write freed (a random one) was 10–25 % slower per write
    /// (docs/PERFORMANCE.md, session 26). Only when the pool is empty (a full cache) does a
    /// lane reuse the slots it freed itself, before it reclaims.
    fn alloc(&mut self) -> Result<u32> {
        loop {
            if let Some(slot) = self.free.pop() {
                return Ok(slot);
            }
            if self.freed_durable > 0 {
                self.return_durable_freed();
            }
            if self.engine.pool.take(self.engine.refill_batch, &mut self.free) > 0 {
                continue;
            }
            if !self.freed.is_empty() {
                // The pool is empty (a full cache): this lane reuses the slots it freed itself,
                // rather than hand them to the pool where another lane's allocation could take
                // them first and leave this one to reclaim.
                self.settle_freed();
                self.free.extend(self.freed.drain(..).rev());
                self.freed_durable = 0;
                continue;
            }
            self.reclaim()?;
        }
    }

    /// A slot for a block a read miss or a write-through will cache, if `admit`. Caching is
    /// optional there: when no slot can be had (every slot dirty, and the backing store
    /// failing the write-back that would free one) the request is served from or written to
    /// the backing store without caching the block, rather than failed.
    fn reserve_for_admission(&mut self, admit: bool) -> Option<u32> {
        if admit { self.alloc().ok() } else { None }
    }

    /// Returns a slot this lane took but did not use (nothing was written to its entry).
    fn give_back(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// Frees the slot of block `lba`'s newest copy, which is being dropped (no newer entry
    /// replaces it): new generation in DRAM, entry zeroed and made durable before the stripe
    /// lock (held by the caller) is released — *after* the stripe's pending free (see
    /// [`Stripe`]) is durable, so that no older entry of the block can outlive this one and
    /// come back. Two write-backs under one fence are not ordered: a power cut inside it
    /// could keep this zeroing and lose the older one's.
    fn free_slot(&mut self, lba: u64, slot: u32) {
        let engine = self.engine;
        let stripe = engine.stripe_index(lba);
        if let Some(pending) = self.unfenced_free(stripe) {
            engine.settle_pending_free(stripe, pending);
            self.fence();
        }
        engine.slots.free(slot);
        engine.clear_entry(slot);
        self.fence();
        engine.stripes[stripe].pending_free.store(0, Ordering::Relaxed);
        self.keep_free(slot);
    }

    /// Frees a slot whose block `lba` now has a newer, durable entry elsewhere: new generation
    /// in DRAM — it becomes the stripe's pending free (see [`Stripe`]). Its entry is zeroed
    /// once the stripe is released (`zero_superseded_entries`) and made durable by this
    /// lane's next fence, not now: a store or write-back still in flight would make the
    /// stripe's unlock (a locked instruction) wait for it, which costs as much as the fence
    /// saved. Returns true if the caller must fence before releasing the stripe: when the
    /// stripe already had a pending free that is not yet durable, this lane settles it
    /// (`settle_pending_free`) and its fence makes it durable. Also returns the state the slot
    /// had (clean or dirty).
    #[must_use = "a true result asks for a fence before the stripe is released"]
    #[inline(always)]
    fn free_superseded(&mut self, stripe: usize, slot: u32) -> (bool, SlotState) {
        let engine = self.engine;
        let earlier = self.unfenced_free(stripe);
        if let Some(pending) = earlier {
            engine.settle_pending_free(stripe, pending);
        }
        if self.frees_unzeroed.len() == self.frees_unzeroed.capacity() {
            // Bounded (a group frees at most `GROUP_MAX` between fences): past it, fence now.
            self.fence();
        }
        let state = engine.slots.free(slot);
        self.frees_unzeroed.push(slot);
        let record = &engine.stripes[stripe];
        record.pending_free.store((self.id as u64 + 1) << 32 | u64::from(slot), Ordering::Relaxed);
        let fences = self.shared.fences.load(Ordering::Relaxed);
        record.pending_free_fences.store(fences, Ordering::Relaxed);
        (earlier.is_some(), state)
    }

    /// Adds a freed slot to the ones on their way back to the pool. Those freed before the
    /// last fence go back once there are `freed_spill` of them; a full list goes back after a
    /// fence of its own (not reached: every write fences before it frees, and a group frees at
    /// most `GROUP_MAX` between fences).
    ///
    /// Only slots with durably zeroed entries reach the pool, so no slot's new entry is ever
    /// written over an old one that is still durable: a power cut could otherwise keep the old
    /// entry's word 0 beside the new entry's word 1, caught only by the entry's check, by
    /// chance.
    fn keep_free(&mut self, slot: u32) {
        if self.freed.len() == self.freed.capacity() {
            self.return_freed();
        }
        self.freed.push(slot);
        if self.freed_durable >= self.engine.freed_spill {
            self.return_durable_freed();
        }
    }

    /// Returns the slots freed before this lane's last fence to the pool.
    fn return_durable_freed(&mut self) {
        self.engine.pool.put(self.freed.drain(..self.freed_durable));
        self.freed_durable = 0;
    }

    /// Returns every slot this lane freed to the pool.
    fn return_freed(&mut self) {
        self.settle_freed();
        self.return_durable_freed();
    }

    /// Makes every slot this lane freed durably free: a fence if a zeroing is pending (which
    /// counts them all), else they already are.
    fn settle_freed(&mut self) {
        if self.zeroings_pending() {
            self.fence();
        }
        self.freed_durable = self.freed.len();
    }

    /// Evicts clean blocks under the CLOCK (or FIFO) hand; when it finds none, writes back the
    /// oldest dirty blocks it passed and evicts those. Never fails for want of space.
    fn reclaim(&mut self) -> Result<()> {
        let engine = self.engine;
        let slot_count = u64::from(engine.slots.len());
        let budget = (2 * slot_count).clamp(HAND_CHUNK, 8192);
        let want = engine.refill_batch;
        let mut evicted = 0;
        let mut scanned = 0;
        self.scratch_slots.clear();
        self.scratch_refused.clear();
        while scanned < budget && evicted < want {
            let start = engine.hand.fetch_add(HAND_CHUNK, Ordering::Relaxed);
            for i in 0..HAND_CHUNK {
                let slot = ((start + i) % slot_count) as u32;
                let word = engine.slots.load(slot);
                match word.state() {
                    SlotState::Clean => match engine.eviction.sweep(self.referenced(slot)) {
                        Sweep::SecondChance => {}
                        Sweep::Evict => {
                            if evicted < want && self.try_evict(slot, word, None) {
                                evicted += 1;
                            }
                        }
                    },
                    // Refused write-backs apart: a run of them (a bad range of the backing
                    // store, filled in address order) must not fill the candidates.
                    SlotState::Dirty if word.write_back_refused() => {
                        if self.scratch_refused.len() < self.scratch_refused.capacity() {
                            self.scratch_refused.push(slot);
                        }
                    }
                    SlotState::Dirty => {
                        if self.scratch_slots.len() < self.scratch_slots.capacity() {
                            self.scratch_slots.push(slot);
                        }
                    }
                    SlotState::Free => {}
                }
            }
            scanned += HAND_CHUNK;
        }
        if evicted > 0 {
            return Ok(());
        }
        if self.scratch_slots.is_empty() {
            // Only blocks the backing store refused before: try those again (it may take
            // them now). Otherwise they stay out: every reclaim would try the same refused
            // blocks first (a bad range of the device, or a path that fails some requests)
            // while other dirty blocks could make room.
            self.scratch_slots.extend_from_slice(&self.scratch_refused);
        }
        if self.scratch_slots.is_empty() {
            // Every slot is free in another lane's list or being filled: let them progress.
            crate::sync::yield_now();
            return Ok(());
        }
        let mut dirty = std::mem::take(&mut self.scratch_slots);
        // The hand may pass a slot twice in one reclaim (its budget is up to twice the cache):
        // each dirty slot once, or a refused one would be tried twice in a batch.
        dirty.sort_unstable();
        dirty.dedup();
        // Oldest first. Sequence numbers are read once: other lanes rewrite entries meanwhile,
        // and a sort whose keys change under it has no consistent order.
        let mut by_age: Vec<(u64, u32)> = dirty
            .iter()
            .map(|&slot| match engine.read_entry(slot) {
                DecodedEntry::Valid(entry) => (entry.seq, slot),
                _ => (u64::MAX, slot),
            })
            .collect();
        by_age.sort_unstable();
        // The oldest `want` first; if none of them could be written back (the backing store
        // refusing those blocks), the next oldest, and so on: blocks the backing store takes
        // make room while the ones it refuses stay dirty. A reclaim stops once
        // `WRITE_BACK_FAILURES_MAX` refusals have passed (a dead device's timeouts would add up
        // on every write; a batch that cleans nothing stops at that many in a row, so at most
        // twice that), or at a failed sync (nothing can be cleaned until the cache is attached
        // again). Only when nothing at all is written back is the first error the result.
        let mut first_error = None;
        let mut refused = 0;
        for chunk in by_age.chunks(want.max(1)) {
            dirty.clear();
            dirty.extend(chunk.iter().map(|&(_, slot)| slot));
            let written = self.write_back(&dirty, None);
            for &slot in &dirty {
                let word = engine.slots.load(slot);
                if word.state() == SlotState::Clean {
                    self.try_evict(slot, word, None);
                }
            }
            refused += written.refused;
            match written {
                WrittenBack { cleaned: 0, error: Some(e), refused: chunk_refused, sync_failed } => {
                    first_error.get_or_insert(e);
                    if sync_failed || chunk_refused == 0 || refused >= WRITE_BACK_FAILURES_MAX {
                        break;
                    }
                }
                _ => {
                    first_error = None;
                    break;
                }
            }
        }
        self.scratch_slots = dirty;
        first_error.map_or(Ok(()), Err)
    }

    /// CLOCK's second chance, for the hand passing a clean `slot`: whether its block's index
    /// entry has the reference bit set — in which case the bit is cleared. Lock-free; the
    /// entry is found through the slot's metadata entry, and a slot that changes meanwhile
    /// reads as unreferenced (`try_evict` checks it again under its stripe).
    fn referenced(&self, slot: u32) -> bool {
        let engine = self.engine;
        if !engine.marks_hits {
            return false;
        }
        let DecodedEntry::Valid(entry) = engine.read_entry(slot) else {
            return false;
        };
        match engine.index.lookup(entry.lba) {
            Some(found) if found.slot == slot && found.referenced => {
                engine.index.clear_reference(&found);
                true
            }
            _ => false,
        }
    }

    /// Evicts a clean slot if its stripe can be taken without waiting and it is unchanged.
    fn try_evict(&mut self, slot: u32, seen: SlotWord, held: Option<usize>) -> bool {
        let engine = self.engine;
        let DecodedEntry::Valid(entry) = engine.read_entry(slot) else {
            return false;
        };
        let Some(_guard) = engine.try_lock_stripe(entry.lba, held) else {
            return false;
        };
        let now = engine.slots.load(slot);
        if !(now.same_incarnation(seen) && now.state() == SlotState::Clean) {
            return false;
        }
        let found = engine.index.lookup(entry.lba);
        assert_eq!(found.map(|f| f.slot), Some(slot), "clean slot {slot} not indexed");
        engine.index.remove(&found.expect("checked"));
        self.free_slot(entry.lba, slot);
        bump(&self.counters().evictions, 1);
        true
    }

    /// Writes dirty slots back to the backing store, syncs it, and marks them clean.
    /// `held` is a stripe the caller holds (other stripes are then only tried, never waited on).
    fn write_back(&mut self, victims: &[u32], held: Option<usize>) -> WrittenBack {
        let engine = self.engine;
        let block = self.block_bytes();
        let mut error = None;
        let mut failures_in_a_row = 0;
        let mut refused = 0;
        self.written.clear();
        for &slot in victims {
            if failures_in_a_row == WRITE_BACK_FAILURES_MAX {
                // A dead device: the rest stay dirty, and nobody waits out its timeouts for
                // every one of them.
                break;
            }
            let seen = engine.slots.load(slot);
            if seen.state() != SlotState::Dirty {
                continue;
            }
            let DecodedEntry::Valid(entry) = engine.read_entry(slot) else {
                continue;
            };
            let Some(guard) = engine.lock_stripe_for_write_back(entry.lba, held) else {
                continue;
            };
            let now = engine.slots.load(slot);
            if !(now.same_incarnation(seen) && now.state() == SlotState::Dirty) {
                continue;
            }
            engine.medium.read(engine.geometry.data_offset(slot), &mut self.write_back_block);
            if let Err(e) = engine.backing_write(&self.write_back_block, entry.lba * block) {
                // This block stays dirty (its copy here is the one that counts); the others
                // are still written back, so one bad block of the backing store does not stop
                // the cache from freeing space or draining the rest. Reclaim tries it again
                // only after the dirty blocks not refused yet.
                engine.slots.mark_write_back_refused(slot, now);
                error.get_or_insert(e);
                failures_in_a_row += 1;
                refused += 1;
                continue;
            }
            failures_in_a_row = 0;
            drop(guard);
            self.written.push((slot, now, entry));
        }
        if self.written.is_empty() {
            return WrittenBack { cleaned: 0, refused, sync_failed: false, error };
        }
        let sample = engine.last_issued_seq();
        if let Err(e) = engine.sync_backing() {
            return WrittenBack { cleaned: 0, refused, sync_failed: true, error: Some(e) };
        }
        let written = std::mem::take(&mut self.written);
        let mut cleaned = 0;
        for &(slot, seen, entry) in &written {
            let Some(_guard) = engine.lock_stripe_for_write_back(entry.lba, held) else {
                continue;
            };
            let now = engine.slots.load(slot);
            if now.same_incarnation(seen) && now.state() == SlotState::Dirty {
                self.rewrite_entry_state(slot, SlotEntry { state: BlockState::Clean, ..entry });
                engine.slots.set_clean(slot);
                cleaned += 1;
            }
        }
        self.written = written;
        self.fence();
        self.advance_synced_seq(sample);
        let counters = self.counters();
        bump(&counters.writebacks, cleaned);
        bump(&counters.dirty_delta, cleaned.wrapping_neg());
        WrittenBack { cleaned: cleaned as usize, refused, sync_failed: false, error }
    }

    /// Inserts `lba -> slot` into the index, hidden (see `Index::insert`), evicting (or
    /// writing back) a block of the same index buckets when they are full; returns the entry
    /// to reveal with `Index::replace`. The caller holds `lba`'s stripe.
    fn index_insert(&mut self, lba: u64, slot: u32) -> Result<Found> {
        let engine = self.engine;
        let held = Some(engine.stripe_index(lba));
        loop {
            let full = match engine.index.insert(lba, slot) {
                Ok(inserted) => return Ok(inserted),
                Err(full) => full,
            };
            bump(&self.counters().index_conflicts, 1);
            let clean = full.occupants.iter().copied().find(|&s| {
                let word = engine.slots.load(s);
                word.state() == SlotState::Clean && self.try_evict(s, word, held)
            });
            if clean.is_some() {
                continue;
            }
            // No clean occupant could be evicted: write a dirty one back (evicted next round).
            // One whose stripe another lane holds is skipped for the next: this lane holds
            // its own stripe, and two lanes making room in each other's stripes must not wait
            // on each other.
            let mut written = false;
            let mut error = None;
            for &occupant in &full.occupants {
                if engine.slots.load(occupant).state() != SlotState::Dirty {
                    continue;
                }
                // One the backing store refuses stays; the next occupant may go instead.
                match self.write_back(&[occupant], held).into_result() {
                    Ok(0) => {}
                    Ok(_) => {
                        written = true;
                        break;
                    }
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
            if !written {
                if let Some(e) = error {
                    return Err(e);
                }
                crate::sync::yield_now();
            }
        }
    }

    // ----- reads -----

    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let engine = self.engine;
        engine.check_range("read", offset, buf.len() as u64)?;
        // Sequential streams are tracked from the first miss on: hits need no admission
        // decision, and tracking every hit would put shared stores on the hit path.
        let mut sequential_tail = None;
        let request_len = buf.len() as u64;
        let mut done = 0;
        for (lba, in_block, len) in pieces(offset, buf.len() as u64, self.block_bytes()) {
            let out = &mut buf[done..done + len];
            if !self.read_hit(lba, in_block, out) {
                let tail = *sequential_tail.get_or_insert_with(|| {
                    engine.admission.note_request(offset, request_len, engine.clock.now_ns())
                });
                self.read_locked(lba, in_block, out, !tail)?;
            }
            done += len;
        }
        bump(&self.counters().bytes_read, buf.len() as u64);
        Ok(())
    }

    /// The lock-free hit path. Returns false on a miss or after repeated interference.
    fn read_hit(&mut self, lba: u64, in_block: usize, out: &mut [u8]) -> bool {
        for _ in 0..READ_ATTEMPTS {
            // Absent, or hidden (being filled under its stripe): the locked path.
            let Some(found) = self.engine.index.lookup(lba).filter(|f| !f.hidden) else {
                return false;
            };
            if self.copy_validated(&found, in_block, out) {
                return true;
            }
        }
        false
    }

    /// Copies out of the slot `found` (a visible index entry) and validates the copy; counts a
    /// hit, or a retry if the copy must be discarded.
    #[inline]
    fn copy_validated(&mut self, found: &Found, in_block: usize, out: &mut [u8]) -> bool {
        let engine = self.engine;
        assert!(!found.hidden, "lock-free copy from a hidden index entry");
        // The copy is validated after it is made: the block's index entry still holds the same
        // slot *and the same slot generation*. A slot's data never changes while an entry
        // points at it with its current generation (writes go out of place; a slot is freed —
        // a new generation — before it is reused), so the copy is the block's data at a point
        // inside the copy. A failed validation discards the copy. No other DRAM line is read.
        engine.medium.read(engine.geometry.data_offset(found.slot) + in_block as u64, out);
        fence(Ordering::Acquire);
        if engine.index.still_holds(found) {
            if engine.marks_hits {
                engine.index.touch(found);
            }
            bump(&self.counters().read_hits, 1);
            return true;
        }
        bump(&self.counters().read_retries, 1);
        false
    }

    /// The locked read path: a hit that raced with writers, or a miss (admitted or not).
    fn read_locked(
        &mut self,
        lba: u64,
        in_block: usize,
        out: &mut [u8],
        may_admit: bool,
    ) -> Result<()> {
        let engine = self.engine;
        let admit = may_admit && engine.mode().admits_reads() && engine.admission.admit_block(lba);
        let reserved = self.reserve_for_admission(admit);
        let mut guard = engine.lock_stripe(lba);
        if let Some(found) = engine.index.lookup(lba) {
            engine.medium.read(engine.geometry.data_offset(found.slot) + in_block as u64, out);
            drop(guard);
            if let Some(slot) = reserved {
                self.give_back(slot);
            }
            bump(&self.counters().read_hits, 1);
            return Ok(());
        }
        let block = self.block_bytes();
        let Some(slot) = reserved else {
            engine.backing_read(out, lba * block + in_block as u64)?;
            let counters = self.counters();
            bump(
                if may_admit {
                    &counters.read_misses_bypassed
                } else {
                    &counters.read_misses_sequential
                },
                1,
            );
            return Ok(());
        };
        if let Err(err) = engine.backing_read(&mut self.block, lba * block) {
            drop(guard);
            self.give_back(slot);
            return Err(err);
        }
        let inserted = match self.index_insert(lba, slot) {
            Ok(inserted) => inserted,
            Err(err) => {
                drop(guard);
                self.give_back(slot);
                return Err(err);
            }
        };
        // The sequence number is taken after the backing read completed (the synced rule).
        let seq = engine.global_seq(&mut guard);
        let data = std::mem::take(&mut self.block);
        self.write_data(slot, &data);
        self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
        engine.index.replace(&inserted, slot, engine.slots.generation(slot));
        engine.slots.publish(slot, SlotState::Clean);
        out.copy_from_slice(&data[in_block..in_block + out.len()]);
        self.block = data;
        drop(guard);
        bump(&self.counters().read_misses_admitted, 1);
        Ok(())
    }

    /// Fills the scratch block with `lba`'s current contents (cache or backing). Stripe held.
    fn load_block(&mut self, lba: u64, cached: Option<&Found>) -> Result<()> {
        let engine = self.engine;
        match cached {
            Some(found) => {
                engine.medium.read(engine.geometry.data_offset(found.slot), &mut self.block)
            }
            None => {
                let offset = lba * self.block_bytes();
                engine.backing_read(&mut self.block, offset)?
            }
        }
        Ok(())
    }

    // ----- writes -----

    /// Writes `data` at byte `offset`. With `fua`, the data is durable on return in every mode
    /// (in write-back and write-only modes it always is).
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.engine.check_range("write", offset, data.len() as u64)?;
        let mut done = 0;
        for (lba, in_block, len) in pieces(offset, data.len() as u64, self.block_bytes()) {
            self.write_block(lba, in_block, Payload::Data(&data[done..done + len]))?;
            done += len;
        }
        bump(&self.counters().bytes_written, data.len() as u64);
        if fua && !self.engine.mode().writes_back() {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes zeroes over `len` bytes at `offset` (durable on return with `fua`, as `write`).
    pub fn write_zeroes(&mut self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.engine.check_range("write_zeroes", offset, len)?;
        for (lba, in_block, n) in pieces(offset, len, self.block_bytes()) {
            self.write_block(lba, in_block, Payload::Zeroes(n))?;
        }
        if fua && !self.engine.mode().writes_back() {
            self.flush()?;
        }
        Ok(())
    }

    fn write_block(&mut self, lba: u64, in_block: usize, payload: Payload<'_>) -> Result<()> {
        bump(&self.counters().writes, 1);
        let mode = self.engine.mode();
        if mode.writes_back() {
            self.write_block_cached(lba, in_block, payload)
        } else {
            self.write_block_backing(lba, in_block, payload, mode == CacheMode::WriteThrough)
        }
    }

    /// Write-back: the new block goes to a free slot, is persisted, then its entry, then the
    /// index switches and the old slot is freed.
    fn write_block_cached(
        &mut self,
        lba: u64,
        in_block: usize,
        payload: Payload<'_>,
    ) -> Result<()> {
        let engine = self.engine;
        let slot = self.alloc()?;
        let full = in_block == 0 && payload.len() as u64 == self.block_bytes();
        // A whole block is copied and made durable before the stripe is taken: the slot is
        // this lane's alone and nothing refers to it, and the lock's locked instruction then
        // finds no write-back outstanding to wait for (docs/DURABILITY.md, write-back steps
        // 1–2). The metadata lines this write touches are cache misses at random places: they
        // load while the fence waits for the copy's stores (started before the copy, they
        // slowed it).
        if full {
            let at = engine.geometry.data_offset(slot);
            match payload {
                Payload::Data(data) => engine.medium.write_flush(at, data),
                Payload::Zeroes(_) => {
                    self.block.fill(0);
                    engine.medium.write_flush(at, &self.block);
                }
            }
        }
        let stripe = engine.stripe_index(lba);
        engine.prefetch_slot_for_entry_store(slot);
        engine.prefetch_stripe(stripe);
        let key = engine.index.key(lba);
        engine.index.prefetch_key(&key);
        // The lane's next write goes to its next slot (address order, see `alloc`): touching
        // that slot's data now walks its page table while this fence waits, instead of on the
        // next write's path. About 10 % of a write (docs/PERFORMANCE.md, session 26); its
        // entry line alone gained nothing, and the touch before this write's copy lost.
        if let Some(&next) = self.free.last() {
            engine.medium.prefetch(engine.geometry.data_offset(next), 1);
        }
        if full {
            self.fence();
        }
        let mut guard = engine.lock_stripe_index(stripe);
        let seq = self.local_seq(&mut guard);
        let old = engine.index.lookup_key(&key);
        if let Some(found) = old {
            engine.prefetch_slot_for_entry_store(found.slot);
        }
        if !full {
            if let Err(err) = self.load_block(lba, old.as_ref()) {
                drop(guard);
                self.give_back(slot);
                return Err(err);
            }
            payload.apply(&mut self.block, in_block);
            let merged = std::mem::take(&mut self.block);
            self.write_data(slot, &merged);
            self.block = merged;
        }
        let entry = match old.map_or_else(|| self.index_insert(lba, slot), Ok) {
            Ok(entry) => entry,
            Err(err) => {
                drop(guard);
                self.give_back(slot);
                return Err(err);
            }
        };
        self.persist_entry(slot, SlotEntry { lba, state: BlockState::Dirty, seq });
        let switched = self.switch_in_dirty(stripe, slot, entry);
        if switched.must_fence {
            self.fence();
        }
        let counters = self.counters();
        bump(&counters.dirty_delta, u64::from(switched.newly_dirty));
        bump(&counters.write_hits, u64::from(switched.hit));
        if !entry.hidden {
            self.keep_free(entry.slot);
        }
        drop(guard);
        self.zero_superseded_entries();
        Ok(())
    }

    /// Makes the dirty copy of `lba` in `slot` (its entry durable) the visible one: points
    /// `lba`'s index `entry` at `slot` — the entry of the copy it replaces, or the hidden one
    /// inserted for a block new to the cache — publishes `slot`, and frees the replaced copy
    /// as superseded. Shared by single and group writes. The caller holds the stripe, fences
    /// before releasing it if `must_fence` comes back true (see `free_superseded`), hands a
    /// replaced copy's slot (`entry.slot` unless `entry.hidden`) to `keep_free`, and counts
    /// what this returns (a group counts once for all its writes).
    #[inline(always)]
    fn switch_in_dirty(&mut self, stripe: usize, slot: u32, entry: Found) -> Switched {
        let engine = self.engine;
        let free_word = engine.slots.load(slot);
        engine.index.replace(&entry, slot, free_word.generation());
        engine.slots.publish_loaded(slot, free_word, SlotState::Dirty);
        if entry.hidden {
            return Switched { must_fence: false, newly_dirty: true, hit: false };
        }
        let (must_fence, old_state) = self.free_superseded(stripe, entry.slot);
        Switched { must_fence, newly_dirty: old_state != SlotState::Dirty, hit: true }
    }

    /// Write-through, write-around and pass-through: the backing store is written under the
    /// block's stripe; a clean cached copy is invalidated durably *before* it changes, a dirty
    /// one only *after* (so a crash never exposes data older than what was acknowledged).
    fn write_block_backing(
        &mut self,
        lba: u64,
        in_block: usize,
        payload: Payload<'_>,
        admit: bool,
    ) -> Result<()> {
        let engine = self.engine;
        let block = self.block_bytes();
        let full = in_block == 0 && payload.len() as u64 == block;
        let reserved = self.reserve_for_admission(admit);
        let mut guard = engine.lock_stripe(lba);
        let old = engine.index.lookup(lba);
        let old_dirty = old.is_some_and(|f| engine.slots.load(f.slot).state() == SlotState::Dirty);
        let fail = |lane: &mut Self, err: Error| {
            if let Some(slot) = reserved {
                lane.give_back(slot);
            }
            Err(err)
        };
        if !full {
            if let Err(err) = self.load_block(lba, old.as_ref()) {
                drop(guard);
                return fail(self, err);
            }
            payload.apply(&mut self.block, in_block);
        } else if admit {
            self.block.fill(0);
            payload.apply(&mut self.block, 0);
        }
        if let (Some(found), false) = (old, old_dirty) {
            engine.index.remove(&found);
            self.free_slot(lba, found.slot);
        }
        let written = match (full, payload) {
            (true, Payload::Zeroes(_)) => engine.backing_write_zeroes(lba * block, block),
            (true, Payload::Data(data)) => engine.backing_write(data, lba * block),
            (false, _) => engine.backing_write(&self.block, lba * block),
        };
        if let Err(err) = written {
            drop(guard);
            return fail(self, err);
        }
        // A dirty cached copy is the only durable copy of the block's current data: it may be
        // dropped only once the new data is durable on the backing store.
        if old_dirty && let Err(err) = engine.sync_backing() {
            drop(guard);
            return fail(self, err);
        }
        let counters = self.counters();
        match (reserved, old.filter(|_| old_dirty)) {
            (Some(slot), dirty_old) => {
                let entry = match dirty_old.map_or_else(|| self.index_insert(lba, slot), Ok) {
                    Ok(entry) => entry,
                    Err(err) => {
                        drop(guard);
                        // The write itself is done; it is just not cached.
                        let _ = fail(self, err);
                        return Ok(());
                    }
                };
                let seq = engine.global_seq(&mut guard);
                let data = std::mem::take(&mut self.block);
                self.write_data(slot, &data);
                self.block = data;
                self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
                engine.index.replace(&entry, slot, engine.slots.generation(slot));
                engine.slots.publish(slot, SlotState::Clean);
                if !entry.hidden {
                    self.free_slot(lba, entry.slot);
                    bump(&counters.dirty_delta, 1u64.wrapping_neg());
                }
            }
            (None, Some(found)) => {
                engine.index.remove(&found);
                self.free_slot(lba, found.slot);
                bump(&counters.dirty_delta, 1u64.wrapping_neg());
            }
            (None, None) => {}
        }
        if old.is_some() {
            bump(&counters.write_hits, 1);
        }
        drop(guard);
        Ok(())
    }

    // ----- trim, flush, drain -----

    /// Discards the whole blocks inside `offset..offset + len` (partial blocks are left as
    /// they are): cached copies are dropped and the range is discarded on the backing store.
    /// Their contents are unspecified until written again.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        let engine = self.engine;
        engine.check_range("trim", offset, len)?;
        let block = self.block_bytes();
        let first = offset.div_ceil(block);
        let end = (offset + len) / block;
        if first >= end {
            return Ok(());
        }
        // Discard first, then drop cached copies: a write racing with the trim then either
        // lands after the discard (and its cached copy is dropped, the backing keeps it) or
        // before (and both are discarded) — never a clean cached copy the backing lacks.
        engine
            .backing
            .discard(first * block, (end - first) * block)
            .map_err(|e| engine.backing_failed(e))?;
        engine.backing_writes.fetch_add(1, Ordering::SeqCst);
        let mut dropped_dirty = 0u64;
        for lba in first..end {
            let guard = engine.lock_stripe(lba);
            if let Some(found) = engine.index.lookup(lba) {
                if engine.slots.load(found.slot).state() == SlotState::Dirty {
                    dropped_dirty += 1;
                }
                engine.index.remove(&found);
                self.free_slot(lba, found.slot);
            }
            drop(guard);
        }
        let counters = self.counters();
        bump(&counters.trims, end - first);
        bump(&counters.dirty_delta, dropped_dirty.wrapping_neg());
        Ok(())
    }

    /// Makes every acknowledged write durable: syncs the backing store if anything reached it
    /// since the last sync, and records the synced sequence number.
    pub fn flush(&mut self) -> Result<()> {
        let engine = self.engine;
        let sample = engine.last_issued_seq();
        if engine.backing_writes.load(Ordering::SeqCst)
            != engine.backing_writes_synced.load(Ordering::SeqCst)
        {
            engine.sync_backing()?;
        }
        self.advance_synced_seq(sample);
        bump(&self.counters().flushes, 1);
        Ok(())
    }

    /// Writes back every dirty block and marks it clean; the backing store then holds every
    /// acknowledged write.
    pub fn drain(&mut self) -> Result<()> {
        let engine = self.engine;
        let mut batch = Vec::with_capacity(DRAIN_BATCH);
        // Everything that can be written back is, and the first failure is the result: a
        // block the backing store refuses stays dirty, and so does nothing else.
        let mut error = None;
        let mut failed_batches = 0;
        let mut write_back = |lane: &mut Self, batch: &[u32]| {
            let written = lane.write_back(batch, None);
            match written.error {
                Some(e) => {
                    failed_batches = if written.cleaned == 0 { failed_batches + 1 } else { 0 };
                    error.get_or_insert(e);
                }
                None => failed_batches = 0,
            }
            failed_batches < DRAIN_FAILED_BATCHES_MAX
        };
        for slot in 0..engine.slots.len() {
            if engine.slots.load(slot).state() == SlotState::Dirty {
                batch.push(slot);
                if batch.len() == DRAIN_BATCH {
                    let go_on = write_back(self, &batch);
                    batch.clear();
                    if !go_on {
                        break;
                    }
                }
            }
        }
        if !batch.is_empty() {
            write_back(self, &batch);
        }
        let flushed = self.flush();
        match error {
            Some(e) => Err(e),
            None => flushed,
        }
    }
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

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use std::sync::Arc;

    use crate::WriteRequest;
    use crate::format::{self, DecodedEntry, SlotEntry};
    use crate::testing::model::{BLOCK, SimEngine, World, config};
    use crate::{AdmissionConfig, CacheMode, Engine, EvictionKind, ManualClock};

    /// A fresh write-back engine on simulated parts, with the parts (to inspect or cut).
    fn write_back_engine(seed: u64) -> (World, SimEngine) {
        let world = World::fresh(seed);
        let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
        let clock = Arc::new(ManualClock::default());
        let engine = Engine::format(world.medium.clone(), world.backing.clone(), clock, &cfg)
            .expect("format");
        (world, engine)
    }

    /// `settle_pending_free` on its own: an entry naming a block of the stripe (here block 0's
    /// live entry, standing in for a superseded one) has its word 0 cleared and made durable by
    /// the caller's fence; an entry naming another stripe's block (a slot reused since) is left
    /// as it is. With the clear taken out (a flush alone, as before session 28) the first
    /// assertion fails; with the stripe check taken out, the second.
    #[test]
    fn settling_a_pending_free_clears_an_entry_of_its_stripe_and_no_other() {
        let (world, engine) = write_back_engine(12);
        let mut lane = engine.lane().expect("lane");
        let data = vec![0x5a; BLOCK];
        lane.write(0, &data, false).expect("write");
        let stripe = engine.stripe_index(0);
        let other = (1..).find(|&lba| engine.stripe_index(lba) != stripe).expect("a block");
        lane.write(other * BLOCK as u64, &data, false).expect("write");
        let (superseded, reused) = (
            engine.index.lookup(0).expect("cached").slot,
            engine.index.lookup(other).expect("cached").slot,
        );
        let word = |slot: u32, durable: bool| {
            let at = engine.geometry.entry_offset(slot);
            if durable {
                world.medium.durable_image()[at as usize / 8]
            } else {
                pmcache_media::Medium::load_u64(&world.medium, at)
            }
        };
        let reused_word0 = word(reused, true);
        assert!(word(superseded, true) != 0 && reused_word0 != 0, "both entries durable");
        engine.settle_pending_free(stripe, superseded);
        engine.settle_pending_free(stripe, reused);
        lane.fence();
        assert_eq!(word(superseded, true), 0, "the superseded entry's word 0, durably");
        assert_eq!((word(reused, false), word(reused, true)), (reused_word0, reused_word0));
    }

    /// A removal on another lane while the superseding lane's zeroes are not visible yet
    /// (stored after the stripe's release, possibly non-temporally: not stored yet, or in that
    /// core's write-combining buffer). The test puts the superseded entry back in what other
    /// threads see after the overwrite, the superseding lane stays idle, and a write-around
    /// write drops the block's newest copy; then power is cut. The block must read as the
    /// write-around data, never as the superseded copy. With `settle_pending_free` reduced to
    /// a flush (session 27's re-flush), the remover makes the restored entry durable and the
    /// superseded copy comes back.
    #[test]
    fn a_removal_settles_a_pending_free_whose_zeroes_are_not_visible_yet() {
        use crate::testing::model::pattern;
        use pmcache_media::Medium;
        let block = BLOCK as u64;
        let (old, new, newest) = (pattern(1, 0, block), pattern(2, 0, block), pattern(3, 0, block));
        for seed in 0..32 {
            let (world, engine) = write_back_engine(200 + seed);
            let (overwritten, wait_for_overwrite) = std::sync::mpsc::channel();
            let (cut, wait_for_cut) = std::sync::mpsc::channel::<()>();
            std::thread::scope(|scope| {
                let (engine, world, old, new) = (&engine, &world, &old, &new);
                scope.spawn(move || {
                    let mut lane = engine.lane().expect("lane");
                    lane.write(0, old, false).expect("write");
                    // Other blocks between, so that the two copies' entries sit in different
                    // lines.
                    for lba in 1..=8u64 {
                        lane.write(lba * block, &pattern(10 + lba, 0, block), false)
                            .expect("write");
                    }
                    let superseded = engine.index.lookup(0).expect("cached").slot;
                    let at = engine.geometry.entry_offset(superseded);
                    let words = (world.medium.load_u64(at), world.medium.load_u64(at + 8));
                    lane.write(0, new, false).expect("overwrite");
                    assert_ne!(engine.index.lookup(0).expect("cached").slot, superseded);
                    world.medium.store_u64(at + 8, words.1);
                    world.medium.store_u64(at, words.0);
                    overwritten.send(()).expect("main thread");
                    wait_for_cut.recv().expect("main thread");
                });
                wait_for_overwrite.recv().expect("writer");
                engine.set_mode(CacheMode::WriteAround);
                let mut lane = engine.lane().expect("second lane");
                lane.write(0, &newest, false).expect("write-around");
                world.switch.cut_now();
                cut.send(()).expect("writer");
            });
            drop(engine);
            let after = world.after_power_cut(200 + seed);
            let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
            let clock = Arc::new(ManualClock::default());
            let (engine, _) = Engine::open(after.medium, after.backing, clock, &cfg).expect("open");
            let mut got = vec![0u8; BLOCK];
            engine.lane().expect("lane").read(0, &mut got).expect("read");
            assert!(got != old, "seed {seed}: the superseded copy came back");
            assert!(got == newest, "seed {seed}: block 0 after the cut");
        }
    }

    /// A lane hands the slots it freed to the shared pool only once their zeroed entries are
    /// durable: another lane refilling such a slot would otherwise write its new entry over an
    /// old one still durable, and a power cut could keep the old entry's word 0 beside the new
    /// entry's word 1 — rejected only by the entry's check, by chance. Groups of overwrites
    /// free a group's slots after each group's last fence; the next group's fences make them
    /// durable, and they go back while that group's own frees are still pending.
    #[test]
    fn slots_handed_to_the_pool_have_durably_zeroed_entries() {
        let (world, engine) = write_back_engine(11);
        let mut lane = engine.lane().expect("lane");
        let blocks = engine.group_max as u64;
        assert!(blocks as usize > engine.freed_spill, "a group's frees must reach the pool");
        let data = vec![0x5a; BLOCK];
        for lba in 0..blocks {
            lane.write(lba * BLOCK as u64, &data, false).expect("first copies");
        }
        let batch: Vec<WriteRequest<'_>> = (0..blocks)
            .map(|lba| WriteRequest { offset: lba * BLOCK as u64, data: &data, fua: false })
            .collect();
        let mut old = Vec::new();
        for _ in 0..3 {
            old.extend((0..blocks).map(|lba| engine.index.lookup(lba).expect("cached").slot));
            let mut outcomes = Vec::new();
            lane.write_batch(&batch, &mut outcomes);
            assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        }
        assert!(lane.zeroings_pending(), "the last group's zeroings are still pending");

        let mut pooled = Vec::new();
        engine.pool.take(usize::MAX, &mut pooled);
        let spilled: Vec<u32> = old.iter().copied().filter(|s| pooled.contains(s)).collect();
        assert!(!spilled.is_empty(), "no superseded slot reached the pool: {old:?} {pooled:?}");
        let durable = world.medium.durable_image();
        for slot in pooled {
            let at = engine.geometry.entry_offset(slot) as usize / 8;
            let entry = SlotEntry::decode(durable[at], durable[at + 1]);
            assert_eq!(entry, DecodedEntry::Free, "slot {slot} reached the pool with {entry:?}");
        }
    }

    /// A stripe's numbers only grow, whichever counter they come from. The global counter
    /// hands out the next issuable number, raised above the stripe's last one (and then
    /// raised itself, so that what it issues later stays above); a lane takes its own numbers
    /// 1,024 at a time from the global counter and issues them in order, raised likewise.
    #[test]
    fn sequence_numbers_grow_per_stripe_from_both_counters() {
        use std::sync::atomic::Ordering;
        let (_world, engine) = write_back_engine(3);
        let start = engine.next_seq.load(Ordering::SeqCst);

        let mut stripe_last = 0;
        assert_eq!(engine.global_seq(&mut stripe_last), start);
        assert_eq!(stripe_last, start);
        // A stripe ahead of the counter (a lane's number can pass it): raised, and the
        // counter follows.
        let mut stripe_last = start + 0x1fe;
        let raised = engine.global_seq(&mut stripe_last);
        let expected = super::first_seq_after(start + 0x1fe);
        assert_eq!((raised, stripe_last), (expected, expected));
        assert_eq!(engine.next_seq.load(Ordering::SeqCst), raised + 1);
        let mut other_stripe = 0;
        assert!(engine.global_seq(&mut other_stripe) > raised);

        let mut lane = engine.lane().expect("lane");
        let taken = engine.next_seq.load(Ordering::SeqCst);
        let mut issued = Vec::new();
        for _ in 0..1500 {
            let mut stripe_last = 0;
            issued.push(lane.local_seq(&mut stripe_last));
            assert_eq!(stripe_last, *issued.last().expect("issued"));
        }
        // Two ranges taken, each issued in order (skipping multiples of 256).
        assert_eq!(engine.next_seq.load(Ordering::SeqCst), taken + 2048);
        let first_range: Vec<u64> =
            (taken..taken + 1024).filter(|&seq| format::is_issuable_seq(seq)).collect();
        assert_eq!(issued[..first_range.len()], first_range[..]);
        assert!(issued.windows(2).all(|pair| pair[0] < pair[1]), "{issued:?}");
        // A stripe ahead of the lane's range: raised.
        let mut stripe_last = taken + 5000;
        let expected = super::first_seq_after(taken + 5000);
        assert_eq!(lane.local_seq(&mut stripe_last), expected);
        assert_eq!(stripe_last, expected);
    }

    /// Sequence numbers skip every multiple of 256 (`format::is_issuable_seq`).
    #[test]
    fn the_next_sequence_number_skips_a_zero_low_byte() {
        use super::first_seq_after;
        for (seq, next) in [(0, 1), (1, 2), (254, 255), (255, 257), (256, 257), (0x12ff, 0x1301)] {
            assert_eq!(first_seq_after(seq), next, "after {seq:#x}");
        }
    }

    /// The eviction hand decides on a clean slot from the word it loaded. A slot freed and
    /// refilled with another clean block before the hand takes the stripe is a new
    /// incarnation of the slot and is skipped: the hand's second chance was the old block's,
    /// and evicting the new one there would also fail the `clean slot not indexed` check when
    /// the entry was read before the refill (the race between `read_entry` and the stripe).
    #[test]
    fn the_hand_skips_a_slot_recycled_since_it_looked() {
        use crate::slots::SlotState;
        let (_world, engine) = write_back_engine(5);
        let mut lane = engine.lane().expect("lane");
        let mut buf = vec![0u8; BLOCK];
        lane.read(BLOCK as u64, &mut buf).expect("block 1 admitted clean");
        let slot = engine.index.lookup(1).expect("block 1 cached").slot;
        let seen = engine.slots.load(slot);
        assert_eq!(seen.state(), SlotState::Clean);
        // A write-back write supersedes block 1's clean copy, and the next admission refills
        // that slot with block 2: the allocator hands it out next, as it would once the pool's
        // cursor comes round to it (after a fence, as the pool requires).
        lane.write(BLOCK as u64, &[7; BLOCK], false).expect("overwrite block 1");
        lane.fence();
        lane.freed.retain(|&freed| freed != slot);
        lane.freed_durable = lane.freed.len();
        lane.free.push(slot);
        lane.read(2 * BLOCK as u64, &mut buf).expect("block 2 admitted clean");
        assert_eq!(engine.index.lookup(2).expect("block 2 cached").slot, slot, "slot reused");
        assert_eq!(engine.slots.load(slot).state(), SlotState::Clean);

        let evictions = engine.stats().evictions;
        assert!(!lane.try_evict(slot, seen, None), "evicted a slot recycled since it was seen");
        assert_eq!(engine.stats().evictions, evictions);
        assert_eq!(engine.index.lookup(2).map(|f| f.slot), Some(slot), "block 2 evicted");
        // The slot as it is now is evicted.
        assert!(lane.try_evict(slot, engine.slots.load(slot), None), "current incarnation");
        assert_eq!(engine.stats().evictions, evictions + 1);
        assert!(engine.index.lookup(2).is_none());
        lane.read(2 * BLOCK as u64, &mut buf).expect("block 2 again");
        assert_eq!(buf, vec![0; BLOCK]);
    }

    /// The dirty-slot figure sums the lanes' counters one after another: a block made dirty
    /// by one lane and cleaned by another between the reads counts as cleaned only, and the
    /// figure reads as 0 then, not as a count wrapped to nearly 2^64.
    #[test]
    fn the_dirty_figure_never_wraps_below_zero() {
        use std::sync::atomic::Ordering;
        let (_world, engine) = write_back_engine(9);
        engine.lane().expect("lane").write(0, &[1; BLOCK], false).expect("write");
        assert_eq!(engine.stats().dirty_slots, 1);
        // What a reader sees if it read the writer's counter before the write and the
        // cleaner's after the clean: -1 in all.
        engine.lanes[0].counters.dirty_delta.store(0, Ordering::Relaxed);
        engine.lanes[1].counters.dirty_delta.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(engine.stats().dirty_slots, 0);
    }

    /// FUA flushes the backing store only where the write goes to it: never in write-back
    /// or write-only (the write is durable on the medium when acknowledged), once per FUA
    /// write in the modes that write through, never without FUA (over clean blocks).
    #[test]
    fn fua_flushes_the_backing_store_only_where_the_write_goes() {
        let (world, engine) = write_back_engine(5);
        let mut lane = engine.lane().expect("lane");
        let data = vec![0x33; BLOCK];
        for mode in CacheMode::ALL {
            engine.set_mode(mode);
            // Not counted: a write that drops a dirty copy flushes the backing store whatever
            // FUA says (the dropped copy was durable), and the last mode left both blocks dirty.
            lane.write(0, &data, false).expect("write");
            lane.write_zeroes(BLOCK as u64, BLOCK as u64, false).expect("write zeroes");
            for fua in [false, true, false, true] {
                let before = world.backing.flushes();
                lane.write(0, &data, fua).expect("write");
                lane.write_zeroes(BLOCK as u64, BLOCK as u64, fua).expect("write zeroes");
                let expected = if fua && !mode.writes_back() { 2 } else { 0 };
                let flushes = world.backing.flushes() - before;
                assert_eq!(flushes, expected, "{mode}, fua {fua}");
            }
        }
    }

    /// Making index room inside a read miss or a write-through (full buckets).
    #[cfg(not(feature = "shuttle"))]
    mod full_index {
        use pmcache_backing::BackingStore;
        use proptest::prelude::*;

        use crate::testing::full_buckets::{self, BACKING_FILL, FullBuckets, assert_reads};
        use crate::testing::proptest_cases;
        use crate::{CacheMode, Lane, WriteRequest};

        const BLOCK: usize = full_buckets::BLOCK as usize;

        /// An operation on block `b` of the 25 that share three index buckets (24 fit).
        #[derive(Clone, Debug)]
        enum Op {
            Write {
                b: usize,
                fill: u8,
            },
            /// Bytes 512..1536 of the block.
            WritePartial {
                b: usize,
                fill: u8,
            },
            WriteZeroes {
                b: usize,
            },
            Trim {
                b: usize,
            },
            Read {
                b: usize,
            },
            /// Whole-block writes handed over as one batch (group commit, and the writes that
            /// find no index room run alone).
            WriteBatch {
                writes: Vec<(usize, u8)>,
            },
            /// Every block written, in this order, one by one: in a mode that writes back,
            /// the buckets then hold only dirty blocks and the one left out must make room by
            /// writing one back.
            WriteAll {
                order: Vec<usize>,
                fill: u8,
            },
            /// Every block read, in this order.
            ReadAll {
                order: Vec<usize>,
            },
            SetMode(CacheMode),
            /// Drop the engine and attach again (recovery rebuilds everything).
            Reattach,
            Drain,
        }

        fn op() -> impl Strategy<Value = Op> {
            let b = 0..25usize;
            prop_oneof![
                4 => (b.clone(), any::<u8>()).prop_map(|(b, fill)| Op::Write { b, fill }),
                2 => (b.clone(), any::<u8>()).prop_map(|(b, fill)| Op::WritePartial { b, fill }),
                1 => b.clone().prop_map(|b| Op::WriteZeroes { b }),
                1 => b.clone().prop_map(|b| Op::Trim { b }),
                4 => b.clone().prop_map(|b| Op::Read { b }),
                2 => prop::collection::vec((b, any::<u8>()), 1..12)
                    .prop_map(|writes| Op::WriteBatch { writes }),
                1 => (Just((0..25).collect::<Vec<usize>>()).prop_shuffle(), any::<u8>())
                    .prop_map(|(order, fill)| Op::WriteAll { order, fill }),
                1 => Just((0..25).collect::<Vec<usize>>()).prop_shuffle()
                    .prop_map(|order| Op::ReadAll { order }),
                1 => prop::sample::select(CacheMode::ALL.to_vec()).prop_map(Op::SetMode),
                1 => Just(Op::Reattach),
                1 => Just(Op::Drain),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(proptest_cases(256)))]

            /// Random operations in every mode on blocks that never all fit the index, so
            /// nearly every admission and every new dirty block must make room (evict a clean
            /// occupant, or write a dirty one back first): every read returns the block's
            /// last data, across re-attachments, and a final drain leaves it on the backing
            /// store.
            #[test]
            fn blocks_competing_for_index_room_keep_their_data(
                ops in prop::collection::vec(op(), 1..80)
            ) {
                let cache = FullBuckets::new();
                let lbas: Vec<u64> = cache.fillers.iter().copied().chain([cache.x]).collect();
                // Each block's contents; `None` after a trim (unspecified until read).
                let mut model: Vec<Option<Vec<u8>>> = vec![Some(vec![BACKING_FILL; BLOCK]); 25];
                let (mut engine, _) = cache.cache.open();
                let mut got = vec![0u8; BLOCK];
                let read = |lane: &mut Lane<'_, _, _, _>,
                            model: &mut [Option<Vec<u8>>],
                            b: usize|
                 -> Result<(), TestCaseError> {
                    let mut got = vec![0u8; BLOCK];
                    lane.read(lbas[b] * BLOCK as u64, &mut got).unwrap();
                    match &model[b] {
                        Some(data) => prop_assert!(
                            got == *data,
                            "block {b}: read {:#x}.., holds {:#x}..", got[0], data[0]
                        ),
                        None => model[b] = Some(got),
                    }
                    Ok(())
                };
                for op in ops {
                    let mut lane = engine.lane().unwrap();
                    match op {
                        Op::Write { b, fill } => {
                            lane.write(lbas[b] * BLOCK as u64, &[fill; BLOCK], false).unwrap();
                            model[b] = Some(vec![fill; BLOCK]);
                        }
                        Op::WritePartial { b, fill } => {
                            lane.write(lbas[b] * BLOCK as u64 + 512, &[fill; 1024], false)
                                .unwrap();
                            if let Some(data) = &mut model[b] {
                                data[512..1536].fill(fill);
                            }
                        }
                        Op::WriteZeroes { b } => {
                            lane.write_zeroes(lbas[b] * BLOCK as u64, BLOCK as u64, false)
                                .unwrap();
                            model[b] = Some(vec![0; BLOCK]);
                        }
                        Op::Trim { b } => {
                            lane.trim(lbas[b] * BLOCK as u64, BLOCK as u64).unwrap();
                            model[b] = None;
                        }
                        Op::Read { b } => read(&mut lane, &mut model, b)?,
                        Op::ReadAll { order } => {
                            for b in order {
                                read(&mut lane, &mut model, b)?;
                            }
                        }
                        Op::WriteBatch { writes } => {
                            // A block repeated in the batch is written in batch order.
                            let data: Vec<[u8; BLOCK]> =
                                writes.iter().map(|&(_, fill)| [fill; BLOCK]).collect();
                            let requests: Vec<WriteRequest<'_>> = writes
                                .iter()
                                .zip(&data)
                                .map(|(&(b, _), data)| WriteRequest {
                                    offset: lbas[b] * BLOCK as u64,
                                    data,
                                    fua: false,
                                })
                                .collect();
                            let mut outcomes = Vec::new();
                            lane.write_batch(&requests, &mut outcomes);
                            prop_assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
                            for &(b, fill) in &writes {
                                model[b] = Some(vec![fill; BLOCK]);
                            }
                        }
                        Op::WriteAll { order, fill } => {
                            for b in order {
                                lane.write(lbas[b] * BLOCK as u64, &[fill; BLOCK], false)
                                    .unwrap();
                                model[b] = Some(vec![fill; BLOCK]);
                            }
                        }
                        Op::SetMode(mode) => engine.set_mode(mode),
                        Op::Reattach => {
                            drop(lane);
                            drop(engine);
                            engine = cache.cache.open().0;
                            continue;
                        }
                        Op::Drain => lane.drain().unwrap(),
                    }
                }
                engine.lane().unwrap().drain().unwrap();
                for (b, data) in model.iter().enumerate() {
                    if let Some(data) = data {
                        engine.backing().read_at(&mut got, lbas[b] * BLOCK as u64).unwrap();
                        prop_assert!(got == *data, "block {b} on the backing store: {:#x}..", got[0]);
                    }
                }
            }
        }

        /// A read miss whose index buckets are full of dirty blocks writes one of them back to
        /// make room. The block read must be its own data, returned and cached: the write-back
        /// once copied the dirty block through the buffer that held it.
        #[test]
        fn a_read_miss_that_writes_back_for_index_room_keeps_its_own_data() {
            let cache = FullBuckets::new();
            let (engine, _) = cache.cache.open();
            let mut lane = engine.lane().unwrap();
            cache.write_fillers(&mut lane);
            let mut got = vec![0u8; full_buckets::BLOCK as usize];
            lane.read(cache.x * full_buckets::BLOCK, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == BACKING_FILL), "read {:#x}", got[0]);
            let stats = engine.stats();
            assert_eq!((stats.read_misses_admitted, stats.writebacks, stats.read_hits), (1, 1, 0));
            // Served from the cache now.
            got.fill(0);
            lane.read(cache.x * full_buckets::BLOCK, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == BACKING_FILL), "read {:#x}", got[0]);
            assert_eq!(engine.stats().read_hits, 1);
            drop(lane);
            // Every block (the fillers now miss in turn, each taking another's place), and again
            // after attaching anew.
            let fillers = cache
                .fillers
                .iter()
                .enumerate()
                .map(|(i, &lba)| (lba, FullBuckets::filler_fill(i)));
            let expected: Vec<(u64, u8)> = fillers.chain([(cache.x, BACKING_FILL)]).collect();
            assert_reads(&engine, expected.iter().copied());
            drop(engine);
            assert_reads(&cache.cache.open().0, expected);
        }

        /// A write that must make index room while another lane holds the stripes of every
        /// dirty occupant but one writes that one back: it never waits for a stripe while
        /// holding its own (two lanes each making room in the other's stripes would wait
        /// forever), and it does not give up while one occupant can still be written back.
        #[test]
        fn making_index_room_skips_occupants_whose_stripe_is_busy() {
            let cache = FullBuckets::new();
            let (engine, _) = cache.cache.open();
            let mut lane = engine.lane().unwrap();
            cache.write_fillers(&mut lane);
            let own = engine.stripe_index(cache.x);
            let (free_at, free_filler) = (23, cache.fillers[23]);
            let mut busy: Vec<usize> = cache.fillers[..free_at]
                .iter()
                .map(|&lba| engine.stripe_index(lba))
                .filter(|&stripe| stripe != own)
                .collect();
            busy.sort_unstable();
            busy.dedup();
            assert!(!busy.contains(&engine.stripe_index(free_filler)), "pick another filler");
            let guards: Vec<_> =
                busy.iter().map(|&stripe| engine.lock_stripe_index(stripe)).collect();
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    let block = [0x77; full_buckets::BLOCK as usize];
                    let result = lane.write(cache.x * full_buckets::BLOCK, &block, false);
                    done_tx.send(result.is_ok()).unwrap();
                });
                let done = done_rx.recv_timeout(std::time::Duration::from_secs(20));
                drop(guards);
                assert_eq!(done, Ok(true), "the write waited on busy stripes");
            });
            drop(lane);
            let stats = engine.stats();
            assert_eq!((stats.writebacks, stats.evictions), (1, 1), "{stats:?}");
            assert_reads(
                &engine,
                [(cache.x, 0x77), (free_filler, FullBuckets::filler_fill(free_at))],
            );
        }

        /// The same for a write-through write (whole or partial) cached in place of a block
        /// written back for room: the cached copy is the data written.
        #[test]
        fn a_write_through_that_writes_back_for_index_room_caches_its_own_data() {
            for partial in [false, true] {
                let cache = FullBuckets::new();
                let (engine, _) = cache.cache.open();
                let mut lane = engine.lane().unwrap();
                cache.write_fillers(&mut lane);
                engine.set_mode(CacheMode::WriteThrough);
                let mut expected =
                    vec![if partial { BACKING_FILL } else { 0x77 }; full_buckets::BLOCK as usize];
                let (at, len) =
                    if partial { (512, 1024) } else { (0, full_buckets::BLOCK as usize) };
                expected[at..at + len].fill(0x77);
                lane.write(
                    cache.x * full_buckets::BLOCK + at as u64,
                    &expected[at..at + len],
                    false,
                )
                .unwrap();
                assert_eq!(engine.stats().writebacks, 1, "partial: {partial}");
                let mut got = vec![0u8; full_buckets::BLOCK as usize];
                lane.read(cache.x * full_buckets::BLOCK, &mut got).unwrap();
                assert!(got == expected, "partial: {partial}: read {:#x} at {at}", got[at]);
                assert_eq!(
                    engine.stats().read_hits,
                    1,
                    "partial: {partial}: not served from the cache"
                );
            }
        }
    }
}
