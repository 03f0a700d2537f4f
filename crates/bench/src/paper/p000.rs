//! Paper 000 (software overhead of NVM-based I/O cache layers) on the in-process bed: pmcache's
//! engine against the raw medium it runs on, fio's workloads as the paper ran them —
//! synchronous, one request in flight per thread, every read a hit after a warm-up.

use std::path::Path;

use pmcache_backing::wrappers::{LatencyDist, LatencyStore};
use pmcache_backing::{BackingStore, IoBuf, PsyncFile};
use pmcache_engine::CacheMode;

use super::common::{GIB, KIB, MIB, check_all_hits, percent, size, sweep};
use super::figure::{Absolute, Figure, number};
use super::inproc::{Bed, SeriesRun, Sweep, Worker, measure};
use super::workload::{Access, Request};
use super::{Ctx, Scale};
use crate::harness::stats::min_max;

const MB: f64 = 1e6;
const GB: f64 = 1e9;

const BED: &str = "in process (host): pmcache's engine and the raw medium, one /dev/shm file";

/// What the in-process ratios are of: a bare copy on the medium, where the paper's are of the
/// NVDIMM as a block device.
const OF_RAW: &str = "of the raw medium in process (a bare copy + persist on the same file; no \
                      block layer, unlike the paper's ratios)";

/// The notes every paper-000 figure of this bed carries.
fn common_notes(span: u64) -> Vec<String> {
    vec![
        "Each thread issues one request at a time (fio's synchronous engine, QD 1 per thread), \
         as the paper ran fio."
            .into(),
        format!(
            "Working set {}: written once through the cache before the run, so every read is \
             a hit (the paper does not state its warm-up).",
            size(span)
        ),
        "The raw series does the same requests directly on the same medium file (reads copy \
         out; writes copy and persist): the paper's standalone NVM."
            .into(),
        "bcache, dm-cache and dm-writecache run only in the QEMU guest bed, on an emulated \
         NVDIMM; this bed has pmcache alone beside the raw medium."
            .into(),
    ]
}

/// Paper 000's published result for figure `id` (both beds), in one sentence.
pub fn published(id: &str) -> &'static str {
    match id {
        "000-fig2" => {
            "No numbers: with the SSD as cache the stacks land between the HDD and the \
             SSD, but with the NVM as cache bcache and dm-cache are slower than the NVM \
             alone."
        }
        "000-fig3" => {
            "bcache is worst at 4 KB and drops once the file passes 5 GB; dm-cache is \
             best at 256 KB (its block size) whatever the file size."
        }
        "000-fig4a" => {
            "bcache and dm-cache both reach a little over 60 % of the NVM at 1 thread; \
             at 16 threads bcache does not reach 30 %."
        }
        "000-fig4b" => {
            "Bandwidth saturates at 4 threads at a little over 10 GB/s (the kernel \
             stack's limit, below the NVM's); the caches come close to the NVM as \
             threads increase."
        }
        "000-fig5" => {
            "At 100 % reads every layer is close to the NVM; with 1 % writes bcache \
             falls to about 58 % of it and to 10 % at 10 % reads, while dm-cache stays \
             close to the NVM."
        }
        "000-fig6" => {
            "No numbers: bcache suffers severe overhead from its locks under even a \
             little intensive write traffic, more so as threads increase."
        }
        _ => "",
    }
}

/// A worker doing requests directly on a backing store.
fn backing_worker<B: BackingStore>(store: &B) -> Worker<'_> {
    Box::new(move |request: &Request, buf: &mut [u8]| {
        let buf = &mut buf[..request.len as usize];
        if request.write {
            store.write_at(buf, request.offset).expect("backing write");
        } else {
            store.read_at(buf, request.offset).expect("backing read");
        }
    })
}

fn thread_ticks(threads: &[usize]) -> Vec<String> {
    threads.iter().map(usize::to_string).collect()
}

/// The largest write of [`write_span`].
const WRITE_CHUNK_BYTES: u64 = MIB;

/// Writes `[0, span)` of `store` once, [`WRITE_CHUNK_BYTES`] at a time from an aligned
/// buffer, each byte `fill`, and flushes it: the store's own reads of the span then read data
/// from its disk, not the holes of a sparse file.
fn write_span<B: BackingStore>(store: &B, span: u64, fill: u8) -> Result<(), String> {
    let chunk = IoBuf::from_slice(&vec![fill; WRITE_CHUNK_BYTES as usize]);
    let mut offset = 0;
    while offset < span {
        let len = (span - offset).min(WRITE_CHUNK_BYTES) as usize;
        store
            .write_at(&chunk[..len], offset)
            .map_err(|e| format!("backing file, write at {offset}: {e}"))?;
        offset += len as u64;
    }
    store.flush().map_err(|e| format!("backing file, flush: {e}"))
}

