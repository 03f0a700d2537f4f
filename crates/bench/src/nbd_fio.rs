//! `pmcache bench nbd`: pmcache served over NBD, driven by fio's nbd engine, beside `nbdkit
//! file` serving the same backing file and fio on the raw backing file, in the same run.
//!
//! Each measurement spawns the real server: this executable's `pmcache serve` on a fresh
//! cache medium in `/dev/shm` (emulated PM) in front of a backing file on the root disk,
//! listening on a unix socket. Once its control socket answers, fio runs with
//! `--ioengine=nbd`; the server's statistics are fetched over the control socket, then the
//! server is stopped with SIGTERM and waited for (on a medium in /dev/shm, a volatile one,
//! pmcache writes every dirty block back before it exits, so the disk is quiet when the next
//! measurement starts). The baselines: `nbdkit file` on the same backing file (by default
//! `cache=none fadvise=random`, so its reads reach the disk as pmcache's misses do and the
//! page cache does not absorb its writes), the same fio job; and fio on the raw backing file
//! (`io_uring`, `O_DIRECT`, the same queue depth). The backing file is written in full first
//! (real data: the file system allocates nothing during the measurement), and before each
//! measurement it is synced and dropped from the page cache.
//!
//! Per configuration the table gives the median over `--runs` runs of IOPS, the IOPS ratio to
//! nbdkit (median of the per-run ratios), fio's latency percentiles (`lat`: submission to
//! completion; p50, p99, p99.9, max) and p99.9's ratio to nbdkit's, and the IOPS once as much
//! data as the cache holds has been transferred (for writes: the cache is full from then on):
//! the lowest 1-second window and the mean of the windows from there on, from fio's
//! per-second IOPS log, and that mean's ratio to nbdkit's. Under each pmcache row, the
//! server's statistics of the median run: dirty share at the end, blocks written back (and
//! by the cleaner), writer stalls, inline fallbacks, evictions, read hits.
//!
//! The rest of this module is the harness the NBD experiments share (`paper002` too): tools,
//! scratch space, servers, fio runs.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// Bytes of one request of `bench nbd`.
const BLOCK_BYTES: u64 = 4096;

/// Arguments of `pmcache bench nbd`.
#[derive(clap::Args, Debug, Clone)]
pub struct NbdArgs {
    /// Workloads, comma-separated: randwrite, randread.
    #[arg(long, value_delimiter = ',', default_value = "randwrite,randread")]
    pub rw: Vec<String>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Span of the random offsets, the size of the backing file (e.g. 2G).
    #[arg(long, value_parser = parse_size, default_value = "2G")]
    pub span: u64,
    /// Size of pmcache's cache medium (e.g. 256M).
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    pub cache_size: u64,
    /// Requests in flight (fio iodepth, one connection).
    #[arg(long, default_value_t = 16)]
    pub qd: usize,
    /// Runs per configuration (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// A further pmcache row with these cleaner settings, comma-separated KEY=VALUE as
    /// `pmcache serve --cleaner` takes them (repeatable; e.g. `order=none`: no cleaner, writers
    /// write back inline).
    #[arg(long = "cleaner", value_name = "KEY=VALUE[,KEY=VALUE]")]
    pub cleaner: Vec<String>,
    /// Directory for the backing file: on a disk, not a tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Directory for the cache medium (emulated PM).
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// nbdkit file plugin's page-cache mode: none (reads reach the disk, writes are pushed
    /// out as they come) or default (the page cache absorbs both).
    #[arg(long, default_value = "none")]
    pub nbdkit_cache: String,
    /// Smoke mode: 4 s, span 256 MiB, cache 32 MiB, 1 run.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Keep the backing file and the scratch directory (fio outputs, server logs).
    #[arg(long)]
    pub keep_files: bool,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
    /// The nbdkit binary.
    #[arg(long, default_value = "nbdkit")]
    pub nbdkit: String,
}

// ---------------------------------------------------------------------------------------------
// The harness shared by the NBD experiments.
// ---------------------------------------------------------------------------------------------

/// Parses a size: digits with an optional K, M, G or T suffix (powers of 1024; `iB`/`B` may
/// follow).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim().trim_end_matches("iB").trim_end_matches('B');
    let (digits, shift) = match trimmed.chars().last() {
        Some('K' | 'k') => (&trimmed[..trimmed.len() - 1], 10),
        Some('M' | 'm') => (&trimmed[..trimmed.len() - 1], 20),
        Some('G' | 'g') => (&trimmed[..trimmed.len() - 1], 30),
        Some('T' | 't') => (&trimmed[..trimmed.len() - 1], 40),
        _ => (trimmed, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{text:?} is not a size (examples: 4096, 64M, 2G)"))
}

/// Bytes in binary units.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The median of the values that are not NaN (the mean of the middle two for an even count).
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

/// The index of the median element of `values` (the lower middle for an even count), NaN
/// last.
pub(crate) fn median_index(values: &[f64]) -> Option<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    order.get((values.len().max(1) - 1) / 2).copied()
}

/// Shows what is being measured on stderr: one line rewritten in place on a terminal, a line
/// each otherwise; an empty text clears the terminal's line.
pub(crate) fn progress(text: &str) {
    use std::io::IsTerminal;
    let mut err = std::io::stderr().lock();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K{text}");
    } else if !text.is_empty() {
        let _ = writeln!(err, "{text}");
    }
    let _ = err.flush();
}

/// Formats an optional figure with `precision` decimals, `-` when absent.
pub(crate) fn opt(value: Option<f64>, precision: usize) -> String {
    value.filter(|v| v.is_finite()).map_or_else(|| "-".into(), |v| format!("{v:.precision$}"))
}

/// Runs `program args` and returns its first line of output, or an error naming the
/// package to install.
pub(crate) fn tool_version(program: &str, arg: &str, package: &str) -> Result<String, String> {
    let output = Command::new(program).arg(arg).output().map_err(|e| {
        format!("{program} not found ({e}); install it (apt-get install -y {package})")
    })?;
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().next().unwrap_or("").trim().to_string();
    if !output.status.success() && line.is_empty() {
        return Err(format!("{program} {arg} failed ({})", output.status));
    }
    Ok(line)
}

