//! The background cleaner on simulated parts: power cuts inside its batches, overwrites during
//! its write-backs, writers stalling on it, a failing and a hung backing store, idle decay.
#![cfg(not(feature = "shuttle"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pmcache_engine::testing::hooked::HookedBacking;
use pmcache_engine::testing::model::{
    BLOCK, BLOCKS, CrashRun, Op, World, config, pattern, run_crash_case,
};
use pmcache_engine::{
    Adaptive, AdmissionConfig, BackingHealth, BackingOp, BackingState, CacheMode, CleanerConfig,
    Engine, Error, EvictionKind, ManualClock, WriteBackOrder,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Settings that keep the cleaner busy on the model's 20-slot cache: always "idle", cleaning
/// down to nothing, in small batches of short merged runs.
fn eager(order: WriteBackOrder) -> CleanerConfig {
    CleanerConfig {
        order,
        target_pct: 0,
        idle_target_pct: 0,
        low_pct: 10,
        high_pct: 30,
        idle_ms: 0,
        queue_depth: 2,
        batch_blocks: 4,
        merge_blocks: 2,
        ..CleanerConfig::default()
    }
}

/// Random power cuts while a cleaner runs beside a workload that overflows the cache: cuts
/// land inside its batches (between its writes, its sync and its clean marks), writers stall
/// on it, and it writes back blocks the workload overwrites, trims and zeroes (half the runs
/// zero 2 whole blocks or more on the backing store, the path of a large write-zeroes; half
/// the runs' backing store has a queue, the cleaner's pipelined path). Pairs of operations run
/// at once on the two lanes, in half the runs also on the same blocks, where the model takes
/// each block from whichever order the engine shows. The model checks every read and every
/// recovery; the final drain checks the backing store. The cleaner must have cleaned blocks.
#[test]
fn power_cuts_with_the_cleaner_running_lose_nothing() {
    let mut rng = SmallRng::seed_from_u64(0xc1ea_0001);
    let mut cuts = 0u64;
    let mut cleaned = 0u64;
    let mut runs = 0u64;
    let (mut with_zeroes, mut with_zero_through, mut with_trims) = (0u64, 0u64, 0u64);
    let (mut overlapping, mut queued, mut beside_switches) = (0u64, 0u64, 0u64);
    while cuts < 1500 {
        let mode = [CacheMode::WriteBack, CacheMode::WriteOnly, CacheMode::WriteThrough]
            [rng.gen_range(0..3)];
        let count = rng.gen_range(30..80);
        let ops = random_ops(&mut rng, count);
        let order = if rng.gen_bool(0.5) { WriteBackOrder::Lba } else { WriteBackOrder::Oldest };
        let run = CrashRun {
            mode,
            cut_at_point: Some(rng.gen_range(1..400)),
            cut_during_recovery_at: rng.gen_bool(0.2).then(|| rng.gen_range(1..5)),
            seed: rng.r#gen(),
            concurrent_pairs: rng.gen_bool(0.7),
            overlapping_pairs: rng.gen_bool(0.5),
            cleaner: Some(eager(order)),
            ..CrashRun::default()
        };
        let outcome = run_crash_case(&ops, &run)
            .unwrap_or_else(|failure| panic!("run {runs} ({run:?}): {failure}\nops: {ops:?}"));
        cuts += outcome.power_cuts;
        cleaned += outcome.cleaner_blocks_cleaned;
        overlapping += outcome.overlapping_pairs;
        beside_switches += outcome.pairs_beside_mode_switches;
        runs += 1;
        let zeroes = ops.iter().any(|op| matches!(op, Op::WriteZeroes { .. }));
        with_zeroes += u64::from(zeroes);
        // The run's seed picks the zero-through threshold (bit 1) and a queue (bit 0).
        with_zero_through += u64::from(zeroes && run.seed & 2 == 2);
        with_trims += u64::from(ops.iter().any(|op| matches!(op, Op::Trim { .. })));
        queued += u64::from(run.seed & 1 == 1);
    }
    eprintln!(
        "{cuts} power cuts over {runs} runs with the cleaner; runs with write-zeroes \
         {with_zeroes} ({with_zero_through} zeroing through), with trims {with_trims}, with a \
         queued backing store {queued}; {overlapping} pairs on the same blocks, \
         {beside_switches} beside a mode switch; the cleaner cleaned {cleaned} blocks"
    );
    assert!(cleaned >= 1000, "the cleaner cleaned only {cleaned} blocks");
    assert!(with_zero_through >= 50 && with_trims >= 50, "too few runs zero or trim");
    assert!(overlapping >= 200, "only {overlapping} pairs on the same blocks");
    assert!(beside_switches >= 50, "only {beside_switches} pairs beside a mode switch");
}

/// Writes, reads of one block and of several, flushes, trims, write-zeroes and mode switches over
/// the whole device (2.4 times the cache).
fn random_ops(rng: &mut SmallRng, count: usize) -> Vec<Op> {
    let block = BLOCK as u64;
    (0..count)
        .map(|_| {
            let lba = rng.gen_range(0..BLOCKS as u64 - 6);
            match rng.gen_range(0..26) {
                0..=10 => Op::Write { offset: lba * block, len: block, fua: rng.gen_bool(0.1) },
                11 => Op::Write { offset: lba * block + 100, len: 300, fua: false },
                12..=16 => Op::Read { offset: lba * block, len: block },
                17 => Op::WriteBatch {
                    writes: (0..rng.gen_range(2..6))
                        .map(|_| (rng.gen_range(0..BLOCKS as u64) * block, block))
                        .collect(),
                    fua: rng.gen_bool(0.2),
                },
                18 => Op::Flush,
                19 => Op::Trim { offset: lba * block, len: block * rng.gen_range(1..4) },
                // Whole blocks (the zero-through path when the run's threshold is 2), or a
                // range with partial blocks at its ends.
                20..=21 => Op::WriteZeroes {
                    offset: lba * block,
                    len: block * rng.gen_range(1..6),
                    fua: rng.gen_bool(0.2),
                },
                22 => Op::WriteZeroes { offset: lba * block + 200, len: block * 3, fua: false },
                // Reads of several blocks, beside writes in flight on the other lane.
                23 => Op::Read { offset: lba * block, len: block * rng.gen_range(2..4) },
                24 => Op::ReadBatch {
                    reads: (0..rng.gen_range(2..5)).map(|i| ((lba + i) * block, block)).collect(),
                },
                _ => Op::SetMode { mode: CacheMode::ALL[rng.gen_range(0..CacheMode::ALL.len())] },
            }
        })
        .collect()
}

type HookedEngine =
    Engine<pmcache_engine::testing::model::SimMedium, Arc<HookedBacking>, Arc<ManualClock>>;

fn hooked_engine(seed: u64, max_lanes: usize) -> (World, Arc<HookedBacking>, HookedEngine) {
    let world = World::fresh(seed);
    let backing = HookedBacking::new(world.backing.clone());
    let cfg = pmcache_engine::Config {
        max_lanes,
        ..config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always)
    };
    let clock = Arc::new(ManualClock::default());
    let engine =
        Engine::format(world.medium.clone(), backing.clone(), clock, &cfg).expect("format");
    (world, backing, engine)
}

