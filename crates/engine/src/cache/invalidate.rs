//! Dropping every clean copy the cache holds: what a detach does once every dirty block is
//! written back, so that a cache attached again after its backing store was used alone serves
//! nothing from before (docs/DURABILITY.md, "Detach").

use super::*;

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Drops every clean copy the cache holds: its entry durably zeroed, its index entry
    /// removed, its slot free. Dirty blocks stay as they are (a detach writes them back
    /// first). Returns how many copies were dropped.
    ///
    /// Every lane must have been dropped (else `LanesOpen`, and nothing changes); no lane is
    /// handed out while it runs; after `shutdown`, `ShutDown`. The backing store is synced
    /// first: a clean copy newer than the last sync may be newer than what the backing store
    /// durably holds (recovery would make it dirty again), so none is dropped before the sync
    /// succeeds, and a failed sync changes nothing. Then each clean copy's entry is zeroed and
    /// one fence makes them durable. A power cut meanwhile leaves some of them, each the only
    /// entry of its block — every superseded entry is durably zeroed once every lane is
    /// dropped (a lane fences its pending zeroings when dropped) — so no older copy comes back,
    /// and what is left is recovered as any clean copy.
    ///
    /// A clean slot whose entry no longer reads as a valid one (the medium changed under it)
    /// has its entry zeroed too, so that no attach takes it for a copy; its DRAM state stays,
    /// its block being unknown.
    pub fn drop_clean_copies(&self) -> Result<u64> {
        let _lifecycle = lock(&self.lifecycle);
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::ShutDown);
        }
        let open = self.lanes.iter().filter(|l| l.in_use.load(Ordering::Acquire)).count();
        if open > 0 {
            return Err(Error::LanesOpen { open });
        }
        self.sync_backing()?;
        let mut dropped = Vec::new();
        for slot in 0..self.slots.len() {
            if self.slots.load(slot).state() != SlotState::Clean {
                continue;
            }
            let DecodedEntry::Valid(entry) = self.read_entry(slot) else {
                self.clear_entry(slot);
                continue;
            };
            let found = self.index.lookup(entry.lba);
            assert_eq!(found.map(|f| f.slot), Some(slot), "clean slot {slot} not indexed");
            self.index.remove(&found.expect("checked"));
            self.slots.free(slot);
            self.clear_entry(slot);
            dropped.push(slot);
        }
        self.medium.drain();
        // Only slots whose zeroed entries are durable go back to the pool.
        self.pools.put(dropped.iter().copied());
        Ok(dropped.len() as u64)
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use std::sync::Arc;

    use pmcache_backing::BackingStore;

    use crate::testing::model::{BLOCK, SimEngine, World, config, pattern};
    use crate::{AdmissionConfig, CacheMode, Engine, Error, EvictionKind, ManualClock};

    fn engine(world: &World, mode: CacheMode) -> SimEngine {
        let cfg = config(mode, EvictionKind::Clock, AdmissionConfig::Always);
        let clock = Arc::new(ManualClock::default());
        Engine::format(world.medium.clone(), world.backing.clone(), clock, &cfg).expect("format")
    }

    fn read(engine: &SimEngine, lba: u64) -> Vec<u8> {
        let mut buf = vec![0u8; BLOCK];
        engine.lane().expect("lane").read(lba * BLOCK as u64, &mut buf).expect("read");
        buf
    }

    /// Blocks written back, a block admitted by a read miss, a block still dirty: every clean
    /// copy goes (durably: none comes back after a power cut), the dirty one stays, and what
    /// is written to the backing store meanwhile is what a read then returns. Refused with a
    /// lane open, and after shutdown.
    #[test]
    fn every_clean_copy_is_dropped_and_the_dirty_ones_kept() {
        let world = World::fresh(3);
        let engine = engine(&world, CacheMode::WriteBack);
        let block = BLOCK as u64;
        let mut lane = engine.lane().expect("lane");
        for lba in 0..4 {
            lane.write(lba * block, &pattern(lba + 1, 0, block), false).expect("write");
        }
        lane.drain().expect("drain");
        lane.read(10 * block, &mut vec![0u8; BLOCK]).expect("a read miss, admitted");
        lane.write(5 * block, &pattern(6, 0, block), false).expect("write");
        assert!(matches!(engine.drop_clean_copies(), Err(Error::LanesOpen { open: 1 })));
        drop(lane);
        assert_eq!(engine.audit(), Ok(6), "a refused drop changed the cache");

        let flushes = world.backing.flushes();
        assert_eq!(engine.drop_clean_copies().ok(), Some(5));
        assert!(world.backing.flushes() > flushes, "the backing store was not synced first");
        assert_eq!(engine.audit(), Ok(1));
        assert_eq!(engine.dirty_slots(), 1);

        world.switch.cut_now();
        let after = world.after_power_cut(3);
        let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
        let clock = Arc::new(ManualClock::default());
        let (recovered, report) =
            Engine::open(after.medium.clone(), after.backing.clone(), clock, &cfg).expect("open");
        assert_eq!((report.clean, report.dirty), (0, 1), "{report:?}");
        let direct = pattern(100, 0, block);
        after.backing.write_at(&direct, 0).expect("a write to the backing store alone");
        assert_eq!(read(&recovered, 0), direct, "a dropped copy was served");
        assert_eq!(read(&recovered, 5), pattern(6, 0, block), "the dirty block was lost");
        engine.shutdown().expect("shutdown");
        assert!(matches!(engine.drop_clean_copies(), Err(Error::ShutDown)));
    }

    /// Write-through copies (on the backing store, not synced there yet) and a block written
    /// twice (its older copy superseded), then a power cut at every persist point of the
    /// drop, and after it: every block reads as last written, whatever the cut kept — no
    /// copy is dropped before the backing store holds its data durably, and no older copy
    /// comes back.
    #[test]
    fn a_power_cut_anywhere_in_the_drop_loses_nothing_and_brings_back_no_older_copy() {
        let block = BLOCK as u64;
        let blocks = 8u64;
        let mut cut_inside = 0;
        for point in 1.. {
            let world = World::fresh(40 + point);
            let engine = engine(&world, CacheMode::WriteThrough);
            let mut lane = engine.lane().expect("lane");
            lane.write(0, &pattern(99, 0, block), false).expect("write");
            for lba in 0..blocks {
                lane.write(lba * block, &pattern(lba + 1, 0, block), false).expect("write");
            }
            drop(lane);
            world.switch.arm(world.switch.points() + point);
            let _ = engine.drop_clean_copies();
            let inside = world.switch.has_crashed();
            if !inside {
                world.switch.cut_now();
            }
            let after = world.after_power_cut(40 + point);
            let cfg = config(CacheMode::WriteThrough, EvictionKind::Clock, AdmissionConfig::Always);
            let clock = Arc::new(ManualClock::default());
            let (recovered, _) =
                Engine::open(after.medium.clone(), after.backing.clone(), clock, &cfg)
                    .expect("open");
            for lba in 0..blocks {
                assert!(
                    read(&recovered, lba) == pattern(lba + 1, 0, block),
                    "block {lba} after a cut at point {point} of the drop"
                );
            }
            if !inside {
                break;
            }
            cut_inside += 1;
        }
        assert!(cut_inside >= 2, "the drop has {cut_inside} persist points");
    }
}
