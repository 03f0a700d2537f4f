//! TLS for NBD connections (`NBD_OPT_STARTTLS`): credentials, the acceptor, the stream.
//!
//! The negotiation ([`crate::codec::Negotiation`]) decides when TLS starts; this module owns
//! what happens then: loading the credentials once at bind ([`TlsConfig::load`]), running the
//! server side of the TLS handshake on a connection's transport ([`TlsAcceptor::accept`]) and
//! the encrypted stream that the rest of the connection is served over ([`TlsStream`], any
//! `Read + Write`). The server keeps a connection's transport in a [`MaybeTls`], plain until
//! the upgrade, so its protocol code is the same over either.
//!
//! Two libraries serve the two kinds of credentials that nbdkit, qemu and libnbd use:
//!
//! - X.509 certificates (`server-cert.pem`, `server-key.pem`, optionally `ca-cert.pem` to
//!   verify client certificates) through rustls with its `ring` provider;
//! - TLS-PSK (a psktool key file of `username:hexkey` lines) through OpenSSL, because rustls
//!   has no external pre-shared keys.
//!
//! Both offer TLS 1.3 and 1.2 only. The handshake runs under the connection's handshake
//! deadline (its reads are the transport's, which enforce it).

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openssl::ssl::{HandshakeError, SslAcceptor, SslMethod, SslOptions, SslStream};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConnection, StreamOwned};
use tracing::debug;

use crate::codec::TlsMode;
use crate::server::Transport;

/// The server's certificate chain in a certificates directory (nbdkit's and qemu's layout).
pub const SERVER_CERT_FILE: &str = "server-cert.pem";
/// The server's private key in a certificates directory.
pub const SERVER_KEY_FILE: &str = "server-key.pem";
/// The CA that client certificates must chain to, when they are verified.
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// Longest pre-shared key accepted (OpenSSL's `PSK_MAX_PSK_LEN`).
pub const PSK_KEY_BYTES_MAX: usize = 512;

/// OpenSSL's TLS 1.2 PSK cipher suites, forward-secret (ECDHE, DHE) first. TLS 1.3 keeps
/// OpenSSL's default suites; its PSK handshake uses `TLS_AES_128_GCM_SHA256`.
const PSK_TLS12_CIPHERS: &str = "ECDHE-PSK-CHACHA20-POLY1305:ECDHE-PSK-AES256-CBC-SHA384:\
     ECDHE-PSK-AES128-CBC-SHA256:DHE-PSK-AES256-GCM-SHA384:DHE-PSK-AES128-GCM-SHA256:\
     DHE-PSK-CHACHA20-POLY1305:PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256:PSK-CHACHA20-POLY1305";

/// How the server offers TLS: the mode and where the credentials are. Loaded by
/// [`TlsConfig::load`] when the server binds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsConfig {
    /// Off (default), on (offered), or required before any other option.
    pub mode: TlsMode,
    /// A directory holding [`SERVER_CERT_FILE`], [`SERVER_KEY_FILE`] and, to verify clients,
    /// [`CA_CERT_FILE`]: X.509 credentials.
    pub certificates_dir: Option<PathBuf>,
    /// A psktool key file (`username:hexkey` per line): TLS-PSK credentials.
    pub psk_file: Option<PathBuf>,
    /// With X.509: require a client certificate signed by [`CA_CERT_FILE`].
    pub verify_peer: bool,
}

/// Why TLS could not be configured or a connection's TLS could not start.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// TLS is on or required but neither credential was given.
    #[error("TLS is {0} but no credentials were given (a certificates directory or a PSK file)")]
    NoCredentials(&'static str),
    /// Credentials were given with TLS off.
    #[error("TLS credentials were given but TLS is off")]
    CredentialsWithTlsOff,
    /// Both a certificates directory and a PSK file were given.
    #[error("a certificates directory and a PSK file were both given; TLS uses one of them")]
    TwoCredentials,
    /// `verify_peer` without X.509 credentials.
    #[error(
        "verifying the client's certificate needs X.509 credentials (a PSK client is \
         authenticated by its key)"
    )]
    VerifyPeerWithoutCertificates,
    /// A credentials file is missing, unreadable or malformed.
    #[error("{}: {reason}", path.display())]
    Credentials {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The TLS library refused the configuration.
    #[error("TLS setup: {0}")]
    Setup(String),
    /// The client sent bytes after `NBD_OPT_STARTTLS` without waiting for the ACK.
    #[error("the client sent {0} bytes after NBD_OPT_STARTTLS before the TLS handshake")]
    BytesBeforeHandshake(usize),
    /// `NBD_OPT_STARTTLS` was acknowledged on a connection that cannot start TLS.
    #[error("TLS cannot start on this connection")]
    NotAvailable,
    /// The TLS handshake failed (bad credentials, not TLS, the client left or was too slow).
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
}

