//! `pmcache bench mixed`: cache hits and misses on the same connections, in front of a slow
//! backing store — what a hit costs while misses are in flight beside it.
//!
//! Each measurement starts `pmcache serve` on a fresh cache medium in `/dev/shm` in front of a
//! backing file in `/dev/shm` with `--backing-latency` (every backing read and write takes at
//! least that long; requests overlap without limit, like a network disk with a deep queue).
//! The hot zone (the first `--hot` bytes) is read once at a high queue depth, so it is cached;
//! then fio's nbd engine reads 4 KiB blocks at random for `--seconds`, `hit %` of them in the
//! hot zone and the rest in the cold rest of the span (`random_distribution=zoned`), at each
//! queue depth, over each number of connections (one fio job per connection). fio logs every
//! request's latency with its offset, so the hot-zone reads (the hits) and the cold ones (the
//! misses) are reported apart, from the client's side; the server's own per-class histograms
//! (`pmcache stats`: from a read's hand-over to the engine to its answer) are reported beside
//! them, with the hit ratio the server counted.
//!
//! Beside each configuration, in the same run: the all-hit run (100 %), and the backing store
//! alone (the same server in `--mode passthrough` with an empty cache: every read goes to
//! the store). The IOPS bound is what the hits and the store's own concurrency allow: with
//! `N` requests in flight, each miss holds one for the store's latency `L` and each hit for at
//! least the unloaded hit latency `t0` (the all-hit run at QD 1, one connection), and no mix
//! passes the all-hit rate: `min(all-hit IOPS, N / ((1 - h) L + h t0))`.
//!
//! With `--writes W` (and `--mode writethrough`, say), `W` % of each connection's requests are
//! 4 KiB random writes over the same zones: what a hit costs while write-throughs are in
//! flight beside it. The writes' latencies are reported apart; the all-hit baseline stays
//! reads only, and a row of all-hit reads with the writes is added; writes count at the
//! store's latency in the bound.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use pmcache_backing::wrappers::LatencyDist;
use pmcache_frontend::units::parse_nonzero_size;
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::fio::check_fio;
use crate::harness::machine::Machine;
use crate::harness::output::{opt, progress};
use crate::harness::process::{catch_interrupts, check_interrupted};
use crate::harness::servers::{PmcacheServe, ServeOptions, Server};
use crate::harness::stats::{median, quantiles};

/// Bytes of one request.
const BLOCK_BYTES: u64 = 4096;

/// Arguments of `pmcache bench mixed`.
#[derive(clap::Args, Debug, Clone)]
pub struct MixedArgs {
    /// Backing-store latency, as `pmcache serve --backing-latency` takes it.
    #[arg(long, default_value = "2ms")]
    pub latency: String,
    /// The same latency in microseconds, for the bound (taken from `--latency` when it is a
    /// plain time).
    #[arg(skip)]
    latency_us: f64,
    /// The cache mode the server runs in (`pmcache serve --mode`).
    #[arg(long, default_value = "writeback")]
    pub mode: String,
    /// Percent of requests that are writes (4 KiB, random over the same zones as the reads):
    /// in write-through modes they go to the slow store. The all-hit baseline stays reads
    /// only; a row of all-hit reads with these writes is added.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=90))]
    pub writes: u32,
    /// Hit percentages, comma-separated (100 is always measured: the baseline).
    #[arg(long, value_delimiter = ',', default_value = "95,90,50")]
    pub hits: Vec<u32>,
    /// Requests in flight per connection, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub qd: Vec<usize>,
    /// Connections (fio jobs), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub conns: Vec<usize>,
    /// `--seconds` and `--runs`, resolved.
    #[arg(skip)]
    seconds: f64,
    #[arg(skip)]
    runs: usize,
    /// The span of the random offsets, the backing file's size.
    #[arg(long, value_parser = parse_nonzero_size, default_value = "1G")]
    pub span: u64,
    /// The hot zone (cached before each measurement), at the start of the span.
    #[arg(long, value_parser = parse_nonzero_size, default_value = "64M")]
    pub hot: u64,
    /// The cache medium's size (room for the hot zone and the cold blocks misses admit).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "256M")]
    pub cache_size: u64,
    /// Directory for the backing file and the cache medium.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
}

