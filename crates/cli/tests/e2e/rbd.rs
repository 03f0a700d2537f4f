//! `pmcache serve` in front of a Ceph RBD image of a throwaway single-host cluster
//! (scripts/ceph/cluster.sh: one monitor, one OSD on a sparse file): fio verify over NBD in
//! write-back and write-through, then a detach and `rbd export` compared with what the client
//! read; kill -9 under load and a restart (the dead server's lock broken by the cluster); the
//! OSD stopped while serving (hits served, writes acknowledged, `stats` says unreachable, the
//! cleaner catches up when it returns); a second host's attach refused while the image's lock
//! is held, and while a dead host's cache holds dirty blocks on it (then taken over, and the
//! dead host refused when it comes back); a live host whose lock is broken writes nothing
//! more; and a monitor that does not answer at start, a precise error within the timeout.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pmcache_testkit::ceph::Cluster;

use crate::common::*;

/// `pmcache serve` on `setup`'s cache medium in front of image `spec`, with its state record
/// in the setup's directory (not /var/lib/pmcache).
fn serve_rbd(setup: &Setup, spec: &str, extra: &[&str]) -> Server {
    let state_dir = setup.disk.path().join("state");
    let mut args = vec!["--state-dir", state_dir.to_str().expect("utf-8")];
    args.extend_from_slice(extra);
    setup.serve_on(Path::new(spec), &args)
}

/// The whole export as the client reads it (nbdcopy to a file).
fn read_export(server: &Server, dir: &Path) -> Vec<u8> {
    require_tool("nbdcopy", "libnbd-bin");
    let out = dir.join("export-as-read.img");
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&out), Duration::from_secs(120));
    let data = std::fs::read(&out).expect("read the copy");
    let _ = std::fs::remove_file(&out);
    data
}

/// `pmcache detach` of the running server: every dirty block written back, the cache marked
/// clean, the image's lock released.
fn detach(setup: &Setup, server: Server) {
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    assert!(out.status.success(), "detach: {}", String::from_utf8_lossy(&out.stderr));
    let (status, logs) = server.wait(Duration::from_secs(60));
    assert!(status.success() && logs.contains("detached"), "{logs}");
}

/// Writes `data` at `offset` with qemu-io (one request per MiB); returns once acknowledged.
fn qemu_write(server: &Server, offset: u64, pattern: u8, len: u64) {
    require_tool("qemu-io", "qemu-utils");
    run_ok(
        Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            &format!("write -P {pattern} {offset} {len}"),
            &server.uri,
        ]),
        Duration::from_secs(120),
    );
}

/// Reads `len` bytes at `offset` with qemu-io, checking every byte is `pattern`.
fn qemu_read_check(server: &Server, offset: u64, pattern: u8, len: u64) {
    let out = run_ok(
        Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            &format!("read -P {pattern} {offset} {len}"),
            &server.uri,
        ]),
        Duration::from_secs(120),
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn fio_verify(server: &Server, dir: &Path) {
    require_fio_nbd();
    let out = run_ok(
        Command::new("fio")
            .args([
                "--name=verify",
                "--ioengine=nbd",
                &format!("--uri={}", server.uri),
                "--rw=randwrite",
                "--bs=4k",
                "--size=16m",
                "--numjobs=2",
                "--offset_increment=64m",
                "--iodepth=16",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
                "--verify_state_save=0",
                "--output-format=json",
            ])
            .current_dir(dir),
        Duration::from_secs(300),
    );
    let v = fio_json(&out);
    for job in v["jobs"].as_array().expect("jobs") {
        assert_eq!(job["error"], 0, "{job}");
        assert!(job["read"]["io_bytes"].as_u64().unwrap_or(0) >= 16 * MIB, "verify reads: {job}");
    }
}

/// fio verify through an 8 MiB cache (32 MiB written: write-back and eviction reach the
/// image) in write-back and write-through; after a detach, the image as `rbd export` reads it
/// is what the client read through the cache.
#[test]
fn fio_verify_in_both_modes_then_the_export_is_what_was_written() {
    let cluster = Cluster::start();
    for mode in ["writeback", "writethrough"] {
        let name = format!("fio-{mode}");
        cluster.create_image(&name, "256M");
        let setup = Setup::new(&format!("rbd-{mode}"), 0, 8 * MIB);
        let server = serve_rbd(&setup, &cluster.spec(&name, &[]), &["--mode", mode]);
        fio_verify(&server, setup.disk.path());
        let stats = setup.stats();
        assert_eq!(
            (stats["backing_engine"].as_str(), stats["backing_state"].as_str()),
            (Some("rbd"), Some("ok")),
            "{stats}"
        );
        match mode {
            "writeback" => assert!(stats["writebacks"].as_u64().unwrap_or(0) > 0, "{stats}"),
            _ => assert!(stats["evictions"].as_u64().unwrap_or(0) > 0, "{stats}"),
        }
        let seen = read_export(&server, setup.disk.path());
        assert_eq!(seen.len() as u64, 256 * MIB);
        detach(&setup, server);
        let exported = cluster.export(&name);
        assert!(exported == seen, "{mode}: rbd export differs from what the client read");
        assert!(exported.iter().any(|&b| b != 0), "{mode}: fio's data is in the image");
    }
}