impl TlsConfig {
    /// Checks the combination and loads the credentials: what each connection's handshake
    /// offers.
    pub fn load(&self) -> Result<ConnTls, TlsError> {
        let (certs, psk) = (self.certificates_dir.as_deref(), self.psk_file.as_deref());
        if certs.is_some() && psk.is_some() {
            return Err(TlsError::TwoCredentials);
        }
        if self.verify_peer && certs.is_none() {
            return Err(TlsError::VerifyPeerWithoutCertificates);
        }
        let acceptor = match (certs, psk) {
            (Some(dir), _) => Some(TlsAcceptor::x509(dir, self.verify_peer)?),
            (None, Some(file)) => Some(TlsAcceptor::psk(file)?),
            (None, None) => None,
        };
        match (self.mode, acceptor) {
            (TlsMode::Off, None) => Ok(ConnTls::Off),
            (TlsMode::Off, Some(_)) => Err(TlsError::CredentialsWithTlsOff),
            (TlsMode::On, Some(a)) => Ok(ConnTls::On(a)),
            (TlsMode::Require, Some(a)) => Ok(ConnTls::Require(a)),
            (TlsMode::On, None) => Err(TlsError::NoCredentials("on")),
            (TlsMode::Require, None) => Err(TlsError::NoCredentials("required")),
        }
    }
}

/// TLS as each connection's handshake offers it.
#[derive(Debug, Clone, Default)]
pub enum ConnTls {
    /// No TLS (`NBD_OPT_STARTTLS` refused).
    #[default]
    Off,
    /// Offered; plain clients are served too.
    On(TlsAcceptor),
    /// Required before any option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT`.
    Require(TlsAcceptor),
}

impl ConnTls {
    /// The mode the negotiation enforces.
    pub fn mode(&self) -> TlsMode {
        match self {
            ConnTls::Off => TlsMode::Off,
            ConnTls::On(_) => TlsMode::On,
            ConnTls::Require(_) => TlsMode::Require,
        }
    }

    fn acceptor(&self) -> Option<&TlsAcceptor> {
        match self {
            ConnTls::Off => None,
            ConnTls::On(a) | ConnTls::Require(a) => Some(a),
        }
    }
}

/// Runs the server side of TLS handshakes with one set of credentials. Cheap to clone.
#[derive(Clone)]
pub struct TlsAcceptor {
    inner: Acceptor,
}

#[derive(Clone)]
enum Acceptor {
    X509 { config: Arc<rustls::ServerConfig>, verify_peer: bool },
    Psk { acceptor: Arc<SslAcceptor>, users: usize },
}

impl fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Acceptor::X509 { verify_peer, .. } => {
                write!(f, "TlsAcceptor(X.509, verify_peer: {verify_peer})")
            }
            Acceptor::Psk { users, .. } => write!(f, "TlsAcceptor(PSK, {users} users)"),
        }
    }
}

fn bad(path: &Path, reason: impl fmt::Display) -> TlsError {
    TlsError::Credentials { path: path.to_owned(), reason: reason.to_string() }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, e))?;
    if certs.is_empty() {
        return Err(bad(path, "no PEM certificate in it"));
    }
    Ok(certs)
}

