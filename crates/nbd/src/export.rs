//! The export abstraction: what the NBD server serves.
//!
//! An [`Export`] is shared by all connections; each client connection gets its own
//! [`ExportConn`] from [`Export::open_conn`] (the cache engine gives each one its own lane).
//! The server only calls an `ExportConn` from the one thread that serves that connection, and
//! only with requests it has already validated: non-empty, in range, aligned to
//! [`BlockSizes::min_bytes`], and for reads and writes no longer than the advertised maximum.
//! Failures are values: an [`ExportError`] carries an errno that the server maps to the NBD
//! error the spec allows.

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

/// An operating error from an export: an errno plus context for the log.
///
/// The errno is mapped to an NBD error code by
/// [`codec::nbd_error_from_errno`](crate::codec::nbd_error_from_errno): `EIO`, `ENOSPC`
/// (also `EDQUOT`, `EFBIG`), `EINVAL`, `EPERM` (also `EROFS`, `EACCES`), `ENOMEM`,
/// `EOVERFLOW`, `ENOTSUP`, `ESHUTDOWN`; anything else becomes `EIO`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}: {}", errno_text(.errno))]
pub struct ExportError {
    errno: i32,
    context: String,
}

impl ExportError {
    /// An error with an errno (`libc::EIO`, ...) and a short description.
    pub fn new(errno: i32, context: impl Into<String>) -> Self {
        Self { errno, context: context.into() }
    }

    /// The errno.
    pub fn errno(&self) -> i32 {
        self.errno
    }

    /// The context given at construction.
    pub fn context(&self) -> &str {
        &self.context
    }
}

fn errno_text(errno: &i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(*errno)
}

impl From<std::io::Error> for ExportError {
    fn from(e: std::io::Error) -> Self {
        Self { errno: e.raw_os_error().unwrap_or(libc::EIO), context: e.to_string() }
    }
}

/// Something the NBD server can serve. Shared by all connections.
pub trait Export: Send + Sync + 'static {
    /// Per-connection state.
    type Conn: ExportConn;

    /// Opens the state for one new client connection. An error closes that connection only.
    fn open_conn(&self) -> Result<Self::Conn, ExportError>;

    /// Export size; a multiple of `block_sizes().min_bytes`. Constant while serving.
    fn size_bytes(&self) -> u64;

    /// Block size constraints. Constant while serving.
    fn block_sizes(&self) -> BlockSizes;

    /// True if a flush or FUA write on one connection makes every write that any connection
    /// has completed durable and visible on all connections (`NBD_FLAG_CAN_MULTI_CONN`).
    fn can_multi_conn(&self) -> bool;
}

/// One write of a batch (see [`ExportConn::write_batch`]).
#[derive(Debug, Clone, Copy)]
pub struct BatchWrite<'a> {
    /// Offset into the export.
    pub offset_bytes: u64,
    /// The payload.
    pub data: &'a [u8],
    /// Persist this write before returning.
    pub fua: bool,
}

/// One read of a batch (see [`ExportConn::read_batch`]).
#[derive(Debug, Default)]
pub struct BatchRead<'a> {
    /// Offset into the export.
    pub offset_bytes: u64,
    /// Where the bytes go; its length is the read's length.
    pub buf: &'a mut [u8],
}

/// What receives each completed request in flight: its ticket, and a read's data (a write's:
/// none) or its error.
pub type Completed<'a> = dyn FnMut(usize, Result<&[u8], ExportError>) + 'a;

/// How a request handed to [`ExportConn::read_batch_start`] or
/// [`ExportConn::write_batch_start`] started.
#[derive(Debug)]
pub enum Started {
    /// Answered: a read's buffer holds the data, a write is done (or the request failed).
    Done(Result<(), ExportError>),
    /// In flight: [`ExportConn::complete`] hands it over with this ticket, which is unique
    /// among the connection's requests in flight and below [`ExportConn::pending_max`].
    Pending(usize),
}

/// One extent of `base:allocation` block status (see [`ExportConn::block_status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockExtent {
    /// Its length in bytes.
    pub len_bytes: u32,
    /// It is a hole: no storage is allocated for it.
    pub hole: bool,
    /// It reads as zeroes.
    pub zero: bool,
}

