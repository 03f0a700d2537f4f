//! The open file or block device every engine drives, and the parts of I/O that do not depend
//! on how requests are issued: opening (with or without `O_DIRECT`), size and alignment
//! discovery, range and alignment checks, bouncing unaligned caller buffers, completing short
//! transfers, flush, discard and write-zeroes.
//!
//! Assumes Linux: alignment comes from `statx(STATX_DIOALIGN)` for files (Linux 6.1+, falling
//! back to 512 bytes) and `BLKSSZGET` for block devices.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::buf::IoBuf;
use crate::psync::{file_size, path_fingerprint};
use crate::{BackingError, BackingIdentity, Result};

/// `_IO(0x12, 119)`: discard a byte range of a block device.
const BLKDISCARD: libc::c_ulong = 0x1277;
/// `_IO(0x12, 127)`: zero a byte range of a block device.
const BLKZEROOUT: libc::c_ulong = 0x127f;
/// `_IO(0x12, 104)`: logical sector size of a block device.
const BLKSSZGET: libc::c_ulong = 0x1268;

/// Chunk size used when zeroes must be written with ordinary writes.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// How a backing file was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpenMode {
    /// Open with `O_DIRECT`.
    pub direct: bool,
    /// Open read-only (writes fail with `EBADF` from the kernel).
    pub read_only: bool,
}

/// An open regular file or block device plus what every engine needs to know about it.
#[derive(Debug)]
pub(crate) struct BackingFile {
    pub file: File,
    pub path: PathBuf,
    pub engine: &'static str,
    pub size_bytes: u64,
    /// Offsets and lengths must be multiples of this under `O_DIRECT`.
    pub block_bytes: u32,
    /// Buffer addresses must be multiples of this under `O_DIRECT`.
    pub mem_align_bytes: u32,
    pub direct: bool,
    pub is_block_device: bool,
    pub fingerprint: [u8; 16],
}

