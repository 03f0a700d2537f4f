//! Opening a cache from the command line: the medium, the backing store, and the decision to
//! format, attach (recover) or refuse.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pmcache_backing::wrappers::{LatencyDist, LatencyStore};
use pmcache_backing::{BackingStore, EngineKind, EngineOptions, open_backing};
use pmcache_engine::format::{FormatError, MAGIC, SUPERBLOCK_BYTES, Superblock};
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, Error, EvictionKind, MonotonicClock, RecoveryReport,
};
use pmcache_frontend::units::{human, parse_size};
use pmcache_frontend::{Backing, CacheEngine};
use pmcache_media::{Medium, MediumOptions, MediumSync, PmemFile};

/// The size of a new cache medium when `--cache-size` is not given.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;
/// The block size of a new cache when `--block-size` is not given.
pub const DEFAULT_BLOCK_BYTES: u32 = 4096;

/// `--medium-sync`'s long help (shared by the commands that open a medium).
pub const MEDIUM_SYNC_HELP: &str = "How a cache medium that is neither DAX nor volatile is made \
durable. `auto`: DAX (a MAP_SYNC mapping: a file on a DAX file system, or device-dax) is \
persistent; a file on tmpfs, ramfs or hugetlbfs (/dev/shm) is volatile (survives a crash of \
the process, not a reboot); anything else (a file on ext4, xfs, ..., a block device) is \
refused, since its mapping lives in the page cache and would come back from a power cut as an \
arbitrary subset of its pages. `msync`: accept such a medium and make every persist call \
msync(MS_SYNC) on the pages it covers, so that each acknowledged write is on the device. The \
cost: every cache write waits for two msyncs (its data block's page, then its metadata \
entry's), each a page write and a device flush: some hundreds of writes per second on a disk against hundreds of thousands \
on /dev/shm (`pmcache bench media-kinds` measures it here).";

