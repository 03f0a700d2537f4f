//! Fuzzes the pure codec entry points directly: option header decoding, every option's
//! data parser, request header decoding and request validation.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pmcache_nbd::BlockSizes;
use pmcache_nbd::codec::{
    ExportInfo, Negotiation, OPTION_HEADER_BYTES, OptionHeader, REQUEST_HEADER_BYTES,
    REQUEST_MAGIC, Session, TlsMode, decode_option_header, decode_request_header,
};

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (head, body) = data.split_at(8);
    let mut oh = [0u8; OPTION_HEADER_BYTES];
    let n = body.len().min(OPTION_HEADER_BYTES);
    oh[..n].copy_from_slice(&body[..n]);
    let _ = decode_option_header(&oh);

    let info = ExportInfo {
        name: "pm".into(),
        size_bytes: 1 << 20,
        block_sizes: BlockSizes {
            min_bytes: 1 << (head[0] % 13),
            preferred_bytes: 4096 << (head[0] % 4),
            max_bytes: 1 << 20,
        },
        can_multi_conn: head[1] & 1 == 1,
    };
    let tls = [TlsMode::Off, TlsMode::On, TlsMode::Require][usize::from(head[1] >> 1) % 3];
    if let Ok(negotiation) = Negotiation::new(&info, [head[2], head[3], head[4], head[5]]) {
        let mut negotiation = negotiation.with_tls(tls);
        let option = u32::from(head[6] % 16);
        let mut out = Vec::new();
        let header = OptionHeader { option, data_len_bytes: body.len() as u32 };
        let _ = negotiation.handle_option(header, body, &mut out);
    }

    let mut rh = [0u8; REQUEST_HEADER_BYTES];
    let n = body.len().min(REQUEST_HEADER_BYTES);
    rh[..n].copy_from_slice(&body[..n]);
    if head[7] & 1 == 1 {
        rh[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    }
    if let Ok(h) = decode_request_header(&rh) {
        let session = Session {
            structured_replies: head[7] & 2 == 2,
            transmission_flags: 0,
            size_bytes: info.size_bytes,
            min_block_bytes: info.block_sizes.min_bytes,
            max_payload_bytes: info.block_sizes.max_bytes,
            block_sizes_agreed: true,
            base_allocation: head[7] & 4 == 4,
        };
        let _ = session.validate(&h);
    }
});
