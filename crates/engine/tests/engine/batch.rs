//! Batches: group commit really shares fences, keeps per-request results and order, and
//! leaves the same data as the writes done one by one.

use std::sync::Arc;

use pmcache_engine::testing::SimBacking;
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, Error, Lane, ManualClock, ReadRequest, WriteRequest,
};
use pmcache_media::{CrashMedium, CrashSwitch};

const BLOCK: usize = 512;
const BLOCKS: u64 = 256;
/// 4 KiB superblock + 4 KiB metadata + 128 slots.
const MEDIUM_BYTES: u64 = 8192 + 128 * BLOCK as u64;

type SimEngine = Engine<CrashMedium, SimBacking, Arc<ManualClock>>;

fn engine(mode: CacheMode) -> (SimEngine, Arc<CrashSwitch>) {
    engine_over(mode, BLOCKS)
}

fn engine_over(mode: CacheMode, backing_blocks: u64) -> (SimEngine, Arc<CrashSwitch>) {
    let switch = CrashSwitch::new();
    let config = Config {
        mode,
        block_size: BLOCK as u32,
        max_lanes: 2,
        admission: AdmissionConfig::Always,
        ..Config::default()
    };
    let engine = Engine::format(
        CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1),
        SimBacking::new(backing_blocks * BLOCK as u64, switch.clone(), 2),
        Arc::new(ManualClock::default()),
        &config,
    )
    .unwrap();
    (engine, switch)
}

fn block_of(byte: u8) -> Vec<u8> {
    vec![byte; BLOCK]
}

type SimLane<'e> = Lane<'e, CrashMedium, SimBacking, Arc<ManualClock>>;

fn write_batch_on(lane: &mut SimLane<'_>, writes: &[(u64, Vec<u8>)]) -> Vec<Result<(), Error>> {
    let requests: Vec<WriteRequest<'_>> = writes
        .iter()
        .map(|(offset, data)| WriteRequest { offset: *offset, data, fua: false })
        .collect();
    let mut outcomes = Vec::new();
    lane.write_batch(&requests, &mut outcomes);
    outcomes
}

fn write_batch(engine: &SimEngine, writes: &[(u64, Vec<u8>)]) -> Vec<Result<(), Error>> {
    write_batch_on(&mut engine.lane().unwrap(), writes)
}

fn read_block(engine: &SimEngine, lba: u64) -> Vec<u8> {
    let mut buf = block_of(0);
    engine.lane().unwrap().read(lba * BLOCK as u64, &mut buf).unwrap();
    buf
}

/// 16 new blocks: 2 fences for the group (data, entries); 16 overwrites: 2 as well (the
/// replaced entries are zeroed and left for the lane's next fence: see `Stripe`). One at a
/// time: 2 fences per write. Dropping a lane whose last zeroings are not fenced yet fences.
#[test]
fn a_group_shares_its_fences() {
    let (engine, switch) = engine(CacheMode::WriteBack);
    let mut lane = engine.lane().unwrap();
    let fresh: Vec<(u64, Vec<u8>)> =
        (0..16).map(|b| (b * BLOCK as u64, block_of(b as u8 + 1))).collect();
    let before = switch.points();
    assert!(write_batch_on(&mut lane, &fresh).iter().all(Result::is_ok));
    assert_eq!(switch.points() - before, 2, "fences for a group of 16 new blocks");

    let over: Vec<(u64, Vec<u8>)> =
        (0..16).map(|b| (b * BLOCK as u64, block_of(b as u8 + 100))).collect();
    let before = switch.points();
    assert!(write_batch_on(&mut lane, &over).iter().all(Result::is_ok));
    assert_eq!(switch.points() - before, 2, "fences for a group of 16 overwrites");

    let before = switch.points();
    for (offset, data) in &over {
        lane.write(*offset, data, false).unwrap();
    }
    assert_eq!(switch.points() - before, 2 * 16, "fences for 16 overwrites one at a time");
    let before = switch.points();
    drop(lane);
    assert_eq!(switch.points() - before, 1, "the last overwrite's zeroing is fenced at drop");
    let before = switch.points();
    drop(engine.lane().unwrap());
    assert_eq!(switch.points() - before, 0, "a lane with nothing pending drops without a fence");
    for b in 0..16 {
        assert_eq!(read_block(&engine, b), block_of(b as u8 + 100), "block {b}");
    }
    let stats = engine.stats();
    assert_eq!(stats.writes, 48);
    assert_eq!(stats.bytes_written, 48 * BLOCK as u64);
    assert_eq!(stats.write_hits, 32);
    assert_eq!(stats.dirty_slots, 16);
}

