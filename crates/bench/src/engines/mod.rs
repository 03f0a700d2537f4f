//! `pmcache bench engines`: paper 004's experiment on this machine.
//!
//! 4 KiB random reads (and writes) through every backing-store engine, for several job counts
//! and queue depths, on a file on the root disk (`O_DIRECT`) and on a file in `/dev/shm`. In the
//! same run, fio drives the same file with the same engine and settings, so every figure sits
//! next to its baseline: the table reports each engine's IOPS, mean and p99 latency, fio's
//! IOPS and mean latency, and the ratio ours/fio. Each point is the median of `--runs` runs,
//! ours and fio interleaved, alternating which goes first (the machine is shared and noisy);
//! the ratio is the median of the per-run ratios, each between two measurements taken back
//! to back, and the table's `runs` column shows the lowest and highest of them (on a shared
//! VM disk one point's per-run ratio can swing from 0.8 to 1.3 within minutes). Output: a
//! table, `--json`, and an SVG plot with paper 004's axes (IOPS vs jobs, one line per engine).
//!
//! A job is a thread with its own queue of `--qd` requests ([`pmcache_backing::IoQueue`]),
//! as a fio job with `thread=1` and `iodepth` is. Synchronous engines (psync, pvsync2) run at
//! queue depth 1 only: a deeper queue makes no difference to them, in fio as here.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use pmcache_backing::{EngineKind, EngineOptions, open_backing};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::machine;
use crate::harness::scratch::write_random;

mod measure;
mod report;

use measure::{measure_point, run_fio, run_ours};
use report::{plot, table_header, table_row, table_summary};

/// Block size of every request, in bytes.
const BLOCK_BYTES: u64 = 4096;

/// Arguments of `pmcache bench engines`.
#[derive(clap::Args, Debug, Clone)]
pub struct EnginesArgs {
    /// Engines to measure, comma-separated (default: all). Names as `--engine` takes them.
    #[arg(long, value_delimiter = ',')]
    pub engines: Vec<String>,
    /// Job (thread) counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub jobs: Vec<usize>,
    /// Queue depths per job, comma-separated (synchronous engines run at 1 only).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub qd: Vec<usize>,
    /// Workloads, comma-separated: randread, randwrite.
    #[arg(long, value_delimiter = ',', default_value = "randread,randwrite")]
    pub rw: Vec<String>,
    /// Files to test, comma-separated: disk (a file in --disk-dir), shm (a file in --shm-dir).
    #[arg(long, value_delimiter = ',', default_value = "disk,shm")]
    pub files: Vec<String>,
    /// Directory on the root disk for the disk file (used with O_DIRECT).
    #[arg(long, default_value = "/var/tmp")]
    pub disk_dir: PathBuf,
    /// Directory in memory for the shm file.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// O_DIRECT on the shm file: auto (if tmpfs accepts it), on, off.
    #[arg(long, default_value = "auto")]
    pub shm_direct: String,
    /// Size of each test file in MiB.
    #[arg(long, default_value_t = 1024)]
    pub file_mib: u64,
    /// Where to write the SVG plot (IOPS vs jobs, one line per engine).
    #[arg(long, default_value = "pmcache-bench-engines.svg")]
    pub plot: PathBuf,
    /// Skip fio (no baseline, no ratio).
    #[arg(long)]
    pub no_fio: bool,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
    /// Keep the test files afterwards.
    #[arg(long)]
    pub keep_files: bool,
    /// Let idle CPUs enter idle states while measuring. By default the bench holds the
    /// CPU wake-up latency at 0 µs through PM QoS (`/dev/cpu_dma_latency`, as tuned's
    /// latency-performance profile does): otherwise every request that hands work to a kernel
    /// thread on another CPU (io_uring on tmpfs: every one) pays that CPU's wake-up from idle,
    /// which on a VM swings such points by 10x between runs, for fio and for us alike.
    #[arg(long)]
    pub allow_cpu_idle: bool,
}

