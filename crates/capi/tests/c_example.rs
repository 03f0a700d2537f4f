//! The C example, `examples/c/crash_verify.c`, compiled with `cc` against `include/pmcache.h`
//! and the `libpmcache.so` that `cargo test` built for this test, then run: its writer is
//! killed after every write was acknowledged, and its verifier finds every acknowledged block
//! after the reopen (recovery) and, once the cache is closed, on the backing file.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Blocks the writer writes before it is killed.
const BLOCKS: u64 = 500;

/// The directory of the `libpmcache.so` built with this test. Cargo builds the package's
/// library — both its crate types, the cdylib with the rlib this test links, in one compiler
/// run — into the `deps` directory that holds this test's binary, before the binary; `cargo
/// build` also copies it to the profile's directory above, which may hold an older one, so
/// `deps` is looked in first.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's directory");
    [Some(deps), deps.parent()]
        .into_iter()
        .flatten()
        .find(|dir| dir.join("libpmcache.so").is_file())
        .unwrap_or_else(|| {
            panic!(
                "libpmcache.so is neither beside {} nor in its parent directory: cargo test \
                 builds it there (crate-type cdylib of pmcache-capi)",
                exe.display()
            )
        })
        .to_path_buf()
}

/// Compiles the example into `dir`.
fn compile(dir: &Path) -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = library_dir();
    let out = dir.join("crash_verify");
    let compiled = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("examples/c/crash_verify.c"))
        .arg("-L")
        .arg(&lib)
        .arg("-lpmcache")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `cc` ({e}): this test compiles the C example and needs a C \
                 compiler (apt-get install -y build-essential)"
            )
        });
    assert!(
        compiled.status.success(),
        "cc failed on the C example:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    out
}

#[test]
fn acknowledged_writes_of_the_c_example_survive_its_crash() {
    let build = tempfile::tempdir().expect("a build directory");
    let example = compile(build.path());
    let shm = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
    let disk = tempfile::tempdir().expect("a directory on disk");
    let cache = shm.path().join("cache.pm");
    let backing = disk.path().join("backing.img");
    let acks = disk.path().join("acks.txt");
    let timeout = Duration::from_secs(120);

    let written = pmcache_testkit::run(
        Command::new(&example)
            .arg("write")
            .args([&cache, &backing])
            .args([BLOCKS.to_string(), "20261203".into()]),
        timeout,
    );
    let stdout = String::from_utf8_lossy(&written.stdout);
    let stderr = String::from_utf8_lossy(&written.stderr);
    assert_eq!(
        written.status.signal(),
        Some(libc::SIGKILL),
        "the writer was to kill itself ({}):\n{stdout}\n{stderr}",
        written.status
    );
    let acked = stdout.lines().filter(|line| line.starts_with("acked ")).count() as u64;
    assert_eq!(acked, BLOCKS, "acknowledged writes:\n{stdout}\n{stderr}");
    assert_eq!(stdout.lines().last(), Some(format!("acked {}", BLOCKS - 1).as_str()));
    std::fs::write(&acks, stdout.as_bytes()).expect("the acknowledgements");

    let verified = pmcache_testkit::run_ok(
        Command::new(&example).arg("verify").args([&cache, &backing]).arg("20261203").arg(&acks),
        timeout,
    );
    assert!(
        verified
            .contains(&format!("verified {BLOCKS} of {BLOCKS} acknowledged blocks in the cache")),
        "{verified}"
    );
    assert!(verified.contains("(volatile medium)"), "{verified}");
    assert!(verified.contains("closed cleanly"), "{verified}");
    assert!(
        verified.contains(&format!("written back: {BLOCKS} of {BLOCKS} acknowledged blocks")),
        "{verified}"
    );
    // Closed cleanly: the control socket is gone.
    assert!(!shm.path().join("cache.pm.ctl").exists(), "the control socket stayed");

    // The verifier tells other data from the acknowledged: a seed not written is refused.
    let other = pmcache_testkit::run(
        Command::new(&example).arg("verify").args([&cache, &backing]).arg("7").arg(&acks),
        timeout,
    );
    let stdout = String::from_utf8_lossy(&other.stdout);
    assert_eq!(other.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains(&format!("verified 0 of {BLOCKS}")), "{stdout}");
}
