//! Test doubles and harnesses that run the production engine: a simulated backing store with a volatile
//! write cache that loses un-flushed writes at a power cut, and fault injection.

#[cfg(all(test, not(feature = "shuttle")))]
pub(crate) mod full_buckets;
pub mod hooked;
pub mod latched;
pub mod model;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pmcache_backing::{BackingError, BackingIdentity, BackingStore};
use pmcache_media::CrashSwitch;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Cases a property test runs: `default`, unless `PROPTEST_CASES` says otherwise (CI keeps the
/// defaults; a longer campaign sets the variable, as proptest's own default config would).
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The stripe (lock) that block `lba` of `engine` falls in: tests build groups whose writes
/// share stripes with it.
pub fn stripe_of<M: pmcache_media::Medium, B: BackingStore, C: crate::Clock>(
    engine: &crate::Engine<M, B, C>,
    lba: u64,
) -> usize {
    engine.stripe_index(lba)
}

/// Sector size of the simulated device: its unit of failure atomicity. A quarter of the
/// model's cache block ([`model::BLOCK`]), as a 4 KiB cache block spans eight 512-byte
/// sectors of a real disk: a block's backing write cut by a power loss can leave any mix of
/// its sectors old and new.
pub const SIM_SECTOR_BYTES: usize = 128;

struct Inner {
    volatile: Mutex<Vec<u8>>,
    durable: Mutex<Vec<u8>>,
    /// Writes since the last flush, in order: (offset, data).
    unflushed: Mutex<Vec<(u64, Vec<u8>)>>,
    crash_image: Mutex<Option<Vec<u8>>>,
    rng: Mutex<SmallRng>,
    switch: Arc<CrashSwitch>,
    fingerprint: [u8; 16],
    fail_writes_from: AtomicU64,
    fail_reads_from: AtomicU64,
    /// Writes overlapping `start..end` (bytes) fail, whatever their count.
    fail_writes_in: Mutex<Vec<std::ops::Range<u64>>>,
    /// Flushes fail (without making anything durable) while set.
    fail_flushes: std::sync::atomic::AtomicBool,
    /// What `failed_flush_loses_writes` answers (true, as a file; false, as an RBD image).
    failed_flush_loses_writes: std::sync::atomic::AtomicBool,
    /// `open_queue` gives a queue (requests run one by one as it submits them, their
    /// completions handed back in reverse order): the engine's queued paths — the cleaner's
    /// pipelined batches, a batch's read misses in flight — then run here, out of order.
    queued: std::sync::atomic::AtomicBool,
    writes: AtomicU64,
    reads: AtomicU64,
    flushes: AtomicU64,
}

impl Inner {
    /// Durable image plus a random subset of un-flushed writes, applied in order, each kept
    /// or lost per sector (a write's pieces split at the device's sector boundaries).
    fn power_cut_image(&self) -> Vec<u8> {
        let mut image = self.durable.lock().expect("poisoned").clone();
        let unflushed = self.unflushed.lock().expect("poisoned");
        let mut rng = self.rng.lock().expect("poisoned");
        for (offset, data) in unflushed.iter() {
            let (start, end) = (*offset as usize, *offset as usize + data.len());
            let mut at = start;
            while at < end {
                let piece_end = ((at / SIM_SECTOR_BYTES + 1) * SIM_SECTOR_BYTES).min(end);
                if rng.gen_bool(0.5) {
                    image[at..piece_end].copy_from_slice(&data[at - start..piece_end - start]);
                }
                at = piece_end;
            }
        }
        image
    }
}

/// An in-memory backing store with a volatile write cache (flush makes writes durable), cut
/// by the same [`CrashSwitch`] as a crash-simulating medium. Cloning shares the device.
#[derive(Clone)]
pub struct SimBacking {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SimBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBacking").field("size_bytes", &self.size_bytes()).finish()
    }
}

impl SimBacking {
    /// A zeroed device of `size_bytes`.
    pub fn new(size_bytes: u64, switch: Arc<CrashSwitch>, seed: u64) -> Self {
        Self::from_image(vec![0; size_bytes as usize], switch, seed)
    }

