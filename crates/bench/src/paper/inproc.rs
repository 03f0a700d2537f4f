//! The in-process bed: pmcache's engine on an emulated-PM file beside the raw medium, every
//! series of a point measured in turns within one run.
//!
//! A [`Bed`] is a cache formatted on a file in the PM directory (`/dev/shm`) in front of a
//! backing file on a disk (opened `O_DIRECT`, as a cache layer reaches its SSD), with the
//! span the experiment touches written once through the engine so that every read hits. The
//! raw series reads and writes (copy + persist) the same medium file directly, at the same
//! offsets relative to the slot area, with the same requests: the paper's "standalone NVM".
//!
//! [`measure`] runs each series of a point for a turn of `seconds` with `threads` threads,
//! the series' order rotating from run to run, and returns bytes per second per series and
//! run; ratios are taken run by run, so that a series is only ever compared with its
//! normaliser from the same run.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pmcache_backing::{BackingStore, IoBuf, PsyncFile};
use pmcache_engine::{Lane, MonotonicClock};
use pmcache_media::{Medium, PmemFile};
use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::figure::{Point, Series};
use super::workload::{Access, Request};
use crate::harness;

pub use crate::harness::bed::BLOCK_BYTES;

/// A cache over an emulated-PM file, the span `[0, span)` cached: the harness's bed
/// ([`harness::bed::Bed`], which it dereferences to) and its medium file, for the raw series.
pub struct Bed<B: BackingStore> {
    bed: harness::bed::Bed<Arc<PmemFile>, B>,
    /// Its medium, for the raw series.
    pub medium: Arc<PmemFile>,
}

impl<B: BackingStore> std::ops::Deref for Bed<B> {
    type Target = harness::bed::Bed<Arc<PmemFile>, B>;
    fn deref(&self) -> &Self::Target {
        &self.bed
    }
}

/// The medium size whose slots hold `span` with a tenth of them free (out-of-place writes
/// always find a free slot without evicting).
pub fn medium_bytes_for(span: u64) -> Result<u64, String> {
    let blocks = span.div_ceil(BLOCK_BYTES);
    let needed = blocks + blocks / 9 + 16;
    let mut bytes = needed * (BLOCK_BYTES + 16) + (1 << 20);
    loop {
        let slots = harness::bed::slot_count(bytes, false)?;
        if slots >= needed {
            return Ok(bytes);
        }
        bytes += (needed - slots) * (BLOCK_BYTES + 16) + (1 << 20);
    }
}

impl Bed<PsyncFile> {
    /// A cache of `span` bytes, its medium in `pm_dir`, its backing file (`O_DIRECT`) in
    /// `disk_dir`, every block of the span written once in write-back mode.
    pub fn new(pm_dir: &Path, disk_dir: &Path, span: u64) -> Result<Self, String> {
        Self::with_backing(pm_dir, disk_dir, span, |path| {
            PsyncFile::open_with(path, true, false).map_err(|e| e.to_string())
        })
    }
}

impl<B: BackingStore> Bed<B> {
    /// As [`Bed::new`], the backing store opened by `open` on the backing file's path.
    pub fn with_backing(
        pm_dir: &Path,
        disk_dir: &Path,
        span: u64,
        open: impl FnOnce(&Path) -> Result<B, String>,
    ) -> Result<Self, String> {
        let span = span.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let dirs = harness::bed::BedDirs::new(pm_dir, disk_dir)?;
        let medium = Arc::new(
            PmemFile::open(&dirs.medium_path(), Some(medium_bytes_for(span)?))
                .map_err(|e| e.to_string())?,
        );
        let backing = open(&dirs.backing_file(span)?)?;
        let bed =
            harness::bed::Bed::format(dirs, medium.clone(), backing, &harness::bed::config(64))?;
        bed.fill(span, 0x5a)?;
        Ok(Bed { bed, medium })
    }

