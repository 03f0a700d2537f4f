//! The conformance suite every engine passes, on a file on the root disk with `O_DIRECT` and on
//! a file in `/dev/shm` with buffered I/O: data round-trips at random offsets and sizes (sync
//! calls with unaligned buffers, and queued), misaligned `O_DIRECT` requests get a clear error,
//! short reads are reported, errors carry the kernel's errno, many I/Os in flight from several
//! threads, flush, and discard/write-zeroes read back as zeroes. `block_devices` runs every
//! engine on loop devices with 512- and 4096-byte sectors.
//!
//! The disk directory is `$PMCACHE_TEST_DISK_DIR` (default `/var/tmp`), the memory one
//! `$PMCACHE_TEST_SHM_DIR` (default `/dev/shm`).

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use pmcache_backing::{
    BackingError, BackingStore, EngineKind, EngineOptions, IoBuf, IoCompletion, IoQueue, IoRequest,
    open_backing,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const FILE_BYTES: u64 = 8 << 20;

#[derive(Clone, Copy, Debug)]
struct Target {
    label: &'static str,
    direct: bool,
}

const DISK_DIRECT: Target = Target { label: "disk-direct", direct: true };
const SHM_BUFFERED: Target = Target { label: "shm-buffered", direct: false };

fn dir_for(target: Target) -> PathBuf {
    let (var, default) = if target.direct {
        ("PMCACHE_TEST_DISK_DIR", "/var/tmp")
    } else {
        ("PMCACHE_TEST_SHM_DIR", "/dev/shm")
    };
    PathBuf::from(std::env::var(var).unwrap_or_else(|_| default.into()))
}

/// A scratch file of `FILE_BYTES` filled with a seeded pattern; returns it with its contents.
fn scratch(target: Target, seed: u64) -> (tempfile::NamedTempFile, Vec<u8>) {
    let file = tempfile::NamedTempFile::new_in(dir_for(target)).expect("scratch file");
    let mut data = vec![0u8; FILE_BYTES as usize];
    SmallRng::seed_from_u64(seed).fill(&mut data[..]);
    std::fs::write(file.path(), &data).expect("fill scratch file");
    (file, data)
}

fn open(kind: EngineKind, target: Target, file: &tempfile::NamedTempFile) -> Arc<dyn BackingStore> {
    let opts = EngineOptions { sync_contexts: 4, ..EngineOptions::new(kind, target.direct) };
    match open_backing(file.path(), &opts) {
        Ok(store) => store,
        Err(e) => panic!("{kind} on {}: {e}", target.label),
    }
}

/// What the generic checks run on: an engine on a file, or an RBD image of a live cluster.
enum Subject<'a> {
    File(EngineKind, Target),
    Rbd(&'a pmcache_testkit::ceph::Cluster),
}

/// What keeps a scratch store's backing alive for a check (a file, or nothing: an image is
/// removed with its cluster).
type Keep = Option<tempfile::NamedTempFile>;

impl Subject<'_> {
    fn label(&self) -> String {
        match self {
            Subject::File(kind, target) => format!("{kind}/{}", target.label),
            Subject::Rbd(_) => "rbd".into(),
        }
    }

    fn engine(&self) -> &'static str {
        match self {
            Subject::File(kind, _) => kind.name(),
            Subject::Rbd(_) => "rbd",
        }
    }

    fn direct(&self) -> bool {
        match self {
            Subject::File(_, target) => target.direct,
            Subject::Rbd(_) => true,
        }
    }

    /// A store of `FILE_BYTES` filled with a pattern seeded by `seed`, opened, with its
    /// contents.
    fn scratch(&self, seed: u64) -> (Arc<dyn BackingStore>, Vec<u8>, Keep) {
        match self {
            Subject::File(kind, target) => {
                let (file, data) = scratch(*target, seed);
                (open(*kind, *target, &file), data, Some(file))
            }
            Subject::Rbd(cluster) => {
                let name = format!("conformance-{seed}-{}", IMAGES.fetch_add(1, Ordering::Relaxed));
                cluster.create_image(&name, &format!("{}M", FILE_BYTES >> 20));
                let store = open_backing(
                    std::path::Path::new(&cluster.spec(&name, &[])),
                    &EngineOptions::default(),
                )
                .unwrap_or_else(|e| panic!("opening image {name}: {e}"));
                let mut data = vec![0u8; FILE_BYTES as usize];
                SmallRng::seed_from_u64(seed).fill(&mut data[..]);
                store.write_at(&data, 0).expect("fill the image");
                (store, data, None)
            }
        }
    }
}

/// Images made so far (each check gets a new one).
static IMAGES: AtomicU64 = AtomicU64::new(0);

/// The targets an engine supports here. IOPOLL needs O_DIRECT and a device with poll queues
/// (a virtio disk has none unless `virtio_blk.poll_queues` is set): where the disk cannot poll,
/// the refusal itself is checked and the data tests are skipped, saying so.
fn targets(kind: EngineKind) -> Vec<Target> {
    if kind != EngineKind::IoUringIopoll {
        return vec![DISK_DIRECT, SHM_BUFFERED];
    }
    let (file, _) = scratch(DISK_DIRECT, 0);
    match open_backing(file.path(), &EngineOptions::new(kind, true)) {
        Ok(_) => vec![DISK_DIRECT],
        Err(
            err @ BackingError::Unsupported { engine: "io_uring-iopoll", option: "IOPOLL", .. },
        ) => {
            let msg = err.to_string();
            assert!(
                msg.contains("EOPNOTSUPP") && msg.contains("poll_queues"),
                "unclear refusal: {msg}"
            );
            eprintln!("skipping io_uring-iopoll data tests: {err}");
            vec![]
        }
        Err(other) => panic!("io_uring-iopoll: unexpected error {other:?}"),
    }
}