/// Checks that fio runs and has its nbd engine; returns its version.
pub(crate) fn check_fio(fio: &str) -> Result<String, String> {
    let version = tool_version(fio, "--version", "fio")?;
    let engine = Command::new(fio)
        .arg("--enghelp=nbd")
        .output()
        .map_err(|e| format!("cannot run {fio}: {e}"))?;
    let help = String::from_utf8_lossy(&engine.stdout);
    if !engine.status.success() || !help.contains("uri") {
        return Err(format!(
            "{fio} ({version}) has no nbd engine (`fio --enghelp=nbd` fails): install a fio \
             built with libnbd (Debian/Ubuntu's fio package has it)"
        ));
    }
    Ok(version)
}

/// A description of the machine the figures come from.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Machine {
    pub(crate) kernel: String,
    pub(crate) cpus: usize,
    pub(crate) cpu_model: String,
    pub(crate) fio: String,
    pub(crate) nbdkit: Option<String>,
}

impl Machine {
    pub(crate) fn probe(fio: String, nbdkit: Option<String>) -> Self {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_default();
        Machine {
            kernel,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            fio,
            nbdkit,
        }
    }
}

/// The file system type of the mount holding `dir` (from /proc/mounts).
fn fs_type(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let mut best: Option<(usize, String)> = None;
    for line in mounts.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_), Some(mount), Some(kind)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let mount = mount.replace("\\040", " ");
        if dir.starts_with(&mount) && best.as_ref().is_none_or(|(len, _)| mount.len() >= *len) {
            best = Some((mount.len(), kind.to_string()));
        }
    }
    best.map(|(_, kind)| kind)
}

/// Where an experiment keeps its files: the backing file in a directory on a disk, and a
/// scratch directory under the system's temporary directory (short unix socket paths) for
/// sockets, server logs and fio's outputs. Both are removed when dropped, unless kept.
pub(crate) struct Scratch {
    dir: Option<tempfile::TempDir>,
    /// The backing file.
    pub(crate) backing: PathBuf,
    /// The cache medium's path (in the shm directory).
    pub(crate) medium: PathBuf,
    keep: bool,
}

impl Scratch {
    /// Prepares the paths (creates nothing on disk but the scratch directory).
    pub(crate) fn new(
        disk_dir: &Path,
        shm_dir: &Path,
        label: &str,
        keep: bool,
    ) -> Result<Self, String> {
        for dir in [disk_dir, shm_dir] {
            if !dir.is_dir() {
                return Err(format!("{} is not a directory", dir.display()));
            }
        }
        if let Some(kind) = fs_type(disk_dir).filter(|k| k == "tmpfs" || k == "ramfs") {
            return Err(format!(
                "{} is on a {kind}: the backing file belongs on a disk (give --dir)",
                disk_dir.display()
            ));
        }
        let dir = tempfile::Builder::new()
            .prefix("pmcache-bench-")
            .tempdir()
            .map_err(|e| format!("cannot create a scratch directory: {e}"))?;
        let pid = std::process::id();
        Ok(Scratch {
            dir: Some(dir),
            backing: disk_dir.join(format!("pmcache-bench-{label}-{pid}.img")),
            medium: shm_dir.join(format!("pmcache-bench-{label}-{pid}.pm")),
            keep,
        })
    }

    /// A path in the scratch directory.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.as_ref().expect("scratch directory").path().join(name)
    }

    /// The scratch directory.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.as_ref().expect("scratch directory").path()
    }

    /// Writes the backing file in full with random data and syncs it, reporting on stderr.
    pub(crate) fn prefill(&self, bytes: u64) -> Result<(), String> {
        let started = Instant::now();
        eprintln!(
            "writing the backing file {} ({}) in full ...",
            self.backing.display(),
            human(bytes)
        );
        prefill(&self.backing, bytes).map_err(|e| {
            format!("cannot write the backing file {}: {e}", self.backing.display())
        })?;
        eprintln!("  done in {:.1} s", started.elapsed().as_secs_f64());
        Ok(())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.medium);
        if self.keep {
            if let Some(dir) = self.dir.take() {
                eprintln!(
                    "kept: {} and the scratch directory {}",
                    self.backing.display(),
                    dir.keep().display()
                );
            }
        } else {
            let _ = std::fs::remove_file(&self.backing);
            let _ = std::fs::remove_file(state_file(&self.backing));
        }
    }
}

/// The attachment record `pmcache serve` keeps beside a backing file when its cache medium is
/// volatile.
fn state_file(backing: &Path) -> PathBuf {
    let mut name = backing.as_os_str().to_owned();
    name.push(".pmcache-state");
    PathBuf::from(name)
}

/// Writes `bytes` of random data to `path` (no holes) and syncs it.
fn prefill(path: &Path, bytes: u64) -> std::io::Result<()> {
    let mut file = std::fs::File::create(path)?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut rng = SmallRng::seed_from_u64(0x5eed_0002);
    let mut left = bytes;
    while left > 0 {
        if was_interrupted() {
            return Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "interrupted"));
        }
        rng.fill(&mut chunk[..]);
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()
}

/// Syncs the backing file and drops it from the page cache, so that a measurement starts
/// with nothing of it cached and no dirty pages of the previous one left to write.
pub(crate) fn settle(path: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    file.sync_all().map_err(|e| format!("syncing {}: {e}", path.display()))?;
    // SAFETY: posix_fadvise only reads its arguments; the descriptor is open for the call.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        let e = std::io::Error::from_raw_os_error(rc);
        return Err(format!("dropping {} from the page cache: {e}", path.display()));
    }
    Ok(())
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_interrupt(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM end the experiment at its next step through its error path,
/// which stops the servers and fio and removes the files, instead of ending the process at
/// once. (A terminal's Ctrl-C reaches the servers and fio too: they stop by themselves.)
pub(crate) fn catch_interrupts() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe; the action
    // is zeroed (a valid empty mask and no flags) before its fields are set.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = note_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &action, std::ptr::null_mut());
    }
}

/// Whether SIGINT or SIGTERM arrived (after [`catch_interrupts`]).
pub(crate) fn was_interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// An error once SIGINT or SIGTERM arrived.
pub(crate) fn check_interrupted() -> Result<(), String> {
    if was_interrupted() { Err("interrupted".into()) } else { Ok(()) }
}

