//! The engine lane a frontend connection or queue serves: NBD's `ExportConn` (`crate::nbd`)
//! and ublk's `Target` (`crate::ublk`) are both implemented on it, with the batch calls they
//! share here, and the read latencies by class (hits answered at once, misses answered when
//! their backing read completes) that `pmcache stats` reports.

use std::os::fd::BorrowedFd;
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

use hdrhistogram::Histogram;
use pmcache_engine::{
    Error, Lane, MonotonicClock, READS_PENDING_MAX, ReadRequest, ReadStart, WriteRequest,
    WriteStart,
};

use crate::Backing;

/// Read latencies recorded by a connection before they are added to the process's.
const LATENCY_FLUSH_RECORDS: u64 = 4096;

/// The server's read latencies, from a read's hand-over to the engine to its answer: hits
/// (answered as the batch is started) and misses (answered when their backing read is).
pub struct ReadLatencies {
    hit: Mutex<Histogram<u64>>,
    miss: Mutex<Histogram<u64>>,
}

fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

/// The process's read latencies (one cache is served per process).
pub static READ_LATENCIES: LazyLock<ReadLatencies> = LazyLock::new(|| ReadLatencies {
    hit: Mutex::new(latency_histogram()),
    miss: Mutex::new(latency_histogram()),
});

impl ReadLatencies {
    /// `(name, value)` pairs for `stats`: count, p50, p90, p99 and max of each class, in ns.
    pub fn stats(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (class, h) in [("hit", &self.hit), ("miss", &self.miss)] {
            let h = h.lock().unwrap_or_else(|e| e.into_inner());
            out.push((format!("read_{class}_latency_count"), h.len()));
            for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
                out.push((format!("read_{class}_latency_ns_{name}"), h.value_at_quantile(q)));
            }
            out.push((format!("read_{class}_latency_ns_max"), h.max()));
        }
        out
    }

    fn add(&self, hit: &mut Histogram<u64>, miss: &mut Histogram<u64>) {
        for (global, local) in [(&self.hit, hit), (&self.miss, miss)] {
            if !local.is_empty() {
                let mut g = global.lock().unwrap_or_else(|e| e.into_inner());
                let _saturated = g.add(&*local);
                local.reset();
            }
        }
    }
}

/// The requests of one batch, held without allocating up to a typical batch.
type Batch<T> = smallvec::SmallVec<[T; 16]>;

/// What receives each completed miss: its ticket, and its data or the frontend's error.
pub(crate) type Completed<'a, E> = dyn FnMut(usize, Result<&[u8], E>) + 'a;

/// One engine lane, served by one frontend connection or queue: NBD's `ExportConn` in
/// `crate::nbd`, ublk's `Target` in `crate::ublk`. Its reads' latencies go to
/// [`READ_LATENCIES`].
pub struct CacheConn<'e> {
    pub(crate) lane: Lane<'e, crate::CacheMedium, Backing, MonotonicClock>,
    /// The engine's outcomes of one batch, kept from batch to batch.
    results: Vec<Result<(), Error>>,
    starts: Vec<ReadStart>,
    write_starts: Vec<WriteStart>,
    /// When each miss in flight was handed over, by ticket.
    miss_started: Box<[Option<Instant>]>,
    hit_ns: Histogram<u64>,
    miss_ns: Histogram<u64>,
}

impl<'e> CacheConn<'e> {
    /// Serves `lane`.
    pub fn new(lane: Lane<'e, crate::CacheMedium, Backing, MonotonicClock>) -> Self {
        Self {
            lane,
            results: Vec::new(),
            starts: Vec::new(),
            write_starts: Vec::new(),
            miss_started: vec![None; READS_PENDING_MAX].into_boxed_slice(),
            hit_ns: latency_histogram(),
            miss_ns: latency_histogram(),
        }
    }

