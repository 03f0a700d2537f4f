//! Block status (`base:allocation`): the metadata context negotiated by real clients
//! (nbdinfo --map, qemu-img map, nbdcopy's sparse copy) and by a raw client, against a
//! `MemExport` whose all-zero pieces are holes.

use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::time::Duration;

use pmcache_nbd::BlockSizes;
use pmcache_nbd::codec::*;
use pmcache_testkit::nbd::{Chunk, RawNbd};
use serde_json::Value;

use crate::common::{NAME, TestServer, Via, pseudo_random, read_file, require_tool, run_ok};

const TIMEOUT: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

/// 16 MiB, zero but for 64 KiB of data at 1 MiB and 1 MiB at 8 MiB.
fn sparse_server(via: Via) -> (TestServer, Vec<u8>) {
    let server = TestServer::start(16 * MIB, BlockSizes::default(), via);
    let mut image = vec![0u8; 16 * MIB as usize];
    let data = pseudo_random(64 << 10, 3);
    image[MIB as usize..MIB as usize + data.len()].copy_from_slice(&data);
    let more = pseudo_random(MIB as usize, 4);
    image[8 * MIB as usize..9 * MIB as usize].copy_from_slice(&more);
    server.export.write_at(0, &image).expect("fill");
    (server, image)
}

/// (offset, length, type) of each extent `nbdinfo --map --json` printed.
fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, u64)> {
    let out = run_ok(Command::new("nbdinfo").args(["--map", "--json", uri]), TIMEOUT);
    let v: Value = serde_json::from_str(&out).expect("nbdinfo json");
    let field = |e: &Value, k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    v.as_array()
        .expect("extents")
        .iter()
        .map(|e| (field(e, "offset"), field(e, "length"), field(e, "type")))
        .collect()
}

#[test]
fn nbdinfo_maps_holes_and_data() {
    require_tool("nbdinfo", "libnbd-bin");
    let (server, _) = sparse_server(Via::Unix);
    let hole_zero = u64::from(STATE_HOLE | STATE_ZERO);
    let expected = vec![
        (0, MIB, hole_zero),
        (MIB, 64 << 10, 0),
        (MIB + (64 << 10), 7 * MIB - (64 << 10), hole_zero),
        (8 * MIB, MIB, 0),
        (9 * MIB, 7 * MIB, hole_zero),
    ];
    assert_eq!(nbdinfo_map(&server.uri), expected);
    server.stop();
}

#[test]
fn qemu_img_map_and_nbdcopy_skip_the_holes() {
    require_tool("qemu-img", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let (server, image) = sparse_server(Via::Tcp);
    let out = run_ok(Command::new("qemu-img").args(["map", "--output=json", &server.uri]), TIMEOUT);
    let v: Value = serde_json::from_str(&out).expect("qemu-img map json");
    let data: Vec<(u64, u64)> = v
        .as_array()
        .expect("map")
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().expect("start"), e["length"].as_u64().expect("length")))
        .collect();
    assert_eq!(data, [(MIB, 64 << 10), (8 * MIB, MIB)], "{v}");

    // A copy to a file skips the zeroes: the file is sparse and equal to the export.
    let copy = server.path("copy.img");
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&copy), TIMEOUT);
    assert!(read_file(&copy) == image, "the copy differs from the export");
    let allocated_bytes = std::fs::metadata(&copy).expect("stat").blocks() * 512;
    assert!(allocated_bytes <= 2 * MIB, "not sparse: {allocated_bytes} bytes allocated");
    server.stop();
}

/// A raw client: listing and selecting the context, block status with and without
/// `REQ_ONE`, and block status without a selected context refused with EINVAL.
#[test]
fn raw_meta_context_negotiation_and_block_status() {
    let (server, _) = sparse_server(Via::Tcp);
    let mut c = RawNbd::greet(server.tcp_addr());
    c.send(&3u32.to_be_bytes());
    let meta_data = |queries: &[&str]| {
        let mut d = (NAME.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(NAME.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    };

    let option = |c: &mut RawNbd, opt: u32, data: &[u8]| {
        c.option(opt, data);
        let reply = c.opt_reply();
        (reply.reply_type, reply.data)
    };
    // Before structured replies: invalid.
    assert_eq!(option(&mut c, OPT_LIST_META_CONTEXT, &meta_data(&[])).0, REP_ERR_INVALID);
    assert_eq!(option(&mut c, OPT_STRUCTURED_REPLY, &[]).0, REP_ACK);
    // Listing everything, or the namespace, names base:allocation.
    for queries in [&[][..], &["base:"][..]] {
        let (ty, data) = option(&mut c, OPT_LIST_META_CONTEXT, &meta_data(queries));
        assert_eq!(ty, REP_META_CONTEXT);
        assert_eq!(&data[4..], META_BASE_ALLOCATION.as_bytes());
        assert_eq!(c.opt_reply().reply_type, REP_ACK);
    }
    // Something else selects nothing.
    assert_eq!(
        option(&mut c, OPT_SET_META_CONTEXT, &meta_data(&["qemu:dirty-bitmap:x"])).0,
        REP_ACK
    );
    let (ty, data) =
        option(&mut c, OPT_SET_META_CONTEXT, &meta_data(&["x-foo:bar", META_BASE_ALLOCATION]));
    assert_eq!(ty, REP_META_CONTEXT);
    assert_eq!(u32::from_be_bytes(data[..4].try_into().expect("4")), META_BASE_ALLOCATION_ID);
    assert_eq!(c.opt_reply().reply_type, REP_ACK);
    c.go(NAME, &[]);

    let descriptors = |data: &[u8]| -> Vec<(u32, u32)> {
        assert_eq!(u32::from_be_bytes(data[..4].try_into().expect("4")), META_BASE_ALLOCATION_ID);
        data[4..]
            .chunks_exact(8)
            .map(|d| {
                let len = u32::from_be_bytes(d[..4].try_into().expect("4"));
                (len, u32::from_be_bytes(d[4..].try_into().expect("4")))
            })
            .collect()
    };
    let hole_zero = STATE_HOLE | STATE_ZERO;
    c.request(CMD_BLOCK_STATUS, 0, 7, 0, 2 * MIB as u32, &[]);
    let Chunk { flags, kind: ty, cookie, payload: data } = c.chunk();
    assert_eq!((flags, ty, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 7));
    let whole = [(MIB as u32, hole_zero), (64 << 10, 0), (MIB as u32 - (64 << 10), hole_zero)];
    assert_eq!(descriptors(&data), whole);
    c.request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 8, 0, 2 * MIB as u32, &[]);
    let Chunk { kind: ty, cookie, payload: data, .. } = c.chunk();
    assert_eq!((ty, cookie), (REPLY_TYPE_BLOCK_STATUS, 8));
    assert_eq!(descriptors(&data), [(MIB as u32, hole_zero)]);
    // Past the end: an error chunk.
    c.request(CMD_BLOCK_STATUS, 0, 9, 15 * MIB, 2 * MIB as u32, &[]);
    let Chunk { kind: ty, cookie, payload: data, .. } = c.chunk();
    assert_eq!((ty, cookie), (REPLY_TYPE_ERROR, 9));
    assert_eq!(u32::from_be_bytes(data[..4].try_into().expect("4")), NBD_EINVAL);
    server.stop();
}
