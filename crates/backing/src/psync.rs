//! The synchronous engines: psync (one pread/pwrite per request) and pvsync2 (one
//! preadv2/pwritev2 per request, optionally with `RWF_HIPRI`, which asks the kernel to poll for
//! the completion: it polls where the path allows it, and ext4's direct I/O does not poll a
//! synchronous request, so there the read waits for an interrupt as without the flag; see
//! docs/PERFORMANCE.md, paper 004), on a regular file or a block device, buffered or `O_DIRECT`.
//!
//! Their queued interface is a [`SyncQueue`]: requests run one after another during `submit`,
//! so any queue depth behaves like depth 1 (as fio's synchronous engines do).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::file::{BackingFile, OpenMode};
use crate::queue::{IoQueue, SyncQueue};
use crate::{BackingIdentity, BackingStore, Result};

/// How each request is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SyncMode {
    Psync,
    Pvsync2 { rw_flags: libc::c_int },
}

#[derive(Debug)]
struct SyncCore {
    file: BackingFile,
    mode: SyncMode,
}

impl SyncCore {
    fn raw_read(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        match self.mode {
            SyncMode::Psync => self.file.file.read_at(buf, offset),
            SyncMode::Pvsync2 { rw_flags } => preadv2(&self.file.file, buf, offset, rw_flags),
        }
    }

    fn raw_write(&self, data: &[u8], offset: u64) -> io::Result<usize> {
        match self.mode {
            SyncMode::Psync => self.file.file.write_at(data, offset),
            SyncMode::Pvsync2 { rw_flags } => pwritev2(&self.file.file, data, offset, rw_flags),
        }
    }
}

impl BackingStore for SyncCore {
    fn size_bytes(&self) -> u64 {
        self.file.size_bytes
    }
    fn logical_block_size(&self) -> u32 {
        self.file.block_bytes
    }
    fn identity(&self) -> BackingIdentity {
        self.file.identity()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_full(buf, offset, |b, at| self.raw_read(b, at))
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        self.file.write_full(data, offset, |d, at| self.raw_write(d, at))
    }
    fn flush(&self) -> Result<()> {
        self.file.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.file.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.file.write_zeroes(offset, len)
    }
    fn extent_at(&self, offset: u64, len: u64) -> Result<crate::Extent> {
        self.file.extent_at(offset, len)
    }
    fn engine_name(&self) -> &'static str {
        self.file.engine
    }
}

macro_rules! sync_engine_store {
    ($ty:ident) => {
        impl BackingStore for $ty {
            fn size_bytes(&self) -> u64 {
                self.core.size_bytes()
            }
            fn logical_block_size(&self) -> u32 {
                self.core.logical_block_size()
            }
            fn identity(&self) -> BackingIdentity {
                self.core.identity()
            }
            fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                self.core.read_at(buf, offset)
            }
            fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
                self.core.write_at(data, offset)
            }
            fn flush(&self) -> Result<()> {
                self.core.flush()
            }
            fn discard(&self, offset: u64, len: u64) -> Result<()> {
                self.core.discard(offset, len)
            }
            fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
                self.core.write_zeroes(offset, len)
            }
            fn extent_at(&self, offset: u64, len: u64) -> Result<crate::Extent> {
                self.core.extent_at(offset, len)
            }
            fn engine_name(&self) -> &'static str {
                self.core.engine_name()
            }
            fn is_direct(&self) -> bool {
                self.core.file.direct
            }
            fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
                Ok(Box::new(SyncQueue::new(self.core.clone(), depth)))
            }
        }
    };
}

/// A backing file driven with pread/pwrite.
#[derive(Debug)]
pub struct PsyncFile {
    core: Arc<SyncCore>,
}

impl PsyncFile {
    /// Opens an existing file or block device for reading and writing (buffered I/O).
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, false, false)
    }

    /// Opens with or without `O_DIRECT`, optionally read-only.
    pub fn open_with(path: &Path, direct: bool, read_only: bool) -> Result<Self> {
        let file = BackingFile::open(path, "psync", OpenMode { direct, read_only })?;
        Ok(Self { core: Arc::new(SyncCore { file, mode: SyncMode::Psync }) })
    }
}

