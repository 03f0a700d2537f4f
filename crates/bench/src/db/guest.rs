//! The guest's bed (`scripts/guest/db-bench.sh`): pgbench and speedtest1 on ext4 over
//! pmcache (ublk), bcache, dm-cache, dm-writecache, rublk's ublk loop target and the bare NVMe
//! namespace in one QEMU boot. The script keeps the guest's result lines in its `--out` file; this module runs it
//! (or reads a kept file) and parses the lines:
//!
//! - `DBBENCH-BED {json}`: the guest, the sizes and the settings;
//! - `DBBENCH {json}`: one pgbench run on one layer (`bench`, `layer`, `run`, `tps`,
//!   `transactions`, `latency_ms_p50`, `latency_ms_p99`, and where the guest measured them
//!   `guest_busy_s`, `guest_idle_s`, `server_cpu_s`);
//! - `DBBENCH-SPEEDTEST1 LAYER RUN LINE`: one line of speedtest1's output;
//! - `DBBENCH-PMSTATS-BEFORE LAYER RUN {json}`, `DBBENCH-PMSTATS LAYER RUN {json}`:
//!   pmcache's `stats --json` before and after a pgbench run;
//! - `DBBENCH-NOTE TEXT`: what the script observed (kernel layers' dirty data, …).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::speedtest1;
use super::summary::{PgbenchPoint, SpeedtestPoint};
use crate::harness::servers::ServerFigures;

/// The layers in the order the guest's tables show them: the caches, the ublk path with no
/// cache (rublk's loop target: what pmcache's path costs by itself), the bare store.
pub const LAYERS: [&str; 6] =
    ["pmcache", "bcache", "dm-cache", "dm-writecache", "ublk-loop", "nvme"];
/// The kernel's cache layers, among which the best is pmcache's bar.
pub const KERNEL_LAYERS: [&str; 3] = ["bcache", "dm-cache", "dm-writecache"];
/// The bare NVMe namespace: the baseline.
pub const BASELINE: &str = "nvme";

/// pmcache's counters after one run in the guest.
#[derive(Debug, Clone, Serialize)]
pub struct PmcacheSample {
    /// The layer.
    pub layer: String,
    /// The run.
    pub run: usize,
    /// The counters: over the pgbench run where the guest printed them before it too, else
    /// since the server started.
    pub figures: ServerFigures,
    /// Whether `figures` are the run's alone.
    pub over_the_run: bool,
}

/// What the guest printed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GuestRun {
    /// The guest and its settings.
    pub bed: serde_json::Value,
    /// pgbench runs.
    pub pgbench: Vec<PgbenchPoint>,
    /// speedtest1 runs.
    pub speedtest1: Vec<SpeedtestPoint>,
    /// pmcache's counters run by run.
    pub pmcache: Vec<PmcacheSample>,
    /// The script's notes.
    pub notes: Vec<String>,
}

#[derive(Deserialize)]
struct Line {
    bench: String,
    #[serde(flatten)]
    point: PgbenchPoint,
}

/// `LAYER RUN REST` of a tagged line.
fn layer_run(rest: &str, i: usize) -> Result<(String, usize, &str), String> {
    let mut parts = rest.splitn(3, ' ');
    let (Some(layer), Some(run)) = (parts.next(), parts.next()) else {
        return Err(format!("line {}: no layer and run: {rest:?}", i + 1));
    };
    let run = run.parse().map_err(|_| format!("line {}: run {run:?} is not a number", i + 1))?;
    Ok((layer.to_string(), run, parts.next().unwrap_or("")))
}

/// Parses the guest's result lines (other lines, such as the kernel's, are skipped).
pub fn parse(text: &str) -> Result<GuestRun, String> {
    let mut run = GuestRun::default();
    let mut outputs: BTreeMap<(String, usize), String> = BTreeMap::new();
    let mut before: BTreeMap<(String, usize), ServerFigures> = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end_matches('\r');
        if let Some(json) = line.strip_prefix("DBBENCH-BED ") {
            run.bed = serde_json::from_str(json).map_err(|e| format!("line {}: {e}", i + 1))?;
        } else if let Some(json) = line.strip_prefix("DBBENCH ") {
            let parsed: Line =
                serde_json::from_str(json).map_err(|e| format!("line {}: {e}: {json}", i + 1))?;
            if parsed.bench != "pgbench" {
                return Err(format!("line {}: unknown bench {:?}", i + 1, parsed.bench));
            }
            run.pgbench.push(parsed.point);
        } else if let Some(rest) = line.strip_prefix("DBBENCH-SPEEDTEST1 ") {
            let (layer, n, text) = layer_run(rest, i)?;
            let out = outputs.entry((layer, n)).or_default();
            out.push_str(text);
            out.push('\n');
        } else if let Some(rest) = line.strip_prefix("DBBENCH-PMSTATS-BEFORE ") {
            let (layer, n, json) = layer_run(rest, i)?;
            let stats: serde_json::Value =
                serde_json::from_str(json).map_err(|e| format!("line {}: {e}", i + 1))?;
            before.insert((layer, n), ServerFigures::from_stats(&stats));
        } else if let Some(rest) = line.strip_prefix("DBBENCH-PMSTATS ") {
            let (layer, n, json) = layer_run(rest, i)?;
            let stats: serde_json::Value =
                serde_json::from_str(json).map_err(|e| format!("line {}: {e}", i + 1))?;
            let after = ServerFigures::from_stats(&stats);
            let (figures, over_the_run) = match before.get(&(layer.clone(), n)) {
                Some(b) => (after.since(b), true),
                None => (after, false),
            };
            run.pmcache.push(PmcacheSample { layer, run: n, figures, over_the_run });
        } else if let Some(note) = line.strip_prefix("DBBENCH-NOTE ") {
            run.notes.push(note.to_string());
        }
    }
    for ((layer, n), output) in outputs {
        let parsed = speedtest1::parse(&output)
            .map_err(|e| format!("speedtest1 on {layer}, run {n}: {e}"))?;
        run.speedtest1.push(SpeedtestPoint {
            layer,
            run: n,
            total_s: parsed.total_s,
            tests: parsed.tests,
        });
    }
    if run.pgbench.is_empty() {
        return Err("the guest printed no pgbench run (no `DBBENCH {json}` line)".into());
    }
    Ok(run)
}

