//! Power-cut tests of the production engine on the crash-simulating medium and a simulated
//! backing store with a volatile write cache. Every read is checked against a reference model;
//! after every power cut, recovery must show every acknowledged write (write-back) or a value
//! the device may durably hold (other modes), and a final drain must leave the backing store
//! holding the model's data.

use pmcache_engine::testing::model::{BLOCK, BLOCKS, CrashRun, DEVICE_BYTES, Op, run_crash_case};
use pmcache_engine::{AdmissionConfig, CacheMode, EvictionKind};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// `run_crash_case` as a property test's verdict.
fn check_case(ops: &[Op], run: &CrashRun) -> Result<(), TestCaseError> {
    run_crash_case(ops, run).map(|_| ()).map_err(TestCaseError::fail)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let device = DEVICE_BYTES;
    let range = (0..device)
        .prop_flat_map(move |offset| (Just(offset), 1..=(device - offset).min(3 * BLOCK as u64)));
    // Write-zeroes up to 8 blocks: several whole blocks take the backing-store path in half
    // the seeds (`run_crash_case`).
    let zeroes = (0..device)
        .prop_flat_map(move |offset| (Just(offset), 1..=(device - offset).min(8 * BLOCK as u64)));
    let aligned = (0..BLOCKS as u64, 1..=3u64).prop_map(|(b, n)| {
        let n = n.min(BLOCKS as u64 - b);
        (b * BLOCK as u64, n * BLOCK as u64)
    });
    // Batches: mostly whole blocks (group commits), some partial, repeats of a block likely.
    let batch_item = prop_oneof![
        4 => (0..BLOCKS as u64).prop_map(|b| (b * BLOCK as u64, BLOCK as u64)),
        1 => range.clone(),
    ];
    prop_oneof![
        2 => (prop::collection::vec(batch_item.clone(), 1..8), any::<bool>())
            .prop_map(|(writes, fua)| Op::WriteBatch { writes, fua }),
        1 => prop::collection::vec(batch_item, 1..8).prop_map(|reads| Op::ReadBatch { reads }),
        6 => aligned.clone().prop_map(|(offset, len)| Op::Read { offset, len }),
        2 => range.clone().prop_map(|(offset, len)| Op::Read { offset, len }),
        6 => (aligned, any::<bool>()).prop_map(|((offset, len), fua)| Op::Write { offset, len, fua }),
        3 => (range.clone(), any::<bool>()).prop_map(|((offset, len), fua)| Op::Write { offset, len, fua }),
        1 => range.clone().prop_map(|(offset, len)| Op::Trim { offset, len }),
        1 => (zeroes, any::<bool>()).prop_map(|((offset, len), fua)| Op::WriteZeroes { offset, len, fua }),
        1 => Just(Op::Flush),
        1 => Just(Op::Drain),
        1 => Just(Op::PowerCut),
    ]
}

/// `op_strategy` with mode switches among the operations.
fn op_with_mode_changes_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op_strategy(),
        1 => prop::sample::select(CacheMode::ALL.to_vec()).prop_map(|mode| Op::SetMode { mode }),
    ]
}

/// `op_with_mode_changes_strategy` with backing faults injected and healed among the
/// operations: writes to a run of blocks refused, every read refused, every flush refused.
fn op_with_backing_faults_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        16 => op_with_mode_changes_strategy(),
        2 => (0..BLOCKS as u64, 1..=16u64).prop_map(|(first, count)| Op::FailBackingWrites {
            first,
            count: count.min(BLOCKS as u64 - first),
        }),
        1 => Just(Op::FailBackingReads),
        1 => Just(Op::FailBackingFlushes),
        2 => Just(Op::HealBacking),
    ]
}

fn admission_strategy() -> impl Strategy<Value = AdmissionConfig> {
    prop_oneof![
        Just(AdmissionConfig::Always),
        Just(AdmissionConfig::SequentialCutoff { cutoff_bytes: 2 * BLOCK as u64 }),
        Just(AdmissionConfig::NHit { hits: 2 }),
    ]
}

