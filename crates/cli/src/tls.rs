//! `pmcache serve`'s TLS flags (`--tls`, `--tls-certificates`, `--tls-psk`,
//! `--tls-verify-peer`): checked against each other and the listener before anything is
//! opened, turned into the server's [`TlsConfig`], and described to the operator.

use std::path::PathBuf;

use pmcache_nbd::{ListenAddr, TlsConfig, TlsMode};

/// TLS for NBD clients (`NBD_OPT_STARTTLS`, as nbdkit and qemu-nbd offer it).
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// TLS: off (STARTTLS refused), on (offered; plain clients served too) or require (no
    /// option but STARTTLS before TLS; plain clients get no data).
    #[arg(long, value_enum, default_value = "off")]
    pub tls: TlsFlag,
    /// X.509 credentials: a directory with server-cert.pem and server-key.pem (and ca-cert.pem
    /// for --tls-verify-peer), the layout of nbdkit and qemu.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    pub tls_certificates: Option<PathBuf>,
    /// TLS-PSK credentials: a psktool key file of `username:hexkey` lines.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// With --tls-certificates: require a client certificate signed by the directory's
    /// ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,
}

/// Which clients a server authenticates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientAuth {
    /// By a pre-shared key of this file (TLS required).
    Psk(PathBuf),
    /// By a client certificate signed by this directory's `ca-cert.pem` (TLS required).
    Certificate(PathBuf),
    /// Nobody: every client that reaches the listener is served.
    Nobody,
}

/// The `--tls` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsFlag {
    /// No TLS.
    Off,
    /// TLS offered.
    On,
    /// TLS required.
    Require,
}

impl TlsArgs {
    /// The server's TLS configuration, or why these flags do not make one.
    pub fn config(&self) -> Result<TlsConfig, String> {
        let mode = match self.tls {
            TlsFlag::Off => TlsMode::Off,
            TlsFlag::On => TlsMode::On,
            TlsFlag::Require => TlsMode::Require,
        };
        let credentials = self.tls_certificates.is_some() || self.tls_psk.is_some();
        if mode == TlsMode::Off && credentials {
            return Err("--tls-certificates and --tls-psk need --tls=on or --tls=require".into());
        }
        if mode == TlsMode::Off && self.tls_verify_peer {
            return Err("--tls-verify-peer needs --tls=on or --tls=require".into());
        }
        if mode != TlsMode::Off && !credentials {
            let flag = if mode == TlsMode::On { "on" } else { "require" };
            return Err(format!(
                "--tls={flag} needs credentials: --tls-certificates DIR (server-cert.pem, \
                 server-key.pem) or --tls-psk FILE (username:hexkey lines, as psktool writes)"
            ));
        }
        if self.tls_verify_peer && self.tls_certificates.is_none() {
            return Err("--tls-verify-peer needs --tls-certificates (with its ca-cert.pem); a \
                        PSK client is authenticated by its key"
                .into());
        }
        Ok(TlsConfig {
            mode,
            certificates_dir: self.tls_certificates.clone(),
            psk_file: self.tls_psk.clone(),
            verify_peer: self.tls_verify_peer,
        })
    }

    /// Which clients these flags authenticate. Only `--tls=require` authenticates anyone:
    /// with `--tls=on` a plain client is served too.
    pub fn client_auth(&self) -> ClientAuth {
        if self.tls != TlsFlag::Require {
            return ClientAuth::Nobody;
        }
        match (&self.tls_psk, &self.tls_certificates) {
            (Some(psk), _) => ClientAuth::Psk(psk.clone()),
            (None, Some(dir)) if self.tls_verify_peer => ClientAuth::Certificate(dir.clone()),
            _ => ClientAuth::Nobody,
        }
    }

