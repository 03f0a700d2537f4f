//! The README's quickstart, command by command: the embedded default served from a fresh
//! directory, 1 MiB written and read back with qemu-io, the stats summary, and Ctrl-C, after
//! which the backing file in `./pmcache-data` holds what was written.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::{PMCACHE, Server, TempDir, require_tool, run, run_ok};

/// The embedded default's cache medium (`pmcache serve` with no arguments).
const DEFAULT_CACHE: &str = "/dev/shm/pmcache-default.pm";

/// The shell lines of the README's `## Quickstart` section, comments dropped.
fn quickstart_commands() -> Vec<String> {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let text = std::fs::read_to_string(&readme).expect("README.md");
    let section = text.split("\n## Quickstart\n").nth(1).expect("a Quickstart section");
    let section = section.split("\n## ").next().expect("its text");
    let mut commands = Vec::new();
    let mut in_block = false;
    for line in section.lines() {
        match line.trim() {
            "```sh" => in_block = true,
            "```" => in_block = false,
            l if in_block && !l.is_empty() => {
                let command = l.split(" # ").next().expect("a command").trim();
                commands.push(command.to_string());
            }
            _ => {}
        }
    }
    commands
}

/// Splits a command line as the shell would for these commands: words, single quotes.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '\'' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    assert!(!quoted, "unbalanced quote in {line:?}");
    if !word.is_empty() {
        out.push(word);
    }
    out
}

#[test]
fn the_readme_quickstart_runs_as_written() {
    if Path::new(DEFAULT_CACHE).exists() {
        // Someone's own default cache: serving it over a scratch backing file is refused, and
        // removing it afterwards would lose their data.
        eprintln!("quickstart test not run: {DEFAULT_CACHE} exists on this machine");
        return;
    }
    require_tool("qemu-io", "qemu-utils");
    // Dropped after the server (declared before it): the default medium this test created.
    let _medium = RemovedOnDrop;
    let commands = quickstart_commands();
    assert_eq!(commands.len(), 5, "the quickstart's commands: {commands:?}");
    assert_eq!(commands[0], "cargo build --release -p pmcache-cli", "the build");
    let dir = TempDir::new_in(&std::env::temp_dir(), "quickstart");
    let mut server = None;
    let mut written = None;
    for line in &commands[1..] {
        let argv = words(line);
        match argv.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["target/release/pmcache", "serve"] => {
                // The binary under test stands for the one `cargo build --release` makes.
                let mut cmd = Command::new(PMCACHE);
                cmd.arg("serve").current_dir(dir.path());
                let started = Server::spawn(cmd, dir.path());
                assert_eq!(started.uri, "nbd://127.0.0.1:10809/pmcache", "{}", started.logs());
                server = Some(started);
            }
            ["qemu-io", "-f", "raw", "-c", op, uri] => {
                assert!(server.is_some(), "{line}: no server yet");
                let out =
                    run_ok(Command::new("qemu-io").args(["-f", "raw", "-c", op, uri]), SECS_60);
                assert!(!out.contains("failed"), "{line}: {out}");
                let op_words = words(op);
                let op_words: Vec<&str> = op_words.iter().map(String::as_str).collect();
                if let ["write", "-P", pattern, offset, len] = op_words.as_slice() {
                    assert_eq!((*offset, *len), ("0", "1M"), "{line}");
                    let byte = u8::from_str_radix(pattern.trim_start_matches("0x"), 16)
                        .expect("a hex pattern");
                    written = Some(byte);
                } else {
                    assert!(out.contains("read 1048576/1048576 bytes"), "{line}: {out}");
                }
            }
            ["target/release/pmcache", "stats"] => {
                let out = run(Command::new(PMCACHE).arg("stats"), SECS_60);
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert!(out.status.success(), "{line}: {}", String::from_utf8_lossy(&out.stderr));
                assert!(stdout.starts_with("cache "), "{line}: {stdout}");
            }
            _ => panic!("a quickstart command this test does not run: {line:?}"),
        }
    }
    // Ctrl-C: the write-back at the stop, then a clean exit.
    let server = server.expect("the quickstart starts a server");
    server.signal("INT");
    let (status, logs) = server.wait(Duration::from_secs(120));
    assert!(status.success(), "serve exited with {status} on Ctrl-C:\n{logs}");
    let byte = written.expect("the quickstart writes");
    let backing = dir.path().join("pmcache-data/backing.img");
    let head = crate::common::read_file_at(&backing, 0, 1 << 20);
    assert!(head.iter().all(|&b| b == byte), "the backing file lacks the written MiB");
}

const SECS_60: Duration = Duration::from_secs(60);

/// Removes the default medium and its control socket, which the test created, however it ends.
struct RemovedOnDrop;

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(DEFAULT_CACHE);
        let _ = std::fs::remove_file(format!("{DEFAULT_CACHE}.ctl"));
    }
}
