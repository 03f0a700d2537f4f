//! Shared helpers: unique temp dirs (the cache medium in /dev/shm, the sparse backing file in
//! the system temp dir), the real `pmcache` binary as a child process that is killed when the
//! test ends (pass or fail), external clients run with a timeout, and the raw NBD client of
//! `pmcache_testkit::nbd`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use pmcache_testkit::{pseudo_random, read_file, require_tool, run, run_ok};

/// Export name `pmcache serve` uses by default.
pub const EXPORT: &str = "pmcache";
/// The binary under test.
pub const PMCACHE: &str = env!("CARGO_BIN_EXE_pmcache");
pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// A directory removed when dropped.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new unique directory under `parent`.
    pub fn new_in(parent: &Path, tag: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").subsec_nanos();
        let name = format!(
            "pmcache-e2e-{tag}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = parent.join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// How the server listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// 127.0.0.1, an ephemeral port (a new one after every restart).
    Tcp,
    /// `--socket` in the temp dir.
    Unix,
}

/// A cache medium in /dev/shm, a sparse backing file, and the control socket path: what a
/// `pmcache serve` runs on, kept across restarts of the server.
pub struct Setup {
    pub shm: TempDir,
    pub disk: TempDir,
    pub cache: PathBuf,
    pub backing: PathBuf,
    pub control: PathBuf,
    pub cache_bytes: u64,
}

impl Setup {
    /// A new setup: the backing file is created sparse; the cache medium does not exist yet.
    pub fn new(tag: &str, backing_bytes: u64, cache_bytes: u64) -> Setup {
        let shm = TempDir::new_in(Path::new("/dev/shm"), tag);
        let disk = TempDir::new_in(&std::env::temp_dir(), tag);
        let backing = disk.path().join("backing.img");
        std::fs::File::create(&backing)
            .and_then(|f| f.set_len(backing_bytes))
            .expect("create sparse backing file");
        Setup {
            cache: shm.path().join("cache.pm"),
            control: shm.path().join("pmcache.ctl"),
            backing,
            shm,
            disk,
            cache_bytes,
        }
    }

    /// `pmcache serve` on this setup with `extra` arguments (e.g. `--mode`), waiting until it
    /// listens.
    pub fn serve(&self, via: Via, extra: &[&str]) -> Server {
        let mut cmd = Command::new(PMCACHE);
        cmd.args(self.serve_args(via, extra));
        Server::spawn(cmd, self.shm.path())
    }

    /// `pmcache serve` on this setup's backing store with the cache medium at `cache` instead
    /// of the setup's (and `extra` arguments), waiting until it listens.
    pub fn serve_with_cache(&self, cache: &Path, via: Via, extra: &[&str]) -> Server {
        let mut args = self.serve_args(via, extra);
        args[2] = cache.into();
        let mut cmd = Command::new(PMCACHE);
        cmd.args(args);
        Server::spawn(cmd, self.shm.path())
    }

    /// `pmcache serve` on this setup with the cache medium at `cache` (and `extra` arguments),
    /// run to completion: a start that is refused.
    pub fn serve_refused(&self, cache: &Path, extra: &[&str]) -> Output {
        let mut args = self.serve_args(Via::Tcp, extra);
        args[2] = cache.into();
        run(Command::new(PMCACHE).args(args), Duration::from_secs(30))
    }

    /// `pmcache serve` on this setup with the backing store at `backing` instead of the
    /// setup's (and `extra` arguments), waiting until it listens.
    pub fn serve_on(&self, backing: &Path, extra: &[&str]) -> Server {
        let mut args = self.serve_args(Via::Tcp, extra);
        args[6] = backing.into();
        let mut cmd = Command::new(PMCACHE);
        cmd.args(args);
        Server::spawn(cmd, self.shm.path())
    }

    /// `pmcache serve` on this setup with the backing store at `backing` (and `extra`
    /// arguments), run to completion: a start that is refused.
    pub fn serve_refused_on(&self, backing: &Path, extra: &[&str]) -> Output {
        let mut args = self.serve_args(Via::Tcp, extra);
        args[6] = backing.into();
        run(Command::new(PMCACHE).args(args), Duration::from_secs(30))
    }

    /// `pmcache serve` over TCP with the psync engine, whose writes to the backing store at or
    /// past `limit_bytes` fail with `EFBIG`: the process's file-size limit (`ulimit -f`), with
    /// SIGXFSZ ignored (a failing backing device, without a device-mapper here).
    pub fn serve_with_writes_failing_past(&self, limit_bytes: u64, extra: &[&str]) -> Server {
        assert!(limit_bytes.is_multiple_of(1024) && limit_bytes > self.cache_bytes);
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(format!("ulimit -f {} && trap '' XFSZ && exec \"$0\" \"$@\"", limit_bytes / 1024))
            .arg(PMCACHE)
            .args(self.serve_args(Via::Tcp, extra))
            .args(["--engine", "psync"]);
        Server::spawn(cmd, self.shm.path())
    }

    fn serve_args(&self, via: Via, extra: &[&str]) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "serve".into(),
            "--cache".into(),
            self.cache.clone().into(),
            "--cache-size".into(),
            self.cache_bytes.to_string().into(),
            "--backing".into(),
            self.backing.clone().into(),
            "--control".into(),
            self.control.clone().into(),
        ];
        args.extend(extra.iter().map(Into::into));
        match via {
            Via::Tcp => args.extend(["--listen".into(), "127.0.0.1:0".into()]),
            Via::Unix => args.extend(["--socket".into(), self.shm.path().join("nbd.sock").into()]),
        }
        args
    }

    /// Runs `pmcache <args>` to completion.
    pub fn pmcache(&self, args: &[&str]) -> Output {
        run(Command::new(PMCACHE).args(args), Duration::from_secs(60))
    }

    /// `--control <path>` for the management commands.
    pub fn control_arg(&self) -> String {
        self.control.display().to_string()
    }

    pub fn cache_arg(&self) -> String {
        self.cache.display().to_string()
    }

    pub fn backing_arg(&self) -> String {
        self.backing.display().to_string()
    }

    /// `pmcache stats --json` of the running server.
    pub fn stats(&self) -> serde_json::Value {
        let out = run_ok(
            Command::new(PMCACHE).args(["stats", "--json", "--control", &self.control_arg()]),
            Duration::from_secs(30),
        );
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("stats --json: {e}: {out}"))
    }
}

