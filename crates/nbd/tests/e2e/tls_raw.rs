//! TLS option haggling byte by byte: a raw client (plain, then over OpenSSL as a PSK client)
//! checks the replies of each mode, a second STARTTLS inside TLS, TLS 1.2 and 1.3, and that
//! a client breaking the STARTTLS rules (pipelined bytes, garbage for a ClientHello, silence)
//! is dropped while the server keeps serving.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use openssl::ssl::{SslConnector, SslMethod, SslStream, SslVerifyMode, SslVersion};
use pmcache_nbd::codec::*;
use pmcache_nbd::{BlockSizes, TlsConfig, TlsMode};
use pmcache_testkit::nbd::{RawNbd, option_bytes};
use pmcache_testkit::tls::psk_file;
use tempfile::TempDir;

use crate::common::{NAME, TestServer, Via, pseudo_random};

const SIZE_BYTES: u64 = 1 << 20;
const KEY: &[u8] = b"pmcache raw test key";

/// Connects, reads the greeting and sends the client flags.
fn connect(addr: SocketAddr) -> RawNbd {
    let mut c = RawNbd::greet(addr);
    c.send(&3u32.to_be_bytes());
    c
}

/// STARTTLS with a PSK handshake, on a client still in clear.
trait StartTls: Sized {
    /// Sends STARTTLS, expects the ACK and runs a PSK handshake as `user` with `key`.
    fn start_tls(
        self,
        user: &str,
        key: &[u8],
        version: SslVersion,
    ) -> RawNbd<SslStream<TcpStream>> {
        self.try_start_tls(user, key, version).expect("TLS handshake")
    }

    fn try_start_tls(
        self,
        user: &str,
        key: &[u8],
        version: SslVersion,
    ) -> Result<RawNbd<SslStream<TcpStream>>, String>;
}

