//! Paper 003's Fig 2: the four filebench personalities (`bench fs`) on ext4 in the paper's
//! three roles, in one run: stock ext4 on a RAM disk, ext4 over a persist-on-write layer
//! (PMAL there, pmcache here) and the PM-native file system (PMFS there, ext4 `-o dax` here).
//!
//! `003-fig2` boots a QEMU guest (`scripts/guest/paper003.sh`) whose kernel has `brd`, ublk
//! and an emulated NVDIMM: ext4 on `brd`, ext4 on pmcache's `/dev/ublkbN` (medium on one
//! NVDIMM, backing file on the guest's NVMe disk) and ext4 `-o dax` on the other NVDIMM,
//! mounted at fixed places; inside, `bench paper 003-fig2 --bed guest-fs` measures them.
//! `003-fig2-host` runs the same on this host's substitutes: ext4 on a loop device over a
//! `/dev/shm` file, ext4 over pmcache through NBD, nbdfuse and a loop device, and tmpfs as
//! the upper bound.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::common::{percent, size};
use super::figure::{Absolute, Figure, Point, Series, number};
use super::{Ctx, Scale};
use crate::fs::personality::{Op, ThreadGroup};
use crate::fs::{self, FsResult, Personality, Threads, Workload};
use crate::harness::servers::{PmcacheServe, ServeOptions, Server};

/// `--bed` inside the guest of `scripts/guest/paper003.sh`.
pub const GUEST_BED: &str = "guest-fs";

/// Where the guest script mounts each bed.
const GUEST_MOUNTS: [(&str, &str); 3] = [
    ("ext4 -o dax (NVDIMM: PMFS's role)", "/mnt/fs-dax"),
    ("ext4 over pmcache (ublk: PMAL's role)", "/mnt/fs-pmcache"),
    ("ext4 on brd (RAM disk: stock ext4)", "/mnt/fs-brd"),
];

/// How a block request goes from ext4 to pmcache in the guest.
const GUEST_PATH: &str = "the block layer and ublk to pmcache's server in user space";

/// How a block request goes from ext4 to pmcache on this host.
const HOST_PATH: &str = "a loop device, FUSE, nbdfuse and an NBD socket to pmcache's server";

/// The paper's sentence.
const PUBLISHED: &str = "Ext4 with PMAL within 5 % of PMFS (abstract); \"considerably better \
                         than the legacy file system and almost matches PMFS\" (§4.2); no \
                         number per workload, none for stock Ext4.";

/// The paper's bar for ext4 with PMAL: within 5 % of PMFS (its abstract).
const PMAL_SHARE_OF_PMFS: f64 = 0.95;

/// What pmcache is in this figure, and what PMAL is in the paper; `path` is how a block
/// request goes from ext4 to pmcache.
fn block_device_note(path: &str) -> String {
    format!(
        "pmcache is a block device under an unchanged ext4: ext4's journal commits, fsyncs \
         and O_DSYNC writes reach it as block requests (writes, FLUSH, FUA) through {path}, \
         and each waits for them to come back. PMAL, the paper's layer, changes ext4 itself: \
         it persists each write as it is made (clflush + sfence) and keeps the journal in the \
         persistent page cache, so its fsync has nothing left to send to a device. The \
         figure asks the paper's question of a block device, which PMAL is not."
    )
}

/// A flowop in which a thread waits until its writes are durable.
struct DurabilityWait {
    /// The thread group's index in the workload.
    group: usize,
    /// What the group's loop waits for, as a note says it.
    what: String,
    /// The fsyncs in each loop (0: a wait for O_DSYNC writes).
    fsyncs: usize,
    /// The flowops whose latencies it is (varmail's two fsyncs are one kind of wait).
    flowops: Vec<&'static str>,
}