/// The resolved plan of one invocation.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Engines measured, by name.
    pub engines: Vec<String>,
    /// Job (thread) counts.
    pub jobs: Vec<usize>,
    /// Queue depths per job.
    pub qd: Vec<usize>,
    /// Workloads: `randread`, `randwrite`.
    pub rw: Vec<String>,
    /// Files: `disk`, `shm`.
    pub files: Vec<String>,
    /// Size of each test file, bytes.
    pub file_bytes: u64,
    /// Seconds per run.
    pub runtime_secs: f64,
    /// Runs per point.
    pub runs: usize,
}

/// One measured run, or the medians of several.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Requests per second.
    pub iops: f64,
    /// Mean latency, nanoseconds (submission to completion).
    pub latency_ns_mean: f64,
    /// 99th percentile latency, nanoseconds (fio: completion latency).
    pub latency_ns_p99: f64,
}

/// One point: an engine, a workload, jobs and queue depth on one file; a line of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The file's label: `disk` or `shm`.
    pub file: String,
    /// The file's path.
    pub path: String,
    /// Whether the file was opened with `O_DIRECT`.
    pub direct: bool,
    /// `randread` or `randwrite`.
    pub rw: String,
    /// The engine's name, as `--engine` takes it.
    pub engine: String,
    /// Jobs (threads).
    pub jobs: usize,
    /// Requests in flight per job.
    pub qd: usize,
    /// Median of our runs, or `None` with `error` set.
    pub ours: Option<Sample>,
    /// Median of fio's runs.
    pub fio: Option<Sample>,
    /// Median over runs of ours.iops / fio.iops within the run.
    pub ratio: Option<f64>,
    /// Every run's ours.iops / fio.iops, in run order: the spread the median came from.
    pub run_ratios: Vec<f64>,
    /// Every run's IOPS of ours, in run order (`ours` holds their median).
    pub ours_runs_iops: Vec<f64>,
    /// Every run's IOPS of fio, in run order (`fio` holds their median).
    pub fio_runs_iops: Vec<f64>,
    /// Why ours did not run.
    pub error: Option<String>,
    /// Why fio did not run or failed.
    pub fio_error: Option<String>,
}

/// What `bench engines` measured: the JSON report.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The machine the figures come from.
    pub machine: Machine,
    /// What was measured.
    pub plan: Plan,
    /// One row per point, in the order measured.
    pub rows: Vec<Row>,
}

/// The machine the figures come from.
#[derive(Debug, Serialize)]
pub struct Machine {
    /// The kernel's release.
    pub kernel: String,
    /// CPUs available to the process.
    pub cpus: usize,
    /// The CPU's model name.
    pub cpu_model: String,
    /// fio's version, if it ran.
    pub fio_version: Option<String>,
    /// How CPU idle states were handled while measuring.
    pub cpu_idle: String,
}

/// Holds the PM QoS CPU wake-up latency request while it lives (the kernel drops the request
/// when the file is closed).
struct CpuIdleHold {
    _file: Option<std::fs::File>,
    description: String,
}

/// Asks the kernel for 0 µs CPU wake-up latency (no idle states deeper than polling) unless
/// `allowed`; reports what it got.
fn hold_cpus_awake(allowed: bool) -> CpuIdleHold {
    const PM_QOS: &str = "/dev/cpu_dma_latency";
    if allowed {
        return CpuIdleHold { _file: None, description: "CPU idle states allowed".into() };
    }
    let held = std::fs::OpenOptions::new()
        .write(true)
        .open(PM_QOS)
        .and_then(|mut f| f.write_all(&0i32.to_ne_bytes()).map(|()| f));
    match held {
        Ok(file) => CpuIdleHold {
            _file: Some(file),
            description: format!("CPU wake-up latency held at 0 µs ({PM_QOS})"),
        },
        Err(e) => CpuIdleHold {
            _file: None,
            description: format!("CPU idle states allowed ({PM_QOS}: {e})"),
        },
    }
}

struct TestFile {
    label: String,
    path: PathBuf,
    direct: bool,
}

impl Experiment for EnginesArgs {
    const NAME: &'static str = "engines";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(3), seconds: Some(2.0), quick_runs: 1, quick_seconds: 0.25 };
    type Report = Report;

