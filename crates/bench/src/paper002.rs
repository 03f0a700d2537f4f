//! `pmcache bench paper002`: paper 002's experiment (adaptive priority boosting of a host-level
//! FTL's writer daemon) with pmcache in pblk's place.
//!
//! The write-back buffer is the cache and the writer daemon is pmcache's cleaner. fio writes
//! 4 MiB random requests over NBD (one connection per writer, `numjobs`) into a cache smaller
//! than the span, so the cleaner must keep writing back for writers to find slots. The real
//! server (`pmcache serve`, spawned from this executable) is confined with `taskset` to CPU 0,
//! or CPUs 0–1; the cleaner runs with adaptive boosting off (`--cleaner adaptive=off`: fixed
//! priority) or on (`adaptive=boost`: its thread's nice value is lowered while writers stall
//! or dirty data is above the high watermark). Each row gives the median over `--runs` runs of
//! the bandwidth (MB/s), the stalls per block written (writes that found no free or clean slot
//! and waited for the cleaner — the paper's failed insertions — over the blocks written, from
//! the server's statistics), the server threads' voluntary + involuntary context switches over
//! the fio run (summed over `/proc/<pid>/task/*/status`, sampled every 100 ms so threads that
//! end with their connection are counted), the cleaner's boosts and the time it spent
//! boosted (the boosts that ended, from the server's statistics, and the one under way at the
//! end, seen by polling the control socket every 500 ms). fio and the bench itself are not
//! confined: on a 2-CPU machine with the server on CPU 0 they mostly run on CPU 1. Beside them: boost's bandwidth over off's in the same run, each configuration's
//! over the same one with the most CPUs, and the raw backing file's bandwidth (fio io_uring,
//! `O_DIRECT`, the same jobs), the ceiling once the cache is full.
//!
//! Table 1 runs the same with a CPU-bound job on the server's CPU: a thread pinned to CPU 0
//! computing π (a fixed number of Leibniz-series terms, sized to take about `--pi-seconds`
//! alone, timed alone first in every run). fio runs until the π job ends, so the whole job
//! runs under contention. The table gives the bandwidth with the π job (and over the
//! bandwidth without it, from the main table at 1 CPU), the server's context switches, and
//! the π job's time (and over its time alone).
//!
//! Output: tables, `--json`, and an SVG plot (`--plot`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pmcache_frontend::units::{human, parse_nonzero_size};
use serde::Serialize;

use crate::harness::fio::{FioResult, FioRun, FioSpec, FioTarget, check_fio};
use crate::harness::machine::{Machine, tool_version};
use crate::harness::output::{opt, progress};
use crate::harness::process::{catch_interrupts, check_interrupted, was_interrupted};
use crate::harness::scratch::{Scratch, settle};
use crate::harness::servers::{PmcacheServe, Server, ServerFigures, control_stats};
use crate::harness::stats::{median, median_index};

/// Arguments of `pmcache bench paper002`.
#[derive(clap::Args, Debug, Clone)]
pub struct Paper002Args {
    /// CPU counts to confine the server to (CPUs 0..n-1), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub cpus: Vec<usize>,
    /// Writer counts (fio jobs, one NBD connection each), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub writers: Vec<usize>,
    /// Cleaner modes to compare (`--cleaner adaptive=...`), comma-separated: off, boost,
    /// boost-pid.
    #[arg(long, value_delimiter = ',', default_value = "off,boost")]
    pub adaptive: Vec<String>,
    /// Seconds per measurement of the main table.
    #[arg(long, default_value_t = 30.0)]
    pub seconds: f64,
    /// Runs per configuration (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Span of the random offsets, the size of the backing file (e.g. 2G).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "2G")]
    pub span: u64,
    /// Size of the cache medium (smaller than the span: the cleaner must run).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "256M")]
    pub cache_size: u64,
    /// Request size.
    #[arg(long, value_parser = parse_nonzero_size, default_value = "4M")]
    pub bs: u64,
    /// Requests in flight per writer.
    #[arg(long, default_value_t = 1)]
    pub qd: usize,
    /// Further cleaner settings for every server, KEY=VALUE (repeatable; e.g. nice_boost=-20);
    /// `adaptive` comes from --adaptive.
    #[arg(long = "cleaner", value_name = "KEY=VALUE")]
    pub cleaner: Vec<String>,
    /// Writer counts of Table 1 (the π job on the server's CPU; the server on CPU 0).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    pub table1_writers: Vec<usize>,
    /// The π job's length alone, in seconds (default: --seconds).
    #[arg(long)]
    pub pi_seconds: Option<f64>,
    /// Skip Table 1.
    #[arg(long)]
    pub no_table1: bool,
    /// Skip the raw backing file's rows.
    #[arg(long)]
    pub no_raw: bool,
    /// Directory for the backing file: on a disk, not a tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Directory for the cache medium (emulated PM).
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Where to write the SVG plot.
    #[arg(long, default_value = "pmcache-bench-paper002.svg")]
    pub plot: PathBuf,
    /// Smoke mode: 1 CPU, 2 writers, 2 s, span 256 MiB, cache 32 MiB, 1 run, a 2 s π job.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Keep the backing file and the scratch directory (fio outputs, server logs).
    #[arg(long)]
    pub keep_files: bool,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
    /// The taskset binary.
    #[arg(long, default_value = "taskset")]
    pub taskset: String,
}