/// The workload's waits for durability: its fsyncs, and its waits for O_DSYNC writes.
fn durability_waits(workload: &Workload) -> Vec<DurabilityWait> {
    let mut waits = vec![];
    for (index, group) in workload.groups.iter().enumerate() {
        let named = |wanted: fn(Op) -> bool| -> Vec<&'static str> {
            group.flowops.iter().filter(|f| wanted(f.op)).map(|f| f.name).collect()
        };
        let counted = group.flowops.iter().filter(|f| f.op.counted()).count();
        let fsyncs = named(|op| op == Op::Fsync);
        if !fsyncs.is_empty() {
            waits.push(DurabilityWait {
                group: index,
                what: format!("{} fsyncs in each loop of {counted} ops", fsyncs.len()),
                fsyncs: fsyncs.len(),
                flowops: fsyncs,
            });
        }
        let dsync_writes: Vec<(u64, u64)> = group
            .flowops
            .iter()
            .filter_map(|f| match f.op {
                Op::AioWriteRandom { iters, iosize, dsync: true, .. } => Some((iters, iosize)),
                _ => None,
            })
            .collect();
        let aio_waits = named(|op| op == Op::AioWait);
        if !dsync_writes.is_empty() && !aio_waits.is_empty() {
            let writes: Vec<String> = dsync_writes
                .iter()
                .map(|&(iters, iosize)| {
                    let plural = if iters == 1 { "" } else { "s" };
                    format!("{iters} O_DSYNC write{plural} of {}", size(iosize))
                })
                .collect();
            waits.push(DurabilityWait {
                group: index,
                what: format!("a wait for its {} in each loop", writes.join(" and ")),
                fsyncs: 0,
                flowops: aio_waits,
            });
        }
    }
    waits
}

/// The mean latency in ms of `wait`'s flowops in `result`, over all their completions.
fn wait_ms(result: &FsResult, workload: &Workload, wait: &DurabilityWait) -> Option<f64> {
    let group = workload.groups[wait.group].name;
    let (ms, ops) = result
        .flowops
        .iter()
        .filter(|f| f.group == group && wait.flowops.contains(&f.name.as_str()))
        .fold((0.0, 0u64), |(ms, ops), f| (ms + f.latency_ms_mean * f.ops as f64, ops + f.ops));
    (ops > 0).then(|| ms / ops as f64)
}

/// A personality's rates and durability waits on the native bed and over pmcache.
struct Limit<'a> {
    personality: Personality,
    workload: &'a Workload,
    /// The native bed's name.
    native: &'a str,
    /// How a block request goes from ext4 to pmcache.
    path: &'a str,
    /// Median ops/s: (over pmcache, native).
    ops_per_s: (f64, f64),
    /// Each of `durability_waits(workload)`'s median latency in ms: (over pmcache, native).
    waits_ms: Vec<(Option<f64>, Option<f64>)>,
}

/// What bounds the personality over pmcache, if its threads wait for durability, and the
/// goal: the paper's bar for PMAL.
fn limit_note(limit: &Limit) -> Option<String> {
    let waits = durability_waits(limit.workload);
    if waits.is_empty() {
        return None;
    }
    let (pmcache, native) = limit.ops_per_s;
    // The native bed's name without its role: `tmpfs`, `ext4 -o dax`.
    let on = limit.native.split(" (").next().unwrap_or(limit.native);
    let ms = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{} ms", number(v)));
    let mut described: Vec<String> = waits
        .iter()
        .zip(&limit.waits_ms)
        .map(|(wait, &(over_ms, on_ms))| {
            let group = &limit.workload.groups[wait.group];
            let mut text = format!("{}: {}", threads_of(group), wait.what);
            // An fsync is timed in the thread that calls it. A wait for O_DSYNC writes also
            // holds the writer thread's queue and, behind the loop's semaphores, the other
            // groups' pace: its time says little about the round trip, so it is left out.
            if wait.fsyncs > 0 {
                text +=
                    &format!(", taking {} over pmcache against {} on {on}", ms(over_ms), ms(on_ms));
            }
            text
        })
        .collect();
    // Groups that post to a semaphore the waiting groups block on wait for them in turn.
    let held: Vec<String> = limit
        .workload
        .groups
        .iter()
        .filter(|group| {
            group.flowops.iter().any(|f| match f.op {
                Op::SemPost { semaphore } => {
                    waits.iter().any(|w| limit.workload.groups[w.group].blocks_on(semaphore))
                }
                _ => false,
            })
        })
        .map(threads_of)
        .collect();
    if !held.is_empty() {
        described.push(format!("{} held back by them through semaphores", held.join(" and ")));
    }
    let goal = native * PMAL_SHARE_OF_PMFS;
    let mut text = format!(
        "What bounds {}: {} ops/s over pmcache against {} on {on} ({}). Its threads wait for \
         durability — {}. Each wait is for block requests that cross {} and come back. The \
         goal is the paper's bar for PMAL, within {} of PMFS: {} ops/s here",
        limit.personality.name(),
        number(pmcache),
        number(native),
        percent(pmcache / native),
        described.join("; "),
        limit.path,
        percent(1.0 - PMAL_SHARE_OF_PMFS),
        number(goal)
    );
    // One loop for every thread: the run's time per op, charged to the fsyncs alone.
    if let ([group], [wait]) = (&limit.workload.groups[..], &waits[..])
        && wait.fsyncs > 0
    {
        let counted = group.flowops.iter().filter(|f| f.op.counted()).count() as f64;
        let ops_per_wait = counted / wait.fsyncs as f64;
        let per_wait_ms = |rate: f64| ops_per_wait * 1e3 / rate;
        text += &format!(
            "; charged to the fsyncs alone, the gap is {} ms of the run per fsync, and the goal \
             leaves {} ms",
            number(per_wait_ms(pmcache) - per_wait_ms(native)),
            number(per_wait_ms(goal) - per_wait_ms(native))
        );
    }
    text += ".";
    Some(text)
}

