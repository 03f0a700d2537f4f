//! Attaching existing caches: clean and unclean shutdowns, corrupt or truncated superblocks
//! and metadata, the wrong backing store, and a failing backing store. Bad bytes on the medium
//! give precise errors or dropped-and-reported entries, never a panic or wrong data.

use std::sync::Arc;

use pmcache_engine::format::{FormatError, SUPERBLOCK_BYTES};
use pmcache_engine::testing::SimBacking;
use pmcache_engine::{AdmissionConfig, CacheMode, Config, Engine, Error, ManualClock};
use pmcache_media::{CrashMedium, CrashSwitch, Medium, PmemFile};
use proptest::prelude::*;

const BLOCK: usize = 512;
const BLOCKS: u64 = 64;
const MEDIUM_BYTES: u64 = 8192 + 32 * BLOCK as u64;

fn config(mode: CacheMode) -> Config {
    Config {
        mode,
        block_size: BLOCK as u32,
        max_lanes: 2,
        admission: AdmissionConfig::Always,
        ..Config::default()
    }
}

fn parts() -> (CrashMedium, SimBacking) {
    let switch = CrashSwitch::new();
    (
        CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1),
        SimBacking::new(BLOCKS * BLOCK as u64, switch, 2),
    )
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::default())
}

fn block_of(value: u8) -> Vec<u8> {
    vec![value; BLOCK]
}