/// Sends `signal` to `pid`.
pub(crate) fn send_signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory effects in this process; a stale pid only yields ESRCH.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// Makes a spawned child receive SIGTERM when the thread that spawned it ends (the bench
/// killed, or panicking through a path that skips the server's guard).
fn terminate_with_parent(command: &mut Command) {
    // SAFETY: the closure runs between fork and exec and calls only prctl(2), which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(6)..].join(" | ");
    if tail.is_empty() { "(no output)".into() } else { tail }
}

/// Sends `stats` to a pmcache server's control socket and returns its JSON reply.
pub(crate) fn control_stats(control: &Path) -> Result<serde_json::Value, String> {
    let mut stream = UnixStream::connect(control)
        .map_err(|e| format!("control socket {}: {e}", control.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    stream.write_all(b"stats\n").map_err(|e| format!("control socket: {e}"))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| format!("control socket: {e}"))?;
    if let Some(message) = line.strip_prefix("error ") {
        return Err(format!("control socket: {}", message.trim()));
    }
    serde_json::from_str(line.trim()).map_err(|e| format!("control socket: bad reply ({e})"))
}

/// How to start `pmcache serve` for a measurement.
pub(crate) struct PmcacheServe<'a> {
    /// The cache medium (removed first: every measurement starts with an empty cache).
    pub(crate) medium: &'a Path,
    /// Its size in bytes.
    pub(crate) cache_bytes: u64,
    /// The backing file.
    pub(crate) backing: &'a Path,
    /// The NBD unix socket.
    pub(crate) socket: &'a Path,
    /// The control socket.
    pub(crate) control: &'a Path,
    /// Where the server's stdout and stderr go.
    pub(crate) log: &'a Path,
    /// `--cleaner` settings, `KEY=VALUE` each.
    pub(crate) cleaner: &'a [String],
    /// CPUs to confine the server to (a taskset list such as `0` or `0-1`), with the taskset
    /// binary.
    pub(crate) cpus: Option<(&'a str, &'a str)>,
    /// Most client connections.
    pub(crate) max_connections: usize,
    /// Further `pmcache serve` arguments (e.g. `--mode`, `--tls`).
    pub(crate) extra_args: &'a [String],
}

/// A server process (pmcache or nbdkit) that is stopped, and its files removed, when
/// dropped: no path out of a measurement leaves one running.
pub(crate) struct Server {
    child: Option<Child>,
    what: &'static str,
    log: PathBuf,
    socket: PathBuf,
    control: Option<PathBuf>,
    medium: Option<PathBuf>,
}

impl Server {
    /// Starts `pmcache serve` (this executable) and waits until its control socket answers
    /// (by then its NBD socket listens).
    pub(crate) fn start_pmcache(serve: &PmcacheServe<'_>) -> Result<Server, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find the pmcache executable: {e}"))?;
        // A fresh cache for every measurement, over a backing file whose contents do not
        // matter: no medium left from the previous one, and no attachment record of it
        // beside the backing file (`serve` refuses a backing store a lost volatile cache may
        // have held newer blocks of).
        let _ = std::fs::remove_file(serve.medium);
        let _ = std::fs::remove_file(state_file(serve.backing));
        let mut command = match serve.cpus {
            Some((cpus, taskset)) => {
                let mut c = Command::new(taskset);
                c.arg("-c").arg(cpus).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        command
            .arg("serve")
            .arg("--cache")
            .arg(serve.medium)
            .arg("--cache-size")
            .arg(serve.cache_bytes.to_string())
            .arg("--backing")
            .arg(serve.backing)
            .arg("--socket")
            .arg(serve.socket)
            .arg("--control")
            .arg(serve.control)
            .arg("--max-connections")
            .arg(serve.max_connections.to_string());
        for setting in serve.cleaner {
            command.arg("--cleaner").arg(setting);
        }
        command.args(serve.extra_args);
        let mut server = Server::spawn(command, "pmcache serve", serve.log, serve.socket)?;
        server.control = Some(serve.control.to_path_buf());
        server.medium = Some(serve.medium.to_path_buf());
        let control = serve.control.to_path_buf();
        let socket = serve.socket.to_path_buf();
        server.wait_ready(|| socket.exists() && control_stats(&control).is_ok())?;
        Ok(server)
    }

    /// Starts `nbdkit file` on `backing` and waits until its socket accepts connections.
    pub(crate) fn start_nbdkit(
        nbdkit: &str,
        backing: &Path,
        socket: &Path,
        log: &Path,
        cache_mode: &str,
    ) -> Result<Server, String> {
        let _ = std::fs::remove_file(socket);
        let mut command = Command::new(nbdkit);
        command.arg("--exit-with-parent").arg("-f").arg("-U").arg(socket).arg("file");
        command.arg(format!("file={}", backing.display()));
        if cache_mode == "none" {
            command.arg("cache=none").arg("fadvise=random");
        }
        let mut server = Server::spawn(command, "nbdkit", log, socket)?;
        let socket = socket.to_path_buf();
        server.wait_ready(|| UnixStream::connect(&socket).is_ok())?;
        Ok(server)
    }

    fn spawn(
        mut command: Command,
        what: &'static str,
        log: &Path,
        socket: &Path,
    ) -> Result<Server, String> {
        let out = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        command.stdin(Stdio::null()).stdout(out).stderr(err);
        terminate_with_parent(&mut command);
        let child = command.spawn().map_err(|e| {
            format!("cannot start {what} ({:?}): {e}", command.get_program().to_string_lossy())
        })?;
        Ok(Server {
            child: Some(child),
            what,
            log: log.to_path_buf(),
            socket: socket.to_path_buf(),
            control: None,
            medium: None,
        })
    }

    fn wait_ready(&mut self, mut ready: impl FnMut() -> bool) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let child = self.child.as_mut().expect("a running server");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!(
                    "{} exited ({status}) before it was ready: {}",
                    self.what,
                    log_tail(&self.log)
                ));
            }
            if ready() {
                return Ok(());
            }
            check_interrupted()?;
            if Instant::now() > deadline {
                return Err(format!(
                    "{} was not ready within 60 s: {}",
                    self.what,
                    log_tail(&self.log)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id (a taskset wrapper has exec'd into it).
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The NBD URI of the default export on the server's socket.
    pub(crate) fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    /// pmcache's control socket.
    pub(crate) fn control(&self) -> Option<PathBuf> {
        self.control.clone()
    }

    /// pmcache's statistics (its control socket).
    pub(crate) fn stats(&self) -> Result<serde_json::Value, String> {
        let control = self.control.as_ref().ok_or("this server has no control socket")?;
        control_stats(control)
    }

    /// Stops the server with SIGTERM and waits for it (pmcache on a medium in /dev/shm writes
    /// every dirty block back first) for up to 10 minutes, then kills it; an error if it had
    /// to be killed or pmcache did not exit cleanly.
    pub(crate) fn stop(mut self) -> Result<(), String> {
        self.shutdown(Duration::from_secs(600))
    }

    /// SIGTERM, then after `grace` SIGKILL. With a zero grace (a measurement abandoned), a
    /// second SIGTERM follows at once, which stops pmcache without its final write-back.
    fn shutdown(&mut self, grace: Duration) -> Result<(), String> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        if let Ok(None) = child.try_wait() {
            send_signal(child.id(), libc::SIGTERM);
            if grace.is_zero() {
                std::thread::sleep(Duration::from_millis(100));
                if let Ok(None) = child.try_wait() {
                    send_signal(child.id(), libc::SIGTERM);
                }
            }
        }
        let grace = grace.max(Duration::from_secs(10));
        let deadline = Instant::now() + grace;
        let mut status = wait_until(&mut child, deadline, true);
        if status.is_none() && was_interrupted() {
            // Interrupted while pmcache writes its cache back: a second SIGTERM stops it at
            // once (nothing acknowledged is lost; the data does not matter here).
            send_signal(child.id(), libc::SIGTERM);
            status = wait_until(&mut child, Instant::now() + Duration::from_secs(10), false);
        }
        match status {
            None => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!(
                    "{} did not stop within {} s of SIGTERM; killed",
                    self.what,
                    grace.as_secs()
                ))
            }
            Some(status) if self.control.is_some() && !status.success() => Err(format!(
                "{} exited with {status} at shutdown: {}",
                self.what,
                log_tail(&self.log)
            )),
            Some(_) => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown(Duration::ZERO) {
            eprintln!("warning: {e}");
        }
        let _ = std::fs::remove_file(&self.socket);
        for path in [&self.control, &self.medium].into_iter().flatten() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Waits for `child` until `deadline`; `None` if it still runs.
/// Waits for `child` until `deadline` (or, if `interruptible`, until SIGINT or SIGTERM
/// arrives); `None` if it still runs.
fn wait_until(child: &mut Child, deadline: Instant, interruptible: bool) -> Option<ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if interruptible && was_interrupted() => return None,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) | Err(_) => return None,
        }
    }
}

