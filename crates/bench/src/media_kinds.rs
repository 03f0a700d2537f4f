//! `pmcache bench media-kinds`: what msync mode costs. 4 KiB write-back writes through the
//! engine (one lane, random blocks over half the cache, so every write lands in the cache and
//! none evicts), with the medium on a disk file system in msync mode (every persist
//! `msync(MS_SYNC)`s its pages) beside the same with the medium on tmpfs (`/dev/shm`,
//! volatile), in the same run: the two take turns, `--seconds` each per run, in an order that
//! alternates from run to run, and the table shows the medians over runs of each one's writes
//! per second and of their ratio in the same run.
//!
//! Each medium file is written whole (and, on the disk, synced) before it is opened, so no
//! write pays for allocating its blocks: the figures are those of a cache in use, not of a new
//! one.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pmcache_backing::PsyncFile;

use pmcache_media::{FileSystem, MediumKind, MediumOptions, MediumSync, MsyncCounts, PmemFile};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::machine;
use crate::harness::stats::median_in_place;

use crate::harness;
use crate::harness::bed::BLOCK_BYTES;

/// Options of `pmcache bench media-kinds`.
#[derive(Debug, Clone, clap::Args)]
pub struct MediaKindsArgs {
    /// Directory for the volatile medium (tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Directory for the msync-mode medium and both backing files: on a disk file system
    /// (ext4, xfs, ...), not tmpfs and not DAX.
    #[arg(long, default_value = "/var/tmp")]
    pub disk_dir: PathBuf,
    /// Size of each cache medium in MiB.
    #[arg(long, default_value_t = 64)]
    pub cache_mib: u64,
}

/// One medium's figures.
#[derive(Debug, Clone, Serialize)]
pub struct MediumResult {
    /// `volatile` or `msync`.
    pub kind: String,
    /// The directory it was in and its file system.
    pub dir: String,
    /// The file system's name.
    pub file_system: String,
    /// Median over runs of 4 KiB writes acknowledged per second.
    pub writes_per_s: f64,
    /// `msync` calls per write over the timed runs (0 for the volatile medium).
    pub msync_calls_per_write: f64,
    /// Bytes those calls covered per write.
    pub synced_bytes_per_write: f64,
}

/// The experiment's result.
#[derive(Debug, Clone, Serialize)]
pub struct MediaKindsResult {
    /// The medium in DRAM.
    pub volatile: MediumResult,
    /// The medium on a disk in msync mode.
    pub msync: MediumResult,
    /// Median over runs of (msync writes/s) / (volatile writes/s) in the same run.
    pub msync_to_volatile: f64,
    /// Runs the medians are over.
    pub runs: usize,
    /// Seconds per medium per run.
    pub seconds: f64,
    /// Each medium's size.
    pub cache_bytes: u64,
    /// The machine.
    pub cpu: String,
}

/// A cache on one medium, with the writer's state.
struct Bed {
    pub(super) bed: harness::bed::Bed<PmemFile, PsyncFile>,
    pub(super) dir: PathBuf,
    file_system: String,
    pub(super) blocks: u64,
    rng: SmallRng,
    data: Vec<u8>,
}