fn open(
    medium: &CrashMedium,
    backing: &SimBacking,
) -> pmcache_engine::Result<pmcache_engine::RecoveryReport> {
    Engine::open(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
        .map(|(_, r)| r)
}

#[test]
fn clean_blocks_stay_cached_and_clean_across_a_clean_shutdown() {
    let (medium, backing) = parts();
    let engine =
        Engine::format(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
            .unwrap();
    {
        let mut lane = engine.lane().unwrap();
        for b in 0..10u64 {
            lane.write(b * BLOCK as u64, &block_of(b as u8 + 1), false).unwrap();
        }
        lane.drain().unwrap();
        lane.write(20 * BLOCK as u64, &block_of(99), false).unwrap();
    }
    engine.shutdown().unwrap();
    let (engine, report) =
        Engine::open(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
            .unwrap();
    assert!(report.was_clean_shutdown);
    assert_eq!(
        (report.clean, report.dirty, report.torn, report.corrupt),
        (10, 1, 0, 0),
        "{report:?}"
    );
    let reads_before = backing.io_counts().1;
    let mut lane = engine.lane().unwrap();
    let mut buf = vec![0u8; BLOCK];
    for b in 0..10u64 {
        lane.read(b * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(buf, block_of(b as u8 + 1));
    }
    assert_eq!(backing.io_counts().1, reads_before, "clean blocks were not served from the cache");
    drop(lane);
    // An unclean shutdown is reported as such.
    drop(engine);
    assert!(!open(&medium, &backing).unwrap().was_clean_shutdown);
}

/// Shutting down waits for no lane: while lanes are open it is refused, naming how many, and
/// changes nothing (the cache keeps serving, and dropping it then is an unclean shutdown);
/// so does a shutdown whose backing-store sync fails.
/// Once every lane is dropped it succeeds, a second call is a no-op, and no lane is handed out
/// after it.
#[test]
fn shutdown_is_refused_while_lanes_are_open_and_final_after() {
    let (medium, backing) = parts();
    let cfg = config(CacheMode::WriteBack);
    let engine = Engine::format(medium.clone(), backing.clone(), clock(), &cfg).unwrap();
    let mut lane = engine.lane().unwrap();
    lane.write(0, &block_of(7), false).unwrap();
    let other = engine.lane().unwrap();
    let err = engine.shutdown().unwrap_err();
    assert!(matches!(err, Error::LanesOpen { open: 2 }), "{err}");
    assert_eq!(err.to_string(), "cannot shut down: 2 lanes are still open");
    drop(other);
    assert!(matches!(engine.shutdown(), Err(Error::LanesOpen { open: 1 })));
    lane.write(BLOCK as u64, &block_of(8), false).unwrap();
    drop(lane);
    drop(engine);
    let (engine, report) = Engine::open(medium.clone(), backing.clone(), clock(), &cfg).unwrap();
    assert!(!report.was_clean_shutdown, "a refused shutdown marked the cache clean");
    assert_eq!(report.dirty, 2, "{report:?}");

    // A shutdown whose backing sync fails changes nothing either, and neither does one after
    // it, even with the backing store healed: a sync that failed may have lost writes that a
    // later sync would not report (see `sync_backing`). Attaching again recovers.
    backing.fail_flushes(true);
    let err = engine.shutdown().unwrap_err();
    assert!(matches!(err, Error::Backing(_)) && err.errno() == 5, "{err}");
    engine.lane().unwrap().write(2 * BLOCK as u64, &block_of(9), false).unwrap();
    backing.heal();
    let err = engine.shutdown().unwrap_err();
    assert!(matches!(err, Error::BackingSyncFailedBefore) && err.errno() == 5, "{err}");
    assert!(err.to_string().contains("restart pmcache"), "{err}");
    drop(engine);
    let (engine, report) = Engine::open(medium.clone(), backing.clone(), clock(), &cfg).unwrap();
    assert!(!report.was_clean_shutdown);
    assert_eq!(report.dirty, 3, "{report:?}");
    engine.shutdown().unwrap();
    engine.shutdown().unwrap();
    assert!(matches!(engine.lane(), Err(Error::ShutDown)));
    drop(engine);
    let (engine, report) = Engine::open(medium, backing, clock(), &cfg).unwrap();
    assert!(report.was_clean_shutdown);
    let mut buf = vec![0u8; BLOCK];
    let mut lane = engine.lane().unwrap();
    for (b, value) in [(0, 7), (1, 8), (2, 9)] {
        lane.read(b * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(buf, block_of(value), "block {b}");
    }
}

/// Formatting over a cache forgets every block it held, and a power cut at any persist point
/// of that format leaves either no cache (the old superblock is invalidated first) or the new,
/// empty one — never the old blocks under a new superblock.
#[test]
fn formatting_over_an_old_cache_forgets_its_blocks_even_if_cut_short() {
    let cfg = config(CacheMode::WriteBack);
    let mut finished = false;
    for point in 1.. {
        let switch = CrashSwitch::new();
        let medium = CrashMedium::new(MEDIUM_BYTES, switch.clone(), point);
        let backing = SimBacking::new(BLOCKS * BLOCK as u64, switch.clone(), 2);
        let engine = Engine::format(medium.clone(), backing.clone(), clock(), &cfg).unwrap();
        {
            let mut lane = engine.lane().unwrap();
            for b in 0..8u64 {
                lane.write(b * BLOCK as u64, &block_of(0x42), false).unwrap();
            }
        }
        drop(engine);
        switch.arm(switch.points() + point);
        let formatted = Engine::format(medium.clone(), backing.clone(), clock(), &cfg);
        let after = if switch.has_crashed() {
            drop(formatted);
            CrashMedium::from_image(medium.crash_image().unwrap(), CrashSwitch::new(), point)
        } else {
            drop(formatted.unwrap());
            finished = true;
            medium
        };
        match Engine::open(after, backing.clone(), clock(), &cfg) {
            Ok((engine, report)) => {
                assert_eq!((report.clean, report.dirty, report.torn, report.corrupt), (0, 0, 0, 0));
                let mut buf = vec![0u8; BLOCK];
                engine.lane().unwrap().read(0, &mut buf).unwrap();
                assert_ne!(buf, block_of(0x42), "cut at {point}: an old dirty block came back");
            }
            // No cache: the header is zeroed, or the new one half written.
            Err(Error::Format(err)) => assert!(
                !finished
                    && matches!(
                        err,
                        FormatError::BadMagic { .. }
                            | FormatError::UnsupportedVersion { .. }
                            | FormatError::BadChecksum { .. }
                    ),
                "cut at {point}: {err}"
            ),
            Err(err) => panic!("cut at {point}: {err}"),
        }
        if finished {
            break;
        }
    }
}

/// Formatting a medium full of garbage leaves every metadata entry free, also when the table
/// spans more than one of the megabyte chunks it is zeroed in.
#[test]
fn formatting_a_medium_full_of_garbage_leaves_every_entry_free() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = dir.path().join("pm");
    // 100,000 slots: 1.6 MB of metadata entries.
    let medium_bytes = 8192 + 100_000 * (16 + BLOCK as u64) + 4096;
    std::fs::write(&path, vec![0xff; medium_bytes as usize]).unwrap();
    let medium = PmemFile::open(&path, None).unwrap();
    let backing = SimBacking::new(BLOCKS * BLOCK as u64, CrashSwitch::new(), 4);
    let engine = Engine::format(medium, backing, clock(), &config(CacheMode::WriteBack)).unwrap();
    let slots = engine.superblock().geometry.slot_count;
    assert!(slots * 16 > 1 << 20, "{slots} slots");
    drop(engine);
    let report = pmcache_engine::check_medium(&PmemFile::open(&path, None).unwrap()).unwrap();
    assert_eq!((report.free, report.corrupt, report.torn), (slots, 0, 0), "{report:?}");
}

#[test]
fn every_corruption_of_the_superblock_is_refused_with_a_precise_error() {
    let (medium, backing) = parts();
    Engine::format(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
        .unwrap();
    let mut header = vec![0u8; 128];
    medium.read(0, &mut header);
    for at in 0..128 {
        let mut bad = header.clone();
        bad[at] ^= 0x01;
        medium.write(0, &bad);
        let err = open(&medium, &backing).expect_err("corrupt superblock accepted");
        assert!(matches!(err, Error::Format(_)), "byte {at}: {err}");
    }
    medium.write(0, &header);
    assert!(open(&medium, &backing).is_ok());
    // A corrupt shutdown word.
    medium.store_u64(256, 0x1234);
    let err = open(&medium, &backing).unwrap_err();
    assert!(matches!(err, Error::Format(FormatError::BadShutdownWord(0x1234))), "{err}");
    // An unformatted medium.
    let (blank, _) = parts();
    let err = open(&blank, &backing).unwrap_err();
    assert!(err.to_string().contains("no pmcache superblock"), "{err}");
}

#[test]
fn another_backing_store_is_refused() {
    let (medium, backing) = parts();
    Engine::format(medium.clone(), backing, clock(), &config(CacheMode::WriteBack)).unwrap();
    let other = SimBacking::new(2 * BLOCKS * BLOCK as u64, CrashSwitch::new(), 3);
    let err = open(&medium, &other).unwrap_err();
    assert!(err.to_string().contains("belongs to another backing store"), "{err}");
}

/// A medium too small to hold even the superblock's header: a precise error from attaching
/// and from the read-only check, not an out-of-bounds read.
#[test]
fn a_medium_smaller_than_a_superblock_is_refused() {
    for len_bytes in [64, 120, 128] {
        let medium = CrashMedium::new(len_bytes, CrashSwitch::new(), 1);
        let backing = SimBacking::new(BLOCKS * BLOCK as u64, CrashSwitch::new(), 4);
        let err = Engine::open(medium.clone(), backing, clock(), &config(CacheMode::WriteBack))
            .map(|_| ())
            .unwrap_err();
        let expected = if len_bytes < 128 { "smaller than a superblock" } else { "magic" };
        assert!(err.to_string().contains(expected), "{len_bytes} bytes: {err}");
        let err = pmcache_engine::check_medium(&medium).unwrap_err();
        assert!(err.to_string().contains(expected), "{len_bytes} bytes: {err}");
    }
}

#[test]
fn a_truncated_medium_file_is_refused() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = dir.path().join("pm");
    let backing = SimBacking::new(BLOCKS * BLOCK as u64, CrashSwitch::new(), 4);
    let medium = PmemFile::open(&path, Some(1 << 20)).unwrap();
    Engine::format(medium, backing.clone(), clock(), &config(CacheMode::WriteBack)).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(1 << 19).unwrap();
    let medium = PmemFile::open(&path, None).unwrap();
    let err = Engine::open(medium, backing, clock(), &config(CacheMode::WriteBack))
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn corrupt_metadata_entries_are_dropped_and_reported_never_trusted() {
    let (medium, backing) = parts();
    let engine =
        Engine::format(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
            .unwrap();
    {
        let mut lane = engine.lane().unwrap();
        for b in 0..20u64 {
            lane.write(b * BLOCK as u64, &block_of(b as u8 + 1), false).unwrap();
        }
        lane.drain().unwrap();
    }
    engine.shutdown().unwrap();
    // Corrupt the entries of slots 0..5: flip bits in word 0 (block number / state / check).
    for slot in 0..5u64 {
        let at = SUPERBLOCK_BYTES + slot * 16;
        let word = medium.load_u64(at);
        medium.store_u64(at, word ^ (1 << (slot * 7 % 40)));
    }
    let (engine, report) =
        Engine::open(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
            .unwrap();
    assert_eq!(report.corrupt, 5, "{report:?}");
    assert_eq!(report.clean, 15, "{report:?}");
    // Every block still reads its data: the dropped ones from the backing store.
    let mut lane = engine.lane().unwrap();
    let mut buf = vec![0u8; BLOCK];
    for b in 0..20u64 {
        lane.read(b * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(buf, block_of(b as u8 + 1), "block {b}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: pmcache_engine::testing::proptest_cases(300),
        ..ProptestConfig::default()
    })]

    /// Random garbage anywhere in the metadata table never panics recovery, and the blocks
    /// whose entries survive read back correctly.
    #[test]
    fn garbage_metadata_never_panics(garbage in prop::collection::vec((0u64..32 * 16 / 8, any::<u64>()), 1..20)) {
        let (medium, backing) = parts();
        let engine = Engine::format(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack)).unwrap();
        {
            let mut lane = engine.lane().unwrap();
            for b in 0..24u64 {
                lane.write(b * BLOCK as u64, &block_of(b as u8 + 1), false).unwrap();
            }
            lane.drain().unwrap();
        }
        drop(engine);
        for (word, value) in garbage {
            medium.store_u64(SUPERBLOCK_BYTES + word * 8, value);
        }
        let (engine, _report) = Engine::open(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack)).unwrap();
        let mut lane = engine.lane().unwrap();
        let mut buf = vec![0u8; BLOCK];
        for b in 0..64u64 {
            lane.read(b * BLOCK as u64, &mut buf).unwrap();
            if b < 24 {
                // Garbage entries that happen to validate as a block would be caught here:
                // the 12-bit check and the sequence low byte make that vanishingly rare.
                prop_assert_eq!(&buf, &block_of(b as u8 + 1), "block {}", b);
            }
        }
    }
}

#[test]
fn a_failing_backing_store_gives_eio_and_loses_nothing_acknowledged() {
    for mode in CacheMode::ALL {
        let (medium, backing) = parts();
        let engine =
            Engine::format(medium.clone(), backing.clone(), clock(), &config(mode)).unwrap();
        let mut lane = engine.lane().unwrap();
        for b in 0..8u64 {
            lane.write(b * BLOCK as u64, &block_of(b as u8 + 1), true).unwrap();
        }
        backing.fail_writes_from(0);
        backing.fail_reads_from(0);
        // Write more blocks than the cache holds: write-back must eventually write back, which
        // fails; other modes write the backing store directly, which fails.
        let mut failures = 0;
        for b in 8..64u64 {
            if let Err(err) = lane.write(b * BLOCK as u64, &block_of(0xee), false) {
                assert_eq!(err.errno(), 5, "{mode}: {err}");
                failures += 1;
            }
        }
        assert!(failures > 0, "{mode}: the failing backing store was never noticed");
        backing.heal();
        // The server keeps serving, and the first 8 acknowledged (FUA) writes are intact.
        let mut buf = vec![0u8; BLOCK];
        for b in 0..8u64 {
            lane.read(b * BLOCK as u64, &mut buf).unwrap();
            assert_eq!(buf, block_of(b as u8 + 1), "{mode}: block {b} after backing errors");
        }
        lane.drain().unwrap();
        let contents = backing.contents();
        for b in 0..8usize {
            assert_eq!(
                &contents[b * BLOCK..(b + 1) * BLOCK],
                &block_of(b as u8 + 1)[..],
                "{mode}: backing block {b}"
            );
        }
    }
}

/// Writes acknowledged by an earlier process of the cache, which stopped without a clean
/// shutdown (so without syncing the backing store), may still be in the backing store's
/// volatile cache: the first flush after the next attach must sync them, though this process
/// wrote nothing. A flush that skipped the sync (no write of its own since attach) would let a
/// power cut after it lose the writes (`crash.rs`'s runs with backing faults, whose segments
/// end with such an attach, reach this too).
#[test]
fn the_first_flush_after_an_attach_syncs_what_an_earlier_process_wrote() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround, CacheMode::PassThrough] {
        let (medium, backing) = parts();
        let engine = Engine::format(medium.clone(), backing.clone(), clock(), &config(mode))
            .expect("format");
        engine.lane().unwrap().write(3 * BLOCK as u64, &block_of(7), false).expect("write");
        drop(engine); // the process stops: no shutdown, no sync
        let (engine, _) =
            Engine::open(medium.clone(), backing.clone(), clock(), &config(mode)).expect("attach");
        let flushes_before = backing.flushes();
        engine.lane().unwrap().flush().expect("flush");
        assert_eq!(backing.flushes(), flushes_before + 1, "{mode}: the flush synced nothing");
        let durable = backing.durable_contents();
        assert_eq!(&durable[3 * BLOCK..4 * BLOCK], &block_of(7)[..], "{mode}: not durable");
    }
}

#[test]
fn requests_past_the_end_are_refused() {
    let (medium, backing) = parts();
    let engine = Engine::format(medium, backing, clock(), &config(CacheMode::WriteBack)).unwrap();
    let mut lane = engine.lane().unwrap();
    let end = BLOCKS * BLOCK as u64;
    let err = lane.write(end - 10, &[0u8; 20], false).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }) && err.errno() == 22, "{err}");
    assert!(lane.read(u64::MAX - 4, &mut [0u8; 8]).is_err());
    assert!(lane.trim(end, 1).is_err());
    lane.read(end - 8, &mut [0u8; 8]).unwrap();
}

