//! The cleaner's mechanism (its policy — settings, order, rate, priority — is
//! `crate::cleaner_policy`): a background thread that writes dirty blocks back through the backing store's
//! queued interface, in batches of one `fdatasync` each, at a rate set by watermarks, a PID
//! controller and idleness, with its thread priority raised while writers stall (paper 002).
//!
//! A dirty slot never changes (writes go out of place), so the cleaner copies a block out of
//! its slot under the block's stripe lock, releases the stripe, and writes the copy back with
//! no lock held. After the batch's sync it takes each stripe again and marks the block clean
//! only if its slot is still the same incarnation and dirty: an overwrite meanwhile freed the
//! slot (a new generation), and the block stays dirty with the newer data.
//!
//! While a copy of a block of stripe `s` is on its way to the backing store, `s` counts it in
//! `Stripe::cleaning`. Anyone else who writes or discards that block's range of the backing
//! store holds the stripe and waits for the count to fall to zero first (`cache/ordering.rs`,
//! the one place that rule lives), so an older copy can never land after a newer one. The
//! cleaner itself never waits for a stripe while it has writes in flight (it only tries the
//! lock), and its completions lower the count without the lock: the wait cannot deadlock.
//! Within one batch a block is copied at most once.
//!
//! Batches are pipelined: once a batch's writes have completed, its flush (`fdatasync`) goes
//! to the queue and the next batch's writes are issued while it runs; the batch is marked
//! clean when its flush completes, before the next flush is issued. The batch being synced
//! is left out of the next one (its blocks are still dirty until marked).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use pmcache_backing::{IoBuf, IoCompletion, IoQueue, IoRequest};

use super::shared::SyncTicket;
use super::*;
use crate::cleaner_policy::priority::ThreadPriority;
use crate::cleaner_policy::{
    Candidate, CleanerConfig, CleanerStats, DirtyThresholds, RateController, RateTerms,
    STALL_BUCKETS, WriteBackOrder, stall_bucket,
};
use crate::sync::{Condvar, wait_timeout};

mod batch;
mod drains;
mod pace;
mod writer_nice;

use drains::DrainRequests;
use pace::Pace;
use writer_nice::WriterNice;

/// Most candidates one scan of the slot table collects (16 bytes each).
const CANDIDATES_MAX: usize = 1 << 16;
/// Longest the cleaner sleeps between looks at the dirty level when resting.
const REST_MS: u64 = 100;
/// How long a stalled writer waits for the cleaner's next batch before it looks again.
const STALL_POLL_MS: u64 = 20;
/// The `user_data` of the cleaner's flushes (its writes carry their buffer's index).
const FLUSH_TAG: u64 = u64::MAX;
/// Reaps in a row that fail as a whole (the queue itself, not one request) before the cleaner
/// gives its queue up and writes synchronously: a queue that fails for good must not keep the
/// copies it holds in flight forever, each keeping writers of its stripe waiting.
const QUEUE_FAILURES_MAX: u32 = 8;
/// Busy time over which the cleaner's write-back rate is measured before it updates its
/// estimate.
const RATE_WINDOW: Duration = Duration::from_millis(200);

/// The cleaner's state shared with the lanes: whether one runs, its settings, its wake-up and
/// progress signals, and its figures.
pub(crate) struct CleanerShared {
    /// A cleaner runs and takes stalls: a writer that finds no slot waits for it instead of
    /// writing back inline.
    running: AtomicBool,
    stop: AtomicBool,
    /// The last batch failed (a backing error or sync failure) and cleaned nothing: writers
    /// fall back to the inline path, which reports the error.
    failing: AtomicBool,
    config: Mutex<CleanerConfig>,
    /// Set (and signalled) to wake a resting cleaner.
    wake: Mutex<bool>,
    wake_signal: Condvar,
    /// Batches completed (cleaned something); stalled writers wait for it to move. Read
    /// without the lock; `progress_lock` orders a waiter's check against the signal.
    progress: AtomicU64,
    progress_lock: Mutex<()>,
    progress_signal: Condvar,
    stalled_writers: AtomicU64,
    status: Mutex<CleanerStats>,
    stalls: AtomicU64,
    stall_ns_total: AtomicU64,
    stall_ns_max: AtomicU64,
    stall_histogram: [AtomicU64; STALL_BUCKETS],
    stall_timeouts: AtomicU64,
    inline_fallbacks: AtomicU64,
    /// Writers' pacing (`CleanerConfig::throttle_pct`).
    pace: Pace,
    /// The writers' nice value while the cleaner is boosted (`CleanerConfig::nice_writers`).
    writer_nice: WriterNice,
    /// Drains asked of the running cleaner (`Engine::request_drain`).
    drains: DrainRequests,
}

