//! Cached data that cannot be trusted: a checksum mismatch (a cache formatted with data
//! checksums) or a poisoned line of the medium, injected under a live engine. A clean block is
//! read from the backing store instead (and cached again); a dirty one fails its reads and
//! its write-back, never returning or writing other data; every other block is served, and
//! written back, as before.

use std::sync::Arc;

use pmcache_engine::format::{DATA_CRC_BYTES, FEATURE_DATA_CRC, Superblock};
use pmcache_engine::testing::{SimBacking, model};
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, Error, EvictionKind, Lane, ManualClock, Unreadable,
};
use pmcache_media::{CrashMedium, CrashSwitch, Medium};

const BLOCK: usize = model::BLOCK;
const BLOCK_BYTES: u64 = BLOCK as u64;
const MEDIUM_BYTES: u64 = 16384 + 128 * BLOCK_BYTES;
const BACKING_BLOCKS: u64 = 512;

type SimEngine = Engine<CrashMedium, SimBacking, Arc<ManualClock>>;
type SimLane<'e> = Lane<'e, CrashMedium, SimBacking, Arc<ManualClock>>;

struct Bed {
    medium: CrashMedium,
    engine: SimEngine,
}

fn config(data_crc: bool) -> Config {
    Config {
        max_lanes: 2,
        data_crc,
        ..model::config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always)
    }
}

fn bed(data_crc: bool) -> Bed {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1);
    let backing = SimBacking::new(BACKING_BLOCKS * BLOCK_BYTES, switch, 2);
    let config = config(data_crc);
    let engine =
        Engine::format(medium.clone(), backing, Arc::new(ManualClock::default()), &config).unwrap();
    Bed { medium, engine }
}

fn block_of(byte: u8) -> Vec<u8> {
    vec![byte; BLOCK]
}

fn read(lane: &mut SimLane<'_>, lba: u64) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; BLOCK];
    lane.read(lba * BLOCK_BYTES, &mut buf).map(|()| buf)
}

fn backing_block(engine: &SimEngine, lba: u64) -> Vec<u8> {
    let at = (lba * BLOCK_BYTES) as usize;
    engine.backing().contents()[at..at + BLOCK].to_vec()
}

/// The slot whose data is `data` (each test writes blocks of distinct bytes).
fn slot_holding(bed: &Bed, data: &[u8]) -> u32 {
    let layout = bed.engine.layout();
    let mut buf = vec![0u8; BLOCK];
    (0..layout.slot_count as u32)
        .find(|&slot| {
            bed.medium.read(layout.data_offset(slot), &mut buf);
            buf == data
        })
        .expect("a slot holds the block")
}

/// Flips one bit of `slot`'s data on the medium (bit rot under the cache).
fn flip_bit(bed: &Bed, slot: u32) {
    let at = bed.engine.layout().data_offset(slot) + BLOCK_BYTES / 2 + 3;
    let mut byte = [0u8];
    bed.medium.read(at, &mut byte);
    bed.medium.write_persist(at, &[byte[0] ^ 0x10]);
}

/// A cache formatted with `--data-crc` records it (format version 4, feature flag set, the
/// checksums between the entries and the data); one formatted without does not, and a
/// superblock with a feature bit this build does not know is refused.
#[test]
fn the_data_checksum_is_a_format_feature() {
    for data_crc in [false, true] {
        let bed = bed(data_crc);
        let superblock = *bed.engine.superblock();
        assert_eq!(superblock.geometry.data_crc, data_crc);
        let geometry = superblock.geometry;
        if data_crc {
            let last = geometry.slot_count as u32 - 1;
            assert!(geometry.crc_offset(last) + DATA_CRC_BYTES <= geometry.data_offset);
            assert!(geometry.crc_offset(0) >= geometry.meta_offset + 16 * geometry.slot_count);
        }
        let mut header = vec![0u8; 4096];
        bed.medium.read(0, &mut header);
        assert_eq!(u32::from_le_bytes(header[8..12].try_into().unwrap()), 4);
        let features = u32::from_le_bytes(header[120..124].try_into().unwrap());
        assert_eq!(features, if data_crc { FEATURE_DATA_CRC } else { 0 });
        let decoded = Superblock::decode(&header, MEDIUM_BYTES).unwrap();
        assert_eq!(decoded.geometry.data_crc, data_crc);
    }
    let mut header = Superblock {
        geometry: pmcache_engine::format::Geometry::plan(MEDIUM_BYTES, 4096, true).unwrap(),
        ..*bed(false).engine.superblock()
    }
    .encode();
    header[120] |= 0b10;
    let crc = crc32c::crc32c(&header[..124]);
    header[124..128].copy_from_slice(&crc.to_le_bytes());
    let err = Superblock::decode(&header, MEDIUM_BYTES).unwrap_err();
    assert!(err.to_string().contains("feature flags 0x3"), "{err}");
}

