//! The in-process bed of several volumes: one cache per volume, each in its own window of one
//! emulated-PM file, laid out as `pmcache serve --store` lays out a medium shared by several
//! backing stores (a store table, then a window per store: `pmcache_engine::stores`). Each
//! volume has its own backing file on the disk (`O_DIRECT`) and its span written once in
//! write-back mode, so that its reads hit; the raw series writes the same medium file directly,
//! at the same offsets relative to each window's slot area.

use std::path::Path;
use std::sync::Arc;

use pmcache_backing::PsyncFile;
use pmcache_engine::stores::{STORE_ALIGN_BYTES, StoreTable};
use pmcache_media::{Medium, PmemFile, Window};

use super::inproc::{BLOCK_BYTES, Worker, lane_request, medium_bytes_for};
use super::workload::Request;
use crate::harness::bed::{self, Bed, BedDirs};

/// One volume's cache, on its window of the shared medium.
pub type VolumeBed = Bed<Window<Arc<PmemFile>>, PsyncFile>;

/// Caches of `span` bytes each, one per volume, on one medium file.
pub struct Volumes {
    /// Each volume's cache (dropped before the medium file's directory).
    pub caches: Vec<VolumeBed>,
    /// The medium file every window is on, for the raw series.
    pub medium: Arc<PmemFile>,
    /// Where each volume's slot area starts in the medium file.
    slot_area_offsets: Vec<u64>,
    /// The medium file's directory (its backing files' are the caches').
    _medium_dirs: BedDirs,
}

impl Volumes {
    /// `volumes` caches of `span` bytes each (names `volume0`, `volume1`, …) on one medium
    /// file in `pm_dir`, each over a backing file of its own (`O_DIRECT`) in `disk_dir`, each
    /// span written once in write-back mode.
    pub fn new(pm_dir: &Path, disk_dir: &Path, volumes: usize, span: u64) -> Result<Self, String> {
        let span = span.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let window_bytes = medium_bytes_for(span)?.next_multiple_of(STORE_ALIGN_BYTES);
        let medium_bytes = STORE_ALIGN_BYTES + volumes as u64 * window_bytes;
        let names: Vec<String> = (0..volumes).map(|v| format!("volume{v}")).collect();
        let table = StoreTable::plan(medium_bytes, &names).map_err(|e| e.to_string())?;
        let medium_dirs = BedDirs::new(pm_dir, disk_dir)?;
        let medium = Arc::new(
            PmemFile::open(&medium_dirs.medium_path(), Some(medium_bytes))
                .map_err(|e| e.to_string())?,
        );
        StoreTable::clear(&*medium);
        let mut caches = Vec::with_capacity(volumes);
        let mut slot_area_offsets = Vec::with_capacity(volumes);
        for entry in &table.stores {
            let dirs = BedDirs::new(disk_dir, disk_dir)?;
            let backing = PsyncFile::open_with(&dirs.backing_file(span)?, true, false)
                .map_err(|e| e.to_string())?;
            let window = Window::new(medium.clone(), entry.window.clone());
            let cache = Bed::format(dirs, window, backing, &bed::config(64))
                .map_err(|e| format!("{}: {e}", entry.name))?;
            cache.fill(span, 0x5a)?;
            slot_area_offsets.push(entry.window.start + cache.data_offset);
            caches.push(cache);
        }
        table.write(&*medium);
        Ok(Volumes { caches, medium, slot_area_offsets, _medium_dirs: medium_dirs })
    }

    /// A worker doing requests directly on the medium file (reads copy out; writes copy and
    /// persist), each at its offset in the slot area of its volume's window.
    pub fn raw_worker(&self) -> Worker<'_> {
        let medium = self.medium.clone();
        let bases = &self.slot_area_offsets;
        Box::new(move |request: &Request, buf: &mut [u8]| {
            let buf = &mut buf[..request.len as usize];
            let at = bases[request.volume] + request.offset;
            if request.write {
                medium.write_persist(at, buf);
            } else {
                medium.read(at, buf);
                std::hint::black_box(&buf);
            }
        })
    }

    /// A worker with a lane of its own on volume `volume`'s cache, for requests to that volume.
    pub fn lane_worker(&self, volume: usize) -> Result<Worker<'_>, String> {
        let mut lane = self.caches[volume].engine.lane().map_err(|e| e.to_string())?;
        Ok(Box::new(move |request: &Request, buf: &mut [u8]| {
            assert_eq!(request.volume, volume, "a request to another volume than the lane's");
            lane_request(&mut lane, request, buf)
        }))
    }

    /// Read misses of all the caches since they were formatted.
    pub fn read_misses(&self) -> u64 {
        self.caches.iter().map(|cache| cache.read_misses()).sum()
    }
}

#[cfg(test)]
mod tests {
    use pmcache_engine::stores::STORE_TABLE_BYTES;

    use super::*;
    use crate::paper::inproc::{SeriesRun, measure};
    use crate::paper::workload::Access;

    #[test]
    fn each_volume_is_a_cache_in_its_own_window_of_one_medium_and_private_writes_stay_in_it() {
        let span = 1 << 20;
        let volumes =
            Volumes::new(Path::new("/dev/shm"), &std::env::temp_dir(), 3, span).expect("volumes");
        // The medium reads back as a store table naming the three windows, disjoint, in order.
        assert!(StoreTable::is_on(&*volumes.medium));
        let read = StoreTable::read(&*volumes.medium).expect("the table");
        assert_eq!(read.names(), ["volume0", "volume1", "volume2"]);
        assert!(read.stores.windows(2).all(|w| w[0].window.end <= w[1].window.start));
        assert!(read.stores[0].window.start >= STORE_TABLE_BYTES as u64);
        for (cache, entry) in volumes.caches.iter().zip(&read.stores) {
            assert_eq!(cache.engine.medium().range(), entry.window);
        }
        // Each thread overwrites block 0 of its own volume through its own cache.
        let access = Access::Private { volume: span };
        let series = [
            SeriesRun::new("raw", |_| volumes.raw_worker()),
            SeriesRun::new("pmcache", |t| volumes.lane_worker(t).expect("a lane")),
        ];
        let before: Vec<u64> = volumes.caches.iter().map(|c| c.engine.stats().writes).collect();
        let rates = measure(&series, access, 3, 0.05, 1, &|| {});
        assert!(rates.iter().all(|r| r[0] > 0.0), "{rates:?}");
        for (cache, before) in volumes.caches.iter().zip(before) {
            assert!(cache.engine.stats().writes > before, "every volume's cache was written");
        }
        // The raw series wrote block 0 of each window's slot area, nothing outside it.
        for (v, entry) in read.stores.iter().enumerate() {
            let mut block = vec![0u8; BLOCK_BYTES as usize];
            volumes.medium.read(volumes.slot_area_offsets[v], &mut block);
            assert!(block.iter().all(|&b| b == 0xc3), "volume {v}'s block 0 in the raw series");
            assert!((entry.window.clone()).contains(&volumes.slot_area_offsets[v]));
        }
        assert_eq!(volumes.read_misses(), 0);
    }
}