/// Writes of one group whose blocks share stripes share the stripe's lock: still one round (no
/// write counted as waiting, no extra entry fence) — new blocks and overwrites alike.
#[test]
fn writes_on_one_stripe_share_its_lock() {
    // Consecutive blocks fall in distinct stripes (a multiplicative hash): look further.
    const SPAN: u64 = 1 << 14;
    let (engine, switch) = engine_over(CacheMode::WriteBack, SPAN);
    let mut by_stripe = std::collections::HashMap::<usize, Vec<u64>>::new();
    for lba in 0..SPAN {
        by_stripe.entry(pmcache_engine::testing::stripe_of(&engine, lba)).or_default().push(lba);
    }
    // Pairs (and more) of blocks on one stripe, each stripe's blocks apart in the batch.
    let mut shared: Vec<Vec<u64>> = by_stripe.into_values().filter(|b| b.len() > 1).collect();
    shared.sort();
    shared.truncate(8);
    let lbas: Vec<u64> = (0..2).flat_map(|i| shared.iter().map(move |b| b[i])).collect();
    assert_eq!(lbas.len(), 16, "16 Ki blocks on 1,024 stripes share every stripe");
    let stripes: std::collections::HashSet<usize> =
        lbas.iter().map(|&b| pmcache_engine::testing::stripe_of(&engine, b)).collect();
    assert_eq!(stripes.len(), 8, "16 writes on 8 stripes");
    let mut lane = engine.lane().unwrap();
    for round in 1..=2u8 {
        let writes: Vec<(u64, Vec<u8>)> =
            lbas.iter().map(|&b| (b * BLOCK as u64, block_of(b as u8 ^ round))).collect();
        let before = switch.points();
        assert!(write_batch_on(&mut lane, &writes).iter().all(Result::is_ok));
        // Overwrites: the second copy freed on a stripe finds the first one's zeroing still
        // pending (one per stripe: see `Stripe`), so the group fences once more before it
        // releases its stripes.
        let fences = if round == 1 { 2 } else { 3 };
        assert_eq!(switch.points() - before, fences, "fences for round {round}");
    }
    drop(lane);
    assert_eq!(engine.stats().group_stripe_waits, 0);
    for &b in &lbas {
        assert_eq!(read_block(&engine, b), block_of(b as u8 ^ 2), "block {b}");
    }
}

/// A repeated block, a partial write and an out-of-range write inside one batch: each gets its
/// own result, and the data is what the writes one by one would leave.
#[test]
fn order_and_results_are_per_request() {
    let (engine, _switch) = engine(CacheMode::WriteBack);
    let mut partial = block_of(7);
    partial.truncate(100);
    let writes = vec![
        (0, block_of(1)),
        (BLOCK as u64, block_of(2)),
        (0, block_of(3)),
        (BLOCKS * BLOCK as u64, block_of(9)),
        (BLOCK as u64 + 10, partial.clone()),
        (2 * BLOCK as u64, block_of(4)),
    ];
    let outcomes = write_batch(&engine, &writes);
    assert_eq!(outcomes.len(), writes.len());
    for (i, outcome) in outcomes.iter().enumerate() {
        match i {
            3 => assert!(matches!(outcome, Err(Error::OutOfRange { .. })), "{outcome:?}"),
            _ => assert!(outcome.is_ok(), "write {i}: {outcome:?}"),
        }
    }
    assert_eq!(read_block(&engine, 0), block_of(3), "the later write of a block wins");
    let mut expected = block_of(2);
    expected[10..110].copy_from_slice(&partial);
    assert_eq!(read_block(&engine, 1), expected, "the partial write lands on the earlier one");
    assert_eq!(read_block(&engine, 2), block_of(4));

    let mut bufs = [block_of(0), block_of(0), block_of(0), vec![0u8; 10]];
    let [a, b, c, d] = &mut bufs;
    let mut reads = [
        ReadRequest { offset: 2 * BLOCK as u64, buf: a },
        ReadRequest { offset: 0, buf: b },
        ReadRequest { offset: BLOCKS * BLOCK as u64, buf: c },
        ReadRequest { offset: BLOCK as u64 + 10, buf: d },
    ];
    let mut outcomes = Vec::new();
    engine.lane().unwrap().read_batch(&mut reads, &mut outcomes);
    assert!(outcomes[0].is_ok() && outcomes[1].is_ok() && outcomes[3].is_ok(), "{outcomes:?}");
    assert!(matches!(outcomes[2], Err(Error::OutOfRange { .. })), "{:?}", outcomes[2]);
    assert_eq!(bufs[0], block_of(4));
    assert_eq!(bufs[1], block_of(3));
    assert_eq!(bufs[3], partial[..10]);
}

