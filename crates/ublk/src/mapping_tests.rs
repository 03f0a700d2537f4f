//! Tests of the request mapping: operations, flags, ranges, alignment, errnos.

use super::*;

const GEOMETRY: Geometry =
    Geometry { size_bytes: 1 << 30, logical_block_bytes: 4096, max_io_bytes: 1 << 20 };

fn decoded(op: u8, flags: u32, start_sector: u64, nr_sectors: u32) -> Result<Request, MapError> {
    decode(&IoDesc::new(op, flags, start_sector, nr_sectors), &GEOMETRY)
}

/// The operation is the low 8 bits, the flags the rest; a descriptor keeps both apart.
#[test]
fn op_and_flags_share_one_word() {
    let desc = IoDesc::new(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA | UBLK_IO_F_NOUNMAP | 0xff, 8, 8);
    assert_eq!(desc.op(), UBLK_IO_OP_WRITE);
    assert_eq!(desc.op_flags, 1 | UBLK_IO_F_FUA | UBLK_IO_F_NOUNMAP);
    assert!(desc.has(UBLK_IO_F_FUA) && desc.has(UBLK_IO_F_NOUNMAP));
    assert!(!IoDesc::new(UBLK_IO_OP_WRITE, 0, 0, 8).has(UBLK_IO_F_FUA));
}

/// Reads and writes become byte ranges; FUA rides on writes; flags the mapping does not
/// know (FAILFAST, META) change nothing.
#[test]
fn reads_and_writes_with_and_without_fua() {
    assert_eq!(
        decoded(UBLK_IO_OP_READ, 0, 8, 8),
        Ok(Request::Read { offset_bytes: 4096, len_bytes: 4096 })
    );
    assert_eq!(
        decoded(UBLK_IO_OP_WRITE, 0, 16, 256),
        Ok(Request::Write { offset_bytes: 8192, len_bytes: 128 << 10, fua: false })
    );
    assert_eq!(
        decoded(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, 0, 8),
        Ok(Request::Write { offset_bytes: 0, len_bytes: 4096, fua: true })
    );
    let failfast_meta = (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11);
    assert_eq!(
        decoded(UBLK_IO_OP_READ, failfast_meta, 8, 8),
        Ok(Request::Read { offset_bytes: 4096, len_bytes: 4096 })
    );
}

/// A FLUSH has no range: whatever sectors it names are ignored; with FUA it is a flush.
#[test]
fn a_flush_has_no_range() {
    assert_eq!(decoded(UBLK_IO_OP_FLUSH, 0, 0, 0), Ok(Request::Flush));
    assert_eq!(decoded(UBLK_IO_OP_FLUSH, UBLK_IO_F_FUA, u64::MAX, 7), Ok(Request::Flush));
    assert_eq!(Request::Flush.done_result(), 0);
}

/// Discards and write-zeroes take ranges longer than a buffer (up to the device end);
/// NOUNMAP forbids deallocating zeroes.
#[test]
fn discard_and_write_zeroes_ranges() {
    let whole = (GEOMETRY.size_bytes / SECTOR_BYTES) as u32;
    assert_eq!(
        decoded(UBLK_IO_OP_DISCARD, 0, 0, whole),
        Ok(Request::Discard { offset_bytes: 0, len_bytes: 1 << 30, fua: false })
    );
    assert_eq!(
        decoded(UBLK_IO_OP_DISCARD, UBLK_IO_F_FUA, 8, 8),
        Ok(Request::Discard { offset_bytes: 4096, len_bytes: 4096, fua: true })
    );
    assert_eq!(
        decoded(UBLK_IO_OP_WRITE_ZEROES, 0, 8, 4096),
        Ok(Request::WriteZeroes {
            offset_bytes: 4096,
            len_bytes: 2 << 20,
            fua: false,
            may_unmap: true
        })
    );
    assert_eq!(
        decoded(UBLK_IO_OP_WRITE_ZEROES, UBLK_IO_F_NOUNMAP | UBLK_IO_F_FUA, 8, 8),
        Ok(Request::WriteZeroes {
            offset_bytes: 4096,
            len_bytes: 4096,
            fua: true,
            may_unmap: false
        })
    );
    // A discard ending exactly at the device end is in range; one sector further is not.
    assert!(decoded(UBLK_IO_OP_DISCARD, 0, u64::from(whole) - 8, 8).is_ok());
    assert!(matches!(
        decoded(UBLK_IO_OP_DISCARD, 0, u64::from(whole), 8),
        Err(MapError::OutOfRange { .. })
    ));
    for op in [UBLK_IO_OP_DISCARD, UBLK_IO_OP_WRITE_ZEROES] {
        let r = decoded(op, 0, 8, 8).unwrap();
        assert_eq!(r.done_result(), 0, "{r:?}");
    }
}