/// Opens the gate of a held backing store and stops the cleaner when dropped, however the test's
/// thread ends: a failed assertion fails the test instead of leaving the cleaner waiting at the
/// gate (and the test's scope waiting for the cleaner).
struct Release<'a>(&'a HookedBacking, &'a HookedEngine);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.hold(false);
        self.1.stop_cleaner();
    }
}

/// Waits until the cleaner just spawned takes stalls.
fn wait_running(engine: &HookedEngine) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !engine.stats().cleaner.running {
        assert!(Instant::now() < deadline, "the cleaner did not start");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn block_data(tag: u64) -> Vec<u8> {
    pattern(tag, 0, BLOCK as u64)
}

/// A block overwritten while the cleaner's copy of it is on its way to the backing store stays
/// dirty with the newer data: the cleaner marks clean only the slot it copied, and the
/// overwrite replaced that slot. A later batch writes the newer data back.
#[test]
fn an_overwrite_during_write_back_keeps_the_block_dirty_with_the_newer_data() {
    let (world, backing, engine) = hooked_engine(1, 3);
    let engine = Arc::new(engine);
    let block = BLOCK as u64;
    engine.lane().unwrap().write(3 * block, &block_data(1), false).unwrap();
    let mut cleaner = engine.cleaner(eager(WriteBackOrder::Lba)).unwrap();
    // Inside the cleaner's backing write of block 3 (no stripe held): overwrite the block
    // through a lane of its own.
    let overwrote = Arc::new(AtomicBool::new(false));
    let (flag, weak) = (overwrote.clone(), Arc::downgrade(&engine));
    *backing.before_write.lock().unwrap() = Some(Box::new(move |offset| {
        if offset == 3 * block && !flag.swap(true, Ordering::SeqCst) {
            let engine = weak.upgrade().expect("engine alive");
            engine.lane().unwrap().write(3 * block, &block_data(2), false).unwrap();
        }
    }));
    let first = cleaner.clean_batch(16);
    assert!(overwrote.load(Ordering::SeqCst), "the hook did not run");
    assert_eq!((first.cleaned, first.superseded), (0, 1), "{first:?}");
    assert_eq!(engine.dirty_slots(), 1, "the block stays dirty");
    let mut buf = vec![0; BLOCK];
    engine.lane().unwrap().read(3 * block, &mut buf).unwrap();
    assert_eq!(buf, block_data(2));
    let second = cleaner.clean_batch(16);
    assert_eq!(second.cleaned, 1, "{second:?}");
    assert_eq!(engine.dirty_slots(), 0);
    let durable = world.backing.durable_contents();
    assert_eq!(
        &durable[3 * BLOCK..4 * BLOCK],
        &block_data(2)[..],
        "the newer data is written back"
    );
    let stats = engine.stats().cleaner;
    assert_eq!((stats.blocks_cleaned, stats.blocks_superseded, stats.batches), (1, 1, 2));
    drop(cleaner);
    engine.audit().unwrap();
}

/// Adjacent dirty blocks are merged into one backing write, in ascending order.
#[test]
fn adjacent_dirty_blocks_go_back_in_one_write() {
    let (world, backing, engine) = hooked_engine(2, 3);
    let block = BLOCK as u64;
    let mut lane = engine.lane().unwrap();
    for lba in [9, 7, 8, 20, 6] {
        lane.write(lba * block, &block_data(lba), false).unwrap();
    }
    drop(lane);
    let mut cleaner =
        engine.cleaner(CleanerConfig { merge_blocks: 8, ..eager(WriteBackOrder::Lba) }).unwrap();
    let outcome = cleaner.clean_batch(64);
    assert_eq!((outcome.cleaned, outcome.writes), (5, 2), "6..=9 merged, 20 alone: {outcome:?}");
    assert_eq!(backing.writes.load(Ordering::SeqCst), 2);
    let durable = world.backing.durable_contents();
    for lba in [6, 7, 8, 9, 20] {
        let at = lba as usize * BLOCK;
        assert_eq!(&durable[at..at + BLOCK], &block_data(lba)[..], "block {lba}");
    }
}

/// `Cleaner::drain` writes every dirty block back, batch after batch, and reports how many; a
/// block the backing store refuses stays dirty and the drain says so.
#[test]
fn a_drain_writes_everything_back_or_says_what_stayed_dirty() {
    let (world, _backing, engine) = hooked_engine(8, 3);
    let block = BLOCK as u64;
    let mut lane = engine.lane().unwrap();
    for lba in 0..18u64 {
        lane.write(lba * block, &block_data(lba), false).unwrap();
    }
    drop(lane);
    let mut cleaner = engine.cleaner(eager(WriteBackOrder::Oldest)).unwrap();
    world.backing.fail_writes_in(5 * block..6 * block);
    let err = cleaner.drain().unwrap_err();
    assert!(
        matches!(err, Error::WriteBackIncomplete { failed: 1, cleaned: 17, unreadable: 0 }),
        "{err}"
    );
    assert_eq!(engine.dirty_slots(), 1);
    world.backing.heal();
    assert_eq!(cleaner.drain().unwrap(), 1);
    assert_eq!(engine.dirty_slots(), 0);
    let durable = world.backing.durable_contents();
    for lba in 0..18 {
        assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(lba as u64)[..]);
    }
}

