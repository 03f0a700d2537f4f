//! The engine as an NBD export: [`CacheExport`] opens a [`CacheConn`] (one engine lane) per
//! client connection, which serves the requests a client had in flight together as the
//! engine's batches.

use pmcache_block::BlockError;
use pmcache_nbd::{BlockSizes, Export};

use crate::CacheEngine;
use crate::conn::{CacheConn, block_error};

/// The engine as an NBD export: every connection gets its own lane.
pub struct CacheExport {
    engine: &'static CacheEngine,
}

impl CacheExport {
    /// Exports `engine`, which lives as long as the process.
    pub fn new(engine: &'static CacheEngine) -> Self {
        Self { engine }
    }
}

impl Export for CacheExport {
    type Conn = CacheConn<'static>;

    fn open_conn(&self) -> Result<CacheConn<'static>, BlockError> {
        self.engine.lane().map(CacheConn::new).map_err(block_error)
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
