//! `bench engine-core`'s recovery row: the time `Engine::open` takes to scan a crashed cache.

use std::path::Path;
use std::time::Instant;

use pmcache_backing::PsyncFile;
use pmcache_engine::{Config, Engine, MonotonicClock};
use pmcache_media::PmemFile;

use super::bed::{Bed, bed};
use super::{BLOCK, CoreResult};
use crate::harness;
use crate::harness::stats::median_in_place;

/// Bytes streamed through between recoveries to push the previous run's metadata out of the
/// CPU caches (several times any last-level cache of the machines this runs on).
const CACHE_FLUSH_BYTES: usize = 256 << 20;

/// Fills a cache of `slots` slots (two thirds dirty, one third clean), crashes it (drops it
/// without shutdown) and times `Engine::open`. Each run maps the medium afresh (so its page
/// tables are built inside the timed scan, as after a restart) and first streams through
/// `CACHE_FLUSH_BYTES`, so that no run finds the previous run's metadata in the CPU caches.
pub(super) fn recovery_row(
    dir: &Path,
    slots: u64,
    runs: usize,
    dram_small: f64,
) -> Result<CoreResult, String> {
    let geometry_bytes = 4096 + (slots * 16).next_multiple_of(4096) + slots * BLOCK;
    let bed = bed(dir, geometry_bytes, 2, false)?;
    let slot_count = bed.engine.superblock().geometry.slot_count;
    {
        let mut lane = bed.engine.lane().map_err(|e| e.to_string())?;
        // The bed wrote 90 % of the slots dirty: write them all back, then overwrite two thirds
        // (each overwrite frees the old copy), leaving one third clean and two thirds dirty.
        lane.drain().map_err(|e| e.to_string())?;
        let data = vec![0x11u8; BLOCK as usize];
        for b in 0..bed.blocks * 2 / 3 {
            lane.write(b * BLOCK, &data, false).map_err(|e| e.to_string())?;
        }
    }
    let dram = bed.engine.stats().dram_bytes_per_slot;
    let Bed { bed: harness::bed::Bed { engine, dirs, .. }, medium, .. } = bed;
    let (backing_path, medium_path) = (dirs.backing_path(), dirs.medium_path());
    drop(engine);
    drop(medium);
    let config = Config { max_lanes: 2, ..Config::default() };
    let mut times = Vec::new();
    let mut report = None;
    let mut flush_buffer = vec![0u8; CACHE_FLUSH_BYTES];
    for run in 0..runs {
        let medium = PmemFile::open(&medium_path, None).map_err(|e| e.to_string())?;
        let backing = PsyncFile::open(&backing_path).map_err(|e| e.to_string())?;
        flush_buffer.iter_mut().step_by(64).for_each(|byte| *byte = run as u8);
        std::hint::black_box(&flush_buffer);
        let started = Instant::now();
        let (engine, r) = Engine::open(medium, backing, MonotonicClock::default(), &config)
            .map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_secs_f64());
        report = Some(r);
        drop(engine);
    }
    let report = report.expect("at least one run");
    let slowest_s = times.iter().copied().fold(0.0, f64::max);
    let recovery_s = median_in_place(&mut times);
    Ok(CoreResult {
        name: format!(
            "recovery ({slot_count} slots: {} clean, {} dirty; DRAM {dram:.2} B/slot here, {dram_small:.2} B/slot at the bench cache)",
            report.clean, report.dirty
        ),
        threads: 1,
        requests_per_call: 1,
        ops_per_sec: slot_count as f64 / recovery_s,
        baseline: format!(
            "time to recover: {:.1} ms (median; slowest {:.1} ms; slots/s in ops_per_sec)",
            recovery_s * 1e3,
            slowest_s * 1e3
        ),
        recovery_ms: Some(recovery_s * 1e3),
        recovery_ms_max: Some(slowest_s * 1e3),
        dram_bytes_per_slot: Some(dram),
        dram_bytes_per_slot_bench_cache: Some(dram_small),
        runs,
        setup: format!("medium {} MiB in {}", geometry_bytes >> 20, dir.display()),
        ..CoreResult::default()
    })
}
