//! The servers fio drives: pmcache, served in this process through the serving library
//! (`pmcache_serve`, what `pmcache serve` runs), and `nbdkit`.

use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pmcache_backing::wrappers::LatencyDist;
use pmcache_engine::CacheMode;
use pmcache_nbd::{ListenAddr, ServerConfig, TlsConfig, TlsMode};
use pmcache_serve::{Announce, CacheConfig, ServeConfig, StopHandle};
use serde::Serialize;

use super::process::{check_interrupted, log_tail, send_signal, terminate_with_parent, wait_until};
use super::scratch::state_file;

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

/// How to serve pmcache for a measurement.
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
    /// Where the server's notes go (formatted, written back, marked clean).
    pub(crate) log: &'a Path,
    /// The cleaner's settings, `KEY=VALUE` each (as `serve --cleaner`).
    pub(crate) cleaner: &'a [String],
    /// CPUs to confine the server's threads to (a list such as `0`, `0-1` or `0,2`).
    pub(crate) cpus: Option<&'a str>,
    /// Most client connections.
    pub(crate) max_connections: usize,
    /// The cache mode, the backing store's added latency, TLS.
    pub(crate) options: ServeOptions<'a>,
}

/// What a measurement changes of `pmcache serve`'s defaults.
#[derive(Clone, Copy, Default)]
pub(crate) struct ServeOptions<'a> {
    /// `--mode` (write-back when `None`).
    pub(crate) mode: Option<CacheMode>,
    /// `--backing-latency`.
    pub(crate) backing_latency: Option<LatencyDist>,
    /// `--tls=on --tls-certificates DIR`.
    pub(crate) tls_certificates: Option<&'a Path>,
    /// A CPU of the cleaner's own, outside the server's other threads' (`cpus`).
    pub(crate) cleaner_cpu: Option<usize>,
}

/// A pmcache server's notes, into its log file.
struct LogNotes(Mutex<std::fs::File>);

impl Announce for LogNotes {
    fn note(&self, line: &str) {
        let mut file = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = writeln!(file, "pmcache: {line}");
    }

    fn progress_bar(&self) -> bool {
        false
    }
}

/// The CPUs of a list such as `0`, `0-1` or `0,2-3`.
fn cpu_set(list: &str) -> Result<rustix::thread::CpuSet, String> {
    let mut set = rustix::thread::CpuSet::new();
    let bad = || format!("{list:?} is not a list of CPUs (such as 0, 0-1 or 0,2-3)");
    for part in list.split(',') {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        let (first, last): (usize, usize) =
            (first.trim().parse().map_err(|_| bad())?, last.trim().parse().map_err(|_| bad())?);
        if first > last || last >= rustix::thread::CpuSet::MAX_CPU {
            return Err(bad());
        }
        (first..=last).for_each(|cpu| set.set(cpu));
    }
    Ok(set)
}

/// Moves this process's thread named `name` to CPU `cpu` alone.
fn pin_thread(name: &str, cpu: usize) -> Result<(), String> {
    let tasks =
        std::fs::read_dir("/proc/self/task").map_err(|e| format!("/proc/self/task: {e}"))?;
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let tid = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok());
        let pid = tid.and_then(rustix::process::Pid::from_raw).ok_or("a task id")?;
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        return rustix::thread::sched_setaffinity(Some(pid), &set)
            .map_err(|e| format!("moving {name} to CPU {cpu}: {e}"));
    }
    Err(format!("no thread named {name} in this process"))
}

/// Where a server runs: a child process (nbdkit), or pmcache on a thread of this process.
enum Running {
    Child(Child),
    Thread { thread: JoinHandle<Result<(), String>>, stop: StopHandle },
}

/// A server process (pmcache or nbdkit) that is stopped, and its files removed, when
/// dropped: no path out of a measurement leaves one running.
pub(crate) struct Server {
    running: Option<Running>,
    what: &'static str,
    log: PathBuf,
    socket: PathBuf,
    control: Option<PathBuf>,
    medium: Option<PathBuf>,
}

