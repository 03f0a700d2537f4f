//! `pmcache bench writeback`: sustained 4 KiB random writes into a write-back cache smaller
//! than the span, with a backing file on a real disk — the regime where a cache's write-back
//! decides its speed.
//!
//! For each shape (writer threads × requests per call), every run measures, one after the
//! other on the same backing file:
//! - `raw`: fio writing 4 KiB at random places of the backing file directly, `O_DIRECT`,
//!   with the same total queue depth (one fio job per writer, each with
//!   the shape's depth) — the baseline;
//! - `cleaner`: the engine in process (a fresh cache on the medium directory), one lane per
//!   writer thread, the background cleaner running with its defaults (or `--cleaner`);
//! - `inline`: the same without a cleaner: a writer that finds no free or clean slot writes
//!   the oldest dirty blocks back itself.
//!
//! Each prints the mean IOPS once the cache is full (every slot used once), the slowest
//! one-second window against that mean, latency percentiles of the writes made after the
//! cache filled, the dirty fraction at the end, and the cleaner's figures; a per-second
//! timeline of IOPS and dirty fraction goes to the JSON and the plot.
//!
//! `misses` measures read misses: 4 KiB random reads over the span (8× the cache by default:
//! nearly all miss) in batches of the shape's depth (`Lane::read_batch`, whose misses go to
//! the backing store together), beside fio's random reads of the backing file with the same
//! jobs and queue depth.
//!
//! `drain` measures the cleaner alone: a cache filled with dirty blocks at distinct random
//! places is written back by `Cleaner::drain` (LBA order, merged runs, its queue depth),
//! beside fio replaying writes of the very same blocks in the same (ascending) order at the
//! same queue depth, and one `fsync` at the end.
//!
//! Every fio baseline is the disk's best: psync, libaio and io_uring each run it in the same
//! run (the first one turning from run to run), and the fastest is the baseline; the lines
//! name the winner and the others' share of it. A synchronous engine runs each job at one
//! request in flight, whatever the depth.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pmcache_backing::EngineKind;
use pmcache_engine::CleanerConfig;
use serde::Serialize;

mod engine;
mod fio;
mod report;

use engine::{run_drain, run_engine, run_misses};
use fio::run_fio_random;
use report::{plot, sample_line, summary};

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::fio::{EngineRate, RAW_ENGINES, best_of_engines, engines_text};
use crate::harness::scratch::write_random;

const BLOCK_BYTES: u64 = 4096;
/// How often the monitor looks at the engine (whether the cache is full yet).
const TICK: Duration = Duration::from_millis(50);

/// A shape of the foreground: `writers` threads, each submitting `depth` writes per call
/// (one `Lane::write`, or one `Lane::write_batch` of `depth` requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Writer threads (lanes; fio jobs for the baseline).
    pub writers: usize,
    /// Writes in flight per writer (requests per call; fio's iodepth for the baseline).
    pub depth: usize,
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (w, d) = s.split_once('x').ok_or_else(|| format!("shape {s:?}: expected WxD"))?;
        let parse = |v: &str| {
            v.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0 && n <= 256)
                .ok_or_else(|| format!("shape {s:?}: {v:?} is not a number from 1 to 256"))
        };
        Ok(Shape { writers: parse(w)?, depth: parse(d)? })
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.writers, self.depth)
    }
}

/// Options of `pmcache bench writeback`.
#[derive(clap::Args, Debug, Clone)]
pub struct WritebackArgs {
    /// Shapes, comma-separated: WRITERSxDEPTH (writer threads × writes in flight each). The
    /// default has Open CAS's measured shape (2 writers × 1) and a total queue depth of 16.
    #[arg(long = "shape", value_delimiter = ',', default_value = "2x1,16x1")]
    pub shapes: Vec<Shape>,
    /// Configurations, comma-separated: raw (fio on the backing file), cleaner, inline
    /// (no cleaner), misses (random reads, nearly all misses, against fio's random reads),
    /// drain (the cleaner alone against fio writing the same blocks).
    #[arg(
        long = "config",
        value_delimiter = ',',
        default_value = "raw,cleaner,inline,misses,drain"
    )]
    pub configs: Vec<String>,
    /// Shape of the read-miss configuration: READERSxDEPTH (reads per batch).
    #[arg(long, default_value = "1x16")]
    pub miss_shape: Shape,
    /// Cache size in MiB.
    #[arg(long, default_value_t = 256)]
    pub cache_mib: u64,
    /// Span of the random writes (and size of the backing file) in MiB.
    #[arg(long, default_value_t = 2048)]
    pub span_mib: u64,
    /// A setting of the cleaner, `KEY=VALUE` (repeatable), as `pmcache serve --cleaner`.
    #[arg(long = "cleaner", value_name = "KEY=VALUE")]
    pub cleaner: Vec<String>,
    /// The backing store's I/O engine, as `--engine` names it (fio's baselines take the best
    /// of its engines).
    #[arg(long, default_value = "io_uring")]
    pub engine: String,
    /// Directory of the backing file: on the disk to measure (not memory).
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Directory of the cache medium (emulated PM).
    #[arg(long, default_value = "/dev/shm")]
    pub medium_dir: PathBuf,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
    /// Where to write the SVG plot (IOPS and dirty fraction over time, per shape).
    #[arg(long, default_value = "pmcache-bench-writeback.svg")]
    pub plot: PathBuf,
}

