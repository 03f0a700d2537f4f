//! `MemExport`: a RAM-backed [`Export`] for tests, examples and benchmarks.
//!
//! The bytes live in fixed 1 MiB stripes, each behind its own `RwLock`, so connections that
//! touch different stripes do not contend. Allocation is zeroed and lazy (untouched pages
//! cost nothing). Flush and FUA are no-ops (RAM has nothing to persist to), which makes the
//! export safe for `NBD_FLAG_CAN_MULTI_CONN`. Counters record flushes, FUA writes and batched
//! reads and writes so tests can check that those requests reach the export, and a fault range
//! makes every operation touching it fail with a chosen errno.
//!
//! For the server's out-of-order replies, reads can be left in flight (`read_batch_start`):
//! with [`MemExport::set_reads_reordered`] every read of a batch of two or more completes
//! later, in reverse order; with [`MemExport::hold_reads`] the reads of a range complete only
//! when it is released, as a slow device's would. Either way a read takes its data when it
//! starts.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

use pmcache_block::{BatchRead, BlockConn, BlockError, Started};

use crate::export::{BlockSizes, Export};

/// Reads one connection leaves in flight at most.
const READS_IN_FLIGHT_MAX: usize = 64;

const STRIPE_BYTES: u64 = 1 << 20;

/// Counts of the requests that reached a [`MemExport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Read calls.
    pub reads: u64,
    /// Reads that arrived in a batch of two or more (also counted in `reads`).
    pub batched_reads: u64,
    /// Write calls.
    pub writes: u64,
    /// Writes that arrived in a batch of two or more (also counted in `writes`).
    pub batched_writes: u64,
    /// Write, trim and write-zeroes calls with FUA set.
    pub fua_ops: u64,
    /// Flush calls.
    pub flushes: u64,
    /// Trim calls.
    pub trims: u64,
    /// Write-zeroes calls.
    pub zero_writes: u64,
    /// Connections opened.
    pub conns_opened: u64,
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    batched_reads: AtomicU64,
    writes: AtomicU64,
    batched_writes: AtomicU64,
    fua_ops: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    zero_writes: AtomicU64,
    conns_opened: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Fault {
    start_bytes: u64,
    end_bytes: u64,
    errno: i32,
}

#[derive(Debug)]
struct Inner {
    stripes: Box<[RwLock<Box<[u8]>>]>,
    size_bytes: u64,
    block_sizes: BlockSizes,
    counters: Counters,
    has_fault: AtomicBool,
    fault: Mutex<Option<Fault>>,
    /// `open_conn` fails while set (a server out of engine lanes, say).
    refuse_conns: AtomicBool,
    /// Every read of a batch of two or more is left in flight (completed in reverse order).
    reads_reordered: AtomicBool,
    held: ReadHold,
}

/// The range whose reads stay in flight, and a descriptor that polls readable while none is
/// held (a byte is in `event` exactly then).
#[derive(Debug)]
struct ReadHold {
    range: Mutex<Option<(u64, u64)>>,
    released: Condvar,
    event: UnixStream,
    signal: UnixStream,
}

impl ReadHold {
    fn new() -> Self {
        let (event, signal) = UnixStream::pair().expect("a socket pair for the read hold");
        (&signal).write_all(&[1]).expect("signal the read hold");
        Self { range: Mutex::new(None), released: Condvar::new(), event, signal }
    }

    fn set(&self, range: Option<(u64, u64)>) {
        let mut held = self.range.lock().unwrap_or_else(|p| p.into_inner());
        match (held.is_some(), range.is_some()) {
            (false, true) => (&self.event).read_exact(&mut [0u8]).expect("drain the read hold"),
            (true, false) => (&self.signal).write_all(&[1]).expect("signal the read hold"),
            _ => {}
        }
        *held = range;
        self.released.notify_all();
    }

    fn holds(range: Option<(u64, u64)>, offset_bytes: u64, len: usize) -> bool {
        range.is_some_and(|(start, end)| offset_bytes < end && offset_bytes + len as u64 > start)
    }
}

/// A RAM-backed export. Cloning shares the same bytes.
#[derive(Debug, Clone)]
pub struct MemExport {
    inner: Arc<Inner>,
}