/// A random request inside the file: block-aligned under O_DIRECT, anything otherwise.
fn random_range(rng: &mut SmallRng, store: &dyn BackingStore, max_bytes: u64) -> (u64, u64) {
    let unit = if store.is_direct() { u64::from(store.logical_block_size()) } else { 1 };
    let len = rng.gen_range(1..=max_bytes / unit) * unit;
    let offset = rng.gen_range(0..=(store.size_bytes() - len) / unit) * unit;
    (offset, len)
}

/// Pushes all requests, submits, and reaps every completion, checking the counts the queue
/// reports on the way: `submit` passes at most what was pushed (and nothing the second time),
/// `reap` returns how many it appended.
fn run_batch(queue: &mut dyn IoQueue, reqs: Vec<IoRequest>) -> Vec<IoCompletion> {
    let n = reqs.len();
    for req in reqs {
        queue.push(req).expect("batch fits the queue");
    }
    assert_eq!(queue.in_flight(), n);
    assert!(queue.submit().expect("submit") <= n);
    assert_eq!(queue.submit().expect("submit again"), 0, "nothing was left to submit");
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let before = out.len();
        let got = queue.reap(n - out.len(), &mut out).expect("reap");
        assert_eq!(got, out.len() - before, "reap's count");
        assert_eq!(queue.in_flight(), n - out.len());
    }
    assert_eq!(queue.in_flight(), 0);
    out
}

fn round_trip_sync(subject: &Subject) {
    let label = subject.label();
    let (store, mut model, _scratch) = subject.scratch(1);
    assert_eq!(store.size_bytes(), FILE_BYTES);
    assert_eq!(store.engine_name(), subject.engine());
    let mut rng = SmallRng::seed_from_u64(2);
    for _ in 0..150 {
        let (offset, len) = random_range(&mut rng, &*store, 64 << 10);
        let (o, l) = (offset as usize, len as usize);
        // One byte into a Vec: deliberately unaligned, so O_DIRECT engines must bounce.
        let mut space = vec![0u8; l + 1];
        rng.fill(&mut space[1..]);
        store.write_at(&space[1..], offset).expect("write");
        model[o..o + l].copy_from_slice(&space[1..]);
        let (offset, len) = random_range(&mut rng, &*store, 64 << 10);
        let (o, l) = (offset as usize, len as usize);
        let mut back = vec![0u8; l + 1];
        store.read_at(&mut back[1..], offset).expect("read");
        assert!(back[1..] == model[o..o + l], "{label}: read at {o}+{l} differs");
    }
    let mut whole = vec![0u8; FILE_BYTES as usize];
    store.read_at(&mut whole, 0).expect("read all");
    assert!(whole == model, "{label}: file differs from the model");
    store.read_at(&mut [], 0).expect("empty read");
    store.write_at(&[], 0).expect("empty write");
}

