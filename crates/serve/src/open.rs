//! Opening a cache: the medium, the backing store, and the decision to
//! format, attach (recover) or refuse.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pmcache_backing::wrappers::{LatencyDist, LatencyStore};
use pmcache_backing::{BackingStore, EngineKind, EngineOptions, open_backing};
use pmcache_engine::format::{FormatError, MAGIC, SUPERBLOCK_BYTES, Superblock};
use pmcache_engine::layout::sort_members;
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, Error, EvictionKind, MonotonicClock,
    PlacementPolicy, RecoveryReport,
};
use pmcache_frontend::units::{human, parse_size};
use pmcache_frontend::{Backing, CacheEngine, CacheMedium};
use pmcache_media::{MEMBERS_MAX, Medium, MediumOptions, MediumSet, MediumSync, PmemFile, Window};

/// The size of a new cache medium when `--cache-size` is not given.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;
/// The block size of a new cache when `--block-size` is not given.
pub const DEFAULT_BLOCK_BYTES: u32 = 4096;

/// How to open a cache: its media, its backing store, and the engine's settings. The
/// `pmcache` command builds it from its flags; a program embedding the server fills it in.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// The media: one, or one per NUMA node (a set of members).
    pub cache: Vec<CacheSpec>,
    /// How a medium that is neither DAX nor volatile is made durable.
    pub medium_sync: MediumSync,
    /// The backing store: a file, a block device, or `rbd:...`.
    pub backing: PathBuf,
    /// Size of a new medium, each member's ([`DEFAULT_CACHE_BYTES`] when `None`); for an
    /// existing cache, it must be the media's size.
    pub cache_size: Option<u64>,
    /// Block size of a new cache ([`DEFAULT_BLOCK_BYTES`] when `None`); for an existing
    /// cache, it must be the cache's.
    pub block_size: Option<u32>,
    /// A CRC32C per cached block, for a new cache.
    pub data_crc: bool,
    /// The cache mode.
    pub mode: CacheMode,
    /// The backing store's I/O engine by name (`pmcache_backing::EngineKind::name`; io_uring
    /// when `None`).
    pub engine: Option<String>,
    /// The eviction policy.
    pub eviction: EvictionKind,
    /// Where a cache of several members places writes.
    pub placement: PlacementPolicy,
    /// Attach although the backing file is another file than the one formatted for.
    pub backing_moved: bool,
    /// Which read misses are admitted.
    pub admission: AdmissionConfig,
    /// A latency added to every backing-store read and write.
    pub backing_latency: Option<LatencyDist>,
}

impl CacheConfig {
    /// The defaults of `pmcache serve` for the cache on `cache` in front of `backing`.
    pub fn new(cache: impl Into<PathBuf>, backing: impl Into<PathBuf>) -> Self {
        Self::of_media(vec![CacheSpec { path: cache.into(), node: None }], backing)
    }

    /// [`CacheConfig::new`] for a cache of the members `cache`.
    pub fn of_media(cache: Vec<CacheSpec>, backing: impl Into<PathBuf>) -> Self {
        Self {
            cache,
            medium_sync: MediumSync::default(),
            backing: backing.into(),
            cache_size: None,
            block_size: None,
            data_crc: false,
            mode: CacheMode::default(),
            engine: None,
            eviction: EvictionKind::default(),
            placement: PlacementPolicy::default(),
            backing_moved: false,
            admission: AdmissionConfig::default(),
            backing_latency: None,
        }
    }
}

fn engine_options(name: Option<&str>) -> Result<EngineOptions, String> {
    let engine = match name {
        None => None,
        Some(name) => {
            Some(EngineKind::ALL.into_iter().find(|e| e.name() == name).ok_or_else(|| {
                let names: Vec<&str> = EngineKind::ALL.iter().map(|e| e.name()).collect();
                format!("unknown engine {name:?}; expected one of {}", names.join(", "))
            })?)
        }
    };
    Ok(EngineOptions { engine, ..EngineOptions::default() })
}

