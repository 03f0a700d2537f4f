//! Pipelined reads reach the export in batches (`BlockConn::read_batch`): a READ and the
//! valid READs whose headers are buffered after it, bounded in count and bytes. Every reply
//! comes back in request order with its own data or its own error, in simple and structured
//! form alike, whatever else (writes, flushes, refused requests) is pipelined between them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pmcache_block::{BatchRead, BatchWrite, BlockConn, BlockError};
use pmcache_nbd::codec::*;
use pmcache_nbd::mem::MemConn;
use pmcache_nbd::server::{READ_BATCH_BYTES_MAX, READ_BATCH_MAX, export_info};
use pmcache_nbd::{
    BlockSizes, ConnEnd, Export, ListenAddr, MemExport, ReplayTransport, Server, ServerConfig,
    serve_connection,
};
use pmcache_testkit::nbd::{go_data, option_bytes, request_bytes};
use pmcache_testkit::pseudo_random;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// What the export saw: the size of every `read_batch` call, and the `read` calls made
/// outside a batch.
#[derive(Debug, Default)]
struct Log {
    batches: Mutex<Vec<usize>>,
    lone_reads: AtomicU64,
}

impl Log {
    fn batches(&self) -> Vec<usize> {
        self.batches.lock().expect("log").clone()
    }
}

/// A `MemExport` that logs read batches and advertises `extra_bytes` more than it holds: a
/// read there passes the server's checks and fails in the export (out of range, `EINVAL`).
struct Counting {
    inner: MemExport,
    extra_bytes: u64,
    log: Arc<Log>,
}

impl Counting {
    fn new(size_bytes: usize, max_bytes: u32, extra_bytes: u64) -> Self {
        let sizes = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes };
        let inner = MemExport::new(size_bytes as u64, sizes).expect("export");
        inner.write_at(0, &pseudo_random(size_bytes, 7)).expect("preload");
        Self { inner, extra_bytes, log: Arc::default() }
    }
}

struct CountingConn {
    inner: MemConn,
    log: Arc<Log>,
}

impl Export for Counting {
    type Conn<'a> = CountingConn;

    fn open_conn(&self) -> Result<CountingConn, BlockError> {
        Ok(CountingConn { inner: self.inner.open_conn()?, log: self.log.clone() })
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes() + self.extra_bytes
    }

    fn block_sizes(&self) -> BlockSizes {
        self.inner.block_sizes()
    }

    fn can_multi_conn(&self) -> bool {
        true
    }
}

impl BlockConn for CountingConn {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.log.lone_reads.fetch_add(1, Ordering::Relaxed);
        self.inner.read(offset_bytes, buf)
    }

    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        assert!(outcomes.is_empty(), "the server passes the outcomes in empty");
        self.log.batches.lock().expect("log").push(reads.len());
        self.inner.read_batch(reads, outcomes);
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), BlockError> {
        self.inner.write(offset_bytes, data, fua)
    }

    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), BlockError>>,
    ) {
        self.inner.write_batch(writes, outcomes);
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        self.inner.flush()
    }

    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), BlockError> {
        self.inner.trim(offset_bytes, len_bytes, fua)
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), BlockError> {
        self.inner.write_zeroes(offset_bytes, len_bytes, fua, may_trim)
    }
}

// ----- a client: requests as bytes, replies parsed in order -----

/// Client flags, optionally structured replies, then `NBD_OPT_GO` for "pm" with block sizes.
fn handshake(structured: bool) -> Vec<u8> {
    let mut b = 3u32.to_be_bytes().to_vec();
    if structured {
        b.extend_from_slice(&option_bytes(OPT_STRUCTURED_REPLY, &[]));
    }
    b.extend_from_slice(&option_bytes(OPT_GO, &go_data("pm", &[INFO_BLOCK_SIZE])));
    b
}

fn read_n(r: &mut impl Read, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    r.read_exact(&mut b).expect("a whole reply");
    b
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4"))
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8"))
}