/// A running `pmcache serve`, SIGKILLed when dropped unless it already exited.
pub struct Server {
    child: Option<Child>,
    /// The NBD URI the server printed.
    pub uri: String,
    /// The TCP address, when listening on TCP.
    pub tcp: Option<SocketAddr>,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
}

impl Server {
    pub fn spawn(cmd: Command, log_dir: &Path) -> Server {
        Self::spawn_until(cmd, log_dir, "NBD URI:", 1)
    }

    /// Starts the server and waits until it printed `count` lines starting with `marker`
    /// (after leading spaces): "NBD URI:" for an NBD server, its NBD URI then taken from the
    /// line.
    pub fn spawn_until(mut cmd: Command, log_dir: &Path, marker: &str, count: usize) -> Server {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let stdout_path = log_dir.join(format!("serve-{n}.out"));
        let stderr_path = log_dir.join(format!("serve-{n}.err"));
        let out = std::fs::File::create(&stdout_path).expect("stdout log");
        let err = std::fs::File::create(&stderr_path).expect("stderr log");
        let desc = format!("{cmd:?}");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
        let mut server =
            Server { child: Some(child), uri: String::new(), tcp: None, stdout_path, stderr_path };
        // 60 s: an attach to an RBD image whose holder was killed waits for the cluster to
        // notice (osd_client_watch_timeout) before it breaks the lock.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&server.stdout_path).unwrap_or_default();
            let lines: Vec<&str> =
                text.lines().filter(|l| l.trim_start().starts_with(marker)).collect();
            if lines.len() >= count {
                server.uri = lines[0].trim_start().trim_start_matches(marker).trim().to_string();
                break;
            }
            if let Some(status) = server.child_mut().try_wait().expect("try_wait") {
                panic!("{desc} exited with {status} before listening:\n{}", server.logs());
            }
            assert!(Instant::now() < deadline, "{desc} did not start:\n{}", server.logs());
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(rest) = server.uri.strip_prefix("nbd://").filter(|_| marker == "NBD URI:") {
            let hostport = rest.split('/').next().expect("host:port");
            server.tcp = Some(hostport.parse().expect("a TCP address in the URI"));
        }
        server
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("server already reaped")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The TCP address (panics for a unix socket).
    pub fn addr(&self) -> SocketAddr {
        self.tcp.expect("a TCP server")
    }

    /// What the server printed so far (stdout, then stderr).
    pub fn logs(&self) -> String {
        format!(
            "--- stdout\n{}--- stderr\n{}",
            std::fs::read_to_string(&self.stdout_path).unwrap_or_default(),
            std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
        )
    }

    /// SIGKILL, and reap.
    pub fn kill9(mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
    }

    /// Sends `signal` (e.g. "TERM") with kill(1).
    pub fn signal(&self, signal: &str) {
        run_ok(
            Command::new("kill").arg(format!("-{signal}")).arg(self.pid().to_string()),
            Duration::from_secs(10),
        );
    }

    /// Waits for the server to exit by itself; panics (and kills it) after `timeout`.
    pub fn wait(mut self, timeout: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child_mut().try_wait().expect("try_wait") {
                self.child = None;
                return (status, self.logs());
            }
            assert!(Instant::now() < deadline, "server did not exit in {timeout:?}:\n{}", {
                self.logs()
            });
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then waits for a successful exit (clean shutdown).
    pub fn terminate(self) -> String {
        self.signal("TERM");
        let (status, logs) = self.wait(Duration::from_secs(60));
        assert!(status.success(), "pmcache serve exited with {status} on SIGTERM:\n{logs}");
        logs
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A directory on a disk file system (the test target's scratch directory), or `None` if it
/// is on tmpfs or ramfs too.
pub fn disk_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&dir).ok()?;
    let probe = dir.join(format!("pmcache-fs-probe-{}", std::process::id()));
    std::fs::write(&probe, b"x").ok()?;
    let out =
        run(Command::new("stat").args(["-f", "-c", "%T"]).arg(&probe), Duration::from_secs(10));
    let _ = std::fs::remove_file(&probe);
    let fs = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && fs != "tmpfs" && fs != "ramfs").then_some(dir)
}

/// Kilobytes of `pid`'s mappings of `file` that `/proc/<pid>/smaps` reports dirty: pages
/// stored to and not yet written back to the file.
pub fn dirty_kib_mapped(pid: u32, file: &Path) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
    let name = file.display().to_string();
    let mut dirty = 0;
    let mut inside = false;
    let mut found = false;
    for line in smaps.lines() {
        let key = line.split_whitespace().next().unwrap_or("");
        if !key.ends_with(':') {
            inside = line.ends_with(&name);
            found |= inside;
        } else if inside && (key == "Shared_Dirty:" || key == "Private_Dirty:") {
            dirty +=
                line.split_whitespace().nth(1).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    assert!(found, "{name} is not mapped by process {pid}");
    dirty
}

/// Fails unless fio is installed and has its nbd engine.
pub fn require_fio_nbd() {
    require_tool("fio", "fio");
    let engines = run_ok(Command::new("fio").arg("--enghelp"), Duration::from_secs(10));
    assert!(
        engines.lines().any(|l| l.trim() == "nbd"),
        "this fio has no nbd engine (install Debian's `fio` package, built with libnbd)"
    );
}

/// Reads `len` bytes of a file at `offset`.
pub fn read_file_at(p: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    buf
}

/// What a command printed on stderr.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A command that failed, and said `says` on stderr.
pub fn assert_refused(out: &Output, says: &str) {
    let text = stderr(out);
    assert!(!out.status.success(), "accepted: {text}");
    assert!(text.contains(says), "not refused with {says:?}: {text}");
}

/// The raw NBD client of the tests (`pmcache_testkit::nbd`).
pub use pmcache_testkit::nbd::RawNbd as NbdClient;

/// The fio JSON document in `out` (fio may print warnings before it).
pub fn fio_json(out: &str) -> serde_json::Value {
    let start = out.find('{').unwrap_or_else(|| panic!("no fio json in:\n{out}"));
    serde_json::from_str(&out[start..]).unwrap_or_else(|e| panic!("fio json: {e}:\n{out}"))
}