/// Options shared by the commands that open a cache.
#[derive(Debug, Clone, clap::Args)]
pub struct CacheArgs {
    /// The cache medium: a file on a DAX file system, a device-dax node, or a file in
    /// /dev/shm (emulated PM); any other file only with --medium-sync msync. Created with
    /// --cache-size when missing or empty.
    #[arg(long)]
    pub cache: PathBuf,
    /// How a medium that is neither DAX nor volatile is made durable.
    #[arg(long, default_value = "auto", value_name = "auto|msync", long_help = MEDIUM_SYNC_HELP)]
    pub medium_sync: MediumSync,
    /// The backing store: a file or block device.
    #[arg(long)]
    pub backing: PathBuf,
    /// Size of a new cache medium (K, M, G, T suffixes; powers of 1024) [default: 1G]. Given
    /// for an existing cache, it must be the medium's size.
    #[arg(long, value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// Cache block size in bytes, for a new cache [default: 4096]. Given for an existing
    /// cache, it must be the cache's.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Cache mode.
    #[arg(long, default_value = "writeback")]
    pub mode: CacheMode,
    /// Backing-store I/O engine: psync, pvsync2, pvsync2-hipri, libaio, io_uring,
    /// io_uring-iopoll, io_uring-sqpoll (default: io_uring; see docs/ENGINES.md).
    #[arg(long)]
    pub engine: Option<String>,
    /// Eviction policy: clock or fifo.
    #[arg(long, default_value = "clock")]
    pub eviction: EvictionKind,
    /// Attach an existing cache although the file at --backing is another file than the one
    /// it was formatted for (another inode: a copy, a move across file systems, a restore).
    /// You vouch that it holds the data the cache was written over; its size and path must
    /// still match. Needed at every attach until the cache is formatted again.
    #[arg(long)]
    pub backing_moved: bool,
    /// Give every backing-store read and write at least this latency, as a slower device
    /// would (for benches and tests of a cache in front of a network disk or an HDD): a time
    /// (`2ms`, `500us`) or a device preset (`hdd`: 2–14 ms, `sata-ssd`: 90–300 µs,
    /// `nvme-ssd`: 60–70 µs). Requests overlap without limit.
    #[arg(long, value_parser = LatencyDist::parse, value_name = "TIME|hdd|sata-ssd|nvme-ssd")]
    pub backing_latency: Option<LatencyDist>,
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

/// Opens the backing store with the engine asked for.
pub fn open_backing_store(path: &Path, engine: Option<&str>) -> Result<Backing, String> {
    open_backing(path, &engine_options(engine)?).map_err(|e| e.to_string())
}

/// Opens a cache's backing store as its arguments say (engine, added latency).
fn open_cache_backing(args: &CacheArgs) -> Result<Backing, String> {
    let backing = open_backing_store(&args.backing, args.engine.as_deref())?;
    Ok(match args.backing_latency {
        Some(dist) => Arc::new(LatencyStore::new(backing, dist, 0x1a7e)),
        None => backing,
    })
}

/// A backing store whose identity leaves out which file it is (its inode): what
/// `--backing-moved` attaches with, so the superblock's record of the file is not compared.
struct MovedBacking(Backing);

impl BackingStore for MovedBacking {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn logical_block_size(&self) -> u32 {
        self.0.logical_block_size()
    }
    fn identity(&self) -> pmcache_backing::BackingIdentity {
        pmcache_backing::BackingIdentity { instance: 0, ..self.0.identity() }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> pmcache_backing::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> pmcache_backing::Result<()> {
        self.0.write_at(data, offset)
    }
    fn flush(&self) -> pmcache_backing::Result<()> {
        self.0.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        self.0.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> pmcache_backing::Result<()> {
        self.0.write_zeroes(offset, len)
    }
    fn extent_at(&self, offset: u64, len: u64) -> pmcache_backing::Result<pmcache_backing::Extent> {
        self.0.extent_at(offset, len)
    }
    fn engine_name(&self) -> &'static str {
        self.0.engine_name()
    }
    fn is_direct(&self) -> bool {
        self.0.is_direct()
    }
    fn open_queue(
        &self,
        depth: usize,
    ) -> pmcache_backing::Result<Box<dyn pmcache_backing::IoQueue>> {
        self.0.open_queue(depth)
    }
}

/// The backing store an existing cache attaches to: as opened, or, with `--backing-moved`,
/// without the record of which file it is.
fn backing_to_attach(args: &CacheArgs, backing: Backing) -> Backing {
    if args.backing_moved { Arc::new(MovedBacking(backing)) } else { backing }
}

/// The message for a failed attach, with the way out where there is one.
fn attach_error(args: &CacheArgs, e: Error) -> String {
    let hint = match e {
        Error::Format(FormatError::BackingReplaced { .. }) => {
            " (if that file holds the same data — copied, moved across file systems or \
             restored — attach with --backing-moved; `pmcache detach` with it writes the dirty \
             blocks back, after which the cache can be formatted for the new file)"
        }
        _ => "",
    };
    format!("{}: {e}{hint}", args.cache.display())
}

/// Engine configuration from the command line.
pub fn engine_config(args: &CacheArgs, max_lanes: usize) -> Config {
    Config {
        mode: args.mode,
        block_size: args.block_size.unwrap_or(DEFAULT_BLOCK_BYTES),
        max_lanes,
        admission: AdmissionConfig::default(),
        eviction: args.eviction,
        index_buckets: None,
    }
}

/// What was on the medium.
pub enum Opened {
    /// A new cache was formatted.
    Formatted,
    /// An existing cache was attached.
    Attached(RecoveryReport),
}

/// Opens (creating if missing) the cache medium, locks it against other processes, and
/// reserves its space: on a file system without room for it (a full `/dev/shm`) the cache
/// must fail now with a message, not die of SIGBUS at its first store into a hole.
fn open_medium(args: &CacheArgs) -> Result<PmemFile, MediumError> {
    let options =
        MediumOptions { create_len_bytes: Some(args.new_cache_bytes()), sync: args.medium_sync };
    let medium = PmemFile::open_with(&args.cache, &options)
        .map_err(|e| MediumError::Other(e.to_string()))?;
    medium.lock_exclusive().map_err(|e| MediumError::Locked(e.to_string()))?;
    medium.reserve().map_err(|e| MediumError::Other(e.to_string()))?;
    crate::numa::report_medium_node(&medium);
    Ok(medium)
}

/// Why a medium could not be opened: another process holds its lock, or anything else.
enum MediumError {
    Locked(String),
    Other(String),
}

impl MediumError {
    fn into_message(self) -> String {
        match self {
            MediumError::Locked(e) | MediumError::Other(e) => e,
        }
    }
}

impl CacheArgs {
    /// The size a new medium is created with.
    pub fn new_cache_bytes(&self) -> u64 {
        self.cache_size.unwrap_or(DEFAULT_CACHE_BYTES)
    }
}

/// Refuses `--cache-size` and `--block-size` given for an existing cache that has another:
/// they shape a new cache only, and an operator who names a size expects to get it, not a
/// silent attach of what is there. An unreadable superblock is left for the attach to
/// report.
fn check_geometry_asked(args: &CacheArgs, medium: &PmemFile) -> Result<(), String> {
    check_size_asked(args, medium)?;
    let path = args.cache.display();
    let len_bytes = medium.len_bytes();
    if let Some(asked) = args.block_size {
        let mut head = vec![0u8; SUPERBLOCK_BYTES.min(len_bytes) as usize];
        medium.read(0, &mut head);
        if let Ok(superblock) = Superblock::decode(&head, len_bytes)
            && superblock.geometry.block_size != asked
        {
            return Err(format!(
                "{path} holds a cache of {} B blocks, not the {asked} B --block-size asks for: \
                 the block size shapes a new cache only; omit --block-size to attach this one \
                 (to change it: `pmcache detach`, then `pmcache format --force`)",
                superblock.geometry.block_size
            ));
        }
    }
    Ok(())
}

/// Refuses a `--cache-size` other than the size of the medium opened: an existing file or
/// device keeps its size (only a new or empty file is created at the size asked).
fn check_size_asked(args: &CacheArgs, medium: &PmemFile) -> Result<(), String> {
    let len_bytes = medium.len_bytes();
    match args.cache_size {
        Some(asked) if asked != len_bytes => Err(format!(
            "{} is an existing medium of {} ({len_bytes} bytes), not the {} ({asked} bytes) \
             --cache-size asks for: the size shapes a new medium only; omit --cache-size to use \
             this one (to resize: `pmcache detach`, remove the medium, create it again)",
            args.cache.display(),
            human(len_bytes),
            human(asked)
        )),
        _ => Ok(()),
    }
}

/// Whether the medium's first bytes are all zero (new or never formatted).
fn is_blank(medium: &PmemFile) -> bool {
    let mut head = [0u8; 4096];
    medium.read(0, &mut head);
    head.iter().all(|&b| b == 0)
}

/// What the cache path held before it was opened: `serve` formats only a medium it creates
/// now or finds empty.
enum Before {
    Missing,
    Empty,
    Holding,
}

fn before_open(path: &Path) -> Result<Before, String> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Before::Missing),
        Err(e) => Err(format!("{}: {e}", path.display())),
        Ok(meta) if meta.is_file() && meta.len() == 0 => Ok(Before::Empty),
        Ok(_) => Ok(Before::Holding),
    }
}

