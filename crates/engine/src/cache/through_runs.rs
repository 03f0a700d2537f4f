//! Write-through, write-around and pass-through writes of many whole blocks: one write of the
//! backing store per run of blocks rather than one per block.
//!
//! The request goes run by run of blocks whose stripes the lane holds together
//! (`Engine::hold_range`, at most `RANGE_HOLD_BLOCKS_MAX` blocks, once no write-through of them
//! is in flight and the cleaner's copies of them have landed). Under a run it does what
//! `write_block_backing` does block by block (`write.rs`): a clean cached copy is dropped
//! durably *before* the backing store changes, a dirty one only *after* the run is synced
//! there (it is the only durable copy of what it held); in write-through each block is then
//! admitted as a clean copy, its sequence number taken after the backing write (the synced
//! rule), in a slot reserved before the stripes were taken (reserving may reclaim, which takes
//! stripes). An admission that finds its index buckets full, or whose stores met a range of the
//! medium lost meanwhile, is not made. A request racing with the run on one of its blocks runs
//! wholly before or wholly after it there; the request as a whole, as any multi-block write, is
//! not atomic.

use super::ordering::{RANGE_HOLD_BLOCKS_MAX, RangeHold};
use super::*;

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Writes `data` (whole blocks) at block-aligned `offset` to the backing store, run by run
    /// (see the module); `admit`: write-through, which caches what it wrote.
    pub(super) fn write_blocks_backing(
        &mut self,
        offset: u64,
        data: &[u8],
        admit: bool,
    ) -> Result<()> {
        let engine = self.engine;
        let block = self.block_bytes();
        assert!(
            offset.is_multiple_of(block) && (data.len() as u64).is_multiple_of(block),
            "a run of whole blocks"
        );
        let first = offset / block;
        let end = first + data.len() as u64 / block;
        bump(&self.counters().writes, end - first);
        let mut reserved: SmallVec<[u32; RANGE_HOLD_BLOCKS_MAX as usize]> = SmallVec::new();
        let (mut hits, mut dropped_dirty) = (0u64, 0u64);
        let mut lba = first;
        let written = loop {
            if lba >= end {
                break Ok(());
            }
            if admit {
                while (reserved.len() as u64) < (end - lba).min(RANGE_HOLD_BLOCKS_MAX) {
                    match self.reserve_for_admission(true) {
                        Some(slot) => reserved.push(slot),
                        None => break,
                    }
                }
            }
            let mut hold = self.hold_range_for_backing(lba, end, RANGE_HOLD_BLOCKS_MAX);
            let run_end = hold.end();
            let mut dirty: SmallVec<[(u64, Found); RANGE_HOLD_BLOCKS_MAX as usize]> =
                SmallVec::new();
            for b in lba..run_end {
                let Some(found) = engine.index.lookup(b) else { continue };
                hits += 1;
                if engine.slots.load(found.slot).state() == SlotState::Dirty {
                    dirty.push((b, found));
                } else {
                    engine.index.remove(&found);
                    self.free_slot(b, found.slot);
                }
            }
            let bytes = |from: u64, to: u64| {
                ((from - first) * block) as usize..((to - first) * block) as usize
            };
            if let Err(err) =
                engine.backing_write(&data[bytes(lba, run_end)], lba * block, &hold.turn())
            {
                break Err(err);
            }
            if !dirty.is_empty() {
                if let Err(err) = engine.sync_backing() {
                    break Err(err);
                }
                for &(b, found) in &dirty {
                    engine.index.remove(&found);
                    self.free_slot(b, found.slot);
                }
                dropped_dirty += dirty.len() as u64;
            }
            for b in lba..run_end {
                let Some(slot) = reserved.pop() else { break };
                if !self.admit_written(&mut hold, b, slot, &data[bytes(b, b + 1)]) {
                    reserved.push(slot);
                }
            }
            drop(hold);
            lba = run_end;
        };
        for slot in reserved {
            self.give_back(slot);
        }
        let counters = self.counters();
        bump(&counters.write_hits, hits);
        bump(&counters.dirty_delta, dropped_dirty.wrapping_neg());
        written
    }

    /// Caches `data`, just written to the backing store as block `lba` (whose stripe `hold`
    /// holds, with no copy of it in the cache), as a clean copy in free `slot`. False if it
    /// was not (the slot is left to the caller, or given back if its stores met a lost range).
    fn admit_written(
        &mut self,
        hold: &mut RangeHold<'_>,
        lba: u64,
        slot: u32,
        data: &[u8],
    ) -> bool {
        let engine = self.engine;
        let Ok(Some(inserted)) = self.index_insert_optional(lba, slot) else {
            return false;
        };
        let seq = engine.global_seq(hold.stripe_last(engine.stripe_index(lba)));
        self.write_data(slot, data);
        self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
        if !self.reveal_clean_copy(&inserted, slot) {
            self.give_back(slot);
        }
        true
    }
}
