//! `pmcache bench memory`: the resident memory of a pmcache server (as `pmcache serve` runs it,
//! served in this process through `pmcache_serve`) with 16 connections idle and busy.
//!
//! The server's own memory is what the process's anonymous resident set (`RssAnon`: heap,
//! stacks, per-connection buffers) grew by from just before the server started; the cache
//! medium it maps from /dev/shm is counted apart (`RssShmem`, likewise). Each run starts a fresh server and measures, in turn:
//! - no connection;
//! - 16 connections that finished the handshake and send nothing;
//! - 16 fio connections (fio's nbd engine) of 4 KiB random reads and writes, QD 16;
//! - 16 fio connections of 1 MiB random reads and writes, QD 4 (each connection's buffers
//!   grow with its requests, up to the largest request the server takes).
//!
//! Busy figures are the peak of samples taken every 100 ms. Medians over the runs.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use pmcache_frontend::units::parse_nonzero_size;
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::fio::{FioRun, FioSpec, FioTarget};
use crate::harness::machine::Machine;
use crate::harness::output::progress;
use crate::harness::process::check_interrupted;
use crate::harness::scratch::{Scratch, ScratchArgs};
use crate::harness::servers::{ServeOptions, Server};
use crate::harness::stats::median;

/// Connections of every measurement.
const CONNECTIONS: usize = 16;

/// Arguments of `pmcache bench memory`.
#[derive(clap::Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Size of the backing file and span of the random offsets (e.g. 2G).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "2G")]
    pub span: u64,
    /// Size of the cache medium (e.g. 256M).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "256M")]
    pub cache_size: u64,
    /// Where the files go, and fio.
    #[command(flatten)]
    pub scratch: ScratchArgs,
}

/// Resident memory of the server, KiB.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Rss {
    anon_kib: u64,
    shmem_kib: u64,
}

/// The resident memory of process `pid` above `base`.
fn rss_over(pid: u32, base: &Rss) -> Result<Rss, String> {
    let now = rss_of(pid)?;
    Ok(Rss {
        anon_kib: now.anon_kib.saturating_sub(base.anon_kib),
        shmem_kib: now.shmem_kib.saturating_sub(base.shmem_kib),
    })
}

fn rss_of(pid: u32) -> Result<Rss, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .ok_or_else(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(Rss { anon_kib: field("RssAnon:")?, shmem_kib: field("RssShmem:")? })
}

/// The measured states, in order.
const STATES: [&str; 4] = ["no connection", "16 idle", "16 busy, 4 KiB QD16", "16 busy, 1 MiB QD4"];

#[derive(Debug, Clone, Serialize)]
struct Row {
    state: &'static str,
    anon_kib_median: Option<f64>,
    shmem_kib_median: Option<f64>,
    anon_kib_runs: Vec<u64>,
}

/// What `bench memory` found.
#[derive(Debug, Serialize)]
pub struct Report {
    machine: Machine,
    connections: usize,
    cache_bytes: u64,
    span_bytes: u64,
    seconds: f64,
    runs: usize,
    rows: Vec<Row>,
}

/// Opens a connection on the server's unix socket and negotiates the default export with
/// `NBD_OPT_GO` (then leaves it idle).
fn idle_connection(socket: &Path) -> Result<UnixStream, String> {
    const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
    const OPT_GO: u32 = 7;
    const REP_ACK: u32 = 1;
    let err = |e: std::io::Error| format!("idle connection: {e}");
    let mut s = UnixStream::connect(socket).map_err(err)?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(err)?;
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).map_err(err)?;
    let mut hello = 3u32.to_be_bytes().to_vec();
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&OPT_GO.to_be_bytes());
    hello.extend_from_slice(&6u32.to_be_bytes());
    hello.extend_from_slice(&[0u8; 6]); // empty name, no info requests
    s.write_all(&hello).map_err(err)?;
    loop {
        let mut header = [0u8; 20];
        s.read_exact(&mut header).map_err(err)?;
        let reply_type = u32::from_be_bytes(header[12..16].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).map_err(err)?;
        match reply_type {
            REP_ACK => return Ok(s),
            t if t & 0x8000_0000 != 0 => return Err(format!("GO refused ({t:#x})")),
            _ => {}
        }
    }
}

/// Waits (up to 30 s) until the server has no connection open: a step's clients have gone
/// before the next step's connect, so none is refused at the connection limit.
fn wait_for_no_connection(server: &Server) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let open = server.stats()?["connections_open"].as_u64();
        match open {
            Some(0) => return Ok(()),
            Some(n) if started.elapsed() > Duration::from_secs(30) => {
                return Err(format!("{n} connections still open 30 s after their clients ended"));
            }
            Some(_) => std::thread::sleep(Duration::from_millis(50)),
            None => return Err("the server's stats have no connections_open".into()),
        }
    }
}

