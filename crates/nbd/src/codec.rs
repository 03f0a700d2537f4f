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

/// The 18-byte server greeting of a fixed newstyle handshake.
pub fn greeting() -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    g[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    g[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    g
}

/// A decoded option header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option code (`OPT_*`).
    pub option: u32,
    /// Length of the option data that follows; at most [`OPTION_DISCARD_BYTES_MAX`]. Above
    /// [`OPTION_DATA_BYTES_MAX`] the data is discarded and the option answered
    /// `NBD_REP_ERR_TOO_BIG` by [`Negotiation::handle_option`].
    pub data_len_bytes: u32,
}

impl OptionHeader {
    /// Whether the option's data is too large to handle (see [`OPTION_DATA_BYTES_MAX`]).
    pub fn is_oversized(&self) -> bool {
        self.data_len_bytes > OPTION_DATA_BYTES_MAX
    }
}

/// Decodes an option header; rejects bad magic and data beyond what the server reads past
/// (both close the connection).
pub fn decode_option_header(b: &[u8; OPTION_HEADER_BYTES]) -> Result<OptionHeader, ProtocolError> {
    let magic = u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    if magic != IHAVEOPT {
        return Err(ProtocolError::BadOptionMagic(magic));
    }
    let option = u32::from_be_bytes([b[8], b[9], b[10], b[11]]);
    let data_len_bytes = u32::from_be_bytes([b[12], b[13], b[14], b[15]]);
    if data_len_bytes > OPTION_DISCARD_BYTES_MAX {
        return Err(ProtocolError::OptionTooLarge(data_len_bytes));
    }
    Ok(OptionHeader { option, data_len_bytes })
}

/// Appends one option reply.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[&[u8]]) {
    let len: usize = data.iter().map(|d| d.len()).sum();
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    // Replies are built from bounded pieces (names <= 4096 bytes), so this never truncates.
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    for d in data {
        out.extend_from_slice(d);
    }
}

/// What the server exports, as the negotiation needs to describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Export name; the empty name always selects this export too (the "default export").
    pub name: String,
    /// Export size.
    pub size_bytes: u64,
    /// Block size constraints advertised with `NBD_INFO_BLOCK_SIZE` (max already clamped to
    /// the server's maximum request size).
    pub block_sizes: BlockSizes,
    /// Whether to advertise `NBD_FLAG_CAN_MULTI_CONN`.
    pub can_multi_conn: bool,
}

impl ExportInfo {
    fn matches(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }

    fn transmission_flags(&self, structured_replies: bool) -> u16 {
        let mut flags = FLAG_HAS_FLAGS
            | FLAG_SEND_FLUSH
            | FLAG_SEND_FUA
            | FLAG_SEND_TRIM
            | FLAG_SEND_WRITE_ZEROES;
        if self.can_multi_conn {
            flags |= FLAG_CAN_MULTI_CONN;
        }
        if structured_replies {
            flags |= FLAG_SEND_DF;
        }
        flags
    }
}

/// The outcome of one option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionOutcome {
    /// Reply bytes (if any) were appended; read the next option.
    Continue,
    /// The client aborted; send the appended reply, then close.
    Abort,
    /// Send the appended bytes, then enter the transmission phase with this session.
    Transmission(Session),
    /// Close the connection without further replies.
    Close(ProtocolError),
    /// Send the appended `ACK`, then run the TLS handshake on the connection; the following
    /// options arrive over TLS. The negotiation already counts TLS as active.
    StartTls,
}

/// Whether the handshake offers TLS (`NBD_OPT_STARTTLS`), as the spec's server modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// NOTLS: `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// TLS at the client's choice (SELECTIVETLS with no TLS-only export): plain clients are
    /// served too.
    On,
    /// FORCEDTLS: before TLS, every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` gets
    /// `NBD_REP_ERR_TLS_REQD` (`NBD_OPT_EXPORT_NAME`, which has no error reply, closes).
    Require,
}

/// The handshake state machine after the greeting and client flags: one call per option.
#[derive(Debug)]
pub struct Negotiation<'a> {
    export: &'a ExportInfo,
    no_zeroes: bool,
    structured_replies: bool,
    /// `base:allocation` was selected with `NBD_OPT_SET_META_CONTEXT`.
    base_allocation: bool,
    options_seen: u32,
    tls_mode: TlsMode,
    tls_active: bool,
}