fn run_strategy() -> impl Strategy<Value = CrashRun> {
    (
        prop::sample::select(CacheMode::ALL.to_vec()),
        prop::sample::select(vec![EvictionKind::Clock, EvictionKind::Fifo]),
        admission_strategy(),
        prop::option::weighted(0.7, 1..400u64),
        // Recovery has few persist points (two without overflow), so a cut meant for it is
        // drawn from the first few; one past its end lands early in the next segment.
        prop::option::weighted(0.3, 1..5u64),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(
            |(mode, eviction, admission, cut_at_point, cut_during_recovery_at, seed, pairs)| {
                CrashRun {
                    mode,
                    eviction,
                    admission,
                    cut_at_point,
                    cut_during_recovery_at,
                    seed,
                    concurrent_pairs: pairs,
                    // A quarter of the runs on a cache of two members (one per simulated
                    // node), the lanes' writes spread over both.
                    members: if seed % 4 == 0 { 2 } else { 1 },
                    data_crc: seed % 3 == 1,
                    ..CrashRun::default()
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: pmcache_engine::testing::proptest_cases(1500),
        ..ProptestConfig::default()
    })]

    /// Random workloads in every mode and policy, with power cuts between and inside operations
    /// (and inside the recovery that follows).
    #[test]
    fn model_holds_across_power_cuts(ops in prop::collection::vec(op_strategy(), 1..60), run in run_strategy()) {
        check_case(&ops, &run)?;
    }

    /// The same with the cache mode switched between operations. A write in write-through,
    /// write-around or pass-through mode over a block that an earlier write left dirty drops
    /// that copy, which another lane's overwrite may have superseded moments before: the
    /// removal that invariant 2 of docs/DURABILITY.md is about, here with data the model
    /// can check (a trim's block may read anything afterwards).
    #[test]
    fn model_holds_across_power_cuts_and_mode_changes(
        ops in prop::collection::vec(op_with_mode_changes_strategy(), 1..60),
        run in run_strategy(),
    ) {
        check_case(&ops, &run)?;
    }

    /// The same (with mode changes) on an index of 2 buckets, 16 entries for the cache's 20
    /// slots: most blocks new to the cache find their candidate buckets full and make room
    /// first (evict a clean block of theirs, or write a dirty one back and then evict it),
    /// inside read misses, writes, batches and recovery. With the index sized for the cache
    /// (the other tests) that never happens.
    #[test]
    fn model_holds_across_power_cuts_with_blocks_competing_for_index_room(
        ops in prop::collection::vec(op_with_mode_changes_strategy(), 1..60),
        run in run_strategy(),
    ) {
        // Two buckets are too few for a set's 32 slots: one medium here.
        let run = CrashRun { index_buckets: Some(2), members: 1, ..run };
        check_case(&ops, &run)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: pmcache_engine::testing::proptest_cases(1000),
        ..ProptestConfig::default()
    })]

    /// The same with a failing backing store: writes to some blocks, reads or flushes refused
    /// (EIO) and healed again, between power cuts. An operation may fail only with the
    /// backing store's error, and a failed one leaves what a power cut inside it would (each
    /// block old or new); every acknowledged write survives the cuts that follow. A segment
    /// that saw faults ends with the cache attached again to the healed store, then drained
    /// and checked.
    #[test]
    fn model_holds_across_power_cuts_with_a_failing_backing_store(
        ops in prop::collection::vec(op_with_backing_faults_strategy(), 1..80),
        run in run_strategy(),
    ) {
        check_case(&ops, &run)?;
    }
}

