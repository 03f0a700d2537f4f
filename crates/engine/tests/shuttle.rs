//! Shuttle (randomised scheduler) tests of the slot/index protocol, running the production
//! engine with its atomics and locks routed through shuttle (`--features shuttle`): a lock-free
//! reader, a writer and an evictor working on the same block must never let the reader see a
//! torn block, a recycled slot's data, or a version older than one it has already seen.
#![cfg(feature = "shuttle")]

use std::sync::Arc;

use pmcache_backing::{BackingIdentity, BackingStore};
use pmcache_engine::testing::LateQueue;
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, ManualClock, ReadRequest, ReadStart, WriteRequest,
    WriteStart,
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
    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        self.words[offset as usize / 8]
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
    fn flush(&self, _offset: u64, _len: u64) {}
    fn drain(&self) {}
}

/// A medium whose every access, a whole block's copy included, is followed by one
/// scheduling point: for scenarios about the slot and stripe protocol rather than torn
/// copies, whose schedules are then short enough for PCT to preempt a lane inside a window of
/// a few steps. Only one shuttle thread runs at a time, so plain atomics hold the words.
struct CoarseMedium {
    words: Vec<std::sync::atomic::AtomicU64>,
    /// Loaded after every access: the scheduling point (shuttle switches around it).
    step: AtomicU64,
}

impl CoarseMedium {
    fn word(&self, offset: u64) -> &std::sync::atomic::AtomicU64 {
        &self.words[offset as usize / 8]
    }
    fn step(&self) {
        self.step.load(Ordering::Relaxed);
    }
}

impl Medium for CoarseMedium {
    fn len_bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }
    fn read(&self, offset: u64, buf: &mut [u8]) {
        assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
        for (i, chunk) in buf.chunks_mut(8).enumerate() {
            let word = self.word(offset + 8 * i as u64).load(Ordering::Relaxed);
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        self.step();
    }
    fn write(&self, offset: u64, data: &[u8]) {
        assert!(offset.is_multiple_of(8) && data.len().is_multiple_of(8));
        for (i, chunk) in data.chunks(8).enumerate() {
            let word = u64::from_le_bytes(chunk.try_into().unwrap());
            self.word(offset + 8 * i as u64).store(word, Ordering::Relaxed);
        }
        self.step();
    }
    fn load_u64(&self, offset: u64) -> u64 {
        let value = self.word(offset).load(Ordering::Acquire);
        self.step();
        value
    }
    fn store_u64(&self, offset: u64, value: u64) {
        self.word(offset).store(value, Ordering::Release);
        self.step();
    }
    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        let swapped = self
            .word(offset)
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        self.step();
        swapped
    }
    fn flush(&self, _offset: u64, _len: u64) {}
    fn drain(&self) {}
}

/// The backing store, with a queue that runs each request when it is reaped, not at submit:
/// a miss's completion comes later (the window in which writes race it), and a write lands
/// late, as on a network disk (the window in which a read on another lane sees the old data).
struct ShuttleBacking {
    bytes: Arc<Mutex<Vec<u8>>>,
}