/// One configuration's run.
#[derive(Clone, Debug, Serialize)]
struct Sample {
    /// Mean IOPS from the moment the cache was full (for raw: the whole run).
    iops: f64,
    /// The slowest whole second after the cache was full, over `iops`.
    min_window_ratio: f64,
    latency_ns_p50: f64,
    latency_ns_p99: f64,
    latency_ns_p999: f64,
    latency_ns_max: f64,
    /// Seconds from the start until every slot had been used once.
    full_after_s: Option<f64>,
    /// Writes per second, second by second.
    iops_timeline: Vec<f64>,
    /// Dirty share of the cache at the end of each second.
    dirty_timeline: Vec<f64>,
    dirty_fraction_end: Option<f64>,
    cleaner: Option<CleanerFigures>,
    /// A raw baseline only: every fio engine's IOPS; the sample is the fastest's.
    raw_engines: Vec<EngineRate>,
}

impl Sample {
    /// A run of `iops` with its slowest second over them, its latency percentiles (p50, p99,
    /// p99.9 and the max, ns) and its per-second timeline; no figure of the cache.
    fn new(
        iops: f64,
        min_window_ratio: f64,
        latency_ns: [f64; 4],
        iops_timeline: Vec<f64>,
    ) -> Self {
        let [latency_ns_p50, latency_ns_p99, latency_ns_p999, latency_ns_max] = latency_ns;
        Sample {
            iops,
            min_window_ratio,
            latency_ns_p50,
            latency_ns_p99,
            latency_ns_p999,
            latency_ns_max,
            full_after_s: None,
            iops_timeline,
            dirty_timeline: Vec::new(),
            dirty_fraction_end: None,
            cleaner: None,
            raw_engines: Vec::new(),
        }
    }
}

/// The engine's figures at the end of a run.
#[derive(Clone, Debug, Serialize)]
struct CleanerFigures {
    blocks_cleaned: u64,
    writes_issued: u64,
    batches: u64,
    inline_writebacks: u64,
    stalls: u64,
    stall_ns_p99: u64,
    stall_ns_max: u64,
    boosts: u64,
    boosted_s: f64,
}

