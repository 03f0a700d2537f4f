//! `pmcache bench core`: the engine against the raw medium it runs on.
//!
//! Every engine figure is measured in the same run as its baseline — the same 4 KiB access
//! pattern done directly on the same mapped medium (a copy out for reads, a copy plus persist
//! for writes) — and reported as a ratio. Each configuration runs `runs` times; within a run
//! the baseline, the floor and the engine take turns every `INTERLEAVE_BLOCK_OPS` operations
//! per thread (or, with `--separate`, each for the run's whole length). The table shows
//! medians (of throughputs and of per-run ratios); the JSON also has the per-run ratios'
//! quartiles.
//! Recovery time and DRAM per slot are measured on a cache of `recovery_slots` slots.
//!
//! Beside each engine figure a *floor* is measured in the same run: the least work any design
//! obeying the engine's contract must add to the raw access on this machine.
//! - Read floor: one dependent random 8-byte load from a DRAM table as large as the engine's
//!   DRAM metadata (where the slot is found), then the raw copy. Every design that maps a block
//!   to a slot through a DRAM structure pays this miss before its copy can start. Batched, the
//!   table loads of the batch overlap, and each copy starts loading the data of the copy
//!   `READ_DATA_PREFETCH_AHEAD` further on, as the engine's batches do (so the floor can
//!   pass the baseline, which copies one request at a time).
//! - Write floor: the raw copy + persist, then a 16-byte entry stored and persisted at a random
//!   slot's place in a metadata table — the persist order the engine's contract prescribes
//!   (data durable, *then* the entry that makes it visible), with nothing else. The entry is
//!   stored as the engine stores its entries (`Medium::store_pair_flush`, non-temporal where
//!   the medium chose non-temporal stores).
//!
//! `floor` in the table is floor / raw; the engine can approach it but not pass it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pmcache_backing::PsyncFile;
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, EvictionKind, MonotonicClock,
    READ_DATA_PREFETCH_AHEAD, ReadRequest, WriteRequest,
};
use pmcache_media::{DramTable, Medium, PmemFile};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::harness::stats::{median_in_place, quartiles};

const BLOCK: u64 = 4096;
/// A 4 KiB buffer aligned like a page, so that the baseline and the engine copy into
/// identically aligned memory (`rep movsb` speed depends on the destination's alignment).
#[repr(C, align(4096))]
struct PageBuf([u8; BLOCK as usize]);

fn page_buf(fill: u8) -> Box<PageBuf> {
    Box::new(PageBuf([fill; BLOCK as usize]))
}

/// Requests per call in the batched configurations (`-qd16`).
const QUEUE_DEPTH: usize = 16;

/// One operation in this many is timed for the latency percentiles.
const LATENCY_SAMPLE_EVERY: u64 = 64;

/// Options of `pmcache bench core`.
#[derive(Debug, Clone, clap::Args)]
pub struct CoreArgs {
    /// Directory for the emulated PM medium and the backing file (DRAM-backed: /dev/shm).
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
    /// Cache medium size in MiB.
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: u64,
    /// Seconds per run of each of the baseline, the floor and the engine.
    #[arg(long, default_value_t = 0.2)]
    pub seconds: f64,
    /// Runs per configuration (medians are reported). Many short runs rather than a few long
    /// ones: on a shared machine the load of other tenants drifts over seconds, and the
    /// medians of 25 runs of 0.2 s varied far less between invocations than those of 5 runs
    /// of 1 s (docs/PERFORMANCE.md, `bench core`).
    #[arg(long, default_value_t = 25)]
    pub runs: usize,
    /// Slots of the cache whose recovery is timed.
    #[arg(long, default_value_t = 1 << 20)]
    pub recovery_slots: u64,
    /// One JSON object per configuration (JSON lines) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Small and short: a smoke test of the harness (CI).
    #[arg(long)]
    pub quick: bool,
    /// Run the baseline, the floor and the engine each for the run's whole length in turn
    /// instead of alternating them every `INTERLEAVE_BLOCK_OPS` operations per thread (about a
    /// millisecond). Alternating, the three see the same moment of the machine's load, and
    /// the per-run ratios spread several times less (docs/PERFORMANCE.md, `bench core`). The
    /// 16-thread row always runs in turn.
    #[arg(long)]
    pub separate: bool,
    /// An execution barrier (`lfence` on x86-64) after every call of the baseline, the floor
    /// and the engine: the next call starts only once the last one has completed, as behind
    /// a request/response boundary (a frontend's reply and the client's next request). A call
    /// is one request, or 16 for the floor and the engine in the `-qd16` rows (one round trip
    /// for a queue of 16), where the baseline still does one. Without it, the CPU may start a
    /// request's first loads while the previous copy is still finishing; a short loop of raw
    /// copies gains from that the most (docs/PERFORMANCE.md, `bench core`).
    #[arg(long)]
    pub serialize: bool,
    /// Run only the configurations whose name contains this (e.g. `read-hit`); skips recovery
    /// unless it matches `recovery`. May start with a hyphen (`--only -4k-qd16`). A trailing
    /// `$` matches the end of the name only (`--only 'write-back-4k$'`: not the `-qd16` rows).
    #[arg(long, allow_hyphen_values = true)]
    pub only: Option<String>,
}

