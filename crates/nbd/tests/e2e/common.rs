//! Shared helpers for the integration tests: an in-process server on an ephemeral port or a
//! unix socket; running external clients with a timeout comes from `pmcache_testkit`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pmcache_nbd::{BlockSizes, ListenAddr, MemExport, RunningServer, Server, ServerConfig};

pub use pmcache_testkit::{pseudo_random, read_file, require_tool, run_ok};

/// Export name used by the tests.
pub const NAME: &str = "pm";

/// A running in-process server with a `MemExport`.
pub struct TestServer {
    /// The export (shared with the server) for checking contents directly.
    pub export: MemExport,
    /// NBD URI of the export.
    pub uri: String,
    /// The listener address.
    pub addr: ListenAddr,
    running: Option<RunningServer>,
    /// Temp dir holding the unix socket and any files a test makes.
    pub dir: tempfile::TempDir,
}

/// Which listener to use.
#[derive(Clone, Copy, Debug)]
pub enum Via {
    /// 127.0.0.1, ephemeral port.
    Tcp,
    /// A unix socket in the temp dir.
    Unix,
}

impl TestServer {
    /// Starts a server for a zeroed `MemExport`.
    pub fn start(size_bytes: u64, block_sizes: BlockSizes, via: Via) -> TestServer {
        Self::start_with(size_bytes, block_sizes, via, |_| {})
    }

    /// Starts a server after letting `tweak` adjust the configuration.
    pub fn start_with(
        size_bytes: u64,
        block_sizes: BlockSizes,
        via: Via,
        tweak: impl FnOnce(&mut ServerConfig),
    ) -> TestServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let export = MemExport::new(size_bytes, block_sizes).expect("MemExport");
        // Every test runs with the reads of a batch answered out of order: clients must match
        // replies to requests by cookie, as the cache's misses make them.
        export.set_reads_reordered(true);
        let listen = match via {
            Via::Tcp => ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0))),
            Via::Unix => ListenAddr::Unix(dir.path().join("nbd.sock")),
        };
        let mut config = ServerConfig {
            export_name: NAME.into(),
            listen,
            handshake_timeout: Duration::from_secs(5),
            ..ServerConfig::default()
        };
        tweak(&mut config);
        let server = Server::bind(config, Arc::new(export.clone())).expect("bind");
        let addr = server.local_addr();
        let uri = addr.nbd_uri(NAME);
        let running = server.spawn().expect("spawn");
        TestServer { export, uri, addr, running: Some(running), dir }
    }

    /// The TCP address (panics for unix listeners).
    pub fn tcp_addr(&self) -> SocketAddr {
        match &self.addr {
            ListenAddr::Tcp(a) => *a,
            ListenAddr::Unix(_) => panic!("not a TCP server"),
        }
    }

    /// A path inside the temp dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The server's connection counts.
    pub fn stats(&self) -> pmcache_nbd::ServerStats {
        self.running.as_ref().expect("running").stats()
    }

    /// Stops the server and waits for it.
    pub fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.stop().expect("server stopped cleanly");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            let _ = r.stop();
        }
    }
}
