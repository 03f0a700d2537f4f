//! fio with `ioengine=nbd` and crc32c verification over two connections.

use std::process::Command;
use std::time::Duration;

use pmcache_nbd::BlockSizes;
use serde_json::Value;

use crate::common::{TestServer, Via, require_tool, run_ok};

fn fio_verify(via: Via, extra: &[&str]) {
    require_tool("fio", "fio");
    let engines = run_ok(Command::new("fio").arg("--enghelp"), Duration::from_secs(10));
    assert!(
        engines.lines().any(|l| l.trim() == "nbd"),
        "this fio has no nbd engine (install Debian's `fio` package, built with libnbd)"
    );
    let server = TestServer::start(64 << 20, BlockSizes::default(), via);
    let uri_arg = format!("--uri={}", server.uri);
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=verify",
        "--ioengine=nbd",
        &uri_arg,
        "--rw=randwrite",
        "--size=16m",
        "--numjobs=2",
        "--offset_increment=16m",
        "--iodepth=16",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--output-format=json",
    ]);
    cmd.args(extra).arg("--verify_state_save=0").current_dir(server.dir.path());
    let out = run_ok(&mut cmd, Duration::from_secs(90));
    let json_start = out.find('{').expect("fio json");
    let v: Value = serde_json::from_str(&out[json_start..]).expect("fio json");
    let jobs = v["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 2, "{v}");
    for j in jobs {
        assert_eq!(j["error"], 0, "{j}");
        assert!(j["write"]["io_bytes"].as_u64().unwrap_or(0) >= 16 << 20, "{j}");
        assert!(j["read"]["io_bytes"].as_u64().unwrap_or(0) >= 16 << 20, "verify reads: {j}");
    }
    let stats = server.export.stats();
    assert!(stats.conns_opened >= 2, "{stats:?}");
    server.stop();
}

#[test]
fn fio_crc32c_verify_two_connections_tcp() {
    fio_verify(Via::Tcp, &["--bs=4k"]);
}

#[test]
fn fio_crc32c_verify_two_connections_unix_mixed_sizes() {
    fio_verify(Via::Unix, &["--bsrange=512-128k"]);
}
