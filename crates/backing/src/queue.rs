//! The queued interface: many I/Os in flight from one thread.
//!
//! A thread opens an [`IoQueue`] of a fixed depth ([`crate::BackingStore::open_queue`]), pushes
//! [`IoRequest`]s (each owns its [`IoBuf`]; the engine keeps it until the completion hands it
//! back), calls [`IoQueue::submit`] once per batch and [`IoQueue::reap`]s [`IoCompletion`]s on
//! the same thread. A queue is `Send` but not shared: it may be opened on one thread and handed
//! to another, and then stays with the thread that first submits on it. io_uring runs a
//! request's completion work on the thread that submitted it, and its queues are single-issuer
//! rings: another thread's submit or reap gets [`BackingError::Unsupported`].
//!
//! Every request's result is final: short transfers are resubmitted for their remainder by the
//! engine, and a read that meets end-of-file completes with [`BackingError::ShortRead`].
//! Validation errors (range, `O_DIRECT` alignment) complete the request with an error instead
//! of failing `push`, so the caller sees every outcome in one place.
//!
//! [`SyncQueue`] runs a queue over any [`BackingStore`] by executing each request during
//! `submit`: that is what the psync and pvsync2 engines (and the wrappers) offer, and what fio
//! does for synchronous engines at any `iodepth`.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use crate::buf::IoBuf;
use crate::{BackingError, BackingStore, Result};

/// What a queued request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// Read `buf.len()` bytes at `offset` into `buf`.
    Read,
    /// Write `buf` at `offset`.
    Write,
    /// Make writes completed before this request was pushed durable (fdatasync). Not ordered
    /// against requests still in flight, as with `IORING_OP_FSYNC`.
    Flush,
}

impl IoOp {
    /// The operation name used in errors.
    pub fn name(self) -> &'static str {
        match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
        }
    }
}

/// One queued request. The engine owns `buf` until the matching [`IoCompletion`].
#[derive(Debug)]
pub struct IoRequest {
    /// The operation.
    pub op: IoOp,
    /// Byte offset on the store (ignored by `Flush`).
    pub offset: u64,
    /// Data to write, or where to read (`buf.len()` bytes); unused by `Flush`.
    pub buf: IoBuf,
    /// Returned untouched in the completion.
    pub user_data: u64,
}

impl IoRequest {
    /// A read of `buf.len()` bytes at `offset`.
    pub fn read(offset: u64, buf: IoBuf, user_data: u64) -> Self {
        Self { op: IoOp::Read, offset, buf, user_data }
    }

    /// A write of `buf` at `offset`.
    pub fn write(offset: u64, buf: IoBuf, user_data: u64) -> Self {
        Self { op: IoOp::Write, offset, buf, user_data }
    }

    /// A flush (fdatasync).
    pub fn flush(user_data: u64) -> Self {
        Self { op: IoOp::Flush, offset: 0, buf: IoBuf::new(0), user_data }
    }

    /// Runs the request on `store` with its synchronous calls, now, and hands back its
    /// completion (what [`SyncQueue`] and the test stores' queues do with each request).
    pub fn run_on(mut self, store: &dyn BackingStore) -> IoCompletion {
        let result = match self.op {
            IoOp::Read => store.read_at(&mut self.buf, self.offset),
            IoOp::Write => store.write_at(&self.buf, self.offset),
            IoOp::Flush => store.flush(),
        };
        IoCompletion {
            user_data: self.user_data,
            op: self.op,
            offset: self.offset,
            buf: self.buf,
            result,
        }
    }
}

/// The outcome of one request, with its buffer handed back.
#[derive(Debug)]
pub struct IoCompletion {
    /// The request's `user_data`.
    pub user_data: u64,
    /// The request's operation.
    pub op: IoOp,
    /// The request's offset.
    pub offset: u64,
    /// The request's buffer (for a read, now holding the data).
    pub buf: IoBuf,
    /// `Ok` when every byte was transferred.
    pub result: Result<()>,
}