impl TlsAcceptor {
    /// X.509 credentials from `dir` (rustls): [`SERVER_CERT_FILE`] (the chain, leaf first),
    /// [`SERVER_KEY_FILE`] (PKCS#8, PKCS#1 or SEC1 PEM) and, if `verify_peer`,
    /// [`CA_CERT_FILE`], which every client certificate must chain to.
    pub fn x509(dir: &Path, verify_peer: bool) -> Result<Self, TlsError> {
        let cert_path = dir.join(SERVER_CERT_FILE);
        let key_path = dir.join(SERVER_KEY_FILE);
        let certs = certificates(&cert_path)?;
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| bad(&key_path, e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsError::Setup(e.to_string()))?;
        let builder = if verify_peer {
            let ca_path = dir.join(CA_CERT_FILE);
            let mut roots = RootCertStore::empty();
            for ca in certificates(&ca_path)? {
                roots.add(ca).map_err(|e| bad(&ca_path, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| bad(&ca_path, e))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| bad(&cert_path, format_args!("with {}: {e}", key_path.display())))?;
        // NBD clients do not resume sessions: no tickets to send after the handshake.
        config.send_tls13_tickets = 0;
        Ok(Self { inner: Acceptor::X509 { config: Arc::new(config), verify_peer } })
    }

    /// TLS-PSK credentials from a psktool key file (OpenSSL): `username:hexkey` lines.
    pub fn psk(file: &Path) -> Result<Self, TlsError> {
        let text = std::fs::read_to_string(file).map_err(|e| bad(file, e))?;
        let keys = parse_psk_file(&text).map_err(|reason| bad(file, reason))?;
        let users = keys.len();
        let setup = |e: openssl::error::ErrorStack| TlsError::Setup(e.to_string());
        let mut builder =
            SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server()).map_err(setup)?;
        builder.set_cipher_list(PSK_TLS12_CIPHERS).map_err(setup)?;
        // A client that closes without close_notify has ended the connection, not broken it.
        builder.set_options(SslOptions::IGNORE_UNEXPECTED_EOF | SslOptions::NO_RENEGOTIATION);
        builder.set_psk_server_callback(move |_ssl, identity, psk_out| {
            let Some(key) = identity.and_then(|id| keys.get(id)) else {
                debug!(identity = ?identity.map(String::from_utf8_lossy), "unknown PSK identity");
                return Ok(0);
            };
            let Some(out) = psk_out.get_mut(..key.len()) else { return Ok(0) };
            out.copy_from_slice(key);
            Ok(key.len())
        });
        Ok(Self { inner: Acceptor::Psk { acceptor: Arc::new(builder.build()), users } })
    }

    /// Runs the server side of the TLS handshake over `t` and returns the encrypted stream.
    pub fn accept<T: Read + Write>(&self, mut t: T) -> Result<TlsStream<T>, TlsError> {
        match &self.inner {
            Acceptor::X509 { config, .. } => {
                let mut conn = ServerConnection::new(config.clone())
                    .map_err(|e| TlsError::Setup(e.to_string()))?;
                while conn.is_handshaking() {
                    conn.complete_io(&mut t).map_err(handshake_io)?;
                }
                while conn.wants_write() {
                    conn.write_tls(&mut t).map_err(handshake_io)?;
                }
                debug!(
                    version = ?conn.protocol_version(),
                    suite = ?conn.negotiated_cipher_suite().map(|s| s.suite()),
                    "TLS (X.509) established"
                );
                Ok(TlsStream::Rustls(Box::new(StreamOwned::new(conn, t))))
            }
            Acceptor::Psk { acceptor, .. } => match acceptor.accept(t) {
                Ok(s) => {
                    let ssl = s.ssl();
                    debug!(
                        version = ssl.version_str(),
                        suite = ssl.current_cipher().map(|c| c.name()),
                        identity = ?ssl.psk_identity().map(String::from_utf8_lossy),
                        "TLS (PSK) established"
                    );
                    Ok(TlsStream::Openssl(s))
                }
                Err(HandshakeError::SetupFailure(e)) => Err(TlsError::Setup(e.to_string())),
                Err(HandshakeError::WouldBlock(_)) => Err(timed_out()),
                Err(HandshakeError::Failure(mid)) => {
                    let e = mid.error();
                    match e.io_error() {
                        Some(io) => Err(handshake_io(io::Error::new(io.kind(), io.to_string()))),
                        None => Err(TlsError::Handshake(e.to_string())),
                    }
                }
            },
        }
    }
}

fn timed_out() -> TlsError {
    TlsError::Handshake("the client did not finish it in time".into())
}

fn handshake_io(e: io::Error) -> TlsError {
    match e.kind() {
        // A read timeout of the handshake deadline.
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => timed_out(),
        _ => TlsError::Handshake(e.to_string()),
    }
}

/// Parses a psktool key file: one `username:hexkey` per line (blank lines skipped), each
/// user once, each key 1 to [`PSK_KEY_BYTES_MAX`] bytes.
pub fn parse_psk_file(text: &str) -> Result<HashMap<Vec<u8>, Vec<u8>>, String> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let n = i + 1;
        let (user, hex) = line
            .trim_end()
            .rsplit_once(':')
            .ok_or_else(|| format!("line {n}: not username:hexkey"))?;
        if user.is_empty() {
            return Err(format!("line {n}: empty username"));
        }
        let key = decode_hex(hex).ok_or_else(|| format!("line {n}: the key is not hex"))?;
        if key.is_empty() || key.len() > PSK_KEY_BYTES_MAX {
            return Err(format!("line {n}: the key must be 1 to {PSK_KEY_BYTES_MAX} bytes"));
        }
        if keys.insert(user.as_bytes().to_vec(), key).is_some() {
            return Err(format!("line {n}: user {user:?} appears twice"));
        }
    }
    if keys.is_empty() {
        return Err("no username:hexkey line".into());
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    hex.as_bytes().chunks_exact(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// A connection's stream once TLS is established.
pub enum TlsStream<T: Read + Write> {
    /// X.509, served by rustls.
    Rustls(Box<StreamOwned<ServerConnection, T>>),
    /// PSK, served by OpenSSL.
    Openssl(SslStream<T>),
}

impl<T: Read + Write> TlsStream<T> {
    /// The transport under the encryption.
    pub fn get_mut(&mut self) -> &mut T {
        match self {
            TlsStream::Rustls(s) => s.get_mut(),
            TlsStream::Openssl(s) => s.get_mut(),
        }
    }
}

impl<T: Read + Write> fmt::Debug for TlsStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsStream::Rustls(_) => "TlsStream::Rustls",
            TlsStream::Openssl(_) => "TlsStream::Openssl",
        })
    }
}