/// Runs `scripts/guest/db-bench.sh` (from the repository's root) with `args`, writing its
/// result lines to `out`.
pub fn run_script(args: &[String], out: &Path) -> Result<(), String> {
    let script = Path::new("scripts/guest/db-bench.sh");
    if !script.exists() {
        return Err(format!(
            "{}: not found; run `bench db --guest` from the repository's root, or give \
             --guest-log with the script's output",
            script.display()
        ));
    }
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .arg("--out")
        .arg(out)
        .status()
        .map_err(|e| format!("{}: {e}", script.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status})", script.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "[    1.0] some kernel line\n\
        DBBENCH-BED {\"kernel\":\"6.12.0\",\"cache_mib\":64,\"scale\":8}\n\
        DBBENCH {\"bench\":\"pgbench\",\"layer\":\"pmcache\",\"run\":1,\"tps\":120.5,\
        \"transactions\":2410,\"latency_ms_p50\":30.1,\"latency_ms_p99\":90.2,\
        \"guest_busy_s\":39.5,\"guest_idle_s\":0.5,\"server_cpu_s\":12.25}\r\n\
        DBBENCH {\"bench\":\"pgbench\",\"layer\":\"nvme\",\"run\":1,\"tps\":60.0,\
        \"transactions\":1200,\"latency_ms_p50\":60.0,\"latency_ms_p99\":200.0}\n\
        DBBENCH-SPEEDTEST1 pmcache 1 -- Speedtest1 for SQLite 3.40.1\n\
        DBBENCH-SPEEDTEST1 pmcache 1  100 - 1000 INSERTs into table with no index....   0.5s\n\
        DBBENCH-SPEEDTEST1 pmcache 1        TOTAL.............   2.5s\n\
        DBBENCH-PMSTATS-BEFORE pmcache 1 {\"slot_count\":100,\"read_hits\":3}\n\
        DBBENCH-PMSTATS pmcache 1 {\"slot_count\":100,\"dirty_slots\":25,\"read_hits\":10}\n\
        DBBENCH-PMSTATS pmcache 2 {\"slot_count\":100,\"dirty_slots\":5,\"read_hits\":12}\n\
        DBBENCH-NOTE bcache: 3.1 MiB dirty after run 1\n";

    #[test]
    fn the_guests_lines_become_points_samples_and_notes() {
        let run = parse(LOG).expect("parsed");
        assert_eq!(run.bed["cache_mib"], 64);
        assert_eq!(run.pgbench.len(), 2);
        assert_eq!(run.pgbench[0].layer, "pmcache");
        assert_eq!(run.pgbench[0].latency_ms_p99, 90.2);
        assert_eq!(run.pgbench[0].server_cpu_s, Some(12.25));
        assert_eq!(run.pgbench[0].guest_busy_s, Some(39.5));
        assert_eq!(run.pgbench[1].server_cpu_s, None);
        assert_eq!(run.speedtest1.len(), 1);
        assert_eq!(run.speedtest1[0].total_s, 2.5);
        assert_eq!(run.speedtest1[0].tests[0].id, 100);
        assert_eq!(run.pmcache[0].figures.dirty_slots, 25);
        assert_eq!(run.pmcache[0].figures.read_hits, 7);
        assert!(run.pmcache[0].over_the_run);
        assert_eq!((run.pmcache[1].figures.read_hits, run.pmcache[1].over_the_run), (12, false));
        assert_eq!(run.notes, ["bcache: 3.1 MiB dirty after run 1"]);
    }

    #[test]
    fn broken_lines_are_errors_naming_them() {
        assert!(parse("DBBENCH {\"bench\":\"pgbench\"}\n").unwrap_err().contains("line 1"));
        assert!(parse("nothing here\n").unwrap_err().contains("no pgbench run"));
        let bad_run = format!("{LOG}DBBENCH-SPEEDTEST1 nvme x TOTAL... 1s\n");
        assert!(parse(&bad_run).unwrap_err().contains("not a number"));
        let cut = format!("{LOG}DBBENCH-SPEEDTEST1 nvme 1  100 - x....   0.5s\n");
        assert!(parse(&cut).unwrap_err().contains("speedtest1 on nvme, run 1"));
    }
}
