//! Which cache holds dirty blocks of an image, recorded on the image itself (its metadata), and
//! what a client that lost the image's exclusive lock may still do.
//!
//! - `pmcache.holder`: the cache attached to the image that may hold dirty blocks of it —
//!   `UUID host=HOST pid=PID since=UNIX_SECS`, the cache's superblock uuid first. Set by a
//!   claim before the cache writes anything; removed by a disclaim once the cache holds no
//!   dirty block (written back and flushed). A cache that stops without that (a crash, or a
//!   stop with dirty blocks on a persistent medium) keeps it.
//! - `pmcache.superseded`: the caches another one took over from, a line each:
//!   `OLD_UUID by NEW_UUID host=HOST at=UNIX_SECS` (the newest [`SUPERSEDED_KEPT`]). A cache
//!   named there never claims the image again: its dirty blocks are older than what the image
//!   took since.
//!
//! A claim is refused while another cache is the holder, unless the operator says it is gone
//! (`takeover`); the same cache claiming again is its recovery. An image that records either
//! key refuses writes (not reads, not flushes) until a claim succeeds, so a cache attached to
//! it writes nothing before it is known to be the holder.
//!
//! A client whose exclusive lock another one broke is fenced off by the cluster (blocklisted):
//! its requests fail with `ESHUTDOWN` (`EBLOCKLISTED`), or with `EROFS` once librbd knows it no
//! longer owns the lock. The first such answer to a write, discard, write-zeroes or flush
//! makes every later one fail at once with [`BackingError::LockLost`], logged once: the engine
//! keeps the blocks dirty.

use std::ffi::c_int;
use std::io;
use std::sync::atomic::Ordering;

use super::{Handle, cstring, errno};
use crate::{BackingError, Result};

/// The key naming the cache that may hold dirty blocks of the image.
pub const HOLDER_KEY: &str = "pmcache.holder";
/// The key listing the caches taken over (one line each).
pub const SUPERSEDED_KEY: &str = "pmcache.superseded";
/// How many taken-over caches `pmcache.superseded` keeps (the newest).
pub const SUPERSEDED_KEPT: usize = 64;

/// `uuid` as `8-4-4-4-12` lowercase hex digits.
pub fn uuid_text(uuid: [u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// The first word of a record line: the uuid it is about.
fn first_word(line: &str) -> &str {
    line.split_whitespace().next().unwrap_or("")
}

/// The line of `superseded` about cache `uuid`, if it was taken over.
pub(super) fn superseded_entry<'a>(superseded: &'a str, uuid: &str) -> Option<&'a str> {
    superseded.lines().find(|line| first_word(line) == uuid)
}

/// `superseded` with a line for `old` taken over by `new` added, keeping the newest
/// [`SUPERSEDED_KEPT`] lines.
pub(super) fn supersede(superseded: &str, old: &str, new_line: &str) -> String {
    let mut lines: Vec<&str> =
        superseded.lines().filter(|l| !l.is_empty() && first_word(l) != old).collect();
    lines.push(new_line);
    let skip = lines.len().saturating_sub(SUPERSEDED_KEPT);
    lines[skip..].join("\n")
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
}