/// Parses an admission policy: `always`, `seq-cutoff=SIZE` (K, M, G suffixes) or `n-hit=N`
/// (1..=254).
pub fn parse_admission(text: &str) -> Result<AdmissionConfig, String> {
    let expected = "expected always, seq-cutoff=SIZE (e.g. seq-cutoff=4M) or n-hit=N";
    match text.split_once('=') {
        None if text == "always" => Ok(AdmissionConfig::Always),
        Some(("seq-cutoff", size)) => Ok(AdmissionConfig::SequentialCutoff {
            cutoff_bytes: parse_size(size).map_err(|e| format!("seq-cutoff: {e}"))?,
        }),
        Some(("n-hit", n)) => match n.parse::<u8>() {
            Ok(hits @ 1..=254) => Ok(AdmissionConfig::NHit { hits }),
            _ => Err(format!("n-hit={n}: N is a count of misses from 1 to 254")),
        },
        _ => Err(format!("unknown admission policy {text:?}; {expected}")),
    }
}

/// An admission policy as `--admission` spells it.
pub fn admission_name(config: AdmissionConfig) -> String {
    match config {
        AdmissionConfig::Always => "always".into(),
        AdmissionConfig::SequentialCutoff { cutoff_bytes } => {
            format!("seq-cutoff={}", size_name(cutoff_bytes))
        }
        AdmissionConfig::NHit { hits } => format!("n-hit={hits}"),
    }
}

