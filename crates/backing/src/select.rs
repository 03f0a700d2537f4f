//! Engine selection: `--engine` names, the default per device, and [`open_backing`].
//!
//! Defaults (documented in `docs/ENGINES.md`): a block device gets `io_uring` with `O_DIRECT`;
//! a regular file gets `io_uring` with `O_DIRECT` when its file system accepts `O_DIRECT`, and
//! buffered `io_uring` otherwise. If io_uring itself is unavailable (old kernel, disabled by
//! `kernel.io_uring_disabled` or a seccomp filter) a *defaulted* choice falls back to `psync`.
//! Every fallback is logged with `tracing::warn!`; an engine or `O_DIRECT` that was asked for
//! explicitly is never replaced: it opens or fails with [`BackingError::Unsupported`].

use std::fmt;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use crate::uring::UringMode;
use crate::{BackingError, BackingStore, LibaioFile, PsyncFile, Pvsync2File, Result, UringFile};

/// How the backing store's I/O is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EngineKind {
    /// pread/pwrite.
    Psync,
    /// preadv2/pwritev2.
    Pvsync2,
    /// preadv2/pwritev2 with `RWF_HIPRI` (polled completion where the device supports it).
    Pvsync2Hipri,
    /// Linux native AIO (io_submit/io_getevents), interrupt-driven.
    Libaio,
    /// io_uring, interrupt-driven.
    IoUring,
    /// io_uring with `IORING_SETUP_IOPOLL` (needs `O_DIRECT` and a pollable file).
    IoUringIopoll,
    /// io_uring with `IORING_SETUP_SQPOLL` (a kernel thread polls the submission queue).
    IoUringSqpoll,
}

impl EngineKind {
    /// Every engine, in the order tables list them.
    pub const ALL: [EngineKind; 7] = [
        EngineKind::Psync,
        EngineKind::Pvsync2,
        EngineKind::Pvsync2Hipri,
        EngineKind::Libaio,
        EngineKind::IoUring,
        EngineKind::IoUringIopoll,
        EngineKind::IoUringSqpoll,
    ];

    /// The name `--engine` takes.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Psync => "psync",
            EngineKind::Pvsync2 => "pvsync2",
            EngineKind::Pvsync2Hipri => "pvsync2-hipri",
            EngineKind::Libaio => "libaio",
            EngineKind::IoUring => "io_uring",
            EngineKind::IoUringIopoll => "io_uring-iopoll",
            EngineKind::IoUringSqpoll => "io_uring-sqpoll",
        }
    }

    /// Whether the engine runs one request at a time (queue depth makes no difference).
    pub fn is_synchronous(self) -> bool {
        matches!(self, EngineKind::Psync | EngineKind::Pvsync2 | EngineKind::Pvsync2Hipri)
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let normal = s.trim().to_ascii_lowercase().replace(['_', ' '], "-");
        let kind = match normal.as_str() {
            "psync" => EngineKind::Psync,
            "pvsync2" => EngineKind::Pvsync2,
            "pvsync2-hipri" => EngineKind::Pvsync2Hipri,
            "libaio" | "aio" => EngineKind::Libaio,
            "io-uring" | "uring" => EngineKind::IoUring,
            "io-uring-iopoll" | "uring-iopoll" => EngineKind::IoUringIopoll,
            "io-uring-sqpoll" | "uring-sqpoll" => EngineKind::IoUringSqpoll,
            _ => {
                let names: Vec<&str> = EngineKind::ALL.iter().map(|k| k.name()).collect();
                return Err(format!("unknown engine {s:?}; expected one of {}", names.join(", ")));
            }
        };
        Ok(kind)
    }
}

/// What the backing path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// A block device (`/dev/nvme0n1`, `/dev/vdb`).
    BlockDevice,
    /// A regular file on some file system.
    RegularFile,
}

/// How to open a backing store. `None` fields take the default for the device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// The engine; `None` picks the default for the device.
    pub engine: Option<EngineKind>,
    /// `O_DIRECT`; `None` picks the default for the device.
    pub direct: Option<bool>,
    /// Open read-only (writes then fail with `EBADF`).
    pub read_only: bool,
    /// Kernel contexts (rings, AIO contexts) kept for synchronous calls: at most this many
    /// threads are in a synchronous call at once. 0 = twice the CPU count (2..=64).
    pub sync_contexts: usize,
}

impl EngineOptions {
    /// Options naming an engine and `O_DIRECT` explicitly.
    pub fn new(engine: EngineKind, direct: bool) -> Self {
        Self { engine: Some(engine), direct: Some(direct), ..Self::default() }
    }
}

/// The engine and mode [`open_backing`] will use for a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolvedEngine {
    /// The engine.
    pub engine: EngineKind,
    /// `O_DIRECT`.
    pub direct: bool,
    /// What the path is.
    pub device: DeviceKind,
}

fn device_kind(path: &Path) -> Result<DeviceKind> {
    let meta = std::fs::metadata(path)
        .map_err(|source| BackingError::Open { path: path.display().to_string(), source })?;
    Ok(if meta.file_type().is_block_device() {
        DeviceKind::BlockDevice
    } else {
        DeviceKind::RegularFile
    })
}

/// Whether `path`'s file system lets it be opened with `O_DIRECT`.
fn accepts_direct(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).is_ok()
}