/// One row of the report. Fields that do not apply to a row are `None` (JSON `null`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CoreResult {
    /// Configuration name.
    pub name: String,
    /// Threads issuing requests.
    pub threads: usize,
    /// Requests handed to the engine per call (1, or 16 for the `-qd16` rows).
    pub requests_per_call: usize,
    /// Engine operations per second (median over runs); for the recovery row, slots
    /// recovered per second.
    pub ops_per_sec: f64,
    /// Baseline operations per second (median over runs).
    pub baseline_ops_per_sec: Option<f64>,
    /// What the baseline is.
    pub baseline: String,
    /// Median over runs of engine / raw baseline in the same run.
    pub ratio_to_raw: Option<f64>,
    /// First and third quartiles over runs of engine / baseline: how far the runs spread.
    pub ratio_to_raw_quartiles: Option<(f64, f64)>,
    /// The 16-thread row: median over runs of the engine at 16 threads / at 2 threads.
    pub ratio_to_2_threads: Option<f64>,
    /// The goal for the row's ratio (`ratio_to_raw`, or `ratio_to_2_threads`), if the issue
    /// sets one.
    pub goal_ratio: Option<f64>,
    /// The floor (see the module docs) over the baseline in the same run, median over runs.
    pub floor_ratio_to_raw: Option<f64>,
    /// Engine over the floor in the same run, median over runs.
    pub ratio_to_floor: Option<f64>,
    /// Engine latency percentiles (sampled) of one call (`requests_per_call` requests),
    /// nanoseconds.
    pub latency_ns_p50: Option<u64>,
    /// 99th percentile.
    pub latency_ns_p99: Option<u64>,
    /// The recovery row: median time to recover, milliseconds (each run on a medium mapped
    /// afresh, after the CPU caches were flushed).
    pub recovery_ms: Option<f64>,
    /// The recovery row: the slowest run, milliseconds.
    pub recovery_ms_max: Option<f64>,
    /// The recovery row: DRAM bytes per slot of the recovered cache.
    pub dram_bytes_per_slot: Option<f64>,
    /// The recovery row: DRAM bytes per slot of the cache the other rows ran on.
    pub dram_bytes_per_slot_bench_cache: Option<f64>,
    /// Runs measured.
    pub runs: usize,
    /// Seconds per run (the recovery row: none; it runs to completion).
    pub seconds: Option<f64>,
    /// Machine and setup.
    pub setup: String,
}

#[derive(Clone, Copy, PartialEq)]
enum Mix {
    Reads,
    Writes,
    Half,
}

struct Bed {
    dir: tempfile::TempDir,
    engine: Engine<Arc<PmemFile>, PsyncFile, MonotonicClock>,
    medium: Arc<PmemFile>,
    blocks: u64,
    data_offset: u64,
}

/// What the floors touch besides the medium: a DRAM table as large as the engine's DRAM
/// metadata holding random block numbers, and a metadata table of one 16-byte entry per slot
/// on a medium of its own.
struct Floor {
    /// Random block numbers, as many bytes as the engine's DRAM tables, and in the same kind
    /// of mapping (huge pages where the kernel gives them): the read's dependent load costs
    /// what the engine's index load can at least cost, TLB included.
    table: DramTable<AtomicU64>,
    entries: PmemFile,
    slots: u64,
}

fn floor_for(bed: &Bed) -> Result<Floor, String> {
    let slots = bed.engine.superblock().geometry.slot_count;
    let dram_bytes = bed.engine.dram_bytes() as u64;
    let mut rng = SmallRng::seed_from_u64(0xf100);
    let table = DramTable::<AtomicU64>::zeroed((dram_bytes / 8).max(1) as usize)
        .map_err(|e| e.to_string())?;
    table.iter().for_each(|word| word.store(rng.gen_range(0..bed.blocks), Ordering::Relaxed));
    let mut entries =
        PmemFile::open(&bed.dir.path().join("floor-entries"), Some((slots * 16).max(4096)))
            .map_err(|e| e.to_string())?;
    // The entries stored as the engine's are (non-temporally or not), whatever this medium's
    // own timing at open chose.
    entries.use_nontemporal(bed.medium.primitives().nt_block_copy);
    Ok(Floor { table, entries, slots })
}

fn setup_text(dir: &Path, medium: &PmemFile) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    format!(
        "{} cores ({cpu}); medium in {} (dax={}, flush={:?}, nt_copies={}, nt_entries={})",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        dir.display(),
        medium.is_dax(),
        medium.primitives().flush,
        medium.primitives().nt_block_copy,
        medium.primitives().nt_pair_store
    )
}