/// A bounded queue of in-flight requests owned by one thread.
pub trait IoQueue: Send {
    /// The most requests that may be pushed and not yet reaped.
    fn depth(&self) -> usize;
    /// Requests pushed and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Queues a request for the next [`IoQueue::submit`] — or passes it to the kernel at once,
    /// where the engine measured that to keep the device busier (io_uring and libaio on files
    /// the device completes by interrupt). Hands the request back when the queue already holds
    /// [`IoQueue::depth`] requests (reap first).
    fn push(&mut self, req: IoRequest) -> std::result::Result<(), IoRequest>;
    /// Passes every pushed request to the kernel; returns how many were passed.
    fn submit(&mut self) -> Result<usize>;
    /// Submits anything pending, then appends completions to `out` until at least `min` were
    /// appended (fewer only if fewer are in flight). Returns the number appended. `min = 0`
    /// (a poll) never waits: it returns the completions that are ready, and when none are, it
    /// asks the kernel once, without waiting, for those it has finished (an io_uring ring whose
    /// completion work is deferred to its thread, or an IOPOLL ring, posts nothing until it is
    /// entered; libaio keeps them in its context until collected).
    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> Result<usize>;
    /// A file descriptor that polls readable when a completion may be ready to reap (a
    /// wake-up may find none), for a thread that waits on other things too; `None` when the
    /// queue offers none (its caller then waits in `reap`).
    fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
}

/// Bookkeeping shared by the asynchronous engines: a fixed table of slots (one per request in
/// flight), the bytes each has moved so far, and completions that are ready without the kernel.
#[derive(Debug)]
pub(crate) struct Slots {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    ready: VecDeque<IoCompletion>,
    in_flight: usize,
}

#[derive(Debug)]
struct Slot {
    req: IoRequest,
    done_bytes: usize,
    /// Times the kernel answered `EINTR` or `EAGAIN` for this request (see [`Slots::on_result`]).
    transient_failures: u32,
}

/// How many times a queued request is issued again after `EINTR` or `EAGAIN` before that
/// error is its result: the synchronous calls retry `EINTR` too, and an IOPOLL ring can answer
/// `EAGAIN` when the device had no tag free at that moment.
pub(crate) const TRANSIENT_RETRIES_MAX: u32 = 8;

/// The part of a slot's request still to transfer.
pub(crate) struct Remaining {
    pub op: IoOp,
    pub offset: u64,
    pub ptr: *mut u8,
    pub len: usize,
}

impl Slots {
    pub fn new(depth: usize) -> Self {
        assert!(depth > 0, "queue depth must be positive");
        Self {
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            ready: VecDeque::with_capacity(depth),
            in_flight: 0,
        }
    }

    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Requests the kernel holds (in flight and not ready).
    pub fn in_kernel(&self) -> usize {
        self.in_flight - self.ready.len()
    }

    pub fn is_full(&self) -> bool {
        self.in_flight == self.slots.len()
    }

    /// Completes `req` at once (validation failures, synchronous flushes).
    pub fn complete_now(&mut self, req: IoRequest, result: Result<()>) {
        assert!(!self.is_full());
        self.in_flight += 1;
        self.ready.push_back(IoCompletion {
            user_data: req.user_data,
            op: req.op,
            offset: req.offset,
            buf: req.buf,
            result,
        });
    }

    /// Accepts a request that passed (or failed) validation: a failed or empty one completes at
    /// once, anything else takes a slot, which the caller issues to the kernel.
    pub fn admit(&mut self, req: IoRequest, check: Result<()>) -> Option<usize> {
        match check {
            Err(e) => self.complete_now(req, Err(e)),
            Ok(()) if req.buf.is_empty() && req.op != IoOp::Flush => self.complete_now(req, Ok(())),
            Ok(()) => return Some(self.insert(req)),
        }
        None
    }

