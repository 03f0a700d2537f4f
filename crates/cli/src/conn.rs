//! The engine lane a frontend connection or queue serves: NBD's `ExportConn` (`crate::nbd`)
//! and ublk's `Target` (`crate::ublk`) are both implemented on it, with the batch calls they
//! share here.

use pmcache_engine::{Error, Lane, MonotonicClock, ReadRequest, WriteRequest};
use pmcache_media::PmemFile;

use crate::cache::Backing;

/// One engine lane, served by one frontend connection or queue: NBD's `ExportConn` in
/// `crate::nbd`, ublk's `Target` in `crate::ublk`.
pub(crate) struct CacheConn {
    pub(crate) lane: Lane<'static, PmemFile, Backing, MonotonicClock>,
    /// The engine's outcomes of one batch, kept from batch to batch.
    results: Vec<Result<(), Error>>,
}

impl CacheConn {
    pub(crate) fn new(lane: Lane<'static, PmemFile, Backing, MonotonicClock>) -> Self {
        Self { lane, results: Vec::new() }
    }

    /// The writes a frontend had in flight together, group-committed by the engine
    /// (`Lane::write_batch`); their outcomes appended to `outcomes` through `map`.
    pub(crate) fn write_batch_into<'a, E>(
        &mut self,
        writes: impl Iterator<Item = WriteRequest<'a>>,
        outcomes: &mut Vec<Result<(), E>>,
        map: fn(Error) -> E,
    ) {
        let requests: Vec<WriteRequest<'a>> = writes.collect();
        self.lane.write_batch(&requests, &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(map)));
    }

    /// The reads a frontend had in flight together, pipelined by the engine
    /// (`Lane::read_batch`); their outcomes appended to `outcomes` through `map`.
    pub(crate) fn read_batch_into<'a, E>(
        &mut self,
        reads: impl Iterator<Item = ReadRequest<'a>>,
        outcomes: &mut Vec<Result<(), E>>,
        map: fn(Error) -> E,
    ) {
        let mut requests: Vec<ReadRequest<'a>> = reads.collect();
        self.lane.read_batch(&mut requests, &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(map)));
    }
}
