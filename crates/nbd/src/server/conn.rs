//! The per-connection protocol: the handshake (with STARTTLS), then transmission — requests
//! decoded from the read buffer, batches of buffered writes and reads handed to the export
//! together. Replies go out as each request is answered: a read the export leaves in flight
//! (a cache miss) is answered when it completes, after the requests behind it if they were
//! answered first (the client matches replies to requests by their cookies).

use super::wire::{Wire, is_eof};
use super::*;

/// Serves one client connection over `transport`: handshake, then requests until the client
/// disconnects or the read side is shut down. On leaving transmission, flushes the export.
///
/// This is the whole per-connection protocol, independent of sockets, so it can be driven
/// by in-memory streams (the fuzz target does).
pub fn serve_connection<E: Export, T: Transport>(
    transport: T,
    export: &E,
    info: &ExportInfo,
) -> Result<ConnEnd, ConnError> {
    serve_connection_tls(transport, export, info, &ConnTls::Off)
}

/// [`serve_connection`] with TLS as `tls` offers it: after an acknowledged
/// `NBD_OPT_STARTTLS`, the rest of the connection is served over TLS on `transport`.
pub fn serve_connection_tls<E: Export, T: Transport>(
    transport: T,
    export: &E,
    info: &ExportInfo,
    tls: &ConnTls,
) -> Result<ConnEnd, ConnError> {
    serve_connection_to(transport, std::slice::from_ref(info), tls, |_| Some(export))
}

/// [`serve_connection_tls`] offering several exports, described by `infos`: when the client
/// picks the `i`-th, `pick(i)` gives the export to serve, or `None` if it is no longer served
/// (the client is refused with `ERR_SHUTDOWN`, as when a connection cannot be opened).
pub(super) fn serve_connection_to<'e, E: Export, T: Transport>(
    transport: T,
    infos: &[ExportInfo],
    tls: &ConnTls,
    pick: impl FnMut(usize) -> Option<&'e E>,
) -> Result<ConnEnd, ConnError> {
    let mut wire = Wire::new(MaybeTls::Plain(transport), READ_BUFFER_BYTES);
    let (session, mut conn) = match handshake(&mut wire, infos, pick, tls) {
        Ok(Some(opened)) => opened,
        Ok(None) => return Ok(ConnEnd::Aborted),
        Err(ConnError::Io(e)) if is_eof(&e) => return Ok(ConnEnd::Closed),
        Err(e) => return Err(e),
    };
    wire.t.end_handshake()?;
    let max_payload = session.max_payload_bytes as usize;
    // A read batch's data is at most `max_payload` (see `READ_BATCH_BYTES_MAX`), each of its
    // replies with its header.
    let headers = READ_BATCH_MAX * STRUCTURED_READ_HEADER_BYTES;
    wire.out = Vec::with_capacity(max_payload + OUT_FLUSH_BYTES + headers);
    let mut payload = vec![0u8; max_payload];
    let result = transmission(&mut wire, &session, &mut conn, &mut payload);
    let flushed = wire.flush();
    if let Err(e) = conn.flush() {
        warn!(error = %e, "export flush at end of connection failed");
    }
    match result {
        Ok(end) => {
            flushed.map(|()| end).or_else(|e| if is_eof(&e) { Ok(end) } else { Err(e.into()) })
        }
        Err(ConnError::Io(e)) if is_eof(&e) => Ok(ConnEnd::Closed),
        Err(e) => Err(e),
    }
}

