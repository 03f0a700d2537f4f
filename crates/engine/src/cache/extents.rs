//! Block status: which parts of a range are holes that read as zeroes, for NBD's
//! `base:allocation` (so that copies and maps skip them).
//!
//! A block with a copy in the cache is data. A block without one is what the backing store
//! says: a hole in a file reads as zeroes; a store that cannot tell says data. Only the holes
//! of the backing store are looked up block by block (data stays data whatever the cache
//! holds), at most [`EXTENT_LOOKUPS_MAX`] per call: a longer answer is cut short, which the
//! protocol allows (the client asks again from where it stopped).
//!
//! The index is asked before the backing store's answer for a block is taken: a block the
//! index does not hold inside a hole is asked of the backing store again after the lookup. A
//! dirty block cleaned and evicted between the backing store's first answer and the lookup
//! is then data on the store, and is never reported as a hole a copy would skip.

use super::*;
use pmcache_backing::Extent;

/// Most index lookups one call makes (64 Ki blocks: 256 MiB of holes at 4 KiB blocks).
pub(super) const EXTENT_LOOKUPS_MAX: u64 = 65_536;

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Describes `offset..offset + len` from `offset` on: appends extents, each non-empty, in
    /// order, adjacent ones of the same kind merged, at most `extents_max` of them; together
    /// they cover the range or a prefix of it. `hole` means the extent reads as zeroes and
    /// holds no space on the backing store.
    pub fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Engine::extents");
        self.check_range("block status", offset, len)?;
        let block = u64::from(self.block_size());
        let end = offset + len;
        let mut at = offset;
        let mut lookups = 0u64;
        // Appends an extent, merged with the last one if of the same kind; false when full.
        let push = |out: &mut Vec<Extent>, extent: Extent| {
            let full = out.len() == extents_max;
            match out.last_mut() {
                Some(last) if last.hole == extent.hole => {
                    last.len += extent.len;
                    true
                }
                _ if full => false,
                _ => {
                    out.push(extent);
                    true
                }
            }
        };
        while at < end {
            let found = self
                .backing
                .extent_at(at, end - at)
                .map_err(|e| self.backing_failed(BackingOp::Other, e))?;
            let found_end = at + found.len.max(1);
            if !found.hole {
                if !push(out, Extent { len: found_end - at, hole: false }) {
                    return Ok(());
                }
                at = found_end;
                continue;
            }
            while at < found_end {
                if lookups == EXTENT_LOOKUPS_MAX {
                    return Ok(());
                }
                lookups += 1;
                let lba = at / block;
                let piece_end = ((lba + 1) * block).min(found_end);
                if self.index.lookup(lba).is_some() {
                    if !push(out, Extent { len: piece_end - at, hole: false }) {
                        return Ok(());
                    }
                    at = piece_end;
                    continue;
                }
                // The run of blocks the index does not hold, from here on.
                let run_start = at;
                at = piece_end;
                while at < found_end && lookups < EXTENT_LOOKUPS_MAX {
                    let lba = at / block;
                    if self.index.lookup(lba).is_some() {
                        break;
                    }
                    lookups += 1;
                    at = ((lba + 1) * block).min(found_end);
                }
                // Asked again, after the index: a block written back and evicted since the
                // first answer is data on the backing store now, never a hole over it.
                let mut run_at = run_start;
                while run_at < at {
                    let again = self
                        .backing
                        .extent_at(run_at, at - run_at)
                        .map_err(|e| self.backing_failed(BackingOp::Other, e))?;
                    let again_end = (run_at + again.len.max(1)).min(at);
                    if !push(out, Extent { len: again_end - run_at, hole: again.hole }) {
                        return Ok(());
                    }
                    run_at = again_end;
                }
            }
        }
        Ok(())
    }
}
