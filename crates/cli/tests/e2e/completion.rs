//! Per-request completion through `pmcache serve`, in front of a slow backing store
//! (`--backing-latency`): a hit sent after a miss on the same connection is answered first,
//! with its own cookie; the miss is answered with its data once the store's read completes;
//! the server's per-class latencies (`stats`) count both.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use pmcache_nbd::codec::{CMD_FLUSH, CMD_READ, CMD_WRITE};

use crate::common::*;

#[test]
fn a_hit_after_a_miss_on_one_connection_is_answered_first() {
    let setup = Setup::new("completion", 8 * MIB, 4 * MIB);
    let backing = std::fs::OpenOptions::new().write(true).open(&setup.backing).expect("open");
    backing.write_all_at(&[0x11; 4096], 0).expect("block 0 on the backing store");
    drop(backing);
    let latency = Duration::from_millis(400);
    let server = setup.serve(Via::Tcp, &["--backing-latency", "400ms"]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(4096, &[0x22; 4096], 0);
    let sent = Instant::now();
    c.request(CMD_READ, 0, 10, 0, 4096, &[]);
    c.request(CMD_READ, 0, 11, 4096, 4096, &[]);
    assert_eq!(c.simple_reply(), (0, 11), "the hit is answered first");
    assert_eq!(c.read_n(4096), [0x22; 4096]);
    let hit_after = sent.elapsed();
    assert_eq!(c.simple_reply(), (0, 10), "then the miss");
    assert_eq!(c.read_n(4096), [0x11; 4096]);
    let miss_after = sent.elapsed();
    assert!(miss_after >= latency, "the miss took {miss_after:?}, less than the store's latency");
    assert!(hit_after < miss_after, "hit {hit_after:?}, miss {miss_after:?}");
    // Admitted: a hit now.
    assert_eq!(c.read_at(0, 4096), [0x11; 4096]);
    drop(c);
    // A connection's latencies reach `stats` when it ends, on the server's own time.
    let ended = Instant::now() + Duration::from_secs(10);
    let mut stats = setup.stats();
    while stats["connections_open"].as_u64() != Some(0) && Instant::now() < ended {
        std::thread::sleep(Duration::from_millis(20));
        stats = setup.stats();
    }
    let count = |k: &str| stats[k].as_u64().unwrap_or_else(|| panic!("{k} in {stats}"));
    assert!(count("read_hit_latency_count") >= 2, "{stats}");
    assert!(count("read_miss_latency_count") >= 1, "{stats}");
    let miss_ns = count("read_miss_latency_ns_p50");
    assert!(miss_ns >= latency.as_nanos() as u64 * 9 / 10, "miss p50 {miss_ns} ns: {stats}");
    assert!(count("read_hit_latency_ns_p50") < miss_ns, "{stats}");
    server.terminate();
}

/// `--backing-latency` takes times and presets, and names what it takes when given neither.
#[test]
fn backing_latency_values_are_checked() {
    let setup = Setup::new("latency-arg", 8 * MIB, 4 * MIB);
    let out = setup.serve_refused(&setup.cache, &["--backing-latency", "fast"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("is not a latency of at most an hour (examples: 2ms"), "{stderr}");
}

/// In write-through mode a write goes to the slow store in flight: a read hit sent after it on
/// the same connection is answered first; the write is answered (its own cookie) once the
/// store has it, and is then a hit; a FLUSH after it is answered after it.
#[test]
fn a_hit_after_a_write_through_on_one_connection_is_answered_first() {
    let setup = Setup::new("write-through-completion", 8 * MIB, 4 * MIB);
    let latency = Duration::from_millis(300);
    let server = setup.serve(Via::Tcp, &["--mode", "writethrough", "--backing-latency", "300ms"]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(4096, &[0x33; 4096], 0);
    let sent = Instant::now();
    c.request(CMD_WRITE, 0, 20, 0, 4096, &[0x44; 4096]);
    c.request(CMD_READ, 0, 21, 4096, 4096, &[]);
    c.request(CMD_FLUSH, 0, 22, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 21), "the hit is answered first");
    assert_eq!(c.read_n(4096), [0x33; 4096]);
    let hit_after = sent.elapsed();
    assert_eq!(c.simple_reply(), (0, 20), "then the write");
    let write_after = sent.elapsed();
    assert_eq!(c.simple_reply(), (0, 22), "then the flush");
    assert!(write_after >= latency, "the write took {write_after:?}, less than the store's");
    assert!(hit_after < latency, "the hit took {hit_after:?}, waiting for the write");
    assert_eq!(c.read_at(0, 4096), [0x44; 4096], "the write reads back");
    drop(c);
    drop(server);
    let mut stored = vec![0u8; 4096];
    let backing = std::fs::File::open(&setup.backing).expect("open");
    backing.read_exact_at(&mut stored, 0).expect("read the backing store");
    assert_eq!(stored, [0x44; 4096], "the write is on the backing store");
}

/// Two connections in front of a store whose writes land only when they complete
/// (`--backing-latency`), in write-through and write-around: connection A writes a block and
/// does not wait; connection B reads 8 KiB covering it (served beside the write in flight: old
/// or new data); A's write is answered; B reads the block again and must get the new data —
/// a read beside the write in flight never caches the store's old data. 20 blocks per mode.
#[test]
fn a_read_beside_a_write_through_in_flight_never_caches_the_old_data() {
    for mode in ["writethrough", "writearound"] {
        let setup = Setup::new(&format!("overlap-{mode}"), 8 * MIB, 4 * MIB);
        let server = setup.serve(Via::Tcp, &["--mode", mode, "--backing-latency", "20ms"]);
        let mut a = NbdClient::ready(server.addr());
        let mut b = NbdClient::ready(server.addr());
        let mut stale = Vec::new();
        for round in 0..20u64 {
            let offset = round * 3 * 4096;
            let new = [round as u8 + 1; 4096];
            a.request(CMD_WRITE, 0, 100 + round, offset, 4096, &new);
            let both = b.read_at(offset, 8192);
            assert!(
                both[..4096] == [0; 4096] || both[..4096] == new,
                "{mode}: a read beside the write got neither the old nor the new data"
            );
            assert_eq!(a.simple_reply(), (0, 100 + round), "{mode}: the write");
            if b.read_at(offset, 4096) != new || a.read_at(offset, 4096) != new {
                stale.push(round);
            }
        }
        assert!(stale.is_empty(), "{mode}: blocks of rounds {stale:?} read back old data");
        server.terminate();
    }
}
