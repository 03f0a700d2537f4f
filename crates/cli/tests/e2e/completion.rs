//! Per-request completion through `pmcache serve`, in front of a slow backing store
//! (`--backing-latency`): a hit sent after a miss on the same connection is answered first,
//! with its own cookie; the miss is answered with its data once the store's read completes;
//! the server's per-class latencies (`stats`) count both.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use pmcache_nbd::codec::CMD_READ;

use crate::common::*;

#[test]
fn a_hit_after_a_miss_on_one_connection_is_answered_first() {
    let setup = Setup::new("completion", 8 * MIB, 4 * MIB);
    let backing = std::fs::OpenOptions::new().write(true).open(&setup.backing).expect("open");
    backing.write_all_at(&[0x11; 4096], 0).expect("block 0 on the backing store");
    drop(backing);
    let latency = Duration::from_millis(400);
    let server = setup.serve(Via::Tcp, &["--backing-latency", "400ms"]);
    let mut c = NbdClient::connect(server.addr());
    c.write_at(4096, &[0x22; 4096], 0);
    let sent = Instant::now();
    c.request(CMD_READ, 0, 10, 0, 4096, &[]).expect("the miss");
    c.request(CMD_READ, 0, 11, 4096, 4096, &[]).expect("the hit");
    assert_eq!(c.simple_reply().expect("reply"), (0, 11), "the hit is answered first");
    assert_eq!(c.read_n(4096).expect("data"), [0x22; 4096]);
    let hit_after = sent.elapsed();
    assert_eq!(c.simple_reply().expect("reply"), (0, 10), "then the miss");
    assert_eq!(c.read_n(4096).expect("data"), [0x11; 4096]);
    let miss_after = sent.elapsed();
    assert!(miss_after >= latency, "the miss took {miss_after:?}, less than the store's latency");
    assert!(hit_after < miss_after, "hit {hit_after:?}, miss {miss_after:?}");
    // Admitted: a hit now.
    assert_eq!(c.read_at(0, 4096), [0x11; 4096]);
    drop(c);
    let stats = setup.stats();
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
    assert!(stderr.contains("is not a latency (examples: 2ms, 500us, hdd"), "{stderr}");
}
