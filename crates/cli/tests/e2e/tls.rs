//! `pmcache serve --tls`: the cache served over TLS to libnbd clients with a pre-shared key
//! and with X.509 certificates (client certificates verified), plain clients refused when TLS
//! is required, and flag combinations that make no TLS configuration refused before anything
//! is opened.

use std::process::Command;
use std::time::Duration;

use pmcache_testkit::tls::{psk_file, x509_credentials};

use crate::common::*;

const TIMEOUT: Duration = Duration::from_secs(90);

fn nbdinfo_size(uri: &str) -> u64 {
    let out = run_ok(Command::new("nbdinfo").args(["--json", uri]), TIMEOUT);
    let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo json");
    v["exports"][0]["export-size"].as_u64().expect("export-size")
}

#[test]
fn tls_required_with_a_psk_serves_nbdcopy_and_refuses_plain_clients() {
    require_tool("nbdcopy", "libnbd-bin");
    let size_bytes = 24 * MIB as usize;
    let setup = Setup::new("tls-psk", size_bytes as u64, 8 * MIB);
    let psk =
        psk_file(&setup.disk.path().join("psk"), "alice", b"0123456789abcdef0123456789abcdef");
    let psk_s = psk.display().to_string();
    let server = setup.serve(Via::Tcp, &["--tls=require", "--tls-psk", &psk_s]);
    let uri = format!("nbds://alice@{}/{EXPORT}?tls-psk-file={psk_s}", server.addr());
    assert_eq!(nbdinfo_size(&uri), size_bytes as u64);

    let data = pseudo_random(size_bytes, 31);
    let src = setup.disk.path().join("src.img");
    std::fs::write(&src, &data).expect("write src");
    let src_s = src.to_str().expect("utf8");
    run_ok(Command::new("nbdcopy").args(["--connections=4", src_s, &uri]), TIMEOUT);
    let out = setup.disk.path().join("out.img");
    run_ok(Command::new("nbdcopy").args([&uri, out.to_str().expect("utf8")]), TIMEOUT);
    assert!(read_file(&out) == data, "nbdcopy out over TLS differs from what went in");

    let plain = run(Command::new("nbdinfo").args(["--json", &server.uri]), TIMEOUT);
    assert!(!plain.status.success(), "a plain client must get nothing:\n{plain:?}");
    let logs = server.terminate();
    assert!(logs.contains("TLS:         required"), "{logs}");
    // Everything written over TLS reached the backing file at the clean stop.
    assert!(read_file(&setup.backing) == data, "backing file after the stop");
}

#[test]
fn tls_on_with_certificates_verifies_client_certificates() {
    require_tool("nbdinfo", "libnbd-bin");
    let setup = Setup::new("tls-x509", 16 * MIB, 4 * MIB);
    let dirs = x509_credentials(setup.disk.path());
    let certs = dirs.server.display().to_string();
    let server =
        setup.serve(Via::Tcp, &["--tls=on", "--tls-certificates", &certs, "--tls-verify-peer"]);
    let uri = |dir: &std::path::Path| {
        format!("nbds://{}/{EXPORT}?tls-certificates={}", server.addr(), dir.display())
    };
    assert_eq!(nbdinfo_size(&uri(&dirs.client)), 16 * MIB);
    let anonymous = run(Command::new("nbdinfo").arg(uri(&dirs.anonymous)), TIMEOUT);
    assert!(!anonymous.status.success(), "no client certificate: {anonymous:?}");
    // TLS on: a plain client is served too.
    assert_eq!(nbdinfo_size(&server.uri), 16 * MIB);
    server.terminate();
}

#[test]
fn tls_flags_that_make_no_configuration_are_refused_before_the_cache_is_opened() {
    let setup = Setup::new("tls-flags", 16 * MIB, 4 * MIB);
    let missing = setup.disk.path().join("no-such-dir");
    let missing_s = missing.display().to_string();
    for (extra, message) in [
        (vec!["--tls=on"], "--tls=on needs credentials"),
        (vec!["--tls=require"], "--tls=require needs credentials"),
        (vec!["--tls-psk", "/x.psk"], "need --tls=on or --tls=require"),
        (vec!["--tls=on", "--tls-psk", "/x.psk", "--tls-verify-peer"], "--tls-certificates"),
        (vec!["--tls=require", "--tls-certificates", &missing_s], "server-cert.pem"),
    ] {
        let out = setup.serve_refused(&setup.cache, &extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} must be refused");
        assert!(stderr.contains(message), "{extra:?}: expected {message:?} in:\n{stderr}");
        assert!(!setup.cache.exists(), "{extra:?}: refused after the cache was opened");
    }
}

/// A listener other hosts reach is refused when no client would be authenticated —
/// certificates without `--tls-verify-peer`, `--tls=on`, TLS off — with the flags that
/// authenticate clients named and nothing created; `--allow-unauthenticated` serves anyway,
/// and the banner says that nobody is authenticated. A PSK server on the same address starts
/// and says its clients are authenticated by their key.
#[test]
fn a_remote_listener_authenticates_clients_or_says_it_does_not() {
    let setup = Setup::new("tls-remote", 64 * MIB, 4 * MIB);
    let dirs = x509_credentials(setup.disk.path());
    let certs = dirs.server.display().to_string();
    let psk =
        psk_file(&setup.disk.path().join("psk"), "alice", b"0123456789abcdef0123456789abcdef");
    let psk = psk.display().to_string();
    let base = [
        "serve",
        "--cache",
        &setup.cache_arg(),
        "--cache-size",
        "4M",
        "--backing",
        &setup.backing_arg(),
        "--control",
        &setup.control_arg(),
        "--listen",
        "0.0.0.0:0",
        "--allow-remote",
    ];
    for (extra, why) in [
        (&["--tls=require", "--tls-certificates", &certs][..], "no --tls-verify-peer"),
        (&["--tls=on", "--tls-psk", &psk][..], "--tls=on serves plain clients too"),
        (&[][..], "--tls=off"),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let out = setup.pmcache(&args);
        assert_eq!(out.status.code(), Some(1), "{extra:?} served");
        let err = String::from_utf8_lossy(&out.stderr);
        for part in
            [why, "no client authentication", "--tls-verify-peer", "--allow-unauthenticated"]
        {
            assert!(err.contains(part), "{extra:?}: missing {part:?} in: {err}");
        }
        assert!(!setup.cache.exists(), "{extra:?}: a refused start created the medium");
    }
    let unauthenticated: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--tls=require", "--tls-certificates", &certs, "--allow-unauthenticated"])
        .collect();
    let banner = started_banner(&setup, &unauthenticated);
    assert!(banner.contains("clients:     NOT AUTHENTICATED"), "{banner}");
    let authenticated: Vec<&str> =
        base.iter().copied().chain(["--tls=require", "--tls-psk", &psk]).collect();
    let banner = started_banner(&setup, &authenticated);
    assert!(banner.contains("clients:     authenticated by TLS-PSK"), "{banner}");
}

/// Starts `pmcache` with `args`, reads its start-up banner (stdout up to the `clients:` line),
/// and stops it with SIGTERM.
fn started_banner(setup: &Setup, args: &[&str]) -> String {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pmcache"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start pmcache");
    let mut banner = String::new();
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    for line in lines.by_ref() {
        let line = line.expect("banner");
        banner.push_str(&line);
        banner.push('\n');
        if line.contains("clients:") {
            break;
        }
    }
    let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let status = child.wait().expect("wait");
    assert!(status.success(), "the server did not stop cleanly: {status}; banner: {banner}");
    let _ = std::fs::remove_file(&setup.cache);
    banner
}