impl Bed {
    /// A cache of `cache_bytes` on a medium in `dir` opened with `sync`, which must come out
    /// as `expected`.
    fn new(
        dir: &Path,
        cache_bytes: u64,
        sync: MediumSync,
        expected: MediumKind,
    ) -> Result<Bed, String> {
        let dirs = harness::bed::BedDirs::new(dir, dir)?;
        let path = dirs.medium_path();
        write_whole(&path, cache_bytes)?;
        let options = MediumOptions { create_len_bytes: None, sync };
        let medium = PmemFile::open_with(&path, &options).map_err(|e| e.to_string())?;
        if medium.kind() != expected {
            return Err(format!(
                "{}: the medium there is {}, not {expected}: give a directory on {}",
                dir.display(),
                medium.kind(),
                if expected == MediumKind::Msync { "a disk file system" } else { "tmpfs" }
            ));
        }
        let file_system = FileSystem::of_path(&path).map_err(|e| e.to_string())?.name;
        // Half the cache: every write lands in it, none evicts.
        let blocks = (harness::bed::slot_count(cache_bytes, false)? / 2).max(1);
        // The backing file beside the medium: write-back writes into a cache with room never
        // reach it.
        let backing = PsyncFile::open(&dirs.backing_file(blocks * BLOCK_BYTES)?)
            .map_err(|e| e.to_string())?;
        let bed = harness::bed::Bed::format(dirs, medium, backing, &harness::bed::config(2))?;
        Ok(Bed {
            bed,
            dir: dir.to_path_buf(),
            file_system,
            blocks,
            rng: SmallRng::seed_from_u64(0x6d73_796e),
            data: vec![0x5a; BLOCK_BYTES as usize],
        })
    }

    /// Writes random blocks for `time`: the writes made and the seconds they took.
    fn run(&mut self, time: Duration) -> Result<(u64, f64), String> {
        let mut lane = self.bed.engine.lane().map_err(|e| e.to_string())?;
        let started = Instant::now();
        let mut writes = 0u64;
        while started.elapsed() < time {
            for _ in 0..8 {
                let block = self.rng.gen_range(0..self.blocks);
                self.data[..8].copy_from_slice(&writes.to_le_bytes());
                lane.write(block * BLOCK_BYTES, &self.data, false).map_err(|e| e.to_string())?;
                writes += 1;
            }
        }
        Ok((writes, started.elapsed().as_secs_f64()))
    }

    fn msync_counts(&self) -> MsyncCounts {
        self.bed.engine.medium().msync_counts()
    }
}

/// Creates `path` holding `len_bytes` zeroes, written and synced: every block allocated.
fn write_whole(path: &Path, len_bytes: u64) -> Result<(), String> {
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut file = std::fs::File::create(path).map_err(err)?;
    let chunk = vec![0u8; 1 << 20];
    let mut left = len_bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n]).map_err(err)?;
        left -= n as u64;
    }
    file.sync_all().map_err(err)
}

fn cpu_text() -> String {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    format!("{cores} cores ({})", machine::cpu_model())
}

impl Experiment for MediaKindsArgs {
    const NAME: &'static str = "media-kinds";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(5), seconds: Some(2.0), quick_runs: 3, quick_seconds: 0.2 };
    type Report = MediaKindsResult;

    /// Runs the experiment.
    fn run(&self, run: &Run) -> Result<MediaKindsResult, String> {
        let cache_bytes = if run.quick { 16 << 20 } else { self.cache_mib << 20 };
        let time = Duration::from_secs_f64(run.seconds);
        let mut volatile =
            Bed::new(&self.shm_dir, cache_bytes, MediumSync::Auto, MediumKind::Volatile)?;
        let mut msync =
            Bed::new(&self.disk_dir, cache_bytes, MediumSync::Msync, MediumKind::Msync)?;
        // Warm-up, untimed: the DRAM tables touched, the first overwrites made.
        volatile.run(time / 4)?;
        msync.run(time / 4)?;
        let synced_before = msync.msync_counts();
        let (mut volatile_rates, mut msync_rates, mut ratios) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut msync_writes = 0u64;
        for turn in 0..run.runs {
            let (v, m) = if turn % 2 == 0 {
                let v = volatile.run(time)?;
                (v, msync.run(time)?)
            } else {
                let m = msync.run(time)?;
                (volatile.run(time)?, m)
            };
            msync_writes += m.0;
            let (v, m) = (v.0 as f64 / v.1, m.0 as f64 / m.1);
            volatile_rates.push(v);
            msync_rates.push(m);
            ratios.push(m / v);
        }
        let synced = msync.msync_counts();
        let per_write = |n: u64| n as f64 / msync_writes.max(1) as f64;
        let result =
            |bed: &Bed, kind: MediumKind, rates: &mut [f64], counts: (f64, f64)| MediumResult {
                kind: kind.name().to_string(),
                dir: bed.dir.display().to_string(),
                file_system: bed.file_system.clone(),
                writes_per_s: median_in_place(rates),
                msync_calls_per_write: counts.0,
                synced_bytes_per_write: counts.1,
            };
        // The volatile medium never msyncs: its counts are zero, whatever the writes.
        let volatile_counts = volatile.msync_counts();
        let volatile_per_write =
            (volatile_counts.calls as f64, volatile_counts.synced_bytes as f64);
        Ok(MediaKindsResult {
            volatile: result(
                &volatile,
                MediumKind::Volatile,
                &mut volatile_rates,
                volatile_per_write,
            ),
            msync: result(
                &msync,
                MediumKind::Msync,
                &mut msync_rates,
                (
                    per_write(synced.calls - synced_before.calls),
                    per_write(synced.synced_bytes - synced_before.synced_bytes),
                ),
            ),
            msync_to_volatile: median_in_place(&mut ratios),
            runs: run.runs,
            seconds: time.as_secs_f64(),
            cache_bytes,
            cpu: cpu_text(),
        })
    }