/// `bytes` with the largest suffix (K, M, G) that divides it, as `parse_size` reads it back.
fn size_name(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Opens the backing store with the engine asked for.
pub fn open_backing_store(path: &Path, engine: Option<&str>) -> Result<Backing, String> {
    open_backing(path, &engine_options(engine)?).map_err(|e| e.to_string())
}

/// Opens a cache's backing store as its arguments say (engine, added latency).
pub(crate) fn open_cache_backing(config: &CacheConfig) -> Result<Backing, String> {
    let backing = open_backing_store(&config.backing, config.engine.as_deref())?;
    Ok(match config.backing_latency {
        Some(dist) => Arc::new(LatencyStore::new(backing, dist, 0x1a7e)),
        None => backing,
    })
}

/// A backing store whose identity leaves out which file it is (its inode): what
/// `--backing-moved` attaches with, so the superblock's record of the file is not compared.
struct MovedBacking(Backing);

impl BackingStore for MovedBacking {
    pmcache_backing::forward_to!(0: size_bytes, logical_block_size, read_at, write_at, flush,
        discard, write_zeroes, extent_at, engine_name, is_direct, failed_flush_loses_writes,
        release, claim, disclaim);
    fn identity(&self) -> pmcache_backing::BackingIdentity {
        pmcache_backing::BackingIdentity { instance: 0, ..self.0.identity() }
    }
    fn open_queue(
        &self,
        depth: usize,
    ) -> pmcache_backing::Result<Box<dyn pmcache_backing::IoQueue>> {
        self.0.open_queue(depth)
    }
}

/// A block device recorded by its persistent name (`crate::backing_id`: its WWID, its
/// device-mapper UUID, its loop device's file ...) rather than its node's path: the identity's
/// fingerprint is that name's, so a cache attaches to its device whichever node (`nvme0n1`,
/// `nvme1n1`, `loop3`) the device has after a reboot.
struct NamedDevice {
    inner: Backing,
    fingerprint: [u8; 16],
}

impl BackingStore for NamedDevice {
    pmcache_backing::forward_to!(inner: size_bytes, logical_block_size, read_at, write_at, flush,
        discard, write_zeroes, extent_at, engine_name, is_direct, failed_flush_loses_writes,
        release, claim, disclaim);
    fn identity(&self) -> pmcache_backing::BackingIdentity {
        pmcache_backing::BackingIdentity { fingerprint: self.fingerprint, ..self.inner.identity() }
    }
    fn open_queue(
        &self,
        depth: usize,
    ) -> pmcache_backing::Result<Box<dyn pmcache_backing::IoQueue>> {
        self.inner.open_queue(depth)
    }
}

/// The fingerprint a cache records for the block device at `path`: that of its persistent
/// name; `None` for a file, an RBD image, or a device without a persistent name (recorded by
/// its canonical path).
fn device_name_fingerprint(path: &Path) -> Option<[u8; 16]> {
    match crate::backing_id::BackingId::of(path).ok()? {
        crate::backing_id::BackingId::Device { key, stable: true } => {
            Some(pmcache_backing::bytes_fingerprint(format!("device-name:{key}").as_bytes()))
        }
        _ => None,
    }
}

/// The backing store a new cache is formatted over: a block device with a persistent name is
/// recorded by that name.
pub(crate) fn backing_to_format(config: &CacheConfig, backing: Backing) -> Backing {
    match device_name_fingerprint(&config.backing) {
        Some(fingerprint) => Arc::new(NamedDevice { inner: backing, fingerprint }),
        None => backing,
    }
}

/// The backing store an existing cache (whose superblock heads `medium`) attaches to: a block
/// device by its persistent name where the superblock records it so (else by its path, as a
/// cache formatted over it by path was); and with `--backing-moved`, without the record of
/// which file it is.
pub(crate) fn backing_to_attach(
    config: &CacheConfig,
    backing: Backing,
    medium: &impl Medium,
) -> Backing {
    let recorded = superblock_of(medium).map(|superblock| superblock.backing.fingerprint);
    let backing = match device_name_fingerprint(&config.backing) {
        Some(fingerprint) if recorded == Some(fingerprint) => {
            Arc::new(NamedDevice { inner: backing, fingerprint })
        }
        _ => backing,
    };
    if config.backing_moved { Arc::new(MovedBacking(backing)) } else { backing }
}

/// The superblock heading `medium`, if its bytes decode as one.
fn superblock_of(medium: &impl Medium) -> Option<Superblock> {
    let len_bytes = medium.len_bytes();
    let mut head = vec![0u8; SUPERBLOCK_BYTES.min(len_bytes) as usize];
    medium.read(0, &mut head);
    Superblock::decode(&head, len_bytes).ok()
}

/// Claims the backing store for the cache whose superblock heads `medium` (its uuid) before
/// the engine opens it: an RBD image records on itself which cache may hold dirty blocks
/// there, refuses another cache while one does, and takes no write before the claim — and
/// recovery may write back (docs/RBD.md). A superblock that does not decode claims nothing
/// here: the open refuses it. Other stores take any claim.
pub(crate) fn claim_for_medium(
    backing: &Backing,
    medium: &impl Medium,
    describe: &str,
) -> Result<(), String> {
    match superblock_of(medium) {
        Some(superblock) => claim(backing, superblock.uuid, describe),
        None => Ok(()),
    }
}

/// Claims the backing store for the cache `uuid` (see [`claim_for_medium`]).
pub(crate) fn claim(backing: &Backing, uuid: [u8; 16], describe: &str) -> Result<(), String> {
    backing.claim(uuid, false).map_err(|e| format!("{describe}: {e}"))
}

/// The message for a failed attach, with the way out where there is one.
pub(crate) fn attach_error(config: &CacheConfig, e: Error) -> String {
    let hint = match e {
        Error::Format(FormatError::BackingReplaced { .. }) => {
            " (if that file holds the same data — copied, moved across file systems or \
             restored — attach with --backing-moved; `pmcache detach` with it writes the dirty \
             blocks back, after which the cache can be formatted for the new file)"
        }
        _ => "",
    };
    format!("{}: {e}{hint}", config.describe())
}

/// Engine configuration from the command line.
pub fn engine_config(config: &CacheConfig, max_lanes: usize) -> Config {
    Config {
        mode: config.mode,
        block_size: config.block_size.unwrap_or(DEFAULT_BLOCK_BYTES),
        max_lanes,
        admission: config.admission,
        eviction: config.eviction,
        placement: pmcache_engine::PlacementConfig {
            policy: config.placement,
            ..Default::default()
        },
        data_crc: config.data_crc,
        ..Config::default()
    }
}

/// What was on the medium.
pub enum Opened {
    /// A new cache was formatted.
    Formatted,
    /// An existing cache was attached.
    Attached(RecoveryReport),
}

/// Opens (creating if missing) one member's medium, locks it against other processes, and
/// reserves its space: on a file system without room for it (a full `/dev/shm`) the cache
/// must fail now with a message, not die of SIGBUS at its first store into a hole. Returns it
/// with its node: the one given (`PATH@NODE`), else the one it declares.
pub(crate) fn open_member(
    config: &CacheConfig,
    spec: &CacheSpec,
) -> Result<(PmemFile, Option<u32>), MediumError> {
    let options = MediumOptions {
        create_len_bytes: Some(config.new_cache_bytes()),
        sync: config.medium_sync,
    };
    let medium =
        PmemFile::open_with(&spec.path, &options).map_err(|e| MediumError::Other(e.to_string()))?;
    medium.lock_exclusive().map_err(|e| MediumError::Locked(e.to_string()))?;
    medium.reserve().map_err(|e| MediumError::Other(e.to_string()))?;
    let node = crate::numa::report_medium_node(&spec.path, &medium, spec.node);
    Ok((medium, node))
}

/// Opens every member given, in the order given. Members of different kinds (a DAX medium
/// beside a volatile one) are refused: the cache would promise only the weaker durability
/// for every block, which no operator asks for by accident.
fn open_members(config: &CacheConfig) -> Result<Vec<(PmemFile, Option<u32>)>, MediumError> {
    let members: Vec<(PmemFile, Option<u32>)> =
        config.cache.iter().map(|spec| open_member(config, spec)).collect::<Result<_, _>>()?;
    let kind = members[0].0.kind();
    if let Some(at) = members.iter().position(|(medium, _)| medium.kind() != kind) {
        return Err(MediumError::Other(format!(
            "{} is {} but {} is {}: a cache's members are all of one kind",
            config.cache[at].path.display(),
            members[at].0.kind(),
            config.cache[0].path.display(),
            kind
        )));
    }
    Ok(members)
}

/// The kind of a cache's media (all its members are of one kind: `open_members`).
pub fn kind_of(medium: &CacheMedium) -> pmcache_media::MediumKind {
    medium.media().next().expect("a set has a member").inner().kind()
}

/// The members as one medium: for an existing cache, in the order their superblocks record
/// (the order they were given in does not matter; the attach checks that none is missing).
fn as_set(mut members: Vec<(PmemFile, Option<u32>)>, existing: bool) -> CacheMedium {
    if existing {
        sort_members(&mut members);
    }
    MediumSet::new(
        members.into_iter().map(|(file, node)| (Window::whole(Arc::new(file)), node)).collect(),
    )
}

/// Why a medium could not be opened: another process holds its lock, or anything else.
pub(crate) enum MediumError {
    Locked(String),
    Other(String),
}

impl MediumError {
    pub(crate) fn into_message(self) -> String {
        match self {
            MediumError::Locked(e) | MediumError::Other(e) => e,
        }
    }
}

/// One `--cache`: a medium's path, and the NUMA node it is for when given (`PATH@NODE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSpec {
    /// The medium.
    pub path: PathBuf,
    /// The node given after `@`, if any.
    pub node: Option<u32>,
}

