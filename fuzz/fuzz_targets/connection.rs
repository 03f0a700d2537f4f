//! Fuzzes a whole server connection: handshake, option haggling, request decoding and
//! validation, payload skipping and reply encoding, over an in-memory stream.
//!
//! The first input byte picks a prefix: raw bytes, or a valid handshake (with or without
//! structured replies) so that most of the input lands in the transmission phase.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pmcache_nbd::codec::{ExportInfo, IHAVEOPT, INFO_BLOCK_SIZE, OPT_GO, OPT_STRUCTURED_REPLY};
use pmcache_nbd::server::export_info;
use pmcache_nbd::{BlockSizes, MemExport, ReplayTransport, serve_connection};

fn export() -> &'static (MemExport, ExportInfo) {
    static EXPORT: OnceLock<(MemExport, ExportInfo)> = OnceLock::new();
    EXPORT.get_or_init(|| {
        let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 1 << 20 };
        let m = MemExport::new(1 << 20, bs).expect("mem export");
        let info = export_info(&m, "pm", 64 * 1024).expect("export info");
        (m, info)
    })
}

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = Vec::with_capacity(rest.len() + 64);
    if mode % 3 != 0 {
        input.extend_from_slice(&3u32.to_be_bytes());
        if mode % 3 == 2 {
            option(&mut input, OPT_STRUCTURED_REPLY, &[]);
        }
        let mut go = 2u32.to_be_bytes().to_vec();
        go.extend_from_slice(b"pm");
        go.extend_from_slice(&1u16.to_be_bytes());
        go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        option(&mut input, OPT_GO, &go);
    }
    input.extend_from_slice(rest);
    let (m, info) = export();
    let mut t = ReplayTransport::new(input);
    let _ = serve_connection(&mut t, m, info);
});