/// Reads the greeting and the option replies up to the `NBD_OPT_GO` ACK.
fn finish_handshake(r: &mut impl Read) {
    assert_eq!(&read_n(r, 18)[..16], b"NBDMAGICIHAVEOPT");
    loop {
        let h = read_n(r, 20);
        let (opt, ty, len) = (be32(&h[8..]), be32(&h[12..]), be32(&h[16..]) as usize);
        read_n(r, len);
        assert!(ty & 0x8000_0000 == 0, "handshake failed: {ty:#x}");
        if opt == OPT_GO && ty == REP_ACK {
            return;
        }
    }
}

/// A request the client sent, and what its reply must be.
#[derive(Debug, Clone)]
struct Sent {
    cookie: u64,
    command: u16,
    offset: u64,
    /// A read's expected data (a read that fails: its length in zeroes).
    expect_data: Vec<u8>,
    /// The NBD error the reply must carry (0: success).
    expect_error: u32,
}

/// Appends a request (and a write's payload) to `out`.
fn request(out: &mut Vec<u8>, command: u16, cookie: u64, offset: u64, len: usize, data: &[u8]) {
    out.extend_from_slice(&request_bytes(command, 0, cookie, offset, len as u32));
    out.extend_from_slice(data);
}

/// Reads the next reply and checks it is `sent`'s: its cookie, its error or (a read) its data,
/// in the form the session uses (reads get one structured chunk on a structured session).
fn expect_reply(r: &mut impl Read, structured: bool, sent: &Sent) {
    let what = format!("cookie {} (command {})", sent.cookie, sent.command);
    if structured && sent.command == CMD_READ {
        let h = read_n(r, 20);
        assert_eq!(be32(&h), STRUCTURED_REPLY_MAGIC, "{what}: not a structured chunk");
        let (flags, ty) = (u16::from_be_bytes([h[4], h[5]]), u16::from_be_bytes([h[6], h[7]]));
        assert_eq!(be64(&h[8..]), sent.cookie, "{what}: replies out of order");
        assert_eq!(flags, REPLY_FLAG_DONE, "{what}: one chunk per read");
        let payload = read_n(r, be32(&h[16..]) as usize);
        match ty {
            REPLY_TYPE_ERROR => {
                assert_eq!(be32(&payload), sent.expect_error, "{what}: its error");
                let message_len = u16::from_be_bytes([payload[4], payload[5]]) as usize;
                assert_eq!(payload.len(), 6 + message_len, "{what}: the error message");
            }
            REPLY_TYPE_OFFSET_DATA => {
                assert_eq!(sent.expect_error, 0, "{what}: succeeded, should have failed");
                assert_eq!(be64(&payload), sent.offset, "{what}: its offset");
                assert!(payload[8..] == sent.expect_data[..], "{what}: its data");
            }
            REPLY_TYPE_NONE => assert!(sent.expect_data.is_empty(), "{what}: no data"),
            other => panic!("{what}: chunk type {other:#x}"),
        }
    } else {
        let h = read_n(r, SIMPLE_REPLY_BYTES);
        assert_eq!(be32(&h), SIMPLE_REPLY_MAGIC, "{what}: not a simple reply");
        assert_eq!(be64(&h[8..]), sent.cookie, "{what}: replies out of order");
        assert_eq!(be32(&h[4..]), sent.expect_error, "{what}: its error");
        if sent.command == CMD_READ && sent.expect_error == 0 {
            let data = read_n(r, sent.expect_data.len());
            assert!(data == sent.expect_data, "{what}: its data");
        }
    }
}

/// Builds a pipelined burst against a model of the export's bytes.
struct Burst {
    bytes: Vec<u8>,
    sent: Vec<Sent>,
    model: Vec<u8>,
}

impl Burst {
    fn new(model: Vec<u8>) -> Self {
        Self { bytes: Vec::new(), sent: Vec::new(), model }
    }

    fn next_cookie(&self) -> u64 {
        self.sent.len() as u64 + 1000
    }

    /// A read that succeeds with the model's bytes.
    fn read(&mut self, offset: u64, len: usize) {
        let at = offset as usize;
        let data = self.model[at..at + len].to_vec();
        self.push(CMD_READ, offset, len, &[], data, 0);
    }

    /// A read that fails with `error`.
    fn failing_read(&mut self, offset: u64, len: usize, error: u32) {
        self.push(CMD_READ, offset, len, &[], Vec::new(), error);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let at = offset as usize;
        self.model[at..at + data.len()].copy_from_slice(data);
        self.push(CMD_WRITE, offset, data.len(), data, Vec::new(), 0);
    }