impl<'a> Negotiation<'a> {
    /// Starts negotiating after the client flags arrived; unknown flags are a hard error.
    pub fn new(
        export: &'a ExportInfo,
        client_flags: [u8; CLIENT_FLAGS_BYTES],
    ) -> Result<Self, ProtocolError> {
        let flags = u32::from_be_bytes(client_flags);
        if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(ProtocolError::UnknownClientFlags(flags));
        }
        Ok(Self {
            export,
            no_zeroes: flags & FLAG_C_NO_ZEROES != 0,
            structured_replies: false,
            base_allocation: false,
            options_seen: 0,
            tls_mode: TlsMode::Off,
            tls_active: false,
        })
    }

    /// Sets how the negotiation treats TLS (default [`TlsMode::Off`]).
    pub fn with_tls(self, tls_mode: TlsMode) -> Self {
        Self { tls_mode, ..self }
    }

    /// True once `NBD_OPT_STARTTLS` was acknowledged: the options since came over TLS.
    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// Answers what TLS decides before the option itself: `NBD_OPT_STARTTLS` in every mode,
    /// and in [`TlsMode::Require`] before TLS every option but `NBD_OPT_ABORT`.
    fn tls_gate(&mut self, opt: u32, data: &[u8], out: &mut Vec<u8>) -> Option<OptionOutcome> {
        if opt == OPT_STARTTLS {
            if self.tls_mode == TlsMode::Off {
                error_reply(out, opt, REP_ERR_POLICY, "TLS is not enabled on this server");
            } else if self.tls_active {
                error_reply(out, opt, REP_ERR_INVALID, "TLS is already active");
            } else if !data.is_empty() {
                error_reply(out, opt, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data");
            } else {
                encode_option_reply(out, opt, REP_ACK, &[]);
                // Nothing negotiated in clear survives the upgrade (a man in the middle could
                // have chosen it).
                self.structured_replies = false;
                self.tls_active = true;
                return Some(OptionOutcome::StartTls);
            }
            return Some(OptionOutcome::Continue);
        }
        if self.tls_mode != TlsMode::Require || self.tls_active || opt == OPT_ABORT {
            return None;
        }
        if opt == OPT_EXPORT_NAME {
            return Some(OptionOutcome::Close(ProtocolError::TlsRequired));
        }
        error_reply(out, opt, REP_ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS");
        Some(OptionOutcome::Continue)
    }

    /// Answers an option whose data is too large to handle ([`OptionHeader::is_oversized`]):
    /// `NBD_REP_ERR_TOO_BIG`, and the haggling goes on once the caller has read past the data.
    /// `NBD_OPT_EXPORT_NAME` has no error reply: it closes (no export name is that long).
    fn refuse_oversized(&self, header: OptionHeader, out: &mut Vec<u8>) -> OptionOutcome {
        if header.option == OPT_EXPORT_NAME {
            return OptionOutcome::Close(ProtocolError::OptionTooLarge(header.data_len_bytes));
        }
        let message = format!(
            "option data of {} bytes is larger than this server handles ({OPTION_DATA_BYTES_MAX})",
            header.data_len_bytes
        );
        error_reply(out, header.option, REP_ERR_TOO_BIG, &message);
        OptionOutcome::Continue
    }

    /// Counts an option; the one past [`OPTIONS_PER_HANDSHAKE_MAX`] closes the connection.
    fn count_option(&mut self) -> Option<OptionOutcome> {
        self.options_seen = self.options_seen.saturating_add(1);
        (self.options_seen > OPTIONS_PER_HANDSHAKE_MAX)
            .then_some(OptionOutcome::Close(ProtocolError::TooManyOptions))
    }

    /// Handles one option whose data has been read in full; appends any reply to `out`. An
    /// oversized option ([`OptionHeader::is_oversized`]) is answered without its data, which
    /// the caller reads past (or passes anyway): `NBD_REP_ERR_TOO_BIG`.
    pub fn handle_option(
        &mut self,
        header: OptionHeader,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> OptionOutcome {
        if let Some(close) = self.count_option() {
            return close;
        }
        if header.is_oversized() {
            return self.refuse_oversized(header, out);
        }
        let opt = header.option;
        if let Some(outcome) = self.tls_gate(opt, data, out) {
            return outcome;
        }
        match opt {
            OPT_EXPORT_NAME => self.export_name(data, out),
            OPT_ABORT => {
                encode_option_reply(out, opt, REP_ACK, &[]);
                OptionOutcome::Abort
            }
            OPT_LIST => {
                if data.is_empty() {
                    let name = self.export.name.as_bytes();
                    let name_len = u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes();
                    encode_option_reply(out, opt, REP_SERVER, &[&name_len, name]);
                    encode_option_reply(out, opt, REP_ACK, &[]);
                } else {
                    error_reply(out, opt, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
                }
                OptionOutcome::Continue
            }
            OPT_INFO | OPT_GO => self.info_or_go(opt, data, out),
            OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    self.structured_replies = true;
                    encode_option_reply(out, opt, REP_ACK, &[]);
                } else {
                    error_reply(
                        out,
                        opt,
                        REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                }
                OptionOutcome::Continue
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(opt, data, out);
                OptionOutcome::Continue
            }
            _ => {
                error_reply(out, opt, REP_ERR_UNSUP, "option not supported");
                OptionOutcome::Continue
            }
        }
    }

    /// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: the one context offered is
    /// `base:allocation`. A list with no query, or a `base:` query, lists it; a query naming it
    /// exactly selects it (a SET replaces what an earlier SET selected). Other namespaces and
    /// names select nothing, which is not an error.
    fn meta_context(&mut self, opt: u32, data: &[u8], out: &mut Vec<u8>) {
        if !self.structured_replies {
            error_reply(out, opt, REP_ERR_INVALID, "structured replies not negotiated");
            return;
        }
        let Some((name, queries)) = parse_meta_context(data) else {
            error_reply(out, opt, REP_ERR_INVALID, "malformed meta context option");
            return;
        };
        let set = opt == OPT_SET_META_CONTEXT;
        if !self.export.matches(name) {
            if set {
                self.base_allocation = false;
            }
            error_reply(out, opt, REP_ERR_UNKNOWN, "no such export");
            return;
        }
        let mut matched = !set && queries.iter().all(Option::is_none);
        for query in queries.iter().flatten() {
            matched |= *query == META_BASE_ALLOCATION.as_bytes() || (!set && *query == b"base:");
        }
        if set {
            self.base_allocation = matched;
        }
        if matched {
            let id = if set { META_BASE_ALLOCATION_ID } else { 0 };
            let name = META_BASE_ALLOCATION.as_bytes();
            encode_option_reply(out, opt, REP_META_CONTEXT, &[&id.to_be_bytes(), name]);
        }
        encode_option_reply(out, opt, REP_ACK, &[]);
    }

    fn export_name(&self, data: &[u8], out: &mut Vec<u8>) -> OptionOutcome {
        if data.len() > STRING_BYTES_MAX || !self.export.matches(data) {
            return OptionOutcome::Close(ProtocolError::UnknownExport);
        }
        let session = self.session(false);
        out.extend_from_slice(&self.export.size_bytes.to_be_bytes());
        out.extend_from_slice(&session.transmission_flags.to_be_bytes());
        if !self.no_zeroes {
            out.extend_from_slice(&[0u8; 124]);
        }
        OptionOutcome::Transmission(session)
    }

    fn info_or_go(&self, opt: u32, data: &[u8], out: &mut Vec<u8>) -> OptionOutcome {
        let Some((name, requests)) = parse_info_request(data) else {
            error_reply(out, opt, REP_ERR_INVALID, "malformed NBD_OPT_INFO/GO data");
            return OptionOutcome::Continue;
        };
        if !self.export.matches(name) {
            error_reply(out, opt, REP_ERR_UNKNOWN, "no such export");
            return OptionOutcome::Continue;
        }
        let requested =
            |ty: u16| requests.chunks_exact(2).any(|c| u16::from_be_bytes([c[0], c[1]]) == ty);
        let block_size_requested = requested(INFO_BLOCK_SIZE);
        // A client that asks for no block sizes keeps to 512-byte multiples and to reads and
        // writes of at most 32 MiB if it wants to interoperate (the spec's advice;
        // `nbd-client` sends a bare GO): an export whose limits allow that serves it, refusing
        // misaligned requests with EINVAL as it does after `NBD_OPT_EXPORT_NAME`. A larger
        // minimum, or a maximum below 32 MiB (and below the export's size, which bounds every
        // request anyway), must be agreed first.
        let sizes = &self.export.block_sizes;
        let payload_bound = u64::from(INTEROPERABLE_MAX_PAYLOAD_BYTES).min(self.export.size_bytes);
        if opt == OPT_GO
            && !block_size_requested
            && (sizes.min_bytes > INTEROPERABLE_MIN_BLOCK_BYTES
                || u64::from(sizes.max_bytes) < payload_bound)
        {
            error_reply(
                out,
                opt,
                REP_ERR_BLOCK_SIZE_REQD,
                "this export needs the client to honour NBD_INFO_BLOCK_SIZE",
            );
            return OptionOutcome::Continue;
        }
        let session = self.session(true);
        let mut export_info = [0u8; 12];
        export_info[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
        export_info[2..10].copy_from_slice(&self.export.size_bytes.to_be_bytes());
        export_info[10..12].copy_from_slice(&session.transmission_flags.to_be_bytes());
        encode_option_reply(out, opt, REP_INFO, &[&export_info]);
        if requested(INFO_NAME) {
            encode_option_reply(
                out,
                opt,
                REP_INFO,
                &[&INFO_NAME.to_be_bytes(), self.export.name.as_bytes()],
            );
        }
        let bs = self.export.block_sizes;
        let mut block_info = [0u8; 14];
        block_info[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        block_info[2..6].copy_from_slice(&bs.min_bytes.to_be_bytes());
        block_info[6..10].copy_from_slice(&bs.preferred_bytes.to_be_bytes());
        block_info[10..14].copy_from_slice(&bs.max_bytes.to_be_bytes());
        encode_option_reply(out, opt, REP_INFO, &[&block_info]);
        encode_option_reply(out, opt, REP_ACK, &[]);
        if opt == OPT_GO { OptionOutcome::Transmission(session) } else { OptionOutcome::Continue }
    }

    fn session(&self, block_sizes_agreed: bool) -> Session {
        let bs = self.export.block_sizes;
        Session {
            structured_replies: self.structured_replies,
            transmission_flags: self.export.transmission_flags(self.structured_replies),
            size_bytes: self.export.size_bytes,
            min_block_bytes: bs.min_bytes,
            max_payload_bytes: bs.max_bytes,
            block_sizes_agreed,
            base_allocation: self.base_allocation && self.structured_replies,
        }
    }
}

pub(crate) fn error_reply(out: &mut Vec<u8>, opt: u32, reply_type: u32, msg: &str) {
    encode_option_reply(out, opt, reply_type, &[msg.as_bytes()]);
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data: name length u32, name, count u16, count * info type u16.
fn parse_info_request(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut f = Fields { bytes: data };
    let name_len = usize::try_from(f.u32()?).ok()?;
    if name_len > STRING_BYTES_MAX {
        return None;
    }
    let name = f.take(name_len)?;
    let count = usize::from(f.u16()?);
    let requests = f.take(count.checked_mul(2)?)?;
    f.bytes.is_empty().then_some((name, requests))
}

/// How many queries of one meta context option are looked at; later ones are ignored (this
/// server has one context to match).
const META_QUERIES_MAX: usize = 16;

/// The queries of a meta context option that are looked at.
type MetaQueries<'a> = [Option<&'a [u8]>; META_QUERIES_MAX];

/// Meta context option data: name length u32, name, query count u32, queries (u32 len + str).
/// Returns the export name and the first [`META_QUERIES_MAX`] queries.
fn parse_meta_context(data: &[u8]) -> Option<(&[u8], MetaQueries<'_>)> {
    let mut f = Fields { bytes: data };
    let name_len = usize::try_from(f.u32()?).ok()?;
    if name_len > STRING_BYTES_MAX {
        return None;
    }
    let name = f.take(name_len)?;
    let count = f.u32()?;
    let mut queries = [None; META_QUERIES_MAX];
    for i in 0..count {
        let len = usize::try_from(f.u32()?).ok()?;
        if len > STRING_BYTES_MAX {
            return None;
        }
        let query = f.take(len)?;
        if let Some(q) = queries.get_mut(i as usize) {
            *q = Some(query);
        }
    }
    f.bytes.is_empty().then_some((name, queries))
}

/// What was agreed in the handshake; validates transmission requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    /// Structured replies were negotiated (reads get structured replies).
    pub structured_replies: bool,
    /// Transmission flags sent to the client.
    pub transmission_flags: u16,
    /// Export size.
    pub size_bytes: u64,
    /// Required alignment of offsets and lengths (1 = none).
    pub min_block_bytes: u32,
    /// Largest read or write payload.
    pub max_payload_bytes: u32,
    /// The client saw the block size constraints (`NBD_OPT_INFO`/`GO`, not `EXPORT_NAME`).
    pub block_sizes_agreed: bool,
    /// `base:allocation` was selected: `NBD_CMD_BLOCK_STATUS` is served.
    pub base_allocation: bool,
}

/// A decoded request header (only the magic is checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// Command type (`CMD_*`).
    pub command: u16,
    /// Opaque client cookie ("handle"), echoed in the reply.
    pub cookie: u64,
    /// Offset into the export.
    pub offset_bytes: u64,
    /// Length of the range (and of the payload, for writes).
    pub len_bytes: u32,
}

impl RequestHeader {
    /// Bytes of payload that follow this header on the wire, whether the request is valid or
    /// not: the server must consume them to stay in sync.
    pub fn payload_len_bytes(&self) -> u32 {
        if self.command == CMD_WRITE { self.len_bytes } else { 0 }
    }
}

/// Decodes a request header; a bad magic is a hard error.
pub fn decode_request_header(
    b: &[u8; REQUEST_HEADER_BYTES],
) -> Result<RequestHeader, ProtocolError> {
    let field = |at| be_u64(b, at).unwrap_or_default();
    let magic = be_u32(b, 0).unwrap_or_default();
    if magic != REQUEST_MAGIC {
        return Err(ProtocolError::BadRequestMagic(magic));
    }
    Ok(RequestHeader {
        flags: be_u16(b, 4).unwrap_or_default(),
        command: be_u16(b, 6).unwrap_or_default(),
        cookie: field(8),
        offset_bytes: field(16),
        len_bytes: be_u32(b, 24).unwrap_or_default(),
    })
}

/// A validated request, ready for the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Read `len_bytes` at `offset_bytes`.
    Read {
        /// Offset into the export.
        offset_bytes: u64,
        /// Length to read; at most the maximum payload.
        len_bytes: u32,
    },
    /// Write the payload that follows.
    Write {
        /// Offset into the export.
        offset_bytes: u64,
        /// Payload length; at most the maximum payload.
        len_bytes: u32,
        /// Persist before replying.
        fua: bool,
    },
    /// Soft disconnect.
    Disconnect,
    /// Flush.
    Flush,
    /// Trim.
    Trim {
        /// Offset into the export.
        offset_bytes: u64,
        /// Length to trim.
        len_bytes: u32,
        /// Persist before replying.
        fua: bool,
    },
    /// Write zeroes.
    WriteZeroes {
        /// Offset into the export.
        offset_bytes: u64,
        /// Length to zero.
        len_bytes: u32,
        /// Persist before replying.
        fua: bool,
        /// The server may punch a hole (`NBD_CMD_FLAG_NO_HOLE` clear).
        may_trim: bool,
    },
    /// Block status of `base:allocation`.
    BlockStatus {
        /// Offset into the export.
        offset_bytes: u64,
        /// Length of the range asked about (not 0).
        len_bytes: u32,
        /// `NBD_CMD_FLAG_REQ_ONE`: one extent is enough.
        req_one: bool,
    },
}

/// A request the server refuses; the connection keeps working.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (NBD error {nbd_error})")]
pub struct RequestError {
    /// NBD error code for the reply (`NBD_E*`).
    pub nbd_error: u32,
    /// Short human-readable reason, also sent in structured error chunks.
    pub reason: &'static str,
}

fn refuse(nbd_error: u32, reason: &'static str) -> RequestError {
    RequestError { nbd_error, reason }
}

impl Session {
    /// Validates a request against the negotiated session: known command, known and
    /// applicable flags, size, alignment, bounds. Errors are the ones the spec names.
    pub fn validate(&self, h: &RequestHeader) -> Result<Request, RequestError> {
        let fua = h.flags & CMD_FLAG_FUA != 0;
        let df = if self.structured_replies { CMD_FLAG_DF } else { 0 };
        match h.command {
            CMD_READ => {
                self.check(h, CMD_FLAG_FUA | df, true, NBD_EINVAL)?;
                Ok(Request::Read { offset_bytes: h.offset_bytes, len_bytes: h.len_bytes })
            }
            CMD_WRITE => {
                self.check(h, CMD_FLAG_FUA, true, NBD_ENOSPC)?;
                Ok(Request::Write { offset_bytes: h.offset_bytes, len_bytes: h.len_bytes, fua })
            }
            CMD_DISC => Ok(Request::Disconnect),
            CMD_FLUSH => {
                check_flags(h, CMD_FLAG_FUA)?;
                if h.offset_bytes != 0 || h.len_bytes != 0 {
                    return Err(refuse(NBD_EINVAL, "flush with nonzero offset or length"));
                }
                Ok(Request::Flush)
            }
            CMD_TRIM => {
                self.check(h, CMD_FLAG_FUA, false, NBD_EINVAL)?;
                Ok(Request::Trim { offset_bytes: h.offset_bytes, len_bytes: h.len_bytes, fua })
            }
            CMD_WRITE_ZEROES => {
                self.check(h, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE, false, NBD_ENOSPC)?;
                Ok(Request::WriteZeroes {
                    offset_bytes: h.offset_bytes,
                    len_bytes: h.len_bytes,
                    fua,
                    may_trim: h.flags & CMD_FLAG_NO_HOLE == 0,
                })
            }
            CMD_BLOCK_STATUS => {
                if !self.base_allocation {
                    return Err(refuse(NBD_EINVAL, "block status without a selected meta context"));
                }
                self.check(h, CMD_FLAG_FUA | CMD_FLAG_REQ_ONE, false, NBD_EINVAL)?;
                if h.len_bytes == 0 {
                    return Err(refuse(NBD_EINVAL, "block status of an empty range"));
                }
                Ok(Request::BlockStatus {
                    offset_bytes: h.offset_bytes,
                    len_bytes: h.len_bytes,
                    req_one: h.flags & CMD_FLAG_REQ_ONE != 0,
                })
            }
            _ => Err(refuse(NBD_EINVAL, "unknown or unsupported command")),
        }
    }

    /// Flags, payload size (if `has_payload_limit`), alignment, then bounds.
    fn check(
        &self,
        h: &RequestHeader,
        allowed_flags: u16,
        has_payload_limit: bool,
        out_of_range_error: u32,
    ) -> Result<(), RequestError> {
        check_flags(h, allowed_flags)?;
        if has_payload_limit && h.len_bytes > self.max_payload_bytes {
            return Err(refuse(NBD_EOVERFLOW, "request exceeds the maximum payload size"));
        }
        let min = u64::from(self.min_block_bytes.max(1));
        if !h.offset_bytes.is_multiple_of(min) || !u64::from(h.len_bytes).is_multiple_of(min) {
            return Err(refuse(NBD_EINVAL, "request not aligned to the minimum block size"));
        }
        match h.offset_bytes.checked_add(u64::from(h.len_bytes)) {
            Some(end) if end <= self.size_bytes => Ok(()),
            _ => Err(refuse(out_of_range_error, "request past the end of the export")),
        }
    }
}

fn check_flags(h: &RequestHeader, allowed: u16) -> Result<(), RequestError> {
    if h.flags & !allowed != 0 {
        return Err(refuse(NBD_EINVAL, "unknown or inapplicable command flag"));
    }
    Ok(())
}

/// Appends a simple reply header (no payload).
pub fn encode_simple_reply(out: &mut Vec<u8>, cookie: u64, nbd_error: u32) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&nbd_error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// Appends a structured chunk header.
pub fn encode_chunk_header(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, len_bytes: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len_bytes.to_be_bytes());
}