sync_engine_store!(PsyncFile);

/// A backing file driven with preadv2/pwritev2, optionally with `RWF_HIPRI` (polled completion
/// where the device has poll queues; the kernel falls back to interrupts where it has none).
#[derive(Debug)]
pub struct Pvsync2File {
    core: Arc<SyncCore>,
}

impl Pvsync2File {
    /// Opens with or without `O_DIRECT` and `RWF_HIPRI`, optionally read-only.
    pub fn open_with(path: &Path, direct: bool, hipri: bool, read_only: bool) -> Result<Self> {
        let engine = if hipri { "pvsync2-hipri" } else { "pvsync2" };
        let file = BackingFile::open(path, engine, OpenMode { direct, read_only })?;
        let rw_flags = if hipri { libc::RWF_HIPRI } else { 0 };
        Ok(Self { core: Arc::new(SyncCore { file, mode: SyncMode::Pvsync2 { rw_flags } }) })
    }
}

sync_engine_store!(Pvsync2File);

fn preadv2(file: &File, buf: &mut [u8], offset: u64, flags: libc::c_int) -> io::Result<usize> {
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let offset = i64::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `iov` describes `buf`, which is valid for writes of its length for the whole
    // (synchronous) call; the fd is open.
    let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset, flags) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

fn pwritev2(file: &File, data: &[u8], offset: u64, flags: libc::c_int) -> io::Result<usize> {
    let iov = libc::iovec { iov_base: data.as_ptr().cast_mut().cast(), iov_len: data.len() };
    let offset = i64::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `iov` describes `data`, valid for reads of its length for the whole call; the
    // kernel does not write through a pwritev2 iovec. The fd is open.
    let n = unsafe { libc::pwritev2(file.as_raw_fd(), &iov, 1, offset, flags) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Size of a regular file or a block device, in bytes.
pub fn file_size(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    // Block devices report 0 in metadata; seeking to the end gives their size.
    let mut handle = file;
    let size = handle.seek(SeekFrom::End(0))?;
    handle.seek(SeekFrom::Start(0))?;
    Ok(size)
}

/// A 16-byte fingerprint of a canonical path (four CRC32Cs with different seeds; not a secret).
/// CRC32C is affine in its seed, so the four differ by a function of the path's length: two
/// paths of one length collide with odds of 2^-32, not 2^-128 (kept as is: a new function
/// would refuse every existing cache).
pub fn path_fingerprint(canonical: &Path) -> [u8; 16] {
    bytes_fingerprint(canonical.as_os_str().as_encoded_bytes())
}

/// A 128-bit fingerprint of `bytes` (four CRC-32Cs with different seeds).
pub fn bytes_fingerprint(bytes: &[u8]) -> [u8; 16] {
    let lo = u64::from(crc32c::crc32c(bytes)) | (u64::from(crc32c::crc32c_append(1, bytes)) << 32);
    let hi = u64::from(crc32c::crc32c_append(2, bytes))
        | (u64::from(crc32c::crc32c_append(3, bytes)) << 32);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&lo.to_le_bytes());
    out[8..].copy_from_slice(&hi.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path's fingerprint uses all 128 bits: across many paths, no two share any of its
    /// four 32-bit words (a word built from fewer bits, or left zero, would repeat).
    #[test]
    fn a_fingerprint_uses_all_its_bits() {
        let prints: Vec<[u8; 16]> =
            (0..256).map(|i| path_fingerprint(Path::new(&format!("/dev/disk/{i}")))).collect();
        for word in 0..4 {
            let mut seen = std::collections::HashSet::new();
            for print in &prints {
                let bytes: [u8; 4] = print[word * 4..word * 4 + 4].try_into().expect("4 bytes");
                assert!(seen.insert(bytes), "word {word} repeats: {bytes:?}");
            }
        }
        assert_eq!(path_fingerprint(Path::new("/a")), path_fingerprint(Path::new("/a")));
    }
}