    /// Measures every point; prints the table's lines as they come unless `run.json`.
    fn run(&self, run: &Run) -> Result<Report, String> {
        let table = !run.json;
        let plan = make_plan(self, run)?;
        let engines: Vec<EngineKind> =
            plan.engines.iter().map(|e| e.parse()).collect::<Result<_, _>>()?;
        let idle_hold = hold_cpus_awake(self.allow_cpu_idle);
        let mut machine = machine(self);
        machine.cpu_idle = idle_hold.description.clone();
        if !self.no_fio && machine.fio_version.is_none() {
            return Err(format!(
                "fio ({}) not found; install it (apt-get install -y fio) or pass --no-fio",
                self.fio
            ));
        }
        let files = prepare_files(self, &plan)?;
        if table {
            print!("{}", table_header(&machine, &plan));
        }
        let mut rows = Vec::new();
        let total = count_points(&plan, &engines, &files);
        let mut done = 0;
        for file in &files {
            for rw in &plan.rw {
                for &engine in &engines {
                    for &qd in &plan.qd {
                        if engine.is_synchronous() && qd != 1 {
                            continue;
                        }
                        for &jobs in &plan.jobs {
                            done += 1;
                            eprint!(
                                "\r[{done}/{total}] {} {rw} {engine} jobs={jobs} qd={qd}          ",
                                file.label
                            );
                            let _ = std::io::stderr().flush();
                            let row = measure_point(self, &plan, file, rw, engine, jobs, qd);
                            if table {
                                eprint!("\r");
                                print!("{}", table_row(&row));
                                let _ = std::io::stdout().flush();
                            }
                            rows.push(row);
                        }
                    }
                }
            }
        }
        eprintln!();
        if !self.keep_files {
            for file in &files {
                let _ = std::fs::remove_file(&file.path);
            }
        }
        Ok(Report { machine, plan, rows })
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        table_summary(&report.rows)
    }

    fn finish(&self, report: &Report, _run: &Run) -> Result<(), String> {
        plot(report, &self.plot)?;
        eprintln!("plot written to {}", self.plot.display());
        Ok(())
    }
}

/// One side of a point: pmcache's engine or fio's same engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// pmcache's engine, driven as the cache drives it.
    Ours,
    /// fio with the same engine and settings.
    Fio,
}

impl EnginesArgs {
    /// Runs one side of one point once and alone: `jobs` threads (or fio jobs) of 4 KiB
    /// random reads at queue depth `qd` for `seconds`, on `path`, a fully written file opened
    /// with `O_DIRECT`. What paper 004's guest bed counts the NVMe queues' reads around.
    pub fn run_side(
        &self,
        side: Side,
        path: &Path,
        engine: EngineKind,
        jobs: usize,
        qd: usize,
        seconds: f64,
    ) -> Result<Sample, String> {
        let file_bytes =
            std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?.len();
        let file = TestFile { label: "disk".into(), path: path.to_path_buf(), direct: true };
        let plan = Plan {
            engines: vec![engine.name().into()],
            jobs: vec![jobs],
            qd: vec![qd],
            rw: vec!["randread".into()],
            files: vec![file.label.clone()],
            file_bytes,
            runtime_secs: seconds,
            runs: 1,
        };
        match side {
            Side::Ours => {
                let opts =
                    EngineOptions { sync_contexts: jobs + 1, ..EngineOptions::new(engine, true) };
                let store = open_backing(path, &opts).map_err(|e| e.to_string())?;
                run_ours(&store, false, jobs, qd, std::time::Duration::from_secs_f64(seconds))
            }
            Side::Fio => run_fio(self, &file, "randread", engine, jobs, qd, &plan),
        }
    }
}

