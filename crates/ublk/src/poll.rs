//! When a queue thread polls its ring and when it sleeps on it (`DeviceConfig::poll_idle`).
//!
//! A queue thread waits on its io_uring for the driver's requests. Sleeping there
//! (`to_wait` 1: `io_uring_enter` returns once a CQE is posted) costs a wake-up per request
//! when requests come one at a time. Polling (`to_wait` 0: `io_uring_enter` runs the ring's
//! pending completions, submits the queued commits and returns at once) keeps the thread on
//! its CPU instead: the next request is found without a wake-up, at the price of a CPU busy
//! for as long as the thread polls. [`PollPolicy`] decides which: it polls from the first
//! completion on, and goes back to sleeping once `idle` has passed without any, so an idle
//! device costs no CPU.
//!
//! Pure (the clock is passed in), so that it is tested without a kernel.

use std::time::{Duration, Instant};

/// Empty polls between two readings of the clock once the idle time is running: the budget
/// is overrun by at most this many polls, and the clock costs nothing on the busy path.
pub const CLOCK_EVERY: u32 = 32;

/// A queue thread's choice between polling its ring and sleeping on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollPolicy {
    /// How long the thread polls after the last completion before it sleeps; zero never
    /// polls.
    idle: Duration,
    /// When the idle time started: read at the first empty poll after a completion (`None`
    /// until then: the clock is not read while completions keep coming).
    last_activity: Option<Instant>,
    /// Empty polls since the clock was last read.
    empty_polls: u32,
    /// The next wait sleeps until a completion arrives.
    sleeping: bool,
}

impl PollPolicy {
    /// A policy polling for `idle` after each completion (zero: always sleeping). It starts
    /// sleeping: the first completion starts the polling.
    pub fn new(idle: Duration) -> Self {
        Self { idle, last_activity: None, empty_polls: 0, sleeping: true }
    }

    /// Whether this policy ever polls.
    pub fn polls(&self) -> bool {
        !self.idle.is_zero()
    }

    /// The `to_wait` of the next wait on the ring: 0 polls (returns at once), 1 sleeps until
    /// a completion arrives.
    pub fn to_wait(&self) -> usize {
        usize::from(self.sleeping)
    }

    /// Records a wait that handled `cqes` completions. `now` is called for the time only
    /// when it is needed: at the first empty poll after a completion, then every
    /// [`CLOCK_EVERY`] empty polls.
    pub fn saw(&mut self, cqes: usize, now: impl FnOnce() -> Instant) {
        if !self.polls() {
            return;
        }
        if cqes > 0 {
            self.sleeping = false;
            self.last_activity = None;
            self.empty_polls = 0;
            return;
        }
        if self.sleeping {
            // A sleeping wait that returned empty (a timeout): still idle.
            return;
        }
        let Some(since) = self.last_activity else {
            self.last_activity = Some(now());
            return;
        };
        self.empty_polls += 1;
        if self.empty_polls >= CLOCK_EVERY {
            self.empty_polls = 0;
            if now().saturating_duration_since(since) >= self.idle {
                self.sleeping = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    const IDLE: Duration = Duration::from_micros(1000);

    /// A clock that moves only when told, counting its readings.
    struct Clock {
        at: Cell<Instant>,
        reads: Cell<u32>,
    }

    impl Clock {
        fn new() -> Self {
            Self { at: Cell::new(Instant::now()), reads: Cell::new(0) }
        }
        fn advance(&self, by: Duration) {
            self.at.set(self.at.get() + by);
        }
        fn now(&self) -> impl FnOnce() -> Instant + '_ {
            || {
                self.reads.set(self.reads.get() + 1);
                self.at.get()
            }
        }
    }

    /// Empty polls until the policy sleeps (at most `limit`), the clock moving `step` at each.
    fn polls_until_sleeping(p: &mut PollPolicy, clock: &Clock, step: Duration, limit: u32) -> u32 {
        for n in 1..=limit {
            clock.advance(step);
            p.saw(0, clock.now());
            if p.to_wait() == 1 {
                return n;
            }
        }
        panic!("still polling after {limit} empty polls");
    }

    /// A new policy sleeps until the first completion, then polls.
    #[test]
    fn starts_sleeping_and_a_completion_starts_the_polling() {
        let clock = Clock::new();
        let mut p = PollPolicy::new(IDLE);
        assert!(p.polls());
        assert_eq!(p.to_wait(), 1);
        p.saw(0, clock.now());
        assert_eq!(p.to_wait(), 1, "an empty sleeping wait started the polling");
        p.saw(1, clock.now());
        assert_eq!(p.to_wait(), 0);
    }

    /// While completions keep coming (with empty polls between them shorter than the
    /// budget), the policy polls, and the clock is not read on the polls that found some.
    #[test]
    fn polls_while_requests_come() {
        let clock = Clock::new();
        let mut p = PollPolicy::new(IDLE);
        p.saw(1, clock.now());
        for _ in 0..1000 {
            p.saw(3, clock.now());
            assert_eq!(p.to_wait(), 0);
            // 100 empty polls of 5 µs between two requests: 500 µs, under the budget.
            for _ in 0..100 {
                clock.advance(Duration::from_micros(5));
                p.saw(0, clock.now());
                assert_eq!(p.to_wait(), 0);
            }
        }
        // One read at the first empty poll after each completion, and one per CLOCK_EVERY
        // empty polls after it.
        assert_eq!(clock.reads.get(), 1000 * (1 + 99 / CLOCK_EVERY));
    }

    /// After the budget without a completion the policy sleeps, within CLOCK_EVERY polls of
    /// the budget; it stays asleep through empty (timed-out) waits.
    #[test]
    fn sleeps_after_the_idle_budget() {
        let clock = Clock::new();
        let mut p = PollPolicy::new(IDLE);
        p.saw(2, clock.now());
        let step = Duration::from_micros(10);
        let n = polls_until_sleeping(&mut p, &clock, step, 10_000);
        // The idle time starts at the first empty poll: 100 more polls are the budget.
        assert!((101..=101 + CLOCK_EVERY).contains(&n), "slept after {n} empty polls");
        let reads = clock.reads.get();
        for _ in 0..100 {
            clock.advance(Duration::from_secs(20));
            p.saw(0, clock.now());
            assert_eq!(p.to_wait(), 1);
        }
        assert_eq!(clock.reads.get(), reads, "the clock was read while sleeping");
    }

    /// A completion after the policy went to sleep starts the polling again, with a fresh
    /// budget.
    #[test]
    fn a_completion_after_sleeping_resumes_polling() {
        let clock = Clock::new();
        let mut p = PollPolicy::new(IDLE);
        let step = Duration::from_micros(10);
        for _ in 0..3 {
            p.saw(1, clock.now());
            assert_eq!(p.to_wait(), 0);
            let n = polls_until_sleeping(&mut p, &clock, step, 10_000);
            assert!((101..=101 + CLOCK_EVERY).contains(&n), "slept after {n} empty polls");
            // Asleep for a long time, then a request.
            clock.advance(Duration::from_secs(60));
            p.saw(0, clock.now());
            assert_eq!(p.to_wait(), 1);
        }
    }

    /// A budget of zero never polls, whatever comes, and never reads the clock.
    #[test]
    fn a_zero_budget_never_polls() {
        let clock = Clock::new();
        let mut p = PollPolicy::new(Duration::ZERO);
        assert!(!p.polls());
        for cqes in [0, 1, 0, 0, 5, 0, 1, 1, 0] {
            p.saw(cqes, clock.now());
            assert_eq!(p.to_wait(), 1);
        }
        assert_eq!(clock.reads.get(), 0);
    }
}
