//! A poisoned line as the mapped medium meets it: the first checked read that reaches it
//! loses the whole page around it (`PmemFile` maps a zeroed private page there; the
//! simulated medium models it with `CrashMedium::poison_mapped`), and what is stored there
//! afterwards never reaches the medium. With blocks smaller than a page the page holds other
//! slots' data; with data checksums the first page of checksums also holds metadata entries.
//! Whatever the page held, every acknowledged write reads back intact after a restart from
//! the durable image — or its read fails with an error, never with other data — and nothing
//! is stored into a lost page again.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use pmcache_engine::testing::{SimBacking, model};
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, EvictionKind, Lane, ManualClock, RecoveryReport,
    check_medium,
};
use pmcache_media::{CrashMedium, CrashSwitch, Medium};

const BLOCK: usize = model::BLOCK;
const BLOCK_BYTES: u64 = BLOCK as u64;
const PAGE: u64 = CrashMedium::PAGE_BYTES;
const SLOTS: u64 = 1000;
const BACKING_BLOCKS: u64 = 4096;

type SimEngine = Engine<CrashMedium, SimBacking, Arc<ManualClock>>;
type SimLane<'e> = Lane<'e, CrashMedium, SimBacking, Arc<ManualClock>>;

fn config(data_crc: bool) -> Config {
    Config {
        max_lanes: 4,
        data_crc,
        ..model::config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always)
    }
}

/// A medium of exactly `SLOTS` slots: the metadata (entries, and checksums with `data_crc`)
/// from 4096, the data from the next page boundary.
fn medium_bytes(data_crc: bool) -> u64 {
    let meta = 16 + if data_crc { 4 } else { 0 };
    (4096 + meta * SLOTS).next_multiple_of(PAGE) + SLOTS * BLOCK_BYTES
}

struct Bed {
    medium: CrashMedium,
    engine: SimEngine,
    data_crc: bool,
}

impl Bed {
    fn new(data_crc: bool) -> Self {
        let switch = CrashSwitch::new();
        let medium = CrashMedium::new(medium_bytes(data_crc), switch.clone(), 1);
        let backing = SimBacking::new(BACKING_BLOCKS * BLOCK_BYTES, switch, 2);
        let clock = Arc::new(ManualClock::default());
        let engine = Engine::format(medium.clone(), backing, clock, &config(data_crc)).unwrap();
        assert_eq!(engine.layout().slot_count, SLOTS);
        Bed { medium, engine, data_crc }
    }

    /// The engine attached again to the durable images of its medium and backing store (a
    /// crash of the process: no clean shutdown), the medium poisoned again at `poisoned`
    /// (the device keeps its poison), as a mapped medium meets it.
    fn restart(self, poisoned: &[u64]) -> (Self, RecoveryReport) {
        self.restart_refusing(poisoned, 0..0)
    }

    /// [`Bed::restart`] with a backing store that refuses writes to the bytes `refused`.
    fn restart_refusing(self, poisoned: &[u64], refused: Range<u64>) -> (Self, RecoveryReport) {
        let image = self.medium.durable_image();
        let backing = self.engine.backing().durable_contents();
        let data_crc = self.data_crc;
        drop(self.engine);
        let switch = CrashSwitch::new();
        let medium = CrashMedium::from_image(image, switch.clone(), 3);
        for &at in poisoned {
            medium.poison_mapped(at, 1);
        }
        let backing = SimBacking::from_image(backing, switch, 4);
        if !refused.is_empty() {
            backing.fail_writes_in(refused);
        }
        let clock = Arc::new(ManualClock::default());
        let (engine, report) =
            Engine::open(medium.clone(), backing, clock, &config(data_crc)).unwrap();
        (Bed { medium, engine, data_crc }, report)
    }