impl BackingStore for ShuttleBacking {
    fn size_bytes(&self) -> u64 {
        self.bytes.lock().unwrap().len() as u64
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn identity(&self) -> BackingIdentity {
        BackingIdentity { size_bytes: self.size_bytes(), fingerprint: [1; 16], instance: 0 }
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
    fn open_queue(
        &self,
        depth: usize,
    ) -> pmcache_backing::Result<Box<dyn pmcache_backing::IoQueue>> {
        let store = ShuttleBacking { bytes: self.bytes.clone() };
        Ok(Box::new(LateQueue::in_order(store, depth)))
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

type ShuttleEngine<M = ShuttleMedium> = Engine<M, ShuttleBacking, Arc<ManualClock>>;

/// A fresh cache of 16 slots in `mode` (admitting every read miss) over `backing`.
fn engine(mode: CacheMode, backing: Vec<u8>) -> Arc<ShuttleEngine> {
    let medium = ShuttleMedium { words: (0..SLOTS_BYTES / 8).map(|_| AtomicU64::new(0)).collect() };
    engine_on(medium, mode, backing)
}

/// [`engine`] on a medium of coarse scheduling points.
fn coarse_engine(mode: CacheMode, backing: Vec<u8>) -> Arc<ShuttleEngine<CoarseMedium>> {
    let words = (0..SLOTS_BYTES / 8).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
    engine_on(CoarseMedium { words, step: AtomicU64::new(0) }, mode, backing)
}

fn engine_on<M: Medium>(medium: M, mode: CacheMode, backing: Vec<u8>) -> Arc<ShuttleEngine<M>> {
    let backing = ShuttleBacking { bytes: Arc::new(Mutex::new(backing)) };
    let config = Config {
        mode,
        block_size: BLOCK as u32,
        max_lanes: 3,
        admission: AdmissionConfig::Always,
        ..Config::default()
    };
    Arc::new(Engine::format(medium, backing, Arc::new(ManualClock::default()), &config).unwrap())
}

fn scenario(mode: CacheMode) {
    scenario_with(mode, false)
}

/// A read of four blocks written in order (so in consecutive slots, copied with one copy)
/// beside a writer overwriting the middle two and an evictor recycling their old slots: every
/// block the read returns is one whole version, blocks never go back in time, and the blocks
/// nobody overwrites keep theirs.
fn run_reader_scenario() {
    let engine = engine(CacheMode::WriteBack, vec![0; 64 * BLOCK]);
    {
        let mut lane = engine.lane().unwrap();
        for lba in 0..4u64 {
            lane.write(lba * BLOCK as u64, &stamp(1), false).unwrap();
        }
    }
    let writer = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut lane = engine.lane().unwrap();
            for version in 2..=3 {
                for lba in [1u64, 2] {
                    lane.write(lba * BLOCK as u64, &stamp(version), false).unwrap();
                }
            }
        })
    };
    let evictor = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut lane = engine.lane().unwrap();
            for lba in 10..24u64 {
                lane.write(lba * BLOCK as u64, &stamp(100 + lba), false).unwrap();
            }
            lane.drain().unwrap();
        })
    };
    let mut lane = engine.lane().unwrap();
    let mut last = [0u64; 4];
    for _ in 0..3 {
        let mut buf = vec![0u8; 4 * BLOCK];
        lane.read(0, &mut buf).unwrap();
        for (lba, block) in buf.chunks(BLOCK).enumerate() {
            let version = version_of(block);
            let allowed: &[u64] = if lba == 1 || lba == 2 { &[1, 2, 3] } else { &[1] };
            assert!(allowed.contains(&version), "block {lba}: version {version}");
            assert!(version >= last[lba], "block {lba} went back: {} then {version}", last[lba]);
            last[lba] = version;
        }
    }
    drop(lane);
    writer.join().unwrap();
    evictor.join().unwrap();
    engine.audit().unwrap();
    let mut buf = vec![0u8; 4 * BLOCK];
    engine.lane().unwrap().read(0, &mut buf).unwrap();
    let versions: Vec<u64> = buf.chunks(BLOCK).map(version_of).collect();
    assert_eq!(versions, [1, 3, 3, 1]);
}

#[test]
fn multi_block_reader_beside_a_writer_and_an_evictor() {
    shuttle::check_random(run_reader_scenario, iterations());
}

