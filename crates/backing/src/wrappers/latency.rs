//! Latency injection: each request takes at least a latency drawn from a distribution.
//!
//! The wrapper pads a request to the sampled latency (what the inner store took counts), so a
//! fast file behind it behaves like the emulated device rather than "fast file + delay".
//! Presets follow the device latency table of paper 000 (HDD, SATA SSD, NVMe SSD).
//!
//! Its queue ([`BackingStore::open_queue`]) keeps every request in flight for its own
//! latency, with no limit on how many overlap (a device of unbounded concurrency, as a network
//! store with deep queues is): each request runs on the inner store, and completes, once its
//! latency has passed since it was pushed — a queued write lands late, not at submit —
//! signalled by a timer descriptor a caller can poll (`IoQueue::completion_fd`).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};

use super::{OpMask, wait_until};
use crate::queue::{IoCompletion, IoOp, IoQueue, IoRequest};
use crate::{BackingError, BackingStore, Result};

/// Where a request's latency comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LatencyDist {
    /// Always this latency.
    Fixed(Duration),
    /// Uniform between two latencies (inclusive).
    Uniform {
        /// Shortest.
        min: Duration,
        /// Longest.
        max: Duration,
    },
    /// `min` plus an exponential tail with mean `mean_extra` (queueing-like behaviour).
    Exponential {
        /// Latency floor.
        min: Duration,
        /// Mean of the exponential part.
        mean_extra: Duration,
    },
}

impl LatencyDist {
    /// A 7200 rpm disk doing random I/O: seek plus rotation, 2-14 ms.
    pub fn hdd() -> Self {
        LatencyDist::Uniform { min: Duration::from_millis(2), max: Duration::from_millis(14) }
    }

    /// A SATA SSD: 90-300 µs (paper 000, Table 1).
    pub fn sata_ssd() -> Self {
        LatencyDist::Uniform { min: Duration::from_micros(90), max: Duration::from_micros(300) }
    }

    /// An NVMe SSD: 60-70 µs (paper 000, Table 1).
    pub fn nvme_ssd() -> Self {
        LatencyDist::Uniform { min: Duration::from_micros(60), max: Duration::from_micros(70) }
    }

    /// Parses a latency as an operator writes it: a fixed time (`2ms`, `500us`, `0.5 ms`,
    /// `100ns`, `1s`) or a preset (`hdd`, `sata-ssd`, `nvme-ssd`).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        match text {
            "hdd" => return Ok(LatencyDist::hdd()),
            "sata-ssd" => return Ok(LatencyDist::sata_ssd()),
            "nvme-ssd" => return Ok(LatencyDist::nvme_ssd()),
            _ => {}
        }
        let units = [("ns", 1e-9), ("us", 1e-6), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)];
        units
            .iter()
            .find_map(|(unit, scale)| {
                let number = text.strip_suffix(unit)?.trim().parse::<f64>().ok()?;
                let secs = number * scale;
                (0.0..=3600.0)
                    .contains(&secs)
                    .then(|| LatencyDist::Fixed(Duration::from_secs_f64(secs)))
            })
            .ok_or_else(|| {
                format!(
                    "{text:?} is not a latency of at most an hour (examples: 2ms, 500us, hdd, \
                     sata-ssd, nvme-ssd)"
                )
            })
    }

    /// The mean latency drawn.
    pub fn mean(&self) -> Duration {
        match *self {
            LatencyDist::Fixed(d) => d,
            LatencyDist::Uniform { min, max } => min + (max - min) / 2,
            LatencyDist::Exponential { min, mean_extra } => min + mean_extra,
        }
    }

    /// Draws one latency.
    pub fn sample(&self, rng: &mut impl Rng) -> Duration {
        match *self {
            LatencyDist::Fixed(d) => d,
            LatencyDist::Uniform { min, max } => {
                assert!(min <= max, "uniform latency: min {min:?} > max {max:?}");
                let span_ns = (max - min).as_nanos() as u64;
                min + Duration::from_nanos(rng.gen_range(0..=span_ns))
            }
            LatencyDist::Exponential { min, mean_extra } => {
                let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                min + mean_extra.mul_f64(-u.ln())
            }
        }
    }
}

/// A store whose requests take at least a sampled latency.
#[derive(Debug)]
pub struct LatencyStore<S> {
    inner: Arc<S>,
    dist: LatencyDist,
    ops: OpMask,
    rng: Mutex<SmallRng>,
    injected_ns_total: AtomicU64,
}

impl<S: BackingStore + 'static> LatencyStore<S> {
    /// Pads reads and writes of `inner` to latencies drawn from `dist` (seeded by `seed`).
    pub fn new(inner: S, dist: LatencyDist, seed: u64) -> Self {
        Self::with_ops(inner, dist, OpMask::DATA, seed)
    }

    /// Like [`LatencyStore::new`], for the operations in `ops`.
    pub fn with_ops(inner: S, dist: LatencyDist, ops: OpMask, seed: u64) -> Self {
        Self {
            inner: Arc::new(inner),
            dist,
            ops,
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            injected_ns_total: AtomicU64::new(0),
        }
    }

    /// Total time spent padding requests, in nanoseconds.
    pub fn injected_ns_total(&self) -> u64 {
        self.injected_ns_total.load(Ordering::Relaxed)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn timed<T>(&self, op: OpMask, f: impl FnOnce() -> T) -> T {
        if !self.ops.contains(op) {
            return f();
        }
        let target = self.dist.sample(&mut *self.rng.lock().unwrap_or_else(|e| e.into_inner()));
        let start = Instant::now();
        let out = f();
        let spent = start.elapsed();
        if spent < target {
            self.injected_ns_total.fetch_add((target - spent).as_nanos() as u64, Ordering::Relaxed);
            wait_until(start + target);
        }
        out
    }
}