/// One measurement's figures.
#[derive(Debug, Clone, Default, Serialize)]
struct Measured {
    iops: f64,
    /// Client-side latency percentiles of the hot-zone (hit) reads, µs.
    hot_us: [f64; 3],
    /// ... of the cold-zone (miss) reads.
    cold_us: [f64; 3],
    /// ... of the writes.
    write_us: [f64; 3],
    /// The server's hit and miss latency percentiles (p50, p90, p99), µs.
    server_hit_us: [f64; 3],
    server_miss_us: [f64; 3],
    /// Reads the server answered from the cache, of all it answered.
    hit_ratio: f64,
}

/// A configuration's medians.
#[derive(Debug, Clone, Serialize)]
struct Row {
    conns: usize,
    qd: usize,
    /// `None`: the backing store alone.
    hit_pct: Option<u32>,
    /// Percent of requests that were writes.
    write_pct: u32,
    median: Measured,
    bound_iops: Option<f64>,
}

/// What `bench mixed` found.
#[derive(Debug, Serialize)]
pub struct Report {
    machine: Machine,
    latency: String,
    unloaded_hit_us: f64,
    rows: Vec<Row>,
}

impl Experiment for MixedArgs {
    const NAME: &'static str = "mixed";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(3), seconds: Some(10.0), quick_runs: 1, quick_seconds: 3.0 };
    type Report = Report;

    fn run(&self, run: &Run) -> Result<Report, String> {
        let mut args = self.clone();
        (args.seconds, args.runs) = (run.seconds, run.runs);
        if run.quick {
            args.qd = vec![16];
            args.conns = vec![1];
            args.hits = vec![90];
        }
        args.latency_us = LatencyDist::parse(&args.latency)
            .map_err(|e| format!("--latency: {e}"))?
            .mean()
            .as_secs_f64()
            * 1e6;
        if args.hot >= args.span || args.hot >= args.cache_size {
            return Err("--hot must be smaller than --span and --cache-size".into());
        }
        let fio_version = check_fio(&args.fio)?;
        catch_interrupts();
        let dir = tempfile::Builder::new()
            .prefix("pmcache-bench-mixed.")
            .tempdir_in(&args.shm_dir)
            .map_err(|e| format!("{}: {e}", args.shm_dir.display()))?;
        let backing = dir.path().join("backing");
        let file = std::fs::File::create(&backing).map_err(|e| e.to_string())?;
        file.set_len(args.span).map_err(|e| e.to_string())?;
        drop(file);
        let machine = Machine::probe(fio_version, None);
        let mut rows = Vec::new();
        // The unloaded hit latency: all hits, QD 1, one connection (median over the runs).
        let t0 = median((0..args.runs).map(|_| {
            let config = Config { conns: 1, qd: 1, hit_pct: Some(100), write_pct: 0 };
            measure(&args, dir.path(), &backing, config).map_or(f64::NAN, |m| m.hot_us[0])
        }))
        .ok_or("no unloaded hit latency measured")?;
        for &conns in &args.conns {
            for &qd in &args.qd {
                let w = args.writes;
                // (hits, writes): the store alone, the all-hit reads (the baseline), all-hit
                // reads with the writes, then the mixes.
                let mut configs: Vec<(Option<u32>, u32)> = vec![(None, w), (Some(100), 0)];
                if w > 0 {
                    configs.push((Some(100), w));
                }
                configs.extend(args.hits.iter().filter(|&&h| h < 100).map(|&h| (Some(h), w)));
                let mut all_hit_iops = None;
                for (hit_pct, write_pct) in configs {
                    let mut runs = Vec::new();
                    for turn in 0..args.runs {
                        check_interrupted()?;
                        let what = hit_pct.map_or("store alone".into(), |h| format!("{h}% hits"));
                        progress(&format!(
                            "{conns} conn, QD {qd}, {what}, {write_pct}% writes, run {}",
                            turn + 1
                        ));
                        let config = Config { conns, qd, hit_pct, write_pct };
                        runs.push(measure(&args, dir.path(), &backing, config)?);
                    }
                    let median = median_of(&runs);
                    if hit_pct == Some(100) && write_pct == 0 {
                        all_hit_iops = Some(median.iops);
                    }
                    // Writes count at the store's latency (write-through), reads by their zone.
                    let bound_iops = hit_pct.zip(all_hit_iops).map(|(h, all_hit)| {
                        let (h, w) = (f64::from(h) / 100.0, f64::from(write_pct) / 100.0);
                        let slow = w + (1.0 - w) * (1.0 - h);
                        let slot_us = slow * args.latency_us + (1.0 - slow) * t0;
                        all_hit.min((conns * qd) as f64 / (slot_us * 1e-6))
                    });
                    rows.push(Row { conns, qd, hit_pct, write_pct, median, bound_iops });
                }
            }
        }
        progress("");
        Ok(Report { machine, latency: args.latency.clone(), unloaded_hit_us: t0, rows })
    }

