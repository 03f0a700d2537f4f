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
    /// The kernel could not give an engine a resource it needs now (descriptors, memory, AIO
    /// events, locked memory): the feature exists, so this is neither [`Self::Unsupported`]
    /// nor a reason to fall back to another engine.
    #[error("engine {engine}: cannot {what}: {source}")]
    NoResources {
        /// The engine name.
        engine: &'static str,
        /// What it was setting up (`create a ring of depth 64`, ...).
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Another client holds the store's lock (an RBD image's exclusive lock): another host
    /// caches it.
    #[error(
        "backing store {store} is locked by {holder}: another pmcache (or another client) has it \
         open for writing; detach it there first"
    )]
    Locked {
        /// The store as given.
        store: String,
        /// Who holds the lock (`client.N at ADDR`).
        holder: String,
        /// The error the lock request got.
        #[source]
        source: io::Error,
    },
    /// This client lost the store's exclusive lock while attached (another client broke it,
    /// and the cluster fenced this one off): nothing more is written from here.
    #[error(
        "backing store {store}: this host lost the image's exclusive lock ({why}): another client \
         broke it, so nothing more is written to the image from this attachment; the cache keeps \
         its dirty blocks. Stop this server: started again on the same cache it writes them back \
         if no other cache took the image over meanwhile, and is refused if one did"
    )]
    LockLost {
        /// The store as given.
        store: String,
        /// What showed it (the error a request got).
        why: String,
    },
    /// The store records another cache as holding dirty blocks of it: attaching this one
    /// would let that one, when it comes back, write older blocks over this one's writes.
    #[error(
        "backing store {store} holds dirty blocks of another cache: {holder}. If that cache is \
         gone for good (its host or medium lost), attach with the takeover override (add \
         :takeover=1 to the rbd: spec): its dirty blocks are then lost, and it is refused if it \
         comes back; otherwise detach it there first (pmcache detach: its dirty blocks written \
         back)"
    )]
    HeldByAnother {
        /// The store as given.
        store: String,
        /// The cache that holds it (its uuid, host and since when).
        holder: String,
    },
    /// Another cache took the store over from this one: this cache's dirty blocks are older
    /// than what was written since, and are never written back.
    #[error(
        "backing store {store} was taken over from this cache ({cache}) by {by}: this cache's \
         dirty blocks are older than what was written to the image since, and are not written \
         back. Format this cache anew to use it with this image (to write its blocks over the \
         newer data anyway: rbd image-meta remove {image} pmcache.superseded)"
    )]
    TakenOver {
        /// The store as given.
        store: String,
        /// The image as Ceph's tools name it (`POOL/IMAGE`).
        image: String,
        /// This cache's uuid.
        cache: String,
        /// The cache that took it over (its uuid, host and when).
        by: String,
    },
    /// A write before a cache claimed the store, on a store that records a cache holding dirty
    /// blocks of it, or one taken over.
    #[error(
        "{op} refused on backing store {store}: the image records a cache that holds dirty \
         blocks of it ({record}), and this attachment has not claimed the image yet"
    )]
    Unclaimed {
        /// The operation.
        op: &'static str,
        /// The store as given.
        store: String,
        /// The record found on the image.
        record: String,
    },
}

impl BackingError {
    /// The error for a failed engine setup call (`io_uring_setup`, `io_setup`, ...): a kernel
    /// without the feature, or one refusing it (`ENOSYS`, `EINVAL`, `EPERM`, `EOPNOTSUPP`,
    /// `EACCES`), or a locked-memory limit too low for it (`ENOMEM`: io_uring before Linux
    /// 5.12 charges its rings to `RLIMIT_MEMLOCK`, often 64 KiB in containers), makes it
    /// [`Self::Unsupported`] for `option`, which a defaulted engine falls back from; anything
    /// else (`EMFILE`, `ENFILE`, `EAGAIN`, ...) is [`Self::NoResources`], keeping the errno.
    pub(crate) fn setup_failed(
        engine: &'static str,
        option: &'static str,
        what: String,
        source: io::Error,
    ) -> Self {
        let missing =
            [libc::ENOSYS, libc::EINVAL, libc::EPERM, libc::EOPNOTSUPP, libc::EACCES, libc::ENOMEM];
        match source.raw_os_error() {
            Some(errno) if missing.contains(&errno) => {
                Self::Unsupported { engine, option, reason: format!("cannot {what}: {source}") }
            }
            _ => Self::NoResources { engine, what, source },
        }
    }

    /// Whether the store could not be reached (a network store past its timeout, or its
    /// connection lost), rather than refusing the request.
    pub fn is_unreachable(&self) -> bool {
        let errno = match self {
            BackingError::Io { source, .. } | BackingError::Open { source, .. } => {
                source.raw_os_error()
            }
            _ => None,
        };
        matches!(
            errno,
            Some(
                libc::ETIMEDOUT
                    | libc::ENOTCONN
                    | libc::ECONNREFUSED
                    | libc::ECONNRESET
                    | libc::EHOSTUNREACH
                    | libc::ENETUNREACH
                    | libc::ESHUTDOWN
            )
        )
    }

    /// The errno a frontend (NBD, ublk) reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            BackingError::Io { source, .. }
            | BackingError::Open { source, .. }
            | BackingError::NoResources { source, .. } => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
            BackingError::OutOfRange { .. } => libc::EINVAL,
            BackingError::ShortRead { .. } | BackingError::ShortWrite { .. } => libc::EIO,
            BackingError::Misaligned { .. } => libc::EINVAL,
            BackingError::Unsupported { .. } => libc::EOPNOTSUPP,
            BackingError::Locked { .. } | BackingError::HeldByAnother { .. } => libc::EBUSY,
            // What librados answers a client the cluster fenced off (EBLOCKLISTED).
            BackingError::LockLost { .. } => libc::ESHUTDOWN,
            BackingError::TakenOver { .. } => libc::ESTALE,
            BackingError::Unclaimed { .. } => libc::EROFS,
        }
    }
}

/// Result of a backing-store operation.
pub type Result<T> = std::result::Result<T, BackingError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_setup_is_unsupported_only_where_the_feature_is_missing_or_refused() {
        for errno in
            [libc::ENOSYS, libc::EINVAL, libc::EPERM, libc::EOPNOTSUPP, libc::EACCES, libc::ENOMEM]
        {
            let err = BackingError::setup_failed(
                "io_uring",
                "SQPOLL",
                "create a ring".into(),
                io::Error::from_raw_os_error(errno),
            );
            assert!(
                matches!(&err, BackingError::Unsupported { engine: "io_uring", option: "SQPOLL", reason }
                    if reason.starts_with("cannot create a ring: ")),
                "{errno}: {err:?}"
            );
            assert_eq!(err.errno(), libc::EOPNOTSUPP);
        }
        for errno in [libc::EMFILE, libc::ENFILE, libc::EAGAIN] {
            let err = BackingError::setup_failed(
                "libaio",
                "queue",
                "create an AIO context of depth 4".into(),
                io::Error::from_raw_os_error(errno),
            );
            assert!(matches!(err, BackingError::NoResources { engine: "libaio", .. }), "{err:?}");
            assert_eq!(err.errno(), errno);
            let shown = err.to_string();
            assert!(shown.starts_with("engine libaio: cannot create an AIO context of depth 4: "));
        }
    }
}
