//! Unit tests of the engine's internals (persist order, sequence numbers, the hand, index room).

use std::sync::Arc;

use crate::WriteRequest;
use crate::format::{self, DecodedEntry, SlotEntry};
use crate::testing::model::{BLOCK, SimEngine, World, config};
use crate::{AdmissionConfig, CacheMode, Engine, EvictionKind, ManualClock};

/// A fresh write-back engine on simulated parts, with the parts (to inspect or cut).
fn write_back_engine(seed: u64) -> (World, SimEngine) {
    let world = World::fresh(seed);
    let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
    let clock = Arc::new(ManualClock::default());
    let engine =
        Engine::format(world.medium.clone(), world.backing.clone(), clock, &cfg).expect("format");
    (world, engine)
}

/// `settle_pending_free` on its own: an entry naming a block of the stripe (here block 0's
/// live entry, standing in for a superseded one) has its word 0 cleared and made durable by
/// the caller's fence; an entry naming another stripe's block (a slot reused since) is left
/// as it is. With the clear taken out (a flush alone) the first
/// assertion fails; with the stripe check taken out, the second.
#[test]
fn settling_a_pending_free_clears_an_entry_of_its_stripe_and_no_other() {
    let (world, engine) = write_back_engine(12);
    let mut lane = engine.lane().expect("lane");
    let data = vec![0x5a; BLOCK];
    lane.write(0, &data, false).expect("write");
    let stripe = engine.stripe_index(0);
    let other = (1..).find(|&lba| engine.stripe_index(lba) != stripe).expect("a block");
    lane.write(other * BLOCK as u64, &data, false).expect("write");
    let (superseded, reused) = (
        engine.index.lookup(0).expect("cached").slot,
        engine.index.lookup(other).expect("cached").slot,
    );
    let word = |slot: u32, durable: bool| {
        let at = engine.layout.entry_offset(slot);
        if durable {
            world.medium.durable_image()[at as usize / 8]
        } else {
            pmcache_media::Medium::load_u64(&world.medium, at)
        }
    };
    let reused_word0 = word(reused, true);
    assert!(word(superseded, true) != 0 && reused_word0 != 0, "both entries durable");
    engine.settle_pending_free(stripe, superseded);
    engine.settle_pending_free(stripe, reused);
    lane.fence();
    assert_eq!(word(superseded, true), 0, "the superseded entry's word 0, durably");
    assert_eq!((word(reused, false), word(reused, true)), (reused_word0, reused_word0));
}

/// A removal on another lane while the superseding lane's zeroes are not visible yet
/// (stored after the stripe's release, possibly non-temporally: not stored yet, or in that
/// core's write-combining buffer). The test puts the superseded entry back in what other
/// threads see after the overwrite, the superseding lane stays idle, and a write-around
/// write drops the block's newest copy; then power is cut. The block must read as the
/// write-around data, never as the superseded copy. With `settle_pending_free` reduced to
/// a flush alone, the remover makes the restored entry durable and the
/// superseded copy comes back.
#[test]
fn a_removal_settles_a_pending_free_whose_zeroes_are_not_visible_yet() {
    use crate::testing::model::pattern;
    use pmcache_media::Medium;
    let block = BLOCK as u64;
    let (old, new, newest) = (pattern(1, 0, block), pattern(2, 0, block), pattern(3, 0, block));
    for seed in 0..32 {
        let (world, engine) = write_back_engine(200 + seed);
        let (overwritten, wait_for_overwrite) = std::sync::mpsc::channel();
        let (cut, wait_for_cut) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let (engine, world, old, new) = (&engine, &world, &old, &new);
            scope.spawn(move || {
                let mut lane = engine.lane().expect("lane");
                lane.write(0, old, false).expect("write");
                // Other blocks between, so that the two copies' entries sit in different
                // lines.
                for lba in 1..=8u64 {
                    lane.write(lba * block, &pattern(10 + lba, 0, block), false).expect("write");
                }
                let superseded = engine.index.lookup(0).expect("cached").slot;
                let at = engine.layout.entry_offset(superseded);
                let words = (world.medium.load_u64(at), world.medium.load_u64(at + 8));
                lane.write(0, new, false).expect("overwrite");
                assert_ne!(engine.index.lookup(0).expect("cached").slot, superseded);
                world.medium.store_u64(at + 8, words.1);
                world.medium.store_u64(at, words.0);
                overwritten.send(()).expect("main thread");
                wait_for_cut.recv().expect("main thread");
            });
            wait_for_overwrite.recv().expect("writer");
            engine.set_mode(CacheMode::WriteAround);
            let mut lane = engine.lane().expect("second lane");
            lane.write(0, &newest, false).expect("write-around");
            world.switch.cut_now();
            cut.send(()).expect("writer");
        });
        drop(engine);
        let after = world.after_power_cut(200 + seed);
        let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
        let clock = Arc::new(ManualClock::default());
        let (engine, _) = Engine::open(after.medium, after.backing, clock, &cfg).expect("open");
        let mut got = vec![0u8; BLOCK];
        engine.lane().expect("lane").read(0, &mut got).expect("read");
        assert!(got != old, "seed {seed}: the superseded copy came back");
        assert!(got == newest, "seed {seed}: block 0 after the cut");
    }
}

