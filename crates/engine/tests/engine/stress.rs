//! Multi-threaded tests on the real medium (a file in /dev/shm) with a real backing file:
//! threads with disjoint blocks checked against their own models, and threads sharing blocks
//! checked for torn or out-of-order reads while evictions and write-backs recycle slots.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pmcache_backing::{EngineKind, EngineOptions, PsyncFile, open_backing};
use pmcache_engine::{
    AdmissionConfig, CacheMode, CleanerConfig, Config, Engine, MonotonicClock, WriteBackOrder,
};
use pmcache_media::PmemFile;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: u64 = 4096;

fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").expect("/dev/shm is needed for the emulated PM medium")
}

fn backing_file(dir: &Path, blocks: u64) -> PsyncFile {
    let path = dir.join("backing");
    std::fs::File::create(&path).unwrap().set_len(blocks * BLOCK).unwrap();
    PsyncFile::open(&path).unwrap()
}

fn config(mode: CacheMode, lanes: usize, index_buckets: Option<u64>) -> Config {
    Config {
        mode,
        block_size: BLOCK as u32,
        max_lanes: lanes,
        admission: AdmissionConfig::Always,
        index_buckets,
        ..Config::default()
    }
}

type ShmEngine = Engine<PmemFile, PsyncFile, MonotonicClock>;

/// Attaches the cache in `dir` again after a process crash (the engine was dropped without
/// shutdown): recovery must see an unclean shutdown and no torn or corrupt entry.
fn reattach_after_crash(
    dir: &Path,
    mode: CacheMode,
    lanes: usize,
    index_buckets: Option<u64>,
) -> ShmEngine {
    let medium = PmemFile::open(&dir.join("pm"), None).unwrap();
    let backing = PsyncFile::open(&dir.join("backing")).unwrap();
    let (engine, report) = Engine::open(
        medium,
        backing,
        MonotonicClock::default(),
        &config(mode, lanes, index_buckets),
    )
    .unwrap();
    assert!(!report.was_clean_shutdown, "{report:?}");
    assert_eq!((report.torn, report.corrupt), (0, 0), "{report:?}");
    engine
}

/// Each thread owns `BLOCKS_PER_THREAD` blocks and checks every read against its own model.
#[test]
fn threads_with_their_own_blocks_match_their_models_in_every_mode() {
    own_blocks_in_every_mode(None);
}

/// The same on an index of 4 buckets, 32 entries for the cache's 32 slots: threads make
/// index room for one another's blocks (evicting clean ones, writing dirty ones back), each
/// holding its own block's stripe meanwhile.
#[test]
fn threads_competing_for_index_room_match_their_models_in_every_mode() {
    own_blocks_in_every_mode(Some(4));
}

