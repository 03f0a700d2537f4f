//! What names a backing store whichever path it is given by, and across a reboot: the key its
//! state record (`crate::state`) is found by.
//!
//! - **A regular file**: its inode and birth time, within its directory. Its record lives
//!   beside the file, under its canonical path (so a start through a symlink finds it); a file
//!   renamed in its directory is found by the inode its record names (every entry of a
//!   directory is on one file system, where an inode number names one file at a time) and its
//!   birth time, which tells it from a later file given the number of a deleted one. Where the
//!   file system keeps no birth time, the inode alone.
//! - **A block device**: a name that udev and the kernel keep for the device itself, not the
//!   node's path: `dm-N`, `sdX` and `loopN` are handed out in the order devices appear, and
//!   change across reboots — the one event the record exists for. In order: a device-mapper
//!   device's UUID (LVM's, LUKS's; else its name, which is the table's), a loop device's
//!   backing file, the disk's WWID (from sysfs: NVMe namespaces, SCSI disks), a partition as
//!   its disk's key and its number, and the first `/dev/disk/by-id/` name that points at it.
//!   A device with none of these is keyed on its canonical path, and `serve` says that the
//!   name may change.
//! - **A Ceph RBD image** (`rbd:POOL/IMAGE...`): its cluster's fsid, its pool's id and
//!   namespace and the image's id, read from the cluster (the image opened read-only, without
//!   its lock): kept across a rename of the image, a new host, a new monitor address.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Where sysfs lists block devices by number.
const SYS_DEV_BLOCK: &str = "/sys/dev/block";
/// udev's persistent names of disks.
const BY_ID: &str = "/dev/disk/by-id";

/// A backing store's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingId {
    /// A regular file: its canonical path, inode and birth time.
    File {
        /// The canonical path.
        canonical: PathBuf,
        /// Its inode number.
        inode: u64,
        /// When it was created (seconds and nanoseconds since the epoch), where the file
        /// system keeps it.
        born: Option<(u64, u32)>,
    },
    /// A block device (or anything else that is not a regular file).
    Device {
        /// The persistent key (see the module).
        key: String,
        /// Whether the key is a persistent name (else: the node's canonical path).
        stable: bool,
    },
    /// A Ceph RBD image.
    Rbd {
        /// Its identity in its cluster.
        ids: pmcache_backing::rbd::RbdIds,
    },
}

impl BackingId {
    /// The identity of the backing store at `path` (which exists); for an `rbd:` spec, read
    /// from its cluster.
    pub fn of(path: &Path) -> Result<BackingId, String> {
        if let Some(spec) = path.to_str().filter(|p| pmcache_backing::RbdSpec::is_rbd(p)) {
            let ids = pmcache_backing::rbd::rbd_ids(spec).map_err(|e| e.to_string())?;
            return Ok(BackingId::Rbd { ids });
        }
        let canonical =
            std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let meta =
            std::fs::metadata(&canonical).map_err(|e| format!("{}: {e}", canonical.display()))?;
        if meta.is_file() {
            let born = meta
                .created()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| (d.as_secs(), d.subsec_nanos()));
            return Ok(BackingId::File { canonical, inode: meta.ino(), born });
        }
        if meta.file_type().is_block_device() {
            let rdev = meta.rdev();
            let (major, minor) = (rustix_major(rdev), rustix_minor(rdev));
            let sys = Path::new(SYS_DEV_BLOCK).join(format!("{major}:{minor}"));
            if let Some(key) = device_key(&sys, Path::new(BY_ID), &canonical) {
                return Ok(BackingId::Device { key, stable: true });
            }
        }
        Ok(BackingId::Device { key: format!("path{}", escape(&canonical)), stable: false })
    }

    /// A file's key as records written before birth times were kept carry it (the inode
    /// alone), which such a record is still found by.
    pub fn legacy_key(&self) -> Option<String> {
        match self {
            BackingId::File { inode, born: Some(_), .. } => Some(format!("file-inode-{inode}")),
            _ => None,
        }
    }

    /// The key the state record carries (`backing_id=`).
    pub fn key(&self) -> String {
        match self {
            BackingId::File { inode, born: None, .. } => format!("file-inode-{inode}"),
            BackingId::File { inode, born: Some((secs, nanos)), .. } => {
                format!("file-inode-{inode}-born-{secs}.{nanos:09}")
            }
            BackingId::Device { key, .. } => key.clone(),
            BackingId::Rbd { ids } => ids.key(),
        }
    }
}

/// The device number's major part (glibc's encoding).
fn rustix_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff)
}

/// The device number's minor part (glibc's encoding).
fn rustix_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0xff)
}