    fn table(&self, report: &Report, run: &Run) -> String {
        table(self, run, report)
    }
}

fn median_of(runs: &[Measured]) -> Measured {
    let m = |f: &dyn Fn(&Measured) -> f64| median(runs.iter().map(f)).unwrap_or(f64::NAN);
    let three =
        |f: &dyn Fn(&Measured) -> [f64; 3]| [m(&|r| f(r)[0]), m(&|r| f(r)[1]), m(&|r| f(r)[2])];
    Measured {
        iops: m(&|r| r.iops),
        hot_us: three(&|r| r.hot_us),
        cold_us: three(&|r| r.cold_us),
        write_us: three(&|r| r.write_us),
        server_hit_us: three(&|r| r.server_hit_us),
        server_miss_us: three(&|r| r.server_miss_us),
        hit_ratio: m(&|r| r.hit_ratio),
    }
}

/// What one measurement runs.
#[derive(Clone, Copy)]
struct Config {
    conns: usize,
    qd: usize,
    /// `None`: the backing store alone.
    hit_pct: Option<u32>,
    write_pct: u32,
}

/// One measurement: a fresh server, the hot zone cached, fio's mixed requests.
fn measure(
    args: &MixedArgs,
    dir: &Path,
    backing: &Path,
    config: Config,
) -> Result<Measured, String> {
    let Config { conns, qd, hit_pct, write_pct } = config;
    let medium = dir.join("cache");
    let (socket, control, log) =
        (dir.join("nbd.sock"), dir.join("ctl.sock"), dir.join("serve.log"));
    let mode = if hit_pct.is_none() { "passthrough" } else { args.mode.as_str() };
    let options = ServeOptions {
        mode: Some(mode.parse().map_err(|e| format!("--mode {mode}: {e}"))?),
        backing_latency: Some(
            LatencyDist::parse(&args.latency).map_err(|e| format!("--latency: {e}"))?,
        ),
        tls_certificates: None,
        cleaner_cpu: None,
    };
    let server = Server::start_pmcache(&PmcacheServe {
        medium: &medium,
        cache_bytes: args.cache_size,
        backing,
        socket: &socket,
        control: &control,
        log: &log,
        cleaner: &[],
        cpus: None,
        max_connections: conns + 2,
        options,
    })?;
    if hit_pct.is_some() {
        // Every hot block once (fio's random map), many in flight: all cached.
        fio(args, dir, &server.uri(), "warm", (32, 1, 0), Zone::HotOnce)?;
    }
    let before = server.stats()?;
    let zone = match hit_pct {
        Some(100) => Zone::Hot,
        Some(h) => Zone::Mixed(h),
        None => Zone::Span,
    };
    let log_prefix = fio(args, dir, &server.uri(), "measure", (qd, conns, write_pct), zone)?;
    let after = server.stats()?;
    server.stop()?;
    let (iops, [hot, cold, writes]) = read_lat_logs(dir, &log_prefix, args.hot, args.seconds)?;
    let count = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or(0);
    let delta = |k: &str| count(&after, k).saturating_sub(count(&before, k));
    let hits = delta("read_hits");
    let misses = delta("read_misses_admitted")
        + delta("read_misses_bypassed")
        + delta("read_misses_sequential");
    let server_us = |class: &str| {
        let recorded = count(&after, &format!("read_{class}_latency_count")) > 0;
        ["p50", "p90", "p99"].map(|p| {
            let key = format!("read_{class}_latency_ns_{p}");
            after[key.as_str()].as_f64().filter(|_| recorded).map_or(f64::NAN, |ns| ns / 1e3)
        })
    };
    let _ = std::fs::remove_file(&medium);
    Ok(Measured {
        iops,
        hot_us: percentiles_us(hot),
        cold_us: percentiles_us(cold),
        write_us: percentiles_us(writes),
        server_hit_us: server_us("hit"),
        server_miss_us: server_us("miss"),
        hit_ratio: hits as f64 / (hits + misses).max(1) as f64,
    })
}

