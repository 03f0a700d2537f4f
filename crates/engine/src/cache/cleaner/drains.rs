//! Drains asked of a running cleaner: the control socket's `flush` and `detach` write back
//! through the cleaner's queue, on its thread.

use super::*;

/// Batches in a row a requested drain lets clean nothing without an error (every dirty block
/// busy under a writer's stripe, or overwritten while it was copied) before it ends, 1 ms
/// apart: answered busy if blocks dirty at its start are left.
const DRAIN_FRUITLESS_MAX: u32 = 1000;
/// A requested drain ends once it has written back this many times the cache's slots: writers
/// that keep dirtying blocks as fast as they are cleaned would otherwise hold it forever.
const DRAIN_SLOTS_FACTOR: u64 = 4;

/// How a requested drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DrainAnswer {
    /// No block dirty when the drain started is dirty any more.
    Drained { cleaned: u64 },
    /// Blocks dirty when the drain started stayed busy (writes of them to the backing store
    /// in flight on lanes) while nothing could be cleaned for the drain's whole wait.
    Busy { dirty: u64, waited_ms: u64 },
    /// A batch cleaned nothing because the backing store refused writes or its sync failed.
    Failed { failed: u64, cleaned: u64, unreadable: u64 },
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
    pub(super) fn new() -> Self {
        Self { state: Mutex::new(DrainState::default()), answered: Condvar::new() }
    }

    /// Starts taking requests; the guard stops that and answers the requests left when the
    /// run loop ends (an unwinding panic too).
    pub(super) fn serve(&self) -> StopServingDrains<'_> {
        lock(&self.state).serving = true;
        StopServingDrains(self)
    }

    /// The number of the newest request not answered yet, taken for a drain.
    pub(super) fn take(&self) -> Option<u64> {
        let state = lock(&self.state);
        (state.asked > state.answered).then_some(state.asked)
    }

    pub(super) fn answer(&self, upto: u64, answer: DrainAnswer) {
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
pub(super) struct StopServingDrains<'a>(&'a DrainRequests);

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
    /// `None` while it runs; `Some(Ok(cleaned))` once no block dirty at the drain's start is
    /// dirty; `Some(Err(DrainBusy))` when such blocks stayed busy for a second while nothing
    /// could be cleaned (writes of them to the backing store in flight);
    /// `Some(Err(WriteBackIncomplete))` when the backing store refused blocks (they stay dirty);
    /// `Some(Err(ShutDown))` when the cleaner stopped before the drain was done.
    pub fn drain_outcome(&self, ticket: u64, timeout: Duration) -> Option<Result<u64>> {
        let drains = &self.cleaner.drains;
        let mut state = lock(&drains.state);
        if state.answered < ticket {
            state = wait_timeout(&drains.answered, state, timeout);
        }
        if state.answered < ticket {
            return None;
        }
        Some(match state.last.unwrap_or(DrainAnswer::Stopped) {
            DrainAnswer::Drained { cleaned } => Ok(cleaned),
            DrainAnswer::Busy { dirty, waited_ms } => Err(Error::DrainBusy { dirty, waited_ms }),
            DrainAnswer::Failed { failed, cleaned, unreadable } => {
                Err(Error::WriteBackIncomplete { failed, cleaned, unreadable })
            }
            DrainAnswer::Stopped => Err(Error::ShutDown),
        })
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Cleaner<'_, M, B, C> {
    /// Serves the drain requests made so far, if any (the run loop's hook, between batches):
    /// batches at full speed until no dirty block is left, a batch fails, the cleaner is
    /// stopped, or nothing could be cleaned for a while. Returns whether it served one.
    pub(super) fn serve_drain_request(&mut self) -> bool {
        let engine = self.lane.engine;
        let shared = &engine.cleaner;
        let Some(upto) = shared.drains.take() else { return false };
        lock(&shared.status).phase = "draining";
        // Every block dirty now has an entry no newer than this: the drain is done when none
        // of them is dirty; blocks writers dirty meanwhile are theirs, not the drain's.
        let started_seq = engine.last_issued_seq();
        let slots = engine.layout.slot_count;
        let mut cleaned = 0u64;
        let mut cleaned_since_check = 0u64;
        let mut fruitless = 0u32;
        let answer = loop {
            if shared.stop.load(Ordering::SeqCst) {
                break DrainAnswer::Stopped;
            }
            if engine.dirty_slots() == 0 {
                break DrainAnswer::Drained { cleaned };
            }
            if cleaned_since_check >= DRAIN_SLOTS_FACTOR * slots {
                // Writers keep dirtying blocks as fast as they are cleaned: done once none of
                // the drain's own is left (the sweep reaches them all), which a pass tells.
                if engine.dirty_slots_up_to(started_seq) == 0 {
                    break DrainAnswer::Drained { cleaned };
                }
                cleaned_since_check = 0;
            }
            let batch_blocks = lock(&shared.config).batch_blocks;
            let outcome = self.clean_batch(batch_blocks);
            cleaned += outcome.cleaned;
            cleaned_since_check += outcome.cleaned;
            if outcome.cleaned > 0 {
                fruitless = 0;
                shared.failing.store(false, Ordering::SeqCst);
                continue;
            }
            if outcome.failed > 0 {
                break DrainAnswer::Failed {
                    failed: outcome.failed,
                    cleaned,
                    unreadable: outcome.unreadable,
                };
            }
            // Nothing cleaned and no error: every block found was busy or replaced meanwhile,
            // or none was found while the count says some are dirty (blocks on their way to
            // being marked clean). Look again shortly; the count decides when it is done.
            fruitless += 1;
            if fruitless >= DRAIN_FRUITLESS_MAX {
                let dirty = engine.dirty_slots_up_to(started_seq);
                if dirty == 0 {
                    break DrainAnswer::Drained { cleaned };
                }
                let waited_ms = u64::from(fruitless);
                break DrainAnswer::Busy { dirty, waited_ms };
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
