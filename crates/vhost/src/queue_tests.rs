//! Batches of descriptor chains built in guest memory (virtio-queue's mock split queue),
//! served on a RAM disk that can leave reads in flight.

use pmcache_block::{BatchRead, BlockConn, BlockError, Completed, Started};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{RawDescriptor, split::Descriptor as SplitDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueOwnedT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;
use crate::virtio::{ID_BYTES, STATUS_UNSUPP};

const BLOCK: usize = 4096;
const DISK_BYTES: usize = 64 * BLOCK;
/// Where the tests' buffers start in guest memory (the queue's rings are below).
const DATA: u64 = 0x10_0000;

/// A RAM disk; with `defer_reads`, every read is left in flight until `complete`.
#[derive(Default)]
struct Disk {
    bytes: Vec<u8>,
    defer_reads: bool,
    in_flight: Vec<(usize, u64, usize)>,
    flushes: usize,
    log: Vec<String>,
}

impl Disk {
    fn new() -> Self {
        Self { bytes: vec![0; DISK_BYTES], ..Self::default() }
    }
}

impl BlockConn for Disk {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        let o = offset as usize;
        buf.copy_from_slice(&self.bytes[o..o + buf.len()]);
        Ok(())
    }

    fn write(&mut self, offset: u64, data: &[u8], _fua: bool) -> Result<(), BlockError> {
        self.log.push(format!("write {offset} {}", data.len()));
        let o = offset as usize;
        self.bytes[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read_batch_start(&mut self, reads: &mut [BatchRead<'_>], started: &mut Vec<Started>) {
        for r in reads {
            self.log.push(format!("read {} {}", r.offset_bytes, r.buf.len()));
            if self.defer_reads {
                let ticket = self.in_flight.len();
                self.in_flight.push((ticket, r.offset_bytes, r.buf.len()));
                started.push(Started::Pending(ticket));
            } else {
                started.push(Started::Done(self.read(r.offset_bytes, r.buf)));
            }
        }
    }

    fn pending(&self) -> usize {
        self.in_flight.len()
    }

    fn complete(&mut self, _min: usize, done: &mut Completed<'_>) -> usize {
        let n = self.in_flight.len();
        // Out of order: the last started completes first.
        for (ticket, offset, len) in self.in_flight.drain(..).rev() {
            let o = offset as usize;
            done(ticket, Ok(&self.bytes[o..o + len]));
        }
        n
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        self.flushes += 1;
        Ok(())
    }

    fn trim(&mut self, offset: u64, len: u64, _fua: bool) -> Result<(), BlockError> {
        self.log.push(format!("trim {offset} {len}"));
        Ok(())
    }

    fn write_zeroes(
        &mut self,
        offset: u64,
        len: u64,
        _fua: bool,
        may_trim: bool,
    ) -> Result<(), BlockError> {
        self.log.push(format!("zeroes {offset} {len} {may_trim}"));
        let o = offset as usize;
        self.bytes[o..o + len as usize].fill(0);
        Ok(())
    }
}

fn geometry() -> Geometry {
    Geometry {
        size_bytes: DISK_BYTES as u64,
        block_bytes: BLOCK as u32,
        physical_block_exp: 0,
        queues: 1,
        queue_size: 64,
        read_only: false,
        serial: *b"pmcache-test-serial\0",
    }
}

/// One descriptor of a test chain: guest address, length, device-writable.
type Desc = (u64, u32, bool);

/// A request's chain: its header at `at` (written by `Bed::header`), the data descriptors,
/// a status byte after the header.
fn request(at: u64, data: &[Desc]) -> Vec<Desc> {
    let mut chain = vec![(at, 16, false)];
    chain.extend_from_slice(data);
    chain.push((at + 16, 1, true));
    chain
}

struct Bed {
    mem: GuestMemoryMmap,
}

impl Bed {
    fn new() -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x80_0000)]).unwrap();
        Self { mem }
    }

    /// Writes the header of a request at `at`.
    fn header(&self, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn status(&self, at: u64) -> u8 {
        self.mem.read_obj(GuestAddress(at + 16)).unwrap()
    }

    /// Serves `chains` as one batch on `disk`; returns (head, used length) of each.
    fn serve(
        &self,
        disk: Disk,
        geometry: Geometry,
        chains: &[Vec<Desc>],
    ) -> (Disk, Vec<(u16, u32)>) {
        let vq = MockSplitQueue::new(&self.mem, 64);
        let mut raw = Vec::new();
        for chain in chains {
            for (i, &(addr, len, write)) in chain.iter().enumerate() {
                let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
                let next = if i + 1 < chain.len() {
                    flags |= VRING_DESC_F_NEXT as u16;
                    raw.len() as u16 + 1
                } else {
                    0
                };
                raw.push(RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next)));
            }
        }
        vq.add_desc_chains(&raw, 0).unwrap();
        let mut queue: Queue = vq.create_queue().unwrap();
        let available: Vec<_> = queue.iter(&self.mem).unwrap().collect();
        assert_eq!(available.len(), chains.len());
        let mut server = QueueServer::new(disk, geometry);
        let mut answered = Vec::new();
        server.serve(&self.mem, available, &mut answered);
        (server.target, answered)
    }
}

