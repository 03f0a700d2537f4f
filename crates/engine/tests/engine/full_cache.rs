//! A cache whose every slot is dirty, in front of a backing store that fails the write-backs
//! that would free one: the modes that write through keep serving. A write-through writes the
//! backing store and leaves the block uncached; one over a dirty copy drops that copy only once
//! the new data is durable; one the backing store fails changes nothing. A power cut afterwards
//! brings back every acknowledged write, and no dropped copy.

use std::sync::Arc;

use pmcache_engine::testing::{SimBacking, model};
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, Error, EvictionKind, Lane, ManualClock,
};
use pmcache_media::{CrashMedium, CrashSwitch};

const BLOCK: usize = model::BLOCK;
const BLOCK_BYTES: u64 = BLOCK as u64;
/// 4 KiB superblock + 4 KiB metadata + 128 slots.
const MEDIUM_BYTES: u64 = 8192 + 128 * BLOCK_BYTES;
const BACKING_BLOCKS: u64 = 512;

type SimEngine = pmcache_engine::Engine<CrashMedium, SimBacking, Arc<ManualClock>>;
type SimLane<'e> = Lane<'e, CrashMedium, SimBacking, Arc<ManualClock>>;

fn config(mode: CacheMode) -> Config {
    Config { max_lanes: 1, ..model::config(mode, EvictionKind::Clock, AdmissionConfig::Always) }
}

fn block_of(byte: u8) -> Vec<u8> {
    vec![byte; BLOCK]
}

fn read_block(lane: &mut SimLane<'_>, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    lane.read(lba * BLOCK_BYTES, &mut buf).expect("read");
    buf
}

fn backing_block(engine: &SimEngine, lba: u64) -> Vec<u8> {
    let at = (lba * BLOCK_BYTES) as usize;
    engine.backing().contents()[at..at + BLOCK].to_vec()
}

/// Each seed keeps a different random half of the backing store's unflushed writes at the cut.
#[test]
fn write_through_serves_a_cache_of_dirty_slots_whose_write_backs_fail() {
    for seed in 0..16 {
        write_through_beside_failing_write_backs(seed);
    }
}

