//! `pmcache bench lookup`: what one dependent lookup in a DRAM table costs a 4 KiB read on
//! this machine, by the table's size.
//!
//! A read hit of any cache whose block-to-slot map lives in DRAM (the index) loads
//! from that map before it knows where its data is, so the load's miss cannot overlap the
//! copy. This measures that cost alone, with nothing of the engine in it: one thread copies
//! 4 KiB out of a random block of a mapped medium (the `bench core` baseline), and, for each
//! table size, does the same after one load from a random place of a table of that size whose
//! value picks the block. The kinds take turns every `INTERLEAVE_BLOCK_OPS` operations inside
//! each run, so all of them see the same moment of the machine's load; the table shows the
//! medians over runs of each kind's time per read and of its rate over the copy alone's in the
//! same run.
//!
//! The ratio bounds the per-request read-hit ratio of `bench core` from above for an index of
//! that size: the engine's read does this load and copy, and more (the generation check).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pmcache_engine::format::Geometry;
use pmcache_media::{DramTable, Medium, PmemFile};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::engine_core::{INTERLEAVE_BLOCK_OPS, median};

const BLOCK: u64 = 4096;

/// A 4 KiB buffer aligned like a page, as `bench core`'s (the copy's speed depends on the
/// destination's alignment).
#[repr(C, align(4096))]
struct PageBuf([u8; BLOCK as usize]);

/// Options of `pmcache bench lookup`.
#[derive(Debug, Clone, clap::Args)]
pub struct LookupArgs {
    /// Directory for the emulated PM medium (DRAM-backed: /dev/shm).
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
    /// Medium size in MiB (`bench core`'s cache size by default, so the bytes per slot
    /// printed are those of its cache).
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: u64,
    /// Table sizes in KiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64, 128, 256, 512, 1024, 2048, 4096])]
    pub table_kib: Vec<u64>,
    /// Seconds each kind (the copy alone, and each table size) runs per run.
    #[arg(long, default_value_t = 0.2)]
    pub seconds: f64,
    /// Runs (medians are reported).
    #[arg(long, default_value_t = 25)]
    pub runs: usize,
    /// An execution barrier after every read, as `bench core --serialize`: the next read
    /// starts only once the last one's copy has completed.
    #[arg(long)]
    pub serialize: bool,
    /// One JSON object per table size instead of the table.
    #[arg(long)]
    pub json: bool,
    /// A smoke run: a 64 MiB medium, 3 runs of at most 0.05 s.
    #[arg(long)]
    pub quick: bool,
}

/// One row: a table size.
#[derive(Debug, Clone, Serialize)]
pub struct LookupResult {
    /// `lookup-<KiB>KiB`.
    pub name: String,
    /// The table's size.
    pub table_bytes: u64,
    /// The table's bytes over the slots of a cache on a medium of `--cache-mib`.
    pub table_bytes_per_slot: f64,
    /// Median over runs of the time per read (load, then copy).
    pub read_ns: f64,
    /// Median over runs of the copy alone's time per read, in the same runs.
    pub copy_alone_ns: f64,
    /// Median over runs of (rate with the load) / (rate of the copy alone) in the same run.
    pub ratio_to_copy: f64,
    /// Runs the medians are over.
    pub runs: usize,
}

/// One kind's worker: the copy alone (`table` None) or the load, then the copy.
struct Reader<'a> {
    medium: &'a PmemFile,
    table: Option<&'a DramTable<AtomicU64>>,
    blocks: u64,
    buf: Box<PageBuf>,
}

impl Reader<'_> {
    #[inline]
    fn read(&mut self, rng: &mut SmallRng) {
        let fresh: u64 = rng.r#gen();
        let block = match self.table {
            None => fresh % self.blocks,
            // The block depends on the loaded value: the copy cannot start before the load.
            Some(table) => {
                let value = table[(fresh % table.len() as u64) as usize].load(Ordering::Relaxed);
                value.wrapping_add(fresh >> 24) % self.blocks
            }
        };
        self.medium.read(block * BLOCK, &mut self.buf.0);
        std::hint::black_box(&self.buf);
    }
}