    fn flush(&mut self) {
        self.push(CMD_FLUSH, 0, 0, &[], Vec::new(), 0);
    }

    fn push(
        &mut self,
        command: u16,
        offset: u64,
        len: usize,
        payload: &[u8],
        expect_data: Vec<u8>,
        expect_error: u32,
    ) {
        let cookie = self.next_cookie();
        request(&mut self.bytes, command, cookie, offset, len, payload);
        self.sent.push(Sent { cookie, command, offset, expect_data, expect_error });
    }
}

/// Serves `burst` on one in-memory connection (the whole burst buffered from the start, so
/// the batches are what the server's bounds make them) and checks every reply, in order.
fn serve_burst(export: &Counting, structured: bool, max_request_bytes: u32, burst: &Burst) {
    let info = export_info(export, "pm", max_request_bytes).expect("info");
    let mut input = handshake(structured);
    input.extend_from_slice(&burst.bytes);
    let mut transport = ReplayTransport::new(input);
    let end = serve_connection(&mut transport, export, &info);
    assert!(matches!(end, Ok(ConnEnd::Closed)), "{end:?}");
    let mut out = &transport.output[..];
    finish_handshake(&mut out);
    for sent in &burst.sent {
        expect_reply(&mut out, structured, sent);
    }
    assert!(out.is_empty(), "{} bytes after the last reply", out.len());
}

/// Reads pipelined back to back go to the export in batches of at most `READ_BATCH_MAX` reads
/// and `READ_BATCH_BYTES_MAX` bytes (a larger read alone); any other request ends a batch.
/// Every reply is the read's own, in order, simple or structured.
#[test]
fn pipelined_reads_reach_the_export_in_bounded_batches() {
    assert_eq!((READ_BATCH_MAX, READ_BATCH_BYTES_MAX), (32, MIB), "the bounds this test uses");
    for structured in [false, true] {
        let export = Counting::new(8 * MIB, 4 * MIB as u32, 0);
        let mut burst = Burst::new(pseudo_random(8 * MIB, 7));
        for i in 0..70u64 {
            burst.read((i * 7919 % 2048) * 4096, 4 * KIB);
        }
        burst.flush();
        for i in 0..20u64 {
            burst.read(i * 64 * KIB as u64, 64 * KIB);
        }
        burst.flush();
        for i in 0..3u64 {
            burst.read(i * MIB as u64, 768 * KIB);
        }
        burst.flush();
        burst.read(3 * MIB as u64, 2 * MIB);
        burst.read(512, 512);
        burst.read(8 * MIB as u64 - 4096, 4096);
        serve_burst(&export, structured, 4 * MIB as u32, &burst);
        let batches = export.log.batches();
        assert_eq!(batches, [32, 32, 6, 16, 4, 1, 1, 1, 1, 2], "structured: {structured}");
        assert_eq!(export.log.lone_reads.load(Ordering::Relaxed), 0, "every read in a batch");
        let stats = export.inner.stats();
        assert_eq!((stats.reads, stats.batched_reads), (96, 92), "{stats:?}");
    }
}

/// The maximum request size bounds a batch's bytes when it is below `READ_BATCH_BYTES_MAX`.
#[test]
fn a_small_maximum_request_size_bounds_the_batch_bytes() {
    let export = Counting::new(MIB, MIB as u32, 0);
    let mut burst = Burst::new(pseudo_random(MIB, 7));
    for i in 0..10u64 {
        burst.read(i * 16 * KIB as u64, 16 * KIB);
    }
    serve_burst(&export, false, 64 * KIB as u32, &burst);
    assert_eq!(export.log.batches(), [4, 4, 2]);
}