/// A clean block whose data fails its checksum is read from the backing store (the right
/// data), counted, dropped and cached again; reads of part of it and a partial write over it
/// are right too.
#[test]
fn a_clean_block_that_fails_its_checksum_is_read_from_the_backing_store() {
    let bed = bed(true);
    let mut lane = bed.engine.lane().unwrap();
    lane.write(3 * BLOCK_BYTES, &block_of(0x33), false).unwrap();
    lane.write(4 * BLOCK_BYTES, &block_of(0x44), false).unwrap();
    lane.drain().unwrap();
    flip_bit(&bed, slot_holding(&bed, &block_of(0x33)));
    assert_eq!(read(&mut lane, 3).unwrap(), block_of(0x33));
    let stats = bed.engine.stats();
    assert_eq!((stats.data_crc_mismatches, stats.unreadable_clean), (1, 1));
    assert_eq!(stats.unreadable_dirty, 0);
    assert_eq!(read(&mut lane, 3).unwrap(), block_of(0x33), "cached again, whole");
    assert_eq!(bed.engine.stats().data_crc_mismatches, 1);

    // A part of a block (the whole block is checked), and a partial write (merged with the
    // backing store's copy of a clean block that fails).
    flip_bit(&bed, slot_holding(&bed, &block_of(0x44)));
    let mut part = vec![0u8; 100];
    lane.read(4 * BLOCK_BYTES + 200, &mut part).unwrap();
    assert_eq!(part, vec![0x44; 100]);
    flip_bit(&bed, slot_holding(&bed, &block_of(0x33)));
    lane.write(3 * BLOCK_BYTES, &[0x55; 100], false).unwrap();
    let merged = [vec![0x55; 100], vec![0x33; BLOCK - 100]].concat();
    assert_eq!(read(&mut lane, 3).unwrap(), merged);
    flip_bit(&bed, slot_holding(&bed, &merged));
    lane.drain().expect_err("the merged block is dirty and fails its checksum");
    let stats = bed.engine.stats();
    assert_eq!((stats.data_crc_mismatches, stats.unreadable_clean), (4, 3));
    assert_eq!(stats.unreadable_dirty, 1);
    drop(lane);
    bed.engine.audit().unwrap();
}

/// A dirty block whose data fails its checksum is the block's only copy: its reads fail with
/// an error that names it (EIO to a client), a partial write over it fails, its write-back is
/// refused (the backing store keeps its older data, never the corrupt one), and every other
/// block is served and written back. A write of the whole block replaces it.
#[test]
fn a_dirty_block_that_fails_its_checksum_is_an_error_never_other_data() {
    let bed = bed(true);
    let mut lane = bed.engine.lane().unwrap();
    lane.write(7 * BLOCK_BYTES, &block_of(0x70), false).unwrap();
    lane.drain().unwrap();
    lane.write(7 * BLOCK_BYTES, &block_of(0x77), false).unwrap();
    lane.write(8 * BLOCK_BYTES, &block_of(0x88), false).unwrap();
    flip_bit(&bed, slot_holding(&bed, &block_of(0x77)));
    let err = read(&mut lane, 7).unwrap_err();
    assert!(
        matches!(err, Error::CachedBlockUnreadable { lba: 7, why: Unreadable::Mismatch { .. } }),
        "{err}"
    );
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("block 7") && err.to_string().contains("checksum"), "{err}");
    let mut part = vec![0u8; 100];
    assert!(lane.read(7 * BLOCK_BYTES + 10, &mut part).is_err(), "a part of it too");
    assert!(
        lane.write(7 * BLOCK_BYTES, &[1u8; 100], false).is_err(),
        "a partial write cannot merge"
    );
    assert_eq!(read(&mut lane, 8).unwrap(), block_of(0x88));

    let err = lane.drain().unwrap_err();
    assert!(matches!(err, Error::CachedBlockUnreadable { lba: 7, .. }), "{err}");
    assert_eq!(backing_block(&bed.engine, 8), block_of(0x88), "the others are written back");
    assert_eq!(backing_block(&bed.engine, 7), block_of(0x70), "the corrupt copy is not");
    assert_eq!(bed.engine.stats().dirty_slots, 1);
    assert!(bed.engine.stats().unreadable_dirty >= 3);

    lane.write(7 * BLOCK_BYTES, &block_of(0x79), false).unwrap();
    assert_eq!(read(&mut lane, 7).unwrap(), block_of(0x79));
    lane.drain().unwrap();
    assert_eq!(backing_block(&bed.engine, 7), block_of(0x79));
    drop(lane);
    bed.engine.audit().unwrap();
}

