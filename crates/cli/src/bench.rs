//! `pmcache bench …`: the experiments of the papers, each beside its baseline.

pub use pmcache_bench::{BenchArgs, run};
