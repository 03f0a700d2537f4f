//! A throughput and IOPS throttle: requests are spaced so neither limit is exceeded.
//!
//! Each read or write reserves the next free interval on a shared schedule
//! (`max(1 / iops, bytes / bytes_per_sec)` long) and waits for its start, so the limits hold
//! over any window, across threads, with no burst allowance.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wait_until;
use crate::{BackingStore, Result};

/// A store limited to `iops` requests and `bytes_per_sec` bytes per second.
#[derive(Debug)]
pub struct ThrottleStore<S> {
    inner: S,
    iops: Option<u64>,
    bytes_per_sec: Option<u64>,
    next_free: Mutex<Option<Instant>>,
}

impl<S: BackingStore> ThrottleStore<S> {
    /// Limits `inner` to at most `iops` reads+writes per second and `bytes_per_sec` bytes
    /// per second (`None` = no limit).
    pub fn new(inner: S, iops: Option<u64>, bytes_per_sec: Option<u64>) -> Self {
        assert!(iops != Some(0) && bytes_per_sec != Some(0), "a throttle limit of 0 never admits");
        Self { inner, iops, bytes_per_sec, next_free: Mutex::new(None) }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn admit(&self, bytes: usize) {
        let per_op_ns = self.iops.map_or(0, |iops| 1_000_000_000 / iops);
        let per_bytes_ns = self
            .bytes_per_sec
            .map_or(0, |bps| (bytes as u128 * 1_000_000_000 / u128::from(bps)) as u64);
        let cost = Duration::from_nanos(per_op_ns.max(per_bytes_ns));
        let start = {
            let mut next = self.next_free.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let start = next.map_or(now, |n| n.max(now));
            *next = Some(start + cost);
            start
        };
        wait_until(start);
    }
}

impl<S: BackingStore> BackingStore for ThrottleStore<S> {
    crate::forward_to!(inner: size_bytes, logical_block_size, identity, flush, discard,
        write_zeroes, extent_at, engine_name, is_direct, failed_flush_loses_writes, release, claim,
        disclaim);
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.admit(buf.len());
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        self.admit(data.len());
        self.inner.write_at(data, offset)
    }
}
