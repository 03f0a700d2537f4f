//! Paper 004 (read performance of I/O interfaces on a low-latency NVMe SSD), Fig 1: 4 KiB random
//! reads by jobs through each of pmcache's backing engines, beside fio with the same engine
//! and settings in the same run (`bench engines`), at queue depth 1 (a) and 32 (b). The
//! paper's question is which interface reaches the device's maximum with the fewest jobs: each
//! figure's sentence gives, for every series, the fewest jobs that reach 95 % of the highest
//! KIOPS any series reached in that panel.
//!
//! On the host the disk is virtio, which has no poll queues: RWF_HIPRI cannot poll and IOPOLL
//! is refused. `scripts/guest/paper004.sh` runs the same inside a QEMU guest on an emulated
//! NVMe drive with poll queues (`--bed guest-nvme`), jobs 1 to 8 on the guest's CPUs. There,
//! before the sweep, each engine (ours and fio's, alone, 1 job at QD 1) reads for a moment
//! while a histogram trigger on the `nvme:nvme_setup_cmd` trace event counts the drive's reads
//! by queue: the figures' notes give how many went to poll queues (the queues without an
//! interrupt line in `/proc/interrupts`) and how many interrupts the I/O queues raised.
//! blk-mq's debugfs has no per-queue request counters on the guest's kernel (6.12), the trace
//! event does. On that kernel ext4's direct I/O (iomap) submits a synchronous request unpolled
//! ("Sync dio can't be polled reliably", fs/iomap/direct-io.c), so pvsync2 with HIPRI reads
//! through the interrupt-driven queues; io_uring with IOPOLL reads through the poll queues.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use pmcache_backing::EngineKind;

use super::figure::{Figure, Point, Series, number};
use super::{Ctx, Scale};
use crate::engines::{EnginesArgs, Row, Side};
use crate::harness::experiment::{Experiment, Run, parse};
use crate::harness::scratch::write_random;

/// The engines of the paper's series (libaio, pvsync2 with HIPRI, io_uring polled) and their
/// interrupt-driven counterparts.
const ENGINES: &str = "libaio,pvsync2,pvsync2-hipri,io_uring,io_uring-iopoll";

/// The share of a panel's highest KIOPS a series must reach to count as at the maximum.
const NEAR_MAXIMUM: f64 = 0.95;

/// The job counts of a bed and scale: on the guest, 1 to 8 whatever the scale (the points past
/// its CPUs are marked oversubscribed).
fn job_counts(scale: Scale, guest: bool) -> Vec<usize> {
    if guest {
        return (1..=8).collect();
    }
    match scale {
        Scale::Smallest => vec![1, 2],
        Scale::Small => vec![1, 2, 4, 8],
        Scale::Full => vec![1, 2, 4, 8, 16],
    }
}

/// The test file's size, MiB: the guest's emulated drive holds less than the host's disk.
fn file_mib(scale: Scale, guest: bool) -> u64 {
    if guest { scale.pick(1024, 256, 64) } else { scale.pick(4096, 1024, 64) }
}

