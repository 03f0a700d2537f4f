//! Per-request completion of write-throughs and write-arounds: a whole-block write in either
//! mode is in flight on the lane's queue (`Lane::write_start`) while the requests behind it
//! are answered; it is answered by `Lane::complete` once the backing store has it. The
//! backing store's completions are held by the latch of `LatchedBacking`.
#![cfg(not(feature = "shuttle"))]

use std::sync::Arc;
use std::time::Duration;

use pmcache_backing::BackingStore;
use pmcache_engine::testing::latched::{LatchedBacking, latched_engine};
use pmcache_engine::testing::model::{BLOCK, pattern};
use pmcache_engine::{CacheMode, Lane, ManualClock, ReadStart, Ticket, WriteRequest, WriteStart};

type LatchedLane<'e> =
    Lane<'e, pmcache_engine::testing::model::SimMedium, Arc<LatchedBacking>, Arc<ManualClock>>;

const B: u64 = BLOCK as u64;

/// The tickets `complete` hands over (waiting for `min`), each request having succeeded.
fn completed(lane: &mut LatchedLane<'_>, min: usize) -> Vec<Ticket> {
    let mut got = Vec::new();
    lane.complete(min, &mut |ticket, result| {
        result.expect("the request in flight");
        got.push(ticket);
    });
    got
}

fn stored(backing: &LatchedBacking, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    backing.inner.read_at(&mut buf, lba * B).expect("read the device");
    buf
}

#[test]
fn a_hit_behind_a_held_write_through_is_answered_and_the_write_admitted_at_its_completion() {
    let (backing, engine) = latched_engine(CacheMode::WriteThrough);
    let mut lane = engine.lane().expect("lane");
    let cached = pattern(2, B, B);
    lane.write(B, &cached, false).expect("write block 1 through");
    backing.hold(true);
    let new = pattern(3, 0, B);
    let WriteStart::Pending(ticket) = lane.write_start(0, &new, false) else {
        panic!("a whole-block write-through must be in flight");
    };
    assert_eq!(lane.pending(), 1);
    let mut hit = vec![0u8; BLOCK];
    let ReadStart::Done(result) = lane.read_start(B, &mut hit) else {
        panic!("block 1 is cached: answered at once");
    };
    result.expect("the hit");
    assert_eq!(hit, cached);
    assert!(completed(&mut lane, 0).is_empty(), "the held write completed");
    backing.hold(false);
    assert_eq!(completed(&mut lane, 1), vec![ticket], "the write's answer, by its ticket");
    assert_eq!(stored(&backing, 0), new, "on the backing store");
    let misses_before = engine.stats().read_misses_admitted + engine.stats().read_misses_bypassed;
    let mut after = vec![0u8; BLOCK];
    let ReadStart::Done(Ok(())) = lane.read_start(0, &mut after) else {
        panic!("block 0 was admitted by its write-through");
    };
    assert_eq!(after, new);
    let stats = engine.stats();
    assert_eq!(stats.read_misses_admitted + stats.read_misses_bypassed, misses_before);
}

#[test]
fn a_write_around_in_flight_drops_the_clean_copy_at_its_start_and_admits_nothing() {
    let (backing, engine) = latched_engine(CacheMode::WriteAround);
    let mut lane = engine.lane().expect("lane");
    let mut buf = vec![0u8; BLOCK];
    lane.read(0, &mut buf).expect("admit block 0 clean");
    backing.hold(true);
    let new = pattern(4, 0, B);
    let WriteStart::Pending(_) = lane.write_start(0, &new, false) else {
        panic!("a whole-block write-around must be in flight");
    };
    // The old clean copy is gone: the read goes to the store (and waits at the latch).
    let ReadStart::Pending(_) = lane.read_start(0, &mut buf) else {
        panic!("block 0's old copy was served beside its write in flight");
    };
    backing.hold(false);
    assert_eq!(completed(&mut lane, 2).len(), 2);
    assert_eq!(stored(&backing, 0), new);
    let ReadStart::Pending(_) = lane.read_start(0, &mut buf) else {
        panic!("a write-around admitted its block, or the miss beside it did");
    };
    let mut read = Vec::new();
    lane.complete(1, &mut |_, data| read = data.expect("read").to_vec());
    assert_eq!(read, new);
}