/// Writers that overflow the cache stall on a running cleaner instead of writing back inline,
/// each stall is counted and timed, and every write lands.
#[test]
fn writers_stall_on_the_cleaner_and_never_write_back_inline() {
    let (world, _backing, engine) = hooked_engine(3, 3);
    let block = BLOCK as u64;
    let settings =
        CleanerConfig { idle_ms: 60_000, adaptive: Adaptive::Off, ..eager(WriteBackOrder::Lba) };
    let mut cleaner = engine.cleaner(settings).unwrap();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        let mut lane = engine.lane().unwrap();
        for round in 0..5u64 {
            for lba in 0..BLOCKS as u64 {
                lane.write(lba * block, &block_data(round * 100 + lba), false).unwrap();
            }
        }
        drop(lane);
        engine.stop_cleaner();
        running.join().unwrap();
    });
    let stats = engine.stats().cleaner;
    assert!(stats.stalls > 0, "{stats:?}");
    assert_eq!(stats.inline_fallbacks, 0, "{stats:?}");
    assert!(stats.blocks_cleaned >= (5 * BLOCKS - 20) as u64, "{stats:?}");
    assert_eq!(stats.stall_histogram.iter().sum::<u64>(), stats.stalls);
    assert!(stats.stall_ns_max > 0 && stats.stall_ns_total >= stats.stall_ns_max);
    let mut lane = engine.lane().unwrap();
    for lba in 0..BLOCKS as u64 {
        let mut buf = vec![0; BLOCK];
        lane.read(lba * block, &mut buf).unwrap();
        assert_eq!(buf, block_data(400 + lba), "block {lba}");
    }
    lane.drain().unwrap();
    let durable = world.backing.durable_contents();
    for lba in 0..BLOCKS {
        assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(400 + lba as u64)[..]);
    }
    drop(lane);
    drop(cleaner);
    engine.audit().unwrap();
}

