//! Write-zeroes over many blocks in the write-back modes.
//!
//! Zeroing through the cache writes a dirty zero block per block: one NBD `WRITE_ZEROES` of
//! 4 GiB would be a million dirty writes under one request, filling the cache and stalling on
//! the cleaner. From [`ZERO_THROUGH_BLOCKS_MIN`] whole blocks on, the work is bounded instead:
//! - a block cached when looked at gets a zero block in the cache, as a write would (at most
//!   as many as the cache holds);
//! - a run of blocks not cached is zeroed on the backing store with one call per extent that
//!   is not a hole already (a hole reads as zeroes), while the run's stripes are held
//!   (`Engine::hold_range`, which also waits for the cleaner's copies of them to land): the
//!   run is looked up again under them, and until they are released no request can cache,
//!   write or write back one of its blocks. A write racing with the zeroes on one of them so
//!   runs wholly before (the block is cached: it gets a zero block in the cache) or wholly
//!   after (it reads the zeroes from the backing store);
//! - the backing store is synced once at the end — when it wrote zeroes, or when any earlier
//!   write of it is not synced yet (a hole skipped may be one a TRIM punched and nothing
//!   synced) — so the zeroes are durable when the request is acknowledged, as every
//!   write-back write is.

use super::ordering::{BackingTurn, RANGE_HOLD_BLOCKS_MAX};
use super::write::Payload;
use super::*;

/// Whole blocks from which a write-zeroes in a write-back mode zeroes uncached blocks on the
/// backing store instead of writing zero blocks into the cache.
pub(super) const ZERO_THROUGH_BLOCKS_MIN: u64 = 256;
/// Most blocks zeroed on the backing store in one run: the stripes held at once.
const ZERO_RUN_BLOCKS_MAX: u64 = RANGE_HOLD_BLOCKS_MAX;

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Zeroes the whole blocks `first..end` (see the module's comment).
    pub(super) fn write_zeroes_through(&mut self, first: u64, end: u64) -> Result<()> {
        let engine = self.engine;
        let mut backing_written = false;
        let mut lba = first;
        while lba < end {
            if engine.index.lookup(lba).is_some() {
                self.write_block(lba, 0, Payload::Zeroes(self.block_bytes() as usize))?;
                lba += 1;
                continue;
            }
            let hold = self.hold_range_for_backing(lba, end, ZERO_RUN_BLOCKS_MAX);
            // Under the stripes: the blocks from `lba` on that are still not cached.
            let run_end =
                (lba..hold.end()).find(|&b| engine.index.lookup(b).is_some()).unwrap_or(hold.end());
            if run_end == lba {
                // Cached meanwhile: a zero block in the cache, on the next turn.
                continue;
            }
            backing_written |= self.zero_uncached_run(lba, run_end, &hold.turn())?;
            drop(hold);
            bump(&self.counters().writes, run_end - lba);
            lba = run_end;
        }
        // Acknowledged zeroes are durable: the zeroes written, and the holes skipped — a hole
        // a TRIM punched (or any earlier write) may not be synced yet.
        if backing_written
            || engine.backing_writes.load(Ordering::SeqCst)
                != engine.backing_writes_synced.load(Ordering::SeqCst)
        {
            engine.sync_backing()?;
        }
        Ok(())
    }

    /// Zeroes `first..end`, blocks not cached whose stripes the caller holds (`turn`), on the
    /// backing store where it is not a hole already. Returns whether the backing store was
    /// written.
    fn zero_uncached_run(&mut self, first: u64, end: u64, turn: &BackingTurn) -> Result<bool> {
        let engine = self.engine;
        let block = self.block_bytes();
        let stop = end * block;
        let mut at = first * block;
        let mut written = false;
        while at < stop {
            let extent = engine
                .backing
                .extent_at(at, stop - at)
                .map_err(|e| engine.backing_failed(BackingOp::Other, e))?;
            if !extent.hole {
                engine.backing_write_zeroes(at, extent.len.min(stop - at), turn)?;
                written = true;
            }
            at += extent.len.max(1);
        }
        Ok(written)
    }
}
