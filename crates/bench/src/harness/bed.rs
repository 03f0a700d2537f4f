//! In-process beds: an engine formatted on a medium file and a backing file of its own, for the
//! experiments that measure the engine without a frontend. Every such experiment builds its bed
//! here: [`BedDirs`] makes the files' directories, the experiment opens its medium (a file, a
//! window of one, a set of members) and its backing store (an I/O engine, a slow wrapper), and
//! [`Bed::format`] formats the cache on them.

use std::path::{Path, PathBuf};

use pmcache_backing::{BackingStore, IoBuf};
use pmcache_engine::{AdmissionConfig, Config, Engine, MonotonicClock};
use pmcache_media::Medium;

/// The engine's block size in every bed.
pub const BLOCK_BYTES: u64 = 4096;

/// The temporary directories of a bed's medium and backing files, removed with the bed.
pub struct BedDirs {
    medium: tempfile::TempDir,
    backing: tempfile::TempDir,
}

impl BedDirs {
    /// A directory for the medium in `medium_dir` (where the emulated PM lives: `/dev/shm`)
    /// and one for the backing file in `backing_dir` (the disk), which may be the same.
    pub fn new(medium_dir: &Path, backing_dir: &Path) -> Result<BedDirs, String> {
        let dir = |parent: &Path| {
            tempfile::Builder::new()
                .prefix("pmcache-bed-")
                .tempdir_in(parent)
                .map_err(|e| format!("{}: {e}", parent.display()))
        };
        Ok(BedDirs { medium: dir(medium_dir)?, backing: dir(backing_dir)? })
    }

    /// Where the medium file goes.
    pub fn medium_path(&self) -> PathBuf {
        self.medium.path().join("medium")
    }

    /// Where the backing file goes.
    pub fn backing_path(&self) -> PathBuf {
        self.backing.path().join("backing")
    }

    /// Creates the backing file, sparse, `bytes` long: its path.
    pub fn backing_file(&self, bytes: u64) -> Result<PathBuf, String> {
        let path = self.backing_path();
        std::fs::File::create(&path)
            .and_then(|f| f.set_len(bytes))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path)
    }
}

/// The configuration of a bed's cache: 4 KiB blocks, every read miss admitted (a bed measures
/// hits it filled itself), `lanes` lanes.
pub fn config(lanes: usize) -> Config {
    Config {
        block_size: BLOCK_BYTES as u32,
        max_lanes: lanes,
        admission: AdmissionConfig::Always,
        ..Config::default()
    }
}

/// The slots a medium of `medium_bytes` holds in a bed (with data checksums if `data_crc`).
pub fn slot_count(medium_bytes: u64, data_crc: bool) -> Result<u64, String> {
    Ok(pmcache_engine::format::Geometry::plan(medium_bytes, BLOCK_BYTES as u32, data_crc)
        .map_err(|e| e.to_string())?
        .slot_count)
}

/// A cache formatted on a bed's medium and backing store.
pub struct Bed<M: Medium, B: BackingStore> {
    /// The engine.
    pub engine: Engine<M, B, MonotonicClock>,
    /// Where the slots start on the medium.
    pub data_offset: u64,
    /// The files' directories (dropped after the engine: fields drop in order).
    pub dirs: BedDirs,
}

impl<M: Medium, B: BackingStore> Bed<M, B> {
    /// Formats a cache of `config` on `medium` and `backing`, whose files are in `dirs`.
    pub fn format(dirs: BedDirs, medium: M, backing: B, config: &Config) -> Result<Self, String> {
        let engine = Engine::format(medium, backing, MonotonicClock::default(), config)
            .map_err(|e| e.to_string())?;
        let data_offset = engine.superblock().geometry.data_offset;
        Ok(Bed { engine, data_offset, dirs })
    }

    /// Writes `[0, bytes)` once, 1 MiB at a time, each byte `fill`: the span is cached (and
    /// dirty), so that reads of it hit.
    pub fn fill(&self, bytes: u64, fill: u8) -> Result<(), String> {
        let mut lane = self.engine.lane().map_err(|e| e.to_string())?;
        let chunk = IoBuf::from_slice(&vec![fill; 1 << 20]);
        let mut offset = 0;
        while offset < bytes {
            let len = (bytes - offset).min(chunk.len() as u64) as usize;
            lane.write(offset, &chunk[..len], false).map_err(|e| e.to_string())?;
            offset += len as u64;
        }
        Ok(())
    }

    /// Read misses since the bed was formatted: a figure that claims all hits checks this is 0.
    pub fn read_misses(&self) -> u64 {
        let stats = self.engine.stats();
        stats.read_misses_admitted + stats.read_misses_bypassed
    }
}