fn write_through_beside_failing_write_backs(seed: u64) {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(MEDIUM_BYTES, switch.clone(), seed);
    let backing = SimBacking::new(BACKING_BLOCKS * BLOCK_BYTES, switch.clone(), seed ^ 0xabc);
    let clock = Arc::new(ManualClock::default());
    let engine = Engine::format(
        medium.clone(),
        backing.clone(),
        clock.clone(),
        &config(CacheMode::WriteBack),
    )
    .expect("format");
    let slots = engine.stats().slot_count;
    assert!(slots > 32 && slots < BACKING_BLOCKS / 2, "{slots} slots");
    let mut lane = engine.lane().expect("lane");
    // Every slot dirty, block `lba` holding `lba + 1`. The newest block, `last`, is the only
    // one whose write-back would succeed: a reclaim writes back the oldest first, and fails.
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &block_of((lba as u8).wrapping_add(1)), false).expect("fill");
    }
    assert_eq!(engine.stats().dirty_slots, slots);
    let last = slots - 1;
    engine.backing().fail_writes_in(0..last * BLOCK_BYTES);
    engine.set_mode(CacheMode::WriteThrough);

    // A new block, written whole and in part: both reach the backing store, neither is cached.
    let new = slots + 10;
    lane.write(new * BLOCK_BYTES, &block_of(0xa1), false).expect("write-through of a new block");
    let partial = slots + 20;
    lane.write(partial * BLOCK_BYTES + 100, &[0xb2; 50], false).expect("partial write-through");
    let mut partial_data = block_of(0);
    partial_data[100..150].fill(0xb2);
    assert_eq!(backing_block(&engine, new), block_of(0xa1));
    assert_eq!(backing_block(&engine, partial), partial_data);
    let before = engine.stats();
    assert_eq!(read_block(&mut lane, new), block_of(0xa1));
    assert_eq!(read_block(&mut lane, partial), partial_data);
    let after = engine.stats();
    assert_eq!(after.read_hits, before.read_hits, "a block without a slot was cached");
    assert_eq!(after.read_misses_bypassed - before.read_misses_bypassed, 2);
    assert_eq!(after.dirty_slots, slots);

    // A write-through the backing store fails: the error, and the dirty copy as it was.
    let err = lane.write(3 * BLOCK_BYTES, &block_of(0xc3), false).expect_err("a failing write");
    assert!(matches!(err, Error::Backing(_)), "{err:?}");
    assert_eq!(read_block(&mut lane, 3), block_of(4));
    assert_eq!(engine.stats().dirty_slots, slots);
    lane.flush().expect("flush");

    // A write-through over the one dirty block whose write succeeds drops its dirty copy, and
    // its slot is free again for the next write-through, which caches its block.
    lane.write(last * BLOCK_BYTES, &block_of(0xd4), false).expect("write-through over dirty");
    assert_eq!(engine.stats().dirty_slots, slots - 1);
    assert_eq!(read_block(&mut lane, last), block_of(0xd4));
    assert_eq!(backing_block(&engine, last), block_of(0xd4));
    let cached = slots + 30;
    lane.write(cached * BLOCK_BYTES, &block_of(0xe5), false).expect("write-through, cached");
    let hits = engine.stats().read_hits;
    assert_eq!(read_block(&mut lane, cached), block_of(0xe5));
    assert_eq!(engine.stats().read_hits, hits + 1, "the freed slot was not used");

    // Power is cut without a flush: the write-through over the dirty block was synced before
    // its dirty copy went, so recovery must not bring the old copy back.
    switch.cut_now();
    drop(lane);
    drop(engine);
    let switch = CrashSwitch::new();
    let medium = CrashMedium::from_image(medium.crash_image().expect("cut"), switch.clone(), seed);
    let backing = SimBacking::from_image(backing.crash_image().expect("cut"), switch.clone(), seed);
    let (engine, report) =
        Engine::open(medium, backing, clock, &config(CacheMode::WriteThrough)).expect("open");
    // The dirty blocks left, plus the write-through cached after the last flush: its clean
    // copy is newer than the synced sequence number, so recovery cannot know the backing store
    // kept that write, and makes it dirty.
    assert_eq!((report.dirty, report.clean_made_dirty), (slots, 1), "{report:?}");
    let mut lane = engine.lane().expect("lane");
    assert_eq!(
        read_block(&mut lane, last),
        block_of(0xd4),
        "seed {seed}: the dropped dirty copy came back"
    );
    assert_eq!(read_block(&mut lane, new), block_of(0xa1));
    assert_eq!(read_block(&mut lane, partial), partial_data);
    assert_eq!(read_block(&mut lane, cached), block_of(0xe5));
    for lba in 0..last {
        assert_eq!(
            read_block(&mut lane, lba),
            block_of((lba as u8).wrapping_add(1)),
            "dirty block {lba}"
        );
    }
    lane.drain().expect("drain");
    for lba in 0..last {
        assert_eq!(
            backing_block(&engine, lba),
            block_of((lba as u8).wrapping_add(1)),
            "written back {lba}"
        );
    }
}

