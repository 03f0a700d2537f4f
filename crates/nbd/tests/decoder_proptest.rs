//! Property tests for the decoders (the CI stand-in for the cargo-fuzz smoke run):
//! random bytes never panic the codec or a whole connection, and random request sequences
//! after a valid handshake get exactly the replies a model of the spec predicts.

use pmcache_nbd::codec::*;
use pmcache_nbd::server::export_info;
use pmcache_nbd::{
    BlockSizes, ConnEnd, ConnTls, MemExport, ReplayTransport, TlsConfig, TlsMode, serve_connection,
    serve_connection_tls,
};
use proptest::prelude::*;

const SIZE: u64 = 1 << 20;
const MIN: u32 = 512;
const MAX_PAYLOAD: u32 = 64 * 1024;

fn mem() -> (MemExport, ExportInfo) {
    let bs = BlockSizes { min_bytes: MIN, preferred_bytes: 4096, max_bytes: 1 << 20 };
    let m = MemExport::new(SIZE, bs).expect("mem");
    let info = export_info(&m, "pm", MAX_PAYLOAD).expect("info");
    (m, info)
}

/// TLS required, with a PSK for alice (the file is read once per test process).
fn psk_tls() -> ConnTls {
    static TLS: std::sync::OnceLock<ConnTls> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("keys.psk");
        std::fs::write(&file, "alice:000102030405060708090a0b0c0d0e0f\n").expect("psk file");
        let config =
            TlsConfig { mode: TlsMode::Require, psk_file: Some(file), ..TlsConfig::default() };
        config.load().expect("PSK configuration")
    })
    .clone()
}

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Client flags, optionally structured replies, then `NBD_OPT_GO` asking for block sizes.
fn handshake(structured: bool) -> Vec<u8> {
    let mut b = 3u32.to_be_bytes().to_vec();
    if structured {
        option(&mut b, OPT_STRUCTURED_REPLY, &[]);
    }
    let mut go = 2u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"pm");
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    option(&mut b, OPT_GO, &go);
    b
}

/// Skips the greeting and option replies up to the `NBD_OPT_GO` ACK; returns the offset.
fn skip_handshake(out: &[u8]) -> usize {
    let mut at = 18;
    loop {
        let opt = u32::from_be_bytes(out[at + 8..at + 12].try_into().expect("4"));
        let ty = u32::from_be_bytes(out[at + 12..at + 16].try_into().expect("4"));
        let len = u32::from_be_bytes(out[at + 16..at + 20].try_into().expect("4")) as usize;
        at += 20 + len;
        if opt == OPT_GO && ty == REP_ACK {
            return at;
        }
        assert!(ty & 0x8000_0000 == 0, "handshake failed: {ty:#x}");
    }
}

#[derive(Debug, Clone)]
struct Req {
    command: u16,
    flags: u16,
    offset: u64,
    len: u32,
    fill: u8,
}

fn req_strategy() -> impl Strategy<Value = Req> {
    let command = prop_oneof![
        4 => Just(CMD_READ),
        4 => Just(CMD_WRITE),
        1 => Just(CMD_FLUSH),
        1 => Just(CMD_TRIM),
        1 => Just(CMD_WRITE_ZEROES),
        1 => Just(CMD_BLOCK_STATUS),
        1 => 8u16..1000,
    ];
    let flags = prop_oneof![
        6 => Just(0u16),
        2 => Just(CMD_FLAG_FUA),
        1 => Just(CMD_FLAG_DF),
        1 => Just(CMD_FLAG_NO_HOLE),
        1 => any::<u16>(),
    ];
    let offset = prop_oneof![
        6 => (0u64..2100).prop_map(|b| b * 512),
        1 => 0u64..SIZE + 4096,
        1 => any::<u64>(),
    ];
    let len = prop_oneof![
        1 => Just(0u32),
        3 => Just(512u32),
        3 => Just(4096u32),
        1 => Just(MAX_PAYLOAD),
        1 => Just(MAX_PAYLOAD + 512),
        2 => 0u32..100_000,
    ];
    (command, flags, offset, len, any::<u8>()).prop_map(|(command, flags, offset, len, fill)| Req {
        command,
        flags,
        offset,
        len,
        fill,
    })
}

