//! [`CrashMedium`]: a medium that can lose power.
//!
//! It keeps two images at 8-byte granularity: the *volatile* one every load and store sees, and
//! the *durable* one that survives a power cut. `flush` snapshots the covered cache lines into
//! the calling thread's pending set; `drain` makes that thread's pending lines durable. A power
//! cut yields the durable image with a random subset of its words replaced by a newer value the
//! hardware could have written back: the word's current value, or a flushed snapshot of it not
//! yet drained (arbitrary cache-line eviction, 8-byte failure atomicity, no ordering between
//! lines).
//!
//! Snapshots are numbered in the order they are taken, and a drain never puts an older
//! snapshot of a word over a newer one already durable: cache coherence writes a line's
//! versions back in order, so one thread's late fence cannot roll back a line that another
//! thread has since changed, flushed and fenced. (Without this, a lane that flushed a line and
//! fenced only later would durably restore its stale copy of a neighbouring entry.)
//!
//! Lines can be *poisoned* ([`CrashMedium::poison`]), as a PM device marks a line it found an
//! uncorrectable error in: [`Medium::read_checked`] of one fails, a plain read of one panics
//! (on the device it is a machine check the process does not survive), and stores do not
//! heal it. Poison is not part of the images: a medium made from an image is poisoned anew.
//!
//! [`CrashMedium::poison_mapped`] poisons lines the way the mapped medium (`PmemFile`) meets
//! them: a plain access of such a line panics, and the first checked read that reaches one
//! *loses* the page around it ([`CrashMedium::PAGE_BYTES`]), as `PmemFile`'s `SIGBUS` handler
//! replaces that page with a zeroed private one. A lost page reads as zeroes (plain reads do
//! not fault any more; checked reads of any byte of it fail), and what is stored there from
//! then on is seen by later loads but never reaches the durable image or a power cut's image:
//! the file under the mapping keeps what it held when the page was lost.
//!
//! A [`CrashSwitch`] shared by every participant (this medium, a simulated backing store)
//! counts persist points (each `drain`, each backing write and flush) and cuts power at the
//! N-th: from then on nothing more becomes durable, and each participant's crash image is
//! captured at that instant.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, Weak};
use std::thread::ThreadId;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::{Medium, Poisoned, check_bounds};

type CrashHook = Box<dyn Fn() + Send + Sync>;
/// Cache lines flushed but not yet drained, per thread: (line index, snapshot number, its
/// eight words), and the number of the next snapshot.
#[derive(Default)]
struct PendingLines {
    by_thread: HashMap<ThreadId, Vec<(usize, u64, [u64; 8])>>,
    next_snapshot: u64,
}

/// The durable image, and for each word the number of the snapshot it came from (0: the
/// initial image).
struct Durable {
    words: Box<[u64]>,
    snapshots: Box<[u64]>,
}

/// Counts persist points and cuts power at a chosen one.
pub struct CrashSwitch {
    points: AtomicU64,
    crash_at_point: AtomicU64,
    crashed: AtomicBool,
    hooks: Mutex<Vec<CrashHook>>,
    /// Held shared by every store to a medium, and exclusively while power is cut and the
    /// images are captured: a power cut is an instant, so no store of another thread may
    /// slip in between the cut and the capture (a store the engine makes after a drain that
    /// the cut turned into a no-op must not reach the image).
    stores: RwLock<()>,
}

impl std::fmt::Debug for CrashSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrashSwitch")
            .field("points", &self.points())
            .field("crashed", &self.has_crashed())
            .finish()
    }
}