/// A lane hands the slots it freed to the shared pool only once their zeroed entries are
/// durable: another lane refilling such a slot would otherwise write its new entry over an
/// old one still durable, and a power cut could keep the old entry's word 0 beside the new
/// entry's word 1 — rejected only by the entry's check, by chance. Groups of overwrites
/// free a group's slots after each group's last fence; the next group's fences make them
/// durable, and they go back while that group's own frees are still pending.
#[test]
fn slots_handed_to_the_pool_have_durably_zeroed_entries() {
    let (world, engine) = write_back_engine(11);
    let mut lane = engine.lane().expect("lane");
    let blocks = engine.group_max as u64;
    assert!(blocks as usize > engine.freed_spill, "a group's frees must reach the pool");
    let data = vec![0x5a; BLOCK];
    for lba in 0..blocks {
        lane.write(lba * BLOCK as u64, &data, false).expect("first copies");
    }
    let batch: Vec<WriteRequest<'_>> = (0..blocks)
        .map(|lba| WriteRequest { offset: lba * BLOCK as u64, data: &data, fua: false })
        .collect();
    let mut old = Vec::new();
    for _ in 0..3 {
        old.extend((0..blocks).map(|lba| engine.index.lookup(lba).expect("cached").slot));
        let mut outcomes = Vec::new();
        lane.write_batch(&batch, &mut outcomes);
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }
    assert!(lane.zeroings_pending(), "the last group's zeroings are still pending");

    let mut pooled = Vec::new();
    engine.pools.take(0, usize::MAX, &mut pooled);
    let spilled: Vec<u32> = old.iter().copied().filter(|s| pooled.contains(s)).collect();
    assert!(!spilled.is_empty(), "no superseded slot reached the pool: {old:?} {pooled:?}");
    let durable = world.medium.durable_image();
    for slot in pooled {
        let at = engine.layout.entry_offset(slot) as usize / 8;
        let entry = SlotEntry::decode(durable[at], durable[at + 1]);
        assert_eq!(entry, DecodedEntry::Free, "slot {slot} reached the pool with {entry:?}");
    }
}

