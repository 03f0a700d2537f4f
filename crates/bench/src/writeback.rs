//! `pmcache bench writeback`: sustained 4 KiB random writes into a write-back cache smaller
//! than the span, with a backing file on a real disk — the regime where a cache's write-back
//! decides its speed.
//!
//! For each shape (writer threads × requests per call), every run measures, one after the
//! other on the same backing file:
//! - `raw`: fio writing 4 KiB at random places of the backing file directly, with the same
//!   I/O engine, `O_DIRECT`, and the same total queue depth (one fio job per writer, each with
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
//! engine, jobs and queue depth.
//!
//! `drain` measures the cleaner alone: a cache filled with dirty blocks at distinct random
//! places is written back by `Cleaner::drain` (LBA order, merged runs, its queue depth),
//! beside fio replaying writes of the very same blocks in the same (ascending) order with the
//! same engine and queue depth, and one `fsync` at the end.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pmcache_backing::{BackingStore, EngineKind, EngineOptions, open_backing};
use pmcache_engine::{
    CleanerConfig, Config, Engine, MonotonicClock, ReadRequest, Stats, WriteRequest,
};
use pmcache_media::PmemFile;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

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
    /// Seconds each configuration runs.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Runs (the table shows medians; the JSON has every run).
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// A setting of the cleaner, `KEY=VALUE` (repeatable), as `pmcache serve --cleaner`.
    #[arg(long = "cleaner", value_name = "KEY=VALUE")]
    pub cleaner: Vec<String>,
    /// The backing store's I/O engine (and fio's), as `--engine` names it.
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
    /// Smoke mode for CI: 16 MiB cache, 128 MiB span, shape 2x1, 3 s, one run.
    #[arg(long)]
    pub quick: bool,
    /// Also write the JSON report (with per-second timelines) to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
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
    /// Blocks per second fio wrote the same blocks (fsync at the end included).
    fio_blocks_per_s: Option<f64>,
    writes_issued: u64,
    ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    setup: String,
    seconds: f64,
    cache_mib: u64,
    span_mib: u64,
    engine: String,
    cleaner: Vec<String>,
    rows: Vec<ShapeRow>,
    drain: Vec<DrainRun>,
}

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

