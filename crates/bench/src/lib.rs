//! pmcache's experiment harness: each `pmcache bench NAME` experiment lives in module `NAME`
//! (`-` as `_`), implements [`harness::experiment::Experiment`], and prints figures beside the
//! baseline it is measured against, in the same run.

pub mod db;
pub mod engine_core;
pub mod engines;
pub mod fs;
pub mod harness;
pub mod lookup;
pub mod media_kinds;
pub mod memory;
pub mod mixed;
pub mod nbd;
pub mod paper;
pub mod tls;
pub mod ublk_mapping;
pub mod writeback;

use clap::{Args, Subcommand};

use harness::experiment::Cli;

/// `pmcache bench`.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    experiment: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// The engine against the raw medium: 4 KiB read hits, write-back writes, a 50:50 mix,
    /// 16 vs 2 threads, DRAM per slot and recovery time (emulated PM in /dev/shm). Beside each
    /// ratio, the floor: raw + the least any design with the engine's contract must add (reads:
    /// one dependent load from a DRAM table of the engine's metadata size; writes: a 16-byte
    /// entry persisted after the data), at the raw baseline's random places on the medium. The
    /// engine chooses where a write goes (in address order, like a log), so its writes can pass
    /// the floor.
    #[command(alias = "core")]
    EngineCore(Cli<engine_core::CoreArgs>),
    /// What one dependent load from a DRAM table costs a 4 KiB read from the medium, by the
    /// table's size: for uniformly random blocks, a bound from above on what a cache whose
    /// block-to-slot map in DRAM has that size can reach, one read at a time, in
    /// `engine-core`'s read-hit rows.
    Lookup(Cli<lookup::LookupArgs>),
    /// Backing-store I/O engines against fio with the same engine and settings (paper 004).
    Engines(Box<Cli<engines::EnginesArgs>>),
    /// Sustained 4 KiB random writes into a write-back cache smaller than the span, backing
    /// file on a disk: the background cleaner vs writers writing back inline vs fio on the
    /// backing file itself (same engine, same total queue depth); per-second timelines, steady
    /// IOPS, latency percentiles, dirty share; and the cleaner's drain of a full cache against
    /// fio writing the same blocks.
    Writeback(Box<Cli<writeback::WritebackArgs>>),
    /// pmcache served over NBD (the real server, fio's nbd engine) beside `nbdkit file` on the
    /// same backing file and fio on the raw backing file: 4 KiB random writes and reads, QD16,
    /// IOPS, latency percentiles, IOPS once the cache is full, the server's statistics.
    Nbd(Box<Cli<nbd::NbdArgs>>),
    /// Cache hits beside misses on the same connections, in front of a slow backing store
    /// (`--backing-latency`): fio's 4 KiB random reads over NBD, hit ratios 100/95/90/50 %,
    /// QD 1 and 16, one and four connections; hit and miss latencies apart (client per
    /// request, and the server's own histograms), IOPS against what the hits and the store's
    /// concurrency allow, beside the store alone, same run.
    Mixed(Box<Cli<mixed::MixedArgs>>),
    /// What TLS costs an NBD client of `pmcache serve`: 4 KiB random reads (cache hits), fio's
    /// nbd engine in clear and over TLS (X.509) against the same server, alternating runs;
    /// median IOPS, latency and the IOPS ratio.
    Tls(Box<Cli<tls::TlsArgs>>),
    /// Paper 002's experiment with its own tables and plot (`bench paper 002-fig2` draws it
    /// on the paper's axes).
    #[command(hide = true)]
    Paper002(Box<Cli<paper::p002::Paper002Args>>),
    /// The papers' experiments with pmcache on their axes: `bench paper <id>` (`list` names
    /// them, `all` runs every one, `host` those that boot no guest) prints each figure's table
    /// and writes its JSON, SVG and PNG to `--out`; `bench paper report` writes the Markdown
    /// report there from the JSON.
    Paper(Box<Cli<paper::PaperArgs>>),
    /// Paper 003's file-system workloads: the four filebench personalities (fileserver,
    /// webserver, varmail, OLTP), written from filebench's definitions with the paper's
    /// counts, sizes and threads (scaled), run in `--dir` for a set time; filebench's summary
    /// (ops/s counting every I/O flowop, r/w, MiB/s, ms/op) and each flowop's rate and
    /// latency, JSON with `--json`.
    Fs(Box<Cli<fs::FsArgs>>),
    /// What `--medium-sync msync` costs: 4 KiB write-back writes per second through the
    /// engine with the medium on a disk file system in msync mode (every persist msyncs its
    /// pages) beside the same with the medium in /dev/shm (volatile), in the same run, taking
    /// turns; medians of several runs and their ratio.
    MediaKinds(Cli<media_kinds::MediaKindsArgs>),
    /// The resident memory of `pmcache serve` (its own, apart from the cache medium it maps)
    /// with no connection, 16 idle connections, and 16 busy ones (fio, 4 KiB and 1 MiB random
    /// reads and writes): what the per-connection buffers and bounds hold in practice.
    Memory(Cli<memory::MemoryArgs>),
    /// What the ublk frontend's request path costs, without a kernel: a ublk descriptor
    /// decoded, validated and dispatched into the engine (one request per dispatch, and 16:
    /// the engine's batch calls) beside the engine call alone, 4 KiB read hits and write-back
    /// writes, same run; ns per request, medians of runs.
    UblkMapping(Cli<ublk_mapping::UblkMappingArgs>),
    /// Databases on ext4 over pmcache: pgbench's TPC-B-like workload (the database 2–4× the
    /// cache) and SQLite's speedtest1, beside ext4 on the raw backing file on this host
    /// (nbdfuse and loop devices, direct I/O), or with `--guest` beside bcache, dm-cache,
    /// dm-writecache and the bare NVMe namespace in one QEMU boot; TPS, latency p50/p99 and
    /// the ratios run by run, the page cache bounded by a memory cgroup.
    Db(Box<Cli<db::DbArgs>>),
}