impl CleanerShared {
    pub(crate) fn new() -> Self {
        Self {
            running: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            failing: AtomicBool::new(false),
            config: Mutex::new(CleanerConfig::default()),
            wake: Mutex::new(false),
            wake_signal: Condvar::new(),
            progress: AtomicU64::new(0),
            progress_lock: Mutex::new(()),
            progress_signal: Condvar::new(),
            stalled_writers: AtomicU64::new(0),
            status: Mutex::new(CleanerStats { phase: "stopped", ..CleanerStats::default() }),
            stalls: AtomicU64::new(0),
            stall_ns_total: AtomicU64::new(0),
            stall_ns_max: AtomicU64::new(0),
            stall_histogram: std::array::from_fn(|_| AtomicU64::new(0)),
            stall_timeouts: AtomicU64::new(0),
            inline_fallbacks: AtomicU64::new(0),
            pace: Pace::new(),
            writer_nice: WriterNice::new(),
            drains: DrainRequests::new(),
        }
    }

    fn wake(&self) {
        *lock(&self.wake) = true;
        self.wake_signal.notify_one();
    }

    /// Sleeps up to `timeout` or until woken.
    fn rest(&self, timeout: Duration) {
        let mut woken = lock(&self.wake);
        if !*woken {
            woken = wait_timeout(&self.wake_signal, woken, timeout);
        }
        *woken = false;
    }

    fn progress_epoch(&self) -> u64 {
        self.progress.load(Ordering::SeqCst)
    }

    fn advance_progress(&self) {
        let _ordered = lock(&self.progress_lock);
        self.progress.fetch_add(1, Ordering::SeqCst);
        self.progress_signal.notify_all();
    }

    /// Waits up to `timeout` for the progress epoch to move past `seen`.
    fn wait_progress(&self, seen: u64, timeout: Duration) {
        let ordered = lock(&self.progress_lock);
        if self.progress.load(Ordering::SeqCst) == seen {
            drop(wait_timeout(&self.progress_signal, ordered, timeout));
        }
    }

