//! Cache media for pmcache: where the cached bytes live and how they are made durable.
//!
//! A [`Medium`] is a byte-addressable mapping with libpmem-style persistence split in two:
//! [`Medium::flush`] writes cache lines back towards the persistence domain and
//! [`Medium::drain`] waits until every flush issued *by the calling thread* has completed (a
//! store fence). A store is durable only after a flush of its line followed by a drain on the
//! same thread — or, for the non-temporal stores some methods may use (`write_flush`,
//! `store_pair_flush`), after the drain alone. 8-byte aligned stores are failure-atomic;
//! nothing larger is.
//!
//! Two implementations:
//! - [`PmemFile`]: a mapped file of one of three kinds ([`MediumKind`]): DAX (MAP_SYNC) when
//!   the file system offers it; volatile, a plain shared mapping of a file on tmpfs, ramfs or
//!   hugetlbfs (a file in `/dev/shm` emulates PM: it survives a process crash, not a reboot);
//!   or, asked for with [`MediumSync::Msync`], any other file made durable by `msync` at every
//!   flush. Any other file is refused. The only cache-side `unsafe` in pmcache lives in this
//!   crate.
//! - [`CrashMedium`]: a test medium that keeps a volatile and a durable image at 8-byte
//!   granularity and can simulate a power cut at any persist point.
//!
//! [`DramTable`] is the engine's volatile counterpart: zeroed arrays of atomics in their own
//! anonymous mappings, aligned and advised for transparent huge pages.

pub mod barrier;
mod crash;
mod dram;
mod error;
mod kind;
mod mapped;
pub mod numa;
mod persist;
mod poison;
mod set;
mod window;

pub use crash::{CrashMedium, CrashSwitch};
pub use dram::{DramTable, ZeroValid};
pub use error::{MediaError, Result};
pub use kind::{FileSystem, MediumKind, MediumSync, fs_type_of_device, probe_kind};
pub use mapped::{MediumOptions, MsyncCounts, PmemFile};
pub use persist::{
    Crc32cInstruction, FlushInstruction, PersistPrimitives, prefetch, serialize_execution,
};
pub use poison::Poisoned;
pub use set::{MEMBERS_MAX, MediumSet, MemberSpan};
pub use window::Window;

/// Size of a CPU cache line, the unit of [`Medium::flush`].
pub const CACHE_LINE_BYTES: u64 = 64;

/// A byte-addressable, persistent (or persistence-emulating) medium.
///
/// Offsets are byte offsets from the start of the medium; an access past the end is a caller
/// bug and panics. Reads may race with writes to the same bytes by other threads: callers that
/// allow that (the engine's lock-free read path) validate what they copied afterwards.
pub trait Medium: Send + Sync {
    /// Length of the medium in bytes.
    fn len_bytes(&self) -> u64;
    /// The members of a medium made of several ([`MediumSet`]), in order: where each lies
    /// and its NUMA node. A plain medium is one member of unknown node.
    fn members(&self) -> Vec<MemberSpan> {
        vec![MemberSpan { range: 0..self.len_bytes(), node: None }]
    }
    /// Copies `buf.len()` bytes at `offset` into `buf`. The bytes must not be poisoned (see
    /// [`Medium::read_checked`]): on a PM device such a read is a machine check that ends the
    /// process.
    fn read(&self, offset: u64, buf: &mut [u8]);
    /// Copies like [`read`](Medium::read), or says the medium cannot return some of the bytes:
    /// a poisoned line (a PM device's uncorrectable error, reported as `SIGBUS`; see
    /// `poison.rs`). `buf` holds unspecified bytes after an error. The engine reads cached
    /// data with this.
    fn read_checked(&self, offset: u64, buf: &mut [u8]) -> std::result::Result<(), Poisoned> {
        self.read(offset, buf);
        Ok(())
    }
    /// The ranges of the medium known to be poisoned, in medium offsets: nothing placed there
    /// can be read back (or, on a mapped medium whose poisoned page was replaced, kept).
    fn poisoned_ranges(&self) -> Vec<std::ops::Range<u64>> {
        Vec::new()
    }
    /// How many ranges this medium has lost so far (see [`Medium::poisoned_ranges`]): a count
    /// that only grows, and grows *before* a range is lost. A thread that stored into the
    /// medium, then fenced, then finds this count where it was when every loss counted so far
    /// was accounted for, knows its stores did not go into a range lost meanwhile. The fence
    /// is a full one, or a compiler fence alone in a process registered for
    /// [`barrier::heavy_fence`]: a medium that loses a range then fences every thread with it
    /// between counting the loss and losing the range.
    fn losses(&self) -> u64 {
        0
    }
    /// Stores `data` at `offset` (not yet durable).
    fn write(&self, offset: u64, data: &[u8]);
    /// Atomically loads the 8-byte word at `offset` (8-byte aligned).
    fn load_u64(&self, offset: u64) -> u64;
    /// Atomically stores the 8-byte word at `offset` (8-byte aligned; not yet durable).
    fn store_u64(&self, offset: u64, value: u64);
    /// Atomically replaces the 8-byte word at `offset` (8-byte aligned) with `new` if it holds
    /// `current`, and says whether it did. A store like [`store_u64`](Medium::store_u64): not
    /// yet durable.
    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool;
    /// Starts writing back the cache lines covering `offset..offset + len`.
    fn flush(&self, offset: u64, len: u64);
    /// Waits until every flush issued by this thread is durable (a store fence).
    fn drain(&self);
    /// Flush then drain.
    fn persist(&self, offset: u64, len: u64) {
        self.flush(offset, len);
        self.drain();
    }
    /// Copies `data` to `offset` and starts making it durable: durable after this thread's
    /// next [`drain`](Medium::drain). Implementations may use non-temporal stores for whole,
    /// aligned blocks. Several of these followed by one drain is a group commit. The calling
    /// thread must not access these bytes again before that drain (Rust's rule for
    /// non-temporal stores); other threads' reads of them are racing reads (see above).
    fn write_flush(&self, offset: u64, data: &[u8]) {
        self.write(offset, data);
        self.flush(offset, data.len() as u64);
    }
    /// A hint that `offset..offset + len` will be read soon (starts loading its first cache
    /// lines; the hardware prefetcher follows a stream from there). No visible effect.
    fn prefetch(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }
    /// Copies `data` to `offset` and makes it durable before returning.
    fn write_persist(&self, offset: u64, data: &[u8]) {
        self.write_flush(offset, data);
        self.drain();
    }
    /// Stores the 16-byte pair at `offset` (16-byte aligned, so one cache line holds it):
    /// `word1` at `offset + 8` first, then `word0` at `offset` — each atomically, so a power
    /// cut between them can tear the pair only that way. Not yet durable. One bounds check
    /// for both words where the implementation can.
    fn store_pair(&self, offset: u64, word0: u64, word1: u64) {
        assert!(offset.is_multiple_of(16), "unaligned pair store at {offset}");
        self.store_u64(offset + 8, word1);
        self.store_u64(offset, word0);
    }
    /// Stores the 16-byte pair at `offset` (16-byte aligned) and starts its write-back:
    /// durable after this thread's next [`drain`](Medium::drain). Each word is stored
    /// atomically, but an implementation may use non-temporal stores, which reach the medium
    /// in either order: a power cut before the drain can leave either word without the other.
    /// The calling thread must drain before any store that publishes the pair (Rust's rule
    /// for non-temporal stores); other threads' loads of it before that drain are racing
    /// reads, which may see either word new without the other.
    fn store_pair_flush(&self, offset: u64, word0: u64, word1: u64) {
        self.store_pair(offset, word0, word1);
        self.flush(offset, 16);
    }
    /// A hint that a [`store_pair_flush`](Medium::store_pair_flush) to `offset` follows:
    /// starts loading the pair's line where that store needs it in the cache, and does nothing
    /// where the store bypasses the cache. No visible effect.
    fn prefetch_pair_store(&self, offset: u64) {
        self.prefetch(offset, 16);
    }
}

