//! `pmcache bench tls`: what TLS costs a client of `pmcache serve` on 4 KiB random reads.
//!
//! One server (`--mode writethrough --tls=on` with fresh X.509 credentials, a cache medium in
//! `/dev/shm` larger than the span, listening on a unix socket) serves both kinds of client,
//! so the two see the same cache: fio's nbd engine in clear (`nbd+unix://`) and over TLS
//! (`nbds+unix://`: GnuTLS in libnbd, rustls in the server). A sequential write pass in clear
//! first puts every block of the span in the cache (write-through: nothing is dirty, no
//! cleaner runs), so every measured read is a hit and the figure is the protocol's cost, not
//! the disk's. The runs alternate in clear and over TLS, the first of each pair swapped from
//! run to run; the table gives the medians of IOPS and latency and the median of the per-run
//! IOPS ratios (TLS / clear).
//!
//! TLS-PSK (OpenSSL in the server) is not measured: fio's engine connects with
//! `nbd_connect_uri`, and libnbd refuses a `tls-psk-file` in a URI unless the program allows
//! local files, which fio does not. The X.509 client finds its CA in `$HOME/.pki/libnbd`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use pmcache_frontend::units::{human, parse_nonzero_size};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::fio::{FioResult, FioRun, FioSpec, FioTarget};
use crate::harness::machine::{Machine, tool_version};
use crate::harness::output::{opt, progress};
use crate::harness::process::catch_interrupts;
use crate::harness::scratch::ScratchArgs;
use crate::harness::servers::ServeOptions;
use crate::harness::stats::median;

/// Bytes of one read.
const BLOCK_BYTES: u64 = 4096;

/// Arguments of `pmcache bench tls`.
#[derive(clap::Args, Debug, Clone)]
pub struct TlsArgs {
    /// Span of the random offsets (the cache holds all of it).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "256M")]
    pub span: u64,
    /// Requests in flight (fio iodepth, one connection).
    #[arg(long, default_value_t = 16)]
    pub qd: usize,
    /// Where the files go, and fio.
    #[command(flatten)]
    pub scratch: ScratchArgs,
}

/// One kind of client's figures.
#[derive(Debug, Clone, Serialize)]
struct Row {
    client: &'static str,
    iops_median: Option<f64>,
    lat_us_p50_median: Option<f64>,
    lat_us_p99_median: Option<f64>,
    runs: Vec<f64>,
}

/// What `bench tls` found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    machine: Machine,
    openssl: String,
    seconds: f64,
    runs: usize,
    span_bytes: u64,
    qd: usize,
    plain: Row,
    tls: Row,
    /// Median of the per-run ratios of TLS IOPS to plain IOPS.
    tls_ratio_median: Option<f64>,
}

impl Experiment for TlsArgs {
    const NAME: &'static str = "tls";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(5), seconds: Some(10.0), quick_runs: 2, quick_seconds: 2.0 };
    type Report = Report;

    fn run(&self, run: &Run) -> Result<Report, String> {
        let (seconds, runs) = (run.seconds, run.runs);
        let span = if run.quick { 64 << 20 } else { self.span };
        if span < BLOCK_BYTES {
            return Err("--span must be at least 4 KiB".into());
        }
        // "OpenSSL 3.0.19 27 Jan 2026 (Library: ...)": the name and the version.
        let openssl = tool_version("openssl", "version", "openssl")?
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        catch_interrupts();
        let (fio_version, scratch) = self.scratch.prepare(Self::NAME, false)?;
        scratch.sparse(span)?;
        let (server_pki, home) = credentials(scratch.dir())?;
        let options = ServeOptions {
            mode: Some(pmcache_engine::CacheMode::WriteThrough),
            tls_certificates: Some(&server_pki),
            ..ServeOptions::default()
        };
        // The whole span and the engine's headroom.
        let server = scratch.serve(span + span / 4 + (16 << 20), 16, &[], None, options)?;
        let plain_uri = server.uri();
        let tls_uri = plain_uri.replacen("nbd+unix://", "nbds+unix://", 1);
        progress(&format!("writing the span ({}) into the cache ...", human(span)));
        warm(&self.scratch.fio, &plain_uri, span)?;

        let spec = |target| FioSpec {
            fio: &self.scratch.fio,
            target,
            rw: "randread",
            bs: BLOCK_BYTES,
            qd: self.qd,
            jobs: 1,
            span,
            seconds,
            out_dir: scratch.dir(),
            timeline: false,
            cpus: None,
        };
        let (mut plain, mut tls) = (Vec::new(), Vec::new());
        for turn in 0..runs {
            for over_tls in [turn % 2 == 1, turn % 2 == 0] {
                progress(&format!(
                    "run {}/{runs}: {}",
                    turn + 1,
                    if over_tls { "TLS" } else { "plain" }
                ));
                if over_tls {
                    let target = FioTarget::NbdTls { uri: tls_uri.clone(), home: home.clone() };
                    tls.push(FioRun::run(&spec(target))?);
                } else {
                    plain.push(FioRun::run(&spec(FioTarget::Nbd(plain_uri.clone())))?);
                }
            }
        }
        progress("");
        server.stop()?;
        Ok(Report {
            machine: Machine::probe(fio_version, None),
            openssl,
            seconds,
            runs,
            span_bytes: span,
            qd: self.qd,
            tls_ratio_median: median(plain.iter().zip(&tls).map(|(p, t)| t.iops / p.iops)),
            plain: row("plain", &plain),
            tls: row("tls-x509", &tls),
        })
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        table(report)
    }
}

