//! fio with `ioengine=nbd` and crc32c verification over two connections against
//! `pmcache serve` in every cache mode, with a cache smaller than the data written (so the
//! write paths evict, write back and read misses go to the backing store), and a clean
//! SIGTERM shutdown afterwards.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

fn fio_verify(mode: &str, via: Via, extra: &[&str]) {
    require_fio_nbd();
    let setup = Setup::new(&format!("fio-{mode}"), 256 * MIB, 8 * MIB);
    let server = setup.serve(via, &["--mode", mode]);
    let uri = match via {
        Via::Tcp => server.uri.clone(),
        Via::Unix => {
            format!("nbd+unix:///{EXPORT}?socket={}", setup.shm.path().join("nbd.sock").display())
        }
    };
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--size=16m",
        "--numjobs=2",
        "--offset_increment=64m",
        "--iodepth=16",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--verify_state_save=0",
        "--output-format=json",
    ]);
    cmd.args(extra).current_dir(setup.disk.path());
    let out = run_ok(&mut cmd, Duration::from_secs(90));
    let v = fio_json(&out);
    let jobs = v["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 2, "{v}");
    for j in jobs {
        assert_eq!(j["error"], 0, "{j}");
        assert!(j["write"]["io_bytes"].as_u64().unwrap_or(0) >= 16 * MIB, "{j}");
        assert!(j["read"]["io_bytes"].as_u64().unwrap_or(0) >= 16 * MIB, "verify reads: {j}");
    }
    let stats = setup.stats();
    assert_eq!(stats["mode"], mode, "{stats}");
    assert!(stats["bytes_written"].as_u64().unwrap_or(0) >= 32 * MIB, "{stats}");
    let caching = stats["writes"].as_u64().unwrap_or(0) > 0;
    assert!(caching, "{stats}");
    if mode == "writeback" {
        // Whole 4 KiB blocks, 16 in flight per connection: the server hands the writes it
        // finds queued to the engine together, which group-commits them.
        assert!(stats["group_writes"].as_u64().unwrap_or(0) > 0, "no group commit: {stats}");
    }
    match mode {
        // 32 MiB of writes through an 8 MiB cache: dirty blocks had to be written back.
        "writeback" | "writeonly" => {
            assert!(stats["writebacks"].as_u64().unwrap_or(0) > 0, "{stats}")
        }
        // Clean copies were evicted to make room.
        "writethrough" => assert!(stats["evictions"].as_u64().unwrap_or(0) > 0, "{stats}"),
        // Nothing is admitted on a write, so the verify reads missed and went to the backing
        // store (admitted in write-around, bypassed in pass-through).
        _ => assert!(
            stats["read_misses_admitted"].as_u64().unwrap_or(0)
                + stats["read_misses_bypassed"].as_u64().unwrap_or(0)
                > 0,
            "{stats}"
        ),
    }
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean"), "{logs}");
}

#[test]
fn fio_verify_writeback_tcp() {
    fio_verify("writeback", Via::Tcp, &["--bs=4k"]);
}

#[test]
fn fio_verify_writethrough_unix_mixed_sizes() {
    fio_verify("writethrough", Via::Unix, &["--bsrange=512-128k"]);
}

#[test]
fn fio_verify_writearound_tcp_mixed_sizes() {
    fio_verify("writearound", Via::Tcp, &["--bsrange=512-64k"]);
}

#[test]
fn fio_verify_passthrough_unix() {
    fio_verify("passthrough", Via::Unix, &["--bs=4k"]);
}

#[test]
fn fio_verify_writeonly_tcp_mixed_sizes() {
    fio_verify("writeonly", Via::Tcp, &["--bsrange=4k-64k"]);
}