    fn record_stall(&self, ns: u64) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
        self.stall_ns_total.fetch_add(ns, Ordering::Relaxed);
        self.stall_ns_max.fetch_max(ns, Ordering::Relaxed);
        self.stall_histogram[stall_bucket(ns)].fetch_add(1, Ordering::Relaxed);
    }

    /// Gives the calling thread, which is about to enter the engine to write (`writing`) or
    /// to read, the nice value the cleaner asks of writers (`CleanerConfig::nice_writers`) if
    /// that changed (a read only takes a thread back to its own value).
    #[inline]
    pub(crate) fn follow_writer_nice(&self, writing: bool) {
        self.writer_nice.follow(writing);
    }

    pub(crate) fn stats(&self) -> CleanerStats {
        let mut stats = lock(&self.status).clone();
        stats.running = self.running.load(Ordering::Relaxed);
        stats.stalls = self.stalls.load(Ordering::Relaxed);
        stats.stall_ns_total = self.stall_ns_total.load(Ordering::Relaxed);
        stats.stall_ns_max = self.stall_ns_max.load(Ordering::Relaxed);
        stats.stall_histogram =
            self.stall_histogram.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        stats.stall_timeouts = self.stall_timeouts.load(Ordering::Relaxed);
        stats.inline_fallbacks = self.inline_fallbacks.load(Ordering::Relaxed);
        (stats.pace_blocks_per_s, stats.throttled_writes, stats.throttle_ns_total) =
            self.pace.figures();
        stats
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// A cleaner for this engine with `config`, to run on a thread of its own
    /// ([`Cleaner::run`]). It holds one lane, and a queue of `config.queue_depth` writes on the
    /// backing store where the store has one (otherwise it writes synchronously).
    pub fn cleaner(&self, config: CleanerConfig) -> Result<Cleaner<'_, M, B, C>> {
        config.validate().map_err(Error::Config)?;
        if self.cleaner.running.load(Ordering::SeqCst) {
            return Err(Error::Config("a cleaner already runs on this cache".into()));
        }
        let lane = self.lane()?;
        // One write per buffer, and the flush of the batch before.
        let queue = self.backing.open_queue(config.queue_depth + 1).ok();
        *lock(&self.cleaner.config) = config.clone();
        self.cleaner.stop.store(false, Ordering::SeqCst);
        let block = self.layout.block_size as usize;
        let depth = config.queue_depth;
        Ok(Cleaner {
            lane,
            queue,
            queue_failures: 0,
            direct_done: Vec::with_capacity(depth),
            buffers: (0..depth).map(|_| Some(IoBuf::new(config.merge_blocks * block))).collect(),
            buffer_blocks: config.merge_blocks,
            runs: (0..depth).map(|_| Vec::with_capacity(config.merge_blocks)).collect(),
            run_first_lba: vec![0; depth],
            free_buffers: (0..depth).rev().collect(),
            completions: Vec::with_capacity(depth),
            candidates: Vec::with_capacity(CANDIDATES_MAX.min(self.layout.slot_count as usize)),
            refused: Vec::with_capacity(64),
            next_candidate: 0,
            scan_cursor: 0,
            resume_lba: 0,
            in_batch: HashSet::with_capacity(config.batch_blocks.min(1 << 16)),
            succeeded: Vec::with_capacity(config.batch_blocks.min(1 << 16)),
            failed: Vec::new(),
            syncing: None,
            syncing_lbas: HashSet::with_capacity(config.batch_blocks.min(1 << 16)),
            spare_blocks: Vec::with_capacity(config.batch_blocks.min(1 << 16)),
            rate_blocks_per_s: 0.0,
            rate_window_blocks: 0,
            rate_window_busy: Duration::ZERO,
            config,
        })
    }

    /// Asks a running cleaner to stop: [`Cleaner::run`] returns once its batch in flight is
    /// done. Writers that need slots write back inline again.
    pub fn stop_cleaner(&self) {
        self.cleaner.stop.store(true, Ordering::SeqCst);
        self.cleaner.running.store(false, Ordering::SeqCst);
        self.cleaner.wake();
        self.cleaner.advance_progress();
    }

    /// The cleaner's settings in force.
    pub fn cleaner_config(&self) -> CleanerConfig {
        lock(&self.cleaner.config).clone()
    }

    /// Changes cleaner settings (`key=value` pairs, all or none) while it runs.
    pub fn set_cleaner_settings<'a>(
        &self,
        pairs: impl IntoIterator<Item = &'a str>,
    ) -> Result<CleanerConfig> {
        let mut config = lock(&self.cleaner.config);
        config.set_all(pairs).map_err(Error::Config)?;
        let changed = config.clone();
        drop(config);
        self.cleaner.wake();
        Ok(changed)
    }

    /// Dirty slots now (the lanes' counters, summed as in [`Engine::stats`]).
    pub fn dirty_slots(&self) -> u64 {
        let delta = self
            .lanes
            .iter()
            .fold(0u64, |sum, l| sum.wrapping_add(l.counters.dirty_delta.load(Ordering::Relaxed)));
        (self.recovered_dirty.wrapping_add(delta) as i64).max(0) as u64
    }

    /// Paces a writer about to write the blocks `lbas` into the cache while dirty data is
    /// above the throttle threshold (`CleanerConfig::throttle_pct`; see `pace.rs`). Only the
    /// blocks that are not dirty already take turns: an overwrite of a dirty block leaves the
    /// cleaner no more to do, and a foreground that overwrites its dirty working set is not
    /// held to the backing store's rate. Looked up without locks, as a hint.
    pub(super) fn pace_writes(&self, lbas: impl Iterator<Item = u64>) {
        self.cleaner.pace.take(
            || lbas.filter(|&lba| !self.holds_dirty(lba)).count() as u64,
            || self.dirty_slots() as f64 / self.layout.slot_count.max(1) as f64,
        );
    }

    /// Whether the cache holds `lba` dirty now (a snapshot, without locks).
    fn holds_dirty(&self, lba: u64) -> bool {
        self.index.lookup(lba).is_some_and(|found| {
            !found.hidden && self.slots.load(found.slot).state() == SlotState::Dirty
        })
    }

    /// Blocks written so far, over all lanes (what tells the cleaner the foreground is busy).
    fn writes_total(&self) -> u64 {
        self.lanes.iter().map(|l| l.counters.writes.load(Ordering::Relaxed)).sum()
    }

    /// Whether a running cleaner takes stalled writers (it is not failing): otherwise a writer
    /// that needs a slot writes back inline (counted).
    pub(super) fn cleaner_takes_stalls(&self) -> bool {
        let shared = &self.cleaner;
        let takes = shared.running.load(Ordering::SeqCst) && !shared.failing.load(Ordering::SeqCst);
        if !takes && shared.running.load(Ordering::Relaxed) {
            shared.inline_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        takes
    }
}

