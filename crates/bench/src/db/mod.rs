//! `pmcache bench db`: databases on ext4 over pmcache against the same without it.
//!
//! pgbench's TPC-B-like workload (PostgreSQL 15, a database of `--scale`, about 16 MB a
//! scale unit, chosen 2–4× the cache) and SQLite's own `speedtest1`, on ext4 over each
//! layer. On this host ([`bed`]): pmcache (`--cache` in shm, write-back, served on a unix
//! socket in this process → nbdfuse → a loop device with direct I/O → ext4) against ext4 on a
//! loop device (direct I/O) over a raw backing file of the same kind, both files on the disk
//! under `--dir`. With `--guest` ([`guest`]): one QEMU boot of `scripts/guest/db-bench.sh`
//! with pmcache (ublk, its medium on an emulated NVDIMM), bcache, dm-cache and
//! dm-writecache, each on an NVDIMM of the cache's size in front of a throttled emulated NVMe
//! namespace, rublk's ublk loop target on such a namespace (the ublk path with no cache), and
//! the bare namespace.
//!
//! The page cache would hide every layer (the databases fit in memory many times over): the
//! databases' processes run in a memory cgroup of `--db-memory` (page cache included), with
//! PostgreSQL's own `shared_buffers` small, and every measurement starts after a sync and a
//! drop of the caches. The layers take turns run by run, the first of each run alternating;
//! each run's ratios are taken to the baseline measured in that run, then their medians.

pub mod bed;
pub mod cgroup;
pub mod guest;
pub mod pgbench;
pub mod postgres;
pub mod speedtest1;
pub mod summary;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use pmcache_frontend::units::{human, parse_nonzero_size};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::machine::{cpu_model, cpus, kernel};
use crate::harness::output::{opt, progress};
use crate::harness::process::{catch_interrupts, check_interrupted};
use bed::{Layer, LayerKind, LayerSpec};
use cgroup::{MemoryCgroup, drop_caches};
use postgres::{Cluster, PgSettings};
use summary::{LayerSummary, PgbenchPoint, SpeedtestPoint};

/// The host's layer through pmcache.
const PMCACHE: &str = "pmcache";
/// The host's baseline: ext4 on the raw backing file.
const RAW: &str = "ext4-raw";
/// pmcache's path without a cache: `nbdkit file` through nbdfuse and the loop device.
const NBDKIT: &str = "nbdkit-file";