#[derive(Clone, Debug, Serialize)]
struct ShapeRow {
    shape: Shape,
    config: String,
    runs: Vec<Sample>,
    /// Per-run ratio of IOPS to raw's in the same run.
    ratios: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
struct DrainRun {
    blocks: u64,
    /// Blocks per second the cleaner wrote back (sync included).
    cleaner_blocks_per_s: f64,
    /// Blocks per second fio wrote the same blocks (fsync at the end included), with the
    /// fastest of its engines.
    fio_blocks_per_s: Option<f64>,
    /// Every engine's blocks per second (as `iops`).
    fio_engines: Vec<EngineRate>,
    writes_issued: u64,
    ratio: Option<f64>,
}

/// What `bench writeback` found.
#[derive(Debug, Serialize)]
pub struct Report {
    #[serde(skip)]
    plan: Plan,
    setup: String,
    seconds: f64,
    cache_mib: u64,
    span_mib: u64,
    engine: String,
    cleaner: Vec<String>,
    rows: Vec<ShapeRow>,
    drain: Vec<DrainRun>,
}

#[derive(Debug)]
struct Plan {
    cache_bytes: u64,
    span_bytes: u64,
    seconds: f64,
    runs: usize,
    shapes: Vec<Shape>,
    configs: Vec<String>,
    engine: EngineKind,
    cleaner: CleanerConfig,
}

fn make_plan(args: &WritebackArgs, run: &Run) -> Result<Plan, String> {
    let engine: EngineKind = args.engine.parse()?;
    let mut cleaner = CleanerConfig::default();
    cleaner
        .set_all(args.cleaner.iter().map(String::as_str))
        .map_err(|e| format!("--cleaner: {e}"))?;
    for c in &args.configs {
        if !["raw", "cleaner", "inline", "misses", "drain"].contains(&c.as_str()) {
            return Err(format!(
                "unknown config {c:?}; expected raw, cleaner, inline, misses or drain"
            ));
        }
    }
    let (seconds, runs) = (run.seconds, run.runs);
    let (cache_mib, span_mib, shapes) = if run.quick {
        (16, 128, vec![Shape { writers: 2, depth: 1 }])
    } else {
        (args.cache_mib, args.span_mib, args.shapes.clone())
    };
    if span_mib < 2 * cache_mib {
        return Err(format!(
            "the span ({span_mib} MiB) must be at least twice the cache ({cache_mib} MiB): the \
             cache must fill and stay full"
        ));
    }
    Ok(Plan {
        cache_bytes: cache_mib << 20,
        span_bytes: span_mib << 20,
        seconds,
        runs,
        shapes,
        configs: args.configs.clone(),
        engine,
        cleaner,
    })
}

impl Experiment for WritebackArgs {
    const NAME: &'static str = "writeback";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(1), seconds: Some(60.0), quick_runs: 1, quick_seconds: 3.0 };
    type Report = Report;