    fn table(&self, r: &MediaKindsResult, _run: &Run) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "pmcache bench media-kinds: 4 KiB write-back writes, one lane, random blocks over half \
         of a {} MiB cache; {} runs of {:.1} s per medium, taking turns (medians)",
            r.cache_bytes >> 20,
            r.runs,
            r.seconds
        );
        let _ = writeln!(out, "  machine: {}", r.cpu);
        let _ = writeln!(
            out,
            "  {:<9} {:<26} {:>12} {:>16} {:>16}",
            "medium", "where", "writes/s", "msync/write", "synced KiB/write"
        );
        for m in [&r.volatile, &r.msync] {
            let _ = writeln!(
                out,
                "  {:<9} {:<26} {:>12.0} {:>16.2} {:>16.2}",
                m.kind,
                format!("{} ({})", m.dir, m.file_system),
                m.writes_per_s,
                m.msync_calls_per_write,
                m.synced_bytes_per_write / 1024.0
            );
        }
        let slower =
            if r.msync_to_volatile > 0.0 { 1.0 / r.msync_to_volatile } else { f64::INFINITY };
        let _ = writeln!(
            out,
            "  msync / volatile: {:.6} of the writes per second ({slower:.0}x slower), median of \
         the per-run ratios",
            r.msync_to_volatile
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::experiment::parse;

    /// A quick run gives both figures; every msync-mode write synced its data page and its
    /// entry's page (two msyncs, two pages at least), the volatile medium none.
    #[test]
    fn a_quick_run_measures_both_media() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let disk = exe.parent().expect("its directory").to_str().expect("utf-8");
        let (args, run) = parse::<MediaKindsArgs>(&["media-kinds", "--quick", "--disk-dir", disk])
            .expect("parses");
        let r = args.run(&run).expect("runs");
        assert_eq!((r.volatile.kind.as_str(), r.msync.kind.as_str()), ("volatile", "msync"));
        assert!(r.volatile.writes_per_s > 0.0 && r.msync.writes_per_s > 0.0, "{r:?}");
        assert!(r.msync.msync_calls_per_write >= 2.0, "{r:?}");
        assert!(r.msync.synced_bytes_per_write >= 2.0 * BLOCK_BYTES as f64, "{r:?}");
        assert_eq!(r.volatile.msync_calls_per_write, 0.0);
        assert!(r.msync_to_volatile > 0.0 && r.runs == 3, "{r:?}");
    }

    /// A disk directory that is tmpfs is refused by name, not measured as msync.
    #[test]
    fn a_disk_directory_on_tmpfs_is_refused() {
        let (args, run) =
            parse::<MediaKindsArgs>(&["media-kinds", "--quick", "--disk-dir", "/dev/shm"])
                .expect("parses");
        let err = args.run(&run).unwrap_err();
        assert!(err.contains("/dev/shm: the medium there is volatile, not msync"), "{err}");
    }
}
