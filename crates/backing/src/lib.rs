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
//! `select` turns `--engine` into an open store ([`open_backing`]); [`rbd`] is a Ceph RBD image
//! through librbd (`rbd:POOL/IMAGE`); [`wrappers`] adds latency, throttling and faults for
//! tests.
//! `unsafe` (system calls, io_uring submission, aligned allocation) stays in this crate.

mod buf;
mod error;
mod file;
mod libaio;
mod pool;
mod psync;
mod queue;
pub mod rbd;
mod select;
mod uring;
pub mod wrappers;

pub use buf::{IO_BUF_ALIGN_BYTES, IoBuf};
pub use error::{BackingError, Result};
pub use libaio::LibaioFile;
pub use psync::{PsyncFile, Pvsync2File, bytes_fingerprint};
pub use queue::{IoCompletion, IoOp, IoQueue, IoRequest, SyncQueue};
pub use rbd::{RbdImage, RbdSpec};
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
    /// Which file that is: a regular file's inode number, so that another file moved or
    /// copied onto the same path is told apart; 0 where unknown (a block device, whose device
    /// number can change across boots, or a store that does not say).
    pub instance: u64,
}

/// A stretch of a backing store, as block status reports it (see
/// [`BackingStore::extent_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Its length in bytes (never 0 for a non-empty query).
    pub len: u64,
    /// A hole: it holds no space on the store and reads as zeroes. `false` means allocated,
    /// or not known.
    pub hole: bool,
}

