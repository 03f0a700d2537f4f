//! `pmcache bench fs`: paper 003's file-system workloads, the four filebench personalities
//! (fileserver, webserver, varmail, OLTP), written from filebench's definitions and run on a
//! directory: their filesets created, their threads looping over their flowops for a set
//! time, every flowop timed; ops/s counted as filebench counts them (its I/O and AIO flowops,
//! open, close and stat included), MiB/s, per-flowop latency, JSON.
//!
//! Filebench itself is in no package registry here, and its upstream personalities hang
//! (webserver's shared log file is held by the first thread that opens it; OLTP) or fail to
//! parse in places; these run the same filesets and loops. Where they differ from filebench's
//! code, on purpose:
//! - webserver's one log file is opened by every thread and kept open (`O_APPEND`), not held
//!   by the first thread that picks it;
//! - an append draws 1 … 16 KiB (filebench's 0 … 16 KiB, whose zero-length draws write
//!   nothing);
//! - `hog` is a real busy loop of stores (a compiler may fold filebench's into one store).

pub mod fileset;
pub mod personality;
pub mod run;
pub mod sync;

use std::path::{Path, PathBuf};

use clap::Args;

pub use personality::{Personality, Sizing, Threads, Workload, workload};
pub use run::{FlowopResult, FsResult};

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::paper::Scale;

/// Options of `pmcache bench fs`.
#[derive(Args, Debug, Clone)]
pub struct FsArgs {
    /// `fileserver`, `webserver`, `varmail`, `oltp`, or `all` (comma-separated for several).
    #[arg(long, default_value = "all", value_delimiter = ',')]
    pub personality: Vec<String>,
    /// The directory the filesets are created in (on the file system under test); removed
    /// after each run.
    #[arg(long)]
    pub dir: PathBuf,
    /// The paper's file counts (and OLTP's file size) over 1024 (`smallest`), 64 (`small`) or
    /// 8 (`full`, what fits here beside a cache of the same size); mean file sizes as the
    /// paper's.
    #[arg(long, value_enum, default_value_t = Scale::Small)]
    pub scale: Scale,
    /// Thread counts, comma-separated: `paper` (50; OLTP 200 shadows, 10 DB writers and the
    /// log writer) and numbers (OLTP: shadows, beside the same writers).
    #[arg(long, value_delimiter = ',', default_value = "paper,2")]
    pub threads: Vec<String>,
    /// Seed of the file sizes, the choices of files and offsets.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The sizing of a scale.
pub fn sizing(scale: Scale) -> Sizing {
    Sizing {
        divisor: match scale {
            Scale::Smallest => 1024,
            Scale::Small => 64,
            Scale::Full => 8,
        },
    }
}

/// Seconds a run measures at a scale.
pub fn seconds(scale: Scale) -> f64 {
    match scale {
        Scale::Smallest => 2.0,
        Scale::Small => 10.0,
        Scale::Full => 60.0,
    }
}

/// The personalities named (`all` is every one).
pub fn personalities(names: &[String]) -> Result<Vec<Personality>, String> {
    let mut chosen = vec![];
    for name in names {
        if name == "all" {
            chosen.extend(Personality::ALL);
            continue;
        }
        let p = Personality::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            format!("no personality {name:?}: fileserver, webserver, varmail, oltp or all")
        })?;
        chosen.push(p);
    }
    let mut seen = vec![];
    chosen.retain(|p| {
        let first = !seen.contains(p);
        seen.push(*p);
        first
    });
    Ok(chosen)
}

/// The thread counts named.
pub fn thread_counts(names: &[String]) -> Result<Vec<Threads>, String> {
    names
        .iter()
        .map(|name| match name.as_str() {
            "paper" => Ok(Threads::Paper),
            n => match n.parse::<usize>() {
                Ok(count) if count > 0 => Ok(Threads::Count(count)),
                _ => Err(format!("--threads: {n:?} is neither `paper` nor a positive number")),
            },
        })
        .collect()
}

