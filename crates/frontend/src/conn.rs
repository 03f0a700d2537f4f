//! The engine lane a frontend connection or queue serves: [`CacheConn`], the one
//! implementation of `pmcache_block::BlockConn` that NBD connections and ublk queues run, and
//! the read latencies by class (hits answered at once, misses answered when their backing read
//! completes) that `pmcache stats` reports.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hdrhistogram::Histogram;
use pmcache_block::{
    BatchRead, BatchWrite, BlockConn, BlockError, BlockExtent, Completed, Started,
};
use pmcache_engine::{
    Error, Lane, MonotonicClock, READS_PENDING_MAX, ReadRequest, ReadStart, WriteRequest,
    WriteStart,
};

use crate::Backing;

/// Read latencies recorded by a connection before they are added to the server's.
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

impl Default for ReadLatencies {
    fn default() -> Self {
        Self { hit: Mutex::new(latency_histogram()), miss: Mutex::new(latency_histogram()) }
    }
}

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

/// One engine lane, served by one NBD connection or one ublk queue as their
/// `pmcache_block::BlockConn`. Its reads' latencies go to the server's [`ReadLatencies`].
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
    /// Where the latencies go, every `LATENCY_FLUSH_RECORDS` and at the end.
    latencies: Arc<ReadLatencies>,
}

impl<'e> CacheConn<'e> {
    /// Serves `lane`, its reads' latencies added to `latencies`.
    pub fn new(
        lane: Lane<'e, crate::CacheMedium, Backing, MonotonicClock>,
        latencies: Arc<ReadLatencies>,
    ) -> Self {
        Self {
            latencies,
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

    fn note_latencies(&mut self) {
        if self.hit_ns.len() + self.miss_ns.len() >= LATENCY_FLUSH_RECORDS {
            self.latencies.add(&mut self.hit_ns, &mut self.miss_ns);
        }
    }
}

/// The engine's error as the frontends report it: its errno and message.
pub(crate) fn block_error(err: Error) -> BlockError {
    BlockError::new(err.errno(), err.to_string())
}

fn write_requests<'a>(writes: &'a [BatchWrite<'_>]) -> Batch<WriteRequest<'a>> {
    writes
        .iter()
        .map(|w| WriteRequest { offset: w.offset_bytes, data: w.data, fua: w.fua })
        .collect()
}

fn read_requests<'a>(reads: &'a mut [BatchRead<'_>]) -> Batch<ReadRequest<'a>> {
    reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf }).collect()
}

impl BlockConn for CacheConn<'_> {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.lane.read(offset_bytes, buf).map_err(block_error)
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        self.lane.write(offset_bytes, data, fua).map_err(block_error)
    }

    /// Group-committed by the engine (`Lane::write_batch`).
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        self.lane.write_batch(&write_requests(writes), &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(block_error)));
    }

    /// Group-committed in write-back modes, whole blocks left in flight to the backing store
    /// otherwise (`Lane::write_batch_start`).
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<Started>) {
        self.lane.write_batch_start(&write_requests(writes), &mut self.write_starts);
        started.extend(self.write_starts.drain(..).map(|s| match s {
            WriteStart::Done(result) => Started::Done(result.map_err(block_error)),
            WriteStart::Pending(ticket) => Started::Pending(ticket.index()),
        }));
    }

    /// Pipelined by the engine (`Lane::read_batch`), all answered on return.
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        self.lane.read_batch(&mut read_requests(reads), &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(block_error)));
    }

    /// Hits answered at once, misses left in flight on the lane's queue
    /// (`Lane::read_batch_start`); each class's latency recorded.
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        let mut requests = read_requests(reads);
        let began = Instant::now();
        self.lane.read_batch_start(&mut requests, &mut self.starts);
        let hit_ns = began.elapsed().as_nanos() as u64;
        for s in self.starts.drain(..) {
            started.push(match s {
                ReadStart::Done(result) => {
                    if result.is_ok() {
                        self.hit_ns.saturating_record(hit_ns.max(1));
                    }
                    Started::Done(result.map_err(block_error))
                }
                ReadStart::Pending(ticket) => {
                    self.miss_started[ticket.index()] = Some(began);
                    Started::Pending(ticket.index())
                }
            });
        }
        self.note_latencies();
    }

    fn pending(&self) -> usize {
        self.lane.pending()
    }

    fn pending_max(&self) -> usize {
        READS_PENDING_MAX
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        self.lane.completion_fd()
    }

    /// Completed misses handed over (`Lane::complete`), each one's latency recorded.
    fn complete(&mut self, min: usize, done: &mut Completed<'_>) -> usize {
        let (miss_started, miss_ns) = (&mut self.miss_started, &mut self.miss_ns);
        let n = self.lane.complete(min, &mut |ticket, result| {
            if let Some(began) = miss_started[ticket.index()].take()
                && result.is_ok()
            {
                miss_ns.saturating_record((began.elapsed().as_nanos() as u64).max(1));
            }
            done(ticket.index(), result.map_err(block_error));
        });
        self.note_latencies();
        n
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        self.lane.flush().map_err(block_error)
    }

    /// Holes of the backing store not cached are holes that read as zeroes; the rest is
    /// data (`Engine::extents`).
    fn block_status(
        &mut self,
        offset_bytes: u64,
        len_bytes: u32,
        extents_max: usize,
        extents: &mut Vec<BlockExtent>,
    ) -> Result<(), BlockError> {
        let mut found = Vec::with_capacity(extents_max.min(64));
        let engine = self.lane.engine();
        engine
            .extents(offset_bytes, u64::from(len_bytes), extents_max, &mut found)
            .map_err(block_error)?;
        extents.extend(found.into_iter().map(|e| BlockExtent {
            // Within the request's length, a u32.
            len_bytes: u32::try_from(e.len).unwrap_or(len_bytes),
            hole: e.hole,
            zero: e.hole,
        }));
        Ok(())
    }

    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), BlockError> {
        self.lane.trim(offset_bytes, len_bytes).map_err(block_error)?;
        if fua { self.flush() } else { Ok(()) }
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), BlockError> {
        self.lane.write_zeroes(offset_bytes, len_bytes, fua).map_err(block_error)
    }
}

impl Drop for CacheConn<'_> {
    fn drop(&mut self) {
        self.latencies.add(&mut self.hit_ns, &mut self.miss_ns);
    }
}
