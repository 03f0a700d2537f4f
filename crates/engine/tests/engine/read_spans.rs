//! Read misses of several blocks (`cache/spans.rs`): one backing read for the request, in
//! flight like a single-block miss; each block served and admitted as a single miss would be,
//! a block cached at the start served from the cache (or read again if it was evicted while
//! the read was in flight), a write beside the read never undone by its admission.
#![cfg(not(feature = "shuttle"))]

use std::sync::Arc;

use pmcache_engine::testing::latched::{LatchedBacking, latched_engine};
use pmcache_engine::testing::model::{BLOCK, SimMedium, pattern};
use pmcache_engine::{
    CacheMode, CleanerConfig, ManualClock, ReadRequest, ReadStart, Ticket, WriteBackOrder,
};

const B: u64 = BLOCK as u64;

type Lane<'e> = pmcache_engine::Lane<'e, SimMedium, Arc<LatchedBacking>, Arc<ManualClock>>;

/// Every completion `complete` hands over, at least `min` of them waited for.
fn complete(lane: &mut Lane<'_>, min: usize) -> Vec<(Ticket, Vec<u8>)> {
    let mut got = Vec::new();
    lane.complete(min, &mut |ticket, result| {
        got.push((ticket, result.expect("the span's read").to_vec()));
    });
    got
}

/// Starts a read that must be in flight, and returns its answer once it completes.
fn read_in_flight(lane: &mut Lane<'_>, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    let ReadStart::Pending(ticket) = lane.read_start(offset, &mut buf) else {
        panic!("the read of {len} bytes at {offset} must be in flight");
    };
    let done = complete(lane, 1);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].0, ticket);
    done.into_iter().next().expect("one answer").1
}

/// A read of four uncached blocks is one backing read; the blocks are admitted, and the same
/// read is then four hits answered at once. A read starting and ending inside blocks too.
#[test]
fn a_miss_of_several_blocks_is_one_backing_read_and_admits_every_block() {
    for (offset, len) in [(4 * B, 4 * B), (10 * B + 100, 3 * B - 37)] {
        let (backing, engine) = latched_engine(CacheMode::WriteBack);
        let mut lane = engine.lane().expect("lane");
        let data = read_in_flight(&mut lane, offset, len);
        assert_eq!(data, pattern(1, offset, len), "the span's data at {offset}");
        assert_eq!(backing.reads(), (1, 0), "one queued backing read, none on the caller");
        let blocks = (offset + len - 1) / B - offset / B + 1;
        let stats = engine.stats();
        assert_eq!(stats.read_misses_admitted, blocks, "every block admitted");
        assert_eq!(stats.bytes_read, len);
        let mut again = vec![0u8; len as usize];
        let ReadStart::Done(Ok(())) = lane.read_start(offset, &mut again) else {
            panic!("the admitted blocks are hits now");
        };
        assert_eq!(again, pattern(1, offset, len));
        assert_eq!(backing.reads(), (1, 0), "the hits read nothing from the store");
        assert_eq!(engine.stats().read_hits, blocks);
    }
}