#[test]
fn too_many_lanes_is_an_error_not_a_hang() {
    let (medium, backing) = parts();
    let engine = Engine::format(medium, backing, clock(), &config(CacheMode::WriteBack)).unwrap();
    let _a = engine.lane().unwrap();
    let _b = engine.lane().unwrap();
    assert!(matches!(engine.lane(), Err(Error::TooManyLanes { max_lanes: 2 })));
}

#[test]
fn check_reports_what_recovery_will_find_without_changing_the_medium() {
    let (medium, backing) = parts();
    let engine =
        Engine::format(medium.clone(), backing.clone(), clock(), &config(CacheMode::WriteBack))
            .unwrap();
    {
        let mut lane = engine.lane().unwrap();
        for b in 0..6u64 {
            lane.write(b * BLOCK as u64, &block_of(1), false).unwrap();
        }
        lane.drain().unwrap();
        for b in 0..2u64 {
            lane.write(b * BLOCK as u64, &block_of(2), false).unwrap();
        }
    }
    drop(engine);
    let at = SUPERBLOCK_BYTES + 10 * 16;
    medium.store_u64(at, 0xdead_beef_0000_0001);
    let before = medium.durable_image();
    let report = pmcache_engine::check_medium(&medium).unwrap();
    assert_eq!((report.clean, report.dirty, report.corrupt), (4, 2, 1), "{report:?}");
    assert!(!report.was_clean_shutdown);
    assert_eq!(medium.durable_image(), before, "check changed the medium");
    let (_, recovered) =
        Engine::open(medium, backing, clock(), &config(CacheMode::WriteBack)).unwrap();
    assert_eq!((recovered.clean, recovered.dirty, recovered.corrupt), (4, 2, 1));
}

