//! The stripe's pending free (invariant 2 of docs/DURABILITY.md): an overwrite leaves the old
//! copy's zeroed entry unfenced on its lane's thread; another lane that then drops the block's
//! newest copy must make that zeroing durable first, or a power cut brings the old copy back as
//! the block's only (dirty) entry. With the remover's re-flush taken out of `free_slot`, or the
//! zeroing lane's write-back taken out of its fence, this test fails.

use std::sync::Arc;
use std::sync::mpsc;

use pmcache_engine::testing::model::{BLOCK, World, config, pattern};
use pmcache_engine::{AdmissionConfig, CacheMode, Engine, EvictionKind, ManualClock, WriteRequest};

#[test]
fn a_removal_on_another_lane_makes_the_pending_free_durable_first() {
    let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
    let old = pattern(1, 0, BLOCK as u64);
    let new = pattern(2, 0, BLOCK as u64);
    let newest = pattern(3, 0, BLOCK as u64);
    // Either the overwriting lane stays idle (the remover must write the zeroing back itself),
    // or it fences once more first (that fence must have written the zeroing back).
    for (seed, lane_fences_first) in (0..128).map(|seed| (seed, seed % 2 == 1)) {
        let world = World::fresh(seed);
        let clock = Arc::new(ManualClock::default());
        let engine =
            Engine::format(world.medium.clone(), world.backing.clone(), clock.clone(), &cfg)
                .expect("format");
        let (overwritten, wait_for_overwrite) = mpsc::channel();
        let (cut, wait_for_cut) = mpsc::channel();
        std::thread::scope(|s| {
            let (engine, old, new) = (&engine, &old, &new);
            s.spawn(move || {
                let mut lane = engine.lane().expect("lane");
                lane.write(0, old, false).expect("write old");
                // Other blocks in between, so that the old and the new copy's entries sit in
                // different cache lines (a flush of one line by another lane would make the
                // zeroing durable by itself).
                for lba in 1..=8u64 {
                    let data = pattern(10 + lba, lba * BLOCK as u64, BLOCK as u64);
                    lane.write(lba * BLOCK as u64, &data, false).expect("write other");
                }
                lane.write(0, new, false).expect("write new");
                if lane_fences_first {
                    // Fences (persisting the synced sequence number) without taking a slot (a
                    // write would reuse the freed one) or flushing other entries' lines.
                    lane.flush().expect("flush");
                }
                overwritten.send(()).expect("main thread");
                // The lane stays alive until power is cut (dropping it would fence).
                wait_for_cut.recv().expect("main thread");
            });
            wait_for_overwrite.recv().expect("writer");
            // Write-around: the write goes to the backing store (synced, since the cached
            // copy is dirty), then the cached copy is dropped with no newer entry replacing it.
            engine.set_mode(CacheMode::WriteAround);
            let mut lane = engine.lane().expect("second lane");
            lane.write(0, &newest, false).expect("write around");
            world.switch.cut_now();
            cut.send(()).expect("writer");
        });
        drop(engine);
        let after = world.after_power_cut(seed);
        let (engine, _) = Engine::open(after.medium, after.backing, clock, &cfg).expect("open");
        let mut buf = vec![0u8; BLOCK];
        engine.lane().expect("lane").read(0, &mut buf).expect("read after the cut");
        assert!(buf != old, "seed {seed}: the overwritten copy came back after the power cut");
        assert_eq!(buf, newest, "seed {seed}: block 0 after the power cut");
    }
}

/// A lane keeps the fence counts it read of other lanes and reads one again only when its
/// last reading does not show a fence since the pending free was recorded. Here the overwriting
/// lane zeroes two old copies between the same two fences (one group commit), and the remover
/// drops both blocks: its reading of the writer's count, taken for the first, equals the
/// count recorded for the second. It must still take the second zeroing as not durable and
/// write it back; counting that reading as "fenced since" (`>=` instead of `>`) fails here.
#[test]
fn a_fence_count_read_earlier_does_not_count_as_a_fence_since() {
    let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
    let block = BLOCK as u64;
    let (first, second) = (0u64, 9u64);
    for seed in 0..128 {
        let world = World::fresh(seed);
        let clock = Arc::new(ManualClock::default());
        let engine =
            Engine::format(world.medium.clone(), world.backing.clone(), clock.clone(), &cfg)
                .expect("format");
        let (overwritten, wait_for_overwrite) = mpsc::channel();
        let (cut, wait_for_cut) = mpsc::channel();
        std::thread::scope(|s| {
            let engine = &engine;
            s.spawn(move || {
                let mut lane = engine.lane().expect("lane");
                // Old copies of both blocks, with other blocks around them so that each old
                // entry has a cache line of its own.
                for lba in 0..18u64 {
                    lane.write(lba * block, &pattern(100 + lba, lba * block, block), false)
                        .expect("write old");
                }
                let new_first = pattern(1, first * block, block);
                let new_second = pattern(2, second * block, block);
                let batch = [
                    WriteRequest { offset: first * block, data: &new_first, fua: false },
                    WriteRequest { offset: second * block, data: &new_second, fua: false },
                ];
                let mut outcomes = Vec::new();
                lane.write_batch(&batch, &mut outcomes);
                assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
                overwritten.send(()).expect("main thread");
                // Alive (dropping the lane would fence) and idle until power is cut.
                wait_for_cut.recv().expect("main thread");
            });
            wait_for_overwrite.recv().expect("writer");
            engine.set_mode(CacheMode::WriteAround);
            let mut lane = engine.lane().expect("second lane");
            for lba in [second, first] {
                lane.write(lba * block, &pattern(3, lba * block, block), false)
                    .expect("write around");
            }
            world.switch.cut_now();
            cut.send(()).expect("writer");
        });
        drop(engine);
        let after = world.after_power_cut(seed);
        let (engine, _) = Engine::open(after.medium, after.backing, clock, &cfg).expect("open");
        let mut lane = engine.lane().expect("lane");
        for lba in [first, second] {
            let mut buf = vec![0u8; BLOCK];
            lane.read(lba * block, &mut buf).expect("read after the cut");
            assert_eq!(
                buf,
                pattern(3, lba * block, block),
                "seed {seed}: block {lba} after the cut"
            );
        }
    }
}