/// The resolved plan of one invocation.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    cpus: Vec<usize>,
    writers: Vec<usize>,
    adaptive: Vec<String>,
    seconds: f64,
    runs: usize,
    span_bytes: u64,
    cache_bytes: u64,
    bs: u64,
    qd: usize,
    cleaner: Vec<String>,
    raw: bool,
    table1_writers: Vec<usize>,
    pi_seconds: f64,
}

fn make_plan(args: &Paper002Args) -> Result<Plan, String> {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut plan = Plan {
        cpus: args.cpus.clone(),
        writers: args.writers.clone(),
        adaptive: args.adaptive.clone(),
        seconds: args.seconds,
        runs: args.runs,
        span_bytes: args.span,
        cache_bytes: args.cache_size,
        bs: args.bs,
        qd: args.qd,
        cleaner: args.cleaner.clone(),
        raw: !args.no_raw,
        table1_writers: if args.no_table1 { Vec::new() } else { args.table1_writers.clone() },
        pi_seconds: args.pi_seconds.unwrap_or(args.seconds),
    };
    if args.quick {
        plan.cpus = vec![1];
        plan.writers = vec![2];
        plan.seconds = 2.0;
        plan.runs = 1;
        plan.span_bytes = 256 << 20;
        plan.cache_bytes = 32 << 20;
        if !args.no_table1 {
            plan.table1_writers = vec![2];
        }
        plan.pi_seconds = 2.0;
    }
    if plan.cpus.iter().chain(&plan.writers).chain(&plan.table1_writers).any(|&n| n == 0)
        || plan.runs == 0
        || plan.qd == 0
        || plan.seconds <= 0.0
        || plan.pi_seconds <= 0.0
    {
        return Err("--cpus, --writers, --table1-writers, --runs, --qd, --seconds and \
                    --pi-seconds must be positive"
            .into());
    }
    if let Some(&n) = plan.cpus.iter().find(|&&n| n > available) {
        return Err(format!("--cpus {n}: this machine has {available} CPUs"));
    }
    if let Some(&n) = plan.writers.iter().chain(&plan.table1_writers).find(|&&n| n > 64) {
        return Err(format!("{n} writers: at most 64"));
    }
    for mode in &plan.adaptive {
        if !["off", "boost", "boost-pid"].contains(&mode.as_str()) {
            return Err(format!("--adaptive {mode:?}: expected off, boost or boost-pid"));
        }
    }
    if plan.adaptive.is_empty() {
        return Err("--adaptive: give at least one mode".into());
    }
    for setting in &plan.cleaner {
        if !setting.contains('=') || setting.contains(char::is_whitespace) {
            return Err(format!("--cleaner {setting:?}: expected KEY=VALUE"));
        }
        if setting.starts_with("adaptive=") {
            return Err("--cleaner adaptive=...: the modes come from --adaptive".into());
        }
    }
    if !plan.span_bytes.is_multiple_of(plan.bs) || !plan.bs.is_multiple_of(4096) {
        return Err("--bs must be a multiple of 4 KiB that divides --span".into());
    }
    if plan.cache_bytes >= plan.span_bytes {
        eprintln!(
            "warning: the cache ({}) is not smaller than the span ({}): the cleaner may never \
             need to run",
            human(plan.cache_bytes),
            human(plan.span_bytes)
        );
    }
    Ok(plan)
}

/// The server threads' context switches over a measurement.
#[derive(Debug, Clone, Default, Serialize)]
struct ContextSwitches {
    voluntary: u64,
    involuntary: u64,
    /// Voluntary + involuntary by thread name (digits and the dash before them dropped:
    /// `nbd-conn-3` counts as `nbd-conn`).
    by_thread: BTreeMap<String, u64>,
}

impl ContextSwitches {
    fn total(&self) -> u64 {
        self.voluntary + self.involuntary
    }
}

/// One thread's counters.
#[derive(Debug, Clone)]
struct TaskCounters {
    name: String,
    voluntary: u64,
    involuntary: u64,
}

/// Every thread of `pid`: `/proc/<pid>/task/<tid>/status`.
fn read_tasks(pid: u32) -> BTreeMap<u32, TaskCounters> {
    let mut tasks = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return tasks };
    for entry in entries.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else { continue };
        let mut task = TaskCounters { name: String::new(), voluntary: 0, involuntary: 0 };
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else { continue };
            let value = value.trim();
            match key {
                "Name" => task.name = value.to_string(),
                "voluntary_ctxt_switches" => task.voluntary = value.parse().unwrap_or(0),
                "nonvoluntary_ctxt_switches" => task.involuntary = value.parse().unwrap_or(0),
                _ => {}
            }
        }
        tasks.insert(tid, task);
    }
    tasks
}