/// A stripe's numbers only grow, whichever counter they come from. The global counter
/// hands out the next issuable number, raised above the stripe's last one (and then
/// raised itself, so that what it issues later stays above); a lane takes its own numbers
/// 1,024 at a time from the global counter and issues them in order, raised likewise.
#[test]
fn sequence_numbers_grow_per_stripe_from_both_counters() {
    use std::sync::atomic::Ordering;
    let (_world, engine) = write_back_engine(3);
    let start = engine.next_seq.load(Ordering::SeqCst);

    let mut stripe_last = 0;
    assert_eq!(engine.global_seq(&mut stripe_last), start);
    assert_eq!(stripe_last, start);
    // A stripe ahead of the counter (a lane's number can pass it): raised, and the
    // counter follows.
    let mut stripe_last = start + 0x1fe;
    let raised = engine.global_seq(&mut stripe_last);
    let expected = super::first_seq_after(start + 0x1fe);
    assert_eq!((raised, stripe_last), (expected, expected));
    assert_eq!(engine.next_seq.load(Ordering::SeqCst), raised + 1);
    let mut other_stripe = 0;
    assert!(engine.global_seq(&mut other_stripe) > raised);

    let mut lane = engine.lane().expect("lane");
    let taken = engine.next_seq.load(Ordering::SeqCst);
    let mut issued = Vec::new();
    for _ in 0..1500 {
        let mut stripe_last = 0;
        issued.push(lane.local_seq(&mut stripe_last));
        assert_eq!(stripe_last, *issued.last().expect("issued"));
    }
    // Two ranges taken, each issued in order (skipping multiples of 256).
    assert_eq!(engine.next_seq.load(Ordering::SeqCst), taken + 2048);
    let first_range: Vec<u64> =
        (taken..taken + 1024).filter(|&seq| format::is_issuable_seq(seq)).collect();
    assert_eq!(issued[..first_range.len()], first_range[..]);
    assert!(issued.windows(2).all(|pair| pair[0] < pair[1]), "{issued:?}");
    // A stripe ahead of the lane's range: raised.
    let mut stripe_last = taken + 5000;
    let expected = super::first_seq_after(taken + 5000);
    assert_eq!(lane.local_seq(&mut stripe_last), expected);
    assert_eq!(stripe_last, expected);
}

/// Sequence numbers skip every multiple of 256 (`format::is_issuable_seq`).
#[test]
fn the_next_sequence_number_skips_a_zero_low_byte() {
    use super::first_seq_after;
    for (seq, next) in [(0, 1), (1, 2), (254, 255), (255, 257), (256, 257), (0x12ff, 0x1301)] {
        assert_eq!(first_seq_after(seq), next, "after {seq:#x}");
    }
}

/// The eviction hand decides on a clean slot from the word it loaded. A slot freed and
/// refilled with another clean block before the hand takes the stripe is a new
/// incarnation of the slot and is skipped: the hand's second chance was the old block's,
/// and evicting the new one there would also fail the `clean slot not indexed` check when
/// the entry was read before the refill (the race between `read_entry` and the stripe).
#[test]
fn the_hand_skips_a_slot_recycled_since_it_looked() {
    use crate::slots::SlotState;
    let (_world, engine) = write_back_engine(5);
    let mut lane = engine.lane().expect("lane");
    let mut buf = vec![0u8; BLOCK];
    lane.read(BLOCK as u64, &mut buf).expect("block 1 admitted clean");
    let slot = engine.index.lookup(1).expect("block 1 cached").slot;
    let seen = engine.slots.load(slot);
    assert_eq!(seen.state(), SlotState::Clean);
    // A write-back write supersedes block 1's clean copy, and the next admission refills
    // that slot with block 2: the allocator hands it out next, as it would once the pool's
    // cursor comes round to it (after a fence, as the pool requires).
    lane.write(BLOCK as u64, &[7; BLOCK], false).expect("overwrite block 1");
    lane.fence();
    lane.freed.retain(|&freed| freed != slot);
    lane.freed_durable = lane.freed.len();
    lane.free.push(slot);
    lane.read(2 * BLOCK as u64, &mut buf).expect("block 2 admitted clean");
    assert_eq!(engine.index.lookup(2).expect("block 2 cached").slot, slot, "slot reused");
    assert_eq!(engine.slots.load(slot).state(), SlotState::Clean);

    let evictions = engine.stats().evictions;
    assert!(!lane.try_evict(slot, seen, None), "evicted a slot recycled since it was seen");
    assert_eq!(engine.stats().evictions, evictions);
    assert_eq!(engine.index.lookup(2).map(|f| f.slot), Some(slot), "block 2 evicted");
    // The slot as it is now is evicted.
    assert!(lane.try_evict(slot, engine.slots.load(slot), None), "current incarnation");
    assert_eq!(engine.stats().evictions, evictions + 1);
    assert!(engine.index.lookup(2).is_none());
    lane.read(2 * BLOCK as u64, &mut buf).expect("block 2 again");
    assert_eq!(buf, vec![0; BLOCK]);
}