/// Runs option haggling; `None` means the client aborted. The export's connection is opened
/// before the option that starts transmission is acknowledged: if it cannot be (no engine
/// lane free, the cache shutting down), a GO gets `ERR_SHUTDOWN` with the reason and the
/// haggling goes on, instead of an acknowledged GO followed by a dropped connection.
pub(super) fn handshake<'e, T: Transport, E: Export>(
    wire: &mut Wire<MaybeTls<T>>,
    infos: &[ExportInfo],
    mut pick: impl FnMut(usize) -> Option<&'e E>,
    tls: &ConnTls,
) -> Result<Option<(Session, E::Conn<'e>)>, ConnError> {
    wire.out.extend_from_slice(&codec::greeting());
    wire.flush()?;
    let mut flags = [0u8; CLIENT_FLAGS_BYTES];
    wire.read_exact(&mut flags)?;
    let mut negotiation = Negotiation::with_exports(infos, flags)?.with_tls(tls.mode());
    let mut data = vec![0u8; OPTION_DATA_BYTES_MAX as usize];
    loop {
        let mut hb = [0u8; OPTION_HEADER_BYTES];
        wire.read_exact(&mut hb)?;
        let header = codec::decode_option_header(&hb)?;
        // Oversized data is read past (bounded by `OPTION_DISCARD_BYTES_MAX` and the handshake
        // deadline) and the option refused; the rest is read in full.
        let data = if header.is_oversized() {
            if header.option != codec::OPT_EXPORT_NAME {
                wire.discard(u64::from(header.data_len_bytes))?;
            }
            &mut data[..0]
        } else {
            let data = &mut data[..header.data_len_bytes as usize];
            wire.read_exact(data)?;
            data
        };
        let mark = wire.out.len();
        // What ends the haggling, once the replies made so far are sent.
        let done = match negotiation.handle_option(header, data, &mut wire.out) {
            OptionOutcome::Continue => None,
            OptionOutcome::Abort => Some(Ok(None)),
            OptionOutcome::Close(e) => Some(Err(e.into())),
            OptionOutcome::StartTls => {
                // The ACK goes out in clear; the client must wait for it before its
                // ClientHello, so nothing may be buffered past it.
                wire.flush()?;
                match wire.buffered() {
                    0 => {
                        wire.t.start_tls(tls)?;
                        // The TLS handshake's records were a batch of their own.
                        wire.t.end_replies()?;
                    }
                    n => return Err(TlsError::BytesBeforeHandshake(n).into()),
                }
                None
            }
            OptionOutcome::Transmission(s) => {
                // The connection, or why it cannot be served: the error that closes an
                // `EXPORT_NAME`, and the reason an `ERR_SHUTDOWN` reply gives.
                let opened = match pick(s.export) {
                    Some(export) => export.open_conn().map_err(|e| {
                        let reason = format!("the server cannot serve this connection now: {e}");
                        (ConnError::from(e), reason)
                    }),
                    None => {
                        let name = &infos[s.export].name;
                        let reason = format!("export {name:?} is no longer served (detached)");
                        Err((io::Error::other(reason.clone()).into(), reason))
                    }
                };
                match opened {
                    Ok(conn) => Some(Ok(Some((s, conn)))),
                    // `EXPORT_NAME` has no error reply: the connection closes.
                    Err((e, _)) if header.option == codec::OPT_EXPORT_NAME => return Err(e),
                    Err((_, reason)) => {
                        warn!(reason, "cannot serve a connection to the export");
                        wire.out.truncate(mark);
                        let (out, option) = (&mut wire.out, header.option);
                        codec::error_reply(out, option, codec::REP_ERR_SHUTDOWN, &reason);
                        None
                    }
                }
            }
        };
        wire.flush()?;
        if let Some(done) = done {
            return done;
        }
    }
}

