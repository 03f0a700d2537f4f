//! Latency injection: each request takes at least a latency drawn from a distribution.
//!
//! The wrapper pads a request to the sampled latency (what the inner store took counts), so a
//! fast file behind it behaves like the emulated device rather than "fast file + delay".
//! Presets follow the device latency table of paper 000 (HDD, SATA SSD, NVMe SSD).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{OpMask, wait_until};
use crate::{BackingIdentity, BackingStore, Result};

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
    inner: S,
    dist: LatencyDist,
    ops: OpMask,
    rng: Mutex<SmallRng>,
    injected_ns_total: AtomicU64,
}

impl<S: BackingStore> LatencyStore<S> {
    /// Pads reads and writes of `inner` to latencies drawn from `dist` (seeded by `seed`).
    pub fn new(inner: S, dist: LatencyDist, seed: u64) -> Self {
        Self::with_ops(inner, dist, OpMask::DATA, seed)
    }

    /// Like [`LatencyStore::new`], for the operations in `ops`.
    pub fn with_ops(inner: S, dist: LatencyDist, ops: OpMask, seed: u64) -> Self {
        Self {
            inner,
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

impl<S: BackingStore> BackingStore for LatencyStore<S> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn identity(&self) -> BackingIdentity {
        self.inner.identity()
    }
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
    fn extent_at(&self, offset: u64, len: u64) -> Result<crate::Extent> {
        self.inner.extent_at(offset, len)
    }
    fn engine_name(&self) -> &'static str {
        self.inner.engine_name()
    }
    fn is_direct(&self) -> bool {
        self.inner.is_direct()
    }
}