/// The dirty-slot figure sums the lanes' counters one after another: a block made dirty
/// by one lane and cleaned by another between the reads counts as cleaned only, and the
/// figure reads as 0 then, not as a count wrapped to nearly 2^64.
#[test]
fn the_dirty_figure_never_wraps_below_zero() {
    use std::sync::atomic::Ordering;
    let (_world, engine) = write_back_engine(9);
    engine.lane().expect("lane").write(0, &[1; BLOCK], false).expect("write");
    assert_eq!(engine.stats().dirty_slots, 1);
    // What a reader sees if it read the writer's counter before the write and the
    // cleaner's after the clean: -1 in all.
    engine.lanes[0].counters.dirty_delta.store(0, Ordering::Relaxed);
    engine.lanes[1].counters.dirty_delta.store(u64::MAX, Ordering::Relaxed);
    assert_eq!(engine.stats().dirty_slots, 0);
}

/// FUA flushes the backing store only where the write goes to it: never in write-back
/// or write-only (the write is durable on the medium when acknowledged), once per FUA
/// write in the modes that write through, never without FUA (over clean blocks).
#[test]
fn fua_flushes_the_backing_store_only_where_the_write_goes() {
    let (world, engine) = write_back_engine(5);
    let mut lane = engine.lane().expect("lane");
    let data = vec![0x33; BLOCK];
    for mode in CacheMode::ALL {
        engine.set_mode(mode);
        // Not counted: a write that drops a dirty copy flushes the backing store whatever
        // FUA says (the dropped copy was durable), and the last mode left both blocks dirty.
        lane.write(0, &data, false).expect("write");
        lane.write_zeroes(BLOCK as u64, BLOCK as u64, false).expect("write zeroes");
        for fua in [false, true, false, true] {
            let before = world.backing.flushes();
            lane.write(0, &data, fua).expect("write");
            lane.write_zeroes(BLOCK as u64, BLOCK as u64, fua).expect("write zeroes");
            let expected = if fua && !mode.writes_back() { 2 } else { 0 };
            let flushes = world.backing.flushes() - before;
            assert_eq!(flushes, expected, "{mode}, fua {fua}");
        }
    }
}

/// Making index room inside a read miss or a write-through (full buckets).
#[cfg(not(feature = "shuttle"))]
mod full_index {
    use pmcache_backing::BackingStore;
    use proptest::prelude::*;

    use crate::testing::full_buckets::{self, BACKING_FILL, FullBuckets, assert_reads};
    use crate::testing::proptest_cases;
    use crate::{CacheMode, Lane, WriteRequest};

    const BLOCK: usize = full_buckets::BLOCK as usize;