fn bed(dir: &Path, cache_bytes: u64, lanes: usize) -> Result<Bed, String> {
    let tmp = tempfile::tempdir_in(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let medium = Arc::new(
        PmemFile::open(&tmp.path().join("medium"), Some(cache_bytes)).map_err(|e| e.to_string())?,
    );
    let config = Config {
        mode: CacheMode::WriteBack,
        block_size: BLOCK as u32,
        max_lanes: lanes,
        admission: AdmissionConfig::Always,
        eviction: EvictionKind::Clock,
        index_buckets: None,
    };
    let slots = pmcache_engine::format::Geometry::for_medium(cache_bytes, BLOCK as u32)
        .map_err(|e| e.to_string())?
        .slot_count;
    // The working set fills 90 % of the cache: every access hits, none evicts.
    let blocks = slots * 9 / 10;
    let backing_path = tmp.path().join("backing");
    std::fs::File::create(&backing_path)
        .and_then(|f| f.set_len(blocks * BLOCK))
        .map_err(|e| e.to_string())?;
    let backing = PsyncFile::open(&backing_path).map_err(|e| e.to_string())?;
    let engine = Engine::format(medium.clone(), backing, MonotonicClock::default(), &config)
        .map_err(|e| e.to_string())?;
    let data_offset = engine.superblock().geometry.data_offset;
    {
        let mut lane = engine.lane().map_err(|e| e.to_string())?;
        let data = vec![0xa5u8; BLOCK as usize];
        for b in 0..blocks {
            lane.write(b * BLOCK, &data, false).map_err(|e| e.to_string())?;
        }
    }
    Ok(Bed { dir: tmp, engine, medium, blocks, data_offset })
}

/// `worker`, followed by an execution barrier after every call if `serialize` (see
/// [`CoreArgs::serialize`]).
fn paced<W: FnMut(&mut SmallRng)>(worker: W, serialize: bool) -> impl FnMut(&mut SmallRng) {
    paced_by(worker, serialize.then_some(pmcache_media::serialize_execution as fn()))
}

/// `worker`, followed by `barrier` after every call.
fn paced_by<W: FnMut(&mut SmallRng)>(
    mut worker: W,
    barrier: Option<fn()>,
) -> impl FnMut(&mut SmallRng) {
    move |rng: &mut SmallRng| {
        worker(rng);
        if let Some(barrier) = barrier {
            barrier();
        }
    }
}

/// Runs `threads` workers for `seconds`, each call of a worker doing `ops_per_call`
/// operations; returns total ops/s and merged sampled latencies (of whole calls).
fn drive<W>(
    threads: usize,
    seconds: f64,
    ops_per_call: usize,
    serialize: bool,
    make_worker: impl Fn(usize) -> W + Sync,
) -> (f64, Histogram<u64>)
where
    W: FnMut(&mut SmallRng) + Send,
{
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<(u64, Histogram<u64>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let stop = &stop;
                let make_worker = &make_worker;
                scope.spawn(move || {
                    let mut worker = paced(make_worker(t), serialize);
                    let mut rng = SmallRng::seed_from_u64(t as u64 + 1);
                    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
                    let mut ops = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..LATENCY_SAMPLE_EVERY - 1 {
                            worker(&mut rng);
                        }
                        let timed = Instant::now();
                        worker(&mut rng);
                        let _ = histogram.record(timed.elapsed().as_nanos() as u64);
                        ops += LATENCY_SAMPLE_EVERY * ops_per_call as u64;
                    }
                    (ops, histogram)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        handles.into_iter().map(|h| h.join().expect("worker panicked")).collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut merged = Histogram::<u64>::new(3).expect("histogram");
    let mut total = 0;
    for (ops, histogram) in results {
        total += ops;
        merged.add(histogram).expect("same histogram shape");
    }
    (total as f64 / elapsed, merged)
}

/// Operations each thread runs of one kind (baseline, floor or engine) before the next kind's
/// turn in an interleaved run (the default; not with `--separate`).
pub(crate) const INTERLEAVE_BLOCK_OPS: usize = 2048;

/// Runs `threads` threads, each with its own baseline, floor and engine worker (made by
/// `make_workers`, in that order), taking turns in blocks of `INTERLEAVE_BLOCK_OPS`
/// operations — every thread on the same kind at once, a barrier between kinds — until each
/// kind has run `seconds` on the first thread. The kinds' order rotates every round, so that
/// none always follows the same other kind. A turn lasts as long as its slowest thread (the
/// others wait at the barrier), so a kind's throughput is its operations over the sum of its
/// turns' slowest times — not a sum of per-thread rates, which would credit a thread that
/// finished early with time it spent waiting. Every kind's calls are timed alike (one in
/// `LATENCY_SAMPLE_EVERY`), so the timing costs each the same. `run` seeds the threads'
/// random sequences: each run draws other blocks. Returns the three throughputs (ops/s) and
/// the engine's sampled call latencies.
fn drive_interleaved<R, F, E>(
    threads: usize,
    seconds: f64,
    ops_per_call: usize,
    run: usize,
    serialize: bool,
    make_workers: impl Fn(usize) -> (R, F, E) + Sync,
) -> ([f64; 3], Histogram<u64>)
where
    R: FnMut(&mut SmallRng) + Send,
    F: FnMut(&mut SmallRng) + Send,
    E: FnMut(&mut SmallRng) + Send,
{
    /// Rounds a thread records before the run starts (more only grow the record, between
    /// timed turns).
    const ROUNDS_RESERVED: usize = 1 << 14;
    let barrier = std::sync::Barrier::new(threads);
    let stop = AtomicBool::new(false);
    // The baseline does one operation per call, the floor and the engine `ops_per_call`.
    let calls = [INTERLEAVE_BLOCK_OPS, (INTERLEAVE_BLOCK_OPS / ops_per_call).max(1)];
    let calls_per_turn = [calls[0], calls[1], calls[1]];
    let ops_per_turn = [calls[0], calls[1] * ops_per_call, calls[1] * ops_per_call];
    type ThreadRecord = (Vec<[Duration; 3]>, Histogram<u64>);
    let records: Vec<ThreadRecord> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, stop, make_workers) = (&barrier, &stop, &make_workers);
                scope.spawn(move || {
                    let (raw, floor, engine) = make_workers(t);
                    let (mut raw, mut floor, mut engine) =
                        (paced(raw, serialize), paced(floor, serialize), paced(engine, serialize));
                    let seed = ((run as u64) << 32) | (t as u64 + 1);
                    let mut rng = SmallRng::seed_from_u64(seed);
                    let mut histograms: [Histogram<u64>; 3] =
                        std::array::from_fn(|_| Histogram::new(3).expect("histogram"));
                    let mut rounds: Vec<[Duration; 3]> = Vec::with_capacity(ROUNDS_RESERVED);
                    let mut busy = [Duration::ZERO; 3];
                    loop {
                        barrier.wait();
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let mut round = [Duration::ZERO; 3];
                        for step in 0..3 {
                            let kind = (step + rounds.len()) % 3;
                            let mut call = |rng: &mut SmallRng| match kind {
                                0 => raw(rng),
                                1 => floor(rng),
                                _ => engine(rng),
                            };
                            barrier.wait();
                            let started = Instant::now();
                            // The last call of every `LATENCY_SAMPLE_EVERY` is timed, as in
                            // `drive`: never a turn's first, which follows another kind's turn
                            // and would skew the percentiles.
                            for n in 1..=calls_per_turn[kind] as u64 {
                                if n % LATENCY_SAMPLE_EVERY == 0 {
                                    let timed = Instant::now();
                                    call(&mut rng);
                                    let ns = timed.elapsed().as_nanos() as u64;
                                    let _ = histograms[kind].record(ns);
                                } else {
                                    call(&mut rng);
                                }
                            }
                            round[kind] = started.elapsed();
                            busy[kind] += round[kind];
                        }
                        rounds.push(round);
                        // The first thread decides, before the next round's barrier, for all.
                        if t == 0 && busy.iter().all(|spent| spent.as_secs_f64() >= seconds) {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    let [_, _, engine_latencies] = histograms;
                    (rounds, engine_latencies)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker panicked")).collect()
    });
    let round_count = records[0].0.len();
    assert!(records.iter().all(|(rounds, _)| rounds.len() == round_count), "rounds differ");
    let mut walls = [Duration::ZERO; 3];
    for round in 0..round_count {
        for (kind, wall) in walls.iter_mut().enumerate() {
            *wall += records.iter().map(|(rounds, _)| rounds[round][kind]).max().expect("threads");
        }
    }
    let rates = std::array::from_fn(|kind| {
        let ops = (threads * round_count * ops_per_turn[kind]) as f64;
        ops / walls[kind].as_secs_f64()
    });
    let mut merged = Histogram::<u64>::new(3).expect("histogram");
    for (_, histogram) in records {
        merged.add(histogram).expect("same histogram shape");
    }
    (rates, merged)
}

/// One thread's raw accesses: a 4 KiB copy from (or copy + persist to) a random block.
fn raw_worker(bed: &Bed, mix: Mix) -> impl FnMut(&mut SmallRng) + Send + '_ {
    let medium = bed.medium.clone();
    let (blocks, data_offset) = (bed.blocks, bed.data_offset);
    let mut buf = page_buf(0);
    let data = page_buf(0x3c);
    move |rng: &mut SmallRng| {
        let at = data_offset + rng.gen_range(0..blocks) * BLOCK;
        let write = match mix {
            Mix::Reads => false,
            Mix::Writes => true,
            Mix::Half => rng.gen_bool(0.5),
        };
        if write {
            medium.write_persist(at, &data.0);
        } else {
            medium.read(at, &mut buf.0);
            std::hint::black_box(&buf);
        }
    }
}

fn run_raw(bed: &Bed, mix: Mix, threads: usize, seconds: f64, serialize: bool) -> f64 {
    drive(threads, seconds, 1, serialize, |_| raw_worker(bed, mix)).0
}

/// One thread's floor (see the module docs): `case.batch` requests per call.
fn floor_worker<'a>(
    bed: &'a Bed,
    floor: &'a Floor,
    case: &'a Case,
) -> impl FnMut(&mut SmallRng) + Send + 'a {
    let batch = case.batch;
    let medium = bed.medium.clone();
    let data_offset = bed.data_offset;
    let mut bufs: Vec<Box<PageBuf>> = (0..batch).map(|_| page_buf(0)).collect();
    let data = page_buf(0x3c);
    let mut writes: Vec<(u64, u64)> = Vec::with_capacity(batch);
    let mut reads: Vec<u64> = Vec::with_capacity(batch);
    move |rng: &mut SmallRng| {
        writes.clear();
        reads.clear();
        for _ in 0..batch {
            let write = match case.mix {
                Mix::Reads => false,
                Mix::Writes => true,
                Mix::Half => rng.gen_bool(0.5),
            };
            if write {
                writes.push((rng.gen_range(0..bed.blocks), rng.gen_range(0..floor.slots) * 16));
            } else {
                reads.push(rng.gen_range(0..floor.table.len() as u64));
            }
        }
        // Writes: every block's data durable, then every entry (one fence each when
        // batched, the persist order of a group commit).
        if !writes.is_empty() {
            for &(block, _) in &writes {
                medium.write_flush(data_offset + block * BLOCK, &data.0);
            }
            medium.drain();
            for &(block, at) in &writes {
                floor.entries.store_pair_flush(at, block | 1 << 40, block);
            }
            floor.entries.drain();
        }
        // Reads: the table loads first (they overlap), then the copies.
        for r in reads.iter_mut() {
            *r = std::hint::black_box(floor.table[*r as usize].load(Ordering::Relaxed));
        }
        // Batched, the copies pipeline their data like the engine's batches do.
        let prefetch = |at: usize| {
            if let Some(&block) = reads.get(at).filter(|_| batch > 1) {
                medium.prefetch(data_offset + block * BLOCK, BLOCK);
            }
        };
        (0..READ_DATA_PREFETCH_AHEAD).for_each(prefetch);
        for (i, (&block, buf)) in reads.iter().zip(bufs.iter_mut()).enumerate() {
            prefetch(i + READ_DATA_PREFETCH_AHEAD);
            medium.read(data_offset + block * BLOCK, &mut buf.0);
            std::hint::black_box(&buf);
        }
    }
}

fn run_floor(bed: &Bed, floor: &Floor, case: &Case, seconds: f64, serialize: bool) -> f64 {
    drive(case.threads, seconds, case.batch, serialize, |_| floor_worker(bed, floor, case)).0
}

/// One thread's requests to the engine, through a lane of its own: `batch` per call.
fn engine_worker(bed: &Bed, mix: Mix, batch: usize) -> impl FnMut(&mut SmallRng) + Send + '_ {
    let mut lane = bed.engine.lane().expect("enough lanes");
    let blocks = bed.blocks;
    let mut bufs: Vec<Box<PageBuf>> = (0..batch).map(|_| page_buf(0)).collect();
    let data = page_buf(0x3c);
    let mut write_offsets: Vec<u64> = Vec::with_capacity(batch);
    let mut read_offsets: Vec<u64> = Vec::with_capacity(batch);
    let mut outcomes = Vec::with_capacity(batch);
    move |rng: &mut SmallRng| {
        write_offsets.clear();
        read_offsets.clear();
        for _ in 0..batch {
            let offset = rng.gen_range(0..blocks) * BLOCK;
            let write = match mix {
                Mix::Reads => false,
                Mix::Writes => true,
                Mix::Half => rng.gen_bool(0.5),
            };
            if write { write_offsets.push(offset) } else { read_offsets.push(offset) }
        }
        if batch == 1 {
            match (write_offsets.first(), read_offsets.first()) {
                (Some(&offset), _) => lane.write(offset, &data.0, false).expect("engine write"),
                (_, Some(&offset)) => {
                    lane.read(offset, &mut bufs[0].0).expect("engine read");
                    std::hint::black_box(&bufs[0]);
                }
                _ => unreachable!("one operation per call"),
            }
            return;
        }
        if !write_offsets.is_empty() {
            let requests: Vec<WriteRequest<'_>> = write_offsets
                .iter()
                .map(|&offset| WriteRequest { offset, data: &data.0, fua: false })
                .collect();
            lane.write_batch(&requests, &mut outcomes);
            outcomes.drain(..).for_each(|o| o.expect("engine write"));
        }
        if !read_offsets.is_empty() {
            let mut requests: Vec<ReadRequest<'_>> = read_offsets
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&offset, buf)| ReadRequest { offset, buf: &mut buf.0 })
                .collect();
            lane.read_batch(&mut requests, &mut outcomes);
            outcomes.drain(..).for_each(|o| o.expect("engine read"));
            std::hint::black_box(&requests);
        }
    }
}