pub(super) fn transmission<T: Transport, C: BlockConn>(
    wire: &mut Wire<T>,
    session: &Session,
    conn: &mut C,
    payload: &mut [u8],
) -> Result<ConnEnd, ConnError> {
    let structured = session.structured_replies;
    let mut queued = Vec::with_capacity(WRITE_BATCH_MAX);
    let mut queued_reads = Vec::with_capacity(READ_BATCH_MAX);
    let mut started = Vec::with_capacity(WRITE_BATCH_MAX.max(READ_BATCH_MAX));
    let mut extents = Vec::with_capacity(BLOCK_STATUS_EXTENTS_MAX);
    let mut errors = ErrorLog::default();
    let mut in_flight = InFlight::new(conn.pending_max(), structured);
    loop {
        if wire.buffered() < REQUEST_HEADER_BYTES {
            wait_for_client(wire, conn, &mut in_flight, &mut errors)?;
            wire.flush()?;
        }
        let mut hb = [0u8; REQUEST_HEADER_BYTES];
        if let Err(e) = wire.read_exact(&mut hb) {
            return if is_eof(&e) { Ok(ConnEnd::Closed) } else { Err(e.into()) };
        }
        let h = codec::decode_request_header(&hb)?;
        let cookie = h.cookie;
        let request = match session.validate(&h) {
            Ok(r) => r,
            Err(refused) => {
                let payload_len = u64::from(h.payload_len_bytes());
                if (wire.buffered() as u64) < payload_len {
                    // The rest of the payload may be slow to come: answer what is answered.
                    wire.flush()?;
                }
                wire.discard(payload_len)?;
                debug!(?h, %refused, "request refused");
                wire.make_room(STRUCTURED_READ_HEADER_BYTES + codec::ERROR_MESSAGE_BYTES_MAX)?;
                // Reads and block status are answered with chunks, their errors too.
                let structured_read =
                    structured && matches!(h.command, codec::CMD_READ | codec::CMD_BLOCK_STATUS);
                codec::encode_error(
                    &mut wire.out,
                    structured_read,
                    cookie,
                    refused.nbd_error,
                    refused.reason,
                );
                continue;
            }
        };
        let result = match request {
            Request::Read { offset_bytes, len_bytes } if len_bytes > 0 => {
                let first = QueuedRead {
                    cookie,
                    offset_bytes,
                    len: len_bytes as usize,
                    reply_at: 0,
                    data_at: 0,
                };
                let batch = ReadBatch {
                    queued: &mut queued_reads,
                    started: &mut started,
                    in_flight: &mut in_flight,
                    errors: &mut errors,
                };
                read_buffered_batch(wire, session, conn, first, batch)?;
                continue;
            }
            Request::Read { offset_bytes, len_bytes } => {
                wire.make_room(STRUCTURED_READ_HEADER_BYTES)?;
                codec::encode_read_ok(&mut wire.out, structured, cookie, offset_bytes, len_bytes);
                continue;
            }
            Request::Write { offset_bytes, len_bytes, fua }
                if len_bytes > 0 && wire.buffered() >= len_bytes as usize =>
            {
                let first = QueuedWrite {
                    cookie,
                    offset_bytes,
                    start: wire.rpos,
                    len: len_bytes as usize,
                    fua,
                };
                let batch = WriteBatch {
                    queued: &mut queued,
                    started: &mut started,
                    in_flight: &mut in_flight,
                    errors: &mut errors,
                };
                write_buffered_batch(wire, session, conn, first, batch)?;
                continue;
            }
            Request::Write { offset_bytes, len_bytes, fua } => {
                if wire.buffered() < len_bytes as usize {
                    // Replies already made (a FLUSH's, say) go out before this thread waits for
                    // the rest of a payload, which the client may send only after them.
                    wire.flush()?;
                }
                let data = &mut payload[..len_bytes as usize];
                wire.read_exact(data)?;
                if data.is_empty() {
                    Ok(())
                } else {
                    // Started like a batch's write: one going through to a slow store is
                    // answered when it completes, holding back nothing behind it.
                    started.clear();
                    conn.write_batch_start(&[BatchWrite { offset_bytes, data, fua }], &mut started);
                    assert_eq!(started.len(), 1, "the export gave one start per write");
                    match started.pop().expect("one start") {
                        Started::Done(outcome) => outcome,
                        Started::Pending(ticket) => {
                            let (command, len) = (codec::CMD_WRITE, len_bytes);
                            in_flight
                                .insert(ticket, Awaited { cookie, command, offset_bytes, len });
                            continue;
                        }
                    }
                }
            }
            Request::Flush => {
                // The writes in flight are answered first, and so covered by the flush.
                answer_in_flight(wire, conn, &mut in_flight, &mut errors)?;
                conn.flush()
            }
            Request::Trim { len_bytes: 0, .. } | Request::WriteZeroes { len_bytes: 0, .. } => {
                Ok(())
            }
            Request::Trim { offset_bytes, len_bytes, fua } => {
                conn.trim(offset_bytes, u64::from(len_bytes), fua)
            }
            Request::WriteZeroes { offset_bytes, len_bytes, fua, may_trim } => {
                conn.write_zeroes(offset_bytes, u64::from(len_bytes), fua, may_trim)
            }
            Request::BlockStatus { offset_bytes, len_bytes, req_one } => {
                let max = if req_one { 1 } else { BLOCK_STATUS_EXTENTS_MAX };
                match block_status(conn, offset_bytes, len_bytes, max, &mut extents) {
                    Ok(()) => {
                        wire.make_room(codec::STRUCTURED_HEADER_BYTES + 4 + 8 * extents.len())?;
                        let pairs = extents.iter().map(|e| (e.len_bytes, extent_flags(e)));
                        codec::encode_block_status(&mut wire.out, cookie, pairs);
                        continue;
                    }
                    Err(e) => {
                        errors.note(h.command, h.offset_bytes, h.len_bytes, &e);
                        reply(wire, cookie, true, Err(e))?;
                        continue;
                    }
                }
            }
            Request::Disconnect => {
                // Every request before it is answered first.
                answer_in_flight(wire, conn, &mut in_flight, &mut errors)?;
                return Ok(ConnEnd::Disconnected);
            }
        };
        if let Err(e) = &result {
            errors.note(h.command, h.offset_bytes, h.len_bytes, e);
        }
        let structured_read = structured && h.command == codec::CMD_READ;
        reply(wire, cookie, structured_read, result)?;
    }
}