impl StartTls for RawNbd {
    fn try_start_tls(
        mut self,
        user: &str,
        key: &[u8],
        version: SslVersion,
    ) -> Result<RawNbd<SslStream<TcpStream>>, String> {
        self.option(OPT_STARTTLS, &[]);
        assert_eq!(self.reply(), (OPT_STARTTLS, REP_ACK));
        let mut b = SslConnector::builder(SslMethod::tls_client()).expect("connector");
        b.set_verify(SslVerifyMode::NONE);
        b.set_min_proto_version(Some(version)).expect("min version");
        b.set_max_proto_version(Some(version)).expect("max version");
        b.set_cipher_list("PSK").expect("PSK ciphers");
        let (user, key) = (user.to_owned(), key.to_owned());
        b.set_psk_client_callback(move |_ssl, _hint, identity, psk| {
            identity[..user.len()].copy_from_slice(user.as_bytes());
            identity[user.len()] = 0;
            psk[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        let mut config = b.build().configure().expect("configure");
        config.set_verify_hostname(false);
        config.set_use_server_name_indication(false);
        self.wrapped(|s| config.connect("localhost", s).map_err(|e| e.to_string()))
    }
}

/// What these tests read of a connection, in clear or over TLS.
trait Replies {
    /// One option reply: (option, reply type); its data is read past.
    fn reply(&mut self) -> (u32, u32);

    /// GO with block sizes, then one READ of 4 KiB at `offset_bytes`: the data.
    fn go_and_read(&mut self, offset_bytes: u64) -> Vec<u8>;

    /// True once the server closed the connection (end of stream or reset) having sent
    /// nothing or a TLS alert record (type 21) at most.
    fn closed(&mut self) -> bool;
}

impl<S: Read + Write> Replies for RawNbd<S> {
    fn reply(&mut self) -> (u32, u32) {
        let reply = self.opt_reply();
        (reply.option, reply.reply_type)
    }

    fn go_and_read(&mut self, offset_bytes: u64) -> Vec<u8> {
        self.go(NAME, &[INFO_BLOCK_SIZE]);
        self.read_at(offset_bytes, 4096)
    }

    fn closed(&mut self) -> bool {
        let mut got = Vec::new();
        let mut b = [0u8; 64];
        loop {
            match self.stream.read(&mut b) {
                Ok(0) => break,
                Ok(n) if got.len() < 1024 => got.extend_from_slice(&b[..n]),
                Ok(_) => return false,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => break,
            }
        }
        got.first().is_none_or(|&t| t == 21)
    }
}

/// `NBD_OPT_GO` data for the export, block sizes asked for.
fn go_data() -> Vec<u8> {
    pmcache_testkit::nbd::go_data(NAME, &[INFO_BLOCK_SIZE])
}

/// STARTTLS, then a plain option where the ClientHello belongs: the server closes the
/// connection within `within`.
pub fn garbage_for_a_client_hello_closes(addr: SocketAddr, within: Duration) {
    let mut garbage = connect(addr);
    garbage.option(OPT_STARTTLS, &[]);
    assert_eq!(garbage.reply(), (OPT_STARTTLS, REP_ACK));
    garbage.send(&option_bytes(OPT_GO, &go_data()));
    let start = Instant::now();
    assert!(garbage.closed(), "a plain option where the ClientHello belongs must close");
    assert!(start.elapsed() < within, "closed after {:?}", start.elapsed());
}

/// A server with a PSK for alice (in the returned directory), the export filled with known
/// data.
fn psk_server(mode: TlsMode, handshake_timeout: Duration) -> (TestServer, Vec<u8>, TempDir) {
    let keys = tempfile::tempdir().expect("tempdir");
    let server = TestServer::start_with(SIZE_BYTES, BlockSizes::default(), Via::Tcp, |c| {
        c.tls = TlsConfig {
            mode,
            psk_file: Some(psk_file(keys.path(), "alice", KEY)),
            ..TlsConfig::default()
        };
        c.handshake_timeout = handshake_timeout;
    });
    let data = pseudo_random(SIZE_BYTES as usize, 21);
    server.export.write_at(0, &data).expect("fill");
    (server, data, keys)
}

#[test]
fn require_answers_tls_reqd_until_starttls_then_serves_over_tls() {
    let (server, data, _keys) = psk_server(TlsMode::Require, Duration::from_secs(5));
    let addr = server.tcp_addr();
    for version in [SslVersion::TLS1_3, SslVersion::TLS1_2] {
        let mut c = connect(addr);
        c.option(OPT_GO, &go_data());
        assert_eq!(c.reply(), (OPT_GO, REP_ERR_TLS_REQD));
        for opt in [OPT_INFO, OPT_LIST, OPT_STRUCTURED_REPLY, 99] {
            let data = if opt == OPT_INFO { go_data() } else { Vec::new() };
            c.option(opt, &data);
            assert_eq!(c.reply(), (opt, REP_ERR_TLS_REQD));
        }
        c.option(OPT_STARTTLS, b"x");
        assert_eq!(c.reply(), (OPT_STARTTLS, REP_ERR_INVALID));
        let mut tls = c.start_tls("alice", KEY, version);
        tls.option(OPT_STARTTLS, &[]);
        assert_eq!(tls.reply(), (OPT_STARTTLS, REP_ERR_INVALID), "STARTTLS inside TLS");
        tls.option(OPT_LIST, &[]);
        assert_eq!(tls.reply(), (OPT_LIST, REP_SERVER));
        assert_eq!(tls.reply(), (OPT_LIST, REP_ACK));
        assert!(tls.go_and_read(8192) == data[8192..12288], "{version:?}");
    }
    // EXPORT_NAME cannot be refused with a reply: the connection closes.
    let mut c = connect(addr);
    c.option(OPT_EXPORT_NAME, NAME.as_bytes());
    assert!(c.closed(), "EXPORT_NAME without TLS must close");
    // ABORT is still acknowledged.
    let mut c = connect(addr);
    c.option(OPT_ABORT, &[]);
    assert_eq!(c.reply(), (OPT_ABORT, REP_ACK));
    server.stop();
}

#[test]
fn tls_off_refuses_starttls_by_policy_and_on_serves_plain_clients() {
    let off = TestServer::start(SIZE_BYTES, BlockSizes::default(), Via::Tcp);
    let mut c = connect(off.tcp_addr());
    c.option(OPT_STARTTLS, &[]);
    assert_eq!(c.reply(), (OPT_STARTTLS, REP_ERR_POLICY));
    assert_eq!(c.go_and_read(0), vec![0u8; 4096]);
    off.stop();

    let (on, data, _keys) = psk_server(TlsMode::On, Duration::from_secs(5));
    assert!(connect(on.tcp_addr()).go_and_read(4096) == data[4096..8192]);
    let mut tls = connect(on.tcp_addr()).start_tls("alice", KEY, SslVersion::TLS1_3);
    assert!(tls.go_and_read(0) == data[..4096]);
    on.stop();
}

/// Breaking the STARTTLS rules drops only that connection: bytes pipelined after STARTTLS
/// (the client must wait for the ACK), garbage instead of a ClientHello, a wrong key, and
/// silence past the handshake deadline. A TLS client is served after each.
#[test]
fn clients_that_break_starttls_are_dropped_and_the_server_keeps_serving() {
    let timeout = Duration::from_millis(800);
    let (server, data, _keys) = psk_server(TlsMode::Require, timeout);
    let addr = server.tcp_addr();
    let served = || {
        let mut tls = connect(addr).start_tls("alice", KEY, SslVersion::TLS1_3);
        assert!(tls.go_and_read(0) == data[..4096]);
    };

    let mut pipelined = connect(addr);
    let mut burst = option_bytes(OPT_STARTTLS, &[]);
    burst.extend_from_slice(&option_bytes(OPT_GO, &go_data()));
    pipelined.send(&burst);
    assert_eq!(pipelined.reply(), (OPT_STARTTLS, REP_ACK));
    let start = Instant::now();
    assert!(pipelined.closed(), "bytes before the handshake must close");
    // At once, not at the handshake deadline (a TLS handshake waiting for a ClientHello that
    // was already read into the server's buffer).
    assert!(start.elapsed() < timeout / 2, "closed after {:?}", start.elapsed());
    served();

    garbage_for_a_client_hello_closes(addr, timeout / 2);
    served();

    for (user, key) in [("alice", &b"wrong key"[..]), ("bob", KEY)] {
        let refused = connect(addr).try_start_tls(user, key, SslVersion::TLS1_3).is_err();
        assert!(refused, "{user} with a wrong key must fail the handshake");
        served();
    }

    let mut silent = connect(addr);
    silent.option(OPT_STARTTLS, &[]);
    assert_eq!(silent.reply(), (OPT_STARTTLS, REP_ACK));
    let start = Instant::now();
    assert!(silent.closed(), "a silent client must be cut at the handshake deadline");
    assert!(start.elapsed() < timeout * 5, "cut after {:?}", start.elapsed());
    served();
    server.stop();
}
