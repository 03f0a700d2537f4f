//! `struct pmcache_config`: what `pmcache_open` opens, read from the caller's memory (as much
//! of it as its `size` says) into the serving library's [`ServeConfig`].

use std::ffi::{CStr, OsStr, c_char};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use pmcache_engine::CacheMode;
use pmcache_serve::{CacheConfig, ServeConfig};

use crate::error::Failure;

/// Handles open at once when `struct pmcache_config`'s `lanes` is 0.
pub(crate) const DEFAULT_LANES: u32 = 8;

/// The largest `size` taken: anything above is not the size of a `struct pmcache_config`
/// (an uninitialised field, most likely).
const CONFIG_BYTES_MAX: usize = 4096;

/// How the cache writes: the values of `struct pmcache_config`'s `mode`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmcacheMode {
    /// Writes go to the cache only, durable when acknowledged; the cleaner writes them back
    /// to the backing store later. Read misses are cached. The default (0).
    WriteBack = 0,
    /// Writes go to the backing store and into the cache (clean), acknowledged once the
    /// backing store has them. Read misses are cached.
    WriteThrough = 1,
    /// Writes go to the backing store only (a cached copy is dropped). Read misses are
    /// cached.
    WriteAround = 2,
    /// Reads and writes go to the backing store; the cache serves only what it holds
    /// already.
    PassThrough = 3,
    /// Writes as write-back; read misses are not cached.
    WriteOnly = 4,
}

impl PmcacheMode {
    const ALL: [(PmcacheMode, CacheMode); 5] = [
        (PmcacheMode::WriteBack, CacheMode::WriteBack),
        (PmcacheMode::WriteThrough, CacheMode::WriteThrough),
        (PmcacheMode::WriteAround, CacheMode::WriteAround),
        (PmcacheMode::PassThrough, CacheMode::PassThrough),
        (PmcacheMode::WriteOnly, CacheMode::WriteOnly),
    ];

    /// The engine's mode for `value`, one of these modes' numbers.
    fn engine_mode(value: u32) -> Option<CacheMode> {
        Self::ALL.iter().find(|(mode, _)| *mode as u32 == value).map(|&(_, mode)| mode)
    }
}

/// What `pmcache_open` opens: a cache medium in front of a backing store. Zero what is not
/// set and set `size`:
///
/// ```c
/// struct pmcache_config config = {
///     .size = sizeof(struct pmcache_config),
///     .cache_path = "/dev/shm/app.pm",
///     .backing_path = "/var/lib/app/disk.img",
/// };
/// ```
///
/// A field left 0 (or NULL) takes its default. Later versions of the library add fields at
/// the end only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PmcacheConfig {
    /// `sizeof(struct pmcache_config)` in the program: how much of the struct the library
    /// reads. A library older than the program's header refuses a struct in which a field it
    /// does not know is set (not zero); a newer one takes the fields it has beyond `size` as
    /// 0.
    pub size: usize,
    /// The cache medium (required): a file on tmpfs (`/dev/shm`), ramfs or hugetlbfs, which
    /// survives a crash of the process but not a reboot, or on a DAX file system or a DAX
    /// device, which survives a power cut; created at `cache_bytes` if missing, formatted if
    /// new, recovered if it holds this backing store's cache. A file on any other file system
    /// is refused.
    pub cache_path: *const c_char,
    /// The size of a new medium in bytes (0: 1 GiB). An existing medium keeps its size; a
    /// size other than it is refused.
    pub cache_bytes: u64,
    /// The backing store (required): a file, a block device, or a Ceph RBD image
    /// (`rbd:POOL/IMAGE`).
    pub backing_path: *const c_char,
    /// When not 0 and no file is at `backing_path`, a sparse file of this many bytes is
    /// created there (and removed again if the open fails). 0: the backing store must exist.
    pub backing_bytes: u64,
    /// The block size of a new cache in bytes (0: 4096): every request is aligned to it. An
    /// existing cache keeps its own; a size other than it is refused.
    pub block_bytes: u32,
    /// How the cache writes: one of `enum pmcache_mode` (0: `PMCACHE_MODE_WRITE_BACK`).
    pub mode: u32,
    /// A new cache keeps a CRC32C of each cached block, checked at every read of it. An
    /// existing cache formatted without them is refused.
    pub data_crc: bool,
    /// How many handles may be open at once (0: 8).
    pub lanes: u32,
    /// The control socket, where `pmcache stats --control PATH` and `pmcache detach` reach
    /// the cache (NULL: the cache path with `.ctl` appended).
    pub control_path: *const c_char,
}

/// What `pmcache_open` was asked for, read and checked.
pub(crate) struct Asked {
    /// The cache as the serving library opens it.
    pub(crate) serve: ServeConfig,
    /// Handles open at once at most.
    pub(crate) lanes: usize,
    /// The size of the backing file to create if it is missing.
    pub(crate) create_backing: Option<u64>,
}

