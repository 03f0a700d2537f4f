//! `pmcache bench …`: the experiments of the papers, each beside its baseline.

use clap::{Args, Subcommand};
use pmcache_bench::engine_core;

/// `pmcache bench`.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    experiment: Experiment,
}

#[derive(Subcommand)]
enum Experiment {
    /// The engine against the raw medium: 4 KiB read hits, write-back writes, a 50:50 mix,
    /// 16 vs 2 threads, DRAM per slot and recovery time (emulated PM in /dev/shm).
    Core(engine_core::CoreArgs),
}

pub fn run(args: BenchArgs) -> Result<(), String> {
    match args.experiment {
        Experiment::Core(args) => engine_core::run_cli(&args),
    }
}