#[test]
fn multi_block_reader_beside_a_writer_and_an_evictor_pct() {
    shuttle::check_pct(run_reader_scenario, iterations(), 3);
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
    engine.audit().unwrap();
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
    engine.audit().unwrap();
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

/// Misses in flight beside a writer of their block: a lane starts a miss of block 5 (read
/// at submit), answers a hit of block 0 behind it, and completes the miss later, while another
/// lane writes block 5 twice. The miss answers a whole version, the hit is answered before
/// the miss completes, and once both are done the block reads as the last write: the miss's
/// admission never brings back the data it read before a write.
fn miss_in_flight_scenario(mode: CacheMode) {
    let mut backing = vec![0; 64 * BLOCK];
    backing[5 * BLOCK..6 * BLOCK].copy_from_slice(&stamp(7));
    let engine = engine(mode, backing);
    let mut setup = engine.lane().unwrap();
    setup.write(0, &stamp(1), false).unwrap();
    // Cached in every mode (a write around the cache is admitted by a read).
    setup.read(0, &mut vec![0u8; BLOCK]).unwrap();
    drop(setup);
    let writer = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut lane = engine.lane().unwrap();
            for version in 8..=9 {
                lane.write(5 * BLOCK as u64, &stamp(version), false).unwrap();
            }
        })
    };
    let mut lane = engine.lane().unwrap();
    let mut last = 7;
    for _ in 0..2 {
        let mut miss = vec![0u8; BLOCK];
        let mut hit = vec![0u8; BLOCK];
        let mut reads = [
            ReadRequest { offset: 5 * BLOCK as u64, buf: &mut miss },
            ReadRequest { offset: 0, buf: &mut hit },
        ];
        let mut started = Vec::new();
        lane.read_batch_start(&mut reads, &mut started);
        let pending = matches!(started[0], ReadStart::Pending(_));
        assert!(matches!(started[1], ReadStart::Done(Ok(()))), "the hit behind the miss");
        assert_eq!(version_of(&hit), 1);
        let mut answer = None;
        if pending {
            lane.complete(1, &mut |_, data| answer = Some(version_of(data.unwrap())));
        } else {
            answer = Some(version_of(&miss));
        }
        let version = answer.expect("the miss answered");
        assert!((7..=9).contains(&version), "block 5: version {version}");
        assert!(version >= last, "block 5 went back in time: {last} then {version}");
        last = version;
    }
    writer.join().unwrap();
    let mut buf = vec![0u8; BLOCK];
    lane.read(5 * BLOCK as u64, &mut buf).unwrap();
    assert_eq!(version_of(&buf), 9, "block 5 after the writes and the misses");
    drop(lane);
    engine.audit().unwrap();
}

#[test]
fn miss_in_flight_beside_a_writer_write_back() {
    shuttle::check_pct(|| miss_in_flight_scenario(CacheMode::WriteBack), iterations(), 3);
}

#[test]
fn miss_in_flight_beside_a_writer_write_around() {
    shuttle::check_pct(|| miss_in_flight_scenario(CacheMode::WriteAround), iterations(), 3);
}

/// Two lanes write one block, each with its write-throughs in flight on its own queue
/// (`Lane::write_start`), while a third reads it. Writes of one block never overlap on the
/// backing store, a write admits its data only if nothing else touched the stripe, and a
/// miss beside a write in flight admits nothing: after both, the cached copy (if any) is
/// exactly what the backing store holds, and that is one of the last writes.
fn write_through_in_flight_scenario(mode: CacheMode) {
    write_through_in_flight_scenario_with(mode, false)
}

/// [`write_through_in_flight_scenario`] with the third lane reading blocks 4–6 in one request
/// (the locked read path of a read across blocks, which must not admit block 5 either).
fn write_through_in_flight_scenario_with(mode: CacheMode, multi_block: bool) {
    let mut backing = vec![0; 64 * BLOCK];
    backing[5 * BLOCK..6 * BLOCK].copy_from_slice(&stamp(7));
    let engine = engine(mode, backing);
    let mut setup = engine.lane().unwrap();
    setup.read(5 * BLOCK as u64, &mut vec![0u8; BLOCK]).unwrap();
    drop(setup);
    let writer = |first: u64| {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut lane = engine.lane().unwrap();
            for version in first..first + 2 {
                match lane.write_start(5 * BLOCK as u64, &stamp(version), false) {
                    WriteStart::Done(result) => result.unwrap(),
                    WriteStart::Pending(_) => {
                        lane.complete(1, &mut |_, result| {
                            result.unwrap();
                        });
                    }
                }
            }
        })
    };
    let writers = [writer(10), writer(20)];
    let mut lane = engine.lane().unwrap();
    let mut buf = vec![0u8; BLOCK];
    if multi_block {
        let mut three = vec![0u8; 3 * BLOCK];
        lane.read(4 * BLOCK as u64, &mut three).unwrap();
        buf.copy_from_slice(&three[BLOCK..2 * BLOCK]);
    } else {
        match lane.read_start(5 * BLOCK as u64, &mut buf) {
            ReadStart::Done(result) => result.unwrap(),
            ReadStart::Pending(_) => {
                lane.complete(1, &mut |_, data| buf.copy_from_slice(data.unwrap()));
            }
        }
    }
    let version = version_of(&buf);
    assert!([7, 10, 11, 20, 21].contains(&version), "block 5 read as version {version}");
    for writer in writers {
        writer.join().unwrap();
    }
    lane.read(5 * BLOCK as u64, &mut buf).unwrap();
    let cached = version_of(&buf);
    let stored = engine.backing().bytes.lock().unwrap()[5 * BLOCK..6 * BLOCK].to_vec();
    assert_eq!(cached, version_of(&stored), "the cache and the backing store disagree");
    assert!([11, 21].contains(&cached), "block 5 ended as version {cached}");
    drop(lane);
    engine.audit().unwrap();
}