/// Fills in the defaults of `opts` for `path` (see the module documentation).
pub fn resolve_engine(path: &Path, opts: &EngineOptions) -> Result<ResolvedEngine> {
    let device = device_kind(path)?;
    let engine = opts.engine.unwrap_or(EngineKind::IoUring);
    let direct = match opts.direct {
        Some(direct) => direct,
        None if device == DeviceKind::BlockDevice => true,
        None if accepts_direct(path) => true,
        None => {
            tracing::warn!(
                path = %path.display(),
                "the file system rejects O_DIRECT; using buffered I/O for the backing store"
            );
            false
        }
    };
    Ok(ResolvedEngine { engine, direct, device })
}

fn default_sync_contexts() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cpus * 2).clamp(2, 64)
}

/// Opens `path` with the engine and mode `opts` asks for (defaults filled in per device). A
/// path `rbd:POOL/IMAGE[:KEY=VALUE]...` opens that Ceph RBD image ([`crate::RbdImage`]).
pub fn open_backing(path: &Path, opts: &EngineOptions) -> Result<Arc<dyn BackingStore>> {
    if let Some(spec) = path.to_str().filter(|p| crate::RbdSpec::is_rbd(p)) {
        if let Some(engine) = opts.engine {
            return Err(BackingError::Unsupported {
                engine: engine.name(),
                option: "rbd",
                reason: "an rbd: image is reached through librbd, not a file engine: leave \
                         --engine out"
                    .into(),
            });
        }
        return Ok(Arc::new(crate::RbdImage::open_with(spec, opts.read_only)?));
    }
    let resolved = resolve_engine(path, opts)?;
    let contexts =
        if opts.sync_contexts == 0 { default_sync_contexts() } else { opts.sync_contexts };
    let (direct, ro) = (resolved.direct, opts.read_only);
    let open = |engine: EngineKind| -> Result<Arc<dyn BackingStore>> {
        Ok(match engine {
            EngineKind::Psync => Arc::new(PsyncFile::open_with(path, direct, ro)?),
            EngineKind::Pvsync2 => Arc::new(Pvsync2File::open_with(path, direct, false, ro)?),
            EngineKind::Pvsync2Hipri => Arc::new(Pvsync2File::open_with(path, direct, true, ro)?),
            EngineKind::Libaio => Arc::new(LibaioFile::open_with(path, direct, ro, contexts)?),
            EngineKind::IoUring => {
                Arc::new(UringFile::open_with(path, UringMode::Interrupt, direct, ro, contexts)?)
            }
            EngineKind::IoUringIopoll => {
                Arc::new(UringFile::open_with(path, UringMode::Iopoll, direct, ro, contexts)?)
            }
            EngineKind::IoUringSqpoll => {
                Arc::new(UringFile::open_with(path, UringMode::Sqpoll, direct, ro, contexts)?)
            }
        })
    };
    match open(resolved.engine) {
        Err(BackingError::Unsupported { option: "io_uring", reason, .. })
            if opts.engine.is_none() =>
        {
            tracing::warn!(
                path = %path.display(),
                %reason,
                "io_uring is unavailable; falling back to the psync engine"
            );
            open(EngineKind::Psync)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in EngineKind::ALL {
            assert_eq!(kind.name().parse::<EngineKind>(), Ok(kind));
        }
        assert_eq!("io-uring".parse::<EngineKind>(), Ok(EngineKind::IoUring));
        assert_eq!("IO_URING_SQPOLL".parse::<EngineKind>(), Ok(EngineKind::IoUringSqpoll));
        let err = "spdk".parse::<EngineKind>().unwrap_err();
        assert!(err.contains("io_uring-iopoll"), "{err}");
    }

    /// With no `--direct` given, a regular file on a file system that rejects `O_DIRECT`
    /// (procfs here) is opened buffered, with the default engine; a path that does not
    /// exist is an open error naming it.
    #[test]
    fn direct_io_defaults_to_what_the_file_system_takes() {
        let resolved = resolve_engine(Path::new("/proc/self/comm"), &EngineOptions::default())
            .expect("resolve");
        assert_eq!(
            resolved,
            ResolvedEngine {
                engine: EngineKind::IoUring,
                direct: false,
                device: DeviceKind::RegularFile
            }
        );
        let disk = tempfile::NamedTempFile::new_in("/var/tmp").expect("a file on the disk");
        let resolved = resolve_engine(disk.path(), &EngineOptions::default()).expect("resolve");
        assert!(resolved.direct, "ext4 takes O_DIRECT");
        let asked = EngineOptions { direct: Some(true), ..EngineOptions::default() };
        assert!(resolve_engine(Path::new("/proc/self/comm"), &asked).expect("resolve").direct);
        match resolve_engine(Path::new("/nonexistent/pmcache"), &EngineOptions::default()) {
            Err(BackingError::Open { path, .. }) => assert_eq!(path, "/nonexistent/pmcache"),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// The engines that run each request on the calling thread, and the names engines print
    /// as.
    #[test]
    fn synchronous_engines_and_display_names() {
        for kind in EngineKind::ALL {
            let synchronous =
                matches!(kind, EngineKind::Psync | EngineKind::Pvsync2 | EngineKind::Pvsync2Hipri);
            assert_eq!(kind.is_synchronous(), synchronous, "{kind:?}");
            assert_eq!(kind.to_string(), kind.name());
        }
    }

    /// Unless told, a store keeps two kernel contexts per CPU, between 2 and 64.
    #[test]
    fn sync_contexts_default_to_twice_the_cpus() {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        assert_eq!(default_sync_contexts(), (2 * cpus).clamp(2, 64));
    }
}
