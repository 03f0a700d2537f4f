//! Poisoned lines: a read of them fails with the offset instead of ending the process, on the
//! real mapped medium (a `SIGBUS` from a page the file no longer has) and on the simulated one.

use std::sync::Arc;

use pmcache_media::{CrashMedium, CrashSwitch, Medium, PmemFile, Poisoned};

const MIB: u64 = 1 << 20;

/// A mapped medium whose file is cut short under it: a read of the cut pages raises `SIGBUS`,
/// as a poisoned line does. The checked read reports the first bad byte and the process
/// lives on; the pages before the cut read back what was written; the bad page stays bad
/// (and is listed) for later reads; pages are listed relative to the medium.
#[test]
fn a_sigbus_under_a_checked_read_of_a_mapped_medium_is_an_error_not_a_crash() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = dir.path().join("pm");
    let medium = PmemFile::open(&path, Some(4 * MIB)).unwrap();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    medium.write_persist(MIB, &pattern);
    medium.write_persist(3 * MIB, &pattern);
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(2 * MIB).unwrap();

    let mut buf = vec![0u8; 8192];
    medium.read_checked(MIB, &mut buf).expect("a page the file still has");
    assert_eq!(buf, pattern);
    let losses = medium.losses();
    let err = medium.read_checked(3 * MIB + 100, &mut buf).expect_err("a page past the file");
    assert!(medium.losses() > losses, "the replaced page is counted as a loss");
    assert_eq!(err, Poisoned { offset: 3 * MIB + 100 });
    assert!(err.to_string().contains("poisoned line"), "{err}");
    let err = medium.read_checked(3 * MIB - 4096, &mut buf).expect_err("spans into the bad page");
    assert_eq!(err.offset, 3 * MIB);
    assert_eq!(medium.read_checked(3 * MIB, &mut buf[..64]), Err(Poisoned { offset: 3 * MIB }));
    let ranges = medium.poisoned_ranges();
    assert!(ranges.contains(&(3 * MIB..3 * MIB + 4096)), "{ranges:?}");
    assert!(ranges.iter().all(|r| r.start >= 2 * MIB), "only cut pages: {ranges:?}");
    medium.read_checked(0, &mut buf).expect("the superblock's page is whole");
    drop(medium);

    // A new mapping of the same file starts with no poisoned pages of its own.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4 * MIB).unwrap();
    let again = PmemFile::open(&path, None).unwrap();
    assert_eq!(again.poisoned_ranges(), Vec::<std::ops::Range<u64>>::new());
    again.read_checked(3 * MIB, &mut buf).expect("the file has the page again");
    assert_eq!(buf, vec![0u8; 8192], "a page past a cut comes back zeroed");
}

/// The simulated medium fails reads of the lines it was told are poisoned (any read that
/// overlaps one, with the first bad byte), serves the rest, lists them, and keeps them
/// poisoned after a store.
#[test]
fn a_crash_medium_fails_checked_reads_of_poisoned_lines_only() {
    let medium = CrashMedium::new(MIB, CrashSwitch::new(), 1);
    medium.write_persist(8192, &[7u8; 4096]);
    medium.poison(8192 + 130, 1);
    let mut buf = [0u8; 4096];
    assert_eq!(medium.read_checked(8192, &mut buf), Err(Poisoned { offset: 8192 + 128 }));
    assert_eq!(
        medium.read_checked(8192 + 150, &mut buf[..8]),
        Err(Poisoned { offset: 8192 + 150 })
    );
    let mut line = [0u8; 64];
    medium.read_checked(8192 + 192, &mut line).expect("the next line is whole");
    assert_eq!(line, [7u8; 64]);
    medium.read_checked(8192 + 64, &mut line).expect("the line before is whole");
    assert_eq!(medium.poisoned_ranges(), vec![8192 + 128..8192 + 192]);
    medium.write_persist(8192, &[9u8; 4096]);
    assert!(medium.read_checked(8192, &mut buf).is_err(), "a store does not heal poison");
    let arc: Arc<CrashMedium> = Arc::new(medium.clone());
    assert!(arc.read_checked(8192 + 128, &mut line).is_err(), "through an Arc too");
}

/// An unchecked read of a poisoned line is a machine check on a device: the simulation
/// panics, so a path of the engine that reads cached data without checking shows up.
#[test]
#[should_panic(expected = "unchecked read of poisoned byte")]
fn an_unchecked_read_of_a_poisoned_line_panics() {
    let medium = CrashMedium::new(MIB, CrashSwitch::new(), 1);
    medium.poison(4096, 64);
    let mut buf = [0u8; 128];
    medium.read(4096 - 64, &mut buf);
}

/// A fault outside a checked read is not the handler's: it passes it on, and the process ends
/// by `SIGBUS` as it would without it (run in a child process: this test binary again).
#[test]
fn a_fault_outside_a_checked_read_still_ends_the_process() {
    use std::os::unix::process::ExitStatusExt;
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "unchecked_read_of_a_cut_page", "--ignored", "--test-threads=1"])
        .env("PMCACHE_POISON_CHILD", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
}

/// The child of the test above: a checked read first (the handler is installed and used),
/// then a plain read of a page past the file's end.
#[test]
#[ignore = "run as a child process by a_fault_outside_a_checked_read_still_ends_the_process"]
fn unchecked_read_of_a_cut_page() {
    if std::env::var_os("PMCACHE_POISON_CHILD").is_none() {
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = dir.path().join("pm");
    let medium = PmemFile::open(&path, Some(4 * MIB)).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(2 * MIB).unwrap();
    let mut buf = [0u8; 64];
    assert!(medium.read_checked(3 * MIB, &mut buf).is_err());
    medium.read(3 * MIB + 4096, &mut buf);
    unreachable!("the read above ends the process");
}
