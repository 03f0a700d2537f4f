//! The servers fio drives: `pmcache serve` (this executable) and `nbdkit file`.

use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::process::{
    check_interrupted, log_tail, send_signal, terminate_with_parent, wait_until, was_interrupted,
};
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
            send_signal(child.id(), rustix::process::Signal::TERM);
            if grace.is_zero() {
                std::thread::sleep(Duration::from_millis(100));
                if let Ok(None) = child.try_wait() {
                    send_signal(child.id(), rustix::process::Signal::TERM);
                }
            }
        }
        let grace = grace.max(Duration::from_secs(10));
        let deadline = Instant::now() + grace;
        let mut status = wait_until(&mut child, deadline, true);
        if status.is_none() && was_interrupted() {
            // Interrupted while pmcache writes its cache back: a second SIGTERM stops it at
            // once (nothing acknowledged is lost; the data does not matter here).
            send_signal(child.id(), rustix::process::Signal::TERM);
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