    /// The slot whose data is `data` (a scan of the data area, plain reads: none of it may be
    /// poisoned).
    fn slot_of(&self, data: &[u8]) -> u32 {
        let layout = self.engine.layout();
        let mut buf = vec![0u8; BLOCK];
        (0..layout.slot_count as u32)
            .find(|&slot| {
                self.medium.read(layout.data_offset(slot), &mut buf);
                buf == data
            })
            .expect("a slot holds the block")
    }
}

/// What each block written holds: the last data written to it.
#[derive(Default)]
struct Written {
    blocks: HashMap<u64, Vec<u8>>,
    version: u32,
    /// Writes that failed (not acknowledged: the block keeps what it held).
    failed: Vec<u64>,
}

impl Written {
    /// A new version of block `lba`: its number and the version, then bytes drawn from them.
    fn data(&mut self, lba: u64) -> Vec<u8> {
        self.version += 1;
        let mut data = Vec::with_capacity(BLOCK);
        data.extend_from_slice(&lba.to_le_bytes());
        data.extend_from_slice(&self.version.to_le_bytes());
        let mut x = lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(self.version) | 1;
        while data.len() < BLOCK {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            data.push(x as u8);
        }
        data
    }

    /// Writes a new version of block `lba`: acknowledged if it returns no error (one that
    /// fails leaves the block as it was, and is counted).
    fn write(&mut self, lane: &mut SimLane<'_>, lba: u64) {
        let data = self.data(lba);
        match lane.write(lba * BLOCK_BYTES, &data, false) {
            Ok(()) => {
                self.blocks.insert(lba, data);
            }
            Err(_) => self.failed.push(lba),
        }
    }

    /// Reads every block written: (blocks that read back other data, blocks whose read
    /// failed).
    fn check_all(&self, lane: &mut SimLane<'_>) -> (Vec<u64>, Vec<u64>) {
        let (mut wrong, mut failed) = (Vec::new(), Vec::new());
        let mut lbas: Vec<u64> = self.blocks.keys().copied().collect();
        lbas.sort_unstable();
        for lba in lbas {
            let mut buf = vec![0u8; BLOCK];
            match lane.read(lba * BLOCK_BYTES, &mut buf) {
                Ok(()) if buf == self.blocks[&lba] => {}
                Ok(()) => wrong.push(lba),
                Err(_) => failed.push(lba),
            }
        }
        (wrong, failed)
    }
}

/// A pseudo-random sequence of blocks.
struct Blocks(u64);

impl Blocks {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
}

/// `count` whole-block writes of blocks below `below`, each seventh followed by a read of a
/// random block written before, checked; a drain every thousand.
fn churn(
    written: &mut Written,
    lane: &mut SimLane<'_>,
    blocks: &mut Blocks,
    count: usize,
    below: u64,
) {
    for i in 0..count {
        let lba = blocks.next(below);
        written.write(lane, lba);
        if i % 7 == 0 {
            let lba = blocks.next(below);
            if let Some(expected) = written.blocks.get(&lba) {
                let mut buf = vec![0u8; BLOCK];
                if lane.read(lba * BLOCK_BYTES, &mut buf).is_ok() {
                    assert!(buf == *expected, "block {lba} read back other data");
                }
            }
        }
        if i % 1000 == 999 {
            let _ = lane.drain();
        }
    }
}

