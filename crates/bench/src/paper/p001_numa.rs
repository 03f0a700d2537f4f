//! Paper 001's NUMA half: Fig 3's private writes (a) and its read-heavy mix (d, 25 % writer /
//! 75 % reader threads reading other threads' blocks) counted as local and remote accesses
//! by thread count, on a cache of one member per NUMA node, with placement local and
//! interleaved.
//!
//! It needs a machine of two or more nodes with a directory bound to each: on the host (one
//! node) it boots the QEMU guest of `scripts/guest/paper001.sh` (two nodes, a tmpfs mounted
//! `mpol=bind:N` at `/mnt/pm/nodeN` for each), which runs this experiment inside with `--bed
//! guest-numa` and brings its figures back. Inside, the engine runs in process on the real
//! kernel's NUMA: threads pinned round-robin to the nodes' CPUs, each with its own lane,
//! placement by `sched_getcpu`. Under TCG a remote access costs what a local one does, so the
//! figures are shares of accesses, not speeds.

use std::path::{Path, PathBuf};

use pmcache_backing::PsyncFile;
use pmcache_engine::{
    Config, Engine, MemberStats, MonotonicClock, PlacementConfig, PlacementPolicy,
};
use pmcache_media::numa::{Topology, pin_to_cpu};
use pmcache_media::{MediumSet, PmemFile};

use super::Ctx;
use super::figure::{Figure, Point, Series, number};
use crate::harness::bed::{self, Bed, BedDirs};

/// The bed name inside the guest.
pub const GUEST_BED: &str = "guest-numa";
const BLOCK: u64 = 4096;

type NumaEngine = Engine<MediumSet<PmemFile>, PsyncFile, MonotonicClock>;
type NumaBed = Bed<MediumSet<PmemFile>, PsyncFile>;
type NumaLane<'e> = pmcache_engine::Lane<'e, MediumSet<PmemFile>, PsyncFile, MonotonicClock>;