/// A write then, in the next batch, a read of the same blocks: the data goes through, each
/// answered OK with its used length (data read + the status byte).
#[test]
fn a_write_then_a_read_round_trip() {
    let bed = Bed::new();
    let pattern: Vec<u8> = (0..2 * BLOCK).map(|i| (i % 251) as u8).collect();
    bed.mem.write_slice(&pattern, GuestAddress(DATA)).unwrap();
    bed.header(0x8000, VIRTIO_BLK_T_OUT, 16);
    let write = request(0x8000, &[(DATA, 2 * BLOCK as u32, false)]);
    let (disk, answered) = bed.serve(Disk::new(), geometry(), &[write]);
    assert_eq!(answered, vec![(0, 1)]);
    assert_eq!(bed.status(0x8000), STATUS_OK);
    assert_eq!(&disk.bytes[16 * 512..16 * 512 + 2 * BLOCK], &pattern[..]);

    bed.header(0x9000, VIRTIO_BLK_T_IN, 16);
    let read = request(0x9000, &[(DATA + 0x10000, 2 * BLOCK as u32, true)]);
    let (_, answered) = bed.serve(disk, geometry(), &[read]);
    assert_eq!(answered, vec![(0, 2 * BLOCK as u32 + 1)]);
    let mut back = vec![0u8; 2 * BLOCK];
    bed.mem.read_slice(&mut back, GuestAddress(DATA + 0x10000)).unwrap();
    assert_eq!(back, pattern);
}

/// A read scattered over buffers that are not adjacent is served one part per buffer,
/// straight into each; buffers of less than a block go through a buffer of the request's.
#[test]
fn scattered_reads_are_served_in_parts_or_through_a_buffer() {
    let bed = Bed::new();
    let mut disk = Disk::new();
    for (i, b) in disk.bytes.iter_mut().enumerate() {
        *b = (i / 7) as u8;
    }
    let expected = disk.bytes[0..2 * BLOCK].to_vec();
    bed.header(0x8000, VIRTIO_BLK_T_IN, 0);
    let parts = request(0x8000, &[(DATA + 0x4000, BLOCK as u32, true), (DATA, BLOCK as u32, true)]);
    bed.header(0x9000, VIRTIO_BLK_T_IN, 0);
    let uneven = request(
        0x9000,
        &[(DATA + 0x20000, 512, true), (DATA + 0x30000, 2 * BLOCK as u32 - 512, true)],
    );
    let (disk, answered) = bed.serve(disk, geometry(), &[parts, uneven]);
    assert_eq!(answered.iter().map(|a| a.1).collect::<Vec<_>>(), vec![8193, 8193]);
    assert_eq!(disk.log, ["read 0 4096", "read 4096 4096", "read 0 8192"]);
    let mut a = vec![0u8; BLOCK];
    bed.mem.read_slice(&mut a, GuestAddress(DATA + 0x4000)).unwrap();
    assert_eq!(a, expected[..BLOCK]);
    bed.mem.read_slice(&mut a, GuestAddress(DATA)).unwrap();
    assert_eq!(a, expected[BLOCK..]);
    let mut head = vec![0u8; 512];
    bed.mem.read_slice(&mut head, GuestAddress(DATA + 0x20000)).unwrap();
    assert_eq!(head, expected[..512]);
    let mut tail = vec![0u8; 2 * BLOCK - 512];
    bed.mem.read_slice(&mut tail, GuestAddress(DATA + 0x30000)).unwrap();
    assert_eq!(tail, expected[512..]);
}