impl<M: Medium + ?Sized> Medium for std::sync::Arc<M> {
    fn len_bytes(&self) -> u64 {
        (**self).len_bytes()
    }
    fn members(&self) -> Vec<MemberSpan> {
        (**self).members()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) {
        (**self).read(offset, buf)
    }
    fn read_checked(&self, offset: u64, buf: &mut [u8]) -> std::result::Result<(), Poisoned> {
        (**self).read_checked(offset, buf)
    }
    fn poisoned_ranges(&self) -> Vec<std::ops::Range<u64>> {
        (**self).poisoned_ranges()
    }
    fn losses(&self) -> u64 {
        (**self).losses()
    }
    fn write(&self, offset: u64, data: &[u8]) {
        (**self).write(offset, data)
    }
    fn load_u64(&self, offset: u64) -> u64 {
        (**self).load_u64(offset)
    }
    fn store_u64(&self, offset: u64, value: u64) {
        (**self).store_u64(offset, value)
    }
    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        (**self).compare_exchange_u64(offset, current, new)
    }
    fn flush(&self, offset: u64, len: u64) {
        (**self).flush(offset, len)
    }
    fn drain(&self) {
        (**self).drain()
    }
    fn persist(&self, offset: u64, len: u64) {
        (**self).persist(offset, len)
    }
    fn write_flush(&self, offset: u64, data: &[u8]) {
        (**self).write_flush(offset, data)
    }
    fn prefetch(&self, offset: u64, len: u64) {
        (**self).prefetch(offset, len)
    }
    fn write_persist(&self, offset: u64, data: &[u8]) {
        (**self).write_persist(offset, data)
    }
    #[inline]
    fn store_pair(&self, offset: u64, word0: u64, word1: u64) {
        (**self).store_pair(offset, word0, word1)
    }
    #[inline]
    fn store_pair_flush(&self, offset: u64, word0: u64, word1: u64) {
        (**self).store_pair_flush(offset, word0, word1)
    }
    fn prefetch_pair_store(&self, offset: u64) {
        (**self).prefetch_pair_store(offset)
    }
}

/// Asserts that `offset..offset + len` lies inside a medium of `medium_len` bytes.
fn check_bounds(offset: u64, len: u64, medium_len: u64) {
    let end = offset.checked_add(len);
    assert!(
        end.is_some_and(|end| end <= medium_len),
        "medium access {offset}+{len} outside a medium of {medium_len} bytes"
    );
}
