//! Regression cases found by the property tests, kept as fixed scripts.

use pmcache_engine::testing::model::{CrashRun, Op, run_crash_case};
use pmcache_engine::{AdmissionConfig, CacheMode, EvictionKind};
/// A case of `model_holds_across_power_cuts`. Pins the sync before a write-through frees the
/// dirty copy it supersedes (a block dirty after recovery's synced rule): were the dirty copy
/// freed once the new data has been `pwrite`n but before the backing store is synced, the new
/// clean copy could be evicted, and a power cut would roll the block back to a version older
/// than an acknowledged, durable one.
#[test]
fn write_through_over_a_dirty_block_keeps_it_durable() {
    let ops = vec![
        Op::Write { offset: 10752, len: 1536, fua: false },
        Op::PowerCut,
        Op::Write { offset: 6656, len: 512, fua: true },
        Op::Write { offset: 7168, len: 1024, fua: false },
        Op::Read { offset: 8192, len: 1536 },
        Op::Read { offset: 16388, len: 1533 },
        Op::Write { offset: 10240, len: 512, fua: false },
        Op::Read { offset: 15360, len: 1536 },
        Op::Read { offset: 3948, len: 127 },
        Op::Write { offset: 5632, len: 1024, fua: false },
        Op::PowerCut,
        Op::Write { offset: 23431, len: 641, fua: true },
        Op::Flush,
        Op::Read { offset: 3072, len: 1536 },
        Op::Write { offset: 10905, len: 245, fua: true },
        Op::WriteZeroes { offset: 11912, len: 1205, fua: false },
        Op::PowerCut,
    ];
    let run = CrashRun {
        mode: CacheMode::WriteThrough,
        eviction: EvictionKind::Fifo,
        admission: AdmissionConfig::NHit { hits: 2 },
        cut_at_point: Some(280),
        cut_during_recovery_at: Some(37),
        seed: 10954214153783984060,
        ..CrashRun::default()
    };
    if let Err(failure) = run_crash_case(&ops, &run) {
        panic!("{failure}");
    }
}

/// A case of `model_holds_across_power_cuts` (two lanes, used alternately). Pins the stripe's
/// pending free (DURABILITY.md invariant 2): lane 1 overwrites a block, the zeroing of the
/// superseded entry left to its next fence; lane 0 then writes the new copy back, marks it
/// clean and evicts it, durably. Unless the eviction settles the pending free first, a power
/// cut leaves only the stale dirty entry, and recovery resurrects it over an acknowledged
/// write.
#[test]
fn a_superseded_entry_never_outlives_the_eviction_of_its_successor() {
    let ops = vec![
        Op::Write { offset: 22528, len: 1536, fua: false },
        Op::PowerCut,
        Op::Read { offset: 20480, len: 1536 },
        Op::Write { offset: 10752, len: 1536, fua: false },
        Op::Write { offset: 1024, len: 1025, fua: true },
        Op::Drain,
        Op::Write { offset: 11256, len: 705, fua: true },
        Op::Write { offset: 7168, len: 512, fua: true },
        Op::Flush,
        Op::Write { offset: 12378, len: 1270, fua: false },
        Op::Read { offset: 0, len: 1536 },
        Op::Write { offset: 8170, len: 962, fua: false },
        Op::Read { offset: 10682, len: 1515 },
        Op::Trim { offset: 13468, len: 422 },
        Op::Read { offset: 21504, len: 512 },
        Op::Read { offset: 8704, len: 1536 },
        Op::Write { offset: 11264, len: 1024, fua: false },
        Op::Write { offset: 18118, len: 1491, fua: false },
        Op::Write { offset: 5120, len: 1024, fua: false },
        Op::Read { offset: 6070, len: 1308 },
        Op::Read { offset: 14336, len: 512 },
        Op::Read { offset: 15872, len: 512 },
        Op::Read { offset: 15872, len: 512 },
        Op::Write { offset: 2048, len: 1024, fua: true },
        Op::Write { offset: 8271, len: 270, fua: true },
        Op::Read { offset: 9216, len: 1024 },
        Op::Trim { offset: 8293, len: 1356 },
        Op::Write { offset: 5120, len: 1024, fua: true },
        Op::Write { offset: 2560, len: 1536, fua: true },
        Op::Write { offset: 10240, len: 1536, fua: false },
        Op::Read { offset: 1024, len: 512 },
        Op::Write { offset: 2048, len: 512, fua: false },
        Op::Write { offset: 9728, len: 1536, fua: true },
        Op::Drain,
        Op::Read { offset: 20992, len: 512 },
        Op::WriteZeroes { offset: 12576, len: 317, fua: false },
        Op::PowerCut,
    ];
    let run = CrashRun {
        eviction: EvictionKind::Fifo,
        admission: AdmissionConfig::NHit { hits: 2 },
        cut_at_point: Some(291),
        cut_during_recovery_at: Some(32),
        seed: 6105861013921432921,
        ..CrashRun::default()
    };
    if let Err(failure) = run_crash_case(&ops, &run) {
        panic!("{failure}");
    }
}

