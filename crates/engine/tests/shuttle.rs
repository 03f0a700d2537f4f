//! Shuttle (randomised scheduler) tests of the slot/index protocol, running the production
//! engine with its atomics and locks routed through shuttle (`--features shuttle`): a lock-free
//! reader, a writer and an evictor working on the same block must never let the reader see a
//! torn block, a recycled slot's data, or a version older than one it has already seen.
#![cfg(feature = "shuttle")]

use std::sync::Arc;

use pmcache_backing::{BackingIdentity, BackingStore};
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, EvictionKind, ManualClock, ReadRequest,
    WriteRequest,
};
use pmcache_media::Medium;
use shuttle::sync::Mutex;
use shuttle::sync::atomic::{AtomicU64, Ordering};

const BLOCK: usize = 512;
const SLOTS_BYTES: u64 = 8192 + 16 * BLOCK as u64;

/// Schedules explored per test: 3,000 in CI, `PMCACHE_SHUTTLE_ITERATIONS` for a longer
/// campaign. A failing schedule is printed by shuttle for replay.
fn iterations() -> usize {
    std::env::var("PMCACHE_SHUTTLE_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(3000)
}

/// A medium whose every word access is a shuttle scheduling point.
struct ShuttleMedium {
    words: Vec<AtomicU64>,
}

impl Medium for ShuttleMedium {
    fn len_bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }
    fn read(&self, offset: u64, buf: &mut [u8]) {
        assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
        for (i, chunk) in buf.chunks_mut(8).enumerate() {
            let word = self.words[offset as usize / 8 + i].load(Ordering::Relaxed);
            chunk.copy_from_slice(&word.to_le_bytes());
        }
    }
    fn write(&self, offset: u64, data: &[u8]) {
        assert!(offset.is_multiple_of(8) && data.len().is_multiple_of(8));
        for (i, chunk) in data.chunks(8).enumerate() {
            let word = u64::from_le_bytes(chunk.try_into().unwrap());
            self.words[offset as usize / 8 + i].store(word, Ordering::Relaxed);
        }
    }
    fn load_u64(&self, offset: u64) -> u64 {
        self.words[offset as usize / 8].load(Ordering::Acquire)
    }
    fn store_u64(&self, offset: u64, value: u64) {
        self.words[offset as usize / 8].store(value, Ordering::Release)
    }
    fn flush(&self, _offset: u64, _len: u64) {}
    fn drain(&self) {}
}

struct ShuttleBacking {
    bytes: Mutex<Vec<u8>>,
}

impl BackingStore for ShuttleBacking {
    fn size_bytes(&self) -> u64 {
        self.bytes.lock().unwrap().len() as u64
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn identity(&self) -> BackingIdentity {
        BackingIdentity { size_bytes: self.size_bytes(), fingerprint: [1; 16] }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> pmcache_backing::Result<()> {
        let bytes = self.bytes.lock().unwrap();
        buf.copy_from_slice(&bytes[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, data: &[u8], offset: u64) -> pmcache_backing::Result<()> {
        let mut bytes = self.bytes.lock().unwrap();
        bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> pmcache_backing::Result<()> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        self.write_at(&vec![0; len as usize], offset)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        self.write_at(&vec![0; len as usize], offset)
    }
}

fn stamp(version: u64) -> Vec<u8> {
    (0..BLOCK / 8).flat_map(|_| version.to_le_bytes()).collect()
}

/// Decodes a block that must be one whole version.
fn version_of(block: &[u8]) -> u64 {
    let first = u64::from_le_bytes(block[..8].try_into().unwrap());
    assert!(
        block.chunks(8).all(|w| u64::from_le_bytes(w.try_into().unwrap()) == first),
        "torn block: starts with version {first}"
    );
    first
}

type ShuttleEngine = Engine<ShuttleMedium, ShuttleBacking, Arc<ManualClock>>;

/// A fresh cache of 16 slots in `mode` (admitting every read miss) over `backing`.
fn engine(mode: CacheMode, backing: Vec<u8>) -> Arc<ShuttleEngine> {
    let medium = ShuttleMedium { words: (0..SLOTS_BYTES / 8).map(|_| AtomicU64::new(0)).collect() };
    let backing = ShuttleBacking { bytes: Mutex::new(backing) };
    let config = Config {
        mode,
        block_size: BLOCK as u32,
        max_lanes: 3,
        admission: AdmissionConfig::Always,
        eviction: EvictionKind::Clock,
        index_buckets: None,
    };
    Arc::new(Engine::format(medium, backing, Arc::new(ManualClock::default()), &config).unwrap())
}

fn scenario(mode: CacheMode) {
    scenario_with(mode, false)
}

/// With `batched`, the writer group-commits block 0 together with block 40, the evictor fills
/// the cache in batches of four, and the reader reads blocks 0 and 40 as one batch.
fn scenario_with(mode: CacheMode, batched: bool) {
    let engine = engine(mode, vec![0; 64 * BLOCK]);
    // Block 0 starts at version 1 in the cache.
    engine.lane().unwrap().write(0, &stamp(1), false).unwrap();

    let writer = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut lane = engine.lane().unwrap();
            for version in 2..=3 {
                if batched {
                    let data = stamp(version);
                    let writes = [0, 40 * BLOCK as u64].map(|offset| WriteRequest {
                        offset,
                        data: &data,
                        fua: false,
                    });
                    let mut outcomes = Vec::new();
                    lane.write_batch(&writes, &mut outcomes);
                    outcomes.into_iter().for_each(|o| o.unwrap());
                } else {
                    lane.write(0, &stamp(version), false).unwrap();
                }
            }
        })
    };
    let evictor = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            // Fill the cache with other blocks so block 0's slots are evicted and recycled,
            // and write everything back.
            let mut lane = engine.lane().unwrap();
            if batched {
                for first in (1..21u64).step_by(4) {
                    let datas: Vec<Vec<u8>> = (first..first + 4).map(|l| stamp(100 + l)).collect();
                    let writes: Vec<WriteRequest<'_>> = (first..first + 4)
                        .zip(&datas)
                        .map(|(lba, data)| WriteRequest {
                            offset: lba * BLOCK as u64,
                            data,
                            fua: false,
                        })
                        .collect();
                    let mut outcomes = Vec::new();
                    lane.write_batch(&writes, &mut outcomes);
                    outcomes.into_iter().for_each(|o| o.unwrap());
                }
            } else {
                for lba in 1..20u64 {
                    lane.write(lba * BLOCK as u64, &stamp(100 + lba), false).unwrap();
                }
            }
            lane.drain().unwrap();
        })
    };
    let mut lane = engine.lane().unwrap();
    let mut last = 0;
    let mut last_40 = 0;
    for _ in 0..4 {
        let mut buf = vec![0u8; BLOCK];
        if batched {
            let mut buf_40 = vec![0u8; BLOCK];
            let mut reads = [
                ReadRequest { offset: 0, buf: &mut buf },
                ReadRequest { offset: 40 * BLOCK as u64, buf: &mut buf_40 },
            ];
            let mut outcomes = Vec::new();
            lane.read_batch(&mut reads, &mut outcomes);
            outcomes.into_iter().for_each(|o| o.unwrap());
            let version = version_of(&buf_40);
            assert!([0, 2, 3].contains(&version), "block 40: version {version}");
            assert!(version >= last_40, "block 40 went back in time: {last_40} then {version}");
            last_40 = version;
        } else {
            lane.read(0, &mut buf).unwrap();
        }
        let version = version_of(&buf);
        assert!((1..=3).contains(&version), "read a recycled slot: version {version}");
        assert!(version >= last, "went back in time: {last} then {version}");
        last = version;
    }
    drop(lane);
    writer.join().unwrap();
    evictor.join().unwrap();
    let mut buf = vec![0u8; BLOCK];
    engine.lane().unwrap().read(0, &mut buf).unwrap();
    assert_eq!(version_of(&buf), 3);
    if batched {
        engine.lane().unwrap().read(40 * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(version_of(&buf), 3);
    }
}