/// After a burst the foreground goes quiet: the cleaner writes everything back (idle cleaning
/// down to `idle_target_pct`, here 0) without being asked, and rests.
#[test]
fn an_idle_cache_is_cleaned_down_to_its_idle_target() {
    let (world, _backing, engine) = hooked_engine(4, 3);
    let block = BLOCK as u64;
    let mut lane = engine.lane().unwrap();
    for lba in 0..15u64 {
        lane.write(lba * block, &block_data(lba), false).unwrap();
    }
    drop(lane);
    assert_eq!(engine.dirty_slots(), 15);
    let settings = CleanerConfig {
        idle_ms: 50,
        target_pct: 50,
        low_pct: 60,
        high_pct: 90,
        ..eager(WriteBackOrder::Oldest)
    };
    let mut cleaner = engine.cleaner(settings).unwrap();
    let started = Instant::now();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        while engine.dirty_slots() > 0 && started.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        engine.stop_cleaner();
        running.join().unwrap();
    });
    assert_eq!(engine.dirty_slots(), 0, "idle cleaning stopped early");
    assert!(started.elapsed() >= Duration::from_millis(50), "cleaned before the idle delay");
    let durable = world.backing.durable_contents();
    for lba in 0..15 {
        assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(lba as u64)[..]);
    }
}

/// A backing store that refuses writes to a range: the cleaner marks those blocks refused and
/// keeps cleaning the others; once it cleans nothing it reports failing, and writers that need
/// a slot fall back to the inline path, which fails with the backing store's error. Dirty data
/// is kept throughout, and after the store heals everything is written back.
#[test]
fn a_failing_backing_store_keeps_dirty_data_and_the_cleaner_resumes_when_it_heals() {
    let (world, _backing, engine) = hooked_engine(5, 3);
    let block = BLOCK as u64;
    let mut lane = engine.lane().unwrap();
    for lba in 0..20u64 {
        lane.write(lba * block, &block_data(lba), false).unwrap();
    }
    world.backing.fail_writes_in(0..(BLOCKS as u64 * block));
    let mut cleaner = engine.cleaner(eager(WriteBackOrder::Lba)).unwrap();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        // Every slot dirty, every write-back refused: a new block's write fails with the
        // backing store's error (after the cleaner reports failing), never hangs.
        let started = Instant::now();
        let err = lane
            .write(30 * block, &block_data(30), false)
            .expect_err("a write found room with every write-back refused");
        assert!(matches!(err, Error::Backing(_)), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
        for lba in 0..20u64 {
            let mut buf = vec![0; BLOCK];
            lane.read(lba * block, &mut buf).unwrap();
            assert_eq!(buf, block_data(lba), "hits are served while the store fails");
        }
        assert_eq!(engine.dirty_slots(), 20);
        world.backing.heal();
        let healed = Instant::now();
        lane.write(30 * block, &block_data(30), false).unwrap();
        while engine.dirty_slots() > 0 && healed.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        engine.stop_cleaner();
        running.join().unwrap();
    });
    let stats = engine.stats().cleaner;
    assert!(stats.errors > 0 && stats.inline_fallbacks > 0, "{stats:?}");
    assert_eq!(engine.dirty_slots(), 0, "{stats:?}");
    let durable = world.backing.durable_contents();
    for lba in (0..20).chain([30]) {
        assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(lba as u64)[..]);
    }
}

/// A backing store whose writes fail while its reads and flushes succeed is reported failing
/// (writes) the whole time: a read miss served by the store and a flush that syncs it do not
/// clear the write-back's failure. A watcher sees the change when the write-back first fails
/// and again when it succeeds after the store heals.
#[test]
fn writes_failing_stay_reported_while_reads_and_flushes_succeed() {
    let (world, _backing, engine) = hooked_engine(6, 3);
    let block = BLOCK as u64;
    let mut lane = engine.lane().unwrap();
    for lba in 0..4u64 {
        lane.write(lba * block, &block_data(lba), false).unwrap();
    }
    world.backing.fail_writes_in(0..(BLOCKS as u64 * block));
    let (seen, health) = engine.wait_backing_health(0, Duration::ZERO);
    assert_eq!(health.state, BackingState::Ok);
    let mut cleaner = engine.cleaner(eager(WriteBackOrder::Lba)).unwrap();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        let (seen, health) = engine.wait_backing_health(seen, Duration::from_secs(20));
        assert_eq!(health.state, BackingState::Failing, "{health:?}");
        assert_eq!(health.failing, vec![BackingOp::Write], "{health:?}");
        // A miss the store serves, and a flush the store takes.
        let mut buf = vec![0; BLOCK];
        lane.read(40 * block, &mut buf).unwrap();
        let flushes = world.backing.flushes();
        lane.flush().unwrap();
        assert!(world.backing.flushes() > flushes, "the flush did not sync the store");
        let health = engine.stats().backing;
        assert_eq!(health.state, BackingState::Failing, "cleared by a read or a flush: {health:?}");
        assert_eq!(health.failing_names(), "writes");
        assert!(health.last_error.is_some_and(|e| e.contains("write")));
        world.backing.heal();
        let (_, health) = engine.wait_backing_health(seen, Duration::from_secs(20));
        assert_eq!(health, BackingHealth::default(), "the write-back succeeded again");
        let healed = Instant::now();
        while engine.dirty_slots() > 0 && healed.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        engine.stop_cleaner();
        running.join().unwrap();
    });
    assert_eq!(engine.dirty_slots(), 0);
}

