//! Operating errors of backing-store I/O, with the errno a frontend reports.

use std::io;

/// A backing-store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// The kernel reported an error.
    #[error("{op} at byte {offset} (+{len}) on the backing store: {source}")]
    Io {
        /// The operation (`read`, `write`, `flush`, ...).
        op: &'static str,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A request reaches past the end of the store.
    #[error(
        "{op} of {len} bytes at byte {offset} is past the end of the backing store ({size} bytes)"
    )]
    OutOfRange {
        /// The operation.
        op: &'static str,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// Size of the store in bytes.
        size: u64,
    },
    /// Opening or configuring the store failed.
    #[error("cannot open backing store {path}: {source}")]
    Open {
        /// The path given.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The store returned end-of-file before a read completed.
    #[error("short read at byte {offset}: wanted {len} bytes, the store ended after {got}")]
    ShortRead {
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request.
        len: u64,
        /// Bytes actually read.
        got: u64,
    },
    /// An engine/option combination the kernel or file cannot do.
    #[error("engine {engine}: {option} is not supported here: {reason}")]
    Unsupported {
        /// The engine name.
        engine: &'static str,
        /// The option (e.g. `IOPOLL`, `O_DIRECT`).
        option: &'static str,
        /// Why.
        reason: String,
    },
}

impl BackingError {
    /// The errno a frontend (NBD, ublk) reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            BackingError::Io { source, .. } | BackingError::Open { source, .. } => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
            BackingError::OutOfRange { .. } => libc::EINVAL,
            BackingError::ShortRead { .. } => libc::EIO,
            BackingError::Unsupported { .. } => libc::EOPNOTSUPP,
        }
    }
}

/// Result of a backing-store operation.
pub type Result<T> = std::result::Result<T, BackingError>;