/// Refuses a directory that is missing or whose file system lacks room for the workload's
/// filesets (and what the run adds to them).
pub fn check_room(workload: &Workload, dir: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(dir).map_err(|e| format!("--dir {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("--dir {}: not a directory", dir.display()));
    }
    let stat = free_bytes(dir)?;
    let need = workload.preallocated_bytes() + workload.preallocated_bytes() / 4 + (64 << 20);
    if stat < need {
        return Err(format!(
            "--dir {}: {} MiB free, {} needs about {} MiB (its fileset and what the run \
             writes); a smaller --scale needs less",
            dir.display(),
            stat >> 20,
            workload.personality.name(),
            need >> 20
        ));
    }
    Ok(())
}

/// Bytes free to an unprivileged writer on the file system of `dir`.
fn free_bytes(dir: &Path) -> Result<u64, String> {
    let stat = rustix::fs::statvfs(dir).map_err(|e| format!("--dir {}: {e}", dir.display()))?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Runs one personality with one thread count in `dir` for `seconds`.
pub fn run_one(
    personality: Personality,
    scale: Scale,
    threads: Threads,
    dir: &Path,
    seconds: f64,
    seed: u64,
) -> Result<FsResult, String> {
    let w = workload(personality, sizing(scale), threads);
    check_room(&w, dir)?;
    run::run(&w, dir, seconds, seed)
}

impl Experiment for FsArgs {
    const NAME: &'static str = "fs";
    /// One run of each personality and thread count; seconds by `--scale`: 2, 10, 60
    /// (filebench's `run 60`); `--quick` is `--scale smallest`.
    const DEFAULTS: Defaults =
        Defaults { runs: None, seconds: Some(0.0), quick_runs: 1, quick_seconds: 2.0 };
    type Report = Vec<FsResult>;

    /// Runs each personality at each thread count, printing each result as filebench does
    /// unless `run.json`.
    fn run(&self, run: &Run) -> Result<Vec<FsResult>, String> {
        let chosen = personalities(&self.personality)?;
        let counts = thread_counts(&self.threads)?;
        let scale = if run.quick { Scale::Smallest } else { self.scale };
        let secs = if run.seconds > 0.0 { run.seconds } else { seconds(scale) };
        let mut results = vec![];
        for &p in &chosen {
            for &t in &counts {
                let result = run_one(p, scale, t, &self.dir, secs, self.seed)?;
                if !run.json {
                    println!("{}", text(&result));
                }
                results.push(result);
            }
        }
        Ok(results)
    }

    fn table(&self, _results: &Vec<FsResult>, _run: &Run) -> String {
        String::new()
    }
}

/// A result as filebench prints one: the summary line, then each flowop.
pub fn text(r: &FsResult) -> String {
    let mut out = format!(
        "{} — threads {}, {:.1} s on {}; fileset {} files ({} preallocated, {} MiB, created in \
         {:.1} s)\n",
        r.personality,
        r.threads,
        r.seconds,
        r.dir,
        r.files,
        r.files_preallocated,
        r.bytes_preallocated >> 20,
        r.create_seconds
    );
    out += &format!(
        "  IO Summary: {} ops, {:.1} ops/s, ({:.0}/{:.0} r/w), {:.1} MiB/s, {:.3} ms/op\n",
        r.ops, r.ops_per_s, r.reads_per_s, r.writes_per_s, r.mib_per_s, r.latency_ms_per_op
    );
    out += &format!(
        "  {:<18} {:>10} {:>9} {:>9} {:>10}\n",
        "flowop", "ops/s", "MiB/s", "ms mean", "ms p99"
    );
    for f in &r.flowops {
        let mib = (f.read_bytes + f.write_bytes) as f64 / r.seconds / (1 << 20) as f64;
        out += &format!(
            "  {:<18} {:>10.1} {:>9.1} {:>9.3} {:>10.3}{}\n",
            f.name,
            f.ops_per_s,
            mib,
            f.latency_ms_mean,
            f.latency_ms_p99,
            if f.counted { "" } else { "  (not an op)" }
        );
    }
    out
}

#[cfg(test)]
mod tests;