/// The arguments of `bench engines` for a scale (`--json`: it prints nothing).
fn arguments(ctx: &Ctx, jobs: &[usize], file_mib: u64) -> Result<(EnginesArgs, Run), String> {
    let seconds = ctx.seconds_given.unwrap_or(ctx.args.scale.pick(5.0, 2.0, 0.5)).max(0.5);
    let jobs: Vec<String> = jobs.iter().map(usize::to_string).collect();
    let argv: Vec<String> = [
        "engines",
        "--engines",
        ENGINES,
        "--jobs",
        &jobs.join(","),
        "--qd",
        "1,32",
        "--rw",
        "randread",
        "--files",
        "disk",
        "--disk-dir",
        &ctx.args.dir.display().to_string(),
        "--file-mib",
        &file_mib.to_string(),
        "--seconds",
        &seconds.to_string(),
        "--runs",
        &ctx.runs.to_string(),
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    parse(&argv.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Fig 1 at QD 1 (a) and QD 32 (b).
pub fn run(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let guest = ctx.args.bed == "guest-nvme";
    let jobs = job_counts(ctx.args.scale, guest);
    let (args, run) = arguments(ctx, &jobs, file_mib(ctx.args.scale, guest))?;
    let queue_notes = if guest {
        let seconds = ctx.args.scale.pick(2.0, 1.0, 0.3);
        eprintln!("004-fig1: counting each engine's reads by NVMe queue ({seconds} s each, alone)");
        match queue_use(&args, &ctx.args.dir, seconds) {
            Ok(counted) => queue_use_notes(&counted, seconds),
            Err(e) => vec![format!("The reads by NVMe queue were not counted: {e}.")],
        }
    } else {
        vec![]
    };
    let report = args.run(&run)?;
    let (suffix, bed) = if guest {
        (
            "-guest",
            format!(
                "QEMU guest (TCG, {} CPUs) on an emulated NVMe drive with poll queues \
                 (scripts/guest/paper004.sh), a file on ext4, O_DIRECT; the notes count which \
                 reads polled",
                ctx.cpus
            ),
        )
    } else {
        (
            "",
            "host: a file on the root disk (virtio, no poll queues: HIPRI cannot poll, IOPOLL is \
             refused), O_DIRECT"
                .to_string(),
        )
    };
    let mut figures = vec![];
    for (panel, qd) in [("a", 1usize), ("b", 32)] {
        let rows: Vec<&Row> = report
            .rows
            .iter()
            .filter(|r| r.qd == qd || (r.qd == 1 && qd > 1 && is_sync(&r.engine)))
            .collect();
        let mut names: Vec<String> = vec![];
        for r in &rows {
            if !names.contains(&r.engine) {
                names.push(r.engine.clone());
            }
        }
        let mut series = vec![];
        let mut notes = vec![
            format!(
                "4 KiB random reads, O_DIRECT, {} MiB file, {} s per run, {} run(s), ours and \
                 fio's taking turns; pmcache's engines are measured as the cache drives them \
                 (a thread per job, its own queue of QD requests).",
                report.plan.file_bytes >> 20,
                number(report.plan.runtime_secs),
                report.plan.runs
            ),
            "SPDK is not measured: it needs vfio or uio and an NVMe device, which neither bed \
             has."
                .into(),
            if report.plan.runs > 1 {
                "Each point is the median IOPS of its runs; its bar spans the lowest and the \
                 highest run."
                    .into()
            } else {
                "One run per point: a point is that run's IOPS and carries no range.".into()
            },
        ];
        let mut ratios = vec![];
        for name in &names {
            let at = |j: usize| rows.iter().find(|r| &r.engine == name && r.jobs == j);
            // KIOPS by jobs of one side (ours or fio's) of the rows, over its runs.
            let kiops = |runs_iops: fn(&Row) -> &Vec<f64>| -> Vec<Option<Point>> {
                jobs.iter()
                    .map(|&j| {
                        let runs_kiops: Vec<f64> =
                            runs_iops(at(j)?).iter().map(|iops| iops / 1000.0).collect();
                        (!runs_kiops.is_empty()).then(|| Point::of(&runs_kiops, j > ctx.cpus))
                    })
                    .collect()
            };
            let (ours, fio) = (kiops(|r| &r.ours_runs_iops), kiops(|r| &r.fio_runs_iops));
            if let Some(error) =
                rows.iter().find(|r| &r.engine == name).and_then(|r| r.error.clone())
            {
                notes.push(format!("pmcache {name}: {error}"));
            }
            if let Some(r) = at(1).and_then(|r| r.ratio) {
                ratios.push(format!("{name} {}", number(r)));
            }
            series.push(Series { name: format!("pmcache {name}"), points: ours });
            series.push(Series { name: format!("fio {name}"), points: fio });
        }
        if !ratios.is_empty() {
            notes.push(format!(
                "At 1 job, pmcache's engine over fio's same engine (the median of the runs' \
                 ratios): {}.",
                ratios.join(", ")
            ));
        }
        if qd > 1 {
            notes.push(
                "pvsync2 (with or without HIPRI) is synchronous: its points are QD 1.".into(),
            );
        }
        notes.extend(queue_notes.iter().cloned());
        figures.push(Figure {
            id: format!("004-fig1{panel}{suffix}"),
            title: format!("4 KiB random reads by jobs, QD {qd} per job, each engine beside fio's"),
            bed: bed.clone(),
            x_label: "jobs".into(),
            x_ticks: jobs.iter().map(usize::to_string).collect(),
            y_label: "KIOPS".into(),
            published:
                "libaio stays at 550 KIOPS whatever the jobs; io_uring (polled) reaches the \
                        device's maximum from 2 jobs, SPDK from 1; pvsync2 with HIPRI needs about \
                        45 jobs."
                    .into(),
            ours: fewest_jobs_sentence(&series, &jobs, &names, ctx.cpus),
            series,
            scale: ctx.scale_note_timed(
                vec![format!(
                    "jobs {} on {} CPUs (the paper: 1 … 120 on 120 cores); a {} MiB file",
                    jobs.iter().map(usize::to_string).collect::<Vec<_>>().join(", "),
                    ctx.cpus,
                    report.plan.file_bytes >> 20
                )],
                report.plan.runtime_secs,
            ),
            notes,
            provenance: ctx.provenance.clone(),
            ..Figure::default()
        });
    }
    Ok(figures)
}

fn is_sync(engine: &str) -> bool {
    engine.starts_with("psync") || engine.starts_with("pvsync2")
}

/// Where one series first reaches [`NEAR_MAXIMUM`] of a panel's highest median.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Reach {
    /// At this many jobs (the fewest), oversubscribed or not.
    At { jobs: usize, oversubscribed: bool },
    /// Never: its highest median's share of the panel's highest, and the jobs it came at.
    Never { best_share: f64, jobs: usize },
    /// The series has no point.
    Unmeasured,
}

/// For each series, where it first reaches [`NEAR_MAXIMUM`] of the highest median of all of
/// `series`; with that highest median, its series' index and its jobs.
fn reach_of(series: &[Series], jobs: &[usize]) -> (Vec<Reach>, Option<(f64, usize, usize)>) {
    let highest = series
        .iter()
        .enumerate()
        .flat_map(|(s, series)| {
            series.points.iter().zip(jobs).filter_map(move |(p, &j)| p.map(|p| (p.median, s, j)))
        })
        .fold(None, |best: Option<(f64, usize, usize)>, (median, s, j)| match best {
            Some((top, ..)) if top >= median => best,
            _ => Some((median, s, j)),
        });
    let Some((top, ..)) = highest else {
        return (vec![Reach::Unmeasured; series.len()], None);
    };
    let reach = series
        .iter()
        .map(|series| {
            let measured: Vec<(usize, Point)> =
                series.points.iter().zip(jobs).filter_map(|(p, &j)| p.map(|p| (j, p))).collect();
            if let Some(&(jobs, point)) =
                measured.iter().find(|(_, p)| p.median >= NEAR_MAXIMUM * top)
            {
                return Reach::At { jobs, oversubscribed: point.oversubscribed };
            }
            measured.iter().max_by(|a, b| a.1.median.total_cmp(&b.1.median)).map_or(
                Reach::Unmeasured,
                |&(jobs, p)| Reach::Never { best_share: p.median / top, jobs },
            )
        })
        .collect();
    (reach, highest)
}

/// The figure's sentence: the fewest jobs at which each engine, ours and fio's, reaches 95 % of
/// the panel's highest KIOPS (`series` are pairs, pmcache's then fio's, of `engines`).
fn fewest_jobs_sentence(
    series: &[Series],
    jobs: &[usize],
    engines: &[String],
    cpus: usize,
) -> String {
    let (reach, highest) = reach_of(series, jobs);
    let Some((top, best_series, best_jobs)) = highest else {
        return "Nothing was measured.".into();
    };
    let said = |reach: &Reach| match *reach {
        Reach::At { jobs, oversubscribed: false } => format!("{jobs}"),
        Reach::At { jobs, oversubscribed: true } => format!("{jobs} (oversubscribed)"),
        Reach::Never { best_share, jobs } => {
            format!("never (at most {:.0} %, at {jobs})", best_share * 100.0)
        }
        Reach::Unmeasured => "not measured".into(),
    };
    let per_engine: Vec<String> = engines
        .iter()
        .enumerate()
        .map(|(i, engine)| {
            let of = |s: usize| reach.get(s).map_or_else(|| "not measured".into(), said);
            format!("{engine}: pmcache {}, fio {}", of(2 * i), of(2 * i + 1))
        })
        .collect();
    format!(
        "Fewest jobs to {:.0} % of the panel's highest, {} KIOPS ({}, {best_jobs} job{}; \
         oversubscribed past {cpus} CPUs): {}.",
        NEAR_MAXIMUM * 100.0,
        number(top),
        series[best_series].name,
        if best_jobs == 1 { "" } else { "s" },
        per_engine.join("; ")
    )
}

/// The engines whose reads are counted by NVMe queue.
const COUNTED: [EngineKind; 5] = [
    EngineKind::Pvsync2Hipri,
    EngineKind::IoUringIopoll,
    EngineKind::Pvsync2,
    EngineKind::IoUring,
    EngineKind::Libaio,
];

/// What one side of one engine did on the NVMe controller's I/O queues while it ran alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct QueueUse {
    /// Reads submitted to the I/O queues.
    reads: u64,
    /// Those of them submitted to a queue without an interrupt line: a poll queue.
    polled_reads: u64,
    /// Interrupts the I/O queues raised.
    interrupts: u64,
}

/// The controller's reads and interrupts by queue id at one moment (I/O queues only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct QueueCounts {
    /// Reads submitted, by queue id.
    reads_by_qid: BTreeMap<u32, u64>,
    /// Interrupts raised, by queue id of the queues that have an interrupt line.
    interrupts_by_qid: BTreeMap<u32, u64>,
}