/// The bytes of `[0, span)` of the file at `path` that are holes (read as zeros, stored
/// nowhere), found with `SEEK_DATA` and `SEEK_HOLE`.
fn hole_bytes(path: &Path, span: u64) -> Result<u64, String> {
    use rustix::fs::{SeekFrom, seek};
    let error = |e: rustix::io::Errno| format!("{}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (mut holes, mut at) = (0, 0);
    while at < span {
        let data = match seek(&file, SeekFrom::Data(at)) {
            Ok(data) => data,
            // No data at or past `at`: the rest is a hole.
            Err(rustix::io::Errno::NXIO) => span,
            Err(e) => return Err(error(e)),
        };
        holes += data.min(span) - at;
        if data >= span {
            break;
        }
        at = seek(&file, SeekFrom::Hole(data)).map_err(error)?;
    }
    Ok(holes)
}

/// Writes the span of `bed`'s backing file through `store` (the bed's backing store, or the
/// file under its delay) and checks the file holds data over all of it.
fn write_backing<B: BackingStore, S: BackingStore>(
    bed: &Bed<B>,
    store: &S,
    span: u64,
) -> Result<(), String> {
    write_span(store, span, FILL)?;
    let path = bed.dirs.backing_path();
    match hole_bytes(&path, span)? {
        0 => Ok(()),
        holes => Err(format!("{}: {holes} bytes of holes after writing the span", path.display())),
    }
}

/// What the disk files hold: the byte the bed writes through the cache, so that the cache and
/// its backing file agree.
const FILL: u8 = 0x5a;

/// `2–14 ms` for a uniform latency.
fn latency_text(dist: LatencyDist) -> String {
    let ms = |d: std::time::Duration| d.as_micros() as f64 / 1e3;
    match dist {
        LatencyDist::Fixed(d) => format!("{} ms", ms(d)),
        LatencyDist::Uniform { min, max } => format!("{}–{} ms", ms(min), ms(max)),
        LatencyDist::Exponential { min, mean_extra } => {
            format!("{} ms + {} ms on average", ms(min), ms(mean_extra))
        }
    }
}

/// Fig 2: the devices alone and the cache stacks, four workloads, log bandwidth.
pub fn fig2(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let span = scale.pick(GIB, 256 * MIB, 16 * MIB);
    let (pm, disk) = (&ctx.args.pm_dir, &ctx.args.dir);
    let ssd = Bed::new(pm, disk, span)?;
    let hdd_latency = LatencyDist::hdd();
    let hdd = Bed::with_backing(pm, disk, span, |path| {
        let file = PsyncFile::open_with(path, true, false).map_err(|e| e.to_string())?;
        Ok(LatencyStore::new(file, hdd_latency, 0x0d1))
    })?;
    // The devices' series read what was written: data on the disk, as the paper's devices
    // hold, not holes the file system answers without reading.
    write_backing(&ssd, ssd.engine.backing(), span)?;
    write_backing(&hdd, hdd.engine.backing().inner(), span)?;
    let hdd_name = format!("HDD (disk file, {} per request)", latency_text(hdd_latency));
    let workloads = [
        ("4K rand read", Access::Random { request: 4 * KIB, span, write_share: 0.0 }),
        ("4M seq read", Access::Sequential { request: 4 * MIB, span, write_share: 0.0 }),
        ("4K rand 50:50", Access::Random { request: 4 * KIB, span, write_share: 0.5 }),
        ("4M seq 50:50", Access::Sequential { request: 4 * MIB, span, write_share: 0.5 }),
    ];
    let series = [
        SeriesRun::new("NVM (raw medium)", |_| ssd.raw_worker()),
        SeriesRun::new("SSD (disk file, O_DIRECT)", |_| backing_worker(ssd.engine.backing())),
        SeriesRun::new(hdd_name.as_str(), |_| backing_worker(hdd.engine.backing())),
        SeriesRun::new("pmcache NVM→SSD", |_| ssd.lane_worker().expect("a lane")),
        SeriesRun::new("pmcache NVM→HDD", |_| hdd.lane_worker().expect("a lane")),
    ];
    let positions: Vec<(String, Access, usize)> =
        workloads.iter().map(|(tick, access)| (tick.to_string(), *access, 1)).collect();
    let result = sweep(ctx, "000-fig2", &series, &positions);
    check_all_hits(&ssd, "000-fig2")?;
    check_all_hits(&hdd, "000-fig2")?;
    let of_nvm: Vec<f64> = (0..workloads.len()).map(|x| result.ratio(x, 3, 0)).collect();
    let over_ssd: Vec<f64> = (0..workloads.len()).map(|x| result.ratio(x, 3, 1)).collect();
    let (ssd_lo, ssd_hi) = min_max(&over_ssd);
    let mut notes = common_notes(span);
    notes.push(format!(
        "The paper names no block size or mix (\"random and sequential patterns mixed\"); \
         the workloads here are {}.",
        listed(workloads.iter().map(|(tick, _)| tick.to_string()))
    ));
    notes.push(format!(
        "pmcache runs in write-back mode with no cleaner during the run: its writes stay in \
         the cache. The HDD is the disk file with each request taking at least {}.",
        latency_text(hdd_latency)
    ));
    notes.push(format!(
        "Both disk files are written in full ({} with O_DIRECT, {} at a time) before the run \
         and checked to hold no holes, so the SSD and HDD series read data from the disk.",
        size(span),
        size(WRITE_CHUNK_BYTES)
    ));
    notes.push(
        "The SSD→HDD stacks need an SSD-class cache medium, which pmcache does not take; that \
         pair is the guest bed's."
            .into(),
    );
    Ok(vec![Figure {
        id: "000-fig2".into(),
        title: "bandwidth of the devices alone and of the cache stacks".into(),
        bed: BED.into(),
        x_label: "workload (1 thread)".into(),
        x_ticks: workloads.iter().map(|(t, _)| t.to_string()).collect(),
        y_label: "MB/s (log)".into(),
        y_log: true,
        bars: true,
        series: result.absolute(MB),
        absolute: None,
        published: published("000-fig2").into(),
        ours: format!(
            "pmcache with the NVM as cache reaches {} {OF_RAW} across the four workloads, and \
             {}–{}× the disk file alone (O_DIRECT).",
            range_text(&of_nvm),
            number(ssd_lo),
            number(ssd_hi)
        ),
        scale: ctx.scale_note(shrunk_span(scale, span, "not stated by the paper")),
        notes,
        provenance: ctx.provenance.clone(),
    }])
}

/// Fig 3: bandwidth by request size, one line per working set (1 thread, random reads).
pub fn fig3(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let sets = scale.pick(
        vec![GIB, 3 * GIB, 5 * GIB, 10 * GIB],
        vec![64 * MIB, 192 * MIB, 320 * MIB, 640 * MIB],
        vec![4 * MIB, 12 * MIB, 20 * MIB, 40 * MIB],
    );
    let sizes: Vec<u64> = match scale {
        Scale::Smallest => vec![4 * KIB, 64 * KIB, MIB],
        _ => vec![4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB],
    };
    let span = *sets.last().expect("working sets");
    let bed = Bed::new(&ctx.args.pm_dir, &ctx.args.dir, span)?;
    let mut names = vec![];
    for set in &sets {
        names.push(format!("raw {}", size(*set)));
        names.push(format!("pmcache {}", size(*set)));
    }
    let bar = ctx.progress("000-fig3", (sizes.len() * sets.len() * 2 * ctx.runs) as u64);
    let pair = [
        SeriesRun::new("raw", |_| bed.raw_worker()),
        SeriesRun::new("pmcache", |_| bed.lane_worker().expect("a lane")),
    ];
    let mut result = Sweep { names, rates: vec![], oversubscribed: vec![] };
    for &request in &sizes {
        let mut rates = vec![];
        for &set in &sets {
            let access = Access::Random { request, span: set, write_share: 0.0 };
            rates.extend(measure(&pair, access, 1, ctx.seconds, ctx.runs, &|| bar.inc(1)));
        }
        result.push(rates, false);
    }
    bar.finish_and_clear();
    check_all_hits(&bed, "000-fig3")?;
    let last = sizes.len() - 1;
    let at_4k: Vec<f64> = (0..sets.len()).map(|w| result.ratio(0, 2 * w + 1, 2 * w)).collect();
    let at_max: Vec<f64> = (0..sets.len()).map(|w| result.ratio(last, 2 * w + 1, 2 * w)).collect();
    let mut notes = common_notes(span);
    notes.push(format!(
        "One cache of {} holds every working set; a line reads uniformly random blocks of \
         the first N bytes of it. Request sizes {} (the paper names 4 KB, 256 KB and 4 MB \
         only).",
        size(span),
        listed(sizes.iter().map(|s| size(*s)))
    ));
    let mut shrunk = vec![];
    if scale != Scale::Full {
        shrunk.push(format!(
            "working sets {} instead of 1, 3, 5 and 10 GB (the DRAM index of the smaller cache \
             fits the CPU caches better)",
            sets.iter().map(|s| size(*s)).collect::<Vec<_>>().join(", ")
        ));
    }
    if scale == Scale::Smallest {
        shrunk.push(format!("request sizes {} only", listed(sizes.iter().map(|s| size(*s)))));
    }
    Ok(vec![Figure {
        id: "000-fig3".into(),
        title: "read bandwidth by request size and working set (lookup cost)".into(),
        bed: BED.into(),
        x_label: "request size".into(),
        x_ticks: sizes.iter().map(|s| size(*s)).collect(),
        y_label: "GB/s".into(),
        series: result.absolute(GB),
        published: published("000-fig3").into(),
        ours: format!(
            "pmcache reaches {} at {} and {} at {} {OF_RAW}, from the smallest to the largest \
             working set.",
            range_text(&at_4k),
            size(sizes[0]),
            range_text(&at_max),
            size(sizes[last])
        ),
        scale: ctx.scale_note(shrunk),
        notes,
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    }])
}

/// Fig 4: threads, (a) 4 KiB random reads normalised to the raw medium, (b) 4 MiB sequential
/// reads in GB/s.
pub fn fig4(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let span = scale.pick(4 * GIB, 256 * MIB, 16 * MIB);
    let threads = scale.threads();
    let bed = Bed::new(&ctx.args.pm_dir, &ctx.args.dir, span)?;
    let series = [
        SeriesRun::new("NVM (raw medium)", |_| bed.raw_worker()),
        SeriesRun::new("pmcache", |_| bed.lane_worker().expect("a lane")),
    ];
    let random = Access::Random { request: 4 * KIB, span, write_share: 0.0 };
    let sequential = Access::Sequential { request: 4 * MIB, span, write_share: 0.0 };
    let at = |access: Access| -> Vec<(String, Access, usize)> {
        threads.iter().map(|&t| (t.to_string(), access, t)).collect()
    };
    let a = sweep(ctx, "000-fig4a", &series, &at(random));
    let b = sweep(ctx, "000-fig4b", &series, &at(sequential));
    check_all_hits(&bed, "000-fig4")?;
    let last = threads.len() - 1;
    let real: Vec<usize> = (0..threads.len()).filter(|&x| threads[x] <= ctx.cpus).collect();
    let real_last = *real.last().expect("one thread is real");
    let mut notes = common_notes(span);
    notes.push(format!(
        "This machine has {} CPUs: points past {} threads time-share them (drawn hollow, \
         starred in the tables) and say nothing about scaling.",
        ctx.cpus, ctx.cpus
    ));
    let shrunk = {
        let mut s = shrunk_span(scale, span, "not stated by the paper");
        if scale == Scale::Smallest {
            s.push(format!("threads {} only", listed(threads.iter().map(usize::to_string))));
        }
        s
    };
    let fig_a = Figure {
        id: "000-fig4a".into(),
        title: "4 KiB random reads by threads, normalised to the raw NVM".into(),
        bed: BED.into(),
        x_label: "threads".into(),
        x_ticks: thread_ticks(&threads),
        y_label: "bandwidth / raw NVM at the same threads".into(),
        series: a.normalised(0),
        absolute: Some(Absolute { y_label: "GB/s".into(), series: a.absolute(GB) }),
        published: published("000-fig4a").into(),
        ours: format!(
            "pmcache reaches {} at 1 thread and {} at {} (real CPUs) {OF_RAW}; {} at {} \
             threads, oversubscribed.",
            percent(a.ratio(0, 1, 0)),
            percent(a.ratio(real_last, 1, 0)),
            threads[real_last],
            percent(a.ratio(last, 1, 0)),
            threads[last]
        ),
        scale: ctx.scale_note(shrunk.clone()),
        notes: notes.clone(),
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    };
    let fig_b = Figure {
        id: "000-fig4b".into(),
        title: "4 MiB sequential reads by threads".into(),
        bed: BED.into(),
        x_label: "threads".into(),
        x_ticks: thread_ticks(&threads),
        y_label: "GB/s".into(),
        series: b.absolute(GB),
        published: published("000-fig4b").into(),
        ours: format!(
            "The raw medium in process (a bare memory copy, no block layer) gives {} GB/s at \
             1 thread and {} at {}; pmcache {} and {} of it.",
            number(b.median(0, 0, GB)),
            number(b.median(real_last, 0, GB)),
            threads[real_last],
            percent(b.ratio(0, 1, 0)),
            percent(b.ratio(real_last, 1, 0))
        ),
        scale: ctx.scale_note(shrunk),
        notes,
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    };
    Ok(vec![fig_a, fig_b])
}

/// The cache-mode series of Figs 5 and 6: the raw medium, pmcache in write-back and in
/// write-through (the mode switched before each turn).
fn mode_series<'a>(bed: &'a Bed<PsyncFile>) -> [SeriesRun<'a>; 3] {
    [
        SeriesRun::new("NVM (raw medium)", |_| bed.raw_worker()),
        SeriesRun::new("pmcache write-back", |_| bed.lane_worker().expect("a lane"))
            .before(|| bed.engine.set_mode(CacheMode::WriteBack)),
        SeriesRun::new("pmcache write-through", |_| bed.lane_worker().expect("a lane"))
            .before(|| bed.engine.set_mode(CacheMode::WriteThrough)),
    ]
}