/// Write-back, every slot dirty, and the backing store refusing one block, the oldest: new
/// writes and overwrites still succeed (a reclaim writes back the other blocks), the refused
/// block keeps its data in the cache, a drain writes back everything else and then reports
/// the failure, and once the backing store takes the block again a drain finishes. A reclaim
/// that gave up at the refused block would fail every write needing a slot.
#[test]
fn one_block_the_backing_store_refuses_does_not_stop_a_full_write_back_cache() {
    let (engine, _medium, _backing) = fresh(CacheMode::WriteBack, 7);
    let slots = engine.stats().slot_count;
    let mut lane = engine.lane().expect("lane");
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &block_of((lba as u8).wrapping_add(1)), false).expect("fill");
    }
    assert_eq!(engine.stats().dirty_slots, slots);
    engine.backing().fail_writes_in(0..BLOCK_BYTES);

    for (i, lba) in (slots..slots + 40).enumerate() {
        lane.write(lba * BLOCK_BYTES, &block_of(0x80u8.wrapping_add(i as u8)), false)
            .unwrap_or_else(|e| panic!("new block {lba} in a full cache: {e}"));
    }
    lane.write(BLOCK_BYTES, &block_of(0xf1), false).expect("an overwrite");
    assert!(engine.stats().writebacks > 0);
    assert_eq!(read_block(&mut lane, 0), block_of(1), "the refused block's data");
    assert_eq!(read_block(&mut lane, 1), block_of(0xf1));
    for (i, lba) in (slots..slots + 40).enumerate() {
        assert_eq!(
            read_block(&mut lane, lba),
            block_of(0x80u8.wrapping_add(i as u8)),
            "block {lba}"
        );
    }

    let err = lane.drain().expect_err("a drain with a block the backing store refuses");
    assert!(matches!(err, Error::Backing(_)), "{err:?}");
    assert_eq!(engine.stats().dirty_slots, 1, "everything else was written back");
    assert!(engine.stats().backing_errors >= 2, "{:?}", engine.stats());
    assert_eq!(backing_block(&engine, 0), block_of(0));
    assert_eq!(backing_block(&engine, 1), block_of(0xf1));
    assert_eq!(backing_block(&engine, slots + 39), block_of(0x80 + 39));

    engine.backing().heal();
    lane.drain().expect("drain once the backing store takes the block");
    assert_eq!(engine.stats().dirty_slots, 0);
    assert_eq!(backing_block(&engine, 0), block_of(1));
}

/// A full write-back cache whose oldest dirty blocks the backing store refuses (a bad range of
/// the device, written first): more than a reclaim lets fail before it gives up, and (in the
/// larger cache) more than a reclaim's 256 candidates. The first writes needing a slot may
/// fail, each after 8 refusals; refused blocks are then left out of the candidates while
/// others exist, so every later write succeeds and no refused block is tried again while
/// other dirty blocks remain. Were every reclaim to try the oldest (refused) blocks first,
/// every write needing a slot would fail (`crash.rs`'s runs with backing faults reach this
/// too); and with refused blocks among the candidates, a run of 256 of them would fill the
/// list.
#[test]
fn a_run_of_refused_blocks_is_passed_over_not_retried_by_every_write() {
    for (slots, refused) in [(128u64, 48u64), (1024, 600)] {
        refused_run(slots, refused);
    }
}

/// A reclaim whose write-backs meet a refused block and a failed sync stops at that batch:
/// after a failed sync nothing can be cleaned until the cache is attached again, so writing
/// back more batches (each with a refusal, so not stopped by the refusal rule) would only be
/// backing-store writes for nothing, on every write needing a slot.
#[test]
fn a_reclaim_stops_at_a_failed_sync_even_beside_refusals() {
    let (engine, _medium, backing) = fresh(CacheMode::WriteBack, 14);
    let slots = engine.stats().slot_count;
    let mut lane = engine.lane().expect("lane");
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &block_of(lba as u8), false).expect("fill");
    }
    // One refused block in every 16, and every sync failing.
    backing.fail_writes_in_each(
        (0..slots).step_by(16).map(|lba| lba * BLOCK_BYTES..(lba + 1) * BLOCK_BYTES).collect(),
    );
    backing.fail_flushes(true);
    let (writes_before, _) = backing.io_counts();
    lane.write(slots * BLOCK_BYTES, &block_of(0xee), false).expect_err("no slot can be cleaned");
    let (writes_after, _) = backing.io_counts();
    let tried = writes_after - writes_before;
    assert!(tried <= 64, "{tried} backing writes for one write after a failed sync");
    assert_eq!(engine.stats().dirty_slots, slots);
}