#[test]
fn write_through_in_flight_beside_writers_and_a_miss() {
    shuttle::check_pct(
        || write_through_in_flight_scenario(CacheMode::WriteThrough),
        iterations(),
        3,
    );
}

#[test]
fn write_through_in_flight_beside_writers_and_a_multi_block_read() {
    shuttle::check_pct(
        || write_through_in_flight_scenario_with(CacheMode::WriteThrough, true),
        iterations(),
        3,
    );
}

#[test]
fn write_around_in_flight_beside_writers_and_a_miss() {
    shuttle::check_pct(
        || write_through_in_flight_scenario(CacheMode::WriteAround),
        iterations(),
        3,
    );
}

/// The eviction hand races a lane that recycles the slot it is looking at. The cache is full
/// of clean blocks, block 0 in slot 0, where the hand starts, and the recycling lane holds
/// the only free slot (the last block's, trimmed). It overwrites block 0 (into its free slot;
/// block 0's clean copy in slot 0 is superseded and that slot comes back to its list) and
/// admits block 20 on a read miss, into slot 0 again. The other lane's read miss finds no
/// free slot and runs the hand, which may load slot 0's word and entry (block 0, clean)
/// before the recycling and take block 0's stripe after it. It must then skip the slot (a new
/// incarnation), neither evicting block 20 nor expecting block 0 there. Every block must read
/// back as written.
fn recycled_victim_scenario() {
    let backing: Vec<u8> = (0..64).flat_map(|lba| stamp(1000 + lba)).collect();
    let engine = coarse_engine(CacheMode::WriteBack, backing);
    let slot_count = engine.superblock().geometry.slot_count;
    assert!(slot_count < 20, "blocks 20 and 21 must be new to the cache");
    let last = slot_count - 1;
    let mut lane = engine.lane().unwrap();
    let mut buf = vec![0u8; BLOCK];
    // Blocks 0, 1, ... admitted into slots 0, 1, ... in turn; the last one trimmed.
    for lba in 0..slot_count {
        lane.read(lba * BLOCK as u64, &mut buf).unwrap();
    }
    lane.trim(last * BLOCK as u64, BLOCK as u64).unwrap();
    let evictor = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let mut buf = vec![0u8; BLOCK];
            engine.lane().unwrap().read(21 * BLOCK as u64, &mut buf).unwrap();
            assert_eq!(version_of(&buf), 1021, "the evictor's read miss");
        })
    };
    lane.write(0, &stamp(500), false).unwrap();
    lane.read(20 * BLOCK as u64, &mut buf).unwrap();
    assert_eq!(version_of(&buf), 1020, "the recycler's read miss");
    evictor.join().unwrap();
    drop(lane);
    engine.audit().unwrap();
    let mut lane = engine.lane().unwrap();
    assert!(engine.stats().evictions >= 1, "the evictor's read miss evicted nothing");
    // The blocks the two lanes wrote, read and trimmed, and one they left alone (every read
    // is a scheduling point; fewer of them here leave the race above more of the schedule).
    for lba in [0, 1, last, 20, 21] {
        lane.read(lba * BLOCK as u64, &mut buf).unwrap();
        let expected = match lba {
            0 => 500,
            _ if lba == last => 0,
            _ => 1000 + lba,
        };
        assert_eq!(version_of(&buf), expected, "block {lba}");
    }
}

/// Three times the other tests' schedules: about one in 700 of them preempts the hand in its
/// window (measured with the check counted), and this scenario's schedules are short.
#[test]
fn eviction_hand_beside_a_recycled_victim() {
    shuttle::check_pct(recycled_victim_scenario, 3 * iterations(), 3);
}