fn mode_notes(span: u64) -> Vec<String> {
    let mut notes = common_notes(span);
    notes.push(
        "The paper does not state the cache modes. pmcache runs in both: write-back (a write \
         is durable in the cache when acknowledged; no cleaner runs during the run) and \
         write-through (every write also goes to the disk file, O_DIRECT, before it is \
         acknowledged, as bcache's default mode does)."
            .into(),
    );
    notes
}

/// Fig 5: one thread, 4 MiB sequential, read share falling from 100 to 10 %.
pub fn fig5(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let span = scale.pick(4 * GIB, 512 * MIB, 32 * MIB);
    let reads: Vec<u32> = match scale {
        Scale::Smallest => vec![100, 90, 50, 10],
        _ => vec![100, 99, 95, 90, 70, 50, 30, 10],
    };
    let bed = Bed::new(&ctx.args.pm_dir, &ctx.args.dir, span)?;
    let series = mode_series(&bed);
    let positions: Vec<(String, Access, usize)> = reads
        .iter()
        .map(|&r| {
            let write_share = f64::from(100 - r) / 100.0;
            (format!("{r} %"), Access::Sequential { request: 4 * MIB, span, write_share }, 1)
        })
        .collect();
    let result = sweep(ctx, "000-fig5", &series, &positions);
    bed.engine.set_mode(CacheMode::WriteBack);
    check_all_hits(&bed, "000-fig5")?;
    // Series `s`'s ratio at each of `shares` that was run: `61 % at 90 %, 20 % at 10 %`.
    let at_shares = |s: usize, shares: &[u32]| {
        let at = |read: u32| reads.iter().position(|&r| r == read);
        let texts = shares.iter().filter_map(|&read| {
            at(read).map(|x| format!("{} at {read} %", percent(result.ratio(x, s, 0))))
        });
        texts.collect::<Vec<_>>().join(", ")
    };
    let mut shrunk = shrunk_span(scale, span, "not stated by the paper");
    if scale == Scale::Smallest {
        shrunk.push(format!("read shares {} % only", listed(reads.iter().map(u32::to_string))));
    }
    Ok(vec![Figure {
        id: "000-fig5".into(),
        title: "4 MiB sequential reads and writes, read share falling, normalised to the NVM"
            .into(),
        bed: BED.into(),
        x_label: "read share (1 thread)".into(),
        x_ticks: positions.iter().map(|(t, _, _)| t.clone()).collect(),
        y_label: "bandwidth / raw NVM at the same mix".into(),
        series: result.normalised(0),
        absolute: Some(Absolute { y_label: "GB/s".into(), series: result.absolute(GB) }),
        published: published("000-fig5").into(),
        ours: format!(
            "pmcache write-back, by read share: {} {OF_RAW}; write-through (every write to \
             the disk): {}.",
            at_shares(1, &[100, 90, 10]),
            at_shares(2, &[90, 10])
        ),
        scale: ctx.scale_note(shrunk),
        notes: mode_notes(span),
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    }])
}