/// A hung backing store (writes that do not complete): hits are still served, a writer that
/// needs a slot waits `stall_timeout_ms` and then fails with a clear error, the dirty data is
/// kept, and once the store answers again the cleaner resumes and writes succeed.
#[test]
fn a_hung_backing_store_bounds_the_writers_wait_and_the_cleaner_resumes() {
    let (world, backing, engine) = hooked_engine(6, 3);
    let block = BLOCK as u64;
    let mut lane = engine.lane().unwrap();
    for lba in 0..20u64 {
        lane.write(lba * block, &block_data(lba), false).unwrap();
    }
    backing.hold(true);
    let settings = CleanerConfig { stall_timeout_ms: 300, ..eager(WriteBackOrder::Lba) };
    let mut cleaner = engine.cleaner(settings).unwrap();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        let started = Instant::now();
        let err = lane.write(30 * block, &block_data(30), false).unwrap_err();
        let waited = started.elapsed();
        assert!(matches!(err, Error::CleanerStalled { .. }), "{err}");
        assert_eq!(err.errno(), libc::EIO);
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(10));
        for lba in 0..20u64 {
            let mut buf = vec![0; BLOCK];
            lane.read(lba * block, &mut buf).unwrap();
            assert_eq!(buf, block_data(lba), "hits are served while the store hangs");
        }
        backing.hold(false);
        lane.write(30 * block, &block_data(30), false).unwrap();
        engine.stop_cleaner();
        running.join().unwrap();
    });
    assert_eq!(engine.stats().cleaner.stall_timeouts, 1);
    lane.drain().unwrap();
    let durable = world.backing.durable_contents();
    for lba in (0..20).chain([30]) {
        assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(lba as u64)[..]);
    }
}

/// Settings change at run time and are checked as a whole.
#[test]
fn settings_change_while_the_cleaner_runs() {
    let (_world, _backing, engine) = hooked_engine(7, 3);
    let mut cleaner = engine.cleaner(CleanerConfig::default()).unwrap();
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        let changed = engine.set_cleaner_settings(["target_pct=5", "order=oldest"]).unwrap();
        assert_eq!((changed.target_pct, changed.order), (5, WriteBackOrder::Oldest));
        let err = engine.set_cleaner_settings(["low_pct=99"]).unwrap_err();
        assert!(err.to_string().contains("thresholds"), "{err}");
        assert_eq!(engine.cleaner_config().low_pct, 50);
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.stats().cleaner.order != "oldest" && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(engine.stats().cleaner.order, "oldest");
        assert!(engine.stats().cleaner.running);
        engine.stop_cleaner();
        running.join().unwrap();
    });
    assert_eq!(engine.stats().cleaner.phase, "stopped");
}