impl QueueCounts {
    /// What happened from `self` to `after`.
    fn until(&self, after: &QueueCounts) -> QueueUse {
        let grown = |before: &BTreeMap<u32, u64>, qid: &u32, now: u64| {
            now.saturating_sub(before.get(qid).copied().unwrap_or(0))
        };
        let mut used = QueueUse::default();
        for (qid, &now) in &after.reads_by_qid {
            let reads = grown(&self.reads_by_qid, qid, now);
            used.reads += reads;
            if !after.interrupts_by_qid.contains_key(qid) {
                used.polled_reads += reads;
            }
        }
        for (qid, &now) in &after.interrupts_by_qid {
            used.interrupts += grown(&self.interrupts_by_qid, qid, now);
        }
        used
    }
}

/// The NVMe read opcode.
const NVME_CMD_READ: u64 = 0x02;

/// The reads of `controller`'s I/O queues, by queue id, in the `hist` file of a
/// [`HIST_TRIGGER`] trigger: lines such as
/// `{ ctrl_id:          0, qid:          4, opcode:          2 } hitcount:       1250`.
fn reads_by_qid(hist: &str, controller: u32) -> BTreeMap<u32, u64> {
    let mut reads = BTreeMap::new();
    for line in hist.lines() {
        let Some((keys, rest)) = line.trim().strip_prefix('{').and_then(|l| l.split_once('}'))
        else {
            continue;
        };
        let key = |name: &str| {
            keys.split(',').find_map(|pair| {
                let (k, v) = pair.split_once(':')?;
                (k.trim() == name).then(|| v.trim().parse::<u64>().ok())?
            })
        };
        let count =
            rest.trim().strip_prefix("hitcount:").and_then(|c| c.trim().parse::<u64>().ok());
        if let (Some(ctrl), Some(qid), Some(NVME_CMD_READ), Some(count)) =
            (key("ctrl_id"), key("qid"), key("opcode"), count)
            && ctrl == u64::from(controller)
            && qid > 0
        {
            *reads.entry(qid as u32).or_insert(0) += count;
        }
    }
    reads
}

