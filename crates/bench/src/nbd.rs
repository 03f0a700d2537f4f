//! `pmcache bench nbd`: pmcache served over NBD, driven by fio's nbd engine, beside `nbdkit
//! file` serving the same backing file and fio on the raw backing file, in the same run.
//!
//! Each measurement spawns the real server: this executable's `pmcache serve` on a fresh
//! cache medium in `/dev/shm` (emulated PM) in front of a backing file on the root disk,
//! listening on a unix socket. Once its control socket answers, fio runs with
//! `--ioengine=nbd`; the server's statistics are fetched over the control socket, then the
//! server is stopped with SIGTERM and waited for (on a medium in /dev/shm, a volatile one,
//! pmcache writes every dirty block back before it exits, so the disk is quiet when the next
//! measurement starts). The baselines: `nbdkit file` on the same backing file (by default
//! `cache=none fadvise=random`, so its reads reach the disk as pmcache's misses do and the
//! page cache does not absorb its writes), the same fio job; `nbdkit memory`, a RAM disk
//! behind the same socket and client, the NBD frontend's own ceiling (no server can be faster
//! through one socket per connection); and fio on the raw backing file
//! (`O_DIRECT`, the same queue depth; the best of fio's psync, libaio and io_uring, each
//! measured in the run). The backing file is written in full first
//! (real data: the file system allocates nothing during the measurement), and before each
//! measurement it is synced and dropped from the page cache.
//!
//! Per configuration the table gives the median over `--runs` runs of IOPS, the IOPS ratio to
//! nbdkit (median of the per-run ratios), fio's latency percentiles (`lat`: submission to
//! completion; p50, p99, p99.9, max) and p99.9's ratio to nbdkit's, and the IOPS once as much
//! data as the cache holds has been transferred (for writes: the cache is full from then on):
//! the lowest 1-second window and the mean of the windows from there on, from fio's
//! per-second IOPS log, and that mean's ratio to nbdkit's. Under each pmcache row, the
//! server's statistics of the median run: dirty share at the end, blocks written back (and
//! by the cleaner), writer stalls, inline fallbacks, evictions, read hits.

use std::fmt::Write as _;

use pmcache_frontend::units::{human, parse_nonzero_size};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run, check_measured};
use crate::harness::fio::{
    EngineRate, FioResult, FioRun, FioSpec, FioTarget, RAW_ENGINES, Steady, best_of_engines,
    engines_text, steady,
};
use crate::harness::machine::{Machine, tool_version};
use crate::harness::output::{opt, progress};
use crate::harness::process::{catch_interrupts, check_interrupted};
use crate::harness::scratch::{Scratch, ScratchArgs, settle};
use crate::harness::servers::{ServeOptions, Server, ServerFigures};
use crate::harness::stats::{median, median_index};

/// Bytes of one request of `bench nbd`.
const BLOCK_BYTES: u64 = 4096;

/// Arguments of `pmcache bench nbd`.
#[derive(clap::Args, Debug, Clone)]
pub struct NbdArgs {
    /// Workloads, comma-separated: randwrite, randread.
    #[arg(long, value_delimiter = ',', default_value = "randwrite,randread")]
    pub rw: Vec<String>,
    /// Span of the random offsets, the size of the backing file (e.g. 2G).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "2G")]
    pub span: u64,
    /// Size of pmcache's cache medium (e.g. 256M).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "256M")]
    pub cache_size: u64,
    /// Requests in flight per connection (fio iodepth).
    #[arg(long, default_value_t = 16)]
    pub qd: usize,
    /// Connections (fio jobs, each with `--qd` in flight); e.g. `--jobs 2 --qd 1` is Open
    /// CAS's measured shape.
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// A further pmcache row with these cleaner settings, comma-separated KEY=VALUE as
    /// `pmcache serve --cleaner` takes them (repeatable; e.g. `order=none`: no cleaner, writers
    /// write back inline).
    #[arg(long = "cleaner", value_name = "KEY=VALUE[,KEY=VALUE]")]
    pub cleaner: Vec<String>,
    /// nbdkit file plugin's page-cache mode: none (reads reach the disk, writes are pushed
    /// out as they come) or default (the page cache absorbs both).
    #[arg(long, default_value = "none")]
    pub nbdkit_cache: String,
    /// Keep the backing file and the scratch directory (fio outputs, server logs).
    #[arg(long)]
    pub keep_files: bool,
    /// Where the files go, and fio.
    #[command(flatten)]
    pub scratch: ScratchArgs,
    /// The nbdkit binary.
    #[arg(long, default_value = "nbdkit")]
    pub nbdkit: String,
}

