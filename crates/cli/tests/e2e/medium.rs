//! The kinds of cache medium through the real server: a cache file on a disk file system is
//! refused with a message naming it, its file system and the ways out; with
//! `--medium-sync msync` it is served, every acknowledged write is synced to the file (the
//! server's mapping holds no dirty page), and the data survive a kill -9 and an offline
//! detach. `serve`'s startup line, `stats` and `check` name the kind: `msync` there,
//! `volatile` for the default in /dev/shm.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// A new directory on the disk the tests are built on; these tests need one.
fn disk_tempdir(tag: &str) -> TempDir {
    let dir = disk_dir()
        .expect("the test target's scratch directory is on tmpfs: no disk file system to try");
    TempDir::new_in(&dir, tag)
}

/// The file system type of `dir` as findmnt (util-linux) names it.
fn fs_type(dir: &Path) -> String {
    let out = run(
        Command::new("findmnt").args(["-n", "-o", "FSTYPE", "--target"]).arg(dir),
        Duration::from_secs(10),
    );
    assert!(out.status.success(), "findmnt: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn check_json(setup: &Setup, cache: &Path) -> serde_json::Value {
    let out = setup.pmcache(&["check", "--json", "--cache", &cache.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("check --json")
}

#[test]
fn a_cache_file_on_a_disk_is_refused_unless_msync_mode_is_asked_for() {
    let setup = Setup::new("mdisk", 64 * MIB, 8 * MIB);
    let disk = disk_tempdir("mdisk");
    let cache: PathBuf = disk.path().join("cache.pm");
    let fs = fs_type(disk.path());

    let out = setup.serve_refused(&cache, &[]);
    let message = stderr(&out);
    assert!(!out.status.success(), "{message}");
    assert!(
        message.contains(&format!("cache medium {} is a file on {fs}", cache.display())),
        "{message}"
    );
    for way_out in ["DAX file system", "device-dax", "/dev/shm", "--medium-sync msync"] {
        assert!(message.contains(way_out), "{way_out} missing: {message}");
    }
    assert!(!cache.exists(), "the refused medium was left behind");
    assert!(!setup.control.exists(), "the refused server left its control socket");

    let extra = ["--medium-sync", "msync", "--cleaner", "order=none"];
    let server = setup.serve_with_cache(&cache, Via::Tcp, &extra);
    let logs = server.logs();
    assert!(logs.contains("medium: msync"), "{logs}");
    assert!(logs.contains(&format!("the cache medium is in msync mode ({fs})")), "{logs}");
    assert_eq!(setup.stats()["medium"], "msync");
    let prometheus = setup.pmcache(&["stats", "--prometheus", "--control", &setup.control_arg()]);
    let prometheus = String::from_utf8_lossy(&prometheus.stdout).into_owned();
    assert!(prometheus.contains("pmcache_medium_info{medium=\"msync\"} 1"), "{prometheus}");

    let mut c = NbdClient::ready(server.addr());
    let data = pseudo_random(MIB as usize, 31);
    for (i, chunk) in data.chunks(64 * KIB as usize).enumerate() {
        c.write_at(3 * MIB + i as u64 * 64 * KIB, chunk, 0);
    }
    // Every write was acknowledged: msync has written each page it touched back to the file.
    assert_eq!(dirty_kib_mapped(server.pid(), &cache), 0, "acknowledged writes left dirty pages");
    let mut reader = NbdClient::ready(server.addr());
    assert!(reader.read_at(3 * MIB, MIB as u32) == data, "read back differs");
    let check = check_json(&setup, &cache);
    assert_eq!(
        (check["medium"].clone(), check["file_system"].clone()),
        ("msync".into(), fs.clone().into())
    );
    assert_eq!(check["dirty"], 256, "{check}");
    let text = setup.pmcache(&["check", "--cache", &cache.display().to_string()]);
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(text.contains(&format!("medium: msync ({fs}: durable only in msync mode")), "{text}");
    drop((c, reader));
    server.kill9();

    // Offline, the medium is refused without msync mode too, and detached with it.
    let detach = |extra: &[&str]| {
        let mut args = vec!["detach", "--cache", cache.to_str().unwrap()];
        args.extend(["--backing", setup.backing.to_str().unwrap(), "--control"]);
        args.push(setup.control.to_str().unwrap());
        args.extend(extra);
        setup.pmcache(&args)
    };
    let refused = detach(&[]);
    assert!(!refused.status.success() && stderr(&refused).contains("--medium-sync msync"));
    let out = detach(&["--medium-sync", "msync"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(read_file_at(&setup.backing, 3 * MIB, MIB as usize) == data, "detach lost data");
    assert_eq!(check_json(&setup, &cache)["dirty"], 0);
}

/// The default medium in /dev/shm: `volatile` on the startup line, in `stats` (JSON, table,
/// Prometheus) and in `check`.
#[test]
fn a_medium_in_dev_shm_is_named_volatile() {
    let setup = Setup::new("mshm", 64 * MIB, 8 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    assert!(server.logs().contains("medium: volatile"), "{}", server.logs());
    assert_eq!(setup.stats()["medium"], "volatile");
    let table = setup.pmcache(&["stats", "--all", "--control", &setup.control_arg()]);
    let table = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(
        table.lines().any(|l| l.starts_with("medium ") && l.ends_with("\"volatile\"")),
        "{table}"
    );
    assert_eq!(check_json(&setup, &setup.cache)["medium"], "volatile");
    let text = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(
        text.contains("medium: volatile (tmpfs: survives a process crash, not a reboot)"),
        "{text}"
    );
    server.terminate();
}