/// The page both metadata entries and data checksums share (checksums follow the entries
/// without a page boundary), lost under a live engine: the dirty blocks whose entries or
/// checksums are there are written back and dropped at once — the one whose checksum read
/// met the poison too, which then reads back from the backing store — their slots never take
/// a block again, nothing is stored into the page again, and after a restart the entries the
/// page held (stale: some of those blocks were written again, written back and evicted
/// since) are not trusted: every block reads back as last written, none fails.
#[test]
fn a_lost_page_of_entries_and_checksums_loses_no_acknowledged_write() {
    let bed = Bed::new(true);
    let mut written = Written::default();
    let layout = bed.engine.layout().clone();
    let crc_page = layout.crc_offset(0) / PAGE * PAGE;
    assert_eq!(layout.entry_offset(SLOTS as u32 - 1) / PAGE * PAGE, crc_page, "shared");
    let engine = &bed.engine;
    let mut lane = engine.lane().unwrap();
    for lba in 0..SLOTS {
        written.write(&mut lane, lba);
    }
    let victim = (0..SLOTS).find(|lba| bed.slot_of(&written.blocks[lba]) == 10).unwrap();
    bed.medium.poison_mapped(layout.crc_offset(10), 4);
    let mut buf = vec![0u8; BLOCK];
    lane.read(victim * BLOCK_BYTES, &mut buf).expect("written back, then read from the store");
    assert!(buf == written.blocks[&victim], "the victim read back other data");
    let lost = crc_page..crc_page + PAGE;
    assert_eq!(bed.medium.poisoned_ranges(), vec![lost.clone()]);
    let touching = (0..SLOTS as u32)
        .filter(|&slot| {
            let (entry, crc) = (layout.entry_offset(slot), layout.crc_offset(slot));
            lost.contains(&entry) || lost.contains(&crc)
        })
        .count() as u64;
    assert_eq!(touching, 232 + 96);
    let stats = engine.stats();
    assert_eq!(stats.retired_slots, touching, "{stats:?}");

    let mut blocks = Blocks(0x2545_f491_4f6c_dd1d);
    churn(&mut written, &mut lane, &mut blocks, 6000, 1500);
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty(), "blocks read back other data: {wrong:?}");
    assert!(failed.is_empty(), "reads failed: {failed:?}");
    assert_eq!(bed.medium.stores_to_lost_pages(), 0, "a store into the lost page");
    drop(lane);
    engine.audit().unwrap();

    let (bed, report) = bed.restart(&[layout.crc_offset(10)]);
    let mut lane = bed.engine.lane().unwrap();
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty(), "after the restart, blocks read back other data: {wrong:?}");
    assert!(failed.is_empty(), "after the restart, reads failed: {failed:?}");
    assert!(written.failed.is_empty(), "writes failed: {:?}", written.failed);
    drop(lane);
    bed.engine.audit().unwrap();
    // The page's entries were not read: the record says the page is settled.
    assert_eq!(report.lost_entries, 232, "{report:?}");
    let checked = check_medium(&bed.medium).unwrap();
    assert_eq!((checked.lost_entries, checked.corrupt), (232, 0), "{checked:?}");
    assert_eq!(bed.engine.stats().retired_slots, touching);
}

/// A data page of several 512-byte blocks, lost under a live engine when one block's read
/// meets the poisoned line: the page's other blocks are lost to this process too, and none of
/// its slots takes a block again — not the slots of the blocks written over since, which are
/// freed without ever being read (a block written into the lost page would come back after a
/// restart as the page's old contents, or fail its checksum). After the restart the page is
/// known lost from the start; the block whose line is poisoned still fails, the others read
/// back as last written.
#[test]
fn a_lost_page_of_small_blocks_never_takes_a_block_again() {
    for data_crc in [false, true] {
        let bed = Bed::new(data_crc);
        let mut written = Written::default();
        let layout = bed.engine.layout().clone();
        let engine = &bed.engine;
        let mut lane = engine.lane().unwrap();
        for lba in 0..SLOTS {
            written.write(&mut lane, lba);
        }
        let poisoned_at = layout.data_offset(83) + 128;
        let page = poisoned_at / PAGE * PAGE;
        let slot_of = |lba: u64| bed.slot_of(&written.blocks[&lba]);
        let on_page: Vec<u64> = (0..SLOTS)
            .filter(|&lba| (page..page + PAGE).contains(&layout.data_offset(slot_of(lba))))
            .collect();
        assert_eq!(on_page.len(), 8);
        let victim = (0..SLOTS).find(|&lba| slot_of(lba) == 83).unwrap();
        bed.medium.poison_mapped(poisoned_at, 1);
        let mut buf = vec![0u8; BLOCK];
        assert!(lane.read(victim * BLOCK_BYTES, &mut buf).is_err(), "its only copy is lost");
        assert_eq!(engine.stats().retired_slots, 8);
        // Written again: the new copies land elsewhere.
        for &lba in on_page.iter().filter(|&&lba| lba != victim) {
            written.write(&mut lane, lba);
        }
        let mut blocks = Blocks(0x9e37_79b9_7f4a_7c15);
        let mut churned = 0;
        while churned < 6000 {
            let lba = blocks.next(1500);
            if lba != victim {
                written.write(&mut lane, lba);
                churned += 1;
            }
        }
        let (wrong, failed) = written.check_all(&mut lane);
        assert!(wrong.is_empty(), "wrong {wrong:?}");
        assert_eq!(failed, [victim]);
        assert_eq!(bed.medium.stores_to_lost_pages(), 0, "a store into the lost page");
        drop(lane);
        engine.audit().unwrap();

        let (bed, report) = bed.restart(&[poisoned_at]);
        assert_eq!(report.lost_entries, 0, "{report:?}");
        assert_eq!(bed.engine.stats().retired_slots, 8, "known lost from the start");
        let mut lane = bed.engine.lane().unwrap();
        let (wrong, failed) = written.check_all(&mut lane);
        assert!(wrong.is_empty(), "after the restart, other data: {wrong:?}");
        assert_eq!(failed, [victim], "data crc {data_crc}");
        drop(lane);
        bed.engine.audit().unwrap();
    }
}