impl BackingFile {
    /// Opens `path` for `engine`. `O_DIRECT` on a file system without it is an
    /// [`BackingError::Unsupported`] naming the engine.
    pub fn open(path: &Path, engine: &'static str, mode: OpenMode) -> Result<Self> {
        let open_err = |source| BackingError::Open { path: path.display().to_string(), source };
        let mut options = OpenOptions::new();
        options.read(true).write(!mode.read_only);
        if mode.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = match options.open(path) {
            Ok(file) => file,
            Err(e) if mode.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(BackingError::Unsupported {
                    engine,
                    option: "O_DIRECT",
                    reason: format!(
                        "the file system holding {} rejects O_DIRECT (open: EINVAL); \
                         run without --direct",
                        path.display()
                    ),
                });
            }
            Err(e) => return Err(open_err(e)),
        };
        let meta = file.metadata().map_err(open_err)?;
        let is_block_device = meta.file_type().is_block_device();
        if !is_block_device && !meta.is_file() {
            return Err(open_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file or block device",
            )));
        }
        let size_bytes = file_size(&file).map_err(open_err)?;
        let canonical = path.canonicalize().map_err(open_err)?;
        let (block_bytes, mem_align_bytes) = if is_block_device {
            let sector = block_device_sector_bytes(&file).map_err(open_err)?;
            (sector, sector)
        } else if mode.direct {
            match dio_alignment(&file).map_err(open_err)? {
                Some((0, _)) => {
                    return Err(BackingError::Unsupported {
                        engine,
                        option: "O_DIRECT",
                        reason: format!(
                            "statx reports no direct-I/O support for {}",
                            path.display()
                        ),
                    });
                }
                Some((offset_align, mem_align)) => (offset_align.max(512), mem_align.max(1)),
                None => (512, 512),
            }
        } else {
            (512, 1)
        };
        Ok(Self {
            file,
            path: canonical.clone(),
            engine,
            size_bytes,
            block_bytes,
            mem_align_bytes,
            direct: mode.direct,
            is_block_device,
            fingerprint: path_fingerprint(&canonical),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn identity(&self) -> BackingIdentity {
        BackingIdentity { size_bytes: self.size_bytes, fingerprint: self.fingerprint }
    }

    /// The request lies inside the store.
    pub fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size_bytes => Ok(()),
            _ => Err(BackingError::OutOfRange { op, offset, len, size: self.size_bytes }),
        }
    }

    /// Under `O_DIRECT`, the request's offset and length are whole logical blocks.
    pub fn check_aligned(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        let block = u64::from(self.block_bytes);
        if self.direct && (!offset.is_multiple_of(block) || !len.is_multiple_of(block)) {
            return Err(BackingError::Misaligned {
                engine: self.engine,
                op,
                offset,
                len,
                block_bytes: self.block_bytes,
            });
        }
        Ok(())
    }

    /// Range and alignment checks for a read or write.
    pub fn check_rw(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        self.check_range(op, offset, len)?;
        self.check_aligned(op, offset, len)
    }

    fn needs_bounce(&self, addr: usize) -> bool {
        self.direct && !addr.is_multiple_of(self.mem_align_bytes as usize)
    }

    /// Reads all of `buf` at `offset` with `raw`, one kernel transfer at a time. `raw` returns the
    /// bytes moved (0 = end of file). Unaligned buffers are bounced under `O_DIRECT`.
    pub fn read_full(
        &self,
        buf: &mut [u8],
        offset: u64,
        mut raw: impl FnMut(&mut [u8], u64) -> io::Result<usize>,
    ) -> Result<()> {
        let len = buf.len() as u64;
        self.check_rw("read", offset, len)?;
        if self.needs_bounce(buf.as_ptr() as usize) {
            let mut bounce = IoBuf::new(buf.len());
            self.read_loop(&mut bounce, offset, &mut raw)?;
            buf.copy_from_slice(&bounce);
            return Ok(());
        }
        self.read_loop(buf, offset, &mut raw)
    }

    fn read_loop(
        &self,
        buf: &mut [u8],
        offset: u64,
        raw: &mut impl FnMut(&mut [u8], u64) -> io::Result<usize>,
    ) -> Result<()> {
        let len = buf.len() as u64;
        let mut done = 0usize;
        while done < buf.len() {
            match raw(&mut buf[done..], offset + done as u64) {
                Ok(0) => return Err(BackingError::ShortRead { offset, len, got: done as u64 }),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(BackingError::Io { op: "read", offset, len, source }),
            }
        }
        Ok(())
    }

    /// Writes all of `data` at `offset` with `raw`; the write twin of [`Self::read_full`].
    pub fn write_full(
        &self,
        data: &[u8],
        offset: u64,
        mut raw: impl FnMut(&[u8], u64) -> io::Result<usize>,
    ) -> Result<()> {
        let len = data.len() as u64;
        self.check_rw("write", offset, len)?;
        if self.needs_bounce(data.as_ptr() as usize) {
            let bounce = IoBuf::from_slice(data);
            return self.write_loop(&bounce, offset, &mut raw);
        }
        self.write_loop(data, offset, &mut raw)
    }

    fn write_loop(
        &self,
        data: &[u8],
        offset: u64,
        raw: &mut impl FnMut(&[u8], u64) -> io::Result<usize>,
    ) -> Result<()> {
        let len = data.len() as u64;
        let mut done = 0usize;
        while done < data.len() {
            match raw(&data[done..], offset + done as u64) {
                Ok(0) => return Err(BackingError::ShortWrite { offset, len, got: done as u64 }),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(BackingError::Io { op: "write", offset, len, source }),
            }
        }
        Ok(())
    }

    /// fdatasync.
    pub fn flush(&self) -> Result<()> {
        self.file.sync_data().map_err(|source| BackingError::Io {
            op: "flush",
            offset: 0,
            len: 0,
            source,
        })
    }

    /// Punches a hole in a file, or `BLKDISCARD`s a block device range.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range("discard", offset, len)?;
        let io = |source| BackingError::Io { op: "discard", offset, len, source };
        if self.is_block_device {
            self.check_aligned("discard", offset, len)?;
            block_range_ioctl(&self.file, BLKDISCARD, offset, len).map_err(io)
        } else {
            fallocate(
                &self.file,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
            .map_err(io)
        }
    }

    /// Zeroes a range: `BLKZEROOUT` on a block device; on a file `FALLOC_FL_ZERO_RANGE`, then a
    /// punched hole, then plain writes of zeroes (the first that the file system supports).
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range("write_zeroes", offset, len)?;
        let io = |source| BackingError::Io { op: "write_zeroes", offset, len, source };
        if self.is_block_device {
            self.check_aligned("write_zeroes", offset, len)?;
            return block_range_ioctl(&self.file, BLKZEROOUT, offset, len).map_err(io);
        }
        if len == 0 {
            return Ok(());
        }
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        if fallocate(&self.file, libc::FALLOC_FL_ZERO_RANGE | keep, offset, len).is_ok()
            || fallocate(&self.file, libc::FALLOC_FL_PUNCH_HOLE | keep, offset, len).is_ok()
        {
            return Ok(());
        }
        self.check_aligned("write_zeroes", offset, len)?;
        let zeroes = IoBuf::new(ZERO_CHUNK_BYTES.min(len as usize));
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            std::os::unix::fs::FileExt::write_all_at(&self.file, &zeroes[..n], offset + done)
                .map_err(io)?;
            done += n as u64;
        }
        Ok(())
    }
}

/// `(offset alignment, memory alignment)` for direct I/O, or `None` if the kernel does not say.
#[expect(unsafe_code, reason = "statx has no safe std wrapper that returns the DIO fields")]
fn dio_alignment(file: &File) -> io::Result<Option<(u32, u32)>> {
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: the fd is open, the path is a valid NUL-terminated string (empty, with
    // AT_EMPTY_PATH), and `stx` is a valid, writable `statx`.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::ENOSYS) { Ok(None) } else { Err(err) };
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(None);
    }
    Ok(Some((stx.stx_dio_offset_align, stx.stx_dio_mem_align)))
}

#[expect(unsafe_code, reason = "ioctl")]
fn block_device_sector_bytes(file: &File) -> io::Result<u32> {
    let mut sector: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one `int` through the pointer, which points at `sector`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut sector) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u32::try_from(sector).unwrap_or(512).max(512))
}

#[expect(unsafe_code, reason = "ioctl")]
fn block_range_ioctl(file: &File, request: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD/BLKZEROOUT read two `u64`s (start, length) through the pointer.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), request, range.as_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[expect(unsafe_code, reason = "fallocate has no safe std wrapper")]
pub(crate) fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: fallocate only reads its integer arguments; the fd is owned by `file` and open.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, len) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Converts a kernel result (`-errno` or a byte count) into an `io::Result`.
pub(crate) fn kernel_result(res: i64) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(i32::try_from(-res).unwrap_or(libc::EIO)))
    } else {
        Ok(res as usize)
    }
}
