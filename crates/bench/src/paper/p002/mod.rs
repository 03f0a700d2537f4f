//! Paper 002's experiment (`pmcache bench paper 002-fig2` draws it on the paper's axes; the
//! hidden `pmcache bench paper002` prints its own tables and plot) (adaptive priority boosting of a host-level
//! FTL's writer daemon) with pmcache in pblk's place.
//!
//! The write-back buffer is the cache and the writer daemon is pmcache's cleaner. fio writes
//! 4 MiB random requests over NBD (one connection per writer, `numjobs`) into a cache smaller
//! than the span, so the cleaner must keep writing back for writers to find slots. The real
//! server (pmcache served in this process through `pmcache_serve`, as `pmcache serve` runs it)
//! and fio (the writers) are confined to the same CPUs, CPU 0 or CPUs 0–1, as the paper's
//! writers and writer daemon share the guest's vCPUs; the cleaner runs with adaptive boosting
//! off (`--cleaner adaptive=off`: fixed priority) or on (`adaptive=boost`: its thread's nice
//! value is lowered while writers stall or dirty data is above the high watermark). Each row
//! gives the median over `--runs` runs of the bandwidth (MB/s), the failed insertions per block
//! written (writes that could not take a slot at once: stalls, which found no free or clean
//! slot and waited for the cleaner, and paced writes that waited for their turn; from the
//! server's statistics), the server threads' voluntary + involuntary context switches over
//! the fio run (summed over `/proc/<pid>/task/*/status`, sampled every 100 ms so threads that
//! end with their connection are counted), the cleaner's boosts and the time it spent
//! boosted (the boosts that ended, from the server's statistics, and the one under way at the
//! end, seen by polling the control socket every 500 ms). Beside them: boost's bandwidth over
//! off's in the same run, each configuration's over the same one with the most CPUs, and the
//! raw backing file's bandwidth (the best of fio's psync, libaio and io_uring,
//! each measured in the run, `O_DIRECT`, the same jobs), the ceiling once the cache is full.
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
use std::path::PathBuf;

use pmcache_frontend::units::{human, parse_nonzero_size};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run, check_measured};
use crate::harness::fio::{EngineRate, FioResult};
use crate::harness::machine::{self, Machine};
use crate::harness::output::progress;
use crate::harness::process::{catch_interrupts, check_interrupted};
use crate::harness::scratch::ScratchArgs;
use crate::harness::servers::ServerFigures;

mod bed;
mod cpu;
mod figures;
mod report;
mod rows;

use bed::Bed;
pub use cpu::{ContextSwitches, CounterTick};
use cpu::{calibrate_pi, join_pi, spawn_pi};
use report::{header, main_row, plot, table1_header, table1_row};
use rows::{main_rows, table1_rows};

pub(super) use figures::run as figures;

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
    /// boost-pid, or boost-cleaner-nice (the boost by the cleaner's nice value alone:
    /// `adaptive=boost nice_boost=-10 nice_writers=0`).
    #[arg(long, value_delimiter = ',', default_value = "off,boost,boost-cleaner-nice")]
    pub adaptive: Vec<String>,
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
    /// Where to write the SVG plot.
    #[arg(long, default_value = "pmcache-bench-paper002.svg")]
    pub plot: PathBuf,
    /// Keep the backing file and the scratch directory (fio outputs, server logs).
    #[arg(long)]
    pub keep_files: bool,
    /// Where the files go, and fio.
    #[command(flatten)]
    pub scratch: ScratchArgs,
}

/// The resolved plan of one invocation.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// CPU counts the server is confined to.
    pub cpus: Vec<usize>,
    /// Writer counts (fio jobs, one NBD connection each).
    pub writers: Vec<usize>,
    /// The cleaner's adaptive modes (`off`, `boost`, ...).
    pub adaptive: Vec<String>,
    /// Seconds per measurement.
    pub seconds: f64,
    /// Runs per configuration.
    pub runs: usize,
    /// Span of the random offsets, the backing file's size, bytes.
    pub span_bytes: u64,
    /// The cache medium's size, bytes.
    pub cache_bytes: u64,
    /// Request size, bytes.
    pub bs: u64,
    /// Requests in flight per writer.
    pub qd: usize,
    /// Further `--cleaner` settings of the server.
    pub cleaner: Vec<String>,
    /// Whether the raw backing file has rows of its own.
    pub raw: bool,
    /// Whether the contention-free reference has rows of its own: the writers and the
    /// server's connections on CPU 0, the cleaner alone on CPU 1 (boost off), the paper's
    /// reference point for Fig 4 (needs 2 CPUs).
    pub reference: bool,
    /// Writer counts of Table 1.
    pub table1_writers: Vec<usize>,
    /// The π job's length alone, seconds.
    pub pi_seconds: f64,
}

