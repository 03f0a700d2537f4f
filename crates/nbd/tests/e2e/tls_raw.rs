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
use pmcache_testkit::tls::psk_file;
use tempfile::TempDir;

use crate::common::{NAME, TestServer, Via, pseudo_random};

const SIZE_BYTES: u64 = 1 << 20;
const KEY: &[u8] = b"pmcache raw test key";

struct Raw<S> {
    s: S,
}

impl Raw<TcpStream> {
    /// Connects, reads the greeting and sends the client flags.
    fn connect(addr: SocketAddr) -> Self {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut c = Raw { s };
        let mut greeting = [0u8; 18];
        c.s.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
        c.send(&3u32.to_be_bytes());
        c
    }

    /// True once the server closed the connection (end of stream or reset) having sent
    /// nothing or a TLS alert record (type 21) at most.
    fn closed(&mut self) -> bool {
        let mut got = Vec::new();
        let mut b = [0u8; 64];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => break,
                Ok(n) if got.len() < 1024 => got.extend_from_slice(&b[..n]),
                Ok(_) => return false,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => break,
            }
        }
        got.first().is_none_or(|&t| t == 21)
    }

    /// Sends STARTTLS, expects the ACK and runs a PSK handshake as `user` with `key`.
    fn start_tls(self, user: &str, key: &[u8], version: SslVersion) -> Raw<SslStream<TcpStream>> {
        self.try_start_tls(user, key, version).expect("TLS handshake")
    }

    fn try_start_tls(
        mut self,
        user: &str,
        key: &[u8],
        version: SslVersion,
    ) -> Result<Raw<SslStream<TcpStream>>, String> {
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
        let s = config.connect("localhost", self.s).map_err(|e| e.to_string())?;
        Ok(Raw { s })
    }
}

impl<S: Read + Write> Raw<S> {
    fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).expect("send");
        self.s.flush().expect("flush");
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        self.send(&option_bytes(option, data));
    }

    /// One option reply: (option, reply type); its data is read past.
    fn reply(&mut self) -> (u32, u32) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("option reply");
        assert_eq!(u64::from_be_bytes(h[..8].try_into().expect("8")), OPTION_REPLY_MAGIC);
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().expect("4")) as usize];
        self.s.read_exact(&mut data).expect("reply data");
        let field = |at: usize| u32::from_be_bytes(h[at..at + 4].try_into().expect("4"));
        (field(8), field(12))
    }

    /// GO with block sizes, then one READ of 4 KiB at `offset_bytes`: the data.
    fn go_and_read(&mut self, offset_bytes: u64) -> Vec<u8> {
        self.option(OPT_GO, &go_data());
        loop {
            match self.reply() {
                (OPT_GO, REP_INFO) => {}
                (OPT_GO, REP_ACK) => break,
                other => panic!("GO failed: {other:x?}"),
            }
        }
        let mut req = REQUEST_MAGIC.to_be_bytes().to_vec();
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&CMD_READ.to_be_bytes());
        req.extend_from_slice(&7u64.to_be_bytes());
        req.extend_from_slice(&offset_bytes.to_be_bytes());
        req.extend_from_slice(&4096u32.to_be_bytes());
        self.send(&req);
        let mut reply = vec![0u8; 16 + 4096];
        self.s.read_exact(&mut reply).expect("read reply");
        assert_eq!(reply[..4], SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(reply[4..8], [0; 4], "read error");
        reply.split_off(16)
    }
}

fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

fn go_data() -> Vec<u8> {
    let mut d = (NAME.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(NAME.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    d
}

/// STARTTLS, then a plain option where the ClientHello belongs: the server closes the
/// connection within `within`.
pub fn garbage_for_a_client_hello_closes(addr: SocketAddr, within: Duration) {
    let mut garbage = Raw::connect(addr);
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
        let mut c = Raw::connect(addr);
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
    let mut c = Raw::connect(addr);
    c.option(OPT_EXPORT_NAME, NAME.as_bytes());
    assert!(c.closed(), "EXPORT_NAME without TLS must close");
    // ABORT is still acknowledged.
    let mut c = Raw::connect(addr);
    c.option(OPT_ABORT, &[]);
    assert_eq!(c.reply(), (OPT_ABORT, REP_ACK));
    server.stop();
}

#[test]
fn tls_off_refuses_starttls_by_policy_and_on_serves_plain_clients() {
    let off = TestServer::start(SIZE_BYTES, BlockSizes::default(), Via::Tcp);
    let mut c = Raw::connect(off.tcp_addr());
    c.option(OPT_STARTTLS, &[]);
    assert_eq!(c.reply(), (OPT_STARTTLS, REP_ERR_POLICY));
    assert_eq!(c.go_and_read(0), vec![0u8; 4096]);
    off.stop();

    let (on, data, _keys) = psk_server(TlsMode::On, Duration::from_secs(5));
    assert!(Raw::connect(on.tcp_addr()).go_and_read(4096) == data[4096..8192]);
    let mut tls = Raw::connect(on.tcp_addr()).start_tls("alice", KEY, SslVersion::TLS1_3);
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
        let mut tls = Raw::connect(addr).start_tls("alice", KEY, SslVersion::TLS1_3);
        assert!(tls.go_and_read(0) == data[..4096]);
    };

    let mut pipelined = Raw::connect(addr);
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
        let refused = Raw::connect(addr).try_start_tls(user, key, SslVersion::TLS1_3).is_err();
        assert!(refused, "{user} with a wrong key must fail the handshake");
        served();
    }

    let mut silent = Raw::connect(addr);
    silent.option(OPT_STARTTLS, &[]);
    assert_eq!(silent.reply(), (OPT_STARTTLS, REP_ACK));
    let start = Instant::now();
    assert!(silent.closed(), "a silent client must be cut at the handshake deadline");
    assert!(start.elapsed() < timeout * 5, "cut after {:?}", start.elapsed());
    served();
    server.stop();
}
