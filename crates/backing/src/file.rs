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
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
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
    /// The inode number of a regular file; 0 for a block device (see `BackingIdentity`).
    pub instance: u64,
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
        let instance = if is_block_device { 0 } else { meta.ino() };
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
            instance,
        })
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn identity(&self) -> BackingIdentity {
        BackingIdentity {
            size_bytes: self.size_bytes,
            fingerprint: self.fingerprint,
            instance: self.instance,
        }
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
        self.write_zero_chunks(offset, len).map_err(io)
    }

    /// The extent at `offset` (at most `len` bytes, `len` > 0): a hole or data, from
    /// `SEEK_DATA`/`SEEK_HOLE`. A block device, or a file system without them, says data.
    pub fn extent_at(&self, offset: u64, len: u64) -> Result<crate::Extent> {
        self.check_range("extent_at", offset, len)?;
        let data = crate::Extent { len, hole: false };
        if self.is_block_device || len == 0 {
            return Ok(data);
        }
        let io = |source| BackingError::Io { op: "extent_at", offset, len, source };
        let Some(data_at) = seek(&self.file, offset, libc::SEEK_DATA).map_err(io)? else {
            // No data from `offset` to the end of the file.
            return Ok(crate::Extent { len, hole: true });
        };
        if data_at > offset {
            return Ok(crate::Extent { len: (data_at - offset).min(len), hole: true });
        }
        let hole_at = seek(&self.file, offset, libc::SEEK_HOLE).map_err(io)?;
        // Every file ends in a (virtual) hole; a file system without SEEK_HOLE reports the end.
        let run = hole_at.map_or(len, |at| at.saturating_sub(offset).clamp(1, len));
        Ok(crate::Extent { len: run, ..data })
    }

    /// Writes zeroes over a range with plain writes, [`ZERO_CHUNK_BYTES`] at a time (for file
    /// systems that can neither zero a range nor punch a hole).
    fn write_zero_chunks(&self, offset: u64, len: u64) -> io::Result<()> {
        let zeroes = IoBuf::new(ZERO_CHUNK_BYTES.min(len as usize));
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            std::os::unix::fs::FileExt::write_all_at(&self.file, &zeroes[..n], offset + done)?;
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

/// `lseek(fd, offset, whence)` for `SEEK_DATA`/`SEEK_HOLE`: the offset found, or `None` when
/// there is none past `offset` (`ENXIO`). A file system without them says EINVAL: taken as data
/// to the end (`Some(offset)` for `SEEK_DATA`, `None` for `SEEK_HOLE`).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let Ok(at) = i64::try_from(offset) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: lseek only reads its integer arguments; the fd is owned by `file` and open. The
    // file offset it moves is not used by this crate, which reads and writes at explicit
    // offsets (pread/pwrite and the queues').
    let found = unsafe { libc::lseek(file.as_raw_fd(), at, whence) };
    if found >= 0 {
        return Ok(Some(found as u64));
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
        e if e.raw_os_error() == Some(libc::EINVAL) => {
            Ok(if whence == libc::SEEK_DATA { Some(offset) } else { None })
        }
        e => Err(e),
    }
}

