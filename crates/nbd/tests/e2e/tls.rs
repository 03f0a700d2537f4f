//! TLS with real clients: libnbd's nbdinfo and nbdcopy (GnuTLS) and qemu-img (GnuTLS through
//! qemu's crypto layer) against the server with X.509 certificates (rustls) and with TLS-PSK
//! (OpenSSL), in each TLS mode; clients without TLS or with the wrong credentials get no data.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use pmcache_nbd::{BlockSizes, TlsConfig, TlsMode};
use pmcache_testkit::run;
use pmcache_testkit::tls::{X509Dirs, psk_file, x509_credentials};
use serde_json::Value;

use crate::common::{NAME, TestServer, Via, pseudo_random, read_file, require_tool, run_ok};
use crate::tls_raw::garbage_for_a_client_hello_closes;

const TIMEOUT: Duration = Duration::from_secs(60);
const SIZE_BYTES: usize = 16 << 20;
const KEY: &[u8] = b"pmcache test pre-shared key 0001";

fn tls_server(tls: TlsConfig) -> TestServer {
    TestServer::start_with(SIZE_BYTES as u64, BlockSizes::default(), Via::Tcp, |c| c.tls = tls)
}

fn x509(mode: TlsMode, dirs: &X509Dirs, verify_peer: bool) -> TlsConfig {
    TlsConfig { mode, certificates_dir: Some(dirs.server.clone()), psk_file: None, verify_peer }
}

fn psk(mode: TlsMode, file: &Path) -> TlsConfig {
    TlsConfig { mode, certificates_dir: None, psk_file: Some(file.to_owned()), verify_peer: false }
}

/// libnbd's URI for the server over TLS, `user@` for PSK, with a query of credentials.
fn nbds(server: &TestServer, user: &str, query: &str) -> String {
    let at = if user.is_empty() { String::new() } else { format!("{user}@") };
    format!("nbds://{at}{}/{NAME}?{query}", server.tcp_addr())
}

fn x509_query(dir: &Path) -> String {
    format!("tls-certificates={}", dir.display())
}

fn psk_query(file: &Path) -> String {
    format!("tls-psk-file={}", file.display())
}

/// nbdinfo's export size, or its failure output.
fn nbdinfo(uri: &str) -> Result<u64, String> {
    require_tool("nbdinfo", "libnbd-bin");
    let out = run(Command::new("nbdinfo").args(["--json", uri]), TIMEOUT);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: Value = serde_json::from_slice(&out.stdout).expect("nbdinfo json");
    Ok(v["exports"][0]["export-size"].as_u64().expect("export-size"))
}

/// A client that must get nothing: nbdinfo fails, saying `why` (in lower case) if given.
/// libnbd reports `NBD_REP_ERR_TLS_REQD` as "Operation not supported" and a refused STARTTLS
/// as a closed connection.
fn refused(uri: &str, why: &str) {
    match nbdinfo(uri) {
        Ok(size) => panic!("{uri}: served ({size} bytes) where it must be refused"),
        Err(stderr) => {
            let lower = stderr.to_lowercase();
            assert!(lower.contains(why), "{uri}: expected {why:?} in:\n{stderr}");
        }
    }
}

/// nbdcopy of fresh data into the export and back out over `uri`, both compared.
fn nbdcopy_roundtrip(server: &TestServer, uri: &str, seed: u64) {
    require_tool("nbdcopy", "libnbd-bin");
    let data = pseudo_random(SIZE_BYTES, seed);
    let src = server.path(&format!("src-{seed}.img"));
    std::fs::write(&src, &data).expect("write src");
    let src_s = src.to_str().expect("utf8");
    run_ok(Command::new("nbdcopy").args(["--connections=4", src_s, uri]), TIMEOUT);
    let mut actual = vec![0u8; SIZE_BYTES];
    server.export.read_at(0, &mut actual).expect("read export");
    assert!(actual == data, "export differs from the source after nbdcopy in over TLS");
    let out = server.path(&format!("out-{seed}.img"));
    run_ok(Command::new("nbdcopy").args([uri, out.to_str().expect("utf8")]), TIMEOUT);
    assert!(read_file(&out) == data, "nbdcopy out over TLS differs from the source");
}

/// qemu-img converts the export to a file over TLS with the credentials object `object`
/// (id `tls0`); the file must equal the export.
fn qemu_img_convert(server: &TestServer, object: &str) {
    require_tool("qemu-img", "qemu-utils");
    let addr = server.tcp_addr();
    let opts = format!(
        "driver=nbd,server.type=inet,server.host={},server.port={},export={NAME},tls-creds=tls0",
        addr.ip(),
        addr.port()
    );
    let out = server.path("qemu.img");
    let out_s = out.to_str().expect("utf8");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "--object", object, "--image-opts", &opts])
            .args(["-O", "raw", out_s]),
        TIMEOUT,
    );
    let mut expected = vec![0u8; SIZE_BYTES];
    server.export.read_at(0, &mut expected).expect("read export");
    assert!(read_file(&out) == expected, "qemu-img's copy over TLS differs from the export");
}

