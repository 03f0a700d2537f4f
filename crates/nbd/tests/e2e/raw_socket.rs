//! A raw-socket client sending malformed handshakes and requests: error replies where the
//! spec names one, only the offending connection closed otherwise, and the server keeps
//! serving well-behaved clients.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pmcache_nbd::codec::*;
use pmcache_nbd::{BlockSizes, ListenAddr, MemExport, Server, ServerConfig, ServerError};

use pmcache_testkit::nbd::{Chunk, RawNbd, go_data, misbehaving_clients};

use crate::common::{NAME, TestServer, Via};

const MIB: u64 = 1 << 20;

fn aligned_server() -> TestServer {
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 1 << 20 };
    TestServer::start_with(MIB, bs, Via::Tcp, |c| c.max_request_bytes = 64 * 1024)
}

#[test]
fn malformed_requests_get_spec_errors_and_connection_keeps_working() {
    let server = aligned_server();
    server.export.set_fault(Some((512 * 1024, 516 * 1024, libc::EIO)));
    let mut c = RawNbd::ready(server.tcp_addr());
    let big = vec![0xcc; 128 * 1024];
    // All pipelined in one burst; replies come back in order.
    c.request(CMD_READ, 0, 1, MIB, 512, &[]); // past the end
    c.request(CMD_WRITE, 0, 2, MIB - 512, 1024, &[1; 1024]); // past the end, payload follows
    c.request(CMD_READ, 0, 3, 1, 512, &[]); // misaligned offset
    c.request(CMD_WRITE, 0, 4, 0, 100, &[2; 100]); // misaligned length, payload follows
    c.request(CMD_READ, 0, 5, 0, 1 << 20, &[]); // oversize (max 64 KiB)
    c.request(CMD_WRITE, 0, 6, 0, big.len() as u32, &big); // oversize, payload follows
    c.request(42, 0, 7, 0, 512, &[]); // unknown command
    c.request(CMD_READ, 1 << 9, 8, 0, 512, &[]); // unknown flag
    c.request(CMD_FLUSH, 0, 9, 512, 0, &[]); // flush with an offset
    c.request(CMD_BLOCK_STATUS, 0, 10, 0, 512, &[]); // not negotiated
    c.request(CMD_READ, CMD_FLAG_DF, 11, 0, 512, &[]); // DF without structured replies
    c.request(CMD_TRIM, 0, 12, MIB - 512, 1024, &[]); // trim past the end
    c.request(CMD_WRITE_ZEROES, 0, 13, MIB, 512, &[]); // zeroes past the end
    c.request(CMD_READ, 0, 14, 512 * 1024, 4096, &[]); // export fails with EIO
    c.request(CMD_WRITE, 0, 15, 512 * 1024, 512, &[3; 512]); // export fails with EIO
    c.request(5, 0, 16, 0, 512, &[]); // CACHE: not advertised
    let wraps = u64::MAX - 511; // aligned, and offset + length wraps past 2^64
    c.request(CMD_READ, 0, 17, wraps, 1024, &[]);
    c.request(CMD_WRITE, 0, 18, wraps, 1024, &[5; 1024]);
    c.request(CMD_TRIM, 0, 19, wraps, 1024, &[]);
    let huge = vec![0xdd; 600 * 1024]; // oversize, and more than the read buffer holds
    c.request(CMD_WRITE, 0, 20, 0, huge.len() as u32, &huge);
    let want = [
        NBD_EINVAL,
        NBD_ENOSPC,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_EOVERFLOW,
        NBD_EOVERFLOW,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_ENOSPC,
        NBD_EIO,
        NBD_EIO,
        NBD_EINVAL,
        NBD_EINVAL,
        NBD_ENOSPC,
        NBD_EINVAL,
        NBD_EOVERFLOW,
    ];
    for (i, w) in want.iter().enumerate() {
        assert_eq!(c.simple_reply(), (*w, i as u64 + 1), "request {}", i + 1);
    }
    // Nothing was written by the refused writes.
    let mut head = [0u8; 1024];
    server.export.read_at(0, &mut head).expect("read");
    assert_eq!(head, [0u8; 1024]);
    // The connection still works, at the largest allowed size too.
    c.assert_works(8192, 100);
    let max = vec![0x77; 64 * 1024];
    c.request(CMD_WRITE, CMD_FLAG_FUA, 200, 0, max.len() as u32, &max);
    c.request(CMD_FLUSH, 0, 201, 0, 0, &[]);
    c.request(CMD_READ, 0, 202, 0, max.len() as u32, &[]);
    assert_eq!(c.simple_reply(), (0, 200));
    assert_eq!(c.simple_reply(), (0, 201));
    assert_eq!(c.simple_reply(), (0, 202));
    assert_eq!(c.read_n(max.len()), max);
    // Soft disconnect closes the connection.
    c.request(CMD_DISC, 0, 300, 0, 0, &[]);
    assert!(c.is_closed());
    let stats = server.export.stats();
    assert_eq!(stats.fua_ops, 1, "{stats:?}");
    assert!(stats.flushes >= 1, "{stats:?}");
    server.stop();
}