/// Arguments of `pmcache bench db`.
#[derive(clap::Args, Debug, Clone)]
pub struct DbArgs {
    /// pmcache's cache (the guest's caches are its NVDIMMs, sized by its script).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "64M")]
    pub cache: u64,
    /// pgbench's scale factor (about 16 MB of database each): the database 2–4× the cache.
    #[arg(long, default_value_t = 8)]
    pub scale: u32,
    /// pgbench's clients.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// pgbench's threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// PostgreSQL's shared_buffers (its own cache; small, so the layers are read).
    #[arg(long, default_value = "16MB")]
    pub shared_buffers: String,
    /// Memory of the databases' processes, page cache included (a memory cgroup).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "96M")]
    pub db_memory: u64,
    /// Each layer's file system (and backing file) size.
    #[arg(long, value_parser = parse_nonzero_size, default_value = "1G")]
    pub fs_size: u64,
    /// speedtest1's --size (100 on the host, 20 in the guest when not given).
    #[arg(long)]
    pub speedtest1_size: Option<u32>,
    /// The speedtest1 binary (default: what scripts/db/build-speedtest1.sh built).
    #[arg(long, value_name = "PATH")]
    pub speedtest1: Option<PathBuf>,
    /// Directory of the backing files: on a disk, not a tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Directory of pmcache's cache medium (emulated PM).
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Leave out the nbdkit-file layer (pmcache's path, nbdfuse and the loop device, with
    /// `nbdkit file` instead of a cache).
    #[arg(long)]
    pub no_nbdkit: bool,
    /// Boot the guest bed (scripts/guest/db-bench.sh): pmcache beside bcache, dm-cache,
    /// dm-writecache, the ublk path with no cache (rublk's loop target) and the bare NVMe
    /// namespace.
    #[arg(long)]
    pub guest: bool,
    /// Read the guest's result lines from this file (kept by an earlier --guest run) instead
    /// of booting.
    #[arg(long, value_name = "FILE")]
    pub guest_log: Option<PathBuf>,
    /// The guest's backing stores: NVMe namespaces throttled to an SSD's cost (4000 IOPS,
    /// 500 MB/s) or a disk's (200 IOPS, 150 MB/s).
    #[arg(long, default_value = "ssd", value_parser = ["ssd", "hdd"])]
    pub guest_backing: String,
    /// With --guest: keep the guest's result lines in this file.
    #[arg(long, value_name = "FILE")]
    pub guest_out: Option<PathBuf>,
}

/// The settings a report was measured with.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// Runs (each layer once per run).
    pub runs: usize,
    /// Seconds of each pgbench run.
    pub seconds: u64,
    /// pmcache's cache (host), or each layer's cache (guest).
    pub cache_bytes: u64,
    /// pgbench's scale.
    pub scale: u32,
    /// pgbench's clients.
    pub clients: usize,
    /// pgbench's threads.
    pub threads: usize,
    /// PostgreSQL's shared_buffers.
    pub shared_buffers: String,
    /// The databases' memory cgroup limit.
    pub db_memory_bytes: u64,
    /// Each file system's size.
    pub fs_bytes: u64,
    /// speedtest1's --size.
    pub speedtest1_size: u32,
    /// The guest's backing stores (`ssd`, `hdd`); none on the host.
    pub backing: Option<String>,
}

/// What `bench db` found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `host` or `guest`.
    pub bed: &'static str,
    /// The kernel the layers ran on.
    pub kernel: String,
    /// CPUs.
    pub cpus: usize,
    /// The CPU's model (the host's).
    pub cpu_model: String,
    /// The settings.
    pub settings: Settings,
    /// The pgbench database's size on each layer after `pgbench -i`, bytes.
    pub database_bytes: BTreeMap<String, u64>,
    /// The layers, in the tables' order.
    pub layers: Vec<String>,
    /// The layer every ratio is taken to.
    pub baseline: String,
    /// The kernel layer of the highest median TPS (guest).
    pub best_kernel_layer: Option<String>,
    /// Each pgbench run.
    pub pgbench: Vec<PgbenchPoint>,
    /// Each speedtest1 run.
    pub speedtest1: Vec<SpeedtestPoint>,
    /// Medians and ratios.
    pub summary: Vec<LayerSummary>,
    /// What the guest printed besides its points.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest: Option<guest::GuestRun>,
    /// How to read the figures.
    pub notes: Vec<String>,
}

impl Experiment for DbArgs {
    const NAME: &'static str = "db";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(5), seconds: Some(20.0), quick_runs: 2, quick_seconds: 3.0 };
    type Report = Report;

    fn run(&self, run: &Run) -> Result<Report, String> {
        if self.guest || self.guest_log.is_some() {
            self.run_guest(run)
        } else {
            self.run_host(run)
        }
    }

    fn table(&self, report: &Report, _run: &Run) -> String {
        table(report)
    }
}

impl DbArgs {
    fn settings(&self, run: &Run, guest: bool) -> Settings {
        let speedtest1_size = self.speedtest1_size.unwrap_or(if guest { 20 } else { 100 });
        Settings {
            runs: run.runs,
            seconds: run.seconds.round().max(1.0) as u64,
            cache_bytes: if run.quick { 16 << 20 } else { self.cache },
            scale: if run.quick { 1 } else { self.scale },
            clients: self.clients,
            threads: self.threads.min(self.clients),
            shared_buffers: self.shared_buffers.clone(),
            db_memory_bytes: self.db_memory,
            fs_bytes: if run.quick { 256 << 20 } else { self.fs_size },
            speedtest1_size: if run.quick { speedtest1_size.min(10) } else { speedtest1_size },
            backing: guest.then(|| self.guest_backing.clone()),
        }
    }

