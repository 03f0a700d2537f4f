//! nbdinfo and nbdcopy (libnbd) against `pmcache serve`: the advertised size, block sizes
//! and flags, and a multi-connection copy in and out through a cache smaller than the data.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

const TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn nbdinfo_reports_the_export() {
    require_tool("nbdinfo", "libnbd-bin");
    let setup = Setup::new("nbdinfo", 300 * MIB, 4 * MIB);
    let server = setup.serve(Via::Unix, &[]);
    let uri =
        format!("nbd+unix:///{EXPORT}?socket={}", setup.shm.path().join("nbd.sock").display());
    let out = run_ok(Command::new("nbdinfo").args(["--json", &uri]), TIMEOUT);
    let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo json");
    assert_eq!(v["protocol"], "newstyle-fixed", "{v}");
    let e = &v["exports"][0];
    assert_eq!(e["export-name"], EXPORT, "{v}");
    assert_eq!(e["export-size"], 300 * MIB, "{v}");
    assert_eq!(e["block_size_minimum"], 512, "{v}");
    assert_eq!(e["block_size_preferred"], 4096, "{v}");
    assert_eq!(e["block_size_maximum"], 32 * MIB, "{v}");
    for flag in ["can_flush", "can_fua", "can_trim", "can_zero", "can_multi_conn"] {
        assert_eq!(e[flag], true, "{flag}: {v}");
    }
    assert_eq!(e["is_read_only"], false, "{v}");
    // Over TCP too, listing the export.
    drop(server);
    let server = setup.serve(Via::Tcp, &[]);
    let out = run_ok(Command::new("nbdinfo").args(["--list", "--json", &server.uri]), TIMEOUT);
    let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo json");
    assert_eq!(v["exports"][0]["export-name"], EXPORT, "{v}");
    server.terminate();
}

#[test]
fn nbdcopy_roundtrip_multi_conn() {
    require_tool("nbdcopy", "libnbd-bin");
    let size_bytes = 48 * MIB as usize;
    let setup = Setup::new("nbdcopy", size_bytes as u64, 8 * MIB);
    std::fs::write(&setup.backing, vec![0x5a; size_bytes]).expect("dirty the backing");
    let server = setup.serve(Via::Tcp, &[]);
    let src = setup.disk.path().join("src.img");
    let mut data = pseudo_random(size_bytes, 7);
    data[(4 << 20)..(6 << 20)].fill(0);
    std::fs::write(&src, &data).expect("write src");
    let src_s = src.to_str().expect("utf8");
    run_ok(
        Command::new("nbdcopy").args(["--connections=4", "--requests=32", src_s, &server.uri]),
        TIMEOUT,
    );
    let out = setup.disk.path().join("out.img");
    let out_s = out.to_str().expect("utf8");
    run_ok(Command::new("nbdcopy").args(["--connections=4", &server.uri, out_s]), TIMEOUT);
    assert!(read_file(&out) == data, "nbdcopy out differs from the source");
    let stats = setup.stats();
    assert!(stats["writebacks"].as_u64().unwrap_or(0) > 0, "{stats}");
    server.terminate();
}