fn own_blocks_in_every_mode(index_buckets: Option<u64>) {
    const THREADS: u64 = 4;
    const BLOCKS_PER_THREAD: u64 = 48;
    for mode in CacheMode::ALL {
        let dir = shm_dir();
        // 32 slots for 192 blocks: constant eviction and (write-back) write-back. In
        // write-around, writes and trims drop a block's cached copy and only read misses
        // admit, so about a third of the blocks (64) are cached at a time: the cache must
        // be well below that for evictions to happen whatever the seed.
        let medium_bytes = 8192 + 32 * BLOCK + 4096;
        let medium = PmemFile::open(&dir.path().join("pm"), Some(medium_bytes)).unwrap();
        let backing = backing_file(dir.path(), THREADS * BLOCKS_PER_THREAD);
        let engine = Engine::format(
            medium,
            backing,
            MonotonicClock::default(),
            &config(mode, 8, index_buckets),
        )
        .unwrap();
        let models: Vec<Vec<Option<Vec<u8>>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let engine = &engine;
                    scope.spawn(move || {
                        let mut lane = engine.lane().unwrap();
                        let mut rng = SmallRng::seed_from_u64(t);
                        let first = t * BLOCKS_PER_THREAD;
                        let mut model: Vec<Option<Vec<u8>>> =
                            vec![Some(vec![0; BLOCK as usize]); BLOCKS_PER_THREAD as usize];
                        for step in 0..1500u64 {
                            let b = rng.gen_range(0..BLOCKS_PER_THREAD);
                            let offset = (first + b) * BLOCK;
                            match rng.gen_range(0..10) {
                                0..=3 => {
                                    let data = own_stamp(t, b, step, BLOCK as usize);
                                    lane.write(offset, &data, false).unwrap();
                                    model[b as usize] = Some(data);
                                }
                                4 => {
                                    let at = rng.gen_range(0..BLOCK - 100);
                                    let data = own_stamp(t, b, step | 1 << 20, 100);
                                    lane.write(offset + at, &data, false).unwrap();
                                    if let Some(block) = &mut model[b as usize] {
                                        block[at as usize..at as usize + 100]
                                            .copy_from_slice(&data);
                                    }
                                }
                                5 => {
                                    lane.trim(offset, BLOCK).unwrap();
                                    model[b as usize] = None;
                                }
                                6 => lane.flush().unwrap(),
                                _ => {
                                    let mut buf = vec![0u8; BLOCK as usize];
                                    lane.read(offset, &mut buf).unwrap();
                                    if let Some(expected) = &model[b as usize] {
                                        assert!(
                                            buf == *expected,
                                            "{mode}: thread {t} block {b} step {step}"
                                        );
                                    } else {
                                        model[b as usize] = Some(buf);
                                    }
                                }
                            }
                        }
                        model
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        engine.audit().unwrap_or_else(|e| panic!("{mode}: {e}"));
        let stats = engine.stats();
        if mode != CacheMode::PassThrough {
            assert!(stats.evictions > 0, "{mode}: no evictions: {stats:?}");
            if index_buckets.is_some() {
                assert!(stats.index_conflicts > 0, "{mode}: never short of index room");
            }
        }
        if mode.writes_back() {
            assert!(stats.writebacks > 0, "{mode}: no write-backs: {stats:?}");
        }
        // Every other mode crashes with its dirty blocks and superseded copies in place, for
        // recovery to sort out; the others after a drain (everything clean).
        let drained = CacheMode::ALL.iter().position(|&m| m == mode).unwrap() % 2 == 0;
        if drained {
            engine.lane().unwrap().drain().unwrap();
        }
        drop(engine);
        let engine = reattach_after_crash(dir.path(), mode, 8, index_buckets);
        engine.audit().unwrap_or_else(|e| panic!("{mode}: after reattach: {e}"));
        let mut lane = engine.lane().unwrap();
        for (t, model) in models.iter().enumerate() {
            for (b, expected) in model.iter().enumerate() {
                let Some(expected) = expected else { continue };
                let mut buf = vec![0u8; BLOCK as usize];
                let offset = (t as u64 * BLOCKS_PER_THREAD + b as u64) * BLOCK;
                lane.read(offset, &mut buf).unwrap();
                assert!(buf == *expected, "{mode}: after reattach, thread {t} block {b}");
            }
        }
    }
}

/// `len` bytes that name thread `t`, block `b` and step `step` in every 8-byte word: a
/// stale or misplaced block never matches another's.
fn own_stamp(t: u64, b: u64, step: u64, len: usize) -> Vec<u8> {
    let word = (t << 56 | b << 40 | step).to_le_bytes();
    word.iter().copied().cycle().take(len).collect()
}

fn stamped(writer: u64, counter: u64) -> Vec<u8> {
    let word = writer << 48 | counter;
    (0..BLOCK / 8).flat_map(|_| word.to_le_bytes()).collect()
}

/// Two writers and two readers share 8 blocks while a fifth thread churns other blocks, so the
/// shared blocks' slots are evicted, written back and recycled under the readers. No read may
/// be torn, no reader may see a writer's counter go backwards on a block, no read may return
/// a writer's older write than one that writer had completed on that block before the read
/// began, and no read may return the zeroes of a never-written block once a write to it has
/// completed.
#[test]
fn shared_blocks_are_never_torn_or_stale() {
    const SHARED: u64 = 8;
    for mode in [CacheMode::WriteBack, CacheMode::WriteThrough] {
        let dir = shm_dir();
        let medium =
            PmemFile::open(&dir.path().join("pm"), Some(8192 + 40 * BLOCK + 4096)).unwrap();
        let backing = backing_file(dir.path(), 256);
        let engine = Arc::new(
            Engine::format(medium, backing, MonotonicClock::default(), &config(mode, 8, None))
                .unwrap(),
        );
        // The last counter each writer completed on each block.
        let completed: Vec<[AtomicU64; 3]> =
            (0..SHARED).map(|_| std::array::from_fn(|_| AtomicU64::new(0))).collect();
        std::thread::scope(|scope| {
            for writer in 1..=2u64 {
                let (engine, completed) = (&engine, &completed);
                scope.spawn(move || {
                    let mut lane = engine.lane().unwrap();
                    for counter in 1..=3000u64 {
                        let b = counter % SHARED;
                        lane.write(b * BLOCK, &stamped(writer, counter), false).unwrap();
                        completed[b as usize][writer as usize].store(counter, Ordering::SeqCst);
                    }
                });
            }
            {
                let engine = &engine;
                scope.spawn(move || {
                    let mut lane = engine.lane().unwrap();
                    let data = vec![7u8; BLOCK as usize];
                    for i in 0..3000u64 {
                        lane.write((SHARED + i % 200) * BLOCK, &data, false).unwrap();
                    }
                });
            }
            for reader in 0..2u64 {
                let (engine, completed) = (&engine, &completed);
                scope.spawn(move || {
                    let mut lane = engine.lane().unwrap();
                    let mut last = [[0u64; 3]; SHARED as usize];
                    let mut buf = vec![0u8; BLOCK as usize];
                    for i in 0..6000u64 {
                        let b = (i + reader) % SHARED;
                        let done_before: [u64; 3] = std::array::from_fn(|w| {
                            completed[b as usize][w].load(Ordering::SeqCst)
                        });
                        lane.read(b * BLOCK, &mut buf).unwrap();
                        let first = u64::from_le_bytes(buf[..8].try_into().unwrap());
                        assert!(
                            buf.chunks(8)
                                .all(|w| u64::from_le_bytes(w.try_into().unwrap()) == first),
                            "{mode}: torn read of block {b}"
                        );
                        let (writer, counter) = (first >> 48, first & 0xffff_ffff_ffff);
                        assert!(
                            first != 0 || done_before == [0; 3],
                            "{mode}: block {b} read as never written after writes {done_before:?}"
                        );
                        if first != 0 {
                            assert!(
                                writer == 1 || writer == 2,
                                "{mode}: foreign data {first:#x} in block {b}"
                            );
                            assert!(
                                counter >= last[b as usize][writer as usize],
                                "{mode}: block {b} went back from {} to {counter}",
                                last[b as usize][writer as usize]
                            );
                            assert!(
                                counter >= done_before[writer as usize],
                                "{mode}: block {b} read writer {writer}'s {counter}, older than \
                                 its {} completed before the read",
                                done_before[writer as usize]
                            );
                            last[b as usize][writer as usize] = counter;
                        }
                    }
                });
            }
        });
        let stats = engine.stats();
        assert!(stats.evictions > 100, "{mode}: too little churn: {stats:?}");
        engine.audit().unwrap_or_else(|e| panic!("{mode}: {e}"));
    }
}

/// Block `lba`'s contents as written by `writer` in its batch number `batch`.
fn batch_stamp(writer: u64, batch: u64, lba: u64) -> Vec<u8> {
    let word = (writer << 56 | batch << 16 | lba).to_le_bytes();
    word.iter().copied().cycle().take(BLOCK as usize).collect()
}

/// Two lanes group-commit batches over the same 16 blocks, so each finds stripes the other
/// holds and commits those writes in later rounds of its group. Every block ends as one of the
/// two last batches wrote it — before and after a process crash and reattach.
#[test]
fn batches_over_the_same_blocks_commit_in_rounds() {
    use pmcache_engine::WriteRequest;
    const BLOCKS: u64 = 16;
    let dir = shm_dir();
    let medium_bytes = 8192 + 256 * BLOCK + 4096;
    let medium = PmemFile::open(&dir.path().join("pm"), Some(medium_bytes)).unwrap();
    let backing = backing_file(dir.path(), BLOCKS);
    let mode = CacheMode::WriteBack;
    let engine =
        Engine::format(medium, backing, MonotonicClock::default(), &config(mode, 4, None)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let batches_done: Vec<u64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u64)
            .map(|writer| {
                let engine = &engine;
                scope.spawn(move || {
                    let mut lane = engine.lane().unwrap();
                    let mut rng = SmallRng::seed_from_u64(writer);
                    let mut outcomes = Vec::new();
                    let mut batch = 0;
                    // At least 200 batches each, then until some write had to wait.
                    while batch < 200
                        || (engine.stats().group_stripe_waits == 0
                            && std::time::Instant::now() < deadline)
                    {
                        let mut lbas: Vec<u64> = (0..BLOCKS).collect();
                        for i in (1..lbas.len()).rev() {
                            lbas.swap(i, rng.gen_range(0..=i));
                        }
                        let data: Vec<Vec<u8>> =
                            lbas.iter().map(|&lba| batch_stamp(writer, batch, lba)).collect();
                        let requests: Vec<WriteRequest<'_>> = lbas
                            .iter()
                            .zip(&data)
                            .map(|(&lba, data)| WriteRequest {
                                offset: lba * BLOCK,
                                data,
                                fua: false,
                            })
                            .collect();
                        lane.write_batch(&requests, &mut outcomes);
                        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
                        batch += 1;
                    }
                    batch
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    engine.audit().unwrap();
    let stats = engine.stats();
    assert!(stats.group_stripe_waits > 0, "no write waited for a stripe: {stats:?}");
    assert_eq!(stats.group_writes, (batches_done[0] + batches_done[1]) * BLOCKS, "{stats:?}");
    let check = |engine: &ShmEngine, when: &str| {
        let mut lane = engine.lane().unwrap();
        for lba in 0..BLOCKS {
            let mut buf = vec![0u8; BLOCK as usize];
            lane.read(lba * BLOCK, &mut buf).unwrap();
            let last = |writer: u64| batch_stamp(writer, batches_done[writer as usize] - 1, lba);
            assert!(buf == last(0) || buf == last(1), "{when}: block {lba} is neither last write");
        }
    };
    check(&engine, "live");
    drop(engine);
    check(&reattach_after_crash(dir.path(), mode, 4, None), "after reattach");
}

/// A cleaner that ran with write-back off (`order=none`, as a server started that way) and
/// was stopped drains every dirty block, whatever its order, over each kind of queue (one
/// that runs requests at reap, and io_uring on a real file with `O_DIRECT`), in batches
/// fewer than the dirty blocks, merged into runs.
#[test]
fn a_stopped_cleaner_drains_everything_in_every_order() {
    for engine_kind in [EngineKind::Psync, EngineKind::IoUring] {
        for order in WriteBackOrder::ALL {
            let dir = shm_dir();
            let disk = tempfile::tempdir_in("/var/tmp").unwrap();
            let medium = PmemFile::open(&dir.path().join("pm"), Some(64 << 20)).unwrap();
            let path = disk.path().join("backing");
            std::fs::File::create(&path).unwrap().set_len(65536 * BLOCK).unwrap();
            let backing = open_backing(&path, &EngineOptions::new(engine_kind, true)).unwrap();
            let engine = Engine::format(
                medium,
                backing,
                MonotonicClock::default(),
                &config(CacheMode::WriteBack, 2, None),
            )
            .unwrap();
            let mut lane = engine.lane().unwrap();
            let written = 12288u64;
            for b in 0..written {
                lane.write(b * BLOCK, &own_stamp(0, b, 1, BLOCK as usize), false).unwrap();
            }
            drop(lane);
            assert_eq!(engine.dirty_slots(), written);
            let settings = CleanerConfig { order, ..CleanerConfig::default() };
            let mut cleaner = engine.cleaner(settings).unwrap();
            let drained = std::thread::scope(|scope| {
                let runner = scope.spawn(move || {
                    cleaner.run(|_| {});
                    cleaner.drain()
                });
                std::thread::sleep(Duration::from_millis(50));
                engine.stop_cleaner();
                let deadline = Instant::now() + Duration::from_secs(30);
                while !runner.is_finished() {
                    if Instant::now() >= deadline {
                        // A panic here would wait for the scoped runner forever.
                        eprintln!("{engine_kind} {order}: the drain did not end in 30 s");
                        std::process::abort();
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                runner.join().unwrap()
            });
            drained.unwrap_or_else(|e| panic!("{engine_kind} {order}: {e}"));
            assert_eq!(engine.dirty_slots(), 0, "{engine_kind} {order}");
            engine.audit().unwrap();
        }
    }
}