impl std::str::FromStr for CacheSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((path, node)) = s.rsplit_once('@')
            && !node.is_empty()
            && node.bytes().all(|b| b.is_ascii_digit())
        {
            if path.is_empty() {
                return Err(format!("{s:?}: a cache medium path is needed before @{node}"));
            }
            let node = node.parse::<u32>().ok().filter(|&n| n < 1 << 16).ok_or_else(|| {
                format!("{s:?}: NUMA node {node} is out of range (a node number is below 65536)")
            })?;
            return Ok(Self { path: PathBuf::from(path), node: Some(node) });
        }
        if s.is_empty() {
            return Err("an empty cache medium path".into());
        }
        Ok(Self { path: PathBuf::from(s), node: None })
    }
}

impl CacheConfig {
    /// The size a new medium is created with.
    pub fn new_cache_bytes(&self) -> u64 {
        self.cache_size.unwrap_or(DEFAULT_CACHE_BYTES)
    }

    /// The media given, for messages: one path, or the paths joined with " + ".
    pub fn describe(&self) -> String {
        self.cache
            .iter()
            .map(|spec| spec.path.display().to_string())
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// Refuses `--cache-size` and `--block-size` given for an existing cache that has another:
/// they shape a new cache only, and an operator who names a size expects to get it, not a
/// silent attach of what is there. An unreadable superblock is left for the attach to
/// report.
fn check_geometry_asked(
    config: &CacheConfig,
    members: &[(PmemFile, Option<u32>)],
) -> Result<(), String> {
    for (spec, (medium, _)) in config.cache.iter().zip(members) {
        check_size_asked(config, &spec.path, medium)?;
        let path = spec.path.display();
        let len_bytes = medium.len_bytes();
        if let Some(asked) = config.block_size {
            let mut head = vec![0u8; SUPERBLOCK_BYTES.min(len_bytes) as usize];
            medium.read(0, &mut head);
            if let Ok(superblock) = Superblock::decode(&head, len_bytes)
                && superblock.geometry.block_size != asked
            {
                return Err(format!(
                    "{path} holds a cache of {} B blocks, not the {asked} B --block-size asks \
                     for: the block size shapes a new cache only; omit --block-size to attach \
                     this one (to change it: `pmcache detach`, then `pmcache format --force`)",
                    superblock.geometry.block_size
                ));
            }
        }
        if config.data_crc {
            let mut head = vec![0u8; SUPERBLOCK_BYTES.min(len_bytes) as usize];
            medium.read(0, &mut head);
            if let Ok(superblock) = Superblock::decode(&head, len_bytes)
                && !superblock.geometry.data_crc
            {
                return Err(format!(
                    "{path} holds a cache formatted without data checksums: --data-crc shapes \
                     a new cache only; omit it to attach this one (to add checksums: `pmcache \
                     detach`, then `pmcache format --force --data-crc`)"
                ));
            }
        }
    }
    Ok(())
}

/// Refuses a `--cache-size` other than the size of the medium opened: an existing file or
/// device keeps its size (only a new or empty file is created at the size asked).
pub(crate) fn check_size_asked(
    config: &CacheConfig,
    path: &Path,
    medium: &PmemFile,
) -> Result<(), String> {
    let len_bytes = medium.len_bytes();
    match config.cache_size {
        Some(asked) if asked != len_bytes => Err(format!(
            "{} is an existing medium of {} ({len_bytes} bytes), not the {} ({asked} bytes) \
             --cache-size asks for: the size shapes a new medium only; omit --cache-size to use \
             this one (to resize: `pmcache detach`, remove the medium, create it again)",
            path.display(),
            human(len_bytes),
            human(asked)
        )),
        _ => Ok(()),
    }
}

/// The first member given whose first bytes are all zero (new or never formatted).
fn first_blank<'a>(
    config: &'a CacheConfig,
    members: &[(PmemFile, Option<u32>)],
) -> Option<&'a Path> {
    config.cache.iter().zip(members).find_map(|(spec, (medium, _))| {
        let mut head = [0u8; 4096];
        medium.read(0, &mut head);
        head.iter().all(|&b| b == 0).then_some(spec.path.as_path())
    })
}

