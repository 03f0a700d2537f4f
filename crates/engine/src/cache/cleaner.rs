//! The cleaner: a background thread that writes dirty blocks back through the backing store's
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
//! `Stripe::cleaning`. Anyone else who writes that block's range of the backing store (an
//! inline write-back, a write-through or write-around) holds the stripe and waits for the
//! count to fall to zero first, so an older copy can never land after a newer one. The
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
use crate::sync::Condvar;
use crate::writeback::priority::ThreadPriority;
use crate::writeback::{
    Candidate, CleanerConfig, CleanerStats, DirtyThresholds, RateController, RateTerms,
    STALL_BUCKETS, WriteBackOrder, stall_bucket,
};

/// Most candidates one scan of the slot table collects (16 bytes each).
const CANDIDATES_MAX: usize = 1 << 16;
/// Longest the cleaner sleeps between looks at the dirty level when resting.
const REST_MS: u64 = 100;
/// How long a stalled writer waits for the cleaner's next batch before it looks again.
const STALL_POLL_MS: u64 = 20;
/// The `user_data` of the cleaner's flushes (its writes carry their buffer's index).
const FLUSH_TAG: u64 = u64::MAX;
/// Longest a paced writer waits for its turn (a debt beyond it is forgiven: stalls bound the
/// rest), in nanoseconds.
const PACE_WAIT_MAX_NS: u64 = 50_000_000;
/// Waits shorter than this are not slept (the sleep itself costs about as much): the debt
/// stays in the schedule and a later write waits for it.
const PACE_SLEEP_MIN_NS: u64 = 20_000;
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
    /// Writers' pacing (`CleanerConfig::throttle_pct`): nanoseconds of schedule per block
    /// written (0: writers are not paced), and the schedule's next free time, in nanoseconds
    /// since `pace_epoch`.
    pace_ns_per_block: AtomicU64,
    pace_next_ns: AtomicU64,
    pace_epoch: Instant,
    throttled_writes: AtomicU64,
    throttle_ns_total: AtomicU64,
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
            pace_ns_per_block: AtomicU64::new(0),
            pace_next_ns: AtomicU64::new(0),
            pace_epoch: Instant::now(),
            throttled_writes: AtomicU64::new(0),
            throttle_ns_total: AtomicU64::new(0),
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
            woken = self
                .wake_signal
                .wait_timeout(woken, timeout)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
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
            let _ = self.progress_signal.wait_timeout(ordered, timeout);
        }
    }

    fn record_stall(&self, ns: u64) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
        self.stall_ns_total.fetch_add(ns, Ordering::Relaxed);
        self.stall_ns_max.fetch_max(ns, Ordering::Relaxed);
        self.stall_histogram[stall_bucket(ns)].fetch_add(1, Ordering::Relaxed);
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
        let per_block = self.pace_ns_per_block.load(Ordering::Relaxed);
        stats.pace_blocks_per_s = if per_block == 0 { 0.0 } else { 1e9 / per_block as f64 };
        stats.throttled_writes = self.throttled_writes.load(Ordering::Relaxed);
        stats.throttle_ns_total = self.throttle_ns_total.load(Ordering::Relaxed);
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
        let block = self.geometry.block_size as usize;
        let depth = config.queue_depth;
        Ok(Cleaner {
            lane,
            queue,
            direct_done: Vec::with_capacity(depth),
            buffers: (0..depth).map(|_| Some(IoBuf::new(config.merge_blocks * block))).collect(),
            buffer_blocks: config.merge_blocks,
            runs: (0..depth).map(|_| Vec::with_capacity(config.merge_blocks)).collect(),
            run_first_lba: vec![0; depth],
            free_buffers: (0..depth).rev().collect(),
            completions: Vec::with_capacity(depth),
            candidates: Vec::with_capacity(CANDIDATES_MAX.min(self.geometry.slot_count as usize)),
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

    /// Paces a writer about to write `blocks` blocks into the cache while dirty data is above
    /// the throttle threshold (`CleanerConfig::throttle_pct`): takes the next `blocks` turns of
    /// a schedule spaced at the pace the cleaner set, and sleeps until the first. One relaxed
    /// load when writers are not paced.
    pub(super) fn pace_writes(&self, blocks: u64) {
        let shared = &self.cleaner;
        let per_block = shared.pace_ns_per_block.load(Ordering::Relaxed);
        if per_block == 0 {
            return;
        }
        let cost = per_block.saturating_mul(blocks);
        let now = shared.pace_epoch.elapsed().as_nanos() as u64;
        let mut next = shared.pace_next_ns.load(Ordering::Relaxed);
        let start = loop {
            let start = next.clamp(now, now + PACE_WAIT_MAX_NS);
            match shared.pace_next_ns.compare_exchange_weak(
                next,
                start + cost,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break start,
                Err(seen) => next = seen,
            }
        };
        let wait_ns = start - now;
        if wait_ns >= PACE_SLEEP_MIN_NS {
            std::thread::sleep(Duration::from_nanos(wait_ns));
            shared.throttled_writes.fetch_add(1, Ordering::Relaxed);
            shared.throttle_ns_total.fetch_add(wait_ns, Ordering::Relaxed);
        }
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

    /// Waits, holding `stripe`, until no cleaner write of its blocks is in flight, before the
    /// caller writes one of its blocks to the backing store: an older copy must not land
    /// after the caller's.
    pub(super) fn wait_cleaner_writes(&self, stripe: usize) {
        let mut spins = 0u32;
        while self.stripes[stripe].cleaning.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 64 {
                crate::sync::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
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
        self.0.pace_ns_per_block.store(0, Ordering::SeqCst);
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
    /// Dirty blocks were found to write back (false: nothing to do).
    pub found_dirty: bool,
}

/// The cleaner of one engine, run by [`Cleaner::run`] on its own thread (see the module docs).
pub struct Cleaner<'e, M: Medium, B: BackingStore, C: Clock> {
    lane: Lane<'e, M, B, C>,
    queue: Option<Box<dyn IoQueue>>,
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
        let engine = self.lane.engine;
        let shared = &engine.cleaner;
        let mut priority = ThreadPriority::current_thread();
        let config = lock(&shared.config).clone();
        let note = if config.adaptive.boosts() {
            priority.probe(config.nice_base, config.nice_boost).err()
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
                let levels = config.thresholds(engine.geometry.slot_count);
                self.set_phase("off", RateTerms::default(), &config, levels);
                shared.pace_ns_per_block.store(0, Ordering::SeqCst);
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
            let levels = config.thresholds(engine.geometry.slot_count);
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
        if let Some(since) = boosted_since {
            let _ = priority.set(self.config.nice_base);
            lock(&shared.status).boosted_ns += since.elapsed().as_nanos() as u64;
        }
        let mut status = lock(&shared.status);
        status.boosted = false;
        status.phase = "stopped";
    }

    /// Folds a full-speed step (`cleaned` blocks in `busy`) into the write-back rate estimate.
    fn measure_rate(&mut self, cleaned: u64, busy: Duration) {
        self.rate_window_blocks += cleaned;
        self.rate_window_busy += busy;
        if self.rate_window_busy >= RATE_WINDOW {
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

    /// Sets the writers' pace from the dirty share: none below the throttle threshold; above
    /// it, the measured write-back rate scaled down linearly to a twentieth of it at 100 %.
    fn set_pace(&self, dirty: u64, config: &CleanerConfig) {
        let shared = &self.lane.engine.cleaner;
        let slots = self.lane.engine.geometry.slot_count.max(1);
        let start = f64::from(config.throttle_pct.max(config.high_pct)) / 100.0;
        let share = dirty as f64 / slots as f64;
        let paced = config.throttle_pct < 100 && share >= start && self.rate_blocks_per_s > 0.0;
        let per_block = if paced {
            let scale = ((1.0 - share) / (1.0 - start).max(1e-6)).clamp(0.05, 1.0);
            (1e9 / (self.rate_blocks_per_s * scale)).max(1.0) as u64
        } else {
            0
        };
        shared.pace_ns_per_block.store(per_block, Ordering::Relaxed);
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

    /// Writes back every dirty block it can, batch after batch at full speed, and returns the
    /// blocks cleaned; stops at a batch that cleans nothing (the first error then, if any).
    /// Like every batch, it must run on the thread that first used the cleaner's queue (an
    /// io_uring queue refuses other threads): before `run`, or on `run`'s thread.
    pub fn drain(&mut self) -> Result<u64> {
        let mut cleaned = 0;
        loop {
            let outcome = self.step(self.config.batch_blocks);
            cleaned += outcome.cleaned;
            if outcome.cleaned == 0 && self.syncing.is_none() {
                if outcome.failed > 0 {
                    return Err(Error::WriteBackIncomplete { failed: outcome.failed, cleaned });
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
        let mut outcome = self.step(max_blocks);
        let settled = self.settle();
        outcome.cleaned += settled.cleaned;
        outcome.superseded += settled.superseded;
        outcome.failed += settled.failed;
        outcome
    }

    /// Completes the batch still syncing, if one is: waits for its flush and marks it clean.
    pub fn settle(&mut self) -> BatchOutcome {
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
    fn step(&mut self, max_blocks: usize) -> BatchOutcome {
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
        let block = u64::from(engine.geometry.block_size);
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
            let Ok(guard) = engine.stripes[stripe].lock.try_lock() else { continue };
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
            engine.medium.read(
                engine.geometry.data_offset(candidate.slot),
                &mut buffer[at..at + block as usize],
            );
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
                let len = self.buffer_blocks * self.lane.engine.geometry.block_size as usize;
                self.buffers[run].as_mut().expect("a free buffer is here").set_len(len);
                return run;
            }
            self.reap(1, outcome);
        }
    }

    /// Sends run `run`'s buffer to the backing store.
    fn issue(&mut self, run: usize, outcome: &mut BatchOutcome) {
        let engine = self.lane.engine;
        let block = engine.geometry.block_size as usize;
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
                    // unknown, so wait them out request by request on later calls; nothing
                    // in flight is counted as written.
                    engine.backing_failed(e);
                    std::thread::sleep(Duration::from_millis(1));
                    return;
                }
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
                engine.backing_failed(e);
                outcome.failed += self.runs[run].len() as u64;
            }
            let mut buf = completion.buf;
            buf.set_len(0);
            self.buffers[run] = Some(buf);
            self.runs[run].clear();
            self.free_buffers.push(run);
        }
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

/// Batches in a row a requested drain lets clean nothing without an error (every dirty block
/// busy under a writer's stripe, or overwritten while it was copied) before it ends, 1 ms
/// apart.
const DRAIN_FRUITLESS_MAX: u32 = 1000;
/// A requested drain ends once it has written back this many times the cache's slots: writers
/// that keep dirtying blocks as fast as they are cleaned would otherwise hold it forever.
const DRAIN_SLOTS_FACTOR: u64 = 4;

/// How a requested drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DrainAnswer {
    /// No dirty block was left, or none could be written back for a while without an error
    /// (writers keep them busy).
    Drained { cleaned: u64 },
    /// A batch cleaned nothing because the backing store refused writes or its sync failed.
    Failed { failed: u64, cleaned: u64 },
    /// The cleaner was stopped first (or its run ended before it got to the request).
    Stopped,
}

/// Drains asked of a running cleaner ([`Engine::request_drain`]), served by its run loop on
/// its own thread (whose queue only that thread may use) and answered through a condition
/// variable. Requests are numbered; one drain answers every request made before it started.
pub(crate) struct DrainRequests {
    state: Mutex<DrainState>,
    answered: Condvar,
}

#[derive(Default)]
struct DrainState {
    /// A run loop takes requests.
    serving: bool,
    /// The number of the last request made.
    asked: u64,
    /// Every request up to this number has its answer.
    answered: u64,
    /// The answer to the requests up to `answered`.
    last: Option<DrainAnswer>,
}

impl DrainRequests {
    fn new() -> Self {
        Self { state: Mutex::new(DrainState::default()), answered: Condvar::new() }
    }

    /// Starts taking requests; the guard stops that and answers the requests left when the
    /// run loop ends (an unwinding panic too).
    fn serve(&self) -> StopServingDrains<'_> {
        lock(&self.state).serving = true;
        StopServingDrains(self)
    }

    /// The number of the newest request not answered yet, taken for a drain.
    fn take(&self) -> Option<u64> {
        let state = lock(&self.state);
        (state.asked > state.answered).then_some(state.asked)
    }

    fn answer(&self, upto: u64, answer: DrainAnswer) {
        let mut state = lock(&self.state);
        if upto > state.answered {
            state.answered = upto;
            state.last = Some(answer);
        }
        drop(state);
        self.answered.notify_all();
    }
}

/// Ends a run loop's service of drain requests when dropped.
struct StopServingDrains<'a>(&'a DrainRequests);

impl Drop for StopServingDrains<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.0.state);
        state.serving = false;
        if state.asked > state.answered {
            state.answered = state.asked;
            state.last = Some(DrainAnswer::Stopped);
        }
        drop(state);
        self.0.answered.notify_all();
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Asks the running cleaner to write back every dirty block, at full speed, on its own
    /// thread and through its queue: its run loop takes the request between two batches and
    /// cleans batch after batch until no dirty block is left or a batch cleans nothing. Returns
    /// the request's number, to wait on with [`Engine::drain_outcome`]; `None` when no cleaner
    /// takes requests (none runs, it was stopped, or its order is `none`): the caller then
    /// writes back through a lane of its own ([`Lane::drain`]).
    pub fn request_drain(&self) -> Option<u64> {
        let shared = &self.cleaner;
        let mut state = lock(&shared.drains.state);
        if !state.serving
            || shared.stop.load(Ordering::SeqCst)
            || lock(&shared.config).order == WriteBackOrder::None
        {
            return None;
        }
        state.asked += 1;
        let ticket = state.asked;
        drop(state);
        shared.wake();
        Some(ticket)
    }

    /// Waits up to `timeout` for the drain asked for as `ticket` ([`Engine::request_drain`]):
    /// `None` while it runs; `Some(Ok(cleaned))` once no dirty block is left (or none could be
    /// written back for a second without an error: writers keep them busy);
    /// `Some(Err(WriteBackIncomplete))` when the backing store refused blocks (they stay dirty);
    /// `Some(Err(ShutDown))` when the cleaner stopped before the drain was done.
    pub fn drain_outcome(&self, ticket: u64, timeout: Duration) -> Option<Result<u64>> {
        let drains = &self.cleaner.drains;
        let mut state = lock(&drains.state);
        if state.answered < ticket {
            state = drains
                .answered
                .wait_timeout(state, timeout)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
        if state.answered < ticket {
            return None;
        }
        Some(match state.last.unwrap_or(DrainAnswer::Stopped) {
            DrainAnswer::Drained { cleaned } => Ok(cleaned),
            DrainAnswer::Failed { failed, cleaned } => {
                Err(Error::WriteBackIncomplete { failed, cleaned })
            }
            DrainAnswer::Stopped => Err(Error::ShutDown),
        })
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Cleaner<'_, M, B, C> {
    /// Serves the drain requests made so far, if any (the run loop's hook, between batches):
    /// batches at full speed until no dirty block is left, a batch fails, the cleaner is
    /// stopped, or nothing could be cleaned for a while. Returns whether it served one.
    fn serve_drain_request(&mut self) -> bool {
        let engine = self.lane.engine;
        let shared = &engine.cleaner;
        let Some(upto) = shared.drains.take() else { return false };
        lock(&shared.status).phase = "draining";
        let slots = engine.geometry.slot_count;
        let mut cleaned = 0u64;
        let mut fruitless = 0u32;
        let answer = loop {
            if shared.stop.load(Ordering::SeqCst) {
                break DrainAnswer::Stopped;
            }
            if engine.dirty_slots() == 0 || cleaned >= DRAIN_SLOTS_FACTOR * slots {
                break DrainAnswer::Drained { cleaned };
            }
            let batch_blocks = lock(&shared.config).batch_blocks;
            let outcome = self.clean_batch(batch_blocks);
            cleaned += outcome.cleaned;
            if outcome.cleaned > 0 {
                fruitless = 0;
                shared.failing.store(false, Ordering::SeqCst);
                continue;
            }
            if outcome.failed > 0 {
                break DrainAnswer::Failed { failed: outcome.failed, cleaned };
            }
            // Nothing cleaned and no error: every block found was busy or replaced meanwhile,
            // or none was found while the count says some are dirty (blocks on their way to
            // being marked clean). Look again shortly; the count decides when it is done.
            fruitless += 1;
            if fruitless >= DRAIN_FRUITLESS_MAX {
                break DrainAnswer::Drained { cleaned };
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        shared.drains.answer(upto, answer);
        true
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod drain_request_tests {
    use std::sync::Arc;

    use crate::testing::model::{BLOCK, World, config, pattern};
    use crate::{AdmissionConfig, CacheMode, Engine, EvictionKind, ManualClock};

    use super::*;

    /// A cleaner that only works when asked: far from every watermark, never idle.
    fn asleep() -> CleanerConfig {
        CleanerConfig {
            target_pct: 99,
            high_pct: 100,
            low_pct: 99,
            idle_target_pct: 99,
            idle_ms: 3_600_000,
            queue_depth: 2,
            batch_blocks: 4,
            merge_blocks: 2,
            ..CleanerConfig::default()
        }
    }

    /// A drain asked of a running cleaner writes every dirty block back on the cleaner's
    /// thread and answers with the count; a failing backing store is answered with the
    /// blocks it refused (they stay dirty); a stopped cleaner takes no request, and one
    /// whose order is `none` neither.
    #[test]
    fn a_requested_drain_is_served_by_the_running_cleaner() {
        let world = World::fresh(41);
        let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
        let engine = Engine::format(
            world.medium.clone(),
            world.backing.clone(),
            Arc::new(ManualClock::default()),
            &cfg,
        )
        .expect("format");
        let block = BLOCK as u64;
        let write = |lbas: std::ops::Range<u64>, tag: u64| {
            let mut lane = engine.lane().expect("lane");
            for lba in lbas {
                lane.write(lba * block, &pattern(tag + lba, 0, block), false).expect("write");
            }
        };
        assert!(engine.request_drain().is_none(), "no cleaner runs yet");
        let mut cleaner = engine.cleaner(asleep()).expect("cleaner");
        std::thread::scope(|scope| {
            let running = scope.spawn(|| cleaner.run(|_| {}));
            let deadline = Instant::now() + Duration::from_secs(10);
            let ticket = loop {
                if let Some(ticket) = engine.request_drain() {
                    break ticket;
                }
                assert!(Instant::now() < deadline, "the cleaner takes no request");
                std::thread::sleep(Duration::from_millis(1));
            };
            // Asked before anything is dirty: answered at once with nothing cleaned.
            let wait = |ticket| loop {
                if let Some(outcome) = engine.drain_outcome(ticket, Duration::from_millis(50)) {
                    break outcome;
                }
                assert!(Instant::now() < deadline, "no answer");
            };
            assert_eq!(wait(ticket).expect("drained"), 0);
            write(0..12, 100);
            assert_eq!(engine.dirty_slots(), 12);
            let ticket = engine.request_drain().expect("taken");
            assert_eq!(wait(ticket).expect("drained"), 12);
            assert_eq!(engine.dirty_slots(), 0);
            let durable = world.backing.durable_contents();
            for lba in 0..12u64 {
                let at = lba as usize * BLOCK;
                assert_eq!(&durable[at..at + BLOCK], &pattern(100 + lba, 0, block)[..]);
            }

            write(0..6, 200);
            world.backing.fail_writes_in(3 * block..4 * block);
            let ticket = engine.request_drain().expect("taken");
            let err = wait(ticket).expect_err("block 3 refused");
            assert!(matches!(err, Error::WriteBackIncomplete { failed: 1, .. }), "{err}");
            assert_eq!(engine.dirty_slots(), 1);
            world.backing.heal();

            engine.set_cleaner_settings(["order=none"]).expect("order none");
            assert!(engine.request_drain().is_none(), "order none takes no request");
            engine.set_cleaner_settings(["order=lba"]).expect("order lba");
            let ticket = engine.request_drain().expect("taken");
            assert_eq!(wait(ticket).expect("drained"), 1);
            assert_eq!(engine.dirty_slots(), 0);

            engine.stop_cleaner();
            running.join().expect("cleaner thread");
        });
        assert!(engine.request_drain().is_none(), "a stopped cleaner takes no request");
        // The cleaner drains after its run too, on the thread that ran it.
        write(20..24, 300);
        assert_eq!(cleaner.drain().expect("drain"), 4);
        drop(cleaner);
        engine.audit().expect("audit");
    }
}