impl BlockExtent {
    /// Its `NBD_STATE_*` flags.
    pub fn flags(&self) -> u32 {
        let hole = if self.hole { crate::codec::STATE_HOLE } else { 0 };
        hole | if self.zero { crate::codec::STATE_ZERO } else { 0 }
    }
}

/// One connection's view of an export. Called from one thread at a time, with requests that
/// are non-empty, in range and aligned. `fua` means: persist this write before returning.
pub trait ExportConn: Send {
    /// Fills `buf` with the bytes at `offset_bytes`.
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), ExportError>;

    /// Writes `data` at `offset_bytes`.
    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), ExportError>;

    /// Writes several requests the client had in flight together (the server gathers the
    /// writes whose payloads have all arrived), pushing one result per write, in order, onto
    /// `outcomes` (which the server passes in empty). Writes to the same bytes take effect in
    /// batch order. The default writes them one by one; an export that can share work between
    /// them (the cache's group commit) overrides it.
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        for w in writes {
            outcomes.push(self.write(w.offset_bytes, w.data, w.fua));
        }
    }

    /// Starts several writes the client had in flight together, as
    /// [`ExportConn::write_batch`] writes them, except that a write the export cannot answer
    /// at once (one going through to a slow store) may be left in flight: `started` receives
    /// one [`Started`] per write, in order, and the server answers each write in flight when
    /// [`ExportConn::complete`] hands it over (with no data). Writes to the same bytes still
    /// take effect in batch order. The default answers every write at once.
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<Started>) {
        let mut outcomes = Vec::with_capacity(writes.len());
        self.write_batch(writes, &mut outcomes);
        started.extend(outcomes.into_iter().map(Started::Done));
    }

    /// Reads several requests the client had in flight together (the server gathers the
    /// reads whose headers have all arrived), filling each one's `buf` and pushing one result
    /// per read, in order, onto `outcomes` (which the server passes in empty). A batch holds
    /// reads only, with no write between them, so they may be served in any order or all at
    /// once. The default reads them one by one; an export that can share work between them
    /// (the cache's pipelined lookups and backing-store reads) overrides it. A failed read
    /// fails alone: the others of its batch are answered with their data.
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        for r in reads {
            outcomes.push(self.read(r.offset_bytes, r.buf));
        }
    }

    /// Starts several reads the client had in flight together, as [`ExportConn::read_batch`]
    /// reads them, except that a read the export cannot answer at once (a cache miss) may be
    /// left in flight: `started` receives one [`Started`] per read, in order, and the
    /// server answers the others at once and each read in flight when
    /// [`ExportConn::complete`] hands it over. The default answers every read at once.
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        let mut outcomes = Vec::with_capacity(reads.len());
        self.read_batch(reads, &mut outcomes);
        started.extend(outcomes.into_iter().map(Started::Done));
    }

    /// Requests started and not yet handed over by [`ExportConn::complete`].
    fn pending(&self) -> usize {
        0
    }

    /// One more than the largest ticket a request in flight may carry.
    fn pending_max(&self) -> usize {
        0
    }

    /// A file descriptor that polls readable when a request in flight may have completed (a
    /// wake-up may find none): the server waits on it beside the client's socket, after a
    /// [`ExportConn::complete`] with 0 (which hands over what the export saw meanwhile).
    /// `None`: the server waits in [`ExportConn::complete`] before it waits for the client.
    fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }

    /// Hands over completed requests in flight, waiting until at least `min` were (fewer only
    /// if fewer are in flight; 0 never waits): `done` gets each one's ticket and a read's data
    /// (its length; a write's: empty) or its error. Returns how many were handed over.
    fn complete(&mut self, min: usize, done: &mut Completed<'_>) -> usize {
        let _ = (min, done);
        0
    }

    /// Makes every write completed before this call durable.
    fn flush(&mut self) -> Result<(), ExportError>;

    /// Describes `offset_bytes..offset_bytes + len_bytes` for the `base:allocation` metadata
    /// context: appends extents from `offset_bytes` on, in order, each non-empty, at most
    /// `extents_max` of them and together at most `len_bytes` (fewer is allowed: the client
    /// asks again for the rest). The default says the range is allocated data.
    fn block_status(
        &mut self,
        offset_bytes: u64,
        len_bytes: u32,
        extents_max: usize,
        extents: &mut Vec<BlockExtent>,
    ) -> Result<(), ExportError> {
        let _ = (offset_bytes, extents_max);
        extents.push(BlockExtent { len_bytes, hole: false, zero: false });
        Ok(())
    }

    /// Discards a range; its contents are unspecified until rewritten.
    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), ExportError>;

    /// Makes a range read as zeroes; `may_trim` allows deallocating it.
    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), ExportError>;
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

    /// An export error keeps its errno and context, shows both, and takes an I/O error's
    /// errno (EIO where it has none).
    #[test]
    fn export_errors_carry_errno_and_context() {
        let err = ExportError::new(libc::ENOSPC, "cache full");
        assert_eq!((err.errno(), err.context()), (libc::ENOSPC, "cache full"));
        let shown = err.to_string();
        assert!(shown.starts_with("cache full: ") && shown.contains("No space left"), "{shown}");
        let from_io = ExportError::from(std::io::Error::from_raw_os_error(libc::EROFS));
        assert_eq!(from_io.errno(), libc::EROFS);
        assert!(from_io.context().contains("Read-only"), "{}", from_io.context());
        let no_errno = ExportError::from(std::io::Error::other("custom"));
        assert_eq!((no_errno.errno(), no_errno.context()), (libc::EIO, "custom"));
    }

    /// A connection that records its reads and writes and fails those at offset 13; a read
    /// fills its buffer with its offset.
    #[derive(Default)]
    struct Recorder {
        reads: Vec<(u64, usize)>,
        writes: Vec<(u64, Vec<u8>, bool)>,
    }

    impl ExportConn for Recorder {
        fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), ExportError> {
            self.reads.push((offset_bytes, buf.len()));
            if offset_bytes == 13 {
                return Err(ExportError::new(libc::EIO, "bad sector"));
            }
            buf.fill(offset_bytes as u8);
            Ok(())
        }
        fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
            self.writes.push((offset_bytes, data.to_vec(), fua));
            if offset_bytes == 13 {
                return Err(ExportError::new(libc::EIO, "bad sector"));
            }
            Ok(())
        }
        fn flush(&mut self) -> Result<(), ExportError> {
            Ok(())
        }
        fn trim(&mut self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
            Ok(())
        }
        fn write_zeroes(&mut self, _: u64, _: u64, _: bool, _: bool) -> Result<(), ExportError> {
            Ok(())
        }
    }

    /// The default batch writes one by one, in order, one outcome each: a failed write
    /// fails alone.
    #[test]
    fn a_default_batch_writes_in_order_with_one_outcome_each() {
        let mut conn = Recorder::default();
        let batch = [
            BatchWrite { offset_bytes: 0, data: b"ab", fua: false },
            BatchWrite { offset_bytes: 13, data: b"c", fua: true },
            BatchWrite { offset_bytes: 0, data: b"d", fua: false },
        ];
        let mut outcomes = Vec::new();
        conn.write_batch(&batch, &mut outcomes);
        assert_eq!(
            conn.writes,
            [(0, b"ab".to_vec(), false), (13, b"c".to_vec(), true), (0, b"d".to_vec(), false)]
        );
        assert_eq!(outcomes.len(), 3);
        assert!(outcomes[0].is_ok() && outcomes[2].is_ok());
        assert_eq!(outcomes[1].as_ref().unwrap_err().errno(), libc::EIO);
    }

    /// The default read batch reads one by one, in order, one outcome each: a failed read
    /// fails alone and the others get their bytes.
    #[test]
    fn a_default_batch_reads_in_order_with_one_outcome_each() {
        let mut conn = Recorder::default();
        let (mut a, mut b, mut c) = ([0u8; 2], [0u8; 1], [0u8; 3]);
        let mut batch = [
            BatchRead { offset_bytes: 5, buf: &mut a },
            BatchRead { offset_bytes: 13, buf: &mut b },
            BatchRead { offset_bytes: 7, buf: &mut c },
        ];
        let mut outcomes = Vec::new();
        conn.read_batch(&mut batch, &mut outcomes);
        assert_eq!(conn.reads, [(5, 2), (13, 1), (7, 3)]);
        assert_eq!(outcomes.len(), 3);
        assert!(outcomes[0].is_ok() && outcomes[2].is_ok());
        assert_eq!(outcomes[1].as_ref().unwrap_err().errno(), libc::EIO);
        assert_eq!((a, b, c), ([5; 2], [0; 1], [7; 3]));
    }
}
