//! Tests of a queue's dispatch: batches, ordering, per-tag results, errors.

use super::*;
use crate::mapping::{
    UBLK_IO_F_FUA, UBLK_IO_F_NOUNMAP, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ,
    UBLK_IO_OP_WRITE, UBLK_IO_OP_WRITE_ZEROES,
};
use pmcache_block::{BatchRead, BatchWrite, BlockConn, BlockError, Started};

const BLOCK: usize = 4096;
const GEOMETRY: Geometry =
    Geometry { size_bytes: 64 * BLOCK as u64, logical_block_bytes: 4096, max_io_bytes: 16384 };

/// A RAM device that records its calls and fails anything touching block 13 with ENOSPC.
#[derive(Default)]
struct Ram {
    bytes: Vec<u8>,
    calls: Vec<String>,
}

impl Ram {
    fn new() -> Self {
        Self { bytes: vec![0; GEOMETRY.size_bytes as usize], calls: Vec::new() }
    }

    fn store(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        Self::check(offset, data.len() as u64)?;
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        if fua {
            self.calls.push(format!("fua {offset}"));
        }
        Ok(())
    }

    fn load(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        Self::check(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.bytes[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn check(offset: u64, len: u64) -> Result<(), BlockError> {
        let bad = 13 * BLOCK as u64;
        if offset <= bad && bad < offset + len {
            return Err(BlockError::new(libc::ENOSPC, "block 13"));
        }
        Ok(())
    }
}

impl BlockConn for Ram {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.calls.push(format!("read {offset}"));
        self.load(offset, buf)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        self.calls.push(format!("write {offset}"));
        self.store(offset, data, fua)
    }
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        self.calls.push(format!("write_batch {}", writes.len()));
        for w in writes {
            outcomes.push(self.store(w.offset_bytes, w.data, w.fua));
        }
    }
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        self.calls.push(format!("read_batch {}", reads.len()));
        for r in reads {
            outcomes.push(self.load(r.offset_bytes, r.buf));
        }
    }
    fn flush(&mut self) -> Result<(), BlockError> {
        self.calls.push("flush".into());
        Ok(())
    }
    fn trim(&mut self, offset: u64, len: u64, fua: bool) -> Result<(), BlockError> {
        Self::check(offset, len)?;
        self.calls.push(format!("trim {offset} {len} fua={fua}"));
        Ok(())
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        len: u64,
        fua: bool,
        may_unmap: bool,
    ) -> Result<(), BlockError> {
        Self::check(offset, len)?;
        self.bytes[offset as usize..(offset + len) as usize].fill(0);
        self.calls.push(format!("zeroes {offset} {len} fua={fua} unmap={may_unmap}"));
        Ok(())
    }
}

fn desc(op: u8, flags: u32, block: u64, blocks: u32) -> IoDesc {
    IoDesc::new(op, flags, block * 8, blocks * 8)
}

fn bufs(depth: usize) -> Vec<Vec<u8>> {
    vec![vec![0; GEOMETRY.max_io_bytes as usize]; depth]
}

fn sorted(mut completions: Vec<(u16, i32)>) -> Vec<(u16, i32)> {
    completions.sort_unstable();
    completions
}

/// The writes of a batch go to the target as one write_batch, its reads as one read_batch
/// after them; every tag gets its own result, and read data lands in the read's own buffer.
#[test]
fn a_batch_goes_to_the_batch_calls_with_one_result_per_tag() {
    let mut ram = Ram::new();
    let mut bufs = bufs(8);
    let mut d = Dispatcher::new(GEOMETRY, 8);
    bufs[5][..BLOCK].fill(0xa5);
    bufs[2][..2 * BLOCK].fill(0x5a);
    d.receive(5, &desc(UBLK_IO_OP_WRITE, 0, 3, 1));
    d.receive(2, &desc(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, 7, 2));
    d.receive(6, &desc(UBLK_IO_OP_READ, 0, 7, 2));
    d.receive(1, &desc(UBLK_IO_OP_READ, 0, 3, 1));
    assert_eq!(d.pending(), 4);
    d.dispatch(&mut ram, &mut bufs);
    assert_eq!(d.pending(), 0);
    let done = sorted(d.completions().collect());
    assert_eq!(done, [(1, 4096), (2, 8192), (5, 4096), (6, 8192)]);
    assert_eq!(ram.calls, ["write_batch 2", "fua 28672", "read_batch 2"]);
    assert!(bufs[1][..BLOCK].iter().all(|&b| b == 0xa5));
    assert!(bufs[6][..2 * BLOCK].iter().all(|&b| b == 0x5a));
    assert_eq!(d.completions().count(), 0, "drained");
}