/// The interrupts of `controller`'s I/O queues (`nvme<controller>q<qid>`, qid > 0), by queue
/// id and summed over CPUs, in the text of `/proc/interrupts`.
fn interrupts_by_qid(text: &str, controller: u32) -> BTreeMap<u32, u64> {
    let mut lines = text.lines();
    let cpus = lines.next().map_or(0, |header| header.split_whitespace().count());
    let prefix = format!("nvme{controller}q");
    let mut interrupts = BTreeMap::new();
    for line in lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(qid) = fields
            .last()
            .and_then(|name| name.strip_prefix(&prefix))
            .and_then(|q| q.parse::<u32>().ok())
            .filter(|&q| q > 0)
        else {
            continue;
        };
        let count: u64 =
            fields.iter().skip(1).take(cpus).filter_map(|c| c.parse::<u64>().ok()).sum();
        *interrupts.entry(qid).or_insert(0) += count;
    }
    interrupts
}

/// The number N of the NVMe controller (`nvmeN`) in a block device's sysfs path, such as
/// `/sys/devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1`.
fn controller_in_sysfs_path(path: &Path) -> Option<u32> {
    path.components().rev().find_map(|c| c.as_os_str().to_str()?.strip_prefix("nvme")?.parse().ok())
}

/// The NVMe controller whose namespace holds `dir`.
fn nvme_controller(dir: &Path) -> Result<u32, String> {
    use std::os::unix::fs::MetadataExt as _;
    let device = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?.dev();
    let sysfs = format!("/sys/dev/block/{}:{}", libc::major(device), libc::minor(device));
    let path = std::fs::canonicalize(&sysfs).map_err(|e| format!("{sysfs}: {e}"))?;
    controller_of_block_device(&path).map_err(|e| format!("{}: {e}", dir.display()))
}