fn refused_run(slots: u64, refused: u64) {
    let (engine, _medium, backing) = fresh_sized(CacheMode::WriteBack, 9, slots, 4 * slots);
    let slots = engine.stats().slot_count;
    let mut lane = engine.lane().expect("lane");
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &block_of((lba as u8).wrapping_add(1)), false).expect("fill");
    }
    backing.fail_writes_in(0..refused * BLOCK_BYTES);
    let writes = refused / 8 + 40;
    let mut failed = Vec::new();
    for (i, lba) in (slots..slots + writes).enumerate() {
        if lane.write(lba * BLOCK_BYTES, &block_of(0x80u8.wrapping_add(i as u8)), false).is_err() {
            failed.push(i);
        }
    }
    let label = format!("{slots} slots, oldest {refused} refused");
    assert!(failed.len() as u64 <= refused / 8, "{label}: writes {failed:?} failed");
    assert!(failed.iter().all(|&i| i < failed.len()), "{label}: a later write failed: {failed:?}");
    let refusals = engine.stats().backing_errors;
    assert!(refusals <= refused, "{label}: {refusals} refused write-backs: some block tried twice");
    for (i, lba) in (slots..slots + writes).enumerate() {
        if !failed.contains(&i) {
            assert_eq!(
                read_block(&mut lane, lba),
                block_of(0x80u8.wrapping_add(i as u8)),
                "{label}: {lba}"
            );
        }
    }
    for lba in 0..refused {
        assert_eq!(
            read_block(&mut lane, lba),
            block_of((lba as u8).wrapping_add(1)),
            "{label}: refused {lba}"
        );
    }
    backing.heal();
    lane.drain().expect("drain once the backing store takes the blocks");
    assert_eq!(backing_block(&engine, 0), block_of(1));
    assert_eq!(backing_block(&engine, refused - 1), block_of(refused as u8));
}

fn fresh(mode: CacheMode, seed: u64) -> (SimEngine, CrashMedium, SimBacking) {
    fresh_sized(mode, seed, (MEDIUM_BYTES - 8192) / BLOCK_BYTES, BACKING_BLOCKS)
}

/// `fresh` with a medium of `slots` slots (plus superblock and metadata) and a backing
/// store of `backing_blocks` blocks.
fn fresh_sized(
    mode: CacheMode,
    seed: u64,
    slots: u64,
    backing_blocks: u64,
) -> (SimEngine, CrashMedium, SimBacking) {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(8192 + slots * BLOCK_BYTES, switch.clone(), seed);
    let backing = SimBacking::new(backing_blocks * BLOCK_BYTES, switch, seed ^ 0x55);
    let engine = Engine::format(
        medium.clone(),
        backing.clone(),
        Arc::new(ManualClock::default()),
        &config(mode),
    )
    .expect("format");
    (engine, medium, backing)
}

/// The cache on `medium` attached again (recovered) with `mode`.
fn reattach(
    medium: CrashMedium,
    backing: &SimBacking,
    mode: CacheMode,
) -> (SimEngine, pmcache_engine::RecoveryReport) {
    Engine::open(medium, backing.clone(), Arc::new(ManualClock::default()), &config(mode))
        .expect("attach again")
}

/// A write-through the backing store fails still counts as a write a flush must sync: it
/// may have changed part of its range before failing (a short write, then an error), and a
/// read can then admit that range as a clean block. (Were only writes that succeeded
/// counted, this flush would skip the `fdatasync`.)
#[test]
fn a_failed_write_is_still_synced_by_the_next_flush() {
    let (engine, _medium, backing) = fresh(CacheMode::WriteThrough, 11);
    let mut lane = engine.lane().expect("lane");
    lane.flush().expect("flush");
    let before = backing.flushes();
    backing.fail_writes_in(5 * BLOCK_BYTES..6 * BLOCK_BYTES);
    lane.write(5 * BLOCK_BYTES, &block_of(3), false).expect_err("a failing write");
    backing.heal();
    lane.flush().expect("flush");
    assert_eq!(backing.flushes(), before + 1, "the flush did not sync the backing store");
    assert_eq!(engine.stats().backing_errors, 1);
}