impl CrashSwitch {
    /// A switch that never cuts power until armed.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            points: AtomicU64::new(0),
            crash_at_point: AtomicU64::new(u64::MAX),
            crashed: AtomicBool::new(false),
            hooks: Mutex::new(Vec::new()),
            stores: RwLock::new(()),
        })
    }

    /// Held while a medium stores: a power cut waits for it, and the store is either wholly
    /// before the cut or after it.
    fn store_gate(&self) -> RwLockReadGuard<'_, ()> {
        self.stores.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Cuts power when persist point number `point` (1-based) is reached: its effects and all
    /// later ones are lost.
    pub fn arm(&self, point: u64) {
        self.crash_at_point.store(point.max(1), Ordering::SeqCst);
    }

    /// Cuts power now.
    pub fn cut_now(&self) {
        self.trigger();
    }

    /// Persist points counted so far.
    pub fn points(&self) -> u64 {
        self.points.load(Ordering::SeqCst)
    }

    /// Whether power has been cut.
    pub fn has_crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    /// Registers a hook run once, at the instant power is cut.
    pub fn on_crash(&self, hook: CrashHook) {
        self.hooks.lock().expect("crash hooks poisoned").push(hook);
    }

    /// Counts one persist point. Returns `true` when its effects must be dropped (power is off).
    pub fn persist_point(&self) -> bool {
        if self.has_crashed() {
            return true;
        }
        let point = self.points.fetch_add(1, Ordering::SeqCst) + 1;
        if point >= self.crash_at_point.load(Ordering::SeqCst) {
            self.trigger();
            return true;
        }
        false
    }

    fn trigger(&self) {
        let _stores_stopped = self.stores.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.crashed.swap(true, Ordering::SeqCst) {
            return;
        }
        for hook in self.hooks.lock().expect("crash hooks poisoned").iter() {
            hook();
        }
    }
}

struct Inner {
    volatile: Box<[AtomicU64]>,
    durable: Mutex<Durable>,
    pending: Mutex<PendingLines>,
    crash_image: Mutex<Option<Vec<u64>>>,
    rng: Mutex<SmallRng>,
    switch: Arc<CrashSwitch>,
    /// Poisoned cache lines (line numbers), and whether there are any (checked first).
    poisoned: Mutex<BTreeSet<u64>>,
    any_poisoned: AtomicBool,
    /// Lines poisoned as a mapped medium meets them (`poison_mapped`), not reached yet by a
    /// checked read; and whether there are any.
    latent: Mutex<BTreeSet<u64>>,
    any_latent: AtomicBool,
    /// Pages lost (page numbers): see the module. Whether there are any, and how many stores
    /// touched one since.
    lost: Mutex<BTreeSet<u64>>,
    any_lost: AtomicBool,
    stores_to_lost: AtomicU64,
    /// Pages lost so far, counted before each is ([`Medium::losses`]).
    losses: AtomicU64,
    /// Armed by [`CrashMedium::lose_page_at_store`]: the range whose next store loses its
    /// page first.
    lose_at_store: Mutex<Option<Range<u64>>>,
    any_lose_at_store: AtomicBool,
}

impl Inner {
    /// What a power cut leaves of each word: its durable value, or — for a random subset of
    /// the words with something newer — one of the newer values the hardware could have
    /// written back before the cut: the word's current value, or a value a flush took a
    /// snapshot of that no drain has made durable yet (and that a later store has since
    /// replaced). A line's versions reach the medium in order, so a snapshot older than the
    /// word's durable one is not a candidate.
    fn power_cut_image(&self) -> Vec<u64> {
        let pending = self.pending.lock().expect("pending flushes poisoned");
        let durable = self.durable.lock().expect("durable image poisoned");
        let mut rng = self.rng.lock().expect("crash rng poisoned");
        let keep_bias = rng.gen_range(0.0..=1.0);
        let mut flushed: HashMap<usize, Vec<u64>> = HashMap::new();
        for &(line, snapshot, values) in pending.by_thread.values().flatten() {
            for (i, value) in values.into_iter().enumerate() {
                let index = line * 8 + i;
                if index < durable.words.len()
                    && durable.snapshots[index] < snapshot
                    && value != durable.words[index]
                {
                    flushed.entry(index).or_default().push(value);
                }
            }
        }
        let lost = self.lost_pages();
        let mut image = durable.words.to_vec();
        for (index, word) in image.iter_mut().enumerate() {
            // A lost page's stores never reach the medium: its words are candidates only as
            // they were flushed before it was lost.
            let current = if lost.contains(&(index as u64 * 8 / CrashMedium::PAGE_BYTES)) {
                *word
            } else {
                self.volatile[index].load(Ordering::SeqCst)
            };
            let snapshots = flushed.get(&index).map_or(&[][..], Vec::as_slice);
            let newer = usize::from(current != *word) + snapshots.len();
            if newer > 0 && rng.gen_bool(keep_bias) {
                let pick = rng.gen_range(0..newer);
                *word = if pick < snapshots.len() { snapshots[pick] } else { current };
            }
        }
        image
    }