#[test]
fn reader_writer_evictor_write_back() {
    shuttle::check_random(|| scenario(CacheMode::WriteBack), iterations());
}

#[test]
fn reader_writer_evictor_write_through() {
    shuttle::check_random(|| scenario(CacheMode::WriteThrough), iterations());
}

#[test]
fn reader_writer_evictor_write_back_pct() {
    shuttle::check_pct(|| scenario(CacheMode::WriteBack), iterations(), 3);
}

#[test]
fn batched_reader_writer_evictor_write_back() {
    shuttle::check_random(|| scenario_with(CacheMode::WriteBack, true), iterations());
}

#[test]
fn batched_reader_writer_evictor_write_back_pct() {
    shuttle::check_pct(|| scenario_with(CacheMode::WriteBack, true), iterations(), 3);
}

/// A reader meets a block that another lane is admitting on a read miss. The block's index
/// entry is hidden while its slot is filled, so the reader must take the locked path and see
/// the whole block, never the slot half filled. With `batched`, it reads through `read_batch`,
/// whose lock-free pass must skip hidden entries as `read` does. The first read starts
/// `first_in_block` bytes into the block and runs to its end.
fn admission_scenario(batched: bool, first_in_block: usize) {
    let mut backing = vec![0; 64 * BLOCK];
    backing[5 * BLOCK..6 * BLOCK].copy_from_slice(&stamp(7));
    let engine = engine(CacheMode::WriteBack, backing);
    let admitter = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut buf = vec![0u8; BLOCK];
            engine.lane().unwrap().read(5 * BLOCK as u64, &mut buf).unwrap();
            assert_eq!(version_of(&buf), 7, "the admitting read");
        })
    };
    let mut lane = engine.lane().unwrap();
    for i in 0..3 {
        let in_block = if i == 0 { first_in_block } else { 0 };
        let offset = (5 * BLOCK + in_block) as u64;
        let mut buf = vec![0u8; BLOCK - in_block];
        if batched {
            let mut reads = [ReadRequest { offset, buf: &mut buf }];
            let mut outcomes = Vec::new();
            lane.read_batch(&mut reads, &mut outcomes);
            outcomes.into_iter().for_each(|o| o.unwrap());
        } else {
            lane.read(offset, &mut buf).unwrap();
        }
        assert_eq!(version_of(&buf), 7, "a read beside the admission");
    }
    drop(lane);
    admitter.join().unwrap();
    assert!(engine.stats().read_misses_admitted >= 1);
}

#[test]
fn reader_beside_a_read_miss_admission() {
    shuttle::check_pct(|| admission_scenario(false, 0), iterations(), 3);
}

#[test]
fn batched_reader_beside_a_read_miss_admission() {
    shuttle::check_pct(|| admission_scenario(true, 0), iterations(), 3);
}

/// The reader's first read takes the block's second half only: a hit found under the lock
/// must honour the offset into the block.
#[test]
fn partial_reader_beside_a_read_miss_admission() {
    shuttle::check_pct(|| admission_scenario(false, BLOCK / 2), iterations(), 3);
}
