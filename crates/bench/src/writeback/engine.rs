//! The engine's side of `bench writeback`: writers with and without the cleaner, read misses, the
//! cleaner's drain.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pmcache_backing::{BackingStore, EngineOptions, open_backing};
use pmcache_engine::{Config, ReadRequest, Stats, WriteRequest};
use pmcache_media::PmemFile;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::fio::run_fio_replay;
use super::{BLOCK_BYTES, CleanerFigures, DrainRun, Plan, Sample, Shape, TICK, WritebackArgs};
use crate::harness::bed::{Bed, BedDirs};
use crate::harness::fio::{RAW_ENGINES, best_of_engines};

/// A fresh cache on the medium directory over the backing file, `lanes` lanes.
type BenchBed = Bed<Arc<PmemFile>, Arc<dyn BackingStore>>;

fn open_engine(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    lanes: usize,
) -> Result<BenchBed, String> {
    let dirs = BedDirs::new(&args.medium_dir, &args.medium_dir)?;
    let medium = Arc::new(
        PmemFile::open(&dirs.medium_path(), Some(plan.cache_bytes)).map_err(|e| e.to_string())?,
    );
    let opts = EngineOptions { sync_contexts: lanes + 1, ..EngineOptions::new(plan.engine, true) };
    let store = open_backing(backing, &opts).map_err(|e| e.to_string())?;
    let config = Config { max_lanes: lanes, ..Config::default() };
    Bed::format(dirs, medium, store, &config)
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds")
}

/// Notes `error` as the run's failure and tells every thread to stop.
fn fail(failure: &Mutex<Option<String>>, stop: &AtomicBool, error: impl ToString) {
    *failure.lock().expect("failure lock") = Some(error.to_string());
    stop.store(true, Ordering::SeqCst);
}