impl Server {
    /// Serves pmcache on a thread of this process through the serving library, as `pmcache
    /// serve` would with these settings, and waits until its control socket answers (by then
    /// its NBD socket listens). Its threads (the cleaner's, the connections') are confined to
    /// `serve.cpus` when given.
    pub(crate) fn start_pmcache(serve: &PmcacheServe<'_>) -> Result<Server, String> {
        // A fresh cache for every measurement, over a backing file whose contents do not
        // matter: no medium left from the previous one, and no attachment record of it
        // beside the backing file (`serve` refuses a backing store a lost volatile cache may
        // have held newer blocks of).
        let _ = std::fs::remove_file(serve.medium);
        let _ = std::fs::remove_file(state_file(serve.backing));
        let _ = std::fs::remove_file(serve.socket);
        let mut cache = CacheConfig::new(serve.medium, serve.backing);
        cache.cache_size = Some(serve.cache_bytes);
        cache.mode = serve.options.mode.unwrap_or(CacheMode::WriteBack);
        cache.backing_latency = serve.options.backing_latency;
        let mut config = ServeConfig::new(cache);
        config.control = Some(serve.control.to_path_buf());
        config
            .cleaner
            .set_all(serve.cleaner.iter().map(String::as_str))
            .map_err(|e| format!("cleaner: {e}"))?;
        let tls = match serve.options.tls_certificates {
            Some(dir) => TlsConfig {
                mode: TlsMode::On,
                certificates_dir: Some(dir.to_path_buf()),
                ..TlsConfig::default()
            },
            None => TlsConfig::default(),
        };
        let nbd = ServerConfig {
            listen: ListenAddr::Unix(serve.socket.to_path_buf()),
            max_connections: serve.max_connections,
            tls,
            ..ServerConfig::default()
        };
        let cpus = serve.cpus.map(cpu_set).transpose()?;
        let log = std::fs::File::create(serve.log)
            .map_err(|e| format!("{}: {e}", serve.log.display()))?;
        let notes: Arc<dyn Announce> = Arc::new(LogNotes(Mutex::new(log)));
        let stop = config.stop.clone();
        let thread = std::thread::Builder::new()
            .name("pmcache-serve".into())
            .spawn(move || {
                // Every thread the server starts inherits this one's CPUs.
                if let Some(cpus) = &cpus {
                    rustix::thread::sched_setaffinity(None, cpus)
                        .map_err(|e| format!("confining the server to its CPUs: {e}"))?;
                }
                pmcache_serve::nbd::serve(&config, nbd, notes)
            })
            .map_err(|e| format!("starting the server's thread: {e}"))?;
        let mut server = Server {
            running: Some(Running::Thread { thread, stop }),
            what: "pmcache",
            log: serve.log.to_path_buf(),
            socket: serve.socket.to_path_buf(),
            control: Some(serve.control.to_path_buf()),
            medium: Some(serve.medium.to_path_buf()),
        };
        let control = serve.control.to_path_buf();
        let socket = serve.socket.to_path_buf();
        server.wait_ready(|| socket.exists() && control_stats(&control).is_ok())?;
        if let Some(cpu) = serve.options.cleaner_cpu {
            pin_thread("pmcache-cleaner", cpu)?;
        }
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
        let mut plugin = vec!["file".to_string(), format!("file={}", backing.display())];
        if cache_mode == "none" {
            plugin.extend(["cache=none".into(), "fadvise=random".into()]);
        }
        Server::start_nbdkit_plugin(nbdkit, "nbdkit", &plugin, socket, log)
    }

    /// Starts `nbdkit memory` (a sparse RAM disk of `size_bytes`) and waits until its socket
    /// accepts connections: the NBD frontend's ceiling, with no storage work behind it.
    pub(crate) fn start_nbdkit_memory(
        nbdkit: &str,
        size_bytes: u64,
        socket: &Path,
        log: &Path,
    ) -> Result<Server, String> {
        let plugin = ["memory".to_string(), format!("size={size_bytes}")];
        Server::start_nbdkit_plugin(nbdkit, "nbdkit memory", &plugin, socket, log)
    }

    /// Starts nbdkit with `plugin` (its name and parameters) on a unix socket and waits until
    /// the socket accepts connections.
    fn start_nbdkit_plugin(
        nbdkit: &str,
        what: &'static str,
        plugin: &[String],
        socket: &Path,
        log: &Path,
    ) -> Result<Server, String> {
        let _ = std::fs::remove_file(socket);
        let mut command = Command::new(nbdkit);
        command.arg("--exit-with-parent").arg("-f").arg("-U").arg(socket).args(plugin);
        let mut server = Server::spawn(command, what, log, socket)?;
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
            running: Some(Running::Child(child)),
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
            match self.running.as_mut().expect("a running server") {
                Running::Child(child) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        self.running = None;
                        return Err(format!(
                            "{} exited ({status}) before it was ready: {}",
                            self.what,
                            log_tail(&self.log)
                        ));
                    }
                }
                Running::Thread { thread, .. } if thread.is_finished() => {
                    let Some(Running::Thread { thread, .. }) = self.running.take() else {
                        unreachable!("matched a thread")
                    };
                    let why = match thread.join() {
                        Ok(Err(e)) => e,
                        Ok(Ok(())) => "it stopped".into(),
                        Err(_) => "its thread panicked".into(),
                    };
                    return Err(format!(
                        "{} ended before it was ready: {why}; {}",
                        self.what,
                        log_tail(&self.log)
                    ));
                }
                Running::Thread { .. } => {}
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

