//! `pmcache bench lookup`: what one dependent lookup in a DRAM table costs a 4 KiB read on
//! this machine, by the table's size.
//!
//! A read hit of any cache whose block-to-slot map lives in DRAM (the index) loads
//! from that map before it knows where its data is, so the load's miss cannot overlap the
//! copy. This measures that cost alone, with nothing of the engine in it: one thread copies
//! 4 KiB out of a random block of a mapped medium (as `bench engine-core`'s baseline does, over 90 %
//! of the medium), and, for each table size, does the same after one load from a random
//! place of a table of that size whose value picks the block. The kinds take turns every
//! `INTERLEAVE_BLOCK_OPS` reads inside each run, in an order shuffled every round, so that
//! all of them see the same moment of the machine's load and none always follows the same
//! other; the table shows the medians over runs of each kind's time per read and of its rate
//! over the copy alone's in the same run.
//!
//! For a uniformly random block, the ratio bounds from above the per-request read-hit ratio
//! of a cache whose index is that size: its read does this load and copy, and more.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pmcache_engine::format::Geometry;
use pmcache_media::{DramTable, Medium, PmemFile};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::engine_core::INTERLEAVE_BLOCK_OPS;
use crate::harness::experiment::{Defaults, Experiment, Run, json_lines};
use crate::harness::stats::median_in_place;

const BLOCK_BYTES: u64 = 4096;

/// A 4 KiB buffer aligned like a page, as `bench engine-core`'s (the copy's speed depends on the
/// destination's alignment).
#[repr(C, align(4096))]
struct PageBuf([u8; BLOCK_BYTES as usize]);

/// Options of `pmcache bench lookup`.
#[derive(Debug, Clone, clap::Args)]
pub struct LookupArgs {
    /// Directory for the emulated PM medium (DRAM-backed: /dev/shm).
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
    /// Medium size in MiB (`bench engine-core`'s cache size by default, so the bytes per slot
    /// printed are those of its cache).
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: u64,
    /// Table sizes in KiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64, 128, 256, 512, 1024, 2048, 4096])]
    pub table_kib: Vec<u64>,
    /// An execution barrier after every read, as `bench engine-core --serialize`: the next read
    /// starts only once the last one's copy has completed.
    #[arg(long)]
    pub serialize: bool,
}

impl LookupArgs {
    /// The medium's size: `--cache-mib`, or 64 MiB with `--quick`.
    fn cache_bytes(&self, run: &Run) -> u64 {
        if run.quick { 64 << 20 } else { self.cache_mib << 20 }
    }
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

/// `x` (uniform over 32 bits) scaled to `0..n` by a multiply and a shift: no division.
#[inline]
fn scale_u32(x: u64, n: u64) -> u64 {
    ((x & 0xffff_ffff) * n) >> 32
}

impl Reader<'_> {
    #[inline]
    fn read(&mut self, rng: &mut SmallRng) {
        let draw: u64 = rng.r#gen();
        // Every kind draws a block the same way. A table kind adds the value it loads (a block
        // number too), modulo the blocks by one compare: the copy cannot start before the
        // load, and a small table's few values still reach every block.
        let drawn_block = scale_u32(draw >> 32, self.blocks);
        let block = match self.table {
            None => drawn_block,
            Some(table) => {
                let at = scale_u32(draw, table.len() as u64) as usize;
                let sum = table[at].load(Ordering::Relaxed) + drawn_block;
                if sum >= self.blocks { sum - self.blocks } else { sum }
            }
        };
        self.medium.read(block * BLOCK_BYTES, &mut self.buf.0);
        std::hint::black_box(&self.buf);
    }
}

/// Runs every kind for at least `seconds` of its own, taking turns every
/// `INTERLEAVE_BLOCK_OPS` reads in an order shuffled every round; an execution barrier follows
/// every read if `serialize`. Returns the reads each kind did (the same for all) and the time
/// each spent on them.
fn run_interleaved<K: FnMut(&mut SmallRng)>(
    kinds: &mut [K],
    seconds: f64,
    run: usize,
    serialize: bool,
) -> (u64, Vec<Duration>) {
    let mut rng = SmallRng::seed_from_u64(0x100c_0000 + run as u64);
    let mut busy = vec![Duration::ZERO; kinds.len()];
    let mut order: Vec<usize> = (0..kinds.len()).collect();
    let mut rounds = 0u64;
    while busy.iter().any(|spent| spent.as_secs_f64() < seconds) {
        order.shuffle(&mut rng);
        for &kind in &order {
            let started = Instant::now();
            for _ in 0..INTERLEAVE_BLOCK_OPS {
                kinds[kind](&mut rng);
                if serialize {
                    pmcache_media::serialize_execution();
                }
            }
            busy[kind] += started.elapsed();
        }
        rounds += 1;
    }
    (rounds * INTERLEAVE_BLOCK_OPS as u64, busy)
}

