//! Pure NBD wire codec: handshake negotiation, request decoding and validation, reply encoding.
//!
//! This module owns every byte layout of the NBD protocol that pmcache speaks (fixed newstyle
//! handshake, simple and structured replies) and no I/O at all: callers hand it byte slices
//! and get back decoded values, or get bytes appended to an output `Vec`. It never panics on
//! any input; malformed input becomes a [`ProtocolError`] (the connection must be closed) or a
//! [`RequestError`] / option error reply (the connection keeps working). It assumes nothing
//! about the transport: the server module does the reading and writing.
//!
//! All integers on the wire are big-endian. Layouts, from the NBD protocol specification:
//!
//! ```text
//! greeting (server, 18 B):   NBDMAGIC u64 | IHAVEOPT u64 | handshake flags u16
//! client flags (4 B):        u32
//! option (client, 16 B + n): IHAVEOPT u64 | option u32 | length u32 | data[length]
//! option reply (20 B + n):   0x3e889045565a9 u64 | option u32 | reply type u32 | length u32 | data
//! request (28 B + payload):  0x25609513 u32 | flags u16 | type u16 | cookie u64 | offset u64 | length u32
//! simple reply (16 B):       0x67446698 u32 | error u32 | cookie u64 | [read data]
//! structured chunk (20 B):   0x668e33ef u32 | flags u16 | type u16 | cookie u64 | length u32 | payload
//! ```

use crate::export::BlockSizes;

/// The block size a client that negotiates none keeps to, per the spec's advice.
const INTEROPERABLE_MIN_BLOCK_BYTES: u32 = 512;
/// The largest read or write such a client sends, per the same advice (2^25).
const INTEROPERABLE_MAX_PAYLOAD_BYTES: u32 = 32 << 20;

/// `NBDMAGIC`, the first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, the newstyle magic; also prefixes every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic prefixing every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic prefixing every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic prefixing every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic prefixing every structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client does not want the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flag: always set.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `NBD_CMD_FLUSH` is supported.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `NBD_CMD_FLAG_FUA` is supported.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: the export is rotational.
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: `NBD_CMD_TRIM` is supported.
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `NBD_CMD_WRITE_ZEROES` is supported.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: `NBD_CMD_FLAG_DF` is supported on reads.
pub const FLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: flush and FUA on one connection are visible on all connections.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Option: choose an export and enter transmission (no reply on error; the session closes).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: abort negotiation.
pub const OPT_ABORT: u32 = 2;
/// Option: list exports.
pub const OPT_LIST: u32 = 3;
/// Option: start TLS (acknowledged when TLS is on; the TLS handshake follows the ACK).
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: use structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list metadata contexts (none are offered).
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts (none are offered).
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply: success / end of a list.
pub const REP_ACK: u32 = 1;
/// Option reply: one export description (for `NBD_OPT_LIST`).
pub const REP_SERVER: u32 = 2;
/// Option reply: one information item (for `NBD_OPT_INFO` / `NBD_OPT_GO`).
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context (for `NBD_OPT_LIST_META_CONTEXT` / `SET_META_CONTEXT`).
pub const REP_META_CONTEXT: u32 = 4;
/// Option error: option unknown to this server.
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
/// Option error: forbidden by policy.
pub const REP_ERR_POLICY: u32 = 0x8000_0002;
/// Option error: syntactically invalid option.
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
/// Option error: TLS must be started first (`NBD_OPT_STARTTLS`).
pub const REP_ERR_TLS_REQD: u32 = 0x8000_0005;
/// Option error: no such export.
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;
/// Option error: the client must request block sizes before `NBD_OPT_GO`.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = 0x8000_0008;
/// Option error: request too big.
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;

/// Information type: export size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Information type: export name.
pub const INFO_NAME: u16 = 1;
/// Information type: export description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Information type: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write (payload follows the header).
pub const CMD_WRITE: u16 = 1;
/// Command: soft disconnect.
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: cache (prefetch hint; not advertised).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status (not advertised).
pub const CMD_BLOCK_STATUS: u16 = 7;

/// The spec's name of a command (`NBD_CMD_READ`, ...), for logs.
pub fn command_name(command: u16) -> &'static str {
    match command {
        CMD_READ => "NBD_CMD_READ",
        CMD_WRITE => "NBD_CMD_WRITE",
        CMD_DISC => "NBD_CMD_DISC",
        CMD_FLUSH => "NBD_CMD_FLUSH",
        CMD_TRIM => "NBD_CMD_TRIM",
        CMD_CACHE => "NBD_CMD_CACHE",
        CMD_WRITE_ZEROES => "NBD_CMD_WRITE_ZEROES",
        CMD_BLOCK_STATUS => "NBD_CMD_BLOCK_STATUS",
        _ => "an unknown command",
    }
}

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: write zeroes must not punch a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: read reply must not be fragmented.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: block status for one extent only.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: fail write zeroes fast if it would be slow (not advertised).
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flag: last chunk of this reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Structured reply type: no payload.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Structured reply type: offset plus data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Structured reply chunk: block status descriptors of one metadata context.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// The `base:allocation` metadata context, the one this server offers.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// The id this server gives `base:allocation` in `NBD_REP_META_CONTEXT` and block status.
pub const META_BASE_ALLOCATION_ID: u32 = 1;
/// `base:allocation` flag: the extent is a hole (no storage allocated).
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;
/// Structured reply type: error plus message.
pub const REPLY_TYPE_ERROR: u16 = 0x8001;