/// Flushes, discards and write-zeroes follow the batch's writes and reads, in arrival order;
/// a discard's FUA reaches trim; NOUNMAP reaches write_zeroes.
#[test]
fn other_requests_follow_in_arrival_order() {
    let mut ram = Ram::new();
    let mut bufs = bufs(8);
    let mut d = Dispatcher::new(GEOMETRY, 8);
    d.receive(0, &desc(UBLK_IO_OP_FLUSH, 0, 0, 0));
    d.receive(1, &desc(UBLK_IO_OP_DISCARD, UBLK_IO_F_FUA, 2, 4));
    d.receive(2, &desc(UBLK_IO_OP_WRITE_ZEROES, UBLK_IO_F_NOUNMAP, 8, 1));
    d.receive(3, &desc(UBLK_IO_OP_WRITE, 0, 20, 1));
    d.dispatch(&mut ram, &mut bufs);
    assert_eq!(
        ram.calls,
        [
            "write 81920",
            "flush",
            "trim 8192 16384 fua=true",
            "zeroes 32768 4096 fua=false unmap=false"
        ]
    );
    assert_eq!(sorted(d.completions().collect()), [(0, 0), (1, 0), (2, 0), (3, 4096)]);
}

/// A request that fails validation completes at once with its errno and never reaches the
/// target; a failed request fails alone, with its errno mapped for the block layer.
#[test]
fn refused_and_failed_requests_fail_alone() {
    let mut ram = Ram::new();
    let mut bufs = bufs(8);
    let mut d = Dispatcher::new(GEOMETRY, 8);
    d.receive(0, &desc(UBLK_IO_OP_READ, 0, 64, 1));
    d.receive(1, &IoDesc::new(UBLK_IO_OP_WRITE, 0, 1, 8));
    d.receive(2, &IoDesc::new(42, 0, 0, 8));
    assert_eq!(d.pending(), 0);
    assert_eq!(
        sorted(d.completions().collect()),
        [(0, -libc::EINVAL), (1, -libc::EINVAL), (2, -libc::EOPNOTSUPP)]
    );
    d.receive(3, &desc(UBLK_IO_OP_WRITE, 0, 13, 1));
    d.receive(4, &desc(UBLK_IO_OP_WRITE, 0, 14, 1));
    d.receive(5, &desc(UBLK_IO_OP_READ, 0, 12, 2));
    d.receive(6, &desc(UBLK_IO_OP_READ, 0, 10, 1));
    d.receive(7, &desc(UBLK_IO_OP_DISCARD, 0, 13, 1));
    d.dispatch(&mut ram, &mut bufs);
    assert_eq!(
        sorted(d.completions().collect()),
        [(3, -libc::ENOSPC), (4, 4096), (5, -libc::ENOSPC), (6, 4096), (7, -libc::ENOSPC)]
    );
    assert!(ram.calls.iter().all(|c| !c.starts_with("trim")), "{:?}", ram.calls);
}

/// A dispatch with nothing received calls nothing.
#[test]
fn an_empty_batch_calls_nothing() {
    let mut ram = Ram::new();
    let mut d = Dispatcher::new(GEOMETRY, 4);
    d.dispatch(&mut ram, &mut bufs(4));
    assert!(ram.calls.is_empty());
    assert_eq!(d.completions().count(), 0);
}

/// A target with only the one-by-one calls gets a batch one by one through the defaults.
#[test]
fn the_default_batch_calls_go_one_by_one() {
    struct Plain(Ram);
    impl BlockConn for Plain {
        fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
            self.0.calls.push(format!("read {offset}"));
            self.0.load(offset, buf)
        }
        fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
            self.0.calls.push(format!("write {offset}"));
            self.0.store(offset, data, fua)
        }
        fn flush(&mut self) -> Result<(), BlockError> {
            self.0.flush()
        }
        fn trim(&mut self, offset: u64, len: u64, fua: bool) -> Result<(), BlockError> {
            self.0.trim(offset, len, fua)
        }
        fn write_zeroes(&mut self, o: u64, l: u64, f: bool, u: bool) -> Result<(), BlockError> {
            self.0.write_zeroes(o, l, f, u)
        }
    }
    let mut plain = Plain(Ram::new());
    let mut bufs = bufs(4);
    let mut d = Dispatcher::new(GEOMETRY, 4);
    d.receive(3, &desc(UBLK_IO_OP_READ, 0, 1, 1));
    d.receive(0, &desc(UBLK_IO_OP_WRITE, 0, 2, 1));
    d.receive(1, &desc(UBLK_IO_OP_WRITE, 0, 4, 1));
    d.receive(2, &desc(UBLK_IO_OP_READ, 0, 5, 1));
    d.dispatch(&mut plain, &mut bufs);
    // Writes in arrival order, then reads by tag.
    assert_eq!(plain.0.calls, ["write 8192", "write 16384", "read 20480", "read 4096"]);
    assert_eq!(d.completions().count(), 4);
}

/// A target that leaves the reads of one block in flight until told (a cache miss on a slow
/// store), answering the rest at once.
struct Slow {
    ram: Ram,
    slow_block: u64,
    /// Reads in flight: (ticket, data).
    in_flight: Vec<(usize, Vec<u8>)>,
    released: bool,
}