/// A stalled writer's wait, from its first failed search for a slot to its end.
pub(super) struct Stall {
    started: Instant,
}

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Called by `reclaim` when no free or clean slot could be had and a cleaner takes stalls
    /// (`Engine::cleaner_takes_stalls`): waits for the cleaner to make progress. `Ok(true)`:
    /// look again; an error: the cleaner made no progress within
    /// `stall_timeout_ms` (a hung backing store), and the write fails, its data kept nowhere
    /// but the caller's buffer and every acknowledged block still dirty in the cache.
    pub(super) fn wait_for_cleaner(
        &mut self,
        stall: &mut Option<Stall>,
        seen: u64,
    ) -> Result<bool> {
        let shared = &self.engine.cleaner;
        let started = stall
            .get_or_insert_with(|| {
                shared.stalled_writers.fetch_add(1, Ordering::SeqCst);
                Stall { started: Instant::now() }
            })
            .started;
        shared.wake();
        shared.wait_progress(seen, Duration::from_millis(STALL_POLL_MS));
        let timeout_ms = lock(&shared.config).stall_timeout_ms;
        let waited = started.elapsed();
        if waited >= Duration::from_millis(timeout_ms) {
            shared.stall_timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(Error::CleanerStalled { waited_ms: waited.as_millis() as u64 });
        }
        Ok(true)
    }

    /// The progress epoch a stalled writer waits to see move.
    pub(super) fn cleaner_epoch(&self) -> u64 {
        self.engine.cleaner.progress_epoch()
    }

    /// Ends a stall (successful or not): counts it and its time.
    pub(super) fn end_stall(&self, stall: Option<Stall>) {
        if let Some(stall) = stall {
            let shared = &self.engine.cleaner;
            shared.stalled_writers.fetch_sub(1, Ordering::SeqCst);
            shared.record_stall(stall.started.elapsed().as_nanos() as u64);
        }
    }
}

/// Clears `CleanerShared::running` when dropped.
struct NotRunningOnExit<'a>(&'a CleanerShared);

impl Drop for NotRunningOnExit<'_> {
    fn drop(&mut self) {
        self.0.pace.off();
        self.0.running.store(false, Ordering::SeqCst);
        self.0.advance_progress();
    }
}

/// One block of a run in flight: its slot, the slot's word when copied, its entry.
type InFlight = (u32, SlotWord, SlotEntry);

/// What one batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Blocks copied and sent to the backing store.
    pub copied: u64,
    /// Blocks written back and marked clean.
    pub cleaned: u64,
    /// Backing writes issued.
    pub writes: u64,
    /// Blocks copied whose slot an overwrite replaced before the mark (they stay dirty).
    pub superseded: u64,
    /// Blocks whose write failed (they stay dirty, marked refused), or all of the batch's
    /// written blocks when its sync failed.
    pub failed: u64,
    /// Of `failed`, the blocks whose data could not be read from the cache (a checksum
    /// mismatch, a poisoned line).
    pub unreadable: u64,
    /// Dirty blocks were found to write back (false: nothing to do).
    pub found_dirty: bool,
}

