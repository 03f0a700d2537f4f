//! Caches whose metadata a test writes directly, and one whose index buckets a test can fill:
//! 24 blocks sharing the three candidate buckets of a 25th, one more than they hold. Index
//! room runs out only this way (the index is sized so that random blocks practically never
//! fill all three buckets), so the paths that make room — eviction, write-back, and
//! recovery's own — need it to be tested.

use std::sync::Arc;

use pmcache_backing::{BackingStore, PsyncFile};
use pmcache_media::{CrashMedium, CrashSwitch, Medium};

use crate::cache::{Engine, Lane};
use crate::config::{CacheMode, Config};
use crate::format::{BlockState, Geometry, SUPERBLOCK_BYTES, SYNCED_SEQ_OFFSET, SlotEntry};
use crate::index::Index;
use crate::recovery::RecoveryReport;
use crate::{Clock, MonotonicClock};

/// The block size.
pub(crate) const BLOCK: u64 = 4096;
/// The engine these tests attach.
pub(crate) type TestEngine = Engine<Arc<CrashMedium>, PsyncFile, MonotonicClock>;
/// Slots in the cache.
pub(crate) const SLOTS: u64 = 64;

/// A formatted cache of [`SLOTS`] slots (write-back, [`BLOCK`]-byte blocks, admitting every
/// random read) on the crash-simulating medium, not attached, in front of a backing file.
pub(crate) struct TestCache {
    pub(crate) medium: Arc<CrashMedium>,
    /// The medium's power switch: tests arm cuts with it.
    pub(crate) switch: Arc<CrashSwitch>,
    pub(crate) geometry: Geometry,
    config: Config,
    backing_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl TestCache {
    /// Formats the cache; `backing_fill` gives what the backing store (of `backing_blocks`)
    /// holds in each block it names. `seed` drives which unpersisted words a power cut keeps.
    pub(crate) fn new(
        backing_blocks: u64,
        backing_fill: impl IntoIterator<Item = (u64, u8)>,
        seed: u64,
    ) -> Self {
        let medium_bytes = (SUPERBLOCK_BYTES + SLOTS * 16).next_multiple_of(4096) + SLOTS * BLOCK;
        let switch = CrashSwitch::new();
        let medium = Arc::new(CrashMedium::new(medium_bytes, switch.clone(), seed));
        let dir = tempfile::tempdir().unwrap();
        let backing_path = dir.path().join("backing");
        std::fs::File::create(&backing_path).unwrap().set_len(backing_blocks * BLOCK).unwrap();
        let config = Config { mode: CacheMode::WriteBack, max_lanes: 2, ..Config::default() };
        let engine = Engine::format(
            medium.clone(),
            PsyncFile::open(&backing_path).unwrap(),
            MonotonicClock::default(),
            &config,
        )
        .expect("format");
        let geometry = engine.superblock().geometry;
        assert_eq!(geometry.slot_count, SLOTS);
        for (lba, fill) in backing_fill {
            engine.backing().write_at(&[fill; BLOCK as usize], lba * BLOCK).unwrap();
        }
        Self { medium, switch, geometry, config, backing_path, _dir: dir }
    }

    /// Stores a metadata entry's two words straight to the medium (not persisted yet).
    pub(crate) fn put_words(&self, slot: u32, word0: u64, word1: u64) {
        let at = self.geometry.entry_offset(slot);
        self.medium.store_u64(at + 8, word1);
        self.medium.store_u64(at, word0);
    }

    /// Writes a block's data and metadata entry straight to the medium (not persisted yet).
    pub(crate) fn put(&self, slot: u32, lba: u64, state: BlockState, seq: u64, fill: u8) {
        self.medium.write(self.geometry.data_offset(slot), &[fill; BLOCK as usize]);
        let (word0, word1) = SlotEntry { lba, state, seq }.encode();
        self.put_words(slot, word0, word1);
    }

    /// Persists what was put, attaches, and returns the engine and its report.
    pub(crate) fn open(&self) -> (TestEngine, RecoveryReport) {
        self.medium.persist(0, self.medium.len_bytes());
        self.open_on(self.medium.clone()).expect("recovery")
    }

    /// Attaches the cache on `medium` (this one's, or what a power cut left of it).
    pub(crate) fn open_on(
        &self,
        medium: Arc<CrashMedium>,
    ) -> crate::Result<(TestEngine, RecoveryReport)> {
        Engine::open(
            medium,
            PsyncFile::open(&self.backing_path).unwrap(),
            MonotonicClock::default(),
            &self.config,
        )
    }
}

/// A [`TestCache`] and the 25 blocks tests use: 24 `fillers` sharing their three candidate
/// index buckets with `x`, one more than the buckets hold. The backing store holds
/// [`BACKING_FILL`] in each of them.
pub(crate) struct FullBuckets {
    pub(crate) cache: TestCache,
    pub(crate) fillers: Vec<u64>,
    pub(crate) x: u64,
}

/// What the backing store holds in each of the blocks at the start.
pub(crate) const BACKING_FILL: u8 = 0xbb;

impl FullBuckets {
    pub(crate) fn new() -> Self {
        Self::with_seed(1)
    }