/// Formats a medium that is new (missing, or an empty file), attaches (recovering) one that
/// holds a pmcache of this backing store, and refuses anything else with a precise message,
/// changing nothing: foreign data, and a medium whose superblock page reads zero (a cache
/// whose superblock was lost may still hold dirty data; only `pmcache format --force`
/// formats it). A new medium that cannot be formatted is removed again.
pub fn open_or_format(args: &CacheArgs, max_lanes: usize) -> Result<(CacheEngine, Opened), String> {
    let backing = open_cache_backing(args)?;
    let config = engine_config(args, max_lanes);
    let describe = |e: Error| format!("{}: {e}", args.cache.display());
    let mut before = before_open(&args.cache)?;
    if !matches!(before, Before::Holding) {
        // Refusals a format would make, before anything is created.
        CacheEngine::check_format(args.new_cache_bytes(), backing.size_bytes(), &config)
            .map_err(describe)?;
    }
    if matches!(before, Before::Missing) {
        // Created here, atomically: a server racing this one for the same new path finds it
        // existing, and attaches or refuses; it never removes what this one serves.
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&args.cache) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => before = Before::Holding,
            Err(e) => return Err(format!("{}: {e}", args.cache.display())),
        }
    }
    if !matches!(before, Before::Holding) {
        let medium = match open_medium(args) {
            Ok(medium) => medium,
            // Another process holds the medium: it is theirs now, whoever created it.
            Err(MediumError::Locked(e)) => return Err(e),
            Err(MediumError::Other(e)) => {
                undo_new_medium(&args.cache, &before);
                return Err(e);
            }
        };
        return match Engine::format(medium, backing, MonotonicClock::default(), &config) {
            Ok(engine) => Ok((engine, Opened::Formatted)),
            Err(e) => {
                undo_new_medium(&args.cache, &before);
                Err(describe(e))
            }
        };
    }
    let medium = open_medium(args).map_err(MediumError::into_message)?;
    if is_blank(&medium) {
        return Err(format!(
            "{} has no cache superblock (its first 4 KiB are zero) but is not empty: it may be \
             a cache whose superblock was lost, still holding dirty data; refusing to format it \
             (`pmcache format --force` formats it; nothing on it was changed)",
            args.cache.display()
        ));
    }
    check_geometry_asked(args, &medium)?;
    let backing = backing_to_attach(args, backing);
    match Engine::open(medium, backing, MonotonicClock::default(), &config) {
        Ok((engine, report)) => Ok((engine, Opened::Attached(report))),
        Err(Error::Format(FormatError::BadMagic { found })) if found != MAGIC => Err(format!(
            "{} holds data that is not a pmcache cache; refusing to overwrite it (use `pmcache format --force` to reformat)",
            args.cache.display()
        )),
        Err(e) => Err(attach_error(args, e)),
    }
}

