//! Paper 004 (read performance of I/O interfaces on a low-latency NVMe SSD), Fig 1: 4 KiB random
//! reads by jobs through each of pmcache's backing engines, beside fio with the same engine
//! and settings in the same run (`bench engines`), at queue depth 1 (a) and 32 (b).
//!
//! On the host the disk is virtio, which has no poll queues: RWF_HIPRI cannot poll and IOPOLL
//! is refused. `scripts/guest/paper004.sh` runs the same inside a QEMU guest on an emulated
//! NVMe drive with poll queues (`--bed guest-nvme`), where both really poll.

use super::figure::{Figure, Point, Series, number};
use super::{Ctx, Scale};
use crate::engines::{self, EnginesArgs, Row};
use crate::harness::experiment::{Experiment, Run, parse};

/// The engines of the paper's series (libaio, pvsync2 with HIPRI, io_uring polled) and their
/// interrupt-driven counterparts.
const ENGINES: &str = "libaio,pvsync2,pvsync2-hipri,io_uring,io_uring-iopoll";

/// The arguments of `bench engines` for a scale (`--json`: it prints nothing).
fn arguments(ctx: &Ctx, jobs: &[usize]) -> Result<(EnginesArgs, Run), String> {
    let seconds = ctx.seconds_given.unwrap_or(ctx.args.scale.pick(5.0, 2.0, 0.5)).max(0.5);
    let file_mib = ctx.args.scale.pick(4096, 1024, 64);
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
    let jobs: Vec<usize> = match ctx.args.scale {
        Scale::Smallest => vec![1, 2],
        Scale::Small => vec![1, 2, 4, 8],
        Scale::Full => vec![1, 2, 4, 8, 16],
    };
    let (args, run) = arguments(ctx, &jobs)?;
    let report = args.run(&run)?;
    let guest = ctx.args.bed == "guest-nvme";
    let (suffix, bed) = if guest {
        (
            "-guest",
            "QEMU guest (TCG) on an emulated NVMe drive with poll queues (scripts/guest/paper004.sh): \
             HIPRI and IOPOLL poll",
        )
    } else {
        (
            "",
            "host: a file on the root disk (virtio, no poll queues: HIPRI cannot poll, IOPOLL is \
             refused), O_DIRECT",
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
            "Each point is the median IOPS over the runs (`bench engines` keeps per-run ratios, \
             not per-run IOPS, so no range is drawn)."
                .into(),
        ];
        let mut ratios = vec![];
        for name in &names {
            let at = |j: usize| rows.iter().find(|r| &r.engine == name && r.jobs == j);
            // KIOPS by jobs of one side (ours or fio's) of the rows.
            let kiops = |side: fn(&Row) -> Option<engines::Sample>| -> Vec<Option<Point>> {
                jobs.iter()
                    .map(|&j| {
                        let iops = side(at(j)?)?.iops / 1000.0;
                        Some(Point {
                            median: iops,
                            min: iops,
                            max: iops,
                            oversubscribed: j > ctx.cpus,
                        })
                    })
                    .collect()
            };
            let (ours, fio) = (kiops(|r| r.ours), kiops(|r| r.fio));
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
        if qd > 1 {
            notes.push(
                "pvsync2 (with or without HIPRI) is synchronous: its points are QD 1.".into(),
            );
        }
        figures.push(Figure {
            id: format!("004-fig1{panel}{suffix}"),
            title: format!("4 KiB random reads by jobs, QD {qd} per job, each engine beside fio's"),
            bed: bed.into(),
            x_label: "jobs".into(),
            x_ticks: jobs.iter().map(usize::to_string).collect(),
            y_label: "KIOPS".into(),
            series,
            published:
                "libaio stays at 550 KIOPS whatever the jobs; io_uring (polled) reaches the \
                        device's maximum from 2 jobs, SPDK from 1; pvsync2 with HIPRI needs about \
                        45 jobs."
                    .into(),
            ours: format!(
                "At 1 job, pmcache's engine over fio's same engine: {}.",
                if ratios.is_empty() { "not measured".to_string() } else { ratios.join(", ") }
            ),
            scale: ctx.scale_note_timed(
                vec![format!(
                    "jobs {} (the paper: 1 … 120 on 120 cores); a {} MiB file",
                    jobs.iter().map(usize::to_string).collect::<Vec<_>>().join(", "),
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
