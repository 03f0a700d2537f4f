//! Request mapping: a ublk I/O descriptor (`struct ublksrv_io_desc`, which the driver fills for
//! each request it hands a queue) decoded into a [`Request`], validated against the device's
//! [`Geometry`], and an outcome turned into the completion result the driver takes (bytes
//! done, or a negative errno).
//!
//! Pure: no kernel, no libublk. The constants are those of the kernel's UAPI header,
//! `include/uapi/linux/ublk_cmd.h`; `crate::device` asserts at compile time that they match
//! libublk's bindings of it.

use pmcache_block::BlockError;

/// Bytes per sector: `start_sector` and `nr_sectors` always count 512-byte sectors, whatever
/// the device's logical block size.
pub const SECTOR_BYTES: u64 = 512;

// Operations: the low 8 bits of `op_flags` (`ublk_cmd.h`, `UBLK_IO_OP_*`).
/// `UBLK_IO_OP_READ`.
pub const UBLK_IO_OP_READ: u8 = 0;
/// `UBLK_IO_OP_WRITE`.
pub const UBLK_IO_OP_WRITE: u8 = 1;
/// `UBLK_IO_OP_FLUSH`.
pub const UBLK_IO_OP_FLUSH: u8 = 2;
/// `UBLK_IO_OP_DISCARD`.
pub const UBLK_IO_OP_DISCARD: u8 = 3;
/// `UBLK_IO_OP_WRITE_SAME` (never sent: the device does not advertise it).
pub const UBLK_IO_OP_WRITE_SAME: u8 = 4;
/// `UBLK_IO_OP_WRITE_ZEROES`.
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;

// Flags: bits 8-31 of `op_flags` (`ublk_cmd.h`, `UBLK_IO_F_*`).
/// `UBLK_IO_F_FUA`: the write is durable when completed.
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
/// `UBLK_IO_F_NOUNMAP`: a WRITE_ZEROES must not deallocate the range.
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;

/// The fields of `struct ublksrv_io_desc` the mapping reads (the buffer address is the
/// frontend's business).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoDesc {
    /// Operation in bits 0-7, `UBLK_IO_F_*` flags in bits 8-31.
    pub op_flags: u32,
    /// Length in 512-byte sectors.
    pub nr_sectors: u32,
    /// First 512-byte sector.
    pub start_sector: u64,
}

impl IoDesc {
    /// A descriptor of operation `op` with `flags` over `nr_sectors` sectors from
    /// `start_sector`.
    pub fn new(op: u8, flags: u32, start_sector: u64, nr_sectors: u32) -> Self {
        Self { op_flags: u32::from(op) | (flags & !0xff), nr_sectors, start_sector }
    }

    /// The operation code.
    pub fn op(&self) -> u8 {
        (self.op_flags & 0xff) as u8
    }

    /// Whether flag `flag` (`UBLK_IO_F_*`) is set.
    pub fn has(&self, flag: u32) -> bool {
        self.op_flags & flag != 0
    }
}

/// What the device looks like to the kernel; requests are validated against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Device size; a multiple of `logical_block_bytes`.
    pub size_bytes: u64,
    /// Logical block size: a power of two from 512 to the page size. Every request's offset
    /// and length are multiples of it.
    pub logical_block_bytes: u32,
    /// Largest read or write (the size of each tag's buffer).
    pub max_io_bytes: u32,
}

/// A decoded, validated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Read `len_bytes` at `offset_bytes` into the tag's buffer.
    Read {
        /// Byte offset on the device.
        offset_bytes: u64,
        /// Length; at most [`Geometry::max_io_bytes`].
        len_bytes: u32,
    },
    /// Write `len_bytes` of the tag's buffer at `offset_bytes`.
    Write {
        /// Byte offset on the device.
        offset_bytes: u64,
        /// Length; at most [`Geometry::max_io_bytes`].
        len_bytes: u32,
        /// Durable on completion (`UBLK_IO_F_FUA`).
        fua: bool,
    },
    /// Make every completed write durable.
    Flush,
    /// Discard a range: its contents are unspecified until rewritten.
    Discard {
        /// Byte offset on the device.
        offset_bytes: u64,
        /// Length.
        len_bytes: u64,
        /// Durable on completion.
        fua: bool,
    },
    /// Make a range read as zeroes.
    WriteZeroes {
        /// Byte offset on the device.
        offset_bytes: u64,
        /// Length.
        len_bytes: u64,
        /// Durable on completion.
        fua: bool,
        /// The range may be deallocated (`UBLK_IO_F_NOUNMAP` not set).
        may_unmap: bool,
    },
}

impl Request {
    /// The completion result of a request done without error: the bytes transferred for a
    /// read or write (the driver completes that much of the request), 0 otherwise.
    pub fn done_result(&self) -> i32 {
        match *self {
            // At most max_io_bytes, which the device setup keeps within i32.
            Request::Read { len_bytes, .. } | Request::Write { len_bytes, .. } => {
                i32::try_from(len_bytes).unwrap_or(i32::MAX)
            }
            Request::Flush | Request::Discard { .. } | Request::WriteZeroes { .. } => 0,
        }
    }
}