    /// An operation on block `b` of the 25 that share three index buckets (24 fit).
    #[derive(Clone, Debug)]
    enum Op {
        Write {
            b: usize,
            fill: u8,
        },
        /// Bytes 512..1536 of the block.
        WritePartial {
            b: usize,
            fill: u8,
        },
        WriteZeroes {
            b: usize,
        },
        Trim {
            b: usize,
        },
        Read {
            b: usize,
        },
        /// Whole-block writes handed over as one batch (group commit, and the writes that
        /// find no index room run alone).
        WriteBatch {
            writes: Vec<(usize, u8)>,
        },
        /// Every block written, in this order, one by one: in a mode that writes back,
        /// the buckets then hold only dirty blocks and the one left out must make room by
        /// writing one back.
        WriteAll {
            order: Vec<usize>,
            fill: u8,
        },
        /// Every block read, in this order.
        ReadAll {
            order: Vec<usize>,
        },
        SetMode(CacheMode),
        /// Drop the engine and attach again (recovery rebuilds everything).
        Reattach,
        Drain,
    }

    fn op() -> impl Strategy<Value = Op> {
        let b = 0..25usize;
        prop_oneof![
            4 => (b.clone(), any::<u8>()).prop_map(|(b, fill)| Op::Write { b, fill }),
            2 => (b.clone(), any::<u8>()).prop_map(|(b, fill)| Op::WritePartial { b, fill }),
            1 => b.clone().prop_map(|b| Op::WriteZeroes { b }),
            1 => b.clone().prop_map(|b| Op::Trim { b }),
            4 => b.clone().prop_map(|b| Op::Read { b }),
            2 => prop::collection::vec((b, any::<u8>()), 1..12)
                .prop_map(|writes| Op::WriteBatch { writes }),
            1 => (Just((0..25).collect::<Vec<usize>>()).prop_shuffle(), any::<u8>())
                .prop_map(|(order, fill)| Op::WriteAll { order, fill }),
            1 => Just((0..25).collect::<Vec<usize>>()).prop_shuffle()
                .prop_map(|order| Op::ReadAll { order }),
            1 => prop::sample::select(CacheMode::ALL.to_vec()).prop_map(Op::SetMode),
            1 => Just(Op::Reattach),
            1 => Just(Op::Drain),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(proptest_cases(256)))]

