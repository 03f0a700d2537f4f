//! One queue's dispatch: the descriptors a queue received together (one wait on its ring),
//! decoded, handed to its [`BlockConn`] — the reads as one [`BlockConn::read_batch`], the writes as
//! one [`BlockConn::write_batch`] (group commit; a lone read or write goes to the single call),
//! the rest one by one in arrival order — and turned into completion results, one per tag.
//! A read or write the target leaves in flight (a cache miss, a write-through to a slow
//! store) completes its tag later ([`Dispatcher::complete_pending`]), without holding back
//! the tags of its batch.
//!
//! Pure: the buffers are any byte slices indexed by tag (libublk's per-tag I/O buffers in
//! `crate::device`, plain vectors in tests and `pmcache bench ublk-mapping`). The kernel does
//! not order requests it has in flight together, so serving the batch's writes, then its
//! reads, then its flushes, discards and write-zeroes is as valid as any order; a FLUSH only
//! covers writes completed before it was sent, and every write of its batch, and every
//! request in flight, is done before it.

use std::ops::DerefMut;

use smallvec::SmallVec;

use crate::mapping::{Geometry, IoDesc, Request, completion_result, decode};
use pmcache_block::{BatchRead, BatchWrite, BlockConn, BlockError, Started};

/// Requests of one kind in a batch held without allocating.
const INLINE_BATCH: usize = 16;

/// The dispatch state of one queue, its vectors sized at start for the queue depth.
#[derive(Debug)]
pub struct Dispatcher {
    geometry: Geometry,
    /// Decoded requests of the current batch, in arrival order.
    received: Vec<(u16, Request)>,
    /// Reads of the current batch as (tag, offset, length), sorted by tag.
    reads: Vec<(u16, u64, u32)>,
    /// Completion results ready to be committed: (tag, bytes done or negative errno).
    completions: Vec<(u16, i32)>,
    /// How each request of a batch call started.
    started: Vec<Started>,
    /// The reads and writes in flight by ticket.
    in_flight: Vec<Option<(u16, Request)>>,
    /// How many of `in_flight` are taken.
    in_flight_count: usize,
}

impl Dispatcher {
    /// A dispatcher for a queue of `depth` tags on a device of `geometry`.
    pub fn new(geometry: Geometry, depth: u16) -> Self {
        let depth = usize::from(depth);
        Self {
            geometry,
            received: Vec::with_capacity(depth),
            reads: Vec::with_capacity(depth),
            completions: Vec::with_capacity(depth),
            started: Vec::with_capacity(depth),
            in_flight: Vec::new(),
            in_flight_count: 0,
        }
    }

    /// Completes the tags of the target's requests in flight that finished, waiting for at
    /// least `min` of them: a read's data is copied to its tag's buffer; each result joins
    /// [`Dispatcher::completions`].
    pub fn complete_pending<T, B>(&mut self, target: &mut T, bufs: &mut [B], min: usize)
    where
        T: BlockConn + ?Sized,
        B: DerefMut<Target = [u8]>,
    {
        let (in_flight, completions) = (&mut self.in_flight, &mut self.completions);
        let mut handed = 0;
        target.complete(min, &mut |ticket, result| {
            let (tag, request) =
                in_flight.get_mut(ticket).and_then(Option::take).unwrap_or_else(|| {
                    panic!("the target completed ticket {ticket}, which is not in flight")
                });
            handed += 1;
            let outcome = result.map(|data| match request {
                Request::Read { len_bytes, .. } => {
                    assert_eq!(
                        data.len(),
                        len_bytes as usize,
                        "the target answered a read's length"
                    );
                    bufs[usize::from(tag)][..data.len()].copy_from_slice(data);
                }
                _ => assert!(data.is_empty(), "the target answered a write with data"),
            });
            completions.push(complete(tag, &request, &outcome));
        });
        self.in_flight_count -= handed;
    }

    /// The device geometry requests are validated against.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Takes the descriptor of `tag` into the current batch; one that fails validation is
    /// completed at once with its errno.
    pub fn receive(&mut self, tag: u16, desc: &IoDesc) {
        match decode(desc, &self.geometry) {
            Ok(request) => self.received.push((tag, request)),
            Err(e) => {
                tracing::debug!(tag, "ublk request refused: {e}");
                self.completions.push((tag, -e.errno()));
            }
        }
    }

    /// Requests received and not yet dispatched.
    pub fn pending(&self) -> usize {
        self.received.len()
    }

