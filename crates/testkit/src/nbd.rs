//! A raw NBD client for tests that speak the protocol byte by byte — malformed handshakes and
//! requests, requests left in flight, replies read one at a time — where a real client (qemu-io,
//! nbdinfo, fio) would hide what the test is about. It knows the wire format from the protocol
//! document, not from the server's codec, so a test of the server does not check the server
//! against itself.
//!
//! Its methods panic on an I/O error (a test that expects none), but for `try_request` and
//! `try_simple_reply`, which a test that cuts the server under its client uses.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const GREETING: &[u8; 16] = b"NBDMAGICIHAVEOPT";
const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
const FLAG_C_NO_ZEROES: u32 = 2;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
/// How long a read or a write on the socket may wait.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// One option reply.
#[derive(Debug)]
pub struct OptReply {
    /// The option it answers.
    pub option: u32,
    /// Its type (`NBD_REP_*`).
    pub reply_type: u32,
    /// Its data.
    pub data: Vec<u8>,
}

/// One structured reply chunk.
#[derive(Debug)]
pub struct Chunk {
    /// `NBD_REPLY_FLAG_*`.
    pub flags: u16,
    /// `NBD_REPLY_TYPE_*`.
    pub kind: u16,
    /// The request's cookie.
    pub cookie: u64,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// A raw NBD client on a TCP connection, or on what a test wraps it in (a TLS session).
pub struct RawNbd<S = TcpStream> {
    /// The connection.
    pub stream: S,
    /// The export's size, from the `GO` that made the client ready.
    pub size_bytes: u64,
    /// The transmission flags, from that `GO`.
    pub flags: u16,
}

impl RawNbd {
    /// Connects, and reads nothing.
    pub fn connect(addr: SocketAddr) -> RawNbd {
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        stream.set_read_timeout(Some(IO_TIMEOUT)).expect("read timeout");
        stream.set_write_timeout(Some(IO_TIMEOUT)).expect("write timeout");
        stream.set_nodelay(true).expect("nodelay");
        RawNbd { stream, size_bytes: 0, flags: 0 }
    }

    /// Connects and reads the server's greeting, nothing more.
    pub fn greet(addr: SocketAddr) -> RawNbd {
        let mut c = RawNbd::connect(addr);
        let greeting = c.read_n(18);
        assert_eq!(&greeting[..16], GREETING, "not an NBD server's greeting");
        c
    }

    /// Connects and negotiates the default export (the empty name: the server's first) with
    /// `NBD_OPT_GO`, block sizes asked for: ready for requests, simple replies.
    pub fn ready(addr: SocketAddr) -> RawNbd {
        let mut c = RawNbd::greet(addr);
        c.send(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
        c.go("", &[INFO_BLOCK_SIZE]);
        c
    }

    /// [`RawNbd::ready`] with structured replies negotiated first.
    pub fn ready_structured(addr: SocketAddr) -> RawNbd {
        let mut c = RawNbd::greet(addr);
        c.send(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
        c.option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(c.opt_reply().reply_type, REP_ACK, "structured replies refused");
        c.go("", &[INFO_BLOCK_SIZE]);
        c
    }

    /// The client with its connection replaced by `wrap`'s stream over it (a TLS session
    /// after STARTTLS), its export's size and flags kept.
    pub fn wrapped<T, E>(
        self,
        wrap: impl FnOnce(TcpStream) -> Result<T, E>,
    ) -> Result<RawNbd<T>, E> {
        let stream = wrap(self.stream)?;
        Ok(RawNbd { stream, size_bytes: self.size_bytes, flags: self.flags })
    }
}

impl<S: Read + Write> RawNbd<S> {
    /// Sends `NBD_OPT_GO` for `export` asking for `infos`, and reads its replies up to the
    /// `ACK` (the export's size and flags kept from its `INFO_EXPORT`).
    pub fn go(&mut self, export: &str, infos: &[u16]) {
        self.option(OPT_GO, &go_data(export, infos));
        loop {
            let reply = self.opt_reply();
            match reply.reply_type {
                REP_INFO if reply.data.len() >= 12 && be16(&reply.data[..2]) == INFO_EXPORT => {
                    self.size_bytes = be64(&reply.data[2..10]);
                    self.flags = be16(&reply.data[10..12]);
                }
                REP_INFO => {}
                REP_ACK => return,
                t => panic!("GO failed with reply type {t:#x}: {:?}", reply.data),
            }
        }
    }

    /// Sends `bytes`.
    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).and_then(|()| self.stream.flush()).expect("send");
    }

