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
    /// A mode's name, with or without the hyphen people write (`write-back`, `writeback`);
    /// it is printed without.
    fn from_str(s: &str) -> Result<Self, String> {
        let unhyphenated = s.replacen('-', "", 1);
        CacheMode::ALL.into_iter().find(|m| m.name() == unhyphenated).ok_or_else(|| {
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
    /// Which member of the cache a lane allocates from (a cache of several members, one per
    /// NUMA node: `placement.rs`). Not recorded on the medium.
    pub placement: crate::placement::PlacementConfig,
    /// Whether a format gives each slot's data a CRC32C, checked on every read of it from the
    /// cache (hits, write-back): `--data-crc`. Ignored when attaching (the superblock's
    /// feature flags win).
    pub data_crc: bool,
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
            placement: crate::placement::PlacementConfig::default(),
            data_crc: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each mode does with writes and read misses: write-back and write-only keep
    /// writes in the cache (durable there at acknowledgement), the rest write the backing
    /// store; pass-through and write-only never admit a read miss.
    #[test]
    fn each_mode_writes_and_admits_as_documented() {
        let table = [
            (CacheMode::WriteBack, "writeback", true, true),
            (CacheMode::WriteThrough, "writethrough", false, true),
            (CacheMode::WriteAround, "writearound", false, true),
            (CacheMode::PassThrough, "passthrough", false, false),
            (CacheMode::WriteOnly, "writeonly", true, false),
        ];
        assert_eq!(table.map(|row| row.0), CacheMode::ALL);
        let mut codes = Vec::new();
        for (mode, name, writes_back, admits_reads) in table {
            assert_eq!((mode.writes_back(), mode.admits_reads()), (writes_back, admits_reads));
            assert_eq!(mode.to_string(), name);
            assert_eq!(name.parse::<CacheMode>(), Ok(mode));
            let split = if name.starts_with("write") { 5 } else { 4 };
            let hyphenated = format!("{}-{}", &name[..split], &name[split..]);
            assert_eq!(hyphenated.parse::<CacheMode>(), Ok(mode), "{hyphenated}");
            assert_eq!(CacheMode::from_u8(mode.to_u8()), mode);
            codes.push(mode.to_u8());
        }
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), CacheMode::ALL.len(), "two modes share a code: {codes:?}");
    }

    #[test]
    fn unknown_names_are_refused_with_the_choices() {
        let err = "write-behind".parse::<CacheMode>().unwrap_err();
        assert!(err.contains("\"write-behind\"") && err.contains("writeonly"), "{err}");
        let err = "lru".parse::<EvictionKind>().unwrap_err();
        assert!(err.contains("\"lru\"") && err.contains("clock or fifo"), "{err}");
    }

    /// The defaults a deployment gets without options: write-back, 4 KiB blocks, bcache's
    /// sequential cutoff of 4 MiB, CLOCK, the index sized from the cache.
    #[test]
    fn the_defaults_are_the_documented_ones() {
        let config = Config::default();
        assert_eq!(config.mode, CacheMode::WriteBack);
        assert_eq!(config.block_size, 4096);
        assert_eq!(config.max_lanes, 64);
        assert_eq!(config.admission, AdmissionConfig::SequentialCutoff { cutoff_bytes: 4 << 20 });
        assert_eq!(config.eviction, EvictionKind::Clock);
        assert_eq!(config.index_buckets, None);
        assert_eq!(CacheMode::default(), CacheMode::WriteBack);
        assert_eq!(EvictionKind::default(), EvictionKind::Clock);
    }
}
