//! The target abstraction: what a ublk queue serves.
//!
//! Each queue of the device has its own [`Target`] (the cache gives each one its own engine
//! lane), called only from that queue's thread, and only with requests that
//! [`crate::mapping::decode`] has validated: non-empty, in range, aligned to the logical block
//! size, reads and writes no longer than a tag's buffer. Failures are values: a
//! [`TargetError`] carries an errno, which the completion turns into one the block layer
//! reports ([`crate::mapping::error_result`]).

/// An operating error from a target: an errno plus context for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}: {}", std::io::Error::from_raw_os_error(*.errno))]
pub struct TargetError {
    errno: i32,
    context: String,
}

impl TargetError {
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

/// One write of a batch (see [`Target::write_batch`]).
#[derive(Debug, Clone, Copy)]
pub struct BatchWrite<'a> {
    /// Byte offset on the device.
    pub offset_bytes: u64,
    /// The payload.
    pub data: &'a [u8],
    /// Durable on return.
    pub fua: bool,
}

/// One read of a batch (see [`Target::read_batch`]).
#[derive(Debug)]
pub struct BatchRead<'a> {
    /// Byte offset on the device.
    pub offset_bytes: u64,
    /// Where the bytes go; its length is the read's length.
    pub buf: &'a mut [u8],
}

/// What receives each completed request in flight: its ticket, and a read's data (a write's:
/// none) or its error.
pub type Completed<'a> = dyn FnMut(usize, Result<&[u8], TargetError>) + 'a;

/// How a request handed to [`Target::read_batch_start`] or [`Target::write_batch_start`]
/// started.
#[derive(Debug)]
pub enum IoStarted {
    /// Answered: a read's buffer holds the data, a write is done (or the request failed).
    Done(Result<(), TargetError>),
    /// In flight: [`Target::complete`] hands it over with this ticket, unique among the
    /// queue's requests in flight.
    Pending(usize),
}

/// One queue's view of the device. Called from the queue's thread only, with validated
/// requests. `fua` means: durable before returning.
pub trait Target {
    /// Fills `buf` with the bytes at `offset_bytes`.
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), TargetError>;

    /// Writes `data` at `offset_bytes`.
    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), TargetError>;

    /// Writes that the queue received together, pushing one result per write, in order, onto
    /// `outcomes` (passed in empty). The kernel does not order requests it has in flight
    /// together, so writes to the same bytes may take effect in any order. The default writes
    /// them one by one; a target that shares work between them (the cache's group commit)
    /// overrides it.
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), TargetError>>,
    ) {
        for w in writes {
            outcomes.push(self.write(w.offset_bytes, w.data, w.fua));
        }
    }

    /// Starts writes that the queue received together, as [`Target::write_batch`] writes
    /// them, except that a write the target cannot answer at once (one going through to a
    /// slow store) may be left in flight: `started` receives one [`IoStarted`] per write, in
    /// order; the queue completes each one in flight when [`Target::complete`] hands it over
    /// (with no data). The default answers every write at once: a lone write with
    /// [`Target::write`], several with [`Target::write_batch`].
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<IoStarted>) {
        if let [w] = writes {
            started.push(IoStarted::Done(self.write(w.offset_bytes, w.data, w.fua)));
            return;
        }
        let mut outcomes = Vec::with_capacity(writes.len());
        self.write_batch(writes, &mut outcomes);
        started.extend(outcomes.into_iter().map(IoStarted::Done));
    }

    /// Reads that the queue received together, filling each `buf` and pushing one result per
    /// read, in order, onto `outcomes` (passed in empty). A failed read fails alone. The
    /// default reads them one by one; a target that shares work between them overrides it.
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), TargetError>>,
    ) {
        for r in reads {
            outcomes.push(self.read(r.offset_bytes, r.buf));
        }
    }

    /// Starts reads the queue received together, as [`Target::read_batch`] reads them, except
    /// that a read the target cannot answer at once (a cache miss) may be left in flight:
    /// `started` receives one [`IoStarted`] per read, in order; the queue completes the
    /// others' tags at once and each read in flight's when [`Target::complete`] hands it
    /// over. The default answers every read at once.
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<IoStarted>) {
        let mut outcomes = Vec::with_capacity(reads.len());
        self.read_batch(reads, &mut outcomes);
        started.extend(outcomes.into_iter().map(IoStarted::Done));
    }

    /// Requests started and not yet handed over by [`Target::complete`].
    fn pending(&self) -> usize {
        0
    }

    /// A descriptor that polls readable when a request in flight may have completed (the
    /// queue waits on it beside the driver's requests, after a [`Target::complete`] with 0);
    /// `None`: the queue completes its requests in flight before it waits for more.
    fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }

    /// Hands over completed requests in flight, waiting until at least `min` were (fewer only
    /// if fewer are in flight): `done` gets each one's ticket and a read's data (its length;
    /// a write's: empty) or its error. Returns how many were handed over.
    fn complete(&mut self, min: usize, done: &mut Completed<'_>) -> usize {
        let _ = (min, done);
        0
    }

    /// Makes every write completed before this call durable.
    fn flush(&mut self) -> Result<(), TargetError>;

    /// Discards a range: its contents are unspecified until rewritten.
    fn discard(&mut self, offset_bytes: u64, len_bytes: u64) -> Result<(), TargetError>;

    /// Makes a range read as zeroes; `may_unmap` allows deallocating it.
    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        may_unmap: bool,
    ) -> Result<(), TargetError>;
}