/// Asks the export for the block status of a range and keeps its answer to the rules of the
/// reply: at most `extents_max` extents, none empty, together within the range; an answer with
/// none says the whole range is allocated data.
pub(super) fn block_status<C: BlockConn>(
    conn: &mut C,
    offset_bytes: u64,
    len_bytes: u32,
    extents_max: usize,
    extents: &mut Vec<BlockExtent>,
) -> Result<(), BlockError> {
    extents.clear();
    conn.block_status(offset_bytes, len_bytes, extents_max, extents)?;
    extents.retain(|e| e.len_bytes > 0);
    extents.truncate(extents_max);
    let mut left = len_bytes;
    let mut kept = 0;
    for e in extents.iter_mut() {
        if left == 0 {
            break;
        }
        e.len_bytes = e.len_bytes.min(left);
        left -= e.len_bytes;
        kept += 1;
    }
    extents.truncate(kept);
    if extents.is_empty() {
        extents.push(BlockExtent { len_bytes, hole: false, zero: false });
    }
    Ok(())
}

/// Export errors of one connection, logged at WARN so an operator sees a failing backing
/// store: the first of each second, with how many were not logged since the last one (a
/// failing device would otherwise write a line per request).
#[derive(Debug, Default)]
pub(super) struct ErrorLog {
    logged_at: Option<Instant>,
    unlogged: u64,
}

impl ErrorLog {
    fn note(&mut self, command: u16, offset_bytes: u64, len_bytes: u32, error: &BlockError) {
        let now = Instant::now();
        if self.logged_at.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
            self.unlogged += 1;
            return;
        }
        warn!(
            command = codec::command_name(command),
            offset_bytes,
            len_bytes,
            %error,
            unlogged_before = self.unlogged,
            "request failed in the export"
        );
        self.logged_at = Some(now);
        self.unlogged = 0;
    }
}

/// Queues the reply to a request that carries no data back (or a failed read).
pub(super) fn reply<T: Transport>(
    wire: &mut Wire<T>,
    cookie: u64,
    structured_read: bool,
    result: Result<(), BlockError>,
) -> io::Result<()> {
    wire.make_room(STRUCTURED_READ_HEADER_BYTES + codec::ERROR_MESSAGE_BYTES_MAX)?;
    match result {
        Ok(()) => codec::encode_simple_reply(&mut wire.out, cookie, 0),
        Err(e) => {
            let nbd_error = codec::nbd_error_from_errno(e.errno());
            codec::encode_error(&mut wire.out, structured_read, cookie, nbd_error, e.context());
        }
    }
    Ok(())
}

/// A write whose payload sits in the read buffer at `start..start + len`.
pub(super) struct QueuedWrite {
    cookie: u64,
    offset_bytes: u64,
    start: usize,
    len: usize,
    fua: bool,
}