/// The fault-injecting runs above reach what they are for: over a fixed set of seeds, enough
/// operations fail with injected backing errors (in every mode), and power is cut while
/// faults are active, for the property to mean something.
#[test]
fn backing_faults_make_operations_fail_between_power_cuts() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0fa1);
    for mode in CacheMode::ALL {
        let (mut failed, mut cuts, mut reattaches) = (0u64, 0u64, 0u64);
        for _ in 0..40 {
            let mut ops = random_ops(&mut rng, 50);
            // Faults early, at random points, and healed later in some runs.
            for _ in 0..3 {
                let at = rng.gen_range(0..ops.len());
                let fault = match rng.gen_range(0..3) {
                    0 => Op::FailBackingWrites {
                        first: rng.gen_range(0..BLOCKS as u64 / 2),
                        count: 16,
                    },
                    1 => Op::FailBackingReads,
                    _ => Op::FailBackingFlushes,
                };
                ops.insert(at, fault);
            }
            if rng.gen_bool(0.5) {
                let at = rng.gen_range(ops.len() / 2..ops.len());
                ops.insert(at, Op::HealBacking);
            }
            // Pass-through persists little, so a cut at a persist point seldom comes: cut
            // between operations too.
            if rng.gen_bool(0.5) {
                let at = rng.gen_range(ops.len() / 3..ops.len());
                ops.insert(at, Op::PowerCut);
            }
            let run = CrashRun {
                mode,
                cut_at_point: rng.gen_bool(0.5).then(|| rng.gen_range(1..200)),
                seed: rng.r#gen(),
                concurrent_pairs: rng.gen_bool(0.5),
                ..CrashRun::default()
            };
            let outcome = run_crash_case(&ops, &run)
                .unwrap_or_else(|failure| panic!("{mode} ({run:?}): {failure}\nops: {ops:?}"));
            failed += outcome.failed_ops;
            cuts += outcome.power_cuts;
            reattaches += outcome.reattaches;
        }
        eprintln!(
            "{mode}: {failed} operations failed, {cuts} power cuts, {reattaches} re-attaches"
        );
        assert!(failed >= 40, "{mode}: only {failed} operations failed");
        assert!(cuts >= 10, "{mode}: only {cuts} power cuts");
        assert!(reattaches >= 5, "{mode}: only {reattaches} re-attaches after faults");
    }
}

fn random_ops(rng: &mut SmallRng, count: usize) -> Vec<Op> {
    let block = BLOCK as u64;
    (0..count)
        .map(|_| {
            let offset = rng.gen_range(0..DEVICE_BYTES);
            let len = rng.gen_range(1..=(DEVICE_BYTES - offset).min(3 * block));
            let aligned_offset = rng.gen_range(0..BLOCKS as u64) * block;
            match rng.gen_range(0..22) {
                19 => Op::WriteBatch {
                    writes: (0..rng.gen_range(2..8))
                        .map(|_| (rng.gen_range(0..BLOCKS as u64) * block, block))
                        .collect(),
                    fua: false,
                },
                20 => Op::ReadBatch {
                    reads: (0..rng.gen_range(2..8))
                        .map(|_| (rng.gen_range(0..BLOCKS as u64) * block, block))
                        .collect(),
                },
                0..=4 => Op::Write { offset: aligned_offset, len: block, fua: rng.gen_bool(0.2) },
                5..=7 => Op::Write { offset, len, fua: rng.gen_bool(0.2) },
                8..=12 => Op::Read { offset: aligned_offset, len: block },
                13..=14 => Op::Read { offset, len },
                15 => Op::Trim { offset, len },
                16 => Op::WriteZeroes { offset, len, fua: false },
                17 => Op::Flush,
                18 => Op::Drain,
                _ => Op::Write { offset: aligned_offset, len: block, fua: false },
            }
        })
        .collect()
}