/// Runs every kind for at least `seconds` of its own, taking turns every
/// `INTERLEAVE_BLOCK_OPS` reads (the first kind of a round rotates); returns the reads each
/// kind did (the same for all) and the time each spent on them.
fn run_interleaved(
    readers: &mut [Reader<'_>],
    seconds: f64,
    run: usize,
    serialize: bool,
) -> (u64, Vec<Duration>) {
    let mut rng = SmallRng::seed_from_u64(0x100c_0000 + run as u64);
    let mut busy = vec![Duration::ZERO; readers.len()];
    let mut turns = 0usize;
    while busy.iter().any(|spent| spent.as_secs_f64() < seconds) {
        for step in 0..readers.len() {
            let kind = (step + turns) % readers.len();
            let started = Instant::now();
            for _ in 0..INTERLEAVE_BLOCK_OPS {
                readers[kind].read(&mut rng);
                if serialize {
                    pmcache_media::serialize_execution();
                }
            }
            busy[kind] += started.elapsed();
        }
        turns += 1;
    }
    ((turns * INTERLEAVE_BLOCK_OPS) as u64, busy)
}

/// Measures every table size; rows in the order of `--table-kib`.
pub fn run(args: &LookupArgs) -> Result<Vec<LookupResult>, String> {
    let (cache_bytes, seconds, runs) = if args.quick {
        (64 << 20, args.seconds.min(0.05), args.runs.min(3))
    } else {
        (args.cache_mib << 20, args.seconds, args.runs)
    };
    if runs == 0 || args.table_kib.is_empty() || args.table_kib.contains(&0) {
        return Err("--runs and every --table-kib must be at least 1".into());
    }
    let slots =
        Geometry::for_medium(cache_bytes, BLOCK as u32).map_err(|e| e.to_string())?.slot_count;
    let dir =
        tempfile::tempdir_in(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    let medium =
        PmemFile::open(&dir.path().join("medium"), Some(cache_bytes)).map_err(|e| e.to_string())?;
    // Every page written once, so no read takes a first-touch fault; the blocks read are
    // 90 % of the medium, as `bench core`'s working set.
    let fill = vec![0xa5u8; 1 << 20];
    for at in (0..cache_bytes).step_by(fill.len()) {
        medium.write(at, &fill[..fill.len().min((cache_bytes - at) as usize)]);
    }
    let blocks = cache_bytes / BLOCK * 9 / 10;
    let mut rng = SmallRng::seed_from_u64(0x7ab1e);
    let tables = args
        .table_kib
        .iter()
        .map(|&kib| {
            let table = DramTable::<AtomicU64>::zeroed((kib << 10) as usize / 8)
                .map_err(|e| e.to_string())?;
            table.iter().for_each(|word| word.store(rng.gen_range(0..blocks), Ordering::Relaxed));
            Ok(table)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let reader =
        |table| Reader { medium: &medium, table, blocks, buf: Box::new(PageBuf([0; 4096])) };
    let mut readers: Vec<Reader<'_>> = std::iter::once(reader(None))
        .chain(tables.iter().map(|table| reader(Some(table))))
        .collect();
    // rates[run][kind], kind 0 the copy alone.
    let rates: Vec<Vec<f64>> = (0..runs)
        .map(|run| {
            let (reads, busy) = run_interleaved(&mut readers, seconds, run, args.serialize);
            busy.iter().map(|spent| reads as f64 / spent.as_secs_f64()).collect()
        })
        .collect();
    let mut copy_alone_ns: Vec<f64> = rates.iter().map(|r| 1e9 / r[0]).collect();
    let copy_alone_ns = median(&mut copy_alone_ns);
    Ok(args
        .table_kib
        .iter()
        .enumerate()
        .map(|(i, &kib)| {
            let mut ns: Vec<f64> = rates.iter().map(|r| 1e9 / r[i + 1]).collect();
            let mut ratios: Vec<f64> = rates.iter().map(|r| r[i + 1] / r[0]).collect();
            LookupResult {
                name: format!("lookup-{kib}KiB"),
                table_bytes: kib << 10,
                table_bytes_per_slot: (kib << 10) as f64 / slots as f64,
                read_ns: median(&mut ns),
                copy_alone_ns,
                ratio_to_copy: median(&mut ratios),
                runs,
            }
        })
        .collect())
}

/// `pmcache bench lookup`: prints the table (or JSON lines).
pub fn run_cli(args: &LookupArgs) -> Result<(), String> {
    let rows = run(args)?;
    if args.json {
        for row in &rows {
            println!("{}", serde_json::to_string(row).map_err(|e| e.to_string())?);
        }
        return Ok(());
    }
    println!(
        "pmcache bench lookup — one thread; 4 KiB copies from random blocks of a {} MiB medium \
         in {}, each after one dependent load from a DRAM table of the size given{}; medians \
         of {} runs; ratio = (with the load) / (the copy alone, {:.0} ns) in the same run\n",
        if args.quick { 64 } else { args.cache_mib },
        args.dir.display(),
        if args.serialize { ", an execution barrier after every read" } else { "" },
        rows[0].runs,
        rows[0].copy_alone_ns
    );
    println!("{:>10} {:>14} {:>12} {:>8}", "table KiB", "bytes/slot", "ns/read", "ratio");
    for row in &rows {
        println!(
            "{:>10} {:>14.2} {:>12.0} {:>7.3}x",
            row.table_bytes >> 10,
            row.table_bytes_per_slot,
            row.read_ns,
            row.ratio_to_copy
        );
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
        lookup: LookupArgs,
    }

    fn args(extra: &[&str]) -> LookupArgs {
        let dir = std::env::temp_dir();
        let mut argv = vec!["lookup", "--dir", dir.to_str().expect("utf-8")];
        argv.extend_from_slice(extra);
        Command::parse_from(argv).lookup
    }

    #[test]
    fn every_table_size_gets_a_row_with_its_own_size_and_the_same_copy_alone() {
        let args = args(&["--quick", "--table-kib", "4,64", "--seconds", "0.005"]);
        let rows = run(&args).expect("runs");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].name, "lookup-4KiB");
        assert_eq!(rows[1].table_bytes, 64 << 10);
        let slots = Geometry::for_medium(64 << 20, 4096).expect("geometry").slot_count;
        assert_eq!(rows[1].table_bytes_per_slot, (64 << 10) as f64 / slots as f64);
        assert_eq!(rows[0].copy_alone_ns, rows[1].copy_alone_ns);
        for row in &rows {
            assert_eq!(row.runs, 3);
            assert!(row.read_ns > 0.0 && row.ratio_to_copy > 0.0, "{row:?}");
        }
    }

    #[test]
    fn interleaved_kinds_each_run_at_least_their_time_in_whole_turns() {
        let dir = tempfile::tempdir().expect("dir");
        let medium = PmemFile::open(&dir.path().join("m"), Some(1 << 20)).expect("medium");
        let table = DramTable::<AtomicU64>::zeroed(512).expect("table");
        let new = |table| Reader {
            medium: &medium,
            table,
            blocks: 200,
            buf: Box::new(PageBuf([0; 4096])),
        };
        let mut readers = vec![new(None), new(Some(&table)), new(Some(&table))];
        let (reads, busy) = run_interleaved(&mut readers, 0.01, 0, true);
        assert_eq!(busy.len(), 3);
        assert!(reads > 0 && reads % INTERLEAVE_BLOCK_OPS as u64 == 0, "{reads}");
        assert!(busy.iter().all(|spent| spent.as_secs_f64() >= 0.01), "{busy:?}");
    }

    #[test]
    fn a_zero_sized_table_is_refused() {
        let err = run(&args(&["--quick", "--table-kib", "0"])).expect_err("refused");
        assert!(err.contains("--table-kib"), "{err}");
    }
}