/// A store whose completed writes survive a failed flush (an RBD image: each write
/// acknowledged by its OSDs; the flush failed because they were out of reach) is trusted again
/// by the next flush that succeeds, without a new attach; the backing store's health reads
/// failing meanwhile and ok again after.
#[test]
fn a_failed_sync_of_a_store_that_loses_nothing_is_simply_tried_again() {
    let (engine, _medium, backing) = fresh(CacheMode::WriteThrough, 13);
    backing.set_failed_flush_loses_writes(false);
    let mut lane = engine.lane().expect("lane");
    lane.write(2 * BLOCK_BYTES, &block_of(4), false).expect("write-through");
    backing.fail_flushes(true);
    let err = lane.flush().expect_err("a failing flush");
    assert!(matches!(err, Error::Backing(_)), "{err:?}");
    let health = engine.stats().backing;
    assert_eq!(health.state, pmcache_engine::BackingState::Failing, "{health:?}");
    assert!(health.last_error.is_some_and(|e| e.contains("flush")));
    backing.heal();
    lane.write(3 * BLOCK_BYTES, &block_of(5), false).expect("write-through");
    lane.flush().expect("the next flush is trusted");
    assert_eq!(engine.stats().backing, pmcache_engine::BackingHealth::default());
    let durable = backing.durable_contents();
    let block =
        |lba: u64| &durable[(lba * BLOCK_BYTES) as usize..((lba + 1) * BLOCK_BYTES) as usize];
    assert_eq!(block(2), &block_of(4)[..]);
    assert_eq!(block(3), &block_of(5)[..]);
}

/// After an `fdatasync` of the backing store fails, no later one is trusted until the cache
/// is attached again (Linux reports a write-back error once, then drops the pages): flushes
/// fail, naming the cause, and the synced sequence number stays, so recovery makes the clean
/// blocks written since dirty and writes them back again.
#[test]
fn after_a_failed_sync_no_later_sync_is_trusted_until_the_cache_is_attached_again() {
    let (engine, medium, backing) = fresh(CacheMode::WriteThrough, 12);
    let mut lane = engine.lane().expect("lane");
    lane.write(2 * BLOCK_BYTES, &block_of(4), false).expect("write-through, cached clean");
    backing.fail_flushes(true);
    let err = lane.flush().expect_err("a failing flush");
    assert!(matches!(err, Error::Backing(_)), "{err:?}");
    backing.heal();
    lane.write(3 * BLOCK_BYTES, &block_of(5), false).expect("write-through");
    let err = lane.flush().expect_err("a flush after a failed one");
    assert!(matches!(err, Error::BackingSyncFailedBefore), "{err:?}");
    assert_eq!(err.errno(), libc::EIO);
    drop(lane);
    drop(engine);
    let (engine, report) = reattach(medium, &backing, CacheMode::WriteThrough);
    assert_eq!(report.clean_made_dirty, 2, "{report:?}");
    let mut lane = engine.lane().expect("lane");
    lane.drain().expect("drain on a healthy backing store");
    assert_eq!(backing_block(&engine, 2), block_of(4));
    assert_eq!(backing_block(&engine, 3), block_of(5));
}

/// A drain on a backing store that fails every write stops after a few batches that wrote
/// nothing back, each stopping after a few failures in a row, instead of trying every dirty
/// block (a dead device's timeouts would add up to minutes); what it could not write back
/// stays dirty.
#[test]
fn a_drain_on_a_dead_backing_store_gives_up_early() {
    let (engine, _medium, backing) = fresh(CacheMode::WriteBack, 13);
    let mut lane = engine.lane().expect("lane");
    let slots = engine.stats().slot_count;
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &block_of(lba as u8), false).expect("fill");
    }
    backing.fail_writes_from(0);
    let (writes_before, _) = backing.io_counts();
    lane.drain().expect_err("a drain with every write failing");
    let (writes_after, _) = backing.io_counts();
    assert!(writes_after - writes_before <= 2 * 8, "{} writes tried", writes_after - writes_before);
    assert_eq!(engine.stats().dirty_slots, slots);
    backing.heal();
    lane.drain().expect("drain once the backing store works");
    assert_eq!(engine.stats().dirty_slots, 0);
}