    /// The server's process id: this process's for pmcache.
    pub(crate) fn pid(&self) -> u32 {
        match &self.running {
            Some(Running::Child(child)) => child.id(),
            Some(Running::Thread { .. }) => std::process::id(),
            None => 0,
        }
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

    /// Stops the server and waits for it (pmcache on a medium in /dev/shm writes every dirty
    /// block back first) for up to 10 minutes; an error if it did not stop cleanly.
    pub(crate) fn stop(mut self) -> Result<(), String> {
        self.shutdown(Duration::from_secs(600))
    }

    /// Stops the server: pmcache through its stop handle, waited for; nbdkit with SIGTERM,
    /// then after `grace` SIGKILL.
    fn shutdown(&mut self, grace: Duration) -> Result<(), String> {
        match self.running.take() {
            None => Ok(()),
            Some(Running::Thread { thread, stop }) => {
                stop.stop();
                match thread.join() {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(format!("{} did not stop cleanly: {e}", self.what)),
                    Err(_) => Err(format!("{}'s thread panicked", self.what)),
                }
            }
            Some(Running::Child(child)) => self.shutdown_child(child, grace),
        }
    }

    /// SIGTERM, then after `grace` SIGKILL.
    fn shutdown_child(&mut self, mut child: Child, grace: Duration) -> Result<(), String> {
        if let Ok(None) = child.try_wait() {
            send_signal(child.id(), rustix::process::Signal::TERM);
        }
        let grace = grace.max(Duration::from_secs(10));
        let deadline = Instant::now() + grace;
        match wait_until(&mut child, deadline, true) {
            None => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!(
                    "{} did not stop within {} s of SIGTERM; killed",
                    self.what,
                    grace.as_secs()
                ))
            }
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

/// The figures of a pmcache server's statistics the NBD experiments print.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerFigures {
    /// Slots of the cache.
    pub slot_count: u64,
    /// Dirty slots when the statistics were taken.
    pub dirty_slots: u64,
    /// Dirty slots over all slots.
    pub dirty_fraction: f64,
    /// Blocks written.
    pub writes: u64,
    /// Reads served from the cache.
    pub read_hits: u64,
    /// Reads that missed (admitted, bypassed or sequential).
    pub read_misses: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Dirty blocks written back by anyone (the cleaner, or writers inline).
    pub writebacks: u64,
    /// Dirty blocks the cleaner wrote back.
    pub blocks_cleaned: u64,
    /// Writers that waited for a free slot.
    pub stalls: u64,
    /// 99th percentile of a stall, nanoseconds.
    pub stall_ns_p99: u64,
    /// Longest stall, nanoseconds.
    pub stall_ns_max: u64,
    /// Stalls that gave up waiting.
    pub stall_timeouts: u64,
    /// Writes paced to the cleaner's rate that waited for their turn.
    pub throttled_writes: u64,
    /// Writes that wrote a dirty block back inline.
    pub inline_write_backs: u64,
    /// Times the cleaner was boosted.
    pub boosts: u64,
    /// Time the cleaner spent boosted (boosts that ended), nanoseconds.
    pub boosted_ns: u64,
    /// Whether the cleaner was boosted when the statistics were taken.
    pub boosted_now: bool,
    /// The order the cleaner writes back in.
    pub cleaner_order: String,
    /// The cleaner's adaptive mode.
    pub cleaner_adaptive: String,
    /// Why the server could not change the cleaner's priority, if it could not.
    pub priority_note: Option<String>,
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
            throttled_writes: n("throttled_writes"),
            inline_write_backs: n("inline_write_back_fallbacks"),
            boosts: n("cleaner_boosts"),
            boosted_ns: n("cleaner_boosted_ns"),
            boosted_now: stats["cleaner_boosted"].as_bool().unwrap_or(false),
            cleaner_order: s("cleaner_order"),
            cleaner_adaptive: s("cleaner_adaptive"),
            priority_note: stats["cleaner_priority_note"].as_str().map(str::to_string),
        }
    }

    /// Writes that could not take a slot at once, what paper 002 calls failed insertions:
    /// the stalls (no free or clean slot: the writer waited for the cleaner) and the paced
    /// writes that waited for their turn.
    pub fn failed_insertions(&self) -> u64 {
        self.stalls + self.throttled_writes
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
            throttled_writes: self.throttled_writes.saturating_sub(before.throttled_writes),
            inline_write_backs: self.inline_write_backs.saturating_sub(before.inline_write_backs),
            boosts: self.boosts.saturating_sub(before.boosts),
            boosted_ns: self.boosted_ns.saturating_sub(before.boosted_ns),
            ..self.clone()
        }
    }
}