fn run_engine(
    bed: &Bed,
    mix: Mix,
    threads: usize,
    batch: usize,
    seconds: f64,
    serialize: bool,
) -> (f64, Histogram<u64>) {
    drive(threads, seconds, batch, serialize, |_| engine_worker(bed, mix, batch))
}

/// The rows measure hits and overwrites of cached blocks only: the working set fits (90 % of
/// the cache), so a read miss, an eviction or a write-back during a row means the row measured
/// something else, and the bench says so instead of printing its figure.
fn check_no_misses(
    name: &str,
    before: &pmcache_engine::Stats,
    after: &pmcache_engine::Stats,
) -> Result<(), String> {
    let counters = |stats: &pmcache_engine::Stats| stats.counters().into_iter().collect::<Vec<_>>();
    let (before, after) = (counters(before), counters(after));
    let grew: Vec<String> = before
        .iter()
        .zip(&after)
        .filter(|((name, _), _)| {
            name.starts_with("read_misses") || *name == "evictions" || *name == "writebacks"
        })
        .filter(|((_, was), (_, now))| now > was)
        .map(|((counter, was), (_, now))| format!("{counter} +{}", now - was))
        .collect();
    if grew.is_empty() {
        Ok(())
    } else {
        Err(format!("{name}: the engine did more than hits and overwrites: {}", grew.join(", ")))
    }
}