    fn run_host(&self, run: &Run) -> Result<Report, String> {
        if !rustix::process::geteuid().is_root() {
            return Err("bench db needs root (loop devices, mounts, cgroups, drop_caches)".into());
        }
        let settings = self.settings(run, false);
        let pg_bin = postgres::bin_dir()?;
        let speedtest1_bin = speedtest1::binary(self.speedtest1.as_ref())?;
        catch_interrupts();
        let work = tempfile::Builder::new()
            .prefix("pmcache-bench-db-")
            .tempdir()
            .map_err(|e| format!("cannot create a scratch directory: {e}"))?;
        // PostgreSQL's user reaches its directories under it.
        std::fs::set_permissions(work.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        let medium = self.shm_dir.join(format!("pmcache-bench-db-{}.pm", std::process::id()));
        let cgroup = MemoryCgroup::create(
            &format!("pmcache-bench-db-{}", std::process::id()),
            settings.db_memory_bytes,
        )?;
        let pg = PgSettings {
            shared_buffers: settings.shared_buffers.clone(),
            scale: settings.scale,
            clients: settings.clients,
            threads: settings.threads,
        };
        let mut beds: Vec<(Layer, Cluster)> = Vec::new();
        let mut database_bytes = BTreeMap::new();
        let mut kinds = vec![(PMCACHE, LayerKind::Pmcache(&medium, settings.cache_bytes))];
        if !self.no_nbdkit {
            kinds.push((NBDKIT, LayerKind::Nbdkit));
        }
        kinds.push((RAW, LayerKind::Raw));
        for (name, kind) in kinds {
            progress(&format!("{name}: ext4, PostgreSQL, pgbench -i -s {}", settings.scale));
            let layer = Layer::create(&LayerSpec {
                name,
                disk_dir: &self.dir,
                fs_bytes: settings.fs_bytes,
                work: &work.path().join(name),
                kind,
            })?;
            let mut cluster =
                Cluster::init(&pg_bin, &layer.mount.join("pgdata"), &layer.work.join("run"), &pg)?;
            cluster.start(&cgroup)?;
            cluster.pgbench_init(&pg, &cgroup)?;
            database_bytes.insert(name.to_string(), cluster.database_bytes()?);
            cluster.stop()?;
            beds.push((layer, cluster));
        }
        let mut pgbench_points = Vec::new();
        let mut speedtest_points = Vec::new();
        for n in 1..=settings.runs {
            // The order rotates from run to run: each layer goes first in turn.
            let order: Vec<usize> = (0..beds.len()).map(|i| (i + n - 1) % beds.len()).collect();
            for &i in &order {
                let (layer, cluster) = &mut beds[i];
                check_interrupted()?;
                progress(&format!("run {n}/{}: pgbench on {}", settings.runs, layer.name));
                drop_caches()?;
                let before = layer.figures();
                let cpu_before = layer.cpu_seconds();
                cluster.start(&cgroup)?;
                let figures = cluster.pgbench_run(&pg, settings.seconds, &cgroup);
                cluster.stop()?;
                let figures = figures?;
                let pmcache = layer.figures().zip(before).map(|(after, b)| after.since(&b));
                let cpu_after = layer.cpu_seconds();
                let used = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
                pgbench_points.push(PgbenchPoint {
                    layer: layer.name.to_string(),
                    run: n,
                    tps: figures.tps,
                    transactions: figures.transactions,
                    latency_ms_p50: figures.latency_ms_p50,
                    latency_ms_p99: figures.latency_ms_p99,
                    server_cpu_s: used(cpu_after.0, cpu_before.0),
                    guest_busy_s: None,
                    guest_idle_s: None,
                    nbdfuse_cpu_s: used(cpu_after.1, cpu_before.1),
                    pmcache,
                });
            }
            for &i in &order {
                let layer = &beds[i].0;
                check_interrupted()?;
                progress(&format!("run {n}/{}: speedtest1 on {}", settings.runs, layer.name));
                let db = layer.mount.join("speedtest1.db");
                for suffix in ["", "-journal", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
                }
                drop_caches()?;
                let args =
                    vec!["--size".to_string(), settings.speedtest1_size.to_string(), db_str(&db)];
                let out = cgroup
                    .command(&speedtest1_bin.to_string_lossy(), &args)
                    .output()
                    .map_err(|e| format!("speedtest1: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "speedtest1 on {} failed ({}): {}",
                        layer.name,
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    ));
                }
                let parsed = speedtest1::parse(&String::from_utf8_lossy(&out.stdout))?;
                speedtest_points.push(SpeedtestPoint {
                    layer: layer.name.to_string(),
                    run: n,
                    total_s: parsed.total_s,
                    tests: parsed.tests,
                });
            }
        }
        progress("stopping: pmcache writes its dirty blocks back");
        drop(beds);
        progress("");
        let layers: Vec<String> = [PMCACHE, NBDKIT, RAW]
            .into_iter()
            .filter(|l| database_bytes.contains_key(*l))
            .map(String::from)
            .collect();
        let summary = summary::summarize(&layers, RAW, None, &pgbench_points, &speedtest_points);
        let notes = vec![
            format!(
                "Page cache: PostgreSQL (shared_buffers {}), pgbench and speedtest1 run in a \
                 memory cgroup of {}, page cache included, and the caches are dropped before \
                 each measurement: the databases' reads beyond that reach the layer. pmcache's \
                 backing file is opened with O_DIRECT, the loop devices do direct I/O.",
                settings.shared_buffers,
                human(settings.db_memory_bytes)
            ),
            "The backing files are on the same disk; pmcache's medium is in shm (DRAM \
             standing in for PM). nbdkit-file is pmcache's path without a cache (nbdkit's file \
             plugin, cache=none, through the same nbdfuse and loop device): what the path \
             costs by itself."
                .into(),
        ];
        Ok(Report {
            bed: "host",
            kernel: kernel(),
            cpus: cpus(),
            cpu_model: cpu_model(),
            settings,
            database_bytes,
            layers,
            baseline: RAW.into(),
            best_kernel_layer: None,
            pgbench: pgbench_points,
            speedtest1: speedtest_points,
            summary,
            guest: None,
            notes,
        })
    }