#[test]
fn structured_replies_for_reads() {
    let server = aligned_server();
    server.export.write_at(4096, &[0xab; 4096]).expect("preload");
    let mut c = RawNbd::ready_structured(server.tcp_addr());
    c.request(CMD_READ, CMD_FLAG_DF, 1, 4096, 4096, &[]);
    let Chunk { flags, kind: ty, cookie, payload } = c.chunk();
    assert_eq!((flags, ty, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 1));
    assert_eq!(payload[..8], 4096u64.to_be_bytes());
    assert!(payload[8..].iter().all(|&b| b == 0xab) && payload.len() == 8 + 4096);

    c.request(CMD_READ, 0, 2, MIB, 512, &[]);
    let Chunk { flags, kind: ty, cookie, payload } = c.chunk();
    assert_eq!((flags, ty, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 2));
    assert_eq!(payload[..4], NBD_EINVAL.to_be_bytes());
    let msg_len = u16::from_be_bytes([payload[4], payload[5]]) as usize;
    assert_eq!(payload.len(), 6 + msg_len);

    c.request(CMD_READ, 0, 3, 0, 0, &[]);
    let done = c.chunk();
    assert_eq!(
        (done.flags, done.kind, done.cookie, done.payload),
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 3, vec![])
    );
    // Non-read commands keep simple replies.
    c.request(CMD_WRITE, 0, 4, MIB, 512, &[0; 512]);
    assert_eq!(c.simple_reply(), (NBD_ENOSPC, 4));
    server.stop();
}

/// A GO that asks for no block sizes, as `nbd-client` sends it: an export with a 512-byte
/// minimum whose maximum request is at least 32 MiB, or the export's size, serves it
/// (misaligned requests get EINVAL, aligned ones work); one with a 4 KiB minimum, or with a
/// 64 KiB maximum on a 1 MiB export, answers `ERR_BLOCK_SIZE_REQD` and the handshake goes on.
#[test]
fn a_bare_go_is_served_within_the_interoperable_sizes() {
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 1 << 20 };
    let server = TestServer::start_with(MIB, bs, Via::Tcp, |_| {});
    let mut c = RawNbd::greet(server.tcp_addr());
    c.send(&3u32.to_be_bytes());
    c.go(NAME, &[]);
    c.request(CMD_WRITE, 0, 1, 100, 512, &[3; 512]);
    assert_eq!(c.simple_reply(), (libc::EINVAL as u32, 1));
    c.request(CMD_WRITE, 0, 2, 512, 512, &[3; 512]);
    assert_eq!(c.simple_reply(), (0, 2));
    // A write of the whole export, the most a client that negotiated nothing can send here.
    c.request(CMD_WRITE, 0, 3, 0, MIB as u32, &vec![4; MIB as usize]);
    assert_eq!(c.simple_reply(), (0, 3));
    server.stop();

    let too_small = [
        BlockSizes { min_bytes: 4096, preferred_bytes: 4096, max_bytes: 1 << 20 },
        BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 64 << 10 },
    ];
    for bs in too_small {
        let server = TestServer::start_with(MIB, bs, Via::Tcp, |_| {});
        let mut c = RawNbd::greet(server.tcp_addr());
        c.send(&3u32.to_be_bytes());
        c.option(OPT_GO, &go_data(NAME, &[]));
        assert_eq!(c.opt_reply().reply_type, REP_ERR_BLOCK_SIZE_REQD, "{bs:?}");
        c.go(NAME, &[INFO_BLOCK_SIZE]);
        server.stop();
    }
}

