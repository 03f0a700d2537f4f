//! Running a workload: its filesets created, its threads looping over their flowops for a set
//! time, each flowop timed and counted as filebench counts it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::fileset::{Fileset, Want};
use super::personality::{Op, Semaphore, ThreadGroup, Workload};
use super::sync::{AioWriter, Throttle};

/// The largest single I/O of any flowop (the whole-file flowops' 1 MiB).
const BUFFER_BYTES: usize = 1 << 20;
/// The memory a thread's `hog` stores to (filebench's `memsize`, bounded).
const HOG_BYTES: usize = 64 << 10;

/// One flowop's results over the run.
#[derive(Clone, Debug, Serialize)]
pub struct FlowopResult {
    /// Its thread group.
    pub group: String,
    /// Its name.
    pub name: String,
    /// Whether filebench counts it in ops.
    pub counted: bool,
    /// Times it completed.
    pub ops: u64,
    /// Per second of the run.
    pub ops_per_s: f64,
    /// Bytes it read.
    pub read_bytes: u64,
    /// Bytes it wrote.
    pub write_bytes: u64,
    /// Its mean latency.
    pub latency_ms_mean: f64,
    /// Its 99th-percentile latency.
    pub latency_ms_p99: f64,
}

/// A workload's results: filebench's summary line and its per-flowop lines.
#[derive(Clone, Debug, Serialize)]
pub struct FsResult {
    /// `fileserver`, ….
    pub personality: String,
    /// Threads per group (`50`, `1+10+200`).
    pub threads: String,
    /// The directory it ran in.
    pub dir: String,
    /// Seconds measured.
    pub seconds: f64,
    /// Files of its filesets, and how many existed at the start.
    pub files: u64,
    /// Files created before the run.
    pub files_preallocated: u64,
    /// Bytes written before the run.
    pub bytes_preallocated: u64,
    /// Seconds creating the filesets took.
    pub create_seconds: f64,
    /// Counted flowops completed (filebench's ops).
    pub ops: u64,
    /// Per second.
    pub ops_per_s: f64,
    /// Read flowops per second.
    pub reads_per_s: f64,
    /// Write flowops per second.
    pub writes_per_s: f64,
    /// Bytes read and written per second, MiB.
    pub mib_per_s: f64,
    /// Mean latency of the counted flowops.
    pub latency_ms_per_op: f64,
    /// Each flowop of each group.
    pub flowops: Vec<FlowopResult>,
}

/// What every thread shares.
struct Shared<'a> {
    workload: &'a Workload,
    filesets: &'a [Fileset],
    stop: AtomicBool,
    /// The log writer's semaphore.
    log_throttle: Throttle,
    /// Each DB writer's.
    db_throttles: Vec<Throttle>,
    failure: Mutex<Option<String>>,
    buffer: Vec<u8>,
}

impl Shared<'_> {
    fn fail(&self, error: String) {
        self.failure.lock().expect("failure lock").get_or_insert(error);
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One flowop's counts on one thread.
struct Tally {
    ops: u64,
    read_bytes: u64,
    write_bytes: u64,
    latency_ns: Histogram<u64>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            ops: 0,
            read_bytes: 0,
            write_bytes: 0,
            latency_ns: Histogram::new_with_bounds(1_000, 600_000_000_000, 2)
                .expect("histogram bounds"),
        }
    }

    fn add(&mut self, other: &Tally) {
        self.ops += other.ops;
        self.read_bytes += other.read_bytes;
        self.write_bytes += other.write_bytes;
        self.latency_ns.add(&other.latency_ns).expect("same bounds");
    }
}

/// What a flowop did.
enum Done {
    /// Completed, with bytes read and written.
    Io { read: u64, written: u64 },
    /// Nothing to act on (no entry in the wanted state): not counted, as filebench.
    Skipped,
    /// The run ended while it waited.
    Stopped,
}

/// A thread's state between flowops.
struct Worker<'a> {
    shared: &'a Shared<'a>,
    group: &'a ThreadGroup,
    /// Which DB writer (its semaphore), for a `dbwr` thread.
    db_writer: usize,
    rng: SmallRng,
    /// fd 1: the open file and its fileset entry.
    fd: Option<(File, usize, usize)>,
    /// The shared log file, opened on the first append.
    log: Option<File>,
    /// `opennext` files per fileset, opened on first use.
    rotating: Vec<Vec<Option<Arc<File>>>>,
    rotor: usize,
    aio: Option<AioWriter>,
    read_buffer: Vec<u8>,
    hog: Vec<u8>,
}