/// Fig 6: 4 KiB random 50:50 by threads, normalised to the NVM.
pub fn fig6(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let span = scale.pick(4 * GIB, 256 * MIB, 16 * MIB);
    let threads = scale.threads();
    let bed = Bed::new(&ctx.args.pm_dir, &ctx.args.dir, span)?;
    let series = mode_series(&bed);
    let access = Access::Random { request: 4 * KIB, span, write_share: 0.5 };
    let positions: Vec<(String, Access, usize)> =
        threads.iter().map(|&t| (t.to_string(), access, t)).collect();
    let result = sweep(ctx, "000-fig6", &series, &positions);
    bed.engine.set_mode(CacheMode::WriteBack);
    check_all_hits(&bed, "000-fig6")?;
    let real_last = threads.iter().rposition(|&t| t <= ctx.cpus).expect("one thread is real");
    let mut shrunk = shrunk_span(scale, span, "not stated by the paper");
    if scale == Scale::Smallest {
        shrunk.push(format!("threads {} only", listed(threads.iter().map(usize::to_string))));
    }
    Ok(vec![Figure {
        id: "000-fig6".into(),
        title: "4 KiB random reads and writes 50:50 by threads, normalised to the NVM".into(),
        bed: BED.into(),
        x_label: "threads".into(),
        x_ticks: thread_ticks(&threads),
        y_label: "bandwidth / raw NVM at the same threads".into(),
        series: result.normalised(0),
        absolute: Some(Absolute { y_label: "MB/s".into(), series: result.absolute(MB) }),
        published: published("000-fig6").into(),
        ours: format!(
            "pmcache write-back reaches {} at 1 thread and {} at {} {OF_RAW}; write-through, \
             bound by the disk, {} and {}.",
            percent(result.ratio(0, 1, 0)),
            percent(result.ratio(real_last, 1, 0)),
            threads[real_last],
            percent(result.ratio(0, 2, 0)),
            percent(result.ratio(real_last, 2, 0))
        ),
        scale: ctx.scale_note(shrunk),
        notes: mode_notes(span),
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    }])
}

