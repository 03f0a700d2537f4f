//! Engine configuration: cache mode, admission and eviction policies, sizes.

use std::fmt;
use std::str::FromStr;

/// How writes and read misses use the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Writes go to the cache only and are durable at acknowledgement; written back later.
    #[default]
    WriteBack,
    /// Writes go to the backing store and into the cache (clean).
    WriteThrough,
    /// Writes go to the backing store only; cached copies are invalidated. Reads admit.
    WriteAround,
    /// Reads and writes go to the backing store; the cache only serves what it already holds.
    PassThrough,
    /// Writes as write-back; read misses are not admitted.
    WriteOnly,
}

impl CacheMode {
    /// All modes, for tests and help texts.
    pub const ALL: [CacheMode; 5] = [
        CacheMode::WriteBack,
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::PassThrough,
        CacheMode::WriteOnly,
    ];

    /// Whether writes are absorbed by the cache (dirty) rather than sent to the backing store.
    pub fn writes_back(self) -> bool {
        matches!(self, CacheMode::WriteBack | CacheMode::WriteOnly)
    }

    /// Whether read misses may be admitted into the cache.
    pub fn admits_reads(self) -> bool {
        !matches!(self, CacheMode::PassThrough | CacheMode::WriteOnly)
    }

    fn name(self) -> &'static str {
        match self {
            CacheMode::WriteBack => "writeback",
            CacheMode::WriteThrough => "writethrough",
            CacheMode::WriteAround => "writearound",
            CacheMode::PassThrough => "passthrough",
            CacheMode::WriteOnly => "writeonly",
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        CacheMode::ALL.iter().position(|&m| m == self).expect("listed") as u8
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        CacheMode::ALL[value as usize]
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CacheMode::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            format!("unknown cache mode {s:?}; expected writeback, writethrough, writearound, passthrough or writeonly")
        })
    }
}

/// Which read misses are admitted into the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionConfig {
    /// Every miss.
    Always,
    /// Every miss, except the part of a sequential stream beyond `cutoff_bytes` (bcache's
    /// sequential cutoff; 4 MiB by default).
    SequentialCutoff {
        /// Bytes of a sequential stream that are still admitted.
        cutoff_bytes: u64,
    },
    /// A block is admitted on its `hits`-th miss within the recent window (n-hit promotion).
    NHit {
        /// Misses needed.
        hits: u8,
    },
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig::SequentialCutoff { cutoff_bytes: 4 << 20 }
    }
}

/// Which clean block to evict when space is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EvictionKind {
    /// CLOCK: a sweeping hand gives referenced blocks a second chance. No list, no list lock.
    #[default]
    Clock,
    /// FIFO: the same hand without reference bits, which evicts in insertion order once the
    /// cache is full (slots are refilled in hand order).
    Fifo,
}

impl EvictionKind {
    /// The policy implementing this kind.
    pub fn policy(self) -> &'static dyn crate::eviction::EvictionPolicy {
        match self {
            EvictionKind::Clock => &crate::eviction::Clock,
            EvictionKind::Fifo => &crate::eviction::Fifo,
        }
    }
}

impl FromStr for EvictionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "clock" => Ok(EvictionKind::Clock),
            "fifo" => Ok(EvictionKind::Fifo),
            _ => Err(format!("unknown eviction policy {s:?}; expected clock or fifo")),
        }
    }
}

/// Everything the engine is configured with.
#[derive(Clone, Debug)]
pub struct Config {
    /// Cache mode; can be changed while running with `Engine::set_mode`.
    pub mode: CacheMode,
    /// Block size used when formatting (ignored when attaching: the superblock's wins).
    pub block_size: u32,
    /// Most lanes (threads or queues) that may use the engine at once.
    pub max_lanes: usize,
    /// Read-miss admission.
    pub admission: AdmissionConfig,
    /// Eviction policy.
    pub eviction: EvictionKind,
    /// Buckets of the DRAM index (8 entries, one cache line each). `None`, the default, sizes
    /// it for the cache: 75 % of its entries in use when every slot holds a block, and at
    /// least 1,024 buckets. Fewer buckets than that make blocks compete for index room (a
    /// block whose three candidate buckets are full evicts a clean block of theirs or writes
    /// a dirty one back first), and fewer entries than slots cache fewer blocks than the
    /// slots could hold: the tests use a tiny index to reach those paths. Too few buckets for
    /// the slot count is a configuration error. Not recorded on the medium: each attach may
    /// choose anew.
    pub index_buckets: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mode: CacheMode::WriteBack,
            block_size: 4096,
            max_lanes: 64,
            admission: AdmissionConfig::default(),
            eviction: EvictionKind::Clock,
            index_buckets: None,
        }
    }
}