/// What a [`RunSampler`] saw.
#[derive(Debug, Clone, Default)]
struct Sampled {
    switches: ContextSwitches,
    /// How long the cleaner had been boosted when sampling stopped, if it still was (the
    /// server's `cleaner_boosted_ns` counts boosts once they end), seconds.
    open_boost_s: f64,
}

/// Samples a process's threads' context-switch counters every 100 ms until stopped (a thread
/// that appears meanwhile counts from zero, one that ends keeps its last sample), and the
/// cleaner's boost state through the control socket every 500 ms.
struct RunSampler {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Sampled>>,
}

impl RunSampler {
    fn start(pid: u32, control: Option<PathBuf>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let base = read_tasks(pid);
        let handle = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut last = base.clone();
                let mut boost: Option<(Instant, u64)> = None;
                for tick in 0u64.. {
                    let done = stop.load(Ordering::Acquire);
                    last.extend(read_tasks(pid));
                    if tick.is_multiple_of(5)
                        && let Some(stats) = control.as_deref().and_then(|c| control_stats(c).ok())
                    {
                        let boosts = stats["cleaner_boosts"].as_u64().unwrap_or(0);
                        boost = match (stats["cleaner_boosted"].as_bool(), boost) {
                            // The same boost as at the last sample.
                            (Some(true), Some((since, n))) if n == boosts => Some((since, n)),
                            (Some(true), _) => Some((Instant::now(), boosts)),
                            _ => None,
                        };
                    }
                    if done {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                let mut out = ContextSwitches::default();
                for (tid, now) in &last {
                    let (v0, i0) = base.get(tid).map_or((0, 0), |b| (b.voluntary, b.involuntary));
                    let (v, i) =
                        (now.voluntary.saturating_sub(v0), now.involuntary.saturating_sub(i0));
                    out.voluntary += v;
                    out.involuntary += i;
                    let name = now.name.trim_end_matches(|c: char| c.is_ascii_digit());
                    let name = name.strip_suffix('-').unwrap_or(name).to_string();
                    *out.by_thread.entry(name).or_default() += v + i;
                }
                let open_boost_s = boost.map_or(0.0, |(since, _)| since.elapsed().as_secs_f64());
                Sampled { switches: out, open_boost_s }
            })
        };
        RunSampler { stop, handle: Some(handle) }
    }

    fn finish(mut self) -> Sampled {
        self.stop.store(true, Ordering::Release);
        self.handle.take().and_then(|h| h.join().ok()).unwrap_or_default()
    }
}

impl Drop for RunSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Confines the calling thread to one CPU.
fn pin_current_thread(cpu: usize) -> Result<(), String> {
    // SAFETY: cpu_set_t is plain data (all zeroes is the empty set); CPU_SET writes within
    // it; sched_setaffinity(0, ...) reads the set and applies it to the calling thread only.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(format!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// π from `terms` terms of the Leibniz series: a chain of dependent divisions and additions,
/// all CPU and nothing else.
fn leibniz_pi(terms: u64) -> f64 {
    let terms = std::hint::black_box(terms);
    let mut sum = 0.0f64;
    let mut sign = 1.0f64;
    let mut k = 0;
    // In slices of 2^22 terms, between which an interruption is noticed.
    while k < terms && !was_interrupted() {
        let end = terms.min(k + (1 << 22));
        while k < end {
            sum += sign / (2 * k + 1) as f64;
            sign = -sign;
            k += 1;
        }
    }
    std::hint::black_box(4.0 * sum)
}

/// Starts the π job on a thread pinned to CPU 0; it returns its run time.
fn spawn_pi(terms: u64) -> JoinHandle<Result<Duration, String>> {
    std::thread::spawn(move || {
        pin_current_thread(0)?;
        let started = Instant::now();
        let pi = leibniz_pi(terms);
        let elapsed = started.elapsed();
        check_interrupted()?;
        if (pi - std::f64::consts::PI).abs() > 1e-3 {
            return Err(format!("the π job computed {pi}"));
        }
        Ok(elapsed)
    })
}

fn join_pi(handle: JoinHandle<Result<Duration, String>>) -> Result<Duration, String> {
    handle.join().map_err(|_| "the π job panicked".to_string())?
}

/// The number of terms that take about `seconds` on CPU 0: from the fastest of three short
/// timed runs (the least disturbed by other load).
fn calibrate_pi(seconds: f64) -> Result<u64, String> {
    let probe = (seconds / 20.0).clamp(0.1, 0.5);
    let mut terms = 1u64 << 20;
    while join_pi(spawn_pi(terms))?.as_secs_f64() < probe {
        terms *= 2;
    }
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        best = best.min(join_pi(spawn_pi(terms))?.as_secs_f64());
    }
    Ok((terms as f64 / best * seconds).max(1.0) as u64)
}

/// One configuration of the main table.
#[derive(Debug, Clone, Serialize)]
struct Config {
    /// None: the raw backing file.
    cpus: Option<usize>,
    writers: usize,
    /// `off`, `boost`, ...; `raw` for the raw file.
    adaptive: String,
}

