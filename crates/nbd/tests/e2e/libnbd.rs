//! nbdinfo and nbdcopy (libnbd) against the server.

use std::process::Command;
use std::time::Duration;

use pmcache_nbd::BlockSizes;
use serde_json::Value;

use crate::common::{NAME, TestServer, Via, pseudo_random, read_file, require_tool, run_ok};

const TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn nbdinfo_reports_export() {
    require_tool("nbdinfo", "libnbd-bin");
    let bs = BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 1 << 20 };
    let server = TestServer::start(32 << 20, bs, Via::Tcp);
    let out = run_ok(Command::new("nbdinfo").args(["--json", &server.uri]), TIMEOUT);
    let v: Value = serde_json::from_str(&out).expect("nbdinfo json");
    assert_eq!(v["protocol"], "newstyle-fixed", "{v}");
    assert_eq!(v["structured"], true, "{v}");
    let e = &v["exports"][0];
    assert_eq!(e["export-name"], NAME, "{v}");
    assert_eq!(e["export-size"], 32 << 20, "{v}");
    assert_eq!(e["block_size_minimum"], 512, "{v}");
    assert_eq!(e["block_size_preferred"], 4096, "{v}");
    assert_eq!(e["block_size_maximum"], 1 << 20, "{v}");
    for flag in ["can_flush", "can_fua", "can_trim", "can_zero", "can_multi_conn", "can_df"] {
        assert_eq!(e[flag], true, "{flag}: {v}");
    }
    assert_eq!(e["is_read_only"], false, "{v}");
    server.stop();
}

#[test]
fn nbdinfo_lists_exports_over_unix_socket() {
    require_tool("nbdinfo", "libnbd-bin");
    let server = TestServer::start(1 << 20, BlockSizes::default(), Via::Unix);
    let out = run_ok(Command::new("nbdinfo").args(["--list", "--json", &server.uri]), TIMEOUT);
    let v: Value = serde_json::from_str(&out).expect("nbdinfo json");
    let names: Vec<&str> = v["exports"]
        .as_array()
        .expect("exports")
        .iter()
        .filter_map(|e| e["export-name"].as_str())
        .collect();
    assert_eq!(names, [NAME], "{v}");
    server.stop();
}

#[test]
fn nbdcopy_roundtrip_multi_conn() {
    require_tool("nbdcopy", "libnbd-bin");
    let size_bytes = 32usize << 20;
    let server = TestServer::start(size_bytes as u64, BlockSizes::default(), Via::Tcp);
    let src = server.path("src.img");
    let mut data = pseudo_random(size_bytes, 7);
    data[(4 << 20)..(6 << 20)].fill(0);
    std::fs::write(&src, &data).expect("write src");
    server.export.write_at(0, &vec![0x5a; size_bytes]).expect("dirty");
    let src_s = src.to_str().expect("utf8");
    run_ok(
        Command::new("nbdcopy").args(["--connections=4", "--requests=32", src_s, &server.uri]),
        TIMEOUT,
    );
    let mut actual = vec![0u8; size_bytes];
    server.export.read_at(0, &mut actual).expect("read export");
    assert!(actual == data, "export differs from source after nbdcopy in");

    let out = server.path("out.img");
    let out_s = out.to_str().expect("utf8");
    run_ok(Command::new("nbdcopy").args(["--connections=4", &server.uri, out_s]), TIMEOUT);
    assert!(read_file(&out) == data, "nbdcopy out differs from source");
    // CAN_MULTI_CONN is advertised, so nbdcopy used several connections in parallel.
    let stats = server.export.stats();
    assert!(stats.conns_opened >= 4, "{stats:?}");
    server.stop();
}