/// Requests past the end, including a start sector whose byte offset overflows u64, are
/// refused with EINVAL.
#[test]
fn out_of_range_requests_are_refused() {
    let last = GEOMETRY.size_bytes / SECTOR_BYTES - 8;
    assert!(decoded(UBLK_IO_OP_READ, 0, last, 8).is_ok());
    for (start, n) in [(last, 16), (last + 8, 8), (u64::MAX / 512 + 1, 8), (u64::MAX - 3, 8)] {
        let err = decoded(UBLK_IO_OP_READ, 0, start, n).unwrap_err();
        assert!(matches!(err, MapError::OutOfRange { .. }), "{start} {n}: {err:?}");
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(err.to_string().contains("past the device"), "{err}");
    }
}

/// Offsets and lengths must be multiples of the logical block size; empty requests and reads
/// or writes longer than a buffer are refused.
#[test]
fn misaligned_empty_and_too_long_requests_are_refused() {
    for (op, start, n) in [
        (UBLK_IO_OP_READ, 1, 8),
        (UBLK_IO_OP_WRITE, 8, 1),
        (UBLK_IO_OP_DISCARD, 4, 8),
        (UBLK_IO_OP_WRITE_ZEROES, 8, 12),
    ] {
        let err = decoded(op, 0, start, n).unwrap_err();
        assert!(matches!(err, MapError::Misaligned { block_bytes: 4096, .. }), "{err:?}");
        assert_eq!(err.errno(), libc::EINVAL);
    }
    for op in [UBLK_IO_OP_READ, UBLK_IO_OP_WRITE, UBLK_IO_OP_DISCARD, UBLK_IO_OP_WRITE_ZEROES] {
        assert_eq!(decoded(op, 0, 8, 0), Err(MapError::Empty));
    }
    let too_long = (2 << 20) / 512;
    for op in [UBLK_IO_OP_READ, UBLK_IO_OP_WRITE] {
        let err = decoded(op, 0, 0, too_long).unwrap_err();
        assert_eq!(err, MapError::TooLong { len_bytes: 2 << 20, max_bytes: 1 << 20 });
        assert_eq!(err.errno(), libc::EINVAL);
    }
    // 512-byte logical blocks take any sector.
    let small = Geometry { logical_block_bytes: 512, ..GEOMETRY };
    let desc = IoDesc::new(UBLK_IO_OP_READ, 0, 1, 1);
    assert_eq!(decode(&desc, &small), Ok(Request::Read { offset_bytes: 512, len_bytes: 512 }));
}

/// Operations the device does not serve (WRITE_SAME, zoned ones, anything unknown) complete
/// with EOPNOTSUPP.
#[test]
fn unknown_operations_are_not_supported() {
    for op in [UBLK_IO_OP_WRITE_SAME, 10, 13, 15, 18, 0x7f, 0xff] {
        let err = decoded(op, 0, 0, 8).unwrap_err();
        assert_eq!(err, MapError::Unsupported { op });
        assert_eq!(err.errno(), libc::EOPNOTSUPP);
    }
}

/// A read or write completes with its byte count; failures with the negative errno the
/// block layer reports as what it is, EIO for the rest.
#[test]
fn outcomes_become_completion_results() {
    let read = Request::Read { offset_bytes: 0, len_bytes: 8192 };
    let write = Request::Write { offset_bytes: 0, len_bytes: 4096, fua: true };
    assert_eq!(completion_result(&read, &Ok(())), 8192);
    assert_eq!(completion_result(&write, &Ok(())), 4096);
    let failed = |errno| completion_result(&write, &Err(BlockError::new(errno, "x")));
    assert_eq!(failed(libc::EIO), -libc::EIO);
    for errno in [libc::ENOSPC, libc::EDQUOT, libc::EFBIG] {
        assert_eq!(failed(errno), -libc::ENOSPC);
    }
    for errno in [libc::EINVAL, libc::EOVERFLOW] {
        assert_eq!(failed(errno), -libc::EINVAL);
    }
    assert_eq!(failed(libc::ENOTSUP), -libc::EOPNOTSUPP);
    for errno in [libc::ESHUTDOWN, libc::EBUSY, libc::ENOMEM, libc::EROFS, libc::EPERM, 0, 9999] {
        assert_eq!(failed(errno), -libc::EIO, "errno {errno}");
    }
}