/// A lock-free read hit marks the block's index entry (CLOCK's reference bit) after its copy
/// validates, and the entry may be removed in between: here by a trim, under the stripe that
/// the reader does not take. The mark must then leave the removed entry empty: a bit set in
/// an empty entry would be a "ghost" that no insert claims and no removal reaches, taking
/// index room for the life of the process (the audit counts index entries against cached
/// blocks). Then the trimmed block is read again (admitted anew) and read back.
fn reference_mark_scenario() {
    let backing: Vec<u8> = (0..64).flat_map(|lba| stamp(1000 + lba)).collect();
    let engine = coarse_engine(CacheMode::WriteBack, backing);
    let mut buf = vec![0u8; BLOCK];
    // Block 5 admitted on a read miss: its entry's reference bit is clear.
    engine.lane().unwrap().read(5 * BLOCK as u64, &mut buf).unwrap();
    let trimmer = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            engine.lane().unwrap().trim(5 * BLOCK as u64, BLOCK as u64).unwrap();
        })
    };
    let mut lane = engine.lane().unwrap();
    lane.read(5 * BLOCK as u64, &mut buf).unwrap();
    assert!([0, 1005].contains(&version_of(&buf)), "a read beside the trim");
    trimmer.join().unwrap();
    drop(lane);
    engine.audit().unwrap();
    let mut lane = engine.lane().unwrap();
    lane.read(5 * BLOCK as u64, &mut buf).unwrap();
    assert_eq!(version_of(&buf), 0, "the trimmed block");
}

#[test]
fn reference_mark_beside_a_trim() {
    shuttle::check_pct(reference_mark_scenario, iterations(), 3);
}

/// A lane asked for while the cache shuts down is either handed out before the shutdown
/// checks for open lanes (which then refuses) or refused: never handed out once the medium
/// says the cache shut down cleanly (a lane then would write on a cache marked clean).
fn lane_beside_shutdown_scenario() {
    use pmcache_engine::format::{SHUTDOWN_CLEAN, SHUTDOWN_WORD_OFFSET};
    let engine = coarse_engine(CacheMode::WriteBack, vec![0; 64 * BLOCK]);
    let asker = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || match engine.lane() {
            Ok(mut lane) => {
                let word = engine.medium().load_u64(SHUTDOWN_WORD_OFFSET);
                assert_ne!(word, SHUTDOWN_CLEAN, "a lane handed out after a clean shutdown");
                lane.write(0, &stamp(9), false).unwrap();
                true
            }
            Err(pmcache_engine::Error::ShutDown) => false,
            Err(e) => panic!("{e}"),
        })
    };
    let shut = engine.shutdown();
    let got_lane = asker.join().unwrap();
    match shut {
        Ok(()) => assert!(matches!(engine.lane(), Err(pmcache_engine::Error::ShutDown))),
        Err(pmcache_engine::Error::LanesOpen { open: 1 }) => assert!(got_lane),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn lane_beside_shutdown() {
    shuttle::check_pct(lane_beside_shutdown_scenario, iterations(), 3);
}

/// The cleaner writes block 0 back (copy under the stripe, backing write with no lock, then
/// the mark) while a writer overwrites it and a reader reads it: the reader sees whole
/// versions that never go back; afterwards the block holds the newer data, and if it is clean
/// the backing store holds that data too — an overwrite during the write-back must leave the
/// block dirty, never marked clean over the older copy.
fn cleaner_writer_reader_scenario<M: Medium + Send + Sync + 'static>(
    engine: Arc<ShuttleEngine<M>>,
) {
    engine.lane().unwrap().write(0, &stamp(1), false).unwrap();
    let cleaner = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let config = pmcache_engine::CleanerConfig {
                queue_depth: 2,
                batch_blocks: 4,
                merge_blocks: 2,
                ..pmcache_engine::CleanerConfig::default()
            };
            let mut cleaner = engine.cleaner(config).unwrap();
            for _ in 0..2 {
                let outcome = cleaner.clean_batch(4);
                assert_eq!(outcome.failed, 0, "{outcome:?}");
            }
        })
    };
    let writer = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            engine.lane().unwrap().write(0, &stamp(2), false).unwrap();
        })
    };
    let mut lane = engine.lane().unwrap();
    let mut last = 0;
    for _ in 0..3 {
        let mut buf = vec![0u8; BLOCK];
        lane.read(0, &mut buf).unwrap();
        let version = version_of(&buf);
        assert!((1..=2).contains(&version), "read version {version}");
        assert!(version >= last, "went back in time: {last} then {version}");
        last = version;
    }
    drop(lane);
    cleaner.join().unwrap();
    writer.join().unwrap();
    engine.audit().unwrap();
    let mut buf = vec![0u8; BLOCK];
    engine.lane().unwrap().read(0, &mut buf).unwrap();
    assert_eq!(version_of(&buf), 2, "the cache lost the newer write");
    let on_backing = version_of(&engine.backing().bytes.lock().unwrap()[..BLOCK]);
    if engine.dirty_slots() == 0 {
        assert_eq!(on_backing, 2, "block 0 marked clean with version {on_backing} written back");
    }
    // Whatever the interleaving, a drain now leaves the newer data on the backing store.
    engine.lane().unwrap().drain().unwrap();
    let on_backing = version_of(&engine.backing().bytes.lock().unwrap()[..BLOCK]);
    assert_eq!(on_backing, 2, "after the drain");
}