/// The engine under `shape`'s writers for the run's length, with or without the cleaner.
pub(super) fn run_engine(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
    with_cleaner: bool,
    run: usize,
) -> Result<Sample, String> {
    let Bed { engine, dirs: _dirs, .. } = open_engine(args, plan, backing, shape.writers + 2)?;
    let slots = engine.superblock().geometry.slot_count;
    let span_blocks = plan.span_bytes / BLOCK_BYTES;
    let stop = AtomicBool::new(false);
    let steady = AtomicBool::new(false);
    let counts: Vec<AtomicU64> = (0..shape.writers).map(|_| AtomicU64::new(0)).collect();
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let mut cleaner = if with_cleaner {
        Some(engine.cleaner(plan.cleaner.clone()).map_err(|e| e.to_string())?)
    } else {
        None
    };
    struct Monitor {
        iops: Vec<f64>,
        dirty: Vec<f64>,
        full_at: Option<(Duration, u64)>,
        end: (Duration, u64),
    }
    let (monitor, histograms) = std::thread::scope(|scope| {
        let cleaner_thread = cleaner.as_mut().map(|c| scope.spawn(move || c.run(|_| {})));
        let writers: Vec<_> = (0..shape.writers)
            .map(|w| {
                let (engine, stop, steady, counts, failure) =
                    (&engine, &stop, &steady, &counts, &failure);
                scope.spawn(move || {
                    let mut hist = histogram();
                    let mut lane = match engine.lane() {
                        Ok(lane) => lane,
                        Err(e) => {
                            fail(failure, stop, e);
                            return hist;
                        }
                    };
                    let mut rng =
                        SmallRng::seed_from_u64(0x5eed ^ (w as u64) << 32 ^ (run as u64) << 48);
                    let mut data = vec![0u8; shape.depth * BLOCK_BYTES as usize];
                    rng.fill(&mut data[..]);
                    let mut offsets = vec![0u64; shape.depth];
                    let mut outcomes = Vec::with_capacity(shape.depth);
                    while !stop.load(Ordering::Relaxed) {
                        for o in offsets.iter_mut() {
                            *o = rng.gen_range(0..span_blocks) * BLOCK_BYTES;
                        }
                        let started = Instant::now();
                        let result = if shape.depth == 1 {
                            lane.write(offsets[0], &data, false)
                        } else {
                            let requests: Vec<WriteRequest<'_>> = offsets
                                .iter()
                                .zip(data.chunks(BLOCK_BYTES as usize))
                                .map(|(&offset, data)| WriteRequest { offset, data, fua: false })
                                .collect();
                            outcomes.clear();
                            lane.write_batch(&requests, &mut outcomes);
                            outcomes.drain(..).find(Result::is_err).unwrap_or(Ok(()))
                        };
                        let ns = started.elapsed().as_nanos() as u64;
                        if let Err(e) = result {
                            fail(failure, stop, e);
                            break;
                        }
                        if steady.load(Ordering::Relaxed) {
                            for _ in 0..shape.depth {
                                let _ = hist.record(ns.max(1));
                            }
                        }
                        counts[w].fetch_add(shape.depth as u64, Ordering::Relaxed);
                    }
                    hist
                })
            })
            .collect();
        // The monitor: whether the cache is full yet, and a sample every second.
        let start = Instant::now();
        let total = || counts.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
        let mut monitor = Monitor {
            iops: Vec::new(),
            dirty: Vec::new(),
            full_at: None,
            end: (Duration::ZERO, 0),
        };
        let mut last_second_total = 0;
        let run_for = Duration::from_secs_f64(plan.seconds);
        let mut next_tick = start + TICK;
        loop {
            std::thread::sleep(next_tick.saturating_duration_since(Instant::now()));
            next_tick += TICK;
            let now = start.elapsed();
            let written = total();
            if monitor.full_at.is_none() && written >= slots {
                monitor.full_at = Some((now, written));
                steady.store(true, Ordering::Relaxed);
            }
            let whole_seconds = now.as_secs() as usize;
            if whole_seconds > monitor.iops.len() {
                monitor.iops.push((written - last_second_total) as f64);
                monitor.dirty.push(engine.dirty_slots() as f64 / slots as f64);
                last_second_total = written;
            }
            if now >= run_for || stop.load(Ordering::Relaxed) {
                monitor.end = (now, written);
                break;
            }
        }
        stop.store(true, Ordering::SeqCst);
        let histograms: Vec<Histogram<u64>> =
            writers.into_iter().map(|h| h.join().expect("writer panicked")).collect();
        engine.stop_cleaner();
        if let Some(thread) = cleaner_thread {
            thread.join().expect("cleaner panicked");
        }
        (monitor, histograms)
    });
    drop(cleaner);
    if let Some(e) = failure.lock().expect("failure lock").take() {
        return Err(format!("a write failed: {e}"));
    }
    let mut hist = histogram();
    for h in &histograms {
        hist.add(h).map_err(|e| e.to_string())?;
    }
    let stats = engine.stats();
    let (end_t, end_written) = monitor.end;
    let (iops, first_steady_second) = match monitor.full_at {
        Some((t, written)) => (
            (end_written - written) as f64 / (end_t - t).as_secs_f64().max(1e-3),
            t.as_secs_f64().ceil() as usize,
        ),
        None => (end_written as f64 / end_t.as_secs_f64(), 0),
    };
    let min_window_ratio = min_window(&monitor.iops, first_steady_second, iops);
    Ok(Sample {
        full_after_s: monitor.full_at.map(|(t, _)| t.as_secs_f64()),
        dirty_fraction_end: monitor.dirty.last().copied(),
        dirty_timeline: monitor.dirty,
        cleaner: Some(figures(&stats, with_cleaner)),
        ..Sample::new(iops, min_window_ratio, latencies(&hist), monitor.iops)
    })
}

/// p50, p99, p99.9 and the max of `hist`, ns.
fn latencies(hist: &Histogram<u64>) -> [f64; 4] {
    let q = |q: f64| hist.value_at_quantile(q) as f64;
    [q(0.5), q(0.99), q(0.999), hist.max() as f64]
}