/// What a cache path held before it was opened: `serve` formats only media it creates now
/// or finds empty.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Before {
    Missing,
    Empty,
    Holding,
}

pub(crate) fn before_open(path: &Path) -> Result<Before, String> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Before::Missing),
        Err(e) => Err(format!("{}: {e}", path.display())),
        Ok(meta) if meta.is_file() && meta.len() == 0 => Ok(Before::Empty),
        Ok(_) => Ok(Before::Holding),
    }
}

/// Refuses a set given twice the same medium, or more members than a cache has.
fn check_members_given(config: &CacheConfig) -> Result<(), String> {
    if config.cache.len() > MEMBERS_MAX {
        return Err(format!(
            "{} cache media given; a cache has at most {MEMBERS_MAX} members (one per NUMA node)",
            config.cache.len()
        ));
    }
    for (i, spec) in config.cache.iter().enumerate() {
        if config.cache[..i].iter().any(|other| other.path == spec.path) {
            return Err(format!("{} is given twice as a cache medium", spec.path.display()));
        }
    }
    Ok(())
}

/// Formats media that are all new (missing, or empty files), attaches (recovering) a cache
/// whose media all hold it, and refuses anything else with a precise message, changing
/// nothing: foreign data, a medium whose superblock page reads zero (a cache whose superblock
/// was lost may still hold dirty data; only `pmcache format --force` formats it), and a set
/// of members some new and some not (a set is formatted or attached whole). Media created
/// here that cannot be formatted are removed again.
pub fn open_or_format(
    config: &CacheConfig,
    max_lanes: usize,
) -> Result<(CacheEngine, Opened), String> {
    check_members_given(config)?;
    let backing = open_cache_backing(config)?;
    let settings = engine_config(config, max_lanes);
    let describe = |e: Error| format!("{}: {e}", config.describe());
    let mut before: Vec<Before> =
        config.cache.iter().map(|spec| before_open(&spec.path)).collect::<Result<_, _>>()?;
    let new = |before: &[Before]| !before.contains(&Before::Holding);
    if new(&before) {
        // Refusals a format would make, before anything is created.
        let sizes = vec![config.new_cache_bytes(); config.cache.len()];
        CacheEngine::check_format_set(&sizes, backing.size_bytes(), &settings).map_err(describe)?;
        for (spec, state) in config.cache.iter().zip(before.iter_mut()) {
            if *state != Before::Missing {
                continue;
            }
            // Created here, atomically: a server racing this one for the same new path finds
            // it existing, and attaches or refuses; it never removes what this one serves.
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&spec.path) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => *state = Before::Holding,
                Err(e) => {
                    undo_new_media(config, &before);
                    return Err(format!("{}: {e}", spec.path.display()));
                }
            }
        }
    }
    if new(&before) {
        let members = match open_members(config) {
            Ok(members) => members,
            // Another process holds a medium: it is theirs now, whoever created it.
            Err(MediumError::Locked(e)) => return Err(e),
            Err(MediumError::Other(e)) => {
                undo_new_media(config, &before);
                return Err(e);
            }
        };
        return match Engine::format(
            as_set(members, false),
            backing_to_format(config, backing),
            MonotonicClock::default(),
            &settings,
        ) {
            Ok(engine) => {
                // Before anything of the new cache reaches the backing store.
                claim(engine.backing(), engine.superblock().uuid, &config.describe())?;
                Ok((engine, Opened::Formatted))
            }
            Err(e) => {
                undo_new_media(config, &before);
                Err(describe(e))
            }
        };
    }
    if before.iter().any(|&b| b != Before::Holding) {
        // Nothing was created: a format creates only when every member is new.
        let new: Vec<String> = config
            .cache
            .iter()
            .zip(&before)
            .filter(|(_, b)| **b != Before::Holding)
            .map(|(spec, _)| spec.path.display().to_string())
            .collect();
        return Err(format!(
            "{} new or empty while the other cache media hold data: a cache's members are \
             formatted together (`pmcache format --force` with every --cache) or attached \
             together; nothing was changed",
            new.join(", ")
        ));
    }
    let members = open_members(config).map_err(MediumError::into_message)?;
    if let Some(blank) = first_blank(config, &members) {
        return Err(format!(
            "{} has no cache superblock (its first 4 KiB are zero) but is not empty: it may be \
             a cache whose superblock was lost, still holding dirty data; refusing to format it \
             (`pmcache format --force` formats it; nothing on it was changed)",
            blank.display()
        ));
    }
    check_geometry_asked(config, &members)?;
    let backing = backing_to_attach(config, backing, &members[0].0);
    claim_for_medium(&backing, &members[0].0, &config.describe())?;
    match Engine::open(as_set(members, true), backing, MonotonicClock::default(), &settings) {
        Ok((engine, report)) => Ok((engine, Opened::Attached(report))),
        Err(Error::Format(FormatError::BadMagic { found }))
            if found == pmcache_engine::stores::STORE_TABLE_MAGIC =>
        {
            Err(format!(
                "{} is a cache shared by several backing stores (it starts with a store \
                 table): serve it with --store NAME=PATH for each of its stores instead of \
                 --backing (`pmcache check` names them)",
                config.describe()
            ))
        }
        Err(Error::Format(FormatError::BadMagic { found })) if found != MAGIC => Err(format!(
            "{} holds data that is not a pmcache cache; refusing to overwrite it (use `pmcache format --force` to reformat)",
            config.describe()
        )),
        Err(e) => Err(attach_error(config, e)),
    }
}