/// A case of `model_holds_across_power_cuts_with_blocks_competing_for_index_room` (an index of
/// 2 buckets for 20 slots, where removals for index room are constant). With address-ordered
/// allocation this script does not reach a cut inside a removal that depends on the remover's
/// own fence for a pending free: it passes with that fence taken out, as do 20,000 random
/// cases. `pending_free.rs` `a_cut_inside_the_removal_never_brings_the_overwritten_copy_back`
/// pins that fence; this script is kept as a workload of constant removals.
#[test]
fn blocks_competing_for_index_room_survive_power_cuts() {
    let ops = vec![
        Op::Write { offset: 22016, len: 512, fua: false },
        Op::ReadBatch { reads: vec![(0, 512)] },
        Op::Write { offset: 0, len: 1024, fua: false },
        Op::Write { offset: 10269, len: 484, fua: true },
        Op::WriteBatch {
            writes: vec![
                (11776, 512),
                (7805, 104),
                (4096, 512),
                (23969, 166),
                (23552, 512),
                (5979, 1352),
            ],
            fua: true,
        },
        Op::SetMode { mode: CacheMode::WriteBack },
        Op::Trim { offset: 8297, len: 746 },
        Op::Write { offset: 15436, len: 453, fua: true },
        Op::PowerCut,
        Op::Write { offset: 8704, len: 1536, fua: false },
        Op::WriteBatch {
            writes: vec![(11776, 512), (4096, 512), (15872, 512), (2560, 512)],
            fua: true,
        },
        Op::Write { offset: 9728, len: 512, fua: true },
        Op::WriteBatch { writes: vec![(6656, 512), (12288, 512)], fua: true },
    ];
    let run = CrashRun {
        admission: AdmissionConfig::NHit { hits: 2 },
        cut_at_point: Some(347),
        cut_during_recovery_at: Some(37),
        seed: 7357249518273205890,
        index_buckets: Some(2),
        ..CrashRun::default()
    };
    if let Err(failure) = run_crash_case(&ops, &run) {
        panic!("{failure}");
    }
}

/// A case of `model_holds_across_power_cuts`, which requires every recovery after a cut to
/// report no corrupt entry. Pins recovery's zeroing of word 1 of a free slot: a cut keeps word
/// 1 of a new entry and loses its word 0, so the slot reads as free with word 1 still holding
/// a sequence number. Were it put in the free pool as it is, and the next entry written there
/// (a sequence number with the same low byte) cut in turn after its word 0, the pair (new word
/// 0, old word 1) would fail its check: reported as corrupt, where a torn entry (dropped, not
/// counted as corruption) is all a power cut made. Shrunk by proptest from a failure of that
/// property test with the zeroing taken out; it fails without it.
#[test]
fn a_torn_entry_over_a_free_slots_old_word_1_is_not_corruption() {
    let ops = vec![
        Op::WriteBatch { writes: vec![(1539, 1022), (1536, 512)], fua: false },
        Op::Read { offset: 18944, len: 512 },
        Op::Write { offset: 20992, len: 512, fua: true },
        Op::Write { offset: 20584, len: 927, fua: true },
        Op::Drain,
        Op::Read { offset: 4699, len: 213 },
        Op::Read { offset: 16384, len: 512 },
        Op::Write { offset: 1024, len: 1024, fua: true },
        Op::PowerCut,
    ];
    let run = CrashRun {
        admission: AdmissionConfig::SequentialCutoff { cutoff_bytes: 1024 },
        cut_at_point: Some(57),
        cut_during_recovery_at: Some(4),
        seed: 8758126944962122312,
        concurrent_pairs: true,
        ..CrashRun::default()
    };
    if let Err(failure) = run_crash_case(&ops, &run) {
        panic!("{failure}");
    }
}
