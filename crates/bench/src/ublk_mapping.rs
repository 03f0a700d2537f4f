//! `pmcache bench ublk-mapping`: what the ublk frontend's request path costs per request,
//! without a kernel. A ublk descriptor is decoded, validated and dispatched into the engine
//! (`pmcache_ublk::Dispatcher` over `pmcache_frontend::CacheConn`, the lane adapter `pmcache
//! serve --ublk` runs: reads and writes started as the server starts them, its read latencies
//! recorded; per-tag buffers as the device has) and its completion result taken; beside it,
//! the engine call alone on the same lane with the same blocks, in the same run. 4 KiB read
//! hits and write-back writes over random blocks of half the cache (every read hits, no write
//! evicts), one request per dispatch (a queue that received one request) and 16 per dispatch
//! (the engine's batch calls). The runs take turns in an order that alternates from run to
//! run; the table shows medians over runs.
//!
//! What it leaves out is the kernel's part: the io_uring commands that hand a request over
//! and commit it, and the copies between the bio and the tag's buffer.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use pmcache_backing::{IoBuf, PsyncFile};
use pmcache_engine::{ReadRequest, WriteRequest};
use pmcache_frontend::{Backing, CacheConn};
use pmcache_media::{MediumOptions, MediumSet, MediumSync, PmemFile, Window};
use pmcache_ublk::mapping::{UBLK_IO_OP_READ, UBLK_IO_OP_WRITE};
use pmcache_ublk::{Dispatcher, Geometry, IoDesc};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::harness::experiment::{Defaults, Experiment, Run};
use crate::harness::stats::median_in_place;

use crate::harness;
use crate::harness::bed::BLOCK_BYTES;
const SECTORS_PER_BLOCK: u32 = (BLOCK_BYTES / 512) as u32;
/// Requests per dispatch in the batched rows, and tags (buffers).
const BATCH: usize = 16;
/// Each tag's buffer, as the device sets it up.
const MAX_IO_BYTES: u32 = 1 << 20;

/// Options of `pmcache bench ublk-mapping`.
#[derive(Debug, Clone, clap::Args)]
pub struct UblkMappingArgs {
    /// Directory of the cache medium (tmpfs: emulated PM) and its backing file.
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
    /// Size of the cache medium in MiB.
    #[arg(long, default_value_t = 64)]
    pub cache_mib: u64,
    /// Requests per measurement.
    #[arg(long, default_value_t = 200_000)]
    pub requests: usize,
}

/// One row: a kind of request, through the mapping and alone.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `read hit` or `write`, and the requests per dispatch.
    pub what: String,
    /// Median ns per request: decode, validation, dispatch into the engine, completion result.
    pub mapped_ns: f64,
    /// Median ns per request: the engine call alone.
    pub engine_ns: f64,
    /// Median over runs of (mapped - engine) in the same run.
    pub overhead_ns: f64,
    /// Median over runs of mapped / engine in the same run.
    pub ratio: f64,
}

/// The experiment's result.
#[derive(Debug, Clone, Serialize)]
pub struct UblkMappingResult {
    /// One row per kind of request.
    pub rows: Vec<Row>,
    /// Requests per measurement.
    pub requests: usize,
    /// Runs the medians are over.
    pub runs: usize,
    /// The cache's size.
    pub cache_bytes: u64,
}

/// The request kinds measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

/// One lane (as `pmcache serve --ublk` serves it, over a psync backing file), a dispatcher,
/// per-tag buffers, and the random blocks every measurement uses.
struct Bed<'e> {
    target: CacheConn<'e>,
    dispatcher: Dispatcher,
    bufs: Vec<IoBuf>,
    pub(super) blocks: Vec<u64>,
}