/// What a write batch works with beside the wire, the session and the export.
pub(super) struct WriteBatch<'a> {
    pub(super) queued: &'a mut Vec<QueuedWrite>,
    pub(super) started: &'a mut Vec<Started>,
    pub(super) in_flight: &'a mut InFlight,
    pub(super) errors: &'a mut ErrorLog,
}

/// Serves `first` (a validated write whose payload is wholly buffered) together with the
/// valid, wholly buffered writes that follow it in the read buffer: one `write_batch_start`
/// call (payloads passed in place, no copy), then one reply per write answered, in order; a
/// write the export left in flight is answered when it completes. Anything else — another
/// command, an invalid or partial request — ends the batch and is left in the buffer for the
/// ordinary path.
pub(super) fn write_buffered_batch<T: Transport, C: BlockConn>(
    wire: &mut Wire<T>,
    session: &Session,
    conn: &mut C,
    first: QueuedWrite,
    batch: WriteBatch<'_>,
) -> io::Result<()> {
    let WriteBatch { queued, started, in_flight, errors } = batch;
    queued.clear();
    wire.rpos += first.len;
    queued.push(first);
    while queued.len() < WRITE_BATCH_MAX && wire.buffered() >= REQUEST_HEADER_BYTES {
        let mut hb = [0u8; REQUEST_HEADER_BYTES];
        hb.copy_from_slice(&wire.rbuf[wire.rpos..wire.rpos + REQUEST_HEADER_BYTES]);
        let Ok(h) = codec::decode_request_header(&hb) else { break };
        let Ok(Request::Write { offset_bytes, len_bytes, fua }) = session.validate(&h) else {
            break;
        };
        let len = len_bytes as usize;
        if len == 0 || wire.buffered() < REQUEST_HEADER_BYTES + len {
            break;
        }
        wire.rpos += REQUEST_HEADER_BYTES;
        queued.push(QueuedWrite { cookie: h.cookie, offset_bytes, start: wire.rpos, len, fua });
        wire.rpos += len;
    }
    started.clear();
    {
        let writes: Vec<BatchWrite<'_>> = queued
            .iter()
            .map(|q| BatchWrite {
                offset_bytes: q.offset_bytes,
                data: &wire.rbuf[q.start..q.start + q.len],
                fua: q.fua,
            })
            .collect();
        conn.write_batch_start(&writes, started);
    }
    assert_eq!(started.len(), queued.len(), "the export gave one start per write");
    for (q, start) in queued.iter().zip(started.drain(..)) {
        let (cookie, offset_bytes, len) = (q.cookie, q.offset_bytes, q.len as u32);
        match start {
            Started::Done(outcome) => {
                if let Err(e) = &outcome {
                    errors.note(codec::CMD_WRITE, offset_bytes, len, e);
                }
                reply(wire, cookie, false, outcome)?;
            }
            Started::Pending(ticket) => {
                let command = codec::CMD_WRITE;
                in_flight.insert(ticket, Awaited { cookie, command, offset_bytes, len });
            }
        }
    }
    Ok(())
}

/// A read of a batch, and where its reply is built in the output buffer.
pub(super) struct QueuedRead {
    cookie: u64,
    offset_bytes: u64,
    len: usize,
    /// Where its reply (header, then data) starts in the output buffer.
    reply_at: usize,
    /// Where its data starts in the output buffer.
    data_at: usize,
}

/// A request a connection's export has in flight: what its reply needs.
#[derive(Clone, Copy)]
pub(super) struct Awaited {
    cookie: u64,
    command: u16,
    offset_bytes: u64,
    len: u32,
}

/// The requests of a connection its export has in flight, by ticket.
pub(super) struct InFlight {
    by_ticket: Vec<Option<Awaited>>,
    structured: bool,
}

impl InFlight {
    fn new(tickets: usize, structured: bool) -> Self {
        Self { by_ticket: vec![None; tickets], structured }
    }

    fn insert(&mut self, ticket: usize, awaited: Awaited) {
        let entry = self
            .by_ticket
            .get_mut(ticket)
            .unwrap_or_else(|| panic!("the export gave ticket {ticket}, past its maximum"));
        assert!(entry.is_none(), "the export gave ticket {ticket} to two requests in flight");
        *entry = Some(awaited);
    }