/// The resolved plan of one invocation.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    rw: Vec<String>,
    seconds: f64,
    span_bytes: u64,
    cache_bytes: u64,
    qd: usize,
    jobs: usize,
    runs: usize,
    nbdkit_cache: String,
    configs: Vec<Config>,
}

/// What serves the fio job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Pmcache,
    Nbdkit,
    /// `nbdkit memory`: the NBD frontend's ceiling (no storage behind it).
    NbdkitMemory,
    Raw,
}

#[derive(Debug, Clone, Serialize)]
struct Config {
    label: String,
    kind: Kind,
    /// `--cleaner` settings of a pmcache row.
    cleaner: Vec<String>,
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
struct RunSample {
    run: usize,
    fio: FioResult,
    steady: Option<Steady>,
    server: Option<ServerFigures>,
    /// The raw file only: every fio engine's IOPS; `fio` is the fastest's.
    raw_engines: Vec<EngineRate>,
}

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
struct Row {
    rw: String,
    config: String,
    kind: Kind,
    cleaner: Vec<String>,
    iops: Option<f64>,
    /// Median over runs of iops / nbdkit's iops in the same run.
    ratio_to_nbdkit: Option<f64>,
    /// The per-run ratios the median came from.
    ratio_to_nbdkit_runs: Vec<f64>,
    lat_us_p50: Option<f64>,
    lat_us_p99: Option<f64>,
    lat_us_p999: Option<f64>,
    lat_us_max: Option<f64>,
    /// Median over runs of p99.9 / nbdkit's p99.9 in the same run (below 1: lower).
    p999_ratio_to_nbdkit: Option<f64>,
    /// Median over runs of iops / `nbdkit memory`'s in the same run: the share of the NBD
    /// frontend's ceiling.
    ratio_to_memory: Option<f64>,
    /// Median over runs of p99 / `nbdkit memory`'s p99 in the same run.
    p99_ratio_to_memory: Option<f64>,
    /// IOPS once a cache's worth of data has moved: lowest 1-s window and mean (medians).
    steady_min_iops: Option<f64>,
    steady_mean_iops: Option<f64>,
    steady_from_s: Option<usize>,
    /// Median over runs of steady mean / nbdkit's steady mean in the same run.
    steady_ratio_to_nbdkit: Option<f64>,
    /// The server's figures in the run with the median IOPS.
    server: Option<ServerFigures>,
    /// The raw file's run with the median IOPS: every fio engine's IOPS.
    raw_engines: Vec<EngineRate>,
    samples: Vec<RunSample>,
    errors: Vec<String>,
}

/// What `bench nbd` found.
#[derive(Debug, Serialize)]
pub struct Report {
    machine: Machine,
    plan: Plan,
    rows: Vec<Row>,
}

fn make_plan(args: &NbdArgs, run: &Run) -> Result<Plan, String> {
    for rw in &args.rw {
        if rw != "randread" && rw != "randwrite" {
            return Err(format!("unknown workload {rw:?}; expected randwrite or randread"));
        }
    }
    if args.qd == 0 || args.jobs == 0 {
        return Err("--qd and --jobs must be positive".into());
    }
    if args.nbdkit_cache != "none" && args.nbdkit_cache != "default" {
        return Err(format!("--nbdkit-cache {:?}: expected none or default", args.nbdkit_cache));
    }
    let mut configs =
        vec![Config { label: "pmcache".into(), kind: Kind::Pmcache, cleaner: Vec::new() }];
    for settings in &args.cleaner {
        let pairs: Vec<String> = settings
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if pairs.is_empty() || pairs.iter().any(|p| !p.contains('=')) {
            return Err(format!("--cleaner {settings:?}: expected KEY=VALUE[,KEY=VALUE]"));
        }
        configs.push(Config {
            label: format!("pmcache {}", pairs.join(",")),
            kind: Kind::Pmcache,
            cleaner: pairs,
        });
    }
    configs.push(Config { label: "nbdkit file".into(), kind: Kind::Nbdkit, cleaner: Vec::new() });
    configs.push(Config {
        label: "nbdkit memory".into(),
        kind: Kind::NbdkitMemory,
        cleaner: Vec::new(),
    });
    configs.push(Config { label: "raw file".into(), kind: Kind::Raw, cleaner: Vec::new() });
    let (seconds, runs) = (run.seconds, run.runs);
    let (span_bytes, cache_bytes) =
        if run.quick { (256 << 20, 32 << 20) } else { (args.span, args.cache_size) };
    if !span_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err("--span must be a multiple of 4 KiB".into());
    }
    Ok(Plan {
        rw: args.rw.clone(),
        seconds,
        span_bytes,
        cache_bytes,
        qd: args.qd,
        jobs: args.jobs,
        runs,
        nbdkit_cache: args.nbdkit_cache.clone(),
        configs,
    })
}

