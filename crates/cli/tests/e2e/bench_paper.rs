//! `pmcache bench paper` experiments that drive the real server: paper 002's runs spawn
//! `pmcache serve` from this binary under `taskset` and write to it with fio over NBD, so
//! they are tested here, on the built binary, rather than from the bench crate's tests.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::common::*;

/// These benches load every CPU (paper 002's measures how its writers fare against a CPU
/// hog; `bench fs` runs hundreds of threads): one at a time, so that none measures another.
static ONE_BENCH_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_bench_at_a_time() -> MutexGuard<'static, ()> {
    ONE_BENCH_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One figure's JSON.
fn figure(dir: &std::path::Path, id: &str) -> serde_json::Value {
    let path = dir.join(format!("{id}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The medians of a series' measured points, and how many points it has in all.
fn medians(series: &serde_json::Value) -> (Vec<f64>, usize) {
    let points = series["points"].as_array().expect("points");
    let measured = points.iter().filter_map(|p| p["median"].as_f64()).collect();
    (measured, points.len())
}

/// Paper 002 at the smallest scale, one run of one second per configuration: every
/// configuration measured something, and Fig 3 is a time series of stalls per write with
/// boost off and on.
#[test]
fn paper_002_measures_every_configuration_and_draws_stalls_over_time() {
    require_fio_nbd();
    let _alone = one_bench_at_a_time();
    let out = TempDir::new_in(&std::env::temp_dir(), "bench-paper-002");
    let disk = TempDir::new_in(&std::env::temp_dir(), "bench-paper-002-disk");
    let printed = run_ok(
        Command::new(PMCACHE)
            .args(["bench", "paper", "002-fig3", "--scale", "smallest", "--seconds", "1"])
            .args(["--runs", "1", "--out"])
            .arg(out.path())
            .arg("--dir")
            .arg(disk.path())
            .args(["--pm-dir", "/dev/shm"]),
        Duration::from_secs(300),
    );
    for id in ["002-fig2", "002-fig3-totals", "002-fig4", "002-table1"] {
        let figure = figure(out.path(), id);
        for series in figure["series"].as_array().expect("series") {
            let (measured, all) = medians(series);
            assert_eq!(measured.len(), all, "{id} {}: a configuration measured nothing", series);
            if id != "002-fig3-totals" {
                assert!(measured.iter().all(|&v| v > 0.0), "{id}: {series}");
            }
        }
        assert!(printed.contains(&format!("{id} — ")), "{id}'s table is printed: {printed}");
    }
    let fig3 = figure(out.path(), "002-fig3");
    let intervals = fig3["x_ticks"].as_array().expect("ticks").len();
    assert!(intervals >= 1, "a one-second run has at least one 0.5 s interval: {fig3}");
    let names: Vec<&str> = fig3["series"]
        .as_array()
        .expect("series")
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, ["boost off", "boost on"]);
    for series in fig3["series"].as_array().expect("series") {
        let (measured, all) = medians(series);
        assert_eq!(all, intervals, "{series}");
        assert!(!measured.is_empty(), "an interval with writes: {series}");
        assert!(measured.iter().all(|v| (0.0..=1000.0).contains(v)), "{series}");
    }
    let ours = fig3["ours"].as_str().expect("ours");
    assert!(ours.contains("failed insertions in all with boost off"), "{ours}");
    for picture in ["002-fig3.svg", "002-fig3.png"] {
        let bytes = std::fs::metadata(out.path().join(picture)).map(|m| m.len()).unwrap_or(0);
        assert!(bytes > 0, "{picture}");
    }
}

/// `bench fs`: each personality a second on a temporary directory, the paper's threads and
/// two; the JSON holds filebench's summary and every flowop of each loop.
#[test]
fn bench_fs_runs_each_personality_and_writes_its_flowops() {
    let _alone = one_bench_at_a_time();
    let dir = TempDir::new_in(&std::env::temp_dir(), "bench-fs");
    let json = dir.path().join("fs.json");
    let printed = run_ok(
        Command::new(PMCACHE)
            .args(["bench", "fs", "--personality", "all", "--scale", "smallest"])
            .args(["--seconds", "1", "--threads", "paper,2", "--dir"])
            .arg(dir.path())
            .arg("--json-out")
            .arg(&json),
        Duration::from_secs(300),
    );
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON")).expect("JSON");
    let results = results.as_array().expect("an array");
    let runs: Vec<(&str, &str)> = results
        .iter()
        .map(|r| (r["personality"].as_str().unwrap(), r["threads"].as_str().unwrap()))
        .collect();
    assert_eq!(
        runs,
        [
            ("fileserver", "50"),
            ("fileserver", "2"),
            ("webserver", "50"),
            ("webserver", "2"),
            ("varmail", "50"),
            ("varmail", "2"),
            ("oltp", "1+10+200"),
            ("oltp", "1+10+2")
        ]
    );
    let loop_lengths = [("fileserver", 11), ("webserver", 31), ("varmail", 13), ("oltp", 12)];
    for r in results {
        let name = r["personality"].as_str().unwrap();
        assert!(r["ops"].as_u64().unwrap() > 0 && r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
        let flowops = r["flowops"].as_array().expect("flowops");
        let expected = loop_lengths.iter().find(|(p, _)| *p == name).unwrap().1;
        assert_eq!(flowops.len(), expected, "{name}: every flowop of its loops");
        let counted: u64 = flowops
            .iter()
            .filter(|f| f["counted"].as_bool().unwrap())
            .map(|f| f["ops"].as_u64().unwrap())
            .sum();
        assert_eq!(counted, r["ops"].as_u64().unwrap(), "{name}: ops are the counted flowops'");
    }
    assert!(printed.contains("IO Summary:"), "{printed}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != "fs.json")
        .collect();
    assert!(left.is_empty(), "the filesets are removed: {left:?}");
    // A directory that is not there: a clear refusal.
    let missing = dir.path().join("missing");
    let out = Command::new(PMCACHE)
        .args(["bench", "fs", "--personality", "varmail", "--dir"])
        .arg(&missing)
        .output()
        .expect("pmcache");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--dir") && stderr.contains("missing"), "{stderr}");
}

/// Paper 003's Fig 2 on this host's beds (as root: it mounts tmpfs, attaches loop devices and
/// serves pmcache through nbdfuse): every personality measured on every bed, ratios to the
/// tmpfs bed, and everything it set up undone.
#[test]
fn paper_003_host_beds_measure_every_personality_and_clean_up() {
    if std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("proc")) != 0 {
        eprintln!("skipped: 003-fig2-host mounts file systems (CI runs the tests as root)");
        return;
    }
    require_tool("nbdfuse", "libnbd-bin");
    require_tool("mkfs.ext4", "e2fsprogs");
    let _alone = one_bench_at_a_time();
    let out = TempDir::new_in(&std::env::temp_dir(), "bench-paper-003");
    let disk = TempDir::new_in(&std::env::temp_dir(), "bench-paper-003-disk");
    run_ok(
        Command::new(PMCACHE)
            .args(["bench", "paper", "003-fig2-host", "--scale", "smallest", "--seconds", "0.5"])
            .args(["--runs", "1", "--out"])
            .arg(out.path())
            .arg("--dir")
            .arg(disk.path())
            .args(["--pm-dir", "/dev/shm"]),
        Duration::from_secs(600),
    );
    for id in ["003-fig2-host", "003-fig2-host-2threads"] {
        let figure = figure(out.path(), id);
        let ticks: Vec<&str> =
            figure["x_ticks"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(ticks, ["fileserver", "webserver", "varmail", "oltp"]);
        let series = figure["absolute"]["series"].as_array().expect("absolute");
        assert_eq!(series.len(), 3, "three beds");
        for s in series {
            let (measured, all) = medians(s);
            assert_eq!(measured.len(), all, "{id}: a personality unmeasured on {s}");
            assert!(measured.iter().all(|&v| v > 0.0), "{id}: {s}");
        }
        assert!(figure["ours"].as_str().unwrap().contains("ext4 over pmcache"), "{figure}");
    }
    let mounts_after = std::fs::read_to_string("/proc/mounts").expect("mounts");
    assert!(!mounts_after.contains("pmcache-003-"), "a bed is still mounted: {mounts_after}");
    let left: Vec<_> = std::fs::read_dir(disk.path()).expect("dir").collect();
    assert!(left.is_empty(), "the backing file is removed: {left:?}");
}