/// The cleaner's batches check each block as a lane's write-back does: a corrupt dirty
/// block stays dirty, the cleaner's drain ends with an error instead of trying it forever,
/// and the rest is written back.
#[test]
fn the_cleaner_leaves_a_dirty_block_that_fails_its_checksum_dirty() {
    let bed = bed(true);
    let mut lane = bed.engine.lane().unwrap();
    for lba in 0..6u64 {
        lane.write(lba * BLOCK_BYTES, &block_of(0x10 + lba as u8), false).unwrap();
    }
    flip_bit(&bed, slot_holding(&bed, &block_of(0x12)));
    drop(lane);
    let mut cleaner = bed.engine.cleaner(pmcache_engine::CleanerConfig::default()).unwrap();
    let err = cleaner.drain().expect_err("one block cannot be written back");
    assert!(matches!(err, Error::WriteBackIncomplete { unreadable: 1.., .. }), "{err}");
    assert!(err.to_string().contains("cannot be read from the cache"), "{err}");
    drop(cleaner);
    for lba in [0u64, 1, 3, 4, 5] {
        assert_eq!(backing_block(&bed.engine, lba), block_of(0x10 + lba as u8));
    }
    assert_eq!(backing_block(&bed.engine, 2), block_of(0));
    let stats = bed.engine.stats();
    assert_eq!(stats.dirty_slots, 1);
    // Each try counts: the batch that found it, and the drain's last try of the refused.
    assert!(stats.data_crc_mismatches >= 1, "{stats:?}");
    assert_eq!(stats.unreadable_dirty, stats.data_crc_mismatches);
}

/// Without data checksums a flipped bit is served as it is: what the checksum buys.
#[test]
fn without_data_checksums_a_flipped_bit_is_served() {
    let bed = bed(false);
    let mut lane = bed.engine.lane().unwrap();
    lane.write(0, &block_of(0x21), false).unwrap();
    flip_bit(&bed, slot_holding(&bed, &block_of(0x21)));
    let got = read(&mut lane, 0).unwrap();
    assert_ne!(got, block_of(0x21));
    assert_eq!(bed.engine.stats().data_crc_mismatches, 0);
}

/// A poisoned line under a clean block: the block is read from the backing store, its slot
/// retired for good (the engine's audit checks it stays out of the pool) while the cache
/// keeps filling its other slots. Under a dirty block: its reads fail, with the poisoned
/// offset, and so does its write-back; the rest is served.
#[test]
fn a_poisoned_line_fails_its_block_only_and_its_slot_is_never_used_again() {
    let bed = bed(false);
    let mut lane = bed.engine.lane().unwrap();
    lane.write(10 * BLOCK_BYTES, &block_of(0xa0), false).unwrap();
    lane.write(11 * BLOCK_BYTES, &block_of(0xb0), false).unwrap();
    lane.drain().unwrap();
    lane.write(11 * BLOCK_BYTES, &block_of(0xb1), false).unwrap();
    lane.write(12 * BLOCK_BYTES, &block_of(0xc1), false).unwrap();
    let layout = bed.engine.layout().clone();
    let clean_slot = slot_holding(&bed, &block_of(0xa0));
    let dirty_slot = slot_holding(&bed, &block_of(0xb1));
    bed.medium.poison(layout.data_offset(clean_slot) + BLOCK_BYTES / 2, 64);
    bed.medium.poison(layout.data_offset(dirty_slot), 1);

    assert_eq!(read(&mut lane, 10).unwrap(), block_of(0xa0));
    let err = read(&mut lane, 11).unwrap_err();
    let poisoned_at = layout.data_offset(dirty_slot);
    assert!(
        matches!(err, Error::CachedBlockUnreadable {
            lba: 11,
            why: Unreadable::Poisoned { offset }
        } if offset == poisoned_at),
        "{err}"
    );
    assert!(err.to_string().contains("poisoned line"), "{err}");
    assert_eq!(read(&mut lane, 12).unwrap(), block_of(0xc1));
    // A read across the three: the dirty one fails it.
    let mut three = vec![0u8; 3 * BLOCK];
    assert!(lane.read(10 * BLOCK_BYTES, &mut three).is_err());
    lane.drain().expect_err("the poisoned dirty block is not written back");
    assert_eq!(backing_block(&bed.engine, 11), block_of(0xb0));
    assert_eq!(backing_block(&bed.engine, 12), block_of(0xc1));
    let stats = bed.engine.stats();
    assert!(stats.medium_read_errors >= 3, "{stats:?}");
    assert_eq!(stats.unreadable_clean, 1);
    assert_eq!(stats.retired_slots, 2);

    // Fill the cache several times over: no block ever lands in a retired slot (it would
    // read back as an error), and the cache keeps serving.
    for round in 0..3u64 {
        for lba in 20..(20 + 200) {
            let byte = (lba + round) as u8;
            lane.write(lba * BLOCK_BYTES, &block_of(byte), false).unwrap();
        }
        for lba in 20..(20 + 200) {
            assert_eq!(read(&mut lane, lba).unwrap(), block_of((lba + round) as u8));
        }
    }
    lane.write(11 * BLOCK_BYTES, &block_of(0xb2), false).unwrap();
    assert_eq!(read(&mut lane, 11).unwrap(), block_of(0xb2));
    lane.drain().unwrap();
    drop(lane);
    bed.engine.audit().unwrap();
    assert_eq!(bed.engine.stats().retired_slots, 2);
}