/// Partial blocks, FUA and write-back modes are answered at once.
#[test]
fn writes_the_queue_does_not_take_are_answered_at_once() {
    for mode in CacheMode::ALL {
        let (backing, engine) = latched_engine(mode);
        let mut lane = engine.lane().expect("lane");
        backing.hold(true);
        let queued = !mode.writes_back();
        let whole = lane.write_start(0, &pattern(5, 0, B), false);
        assert_eq!(matches!(whole, WriteStart::Pending(_)), queued, "{mode:?}: whole block");
        for (offset, len, fua) in
            [(B, B, true), (2 * B + B / 2, B / 2, false), (3 * B, 2 * B, false)]
        {
            let data = pattern(6, offset, len);
            let WriteStart::Done(result) = lane.write_start(offset, &data, fua) else {
                panic!("{mode:?}: a write at {offset}+{len} fua {fua} went into the queue");
            };
            result.expect("the write");
        }
        backing.hold(false);
        assert_eq!(completed(&mut lane, 1).len(), usize::from(queued), "{mode:?}");
    }
}

/// A second write of a block waits for the first in flight, from the same lane (which
/// reaps its own, keeping the answer) and from another lane (which waits until the first's
/// lane completes it): the block ends as the second write, in the cache and on the store.
#[test]
fn a_write_of_a_block_in_flight_lands_after_it() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (backing, engine) = latched_engine(mode);
        let mut lane = engine.lane().expect("lane");
        backing.hold(true);
        let WriteStart::Pending(first) = lane.write_start(0, &pattern(7, 0, B), false) else {
            panic!("{mode:?}: in flight");
        };
        let second = pattern(8, 0, B);
        let opener = {
            let backing = backing.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                backing.hold(false);
            })
        };
        // The same lane: its own write is reaped first (its answer kept).
        lane.write(0, &second, false).expect("the second write");
        opener.join().expect("opener");
        assert_eq!(completed(&mut lane, 0), vec![first], "{mode:?}: the first's answer kept");
        assert_eq!(stored(&backing, 0), second, "{mode:?}: the second write landed last");

        // Another lane: it waits until this lane completes its write.
        backing.hold(true);
        let WriteStart::Pending(third) = lane.write_start(0, &pattern(9, 0, B), false) else {
            panic!("{mode:?}: in flight");
        };
        let fourth = pattern(10, 0, B);
        std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                let mut other = engine.lane().expect("lane");
                other.write(0, &fourth, false).expect("the other lane's write");
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!other.is_finished(), "{mode:?}: the other lane did not wait");
            backing.hold(false);
            assert_eq!(completed(&mut lane, 1), vec![third]);
            other.join().expect("the other lane");
        });
        assert_eq!(stored(&backing, 0), fourth, "{mode:?}: the other lane's write landed last");
        let mut after = vec![0u8; BLOCK];
        lane.read(0, &mut after).expect("read");
        assert_eq!(after, fourth, "{mode:?}: the block reads as the last write");
    }
}

/// A write batch in write-through mode starts every write, then waits: its writes of one
/// block take effect in batch order, and every outcome is its own.
#[test]
fn a_write_batch_through_keeps_batch_order_per_block() {
    let (backing, engine) = latched_engine(CacheMode::WriteThrough);
    let mut lane = engine.lane().expect("lane");
    let datas: Vec<Vec<u8>> = (0..6).map(|i| pattern(20 + i, 0, B)).collect();
    let offsets = [0, B, 0, 2 * B, B, 0];
    let writes: Vec<WriteRequest<'_>> = offsets
        .iter()
        .zip(&datas)
        .map(|(&offset, data)| WriteRequest { offset, data, fua: false })
        .collect();
    let mut outcomes = Vec::new();
    lane.write_batch(&writes, &mut outcomes);
    assert_eq!(outcomes.len(), 6);
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(lane.pending(), 0);
    for (lba, last) in [(0, 5), (1, 4), (2, 3)] {
        assert_eq!(stored(&backing, lba), datas[last], "block {lba} on the store");
        let mut after = vec![0u8; BLOCK];
        lane.read(lba * B, &mut after).expect("read");
        assert_eq!(after, datas[last], "block {lba} read back");
    }
}

