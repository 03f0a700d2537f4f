//! A throughput and IOPS throttle: requests are spaced so neither limit is exceeded.
//!
//! Each read or write reserves the next free interval on a shared schedule
//! (`max(1 / iops, bytes / bytes_per_sec)` long) and waits for its start, so the limits hold
//! over any window, across threads, with no burst allowance.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wait_until;
use crate::{BackingIdentity, BackingStore, Result};

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
        self.admit(buf.len());
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        self.admit(data.len());
        self.inner.write_at(data, offset)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len)
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
    fn failed_flush_loses_writes(&self) -> bool {
        self.inner.failed_flush_loses_writes()
    }
    fn release(&self) -> Result<()> {
        self.inner.release()
    }
    fn claim(&self, cache_uuid: [u8; 16], takeover: bool) -> Result<()> {
        self.inner.claim(cache_uuid, takeover)
    }
    fn disclaim(&self) -> Result<()> {
        self.inner.disclaim()
    }
}