    /// A device holding `image` durably (what a power cut left).
    pub fn from_image(image: Vec<u8>, switch: Arc<CrashSwitch>, seed: u64) -> Self {
        let inner = Arc::new(Inner {
            volatile: Mutex::new(image.clone()),
            durable: Mutex::new(image),
            unflushed: Mutex::new(Vec::new()),
            crash_image: Mutex::new(None),
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            switch: switch.clone(),
            fingerprint: [0x5a; 16],
            fail_writes_from: AtomicU64::new(u64::MAX),
            fail_reads_from: AtomicU64::new(u64::MAX),
            fail_writes_in: Mutex::new(Vec::new()),
            fail_flushes: std::sync::atomic::AtomicBool::new(false),
            failed_flush_loses_writes: std::sync::atomic::AtomicBool::new(true),
            queued: std::sync::atomic::AtomicBool::new(false),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        switch.on_crash(Box::new(move || {
            if let Some(inner) = weak.upgrade() {
                let image = inner.power_cut_image();
                *inner.crash_image.lock().expect("poisoned") = Some(image);
            }
        }));
        Self { inner }
    }

    /// Offers a queue to the engine (`open_queue`), or not (the engine then does its I/O one
    /// call at a time).
    pub fn set_queued(&self, queued: bool) {
        self.inner.queued.store(queued, Ordering::SeqCst);
    }

    /// Whether the device offers a queue.
    pub fn is_queued(&self) -> bool {
        self.inner.queued.load(Ordering::SeqCst)
    }

    /// The image captured when power was cut.
    pub fn crash_image(&self) -> Option<Vec<u8>> {
        self.inner.crash_image.lock().expect("poisoned").clone()
    }

    /// What the device holds now (volatile view).
    pub fn contents(&self) -> Vec<u8> {
        self.inner.volatile.lock().expect("poisoned").clone()
    }

    /// What the device holds durably (what a power cut that keeps no unflushed write leaves).
    pub fn durable_contents(&self) -> Vec<u8> {
        self.inner.durable.lock().expect("poisoned").clone()
    }

    /// From the `n`-th write on (0-based, counting writes, discards and zeroings), fail with EIO.
    pub fn fail_writes_from(&self, n: u64) {
        self.inner.fail_writes_from.store(n, Ordering::SeqCst);
    }

    /// From the `n`-th read on, fail with EIO.
    pub fn fail_reads_from(&self, n: u64) {
        self.inner.fail_reads_from.store(n, Ordering::SeqCst);
    }

    /// Fails with EIO every write (or discard, or zeroing) that overlaps the bytes `range`,
    /// and serves the rest: a device with bad sectors, or a cache whose write-backs of some
    /// blocks fail while other writes succeed.
    pub fn fail_writes_in(&self, range: std::ops::Range<u64>) {
        self.fail_writes_in_each(vec![range]);
    }

    /// [`SimBacking::fail_writes_in`] for several ranges at once (replacing earlier ones).
    pub fn fail_writes_in_each(&self, ranges: Vec<std::ops::Range<u64>>) {
        *self.inner.fail_writes_in.lock().expect("poisoned") = ranges;
    }

    /// Fails every flush with EIO (making nothing durable) while `fail` holds.
    pub fn fail_flushes(&self, fail: bool) {
        self.inner.fail_flushes.store(fail, Ordering::SeqCst);
    }

    /// Says whether a failed flush may have lost completed writes (true by default, as a
    /// file; false as a store whose writes are durable when they complete, such as an RBD
    /// image). A failed flush here never drops writes: a later one makes them durable.
    pub fn set_failed_flush_loses_writes(&self, loses: bool) {
        self.inner.failed_flush_loses_writes.store(loses, Ordering::SeqCst);
    }

    /// Stops injecting faults.
    pub fn heal(&self) {
        self.fail_writes_from(u64::MAX);
        self.fail_reads_from(u64::MAX);
        self.fail_writes_in_each(Vec::new());
        self.fail_flushes(false);
    }

    /// Writes and reads served so far.
    pub fn io_counts(&self) -> (u64, u64) {
        (self.inner.writes.load(Ordering::SeqCst), self.inner.reads.load(Ordering::SeqCst))
    }

    /// Flushes served so far.
    pub fn flushes(&self) -> u64 {
        self.inner.flushes.load(Ordering::SeqCst)
    }

    fn eio(op: &'static str, offset: u64, len: u64) -> BackingError {
        BackingError::Io { op, offset, len, source: io::Error::from_raw_os_error(5) }
    }

    fn check(&self, op: &'static str, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        let size = self.size_bytes();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(BackingError::OutOfRange { op, offset, len, size });
        }
        Ok(())
    }

    fn store(&self, op: &'static str, offset: u64, data: &[u8]) -> pmcache_backing::Result<()> {
        self.check(op, offset, data.len() as u64)?;
        let n = self.inner.writes.fetch_add(1, Ordering::SeqCst);
        let end = offset + data.len() as u64;
        let refused = (self.inner.fail_writes_in.lock().expect("poisoned").iter())
            .any(|bad| offset < bad.end && bad.start < end);
        if n >= self.inner.fail_writes_from.load(Ordering::SeqCst) || refused {
            return Err(Self::eio(op, offset, data.len() as u64));
        }
        let crashed = self.inner.switch.persist_point();
        let mut volatile = self.inner.volatile.lock().expect("poisoned");
        volatile[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        if !crashed {
            self.inner.unflushed.lock().expect("poisoned").push((offset, data.to_vec()));
        }
        Ok(())
    }
}

impl BackingStore for SimBacking {
    fn size_bytes(&self) -> u64 {
        self.inner.volatile.lock().expect("poisoned").len() as u64
    }

    fn logical_block_size(&self) -> u32 {
        SIM_SECTOR_BYTES as u32
    }

    fn identity(&self) -> BackingIdentity {
        BackingIdentity {
            size_bytes: self.size_bytes(),
            fingerprint: self.inner.fingerprint,
            instance: 0,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> pmcache_backing::Result<()> {
        self.check("read", offset, buf.len() as u64)?;
        let n = self.inner.reads.fetch_add(1, Ordering::SeqCst);
        if n >= self.inner.fail_reads_from.load(Ordering::SeqCst) {
            return Err(Self::eio("read", offset, buf.len() as u64));
        }
        let volatile = self.inner.volatile.lock().expect("poisoned");
        buf.copy_from_slice(&volatile[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, data: &[u8], offset: u64) -> pmcache_backing::Result<()> {
        self.store("write", offset, data)
    }

    fn open_queue(
        &self,
        depth: usize,
    ) -> pmcache_backing::Result<Box<dyn pmcache_backing::IoQueue>> {
        if !self.is_queued() {
            return Err(BackingError::Unsupported {
                engine: "sim",
                option: "queue",
                reason: "this simulated device offers no queue".into(),
            });
        }
        let seed = self.inner.rng.lock().expect("poisoned").r#gen();
        Ok(Box::new(LateQueue::shuffled(self.clone(), depth, seed)))
    }

    fn failed_flush_loses_writes(&self) -> bool {
        self.inner.failed_flush_loses_writes.load(Ordering::SeqCst)
    }

    fn flush(&self) -> pmcache_backing::Result<()> {
        self.inner.flushes.fetch_add(1, Ordering::SeqCst);
        if self.inner.fail_flushes.load(Ordering::SeqCst) {
            return Err(Self::eio("flush", 0, 0));
        }
        if self.inner.switch.persist_point() {
            return Ok(());
        }
        let volatile = self.inner.volatile.lock().expect("poisoned");
        let mut unflushed = self.inner.unflushed.lock().expect("poisoned");
        *self.inner.durable.lock().expect("poisoned") = volatile.clone();
        unflushed.clear();
        Ok(())
    }

    /// A discarded sector reads back as anything afterwards (as on many devices): here its
    /// old data, zeroes or a garbage pattern, chosen at random per sector. So an engine that
    /// implemented write-zeroes with a discard, or trusted a discarded range's contents, fails.
    fn discard(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        self.check("discard", offset, len)?;
        let mut data = self.inner.volatile.lock().expect("poisoned")
            [offset as usize..(offset + len) as usize]
            .to_vec();
        {
            let mut rng = self.inner.rng.lock().expect("poisoned");
            for sector in data.chunks_mut(SIM_SECTOR_BYTES) {
                match rng.gen_range(0..3) {
                    0 => {}
                    1 => sector.fill(0),
                    _ => sector.fill(0xd5),
                }
            }
        }
        self.store("discard", offset, &data)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        self.store("write_zeroes", offset, &vec![0u8; len as usize])
    }
}

/// A queue over a backing store whose requests run on it only when a reap picks them, not
/// at submit: a write lands late, as on a network disk, so a read started meanwhile on
/// another lane reads the old data.
///
/// [`LateQueue::shuffled`] (the simulated device's queue) also lets other lanes act while a
/// request is in flight: before running any, the reaping thread yields; a reap that must wait
/// runs at least the requests it waits for and each other one by a coin flip, a poll
/// (`min = 0`) each by a coin flip, and completions come back shuffled — the engine's queued
/// paths (misses in flight, the cleaner's pipelined writes, write-throughs) meet completions
/// out of order. [`LateQueue::in_order`] runs every submitted request at each reap, in order,
/// without yielding: for a model checker (shuttle) that schedules the threads itself.
pub struct LateQueue<S> {
    store: S,
    depth: usize,
    /// Pushed, not submitted yet.
    pushed: Vec<pmcache_backing::IoRequest>,
    /// Submitted, not run yet.
    submitted: Vec<pmcache_backing::IoRequest>,
    /// The coin for shuffled queues; none for in-order ones.
    rng: Option<SmallRng>,
}

impl<S: BackingStore> LateQueue<S> {
    /// A queue of `depth` whose reaps yield, pick and shuffle (see the type), from `seed`.
    pub fn shuffled(store: S, depth: usize, seed: u64) -> Self {
        Self::new(store, depth, Some(SmallRng::seed_from_u64(seed)))
    }

    /// A queue of `depth` whose reaps run every submitted request, in order.
    pub fn in_order(store: S, depth: usize) -> Self {
        Self::new(store, depth, None)
    }

    fn new(store: S, depth: usize, rng: Option<SmallRng>) -> Self {
        let (pushed, submitted) = (Vec::with_capacity(depth), Vec::with_capacity(depth));
        Self { store, depth, pushed, submitted, rng }
    }
}

impl<S: BackingStore> pmcache_backing::IoQueue for LateQueue<S> {
    fn depth(&self) -> usize {
        self.depth
    }
    fn in_flight(&self) -> usize {
        self.pushed.len() + self.submitted.len()
    }
    fn push(
        &mut self,
        req: pmcache_backing::IoRequest,
    ) -> std::result::Result<(), pmcache_backing::IoRequest> {
        if self.in_flight() == self.depth {
            return Err(req);
        }
        self.pushed.push(req);
        Ok(())
    }
    fn submit(&mut self) -> pmcache_backing::Result<usize> {
        let n = self.pushed.len();
        self.submitted.append(&mut self.pushed);
        Ok(n)
    }
    fn reap(
        &mut self,
        min: usize,
        out: &mut Vec<pmcache_backing::IoCompletion>,
    ) -> pmcache_backing::Result<usize> {
        use rand::seq::SliceRandom;
        self.submit()?;
        let Some(rng) = self.rng.as_mut() else {
            let n = self.submitted.len();
            out.extend(self.submitted.drain(..).map(|req| req.run_on(&self.store)));
            return Ok(n);
        };
        if self.submitted.is_empty() {
            return Ok(0);
        }
        // The requests stay in flight a moment: another lane's request may pass them.
        for _ in 0..4 {
            std::thread::yield_now();
        }
        self.submitted.shuffle(rng);
        let min = min.min(self.submitted.len());
        let mut got = 0;
        let mut at = 0;
        while at < self.submitted.len() {
            if got < min || rng.gen_bool(0.5) {
                let req = self.submitted.swap_remove(at);
                out.push(req.run_on(&self.store));
                got += 1;
            } else {
                at += 1;
            }
        }
        Ok(got)
    }
}