impl MemExport {
    /// A zero-filled export of `size_bytes` with the given block size constraints.
    pub fn new(size_bytes: u64, block_sizes: BlockSizes) -> Result<Self, BlockError> {
        block_sizes.validate().map_err(|m| BlockError::new(libc::EINVAL, m))?;
        if !size_bytes.is_multiple_of(u64::from(block_sizes.min_bytes)) {
            return Err(BlockError::new(libc::EINVAL, "size is not a multiple of min block"));
        }
        let stripe_count = size_bytes.div_ceil(STRIPE_BYTES);
        let stripes = (0..stripe_count)
            .map(|i| {
                let len = (size_bytes - i * STRIPE_BYTES).min(STRIPE_BYTES);
                // Bounded: len <= STRIPE_BYTES, which fits in usize.
                RwLock::new(vec![0u8; len as usize].into_boxed_slice())
            })
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                stripes,
                size_bytes,
                block_sizes,
                counters: Counters::default(),
                has_fault: AtomicBool::new(false),
                fault: Mutex::new(None),
                refuse_conns: AtomicBool::new(false),
                reads_reordered: AtomicBool::new(false),
                held: ReadHold::new(),
            }),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> MemStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MemStats {
            reads: get(&c.reads),
            batched_reads: get(&c.batched_reads),
            writes: get(&c.writes),
            batched_writes: get(&c.batched_writes),
            fua_ops: get(&c.fua_ops),
            flushes: get(&c.flushes),
            trims: get(&c.trims),
            zero_writes: get(&c.zero_writes),
            conns_opened: get(&c.conns_opened),
        }
    }

    /// Makes `open_conn` fail with EBUSY while `refuse` holds (for tests of a server that
    /// cannot serve another connection).
    pub fn refuse_conns(&self, refuse: bool) {
        self.inner.refuse_conns.store(refuse, Ordering::Release);
    }

    /// Leaves every read of a batch of two or more in flight, to complete in reverse order
    /// (for tests of replies out of order).
    pub fn set_reads_reordered(&self, reordered: bool) {
        self.inner.reads_reordered.store(reordered, Ordering::Release);
    }

    /// Leaves every read overlapping `[start_bytes, end_bytes)` in flight until the hold is
    /// lifted (`None`), as a slow device would.
    pub fn hold_reads(&self, range: Option<(u64, u64)>) {
        self.inner.held.set(range);
    }

    /// Makes every operation overlapping `[start_bytes, end_bytes)` fail with `errno`;
    /// `None` clears the fault.
    pub fn set_fault(&self, fault: Option<(u64, u64, i32)>) {
        let f =
            fault.map(|(start_bytes, end_bytes, errno)| Fault { start_bytes, end_bytes, errno });
        *self.inner.fault.lock().unwrap_or_else(|p| p.into_inner()) = f;
        self.inner.has_fault.store(f.is_some(), Ordering::Release);
    }

    /// Reads bytes directly (for tests); out-of-range reads fail with `EINVAL`.
    pub fn read_at(&self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.inner.check(offset_bytes, buf.len() as u64)?;
        self.inner.for_each_stripe(offset_bytes, buf.len(), |stripe, at, range| {
            let s = stripe.read().unwrap_or_else(|p| p.into_inner());
            buf[range.clone()].copy_from_slice(&s[at..at + range.len()]);
        });
        Ok(())
    }

    /// Writes bytes directly (for tests and preloading); out-of-range writes fail.
    pub fn write_at(&self, offset_bytes: u64, data: &[u8]) -> Result<(), BlockError> {
        self.inner.check(offset_bytes, data.len() as u64)?;
        self.inner.for_each_stripe(offset_bytes, data.len(), |stripe, at, range| {
            let mut s = stripe.write().unwrap_or_else(|p| p.into_inner());
            s[at..at + range.len()].copy_from_slice(&data[range.clone()]);
        });
        Ok(())
    }

    fn zero(&self, offset_bytes: u64, len_bytes: u64) -> Result<(), BlockError> {
        self.inner.check(offset_bytes, len_bytes)?;
        let len = usize::try_from(len_bytes).map_err(|_| BlockError::new(libc::EINVAL, "len"))?;
        self.inner.for_each_stripe(offset_bytes, len, |stripe, at, range| {
            let mut s = stripe.write().unwrap_or_else(|p| p.into_inner());
            s[at..at + range.len()].fill(0);
        });
        Ok(())
    }
}

impl Inner {
    fn check(&self, offset_bytes: u64, len_bytes: u64) -> Result<(), BlockError> {
        let end = offset_bytes
            .checked_add(len_bytes)
            .filter(|&end| end <= self.size_bytes)
            .ok_or_else(|| BlockError::new(libc::EINVAL, "range past the end of the export"))?;
        if self.has_fault.load(Ordering::Acquire) {
            let fault = *self.fault.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(f) = fault
                && offset_bytes < f.end_bytes
                && end > f.start_bytes
            {
                return Err(BlockError::new(f.errno, "injected fault"));
            }
        }
        Ok(())
    }