/// The cleaner of one engine, run by [`Cleaner::run`] on its own thread (see the module docs).
pub struct Cleaner<'e, M: Medium, B: BackingStore, C: Clock> {
    lane: Lane<'e, M, B, C>,
    queue: Option<Box<dyn IoQueue>>,
    /// Reaps of `queue` in a row that failed as a whole.
    queue_failures: u32,
    /// Completions of writes made synchronously (a store without a queue).
    direct_done: Vec<IoCompletion>,
    /// One buffer per write in flight, `buffer_blocks` blocks each; `None` while in flight.
    buffers: Vec<Option<IoBuf>>,
    /// Blocks a buffer holds: `merge_blocks` when the cleaner was made (a later, larger
    /// setting merges no more than that).
    buffer_blocks: usize,
    /// The blocks of each buffer's run.
    runs: Vec<Vec<InFlight>>,
    run_first_lba: Vec<u64>,
    free_buffers: Vec<usize>,
    completions: Vec<IoCompletion>,
    /// The last scan's dirty blocks in write-back order, consumed from `next_candidate`.
    candidates: Vec<Candidate>,
    /// Dirty blocks whose write-back the backing store refused before, tried when the scan
    /// found nothing else.
    refused: Vec<Candidate>,
    next_candidate: usize,
    scan_cursor: u32,
    resume_lba: u64,
    in_batch: HashSet<u64>,
    succeeded: Vec<InFlight>,
    failed: Vec<InFlight>,
    /// The batch whose writes completed and whose flush is on its way.
    syncing: Option<SyncInFlight>,
    /// The block numbers of `syncing` (left out of the next batch).
    syncing_lbas: HashSet<u64>,
    /// An empty list kept for the next batch's blocks.
    spare_blocks: Vec<InFlight>,
    /// The write-back rate at full speed, blocks per second (0: not measured yet), and the
    /// blocks and busy time measured since it was last updated.
    rate_blocks_per_s: f64,
    rate_window_blocks: u64,
    rate_window_busy: Duration,
    config: CleanerConfig,
}

/// A batch written and being synced.
struct SyncInFlight {
    blocks: Vec<InFlight>,
    ticket: SyncTicket,
    /// The last sequence number issued before the flush (see `advance_synced_seq`).
    seq_sample: u64,
    /// The flush's outcome once it completed.
    result: Option<std::result::Result<(), pmcache_backing::BackingError>>,
}