/// The rows from each run's rates (`rates[run][kind]`, kind 0 the copy alone, kind `i + 1`
/// the table of `table_kib[i]`).
fn rows(table_kib: &[u64], slots: u64, rates: &[Vec<f64>]) -> Vec<LookupResult> {
    let mut copy_alone_ns: Vec<f64> = rates.iter().map(|r| 1e9 / r[0]).collect();
    let copy_alone_ns = median_in_place(&mut copy_alone_ns);
    table_kib
        .iter()
        .enumerate()
        .map(|(i, &kib)| {
            let mut ns: Vec<f64> = rates.iter().map(|r| 1e9 / r[i + 1]).collect();
            let mut ratios: Vec<f64> = rates.iter().map(|r| r[i + 1] / r[0]).collect();
            LookupResult {
                name: format!("lookup-{kib}KiB"),
                table_bytes: kib << 10,
                table_bytes_per_slot: (kib << 10) as f64 / slots as f64,
                read_ns: median_in_place(&mut ns),
                copy_alone_ns,
                ratio_to_copy: median_in_place(&mut ratios),
                runs: rates.len(),
            }
        })
        .collect()
}

impl Experiment for LookupArgs {
    const NAME: &'static str = "lookup";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(25), seconds: Some(0.2), quick_runs: 3, quick_seconds: 0.05 };
    type Report = Vec<LookupResult>;