/// What fio drives.
pub(crate) enum FioTarget {
    /// An NBD export (`--ioengine=nbd --uri=...`), one connection per job.
    Nbd(String),
    /// An NBD export over TLS with X.509: libnbd finds the CA in `home`/.pki/libnbd (fio's
    /// engine cannot pass credentials: libnbd refuses file paths in a URI unless the program
    /// allows them).
    NbdTls {
        /// `nbds://` or `nbds+unix://`.
        uri: String,
        /// fio's `HOME`.
        home: PathBuf,
    },
    /// A file, with `io_uring` and `O_DIRECT`.
    File(PathBuf),
}

/// One fio invocation.
pub(crate) struct FioSpec<'a> {
    pub(crate) fio: &'a str,
    pub(crate) target: FioTarget,
    /// `randwrite` or `randread`.
    pub(crate) rw: &'a str,
    /// Request size in bytes.
    pub(crate) bs: u64,
    /// Requests in flight per job.
    pub(crate) qd: usize,
    /// Jobs (for nbd: connections).
    pub(crate) jobs: usize,
    /// Span of the random offsets, bytes.
    pub(crate) span: u64,
    /// Run time (time-based).
    pub(crate) seconds: f64,
    /// Where fio writes its JSON and logs.
    pub(crate) out_dir: &'a Path,
    /// Keep a per-second IOPS log.
    pub(crate) timeline: bool,
}

/// What fio measured (all jobs together).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FioResult {
    pub(crate) iops: f64,
    pub(crate) bytes_per_s: f64,
    pub(crate) ios: u64,
    pub(crate) runtime_ms: u64,
    pub(crate) lat_ns_mean: f64,
    pub(crate) lat_ns_p50: f64,
    pub(crate) lat_ns_p99: f64,
    pub(crate) lat_ns_p999: f64,
    pub(crate) lat_ns_max: f64,
    /// IOPS of each whole second of the run, all jobs summed (empty without a timeline).
    pub(crate) timeline_iops: Vec<f64>,
}

/// A running fio, killed if dropped before it is waited for.
pub(crate) struct FioRun {
    child: Option<Child>,
    output: PathBuf,
    stderr: PathBuf,
    out_dir: PathBuf,
    log_prefix: String,
    rw: String,
    seconds: f64,
    interrupted: bool,
}

static FIO_RUNS: AtomicU64 = AtomicU64::new(0);

impl FioRun {
    /// Starts fio.
    pub(crate) fn spawn(spec: &FioSpec<'_>) -> Result<FioRun, String> {
        let n = FIO_RUNS.fetch_add(1, Ordering::Relaxed);
        let output = spec.out_dir.join(format!("fio-{n}.json"));
        let stderr = spec.out_dir.join(format!("fio-{n}.stderr"));
        let log_prefix = format!("fio-{n}");
        let runtime_ms = (spec.seconds * 1000.0).round().max(1.0) as u64;
        let mut command = Command::new(spec.fio);
        command
            .arg("--name=pmcache-bench")
            .arg(format!("--rw={}", spec.rw))
            .arg(format!("--bs={}", spec.bs))
            .arg(format!("--iodepth={}", spec.qd))
            .arg(format!("--numjobs={}", spec.jobs))
            .arg(format!("--size={}", spec.span))
            .arg(format!("--runtime={runtime_ms}ms"))
            .args(["--time_based", "--group_reporting", "--norandommap", "--randrepeat=0"])
            .args(["--lat_percentiles=1", "--percentile_list=50:99:99.9"])
            .arg("--output-format=json")
            .arg(format!("--output={}", output.display()));
        match &spec.target {
            FioTarget::Nbd(uri) => {
                command.arg("--ioengine=nbd").arg(format!("--uri={uri}"));
            }
            FioTarget::NbdTls { uri, home } => {
                command.arg("--ioengine=nbd").arg(format!("--uri={uri}")).env("HOME", home);
            }
            FioTarget::File(path) => {
                command
                    .arg("--ioengine=io_uring")
                    .arg("--direct=1")
                    .arg(format!("--filename={}", path.display()));
            }
        }
        if spec.timeline {
            command
                .arg(format!("--write_iops_log={}", spec.out_dir.join(&log_prefix).display()))
                .arg("--log_avg_msec=1000");
        }
        let err = std::fs::File::create(&stderr).map_err(|e| e.to_string())?;
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
        terminate_with_parent(&mut command);
        let child = command.spawn().map_err(|e| format!("cannot run {}: {e}", spec.fio))?;
        Ok(FioRun {
            child: Some(child),
            output,
            stderr,
            out_dir: spec.out_dir.to_path_buf(),
            log_prefix,
            rw: spec.rw.to_string(),
            seconds: spec.seconds,
            interrupted: false,
        })
    }

