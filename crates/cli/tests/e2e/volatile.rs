//! A cache on a volatile medium (a file in /dev/shm, tmpfs): a stop writes every dirty block
//! back before the cache is marked clean; the attachment is recorded in a state file beside
//! the backing file, and a start over a backing store whose cache was lost with dirty blocks
//! is refused, changing nothing, until `--accept-stale-backing`. A control `flush` goes
//! through the running cleaner. A medium on a disk file system keeps its dirty blocks at a
//! stop.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;

/// The state file `serve` keeps by default: the backing file's path + ".pmcache-state".
fn state_path(setup: &Setup) -> PathBuf {
    let mut name = setup.backing.as_os_str().to_owned();
    name.push(".pmcache-state");
    PathBuf::from(name)
}

/// The `key=value` lines of the state file.
fn state(setup: &Setup) -> std::collections::HashMap<String, String> {
    let text = std::fs::read_to_string(state_path(setup))
        .unwrap_or_else(|e| panic!("{}: {e}", state_path(setup).display()));
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Writes `chunks` pieces of 1 MiB of distinct data, every other MiB of the first
/// `2 * chunks` MiB, and returns them with their offsets.
fn write_chunks(c: &mut NbdClient, chunks: u64, seed: u64) -> Vec<(u64, Vec<u8>)> {
    (0..chunks)
        .map(|i| {
            let data = pseudo_random(MIB as usize, seed + i);
            let offset = 2 * i * MIB;
            c.write_at(offset, &data, 0);
            (offset, data)
        })
        .collect()
}

fn assert_backing_holds(setup: &Setup, written: &[(u64, Vec<u8>)], what: &str) {
    for (offset, data) in written {
        assert!(
            read_file_at(&setup.backing, *offset, data.len()) == *data,
            "{what}: the backing file lacks the acknowledged data at byte {offset}"
        );
    }
}

/// SIGTERM on a medium in /dev/shm with 48 MiB of dirty blocks that no cleaner wrote back
/// (`order=none`): the server writes every one back before it marks the cache clean, exits 0,
/// and the backing file holds every acknowledged byte; the state file says so.
#[test]
fn sigterm_on_a_volatile_medium_writes_every_dirty_block_back() {
    let setup = Setup::new("volstop", 256 * MIB, 64 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    assert!(server.logs().contains("the cache medium is volatile (tmpfs"), "{}", server.logs());
    let recorded = state(&setup);
    assert_eq!(recorded["cache_volatile"], "true", "{recorded:?}");
    assert_eq!(recorded["backing_stale"], "true", "{recorded:?}");
    assert_eq!(Path::new(&recorded["cache"]), std::fs::canonicalize(&setup.cache).unwrap());
    let mut c = NbdClient::ready(server.addr());
    let written = write_chunks(&mut c, 48, 100);
    let stats = setup.stats();
    assert_eq!(stats["dirty_slots"], 48 * 256, "{stats}");
    assert_eq!(stats["cleaner_blocks_cleaned"], 0, "{stats}");
    assert!(read_file_at(&setup.backing, 0, MIB as usize) != written[0].1, "written back early");

    let logs = server.terminate();
    assert!(logs.contains("writing back 12288 dirty blocks"), "{logs}");
    assert!(logs.contains("12288 of 12288 blocks written back"), "{logs}");
    assert!(logs.contains("cache marked clean (every block written back"), "{logs}");
    assert!(!setup.control.exists(), "control socket left behind");
    assert_backing_holds(&setup, &written, "after SIGTERM");
    let recorded = state(&setup);
    assert_eq!(recorded["backing_stale"], "false", "{recorded:?}");
    let out = setup.pmcache(&["check", "--json", "--cache", &setup.cache_arg()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check json");
    assert_eq!((v["clean_shutdown"].clone(), v["dirty"].clone()), (true.into(), 0.into()), "{v}");
    // The state file's own promise: the medium can go now, and the next start formats anew.
    std::fs::remove_file(&setup.cache).expect("rm medium");
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("formatted"), "{}", server.logs());
    let mut c = NbdClient::ready(server.addr());
    assert!(c.read_at(0, MIB as u32) == written[0].1);
    drop(c);
    server.terminate();
}

/// kill -9 with dirty blocks in a volatile cache, then the medium deleted (as a reboot would):
/// `serve` refuses to format a new cache over the stale backing store, says what was lost
/// and how to go on, and changes nothing — nor for an empty re-created medium, nor for
/// another medium while the old cache is still there. `--accept-stale-backing` starts.
#[test]
fn a_lost_volatile_cache_is_refused_until_accepted() {
    let setup = Setup::new("vollost", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(0, &[7; 65536], 0);
    assert_eq!(setup.stats()["dirty_slots"], 16);
    server.kill9();
    let backing = read_file(&setup.backing);
    let state_before = std::fs::read(state_path(&setup)).expect("state file");

    // The old cache is still there, and another medium is asked for.
    let other = setup.shm.path().join("other.pm");
    let out = setup.serve_refused(&other, &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("is still there") && err.contains("pmcache detach --cache"), "{err}");
    assert!(!other.exists(), "a refused serve created the other medium");

    std::fs::remove_file(&setup.cache).expect("rm medium");
    let out = setup.serve_refused(&setup.cache, &[]);
    assert!(!out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    for part in [
        "refusing to start",
        &state_path(&setup).display().to_string(),
        "the medium file no longer exists",
        "The blocks that were dirty in it are lost",
        "Nothing was changed",
        "--accept-stale-backing",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert!(!setup.cache.exists(), "a refused serve created the medium");

    std::fs::write(&setup.cache, b"").expect("empty medium");
    let out = setup.serve_refused(&setup.cache, &[]);
    assert_refused(&out, "the medium file is empty");
    assert_eq!(std::fs::metadata(&setup.cache).expect("medium").len(), 0, "medium changed");
    assert!(read_file(&setup.backing) == backing, "a refused serve changed the backing file");
    assert!(std::fs::read(state_path(&setup)).expect("state") == state_before);

    // The operator accepts the loss: a new cache over the backing store as it is.
    let server = setup.serve(Via::Tcp, &["--accept-stale-backing"]);
    let logs = server.logs();
    assert!(
        logs.contains("warning: --accept-stale-backing") && logs.contains("formatted"),
        "{logs}"
    );
    let mut c = NbdClient::ready(server.addr());
    assert_eq!(c.read_at(0, 4096), vec![0u8; 4096], "the lost blocks read as the backing's");
    c.write_at(0, &[9; 4096], 0);
    drop(c);
    server.terminate();
    assert_eq!(state(&setup)["backing_stale"], "false");
    assert!(read_file_at(&setup.backing, 0, 4096) == vec![9u8; 4096]);
    // From then on the new cache is the recorded one: it attaches without the flag.
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("(clean shutdown)"), "{}", server.logs());
    assert_eq!(NbdClient::ready(server.addr()).read_at(0, 4096), vec![9u8; 4096]);
    server.terminate();
}

/// kill -9 with dirty blocks, restart on the same volatile medium: the record matches the
/// cache, which recovers them, and an offline `detach` records the backing store complete.
#[test]
fn a_volatile_cache_that_survived_attaches_and_detach_records_it_written_back() {
    let setup = Setup::new("volkept", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    NbdClient::ready(server.addr()).write_at(MIB, &[4; 8192], 0);
    server.kill9();
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    assert!(server.logs().contains("(unclean shutdown): 0 clean and 2 dirty"), "{}", server.logs());
    assert_eq!(NbdClient::ready(server.addr()).read_at(MIB, 8192), vec![4u8; 8192]);
    server.kill9();
    assert_eq!(state(&setup)["backing_stale"], "true");
    let out = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("the backing store holds every block"));
    assert_eq!(state(&setup)["backing_stale"], "false");
    assert!(read_file_at(&setup.backing, MIB, 8192) == vec![4u8; 8192]);
    std::fs::remove_file(&setup.cache).expect("rm medium");
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("formatted"), "{}", server.logs());
    server.terminate();
}

/// `pmcache flush` on a server whose cleaner rests (far below its watermarks, never idle)
/// is served by the cleaner: every dirty block written back through its queue
/// (`cleaner_blocks_cleaned`), `dirty_slots` 0 in `pmcache stats`, the data in the backing
/// file. With `order=none` (no cleaner) the flush writes back through a lane instead.
#[test]
fn a_control_flush_goes_through_the_running_cleaner() {
    let setup = Setup::new("volflush", 256 * MIB, 64 * MIB);
    let resting = [
        "--cleaner",
        "high_pct=100",
        "--cleaner",
        "low_pct=99",
        "--cleaner",
        "target_pct=99",
        "--cleaner",
        "idle_target_pct=99",
        "--cleaner",
        "idle_ms=3600000",
    ];
    let server = setup.serve(Via::Tcp, &resting);
    let mut c = NbdClient::ready(server.addr());
    let written = write_chunks(&mut c, 8, 300);
    let stats = setup.stats();
    assert_eq!(
        (stats["dirty_slots"].clone(), stats["cleaner_blocks_cleaned"].clone()),
        (2048.into(), 0.into()),
        "{stats}"
    );
    let out = setup.pmcache(&["flush", "--control", &setup.control_arg()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("all dirty blocks written back (2048 were dirty)"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stats = setup.stats();
    assert_eq!(stats["dirty_slots"], 0, "{stats}");
    assert_eq!(stats["cleaner_blocks_cleaned"], 2048, "{stats}");
    assert_backing_holds(&setup, &written, "after flush");

    // No cleaner: the flush falls back to a lane.
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "order=none"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let more = pseudo_random(MIB as usize, 400);
    c.write_at(100 * MIB, &more, 0);
    assert_eq!(setup.stats()["dirty_slots"], 256);
    let out = setup.pmcache(&["flush", "--control", &setup.control_arg()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stats = setup.stats();
    assert_eq!(stats["dirty_slots"], 0, "{stats}");
    assert_eq!(stats["cleaner_blocks_cleaned"], 2048, "{stats}");
    assert!(read_file_at(&setup.backing, 100 * MIB, more.len()) == more);
    drop(c);
    server.terminate();
}

/// A medium on a disk file system in msync mode (standing in for real PM here: a medium that
/// survives a reboot) keeps the plain stop: marked clean with its dirty blocks kept, no
/// write-back, no state file.
#[test]
fn a_medium_that_survives_a_reboot_keeps_its_dirty_blocks_at_a_stop() {
    let Some(dir) = disk_dir() else {
        eprintln!("skipped: the test scratch directory is on tmpfs, no disk medium to try");
        return;
    };
    let setup = Setup::new("voldisk", 64 * MIB, 4 * MIB);
    let disk = TempDir::new_in(&dir, "voldisk");
    let cache = disk.path().join("cache.pm");
    let extra = ["--cleaner", "order=none", "--medium-sync", "msync"];
    let server = setup.serve_with_cache(&cache, Via::Tcp, &extra);
    assert!(!server.logs().contains("volatile"), "{}", server.logs());
    assert!(server.logs().contains("medium: msync"), "{}", server.logs());
    NbdClient::ready(server.addr()).write_at(0, &[6; 8192], 0);
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean") && !logs.contains("writing back"), "{logs}");
    assert!(!state_path(&setup).exists(), "a state file for a medium that is not volatile");
    let out = setup.pmcache(&["check", "--json", "--cache", &cache.display().to_string()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check json");
    assert_eq!((v["clean_shutdown"].clone(), v["dirty"].clone()), (true.into(), 2.into()), "{v}");
    assert!(read_file_at(&setup.backing, 0, 8192) == vec![0u8; 8192], "written back");
}

/// A stop on a volatile medium whose write-back the backing store refuses (writes past 16 MiB
/// fail) fails, saying so: exit status non-zero, the cache not marked clean, its dirty
/// blocks kept, the state file still saying the backing store may be stale. A restart on the
/// medium recovers them, and a stop once the backing store takes writes writes them back.
#[test]
fn a_stop_whose_write_back_fails_keeps_the_dirty_blocks_and_says_so() {
    let setup = Setup::new("volfail", 64 * MIB, 4 * MIB);
    let server = setup.serve_with_writes_failing_past(16 * MIB, &["--cleaner", "order=none"]);
    let mut c = NbdClient::ready(server.addr());
    c.write_at(0, &[1; 4096], 0);
    c.write_at(32 * MIB, &[2; 4096], 0);
    drop(c);
    server.signal("TERM");
    let (status, logs) = server.wait(Duration::from_secs(60));
    assert!(!status.success(), "{logs}");
    assert!(logs.contains("write-back before stopping failed"), "{logs}");
    assert!(logs.contains("a reboot loses them"), "{logs}");
    assert!(!logs.contains("cache marked clean"), "{logs}");
    assert_eq!(state(&setup)["backing_stale"], "true");
    let out = setup.pmcache(&["check", "--json", "--cache", &setup.cache_arg()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check json");
    assert_eq!((v["clean_shutdown"].clone(), v["dirty"].clone()), (false.into(), 1.into()), "{v}");
    assert!(read_file_at(&setup.backing, 0, 4096) == vec![1u8; 4096]);
    assert!(read_file_at(&setup.backing, 32 * MIB, 4096) == vec![0u8; 4096]);

    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    assert!(server.logs().contains("(unclean shutdown)"), "{}", server.logs());
    server.terminate();
    assert!(read_file_at(&setup.backing, 32 * MIB, 4096) == vec![2u8; 4096]);
    assert_eq!(state(&setup)["backing_stale"], "false");
}

/// Idle decay through the real server: after a burst below the target dirty share, nothing
/// is written back while writes go on; once the clients are quiet for `idle_ms`, the running
/// cleaner writes everything back (down to `idle_target_pct`, 0 %) without being asked.
#[test]
fn an_idle_server_writes_its_dirty_blocks_back_by_itself() {
    let setup = Setup::new("volidle", 256 * MIB, 64 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "idle_ms=500"]);
    let mut c = NbdClient::ready(server.addr());
    let written = write_chunks(&mut c, 8, 500);
    let dirty_after_burst = setup.stats()["dirty_slots"].as_u64().unwrap();
    assert!(dirty_after_burst > 0, "the burst left nothing dirty");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let stats = loop {
        let stats = setup.stats();
        if stats["dirty_slots"] == 0 || std::time::Instant::now() > deadline {
            break stats;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(stats["dirty_slots"], 0, "idle cleaning did not empty the cache: {stats}");
    assert!(stats["cleaner_blocks_cleaned"].as_u64().unwrap() >= 2048, "{stats}");
    assert_backing_holds(&setup, &written, "after idle cleaning");
    drop(c);
    server.terminate();
}

/// The state record of a backing file is found whichever path names the file: a start through
/// a symlink, and one after the file was renamed in its directory, are refused when its
/// volatile cache was lost with dirty blocks.
#[test]
fn a_lost_volatile_cache_is_found_through_a_symlink_and_after_a_rename() {
    let setup = Setup::new("vollost-names", 64 * MIB, 4 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    NbdClient::ready(server.addr()).write_at(0, &[7; 65536], 0);
    server.kill9();
    std::fs::remove_file(&setup.cache).expect("rm medium");
    let link = setup.disk.path().join("link.img");
    std::os::unix::fs::symlink(&setup.backing, &link).expect("symlink");
    let out = setup.serve_refused_on(&link, &[]);
    assert!(stderr(&out).contains("refusing to start"), "through a symlink: {}", stderr(&out));
    let renamed = setup.disk.path().join("renamed.img");
    std::fs::rename(&setup.backing, &renamed).expect("rename");
    let out = setup.serve_refused_on(&renamed, &[]);
    let err = stderr(&out);
    assert!(err.contains("refusing to start"), "after a rename: {err}");
    assert!(err.contains(&state_path(&setup).display().to_string()), "{err}");
    assert!(!setup.cache.exists(), "a refused serve created the medium");
}

/// A loop device attached under another number (what a reboot does to `loopN`, `dm-N` and
/// `sdX` names) is the same backing store: its record, named after the loop's backing file in
/// the state directory, is found, and the start refused when the volatile cache was lost.
#[test]
fn a_lost_volatile_cache_is_found_when_its_device_has_another_name() {
    let setup = Setup::new("vollost-loop", 64 * MIB, 4 * MIB);
    let image = setup.disk.path().join("disk.img");
    std::fs::File::create(&image).and_then(|f| f.set_len(64 * MIB)).expect("image");
    let Some(first) = attach_loop(&image) else { return };
    let state_dir = setup.shm.path().join("state");
    let dir = state_dir.display().to_string();
    let server = setup.serve_on(&first, &["--cleaner", "order=none", "--state-dir", &dir]);
    NbdClient::ready(server.addr()).write_at(0, &[7; 65536], 0);
    server.kill9();
    std::fs::remove_file(&setup.cache).expect("rm medium");
    let records: Vec<String> = std::fs::read_dir(&state_dir)
        .expect("state dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        records.len() == 1 && records[0].starts_with("loop-file-"),
        "the record is not named after the loop's file: {records:?}"
    );
    detach_loop(&first);
    // Another device takes the first number; the image comes back under another.
    let filler = setup.disk.path().join("filler.img");
    std::fs::File::create(&filler).and_then(|f| f.set_len(MIB)).expect("filler");
    let taken = attach_loop(&filler).expect("loop");
    let second = attach_loop(&image).expect("loop");
    assert_ne!(first, second, "the image came back under the same name");
    let out = setup.serve_refused_on(&second, &["--state-dir", &dir]);
    detach_loop(&second);
    detach_loop(&taken);
    let err = stderr(&out);
    assert!(err.contains("refusing to start") && err.contains("loop-file-"), "{err}");
    assert!(!setup.cache.exists(), "a refused serve created the medium");
}

/// A cache over a block device attaches, with its dirty blocks, when the device comes back
/// under another name (NVMe namespaces, `sdX` and `loopN` are numbered in the order they
/// appear, which a reboot may change): the superblock names the device by its persistent
/// name, not by its node's path.
#[test]
fn a_cache_attaches_when_its_device_has_another_name() {
    let setup = Setup::new("renamed-device", 64 * MIB, 4 * MIB);
    let image = setup.disk.path().join("disk.img");
    std::fs::File::create(&image).and_then(|f| f.set_len(64 * MIB)).expect("image");
    let Some(first) = attach_loop(&image) else { return };
    let server = setup.serve_on(&first, &["--cleaner", "order=none"]);
    NbdClient::ready(server.addr()).write_at(4096, &[0x3c; 65536], 0);
    server.kill9();
    detach_loop(&first);
    let filler = setup.disk.path().join("filler.img");
    std::fs::File::create(&filler).and_then(|f| f.set_len(MIB)).expect("filler");
    // The filler takes the freed node; other tests attach and detach loop devices meanwhile,
    // so the image may still get it back: then it is attached again, with one more filler.
    let mut taken = vec![attach_loop(&filler).expect("loop")];
    let second = loop {
        let second = attach_loop(&image).expect("loop");
        if second != first {
            break second;
        }
        detach_loop(&second);
        assert!(taken.len() < 8, "the image keeps coming back under {}", first.display());
        taken.push(attach_loop(&filler).expect("loop"));
    };
    let server = setup.serve_on(&second, &["--cleaner", "order=none"]);
    let read = NbdClient::ready(server.addr()).read_at(4096, 65536);
    let stats = setup.stats();
    server.terminate();
    detach_loop(&second);
    taken.iter().for_each(|device| detach_loop(device));
    assert!(read.iter().all(|&b| b == 0x3c), "the dirty blocks were not served after the rename");
    assert_eq!(stats["dirty_slots"], 16, "the dirty blocks were not recovered");
}

/// Attaches `file` to a free loop device; `None` (the test skipped, said on stderr) where this
/// machine has none.
fn attach_loop(file: &Path) -> Option<PathBuf> {
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("losetup (`apt-get install -y mount`): {e}"));
    if !out.status.success() {
        eprintln!("skipped: no loop device ({})", String::from_utf8_lossy(&out.stderr).trim());
        return None;
    }
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn detach_loop(device: &Path) {
    let _ = std::process::Command::new("losetup").arg("-d").arg(device).status();
}

fn qemu_io(server: &Server, cmds: &[&str]) -> String {
    let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
    pmcache_testkit::qemu_io(&server.uri, &cmds, Duration::from_secs(60))
}

/// A volatile cache served write-through and switched to write-back at run time: the state
/// record says the backing store may lack blocks before the switch takes effect, so that 4 MiB
/// written back later, then lost with the medium (kill -9, the medium deleted as a reboot
/// deletes /dev/shm), is refused at the next start as for a cache served write-back from the
/// start — never a new cache serving zeroes where the acknowledged writes were.
#[test]
fn a_switch_to_write_back_is_recorded_before_it_takes_effect() {
    let setup = Setup::new("volswitch", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &["--mode", "writethrough", "--cleaner", "order=none"]);
    assert_eq!(state(&setup)["backing_stale"], "false");
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=writeback"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(state(&setup)["backing_stale"], "true", "the switch was not recorded");
    qemu_io(&server, &["write -P 0x5a 0 4M"]);
    let stats = setup.stats();
    assert_eq!(
        (stats["mode"].as_str(), stats["dirty_slots"].as_u64()),
        (Some("writeback"), Some(1024))
    );
    server.kill9();
    std::fs::remove_file(&setup.cache).expect("rm medium");

    let out = setup.serve_refused(&setup.cache, &["--mode", "writethrough"]);
    assert!(!out.status.success(), "a new cache was served over the stale backing store");
    let err = stderr(&out);
    for part in [
        "refusing to start",
        "the medium file no longer exists",
        "The blocks that were dirty in it are lost",
        "--accept-stale-backing",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert!(!setup.cache.exists(), "a refused serve created the medium");
    assert!(read_file_at(&setup.backing, 0, (4 * MIB) as usize).iter().all(|&b| b == 0));
}

/// Back to write-through: once every dirty block is written back the record says the backing
/// store holds every block (and not before: a start refused until then), so a medium lost
/// after that starts a new cache, which serves the data from the backing store.
#[test]
fn a_switch_back_to_write_through_records_the_backing_store_complete() {
    let setup = Setup::new("volswitchback", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &["--mode", "writethrough", "--cleaner", "order=none"]);
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=write-back"]);
    assert!(out.status.success(), "{}", stderr(&out));
    qemu_io(&server, &["write -P 0x5b 0 4M"]);
    assert_eq!(state(&setup)["backing_stale"], "true");
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=writethrough"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(setup.stats()["dirty_slots"], 0);
    assert_eq!(state(&setup)["backing_stale"], "false", "not recorded complete");
    server.kill9();
    std::fs::remove_file(&setup.cache).expect("rm medium");
    let server = setup.serve(Via::Tcp, &["--mode", "writethrough"]);
    assert!(server.logs().contains("formatted"), "{}", server.logs());
    qemu_io(&server, &["read -P 0x5b 0 4M"]);
    server.terminate();
}

/// A switch to a mode that keeps dirty blocks whose record cannot be written (the state file's
/// path taken by a directory, so its rename fails) is refused, saying why, and the mode stays.
#[test]
fn a_switch_whose_record_cannot_be_written_is_refused() {
    let setup = Setup::new("volswitchfail", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &["--mode", "writethrough", "--cleaner", "order=none"]);
    std::fs::remove_file(state_path(&setup)).expect("rm record");
    std::fs::create_dir(state_path(&setup)).expect("a directory in its place");
    std::fs::write(state_path(&setup).join("keep"), b"x").expect("not empty");
    for mode in ["writeback", "write-only"] {
        let out =
            setup.pmcache(&["set", "--control", &setup.control_arg(), &format!("mode={mode}")]);
        assert!(!out.status.success(), "mode={mode} was switched to without its record");
        let err = stderr(&out);
        assert!(err.contains("refused") && err.contains("stays writethrough"), "{err}");
        assert!(err.contains(&state_path(&setup).display().to_string()), "{err}");
        assert_eq!(setup.stats()["mode"], "writethrough");
    }
    qemu_io(&server, &["write -P 0x5c 0 1M"]);
    assert_eq!(setup.stats()["dirty_slots"], 0);
    assert!(read_file_at(&setup.backing, 0, MIB as usize).iter().all(|&b| b == 0x5c));
    std::fs::remove_dir_all(state_path(&setup)).expect("rm the directory");
    server.terminate();
}