/// kill -9 while fio writes; the restart attaches once the cluster has broken the dead
/// server's lock, recovers the cache, and every write acknowledged before the kill reads back —
/// through the cache and, after a detach, from the image itself.
#[test]
fn kill9_under_load_then_restart_keeps_acknowledged_writes() {
    let cluster = Cluster::start();
    cluster.create_image("crash", "128M");
    let spec = cluster.spec("crash", &[]);
    let setup = Setup::new("rbd-kill9", 0, 16 * MIB);
    let server = serve_rbd(&setup, &spec, &[]);
    qemu_write(&server, 0, 0x5a, 8 * MIB);
    require_fio_nbd();
    let load: Child = Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri),
            "--rw=randwrite",
            "--bs=4k",
            "--offset=32m",
            "--size=64m",
            "--iodepth=16",
            "--time_based",
            "--runtime=30",
        ])
        .current_dir(setup.disk.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("fio");
    std::thread::sleep(Duration::from_secs(3));
    server.kill9();
    let mut load = load;
    let _ = load.kill();
    let _ = load.wait();
    // The cache medium is volatile: its state record, filed under the image's identity,
    // refuses another cache over the image while this one may hold blocks the image lacks.
    let state_dir = setup.disk.path().join("state");
    let records: Vec<String> = std::fs::read_dir(&state_dir)
        .expect("the state directory")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        records.len() == 1
            && records[0].starts_with("rbd-")
            && records[0].ends_with(".pmcache-state"),
        "{records:?}"
    );
    let other = setup.shm.path().join("other.pm");
    let out = run(
        Command::new(PMCACHE).args(["serve", "--cache"]).arg(&other).args([
            "--cache-size",
            "16M",
            "--backing",
            &spec,
            "--state-dir",
            state_dir.to_str().expect("utf-8"),
            "--listen",
            "127.0.0.1:0",
        ]),
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("refusing to start: the state file"),
        "{stderr}"
    );
    let started = Instant::now();
    let server = serve_rbd(&setup, &spec, &[]);
    let logs = server.logs();
    assert!(logs.contains("unclean shutdown"), "{logs}");
    eprintln!(
        "restart attached in {:?} (the dead server's lock broken by the cluster)",
        started.elapsed()
    );
    qemu_read_check(&server, 0, 0x5a, 8 * MIB);
    detach(&setup, server);
    let exported = cluster.export("crash");
    assert!(
        exported[..(8 * MIB) as usize].iter().all(|&b| b == 0x5a),
        "the image lost acknowledged writes"
    );
}

/// The OSD stopped while pmcache serves: cached blocks are still read, writes are acknowledged
/// while the cache has room, `stats` says the backing store is unreachable; when the OSD is
/// back, the cleaner catches up and the image holds every write.
#[test]
fn osd_stopped_while_serving() {
    let cluster = Cluster::start();
    cluster.create_image("fault", "128M");
    // I/O to a missing OSD fails after 5 s here (30 s by default): anything that waited for
    // the OSD would take that long.
    let spec = cluster.spec("fault", &["rados_osd_op_timeout=5"]);
    let setup = Setup::new("rbd-osd", 0, 64 * MIB);
    let server = serve_rbd(&setup, &spec, &[]);
    qemu_write(&server, 0, 0x11, 4 * MIB);
    wait_for("the first writes written back", Duration::from_secs(60), || {
        setup.stats()["dirty_slots"].as_u64() == Some(0)
    });
    cluster.stop_osd();
    let started = Instant::now();
    qemu_read_check(&server, 0, 0x11, 4 * MIB);
    qemu_write(&server, 8 * MIB, 0x22, 4 * MIB);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "hits and writes waited for the OSD: {:?}",
        started.elapsed()
    );
    qemu_read_check(&server, 8 * MIB, 0x22, 4 * MIB);
    wait_for("stats saying unreachable", Duration::from_secs(60), || {
        setup.stats()["backing_state"].as_str() == Some("unreachable")
    });
    let stats = setup.stats();
    assert!(stats["dirty_slots"].as_u64().unwrap_or(0) > 0, "{stats}");
    assert!(
        stats["backing_last_error"].as_str().is_some_and(|e| e.contains("timed out")),
        "{stats}"
    );
    cluster.start_osd();
    wait_for("the cleaner catching up", Duration::from_secs(120), || {
        let stats = setup.stats();
        stats["dirty_slots"].as_u64() == Some(0) && stats["backing_state"].as_str() == Some("ok")
    });
    detach(&setup, server);
    let exported = cluster.export("fault");
    let at = |mib: u64| (mib * MIB) as usize;
    assert!(exported[..at(4)].iter().all(|&b| b == 0x11), "the first writes");
    assert!(
        exported[at(8)..at(12)].iter().all(|&b| b == 0x22),
        "the writes made while the OSD was down"
    );
}

