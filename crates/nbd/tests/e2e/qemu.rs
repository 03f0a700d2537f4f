//! qemu-io and qemu-img against the server.

use std::process::Command;
use std::time::Duration;

use pmcache_nbd::BlockSizes;

use crate::common::{TestServer, Via, require_tool};
use pmcache_testkit::{QemuIoScript, qemu_img_roundtrip, qemu_io_patterns};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs qemu-io with `cmds` against `uri` (see `pmcache_testkit::qemu_io`).
fn qemu_io(uri: &str, cmds: &[String]) -> String {
    pmcache_testkit::qemu_io(uri, cmds, TIMEOUT)
}

/// Writes a pattern at many offsets and sizes, reading each back with pattern verification
/// (`pmcache_testkit::qemu_io_patterns`), then checks the whole export against a model of the
/// writes.
fn patterns(via: Via, block_sizes: BlockSizes) {
    let size_bytes: u64 = 64 << 20;
    let server = TestServer::start(size_bytes, block_sizes, via);
    let QemuIoScript { commands: cmds, model } = qemu_io_patterns(size_bytes, 120);
    qemu_io(&server.uri, &cmds);

    let mut actual = vec![0u8; size_bytes as usize];
    server.export.read_at(0, &mut actual).expect("read export");
    let first_diff = actual.iter().zip(&model).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "export differs from model");
    let stats = server.export.stats();
    assert!(stats.flushes >= 1, "{stats:?}");
    assert!(stats.fua_ops >= 1, "{stats:?}");
    assert!(stats.zero_writes >= 1, "{stats:?}");
    assert!(stats.trims >= 1, "{stats:?}");
    server.stop();
}

#[test]
fn qemu_io_patterns_tcp() {
    patterns(Via::Tcp, BlockSizes::default());
}

/// A 4 KiB-aligned export: qemu must honour NBD_INFO_BLOCK_SIZE (read-modify-write on its
/// side) or the server would refuse its unaligned requests.
#[test]
fn qemu_io_patterns_unix_aligned() {
    patterns(Via::Unix, BlockSizes { min_bytes: 4096, preferred_bytes: 4096, max_bytes: 1 << 20 });
}

#[test]
fn qemu_img_convert_roundtrip() {
    require_tool("qemu-img", "qemu-utils");
    let size_bytes: u64 = 24 << 20;
    let server = TestServer::start(size_bytes, BlockSizes::default(), Via::Tcp);
    // Dirty the export first so zero detection must actually write zeroes.
    server.export.write_at(0, &vec![0xee; size_bytes as usize]).expect("dirty");
    let dir = server.path("");
    let data = qemu_img_roundtrip(&dir, &server.uri, size_bytes as usize, TIMEOUT);
    let mut actual = vec![0u8; size_bytes as usize];
    server.export.read_at(0, &mut actual).expect("read export");
    assert!(actual == data, "export differs from source after qemu-img convert in");
    server.stop();
}

/// A server of two exports: qemu-io reaches each by name and finds only its data; an export
/// closed alone refuses new clients with the reason while the other is served; closing the
/// last stops the server.
#[test]
fn two_exports_each_served_and_closed_alone() {
    use pmcache_nbd::{ListenAddr, MemExport, Server, ServerConfig};
    use std::sync::Arc;
    require_tool("qemu-io", "qemu-utils");
    let first = MemExport::new(4 << 20, BlockSizes::default()).expect("export");
    let second = MemExport::new(8 << 20, BlockSizes::default()).expect("export");
    let config = ServerConfig {
        listen: ListenAddr::Tcp(([127, 0, 0, 1], 0).into()),
        ..ServerConfig::default()
    };
    let exports = vec![
        ("one".to_string(), Arc::new(first.clone())),
        ("two".into(), Arc::new(second.clone())),
    ];
    let server = Server::bind_exports(config, exports).expect("bind");
    let addr = server.local_addr();
    let running = server.spawn().expect("spawn");
    let handle = running.shutdown_handle();
    qemu_io(&addr.nbd_uri("one"), &["write -P 1 0 64k".into()]);
    qemu_io(&addr.nbd_uri("two"), &["write -P 2 0 64k".into(), "write -P 3 6M 4k".into()]);
    let mut buf = vec![0u8; 65536];
    first.read_at(0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 1), "export one holds another's data");
    second.read_at(0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 2), "export two holds another's data");
    // The empty name is the first export.
    qemu_io(&addr.nbd_uri(""), &["read -P 1 0 64k".into()]);

    handle.close_export(0);
    assert!(handle.is_export_closed(0) && !handle.is_export_closed(1));
    let out = pmcache_testkit::run(
        Command::new("qemu-io").args(["-f", "raw", &addr.nbd_uri("one"), "-c", "read 0 4k"]),
        TIMEOUT,
    );
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("no longer served"), "{text}");
    qemu_io(&addr.nbd_uri("two"), &["read -P 3 6M 4k".into()]);
    assert!(!handle.is_shutdown());
    handle.close_export(1);
    assert!(handle.is_shutdown(), "closing the last export stops the server");
    running.stop().expect("stopped");
}