/// Reads left in flight and completed out of order are answered in the order the guest made
/// them available, with their data.
#[test]
fn reads_in_flight_are_answered_in_available_order() {
    let bed = Bed::new();
    let mut disk = Disk::new();
    disk.defer_reads = true;
    disk.bytes[..BLOCK].fill(1);
    disk.bytes[BLOCK..2 * BLOCK].fill(2);
    let mut chains = Vec::new();
    for i in 0..4u64 {
        let at = 0x8000 + i * 0x100;
        bed.header(at, VIRTIO_BLK_T_IN, (i % 2) * 8);
        chains.push(request(at, &[(DATA + i * 0x1000, BLOCK as u32, true)]));
    }
    let (disk, answered) = bed.serve(disk, geometry(), &chains);
    assert_eq!(disk.in_flight.len(), 0);
    let heads: Vec<u16> = answered.iter().map(|a| a.0).collect();
    assert_eq!(heads, vec![0, 3, 6, 9], "heads in available order");
    for i in 0..4u64 {
        let b: u8 = bed.mem.read_obj(GuestAddress(DATA + i * 0x1000 + 100)).unwrap();
        assert_eq!(b, 1 + (i % 2) as u8);
        assert_eq!(bed.status(0x8000 + i * 0x100), STATUS_OK);
    }
}

/// Refusals: past the end, misaligned, an unknown type, a write to a read-only device. Each
/// is answered with its status, and the good request beside them is served.
#[test]
fn bad_requests_are_answered_with_their_status() {
    let bed = Bed::new();
    let mut chains = Vec::new();
    let cases = [
        (VIRTIO_BLK_T_IN, (DISK_BYTES / 512) as u64, STATUS_IOERR),
        (VIRTIO_BLK_T_IN, 1, STATUS_IOERR),
        (99, 0, STATUS_UNSUPP),
        (VIRTIO_BLK_T_IN, 8, STATUS_OK),
    ];
    for (i, &(kind, sector, _)) in cases.iter().enumerate() {
        let at = 0x8000 + i as u64 * 0x100;
        bed.header(at, kind, sector);
        chains.push(request(at, &[(DATA + i as u64 * 0x1000, BLOCK as u32, true)]));
    }
    let (_, answered) = bed.serve(Disk::new(), geometry(), &chains);
    for (i, &(_, _, status)) in cases.iter().enumerate() {
        assert_eq!(bed.status(0x8000 + i as u64 * 0x100), status, "case {i}");
    }
    assert_eq!(answered[3].1, BLOCK as u32 + 1);
    assert_eq!(answered[0].1, 1, "a refused read reads nothing");

    let read_only = Geometry { read_only: true, ..geometry() };
    bed.header(0x8000, VIRTIO_BLK_T_OUT, 0);
    let write = request(0x8000, &[(DATA, BLOCK as u32, false)]);
    let (disk, _) = bed.serve(Disk::new(), read_only, &[write]);
    assert_eq!(bed.status(0x8000), STATUS_UNSUPP);
    assert!(disk.log.is_empty(), "nothing reached the disk");
}

