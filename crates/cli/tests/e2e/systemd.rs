//! `contrib/pmcache@.service`, run the way systemd runs it: its `ExecStartPre` and
//! `ExecStart` command lines (with `%i` and the install paths replaced by this test's) in its
//! working directory, `$NOTIFY_SOCKET` set (a `Type=notify` unit is ready at `READY=1`), then
//! its `KillSignal`, and an exit within its `TimeoutStopSec`. A test of the unit's commands,
//! not of systemd: the volatile cache is written back and marked clean by the stop.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{PMCACHE, TempDir, read_file_at};

const UNIT: &str = include_str!("../../../../contrib/pmcache@.service");

/// The values of `key=` in the unit, in order.
fn values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    let prefix = format!("{key}=");
    unit.lines().filter_map(|line| line.trim().strip_prefix(prefix.as_str())).collect()
}

fn one<'a>(unit: &'a str, key: &str) -> &'a str {
    match values(unit, key).as_slice() {
        [value] => value,
        other => panic!("{key}: {other:?} in the unit"),
    }
}

/// A command line of the unit with this test's paths: the binary, the config directory and
/// the instance name.
fn command_line(line: &str, config_dir: &Path, instance: &str) -> Vec<String> {
    line.replace("/usr/local/bin/pmcache", PMCACHE)
        .replace("/etc/pmcache/", &format!("{}/", config_dir.display()))
        .replace("%i", instance)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// `TimeoutStopSec=` in seconds (`15min`, `90s`, `90`).
fn seconds(value: &str) -> u64 {
    if let Some(min) = value.strip_suffix("min") {
        return min.parse::<u64>().expect("minutes") * 60;
    }
    value.trim_end_matches('s').parse().expect("seconds")
}

#[test]
fn the_unit_starts_serves_and_stops_cleanly_within_its_timeout() {
    assert_eq!(one(UNIT, "Type"), "notify");
    assert_eq!(one(UNIT, "KillSignal"), "SIGTERM");
    assert!(values(UNIT, "Before")[0].contains("local-fs-pre.target"));
    let shm = TempDir::new_in(Path::new("/dev/shm"), "systemd-unit");
    let state = TempDir::new_in(&std::env::temp_dir(), "systemd-unit");
    let work = state.path().join("var-lib-pmcache");
    let config_dir = state.path().join("etc-pmcache");
    std::fs::create_dir_all(&work).expect("working directory");
    std::fs::create_dir_all(&config_dir).expect("config directory");
    let socket = state.path().join("nbd.sock");
    let cache = shm.path().join("cache.pm");
    std::fs::write(
        config_dir.join("boot.toml"),
        format!(
            "cache = \"{}\"\ncache-size = \"16M\"\nsocket = \"{}\"\nmode = \"write-back\"\n\
             cleaner = [\"order=none\"]\n",
            cache.display(),
            socket.display()
        ),
    )
    .expect("config");
    // The service manager's side of `Type=notify`.
    let notify_path = state.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    for pre in values(UNIT, "ExecStartPre") {
        // `-`: its failure is ignored (no ublk module here).
        let (ignore, line) = pre.strip_prefix('-').map_or((false, pre), |l| (true, l));
        let argv = command_line(line, &config_dir, "boot");
        let status = Command::new(&argv[0]).args(&argv[1..]).current_dir(&work).status();
        assert!(ignore || status.as_ref().is_ok_and(|s| s.success()), "{pre}: {status:?}");
    }
    let argv = command_line(one(UNIT, "ExecStart"), &config_dir, "boot");
    let log = state.path().join("serve.log");
    let mut server = Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(&work)
        .env("NOTIFY_SOCKET", &notify_path)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(state.path().join("serve.err")).expect("log"))
        .spawn()
        .expect("ExecStart");
    let logs = || {
        let out = std::fs::read_to_string(&log).unwrap_or_default();
        let err = std::fs::read_to_string(state.path().join("serve.err")).unwrap_or_default();
        format!("--- stdout\n{out}--- stderr\n{err}")
    };
    let mut message = [0u8; 256];
    let n = notify.recv(&mut message).unwrap_or_else(|e| panic!("no READY=1: {e}\n{}", logs()));
    let message = String::from_utf8_lossy(&message[..n]).into_owned();
    assert!(message.lines().any(|l| l == "READY=1"), "{message:?}");
    // Ready means served: the default backing file was made under the working directory,
    // and a write reaches the cache (a write-back cache with no cleaner keeps it dirty).
    let backing = work.join("pmcache-data/backing.img");
    assert!(backing.exists(), "no backing file under WorkingDirectory:\n{}", logs());
    let uri = format!("nbd+unix:///pmcache?socket={}", socket.display());
    let written = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5c 1M 64k", &uri])
        .output()
        .expect("qemu-io (apt-get install qemu-utils)");
    assert!(written.status.success(), "{}", String::from_utf8_lossy(&written.stderr));
    assert!(read_file_at(&backing, 1 << 20, 65536).iter().all(|&b| b == 0), "written through");
    // The stop: KillSignal to the main process, an exit within TimeoutStopSec.
    let started = Instant::now();
    let kill = Command::new("kill").arg("-TERM").arg(server.id().to_string()).status();
    assert!(kill.is_ok_and(|s| s.success()));
    let timeout = Duration::from_secs(seconds(one(UNIT, "TimeoutStopSec")));
    let status = loop {
        if let Some(status) = server.try_wait().expect("try_wait") {
            break status;
        }
        assert!(started.elapsed() < timeout, "not stopped within {timeout:?}:\n{}", logs());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit {status}:\n{}", logs());
    let logs = logs();
    assert!(logs.contains("every block written back"), "{logs}");
    assert!(read_file_at(&backing, 1 << 20, 65536).iter().all(|&b| b == 0x5c), "{logs}");
}
