//! Unit tests of the codec: the handshake option by option, request validation, reply bytes.

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
    let always =
        FLAG_HAS_FLAGS + FLAG_SEND_FLUSH + FLAG_SEND_FUA + FLAG_SEND_TRIM + FLAG_SEND_WRITE_ZEROES;
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
    assert!(matches!(n.handle_option(h, &data, &mut Vec::new()), OptionOutcome::Transmission(_)));

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
    let context = |opt, id| vec![(opt, REP_META_CONTEXT, listed(id)), (opt, REP_ACK, Vec::new())];
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
    let OptionOutcome::Transmission(session) = n.handle_option(h, &data, &mut Vec::new()) else {
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

/// A negotiation of several exports: LIST names each in order; GO and EXPORT_NAME pick one
/// by name (the empty name the first), its size in the session; an unknown name is refused;
/// the `base:allocation` a SET selected for one export is not served on another.
#[test]
fn several_exports_are_listed_and_picked_by_name() {
    let small = ExportInfo { name: "small".into(), size_bytes: 1 << 20, ..export() };
    let large = ExportInfo { name: "large".into(), size_bytes: 8 << 20, ..export() };
    let exports = [small, large];
    let mut n = Negotiation::with_exports(&exports, [0, 0, 0, 3]).expect("valid flags");
    let (_, out) = option(&mut n, OPT_LIST, &[]);
    let named = |name: &[u8]| {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d
    };
    assert_eq!(
        option_replies(&out),
        [
            (OPT_LIST, REP_SERVER, named(b"small")),
            (OPT_LIST, REP_SERVER, named(b"large")),
            (OPT_LIST, REP_ACK, Vec::new())
        ]
    );
    let (outcome, out) = option(&mut n, OPT_GO, &go(b"other", &[INFO_BLOCK_SIZE]));
    assert_eq!(outcome, OptionOutcome::Continue);
    assert_eq!(option_replies(&out)[0].1, REP_ERR_UNKNOWN);
    let (_, _) = option(&mut n, OPT_STRUCTURED_REPLY, &[]);
    let (_, out) = option(&mut n, OPT_SET_META_CONTEXT, &meta(b"small", &[b"base:allocation"]));
    assert_eq!(option_replies(&out).last().map(|r| r.1), Some(REP_ACK));
    match option(&mut n, OPT_GO, &go(b"large", &[INFO_BLOCK_SIZE])).0 {
        OptionOutcome::Transmission(s) => {
            assert_eq!((s.export, s.size_bytes), (1, 8 << 20));
            assert!(!s.base_allocation, "selected for another export");
        }
        other => panic!("GO large: {other:?}"),
    }
    let mut n = Negotiation::with_exports(&exports, [0, 0, 0, 3]).expect("valid flags");
    let (_, _) = option(&mut n, OPT_STRUCTURED_REPLY, &[]);
    let (_, _) = option(&mut n, OPT_SET_META_CONTEXT, &meta(b"large", &[b"base:allocation"]));
    match option(&mut n, OPT_GO, &go(b"large", &[INFO_BLOCK_SIZE])).0 {
        OptionOutcome::Transmission(s) => assert!(s.export == 1 && s.base_allocation),
        other => panic!("GO large: {other:?}"),
    }
    let mut n = Negotiation::with_exports(&exports, [0, 0, 0, 3]).expect("valid flags");
    match option(&mut n, OPT_EXPORT_NAME, b"").0 {
        OptionOutcome::Transmission(s) => assert_eq!((s.export, s.size_bytes), (0, 1 << 20)),
        other => panic!("EXPORT_NAME of the empty name: {other:?}"),
    }
    let mut n = Negotiation::with_exports(&exports, [0, 0, 0, 3]).expect("valid flags");
    assert_eq!(
        option(&mut n, OPT_EXPORT_NAME, b"nope").0,
        OptionOutcome::Close(ProtocolError::UnknownExport)
    );
}