fn round_trip_queued(subject: &Subject) {
    let label = subject.label();
    let (store, mut model, _scratch) = subject.scratch(3);
    let mut queue = store.open_queue(16).expect("queue");
    assert_eq!(queue.depth(), 16);
    let mut rng = SmallRng::seed_from_u64(4);
    let chunk = 64u64 << 10;
    let unit = if subject.direct() { u64::from(store.logical_block_size()) } else { 1 };
    for round in 0..8 {
        // Distinct 64 KiB chunks per batch, so in-flight writes never overlap.
        let mut chunks: Vec<u64> = (0..FILE_BYTES / chunk).collect();
        for i in 0..16 {
            let j = rng.gen_range(i..chunks.len());
            chunks.swap(i, j);
        }
        let ranges: Vec<(u64, u64)> = chunks[..16]
            .iter()
            .map(|&c| {
                let len = rng.gen_range(1..=chunk / unit) * unit;
                let start = c * chunk + rng.gen_range(0..=(chunk - len) / unit) * unit;
                (start, len)
            })
            .collect();
        let writes = ranges
            .iter()
            .enumerate()
            .map(|(i, &(offset, len))| {
                let mut buf = IoBuf::new(len as usize);
                rng.fill(&mut buf[..]);
                model[offset as usize..(offset + len) as usize].copy_from_slice(&buf);
                IoRequest::write(offset, buf, i as u64)
            })
            .collect();
        for c in run_batch(&mut *queue, writes) {
            c.result.unwrap_or_else(|e| panic!("{label}: round {round} write: {e}"));
        }
        let reads = ranges
            .iter()
            .enumerate()
            .map(|(i, &(offset, len))| IoRequest::read(offset, IoBuf::new(len as usize), i as u64))
            .collect();
        let mut seen = vec![false; ranges.len()];
        for c in run_batch(&mut *queue, reads) {
            c.result.unwrap_or_else(|e| panic!("{label}: read: {e}"));
            let (offset, len) = ranges[c.user_data as usize];
            assert_eq!(c.offset, offset);
            assert_eq!(c.buf.len() as u64, len);
            assert!(
                *c.buf == model[offset as usize..(offset + len) as usize],
                "{label}: queued read differs"
            );
            seen[c.user_data as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "every request completes exactly once");
    }
    // A full queue hands the request back.
    let mut queue = store.open_queue(2).expect("queue");
    for i in 0..2 {
        queue.push(IoRequest::read(0, IoBuf::new(4096), i)).expect("room");
    }
    assert!(queue.push(IoRequest::read(0, IoBuf::new(4096), 9)).is_err(), "queue of 2 takes a 3rd");
    let mut out = Vec::new();
    while out.len() < 2 {
        queue.reap(2, &mut out).expect("reap");
    }
    assert!(out.iter().all(|c| c.result.is_ok()));
}

fn misaligned_direct_is_refused(kind: EngineKind, target: Target) {
    if !target.direct {
        return;
    }
    let (file, _) = scratch(target, 5);
    let store = open(kind, target, &file);
    let block = u64::from(store.logical_block_size());
    assert!(block >= 512);
    let check = |err: BackingError| {
        assert!(matches!(err, BackingError::Misaligned { .. }), "{kind}: {err:?}");
        assert_eq!(err.errno(), libc::EINVAL);
        let msg = err.to_string();
        assert!(msg.contains(kind.name()) && msg.contains("O_DIRECT"), "unclear error: {msg}");
    };
    let mut buf = vec![0u8; block as usize];
    check(store.read_at(&mut buf, 1).unwrap_err());
    check(store.write_at(&buf[..100], 0).unwrap_err());
    let mut queue = store.open_queue(4).expect("queue");
    let out =
        run_batch(&mut *queue, vec![IoRequest::read(block + 1, IoBuf::new(block as usize), 7)]);
    assert_eq!(out[0].user_data, 7);
    check(out.into_iter().next().unwrap().result.unwrap_err());
}

fn short_read_is_reported(kind: EngineKind, target: Target) {
    let (file, _) = scratch(target, 6);
    let store = open(kind, target, &file);
    // The file shrinks behind the store's back: a read across the new end is short.
    let half = FILE_BYTES / 2;
    file.as_file().set_len(half).expect("truncate");
    let mut buf = vec![0u8; 8192];
    match store.read_at(&mut buf, half - 4096) {
        Err(BackingError::ShortRead { offset, len, got }) => {
            assert_eq!((offset, len, got), (half - 4096, 8192, 4096), "{kind}/{}", target.label);
        }
        other => panic!("{kind}/{}: expected a short read, got {other:?}", target.label),
    }
    let mut queue = store.open_queue(4).expect("queue");
    let out = run_batch(
        &mut *queue,
        vec![
            IoRequest::read(half - 4096, IoBuf::new(8192), 1),
            IoRequest::read(half + 4096, IoBuf::new(4096), 2),
            IoRequest::read(0, IoBuf::new(4096), 3),
        ],
    );
    for c in out {
        match (c.user_data, c.result) {
            (1, Err(BackingError::ShortRead { got: 4096, .. })) => {}
            (2, Err(BackingError::ShortRead { got: 0, .. })) => {}
            (3, Ok(())) => {}
            (id, r) => panic!("{kind}/{}: request {id}: {r:?}", target.label),
        }
    }
}

fn errors_carry_errno(kind: EngineKind, target: Target) {
    let (file, _) = scratch(target, 7);
    let opts = EngineOptions {
        read_only: true,
        sync_contexts: 2,
        ..EngineOptions::new(kind, target.direct)
    };
    let store = open_backing(file.path(), &opts).expect("open read-only");
    let buf = IoBuf::new(4096);
    let err = store.write_at(&buf, 0).unwrap_err();
    assert_eq!(err.errno(), libc::EBADF, "{kind}/{}: {err}", target.label);
    let mut queue = store.open_queue(4).expect("queue");
    let out = run_batch(
        &mut *queue,
        vec![IoRequest::write(0, IoBuf::new(4096), 1), IoRequest::read(4096, IoBuf::new(4096), 2)],
    );
    for c in out {
        match c.user_data {
            1 => {
                let err = c.result.unwrap_err();
                assert_eq!(err.errno(), libc::EBADF, "{kind}: queued write");
                assert!(
                    matches!(err, BackingError::Io { op: "write", offset: 0, len: 4096, .. }),
                    "{kind}: {err:?}"
                );
            }
            _ => c.result.expect("a read on a read-only store works"),
        }
    }
    let err = store.read_at(&mut [0u8; 4096], FILE_BYTES).unwrap_err();
    assert!(matches!(err, BackingError::OutOfRange { .. }));
    assert_eq!(err.errno(), libc::EINVAL);
}

/// A store says how it was opened: its engine's `--engine` name, whether it bypasses the page
/// cache, its I/O unit (512 bytes buffered; a power of two of at least 512 with `O_DIRECT`),
/// and an identity of its size and canonical path — the same through another path to the
/// same file, another for another file.
fn says_how_it_was_opened(kind: EngineKind, target: Target) {
    let (file, _) = scratch(target, 12);
    let store = open(kind, target, &file);
    let label = format!("{kind}/{}", target.label);
    assert_eq!(store.engine_name(), kind.name(), "{label}");
    assert_eq!(store.is_direct(), target.direct, "{label}");
    let unit = store.logical_block_size();
    if target.direct {
        assert!(unit >= 512 && unit.is_power_of_two(), "{label}: unit {unit}");
    } else {
        assert_eq!(unit, 512, "{label}");
    }
    assert_eq!(store.size_bytes(), FILE_BYTES, "{label}");
    let identity = store.identity();
    assert_eq!(identity.size_bytes, FILE_BYTES, "{label}");
    let dir = file.path().parent().expect("in a directory");
    let name = file.path().file_name().expect("named");
    let roundabout = dir.join(".").join(name);
    let opts = EngineOptions { sync_contexts: 4, ..EngineOptions::new(kind, target.direct) };
    let again = open_backing(&roundabout, &opts).expect("the same file by another path");
    assert_eq!(again.identity(), identity, "{label}: the same file");
    let (other, _) = scratch(target, 13);
    assert_ne!(open(kind, target, &other).identity().fingerprint, identity.fingerprint, "{label}");
}

/// A queue dropped with requests in flight or completed but not reaped waits for the kernel
/// and closes; the store's next queue (which may reuse its ring or context) sees none of
/// their completions. A request that fails validation is reaped like any other, with its
/// operation named.
fn a_queue_dropped_unreaped_leaves_nothing_behind(subject: &Subject) {
    let label = subject.label();
    let (store, data, _scratch) = subject.scratch(14);
    let unit = u64::from(store.logical_block_size());
    for reaped in [0, 1, 4] {
        let mut queue = store.open_queue(8).expect("queue");
        for i in 0..4u64 {
            queue.push(IoRequest::read(i * 4096, IoBuf::new(4096), 100 + i)).expect("push");
        }
        queue.push(IoRequest::read(FILE_BYTES, IoBuf::new(4096), 200)).expect("push");
        queue.submit().expect("submit");
        let mut out = Vec::new();
        while out.len() < reaped {
            queue.reap(reaped - out.len(), &mut out).expect("reap");
        }
        drop(queue);
    }
    let mut queue = store.open_queue(8).expect("a queue after the dropped ones");
    let out = run_batch(
        &mut *queue,
        vec![
            IoRequest::read(unit, IoBuf::new(4096), 1),
            IoRequest::write(FILE_BYTES - unit, IoBuf::new(2 * unit as usize), 2),
        ],
    );
    assert_eq!(out.len(), 2, "{label}: only this batch's completions");
    for c in out {
        match c.user_data {
            1 => {
                c.result.expect("read");
                assert_eq!(&c.buf[..], &data[unit as usize..unit as usize + 4096]);
            }
            2 => {
                let err = c.result.unwrap_err();
                assert!(
                    matches!(err, BackingError::OutOfRange { op: "write", .. }),
                    "{label}: {err:?}"
                );
            }
            other => panic!("{label}: a completion of an earlier queue: {other}"),
        }
    }
}

/// A caller that polls with `reap(0)` and never waits (an event loop polling several sources)
/// gets every completion: `reap(0)` enters the kernel itself where the ring needs that to post
/// them (deferred or cooperative task work, IOPOLL), and libaio collects without waiting.
fn a_poller_that_never_waits_gets_every_completion(subject: &Subject) {
    let label = subject.label();
    let (store, data, _scratch) = subject.scratch(15);
    let mut queue = store.open_queue(8).expect("queue");
    for i in 0..4u64 {
        queue.push(IoRequest::read(i * 8192, IoBuf::new(4096), i)).expect("push");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut out = Vec::new();
    let mut polls = 0u64;
    while out.len() < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "{label}: {} of 4 completions after {polls} polls of reap(0) in 10 s",
            out.len()
        );
        queue.reap(0, &mut out).expect("reap(0)");
        polls += 1;
    }
    assert_eq!(queue.in_flight(), 0);
    for c in out {
        c.result.expect("read");
        let at = c.user_data as usize * 8192;
        assert!(c.buf[..] == data[at..at + 4096], "{label}: read {at} differs");
    }
}