    /// Runs fio to its end.
    pub(crate) fn run(spec: &FioSpec<'_>) -> Result<FioResult, String> {
        FioRun::spawn(spec)?.wait()
    }

    /// Asks fio to stop now (SIGINT: it ends its jobs and reports what they did).
    pub(crate) fn interrupt(&mut self) {
        if let Some(child) = &self.child {
            self.interrupted = true;
            send_signal(child.id(), libc::SIGINT);
        }
    }

    /// Whether fio still runs.
    pub(crate) fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits for fio and reads its report.
    pub(crate) fn wait(mut self) -> Result<FioResult, String> {
        let mut child = self.child.take().expect("a running fio");
        let deadline = Instant::now() + Duration::from_secs_f64(self.seconds * 2.0 + 120.0);
        let Some(status) = wait_until(&mut child, deadline, true) else {
            let _ = child.kill();
            let _ = child.wait();
            check_interrupted()?;
            return Err("fio did not finish in time; killed".into());
        };
        let stderr = log_tail(&self.stderr);
        let text = std::fs::read_to_string(&self.output).unwrap_or_default();
        // fio may print notes before the JSON document.
        let start = text.find("\n{").map_or(0, |i| i + 1);
        let doc: serde_json::Value = match serde_json::from_str(&text[start..]) {
            Ok(doc) => doc,
            Err(_) => return Err(format!("fio failed ({status}): {stderr}")),
        };
        if !status.success() && !self.interrupted {
            return Err(format!("fio failed ({status}): {stderr}"));
        }
        let job = &doc["jobs"][0];
        let error = job["error"].as_i64().unwrap_or(0);
        if error != 0 {
            let msg = std::io::Error::from_raw_os_error(error as i32);
            return Err(format!("fio: error {error} ({msg}): {stderr}"));
        }
        let side = if self.rw.contains("write") { &job["write"] } else { &job["read"] };
        let lat = &side["lat_ns"];
        let percentile = |key: &str| lat["percentile"][key].as_f64().unwrap_or(f64::NAN);
        let timeline = read_timeline(&self.out_dir, &self.log_prefix);
        Ok(FioResult {
            iops: side["iops"].as_f64().ok_or("fio's report has no iops")?,
            bytes_per_s: side["bw_bytes"].as_f64().unwrap_or(f64::NAN),
            ios: side["total_ios"].as_u64().unwrap_or(0),
            runtime_ms: side["runtime"].as_u64().unwrap_or(0),
            lat_ns_mean: lat["mean"].as_f64().unwrap_or(f64::NAN),
            lat_ns_p50: percentile("50.000000"),
            lat_ns_p99: percentile("99.000000"),
            lat_ns_p999: percentile("99.900000"),
            lat_ns_max: lat["max"].as_f64().unwrap_or(f64::NAN),
            timeline_iops: timeline,
        })
    }
}

impl Drop for FioRun {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sums fio's per-job IOPS logs (`<prefix>_iops.<job>.log`, one line per second:
/// `time_ms, iops, ...`) into one value per second; a second no job logged counts 0.
fn read_timeline(dir: &Path, prefix: &str) -> Vec<f64> {
    let start = format!("{prefix}_iops.");
    let mut seconds: Vec<f64> = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return seconds };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(&start) || !name.ends_with(".log") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            let mut fields = line.split(',').map(str::trim);
            let (Some(Ok(ms)), Some(Ok(iops))) =
                (fields.next().map(str::parse::<u64>), fields.next().map(str::parse::<f64>))
            else {
                continue;
            };
            // A window ends at about `ms`; window k covers second k-1..k.
            let k = ((ms + 500) / 1000) as usize;
            if k == 0 {
                continue;
            }
            if seconds.len() < k {
                seconds.resize(k, 0.0);
            }
            seconds[k - 1] += iops;
        }
    }
    seconds
}

/// IOPS from the second by which as many bytes as the cache holds had been transferred (for
/// writes: the cache is full from then on), and at least 2 s in.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Steady {
    /// The first second counted.
    pub(crate) from_s: usize,
    /// The lowest 1-second window from then on.
    pub(crate) min_iops: f64,
    /// The mean of those windows.
    pub(crate) mean_iops: f64,
}

pub(crate) fn steady(timeline: &[f64], bs: u64, fill_bytes: u64) -> Option<Steady> {
    let mut moved = 0.0;
    let mut from = None;
    for (i, &iops) in timeline.iter().enumerate() {
        moved += iops * bs as f64;
        if moved >= fill_bytes as f64 {
            from = Some(i + 1);
            break;
        }
    }
    let from_s = from?.max(2);
    let windows = timeline.get(from_s..).filter(|w| !w.is_empty())?;
    Some(Steady {
        from_s,
        min_iops: windows.iter().copied().fold(f64::INFINITY, f64::min),
        mean_iops: windows.iter().sum::<f64>() / windows.len() as f64,
    })
}