/// Appends the header of a successful read reply; the caller appends `len_bytes` of data.
///
/// Simple replies: the 16-byte header. Structured replies: one `OFFSET_DATA` chunk with the
/// `DONE` flag (the data is complete in memory before it is sent, so no error can follow), or
/// a `NONE` chunk for a zero-length read (a data chunk must carry at least one byte).
pub fn encode_read_ok(
    out: &mut Vec<u8>,
    structured: bool,
    cookie: u64,
    offset_bytes: u64,
    len_bytes: u32,
) {
    if !structured {
        encode_simple_reply(out, cookie, 0);
    } else if len_bytes == 0 {
        encode_chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0);
    } else {
        let chunk_len = len_bytes.saturating_add(8);
        encode_chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie, chunk_len);
        out.extend_from_slice(&offset_bytes.to_be_bytes());
    }
}

/// Appends a `base:allocation` block status reply: one `BLOCK_STATUS` chunk with the `DONE`
/// flag, carrying `(length, flags)` descriptors (`STATE_*` flags).
pub fn encode_block_status(
    out: &mut Vec<u8>,
    cookie: u64,
    extents: impl ExactSizeIterator<Item = (u32, u32)>,
) {
    let chunk_len = u32::try_from(4 + 8 * extents.len()).unwrap_or(u32::MAX);
    encode_chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, cookie, chunk_len);
    out.extend_from_slice(&META_BASE_ALLOCATION_ID.to_be_bytes());
    for (len_bytes, flags) in extents {
        out.extend_from_slice(&len_bytes.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
}

/// Appends an error reply. Reads on a structured session get an `ERROR` chunk carrying
/// `message` (truncated to [`ERROR_MESSAGE_BYTES_MAX`]); everything else a simple reply.
pub fn encode_error(
    out: &mut Vec<u8>,
    structured_read: bool,
    cookie: u64,
    nbd_error: u32,
    message: &str,
) {
    if !structured_read {
        encode_simple_reply(out, cookie, nbd_error);
        return;
    }
    let mut msg_len = message.len().min(ERROR_MESSAGE_BYTES_MAX);
    while !message.is_char_boundary(msg_len) {
        msg_len -= 1;
    }
    let msg = &message.as_bytes()[..msg_len];
    let msg_len_u16 = u16::try_from(msg.len()).unwrap_or(0);
    let chunk_len = 6 + u32::from(msg_len_u16);
    encode_chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, chunk_len);
    out.extend_from_slice(&nbd_error.to_be_bytes());
    out.extend_from_slice(&msg_len_u16.to_be_bytes());
    out.extend_from_slice(msg);
}