impl Bed<'_> {
    /// Seconds for `blocks.len()` requests of `kind`, `per_dispatch` at a time, through the
    /// mapping (`mapped`) or straight into the engine.
    fn measure(&mut self, kind: Kind, per_dispatch: usize, mapped: bool) -> Result<f64, String> {
        let op = if kind == Kind::Read { UBLK_IO_OP_READ } else { UBLK_IO_OP_WRITE };
        let started = Instant::now();
        let (mut failed, mut unanswered) = (0usize, 0usize);
        let mut outcomes = Vec::with_capacity(BATCH);
        let mut direct = buffers(BLOCK_BYTES as usize, 0x5a);
        for chunk in self.blocks.chunks(per_dispatch) {
            if mapped {
                for (tag, &block) in chunk.iter().enumerate() {
                    let desc =
                        IoDesc::new(op, 0, block * u64::from(SECTORS_PER_BLOCK), SECTORS_PER_BLOCK);
                    self.dispatcher.receive(tag as u16, &desc);
                }
                self.dispatcher.dispatch(&mut self.target, &mut self.bufs);
                let mut answered = 0;
                for (_, result) in self.dispatcher.completions() {
                    answered += 1;
                    failed += usize::from(result < 0);
                }
                unanswered += chunk.len().saturating_sub(answered);
                continue;
            }
            let lane = self.target.lane();
            match (kind, chunk) {
                (Kind::Read, &[block]) => {
                    failed += usize::from(lane.read(block * BLOCK_BYTES, &mut direct[0]).is_err())
                }
                (Kind::Write, &[block]) => {
                    let r = lane.write(block * BLOCK_BYTES, &direct[0], false);
                    failed += usize::from(r.is_err());
                }
                (Kind::Read, _) => {
                    let mut requests: Vec<ReadRequest<'_>> = chunk
                        .iter()
                        .zip(direct.iter_mut())
                        .map(|(&b, buf)| ReadRequest { offset: b * BLOCK_BYTES, buf: &mut buf[..] })
                        .collect();
                    outcomes.clear();
                    lane.read_batch(&mut requests, &mut outcomes);
                    failed += outcomes.iter().filter(|r| r.is_err()).count();
                }
                (Kind::Write, _) => {
                    let requests: Vec<WriteRequest<'_>> = chunk
                        .iter()
                        .zip(&direct)
                        .map(|(&b, data)| WriteRequest {
                            offset: b * BLOCK_BYTES,
                            data,
                            fua: false,
                        })
                        .collect();
                    outcomes.clear();
                    lane.write_batch(&requests, &mut outcomes);
                    failed += outcomes.iter().filter(|r| r.is_err()).count();
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        if failed > 0 {
            return Err(format!("{failed} requests failed"));
        }
        // Every read hits and every write is written back later: each is answered at once.
        if unanswered > 0 {
            return Err(format!("{unanswered} requests were left in flight"));
        }
        Ok(seconds)
    }
}

/// `BATCH` buffers of `bytes` filled with `fill`, 4096-byte aligned as the device's are (the
/// engine's slots are too: a copy between them is at the same offset in a page).
fn buffers(bytes: usize, fill: u8) -> Vec<IoBuf> {
    (0..BATCH)
        .map(|_| {
            let mut buf = IoBuf::with_align(bytes, 4096);
            buf.fill(fill);
            buf
        })
        .collect()
}

impl Experiment for UblkMappingArgs {
    const NAME: &'static str = "ublk-mapping";
    const DEFAULTS: Defaults =
        Defaults { runs: Some(5), seconds: None, quick_runs: 3, quick_seconds: 0.0 };
    type Report = UblkMappingResult;

    /// Runs the experiment.
    fn run(&self, run: &Run) -> Result<UblkMappingResult, String> {
        let cache_bytes = if run.quick { 16 << 20 } else { self.cache_mib << 20 };
        let dirs = harness::bed::BedDirs::new(&self.dir, &self.dir)?;
        let options = MediumOptions { create_len_bytes: Some(cache_bytes), sync: MediumSync::Auto };
        let medium =
            PmemFile::open_with(&dirs.medium_path(), &options).map_err(|e| e.to_string())?;
        // Half the cache: every read hits, no write evicts.
        let span_blocks = (harness::bed::slot_count(cache_bytes, false)? / 2).max(1);
        let backing: Backing = Arc::new(
            PsyncFile::open(&dirs.backing_file(span_blocks * BLOCK_BYTES)?)
                .map_err(|e| e.to_string())?,
        );
        let medium = MediumSet::single(Window::whole(Arc::new(medium)));
        let bed = harness::bed::Bed::format(dirs, medium, backing, &harness::bed::config(2))?;
        let engine = &bed.engine;
        let mut rng = SmallRng::seed_from_u64(0x7562_6c6b);
        let geometry = Geometry {
            size_bytes: engine.size_bytes(),
            logical_block_bytes: BLOCK_BYTES as u32,
            max_io_bytes: MAX_IO_BYTES,
        };
        let mut bed = Bed {
            target: CacheConn::new(engine.lane().map_err(|e| e.to_string())?, Default::default()),
            dispatcher: Dispatcher::new(geometry, BATCH as u16),
            bufs: buffers(MAX_IO_BYTES as usize, 0xa5),
            blocks: (0..if run.quick { 20_000 } else { self.requests.max(BATCH) })
                .map(|_| rng.gen_range(0..span_blocks))
                .collect(),
        };
        // Every block of the span written once (reads then hit), untimed; a warm-up of each path.
        let all: Vec<u64> = (0..span_blocks).collect();
        let measured = std::mem::replace(&mut bed.blocks, all);
        bed.measure(Kind::Write, BATCH, false)?;
        bed.blocks = measured;
        let shapes = [(Kind::Read, 1), (Kind::Write, 1), (Kind::Read, BATCH), (Kind::Write, BATCH)];
        for &(kind, per) in &shapes {
            bed.measure(kind, per, true)?;
            bed.measure(kind, per, false)?;
        }
        let n = bed.blocks.len() as f64;
        let mut samples = vec![(Vec::new(), Vec::new(), Vec::new(), Vec::new()); shapes.len()];
        for turn in 0..run.runs {
            for (i, &(kind, per)) in shapes.iter().enumerate() {
                let (mapped, engine_alone) = if turn % 2 == 0 {
                    let m = bed.measure(kind, per, true)?;
                    (m, bed.measure(kind, per, false)?)
                } else {
                    let e = bed.measure(kind, per, false)?;
                    (bed.measure(kind, per, true)?, e)
                };
                let (m, e) = (mapped * 1e9 / n, engine_alone * 1e9 / n);
                let s = &mut samples[i];
                s.0.push(m);
                s.1.push(e);
                s.2.push(m - e);
                s.3.push(m / e);
            }
        }
        let rows = shapes
            .iter()
            .zip(&mut samples)
            .map(|(&(kind, per), s)| Row {
                what: format!(
                    "{}, {per} per dispatch",
                    if kind == Kind::Read { "4 KiB read hit" } else { "4 KiB write" }
                ),
                mapped_ns: median_in_place(&mut s.0),
                engine_ns: median_in_place(&mut s.1),
                overhead_ns: median_in_place(&mut s.2),
                ratio: median_in_place(&mut s.3),
            })
            .collect();
        Ok(UblkMappingResult { rows, requests: bed.blocks.len(), runs: run.runs, cache_bytes })
    }

    fn table(&self, r: &UblkMappingResult, _run: &Run) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "pmcache bench ublk-mapping: ublk descriptor decode + dispatch into the engine beside \
         the engine call alone, one lane, random blocks over half of a {} MiB cache; {} runs \
         of {} requests (medians; no kernel: the io_uring hand-over and the bio copies are not \
         in it)",
            r.cache_bytes >> 20,
            r.runs,
            r.requests
        );
        let _ = writeln!(
            out,
            "  {:<32} {:>12} {:>12} {:>13} {:>8}",
            "request", "mapped ns", "engine ns", "overhead ns", "ratio"
        );
        for row in &r.rows {
            let _ = writeln!(
                out,
                "  {:<32} {:>12.1} {:>12.1} {:>13.1} {:>8.3}",
                row.what, row.mapped_ns, row.engine_ns, row.overhead_ns, row.ratio
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quick run gives four rows, each with positive times.
    #[test]
    fn a_quick_run_measures_every_row() {
        let args = UblkMappingArgs { dir: std::env::temp_dir(), cache_mib: 16, requests: 1000 };
        // /dev/shm when there is one (the medium kind does not matter here).
        let args = if std::path::Path::new("/dev/shm").is_dir() {
            UblkMappingArgs { dir: "/dev/shm".into(), ..args }
        } else {
            args
        };
        let run = Run { quick: true, runs: 1, seconds: 0.0, json: false };
        let r = args.run(&run).expect("quick run");
        assert_eq!(r.rows.len(), 4);
        for row in &r.rows {
            assert!(row.mapped_ns > 0.0 && row.engine_ns > 0.0, "{row:?}");
        }
    }
}