pub(super) fn figures(stats: &Stats, with_cleaner: bool) -> CleanerFigures {
    let c = &stats.cleaner;
    CleanerFigures {
        blocks_cleaned: c.blocks_cleaned,
        writes_issued: c.writes_issued,
        batches: c.batches,
        inline_writebacks: if with_cleaner {
            stats.writebacks.saturating_sub(c.blocks_cleaned)
        } else {
            stats.writebacks
        },
        stalls: c.stalls,
        stall_ns_p99: c.stall_ns_quantile(0.99),
        stall_ns_max: c.stall_ns_max,
        boosts: c.boosts,
        boosted_s: c.boosted_ns as f64 / 1e9,
    }
}

/// The slowest whole second from `first` on (the last, partial second left out), over `mean`.
pub(super) fn min_window(timeline: &[f64], first: usize, mean: f64) -> f64 {
    let windows = timeline.get(first..).unwrap_or(&[]);
    let slowest = windows.iter().copied().fold(f64::INFINITY, f64::min);
    if slowest.is_finite() && mean > 0.0 { slowest / mean } else { f64::NAN }
}

/// Random reads over the span in batches of `shape.depth`, one lane per reader: nearly all
/// miss (the span is several times the cache), and the misses of a batch go to the backing
/// store together. Latencies are of whole batches (a batch returns with its slowest read).
pub(super) fn run_misses(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    shape: Shape,
    run: usize,
) -> Result<Sample, String> {
    let Bed { engine, dirs: _dirs, .. } = open_engine(args, plan, backing, shape.writers + 1)?;
    let span_blocks = plan.span_bytes / BLOCK_BYTES;
    let stop = AtomicBool::new(false);
    let counts: Vec<AtomicU64> = (0..shape.writers).map(|_| AtomicU64::new(0)).collect();
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let (timeline, elapsed, histograms) = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..shape.writers)
            .map(|w| {
                let (engine, stop, counts, failure) = (&engine, &stop, &counts, &failure);
                scope.spawn(move || {
                    let mut hist = histogram();
                    let mut lane = match engine.lane() {
                        Ok(lane) => lane,
                        Err(e) => {
                            fail(failure, stop, e);
                            return hist;
                        }
                    };
                    let mut rng =
                        SmallRng::seed_from_u64(0x4ead ^ (w as u64) << 32 ^ (run as u64) << 48);
                    let mut bufs = vec![vec![0u8; BLOCK_BYTES as usize]; shape.depth];
                    let mut outcomes = Vec::with_capacity(shape.depth);
                    while !stop.load(Ordering::Relaxed) {
                        let mut reads: Vec<ReadRequest<'_>> = bufs
                            .iter_mut()
                            .map(|buf| ReadRequest {
                                offset: rng.gen_range(0..span_blocks) * BLOCK_BYTES,
                                buf,
                            })
                            .collect();
                        let started = Instant::now();
                        lane.read_batch(&mut reads, &mut outcomes);
                        let ns = started.elapsed().as_nanos() as u64;
                        if let Some(Err(e)) = outcomes.iter().find(|o| o.is_err()) {
                            fail(failure, stop, e);
                            break;
                        }
                        for _ in 0..shape.depth {
                            let _ = hist.record(ns.max(1));
                        }
                        counts[w].fetch_add(shape.depth as u64, Ordering::Relaxed);
                    }
                    hist
                })
            })
            .collect();
        let start = Instant::now();
        let run_for = Duration::from_secs_f64(plan.seconds);
        let mut timeline = Vec::new();
        let mut last = 0;
        while start.elapsed() < run_for && !stop.load(Ordering::Relaxed) {
            let next = start + Duration::from_secs(timeline.len() as u64 + 1);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            let total: u64 = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
            timeline.push((total - last) as f64);
            last = total;
        }
        stop.store(true, Ordering::SeqCst);
        let elapsed = start.elapsed();
        let histograms: Vec<Histogram<u64>> =
            readers.into_iter().map(|h| h.join().expect("reader panicked")).collect();
        (timeline, elapsed, histograms)
    });
    if let Some(e) = failure.lock().expect("failure lock").take() {
        return Err(format!("a read failed: {e}"));
    }
    let mut hist = histogram();
    for h in &histograms {
        hist.add(h).map_err(|e| e.to_string())?;
    }
    let total: u64 = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    let iops = total as f64 / elapsed.as_secs_f64();
    let stats = engine.stats();
    let misses =
        stats.read_misses_admitted + stats.read_misses_bypassed + stats.read_misses_sequential;
    eprintln!(
        "  read misses: {misses} of {} blocks read ({:.0} %), {} admitted",
        misses + stats.read_hits,
        100.0 * misses as f64 / (misses + stats.read_hits).max(1) as f64,
        stats.read_misses_admitted
    );
    Ok(Sample::new(iops, min_window(&timeline, 1, iops), latencies(&hist), timeline))
}

