//! The block-request contract between pmcache's frontends and what they serve.
//!
//! A frontend turns its protocol into calls of [`BlockConn`]: the NBD server one per client
//! connection, the ublk device one per queue (the cache gives each its own engine lane). The
//! frontend calls a `BlockConn` from one thread at a time, and only with requests it has
//! validated: non-empty, in range, aligned to the device's smallest block, reads and writes
//! no longer than the largest request it advertises. Failures are values: a [`BlockError`]
//! carries an errno, which each frontend turns into what its protocol reports (an NBD error
//! code, a negative result for the block layer).
//!
//! Neither frontend knows the other; `pmcache-frontend` implements the trait once for the
//! cache, `pmcache_nbd::MemExport` for a RAM disk and `pmcache ublk null` for nothing at all.

#![forbid(unsafe_code)]

use std::os::fd::BorrowedFd;

/// An operating error from what a frontend serves: an errno plus context for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}: {}", errno_text(.errno))]
pub struct BlockError {
    errno: i32,
    context: String,
}

impl BlockError {
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

impl From<std::io::Error> for BlockError {
    fn from(e: std::io::Error) -> Self {
        Self { errno: e.raw_os_error().unwrap_or(libc::EIO), context: e.to_string() }
    }
}

/// One write of a batch (see [`BlockConn::write_batch`]).
#[derive(Debug, Clone, Copy)]
pub struct BatchWrite<'a> {
    /// Byte offset on the device.
    pub offset_bytes: u64,
    /// The payload.
    pub data: &'a [u8],
    /// Durable before it is answered.
    pub fua: bool,
}

/// One read of a batch (see [`BlockConn::read_batch`]).
#[derive(Debug, Default)]
pub struct BatchRead<'a> {
    /// Byte offset on the device.
    pub offset_bytes: u64,
    /// Where the bytes go; its length is the read's length.
    pub buf: &'a mut [u8],
}

/// What receives each completed request in flight: its ticket, and a read's data (a write's:
/// none) or its error.
pub type Completed<'a> = dyn FnMut(usize, Result<&[u8], BlockError>) + 'a;

/// How a request handed to [`BlockConn::read_batch_start`] or
/// [`BlockConn::write_batch_start`] started.
#[derive(Debug)]
pub enum Started {
    /// Answered: a read's buffer holds the data, a write is done (or the request failed).
    Done(Result<(), BlockError>),
    /// In flight: [`BlockConn::complete`] hands it over with this ticket, which is unique
    /// among the connection's (queue's) requests in flight and, where
    /// [`BlockConn::pending_max`] is not 0, below it.
    Pending(usize),
}

/// One extent of allocation status (see [`BlockConn::block_status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockExtent {
    /// Its length in bytes.
    pub len_bytes: u32,
    /// It is a hole: no storage is allocated for it.
    pub hole: bool,
    /// It reads as zeroes.
    pub zero: bool,
}

/// One client connection's (NBD) or one queue's (ublk) view of a block device. Called from
/// one thread at a time, with validated requests (see the crate). `fua` means: durable before
/// returning.
pub trait BlockConn {
    /// Fills `buf` with the bytes at `offset_bytes`.
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError>;

    /// Writes `data` at `offset_bytes`.
    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), BlockError>;

    /// Writes several requests the client had in flight together, pushing one result per
    /// write, in order, onto `outcomes` (passed in empty). Writes to the same bytes take
    /// effect in batch order (NBD gathers them in the client's order; the block layer does
    /// not order what it has in flight together, so over ublk any order is the client's).
    /// The default writes them one by one; what can share work between them (the cache's
    /// group commit) overrides it.
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        for w in writes {
            outcomes.push(self.write(w.offset_bytes, w.data, w.fua));
        }
    }

    /// Starts writes received together, as [`BlockConn::write_batch`] writes them, except
    /// that a write that cannot be answered at once (one going through to a slow store) may
    /// be left in flight: `started` receives one [`Started`] per write, in order, and the
    /// frontend answers each write in flight when [`BlockConn::complete`] hands it over (with
    /// no data). Writes to the same bytes still take effect in batch order. The default
    /// answers every write at once: a lone write with [`BlockConn::write`], several with
    /// [`BlockConn::write_batch`].
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<Started>) {
        if let [w] = writes {
            started.push(Started::Done(self.write(w.offset_bytes, w.data, w.fua)));
            return;
        }
        let mut outcomes = Vec::with_capacity(writes.len());
        self.write_batch(writes, &mut outcomes);
        started.extend(outcomes.into_iter().map(Started::Done));
    }

    /// Reads several requests received together, filling each one's `buf` and pushing one
    /// result per read, in order, onto `outcomes` (passed in empty). A batch holds reads
    /// only, so they may be served in any order or all at once. The default reads them one by
    /// one; what can share work between them (the cache's pipelined lookups and backing-store
    /// reads) overrides it. A failed read fails alone: the others are answered with their data.
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        for r in reads {
            outcomes.push(self.read(r.offset_bytes, r.buf));
        }
    }

    /// Starts reads received together, as [`BlockConn::read_batch`] reads them, except that
    /// a read that cannot be answered at once (a cache miss) may be left in flight: `started`
    /// receives one [`Started`] per read, in order; the frontend answers the others at once and
    /// each read in flight when [`BlockConn::complete`] hands it over. The default answers
    /// every read at once.
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        let mut outcomes = Vec::with_capacity(reads.len());
        self.read_batch(reads, &mut outcomes);
        started.extend(outcomes.into_iter().map(Started::Done));
    }

    /// Requests started and not yet handed over by [`BlockConn::complete`].
    fn pending(&self) -> usize {
        0
    }

    /// One more than the largest ticket a request in flight may carry (0: no bound given).
    fn pending_max(&self) -> usize {
        0
    }

    /// A descriptor that polls readable when a request in flight may have completed (a
    /// wake-up may find none): the frontend waits on it beside its own source of requests,
    /// after a [`BlockConn::complete`] with 0 (which hands over what completed meanwhile).
    /// `None`: the frontend completes its requests in flight before it waits for more.
    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
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
    fn flush(&mut self) -> Result<(), BlockError>;

    /// Describes `offset_bytes..offset_bytes + len_bytes`: appends extents from
    /// `offset_bytes` on, in order, each non-empty, at most `extents_max` of them and together
    /// at most `len_bytes` (fewer is allowed: the client asks again for the rest). The default
    /// says the range is allocated data.
    fn block_status(
        &mut self,
        offset_bytes: u64,
        len_bytes: u32,
        extents_max: usize,
        extents: &mut Vec<BlockExtent>,
    ) -> Result<(), BlockError> {
        let _ = (offset_bytes, extents_max);
        extents.push(BlockExtent { len_bytes, hole: false, zero: false });
        Ok(())
    }

    /// Discards a range: its contents are unspecified until rewritten; with `fua`, durably
    /// before returning.
    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), BlockError>;

    /// Makes a range read as zeroes; `may_trim` allows deallocating it.
    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), BlockError>;
}

#[cfg(test)]
mod tests;
