//! `serve --data-crc` through a real client (qemu-io): bits flipped in the cache medium's file
//! under the live server are caught. A clean block is read back right (from the backing
//! file), a dirty one fails its read with EIO and is not written back (the switch out of
//! write-back is refused), every other block is served; `stats` counts them. `--data-crc`
//! asked of an existing cache formatted without it is refused.

use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::Duration;

use pmcache_testkit::qemu_io;

use crate::common::*;

const BLOCK: usize = 4096;

fn io(server: &Server, cmds: &[&str]) -> String {
    let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
    qemu_io(&server.uri, &cmds, Duration::from_secs(60))
}

/// qemu-io with one command expected to fail: its exit status and output.
fn io_failing(server: &Server, cmd: &str) -> (bool, String) {
    let out = pmcache_testkit::run(
        Command::new("qemu-io").args(["-f", "raw", &server.uri, "-c", cmd]),
        Duration::from_secs(60),
    );
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn n(stats: &serde_json::Value, key: &str) -> u64 {
    stats[key].as_u64().unwrap_or_else(|| panic!("no {key} in {stats}"))
}

/// Flips a bit in the first block of the cache medium's file that is all `byte` (a slot
/// holding a block the client wrote with that pattern).
fn flip_a_bit_of_the_block_of(setup: &Setup, byte: u8) {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&setup.cache).unwrap();
    let mut block = vec![0u8; BLOCK];
    let blocks = file.metadata().unwrap().len() / BLOCK as u64;
    let at = (1..blocks)
        .map(|i| i * BLOCK as u64)
        .find(|&at| {
            file.read_exact_at(&mut block, at).unwrap();
            block.iter().all(|&b| b == byte)
        })
        .unwrap_or_else(|| panic!("no block of {byte:#x} in the cache medium"));
    file.write_all_at(&[byte ^ 0x01], at + 1234).unwrap();
}

#[test]
fn a_flipped_bit_is_caught_clean_blocks_re_read_dirty_ones_an_error() {
    let setup = Setup::new("data-crc", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &["--data-crc", "--cleaner", "order=none"]);
    let check = run(
        Command::new(PMCACHE).args(["check", "--cache", &setup.cache_arg(), "--json"]),
        Duration::from_secs(30),
    );
    let check: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check --json");
    assert_eq!(
        (check["data_crc"].as_bool(), check["format_version"].as_u64()),
        (Some(true), Some(4))
    );
    io(&server, &["write -P 0x3c 1M 64k"]);
    let out = setup.pmcache(&["flush", "--control", &setup.control_arg()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    io(&server, &["write -P 0x5a 0 64k", "write -P 0x6b 2M 64k"]);
    assert_eq!(n(&setup.stats(), "dirty_slots"), 32);
    assert_eq!(setup.stats()["data_crc"], true);

    flip_a_bit_of_the_block_of(&setup, 0x3c);
    flip_a_bit_of_the_block_of(&setup, 0x5a);
    let out = io(&server, &["read -P 0x3c 1M 64k"]);
    assert!(!out.contains("failed"), "the clean block was not read back right: {out}");
    let (_, out) = io_failing(&server, "read -P 0x5a 0 64k");
    assert!(out.contains("Input/output error"), "the dirty block was served: {out}");
    assert!(!out.contains("Pattern verification failed"), "{out}");
    let out = io(&server, &["read -P 0x6b 2M 64k"]);
    assert!(!out.contains("failed"), "{out}");

    let stats = setup.stats();
    assert_eq!(
        n(&stats, "data_crc_mismatches"),
        n(&stats, "unreadable_clean") + n(&stats, "unreadable_dirty")
    );
    assert!(n(&stats, "unreadable_clean") >= 1 && n(&stats, "unreadable_dirty") >= 1, "{stats}");
    let summary = setup.pmcache(&["stats", "--control", &setup.control_arg()]);
    let summary = String::from_utf8_lossy(&summary.stdout);
    assert!(
        summary.contains("data checksums") && summary.contains("checksum mismatches"),
        "{summary}"
    );

    // Leaving write-back must write every dirty block back: one cannot be, so it is refused.
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=write-through"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("checksum"), "{stderr}");
    assert_eq!(setup.stats()["mode"], "writeback");
    assert!(
        read_file_at(&setup.backing, 2 * MIB, 64 * 1024).iter().all(|&b| b == 0x6b),
        "the good dirty blocks were written back"
    );
    assert!(
        read_file_at(&setup.backing, 0, BLOCK).iter().all(|&b| b == 0),
        "the corrupt block reached the backing file"
    );
    // A write of the whole block replaces it.
    io(&server, &["write -P 0x7c 0 64k"]);
    let out = io(&server, &["read -P 0x7c 0 64k"]);
    assert!(!out.contains("failed"), "{out}");
    let out = setup.pmcache(&["set", "--control", &setup.control_arg(), "mode=write-through"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    server.terminate();
}

#[test]
fn data_crc_for_an_existing_cache_without_it_is_refused() {
    let setup = Setup::new("data-crc-refused", 64 * MIB, 16 * MIB);
    setup.serve(Via::Tcp, &[]).terminate();
    let out = setup.serve_refused(&setup.cache, &["--data-crc"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served");
    assert!(stderr.contains("formatted without data checksums"), "{stderr}");
    let out = run(
        Command::new(PMCACHE).args(["check", "--cache", &setup.cache_arg(), "--json"]),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "the refusal changed the cache");
}

/// The cache medium's file cut short under a live server: reads of the pages it no longer
/// has raise SIGBUS, as a poisoned line does. The server lives on: the dirty blocks there fail
/// their reads with EIO, every other block is served, and `stats` counts the medium's read
/// errors and the slots retired.
#[test]
fn a_sigbus_from_the_medium_is_an_error_for_its_blocks_and_the_server_serves_on() {
    let setup = Setup::new("poisoned", 64 * MIB, 16 * MIB);
    let server = setup.serve(Via::Tcp, &["--cleaner", "order=none"]);
    io(&server, &["write -P 0x11 0 12M"]);
    let out = setup.pmcache(&["flush", "--control", &setup.control_arg()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    io(&server, &["write -P 0x22 32M 256k"]);
    // Cut the file two blocks into the 0x22 blocks' slots (written after the others, in
    // address order).
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&setup.cache).unwrap();
    let mut block = vec![0u8; BLOCK];
    let first = (1..file.metadata().unwrap().len() / BLOCK as u64)
        .map(|i| i * BLOCK as u64)
        .find(|&at| {
            file.read_exact_at(&mut block, at).unwrap();
            block.iter().all(|&b| b == 0x22)
        })
        .expect("the 0x22 blocks in the medium");
    file.set_len(first + 2 * BLOCK as u64).unwrap();

    let (ok, out) = io_failing(&server, "read -P 0x22 32M 256k");
    assert!(!ok && out.contains("Input/output error"), "{out}");
    io(&server, &["read -P 0x22 32M 8k", "read -P 0x11 0 12M"]);
    let stats = setup.stats();
    assert!(n(&stats, "medium_read_errors") >= 1, "{stats}");
    assert!(n(&stats, "retired_slots") >= 1, "{stats}");
    assert_eq!(n(&stats, "unreadable_dirty"), n(&stats, "medium_read_errors"), "{stats}");
    let (ok, _) = io_failing(&server, "read 32M 256k");
    assert!(!ok, "a second read of them fails as well");
    io(&server, &["read -P 0x11 4M 4M"]);
    server.kill9();
}