    /// Measures every table size; rows in the order of `--table-kib`.
    fn run(&self, run: &Run) -> Result<Vec<LookupResult>, String> {
        let cache_bytes = self.cache_bytes(run);
        let (seconds, runs) = (run.seconds, run.runs);
        if self.table_kib.is_empty() || self.table_kib.contains(&0) {
            return Err("every --table-kib must be at least 1".into());
        }
        let slots = Geometry::for_medium(cache_bytes, BLOCK_BYTES as u32)
            .map_err(|e| e.to_string())?
            .slot_count;
        let dir =
            tempfile::tempdir_in(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let medium = PmemFile::open(&dir.path().join("medium"), Some(cache_bytes))
            .map_err(|e| e.to_string())?;
        // Every page written once, so no read takes a first-touch fault; the blocks read are
        // 90 % of the medium, as `bench engine-core`'s working set.
        let fill = vec![0xa5u8; 1 << 20];
        for at in (0..cache_bytes).step_by(fill.len()) {
            medium.write(at, &fill[..fill.len().min((cache_bytes - at) as usize)]);
        }
        let blocks = cache_bytes / BLOCK_BYTES * 9 / 10;
        let mut rng = SmallRng::seed_from_u64(0x7ab1e);
        let tables = self
            .table_kib
            .iter()
            .map(|&kib| {
                let table = DramTable::<AtomicU64>::zeroed((kib << 10) as usize / 8)
                    .map_err(|e| e.to_string())?;
                table
                    .iter()
                    .for_each(|word| word.store(rng.gen_range(0..blocks), Ordering::Relaxed));
                Ok(table)
            })
            .collect::<Result<Vec<_>, String>>()?;
        let reader =
            |table| Reader { medium: &medium, table, blocks, buf: Box::new(PageBuf([0; 4096])) };
        let mut readers: Vec<Reader<'_>> = std::iter::once(reader(None))
            .chain(tables.iter().map(|table| reader(Some(table))))
            .collect();
        let mut kinds: Vec<_> =
            readers.iter_mut().map(|r| |rng: &mut SmallRng| r.read(rng)).collect();
        let rates: Vec<Vec<f64>> = (0..runs)
            .map(|turn| {
                let (reads, busy) = run_interleaved(&mut kinds, seconds, turn, self.serialize);
                busy.iter().map(|spent| reads as f64 / spent.as_secs_f64()).collect()
            })
            .collect();
        Ok(rows(&self.table_kib, slots, &rates))
    }

    /// One JSON object per table size.
    fn json(&self, rows: &Vec<LookupResult>) -> Result<String, String> {
        json_lines(rows)
    }

    fn table(&self, rows: &Vec<LookupResult>, run: &Run) -> String {
        let (args, mut out) = (self, String::new());
        let _ = writeln!(
            out,
            "pmcache bench lookup — one thread; 4 KiB copies from random blocks of a {} MiB medium \
         in {}, each after one dependent load from a DRAM table of the size given{}; medians \
         of {} runs; ratio = (with the load) / (the copy alone, {:.0} ns) in the same run\n",
            args.cache_bytes(run) >> 20,
            args.dir.display(),
            if args.serialize { ", an execution barrier after every read" } else { "" },
            rows[0].runs,
            rows[0].copy_alone_ns
        );
        let _ = writeln!(
            out,
            "{:>10} {:>14} {:>12} {:>8}",
            "table KiB", "bytes/slot", "ns/read", "ratio"
        );
        for row in rows {
            let _ = writeln!(
                out,
                "{:>10} {:>14.2} {:>12.0} {:>7.3}x",
                row.table_bytes >> 10,
                row.table_bytes_per_slot,
                row.read_ns,
                row.ratio_to_copy
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::experiment::parse;

    fn measured(extra: &[&str]) -> Result<Vec<LookupResult>, String> {
        // The medium's directory: a tmpfs (a file on a disk file system is refused).
        let mut argv = vec!["lookup", "--dir", "/dev/shm"];
        argv.extend_from_slice(extra);
        let (args, run) = parse::<LookupArgs>(&argv).expect("parses");
        args.run(&run)
    }

    #[test]
    fn every_table_size_gets_a_row_of_its_own_rates_over_the_copy_alones() {
        // Two runs: the copy alone at 100 and 200 reads/s, the 4 KiB table at 50 and 150, the
        // 64 KiB one at 25 and 50.
        let rates = vec![vec![100.0, 50.0, 25.0], vec![200.0, 150.0, 50.0]];
        let rows = rows(&[4, 64], 1024, &rates);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].name.as_str(), rows[1].table_bytes), ("lookup-4KiB", 64 << 10));
        assert_eq!(rows[1].table_bytes_per_slot, 64.0);
        assert_eq!(rows[0].copy_alone_ns, (1e7 + 5e6) / 2.0);
        assert_eq!(rows[0].ratio_to_copy, (0.5 + 0.75) / 2.0);
        assert_eq!(rows[1].ratio_to_copy, (0.25 + 0.25) / 2.0);
        assert_eq!(rows[1].read_ns, (4e7 + 2e7) / 2.0);
        assert!(rows.iter().all(|row| row.runs == 2));
    }

    #[test]
    fn a_quick_run_measures_every_table_size() {
        let rows =
            measured(&["--quick", "--serialize", "--table-kib", "4,64", "--seconds", "0.005"])
                .expect("runs");
        assert_eq!(rows.iter().map(|row| row.table_bytes).collect::<Vec<_>>(), [4 << 10, 64 << 10]);
        for row in rows {
            assert_eq!(row.runs, 3);
            assert!(row.read_ns.is_finite() && row.ratio_to_copy.is_finite(), "{row:?}");
        }
    }

    /// Each kind runs the same reads, and a kind's time is its own: a kind that spins 4 times
    /// as long per read gets about 4 times the time. The machine is shared: a run whose ratio
    /// a preemption pushed out of range is taken again, up to 5 runs (a time charged to the
    /// wrong kind would put every run out of range).
    #[test]
    fn interleaved_kinds_run_the_same_reads_each_on_its_own_clock() {
        let mut ratios = Vec::new();
        for _ in 0..5 {
            let counts = [AtomicU64::new(0), AtomicU64::new(0)];
            let mut kinds: Vec<_> = [(0, 1_000u64), (1, 4_000)]
                .into_iter()
                .map(|(kind, spin_ns)| {
                    let counts = &counts;
                    move |_: &mut SmallRng| {
                        counts[kind].fetch_add(1, Ordering::Relaxed);
                        let until = Instant::now() + Duration::from_nanos(spin_ns);
                        while Instant::now() < until {}
                    }
                })
                .collect();
            let (reads, busy) = run_interleaved(&mut kinds, 0.01, 0, true);
            let done = counts.each_ref().map(|c| c.load(Ordering::Relaxed));
            assert_eq!(done, [reads, reads]);
            assert!(busy.iter().all(|spent| spent.as_secs_f64() >= 0.01), "{busy:?}");
            let slow_over_fast = busy[1].as_secs_f64() / busy[0].as_secs_f64();
            if (2.0..6.0).contains(&slow_over_fast) {
                return;
            }
            ratios.push(slow_over_fast);
        }
        panic!("the slow kind's time over the fast one's was out of 2..6 in every run: {ratios:?}");
    }

    #[test]
    fn a_zero_sized_table_is_refused() {
        let err = measured(&["--quick", "--table-kib", "0"]).expect_err("refused");
        assert!(err.contains("--table-kib"), "{err}");
    }

    #[test]
    fn a_scaled_draw_stays_below_its_bound_and_reaches_its_top() {
        assert_eq!(scale_u32(0, 10), 0);
        assert_eq!(scale_u32(0xffff_ffff, 10), 9);
        assert_eq!(scale_u32(0x8000_0000, 10), 5);
        assert_eq!(scale_u32(u64::MAX, 7), 6, "only the low 32 bits count");
    }
}