fn make_plan(args: &Paper002Args, run: &Run) -> Result<Plan, String> {
    let available = machine::cpus();
    let mut plan = Plan {
        cpus: args.cpus.clone(),
        writers: args.writers.clone(),
        adaptive: args.adaptive.clone(),
        seconds: run.seconds,
        runs: run.runs,
        span_bytes: args.span,
        cache_bytes: args.cache_size,
        bs: args.bs,
        qd: args.qd,
        cleaner: args.cleaner.clone(),
        raw: !args.no_raw,
        reference: available >= 2,
        table1_writers: if args.no_table1 { Vec::new() } else { args.table1_writers.clone() },
        pi_seconds: args.pi_seconds.unwrap_or(run.seconds),
    };
    if run.quick {
        plan.cpus = vec![1];
        plan.writers = vec![2];
        plan.span_bytes = 256 << 20;
        plan.cache_bytes = 32 << 20;
        if !args.no_table1 {
            plan.table1_writers = vec![2];
        }
        plan.pi_seconds = 2.0;
    }
    if plan.cpus.iter().chain(&plan.writers).chain(&plan.table1_writers).any(|&n| n == 0)
        || plan.qd == 0
        || plan.pi_seconds <= 0.0
    {
        return Err(
            "--cpus, --writers, --table1-writers, --qd and --pi-seconds must be positive".into()
        );
    }
    if let Some(&n) = plan.cpus.iter().find(|&&n| n > available) {
        return Err(format!("--cpus {n}: this machine has {available} CPUs"));
    }
    if let Some(&n) = plan.writers.iter().chain(&plan.table1_writers).find(|&&n| n > 64) {
        return Err(format!("{n} writers: at most 64"));
    }
    for mode in &plan.adaptive {
        if !["off", "boost", "boost-pid", CLEANER_NICE].contains(&mode.as_str()) {
            return Err(format!(
                "--adaptive {mode:?}: expected off, boost, boost-pid or boost-cleaner-nice"
            ));
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

/// One configuration of the main table.
#[derive(Debug, Clone, Serialize)]
struct Config {
    /// None: the raw backing file.
    cpus: Option<usize>,
    writers: usize,
    /// `off`, `boost`, ...; `raw` for the raw file.
    adaptive: String,
}

/// The adaptive label of the rows whose cleaner is boosted by its own nice value alone: -10
/// while boosted, the writers' unchanged (`--cleaner adaptive=boost nice_boost=-10
/// nice_writers=0`). `boost` is the default boost, by the writers yielding (nice 10).
pub const CLEANER_NICE: &str = "boost-cleaner-nice";

/// The adaptive label of the contention-free reference's rows ([`Plan::reference`]).
pub const CLEANER_APART: &str = "cleaner-apart";

impl Config {
    fn label(&self) -> String {
        if self.adaptive == CLEANER_APART {
            return format!("CPU 0, {} writers, the cleaner alone on CPU 1", self.writers);
        }
        match self.cpus {
            Some(c) => format!("{c} CPU, {} writers, {}", self.writers, self.adaptive),
            None => format!("raw file, {} writers", self.writers),
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The run it belongs to, from 0.
    pub run: usize,
    /// What fio measured.
    pub fio: FioResult,
    /// Bandwidth, MB/s (10^6 bytes).
    pub mb_per_s: f64,
    /// The server's figures over the measurement (none for the raw file).
    pub server: Option<ServerFigures>,
    /// The server's threads' context switches over the measurement.
    pub context_switches: Option<ContextSwitches>,
    /// The raw file only: every fio engine's IOPS; the sample is the fastest's.
    pub raw_engines: Vec<EngineRate>,
    /// The server's write and stall counters every 500 ms from just before fio started (the
    /// paper's Fig 3 is their course over time).
    pub counters: Vec<CounterTick>,
    /// Time the cleaner spent boosted during the run: the boosts that ended, and the one
    /// still under way at the end, seconds.
    pub boosted_s: Option<f64>,
    /// Table 1: the π job's run time with the server, seconds.
    pub pi_seconds: Option<f64>,
    /// Table 1: fio reached its time limit before the π job ended.
    pub fio_ended_first: bool,
}

/// One line of a table: medians over runs.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// CPUs the server was confined to; `None` for the raw file.
    pub cpus: Option<usize>,
    /// Writers (fio jobs).
    pub writers: usize,
    /// The cleaner's adaptive mode; `raw` for the raw file.
    pub adaptive: String,
    /// Bandwidth, MB/s.
    pub mb_per_s: Option<f64>,
    /// Median over runs of this row's bandwidth over the `off` row's (same CPUs and writers)
    /// in the same run.
    pub ratio_to_off: Option<f64>,
    /// This row's bandwidth over the same configuration's with the most CPUs (medians).
    pub ratio_to_most_cpus: Option<f64>,
    /// This row's bandwidth over the raw file's with the same writers (medians).
    pub ratio_to_raw: Option<f64>,
    /// Stalls per block written.
    pub failed_per_write: Option<f64>,
    /// Writer stalls.
    pub failed_insertions: Option<f64>,
    /// Stalls per fio request.
    pub failed_per_request: Option<f64>,
    /// The server's context switches.
    pub context_switches: Option<f64>,
    /// Times the cleaner was boosted.
    pub boosts: Option<f64>,
    /// Seconds the cleaner spent boosted.
    pub boosted_s: Option<f64>,
    /// Blocks the cleaner wrote back.
    pub blocks_cleaned: Option<f64>,
    /// Table 1: the π job's time with the server, seconds.
    pub pi_seconds: Option<f64>,
    /// Table 1: the π job's time with the server over its time alone.
    pub pi_ratio_to_alone: Option<f64>,
    /// Table 1: bandwidth over the main table's at 1 CPU (same writers and mode).
    pub ratio_to_without_pi: Option<f64>,
    /// The median run's context switches by thread.
    pub context_switches_by_thread: BTreeMap<String, u64>,
    /// The median run's server figures.
    pub server: Option<ServerFigures>,
    /// The raw file's median run: every fio engine's IOPS (the row is the fastest's).
    pub raw_engines: Vec<EngineRate>,
    /// Every run's measurement.
    pub samples: Vec<Sample>,
    /// What went wrong, by run.
    pub errors: Vec<String>,
}

/// What `bench paper002` measured: the JSON report.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The machine the figures come from.
    pub machine: Machine,
    /// What was measured.
    pub plan: Plan,
    /// The main table's rows.
    pub rows: Vec<Row>,
    /// The π job alone, seconds, each run.
    pub pi_alone_seconds: Vec<f64>,
    /// Terms of the π job (calibrated to `plan.pi_seconds` alone).
    pub pi_terms: u64,
    /// Table 1's rows: the server on CPU 0 beside the π job.
    pub table1: Vec<Row>,
}

impl Experiment for Paper002Args {
    const NAME: &'static str = "paper002";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(3), seconds: Some(30.0), quick_runs: 1, quick_seconds: 2.0 };
    type Report = Report;

    /// Measures the main table and Table 1, printing the tables as they come unless
    /// `run.json`.
    fn run(&self, run: &Run) -> Result<Report, String> {
        let tables = !run.json;
        let plan = make_plan(self, run)?;
        catch_interrupts();
        let (fio_version, scratch) = self.scratch.prepare(Self::NAME, self.keep_files)?;
        let machine = Machine::probe(fio_version, None);
        scratch.prefill(plan.span_bytes)?;
        let bed = Bed { args: self, plan: &plan, scratch: &scratch };

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
        if plan.reference {
            for &writers in &plan.writers {
                let adaptive = CLEANER_APART.into();
                configs.push(Config { cpus: Some(1), writers, adaptive });
            }
        }
        if tables {
            print!("{}", header(&machine, &plan));
        }
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); configs.len()];
        let mut errors: Vec<Vec<String>> = vec![Vec::new(); configs.len()];
        let total = plan.runs * configs.len();
        let mut done = 0;
        for turn in 0..plan.runs {
            // The order rotates between runs, so that drift in the machine's load does not
            // always hit the same configuration.
            for i in 0..configs.len() {
                let c = (i + turn) % configs.len();
                done += 1;
                progress(&format!(
                    "[{done}/{total}] run {}/{} {}",
                    turn + 1,
                    plan.runs,
                    configs[c].label()
                ));
                check_interrupted()?;
                match bed.measure(&configs[c], turn) {
                    Ok(mut s) => {
                        s.run = turn;
                        samples[c].push(s);
                    }
                    Err(e) => errors[c].push(format!("run {}: {e}", turn + 1)),
                }
            }
        }
        progress("");
        let rows = main_rows(&configs, samples, errors);
        if tables {
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
            for turn in 0..plan.runs {
                done += 1;
                progress(&format!(
                    "[{done}/{total}] Table 1 run {}/{}: the π job alone",
                    turn + 1,
                    plan.runs
                ));
                pi_alone.push(join_pi(spawn_pi(pi_terms))?.as_secs_f64());
                for i in 0..t1.len() {
                    let c = (i + turn) % t1.len();
                    let (writers, adaptive) = &t1[c];
                    done += 1;
                    progress(&format!(
                        "[{done}/{total}] Table 1 run {}/{}: {writers} writers, {adaptive}, with the π job",
                        turn + 1,
                        plan.runs
                    ));
                    check_interrupted()?;
                    match bed.measure_with_pi(*writers, adaptive, pi_terms) {
                        Ok(mut s) => {
                            s.run = turn;
                            samples[c].push(s);
                        }
                        Err(e) => errors[c].push(format!("run {}: {e}", turn + 1)),
                    }
                }
            }
            progress("");
            table1 = table1_rows(&t1, samples, errors, &rows, &pi_alone);
            if tables {
                print!("{}", table1_header(pi_terms, &pi_alone));
                for row in &table1 {
                    print!("{}", table1_row(row));
                }
            }
        }

        Ok(Report { machine, plan, rows, pi_alone_seconds: pi_alone, pi_terms, table1 })
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        let note = report.rows.iter().find_map(|r| r.server.as_ref()?.priority_note.clone());
        note.map_or_else(String::new, |note| {
            format!("# note: the server could not change the cleaner's priority: {note}\n")
        })
    }

    fn finish(&self, report: &Report, _run: &Run) -> Result<(), String> {
        plot(report, &self.plot)?;
        eprintln!("plot written to {}", self.plot.display());
        check_measured(report.rows.iter().chain(&report.table1).map(|r| r.mb_per_s))
    }
}
