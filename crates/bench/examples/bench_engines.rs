//! `pmcache bench engines` until the CLI wires it: `cargo run --release -p pmcache-bench
//! --example bench_engines -- --quick`.

use clap::Parser;
use pmcache_bench::engines::{EnginesArgs, run_cli};

/// Backing-store engines vs fio (paper 004).
#[derive(Parser, Debug)]
#[command(name = "bench_engines")]
struct Cli {
    #[command(flatten)]
    args: EnginesArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run_cli(&cli.args) {
        eprintln!("bench engines: {e}");
        std::process::exit(1);
    }
}