/// Writers faster than the backing store are paced once dirty data passes `throttle_pct`:
/// the cleaner measures its write-back rate and writers take turns at it, so that some writes
/// wait a little (counted, timed) and every write still lands; with `throttle_pct=100` none
/// is paced.
#[test]
fn writers_are_paced_above_the_throttle_threshold_and_not_with_it_off() {
    for throttle_pct in [80, 100] {
        let (world, backing, engine) = hooked_engine(5, 3);
        // A slow device: 200 µs per write.
        *backing.before_write.lock().unwrap() =
            Some(Box::new(|_| std::thread::sleep(Duration::from_micros(200))));
        let block = BLOCK as u64;
        let settings = CleanerConfig {
            idle_ms: 60_000,
            adaptive: Adaptive::Off,
            throttle_pct,
            ..eager(WriteBackOrder::Lba)
        };
        let mut cleaner = engine.cleaner(settings).unwrap();
        let mut last = vec![0u64; BLOCKS];
        let mut paced_seen = false;
        std::thread::scope(|scope| {
            let running = scope.spawn(|| cleaner.run(|_| {}));
            wait_running(&engine);
            let mut lane = engine.lane().unwrap();
            let mut rng = SmallRng::seed_from_u64(7);
            let started = Instant::now();
            let mut tag = 1;
            while started.elapsed() < Duration::from_millis(1500) {
                let lba = rng.gen_range(0..BLOCKS as u64);
                lane.write(lba * block, &block_data(tag), false).unwrap();
                last[lba as usize] = tag;
                tag += 1;
                paced_seen |= engine.stats().cleaner.pace_blocks_per_s > 0.0;
            }
            drop(lane);
            engine.stop_cleaner();
            running.join().unwrap();
        });
        let stats = engine.stats().cleaner;
        if throttle_pct == 100 {
            assert_eq!(stats.throttled_writes, 0, "{stats:?}");
            assert!(!paced_seen);
        } else {
            assert!(paced_seen, "writers were never paced: {stats:?}");
            assert!(stats.throttled_writes > 0, "{stats:?}");
            assert!(stats.throttle_ns_total > 0, "{stats:?}");
        }
        let mut lane = engine.lane().unwrap();
        for (lba, &tag) in last.iter().enumerate().filter(|(_, t)| **t > 0) {
            let mut buf = vec![0; BLOCK];
            lane.read(lba as u64 * block, &mut buf).unwrap();
            assert_eq!(buf, block_data(tag), "block {lba}");
        }
        lane.drain().unwrap();
        let durable = world.backing.durable_contents();
        for (lba, &tag) in last.iter().enumerate().filter(|(_, t)| **t > 0) {
            assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(tag)[..]);
        }
        drop(lane);
        drop(cleaner);
        engine.audit().unwrap();
    }
}

/// Pacing counts what a write leaves for the cleaner: while writers are paced, overwrites of
/// a block that is dirty already take no turn (they add nothing to write back), so a
/// foreground that rewrites its dirty working set is not held to the backing store's rate.
/// The block stays dirty for the whole check: the cleaner is held at a gate in front of the
/// backing store.
#[test]
fn overwrites_of_a_dirty_block_are_not_paced() {
    let (_world, backing, engine) = hooked_engine(12, 3);
    backing.on_write(|_| std::thread::sleep(Duration::from_micros(200)));
    let block = BLOCK as u64;
    let settings = CleanerConfig {
        idle_ms: 60_000,
        adaptive: Adaptive::Off,
        throttle_pct: 50,
        ..eager(WriteBackOrder::Lba)
    };
    let mut cleaner = engine.cleaner(settings).unwrap();
    let (throttled, paced) = std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        let release = Release(&backing, &engine);
        let mut lane = engine.lane().unwrap();
        let mut rng = SmallRng::seed_from_u64(9);
        let mut tag = 1;
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.stats().cleaner.pace_blocks_per_s == 0.0 && Instant::now() < deadline {
            lane.write(rng.gen_range(1..BLOCKS as u64) * block, &block_data(tag), false).unwrap();
            tag += 1;
        }
        // From here on nothing reaches the backing store: block 0, written now, stays dirty.
        backing.hold(true);
        std::thread::sleep(Duration::from_millis(50));
        lane.write(0, &block_data(tag), false).unwrap();
        let before = engine.stats().cleaner.throttled_writes;
        let mut paced = true;
        for i in 0..200 {
            lane.write(0, &block_data(tag + 1 + i), false).unwrap();
            paced &= engine.stats().cleaner.pace_blocks_per_s > 0.0;
        }
        let throttled = engine.stats().cleaner.throttled_writes - before;
        drop(lane);
        drop(release);
        running.join().unwrap();
        (throttled, paced)
    });
    assert!(paced, "writers stopped being paced during the overwrites");
    assert_eq!(throttled, 0, "overwrites of a dirty block waited for turns");
    drop(cleaner);
    engine.audit().unwrap();
}