/// A span over a dirty cached block serves that block from the cache, in every mode, through
/// `read_start` and `read_batch_start` both.
#[test]
fn a_block_cached_at_the_start_is_served_from_the_cache() {
    for mode in CacheMode::ALL {
        let (backing, engine) = latched_engine(mode);
        let mut lane = engine.lane().expect("lane");
        let written = pattern(7, 3 * B, B);
        lane.write(3 * B, &written, false).expect("write block 3");
        let mut expected = pattern(1, 2 * B, 4 * B);
        expected[B as usize..2 * B as usize].copy_from_slice(&written);
        let data = read_in_flight(&mut lane, 2 * B, 4 * B);
        assert_eq!(data, expected, "{mode:?}: block 3 from the cache, the rest from the store");

        let mut buf = vec![0u8; 4 * BLOCK];
        let mut single = vec![0u8; BLOCK];
        let mut reads = [
            ReadRequest { offset: 20 * B, buf: &mut buf },
            ReadRequest { offset: 30 * B, buf: &mut single },
        ];
        let mut started = Vec::new();
        backing.hold(true);
        lane.read_batch_start(&mut reads, &mut started);
        assert!(started.iter().all(|s| matches!(s, ReadStart::Pending(_))), "{started:?}");
        backing.hold(false);
        let mut done = complete(&mut lane, 2);
        done.sort_by_key(|(ticket, _)| ticket.index());
        let answers: Vec<usize> = done.iter().map(|(_, data)| data.len()).collect();
        assert!(answers.contains(&(4 * BLOCK)) && answers.contains(&BLOCK), "{answers:?}");
        for (_, data) in done {
            let at = if data.len() == BLOCK { 30 * B } else { 20 * B };
            assert_eq!(data, pattern(1, at, data.len() as u64), "{mode:?}: batch read at {at}");
        }
        assert_eq!(lane.pending(), 0);
    }
}

/// A block cached (dirty) when the span's read was queued, written back and evicted before
/// the read completes: the data read may predate the write-back, so the block is read again
/// and the span answers the written data — never the store's older copy.
#[test]
fn a_block_evicted_while_the_span_is_in_flight_is_read_again() {
    let (backing, engine) = latched_engine(CacheMode::WriteBack);
    let mut reader = engine.lane().expect("lane");
    let mut writer = engine.lane().expect("lane");
    let written = pattern(7, 3 * B, B);
    writer.write(3 * B, &written, false).expect("write block 3");
    // The store runs a queued read at submit: the span's copy of block 3 is the old data.
    let mut buf = vec![0u8; 3 * BLOCK];
    let ReadStart::Pending(_) = reader.read_start(2 * B, &mut buf) else {
        panic!("blocks 2 and 4 are not cached: the span must be in flight");
    };
    let mut cleaner = engine
        .cleaner(CleanerConfig {
            order: WriteBackOrder::Lba,
            target_pct: 0,
            idle_target_pct: 0,
            ..CleanerConfig::default()
        })
        .expect("cleaner");
    assert_eq!(cleaner.drain().expect("write-back"), 1, "block 3 written back");
    drop(cleaner);
    // Fill the cache with other blocks until a clean one (block 3, the only one) is evicted.
    let mut next = 20;
    while engine.stats().evictions == 0 {
        assert!(next < 48, "no eviction after writing blocks 20..{next}");
        writer.write(next * B, &pattern(9, next * B, B), false).expect("write");
        next += 1;
    }
    let done = complete(&mut reader, 1);
    let mut expected = pattern(1, 2 * B, 3 * B);
    expected[BLOCK..2 * BLOCK].copy_from_slice(&written);
    assert!(done[0].1 == expected, "block 3 answered as the store held it, not as written");
    assert!(backing.reads().1 >= 1, "block 3 was read again on the ordinary path");
}

/// In every mode: a write (from another lane) to a block of a span in flight leaves the block
/// reading as the write; the span answers the old or the new data for it.
#[test]
fn a_write_beside_a_span_in_flight_is_never_undone_by_it() {
    for mode in CacheMode::ALL {
        let (backing, engine) = latched_engine(mode);
        let mut reader = engine.lane().expect("lane");
        let mut writer = engine.lane().expect("lane");
        backing.hold(true);
        let mut buf = vec![0u8; 4 * BLOCK];
        let ReadStart::Pending(_) = reader.read_start(6 * B, &mut buf) else {
            panic!("{mode:?}: blocks 6..10 are not cached: the span must be in flight");
        };
        let new = pattern(7, 7 * B, B);
        writer.write(7 * B, &new, false).expect("write");
        backing.hold(false);
        let done = complete(&mut reader, 1);
        let old = pattern(1, 6 * B, 4 * B);
        let block_7 = &done[0].1[BLOCK..2 * BLOCK];
        assert!(
            block_7 == &old[BLOCK..2 * BLOCK] || block_7 == &new[..],
            "{mode:?}: the span answered neither the old nor the new data of block 7"
        );
        assert_eq!(done[0].1[..BLOCK], old[..BLOCK], "{mode:?}: block 6");
        assert_eq!(done[0].1[2 * BLOCK..], old[2 * BLOCK..], "{mode:?}: blocks 8 and 9");
        let mut after = vec![0u8; BLOCK];
        for lane in [&mut reader, &mut writer] {
            lane.read(7 * B, &mut after).expect("read");
            assert_eq!(after, new, "{mode:?}: block 7 reads as the write after the span");
        }
        let mut all = vec![0u8; 4 * BLOCK];
        reader.read(6 * B, &mut all).expect("read");
        assert_eq!(all[..BLOCK], old[..BLOCK], "{mode:?}: block 6 after the span");
    }
}

