//! Per-request completion of reads: a miss in flight holds back nothing behind it. A hit
//! started after a miss is answered while the miss's backing read is still held (the latch of
//! `LatchedBacking`); a write that lands while a miss is in flight is never undone by the
//! miss's admission of what it read before the write; a lane given back with misses in flight
//! completes them first.
#![cfg(not(feature = "shuttle"))]

use std::sync::Arc;

use pmcache_engine::testing::latched::{LatchedBacking, latched_engine};
use pmcache_engine::testing::model::{BLOCK, pattern};
use pmcache_engine::{CacheMode, ManualClock, ReadRequest, ReadStart, Ticket};

const B: u64 = BLOCK as u64;

/// Serves every completion `complete` hands over, up to `min` of them waited for.
fn complete(
    lane: &mut pmcache_engine::Lane<
        '_,
        pmcache_engine::testing::model::SimMedium,
        Arc<LatchedBacking>,
        Arc<ManualClock>,
    >,
    min: usize,
) -> Vec<(Ticket, Vec<u8>)> {
    let mut got = Vec::new();
    lane.complete(min, &mut |ticket, result| {
        got.push((ticket, result.expect("the miss's read").to_vec()));
    });
    got
}

#[test]
fn a_hit_started_after_a_miss_is_answered_while_the_miss_is_held() {
    let (backing, engine) = latched_engine(CacheMode::WriteBack);
    let mut lane = engine.lane().expect("lane");
    let written = pattern(9, B, B);
    lane.write(B, &written, false).expect("write block 1");
    backing.hold(true);
    let mut miss_buf = vec![0u8; BLOCK];
    let ReadStart::Pending(ticket) = lane.read_start(0, &mut miss_buf) else {
        panic!("block 0 is not cached: its read must be in flight");
    };
    assert_eq!(lane.pending(), 1);
    let mut hit_buf = vec![0u8; BLOCK];
    let ReadStart::Done(result) = lane.read_start(B, &mut hit_buf) else {
        panic!("block 1 is cached: answered at once");
    };
    result.expect("the hit");
    assert_eq!(hit_buf, written, "the hit's data");
    assert!(complete(&mut lane, 0).is_empty(), "the held miss completed");
    // A batch of hits behind it is answered at once too.
    let mut bufs = [vec![0u8; BLOCK], vec![0u8; BLOCK]];
    let [a, b] = &mut bufs;
    let mut reads = [ReadRequest { offset: B, buf: a }, ReadRequest { offset: B, buf: b }];
    let mut started = Vec::new();
    lane.read_batch_start(&mut reads, &mut started);
    assert!(started.iter().all(|s| matches!(s, ReadStart::Done(Ok(())))), "{started:?}");
    backing.hold(false);
    let done = complete(&mut lane, 1);
    assert_eq!(done, vec![(ticket, pattern(1, 0, B))], "the miss's answer, by its ticket");
    assert_eq!(lane.pending(), 0);
    // Admitted: a hit now.
    let ReadStart::Done(Ok(())) = lane.read_start(0, &mut miss_buf) else {
        panic!("block 0 was admitted by its miss");
    };
    assert_eq!(miss_buf, pattern(1, 0, B));
    assert_eq!(engine.stats().read_misses_admitted, 1);
}

/// In every mode: a write (from another lane) that lands while a miss of its block is in
/// flight leaves the block reading as the write, whatever the miss's admission does with the
/// older data it read; the miss itself answers the old or the new data.
#[test]
fn a_write_beside_a_miss_in_flight_is_never_undone_by_the_miss() {
    for mode in CacheMode::ALL {
        for offset_in_block in [0, 128] {
            let (backing, engine) = latched_engine(mode);
            let mut reader = engine.lane().expect("lane");
            let mut writer = engine.lane().expect("lane");
            backing.hold(true);
            let mut buf = vec![0u8; 256];
            let ReadStart::Pending(_) = reader.read_start(2 * B + offset_in_block, &mut buf) else {
                panic!("{mode:?}: block 2 is not cached: its read must be in flight");
            };
            let new = pattern(7, 2 * B, B);
            writer.write(2 * B, &new, false).expect("write");
            backing.hold(false);
            let done = complete(&mut reader, 1);
            let range = offset_in_block as usize..offset_in_block as usize + 256;
            let old = pattern(1, 2 * B, B);
            assert!(
                done[0].1 == old[range.clone()] || done[0].1 == new[range.clone()],
                "{mode:?}: the miss answered neither the old nor the new data"
            );
            let mut after = vec![0u8; BLOCK];
            reader.read(2 * B, &mut after).expect("read");
            assert_eq!(after, new, "{mode:?}: the block reads as the write after the miss");
            writer.read(2 * B, &mut after).expect("read");
            assert_eq!(after, new, "{mode:?}: on the writer's lane too");
        }
    }
}

/// A miss in flight when a TRIM of its block goes by leaves no stale data admitted either.
#[test]
fn a_trim_beside_a_miss_in_flight_is_never_undone_by_the_miss() {
    let (backing, engine) = latched_engine(CacheMode::WriteAround);
    let mut reader = engine.lane().expect("lane");
    let mut writer = engine.lane().expect("lane");
    backing.hold(true);
    let mut buf = vec![0u8; BLOCK];
    assert!(matches!(reader.read_start(3 * B, &mut buf), ReadStart::Pending(_)));
    writer.write_zeroes(3 * B, B, false).expect("zeroes");
    backing.hold(false);
    complete(&mut reader, 1);
    let mut after = vec![1u8; BLOCK];
    reader.read(3 * B, &mut after).expect("read");
    assert_eq!(after, vec![0u8; BLOCK], "the block reads as the zeroes");
}

#[test]
fn a_lane_given_back_with_misses_in_flight_completes_them_first() {
    let (backing, engine) = latched_engine(CacheMode::WriteBack);
    {
        let mut lane = engine.lane().expect("lane");
        let mut bufs = [vec![0u8; BLOCK], vec![0u8; BLOCK]];
        let [a, b] = &mut bufs;
        let mut reads =
            [ReadRequest { offset: 4 * B, buf: a }, ReadRequest { offset: 5 * B, buf: b }];
        let mut started = Vec::new();
        backing.hold(true);
        lane.read_batch_start(&mut reads, &mut started);
        assert!(started.iter().all(|s| matches!(s, ReadStart::Pending(_))), "{started:?}");
        backing.hold(false);
    }
    assert_eq!(engine.stats().read_misses_admitted, 2, "both misses completed and admitted");
    let mut lane = engine.lane().expect("lane");
    let mut buf = vec![0u8; BLOCK];
    let ReadStart::Done(Ok(())) = lane.read_start(5 * B, &mut buf) else {
        panic!("block 5 was admitted when its lane was given back");
    };
    assert_eq!(buf, pattern(1, 5 * B, B));
    drop(lane);
    engine.shutdown().expect("shutdown");
}
