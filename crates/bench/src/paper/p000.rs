//! Paper 000 (software overhead of NVM-based I/O cache layers) on the in-process bed: pmcache's
//! engine against the raw medium it runs on, fio's workloads as the paper ran them —
//! synchronous, one request in flight per thread, every read a hit after a warm-up.

use pmcache_backing::wrappers::{LatencyDist, LatencyStore};
use pmcache_backing::{BackingStore, PsyncFile};
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

/// Fig 2: the devices alone and the cache stacks, four workloads, log bandwidth.
pub fn fig2(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    let span = scale.pick(GIB, 256 * MIB, 16 * MIB);
    let (pm, disk) = (&ctx.args.pm_dir, &ctx.args.dir);
    let ssd = Bed::new(pm, disk, span)?;
    let hdd = Bed::with_backing(pm, disk, span, |path| {
        let file = PsyncFile::open_with(path, true, false).map_err(|e| e.to_string())?;
        Ok(LatencyStore::new(file, LatencyDist::hdd(), 0x0d1))
    })?;
    let workloads = [
        ("4K rand read", Access::Random { request: 4 * KIB, span, write_share: 0.0 }),
        ("4M seq read", Access::Sequential { request: 4 * MIB, span, write_share: 0.0 }),
        ("4K rand 50:50", Access::Random { request: 4 * KIB, span, write_share: 0.5 }),
        ("4M seq 50:50", Access::Sequential { request: 4 * MIB, span, write_share: 0.5 }),
    ];
    let series = [
        SeriesRun::new("NVM (raw medium)", |_| ssd.raw_worker()),
        SeriesRun::new("SSD (disk file, O_DIRECT)", |_| backing_worker(ssd.engine.backing())),
        SeriesRun::new("HDD (disk file + 2-14 ms)", |_| backing_worker(hdd.engine.backing())),
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
    notes.push(
        "The paper names no block size or mix (\"random and sequential patterns mixed\"); \
         four workloads are run here: 4 KiB random and 4 MiB sequential, reads and 50:50."
            .into(),
    );
    notes.push(
        "pmcache runs in write-back mode with no cleaner during the run: its writes stay in \
         the cache. The HDD is the disk file behind a 2-14 ms per-request delay."
            .into(),
    );
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
            "pmcache with the NVM as cache reaches {} of the NVM alone across the four \
             workloads, {}–{}× the SSD alone.",
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
         the first N bytes of it. The request ladder is ×4 from 4 KiB (the paper names 4 KB, \
         256 KB and 4 MB only).",
        size(span)
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
        shrunk.push("request sizes 4 KiB, 64 KiB and 1 MiB only".into());
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
            "pmcache reaches {} of the raw medium at 4 KiB and {} at {}, from the smallest to \
             the largest working set.",
            range_text(&at_4k),
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
            s.push("threads 1, 2 and 4 only".into());
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
            "pmcache reaches {} of the raw NVM at 1 thread and {} at {} (real CPUs); {} at {} \
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
            "The raw medium (this VM's memory copy) gives {} GB/s at 1 thread and {} at {}; \
             pmcache {} and {} of it.",
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
    let at = |read: u32, s: usize| {
        reads.iter().position(|&r| r == read).map(|x| percent(result.ratio(x, s, 0)))
    };
    let mut shrunk = shrunk_span(scale, span, "not stated by the paper");
    if scale == Scale::Smallest {
        shrunk.push("read shares 100, 90, 50 and 10 % only".into());
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
            "pmcache write-back: {} of the NVM at 100 % reads, {} at 90 %, {} at 10 %; \
             write-through (every write to the disk): {} at 90 %, {} at 10 %.",
            at(100, 1).unwrap_or_default(),
            at(90, 1).unwrap_or_default(),
            at(10, 1).unwrap_or_default(),
            at(90, 2).unwrap_or_default(),
            at(10, 2).unwrap_or_default()
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
        shrunk.push("threads 1, 2 and 4 only".into());
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
            "pmcache write-back reaches {} of the NVM at 1 thread and {} at {}; write-through, \
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

/// `61 %` or `58–63 %`.
fn range_text(ratios: &[f64]) -> String {
    let (lo, hi) = min_max(ratios);
    if (hi - lo) * 100.0 < 0.5 {
        percent(lo)
    } else {
        format!("{:.0}–{:.0} %", lo * 100.0, hi * 100.0)
    }
}
