//! A backing store whose queued requests complete only when the test lets them, as a slow
//! device's would. Each read or write reaches the device either when it is submitted (a read's
//! data is what the device held then) or, with [`LatchedBacking::land_late`], only when its
//! completion is let through (a write lands late, as on a network disk: a read started
//! meanwhile sees the old data); its completion is held while the latch is closed. What the
//! engine and a frontend do with requests overlapping a miss or a write-through in flight is
//! tested with it.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use pmcache_backing::{BackingStore, IoCompletion, IoQueue, IoRequest};

use super::SimBacking;
use super::model::{World, config, pattern};
use crate::{AdmissionConfig, CacheMode, Engine, EvictionKind, ManualClock};

/// The latch: closed, queued requests' completions wait.
struct Latch {
    closed: Mutex<bool>,
    opened: Condvar,
    /// Readable while the latch is open (what a queue's `completion_fd` polls): a byte is
    /// written to `signal` when it opens, and drained from it when it closes.
    event: UnixStream,
    signal: UnixStream,
}

impl Latch {
    fn set(&self, closed: bool) {
        let mut was_closed = self.closed.lock().expect("poisoned");
        if *was_closed != closed {
            if closed {
                let mut byte = [0u8; 1];
                (&self.event).read_exact(&mut byte).expect("drain the latch's signal");
            } else {
                (&self.signal).write_all(&[1]).expect("signal the latch");
            }
        }
        *was_closed = closed;
        self.opened.notify_all();
    }

    fn is_closed(&self) -> bool {
        *self.closed.lock().expect("poisoned")
    }
}

/// A [`SimBacking`] whose queue holds completions while its latch is closed.
pub struct LatchedBacking {
    /// The device underneath.
    pub inner: SimBacking,
    latch: Arc<Latch>,
    /// Queued requests run on the device when their completion is let through, not at submit.
    late: AtomicBool,
    /// Reads that reached the device: (queued, synchronous `read_at`).
    reads: Arc<[AtomicU64; 2]>,
}

impl LatchedBacking {
    /// Over `inner`, the latch open.
    pub fn new(inner: SimBacking) -> Arc<Self> {
        let (event, signal) = UnixStream::pair().expect("a socket pair for the latch");
        let latch = Latch { closed: Mutex::new(true), opened: Condvar::new(), event, signal };
        let latch = Arc::new(latch);
        latch.set(false);
        let reads = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        Arc::new(Self { inner, latch, late: AtomicBool::new(false), reads })
    }

    /// Makes the requests of queues opened from now on run on the device only when their
    /// completion is let through (`true`), or at submit (`false`, the default).
    pub fn land_late(&self, late: bool) {
        self.late.store(late, Ordering::SeqCst);
    }

    /// Closes (`true`) or opens the latch that queued requests' completions wait at.
    pub fn hold(&self, closed: bool) {
        self.latch.set(closed);
    }

    /// Reads the device took so far: (queued requests, synchronous `read_at` calls).
    pub fn reads(&self) -> (u64, u64) {
        (self.reads[0].load(Ordering::SeqCst), self.reads[1].load(Ordering::SeqCst))
    }
}

impl BackingStore for LatchedBacking {
    pmcache_backing::forward_to!(inner: size_bytes, logical_block_size, identity, write_at, flush,
        discard, write_zeroes);
    fn read_at(&self, buf: &mut [u8], offset: u64) -> pmcache_backing::Result<()> {
        self.reads[1].fetch_add(1, Ordering::SeqCst);
        self.inner.read_at(buf, offset)
    }
    fn engine_name(&self) -> &'static str {
        "latched"
    }
    fn open_queue(&self, depth: usize) -> pmcache_backing::Result<Box<dyn IoQueue>> {
        Ok(Box::new(LatchedQueue {
            device: self.inner.clone(),
            late: self.late.load(Ordering::SeqCst),
            latch: self.latch.clone(),
            reads: self.reads.clone(),
            pushed: VecDeque::with_capacity(depth),
            held: VecDeque::with_capacity(depth),
            depth,
        }))
    }
}

/// Runs each request on the device at submit (or, landing late, when its completion is let
/// through); holds its completion while the latch is closed.
struct LatchedQueue {
    device: SimBacking,
    late: bool,
    latch: Arc<Latch>,
    reads: Arc<[AtomicU64; 2]>,
    /// Pushed, not submitted yet.
    pushed: VecDeque<IoRequest>,
    /// Submitted: run already (landing at submit) or still to run (landing late).
    held: VecDeque<Held>,
    depth: usize,
}

enum Held {
    Ran(IoCompletion),
    ToRun(IoRequest),
}

impl IoQueue for LatchedQueue {
    fn depth(&self) -> usize {
        self.depth
    }
    fn in_flight(&self) -> usize {
        self.pushed.len() + self.held.len()
    }
    fn push(&mut self, req: IoRequest) -> Result<(), IoRequest> {
        if self.in_flight() == self.depth {
            return Err(req);
        }
        if req.op == pmcache_backing::IoOp::Read {
            self.reads[0].fetch_add(1, Ordering::SeqCst);
        }
        self.pushed.push_back(req);
        Ok(())
    }
    fn submit(&mut self) -> pmcache_backing::Result<usize> {
        let n = self.pushed.len();
        while let Some(req) = self.pushed.pop_front() {
            self.held.push_back(if self.late {
                Held::ToRun(req)
            } else {
                Held::Ran(req.run_on(&self.device))
            });
        }
        Ok(n)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> pmcache_backing::Result<usize> {
        self.submit()?;
        let mut closed = self.latch.closed.lock().expect("poisoned");
        let mut got = 0;
        loop {
            while !*closed && let Some(held) = self.held.pop_front() {
                out.push(match held {
                    Held::Ran(completion) => completion,
                    Held::ToRun(req) => req.run_on(&self.device),
                });
                got += 1;
            }
            if got >= min.min(got + self.held.len()) {
                return Ok(got);
            }
            closed = self.latch.opened.wait(closed).expect("poisoned");
        }
    }
    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.latch.event.as_fd())
    }
}

impl LatchedBacking {
    /// Whether the latch is closed.
    pub fn held(&self) -> bool {
        self.latch.is_closed()
    }
}

/// An engine whose backing store is latched.
pub type LatchedEngine = Engine<super::model::SimMedium, Arc<LatchedBacking>, Arc<ManualClock>>;

/// An engine in `mode` (CLOCK, admitting always, 4 lanes) over a latched store whose blocks
/// hold `pattern(1, ..)`; the store offers a queue.
pub fn latched_engine(mode: CacheMode) -> (Arc<LatchedBacking>, LatchedEngine) {
    let world = World::fresh(1);
    let device = pattern(1, 0, world.backing.size_bytes());
    world.backing.write_at(&device, 0).expect("fill the device");
    let backing = LatchedBacking::new(world.backing.clone());
    let cfg = crate::Config {
        max_lanes: 4,
        ..config(mode, EvictionKind::Clock, AdmissionConfig::Always)
    };
    let engine = Engine::format(world.medium.clone(), backing.clone(), Arc::default(), &cfg)
        .expect("format");
    (backing, engine)
}