#[test]
fn x509_required_serves_libnbd_and_qemu_and_refuses_plain_clients() {
    let pki = tempfile::tempdir().expect("tempdir");
    let dirs = x509_credentials(pki.path());
    let server = tls_server(x509(TlsMode::Require, &dirs, false));
    let uri = nbds(&server, "", &x509_query(&dirs.anonymous));
    assert_eq!(nbdinfo(&uri), Ok(SIZE_BYTES as u64));
    nbdcopy_roundtrip(&server, &uri, 11);
    let object = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", dirs.anonymous.display());
    qemu_img_convert(&server, &object);
    // A plain client gets TLS_REQD for every option and no data.
    refused(&server.uri, "not supported");
    // A client that does not trust the server's CA fails the handshake.
    let other = tempfile::tempdir().expect("tempdir");
    let stranger = x509_credentials(other.path());
    refused(&nbds(&server, "", &x509_query(&stranger.anonymous)), "certificate");
    garbage_for_a_client_hello_closes(server.tcp_addr(), Duration::from_secs(2));
    assert_eq!(nbdinfo(&uri), Ok(SIZE_BYTES as u64), "the server keeps serving");
    server.stop();
}

#[test]
fn x509_verify_peer_needs_a_client_certificate_from_the_ca() {
    let pki = tempfile::tempdir().expect("tempdir");
    let dirs = x509_credentials(pki.path());
    let server = tls_server(x509(TlsMode::On, &dirs, true));
    let uri = nbds(&server, "", &x509_query(&dirs.client));
    assert_eq!(nbdinfo(&uri), Ok(SIZE_BYTES as u64));
    nbdcopy_roundtrip(&server, &uri, 12);
    let object = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", dirs.client.display());
    qemu_img_convert(&server, &object);
    // No client certificate: the handshake fails.
    refused(&nbds(&server, "", &x509_query(&dirs.anonymous)), "tls");
    // TLS on: plain clients are served too.
    assert_eq!(nbdinfo(&server.uri), Ok(SIZE_BYTES as u64));
    server.stop();
}

#[test]
fn psk_required_serves_libnbd_and_qemu_and_refuses_wrong_keys() {
    let keys = tempfile::tempdir().expect("tempdir");
    let file = psk_file(&keys.path().join("good"), "alice", KEY);
    let server = tls_server(psk(TlsMode::Require, &file));
    let uri = nbds(&server, "alice", &psk_query(&file));
    assert_eq!(nbdinfo(&uri), Ok(SIZE_BYTES as u64));
    nbdcopy_roundtrip(&server, &uri, 13);
    let dir = file.parent().expect("dir").display().to_string();
    qemu_img_convert(
        &server,
        &format!("tls-creds-psk,id=tls0,endpoint=client,dir={dir},username=alice"),
    );
    let wrong = psk_file(&keys.path().join("wrong"), "alice", b"not the key");
    refused(&nbds(&server, "alice", &psk_query(&wrong)), "tls");
    let stranger = psk_file(&keys.path().join("bob"), "bob", KEY);
    refused(&nbds(&server, "bob", &psk_query(&stranger)), "tls");
    refused(&server.uri, "not supported");
    assert_eq!(nbdinfo(&uri), Ok(SIZE_BYTES as u64), "the server keeps serving");
    server.stop();
}

#[test]
fn tls_on_serves_both_and_tls_off_refuses_starttls() {
    let keys = tempfile::tempdir().expect("tempdir");
    let file = psk_file(keys.path(), "alice", KEY);
    let on = tls_server(psk(TlsMode::On, &file));
    assert_eq!(nbdinfo(&nbds(&on, "alice", &psk_query(&file))), Ok(SIZE_BYTES as u64));
    assert_eq!(nbdinfo(&on.uri), Ok(SIZE_BYTES as u64));
    nbdcopy_roundtrip(&on, &on.uri, 14);
    on.stop();

    let off = tls_server(TlsConfig::default());
    refused(&nbds(&off, "alice", &psk_query(&file)), "closed");
    assert_eq!(nbdinfo(&off.uri), Ok(SIZE_BYTES as u64));
    off.stop();
}

/// Over TLS the write timeout covers each batch of replies, not the connection's life: a
/// client pausing longer than the timeout between requests is still served (the TLS
/// stream's flush ends each batch's deadline on the socket underneath).
#[test]
fn the_write_timeout_restarts_with_every_batch_of_replies_over_tls() {
    require_tool("qemu-io", "qemu-utils");
    let pki = tempfile::tempdir().expect("tempdir");
    let dirs = x509_credentials(pki.path());
    let server = TestServer::start_with(SIZE_BYTES as u64, BlockSizes::default(), Via::Tcp, |c| {
        c.tls = x509(TlsMode::Require, &dirs, false);
        c.write_timeout = Duration::from_millis(500);
    });
    let addr = server.tcp_addr();
    let object = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", dirs.anonymous.display());
    let opts = format!(
        "driver=nbd,server.type=inet,server.host={},server.port={},export={NAME},tls-creds=tls0",
        addr.ip(),
        addr.port()
    );
    let out = run_ok(
        Command::new("qemu-io")
            .args(["--object", &object, "--image-opts", &opts])
            .args(["-c", "write -P 7 0 64k", "-c", "sleep 1200", "-c", "read -P 7 0 64k"])
            .args(["-c", "sleep 1200", "-c", "read -P 7 0 64k"]),
        TIMEOUT,
    );
    assert_eq!(out.matches("read 65536/65536").count(), 2, "{out}");
    assert_eq!(server.stats().connections_dropped_write_timeout, 0);
    server.stop();
}