#[test]
fn option_errors_keep_the_handshake_going() {
    let server = aligned_server();
    let mut c = RawNbd::greet(server.tcp_addr());
    c.send(&1u32.to_be_bytes()); // fixed newstyle, zeroes wanted
    let cases: [(u32, Vec<u8>, u32); 8] = [
        (OPT_LIST, vec![1], REP_ERR_INVALID),
        // Too large to handle: read past and refused (five 4096-byte meta-context queries
        // would be about this size); the bytes are not taken for the next option.
        (OPT_SET_META_CONTEXT, vec![0x49; 20_000], REP_ERR_TOO_BIG),
        (99, vec![0x49; 1 << 20], REP_ERR_TOO_BIG),
        (99, vec![1, 2, 3], REP_ERR_UNSUP),
        (OPT_STARTTLS, vec![], REP_ERR_POLICY),
        (OPT_GO, go_data("nope", &[INFO_BLOCK_SIZE]), REP_ERR_UNKNOWN),
        (OPT_GO, vec![0, 0, 0, 9, 1], REP_ERR_INVALID),
        (OPT_SET_META_CONTEXT, vec![0; 8], REP_ERR_INVALID),
    ];
    for (opt, data, want) in cases {
        c.option(opt, &data);
        let r = c.opt_reply();
        assert_eq!((r.option, r.reply_type), (opt, want), "option {opt}");
    }
    c.option(OPT_LIST, &[]);
    let r = c.opt_reply();
    assert_eq!(r.reply_type, REP_SERVER);
    assert_eq!(&r.data[4..], NAME.as_bytes());
    assert_eq!(c.opt_reply().reply_type, REP_ACK);
    c.option(OPT_INFO, &go_data("", &[INFO_NAME]));
    let mut infos = Vec::new();
    loop {
        let r = c.opt_reply();
        if r.reply_type == REP_ACK {
            break;
        }
        assert_eq!(r.reply_type, REP_INFO);
        infos.push(u16::from_be_bytes([r.data[0], r.data[1]]));
    }
    assert_eq!(infos, [INFO_EXPORT, INFO_NAME, INFO_BLOCK_SIZE]);
    // Old-style entry into transmission: size, flags, then 124 zeroes.
    c.option(OPT_EXPORT_NAME, NAME.as_bytes());
    let reply = c.read_n(8 + 2 + 124);
    assert_eq!(reply[..8], MIB.to_be_bytes());
    let flags = u16::from_be_bytes([reply[8], reply[9]]);
    let want = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA;
    assert_eq!(flags & want, want);
    assert!(reply[10..].iter().all(|&b| b == 0));
    c.assert_works(0, 1);

    let mut a = RawNbd::greet(server.tcp_addr());
    a.send(&3u32.to_be_bytes());
    a.option(OPT_ABORT, &[]);
    assert_eq!(a.opt_reply().reply_type, REP_ACK);
    assert!(a.is_closed());
    server.stop();
}

#[test]
fn garbage_handshakes_close_only_their_connection() {
    let server = aligned_server();
    let addr = server.tcp_addr();
    let mut good = RawNbd::ready(addr);

    for (what, mut c) in misbehaving_clients(addr) {
        assert!(c.is_closed(), "{what}: connection not closed");
    }
    good.assert_works(0, 10);
    RawNbd::ready_structured(addr);
    let mut fresh = RawNbd::ready(addr);
    fresh.assert_works(4096, 20);
    server.stop();
}

#[test]
fn connection_limit_and_handshake_timeout() {
    let server = TestServer::start_with(MIB, BlockSizes::default(), Via::Tcp, |c| {
        c.max_connections = 2;
        c.handshake_timeout = Duration::from_millis(300);
    });
    let addr = server.tcp_addr();
    let mut a = RawNbd::ready(addr);
    let idle = RawNbd::greet(addr); // never finishes its handshake
    let mut third = RawNbd::connect(addr);
    assert!(third.is_closed(), "third connection should be refused");
    a.assert_works(0, 1);
    // The idle one times out, freeing its slot.
    drop(idle);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut c = RawNbd::connect(addr);
        let mut g = [0u8; 18];
        if c.stream.read_exact(&mut g).is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "slot never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    server.stop();
}

