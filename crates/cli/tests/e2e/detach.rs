//! `pmcache detach` hands the backing store over to be used alone: a detached cache keeps no
//! copy of its blocks, so what is written to the backing store meanwhile is what a later
//! attach of the same cache serves — after an online detach (the control socket), an offline
//! one (`detach --backing`), and the detach of one store of a shared medium.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use pmcache_testkit::qemu_io;

use crate::common::*;

fn io(uri: &str, cmds: &[&str]) -> String {
    let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
    qemu_io(uri, &cmds, Duration::from_secs(60))
}

fn text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Writes `len` bytes of `byte` at `offset` of the file at `path` directly, as a user of the
/// backing store alone would, and syncs them.
fn write_directly(path: &Path, offset: u64, len: usize, byte: u8) {
    let file = std::fs::OpenOptions::new().write(true).open(path).expect("open the backing file");
    file.write_all_at(&vec![byte; len], offset).expect("write the backing file");
    file.sync_all().expect("sync the backing file");
}

/// 1 MiB written through pmcache, an online `detach`, 1 MiB of other data written to the
/// backing file directly, the same cache served again: the new data is read, not the copy
/// the cache held.
#[test]
fn after_an_online_detach_the_backing_stores_own_writes_are_served() {
    let setup = Setup::new("detach-online", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    io(&server.uri, &["write -P 0x11 0 1M", "read -P 0x11 0 1M"]);
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let (status, logs) = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{logs}");
    assert!(read_file_at(&setup.backing, 0, MIB as usize).iter().all(|&b| b == 0x11));

    write_directly(&setup.backing, 0, MIB as usize, 0x22);
    let server = setup.serve(Via::Tcp, &[]);
    io(&server.uri, &["read -P 0x22 0 1M"]);
    assert!(logs.contains("256 clean copies dropped"), "{logs}");
    assert!(server.logs().contains("(clean shutdown): 0 clean and 0 dirty"), "{}", server.logs());
    server.terminate();
}

/// The same after an offline `detach --backing` of a cache left by a kill -9 with its 1 MiB
/// dirty: written back, and its copies dropped.
#[test]
fn after_an_offline_detach_the_backing_stores_own_writes_are_served() {
    let setup = Setup::new("detach-offline", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    io(&server.uri, &["write -P 0x11 0 1M"]);
    server.kill9();
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(read_file_at(&setup.backing, 0, MIB as usize).iter().all(|&b| b == 0x11));

    write_directly(&setup.backing, 0, MIB as usize, 0x22);
    let server = setup.serve(Via::Tcp, &[]);
    io(&server.uri, &["read -P 0x22 0 1M"]);
    assert!(
        text(&out).contains("256 dirty blocks written back, 256 clean copies dropped"),
        "{}",
        text(&out)
    );
    assert!(server.logs().contains("(clean shutdown): 0 clean and 0 dirty"), "{}", server.logs());
    server.terminate();
}

/// One store of a shared medium detached (`detach --store a`) while b is served on: a's
/// copies are dropped, b's kept; a's backing file written directly is what a serves next.
#[test]
fn after_a_store_is_detached_its_backing_stores_own_writes_are_served() {
    let setup = Setup::new("detach-store", 32 * MIB, 64 * MIB);
    let b = setup.disk.path().join("b.img");
    std::fs::File::create(&b).and_then(|f| f.set_len(32 * MIB)).expect("backing b");
    let stores = [
        "--store".to_string(),
        format!("a={}", setup.backing.display()),
        "--store".to_string(),
        format!("b={}", b.display()),
    ];
    let serve = || {
        let mut cmd = std::process::Command::new(PMCACHE);
        cmd.args(["serve", "--cache", &setup.cache_arg(), "--cache-size"])
            .arg(setup.cache_bytes.to_string())
            .args(["--listen", "127.0.0.1:0"])
            .args(&stores);
        Server::spawn(cmd, setup.shm.path())
    };
    let server = serve();
    let uri = |server: &Server, store: &str| format!("nbd://{}/{store}", server.addr());
    io(&uri(&server, "a"), &["write -P 0x11 0 1M"]);
    io(&uri(&server, "b"), &["write -P 0x33 0 1M"]);
    let out = setup.pmcache(&["detach", "--cache", &setup.cache_arg(), "--store", "a"]);
    assert!(out.status.success(), "{}", text(&out));
    write_directly(&setup.backing, 0, MIB as usize, 0x22);
    io(&uri(&server, "b"), &["read -P 0x33 0 1M"]);
    let first_logs = server.terminate();

    let server = serve();
    io(&uri(&server, "a"), &["read -P 0x22 0 1M"]);
    io(&uri(&server, "b"), &["read -P 0x33 0 1M"]);
    let detached = "store \"a\": cache marked clean and detached (every block written back, 256 \
                    clean copies dropped)";
    assert!(first_logs.contains(detached), "{first_logs}");
    let logs = server.logs();
    assert!(logs.contains("store \"a\" (clean shutdown): 0 clean and 0 dirty"), "{logs}");
    assert!(logs.contains("store \"b\" (clean shutdown): 256 clean"), "{logs}");
    server.terminate();
}
