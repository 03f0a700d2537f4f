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

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pmcache_backing::{BackingStore, EngineKind, EngineOptions, IoBuf, IoRequest, open_backing};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

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
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    pub runtime_secs: f64,
    /// Runs per point (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Smoke mode for CI: 64 MiB files, jobs 1, QD 1 and 8, randread, 0.25 s, 1 run.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
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
struct Plan {
    engines: Vec<String>,
    jobs: Vec<usize>,
    qd: Vec<usize>,
    rw: Vec<String>,
    files: Vec<String>,
    file_bytes: u64,
    runtime_secs: f64,
    runs: usize,
}

/// One measured run.
#[derive(Debug, Clone, Copy, Serialize)]
struct Sample {
    iops: f64,
    latency_ns_mean: f64,
    latency_ns_p99: f64,
}

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
struct Row {
    file: String,
    path: String,
    direct: bool,
    rw: String,
    engine: String,
    jobs: usize,
    qd: usize,
    /// Median of our runs, or `None` with `error` set.
    ours: Option<Sample>,
    /// Median of fio's runs.
    fio: Option<Sample>,
    /// Median over runs of ours.iops / fio.iops within the run.
    ratio: Option<f64>,
    /// Every run's ours.iops / fio.iops, in run order: the spread the median came from.
    run_ratios: Vec<f64>,
    /// Why ours did not run.
    error: Option<String>,
    /// Why fio did not run or failed.
    fio_error: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    plan: Plan,
    rows: Vec<Row>,
}