/// While the cleaner waits on a slow flush it sets no pace: the writers refresh it from the
/// dirty level themselves, so that it slows as the clean slots run out instead of spending
/// them at the rate set before the flush (and then stalling for the rest of it).
#[test]
fn writers_slow_their_pace_while_the_cleaner_waits_on_a_slow_flush() {
    let (_world, backing, engine) = hooked_engine(6, 3);
    backing.on_write(|_| std::thread::sleep(Duration::from_micros(200)));
    let block = BLOCK as u64;
    let settings = CleanerConfig {
        idle_ms: 60_000,
        adaptive: Adaptive::Off,
        throttle_pct: 50,
        ..eager(WriteBackOrder::Lba)
    };
    let mut cleaner = engine.cleaner(settings).unwrap();
    // 0: flushes at full speed; 1: the next flush is slow; 2: it is under way; 3: it ended.
    let slow_flush = Arc::new(AtomicU64::new(0));
    let flush_state = slow_flush.clone();
    backing.on_flush(move |_| {
        if flush_state.compare_exchange(1, 2, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            std::thread::sleep(Duration::from_millis(400));
            flush_state.store(3, Ordering::SeqCst);
        }
    });
    // Nothing in the scope panics before the cleaner is stopped (the scope would wait for it).
    let (at_start, slowest) = std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|_| {}));
        wait_running(&engine);
        let mut lane = engine.lane().unwrap();
        let mut rng = SmallRng::seed_from_u64(8);
        let mut tag = 1;
        let mut write = || {
            let lba = rng.gen_range(0..BLOCKS as u64);
            lane.write(lba * block, &block_data(tag), false).unwrap();
            tag += 1;
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.stats().cleaner.pace_blocks_per_s == 0.0 && Instant::now() < deadline {
            write();
        }
        // The last pace set before the cleaner began to wait (on a loaded machine the
        // cleaner may catch up and turn pacing off just before), and the slowest one during
        // the wait.
        let mut at_start = engine.stats().cleaner.pace_blocks_per_s;
        slow_flush.store(1, Ordering::SeqCst);
        while slow_flush.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
            write();
            let pace = engine.stats().cleaner.pace_blocks_per_s;
            if slow_flush.load(Ordering::SeqCst) < 2 && pace > 0.0 {
                at_start = pace;
            }
        }
        let mut slowest = at_start;
        while slow_flush.load(Ordering::SeqCst) == 2 {
            write();
            let pace = engine.stats().cleaner.pace_blocks_per_s;
            if slow_flush.load(Ordering::SeqCst) == 2 && pace > 0.0 {
                slowest = slowest.min(pace);
            }
        }
        drop(lane);
        engine.stop_cleaner();
        running.join().unwrap();
        (at_start, slowest)
    });
    assert!(at_start > 0.0, "writers were not paced when the slow flush began");
    assert!(
        slowest < at_start / 2.0,
        "the pace stayed at {slowest:.0} blocks/s (from {at_start:.0}) during the flush"
    );
    drop(cleaner);
    engine.audit().unwrap();
}

/// A backing store whose queue takes requests and then fails every reap as a whole (a queue
/// that fails for good): requests pushed on it never complete.
struct DeadQueueBacking(pmcache_engine::testing::SimBacking);

struct DeadQueue {
    held: Vec<pmcache_backing::IoRequest>,
    depth: usize,
}

impl pmcache_backing::IoQueue for DeadQueue {
    fn depth(&self) -> usize {
        self.depth
    }
    fn in_flight(&self) -> usize {
        self.held.len()
    }
    fn push(&mut self, req: pmcache_backing::IoRequest) -> Result<(), pmcache_backing::IoRequest> {
        if self.held.len() == self.depth {
            return Err(req);
        }
        self.held.push(req);
        Ok(())
    }
    fn submit(&mut self) -> pmcache_backing::Result<usize> {
        Ok(0)
    }
    fn reap(
        &mut self,
        _min: usize,
        _out: &mut Vec<pmcache_backing::IoCompletion>,
    ) -> pmcache_backing::Result<usize> {
        Err(pmcache_backing::BackingError::Io {
            op: "reap",
            offset: 0,
            len: 0,
            source: std::io::Error::from_raw_os_error(libc::EBADF),
        })
    }
}

impl pmcache_backing::BackingStore for DeadQueueBacking {
    pmcache_backing::forward_to!(0: size_bytes, logical_block_size, identity, read_at, write_at,
        flush, discard, write_zeroes);
    fn open_queue(
        &self,
        depth: usize,
    ) -> pmcache_backing::Result<Box<dyn pmcache_backing::IoQueue>> {
        Ok(Box::new(DeadQueue { held: Vec::new(), depth }))
    }
}

