//! Requests whose answer depends on the cache and the backing store together: block status
//! (`base:allocation`: nbdinfo `--map`, a sparse `qemu-img convert`) and TRIM / WRITE_ZEROES
//! of nearly 4 GiB from a raw client, whose work must stay bounded.

use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::time::{Duration, Instant};

use pmcache_nbd::codec::{CMD_TRIM, CMD_WRITE_ZEROES, STATE_HOLE, STATE_ZERO};

use crate::common::*;

const GIB: u64 = 1 << 30;

/// (offset, length, type) of each extent `nbdinfo --map --json` printed.
fn map(uri: &str) -> Vec<(u64, u64, u64)> {
    let out =
        run_ok(Command::new("nbdinfo").args(["--map", "--json", uri]), Duration::from_secs(60));
    let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo json");
    let field = |e: &serde_json::Value, k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{v}"));
    v.as_array()
        .expect("extents")
        .iter()
        .map(|e| (field(e, "offset"), field(e, "length"), field(e, "type")))
        .collect()
}

/// Blocks only in the cache are data though the backing file is a hole there; after a flush
/// they are data on the backing store; trimmed, a hole again. A convert skips the holes.
#[test]
fn block_status_sees_the_cache_and_the_backing_store() {
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("qemu-img", "qemu-utils");
    let setup = Setup::new("block-status", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let hole_zero = u64::from(STATE_HOLE | STATE_ZERO);
    assert_eq!(map(&server.uri), [(0, 64 * MIB, hole_zero)], "an empty sparse backing file");

    let data = pseudo_random(64 * KIB as usize, 9);
    let mut client = NbdClient::ready(server.addr());
    client.write_at(MIB, &data, 0);
    let expected =
        [(0, MIB, hole_zero), (MIB, 64 * KIB, 0), (MIB + 64 * KIB, 63 * MIB - 64 * KIB, hole_zero)];
    assert_eq!(map(&server.uri), expected, "dirty in the cache, a hole on the backing store");
    assert_eq!(read_file_at(&setup.backing, MIB, 4096), vec![0u8; 4096]);
    let flushed = setup.pmcache(&["flush", "--control", &setup.control_arg()]);
    assert!(flushed.status.success(), "{flushed:?}");
    assert_eq!(read_file_at(&setup.backing, MIB, data.len()), data, "written back");
    assert_eq!(map(&server.uri), expected, "written back: data on the backing store");

    let copy = setup.disk.path().join("copy.img");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", &server.uri])
            .arg(&copy),
        Duration::from_secs(60),
    );
    let image = read_file(&copy);
    assert_eq!(image.len() as u64, 64 * MIB);
    assert!(image[MIB as usize..(MIB + 64 * KIB) as usize] == data[..], "the copy's data");
    let allocated_bytes = std::fs::metadata(&copy).expect("stat").blocks() * 512;
    assert!(allocated_bytes <= 2 * MIB, "not sparse: {allocated_bytes} bytes allocated");

    client.request(CMD_TRIM, 0, 3, MIB, 64 * KIB as u32, &[]);
    assert_eq!(client.simple_reply(), (0, 3));
    assert_eq!(map(&server.uri), [(0, 64 * MIB, hole_zero)], "trimmed: a hole again");
    server.terminate();
}

/// WRITE_ZEROES and TRIM of 4 GiB less 512 bytes over cached dirty blocks, blocks written
/// back and holes: each answered in bounded time, without a dirty block written per block of
/// the range (before, a WRITE_ZEROES was a million of them, each cleaned in turn), the range
/// reads as zeroes and what lies outside it is kept.
#[test]
fn oversized_write_zeroes_and_trims_do_bounded_work() {
    let setup = Setup::new("oversized", 5 * GIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let mut client = NbdClient::ready(server.addr());
    client.stream.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    let block = pseudo_random(4096, 5);
    let start = 512 * MIB;
    let len = u32::MAX - 511;
    let end = start + u64::from(len);
    // Written back (data on the backing store) and then dirty in the cache, inside the range;
    // and one block either side of it.
    client.write_at(start + GIB, &block, 0);
    let flushed = setup.pmcache(&["flush", "--control", &setup.control_arg()]);
    assert!(flushed.status.success(), "{flushed:?}");
    client.write_at(start + 2 * GIB, &block, 0);
    client.write_at(start - 4096, &block, 0);
    client.write_at(end, &block, 0);
    let before = setup.stats();

    let started = Instant::now();
    client.request(CMD_WRITE_ZEROES, 0, 7, start, len, &[]);
    assert_eq!(client.simple_reply(), (0, 7));
    let zeroing = started.elapsed();
    let after = setup.stats();
    let counter = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    let cleaned =
        counter(&after, "cleaner_blocks_cleaned") - counter(&before, "cleaner_blocks_cleaned");
    let inline = counter(&after, "writebacks") - counter(&before, "writebacks");
    assert!(cleaned + inline < 1000, "{cleaned} blocks cleaned, {inline} written back: {after}");
    assert!(zeroing < Duration::from_secs(60), "WRITE_ZEROES of 4 GiB took {zeroing:?}");
    for at in [start, start + GIB, start + 2 * GIB, end - 4096] {
        assert_eq!(client.read_at(at, 4096), vec![0u8; 4096], "zeroed at {at}");
    }
    assert_eq!(client.read_at(start - 4096, 4096), block, "before the range");
    assert_eq!(client.read_at(end, 4096), block, "after the range");

    let started = Instant::now();
    client.request(CMD_TRIM, 0, 8, start, len, &[]);
    assert_eq!(client.simple_reply(), (0, 8));
    let trimming = started.elapsed();
    assert!(trimming < Duration::from_secs(60), "TRIM of 4 GiB took {trimming:?}");
    assert_eq!(client.read_at(end, 4096), block, "after the trimmed range");
    eprintln!("WRITE_ZEROES of 4 GiB: {zeroing:?}; TRIM: {trimming:?}");
    drop(client);
    // Acknowledged zeroes are durable: after kill -9 and recovery they are still zeroes.
    server.kill9();
    let server = setup.serve(Via::Tcp, &[]);
    let mut client = NbdClient::ready(server.addr());
    assert_eq!(client.read_at(start + 2 * GIB, 4096), vec![0u8; 4096]);
    assert_eq!(client.read_at(end, 4096), block);
    server.terminate();
}
