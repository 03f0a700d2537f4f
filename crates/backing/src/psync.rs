//! The psync engine: one pread/pwrite per request, on a regular file or a block device.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::{BackingError, BackingIdentity, BackingStore, Result};

/// A backing file driven with pread/pwrite (buffered I/O).
#[derive(Debug)]
pub struct PsyncFile {
    file: File,
    size_bytes: u64,
    fingerprint: [u8; 16],
}

impl PsyncFile {
    /// Opens an existing file or block device for reading and writing.
    pub fn open(path: &Path) -> Result<Self> {
        let open_err = |source| BackingError::Open { path: path.display().to_string(), source };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(open_err)?;
        let size_bytes = file_size(&file).map_err(open_err)?;
        let canonical = path.canonicalize().map_err(open_err)?;
        Ok(Self { file, size_bytes, fingerprint: path_fingerprint(&canonical) })
    }

    fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size_bytes => Ok(()),
            _ => Err(BackingError::OutOfRange { op, offset, len, size: self.size_bytes }),
        }
    }
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

/// A 16-byte fingerprint of a canonical path (two CRC32C-chained 64-bit halves; not a secret).
pub fn path_fingerprint(canonical: &Path) -> [u8; 16] {
    let bytes = canonical.as_os_str().as_encoded_bytes();
    let lo = u64::from(crc32c::crc32c(bytes)) | (u64::from(crc32c::crc32c_append(1, bytes)) << 32);
    let hi = u64::from(crc32c::crc32c_append(2, bytes))
        | (u64::from(crc32c::crc32c_append(3, bytes)) << 32);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&lo.to_le_bytes());
    out[8..].copy_from_slice(&hi.to_le_bytes());
    out
}

fn io_err(op: &'static str, offset: u64, len: u64) -> impl FnOnce(io::Error) -> BackingError {
    move |source| BackingError::Io { op, offset, len, source }
}

impl BackingStore for PsyncFile {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn logical_block_size(&self) -> u32 {
        512
    }

    fn identity(&self) -> BackingIdentity {
        BackingIdentity { size_bytes: self.size_bytes, fingerprint: self.fingerprint }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.check_range("read", offset, len)?;
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            match self.file.read_at(&mut buf[done..], at) {
                Ok(0) => return Err(BackingError::ShortRead { offset, len, got: done as u64 }),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err("read", offset, len)(e)),
            }
        }
        Ok(())
    }

    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        let len = data.len() as u64;
        self.check_range("write", offset, len)?;
        self.file.write_all_at(data, offset).map_err(io_err("write", offset, len))
    }

    fn flush(&self) -> Result<()> {
        self.file.sync_data().map_err(io_err("flush", 0, 0))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range("discard", offset, len)?;
        punch_hole(&self.file, offset, len).map_err(io_err("discard", offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range("write_zeroes", offset, len)?;
        // Punching a hole in a file reads back as zeroes; fall back to writing zeroes.
        if punch_hole(&self.file, offset, len).is_ok() {
            return Ok(());
        }
        let zeroes = vec![0u8; 64 * 1024];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            self.file.write_all_at(&zeroes[..n], offset + done).map_err(io_err(
                "write_zeroes",
                offset,
                len,
            ))?;
            done += n as u64;
        }
        Ok(())
    }
}

/// Deallocates a byte range of a regular file (it then reads as zeroes).
fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    rustix_free_punch(file, offset, len)
}

#[expect(unsafe_code, reason = "fallocate has no safe std wrapper")]
fn rustix_free_punch(file: &File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate only reads its integer arguments; the fd is owned by `file` and open.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}