/// After a restart, the medium's list of poisoned lines retires their slots at attach, before
/// any block is placed there; a dirty block recovered on one fails its reads (and recovery
/// does not drop it).
#[test]
fn attach_retires_the_slots_the_medium_reports_poisoned() {
    let bed = bed(true);
    let mut lane = bed.engine.lane().unwrap();
    lane.write(5 * BLOCK_BYTES, &block_of(0x55), false).unwrap();
    let layout = bed.engine.layout().clone();
    let dirty_slot = slot_holding(&bed, &block_of(0x55));
    drop(lane);
    let image = bed.medium.durable_image();
    let backing = bed.engine.backing().clone();
    drop(bed);

    let medium = CrashMedium::from_image(image, CrashSwitch::new(), 3);
    let free_slot = dirty_slot + 7;
    medium.poison(layout.data_offset(dirty_slot), 64);
    medium.poison(layout.data_offset(free_slot), 64);
    // One line of checksums holds sixteen slots' checksums: all sixteen are retired.
    medium.poison(layout.crc_offset(dirty_slot + 40), 4);
    let line = layout.crc_offset(dirty_slot + 40) / 64 * 64
        ..layout.crc_offset(dirty_slot + 40) / 64 * 64 + 64;
    let sharing_the_line = (0..layout.slot_count as u32)
        .filter(|&slot| line.contains(&layout.crc_offset(slot)))
        .count() as u64;
    assert_eq!(sharing_the_line, 16);
    let (engine, _report) =
        Engine::open(medium, backing, Arc::new(ManualClock::default()), &config(false)).unwrap();
    assert_eq!(engine.stats().retired_slots, 2 + sharing_the_line);
    let mut lane = engine.lane().unwrap();
    let mut buf = vec![0u8; BLOCK];
    let err = lane.read(5 * BLOCK_BYTES, &mut buf).unwrap_err();
    assert!(matches!(err, Error::CachedBlockUnreadable { lba: 5, .. }), "{err}");
    for lba in 100..200u64 {
        lane.write(lba * BLOCK_BYTES, &block_of(lba as u8), false).unwrap();
        lane.read(lba * BLOCK_BYTES, &mut buf).unwrap();
    }
    drop(lane);
    engine.audit().unwrap();
}

/// A full cache (every slot holds a block, the pool is empty): the slot of a clean block on a
/// poisoned line is retired and freed into the lane's own list, and the lane, finding the pool
/// empty, takes back the slots it freed — never the retired one. (It did: the next write
/// landed there, on the poisoned line, and read back as an error.)
#[test]
fn a_full_cache_never_reuses_a_retired_slot_from_its_own_freed_list() {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1);
    let backing = SimBacking::new(BACKING_BLOCKS * BLOCK_BYTES, switch, 2);
    // Write-only: a read miss is not admitted, so the freed slot waits for the next write.
    let config = Config {
        max_lanes: 2,
        ..model::config(CacheMode::WriteOnly, EvictionKind::Clock, AdmissionConfig::Always)
    };
    let engine =
        Engine::format(medium.clone(), backing, Arc::new(ManualClock::default()), &config).unwrap();
    let bed = Bed { medium, engine };
    let slots = bed.engine.layout().slot_count;
    assert!(slots < 250 && BACKING_BLOCKS > slots + 10);
    let mut lane = bed.engine.lane().unwrap();
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &block_of(lba as u8), false).unwrap();
    }
    lane.drain().unwrap();
    let poisoned = slot_holding(&bed, &block_of(3));
    bed.medium.poison(bed.engine.layout().data_offset(poisoned) + 64, 1);
    assert_eq!(read(&mut lane, 3).unwrap(), block_of(3), "read from the backing store");
    assert_eq!(bed.engine.stats().retired_slots, 1);

    let fresh = slots + 5;
    lane.write(fresh * BLOCK_BYTES, &block_of(0xee), false).unwrap();
    assert_eq!(read(&mut lane, fresh).unwrap(), block_of(0xee), "written to the retired slot");
    let mut buf = vec![0u8; BLOCK];
    bed.medium.read(bed.engine.layout().data_offset(poisoned), &mut buf[..64]);
    assert_ne!(buf[..64], [0xee; 64], "the write reached the poisoned slot");
    drop(lane);
    bed.engine.audit().unwrap();
}