/// The figures of a pmcache server's statistics the NBD experiments print.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct ServerFigures {
    pub(crate) slot_count: u64,
    pub(crate) dirty_slots: u64,
    pub(crate) dirty_fraction: f64,
    pub(crate) writes: u64,
    pub(crate) read_hits: u64,
    pub(crate) read_misses: u64,
    pub(crate) evictions: u64,
    /// Dirty blocks written back by anyone (the cleaner, or writers inline).
    pub(crate) writebacks: u64,
    pub(crate) blocks_cleaned: u64,
    pub(crate) stalls: u64,
    pub(crate) stall_ns_p99: u64,
    pub(crate) stall_ns_max: u64,
    pub(crate) stall_timeouts: u64,
    pub(crate) inline_write_backs: u64,
    pub(crate) boosts: u64,
    pub(crate) boosted_ns: u64,
    /// Whether the cleaner was boosted when the statistics were taken.
    pub(crate) boosted_now: bool,
    pub(crate) cleaner_order: String,
    pub(crate) cleaner_adaptive: String,
    pub(crate) priority_note: Option<String>,
}

impl ServerFigures {
    /// Reads the figures from the control socket's `stats` reply.
    pub(crate) fn from_stats(stats: &serde_json::Value) -> Self {
        let n = |key: &str| stats[key].as_u64().unwrap_or(0);
        let s = |key: &str| stats[key].as_str().unwrap_or("").to_string();
        let slot_count = n("slot_count");
        ServerFigures {
            slot_count,
            dirty_slots: n("dirty_slots"),
            dirty_fraction: n("dirty_slots") as f64 / slot_count.max(1) as f64,
            writes: n("writes"),
            read_hits: n("read_hits"),
            read_misses: n("read_misses_admitted")
                + n("read_misses_bypassed")
                + n("read_misses_sequential"),
            evictions: n("evictions"),
            writebacks: n("writebacks"),
            blocks_cleaned: n("cleaner_blocks_cleaned"),
            stalls: n("stalls"),
            stall_ns_p99: n("stall_ns_p99"),
            stall_ns_max: n("stall_ns_max"),
            stall_timeouts: n("stall_timeouts"),
            inline_write_backs: n("inline_write_back_fallbacks"),
            boosts: n("cleaner_boosts"),
            boosted_ns: n("cleaner_boosted_ns"),
            boosted_now: stats["cleaner_boosted"].as_bool().unwrap_or(false),
            cleaner_order: s("cleaner_order"),
            cleaner_adaptive: s("cleaner_adaptive"),
            priority_note: stats["cleaner_priority_note"].as_str().map(str::to_string),
        }
    }

    /// The counters' growth from `before` to `self` (the gauges as in `self`).
    pub(crate) fn since(&self, before: &ServerFigures) -> ServerFigures {
        ServerFigures {
            writes: self.writes.saturating_sub(before.writes),
            read_hits: self.read_hits.saturating_sub(before.read_hits),
            read_misses: self.read_misses.saturating_sub(before.read_misses),
            evictions: self.evictions.saturating_sub(before.evictions),
            writebacks: self.writebacks.saturating_sub(before.writebacks),
            blocks_cleaned: self.blocks_cleaned.saturating_sub(before.blocks_cleaned),
            stalls: self.stalls.saturating_sub(before.stalls),
            stall_timeouts: self.stall_timeouts.saturating_sub(before.stall_timeouts),
            inline_write_backs: self.inline_write_backs.saturating_sub(before.inline_write_backs),
            boosts: self.boosts.saturating_sub(before.boosts),
            boosted_ns: self.boosted_ns.saturating_sub(before.boosted_ns),
            ..self.clone()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `pmcache bench nbd`.
// ---------------------------------------------------------------------------------------------

/// The resolved plan of one invocation.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    rw: Vec<String>,
    seconds: f64,
    span_bytes: u64,
    cache_bytes: u64,
    qd: usize,
    runs: usize,
    nbdkit_cache: String,
    configs: Vec<Config>,
}

/// What serves the fio job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Pmcache,
    Nbdkit,
    Raw,
}

#[derive(Debug, Clone, Serialize)]
struct Config {
    label: String,
    kind: Kind,
    /// `--cleaner` settings of a pmcache row.
    cleaner: Vec<String>,
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
struct RunSample {
    run: usize,
    fio: FioResult,
    steady: Option<Steady>,
    server: Option<ServerFigures>,
}

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
struct Row {
    rw: String,
    config: String,
    kind: Kind,
    cleaner: Vec<String>,
    iops: Option<f64>,
    /// Median over runs of iops / nbdkit's iops in the same run.
    ratio_to_nbdkit: Option<f64>,
    /// The per-run ratios the median came from.
    ratio_to_nbdkit_runs: Vec<f64>,
    lat_us_p50: Option<f64>,
    lat_us_p99: Option<f64>,
    lat_us_p999: Option<f64>,
    lat_us_max: Option<f64>,
    /// Median over runs of p99.9 / nbdkit's p99.9 in the same run (below 1: lower).
    p999_ratio_to_nbdkit: Option<f64>,
    /// IOPS once a cache's worth of data has moved: lowest 1-s window and mean (medians).
    steady_min_iops: Option<f64>,
    steady_mean_iops: Option<f64>,
    steady_from_s: Option<usize>,
    /// Median over runs of steady mean / nbdkit's steady mean in the same run.
    steady_ratio_to_nbdkit: Option<f64>,
    /// The server's figures in the run with the median IOPS.
    server: Option<ServerFigures>,
    samples: Vec<RunSample>,
    errors: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    plan: Plan,
    rows: Vec<Row>,
}

fn make_plan(args: &NbdArgs) -> Result<Plan, String> {
    for rw in &args.rw {
        if rw != "randread" && rw != "randwrite" {
            return Err(format!("unknown workload {rw:?}; expected randwrite or randread"));
        }
    }
    if args.qd == 0 || args.runs == 0 || args.seconds <= 0.0 {
        return Err("--qd, --runs and --seconds must be positive".into());
    }
    if args.nbdkit_cache != "none" && args.nbdkit_cache != "default" {
        return Err(format!("--nbdkit-cache {:?}: expected none or default", args.nbdkit_cache));
    }
    let mut configs =
        vec![Config { label: "pmcache".into(), kind: Kind::Pmcache, cleaner: Vec::new() }];
    for settings in &args.cleaner {
        let pairs: Vec<String> = settings
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if pairs.is_empty() || pairs.iter().any(|p| !p.contains('=')) {
            return Err(format!("--cleaner {settings:?}: expected KEY=VALUE[,KEY=VALUE]"));
        }
        configs.push(Config {
            label: format!("pmcache {}", pairs.join(",")),
            kind: Kind::Pmcache,
            cleaner: pairs,
        });
    }
    configs.push(Config { label: "nbdkit file".into(), kind: Kind::Nbdkit, cleaner: Vec::new() });
    configs.push(Config { label: "raw file".into(), kind: Kind::Raw, cleaner: Vec::new() });
    let (seconds, span_bytes, cache_bytes, runs) = if args.quick {
        (4.0, 256 << 20, 32 << 20, 1)
    } else {
        (args.seconds, args.span, args.cache_size, args.runs)
    };
    if !span_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err("--span must be a multiple of 4 KiB".into());
    }
    Ok(Plan {
        rw: args.rw.clone(),
        seconds,
        span_bytes,
        cache_bytes,
        qd: args.qd,
        runs,
        nbdkit_cache: args.nbdkit_cache.clone(),
        configs,
    })
}

/// Runs the experiment and prints the table (or JSON).
pub fn run_cli(args: &NbdArgs) -> Result<(), String> {
    let plan = make_plan(args)?;
    catch_interrupts();
    let fio_version = check_fio(&args.fio)?;
    let nbdkit_version = tool_version(&args.nbdkit, "--version", "nbdkit")?;
    let machine = Machine::probe(fio_version, Some(nbdkit_version));
    let scratch = Scratch::new(&args.dir, &args.shm_dir, "nbd", args.keep_files)?;
    scratch.prefill(plan.span_bytes)?;
    if !args.json {
        print!("{}", header(&machine, &plan));
    }
    let total = plan.rw.len() * plan.runs * plan.configs.len();
    let mut done = 0;
    let mut rows = Vec::new();
    for rw in &plan.rw {
        // samples[config] over runs, each with its run index.
        let mut samples: Vec<Vec<RunSample>> = vec![Vec::new(); plan.configs.len()];
        let mut errors: Vec<Vec<String>> = vec![Vec::new(); plan.configs.len()];
        for run in 0..plan.runs {
            // The order rotates between runs, so that drift in the machine's load does not
            // always hit the same configuration.
            let n = plan.configs.len();
            for i in 0..n {
                let c = (i + run) % n;
                let config = &plan.configs[c];
                done += 1;
                progress(&format!(
                    "[{done}/{total}] {rw} run {}/{} {}",
                    run + 1,
                    plan.runs,
                    config.label
                ));
                check_interrupted()?;
                match measure(args, &plan, &scratch, config, rw) {
                    Ok(mut sample) => {
                        sample.run = run;
                        samples[c].push(sample);
                    }
                    Err(e) => errors[c].push(format!("run {}: {e}", run + 1)),
                }
            }
        }
        progress("");
        let rw_rows = aggregate(&plan, rw, samples, errors);
        if !args.json {
            for row in &rw_rows {
                print!("{}", table_row(row));
            }
            println!();
        }
        rows.extend(rw_rows);
    }
    let report = Report { machine, plan, rows };
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, &json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", summary(&report));
    }
    let failed = report.rows.iter().filter(|r| r.iops.is_none()).count();
    if failed > 0 {
        return Err(format!("{failed} configurations measured nothing (see their errors)"));
    }
    Ok(())
}

