//! A cache of several members (`--cache PATH@NODE` given more than once): served over NBD,
//! written and read by qemu-io, stopped and attached again with its members listed in
//! another order, checked, and refused with a member missing or with a new medium beside
//! formatted ones. This machine has one NUMA node, so every member is given node 0; the
//! placement between nodes is tested by the engine's tests and the two-node guest.

use std::path::Path;
use std::time::Duration;

use crate::common::*;

const TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn a_cache_of_two_members_serves_recovers_in_any_order_and_refuses_a_missing_member() {
    // Two members of 4 MiB (1,000-odd slots each) in front of 64 MiB: the 6 MiB written fill
    // the first member and spill into the second.
    let setup = Setup::new("members", 64 * MIB, 4 * MIB);
    let second = setup.shm.path().join("cache-1.pm");
    let second_arg = format!("{}@0", second.display());
    let first_arg = format!("{}@0", setup.cache.display());
    // No background cleaning: the dirty counts below are the writes', whatever the load.
    let server = setup.serve_with_cache(
        Path::new(&first_arg),
        Via::Tcp,
        &["--cache", &second_arg, "--cleaner", "order=none"],
    );
    let logs_formatted = |s: &str| s.contains("formatted") && s.contains(" + ");
    let cmds: Vec<String> = (0..6u64)
        .flat_map(|i| {
            let offset = i * MIB;
            [
                format!("write -P {} {offset} 1048576", i + 1),
                format!("read -P {} {offset} 1048576", i + 1),
            ]
        })
        .collect();
    pmcache_testkit::qemu_io(&server.uri, &cmds, TIMEOUT);
    let stats = setup.stats();
    let members = stats["members"].as_array().expect("members in stats").clone();
    assert_eq!(members.len(), 2, "{stats}");
    let field = |m: &serde_json::Value, name: &str| m[name].as_u64().expect(name);
    let slots: Vec<u64> = members.iter().map(|m| field(m, "slots")).collect();
    assert!(slots[0] > 900 && slots[0] == slots[1], "{stats}");
    // Both members on node 0, as the server's thread: 1,536 blocks written, every one local;
    // the first member (the nearer on a tie) filled, the rest on the second.
    let dirty: Vec<u64> = members.iter().map(|m| field(m, "dirty")).collect();
    assert_eq!(dirty, [slots[0], 1536 - slots[0]], "{stats}");
    let local: Vec<u64> = members.iter().map(|m| field(m, "writes_local")).collect();
    assert_eq!(local, dirty, "{stats}");
    assert!(members.iter().all(|m| field(m, "writes_remote") == 0 && m["node"] == 0), "{stats}");
    let reads_local: u64 = members.iter().map(|m| field(m, "reads_local")).sum();
    assert_eq!(reads_local, field(&stats, "read_hits"), "{stats}");
    // The table shows one row per member.
    let table = setup.pmcache(&["stats", "--control", &setup.control_arg()]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("writes_local")
            && text
                .lines()
                .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
                .count()
                >= 2,
        "{text}"
    );
    let logs = server.terminate();
    assert!(logs_formatted(&logs), "{logs}");

    // Attached again with the members given the other way round.
    let check =
        setup.pmcache(&["check", "--json", "--cache", &second_arg, "--cache", &setup.cache_arg()]);
    let v: serde_json::Value = serde_json::from_slice(&check.stdout)
        .unwrap_or_else(|e| panic!("check --json: {e}: {}", stderr(&check)));
    assert!(check.status.success(), "{v}");
    assert_eq!((v["members"].as_u64(), v["format_version"].as_u64()), (Some(2), Some(4)), "{v}");
    assert_eq!(v["slots"].as_u64(), Some(slots[0] + slots[1]), "{v}");
    let mut args = vec!["--cache".to_string(), second_arg.clone()];
    args.extend(["--cache".into(), first_arg.clone()]);
    let swapped = {
        let mut cmd = std::process::Command::new(PMCACHE);
        cmd.arg("serve");
        cmd.args(&args);
        cmd.args(["--backing", &setup.backing_arg(), "--control", &setup.control_arg()]);
        cmd.args(["--listen", "127.0.0.1:0"]);
        Server::spawn(cmd, setup.shm.path())
    };
    let verify: Vec<String> =
        (0..6u64).map(|i| format!("read -P {} {} 1048576", i + 1, i * MIB)).collect();
    pmcache_testkit::qemu_io(&swapped.uri, &verify, TIMEOUT);
    let logs = swapped.terminate();
    assert!(logs.contains("attached") && logs.contains("clean shutdown"), "{logs}");

    // One member alone: refused, naming what is missing, and nothing changes.
    let before = std::fs::read(&setup.cache).expect("read member 0");
    let alone = setup.serve_refused(&setup.cache, &[]);
    assert!(!alone.status.success());
    let why = stderr(&alone);
    assert!(why.contains("has 2 members, 1 given") && why.contains("every member"), "{why}");
    assert!(
        std::fs::read(&setup.cache).expect("read member 0") == before,
        "a refused start changed member 0"
    );
    // A new medium beside the formatted ones: refused, and the new file is not left behind.
    let third = setup.shm.path().join("cache-2.pm");
    let mixed = setup.serve_refused(
        &setup.cache,
        &["--cache", &second_arg, "--cache", &third.display().to_string()],
    );
    let why = stderr(&mixed);
    assert!(!mixed.status.success() && why.contains("formatted together"), "{why}");
    assert!(!third.exists(), "the refused start left {} behind", third.display());
}