/// NBD error: operation not permitted.
pub const NBD_EPERM: u32 = 1;
/// NBD error: input/output error.
pub const NBD_EIO: u32 = 5;
/// NBD error: out of memory.
pub const NBD_ENOMEM: u32 = 12;
/// NBD error: invalid argument.
pub const NBD_EINVAL: u32 = 22;
/// NBD error: no space left.
pub const NBD_ENOSPC: u32 = 28;
/// NBD error: value too large (request exceeds the maximum payload size).
pub const NBD_EOVERFLOW: u32 = 75;
/// NBD error: operation not supported.
pub const NBD_ENOTSUP: u32 = 95;
/// NBD error: the server is shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

/// Size of the server greeting.
pub const GREETING_BYTES: usize = 18;
/// Size of the client flags.
pub const CLIENT_FLAGS_BYTES: usize = 4;
/// Size of an option header.
pub const OPTION_HEADER_BYTES: usize = 16;
/// Size of a request header.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Size of a structured reply chunk header.
pub const STRUCTURED_HEADER_BYTES: usize = 20;
/// Size of a structured read reply header: chunk header plus the 8-byte offset.
pub const STRUCTURED_READ_HEADER_BYTES: usize = STRUCTURED_HEADER_BYTES + 8;
/// Largest option data the server reads and handles.
pub const OPTION_DATA_BYTES_MAX: u32 = 16 * 1024;
/// Largest option data the server reads past (discarding it) to answer `NBD_REP_ERR_TOO_BIG`
/// and go on; anything larger closes the connection. No option this server supports needs
/// more than [`OPTION_DATA_BYTES_MAX`]; the handshake's deadline bounds the time spent.
pub const OPTION_DISCARD_BYTES_MAX: u32 = 1 << 20;
/// Longest export name (and any string) the spec allows.
pub const STRING_BYTES_MAX: usize = 4096;
/// Most options one client may send before the server gives up on it.
pub const OPTIONS_PER_HANDSHAKE_MAX: u32 = 256;
/// Longest error message put in a structured error chunk.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 256;

/// A violation that ends the connection (hard disconnect), per the spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The client set handshake flags we never advertised.
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    /// An option did not start with `IHAVEOPT`.
    #[error("bad option magic {0:#x}")]
    BadOptionMagic(u64),
    /// An option's data length exceeds [`OPTION_DISCARD_BYTES_MAX`] (or, for
    /// `NBD_OPT_EXPORT_NAME`, which has no error reply, [`OPTION_DATA_BYTES_MAX`]).
    #[error("option data of {0} bytes exceeds the limit")]
    OptionTooLarge(u32),
    /// More than [`OPTIONS_PER_HANDSHAKE_MAX`] options.
    #[error("too many options in one handshake")]
    TooManyOptions,
    /// `NBD_OPT_EXPORT_NAME` named an export we do not have (no error reply is possible).
    #[error("unknown export requested with NBD_OPT_EXPORT_NAME")]
    UnknownExport,
    /// `NBD_OPT_EXPORT_NAME` before TLS on a server that requires TLS (no error reply is
    /// possible).
    #[error("NBD_OPT_EXPORT_NAME before TLS, which this server requires")]
    TlsRequired,
    /// A request did not start with the request magic.
    #[error("bad request magic {0:#x}")]
    BadRequestMagic(u32),
}

fn be_u16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([s[0], s[1]]))
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_be_bytes(a))
}

/// A forward-only reader over option data; every accessor returns `None` past the end.
struct Fields<'a> {
    bytes: &'a [u8],
}

impl<'a> Fields<'a> {
    fn u16(&mut self) -> Option<u16> {
        let v = be_u16(self.bytes, 0)?;
        self.bytes = &self.bytes[2..];
        Some(v)
    }

    fn u32(&mut self) -> Option<u32> {
        let v = be_u32(self.bytes, 0)?;
        self.bytes = &self.bytes[4..];
        Some(v)
    }

    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        if len > self.bytes.len() {
            return None;
        }
        let (head, tail) = self.bytes.split_at(len);
        self.bytes = tail;
        Some(head)
    }
}

mod handshake;
mod transmission;

pub use handshake::*;
pub use transmission::*;

#[cfg(test)]
pub(crate) mod tests;