impl Experiment for NbdArgs {
    const NAME: &'static str = "nbd";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(3), seconds: Some(60.0), quick_runs: 1, quick_seconds: 4.0 };
    type Report = Report;

    /// Runs every configuration, printing the table's rows as they come unless `run.json`.
    fn run(&self, run: &Run) -> Result<Report, String> {
        let plan = make_plan(self, run)?;
        catch_interrupts();
        let (fio_version, scratch) = self.scratch.prepare(Self::NAME, self.keep_files)?;
        let nbdkit_version = tool_version(&self.nbdkit, "--version", "nbdkit")?;
        let machine = Machine::probe(fio_version, Some(nbdkit_version));
        scratch.prefill(plan.span_bytes)?;
        if !run.json {
            print!("{}", header(&machine, &plan));
        }
        let total = plan.rw.len() * plan.runs * plan.configs.len();
        let mut done = 0;
        let mut rows = Vec::new();
        for rw in &plan.rw {
            // samples[config] over runs, each with its run index.
            let mut samples: Vec<Vec<RunSample>> = vec![Vec::new(); plan.configs.len()];
            let mut errors: Vec<Vec<String>> = vec![Vec::new(); plan.configs.len()];
            for turn in 0..plan.runs {
                // The order rotates between runs, so that drift in the machine's load does not
                // always hit the same configuration.
                let n = plan.configs.len();
                for i in 0..n {
                    let c = (i + turn) % n;
                    let config = &plan.configs[c];
                    done += 1;
                    progress(&format!(
                        "[{done}/{total}] {rw} run {}/{} {}",
                        turn + 1,
                        plan.runs,
                        config.label
                    ));
                    check_interrupted()?;
                    match measure(self, &plan, &scratch, config, rw, turn) {
                        Ok(mut sample) => {
                            sample.run = turn;
                            samples[c].push(sample);
                        }
                        Err(e) => errors[c].push(format!("run {}: {e}", turn + 1)),
                    }
                }
            }
            progress("");
            let rw_rows = aggregate(&plan, rw, samples, errors);
            if !run.json {
                for row in &rw_rows {
                    print!("{}", table_row(row));
                }
                println!();
            }
            rows.extend(rw_rows);
        }
        Ok(Report { machine, plan, rows })
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        summary(report)
    }

