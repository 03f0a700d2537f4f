//! qemu-io and qemu-img against `pmcache serve`: patterns written and verified at many
//! offsets and sizes through a cache smaller than the data (eviction and write-back happen),
//! FUA, pipelined writes, write-zeroes, discard and flush; then an online `pmcache detach`
//! and a byte-for-byte comparison of the backing file with a model of the writes. And
//! `qemu-img convert` of a file into the export and back out.

use std::process::Command;
use std::time::Duration;

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
    // Sub-block, 512-aligned but not 4 KiB-aligned, unaligned, and multi-MiB lengths.
    let lens: [u64; 12] =
        [1, 511, 512, 1536, 4096, 4097, 7680, 65536, 100_000, 1 << 20, (3 << 20) + 7, 8 << 20];
    let mut model = vec![0u8; span_bytes as usize];
    let mut cmds = Vec::new();
    let mut x: u64 = 0x1234_5678;
    for i in 0..144u64 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let len = lens[(i % lens.len() as u64) as usize];
        let offset = (x >> 20) % (span_bytes - len);
        let offset = match i % 3 {
            0 => offset & !4095,
            1 => offset & !511,
            _ => offset,
        };
        let pattern = (i % 255 + 1) as u8;
        let fua = if i % 7 == 0 { "-f " } else { "" };
        cmds.push(format!("write {fua}-P {pattern} {offset} {len}"));
        cmds.push(format!("read -P {pattern} {offset} {len}"));
        model[offset as usize..(offset + len) as usize].fill(pattern);
    }
    // Pipelined writes, zeroes (aligned and not), a discard (contents unspecified until
    // rewritten), and a flush.
    for j in 0..16u64 {
        let offset = (40 * MIB) + j * 65536 + 512;
        cmds.push(format!("aio_write -P 77 {offset} 65536"));
        model[offset as usize..(offset + 65536) as usize].fill(77);
    }
    cmds.push("aio_flush".into());
    cmds.push("write -z 1000000 300000".into());
    model[1_000_000..1_300_000].fill(0);
    cmds.push("read -P 0 1000000 300000".into());
    cmds.push("write -z 8388608 2097152".into());
    model[8 << 20..10 << 20].fill(0);
    cmds.push("read -P 0 8388608 2097152".into());
    cmds.push("discard 0 1048576".into());
    cmds.push("write -P 9 0 1048576".into());
    model[..1 << 20].fill(9);
    cmds.push("flush".into());
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
    let src = setup.disk.path().join("src.img");
    let data = image_with_zero_region(size_bytes as usize, 42);
    std::fs::write(&src, &data).expect("write src");
    let src_s = src.to_str().expect("utf8 path");
    qemu_img_convert(src_s, &server.uri, true, TIMEOUT);
    let out = setup.disk.path().join("out.img");
    qemu_img_convert(&server.uri, out.to_str().expect("utf8 path"), false, TIMEOUT);
    assert!(read_file(&out) == data, "qemu-img convert out differs from the source");
    run_ok(
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", src_s, &server.uri]),
        TIMEOUT,
    );
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
