//! Operating errors of the cache media.

use std::io;

/// A medium could not be opened or mapped.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    /// Opening, creating or sizing the file failed.
    #[error("cache medium {path}: {action}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// What was being done.
        action: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The file is empty and no size was given to create it with.
    #[error("cache medium {path} is empty; give a size to create it")]
    Empty {
        /// The path given.
        path: String,
    },
    /// The medium is too small to hold even a superblock.
    #[error("cache medium {path} is {len_bytes} bytes; at least {min_bytes} are needed")]
    TooSmall {
        /// The path given.
        path: String,
        /// Its length.
        len_bytes: u64,
        /// The minimum.
        min_bytes: u64,
    },
    /// The medium is neither DAX nor in DRAM, and msync mode was not asked for: a shared
    /// mapping of it would not be durable.
    #[error(
        "cache medium {path} is {what}, which has no DAX: mapped, its pages live in the page \
         cache, and after a power cut it comes back as any subset of the pages written, so \
         acknowledged writes could be lost and stale blocks served; refusing it. Put the cache \
         on a DAX file system or a device-dax node (persistent), on tmpfs such as /dev/shm \
         (volatile: survives a crash of the process, not a reboot), or keep it here in msync \
         mode (`--medium-sync msync`; `MediumSync::Msync` in the library): every persist then \
         waits for msync(MS_SYNC), a device write per cache write"
    )]
    NotDurable {
        /// The path given.
        path: String,
        /// What it is: `a file on ext4`, `a block device (...)`.
        what: String,
    },
}

impl MediaError {
    /// The errno a frontend reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            MediaError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            MediaError::Empty { .. } | MediaError::TooSmall { .. } => libc::EINVAL,
            MediaError::NotDurable { .. } => libc::EOPNOTSUPP,
        }
    }
}

/// Result of a media operation.
pub type Result<T> = std::result::Result<T, MediaError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_has_its_errno() {
        let io = |source| MediaError::Io { path: "p".into(), action: "open", source };
        assert_eq!(io(io::Error::from_raw_os_error(libc::ENOSPC)).errno(), libc::ENOSPC);
        assert_eq!(io(io::Error::other("no os error")).errno(), libc::EIO);
        assert_eq!(MediaError::Empty { path: "p".into() }.errno(), libc::EINVAL);
        let small = MediaError::TooSmall { path: "p".into(), len_bytes: 1, min_bytes: 2 };
        assert_eq!(small.errno(), libc::EINVAL);
        let disk = MediaError::NotDurable { path: "p".into(), what: "a file on ext4".into() };
        assert_eq!(disk.errno(), libc::EOPNOTSUPP);
    }
}
