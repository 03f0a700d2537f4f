//! One virtqueue's requests served on its [`BlockConn`]: the descriptor chains a kick made
//! available, decoded against guest memory, served as one batch — the writes as one
//! [`BlockConn::write_batch_start`] (group commit), the reads as one
//! [`BlockConn::read_batch_start`], the rest in arrival order once nothing is in flight — and
//! answered in the order the guest made them available.
//!
//! That order is what makes a restarted server safe. QEMU learns nothing from a backend that
//! died; when a new one connects it restarts each virtqueue at its used index, so every
//! request after the last one answered is served again (reads and writes may be repeated;
//! the guest was never told they were done). That is right only if the used ring holds a
//! prefix of the available ring: each batch is answered whole, in available order.
//!
//! Data moves between guest memory and the target without a copy: a read is served into the
//! guest's buffers and a write from them, one block-aligned segment each (split where the
//! guest's buffers are, merged where they are adjacent in the process's memory). A request
//! whose segments are not whole blocks goes through a buffer of its own.

use std::ops::Deref;

use pmcache_block::{BatchRead, BatchWrite, BlockConn, BlockError, Started};
use smallvec::SmallVec;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::virtio::{
    Geometry, HEADER_BYTES, Header, ID_BYTES, Kind, Range, Refused, STATUS_IOERR, STATUS_OK,
};

/// The largest read or write a request may carry: its length must fit a `u32` used length,
/// and a request this long that needs its own buffer allocates it.
pub const REQUEST_BYTES_MAX: u64 = 32 << 20;

/// A run of guest memory as this process maps it.
#[derive(Debug, Clone, Copy)]
struct Segment {
    ptr: *mut u8,
    len: usize,
}

type Segments = SmallVec<[Segment; 4]>;

/// One request of the batch being served.
#[derive(Debug)]
struct Request {
    head: u16,
    /// The guest address of its status byte (`None`: a chain with nowhere to answer).
    status_at: Option<GuestAddress>,
    kind: Kind,
    offset_bytes: u64,
    /// A read's destination or a write's source in guest memory.
    data: Segments,
    /// A discard's or write-zeroes' ranges.
    ranges: Vec<Range>,
    /// A request whose data segments are not whole blocks is served through this.
    bounce: Option<Vec<u8>>,
    /// Parts still in flight.
    in_flight: usize,
    status: u8,
    /// Bytes written to guest memory: data read, and the status byte.
    used_bytes: u32,
}

/// A part of a read or write handed to the target: one block-aligned run of guest memory.
#[derive(Debug, Clone, Copy)]
struct Part {
    request: usize,
    /// Where a read's data goes (a write's source).
    segment: Segment,
}

/// Counters of one queue, added up by the server for `stats`.
#[derive(Debug, Default, Clone, Copy)]
pub struct QueueCounters {
    /// Requests answered.
    pub requests: u64,
    /// Batches served (one per pass over the available ring).
    pub batches: u64,
    /// Requests answered with an error status.
    pub errors: u64,
    /// Reads and writes served through a buffer of their own.
    pub bounced: u64,
}

/// One virtqueue's server: its target (an engine lane), and the state of the batch in
/// service, sized at start for the queue.
pub struct QueueServer<T> {
    target: T,
    geometry: Geometry,
    requests: Vec<Request>,
    parts: Vec<Part>,
    /// The part of each ticket in flight.
    tickets: Vec<Option<usize>>,
    tickets_in_flight: usize,
    started: Vec<Started>,
    counters: QueueCounters,
}

// SAFETY: the raw pointers a `QueueServer` holds point into guest memory only while one batch
// is served (`serve`), on the thread that serves it; between batches the vectors holding them
// are empty. Moving the server to another thread between batches moves no live pointer.
unsafe impl<T: Send> Send for QueueServer<T> {}

impl<T: BlockConn> QueueServer<T> {
    /// A server of requests on `target` for a device of `geometry`.
    pub fn new(target: T, geometry: Geometry) -> Self {
        let depth = usize::from(geometry.queue_size);
        Self {
            target,
            geometry,
            requests: Vec::with_capacity(depth),
            parts: Vec::with_capacity(depth),
            tickets: Vec::new(),
            tickets_in_flight: 0,
            started: Vec::with_capacity(depth),
            counters: QueueCounters::default(),
        }
    }