fn measure(
    args: &NbdArgs,
    plan: &Plan,
    scratch: &Scratch,
    config: &Config,
    rw: &str,
) -> Result<RunSample, String> {
    settle(&scratch.backing)?;
    let fio = |target| FioSpec {
        fio: &args.fio,
        target,
        rw,
        bs: BLOCK_BYTES,
        qd: plan.qd,
        jobs: 1,
        span: plan.span_bytes,
        seconds: plan.seconds,
        out_dir: scratch.dir(),
        timeline: true,
    };
    let (result, server) = match config.kind {
        Kind::Pmcache => {
            let socket = scratch.path("pmcache.sock");
            let control = scratch.path("pmcache.ctl");
            let log = scratch.path("pmcache-serve.log");
            let server = Server::start_pmcache(&PmcacheServe {
                medium: &scratch.medium,
                cache_bytes: plan.cache_bytes,
                backing: &scratch.backing,
                socket: &socket,
                control: &control,
                log: &log,
                cleaner: &config.cleaner,
                cpus: None,
                max_connections: 16,
                extra_args: &[],
            })?;
            let result = FioRun::run(&fio(FioTarget::Nbd(server.uri())))?;
            let stats = server.stats()?;
            server.stop()?;
            (result, Some(ServerFigures::from_stats(&stats)))
        }
        Kind::Nbdkit => {
            let socket = scratch.path("nbdkit.sock");
            let log = scratch.path("nbdkit.log");
            let server = Server::start_nbdkit(
                &args.nbdkit,
                &scratch.backing,
                &socket,
                &log,
                &plan.nbdkit_cache,
            )?;
            let result = FioRun::run(&fio(FioTarget::Nbd(server.uri())))?;
            server.stop()?;
            (result, None)
        }
        Kind::Raw => (FioRun::run(&fio(FioTarget::File(scratch.backing.clone())))?, None),
    };
    let steady = steady(&result.timeline_iops, BLOCK_BYTES, plan.cache_bytes);
    Ok(RunSample { run: 0, fio: result, steady, server })
}

