//! fio jobs: starting them, parsing fio's JSON report and per-second IOPS logs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pmcache_backing::EngineKind;
use serde::Serialize;

use super::machine::tool_version;
use super::process::{check_interrupted, log_tail, send_signal, terminate_with_parent, wait_until};

/// Checks that fio runs and has its nbd engine; returns its version.
pub(crate) fn check_fio(fio: &str) -> Result<String, String> {
    let version = tool_version(fio, "--version", "fio")?;
    let engine = Command::new(fio)
        .arg("--enghelp=nbd")
        .output()
        .map_err(|e| format!("cannot run {fio}: {e}"))?;
    let help = String::from_utf8_lossy(&engine.stdout);
    if !engine.status.success() || !help.contains("uri") {
        return Err(format!(
            "{fio} ({version}) has no nbd engine (`fio --enghelp=nbd` fails): install a fio \
             built with libnbd (Debian/Ubuntu's fio package has it)"
        ));
    }
    Ok(version)
}

/// fio's name and options for an engine.
pub(crate) fn fio_engine(engine: EngineKind) -> (&'static str, &'static [&'static str]) {
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

/// fio's JSON report, past the notes and error lines fio may print before it.
pub(crate) fn parse_json(text: &str) -> Result<serde_json::Value, serde_json::Error> {
    let start = text.find("\n{").map_or(0, |i| i + 1);
    serde_json::from_str(&text[start..])
}

/// The error of the report's first job (`error N (what it means)`), if it failed.
pub(crate) fn job_error(doc: &serde_json::Value) -> Option<String> {
    let error = doc["jobs"][0]["error"].as_i64().unwrap_or(0);
    let msg = std::io::Error::from_raw_os_error(error as i32);
    (error != 0).then(|| format!("error {error} ({msg})"))
}

/// The JSON report of a fio run whose output was captured; a failed job's error follows
/// `what`.
pub(crate) fn captured_report(
    output: &std::process::Output,
    what: &str,
) -> Result<serde_json::Value, String> {
    let doc = parse_json(&String::from_utf8_lossy(&output.stdout)).map_err(|e| {
        let stderr = String::from_utf8_lossy(&output.stderr);
        format!("fio output is not JSON ({e}): {}", stderr.lines().next().unwrap_or(""))
    })?;
    match job_error(&doc) {
        Some(error) => Err(format!("{what}: {error}")),
        None => Ok(doc),
    }
}

/// What fio drives.
pub(crate) enum FioTarget {
    /// An NBD export (`--ioengine=nbd --uri=...`), one connection per job.
    Nbd(String),
    /// An NBD export over TLS with X.509: libnbd finds the CA in `home`/.pki/libnbd (fio's
    /// engine cannot pass credentials: libnbd refuses file paths in a URI unless the program
    /// allows them).
    NbdTls {
        /// `nbds://` or `nbds+unix://`.
        uri: String,
        /// fio's `HOME`.
        home: PathBuf,
    },
    /// A file, `O_DIRECT`, with fio's `engine` (one of [`RAW_ENGINES`]).
    File {
        /// The file.
        path: PathBuf,
        /// fio's `--ioengine`.
        engine: &'static str,
    },
}

/// The fio engines a raw baseline tries: the disk's best at a shape is the best of these,
/// each measured in the same run (a synchronous engine runs each job at one request in
/// flight, whatever the queue depth asked).
pub(crate) const RAW_ENGINES: [&str; 3] = ["psync", "libaio", "io_uring"];

/// One engine's figure in a best-of-engines baseline.
#[derive(Debug, Clone, Serialize)]
pub struct EngineRate {
    /// fio's `--ioengine`.
    pub engine: String,
    /// Requests per second (`None`: the engine failed here, see `error`).
    pub iops: Option<f64>,
    /// Why the engine measured nothing.
    pub error: Option<String>,
}

/// Runs `measure` with each of `engines` (in an order rotated by `turn`, so that no engine
/// always goes first) and returns the fastest one's result, with every engine's rate in
/// `engines`' order; an error only when every engine failed.
pub(crate) fn best_of_engines<T>(
    engines: &[&'static str],
    turn: usize,
    mut measure: impl FnMut(&'static str) -> Result<T, String>,
    iops: impl Fn(&T) -> f64,
) -> Result<(T, Vec<EngineRate>), String> {
    let mut results: Vec<Option<Result<T, String>>> = engines.iter().map(|_| None).collect();
    for i in 0..engines.len() {
        let at = (i + turn) % engines.len();
        check_interrupted()?;
        results[at] = Some(measure(engines[at]));
    }
    let mut rates = Vec::with_capacity(engines.len());
    let mut best: Option<T> = None;
    for (engine, result) in engines.iter().zip(results) {
        match result.expect("every engine was measured") {
            Ok(r) => {
                rates.push(EngineRate {
                    engine: engine.to_string(),
                    iops: Some(iops(&r)),
                    error: None,
                });
                if best.as_ref().is_none_or(|b| iops(&r) > iops(b)) {
                    best = Some(r);
                }
            }
            Err(e) => {
                rates.push(EngineRate { engine: engine.to_string(), iops: None, error: Some(e) })
            }
        }
    }
    match best {
        Some(best) => Ok((best, rates)),
        None => Err(format!(
            "every fio engine failed: {}",
            rates
                .iter()
                .map(|r| format!("{}: {}", r.engine, r.error.as_deref().unwrap_or("")))
                .collect::<Vec<_>>()
                .join("; ")
        )),
    }
}

/// The winner of a best-of-engines baseline and the others' IOPS as a share of it, for a
/// table: `psync (libaio 0.62, io_uring 0.58)`.
pub(crate) fn engines_text(rates: &[EngineRate]) -> String {
    let best = rates
        .iter()
        .filter_map(|r| r.iops.map(|i| (r.engine.as_str(), i)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let Some((winner, top)) = best else { return "no engine measured".into() };
    let others: Vec<String> = rates
        .iter()
        .filter(|r| r.engine != winner)
        .map(|r| match r.iops {
            Some(i) => format!("{} {:.2}", r.engine, i / top),
            None => format!("{} failed", r.engine),
        })
        .collect();
    if others.is_empty() { winner.to_string() } else { format!("{winner} ({})", others.join(", ")) }
}

/// One fio invocation.
pub(crate) struct FioSpec<'a> {
    pub(crate) fio: &'a str,
    pub(crate) target: FioTarget,
    /// `randwrite` or `randread`.
    pub(crate) rw: &'a str,
    /// Request size in bytes.
    pub(crate) bs: u64,
    /// Requests in flight per job.
    pub(crate) qd: usize,
    /// Jobs (for nbd: connections).
    pub(crate) jobs: usize,
    /// Span of the random offsets, bytes.
    pub(crate) span: u64,
    /// Run time (time-based).
    pub(crate) seconds: f64,
    /// Where fio writes its JSON and logs.
    pub(crate) out_dir: &'a Path,
    /// Keep a per-second IOPS log.
    pub(crate) timeline: bool,
    /// The CPUs fio's jobs may run on (`--cpus_allowed`, e.g. `0` or `0-1`, shared by the
    /// jobs); `None`: any.
    pub(crate) cpus: Option<&'a str>,
}

/// What fio measured (all jobs together).
#[derive(Debug, Clone, Serialize)]
pub struct FioResult {
    /// Requests per second.
    pub iops: f64,
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Requests completed.
    pub ios: u64,
    /// Run time, milliseconds.
    pub runtime_ms: u64,
    /// Mean latency (submission to completion), nanoseconds.
    pub lat_ns_mean: f64,
    /// Median latency, nanoseconds.
    pub lat_ns_p50: f64,
    /// 99th percentile latency, nanoseconds.
    pub lat_ns_p99: f64,
    /// 99.9th percentile latency, nanoseconds.
    pub lat_ns_p999: f64,
    /// Highest latency, nanoseconds.
    pub lat_ns_max: f64,
    /// IOPS of each whole second of the run, all jobs summed (empty without a timeline).
    pub timeline_iops: Vec<f64>,
}

/// A running fio, killed if dropped before it is waited for.
pub(crate) struct FioRun {
    child: Option<Child>,
    output: PathBuf,
    stderr: PathBuf,
    out_dir: PathBuf,
    log_prefix: String,
    rw: String,
    seconds: f64,
    interrupted: bool,
}

static FIO_RUNS: AtomicU64 = AtomicU64::new(0);

impl FioRun {
    /// Starts fio.
    pub(crate) fn spawn(spec: &FioSpec<'_>) -> Result<FioRun, String> {
        let n = FIO_RUNS.fetch_add(1, Ordering::Relaxed);
        let output = spec.out_dir.join(format!("fio-{n}.json"));
        let stderr = spec.out_dir.join(format!("fio-{n}.stderr"));
        let log_prefix = format!("fio-{n}");
        let runtime_ms = (spec.seconds * 1000.0).round().max(1.0) as u64;
        let mut command = Command::new(spec.fio);
        command
            .arg("--name=pmcache-bench")
            .arg(format!("--rw={}", spec.rw))
            .arg(format!("--bs={}", spec.bs))
            .arg(format!("--iodepth={}", spec.qd))
            .arg(format!("--numjobs={}", spec.jobs))
            .arg(format!("--size={}", spec.span))
            .arg(format!("--runtime={runtime_ms}ms"))
            .args(["--time_based", "--group_reporting", "--norandommap", "--randrepeat=0"])
            .args(["--lat_percentiles=1", "--percentile_list=50:99:99.9"])
            .arg("--output-format=json")
            .arg(format!("--output={}", output.display()));
        if let Some(cpus) = spec.cpus {
            command.arg(format!("--cpus_allowed={cpus}")).arg("--cpus_allowed_policy=shared");
        }
        match &spec.target {
            FioTarget::Nbd(uri) => {
                command.arg("--ioengine=nbd").arg(format!("--uri={uri}"));
            }
            FioTarget::NbdTls { uri, home } => {
                command.arg("--ioengine=nbd").arg(format!("--uri={uri}")).env("HOME", home);
            }
            FioTarget::File { path, engine } => {
                command
                    .arg(format!("--ioengine={engine}"))
                    .arg("--direct=1")
                    .arg(format!("--filename={}", path.display()));
            }
        }
        if spec.timeline {
            command
                .arg(format!("--write_iops_log={}", spec.out_dir.join(&log_prefix).display()))
                .arg("--log_avg_msec=1000");
        }
        let err = std::fs::File::create(&stderr).map_err(|e| e.to_string())?;
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
        terminate_with_parent(&mut command);
        let child = command.spawn().map_err(|e| format!("cannot run {}: {e}", spec.fio))?;
        Ok(FioRun {
            child: Some(child),
            output,
            stderr,
            out_dir: spec.out_dir.to_path_buf(),
            log_prefix,
            rw: spec.rw.to_string(),
            seconds: spec.seconds,
            interrupted: false,
        })
    }

    /// Runs fio to its end.
    pub(crate) fn run(spec: &FioSpec<'_>) -> Result<FioResult, String> {
        FioRun::spawn(spec)?.wait()
    }

    /// Asks fio to stop now (SIGINT: it ends its jobs and reports what they did).
    pub(crate) fn interrupt(&mut self) {
        if let Some(child) = &self.child {
            self.interrupted = true;
            send_signal(child.id(), rustix::process::Signal::INT);
        }
    }

    /// Whether fio still runs.
    pub(crate) fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits for fio and reads its report.
    pub(crate) fn wait(mut self) -> Result<FioResult, String> {
        let mut child = self.child.take().expect("a running fio");
        let deadline = Instant::now() + Duration::from_secs_f64(self.seconds * 2.0 + 120.0);
        let Some(status) = wait_until(&mut child, deadline, true) else {
            let _ = child.kill();
            let _ = child.wait();
            check_interrupted()?;
            return Err("fio did not finish in time; killed".into());
        };
        let stderr = log_tail(&self.stderr);
        let text = std::fs::read_to_string(&self.output).unwrap_or_default();
        let Ok(doc) = parse_json(&text) else {
            return Err(format!("fio failed ({status}): {stderr}"));
        };
        if !status.success() && !self.interrupted {
            return Err(format!("fio failed ({status}): {stderr}"));
        }
        if let Some(error) = job_error(&doc) {
            return Err(format!("fio: {error}: {stderr}"));
        }
        let job = &doc["jobs"][0];
        let side = if self.rw.contains("write") { &job["write"] } else { &job["read"] };
        let lat = &side["lat_ns"];
        let percentile = |key: &str| lat["percentile"][key].as_f64().unwrap_or(f64::NAN);
        let timeline = read_timeline(&self.out_dir, &self.log_prefix);
        Ok(FioResult {
            iops: side["iops"].as_f64().ok_or("fio's report has no iops")?,
            bytes_per_s: side["bw_bytes"].as_f64().unwrap_or(f64::NAN),
            ios: side["total_ios"].as_u64().unwrap_or(0),
            runtime_ms: side["runtime"].as_u64().unwrap_or(0),
            lat_ns_mean: lat["mean"].as_f64().unwrap_or(f64::NAN),
            lat_ns_p50: percentile("50.000000"),
            lat_ns_p99: percentile("99.000000"),
            lat_ns_p999: percentile("99.900000"),
            lat_ns_max: lat["max"].as_f64().unwrap_or(f64::NAN),
            timeline_iops: timeline,
        })
    }
}

impl Drop for FioRun {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sums fio's per-job IOPS logs (`<prefix>_iops.<job>.log`, one line per second:
/// `time_ms, iops, ...`) into one value per second; a second no job logged counts 0.
pub(crate) fn read_timeline(dir: &Path, prefix: &str) -> Vec<f64> {
    let start = format!("{prefix}_iops.");
    let mut seconds: Vec<f64> = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return seconds };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(&start) || !name.ends_with(".log") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            let mut fields = line.split(',').map(str::trim);
            let (Some(Ok(ms)), Some(Ok(iops))) =
                (fields.next().map(str::parse::<u64>), fields.next().map(str::parse::<f64>))
            else {
                continue;
            };
            // A window ends at about `ms`; window k covers second k-1..k.
            let k = ((ms + 500) / 1000) as usize;
            if k == 0 {
                continue;
            }
            if seconds.len() < k {
                seconds.resize(k, 0.0);
            }
            seconds[k - 1] += iops;
        }
    }
    seconds
}

/// IOPS from the second by which as many bytes as the cache holds had been transferred (for
/// writes: the cache is full from then on), and at least 2 s in.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Steady {
    /// The first second counted.
    pub(crate) from_s: usize,
    /// The lowest 1-second window from then on.
    pub(crate) min_iops: f64,
    /// The mean of those windows.
    pub(crate) mean_iops: f64,
}

pub(crate) fn steady(timeline: &[f64], bs: u64, fill_bytes: u64) -> Option<Steady> {
    let mut moved = 0.0;
    let mut from = None;
    for (i, &iops) in timeline.iter().enumerate() {
        moved += iops * bs as f64;
        if moved >= fill_bytes as f64 {
            from = Some(i + 1);
            break;
        }
    }
    let from_s = from?.max(2);
    let windows = timeline.get(from_s..).filter(|w| !w.is_empty())?;
    Some(Steady {
        from_s,
        min_iops: windows.iter().copied().fold(f64::INFINITY, f64::min),
        mean_iops: windows.iter().sum::<f64>() / windows.len() as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_starts_once_a_cache_worth_has_moved() {
        // 100 requests of 4 KiB a second; a cache of 1000 requests fills during second 10.
        let timeline = [100.0; 20];
        let s = steady(&timeline, 4096, 1000 * 4096).expect("windows after the fill");
        assert_eq!(s.from_s, 10);
        assert_eq!((s.min_iops, s.mean_iops), (100.0, 100.0));
        assert!(steady(&timeline[..5], 4096, 1000 * 4096).is_none());
    }

    #[test]
    fn the_baseline_is_the_fastest_engine_and_every_engine_runs_once() {
        let mut order = Vec::new();
        let (best, rates) = best_of_engines(
            &RAW_ENGINES,
            1,
            |engine| {
                order.push(engine);
                match engine {
                    "psync" => Ok(48_000.0),
                    "libaio" => Err("no libaio".to_string()),
                    _ => Ok(30_000.0),
                }
            },
            |&iops| iops,
        )
        .expect("two engines measured");
        assert_eq!(best, 48_000.0);
        assert_eq!(order, ["libaio", "io_uring", "psync"], "the order turns with the run");
        assert_eq!(rates.iter().map(|r| r.engine.as_str()).collect::<Vec<_>>(), RAW_ENGINES);
        assert_eq!(engines_text(&rates), "psync (libaio failed, io_uring 0.62)");
        let none = best_of_engines(&RAW_ENGINES, 0, |_| Err::<f64, _>("gone".into()), |&v| v);
        assert!(none.is_err_and(|e| e.contains("psync: gone")));
    }
}
