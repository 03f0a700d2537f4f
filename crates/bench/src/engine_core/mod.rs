//! `pmcache bench engine-core` (or `core`): the engine against the raw medium it runs on.
//!
//! Every engine figure is measured in the same run as its baseline — the same 4 KiB access
//! pattern done directly on the same mapped medium (a copy out for reads, a copy plus persist
//! for writes) — and reported as a ratio. Each configuration runs `runs` times; within a run
//! the baseline, the floor and the engine take turns every `INTERLEAVE_BLOCK_OPS` operations
//! per thread (or, with `--separate`, each for the run's whole length). The table shows
//! medians (of throughputs and of per-run ratios); the JSON also has the per-run ratios'
//! quartiles.
//! Recovery time and DRAM per slot are measured on a cache of `recovery_slots` slots.
//! Many short runs (`--runs 25 --seconds 0.2`) rather than a few long ones: on a shared
//! machine the load of other tenants drifts over seconds, and the medians of 25 runs of 0.2 s
//! varied far less between invocations than those of 5 runs of 1 s (docs/PERFORMANCE.md).
//!
//! Beside each engine figure a *floor* is measured in the same run: the least work any design
//! obeying the engine's contract must add to the raw access on this machine.
//! - Read floor: one dependent random 8-byte load from a DRAM table as large as the engine's
//!   DRAM metadata (where the slot is found), then the raw copy. Every design that maps a block
//!   to a slot through a DRAM structure pays this miss before its copy can start. Batched, the
//!   table loads of the batch overlap, and each copy starts loading the data of the copy
//!   `READ_DATA_PREFETCH_AHEAD` further on, as the engine's batches do (so the floor can
//!   pass the baseline, which copies one request at a time).
//! - Write floor: the raw copy + persist, then a 16-byte entry stored and persisted at a random
//!   slot's place in a metadata table — the persist order the engine's contract prescribes
//!   (data durable, *then* the entry that makes it visible), with nothing else. The entry is
//!   stored as the engine stores its entries (`Medium::store_pair_flush`, non-temporal where
//!   the medium chose non-temporal stores).
//!
//! `floor` in the table is floor / raw; the engine can approach it but not pass it.
//!
//! The `-crc` rows measure what data checksums (`--data-crc`) cost: the same requests to a
//! second cache, formatted with them, alternated with the first in the same run; their ratio
//! is the engine with checksums over the engine without.

use std::fmt::Write as _;
use std::path::PathBuf;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run, json_lines};
use crate::harness::stats::{median_in_place, quartiles};

mod bed;
mod drive;
mod recovery;

use bed::{
    Mix, bed, check_no_misses, engine_worker, floor_for, floor_worker, raw_worker, run_engine,
    run_floor, run_raw, setup_text,
};
pub(crate) use drive::INTERLEAVE_BLOCK_OPS;
use drive::drive_interleaved;
use recovery::recovery_row;

const BLOCK: u64 = 4096;
/// A 4 KiB buffer aligned like a page, so that the baseline and the engine copy into
/// identically aligned memory (`rep movsb` speed depends on the destination's alignment).
#[repr(C, align(4096))]
struct PageBuf([u8; BLOCK as usize]);

fn page_buf(fill: u8) -> Box<PageBuf> {
    Box::new(PageBuf([fill; BLOCK as usize]))
}

/// Requests per call in the batched configurations (`-qd16`).
const QUEUE_DEPTH: usize = 16;

/// One operation in this many is timed for the latency percentiles.
const LATENCY_SAMPLE_EVERY: u64 = 64;