    /// The queue's counters so far.
    pub fn counters(&self) -> QueueCounters {
        self.counters
    }

    /// Serves the chains of one batch, all decoded against `mem`, and returns each one's
    /// (head index, used length) in the order given, every status byte written.
    pub fn serve<M>(
        &mut self,
        mem: &GuestMemoryMmap,
        chains: impl IntoIterator<Item = DescriptorChain<M>>,
        answered: &mut Vec<(u16, u32)>,
    ) where
        M: Deref<Target = GuestMemoryMmap>,
    {
        for chain in chains {
            let request = self.decode(mem, chain);
            self.counters.bounced += u64::from(request.bounce.is_some());
            self.requests.push(request);
        }
        if self.requests.is_empty() {
            return;
        }
        self.counters.batches += 1;
        refuse_aliased_buffers(&mut self.requests);
        self.start_writes();
        self.start_reads();
        for index in 0..self.requests.len() {
            let request = &self.requests[index];
            if request.status != STATUS_OK {
                continue;
            }
            let outcome = match request.kind {
                Kind::Read | Kind::Write | Kind::Unsupported(_) => continue,
                Kind::Flush => {
                    self.drain();
                    self.target.flush()
                }
                Kind::GetId => {
                    let id = self.geometry.serial;
                    let request = &mut self.requests[index];
                    let len = scatter(&request.data, &id);
                    request.used_bytes += len as u32;
                    Ok(())
                }
                Kind::Discard | Kind::WriteZeroes => {
                    self.drain();
                    let request = &self.requests[index];
                    request.ranges.iter().try_for_each(|r| match request.kind {
                        Kind::Discard => self.target.trim(r.offset_bytes, r.len_bytes, false),
                        _ => self.target.write_zeroes(r.offset_bytes, r.len_bytes, false, r.unmap),
                    })
                }
            };
            if let Err(e) = outcome {
                fail(&mut self.requests[index], &e);
            }
        }
        self.drain();
        for request in self.requests.drain(..) {
            if request.status == STATUS_OK
                && request.kind == Kind::Read
                && let Some(bounce) = &request.bounce
            {
                scatter(&request.data, bounce);
            }
            let answered_ok = match request.status_at {
                Some(at) => mem.write_obj(request.status, at).is_ok(),
                None => false,
            };
            self.counters.requests += 1;
            if request.status != STATUS_OK || !answered_ok {
                self.counters.errors += 1;
            }
            let used = if answered_ok { request.used_bytes + 1 } else { 0 };
            answered.push((request.head, used));
        }
        self.parts.clear();
    }

    /// Decodes one chain: its header, its data segments, its status byte.
    fn decode<M>(&mut self, mem: &GuestMemoryMmap, chain: DescriptorChain<M>) -> Request
    where
        M: Deref<Target = GuestMemoryMmap>,
    {
        let head = chain.head_index();
        let mut readable: SmallVec<[(GuestAddress, u32); 8]> = SmallVec::new();
        let mut writable: SmallVec<[(GuestAddress, u32); 8]> = SmallVec::new();
        for desc in chain {
            if desc.is_write_only() {
                writable.push((desc.addr(), desc.len()));
            } else if writable.is_empty() {
                readable.push((desc.addr(), desc.len()));
            } else {
                // The device-readable part comes first (virtio 1.2, 2.7.4.2); a chain that
                // mixes them is malformed, and answered on its last byte if it has one.
                writable.push((desc.addr(), 0));
            }
        }
        // The status byte: the last byte of the device-writable part.
        let status_at = writable.last_mut().and_then(|(addr, len)| {
            let at = addr.checked_add(u64::from(len.checked_sub(1)?))?;
            *len -= 1;
            Some(at)
        });
        let mut request = Request {
            head,
            status_at,
            kind: Kind::Unsupported(u32::MAX),
            offset_bytes: 0,
            data: Segments::new(),
            ranges: Vec::new(),
            bounce: None,
            in_flight: 0,
            status: STATUS_OK,
            used_bytes: 0,
        };
        if let Err(refused) = self.decode_into(mem, &readable, &writable, &mut request) {
            tracing::debug!(head, "vhost-user-blk request refused: {refused}");
            request.status = refused.status();
        }
        request
    }

