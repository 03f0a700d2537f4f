//! Backing-store I/O for pmcache.
//!
//! This crate owns *how* the cache talks to the slow device behind it. The engine only sees
//! [`BackingStore`]: a synchronous, thread-safe block interface. Engines that keep many I/Os in
//! flight (io_uring, libaio) implement it too, by submitting and reaping on the calling thread.
//!
//! Assumptions: offsets and lengths are in bytes; callers may pass buffers of any alignment
//! (an `O_DIRECT` engine bounces through an aligned buffer when it must).
//!
//! Layout: `file` owns the open file and everything that does not depend on how I/O is
//! issued; one module per engine (`psync`, `libaio`, `uring`) issues it; `queue` is the
//! batched interface ([`IoQueue`]: many I/Os in flight, buffers owned until completion);
//! `select` turns `--engine` into an open store ([`open_backing`]); [`wrappers`] adds latency,
//! throttling and faults for tests.
//! `unsafe` (system calls, io_uring submission, aligned allocation) stays in this crate.

mod buf;
mod error;
mod file;
mod libaio;
mod pool;
mod psync;
mod queue;
mod select;
mod uring;
pub mod wrappers;

pub use buf::{IO_BUF_ALIGN_BYTES, IoBuf};
pub use error::{BackingError, Result};
pub use libaio::LibaioFile;
pub use psync::{PsyncFile, Pvsync2File};
pub use queue::{IoCompletion, IoOp, IoQueue, IoRequest, SyncQueue};
pub use select::{
    DeviceKind, EngineKind, EngineOptions, ResolvedEngine, open_backing, resolve_engine,
};
pub use uring::{UringFile, UringMode};

/// Ends the process on a broken invariant met while the kernel may still own buffers (an
/// io_uring or AIO request in flight). A panic would unwind: it would free those buffers
/// under the kernel's DMA, and hand a ring or context with the request still in it back to
/// its pool, where the next caller would take the stale completion for its own.
#[cold]
pub(crate) fn abort_with_io_in_flight(what: std::fmt::Arguments<'_>) -> ! {
    eprintln!("pmcache: {what}, with I/O in flight: aborting");
    std::process::abort()
}

/// What identifies a backing store, so a cache is never attached to the wrong one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackingIdentity {
    /// Size of the store in bytes.
    pub size_bytes: u64,
    /// A fingerprint of where the store lives (for a file: a hash of its canonical path).
    pub fingerprint: [u8; 16],
}

/// The block interface the cache engine drives. All methods may be called from many threads.
pub trait BackingStore: Send + Sync {
    /// Size in bytes.
    fn size_bytes(&self) -> u64;
    /// The smallest I/O unit the store accepts, in bytes (512 or 4096 for `O_DIRECT`).
    fn logical_block_size(&self) -> u32;
    /// The identity recorded in a cache's superblock.
    fn identity(&self) -> BackingIdentity;
    /// Reads exactly `buf.len()` bytes at `offset`, completing short reads.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Writes exactly `data.len()` bytes at `offset`, completing short writes.
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()>;
    /// Makes every completed write durable (fdatasync).
    fn flush(&self) -> Result<()>;
    /// Discards a range: afterwards it reads as zeroes on a file, or unspecified on a device.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// Writes zeroes over a range.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()>;

    /// The engine's name as `--engine` spells it (`psync`, `io_uring-iopoll`, ...).
    fn engine_name(&self) -> &'static str {
        "custom"
    }
    /// Whether the store bypasses the page cache (`O_DIRECT`).
    fn is_direct(&self) -> bool {
        false
    }
    /// Opens a queue of `depth` requests for the calling thread (see [`IoQueue`]). Stores
    /// without a native queue refuse; [`SyncQueue`] runs a queue over any store.
    fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
        let _ = depth;
        Err(BackingError::Unsupported {
            engine: self.engine_name(),
            option: "queue",
            reason: "this store has no native queue; wrap it in a SyncQueue".into(),
        })
    }
}

impl<T: BackingStore + ?Sized> BackingStore for std::sync::Arc<T> {
    fn size_bytes(&self) -> u64 {
        (**self).size_bytes()
    }
    fn logical_block_size(&self) -> u32 {
        (**self).logical_block_size()
    }
    fn identity(&self) -> BackingIdentity {
        (**self).identity()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        (**self).read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        (**self).write_at(data, offset)
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        (**self).discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        (**self).write_zeroes(offset, len)
    }
    fn engine_name(&self) -> &'static str {
        (**self).engine_name()
    }
    fn is_direct(&self) -> bool {
        (**self).is_direct()
    }
    fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
        (**self).open_queue(depth)
    }
}