/// The cleaner alone: a cache filled with dirty blocks at distinct random places, drained;
/// then fio writes the same blocks in the same ascending order at the cleaner's queue depth.
pub(super) fn run_drain(
    args: &WritebackArgs,
    plan: &Plan,
    backing: &Path,
    run: usize,
) -> Result<DrainRun, String> {
    let Bed { engine, dirs: _dirs, .. } = open_engine(args, plan, backing, 2)?;
    let slots = engine.superblock().geometry.slot_count;
    let span_blocks = plan.span_bytes / BLOCK_BYTES;
    // 90 % of the slots: the fill never needs a slot back.
    let want = (slots * 9 / 10).min(span_blocks / 2) as usize;
    let mut rng = SmallRng::seed_from_u64(0xd2a1 ^ run as u64);
    let mut blocks: HashSet<u64> = HashSet::with_capacity(want);
    while blocks.len() < want {
        blocks.insert(rng.gen_range(0..span_blocks));
    }
    let mut blocks: Vec<u64> = blocks.into_iter().collect();
    {
        let mut lane = engine.lane().map_err(|e| e.to_string())?;
        let mut data = vec![0u8; BLOCK_BYTES as usize];
        rng.fill(&mut data[..]);
        for &b in &blocks {
            lane.write(b * BLOCK_BYTES, &data, false).map_err(|e| e.to_string())?;
        }
    }
    if engine.dirty_slots() != want as u64 {
        return Err(format!(
            "the fill left {} dirty blocks, not {want}: something wrote back early",
            engine.dirty_slots()
        ));
    }
    blocks.sort_unstable();
    // fio first on odd runs (see `run_cli`).
    let fio_first = run % 2 == 1;
    // The disk's best at the cleaner's queue depth: each of fio's engines replays the blocks.
    let replay = || {
        best_of_engines(
            &RAW_ENGINES,
            run,
            |engine| run_fio_replay(args, plan, backing, &blocks, engine),
            |&blocks_per_s| blocks_per_s,
        )
    };
    let mut fio = None;
    if fio_first {
        fio = Some(replay()?);
    }
    let mut cleaner = engine.cleaner(plan.cleaner.clone()).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let cleaned = cleaner.drain().map_err(|e| e.to_string())?;
    let seconds = started.elapsed().as_secs_f64();
    let writes_issued = engine.stats().cleaner.writes_issued;
    drop(cleaner);
    if cleaned != want as u64 {
        return Err(format!("the drain cleaned {cleaned} blocks, not {want}"));
    }
    let cleaner_blocks_per_s = cleaned as f64 / seconds;
    if !fio_first {
        fio = Some(replay()?);
    }
    let (fio_blocks_per_s, fio_engines) = fio.unzip();
    Ok(DrainRun {
        blocks: cleaned,
        cleaner_blocks_per_s,
        fio_blocks_per_s,
        fio_engines: fio_engines.unwrap_or_default(),
        writes_issued,
        ratio: fio_blocks_per_s.map(|f| cleaner_blocks_per_s / f),
    })
}