impl BlockConn for Slow {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.ram.load(offset, buf)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        self.ram.store(offset, data, fua)
    }
    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        for r in reads {
            let outcome = self.ram.load(r.offset_bytes, r.buf);
            if r.offset_bytes / BLOCK as u64 == self.slow_block {
                let ticket = self.in_flight.len() + 10;
                self.in_flight.push((ticket, r.buf.to_vec()));
                started.push(Started::Pending(ticket));
            } else {
                started.push(Started::Done(outcome));
            }
        }
    }
    /// Writes of the slow block stay in flight too (a write-through to a slow store).
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<Started>) {
        for w in writes {
            let outcome = self.ram.store(w.offset_bytes, w.data, w.fua);
            if w.offset_bytes / BLOCK as u64 == self.slow_block {
                let ticket = self.in_flight.len() + 10;
                self.in_flight.push((ticket, Vec::new()));
                started.push(Started::Pending(ticket));
            } else {
                started.push(Started::Done(outcome));
            }
        }
    }
    fn pending(&self) -> usize {
        self.in_flight.len()
    }
    fn complete(&mut self, _min: usize, done: &mut pmcache_block::Completed<'_>) -> usize {
        if !self.released {
            return 0;
        }
        let n = self.in_flight.len();
        for (ticket, data) in self.in_flight.drain(..) {
            done(ticket, Ok(&data));
        }
        n
    }
    fn flush(&mut self) -> Result<(), BlockError> {
        self.ram.flush()
    }
    fn trim(&mut self, offset: u64, len: u64, fua: bool) -> Result<(), BlockError> {
        self.ram.trim(offset, len, fua)
    }
    fn write_zeroes(&mut self, o: u64, l: u64, f: bool, u: bool) -> Result<(), BlockError> {
        self.ram.write_zeroes(o, l, f, u)
    }
}

/// A read the target leaves in flight holds back no tag of its batch: the others complete at
/// dispatch, and its own tag completes, with its data in its buffer, when the target hands it
/// over.
#[test]
fn a_read_in_flight_completes_its_tag_alone_and_later() {
    let mut slow = Slow { ram: Ram::new(), slow_block: 9, in_flight: Vec::new(), released: false };
    slow.ram.bytes[9 * BLOCK..10 * BLOCK].fill(0x99);
    slow.ram.bytes[2 * BLOCK..3 * BLOCK].fill(0x22);
    let mut bufs = bufs(4);
    let mut d = Dispatcher::new(GEOMETRY, 4);
    d.receive(0, &desc(UBLK_IO_OP_READ, 0, 9, 1));
    d.receive(1, &desc(UBLK_IO_OP_READ, 0, 2, 1));
    d.receive(2, &desc(UBLK_IO_OP_WRITE, 0, 5, 1));
    d.dispatch(&mut slow, &mut bufs);
    assert_eq!(sorted(d.completions().collect()), [(1, 4096), (2, 4096)]);
    assert!(bufs[1][..BLOCK].iter().all(|&b| b == 0x22));
    d.complete_pending(&mut slow, &mut bufs, 0);
    assert_eq!(d.completions().count(), 0, "still in flight");
    slow.released = true;
    d.complete_pending(&mut slow, &mut bufs, 1);
    assert_eq!(d.completions().collect::<Vec<_>>(), [(0, 4096)]);
    assert!(bufs[0][..BLOCK].iter().all(|&b| b == 0x99), "the data in the tag's buffer");
}

/// A write the target leaves in flight holds back no tag either; a FLUSH of a later batch is
/// served only once every request in flight completed.
#[test]
fn a_write_in_flight_completes_its_tag_alone_and_before_a_flush() {
    let mut slow = Slow { ram: Ram::new(), slow_block: 9, in_flight: Vec::new(), released: false };
    let mut bufs = bufs(4);
    bufs[0][..BLOCK].fill(0x77);
    let mut d = Dispatcher::new(GEOMETRY, 4);
    d.receive(0, &desc(UBLK_IO_OP_WRITE, 0, 9, 1));
    d.receive(1, &desc(UBLK_IO_OP_WRITE, 0, 2, 1));
    d.receive(2, &desc(UBLK_IO_OP_READ, 0, 2, 1));
    d.dispatch(&mut slow, &mut bufs);
    assert_eq!(sorted(d.completions().collect()), [(1, 4096), (2, 4096)]);
    d.complete_pending(&mut slow, &mut bufs, 0);
    assert_eq!(d.completions().count(), 0, "still in flight");
    slow.released = true;
    d.receive(3, &desc(UBLK_IO_OP_FLUSH, 0, 0, 0));
    d.dispatch(&mut slow, &mut bufs);
    assert_eq!(
        d.completions().collect::<Vec<_>>(),
        [(0, 4096), (3, 0)],
        "the write, then the flush"
    );
    assert!(slow.ram.bytes[9 * BLOCK..10 * BLOCK].iter().all(|&b| b == 0x77));
}
