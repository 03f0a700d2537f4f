//! `pmcache serve --ublk` where it cannot serve: in a build without the `ublk` feature, and on
//! a kernel without the ublk driver. Either way it is refused before anything is opened, with
//! an error that says what to do (build with the feature; load `ublk_drv`, or serve over
//! NBD). The device itself runs only where the driver is (the QEMU guest of
//! `scripts/guest/`).

use crate::common::*;

/// Without `/dev/ublk-control`, `serve --ublk` fails at once: the error names the control
/// device, `modprobe ublk_drv` and NBD, and neither the cache medium nor the control socket
/// is created.
#[cfg(feature = "ublk")]
#[test]
fn serve_ublk_without_the_driver_is_refused_and_says_what_to_do() {
    if std::path::Path::new("/dev/ublk-control").exists() {
        eprintln!("skipped: this kernel has the ublk driver (/dev/ublk-control exists)");
        return;
    }
    let setup = Setup::new("ublk-missing", 64 * MIB, 4 * MIB);
    let (cache, backing, control) = (setup.cache_arg(), setup.backing_arg(), setup.control_arg());
    let out = setup.pmcache(&[
        "serve",
        "--ublk",
        "--ublk-queues",
        "2",
        "--cache",
        &cache,
        "--cache-size",
        "4M",
        "--backing",
        &backing,
        "--control",
        &control,
    ]);
    assert!(!out.status.success(), "serve --ublk started without the driver");
    let err = String::from_utf8_lossy(&out.stderr);
    for part in ["/dev/ublk-control does not exist", "modprobe ublk_drv", "NBD"] {
        assert!(err.contains(part), "missing {part:?} in: {err}");
    }
    assert!(!setup.cache.exists(), "a refused serve --ublk created the cache medium");
    assert!(!setup.control.exists(), "a refused serve --ublk left a control socket");
}

/// The ublk options are refused without `--ublk` (the polling budget without `--ublk-poll`),
/// and `--ublk` with NBD's listening options.
#[test]
fn ublk_options_need_ublk_and_exclude_nbds() {
    let setup = Setup::new("ublk-args", 64 * MIB, 4 * MIB);
    let (cache, backing) = (setup.cache_arg(), setup.backing_arg());
    let base = ["serve", "--cache", &cache, "--backing", &backing];
    for extra in [
        &["--ublk-queues", "2"][..],
        &["--recover", "0"][..],
        &["--ublk-recovery", "off"][..],
        &["--ublk-poll"][..],
        &["--ublk", "--ublk-poll-idle-us", "500"][..],
        &["--ublk", "--socket", "/tmp/x.sock"][..],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let out = setup.pmcache(&args);
        assert!(!out.status.success(), "{extra:?} accepted");
        assert_eq!(out.status.code(), Some(2), "{extra:?}: not a usage error");
        assert!(!setup.cache.exists(), "{extra:?}: created the cache medium");
    }
}

/// Without the driver, a take-over (`serve --ublk --recover N`) and `pmcache ublk list` and
/// `remove` fail with the same precise message, and nothing is created.
#[cfg(feature = "ublk")]
#[test]
fn recovery_and_device_management_without_the_driver_say_what_to_do() {
    if std::path::Path::new("/dev/ublk-control").exists() {
        eprintln!("skipped: this kernel has the ublk driver (/dev/ublk-control exists)");
        return;
    }
    let setup = Setup::new("ublk-recover-missing", 64 * MIB, 4 * MIB);
    let (cache, backing, control) = (setup.cache_arg(), setup.backing_arg(), setup.control_arg());
    let serve = [
        "serve",
        "--ublk",
        "--recover",
        "3",
        "--cache",
        &cache,
        "--backing",
        &backing,
        "--control",
        &control,
    ];
    for args in [&serve[..], &["ublk", "list"][..], &["ublk", "remove", "3"][..]] {
        let out = setup.pmcache(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        for part in ["/dev/ublk-control does not exist", "modprobe ublk_drv"] {
            assert!(err.contains(part), "{args:?}: missing {part:?} in: {err}");
        }
    }
    assert!(!setup.cache.exists(), "a refused take-over created the cache medium");
    assert!(!setup.control.exists(), "a refused take-over left a control socket");
}

/// A build without the `ublk` feature refuses `serve --ublk`, a take-over and `pmcache ublk`
/// at once, naming the feature, the package its build needs and the command that builds it,
/// and creates nothing.
#[cfg(not(feature = "ublk"))]
#[test]
fn ublk_in_a_build_without_the_feature_says_how_to_build_it() {
    let setup = Setup::new("ublk-not-built", 64 * MIB, 4 * MIB);
    let (cache, backing, control) = (setup.cache_arg(), setup.backing_arg(), setup.control_arg());
    let serve = [
        "serve",
        "--ublk",
        "--cache",
        &cache,
        "--cache-size",
        "4M",
        "--backing",
        &backing,
        "--control",
        &control,
    ];
    let takeover: Vec<&str> = serve.iter().copied().chain(["--recover", "0"]).collect();
    for args in [&serve[..], &takeover[..], &["ublk", "list"][..], &["ublk", "remove", "3"][..]] {
        let out = setup.pmcache(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        for part in [
            "without the ublk frontend",
            "cargo feature `ublk`",
            "apt-get install -y libclang-dev",
            "cargo build --release -p pmcache-cli --features ublk",
            "serve over NBD",
        ] {
            assert!(err.contains(part), "{args:?}: missing {part:?} in: {err}");
        }
    }
    assert!(!setup.cache.exists(), "a refused serve --ublk created the cache medium");
    assert!(!setup.control.exists(), "a refused serve --ublk left a control socket");
}