    /// Calls `f(stripe, offset within stripe, range within the caller's buffer)` for each
    /// stripe overlapping `[offset_bytes, offset_bytes + len)`, which must be in range.
    fn for_each_stripe(
        &self,
        offset_bytes: u64,
        len: usize,
        mut f: impl FnMut(&RwLock<Box<[u8]>>, usize, std::ops::Range<usize>),
    ) {
        let mut done = 0usize;
        while done < len {
            let pos = offset_bytes + done as u64;
            let index = (pos / STRIPE_BYTES) as usize;
            let at = (pos % STRIPE_BYTES) as usize;
            let n = (len - done).min(STRIPE_BYTES as usize - at);
            f(&self.stripes[index], at, done..done + n);
            done += n;
        }
    }
}

impl Export for MemExport {
    type Conn<'a> = MemConn;

    fn open_conn(&self) -> Result<MemConn, BlockError> {
        if self.inner.refuse_conns.load(Ordering::Acquire) {
            return Err(BlockError::new(libc::EBUSY, "no connection can be opened now"));
        }
        self.inner.counters.conns_opened.fetch_add(1, Ordering::Relaxed);
        Ok(MemConn {
            export: self.clone(),
            in_flight: Vec::with_capacity(READS_IN_FLIGHT_MAX),
            tickets: (0..READS_IN_FLIGHT_MAX).rev().collect(),
        })
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes
    }

    fn block_sizes(&self) -> BlockSizes {
        self.inner.block_sizes
    }

    fn can_multi_conn(&self) -> bool {
        true
    }
}

/// A connection to a [`MemExport`].
#[derive(Debug)]
pub struct MemConn {
    export: MemExport,
    /// Reads in flight, in the order they started.
    in_flight: Vec<InFlight>,
    /// Free tickets.
    tickets: Vec<usize>,
}

/// A read left in flight, with the answer it took when it started.
#[derive(Debug)]
struct InFlight {
    ticket: usize,
    offset_bytes: u64,
    answer: Result<Vec<u8>, BlockError>,
}