    fn run_guest(&self, run: &Run) -> Result<Report, String> {
        let settings = self.settings(run, true);
        let text = match &self.guest_log {
            Some(path) => {
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => {
                let kept;
                let out = match &self.guest_out {
                    Some(path) => path.clone(),
                    None => {
                        kept = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
                        kept.path().to_path_buf()
                    }
                };
                let args: Vec<String> = [
                    ("--runs", settings.runs.to_string()),
                    ("--seconds", settings.seconds.to_string()),
                    ("--scale", settings.scale.to_string()),
                    ("--cache-mib", (settings.cache_bytes >> 20).to_string()),
                    ("--clients", settings.clients.to_string()),
                    ("--threads", settings.threads.to_string()),
                    ("--shared-buffers", settings.shared_buffers.clone()),
                    ("--db-memory-mib", (settings.db_memory_bytes >> 20).to_string()),
                    ("--speedtest1-size", settings.speedtest1_size.to_string()),
                    ("--backing", self.guest_backing.clone()),
                ]
                .into_iter()
                .flat_map(|(k, v)| [k.to_string(), v])
                .collect();
                guest::run_script(&args, &out)?;
                std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?
            }
        };
        let run = guest::parse(&text)?;
        report_of_guest(run, settings)
    }
}

fn db_str(path: &std::path::Path) -> String {
    path.to_string_lossy().into_owned()
}

/// The report of a guest run: its settings as the guest printed them where it did.
fn report_of_guest(run: guest::GuestRun, fallback: Settings) -> Result<Report, String> {
    let bed = &run.bed;
    let num = |key: &str| bed[key].as_u64();
    let settings = Settings {
        runs: run.pgbench.iter().map(|p| p.run).max().unwrap_or(0),
        seconds: num("seconds").unwrap_or(fallback.seconds),
        cache_bytes: num("cache_mib").map_or(fallback.cache_bytes, |m| m << 20),
        scale: num("scale").map_or(fallback.scale, |s| s as u32),
        clients: num("clients").map_or(fallback.clients, |c| c as usize),
        threads: num("threads").map_or(fallback.threads, |t| t as usize),
        shared_buffers: bed["shared_buffers"]
            .as_str()
            .map_or(fallback.shared_buffers, str::to_string),
        db_memory_bytes: num("db_memory_mib").map_or(fallback.db_memory_bytes, |m| m << 20),
        fs_bytes: num("fs_mib").map_or(fallback.fs_bytes, |m| m << 20),
        speedtest1_size: num("speedtest1_size").map_or(fallback.speedtest1_size, |s| s as u32),
        backing: bed["backing"].as_str().map(str::to_string).or(fallback.backing),
    };
    let layers: Vec<String> = guest::LAYERS
        .iter()
        .filter(|l| run.pgbench.iter().any(|p| p.layer == **l))
        .map(|l| l.to_string())
        .collect();
    if !layers.iter().any(|l| l == guest::BASELINE) {
        return Err(format!("the guest measured no {} baseline", guest::BASELINE));
    }
    let kernel_layers: Vec<String> = guest::KERNEL_LAYERS.iter().map(|l| l.to_string()).collect();
    let best = summary::best_kernel_layer(&run.pgbench, &kernel_layers);
    let summary = summary::summarize(
        &layers,
        guest::BASELINE,
        best.as_deref(),
        &run.pgbench,
        &run.speedtest1,
    );
    let database_bytes = num("db_bytes")
        .map(|b| layers.iter().map(|l| (l.clone(), b)).collect())
        .unwrap_or_default();
    let notes = vec![
        format!(
            "Guest under QEMU TCG: absolute rates mean nothing, only ratios within the boot. \
             Each cache layer has an emulated NVDIMM of the same size as its cache in front of \
             an NVMe namespace throttled to {}; the database was loaded once (the same tar on \
             every layer) before the runs.",
            match settings.backing.as_deref() {
                Some("hdd") => "a disk's cost (200 IOPS, 150 MB/s)",
                _ => "an SSD's cost (4000 IOPS, 500 MB/s)",
            }
        ),
        format!(
            "Page cache: the databases run in a memory cgroup of {} in the guest, caches \
             dropped before each measurement.",
            human(settings.db_memory_bytes)
        ),
    ];
    Ok(Report {
        bed: "guest",
        kernel: bed["kernel"].as_str().unwrap_or_default().to_string(),
        cpus: num("guest_cpus").unwrap_or(0) as usize,
        cpu_model: cpu_model(),
        settings,
        database_bytes,
        layers,
        baseline: guest::BASELINE.into(),
        best_kernel_layer: best,
        pgbench: run.pgbench.clone(),
        speedtest1: run.speedtest1.clone(),
        summary,
        guest: Some(run),
        notes,
    })
}

/// Where the CPU went in each pgbench run: the guest's busy share and busy time per
/// transaction, the server's and nbdfuse's CPU per transaction; empty without such figures.
fn cpu_table(points: &[PgbenchPoint]) -> String {
    let rows: Vec<&PgbenchPoint> = points
        .iter()
        .filter(|p| {
            p.server_cpu_s.is_some() || p.nbdfuse_cpu_s.is_some() || p.guest_busy_s.is_some()
        })
        .collect();
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(out, "\n## where the CPU goes in each pgbench run (per transaction)");
    let _ = writeln!(
        out,
        "run  {:<13}  {:>8}  {:>11}  {:>11}  {:>11}",
        "layer", "busy_pct", "busy_ms/txn", "server_ms/txn", "nbdfuse_ms/txn"
    );
    for p in rows {
        let per = |s: Option<f64>| s.map(|s| s * 1e3 / p.transactions.max(1) as f64);
        let busy_pct = p.guest_busy_s.zip(p.guest_idle_s).map(|(b, i)| 100.0 * b / (b + i));
        let _ = writeln!(
            out,
            "{:<3}  {:<13}  {:>8}  {:>11}  {:>13}  {:>14}",
            p.run,
            p.layer,
            opt(busy_pct, 0),
            opt(per(p.guest_busy_s), 2),
            opt(per(p.server_cpu_s), 3),
            opt(per(p.nbdfuse_cpu_s), 3)
        );
    }
    out
}

fn table(r: &Report) -> String {
    let s = &r.settings;
    let mut out = String::new();
    let db = r.database_bytes.values().copied().max().unwrap_or(0);
    let _ = writeln!(
        out,
        "# bench db ({}): pgbench TPC-B-like, scale {} (database {} = {:.1}x the {} cache), \
         {} clients, {} threads, {} s a run; speedtest1 --size {}; {} runs, layers alternating",
        r.bed,
        s.scale,
        human(db),
        db as f64 / s.cache_bytes.max(1) as f64,
        human(s.cache_bytes),
        s.clients,
        s.threads,
        s.seconds,
        s.speedtest1_size,
        s.runs
    );
    let _ = writeln!(
        out,
        "# {}: kernel {}, {} CPUs, {}; shared_buffers {}, databases in a {} memory cgroup",
        r.bed,
        r.kernel,
        r.cpus,
        r.cpu_model,
        s.shared_buffers,
        human(s.db_memory_bytes)
    );
    for note in &r.notes {
        let _ = writeln!(out, "# {note}");
    }
    out.push_str(&summary::tables(
        &r.layers,
        &r.baseline,
        r.best_kernel_layer.as_deref(),
        &r.pgbench,
        &r.speedtest1,
        &r.summary,
    ));
    out.push_str(&cpu_table(&r.pgbench));
    let pm: Vec<&PgbenchPoint> = r.pgbench.iter().filter(|p| p.pmcache.is_some()).collect();
    if !pm.is_empty() {
        let _ = writeln!(out, "\n## pmcache's counters over each pgbench run");
        out.push_str(COUNTERS_HEADER);
        for p in pm {
            counters_row(&mut out, p.run, p.pmcache.as_ref().expect("filtered"), "");
        }
    }
    if let Some(g) = &r.guest {
        if !g.pmcache.is_empty() {
            let _ = writeln!(
                out,
                "\n## pmcache's counters in the guest over each pgbench run (* since its start)"
            );
            out.push_str(COUNTERS_HEADER);
            for s in &g.pmcache {
                counters_row(&mut out, s.run, &s.figures, if s.over_the_run { "" } else { " *" });
            }
        }
        for note in &g.notes {
            let _ = writeln!(out, "# guest: {note}");
        }
    }
    out
}

const COUNTERS_HEADER: &str =
    "run  read_hits  read_misses  writes  writebacks  evictions  stalls  dirty_at_end\n";

/// One row of pmcache's counters over a pgbench run, `mark` after it.
fn counters_row(
    out: &mut String,
    run: usize,
    f: &crate::harness::servers::ServerFigures,
    mark: &str,
) {
    let _ = writeln!(
        out,
        "{:<3}  {:>9}  {:>11}  {:>6}  {:>10}  {:>9}  {:>6}  {:>11.0}%{mark}",
        run,
        f.read_hits,
        f.read_misses,
        f.writes,
        f.writebacks,
        f.evictions,
        f.stalls,
        f.dirty_fraction * 100.0
    );
}
