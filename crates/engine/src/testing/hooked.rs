//! A backing store over a [`SimBacking`] with hooks: a test runs code of its own at the moment
//! the engine writes, zeroes, discards or flushes (before the operation reaches the device),
//! or holds writes at a gate (a hung device). What the engine's ordering rules are about —
//! an operation of one request landing while another is in flight — is staged with these.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use pmcache_backing::BackingStore;

use super::{SIM_SECTOR_BYTES, SimBacking};

/// A hook, called with the operation's offset in bytes.
pub type Hook = Box<dyn FnMut(u64) + Send>;

/// A [`SimBacking`] with hooks before each write, write-zeroes, discard and flush, and a gate
/// that holds writes.
pub struct HookedBacking {
    /// The device underneath.
    pub inner: SimBacking,
    held: Mutex<bool>,
    released: Condvar,
    /// Writes that reached the device.
    pub writes: AtomicUsize,
    /// Called before each write reaches the device (then the gate is waited for).
    pub before_write: Mutex<Option<Hook>>,
    /// Called before each write-zeroes reaches the device.
    pub before_write_zeroes: Mutex<Option<Hook>>,
    /// Called before each discard reaches the device.
    pub before_discard: Mutex<Option<Hook>>,
    /// Called before each flush reaches the device (with offset 0).
    pub before_flush: Mutex<Option<Hook>>,
    /// Called once each extent query has its answer, before the answer is returned.
    pub after_extent: Mutex<Option<Hook>>,
    /// With [`HookedBacking::with_holes`]: per sector, whether it is a hole (discarded since
    /// it was last written), as a file's punched range is.
    holes: Option<Mutex<Vec<bool>>>,
}

impl HookedBacking {
    /// No hooks, the gate open.
    pub fn new(inner: SimBacking) -> std::sync::Arc<Self> {
        Self::build(inner, false)
    }

    /// As [`HookedBacking::new`], over a device whose discards punch holes, as a file's do: a
    /// discarded sector reads as zeroes and `extent_at` reports it as a hole until it is
    /// written again. The discard, like any write, is durable only after a flush.
    pub fn with_holes(inner: SimBacking) -> std::sync::Arc<Self> {
        Self::build(inner, true)
    }

    fn build(inner: SimBacking, holes: bool) -> std::sync::Arc<Self> {
        let sectors = inner.size_bytes() as usize / SIM_SECTOR_BYTES;
        std::sync::Arc::new(Self {
            holes: holes.then(|| Mutex::new(vec![false; sectors])),
            inner,
            held: Mutex::new(false),
            released: Condvar::new(),
            writes: AtomicUsize::new(0),
            before_write: Mutex::new(None),
            before_write_zeroes: Mutex::new(None),
            before_discard: Mutex::new(None),
            before_flush: Mutex::new(None),
            after_extent: Mutex::new(None),
        })
    }

    /// Closes (`true`) or opens the gate that writes wait at.
    pub fn hold(&self, held: bool) {
        *self.held.lock().expect("poisoned") = held;
        self.released.notify_all();
    }

    /// Sets the hook before writes.
    pub fn on_write(&self, hook: impl FnMut(u64) + Send + 'static) {
        *self.before_write.lock().expect("poisoned") = Some(Box::new(hook));
    }

    /// Sets the hook before write-zeroes.
    pub fn on_write_zeroes(&self, hook: impl FnMut(u64) + Send + 'static) {
        *self.before_write_zeroes.lock().expect("poisoned") = Some(Box::new(hook));
    }

    /// Sets the hook before discards.
    pub fn on_discard(&self, hook: impl FnMut(u64) + Send + 'static) {
        *self.before_discard.lock().expect("poisoned") = Some(Box::new(hook));
    }

    /// Sets the hook before flushes.
    pub fn on_flush(&self, hook: impl FnMut(u64) + Send + 'static) {
        *self.before_flush.lock().expect("poisoned") = Some(Box::new(hook));
    }

    /// Sets the hook after extent queries (what the engine learns is then already old).
    pub fn on_extent(&self, hook: impl FnMut(u64) + Send + 'static) {
        *self.after_extent.lock().expect("poisoned") = Some(Box::new(hook));
    }

    /// Marks the sectors of `offset..offset + len` holes (or data).
    fn mark(&self, offset: u64, len: u64, hole: bool) {
        if let Some(holes) = &self.holes {
            let sector = SIM_SECTOR_BYTES as u64;
            let (first, end) = (offset / sector, (offset + len).div_ceil(sector));
            let mut holes = holes.lock().expect("poisoned");
            for at in first..end.min(holes.len() as u64) {
                holes[at as usize] = hole;
            }
        }
    }

    fn call(hook: &Mutex<Option<Hook>>, offset: u64) {
        // Taken out while it runs: a hook may make the engine call the same operation again
        // (from another thread), which then runs without it.
        let taken = hook.lock().expect("poisoned").take();
        if let Some(mut f) = taken {
            f(offset);
            let mut slot = hook.lock().expect("poisoned");
            if slot.is_none() {
                *slot = Some(f);
            }
        }
    }
}

impl BackingStore for HookedBacking {
    pmcache_backing::forward_to!(inner: size_bytes, logical_block_size, identity, read_at);
    fn write_at(&self, data: &[u8], offset: u64) -> pmcache_backing::Result<()> {
        HookedBacking::call(&self.before_write, offset);
        let mut held = self.held.lock().expect("poisoned");
        while *held {
            held = self.released.wait(held).expect("poisoned");
        }
        drop(held);
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.mark(offset, data.len() as u64, false);
        self.inner.write_at(data, offset)
    }
    fn flush(&self) -> pmcache_backing::Result<()> {
        HookedBacking::call(&self.before_flush, 0);
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        HookedBacking::call(&self.before_discard, offset);
        if self.holes.is_none() {
            return self.inner.discard(offset, len);
        }
        // A punched hole reads as zeroes; durable, like the write it is, after a flush.
        self.mark(offset, len, true);
        self.inner.write_zeroes(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        HookedBacking::call(&self.before_write_zeroes, offset);
        self.mark(offset, len, false);
        self.inner.write_zeroes(offset, len)
    }
    fn extent_at(&self, offset: u64, len: u64) -> pmcache_backing::Result<pmcache_backing::Extent> {
        let Some(holes) = &self.holes else {
            return Ok(pmcache_backing::Extent { len, hole: false });
        };
        let extent = {
            let holes = holes.lock().expect("poisoned");
            let sector = SIM_SECTOR_BYTES as u64;
            let hole_at = |at: u64| holes.get((at / sector) as usize).copied().unwrap_or(false);
            let hole = hole_at(offset);
            let mut end = offset;
            while end < offset + len && hole_at(end) == hole {
                end = (end / sector + 1) * sector;
            }
            pmcache_backing::Extent { len: end.min(offset + len) - offset, hole }
        };
        HookedBacking::call(&self.after_extent, offset);
        Ok(extent)
    }
}