/// The ordinary path (`Lane::read`, a read the queue does not take) reads a run of uncached
/// whole blocks with one backing read too, and admits them; a cached block ends the run.
#[test]
fn the_ordinary_path_reads_a_run_of_uncached_blocks_at_once() {
    let (backing, engine) = latched_engine(CacheMode::WriteBack);
    let mut lane = engine.lane().expect("lane");
    let written = pattern(7, 6 * B, B);
    lane.write(6 * B, &written, false).expect("write block 6");
    // Blocks 2 to 5 uncached (one read), 6 cached, 7 alone (one read of its own).
    let mut buf = vec![0u8; 6 * BLOCK];
    lane.read(2 * B, &mut buf).expect("read");
    let mut expected = pattern(1, 2 * B, 6 * B);
    expected[4 * BLOCK..5 * BLOCK].copy_from_slice(&written);
    assert!(buf == expected, "the read's data");
    assert_eq!(backing.reads(), (0, 2), "blocks 2 to 5 in one read, block 7 in another");
    assert_eq!(engine.stats().read_misses_admitted, 5);
    lane.read(2 * B, &mut buf).expect("read again");
    assert!(buf == expected, "the read's data, from the cache");
    assert_eq!(backing.reads(), (0, 2), "the second read was all hits");
}

/// Spans in flight that would hold more admission slots than the cache has: the lane does not
/// wait for slots only its own completions free (it hung there, every slot being filled);
/// the blocks beyond the free slots are served without being admitted.
#[test]
fn spans_in_flight_never_wait_for_slots_their_own_lane_holds() {
    let (backing, engine) = latched_engine(CacheMode::WriteBack);
    let (sent, got) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lane = engine.lane().expect("lane");
        backing.hold(true);
        // 5 reads of 8 blocks: 40 blocks, twice the model's 20 slots.
        let mut bufs = vec![vec![0u8; 8 * BLOCK]; 5];
        let mut pending = 0;
        for (i, buf) in bufs.iter_mut().enumerate() {
            match lane.read_start(i as u64 * 8 * B, buf) {
                ReadStart::Pending(_) => pending += 1,
                ReadStart::Done(result) => result.expect("read"),
            }
        }
        backing.hold(false);
        let mut answers = complete(&mut lane, pending);
        answers.sort_by_key(|(ticket, _)| ticket.index());
        drop(lane);
        let admitted = engine.stats().read_misses_admitted;
        sent.send((pending, answers, admitted)).expect("send");
    });
    let (pending, answers, admitted) =
        got.recv_timeout(std::time::Duration::from_secs(30)).expect("the reads never completed");
    reader.join().expect("reader");
    assert_eq!(pending, 5, "every read in flight");
    let mut seen: Vec<Vec<u8>> = answers.into_iter().map(|(_, data)| data).collect();
    seen.sort();
    let mut expected: Vec<Vec<u8>> = (0..5).map(|i| pattern(1, i * 8 * B, 8 * B)).collect();
    expected.sort();
    assert!(seen == expected, "every read answered its blocks");
    assert!((1..=20).contains(&admitted), "{admitted} blocks admitted into 20 slots");
}
