//! Paper 001 (NOVA's scalability on a NUMA many-core server), Fig 3: block-level analogues of
//! FxMark's workloads on the in-process bed, where a file is a volume. Private writes (a,
//! DWOL) give each thread a volume of its own (a cache per thread, each in its own window of
//! one medium file); shared writes and the mixes (b–d, DWOM) share one volume. pmcache with a
//! lane per thread (the per-core logs of the scalable design) runs against one lane per
//! volume behind a mutex (the vanilla design's log and lock per inode), beside the raw medium.

use std::sync::Mutex;

use pmcache_backing::BackingStore;
use pmcache_engine::stores::STORES_MAX;
use pmcache_engine::{Lane, MonotonicClock};
use pmcache_media::Medium;
use pmcache_media::numa::Topology;

use super::Ctx;
use super::common::{check_all_hits, size, sweep};
use super::figure::{Figure, number};
use super::inproc::{Bed, SeriesRun, Worker, lane_request};
use super::volumes::Volumes;
use super::workload::{Access, DWOM_STRIDE_BYTES, Request, writer_count};

const GB: f64 = 1e9;

/// One panel of Fig 3.
struct Panel {
    /// The id's suffix.
    suffix: &'static str,
    title: &'static str,
    access: Access,
    /// The paper's sentence.
    published: &'static str,
    /// The vanilla analogue's series name.
    vanilla: &'static str,
    /// What the workload and each series stand for.
    notes: Vec<String>,
}

/// The four panels.
fn panels() -> [Panel; 4] {
    let region = size(DWOM_STRIDE_BYTES);
    let shared_series = format!(
        "One volume (FxMark's shared file) of {region} per thread, written once before the \
         measurement. Series: the raw medium does the same requests on the medium file (copy \
         + persist, the same offsets relative to the slot area); \"a lane per thread\" is \
         pmcache as it is meant to run, each thread with a lane (a log) of its own, the \
         scalable design's per-core logs; \"one shared lane\" is the vanilla analogue: all \
         threads through the volume's one lane behind a mutex, one log and one lock, as \
         vanilla NOVA's per-inode log and its lock."
    );
    let mixed_reads = format!(
        "Readers read block after block of the writers' regions ({region} each), each reader \
         starting at its own place in them: always another thread's blocks, never one block \
         twice in a row, so that reads go to the memory hierarchy rather than one cached \
         block; every read is a hit (checked). With one thread there is no reader (one writer \
         at least); from two threads on, at least one reader."
    );
    [
        Panel {
            suffix: "a",
            title: "private writes (DWOL analogue): each thread overwrites block 0 of its own \
                    volume",
            access: Access::Private { volume: DWOM_STRIDE_BYTES },
            published: "Vanilla NOVA rises to 17.15 GB/s at 15 cores (one socket) and then \
                        falls; Scalable NOVA grows linearly with cores.",
            vanilla: "pmcache, each volume's one lane behind a mutex",
            notes: vec![
                format!(
                    "A volume per thread (FxMark's private file): as many caches as the \
                     largest thread count, each of {region} in its own window of one medium \
                     file, laid out as `pmcache serve --store` lays out a medium shared by \
                     several backing stores (a store table, a window per store); thread t \
                     overwrites block 0 of volume t."
                ),
                "Series: the raw medium writes block 0 of each window's slot area (copy + \
                 persist); \"a lane per thread\" is each thread with a lane of its own \
                 volume's cache; the vanilla analogue is each volume's one lane behind a mutex \
                 of its own. Vanilla NOVA has a log (and a lock) per inode too, so a private \
                 file's writer contends with no other thread and the two pmcache series differ \
                 by an uncontended lock and unlock on each write; vanilla NOVA's fall past 15 \
                 cores is NUMA (all its data on one node), which one node cannot show: \
                 001-fig3-numa counts the placement on a guest of two nodes."
                    .into(),
            ],
        },
        Panel {
            suffix: "b",
            title: "shared writes (DWOM analogue): one volume, thread i overwrites the block at \
                    i × 8 MiB",
            access: Access::Shared { stride: DWOM_STRIDE_BYTES },
            published: "Vanilla NOVA gives 1.29 GB/s at 1 core and falls slightly as cores \
                        increase (the per-inode log lock); Scalable NOVA grows linearly.",
            vanilla: "pmcache, one shared lane",
            notes: vec![shared_series.clone()],
        },
        Panel {
            suffix: "c",
            title: "mixed, 75 % writer / 25 % reader threads on one volume, readers walking \
                    the writers' blocks",
            access: Access::Mixed { stride: DWOM_STRIDE_BYTES, writer_share: 0.75 },
            published: "Vanilla NOVA is bounded by its shared-file write performance; Scalable \
                        NOVA stays linear with a lower slope (remote reads).",
            vanilla: "pmcache, one shared lane",
            notes: vec![shared_series.clone(), mixed_reads.clone()],
        },
        Panel {
            suffix: "d",
            title: "mixed, 25 % writer / 75 % reader threads on one volume, readers walking \
                    the writers' blocks",
            access: Access::Mixed { stride: DWOM_STRIDE_BYTES, writer_share: 0.25 },
            published: "Scalable NOVA peaks at 54.24 GB/s at 36 cores and falls after that.",
            vanilla: "pmcache, one shared lane",
            notes: vec![shared_series, mixed_reads],
        },
    ]
}