/// Misses by kind, and the sequential cutoff applied only when the cache is short of room: a
/// stream read into free slots evicts nothing and is cached whole; once the cache is full, a
/// stream's part past the cutoff bypasses it.
#[test]
fn misses_are_counted_by_kind() {
    let (medium, backing) = parts();
    let mut cfg = config(CacheMode::WriteBack);
    cfg.admission = AdmissionConfig::SequentialCutoff { cutoff_bytes: 4 * BLOCK as u64 };
    let engine = Engine::format(medium, backing, clock(), &cfg).unwrap();
    let slots = engine.superblock().geometry.slot_count;
    assert!(slots <= 32 && slots > 16, "the test's stream fits, its writes overfill: {slots}");
    let mut lane = engine.lane().unwrap();
    let mut buf = vec![0u8; BLOCK];
    // A sequential stream of 16 blocks into an empty cache: every block admitted.
    for b in 0..16u64 {
        lane.read(b * BLOCK as u64, &mut buf).unwrap();
    }
    let stats = engine.stats();
    assert_eq!((stats.read_misses_admitted, stats.read_misses_sequential), (16, 0), "{stats:?}");
    lane.read(5 * BLOCK as u64, &mut buf).unwrap();
    assert_eq!(engine.stats().read_hits, 1, "the stream's blocks are cached");
    // Writes of more blocks than the cache holds leave no slot free.
    for b in 40..64u64 {
        lane.write(b * BLOCK as u64, &block_of(b as u8), false).unwrap();
    }
    // A second stream, of blocks never read: the first 4 admitted, the 12 past the cutoff not.
    for b in 20..36u64 {
        lane.read(b * BLOCK as u64, &mut buf).unwrap();
    }
    let stats = engine.stats();
    assert_eq!((stats.read_misses_admitted, stats.read_misses_sequential), (20, 12), "{stats:?}");
    // Pass-through does not admit.
    engine.set_mode(CacheMode::PassThrough);
    lane.read(38 * BLOCK as u64, &mut buf).unwrap();
    let stats = engine.stats();
    assert_eq!(stats.read_misses_bypassed, 1, "{stats:?}");
}

