//! The `pmcache` command's behaviour around `serve`: refusals that leave the medium
//! untouched (a cache of another backing store, foreign data, a cache already served),
//! `check` on a healthy and a corrupted cache, `stats --json` / `--prometheus`, `flush`,
//! SIGTERM shutdown, a second signal during a slow shutdown, and `detach` online and offline.

use std::process::Command;
use std::time::Duration;

use pmcache_nbd::codec::{CMD_FLAG_FUA, CMD_READ};

use crate::common::*;

/// `pmcache serve ARGS`, run to completion (a refused start).
fn serve_once(args: &[&str]) -> std::process::Output {
    run(Command::new(PMCACHE).arg("serve").args(args), Duration::from_secs(30))
}

fn serve_refused(setup: &Setup, backing: &std::path::Path) -> std::process::Output {
    serve_refused_with(setup, backing, &["--cache-size", &setup.cache_bytes.to_string()])
}

/// `serve_refused` with `extra` arguments in place of `--cache-size`.
fn serve_refused_with(
    setup: &Setup,
    backing: &std::path::Path,
    extra: &[&str],
) -> std::process::Output {
    let (cache, backing, control) =
        (setup.cache_arg(), backing.display().to_string(), setup.control_arg());
    let mut args = vec!["--cache", &cache, "--backing", &backing, "--control", &control];
    args.extend(["--listen", "127.0.0.1:0"]);
    args.extend(extra);
    serve_once(&args)
}