/// One panel: id suffix, title, the share of writer threads, the paper's sentence.
fn panels() -> [(&'static str, &'static str, f64, &'static str); 2] {
    [
        (
            "a",
            "private writes: the share of each thread's writes on its own node",
            1.0,
            "With all data on one node, Vanilla NOVA's private writes peak at one socket; \
             Scalable NOVA places data and metadata on the writer's node and scales linearly.",
        ),
        (
            "d",
            "25 % writer / 75 % reader threads, readers reading another thread's blocks: the \
             share of reads and writes on the reader's or writer's own node",
            0.25,
            "Scalable NOVA peaks at 54.24 GB/s at 36 cores and falls after that: remote reads \
             become what limits read-heavy mixes.",
        ),
    ]
}

/// `001-fig3-numa`: on the host, through the guest; inside it, measured.
pub fn run(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    if ctx.args.bed == GUEST_BED {
        return measure(ctx);
    }
    let figures = super::guest::figures_from_guest(ctx, "scripts/guest/paper001.sh", &[], |f| {
        f.id.starts_with("001-fig3-numa")
    })?;
    if figures.len() != panels().len() {
        return Err(format!("the guest wrote {} 001-fig3-numa figures", figures.len()));
    }
    Ok(figures)
}

/// Local and remote accesses of one point, summed over the members.
#[derive(Default, Clone, Copy)]
struct Counts {
    reads_local: u64,
    reads_remote: u64,
    writes_local: u64,
    writes_remote: u64,
}

impl Counts {
    fn between(before: &[MemberStats], after: &[MemberStats]) -> Counts {
        let sum = |stats: &[MemberStats], f: fn(&MemberStats) -> u64| -> u64 {
            stats.iter().map(f).sum()
        };
        let delta = |f: fn(&MemberStats) -> u64| sum(after, f) - sum(before, f);
        Counts {
            reads_local: delta(|m| m.reads_local),
            reads_remote: delta(|m| m.reads_remote),
            writes_local: delta(|m| m.writes_local),
            writes_remote: delta(|m| m.writes_remote),
        }
    }

    fn local_pct(local: u64, remote: u64) -> Option<f64> {
        (local + remote > 0).then(|| 100.0 * local as f64 / (local + remote) as f64)
    }
}

/// The machine's memory nodes, each with its CPUs and its member's directory.
fn nodes(pm_dir: &Path) -> Result<Vec<(u32, Vec<usize>, PathBuf)>, String> {
    let topology = Topology::detect();
    let nodes: Vec<(u32, Vec<usize>, PathBuf)> = topology
        .memory_nodes()
        .iter()
        .map(|&n| (n, topology.cpus_of(n), pm_dir.join(format!("node{n}"))))
        .filter(|(_, cpus, _)| !cpus.is_empty())
        .collect();
    if nodes.len() < 2 {
        return Err(format!(
            "001-fig3-numa --bed {GUEST_BED} needs two NUMA nodes with CPUs and memory; this \
             machine has {} (run it without --bed to boot the guest of two nodes)",
            nodes.len()
        ));
    }
    for (_, _, dir) in &nodes {
        if !dir.is_dir() {
            return Err(format!("{}: missing (a directory bound to its node)", dir.display()));
        }
    }
    Ok(nodes)
}

/// A fresh cache of one member per node (each member's file in its node's directory) over a
/// new backing file.
fn engine(
    ctx: &Ctx,
    nodes: &[(u32, Vec<usize>, PathBuf)],
    member_bytes: u64,
    policy: PlacementPolicy,
) -> Result<NumaBed, String> {
    let dirs = BedDirs::new(&ctx.args.dir, &ctx.args.dir)?;
    let mut members = Vec::new();
    for (node, _, dir) in nodes {
        let path = dir.join("pmcache-001-numa.pm");
        let _ = std::fs::remove_file(&path);
        let medium = PmemFile::open(&path, Some(member_bytes)).map_err(|e| e.to_string())?;
        medium.reserve().map_err(|e| e.to_string())?;
        members.push((medium, Some(*node)));
    }
    let backing_path = dirs.backing_file(member_bytes * nodes.len() as u64)?;
    let backing = PsyncFile::open(&backing_path).map_err(|e| e.to_string())?;
    let config =
        Config { placement: PlacementConfig { policy, ..Default::default() }, ..bed::config(64) };
    Bed::format(dirs, MediumSet::new(members), backing, &config)
}

/// The CPU of thread `i`: the nodes in turn, each node's CPUs in turn.
fn cpu_of(nodes: &[(u32, Vec<usize>, PathBuf)], i: usize) -> usize {
    let (_, cpus, _) = &nodes[i % nodes.len()];
    cpus[(i / nodes.len()) % cpus.len()]
}

/// Runs `threads` threads, thread `i` pinned to `cpu_of(i)` with a lane of its own: the first
/// `writers` write their own region of `region` blocks `passes` times, the rest read the
/// region of the next thread (written by its owner first, so that it is cached).
fn point(
    engine: &NumaEngine,
    nodes: &[(u32, Vec<usize>, PathBuf)],
    threads: usize,
    writers: usize,
    region: u64,
    passes: usize,
) -> Result<Counts, String> {
    let each = |work: &(dyn Fn(usize, &mut NumaLane<'_>) -> Result<(), String> + Sync)| {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|i| {
                    scope.spawn(move || -> Result<(), String> {
                        pin_to_cpu(cpu_of(nodes, i)).map_err(|e| format!("pin: {e}"))?;
                        let mut lane = engine.lane().map_err(|e| e.to_string())?;
                        work(i, &mut lane)
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().expect("a bench thread panicked"))
        })
    };
    let data = vec![0x5au8; BLOCK as usize];
    let write_region = |i: usize, lane: &mut NumaLane<'_>| -> Result<(), String> {
        for b in 0..region {
            lane.write((i as u64 * region + b) * BLOCK, &data, false).map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    // Every thread's region written by its owner: the readers' blocks are cached, on their
    // owners' nodes.
    if writers < threads {
        each(&write_region)?;
    }
    let before = engine.member_stats();
    each(&|i, lane| {
        if i < writers {
            (0..passes).try_for_each(|_| write_region(i, lane))
        } else {
            let mut buf = vec![0u8; BLOCK as usize];
            let owner = ((i + 1) % threads) as u64;
            for _ in 0..passes {
                for b in 0..region {
                    lane.read((owner * region + b) * BLOCK, &mut buf).map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        }
    })?;
    Ok(Counts::between(&before, &engine.member_stats()))
}

/// Measures both panels inside a machine of several nodes.
fn measure(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let nodes = nodes(&ctx.args.pm_dir)?;
    let threads = ctx.args.scale.threads();
    let threads_max = *threads.iter().max().expect("thread counts");
    let region = ctx.args.scale.pick(4096, 2048, 512);
    let passes = ctx.args.scale.pick(4, 2, 1);
    // Room for every region, spread however placement spreads them, with a fifth to spare.
    let member_bytes = ((threads_max as u64 * region * (BLOCK + 16)).max(64 << 20) * 6 / 5)
        .next_multiple_of(1 << 20);
    let cpus: usize = nodes.iter().map(|(_, cpus, _)| cpus.len()).sum();
    let policies = [PlacementPolicy::Local, PlacementPolicy::Interleave];
    let mut figures = Vec::new();
    for (panel, title, writer_share, published) in panels() {
        // [policy][reads or writes][x] = local percentages of the runs.
        let mut pct = vec![vec![vec![Vec::new(); threads.len()]; 2]; policies.len()];
        let mut totals = Counts::default();
        for (p, &policy) in policies.iter().enumerate() {
            for (x, &t) in threads.iter().enumerate() {
                let writers = ((t as f64 * writer_share).ceil() as usize).clamp(1, t);
                for _ in 0..ctx.runs {
                    let Bed { engine, dirs: _dirs, .. } =
                        engine(ctx, &nodes, member_bytes, policy)?;
                    let counts = point(&engine, &nodes, t, writers, region, passes)?;
                    if policy == PlacementPolicy::Local {
                        totals.reads_local += counts.reads_local;
                        totals.reads_remote += counts.reads_remote;
                        totals.writes_local += counts.writes_local;
                        totals.writes_remote += counts.writes_remote;
                    }
                    if let Some(v) = Counts::local_pct(counts.writes_local, counts.writes_remote) {
                        pct[p][1][x].push(v);
                    }
                    if let Some(v) = Counts::local_pct(counts.reads_local, counts.reads_remote) {
                        pct[p][0][x].push(v);
                    }
                }
            }
        }
        let series_of = |p: usize, kind: usize, name: String| Series {
            name,
            points: threads
                .iter()
                .enumerate()
                .map(|(x, &t)| {
                    let values = &pct[p][kind][x];
                    (!values.is_empty()).then(|| Point::of(values, t > cpus))
                })
                .collect(),
        };
        let mut series = vec![
            series_of(0, 1, "writes on the writer's node, placement local".into()),
            series_of(1, 1, "writes on the writer's node, interleaved".into()),
        ];
        if writer_share < 1.0 {
            series.push(series_of(0, 0, "reads on the reader's node, placement local".into()));
            series.push(series_of(1, 0, "reads on the reader's node, interleaved".into()));
        }
        let at = |s: &Series, x: usize| {
            s.points[x].as_ref().map_or_else(|| "-".to_string(), |p| number(p.median))
        };
        let last = threads.len() - 1;
        let mut ours = format!(
            "Placement local: {} % of writes on the writer's node at {} threads (interleaved: \
             {} %).",
            at(&series[0], last),
            threads[last],
            at(&series[1], last)
        );
        if writer_share < 1.0 {
            ours += &format!(
                " Readers reading another thread's blocks: {} % of reads local with placement \
                 local, {} % interleaved — a block is read where its writer put it.",
                at(&series[2], last),
                at(&series[3], last)
            );
        }
        let id = format!("001-fig3-numa-{panel}");
        figures.push(Figure {
            id,
            title: title.into(),
            bed: format!(
                "QEMU guest (TCG) of {} NUMA nodes, a tmpfs bound to each (mpol=bind), one \
                 cache member per node; the engine in process, threads pinned round-robin to \
                 the nodes' CPUs",
                nodes.len()
            ),
            x_label: "threads".into(),
            x_ticks: threads.iter().map(usize::to_string).collect(),
            y_label: "% of accesses on the thread's own node".into(),
            series,
            published: published.into(),
            ours,
            scale: ctx.scale_note_timed(
                vec![
                    format!("{} nodes of {} CPUs in all instead of 8 sockets", nodes.len(), cpus),
                    format!("{region} blocks of 4 KiB per thread, each written (or read) {passes} time(s) a run"),
                ],
                0.0,
            ),
            notes: vec![
                "TCG has no remote-access latency: these are shares of accesses, counted by \
                 the engine per member (and the guest test checks the same placement from \
                 outside the engine: numa_maps, per-node Shmem, the members' bytes)."
                    .into(),
                format!(
                    "Thread i runs on node i mod {}; a reader reads the blocks of thread i + 1, \
                     on the other node when the thread count is even.",
                    nodes.len()
                ),
                format!(
                    "Placement local, all points and runs: {} writes local, {} remote; {} \
                     reads local, {} remote.",
                    totals.writes_local,
                    totals.writes_remote,
                    totals.reads_local,
                    totals.reads_remote
                ),
                format!("Points past {cpus} threads time-share the guest's CPUs."),
            ],
            provenance: ctx.provenance.clone(),
            ..Figure::default()
        });
    }
    Ok(figures)
}