    fn finish(&self, report: &Report, _run: &Run) -> Result<(), String> {
        check_measured(report.rows.iter().map(|r| r.iops))
    }
}

fn measure(
    args: &NbdArgs,
    plan: &Plan,
    scratch: &Scratch,
    config: &Config,
    rw: &str,
    run: usize,
) -> Result<RunSample, String> {
    settle(&scratch.backing)?;
    let fio = |target| FioSpec {
        fio: &args.scratch.fio,
        target,
        rw,
        bs: BLOCK_BYTES,
        qd: plan.qd,
        jobs: plan.jobs,
        span: plan.span_bytes,
        seconds: plan.seconds,
        out_dir: scratch.dir(),
        timeline: true,
        cpus: None,
    };
    let (result, server) = match config.kind {
        Kind::Pmcache => {
            let server = scratch.serve(
                plan.cache_bytes,
                16,
                &config.cleaner,
                None,
                ServeOptions::default(),
            )?;
            let result = FioRun::run(&fio(FioTarget::Nbd(server.uri())))?;
            let stats = server.stats()?;
            server.stop()?;
            (result, Some(ServerFigures::from_stats(&stats)))
        }
        Kind::Nbdkit => {
            let socket = scratch.path("nbdkit.sock");
            let log = scratch.path("nbdkit.log");
            let server = Server::start_nbdkit(
                &args.nbdkit,
                &scratch.backing,
                &socket,
                &log,
                &plan.nbdkit_cache,
            )?;
            let result = FioRun::run(&fio(FioTarget::Nbd(server.uri())))?;
            server.stop()?;
            (result, None)
        }
        Kind::NbdkitMemory => {
            let socket = scratch.path("nbdkit-memory.sock");
            let log = scratch.path("nbdkit-memory.log");
            let server = Server::start_nbdkit_memory(&args.nbdkit, plan.span_bytes, &socket, &log)?;
            let result = FioRun::run(&fio(FioTarget::Nbd(server.uri())))?;
            server.stop()?;
            (result, None)
        }
        Kind::Raw => {
            // The disk's best: each of fio's engines in turn, the first turning with the run.
            let (result, engines) = best_of_engines(
                &RAW_ENGINES,
                run,
                |engine| {
                    settle(&scratch.backing)?;
                    let path = scratch.backing.clone();
                    FioRun::run(&fio(FioTarget::File { path, engine }))
                },
                |r| r.iops,
            )?;
            let steady = steady(&result.timeline_iops, BLOCK_BYTES, plan.cache_bytes);
            return Ok(RunSample { run, fio: result, steady, server: None, raw_engines: engines });
        }
    };
    let steady = steady(&result.timeline_iops, BLOCK_BYTES, plan.cache_bytes);
    Ok(RunSample { run, fio: result, steady, server, raw_engines: Vec::new() })
}

