//! A write-through, write-around or pass-through write of many whole blocks goes to the
//! backing store run by run (`cache/through_runs.rs`): one write per run of at most 32 blocks,
//! the clean cached copies dropped before it, the dirty ones after the run is synced, and in
//! write-through every block cached again as a clean copy.

use std::sync::Arc;

use pmcache_engine::testing::{SimBacking, model};
use pmcache_engine::{AdmissionConfig, CacheMode, Config, Engine, EvictionKind, ManualClock};
use pmcache_media::{CrashMedium, CrashSwitch};

const BLOCK: usize = model::BLOCK;
const BLOCK_BYTES: u64 = BLOCK as u64;

type SimEngine = Engine<CrashMedium, SimBacking, Arc<ManualClock>>;

fn config() -> Config {
    Config {
        max_lanes: 2,
        ..model::config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always)
    }
}

fn engine() -> (SimEngine, CrashMedium) {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(8192 + 1024 * BLOCK_BYTES, switch.clone(), 1);
    let backing = SimBacking::new(4096 * BLOCK_BYTES, switch, 2);
    let clock = Arc::new(ManualClock::default());
    (Engine::format(medium.clone(), backing, clock, &config()).unwrap(), medium)
}

fn pattern(lba: u64, version: u8) -> Vec<u8> {
    (0..BLOCK).map(|i| (i as u8) ^ (lba as u8).wrapping_mul(31) ^ version).collect()
}

/// 128 blocks written at once in write-through over clean and dirty cached copies: four
/// writes of the backing store (before, 128), the dirty copies gone (the store synced before
/// they went), every block cached again clean and read back from the cache, and after a
/// flush and a restart from the durable images every block holds the new data.
#[test]
fn a_write_through_of_many_blocks_is_one_backing_write_per_run() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround, CacheMode::PassThrough] {
        let (engine, medium) = engine();
        let mut lane = engine.lane().unwrap();
        for lba in 10..20 {
            lane.write(lba * BLOCK_BYTES, &pattern(lba, 1), false).unwrap();
        }
        lane.drain().unwrap();
        for lba in 30..40 {
            lane.write(lba * BLOCK_BYTES, &pattern(lba, 1), false).unwrap();
        }
        assert_eq!(engine.stats().dirty_slots, 10);
        engine.set_mode(mode);
        let data: Vec<u8> = (0..128).flat_map(|lba| pattern(lba, 2)).collect();
        let (writes_before, _) = engine.backing().io_counts();
        lane.write(0, &data, false).unwrap();
        let (writes_after, _) = engine.backing().io_counts();
        assert_eq!(writes_after - writes_before, 4, "{mode:?}: backing writes for 128 blocks");
        let stats = engine.stats();
        assert_eq!(stats.dirty_slots, 0, "{mode:?}: {stats:?}");
        assert_eq!(stats.write_hits, 20, "{mode:?}: {stats:?}");
        let hits_before = engine.stats().read_hits;
        let mut buf = vec![0u8; BLOCK];
        for lba in 0..128 {
            lane.read(lba * BLOCK_BYTES, &mut buf).unwrap();
            assert!(buf == pattern(lba, 2), "{mode:?}: block {lba}");
        }
        let hits = engine.stats().read_hits - hits_before;
        let admitted = if mode == CacheMode::WriteThrough { 128 } else { 0 };
        assert_eq!(hits, admitted, "{mode:?}: read hits after the write");
        lane.flush().unwrap();
        drop(lane);
        engine.audit().unwrap();
        // A restart from the durable images (no clean shutdown).
        let image = medium.durable_image();
        let backing = engine.backing().durable_contents();
        drop(engine);
        let switch = CrashSwitch::new();
        let medium = CrashMedium::from_image(image, switch.clone(), 3);
        let backing = SimBacking::from_image(backing, switch, 4);
        let (engine, _) =
            Engine::open(medium, backing, Arc::new(ManualClock::default()), &config()).unwrap();
        let mut lane = engine.lane().unwrap();
        for lba in 0..128 {
            lane.read(lba * BLOCK_BYTES, &mut buf).unwrap();
            assert!(buf == pattern(lba, 2), "{mode:?}: block {lba} after the restart");
        }
    }
}
