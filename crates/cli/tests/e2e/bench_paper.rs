//! `pmcache bench paper` experiments that drive the real server: paper 002's runs spawn
//! `pmcache serve` from this binary under `taskset` and write to it with fio over NBD, so
//! they are tested here, on the built binary, rather than from the bench crate's tests.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

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
    assert!(ours.contains("stalls in all with boost off"), "{ours}");
    for picture in ["002-fig3.svg", "002-fig3.png"] {
        let bytes = std::fs::metadata(out.path().join(picture)).map(|m| m.len()).unwrap_or(0);
        assert!(bytes > 0, "{picture}");
    }
}