fn now_unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Handle {
    /// The value of image metadata `key`, `None` when it is not set.
    pub(super) fn metadata_get(&self, key: &str) -> io::Result<Option<String>> {
        let k = cstring("metadata key", key)?;
        let mut buf = vec![0u8; 256];
        for _ in 0..4 {
            let mut len = buf.len();
            // SAFETY: open image; `k` is NUL-terminated; `buf` holds `len` bytes, and librbd
            // answers -ERANGE with the length it needs in `len` when they are too few.
            let ret = unsafe {
                (self.api.rbd_metadata_get)(
                    self.image,
                    k.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    &mut len,
                )
            };
            if ret == -libc::ENOENT {
                return Ok(None);
            }
            if ret == -libc::ERANGE {
                buf.resize(len.max(buf.len() * 2), 0);
                continue;
            }
            if ret < 0 {
                return Err(errno(ret.into()));
            }
            return Ok(Some(super::c_string(&buf)));
        }
        Err(io::Error::from_raw_os_error(libc::ERANGE))
    }

    /// Sets image metadata `key` to `value` (on the image's header object: durable when this
    /// returns).
    pub(super) fn metadata_set(&self, key: &str, value: &str) -> io::Result<()> {
        let k = cstring("metadata key", key)?;
        let v = cstring("metadata value", value)?;
        // SAFETY: open image; both strings are NUL-terminated (copied by librbd).
        let ret = unsafe { (self.api.rbd_metadata_set)(self.image, k.as_ptr(), v.as_ptr()) };
        if ret < 0 {
            return Err(errno(ret.into()));
        }
        Ok(())
    }

    /// Removes image metadata `key` (not set: nothing to do).
    pub(super) fn metadata_remove(&self, key: &str) -> io::Result<()> {
        let k = cstring("metadata key", key)?;
        // SAFETY: open image; `k` is NUL-terminated.
        let ret = unsafe { (self.api.rbd_metadata_remove)(self.image, k.as_ptr()) };
        if ret < 0 && ret != -libc::ENOENT {
            return Err(errno(ret.into()));
        }
        Ok(())
    }

    /// Whether this client owns the image's exclusive lock, as librbd knows it.
    fn is_lock_owner(&self) -> io::Result<bool> {
        let mut owner: c_int = 0;
        // SAFETY: open image; `owner` receives the answer.
        let ret = unsafe { (self.api.rbd_is_exclusive_lock_owner)(self.image, &mut owner) };
        if ret < 0 {
            return Err(errno(ret.into()));
        }
        Ok(owner != 0)
    }

    /// What a write, discard, write-zeroes or flush meets before librbd sees it: the lock lost
    /// before, or (not for a flush: it writes nothing) an image not claimed yet.
    pub(super) fn check_write(&self, op: &'static str) -> Result<()> {
        if self.lock_lost.load(Ordering::SeqCst) {
            return Err(self.lock_lost_error());
        }
        if op != "flush" && self.gated.load(Ordering::SeqCst) {
            let record = self.gate_record.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Err(BackingError::Unclaimed { op, store: self.name.clone(), record });
        }
        Ok(())
    }

    fn lock_lost_error(&self) -> BackingError {
        let why = self.lost_why.lock().unwrap_or_else(|e| e.into_inner()).clone();
        BackingError::LockLost { store: self.name.clone(), why }
    }

    /// The error for a write, discard, write-zeroes or flush librbd answered with `ret` (< 0):
    /// [`BackingError::LockLost`] when the answer shows this client lost the lock (from then on
    /// every such request fails with it), `other` otherwise.
    pub(super) fn write_failed(&self, ret: i64, other: BackingError) -> BackingError {
        let errno = (-ret) as i32;
        if errno != libc::ESHUTDOWN && errno != libc::EROFS {
            return other;
        }
        // ESHUTDOWN is EBLOCKLISTED: the cluster fenced this client off. EROFS on an image
        // opened for writing: librbd no longer owns the lock (asked, to be sure).
        let lost = errno == libc::ESHUTDOWN || !matches!(self.is_lock_owner(), Ok(true));
        if !lost {
            return other;
        }
        self.mark_lock_lost(format!("{other}"));
        self.lock_lost_error()
    }

    /// From now on nothing is written from this client; logged once.
    fn mark_lock_lost(&self, why: String) {
        let mut kept = self.lost_why.lock().unwrap_or_else(|e| e.into_inner());
        if self.lock_lost.swap(true, Ordering::SeqCst) {
            return;
        }
        *kept = why;
        // Not released at drop or by `release`: it is not this client's any more.
        self.locked.store(false, Ordering::SeqCst);
        tracing::error!(
            "backing store {}: the image's exclusive lock was lost ({}): another client broke it. \
             Nothing more is written to the image from this attachment; its dirty blocks stay \
             in the cache",
            self.name,
            *kept
        );
    }

    /// Reads the records at open: an image with either refuses writes until a claim.
    pub(super) fn gate_if_recorded(&self) -> io::Result<()> {
        let holder = self.metadata_get(HOLDER_KEY)?;
        let superseded = self.metadata_get(SUPERSEDED_KEY)?.filter(|s| !s.trim().is_empty());
        let record = match (holder, superseded) {
            (Some(holder), _) => format!("{HOLDER_KEY} = {holder}"),
            (None, Some(superseded)) => format!(
                "{SUPERSEDED_KEY}: {} cache(s) taken over",
                superseded.lines().filter(|l| !l.is_empty()).count()
            ),
            (None, None) => return Ok(()),
        };
        *self.gate_record.lock().unwrap_or_else(|e| e.into_inner()) = record;
        self.gated.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// See [`crate::BackingStore::claim`]; `image` names the image as Ceph's tools do.
    pub(super) fn claim(&self, image: &str, cache_uuid: [u8; 16], takeover: bool) -> Result<()> {
        if self.lock_lost.load(Ordering::SeqCst) {
            return Err(self.lock_lost_error());
        }
        let uuid = uuid_text(cache_uuid);
        let io = |step: &'static str| {
            move |e: io::Error| BackingError::Io { op: step, offset: 0, len: 0, source: e }
        };
        let superseded = self.metadata_get(SUPERSEDED_KEY).map_err(io("read image metadata"))?;
        let superseded = superseded.unwrap_or_default();
        if let Some(entry) = superseded_entry(&superseded, &uuid) {
            let by = entry.split_once(" by ").map_or(entry, |(_, by)| by).to_string();
            return Err(BackingError::TakenOver {
                store: self.name.clone(),
                image: image.into(),
                cache: uuid,
                by,
            });
        }
        let host = host_name();
        let now = now_unix_secs();
        let holder = self.metadata_get(HOLDER_KEY).map_err(io("read image metadata"))?;
        if let Some(holder) = holder.as_deref().filter(|h| first_word(h) != uuid) {
            if !takeover {
                return Err(BackingError::HeldByAnother {
                    store: self.name.clone(),
                    holder: holder.to_string(),
                });
            }
            // Recorded before the holder changes: the old cache is refused from here on, even
            // if this claim goes no further.
            let old = first_word(holder);
            let line = format!("{old} by {uuid} host={host} at={now}");
            let list = supersede(&superseded, old, &line);
            self.metadata_set(SUPERSEDED_KEY, &list)
                .map_err(|e| self.metadata_failed(e, "record the cache taken over"))?;
            tracing::warn!(
                "backing store {}: taken over from cache {holder} (takeover override): its \
                 dirty blocks are not written back, and it is refused if it comes back",
                self.name
            );
        }
        let record = format!("{uuid} host={host} pid={} since={now}", std::process::id());
        self.metadata_set(HOLDER_KEY, &record)
            .map_err(|e| self.metadata_failed(e, "record this cache as the holder"))?;
        *self.claimed.lock().unwrap_or_else(|e| e.into_inner()) = Some(uuid);
        self.gated.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// See [`crate::BackingStore::disclaim`].
    pub(super) fn disclaim(&self) -> Result<()> {
        if self.lock_lost.load(Ordering::SeqCst) {
            return Err(self.lock_lost_error());
        }
        let Some(uuid) = self.claimed.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Ok(());
        };
        let io = |e: io::Error| BackingError::Io {
            op: "read image metadata",
            offset: 0,
            len: 0,
            source: e,
        };
        let holder = self.metadata_get(HOLDER_KEY).map_err(io)?;
        if holder.as_deref().is_some_and(|h| first_word(h) == uuid) {
            self.metadata_remove(HOLDER_KEY)
                .map_err(|e| self.metadata_failed(e, "remove this cache's holder record"))?;
        }
        *self.claimed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    fn metadata_failed(&self, e: io::Error, op: &'static str) -> BackingError {
        let ret = -i64::from(e.raw_os_error().unwrap_or(libc::EIO));
        self.write_failed(ret, BackingError::Io { op, offset: 0, len: 0, source: e })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_is_written_as_ceph_and_uuidgen_write_one() {
        let uuid = *b"\x01\x23\x45\x67\x89\xab\xcd\xef\x00\x11\x22\x33\x44\x55\x66\x77";
        assert_eq!(uuid_text(uuid), "01234567-89ab-cdef-0011-223344556677");
    }

    #[test]
    fn the_superseded_list_finds_each_cache_by_its_uuid_and_keeps_the_newest() {
        let mut list = String::new();
        for i in 0..SUPERSEDED_KEPT + 5 {
            let line = format!("old-{i} by new-{i} host=h at={i}");
            list = supersede(&list, &format!("old-{i}"), &line);
        }
        assert_eq!(list.lines().count(), SUPERSEDED_KEPT);
        assert_eq!(superseded_entry(&list, "old-4"), None, "the oldest are dropped");
        assert_eq!(superseded_entry(&list, "old-5"), Some("old-5 by new-5 host=h at=5"));
        assert_eq!(superseded_entry(&list, "old-6 by"), None, "the first word only");
        assert_eq!(superseded_entry(&list, "new-6"), None, "the cache taken over, not its heir");
        let again = supersede(&list, "old-5", "old-5 by newer host=h at=99");
        assert_eq!(again.lines().filter(|l| l.starts_with("old-5 ")).count(), 1);
        assert_eq!(superseded_entry(&again, "old-5"), Some("old-5 by newer host=h at=99"));
    }
}
