//! One queue's dispatch: the descriptors a queue received together (one wait on its ring),
//! decoded, handed to its [`Target`] — the reads as one [`Target::read_batch`], the writes as
//! one [`Target::write_batch`] (group commit; a lone read or write goes to the single call),
//! the rest one by one in arrival order — and turned into completion results, one per tag.
//! A read the target leaves in flight (a cache miss) completes its tag later
//! ([`Dispatcher::complete_reads`]), without holding back the tags of its batch.
//!
//! Pure: the buffers are any byte slices indexed by tag (libublk's per-tag I/O buffers in
//! `crate::device`, plain vectors in tests and `pmcache bench ublk-mapping`). The kernel does
//! not order requests it has in flight together, so serving the batch's writes, then its
//! reads, then its flushes, discards and write-zeroes is as valid as any order; a FLUSH only
//! covers writes completed before it was sent, and every write of its batch is done before it.

use std::ops::DerefMut;

use smallvec::SmallVec;

use crate::mapping::{Geometry, IoDesc, Request, completion_result, decode};
use crate::target::{BatchRead, BatchWrite, ReadStarted, Target, TargetError};

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
    /// A batch call's outcomes.
    outcomes: Vec<Result<(), TargetError>>,
    /// Completion results ready to be committed: (tag, bytes done or negative errno).
    completions: Vec<(u16, i32)>,
    /// How each read in flight started.
    started: Vec<ReadStarted>,
    /// The reads in flight by ticket: (tag, offset, length).
    in_flight: Vec<Option<(u16, u64, u32)>>,
}

impl Dispatcher {
    /// A dispatcher for a queue of `depth` tags on a device of `geometry`.
    pub fn new(geometry: Geometry, depth: u16) -> Self {
        let depth = usize::from(depth);
        Self {
            geometry,
            received: Vec::with_capacity(depth),
            reads: Vec::with_capacity(depth),
            outcomes: Vec::with_capacity(depth),
            completions: Vec::with_capacity(depth),
            started: Vec::with_capacity(depth),
            in_flight: Vec::new(),
        }
    }

    /// Completes the tags of the target's reads in flight that finished, waiting for at
    /// least `min` of them: each one's data is copied to its tag's buffer and its result
    /// joins [`Dispatcher::completions`].
    pub fn complete_reads<T, B>(&mut self, target: &mut T, bufs: &mut [B], min: usize)
    where
        T: Target + ?Sized,
        B: DerefMut<Target = [u8]>,
    {
        let (in_flight, completions) = (&mut self.in_flight, &mut self.completions);
        target.read_complete(min, &mut |ticket, result| {
            let (tag, offset_bytes, len_bytes) =
                in_flight.get_mut(ticket).and_then(Option::take).unwrap_or_else(|| {
                    panic!("the target completed read ticket {ticket}, which is not in flight")
                });
            let outcome = result.map(|data| {
                assert_eq!(data.len(), len_bytes as usize, "the target answered a read's length");
                bufs[usize::from(tag)][..data.len()].copy_from_slice(data);
            });
            let request = Request::Read { offset_bytes, len_bytes };
            completions.push(complete(tag, &request, &outcome));
        });
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
        T: Target + ?Sized,
        B: DerefMut<Target = [u8]>,
    {
        if self.received.is_empty() {
            return;
        }
        self.dispatch_writes(target, bufs);
        self.dispatch_reads(target, bufs);
        for &(tag, request) in &self.received {
            let outcome = match request {
                Request::Read { .. } | Request::Write { .. } => continue,
                Request::Flush => target.flush(),
                Request::Discard { offset_bytes, len_bytes, fua } => target
                    .discard(offset_bytes, len_bytes)
                    .and_then(|()| if fua { target.flush() } else { Ok(()) }),
                Request::WriteZeroes { offset_bytes, len_bytes, fua, may_unmap } => {
                    target.write_zeroes(offset_bytes, len_bytes, fua, may_unmap)
                }
            };
            self.completions.push(complete(tag, &request, &outcome));
        }
        self.received.clear();
    }

    /// The completion results ready to be committed, (tag, result), drained.
    pub fn completions(&mut self) -> std::vec::Drain<'_, (u16, i32)> {
        self.completions.drain(..)
    }

    fn dispatch_writes<T, B>(&mut self, target: &mut T, bufs: &[B])
    where
        T: Target + ?Sized,
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
        self.outcomes.clear();
        match writes.as_slice() {
            // A batch of one goes to the single call, which a target serves without gathering.
            [w] => self.outcomes.push(target.write(w.offset_bytes, w.data, w.fua)),
            _ => target.write_batch(&writes, &mut self.outcomes),
        }
        assert_eq!(self.outcomes.len(), writes.len(), "one outcome per write");
        let writes = self.received.iter().filter(|(_, r)| matches!(r, Request::Write { .. }));
        for ((tag, request), outcome) in writes.zip(self.outcomes.drain(..)) {
            self.completions.push(complete(*tag, request, &outcome));
        }
    }

    fn dispatch_reads<T, B>(&mut self, target: &mut T, bufs: &mut [B])
    where
        T: Target + ?Sized,
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
                ReadStarted::Done(outcome) => {
                    self.completions.push(complete(tag, &request, &outcome));
                }
                ReadStarted::Pending(ticket) => {
                    if self.in_flight.len() <= ticket {
                        self.in_flight.resize(ticket + 1, None);
                    }
                    assert!(self.in_flight[ticket].is_none(), "read ticket {ticket} given twice");
                    self.in_flight[ticket] = Some((tag, offset_bytes, len_bytes));
                }
            }
        }
    }
}

fn complete(tag: u16, request: &Request, outcome: &Result<(), TargetError>) -> (u16, i32) {
    if let Err(e) = outcome {
        tracing::debug!(tag, ?request, "ublk request failed: {e}");
    }
    (tag, completion_result(request, outcome))
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
