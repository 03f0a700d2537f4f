//! `pmcache bench …`: the experiments of the papers, each beside its baseline.

use clap::{Args, Subcommand};
use pmcache_bench::{
    engine_core, engines, fs, lookup_cost, media_kinds, mixed, nbd_fio, nbd_tls, paper, paper002,
    serve_memory, ublk_mapping, writeback,
};

/// `pmcache bench`.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    experiment: Experiment,
}

#[derive(Subcommand)]
enum Experiment {
    /// The engine against the raw medium: 4 KiB read hits, write-back writes, a 50:50 mix,
    /// 16 vs 2 threads, DRAM per slot and recovery time (emulated PM in /dev/shm). Beside each
    /// ratio, the floor: raw + the least any design with the engine's contract must add (reads:
    /// one dependent load from a DRAM table of the engine's metadata size; writes: a 16-byte
    /// entry persisted after the data), at the raw baseline's random places on the medium. The
    /// engine chooses where a write goes (in address order, like a log), so its writes can pass
    /// the floor.
    Core(engine_core::CoreArgs),
    /// What one dependent load from a DRAM table costs a 4 KiB read from the medium, by the
    /// table's size: for uniformly random blocks, a bound from above on what a cache whose
    /// block-to-slot map in DRAM has that size can reach, one read at a time, in `core`'s
    /// read-hit rows.
    Lookup(lookup_cost::LookupArgs),
    /// Backing-store I/O engines against fio with the same engine and settings (paper 004).
    Engines(Box<engines::EnginesArgs>),
    /// Sustained 4 KiB random writes into a write-back cache smaller than the span, backing
    /// file on a disk: the background cleaner vs writers writing back inline vs fio on the
    /// backing file itself (same engine, same total queue depth); per-second timelines, steady
    /// IOPS, latency percentiles, dirty share; and the cleaner's drain of a full cache against
    /// fio writing the same blocks.
    Writeback(Box<writeback::WritebackArgs>),
    /// pmcache served over NBD (the real server, fio's nbd engine) beside `nbdkit file` on the
    /// same backing file and fio on the raw backing file: 4 KiB random writes and reads, QD16,
    /// IOPS, latency percentiles, IOPS once the cache is full, the server's statistics.
    Nbd(Box<nbd_fio::NbdArgs>),
    /// Cache hits beside misses on the same connections, in front of a slow backing store
    /// (`--backing-latency`): fio's 4 KiB random reads over NBD, hit ratios 100/95/90/50 %,
    /// QD 1 and 16, one and four connections; hit and miss latencies apart (client per
    /// request, and the server's own histograms), IOPS against what the hits and the store's
    /// concurrency allow, beside the store alone, same run.
    Mixed(Box<mixed::MixedArgs>),
    /// What TLS costs an NBD client of `pmcache serve`: 4 KiB random reads (cache hits), fio's
    /// nbd engine in clear and over TLS (X.509) against the same server, alternating runs;
    /// median IOPS, latency and the IOPS ratio.
    Tls(Box<nbd_tls::TlsArgs>),
    /// Paper 002's experiment with pmcache in pblk's place: 4 MiB random writes over NBD into
    /// a cache smaller than the span, the server confined to 1 or 2 CPUs, 1 or more writers,
    /// adaptive boosting of the cleaner off vs on: bandwidth, stalls per write, context
    /// switches, boosts; Table 1: the same beside a CPU-bound π job on the server's CPU.
    Paper002(Box<paper002::Paper002Args>),
    /// The papers' experiments with pmcache on their axes: `bench paper <id>` (`list` names
    /// them, `all` runs every one, `host` those that boot no guest) prints each figure's table and writes its JSON, SVG and PNG
    /// to `--out`; `bench paper report` writes the Markdown report there from the JSON.
    Paper(Box<paper::PaperArgs>),
    /// Paper 003's file-system workloads: the four filebench personalities (fileserver,
    /// webserver, varmail, OLTP), written from filebench's definitions with the paper's
    /// counts, sizes and threads (scaled), run in `--dir` for a set time; filebench's summary
    /// (ops/s counting every I/O flowop, r/w, MiB/s, ms/op) and each flowop's rate and
    /// latency, JSON with `--json`.
    Fs(Box<fs::FsArgs>),
    /// What `--medium-sync msync` costs: 4 KiB write-back writes per second through the
    /// engine with the medium on a disk file system in msync mode (every persist msyncs its
    /// pages) beside the same with the medium in /dev/shm (volatile), in the same run, taking
    /// turns; medians of several runs and their ratio.
    MediaKinds(media_kinds::MediaKindsArgs),
    /// The resident memory of `pmcache serve` (its own, apart from the cache medium it maps)
    /// with no connection, 16 idle connections, and 16 busy ones (fio, 4 KiB and 1 MiB random
    /// reads and writes): what the per-connection buffers and bounds hold in practice.
    Memory(serve_memory::MemoryArgs),
    /// What the ublk frontend's request path costs, without a kernel: a ublk descriptor
    /// decoded, validated and dispatched into the engine (one request per dispatch, and 16:
    /// the engine's batch calls) beside the engine call alone, 4 KiB read hits and write-back
    /// writes, same run; ns per request, medians of runs.
    UblkMapping(ublk_mapping::UblkMappingArgs),
}

pub fn run(args: BenchArgs) -> Result<(), String> {
    match args.experiment {
        Experiment::Core(args) => engine_core::run_cli(&args),
        Experiment::Lookup(args) => lookup_cost::run_cli(&args),
        Experiment::Engines(args) => engines::run_cli(&args),
        Experiment::Writeback(args) => writeback::run_cli(&args),
        Experiment::Nbd(args) => nbd_fio::run_cli(&args),
        Experiment::Mixed(args) => mixed::run_cli(&args),
        Experiment::Tls(args) => nbd_tls::run_cli(&args),
        Experiment::Paper002(args) => paper002::run_cli(&args),
        Experiment::Paper(args) => paper::run_cli(&args),
        Experiment::Fs(args) => fs::run_cli(&args),
        Experiment::MediaKinds(args) => media_kinds::run_cli(&args),
        Experiment::Memory(args) => serve_memory::run_cli(&args),
        Experiment::UblkMapping(args) => ublk_mapping::run_cli(&args),
    }
}