        /// Random operations in every mode on blocks that never all fit the index, so
        /// nearly every admission and every new dirty block must make room (evict a clean
        /// occupant, or write a dirty one back first): every read returns the block's
        /// last data, across re-attachments, and a final drain leaves it on the backing
        /// store.
        #[test]
        fn blocks_competing_for_index_room_keep_their_data(
            ops in prop::collection::vec(op(), 1..80)
        ) {
            let cache = FullBuckets::new();
            let lbas: Vec<u64> = cache.fillers.iter().copied().chain([cache.x]).collect();
            // Each block's contents; `None` after a trim (unspecified until read).
            let mut model: Vec<Option<Vec<u8>>> = vec![Some(vec![BACKING_FILL; BLOCK]); 25];
            let (mut engine, _) = cache.cache.open();
            let mut got = vec![0u8; BLOCK];
            let read = |lane: &mut Lane<'_, _, _, _>,
                        model: &mut [Option<Vec<u8>>],
                        b: usize|
             -> Result<(), TestCaseError> {
                let mut got = vec![0u8; BLOCK];
                lane.read(lbas[b] * BLOCK as u64, &mut got).unwrap();
                match &model[b] {
                    Some(data) => prop_assert!(
                        got == *data,
                        "block {b}: read {:#x}.., holds {:#x}..", got[0], data[0]
                    ),
                    None => model[b] = Some(got),
                }
                Ok(())
            };
            for op in ops {
                let mut lane = engine.lane().unwrap();
                match op {
                    Op::Write { b, fill } => {
                        lane.write(lbas[b] * BLOCK as u64, &[fill; BLOCK], false).unwrap();
                        model[b] = Some(vec![fill; BLOCK]);
                    }
                    Op::WritePartial { b, fill } => {
                        lane.write(lbas[b] * BLOCK as u64 + 512, &[fill; 1024], false)
                            .unwrap();
                        if let Some(data) = &mut model[b] {
                            data[512..1536].fill(fill);
                        }
                    }
                    Op::WriteZeroes { b } => {
                        lane.write_zeroes(lbas[b] * BLOCK as u64, BLOCK as u64, false)
                            .unwrap();
                        model[b] = Some(vec![0; BLOCK]);
                    }
                    Op::Trim { b } => {
                        lane.trim(lbas[b] * BLOCK as u64, BLOCK as u64).unwrap();
                        model[b] = None;
                    }
                    Op::Read { b } => read(&mut lane, &mut model, b)?,
                    Op::ReadAll { order } => {
                        for b in order {
                            read(&mut lane, &mut model, b)?;
                        }
                    }
                    Op::WriteBatch { writes } => {
                        // A block repeated in the batch is written in batch order.
                        let data: Vec<[u8; BLOCK]> =
                            writes.iter().map(|&(_, fill)| [fill; BLOCK]).collect();
                        let requests: Vec<WriteRequest<'_>> = writes
                            .iter()
                            .zip(&data)
                            .map(|(&(b, _), data)| WriteRequest {
                                offset: lbas[b] * BLOCK as u64,
                                data,
                                fua: false,
                            })
                            .collect();
                        let mut outcomes = Vec::new();
                        lane.write_batch(&requests, &mut outcomes);
                        prop_assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
                        for &(b, fill) in &writes {
                            model[b] = Some(vec![fill; BLOCK]);
                        }
                    }
                    Op::WriteAll { order, fill } => {
                        for b in order {
                            lane.write(lbas[b] * BLOCK as u64, &[fill; BLOCK], false)
                                .unwrap();
                            model[b] = Some(vec![fill; BLOCK]);
                        }
                    }
                    Op::SetMode(mode) => engine.set_mode(mode),
                    Op::Reattach => {
                        drop(lane);
                        drop(engine);
                        engine = cache.cache.open().0;
                        continue;
                    }
                    Op::Drain => lane.drain().unwrap(),
                }
            }
            engine.lane().unwrap().drain().unwrap();
            for (b, data) in model.iter().enumerate() {
                if let Some(data) = data {
                    engine.backing().read_at(&mut got, lbas[b] * BLOCK as u64).unwrap();
                    prop_assert!(got == *data, "block {b} on the backing store: {:#x}..", got[0]);
                }
            }
        }
    }

    /// A read miss whose index buckets are full of dirty blocks writes one of them back to
    /// make room. The block read must be its own data, returned and cached: the write-back
    /// once copied the dirty block through the buffer that held it.
    #[test]
    fn a_read_miss_that_writes_back_for_index_room_keeps_its_own_data() {
        let cache = FullBuckets::new();
        let (engine, _) = cache.cache.open();
        let mut lane = engine.lane().unwrap();
        cache.write_fillers(&mut lane);
        let mut got = vec![0u8; full_buckets::BLOCK as usize];
        lane.read(cache.x * full_buckets::BLOCK, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == BACKING_FILL), "read {:#x}", got[0]);
        let stats = engine.stats();
        assert_eq!((stats.read_misses_admitted, stats.writebacks, stats.read_hits), (1, 1, 0));
        // Served from the cache now.
        got.fill(0);
        lane.read(cache.x * full_buckets::BLOCK, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == BACKING_FILL), "read {:#x}", got[0]);
        assert_eq!(engine.stats().read_hits, 1);
        drop(lane);
        // Every block (the fillers now miss in turn, each taking another's place), and again
        // after attaching anew.
        let fillers =
            cache.fillers.iter().enumerate().map(|(i, &lba)| (lba, FullBuckets::filler_fill(i)));
        let expected: Vec<(u64, u8)> = fillers.chain([(cache.x, BACKING_FILL)]).collect();
        assert_reads(&engine, expected.iter().copied());
        drop(engine);
        assert_reads(&cache.cache.open().0, expected);
    }

    /// A write that must make index room while another lane holds the stripes of every
    /// dirty occupant but one writes that one back: it never waits for a stripe while
    /// holding its own (two lanes each making room in the other's stripes would wait
    /// forever), and it does not give up while one occupant can still be written back.
    #[test]
    fn making_index_room_skips_occupants_whose_stripe_is_busy() {
        let cache = FullBuckets::new();
        let (engine, _) = cache.cache.open();
        let mut lane = engine.lane().unwrap();
        cache.write_fillers(&mut lane);
        let own = engine.stripe_index(cache.x);
        let (free_at, free_filler) = (23, cache.fillers[23]);
        let mut busy: Vec<usize> = cache.fillers[..free_at]
            .iter()
            .map(|&lba| engine.stripe_index(lba))
            .filter(|&stripe| stripe != own)
            .collect();
        busy.sort_unstable();
        busy.dedup();
        assert!(!busy.contains(&engine.stripe_index(free_filler)), "pick another filler");
        let guards: Vec<_> = busy.iter().map(|&stripe| engine.lock_stripe_index(stripe)).collect();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let block = [0x77; full_buckets::BLOCK as usize];
                let result = lane.write(cache.x * full_buckets::BLOCK, &block, false);
                done_tx.send(result.is_ok()).unwrap();
            });
            let done = done_rx.recv_timeout(std::time::Duration::from_secs(20));
            drop(guards);
            assert_eq!(done, Ok(true), "the write waited on busy stripes");
        });
        drop(lane);
        let stats = engine.stats();
        assert_eq!((stats.writebacks, stats.evictions), (1, 1), "{stats:?}");
        assert_reads(&engine, [(cache.x, 0x77), (free_filler, FullBuckets::filler_fill(free_at))]);
    }

    /// The same for a write-through write (whole or partial) cached in place of a block
    /// written back for room: the cached copy is the data written.
    #[test]
    fn a_write_through_that_writes_back_for_index_room_caches_its_own_data() {
        for partial in [false, true] {
            let cache = FullBuckets::new();
            let (engine, _) = cache.cache.open();
            let mut lane = engine.lane().unwrap();
            cache.write_fillers(&mut lane);
            engine.set_mode(CacheMode::WriteThrough);
            let mut expected =
                vec![if partial { BACKING_FILL } else { 0x77 }; full_buckets::BLOCK as usize];
            let (at, len) = if partial { (512, 1024) } else { (0, full_buckets::BLOCK as usize) };
            expected[at..at + len].fill(0x77);
            lane.write(cache.x * full_buckets::BLOCK + at as u64, &expected[at..at + len], false)
                .unwrap();
            assert_eq!(engine.stats().writebacks, 1, "partial: {partial}");
            let mut got = vec![0u8; full_buckets::BLOCK as usize];
            lane.read(cache.x * full_buckets::BLOCK, &mut got).unwrap();
            assert!(got == expected, "partial: {partial}: read {:#x} at {at}", got[at]);
            assert_eq!(
                engine.stats().read_hits,
                1,
                "partial: {partial}: not served from the cache"
            );
        }
    }
}

