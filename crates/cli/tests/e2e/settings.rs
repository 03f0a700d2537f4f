//! `pmcache set` on a live server, through a real client (qemu-io): the cache mode switched at
//! run time (leaving write-back writes every dirty block back first; refused, the mode
//! unchanged, when that fails) and the admission policy (`serve --admission`, `set
//! admission=`), with the counters `stats` shows.

use std::process::Command;
use std::time::Duration;

use pmcache_testkit::qemu_io;

use crate::common::*;

fn io(server: &Server, cmds: &[&str]) -> String {
    let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
    qemu_io(&server.uri, &cmds, Duration::from_secs(60))
}

fn n(stats: &serde_json::Value, key: &str) -> u64 {
    stats[key].as_u64().unwrap_or_else(|| panic!("no {key} in {stats}"))
}

/// Write-back to write-through on a cache holding dirty blocks (the cleaner off, so they stay
/// dirty until the switch): every one is on the backing file when `set` returns, the mode and
/// the time of the change are in `stats`, and later writes go through. Back to write-back.
#[test]
fn leaving_write_back_writes_every_dirty_block_back_first() {
    let setup = Setup::new("set-mode", 64 * MIB, 32 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    io(&server, &["write -P 0x5c 0 8M"]);
    let stats = setup.stats();
    assert_eq!((n(&stats, "dirty_slots"), n(&stats, "mode_changed_unix_secs")), (2048, 0));
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=write-through"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.lines().any(|l| l.starts_with("mode") && l.ends_with("writethrough")),
        "{stdout}"
    );
    let stats = setup.stats();
    assert_eq!((stats["mode"].as_str(), n(&stats, "dirty_slots")), (Some("writethrough"), 0));
    assert!(n(&stats, "mode_changed_unix_secs") > 1_700_000_000, "{stats}");
    assert!(
        read_file_at(&setup.backing, 0, (8 * MIB) as usize).iter().all(|&b| b == 0x5c),
        "the backing file lacks blocks that were dirty"
    );
    io(&server, &["write -P 0x6d 8M 1M"]);
    assert_eq!(n(&setup.stats(), "dirty_slots"), 0, "a write-through write left a dirty block");
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=writeback"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    io(&server, &["write -P 0x7e 16M 1M"]);
    assert_eq!(setup.stats()["mode"], "writeback");
    assert_eq!(n(&setup.stats(), "dirty_slots"), 256);
    server.terminate();
}

/// With the backing store failing the write-back, leaving write-back is refused: the command
/// fails saying why, and the cache stays in write-back with its dirty blocks, all readable.
#[test]
fn a_switch_whose_write_back_fails_is_refused_and_the_mode_stays() {
    let setup = Setup::new("set-mode-fail", 64 * MIB, 16 * MIB);
    // Writes to the backing file at or past 32 MiB fail (EFBIG).
    let server = setup.serve_with_writes_failing_past(32 * MIB, &["--cleaner", "order=none"]);
    io(&server, &["write -P 0x21 40M 1M"]);
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=write-through"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the switch succeeded over a failing backing store");
    assert!(stderr.contains("refused") && stderr.contains("stays writeback"), "{stderr}");
    let stats = setup.stats();
    assert_eq!(stats["mode"], "writeback", "{stats}");
    assert_eq!(n(&stats, "dirty_slots"), 256, "{stats}");
    assert_eq!(n(&stats, "mode_changed_unix_secs"), 0, "{stats}");
    let out = io(&server, &["read -P 0x21 40M 1M"]);
    assert!(!out.contains("Pattern verification failed"), "{out}");
}

/// `--admission n-hit=2`: a block's first miss is cold (not admitted), its second admitted;
/// `set admission=always` admits the next first miss; `set admission=seq-cutoff=1M` bypasses
/// the part of a 48 MiB sequential read past its first 1 MiB that finds the 32 MiB cache short
/// of room (a scan fills free slots, it never evicts). A policy that does not parse is
/// refused and changes nothing.
#[test]
fn admission_is_set_at_start_and_changed_at_run_time() {
    let setup = Setup::new("set-admission", 64 * MIB, 32 * MIB);
    let server = setup.serve(Via::Tcp, &["--admission", "n-hit=2"]);
    assert_eq!(setup.stats()["admission"], "n-hit=2");
    io(&server, &["read 0 4k"]);
    let stats = setup.stats();
    assert_eq!((n(&stats, "read_misses_cold"), n(&stats, "read_misses_admitted")), (1, 0));
    io(&server, &["read 0 4k"]);
    assert_eq!(n(&setup.stats(), "read_misses_admitted"), 1);
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "admission=n-hit=0"]);
    assert!(!out.status.success(), "n-hit=0 was taken");
    assert!(String::from_utf8_lossy(&out.stderr).contains("from 1 to 254"));
    assert_eq!(setup.stats()["admission"], "n-hit=2");

    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "admission=always"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    io(&server, &["read 1M 4k"]);
    let stats = setup.stats();
    assert_eq!(stats["admission"], "always");
    assert_eq!((n(&stats, "read_misses_cold"), n(&stats, "read_misses_admitted")), (1, 2));

    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "admission=seq-cutoff=1M"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    io(&server, &["read 16M 48M"]);
    let stats = setup.stats();
    assert_eq!(stats["admission"], "seq-cutoff=1M");
    let (admitted, sequential) =
        (n(&stats, "read_misses_admitted") - 2, n(&stats, "read_misses_sequential"));
    let (blocks, slots) = (48 * MIB / 4096, n(&stats, "slot_count"));
    assert_eq!(admitted + sequential, blocks, "every block missed once: {stats}");
    // Admitted while an eighth of the slots was free (lanes hold a few free slots of their
    // own), bypassed from then on.
    let room = slots - slots / 8;
    assert!(admitted <= room + 64 && admitted + 1024 >= room, "{stats}");
    server.terminate();

    let out = setup.pmcache(&[
        "serve",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
        "--admission",
        "sometimes",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown admission policy"));
}

/// `pmcache stats` with no arguments asks the server `pmcache serve` started with none (the
/// embedded default's control socket): its summary, or, with no such server, an error naming
/// where it looked.
#[test]
fn stats_with_no_arguments_asks_the_default_server() {
    let out = run(Command::new(PMCACHE).arg("stats"), Duration::from_secs(30));
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        assert!(stdout.starts_with("cache "), "{stdout}");
    } else {
        assert!(
            stderr.contains("no pmcache server answers on /dev/shm/pmcache-default.pm.ctl"),
            "{stderr}"
        );
    }
}

/// `stats --watch SECONDS` prints the summary again and again, the screen cleared before each;
/// a period that is not a positive number is refused.
#[test]
fn stats_watch_refreshes_the_summary() {
    let setup = Setup::new("stats-watch", 64 * MIB, 8 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let mut child = Command::new(PMCACHE)
        .args(["stats", "--watch", "0.2", "--control", &setup.control_arg()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("stats --watch");
    std::thread::sleep(Duration::from_millis(1500));
    child.kill().expect("kill");
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let screens = stdout.matches("\x1b[2J").count();
    assert!(screens >= 3, "{screens} screens in 1.5 s: {stdout}");
    assert!(stdout.matches("\ncleaner ").count() >= 3, "{stdout}");
    let out = setup.pmcache(&["stats", "--watch", "0", "--control", &setup.control_arg()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("above 0"));
    server.terminate();
}