/// Options of `pmcache bench engine-core`.
#[derive(Debug, Clone, clap::Args)]
pub struct CoreArgs {
    /// Directory for the emulated PM medium and the backing file (DRAM-backed: /dev/shm).
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
    /// Cache medium size in MiB.
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: u64,
    /// Slots of the cache whose recovery is timed.
    #[arg(long, default_value_t = 1 << 20)]
    pub recovery_slots: u64,
    /// Run the baseline, the floor and the engine each for the run's whole length in turn
    /// instead of alternating them every `INTERLEAVE_BLOCK_OPS` operations per thread (about a
    /// millisecond). Alternating, the three see the same moment of the machine's load, and
    /// the per-run ratios spread several times less (docs/PERFORMANCE.md, `bench engine-core`). The
    /// 16-thread row always runs in turn.
    #[arg(long)]
    pub separate: bool,
    /// An execution barrier (`lfence` on x86-64) after every call of the baseline, the floor
    /// and the engine: the next call starts only once the last one has completed, as behind
    /// a request/response boundary (a frontend's reply and the client's next request). A call
    /// is one request, or 16 for the floor and the engine in the `-qd16` rows (one round trip
    /// for a queue of 16), where the baseline still does one. Without it, the CPU may start a
    /// request's first loads while the previous copy is still finishing; a short loop of raw
    /// copies gains from that the most (docs/PERFORMANCE.md, `bench engine-core`).
    #[arg(long)]
    pub serialize: bool,
    /// Run only the configurations whose name contains this (e.g. `read-hit`); skips recovery
    /// unless it matches `recovery`. May start with a hyphen (`--only -4k-qd16`). A trailing
    /// `$` matches the end of the name only (`--only 'write-back-4k$'`: not the `-qd16` rows).
    #[arg(long, allow_hyphen_values = true)]
    pub only: Option<String>,
}

/// One row of the report. Fields that do not apply to a row are `None` (JSON `null`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CoreResult {
    /// Configuration name.
    pub name: String,
    /// Threads issuing requests.
    pub threads: usize,
    /// Requests handed to the engine per call (1, or 16 for the `-qd16` rows).
    pub requests_per_call: usize,
    /// Engine operations per second (median over runs); for the recovery row, slots
    /// recovered per second.
    pub ops_per_sec: f64,
    /// Baseline operations per second (median over runs).
    pub baseline_ops_per_sec: Option<f64>,
    /// What the baseline is.
    pub baseline: String,
    /// Median over runs of engine / raw baseline in the same run.
    pub ratio_to_raw: Option<f64>,
    /// First and third quartiles over runs of engine / baseline: how far the runs spread.
    pub ratio_to_raw_quartiles: Option<(f64, f64)>,
    /// The 16-thread row: median over runs of the engine at 16 threads / at 2 threads.
    pub ratio_to_2_threads: Option<f64>,
    /// The goal for the row's ratio (`ratio_to_raw`, or `ratio_to_2_threads`), if the issue
    /// sets one.
    pub goal_ratio: Option<f64>,
    /// The floor (see the module docs) over the baseline in the same run, median over runs.
    pub floor_ratio_to_raw: Option<f64>,
    /// Engine over the floor in the same run, median over runs.
    pub ratio_to_floor: Option<f64>,
    /// The `-crc` rows: median over runs of the engine with data checksums over the engine
    /// without, in the same run (`baseline_ops_per_sec` is then the engine without).
    pub ratio_to_engine_without_crc: Option<f64>,
    /// Engine latency percentiles (sampled) of one call (`requests_per_call` requests),
    /// nanoseconds.
    pub latency_ns_p50: Option<u64>,
    /// 99th percentile.
    pub latency_ns_p99: Option<u64>,
    /// The recovery row: median time to recover, milliseconds (each run on a medium mapped
    /// afresh, after the CPU caches were flushed).
    pub recovery_ms: Option<f64>,
    /// The recovery row: the slowest run, milliseconds.
    pub recovery_ms_max: Option<f64>,
    /// The recovery row: DRAM bytes per slot of the recovered cache.
    pub dram_bytes_per_slot: Option<f64>,
    /// The recovery row: DRAM bytes per slot of the cache the other rows ran on.
    pub dram_bytes_per_slot_bench_cache: Option<f64>,
    /// Runs measured.
    pub runs: usize,
    /// Seconds per run (the recovery row: none; it runs to completion).
    pub seconds: Option<f64>,
    /// Machine and setup.
    pub setup: String,
}