impl Config {
    fn label(&self) -> String {
        match self.cpus {
            Some(c) => format!("{c} CPU, {} writers, {}", self.writers, self.adaptive),
            None => format!("raw file, {} writers", self.writers),
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
struct Sample {
    run: usize,
    fio: FioResult,
    mb_per_s: f64,
    server: Option<ServerFigures>,
    context_switches: Option<ContextSwitches>,
    /// Time the cleaner spent boosted during the run: the boosts that ended, and the one
    /// still under way at the end, seconds.
    boosted_s: Option<f64>,
    /// Table 1: the π job's run time with the server, seconds.
    pi_seconds: Option<f64>,
    /// Table 1: fio reached its time limit before the π job ended.
    fio_ended_first: bool,
}

/// One line of a table: medians over runs.
#[derive(Debug, Clone, Serialize)]
struct Row {
    cpus: Option<usize>,
    writers: usize,
    adaptive: String,
    mb_per_s: Option<f64>,
    /// Median over runs of this row's bandwidth over the `off` row's (same CPUs and writers)
    /// in the same run.
    ratio_to_off: Option<f64>,
    /// This row's bandwidth over the same configuration's with the most CPUs (medians).
    ratio_to_most_cpus: Option<f64>,
    /// This row's bandwidth over the raw file's with the same writers (medians).
    ratio_to_raw: Option<f64>,
    /// Stalls per block written.
    stalls_per_write: Option<f64>,
    stalls: Option<f64>,
    /// Stalls per fio request.
    stalls_per_request: Option<f64>,
    context_switches: Option<f64>,
    boosts: Option<f64>,
    boosted_s: Option<f64>,
    blocks_cleaned: Option<f64>,
    /// Table 1: the π job's time with the server, and over its time alone.
    pi_seconds: Option<f64>,
    pi_ratio_to_alone: Option<f64>,
    /// Table 1: bandwidth over the main table's at 1 CPU (same writers and mode).
    ratio_to_without_pi: Option<f64>,
    /// The median run's context switches by thread and server figures.
    context_switches_by_thread: BTreeMap<String, u64>,
    server: Option<ServerFigures>,
    samples: Vec<Sample>,
    errors: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    plan: Plan,
    rows: Vec<Row>,
    /// The π job alone, seconds, each run.
    pi_alone_seconds: Vec<f64>,
    pi_terms: u64,
    table1: Vec<Row>,
}

/// Everything a measurement needs.
struct Bed<'a> {
    args: &'a Paper002Args,
    plan: &'a Plan,
    scratch: &'a Scratch,
}

impl Bed<'_> {
    fn fio_spec(&self, target: FioTarget, writers: usize, seconds: f64) -> FioSpec<'_> {
        FioSpec {
            fio: &self.args.fio,
            target,
            rw: "randwrite",
            bs: self.plan.bs,
            qd: self.plan.qd,
            jobs: writers,
            span: self.plan.span_bytes,
            seconds,
            out_dir: self.scratch.dir(),
            timeline: false,
        }
    }

    fn start_server(&self, cpus: usize, writers: usize, adaptive: &str) -> Result<Server, String> {
        let cpu_list = if cpus == 1 { "0".to_string() } else { format!("0-{}", cpus - 1) };
        let mut cleaner = vec![format!("adaptive={adaptive}")];
        cleaner.extend(self.plan.cleaner.iter().cloned());
        let (socket, control, log) = (
            self.scratch.path("pmcache.sock"),
            self.scratch.path("pmcache.ctl"),
            self.scratch.path("pmcache-serve.log"),
        );
        Server::start_pmcache(&PmcacheServe {
            medium: &self.scratch.medium,
            cache_bytes: self.plan.cache_bytes,
            backing: &self.scratch.backing,
            socket: &socket,
            control: &control,
            log: &log,
            cleaner: &cleaner,
            cpus: Some((&cpu_list, &self.args.taskset)),
            max_connections: writers.max(16),
            extra_args: &[],
        })
    }

    /// One main-table measurement.
    fn measure(&self, config: &Config) -> Result<Sample, String> {
        settle(&self.scratch.backing)?;
        let Some(cpus) = config.cpus else {
            let spec = self.fio_spec(
                FioTarget::File(self.scratch.backing.clone()),
                config.writers,
                self.plan.seconds,
            );
            let fio = FioRun::run(&spec)?;
            return Ok(sample(fio, None, None, None, false));
        };
        let server = self.start_server(cpus, config.writers, &config.adaptive)?;
        let before = ServerFigures::from_stats(&server.stats()?);
        let sampler = RunSampler::start(server.pid(), server.control());
        let spec = self.fio_spec(FioTarget::Nbd(server.uri()), config.writers, self.plan.seconds);
        let fio = FioRun::run(&spec);
        let sampled = sampler.finish();
        let fio = fio?;
        let after = ServerFigures::from_stats(&server.stats()?);
        server.stop()?;
        Ok(sample(fio, Some(after.since(&before)), Some(sampled), None, false))
    }