fn row(client: &'static str, results: &[FioResult]) -> Row {
    Row {
        client,
        iops_median: median(results.iter().map(|r| r.iops)),
        lat_us_p50_median: median(results.iter().map(|r| r.lat_ns_p50 / 1e3)),
        lat_us_p99_median: median(results.iter().map(|r| r.lat_ns_p99 / 1e3)),
        runs: results.iter().map(|r| r.iops).collect(),
    }
}

fn table(r: &Report) -> String {
    let m = &r.machine;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# bench tls: 4 KiB random reads, every one a cache hit, QD {}, 1 connection, unix \
         socket; span {}; medians of {} runs of {} s",
        r.qd,
        human(r.span_bytes),
        r.runs,
        r.seconds
    );
    let _ = writeln!(out, "# host: {} CPUs, {}, kernel {}", m.cpus, m.cpu_model, m.kernel);
    let _ = writeln!(
        out,
        "# {}; client libnbd (GnuTLS), server rustls (X.509, a P-256 certificate made by {})",
        m.fio, r.openssl
    );
    let _ = writeln!(out, "client        iops  lat_p50_us  lat_p99_us  ratio");
    for (row, ratio) in [(&r.plain, None), (&r.tls, r.tls_ratio_median)] {
        let _ = writeln!(
            out,
            "{:<9} {:>8}  {:>10}  {:>10}  {}",
            row.client,
            opt(row.iops_median, 0),
            opt(row.lat_us_p50_median, 1),
            opt(row.lat_us_p99_median, 1),
            ratio.map_or_else(|| "1.00x".into(), |x| format!("{x:.2}x"))
        );
    }
    out
}

/// One sequential write pass of the span in clear: every block then sits in the cache.
fn warm(fio: &str, uri: &str, span: u64) -> Result<(), String> {
    let out = Command::new(fio)
        .args(["--name=warm", "--ioengine=nbd", "--rw=write", "--bs=1M", "--iodepth=8"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--size={span}"))
        .output()
        .map_err(|e| format!("cannot run {fio}: {e}"))?;
    if !out.status.success() {
        return Err(format!("fio's warm-up pass failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

const OPENSSL_CONFIG: &str = "[req]\ndistinguished_name = dn\n[dn]\n\
    [ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n\
    [server]\nbasicConstraints = critical,CA:FALSE\n\
    keyUsage = critical,digitalSignature,keyEncipherment\nextendedKeyUsage = serverAuth\n\
    subjectAltName = IP:127.0.0.1,DNS:localhost\n";

/// A CA and a server certificate (P-256) made by the `openssl` command under `dir`: the
/// server's credentials directory, and a `HOME` whose `.pki/libnbd` holds the CA for libnbd.
fn credentials(dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    let work = dir.join("pki");
    let home = dir.join("home");
    let libnbd = home.join(".pki").join("libnbd");
    for d in [&work, &libnbd] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    std::fs::write(work.join("openssl.cnf"), OPENSSL_CONFIG).map_err(|e| e.to_string())?;
    let key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -config openssl.cnf";
    for command in [
        format!("req -new -x509 -days 2 -extensions ca {key} -keyout ca-key.pem -out ca-cert.pem"),
        format!("req -new {key} -keyout server-key.pem -out server.csr"),
        "x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -set_serial 2 -days 2 \
         -extfile openssl.cnf -extensions server -out server-cert.pem"
            .to_owned(),
    ] {
        let subject = ["-subj", "/CN=pmcache bench"];
        let args: Vec<&str> = command.split(' ').collect();
        let subj: &[&str] = if args[0] == "req" { &subject } else { &[] };
        let out = Command::new("openssl")
            .current_dir(&work)
            .args(&args)
            .args(subj)
            .output()
            .map_err(|e| format!("cannot run openssl: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!("openssl {command}: {err}"));
        }
    }
    std::fs::copy(work.join("ca-cert.pem"), libnbd.join("ca-cert.pem"))
        .map_err(|e| e.to_string())?;
    Ok((work, home))
}
