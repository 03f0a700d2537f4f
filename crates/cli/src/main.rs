//! The `pmcache` command: serve a cache over NBD, manage caches, run the experiments.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod cache;
mod control;
mod manage;
mod serve;
mod state;

/// pmcache: a block cache on persistent memory, served over NBD.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a cache over NBD (with no options: a 1 GiB cache in /dev/shm in front of a sparse
    /// 8 GiB file under ./pmcache-data, on 127.0.0.1:10809). On a volatile medium (tmpfs,
    /// ramfs) a stop writes every dirty block back first, and the attachment is recorded
    /// beside the backing file.
    Serve(Box<serve::ServeArgs>),
    /// Format a cache medium for a backing store.
    Format(manage::FormatArgs),
    /// Verify a cache medium's superblock and metadata (non-zero exit on corruption).
    Check(manage::CheckArgs),
    /// Statistics of a running server (table, --json or --prometheus).
    Stats(manage::StatsArgs),
    /// Show or change the background cleaner's settings on a running server.
    Set(manage::SetArgs),
    /// Write back every dirty block of a running server.
    Flush(manage::ControlArgs),
    /// Write back everything and mark the cache clean, so the backing store can be used alone.
    Detach(manage::DetachArgs),
    /// Run an experiment and print its figures beside their baselines.
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_target(false).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Format(args) => manage::format(args),
        Command::Check(args) => manage::check(args),
        Command::Stats(args) => manage::stats(args),
        Command::Set(args) => manage::set(args),
        Command::Flush(args) => manage::flush(args),
        Command::Detach(args) => manage::detach(args),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pmcache: {message}");
            ExitCode::FAILURE
        }
    }
}