/// Puts new media's paths back as they were after a format that failed (rare once
/// `check_format` passed: no room to reserve, no memory for the DRAM tables).
fn undo_new_media(config: &CacheConfig, before: &[Before]) {
    for (spec, state) in config.cache.iter().zip(before) {
        let _ = match state {
            Before::Missing => std::fs::remove_file(&spec.path),
            Before::Empty => {
                std::fs::OpenOptions::new().write(true).open(&spec.path).and_then(|f| f.set_len(0))
            }
            Before::Holding => Ok(()),
        };
    }
}

/// Attaches (recovering) the cache on the media, never formatting it: a blank superblock
/// page is refused with a message, whatever the rest of the medium holds.
pub fn open_existing(config: &CacheConfig, max_lanes: usize) -> Result<CacheEngine, String> {
    check_members_given(config)?;
    let backing = open_cache_backing(config)?;
    let members = open_members(config).map_err(MediumError::into_message)?;
    if let Some(blank) = first_blank(config, &members) {
        return Err(format!(
            "{} has no cache superblock (its first 4 KiB are zero); nothing to attach, and \
             nothing on it was changed",
            blank.display()
        ));
    }
    check_geometry_asked(config, &members)?;
    let backing = backing_to_attach(config, backing, &members[0].0);
    claim_for_medium(&backing, &members[0].0, &config.describe())?;
    let settings = engine_config(config, max_lanes);
    Engine::open(as_set(members, true), backing, MonotonicClock::default(), &settings)
        .map(|(engine, _)| engine)
        .map_err(|e| attach_error(config, e))
}

/// Formats the media as one cache (one member each, in the order given), refusing to
/// overwrite a medium that is not blank unless `force`.
pub fn format(config: &CacheConfig, force: bool) -> Result<CacheEngine, String> {
    check_members_given(config)?;
    let backing = open_cache_backing(config)?;
    let members = open_members(config).map_err(MediumError::into_message)?;
    if !force {
        for (spec, (medium, _)) in config.cache.iter().zip(&members) {
            let mut head = [0u8; 4096];
            medium.read(0, &mut head);
            if head.iter().any(|&b| b != 0) {
                return Err(format!(
                    "{} is not blank (it may hold a cache with dirty data); pass --force to \
                     reformat it",
                    spec.path.display()
                ));
            }
        }
    }
    for (spec, (medium, _)) in config.cache.iter().zip(&members) {
        check_size_asked(config, &spec.path, medium)?;
    }
    let engine = Engine::format(
        as_set(members, false),
        backing_to_format(config, backing),
        MonotonicClock::default(),
        &engine_config(config, 4),
    )
    .map_err(|e| format!("{}: {e}", config.describe()))?;
    claim(engine.backing(), engine.superblock().uuid, &config.describe())?;
    Ok(engine)
}