/// Maps an errno from the export to the NBD error the spec allows on the wire.
pub fn nbd_error_from_errno(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => NBD_EPERM,
        libc::EIO => NBD_EIO,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::ENOTSUP => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn export() -> ExportInfo {
        ExportInfo {
            name: "pm".into(),
            size_bytes: 1 << 20,
            block_sizes: BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 1 << 16 },
            can_multi_conn: true,
        }
    }

    fn header(command: u16, flags: u16, offset_bytes: u64, len_bytes: u32) -> RequestHeader {
        RequestHeader { flags, command, cookie: 7, offset_bytes, len_bytes }
    }

    /// `NBD_OPT_INFO` / `NBD_OPT_GO` data naming `name` and asking for `infos`.
    pub(crate) fn go(name: &[u8], infos: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    fn negotiated_session(structured: bool) -> Session {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 3]).expect("valid flags");
        let mut out = Vec::new();
        if structured {
            let h = OptionHeader { option: OPT_STRUCTURED_REPLY, data_len_bytes: 0 };
            assert_eq!(n.handle_option(h, &[], &mut out), OptionOutcome::Continue);
        }
        let data = go(b"pm", &[INFO_BLOCK_SIZE]);
        let h = OptionHeader { option: OPT_GO, data_len_bytes: data.len() as u32 };
        match n.handle_option(h, &data, &mut out) {
            OptionOutcome::Transmission(s) => s,
            other => panic!("expected transmission, got {other:?}"),
        }
    }

    #[test]
    fn greeting_layout() {
        let g = greeting();
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(u16::from_be_bytes([g[16], g[17]]), 3);
    }

    #[test]
    fn unknown_client_flags_close() {
        let e = export();
        assert_eq!(
            Negotiation::new(&e, [0, 0, 0, 4]).unwrap_err(),
            ProtocolError::UnknownClientFlags(4)
        );
    }

    #[test]
    fn go_replies_info_then_ack() {
        let s = negotiated_session(true);
        assert!(s.structured_replies);
        assert_ne!(s.transmission_flags & FLAG_CAN_MULTI_CONN, 0);
        assert_ne!(s.transmission_flags & FLAG_SEND_DF, 0);
        assert_eq!(s.min_block_bytes, 512);
    }

    /// A GO that asks for no block sizes (as `nbd-client` sends it) enters transmission on an
    /// export whose minimum is 512 bytes; only a larger minimum must be agreed first.
    #[test]
    fn go_without_block_size_request_is_refused_only_beyond_the_interoperable_sizes() {
        let data = go(b"", &[]);
        let h = OptionHeader { option: OPT_GO, data_len_bytes: data.len() as u32 };
        // (size, min, max): served when min <= 512 and max >= min(32 MiB, size).
        for (size_bytes, min_bytes, max_bytes, served) in [
            (1 << 20, 512, 1 << 20, true),
            (1 << 30, 512, 32 << 20, true),
            (1 << 30, 1, 32 << 20, true),
            (1 << 20, 4096, 1 << 20, false),
            (1 << 20, 512, 1 << 16, false),
            (1 << 30, 512, (32 << 20) - 512, false),
        ] {
            let mut e = export();
            e.size_bytes = size_bytes;
            e.block_sizes = BlockSizes { min_bytes, preferred_bytes: 4096, max_bytes };
            let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
            let mut out = Vec::new();
            let outcome = n.handle_option(h, &data, &mut out);
            let case = format!("size {size_bytes}, min {min_bytes}, max {max_bytes}");
            if served {
                assert!(matches!(outcome, OptionOutcome::Transmission(_)), "{case}: {outcome:?}");
            } else {
                assert_eq!(outcome, OptionOutcome::Continue, "{case}");
                assert_eq!(be_u32(&out, 12), Some(REP_ERR_BLOCK_SIZE_REQD), "{case}");
                // Asking for the sizes is all it takes.
                let asked = go(b"", &[INFO_BLOCK_SIZE]);
                let h = OptionHeader { option: OPT_GO, data_len_bytes: asked.len() as u32 };
                let outcome = n.handle_option(h, &asked, &mut Vec::new());
                assert!(matches!(outcome, OptionOutcome::Transmission(_)), "{case}: {outcome:?}");
            }
        }
    }

    #[test]
    fn go_unknown_and_malformed() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let mut out = Vec::new();
        let data = go(b"nope", &[INFO_BLOCK_SIZE]);
        let h = OptionHeader { option: OPT_GO, data_len_bytes: data.len() as u32 };
        assert_eq!(n.handle_option(h, &data, &mut out), OptionOutcome::Continue);
        assert_eq!(be_u32(&out, 12), Some(REP_ERR_UNKNOWN));
        out.clear();
        let h = OptionHeader { option: OPT_GO, data_len_bytes: 3 };
        assert_eq!(n.handle_option(h, &[0, 0, 9], &mut out), OptionOutcome::Continue);
        assert_eq!(be_u32(&out, 12), Some(REP_ERR_INVALID));
    }

    #[test]
    fn export_name_unknown_closes() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let h = OptionHeader { option: OPT_EXPORT_NAME, data_len_bytes: 1 };
        assert_eq!(
            n.handle_option(h, b"x", &mut Vec::new()),
            OptionOutcome::Close(ProtocolError::UnknownExport)
        );
    }

    #[test]
    fn request_errors_are_the_specs() {
        let s = negotiated_session(false);
        let cases = [
            (header(CMD_READ, 0, 1 << 20, 512), NBD_EINVAL),
            (header(CMD_WRITE, 0, 1 << 20, 512), NBD_ENOSPC),
            (header(CMD_WRITE_ZEROES, 0, u64::MAX - 511, 512), NBD_ENOSPC),
            (header(CMD_READ, 0, 1, 512), NBD_EINVAL),
            (header(CMD_READ, 0, 0, 100), NBD_EINVAL),
            (header(CMD_READ, 0, 0, (1 << 16) + 512), NBD_EOVERFLOW),
            (header(CMD_READ, CMD_FLAG_DF, 0, 512), NBD_EINVAL),
            (header(CMD_FLUSH, 0, 0, 512), NBD_EINVAL),
            (header(99, 0, 0, 0), NBD_EINVAL),
            (header(CMD_BLOCK_STATUS, 0, 0, 512), NBD_EINVAL),
            (header(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512), NBD_EINVAL),
        ];
        for (h, want) in cases {
            assert_eq!(s.validate(&h).map_err(|e| e.nbd_error), Err(want), "{h:?}");
        }
        assert_eq!(
            s.validate(&header(CMD_TRIM, CMD_FLAG_FUA, 0, 1 << 20)),
            Ok(Request::Trim { offset_bytes: 0, len_bytes: 1 << 20, fua: true })
        );
    }

    #[test]
    fn structured_error_chunk_layout() {
        let mut out = Vec::new();
        encode_error(&mut out, true, 9, NBD_EIO, "boom");
        assert_eq!(be_u32(&out, 0), Some(STRUCTURED_REPLY_MAGIC));
        assert_eq!(be_u16(&out, 6), Some(REPLY_TYPE_ERROR));
        assert_eq!(be_u32(&out, 16), Some(10));
        assert_eq!(be_u32(&out, 20), Some(NBD_EIO));
        assert_eq!(&out[26..], b"boom");
    }

    // ----- the handshake, option by option, against the spec (doc/proto.md of NBD) -----

    /// Option replies in `out`: (option, reply type, data) each, checking every magic.
    fn option_replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut replies = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let magic = u64::from_be_bytes(out[at..at + 8].try_into().expect("8 bytes"));
            assert_eq!(magic, OPTION_REPLY_MAGIC, "reply {} at byte {at}", replies.len());
            let option = be_u32(out, at + 8).expect("option");
            let reply_type = be_u32(out, at + 12).expect("type");
            let len = be_u32(out, at + 16).expect("length") as usize;
            replies.push((option, reply_type, out[at + 20..at + 20 + len].to_vec()));
            at += 20 + len;
        }
        replies
    }

    fn option(n: &mut Negotiation<'_>, option: u32, data: &[u8]) -> (OptionOutcome, Vec<u8>) {
        let mut out = Vec::new();
        let h = OptionHeader { option, data_len_bytes: data.len() as u32 };
        (n.handle_option(h, data, &mut out), out)
    }

    /// The wire values, as the spec numbers them.
    #[test]
    fn wire_values_are_the_specs() {
        assert_eq!((FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES), (1, 2));
        assert_eq!((FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES), (1, 2));
        let transmission = [
            FLAG_HAS_FLAGS,
            FLAG_READ_ONLY,
            FLAG_SEND_FLUSH,
            FLAG_SEND_FUA,
            FLAG_ROTATIONAL,
            FLAG_SEND_TRIM,
            FLAG_SEND_WRITE_ZEROES,
            FLAG_SEND_DF,
            FLAG_CAN_MULTI_CONN,
        ];
        assert_eq!(transmission, [1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80, 0x100]);
        let command =
            [CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, CMD_FLAG_DF, CMD_FLAG_REQ_ONE, CMD_FLAG_FAST_ZERO];
        assert_eq!(command, [1, 2, 4, 8, 0x10]);
        assert_eq!(REPLY_FLAG_DONE, 1);
        assert_eq!(STRUCTURED_READ_HEADER_BYTES, 28, "chunk header, then the 64-bit offset");
    }

    /// The flags a session advertises: flush, FUA, trim and write-zeroes always, multi-conn
    /// where the export allows it, DF only with structured replies (it means nothing
    /// without them); never read-only or rotational.
    #[test]
    fn transmission_flags_are_exactly_the_supported_ones() {
        let always = FLAG_HAS_FLAGS
            + FLAG_SEND_FLUSH
            + FLAG_SEND_FUA
            + FLAG_SEND_TRIM
            + FLAG_SEND_WRITE_ZEROES;
        assert_eq!(always, 0x6d);
        let mut e = export();
        assert_eq!(e.transmission_flags(false), always + FLAG_CAN_MULTI_CONN);
        assert_eq!(e.transmission_flags(true), always + FLAG_CAN_MULTI_CONN + FLAG_SEND_DF);
        e.can_multi_conn = false;
        assert_eq!(e.transmission_flags(false), always);
        assert_eq!(e.transmission_flags(true), always + FLAG_SEND_DF);
    }

    /// Option data up to 16 KiB is handled; beyond it up to 1 MiB the option is answered
    /// `ERR_TOO_BIG` (the server reads past the data) and the haggling goes on, except for
    /// `EXPORT_NAME`, which has no error reply; beyond 1 MiB the connection closes.
    #[test]
    fn option_data_is_handled_to_16_kib_and_refused_to_1_mib() {
        let mut b = [0u8; OPTION_HEADER_BYTES];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&OPT_GO.to_be_bytes());
        for len in [16 * 1024u32, 16 * 1024 + 1, 1 << 20] {
            b[12..16].copy_from_slice(&len.to_be_bytes());
            let header = decode_option_header(&b).expect("decoded");
            assert_eq!(header, OptionHeader { option: OPT_GO, data_len_bytes: len });
            assert_eq!(header.is_oversized(), len > 16 * 1024);
        }
        b[12..16].copy_from_slice(&((1u32 << 20) + 1).to_be_bytes());
        assert_eq!(decode_option_header(&b), Err(ProtocolError::OptionTooLarge((1 << 20) + 1)));
        b[0] ^= 1;
        assert!(matches!(decode_option_header(&b), Err(ProtocolError::BadOptionMagic(_))));

        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let big = OptionHeader { option: OPT_SET_META_CONTEXT, data_len_bytes: 20_000 };
        let mut out = Vec::new();
        assert_eq!(n.handle_option(big, &[], &mut out), OptionOutcome::Continue);
        let replies = option_replies(&out);
        assert_eq!(replies.len(), 1);
        let (option, reply_type, message) = &replies[0];
        assert_eq!((*option, *reply_type), (OPT_SET_META_CONTEXT, REP_ERR_TOO_BIG));
        assert_eq!(
            String::from_utf8_lossy(message),
            "option data of 20000 bytes is larger than this server handles (16384)"
        );
        // The haggling goes on.
        let data = go(b"pm", &[INFO_BLOCK_SIZE]);
        let h = OptionHeader { option: OPT_GO, data_len_bytes: data.len() as u32 };
        assert!(matches!(
            n.handle_option(h, &data, &mut Vec::new()),
            OptionOutcome::Transmission(_)
        ));

        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let big = OptionHeader { option: OPT_EXPORT_NAME, data_len_bytes: 20_000 };
        let mut out = Vec::new();
        assert_eq!(
            n.handle_option(big, &[], &mut out),
            OptionOutcome::Close(ProtocolError::OptionTooLarge(20_000))
        );
        assert!(out.is_empty());
    }

    /// A client gets 256 options; the 257th closes the connection.
    #[test]
    fn the_257th_option_closes() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 3]).expect("valid flags");
        for i in 0..OPTIONS_PER_HANDSHAKE_MAX {
            let (outcome, _) = option(&mut n, OPT_STARTTLS, &[]);
            assert_eq!(outcome, OptionOutcome::Continue, "option {}", i + 1);
        }
        assert_eq!(OPTIONS_PER_HANDSHAKE_MAX, 256);
        let (outcome, out) = option(&mut n, OPT_LIST, &[]);
        assert_eq!(outcome, OptionOutcome::Close(ProtocolError::TooManyOptions));
        assert!(out.is_empty(), "no reply on a hard close");
    }

    /// ABORT is acknowledged, then the server closes; LIST names the one export, then
    /// ends the list, and refuses data; unknown options are unsupported, STARTTLS refused while
    /// TLS is off.
    #[test]
    fn abort_list_and_unsupported_options() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let (outcome, out) = option(&mut n, OPT_LIST, &[]);
        assert_eq!(outcome, OptionOutcome::Continue);
        let mut server = 2u32.to_be_bytes().to_vec();
        server.extend_from_slice(b"pm");
        assert_eq!(
            option_replies(&out),
            [(OPT_LIST, REP_SERVER, server), (OPT_LIST, REP_ACK, Vec::new())]
        );
        let (outcome, out) = option(&mut n, OPT_LIST, b"x");
        assert_eq!(outcome, OptionOutcome::Continue);
        assert_eq!(
            option_replies(&out)[..1].iter().map(|r| r.1).collect::<Vec<_>>(),
            [REP_ERR_INVALID]
        );
        let (outcome, out) = option(&mut n, 4, &[]);
        assert_eq!(outcome, OptionOutcome::Continue);
        assert_eq!(option_replies(&out)[0].1, REP_ERR_UNSUP);
        let (outcome, out) = option(&mut n, OPT_STARTTLS, &[]);
        assert_eq!(outcome, OptionOutcome::Continue);
        assert_eq!(option_replies(&out)[0].1, REP_ERR_POLICY, "TLS is off by default");
        let (outcome, out) = option(&mut n, OPT_ABORT, &[]);
        assert_eq!(outcome, OptionOutcome::Abort);
        assert_eq!(option_replies(&out), [(OPT_ABORT, REP_ACK, Vec::new())]);
    }

    /// Meta context data: name length, name, query count, queries (length, string), with
    /// every string at most 4096 bytes and nothing after.
    fn meta(name: &[u8], queries: &[&[u8]]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q);
        }
        d
    }

    /// LIST/SET_META_CONTEXT need structured replies first, and well-formed data naming the
    /// export; then `base:allocation` is listed for no query or `base:`, selected only when a
    /// SET names it, and the session serves block status only if the last SET selected it.
    #[test]
    fn meta_context_options() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let good = meta(b"pm", &[b"base:"]);
        for opt in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
            let (_, out) = option(&mut n, opt, &good);
            assert_eq!(option_replies(&out)[0].1, REP_ERR_INVALID, "before structured replies");
        }
        let (_, out) = option(&mut n, OPT_STRUCTURED_REPLY, b"x");
        assert_eq!(option_replies(&out)[0].1, REP_ERR_INVALID, "structured reply with data");
        let (_, out) = option(&mut n, OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(option_replies(&out), [(OPT_STRUCTURED_REPLY, REP_ACK, Vec::new())]);
        let long = vec![b'q'; STRING_BYTES_MAX];
        let too_long = vec![b'q'; STRING_BYTES_MAX + 1];
        let mut trailing = good.clone();
        trailing.push(0);
        let base = META_BASE_ALLOCATION.as_bytes();
        let listed = |id: u32| {
            let mut d = id.to_be_bytes().to_vec();
            d.extend_from_slice(base);
            d
        };
        // (data, LIST's replies, SET's replies); an empty reply list means ACK alone.
        let ack = |opt| vec![(opt, REP_ACK, Vec::new())];
        let context =
            |opt, id| vec![(opt, REP_META_CONTEXT, listed(id)), (opt, REP_ACK, Vec::new())];
        let (list, set) = (OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT);
        let error = |opt, ty| vec![(opt, ty)];
        type Replies = Vec<(u32, u32, Vec<u8>)>;
        let cases: [(Vec<u8>, Replies, Replies); 4] = [
            (good.clone(), context(list, 0), ack(set)),
            (meta(b"", &[]), context(list, 0), ack(set)),
            (meta(b"pm", &[b"x-y:z", base]), context(list, 0), context(set, 1)),
            (meta(b"pm", &[b"base:allocations"]), ack(list), ack(set)),
        ];
        for (i, (data, want_list, want_set)) in cases.iter().enumerate() {
            let (_, out) = option(&mut n, list, data);
            assert_eq!(&option_replies(&out), want_list, "case {i}, list");
            let (_, out) = option(&mut n, set, data);
            assert_eq!(&option_replies(&out), want_set, "case {i}, set");
        }
        let bad: [(Vec<u8>, u32); 5] = [
            (meta(&long, &[&long]), REP_ERR_UNKNOWN),
            (meta(&too_long, &[]), REP_ERR_INVALID),
            (meta(b"pm", &[&too_long]), REP_ERR_INVALID),
            (trailing, REP_ERR_INVALID),
            (good[..good.len() - 1].to_vec(), REP_ERR_INVALID),
        ];
        for (i, (data, ty)) in bad.iter().enumerate() {
            for opt in [list, set] {
                let (outcome, out) = option(&mut n, opt, data);
                assert_eq!(outcome, OptionOutcome::Continue);
                let got: Vec<(u32, u32)> =
                    option_replies(&out).into_iter().map(|r| (r.0, r.1)).collect();
                assert_eq!(got, error(opt, *ty), "bad case {i}");
            }
        }
        // The last SET (an unknown export) selected nothing: block status is refused.
        let data = go(b"pm", &[INFO_BLOCK_SIZE]);
        let h = OptionHeader { option: OPT_GO, data_len_bytes: data.len() as u32 };
        let OptionOutcome::Transmission(session) = n.handle_option(h, &data, &mut Vec::new())
        else {
            panic!("no transmission")
        };
        assert!(!session.base_allocation);
    }

    /// A SET selecting `base:allocation` lets block status through validation: flags FUA
    /// and REQ_ONE only, a non-empty range inside the export.
    #[test]
    fn block_status_is_validated_once_selected() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 1]).expect("valid flags");
        let mut out = Vec::new();
        let h = OptionHeader { option: OPT_STRUCTURED_REPLY, data_len_bytes: 0 };
        n.handle_option(h, &[], &mut out);
        let data = meta(b"pm", &[META_BASE_ALLOCATION.as_bytes()]);
        let h = OptionHeader { option: OPT_SET_META_CONTEXT, data_len_bytes: data.len() as u32 };
        n.handle_option(h, &data, &mut out);
        let data = go(b"pm", &[INFO_BLOCK_SIZE]);
        let h = OptionHeader { option: OPT_GO, data_len_bytes: data.len() as u32 };
        let OptionOutcome::Transmission(session) = n.handle_option(h, &data, &mut out) else {
            panic!("no transmission")
        };
        assert!(session.base_allocation);
        let bs = |flags, offset_bytes, len_bytes| RequestHeader {
            flags,
            command: CMD_BLOCK_STATUS,
            cookie: 1,
            offset_bytes,
            len_bytes,
        };
        assert_eq!(
            session.validate(&bs(CMD_FLAG_REQ_ONE, 0, 4096)),
            Ok(Request::BlockStatus { offset_bytes: 0, len_bytes: 4096, req_one: true })
        );
        for bad in [bs(CMD_FLAG_NO_HOLE, 0, 4096), bs(0, 0, 0), bs(0, e.size_bytes, 4096)] {
            assert_eq!(session.validate(&bad).map_err(|r| r.nbd_error), Err(NBD_EINVAL), "{bad:?}");
        }
        let mut plain = session;
        plain.base_allocation = false;
        assert!(plain.validate(&bs(0, 0, 4096)).is_err(), "not selected");
    }

    /// EXPORT_NAME enters transmission with the size and flags, then 124 zero bytes unless
    /// the client asked for none; the empty name is the default export; a name up to the
    /// spec's 4096 bytes is compared, a longer one closes the connection.
    #[test]
    fn export_name_enters_transmission() {
        let e = export();
        for (client_flags, zeroes) in [([0, 0, 0, 1], 124), ([0, 0, 0, 3], 0)] {
            for name in [&b"pm"[..], b""] {
                let mut n = Negotiation::new(&e, client_flags).expect("valid flags");
                let (outcome, out) = option(&mut n, OPT_EXPORT_NAME, name);
                let OptionOutcome::Transmission(session) = outcome else {
                    panic!("{name:?}: {outcome:?}")
                };
                assert!(!session.structured_replies && !session.block_sizes_agreed);
                assert_eq!(out.len(), 8 + 2 + zeroes, "{client_flags:?}");
                assert_eq!(u64::from_be_bytes(out[..8].try_into().expect("8")), 1 << 20);
                assert_eq!(be_u16(&out, 8), Some(e.transmission_flags(false)));
                assert!(out[10..].iter().all(|&b| b == 0));
            }
        }
        let mut long = export();
        long.name = "n".repeat(STRING_BYTES_MAX);
        let mut n = Negotiation::new(&long, [0, 0, 0, 3]).expect("valid flags");
        let (outcome, _) = option(&mut n, OPT_EXPORT_NAME, long.name.as_bytes());
        assert!(matches!(outcome, OptionOutcome::Transmission(_)), "{outcome:?}");
        long.name.push('n');
        let mut n = Negotiation::new(&long, [0, 0, 0, 3]).expect("valid flags");
        let (outcome, _) = option(&mut n, OPT_EXPORT_NAME, long.name.as_bytes());
        assert_eq!(outcome, OptionOutcome::Close(ProtocolError::UnknownExport));
    }

    /// INFO describes the export (size and flags, the name only when asked, block sizes
    /// always) and stays in negotiation; a name longer than the spec allows is invalid, one
    /// within it but unknown is unknown.
    #[test]
    fn info_describes_and_stays() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 3]).expect("valid flags");
        let types = |out: &[u8]| -> Vec<(u32, Option<u16>)> {
            option_replies(out)
                .iter()
                .map(|(_, t, d)| (*t, if *t == REP_INFO { be_u16(d, 0) } else { None }))
                .collect()
        };
        let (outcome, out) = option(&mut n, OPT_INFO, &go(b"pm", &[INFO_NAME]));
        assert_eq!(outcome, OptionOutcome::Continue);
        assert_eq!(
            types(&out),
            [
                (REP_INFO, Some(INFO_EXPORT)),
                (REP_INFO, Some(INFO_NAME)),
                (REP_INFO, Some(INFO_BLOCK_SIZE)),
                (REP_ACK, None)
            ]
        );
        assert_eq!(&option_replies(&out)[1].2[2..], b"pm");
        let (_, out) = option(&mut n, OPT_INFO, &go(b"pm", &[INFO_DESCRIPTION]));
        assert_eq!(
            types(&out),
            [(REP_INFO, Some(INFO_EXPORT)), (REP_INFO, Some(INFO_BLOCK_SIZE)), (REP_ACK, None)]
        );
        let block = &option_replies(&out)[1].2;
        assert_eq!(
            (be_u32(block, 2), be_u32(block, 6), be_u32(block, 10)),
            (Some(512), Some(4096), Some(1 << 16))
        );
        let (_, out) = option(&mut n, OPT_INFO, &go(&vec![b'x'; STRING_BYTES_MAX], &[]));
        assert_eq!(types(&out), [(REP_ERR_UNKNOWN, None)]);
        let (_, out) = option(&mut n, OPT_INFO, &go(&vec![b'x'; STRING_BYTES_MAX + 1], &[]));
        assert_eq!(types(&out)[0].0, REP_ERR_INVALID);
    }

    /// FUA is read from the request's own flags.
    #[test]
    fn fua_comes_from_the_request() {
        let s = negotiated_session(false);
        for (flags, fua) in [(0, false), (CMD_FLAG_FUA, true)] {
            assert_eq!(
                s.validate(&header(CMD_WRITE, flags, 0, 512)),
                Ok(Request::Write { offset_bytes: 0, len_bytes: 512, fua })
            );
        }
    }

    /// Flush takes no range and only FUA; write-zeroes may punch a hole unless NO_HOLE says
    /// not to.
    #[test]
    fn flush_and_write_zeroes_requests() {
        let s = negotiated_session(false);
        assert_eq!(s.validate(&header(CMD_FLUSH, 0, 0, 0)), Ok(Request::Flush));
        assert_eq!(s.validate(&header(CMD_FLUSH, CMD_FLAG_FUA, 0, 0)), Ok(Request::Flush));
        assert_eq!(
            s.validate(&header(CMD_FLUSH, CMD_FLAG_NO_HOLE, 0, 0)).map_err(|e| e.nbd_error),
            Err(NBD_EINVAL)
        );
        for (flags, may_trim, fua) in [
            (0, true, false),
            (CMD_FLAG_NO_HOLE, false, false),
            (CMD_FLAG_FUA, true, true),
            (CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, false, true),
        ] {
            assert_eq!(
                s.validate(&header(CMD_WRITE_ZEROES, flags, 512, 1024)),
                Ok(Request::WriteZeroes { offset_bytes: 512, len_bytes: 1024, fua, may_trim }),
                "flags {flags:#x}"
            );
        }
    }

    /// Errnos map to the errors the spec lets a server send; anything else is EIO.
    #[test]
    fn errnos_map_to_the_specs_errors() {
        let cases = [
            (libc::EPERM, NBD_EPERM),
            (libc::EROFS, NBD_EPERM),
            (libc::EACCES, NBD_EPERM),
            (libc::EIO, NBD_EIO),
            (libc::ENOMEM, NBD_ENOMEM),
            (libc::EINVAL, NBD_EINVAL),
            (libc::ENOSPC, NBD_ENOSPC),
            (libc::EDQUOT, NBD_ENOSPC),
            (libc::EFBIG, NBD_ENOSPC),
            (libc::EOVERFLOW, NBD_EOVERFLOW),
            (libc::ENOTSUP, NBD_ENOTSUP),
            (libc::ESHUTDOWN, NBD_ESHUTDOWN),
            (libc::EBADF, NBD_EIO),
            (libc::ENOENT, NBD_EIO),
        ];
        for (errno, nbd) in cases {
            assert_eq!(nbd_error_from_errno(errno), nbd, "errno {errno}");
        }
        // The spec's numbers.
        let numbers = [
            NBD_EPERM,
            NBD_EIO,
            NBD_ENOMEM,
            NBD_EINVAL,
            NBD_ENOSPC,
            NBD_EOVERFLOW,
            NBD_ENOTSUP,
            NBD_ESHUTDOWN,
        ];
        assert_eq!(numbers, [1, 5, 12, 22, 28, 75, 95, 108]);
    }

    /// A structured error's message is cut to 256 bytes, at a character boundary.
    #[test]
    fn a_long_error_message_is_cut_at_a_character_boundary() {
        // 255 ASCII bytes, then a 2-byte character across the 256-byte limit.
        let message = format!("{}é and more", "a".repeat(255));
        let mut out = Vec::new();
        encode_error(&mut out, true, 3, NBD_EIO, &message);
        assert_eq!(be_u16(&out, 24), Some(255), "message length");
        assert_eq!(be_u32(&out, 16), Some(6 + 255), "chunk length");
        assert_eq!(&out[26..], "a".repeat(255).as_bytes());
        let mut out = Vec::new();
        encode_error(&mut out, true, 3, NBD_EIO, &"b".repeat(300));
        assert_eq!(be_u16(&out, 24), Some(256));
        let mut out = Vec::new();
        encode_error(&mut out, false, 3, NBD_EIO, "ignored");
        assert_eq!(out.len(), SIMPLE_REPLY_BYTES, "a simple reply carries no message");
        assert_eq!(be_u32(&out, 4), Some(NBD_EIO));
    }
}