/// A lane holds the rest of its free run when a page holding some of those slots is lost:
/// it never places a block in one of them (each would read back as an error, and after a
/// restart as the page's old contents).
#[test]
fn slots_in_a_lanes_free_run_on_a_lost_page_are_never_used() {
    let bed = Bed::new(false);
    let mut written = Written::default();
    let layout = bed.engine.layout().clone();
    let mut lane = bed.engine.lane().unwrap();
    written.write(&mut lane, 0);
    assert_eq!(bed.slot_of(&written.blocks[&0]), 0, "the lane's run starts at slot 0");
    bed.medium.poison_mapped(layout.data_offset(0) + 64, 1);
    let mut buf = vec![0u8; BLOCK];
    assert!(lane.read(0, &mut buf).is_err(), "the block's only copy is lost");
    assert_eq!(bed.engine.stats().retired_slots, PAGE / BLOCK_BYTES);
    for lba in 1..40 {
        written.write(&mut lane, lba);
    }
    written.blocks.remove(&0);
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty() && failed.is_empty(), "wrong {wrong:?}, failed {failed:?}");
    assert_eq!(bed.medium.stores_to_lost_pages(), 0, "a block placed in the lost page");
}

/// The backing store refuses the write-backs that would settle a lost page of entries: the
/// page stays pending on the medium's record, and the blocks whose entries are there stay.
/// One of them, clean, is written around the cache meanwhile: its removal never reaches the
/// lost page. After a crash (the store still refusing), recovery trusts the page's dirty
/// entries — the only copies of their blocks — and not its clean ones at or below the synced
/// sequence number (the backing store has that data, or newer: here the block written
/// around); every block reads back as last written. Once the store takes writes again, an
/// allocation settles the page, and at the next start its entries are not read at all.
#[test]
fn a_lost_page_the_backing_store_will_not_settle_stays_pending_across_a_crash() {
    let bed = Bed::new(true);
    let mut written = Written::default();
    let layout = bed.engine.layout().clone();
    let crc_page = layout.crc_offset(0) / PAGE * PAGE;
    let entry_on_page = |slot: u32| layout.entry_offset(slot) / PAGE * PAGE == crc_page;
    let mut lane = bed.engine.lane().unwrap();
    // Slots in address order: the first 768 blocks written back, then clean copies read in
    // and synced, then dirty blocks, the last two kinds with their entries on the page.
    let first_on_page = (0..SLOTS as u32).find(|&slot| entry_on_page(slot)).unwrap();
    let read_in = 2000..2100u64;
    bed.engine.set_mode(CacheMode::WriteAround);
    for lba in read_in.clone() {
        let data = written.data(lba);
        lane.write(lba * BLOCK_BYTES, &data, true).unwrap();
        written.blocks.insert(lba, data);
    }
    bed.engine.set_mode(CacheMode::WriteBack);
    for lba in 0..u64::from(first_on_page) {
        written.write(&mut lane, lba);
    }
    lane.drain().unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lba in read_in.clone() {
        lane.read(lba * BLOCK_BYTES, &mut buf).unwrap();
        assert!(buf == written.blocks[&lba], "block {lba}");
    }
    lane.flush().unwrap();
    let dirty = 1000..1100u64;
    for lba in dirty.clone() {
        written.write(&mut lane, lba);
    }
    let on_page = dirty.clone().filter(|lba| entry_on_page(bed.slot_of(&written.blocks[lba])));
    assert!(on_page.count() > 50);
    // The write-backs of the dirty blocks are refused (nothing else is).
    let dirty_bytes = dirty.start * BLOCK_BYTES..dirty.end * BLOCK_BYTES;
    bed.engine.backing().fail_writes_in(dirty_bytes.clone());
    let victim =
        (0..u64::from(first_on_page)).find(|lba| bed.slot_of(&written.blocks[lba]) == 20).unwrap();
    bed.medium.poison_mapped(layout.crc_offset(20), 4);
    lane.read(victim * BLOCK_BYTES, &mut buf).unwrap();
    assert!(buf == written.blocks[&victim], "a clean block, read from the backing store");
    for lba in dirty.clone().take(20) {
        lane.read(lba * BLOCK_BYTES, &mut buf).unwrap();
        assert!(buf == written.blocks[&lba], "block {lba}");
    }
    // A block read in clean, with its entry on the pending page, written around the cache:
    // its cached copy is dropped (a removal the medium never sees: the entry is on the lost
    // page) and the backing store takes the new data. The entry must not bring the old data
    // back.
    let around = read_in
        .clone()
        .find(|lba| entry_on_page(bed.slot_of(&written.blocks[lba])))
        .expect("a block read in has its entry on the page");
    bed.engine.set_mode(CacheMode::WriteAround);
    let data = written.data(around);
    lane.write(around * BLOCK_BYTES, &data, true).unwrap();
    written.blocks.insert(around, data);
    bed.engine.set_mode(CacheMode::WriteBack);
    drop(lane);

    // The backing store still refuses those blocks at the restart: the page stays pending.
    let (bed, report) = bed.restart_refusing(&[], dirty_bytes.clone());
    let mut lane = bed.engine.lane().unwrap();

    // The block written around first, before any reclaim could evict a stale copy of it.
    lane.read(around * BLOCK_BYTES, &mut buf).unwrap();
    assert!(buf == written.blocks[&around], "the block written around came back old");
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty() && failed.is_empty(), "wrong {wrong:?}, failed {failed:?}");
    assert!(report.lost_entries >= 50, "clean entries on the pending page: {report:?}");
    assert!(report.dirty >= 100, "{report:?}");
    // Working again, the store takes them: an allocation settles the page.
    bed.engine.backing().heal();
    let mut blocks = Blocks(77);
    churn(&mut written, &mut lane, &mut blocks, 2000, 1500);
    drop(lane);
    bed.engine.audit().unwrap();

    let (bed, report) = bed.restart(&[]);
    assert_eq!(report.lost_entries, 232, "settled at the last start: {report:?}");
    let mut lane = bed.engine.lane().unwrap();
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty() && failed.is_empty(), "wrong {wrong:?}, failed {failed:?}");
    assert!(written.failed.is_empty(), "writes failed: {:?}", written.failed);
}

