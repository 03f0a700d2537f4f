//! `pmcache bench …`: the experiments of the papers, each beside its baseline.

use clap::{Args, Subcommand};
use pmcache_bench::{engine_core, engines, lookup_cost};

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
}

pub fn run(args: BenchArgs) -> Result<(), String> {
    match args.experiment {
        Experiment::Core(args) => engine_core::run_cli(&args),
        Experiment::Lookup(args) => lookup_cost::run_cli(&args),
        Experiment::Engines(args) => engines::run_cli(&args),
    }
}