/// The spec's answer for a request, written independently of the codec.
fn expected_error(r: &Req, structured: bool) -> u32 {
    let fua = CMD_FLAG_FUA;
    let allowed = match r.command {
        CMD_READ => fua | if structured { CMD_FLAG_DF } else { 0 },
        CMD_WRITE | CMD_FLUSH | CMD_TRIM => fua,
        CMD_WRITE_ZEROES => fua | CMD_FLAG_NO_HOLE,
        _ => return NBD_EINVAL,
    };
    if r.flags & !allowed != 0 {
        return NBD_EINVAL;
    }
    if r.command == CMD_FLUSH {
        return if r.offset == 0 && r.len == 0 { 0 } else { NBD_EINVAL };
    }
    if matches!(r.command, CMD_READ | CMD_WRITE) && r.len > MAX_PAYLOAD {
        return NBD_EOVERFLOW;
    }
    if !r.offset.is_multiple_of(u64::from(MIN)) || !r.len.is_multiple_of(MIN) {
        return NBD_EINVAL;
    }
    match r.offset.checked_add(u64::from(r.len)) {
        Some(end) if end <= SIZE => 0,
        _ if matches!(r.command, CMD_WRITE | CMD_WRITE_ZEROES) => NBD_ENOSPC,
        _ => NBD_EINVAL,
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8"))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn codec_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), option_code in 0u32..16) {
        let (_m, info) = mem();
        let mut header = [0u8; REQUEST_HEADER_BYTES];
        let n = bytes.len().min(REQUEST_HEADER_BYTES);
        header[..n].copy_from_slice(&bytes[..n]);
        header[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        let h = decode_request_header(&header).expect("magic is right");
        for structured in [false, true] {
            let session = Session {
                export: 0,
                structured_replies: structured,
                transmission_flags: 0,
                size_bytes: SIZE,
                min_block_bytes: MIN,
                max_payload_bytes: MAX_PAYLOAD,
                block_sizes_agreed: true,
                base_allocation: structured,
            };
            let _ = session.validate(&h);
        }
        let mut oh = [0u8; OPTION_HEADER_BYTES];
        oh[..n.min(16)].copy_from_slice(&bytes[..n.min(16)]);
        let _ = decode_option_header(&oh);
        let mut negotiation = Negotiation::new(&info, [0, 0, 0, 3]).expect("flags");
        let mut out = Vec::new();
        if option_code == OPT_EXPORT_NAME {
            // EXPORT_NAME ends negotiation with an unframed reply (size, flags, padding): it
            // must not panic, and there is nothing framed to check.
            let header = OptionHeader { option: option_code, data_len_bytes: bytes.len() as u32 };
            let _ = negotiation.handle_option(header, &bytes, &mut out);
            return Ok(());
        }
        for opt in [option_code, OPT_GO, OPT_INFO, OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
            let header = OptionHeader { option: opt, data_len_bytes: bytes.len() as u32 };
            let _ = negotiation.handle_option(header, &bytes, &mut out);
        }
        // Every reply is framed: magic, option, type, length, then exactly that much data.
        let mut at = 0;
        while at < out.len() {
            prop_assert_eq!(be64(&out, at), OPTION_REPLY_MAGIC);
            at += 20 + be32(&out, at + 16) as usize;
        }
        prop_assert_eq!(at, out.len());
    }

    /// Random options under every TLS mode: every reply is framed, and a server that
    /// requires TLS never enters transmission (nor answers with anything but `TLS_REQD`,
    /// `ABORT`'s `ACK` or `STARTTLS`'s replies) before `STARTTLS` is acknowledged.
    #[test]
    fn tls_modes_gate_every_option(
        options in proptest::collection::vec((0u32..12, proptest::collection::vec(any::<u8>(), 0..64)), 1..24),
        mode in prop_oneof![Just(TlsMode::Off), Just(TlsMode::On), Just(TlsMode::Require)],
    ) {
        let (_m, info) = mem();
        let mut n = Negotiation::new(&info, [0, 0, 0, 3]).expect("flags").with_tls(mode);
        for (opt, data) in options {
            let tls_before = n.tls_active();
            let mut out = Vec::new();
            let header = OptionHeader { option: opt, data_len_bytes: data.len() as u32 };
            let outcome = n.handle_option(header, &data, &mut out);
            if mode == TlsMode::Require && !tls_before {
                prop_assert!(!matches!(outcome, OptionOutcome::Transmission(_)), "{outcome:?}");
                if opt != OPT_STARTTLS && opt != OPT_ABORT && opt != OPT_EXPORT_NAME {
                    prop_assert_eq!(be32(&out, 12), REP_ERR_TLS_REQD);
                }
            }
            prop_assert_eq!(outcome == OptionOutcome::StartTls, n.tls_active() && !tls_before);
            if mode == TlsMode::Off {
                prop_assert!(!n.tls_active());
            }
            match outcome {
                OptionOutcome::Continue | OptionOutcome::StartTls => {}
                _ => break,
            }
            let mut at = 0;
            while at < out.len() {
                prop_assert_eq!(be64(&out, at), OPTION_REPLY_MAGIC);
                at += 20 + be32(&out, at + 16) as usize;
            }
            prop_assert_eq!(at, out.len());
        }
    }

    /// A whole connection to a server that requires TLS (PSK), fed random bytes, or
    /// `STARTTLS` and then random bytes for a ClientHello: never a panic, never transmission.
    #[test]
    fn random_streams_to_a_tls_server_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        starttls in any::<bool>(),
    ) {
        let (m, info) = mem();
        let tls = psk_tls();
        let mut input = 3u32.to_be_bytes().to_vec();
        if starttls {
            option(&mut input, OPT_STARTTLS, &[]);
        }
        input.extend_from_slice(&bytes);
        let mut t = ReplayTransport::new(input);
        let end = serve_connection_tls(&mut t, &m, &info, &tls);
        prop_assert!(m.stats().conns_opened == 0, "{end:?}");
    }

    #[test]
    fn random_streams_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        prefix in 0u8..3,
    ) {
        let (m, info) = mem();
        let mut input = match prefix {
            0 => Vec::new(),
            1 => handshake(false),
            _ => handshake(true),
        };
        input.extend_from_slice(&bytes);
        let mut t = ReplayTransport::new(input);
        let _ = serve_connection(&mut t, &m, &info);
    }

    #[test]
    fn request_sequences_match_the_spec_model(
        reqs in proptest::collection::vec(req_strategy(), 1..40),
        structured in any::<bool>(),
    ) {
        let (m, info) = mem();
        let mut input = handshake(structured);
        for (i, r) in reqs.iter().enumerate() {
            input.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            input.extend_from_slice(&r.flags.to_be_bytes());
            input.extend_from_slice(&r.command.to_be_bytes());
            input.extend_from_slice(&(i as u64).to_be_bytes());
            input.extend_from_slice(&r.offset.to_be_bytes());
            input.extend_from_slice(&r.len.to_be_bytes());
            if r.command == CMD_WRITE {
                input.extend(std::iter::repeat_n(r.fill, r.len as usize));
            }
        }
        input.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        input.extend_from_slice(&[0, 0, 0, CMD_DISC as u8]);
        input.extend_from_slice(&[0u8; 20]);
        let mut t = ReplayTransport::new(input);
        let end = serve_connection(&mut t, &m, &info).expect("connection ok");
        prop_assert_eq!(end, ConnEnd::Disconnected);

        let out = &t.output;
        let mut at = skip_handshake(out);
        let mut model = vec![0u8; SIZE as usize];
        for (i, r) in reqs.iter().enumerate() {
            let want = expected_error(r, structured);
            // Reads and block status (refused here: no context is selected) get chunks.
            let chunked = matches!(r.command, CMD_READ | CMD_BLOCK_STATUS);
            let (error, data) = if structured && chunked {
                prop_assert_eq!(be32(out, at), STRUCTURED_REPLY_MAGIC);
                let flags = u16::from_be_bytes([out[at + 4], out[at + 5]]);
                let ty = u16::from_be_bytes([out[at + 6], out[at + 7]]);
                prop_assert_eq!(be64(out, at + 8), i as u64);
                prop_assert_eq!(flags, REPLY_FLAG_DONE);
                let len = be32(out, at + 16) as usize;
                let payload = &out[at + 20..at + 20 + len];
                at += 20 + len;
                match ty {
                    REPLY_TYPE_OFFSET_DATA => {
                        prop_assert_eq!(be64(payload, 0), r.offset);
                        (0, &payload[8..])
                    }
                    REPLY_TYPE_NONE => (0, &payload[..0]),
                    REPLY_TYPE_ERROR => (be32(payload, 0), &payload[..0]),
                    other => return Err(TestCaseError::fail(format!("chunk type {other}"))),
                }
            } else {
                prop_assert_eq!(be32(out, at), SIMPLE_REPLY_MAGIC);
                prop_assert_eq!(be64(out, at + 8), i as u64);
                let error = be32(out, at + 4);
                at += 16;
                let data_len = if r.command == CMD_READ && error == 0 { r.len as usize } else { 0 };
                let data = &out[at..at + data_len];
                at += data_len;
                (error, data)
            };
            prop_assert_eq!(error, want, "request {} {:?}", i, r);
            if want != 0 {
                continue;
            }
            let range = r.offset as usize..(r.offset + u64::from(r.len)) as usize;
            match r.command {
                CMD_READ => prop_assert!(data == &model[range], "read {} differs", i),
                CMD_WRITE => model[range].fill(r.fill),
                CMD_TRIM | CMD_WRITE_ZEROES => model[range].fill(0),
                _ => {}
            }
        }
        prop_assert_eq!(at, out.len(), "trailing output");
    }
}
