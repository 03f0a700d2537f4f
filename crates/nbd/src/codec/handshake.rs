//! The handshake: the greeting, option headers and replies, and the option haggling
//! ([`Negotiation`], one call per option, STARTTLS and meta contexts included).

use super::*;

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

    pub(super) fn transmission_flags(&self, structured_replies: bool) -> u16 {
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
    exports: &'a [ExportInfo],
    no_zeroes: bool,
    structured_replies: bool,
    /// `base:allocation` was selected with `NBD_OPT_SET_META_CONTEXT`.
    base_allocation: bool,
    /// The export the last `NBD_OPT_SET_META_CONTEXT` named: what it selected applies to
    /// that export only.
    base_allocation_export: usize,
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
        Self::with_exports(std::slice::from_ref(export), client_flags)
    }

    /// A negotiation offering `exports` (at least one): the client picks one by name, the
    /// empty name picking the first; `NBD_OPT_LIST` lists them all.
    pub fn with_exports(
        exports: &'a [ExportInfo],
        client_flags: [u8; CLIENT_FLAGS_BYTES],
    ) -> Result<Self, ProtocolError> {
        assert!(!exports.is_empty(), "a negotiation offers an export at least");
        let flags = u32::from_be_bytes(client_flags);
        if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(ProtocolError::UnknownClientFlags(flags));
        }
        Ok(Self {
            exports,
            no_zeroes: flags & FLAG_C_NO_ZEROES != 0,
            structured_replies: false,
            base_allocation: false,
            base_allocation_export: 0,
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
                    for export in self.exports {
                        let name = export.name.as_bytes();
                        let name_len = u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes();
                        encode_option_reply(out, opt, REP_SERVER, &[&name_len, name]);
                    }
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
        let Some(export) = self.find(name) else {
            if set {
                self.base_allocation = false;
            }
            error_reply(out, opt, REP_ERR_UNKNOWN, "no such export");
            return;
        };
        let mut matched = !set && queries.iter().all(Option::is_none);
        for query in queries.iter().flatten() {
            matched |= *query == META_BASE_ALLOCATION.as_bytes() || (!set && *query == b"base:");
        }
        if set {
            self.base_allocation = matched;
            self.base_allocation_export = export;
        }
        if matched {
            let id = if set { META_BASE_ALLOCATION_ID } else { 0 };
            let name = META_BASE_ALLOCATION.as_bytes();
            encode_option_reply(out, opt, REP_META_CONTEXT, &[&id.to_be_bytes(), name]);
        }
        encode_option_reply(out, opt, REP_ACK, &[]);
    }

    /// The export a client's `name` picks: the one of that name, or the first for the empty
    /// name.
    fn find(&self, name: &[u8]) -> Option<usize> {
        self.exports.iter().position(|e| e.matches(name))
    }

    fn export_name(&self, data: &[u8], out: &mut Vec<u8>) -> OptionOutcome {
        let found = if data.len() > STRING_BYTES_MAX { None } else { self.find(data) };
        let Some(export) = found else {
            return OptionOutcome::Close(ProtocolError::UnknownExport);
        };
        let session = self.session(export, false);
        out.extend_from_slice(&self.exports[export].size_bytes.to_be_bytes());
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
        let Some(export) = self.find(name) else {
            error_reply(out, opt, REP_ERR_UNKNOWN, "no such export");
            return OptionOutcome::Continue;
        };
        let info = &self.exports[export];
        let requested =
            |ty: u16| requests.chunks_exact(2).any(|c| u16::from_be_bytes([c[0], c[1]]) == ty);
        let block_size_requested = requested(INFO_BLOCK_SIZE);
        // A client that asks for no block sizes keeps to 512-byte multiples and to reads and
        // writes of at most 32 MiB if it wants to interoperate (the spec's advice;
        // `nbd-client` sends a bare GO): an export whose limits allow that serves it, refusing
        // misaligned requests with EINVAL as it does after `NBD_OPT_EXPORT_NAME`. A larger
        // minimum, or a maximum below 32 MiB (and below the export's size, which bounds every
        // request anyway), must be agreed first.
        let sizes = &info.block_sizes;
        let payload_bound = u64::from(INTEROPERABLE_MAX_PAYLOAD_BYTES).min(info.size_bytes);
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
        let session = self.session(export, true);
        let mut export_info = [0u8; 12];
        export_info[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
        export_info[2..10].copy_from_slice(&info.size_bytes.to_be_bytes());
        export_info[10..12].copy_from_slice(&session.transmission_flags.to_be_bytes());
        encode_option_reply(out, opt, REP_INFO, &[&export_info]);
        if requested(INFO_NAME) {
            encode_option_reply(
                out,
                opt,
                REP_INFO,
                &[&INFO_NAME.to_be_bytes(), info.name.as_bytes()],
            );
        }
        let bs = info.block_sizes;
        let mut block_info = [0u8; 14];
        block_info[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        block_info[2..6].copy_from_slice(&bs.min_bytes.to_be_bytes());
        block_info[6..10].copy_from_slice(&bs.preferred_bytes.to_be_bytes());
        block_info[10..14].copy_from_slice(&bs.max_bytes.to_be_bytes());
        encode_option_reply(out, opt, REP_INFO, &[&block_info]);
        encode_option_reply(out, opt, REP_ACK, &[]);
        if opt == OPT_GO { OptionOutcome::Transmission(session) } else { OptionOutcome::Continue }
    }

    fn session(&self, export: usize, block_sizes_agreed: bool) -> Session {
        let info = &self.exports[export];
        let bs = info.block_sizes;
        Session {
            export,
            structured_replies: self.structured_replies,
            transmission_flags: info.transmission_flags(self.structured_replies),
            size_bytes: info.size_bytes,
            min_block_bytes: bs.min_bytes,
            max_payload_bytes: bs.max_bytes,
            block_sizes_agreed,
            base_allocation: self.base_allocation
                && self.base_allocation_export == export
                && self.structured_replies,
        }
    }
}

pub(crate) fn error_reply(out: &mut Vec<u8>, opt: u32, reply_type: u32, msg: &str) {
    encode_option_reply(out, opt, reply_type, &[msg.as_bytes()]);
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data: name length u32, name, count u16, count * info type u16.
pub(super) fn parse_info_request(data: &[u8]) -> Option<(&[u8], &[u8])> {
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
pub(super) const META_QUERIES_MAX: usize = 16;

/// The queries of a meta context option that are looked at.
pub(super) type MetaQueries<'a> = [Option<&'a [u8]>; META_QUERIES_MAX];

/// Meta context option data: name length u32, name, query count u32, queries (u32 len + str).
/// Returns the export name and the first [`META_QUERIES_MAX`] queries.
pub(super) fn parse_meta_context(data: &[u8]) -> Option<(&[u8], MetaQueries<'_>)> {
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