impl<M: Medium, B: BackingStore, C: Clock> Cleaner<'_, M, B, C> {
    fn engine(&self) -> &Engine<M, B, C> {
        self.lane.engine
    }

    /// Runs until [`Engine::stop_cleaner`]. `on_start` is called first, on this thread, with
    /// why the thread's priority cannot be adapted, if it cannot (it then runs unboosted).
    /// Afterwards the cleaner can still [`Cleaner::drain`] the cache.
    pub fn run(&mut self, on_start: impl FnOnce(Option<&str>)) {
        let _unwind = AbortOnUnwind::new("Cleaner::run");
        let engine = self.lane.engine;
        let shared = &engine.cleaner;
        let mut priority = ThreadPriority::current_thread();
        let config = lock(&shared.config).clone();
        let note = if config.adaptive.boosts() {
            // Writers yielding (`nice_writers`) asks of their threads the way back from a
            // higher nice value: tried on a thread of its own, which a refusal leaves behind.
            priority
                .probe(config.nice_base, config.nice_boost)
                .and_then(|()| {
                    if config.nice_writers <= config.nice_base {
                        return Ok(());
                    }
                    std::thread::scope(|scope| {
                        scope
                            .spawn(|| {
                                ThreadPriority::current_thread()
                                    .probe(config.nice_base, config.nice_writers)
                            })
                            .join()
                            .unwrap_or_else(|_| Err("the priority probe panicked".into()))
                    })
                })
                .err()
        } else {
            priority.set(config.nice_base).err()
        };
        let can_boost = note.is_none();
        // Writers stop waiting for this cleaner however `run` ends, an unwinding panic too.
        let _not_running = NotRunningOnExit(shared);
        // Drains are asked of this loop until it ends (those still waiting then are answered).
        let _drains = shared.drains.serve();
        lock(&shared.status).priority_note = note.clone();
        on_start(note.as_deref());

        let mut controller = RateController::new();
        let mut tokens = 0.0f64;
        let mut last_step = Instant::now();
        let mut last_writes = engine.writes_total();
        let mut last_write_seen = Instant::now();
        let mut full_speed = false;
        let mut boosted_since: Option<Instant> = None;
        let mut failures_in_a_row = 0u32;
        while !shared.stop.load(Ordering::SeqCst) {
            if self.serve_drain_request() {
                continue;
            }
            let config = lock(&shared.config).clone();
            if config.order == WriteBackOrder::None {
                shared.running.store(false, Ordering::SeqCst);
                let levels = config.thresholds(engine.layout.slot_count);
                self.set_phase("off", RateTerms::default(), &config, levels);
                shared.pace.off();
                self.settle();
                shared.rest(Duration::from_millis(REST_MS));
                continue;
            }
            shared.running.store(true, Ordering::SeqCst);
            if config != self.config {
                if config.order != self.config.order {
                    self.candidates.clear();
                    self.next_candidate = 0;
                }
                controller.reset();
                self.config = config.clone();
            }
            let levels = config.thresholds(engine.layout.slot_count);
            let DirtyThresholds { target, high, low, idle_target } = levels;
            let dirty = engine.dirty_slots();
            let now = Instant::now();
            let writes = engine.writes_total();
            if writes != last_writes {
                last_writes = writes;
                last_write_seen = now;
            }
            let idle = now.duration_since(last_write_seen) >= Duration::from_millis(config.idle_ms);
            let stalled = shared.stalled_writers.load(Ordering::SeqCst) > 0;
            if dirty >= high || stalled {
                full_speed = true;
            } else if dirty < low {
                full_speed = false;
            }
            // Paper 002's adaptive priority: raised while writers stall or dirt is above the
            // high watermark, lowered below the low one.
            let boost = can_boost && config.adaptive.boosts() && full_speed;
            match (boost, boosted_since) {
                (true, None) if priority.set(config.nice_boost).is_ok() => {
                    boosted_since = Some(now);
                    lock(&shared.status).boosts += 1;
                }
                (false, Some(since)) if priority.set(config.nice_base).is_ok() => {
                    boosted_since = None;
                    lock(&shared.status).boosted_ns += since.elapsed().as_nanos() as u64;
                }
                _ => {}
            }
            lock(&shared.status).boosted = boosted_since.is_some();
            let yielding = boosted_since.is_some() && config.nice_writers > config.nice_base;
            shared.writer_nice.set(yielding.then_some(config.nice_writers));
            let dt_s = now.duration_since(last_step).as_secs_f64();
            last_step = now;
            let budget = if full_speed {
                self.set_phase("full", RateTerms::default(), &config, levels);
                Some(config.batch_blocks)
            } else if idle && dirty > idle_target {
                self.set_phase("idle", RateTerms::default(), &config, levels);
                Some(config.batch_blocks)
            } else if config.adaptive.controls_rate() && dirty > target {
                let terms = controller.update(
                    (dirty - target) as f64,
                    dt_s,
                    (config.kp, config.ki, config.kd),
                    config.rate_min,
                    config.rate_max,
                );
                self.set_phase("rate", terms, &config, levels);
                tokens = (tokens + terms.rate * dt_s).min(config.batch_blocks as f64);
                if tokens >= 1.0 {
                    Some(tokens as usize)
                } else {
                    let wait_s = (1.0 - tokens) / terms.rate;
                    self.settle();
                    shared.rest(Duration::from_secs_f64(wait_s.min(REST_MS as f64 / 1000.0)));
                    None
                }
            } else {
                controller.reset();
                tokens = 0.0;
                self.set_phase("resting", RateTerms::default(), &config, levels);
                self.settle();
                shared.rest(Duration::from_millis(REST_MS));
                None
            };
            self.set_pace(dirty, &config);
            let Some(budget) = budget else { continue };
            let started = Instant::now();
            let outcome = self.step(budget);
            if budget == config.batch_blocks {
                self.measure_rate(outcome.cleaned, started.elapsed());
            }
            tokens = (tokens - outcome.copied as f64).max(0.0);
            if outcome.failed > 0 && outcome.cleaned == 0 && self.syncing.is_none() {
                failures_in_a_row += 1;
                shared.failing.store(true, Ordering::SeqCst);
                lock(&shared.status).phase = "failing";
                // Writers fall back inline meanwhile; wake any waiting so they see it.
                shared.advance_progress();
                let backoff_ms = (10u64 << failures_in_a_row.min(7)).min(1000);
                self.settle();
                shared.rest(Duration::from_millis(backoff_ms));
            } else {
                if outcome.cleaned > 0 {
                    failures_in_a_row = 0;
                    shared.failing.store(false, Ordering::SeqCst);
                    engine.backing_succeeded(BackingOp::Write);
                }
                if outcome.copied == 0 {
                    // Nothing could be written back right now (every dirty block busy or just
                    // cleaned by someone else): look again shortly rather than spin.
                    self.settle();
                    shared.rest(Duration::from_millis(2));
                }
            }
        }
        self.settle();
        shared.running.store(false, Ordering::SeqCst);
        shared.writer_nice.set(None);
        if let Some(since) = boosted_since {
            let _ = priority.set(self.config.nice_base);
            lock(&shared.status).boosted_ns += since.elapsed().as_nanos() as u64;
        }
        let mut status = lock(&shared.status);
        status.boosted = false;
        status.phase = "stopped";
    }

    /// Folds a full-speed step (`cleaned` blocks in `busy`) into the write-back rate estimate:
    /// the first estimate from the first steps that cleaned anything (writers filling the
    /// cache are paced from then on, not only after a whole window), later ones each
    /// `RATE_WINDOW` of busy time.
    fn measure_rate(&mut self, cleaned: u64, busy: Duration) {
        self.rate_window_blocks += cleaned;
        self.rate_window_busy += busy;
        let first = self.rate_blocks_per_s == 0.0 && self.rate_window_blocks > 0;
        if first || self.rate_window_busy >= RATE_WINDOW {
            let now = self.rate_window_blocks as f64 / self.rate_window_busy.as_secs_f64();
            self.rate_blocks_per_s = if self.rate_blocks_per_s == 0.0 {
                now
            } else {
                0.5 * self.rate_blocks_per_s + 0.5 * now
            };
            self.rate_window_blocks = 0;
            self.rate_window_busy = Duration::ZERO;
        }
    }

    /// Sets the writers' pace (see `pace.rs`): from the throttle threshold (or the high
    /// watermark, if higher) at the measured write-back rate; not at all with `throttle_pct`
    /// 100 or before a rate is measured. Below the high watermark it is off, refreshes by the
    /// writers too (a write then reads one atomic, not the clock): pacing starts above it, and
    /// from the high watermark on the cleaner runs flat out, its steps, slow flushes included,
    /// being what writers refresh the pace across.
    fn set_pace(&self, dirty: u64, config: &CleanerConfig) {
        let pace = &self.lane.engine.cleaner.pace;
        let slots = self.lane.engine.layout.slot_count.max(1);
        let share = dirty as f64 / slots as f64;
        let below_high = share < f64::from(config.high_pct) / 100.0;
        if config.throttle_pct >= 100 || self.rate_blocks_per_s <= 0.0 || below_high {
            pace.off();
            return;
        }
        let start = f64::from(config.throttle_pct.max(config.high_pct)) / 100.0;
        pace.set(self.rate_blocks_per_s, start, share);
    }

    fn set_phase(
        &self,
        phase: &'static str,
        rate: RateTerms,
        config: &CleanerConfig,
        levels: DirtyThresholds,
    ) {
        let mut status = lock(&self.engine().cleaner.status);
        status.phase = phase;
        status.rate = rate;
        status.order = config.order.as_str();
        status.adaptive = config.adaptive.as_str();
        status.target_blocks = levels.target;
        status.high_blocks = levels.high;
        status.low_blocks = levels.low;
    }
}
