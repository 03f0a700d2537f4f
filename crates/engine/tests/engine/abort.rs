//! A panic inside the engine ends the process, in a build that unwinds too (this test binary
//! unwinds: the test harness needs it) and under a `catch_unwind`: each test runs its engine in
//! a child process (this binary again, the test selected by name) with the `panic-mid-write`
//! failpoint armed, and expects the child to die of SIGABRT with the engine's message.

#![cfg(not(feature = "shuttle"))]

use std::os::unix::process::ExitStatusExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::{Command, Output};
use std::sync::Arc;

use pmcache_engine::testing::SimBacking;
use pmcache_engine::{AdmissionConfig, Config, Engine, ManualClock, WriteRequest};
use pmcache_media::{CrashMedium, CrashSwitch};

const BLOCK: usize = 512;
const BLOCKS: u64 = 1024;
const MEDIUM_BYTES: u64 = 8192 + 256 * BLOCK as u64;
/// Set in a child: run the engine, not the parent's checks.
const CHILD: &str = "PMCACHE_ENGINE_ABORT_TEST_CHILD";

fn engine() -> Engine<CrashMedium, SimBacking, Arc<ManualClock>> {
    let switch = CrashSwitch::new();
    let config = Config {
        block_size: BLOCK as u32,
        max_lanes: 2,
        admission: AdmissionConfig::Always,
        ..Config::default()
    };
    Engine::format(
        CrashMedium::new(MEDIUM_BYTES, switch.clone(), 1),
        SimBacking::new(BLOCKS * BLOCK as u64, switch, 2),
        Arc::new(ManualClock::default()),
        &config,
    )
    .expect("format")
}

/// Runs the test `name` of this binary in a child process with `PMCACHE_FAILPOINT` set to
/// `failpoint`.
fn child(name: &str, failpoint: &str) -> Output {
    let exe = std::env::current_exe().expect("this test binary");
    Command::new(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("PMCACHE_FAILPOINT", failpoint)
        .output()
        .expect("run the child")
}

/// Checks that the child died of SIGABRT, after the failpoint's panic, with the abort of
/// the guard of `entry`, and that it never got past it (`unreachable` never printed).
fn assert_aborted_in(out: &Output, failpoint: &str, entry: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!("status {:?}\n--- stdout\n{stdout}--- stderr\n{stderr}", out.status);
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "not aborted: {context}");
    assert!(stderr.contains(&format!("failpoint PMCACHE_FAILPOINT={failpoint}")), "{context}");
    assert!(stderr.contains(&format!("a panic unwound out of {entry}; aborting")), "{context}");
    assert!(stdout.contains("before the failpoint: done"), "{context}");
    assert!(!stdout.contains("unreachable"), "{context}");
}

#[test]
fn a_panic_mid_write_aborts_through_a_catch_unwind() {
    const NAME: &str = "abort::a_panic_mid_write_aborts_through_a_catch_unwind";
    if std::env::var_os(CHILD).is_none() {
        let out = child(NAME, "panic-mid-write:3");
        assert_aborted_in(&out, "panic-mid-write:3", "Lane::write");
        return;
    }
    let engine = engine();
    let mut lane = engine.lane().expect("lane");
    for lba in 0..2u64 {
        lane.write(lba * BLOCK as u64, &[lba as u8 + 1; BLOCK], false).expect("write");
    }
    println!("before the failpoint: done");
    let caught =
        catch_unwind(AssertUnwindSafe(|| lane.write(2 * BLOCK as u64, &[3; BLOCK], false)));
    // Only reached if the panic unwound out of the engine.
    println!("unreachable: the write returned {:?}", caught.map(|r| r.is_ok()));
}

#[test]
fn a_panic_mid_group_commit_aborts() {
    const NAME: &str = "abort::a_panic_mid_group_commit_aborts";
    if std::env::var_os(CHILD).is_none() {
        let out = child(NAME, "panic-mid-write:13");
        assert_aborted_in(&out, "panic-mid-write:13", "Lane::write_batch");
        return;
    }
    let engine = engine();
    let mut lane = engine.lane().expect("lane");
    let data: Vec<Vec<u8>> = (0..8).map(|i| vec![i as u8 + 1; BLOCK]).collect();
    let batch = |first: u64| -> Vec<WriteRequest<'_>> {
        (0..8)
            .map(|i| WriteRequest {
                offset: (first + i as u64) * BLOCK as u64,
                data: &data[i],
                fua: false,
            })
            .collect()
    };
    let mut outcomes = Vec::new();
    lane.write_batch(&batch(0), &mut outcomes);
    assert!(outcomes.iter().all(Result::is_ok));
    println!("before the failpoint: done");
    // The 5th write of this group is the 13th block write.
    lane.write_batch(&batch(100), &mut outcomes);
    println!("unreachable: the batch returned");
}