fn make_plan(args: &WritebackArgs) -> Result<Plan, String> {
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
    let (cache_mib, span_mib, seconds, runs, shapes) = if args.quick {
        (16, 128, 3.0, 1, vec![Shape { writers: 2, depth: 1 }])
    } else {
        (args.cache_mib, args.span_mib, args.seconds, args.runs.max(1), args.shapes.clone())
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

/// Runs the experiment and prints the table (and writes the JSON and plot).
pub fn run_cli(args: &WritebackArgs) -> Result<(), String> {
    let plan = make_plan(args)?;
    let fio_version = Command::new(&args.fio).arg("--version").output().ok();
    let wants_fio = plan.configs.iter().any(|c| c == "raw" || c == "drain" || c == "misses");
    if wants_fio && fio_version.as_ref().is_none_or(|o| !o.status.success()) {
        return Err(format!(
            "fio ({}) not found; install it (apt-get install -y fio) or leave out raw and drain",
            args.fio
        ));
    }
    std::fs::create_dir_all(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    let backing = args.dir.join(format!("pmcache-bench-writeback-{}.img", std::process::id()));
    let _remove = RemoveOnDrop(backing.clone());
    eprintln!("writing the backing file {} ({} MiB)…", backing.display(), plan.span_bytes >> 20);
    write_file(&backing, plan.span_bytes).map_err(|e| format!("{}: {e}", backing.display()))?;
    let setup = setup_text(&args.dir, &args.medium_dir, &plan);
    println!("{setup}");

    let mut rows: Vec<ShapeRow> = Vec::new();
    let mut drains: Vec<DrainRun> = Vec::new();
    for run in 0..plan.runs {
        for &shape in &plan.shapes {
            // The configurations take turns going first, so that a drift in the disk's speed
            // (a host flushing its cache, a neighbour's load) does not always hit the same one.
            let mut order = ["raw", "cleaner", "inline"];
            order.rotate_left(run % 3);
            let mut samples: Vec<(&str, Sample)> = Vec::new();
            for config in order {
                if !plan.configs.iter().any(|c| c == config) {
                    continue;
                }
                eprintln!("run {}/{}: shape {shape}, {config}…", run + 1, plan.runs);
                let sample = match config {
                    "raw" => run_fio_random(args, &plan, &backing, shape)?,
                    _ => run_engine(args, &plan, &backing, shape, config == "cleaner", run)?,
                };
                samples.push((config, sample));
            }
            let raw_iops = samples.iter().find(|(c, _)| *c == "raw").map(|(_, s)| s.iops);
            samples.sort_by_key(|(c, _)| ["raw", "cleaner", "inline"].iter().position(|x| x == c));
            for (config, sample) in samples {
                print_sample_line(run, shape, config, &sample, raw_iops);
                let ratio = raw_iops.filter(|_| config != "raw").map(|raw| sample.iops / raw);
                push_row(&mut rows, shape, config, sample, ratio);
            }
        }
        if plan.configs.iter().any(|c| c == "misses") {
            let shape = args.miss_shape;
            eprintln!("run {}/{}: read misses {shape}…", run + 1, plan.runs);
            let (ours, fio) = if run % 2 == 0 {
                let ours = run_misses(args, &plan, &backing, shape, run)?;
                (ours, run_fio_random_reads(args, &plan, &backing, shape)?)
            } else {
                let fio = run_fio_random_reads(args, &plan, &backing, shape)?;
                (run_misses(args, &plan, &backing, shape, run)?, fio)
            };
            print_sample_line(run, shape, "raw-read", &fio, None);
            print_sample_line(run, shape, "misses", &ours, Some(fio.iops));
            let ratio = ours.iops / fio.iops;
            push_row(&mut rows, shape, "raw-read", fio, None);
            push_row(&mut rows, shape, "misses", ours, Some(ratio));
        }
        if plan.configs.iter().any(|c| c == "drain") {
            eprintln!("run {}/{}: drain…", run + 1, plan.runs);
            let drain = run_drain(args, &plan, &backing, run)?;
            println!(
                "  run {} drain: {} blocks, cleaner {:.0} blocks/s in {} writes, fio same blocks \
                 {}, ratio {}",
                run + 1,
                drain.blocks,
                drain.cleaner_blocks_per_s,
                drain.writes_issued,
                drain.fio_blocks_per_s.map_or("-".into(), |v| format!("{v:.0} blocks/s")),
                drain.ratio.map_or("-".into(), |r| format!("{r:.2}"))
            );
            drains.push(drain);
        }
    }
    print!("{}", summary(&plan, &rows, &drains));
    let report = Report {
        setup,
        seconds: plan.seconds,
        cache_mib: plan.cache_bytes >> 20,
        span_mib: plan.span_bytes >> 20,
        engine: plan.engine.name().to_string(),
        cleaner: args.cleaner.clone(),
        rows,
        drain: drains,
    };
    if let Some(path) = &args.json_out {
        let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    plot(&report, &args.plot)?;
    eprintln!("plot written to {}", args.plot.display());
    Ok(())
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

/// Writes `bytes` of non-zero data (so that no block is a hole the file system would
/// allocate during the measurement), then syncs.
fn write_file(path: &Path, bytes: u64) -> std::io::Result<()> {
    let mut file = std::fs::File::create(path)?;
    let mut chunk = vec![0u8; 1 << 20];
    SmallRng::seed_from_u64(0xbac).fill(&mut chunk[..]);
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()
}

/// The engine with a fresh cache on the medium directory, over the backing file.
type BenchEngine = Engine<Arc<PmemFile>, Arc<dyn BackingStore>, MonotonicClock>;

fn open_engine(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    lanes: usize,
) -> Result<(tempfile::TempDir, BenchEngine), String> {
    let tmp = tempfile::tempdir_in(&args.medium_dir)
        .map_err(|e| format!("{}: {e}", args.medium_dir.display()))?;
    let medium = Arc::new(
        PmemFile::open(&tmp.path().join("medium"), Some(plan.cache_bytes))
            .map_err(|e| e.to_string())?,
    );
    let opts = EngineOptions { sync_contexts: lanes + 1, ..EngineOptions::new(plan.engine, true) };
    let store = open_backing(backing, &opts).map_err(|e| e.to_string())?;
    let config = Config { max_lanes: lanes, ..Config::default() };
    let engine = Engine::format(medium, store, MonotonicClock::default(), &config)
        .map_err(|e| e.to_string())?;
    Ok((tmp, engine))
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds")
}

/// The engine under `shape`'s writers for the run's length, with or without the cleaner.
fn run_engine(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
    with_cleaner: bool,
    run: usize,
) -> Result<Sample, String> {
    let (_medium_dir, engine) = open_engine(args, plan, backing, shape.writers + 2)?;
    let slots = engine.superblock().geometry.slot_count;
    let span_blocks = plan.span_bytes / BLOCK_BYTES;
    let stop = AtomicBool::new(false);
    let steady = AtomicBool::new(false);
    let counts: Vec<AtomicU64> = (0..shape.writers).map(|_| AtomicU64::new(0)).collect();
    let failure: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let mut cleaner = if with_cleaner {
        Some(engine.cleaner(plan.cleaner.clone()).map_err(|e| e.to_string())?)
    } else {
        None
    };
    struct Monitor {
        iops: Vec<f64>,
        dirty: Vec<f64>,
        full_at: Option<(Duration, u64)>,
        end: (Duration, u64),
    }
    let (monitor, histograms) = std::thread::scope(|scope| {
        let cleaner_thread = cleaner.as_mut().map(|c| scope.spawn(move || c.run(|_| {})));
        let writers: Vec<_> = (0..shape.writers)
            .map(|w| {
                let (engine, stop, steady, counts, failure) =
                    (&engine, &stop, &steady, &counts, &failure);
                scope.spawn(move || {
                    let mut hist = histogram();
                    let mut lane = match engine.lane() {
                        Ok(lane) => lane,
                        Err(e) => {
                            *failure.lock().expect("failure lock") = Some(e.to_string());
                            stop.store(true, Ordering::SeqCst);
                            return hist;
                        }
                    };
                    let mut rng =
                        SmallRng::seed_from_u64(0x5eed ^ (w as u64) << 32 ^ (run as u64) << 48);
                    let mut data = vec![0u8; shape.depth * BLOCK_BYTES as usize];
                    rng.fill(&mut data[..]);
                    let mut offsets = vec![0u64; shape.depth];
                    let mut outcomes = Vec::with_capacity(shape.depth);
                    while !stop.load(Ordering::Relaxed) {
                        for o in offsets.iter_mut() {
                            *o = rng.gen_range(0..span_blocks) * BLOCK_BYTES;
                        }
                        let started = Instant::now();
                        let result = if shape.depth == 1 {
                            lane.write(offsets[0], &data, false)
                        } else {
                            let requests: Vec<WriteRequest<'_>> = offsets
                                .iter()
                                .zip(data.chunks(BLOCK_BYTES as usize))
                                .map(|(&offset, data)| WriteRequest { offset, data, fua: false })
                                .collect();
                            outcomes.clear();
                            lane.write_batch(&requests, &mut outcomes);
                            outcomes.drain(..).find(Result::is_err).unwrap_or(Ok(()))
                        };
                        let ns = started.elapsed().as_nanos() as u64;
                        if let Err(e) = result {
                            *failure.lock().expect("failure lock") = Some(e.to_string());
                            stop.store(true, Ordering::SeqCst);
                            break;
                        }
                        if steady.load(Ordering::Relaxed) {
                            for _ in 0..shape.depth {
                                let _ = hist.record(ns.max(1));
                            }
                        }
                        counts[w].fetch_add(shape.depth as u64, Ordering::Relaxed);
                    }
                    hist
                })
            })
            .collect();
        // The monitor: whether the cache is full yet, and a sample every second.
        let start = Instant::now();
        let total = || counts.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
        let mut monitor = Monitor {
            iops: Vec::new(),
            dirty: Vec::new(),
            full_at: None,
            end: (Duration::ZERO, 0),
        };
        let mut last_second_total = 0;
        let run_for = Duration::from_secs_f64(plan.seconds);
        let mut next_tick = start + TICK;
        loop {
            std::thread::sleep(next_tick.saturating_duration_since(Instant::now()));
            next_tick += TICK;
            let now = start.elapsed();
            let written = total();
            if monitor.full_at.is_none() && written >= slots {
                monitor.full_at = Some((now, written));
                steady.store(true, Ordering::Relaxed);
            }
            let whole_seconds = now.as_secs() as usize;
            if whole_seconds > monitor.iops.len() {
                monitor.iops.push((written - last_second_total) as f64);
                monitor.dirty.push(engine.dirty_slots() as f64 / slots as f64);
                last_second_total = written;
            }
            if now >= run_for || stop.load(Ordering::Relaxed) {
                monitor.end = (now, written);
                break;
            }
        }
        stop.store(true, Ordering::SeqCst);
        let histograms: Vec<Histogram<u64>> =
            writers.into_iter().map(|h| h.join().expect("writer panicked")).collect();
        engine.stop_cleaner();
        if let Some(thread) = cleaner_thread {
            thread.join().expect("cleaner panicked");
        }
        (monitor, histograms)
    });
    drop(cleaner);
    if let Some(e) = failure.lock().expect("failure lock").take() {
        return Err(format!("a write failed: {e}"));
    }
    let mut hist = histogram();
    for h in &histograms {
        hist.add(h).map_err(|e| e.to_string())?;
    }
    let stats = engine.stats();
    let (end_t, end_written) = monitor.end;
    let (iops, first_steady_second) = match monitor.full_at {
        Some((t, written)) => (
            (end_written - written) as f64 / (end_t - t).as_secs_f64().max(1e-3),
            t.as_secs_f64().ceil() as usize,
        ),
        None => (end_written as f64 / end_t.as_secs_f64(), 0),
    };
    Ok(Sample {
        iops,
        min_window_ratio: min_window(&monitor.iops, first_steady_second, iops),
        latency_ns_p50: hist.value_at_quantile(0.5) as f64,
        latency_ns_p99: hist.value_at_quantile(0.99) as f64,
        latency_ns_p999: hist.value_at_quantile(0.999) as f64,
        latency_ns_max: hist.max() as f64,
        full_after_s: monitor.full_at.map(|(t, _)| t.as_secs_f64()),
        iops_timeline: monitor.iops,
        dirty_fraction_end: monitor.dirty.last().copied(),
        dirty_timeline: monitor.dirty,
        cleaner: Some(figures(&stats, with_cleaner)),
    })
}

fn figures(stats: &Stats, with_cleaner: bool) -> CleanerFigures {
    let c = &stats.cleaner;
    CleanerFigures {
        blocks_cleaned: c.blocks_cleaned,
        writes_issued: c.writes_issued,
        batches: c.batches,
        inline_writebacks: if with_cleaner {
            stats.writebacks.saturating_sub(c.blocks_cleaned)
        } else {
            stats.writebacks
        },
        stalls: c.stalls,
        stall_ns_p99: c.stall_ns_quantile(0.99),
        stall_ns_max: c.stall_ns_max,
        boosts: c.boosts,
        boosted_s: c.boosted_ns as f64 / 1e9,
    }
}

/// The slowest whole second from `first` on (the last, partial second left out), over `mean`.
fn min_window(timeline: &[f64], first: usize, mean: f64) -> f64 {
    let windows = timeline.get(first..).unwrap_or(&[]);
    let slowest = windows.iter().copied().fold(f64::INFINITY, f64::min);
    if slowest.is_finite() && mean > 0.0 { slowest / mean } else { f64::NAN }
}

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
fn run_fio_random(
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

/// Random reads over the span in batches of `shape.depth`, one lane per reader: nearly all
/// miss (the span is several times the cache), and the misses of a batch go to the backing
/// store together. Latencies are of whole batches (a batch returns with its slowest read).
fn run_misses(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
    run: usize,
) -> Result<Sample, String> {
    let (_medium_dir, engine) = open_engine(args, plan, backing, shape.writers + 1)?;
    let span_blocks = plan.span_bytes / BLOCK_BYTES;
    let stop = AtomicBool::new(false);
    let counts: Vec<AtomicU64> = (0..shape.writers).map(|_| AtomicU64::new(0)).collect();
    let failure: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let (timeline, elapsed, histograms) = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..shape.writers)
            .map(|w| {
                let (engine, stop, counts, failure) = (&engine, &stop, &counts, &failure);
                scope.spawn(move || {
                    let mut hist = histogram();
                    let mut lane = match engine.lane() {
                        Ok(lane) => lane,
                        Err(e) => {
                            *failure.lock().expect("failure lock") = Some(e.to_string());
                            stop.store(true, Ordering::SeqCst);
                            return hist;
                        }
                    };
                    let mut rng =
                        SmallRng::seed_from_u64(0x4ead ^ (w as u64) << 32 ^ (run as u64) << 48);
                    let mut bufs = vec![vec![0u8; BLOCK_BYTES as usize]; shape.depth];
                    let mut outcomes = Vec::with_capacity(shape.depth);
                    while !stop.load(Ordering::Relaxed) {
                        let mut reads: Vec<ReadRequest<'_>> = bufs
                            .iter_mut()
                            .map(|buf| ReadRequest {
                                offset: rng.gen_range(0..span_blocks) * BLOCK_BYTES,
                                buf,
                            })
                            .collect();
                        let started = Instant::now();
                        lane.read_batch(&mut reads, &mut outcomes);
                        let ns = started.elapsed().as_nanos() as u64;
                        if let Some(Err(e)) = outcomes.iter().find(|o| o.is_err()) {
                            *failure.lock().expect("failure lock") = Some(e.to_string());
                            stop.store(true, Ordering::SeqCst);
                            break;
                        }
                        for _ in 0..shape.depth {
                            let _ = hist.record(ns.max(1));
                        }
                        counts[w].fetch_add(shape.depth as u64, Ordering::Relaxed);
                    }
                    hist
                })
            })
            .collect();
        let start = Instant::now();
        let run_for = Duration::from_secs_f64(plan.seconds);
        let mut timeline = Vec::new();
        let mut last = 0;
        while start.elapsed() < run_for && !stop.load(Ordering::Relaxed) {
            let next = start + Duration::from_secs(timeline.len() as u64 + 1);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            let total: u64 = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
            timeline.push((total - last) as f64);
            last = total;
        }
        stop.store(true, Ordering::SeqCst);
        let elapsed = start.elapsed();
        let histograms: Vec<Histogram<u64>> =
            readers.into_iter().map(|h| h.join().expect("reader panicked")).collect();
        (timeline, elapsed, histograms)
    });
    if let Some(e) = failure.lock().expect("failure lock").take() {
        return Err(format!("a read failed: {e}"));
    }
    let mut hist = histogram();
    for h in &histograms {
        hist.add(h).map_err(|e| e.to_string())?;
    }
    let total: u64 = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    let iops = total as f64 / elapsed.as_secs_f64();
    let stats = engine.stats();
    let misses =
        stats.read_misses_admitted + stats.read_misses_bypassed + stats.read_misses_sequential;
    eprintln!(
        "  read misses: {misses} of {} blocks read ({:.0} %), {} admitted",
        misses + stats.read_hits,
        100.0 * misses as f64 / (misses + stats.read_hits).max(1) as f64,
        stats.read_misses_admitted
    );
    Ok(Sample {
        iops,
        min_window_ratio: min_window(&timeline, 1, iops),
        latency_ns_p50: hist.value_at_quantile(0.5) as f64,
        latency_ns_p99: hist.value_at_quantile(0.99) as f64,
        latency_ns_p999: hist.value_at_quantile(0.999) as f64,
        latency_ns_max: hist.max() as f64,
        full_after_s: None,
        iops_timeline: timeline,
        dirty_timeline: Vec::new(),
        dirty_fraction_end: None,
        cleaner: None,
    })
}

/// fio's random reads of the backing file, one job per reader, at the shape's depth.
fn run_fio_random_reads(
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

/// The cleaner alone: a cache filled with dirty blocks at distinct random places, drained;
/// then fio writes the same blocks in the same ascending order at the cleaner's queue depth.
fn run_drain(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    run: usize,
) -> Result<DrainRun, String> {
    let (_medium_dir, engine) = open_engine(args, plan, backing, 2)?;
    let slots = engine.superblock().geometry.slot_count;
    let span_blocks = plan.span_bytes / BLOCK_BYTES;
    // 90 % of the slots: the fill never needs a slot back.
    let want = (slots * 9 / 10).min(span_blocks / 2) as usize;
    let mut rng = SmallRng::seed_from_u64(0xd2a1 ^ run as u64);
    let mut blocks: HashSet<u64> = HashSet::with_capacity(want);
    while blocks.len() < want {
        blocks.insert(rng.gen_range(0..span_blocks));
    }
    let mut blocks: Vec<u64> = blocks.into_iter().collect();
    {
        let mut lane = engine.lane().map_err(|e| e.to_string())?;
        let mut data = vec![0u8; BLOCK_BYTES as usize];
        rng.fill(&mut data[..]);
        for &b in &blocks {
            lane.write(b * BLOCK_BYTES, &data, false).map_err(|e| e.to_string())?;
        }
    }
    if engine.dirty_slots() != want as u64 {
        return Err(format!(
            "the fill left {} dirty blocks, not {want}: something wrote back early",
            engine.dirty_slots()
        ));
    }
    blocks.sort_unstable();
    // fio first on odd runs (see `run_cli`).
    let fio_first = run % 2 == 1;
    let mut fio_blocks_per_s = None;
    if fio_first {
        fio_blocks_per_s = Some(run_fio_replay(args, plan, backing, &blocks)?);
    }
    let mut cleaner = engine.cleaner(plan.cleaner.clone()).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let cleaned = cleaner.drain().map_err(|e| e.to_string())?;
    let seconds = started.elapsed().as_secs_f64();
    let writes_issued = engine.stats().cleaner.writes_issued;
    drop(cleaner);
    if cleaned != want as u64 {
        return Err(format!("the drain cleaned {cleaned} blocks, not {want}"));
    }
    let cleaner_blocks_per_s = cleaned as f64 / seconds;
    if !fio_first {
        fio_blocks_per_s = Some(run_fio_replay(args, plan, backing, &blocks)?);
    }
    Ok(DrainRun {
        blocks: cleaned,
        cleaner_blocks_per_s,
        fio_blocks_per_s,
        writes_issued,
        ratio: fio_blocks_per_s.map(|f| cleaner_blocks_per_s / f),
    })
}

/// fio writing `blocks` (ascending) to the backing file from an I/O log, at the cleaner's
/// queue depth, with an fsync at the end; returns blocks per second.
fn run_fio_replay(
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

fn print_sample_line(run: usize, shape: Shape, config: &str, s: &Sample, raw: Option<f64>) {
    let ratio = match (config, raw) {
        ("raw", _) | (_, None) => String::from("    -"),
        (_, Some(raw)) => format!("{:5.2}", s.iops / raw),
    };
    let mut line = format!(
        "  run {} {shape:>5} {config:<8} {:>9.0} IOPS  ×raw {ratio}  min1s/mean {:.2}  p50 {}  \
         p99 {}  p99.9 {}  max {}",
        run + 1,
        s.iops,
        s.min_window_ratio,
        us(s.latency_ns_p50),
        us(s.latency_ns_p99),
        us(s.latency_ns_p999),
        us(s.latency_ns_max),
    );
    if let Some(c) = &s.cleaner {
        let _ = write!(
            line,
            "  dirty {:.0}%  full@{}  cleaned {} in {} writes  inline {}  stalls {} (p99 {}, max \
             {})  boosts {} ({:.1} s)",
            s.dirty_fraction_end.unwrap_or(f64::NAN) * 100.0,
            s.full_after_s.map_or("-".into(), |t| format!("{t:.1}s")),
            c.blocks_cleaned,
            c.writes_issued,
            c.inline_writebacks,
            c.stalls,
            us(c.stall_ns_p99 as f64),
            us(c.stall_ns_max as f64),
            c.boosts,
            c.boosted_s
        );
    }
    println!("{line}");
}

fn us(ns: f64) -> String {
    if !ns.is_finite() {
        "-".into()
    } else if ns >= 1e6 {
        format!("{:.1}ms", ns / 1e6)
    } else {
        format!("{:.0}µs", ns / 1e3)
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) { (v[mid - 1] + v[mid]) / 2.0 } else { v[mid] }
}

fn summary(plan: &Plan, rows: &[ShapeRow], drains: &[DrainRun]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nmedians of {} run(s): steady IOPS (after the cache is full), ratio to raw in the \
         same run, slowest second / mean, latency of writes after the cache is full",
        plan.runs
    );
    let _ = writeln!(
        out,
        "{:>6} {:<8} {:>9} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "shape", "config", "IOPS", "×raw", "min1s/mean", "p99", "p99.9", "max", "p99.9/raw"
    );
    for row in rows {
        let m = |f: &dyn Fn(&Sample) -> f64| median(&row.runs.iter().map(f).collect::<Vec<_>>());
        let raw_p999 = rows
            .iter()
            .find(|r| r.shape == row.shape && r.config == "raw")
            .map(|r| median(&r.runs.iter().map(|s| s.latency_ns_p999).collect::<Vec<_>>()));
        let p999 = m(&|s| s.latency_ns_p999);
        let _ = writeln!(
            out,
            "{:>6} {:<8} {:>9.0} {:>6} {:>10.2} {:>9} {:>9} {:>9} {:>9}",
            row.shape.to_string(),
            row.config,
            m(&|s| s.iops),
            if row.ratios.is_empty() { "-".into() } else { format!("{:.2}", median(&row.ratios)) },
            m(&|s| s.min_window_ratio),
            us(m(&|s| s.latency_ns_p99)),
            us(p999),
            us(m(&|s| s.latency_ns_max)),
            match raw_p999 {
                Some(raw) if row.config != "raw" => format!("{:.2}", p999 / raw),
                _ => "-".into(),
            }
        );
    }
    if !drains.is_empty() {
        let cleaner = median(&drains.iter().map(|d| d.cleaner_blocks_per_s).collect::<Vec<_>>());
        let fio = median(&drains.iter().filter_map(|d| d.fio_blocks_per_s).collect::<Vec<_>>());
        let ratio = median(&drains.iter().filter_map(|d| d.ratio).collect::<Vec<_>>());
        let _ = writeln!(
            out,
            "drain of {} dirty blocks: cleaner {cleaner:.0} blocks/s, fio writing the same \
             blocks (same engine, QD {}) {fio:.0} blocks/s, ratio {ratio:.2}",
            drains[0].blocks, plan.cleaner.queue_depth
        );
    }
    out
}

fn plot(report: &Report, path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    // The write shapes (the read-miss rows have no dirty share to plot).
    let written = |r: &&ShapeRow| ["raw", "cleaner", "inline"].contains(&r.config.as_str());
    let shapes: Vec<Shape> = report.rows.iter().filter(written).fold(Vec::new(), |mut v, r| {
        if !v.contains(&r.shape) {
            v.push(r.shape);
        }
        v
    });
    if shapes.is_empty() {
        return Ok(());
    }
    let root = SVGBackend::new(path, (1100, 380 * shapes.len() as u32 * 2)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((shapes.len() * 2, 1));
    let configs = ["raw", "cleaner", "inline"];
    for (i, shape) in shapes.iter().enumerate() {
        // The first run of each configuration.
        let series: Vec<(&str, &Sample)> = configs
            .iter()
            .filter_map(|c| {
                report
                    .rows
                    .iter()
                    .find(|r| r.shape == *shape && r.config == *c)
                    .and_then(|r| r.runs.first().map(|s| (*c, s)))
            })
            .collect();
        let seconds = series.iter().map(|(_, s)| s.iops_timeline.len()).max().unwrap_or(1).max(1);
        let y_max =
            series.iter().flat_map(|(_, s)| s.iops_timeline.iter().copied()).fold(1.0f64, f64::max)
                * 1.1;
        let mut chart = ChartBuilder::on(&areas[2 * i])
            .caption(
                format!(
                    "{shape} writers×depth: 4 KiB random writes per second, cache {} MiB, span {} MiB",
                    report.cache_mib, report.span_mib
                ),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..seconds as f64, 0f64..y_max)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("s")
            .y_desc("IOPS")
            .y_label_formatter(&|y| format!("{:.0}K", y / 1000.0))
            .draw()
            .map_err(|e| e.to_string())?;
        for (j, (config, sample)) in series.iter().enumerate() {
            let color = Palette99::pick(j).to_rgba();
            let points: Vec<(f64, f64)> = sample
                .iops_timeline
                .iter()
                .enumerate()
                .map(|(t, &v)| (t as f64 + 0.5, v))
                .collect();
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(*config)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| e.to_string())?;
        let mut dirty = ChartBuilder::on(&areas[2 * i + 1])
            .caption(format!("{shape}: dirty share of the cache"), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..seconds as f64, 0f64..1.0f64)
            .map_err(|e| e.to_string())?;
        dirty
            .configure_mesh()
            .x_desc("s")
            .y_desc("dirty")
            .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
            .draw()
            .map_err(|e| e.to_string())?;
        for (j, (config, sample)) in series.iter().enumerate() {
            if sample.dirty_timeline.is_empty() {
                continue;
            }
            let color = Palette99::pick(j).to_rgba();
            let points: Vec<(f64, f64)> = sample
                .dirty_timeline
                .iter()
                .enumerate()
                .map(|(t, &v)| (t as f64 + 1.0, v))
                .collect();
            dirty
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(*config)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        dirty
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}