    /// A worker doing requests directly on the medium (reads copy out; writes copy and
    /// persist), offsets relative to the slot area.
    pub fn raw_worker(&self) -> Worker<'_> {
        let (medium, base) = (self.medium.clone(), self.data_offset);
        Box::new(move |request: &Request, buf: &mut [u8]| {
            let buf = &mut buf[..request.len as usize];
            if request.write {
                medium.write_persist(base + request.offset, buf);
            } else {
                medium.read(base + request.offset, buf);
                std::hint::black_box(&buf);
            }
        })
    }

    /// A worker with a lane of its own.
    pub fn lane_worker(&self) -> Result<Worker<'_>, String> {
        let mut lane = self.engine.lane().map_err(|e| e.to_string())?;
        Ok(Box::new(move |request: &Request, buf: &mut [u8]| lane_request(&mut lane, request, buf)))
    }
}

/// Does `request` through `lane`; a failed request is a failed experiment.
pub fn lane_request<M: Medium, B: BackingStore>(
    lane: &mut Lane<'_, M, B, MonotonicClock>,
    request: &Request,
    buf: &mut [u8],
) {
    let buf = &mut buf[..request.len as usize];
    if request.write {
        lane.write(request.offset, buf, false).expect("engine write");
    } else {
        lane.read(request.offset, buf).expect("engine read");
        std::hint::black_box(&buf);
    }
}

/// One thread's way of doing a request, with a buffer as large as the request.
pub type Worker<'a> = Box<dyn FnMut(&Request, &mut [u8]) + Send + 'a>;

/// A series: its name, and what makes thread *t*'s worker. `before`/`after` run around each of
/// its turns (a cache-mode switch).
pub struct SeriesRun<'a> {
    /// The series' name in the figure.
    pub name: String,
    /// Makes thread `t`'s worker.
    pub make: Box<dyn Fn(usize) -> Worker<'a> + Sync + 'a>,
    /// Runs before each turn.
    pub before: Option<Box<dyn Fn() + 'a>>,
}

impl<'a> SeriesRun<'a> {
    /// A series with nothing run around its turns.
    pub fn new(name: impl Into<String>, make: impl Fn(usize) -> Worker<'a> + Sync + 'a) -> Self {
        SeriesRun { name: name.into(), make: Box::new(make), before: None }
    }

    /// `before` runs before each of the series' turns.
    pub fn before(mut self, before: impl Fn() + 'a) -> Self {
        self.before = Some(Box::new(before));
        self
    }
}

