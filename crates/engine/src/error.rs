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
}

impl Error {
    /// The errno a frontend (NBD, ublk) reports.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Backing(e) => e.errno(),
            Error::Format(_) => libc_eio(),
            Error::OutOfRange { .. } | Error::Config(_) => 22, // EINVAL
            Error::TooManyLanes { .. } | Error::LanesOpen { .. } => 16, // EBUSY
            Error::ShutDown => 108,                            // ESHUTDOWN
            Error::Memory(_) => 12,                            // ENOMEM
        }
    }
}

fn libc_eio() -> i32 {
    5
}

/// Result of an engine operation.
pub type Result<T> = std::result::Result<T, Error>;