    /// Reads exactly `n` bytes.
    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; n];
        self.stream.read_exact(&mut bytes).expect("read");
        bytes
    }

    /// Sends an option.
    pub fn option(&mut self, option: u32, data: &[u8]) {
        self.send(&option_bytes(option, data));
    }

    /// Reads the next option reply.
    pub fn opt_reply(&mut self) -> OptReply {
        let h = self.read_n(20);
        assert_eq!(be64(&h[..8]), OPTION_REPLY_MAGIC, "not an option reply: {h:?}");
        let len = be32(&h[16..20]) as usize;
        OptReply { option: be32(&h[8..12]), reply_type: be32(&h[12..16]), data: self.read_n(len) }
    }

    /// Sends one request: its header, then `payload`.
    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) {
        self.try_request(command, flags, cookie, offset, len, payload).expect("send a request");
    }

    /// [`RawNbd::request`], the error returned.
    pub fn try_request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        let mut bytes = request_bytes(command, flags, cookie, offset, len);
        bytes.extend_from_slice(payload);
        self.stream.write_all(&bytes)
    }

    /// Reads a simple reply's header: (error, cookie).
    pub fn simple_reply(&mut self) -> (u32, u64) {
        self.try_simple_reply().expect("a simple reply")
    }

    /// [`RawNbd::simple_reply`], the error returned.
    pub fn try_simple_reply(&mut self) -> io::Result<(u32, u64)> {
        let mut h = [0u8; 16];
        self.stream.read_exact(&mut h)?;
        assert_eq!(be32(&h[..4]), SIMPLE_REPLY_MAGIC, "not a simple reply: {h:?}");
        Ok((be32(&h[4..8]), be64(&h[8..16])))
    }

    /// Reads a structured reply chunk.
    pub fn chunk(&mut self) -> Chunk {
        let h = self.read_n(20);
        assert_eq!(be32(&h[..4]), STRUCTURED_REPLY_MAGIC, "not a structured chunk: {h:?}");
        let len = be32(&h[16..20]) as usize;
        Chunk {
            flags: be16(&h[4..6]),
            kind: be16(&h[6..8]),
            cookie: be64(&h[8..16]),
            payload: self.read_n(len),
        }
    }

    /// Reads `len` bytes at `offset`, asserting success (simple replies).
    pub fn read_at(&mut self, offset: u64, len: u32) -> Vec<u8> {
        self.request(CMD_READ, 0, 1, offset, len, &[]);
        assert_eq!(self.simple_reply(), (0, 1), "read {offset}+{len}");
        self.read_n(len as usize)
    }

    /// Writes `data` at `offset` with `flags`, asserting success.
    pub fn write_at(&mut self, offset: u64, data: &[u8], flags: u16) {
        self.request(CMD_WRITE, flags, 2, offset, data.len() as u32, data);
        assert_eq!(self.simple_reply(), (0, 2), "write {offset}+{}", data.len());
    }

    /// A 4 KiB write then its read-back at `offset` (cookies `cookie` and `cookie + 1`):
    /// this connection still works.
    pub fn assert_works(&mut self, offset: u64, cookie: u64) {
        let data: Vec<u8> = (0..4096u64).map(|i| (i ^ cookie) as u8).collect();
        self.request(CMD_WRITE, 0, cookie, offset, 4096, &data);
        assert_eq!(self.simple_reply(), (0, cookie));
        self.request(CMD_READ, 0, cookie + 1, offset, 4096, &[]);
        assert_eq!(self.simple_reply(), (0, cookie + 1));
        assert_eq!(self.read_n(4096), data);
    }

    /// Whether the server closed the connection (EOF or reset) within the read timeout,
    /// whatever it sent before.
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1024];
        loop {
            match self.stream.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// Connections that each break the protocol in their own way, as a server must survive them:
/// garbage for the client flags, a bad option magic, an oversized option, an option one byte
/// longer than a server reads past (1 MiB + 1), an export name too long for any export, an
/// unknown export asked for with `NBD_OPT_EXPORT_NAME` (which has no error reply), and a bad
/// request magic once ready. The server must close each, and only it.
pub fn misbehaving_clients(addr: SocketAddr) -> Vec<(&'static str, RawNbd)> {
    let flags = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes();
    let greeted = |what: &'static str, send: &dyn Fn(&mut RawNbd)| {
        let mut c = RawNbd::greet(addr);
        send(&mut c);
        (what, c)
    };
    let header = |len: u32| {
        let mut b = flags.to_vec();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    };
    let mut ready = RawNbd::ready(addr);
    ready.send(&[0xde; 28]);
    vec![
        greeted("garbage for the client flags", &|c| c.send(&[0x17; 64])),
        greeted("a bad option magic", &|c| {
            c.send(&flags);
            c.send(b"NOTMAGIC\0\0\0\x07\0\0\0\0");
        }),
        greeted("an oversized option", &|c| c.send(&header(0x4000_0000))),
        greeted("an option one byte past what is read past", &|c| c.send(&header((1 << 20) + 1))),
        greeted("an export name too long for any export", &|c| {
            c.send(&flags);
            c.option(OPT_EXPORT_NAME, &[b'x'; 20_000]);
        }),
        greeted("an unknown export by NBD_OPT_EXPORT_NAME", &|c| {
            c.send(&flags);
            c.option(OPT_EXPORT_NAME, b"nope");
        }),
        ("a bad request magic", ready),
    ]
}

/// An option on the wire: `IHAVEOPT`, the option, its data's length, its data.
pub fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// `NBD_OPT_GO` / `NBD_OPT_INFO` data: the export's name, then the infos asked for.
pub fn go_data(export: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (export.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// A request's 28-byte header.
pub fn request_bytes(command: u16, flags: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(28);
    b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&command.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b.try_into().expect("2 bytes"))
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b.try_into().expect("4 bytes"))
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b.try_into().expect("8 bytes"))
}
