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

    /// A warning for a listener other hosts reach without TLS.
    pub fn remote_warning(&self, listen: &ListenAddr, allow_remote: bool) -> Option<String> {
        let remote = matches!(listen, ListenAddr::Tcp(a) if !a.ip().is_loopback());
        (allow_remote && remote && self.tls == TlsFlag::Off).then(|| {
            "pmcache: warning: --allow-remote with --tls=off: the export travels in clear and \
             anyone who reaches the port reads and writes it; consider --tls=require with \
             --tls-certificates or --tls-psk"
                .to_owned()
        })
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
    fn only_a_remote_listener_without_tls_is_warned_about() {
        let remote = ListenAddr::Tcp("0.0.0.0:10809".parse().expect("addr"));
        let local = ListenAddr::Tcp("127.0.0.1:10809".parse().expect("addr"));
        let off = args(TlsFlag::Off, false, false, false);
        assert!(off.remote_warning(&remote, true).is_some());
        assert!(off.remote_warning(&local, true).is_none());
        assert!(args(TlsFlag::Require, false, true, false).remote_warning(&remote, true).is_none());
    }
}
