//! The request streams of the in-process experiments: fio's patterns as the papers ran them
//! (random or sequential, a read share) and block-level analogues of FxMark's workloads.

use rand::Rng;
use rand::rngs::SmallRng;

/// FxMark's DWOM stride: worker *i* writes the page at *i* × 8 MiB of the shared file.
pub const DWOM_STRIDE_BYTES: u64 = 8 << 20;

/// What the threads of one measurement do.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Access {
    /// fio `rw=randread`/`randwrite`/`randrw`: uniformly random `request`-aligned offsets in
    /// `[0, span)`; each request a write with probability `write_share`.
    Random {
        /// Bytes per request.
        request: u64,
        /// Bytes the requests fall in, from 0.
        span: u64,
        /// The probability that a request writes.
        write_share: f64,
    },
    /// fio `rw=read`/`write`/`rw`: each thread streams through its own part of the span,
    /// starting at `thread × span / threads` (rounded down to a request) and wrapping at the
    /// span's end; each request a write with probability `write_share`.
    Sequential {
        /// Bytes per request.
        request: u64,
        /// Bytes the streams go through, from 0.
        span: u64,
        /// The probability that a request writes.
        write_share: f64,
    },
    /// FxMark DWOL at the block level: a volume per thread (FxMark's private file), thread
    /// *t* overwriting the 4 KiB at offset 0 of its own volume, volume *t*.
    Private {
        /// Bytes of each thread's volume.
        volume: u64,
    },
    /// FxMark DWOM at the block level: one volume (FxMark's shared file) of `stride` bytes
    /// per thread, thread *i* overwriting the 4 KiB at `i × stride`.
    Shared {
        /// Bytes between two threads' blocks: each thread's region of the volume.
        stride: u64,
    },
    /// One volume as in `Shared`: a share of the threads write as there; the others read,
    /// block after block, the writers' regions (`stride` bytes each, all written before the
    /// measurement), each reader starting at its own place in them — blocks of other
    /// threads' regions only, never the same block twice in a row.
    Mixed {
        /// Bytes of each thread's region, and between two writers' blocks.
        stride: u64,
        /// The share of the threads that write (see [`writer_count`]).
        writer_share: f64,
    },
}

/// One request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The volume, of a bed's volumes numbered from 0 ([`Access::volumes`]).
    pub volume: usize,
    /// Byte offset in the volume.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// A write (else a read).
    pub write: bool,
}

/// FxMark's page size, the request of its DWOL/DWOM workloads.
pub const PAGE_BYTES: u64 = 4096;

/// Writer threads among `threads` for a writer share: the share rounded, but at least one
/// writer and, from two threads on, at least one reader.
pub fn writer_count(threads: usize, writer_share: f64) -> usize {
    let rounded = (threads as f64 * writer_share).round() as usize;
    if threads < 2 { threads } else { rounded.clamp(1, threads - 1) }
}

impl Access {
    /// The largest request, for buffers.
    pub fn request_max(&self) -> u64 {
        match *self {
            Access::Random { request, .. } | Access::Sequential { request, .. } => request,
            _ => PAGE_BYTES,
        }
    }

    /// The volumes the streams of `threads` threads go to: one per thread under `Private`,
    /// else one.
    pub fn volumes(&self, threads: usize) -> usize {
        match *self {
            Access::Private { .. } => threads,
            _ => 1,
        }
    }

    /// The bytes of each volume the streams of `threads` threads touch: `[0, span_bytes)`.
    pub fn span_bytes(&self, threads: usize) -> u64 {
        match *self {
            Access::Random { span, .. } | Access::Sequential { span, .. } => span,
            Access::Private { volume } => volume,
            Access::Shared { stride } | Access::Mixed { stride, .. } => stride * threads as u64,
        }
    }

    /// Thread `thread`'s stream, one of `threads`.
    pub fn stream(&self, thread: usize, threads: usize) -> Stream {
        assert!(thread < threads, "thread {thread} of {threads}");
        let cursor = match *self {
            Access::Sequential { request, span, .. } => {
                let start = span / threads as u64 * thread as u64;
                start - start % request
            }
            Access::Mixed { stride, writer_share } => {
                let writers = writer_count(threads, writer_share);
                if thread < writers {
                    0
                } else {
                    // Readers spread evenly over the writers' blocks.
                    assert!(stride >= 2 * PAGE_BYTES, "a region of {stride} bytes");
                    let blocks = writers as u64 * (stride / PAGE_BYTES);
                    let (reader, readers) = ((thread - writers) as u64, (threads - writers) as u64);
                    blocks * reader / readers
                }
            }
            _ => 0,
        };
        Stream { access: *self, thread, threads, cursor }
    }
}