/// Inside an `impl BackingStore for` a wrapper: the named methods passed to the store in the
/// wrapper's field (`inner`, or `0` for a tuple struct), unchanged, so that the wrapper writes
/// out only the calls it changes. Any method of [`BackingStore`] can be named.
///
/// ```
/// use pmcache_backing::{BackingStore, Result};
///
/// /// Counts the writes that reach the store it wraps.
/// struct Counting<S> {
///     inner: S,
///     writes: std::sync::atomic::AtomicU64,
/// }
///
/// impl<S: BackingStore> BackingStore for Counting<S> {
///     pmcache_backing::forward_to!(inner: size_bytes, logical_block_size, identity, read_at,
///         flush, discard, write_zeroes, engine_name, is_direct);
///     fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
///         self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///         self.inner.write_at(data, offset)
///     }
/// }
/// ```
#[macro_export]
macro_rules! forward_to {
    ($field:tt : $($method:ident),+ $(,)?) => {
        $( $crate::forward_to!(@one $field $method); )+
    };
    (@one $f:tt size_bytes) => {
        fn size_bytes(&self) -> u64 { self.$f.size_bytes() }
    };
    (@one $f:tt logical_block_size) => {
        fn logical_block_size(&self) -> u32 { self.$f.logical_block_size() }
    };
    (@one $f:tt identity) => {
        fn identity(&self) -> $crate::BackingIdentity { self.$f.identity() }
    };
    (@one $f:tt read_at) => {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> $crate::Result<()> {
            self.$f.read_at(buf, offset)
        }
    };
    (@one $f:tt write_at) => {
        fn write_at(&self, data: &[u8], offset: u64) -> $crate::Result<()> {
            self.$f.write_at(data, offset)
        }
    };
    (@one $f:tt flush) => {
        fn flush(&self) -> $crate::Result<()> { self.$f.flush() }
    };
    (@one $f:tt discard) => {
        fn discard(&self, offset: u64, len: u64) -> $crate::Result<()> {
            self.$f.discard(offset, len)
        }
    };
    (@one $f:tt write_zeroes) => {
        fn write_zeroes(&self, offset: u64, len: u64) -> $crate::Result<()> {
            self.$f.write_zeroes(offset, len)
        }
    };
    (@one $f:tt engine_name) => {
        fn engine_name(&self) -> &'static str { self.$f.engine_name() }
    };
    (@one $f:tt is_direct) => {
        fn is_direct(&self) -> bool { self.$f.is_direct() }
    };
    (@one $f:tt extent_at) => {
        fn extent_at(&self, offset: u64, len: u64) -> $crate::Result<$crate::Extent> {
            self.$f.extent_at(offset, len)
        }
    };
    (@one $f:tt failed_flush_loses_writes) => {
        fn failed_flush_loses_writes(&self) -> bool { self.$f.failed_flush_loses_writes() }
    };
    (@one $f:tt release) => {
        fn release(&self) -> $crate::Result<()> { self.$f.release() }
    };
    (@one $f:tt claim) => {
        fn claim(&self, cache_uuid: [u8; 16], takeover: bool) -> $crate::Result<()> {
            self.$f.claim(cache_uuid, takeover)
        }
    };
    (@one $f:tt disclaim) => {
        fn disclaim(&self) -> $crate::Result<()> { self.$f.disclaim() }
    };
    (@one $f:tt open_queue) => {
        fn open_queue(&self, depth: usize) -> $crate::Result<Box<dyn $crate::IoQueue>> {
            self.$f.open_queue(depth)
        }
    };
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
    /// The extent that starts at `offset`, at most `len` bytes long (`len` > 0): a hole or
    /// data. Files answer from `SEEK_DATA`/`SEEK_HOLE`; a store that cannot tell says data.
    fn extent_at(&self, offset: u64, len: u64) -> Result<Extent> {
        let _ = offset;
        Ok(Extent { len, hole: false })
    }
    /// Whether a failed [`BackingStore::flush`] may have lost writes that completed before it.
    /// For a file it may: Linux reports a write-back error to one `fdatasync` and drops the
    /// pages, so the engine trusts no later flush until it is attached again. A store whose
    /// writes are on the device when they complete (an RBD image without librbd's cache: each
    /// one acknowledged by its OSDs) says `false`, and a flush that failed — an OSD out of
    /// reach — is simply tried again.
    fn failed_flush_loses_writes(&self) -> bool {
        true
    }
    /// Lets go of what the store holds for its user once no more I/O will be issued (the
    /// cache is shut down): an RBD image's exclusive lock, so that another host may attach at
    /// once rather than after the cluster notices this one is gone. Default: nothing.
    fn release(&self) -> Result<()> {
        Ok(())
    }
    /// Records on the store that the cache `cache_uuid` (its superblock's uuid) is attached
    /// and may hold dirty blocks of it, before the cache writes anything to it. Refused when
    /// the store records another cache holding dirty blocks ([`BackingError::HeldByAnother`];
    /// `takeover` overrides that: the operator says the other is gone for good, and it is
    /// refused from then on), or when another cache took the store over from this one
    /// ([`BackingError::TakenOver`]). The same cache claiming again (its recovery) is not
    /// refused. Kept until [`BackingStore::disclaim`]: a cache that stops without it (a crash,
    /// or a stop with dirty blocks) keeps its claim. Default: nothing recorded (a store only
    /// one host reaches).
    fn claim(&self, cache_uuid: [u8; 16], takeover: bool) -> Result<()> {
        let _ = (cache_uuid, takeover);
        Ok(())
    }
    /// Drops this attachment's claim: the cache holds no dirty block of the store any more
    /// (written back and flushed), so another cache may attach without the takeover override.
    /// Default: nothing.
    fn disclaim(&self) -> Result<()> {
        Ok(())
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
    fn extent_at(&self, offset: u64, len: u64) -> Result<Extent> {
        (**self).extent_at(offset, len)
    }
    fn engine_name(&self) -> &'static str {
        (**self).engine_name()
    }
    fn is_direct(&self) -> bool {
        (**self).is_direct()
    }
    fn failed_flush_loses_writes(&self) -> bool {
        (**self).failed_flush_loses_writes()
    }
    fn release(&self) -> Result<()> {
        (**self).release()
    }
    fn claim(&self, cache_uuid: [u8; 16], takeover: bool) -> Result<()> {
        (**self).claim(cache_uuid, takeover)
    }
    fn disclaim(&self) -> Result<()> {
        (**self).disclaim()
    }
    fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
        (**self).open_queue(depth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that implements only what it must.
    struct Minimal;

    impl BackingStore for Minimal {
        fn size_bytes(&self) -> u64 {
            4096
        }
        fn logical_block_size(&self) -> u32 {
            512
        }
        fn identity(&self) -> BackingIdentity {
            BackingIdentity { size_bytes: 4096, fingerprint: [1; 16], instance: 0 }
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
            buf.fill(7);
            Ok(())
        }
        fn write_at(&self, _data: &[u8], _offset: u64) -> Result<()> {
            Ok(())
        }
        fn flush(&self) -> Result<()> {
            Ok(())
        }
        fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
            Ok(())
        }
        fn write_zeroes(&self, _offset: u64, _len: u64) -> Result<()> {
            Ok(())
        }
    }

    /// A store's defaults: named `custom`, buffered, no native queue (refused, pointing at
    /// `SyncQueue`); an `Arc` of it says the same.
    #[test]
    fn a_minimal_store_has_plain_defaults_also_behind_an_arc() {
        let stores: [Box<dyn BackingStore>; 2] =
            [Box::new(Minimal), Box::new(std::sync::Arc::new(Minimal))];
        for store in stores {
            assert_eq!(store.engine_name(), "custom");
            assert!(!store.is_direct());
            match store.open_queue(4).err().expect("no native queue") {
                BackingError::Unsupported { engine: "custom", option: "queue", reason } => {
                    assert!(reason.contains("SyncQueue"), "{reason}")
                }
                other => panic!("unexpected {other:?}"),
            }
            let mut buf = [0u8; 8];
            store.read_at(&mut buf, 0).expect("read");
            assert_eq!(buf, [7; 8]);
            assert_eq!(store.identity().fingerprint, [1; 16]);
        }
    }

    /// A `SyncQueue` holds at most its depth, runs its requests at submit (or reap), counts
    /// them in flight until reaped, and hands back each buffer with its result.
    #[test]
    fn a_sync_queue_runs_any_store_as_a_queue() {
        let mut queue = SyncQueue::new(std::sync::Arc::new(Minimal), 2);
        assert_eq!((queue.depth(), queue.in_flight()), (2, 0));
        queue.push(IoRequest::read(0, IoBuf::new(16), 1)).expect("room");
        queue.push(IoRequest::flush(2)).expect("room");
        let refused = queue.push(IoRequest::write(0, IoBuf::new(16), 3)).unwrap_err();
        assert_eq!(refused.user_data, 3, "the refused request comes back");
        assert_eq!(queue.submit().expect("submit"), 2);
        assert_eq!(queue.in_flight(), 2, "run, not yet reaped");
        let mut out = Vec::new();
        assert_eq!(queue.reap(1, &mut out).expect("reap"), 2);
        assert_eq!(queue.in_flight(), 0);
        assert_eq!(out[0].user_data, 1);
        assert_eq!((out[0].op.name(), &out[0].buf[..]), ("read", &[7u8; 16][..]));
        assert_eq!((out[1].user_data, out[1].op.name()), (2, "flush"));
        assert!(out.iter().all(|c| c.result.is_ok()));
        queue.push(IoRequest::write(0, IoBuf::new(16), 4)).expect("room again");
        out.clear();
        assert_eq!(queue.reap(1, &mut out).expect("reap submits"), 1);
        assert_eq!(out[0].op.name(), "write");
    }
}