    /// One Table 1 measurement: the server on CPU 0 and the π job on CPU 0; fio runs until
    /// the π job ends.
    fn measure_with_pi(
        &self,
        writers: usize,
        adaptive: &str,
        terms: u64,
    ) -> Result<Sample, String> {
        settle(&self.scratch.backing)?;
        let server = self.start_server(1, writers, adaptive)?;
        let before = ServerFigures::from_stats(&server.stats()?);
        let sampler = RunSampler::start(server.pid(), server.control());
        // A limit far beyond the π job's expected time; fio is interrupted when it ends.
        let limit = self.plan.pi_seconds * 8.0 + 30.0;
        let mut fio = FioRun::spawn(&self.fio_spec(FioTarget::Nbd(server.uri()), writers, limit))?;
        let pi = spawn_pi(terms);
        let pi_time = join_pi(pi);
        let fio_ended_first = !fio.running();
        fio.interrupt();
        let fio = fio.wait();
        let sampled = sampler.finish();
        let (fio, pi_time) = (fio?, pi_time?);
        let after = ServerFigures::from_stats(&server.stats()?);
        server.stop()?;
        Ok(sample(
            fio,
            Some(after.since(&before)),
            Some(sampled),
            Some(pi_time.as_secs_f64()),
            fio_ended_first,
        ))
    }
}

fn sample(
    fio: FioResult,
    server: Option<ServerFigures>,
    sampled: Option<Sampled>,
    pi_seconds: Option<f64>,
    fio_ended_first: bool,
) -> Sample {
    let boosted_s = server.as_ref().map(|s| {
        let open = sampled.as_ref().filter(|_| s.boosted_now).map_or(0.0, |x| x.open_boost_s);
        s.boosted_ns as f64 / 1e9 + open
    });
    Sample {
        run: 0,
        mb_per_s: fio.bytes_per_s / 1e6,
        fio,
        server,
        context_switches: sampled.map(|x| x.switches),
        boosted_s,
        pi_seconds,
        fio_ended_first,
    }
}

/// Runs the experiment, prints the tables (or JSON) and writes the plot.
pub fn run_cli(args: &Paper002Args) -> Result<(), String> {
    let plan = make_plan(args)?;
    catch_interrupts();
    let fio_version = check_fio(&args.fio)?;
    tool_version(&args.taskset, "--version", "util-linux")?;
    let machine = Machine::probe(fio_version, None);
    let scratch = Scratch::new(&args.dir, &args.shm_dir, "paper002", args.keep_files)?;
    scratch.prefill(plan.span_bytes)?;
    let bed = Bed { args, plan: &plan, scratch: &scratch };

    let mut configs = Vec::new();
    for &cpus in &plan.cpus {
        for &writers in &plan.writers {
            for adaptive in &plan.adaptive {
                configs.push(Config { cpus: Some(cpus), writers, adaptive: adaptive.clone() });
            }
        }
    }
    if plan.raw {
        for &writers in &plan.writers {
            configs.push(Config { cpus: None, writers, adaptive: "raw".into() });
        }
    }
    if !args.json {
        print!("{}", header(&machine, &plan));
    }
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); configs.len()];
    let mut errors: Vec<Vec<String>> = vec![Vec::new(); configs.len()];
    let total = plan.runs * configs.len();
    let mut done = 0;
    for run in 0..plan.runs {
        // The order rotates between runs, so that drift in the machine's load does not
        // always hit the same configuration.
        for i in 0..configs.len() {
            let c = (i + run) % configs.len();
            done += 1;
            progress(&format!(
                "[{done}/{total}] run {}/{} {}",
                run + 1,
                plan.runs,
                configs[c].label()
            ));
            check_interrupted()?;
            match bed.measure(&configs[c]) {
                Ok(mut s) => {
                    s.run = run;
                    samples[c].push(s);
                }
                Err(e) => errors[c].push(format!("run {}: {e}", run + 1)),
            }
        }
    }
    progress("");
    let rows = main_rows(&configs, samples, errors);
    if !args.json {
        for row in &rows {
            print!("{}", main_row(row));
        }
    }

    let mut pi_alone = Vec::new();
    let mut pi_terms = 0;
    let mut table1 = Vec::new();
    if !plan.table1_writers.is_empty() {
        progress("calibrating the π job on CPU 0");
        pi_terms = calibrate_pi(plan.pi_seconds)?;
        let t1: Vec<(usize, String)> = plan
            .table1_writers
            .iter()
            .flat_map(|&w| plan.adaptive.iter().map(move |a| (w, a.clone())))
            .collect();
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); t1.len()];
        let mut errors: Vec<Vec<String>> = vec![Vec::new(); t1.len()];
        let total = plan.runs * (t1.len() + 1);
        let mut done = 0;
        for run in 0..plan.runs {
            done += 1;
            progress(&format!(
                "[{done}/{total}] Table 1 run {}/{}: the π job alone",
                run + 1,
                plan.runs
            ));
            pi_alone.push(join_pi(spawn_pi(pi_terms))?.as_secs_f64());
            for i in 0..t1.len() {
                let c = (i + run) % t1.len();
                let (writers, adaptive) = &t1[c];
                done += 1;
                progress(&format!(
                    "[{done}/{total}] Table 1 run {}/{}: {writers} writers, {adaptive}, with the π job",
                    run + 1,
                    plan.runs
                ));
                check_interrupted()?;
                match bed.measure_with_pi(*writers, adaptive, pi_terms) {
                    Ok(mut s) => {
                        s.run = run;
                        samples[c].push(s);
                    }
                    Err(e) => errors[c].push(format!("run {}: {e}", run + 1)),
                }
            }
        }
        progress("");
        table1 = table1_rows(&t1, samples, errors, &rows, &pi_alone);
        if !args.json {
            print!("{}", table1_header(pi_terms, &pi_alone));
            for row in &table1 {
                print!("{}", table1_row(row));
            }
        }
    }

    let report = Report { machine, plan, rows, pi_alone_seconds: pi_alone, pi_terms, table1 };
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, &json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else if let Some(note) =
        report.rows.iter().find_map(|r| r.server.as_ref().and_then(|s| s.priority_note.clone()))
    {
        println!("# note: the server could not change the cleaner's priority: {note}");
    }
    plot(&report, &args.plot)?;
    eprintln!("plot written to {}", args.plot.display());
    let failed = report.rows.iter().chain(&report.table1).filter(|r| r.mb_per_s.is_none()).count();
    if failed > 0 {
        return Err(format!("{failed} configurations measured nothing (see their errors)"));
    }
    Ok(())
}