/// The handshake timeout is a deadline for the whole handshake: a client that sends a byte
/// every 200 ms, each within the timeout, is still cut off when the timeout (1 s) has passed
/// since it connected.
#[test]
fn a_trickling_handshake_is_cut_at_its_deadline() {
    let server = TestServer::start_with(MIB, BlockSizes::default(), Via::Tcp, |c| {
        c.handshake_timeout = Duration::from_secs(1);
    });
    let started = Instant::now();
    let mut c = RawNbd::greet(server.tcp_addr());
    c.stream.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
    // Client flags, then an option header, one byte at a time: never complete in 1 s.
    let bytes: Vec<u8> = [3u32.to_be_bytes().to_vec(), IHAVEOPT.to_be_bytes().to_vec()].concat();
    let mut closed_after = None;
    for &byte in bytes.iter().cycle().take(40) {
        if c.stream.write_all(&[byte]).is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        let mut b = [0u8; 64];
        match c.stream.read(&mut b) {
            Ok(0) => {
                closed_after = Some(started.elapsed());
                break;
            }
            Ok(_) => panic!("a reply to an unfinished option"),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                closed_after = Some(started.elapsed());
                break;
            }
            Err(_) => {} // the 200 ms read timeout: still open
        }
    }
    let closed_after = closed_after.expect("the trickling client was never cut off");
    assert!(closed_after < Duration::from_millis(2500), "cut off after {closed_after:?}");
    assert!(closed_after >= Duration::from_millis(900), "cut off early: {closed_after:?}");
    server.stop();
}

/// Replies already made go out before the server waits for the rest of a write's payload: a
/// FLUSH and the header and first half of a WRITE arrive in one segment, and the client sends
/// the second half only once it has the FLUSH's reply (a refused write's payload likewise).
#[test]
fn replies_are_sent_before_waiting_for_a_payload() {
    let server = aligned_server();
    let mut c = RawNbd::ready(server.tcp_addr());
    let mut burst = Vec::new();
    let header = |command: u16, cookie: u64, offset: u64, len: u32| {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&command.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    };
    for (write_offset, write_reply) in [(4096, 0), (MIB, libc::ENOSPC as u32)] {
        burst.clear();
        burst.extend(header(CMD_FLUSH, 1, 0, 0));
        burst.extend(header(CMD_WRITE, 2, write_offset, 8192));
        burst.extend([6u8; 4096]);
        c.send(&burst);
        assert_eq!(c.simple_reply(), (0, 1), "the FLUSH's reply waited for the payload");
        c.send(&[6u8; 4096]);
        assert_eq!(c.simple_reply(), (write_reply, 2));
    }
    c.assert_works(0, 3);
    server.stop();
}

/// A GO the server cannot serve (the export refuses a connection: the cache out of lanes or
/// shutting down) is answered `ERR_SHUTDOWN` with the reason, never acknowledged and then
/// dropped; the handshake goes on, and a later GO is served once connections open again.
#[test]
fn a_go_that_cannot_be_served_is_refused_with_a_reason() {
    let server = aligned_server();
    server.export.refuse_conns(true);
    let mut c = RawNbd::greet(server.tcp_addr());
    c.send(&3u32.to_be_bytes());
    c.option(OPT_GO, &go_data(NAME, &[INFO_BLOCK_SIZE]));
    let r = c.opt_reply();
    assert_eq!(r.reply_type, REP_ERR_SHUTDOWN);
    let reason = String::from_utf8_lossy(&r.data).into_owned();
    assert!(reason.contains("cannot serve this connection now"), "{reason}");
    server.export.refuse_conns(false);
    c.go(NAME, &[INFO_BLOCK_SIZE]);
    c.assert_works(0, 1);
    server.stop();
}

