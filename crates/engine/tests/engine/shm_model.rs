//! The model test on the real medium: a file in /dev/shm mapped as PM, with a real backing
//! file. A "power cut" here is a process crash: the engine is dropped without shutdown and the
//! cache re-attached from the files, so every completed store must still be there.

use pmcache_backing::PsyncFile;
use pmcache_engine::testing::model::{
    BLOCK, DEVICE_BYTES, MEDIUM_BYTES, Model, Op, config, run_op, verify_all,
};
use pmcache_engine::{AdmissionConfig, CacheMode, Engine, EvictionKind, MonotonicClock};
use pmcache_media::PmemFile;
use proptest::prelude::*;

fn op_strategy() -> impl Strategy<Value = Op> {
    let device = DEVICE_BYTES;
    let range = (0..device)
        .prop_flat_map(move |offset| (Just(offset), 1..=(device - offset).min(3 * BLOCK as u64)));
    let batch_item = prop_oneof![
        3 => (0..(DEVICE_BYTES / BLOCK as u64)).prop_map(|b| (b * BLOCK as u64, BLOCK as u64)),
        1 => range.clone(),
    ];
    prop_oneof![
        2 => prop::collection::vec(batch_item.clone(), 1..8)
            .prop_map(|writes| Op::WriteBatch { writes, fua: false }),
        1 => prop::collection::vec(batch_item, 1..8).prop_map(|reads| Op::ReadBatch { reads }),
        4 => range.clone().prop_map(|(offset, len)| Op::Read { offset, len }),
        4 => (range.clone(), any::<bool>()).prop_map(|((offset, len), fua)| Op::Write { offset, len, fua }),
        1 => range.clone().prop_map(|(offset, len)| Op::Trim { offset, len }),
        1 => range.prop_map(|(offset, len)| Op::WriteZeroes { offset, len, fua: false }),
        1 => Just(Op::Flush),
        1 => Just(Op::Drain),
        1 => Just(Op::PowerCut),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: pmcache_engine::testing::proptest_cases(200),
        ..ProptestConfig::default()
    })]

    #[test]
    fn model_holds_on_a_dev_shm_medium_across_process_crashes(
        ops in prop::collection::vec(op_strategy(), 1..80),
        mode in prop::sample::select(CacheMode::ALL.to_vec()),
    ) {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let pm = dir.path().join("pm");
        let backing_path = dir.path().join("backing");
        std::fs::File::create(&backing_path).unwrap().set_len(DEVICE_BYTES).unwrap();
        let cfg = config(mode, EvictionKind::Clock, AdmissionConfig::Always);
        let medium = PmemFile::open(&pm, Some(MEDIUM_BYTES)).unwrap();
        let mut engine = Engine::format(medium, PsyncFile::open(&backing_path).unwrap(), MonotonicClock::default(), &cfg).unwrap();
        let mut model = Model::new(mode);
        for op in &ops {
            if let Op::PowerCut = op {
                drop(engine);
                let medium = PmemFile::open(&pm, None).unwrap();
                let backing = PsyncFile::open(&backing_path).unwrap();
                engine = Engine::open(medium, backing, MonotonicClock::default(), &cfg).unwrap().0;
                let mut lane = engine.lane().unwrap();
                verify_all(&mut lane, &mut model).map_err(TestCaseError::fail)?;
                continue;
            }
            let mut lane = engine.lane().unwrap();
            let done = run_op(&mut lane, &mut model, op).map_err(TestCaseError::fail)?;
            done.check_reads(&mut model).map_err(TestCaseError::fail)?;
            model.apply(op, &done.data);
        }
        let mut lane = engine.lane().unwrap();
        lane.drain().unwrap();
        model.apply(&Op::Drain, &[]);
        verify_all(&mut lane, &mut model).map_err(TestCaseError::fail)?;
        model.check_backing(&std::fs::read(&backing_path).unwrap()).map_err(TestCaseError::fail)?;
    }
}