/// Block status over a dirty block the backing store holds as a hole: the cleaner (here a
/// lane's drain) writes it back and the block is evicted between the backing store's answer
/// and the index lookup. The block is data on the store by then, and must be reported as
/// data: a hole there would make `qemu-img convert` or `nbdcopy` skip acknowledged data.
/// With the backing store asked only before the index, the block is reported a hole.
#[test]
fn a_block_written_back_and_evicted_during_block_status_is_never_a_hole() {
    use crate::testing::hooked::HookedBacking;
    use pmcache_backing::{BackingStore, Extent};
    use std::sync::mpsc;

    let world = World::fresh(31);
    let backing = HookedBacking::with_holes(world.backing.clone());
    let device = backing.size_bytes();
    backing.discard(0, device).expect("punch the whole device");
    let cfg = config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always);
    let engine = Engine::format(
        world.medium.clone(),
        backing.clone(),
        Arc::new(ManualClock::default()),
        &cfg,
    )
    .expect("format");
    let block = BLOCK as u64;
    let target = 5u64;
    let data = vec![0x77u8; BLOCK];
    let mut lane = engine.lane().expect("lane");
    lane.write(target * block, &data, false).expect("a dirty block over a hole");
    let (ask, asked) = mpsc::channel::<()>();
    let (done, answered) = mpsc::channel::<()>();
    let mut first = true;
    backing.on_extent(move |_| {
        if std::mem::take(&mut first) {
            ask.send(()).expect("ask for the write-back");
            answered.recv().expect("the write-back and eviction");
        }
    });
    std::thread::scope(|scope| {
        let (lane, engine) = (&mut lane, &engine);
        scope.spawn(move || {
            asked.recv().expect("the extent query");
            lane.drain().expect("write the block back");
            // Other blocks read until the block is evicted.
            let mut buf = vec![0u8; BLOCK];
            let others = (0..device / block).filter(|&lba| lba != target).cycle();
            for lba in others.take(1000) {
                if engine.index.lookup(target).is_none() {
                    break;
                }
                lane.read(lba * block, &mut buf).expect("read another block");
            }
            assert!(engine.index.lookup(target).is_none(), "the block was never evicted");
            done.send(()).expect("answer the hook");
        });
        let mut extents = Vec::new();
        engine.extents(target * block, block, 16, &mut extents).expect("block status");
        assert_eq!(
            extents,
            vec![Extent { len: block, hole: false }],
            "acknowledged data reported as a hole"
        );
    });
}