/// Puts a new medium's path back as it was after a format that failed (rare once
/// `check_format` passed: no room to reserve, no memory for the DRAM tables).
fn undo_new_medium(path: &Path, before: &Before) {
    let _ = match before {
        Before::Missing => std::fs::remove_file(path),
        Before::Empty => {
            std::fs::OpenOptions::new().write(true).open(path).and_then(|f| f.set_len(0))
        }
        Before::Holding => Ok(()),
    };
}

/// Attaches (recovering) the cache on the medium, never formatting it: a blank superblock
/// page is refused with a message, whatever the rest of the medium holds.
pub fn open_existing(args: &CacheArgs, max_lanes: usize) -> Result<CacheEngine, String> {
    let backing = open_cache_backing(args)?;
    let medium = open_medium(args).map_err(MediumError::into_message)?;
    if is_blank(&medium) {
        return Err(format!(
            "{} has no cache superblock (its first 4 KiB are zero); nothing to attach, and \
             nothing on it was changed",
            args.cache.display()
        ));
    }
    check_geometry_asked(args, &medium)?;
    let backing = backing_to_attach(args, backing);
    Engine::open(medium, backing, MonotonicClock::default(), &engine_config(args, max_lanes))
        .map(|(engine, _)| engine)
        .map_err(|e| attach_error(args, e))
}

/// Formats the medium, refusing to overwrite a non-blank one unless `force`.
pub fn format(args: &CacheArgs, force: bool) -> Result<CacheEngine, String> {
    let backing = open_cache_backing(args)?;
    let medium = open_medium(args).map_err(MediumError::into_message)?;
    if !force && !is_blank(&medium) {
        return Err(format!(
            "{} is not blank (it may hold a cache with dirty data); pass --force to reformat it",
            args.cache.display()
        ));
    }
    check_size_asked(args, &medium)?;
    Engine::format(medium, backing, MonotonicClock::default(), &engine_config(args, 4))
        .map_err(|e| format!("{}: {e}", args.cache.display()))
}