/// The aim for the engine's DRAM (index, slot words, free-slot bitmap, stripes,
/// lanes): at most 16 bytes per slot, at the scale `pmcache bench core` reports it (1 M slots
/// of 4 KiB, 64 lanes; the medium is a sparse file in /dev/shm). The index alone, one 8-byte
/// entry per slot at its 75 % load, and the 4-byte slot word are 14.7 bytes: a figure below
/// that would leave a table out.
#[test]
fn a_million_slots_take_at_most_16_bytes_of_dram_each() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let slots = 1u64 << 20;
    let medium_bytes = (SUPERBLOCK_BYTES + slots * 16).next_multiple_of(4096) + slots * 4096;
    let medium = PmemFile::open(&dir.path().join("pm"), Some(medium_bytes)).unwrap();
    let backing = SimBacking::new(BLOCKS * 4096, CrashSwitch::new(), 5);
    let config = Config { block_size: 4096, max_lanes: 64, ..config(CacheMode::WriteBack) };
    let engine = Engine::format(medium, backing, clock(), &config).unwrap();
    let stats = engine.stats();
    assert_eq!(stats.slot_count, slots);
    assert!(
        (4.0 + 8.0 / 0.75..=16.0).contains(&stats.dram_bytes_per_slot),
        "{} bytes of DRAM per slot",
        stats.dram_bytes_per_slot
    );
}