impl<'a> Worker<'a> {
    fn new(shared: &'a Shared<'a>, group: &'a ThreadGroup, db_writer: usize, seed: u64) -> Self {
        // The writes a loop queues before its `aiowait`, and the largest.
        let (aio_depth, aio_bytes) =
            group.flowops.iter().fold((0usize, None), |(depth, bytes), f| match f.op {
                Op::AioWriteRandom { iters, iosize, .. } => {
                    (depth + iters as usize, bytes.max(Some(iosize as usize)))
                }
                _ => (depth, bytes),
            });
        let read_bytes = group
            .flowops
            .iter()
            .filter_map(|f| match f.op {
                Op::ReadWholeFile { iosize } | Op::ReadRandom { iosize, .. } => {
                    Some((iosize as usize).min(BUFFER_BYTES))
                }
                _ => None,
            })
            .max()
            .unwrap_or(0);
        Worker {
            shared,
            group,
            db_writer,
            rng: SmallRng::seed_from_u64(seed),
            fd: None,
            log: None,
            rotating: shared.filesets.iter().map(|f| vec![None; f.sizes().len()]).collect(),
            rotor: 0,
            aio: aio_bytes.map(|bytes| AioWriter::new(aio_depth.max(1), bytes)),
            read_buffer: vec![0; read_bytes],
            hog: vec![0; HOG_BYTES],
        }
    }