/// Two lanes, each with a write in flight, each writing the block the other has in flight:
/// neither waits for the other (a lane waiting for another's write reaps its own meanwhile).
#[test]
fn two_lanes_writing_each_others_blocks_in_flight_do_not_wait_for_each_other() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (backing, engine) = latched_engine(mode);
        backing.hold(true);
        let barrier = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            let lane_writes = |mine: u64, theirs: u64| {
                let (engine, barrier) = (&engine, &barrier);
                scope.spawn(move || {
                    let mut lane = engine.lane().expect("lane");
                    let started = lane.write_start(mine * B, &pattern(30 + mine, 0, B), false);
                    assert!(matches!(started, WriteStart::Pending(_)), "{mode:?}: in flight");
                    barrier.wait();
                    lane.write(theirs * B, &pattern(40 + theirs, 0, B), false).expect("write");
                    completed(&mut lane, 1).len()
                })
            };
            let (a, b) = (lane_writes(0, 1), lane_writes(1, 0));
            std::thread::sleep(Duration::from_millis(50));
            backing.hold(false);
            assert_eq!(a.join().expect("lane a"), 1, "{mode:?}: lane a's write answered");
            assert_eq!(b.join().expect("lane b"), 1, "{mode:?}: lane b's write answered");
        });
        for lba in [0, 1] {
            assert_eq!(stored(&backing, lba), pattern(40 + lba, 0, B), "{mode:?}: block {lba}");
        }
    }
}

/// A read of several blocks beside a write-through or write-around in flight on another lane,
/// on a store whose writes land only when they complete: the read goes to the store (the old
/// data, the two overlap) but admits nothing, so once the write is answered every read of the
/// block returns the new data — and so does the durable cache after a restart.
#[test]
fn a_multi_block_read_beside_a_write_in_flight_that_lands_late_caches_no_stale_copy() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (backing, engine) = latched_engine(mode);
        backing.land_late(true);
        let mut writer = engine.lane().expect("writer lane");
        let mut reader = engine.lane().expect("reader lane");
        let old = pattern(1, 0, 2 * B);
        backing.hold(true);
        let new = pattern(7, 0, B);
        let WriteStart::Pending(ticket) = writer.write_start(0, &new, false) else {
            panic!("{mode:?}: a whole-block write must be in flight");
        };
        assert_eq!(stored(&backing, 0), old[..BLOCK], "{mode:?}: the write landed at submit");
        let mut both = vec![0u8; 2 * BLOCK];
        reader.read(0, &mut both).expect("the read beside the write");
        assert_eq!(both, old, "{mode:?}: the store still held the old data");
        backing.hold(false);
        assert_eq!(completed(&mut writer, 1), vec![ticket]);
        assert_eq!(stored(&backing, 0), new, "{mode:?}: the write landed");
        for lane in [&mut reader, &mut writer] {
            let mut again = vec![0u8; 2 * BLOCK];
            lane.read(0, &mut again).expect("read again");
            assert_eq!(again[..BLOCK], new[..], "{mode:?}: a stale copy of block 0 was cached");
            let mut one = vec![0u8; BLOCK];
            lane.read(0, &mut one).expect("read block 0 alone");
            assert_eq!(one, new, "{mode:?}");
        }
    }
}

/// A partial write made in write-back mode while a write-through of its block is still in
/// flight (the mode switched between the two) merges with the data of that write, not with
/// what the store held before it: it waits for the write in flight.
#[test]
fn a_partial_write_back_after_a_switch_merges_with_the_write_through_in_flight() {
    let (backing, engine) = latched_engine(CacheMode::WriteThrough);
    backing.land_late(true);
    let mut through = engine.lane().expect("write-through lane");
    let new = pattern(8, 0, B);
    backing.hold(true);
    let WriteStart::Pending(ticket) = through.write_start(0, &new, false) else {
        panic!("a whole-block write-through must be in flight");
    };
    engine.set_mode(CacheMode::WriteBack);
    let patch = vec![0xeeu8; BLOCK / 4];
    std::thread::scope(|scope| {
        let partial = scope.spawn(|| {
            let mut lane = engine.lane().expect("write-back lane");
            lane.write(B / 4, &patch, false).expect("the partial write");
        });
        // The partial write waits for the write in flight; it lands once let through.
        std::thread::sleep(Duration::from_millis(20));
        backing.hold(false);
        assert_eq!(completed(&mut through, 1), vec![ticket]);
        partial.join().expect("the partial write's thread");
    });
    let mut expected = new.clone();
    expected[BLOCK / 4..BLOCK / 2].copy_from_slice(&patch);
    let mut read = vec![0u8; BLOCK];
    through.read(0, &mut read).expect("read");
    assert_eq!(read, expected, "the partial write merged with the old data");
}

