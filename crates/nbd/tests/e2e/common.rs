//! Shared helpers for the integration tests: an in-process server on an ephemeral port or a
//! unix socket, and running external clients with a timeout.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pmcache_nbd::{BlockSizes, ListenAddr, MemExport, RunningServer, Server, ServerConfig};

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

/// Fails the test unless `bin` is on PATH, naming the apt package that provides it.
pub fn require_tool(bin: &str, apt_package: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false);
    assert!(found, "`{bin}` not found on PATH: install it with `apt-get install -y {apt_package}`");
}

/// Runs a command to completion, killing it after `timeout`; panics on timeout.
pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
    let deadline = Instant::now() + timeout;
    // Drain pipes on threads so a chatty child cannot block on a full pipe.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut v);
        v
    });
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("timed out after {timeout:?}: {desc}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output { status, stdout: out_t.join().expect("stdout"), stderr: err_t.join().expect("stderr") }
}

/// Runs a command and asserts it succeeded; returns stdout.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> String {
    let desc = format!("{cmd:?}");
    let out = run(cmd, timeout);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{desc} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

/// Deterministic pseudo-random bytes.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Reads a whole file.
pub fn read_file(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}
