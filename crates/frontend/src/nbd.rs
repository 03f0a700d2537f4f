//! The engine as an NBD export: [`CacheExport`] opens a [`CacheConn`] (one engine lane) per
//! client connection, which serves the requests a client had in flight together as the
//! engine's batches.

use std::sync::Arc;

use pmcache_block::BlockError;
use pmcache_nbd::{BlockSizes, Export};

use crate::CacheEngine;
use crate::conn::{CacheConn, ReadLatencies, block_error};

/// The engine as an NBD export: every connection gets its own lane.
pub struct CacheExport {
    engine: Arc<CacheEngine>,
    latencies: Arc<ReadLatencies>,
}

impl CacheExport {
    /// Exports `engine`, its connections' read latencies added to `latencies`.
    pub fn new(engine: Arc<CacheEngine>, latencies: Arc<ReadLatencies>) -> Self {
        Self { engine, latencies }
    }
}

impl Export for CacheExport {
    type Conn<'a> = CacheConn<'a>;

    fn open_conn(&self) -> Result<CacheConn<'_>, BlockError> {
        let lane = self.engine.lane().map_err(block_error)?;
        Ok(CacheConn::new(lane, self.latencies.clone()))
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