fn many_in_flight_from_threads(subject: &Subject) {
    let label = subject.label();
    const THREADS: u64 = 4;
    const BLOCKS_PER_THREAD: u64 = 256;
    const BLOCK: u64 = 4096;
    let (store, _, _scratch) = subject.scratch(8);
    let region = FILE_BYTES / (THREADS + 2) / BLOCK * BLOCK;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (store, label) = (store.clone(), &label);
            s.spawn(move || {
                let mut queue = store.open_queue(32).expect("queue");
                let base = t * region;
                let stamp = |b: u64| (t * 1_000_003 + b) as u8;
                let mut out = Vec::with_capacity(32);
                for pass in 0..2 {
                    let (mut next, mut done) = (0u64, 0u64);
                    while done < BLOCKS_PER_THREAD {
                        while next < BLOCKS_PER_THREAD && queue.in_flight() < queue.depth() {
                            let offset = base + next * BLOCK;
                            let req = if pass == 0 {
                                let mut buf = IoBuf::new(BLOCK as usize);
                                buf.fill(stamp(next));
                                IoRequest::write(offset, buf, next)
                            } else {
                                IoRequest::read(offset, IoBuf::new(BLOCK as usize), next)
                            };
                            queue.push(req).expect("room below depth");
                            next += 1;
                        }
                        queue.submit().expect("submit");
                        out.clear();
                        queue.reap(1, &mut out).expect("reap");
                        for c in &out {
                            assert!(c.result.is_ok(), "{label}: {:?}", c.result);
                            if pass == 1 {
                                assert!(
                                    c.buf.iter().all(|&b| b == stamp(c.user_data)),
                                    "{label}: thread {t}"
                                );
                            }
                        }
                        done += out.len() as u64;
                    }
                }
            });
        }
        // Two more threads use the synchronous calls at the same time.
        for t in THREADS..THREADS + 2 {
            let (store, label) = (store.clone(), &label);
            s.spawn(move || {
                let base = t * region;
                for b in 0..64u64 {
                    let data = vec![(t + b) as u8; BLOCK as usize];
                    store.write_at(&data, base + b * BLOCK).expect("sync write");
                }
                for b in 0..64u64 {
                    let mut back = vec![0u8; BLOCK as usize];
                    store.read_at(&mut back, base + b * BLOCK).expect("sync read");
                    assert!(back.iter().all(|&x| x == (t + b) as u8), "{label}: sync thread {t}");
                }
            });
        }
    });
}

fn flush_discard_and_zeroes(subject: &Subject) {
    let label = subject.label();
    let (store, _, _scratch) = subject.scratch(9);
    store.flush().expect("flush");
    let mut queue = store.open_queue(4).expect("queue");
    let out =
        run_batch(&mut *queue, vec![IoRequest::write(0, IoBuf::new(4096), 1), IoRequest::flush(2)]);
    assert!(out.iter().all(|c| c.result.is_ok()), "{label}: {out:?}");
    let ones = vec![0xA5u8; 256 << 10];
    store.write_at(&ones, 1 << 20).expect("write");
    store.discard((1 << 20) + (64 << 10), 64 << 10).expect("discard");
    store.write_zeroes((1 << 20) + (192 << 10), 32 << 10).expect("write_zeroes");
    let mut back = vec![0u8; 256 << 10];
    store.read_at(&mut back, 1 << 20).expect("read");
    let zero = |r: std::ops::Range<usize>| back[r].iter().all(|&b| b == 0);
    let kept = |r: std::ops::Range<usize>| back[r].iter().all(|&b| b == 0xA5);
    assert!(kept(0..64 << 10), "{label}: bytes before the discard changed");
    assert!(zero((64 << 10)..(128 << 10)), "{label}: discarded range is not zero");
    assert!(kept((128 << 10)..(192 << 10)), "{label}: bytes between changed");
    assert!(zero((192 << 10)..(224 << 10)), "{label}: write_zeroes range is not zero");
    assert!(kept((224 << 10)..(256 << 10)), "{label}: bytes after changed");
    assert!(store.discard(FILE_BYTES, 4096).is_err(), "discard past the end");
}

