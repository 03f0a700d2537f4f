//! What the engine counts, and how much backing-store work an operation costs: a trim's
//! counters, a whole-block write-through that needs no read, a drain that syncs once per
//! batch rather than once per block, a writer short of slots writing back the oldest dirty
//! blocks first. Each of these once changed (in a mutation run) without
//! any data going wrong, so only counting tells them apart.

use std::sync::Arc;

use pmcache_engine::testing::{SimBacking, model};
use pmcache_engine::{AdmissionConfig, CacheMode, Config, Engine, EvictionKind, ManualClock};
use pmcache_media::{CrashMedium, CrashSwitch, MediumSet};

const BLOCK: usize = model::BLOCK;
const BLOCK_BYTES: u64 = BLOCK as u64;
/// Room for the superblock, the metadata table and about 700 slots.
const MEDIUM_BYTES: u64 = 16384 + 700 * BLOCK_BYTES;
const BACKING_BLOCKS: u64 = 2048;
/// `cache/mod.rs`'s `DRAIN_BATCH`: a drain writes back this many blocks per backing sync.
const DRAIN_BATCH: u64 = 256;

use model::SimEngine;

fn engine(mode: CacheMode) -> SimEngine {
    let switch = CrashSwitch::new();
    let config = Config {
        max_lanes: 1,
        ..model::config(mode, EvictionKind::Clock, AdmissionConfig::Always)
    };
    Engine::format(
        MediumSet::single(CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1)),
        SimBacking::new(BACKING_BLOCKS * BLOCK_BYTES, switch, 2),
        Arc::new(ManualClock::default()),
        &config,
    )
    .expect("format")
}

#[test]
fn a_trim_counts_the_whole_blocks_it_covers_and_the_dirty_ones_it_drops() {
    let engine = engine(CacheMode::WriteBack);
    let mut lane = engine.lane().expect("lane");
    // Blocks 0..4 clean (written, then drained), 4..8 dirty.
    for lba in 0..8 {
        if lba == 4 {
            lane.drain().expect("drain");
        }
        lane.write(lba * BLOCK_BYTES, &[lba as u8 + 1; BLOCK], false).expect("write");
    }
    assert_eq!(engine.stats().dirty_slots, 4);
    // From the middle of block 2 to the middle of block 7: whole blocks 3..7, one clean and
    // three dirty.
    lane.trim(2 * BLOCK_BYTES + 100, 5 * BLOCK_BYTES).expect("trim");
    let stats = engine.stats();
    assert_eq!((stats.trims, stats.dirty_slots), (4, 1), "{stats:?}");
    // The partly covered blocks and those outside are still cached.
    let hits = stats.read_hits;
    let mut buf = vec![0u8; BLOCK];
    for lba in [0, 1, 2, 7] {
        lane.read(lba * BLOCK_BYTES, &mut buf).expect("read");
        assert_eq!(buf, [lba as u8 + 1; BLOCK], "block {lba}");
    }
    assert_eq!(engine.stats().read_hits, hits + 4);
}

#[test]
fn a_whole_block_write_through_does_not_read_the_backing_store() {
    let engine = engine(CacheMode::WriteThrough);
    let mut lane = engine.lane().expect("lane");
    let (_, reads_before) = engine.backing().io_counts();
    lane.write(10 * BLOCK_BYTES, &[7; BLOCK], false).expect("whole block");
    lane.write(20 * BLOCK_BYTES, &[8; 2 * BLOCK], false).expect("two whole blocks");
    assert_eq!(engine.backing().io_counts().1, reads_before, "a whole-block write read");
    // A partial block of an uncached block is merged with what the backing store holds.
    lane.write(30 * BLOCK_BYTES + 8, &[9; 16], false).expect("partial block");
    assert_eq!(engine.backing().io_counts().1, reads_before + 1);
}

#[test]
fn a_drain_syncs_the_backing_store_once_per_batch_of_blocks() {
    let engine = engine(CacheMode::WriteBack);
    assert!(engine.stats().slot_count > 2 * DRAIN_BATCH, "{:?}", engine.stats());
    let mut lane = engine.lane().expect("lane");
    for (blocks, batches) in
        [(10, 1), (DRAIN_BATCH, 1), (DRAIN_BATCH + 1, 2), (2 * DRAIN_BATCH + 5, 3)]
    {
        for lba in 0..blocks {
            lane.write(lba * BLOCK_BYTES, &[blocks as u8; BLOCK], false).expect("write");
        }
        assert_eq!(engine.stats().dirty_slots, blocks);
        let flushes = engine.backing().flushes();
        lane.drain().expect("drain");
        assert_eq!(engine.stats().dirty_slots, 0);
        assert_eq!(engine.backing().flushes() - flushes, batches, "{blocks} dirty blocks");
    }
}

/// With no clean block to evict, a writer writes back the *oldest* dirty blocks the hand
/// passed (by sequence number), not the first ones in slot order. Here the lowest slots hold
/// the newest blocks (written into slots freed by a trim), so the two orders differ.
#[test]
fn a_writer_short_of_slots_writes_back_the_oldest_dirty_blocks() {
    let engine = engine(CacheMode::WriteBack);
    let slots = engine.stats().slot_count;
    let mut lane = engine.lane().expect("lane");
    // Block b in slot b (the pool hands out the lowest slots first), all dirty.
    for lba in 0..slots {
        lane.write(lba * BLOCK_BYTES, &[1; BLOCK], false).expect("write");
    }
    // Slots 0..64 freed, then refilled by 64 newer blocks.
    lane.trim(0, 64 * BLOCK_BYTES).expect("trim");
    for lba in 1000..1064 {
        lane.write(lba * BLOCK_BYTES, &[2; BLOCK], false).expect("newer write");
    }
    assert_eq!(engine.stats().dirty_slots, slots);
    assert_eq!(engine.stats().writebacks, 0);
    // No free slot: this write makes room by writing back.
    lane.write(2000 * BLOCK_BYTES, &[3; BLOCK], false).expect("write needing room");
    assert!(engine.stats().writebacks > 0);
    let backing = engine.backing().contents();
    let on_backing = |lba: u64| backing[(lba * BLOCK_BYTES) as usize] != 0;
    assert!(on_backing(64), "the oldest dirty block was not written back");
    assert!(
        (1000..1064).all(|lba| !on_backing(lba)),
        "a newer block was written back before older ones"
    );
}
