//! Which block device a backing store is, beyond its path: what the kernel reports as the
//! device's own identity in sysfs (`/sys/dev/block/MAJOR:MINOR`), so that a cache is not
//! attached to another device that took the same name (`/dev/sdb` after a disk swap or a
//! reboot that renumbered disks, a loop device pointed at another file).
//!
//! The identity, in order of preference, is the first that is present and not empty:
//! - `wwid` of the disk or of its `device` (SCSI, NVMe namespaces: a world-wide name);
//! - `device/serial`, `serial` (NVMe controllers, virtio disks);
//! - `dm/uuid` (device-mapper), `md/uuid` (md RAID);
//! - for a loop device, the file it serves (`loop/backing_file`), that file's inode and the
//!   offset into it (`loop/offset`).
//!
//! A partition is its disk's identity and its start sector. A device that reports none of
//! these (a RAM disk, a virtio disk without a serial) has no identity here: 0, as before, and
//! only its path and size identify it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A 64-bit instance number for the block device `rdev` (`st_rdev`), never 0 when the
/// device reports an identity; 0 when it reports none.
pub(crate) fn block_device_instance(rdev: u64) -> u64 {
    let dir = PathBuf::from(format!("/sys/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev)));
    identity_in(&dir).map_or(0, |identity| instance_of(identity.as_bytes()))
}

/// The identity of the block device whose sysfs directory is `dir`, if it reports one.
fn identity_in(dir: &Path) -> Option<String> {
    if dir.join("partition").exists() {
        let start = read_trimmed(&dir.join("start"))?;
        let disk = identity_in(&dir.join(".."))?;
        return Some(format!("{disk}|partition@{start}"));
    }
    const NAMED: [(&str, &str); 6] = [
        ("wwid", "wwid"),
        ("device/wwid", "wwid"),
        ("device/serial", "serial"),
        ("serial", "serial"),
        ("dm/uuid", "dm"),
        ("md/uuid", "md"),
    ];
    for (file, kind) in NAMED {
        if let Some(value) = read_trimmed(&dir.join(file)) {
            return Some(format!("{kind}:{value}"));
        }
    }
    let backing_file = read_trimmed(&dir.join("loop/backing_file"))?;
    // The same path may hold another file later: its inode tells them apart. (A file deleted
    // under its loop device reads "<path> (deleted)": another identity, so the cache is
    // refused rather than trusted.) Two loop devices over one file at different offsets are
    // different devices.
    let inode = std::fs::metadata(&backing_file).map_or(0, |meta| meta.ino());
    let offset = read_trimmed(&dir.join("loop/offset")).unwrap_or_default();
    Some(format!("loop:{backing_file}#{inode}+{offset}"))
}

/// The contents of a sysfs attribute, trimmed; `None` if missing, unreadable or empty.
fn read_trimmed(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let trimmed = text.trim();
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

/// 64 bits of hash of `identity`, never 0 (0 means "unknown").
fn instance_of(identity: &[u8]) -> u64 {
    let lo = u64::from(crc32c::crc32c(identity));
    let hi = u64::from(crc32c::crc32c_append(0x1d, identity));
    (hi << 32 | lo).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, file: &str, text: &str) {
        let path = dir.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn the_first_identity_present_wins_and_empty_ones_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("vda");
        std::fs::create_dir(&disk).unwrap();
        assert_eq!(identity_in(&disk), None, "nothing reported");
        write(&disk, "serial", "  \n");
        assert_eq!(identity_in(&disk), None, "an empty serial is no identity");
        write(&disk, "serial", "BTLJ1234\n");
        assert_eq!(identity_in(&disk).as_deref(), Some("serial:BTLJ1234"));
        write(&disk, "device/wwid", "eui.0025388b91b4c5d2\n");
        assert_eq!(identity_in(&disk).as_deref(), Some("wwid:eui.0025388b91b4c5d2"));
    }

    #[test]
    fn a_partition_is_its_disks_identity_and_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("sdb");
        write(&disk, "device/wwid", "naa.5000c500a1b2c3d4");
        for (part, start) in [("sdb1", "2048"), ("sdb2", "1050624")] {
            write(&disk.join(part), "partition", "1");
            write(&disk.join(part), "start", start);
        }
        let first = identity_in(&disk.join("sdb1")).unwrap();
        assert_eq!(first, "wwid:naa.5000c500a1b2c3d4|partition@2048");
        assert_ne!(Some(first), identity_in(&disk.join("sdb2")));
        std::fs::remove_file(disk.join("device/wwid")).unwrap();
        assert_eq!(identity_in(&disk.join("sdb1")), None, "a disk without identity");
    }

    #[test]
    fn a_loop_device_is_the_file_it_serves_and_that_files_inode() {
        let dir = tempfile::tempdir().unwrap();
        let served = dir.path().join("image");
        std::fs::write(&served, b"x").unwrap();
        let loop_dir = dir.path().join("loop3");
        write(&loop_dir, "loop/backing_file", &format!("{}\n", served.display()));
        let before = identity_in(&loop_dir).unwrap();
        assert!(before.starts_with(&format!("loop:{}#", served.display())), "{before}");
        write(&loop_dir, "loop/offset", "4096");
        let at_offset = identity_in(&loop_dir).unwrap();
        assert_ne!(at_offset, before, "another offset into the same file");
        write(&loop_dir, "loop/offset", "0");
        let before = identity_in(&loop_dir).unwrap();
        // Another file moved onto the same path: another identity.
        let other = dir.path().join("other");
        std::fs::write(&other, b"y").unwrap();
        std::fs::rename(&other, &served).unwrap();
        assert_ne!(identity_in(&loop_dir).unwrap(), before);
    }

    #[test]
    fn instances_are_never_zero_and_differ_between_identities() {
        assert_ne!(instance_of(b"serial:A"), 0);
        assert_ne!(instance_of(b"serial:A"), instance_of(b"serial:B"));
        assert_eq!(instance_of(b"wwid:x"), instance_of(b"wwid:x"));
    }
}