mod faults {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Write {
            lba: u64,
            value: u8,
        },
        Read {
            lba: u64,
        },
        Flush,
        Drain,
        /// The backing store refuses writes to blocks `first..first + len`.
        FailWrites {
            first: u64,
            len: u64,
        },
        FailFlushes,
        Heal,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few enough blocks that the 128-slot cache fills and reclaims often.
        let lba = 0..200u64;
        prop_oneof![
            8 => (lba.clone(), any::<u8>()).prop_map(|(lba, value)| Op::Write { lba, value }),
            3 => lba.prop_map(|lba| Op::Read { lba }),
            1 => Just(Op::Flush),
            1 => Just(Op::Drain),
            1 => (0..200u64, 1..40u64).prop_map(|(first, len)| Op::FailWrites { first, len }),
            1 => Just(Op::FailFlushes),
            1 => Just(Op::Heal),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: pmcache_engine::testing::proptest_cases(64),
            ..ProptestConfig::default()
        })]

        /// Write-back with a backing store that refuses writes to some blocks and fails
        /// flushes at random: a write either succeeds or fails with the backing store's error
        /// and changes nothing; every read returns the last acknowledged value; drains and
        /// flushes fail only with backing errors; and once the store is healed and the cache
        /// attached again, a drain leaves the backing store holding exactly the acknowledged
        /// values.
        #[test]
        fn write_back_over_a_failing_backing_store_loses_nothing(
            ops in prop::collection::vec(op(), 1..300),
            seed in any::<u64>(),
        ) {
            let (engine, medium, backing) = fresh(CacheMode::WriteBack, seed);
            let mut model = [0u8; 200];
            {
                let mut lane = engine.lane().expect("lane");
                for op in &ops {
                    match *op {
                        Op::Write { lba, value } => {
                            match lane.write(lba * BLOCK_BYTES, &block_of(value), false) {
                                Ok(()) => model[lba as usize] = value,
                                Err(Error::Backing(_) | Error::BackingSyncFailedBefore) => {}
                                Err(e) => prop_assert!(false, "write {lba}: {e}"),
                            }
                        }
                        Op::Read { lba } => {
                            prop_assert_eq!(
                                read_block(&mut lane, lba),
                                block_of(model[lba as usize]),
                                "block {}", lba
                            );
                        }
                        Op::Flush | Op::Drain => {
                            let done =
                                if matches!(op, Op::Flush) { lane.flush() } else { lane.drain() };
                            if let Err(e) = done {
                                prop_assert!(
                                    matches!(e, Error::Backing(_) | Error::BackingSyncFailedBefore),
                                    "{:?}: {}", op, e
                                );
                            }
                        }
                        Op::FailWrites { first, len } => backing
                            .fail_writes_in(first * BLOCK_BYTES..(first + len) * BLOCK_BYTES),
                        Op::FailFlushes => backing.fail_flushes(true),
                        Op::Heal => backing.heal(),
                    }
                }
            }
            backing.heal();
            drop(engine);
            let (engine, _) = reattach(medium, &backing, CacheMode::WriteBack);
            let mut lane = engine.lane().expect("lane");
            lane.drain().expect("drain on a healed backing store");
            for (lba, &value) in model.iter().enumerate() {
                prop_assert_eq!(backing_block(&engine, lba as u64), block_of(value), "block {}", lba);
                prop_assert_eq!(read_block(&mut lane, lba as u64), block_of(value));
            }
        }
    }
}