fn aggregate(
    plan: &Plan,
    rw: &str,
    samples: Vec<Vec<RunSample>>,
    errors: Vec<Vec<String>>,
) -> Vec<Row> {
    let nbdkit = plan.configs.iter().position(|c| c.kind == Kind::Nbdkit);
    let baseline = |run: usize| -> Option<&RunSample> {
        nbdkit.and_then(|b| samples[b].iter().find(|s| s.run == run))
    };
    let mut rows = Vec::new();
    for (c, config) in plan.configs.iter().enumerate() {
        let mine = &samples[c];
        let per_run = |f: &dyn Fn(&RunSample, &RunSample) -> Option<f64>| -> Vec<f64> {
            mine.iter().filter_map(|s| baseline(s.run).and_then(|b| f(s, b))).collect()
        };
        let ratios = per_run(&|s, b| Some(s.fio.iops / b.fio.iops));
        let p999_ratios = per_run(&|s, b| Some(s.fio.lat_ns_p999 / b.fio.lat_ns_p999));
        let steady_ratios = per_run(&|s, b| {
            Some(s.steady?.mean_iops / b.steady?.mean_iops).filter(|r| r.is_finite())
        });
        let us = |f: fn(&FioResult) -> f64| median(mine.iter().map(|s| f(&s.fio) / 1000.0));
        let iops: Vec<f64> = mine.iter().map(|s| s.fio.iops).collect();
        let median_run = median_index(&iops);
        rows.push(Row {
            rw: rw.to_string(),
            config: config.label.clone(),
            kind: config.kind,
            cleaner: config.cleaner.clone(),
            iops: median(iops.iter().copied()),
            ratio_to_nbdkit: median(ratios.iter().copied()),
            ratio_to_nbdkit_runs: ratios,
            lat_us_p50: us(|f| f.lat_ns_p50),
            lat_us_p99: us(|f| f.lat_ns_p99),
            lat_us_p999: us(|f| f.lat_ns_p999),
            lat_us_max: us(|f| f.lat_ns_max),
            p999_ratio_to_nbdkit: median(p999_ratios),
            steady_min_iops: median(mine.iter().filter_map(|s| s.steady.map(|t| t.min_iops))),
            steady_mean_iops: median(mine.iter().filter_map(|s| s.steady.map(|t| t.mean_iops))),
            steady_from_s: median(mine.iter().filter_map(|s| s.steady.map(|t| t.from_s as f64)))
                .map(|s| s.round() as usize),
            steady_ratio_to_nbdkit: median(steady_ratios),
            server: median_run.and_then(|i| mine[i].server.clone()),
            samples: mine.clone(),
            errors: errors[c].clone(),
        });
    }
    rows
}

fn header(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# pmcache bench nbd — kernel {}, {} CPUs ({}), {}, {}",
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.fio,
        m.nbdkit.as_deref().unwrap_or("no nbdkit")
    );
    let _ = writeln!(
        out,
        "# 4 KiB random requests over a {} span, QD{}, one connection; pmcache: a {} cache in \
         /dev/shm; nbdkit file cache={}; raw: fio io_uring O_DIRECT on the backing file; {} s \
         per run, median of {} runs; ×nbdkit: median of per-run ratios; full: IOPS once {} \
         has moved (the lowest 1-s window / the mean)",
        human(plan.span_bytes),
        plan.qd,
        human(plan.cache_bytes),
        plan.nbdkit_cache,
        plan.seconds,
        plan.runs,
        human(plan.cache_bytes)
    );
    let _ = writeln!(
        out,
        "{:<9} {:<28} {:>9} {:>7} {:>8} {:>8} {:>9} {:>9} {:>7} {:>17} {:>7}",
        "rw",
        "config",
        "IOPS",
        "×nbdkit",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "max µs",
        "p99.9×",
        "full min/mean",
        "×nbdkit"
    );
    out
}

fn table_row(r: &Row) -> String {
    let mut out = String::new();
    let full = match (r.steady_min_iops, r.steady_mean_iops) {
        (Some(min), Some(mean)) => format!("{min:.0}/{mean:.0}"),
        _ => "-".into(),
    };
    let _ = writeln!(
        out,
        "{:<9} {:<28} {:>9} {:>7} {:>8} {:>8} {:>9} {:>9} {:>7} {:>17} {:>7}",
        r.rw,
        r.config,
        opt(r.iops, 0),
        opt(r.ratio_to_nbdkit, 2),
        opt(r.lat_us_p50, 1),
        opt(r.lat_us_p99, 1),
        opt(r.lat_us_p999, 1),
        opt(r.lat_us_max, 0),
        opt(r.p999_ratio_to_nbdkit, 2),
        full,
        opt(r.steady_ratio_to_nbdkit, 2)
    );
    if let Some(s) = &r.server {
        let stall = if s.stalls > 0 {
            format!(
                " (p99 {:.2} ms, max {:.2} ms)",
                s.stall_ns_p99 as f64 / 1e6,
                s.stall_ns_max as f64 / 1e6
            )
        } else {
            String::new()
        };
        let reads = s.read_hits + s.read_misses;
        let hits = if reads > 0 {
            format!(", read hits {:.1} %", 100.0 * s.read_hits as f64 / reads as f64)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{:<9} └ cleaner {}/{}: dirty {:.1} % at the end, {} blocks written back ({} by the \
             cleaner), {} stalls{stall}, {} inline fallbacks, {} evictions{hits}",
            "",
            s.cleaner_order,
            s.cleaner_adaptive,
            100.0 * s.dirty_fraction,
            s.writebacks,
            s.blocks_cleaned,
            s.stalls,
            s.inline_write_backs,
            s.evictions
        );
    }
    for e in &r.errors {
        let _ = writeln!(out, "{:<9} └ error: {e}", "");
    }
    out
}

fn summary(report: &Report) -> String {
    let mut out = String::new();
    for r in report.rows.iter().filter(|r| r.kind == Kind::Pmcache && r.cleaner.is_empty()) {
        let goal = if r.rw == "randwrite" { 1.5 } else { 1.0 };
        let lower_tail = if r.rw == "randwrite" {
            match r.p999_ratio_to_nbdkit {
                Some(x) if x < 1.0 => ", p99.9 lower",
                Some(_) => ", p99.9 not lower",
                None => "",
            }
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "# {}: pmcache at {}× nbdkit's IOPS (goal ≥{goal}){lower_tail}",
            r.rw,
            opt(r.ratio_to_nbdkit, 2)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("x").is_err());
    }

    #[test]
    fn steady_starts_once_a_cache_worth_has_moved() {
        // 100 requests of 4 KiB a second; a cache of 1000 requests fills during second 10.
        let timeline = [100.0; 20];
        let s = steady(&timeline, 4096, 1000 * 4096).expect("windows after the fill");
        assert_eq!(s.from_s, 10);
        assert_eq!((s.min_iops, s.mean_iops), (100.0, 100.0));
        assert!(steady(&timeline[..5], 4096, 1000 * 4096).is_none());
    }

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, f64::NAN, 2.0, 3.0]), Some(2.5));
        assert_eq!(median_index(&[5.0, 1.0, 3.0]), Some(2));
        assert_eq!(median_index(&[5.0, 1.0]), Some(1));
    }
}