/// A deep queue kept full for many requests: completions can overtake SQ bookkeeping (an
/// SQPOLL thread completes inline before it publishes the SQ head), which must not matter.
fn deep_queue_stays_full(subject: &Subject) {
    let label = subject.label();
    let (store, model, _scratch) = subject.scratch(12);
    let mut queue = store.open_queue(64).expect("queue");
    let mut rng = SmallRng::seed_from_u64(13);
    let blocks = FILE_BYTES / 4096;
    let (mut issued, mut done) = (0u64, 0u64);
    let mut out = Vec::new();
    while done < 20_000 {
        while issued < 20_000 && queue.in_flight() < queue.depth() {
            let offset = rng.gen_range(0..blocks) * 4096;
            queue.push(IoRequest::read(offset, IoBuf::new(4096), offset)).expect("room");
            issued += 1;
        }
        out.clear();
        queue.reap(1, &mut out).expect("reap");
        for c in &out {
            assert!(c.result.is_ok(), "{label}: {:?}", c.result);
            let o = c.user_data as usize;
            assert!(*c.buf == model[o..o + 4096], "{label}: read at {o} differs");
        }
        done += out.len() as u64;
    }
}

macro_rules! conformance {
    ($($module:ident => $kind:expr),* $(,)?) => {$(
        mod $module {
            use super::*;
            #[test]
            fn round_trip_sync_unaligned_buffers() {
                for t in targets($kind) { super::round_trip_sync(&Subject::File($kind, t)) }
            }
            #[test]
            fn round_trip_queued() {
                for t in targets($kind) { super::round_trip_queued(&Subject::File($kind, t)) }
            }
            #[test]
            fn misaligned_direct_is_refused() {
                for t in targets($kind) { super::misaligned_direct_is_refused($kind, t) }
            }
            #[test]
            fn short_read_is_reported() {
                for t in targets($kind) { super::short_read_is_reported($kind, t) }
            }
            #[test]
            fn errors_carry_errno() {
                for t in targets($kind) { super::errors_carry_errno($kind, t) }
            }
            #[test]
            fn says_how_it_was_opened() {
                for t in targets($kind) { super::says_how_it_was_opened($kind, t) }
            }
            #[test]
            fn a_queue_dropped_unreaped_leaves_nothing_behind() {
                for t in targets($kind) {
                    super::a_queue_dropped_unreaped_leaves_nothing_behind(&Subject::File($kind, t))
                }
            }
            #[test]
            fn a_poller_that_never_waits_gets_every_completion() {
                for t in targets($kind) {
                    super::a_poller_that_never_waits_gets_every_completion(&Subject::File($kind, t))
                }
            }
            #[test]
            fn many_in_flight_from_threads() {
                for t in targets($kind) { super::many_in_flight_from_threads(&Subject::File($kind, t)) }
            }
            #[test]
            fn deep_queue_stays_full() {
                for t in targets($kind) { super::deep_queue_stays_full(&Subject::File($kind, t)) }
            }
            #[test]
            fn flush_discard_and_zeroes() {
                for t in targets($kind) { super::flush_discard_and_zeroes(&Subject::File($kind, t)) }
            }
        }
    )*};
}

conformance! {
    psync => EngineKind::Psync,
    pvsync2 => EngineKind::Pvsync2,
    pvsync2_hipri => EngineKind::Pvsync2Hipri,
    libaio => EngineKind::Libaio,
    io_uring => EngineKind::IoUring,
    io_uring_iopoll => EngineKind::IoUringIopoll,
    io_uring_sqpoll => EngineKind::IoUringSqpoll,
}

/// Combinations the kernel or file cannot do are refused with the engine, option and reason.
#[test]
fn unsupported_combinations_are_named() {
    let (file, _) = scratch(SHM_BUFFERED, 10);
    let err = open_backing(file.path(), &EngineOptions::new(EngineKind::IoUringIopoll, false))
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(matches!(err, BackingError::Unsupported { option: "IOPOLL", .. }), "{err:?}");
    assert!(msg.contains("io_uring-iopoll") && msg.contains("O_DIRECT"), "{msg}");
    assert_eq!(err.errno(), libc::EOPNOTSUPP);
    // tmpfs: either no O_DIRECT at all (older kernels) or no polled completion.
    let err = open_backing(file.path(), &EngineOptions::new(EngineKind::IoUringIopoll, true))
        .err()
        .expect("refused");
    match &err {
        BackingError::Unsupported {
            engine: "io_uring-iopoll",
            option: "IOPOLL" | "O_DIRECT",
            ..
        } => {}
        other => panic!("expected a named refusal, got {other:?}"),
    }
}

/// IOPOLL is refused on a file whose device cannot poll even when the file has no data yet
/// (made by `truncate`, or past its end): a read of a hole never reaches the device, so a
/// probe that only reads could pass there and leave every later write to fail.
#[test]
fn io_uring_iopoll_opens_over_holes_only_where_the_device_polls() {
    let written = match targets(EngineKind::IoUringIopoll).is_empty() {
        true => "refused",
        false => "accepted",
    };
    for len in [FILE_BYTES, 0] {
        let file = tempfile::NamedTempFile::new_in(dir_for(DISK_DIRECT)).expect("scratch file");
        file.as_file().set_len(len).expect("sparse length");
        let opened =
            open_backing(file.path(), &EngineOptions::new(EngineKind::IoUringIopoll, true));
        match (written, opened) {
            ("refused", Err(BackingError::Unsupported { option: "IOPOLL", reason, .. })) => {
                // Here the refusal comes from sysfs, naming the device, whose queue cannot
                // poll; a file system without one block device says it has nothing to probe.
                let dev = std::fs::metadata(file.path()).expect("stat").dev();
                let device = format!("{}:{}", libc::major(dev), libc::minor(dev));
                assert!(
                    reason.contains(&format!("block device {device}, whose queue cannot poll"))
                        || reason.contains("holds no data to probe polled I/O with"),
                    "{reason}"
                );
            }
            ("refused", Ok(_)) => panic!(
                "a {len}-byte sparse file on a device that cannot poll was accepted for IOPOLL"
            ),
            ("accepted", Ok(_)) => {}
            (written, other) => panic!(
                "{len}-byte sparse file (a written one was {written}): {:?}",
                other.map(|store| store.engine_name())
            ),
        }
    }
}