/// Whether configuration `name` is selected by `--only`: it contains `only`, or ends with it
/// when `only` ends with `$`.
fn name_matches(name: &str, only: &str) -> bool {
    match only.strip_suffix('$') {
        Some(end) => name.ends_with(end),
        None => name.contains(only),
    }
}

struct Case {
    name: &'static str,
    mix: Mix,
    threads: usize,
    /// Requests handed to the engine per call (1: `read`/`write`; more: `read_batch` /
    /// `write_batch`, as a frontend with that many requests queued does).
    batch: usize,
    goal: Option<f64>,
    baseline: &'static str,
}

/// Runs every configuration and returns the rows.
pub fn run(args: &CoreArgs) -> Result<Vec<CoreResult>, String> {
    let (cache_bytes, seconds, runs, recovery_slots) = if args.quick {
        (64 << 20, args.seconds.min(0.2), args.runs.min(3), args.recovery_slots.min(1 << 14))
    } else {
        (args.cache_mib << 20, args.seconds, args.runs, args.recovery_slots)
    };
    let bed = bed(&args.dir, cache_bytes, 32)?;
    let floor = floor_for(&bed)?;
    let setup = format!(
        "{}; cache {} MiB, {} slots, working set {} blocks of 4 KiB{}{}",
        setup_text(&args.dir, &bed.medium),
        cache_bytes >> 20,
        bed.engine.superblock().geometry.slot_count,
        bed.blocks,
        if args.separate {
            "; baseline, floor and engine each for a whole run in turn".to_string()
        } else {
            format!(
                "; baseline, floor and engine alternated every {INTERLEAVE_BLOCK_OPS} operations"
            )
        },
        if args.serialize { "; an execution barrier after every call (--serialize)" } else { "" }
    );
    const READ: &str = "raw 4 KiB copy from the medium";
    const WRITE: &str = "raw 4 KiB copy + persist";
    const MIX: &str = "raw copy / copy + persist, 50:50";
    let case = |name, mix, threads, batch, goal, baseline| Case {
        name,
        mix,
        threads,
        batch,
        goal: Some(goal),
        baseline,
    };
    // One request per call, then QUEUE_DEPTH requests per call (batches); the baseline is the
    // raw access one request at a time in both.
    let cases = [
        case("read-hit-4k", Mix::Reads, 1, 1, 0.90, READ),
        case("read-hit-4k", Mix::Reads, 2, 1, 0.90, READ),
        case("write-back-4k", Mix::Writes, 1, 1, 0.70, WRITE),
        case("write-back-4k", Mix::Writes, 2, 1, 0.70, WRITE),
        case("mix-50-50-4k", Mix::Half, 2, 1, 0.80, MIX),
        case("read-hit-4k-qd16", Mix::Reads, 1, QUEUE_DEPTH, 0.90, READ),
        case("read-hit-4k-qd16", Mix::Reads, 2, QUEUE_DEPTH, 0.90, READ),
        case("write-back-4k-qd16", Mix::Writes, 1, QUEUE_DEPTH, 0.70, WRITE),
        case("write-back-4k-qd16", Mix::Writes, 2, QUEUE_DEPTH, 0.70, WRITE),
        case("mix-50-50-4k-qd16", Mix::Half, 2, QUEUE_DEPTH, 0.80, MIX),
    ];
    let mut rows = Vec::new();
    let selected = |name: &str| args.only.as_deref().is_none_or(|only| name_matches(name, only));
    for case in cases.iter().filter(|c| selected(c.name)) {
        let mut engine_ops = Vec::new();
        let mut raw_ops = Vec::new();
        let mut ratios = Vec::new();
        let mut floor_ratios = Vec::new();
        let mut to_floor = Vec::new();
        let mut histogram = Histogram::<u64>::new(3).expect("histogram");
        let before = bed.engine.stats();
        for run in 0..runs {
            let ([raw, floor_ops, ops], h) = if !args.separate {
                drive_interleaved(case.threads, seconds, case.batch, run, args.serialize, |_| {
                    (
                        raw_worker(&bed, case.mix),
                        floor_worker(&bed, &floor, case),
                        engine_worker(&bed, case.mix, case.batch),
                    )
                })
            } else {
                let serialize = args.serialize;
                let raw = run_raw(&bed, case.mix, case.threads, seconds, serialize);
                let floor_ops = run_floor(&bed, &floor, case, seconds, serialize);
                let (ops, h) =
                    run_engine(&bed, case.mix, case.threads, case.batch, seconds, serialize);
                ([raw, floor_ops, ops], h)
            };
            histogram.add(h).expect("same shape");
            ratios.push(ops / raw);
            floor_ratios.push(floor_ops / raw);
            to_floor.push(ops / floor_ops);
            engine_ops.push(ops);
            raw_ops.push(raw);
        }
        check_no_misses(case.name, &before, &bed.engine.stats())?;
        rows.push(CoreResult {
            name: case.name.to_string(),
            threads: case.threads,
            requests_per_call: case.batch,
            ops_per_sec: median_in_place(&mut engine_ops),
            baseline_ops_per_sec: Some(median_in_place(&mut raw_ops)),
            baseline: case.baseline.to_string(),
            ratio_to_raw: Some(median_in_place(&mut ratios)),
            ratio_to_raw_quartiles: Some(quartiles(&mut ratios)),
            goal_ratio: case.goal,
            floor_ratio_to_raw: Some(median_in_place(&mut floor_ratios)),
            ratio_to_floor: Some(median_in_place(&mut to_floor)),
            latency_ns_p50: Some(histogram.value_at_quantile(0.5)),
            latency_ns_p99: Some(histogram.value_at_quantile(0.99)),
            runs,
            seconds: Some(seconds),
            setup: setup.clone(),
            ..CoreResult::default()
        });
    }
    // 16 threads on this machine's cores against 2 threads: no collapse under oversubscription.
    if selected("mix-50-50-4k-16-threads") {
        let mut sixteen = Vec::new();
        let mut two = Vec::new();
        let mut ratios = Vec::new();
        let mut histogram = Histogram::<u64>::new(3).expect("histogram");
        let before = bed.engine.stats();
        let at = |threads| run_engine(&bed, Mix::Half, threads, 1, seconds, args.serialize);
        for run in 0..runs {
            // Alternately first, so that neither always follows the other.
            let ((base, _), (ops, h)) = if run % 2 == 0 {
                let base = at(2);
                (base, at(16))
            } else {
                let sixteen_threads = at(16);
                (at(2), sixteen_threads)
            };
            histogram.add(h).expect("same shape");
            two.push(base);
            sixteen.push(ops);
            ratios.push(ops / base);
        }
        check_no_misses("mix-50-50-4k at 16 threads", &before, &bed.engine.stats())?;
        rows.push(CoreResult {
            name: "mix-50-50-4k".to_string(),
            threads: 16,
            requests_per_call: 1,
            ops_per_sec: median_in_place(&mut sixteen),
            baseline_ops_per_sec: Some(median_in_place(&mut two)),
            baseline: "the engine at 2 threads".to_string(),
            ratio_to_2_threads: Some(median_in_place(&mut ratios)),
            goal_ratio: Some(0.90),
            latency_ns_p50: Some(histogram.value_at_quantile(0.5)),
            latency_ns_p99: Some(histogram.value_at_quantile(0.99)),
            runs,
            seconds: Some(seconds),
            setup: setup.clone(),
            ..CoreResult::default()
        });
    }
    let stats = bed.engine.stats();
    if std::env::var_os("PMCACHE_BENCH_STATS").is_some() {
        eprintln!("engine stats: {stats:?}");
    }
    let dram = stats.dram_bytes_per_slot;
    drop(floor);
    drop(bed);
    if selected("recovery") {
        rows.push(recovery_row(&args.dir, recovery_slots, runs, dram)?);
    }
    Ok(rows)
}

