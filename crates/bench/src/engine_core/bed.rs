//! The test bed of `bench engine-core`: a cache medium and backing file, the floors' tables, and each
//! kind's worker (raw, floor, engine).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hdrhistogram::Histogram;
use pmcache_backing::PsyncFile;
use pmcache_engine::{Config, READ_DATA_PREFETCH_AHEAD, ReadRequest, WriteRequest};
use pmcache_media::{DramTable, Medium, MediumSet, PmemFile, Window};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::drive::drive;
use super::{BLOCK, Case, PageBuf, page_buf};
use crate::harness;

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Mix {
    Reads,
    Writes,
    Half,
}

/// The engine on the medium as `pmcache serve` has it (`CacheMedium`'s window of it), its
/// working set written.
pub(super) struct Bed {
    pub(super) bed: harness::bed::Bed<MediumSet<Window<Arc<PmemFile>>>, PsyncFile>,
    pub(super) medium: Arc<PmemFile>,
    pub(super) blocks: u64,
}

impl std::ops::Deref for Bed {
    type Target = harness::bed::Bed<MediumSet<Window<Arc<PmemFile>>>, PsyncFile>;
    fn deref(&self) -> &Self::Target {
        &self.bed
    }
}

/// What the floors touch besides the medium: a DRAM table as large as the engine's DRAM
/// metadata holding random block numbers, and a metadata table of one 16-byte entry per slot
/// on a medium of its own.
pub(super) struct Floor {
    /// Random block numbers, as many bytes as the engine's DRAM tables, and in the same kind
    /// of mapping (huge pages where the kernel gives them): the read's dependent load costs
    /// what the engine's index load can at least cost, TLB included.
    table: DramTable<AtomicU64>,
    entries: PmemFile,
    slots: u64,
}

pub(super) fn floor_for(bed: &Bed) -> Result<Floor, String> {
    let slots = bed.engine.superblock().geometry.slot_count;
    let dram_bytes = bed.engine.dram_bytes() as u64;
    let mut rng = SmallRng::seed_from_u64(0xf100);
    let table = DramTable::<AtomicU64>::zeroed((dram_bytes / 8).max(1) as usize)
        .map_err(|e| e.to_string())?;
    table.iter().for_each(|word| word.store(rng.gen_range(0..bed.blocks), Ordering::Relaxed));
    let mut entries = PmemFile::open(
        &bed.dirs.medium_path().with_file_name("floor-entries"),
        Some((slots * 16).max(4096)),
    )
    .map_err(|e| e.to_string())?;
    // The entries stored as the engine's are (non-temporally or not), whatever this medium's
    // own timing at open chose.
    entries.use_nontemporal(bed.medium.primitives().nt_block_copy);
    Ok(Floor { table, entries, slots })
}

pub(super) fn setup_text(dir: &Path, medium: &PmemFile) -> String {
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

/// A cache of `cache_bytes` on a new medium in `dir` (with data checksums if `data_crc`),
/// its working set written.
pub(super) fn bed(
    dir: &Path,
    cache_bytes: u64,
    lanes: usize,
    data_crc: bool,
) -> Result<Bed, String> {
    let dirs = harness::bed::BedDirs::new(dir, dir)?;
    let medium = Arc::new(
        PmemFile::open(&dirs.medium_path(), Some(cache_bytes)).map_err(|e| e.to_string())?,
    );
    // The working set fills 90 % of the cache: every access hits, none evicts.
    let blocks = harness::bed::slot_count(cache_bytes, data_crc)? * 9 / 10;
    let backing =
        PsyncFile::open(&dirs.backing_file(blocks * BLOCK)?).map_err(|e| e.to_string())?;
    let config = Config { data_crc, ..harness::bed::config(lanes) };
    let set = MediumSet::single(Window::whole(medium.clone()));
    let bed = harness::bed::Bed::format(dirs, set, backing, &config)?;
    {
        let mut lane = bed.engine.lane().map_err(|e| e.to_string())?;
        let data = vec![0xa5u8; BLOCK as usize];
        for b in 0..blocks {
            lane.write(b * BLOCK, &data, false).map_err(|e| e.to_string())?;
        }
    }
    Ok(Bed { bed, medium, blocks })
}

/// One thread's raw accesses: a 4 KiB copy from (or copy + persist to) a random block.
pub(super) fn raw_worker(bed: &Bed, mix: Mix) -> impl FnMut(&mut SmallRng) + Send + '_ {
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

pub(super) fn run_raw(bed: &Bed, mix: Mix, threads: usize, seconds: f64, serialize: bool) -> f64 {
    drive(threads, seconds, 1, serialize, |_| raw_worker(bed, mix)).0
}

/// One thread's floor (see the module docs): `case.batch` requests per call.
pub(super) fn floor_worker<'a>(
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

pub(super) fn run_floor(
    bed: &Bed,
    floor: &Floor,
    case: &Case,
    seconds: f64,
    serialize: bool,
) -> f64 {
    drive(case.threads, seconds, case.batch, serialize, |_| floor_worker(bed, floor, case)).0
}

/// One thread's requests to the engine, through a lane of its own: `batch` per call.
pub(super) fn engine_worker(
    bed: &Bed,
    mix: Mix,
    batch: usize,
) -> impl FnMut(&mut SmallRng) + Send + '_ {
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

pub(super) fn run_engine(
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
pub(super) fn check_no_misses(
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