/// 10,000 power cuts at random persist points: mid-write, mid-eviction and write-back,
/// mid-drain, mid-flush, and (in a third of the runs, armed for the recovery after the first
/// cut) again mid-recovery — counted, and required to be at least 500 — and, in half the
/// runs, while two operations are in flight on the two lanes (at least 500): on disjoint
/// blocks, or, in half of those runs, also two writes, trims or write-zeroes on the same
/// blocks, which must end as one of their two orders, block by block.
#[test]
fn ten_thousand_random_power_cuts() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0001);
    let mut cuts = 0u64;
    let mut in_recovery = 0u64;
    let mut in_pairs = 0u64;
    let mut overlapping = 0u64;
    let mut runs = 0u64;
    while cuts < 10_000 {
        let mode = CacheMode::ALL[rng.gen_range(0..CacheMode::ALL.len())];
        let count = rng.gen_range(20..60);
        let ops = random_ops(&mut rng, count);
        let run = CrashRun {
            mode,
            eviction: if rng.gen_bool(0.5) { EvictionKind::Clock } else { EvictionKind::Fifo },
            cut_at_point: Some(rng.gen_range(1..300)),
            cut_during_recovery_at: rng.gen_bool(0.33).then(|| rng.gen_range(1..5)),
            seed: rng.r#gen(),
            concurrent_pairs: rng.gen_bool(0.5),
            overlapping_pairs: rng.gen_bool(0.5),
            ..CrashRun::default()
        };
        let outcome = run_crash_case(&ops, &run).unwrap_or_else(|failure| {
            panic!("run {runs} ({run:?}) failed: {failure}\nops: {ops:?}")
        });
        cuts += outcome.power_cuts;
        in_recovery += outcome.cuts_during_recovery;
        in_pairs += outcome.cuts_during_pairs;
        overlapping += outcome.overlapping_pairs;
        runs += 1;
    }
    eprintln!(
        "{cuts} power cuts over {runs} runs, {in_recovery} of them inside a recovery, \
         {in_pairs} with two operations in flight; {overlapping} pairs on the same blocks"
    );
    assert!(overlapping >= 500, "only {overlapping} pairs on the same blocks");
    assert!(in_recovery >= 500, "only {in_recovery} power cuts landed inside a recovery");
    assert!(in_pairs >= 500, "only {in_pairs} power cuts landed with two operations in flight");
}

/// Power cuts at random persist points of a cache of two or three members (one per simulated
/// node, each of 16 slots, the lanes' threads moving from node to node at every refill of
/// their free runs): acknowledged writes spread over every member, and the members' pools,
/// hands and fallbacks all run, must all survive, with cuts inside recovery and inside pairs
/// of operations in flight as in the one-medium runs.
#[test]
fn power_cuts_over_a_cache_of_several_members() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0048);
    let (mut cuts, mut runs, mut in_recovery) = (0u64, 0u64, 0u64);
    while cuts < 2_000 {
        let mode = CacheMode::ALL[rng.gen_range(0..CacheMode::ALL.len())];
        let count = rng.gen_range(20..60);
        let ops = random_ops(&mut rng, count);
        let run = CrashRun {
            mode,
            eviction: if rng.gen_bool(0.5) { EvictionKind::Clock } else { EvictionKind::Fifo },
            cut_at_point: Some(rng.gen_range(1..300)),
            cut_during_recovery_at: rng.gen_bool(0.33).then(|| rng.gen_range(1..5)),
            seed: rng.r#gen(),
            concurrent_pairs: rng.gen_bool(0.5),
            overlapping_pairs: rng.gen_bool(0.5),
            members: rng.gen_range(2..=3),
            ..CrashRun::default()
        };
        let outcome = run_crash_case(&ops, &run).unwrap_or_else(|failure| {
            panic!("run {runs} ({run:?}) failed: {failure}\nops: {ops:?}")
        });
        cuts += outcome.power_cuts;
        in_recovery += outcome.cuts_during_recovery;
        runs += 1;
    }
    eprintln!("{cuts} power cuts over {runs} runs of sets, {in_recovery} inside a recovery");
    assert!(in_recovery >= 100, "only {in_recovery} power cuts landed inside a recovery");
}

