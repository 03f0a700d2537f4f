//! The export abstraction: what the NBD server serves.
//!
//! An [`Export`] is shared by all connections; each client connection gets its own
//! [`BlockConn`] from [`Export::open_conn`] (the cache engine gives each one its own lane).
//! The server only calls a connection's `BlockConn` from the one thread that serves that
//! connection, and only with requests it has already validated: non-empty, in range, aligned
//! to [`BlockSizes::min_bytes`], and for reads and writes no longer than the advertised
//! maximum. Failures are values: a [`BlockError`] carries an errno, which
//! [`codec::nbd_error_from_errno`](crate::codec::nbd_error_from_errno) maps to the NBD error
//! the spec allows: `EIO`, `ENOSPC` (also `EDQUOT`, `EFBIG`), `EINVAL`, `EPERM` (also
//! `EROFS`, `EACCES`), `ENOMEM`, `EOVERFLOW`, `ENOTSUP`, `ESHUTDOWN`; anything else becomes
//! `EIO`.

use pmcache_block::{BlockConn, BlockError, BlockExtent};

/// Block size constraints advertised with `NBD_INFO_BLOCK_SIZE`.
///
/// `min_bytes` and `preferred_bytes` are powers of two, `min_bytes <= 64 KiB`,
/// `min_bytes <= preferred_bytes`, and `max_bytes` is a multiple of `min_bytes`. The server
/// rejects requests not aligned to `min_bytes` with `EINVAL` and clamps `max_bytes` to its
/// configured maximum request size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Required alignment of offsets and lengths.
    pub min_bytes: u32,
    /// Size below which requests are inefficient (e.g. read-modify-write).
    pub preferred_bytes: u32,
    /// Largest read or write payload the export accepts.
    pub max_bytes: u32,
}

impl BlockSizes {
    /// Checks the invariants the NBD spec puts on block size constraints.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !self.min_bytes.is_power_of_two() || self.min_bytes > 64 * 1024 {
            return Err("minimum block size must be a power of two no larger than 64 KiB");
        }
        if !self.preferred_bytes.is_power_of_two() || self.preferred_bytes < self.min_bytes {
            return Err("preferred block size must be a power of two >= the minimum");
        }
        if self.max_bytes < self.min_bytes || !self.max_bytes.is_multiple_of(self.min_bytes) {
            return Err("maximum block size must be a multiple of the minimum");
        }
        Ok(())
    }
}

impl Default for BlockSizes {
    /// No alignment, 4 KiB preferred, 32 MiB maximum.
    fn default() -> Self {
        Self { min_bytes: 1, preferred_bytes: 4096, max_bytes: 32 << 20 }
    }
}

/// Something the NBD server can serve. Shared by all connections.
pub trait Export: Send + Sync + 'static {
    /// Per-connection state, which may borrow the export (a connection's thread holds the
    /// export while it serves).
    type Conn<'a>: BlockConn + Send
    where
        Self: 'a;

    /// Opens the state for one new client connection. An error closes that connection only.
    fn open_conn(&self) -> Result<Self::Conn<'_>, BlockError>;

    /// Export size; a multiple of `block_sizes().min_bytes`. Constant while serving.
    fn size_bytes(&self) -> u64;

    /// Block size constraints. Constant while serving.
    fn block_sizes(&self) -> BlockSizes;

    /// True if a flush or FUA write on one connection makes every write that any connection
    /// has completed durable and visible on all connections (`NBD_FLAG_CAN_MULTI_CONN`).
    fn can_multi_conn(&self) -> bool;
}

/// The `NBD_STATE_*` flags of an extent of `base:allocation` block status.
pub fn extent_flags(extent: &BlockExtent) -> u32 {
    let hole = if extent.hole { crate::codec::STATE_HOLE } else { 0 };
    hole | if extent.zero { crate::codec::STATE_ZERO } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(min_bytes: u32, preferred_bytes: u32, max_bytes: u32) -> BlockSizes {
        BlockSizes { min_bytes, preferred_bytes, max_bytes }
    }

    /// The spec's block size rules, at their edges.
    #[test]
    fn block_sizes_keep_to_the_spec() {
        let valid = [
            sizes(1, 1, 1),
            sizes(512, 4096, 32 << 20),
            sizes(64 << 10, 64 << 10, 64 << 10),
            BlockSizes::default(),
        ];
        for s in valid {
            assert_eq!(s.validate(), Ok(()), "{s:?}");
        }
        let invalid = [
            (sizes(0, 4096, 4096), "minimum"),
            (sizes(3, 4096, 4096), "minimum"),
            (sizes(128 << 10, 128 << 10, 128 << 10), "minimum"),
            (sizes(512, 768, 4096), "preferred"),
            (sizes(4096, 512, 4096), "preferred"),
            (sizes(4096, 4096, 2048), "maximum"),
            (sizes(4096, 4096, 6144), "maximum"),
        ];
        for (s, which) in invalid {
            let err = s.validate().unwrap_err();
            assert!(err.starts_with(which), "{s:?}: {err}");
        }
    }
}
