//! TLS credentials for the end-to-end tests, made fresh by the `openssl` command: a CA, a
//! server certificate for 127.0.0.1 and localhost, a client certificate, and psktool key files.
//! The key usages are the ones qemu checks (`keyEncipherment` too, although the keys are
//! ECDSA).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{require_tool, run_ok};

const OPENSSL_CONFIG: &str = "\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

/// X.509 credentials in nbdkit's and qemu's layout.
#[derive(Debug, Clone)]
pub struct X509Dirs {
    /// The server's: `server-cert.pem`, `server-key.pem`, `ca-cert.pem`.
    pub server: PathBuf,
    /// A client's: `ca-cert.pem`, `client-cert.pem`, `client-key.pem` (libnbd's
    /// `tls-certificates=`, qemu's `tls-creds-x509,dir=`).
    pub client: PathBuf,
    /// A client's with the CA only (no client certificate).
    pub anonymous: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    run_ok(Command::new("openssl").current_dir(dir).args(args), Duration::from_secs(30));
}

/// Makes a CA, a server certificate (127.0.0.1, localhost) and a client certificate (P-256
/// keys) under `root`.
pub fn x509_credentials(root: &Path) -> X509Dirs {
    require_tool("openssl", "openssl");
    let work = root.join("pki");
    std::fs::create_dir_all(&work).expect("pki dir");
    std::fs::write(work.join("openssl.cnf"), OPENSSL_CONFIG).expect("openssl.cnf");
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-config"];
    let mut ca = vec!["req", "-new", "-x509", "-days", "2", "-extensions", "ca"];
    ca.extend(ec);
    ca.extend(["openssl.cnf", "-keyout", "ca-key.pem", "-out", "ca-cert.pem"]);
    ca.extend(["-subj", "/CN=pmcache test CA"]);
    openssl(&work, &ca);
    for (who, serial) in [("server", "2"), ("client", "3")] {
        let (key, csr, cert) =
            (format!("{who}-key.pem"), format!("{who}.csr"), format!("{who}-cert.pem"));
        let mut req = vec!["req", "-new"];
        req.extend(ec);
        let subject = format!("/CN=pmcache test {who}");
        req.extend(["openssl.cnf", "-keyout", &key, "-out", &csr, "-subj", &subject]);
        openssl(&work, &req);
        openssl(
            &work,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca-cert.pem",
                "-CAkey",
                "ca-key.pem",
                "-set_serial",
                serial,
                "-days",
                "2",
                "-extfile",
                "openssl.cnf",
                "-extensions",
                who,
                "-out",
                &cert,
            ],
        );
    }
    let dirs = X509Dirs {
        server: root.join("server-pki"),
        client: root.join("client-pki"),
        anonymous: root.join("anonymous-pki"),
    };
    let copies: [(&Path, &[&str]); 3] = [
        (&dirs.server, &["ca-cert.pem", "server-cert.pem", "server-key.pem"]),
        (&dirs.client, &["ca-cert.pem", "client-cert.pem", "client-key.pem"]),
        (&dirs.anonymous, &["ca-cert.pem"]),
    ];
    for (dir, files) in copies {
        std::fs::create_dir_all(dir).expect("credentials dir");
        for f in files {
            std::fs::copy(work.join(f), dir.join(f)).expect("copy credential");
        }
    }
    dirs
}

/// Writes a psktool key file `dir/keys.psk` with one `user:hexkey` line (qemu's
/// `tls-creds-psk` reads that name from its `dir=`); returns its path.
pub fn psk_file(dir: &Path, user: &str, key: &[u8]) -> PathBuf {
    std::fs::create_dir_all(dir).expect("psk dir");
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join("keys.psk");
    std::fs::write(&path, format!("{user}:{hex}\n")).expect("write psk file");
    path
}