    /// The lost pages (page numbers).
    fn lost_pages(&self) -> BTreeSet<u64> {
        if !self.any_lost.load(Ordering::SeqCst) {
            return BTreeSet::new();
        }
        self.lost.lock().expect("lost pages lock").clone()
    }
}

/// A crash-simulating medium. Cloning shares the same images.
#[derive(Clone)]
pub struct CrashMedium {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CrashMedium {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrashMedium").field("len_bytes", &self.len_bytes()).finish()
    }
}

impl CrashMedium {
    /// A zeroed medium of `len_bytes` (rounded up to 8), cut by `switch`, with eviction choices
    /// drawn from `seed`.
    pub fn new(len_bytes: u64, switch: Arc<CrashSwitch>, seed: u64) -> Self {
        Self::from_image(vec![0; len_bytes.div_ceil(8) as usize], switch, seed)
    }

    /// A medium whose volatile and durable images both equal `words` (what a power cut left).
    pub fn from_image(words: Vec<u64>, switch: Arc<CrashSwitch>, seed: u64) -> Self {
        let volatile = words.iter().map(|&w| AtomicU64::new(w)).collect();
        let inner = Arc::new(Inner {
            volatile,
            durable: Mutex::new(Durable {
                snapshots: vec![0; words.len()].into_boxed_slice(),
                words: words.into_boxed_slice(),
            }),
            pending: Mutex::new(PendingLines::default()),
            crash_image: Mutex::new(None),
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            switch: switch.clone(),
            poisoned: Mutex::new(BTreeSet::new()),
            any_poisoned: AtomicBool::new(false),
            latent: Mutex::new(BTreeSet::new()),
            any_latent: AtomicBool::new(false),
            lost: Mutex::new(BTreeSet::new()),
            any_lost: AtomicBool::new(false),
            stores_to_lost: AtomicU64::new(0),
            losses: AtomicU64::new(0),
            lose_at_store: Mutex::new(None),
            any_lose_at_store: AtomicBool::new(false),
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        switch.on_crash(Box::new(move || {
            if let Some(inner) = weak.upgrade() {
                let image = inner.power_cut_image();
                *inner.crash_image.lock().expect("crash image poisoned") = Some(image);
            }
        }));
        Self { inner }
    }

    /// The image captured when the switch cut power, if it has.
    pub fn crash_image(&self) -> Option<Vec<u64>> {
        self.inner.crash_image.lock().expect("crash image poisoned").clone()
    }

    /// What a power cut right now would leave (does not stop this medium).
    pub fn power_cut_image(&self) -> Vec<u64> {
        self.inner.power_cut_image()
    }

    /// The durable image only (what a power cut with no lucky evictions leaves).
    pub fn durable_image(&self) -> Vec<u64> {
        self.inner.durable.lock().expect("durable image poisoned").words.to_vec()
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        &self.inner.volatile[index]
    }

    /// Poisons the cache lines covering `offset..offset + len`: from now on a read of them
    /// fails ([`Medium::read_checked`]) or panics ([`Medium::read`]).
    pub fn poison(&self, offset: u64, len: u64) {
        check_bounds(offset, len, self.len_bytes());
        let lines = offset / CACHE_LINE..(offset + len).div_ceil(CACHE_LINE);
        self.inner.poisoned.lock().expect("poisoned lines lock").extend(lines);
        self.inner.any_poisoned.store(true, Ordering::SeqCst);
    }

    /// The first poisoned byte of `offset..offset + len`, if any.
    fn first_poisoned(&self, offset: u64, len: u64) -> Option<u64> {
        if !self.inner.any_poisoned.load(Ordering::SeqCst) || len == 0 {
            return None;
        }
        let lines = offset / CACHE_LINE..(offset + len).div_ceil(CACHE_LINE);
        let poisoned = self.inner.poisoned.lock().expect("poisoned lines lock");
        poisoned.range(lines).next().map(|&line| (line * CACHE_LINE).max(offset))
    }

    /// The page a mapped medium replaces when a checked read meets a poisoned line in it.
    pub const PAGE_BYTES: u64 = 4096;

    /// Poisons the cache lines covering `offset..offset + len` as a mapped medium meets them
    /// (see the module): a plain access of one panics; the first checked read that reaches
    /// one loses the page holding it, from then on listed by [`Medium::poisoned_ranges`].
    pub fn poison_mapped(&self, offset: u64, len: u64) {
        check_bounds(offset, len, self.len_bytes());
        let lines = offset / CACHE_LINE..(offset + len).div_ceil(CACHE_LINE);
        self.inner.latent.lock().expect("latent lines lock").extend(lines);
        self.inner.any_latent.store(true, Ordering::SeqCst);
    }

    /// Loses the pages covering `offset..offset + len` now, as a checked read that met a
    /// poisoned line in each would (see the module).
    pub fn lose_pages(&self, offset: u64, len: u64) {
        check_bounds(offset, len, self.len_bytes());
        let pages = offset / Self::PAGE_BYTES..(offset + len).div_ceil(Self::PAGE_BYTES);
        for page in pages {
            self.lose_page(page);
        }
    }

    fn lose_page(&self, page: u64) {
        let _gate = self.inner.switch.store_gate();
        let mut lost = self.inner.lost.lock().expect("lost pages lock");
        if lost.contains(&page) {
            return;
        }
        // Counted before the page is lost: a store's flush that finds it lost (under this
        // lock) is followed by a load of the count that sees it (`Medium::losses`).
        self.inner.losses.fetch_add(1, Ordering::SeqCst);
        lost.insert(page);
        let words = page * Self::PAGE_BYTES / 8..((page + 1) * Self::PAGE_BYTES / 8);
        for index in words.filter(|&i| i < self.inner.volatile.len() as u64) {
            self.word(index as usize).store(0, Ordering::SeqCst);
        }
        self.inner.any_lost.store(true, Ordering::SeqCst);
    }

    /// Arms a loss at a store: the next store (write, word store or exchange) that touches
    /// `trigger` first loses the page it touches there (its first such page), as if a read on
    /// another thread met a poisoned line in it at that instant — the store then goes to the
    /// replacement and never reaches the medium. Once.
    pub fn lose_page_at_store(&self, trigger: Range<u64>) {
        *self.inner.lose_at_store.lock().expect("lose-at-store lock") = Some(trigger);
        self.inner.any_lose_at_store.store(true, Ordering::SeqCst);
    }

    /// Whether a loss armed by [`CrashMedium::lose_page_at_store`] is still waiting for its
    /// store.
    pub fn loss_at_store_armed(&self) -> bool {
        self.inner.any_lose_at_store.load(Ordering::SeqCst)
    }

    /// The armed loss at a store, if this store of `offset..offset + len` is its.
    fn lose_at_store(&self, offset: u64, len: u64) {
        if !self.inner.any_lose_at_store.load(Ordering::SeqCst) {
            return;
        }
        let page = {
            let mut armed = self.inner.lose_at_store.lock().expect("lose-at-store lock");
            let Some(trigger) = armed.as_ref() else { return };
            let (start, end) = (offset.max(trigger.start), (offset + len).min(trigger.end));
            if start >= end {
                return;
            }
            *armed = None;
            self.inner.any_lose_at_store.store(false, Ordering::SeqCst);
            start / Self::PAGE_BYTES
        };
        self.lose_page(page);
    }

    /// How many stores (writes, word stores and exchanges) touched a lost page since this
    /// medium was made: stores that never reach the medium.
    pub fn stores_to_lost_pages(&self) -> u64 {
        self.inner.stores_to_lost.load(Ordering::SeqCst)
    }

    /// Whether `offset..offset + len` touches a lost page.
    fn touches_lost(&self, offset: u64, len: u64) -> bool {
        if !self.inner.any_lost.load(Ordering::SeqCst) || len == 0 {
            return false;
        }
        let pages = offset / Self::PAGE_BYTES..(offset + len).div_ceil(Self::PAGE_BYTES);
        self.inner.lost.lock().expect("lost pages lock").range(pages).next().is_some()
    }

    /// Counts a store to `offset..offset + len` if it touches a lost page.
    fn note_store(&self, offset: u64, len: u64) {
        self.lose_at_store(offset, len);
        if self.touches_lost(offset, len) {
            self.inner.stores_to_lost.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A plain access of `offset..offset + len`: a line poisoned as a mapped medium meets
    /// it is a machine check there.
    fn check_plain_access(&self, offset: u64, len: u64) {
        if !self.inner.any_latent.load(Ordering::SeqCst) || len == 0 {
            return;
        }
        let lines = offset / CACHE_LINE..(offset + len).div_ceil(CACHE_LINE);
        let latent = self.inner.latent.lock().expect("latent lines lock");
        if let Some(&line) = latent.range(lines).next() {
            panic!(
                "a plain access of poisoned byte {}: a machine check on a PM device",
                (line * CACHE_LINE).max(offset)
            );
        }
    }

    /// A checked read of `offset..offset + len` on the mapped model: every page holding a
    /// poisoned line it reaches is lost; then the first byte it reads of a lost page, if any.
    fn checked_read_losses(&self, offset: u64, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        if self.inner.any_latent.load(Ordering::SeqCst) {
            let lines = offset / CACHE_LINE..(offset + len).div_ceil(CACHE_LINE);
            let reached: Vec<u64> = {
                let mut latent = self.inner.latent.lock().expect("latent lines lock");
                let reached: Vec<u64> = latent.range(lines).copied().collect();
                let pages: BTreeSet<u64> =
                    reached.iter().map(|line| line * CACHE_LINE / Self::PAGE_BYTES).collect();
                latent.retain(|line| !pages.contains(&(line * CACHE_LINE / Self::PAGE_BYTES)));
                pages.into_iter().collect()
            };
            for page in reached {
                self.lose_page(page);
            }
        }
        if !self.inner.any_lost.load(Ordering::SeqCst) {
            return None;
        }
        let pages = offset / Self::PAGE_BYTES..(offset + len).div_ceil(Self::PAGE_BYTES);
        let lost = self.inner.lost.lock().expect("lost pages lock");
        lost.range(pages).next().map(|&page| (page * Self::PAGE_BYTES).max(offset))
    }
}

const CACHE_LINE: u64 = crate::CACHE_LINE_BYTES;

impl CrashMedium {
    fn copy_out(&self, offset: u64, buf: &mut [u8]) {
        for (i, byte) in buf.iter_mut().enumerate() {
            let at = offset as usize + i;
            let word = self.word(at / 8).load(Ordering::Relaxed);
            *byte = word.to_le_bytes()[at % 8];
        }
    }
}

impl Medium for CrashMedium {
    fn len_bytes(&self) -> u64 {
        self.inner.volatile.len() as u64 * 8
    }

    fn read(&self, offset: u64, buf: &mut [u8]) {
        check_bounds(offset, buf.len() as u64, self.len_bytes());
        if let Some(at) = self.first_poisoned(offset, buf.len() as u64) {
            panic!("an unchecked read of poisoned byte {at}: a machine check on a PM device");
        }
        self.check_plain_access(offset, buf.len() as u64);
        self.copy_out(offset, buf);
    }

    fn read_checked(&self, offset: u64, buf: &mut [u8]) -> std::result::Result<(), Poisoned> {
        check_bounds(offset, buf.len() as u64, self.len_bytes());
        let len = buf.len() as u64;
        let first = [self.first_poisoned(offset, len), self.checked_read_losses(offset, len)];
        if let Some(at) = first.into_iter().flatten().min() {
            return Err(Poisoned { offset: at });
        }
        self.copy_out(offset, buf);
        Ok(())
    }

    fn losses(&self) -> u64 {
        self.inner.losses.load(Ordering::SeqCst)
    }

    fn poisoned_ranges(&self) -> Vec<std::ops::Range<u64>> {
        let poisoned = self.inner.poisoned.lock().expect("poisoned lines lock");
        let lines = poisoned.iter().map(|&line| line * CACHE_LINE..(line + 1) * CACHE_LINE);
        let lost = self.inner.lost_pages();
        let pages = lost.iter().map(|&page| page * Self::PAGE_BYTES..(page + 1) * Self::PAGE_BYTES);
        lines.chain(pages.map(|r| r.start..r.end.min(self.len_bytes()))).collect()
    }

    fn write(&self, offset: u64, data: &[u8]) {
        check_bounds(offset, data.len() as u64, self.len_bytes());
        self.note_store(offset, data.len() as u64);
        let _gate = self.inner.switch.store_gate();
        let mut at = offset as usize;
        let end = at + data.len();
        while at < end {
            let index = at / 8;
            let in_word = at % 8;
            let take = (8 - in_word).min(end - at);
            let src = &data[at - offset as usize..at - offset as usize + take];
            let word = self.word(index);
            if take == 8 {
                word.store(u64::from_le_bytes(src.try_into().expect("8 bytes")), Ordering::Relaxed);
            } else {
                let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    let mut bytes = old.to_le_bytes();
                    bytes[in_word..in_word + take].copy_from_slice(src);
                    Some(u64::from_le_bytes(bytes))
                });
            }
            at += take;
        }
    }

    fn load_u64(&self, offset: u64) -> u64 {
        assert!(offset.is_multiple_of(8), "unaligned word load at {offset}");
        check_bounds(offset, 8, self.len_bytes());
        self.check_plain_access(offset, 8);
        self.word(offset as usize / 8).load(Ordering::Acquire)
    }

    fn store_u64(&self, offset: u64, value: u64) {
        assert!(offset.is_multiple_of(8), "unaligned word store at {offset}");
        check_bounds(offset, 8, self.len_bytes());
        self.note_store(offset, 8);
        let _gate = self.inner.switch.store_gate();
        self.word(offset as usize / 8).store(value, Ordering::Release)
    }

    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        assert!(offset.is_multiple_of(8), "unaligned word exchange at {offset}");
        check_bounds(offset, 8, self.len_bytes());
        self.check_plain_access(offset, 8);
        self.note_store(offset, 8);
        let _gate = self.inner.switch.store_gate();
        self.word(offset as usize / 8)
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn flush(&self, offset: u64, len: u64) {
        check_bounds(offset, len, self.len_bytes());
        if len == 0 {
            return;
        }
        let words = self.inner.volatile.len();
        let first_line = offset as usize / 64;
        let last_line = (offset + len - 1) as usize / 64;
        // A lost page's lines never reach the medium again.
        let lost = self.inner.lost_pages();
        let line_page = |line: usize| (line as u64 * CACHE_LINE) / Self::PAGE_BYTES;
        // Snapshots are taken under the lock, so their numbers follow the order of their loads.
        let mut pending = self.inner.pending.lock().expect("pending flushes poisoned");
        pending.next_snapshot += 1;
        let snapshot = pending.next_snapshot;
        let kept = (first_line..=last_line).filter(|&line| !lost.contains(&line_page(line)));
        let lines = kept.map(|line| {
            let mut values = [0u64; 8];
            for (i, value) in values.iter_mut().enumerate() {
                let index = line * 8 + i;
                if index < words {
                    *value = self.word(index).load(Ordering::SeqCst);
                }
            }
            (line, snapshot, values)
        });
        pending.by_thread.entry(std::thread::current().id()).or_default().extend(lines);
    }

    fn drain(&self) {
        // The persist point first: a cut here sees this thread's flushed lines still pending,
        // so the image may hold any of them (the fence was under way).
        let crashed = self.inner.switch.persist_point();
        let lines = {
            let mut pending = self.inner.pending.lock().expect("pending flushes poisoned");
            pending.by_thread.remove(&std::thread::current().id()).unwrap_or_default()
        };
        if crashed {
            return;
        }
        let mut durable = self.inner.durable.lock().expect("durable image poisoned");
        let Durable { words, snapshots } = &mut *durable;
        for (line, snapshot, values) in lines {
            for (i, value) in values.into_iter().enumerate() {
                let index = line * 8 + i;
                if index < words.len() && snapshots[index] < snapshot {
                    words[index] = value;
                    snapshots[index] = snapshot;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(image: &[u64], offset: usize, len: usize) -> Vec<u8> {
        image.iter().flat_map(|w| w.to_le_bytes()).skip(offset).take(len).collect()
    }

    #[test]
    fn persisted_data_survives_every_power_cut() {
        let switch = CrashSwitch::new();
        let medium = CrashMedium::new(4096, switch.clone(), 1);
        medium.write(100, b"persisted");
        medium.persist(100, 9);
        medium.write(2000, b"volatile only");
        for _ in 0..50 {
            let image = medium.power_cut_image();
            assert_eq!(bytes(&image, 100, 9), b"persisted");
        }
        // With enough cuts, the unpersisted words are sometimes kept and sometimes lost.
        let outcomes: std::collections::HashSet<Vec<u8>> =
            (0..200).map(|_| bytes(&medium.power_cut_image(), 2000, 13)).collect();
        assert!(outcomes.len() > 1, "eviction of unpersisted words is never random");
        assert!(outcomes.contains(&vec![0u8; 13]));
    }

    /// Thread A flushes a line and fences late; meanwhile thread B changes another word of the
    /// line, flushes and fences. A's fence must not put A's older copy of B's word back.
    #[test]
    fn a_late_fence_never_rolls_back_a_newer_durable_word() {
        let switch = CrashSwitch::new();
        let medium = CrashMedium::new(4096, switch, 3);
        medium.store_u64(0, 1);
        medium.flush(0, 8); // A's snapshot: word 0 = 1, word 1 = 0
        let other = medium.clone();
        std::thread::spawn(move || {
            other.store_u64(8, 7);
            other.flush(8, 8);
            other.drain();
        })
        .join()
        .unwrap();
        assert_eq!(medium.durable_image()[1], 7);
        medium.drain();
        assert_eq!(medium.durable_image()[..2], [1, 7], "the late fence rolled word 1 back");
    }

    #[test]
    fn flush_without_drain_is_not_durable_and_drain_is_per_thread() {
        let switch = CrashSwitch::new();
        let medium = CrashMedium::new(4096, switch, 2);
        medium.store_u64(0, 42);
        medium.flush(0, 8);
        assert_eq!(medium.durable_image()[0], 0);
        let other = medium.clone();
        std::thread::spawn(move || other.drain()).join().unwrap();
        assert_eq!(medium.durable_image()[0], 0, "another thread's fence made my flush durable");
        medium.drain();
        assert_eq!(medium.durable_image()[0], 42);
    }

    #[test]
    fn a_store_after_flush_is_not_made_durable_by_the_drain() {
        let medium = CrashMedium::new(64, CrashSwitch::new(), 3);
        medium.store_u64(8, 1);
        medium.flush(8, 8);
        medium.store_u64(8, 2);
        medium.drain();
        assert_eq!(medium.durable_image()[1], 1);
    }

    #[test]
    fn armed_switch_freezes_durability_and_captures_an_image() {
        let switch = CrashSwitch::new();
        let medium = CrashMedium::new(256, switch.clone(), 4);
        switch.arm(2);
        medium.store_u64(0, 1);
        medium.persist(0, 8); // point 1: durable
        medium.store_u64(8, 2);
        medium.persist(8, 8); // point 2: power cut, lost
        medium.store_u64(16, 3);
        medium.persist(16, 8); // after the cut: lost, and not in the image
        assert!(switch.has_crashed());
        let image = medium.crash_image().expect("image captured at the cut");
        assert_eq!(image[0], 1);
        assert!(image[1] == 0 || image[1] == 2);
        assert_eq!(image[2], 0, "a store made after the power cut reached the crash image");
        assert_eq!(medium.durable_image()[2], 0);
    }

    /// A flushed value that a later store replaced before any drain may still be what a power
    /// cut leaves (the line could have been written back at the flush); a snapshot older than
    /// the word's durable value never is.
    #[test]
    fn a_flushed_value_replaced_before_the_drain_may_survive_a_cut() {
        let medium = CrashMedium::new(64, CrashSwitch::new(), 11);
        medium.store_u64(0, 1);
        medium.persist(0, 8);
        medium.store_u64(0, 2);
        medium.flush(0, 8);
        medium.store_u64(0, 3);
        let outcomes: std::collections::HashSet<u64> =
            (0..300).map(|_| medium.power_cut_image()[0]).collect();
        assert_eq!(outcomes, [1, 2, 3].into(), "a cut leaves the durable, flushed or last value");
        // Restored to the durable value: the flushed snapshot is still a candidate.
        medium.store_u64(0, 1);
        let outcomes: std::collections::HashSet<u64> =
            (0..300).map(|_| medium.power_cut_image()[0]).collect();
        assert_eq!(outcomes, [1, 2].into());
        // Another thread makes a newer value durable: the older snapshot is no candidate.
        let other = medium.clone();
        std::thread::spawn(move || {
            other.store_u64(0, 4);
            other.persist(0, 8);
        })
        .join()
        .unwrap();
        let outcomes: std::collections::HashSet<u64> =
            (0..100).map(|_| medium.power_cut_image()[0]).collect();
        assert_eq!(outcomes, [4].into());
    }

    /// A power cut is an instant: a thread that keeps storing after it (as a lane does after
    /// a drain the cut turned into a no-op) never gets a store into the captured image.
    #[test]
    fn no_store_made_after_a_cut_reaches_its_image() {
        for seed in 0..20 {
            let switch = CrashSwitch::new();
            let medium = CrashMedium::new(64, switch.clone(), seed);
            let storer = {
                let (medium, switch) = (medium.clone(), switch.clone());
                std::thread::spawn(move || {
                    let mut value = 0u64;
                    loop {
                        value += 1;
                        medium.store_u64(0, value);
                        if switch.has_crashed() {
                            break;
                        }
                    }
                    // Keeps going, unaware, as code after a cut does.
                    for more in 1..=10_000 {
                        medium.store_u64(0, value + more);
                    }
                    value
                })
            };
            while medium.load_u64(0) < 1000 {
                std::hint::spin_loop();
            }
            switch.cut_now();
            let last_before = storer.join().unwrap();
            let image = medium.crash_image().expect("cut");
            assert!(image[0] <= last_before, "a store after the cut: {} > {last_before}", image[0]);
        }
    }

    /// A cut at a drain may leave the lines that drain was making durable, or not.
    #[test]
    fn a_cut_at_a_drain_may_keep_its_lines_or_not() {
        let mut kept = std::collections::HashSet::new();
        for seed in 0..40 {
            let switch = CrashSwitch::new();
            let medium = CrashMedium::new(64, switch.clone(), seed);
            medium.store_u64(8, 5);
            medium.flush(8, 8);
            medium.store_u64(8, 6);
            switch.arm(1);
            medium.drain();
            kept.insert(medium.crash_image().expect("cut")[1]);
        }
        assert_eq!(kept, [0, 5, 6].into());
    }

    #[test]
    fn unaligned_reads_and_writes_round_trip() {
        let medium = CrashMedium::new(128, CrashSwitch::new(), 5);
        let data: Vec<u8> = (0..37).collect();
        medium.write(3, &data);
        let mut out = vec![0u8; 37];
        medium.read(3, &mut out);
        assert_eq!(out, data);
    }
}
