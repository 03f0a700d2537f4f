//! Paper 001 (NOVA's scalability on a NUMA many-core server), Fig 3: block-level analogues of
//! FxMark's workloads on the in-process bed, pmcache with a lane per thread (the per-core
//! logs of the scalable design) against all threads sharing one lane behind a lock (the
//! vanilla design's single log lock), beside the raw medium.

use std::sync::Mutex;

use super::common::{check_all_hits, size, sweep};
use super::figure::{Figure, number};
use super::inproc::{Bed, SeriesRun, Worker, lane_request};
use super::workload::{Access, DWOM_STRIDE_BYTES, Request};
use super::{Ctx, Scale};

const GB: f64 = 1e9;

/// The four panels: id suffix, title, workload, the paper's sentence.
fn panels() -> [(&'static str, &'static str, Access, &'static str); 4] {
    [
        (
            "a",
            "private writes (DWOL analogue): each thread overwrites a block of its own region",
            Access::Private { region: DWOM_STRIDE_BYTES },
            "Vanilla NOVA rises to 17.15 GB/s at 15 cores (one socket) and then falls; \
             Scalable NOVA grows linearly with cores.",
        ),
        (
            "b",
            "shared writes (DWOM analogue): thread i overwrites the block at i × 8 MiB",
            Access::Shared { stride: DWOM_STRIDE_BYTES },
            "Vanilla NOVA gives 1.29 GB/s at 1 core and falls slightly as cores increase \
             (the per-inode log lock); Scalable NOVA grows linearly.",
        ),
        (
            "c",
            "mixed, 75 % writer / 25 % reader threads, readers reading other threads' blocks",
            Access::Mixed { stride: DWOM_STRIDE_BYTES, writer_share: 0.75 },
            "Vanilla NOVA is bounded by its shared-file write performance; Scalable NOVA stays \
             linear with a lower slope (remote reads).",
        ),
        (
            "d",
            "mixed, 25 % writer / 75 % reader threads, readers reading other threads' blocks",
            Access::Mixed { stride: DWOM_STRIDE_BYTES, writer_share: 0.25 },
            "Scalable NOVA peaks at 54.24 GB/s at 36 cores and falls after that.",
        ),
    ]
}

/// Fig 3 a–d.
pub fn fig3(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let threads = scale.threads();
    let threads_max = *threads.iter().max().expect("thread counts");
    let span = DWOM_STRIDE_BYTES * threads_max as u64;
    let bed = Bed::new(&ctx.args.pm_dir, &ctx.args.dir, span)?;
    let shared_lane = Mutex::new(bed.engine.lane().map_err(|e| e.to_string())?);
    let series = [
        SeriesRun::new("raw medium (copy + persist)", |_| bed.raw_worker()),
        SeriesRun::new("pmcache, a lane per thread", |_| bed.lane_worker().expect("a lane")),
        SeriesRun::new("pmcache, one shared lane", |_| -> Worker<'_> {
            let shared = &shared_lane;
            Box::new(move |request: &Request, buf: &mut [u8]| {
                let mut lane = shared.lock().expect("a worker panicked");
                lane_request(&mut lane, request, buf);
            })
        }),
    ];
    let real_last = threads.iter().rposition(|&t| t <= ctx.cpus).expect("one thread is real");
    let mut figures = vec![];
    for (panel, title, access, published) in panels() {
        let id = format!("001-fig3{panel}");
        let positions: Vec<(String, Access, usize)> =
            threads.iter().map(|&t| (t.to_string(), access, t)).collect();
        let sweep = sweep(ctx, &id, &series, &positions);
        let gb = |x: usize, s: usize| number(sweep.median(x, s, GB));
        let ours = format!(
            "A lane per thread: {} GB/s at 1 thread, {} at {}; one shared lane: {} and {}; \
             the raw medium: {} and {}.",
            gb(0, 1),
            gb(real_last, 1),
            threads[real_last],
            gb(0, 2),
            gb(real_last, 2),
            gb(0, 0),
            gb(real_last, 0)
        );
        let mut notes = vec![
            "Block-level analogue: pmcache has no files or inodes, so \"private\" and \
             \"shared\" differ only in where the blocks lie; the lock FxMark's shared \
             workloads contend on (NOVA's per-inode log) has no counterpart, which is the \
             design's point. The vanilla analogue is all threads through one lane behind a \
             mutex: one log, one lock."
                .into(),
            "Write-back mode; every write an out-of-place 4 KiB write persisted with its \
             entry; readers' blocks are always cached."
                .into(),
            format!(
                "This machine has {} CPUs: points past {} threads time-share them and say \
                 nothing about scaling. Throughput is 4 KiB × requests per second, as FxMark \
                 counts it.",
                ctx.cpus, ctx.cpus
            ),
            "Not measured: the NUMA half of the paper (8 nodes, remote reads); this VM has \
             one node, and pmcache does not yet place data by node."
                .into(),
        ];
        if access == (Access::Private { region: DWOM_STRIDE_BYTES }) {
            notes.push(format!(
                "Each thread's region is {}; the cache holds {} in all.",
                size(DWOM_STRIDE_BYTES),
                size(span)
            ));
        }
        let mut shrunk =
            vec!["threads 1 … 16 on 2 CPUs instead of 1 … 120 cores on 8 sockets".into()];
        if scale == Scale::Smallest {
            shrunk.push("threads 1, 2 and 4 only".into());
        }
        figures.push(Figure {
            id,
            title: title.into(),
            bed: "in process (host): pmcache's engine and the raw medium, one /dev/shm file".into(),
            x_label: "threads".into(),
            x_ticks: threads.iter().map(usize::to_string).collect(),
            y_label: "GB/s".into(),
            series: sweep.absolute(GB),
            published: published.into(),
            ours,
            scale: ctx.scale_note(shrunk),
            notes,
            provenance: ctx.provenance.clone(),
            ..Figure::default()
        });
    }
    check_all_hits(&bed, "001-fig3")?;
    Ok(figures)
}