impl<S: BackingStore + 'static> BackingStore for LatencyStore<S> {
    crate::forward_to!(inner: size_bytes, logical_block_size, identity, extent_at, engine_name,
        is_direct, failed_flush_loses_writes, release, claim, disclaim);
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.timed(OpMask::READ, || self.inner.read_at(buf, offset))
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        self.timed(OpMask::WRITE, || self.inner.write_at(data, offset))
    }
    fn flush(&self) -> Result<()> {
        self.timed(OpMask::FLUSH, || self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.timed(OpMask::DISCARD, || self.inner.discard(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.timed(OpMask::DISCARD, || self.inner.write_zeroes(offset, len))
    }
    fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
        let timer = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .map_err(|e| BackingError::setup_failed("latency", "queue", "a timer".into(), e.into()))?;
        let seed = self.rng.lock().unwrap_or_else(|e| e.into_inner()).r#gen();
        let inner: Arc<dyn BackingStore> = self.inner.clone();
        Ok(Box::new(LatencyQueue {
            inner,
            dist: self.dist,
            ops: self.ops,
            rng: SmallRng::seed_from_u64(seed),
            pushed: Vec::with_capacity(depth),
            held: Vec::with_capacity(depth),
            timer,
            depth,
        }))
    }
}

/// The wrapper's queue: each request is held for its latency and runs on the inner store
/// only then, when it completes. A write lands late, as on a network disk whose writes are
/// not visible until acknowledged: a read started meanwhile reads the old data, which is what
/// a cache beside a write in flight must cope with.
struct LatencyQueue {
    inner: Arc<dyn BackingStore>,
    dist: LatencyDist,
    ops: OpMask,
    rng: SmallRng,
    /// Pushed and not submitted yet, with when each is due.
    pushed: Vec<(Instant, IoRequest)>,
    /// Submitted: each runs once it is due.
    held: Vec<(Instant, IoRequest)>,
    /// Armed for the earliest held request.
    timer: OwnedFd,
    depth: usize,
}

impl LatencyQueue {
    fn op_mask(op: IoOp) -> OpMask {
        match op {
            IoOp::Read => OpMask::READ,
            IoOp::Write => OpMask::WRITE,
            IoOp::Flush => OpMask::FLUSH,
        }
    }

    /// Arms the timer for the earliest held request (disarms it when none is held); a re-arm
    /// also clears an expiry not yet read.
    fn arm(&self) -> Result<()> {
        let value = match self.held.iter().map(|(due, _)| *due).min() {
            None => Timespec { tv_sec: 0, tv_nsec: 0 },
            Some(due) => {
                let left =
                    due.saturating_duration_since(Instant::now()).max(Duration::from_nanos(1));
                Timespec { tv_sec: left.as_secs() as i64, tv_nsec: i64::from(left.subsec_nanos()) }
            }
        };
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        let spec = Itimerspec { it_interval: zero, it_value: value };
        timerfd_settime(&self.timer, TimerfdTimerFlags::empty(), &spec)
            .map(|_| ())
            .map_err(|e| BackingError::Io { op: "timer", offset: 0, len: 0, source: e.into() })
    }
}

impl IoQueue for LatencyQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.pushed.len() + self.held.len()
    }

    fn push(&mut self, req: IoRequest) -> std::result::Result<(), IoRequest> {
        if self.in_flight() == self.depth {
            return Err(req);
        }
        let latency = if self.ops.contains(Self::op_mask(req.op)) {
            self.dist.sample(&mut self.rng)
        } else {
            Duration::ZERO
        };
        self.pushed.push((Instant::now() + latency, req));
        Ok(())
    }

    fn submit(&mut self) -> Result<usize> {
        let n = self.pushed.len();
        self.held.append(&mut self.pushed);
        if n > 0 {
            self.arm()?;
        }
        Ok(n)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> Result<usize> {
        self.submit()?;
        let min = min.min(self.held.len());
        let mut got = 0;
        loop {
            let now = Instant::now();
            let mut at = 0;
            while at < self.held.len() {
                if self.held[at].0 <= now {
                    let (_, req) = self.held.swap_remove(at);
                    out.push(req.run_on(self.inner.as_ref()));
                    got += 1;
                } else {
                    at += 1;
                }
            }
            if got >= min {
                self.arm()?;
                return Ok(got);
            }
            if let Some(due) = self.held.iter().map(|(due, _)| *due).min() {
                wait_until(due);
            }
        }
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.timer.as_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_reads_times_and_presets_and_refuses_the_rest() {
        let fixed = |us: u64| Ok(LatencyDist::Fixed(Duration::from_micros(us)));
        assert_eq!(LatencyDist::parse("2ms"), fixed(2000));
        assert_eq!(LatencyDist::parse("500us"), fixed(500));
        assert_eq!(LatencyDist::parse("1.5 ms"), fixed(1500));
        assert_eq!(LatencyDist::parse("1s"), fixed(1_000_000));
        assert_eq!(LatencyDist::parse("hdd"), Ok(LatencyDist::hdd()));
        assert_eq!(LatencyDist::parse("nvme-ssd").map(|d| d.mean()), Ok(Duration::from_micros(65)));
        assert_eq!(
            LatencyDist::parse("sata-ssd").map(|d| d.mean()),
            Ok(Duration::from_micros(195))
        );
        assert_eq!(LatencyDist::hdd().mean(), Duration::from_millis(8));
        for bad in ["", "2", "fast", "-1ms", "2 hours", "NaNms", "2h", "7200s"] {
            let err = LatencyDist::parse(bad).expect_err(bad);
            assert!(err.contains("is not a latency"), "{bad}: {err}");
        }
    }
}