/// Bytes per second of each series (outer) in each run (inner), the series' turns rotating.
/// `turn_done` is called after every turn (progress).
pub fn measure(
    series: &[SeriesRun<'_>],
    access: Access,
    threads: usize,
    seconds: f64,
    runs: usize,
    turn_done: &dyn Fn(),
) -> Vec<Vec<f64>> {
    let mut rates = vec![Vec::with_capacity(runs); series.len()];
    for run in 0..runs {
        for step in 0..series.len() {
            let index = (run + step) % series.len();
            let one = &series[index];
            if let Some(before) = &one.before {
                before();
            }
            rates[index].push(turn(one, access, threads, seconds, run));
            turn_done();
        }
    }
    rates
}

/// One turn of one series: `threads` threads for `seconds`; bytes per second.
fn turn(series: &SeriesRun<'_>, access: Access, threads: usize, seconds: f64, run: usize) -> f64 {
    let stop = AtomicBool::new(false);
    let bytes = AtomicU64::new(0);
    let ready = std::sync::Barrier::new(threads + 1);
    let request_max = access.request_max() as usize;
    let elapsed = std::thread::scope(|scope| {
        for t in 0..threads {
            let (stop, bytes, ready) = (&stop, &bytes, &ready);
            let make = &series.make;
            scope.spawn(move || {
                let mut worker = make(t);
                let mut buf = IoBuf::from_slice(&vec![0xc3; request_max]);
                let mut stream = access.stream(t, threads);
                let mut rng = SmallRng::seed_from_u64(((run as u64) << 32) | t as u64);
                let mut done = 0u64;
                ready.wait();
                while !stop.load(Ordering::Relaxed) {
                    let request = stream.next(&mut rng);
                    worker(&request, &mut buf);
                    done += request.len;
                }
                bytes.fetch_add(done, Ordering::Relaxed);
            });
        }
        ready.wait();
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        started
    });
    // Every thread has stopped: the last requests started before the stop count, and the
    // time runs until the last of them ended.
    bytes.load(Ordering::Relaxed) as f64 / elapsed.elapsed().as_secs_f64()
}

/// `values[i] / normaliser[i]`, run by run.
pub fn ratios(values: &[f64], normaliser: &[f64]) -> Vec<f64> {
    values.iter().zip(normaliser).map(|(v, n)| v / n).collect()
}

/// The rates of a sweep: for each x position, each series' bytes per second in each run.
pub struct Sweep {
    /// Series names, in the order of `rates[x]`.
    pub names: Vec<String>,
    /// `rates[x][series][run]`.
    pub rates: Vec<Vec<Vec<f64>>>,
    /// Whether position x ran more threads than there are CPUs.
    pub oversubscribed: Vec<bool>,
}

impl Sweep {
    /// An empty sweep of these series.
    pub fn new(series: &[SeriesRun<'_>]) -> Self {
        Sweep {
            names: series.iter().map(|s| s.name.clone()).collect(),
            rates: vec![],
            oversubscribed: vec![],
        }
    }

    /// Adds the next x position's rates.
    pub fn push(&mut self, rates: Vec<Vec<f64>>, oversubscribed: bool) {
        assert_eq!(rates.len(), self.names.len(), "one rate list per series");
        self.rates.push(rates);
        self.oversubscribed.push(oversubscribed);
    }

    /// Each series in `unit` (bytes per second divided by `unit`).
    pub fn absolute(&self, unit: f64) -> Vec<Series> {
        self.map(|x, s| self.rates[x][s].iter().map(|r| r / unit).collect())
    }

    /// Each series as a ratio to series `by`, run by run.
    pub fn normalised(&self, by: usize) -> Vec<Series> {
        self.map(|x, s| ratios(&self.rates[x][s], &self.rates[x][by]))
    }

    /// The median of series `s`'s ratio to series `by` at position `x`.
    pub fn ratio(&self, x: usize, s: usize, by: usize) -> f64 {
        Point::of(&ratios(&self.rates[x][s], &self.rates[x][by]), false).median
    }

    /// The median rate of series `s` at position `x`, in `unit`.
    pub fn median(&self, x: usize, s: usize, unit: f64) -> f64 {
        Point::of(&self.rates[x][s], false).median / unit
    }

    fn map(&self, values: impl Fn(usize, usize) -> Vec<f64>) -> Vec<Series> {
        (0..self.names.len())
            .map(|s| Series {
                name: self.names[s].clone(),
                points: (0..self.rates.len())
                    .map(|x| Some(Point::of(&values(x, s), self.oversubscribed[x])))
                    .collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bed_caches_its_whole_span_and_reads_it_all_as_hits() {
        let bed = Bed::new(Path::new("/dev/shm"), &std::env::temp_dir(), 8 << 20).expect("bed");
        assert_eq!(bed.read_misses(), 0);
        let access = Access::Random { request: 64 << 10, span: 8 << 20, write_share: 0.5 };
        let series = [
            SeriesRun::new("raw", |_| bed.raw_worker()),
            SeriesRun::new("pmcache", |_| bed.lane_worker().expect("lane")),
        ];
        let turns = std::cell::Cell::new(0);
        let rates = measure(&series, access, 2, 0.05, 2, &|| turns.set(turns.get() + 1));
        assert_eq!(turns.get(), 4);
        assert!(rates.iter().all(|r| r.len() == 2 && r.iter().all(|&b| b > 0.0)), "{rates:?}");
        assert_eq!(bed.read_misses(), 0, "every read of the span hits");
    }
}