/// Bytes streamed through between recoveries to push the previous run's metadata out of the
/// CPU caches (several times any last-level cache of the machines this runs on).
const CACHE_FLUSH_BYTES: usize = 256 << 20;

/// Fills a cache of `slots` slots (two thirds dirty, one third clean), crashes it (drops it
/// without shutdown) and times `Engine::open`. Each run maps the medium afresh (so its page
/// tables are built inside the timed scan, as after a restart) and first streams through
/// `CACHE_FLUSH_BYTES`, so that no run finds the previous run's metadata in the CPU caches.
fn recovery_row(
    dir: &Path,
    slots: u64,
    runs: usize,
    dram_small: f64,
) -> Result<CoreResult, String> {
    let geometry_bytes = 4096 + (slots * 16).next_multiple_of(4096) + slots * BLOCK;
    let bed = bed(dir, geometry_bytes, 2)?;
    let slot_count = bed.engine.superblock().geometry.slot_count;
    {
        let mut lane = bed.engine.lane().map_err(|e| e.to_string())?;
        // The bed wrote 90 % of the slots dirty: write them all back, then overwrite two thirds
        // (each overwrite frees the old copy), leaving one third clean and two thirds dirty.
        lane.drain().map_err(|e| e.to_string())?;
        let data = vec![0x11u8; BLOCK as usize];
        for b in 0..bed.blocks * 2 / 3 {
            lane.write(b * BLOCK, &data, false).map_err(|e| e.to_string())?;
        }
    }
    let dram = bed.engine.stats().dram_bytes_per_slot;
    let Bed { dir: tmp, engine, medium, .. } = bed;
    let backing_path = tmp.path().join("backing");
    let medium_path = tmp.path().join("medium");
    drop(engine);
    drop(medium);
    let config = Config { max_lanes: 2, ..Config::default() };
    let mut times = Vec::new();
    let mut report = None;
    let mut flush_buffer = vec![0u8; CACHE_FLUSH_BYTES];
    for run in 0..runs {
        let medium = PmemFile::open(&medium_path, None).map_err(|e| e.to_string())?;
        let backing = PsyncFile::open(&backing_path).map_err(|e| e.to_string())?;
        flush_buffer.iter_mut().step_by(64).for_each(|byte| *byte = run as u8);
        std::hint::black_box(&flush_buffer);
        let started = Instant::now();
        let (engine, r) = Engine::open(medium, backing, MonotonicClock::default(), &config)
            .map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_secs_f64());
        report = Some(r);
        drop(engine);
    }
    let report = report.expect("at least one run");
    let slowest_s = times.iter().copied().fold(0.0, f64::max);
    let recovery_s = median_in_place(&mut times);
    Ok(CoreResult {
        name: format!(
            "recovery ({slot_count} slots: {} clean, {} dirty; DRAM {dram:.2} B/slot here, {dram_small:.2} B/slot at the bench cache)",
            report.clean, report.dirty
        ),
        threads: 1,
        requests_per_call: 1,
        ops_per_sec: slot_count as f64 / recovery_s,
        baseline: format!(
            "time to recover: {:.1} ms (median; slowest {:.1} ms; slots/s in ops_per_sec)",
            recovery_s * 1e3,
            slowest_s * 1e3
        ),
        recovery_ms: Some(recovery_s * 1e3),
        recovery_ms_max: Some(slowest_s * 1e3),
        dram_bytes_per_slot: Some(dram),
        dram_bytes_per_slot_bench_cache: Some(dram_small),
        runs,
        setup: format!("medium {} MiB in {}", geometry_bytes >> 20, dir.display()),
        ..CoreResult::default()
    })
}