    /// Whether these flags may serve `listen`: a listener other hosts reach
    /// (`--allow-remote` on a non-loopback address) with no client authenticated is refused
    /// unless `allow_unauthenticated` (`--allow-unauthenticated`) says so; served then, with
    /// the warning returned.
    pub fn check_remote(
        &self,
        listen: &ListenAddr,
        allow_remote: bool,
        allow_unauthenticated: bool,
    ) -> Result<Option<String>, String> {
        let remote = matches!(listen, ListenAddr::Tcp(a) if !a.ip().is_loopback());
        if !(allow_remote && remote) || self.client_auth() != ClientAuth::Nobody {
            return Ok(None);
        }
        let why = match (self.tls, self.tls_certificates.is_some()) {
            (TlsFlag::Off, _) => "with --tls=off the export travels in clear, and",
            (TlsFlag::On, _) => "--tls=on serves plain clients too, so",
            (TlsFlag::Require, _) => {
                "--tls=require with --tls-certificates and no --tls-verify-peer encrypts but                  checks no client certificate, so"
            }
        };
        if !allow_unauthenticated {
            return Err(format!(
                "refusing to serve {listen} to other hosts with no client authentication: {why}                  anyone who reaches the port reads and writes the device. Authenticate clients                  with --tls=require and --tls-psk FILE, or --tls=require, --tls-certificates                  DIR and --tls-verify-peer; or pass --allow-unauthenticated to serve anyone",
                listen = match listen {
                    ListenAddr::Tcp(a) => a.to_string(),
                    ListenAddr::Unix(p) => p.display().to_string(),
                }
            ));
        }
        Ok(Some(format!(
            "pmcache: warning: --allow-unauthenticated: {why} anyone who reaches the port reads              and writes the device"
        )))
    }

    /// The start-up banner's line on which clients are authenticated.
    pub fn clients_line(&self, listen: &ListenAddr) -> String {
        let local = match listen {
            ListenAddr::Tcp(a) if a.ip().is_loopback() => Some("processes on this host"),
            ListenAddr::Tcp(_) => None,
            ListenAddr::Unix(_) => Some("processes that may open the socket"),
        };
        let who = match self.client_auth() {
            ClientAuth::Psk(file) => {
                format!("authenticated by TLS-PSK (a key of {})", file.display())
            }
            ClientAuth::Certificate(dir) => format!(
                "authenticated by a client certificate signed by {}",
                dir.join("ca-cert.pem").display()
            ),
            ClientAuth::Nobody => match local {
                Some(who) => format!("not authenticated ({who} reach it)"),
                None => "NOT AUTHENTICATED: anyone who reaches the port reads and writes the                          device"
                    .to_owned(),
            },
        };
        format!("  clients:     {who}")
    }