impl<T: Read + Write> Read for TlsStream<T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            TlsStream::Rustls(s) => s.read(buf),
            TlsStream::Openssl(s) => s.read(buf),
        }
    }
}

impl<T: Read + Write> Write for TlsStream<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            TlsStream::Rustls(s) => s.write(buf),
            TlsStream::Openssl(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            TlsStream::Rustls(s) => s.flush(),
            TlsStream::Openssl(s) => s.flush(),
        }
    }
}

/// A connection's transport: plain until `NBD_OPT_STARTTLS`, then TLS over it.
#[derive(Debug)]
pub(crate) enum MaybeTls<T: Read + Write> {
    Plain(T),
    Tls(TlsStream<T>),
    /// The handshake failed: the transport is gone.
    Failed,
}

impl<T: Transport> MaybeTls<T> {
    /// Runs the TLS handshake over the plain transport and serves over TLS from then on.
    pub(crate) fn start_tls(&mut self, tls: &ConnTls) -> Result<(), TlsError> {
        let acceptor = tls.acceptor().ok_or(TlsError::NotAvailable)?;
        match std::mem::replace(self, MaybeTls::Failed) {
            MaybeTls::Plain(t) => {
                *self = MaybeTls::Tls(acceptor.accept(t)?);
                Ok(())
            }
            other => {
                *self = other;
                Err(TlsError::NotAvailable)
            }
        }
    }
}

fn failed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the connection's TLS handshake failed")
}

impl<T: Transport> Read for MaybeTls<T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            MaybeTls::Plain(t) => t.read(buf),
            MaybeTls::Tls(s) => s.read(buf),
            MaybeTls::Failed => Err(failed()),
        }
    }
}

impl<T: Transport> Write for MaybeTls<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            MaybeTls::Plain(t) => t.write(buf),
            MaybeTls::Tls(s) => s.write(buf),
            MaybeTls::Failed => Err(failed()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            MaybeTls::Plain(t) => t.flush(),
            MaybeTls::Tls(s) => s.flush(),
            MaybeTls::Failed => Err(failed()),
        }
    }
}