#[test]
fn cleaner_beside_a_writer_and_a_reader() {
    shuttle::check_pct(
        || cleaner_writer_reader_scenario(engine(CacheMode::WriteBack, vec![0; 64 * BLOCK])),
        iterations(),
        3,
    );
}

#[test]
fn cleaner_beside_a_writer_and_a_reader_coarse() {
    shuttle::check_pct(
        || cleaner_writer_reader_scenario(coarse_engine(CacheMode::WriteBack, vec![0; 64 * BLOCK])),
        iterations(),
        3,
    );
}

/// Requests on the same blocks from two lanes beside the cleaner: block 2 is dirty (version 1)
/// and the cleaner writes it back while lane A trims it and then zeroes blocks 0..4 (through
/// the backing store: 2 whole blocks or more), and lane B overwrites block 3 (version 5). Block
/// 2 must read zeroes — the trim and the zeroes were acknowledged one after the other, so the
/// cleaner's older copy must not land after them — and block 3 one of the two orders, zeroes
/// or version 5; after a drain the backing store holds what the cache served.
fn overlapping_requests_beside_the_cleaner_scenario() {
    let engine = engine(CacheMode::WriteBack, (0..64).flat_map(|_| stamp(9)).collect());
    engine.set_zero_through_blocks_min(2);
    let block = BLOCK as u64;
    engine.lane().unwrap().write(2 * block, &stamp(1), false).unwrap();
    let cleaner = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            let config = pmcache_engine::CleanerConfig {
                queue_depth: 2,
                batch_blocks: 4,
                merge_blocks: 1,
                ..pmcache_engine::CleanerConfig::default()
            };
            let mut cleaner = engine.cleaner(config).unwrap();
            for _ in 0..2 {
                let outcome = cleaner.clean_batch(4);
                assert_eq!(outcome.failed, 0, "{outcome:?}");
            }
        })
    };
    let overwriter = {
        let engine = engine.clone();
        shuttle::thread::spawn(move || {
            engine.lane().unwrap().write(3 * block, &stamp(5), false).unwrap();
        })
    };
    {
        let mut lane = engine.lane().unwrap();
        lane.trim(2 * block, block).unwrap();
        lane.write_zeroes(0, 4 * block, false).unwrap();
    }
    cleaner.join().unwrap();
    overwriter.join().unwrap();
    engine.audit().unwrap();
    let read = |lba: u64| {
        let mut buf = vec![0u8; BLOCK];
        engine.lane().unwrap().read(lba * block, &mut buf).unwrap();
        version_of(&buf)
    };
    assert_eq!(read(2), 0, "block 2 after its trim and zeroes");
    let block_3 = read(3);
    assert!(block_3 == 0 || block_3 == 5, "block 3 is neither order: version {block_3}");
    engine.lane().unwrap().drain().unwrap();
    let backing = engine.backing().bytes.lock().unwrap().clone();
    let on_backing = |lba: u64| version_of(&backing[(lba * block) as usize..][..BLOCK]);
    assert_eq!(on_backing(2), 0, "block 2 on the backing store");
    assert_eq!(on_backing(3), block_3, "block 3 on the backing store");
}

#[test]
fn overlapping_requests_beside_the_cleaner() {
    shuttle::check_pct(overlapping_requests_beside_the_cleaner_scenario, iterations(), 3);
}

#[test]
fn overlapping_requests_beside_the_cleaner_random() {
    shuttle::check_random(overlapping_requests_beside_the_cleaner_scenario, iterations());
}
