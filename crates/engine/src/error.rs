//! The engine's operating errors, each with the errno a frontend reports.

use pmcache_backing::BackingError;

use crate::format::FormatError;

/// An engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backing store failed; acknowledged data in the cache is untouched.
    #[error(transparent)]
    Backing(#[from] BackingError),
    /// The medium is not a usable pmcache for this backing store.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A request reaches past the end of the device.
    #[error(
        "{op} of {len} bytes at byte {offset} is past the end of the device ({size_bytes} bytes)"
    )]
    OutOfRange {
        /// The operation.
        op: &'static str,
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Device size in bytes.
        size_bytes: u64,
    },
    /// More lanes were asked for than the engine was configured with.
    #[error("all {max_lanes} lanes are in use")]
    TooManyLanes {
        /// The configured maximum.
        max_lanes: usize,
    },
    /// The engine was shut down.
    #[error("the cache is shut down")]
    ShutDown,
    /// Shutdown was asked for while lanes are still open.
    #[error("cannot shut down: {open} lanes are still open")]
    LanesOpen {
        /// Lanes still open.
        open: usize,
    },
    /// The engine's DRAM tables could not be allocated.
    #[error("allocating the cache's DRAM tables: {0}")]
    Memory(#[from] pmcache_media::MediaError),
    /// The configuration cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An earlier `fdatasync` of the backing store failed: writes before it may be lost
    /// there, which a later one would not report, so none is trusted until the cache is
    /// attached again.
    #[error(
        "an earlier fdatasync of the backing store failed, so writes before it may be lost there (a later fdatasync would not say); restart pmcache: it recovers the cache and writes back again every block not known to be synced"
    )]
    BackingSyncFailedBefore,
    /// A write found no free or clean slot and the cleaner wrote nothing back for the whole
    /// stall timeout (a hung backing store): the write is refused; every acknowledged block
    /// stays dirty in the cache.
    #[error(
        "the cache is full of dirty data and the cleaner wrote nothing back for {waited_ms} ms (is the backing store hung?); the write was not done, acknowledged data stays in the cache"
    )]
    CleanerStalled {
        /// How long the write waited.
        waited_ms: u64,
    },
    /// A block's only up-to-date copy (dirty in the cache) cannot be read back: a poisoned
    /// line of the medium, or data that fails its checksum. The request fails rather than
    /// return other data; the block stays dirty and is not written back.
    #[error(
        "block {lba} cannot be read from the cache, which holds its only up-to-date copy: {why}; it is not served nor written back (a write of the whole block or a trim replaces it)"
    )]
    CachedBlockUnreadable {
        /// The block.
        lba: u64,
        /// Why.
        why: Unreadable,
    },
    /// Write-back left blocks dirty: the backing store refused them, or (`unreadable` of
    /// them) they could not be read from the cache.
    #[error(
        "write-back failed for {failed} blocks ({cleaned} were written back{}); they stay dirty in the cache",
        unreadable_text(*unreadable)
    )]
    WriteBackIncomplete {
        /// Blocks whose write-back failed.
        failed: u64,
        /// Blocks written back.
        cleaned: u64,
        /// Of the failed, those whose data in the cache cannot be read back (a checksum
        /// mismatch, a poisoned line): writing the backing store again does not help them.
        unreadable: u64,
    },
    /// A drain gave up on blocks that stayed busy for its whole wait: a write of the same
    /// blocks to the backing store still in flight (a hung store), or writers of the old
    /// mode. Nothing failed; the blocks stay dirty and a later drain writes them back.
    #[error(
        "{dirty} dirty blocks could not be written back: writes of them to the backing store stayed in flight for {waited_ms} ms (is the backing store hung?); they stay dirty in the cache"
    )]
    DrainBusy {
        /// Blocks dirty when the drain started and still dirty.
        dirty: u64,
        /// How long the drain waited for them.
        waited_ms: u64,
    },
}

impl Error {
    /// The errno a frontend (NBD, ublk) reports.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Backing(e) => e.errno(),
            Error::Format(_) => libc::EIO,
            Error::OutOfRange { .. } | Error::Config(_) => libc::EINVAL,
            Error::TooManyLanes { .. } | Error::LanesOpen { .. } => libc::EBUSY,
            Error::ShutDown => libc::ESHUTDOWN,
            Error::Memory(_) => libc::ENOMEM,
            Error::BackingSyncFailedBefore => libc::EIO,
            Error::CleanerStalled { .. } | Error::WriteBackIncomplete { .. } => libc::EIO,
            Error::DrainBusy { .. } => libc::EBUSY,
            Error::CachedBlockUnreadable { .. } => libc::EIO,
        }
    }
}

/// Why a slot's data cannot be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unreadable {
    /// The medium cannot return it: a poisoned line at this medium offset.
    Poisoned {
        /// Medium offset of the first bad byte.
        offset: u64,
    },
    /// It does not match the checksum written with it.
    Mismatch {
        /// The checksum on the medium.
        stored: u32,
        /// The checksum of the data read.
        computed: u32,
    },
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreadable::Poisoned { offset } => {
                write!(f, "the cache medium has a poisoned line at byte {offset}")
            }
            Unreadable::Mismatch { stored, computed } => write!(
                f,
                "its data fails its checksum (stored {stored:#010x}, computed {computed:#010x})"
            ),
        }
    }
}

fn unreadable_text(unreadable: u64) -> String {
    if unreadable == 0 {
        return String::new();
    }
    format!(
        "; {unreadable} cannot be read from the cache — a checksum mismatch or a poisoned line of \
         the medium — and are not written back: a write of the whole block or a trim replaces \
         each"
    )
}

/// Result of an engine operation.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Each error reaches a frontend as the errno its kind calls for; a backing store's
    /// error keeps its own (a range error there is EINVAL, an I/O error its OS errno).
    #[test]
    fn each_error_carries_its_errno() {
        let io = |errno| BackingError::Io {
            op: "write",
            offset: 0,
            len: 4096,
            source: std::io::Error::from_raw_os_error(errno),
        };
        let cases = [
            (Error::Backing(io(libc::ENOSPC)), libc::ENOSPC),
            (Error::Backing(io(libc::EIO)), libc::EIO),
            (Error::Format(FormatError::BadMagic { found: [0; 8] }), libc::EIO),
            (
                Error::OutOfRange { op: "read", offset: 1 << 30, len: 512, size_bytes: 4096 },
                libc::EINVAL,
            ),
            (Error::Config("no lanes".into()), libc::EINVAL),
            (Error::TooManyLanes { max_lanes: 2 }, libc::EBUSY),
            (Error::LanesOpen { open: 1 }, libc::EBUSY),
            (Error::ShutDown, libc::ESHUTDOWN),
            (Error::BackingSyncFailedBefore, libc::EIO),
            (Error::DrainBusy { dirty: 3, waited_ms: 30_000 }, libc::EBUSY),
        ];
        for (error, errno) in cases {
            assert_eq!(error.errno(), errno, "{error}");
        }
        let missing = pmcache_media::PmemFile::open(std::path::Path::new("/nonexistent/pm"), None)
            .expect_err("no such file");
        assert_eq!(Error::Memory(missing).errno(), libc::ENOMEM);
    }
}