    /// Takes a slot for `req`; the caller issues it to the kernel.
    pub fn insert(&mut self, req: IoRequest) -> usize {
        let index = self.free.pop().expect("insert into a full queue");
        assert!(self.slots[index].is_none());
        self.slots[index] = Some(Slot { req, done_bytes: 0, transient_failures: 0 });
        self.in_flight += 1;
        index
    }

    pub fn remaining(&mut self, index: usize) -> Remaining {
        let slot = self.slots[index].as_mut().expect("remaining() of an empty slot");
        let len = slot.req.buf.len() - slot.done_bytes;
        Remaining {
            op: slot.req.op,
            offset: slot.req.offset + slot.done_bytes as u64,
            // SAFETY: `done_bytes <= buf.len()`, so the pointer stays inside the allocation.
            ptr: unsafe { slot.req.buf.as_mut_ptr().add(slot.done_bytes) },
            len,
        }
    }

    /// Records a kernel result for a slot. Returns `true` when the slot must be issued again for
    /// its remainder (a short transfer, or `EINTR`/`EAGAIN` up to [`TRANSIENT_RETRIES_MAX`]
    /// times); otherwise the request is complete and ready.
    ///
    /// A result for a slot that holds no request, or one moving more bytes than asked, means
    /// the kernel and this table disagree about which buffers it may still write into: the
    /// process aborts rather than unwind and free them.
    pub fn on_result(&mut self, index: usize, res: io::Result<usize>) -> bool {
        let Some(slot) = self.slots.get_mut(index).and_then(Option::as_mut) else {
            crate::abort_with_io_in_flight(format_args!(
                "a completion for queue slot {index}, which holds no request"
            ))
        };
        let op = slot.req.op;
        let (offset, len) = (slot.req.offset, slot.req.buf.len() as u64);
        let result = match res {
            Err(source)
                if matches!(source.raw_os_error(), Some(libc::EINTR | libc::EAGAIN))
                    && slot.transient_failures < TRANSIENT_RETRIES_MAX =>
            {
                slot.transient_failures += 1;
                return true;
            }
            Err(source) => Err(BackingError::Io { op: op.name(), offset, len, source }),
            Ok(_) if op == IoOp::Flush => Ok(()),
            Ok(0) if slot.done_bytes < slot.req.buf.len() => {
                let got = slot.done_bytes as u64;
                Err(match op {
                    IoOp::Read => BackingError::ShortRead { offset, len, got },
                    _ => BackingError::ShortWrite { offset, len, got },
                })
            }
            Ok(n) => {
                if n > slot.req.buf.len() - slot.done_bytes {
                    crate::abort_with_io_in_flight(format_args!(
                        "the kernel moved {n} bytes for queue slot {index}, which asked for {}",
                        slot.req.buf.len() - slot.done_bytes
                    ))
                }
                slot.done_bytes += n;
                if slot.done_bytes < slot.req.buf.len() {
                    return true;
                }
                Ok(())
            }
        };
        let slot = self.slots[index].take().expect("checked above");
        self.free.push(index);
        self.ready.push_back(IoCompletion {
            user_data: slot.req.user_data,
            op,
            offset,
            buf: slot.req.buf,
            result,
        });
        false
    }

    /// Moves ready completions to `out`; returns how many.
    pub fn drain_ready(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        let n = self.ready.len();
        self.in_flight -= n;
        out.extend(self.ready.drain(..));
        n
    }
}

/// A queue that executes each request synchronously, during `submit`, on any store.
pub struct SyncQueue {
    store: Arc<dyn BackingStore>,
    pending: VecDeque<IoRequest>,
    done: VecDeque<IoCompletion>,
    depth: usize,
}

impl SyncQueue {
    /// A queue of `depth` requests over `store`.
    pub fn new(store: Arc<dyn BackingStore>, depth: usize) -> Self {
        assert!(depth > 0, "queue depth must be positive");
        Self {
            store,
            pending: VecDeque::with_capacity(depth),
            done: VecDeque::with_capacity(depth),
            depth,
        }
    }
}

