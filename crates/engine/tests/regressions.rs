//! Regression cases found by the property tests, kept as fixed scripts.

use pmcache_engine::testing::model::{CrashRun, Op, run_crash_case};
use pmcache_engine::{AdmissionConfig, CacheMode, EvictionKind};
/// Found by `model_holds_across_power_cuts`: in write-through mode a write superseded a dirty
/// block (dirty after recovery's synced rule); the dirty copy was freed once the new data had
/// been `pwrite`n but before the backing store was synced, the new clean copy was evicted, and
/// a power cut rolled the block back to a version older than an acknowledged, durable one.
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
    };
    if let Err(failure) = run_crash_case(&ops, &run) {
        panic!("{failure}");
    }
}
