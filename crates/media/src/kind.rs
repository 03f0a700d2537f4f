//! What a mapped medium promises, decided when it is opened: [`MediumKind`].
//!
//! - **DAX** — a `MAP_SYNC` mapping succeeded (a file on a DAX file system, or a device-dax
//!   node): flushed and fenced cache lines are durable across power loss.
//! - **Volatile** — a regular file on tmpfs, ramfs or hugetlbfs (`/dev/shm`): the contents live
//!   in DRAM and survive a crash of the process, not a reboot.
//! - **Msync** — any other file or device, asked for with [`MediumSync::Msync`]: its mapping
//!   lives in the page cache, so every flush also `msync(MS_SYNC)`s the pages it covers.
//!
//! Any other file or device without [`MediumSync::Msync`] is refused
//! ([`MediaError::NotDurable`]): a plain shared mapping of a disk file comes back after a
//! power cut as whatever subset of its dirty pages the kernel had written, which would make
//! the cache serve stale blocks. The file system is read with `fstatfs` (its `f_type` magic
//! decides) and named from `/proc/self/mountinfo` for messages.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::str::FromStr;

use crate::{MediaError, Result};

/// `f_type` of tmpfs (and of devtmpfs, which is why only regular files count as volatile).
const TMPFS_MAGIC: u64 = 0x0102_1994;
/// `f_type` of ramfs.
const RAMFS_MAGIC: u64 = 0x8584_58f6;
/// `f_type` of hugetlbfs.
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Names of common file systems by `f_type`, for when `/proc/self/mountinfo` has no answer.
const KNOWN_MAGIC: [(u64, &str); 10] = [
    (TMPFS_MAGIC, "tmpfs"),
    (RAMFS_MAGIC, "ramfs"),
    (HUGETLBFS_MAGIC, "hugetlbfs"),
    (0xef53, "ext2/ext3/ext4"),
    (0x5846_5342, "xfs"),
    (0x9123_683e, "btrfs"),
    (0x794c_7630, "overlay"),
    (0xf2f5_2010, "f2fs"),
    (0x6969, "nfs"),
    (0x6573_5546, "fuse"),
];

/// What a mapped medium promises (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MediumKind {
    /// Real persistent memory, mapped `MAP_SYNC`: durable across power loss.
    Dax,
    /// A file in DRAM (tmpfs, ramfs, hugetlbfs): survives a process crash, not a reboot.
    Volatile,
    /// A page-cache mapping made durable by `msync(MS_SYNC)` at every flush.
    Msync,
}

impl MediumKind {
    /// The kind's name as pmcache prints it: `dax`, `volatile` or `msync`.
    pub fn name(self) -> &'static str {
        match self {
            MediumKind::Dax => "dax",
            MediumKind::Volatile => "volatile",
            MediumKind::Msync => "msync",
        }
    }

    /// Whether acknowledged writes survive a reboot or power loss.
    pub fn survives_reboot(self) -> bool {
        !matches!(self, MediumKind::Volatile)
    }
}

impl std::fmt::Display for MediumKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a medium that is neither DAX nor in DRAM may be made durable: the caller's choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MediumSync {
    /// DAX or a volatile file system; anything else is refused.
    #[default]
    Auto,
    /// As `Auto`, but a file or device that is neither is accepted and `msync`ed at every
    /// flush ([`MediumKind::Msync`]): each persisted write waits for the device.
    Msync,
}

impl MediumSync {
    /// The names [`FromStr`] accepts.
    pub const NAMES: [&'static str; 2] = ["auto", "msync"];
}

impl FromStr for MediumSync {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "auto" => Ok(MediumSync::Auto),
            "msync" => Ok(MediumSync::Msync),
            other => Err(format!(
                "unknown medium sync {other:?}; expected one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

impl std::fmt::Display for MediumSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MediumSync::Auto => "auto",
            MediumSync::Msync => "msync",
        })
    }
}

/// The file system an open file lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileSystem {
    /// `statfs.f_type`.
    pub magic: u64,
    /// Its type as `/proc/self/mountinfo` names it (`ext4`, `tmpfs`), else a known name for
    /// the magic, else the magic in hex.
    pub name: String,
}