#[test]
fn shutdown_finishes_requests_and_flushes() {
    let server = aligned_server();
    let export = server.export.clone();
    let mut c = RawNbd::ready(server.tcp_addr());
    let mut idle = RawNbd::ready(server.tcp_addr());
    c.request(CMD_WRITE, 0, 1, 0, 4096, &[9; 4096]);
    assert_eq!(c.simple_reply(), (0, 1));
    let flushes_before = export.stats().flushes;
    let started = Instant::now();
    server.stop();
    assert!(started.elapsed() < Duration::from_secs(3), "shutdown took {:?}", started.elapsed());
    assert!(c.is_closed());
    assert!(idle.is_closed());
    assert_eq!(export.stats().flushes, flushes_before + 2, "each connection flushed once");
    let mut b = [0u8; 4096];
    export.read_at(0, &mut b).expect("read");
    assert_eq!(b, [9; 4096]);
}

/// A client that sends reads and never reads the replies leaves its connection thread
/// blocked in a send; shutdown still returns, after its grace period, by cutting that
/// connection, and a well-behaved client's acknowledged write is kept.
#[test]
fn shutdown_cuts_a_client_that_stopped_reading() {
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 32 * MIB as u32 };
    let server = TestServer::start_with(64 * MIB, bs, Via::Tcp, |c| {
        c.max_request_bytes = 32 * MIB as u32;
    });
    let export = server.export.clone();
    let mut good = RawNbd::ready(server.tcp_addr());
    good.request(CMD_WRITE, 0, 1, 0, 4096, &[5; 4096]);
    assert_eq!(good.simple_reply(), (0, 1));
    let mut stuck = RawNbd::ready(server.tcp_addr());
    // 128 MiB of replies: far more than the socket buffers hold.
    for cookie in 0..4 {
        stuck.request(CMD_READ, 0, cookie, cookie * 16 * MIB, 32 * MIB as u32, &[]);
    }
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    server.stop();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(8), "shutdown took {took:?}");
    assert!(took >= Duration::from_secs(4), "the stuck connection was cut early: {took:?}");
    assert!(good.is_closed());
    let mut b = [0u8; 4096];
    export.read_at(0, &mut b).expect("read");
    assert_eq!(b, [5; 4096]);
}

#[test]
fn unix_socket_serves_and_is_removed() {
    let server = TestServer::start(MIB, BlockSizes::default(), Via::Unix);
    let ListenAddr::Unix(path) = server.addr.clone() else { panic!("unix") };
    assert!(path.exists());
    let mut s = std::os::unix::net::UnixStream::connect(&path).expect("connect");
    let mut g = [0u8; 18];
    s.read_exact(&mut g).expect("greeting");
    assert_eq!(&g[..8], b"NBDMAGIC");
    drop(s);
    server.stop();
    assert!(!path.exists(), "socket file left behind");
}

#[test]
fn remote_listen_needs_explicit_flag() {
    let export = std::sync::Arc::new(MemExport::new(MIB, BlockSizes::default()).expect("mem"));
    let any = ListenAddr::Tcp(SocketAddr::from(([0, 0, 0, 0], 0)));
    let config = ServerConfig { listen: any.clone(), ..ServerConfig::default() };
    let err = Server::bind(config, export.clone()).expect_err("must refuse");
    assert!(matches!(err, ServerError::RemoteNotAllowed(_)), "{err}");
    let config = ServerConfig { listen: any, allow_remote: true, ..ServerConfig::default() };
    let server = Server::bind(config, export).expect("allowed");
    let running = server.spawn().expect("spawn");
    running.stop().expect("stop");
}