    /// How TLS clients connect, for the start-up banner (`None` with TLS off).
    pub fn how_to_connect(&self, listen: &ListenAddr, export: &str) -> Option<String> {
        if self.tls == TlsFlag::Off {
            return None;
        }
        let psk = self.tls_certificates.is_none();
        // libnbd takes a PSK username from the URI's user part.
        let user = if psk { "<user>@" } else { "" };
        let uri = match listen {
            ListenAddr::Tcp(a) => format!("nbds://{user}{a}/{export}?"),
            ListenAddr::Unix(p) => format!("nbds+unix://{user}/{export}?socket={}&", p.display()),
        };
        let (query, qemu) = match &self.tls_certificates {
            Some(dir) => (
                "tls-certificates=<dir with ca-cert.pem>".to_owned(),
                format!(
                    "--object tls-creds-x509,id=tls0,endpoint=client,dir=<dir with ca-cert.pem> \
                     (this server's: {})",
                    dir.display()
                ),
            ),
            None => (
                "tls-psk-file=<psk file>".to_owned(),
                "--object tls-creds-psk,id=tls0,endpoint=client,dir=<dir with keys.psk>,\
                 username=<user>"
                    .to_owned(),
            ),
        };
        let mode = if self.tls == TlsFlag::Require { "required" } else { "offered" };
        Some(format!(
            "  TLS:         {mode}\n  nbdinfo:     nbdinfo '{uri}{query}'\n  qemu-img:    \
             qemu-img info {qemu} --image-opts driver=nbd,...,export={export},tls-creds=tls0"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(tls: TlsFlag, certs: bool, psk: bool, verify: bool) -> TlsArgs {
        TlsArgs {
            tls,
            tls_certificates: certs.then(|| PathBuf::from("/etc/pki/pmcache")),
            tls_psk: psk.then(|| PathBuf::from("/etc/pmcache/keys.psk")),
            tls_verify_peer: verify,
        }
    }

    #[test]
    fn flags_that_make_no_configuration_are_refused_precisely() {
        let refused = |a: TlsArgs| a.config().expect_err("refused");
        assert!(refused(args(TlsFlag::On, false, false, false)).contains("--tls=on needs"));
        assert!(refused(args(TlsFlag::Require, false, false, false)).contains("--tls=require"));
        assert!(refused(args(TlsFlag::Off, true, false, false)).contains("need --tls=on"));
        assert!(refused(args(TlsFlag::Off, false, false, true)).contains("--tls-verify-peer"));
        assert!(refused(args(TlsFlag::On, false, true, true)).contains("--tls-certificates"));
        let ok = args(TlsFlag::Require, true, false, true).config().expect("valid");
        assert_eq!(ok.mode, TlsMode::Require);
        assert!(ok.verify_peer && ok.certificates_dir.is_some() && ok.psk_file.is_none());
        assert_eq!(
            args(TlsFlag::Off, false, false, false).config().expect("off"),
            TlsConfig { mode: TlsMode::Off, ..TlsConfig::default() }
        );
    }

    #[test]
    fn only_tls_required_with_a_key_or_a_verified_certificate_authenticates_clients() {
        let auth = |a: TlsArgs| a.client_auth();
        assert!(matches!(auth(args(TlsFlag::Require, false, true, false)), ClientAuth::Psk(_)));
        assert!(matches!(
            auth(args(TlsFlag::Require, true, false, true)),
            ClientAuth::Certificate(_)
        ));
        assert_eq!(auth(args(TlsFlag::Require, true, false, false)), ClientAuth::Nobody);
        assert_eq!(auth(args(TlsFlag::On, false, true, false)), ClientAuth::Nobody);
        assert_eq!(auth(args(TlsFlag::On, true, false, true)), ClientAuth::Nobody);
        assert_eq!(auth(args(TlsFlag::Off, false, false, false)), ClientAuth::Nobody);
    }

    #[test]
    fn a_remote_listener_with_no_client_authenticated_needs_allow_unauthenticated() {
        let remote = ListenAddr::Tcp("0.0.0.0:10809".parse().expect("addr"));
        let local = ListenAddr::Tcp("127.0.0.1:10809".parse().expect("addr"));
        let unauthenticated = [
            (args(TlsFlag::Off, false, false, false), "--tls=off"),
            (args(TlsFlag::On, false, true, false), "--tls=on serves plain clients"),
            (args(TlsFlag::On, true, false, true), "--tls=on serves plain clients"),
            (args(TlsFlag::Require, true, false, false), "no --tls-verify-peer"),
        ];
        for (a, why) in &unauthenticated {
            let refused = a.check_remote(&remote, true, false).expect_err("refused");
            assert!(
                refused.contains(why) && refused.contains("--allow-unauthenticated"),
                "{refused}"
            );
            let warned = a.check_remote(&remote, true, true).expect("served").expect("warned");
            assert!(warned.contains("anyone who reaches the port"), "{warned}");
            assert_eq!(a.check_remote(&local, true, false), Ok(None), "loopback");
            assert!(a.clients_line(&remote).contains("NOT AUTHENTICATED"));
            assert!(a.clients_line(&local).contains("not authenticated (processes on this host"));
        }
        for a in
            [args(TlsFlag::Require, false, true, false), args(TlsFlag::Require, true, false, true)]
        {
            assert_eq!(a.check_remote(&remote, true, false), Ok(None));
            assert!(a.clients_line(&remote).contains("authenticated by"));
        }
    }
}
