//! Transmission: request headers, their validation against the negotiated [`Session`], and
//! reply encoding (simple replies and structured chunks).

use super::*;

/// What was agreed in the handshake; validates transmission requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    /// The export the client picked: its index among those the negotiation offered.
    pub export: usize,
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

pub(super) fn refuse(nbd_error: u32, reason: &'static str) -> RequestError {
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

pub(super) fn check_flags(h: &RequestHeader, allowed: u16) -> Result<(), RequestError> {
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
