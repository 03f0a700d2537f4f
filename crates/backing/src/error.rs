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
    /// The store accepted only part of a write and then made no progress (or a fault wrapper
    /// tore the write on purpose): the first `got` bytes may be on the store.
    #[error("short write at byte {offset}: wanted {len} bytes, the store took {got}")]
    ShortWrite {
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request.
        len: u64,
        /// Bytes actually written.
        got: u64,
    },
    /// An `O_DIRECT` request whose offset or length is not a multiple of the logical block size.
    #[error(
        "engine {engine}: {op} of {len} bytes at byte {offset} is not aligned to the \
         {block_bytes}-byte logical block that O_DIRECT requires"
    )]
    Misaligned {
        /// The engine name.
        engine: &'static str,
        /// The operation.
        op: &'static str,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// The required alignment in bytes.
        block_bytes: u32,
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
            BackingError::ShortRead { .. } | BackingError::ShortWrite { .. } => libc::EIO,
            BackingError::Misaligned { .. } => libc::EINVAL,
            BackingError::Unsupported { .. } => libc::EOPNOTSUPP,
        }
    }
}

/// Result of a backing-store operation.
pub type Result<T> = std::result::Result<T, BackingError>;
