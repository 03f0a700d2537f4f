//! The queued interface over `rbd_aio_*`: each request is issued with a completion whose
//! callback (on a librbd thread) files its result in [`Done`] and wakes the queue's thread
//! (a condition variable for `reap`, an eventfd for a thread that polls).

use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{Handle, check_request, errno, ffi};
use crate::{BackingError, IoCompletion, IoOp, IoQueue, IoRequest, Result};

/// Results filed by librbd's callbacks: (slot, return value).
struct Done {
    results: Mutex<Vec<(usize, isize)>>,
    wake: Condvar,
    eventfd: OwnedFd,
}

impl Done {
    fn lock(&self) -> MutexGuard<'_, Vec<(usize, isize)>> {
        // A callback never panics while holding the lock; a poisoned lock still holds
        // whole entries.
        self.results.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a completion's callback gets: where to file the result, for which slot.
struct CallbackArg {
    api: &'static ffi::Api,
    done: Arc<Done>,
    slot: usize,
}

/// Runs on a librbd thread when a request completes.
unsafe extern "C" fn on_complete(completion: ffi::Completion, arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<CallbackArg>` leaked for this completion at submit, and librbd
    // calls this once per completion.
    let arg = unsafe { Box::from_raw(arg.cast::<CallbackArg>()) };
    // SAFETY: the completion is live until the queue releases it, after this result is filed.
    let ret = unsafe { (arg.api.rbd_aio_get_return_value)(completion) };
    arg.done.lock().push((arg.slot, ret));
    arg.done.wake.notify_all();
    // A full counter (never: it is read at every reap) would only skip a wake-up.
    let _ = rustix::io::write(&arg.done.eventfd, &1u64.to_ne_bytes());
}

/// A request librbd holds.
struct InFlight {
    req: IoRequest,
    completion: ffi::Completion,
}

/// A queue of `rbd_aio_*` requests owned by one thread.
pub(super) struct RbdQueue {
    handle: Arc<Handle>,
    depth: usize,
    size_bytes: u64,
    read_only: bool,
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    /// Pushed, not yet submitted.
    pending: VecDeque<IoRequest>,
    /// Completed (refused at push, or reaped from `done`), not yet handed out.
    ready: VecDeque<IoCompletion>,
    done: Arc<Done>,
    /// Pushed and not yet handed out.
    in_flight: usize,
}

// SAFETY: the completions are librbd objects usable from any thread; the buffers are owned
// `IoBuf`s; the queue is used by one thread at a time (`&mut self`).
unsafe impl Send for RbdQueue {}

impl RbdQueue {
    pub(super) fn new(
        handle: Arc<Handle>,
        depth: usize,
        size_bytes: u64,
        read_only: bool,
    ) -> Result<Self> {
        assert!(depth > 0, "queue depth must be positive");
        let eventfd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| BackingError::NoResources {
            engine: super::RBD_ENGINE,
            what: "create an eventfd".into(),
            source: e.into(),
        })?;
        Ok(Self {
            handle,
            depth,
            size_bytes,
            read_only,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            pending: VecDeque::with_capacity(depth),
            ready: VecDeque::with_capacity(depth),
            done: Arc::new(Done {
                results: Mutex::new(Vec::with_capacity(depth)),
                wake: Condvar::new(),
                eventfd,
            }),
            in_flight: 0,
        })
    }

    fn check(&self, req: &IoRequest) -> Result<()> {
        if req.op != IoOp::Read {
            self.handle.check_write(req.op.name())?;
        }
        if req.op == IoOp::Flush {
            return Ok(());
        }
        let len = req.buf.len() as u64;
        check_request(self.read_only, self.size_bytes, req.op.name(), req.offset, len)
    }

    /// The error for `req` answered with `ret` (< 0): for a write or a flush, one that shows
    /// the lock lost is [`BackingError::LockLost`].
    fn failed(&self, op: IoOp, offset: u64, len: u64, ret: isize) -> BackingError {
        let error = io_error(op.name(), offset, len, ret);
        if op == IoOp::Read { error } else { self.handle.write_failed(ret as i64, error) }
    }

    /// Issues one request to librbd.
    fn issue(&mut self, mut req: IoRequest) {
        let api = self.handle.api;
        let slot = self.free.pop().expect("a free slot for every pushed request");
        let arg = Box::into_raw(Box::new(CallbackArg { api, done: self.done.clone(), slot }));
        let mut completion: ffi::Completion = std::ptr::null_mut();
        // SAFETY: `arg` stays valid until the callback takes it back; `completion` receives the
        // new completion.
        let ret =
            unsafe { (api.rbd_aio_create_completion)(arg.cast(), on_complete, &mut completion) };
        if ret < 0 {
            // SAFETY: the completion was not created, so no callback will take `arg`.
            drop(unsafe { Box::from_raw(arg) });
            self.free.push(slot);
            self.ready.push_back(completion_of(
                req,
                Err(io_error("create a completion", 0, 0, ret as isize)),
            ));
            return;
        }
        let (offset, len, ptr) = (req.offset, req.buf.len(), req.buf.as_mut_ptr());
        let image = self.handle.image;
        // SAFETY: open image; the buffer is owned by the request kept in `slots[slot]` until its
        // completion is reaped (or waited for at drop), so it outlives librbd's use of it.
        let ret = unsafe {
            match req.op {
                IoOp::Read => (api.rbd_aio_read)(image, offset, len, ptr.cast(), completion),
                IoOp::Write => (api.rbd_aio_write)(image, offset, len, ptr.cast(), completion),
                IoOp::Flush => (api.rbd_aio_flush)(image, completion),
            }
        };
        if ret < 0 {
            // librbd reports errors through the completion; a refusal here means the
            // completion was never queued, so its callback never runs: its argument is leaked
            // rather than freed under a callback that might, after all, run.
            // SAFETY: the completion was created above and is not queued.
            unsafe { (api.rbd_aio_release)(completion) };
            self.free.push(slot);
            let error = self.failed(req.op, offset, len as u64, ret as isize);
            self.ready.push_back(completion_of(req, Err(error)));
            return;
        }
        self.slots[slot] = Some(InFlight { req, completion });
    }

    /// Moves results filed by callbacks into `ready`; returns how many.
    fn collect(&mut self, results: Vec<(usize, isize)>) -> usize {
        let n = results.len();
        for (slot, ret) in results {
            let InFlight { req, completion } =
                self.slots[slot].take().expect("a completed slot holds its request");
            // SAFETY: the callback ran (it filed this result); the completion is released once.
            unsafe { (self.handle.api.rbd_aio_release)(completion) };
            self.free.push(slot);
            let len = if req.op == IoOp::Flush { 0 } else { req.buf.len() };
            let result = if ret < 0 {
                Err(self.failed(req.op, req.offset, len as u64, ret))
            } else if req.op == IoOp::Read && (ret as usize) < len {
                Err(BackingError::ShortRead {
                    offset: req.offset,
                    len: len as u64,
                    got: ret as u64,
                })
            } else {
                Ok(())
            };
            self.ready.push_back(completion_of(req, result));
        }
        n
    }

    /// Requests librbd holds.
    fn in_librbd(&self) -> usize {
        self.depth - self.free.len()
    }
}

fn io_error(op: &'static str, offset: u64, len: u64, ret: isize) -> BackingError {
    BackingError::Io { op, offset, len, source: errno(ret as i64) }
}

fn completion_of(req: IoRequest, result: Result<()>) -> IoCompletion {
    IoCompletion { user_data: req.user_data, op: req.op, offset: req.offset, buf: req.buf, result }
}

impl IoQueue for RbdQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn push(&mut self, req: IoRequest) -> std::result::Result<(), IoRequest> {
        if self.in_flight == self.depth {
            return Err(req);
        }
        self.in_flight += 1;
        match self.check(&req) {
            Err(e) => self.ready.push_back(completion_of(req, Err(e))),
            Ok(()) if req.buf.is_empty() && req.op != IoOp::Flush => {
                self.ready.push_back(completion_of(req, Ok(())))
            }
            Ok(()) => self.pending.push_back(req),
        }
        Ok(())
    }

    fn submit(&mut self) -> Result<usize> {
        let n = self.pending.len();
        while let Some(req) = self.pending.pop_front() {
            self.issue(req);
        }
        Ok(n)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> Result<usize> {
        self.submit()?;
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&self.done.eventfd, &mut counter);
        let ready = std::mem::take(&mut *self.done.lock());
        self.collect(ready);
        let mut appended = 0;
        loop {
            while let Some(c) = self.ready.pop_front() {
                out.push(c);
                appended += 1;
                self.in_flight -= 1;
            }
            if appended >= min || self.in_librbd() == 0 {
                return Ok(appended);
            }
            let results = {
                let mut results = self.done.lock();
                while results.is_empty() {
                    results = self.done.wake.wait(results).unwrap_or_else(|e| e.into_inner());
                }
                std::mem::take(&mut *results)
            };
            self.collect(results);
        }
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.done.eventfd.as_fd())
    }
}

impl Drop for RbdQueue {
    fn drop(&mut self) {
        let api = self.handle.api;
        for slot in self.slots.iter_mut() {
            if let Some(InFlight { req, completion }) = slot.take() {
                // SAFETY: the completion is live; waiting keeps the request's buffer alive until
                // librbd is done with it (its callback has then run: librbd marks a completion
                // complete after calling it).
                unsafe {
                    (api.rbd_aio_wait_for_complete)(completion);
                    (api.rbd_aio_release)(completion);
                }
                drop(req);
            }
        }
    }
}