/// Run out of file descriptors, io_uring's setup fails with `EMFILE`: a resource error that
/// keeps the errno, not "io_uring is not supported here" (which would also make the default
/// engine fall back to psync, silently, for a passing shortage). Runs in a child process,
/// since the descriptor limit is the whole process's.
#[test]
fn a_ring_without_descriptors_is_a_resource_error() {
    const CHILD: &str = "PMCACHE_TEST_NOFILE_CHILD";
    let name = "a_ring_without_descriptors_is_a_resource_error";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .expect("run the child");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "child failed:\n{text}");
        return;
    }
    let (file, _) = scratch(DISK_DIRECT, 16);
    let store = open(EngineKind::IoUring, DISK_DIRECT, &file);
    // Every descriptor below a low limit taken, then one given back: enough to open the file,
    // none left for the ring.
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit write and read the struct passed, which lives on the stack.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_cur.min(256);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
    let mut held = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        held.push(f);
    }
    let err = match store.open_queue(8) {
        Err(err) => err,
        Ok(_) => panic!("a queue's ring was created with no descriptor free"),
    };
    assert!(matches!(err, BackingError::NoResources { engine: "io_uring", .. }), "{err:?}");
    assert_eq!(err.errno(), libc::EMFILE, "{err}");
    assert!(err.to_string().contains("create a ring of depth 8"), "{err}");
    held.pop();
    let opts = EngineOptions::default();
    let err = match open_backing(file.path(), &opts) {
        Err(err) => err,
        Ok(store) => panic!("opened with {} and no descriptor for its ring", store.engine_name()),
    };
    assert!(matches!(err, BackingError::NoResources { engine: "io_uring", .. }), "{err:?}");
    assert_eq!(err.errno(), libc::EMFILE, "{err}");
}

/// An SQPOLL ring's kernel thread goes to sleep after a second without work; the next
/// request must wake it (`IORING_SQ_NEED_WAKEUP`), for queued and synchronous calls alike,
/// rather than sit in the SQ. Each wait is bounded by a watchdog so a regression fails.
#[test]
fn sqpoll_wakes_its_sleeping_thread() {
    for target in [DISK_DIRECT, SHM_BUFFERED] {
        let (file, data) = scratch(target, 17);
        let store = open(EngineKind::IoUringSqpoll, target, &file);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            let mut queue = store.open_queue(4).expect("queue");
            // Longer than the thread's idle time (1 s): it is asleep when the request comes.
            std::thread::sleep(std::time::Duration::from_millis(1500));
            queue.push(IoRequest::read(4096, IoBuf::new(4096), 1)).expect("push");
            let mut out = Vec::new();
            while out.is_empty() {
                queue.reap(1, &mut out).expect("reap");
            }
            let c = out.pop().expect("completion");
            done_tx.send((c.offset, c.result.map(|()| c.buf.to_vec()))).expect("report");
            std::thread::sleep(std::time::Duration::from_millis(1500));
            let mut buf = IoBuf::new(4096);
            let read = store.read_at(&mut buf, 8192).map(|()| buf.to_vec());
            done_tx.send((8192, read)).expect("report");
        });
        for _ in 0..2 {
            let (at, read) =
                done_rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap_or_else(|e| {
                    panic!("SQPOLL/{}: no completion within 10 s: {e}", target.label)
                });
            let at = at as usize;
            let back = read.unwrap_or_else(|e| panic!("SQPOLL/{}: read {at}: {e}", target.label));
            assert!(back[..] == data[at..at + 4096], "SQPOLL/{}: read {at} differs", target.label);
        }
        worker.join().expect("worker");
    }
}

/// A dropped libaio queue gives its context back (`io_destroy`): opening and dropping queues
/// whose event reservations add up to several times the system's limit
/// (`/proc/sys/fs/aio-max-nr`) keeps working. With the context leaked, `io_setup` fails
/// with `EAGAIN` once the limit is reached.
#[test]
fn libaio_queues_give_their_events_back() {
    let max_nr: u64 = std::fs::read_to_string("/proc/sys/fs/aio-max-nr")
        .expect("aio-max-nr")
        .trim()
        .parse()
        .expect("a number");
    const DEPTH: u64 = 4096;
    // The kernel reserves at least twice the depth per context.
    let rounds = (4 * max_nr / (2 * DEPTH) + 1).min(600);
    let (file, _) = scratch(SHM_BUFFERED, 18);
    let store = open(EngineKind::Libaio, SHM_BUFFERED, &file);
    for round in 0..rounds {
        match store.open_queue(DEPTH as usize) {
            Ok(queue) => drop(queue),
            Err(e) => panic!("queue {round} of {rounds} (aio-max-nr {max_nr}): {e}"),
        }
    }
}

/// Defaults: a regular file on a file system with O_DIRECT gets io_uring + O_DIRECT.
#[test]
fn defaults_per_device() {
    let (file, _) = scratch(DISK_DIRECT, 11);
    let resolved = pmcache_backing::resolve_engine(file.path(), &EngineOptions::default()).unwrap();
    assert_eq!(resolved.engine, EngineKind::IoUring);
    assert_eq!(resolved.device, pmcache_backing::DeviceKind::RegularFile);
    let store = open_backing(file.path(), &EngineOptions::default()).unwrap();
    assert_eq!(store.engine_name(), "io_uring");
    assert_eq!(store.is_direct(), resolved.direct);
    // The default count of kernel contexts serves I/O from several threads at once.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let store = &store;
            s.spawn(move || {
                let mut buf = IoBuf::new(4096);
                store.read_at(&mut buf, t * 4096).expect("read with default contexts");
            });
        }
    });
}