/// Runs the experiment `args` names.
pub fn run(args: BenchArgs) -> Result<(), String> {
    match args.experiment {
        Bench::EngineCore(cli) => cli.main(),
        Bench::Lookup(cli) => cli.main(),
        Bench::Engines(cli) => cli.main(),
        Bench::Writeback(cli) => cli.main(),
        Bench::Nbd(cli) => cli.main(),
        Bench::Mixed(cli) => cli.main(),
        Bench::Tls(cli) => cli.main(),
        Bench::Paper002(cli) => cli.main(),
        Bench::Paper(cli) => cli.main(),
        Bench::Fs(cli) => cli.main(),
        Bench::MediaKinds(cli) => cli.main(),
        Bench::Memory(cli) => cli.main(),
        Bench::UblkMapping(cli) => cli.main(),
        Bench::Db(cli) => cli.main(),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::harness::experiment::Experiment;

    #[derive(Parser)]
    struct Bench {
        #[command(flatten)]
        args: BenchArgs,
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Bench::command().debug_assert();
    }

    /// Each subcommand is named as its experiment names itself.
    #[test]
    fn every_subcommand_is_its_experiments_name() {
        let names = [
            engine_core::CoreArgs::NAME,
            lookup::LookupArgs::NAME,
            engines::EnginesArgs::NAME,
            writeback::WritebackArgs::NAME,
            nbd::NbdArgs::NAME,
            mixed::MixedArgs::NAME,
            tls::TlsArgs::NAME,
            paper::p002::Paper002Args::NAME,
            paper::PaperArgs::NAME,
            fs::FsArgs::NAME,
            media_kinds::MediaKindsArgs::NAME,
            memory::MemoryArgs::NAME,
            ublk_mapping::UblkMappingArgs::NAME,
            db::DbArgs::NAME,
        ];
        let command = Bench::command();
        let subcommands: Vec<&str> = command.get_subcommands().map(|s| s.get_name()).collect();
        assert_eq!(subcommands, names);
    }

    /// `pmcache bench X` lives in module `X` (`-` as `_`); hidden subcommands are aliases.
    #[test]
    fn every_subcommand_is_its_module() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        for sub in Bench::command().get_subcommands().filter(|s| !s.is_hide_set()) {
            let module = sub.get_name().replace('-', "_");
            let found = [format!("{module}.rs"), format!("{module}/mod.rs")]
                .iter()
                .any(|f| src.join(f).exists());
            assert!(found, "bench {} has no module {module}", sub.get_name());
        }
    }
}
