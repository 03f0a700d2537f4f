//! fio's side of `bench writeback`: random writes and reads on the backing file, the drain's blocks
//! replayed.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use pmcache_backing::EngineKind;

use super::engine::min_window;
use super::{BLOCK_BYTES, Plan, Sample, Shape, WritebackArgs};

fn fio_base(args: &WritebackArgs, plan: &Plan, file: &Path) -> Command {
    let mut cmd = Command::new(&args.fio);
    cmd.arg("--name=pmcache")
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--ioengine={}", fio_engine(plan.engine)))
        .args(["--direct=1", "--bs=4096", "--thread", "--group_reporting"])
        .args(["--output-format=json", "--lat_percentiles=1"])
        .arg("--percentile_list=50:99:99.9");
    cmd
}

/// fio's name for an engine (the variants' options do not matter for writes on a file).
fn fio_engine(engine: EngineKind) -> &'static str {
    match engine {
        EngineKind::Psync => "psync",
        EngineKind::Pvsync2 | EngineKind::Pvsync2Hipri => "pvsync2",
        EngineKind::Libaio => "libaio",
        EngineKind::IoUring | EngineKind::IoUringIopoll | EngineKind::IoUringSqpoll => "io_uring",
    }
}

fn fio_json(output: &std::process::Output) -> Result<serde_json::Value, String> {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json_start = stdout.find("\n{").map_or(0, |i| i + 1);
    let doc: serde_json::Value = serde_json::from_str(&stdout[json_start..]).map_err(|e| {
        let stderr = String::from_utf8_lossy(&output.stderr);
        format!("fio output is not JSON ({e}): {}", stderr.lines().next().unwrap_or(""))
    })?;
    let error = doc["jobs"][0]["error"].as_i64().unwrap_or(0);
    if error != 0 {
        let msg = std::io::Error::from_raw_os_error(error as i32);
        return Err(format!("fio: error {error} ({msg})"));
    }
    Ok(doc)
}

/// The baseline: fio's random writes on the backing file, one job per writer.
pub(super) fn run_fio_random(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
) -> Result<Sample, String> {
    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    let prefix = logs.path().join("raw");
    let runtime_ms = (plan.seconds * 1000.0).round().max(1.0) as u64;
    let output = fio_base(args, plan, backing)
        .arg(format!("--size={}", plan.span_bytes))
        .args(["--rw=randwrite", "--norandommap", "--randrepeat=0", "--time_based"])
        .arg(format!("--runtime={runtime_ms}ms"))
        .arg(format!("--numjobs={}", shape.writers))
        .arg(format!("--iodepth={}", shape.depth))
        .arg(format!("--write_iops_log={}", prefix.display()))
        .args(["--log_avg_msec=1000", "--per_job_logs=1"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let doc = fio_json(&output)?;
    let side = &doc["jobs"][0]["write"];
    let iops = side["iops"].as_f64().ok_or("fio JSON has no iops")?;
    let lat = |key: &str| side["lat_ns"]["percentile"][key].as_f64().unwrap_or(f64::NAN);
    let timeline = iops_log(logs.path(), "raw_iops")?;
    Ok(Sample {
        iops,
        // fio's first second includes its start-up: left out, as the engine's fill is.
        min_window_ratio: min_window(&timeline, 1, iops),
        latency_ns_p50: lat("50.000000"),
        latency_ns_p99: lat("99.000000"),
        latency_ns_p999: lat("99.900000"),
        latency_ns_max: side["lat_ns"]["max"].as_f64().unwrap_or(f64::NAN),
        full_after_s: None,
        iops_timeline: timeline,
        dirty_timeline: Vec::new(),
        dirty_fraction_end: None,
        cleaner: None,
    })
}

/// Sums fio's per-job IOPS logs (`<stem>.N.log`, one line per second: msec, value, …) into
/// one per-second timeline.
fn iops_log(dir: &Path, stem: &str) -> Result<Vec<f64>, String> {
    let mut seconds: Vec<f64> = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| e.to_string())?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(stem) {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).map_err(|e| e.to_string())?;
        for line in text.lines() {
            let mut fields = line.split(',').map(str::trim);
            let (Some(ms), Some(value)) = (fields.next(), fields.next()) else { continue };
            let (Ok(ms), Ok(value)) = (ms.parse::<u64>(), value.parse::<f64>()) else {
                continue;
            };
            // An entry at ~1000·k ms averages second k (counting from 1).
            let second = ((ms + 500) / 1000).max(1) as usize - 1;
            if seconds.len() <= second {
                seconds.resize(second + 1, 0.0);
            }
            seconds[second] += value;
        }
    }
    Ok(seconds)
}

/// fio's random reads of the backing file, one job per reader, at the shape's depth.
pub(super) fn run_fio_random_reads(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
) -> Result<Sample, String> {
    let runtime_ms = (plan.seconds * 1000.0).round().max(1.0) as u64;
    let output = fio_base(args, plan, backing)
        .arg(format!("--size={}", plan.span_bytes))
        .args(["--rw=randread", "--norandommap", "--randrepeat=0", "--time_based"])
        .arg(format!("--runtime={runtime_ms}ms"))
        .arg(format!("--numjobs={}", shape.writers))
        .arg(format!("--iodepth={}", shape.depth))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let doc = fio_json(&output)?;
    let side = &doc["jobs"][0]["read"];
    let iops = side["iops"].as_f64().ok_or("fio JSON has no iops")?;
    let lat = |key: &str| side["lat_ns"]["percentile"][key].as_f64().unwrap_or(f64::NAN);
    Ok(Sample {
        iops,
        min_window_ratio: f64::NAN,
        latency_ns_p50: lat("50.000000"),
        latency_ns_p99: lat("99.000000"),
        latency_ns_p999: lat("99.900000"),
        latency_ns_max: side["lat_ns"]["max"].as_f64().unwrap_or(f64::NAN),
        full_after_s: None,
        iops_timeline: Vec::new(),
        dirty_timeline: Vec::new(),
        dirty_fraction_end: None,
        cleaner: None,
    })
}

/// fio writing `blocks` (ascending) to the backing file from an I/O log, at the cleaner's
/// queue depth, with an fsync at the end; returns blocks per second.
pub(super) fn run_fio_replay(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    blocks: &[u64],
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
    let output = fio_base(args, plan, backing)
        .arg(format!("--read_iolog={}", log_path.display()))
        .args(["--replay_no_stall=1", "--end_fsync=1"])
        .arg(format!("--iodepth={}", plan.cleaner.queue_depth))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let wall = started.elapsed().as_secs_f64();
    let doc = fio_json(&output)?;
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