/// A mode switch is a barrier: `set_mode` returns only once every write request that read the
/// old mode has returned, and such a request keeps that mode to its end. Here a request of
/// this lane is in progress (its mode pinned, as `write_batch` pins it around the writes it
/// runs alone) in write-around when another thread switches to write-back: the switch waits;
/// the request's FUA write still flushes the backing store (in write-around its data is on the
/// store, not in the cache, and only a flush makes it durable); once the request ends the
/// switch returns, and the next write lands dirty in the cache. With the mode read anew for
/// the FUA the flush is skipped; with a switch that does not wait it returns at once.
#[test]
fn a_mode_switch_waits_for_the_requests_of_the_old_mode_which_keep_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let world = World::fresh(41);
    let cfg = config(CacheMode::WriteAround, EvictionKind::Clock, AdmissionConfig::Always);
    let engine = Engine::format(
        world.medium.clone(),
        world.backing.clone(),
        Arc::new(ManualClock::default()),
        &cfg,
    )
    .expect("format");
    let mut lane = engine.lane().expect("lane");
    let block = BLOCK as u64;
    assert_eq!(lane.pin_mode(), CacheMode::WriteAround);
    let switched = AtomicBool::new(false);
    let (passed, flushed, dirty) = std::thread::scope(|scope| {
        let switch = scope.spawn(|| {
            engine.set_mode(CacheMode::WriteBack);
            switched.store(true, Ordering::SeqCst);
        });
        while engine.mode() != CacheMode::WriteBack {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let passed = switched.load(Ordering::SeqCst);
        let flushes = world.backing.flushes();
        lane.write(0, &vec![0x31; BLOCK], true).expect("a FUA write inside the request");
        let flushed = world.backing.flushes() > flushes;
        let dirty = lane.engine().stats().dirty_slots;
        // The request ends before anything is checked: the switch waits for it.
        lane.unpin_mode();
        switch.join().expect("the switch");
        (passed, flushed, dirty)
    });
    assert!(!passed, "the switch passed a request of the old mode");
    assert!(flushed, "the FUA write did not flush the store");
    assert_eq!(dirty, 0, "the write went to the cache");
    assert!(switched.load(Ordering::SeqCst));
    lane.write(block, &vec![0x32; BLOCK], false).expect("a write after the switch");
    assert_eq!(engine.stats().dirty_slots, 1, "the write after the switch is not dirty");
}