/// Lanes on three threads write; one of them meets the poisoned line while the others go on
/// writing (a write that took its slot on the page just before it was lost runs again
/// elsewhere), then all write on: the page is settled
/// whenever every stripe it needs can be had — at once, or by a later allocation, while the
/// blocks the writers' reclaims meet are written back alone — no write fails, nothing is
/// stored into the page once it is settled, and after a restart every block reads back as
/// last written.
#[test]
fn a_page_lost_beside_writers_on_other_threads_loses_no_acknowledged_write() {
    use std::sync::Barrier;
    use std::sync::atomic::{AtomicBool, Ordering};
    let bed = Bed::new(true);
    let mut written = Written::default();
    let layout = bed.engine.layout().clone();
    let engine = &bed.engine;
    {
        let mut lane = engine.lane().unwrap();
        for lba in 0..SLOTS {
            written.write(&mut lane, lba);
        }
    }
    let victim = (0..SLOTS).find(|lba| bed.slot_of(&written.blocks[lba]) == 30).unwrap();
    bed.medium.poison_mapped(layout.crc_offset(30), 4);
    let (met, lost) = (Barrier::new(3), AtomicBool::new(false));
    let results: Vec<(HashMap<u64, Vec<u8>>, u32)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3u64)
            .map(|thread| {
                let (met, lost) = (&met, &lost);
                scope.spawn(move || {
                    let mut lane = engine.lane().unwrap();
                    let mut mine: HashMap<u64, Vec<u8>> = HashMap::new();
                    let mut failures = 0u32;
                    let mut blocks = Blocks(thread * 7919 + 1);
                    let mut buf = vec![0u8; BLOCK];
                    for i in 0..3000u32 {
                        if i == 1000 {
                            met.wait();
                            if thread == 0 {
                                let _ = lane.read(victim * BLOCK_BYTES, &mut buf);
                                lost.store(true, Ordering::SeqCst);
                            }
                        }
                        if i % 5 == 0 && !lost.load(Ordering::Relaxed) {
                            let lba = 1000 + thread + 3 * blocks.next(160);
                            if lane.read(lba * BLOCK_BYTES, &mut buf).is_ok() {
                                assert!(mine.get(&lba).is_none_or(|d| *d == buf));
                            }
                        }
                        // Each thread its own blocks: 1000 + thread, + 3, + 6, ...
                        let lba = 1000 + thread + 3 * blocks.next(160);
                        let data: Vec<u8> =
                            (0..BLOCK as u32).map(|b| (b ^ i ^ (lba as u32) << 3) as u8).collect();
                        if lane.write(lba * BLOCK_BYTES, &data, false).is_ok() {
                            mine.insert(lba, data);
                        } else {
                            failures += 1;
                        }
                    }
                    (mine, failures)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut failures = 0;
    for (mine, failed) in results {
        written.blocks.extend(mine);
        failures += failed;
    }
    assert_eq!(failures, 0, "writes failed");
    {
        // One more allocation settles the page if no thread could.
        let mut lane = engine.lane().unwrap();
        written.write(&mut lane, 5);
        let stored = bed.medium.stores_to_lost_pages();
        for lba in 0..300 {
            written.write(&mut lane, 2000 + lba);
        }
        let (wrong, failed) = written.check_all(&mut lane);
        assert!(wrong.is_empty() && failed.is_empty(), "wrong {wrong:?}, failed {failed:?}");
        assert_eq!(bed.medium.stores_to_lost_pages(), stored, "a store into the settled page");
    }
    engine.audit().unwrap();
    let (bed, report) = bed.restart(&[layout.crc_offset(30)]);
    let mut lane = bed.engine.lane().unwrap();
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty(), "after the restart, other data: {wrong:?}");
    assert!(failed.is_empty(), "after the restart, reads failed: {failed:?}");
    assert!(written.failed.is_empty(), "writes failed: {:?}", written.failed);
    assert_eq!(report.lost_entries, 232, "{report:?}");
}

/// Where a page is lost at the instant a store reaches it (`CrashMedium::lose_page_at_store`),
/// as if a read on another thread met a poisoned line there just then.
#[derive(Clone, Copy, Debug)]
enum LostAt {
    /// The page of the first block data stored.
    Data,
    /// The page of the first metadata entry stored.
    Entry,
    /// The page of the first data checksum stored (it holds entries too).
    Checksum,
}

impl LostAt {
    fn trigger(self, bed: &Bed) -> Range<u64> {
        let layout = bed.engine.layout();
        let member = &layout.members()[0];
        let geometry = &member.geometry;
        let entries = member.base + geometry.meta_offset;
        let entries_end = entries + 16 * geometry.slot_count;
        match self {
            LostAt::Data => {
                layout.data_offset(0)..layout.data_offset(SLOTS as u32 - 1) + BLOCK_BYTES
            }
            LostAt::Entry => entries..entries_end,
            LostAt::Checksum => entries_end..entries_end + 4 * geometry.slot_count,
        }
    }
}

/// What stores into the page as it is lost.
#[derive(Clone, Copy, Debug)]
enum Storing {
    /// A whole-block write of a block new to the cache (write-back).
    NewBlock,
    /// A whole-block write over a cached dirty block (write-back).
    Overwrite,
    /// A 100-byte write into a cached dirty block (write-back: a merge).
    Partial,
    /// A group-committed batch of eight writes (write-back).
    Group,
    /// A read miss admitting the block (write-back mode, admission always).
    ReadAdmission,
    /// A write-through write admitting its block.
    ThroughAdmission,
}

/// A page of the medium lost at the instant a write or an admission stores into it — by a
/// read on another thread, before any thread of the engine knows: the store goes to the
/// replacement and never reaches the medium. A write is acknowledged only with every one of
/// its stores landed (it runs again in another slot otherwise), an admission is made only so
/// (dropped otherwise, its entry cleared where it landed without its data): every block reads
/// back as last acknowledged, now and after a restart from the durable images.
#[test]
fn a_page_lost_while_a_write_or_admission_stores_there_loses_nothing_acknowledged() {
    use pmcache_engine::WriteRequest;
    let mut unlanded_runs = 0;
    for data_crc in [false, true] {
        let places: &[LostAt] = if data_crc {
            &[LostAt::Data, LostAt::Entry, LostAt::Checksum]
        } else {
            &[LostAt::Data, LostAt::Entry]
        };
        for &place in places {
            for storing in [
                Storing::NewBlock,
                Storing::Overwrite,
                Storing::Partial,
                Storing::Group,
                Storing::ReadAdmission,
                Storing::ThroughAdmission,
            ] {
                let what = format!(
                    "{storing:?} with the page of its {place:?} lost (data_crc {data_crc})"
                );
                let bed = Bed::new(data_crc);
                let mut written = Written::default();
                let mut backing_only = Vec::new();
                {
                    let engine = &bed.engine;
                    let mut lane = engine.lane().unwrap();
                    for lba in 0..40 {
                        written.write(&mut lane, lba);
                    }
                    // Blocks on the backing store only, for the admissions.
                    engine.set_mode(CacheMode::WriteAround);
                    for lba in 100..110 {
                        written.write(&mut lane, lba);
                        backing_only.push(lba);
                    }
                    engine.set_mode(CacheMode::WriteBack);
                    let _ = lane.drain();
                    bed.medium.lose_page_at_store(place.trigger(&bed));
                    match storing {
                        Storing::NewBlock => written.write(&mut lane, 200),
                        Storing::Overwrite => written.write(&mut lane, 7),
                        Storing::Partial => {
                            let mut data = written.blocks[&9].clone();
                            data[300..400].fill(0xa5);
                            lane.write(9 * BLOCK_BYTES + 300, &data[300..400], false).unwrap();
                            written.blocks.insert(9, data);
                        }
                        Storing::Group => {
                            let blocks: Vec<(u64, Vec<u8>)> =
                                (0..8).map(|i| (300 + i, written.data(300 + i))).collect();
                            let writes: Vec<WriteRequest<'_>> = blocks
                                .iter()
                                .map(|(lba, data)| WriteRequest {
                                    offset: lba * BLOCK_BYTES,
                                    data,
                                    fua: false,
                                })
                                .collect();
                            let mut outcomes = Vec::new();
                            lane.write_batch(&writes, &mut outcomes);
                            for ((lba, data), outcome) in blocks.into_iter().zip(outcomes) {
                                outcome.unwrap_or_else(|e| panic!("{what}: write of {lba}: {e}"));
                                written.blocks.insert(lba, data);
                            }
                        }
                        Storing::ReadAdmission => {
                            let mut buf = vec![0u8; BLOCK];
                            lane.read(104 * BLOCK_BYTES, &mut buf).unwrap();
                            assert!(buf == written.blocks[&104], "{what}: the read");
                        }
                        Storing::ThroughAdmission => {
                            engine.set_mode(CacheMode::WriteThrough);
                            written.write(&mut lane, 105);
                            lane.flush().unwrap();
                        }
                    }
                    assert!(!bed.medium.loss_at_store_armed(), "{what}: no store met the page");
                    assert!(
                        written.failed.is_empty(),
                        "{what}: writes failed: {:?}",
                        written.failed
                    );
                    let (wrong, failed) = written.check_all(&mut lane);
                    assert!(
                        wrong.is_empty() && failed.is_empty(),
                        "{what}: wrong {wrong:?}, failed {failed:?}"
                    );
                    if engine.stats().unlanded_stores > 0 {
                        unlanded_runs += 1;
                    }
                }
                bed.engine.audit().unwrap();
                let (bed, _report) = bed.restart(&[]);
                let mut lane = bed.engine.lane().unwrap();
                let (wrong, failed) = written.check_all(&mut lane);
                assert!(wrong.is_empty(), "{what}: after the restart, other data: {wrong:?}");
                assert!(failed.is_empty(), "{what}: after the restart, reads failed: {failed:?}");
                drop(lane);
                bed.engine.audit().unwrap();
            }
        }
    }
    // Every data-page case (and most others) stored into the page it lost.
    assert!(unlanded_runs >= 12, "only {unlanded_runs} runs met a lost page in their stores");
}

/// A write-back that meets a poisoned line in a dirty block's checksum: the page it takes
/// is settled at once, which writes that block back too (its data still reads; its checksum
/// is what was lost). The write-back does not count it as unreadable: the drain succeeds,
/// and every block reads back as written, now and after a restart.
#[test]
fn a_write_back_meeting_a_lost_checksum_page_counts_no_block_unreadable_that_settled() {
    let bed = Bed::new(true);
    let mut written = Written::default();
    let layout = bed.engine.layout().clone();
    {
        let mut lane = bed.engine.lane().unwrap();
        for lba in 0..40 {
            written.write(&mut lane, lba);
        }
        let slot = bed.slot_of(&written.blocks[&3]);
        bed.medium.poison_mapped(layout.crc_offset(slot), 4);
        lane.drain().unwrap();
        let stats = bed.engine.stats();
        assert_eq!(stats.dirty_slots, 0, "{stats:?}");
        assert_eq!(stats.unreadable_dirty, 0, "{stats:?}");
        assert!(stats.medium_read_errors >= 1, "{stats:?}");
        let (wrong, failed) = written.check_all(&mut lane);
        assert!(wrong.is_empty() && failed.is_empty(), "wrong {wrong:?}, failed {failed:?}");
    }
    let slot = bed.slot_of(&written.blocks[&3]);
    let (bed, _report) = bed.restart(&[layout.crc_offset(slot)]);
    let mut lane = bed.engine.lane().unwrap();
    let (wrong, failed) = written.check_all(&mut lane);
    assert!(wrong.is_empty() && failed.is_empty(), "wrong {wrong:?}, failed {failed:?}");
}
