//! Queued read misses: a batch's misses go to a real backing file through the lane's io_uring
//! queue together, each is served and admitted as a single miss would be, and a batch mixing
//! hits, misses, a repeated block, a read across blocks and one out of range gets every
//! result right and in order. A writer overwriting the blocks meanwhile never lets a stale
//! block into the cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use pmcache_backing::{BackingStore, EngineKind, EngineOptions, open_backing};
use pmcache_engine::{AdmissionConfig, Config, Engine, MonotonicClock, ReadRequest};
use pmcache_media::PmemFile;

const BLOCK: usize = 4096;
const BLOCKS: u64 = 2048;

type FileEngine = Engine<PmemFile, Arc<dyn BackingStore>, MonotonicClock>;

/// The version-`v` contents of block `lba`: every 8-byte word holds `(lba << 32) | v`.
fn pattern(lba: u64, version: u64) -> Vec<u8> {
    let word = (lba << 32) | version;
    (0..BLOCK / 8).flat_map(|_| word.to_le_bytes()).collect()
}

/// The (block, version) a block's bytes hold; panics on a torn block.
fn decode(data: &[u8]) -> (u64, u64) {
    let first = u64::from_le_bytes(data[..8].try_into().unwrap());
    assert!(
        data.chunks(8).all(|w| u64::from_le_bytes(w.try_into().unwrap()) == first),
        "torn block starting with {first:#x}"
    );
    (first >> 32, first & 0xffff_ffff)
}

/// A write-back cache of 256 slots on a medium in /dev/shm, over a backing file (io_uring,
/// O_DIRECT where the file system takes it) holding version 1 of every block.
fn engine_in(dir: &Path, lanes: usize) -> FileEngine {
    let backing_path = dir.join("backing");
    let image: Vec<u8> = (0..BLOCKS).flat_map(|lba| pattern(lba, 1)).collect();
    std::fs::write(&backing_path, image).unwrap();
    let direct = EngineOptions::new(EngineKind::IoUring, true);
    let store = open_backing(&backing_path, &direct)
        .or_else(|_| open_backing(&backing_path, &EngineOptions::new(EngineKind::IoUring, false)))
        .expect("an io_uring backing store");
    // The medium in /dev/shm (emulated PM; a file on a disk file system is refused), mapped
    // and then unlinked: the mapping keeps it for as long as the engine lives.
    static MEDIA: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = MEDIA.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let medium_path =
        PathBuf::from(format!("/dev/shm/pmcache-misses-{}-{n}.pm", std::process::id()));
    let medium =
        PmemFile::open(&medium_path, Some(8192 + 256 * BLOCK as u64 + 65536)).expect("medium");
    std::fs::remove_file(&medium_path).expect("unlink the mapped medium");
    let config = Config {
        block_size: BLOCK as u32,
        max_lanes: lanes,
        admission: AdmissionConfig::Always,
        ..Config::default()
    };
    Engine::format(medium, store, MonotonicClock::default(), &config).unwrap()
}

fn tempdir() -> tempfile::TempDir {
    // On a disk where there is one (the queue then really waits for the device).
    tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir()).unwrap()
}

#[test]
fn a_batch_of_misses_is_read_and_admitted_together() {
    let dir = tempdir();
    let engine = engine_in(dir.path(), 2);
    let mut lane = engine.lane().unwrap();
    let blocks: Vec<u64> = (0..32).map(|i| i * 7 % BLOCKS).collect();
    let mut bufs = vec![vec![0u8; BLOCK]; blocks.len()];
    let mut reads: Vec<ReadRequest<'_>> = blocks
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&lba, buf)| ReadRequest { offset: lba * BLOCK as u64, buf })
        .collect();
    let mut outcomes = Vec::new();
    lane.read_batch(&mut reads, &mut outcomes);
    assert_eq!(outcomes.len(), blocks.len());
    outcomes.iter().for_each(|o| assert!(o.is_ok(), "{o:?}"));
    drop(reads);
    for (&lba, buf) in blocks.iter().zip(&bufs) {
        assert_eq!(decode(buf), (lba, 1), "block {lba}");
    }
    let stats = engine.stats();
    assert_eq!(stats.read_misses_admitted, blocks.len() as u64, "{stats:?}");
    assert_eq!(stats.read_hits, 0);
    // Admitted: read again, every block is a hit from the cache.
    let mut reads: Vec<ReadRequest<'_>> = blocks
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&lba, buf)| ReadRequest { offset: lba * BLOCK as u64, buf })
        .collect();
    lane.read_batch(&mut reads, &mut outcomes);
    outcomes.iter().for_each(|o| assert!(o.is_ok(), "{o:?}"));
    assert_eq!(engine.stats().read_hits, blocks.len() as u64);
    drop(lane);
    engine.audit().unwrap();
}

