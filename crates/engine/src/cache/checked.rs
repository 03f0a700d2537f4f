//! Cached data read back with its checks: the medium may not return a line (poisoned: a PM
//! device's uncorrectable error), and in a cache formatted with data checksums
//! (`Config::data_crc`) each slot's data must match the CRC32C written with it.
//!
//! Every read of a slot's data — a hit, a partial write's merge, a write-back — goes through
//! here. A block that fails is never served: a clean one is dropped from the cache and read
//! from the backing store, which has it; a dirty one (the only copy) fails its request with
//! [`Error::CachedBlockUnreadable`], stays dirty and is not written back. A slot whose data is
//! on a poisoned line is retired: no block is placed there again while the engine runs.

use super::*;
use crate::error::Unreadable;
use crate::format::DATA_CRC_BYTES;

fn poisoned(p: pmcache_media::Poisoned) -> Unreadable {
    Unreadable::Poisoned { offset: p.offset }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Writes the checksum of `data`, the block just written to free `slot`, and starts its
    /// write-back, so that the fence that makes the data durable makes it durable too (before
    /// the slot's entry). Nothing without data checksums.
    #[inline]
    pub(super) fn store_data_crc(&self, slot: u32, data: &[u8]) {
        if self.layout.data_crc() {
            self.store_crc(slot, crc32c::crc32c(data));
        }
    }

    /// [`Engine::store_data_crc`] for a block of zeroes.
    #[inline]
    pub(super) fn store_zero_block_crc(&self, slot: u32) {
        if self.layout.data_crc() {
            self.store_crc(slot, self.zero_block_crc);
        }
    }

    /// Starts loading the line of `slot`'s checksum for a store to it (a cache with data
    /// checksums): the miss overlaps the data's copy.
    #[inline]
    pub(super) fn prefetch_crc_store(&self, slot: u32) {
        if self.layout.data_crc() {
            self.medium.prefetch(self.layout.crc_offset(slot), DATA_CRC_BYTES);
        }
    }

    fn store_crc(&self, slot: u32, crc: u32) {
        let at = self.layout.crc_offset(slot);
        self.medium.write(at, &crc.to_le_bytes());
        self.medium.flush(at, DATA_CRC_BYTES);
    }

    /// The checksum stored for `slot` (a cache with data checksums).
    #[inline]
    pub(super) fn stored_crc(&self, slot: u32) -> std::result::Result<u32, Unreadable> {
        let mut stored = [0u8; DATA_CRC_BYTES as usize];
        self.medium.read_checked(self.layout.crc_offset(slot), &mut stored).map_err(poisoned)?;
        Ok(u32::from_le_bytes(stored))
    }

    /// Checks a whole block against the checksum `stored` for it.
    #[inline]
    pub(super) fn verify(data: &[u8], stored: u32) -> std::result::Result<(), Unreadable> {
        let computed = crc32c::crc32c(data);
        if computed == stored { Ok(()) } else { Err(Unreadable::Mismatch { stored, computed }) }
    }

    /// Reads `slot`'s whole block into `out` and checks it. The caller holds the block's
    /// stripe (or otherwise knows the slot keeps its block meanwhile).
    pub(crate) fn read_block_checked(
        &self,
        slot: u32,
        out: &mut [u8],
    ) -> std::result::Result<(), Unreadable> {
        self.medium.read_checked(self.layout.data_offset(slot), out).map_err(poisoned)?;
        if self.layout.data_crc() {
            Self::verify(out, self.stored_crc(slot)?)?;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes at `in_block` of `slot`'s block and checks them, as
    /// [`Engine::read_block_checked`]; with data checksums a part of a block is read whole
    /// into `whole` (a block) first.
    pub(super) fn read_slot_checked(
        &self,
        slot: u32,
        in_block: usize,
        out: &mut [u8],
        whole: &mut [u8],
    ) -> std::result::Result<(), Unreadable> {
        if !self.layout.data_crc() {
            let at = self.layout.data_offset(slot) + in_block as u64;
            return self.medium.read_checked(at, out).map_err(poisoned);
        }
        if out.len() == whole.len() {
            return self.read_block_checked(slot, out);
        }
        self.read_block_checked(slot, whole)?;
        out.copy_from_slice(&whole[in_block..in_block + out.len()]);
        Ok(())
    }

    /// Retires the slots whose data or checksum lies on a line the medium reports poisoned
    /// (at attach: the medium's own list). Returns how many were retired.
    pub(crate) fn retire_poisoned_slots(&self) -> u64 {
        let ranges = self.medium.poisoned_ranges();
        if ranges.is_empty() {
            return 0;
        }
        let block = u64::from(self.layout.block_size);
        let hits =
            |start: u64, len: u64| ranges.iter().any(|r| r.start < start + len && start < r.end);
        (0..self.layout.slot_count as u32)
            .filter(|&slot| {
                hits(self.layout.data_offset(slot), block)
                    || (self.layout.data_crc()
                        && hits(self.layout.crc_offset(slot), DATA_CRC_BYTES))
            })
            .filter(|&slot| self.pools.retire(slot))
            .count() as u64
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Counts `slot`'s failed check (`why`), retires the slot if its data is on a poisoned
    /// line, and marks a dirty one so that reclaim tries it after every other dirty one. The
    /// caller holds the stripe of the block in it. Returns whether it is dirty (the block's
    /// only copy).
    pub(super) fn note_unreadable(&mut self, slot: u32, why: Unreadable) -> bool {
        let engine = self.engine;
        let counters = self.counters();
        match why {
            Unreadable::Poisoned { .. } => {
                bump(&counters.medium_read_errors, 1);
                engine.pools.retire(slot);
            }
            Unreadable::Mismatch { .. } => bump(&counters.data_crc_mismatches, 1),
        }
        let word = engine.slots.load(slot);
        if word.state() == SlotState::Dirty {
            bump(&counters.unreadable_dirty, 1);
            if !word.write_back_refused() {
                engine.slots.mark_write_back_refused(slot, word);
            }
            return true;
        }
        assert_eq!(word.state(), SlotState::Clean, "an unreadable slot {slot} that holds nothing");
        bump(&counters.unreadable_clean, 1);
        false
    }

    /// `lba`'s cached copy in `slot` failed its check (`why`); the caller holds `lba`'s
    /// stripe. A clean copy is dropped (the backing store has the block: the caller reads it
    /// there) and `Ok` returned. A dirty one is the block's only copy: the error names it.
    pub(super) fn unreadable(&mut self, lba: u64, slot: u32, why: Unreadable) -> Result<()> {
        if self.note_unreadable(slot, why) {
            return Err(Error::CachedBlockUnreadable { lba, why });
        }
        let engine = self.engine;
        let found = engine.index.lookup(lba).filter(|found| found.slot == slot);
        engine.index.remove(&found.expect("a clean slot read under its stripe is indexed"));
        self.free_slot(lba, slot);
        Ok(())
    }
}