/// `dbwr (10 threads)`.
fn threads_of(group: &ThreadGroup) -> String {
    let plural = if group.instances == 1 { "" } else { "s" };
    format!("{} ({} thread{plural})", group.name, group.instances)
}

/// A bed: its series name and the directory the personalities run in.
struct Bed {
    name: String,
    dir: PathBuf,
}

/// `003-fig2`: the guest's beds (measured here inside the guest, or by booting it).
pub fn run(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    if ctx.args.bed == GUEST_BED {
        let beds: Vec<Bed> = GUEST_MOUNTS
            .iter()
            .map(|(name, dir)| Bed { name: name.to_string(), dir: dir.into() })
            .collect();
        for bed in &beds {
            if !is_mount_point(&bed.dir) {
                return Err(format!(
                    "{}: not mounted ({}); `--bed {GUEST_BED}` runs inside the guest of \
                     scripts/guest/paper003.sh",
                    bed.dir.display(),
                    bed.name
                ));
            }
        }
        let bed = format!(
            "QEMU guest (TCG, {} vCPUs, Linux {}): ext4 on brd, on pmcache's /dev/ublkbN \
             (medium on an emulated NVDIMM, ext4 -o dax; backing file on the emulated NVMe \
             disk) and -o dax on a second NVDIMM",
            ctx.cpus,
            crate::harness::machine::kernel()
        );
        let notes = vec![
            "Under TCG every instruction is emulated: absolute ops/s are the emulator's; the \
             figure is each bed's ratio to ext4 -o dax, run by run."
                .to_string(),
            "pmcache: `serve --ublk`, write-back, its cache as large as the backing store (it \
             plays the paper's PM storage), medium on ext4 -o dax on its own NVDIMM; every \
             write is persisted on the medium before it is acknowledged, so ext4's FLUSH and \
             FUA (fsync, O_DSYNC, journal commits) cost no device cache flush."
                .to_string(),
        ];
        return measure(ctx, &beds, "003-fig2", &bed, GUEST_PATH, notes);
    }
    let seconds: Vec<String> =
        ctx.seconds_given.map(|s| vec!["--seconds".into(), s.to_string()]).unwrap_or_default();
    let script = "scripts/guest/paper003.sh";
    let figures = super::guest::figures_from_guest(ctx, script, &seconds, |f| {
        f.id.starts_with("003-fig2") && !f.id.starts_with("003-fig2-host")
    })?;
    if figures.len() != 2 {
        return Err(format!("the guest wrote {} 003-fig2 figures, not 2", figures.len()));
    }
    Ok(figures)
}