impl MemConn {
    fn count(&self, counter: impl Fn(&Counters) -> &AtomicU64, fua: bool) {
        let c = &self.export.inner.counters;
        counter(c).fetch_add(1, Ordering::Relaxed);
        if fua {
            c.fua_ops.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl BlockConn for MemConn {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.count(|c| &c.reads, false);
        self.export.read_at(offset_bytes, buf)
    }

    fn read_batch(
        &mut self,
        reads: &mut [pmcache_block::BatchRead<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        if reads.len() > 1 {
            let batched = &self.export.inner.counters.batched_reads;
            batched.fetch_add(reads.len() as u64, Ordering::Relaxed);
        }
        for r in reads {
            outcomes.push(self.read(r.offset_bytes, r.buf));
        }
    }

    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        let inner = &self.export.inner;
        let reordered = reads.len() > 1 && inner.reads_reordered.load(Ordering::Acquire);
        let held = *inner.held.range.lock().unwrap_or_else(|p| p.into_inner());
        if reads.len() > 1 {
            inner.counters.batched_reads.fetch_add(reads.len() as u64, Ordering::Relaxed);
        }
        for r in reads {
            let later = reordered || ReadHold::holds(held, r.offset_bytes, r.buf.len());
            let outcome = self.read(r.offset_bytes, r.buf);
            match self.tickets.pop().filter(|_| later) {
                Some(ticket) => {
                    let answer = outcome.map(|()| r.buf.to_vec());
                    self.in_flight.push(InFlight { ticket, offset_bytes: r.offset_bytes, answer });
                    started.push(Started::Pending(ticket));
                }
                None => started.push(Started::Done(outcome)),
            }
        }
    }

    fn pending(&self) -> usize {
        self.in_flight.len()
    }

    fn pending_max(&self) -> usize {
        READS_IN_FLIGHT_MAX
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.export.inner.held.event.as_fd())
    }

    /// Completes the reads in flight outside the held range, the latest started first.
    fn complete(&mut self, min: usize, done: &mut pmcache_block::Completed<'_>) -> usize {
        let min = min.min(self.in_flight.len());
        let hold = &self.export.inner.held;
        let mut range = hold.range.lock().unwrap_or_else(|p| p.into_inner());
        let mut completed = 0;
        loop {
            let mut at = self.in_flight.len();
            while at > 0 {
                at -= 1;
                let r = &self.in_flight[at];
                let len = r.answer.as_ref().map_or(0, Vec::len);
                if !ReadHold::holds(*range, r.offset_bytes, len) {
                    let r = self.in_flight.remove(at);
                    self.tickets.push(r.ticket);
                    done(r.ticket, r.answer.as_deref().map_err(Clone::clone));
                    completed += 1;
                }
            }
            if completed >= min {
                return completed;
            }
            range = hold.released.wait(range).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        self.count(|c| &c.writes, fua);
        self.export.write_at(offset_bytes, data)
    }

    fn write_batch(
        &mut self,
        writes: &[pmcache_block::BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        if writes.len() > 1 {
            let batched = &self.export.inner.counters.batched_writes;
            batched.fetch_add(writes.len() as u64, Ordering::Relaxed);
        }
        for w in writes {
            outcomes.push(self.write(w.offset_bytes, w.data, w.fua));
        }
    }

    /// All-zero 4 KiB pieces are reported as holes that read as zeroes (as a sparse RAM disk
    /// would keep them), the rest as data.
    fn block_status(
        &mut self,
        offset_bytes: u64,
        len_bytes: u32,
        extents_max: usize,
        extents: &mut Vec<pmcache_block::BlockExtent>,
    ) -> Result<(), BlockError> {
        const PIECE_BYTES: u32 = 4096;
        let mut piece = [0u8; PIECE_BYTES as usize];
        let mut done = 0u32;
        while done < len_bytes {
            let n = (len_bytes - done)
                .min(PIECE_BYTES - (offset_bytes + u64::from(done)) as u32 % PIECE_BYTES);
            self.export.read_at(offset_bytes + u64::from(done), &mut piece[..n as usize])?;
            let zero = piece[..n as usize].iter().all(|&b| b == 0);
            let full = extents.len() == extents_max;
            match extents.last_mut() {
                Some(last) if last.zero == zero => last.len_bytes += n,
                _ if full => break,
                _ => extents.push(pmcache_block::BlockExtent { len_bytes: n, hole: zero, zero }),
            }
            done += n;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        self.count(|c| &c.flushes, false);
        self.export.inner.check(0, 0)
    }

    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), BlockError> {
        self.count(|c| &c.trims, fua);
        self.export.zero(offset_bytes, len_bytes)
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), BlockError> {
        self.count(|c| &c.zero_writes, fua);
        self.export.zero(offset_bytes, len_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_stripes() {
        let m = MemExport::new(3 * STRIPE_BYTES, BlockSizes::default()).expect("mem");
        let data: Vec<u8> = (0..STRIPE_BYTES + 100).map(|i| i as u8).collect();
        m.write_at(STRIPE_BYTES - 50, &data).expect("write");
        let mut back = vec![0u8; data.len()];
        m.read_at(STRIPE_BYTES - 50, &mut back).expect("read");
        assert_eq!(back, data);
        assert!(m.read_at(3 * STRIPE_BYTES - 1, &mut [0u8; 2]).is_err());
    }

    #[test]
    fn fault_range() {
        let m = MemExport::new(STRIPE_BYTES, BlockSizes::default()).expect("mem");
        m.set_fault(Some((4096, 8192, libc::EIO)));
        let mut c = m.open_conn().expect("conn");
        assert_eq!(c.read(4000, &mut [0u8; 100]).map_err(|e| e.errno()), Err(libc::EIO));
        assert!(c.read(0, &mut [0u8; 4096]).is_ok());
        m.set_fault(None);
        assert!(c.read(4000, &mut [0u8; 100]).is_ok());
    }

    /// Write-zeroes across a stripe boundary zeroes exactly its range.
    #[test]
    fn zeroes_span_stripes_exactly() {
        let m = MemExport::new(2 * STRIPE_BYTES, BlockSizes::default()).expect("mem");
        m.write_at(STRIPE_BYTES - 200, &[9u8; 400]).expect("fill");
        let mut c = m.open_conn().expect("conn");
        c.write_zeroes(STRIPE_BYTES - 100, 150, false, true).expect("zeroes");
        let mut back = vec![0u8; 400];
        m.read_at(STRIPE_BYTES - 200, &mut back).expect("read");
        assert!(back[..100].iter().all(|&b| b == 9), "before");
        assert!(back[100..250].iter().all(|&b| b == 0), "the range");
        assert!(back[250..].iter().all(|&b| b == 9), "after");
        assert_eq!(
            c.write_zeroes(2 * STRIPE_BYTES - 10, 11, false, true).map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
    }

    /// A fault covers exactly its byte range: a request touching its first or last byte
    /// fails, one ending at its start or starting at its end does not.
    #[test]
    fn a_fault_covers_exactly_its_range() {
        let m = MemExport::new(STRIPE_BYTES, BlockSizes::default()).expect("mem");
        m.set_fault(Some((4096, 8192, libc::ENOSPC)));
        let mut c = m.open_conn().expect("conn");
        for (offset, len, fails) in
            [(0, 4096, false), (8192, 100, false), (4095, 2, true), (8191, 1, true)]
        {
            let got = c.read(offset, &mut vec![0u8; len]).map_err(|e| e.errno());
            assert_eq!(got, if fails { Err(libc::ENOSPC) } else { Ok(()) }, "{offset}+{len}");
        }
    }
}