/// Why a descriptor is refused before it reaches the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// An operation the device does not serve (zoned operations, WRITE_SAME, anything new).
    #[error("unsupported ublk operation {op}")]
    Unsupported {
        /// The operation code.
        op: u8,
    },
    /// A read, write, discard or write-zeroes of no sectors.
    #[error("empty request")]
    Empty,
    /// Offset or length not a multiple of the logical block size.
    #[error("request at byte {offset_bytes} of {len_bytes} B is not aligned to {block_bytes} B")]
    Misaligned {
        /// Byte offset.
        offset_bytes: u64,
        /// Length.
        len_bytes: u64,
        /// The logical block size.
        block_bytes: u32,
    },
    /// The request ends past the end of the device.
    #[error(
        "request at byte {offset_bytes} of {len_bytes} B ends past the device's {size_bytes} B"
    )]
    OutOfRange {
        /// Byte offset (saturated when the sector number overflows).
        offset_bytes: u64,
        /// Length.
        len_bytes: u64,
        /// The device size.
        size_bytes: u64,
    },
    /// A read or write longer than a tag's buffer.
    #[error("request of {len_bytes} B is longer than the {max_bytes} B buffer")]
    TooLong {
        /// Length.
        len_bytes: u64,
        /// The buffer size.
        max_bytes: u32,
    },
}

impl MapError {
    /// The errno the request completes with: `EOPNOTSUPP` for an unknown operation, `EINVAL`
    /// for the rest.
    pub fn errno(&self) -> i32 {
        match self {
            MapError::Unsupported { .. } => libc::EOPNOTSUPP,
            _ => libc::EINVAL,
        }
    }
}

/// Decodes and validates one descriptor.
pub fn decode(desc: &IoDesc, geometry: &Geometry) -> Result<Request, MapError> {
    let fua = desc.has(UBLK_IO_F_FUA);
    let op = desc.op();
    let (offset_bytes, len_bytes) = match op {
        UBLK_IO_OP_FLUSH => return Ok(Request::Flush),
        UBLK_IO_OP_READ | UBLK_IO_OP_WRITE | UBLK_IO_OP_DISCARD | UBLK_IO_OP_WRITE_ZEROES => {
            range(desc, geometry)?
        }
        op => return Err(MapError::Unsupported { op }),
    };
    let io_len = || match u32::try_from(len_bytes) {
        Ok(len) if len <= geometry.max_io_bytes => Ok(len),
        _ => Err(MapError::TooLong { len_bytes, max_bytes: geometry.max_io_bytes }),
    };
    Ok(match op {
        UBLK_IO_OP_READ => Request::Read { offset_bytes, len_bytes: io_len()? },
        UBLK_IO_OP_WRITE => Request::Write { offset_bytes, len_bytes: io_len()?, fua },
        UBLK_IO_OP_DISCARD => Request::Discard { offset_bytes, len_bytes, fua },
        _ => Request::WriteZeroes {
            offset_bytes,
            len_bytes,
            fua,
            may_unmap: !desc.has(UBLK_IO_F_NOUNMAP),
        },
    })
}

/// The byte range of a descriptor: non-empty, aligned, within the device.
fn range(desc: &IoDesc, geometry: &Geometry) -> Result<(u64, u64), MapError> {
    let len_bytes = u64::from(desc.nr_sectors) * SECTOR_BYTES;
    if len_bytes == 0 {
        return Err(MapError::Empty);
    }
    let out_of_range = |offset_bytes| MapError::OutOfRange {
        offset_bytes,
        len_bytes,
        size_bytes: geometry.size_bytes,
    };
    let offset_bytes = desc.start_sector.checked_mul(SECTOR_BYTES).ok_or(out_of_range(u64::MAX))?;
    let block = u64::from(geometry.logical_block_bytes);
    if !offset_bytes.is_multiple_of(block) || !len_bytes.is_multiple_of(block) {
        return Err(MapError::Misaligned {
            offset_bytes,
            len_bytes,
            block_bytes: geometry.logical_block_bytes,
        });
    }
    match offset_bytes.checked_add(len_bytes) {
        Some(end) if end <= geometry.size_bytes => Ok((offset_bytes, len_bytes)),
        _ => Err(out_of_range(offset_bytes)),
    }
}

/// The completion result of a failed request: a negative errno among those the block layer
/// reports as what they are (`errno_to_blk_status`): `-ENOSPC` (also for `EDQUOT`, `EFBIG`),
/// `-EINVAL` (also `EOVERFLOW`), `-EOPNOTSUPP` (also `ENOTSUP`), and `-EIO` for everything
/// else (the engine's shut-down, busy and out-of-memory errors included: to the file system
/// above they are all a failed I/O).
pub fn error_result(errno: i32) -> i32 {
    match errno {
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => -libc::ENOSPC,
        libc::EINVAL | libc::EOVERFLOW => -libc::EINVAL,
        // ENOTSUP is EOPNOTSUPP on Linux.
        libc::EOPNOTSUPP => -libc::EOPNOTSUPP,
        _ => -libc::EIO,
    }
}

/// The completion result of `request` given the target's outcome.
pub fn completion_result(request: &Request, outcome: &Result<(), BlockError>) -> i32 {
    match outcome {
        Ok(()) => request.done_result(),
        Err(e) => error_result(e.errno()),
    }
}

#[cfg(test)]
#[path = "mapping_tests.rs"]
mod tests;
