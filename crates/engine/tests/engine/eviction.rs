//! The eviction policies end to end: read hits mark a block's index entry, and the CLOCK hand
//! gives marked blocks a second chance; FIFO evicts in insertion order, hits or not.

use std::sync::Arc;

use pmcache_engine::testing::SimBacking;
use pmcache_engine::{AdmissionConfig, CacheMode, Config, Engine, EvictionKind, ManualClock};
use pmcache_media::{CrashMedium, CrashSwitch};

const BLOCK: usize = 512;
const SLOTS: u64 = 256;
const MEDIUM_BYTES: u64 = 8192 + SLOTS * BLOCK as u64;
const BACKING_BLOCKS: u64 = 4 * SLOTS;

/// Reads of the hot blocks that hit after a scan of new blocks evicted half the cache.
fn hot_hits_after_a_scan(eviction: EvictionKind) -> (u64, u64) {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1);
    let backing = SimBacking::new(BACKING_BLOCKS * BLOCK as u64, switch, 2);
    let config = Config {
        mode: CacheMode::WriteThrough,
        block_size: BLOCK as u32,
        max_lanes: 1,
        admission: AdmissionConfig::Always,
        eviction,
        ..Config::default()
    };
    let engine =
        Engine::format(medium, backing, Arc::new(ManualClock::default()), &config).expect("format");
    let slots = engine.stats().slot_count;
    let mut lane = engine.lane().expect("a lane");
    let mut buf = vec![0u8; BLOCK];
    let mut read = |lba: u64| lane.read(lba * BLOCK as u64, &mut buf).expect("read");
    // Fill the cache in block order (the hand meets them in that order), then hit the first
    // eighth of them: the hot set.
    let hot = slots / 8;
    (0..slots).for_each(&mut read);
    (0..hot).for_each(&mut read);
    // A scan of new blocks evicts about half the cache.
    (slots..slots + slots / 2).for_each(&mut read);
    let before = engine.stats().read_hits;
    (0..hot).for_each(&mut read);
    (engine.stats().read_hits - before, hot)
}

#[test]
fn clock_keeps_blocks_hit_since_the_hand_passed_and_fifo_does_not() {
    let (clock_hits, hot) = hot_hits_after_a_scan(EvictionKind::Clock);
    assert_eq!(clock_hits, hot, "CLOCK evicted blocks that were hit");
    let (fifo_hits, hot) = hot_hits_after_a_scan(EvictionKind::Fifo);
    assert!(fifo_hits < hot / 2, "FIFO kept {fifo_hits} of {hot} oldest blocks");
}

/// CLOCK's second chance is a chance, not immunity: with every clean block marked, the hand
/// clears the marks on a first pass and evicts on its second, before it would write back a
/// dirty block. Here the cache holds dirty blocks in its first 64 slots (written first, where
/// the hand starts) and clean blocks, each read twice, in the rest; a new block's admission
/// evicts a clean one and writes nothing back. (A hand that gave up after one pass, its last
/// chunk reaching a little into the dirty slots again, would write one back.)
#[test]
fn the_hand_passes_twice_before_it_writes_back() {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1);
    let backing = SimBacking::new(BACKING_BLOCKS * BLOCK as u64, switch, 2);
    let config = Config {
        block_size: BLOCK as u32,
        max_lanes: 1,
        admission: AdmissionConfig::Always,
        ..Config::default()
    };
    let engine =
        Engine::format(medium, backing, Arc::new(ManualClock::default()), &config).expect("format");
    let slots = engine.stats().slot_count;
    assert!(slots + 2 < 2 * slots && 2 * slots > 32, "one pass must not be a whole budget");
    let mut lane = engine.lane().expect("a lane");
    const DIRTY: u64 = 64;
    for lba in 0..DIRTY {
        lane.write(lba * BLOCK as u64, &[1; BLOCK], false).expect("a dirty block");
    }
    let mut buf = vec![0u8; BLOCK];
    for _ in 0..2 {
        for lba in DIRTY..slots {
            lane.read(lba * BLOCK as u64, &mut buf).expect("read");
        }
    }
    let before = engine.stats();
    assert_eq!((before.dirty_slots, before.evictions), (DIRTY, 0), "{before:?}");
    lane.read(slots * BLOCK as u64, &mut buf).expect("a new block");
    let after = engine.stats();
    assert!(after.evictions > 0, "{after:?}");
    assert_eq!(after.writebacks, 0, "wrote back a dirty block with clean ones to evict");
    assert_eq!(after.dirty_slots, DIRTY);
}