/// The cleaner's queue fails for good: the cleaner gives it up after a few failed reaps, ends
/// the copies it held (their stripes' counts lowered: a write-through of one of those blocks
/// does not wait for them forever, holding its stripe) and writes back synchronously, so the
/// drain completes and every block reaches the backing store.
#[test]
fn a_cleaner_queue_that_fails_for_good_is_given_up_and_writers_are_not_held() {
    use pmcache_engine::testing::model::pattern;
    let world = World::fresh(77);
    let backing = Arc::new(DeadQueueBacking(world.backing.clone()));
    let cfg = pmcache_engine::Config {
        max_lanes: 4,
        ..config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always)
    };
    let engine =
        Engine::format(world.medium.clone(), backing, Arc::new(ManualClock::default()), &cfg)
            .expect("format");
    let block = BLOCK as u64;
    let mut lane = engine.lane().expect("lane");
    for lba in 0..8 {
        lane.write(lba * block, &pattern(lba + 1, lba * block, block), false).expect("write");
    }
    drop(lane);
    // Both threads answer through channels, so that a copy held forever fails the test (its
    // threads left behind) instead of hanging it.
    let engine: &'static _ = Box::leak(Box::new(engine));
    let (drained_tx, drained_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut cleaner = engine.cleaner(eager(WriteBackOrder::Lba)).expect("cleaner");
        // The first batch's copies are stuck on the dead queue until it is given up.
        drained_tx.send(cleaner.drain().map_err(|e| e.to_string())).expect("the answer");
    });
    let (written_tx, written_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // A write-through of a block whose copy may be stuck: it waits for the copy's end.
        engine.set_mode(CacheMode::WriteThrough);
        let mut lane = engine.lane().expect("lane");
        let written = lane.write(0, &pattern(100, 0, block), false).map_err(|e| e.to_string());
        written_tx.send(written).expect("the answer");
    });
    let wait = Duration::from_secs(20);
    let written = written_rx.recv_timeout(wait).expect("the write-through waited for ever");
    written.expect("the write-through of block 0");
    let drained = drained_rx.recv_timeout(wait).expect("the drain did not end");
    drained.expect("the drain through the synchronous path");
    assert_eq!(engine.stats().dirty_slots, 0, "blocks left dirty");
    let stored = world.backing.contents();
    assert_eq!(stored[..BLOCK], pattern(100, 0, block)[..], "block 0 is the write-through");
    for lba in 1..8u64 {
        let at = (lba * block) as usize;
        assert_eq!(stored[at..at + BLOCK], pattern(lba + 1, lba * block, block)[..], "{lba}");
    }
}

fn nice_of_this_thread() -> i32 {
    rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("getpriority")
}

/// The default boost (paper 002's adaptive priority, with the writers yielding): while the
/// cleaner is boosted, a writer's thread runs at `nice_writers` from its next write on, a
/// thread that only reads is not demoted, and once the boost ends the writer's next request
/// takes its thread back to its own value. The cleaner is held boosted by a backing store
/// whose writes wait at a gate.
#[test]
fn a_boosted_cleaner_makes_its_writers_yield_until_the_boost_ends() {
    let (world, backing, engine) = hooked_engine(11, 4);
    let block = BLOCK as u64;
    let settings = CleanerConfig {
        idle_ms: 60_000,
        adaptive: Adaptive::Boost,
        nice_base: 0,
        nice_boost: 0,
        nice_writers: 10,
        ..eager(WriteBackOrder::Lba)
    };
    let boosted = |want: bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.stats().cleaner.boosted != want {
            assert!(Instant::now() < deadline, "the cleaner's boost never became {want}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let mut cleaner = engine.cleaner(settings).unwrap();
    backing.hold(true);
    std::thread::scope(|scope| {
        let running = scope.spawn(|| cleaner.run(|note| assert_eq!(note, None, "{note:?}")));
        wait_running(&engine);
        let release = Release(&backing, &engine);
        let writer = scope
            .spawn(|| {
                let own = nice_of_this_thread();
                let mut lane = engine.lane().unwrap();
                // 8 of 20 slots dirty: over the high watermark (30 %), under the pacing one.
                for lba in 0..8u64 {
                    lane.write(lba * block, &block_data(lba), false).unwrap();
                }
                boosted(true);
                assert_eq!(nice_of_this_thread(), own, "not demoted before its next request");
                let reader = std::thread::scope(|inner| {
                    inner
                        .spawn(|| {
                            let own = nice_of_this_thread();
                            let mut lane = engine.lane().unwrap();
                            lane.read(0, &mut vec![0; BLOCK]).unwrap();
                            (own, nice_of_this_thread())
                        })
                        .join()
                        .unwrap()
                });
                assert_eq!(reader.0, reader.1, "a thread that only reads keeps its value");
                lane.write(8 * block, &block_data(8), false).unwrap();
                assert_eq!(nice_of_this_thread(), own + 10, "a writer yields while boosted");
                backing.hold(false);
                boosted(false);
                lane.read(0, &mut vec![0; BLOCK]).unwrap();
                // Going back down needs CAP_SYS_NICE or RLIMIT_NICE: root here.
                if rustix::process::geteuid().is_root() {
                    assert_eq!(nice_of_this_thread(), own, "back to its own after the boost");
                }
            })
            .join();
        drop(release);
        running.join().unwrap();
        writer.unwrap();
    });
    let stats = engine.stats().cleaner;
    assert!(stats.boosts >= 1 && stats.boosted_ns > 0, "{stats:?}");
    cleaner.drain().unwrap();
    let durable = world.backing.durable_contents();
    for lba in 0..9usize {
        assert_eq!(&durable[lba * BLOCK..(lba + 1) * BLOCK], &block_data(lba as u64)[..]);
    }
    drop(cleaner);
    engine.audit().unwrap();
}