    /// The same, with `seed` for the medium's power cuts (see [`TestCache::new`]).
    pub(crate) fn with_seed(seed: u64) -> Self {
        let medium_bytes = (SUPERBLOCK_BYTES + SLOTS * 16).next_multiple_of(4096) + SLOTS * BLOCK;
        let slot_count = Geometry::for_medium(medium_bytes, BLOCK as u32).unwrap().slot_count;
        // Found once per test process (a scan of some 26 M block numbers).
        static COLLIDING: std::sync::OnceLock<Vec<u64>> = std::sync::OnceLock::new();
        let mut fillers = COLLIDING
            .get_or_init(|| {
                let index = Index::new(slot_count as u32).unwrap();
                let target = index.candidate_buckets(0);
                (0..1u64 << 36)
                    .filter(|&lba| index.candidate_buckets(lba) == target)
                    .take(25)
                    .collect()
            })
            .clone();
        let x = fillers.pop().unwrap();
        let blocks = fillers.iter().chain([&x]).map(|&lba| (lba, BACKING_FILL));
        let cache = TestCache::new(x + 1, blocks, seed);
        assert_eq!(cache.geometry.slot_count, slot_count);
        // Clean entries a test puts (sequence numbers below 1000) stay clean at recovery.
        cache.medium.store_u64(SYNCED_SEQ_OFFSET, crate::format::encode_synced_seq(1000));
        Self { cache, fillers, x }
    }

    /// What [`FullBuckets::write_fillers`] writes in filler `i`.
    pub(crate) fn filler_fill(i: usize) -> u8 {
        0x10 + i as u8
    }

    /// Writes every filler whole (dirty, in write-back mode) through `lane`.
    pub(crate) fn write_fillers<M: Medium, B: BackingStore, C: Clock>(
        &self,
        lane: &mut Lane<'_, M, B, C>,
    ) {
        for (i, &lba) in self.fillers.iter().enumerate() {
            lane.write(lba * BLOCK, &[Self::filler_fill(i); BLOCK as usize], false).unwrap();
        }
    }
}

/// Reads each block through a new lane and checks it holds its fill byte throughout.
pub(crate) fn assert_reads<M: Medium, B: BackingStore, C: Clock>(
    engine: &Engine<M, B, C>,
    expected: impl IntoIterator<Item = (u64, u8)>,
) {
    let mut lane = engine.lane().unwrap();
    let mut got = vec![0u8; BLOCK as usize];
    for (lba, fill) in expected {
        lane.read(lba * BLOCK, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == fill), "block {lba}: {:#x}, not {fill:#x}", got[0]);
    }
}