/// FLUSH, GET_ID, DISCARD and WRITE_ZEROES reach the target; GET_ID answers the serial.
#[test]
fn flush_get_id_discard_and_write_zeroes() {
    let bed = Bed::new();
    let mut disk = Disk::new();
    disk.bytes[BLOCK..2 * BLOCK].fill(9);
    let mut ranges = Vec::new();
    for (sector, sectors, flags) in [(8u64, 8u32, 1u32), (24, 16, 0)] {
        ranges.extend_from_slice(&sector.to_le_bytes());
        ranges.extend_from_slice(&sectors.to_le_bytes());
        ranges.extend_from_slice(&flags.to_le_bytes());
    }
    bed.mem.write_slice(&ranges, GuestAddress(DATA)).unwrap();
    bed.mem.write_slice(&ranges[..16], GuestAddress(DATA + 0x100)).unwrap();
    bed.mem.write_slice(&[0u8; 4], GuestAddress(DATA + 0x10C)).unwrap(); // discard: no unmap flag
    bed.header(0x8000, VIRTIO_BLK_T_FLUSH, 0);
    bed.header(0x8100, VIRTIO_BLK_T_GET_ID, 0);
    bed.header(0x8200, VIRTIO_BLK_T_WRITE_ZEROES, 0);
    bed.header(0x8300, VIRTIO_BLK_T_DISCARD, 0);
    let chains = [
        request(0x8000, &[]),
        request(0x8100, &[(DATA + 0x1000, ID_BYTES as u32, true)]),
        request(0x8200, &[(DATA, 32, false)]),
        request(0x8300, &[(DATA + 0x100, 16, false)]),
    ];
    let (disk, answered) = bed.serve(disk, geometry(), &chains);
    for at in [0x8000, 0x8100, 0x8200, 0x8300] {
        assert_eq!(bed.status(at), STATUS_OK, "request at {at:#x}");
    }
    assert_eq!(disk.flushes, 1);
    assert_eq!(answered[1].1, ID_BYTES as u32 + 1);
    let mut id = [0u8; ID_BYTES];
    bed.mem.read_slice(&mut id, GuestAddress(DATA + 0x1000)).unwrap();
    assert_eq!(&id, b"pmcache-test-serial\0");
    assert_eq!(disk.log, ["zeroes 4096 4096 true", "zeroes 12288 8192 false", "trim 4096 4096"]);
    assert!(disk.bytes[BLOCK..2 * BLOCK].iter().all(|&b| b == 0));
}

/// Two reads into the same guest buffer in one batch: the later is refused, so the target
/// never holds two references to the same bytes; a write from a buffer another request
/// reads into is refused too.
#[test]
fn requests_whose_buffers_overlap_are_refused() {
    let bed = Bed::new();
    let mut chains = Vec::new();
    for (i, (kind, buf)) in [
        (VIRTIO_BLK_T_IN, DATA),
        (VIRTIO_BLK_T_IN, DATA + 0x800),
        (VIRTIO_BLK_T_OUT, DATA + 0x10000),
    ]
    .into_iter()
    .enumerate()
    {
        let at = 0x8000 + i as u64 * 0x100;
        bed.header(at, kind, 0);
        chains.push(request(at, &[(buf, BLOCK as u32, kind == VIRTIO_BLK_T_IN)]));
    }
    let (disk, _) = bed.serve(Disk::new(), geometry(), &chains);
    assert_eq!(bed.status(0x8000), STATUS_OK);
    assert_eq!(bed.status(0x8100), STATUS_IOERR, "overlaps the first read's buffer");
    assert_eq!(bed.status(0x8200), STATUS_OK, "a write from its own buffer");
    assert_eq!(disk.log, ["write 0 4096", "read 0 4096"]);
}

/// A chain without a device-writable byte cannot be answered: used length 0, and nothing is
/// served for it.
#[test]
fn a_chain_with_nowhere_to_answer_is_returned_unanswered() {
    let bed = Bed::new();
    bed.header(0x8000, VIRTIO_BLK_T_OUT, 0);
    let chain = vec![(0x8000, 16, false), (DATA, BLOCK as u32, false)];
    let (disk, answered) = bed.serve(Disk::new(), geometry(), &[chain]);
    assert_eq!(answered, vec![(0, 0)]);
    assert!(disk.log.is_empty());
}