    /// Runs every configuration, printing each run's line as it comes unless `run.json`.
    fn run(&self, run: &Run) -> Result<Report, String> {
        let plan = make_plan(self, run)?;
        let say = |line: &str| {
            if !run.json {
                println!("{line}");
            }
        };
        let fio_version = Command::new(&self.fio).arg("--version").output().ok();
        let wants_fio = plan.configs.iter().any(|c| c == "raw" || c == "drain" || c == "misses");
        if wants_fio && fio_version.as_ref().is_none_or(|o| !o.status.success()) {
            return Err(format!(
                "fio ({}) not found; install it (apt-get install -y fio) or leave out raw and drain",
                self.fio
            ));
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let backing = self.dir.join(format!("pmcache-bench-writeback-{}.img", std::process::id()));
        let _remove = RemoveOnDrop(backing.clone());
        eprintln!(
            "writing the backing file {} ({} MiB)…",
            backing.display(),
            plan.span_bytes >> 20
        );
        write_random(&backing, plan.span_bytes)
            .map_err(|e| format!("{}: {e}", backing.display()))?;
        let setup = setup_text(&self.dir, &self.medium_dir, &plan);
        say(&setup);

        let mut rows: Vec<ShapeRow> = Vec::new();
        let mut drains: Vec<DrainRun> = Vec::new();
        for turn in 0..plan.runs {
            for &shape in &plan.shapes {
                // The configurations take turns going first, so that a drift in the disk's speed
                // (a host flushing its cache, a neighbour's load) does not always hit the same one.
                let mut order = ["raw", "cleaner", "inline"];
                order.rotate_left(turn % 3);
                let mut samples: Vec<(&str, Sample)> = Vec::new();
                for config in order {
                    if !plan.configs.iter().any(|c| c == config) {
                        continue;
                    }
                    eprintln!("run {}/{}: shape {shape}, {config}…", turn + 1, plan.runs);
                    let sample = match config {
                        "raw" => best_raw(turn, |engine| {
                            run_fio_random(self, &plan, &backing, shape, engine, true)
                        })?,
                        _ => run_engine(self, &plan, &backing, shape, config == "cleaner", turn)?,
                    };
                    samples.push((config, sample));
                }
                let raw_iops = samples.iter().find(|(c, _)| *c == "raw").map(|(_, s)| s.iops);
                samples
                    .sort_by_key(|(c, _)| ["raw", "cleaner", "inline"].iter().position(|x| x == c));
                for (config, sample) in samples {
                    say(&sample_line(turn, shape, config, &sample, raw_iops));
                    let ratio = raw_iops.filter(|_| config != "raw").map(|raw| sample.iops / raw);
                    push_row(&mut rows, shape, config, sample, ratio);
                }
            }
            if plan.configs.iter().any(|c| c == "misses") {
                let shape = self.miss_shape;
                eprintln!("run {}/{}: read misses {shape}…", turn + 1, plan.runs);
                let raw_reads = || {
                    best_raw(turn, |engine| {
                        run_fio_random(self, &plan, &backing, shape, engine, false)
                    })
                };
                let (ours, fio) = if turn % 2 == 0 {
                    let ours = run_misses(self, &plan, &backing, shape, turn)?;
                    (ours, raw_reads()?)
                } else {
                    let fio = raw_reads()?;
                    (run_misses(self, &plan, &backing, shape, turn)?, fio)
                };
                say(&sample_line(turn, shape, "raw-read", &fio, None));
                say(&sample_line(turn, shape, "misses", &ours, Some(fio.iops)));
                let ratio = ours.iops / fio.iops;
                push_row(&mut rows, shape, "raw-read", fio, None);
                push_row(&mut rows, shape, "misses", ours, Some(ratio));
            }
            if plan.configs.iter().any(|c| c == "drain") {
                eprintln!("run {}/{}: drain…", turn + 1, plan.runs);
                let drain = run_drain(self, &plan, &backing, turn)?;
                say(&format!(
                    "  run {} drain: {} blocks, cleaner {:.0} blocks/s in {} writes, fio same blocks \
                 {} ({}), ratio {}",
                    turn + 1,
                    drain.blocks,
                    drain.cleaner_blocks_per_s,
                    drain.writes_issued,
                    drain.fio_blocks_per_s.map_or("-".into(), |v| format!("{v:.0} blocks/s")),
                    engines_text(&drain.fio_engines),
                    drain.ratio.map_or("-".into(), |r| format!("{r:.2}"))
                ));
                drains.push(drain);
            }
        }
        Ok(Report {
            setup,
            seconds: plan.seconds,
            cache_mib: plan.cache_bytes >> 20,
            span_mib: plan.span_bytes >> 20,
            engine: plan.engine.name().to_string(),
            cleaner: self.cleaner.clone(),
            rows,
            drain: drains,
            plan,
        })
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        summary(&report.plan, &report.rows, &report.drain)
    }

    fn finish(&self, report: &Report, _run: &Run) -> Result<(), String> {
        plot(report, &self.plot)?;
        eprintln!("plot written to {}", self.plot.display());
        Ok(())
    }
}

/// The best of fio's engines in run `run` (the first engine turning with the run), with every
/// engine's figure kept in the sample.
fn best_raw(
    run: usize,
    measure: impl FnMut(&'static str) -> Result<Sample, String>,
) -> Result<Sample, String> {
    let (mut best, engines) = best_of_engines(&RAW_ENGINES, run, measure, |s| s.iops)?;
    best.raw_engines = engines;
    Ok(best)
}

/// Adds a run's sample (and its ratio to the baseline) to its row.
fn push_row(
    rows: &mut Vec<ShapeRow>,
    shape: Shape,
    config: &str,
    sample: Sample,
    ratio: Option<f64>,
) {
    let at = match rows.iter().position(|r| r.shape == shape && r.config == config) {
        Some(at) => at,
        None => {
            rows.push(ShapeRow {
                shape,
                config: config.to_string(),
                runs: Vec::new(),
                ratios: Vec::new(),
            });
            rows.len() - 1
        }
    };
    rows[at].ratios.extend(ratio);
    rows[at].runs.push(sample);
}

fn setup_text(dir: &Path, medium_dir: &Path, plan: &Plan) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "writeback: {cpus} CPUs; cache {} MiB in {}, backing file {} MiB in {} ({}, O_DIRECT); \
         4 KiB random writes, {} s per configuration, {} run(s); cleaner {}",
        plan.cache_bytes >> 20,
        medium_dir.display(),
        plan.span_bytes >> 20,
        dir.display(),
        plan.engine.name(),
        plan.seconds,
        plan.runs,
        cleaner_text(&plan.cleaner),
    )
}

fn cleaner_text(config: &CleanerConfig) -> String {
    let defaults = CleanerConfig::default().describe();
    let changed: Vec<String> = config
        .describe()
        .into_iter()
        .filter(|pair| !defaults.contains(pair))
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    if changed.is_empty() { "defaults".into() } else { changed.join(" ") }
}

/// Removes a file when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