/// `003-fig2-host`: the beds this host can have, set up and torn down here (as root).
pub fn run_host(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    if !rustix::process::geteuid().is_root() {
        return Err("003-fig2-host mounts file systems and attaches loop devices: run it as \
                    root"
            .into());
    }
    for tool in ["mkfs.ext4", "losetup", "mount", "umount", "nbdfuse"] {
        if !on_path(tool) {
            return Err(format!("003-fig2-host needs {tool} (e2fsprogs, mount, libnbd-bin)"));
        }
    }
    let bytes = bed_bytes(ctx.args.scale);
    // Webserver's one log file grows all run long (every thread appends to it, and filebench
    // never trims it): room for that beyond the fileset, in sparse files and a tmpfs that
    // take memory only as they are written.
    let seconds = ctx.seconds_given.unwrap_or(fs::seconds(ctx.args.scale));
    let device_bytes = bytes + (seconds.ceil() as u64) * (160 << 20);
    let mut host = HostBeds::new(ctx, bytes, device_bytes)?;
    let beds = host.mount()?;
    let bed = format!(
        "this host: tmpfs, ext4 over pmcache (serve on a unix socket → nbdfuse → loop device; \
         a {} MiB cache in {}, backing file in {}), ext4 on a loop device over a file in {}; \
         devices of {} MiB",
        bytes >> 20,
        ctx.args.pm_dir.display(),
        ctx.args.dir.display(),
        ctx.args.pm_dir.display(),
        device_bytes >> 20
    );
    let notes = vec![
        "tmpfs stands in for the PM-native file system as an upper bound: it has no block \
         layer and no durability at all."
            .to_string(),
        "The pmcache bed's path crosses the kernel three times (ext4 → loop → FUSE → nbdfuse → \
         NBD socket → pmcache), each request copied through user space twice; the guest's \
         ublk bed is the faithful one."
            .to_string(),
        "The RAM-disk bed is a loop device over a tmpfs file (this host's kernel has no brd): \
         a block device in DRAM with the block layer in front, as the paper's RAM-disk driver."
            .to_string(),
    ];
    let figures = measure(ctx, &beds, "003-fig2-host", &bed, HOST_PATH, notes);
    host.unmount();
    figures
}

/// The size of each bed's device at a scale: room for the largest personality's fileset and
/// what its run adds, with ext4's own overhead.
fn bed_bytes(scale: Scale) -> u64 {
    let need = Personality::ALL
        .iter()
        .map(|&p| fs::workload(p, fs::sizing(scale), Threads::Paper).preallocated_bytes())
        .max()
        .unwrap_or(0);
    let bytes = (need * 2 + (64 << 20)).max(256 << 20);
    bytes.div_ceil(64 << 20) * (64 << 20)
}

