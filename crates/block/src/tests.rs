use super::*;

/// An error keeps its errno and context, shows both, and takes an I/O error's errno (EIO
/// where it has none).
#[test]
fn block_errors_carry_errno_and_context() {
    let err = BlockError::new(libc::ENOSPC, "cache full");
    assert_eq!((err.errno(), err.context()), (libc::ENOSPC, "cache full"));
    let shown = err.to_string();
    assert!(shown.starts_with("cache full: ") && shown.contains("No space left"), "{shown}");
    let from_io = BlockError::from(std::io::Error::from_raw_os_error(libc::EROFS));
    assert_eq!(from_io.errno(), libc::EROFS);
    assert!(from_io.context().contains("Read-only"), "{}", from_io.context());
    let no_errno = BlockError::from(std::io::Error::other("custom"));
    assert_eq!((no_errno.errno(), no_errno.context()), (libc::EIO, "custom"));
}

/// A connection that records its reads, writes and batches and fails requests at offset 13;
/// a read fills its buffer with its offset.
#[derive(Default)]
struct Recorder {
    reads: Vec<(u64, usize)>,
    writes: Vec<(u64, Vec<u8>, bool)>,
    write_batches: usize,
}

impl BlockConn for Recorder {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.reads.push((offset_bytes, buf.len()));
        if offset_bytes == 13 {
            return Err(BlockError::new(libc::EIO, "bad sector"));
        }
        buf.fill(offset_bytes as u8);
        Ok(())
    }
    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        self.writes.push((offset_bytes, data.to_vec(), fua));
        if offset_bytes == 13 {
            return Err(BlockError::new(libc::EIO, "bad sector"));
        }
        Ok(())
    }
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        self.write_batches += 1;
        for w in writes {
            outcomes.push(self.write(w.offset_bytes, w.data, w.fua));
        }
    }
    fn flush(&mut self) -> Result<(), BlockError> {
        Ok(())
    }
    fn trim(&mut self, _: u64, _: u64, _: bool) -> Result<(), BlockError> {
        Ok(())
    }
    fn write_zeroes(&mut self, _: u64, _: u64, _: bool, _: bool) -> Result<(), BlockError> {
        Ok(())
    }
}

/// A lone started write is written with `write`, several with one `write_batch`; every
/// write is answered at once, in order, a failed one alone.
#[test]
fn default_started_writes_are_answered_at_once() {
    let mut conn = Recorder::default();
    let mut started = Vec::new();
    conn.write_batch_start(&[BatchWrite { offset_bytes: 4, data: b"x", fua: true }], &mut started);
    assert_eq!((conn.write_batches, conn.writes.len()), (0, 1));
    assert!(matches!(started.as_slice(), [Started::Done(Ok(()))]));
    started.clear();
    let batch = [
        BatchWrite { offset_bytes: 0, data: b"ab", fua: false },
        BatchWrite { offset_bytes: 13, data: b"c", fua: false },
    ];
    conn.write_batch_start(&batch, &mut started);
    assert_eq!((conn.write_batches, conn.writes.len()), (1, 3));
    assert!(
        matches!(started.as_slice(), [Started::Done(Ok(())), Started::Done(Err(e))] if e.errno() == libc::EIO)
    );
    assert_eq!(conn.pending(), 0);
    let mut handed = 0;
    assert_eq!(conn.complete(1, &mut |_, _| handed += 1), 0);
    assert_eq!(handed, 0);
}

/// The default batch writes one by one, in order, one outcome each: a failed write fails
/// alone.
#[test]
fn a_default_batch_writes_in_order_with_one_outcome_each() {
    let mut conn = Recorder::default();
    let batch = [
        BatchWrite { offset_bytes: 0, data: b"ab", fua: false },
        BatchWrite { offset_bytes: 13, data: b"c", fua: true },
        BatchWrite { offset_bytes: 0, data: b"d", fua: false },
    ];
    let mut outcomes = Vec::new();
    conn.write_batch(&batch, &mut outcomes);
    assert_eq!(
        conn.writes,
        [(0, b"ab".to_vec(), false), (13, b"c".to_vec(), true), (0, b"d".to_vec(), false)]
    );
    assert_eq!(outcomes.len(), 3);
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok());
    assert_eq!(outcomes[1].as_ref().unwrap_err().errno(), libc::EIO);
}

/// The default read batch (started or not) reads one by one, in order, one outcome each: a
/// failed read fails alone and the others get their bytes.
#[test]
fn a_default_batch_reads_in_order_with_one_outcome_each() {
    let mut conn = Recorder::default();
    let (mut a, mut b, mut c) = ([0u8; 2], [0u8; 1], [0u8; 3]);
    let mut batch = [
        BatchRead { offset_bytes: 5, buf: &mut a },
        BatchRead { offset_bytes: 13, buf: &mut b },
        BatchRead { offset_bytes: 7, buf: &mut c },
    ];
    let mut outcomes = Vec::new();
    conn.read_batch(&mut batch, &mut outcomes);
    assert_eq!(conn.reads, [(5, 2), (13, 1), (7, 3)]);
    assert_eq!(outcomes.len(), 3);
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok());
    assert_eq!(outcomes[1].as_ref().unwrap_err().errno(), libc::EIO);
    let mut started = Vec::new();
    conn.read_batch_start(&mut batch, &mut started);
    assert!(matches!(
        started.as_slice(),
        [Started::Done(Ok(())), Started::Done(Err(_)), Started::Done(Ok(()))]
    ));
    assert_eq!((a, b, c), ([5; 2], [0; 1], [7; 3]));
}

/// The default block status calls the whole range allocated data.
#[test]
fn default_block_status_is_one_data_extent() {
    let mut extents = Vec::new();
    Recorder::default().block_status(4096, 8192, 16, &mut extents).unwrap();
    assert_eq!(extents, [BlockExtent { len_bytes: 8192, hole: false, zero: false }]);
}