/// A backing store that only has a size: for the limits on backing stores too large to hold.
struct SizedBacking(u64);

impl pmcache_backing::BackingStore for SizedBacking {
    fn size_bytes(&self) -> u64 {
        self.0
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn identity(&self) -> pmcache_backing::BackingIdentity {
        pmcache_backing::BackingIdentity { size_bytes: self.0, fingerprint: [3; 16], instance: 0 }
    }
    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> pmcache_backing::Result<()> {
        unreachable!("nothing is read")
    }
    fn write_at(&self, _data: &[u8], _offset: u64) -> pmcache_backing::Result<()> {
        unreachable!("nothing is written")
    }
    fn flush(&self) -> pmcache_backing::Result<()> {
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> pmcache_backing::Result<()> {
        unreachable!("nothing is discarded")
    }
    fn write_zeroes(&self, _offset: u64, _len: u64) -> pmcache_backing::Result<()> {
        unreachable!("nothing is zeroed")
    }
}

/// Configurations and backing stores a cache cannot serve are refused with a message that
/// names the limit, each on its boundary: a backing store that is empty or not a whole number
/// of cache blocks, one of more than 2^40 blocks (block numbers have 40 bits), no lanes, or
/// fewer than 4 slots per lane. A refused format writes nothing: the medium (here holding an
/// old cache's bytes) is left as it was, not formatted before the refusal.
#[test]
fn caches_that_cannot_serve_are_refused_at_their_limits() {
    fn format_with(backing_bytes: u64, max_lanes: usize) -> pmcache_engine::Result<u64> {
        let (medium, _) = parts();
        let old: Vec<u8> = (0..MEDIUM_BYTES).map(|i| (i * 7 + 1) as u8).collect();
        medium.write(0, &old);
        medium.persist(0, MEDIUM_BYTES);
        let config = Config { max_lanes, ..config(CacheMode::WriteBack) };
        let formatted =
            Engine::format(medium.clone(), SizedBacking(backing_bytes), clock(), &config)
                .map(|engine| engine.superblock().geometry.slot_count);
        if formatted.is_err() {
            let mut now = vec![0u8; MEDIUM_BYTES as usize];
            medium.read(0, &mut now);
            assert!(now == old, "a refused format changed the medium");
        }
        formatted
    }
    fn refused(result: pmcache_engine::Result<u64>, needle: &str) {
        match result {
            Err(Error::Config(message)) => {
                assert!(message.contains(needle), "{message:?} does not say {needle:?}")
            }
            other => panic!("accepted or refused otherwise ({needle}): {other:?}"),
        }
    }
    let block = BLOCK as u64;
    let slots = format_with(BLOCKS * block, 1).expect("a cache that can serve");
    refused(format_with(0, 1), "not a non-zero multiple of the 512-byte cache block");
    refused(format_with(BLOCKS * block + 8, 1), "not a non-zero multiple");
    assert!(format_with(block, 1).is_ok(), "one block");
    let max_blocks = pmcache_engine::format::MAX_BACKING_BLOCKS;
    assert!(format_with(max_blocks * block, 1).is_ok(), "2^40 blocks");
    refused(format_with((max_blocks + 1) * block, 1), "at most 2^40");
    refused(format_with(BLOCKS * block, 0), "at least one lane");
    let lanes_max = (slots / 4) as usize;
    assert!(format_with(BLOCKS * block, lanes_max).is_ok(), "{lanes_max} lanes, {slots} slots");
    refused(format_with(BLOCKS * block, lanes_max + 1), "need 4 slots per lane");
}
