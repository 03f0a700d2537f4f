//! File systems mounted on a device, synced before the device stops.
//!
//! Stopping a ublk device deletes its disk as a surprise removal: a file system still mounted
//! on it is shut down without a sync, so what it had not written yet (data in its page cache,
//! a journal commit) is lost, as on a pulled disk. A stop therefore first syncs (`syncfs`)
//! every file system mounted on the device or one of its partitions, while the queues still
//! serve the writes that causes.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// A device number, `major:minor`.
pub type DeviceNumber = (u32, u32);

fn parse_number(text: &str) -> Option<DeviceNumber> {
    let (major, minor) = text.trim().split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The device numbers of block device `name` (e.g. `ublkb0`) and of its partitions, from
/// sysfs.
fn device_numbers(name: &str) -> Vec<DeviceNumber> {
    let disk = Path::new("/sys/block").join(name);
    let mut numbers = Vec::new();
    let mut read = |dir: &Path| {
        if let Some(number) =
            std::fs::read_to_string(dir.join("dev")).ok().as_deref().and_then(parse_number)
        {
            numbers.push(number);
        }
    };
    read(&disk);
    if let Ok(entries) = std::fs::read_dir(&disk) {
        for entry in entries.flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with(name)) {
                read(&entry.path());
            }
        }
    }
    numbers
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`); a path
/// need not be UTF-8.
fn unescape(field: &str) -> OsString {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

/// The mount points in `mountinfo` (`/proc/self/mountinfo`'s text) of the devices numbered
/// `numbers`.
pub fn mount_points(mountinfo: &str, numbers: &[DeviceNumber]) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let number = parse_number(fields.nth(2)?)?;
            let mount_point = fields.nth(1)?;
            numbers.contains(&number).then(|| PathBuf::from(unescape(mount_point)))
        })
        .collect()
}

/// Syncs the file system at `mount_point` if it is on one of `numbers` (another may be
/// mounted over it, and then it cannot be reached by its path).
fn sync_at(mount_point: &Path, numbers: &[DeviceNumber]) -> std::io::Result<()> {
    let dir = std::fs::File::open(mount_point)?;
    let dev = rustix::fs::fstat(&dir)?.st_dev;
    if !numbers.contains(&(rustix::fs::major(dev), rustix::fs::minor(dev))) {
        return Err(std::io::Error::other("another file system is mounted over it"));
    }
    Ok(rustix::fs::syncfs(&dir)?)
}

/// Syncs every file system mounted on block device `name` or its partitions; returns each
/// mount point with the outcome.
pub fn sync_mounted(name: &str) -> Vec<(PathBuf, std::io::Result<()>)> {
    let numbers = device_numbers(name);
    if numbers.is_empty() {
        return Vec::new();
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mount_points(&mountinfo, &numbers)
        .into_iter()
        .map(|point| {
            let synced = sync_at(&point, &numbers);
            (point, synced)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 259:1 / / rw,relatime - ext4 /dev/nvme0n1p1 rw
40 22 259:7 / /mnt/fs rw,relatime shared:1 - ext4 /dev/ublkb0 rw
41 22 259:8 / /mnt/with\\040space rw,relatime - ext4 /dev/ublkb0p1 rw
42 22 259:70 / /mnt/other rw,relatime - ext4 /dev/ublkb1 rw
43 40 259:7 /sub /mnt/bind rw,relatime - ext4 /dev/ublkb0 rw
";

    /// Every mount of the disk and its partitions (bind mounts too), no other device's,
    /// with escaped characters restored.
    #[test]
    fn the_mounts_of_a_device_and_its_partitions() {
        let numbers = [(259, 7), (259, 8)];
        let points = mount_points(MOUNTINFO, &numbers);
        let expected = ["/mnt/fs", "/mnt/with space", "/mnt/bind"].map(PathBuf::from);
        assert_eq!(points, expected);
        assert!(mount_points(MOUNTINFO, &[(9, 9)]).is_empty());
        assert!(mount_points("garbage\n\n1 2\n1 2 x:y 4 5\n", &numbers).is_empty());
    }

    #[test]
    fn octal_escapes_are_undone() {
        assert_eq!(unescape(r"a\040b\011c\134d"), "a b\tc\\d");
        assert_eq!(unescape(r"trailing\04"), r"trailing\04");
        assert_eq!(unescape(r"\999"), r"\999");
        // Bytes that are not UTF-8 are kept as they are.
        assert_eq!(unescape(r"\377x").into_vec(), vec![0xff, b'x']);
    }

    /// The root file system is synced only when it is on one of the numbers given.
    #[test]
    fn a_mount_point_on_another_device_is_not_synced() {
        let dev = rustix::fs::stat("/").unwrap().st_dev;
        let root = (rustix::fs::major(dev), rustix::fs::minor(dev));
        assert!(sync_at(Path::new("/"), &[root]).is_ok());
        let other = (root.0, root.1.wrapping_add(1));
        let err = sync_at(Path::new("/"), &[other]).unwrap_err();
        assert!(err.to_string().contains("mounted over"), "{err}");
    }
}