/// Other modes write through to the backing store one request at a time, with the same
/// results as `write`.
#[test]
fn other_modes_run_each_write_alone() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround, CacheMode::PassThrough] {
        let (engine, _switch) = engine(mode);
        let writes: Vec<(u64, Vec<u8>)> =
            (0..8).map(|b| (b * BLOCK as u64, block_of(b as u8 + 1))).collect();
        assert!(write_batch(&engine, &writes).iter().all(Result::is_ok), "{mode}");
        let backing = engine.backing().contents();
        for b in 0..8usize {
            assert_eq!(backing[b * BLOCK..(b + 1) * BLOCK], block_of(b as u8 + 1), "{mode} {b}");
        }
    }
}

/// A batch larger than the cache: groups are bounded, the lane evicts and writes back between
/// them, and every block reads back.
#[test]
fn a_batch_larger_than_the_cache() {
    let (engine, _switch) = engine(CacheMode::WriteBack);
    let writes: Vec<(u64, Vec<u8>)> =
        (0..BLOCKS).map(|b| (b * BLOCK as u64, block_of((b % 250) as u8 + 1))).collect();
    assert!(write_batch(&engine, &writes).iter().all(Result::is_ok));
    for b in 0..BLOCKS {
        assert_eq!(read_block(&engine, b), block_of((b % 250) as u8 + 1), "block {b}");
    }
    engine.lane().unwrap().drain().unwrap();
    let backing = engine.backing().contents();
    for b in 0..BLOCKS as usize {
        assert_eq!(backing[b * BLOCK..(b + 1) * BLOCK], block_of((b % 250) as u8 + 1));
    }
}