/// A scripted workload that fills the cache past capacity (forcing evictions and write-backs),
/// overwrites, trims, flushes and drains; power is cut after the N-th persist for every N.
#[test]
fn crash_point_enumeration() {
    let block = BLOCK as u64;
    let mut ops = Vec::new();
    for b in 0..30 {
        ops.push(Op::Write { offset: b * block, len: block, fua: false });
    }
    for b in (0..30).step_by(3) {
        ops.push(Op::Write { offset: b * block + 100, len: 300, fua: false });
        ops.push(Op::Read { offset: b * block, len: block });
    }
    ops.push(Op::Trim { offset: 4 * block, len: 3 * block });
    ops.push(Op::WriteZeroes { offset: 10 * block, len: 2 * block, fua: true });
    ops.push(Op::Flush);
    for b in 30..40 {
        ops.push(Op::Write { offset: b * block, len: block, fua: false });
    }
    ops.push(Op::Drain);
    for b in 0..8 {
        ops.push(Op::Write { offset: b * block, len: block, fua: false });
    }
    // Group commits: new blocks, overwrites, a repeated block, a partial write in the batch.
    ops.push(Op::WriteBatch {
        writes: [40, 41, 42, 0, 1].iter().map(|&b| (b * block, block)).collect(),
        fua: false,
    });
    ops.push(Op::WriteBatch {
        writes: vec![
            (2 * block, block),
            (3 * block, block),
            (2 * block, block),
            (5 * block + 7, 100),
            (5 * block, block),
        ],
        fua: false,
    });
    ops.push(Op::ReadBatch { reads: (0..6).map(|b| (b * block, block)).collect() });
    for mode in CacheMode::ALL {
        let base = CrashRun { mode, seed: 7, ..CrashRun::default() };
        let total = run_crash_case(&ops, &base)
            .expect("run without power cut")
            .persist_points_first_segment;
        assert!(total > 50, "{mode}: only {total} persist points");
        for point in 1..=total {
            let run = CrashRun { cut_at_point: Some(point), seed: point, ..base.clone() };
            let outcome = run_crash_case(&ops, &run).unwrap_or_else(|failure| {
                panic!("{mode}, cut at persist {point} of {total}: {failure}")
            });
            assert_eq!(outcome.power_cuts, 1, "{mode}: the cut at {point} did not happen");
        }
        eprintln!("{mode}: power cut after each of {total} persist points");
    }
}

/// A scripted workload over a backing store that fails part of the time: writes to some
/// blocks refused while the cache fills and reclaims (write-backs fail and are retried
/// elsewhere), a failing flush (after which nothing is trusted until the next attach), reads
/// refused, then healed. Power is cut after the N-th persist for every N, in every mode.
#[test]
fn crash_point_enumeration_with_a_failing_backing_store() {
    let block = BLOCK as u64;
    let mut ops = Vec::new();
    for b in 0..12 {
        ops.push(Op::Write { offset: b * block, len: block, fua: false });
    }
    ops.push(Op::FailBackingWrites { first: 0, count: 8 });
    for b in 12..32 {
        ops.push(Op::Write { offset: b * block, len: block, fua: false });
    }
    ops.push(Op::Write { offset: 2 * block + 50, len: 100, fua: false });
    ops.push(Op::Drain);
    ops.push(Op::FailBackingReads);
    ops.push(Op::Read { offset: 40 * block, len: block });
    ops.push(Op::Write { offset: 41 * block + 7, len: 30, fua: false });
    ops.push(Op::FailBackingFlushes);
    ops.push(Op::Write { offset: 33 * block, len: block, fua: true });
    ops.push(Op::Flush);
    ops.push(Op::HealBacking);
    for b in 0..6 {
        ops.push(Op::Write { offset: b * block, len: block, fua: false });
    }
    ops.push(Op::WriteBatch { writes: (20..26).map(|b| (b * block, block)).collect(), fua: false });
    ops.push(Op::Drain);
    for mode in CacheMode::ALL {
        let base = CrashRun { mode, seed: 11, ..CrashRun::default() };
        let clean = run_crash_case(&ops, &base).expect("run without power cut");
        assert!(clean.failed_ops >= 3, "{mode}: only {} operations failed", clean.failed_ops);
        // Every point, the drain after the attach that follows the faults included.
        let total = clean.persist_points_without_cuts;
        assert!(total > clean.persist_points_first_segment, "{mode}: no re-attach");
        for point in 1..=total {
            let run = CrashRun { cut_at_point: Some(point), seed: point, ..base.clone() };
            let outcome = run_crash_case(&ops, &run).unwrap_or_else(|failure| {
                panic!("{mode}, cut at persist {point} of {total}: {failure}")
            });
            assert_eq!(outcome.power_cuts, 1, "{mode}: the cut at {point} did not happen");
        }
        eprintln!(
            "{mode}: {} operations failed; power cut after each of {total} persist points",
            clean.failed_ops
        );
    }
}