/// `path` as one file name: `/` becomes `-`, and bytes outside `[A-Za-z0-9._:+@=-]` become
/// `%XX`.
pub fn escape(path: &Path) -> String {
    let mut out = String::new();
    for byte in path.as_os_str().as_encoded_bytes() {
        match byte {
            b'/' => out.push('-'),
            b if b.is_ascii_alphanumeric() || b"._:+@=-".contains(b) => out.push(*b as char),
            b => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The trimmed contents of a sysfs attribute, if it has any.
fn attribute(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// The persistent key of the block device whose sysfs directory is `sys` and whose node is
/// `node` (canonical), with `by_id` the directory of udev's by-id links; `None` if it has no
/// persistent name.
pub fn device_key(sys: &Path, by_id: &Path, node: &Path) -> Option<String> {
    let clean = |s: &str| escape(Path::new(s));
    if let Some(uuid) = attribute(&sys.join("dm/uuid")) {
        return Some(format!("dm-uuid-{}", clean(&uuid)));
    }
    if let Some(name) = attribute(&sys.join("dm/name")) {
        return Some(format!("dm-name-{}", clean(&name)));
    }
    if let Some(file) = attribute(&sys.join("loop/backing_file")) {
        return Some(format!("loop-file{}", escape(Path::new(&file))));
    }
    for wwid in ["wwid", "device/wwid"] {
        if let Some(id) = attribute(&sys.join(wwid)) {
            return Some(format!("wwid-{}", clean(&id)));
        }
    }
    if let Some(number) = attribute(&sys.join("partition")) {
        // The partition's directory sits in its disk's.
        let disk = std::fs::canonicalize(sys).ok()?.parent()?.to_path_buf();
        if let Some(key) = device_key(&disk, by_id, Path::new("")) {
            return Some(format!("{key}-part{number}"));
        }
    }
    by_id_name(by_id, node).map(|name| format!("by-id-{}", clean(&name)))
}

/// The first of udev's by-id names (sorted: `wwn-` ones first) that points at `node`.
fn by_id_name(by_id: &Path, node: &Path) -> Option<String> {
    if node.as_os_str().is_empty() {
        return None;
    }
    let mut names: Vec<String> = std::fs::read_dir(by_id)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| std::fs::canonicalize(entry.path()).is_ok_and(|target| target == node))
        .filter_map(|entry| entry.file_name().into_string().ok())
        .collect();
    names.sort_by_key(|name| (!name.starts_with("wwn-"), name.clone()));
    names.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("dir");
        std::fs::write(path, text).expect("write");
    }

    /// Each kind of device is keyed on its persistent name, in the module's order, and a
    /// partition on its disk's key.
    #[test]
    fn devices_are_keyed_on_their_persistent_names() {
        let root = tempfile::tempdir().expect("tempdir");
        let sys = root.path().join("sys");
        let by_id = root.path().join("by-id");
        std::fs::create_dir_all(&by_id).expect("by-id");
        let none = Path::new("");

        let dm = sys.join("dm-3");
        write(&dm.join("dm/uuid"), "LVM-abc123\n");
        write(&dm.join("dm/name"), "vg-lv\n");
        assert_eq!(device_key(&dm, &by_id, none).as_deref(), Some("dm-uuid-LVM-abc123"));
        write(&dm.join("dm/uuid"), "\n");
        assert_eq!(device_key(&dm, &by_id, none).as_deref(), Some("dm-name-vg-lv"));

        let lo = sys.join("loop7");
        write(&lo.join("loop/backing_file"), "/srv/disk image.img\n");
        assert_eq!(
            device_key(&lo, &by_id, none).as_deref(),
            Some("loop-file-srv-disk%20image.img")
        );

        let nvme = sys.join("nvme0n1");
        write(&nvme.join("wwid"), "eui.0025388b91c1a2b3\n");
        assert_eq!(device_key(&nvme, &by_id, none).as_deref(), Some("wwid-eui.0025388b91c1a2b3"));
        let part = nvme.join("nvme0n1p2");
        write(&part.join("partition"), "2\n");
        assert_eq!(
            device_key(&part, &by_id, none).as_deref(),
            Some("wwid-eui.0025388b91c1a2b3-part2")
        );

        // Nothing in sysfs: udev's by-id link that points at the node, wwn- first.
        let bare = sys.join("sdb");
        std::fs::create_dir_all(&bare).expect("sdb");
        let node = root.path().join("sdb-node");
        write(&node, "");
        let node = std::fs::canonicalize(&node).expect("node");
        std::os::unix::fs::symlink(&node, by_id.join("ata-DISK_SERIAL")).expect("link");
        assert_eq!(device_key(&bare, &by_id, &node).as_deref(), Some("by-id-ata-DISK_SERIAL"));
        std::os::unix::fs::symlink(&node, by_id.join("wwn-0x5000")).expect("link");
        assert_eq!(device_key(&bare, &by_id, &node).as_deref(), Some("by-id-wwn-0x5000"));
        assert_eq!(device_key(&bare, &by_id, &root.path().join("other")), None);
    }

    /// A regular file is keyed on its inode, whichever path names it.
    #[test]
    fn a_file_is_the_same_through_a_symlink_and_after_a_rename() {
        let root = tempfile::tempdir().expect("tempdir");
        let file = root.path().join("backing.img");
        write(&file, "data");
        let link = root.path().join("link.img");
        std::os::unix::fs::symlink(&file, &link).expect("link");
        let id = BackingId::of(&file).expect("id");
        assert_eq!(BackingId::of(&link).expect("id").key(), id.key());
        let renamed = root.path().join("renamed.img");
        std::fs::rename(&file, &renamed).expect("rename");
        assert_eq!(BackingId::of(&renamed).expect("id").key(), id.key());
        assert!(id.key().starts_with("file-inode-"), "{}", id.key());
    }
}