    fn fileset(&self, index: usize) -> &'a Fileset {
        &self.shared.filesets[index]
    }

    fn stopped(&self) -> bool {
        self.shared.stop.load(Ordering::Relaxed)
    }

    /// Runs the loop until the stop flag; returns each flowop's tally.
    fn run(mut self, start: &Barrier) -> Vec<Tally> {
        let mut tallies: Vec<Tally> = self.group.flowops.iter().map(|_| Tally::new()).collect();
        start.wait();
        'run: while !self.stopped() {
            for (k, flowop) in self.group.flowops.iter().enumerate() {
                let repeats = match flowop.op {
                    Op::AioWriteRandom { iters, .. } => iters,
                    _ => 1,
                };
                for _ in 0..repeats {
                    if self.stopped() {
                        break 'run;
                    }
                    let began = Instant::now();
                    match self.execute(flowop.op) {
                        Ok(Done::Io { read, written }) => {
                            let t = &mut tallies[k];
                            t.ops += 1;
                            t.read_bytes += read;
                            t.write_bytes += written;
                            let ns = began.elapsed().as_nanos() as u64;
                            t.latency_ns.saturating_record(ns.max(1_000));
                        }
                        Ok(Done::Skipped) => {}
                        Ok(Done::Stopped) => break 'run,
                        Err(e) => {
                            self.shared.fail(format!(
                                "{}: {}: {}",
                                self.shared.workload.personality.name(),
                                flowop.name,
                                e
                            ));
                            break 'run;
                        }
                    }
                }
            }
        }
        self.close_fd();
        tallies
    }

    fn close_fd(&mut self) {
        if let Some((file, fileset, entry)) = self.fd.take() {
            drop(file);
            self.fileset(fileset).release(entry, true);
        }
    }

    fn execute(&mut self, op: Op) -> Result<Done, String> {
        let io = |read: u64, written: u64| Ok(Done::Io { read, written });
        match op {
            Op::CreateFile { fileset } | Op::OpenFile { fileset } => {
                assert!(self.fd.is_none(), "a flowop opened fd 1 without closing it");
                let create = matches!(op, Op::CreateFile { .. });
                let want = if create { Want::Absent } else { Want::Existing };
                let set = self.fileset(fileset);
                let Some(entry) = set.pick(want, &mut self.rng, &self.shared.stop) else {
                    return Ok(if self.stopped() { Done::Stopped } else { Done::Skipped });
                };
                let path = set.path(entry);
                let mut options = OpenOptions::new();
                options.read(true).write(true);
                if create {
                    options.create(true).truncate(true);
                }
                match options.open(&path) {
                    Ok(file) => {
                        self.fd = Some((file, fileset, entry));
                        io(0, 0)
                    }
                    Err(e) => {
                        set.release(entry, !create);
                        Err(format!("{}: {e}", path.display()))
                    }
                }
            }
            Op::CloseFile => {
                if self.fd.is_none() {
                    return Ok(Done::Skipped);
                }
                self.close_fd();
                io(0, 0)
            }
            Op::DeleteFile { fileset } | Op::StatFile { fileset } => {
                let set = self.fileset(fileset);
                let Some(entry) = set.pick(Want::Existing, &mut self.rng, &self.shared.stop) else {
                    return Ok(if self.stopped() { Done::Stopped } else { Done::Skipped });
                };
                let path = set.path(entry);
                if matches!(op, Op::DeleteFile { .. }) {
                    let result = std::fs::remove_file(&path);
                    set.release(entry, result.is_err());
                    result.map_err(|e| format!("{}: {e}", path.display()))?;
                } else {
                    let result = std::fs::metadata(&path);
                    set.release(entry, true);
                    result.map_err(|e| format!("{}: {e}", path.display()))?;
                }
                io(0, 0)
            }
            Op::WriteWholeFile { iosize } => {
                let Some((file, fileset, entry)) = self.fd.as_mut() else {
                    return Ok(Done::Skipped);
                };
                let size = self.shared.filesets[*fileset].size(*entry);
                let mut left = size;
                while left > 0 {
                    let piece = left.min(iosize).min(BUFFER_BYTES as u64) as usize;
                    file.write_all(&self.shared.buffer[..piece]).map_err(|e| e.to_string())?;
                    left -= piece as u64;
                }
                io(0, size)
            }
            Op::ReadWholeFile { iosize } => {
                let Some((file, ..)) = self.fd.as_mut() else { return Ok(Done::Skipped) };
                file.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
                let piece = (iosize as usize).min(self.read_buffer.len());
                let mut total = 0u64;
                loop {
                    let n = file.read(&mut self.read_buffer[..piece]).map_err(|e| e.to_string())?;
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                }
                io(total, 0)
            }
            Op::AppendFileRand { iosize_max, shared_log } => {
                let len = self.rng.gen_range(1..=iosize_max.min(BUFFER_BYTES as u64)) as usize;
                let data = &self.shared.buffer[..len];
                match shared_log {
                    Some(fileset) => {
                        if self.log.is_none() {
                            let path = self.fileset(fileset).path(0);
                            let file = OpenOptions::new()
                                .append(true)
                                .open(&path)
                                .map_err(|e| format!("{}: {e}", path.display()))?;
                            self.log = Some(file);
                        }
                        let log = self.log.as_mut().expect("opened above");
                        log.write_all(data).map_err(|e| e.to_string())?;
                    }
                    None => {
                        let Some((file, ..)) = self.fd.as_mut() else {
                            return Ok(Done::Skipped);
                        };
                        file.seek(SeekFrom::End(0)).map_err(|e| e.to_string())?;
                        file.write_all(data).map_err(|e| e.to_string())?;
                    }
                }
                io(0, len as u64)
            }
            Op::Fsync => {
                let Some((file, ..)) = self.fd.as_ref() else { return Ok(Done::Skipped) };
                file.sync_all().map_err(|e| e.to_string())?;
                io(0, 0)
            }
            Op::ReadRandom { fileset, iosize } => {
                let (file, size) = self.next_rotating(fileset, false)?;
                let offset = self.random_offset(size, iosize);
                let buf = &mut self.read_buffer[..iosize as usize];
                let n = std::os::unix::fs::FileExt::read_at(&*file, buf, offset)
                    .map_err(|e| e.to_string())?;
                io(n as u64, 0)
            }
            Op::AioWriteRandom { fileset, iosize, dsync, .. } => {
                let (file, size) = self.next_rotating(fileset, dsync)?;
                let offset = self.random_offset(size, iosize);
                self.aio.as_ref().expect("a writer thread").submit(
                    file,
                    offset,
                    iosize as usize,
                )?;
                io(0, iosize)
            }
            Op::AioWait => match self.aio.as_ref() {
                None => Ok(Done::Skipped),
                Some(aio) => match aio.wait(&self.shared.stop)? {
                    true => io(0, 0),
                    false => Ok(Done::Stopped),
                },
            },
            Op::Hog { iterations } => {
                let len = self.hog.len();
                for i in 0..iterations as usize {
                    self.hog[i % len] = i as u8;
                    std::hint::black_box(&mut self.hog);
                }
                io(0, 0)
            }
            Op::SemBlock { semaphore, value, .. } => {
                let throttle = match semaphore {
                    Semaphore::LogWriter => &self.shared.log_throttle,
                    Semaphore::DbWriters => &self.shared.db_throttles[self.db_writer],
                };
                Ok(if throttle.block(value, &self.shared.stop) {
                    Done::Io { read: 0, written: 0 }
                } else {
                    Done::Stopped
                })
            }
            Op::SemPost { semaphore } => {
                let stop = &self.shared.stop;
                let posted = match semaphore {
                    Semaphore::LogWriter => self.shared.log_throttle.post(stop),
                    Semaphore::DbWriters => {
                        self.shared.db_throttles.iter().all(|throttle| throttle.post(stop))
                    }
                };
                Ok(if posted { Done::Io { read: 0, written: 0 } } else { Done::Stopped })
            }
            Op::EventLimit => io(0, 0),
        }
    }

    /// The next file of `fileset` in this thread's rotation (`opennext`), opened on first use
    /// (`O_DSYNC` for a dsync writer), and its size.
    fn next_rotating(&mut self, fileset: usize, dsync: bool) -> Result<(Arc<File>, u64), String> {
        let set = self.fileset(fileset);
        let n = self.rotating[fileset].len();
        let entry = self.rotor % n;
        self.rotor = self.rotor.wrapping_add(1);
        if self.rotating[fileset][entry].is_none() {
            let path = set.path(entry);
            let mut options = OpenOptions::new();
            options.read(true).write(true);
            if dsync {
                options.custom_flags(libc::O_DSYNC);
            }
            let file = options.open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            self.rotating[fileset][entry] = Some(Arc::new(file));
        }
        let file = Arc::clone(self.rotating[fileset][entry].as_ref().expect("opened above"));
        Ok((file, set.size(entry)))
    }

    /// A random `iosize`-aligned offset of a file of `size` bytes.
    fn random_offset(&mut self, size: u64, iosize: u64) -> u64 {
        let slots = (size / iosize).max(1);
        self.rng.gen_range(0..slots) * iosize
    }
}