/// A drain beside a write-through in flight on the stripe of a dirty block (dirty from before
/// a switch out of write-back) waits for that write, then writes the block back: it never
/// answers success while a block dirty at its start is still dirty.
#[test]
fn a_drain_waits_for_a_write_in_flight_on_a_dirty_blocks_stripe_and_cleans_it() {
    let (backing, engine) = wide_latched_engine();
    let (first, neighbour) = two_blocks_of_one_stripe(&engine);
    let mut writer = engine.lane().expect("writer lane");
    let dirty = pattern(9, first * B, B);
    writer.write(first * B, &dirty, false).expect("a dirty block");
    engine.set_mode(CacheMode::WriteThrough);
    backing.hold(true);
    let WriteStart::Pending(ticket) = writer.write_start(neighbour * B, &pattern(10, 0, B), false)
    else {
        panic!("a whole-block write-through must be in flight");
    };
    std::thread::scope(|scope| {
        let drain = scope.spawn(|| {
            let mut lane = engine.lane().expect("drain lane");
            lane.drain()
        });
        std::thread::sleep(Duration::from_millis(30));
        backing.hold(false);
        assert_eq!(completed(&mut writer, 1), vec![ticket]);
        drain.join().expect("the drain's thread").expect("the drain");
    });
    assert_eq!(engine.stats().dirty_slots, 0, "the drain answered with a block dirty");
    assert_eq!(stored(&backing, first), dirty, "the dirty block is on the backing store");
}

/// A latched engine in write-back over a device of 4096 blocks (where two blocks share a
/// stripe), its cache the model's 20 slots.
fn wide_latched_engine() -> (Arc<LatchedBacking>, pmcache_engine::testing::latched::LatchedEngine) {
    let blocks = 4096u64;
    let world = pmcache_engine::testing::model::World::fresh(3);
    let device = pmcache_engine::testing::SimBacking::new(blocks * B, world.switch.clone(), 3);
    let backing = LatchedBacking::new(device);
    let cfg = pmcache_engine::Config {
        max_lanes: 4,
        ..pmcache_engine::testing::model::config(
            CacheMode::WriteBack,
            pmcache_engine::EvictionKind::Clock,
            pmcache_engine::AdmissionConfig::Always,
        )
    };
    let engine = pmcache_engine::Engine::format(
        world.medium.clone(),
        backing.clone(),
        Arc::new(ManualClock::default()),
        &cfg,
    )
    .expect("format");
    (backing, engine)
}

/// Two blocks of one stripe.
fn two_blocks_of_one_stripe(
    engine: &pmcache_engine::testing::latched::LatchedEngine,
) -> (u64, u64) {
    let stripe_of = |lba| pmcache_engine::testing::stripe_of(engine, lba);
    let blocks = engine.size_bytes() / B;
    (0..blocks)
        .flat_map(|a| (a + 1..blocks).map(move |b| (a, b)))
        .find(|&(a, b)| stripe_of(a) == stripe_of(b))
        .expect("two blocks of one stripe")
}

/// A drain asked of the running cleaner (the control socket's `flush`) while the only dirty
/// block's stripe has a write-through in flight that does not complete: after a second of
/// finding nothing it can clean, it answers `DrainBusy`, never success; once the write
/// completes, the next drain writes the block back.
#[test]
fn a_requested_drain_answers_busy_while_a_dirty_blocks_stripe_stays_busy() {
    let (backing, engine) = wide_latched_engine();
    let (first, neighbour) = two_blocks_of_one_stripe(&engine);
    let mut writer = engine.lane().expect("writer lane");
    writer.write(first * B, &pattern(11, first * B, B), false).expect("a dirty block");
    engine.set_mode(CacheMode::WriteThrough);
    backing.hold(true);
    let WriteStart::Pending(ticket) = writer.write_start(neighbour * B, &pattern(12, 0, B), false)
    else {
        panic!("a whole-block write-through must be in flight");
    };
    let config = pmcache_engine::CleanerConfig {
        target_pct: 99,
        high_pct: 100,
        low_pct: 99,
        idle_target_pct: 99,
        idle_ms: 3_600_000,
        ..pmcache_engine::CleanerConfig::default()
    };
    let mut cleaner = engine.cleaner(config).expect("cleaner");
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        let ask = || loop {
            if let Some(asked) = engine.request_drain() {
                break asked;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let answer = |asked| loop {
            if let Some(outcome) = engine.drain_outcome(asked, Duration::from_millis(100)) {
                break outcome;
            }
        };
        let busy = answer(ask());
        backing.hold(false);
        assert_eq!(completed(&mut writer, 1), vec![ticket]);
        let drained = answer(ask());
        engine.stop_cleaner();
        running.join().expect("the cleaner");
        let err = busy.expect_err("a drain answered success with the block dirty");
        assert!(matches!(err, pmcache_engine::Error::DrainBusy { dirty: 1, .. }), "{err}");
        drained.expect("the drain once the write completed");
    });
    assert_eq!(engine.stats().dirty_slots, 0);
    assert_eq!(stored(&backing, first), pattern(11, first * B, B));
}