/// Reads and checks the config at `config`, as much of it as its `size` says.
///
/// # Safety
///
/// `config` is NULL or points to a `size_t` (its `size`) followed by the rest of `size`
/// readable bytes, and its paths are NULL or NUL-terminated strings.
pub(crate) unsafe fn read(config: *const PmcacheConfig) -> Result<Asked, Failure> {
    if config.is_null() {
        return Err(Failure::invalid("pmcache_open: config is NULL"));
    }
    // SAFETY: `config` is not NULL and starts with its `size` field (the caller's contract),
    // aligned as the struct is.
    let size = unsafe { config.cast::<usize>().read() };
    let known = size_of::<PmcacheConfig>();
    if size < known || size > CONFIG_BYTES_MAX {
        return Err(Failure::invalid(format!(
            "pmcache_open: config.size is {size}, but a struct pmcache_config of this library \
             has {known} bytes: set it to sizeof(struct pmcache_config)"
        )));
    }
    if size > known {
        // SAFETY: the caller gives `size` readable bytes at `config`; `known < size`.
        let beyond =
            unsafe { std::slice::from_raw_parts(config.cast::<u8>().add(known), size - known) };
        if beyond.iter().any(|&b| b != 0) {
            return Err(Failure::new(
                libc::E2BIG,
                format!(
                    "pmcache_open: fields of struct pmcache_config past its first {known} bytes \
                     are set, which this libpmcache does not know (the program was built with \
                     a newer pmcache.h)"
                ),
            ));
        }
    }
    // SAFETY: `known <= size` bytes are readable at `config`, a `PmcacheConfig`: every field
    // is a plain integer, a pointer or a C bool (0 or 1).
    let config = unsafe { config.read() };
    // SAFETY: the paths are NULL or NUL-terminated (the caller's contract).
    let (cache, backing, control) = unsafe {
        (
            path(config.cache_path, "cache_path")?,
            path(config.backing_path, "backing_path")?,
            optional_path(config.control_path, "control_path")?,
        )
    };
    let (Some(cache), Some(backing)) = (cache, backing) else {
        return Err(Failure::invalid(
            "pmcache_open: config.cache_path and config.backing_path are required",
        ));
    };
    let mode = PmcacheMode::engine_mode(config.mode).ok_or_else(|| {
        Failure::invalid(format!(
            "pmcache_open: config.mode is {}, not one of enum pmcache_mode (0 to {})",
            config.mode,
            PmcacheMode::ALL.len() - 1
        ))
    })?;
    let mut cache_config = CacheConfig::new(cache, backing.clone());
    cache_config.cache_size = (config.cache_bytes != 0).then_some(config.cache_bytes);
    cache_config.block_size = (config.block_bytes != 0).then_some(config.block_bytes);
    cache_config.mode = mode;
    cache_config.data_crc = config.data_crc;
    let mut serve = ServeConfig::new(cache_config);
    serve.control = control;
    // The program embedding the cache owns its signals.
    serve.stop_on_signals = false;
    let lanes = if config.lanes == 0 { DEFAULT_LANES } else { config.lanes };
    let create_backing = (config.backing_bytes != 0 && !is_rbd(&backing) && !backing.exists())
        .then_some(config.backing_bytes);
    Ok(Asked { serve, lanes: lanes as usize, create_backing })
}

/// Whether `path` names a Ceph RBD image rather than a file.
fn is_rbd(path: &Path) -> bool {
    path.as_os_str().as_bytes().starts_with(b"rbd:")
}

/// The path at `text`, refused if NULL or empty.
///
/// # Safety
///
/// `text` is NULL or a NUL-terminated string.
unsafe fn path(text: *const c_char, field: &str) -> Result<Option<PathBuf>, Failure> {
    // SAFETY: as this function's.
    match unsafe { optional_path(text, field) }? {
        None => Ok(None),
        Some(path) if path.as_os_str().is_empty() => {
            Err(Failure::invalid(format!("pmcache_open: config.{field} is empty")))
        }
        Some(path) => Ok(Some(path)),
    }
}

/// The path at `text`, `None` when NULL.
///
/// # Safety
///
/// `text` is NULL or a NUL-terminated string.
unsafe fn optional_path(text: *const c_char, field: &str) -> Result<Option<PathBuf>, Failure> {
    if text.is_null() {
        return Ok(None);
    }
    // SAFETY: a NUL-terminated string (the caller's contract), read before this call returns.
    let bytes = unsafe { CStr::from_ptr(text) }.to_bytes();
    if bytes.is_empty() {
        return Err(Failure::invalid(format!("pmcache_open: config.{field} is empty")));
    }
    Ok(Some(PathBuf::from(OsStr::from_bytes(bytes))))
}

/// Creates a sparse backing file of `bytes` at `path`; `false` if one was created meanwhile
/// by someone else (it is then used as it is).
pub(crate) fn create_backing(path: &Path, bytes: u64) -> Result<bool, Failure> {
    let failed = |e: std::io::Error| {
        Failure::new(
            e.raw_os_error().unwrap_or(libc::EIO),
            format!("creating the backing file {}: {e}", path.display()),
        )
    };
    match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(file) => match file.set_len(bytes) {
            Ok(()) => Ok(true),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(failed(e))
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(failed(e)),
    }
}