/// Writes sent back to back (one `send`) reach the export as one batch; an invalid request in
/// the middle ends the batch and gets its own error; every write gets its reply, in order,
/// and the data is what the writes one by one leave (a repeated offset: the later one wins).
#[test]
fn pipelined_writes_are_batched_and_each_answered() {
    let server = aligned_server();
    let export = server.export.clone();
    // Block 10 fails in the export: the write there sits inside a batch of the second run.
    export.set_fault(Some((10 * 4096, 11 * 4096, libc::EIO)));
    let mut c = RawNbd::ready(server.tcp_addr());
    let request = |command: u16, cookie: u64, offset: u64, payload: &[u8]| {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&command.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        b.extend_from_slice(payload);
        b
    };
    let mut burst = Vec::new();
    for i in 0..6u64 {
        burst.extend(request(CMD_WRITE, 10 + i, i * 4096, &[i as u8 + 1; 4096]));
    }
    burst.extend(request(CMD_WRITE, 16, 0, &[0xee; 4096])); // the same offset again
    burst.extend(request(CMD_WRITE, 17, MIB, &[7; 512])); // past the end: ENOSPC
    for i in 0..4u64 {
        burst.extend(request(CMD_WRITE, 20 + i, (8 + i) * 4096, &[i as u8 + 50; 4096]));
    }
    c.send(&burst);
    for cookie in (10..18).chain(20..24) {
        let expected = match cookie {
            17 => NBD_ENOSPC,
            22 => NBD_EIO,
            _ => 0,
        };
        assert_eq!(c.simple_reply(), (expected, cookie), "reply for cookie {cookie}");
    }
    let stats = export.stats();
    assert_eq!(stats.writes, 11, "{stats:?}");
    assert!(stats.batched_writes >= 2, "no batch reached the export: {stats:?}");
    let mut b = vec![0u8; 4096];
    export.read_at(0, &mut b).expect("read");
    assert_eq!(b, [0xee; 4096], "the later write of offset 0 wins");
    for i in 1..6u64 {
        export.read_at(i * 4096, &mut b).expect("read");
        assert_eq!(b, [i as u8 + 1; 4096], "block {i}");
    }
    export.set_fault(None);
    for i in 0..4u64 {
        export.read_at((8 + i) * 4096, &mut b).expect("read");
        let want = if i == 2 { [0; 4096] } else { [i as u8 + 50; 4096] };
        assert_eq!(b, want, "block {}", 8 + i);
    }
    c.assert_works(64 * 4096, 100);
    server.stop();
}

/// Payloads larger than the server's 256 KiB read buffer (which it reads straight into the
/// request's buffer) and smaller ones, pipelined: each arrives whole and in place.
#[test]
fn large_payloads_arrive_whole() {
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 4 * MIB as u32 };
    let server =
        TestServer::start_with(8 * MIB, bs, Via::Tcp, |c| c.max_request_bytes = 4 * MIB as u32);
    let export = server.export.clone();
    let mut c = RawNbd::ready(server.tcp_addr());
    let pattern = |seed: u64, len: usize| -> Vec<u8> {
        (0..len as u64).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as u8).collect()
    };
    let writes = [
        (512u64, MIB as usize + 512),
        (3 * MIB, 300 << 10),
        (5 * MIB, 4096),
        (6 * MIB, 2 * MIB as usize),
    ];
    let mut burst = Vec::new();
    for (i, &(offset, len)) in writes.iter().enumerate() {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&CMD_WRITE.to_be_bytes());
        b.extend_from_slice(&(i as u64).to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&(len as u32).to_be_bytes());
        b.extend_from_slice(&pattern(i as u64, len));
        burst.extend(b);
    }
    c.send(&burst);
    for i in 0..writes.len() as u64 {
        assert_eq!(c.simple_reply(), (0, i));
    }
    for (i, &(offset, len)) in writes.iter().enumerate() {
        let mut back = vec![0u8; len];
        export.read_at(offset, &mut back).expect("read");
        assert!(back == pattern(i as u64, len), "write {i} at {offset} ({len} bytes)");
        c.request(CMD_READ, 0, 100 + i as u64, offset, len as u32, &[]);
        assert_eq!(c.simple_reply(), (0, 100 + i as u64));
        assert!(c.read_n(len) == back, "read {i}");
    }
    c.assert_works(0, 200);
    server.stop();
}

/// The handshake timeout ends with the handshake: a client idle in transmission for longer
/// than it (here 3 times as long) is still served.
#[test]
fn an_idle_client_outlives_the_handshake_timeout() {
    let server = TestServer::start_with(MIB, BlockSizes::default(), Via::Tcp, |c| {
        c.handshake_timeout = Duration::from_millis(300);
    });
    let mut c = RawNbd::ready(server.tcp_addr());
    c.assert_works(0, 1);
    std::thread::sleep(Duration::from_millis(900));
    c.assert_works(4096, 10);
    server.stop();
}

