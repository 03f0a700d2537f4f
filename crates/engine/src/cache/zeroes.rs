//! Write-zeroes over many blocks in the write-back modes.
//!
//! Zeroing through the cache writes a dirty zero block per block: one NBD `WRITE_ZEROES` of
//! 4 GiB would be a million dirty writes under one request, filling the cache and stalling on
//! the cleaner. From [`ZERO_THROUGH_BLOCKS_MIN`] whole blocks on, the work is bounded instead:
//! - a block cached when looked at gets a zero block in the cache, as a write would (at most
//!   as many as the cache holds);
//! - a run of uncached blocks is zeroed on the backing store with one call per extent that is
//!   not a hole already (a hole reads as zeroes), then every clean copy a read miss brought
//!   into the cache meanwhile is dropped under its stripe (a miss reads the backing store
//!   under the stripe, so none can survive holding the old data); a dirty copy there is a
//!   concurrent write's, and stays;
//! - the backing store is synced once at the end, so the zeroes are durable when the request
//!   is acknowledged, as every write-back write is.

use super::write::Payload;
use super::*;

/// Whole blocks from which a write-zeroes in a write-back mode zeroes uncached blocks on the
/// backing store instead of writing zero blocks into the cache.
pub(super) const ZERO_THROUGH_BLOCKS_MIN: u64 = 256;
/// Most blocks zeroed on the backing store in one run (the stripe pass after it then takes
/// at most this many locks in a row).
const ZERO_RUN_BLOCKS_MAX: u64 = 16_384;

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Zeroes the whole blocks `first..end` (see the module's comment).
    pub(super) fn write_zeroes_through(&mut self, first: u64, end: u64) -> Result<()> {
        let engine = self.engine;
        let block = self.block_bytes();
        let mut backing_written = false;
        let mut lba = first;
        while lba < end {
            if engine.index.lookup(lba).is_some() {
                self.write_block(lba, 0, Payload::Zeroes(block as usize))?;
                lba += 1;
                continue;
            }
            let mut run_end = lba + 1;
            while run_end < end
                && run_end - lba < ZERO_RUN_BLOCKS_MAX
                && engine.index.lookup(run_end).is_none()
            {
                run_end += 1;
            }
            backing_written |= self.zero_uncached_run(lba, run_end)?;
            bump(&self.counters().writes, run_end - lba);
            lba = run_end;
        }
        if backing_written {
            engine.sync_backing()?;
        }
        Ok(())
    }

    /// Zeroes `first..end`, blocks that were not cached when looked at, on the backing store
    /// where it is not a hole already, then drops the clean copies cached since. Returns
    /// whether the backing store was written.
    fn zero_uncached_run(&mut self, first: u64, end: u64) -> Result<bool> {
        let engine = self.engine;
        let block = self.block_bytes();
        let stop = end * block;
        let mut at = first * block;
        let mut written = false;
        while at < stop {
            let extent =
                engine.backing.extent_at(at, stop - at).map_err(|e| engine.backing_failed(e))?;
            if !extent.hole {
                engine.backing_write_zeroes(at, extent.len)?;
                written = true;
            }
            at += extent.len.max(1);
        }
        if !written {
            return Ok(false);
        }
        for lba in first..end {
            let guard = engine.lock_stripe(lba);
            if let Some(found) = engine.index.lookup(lba)
                && engine.slots.load(found.slot).state() != SlotState::Dirty
            {
                engine.index.remove(&found);
                self.free_slot(lba, found.slot);
            }
            drop(guard);
        }
        Ok(true)
    }
}