    fn decode_into(
        &self,
        mem: &GuestMemoryMmap,
        readable: &[(GuestAddress, u32)],
        writable: &[(GuestAddress, u32)],
        request: &mut Request,
    ) -> Result<(), Refused> {
        if request.status_at.is_none() {
            return Err(Refused::Invalid("no device-writable status byte".into()));
        }
        let mut header = [0u8; HEADER_BYTES];
        let header_read = gather_bytes(mem, readable, 0, &mut header)?;
        if header_read < HEADER_BYTES {
            return Err(Refused::Invalid(format!("a header of {header_read} bytes")));
        }
        let header = Header::decode(&header);
        request.kind = header.kind;
        let g = &self.geometry;
        let writes = matches!(header.kind, Kind::Write | Kind::Discard | Kind::WriteZeroes);
        if writes && g.read_only {
            return Err(Refused::Unsupported("a write to a read-only device".into()));
        }
        match header.kind {
            Kind::Read | Kind::Write => {
                let data = if header.kind == Kind::Read {
                    segments(mem, writable, 0)?
                } else {
                    segments(mem, readable, HEADER_BYTES as u64)?
                };
                let len_bytes = data.iter().map(|s| s.len as u64).sum::<u64>();
                if len_bytes == 0 || len_bytes > REQUEST_BYTES_MAX {
                    return Err(Refused::Invalid(format!(
                        "a read or write of {len_bytes} bytes (at most {REQUEST_BYTES_MAX})"
                    )));
                }
                request.offset_bytes = g.check_extent(header.sector, len_bytes)?;
                let block = g.block_bytes as usize;
                if data.iter().any(|s| !s.len.is_multiple_of(block)) {
                    let mut bounce = vec![0u8; len_bytes as usize];
                    if header.kind == Kind::Write {
                        gather(&data, &mut bounce);
                    }
                    request.bounce = Some(bounce);
                }
                if header.kind == Kind::Read {
                    request.used_bytes = len_bytes as u32;
                }
                request.data = data;
            }
            Kind::Flush => {}
            Kind::GetId => {
                request.data = segments(mem, writable, 0)?;
                let room = request.data.iter().map(|s| s.len).sum::<usize>();
                if room < ID_BYTES {
                    // The driver reads what fits (a shorter ID is NUL-padded anyway).
                    tracing::debug!("GET_ID with room for {room} bytes");
                }
            }
            Kind::Discard | Kind::WriteZeroes => {
                let len = readable.iter().map(|&(_, l)| l as usize).sum::<usize>();
                let len = len.saturating_sub(HEADER_BYTES).min(RANGE_READ_MAX);
                let mut bytes = vec![0u8; len];
                gather_bytes(mem, readable, HEADER_BYTES as u64, &mut bytes)?;
                request.ranges = g.decode_ranges(header.kind, &bytes)?;
            }
            Kind::Unsupported(kind) => {
                return Err(Refused::Unsupported(format!("request type {kind}")));
            }
        }
        Ok(())
    }

