//! `pmcache serve --vhost-user-blk`: what the server does before and around a VMM (the guest
//! side runs in scripts/guest/vhost-user-blk-e2e.sh): a socket path taken by a file or by a
//! live server is refused before the medium is touched, a stale socket left by a killed
//! server is replaced, each store of a shared cache is served on its own socket, and SIGTERM
//! stops every store cleanly and removes the sockets.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

const MARKER: &str = "vhost-user-blk:";

fn serve_vhost(setup: &Setup, socket: &Path, extra: &[&str]) -> Server {
    let mut cmd = Command::new(PMCACHE);
    cmd.args(["serve", "--cache", &setup.cache_arg(), "--cache-size"])
        .arg(setup.cache_bytes.to_string())
        .args(["--backing", &setup.backing_arg(), "--control", &setup.control_arg()])
        .arg("--vhost-user-blk")
        .arg(socket)
        .args(extra);
    Server::spawn_until(cmd, setup.shm.path(), MARKER, 1)
}

#[test]
fn the_socket_is_served_replaced_when_stale_and_refused_when_taken() {
    let setup = Setup::new("vhost-socket", 32 * MIB, 16 * MIB);
    let socket = setup.disk.path().join("vm.sock");

    // A regular file where the socket goes: refused, left alone, nothing formatted.
    std::fs::write(&socket, b"not a socket").unwrap();
    let mut cmd = Command::new(PMCACHE);
    cmd.args(["serve", "--cache", &setup.cache_arg(), "--backing", &setup.backing_arg()])
        .arg("--vhost-user-blk")
        .arg(&socket);
    let out = run(&mut cmd, Duration::from_secs(30));
    assert_refused(&out, "is not a socket");
    assert_eq!(std::fs::read(&socket).unwrap(), b"not a socket");
    assert!(!setup.cache.exists(), "the medium was not created");
    std::fs::remove_file(&socket).unwrap();

    let server = serve_vhost(&setup, &socket, &["--vhost-queues", "2"]);
    assert!(server.logs().contains("2 virtqueues"), "{}", server.logs());
    assert!(server.logs().contains("vhost-user-blk-pci,chardev=pmc,num-queues=2"));
    let stats = setup.stats();
    assert_eq!(stats["vhost_queues"], 2, "{stats}");
    assert_eq!(stats["vhost_connections"], 0);

    // A second server on the same socket (another cache) is refused: the first one answers.
    let other = Setup::new("vhost-socket-2", 32 * MIB, 16 * MIB);
    let mut cmd = Command::new(PMCACHE);
    cmd.args(["serve", "--cache", &other.cache_arg(), "--backing", &other.backing_arg()])
        .arg("--vhost-user-blk")
        .arg(&socket);
    assert_refused(&run(&mut cmd, Duration::from_secs(30)), "in use");

    // Killed, the server leaves its socket; the next start replaces it and recovers the
    // cache.
    server.kill9();
    assert!(socket.exists(), "a killed server leaves its socket");
    let server = serve_vhost(&setup, &socket, &[]);
    assert!(server.logs().contains("unclean shutdown"), "{}", server.logs());
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean"), "{logs}");
    assert!(!socket.exists(), "the socket is removed at the stop");
}

#[test]
fn each_store_is_served_on_its_own_socket() {
    let setup = Setup::new("vhost-stores", 32 * MIB, 32 * MIB);
    let b = setup.disk.path().join("b.img");
    std::fs::File::create(&b).and_then(|f| f.set_len(48 * MIB)).unwrap();
    let dir = setup.disk.path().join("sockets");
    std::fs::create_dir(&dir).unwrap();
    let mut cmd = Command::new(PMCACHE);
    cmd.args(["serve", "--cache", &setup.cache_arg(), "--cache-size"])
        .arg(setup.cache_bytes.to_string())
        .arg("--store")
        .arg(format!("a={}", setup.backing.display()))
        .arg("--store")
        .arg(format!("b={}", b.display()))
        .arg("--vhost-user-blk")
        .arg(&dir);
    let server = Server::spawn_until(cmd, setup.shm.path(), MARKER, 2);
    for name in ["a", "b"] {
        let socket = dir.join(format!("{name}.sock"));
        assert!(socket.exists(), "{}:\n{}", socket.display(), server.logs());
        let control = format!("{}.{name}.ctl", setup.cache.display());
        let out = run_ok(
            Command::new(PMCACHE).args(["stats", "--json", "--control", &control]),
            Duration::from_secs(30),
        );
        let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(stats["vhost_queues"], 1, "store {name}: {stats}");
    }
    let logs = server.terminate();
    assert_eq!(logs.matches("cache marked clean").count(), 2, "{logs}");
    assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "the sockets are removed");

    // Without a directory there, the stores are refused before the medium is touched.
    let mut cmd = Command::new(PMCACHE);
    cmd.args(["serve", "--cache", &setup.cache_arg()])
        .arg("--store")
        .arg(format!("a={}", setup.backing.display()))
        .arg("--vhost-user-blk")
        .arg(setup.disk.path().join("missing"));
    assert_refused(&run(&mut cmd, Duration::from_secs(30)), "must exist");
}