/// A lane behind a mutex, on cache lines of its own: the lanes of several volumes side by
/// side share no line (a lock word written by one thread and read by another would cost what
/// vanilla NOVA's per-inode locks, each in its own inode, do not).
#[repr(align(128))]
struct LockedLane<'e, M: Medium, B: BackingStore>(Mutex<Lane<'e, M, B, MonotonicClock>>);

impl<'e, M: Medium, B: BackingStore> LockedLane<'e, M, B> {
    fn new(lane: Lane<'e, M, B, MonotonicClock>) -> Self {
        LockedLane(Mutex::new(lane))
    }
}

/// A series whose thread `t` does its requests through `lanes[t]`, a lane behind a mutex, or
/// through `lanes[0]` when there is one lane for all.
fn locked_lanes<'a, 'e, M: Medium, B: BackingStore>(
    name: &str,
    lanes: &'a [LockedLane<'e, M, B>],
) -> SeriesRun<'a>
where
    Lane<'e, M, B, MonotonicClock>: Send,
{
    SeriesRun::new(name, move |t| -> Worker<'a> {
        let lane = &lanes[if lanes.len() == 1 { 0 } else { t }].0;
        Box::new(move |request: &Request, buf: &mut [u8]| {
            lane_request(&mut lane.lock().expect("a worker panicked"), request, buf)
        })
    })
}