/// Reads at the edges of blocks and of the device, of every awkward length, in one batch: each
/// gets the same result and bytes as the same read alone, and the bytes the device holds —
/// hits and misses, reads across two blocks, empty reads, reads past the end.
#[test]
fn batched_reads_at_block_and_device_edges_match_single_reads() {
    let (engine, _switch) = engine(CacheMode::WriteBack);
    let block = BLOCK as u64;
    let size = BLOCKS * block;
    // Neighbouring bytes differ, so a copy one byte off shows.
    let byte_at = |pos: u64| (pos.wrapping_mul(0x9E37_79B9) >> 11) as u8;
    let device: Vec<u8> = (0..size).map(byte_at).collect();
    let mut lane = engine.lane().unwrap();
    // Twice the cache: half the blocks end up written back and evicted (read misses).
    for (lba, data) in device.chunks(BLOCK).enumerate() {
        lane.write(lba as u64 * block, data, false).unwrap();
    }
    // The first blocks again, out of order: each lands in a slot beside one that holds no
    // block following it on the device, so a copy running past its slot's end shows.
    for lba in [0, 2, 1] {
        lane.write(lba * block, &device[(lba * block) as usize..][..BLOCK], false).unwrap();
    }
    let mut extents = Vec::new();
    for lba in [0, 1, 100, BLOCKS - 2, BLOCKS - 1, BLOCKS] {
        for delta in [-1i64, 0, 1, 2, BLOCK as i64 / 2] {
            let Some(offset) = (lba * block).checked_add_signed(delta) else { continue };
            for len in [0, 1, 8, block - 1, block, block + 1, 2 * block] {
                extents.push((offset, len as usize));
            }
        }
    }
    let mut bufs: Vec<Vec<u8>> = extents.iter().map(|&(_, len)| vec![0xee; len]).collect();
    let mut reads: Vec<ReadRequest<'_>> = extents
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, _), buf)| ReadRequest { offset, buf })
        .collect();
    let mut outcomes = Vec::new();
    let before = engine.stats();
    lane.read_batch(&mut reads, &mut outcomes);
    let after = engine.stats();
    assert!(after.read_hits > before.read_hits, "some batched reads hit");
    assert!(after.read_misses_admitted > before.read_misses_admitted, "some missed");
    assert_eq!(outcomes.len(), extents.len());
    let mut in_range = 0;
    for ((&(offset, len), batched), outcome) in extents.iter().zip(&bufs).zip(&outcomes) {
        let mut alone = vec![0xee; len];
        let alone_outcome = lane.read(offset, &mut alone);
        assert_eq!(format!("{outcome:?}"), format!("{alone_outcome:?}"), "{offset} +{len}");
        if offset + len as u64 <= size {
            in_range += 1;
            let expected = &device[offset as usize..offset as usize + len];
            assert!(batched == expected, "batched read {offset} +{len}: wrong bytes");
            assert!(alone == expected, "read {offset} +{len}: wrong bytes");
        } else {
            assert!(matches!(outcome, Err(Error::OutOfRange { .. })), "{offset} +{len}");
        }
    }
    assert!(in_range > 100, "{in_range} reads inside the device");
}

/// A group of which only some writes find a slot: every other slot holds a dirty block, and
/// the backing store fails the write-back that would free one. The writes that got a slot
/// land; the others run alone after them and report the error; no cached block is touched;
/// once the backing store heals, everything drains.
#[test]
fn writes_of_a_group_that_find_no_slot_fail_alone_and_touch_nothing_else() {
    let (engine, _switch) = engine(CacheMode::WriteBack);
    let mut lane = engine.lane().unwrap();
    // 110 of the 128 slots dirty.
    let cached = 110;
    for lba in 0..cached {
        lane.write(lba * BLOCK as u64, &block_of(lba as u8 + 1), false).unwrap();
    }
    engine.backing().fail_writes_from(0);
    let writes: Vec<(u64, Vec<u8>)> =
        (0..32).map(|i| ((200 + i) * BLOCK as u64, block_of(i as u8 + 150))).collect();
    let outcomes = write_batch_on(&mut lane, &writes);
    let landed = outcomes.iter().filter(|o| o.is_ok()).count();
    assert!(landed > 0 && landed < writes.len(), "{landed} of {} writes landed", writes.len());
    for (i, outcome) in outcomes.iter().enumerate() {
        let lba = 200 + i as u64;
        match outcome {
            Ok(()) => assert_eq!(read_block(&engine, lba), block_of(i as u8 + 150), "{lba}"),
            Err(err) => {
                assert!(matches!(err, Error::Backing(_)), "write {i}: {err:?}");
                assert_eq!(read_block(&engine, lba), block_of(0), "failed write {lba}");
            }
        }
    }
    for lba in 0..cached {
        assert_eq!(read_block(&engine, lba), block_of(lba as u8 + 1), "cached block {lba}");
    }
    engine.backing().heal();
    lane.drain().unwrap();
    let backing = engine.backing().contents();
    for lba in 0..cached as usize {
        assert_eq!(backing[lba * BLOCK..(lba + 1) * BLOCK], block_of(lba as u8 + 1), "{lba}");
    }
    for (i, outcome) in outcomes.iter().enumerate() {
        let at = (200 + i) * BLOCK;
        let expected = if outcome.is_ok() { block_of(i as u8 + 150) } else { block_of(0) };
        assert_eq!(backing[at..at + BLOCK], expected, "block {}", 200 + i);
    }
}