/// The NVMe controller of the block device (or partition) at canonical sysfs path `path`: the
/// one in the path, or for a namespace of a multipath subsystem
/// (`/sys/devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1`) the subsystem's only
/// controller, which its directory lists as a link `nvme0`.
fn controller_of_block_device(path: &Path) -> Result<u32, String> {
    if let Some(controller) = controller_in_sysfs_path(path) {
        return Ok(controller);
    }
    let subsystem = path
        .ancestors()
        .find(|dir| {
            dir.file_name().is_some_and(|name| name.to_string_lossy().starts_with("nvme-subsys"))
        })
        .ok_or_else(|| format!("not on an NVMe controller ({})", path.display()))?;
    let entries =
        std::fs::read_dir(subsystem).map_err(|e| format!("{}: {e}", subsystem.display()))?;
    let controllers: Vec<u32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("nvme")?.parse().ok())
        .collect();
    match controllers[..] {
        [controller] => Ok(controller),
        _ => {
            Err(format!("{} lists {} controllers, not one", subsystem.display(), controllers.len()))
        }
    }
}

/// Where the kernel's trace event files are.
const TRACEFS: &str = "/sys/kernel/tracing";

/// The trigger that counts the NVMe commands by controller, queue and opcode as they are
/// submitted.
const HIST_TRIGGER: &str = "hist:keys=ctrl_id,qid,opcode";

/// A [`HIST_TRIGGER`] on the `nvme:nvme_setup_cmd` trace event, removed when dropped.
struct CommandHistogram {
    /// The event's directory in tracefs.
    event_dir: PathBuf,
}

impl CommandHistogram {
    fn install() -> Result<Self, String> {
        let event_dir = Path::new(TRACEFS).join("events/nvme/nvme_setup_cmd");
        let histogram = CommandHistogram { event_dir };
        histogram.write_trigger(HIST_TRIGGER)?;
        Ok(histogram)
    }

    /// Adds (or with a leading `!`, removes) a trigger without touching the event's others.
    fn write_trigger(&self, trigger: &str) -> Result<(), String> {
        let path = self.event_dir.join("trigger");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(trigger.as_bytes()))
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    fn read(&self) -> Result<String, String> {
        let path = self.event_dir.join("hist");
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
    }
}

impl Drop for CommandHistogram {
    fn drop(&mut self) {
        let _ = self.write_trigger(&format!("!{HIST_TRIGGER}"));
    }
}

/// One counted engine: ours and fio's use of the queues, or why a side was not counted.
struct Counted {
    engine: EngineKind,
    ours: Result<QueueUse, String>,
    fio: Result<QueueUse, String>,
}

/// Runs each [`COUNTED`] engine, ours then fio's, alone for `seconds` (1 job, QD 1) on a
/// 16 MiB file in `dir` and counts its reads by NVMe queue.
fn queue_use(args: &EnginesArgs, dir: &Path, seconds: f64) -> Result<Vec<Counted>, String> {
    const FILE_BYTES: u64 = 16 << 20;
    let controller = nvme_controller(dir)?;
    let histogram = CommandHistogram::install()?;
    let counts = || -> Result<QueueCounts, String> {
        let interrupts = std::fs::read_to_string("/proc/interrupts")
            .map_err(|e| format!("/proc/interrupts: {e}"))?;
        Ok(QueueCounts {
            reads_by_qid: reads_by_qid(&histogram.read()?, controller),
            interrupts_by_qid: interrupts_by_qid(&interrupts, controller),
        })
    };
    if counts()?.interrupts_by_qid.is_empty() {
        return Err(format!("/proc/interrupts names no I/O queue of nvme{controller}"));
    }
    let path = dir.join(format!("pmcache-bench-p004-queues-{}.dat", std::process::id()));
    write_random(&path, FILE_BYTES).map_err(|e| format!("{}: {e}", path.display()))?;
    // Written back now, so that the reads counted are the engines'.
    std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|e| e.to_string())?;
    let mut counted = vec![];
    for engine in COUNTED {
        let side_use = |side: Side| -> Result<QueueUse, String> {
            let before = counts()?;
            args.run_side(side, &path, engine, 1, 1, seconds)?;
            Ok(before.until(&counts()?))
        };
        let ours = side_use(Side::Ours);
        let fio = side_use(Side::Fio);
        counted.push(Counted { engine, ours, fio });
    }
    let _ = std::fs::remove_file(&path);
    Ok(counted)
}

