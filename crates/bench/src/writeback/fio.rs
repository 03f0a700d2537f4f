//! fio's side of `bench writeback`: random writes and reads on the backing file, the drain's blocks
//! replayed.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use super::engine::min_window;
use super::{BLOCK_BYTES, Plan, Sample, Shape, WritebackArgs};
use crate::harness::fio::{captured_report, read_timeline};

/// fio on `file` with `engine` (`psync`, `libaio`, `io_uring`: one of `RAW_ENGINES`).
fn fio_base(args: &WritebackArgs, file: &Path, engine: &str) -> Command {
    let mut cmd = Command::new(&args.fio);
    cmd.arg("--name=pmcache")
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--ioengine={engine}"))
        .args(["--direct=1", "--bs=4096", "--thread", "--group_reporting"])
        .args(["--output-format=json", "--lat_percentiles=1"])
        .arg("--percentile_list=50:99:99.9");
    cmd
}

/// fio's random writes (`write`: with a per-second timeline) or reads on the backing file
/// with `engine`, one job per writer (reader) at the shape's depth.
pub(super) fn run_fio_random(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
    engine: &str,
    write: bool,
) -> Result<Sample, String> {
    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    let prefix = logs.path().join("raw");
    let runtime_ms = (plan.seconds * 1000.0).round().max(1.0) as u64;
    let mut command = fio_base(args, backing, engine);
    command
        .arg(format!("--size={}", plan.span_bytes))
        .arg(if write { "--rw=randwrite" } else { "--rw=randread" })
        .args(["--norandommap", "--randrepeat=0", "--time_based"])
        .arg(format!("--runtime={runtime_ms}ms"))
        .arg(format!("--numjobs={}", shape.writers))
        .arg(format!("--iodepth={}", shape.depth));
    if write {
        command.arg(format!("--write_iops_log={}", prefix.display()));
        command.args(["--log_avg_msec=1000", "--per_job_logs=1"]);
    }
    let output = command.output().map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let doc = captured_report(&output, "fio")?;
    let side = &doc["jobs"][0][if write { "write" } else { "read" }];
    let iops = side["iops"].as_f64().ok_or("fio JSON has no iops")?;
    let lat = |key: &str| side["lat_ns"]["percentile"][key].as_f64().unwrap_or(f64::NAN);
    let timeline = if write { read_timeline(logs.path(), "raw") } else { Vec::new() };
    // fio's first second includes its start-up: left out, as the engine's fill is.
    let min_window_ratio = if write { min_window(&timeline, 1, iops) } else { f64::NAN };
    let max = side["lat_ns"]["max"].as_f64().unwrap_or(f64::NAN);
    let latency_ns = [lat("50.000000"), lat("99.000000"), lat("99.900000"), max];
    Ok(Sample::new(iops, min_window_ratio, latency_ns, timeline))
}

/// fio writing `blocks` (ascending) to the backing file from an I/O log with `engine`, at the
/// cleaner's queue depth, with an fsync at the end; returns blocks per second.
pub(super) fn run_fio_replay(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    blocks: &[u64],
    engine: &str,
) -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let log_path = dir.path().join("blocks.iolog");
    let mut log = String::with_capacity(blocks.len() * 48);
    let name = backing.display();
    let _ = writeln!(log, "fio version 2 iolog\n{name} add\n{name} open");
    for b in blocks {
        let _ = writeln!(log, "{name} write {} {BLOCK_BYTES}", b * BLOCK_BYTES);
    }
    let _ = writeln!(log, "{name} close");
    std::fs::write(&log_path, log).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let output = fio_base(args, backing, engine)
        .arg(format!("--read_iolog={}", log_path.display()))
        .args(["--replay_no_stall=1", "--end_fsync=1"])
        .arg(format!("--iodepth={}", plan.cleaner.queue_depth))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let wall = started.elapsed().as_secs_f64();
    let doc = captured_report(&output, "fio")?;
    let job = &doc["jobs"][0];
    let done = job["write"]["total_ios"].as_u64().unwrap_or(0);
    if done != blocks.len() as u64 {
        return Err(format!("fio wrote {done} of the {} blocks of its log", blocks.len()));
    }
    // fio's job time covers the writes and the final fsync; the wall time also has fio's
    // start-up, so the job time is the fairer one when fio reports it.
    let job_s = job["job_runtime"].as_f64().map(|ms| ms / 1000.0).filter(|&s| s > 0.0);
    Ok(blocks.len() as f64 / job_s.unwrap_or(wall))
}