/// Whether configuration `name` is selected by `--only`: it contains `only`, or ends with it
/// when `only` ends with `$`.
fn name_matches(name: &str, only: &str) -> bool {
    match only.strip_suffix('$') {
        Some(end) => name.ends_with(end),
        None => name.contains(only),
    }
}

struct Case {
    name: &'static str,
    mix: Mix,
    threads: usize,
    /// Requests handed to the engine per call (1: `read`/`write`; more: `read_batch` /
    /// `write_batch`, as a frontend with that many requests queued does).
    batch: usize,
    goal: Option<f64>,
    baseline: &'static str,
}

/// Runs every configuration and returns the rows.
fn measure(args: &CoreArgs, run: &Run) -> Result<Vec<CoreResult>, String> {
    let (seconds, runs) = (run.seconds, run.runs);
    let (cache_bytes, recovery_slots) = if run.quick {
        (64 << 20, args.recovery_slots.min(1 << 14))
    } else {
        (args.cache_mib << 20, args.recovery_slots)
    };
    let bed = bed(&args.dir, cache_bytes, 32, false)?;
    let floor = floor_for(&bed)?;
    let setup = format!(
        "{}; cache {} MiB, {} slots, working set {} blocks of 4 KiB{}{}",
        setup_text(&args.dir, &bed.medium),
        cache_bytes >> 20,
        bed.engine.superblock().geometry.slot_count,
        bed.blocks,
        if args.separate {
            "; baseline, floor and engine each for a whole run in turn".to_string()
        } else {
            format!(
                "; baseline, floor and engine alternated every {INTERLEAVE_BLOCK_OPS} operations"
            )
        },
        if args.serialize { "; an execution barrier after every call (--serialize)" } else { "" }
    );
    const READ: &str = "raw 4 KiB copy from the medium";
    const WRITE: &str = "raw 4 KiB copy + persist";
    const MIX: &str = "raw copy / copy + persist, 50:50";
    let case = |name, mix, threads, batch, goal, baseline| Case {
        name,
        mix,
        threads,
        batch,
        goal: Some(goal),
        baseline,
    };
    // One request per call, then QUEUE_DEPTH requests per call (batches); the baseline is the
    // raw access one request at a time in both.
    let cases = [
        case("read-hit-4k", Mix::Reads, 1, 1, 0.90, READ),
        case("read-hit-4k", Mix::Reads, 2, 1, 0.90, READ),
        case("write-back-4k", Mix::Writes, 1, 1, 0.70, WRITE),
        case("write-back-4k", Mix::Writes, 2, 1, 0.70, WRITE),
        case("mix-50-50-4k", Mix::Half, 2, 1, 0.80, MIX),
        case("read-hit-4k-qd16", Mix::Reads, 1, QUEUE_DEPTH, 0.90, READ),
        case("read-hit-4k-qd16", Mix::Reads, 2, QUEUE_DEPTH, 0.90, READ),
        case("write-back-4k-qd16", Mix::Writes, 1, QUEUE_DEPTH, 0.70, WRITE),
        case("write-back-4k-qd16", Mix::Writes, 2, QUEUE_DEPTH, 0.70, WRITE),
        case("mix-50-50-4k-qd16", Mix::Half, 2, QUEUE_DEPTH, 0.80, MIX),
    ];
    let mut rows = Vec::new();
    let selected = |name: &str| args.only.as_deref().is_none_or(|only| name_matches(name, only));
    for case in cases.iter().filter(|c| selected(c.name)) {
        let mut engine_ops = Vec::new();
        let mut raw_ops = Vec::new();
        let mut ratios = Vec::new();
        let mut floor_ratios = Vec::new();
        let mut to_floor = Vec::new();
        let mut histogram = Histogram::<u64>::new(3).expect("histogram");
        let before = bed.engine.stats();
        for run in 0..runs {
            let ([raw, floor_ops, ops], h) = if !args.separate {
                drive_interleaved(case.threads, seconds, case.batch, run, args.serialize, |_| {
                    (
                        raw_worker(&bed, case.mix),
                        floor_worker(&bed, &floor, case),
                        engine_worker(&bed, case.mix, case.batch),
                    )
                })
            } else {
                let serialize = args.serialize;
                let raw = run_raw(&bed, case.mix, case.threads, seconds, serialize);
                let floor_ops = run_floor(&bed, &floor, case, seconds, serialize);
                let (ops, h) =
                    run_engine(&bed, case.mix, case.threads, case.batch, seconds, serialize);
                ([raw, floor_ops, ops], h)
            };
            histogram.add(h).expect("same shape");
            ratios.push(ops / raw);
            floor_ratios.push(floor_ops / raw);
            to_floor.push(ops / floor_ops);
            engine_ops.push(ops);
            raw_ops.push(raw);
        }
        check_no_misses(case.name, &before, &bed.engine.stats())?;
        rows.push(CoreResult {
            name: case.name.to_string(),
            threads: case.threads,
            requests_per_call: case.batch,
            ops_per_sec: median_in_place(&mut engine_ops),
            baseline_ops_per_sec: Some(median_in_place(&mut raw_ops)),
            baseline: case.baseline.to_string(),
            ratio_to_raw: Some(median_in_place(&mut ratios)),
            ratio_to_raw_quartiles: Some(quartiles(&mut ratios)),
            goal_ratio: case.goal,
            floor_ratio_to_raw: Some(median_in_place(&mut floor_ratios)),
            ratio_to_floor: Some(median_in_place(&mut to_floor)),
            latency_ns_p50: Some(histogram.value_at_quantile(0.5)),
            latency_ns_p99: Some(histogram.value_at_quantile(0.99)),
            runs,
            seconds: Some(seconds),
            setup: setup.clone(),
            ..CoreResult::default()
        });
    }
    let crc_cases = [
        case("read-hit-4k-crc", Mix::Reads, 1, 1, 0.0, READ),
        case("write-back-4k-crc", Mix::Writes, 1, 1, 0.0, WRITE),
        case("read-hit-4k-qd16-crc", Mix::Reads, 1, QUEUE_DEPTH, 0.0, READ),
        case("write-back-4k-qd16-crc", Mix::Writes, 1, QUEUE_DEPTH, 0.0, WRITE),
    ];
    if crc_cases.iter().any(|c| selected(c.name)) {
        let checked = self::bed(&args.dir, cache_bytes, 32, true)?;
        for case in crc_cases.iter().filter(|c| selected(c.name)) {
            rows.push(crc_row(&bed, &checked, case, seconds, runs, args.serialize, &setup)?);
        }
    }
    // 16 threads on this machine's cores against 2 threads: no collapse under oversubscription.
    if selected("mix-50-50-4k-16-threads") {
        let mut sixteen = Vec::new();
        let mut two = Vec::new();
        let mut ratios = Vec::new();
        let mut histogram = Histogram::<u64>::new(3).expect("histogram");
        let before = bed.engine.stats();
        let at = |threads| run_engine(&bed, Mix::Half, threads, 1, seconds, args.serialize);
        for run in 0..runs {
            // Alternately first, so that neither always follows the other.
            let ((base, _), (ops, h)) = if run % 2 == 0 {
                let base = at(2);
                (base, at(16))
            } else {
                let sixteen_threads = at(16);
                (at(2), sixteen_threads)
            };
            histogram.add(h).expect("same shape");
            two.push(base);
            sixteen.push(ops);
            ratios.push(ops / base);
        }
        check_no_misses("mix-50-50-4k at 16 threads", &before, &bed.engine.stats())?;
        rows.push(CoreResult {
            name: "mix-50-50-4k".to_string(),
            threads: 16,
            requests_per_call: 1,
            ops_per_sec: median_in_place(&mut sixteen),
            baseline_ops_per_sec: Some(median_in_place(&mut two)),
            baseline: "the engine at 2 threads".to_string(),
            ratio_to_2_threads: Some(median_in_place(&mut ratios)),
            goal_ratio: Some(0.90),
            latency_ns_p50: Some(histogram.value_at_quantile(0.5)),
            latency_ns_p99: Some(histogram.value_at_quantile(0.99)),
            runs,
            seconds: Some(seconds),
            setup: setup.clone(),
            ..CoreResult::default()
        });
    }
    let stats = bed.engine.stats();
    if std::env::var_os("PMCACHE_BENCH_STATS").is_some() {
        eprintln!("engine stats: {stats:?}");
    }
    let dram = stats.dram_bytes_per_slot;
    drop(floor);
    drop(bed);
    if selected("recovery") {
        rows.push(recovery_row(&args.dir, recovery_slots, runs, dram)?);
    }
    Ok(rows)
}

