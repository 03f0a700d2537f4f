//! The engine as an NBD export: [`CacheExport`] opens a [`CacheConn`] (one engine lane) per
//! client connection, and `CacheConn` is the connection (`pmcache_nbd::ExportConn`), the
//! requests a client had in flight together served as the engine's batches.

use std::os::fd::BorrowedFd;

use pmcache_engine::{Error, READS_PENDING_MAX, ReadRequest, WriteRequest};
use pmcache_nbd::export::Completed;
use pmcache_nbd::{
    BatchRead, BatchWrite, BlockExtent, BlockSizes, Export, ExportConn, ExportError, Started,
};

use crate::CacheEngine;
use crate::conn::CacheConn;

/// The engine as an NBD export: every connection gets its own lane.
pub struct CacheExport {
    engine: &'static CacheEngine,
}

fn export_error(err: Error) -> ExportError {
    ExportError::new(err.errno(), err.to_string())
}

impl CacheExport {
    /// Exports `engine`, which lives as long as the process.
    pub fn new(engine: &'static CacheEngine) -> Self {
        Self { engine }
    }
}

impl Export for CacheExport {
    type Conn = CacheConn<'static>;

    fn open_conn(&self) -> Result<CacheConn<'static>, ExportError> {
        self.engine.lane().map(CacheConn::new).map_err(export_error)
    }

    fn size_bytes(&self) -> u64 {
        self.engine.size_bytes()
    }

    fn block_sizes(&self) -> BlockSizes {
        let preferred = self.engine.block_size();
        BlockSizes { min_bytes: 512, preferred_bytes: preferred, max_bytes: 32 << 20 }
    }

    /// Safe in every mode: write-back writes are durable at acknowledgement, and a FLUSH on any
    /// connection syncs the backing store for every write any connection completed.
    fn can_multi_conn(&self) -> bool {
        true
    }
}

impl ExportConn for CacheConn<'_> {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.lane.read(offset_bytes, buf).map_err(export_error)
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.lane.write(offset_bytes, data, fua).map_err(export_error)
    }

    /// The writes a client had in flight, group-committed by the engine (`Lane::write_batch`).
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        let requests = writes.iter().map(|w| WriteRequest {
            offset: w.offset_bytes,
            data: w.data,
            fua: w.fua,
        });
        self.write_batch_into(requests, outcomes, export_error);
    }

    /// Writes group-committed in write-back modes, whole blocks left in flight to the backing
    /// store otherwise (`Lane::write_batch_start`).
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<Started>) {
        let requests = writes.iter().map(|w| WriteRequest {
            offset: w.offset_bytes,
            data: w.data,
            fua: w.fua,
        });
        self.write_batch_start_into(
            requests,
            started,
            |result| Started::Done(result.map_err(export_error)),
            Started::Pending,
        );
    }

    /// The reads a client had in flight, pipelined by the engine (`Lane::read_batch`).
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        let requests =
            reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf });
        self.read_batch_into(requests, outcomes, export_error);
    }

    /// Hits answered at once, misses left in flight on the lane's queue
    /// (`Lane::read_batch_start`).
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        let requests =
            reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf });
        self.read_batch_start_into(
            requests,
            started,
            |result| Started::Done(result.map_err(export_error)),
            Started::Pending,
        );
    }

    fn pending(&self) -> usize {
        self.lane.pending()
    }

    fn pending_max(&self) -> usize {
        READS_PENDING_MAX
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        CacheConn::completion_fd(self)
    }

    fn complete(&mut self, min: usize, done: &mut Completed<'_>) -> usize {
        self.complete_into(min, done, export_error)
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        self.lane.flush().map_err(export_error)
    }

    /// Holes of the backing store not cached are holes that read as zeroes; the rest is
    /// data (`Engine::extents`).
    fn block_status(
        &mut self,
        offset_bytes: u64,
        len_bytes: u32,
        extents_max: usize,
        extents: &mut Vec<BlockExtent>,
    ) -> Result<(), ExportError> {
        let mut found = Vec::with_capacity(extents_max.min(64));
        let engine = self.lane.engine();
        engine
            .extents(offset_bytes, u64::from(len_bytes), extents_max, &mut found)
            .map_err(export_error)?;
        extents.extend(found.into_iter().map(|e| BlockExtent {
            // Within the request's length, a u32.
            len_bytes: u32::try_from(e.len).unwrap_or(len_bytes),
            hole: e.hole,
            zero: e.hole,
        }));
        Ok(())
    }

    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), ExportError> {
        self.lane.trim(offset_bytes, len_bytes).map_err(export_error)?;
        if fua { self.flush() } else { Ok(()) }
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), ExportError> {
        self.lane.write_zeroes(offset_bytes, len_bytes, fua).map_err(export_error)
    }
}