/// `pmcache bench core`: prints the table (or JSON lines).
pub fn run_cli(args: &CoreArgs) -> Result<(), String> {
    let rows = run(args)?;
    if rows.is_empty() {
        return Err(format!("no configuration matches --only {:?}", args.only));
    }
    if args.json {
        for row in &rows {
            println!("{}", serde_json::to_string(row).map_err(|e| e.to_string())?);
        }
        return Ok(());
    }
    println!("pmcache bench core — {}", rows[0].setup);
    let timed = rows.iter().find_map(|row| row.seconds);
    println!(
        "medians of {} runs{}; ratio = engine / baseline in the same run (the 16-thread row: \
         engine at 16 threads / at 2); floor = the least any design with the engine's contract \
         adds, at the baseline's random places (see `pmcache bench core --help`), as floor / \
         baseline; engine/floor = engine / \
         floor in the same run; p50/p99 = latency of one call (16 requests in the -qd16 rows)\n",
        rows[0].runs,
        timed.map(|s| format!(" of {s:.1} s")).unwrap_or_default()
    );
    println!(
        "{:<20} {:>7} {:>14} {:>14} {:>8} {:>6} {:>7} {:>12} {:>9} {:>9}  baseline",
        "config",
        "threads",
        "engine op/s",
        "baseline op/s",
        "ratio",
        "goal",
        "floor",
        "engine/floor",
        "p50 ns",
        "p99 ns"
    );
    let last_is_recovery = rows.last().is_some_and(|r| r.name.starts_with("recovery"));
    let table = if last_is_recovery { &rows[..rows.len() - 1] } else { &rows[..] };
    for row in table {
        let ratio = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
        let number = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
        println!(
            "{:<20} {:>7} {:>14.0} {:>14} {:>8} {:>6} {:>7} {:>12} {:>9} {:>9}  {}",
            row.name,
            row.threads,
            row.ops_per_sec,
            row.baseline_ops_per_sec.map(|b| format!("{b:.0}")).unwrap_or_default(),
            ratio(row.ratio_to_raw.or(row.ratio_to_2_threads)),
            row.goal_ratio.map(|g| format!("{g:.2}x")).unwrap_or_default(),
            ratio(row.floor_ratio_to_raw),
            ratio(row.ratio_to_floor),
            number(row.latency_ns_p50),
            number(row.latency_ns_p99),
            row.baseline
        );
    }
    if last_is_recovery {
        let recovery = &rows[rows.len() - 1];
        println!("\n{}: {}", recovery.name, recovery.baseline);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        core: CoreArgs,
    }

    #[test]
    fn a_filter_ending_in_a_dollar_matches_the_end_of_the_name_only() {
        assert!(name_matches("write-back-4k", "write-back-4k$"));
        assert!(!name_matches("write-back-4k-qd16", "write-back-4k$"));
        assert!(name_matches("write-back-4k-qd16", "write-back-4k"));
        assert!(name_matches("mix-50-50-4k-qd16", "-qd16$"));
        assert!(!name_matches("recovery", "4k$"));
    }

    #[test]
    fn an_interleaved_run_gives_every_kind_the_same_operations_and_its_own_rate() {
        const BATCH: usize = 16;
        let ops = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
        let spin = |ns: u64| {
            let until = Instant::now() + Duration::from_nanos(ns);
            while Instant::now() < until {}
        };
        let ops_ref = &ops;
        let ([raw, floor, engine], latencies) = drive_interleaved(2, 0.02, BATCH, 0, false, |_| {
            (
                move |_: &mut SmallRng| {
                    ops_ref[0].fetch_add(1, Ordering::Relaxed);
                },
                move |_: &mut SmallRng| {
                    ops_ref[1].fetch_add(BATCH as u64, Ordering::Relaxed);
                    spin(2_000);
                },
                move |_: &mut SmallRng| {
                    ops_ref[2].fetch_add(BATCH as u64, Ordering::Relaxed);
                    spin(8_000);
                },
            )
        });
        let done = ops.each_ref().map(|o| o.load(Ordering::Relaxed));
        assert_eq!(done[0], done[1], "baseline and floor ran different operation counts");
        assert_eq!(done[1], done[2], "floor and engine ran different operation counts");
        assert_eq!(done[0] % (2 * INTERLEAVE_BLOCK_OPS as u64), 0, "whole blocks on both threads");
        assert!(done[0] > 0);
        // A call of 16 operations that spins 8 µs runs at about 2 M op/s per thread, 4 times
        // slower than one that spins 2 µs; the baseline does no work at all.
        assert!(raw > floor && floor > engine, "rates {raw} {floor} {engine}");
        let per_thread_ns = 2.0 * 1e9 * BATCH as f64 / engine;
        assert!(
            (8_000.0..100_000.0).contains(&per_thread_ns),
            "engine call took {per_thread_ns} ns"
        );
        assert!(!latencies.is_empty() && latencies.min() >= 7_900, "sampled engine call latencies");
    }

    /// A turn lasts as long as its slowest thread: with one thread's calls 4 times slower than
    /// the other's, the rate is both threads' operations over the slow thread's time, not the
    /// sum of the two threads' own rates (which would be 2.5 times higher).
    #[test]
    fn an_interleaved_rate_counts_each_turn_at_its_slowest_thread() {
        let spin = |ns: u64| {
            let until = Instant::now() + Duration::from_nanos(ns);
            while Instant::now() < until {}
        };
        let rates = drive_interleaved(2, 0.03, 1, 0, false, |t| {
            let ns = if t == 0 { 8_000 } else { 2_000 };
            let kind = move |_: &mut SmallRng| spin(ns);
            (kind, kind, kind)
        })
        .0;
        // 2 operations per 8 µs: at most 250 k op/s (spins only ever take longer, on a busy
        // machine much longer: other tests spin beside this one). The sum of per-thread rates
        // would be 125 k + 500 k = 625 k op/s.
        for rate in rates {
            assert!((40_000.0..=262_000.0).contains(&rate), "rate {rate}");
        }
    }

    #[test]
    fn a_paced_worker_is_followed_by_the_barrier_after_every_call_and_only_if_asked() {
        static BARRIERS: AtomicU64 = AtomicU64::new(0);
        fn count_barrier() {
            BARRIERS.fetch_add(1, Ordering::Relaxed);
        }
        for (barrier, barriers_wanted) in [(None, 0), (Some(count_barrier as fn()), 5)] {
            BARRIERS.store(0, Ordering::Relaxed);
            let mut calls = 0;
            let mut worker = paced_by(|_: &mut SmallRng| calls += 1, barrier);
            let mut rng = SmallRng::seed_from_u64(1);
            (0..5).for_each(|_| worker(&mut rng));
            drop(worker);
            assert_eq!((calls, BARRIERS.load(Ordering::Relaxed)), (5, barriers_wanted));
        }
        let parsed = Command::try_parse_from(["bench", "--serialize"]).expect("parses");
        assert!(parsed.core.serialize);
        assert!(!Command::try_parse_from(["bench"]).expect("parses").core.serialize);
    }

    #[test]
    fn a_filter_may_start_with_a_hyphen() {
        let parsed = Command::try_parse_from(["bench", "--only", "-4k-qd16", "--runs", "3"])
            .expect("a filter starting with a hyphen is a value, not an option");
        assert_eq!(parsed.core.only.as_deref(), Some("-4k-qd16"));
        assert_eq!(parsed.core.runs, 3);
    }
}