/// The figures' notes on the counted reads: the method, then a note per engine.
fn queue_use_notes(counted: &[Counted], seconds: f64) -> Vec<String> {
    let side = |used: &Result<QueueUse, String>| match used {
        Ok(u) => format!(
            "{} of {} reads on poll queues, interrupts: {}",
            u.polled_reads, u.reads, u.interrupts
        ),
        Err(e) => format!("not counted ({e})"),
    };
    let mut notes = vec![format!(
        "Which reads polled: before the sweep each engine read alone for {} s, 1 job at QD 1, \
         ours then fio's, while a histogram trigger on the nvme_setup_cmd trace event counted \
         the drive's reads by queue; a poll queue is an I/O queue without an interrupt line in \
         /proc/interrupts, whose interrupts are counted too.",
        number(seconds)
    )];
    for c in counted {
        notes.push(format!(
            "{}: pmcache {}; fio {}.",
            c.engine.name(),
            side(&c.ours),
            side(&c.fio)
        ));
    }
    notes
}

/// Runs `scripts/guest/paper004.sh` (which runs this experiment in the guest and writes its
/// figures to `--out`) and reads the figures back.
pub fn run_guest(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let figures = super::guest::figures_from_guest(ctx, "scripts/guest/paper004.sh", &[], |f| {
        f.id.starts_with("004-fig1") && f.id.ends_with("-guest")
    })?;
    if figures.is_empty() {
        return Err("the guest wrote no 004-fig1 figure".into());
    }
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(median: f64, oversubscribed: bool) -> Option<Point> {
        Some(Point { median, min: median, max: median, oversubscribed })
    }

    #[test]
    fn the_hist_file_gives_the_reads_of_the_controllers_io_queues() {
        let hist = "\
# event histogram
#
# trigger info: hist:keys=ctrl_id,qid,opcode:vals=hitcount:sort=hitcount:size=2048 [active]
#

{ ctrl_id:          0, qid:          0, opcode:          2 } hitcount:          3
{ ctrl_id:          0, qid:          4, opcode:          2 } hitcount:       1250
{ ctrl_id:          0, qid:          1, opcode:          1 } hitcount:         40
{ ctrl_id:          0, qid:          1, opcode:          2 } hitcount:       2087
{ ctrl_id:          1, qid:          2, opcode:          2 } hitcount:        999

Totals:
    Hits: 4379
    Entries: 5
    Dropped: 0
";
        assert_eq!(reads_by_qid(hist, 0), BTreeMap::from([(1, 2087), (4, 1250)]));
        assert_eq!(reads_by_qid(hist, 1), BTreeMap::from([(2, 999)]));
        assert!(reads_by_qid("", 0).is_empty());
    }

    #[test]
    fn proc_interrupts_gives_the_io_queues_interrupts_summed_over_cpus() {
        let text = "\
           CPU0       CPU1
  1:          9          0   IO-APIC   1-edge      i8042
 24:         16          0   PCI-MSI 49152-edge      nvme0q0
 25:       2119          5   PCI-MSI 49153-edge      nvme0q1
 26:          0        670   PCI-MSI 49154-edge      nvme0q2
 27:          7          0   PCI-MSI 49155-edge      nvme1q1
NMI:          0          0   Non-maskable interrupts
";
        assert_eq!(interrupts_by_qid(text, 0), BTreeMap::from([(1, 2124), (2, 670)]));
        assert_eq!(interrupts_by_qid(text, 1), BTreeMap::from([(1, 7)]));
    }

    #[test]
    fn reads_on_queues_without_an_interrupt_line_count_as_polled() {
        let before = QueueCounts {
            reads_by_qid: BTreeMap::from([(1, 100), (2, 50)]),
            interrupts_by_qid: BTreeMap::from([(1, 90), (2, 50)]),
        };
        let after = QueueCounts {
            reads_by_qid: BTreeMap::from([(1, 110), (2, 50), (4, 1250)]),
            interrupts_by_qid: BTreeMap::from([(1, 102), (2, 50)]),
        };
        assert_eq!(
            before.until(&after),
            QueueUse { reads: 1260, polled_reads: 1250, interrupts: 12 }
        );
        assert_eq!(after.until(&after), QueueUse::default());
    }

    #[test]
    fn the_controller_is_read_from_the_sysfs_path() {
        let path = Path::new("/sys/devices/pci0000:00/0000:00:04.0/nvme/nvme3/nvme3n1/nvme3n1p1");
        assert_eq!(controller_in_sysfs_path(path), Some(3));
        assert_eq!(controller_in_sysfs_path(Path::new("/sys/devices/virtual/block/loop0")), None);
    }

    #[test]
    fn a_multipath_namespace_is_on_its_subsystems_only_controller() {
        let sys = tempfile::tempdir().expect("tempdir");
        let controller = sys.path().join("pci0000:00/0000:00:03.0/nvme/nvme2");
        let subsystem = sys.path().join("virtual/nvme-subsystem/nvme-subsys2");
        let namespace = subsystem.join("nvme2n1");
        std::fs::create_dir_all(&controller).expect("the controller's directory");
        std::fs::create_dir_all(namespace.join("nvme2n1p1")).expect("the namespace's directory");
        std::fs::create_dir(subsystem.join("ng2n1")).expect("the generic device's directory");
        std::os::unix::fs::symlink(&controller, subsystem.join("nvme2")).expect("the link");
        assert_eq!(controller_of_block_device(&namespace), Ok(2));
        assert_eq!(controller_of_block_device(&namespace.join("nvme2n1p1")), Ok(2));
        std::os::unix::fs::symlink(&controller, subsystem.join("nvme3")).expect("a second link");
        let error = controller_of_block_device(&namespace).expect_err("two controllers");
        assert!(error.contains("lists 2 controllers"), "{error}");
        let loop_device = sys.path().join("virtual/block/loop0");
        let error = controller_of_block_device(&loop_device).expect_err("no NVMe controller");
        assert!(error.contains("not on an NVMe controller"), "{error}");
    }

    #[test]
    fn the_guest_runs_jobs_one_to_eight() {
        for scale in [Scale::Smallest, Scale::Small, Scale::Full] {
            assert_eq!(job_counts(scale, true), [1, 2, 3, 4, 5, 6, 7, 8]);
        }
        assert_eq!(job_counts(Scale::Smallest, false), [1, 2]);
    }

    #[test]
    fn each_series_reaches_the_panels_maximum_at_its_fewest_jobs() {
        let jobs = [1, 2, 4];
        let series = vec![
            Series {
                name: "pmcache io_uring".into(),
                points: vec![point(50.0, false), point(100.0, false), point(98.0, true)],
            },
            Series {
                name: "fio io_uring".into(),
                points: vec![point(40.0, false), point(90.0, false), point(96.0, true)],
            },
            Series {
                name: "pmcache pvsync2".into(),
                points: vec![point(10.0, false), point(60.0, false), None],
            },
            Series { name: "fio pvsync2".into(), points: vec![None, None, None] },
        ];
        let (reach, highest) = reach_of(&series, &jobs);
        assert_eq!(highest, Some((100.0, 0, 2)));
        assert_eq!(
            reach,
            [
                Reach::At { jobs: 2, oversubscribed: false },
                Reach::At { jobs: 4, oversubscribed: true },
                Reach::Never { best_share: 0.6, jobs: 2 },
                Reach::Unmeasured,
            ]
        );
        let sentence =
            fewest_jobs_sentence(&series, &jobs, &["io_uring".into(), "pvsync2".into()], 2);
        assert_eq!(
            sentence,
            "Fewest jobs to 95 % of the panel's highest, 100 KIOPS (pmcache io_uring, 2 jobs; \
             oversubscribed past 2 CPUs): io_uring: pmcache 2, fio 4 (oversubscribed); \
             pvsync2: pmcache never (at most 60 %, at 2), fio not measured."
        );
        let one_job = [Series { name: "pmcache libaio".into(), points: vec![point(7.0, false)] }];
        assert_eq!(
            fewest_jobs_sentence(&one_job, &[1], &["libaio".into()], 2),
            "Fewest jobs to 95 % of the panel's highest, 7.00 KIOPS (pmcache libaio, 1 job; \
             oversubscribed past 2 CPUs): libaio: pmcache 1, fio not measured."
        );
    }
}