/// Converts a kernel result (`-errno` or a byte count) into an `io::Result`.
pub(crate) fn kernel_result(res: i64) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(i32::try_from(-res).unwrap_or(libc::EIO)))
    } else {
        Ok(res as usize)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    const BUFFERED: OpenMode = OpenMode { direct: false, read_only: false };
    const DIRECT: OpenMode = OpenMode { direct: true, read_only: false };

    /// A buffered backing file of `len` bytes of `fill`, in /dev/shm.
    fn scratch(len: usize, fill: u8) -> (tempfile::NamedTempFile, BackingFile) {
        let temp = tempfile::NamedTempFile::new_in("/dev/shm").expect("scratch file");
        std::fs::write(temp.path(), vec![fill; len]).expect("fill");
        let file = BackingFile::open(temp.path(), "psync", BUFFERED).expect("open");
        (temp, file)
    }

    fn interrupted() -> io::Error {
        io::Error::from(io::ErrorKind::Interrupted)
    }

    /// A transfer the kernel cut short is continued where it stopped, and one interrupted by
    /// a signal (EINTR) is retried, until every byte has moved.
    #[test]
    fn short_and_interrupted_transfers_are_completed() {
        let (_temp, file) = scratch(8192, 0);
        let data: Vec<u8> = (0..8192).map(|i| (i % 251) as u8 + 1).collect();
        let mut calls = Vec::new();
        file.write_full(&data, 0, |chunk, at| {
            calls.push(at);
            if calls.len() % 2 == 1 {
                return Err(interrupted());
            }
            file.file.write_at(&chunk[..chunk.len().min(3000)], at)
        })
        .expect("write");
        assert_eq!(calls, [0, 0, 3000, 3000, 6000, 6000]);
        let mut back = vec![0u8; 8192];
        let mut calls = Vec::new();
        file.read_full(&mut back, 0, |chunk, at| {
            calls.push(at);
            if calls.len() % 2 == 1 {
                return Err(interrupted());
            }
            let n = chunk.len().min(5000);
            file.file.read_at(&mut chunk[..n], at)
        })
        .expect("read");
        assert_eq!(calls, [0, 0, 5000, 5000]);
        assert_eq!(back, data);
    }

    /// A transfer that moves nothing (end of file, or a device that stops taking data) is a
    /// short read or write saying how far it got; a failed one names its operation and keeps
    /// the kernel's errno.
    #[test]
    fn a_stalled_or_failed_transfer_is_a_precise_error() {
        let (_temp, file) = scratch(4096, 0);
        let mut buf = vec![0u8; 1000];
        let mut moved = 0;
        let err = file
            .read_full(&mut buf, 512, |chunk, _| {
                let n = if moved == 0 { 100.min(chunk.len()) } else { 0 };
                moved += n;
                Ok(n)
            })
            .unwrap_err();
        assert!(
            matches!(err, BackingError::ShortRead { offset: 512, len: 1000, got: 100 }),
            "{err:?}"
        );
        let mut moved = 0;
        let err = file
            .write_full(&buf, 512, |chunk, _| {
                let n = if moved == 0 { 300.min(chunk.len()) } else { 0 };
                moved += n;
                Ok(n)
            })
            .unwrap_err();
        assert!(
            matches!(err, BackingError::ShortWrite { offset: 512, len: 1000, got: 300 }),
            "{err:?}"
        );
        let eio = || io::Error::from_raw_os_error(libc::EIO);
        let err = file.read_full(&mut buf, 0, |_, _| Err(eio())).unwrap_err();
        assert!(
            matches!(err, BackingError::Io { op: "read", offset: 0, len: 1000, .. }),
            "{err:?}"
        );
        assert_eq!(err.errno(), libc::EIO);
        let err = file.write_full(&buf, 8, |_, _| Err(eio())).unwrap_err();
        assert!(
            matches!(err, BackingError::Io { op: "write", offset: 8, len: 1000, .. }),
            "{err:?}"
        );
        assert_eq!(err.errno(), libc::EIO);
    }

    /// The plain-write fallback of write-zeroes covers exactly its range, over more than one
    /// chunk and a part of one.
    #[test]
    fn zeroes_by_plain_writes_cover_exactly_the_range() {
        let len = 3 * ZERO_CHUNK_BYTES + 1000;
        let (temp, file) = scratch(len, 0xff);
        let (at, n) = (100, 2 * ZERO_CHUNK_BYTES + 700);
        file.write_zero_chunks(at as u64, n as u64).expect("zeroes");
        let after = std::fs::read(temp.path()).expect("read back");
        assert!(after[..at].iter().all(|&b| b == 0xff), "before the range");
        assert!(after[at..at + n].iter().all(|&b| b == 0), "the range");
        assert!(after[at + n..].iter().all(|&b| b == 0xff), "after the range");
        file.write_zero_chunks(0, 0).expect("an empty range");
    }

    /// Extents of a sparse file (in the temp dir): the hole before data, the data run,
    /// the hole after it to the end, each clipped to the query's length.
    #[test]
    fn extents_follow_the_holes_and_data_of_a_sparse_file() {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sparse");
        let sparse = std::fs::File::create(&path).expect("create");
        sparse.set_len(8 * MIB).expect("size");
        std::os::unix::fs::FileExt::write_all_at(&sparse, &[7u8; 65536], 2 * MIB).expect("data");
        let file = BackingFile::open(&path, "psync", BUFFERED).expect("open");
        let hole = |len| crate::Extent { len, hole: true };
        let data = |len| crate::Extent { len, hole: false };
        assert_eq!(file.extent_at(0, 8 * MIB).expect("extent"), hole(2 * MIB));
        assert_eq!(file.extent_at(0, MIB).expect("extent"), hole(MIB), "clipped");
        let run = file.extent_at(2 * MIB, 6 * MIB).expect("extent");
        assert!(!run.hole && run.len >= 65536 && run.len < 6 * MIB, "{run:?}");
        assert_eq!(file.extent_at(2 * MIB + 4096, 4096).expect("extent"), data(4096));
        assert_eq!(file.extent_at(4 * MIB, 4 * MIB).expect("extent"), hole(4 * MIB), "to the end");
        assert!(file.extent_at(7 * MIB, 2 * MIB).is_err(), "past the end is refused");
    }

    /// A file system that rejects `O_DIRECT` (procfs here) is named as such, with what to do;
    /// other open failures stay open failures, with or without `O_DIRECT`.
    #[test]
    fn a_file_system_without_direct_io_is_named() {
        let proc_file = Path::new("/proc/self/comm");
        match BackingFile::open(proc_file, "libaio", DIRECT).unwrap_err() {
            BackingError::Unsupported { engine: "libaio", option: "O_DIRECT", reason } => {
                assert!(
                    reason.contains("/proc/self/comm") && reason.contains("--direct"),
                    "{reason}"
                )
            }
            other => panic!("unexpected {other:?}"),
        }
        BackingFile::open(proc_file, "psync", BUFFERED).expect("buffered, procfs opens");
        let missing = Path::new("/dev/shm/pmcache-no-such-backing-file");
        for mode in [BUFFERED, DIRECT] {
            match BackingFile::open(missing, "psync", mode).unwrap_err() {
                BackingError::Open { source, .. } => {
                    assert_eq!(source.raw_os_error(), Some(libc::ENOENT), "{mode:?}")
                }
                other => panic!("{mode:?}: unexpected {other:?}"),
            }
        }
    }

    /// Only a regular file or a block device backs a cache: a character device is refused.
    #[test]
    fn a_character_device_is_refused() {
        match BackingFile::open(Path::new("/dev/null"), "psync", BUFFERED).unwrap_err() {
            BackingError::Open { path, source } => {
                assert_eq!(path, "/dev/null");
                assert_eq!(source.kind(), io::ErrorKind::InvalidInput);
                assert!(source.to_string().contains("not a regular file or block device"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