/// A `-crc` row: the raw access, the engine on `plain` (no data checksums) and the engine on
/// `checked` (data checksums) alternated in each run.
fn crc_row(
    plain: &bed::Bed,
    checked: &bed::Bed,
    case: &Case,
    seconds: f64,
    runs: usize,
    serialize: bool,
    setup: &str,
) -> Result<CoreResult, String> {
    let (mut with, mut without, mut ratios, mut to_raw) = (vec![], vec![], vec![], vec![]);
    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
    let before = checked.engine.stats();
    for run in 0..runs {
        let ([raw, plain_ops, checked_ops], h) =
            drive_interleaved(case.threads, seconds, case.batch, run, serialize, |_| {
                (
                    raw_worker(plain, case.mix),
                    engine_worker(plain, case.mix, case.batch),
                    engine_worker(checked, case.mix, case.batch),
                )
            });
        histogram.add(h).expect("same shape");
        ratios.push(checked_ops / plain_ops);
        to_raw.push(checked_ops / raw);
        with.push(checked_ops);
        without.push(plain_ops);
    }
    let after = checked.engine.stats();
    check_no_misses(case.name, &before, &after)?;
    if after.data_crc_mismatches != before.data_crc_mismatches {
        return Err(format!("{}: the checksummed cache reported mismatches", case.name));
    }
    Ok(CoreResult {
        name: case.name.to_string(),
        threads: case.threads,
        requests_per_call: case.batch,
        ops_per_sec: median_in_place(&mut with),
        baseline_ops_per_sec: Some(median_in_place(&mut without)),
        baseline: "the engine without data checksums".to_string(),
        ratio_to_raw: Some(median_in_place(&mut to_raw)),
        ratio_to_engine_without_crc: Some(median_in_place(&mut ratios)),
        ratio_to_raw_quartiles: Some(quartiles(&mut ratios)),
        latency_ns_p50: Some(histogram.value_at_quantile(0.5)),
        latency_ns_p99: Some(histogram.value_at_quantile(0.99)),
        runs,
        seconds: Some(seconds),
        setup: setup.to_string(),
        ..CoreResult::default()
    })
}