impl IoQueue for SyncQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.done.len()
    }

    fn push(&mut self, req: IoRequest) -> std::result::Result<(), IoRequest> {
        if self.in_flight() == self.depth {
            return Err(req);
        }
        self.pending.push_back(req);
        Ok(())
    }

    fn submit(&mut self) -> Result<usize> {
        let n = self.pending.len();
        while let Some(req) = self.pending.pop_front() {
            self.done.push_back(req.run_on(self.store.as_ref()));
        }
        Ok(n)
    }

    fn reap(&mut self, _min: usize, out: &mut Vec<IoCompletion>) -> Result<usize> {
        self.submit()?;
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_read(len: usize) -> (Slots, usize) {
        let mut slots = Slots::new(4);
        let slot = slots.admit(IoRequest::read(4096, IoBuf::new(len), 9), Ok(())).expect("slot");
        (slots, slot)
    }

    fn done(slots: &mut Slots) -> IoCompletion {
        let mut out = Vec::new();
        assert_eq!(slots.drain_ready(&mut out), 1);
        assert_eq!(slots.in_flight(), 0);
        out.pop().expect("one completion")
    }

    #[test]
    fn a_short_transfer_is_issued_again_for_its_remainder_then_reported_at_the_end() {
        let (mut slots, slot) = one_read(1000);
        assert!(slots.on_result(slot, Ok(100)));
        let rem = slots.remaining(slot);
        assert_eq!((rem.op, rem.offset, rem.len), (IoOp::Read, 4196, 900));
        assert!(slots.on_result(slot, Ok(400)));
        assert_eq!(slots.remaining(slot).offset, 4596);
        assert!(!slots.on_result(slot, Ok(0)));
        let c = done(&mut slots);
        assert!(
            matches!(c.result, Err(BackingError::ShortRead { offset: 4096, len: 1000, got: 500 })),
            "{:?}",
            c.result
        );
        assert_eq!(c.user_data, 9);
    }

    #[test]
    fn interrupted_and_busy_results_are_retried_a_bounded_number_of_times() {
        let (mut slots, slot) = one_read(512);
        assert!(slots.on_result(slot, Err(io::Error::from_raw_os_error(libc::EINTR))));
        assert!(slots.on_result(slot, Err(io::Error::from_raw_os_error(libc::EAGAIN))));
        assert!(!slots.on_result(slot, Ok(512)));
        done(&mut slots).result.expect("read after two retries");

        let (mut slots, slot) = one_read(512);
        for _ in 0..TRANSIENT_RETRIES_MAX {
            assert!(slots.on_result(slot, Err(io::Error::from_raw_os_error(libc::EAGAIN))));
        }
        assert!(!slots.on_result(slot, Err(io::Error::from_raw_os_error(libc::EAGAIN))));
        let err = done(&mut slots).result.unwrap_err();
        assert!(matches!(err, BackingError::Io { op: "read", offset: 4096, len: 512, .. }));
        assert_eq!(err.errno(), libc::EAGAIN);

        let (mut slots, slot) = one_read(512);
        assert!(!slots.on_result(slot, Err(io::Error::from_raw_os_error(libc::EIO))));
        assert_eq!(done(&mut slots).result.unwrap_err().errno(), libc::EIO);
    }

    /// A completion naming a slot with no request aborts the process (it may not unwind and
    /// free buffers the kernel could still write into): checked in a child process.
    #[test]
    fn a_completion_for_an_empty_slot_aborts() {
        const CHILD: &str = "PMCACHE_TEST_EMPTY_SLOT_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let (mut slots, _) = one_read(512);
            slots.on_result(3, Ok(512));
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "queue::tests::a_completion_for_an_empty_slot_aborts"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{}\n{stderr}", out.status);
        assert!(
            stderr.contains(
                "a completion for queue slot 3, which holds no request, with I/O in flight: aborting"
            ),
            "{stderr}"
        );
    }
}