fn make_plan(args: &EnginesArgs, run: &Run) -> Result<Plan, String> {
    let all: Vec<String> = EngineKind::ALL.iter().map(|k| k.name().to_string()).collect();
    let engines = if args.engines.is_empty() { all } else { args.engines.clone() };
    for e in &engines {
        e.parse::<EngineKind>()?;
    }
    for rw in &args.rw {
        if rw != "randread" && rw != "randwrite" {
            return Err(format!("unknown workload {rw:?}; expected randread or randwrite"));
        }
    }
    for f in &args.files {
        if f != "disk" && f != "shm" {
            return Err(format!("unknown file {f:?}; expected disk or shm"));
        }
    }
    if args.jobs.iter().chain(&args.qd).any(|&n| n == 0) {
        return Err("jobs and qd must be positive".into());
    }
    if run.quick {
        return Ok(Plan {
            engines,
            jobs: vec![1],
            qd: vec![1, 8],
            rw: vec!["randread".into()],
            files: args.files.clone(),
            file_bytes: 64 << 20,
            runtime_secs: run.seconds,
            runs: run.runs,
        });
    }
    Ok(Plan {
        engines,
        jobs: args.jobs.clone(),
        qd: args.qd.clone(),
        rw: args.rw.clone(),
        files: args.files.clone(),
        file_bytes: args.file_mib << 20,
        runtime_secs: run.seconds,
        runs: run.runs,
    })
}

fn count_points(plan: &Plan, engines: &[EngineKind], files: &[TestFile]) -> usize {
    let per_engine = |e: &EngineKind| {
        let qds = if e.is_synchronous() {
            plan.qd.iter().filter(|&&q| q == 1).count()
        } else {
            plan.qd.len()
        };
        qds * plan.jobs.len()
    };
    files.len() * plan.rw.len() * engines.iter().map(per_engine).sum::<usize>()
}

fn machine(args: &EnginesArgs) -> Machine {
    let fio_version = if args.no_fio {
        None
    } else {
        Command::new(&args.fio)
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    Machine {
        kernel: machine::kernel(),
        cpus: machine::cpus(),
        cpu_model: machine::cpu_model(),
        fio_version,
        cpu_idle: String::new(),
    }
}

/// Creates the test files, fully written (no holes: a hole reads without touching the disk).
fn prepare_files(args: &EnginesArgs, plan: &Plan) -> Result<Vec<TestFile>, String> {
    let mut files = Vec::new();
    for label in &plan.files {
        let (dir, direct) =
            if label == "disk" { (&args.disk_dir, true) } else { (&args.shm_dir, false) };
        let path = dir.join(format!("pmcache-bench-engines-{}.dat", std::process::id()));
        write_random(&path, plan.file_bytes)
            .map_err(|e| format!("cannot create test file {}: {e}", path.display()))?;
        let direct = if label == "disk" {
            direct
        } else {
            match args.shm_direct.as_str() {
                "on" => true,
                "off" => false,
                _ => accepts_direct(&path),
            }
        };
        files.push(TestFile { label: label.clone(), path, direct });
    }
    Ok(files)
}

fn accepts_direct(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::experiment::parse;
    use crate::harness::stats::median;

    #[test]
    fn a_row_keeps_every_runs_iops_and_one_side_runs_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dir_arg = dir.path().display().to_string();
        let argv = [
            "engines",
            "--engines",
            "psync",
            "--jobs",
            "1",
            "--qd",
            "1",
            "--rw",
            "randread",
            "--files",
            "disk",
            "--disk-dir",
            &dir_arg,
            "--file-mib",
            "1",
            "--runs",
            "3",
            "--seconds",
            "0.02",
            "--no-fio",
            "--allow-cpu-idle",
            "--keep-files",
            "--json",
        ];
        let (args, run) = parse::<EnginesArgs>(&argv).expect("arguments");
        let report = args.run(&run).expect("bench engines");
        let [row] = &report.rows[..] else { panic!("one point: {:?}", report.rows) };
        assert_eq!(row.ours_runs_iops.len(), 3, "{row:?}");
        assert!(row.ours_runs_iops.iter().all(|&iops| iops > 0.0), "{row:?}");
        assert_eq!(row.ours.map(|s| s.iops), median(row.ours_runs_iops.iter().copied()));
        assert!(row.fio_runs_iops.is_empty() && row.fio.is_none(), "--no-fio: {row:?}");

        let alone = args
            .run_side(Side::Ours, Path::new(&row.path), EngineKind::Psync, 1, 1, 0.02)
            .expect("one side alone");
        assert!(alone.iops > 0.0, "{alone:?}");
    }
}