/// One thread's requests, one at a time.
#[derive(Clone, Debug)]
pub struct Stream {
    access: Access,
    thread: usize,
    threads: usize,
    /// `Sequential`: the next offset; `Mixed`, a reader: the next of the writers' blocks,
    /// counted from the first writer's first.
    cursor: u64,
}

impl Stream {
    /// The next request.
    pub fn next(&mut self, rng: &mut SmallRng) -> Request {
        match self.access {
            Access::Random { request, span, write_share } => {
                let requests = (span / request).max(1);
                let offset = rng.gen_range(0..requests) * request;
                Request { volume: 0, offset, len: request, write: chance(rng, write_share) }
            }
            Access::Sequential { request, span, write_share } => {
                if self.cursor + request > span {
                    self.cursor = 0;
                }
                let offset = self.cursor;
                self.cursor += request;
                Request { volume: 0, offset, len: request, write: chance(rng, write_share) }
            }
            Access::Private { .. } => {
                Request { volume: self.thread, offset: 0, len: PAGE_BYTES, write: true }
            }
            Access::Shared { stride } => Request {
                volume: 0,
                offset: self.thread as u64 * stride,
                len: PAGE_BYTES,
                write: true,
            },
            Access::Mixed { stride, writer_share } => {
                let writers = writer_count(self.threads, writer_share);
                if self.thread < writers {
                    return Request {
                        volume: 0,
                        offset: self.thread as u64 * stride,
                        len: PAGE_BYTES,
                        write: true,
                    };
                }
                let region_blocks = stride / PAGE_BYTES;
                let block = self.cursor % (writers as u64 * region_blocks);
                self.cursor = block + 1;
                let (writer, in_region) = (block / region_blocks, block % region_blocks);
                Request {
                    volume: 0,
                    offset: writer * stride + in_region * PAGE_BYTES,
                    len: PAGE_BYTES,
                    write: false,
                }
            }
        }
    }
}