/// A loop device over a scratch file on the disk, with the given logical sector size;
/// detached (and its file removed) on drop.
struct LoopDevice {
    path: PathBuf,
    _file: tempfile::NamedTempFile,
}

impl LoopDevice {
    fn attach(sector_bytes: u32, contents: &[u8]) -> Result<Self, String> {
        let file =
            tempfile::NamedTempFile::new_in(dir_for(DISK_DIRECT)).map_err(|e| e.to_string())?;
        std::fs::write(file.path(), contents).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("losetup")
            .args(["--find", "--show", "--sector-size", &sector_bytes.to_string()])
            .arg(file.path())
            .output()
            .map_err(|e| format!("losetup (`apt-get install -y mount`): {e}"))?;
        if !out.status.success() {
            return Err(format!("losetup: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Ok(Self { path, _file: file })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").arg("-d").arg(&self.path).status();
    }
}

/// Every engine on a real block device (a loop device with 512- and 4096-byte sectors):
/// `O_DIRECT` by default, the device's sector as its unit (`BLKSSZGET`), data round trips
/// with aligned and unaligned buffers, misaligned requests refused, `BLKZEROOUT` and
/// `BLKDISCARD` for write-zeroes and discard. Skipped, saying so, where no loop device can
/// be attached (CI runs as root with `losetup`).
#[test]
fn block_devices() {
    let mut rng = SmallRng::seed_from_u64(15);
    let mut contents = vec![0u8; FILE_BYTES as usize];
    rng.fill(&mut contents[..]);
    for sector in [512u32, 4096] {
        let device = match LoopDevice::attach(sector, &contents) {
            Ok(device) => device,
            Err(reason) => {
                eprintln!("skipping block device tests: {reason}");
                return;
            }
        };
        let resolved = pmcache_backing::resolve_engine(&device.path, &EngineOptions::default())
            .expect("resolve");
        assert_eq!(resolved.device, pmcache_backing::DeviceKind::BlockDevice);
        assert!(resolved.direct, "a block device defaults to O_DIRECT");
        let unit = u64::from(sector);
        for kind in EngineKind::ALL {
            let label = format!("{kind} on {} ({sector}-byte sectors)", device.path.display());
            let opts = EngineOptions { sync_contexts: 2, ..EngineOptions::new(kind, true) };
            let store = match open_backing(&device.path, &opts) {
                Ok(store) => store,
                Err(err @ BackingError::Unsupported { option: "IOPOLL", .. })
                    if kind == EngineKind::IoUringIopoll =>
                {
                    eprintln!("{label}: {err}");
                    continue;
                }
                Err(err) => panic!("{label}: {err}"),
            };
            assert_eq!(store.logical_block_size(), sector, "{label}");
            assert_eq!(store.size_bytes(), FILE_BYTES, "{label}");
            assert!(store.is_direct(), "{label}");
            let at = rng.gen_range(0..FILE_BYTES / unit - 4) * unit;
            let mut back = vec![0u8; 2 * sector as usize + 1];
            store.read_at(&mut back[1..], at).expect("an unaligned buffer is bounced");
            assert_eq!(&back[1..], &contents[at as usize..(at + 2 * unit) as usize], "{label}");
            let mut fresh = IoBuf::new(2 * sector as usize);
            rng.fill(&mut fresh[..]);
            store.write_at(&fresh, at).expect("write");
            let mut again = IoBuf::new(2 * sector as usize);
            store.read_at(&mut again, at).expect("read");
            assert_eq!(&again[..], &fresh[..], "{label}");
            let half = unit / 2;
            for (offset, len) in [(at + half, unit), (at, unit + half)] {
                let err = store.write_at(&vec![0u8; len as usize], offset).unwrap_err();
                assert!(matches!(err, BackingError::Misaligned { .. }), "{label}: {err:?}");
            }
            let err = store.write_zeroes(at + half, unit).unwrap_err();
            assert!(matches!(err, BackingError::Misaligned { .. }), "{label}: {err:?}");
            store.write_zeroes(at, unit).expect("BLKZEROOUT");
            store.read_at(&mut again, at).expect("read");
            assert!(again[..sector as usize].iter().all(|&b| b == 0), "{label}: zeroed");
            assert_eq!(&again[sector as usize..], &fresh[sector as usize..], "{label}: the rest");
            store.discard(at + unit, unit).expect("BLKDISCARD");
            let err = store.discard(at + half, unit).unwrap_err();
            assert!(matches!(err, BackingError::Misaligned { .. }), "{label}: {err:?}");
            store.flush().expect("flush");
            contents[at as usize..(at + 2 * unit) as usize].copy_from_slice(&fresh);
            contents[at as usize..(at + unit) as usize].fill(0);
            // The discarded sector's contents are unspecified: take them as they read now.
            let mut discarded = IoBuf::new(sector as usize);
            store.read_at(&mut discarded, at + unit).expect("read");
            contents[(at + unit) as usize..(at + 2 * unit) as usize].copy_from_slice(&discarded);
        }
    }
}

/// An io_uring queue's completion descriptor wakes a thread that sleeps in `poll` when a read
/// completes — on a disk file (O_DIRECT, completed by interrupt) and on tmpfs (every read
/// handed to an io-wq worker, its completion work deferred to the submitting thread) — and
/// the next `reap` takes the read; with nothing in flight, a reap quiets the descriptor.
#[test]
fn io_uring_completion_descriptor_wakes_a_poller() {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    for target in [DISK_DIRECT, SHM_BUFFERED] {
        let (file, data) = scratch(target, 9);
        let store = open(EngineKind::IoUring, target, &file);
        let mut queue = store.open_queue(4).expect("queue");
        for round in 0..3u64 {
            let offset = round * 4096;
            queue.push(IoRequest::read(offset, IoBuf::new(4096), round)).expect("room");
            queue.submit().expect("submit");
            let fd = queue.completion_fd().expect("a completion descriptor");
            let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
            let limit = Timespec { tv_sec: 10, tv_nsec: 0 };
            let ready = poll(&mut fds, Some(&limit)).expect("poll");
            assert_eq!(ready, 1, "{}: no wake-up for read {round} within 10 s", target.label);
            let mut done = Vec::new();
            queue.reap(1, &mut done).expect("reap");
            assert_eq!(done.len(), 1);
            assert!(done[0].result.is_ok());
            assert_eq!(done[0].buf[..], data[offset as usize..offset as usize + 4096]);
            // The reap's own completion work may signal once more (a wake-up that finds
            // nothing); a reap with nothing in flight leaves it quiet.
            assert_eq!(queue.reap(0, &mut done).expect("reap"), 0);
            let fd = queue.completion_fd().expect("a completion descriptor");
            let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
            let now = Timespec { tv_sec: 0, tv_nsec: 0 };
            assert_eq!(poll(&mut fds, Some(&now)).expect("poll"), 0, "quiet after the reaps");
        }
    }
}

/// A completion that arrives after a submit ran the completion work before it (posting a CQE
/// the next reap finds) still makes the completion descriptor readable after that reap: a
/// reap never leaves completion work pending behind a drained descriptor.
#[test]
fn io_uring_completion_descriptor_is_readable_for_work_left_behind_a_reap() {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let settle = || std::thread::sleep(std::time::Duration::from_millis(30));
    for target in [DISK_DIRECT, SHM_BUFFERED] {
        let (file, data) = scratch(target, 12);
        let store = open(EngineKind::IoUring, target, &file);
        let mut queue = store.open_queue(4).expect("queue");
        for round in 0..4u64 {
            let (a, b) = (round * 8192, round * 8192 + 4096);
            queue.push(IoRequest::read(a, IoBuf::new(4096), a)).expect("room");
            queue.submit().expect("submit");
            settle(); // A's completion waits as completion work.
            queue.push(IoRequest::read(b, IoBuf::new(4096), b)).expect("room");
            queue.submit().expect("submit"); // Runs A's work: A's CQE is posted.
            settle(); // B's completion waits as completion work.
            let mut done = Vec::new();
            while done.len() < 2 {
                let fd = queue.completion_fd().expect("a completion descriptor");
                let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
                let limit = Timespec { tv_sec: 5, tv_nsec: 0 };
                let ready = poll(&mut fds, Some(&limit)).expect("poll");
                assert_eq!(
                    ready,
                    1,
                    "{}: round {round}: no wake-up within 5 s with {} of 2 reads reaped",
                    target.label,
                    done.len()
                );
                queue.reap(0, &mut done).expect("reap");
            }
            for c in &done {
                assert!(c.result.is_ok(), "{}: {:?}", target.label, c.result);
                let offset = c.user_data as usize;
                assert_eq!(c.buf[..], data[offset..offset + 4096], "{}", target.label);
            }
        }
    }
}

/// A caller that waits only on the completion descriptor and reaps with `min` 0, pushing new
/// reads as old ones complete (an NBD connection with reads in flight), gets every
/// completion: the descriptor stays readable while completion work is left to run, whether
/// that work came before or after the caller's last submit.
#[test]
fn io_uring_completion_descriptor_stays_readable_until_every_completion_is_reaped() {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    const DEPTH: usize = 32;
    const READS: u64 = 20_000;
    let blocks = FILE_BYTES / 4096;
    for target in [DISK_DIRECT, SHM_BUFFERED] {
        let (file, data) = scratch(target, 11);
        let store = open(EngineKind::IoUring, target, &file);
        let mut queue = store.open_queue(DEPTH).expect("queue");
        let (mut sent, mut reaped) = (0u64, 0u64);
        let mut done = Vec::new();
        while reaped < READS {
            while sent < READS && queue.in_flight() < DEPTH {
                let offset = (sent.wrapping_mul(0x9e37_79b9) % blocks) * 4096;
                queue.push(IoRequest::read(offset, IoBuf::new(4096), offset)).expect("room");
                sent += 1;
                if sent % 3 == 0 {
                    // Submitting enters the ring, which runs the completion work there is.
                    queue.submit().expect("submit");
                }
            }
            queue.submit().expect("submit");
            let fd = queue.completion_fd().expect("a completion descriptor");
            let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
            let limit = Timespec { tv_sec: 10, tv_nsec: 0 };
            let ready = poll(&mut fds, Some(&limit)).expect("poll");
            assert_eq!(
                ready,
                1,
                "{}: no wake-up within 10 s with {reaped} of {READS} reads reaped and {} in \
                 flight",
                target.label,
                queue.in_flight()
            );
            done.clear();
            queue.reap(0, &mut done).expect("reap");
            for c in &done {
                assert!(c.result.is_ok(), "{}: {:?}", target.label, c.result);
                let offset = c.user_data as usize;
                assert_eq!(c.buf[..], data[offset..offset + 4096], "{}", target.label);
            }
            reaped += done.len() as u64;
        }
    }
}

/// The generic checks on an RBD image of a throwaway single-host cluster (one monitor, one OSD:
/// scripts/ceph/cluster.sh), one image per check.
#[test]
fn rbd_image() {
    let cluster = pmcache_testkit::ceph::Cluster::start();
    let subject = Subject::Rbd(&cluster);
    round_trip_sync(&subject);
    round_trip_queued(&subject);
    a_queue_dropped_unreaped_leaves_nothing_behind(&subject);
    a_poller_that_never_waits_gets_every_completion(&subject);
    many_in_flight_from_threads(&subject);
    flush_discard_and_zeroes(&subject);
    deep_queue_stays_full(&subject);
}