/// What a scale shrank of a working set the paper did not give.
fn shrunk_span(scale: Scale, span: u64, paper: &str) -> Vec<String> {
    match scale {
        Scale::Full => vec![],
        _ => vec![format!("working set {} (the paper's: {paper})", size(span))],
    }
}

/// `1, 2 and 4`.
fn listed(items: impl Iterator<Item = String>) -> String {
    let mut items: Vec<String> = items.collect();
    match items.pop() {
        None => String::new(),
        Some(last) if items.is_empty() => last,
        Some(last) => format!("{} and {last}", items.join(", ")),
    }
}

/// `61 %` or `58–63 %`.
fn range_text(ratios: &[f64]) -> String {
    let (lo, hi) = min_max(ratios);
    if (hi - lo) * 100.0 < 0.5 {
        percent(lo)
    } else {
        format!("{:.0}–{:.0} %", lo * 100.0, hi * 100.0)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn the_backing_file_is_written_over_its_span_and_holds_no_holes() {
        let span = 4 * MIB;
        let bed = Bed::new(Path::new("/dev/shm"), &std::env::temp_dir(), span).expect("bed");
        let path = bed.dirs.backing_path();
        assert_eq!(hole_bytes(&path, span), Ok(span), "filling the cache leaves the file sparse");
        write_span(bed.engine.backing(), span / 2, FILL).expect("half the span");
        assert_eq!(hole_bytes(&path, span), Ok(span / 2), "the second half is still a hole");
        write_backing(&bed, bed.engine.backing(), span).expect("the span");
        assert_eq!(hole_bytes(&path, span), Ok(0));
        let blocks = std::fs::metadata(&path).expect("metadata").blocks();
        assert!(blocks * 512 >= span, "{blocks} blocks of 512 bytes stored for {span} bytes");
        let mut last = IoBuf::new(4096);
        bed.engine.backing().read_at(&mut last, span - 4096).expect("read");
        assert!(last.iter().all(|&b| b == FILL), "the file reads back what was written");
    }

    #[test]
    fn lists_and_latencies_read_as_the_figures_write_them() {
        assert_eq!(listed([1, 2, 4].iter().map(usize::to_string)), "1, 2 and 4");
        assert_eq!(listed(["4 KiB".to_string()].into_iter()), "4 KiB");
        assert_eq!(listed(std::iter::empty()), "");
        assert_eq!(latency_text(LatencyDist::hdd()), "2–14 ms");
        let fixed = LatencyDist::Fixed(std::time::Duration::from_micros(500));
        assert_eq!(latency_text(fixed), "0.5 ms");
    }
}