/// Creates the workload's filesets under `dir`, runs its threads for `seconds`, removes the
/// filesets, and returns filebench's figures.
pub fn run(workload: &Workload, dir: &Path, seconds: f64, seed: u64) -> Result<FsResult, String> {
    raise_open_files_limit(workload)?;
    let root = dir.join(format!("pmcache-fs-{}", workload.personality.name()));
    std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    let filesets: Vec<Fileset> = workload
        .filesets
        .iter()
        .enumerate()
        .map(|(i, spec)| Fileset::plan(spec, &root, seed.wrapping_add(i as u64)))
        .collect();
    let mut buffer = vec![0u8; BUFFER_BYTES];
    SmallRng::seed_from_u64(seed).fill(&mut buffer[..]);
    let created = Instant::now();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for set in &filesets {
        set.create(&buffer, cpus.clamp(1, 8))?;
    }
    let create_seconds = created.elapsed().as_secs_f64();
    let outcome = measure(workload, &filesets, buffer, seconds, seed);
    let removed = std::fs::remove_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()));
    let mut result = outcome?;
    removed?;
    result.dir = dir.display().to_string();
    result.create_seconds = create_seconds;
    Ok(result)
}

/// Every thread keeps its `opennext` files open (OLTP: 211 threads × 11 files), as filebench
/// does, which raises its open-files limit to the hard limit: so does this.
fn raise_open_files_limit(workload: &Workload) -> Result<(), String> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let files: u64 = workload.filesets.iter().map(|f| f.entries).sum();
    let need = workload.threads_total() as u64 * (files.min(64) + 4) + 256;
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.is_some_and(|current| current < need) {
        limit.current = limit.maximum.map(|max| need.min(max)).or(Some(need));
        setrlimit(Resource::Nofile, limit)
            .map_err(|e| format!("raising the open-files limit to {need}: {e}"))?;
    }
    let now = getrlimit(Resource::Nofile).current;
    if now.is_some_and(|current| current < need) {
        return Err(format!(
            "{} keeps about {need} files open; the open-files limit is {} (ulimit -n)",
            workload.personality.name(),
            now.unwrap_or(0)
        ));
    }
    Ok(())
}