fn aggregate(
    plan: &Plan,
    rw: &str,
    samples: Vec<Vec<RunSample>>,
    errors: Vec<Vec<String>>,
) -> Vec<Row> {
    let of_kind = |kind: Kind| plan.configs.iter().position(|c| c.kind == kind);
    let (nbdkit, memory) = (of_kind(Kind::Nbdkit), of_kind(Kind::NbdkitMemory));
    let baseline = |run: usize| -> Option<&RunSample> {
        nbdkit.and_then(|b| samples[b].iter().find(|s| s.run == run))
    };
    let ceiling = |run: usize| -> Option<&RunSample> {
        memory.and_then(|b| samples[b].iter().find(|s| s.run == run))
    };
    let mut rows = Vec::new();
    for (c, config) in plan.configs.iter().enumerate() {
        let mine = &samples[c];
        let per_run = |f: &dyn Fn(&RunSample, &RunSample) -> Option<f64>| -> Vec<f64> {
            mine.iter().filter_map(|s| baseline(s.run).and_then(|b| f(s, b))).collect()
        };
        let ratios = per_run(&|s, b| Some(s.fio.iops / b.fio.iops));
        let p999_ratios = per_run(&|s, b| Some(s.fio.lat_ns_p999 / b.fio.lat_ns_p999));
        let to_ceiling = |f: &dyn Fn(&RunSample, &RunSample) -> f64| -> Option<f64> {
            median(mine.iter().filter_map(|s| ceiling(s.run).map(|m| f(s, m))))
        };
        let ratio_to_memory = to_ceiling(&|s, m| s.fio.iops / m.fio.iops);
        let p99_ratio_to_memory = to_ceiling(&|s, m| s.fio.lat_ns_p99 / m.fio.lat_ns_p99);
        let steady_ratios = per_run(&|s, b| {
            Some(s.steady?.mean_iops / b.steady?.mean_iops).filter(|r| r.is_finite())
        });
        let us = |f: fn(&FioResult) -> f64| median(mine.iter().map(|s| f(&s.fio) / 1000.0));
        let iops: Vec<f64> = mine.iter().map(|s| s.fio.iops).collect();
        let median_run = median_index(&iops);
        rows.push(Row {
            rw: rw.to_string(),
            config: config.label.clone(),
            kind: config.kind,
            cleaner: config.cleaner.clone(),
            iops: median(iops.iter().copied()),
            ratio_to_nbdkit: median(ratios.iter().copied()),
            ratio_to_nbdkit_runs: ratios,
            lat_us_p50: us(|f| f.lat_ns_p50),
            lat_us_p99: us(|f| f.lat_ns_p99),
            lat_us_p999: us(|f| f.lat_ns_p999),
            lat_us_max: us(|f| f.lat_ns_max),
            p999_ratio_to_nbdkit: median(p999_ratios),
            ratio_to_memory,
            p99_ratio_to_memory,
            steady_min_iops: median(mine.iter().filter_map(|s| s.steady.map(|t| t.min_iops))),
            steady_mean_iops: median(mine.iter().filter_map(|s| s.steady.map(|t| t.mean_iops))),
            steady_from_s: median(mine.iter().filter_map(|s| s.steady.map(|t| t.from_s as f64)))
                .map(|s| s.round() as usize),
            steady_ratio_to_nbdkit: median(steady_ratios),
            server: median_run.and_then(|i| mine[i].server.clone()),
            raw_engines: median_run.map(|i| mine[i].raw_engines.clone()).unwrap_or_default(),
            samples: mine.clone(),
            errors: errors[c].clone(),
        });
    }
    rows
}

fn header(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# pmcache bench nbd — kernel {}, {} CPUs ({}), {}, {}",
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.fio,
        m.nbdkit.as_deref().unwrap_or("no nbdkit")
    );
    let _ = writeln!(
        out,
        "# 4 KiB random requests over a {} span, {} connection(s) at QD{} each; pmcache: a {} \
         cache in /dev/shm; nbdkit file cache={}; nbdkit memory: the NBD frontend's ceiling \
         (a RAM disk); raw: the best of fio's psync, libaio and io_uring, O_DIRECT, on the \
         backing file; {} s per run, median of {} runs; ×nbdkit: median of per-run ratios; \
         full: IOPS once {} has moved (the lowest 1-s window / the mean)",
        human(plan.span_bytes),
        plan.jobs,
        plan.qd,
        human(plan.cache_bytes),
        plan.nbdkit_cache,
        plan.seconds,
        plan.runs,
        human(plan.cache_bytes)
    );
    let _ = writeln!(
        out,
        "{:<9} {:<28} {:>9} {:>7} {:>8} {:>8} {:>9} {:>9} {:>7} {:>17} {:>7}",
        "rw",
        "config",
        "IOPS",
        "×nbdkit",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "max µs",
        "p99.9×",
        "full min/mean",
        "×nbdkit"
    );
    out
}