    /// Hands the batch's writes to the target as one batch.
    fn start_writes(&mut self) {
        self.parts.clear();
        let mut writes: SmallVec<[BatchWrite<'_>; 16]> = SmallVec::new();
        for (index, request) in self.requests.iter().enumerate() {
            if request.kind != Kind::Write || request.status != STATUS_OK {
                continue;
            }
            for_each_part(request, |offset_bytes, segment| {
                // SAFETY: `segment` is a run of mapped guest memory (decoded against `mem`,
                // which the caller of `serve` holds for the whole batch) or of the request's
                // own buffer; no request of the batch has a device-writable buffer over it
                // (`refuse_aliased_buffers`), so nothing writes it while this borrow lives.
                let data = unsafe { std::slice::from_raw_parts(segment.ptr, segment.len) };
                writes.push(BatchWrite { offset_bytes, data, fua: false });
                self.parts.push(Part { request: index, segment });
            });
        }
        if writes.is_empty() {
            return;
        }
        self.started.clear();
        self.target.write_batch_start(&writes, &mut self.started);
        assert_eq!(self.started.len(), writes.len(), "one start per write");
        drop(writes);
        self.take_starts(0);
    }

    /// Hands the batch's reads to the target as one batch.
    fn start_reads(&mut self) {
        let first = self.parts.len();
        let mut reads: SmallVec<[BatchRead<'_>; 16]> = SmallVec::new();
        for (index, request) in self.requests.iter().enumerate() {
            if request.kind != Kind::Read || request.status != STATUS_OK {
                continue;
            }
            for_each_part(request, |offset_bytes, segment| {
                // SAFETY: as for writes; besides, no two device-writable runs of the batch
                // overlap (`refuse_aliased_buffers`), so each `&mut` is the only reference to
                // its bytes in this process while the target fills it.
                let buf = unsafe { std::slice::from_raw_parts_mut(segment.ptr, segment.len) };
                reads.push(BatchRead { offset_bytes, buf });
                self.parts.push(Part { request: index, segment });
            });
        }
        if reads.is_empty() {
            return;
        }
        self.started.clear();
        self.target.read_batch_start(&mut reads, &mut self.started);
        assert_eq!(self.started.len(), reads.len(), "one start per read");
        drop(reads);
        self.take_starts(first);
    }

    /// Records how the parts from `first` on started: failed ones fail their request, ones in
    /// flight are counted on it.
    fn take_starts(&mut self, first: usize) {
        let mut started = std::mem::take(&mut self.started);
        for (part, start) in (first..).zip(started.drain(..)) {
            let request = self.parts[part].request;
            match start {
                Started::Done(Ok(())) => {}
                Started::Done(Err(e)) => fail(&mut self.requests[request], &e),
                Started::Pending(ticket) => {
                    if self.tickets.len() <= ticket {
                        self.tickets.resize(ticket + 1, None);
                    }
                    assert!(self.tickets[ticket].is_none(), "ticket {ticket} given twice");
                    self.tickets[ticket] = Some(part);
                    self.tickets_in_flight += 1;
                    self.requests[request].in_flight += 1;
                }
            }
        }
        self.started = started;
    }

    /// Waits for every part in flight: a read's data is copied where it goes.
    fn drain(&mut self) {
        while self.tickets_in_flight > 0 {
            let (tickets, parts, requests) = (&mut self.tickets, &self.parts, &mut self.requests);
            let mut handed = 0;
            self.target.complete(self.tickets_in_flight, &mut |ticket, result| {
                let part = tickets.get_mut(ticket).and_then(Option::take).unwrap_or_else(|| {
                    panic!("the target completed ticket {ticket}, which is not in flight")
                });
                handed += 1;
                let Part { request, segment } = parts[part];
                let request = &mut requests[request];
                request.in_flight -= 1;
                match result {
                    Ok(data) if request.kind == Kind::Read => {
                        assert_eq!(data.len(), segment.len, "the target answered a read's length");
                        // SAFETY: as in `start_reads`: the run is mapped for the batch and no
                        // other reference to it exists.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(segment.ptr, segment.len) };
                        dst.copy_from_slice(data);
                    }
                    Ok(data) => assert!(data.is_empty(), "the target answered a write with data"),
                    Err(e) => fail(request, &e),
                }
            });
            assert!(
                handed > 0,
                "the target completed nothing of {} in flight",
                self.tickets_in_flight
            );
            self.tickets_in_flight -= handed;
        }
    }
}

/// Ranges read of a discard or write-zeroes (more than offered is refused).
const RANGE_READ_MAX: usize = (crate::virtio::RANGES_MAX as usize + 1) * crate::virtio::RANGE_BYTES;

/// Calls `part` with each block-aligned run of a read or write: its device offset and where
/// it is in memory (the request's own buffer when it has one).
fn for_each_part(request: &Request, mut part: impl FnMut(u64, Segment)) {
    if let Some(bounce) = &request.bounce {
        let segment = Segment { ptr: bounce.as_ptr().cast_mut(), len: bounce.len() };
        part(request.offset_bytes, segment);
        return;
    }
    let mut offset_bytes = request.offset_bytes;
    for &segment in &request.data {
        part(offset_bytes, segment);
        offset_bytes += segment.len as u64;
    }
}

fn fail(request: &mut Request, e: &BlockError) {
    tracing::debug!(head = request.head, kind = ?request.kind, "vhost-user-blk request failed: {e}");
    request.status = STATUS_IOERR;
}

/// Fails the later of any two requests of a batch whose buffers overlap where one of them is
/// written by the device: a guest may hand such buffers, and serving both would give the
/// target two live references to the same bytes.
fn refuse_aliased_buffers(requests: &mut [Request]) {
    let mut runs: Vec<(usize, usize, bool, usize)> = Vec::new();
    for (index, request) in requests.iter().enumerate() {
        if request.status != STATUS_OK {
            continue;
        }
        let written = matches!(request.kind, Kind::Read | Kind::GetId);
        for s in &request.data {
            let start = s.ptr as usize;
            runs.push((start, start + s.len, written, index));
        }
    }
    runs.sort_unstable();
    let mut reach: Option<(usize, bool, usize)> = None; // (end, written, request)
    let mut refused = Vec::new();
    for &(start, end, written, index) in &runs {
        if let Some((reach_end, reach_written, reach_index)) = reach
            && start < reach_end
            && (written || reach_written)
        {
            refused.push(index.max(reach_index));
        }
        if reach.is_none_or(|(reach_end, _, _)| end > reach_end) {
            reach = Some((end, written, index));
        } else if let Some(r) = reach.as_mut() {
            r.1 |= written;
        }
    }
    for index in refused {
        tracing::debug!(head = requests[index].head, "buffers overlap another request's");
        requests[index].status = STATUS_IOERR;
    }
}

/// The runs of guest memory of `descs` from byte `skip` on, each mapped in this process,
/// adjacent ones merged.
fn segments(
    mem: &GuestMemoryMmap,
    descs: &[(GuestAddress, u32)],
    mut skip: u64,
) -> Result<Segments, Refused> {
    let mut out = Segments::new();
    for &(addr, len) in descs {
        let len = u64::from(len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let (addr, len) = (addr.unchecked_add(skip), (len - skip) as usize);
        skip = 0;
        for slice in GuestMemoryBackend::get_slices(mem, addr, len) {
            let slice = slice.map_err(|e| {
                Refused::Invalid(format!("{len} bytes at guest address {:#x}: {e}", addr.0))
            })?;
            let segment = Segment { ptr: slice.ptr_guard_mut().as_ptr(), len: slice.len() };
            match out.last_mut() {
                Some(last) if last.ptr.wrapping_add(last.len) == segment.ptr => {
                    last.len += segment.len;
                }
                _ => out.push(segment),
            }
        }
    }
    Ok(out)
}

/// Copies bytes of `descs` from byte `skip` on into `out`; returns how many there were.
fn gather_bytes(
    mem: &GuestMemoryMmap,
    descs: &[(GuestAddress, u32)],
    skip: u64,
    out: &mut [u8],
) -> Result<usize, Refused> {
    let mut done = 0;
    let mut skip = skip;
    for &(addr, len) in descs {
        let len = u64::from(len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let take = ((len - skip) as usize).min(out.len() - done);
        mem.read_slice(&mut out[done..done + take], addr.unchecked_add(skip))
            .map_err(|e| Refused::Invalid(format!("reading the request: {e}")))?;
        done += take;
        skip = 0;
        if done == out.len() {
            break;
        }
    }
    Ok(done)
}

/// Copies the bytes of `segments` into `out` (a write's own buffer).
fn gather(segments: &[Segment], out: &mut [u8]) {
    let mut done = 0;
    for s in segments {
        // SAFETY: a mapped run of guest memory, read while the batch holds the mapping.
        let src = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
        out[done..done + s.len].copy_from_slice(src);
        done += s.len;
    }
}

/// Copies `data` into `segments`, as far as they reach; returns the bytes copied.
fn scatter(segments: &[Segment], data: &[u8]) -> usize {
    let mut done = 0;
    for s in segments {
        let take = s.len.min(data.len() - done);
        // SAFETY: a mapped run of guest memory the device writes, held for the batch, with no
        // other reference to it (`refuse_aliased_buffers`).
        let dst = unsafe { std::slice::from_raw_parts_mut(s.ptr, take) };
        dst.copy_from_slice(&data[done..done + take]);
        done += take;
        if done == data.len() {
            break;
        }
    }
    done
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