    fn take(&mut self, ticket: usize) -> Awaited {
        self.by_ticket.get_mut(ticket).and_then(Option::take).unwrap_or_else(|| {
            panic!("the export completed ticket {ticket}, which is not in flight")
        })
    }
}

/// Answers every request in flight, sending what is answered already before it waits.
fn answer_in_flight<T: Transport, C: BlockConn>(
    wire: &mut Wire<T>,
    conn: &mut C,
    in_flight: &mut InFlight,
    errors: &mut ErrorLog,
) -> io::Result<()> {
    if conn.pending() > 0 {
        wire.flush()?;
    }
    while conn.pending() > 0 {
        let pending = conn.pending();
        deliver_completed(wire, conn, in_flight, errors, pending)?;
    }
    Ok(())
}

/// Appends the replies of the requests in flight that completed, waiting for at least `min`.
fn deliver_completed<T: Transport, C: BlockConn>(
    wire: &mut Wire<T>,
    conn: &mut C,
    in_flight: &mut InFlight,
    errors: &mut ErrorLog,
    min: usize,
) -> io::Result<()> {
    let mut written = Ok(());
    let structured = in_flight.structured;
    conn.complete(min, &mut |ticket, result| {
        let Awaited { cookie, command, offset_bytes, len } = in_flight.take(ticket);
        if written.is_err() {
            return;
        }
        let read = command == codec::CMD_READ;
        written = match result {
            Ok(data) if read => {
                assert_eq!(data.len(), len as usize, "the export answered a read's length");
                wire.make_room(STRUCTURED_READ_HEADER_BYTES + data.len()).map(|()| {
                    codec::encode_read_ok(&mut wire.out, structured, cookie, offset_bytes, len);
                    wire.out.extend_from_slice(data);
                })
            }
            Ok(data) => {
                assert!(data.is_empty(), "the export answered a write with data");
                reply(wire, cookie, false, Ok(()))
            }
            Err(e) => {
                errors.note(command, offset_bytes, len, &e);
                reply(wire, cookie, structured && read, Err(e))
            }
        };
    });
    written
}

/// Before the server waits for the client's next request: answers the reads in flight that
/// completed, and while some are still in flight, sends what is answered and waits for
/// whichever comes first, a completion or the client. An export without a completion
/// descriptor (or a transport without one to poll) has its reads completed before the wait.
fn wait_for_client<T: Transport, C: BlockConn>(
    wire: &mut Wire<T>,
    conn: &mut C,
    in_flight: &mut InFlight,
    errors: &mut ErrorLog,
) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags, poll};
    loop {
        deliver_completed(wire, conn, in_flight, errors, 0)?;
        if conn.pending() == 0 {
            return Ok(());
        }
        wire.flush()?;
        if wire.t.has_buffered_input() {
            return Ok(());
        }
        let (Some(completions), Some(client)) = (conn.completion_fd(), wire.t.poll_fd()) else {
            let pending = conn.pending();
            deliver_completed(wire, conn, in_flight, errors, pending)?;
            continue;
        };
        let mut fds = [
            PollFd::from_borrowed_fd(client, PollFlags::IN),
            PollFd::from_borrowed_fd(completions, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        if !fds[0].revents().is_empty() {
            // The client sent more (or hung up: the read says which).
            return Ok(());
        }
    }
}

/// What a read batch works with beside the wire, the session and the export.
pub(super) struct ReadBatch<'a> {
    pub(super) queued: &'a mut Vec<QueuedRead>,
    pub(super) started: &'a mut Vec<Started>,
    pub(super) in_flight: &'a mut InFlight,
    pub(super) errors: &'a mut ErrorLog,
}