fn measure(
    workload: &Workload,
    filesets: &[Fileset],
    buffer: Vec<u8>,
    seconds: f64,
    seed: u64,
) -> Result<FsResult, String> {
    let highwater = |semaphore: Semaphore| {
        workload
            .groups
            .iter()
            .flat_map(|g| &g.flowops)
            .find_map(|f| match f.op {
                Op::SemBlock { semaphore: s, highwater, .. } if s == semaphore => Some(highwater),
                _ => None,
            })
            .unwrap_or(0)
    };
    let db_writers = workload
        .groups
        .iter()
        .filter(|g| g.blocks_on(Semaphore::DbWriters))
        .map(|g| g.instances)
        .sum::<usize>();
    let shared = Shared {
        workload,
        filesets,
        stop: AtomicBool::new(false),
        log_throttle: Throttle::new(highwater(Semaphore::LogWriter)),
        db_throttles: (0..db_writers)
            .map(|_| Throttle::new(highwater(Semaphore::DbWriters)))
            .collect(),
        failure: Mutex::new(None),
        buffer,
    };
    let threads = workload.threads_total();
    let start = Barrier::new(threads + 1);
    let (tallies, elapsed) = std::thread::scope(|scope| {
        let mut handles = vec![];
        let mut n = 0u64;
        for group in &workload.groups {
            let is_db_writer = group.blocks_on(Semaphore::DbWriters);
            for instance in 0..group.instances {
                n += 1;
                let shared = &shared;
                let start = &start;
                let index = if is_db_writer { instance } else { 0 };
                let handle = std::thread::Builder::new()
                    .name(format!("fs-{}", group.name))
                    .stack_size(256 << 10)
                    .spawn_scoped(scope, move || {
                        Worker::new(shared, group, index, seed.wrapping_mul(1_000_003) + n)
                            .run(start)
                    })
                    .expect("spawning a workload thread");
                handles.push((group.name, handle));
            }
        }
        start.wait();
        let began = Instant::now();
        let deadline = began + Duration::from_secs_f64(seconds);
        while Instant::now() < deadline && !shared.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10).min(deadline - Instant::now()));
        }
        shared.stop.store(true, Ordering::Relaxed);
        let elapsed = began.elapsed().as_secs_f64();
        shared.log_throttle.wake_all();
        shared.db_throttles.iter().for_each(Throttle::wake_all);
        let tallies: Vec<(&str, Vec<Tally>)> = handles
            .into_iter()
            .map(|(name, h)| (name, h.join().expect("a workload thread panicked")))
            .collect();
        (tallies, elapsed)
    });
    if let Some(e) = shared.failure.into_inner().expect("failure lock") {
        return Err(e);
    }
    Ok(summarise(workload, filesets, &tallies, elapsed))
}

fn summarise(
    workload: &Workload,
    filesets: &[Fileset],
    tallies: &[(&str, Vec<Tally>)],
    seconds: f64,
) -> FsResult {
    let mut flowops = vec![];
    let (mut ops, mut reads, mut writes, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut latency_ns_total = 0.0;
    for group in &workload.groups {
        for (k, flowop) in group.flowops.iter().enumerate() {
            let mut sum = Tally::new();
            for (_, t) in tallies.iter().filter(|(name, _)| *name == group.name) {
                sum.add(&t[k]);
            }
            let counted = flowop.op.counted();
            if counted {
                ops += sum.ops;
                latency_ns_total += sum.latency_ns.mean() * sum.ops as f64;
                bytes += sum.read_bytes + sum.write_bytes;
                if flowop.op.is_read() {
                    reads += sum.ops;
                }
                if flowop.op.is_write() {
                    writes += sum.ops;
                }
            }
            flowops.push(FlowopResult {
                group: group.name.into(),
                name: flowop.name.into(),
                counted,
                ops: sum.ops,
                ops_per_s: sum.ops as f64 / seconds,
                read_bytes: sum.read_bytes,
                write_bytes: sum.write_bytes,
                latency_ms_mean: sum.latency_ns.mean() / 1e6,
                latency_ms_p99: sum.latency_ns.value_at_quantile(0.99) as f64 / 1e6,
            });
        }
    }
    let files: u64 = filesets.iter().map(|f| f.spec.entries).sum();
    let preallocated: u64 =
        filesets.iter().map(|f| f.spec.entries * f.spec.prealloc_percent / 100).sum();
    let bytes_preallocated: u64 = filesets.iter().map(Fileset::preallocated_bytes).sum();
    FsResult {
        personality: workload.personality.name().into(),
        threads: workload.threads_label(),
        dir: String::new(),
        seconds,
        files,
        files_preallocated: preallocated,
        bytes_preallocated,
        create_seconds: 0.0,
        ops,
        ops_per_s: ops as f64 / seconds,
        reads_per_s: reads as f64 / seconds,
        writes_per_s: writes as f64 / seconds,
        mib_per_s: bytes as f64 / seconds / (1 << 20) as f64,
        latency_ms_per_op: if ops == 0 { 0.0 } else { latency_ns_total / ops as f64 / 1e6 },
        flowops,
    }
}