/// Fig 3 a–d.
pub fn fig3(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let threads = ctx.args.scale.threads();
    let nodes_here = Topology::detect().nodes().len();
    let threads_max = *threads.iter().max().expect("thread counts");
    if threads_max > STORES_MAX {
        return Err(format!(
            "001-fig3: {threads_max} private volumes, one medium holds at most {STORES_MAX}"
        ));
    }
    let span = DWOM_STRIDE_BYTES * threads_max as u64;
    let (pm_dir, disk_dir) = (&ctx.args.pm_dir, &ctx.args.dir);
    let shared = Bed::new(pm_dir, disk_dir, span)?;
    let volumes = Volumes::new(pm_dir, disk_dir, threads_max, DWOM_STRIDE_BYTES)?;
    let shared_lane = [LockedLane::new(shared.engine.lane().map_err(|e| e.to_string())?)];
    let volume_lanes = volumes
        .caches
        .iter()
        .map(|cache| cache.engine.lane().map(LockedLane::new).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let real_last = threads.iter().rposition(|&t| t <= ctx.cpus).expect("one thread is real");
    let mut figures = vec![];
    for panel in panels() {
        let series = if let Access::Private { .. } = panel.access {
            [
                SeriesRun::new("raw medium (copy + persist)", |_| volumes.raw_worker()),
                SeriesRun::new("pmcache, a lane per thread", |t| {
                    volumes.lane_worker(t).expect("a lane")
                }),
                locked_lanes(panel.vanilla, &volume_lanes),
            ]
        } else {
            [
                SeriesRun::new("raw medium (copy + persist)", |_| shared.raw_worker()),
                SeriesRun::new("pmcache, a lane per thread", |_| {
                    shared.lane_worker().expect("a lane")
                }),
                locked_lanes(panel.vanilla, &shared_lane),
            ]
        };
        let id = format!("001-fig3{}", panel.suffix);
        let positions: Vec<(String, Access, usize)> =
            threads.iter().map(|&t| (t.to_string(), panel.access, t)).collect();
        let sweep = sweep(ctx, &id, &series, &positions);
        let at = |x: usize, s: usize| {
            format!(
                "{} GB/s ({} of the raw medium)",
                number(sweep.median(x, s, GB)),
                number(sweep.ratio(x, s, 0))
            )
        };
        let ours = format!(
            "A lane per thread: {} at 1 thread, {} at {}; {}: {} and {}; the raw medium: {} \
             and {} GB/s.",
            at(0, 1),
            at(real_last, 1),
            threads[real_last],
            panel.vanilla.trim_start_matches("pmcache, "),
            at(0, 2),
            at(real_last, 2),
            number(sweep.median(0, 0, GB)),
            number(sweep.median(real_last, 0, GB))
        );
        let mut notes = panel.notes;
        if let Access::Mixed { writer_share, .. } = panel.access {
            let split: Vec<String> = threads
                .iter()
                .map(|&t| {
                    let writers = writer_count(t, writer_share);
                    format!("{t}: {writers}/{}", t - writers)
                })
                .collect();
            notes.push(format!("Writers/readers by thread count: {}.", split.join(", ")));
        }
        notes.extend([
            "Write-back mode; every write an out-of-place 4 KiB write persisted with its \
             entry."
                .into(),
            format!(
                "This machine has {} CPUs: points past {} threads time-share them and say \
                 nothing about scaling. Throughput is 4 KiB × requests per second, as FxMark \
                 counts it; the raw medium is measured in the same run, turn by turn.",
                ctx.cpus, ctx.cpus
            ),
            format!(
                "Not measured here: the cost of remote accesses (8 nodes in the paper, {} on \
                 this machine, and every thread's data in one medium file); 001-fig3-numa \
                 counts where pmcache's placement puts writes and reads on a guest of two \
                 nodes.",
                nodes_here
            ),
        ]);
        let thread_list: Vec<String> = threads.iter().map(usize::to_string).collect();
        let shrunk = vec![format!(
            "threads {} on {} CPUs instead of 1 … 120 cores on 8 sockets",
            thread_list.join(", "),
            ctx.cpus
        )];
        figures.push(Figure {
            id,
            title: panel.title.into(),
            bed: "in process (host): pmcache's engine and the raw medium, one /dev/shm file".into(),
            x_label: "threads".into(),
            x_ticks: threads.iter().map(usize::to_string).collect(),
            y_label: "GB/s".into(),
            series: sweep.absolute(GB),
            published: panel.published.into(),
            ours,
            scale: ctx.scale_note(shrunk),
            notes,
            provenance: ctx.provenance.clone(),
            ..Figure::default()
        });
    }
    check_all_hits(&shared, "001-fig3")?;
    match volumes.read_misses() {
        0 => Ok(figures),
        n => Err(format!("001-fig3a: {n} read misses on volumes meant to be all hits")),
    }
}