/// Serves `first` (a validated, non-empty read) together with the valid, non-empty reads whose
/// headers follow it in the read buffer, up to [`READ_BATCH_MAX`] reads and a data budget of
/// [`READ_BATCH_BYTES_MAX`] or the maximum request size, whichever is smaller (`first` always
/// goes, however large): every reply is laid out in the output buffer, header then room for
/// the data, and one `read_batch_start` call fills the data in place (no copy, no
/// allocation). A read that fails gets an error reply in place of its own; a read the export
/// left in flight has its reply taken out, to be appended when it completes; the others keep
/// theirs, in request order. Anything else — another command, an invalid or partial request —
/// ends the batch and is left in the buffer for the ordinary path.
pub(super) fn read_buffered_batch<T: Transport, C: BlockConn>(
    wire: &mut Wire<T>,
    session: &Session,
    conn: &mut C,
    first: QueuedRead,
    batch: ReadBatch<'_>,
) -> io::Result<()> {
    let ReadBatch { queued, started, in_flight, errors } = batch;
    let structured = session.structured_replies;
    let budget = READ_BATCH_BYTES_MAX.min(session.max_payload_bytes as usize);
    queued.clear();
    let mut total = first.len;
    queued.push(first);
    while queued.len() < READ_BATCH_MAX && wire.buffered() >= REQUEST_HEADER_BYTES {
        let mut hb = [0u8; REQUEST_HEADER_BYTES];
        hb.copy_from_slice(&wire.rbuf[wire.rpos..wire.rpos + REQUEST_HEADER_BYTES]);
        let Ok(h) = codec::decode_request_header(&hb) else { break };
        let Ok(Request::Read { offset_bytes, len_bytes }) = session.validate(&h) else {
            break;
        };
        let len = len_bytes as usize;
        if len == 0 || total + len > budget {
            break;
        }
        wire.rpos += REQUEST_HEADER_BYTES;
        total += len;
        queued.push(QueuedRead { cookie: h.cookie, offset_bytes, len, reply_at: 0, data_at: 0 });
    }
    wire.make_room(total + queued.len() * STRUCTURED_READ_HEADER_BYTES)?;
    for q in queued.iter_mut() {
        q.reply_at = wire.out.len();
        codec::encode_read_ok(&mut wire.out, structured, q.cookie, q.offset_bytes, q.len as u32);
        q.data_at = wire.out.len();
        wire.out.resize(q.data_at + q.len, 0);
    }
    started.clear();
    {
        // The data of each reply, split off the output buffer in order.
        let mut reads: [BatchRead<'_>; READ_BATCH_MAX] =
            std::array::from_fn(|_| BatchRead::default());
        let mut rest = &mut wire.out[queued[0].reply_at..];
        let mut rest_at = queued[0].reply_at;
        for (q, r) in queued.iter().zip(reads.iter_mut()) {
            let (_, data) = std::mem::take(&mut rest).split_at_mut(q.data_at - rest_at);
            let (buf, after) = data.split_at_mut(q.len);
            *r = BatchRead { offset_bytes: q.offset_bytes, buf };
            rest = after;
            rest_at = q.data_at + q.len;
        }
        conn.read_batch_start(&mut reads[..queued.len()], started);
    }
    assert_eq!(started.len(), queued.len(), "the export gave one start per read");
    let Some(first_apart) = started.iter().position(|s| !matches!(s, Started::Done(Ok(())))) else {
        return Ok(());
    };
    // From the first read not answered with its data on, the replies are taken out and put
    // back one by one: a failed read's replaced by its error, a read in flight's left out
    // (only when one is: a copy of that tail).
    let cut = queued[first_apart].reply_at;
    let tail = wire.out.split_off(cut);
    for (q, s) in queued[first_apart..].iter().zip(started.drain(first_apart..)) {
        match s {
            Started::Done(Ok(())) => {
                let answer = &tail[q.reply_at - cut..q.data_at + q.len - cut];
                wire.make_room(answer.len())?;
                wire.out.extend_from_slice(answer);
            }
            Started::Done(Err(e)) => {
                errors.note(codec::CMD_READ, q.offset_bytes, q.len as u32, &e);
                reply(wire, q.cookie, structured, Err(e))?;
            }
            Started::Pending(ticket) => {
                let (cookie, offset_bytes, len) = (q.cookie, q.offset_bytes, q.len as u32);
                in_flight.insert(
                    ticket,
                    Awaited { cookie, command: codec::CMD_READ, offset_bytes, len },
                );
            }
        }
    }
    Ok(())
}