impl<T: Transport> Transport for MaybeTls<T> {
    fn poll_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match self {
            MaybeTls::Plain(t) => t.poll_fd(),
            MaybeTls::Tls(TlsStream::Rustls(s)) => s.get_ref().poll_fd(),
            MaybeTls::Tls(TlsStream::Openssl(s)) => s.get_ref().poll_fd(),
            MaybeTls::Failed => None,
        }
    }

    fn has_buffered_input(&mut self) -> bool {
        match self {
            MaybeTls::Plain(t) => t.has_buffered_input(),
            // Records received whole are decrypted here; an error is left for the next read
            // to report.
            MaybeTls::Tls(TlsStream::Rustls(s)) => s
                .conn
                .process_new_packets()
                .map_or(true, |state| state.plaintext_bytes_to_read() > 0),
            // Without read-ahead OpenSSL takes one record at a time from the socket: what it
            // holds is the rest of the record being read.
            MaybeTls::Tls(TlsStream::Openssl(s)) => s.ssl().pending() > 0,
            MaybeTls::Failed => false,
        }
    }

    fn end_handshake(&mut self) -> io::Result<()> {
        match self {
            MaybeTls::Plain(t) => t.end_handshake(),
            MaybeTls::Tls(s) => s.get_mut().end_handshake(),
            MaybeTls::Failed => Err(failed()),
        }
    }

    fn end_replies(&mut self) -> io::Result<()> {
        match self {
            MaybeTls::Plain(t) => t.end_replies(),
            MaybeTls::Tls(s) => s.get_mut().end_replies(),
            MaybeTls::Failed => Err(failed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{
        ExportInfo, Negotiation, OPT_ABORT, OPT_EXPORT_NAME, OPT_GO, OPT_INFO, OPT_LIST,
        OPT_STARTTLS, OPT_STRUCTURED_REPLY, OptionHeader, OptionOutcome, ProtocolError, REP_ACK,
        REP_ERR_INVALID, REP_ERR_POLICY, REP_ERR_TLS_REQD,
    };
    use crate::export::BlockSizes;

    fn export() -> ExportInfo {
        ExportInfo {
            name: "pm".into(),
            size_bytes: 1 << 20,
            block_sizes: BlockSizes { min_bytes: 512, preferred_bytes: 4096, max_bytes: 1 << 20 },
            can_multi_conn: true,
        }
    }

    /// Handles one option; returns the outcome and the reply types appended.
    fn option(n: &mut Negotiation<'_>, option: u32, data: &[u8]) -> (OptionOutcome, Vec<u32>) {
        let mut out = Vec::new();
        let h = OptionHeader { option, data_len_bytes: data.len() as u32 };
        let outcome = n.handle_option(h, data, &mut out);
        let mut types = Vec::new();
        let mut at = 0;
        while at + 20 <= out.len() {
            types.push(u32::from_be_bytes(out[at + 12..at + 16].try_into().expect("4 bytes")));
            at += 20 + u32::from_be_bytes(out[at + 16..at + 20].try_into().expect("4")) as usize;
        }
        (outcome, types)
    }

    fn go() -> Vec<u8> {
        let mut d = 2u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"pm");
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&crate::codec::INFO_BLOCK_SIZE.to_be_bytes());
        d
    }

    /// FORCEDTLS: before TLS every option but STARTTLS and ABORT gets TLS_REQD and
    /// EXPORT_NAME closes; STARTTLS with data is invalid; after the ACK the options are
    /// served, a second STARTTLS is invalid and nothing gets TLS_REQD any more.
    #[test]
    fn require_refuses_everything_before_tls() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 3]).expect("flags").with_tls(TlsMode::Require);
        for opt in [OPT_LIST, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY, 4, 99] {
            let data = if opt == OPT_GO || opt == OPT_INFO { go() } else { Vec::new() };
            assert_eq!(
                option(&mut n, opt, &data),
                (OptionOutcome::Continue, vec![REP_ERR_TLS_REQD])
            );
        }
        assert_eq!(
            option(&mut n, OPT_STARTTLS, b"x"),
            (OptionOutcome::Continue, vec![REP_ERR_INVALID])
        );
        assert!(!n.tls_active());
        let mut closing = Negotiation::new(&e, [0, 0, 0, 3]).expect("flags");
        closing = closing.with_tls(TlsMode::Require);
        assert_eq!(
            option(&mut closing, OPT_EXPORT_NAME, b"pm"),
            (OptionOutcome::Close(ProtocolError::TlsRequired), vec![])
        );
        let mut aborting = Negotiation::new(&e, [0, 0, 0, 3]).expect("flags");
        aborting = aborting.with_tls(TlsMode::Require);
        assert_eq!(option(&mut aborting, OPT_ABORT, &[]), (OptionOutcome::Abort, vec![REP_ACK]));

        assert_eq!(option(&mut n, OPT_STARTTLS, &[]), (OptionOutcome::StartTls, vec![REP_ACK]));
        assert!(n.tls_active());
        assert_eq!(
            option(&mut n, OPT_STARTTLS, &[]),
            (OptionOutcome::Continue, vec![REP_ERR_INVALID])
        );
        assert_eq!(option(&mut n, OPT_LIST, &[]).1.last(), Some(&REP_ACK));
        let (outcome, _) = option(&mut n, OPT_GO, &go());
        assert!(matches!(outcome, OptionOutcome::Transmission(_)), "{outcome:?}");
    }

    /// TLS on: plain options are served, STARTTLS is acknowledged; structured replies agreed
    /// in clear do not survive the upgrade. TLS off: STARTTLS is refused by policy.
    #[test]
    fn on_serves_both_and_off_refuses_starttls() {
        let e = export();
        let mut n = Negotiation::new(&e, [0, 0, 0, 3]).expect("flags").with_tls(TlsMode::On);
        assert_eq!(option(&mut n, OPT_STRUCTURED_REPLY, &[]).1, [REP_ACK]);
        assert_eq!(option(&mut n, OPT_STARTTLS, &[]), (OptionOutcome::StartTls, vec![REP_ACK]));
        let OptionOutcome::Transmission(session) = option(&mut n, OPT_GO, &go()).0 else {
            panic!("GO after TLS enters transmission");
        };
        assert!(!session.structured_replies, "negotiated in clear, so forgotten");

        let mut plain = Negotiation::new(&e, [0, 0, 0, 3]).expect("flags").with_tls(TlsMode::On);
        assert!(matches!(option(&mut plain, OPT_GO, &go()).0, OptionOutcome::Transmission(_)));

        let mut off = Negotiation::new(&e, [0, 0, 0, 3]).expect("flags");
        assert_eq!(
            option(&mut off, OPT_STARTTLS, &[]),
            (OptionOutcome::Continue, vec![REP_ERR_POLICY])
        );
        assert!(!off.tls_active());
        assert!(matches!(option(&mut off, OPT_GO, &go()).0, OptionOutcome::Transmission(_)));
    }

    #[test]
    fn psk_files_are_psktools_format_and_checked() {
        let keys = parse_psk_file("alice:00ff10\n\nbob:ABCDEF01\n").expect("valid");
        assert_eq!(keys[b"alice".as_slice()], [0x00, 0xff, 0x10]);
        assert_eq!(keys[b"bob".as_slice()], [0xab, 0xcd, 0xef, 0x01]);
        for (text, why) in [
            ("", "no username"),
            ("alice", "not username:hexkey"),
            (":00", "empty username"),
            ("alice:0g", "not hex"),
            ("alice:abc", "not hex"),
            ("alice:", "1 to 512"),
            ("alice:00\nalice:01", "twice"),
        ] {
            let e = parse_psk_file(text).expect_err(text);
            assert!(e.contains(why), "{text:?}: {e}");
        }
        assert!(parse_psk_file(&format!("a:{}", "00".repeat(PSK_KEY_BYTES_MAX + 1))).is_err());
    }

    #[test]
    fn configurations_are_checked_before_anything_is_loaded() {
        let dir = PathBuf::from("/nonexistent-pmcache-tls");
        let config = |mode, certs: bool, psk: bool, verify_peer| TlsConfig {
            mode,
            certificates_dir: certs.then(|| dir.clone()),
            psk_file: psk.then(|| dir.join("keys.psk")),
            verify_peer,
        };
        let err = |c: TlsConfig| c.load().expect_err("refused").to_string();
        assert!(matches!(config(TlsMode::Off, false, false, false).load(), Ok(ConnTls::Off)));
        assert!(err(config(TlsMode::On, false, false, false)).contains("no credentials"));
        assert!(err(config(TlsMode::Require, true, true, false)).contains("both"));
        assert!(err(config(TlsMode::On, false, true, true)).contains("X.509"));
        assert!(err(config(TlsMode::On, true, false, false)).contains("server-cert.pem"));
        assert!(err(config(TlsMode::On, false, true, false)).contains("keys.psk"));
    }
}