#[derive(Debug, Serialize)]
struct Machine {
    kernel: String,
    cpus: usize,
    cpu_model: String,
    fio_version: Option<String>,
    /// How CPU idle states were handled while measuring.
    cpu_idle: String,
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

/// Runs the experiment and prints the table (or JSON); writes the plot.
pub fn run_cli(args: &EnginesArgs) -> Result<(), String> {
    let plan = make_plan(args)?;
    let engines: Vec<EngineKind> =
        plan.engines.iter().map(|e| e.parse()).collect::<Result<_, _>>()?;
    let idle_hold = hold_cpus_awake(args.allow_cpu_idle);
    let mut machine = machine(args);
    machine.cpu_idle = idle_hold.description.clone();
    if !args.no_fio && machine.fio_version.is_none() {
        return Err(format!(
            "fio ({}) not found; install it (apt-get install -y fio) or pass --no-fio",
            args.fio
        ));
    }
    let files = prepare_files(args, &plan)?;
    if !args.json {
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
                        let row = measure_point(args, &plan, file, rw, engine, jobs, qd);
                        if !args.json {
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
    if !args.keep_files {
        for file in &files {
            let _ = std::fs::remove_file(&file.path);
        }
    }
    let report = Report { machine, plan, rows };
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, &json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", table_summary(&report.rows));
    }
    plot(&report, &args.plot)?;
    eprintln!("plot written to {}", args.plot.display());
    Ok(())
}

fn make_plan(args: &EnginesArgs) -> Result<Plan, String> {
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
    if args.jobs.iter().chain(&args.qd).any(|&n| n == 0) || args.runs == 0 {
        return Err("jobs, qd and runs must be positive".into());
    }
    if args.quick {
        return Ok(Plan {
            engines,
            jobs: vec![1],
            qd: vec![1, 8],
            rw: vec!["randread".into()],
            files: args.files.clone(),
            file_bytes: 64 << 20,
            runtime_secs: 0.25,
            runs: 1,
        });
    }
    Ok(Plan {
        engines,
        jobs: args.jobs.clone(),
        qd: args.qd.clone(),
        rw: args.rw.clone(),
        files: args.files.clone(),
        file_bytes: args.file_mib << 20,
        runtime_secs: args.runtime_secs,
        runs: args.runs,
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
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
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
        kernel,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model,
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
        write_file(&path, plan.file_bytes)
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

fn write_file(path: &Path, bytes: u64) -> std::io::Result<()> {
    let mut file = std::fs::File::create(path)?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let mut left = bytes;
    while left > 0 {
        rng.fill(&mut chunk[..]);
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()
}

fn accepts_direct(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).is_ok()
}

fn median(mut samples: Vec<Sample>) -> Option<Sample> {
    if samples.is_empty() {
        return None;
    }
    let mid = samples.len() / 2;
    let pick = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[mid]
    };
    let mut iops: Vec<f64> = samples.iter().map(|s| s.iops).collect();
    let mut mean: Vec<f64> = samples.iter().map(|s| s.latency_ns_mean).collect();
    let mut p99: Vec<f64> = samples.iter().map(|s| s.latency_ns_p99).collect();
    let out = Sample {
        iops: pick(&mut iops),
        latency_ns_mean: pick(&mut mean),
        latency_ns_p99: pick(&mut p99),
    };
    samples.clear();
    Some(out)
}

fn measure_point(
    args: &EnginesArgs,
    plan: &Plan,
    file: &TestFile,
    rw: &str,
    engine: EngineKind,
    jobs: usize,
    qd: usize,
) -> Row {
    let mut row = Row {
        file: file.label.clone(),
        path: file.path.display().to_string(),
        direct: file.direct,
        rw: rw.to_string(),
        engine: engine.name().to_string(),
        jobs,
        qd,
        ours: None,
        fio: None,
        ratio: None,
        run_ratios: Vec::new(),
        error: None,
        fio_error: None,
    };
    let runtime = Duration::from_secs_f64(plan.runtime_secs);
    let opts = EngineOptions { sync_contexts: jobs + 1, ..EngineOptions::new(engine, file.direct) };
    let store = match open_backing(&file.path, &opts) {
        Ok(store) => Some(store),
        Err(e) => {
            row.error = Some(e.to_string());
            None
        }
    };
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    // Ours and fio alternate which goes first, so drift in the machine's load hits both.
    for run in 0..plan.runs {
        let (mut ours_now, mut fio_now) = (None, None);
        for side in [run % 2, 1 - run % 2] {
            if side == 0 {
                if let Some(store) = &store {
                    match run_ours(store, rw == "randwrite", jobs, qd, runtime) {
                        Ok(s) => ours_now = Some(s),
                        Err(e) => row.error = Some(e),
                    }
                }
            } else if !args.no_fio && row.fio_error.is_none() {
                match run_fio(args, file, rw, engine, jobs, qd, plan) {
                    Ok(s) => fio_now = Some(s),
                    Err(e) => row.fio_error = Some(e),
                }
            }
        }
        if let (Some(o), Some(f)) = (ours_now, fio_now) {
            ratios.push(o.iops / f.iops);
        }
        ours.extend(ours_now);
        theirs.extend(fio_now);
    }
    row.ours = median(ours);
    row.fio = median(theirs);
    if !ratios.is_empty() {
        row.run_ratios = ratios.clone();
        ratios.sort_by(f64::total_cmp);
        row.ratio = Some(ratios[ratios.len() / 2]);
    }
    row
}

/// `jobs` threads, each keeping `qd` 4 KiB requests in flight at random aligned offsets.
fn run_ours(
    store: &Arc<dyn BackingStore>,
    write: bool,
    jobs: usize,
    qd: usize,
    runtime: Duration,
) -> Result<Sample, String> {
    let barrier = Arc::new(Barrier::new(jobs));
    let blocks = store.size_bytes() / BLOCK_BYTES;
    let results: Vec<Result<JobResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..jobs)
            .map(|job| {
                let store = store.clone();
                let barrier = barrier.clone();
                s.spawn(move || run_job(&*store, write, qd, runtime, blocks, job as u64, &barrier))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("job panicked".into())))
            .collect()
    });
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    let (mut ios, mut elapsed_max) = (0u64, Duration::ZERO);
    for r in results {
        let job = r?;
        ios += job.ios;
        elapsed_max = elapsed_max.max(job.elapsed);
        hist.add(&job.hist).map_err(|e| e.to_string())?;
    }
    Ok(Sample {
        iops: ios as f64 / elapsed_max.as_secs_f64(),
        latency_ns_mean: hist.mean(),
        latency_ns_p99: hist.value_at_quantile(0.99) as f64,
    })
}

fn run_job(
    store: &dyn BackingStore,
    write: bool,
    qd: usize,
    runtime: Duration,
    blocks: u64,
    job: u64,
    barrier: &Barrier,
) -> Result<JobResult, String> {
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    let mut queue = store.open_queue(qd).map_err(|e| e.to_string())?;
    let mut rng = SmallRng::seed_from_u64(0xb10c ^ job.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut spare: Vec<IoBuf> = (0..qd)
        .map(|_| {
            let mut buf = IoBuf::new(BLOCK_BYTES as usize);
            if write {
                rng.fill(&mut buf[..]);
            }
            buf
        })
        .collect();
    let mut out = Vec::with_capacity(qd);
    barrier.wait();
    let epoch = Instant::now();
    let deadline = epoch + runtime;
    let mut ios = 0u64;
    let mut now = epoch;
    while now < deadline {
        while let Some(buf) = spare.pop() {
            let offset = rng.gen_range(0..blocks) * BLOCK_BYTES;
            let issued_ns = epoch.elapsed().as_nanos() as u64;
            let req = if write {
                IoRequest::write(offset, buf, issued_ns)
            } else {
                IoRequest::read(offset, buf, issued_ns)
            };
            if let Err(req) = queue.push(req) {
                spare.push(req.buf);
                break;
            }
        }
        out.clear();
        queue.reap(1, &mut out).map_err(|e| e.to_string())?;
        now = Instant::now();
        let now_ns = (now - epoch).as_nanos() as u64;
        for c in out.drain(..) {
            if let Err(e) = c.result {
                return Err(format!("{} failed: {e}", c.op.name()));
            }
            hist.record(now_ns.saturating_sub(c.user_data).max(1)).map_err(|e| e.to_string())?;
            ios += 1;
            spare.push(c.buf);
        }
    }
    let elapsed = now - epoch;
    // Drain what is still in flight (not counted).
    while queue.in_flight() > 0 {
        out.clear();
        queue.reap(queue.in_flight(), &mut out).map_err(|e| e.to_string())?;
    }
    Ok(JobResult { ios, elapsed, hist })
}

/// What one job measured.
struct JobResult {
    /// Requests completed before the deadline.
    ios: u64,
    /// Time from the start to the last counted completion.
    elapsed: Duration,
    /// Latency of every counted request, in nanoseconds.
    hist: Histogram<u64>,
}

/// fio's name and options for an engine.
fn fio_engine(engine: EngineKind) -> (&'static str, &'static [&'static str]) {
    match engine {
        EngineKind::Psync => ("psync", &[]),
        EngineKind::Pvsync2 => ("pvsync2", &[]),
        EngineKind::Pvsync2Hipri => ("pvsync2", &["--hipri=1"]),
        EngineKind::Libaio => ("libaio", &[]),
        EngineKind::IoUring => ("io_uring", &[]),
        EngineKind::IoUringIopoll => ("io_uring", &["--hipri=1"]),
        EngineKind::IoUringSqpoll => ("io_uring", &["--sqthread_poll=1"]),
    }
}

fn run_fio(
    args: &EnginesArgs,
    file: &TestFile,
    rw: &str,
    engine: EngineKind,
    jobs: usize,
    qd: usize,
    plan: &Plan,
) -> Result<Sample, String> {
    let (ioengine, extra) = fio_engine(engine);
    let runtime_ms = (plan.runtime_secs * 1000.0).round().max(1.0) as u64;
    let output = Command::new(&args.fio)
        .arg("--name=pmcache")
        .arg(format!("--filename={}", file.path.display()))
        .arg(format!("--size={}", plan.file_bytes))
        .arg(format!("--direct={}", u8::from(file.direct)))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={BLOCK_BYTES}"))
        .arg(format!("--ioengine={ioengine}"))
        .arg(format!("--iodepth={qd}"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--runtime={runtime_ms}ms"))
        .args(["--time_based", "--thread", "--group_reporting", "--norandommap"])
        .args(["--randrepeat=0", "--invalidate=0", "--output-format=json"])
        .args(extra)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    // fio prints error lines before the JSON document.
    let json_start = stdout.find("\n{").map_or(0, |i| i + 1);
    let doc: serde_json::Value = serde_json::from_str(&stdout[json_start..]).map_err(|e| {
        let stderr = String::from_utf8_lossy(&output.stderr);
        format!("fio output is not JSON ({e}): {}", stderr.lines().next().unwrap_or(""))
    })?;
    let job = &doc["jobs"][0];
    let error = job["error"].as_i64().unwrap_or(0);
    if error != 0 {
        let msg = std::io::Error::from_raw_os_error(error as i32);
        return Err(format!("fio {ioengine} {}: error {error} ({msg})", extra.join(" ")));
    }
    let side = if rw == "randwrite" { &job["write"] } else { &job["read"] };
    let iops = side["iops"].as_f64().ok_or("fio JSON has no iops")?;
    Ok(Sample {
        iops,
        latency_ns_mean: side["lat_ns"]["mean"].as_f64().unwrap_or(f64::NAN),
        latency_ns_p99: side["clat_ns"]["percentile"]["99.000000"].as_f64().unwrap_or(f64::NAN),
    })
}

fn table_header(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# pmcache bench engines — kernel {}, {} CPUs ({}), {}; {}; 4 KiB, median of {} runs \
         of {:.2} s per point; files of {} MiB",
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.fio_version.as_deref().unwrap_or("no fio"),
        m.cpu_idle,
        plan.runs,
        plan.runtime_secs,
        plan.file_bytes >> 20
    );
    let _ = writeln!(
        out,
        "{:<5} {:<8} {:<9} {:<16} {:>4} {:>3} {:>10} {:>9} {:>9} {:>10} {:>9} {:>6} {:>11}",
        "file",
        "mode",
        "rw",
        "engine",
        "jobs",
        "qd",
        "IOPS",
        "mean µs",
        "p99 µs",
        "fio IOPS",
        "fio µs",
        "ratio",
        "runs"
    );
    out
}

fn table_row(r: &Row) -> String {
    let mut out = String::new();
    let mode = if r.direct { "O_DIRECT" } else { "buffered" };
    let us = |ns: f64| ns / 1000.0;
    let (iops, mean, p99) = r.ours.map_or(("-".into(), "-".into(), "-".into()), |s| {
        (
            format!("{:.0}", s.iops),
            format!("{:.1}", us(s.latency_ns_mean)),
            format!("{:.1}", us(s.latency_ns_p99)),
        )
    });
    let (fio_iops, fio_mean) = r.fio.map_or(("-".into(), "-".into()), |s| {
        (format!("{:.0}", s.iops), format!("{:.1}", us(s.latency_ns_mean)))
    });
    let ratio = r.ratio.map_or("-".into(), |x| format!("{x:.2}"));
    let lowest = r.run_ratios.iter().copied().reduce(f64::min);
    let highest = r.run_ratios.iter().copied().reduce(f64::max);
    let spread = match (lowest, highest) {
        (Some(low), Some(high)) => format!("{low:.2}–{high:.2}"),
        _ => "-".into(),
    };
    let _ = writeln!(
        out,
        "{:<5} {:<8} {:<9} {:<16} {:>4} {:>3} {:>10} {:>9} {:>9} {:>10} {:>9} {:>6} {:>11}",
        r.file,
        mode,
        r.rw,
        r.engine,
        r.jobs,
        r.qd,
        iops,
        mean,
        p99,
        fio_iops,
        fio_mean,
        ratio,
        spread
    );
    if let Some(e) = &r.error {
        let _ = writeln!(out, "      ours: {e}");
    }
    if let Some(e) = &r.fio_error {
        let _ = writeln!(out, "      fio:  {e}");
    }
    out
}

fn table_summary(rows: &[Row]) -> String {
    let ratios: Vec<f64> = rows.iter().filter_map(|r| r.ratio).collect();
    if ratios.is_empty() {
        return String::new();
    }
    let below = ratios.iter().filter(|&&x| x < 0.90).count();
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    format!(
        "# {} points with a fio baseline; {} below 0.90x; lowest ratio {:.2}\n",
        ratios.len(),
        below,
        min
    )
}

/// One panel per (file, workload, queue depth): IOPS vs jobs, a solid line per engine (ours)
/// and a dashed-looking line of hollow points for fio's same engine.
fn plot(report: &Report, path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let mut panels: Vec<(String, String, usize)> = Vec::new();
    for r in &report.rows {
        let key = (r.file.clone(), r.rw.clone(), r.qd);
        if !panels.contains(&key) {
            panels.push(key);
        }
    }
    if panels.is_empty() {
        return Ok(());
    }
    let cols = panels.len().min(2);
    let rows = panels.len().div_ceil(cols);
    let root = SVGBackend::new(path, (720 * cols as u32, 480 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((rows, cols));
    let engines: Vec<String> = report.plan.engines.clone();
    let max_jobs = report.plan.jobs.iter().copied().max().unwrap_or(1).max(2) as f64;
    for ((file, rw, qd), area) in panels.iter().zip(areas.iter()) {
        let mine: Vec<&Row> =
            report.rows.iter().filter(|r| &r.file == file && &r.rw == rw && r.qd == *qd).collect();
        let y_max = mine
            .iter()
            .flat_map(|r| [r.ours.map(|s| s.iops), r.fio.map(|s| s.iops)])
            .flatten()
            .fold(1.0f64, f64::max)
            * 1.1;
        let mode = mine.first().map_or("", |r| if r.direct { "O_DIRECT" } else { "buffered" });
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{file} ({mode}), 4 KiB {rw}, QD{qd}"), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0.5f64..max_jobs + 0.5, 0f64..y_max)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("jobs")
            .y_desc("IOPS")
            .x_labels(max_jobs as usize + 2)
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
            })
            .disable_x_mesh()
            .y_label_formatter(&|y| format!("{:.0}K", y / 1000.0))
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, engine) in engines.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
                let mut p: Vec<(f64, f64)> = mine
                    .iter()
                    .filter(|r| &r.engine == engine)
                    .filter_map(|r| f(r).map(|y| (r.jobs as f64, y)))
                    .collect();
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                p
            };
            let ours = points(&|r| r.ours.map(|s| s.iops));
            let fio = points(&|r| r.fio.map(|s| s.iops));
            if !ours.is_empty() {
                chart
                    .draw_series(LineSeries::new(ours.clone(), color.stroke_width(2)))
                    .map_err(|e| e.to_string())?
                    .label(format!("{engine} (pmcache)"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(ours.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
            if !fio.is_empty() {
                chart
                    .draw_series(LineSeries::new(fio.clone(), color.mix(0.4).stroke_width(1)))
                    .map_err(|e| e.to_string())?
                    .label(format!("{engine} (fio)"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.mix(0.4))
                    });
                chart
                    .draw_series(fio.iter().map(|&p| Circle::new(p, 4, color.stroke_width(1))))
                    .map_err(|e| e.to_string())?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}