impl FileSystem {
    /// The file system of `file` (`fstatfs`), named from `/proc/self/mountinfo`.
    pub fn of(file: &File) -> io::Result<FileSystem> {
        // SAFETY: `statfs` is plain old data; all zeroes is a valid value to be overwritten.
        let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: a plain system call on an open descriptor, writing into `stat`, which lives
        // for the call.
        if unsafe { libc::fstatfs(file.as_raw_fd(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // `f_type` is signed on some targets; the magic numbers are its low 32 bits.
        let magic = (stat.f_type as u64) & 0xffff_ffff;
        let dev = file.metadata()?.dev();
        let mounted = std::fs::read_to_string("/proc/self/mountinfo")
            .ok()
            .and_then(|text| fs_type_of_device(&text, dev_major(dev), dev_minor(dev)));
        let name = mounted.unwrap_or_else(|| match KNOWN_MAGIC.iter().find(|(m, _)| *m == magic) {
            Some((_, name)) => (*name).to_string(),
            None => format!("a file system with f_type {magic:#x}"),
        });
        Ok(FileSystem { magic, name })
    }

    /// The file system of the file at `path`.
    pub fn of_path(path: &Path) -> io::Result<FileSystem> {
        FileSystem::of(&File::open(path)?)
    }

    /// Whether files on it live in DRAM only: tmpfs, ramfs, hugetlbfs.
    pub fn is_volatile(&self) -> bool {
        matches!(self.magic, TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC)
    }
}

/// The major number of a `st_dev` (glibc's `gnu_dev_major`).
pub(crate) fn dev_major(dev: u64) -> u64 {
    ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff)
}

/// The minor number of a `st_dev` (glibc's `gnu_dev_minor`).
pub(crate) fn dev_minor(dev: u64) -> u64 {
    (dev & 0xff) | ((dev >> 12) & !0xff)
}

/// The file system type of the mount whose device is `major:minor`, from
/// `/proc/self/mountinfo`'s text (fields: id, parent, major:minor, root, mount point,
/// options, optional fields, `-`, type, source, super options). The last such mount wins (a
/// later mount over an earlier one).
pub fn fs_type_of_device(mountinfo: &str, major: u64, minor: u64) -> Option<String> {
    let wanted = format!("{major}:{minor}");
    mountinfo
        .lines()
        .filter(|line| line.split_whitespace().nth(2) == Some(wanted.as_str()))
        .filter_map(|line| {
            let mut after = line.split(" - ").nth(1)?.split_whitespace();
            after.next().map(str::to_string)
        })
        .next_back()
}

/// The kind of a medium whose `MAP_SYNC` mapping failed (`dax` false) or succeeded, or the
/// refusal, for the open `file` at `path`.
pub(crate) fn classify(
    file: &File,
    path: &Path,
    dax: bool,
    sync: MediumSync,
) -> Result<MediumKind> {
    if dax {
        return Ok(MediumKind::Dax);
    }
    let io_err = |source| MediaError::Io {
        path: path.display().to_string(),
        action: "find its file system (fstatfs)",
        source,
    };
    let file_type = file.metadata().map_err(io_err)?.file_type();
    let file_system = FileSystem::of(file).map_err(io_err)?;
    if file_type.is_file() && file_system.is_volatile() {
        return Ok(MediumKind::Volatile);
    }
    if sync == MediumSync::Msync {
        return Ok(MediumKind::Msync);
    }
    let what = if file_type.is_file() {
        format!("a file on {}", file_system.name)
    } else if file_type.is_block_device() {
        "a block device (mapped through the page cache)".to_string()
    } else if file_type.is_char_device() {
        "a character device that is not device-dax".to_string()
    } else {
        format!("neither a regular file nor a device, on {}", file_system.name)
    };
    Err(MediaError::NotDurable { path: path.display().to_string(), what })
}

/// The kind the medium at `path` would be opened as with `sync`, or the refusal, without
/// opening it for writing or changing anything: `MAP_SYNC` is tried on a read-only mapping of
/// its first page. For reports on a medium another process may be serving (`pmcache check`).
pub fn probe_kind(path: &Path, sync: MediumSync) -> Result<MediumKind> {
    let file = File::open(path).map_err(|source| MediaError::Io {
        path: path.display().to_string(),
        action: "open",
        source,
    })?;
    classify(&file, path, map_sync_works(&file), sync)
}

/// Whether a read-only `MAP_SYNC` mapping of `file`'s first page is accepted (DAX).
fn map_sync_works(file: &File) -> bool {
    let page = page_bytes();
    let flags = libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC;
    // SAFETY: a fresh read-only mapping at an address of the kernel's choosing, of a descriptor
    // open for the call; unmapped at once, never accessed.
    let addr = unsafe {
        libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ, flags, file.as_raw_fd(), 0)
    };
    if addr == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: unmaps exactly the mapping made above, once.
    unsafe { libc::munmap(addr, page) };
    true
}

/// The system's page size in bytes.
pub(crate) fn page_bytes() -> usize {
    // SAFETY: a plain libc call with no pointers.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_system_of_a_device_is_read_from_mountinfo() {
        let mountinfo = "\
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=123k,mode=755
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=246k
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=246k
33 27 0:40 / /mnt/ram rw - ramfs none rw
";
        assert_eq!(fs_type_of_device(mountinfo, 0, 27).as_deref(), Some("tmpfs"));
        assert_eq!(fs_type_of_device(mountinfo, 254, 0).as_deref(), Some("ext4"));
        assert_eq!(fs_type_of_device(mountinfo, 0, 6).as_deref(), Some("devtmpfs"));
        assert_eq!(fs_type_of_device(mountinfo, 0, 40).as_deref(), Some("ramfs"));
        assert_eq!(fs_type_of_device(mountinfo, 9, 9), None);
    }

    #[test]
    fn medium_sync_names_round_trip() {
        for name in MediumSync::NAMES {
            assert_eq!(name.parse::<MediumSync>().unwrap().to_string(), name);
        }
        let err = "fsync".parse::<MediumSync>().unwrap_err();
        assert!(err.contains("auto, msync"), "{err}");
        assert_eq!(MediumSync::default(), MediumSync::Auto);
    }

    /// /dev/shm is tmpfs: volatile, whatever sync was asked for, and its file system is named.
    #[test]
    fn a_file_in_dev_shm_is_volatile() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("pm");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let fs = FileSystem::of_path(&path).unwrap();
        assert!(fs.is_volatile() && fs.name == "tmpfs", "{fs:?}");
        for sync in [MediumSync::Auto, MediumSync::Msync] {
            assert_eq!(probe_kind(&path, sync).unwrap(), MediumKind::Volatile);
        }
    }

    /// A device node on devtmpfs shares tmpfs's magic but is not a volatile file medium.
    #[test]
    fn a_device_node_is_not_taken_for_a_volatile_file() {
        let err = probe_kind(Path::new("/dev/null"), MediumSync::Auto).unwrap_err();
        assert!(matches!(err, MediaError::NotDurable { .. }), "{err}");
        assert!(err.to_string().contains("character device"), "{err}");
    }
}