fn table_row(r: &Row) -> String {
    let mut out = String::new();
    let full = match (r.steady_min_iops, r.steady_mean_iops) {
        (Some(min), Some(mean)) => format!("{min:.0}/{mean:.0}"),
        _ => "-".into(),
    };
    let _ = writeln!(
        out,
        "{:<9} {:<28} {:>9} {:>7} {:>8} {:>8} {:>9} {:>9} {:>7} {:>17} {:>7}",
        r.rw,
        r.config,
        opt(r.iops, 0),
        opt(r.ratio_to_nbdkit, 2),
        opt(r.lat_us_p50, 1),
        opt(r.lat_us_p99, 1),
        opt(r.lat_us_p999, 1),
        opt(r.lat_us_max, 0),
        opt(r.p999_ratio_to_nbdkit, 2),
        full,
        opt(r.steady_ratio_to_nbdkit, 2)
    );
    if !r.raw_engines.is_empty() {
        let _ =
            writeln!(out, "{:<9} └ fio engine (median run): {}", "", engines_text(&r.raw_engines));
    }
    if r.kind == Kind::Pmcache {
        let _ = writeln!(
            out,
            "{:<9} └ of nbdkit memory (the frontend's ceiling): IOPS {}, p99 {}×",
            "",
            opt(r.ratio_to_memory, 2),
            opt(r.p99_ratio_to_memory, 2)
        );
    }
    if let Some(s) = &r.server {
        let stall = if s.stalls > 0 {
            format!(
                " (p99 {:.2} ms, max {:.2} ms)",
                s.stall_ns_p99 as f64 / 1e6,
                s.stall_ns_max as f64 / 1e6
            )
        } else {
            String::new()
        };
        let reads = s.read_hits + s.read_misses;
        let hits = if reads > 0 {
            format!(", read hits {:.1} %", 100.0 * s.read_hits as f64 / reads as f64)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{:<9} └ cleaner {}/{}: dirty {:.1} % at the end, {} blocks written back ({} by the \
             cleaner), {} stalls{stall}, {} inline fallbacks, {} evictions{hits}",
            "",
            s.cleaner_order,
            s.cleaner_adaptive,
            100.0 * s.dirty_fraction,
            s.writebacks,
            s.blocks_cleaned,
            s.stalls,
            s.inline_write_backs,
            s.evictions
        );
    }
    for e in &r.errors {
        let _ = writeln!(out, "{:<9} └ error: {e}", "");
    }
    out
}

fn summary(report: &Report) -> String {
    let mut out = String::new();
    for r in report.rows.iter().filter(|r| r.kind == Kind::Pmcache && r.cleaner.is_empty()) {
        let goal = if r.rw == "randwrite" { 1.5 } else { 1.0 };
        let lower_tail = if r.rw == "randwrite" {
            match r.p999_ratio_to_nbdkit {
                Some(x) if x < 1.0 => ", p99.9 lower",
                Some(_) => ", p99.9 not lower",
                None => "",
            }
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "# {}: pmcache at {}× nbdkit's IOPS (goal ≥{goal}){lower_tail}; {} of nbdkit \
             memory's, p99 {}× its",
            r.rw,
            opt(r.ratio_to_nbdkit, 2),
            opt(r.ratio_to_memory, 2),
            opt(r.p99_ratio_to_memory, 2)
        );
    }
    out
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::harness::experiment::parse;

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_zero() {
        let parse = |flags: &[&str]| parse::<NbdArgs>(&[&["nbd"], flags].concat()).map(|p| p.0);
        let args = parse(&["--span", "2GiB", "--cache-size", "256M"]).expect("sizes");
        assert_eq!((args.span, args.cache_size), (2 << 30, 256 << 20));
        assert!(parse(&["--span", "0"]).is_err());
        assert!(parse(&["--cache-size", "x"]).is_err());
    }
}