/// Medians over a row's samples.
fn base_row(
    cpus: Option<usize>,
    writers: usize,
    adaptive: &str,
    mine: Vec<Sample>,
    errors: Vec<String>,
) -> Row {
    let server = |f: fn(&ServerFigures) -> f64| -> Option<f64> {
        median(mine.iter().filter_map(|s| s.server.as_ref().map(f)))
    };
    let bandwidth: Vec<f64> = mine.iter().map(|s| s.mb_per_s).collect();
    let median_run = median_index(&bandwidth).map(|i| &mine[i]);
    Row {
        cpus,
        writers,
        adaptive: adaptive.to_string(),
        mb_per_s: median(bandwidth.iter().copied()),
        ratio_to_off: None,
        ratio_to_most_cpus: None,
        ratio_to_raw: None,
        stalls_per_write: server(|s| s.stalls as f64 / s.writes.max(1) as f64),
        stalls: server(|s| s.stalls as f64),
        stalls_per_request: median(
            mine.iter().filter_map(|s| {
                s.server.as_ref().map(|f| f.stalls as f64 / s.fio.ios.max(1) as f64)
            }),
        ),
        context_switches: median(
            mine.iter().filter_map(|s| s.context_switches.as_ref().map(|c| c.total() as f64)),
        ),
        boosts: server(|s| s.boosts as f64),
        boosted_s: median(mine.iter().filter_map(|s| s.boosted_s)),
        blocks_cleaned: server(|s| s.blocks_cleaned as f64),
        pi_seconds: median(mine.iter().filter_map(|s| s.pi_seconds)),
        pi_ratio_to_alone: None,
        ratio_to_without_pi: None,
        context_switches_by_thread: median_run
            .and_then(|s| s.context_switches.as_ref().map(|c| c.by_thread.clone()))
            .unwrap_or_default(),
        server: median_run.and_then(|s| s.server.clone()),
        samples: mine,
        errors,
    }
}

fn main_rows(configs: &[Config], samples: Vec<Vec<Sample>>, errors: Vec<Vec<String>>) -> Vec<Row> {
    let mut rows: Vec<Row> = configs
        .iter()
        .zip(samples)
        .zip(errors)
        .map(|((c, s), e)| base_row(c.cpus, c.writers, &c.adaptive, s, e))
        .collect();
    let most_cpus = configs.iter().filter_map(|c| c.cpus).max();
    let snapshot = rows.clone();
    for row in rows.iter_mut().filter(|r| r.cpus.is_some()) {
        let find = |cpus: Option<usize>, adaptive: &str| {
            snapshot
                .iter()
                .find(|r| r.cpus == cpus && r.writers == row.writers && r.adaptive == adaptive)
        };
        if let Some(off) = find(row.cpus, "off") {
            let ratios = row.samples.iter().filter_map(|s| {
                off.samples.iter().find(|o| o.run == s.run).map(|o| s.mb_per_s / o.mb_per_s)
            });
            row.ratio_to_off = median(ratios);
        }
        if let Some(top) = find(most_cpus, &row.adaptive) {
            row.ratio_to_most_cpus = row.mb_per_s.zip(top.mb_per_s).map(|(a, b)| a / b);
        }
        if let Some(raw) = find(None, "raw") {
            row.ratio_to_raw = row.mb_per_s.zip(raw.mb_per_s).map(|(a, b)| a / b);
        }
    }
    rows
}