    /// Serves the current batch on `target`; `bufs[tag]` is the buffer of each tag (read
    /// data goes there, write data comes from there), at least a maximum request long.
    pub fn dispatch<T, B>(&mut self, target: &mut T, bufs: &mut [B])
    where
        T: BlockConn + ?Sized,
        B: DerefMut<Target = [u8]>,
    {
        if self.received.is_empty() {
            return;
        }
        self.dispatch_writes(target, bufs);
        self.dispatch_reads(target, bufs);
        let received = std::mem::take(&mut self.received);
        for &(tag, request) in &received {
            let outcome = match request {
                Request::Read { .. } | Request::Write { .. } => continue,
                Request::Flush => {
                    while self.in_flight_count > 0 {
                        self.complete_pending(target, bufs, self.in_flight_count);
                    }
                    target.flush()
                }
                Request::Discard { offset_bytes, len_bytes, fua } => {
                    target.trim(offset_bytes, len_bytes, fua)
                }
                Request::WriteZeroes { offset_bytes, len_bytes, fua, may_unmap } => {
                    target.write_zeroes(offset_bytes, len_bytes, fua, may_unmap)
                }
            };
            self.completions.push(complete(tag, &request, &outcome));
        }
        self.received = received;
        self.received.clear();
    }

    /// The completion results ready to be committed, (tag, result), drained.
    pub fn completions(&mut self) -> std::vec::Drain<'_, (u16, i32)> {
        self.completions.drain(..)
    }

    fn dispatch_writes<T, B>(&mut self, target: &mut T, bufs: &[B])
    where
        T: BlockConn + ?Sized,
        B: DerefMut<Target = [u8]>,
    {
        let mut writes: SmallVec<[BatchWrite<'_>; INLINE_BATCH]> = SmallVec::new();
        for &(tag, request) in &self.received {
            if let Request::Write { offset_bytes, len_bytes, fua } = request {
                let data = &bufs[usize::from(tag)][..len_bytes as usize];
                writes.push(BatchWrite { offset_bytes, data, fua });
            }
        }
        if writes.is_empty() {
            return;
        }
        self.started.clear();
        target.write_batch_start(&writes, &mut self.started);
        assert_eq!(self.started.len(), writes.len(), "one start per write");
        drop(writes);
        let mut started = std::mem::take(&mut self.started);
        let writes = self.received.iter().filter(|(_, r)| matches!(r, Request::Write { .. }));
        let writes: SmallVec<[(u16, Request); INLINE_BATCH]> = writes.copied().collect();
        for ((tag, request), s) in writes.into_iter().zip(started.drain(..)) {
            match s {
                Started::Done(outcome) => self.completions.push(complete(tag, &request, &outcome)),
                Started::Pending(ticket) => await_ticket(
                    &mut self.in_flight,
                    &mut self.in_flight_count,
                    ticket,
                    (tag, request),
                ),
            }
        }
        self.started = started;
    }

    fn dispatch_reads<T, B>(&mut self, target: &mut T, bufs: &mut [B])
    where
        T: BlockConn + ?Sized,
        B: DerefMut<Target = [u8]>,
    {
        self.reads.clear();
        self.reads.extend(self.received.iter().filter_map(|&(tag, request)| match request {
            Request::Read { offset_bytes, len_bytes } => Some((tag, offset_bytes, len_bytes)),
            _ => None,
        }));
        if self.reads.is_empty() {
            return;
        }
        // Sorted by tag, the buffers are taken apart in one pass into disjoint borrows.
        self.reads.sort_unstable_by_key(|&(tag, _, _)| tag);
        let mut batch: SmallVec<[BatchRead<'_>; INLINE_BATCH]> = SmallVec::new();
        let mut rest: &mut [B] = bufs;
        let mut first_tag = 0;
        for &(tag, offset_bytes, len_bytes) in &self.reads {
            let skip = usize::from(tag) - first_tag;
            let (_, from_tag) = std::mem::take(&mut rest).split_at_mut(skip);
            let (buf, tail) = from_tag.split_first_mut().expect("a buffer per tag");
            batch.push(BatchRead { offset_bytes, buf: &mut buf[..len_bytes as usize] });
            rest = tail;
            first_tag = usize::from(tag) + 1;
        }
        self.started.clear();
        target.read_batch_start(&mut batch, &mut self.started);
        assert_eq!(self.started.len(), batch.len(), "one start per read");
        for (&(tag, offset_bytes, len_bytes), s) in self.reads.iter().zip(self.started.drain(..)) {
            let request = Request::Read { offset_bytes, len_bytes };
            match s {
                Started::Done(outcome) => {
                    self.completions.push(complete(tag, &request, &outcome));
                }
                Started::Pending(ticket) => await_ticket(
                    &mut self.in_flight,
                    &mut self.in_flight_count,
                    ticket,
                    (tag, request),
                ),
            }
        }
    }
}

/// Notes a request the target left in flight with `ticket`.
fn await_ticket(
    in_flight: &mut Vec<Option<(u16, Request)>>,
    count: &mut usize,
    ticket: usize,
    awaited: (u16, Request),
) {
    if in_flight.len() <= ticket {
        in_flight.resize(ticket + 1, None);
    }
    assert!(in_flight[ticket].is_none(), "ticket {ticket} given twice");
    in_flight[ticket] = Some(awaited);
    *count += 1;
}

fn complete(tag: u16, request: &Request, outcome: &Result<(), BlockError>) -> (u16, i32) {
    if let Err(e) = outcome {
        tracing::debug!(tag, ?request, "ublk request failed: {e}");
    }
    (tag, completion_result(request, outcome))
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