#[test]
fn serve_refuses_a_cache_of_another_backing_store_without_touching_it() {
    let setup = Setup::new("other", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(0, &[7; 8192], 0); // dirty blocks in the cache
    server.kill9();
    let before = read_file(&setup.cache);
    // Same size, another file.
    let other = setup.disk.path().join("other.img");
    std::fs::File::create(&other).and_then(|f| f.set_len(64 * MIB)).expect("other backing");
    let out = serve_refused(&setup, &other);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&setup.cache_arg())
            && err.contains("this cache belongs to another backing store")
            && err.contains("67108864 bytes with fingerprint"),
        "{err}"
    );
    assert!(read_file(&setup.cache) == before, "a refused serve changed the medium");
    assert!(read_file_at(&other, 0, 8192) == vec![0u8; 8192]);
    // The right backing store still attaches and has the data.
    let server = setup.serve(Via::Tcp, &[]);
    assert_eq!(NbdClient::ready(server.addr()).read_at(0, 8192), vec![7u8; 8192]);
    server.kill9();

    // Another file moved onto the backing store's path (same path, same size): refused by
    // its inode. Checked by path and size alone, the cache would attach and serve the old
    // file's blocks.
    let before = read_file(&setup.cache);
    let original = setup.disk.path().join("original.img");
    std::fs::rename(&setup.backing, &original).expect("keep the original");
    std::fs::rename(&other, &setup.backing).expect("another file onto the path");
    let out = serve_refused(&setup, &setup.backing);
    assert_refused(&out, "this cache belongs to another file at the backing store's path");
    assert!(read_file(&setup.cache) == before, "a refused serve changed the medium");
    assert!(read_file_at(&setup.backing, 0, 8192) == vec![0u8; 8192]);
    std::fs::rename(&original, &setup.backing).expect("the original back");
    let server = setup.serve(Via::Tcp, &[]);
    assert_eq!(NbdClient::ready(server.addr()).read_at(0, 8192), vec![7u8; 8192]);
    server.terminate();

    // The same data in another file at the path (a copy: another inode) is refused too, with
    // the way out in the message: `--backing-moved` attaches it, and an offline detach with it
    // writes the dirty blocks back into the copy.
    let copy = setup.disk.path().join("copy.img");
    std::fs::copy(&setup.backing, &copy).expect("copy the backing file");
    std::fs::rename(&copy, &setup.backing).expect("the copy onto the path");
    let out = serve_refused(&setup, &setup.backing);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("another file at the backing store's path"), "{err}");
    assert!(err.contains("attach with --backing-moved"), "{err}");
    let server = setup.serve(Via::Tcp, &["--backing-moved"]);
    assert_eq!(NbdClient::ready(server.addr()).read_at(0, 8192), vec![7u8; 8192]);
    server.terminate();
    let (cache, backing) = (setup.cache_arg(), setup.backing_arg());
    let detach = ["detach", "--cache", &cache, "--backing", &backing];
    let out = setup.pmcache(&detach);
    assert!(!out.status.success() && stderr(&out).contains("--backing-moved"), "{}", stderr(&out));
    let out = setup.pmcache(&[&detach[..], &["--backing-moved"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(read_file_at(&setup.backing, 0, 8192) == vec![7u8; 8192], "not written back");
}

#[test]
fn serve_refuses_foreign_data_and_a_cache_already_served() {
    let setup = Setup::new("foreign", 64 * MIB, 4 * MIB);
    let foreign = pseudo_random(4 * MIB as usize, 99);
    std::fs::write(&setup.cache, &foreign).expect("foreign medium");
    let out = serve_refused(&setup, &setup.backing);
    assert_refused(&out, "holds data that is not a pmcache cache; refusing to overwrite it");
    assert!(read_file(&setup.cache) == foreign, "a refused serve changed foreign data");
    let out = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
    assert!(!out.status.success(), "check accepted foreign data");

    // A second server on a cache that is being served is refused, and the first is unharmed.
    std::fs::remove_file(&setup.cache).expect("rm");
    let server = setup.serve(Via::Tcp, &[]);
    let mut c = NbdClient::ready(server.addr());
    let data = pseudo_random(64 * 1024, 5);
    c.write_at(0, &data, 0);
    let out = serve_refused(&setup, &setup.backing);
    assert_refused(&out, "another pmcache server runs on this cache");
    assert!(c.read_at(0, 64 * 1024) == data);
    let stats = setup.stats();
    assert_eq!(stats["bytes_written"], 64 * 1024, "{stats}");
    server.terminate();
}

#[test]
fn check_flags_a_corrupted_metadata_entry() {
    let setup = Setup::new("check", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(0, &pseudo_random(256 * 1024, 1), CMD_FLAG_FUA);
    drop(c);
    // The medium is in /dev/shm (volatile): the stop wrote the 64 blocks back, and they stay
    // cached, clean.
    server.terminate();
    let out = setup.pmcache(&["check", "--json", "--cache", &setup.cache_arg()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check json");
    assert_eq!(
        (v["clean_shutdown"].clone(), v["clean"].clone(), v["dirty"].clone(), v["corrupt"].clone()),
        (true.into(), 64.into(), 0.into(), 0.into()),
        "{v}"
    );
    // Flip a bit of the 12-bit check field of the first used entry (meta_offset 4096, 16
    // bytes per slot): the entry no longer matches its checksum.
    let mut medium = read_file(&setup.cache);
    let slot = (0..v["slots"].as_u64().expect("slots") as usize)
        .find(|s| medium[4096 + 16 * s..4096 + 16 * s + 8] != [0; 8])
        .expect("a used entry");
    medium[4096 + 16 * slot + 6] ^= 0x10; // bit 52 of word 0
    std::fs::write(&setup.cache, &medium).expect("corrupt");
    let out = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
    assert!(!out.status.success(), "check passed a corrupt entry");
    assert!(stderr(&out).contains("1 corrupt metadata entries"), "{}", stderr(&out));
    // Serving drops the corrupt entry (counted), never trusts it.
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("0 torn and 1 corrupt entries dropped"), "{}", server.logs());
    server.terminate();
}

#[test]
fn stats_flush_sigterm_and_detach() {
    let setup = Setup::new("stats", 64 * MIB, 4 * MIB);
    // The cleaner leaves the 50 % of dirty blocks alone (below its target, never idle long
    // enough), so that the counts below are exact however slowly the test runs.
    let quiet = ["high_pct=90", "low_pct=80", "target_pct=80", "idle_ms=3600000"];
    let mut serve_args = vec!["--mode", "writeback"];
    serve_args.extend(quiet.iter().flat_map(|setting| ["--cleaner", *setting]));
    let server = setup.serve(Via::Tcp, &serve_args);
    let mut c = NbdClient::ready(server.addr());
    let data = pseudo_random(2 * MIB as usize, 8);
    c.write_at(MIB, &data, 0);
    assert_eq!(c.read_at(MIB, 4096), data[..4096]);
    let stats = setup.stats();
    assert_eq!(stats["mode"], "writeback", "{stats}");
    assert_eq!(stats["size_bytes"], 64 * MIB, "{stats}");
    assert_eq!(stats["dirty_slots"], 512, "{stats}");
    assert_eq!(stats["bytes_written"], 2 * MIB, "{stats}");
    assert!(stats["read_hits"].as_u64() >= Some(1), "{stats}");

    let out = run_ok(
        Command::new(PMCACHE).args(["stats", "--prometheus", "--control", &setup.control_arg()]),
        Duration::from_secs(10),
    );
    let mut samples = std::collections::HashMap::new();
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let kind = rest.split_whitespace().nth(1);
            assert!(matches!(kind, Some("counter" | "gauge")), "{line}");
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: f64 = value.parse().unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert!(name.starts_with("pmcache_"), "{line}");
        samples.insert(name.to_string(), value);
    }
    assert_eq!(samples.get("pmcache_dirty_slots"), Some(&512.0), "{out}");
    assert_eq!(samples.get("pmcache_mode_info{mode=\"writeback\"}"), Some(&1.0), "{out}");
    let table = run_ok(
        Command::new(PMCACHE).args(["stats", "--all", "--control", &setup.control_arg()]),
        Duration::from_secs(10),
    );
    assert!(table.lines().any(|l| l.starts_with("dirty_slots") && l.ends_with(" 512")), "{table}");
    // The summary, for a person: grouped, in human units.
    let summary = run_ok(
        Command::new(PMCACHE).args(["stats", "--control", &setup.control_arg()]),
        Duration::from_secs(10),
    );
    for group in ["cache ", "usage ", "reads ", "writes ", "cleaner ", "connections ", "errors "] {
        assert!(summary.lines().any(|l| l.starts_with(group)), "no {group:?} line: {summary}");
    }
    assert!(summary.contains("dirty 512 ("), "{summary}");

    // flush: everything written back, nothing dirty, the backing file has the data.
    let out = run_ok(
        Command::new(PMCACHE).args(["flush", "--control", &setup.control_arg()]),
        Duration::from_secs(30),
    );
    assert!(out.contains("all dirty blocks written back (512 were dirty)"), "{out}");
    assert_eq!(setup.stats()["dirty_slots"], 0);
    assert!(read_file_at(&setup.backing, MIB, data.len()) == data);

    // SIGTERM: a clean shutdown, with a client still connected. The medium is in /dev/shm
    // (volatile), so the stop writes the dirty block back first.
    c.write_at(8 * MIB, &[3; 4096], 0);
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean"), "{logs}");
    assert!(!setup.control.exists(), "control socket left behind");
    let out = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("last shutdown: clean"), "{text}");
    assert!(text.contains("513 clean, 0 dirty"), "{text}");
    assert!(read_file_at(&setup.backing, 8 * MIB, 4096) == vec![3u8; 4096]);

    // A dirty block left by a kill -9.
    let server = setup.serve(Via::Tcp, &[]);
    NbdClient::ready(server.addr()).write_at(8 * MIB, &[5; 4096], 0);
    server.kill9();

    // Offline detach with no server: needs --backing, then writes back the dirty block.
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    assert!(!out.status.success() && stderr(&out).contains("give --backing"), "{}", stderr(&out));
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 dirty blocks written back"));
    assert!(read_file_at(&setup.backing, 8 * MIB, 4096) == vec![5u8; 4096]);

    // Online detach after a kill -9 and a recovery: the server exits by itself, having
    // written everything back.
    let server = setup.serve(Via::Unix, &[]);
    let uri_sock = setup.shm.path().join("nbd.sock");
    assert!(uri_sock.exists());
    require_tool("qemu-io", "qemu-utils");
    let uri = format!("nbd+unix:///{EXPORT}?socket={}", uri_sock.display());
    run_ok(
        Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "write -P 4 16M 1M"]),
        Duration::from_secs(30),
    );
    server.kill9();
    assert!(uri_sock.exists(), "the killed server's socket stays behind");
    let server = setup.serve(Via::Unix, &[]); // replaces the stale socket
    // The offline detach dropped every clean copy: only the blocks written since are cached.
    assert!(
        server.logs().contains("(unclean shutdown): 0 clean and 256 dirty blocks"),
        "{}",
        server.logs()
    );
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(read_file_at(&setup.backing, 16 * MIB, MIB as usize) == vec![4u8; MIB as usize]);
    let (status, logs) = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{logs}");
    assert!(!uri_sock.exists(), "socket left behind after detach");
    let out = setup.pmcache(&["check", "--json", "--cache", &setup.cache_arg()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check json");
    assert_eq!((v["clean_shutdown"].clone(), v["dirty"].clone()), (true.into(), 0.into()), "{v}");
}

/// The medium is locked by the process serving it: a second server given another control
/// socket (so the socket probe cannot see the first) and an offline `detach` are refused by
/// the lock, and the first server keeps its data. An offline `detach` of a medium whose
/// superblock page reads blank (its metadata table still holding entries) changes nothing:
/// it attaches or refuses, never formats.
#[test]
fn the_medium_is_locked_and_detach_never_formats() {
    let setup = Setup::new("lock", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let mut c = NbdClient::ready(server.addr());
    let data = pseudo_random(64 * 1024, 3);
    c.write_at(0, &data, 0);
    let other_control = setup.disk.path().join("other.sock").display().to_string();
    let refused = |out: &std::process::Output, why: &str| {
        assert!(!out.status.success() && stderr(out).contains(why), "{}", stderr(out));
    };
    let detach_offline = |control: &str| {
        setup.pmcache(&[
            "detach",
            "--cache",
            &setup.cache_arg(),
            "--backing",
            &setup.backing_arg(),
            "--control",
            control,
        ])
    };
    let second_server = serve_once(&[
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
        "--control",
        &other_control,
        "--listen",
        "127.0.0.1:0",
    ]);
    refused(&second_server, "another process is using this cache medium");
    refused(&detach_offline(&other_control), "another process is using this cache medium");
    assert!(c.read_at(0, 64 * 1024) == data);
    server.kill9();

    // The superblock page zeroed; the metadata table still holds the dirty entries.
    let mut medium = read_file(&setup.cache);
    medium[..4096].fill(0);
    std::fs::write(&setup.cache, &medium).expect("zero the superblock page");
    refused(&detach_offline(&setup.control_arg()), "has no cache superblock");
    assert!(read_file(&setup.cache) == medium, "a refused detach changed the medium");
    // Nor does `serve`: only a new (missing or empty) medium is formatted without --force.
    // Formatting this one would lose the dirty blocks.
    refused(&serve_refused(&setup, &setup.backing), "has no cache superblock (its first 4 KiB");
    assert!(read_file(&setup.cache) == medium, "a refused serve changed the medium");
}

/// `--control` naming something that is not a socket (the medium itself, by a slip) is
/// refused and the file left alone, not deleted as a stale socket.
#[test]
fn a_control_path_that_is_not_a_socket_is_left_alone() {
    let setup = Setup::new("ctlfile", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    NbdClient::ready(server.addr()).write_at(0, &[5; 8192], 0);
    server.terminate();
    let medium = read_file(&setup.cache);
    let out = serve_once(&[
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
        "--control",
        &setup.cache_arg(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert_refused(&out, "exists and is not a socket; refusing to replace it");
    assert!(read_file(&setup.cache) == medium, "the medium changed");
    let server = setup.serve(Via::Tcp, &[]);
    assert_eq!(NbdClient::ready(server.addr()).read_at(0, 8192), vec![5u8; 8192]);
    server.terminate();
}

/// A new medium that cannot become a cache of this backing store (its size is not a whole
/// number of cache blocks) is refused and removed again: nothing is left half-made, and a
/// retry with a fitting backing store starts afresh.
#[test]
fn a_new_medium_that_cannot_serve_is_not_left_behind() {
    let setup = Setup::new("oddsize", 64 * MIB, 4 * MIB);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&setup.backing)
        .and_then(|f| f.set_len(64 * MIB + 512))
        .expect("odd-sized backing");
    let out = serve_refused(&setup, &setup.backing);
    assert_refused(&out, "not a non-zero multiple of the 4096-byte cache block");
    assert!(!setup.cache.exists(), "the refused medium was left behind");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&setup.backing)
        .and_then(|f| f.set_len(64 * MIB))
        .expect("fitting backing");
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("formatted"), "{}", server.logs());
    server.terminate();
}

/// An online detach whose write-back fails (the backing store refuses writes past 16 MiB)
/// fails too, saying so, and the cache keeps its dirty blocks: `detach` must not report
/// "wrote every block back" while the data is only in the cache. A restart
/// recovers them, and once the backing store takes writes again a detach writes them back.
#[test]
fn a_detach_whose_write_back_fails_says_so_and_keeps_the_dirty_blocks() {
    let setup = Setup::new("detachfail", 64 * MIB, 4 * MIB);
    let server = setup.serve_with_writes_failing_past(16 * MIB, &[]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(0, &[1; 4096], 0);
    c.write_at(32 * MIB, &[2; 4096], 0);
    drop(c);
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr(&out).contains("stopped without marking the cache clean"), "{}", stderr(&out));
    let (status, logs) = server.wait(Duration::from_secs(30));
    assert!(!status.success(), "{logs}");
    assert!(logs.contains("write-back before detach failed"), "{logs}");
    assert!(read_file_at(&setup.backing, 32 * MIB, 4096) == vec![0u8; 4096]);

    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("(unclean shutdown)"), "{}", server.logs());
    assert_eq!(NbdClient::ready(server.addr()).read_at(32 * MIB, 4096), vec![2u8; 4096]);
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--control",
        &setup.control_arg(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    server.wait(Duration::from_secs(30));
    assert!(read_file_at(&setup.backing, 0, 4096) == vec![1u8; 4096]);
    assert!(read_file_at(&setup.backing, 32 * MIB, 4096) == vec![2u8; 4096]);
}

/// A client that asked for 128 MiB of reads (far more than the socket buffers hold) and reads
/// none of the replies: the server's connection blocks sending, and holds a shutdown up until
/// its 5 s grace runs out.
fn a_client_that_stopped_reading(addr: std::net::SocketAddr) -> NbdClient {
    let mut stuck = NbdClient::ready(addr);
    for cookie in 0..4 {
        stuck.request(CMD_READ, 0, cookie, cookie * 32 * MIB, 32 * MIB as u32, &[]);
    }
    std::thread::sleep(Duration::from_millis(300));
    stuck
}

/// A shutdown waiting on a client that stopped reading (cut after a 5 s grace) is ended at
/// once by a second SIGINT: exit status 130, no clean mark, and the next start recovers the
/// acknowledged write.
#[test]
fn a_second_signal_stops_a_slow_shutdown_at_once_and_nothing_acknowledged_is_lost() {
    let setup = Setup::new("sig2", 256 * MIB, 64 * MIB);
    // No cleaner: the block must still be dirty (never written back) at the second signal.
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    let mut good = NbdClient::ready(server.addr());
    good.write_at(0, &[7; 4096], 0);
    let stuck = a_client_that_stopped_reading(server.addr());
    server.signal("INT");
    std::thread::sleep(Duration::from_millis(1000));
    let logs = server.logs();
    assert!(logs.contains("pmcache: shutting down"), "{logs}");
    assert!(!logs.contains("cache marked clean"), "the shutdown did not wait:\n{logs}");
    server.signal("INT");
    let started = std::time::Instant::now();
    let (status, logs) = server.wait(Duration::from_secs(3));
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(status.code(), Some(130), "{logs}");
    assert!(logs.contains("second signal: stopping at once"), "{logs}");
    assert!(!logs.contains("cache marked clean"), "{logs}");
    drop(stuck);

    let out = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("last shutdown: unclean"), "{text}");
    // The next start recovers the acknowledged (dirty, never written back) block.
    let server = setup.serve(Via::Tcp, &[]);
    let logs = server.logs();
    assert!(logs.contains("unclean shutdown") && logs.contains("1 dirty"), "{logs}");
    let mut c = NbdClient::ready(server.addr());
    assert!(c.read_at(0, 4096) == vec![7u8; 4096]);
    drop(c);
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean"), "{logs}");
}

/// An online `detach` waits for the server to mark the cache clean and remove its control
/// socket. A server that ends without that (here killed while a client that stopped reading
/// holds its shutdown up) leaves the socket behind: `detach` says so at once, rather than
/// waiting out its 60 s, and the next start recovers the acknowledged write.
#[test]
fn a_detach_whose_server_dies_reports_an_unclean_stop() {
    let setup = Setup::new("detachdie", 256 * MIB, 64 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let mut good = NbdClient::ready(server.addr());
    good.write_at(0, &[9; 4096], 0);
    let stuck = a_client_that_stopped_reading(server.addr());
    let detach = std::process::Command::new(PMCACHE)
        .args(["detach", "--cache", &setup.cache_arg(), "--control", &setup.control_arg()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("detach");
    std::thread::sleep(Duration::from_millis(1000));
    let started = std::time::Instant::now();
    server.kill9();
    let out = detach.wait_with_output().expect("detach output");
    assert!(started.elapsed() < Duration::from_secs(10), "detach waited {:?}", started.elapsed());
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr(&out).contains("stopped without marking the cache clean"), "{}", stderr(&out));
    drop(stuck);
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("unclean shutdown"), "{}", server.logs());
    let mut c = NbdClient::ready(server.addr());
    assert!(c.read_at(0, 4096) == vec![9u8; 4096]);
    drop(c);
    server.terminate();
}

/// A backing store failing under a write-through: the client gets the error (EFBIG arrives as
/// `ENOSPC`), the server says so in its log at WARN with the command and range, counts it in
/// `backing_errors`, and keeps serving the blocks the backing store takes.
#[test]
fn a_failing_backing_store_is_reported_in_the_log_and_the_stats() {
    let setup = Setup::new("backerr", 64 * MIB, 4 * MIB);
    let server = setup.serve_with_writes_failing_past(16 * MIB, &["--mode", "writethrough"]);
    let mut c = NbdClient::ready(server.addr());
    assert_eq!(setup.stats()["backing_errors"], 0);
    c.request(pmcache_nbd::codec::CMD_WRITE, 0, 1, 32 * MIB, 4096, &[3; 4096]);
    assert_eq!(c.simple_reply(), (pmcache_nbd::codec::NBD_ENOSPC, 1));
    c.write_at(0, &[4; 4096], 0);
    assert_eq!(c.read_at(0, 4096), vec![4u8; 4096]);
    let stats = setup.stats();
    assert!(stats["backing_errors"].as_u64() >= Some(1), "{stats}");
    let logs = server.logs();
    assert!(
        logs.contains("request failed in the export")
            && logs.contains("NBD_CMD_WRITE")
            && logs.contains("on the backing store"),
        "{logs}"
    );
    drop(c);
    server.terminate();
}

/// A backing store refusing the write-back of a dirty block (write-back mode, writes past
/// 16 MiB failing): the client's write is acknowledged and served from the cache, the server
/// says in its log that the store's writes fail and that dirty blocks stay, and `stats` shows
/// the store failing (writes) while a read from the store and a flush succeed: neither hides
/// the write-back it cannot take.
#[test]
fn a_failing_write_back_is_said_in_the_log_and_stays_in_the_stats() {
    let setup = Setup::new("wbfail", 64 * MIB, 4 * MIB);
    let server = setup.serve_with_writes_failing_past(16 * MIB, &["--mode", "writeback"]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(32 * MIB, &[7; 4096], 0);
    let said = "is failing: writes fail (last: write at byte 33554432";
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !server.logs().contains(said) {
        assert!(std::time::Instant::now() < deadline, "not said in the log: {}", server.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.logs().contains("the 1 dirty blocks stay in the cache"), "{}", server.logs());
    assert_eq!(c.read_at(20 * MIB, 4096), vec![0u8; 4096], "a read from the store");
    c.request(pmcache_nbd::codec::CMD_FLUSH, 0, 2, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 2), "the flush");
    let stats = setup.stats();
    assert_eq!(stats["backing_state"], "failing", "{stats}");
    assert_eq!(stats["backing_failing"], serde_json::json!(["writes"]), "{stats}");
    assert_eq!(c.read_at(32 * MIB, 4096), vec![7u8; 4096], "the dirty block");
    assert!(stats["dirty_slots"].as_u64() >= Some(1), "{stats}");
    drop(c);
    server.kill9();
}

/// Argument mistakes are refused before the medium is touched: a non-loopback address
/// without `--allow-remote` (refused only after opening the medium, it would leave a new
/// medium created, or an existing cache recovered and marked unclean), and a cache path in a
/// directory that does not exist (reported as such, not as a control-socket error).
#[test]
fn argument_mistakes_are_refused_before_the_medium_is_touched() {
    let setup = Setup::new("args", 64 * MIB, 4 * MIB);
    let out = serve_once(&[
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
        "--control",
        &setup.control_arg(),
        "--listen",
        "0.0.0.0:0",
    ]);
    assert_refused(&out, "without --allow-remote");
    assert!(!setup.cache.exists(), "the medium was created");
    assert!(!setup.control.exists(), "the control socket was left");

    let missing = setup.shm.path().join("no-such-dir").join("cache.pm");
    let out = serve_once(&[
        "--cache",
        &missing.display().to_string(),
        "--backing",
        &setup.backing_arg(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("the directory of the cache medium")
            && stderr(&out).contains("does not exist"),
        "{}",
        stderr(&out)
    );
}

/// `--cache-size` and `--block-size` shape a new cache. Given for an existing cache with
/// another geometry, they are refused with the cache's own figures, and nothing on the medium
/// changes; the figures the cache has are accepted. Neither is silently ignored, and
/// `format --force` with another `--cache-size` is refused too, rather than keeping the old
/// size.
#[test]
fn a_geometry_other_than_the_caches_is_refused_not_ignored() {
    let setup = Setup::new("geometry", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let data = pseudo_random(64 * 1024, 26);
    NbdClient::ready(server.addr()).write_at(0, &data, 0); // dirty blocks in the cache
    server.kill9();
    let before = read_file(&setup.cache);
    let refusals = [
        (
            vec!["--cache-size", "8M"],
            "is an existing medium of 4.0 MiB (4194304 bytes), not the 8.0 MiB (8388608 bytes) --cache-size asks for",
        ),
        (
            vec!["--block-size", "8192"],
            "holds a cache of 4096 B blocks, not the 8192 B --block-size asks for",
        ),
    ];
    for (extra, message) in &refusals {
        let out = serve_refused_with(&setup, &setup.backing, extra);
        assert!(!out.status.success(), "{extra:?} accepted");
        assert!(stderr(&out).contains(message), "{extra:?}: {}", stderr(&out));
        assert!(read_file(&setup.cache) == before, "a refused serve changed the medium");
    }
    let out = setup.pmcache(&[
        "format",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
        "--cache-size",
        "8M",
        "--force",
    ]);
    assert!(!out.status.success(), "format --force took another size");
    assert!(stderr(&out).contains("--cache-size asks for"), "{}", stderr(&out));
    assert!(read_file(&setup.cache) == before, "a refused format changed the medium");

    // The cache's own figures attach, and the dirty data is there.
    let server = setup.serve(Via::Tcp, &["--block-size", "4096"]);
    assert!(NbdClient::ready(server.addr()).read_at(0, 64 * 1024) == data);
    server.terminate();
}

/// Logs written to a file (not a terminal) carry no colour codes, and `--log-format json`
/// writes each log line as one JSON object a collector can parse.
#[test]
fn logs_to_a_file_have_no_colour_and_json_logs_parse() {
    let setup = Setup::new("logs", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let text = server.terminate();
    assert!(text.contains("NBD server listening"), "{text}");
    assert!(!text.contains('\u{1b}'), "escape codes in a log written to a file: {text:?}");

    let server = setup.serve(Via::Tcp, &["--log-format", "json"]);
    let logs = server.terminate();
    let listening: Vec<serde_json::Value> = logs
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .filter(|v: &serde_json::Value| v["fields"]["message"] == "NBD server listening")
        .collect();
    assert_eq!(listening.len(), 1, "{logs}");
    assert_eq!(listening[0]["level"], "INFO");
    assert!(!logs.contains('\u{1b}'), "{logs:?}");
}