/// Clients that send reads and stop reading the replies are dropped at the write timeout:
/// with `max_connections` such clients, a new client is still served (without the timeout
/// their threads block in a send forever and every later connection is refused), and the
/// drops are counted.
#[test]
fn clients_that_stop_reading_are_dropped_at_the_write_timeout() {
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 32 * MIB as u32 };
    let server = TestServer::start_with(64 * MIB, bs, Via::Tcp, |c| {
        c.max_request_bytes = 32 * MIB as u32;
        c.max_connections = 2;
        c.write_timeout = Duration::from_secs(1);
    });
    let mut stuck: Vec<RawNbd> = (0..2).map(|_| RawNbd::ready(server.tcp_addr())).collect();
    for c in &mut stuck {
        // 128 MiB of replies: far more than the socket buffers hold.
        for cookie in 0..4 {
            c.request(CMD_READ, 0, cookie, cookie * 16 * MIB, 32 * MIB as u32, &[]);
        }
    }
    let started = Instant::now();
    while server.stats().connections_dropped_write_timeout < 2 {
        assert!(started.elapsed() < Duration::from_secs(10), "not dropped: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900), "dropped before the timeout: {took:?}");
    while server.stats().connections_open > 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "still open: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut fresh = RawNbd::ready(server.tcp_addr());
    fresh.assert_works(0, 1);
    let stats = server.stats();
    assert_eq!(stats.connections_dropped_write_timeout, 2, "{stats:?}");
    assert_eq!((stats.connections_dropped_idle, stats.connections_refused_at_limit), (0, 0));
    drop(stuck);
    server.stop();
}

/// A client that reads a reply a byte at a time keeps making progress, but its replies must
/// all be taken within one write timeout: it is dropped, not served forever.
#[test]
fn a_client_reading_a_trickle_is_dropped_at_the_write_timeout() {
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 32 * MIB as u32 };
    let server = TestServer::start_with(64 * MIB, bs, Via::Tcp, |c| {
        c.max_request_bytes = 32 * MIB as u32;
        c.write_timeout = Duration::from_secs(1);
    });
    let mut slow = RawNbd::ready(server.tcp_addr());
    slow.request(CMD_READ, 0, 1, 0, 32 * MIB as u32, &[]);
    let started = Instant::now();
    let mut b = [0u8; 4096];
    while server.stats().connections_dropped_write_timeout == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "never dropped");
        // 40 KiB/s: 32 MiB would take over 13 minutes.
        let _ = slow.stream.read(&mut b);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(started.elapsed() >= Duration::from_millis(900));
    server.stop();
}

/// With an idle timeout, a client that sends nothing for longer is dropped and counted; one
/// that keeps sending requests within it is served throughout.
#[test]
fn an_idle_client_is_dropped_at_the_idle_timeout() {
    let server = TestServer::start_with(MIB, BlockSizes::default(), Via::Tcp, |c| {
        c.idle_timeout = Some(Duration::from_millis(400));
    });
    let mut idle = RawNbd::ready(server.tcp_addr());
    let mut busy = RawNbd::ready(server.tcp_addr());
    for round in 0..6 {
        busy.assert_works(4096, 10 + 2 * round);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(idle.is_closed(), "the idle client was not dropped");
    let stats = server.stats();
    assert_eq!(stats.connections_dropped_idle, 1, "{stats:?}");
    assert_eq!(stats.connections_open, 1, "{stats:?}");
    busy.assert_works(0, 100);
    server.stop();
}

/// A read the export leaves in flight (held, as a cache miss on a slow store is) holds back
/// nothing behind it: the read and the write after it are answered first, matched by their
/// cookies, and the held read's reply follows, with its data, when it completes.
#[test]
fn a_read_in_flight_is_answered_after_the_requests_behind_it() {
    let server = aligned_server();
    let export = server.export.clone();
    export.write_at(0, &[1; 4096]).expect("preload");
    export.write_at(5 * 4096, &[5; 4096]).expect("preload");
    export.hold_reads(Some((0, 4096)));
    let mut c = RawNbd::ready(server.tcp_addr());
    c.request(CMD_READ, 0, 1, 0, 4096, &[]);
    c.request(CMD_READ, 0, 2, 5 * 4096, 4096, &[]);
    assert_eq!(c.simple_reply(), (0, 2), "the read behind the held one comes first");
    assert_eq!(c.read_n(4096), [5; 4096]);
    c.request(CMD_WRITE, 0, 3, 6 * 4096, 4096, &[6; 4096]);
    assert_eq!(c.simple_reply(), (0, 3), "a write behind the held read");
    export.hold_reads(None);
    assert_eq!(c.simple_reply(), (0, 1), "the held read, once it completes");
    assert_eq!(c.read_n(4096), [1; 4096]);
    c.assert_works(64 * 4096, 100);
    server.stop();
}

/// A disconnect behind a read in flight: the read is answered before the server closes.
#[test]
fn a_disconnect_waits_for_the_reads_in_flight() {
    let server = aligned_server();
    let export = server.export.clone();
    export.write_at(0, &[9; 4096]).expect("preload");
    export.hold_reads(Some((0, 4096)));
    let mut c = RawNbd::ready_structured(server.tcp_addr());
    c.request(CMD_READ, 0, 1, 0, 4096, &[]);
    c.request(CMD_DISC, 0, 2, 0, 0, &[]);
    let release = {
        let export = export.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            export.hold_reads(None);
        })
    };
    let Chunk { flags, kind, cookie, payload } = c.chunk();
    assert_eq!(
        (flags & REPLY_FLAG_DONE, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 1)
    );
    assert_eq!(payload[8..], [9; 4096]);
    assert!(c.is_closed(), "the server closes after the disconnect");
    release.join().expect("release");
    server.stop();
}