/// A second host (another cache, another state directory) is refused while the image's lock
/// is held, with the holder's address; after a detach it attaches. A monitor that does not
/// answer fails the start with what was tried, within the connection timeout.
#[test]
fn a_second_host_is_refused_and_a_dead_monitor_is_a_precise_error() {
    let cluster = Cluster::start();
    cluster.create_image("shared", "64M");
    let spec = cluster.spec("shared", &[]);
    let first = Setup::new("rbd-first", 0, 8 * MIB);
    let server = serve_rbd(&first, &spec, &[]);
    qemu_write(&server, 0, 0x33, MIB);
    let second = Setup::new("rbd-second", 0, 8 * MIB);
    let state_dir = second.disk.path().join("state");
    let out = second
        .serve_refused_on(Path::new(&spec), &["--state-dir", state_dir.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is locked by client.") && stderr.contains(" at 127.0.0.1:"),
        "{stderr}"
    );
    assert!(!second.cache.exists(), "the refused start made a cache medium");
    detach(&first, server);
    let server = serve_rbd(&second, &spec, &[]);
    qemu_read_check(&server, 0, 0x33, MIB);
    detach(&second, server);

    let dead = "rbd:rbd/shared:mon_host=127.0.0.1\\:1:client_mount_timeout=3";
    let started = Instant::now();
    let out = second
        .serve_refused_on(Path::new(dead), &["--state-dir", state_dir.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("connecting to the monitors at \"127.0.0.1:1\"")
            && stderr.contains("timed out"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}

/// Two hosts, one image, both orders. (a) Host A's cache holds dirty blocks and A dies (kill -9;
/// its lock broken as the cluster would after the watch timeout): host B's attach is refused,
/// naming A's cache; B attaches with `takeover=1`, writes and detaches; A started again on its
/// own cache is refused (its blocks are older than B's) and writes nothing. (b) A serves with
/// dirty blocks and its lock is broken under it (`rbd lock rm`, which blocklists it): B takes
/// the image over and writes; A's write-back then fails with the lock-lost error, its blocks
/// stay dirty, and the image keeps B's data in both orders.
#[test]
fn a_second_cache_never_meets_a_returning_holders_older_blocks() {
    let cluster = Cluster::start();
    let never_clean = ["--mode", "writeback", "--cleaner", "order=none"];
    for (case, image) in [("dead", "dead-holder"), ("live", "live-holder")] {
        cluster.create_image(image, "64M");
        let spec = cluster.spec(image, &[]);
        let host_a = Setup::new(&format!("rbd-{case}-a"), 0, 8 * MIB);
        let host_b = Setup::new(&format!("rbd-{case}-b"), 0, 8 * MIB);
        // Host A's cache file outlives its server (kill -9 leaves /dev/shm as it is).
        let a = serve_rbd(&host_a, &spec, &never_clean);
        qemu_write(&a, 0, 0x41, MIB);
        assert!(cluster.image_meta(image, "pmcache.holder").is_some(), "no holder recorded");
        let b_state = host_b.disk.path().join("state");
        let b_state = b_state.to_str().expect("utf-8");
        let a_alive = if case == "dead" {
            a.kill9();
            cluster.break_lock(image);
            let out = host_b.serve_refused_on(Path::new(&spec), &["--state-dir", b_state]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{stderr}");
            assert!(stderr.contains("holds dirty blocks of another cache"), "{stderr}");
            assert!(stderr.contains("takeover=1"), "{stderr}");
            None
        } else {
            cluster.break_lock(image);
            Some(a)
        };
        let takeover = cluster.spec(image, &["takeover=1"]);
        let b = serve_rbd(&host_b, &takeover, &[]);
        qemu_write(&b, 0, 0x42, MIB);
        detach(&host_b, b);
        match a_alive {
            None => {
                let a_state = host_a.disk.path().join("state");
                let out = host_a.serve_refused_on(
                    Path::new(&spec),
                    &["--state-dir", a_state.to_str().expect("utf-8")],
                );
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert!(!out.status.success(), "the taken-over cache attached: {stderr}");
                assert!(stderr.contains("older"), "{stderr}");
            }
            Some(a) => {
                let out = host_a.pmcache(&["flush", "--control", &host_a.control_arg()]);
                let said = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(!out.status.success(), "a flush after the lock was lost: {said}");
                let stats = host_a.stats();
                assert!(
                    said.contains("lost the image's exclusive lock")
                        || stats.to_string().contains("lost the image's exclusive lock"),
                    "{said} {stats}"
                );
                assert!(stats["dirty_slots"].as_u64().unwrap_or(0) > 0, "{stats}");
                a.kill9();
            }
        }
        let exported = cluster.export(image);
        assert!(
            exported[..MIB as usize].iter().all(|&b| b == 0x42),
            "{case}: the image lost the second host's writes"
        );
    }
}