fn table1_rows(
    t1: &[(usize, String)],
    samples: Vec<Vec<Sample>>,
    errors: Vec<Vec<String>>,
    main: &[Row],
    pi_alone: &[f64],
) -> Vec<Row> {
    t1.iter()
        .zip(samples)
        .zip(errors)
        .map(|(((writers, adaptive), s), e)| {
            let mut row = base_row(Some(1), *writers, adaptive, s, e);
            // The π job's time over its time alone in the same run.
            row.pi_ratio_to_alone = median(
                row.samples.iter().filter_map(|s| Some(s.pi_seconds? / *pi_alone.get(s.run)?)),
            );
            let without = main
                .iter()
                .find(|r| r.cpus == Some(1) && r.writers == *writers && r.adaptive == *adaptive);
            row.ratio_to_without_pi =
                row.mb_per_s.zip(without.and_then(|r| r.mb_per_s)).map(|(a, b)| a / b);
            if row.samples.iter().any(|s| s.fio_ended_first) {
                row.errors.push("fio reached its time limit before the π job ended".into());
            }
            row
        })
        .collect()
}

fn header(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# pmcache bench paper002 — kernel {}, {} CPUs ({}), {}",
        m.kernel, m.cpus, m.cpu_model, m.fio
    );
    let extra = if plan.cleaner.is_empty() {
        String::new()
    } else {
        format!(", cleaner {}", plan.cleaner.join(" "))
    };
    let _ = writeln!(
        out,
        "# {} random writes over NBD (one connection per writer, QD{} each), span {}, cache {} \
         in /dev/shm{extra}; the server confined to CPUs 0..n-1 (taskset); {} s per run, \
         median of {} runs; ×off: over adaptive=off in the same run; ×{}cpu: over the same \
         with the most CPUs; stalls/write: writer stalls per block written; ctx sw: the server \
         threads' context switches during the run",
        human(plan.bs),
        plan.qd,
        human(plan.span_bytes),
        human(plan.cache_bytes),
        plan.seconds,
        plan.runs,
        plan.cpus.iter().max().copied().unwrap_or(1)
    );
    let _ = writeln!(
        out,
        "{:<4} {:>7} {:<9} {:>8} {:>6} {:>6} {:>6} {:>12} {:>9} {:>9} {:>7} {:>9} {:>10}",
        "cpus",
        "writers",
        "adaptive",
        "MB/s",
        "×off",
        format!("×{}cpu", plan.cpus.iter().max().copied().unwrap_or(1)),
        "×raw",
        "stalls/write",
        "stalls",
        "ctx sw",
        "boosts",
        "boosted s",
        "cleaned"
    );
    out
}

fn main_row(r: &Row) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<4} {:>7} {:<9} {:>8} {:>6} {:>6} {:>6} {:>12} {:>9} {:>9} {:>7} {:>9} {:>10}",
        r.cpus.map_or("-".into(), |c| c.to_string()),
        r.writers,
        r.adaptive,
        opt(r.mb_per_s, 1),
        opt(r.ratio_to_off, 2),
        opt(r.ratio_to_most_cpus, 2),
        opt(r.ratio_to_raw, 2),
        r.stalls_per_write.map_or("-".into(), |x| format!("{x:.2e}")),
        opt(r.stalls, 0),
        opt(r.context_switches, 0),
        opt(r.boosts, 0),
        opt(r.boosted_s, 2),
        opt(r.blocks_cleaned, 0)
    );
    if !r.context_switches_by_thread.is_empty() {
        let parts: Vec<String> =
            r.context_switches_by_thread.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(out, "     └ ctx sw by thread (median run): {}", parts.join(", "));
    }
    for e in &r.errors {
        let _ = writeln!(out, "     └ error: {e}");
    }
    out
}

fn table1_header(terms: u64, pi_alone: &[f64]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n# Table 1 — the server on CPU 0 with a CPU-bound job on CPU 0 (π from {terms} \
         Leibniz terms: {} s alone, median of {} runs); fio runs until the π job ends; \
         ×alone: bandwidth over the main table's 1-CPU row; π ×alone: over the π job alone in \
         the same run",
        opt(median(pi_alone.iter().copied()), 2),
        pi_alone.len()
    );
    let _ = writeln!(
        out,
        "{:>7} {:<9} {:>8} {:>7} {:>9} {:>8} {:>8} {:>12} {:>7} {:>9}",
        "writers",
        "adaptive",
        "MB/s",
        "×alone",
        "ctx sw",
        "π s",
        "π ×alone",
        "stalls/write",
        "boosts",
        "boosted s"
    );
    out
}

fn table1_row(r: &Row) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>7} {:<9} {:>8} {:>7} {:>9} {:>8} {:>8} {:>12} {:>7} {:>9}",
        r.writers,
        r.adaptive,
        opt(r.mb_per_s, 1),
        opt(r.ratio_to_without_pi, 2),
        opt(r.context_switches, 0),
        opt(r.pi_seconds, 2),
        opt(r.pi_ratio_to_alone, 2),
        r.stalls_per_write.map_or("-".into(), |x| format!("{x:.2e}")),
        opt(r.boosts, 0),
        opt(r.boosted_s, 2)
    );
    for e in &r.errors {
        let _ = writeln!(out, "        └ error: {e}");
    }
    out
}

/// A figure of a row, for a plot.
type Figure = fn(&Row) -> Option<f64>;