/// Pipelined reads that reach the export together and complete in reverse order are
/// answered in that order, each reply with its own cookie and data (every test server
/// reorders batched reads so).
#[test]
fn pipelined_reads_are_answered_as_they_complete() {
    let server = aligned_server();
    let export = server.export.clone();
    for i in 0..4u64 {
        export.write_at(i * 4096, &[i as u8 + 1; 4096]).expect("preload");
    }
    let mut c = RawNbd::ready(server.tcp_addr());
    let mut burst = Vec::new();
    for i in 0..4u64 {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&CMD_READ.to_be_bytes());
        b.extend_from_slice(&(10 + i).to_be_bytes());
        b.extend_from_slice(&(i * 4096).to_be_bytes());
        b.extend_from_slice(&4096u32.to_be_bytes());
        burst.extend(b);
    }
    c.send(&burst);
    let mut order = Vec::new();
    for _ in 0..4 {
        let (error, cookie) = c.simple_reply();
        assert_eq!(error, 0);
        assert_eq!(c.read_n(4096), [(cookie - 10) as u8 + 1; 4096], "cookie {cookie}'s data");
        order.push(cookie);
    }
    assert_eq!(order, [13, 12, 11, 10], "answered as they completed");
    server.stop();
}

/// A client refused an export that was closed is no connection of that export while it
/// haggles on (a detach waiting for that export's last connection does not wait for it), and
/// it can still pick another export and be served.
#[test]
fn a_client_refused_a_closed_export_is_not_counted_as_its_connection() {
    let exports = ["one", "two"].map(|name| {
        (
            name.to_string(),
            std::sync::Arc::new(MemExport::new(1 << 20, BlockSizes::default()).expect("export")),
        )
    });
    let config = ServerConfig {
        listen: ListenAddr::Tcp(([127, 0, 0, 1], 0).into()),
        ..ServerConfig::default()
    };
    let server = Server::bind_exports(config, exports.to_vec()).expect("bind");
    let ListenAddr::Tcp(addr) = server.local_addr() else { panic!("a TCP listener") };
    let running = server.spawn().expect("spawn");
    let handle = running.shutdown_handle();
    handle.close_export(0);
    let mut c = RawNbd::greet(addr);
    c.send(&3u32.to_be_bytes());
    c.option(OPT_GO, &go_data("one", &[INFO_BLOCK_SIZE]));
    let r = c.opt_reply();
    assert_eq!(r.reply_type, REP_ERR_SHUTDOWN);
    assert!(String::from_utf8_lossy(&r.data).contains("no longer served"));
    assert_eq!(handle.export_connections(0), 0, "the refused client counts as export one's");
    c.option(OPT_GO, &go_data("two", &[INFO_BLOCK_SIZE]));
    loop {
        let r = c.opt_reply();
        if r.reply_type == REP_ACK {
            break;
        }
        assert_eq!(r.reply_type, REP_INFO);
    }
    c.assert_works(0, 1);
    assert_eq!((handle.export_connections(0), handle.export_connections(1)), (0, 1));
    running.stop().expect("stopped");
}