/// One run: a fresh server, the four states.
fn measure_run(
    args: &MemoryArgs,
    scratch: &Scratch,
    span: u64,
    cache: u64,
    seconds: f64,
) -> Result<Vec<Rss>, String> {
    let base = rss_of(std::process::id())?;
    let server = scratch.serve(cache, CONNECTIONS, &[], None, ServeOptions::default())?;
    let socket = scratch.path("pmcache.sock");
    let pid = server.pid();
    std::thread::sleep(Duration::from_millis(500));
    let mut found = vec![rss_over(pid, &base)?];
    let idle: Vec<UnixStream> =
        (0..CONNECTIONS).map(|_| idle_connection(&socket)).collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_secs(1));
    found.push(rss_over(pid, &base)?);
    drop(idle);
    for (bs, qd) in [(4096, 16), (1 << 20, 4)] {
        check_interrupted()?;
        wait_for_no_connection(&server)?;
        let spec = FioSpec {
            fio: &args.scratch.fio,
            target: FioTarget::Nbd(server.uri()),
            rw: "randrw",
            bs,
            qd,
            jobs: CONNECTIONS,
            span,
            seconds,
            out_dir: scratch.dir(),
            timeline: false,
            cpus: None,
        };
        let mut fio = FioRun::spawn(&spec)?;
        let mut peak = Rss::default();
        let started = Instant::now();
        while fio.running() {
            let now = rss_over(pid, &base)?;
            if now.anon_kib > peak.anon_kib {
                peak = now;
            }
            if started.elapsed() > Duration::from_secs_f64(seconds + 60.0) {
                fio.interrupt();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        fio.wait()?;
        found.push(peak);
    }
    server.stop()?;
    Ok(found)
}

impl Experiment for MemoryArgs {
    const NAME: &'static str = "memory";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(3), seconds: Some(10.0), quick_runs: 1, quick_seconds: 2.0 };
    type Report = Report;

    fn run(&self, run: &Run) -> Result<Report, String> {
        let (span, cache, seconds, runs) = if run.quick {
            (256 << 20, 32 << 20, run.seconds, run.runs)
        } else {
            (self.span, self.cache_size, run.seconds, run.runs)
        };
        let (fio_version, scratch) = self.scratch.prepare(Self::NAME, false)?;
        let machine = Machine::probe(fio_version, None);
        scratch.sparse(span)?;
        let mut samples: Vec<Vec<Rss>> = vec![Vec::new(); STATES.len()];
        for run in 0..runs {
            progress(&format!("run {}/{runs}", run + 1));
            let found = measure_run(self, &scratch, span, cache, seconds)?;
            for (state, rss) in samples.iter_mut().zip(found) {
                state.push(rss);
            }
        }
        progress("");
        let _ = std::fs::remove_file(&scratch.backing);
        let rows: Vec<Row> = STATES
            .iter()
            .zip(&samples)
            .map(|(state, s)| Row {
                state,
                anon_kib_median: median(s.iter().map(|r| r.anon_kib as f64)),
                shmem_kib_median: median(s.iter().map(|r| r.shmem_kib as f64)),
                anon_kib_runs: s.iter().map(|r| r.anon_kib).collect(),
            })
            .collect();
        Ok(Report {
            machine,
            connections: CONNECTIONS,
            cache_bytes: cache,
            span_bytes: span,
            seconds,
            runs,
            rows,
        })
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        table(self, report)
    }
}

fn table(args: &MemoryArgs, report: &Report) -> String {
    let mut out = String::new();
    let (cache, span, seconds, runs) =
        (report.cache_bytes, report.span_bytes, report.seconds, report.runs);
    let _ = writeln!(
        out,
        "pmcache server's resident memory: {CONNECTIONS} connections, cache {} MiB in {}, \
         backing {} MiB, busy runs {seconds} s; median of {runs} run(s)",
        cache >> 20,
        args.scratch.shm_dir.display(),
        span >> 20
    );
    let _ = writeln!(
        out,
        "{:<22} {:>14} {:>18}   per run (RssAnon MiB)",
        "state", "RssAnon MiB", "RssShmem MiB"
    );
    let mib = |kib: Option<f64>| kib.map_or("-".to_string(), |k| format!("{:.1}", k / 1024.0));
    for row in &report.rows {
        let runs: Vec<String> =
            row.anon_kib_runs.iter().map(|k| format!("{:.1}", *k as f64 / 1024.0)).collect();
        let _ = writeln!(
            out,
            "{:<22} {:>14} {:>18}   {}",
            row.state,
            mib(row.anon_kib_median),
            mib(row.shmem_kib_median),
            runs.join(", ")
        );
    }
    out
}