/// Runs every personality at the paper's threads and at 2 on every bed, taking turns, and
/// makes one figure per thread count.
fn measure(
    ctx: &Ctx,
    beds: &[Bed],
    id: &str,
    bed_text: &str,
    path: &str,
    mut notes: Vec<String>,
) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let seconds = ctx.seconds_given.unwrap_or(fs::seconds(scale));
    let thread_counts = [Threads::Paper, Threads::Count(2)];
    let personalities = Personality::ALL;
    // rates[t][p][b]: (run, ops/s)
    let mut rates = vec![vec![vec![vec![]; beds.len()]; personalities.len()]; 2];
    // waits[t][p][b][w]: the durability wait w's mean latency in ms, one per run
    let mut waits = vec![vec![vec![vec![]; beds.len()]; personalities.len()]; 2];
    let turns = (ctx.runs * personalities.len() * thread_counts.len() * beds.len()) as u64;
    let bar = ctx.progress(id, turns);
    for run in 0..ctx.runs {
        for (p, &personality) in personalities.iter().enumerate() {
            for (t, &threads) in thread_counts.iter().enumerate() {
                for k in 0..beds.len() {
                    let b = (k + run + p) % beds.len();
                    let result = fs::run_one(
                        personality,
                        scale,
                        threads,
                        &beds[b].dir,
                        seconds,
                        run as u64 + 1,
                    )
                    .map_err(|e| format!("{}: {e}", beds[b].name))?;
                    eprintln!(
                        "{id}: run {} {} threads {} on {}: {:.0} ops/s",
                        run + 1,
                        personality.name(),
                        result.threads,
                        beds[b].name,
                        result.ops_per_s
                    );
                    rates[t][p][b].push((run, result.ops_per_s));
                    let workload = fs::workload(personality, fs::sizing(scale), threads);
                    let runs_ms: &mut Vec<Vec<f64>> = &mut waits[t][p][b];
                    for (w, wait) in durability_waits(&workload).iter().enumerate() {
                        if runs_ms.len() <= w {
                            runs_ms.push(vec![]);
                        }
                        runs_ms[w].extend(wait_ms(&result, &workload, wait));
                    }
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    let sizing = fs::sizing(scale);
    let sizes: Vec<String> = personalities
        .iter()
        .map(|&p| {
            let w = fs::workload(p, sizing, Threads::Paper);
            let set = &w.filesets[0];
            format!("{} {} × {} KiB", p.name(), set.entries, set.mean_size >> 10)
        })
        .collect();
    // The paper's filesets, in GiB: the smallest and the largest.
    let paper_gib: Vec<f64> = personalities
        .iter()
        .map(|&p| {
            let w = fs::workload(p, fs::Sizing::PAPER, Threads::Paper);
            w.filesets.iter().map(|f| (f.entries * f.mean_size) as f64).sum::<f64>()
                / (1u64 << 30) as f64
        })
        .collect();
    let (paper_lo, paper_hi) = crate::harness::stats::min_max(&paper_gib);
    let shrunk = vec![
        format!(
            "file counts and OLTP's file size: the paper's Table 2 over {} ({}), because its \
             {paper_lo:.0}–{paper_hi:.0} GiB filesets do not fit in this machine's memory \
             beside a RAM disk, a medium and a DAX device of the same size each (even at 1/{}, \
             --scale full); mean sizes, threads and every other parameter as the paper's and \
             filebench's",
            sizing.divisor,
            sizes.join(", "),
            fs::sizing(Scale::Full).divisor
        ),
        format!(
            "{} s per run (the paper does not say; filebench's `run {}` at --scale full), to \
             keep a run of every personality on every bed within minutes",
            seconds,
            fs::seconds(Scale::Full)
        ),
    ];
    notes.insert(0, block_device_note(path));
    notes.push(
        "The personalities are `pmcache bench fs`: filebench's fileserver, webserver, varmail \
         and oltp written anew from their definitions (filebench is in no registry here and \
         its own files hang in places); ops are counted as filebench counts them: every I/O \
         flowop, open, close, stat and aiowait included."
            .into(),
    );
    let mut figures = vec![];
    for (t, &threads) in thread_counts.iter().enumerate() {
        let over = match threads {
            Threads::Paper => true,
            Threads::Count(n) => n > ctx.cpus,
        };
        // OLTP's groups, the shadows first: `200 + 10 + 1`.
        let oltp = fs::workload(Personality::Oltp, sizing, threads);
        let oltp_threads: Vec<String> =
            oltp.groups.iter().rev().map(|g| g.instances.to_string()).collect();
        let oltp_threads = oltp_threads.join(" + ");
        let (fig_id, what) = match threads {
            Threads::Paper => {
                let most = fs::workload(Personality::Fileserver, sizing, threads).threads_total();
                (id.to_string(), format!("the paper's threads: {most}; OLTP {oltp_threads}"))
            }
            Threads::Count(n) => {
                (format!("{id}-{n}threads"), format!("{n} threads (OLTP: {oltp_threads})"))
            }
        };
        let absolute: Vec<Series> = beds
            .iter()
            .enumerate()
            .map(|(b, bed)| Series {
                name: bed.name.clone(),
                points: (0..personalities.len())
                    .map(|p| {
                        let values: Vec<f64> = rates[t][p][b].iter().map(|&(_, r)| r).collect();
                        (!values.is_empty()).then(|| Point::of(&values, over))
                    })
                    .collect(),
            })
            .collect();
        let ratio = |p: usize, b: usize, to: usize| -> Option<Vec<f64>> {
            let r: Vec<f64> = rates[t][p][b]
                .iter()
                .filter_map(|&(run, rate)| {
                    let base = rates[t][p][to].iter().find(|(r, _)| *r == run)?.1;
                    (base > 0.0).then_some(rate / base)
                })
                .collect();
            (!r.is_empty()).then_some(r)
        };
        let normalised: Vec<Series> = beds
            .iter()
            .enumerate()
            .map(|(b, bed)| Series {
                name: bed.name.clone(),
                points: (0..personalities.len())
                    .map(|p| ratio(p, b, 0).map(|r| Point::of(&r, over)))
                    .collect(),
            })
            .collect();
        let median =
            |p: usize, b: usize, to: usize| ratio(p, b, to).map(|r| Point::of(&r, false).median);
        let parts: Vec<String> = personalities
            .iter()
            .enumerate()
            .map(|(p, personality)| {
                let of_native = median(p, 1, 0).map_or("—".into(), percent);
                let of_ram = median(p, 1, 2).map_or("—".into(), |r| format!("{r:.2}×"));
                format!("{} {of_native} of it ({of_ram} the RAM disk's)", personality.name())
            })
            .collect();
        let ours = format!(
            "pmcache is a block device under an unchanged ext4 (PMAL changes ext4 itself). {} \
             against {}, by ops/s: {}.",
            beds[1].name,
            beds[0].name,
            parts.join("; ")
        );
        let mut fig_notes = notes.clone();
        let median_of =
            |values: &[f64]| (!values.is_empty()).then(|| Point::of(values, false).median);
        for (p, &personality) in personalities.iter().enumerate() {
            let rate =
                |b: usize| median_of(&rates[t][p][b].iter().map(|&(_, r)| r).collect::<Vec<f64>>());
            let (Some(over), Some(native)) = (rate(1), rate(0)) else { continue };
            let workload = fs::workload(personality, sizing, threads);
            let wait_count = durability_waits(&workload).len();
            let at = |b: usize, w: usize| waits[t][p][b].get(w).and_then(|v| median_of(v));
            let limit = Limit {
                personality,
                workload: &workload,
                native: &beds[0].name,
                path,
                ops_per_s: (over, native),
                waits_ms: (0..wait_count).map(|w| (at(1, w), at(0, w))).collect(),
            };
            fig_notes.extend(limit_note(&limit));
        }
        figures.push(Figure {
            id: fig_id,
            title: format!("filebench personalities on ext4 in the paper's three roles, {what}"),
            bed: bed_text.to_string(),
            x_label: "workload".into(),
            x_ticks: personalities.iter().map(|p| p.name().to_string()).collect(),
            y_label: format!("ops/s / {}", beds[0].name),
            y_log: false,
            bars: true,
            series: normalised,
            absolute: Some(Absolute { y_label: "ops/s".into(), series: absolute }),
            published: PUBLISHED.into(),
            ours,
            scale: ctx.scale_note_timed(shrunk.clone(), seconds),
            notes: fig_notes,
            provenance: ctx.provenance.clone(),
        });
    }
    Ok(figures)
}

/// Whether `dir` is a mount point (its device differs from its parent's).
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(here), Some(Ok(parent))) =
        (std::fs::metadata(dir), dir.parent().map(std::fs::metadata))
    else {
        return false;
    };
    here.dev() != parent.dev()
}

/// Runs a command to completion, its failure an error with its output.
fn sh(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// How long nbdfuse may take to show the device.
const NBDFUSE_WAIT: Duration = Duration::from_secs(20);

/// The host's beds: what was set up, undone in reverse (also when dropped).
struct HostBeds {
    work: PathBuf,
    shm: PathBuf,
    backing: PathBuf,
    /// The cache's size: at least the largest fileset's.
    cache_bytes: u64,
    /// Each device's size.
    bytes: u64,
    server: Option<Server>,
    nbdfuse: Option<Child>,
    mounts: Vec<PathBuf>,
    loops: Vec<String>,
}

impl HostBeds {
    fn new(ctx: &Ctx, cache_bytes: u64, bytes: u64) -> Result<HostBeds, String> {
        let work = tempfile::Builder::new()
            .prefix("pmcache-003-")
            .tempdir_in(std::env::temp_dir())
            .map_err(|e| format!("a work directory: {e}"))?
            .keep();
        let shm = ctx.args.pm_dir.join(format!("pmcache-003-{}", std::process::id()));
        std::fs::create_dir_all(&shm).map_err(|e| format!("{}: {e}", shm.display()))?;
        let backing = ctx.args.dir.join(format!("pmcache-003-{}.img", std::process::id()));
        Ok(HostBeds {
            work,
            shm,
            backing,
            cache_bytes,
            bytes,
            server: None,
            nbdfuse: None,
            mounts: vec![],
            loops: vec![],
        })
    }

    fn mount(&mut self) -> Result<Vec<Bed>, String> {
        let size = self.bytes.to_string();
        let dir = |name: &str| -> Result<PathBuf, String> {
            let d = self.work.join(name);
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            Ok(d)
        };
        // tmpfs.
        let tmpfs = dir("tmpfs")?;
        sh("mount", &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", path(&tmpfs)])?;
        self.mounts.push(tmpfs.clone());
        // pmcache over NBD → nbdfuse → loop.
        let file = std::fs::File::create(&self.backing)
            .map_err(|e| format!("{}: {e}", self.backing.display()))?;
        file.set_len(self.bytes).map_err(|e| format!("{}: {e}", self.backing.display()))?;
        let socket = self.work.join("nbd.sock");
        let control = self.work.join("control.sock");
        let medium = self.shm.join("cache.pm");
        let log = self.work.join("serve.log");
        self.server = Some(Server::start_pmcache(&PmcacheServe {
            medium: &medium,
            cache_bytes: self.cache_bytes,
            backing: &self.backing,
            socket: &socket,
            control: &control,
            log: &log,
            cleaner: &[],
            cpus: None,
            max_connections: 4,
            options: ServeOptions::default(),
        })?);
        let fuse = dir("fuse")?;
        let disk = fuse.join("disk");
        let child = Command::new("nbdfuse")
            .arg(&disk)
            .arg("--unix")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("nbdfuse: {e}"))?;
        self.nbdfuse = Some(child);
        let began = Instant::now();
        while std::fs::metadata(&disk).map(|m| m.len()).unwrap_or(0) != self.bytes {
            if began.elapsed() > NBDFUSE_WAIT {
                return Err(format!(
                    "nbdfuse: {} did not appear in {} s",
                    disk.display(),
                    NBDFUSE_WAIT.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.mounts.push(fuse);
        let pm_loop = sh("losetup", &["--show", "-f", path(&disk)])?;
        self.loops.push(pm_loop.clone());
        let pmcache = dir("pmcache")?;
        mkfs_and_mount(&pm_loop, &pmcache)?;
        self.mounts.push(pmcache.clone());
        // ext4 on a loop device over a /dev/shm file.
        let ram = self.shm.join("ramdisk.img");
        let f = std::fs::File::create(&ram).map_err(|e| format!("{}: {e}", ram.display()))?;
        f.set_len(self.bytes).map_err(|e| format!("{}: {e}", ram.display()))?;
        let ram_loop = sh("losetup", &["--show", "-f", path(&ram)])?;
        self.loops.push(ram_loop.clone());
        let ramdisk = dir("ramdisk")?;
        mkfs_and_mount(&ram_loop, &ramdisk)?;
        self.mounts.push(ramdisk.clone());
        Ok(vec![
            Bed { name: "tmpfs (PMFS's role: an upper bound)".into(), dir: tmpfs },
            Bed { name: "ext4 over pmcache (NBD, nbdfuse, loop)".into(), dir: pmcache },
            Bed { name: "ext4 on a loop device in /dev/shm (RAM disk)".into(), dir: ramdisk },
        ])
    }

    /// Undoes what `mount` did, in reverse order: the ext4 mounts, the loop devices, the
    /// FUSE mount (nbdfuse then exits), pmcache (its clean shutdown), tmpfs.
    fn unmount(&mut self) {
        while let Some(m) = self.mounts.pop() {
            if m.ends_with("fuse") {
                while let Some(l) = self.loops.pop() {
                    let _ = sh("losetup", &["-d", &l]);
                }
                // A loop device lets go of its file asynchronously.
                let began = Instant::now();
                while sh("umount", &[path(&m)]).is_err() && began.elapsed().as_secs() < 10 {
                    std::thread::sleep(Duration::from_millis(100));
                }
                if let Some(mut child) = self.nbdfuse.take() {
                    let began = Instant::now();
                    while matches!(child.try_wait(), Ok(None)) && began.elapsed().as_secs() < 10 {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let _ = child.kill();
                    let _ = child.wait();
                }
                if let Some(server) = self.server.take()
                    && let Err(e) = server.stop()
                {
                    eprintln!("warning: {e}");
                }
            } else {
                let _ = sh("umount", &[path(&m)]);
            }
        }
        while let Some(l) = self.loops.pop() {
            let _ = sh("losetup", &["-d", &l]);
        }
        if let Some(mut child) = self.nbdfuse.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        drop(self.server.take());
        let _ = std::fs::remove_dir_all(&self.shm);
        let _ = std::fs::remove_file(&self.backing);
        let _ = std::fs::remove_file(crate::harness::scratch::state_file(&self.backing));
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

impl Drop for HostBeds {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// Whether `program` is on the `PATH`.
fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path made here")
}

/// mkfs.ext4 on `device` and mounts it at `at` (`noinit_itable`: no lazy inode-table
/// initialisation running beside the measurement).
fn mkfs_and_mount(device: &str, at: &Path) -> Result<(), String> {
    sh("mkfs.ext4", &["-q", "-F", device])?;
    sh("mount", &["-t", "ext4", "-o", "noinit_itable", device, path(at)])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paper_workload(personality: Personality) -> Workload {
        fs::workload(personality, fs::sizing(Scale::Smallest), Threads::Paper)
    }

    #[test]
    fn varmail_waits_on_its_fsyncs_oltp_on_its_o_dsync_writes_the_others_on_nothing() {
        let varmail = durability_waits(&paper_workload(Personality::Varmail));
        let [wait] = &varmail[..] else { panic!("varmail: one kind of wait") };
        assert_eq!((wait.fsyncs, wait.what.as_str()), (2, "2 fsyncs in each loop of 13 ops"));
        assert_eq!(wait.flowops, ["fsyncfile2", "fsyncfile3"]);
        let oltp = paper_workload(Personality::Oltp);
        let waits = durability_waits(&oltp);
        let groups: Vec<&str> = waits.iter().map(|w| oltp.groups[w.group].name).collect();
        assert_eq!(groups, ["lgwr", "dbwr"]);
        assert!(waits.iter().all(|w| w.fsyncs == 0 && w.what.contains("O_DSYNC")));
        assert_eq!(waits[1].what, "a wait for its 100 O_DSYNC writes of 2 KiB in each loop");
        for personality in [Personality::Fileserver, Personality::Webserver] {
            assert!(durability_waits(&paper_workload(personality)).is_empty(), "{personality:?}");
        }
    }

    #[test]
    fn the_limit_note_gives_the_rates_the_waits_and_what_the_goal_leaves_per_fsync() {
        let varmail = paper_workload(Personality::Varmail);
        let limit = Limit {
            personality: Personality::Varmail,
            workload: &varmail,
            native: "ext4 -o dax (PMFS's role)",
            path: "ublk",
            ops_per_s: (2000.0, 4000.0),
            waits_ms: vec![(Some(12.5), Some(2.0))],
        };
        let text = limit_note(&limit).expect("varmail waits for durability");
        assert!(
            text.contains("2000 ops/s over pmcache against 4000 on ext4 -o dax (50 %)"),
            "{text}"
        );
        assert!(
            text.contains("taking 12.5 ms over pmcache against 2.00 ms on ext4 -o dax"),
            "{text}"
        );
        assert!(text.contains("within 5 % of PMFS: 3800 ops/s here"), "{text}");
        // 13 ops per 2 fsyncs: 6.5 ops of 0.5 ms against 0.25 ms, and of 1/3800 s at the goal.
        let (gap_ms, budget_ms) =
            (6.5e3 / 2000.0 - 6.5e3 / 4000.0, 6.5e3 / 3800.0 - 6.5e3 / 4000.0);
        let expected = format!(
            "the gap is {} ms of the run per fsync, and the goal leaves {} ms",
            number(gap_ms),
            number(budget_ms)
        );
        assert!(text.contains(&expected), "{text}");
        let fileserver = paper_workload(Personality::Fileserver);
        let none = Limit {
            personality: Personality::Fileserver,
            workload: &fileserver,
            waits_ms: vec![],
            ..limit
        };
        assert_eq!(limit_note(&none), None, "fileserver waits for no durability");
    }

    #[test]
    fn oltp_limit_names_each_writer_group_and_who_waits_for_them_untimed() {
        let oltp = paper_workload(Personality::Oltp);
        let limit = Limit {
            personality: Personality::Oltp,
            workload: &oltp,
            native: "ext4 -o dax",
            path: "ublk",
            ops_per_s: (1000.0, 2000.0),
            waits_ms: vec![(Some(3.0), Some(1.0)), (None, Some(40.0))],
        };
        let text = limit_note(&limit).expect("oltp waits for durability");
        for part in [
            "lgwr (1 thread): a wait for its 1 O_DSYNC write of 256 KiB in each loop; ",
            "dbwr (10 threads): a wait for its 100 O_DSYNC writes of 2 KiB in each loop; ",
            "shadow (200 threads) held back by them through semaphores.",
            "within 5 % of PMFS: 1900 ops/s here.",
        ] {
            assert!(text.contains(part), "{part:?} in {text}");
        }
        assert!(!text.contains("taking") && !text.contains("per fsync"), "{text}");
    }
}
