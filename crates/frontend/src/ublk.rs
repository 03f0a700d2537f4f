//! A [`CacheConn`] as a ublk queue's target (`pmcache_ublk::Target`): the requests a queue
//! received together served as the engine's batches. This is the request path alone, which
//! needs no kernel; the device that runs one target per queue is `pmcache_ublk::device`
//! (behind that crate's feature `device`).

use std::os::fd::BorrowedFd;

use pmcache_engine::{Error, ReadRequest, WriteRequest};
use pmcache_ublk::target::Completed;
use pmcache_ublk::{BatchRead, BatchWrite, IoStarted, Target, TargetError};

use crate::conn::CacheConn;

fn target_error(err: Error) -> TargetError {
    TargetError::new(err.errno(), err.to_string())
}

impl Target for CacheConn<'_> {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), TargetError> {
        self.lane.read(offset_bytes, buf).map_err(target_error)
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), TargetError> {
        self.lane.write(offset_bytes, data, fua).map_err(target_error)
    }

    /// The writes a queue received together, group-committed by the engine
    /// (`Lane::write_batch`).
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), TargetError>>,
    ) {
        let requests = writes.iter().map(|w| WriteRequest {
            offset: w.offset_bytes,
            data: w.data,
            fua: w.fua,
        });
        self.write_batch_into(requests, outcomes, target_error);
    }

    /// The reads a queue received together, pipelined by the engine (`Lane::read_batch`).
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), TargetError>>,
    ) {
        let requests =
            reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf });
        self.read_batch_into(requests, outcomes, target_error);
    }

    /// Writes group-committed in write-back modes, whole blocks left in flight to the backing
    /// store otherwise (`Lane::write_batch_start`).
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<IoStarted>) {
        let requests = writes.iter().map(|w| WriteRequest {
            offset: w.offset_bytes,
            data: w.data,
            fua: w.fua,
        });
        self.write_batch_start_into(
            requests,
            started,
            |result| IoStarted::Done(result.map_err(target_error)),
            IoStarted::Pending,
        );
    }

    /// Hits answered at once, misses left in flight on the lane's queue
    /// (`Lane::read_batch_start`).
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<IoStarted>) {
        let requests =
            reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf });
        self.read_batch_start_into(
            requests,
            started,
            |result| IoStarted::Done(result.map_err(target_error)),
            IoStarted::Pending,
        );
    }

    fn pending(&self) -> usize {
        self.lane.pending()
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        CacheConn::completion_fd(self)
    }

    fn complete(&mut self, min: usize, done: &mut Completed<'_>) -> usize {
        self.complete_into(min, done, target_error)
    }

    fn flush(&mut self) -> Result<(), TargetError> {
        self.lane.flush().map_err(target_error)
    }

    fn discard(&mut self, offset_bytes: u64, len_bytes: u64) -> Result<(), TargetError> {
        self.lane.trim(offset_bytes, len_bytes).map_err(target_error)
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        _may_unmap: bool,
    ) -> Result<(), TargetError> {
        self.lane.write_zeroes(offset_bytes, len_bytes, fua).map_err(target_error)
    }
}