fn chance(rng: &mut SmallRng, share: f64) -> bool {
    share > 0.0 && (share >= 1.0 || rng.gen_bool(share))
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn take(access: Access, thread: usize, threads: usize, n: usize) -> Vec<Request> {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut stream = access.stream(thread, threads);
        (0..n).map(|_| stream.next(&mut rng)).collect()
    }

    #[test]
    fn random_requests_are_aligned_inside_the_span_with_the_write_share_asked() {
        let access = Access::Random { request: 4096, span: 1 << 20, write_share: 0.5 };
        let requests = take(access, 0, 1, 20_000);
        assert!(requests.iter().all(|r| r.offset % 4096 == 0 && r.offset + r.len <= 1 << 20));
        let writes = requests.iter().filter(|r| r.write).count() as f64 / 20_000.0;
        assert!((writes - 0.5).abs() < 0.02, "write share {writes}");
        let distinct: std::collections::HashSet<u64> = requests.iter().map(|r| r.offset).collect();
        assert_eq!(distinct.len(), 256, "uniform over every block of the span");
        let reads_only = Access::Random { request: 4096, span: 1 << 20, write_share: 0.0 };
        assert!(take(reads_only, 0, 1, 1000).iter().all(|r| !r.write));
    }

    #[test]
    fn sequential_streams_start_in_their_own_part_and_wrap_at_the_span() {
        let access = Access::Sequential { request: 4 << 20, span: 64 << 20, write_share: 0.0 };
        let first: Vec<u64> = take(access, 0, 4, 5).iter().map(|r| r.offset >> 20).collect();
        assert_eq!(first, [0, 4, 8, 12, 16]);
        let third: Vec<u64> = take(access, 2, 4, 6).iter().map(|r| r.offset >> 20).collect();
        assert_eq!(third, [32, 36, 40, 44, 48, 52]);
        let last: Vec<u64> = take(access, 3, 4, 5).iter().map(|r| r.offset >> 20).collect();
        assert_eq!(last, [48, 52, 56, 60, 0], "wraps at the span's end");
        let mixed = Access::Sequential { request: 4 << 20, span: 1 << 30, write_share: 0.3 };
        let writes = take(mixed, 0, 1, 10_000).iter().filter(|r| r.write).count();
        assert!((2_700..3_300).contains(&writes), "{writes} writes of 10,000 at 30 %");
    }

    #[test]
    fn private_writes_go_to_block_zero_of_each_threads_own_volume() {
        let access = Access::Private { volume: 8 << 20 };
        assert_eq!((access.volumes(4), access.span_bytes(4)), (4, 8 << 20));
        for thread in 0..4 {
            let requests = take(access, thread, 4, 10);
            assert!(requests.iter().all(|r| r.write && r.len == PAGE_BYTES));
            assert!(requests.iter().all(|r| r.volume == thread && r.offset == 0), "{requests:?}");
        }
    }

    #[test]
    fn shared_writes_are_dwom_blocks_eight_mib_apart_in_one_volume() {
        let access = Access::Shared { stride: DWOM_STRIDE_BYTES };
        assert_eq!((access.volumes(16), access.span_bytes(16)), (1, 128 << 20));
        let offsets: Vec<u64> = (0..16).map(|t| take(access, t, 16, 1)[0].offset).collect();
        assert_eq!(offsets, (0..16).map(|t| t * (8 << 20)).collect::<Vec<_>>());
        let fifth = take(access, 5, 16, 8);
        assert!(fifth.iter().all(|r| r.write && r.volume == 0 && r.offset == 5 * (8 << 20)));
    }

    #[test]
    fn private_and_shared_streams_differ_in_volume_and_offset() {
        let private = Access::Private { volume: DWOM_STRIDE_BYTES };
        let shared = Access::Shared { stride: DWOM_STRIDE_BYTES };
        let first = |access: Access| -> Vec<(usize, u64)> {
            (0..8).map(|t| take(access, t, 8, 1)[0]).map(|r| (r.volume, r.offset)).collect()
        };
        let private_places = first(private);
        let shared_places = first(shared);
        assert_eq!(private_places, (0..8).map(|t| (t, 0)).collect::<Vec<_>>());
        assert_eq!(shared_places, (0..8).map(|t| (0, t as u64 * (8 << 20))).collect::<Vec<_>>());
        // Only thread 0's block is the same block in both.
        let same = private_places.iter().zip(&shared_places).filter(|(p, s)| p == s).count();
        assert_eq!(same, 1);
    }

    #[test]
    fn mixed_threads_split_by_share() {
        assert_eq!(writer_count(1, 0.75), 1);
        assert_eq!(writer_count(1, 0.25), 1);
        assert_eq!(writer_count(2, 0.75), 1);
        assert_eq!(writer_count(2, 0.25), 1);
        assert_eq!(writer_count(4, 0.75), 3);
        assert_eq!(writer_count(4, 0.25), 1);
        assert_eq!(writer_count(16, 0.75), 12);
        assert_eq!(writer_count(16, 0.25), 4);
    }

    #[test]
    fn mixed_writers_overwrite_their_block_and_readers_walk_every_block_of_the_writers() {
        const REGION: u64 = 1 << 20;
        let region_blocks = REGION / PAGE_BYTES;
        for (threads, share) in [(2, 0.75), (4, 0.25), (8, 0.75), (16, 0.25)] {
            let access = Access::Mixed { stride: REGION, writer_share: share };
            let writers = writer_count(threads, share);
            let writers_blocks = writers as u64 * region_blocks;
            let mut first_reads = vec![];
            for thread in 0..threads {
                let requests = take(access, thread, threads, 2 * writers_blocks as usize);
                assert!(requests.iter().all(|r| r.volume == 0 && r.len == PAGE_BYTES));
                if thread < writers {
                    assert!(requests.iter().all(|r| r.write && r.offset == thread as u64 * REGION));
                    continue;
                }
                assert!(requests.iter().all(|r| !r.write));
                let blocks: Vec<u64> = requests.iter().map(|r| r.offset / PAGE_BYTES).collect();
                // Inside the writers' regions: never the reader's own region.
                assert!(
                    blocks.iter().all(|&b| b < writers_blocks),
                    "{threads} threads: {blocks:?}"
                );
                assert!(blocks.iter().all(|&b| b / region_blocks != thread as u64));
                // A walk over every block of the writers' regions, each read once per pass.
                let pass: std::collections::HashSet<u64> =
                    blocks[..writers_blocks as usize].iter().copied().collect();
                assert_eq!(pass.len() as u64, writers_blocks, "every writer's block, once");
                assert_eq!(blocks[..writers_blocks as usize], blocks[writers_blocks as usize..]);
                assert!(blocks.windows(2).all(|w| w[0] != w[1]), "never one block twice in a row");
                first_reads.push(blocks[0]);
            }
            // The readers start at different places, spread over the writers' blocks.
            let readers = (threads - writers) as u64;
            let expected: Vec<u64> = (0..readers).map(|r| writers_blocks * r / readers).collect();
            assert_eq!(first_reads, expected, "{threads} threads, writer share {share}");
        }
    }
}
