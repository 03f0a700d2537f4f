//! qemu-io and qemu-img against `pmcache serve`: patterns written and verified at many
//! offsets and sizes through a cache smaller than the data (eviction and write-back happen),
//! FUA, pipelined writes, write-zeroes, discard and flush; then an online `pmcache detach`
//! and a byte-for-byte comparison of the backing file with a model of the writes. And
//! `qemu-img convert` of a file into the export and back out.

use std::time::Duration;

use pmcache_testkit::{QemuIoScript, qemu_img_roundtrip, qemu_io_patterns};

use crate::common::*;

const TIMEOUT: Duration = Duration::from_secs(90);

/// Runs qemu-io with `cmds` against `uri` (see `pmcache_testkit::qemu_io`).
fn qemu_io(uri: &str, cmds: &[String]) -> String {
    pmcache_testkit::qemu_io(uri, cmds, TIMEOUT)
}

fn patterns(mode: &str, via: Via) {
    // Writes land in the first 64 MiB of a 256 MiB backing file, through an 8 MiB cache.
    let span_bytes: u64 = 64 * MIB;
    let setup = Setup::new(&format!("qemu-{mode}"), 256 * MIB, 8 * MIB);
    let server = setup.serve(via, &["--mode", mode]);
    let uri = match via {
        Via::Tcp => server.uri.clone(),
        Via::Unix => {
            format!("nbd+unix:///{EXPORT}?socket={}", setup.shm.path().join("nbd.sock").display())
        }
    };
    let QemuIoScript { commands: mut cmds, model } = qemu_io_patterns(span_bytes, 144);
    // Re-read everything after the cache churned (old blocks come back from the backing store).
    for (i, chunk) in model.chunks(4 << 20).enumerate() {
        if chunk.iter().all(|&b| b == chunk[0]) {
            cmds.push(format!("read -P {} {} {}", chunk[0], i << 22, 4 << 20));
        }
    }
    qemu_io(&uri, &cmds);
    let stats = setup.stats();
    assert!(stats["flushes"].as_u64().unwrap_or(0) >= 1, "{stats}");
    if mode == "writeback" {
        assert!(stats["writebacks"].as_u64().unwrap_or(0) > 0, "{stats}");
    }
    assert!(stats["evictions"].as_u64().unwrap_or(0) > 0, "{stats}");

    // Online detach: the server writes everything back, marks the cache clean and exits.
    let detach = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    let text = String::from_utf8_lossy(&detach.stdout);
    assert!(detach.status.success(), "{text}{}", String::from_utf8_lossy(&detach.stderr));
    assert!(text.contains("detached"), "{text}");
    // `detach` returned: the backing file alone is complete right now.
    let backing = read_file_at(&setup.backing, 0, span_bytes as usize);
    let first_diff = backing.iter().zip(&model).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "backing file differs from the model after detach");
    let (status, logs) = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{logs}");
    assert!(logs.contains("detached (every block written back,"), "{logs}");
    let check = setup.pmcache(&["check", "--json", "--cache", &setup.cache_arg()]);
    let v: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check --json");
    assert!(check.status.success(), "{v}");
    assert_eq!(v["clean_shutdown"], true, "{v}");
    assert_eq!(v["dirty"], 0, "{v}");
}

#[test]
fn qemu_io_patterns_writeback_tcp_then_detach() {
    patterns("writeback", Via::Tcp);
}

#[test]
fn qemu_io_patterns_writethrough_unix_then_detach() {
    patterns("writethrough", Via::Unix);
}

#[test]
fn qemu_img_convert_roundtrip() {
    require_tool("qemu-img", "qemu-utils");
    let size_bytes: u64 = 32 * MIB;
    let setup = Setup::new("qemu-img", size_bytes, 8 * MIB);
    std::fs::write(&setup.backing, vec![0xee; size_bytes as usize]).expect("dirty the backing");
    let server = setup.serve(Via::Tcp, &[]);
    let data = qemu_img_roundtrip(setup.disk.path(), &server.uri, size_bytes as usize, TIMEOUT);
    server.terminate();
    // After a clean shutdown the cache still holds dirty blocks; an offline detach writes them
    // back and the backing file equals the source.
    let detach = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
    ]);
    assert!(detach.status.success(), "{}", String::from_utf8_lossy(&detach.stderr));
    assert!(read_file(&setup.backing) == data, "backing file differs from the source after detach");
}