/// Six panels: bandwidth, context switches and stalls per write against writers (a line per
/// CPU count and mode, the raw file dashed), and Table 1's bandwidth, π time and context
/// switches as bars beside their references.
fn plot(report: &Report, path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1440, 1440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((3, 2));
    let err = |e: &dyn std::fmt::Display| e.to_string();

    // The lines: one per (cpus, adaptive).
    let mut lines: Vec<(Option<usize>, String)> = Vec::new();
    for r in &report.rows {
        let key = (r.cpus, r.adaptive.clone());
        if !lines.contains(&key) {
            lines.push(key);
        }
    }
    let max_writers = report.plan.writers.iter().copied().max().unwrap_or(1).max(2) as f64;
    let panels: [(&str, &str, Figure); 3] = [
        ("bandwidth, 4 MiB random writes over NBD", "MB/s", |r| r.mb_per_s),
        ("server context switches during the run", "context switches", |r| r.context_switches),
        ("writer stalls per block written", "stalls / write", |r| r.stalls_per_write),
    ];
    for (i, (title, y_desc, value)) in panels.iter().enumerate() {
        let y_max = report.rows.iter().filter_map(value).fold(0.0f64, f64::max).max(1e-9) * 1.15;
        let mut chart = ChartBuilder::on(&areas[i])
            .caption(*title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0.5f64..max_writers + 0.5, 0f64..y_max)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("writers (NBD connections)")
            .y_desc(*y_desc)
            .x_labels(max_writers as usize + 2)
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
            })
            .disable_x_mesh()
            .draw()
            .map_err(|e| err(&e))?;
        for (k, (cpus, adaptive)) in lines.iter().enumerate() {
            let mut points: Vec<(f64, f64)> = report
                .rows
                .iter()
                .filter(|r| r.cpus == *cpus && &r.adaptive == adaptive)
                .filter_map(|r| value(r).map(|y| (r.writers as f64, y)))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = if cpus.is_none() { BLACK.mix(0.5) } else { Palette99::pick(k).to_rgba() };
            let label = match cpus {
                Some(c) => format!("{c} CPU, {adaptive}"),
                None => "raw file".into(),
            };
            let width = if adaptive == "off" || cpus.is_none() { 1 } else { 2 };
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(width)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width))
                });
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
    }

    // Table 1: bars, one group per row.
    let t1 = &report.table1;
    let pi_alone = median(report.pi_alone_seconds.iter().copied());
    let bar_panels: [(&str, &str, Figure, Option<Figure>); 3] = [
        (
            "Table 1: bandwidth with the π job (light: without it)",
            "MB/s",
            |r| r.mb_per_s,
            Some(|r| r.mb_per_s.zip(r.ratio_to_without_pi).map(|(b, x)| b / x)),
        ),
        ("Table 1: the π job's time (line: alone)", "seconds", |r| r.pi_seconds, None),
        ("Table 1: server context switches", "context switches", |r| r.context_switches, None),
    ];
    for (i, (title, y_desc, value, reference)) in bar_panels.iter().enumerate() {
        let area = &areas[3 + i];
        if t1.is_empty() {
            continue;
        }
        let mut y_max = t1.iter().filter_map(value).fold(0.0f64, f64::max);
        if let Some(reference) = reference {
            y_max = t1.iter().filter_map(reference).fold(y_max, f64::max);
        }
        if i == 1 {
            y_max = y_max.max(pi_alone.unwrap_or(0.0));
        }
        let y_max = y_max.max(1e-9) * 1.15;
        let n = t1.len();
        let mut chart = ChartBuilder::on(area)
            .caption(*title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..y_max)
            .map_err(|e| err(&e))?;
        let names: Vec<String> =
            t1.iter().map(|r| format!("{} w, {}", r.writers, r.adaptive)).collect();
        chart
            .configure_mesh()
            .y_desc(*y_desc)
            .x_labels(n)
            .x_label_formatter(&|x| {
                let k = x.round();
                if (x - k).abs() < 1e-6 && k >= 0.0 {
                    names.get(k as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .disable_x_mesh()
            .draw()
            .map_err(|e| err(&e))?;
        for (k, row) in t1.iter().enumerate() {
            let x = k as f64;
            let color = Palette99::pick(k).to_rgba();
            if let Some(reference) = reference.and_then(|f| f(row)) {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x - 0.4, 0.0), (x, reference)],
                        color.mix(0.3).filled(),
                    )))
                    .map_err(|e| err(&e))?;
            }
            if let Some(y) = value(row) {
                let left = if reference.is_some() { x } else { x - 0.3 };
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(left, 0.0), (x + 0.3, y)],
                        color.filled(),
                    )))
                    .map_err(|e| err(&e))?;
            }
        }
        if i == 1
            && let Some(alone) = pi_alone
        {
            chart
                .draw_series(LineSeries::new(
                    vec![(-0.5, alone), (n as f64 - 0.5, alone)],
                    BLACK.stroke_width(2),
                ))
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leibniz_converges_to_pi() {
        assert!((leibniz_pi(1_000_000) - std::f64::consts::PI).abs() < 1e-5);
    }

    #[test]
    fn this_process_has_readable_context_switch_counters() {
        let tasks = read_tasks(std::process::id());
        assert!(!tasks.is_empty());
        assert!(tasks.values().all(|t| !t.name.is_empty()));
    }
}