    /// The lane served, for calls into the engine beside the frontend's.
    pub fn lane(&mut self) -> &mut Lane<'e, crate::CacheMedium, Backing, MonotonicClock> {
        &mut self.lane
    }

    /// The writes a frontend had in flight together, group-committed by the engine
    /// (`Lane::write_batch`); their outcomes appended to `outcomes` through `map`.
    pub(crate) fn write_batch_into<'a, E>(
        &mut self,
        writes: impl Iterator<Item = WriteRequest<'a>>,
        outcomes: &mut Vec<Result<(), E>>,
        map: fn(Error) -> E,
    ) {
        let requests: Batch<WriteRequest<'a>> = writes.collect();
        self.lane.write_batch(&requests, &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(map)));
    }

    /// The writes a frontend had in flight together, started by the engine
    /// (`Lane::write_batch_start`: group-committed in write-back modes, whole blocks left in
    /// flight to the backing store otherwise): for each, in order, `answered(result)` or
    /// `pending(ticket)`, appended to `started`.
    pub(crate) fn write_batch_start_into<'a, S>(
        &mut self,
        writes: impl Iterator<Item = WriteRequest<'a>>,
        started: &mut Vec<S>,
        answered: impl Fn(Result<(), Error>) -> S,
        pending: impl Fn(usize) -> S,
    ) {
        let requests: Batch<WriteRequest<'a>> = writes.collect();
        self.lane.write_batch_start(&requests, &mut self.write_starts);
        started.extend(self.write_starts.drain(..).map(|s| match s {
            WriteStart::Done(result) => answered(result),
            WriteStart::Pending(ticket) => pending(ticket.index()),
        }));
    }

    /// The reads a frontend had in flight together, started by the engine
    /// (`Lane::read_batch_start`): for each, in order, `answered(result)` when answered (its
    /// buffer filled) or `pending(ticket)` when in flight, appended to `started`.
    pub(crate) fn read_batch_start_into<'a, S>(
        &mut self,
        reads: impl Iterator<Item = ReadRequest<'a>>,
        started: &mut Vec<S>,
        answered: impl Fn(Result<(), Error>) -> S,
        pending: impl Fn(usize) -> S,
    ) {
        let mut requests: Batch<ReadRequest<'a>> = reads.collect();
        let began = Instant::now();
        self.lane.read_batch_start(&mut requests, &mut self.starts);
        let hit_ns = began.elapsed().as_nanos() as u64;
        for s in self.starts.drain(..) {
            started.push(match s {
                ReadStart::Done(result) => {
                    if result.is_ok() {
                        self.hit_ns.saturating_record(hit_ns.max(1));
                    }
                    answered(result)
                }
                ReadStart::Pending(ticket) => {
                    self.miss_started[ticket.index()] = Some(began);
                    pending(ticket.index())
                }
            });
        }
        self.note_latencies();
    }

    /// Hands completed misses to `done` (ticket, data or error through `map`), waiting for at
    /// least `min` of them (`Lane::complete`).
    pub(crate) fn complete_into<E>(
        &mut self,
        min: usize,
        done: &mut Completed<'_, E>,
        map: fn(Error) -> E,
    ) -> usize {
        let (miss_started, miss_ns) = (&mut self.miss_started, &mut self.miss_ns);
        let n = self.lane.complete(min, &mut |ticket, result| {
            if let Some(began) = miss_started[ticket.index()].take()
                && result.is_ok()
            {
                miss_ns.saturating_record((began.elapsed().as_nanos() as u64).max(1));
            }
            done(ticket.index(), result.map_err(map));
        });
        self.note_latencies();
        n
    }

    /// The descriptor that polls readable when a miss may have completed.
    pub(crate) fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        self.lane.completion_fd()
    }

    fn note_latencies(&mut self) {
        if self.hit_ns.len() + self.miss_ns.len() >= LATENCY_FLUSH_RECORDS {
            READ_LATENCIES.add(&mut self.hit_ns, &mut self.miss_ns);
        }
    }

    /// The reads a frontend had in flight together, all answered on return
    /// (`Lane::read_batch`); their outcomes appended to `outcomes` through `map`.
    pub(crate) fn read_batch_into<'a, E>(
        &mut self,
        reads: impl Iterator<Item = ReadRequest<'a>>,
        outcomes: &mut Vec<Result<(), E>>,
        map: fn(Error) -> E,
    ) {
        let mut requests: Batch<ReadRequest<'a>> = reads.collect();
        self.lane.read_batch(&mut requests, &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(map)));
    }
}

impl Drop for CacheConn<'_> {
    fn drop(&mut self) {
        READ_LATENCIES.add(&mut self.hit_ns, &mut self.miss_ns);
    }
}