#[test]
fn a_mixed_batch_gets_each_result_in_order() {
    let dir = tempdir();
    let engine = engine_in(dir.path(), 2);
    let mut lane = engine.lane().unwrap();
    // Block 3 cached (a hit), block 5 rewritten in the cache (version 2).
    let mut buf = vec![0u8; BLOCK];
    lane.read(3 * BLOCK as u64, &mut buf).unwrap();
    lane.write(5 * BLOCK as u64, &pattern(5, 2), false).unwrap();
    let size = engine.size_bytes();
    // (offset, len): misses, a hit, a dirty block, the same block twice, a read across two
    // blocks, a partial block, and one beyond the end.
    let plan: Vec<(u64, usize)> = vec![
        (10 * BLOCK as u64, BLOCK),
        (3 * BLOCK as u64, BLOCK),
        (11 * BLOCK as u64, BLOCK),
        (5 * BLOCK as u64, BLOCK),
        (12 * BLOCK as u64, BLOCK),
        (12 * BLOCK as u64, BLOCK),
        (20 * BLOCK as u64 + 2048, BLOCK),
        (30 * BLOCK as u64 + 512, 1024),
        (size, BLOCK),
        (13 * BLOCK as u64, BLOCK),
    ];
    let mut bufs: Vec<Vec<u8>> = plan.iter().map(|&(_, len)| vec![0u8; len]).collect();
    let mut reads: Vec<ReadRequest<'_>> = plan
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, _), buf)| ReadRequest { offset, buf })
        .collect();
    let mut outcomes = Vec::new();
    lane.read_batch(&mut reads, &mut outcomes);
    drop(reads);
    assert_eq!(outcomes.len(), plan.len());
    for (i, ((offset, len), outcome)) in plan.iter().zip(&outcomes).enumerate() {
        if *offset == size {
            assert!(outcome.is_err(), "read {i} beyond the end succeeded");
            continue;
        }
        assert!(outcome.is_ok(), "read {i}: {outcome:?}");
        // Compare with the expected bytes: version 2 for block 5, 1 elsewhere.
        let mut expected = Vec::new();
        let first = offset / BLOCK as u64;
        let last = (offset + *len as u64 - 1) / BLOCK as u64;
        for lba in first..=last {
            expected.extend(pattern(lba, if lba == 5 { 2 } else { 1 }));
        }
        let at = (offset % BLOCK as u64) as usize;
        assert_eq!(bufs[i], expected[at..at + len], "read {i} at {offset}");
    }
    drop(lane);
    engine.audit().unwrap();
}

/// A writer overwrites blocks (write-back) and drains them to the backing file while a reader
/// reads them in batches of misses: every read is a whole version no older than the one
/// before it, and at the end the cache serves the newest version of every block — a miss read
/// before an overwrite never lands in the cache over it.
#[test]
fn misses_beside_a_writer_never_admit_stale_data() {
    reads_beside_a_writer(1);
}

/// The same with reads of several blocks (`cache/spans.rs`): reads of 2 and of 4 blocks, each
/// one backing read, their blocks cached, dirty, written back and evicted by the writer while
/// the reads are in flight.
#[test]
fn spans_beside_a_writer_never_serve_or_admit_stale_data() {
    reads_beside_a_writer(2);
    reads_beside_a_writer(4);
}

/// Batches of 16 blocks read `blocks_per_read` blocks a request beside a writer (see above).
fn reads_beside_a_writer(blocks_per_read: u64) {
    let dir = tempdir();
    let engine = engine_in(dir.path(), 3);
    let stop = AtomicBool::new(false);
    // Four times the cache: reads keep missing, admissions keep evicting.
    const HOT: u64 = 1024;
    let versions: Vec<std::sync::atomic::AtomicU64> =
        (0..HOT).map(|_| std::sync::atomic::AtomicU64::new(1)).collect();
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut lane = engine.lane().unwrap();
            for round in 2..40u64 {
                for lba in (0..HOT).filter(|l| (l + round) % 3 == 0) {
                    lane.write(lba * BLOCK as u64, &pattern(lba, round), false).unwrap();
                    versions[lba as usize].store(round, Ordering::SeqCst);
                }
                // Write everything back and let eviction drop blocks, so that later reads miss
                // again.
                lane.drain().unwrap();
            }
            stop.store(true, Ordering::SeqCst);
        });
        let mut lane = engine.lane().unwrap();
        let mut seen = vec![0u64; HOT as usize];
        let mut batches = 0;
        while !stop.load(Ordering::SeqCst) || batches < 20 {
            let first = (batches * 16) % HOT;
            let blocks: Vec<u64> = (0..16).map(|i| (first + i) % HOT).collect();
            let floor: Vec<u64> =
                blocks.iter().map(|&l| versions[l as usize].load(Ordering::SeqCst)).collect();
            let per_read = blocks_per_read as usize;
            let mut bufs = vec![vec![0u8; BLOCK * per_read]; blocks.len() / per_read];
            let mut reads: Vec<ReadRequest<'_>> = blocks
                .chunks(per_read)
                .zip(bufs.iter_mut())
                .map(|(lbas, buf)| ReadRequest { offset: lbas[0] * BLOCK as u64, buf })
                .collect();
            let mut outcomes = Vec::new();
            lane.read_batch(&mut reads, &mut outcomes);
            drop(reads);
            assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
            let data = bufs.concat();
            for ((&lba, block), floor) in blocks.iter().zip(data.chunks(BLOCK)).zip(&floor) {
                let (got_lba, version) = decode(block);
                assert_eq!(got_lba, lba);
                assert!(version >= *floor, "block {lba}: version {version} after {floor}");
                assert!(version >= seen[lba as usize], "block {lba} went back in time");
                seen[lba as usize] = version;
            }
            batches += 1;
        }
        writer.join().unwrap();
    });
    let mut lane = engine.lane().unwrap();
    for lba in 0..HOT {
        let mut buf = vec![0u8; BLOCK];
        lane.read(lba * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(decode(&buf), (lba, versions[lba as usize].load(Ordering::SeqCst)));
    }
    drop(lane);
    engine.audit().unwrap();
}