/// Where fio's reads go.
#[derive(Clone, Copy)]
enum Zone {
    /// Every hot block once.
    HotOnce,
    /// The hot zone only, for the run's time.
    Hot,
    /// `h` % in the hot zone, the rest in the cold rest of the span.
    Mixed(u32),
    /// The whole span, uniformly.
    Span,
}

/// Runs fio's nbd engine, `(qd, jobs, write_pct)`; returns the prefix of its latency logs.
fn fio(
    args: &MixedArgs,
    dir: &Path,
    uri: &str,
    name: &str,
    (qd, jobs, write_pct): (usize, usize, u32),
    zone: Zone,
) -> Result<String, String> {
    let prefix = dir.join(name).display().to_string();
    let mut command = Command::new(&args.fio);
    command.arg(format!("--name={name}"));
    if write_pct > 0 {
        command.arg("--rw=randrw").arg(format!("--rwmixread={}", 100 - write_pct));
    } else {
        command.arg("--rw=randread");
    }
    command
        .args(["--ioengine=nbd", "--randrepeat=0", "--group_reporting"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--bs={BLOCK_BYTES}"))
        .arg(format!("--iodepth={qd}"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--output={prefix}.json"))
        .arg("--output-format=json");
    match zone {
        Zone::HotOnce => {
            command.arg(format!("--size={}", args.hot));
        }
        Zone::Hot | Zone::Mixed(_) | Zone::Span => {
            let runtime_ms = (args.seconds * 1000.0).round() as u64;
            command
                .args(["--time_based", "--norandommap", "--log_offset=1"])
                .arg(format!("--runtime={runtime_ms}ms"))
                .arg(format!("--write_lat_log={prefix}"));
            match zone {
                Zone::Hot => command.arg(format!("--size={}", args.hot)),
                Zone::Mixed(h) => {
                    let hot_pct = args.hot as f64 * 100.0 / args.span as f64;
                    command.arg(format!("--size={}", args.span)).arg(format!(
                        "--random_distribution=zoned:{h}/{hot_pct:.6}:{}/{:.6}",
                        100 - h,
                        100.0 - hot_pct
                    ))
                }
                _ => command.arg(format!("--size={}", args.span)),
            };
        }
    }
    let status = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    if !status.status.success() {
        return Err(format!(
            "fio ({name}) failed ({}): {}",
            status.status,
            String::from_utf8_lossy(&status.stderr).trim()
        ));
    }
    Ok(prefix)
}

/// Reads fio's per-request latency logs (`<prefix>_lat.<job>.log`: msec, ns, dir, bs,
/// offset): the IOPS over the run and the latencies, ns, of the hot-zone reads, the cold-zone
/// reads and the writes.
fn read_lat_logs(
    dir: &Path,
    prefix: &str,
    hot_bytes: u64,
    seconds: f64,
) -> Result<(f64, [Vec<u64>; 3]), String> {
    let stem = Path::new(prefix).file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let (mut hot, mut cold, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    let entries = std::fs::read_dir(dir).map_err(|e| e.to_string())?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !(name.starts_with(&format!("{stem}_lat.")) && name.ends_with(".log")) {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).map_err(|e| e.to_string())?;
        for line in text.lines() {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let (Some(ns), Some(dir), Some(offset)) = (fields.get(1), fields.get(2), fields.get(4))
            else {
                continue;
            };
            let (Ok(ns), Ok(offset)) = (ns.parse::<u64>(), offset.parse::<u64>()) else {
                continue;
            };
            match (*dir, offset < hot_bytes) {
                ("1", _) => writes.push(ns),
                (_, true) => hot.push(ns),
                (_, false) => cold.push(ns),
            }
        }
        let _ = std::fs::remove_file(entry.path());
    }
    let total = hot.len() + cold.len() + writes.len();
    if total == 0 {
        return Err(format!("fio wrote no latency log ({prefix}_lat.*.log)"));
    }
    Ok((total as f64 / seconds, [hot, cold, writes]))
}

/// p50, p90, p99 in µs.
fn percentiles_us(mut ns: Vec<u64>) -> [f64; 3] {
    quantiles(&mut ns, [0.5, 0.9, 0.99]).map(|v| v / 1e3)
}

fn table(args: &MixedArgs, run: &Run, report: &Report) -> String {
    let (machine, t0, rows) = (&report.machine, report.unloaded_hit_us, &report.rows);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pmcache bench mixed: 4 KiB random reads ({}% writes) over NBD (fio {}), mode {}, backing \
         store latency {} (requests overlap without limit), span {} MiB, hot zone {} MiB cached \
         first, cache {} MiB; {} s per run, medians of {} runs; {} CPUs, kernel {}",
        args.writes,
        machine.fio,
        args.mode,
        args.latency,
        args.span >> 20,
        args.hot >> 20,
        args.cache_size >> 20,
        run.seconds,
        run.runs,
        machine.cpus,
        machine.kernel
    );
    let _ = writeln!(
        out,
        "hot/cold: client-side latency (fio, per request by offset) of the hot-zone and cold-zone \
         reads; server: pmcache's own hit/miss histograms (hand-over to answer); bound = min(all-hit \
         IOPS, N / (s L + (1-s) t0)), s = the share of requests to the store (misses, writes at the \
         store's latency), t0 = unloaded hit p50 = {t0:.1} µs"
    );
    let _ = writeln!(
        out,
        "{:>5} {:>3} {:>6} {:>6} {:>9} {:>9} {:>6} {:>20} {:>11} {:>20} {:>20} {:>18} {:>6}",
        "conns",
        "QD",
        "hits",
        "writes",
        "IOPS",
        "bound",
        "/bound",
        "hot p50/p90/p99 µs",
        "vs all-hit",
        "cold p50/p90/p99 µs",
        "write p50/p90/p99 µs",
        "server hit/miss p50",
        "hit %"
    );
    let mut all_hit: Option<&Measured> = None;
    for r in rows {
        let m = &r.median;
        if r.hit_pct == Some(100) && r.write_pct == 0 {
            all_hit = Some(m);
        }
        let vs = match (r.hit_pct, all_hit) {
            (Some(h), Some(a)) if h < 100 || r.write_pct > 0 => {
                format!("{:.2}x/{:.2}x", m.hot_us[0] / a.hot_us[0], m.hot_us[1] / a.hot_us[1])
            }
            _ => "-".into(),
        };
        let three = |v: [f64; 3]| {
            format!("{}/{}/{}", opt(Some(v[0]), 0), opt(Some(v[1]), 0), opt(Some(v[2]), 0))
        };
        let _ = writeln!(
            out,
            "{:>5} {:>3} {:>6} {:>6} {:>9.0} {:>9} {:>6} {:>20} {:>11} {:>20} {:>20} {:>18} {:>6.1}",
            r.conns,
            r.qd,
            r.hit_pct.map_or("store".into(), |h| format!("{h}%")),
            format!("{}%", r.write_pct),
            m.iops,
            opt(r.bound_iops, 0),
            opt(r.bound_iops.map(|b| m.iops / b), 2),
            three(m.hot_us),
            vs,
            three(m.cold_us),
            three(m.write_us),
            format!(
                "{}/{} µs",
                opt(Some(m.server_hit_us[0]), 1),
                opt(Some(m.server_miss_us[0]), 0)
            ),
            m.hit_ratio * 100.0,
        );
    }
    out
}