/// Reads that fail inside a batch (past the end of what the export holds, or on a faulty
/// range), first, in the middle and last, get their own error replies; the others of the
/// batch their data. A read the server refuses (past the advertised end) gets its error
/// without reaching the export and ends the batch; so does a zero-length read, answered on
/// its own.
#[test]
fn a_failed_read_in_a_batch_gets_its_own_error_reply() {
    for structured in [false, true] {
        let size = MIB;
        let export = Counting::new(size, MIB as u32, 64 * KIB as u64);
        let faulty = 100 * 4096u64;
        export.inner.set_fault(Some((faulty, faulty + 4096, libc::EIO)));
        let mut burst = Burst::new(pseudo_random(size, 7));
        for i in 0..5u64 {
            burst.read(i * 4096, 4096);
        }
        // Advertised, but past what the export holds: fails in the export.
        burst.failing_read(size as u64, 4096, NBD_EINVAL);
        for i in 5..9u64 {
            burst.read(i * 4096, 4096);
        }
        burst.failing_read(faulty, 4096, NBD_EIO);
        burst.read(50 * 4096, 8192);
        burst.failing_read(faulty, 512, NBD_EIO);
        // Past the advertised end: refused by the server.
        burst.failing_read((size + 64 * KIB) as u64, 4096, NBD_EINVAL);
        burst.failing_read(faulty + 3584, 512, NBD_EIO);
        for i in 0..4u64 {
            burst.read(200 * 4096 + i * 512, 512);
        }
        burst.read(4096, 0);
        burst.read(8192, 4096);
        burst.failing_read(size as u64 + 4096, 512, NBD_EINVAL);
        serve_burst(&export, structured, MIB as u32, &burst);
        assert_eq!(export.log.batches(), [13, 5, 2], "structured: {structured}");
        assert_eq!(export.log.lone_reads.load(Ordering::Relaxed), 0);
    }
}

// ----- over a socket, with writes and flushes between the reads -----

/// A client pipelining a long mix of reads, writes and flushes over TCP (a thread sends the
/// whole burst while this one reads the replies): every reply arrives in order with the bytes
/// the requests one by one leave, and the export saw reads in batches.
#[test]
fn pipelined_reads_writes_and_flushes_over_a_socket() {
    for structured in [false, true] {
        let size = 4 * MIB;
        let export = Arc::new(Counting::new(size, MIB as u32, 0));
        let config = ServerConfig {
            export_name: "pm".into(),
            listen: ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ServerConfig::default()
        };
        let server = Server::bind(config, export.clone()).expect("bind");
        let ListenAddr::Tcp(addr) = server.local_addr() else { unreachable!("a TCP listener") };
        let running = server.spawn().expect("spawn");

        let mut burst = Burst::new(pseudo_random(size, 7));
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |bound: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % bound
        };
        for _ in 0..200 {
            burst.read(next(1024) * 4096, 4096);
        }
        for i in 0..3000u64 {
            let len = (1 + next(16) as usize) * 512;
            let offset = next((size - len) as u64 / 512) * 512;
            match next(10) {
                0..6 => burst.read(offset, len),
                6..9 => burst.write(offset, &pseudo_random(len, i)),
                _ => burst.flush(),
            }
        }

        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        s.set_nodelay(true).expect("nodelay");
        s.write_all(&handshake(structured)).expect("handshake");
        finish_handshake(&mut s);
        let mut sender = s.try_clone().expect("clone");
        let bytes = std::mem::take(&mut burst.bytes);
        let sending = std::thread::spawn(move || sender.write_all(&bytes).expect("send"));
        let mut replies = std::io::BufReader::with_capacity(256 * KIB, &s);
        for sent in &burst.sent {
            expect_reply(&mut replies, structured, sent);
        }
        sending.join().expect("sender");
        drop(replies);
        drop(s);
        running.stop().expect("stop");

        let reads = burst.sent.iter().filter(|s| s.command == CMD_READ).count();
        let batches = export.log.batches();
        assert_eq!(batches.iter().sum::<usize>(), reads, "every read went through a batch");
        assert_eq!(export.log.lone_reads.load(Ordering::Relaxed), 0);
        let largest = batches.iter().copied().max().unwrap_or(0);
        assert!(largest > 1, "no read batch of two or more: {batches:?}");
        assert!(largest <= READ_BATCH_MAX, "{batches:?}");
        assert!(batches.len() < reads, "reads were batched: {} batches", batches.len());
        let mut back = vec![0u8; size];
        export.inner.read_at(0, &mut back).expect("read back");
        assert!(back == burst.model, "the export holds what the writes left");
    }
}