impl Experiment for CoreArgs {
    const NAME: &'static str = "engine-core";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(25), seconds: Some(0.2), quick_runs: 3, quick_seconds: 0.2 };
    type Report = Vec<CoreResult>;

    fn run(&self, run: &Run) -> Result<Vec<CoreResult>, String> {
        let rows = measure(self, run)?;
        if rows.is_empty() {
            return Err(format!("no configuration matches --only {:?}", self.only));
        }
        Ok(rows)
    }

    /// One JSON object per configuration (JSON lines).
    fn json(&self, rows: &Vec<CoreResult>) -> Result<String, String> {
        json_lines(rows)
    }

    fn table(&self, rows: &Vec<CoreResult>, _run: &Run) -> String {
        table(rows)
    }
}

/// The table of `rows`.
fn table(rows: &[CoreResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "pmcache bench core — {}", rows[0].setup);
    let timed = rows.iter().find_map(|row| row.seconds);
    let _ = writeln!(
        out,
        "medians of {} runs{}; ratio = engine / baseline in the same run (the 16-thread row: \
         engine at 16 threads / at 2); floor = the least any design with the engine's contract \
         adds, at the baseline's random places (see `pmcache bench core --help`), as floor / \
         baseline; engine/floor = engine / \
         floor in the same run; p50/p99 = latency of one call (16 requests in the -qd16 rows)\n",
        rows[0].runs,
        timed.map(|s| format!(" of {s:.1} s")).unwrap_or_default()
    );
    let _ = writeln!(
        out,
        "{:<20} {:>7} {:>14} {:>14} {:>8} {:>6} {:>7} {:>12} {:>9} {:>9}  baseline",
        "config",
        "threads",
        "engine op/s",
        "baseline op/s",
        "ratio",
        "goal",
        "floor",
        "engine/floor",
        "p50 ns",
        "p99 ns"
    );
    let last_is_recovery = rows.last().is_some_and(|r| r.name.starts_with("recovery"));
    let table = if last_is_recovery { &rows[..rows.len() - 1] } else { rows };
    let (crc_rows, table): (Vec<&CoreResult>, Vec<&CoreResult>) =
        table.iter().partition(|row| row.ratio_to_engine_without_crc.is_some());
    for row in table {
        let ratio = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
        let number = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<20} {:>7} {:>14.0} {:>14} {:>8} {:>6} {:>7} {:>12} {:>9} {:>9}  {}",
            row.name,
            row.threads,
            row.ops_per_sec,
            row.baseline_ops_per_sec.map(|b| format!("{b:.0}")).unwrap_or_default(),
            ratio(row.ratio_to_raw.or(row.ratio_to_2_threads)),
            row.goal_ratio.map(|g| format!("{g:.2}x")).unwrap_or_default(),
            ratio(row.floor_ratio_to_raw),
            ratio(row.ratio_to_floor),
            number(row.latency_ns_p50),
            number(row.latency_ns_p99),
            row.baseline
        );
    }
    if !crc_rows.is_empty() {
        let _ = writeln!(
            out,
            "\ndata checksums (--data-crc): ratio = engine with / engine without, in the same run\n"
        );
        let _ = writeln!(
            out,
            "{:<24} {:>7} {:>14} {:>14} {:>8} {:>12} {:>9} {:>9}",
            "config",
            "threads",
            "with op/s",
            "without op/s",
            "ratio",
            "with/raw",
            "p50 ns",
            "p99 ns"
        );
        for row in crc_rows {
            let ratio = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
            let _ = writeln!(
                out,
                "{:<24} {:>7} {:>14.0} {:>14.0} {:>8} {:>12} {:>9} {:>9}",
                row.name,
                row.threads,
                row.ops_per_sec,
                row.baseline_ops_per_sec.unwrap_or_default(),
                ratio(row.ratio_to_engine_without_crc),
                ratio(row.ratio_to_raw),
                row.latency_ns_p50.unwrap_or_default(),
                row.latency_ns_p99.unwrap_or_default()
            );
        }
    }
    if last_is_recovery {
        let recovery = &rows[rows.len() - 1];
        let _ = writeln!(out, "\n{}: {}", recovery.name, recovery.baseline);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::experiment::parse;

    #[test]
    fn a_filter_ending_in_a_dollar_matches_the_end_of_the_name_only() {
        assert!(name_matches("write-back-4k", "write-back-4k$"));
        assert!(!name_matches("write-back-4k-qd16", "write-back-4k$"));
        assert!(name_matches("write-back-4k-qd16", "write-back-4k"));
        assert!(name_matches("mix-50-50-4k-qd16", "-qd16$"));
        assert!(!name_matches("recovery", "4k$"));
    }

    #[test]
    fn serialize_is_off_unless_asked() {
        let parsed = parse::<CoreArgs>(&["bench", "--serialize"]).expect("parses").0;
        assert!(parsed.serialize);
        assert!(!parse::<CoreArgs>(&["bench"]).expect("parses").0.serialize);
    }

    #[test]
    fn a_filter_may_start_with_a_hyphen() {
        let (parsed, run) = parse::<CoreArgs>(&["bench", "--only", "-4k-qd16", "--runs", "3"])
            .expect("a filter starting with a hyphen is a value, not an option");
        assert_eq!(parsed.only.as_deref(), Some("-4k-qd16"));
        assert_eq!(run.runs, 3);
    }
}
