//! The control socket of a running server: a unix socket speaking one command per connection,
//! one line each way (`stats` → a JSON object; `flush` → write back every dirty block, through
//! the cleaner when one runs, answered by `progress <dirty> <total>` lines then `done <total>`;
//! `detach` → write everything back, drop the cache's copies, stop serving, mark the cache
//! clean; `set KEY=VALUE ...` → change the cache mode (`mode=`: leaving write-back writes every
//! dirty block back first, answered by `progress` lines; the state record of a volatile
//! medium follows every change: `crate::attachment`), the admission policy (`admission=`) or
//! cleaner settings, answered by `setting KEY VALUE` lines, all of them, then `done`; `set`
//! alone lists them). A `warning TEXT` line says what did not stop the command but should be
//! known.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use pmcache_engine::{AdmissionConfig, CacheMode, Error};
use pmcache_frontend::{CacheEngine, ReadLatencies};

use crate::attachment::Attachment;
use crate::open::{admission_name, parse_admission};

/// The control socket path of a cache.
pub fn default_control_path(cache: &Path) -> PathBuf {
    let mut name = cache.as_os_str().to_owned();
    name.push(".ctl");
    PathBuf::from(name)
}

/// What the control socket and the signals stop: the running frontend (the NBD server, the
/// ublk device), or a program that serves the engine's lanes itself
/// ([`crate::Serving::start_control`]).
pub trait Frontend: Clone + Send + 'static {
    /// Stops serving (a `pmcache detach`, SIGINT or SIGTERM, a [`crate::StopHandle`]):
    /// requests in flight finish, then whoever serves the cache finishes it
    /// ([`crate::Serving::finish`]). A program serving lanes itself learns of it here.
    fn stop(&self);

    /// The frontend's own counters for `pmcache stats`.
    fn stats(&self) -> Vec<(&'static str, u64)>;
}

/// Binds the control socket, replacing a stale one (no server answering on it). Anything at
/// the path that is not a socket (a mistyped `--control` naming the medium, or any file) is
/// refused and left alone.
pub fn bind(path: &Path) -> Result<UnixListener, String> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(format!(
                "control socket {} exists and is not a socket; refusing to replace it (choose \
                 another --control path)",
                path.display()
            ));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(format!(
                "{} is in use: another pmcache server runs on this cache",
                path.display()
            ));
        }
        std::fs::remove_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    UnixListener::bind(path).map_err(|e| format!("control socket {}: {e}", path.display()))
}

/// The engine's statistics as a JSON object.
pub fn stats_json(engine: &CacheEngine, latencies: &ReadLatencies) -> serde_json::Value {
    let stats = engine.stats();
    let mut object = serde_json::Map::new();
    for (name, value) in stats.counters() {
        object.insert(name.to_string(), value.into());
    }
    object.insert("block_size".into(), stats.block_size.into());
    object.insert("dram_bytes_per_slot".into(), stats.dram_bytes_per_slot.into());
    object.insert("mode".into(), engine.mode().to_string().into());
    object.insert(
        "mode_changed_unix_secs".into(),
        MODE_CHANGED_UNIX_SECS.load(Ordering::SeqCst).into(),
    );
    object.insert("admission".into(), admission_name(engine.admission()).into());
    object.insert("data_crc".into(), engine.layout().data_crc().into());
    object.insert("medium".into(), crate::open::kind_of(engine.medium()).name().into());
    object.insert("size_bytes".into(), engine.size_bytes().into());
    object.insert("backing_engine".into(), engine.backing().engine_name().into());
    object.insert("backing_state".into(), stats.backing.state.name().into());
    object.insert(
        "backing_failing".into(),
        stats.backing.failing.iter().map(|op| op.name()).collect::<Vec<_>>().into(),
    );
    object.insert("backing_last_error".into(), stats.backing.last_error.clone().into());
    object.insert("backing_failing_ms".into(), stats.backing.failing_ms.into());
    let members: Vec<serde_json::Value> = engine
        .member_stats()
        .iter()
        .map(|m| {
            serde_json::json!({
                "member": m.index,
                "node": m.node,
                "slots": m.slots,
                "dirty": m.dirty,
                "free": m.free,
                "reads_local": m.reads_local,
                "reads_remote": m.reads_remote,
                "writes_local": m.writes_local,
                "writes_remote": m.writes_remote,
            })
        })
        .collect();
    object.insert("members".into(), members.into());
    for (name, value) in latencies.stats() {
        object.insert(name, value.into());
    }
    let c = &stats.cleaner;
    let cleaner = [
        ("cleaner_running", serde_json::Value::from(c.running)),
        ("cleaner_order", c.order.into()),
        ("cleaner_adaptive", c.adaptive.into()),
        ("cleaner_phase", c.phase.into()),
        ("cleaner_target_blocks", c.target_blocks.into()),
        ("cleaner_low_blocks", c.low_blocks.into()),
        ("cleaner_high_blocks", c.high_blocks.into()),
        ("cleaner_rate_blocks_per_s", c.rate.rate.into()),
        ("cleaner_rate_error_blocks", c.rate.error_blocks.into()),
        ("cleaner_rate_proportional", c.rate.proportional.into()),
        ("cleaner_rate_integral", c.rate.integral.into()),
        ("cleaner_rate_derivative", c.rate.derivative.into()),
        ("cleaner_batches", c.batches.into()),
        ("cleaner_blocks_cleaned", c.blocks_cleaned.into()),
        ("cleaner_writes_issued", c.writes_issued.into()),
        ("cleaner_blocks_superseded", c.blocks_superseded.into()),
        ("cleaner_blocks_evicted_for_writers", c.blocks_evicted_for_writers.into()),
        ("cleaner_errors", c.errors.into()),
        ("cleaner_boosts", c.boosts.into()),
        ("cleaner_boosted_ns", c.boosted_ns.into()),
        ("cleaner_boosted", c.boosted.into()),
        ("stalls", c.stalls.into()),
        ("stall_ns_total", c.stall_ns_total.into()),
        ("stall_ns_p50", c.stall_ns_quantile(0.5).into()),
        ("stall_ns_p99", c.stall_ns_quantile(0.99).into()),
        ("stall_ns_max", c.stall_ns_max.into()),
        ("stall_timeouts", c.stall_timeouts.into()),
        ("inline_write_back_fallbacks", c.inline_fallbacks.into()),
        ("pace_blocks_per_s", c.pace_blocks_per_s.into()),
        ("throttled_writes", c.throttled_writes.into()),
        ("throttle_ns_total", c.throttle_ns_total.into()),
    ];
    for (name, value) in cleaner {
        object.insert(name.into(), value);
    }
    if let Some(note) = &c.priority_note {
        object.insert("cleaner_priority_note".into(), note.clone().into());
    }
    serde_json::Value::Object(object)
}

/// What the control socket's `stats` answers: the engine's statistics ([`stats_json`]) and
/// `frontend`'s own counters.
pub fn served_stats_json(
    engine: &CacheEngine,
    latencies: &ReadLatencies,
    frontend: &impl Frontend,
) -> serde_json::Value {
    let mut stats = stats_json(engine, latencies);
    if let Some(object) = stats.as_object_mut() {
        for (name, value) in frontend.stats() {
            object.insert(name.into(), value.into());
        }
    }
    stats
}

/// What the control socket serves: the engine, its frontend, the state record it keeps in
/// step with the mode, and the flag a `detach` sets.
pub(crate) struct Served<F> {
    pub(crate) engine: Arc<CacheEngine>,
    pub(crate) latencies: Arc<ReadLatencies>,
    pub(crate) frontend: F,
    pub(crate) attachment: Arc<Attachment>,
    pub(crate) detach: Arc<AtomicBool>,
    /// Set when the server has stopped: the next connection (the server's own, to wake this
    /// thread) ends the serving.
    pub(crate) closing: Arc<AtomicBool>,
}

/// Serves control connections until the server closes it (`Served::closing`), and returns
/// the listener, still bound: until the server removes the socket, a client's connection is
/// taken (and left unanswered), so an online `detach` polling it never mistakes the moments
/// between this thread's end and the socket's removal for a server that died.
pub(crate) fn serve(listener: UnixListener, served: Served<impl Frontend>) -> UnixListener {
    for stream in listener.incoming() {
        if served.closing.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        if let Err(e) = handle(stream, &served) {
            eprintln!("pmcache: control connection: {e}");
        }
    }
    listener
}

fn handle(stream: UnixStream, served: &Served<impl Frontend>) -> std::io::Result<()> {
    let Served { engine, latencies, frontend, attachment, detach, .. } = served;
    let engine = &**engine;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut command = String::new();
    reader.read_line(&mut command)?;
    match command.trim() {
        // A connection closed without a command: a liveness probe (`detach` waiting).
        "" => {}
        "stats" => writeln!(writer, "{}", served_stats_json(engine, latencies, frontend))?,
        "flush" => {
            let total = engine.dirty_slots();
            match flush(engine, |dirty| {
                let _ = writeln!(writer, "progress {dirty} {total}");
            }) {
                Ok(()) => {
                    if let Err(e) = record_if_written_back(engine, attachment) {
                        writeln!(writer, "warning {e}")?;
                    }
                    writeln!(writer, "done {total}")?
                }
                Err(e) => writeln!(writer, "error {e}")?,
            }
        }
        set if set == "set" || set.starts_with("set ") => {
            let (serving, cleaner): (Vec<&str>, Vec<&str>) = set
                .split_whitespace()
                .skip(1)
                .partition(|p| p.starts_with("mode=") || p.starts_with("admission="));
            let mut changes = ServingChanges::default();
            for pair in serving {
                if let Err(e) = changes.parse(pair) {
                    return writeln!(writer, "error {e}");
                }
            }
            let config = match engine.set_cleaner_settings(cleaner) {
                Ok(config) => config,
                Err(e) => return writeln!(writer, "error {e}"),
            };
            if let Some(admission) = changes.admission {
                engine.set_admission(admission);
            }
            if let Some(mode) = changes.mode {
                let switched = switch_mode(engine, attachment, mode, |dirty, total| {
                    let _ = writeln!(writer, "progress {dirty} {total}");
                });
                if let Err(e) = switched {
                    return writeln!(writer, "error {e}");
                }
                if let Err(e) = record_if_written_back(engine, attachment) {
                    writeln!(writer, "warning {e}")?;
                }
            }
            writeln!(writer, "setting mode {}", engine.mode())?;
            writeln!(writer, "setting admission {}", admission_name(engine.admission()))?;
            for (key, value) in config.describe() {
                writeln!(writer, "setting {key} {value}")?;
            }
            writeln!(writer, "done")?;
        }
        "detach" => {
            detach.store(true, Ordering::SeqCst);
            frontend.stop();
            writeln!(writer, "detaching")?;
        }
        other => writeln!(
            writer,
            "error unknown command {other:?}; expected stats, flush, set or detach"
        )?,
    }
    Ok(())
}

/// The settings of a `set` that the server applies itself (the rest are the cleaner's).
#[derive(Default)]
struct ServingChanges {
    mode: Option<CacheMode>,
    admission: Option<AdmissionConfig>,
}

impl ServingChanges {
    fn parse(&mut self, pair: &str) -> Result<(), String> {
        match pair.split_once('=') {
            Some(("mode", value)) => {
                // `write-back` as Open CAS and bcache operators write it, or `writeback`.
                self.mode = Some(value.replace('-', "").parse()?);
            }
            Some(("admission", value)) => self.admission = Some(parse_admission(value)?),
            _ => return Err(format!("{pair:?} is not a setting")),
        }
        Ok(())
    }
}

/// When the cache mode last changed at run time, in seconds since the Unix epoch (0: never
/// since the server started).
static MODE_CHANGED_UNIX_SECS: AtomicU64 = AtomicU64::new(0);

/// Switches the cache mode of a running server. Entering a mode that keeps dirty blocks
/// (write-back, write-only) is recorded first (`Attachment::before_dirtying`: a volatile
/// medium's state record says the backing store may be stale before the switch takes
/// effect), and refused, the mode unchanged, if it cannot be. Leaving such a mode for one
/// that does not writes every dirty block back first, with `progress(dirty, total)` every
/// 100 ms: while still in the old mode, then once more after the switch for what was written
/// meanwhile. If either write-back fails, the old mode stays (nothing is lost: the dirty
/// blocks stay in the cache) and the error says so.
fn switch_mode(
    engine: &CacheEngine,
    attachment: &Attachment,
    to: CacheMode,
    mut progress: impl FnMut(u64, u64),
) -> Result<(), String> {
    let from = engine.mode();
    if from == to {
        return Ok(());
    }
    if to.writes_back() {
        attachment
            .before_dirtying(|| engine.set_mode(to))
            .map_err(|e| format!("{from} -> {to} refused: {e}; the cache stays {from}"))?;
    } else if from.writes_back() {
        let total = engine.dirty_slots();
        let refused = |e: String| {
            format!(
                "{from} -> {to} refused: writing the dirty blocks back failed ({e}); the cache \
                 stays {from}, with its dirty blocks (nothing acknowledged is lost)"
            )
        };
        flush(engine, |dirty| progress(dirty, total)).map_err(refused)?;
        engine.set_mode(to);
        if let Err(e) = flush(engine, |dirty| progress(dirty, total)) {
            // Back to a mode that dirties blocks without a new record: the record has said
            // the backing store may be stale since `from` was entered, and is recorded
            // complete only after a switch out of it succeeds.
            engine.set_mode(from);
            return Err(refused(e));
        }
    } else {
        engine.set_mode(to);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    MODE_CHANGED_UNIX_SECS.store(now, Ordering::SeqCst);
    Ok(())
}

/// Records the backing store complete in the state record of a volatile medium when the cache
/// is in a mode that makes no dirty block and holds none (every slot's state read: after a
/// switch out of write-back, or a flush). An error is the record's: the cache is as it was,
/// and the record still says the backing store may be stale, which is safe.
fn record_if_written_back(engine: &CacheEngine, attachment: &Attachment) -> Result<bool, String> {
    attachment
        .backing_complete(|| {
            !engine.mode().writes_back()
                && engine.member_stats().iter().map(|member| member.dirty).sum::<u64>() == 0
        })
        .map_err(|e| {
            format!(
                "every block is written back, but recording it failed ({e}): the state record \
                 still says the backing store may lack blocks, so a start after the medium is \
                 lost is refused until --accept-stale-backing"
            )
        })
}

/// Writes every dirty block back, calling `progress` with the dirty count every 100 ms: through
/// the running cleaner (its thread and queue, at full speed: `Engine::request_drain`), or, when
/// none takes requests (`order=none`, or stopped), through a lane of this thread's own.
fn flush(engine: &CacheEngine, mut progress: impl FnMut(u64)) -> Result<(), String> {
    const TICK: Duration = Duration::from_millis(100);
    if let Some(ticket) = engine.request_drain() {
        loop {
            match engine.drain_outcome(ticket, TICK) {
                None => progress(engine.dirty_slots()),
                Some(Ok(_)) => return Ok(()),
                Some(Err(Error::ShutDown)) => {
                    return Err("the server began to stop before the flush was done".into());
                }
                Some(Err(e)) => return Err(e.to_string()),
            }
        }
    }
    std::thread::scope(|scope| {
        let drain = scope.spawn(|| engine.lane().and_then(|mut lane| lane.drain()));
        while !drain.is_finished() {
            progress(engine.dirty_slots());
            std::thread::sleep(TICK);
        }
        drain.join().expect("drain thread panicked")
    })
    .map_err(|e| e.to_string())
}

/// Sends one command to a running server and returns its reply lines through `on_line`.
pub fn request(path: &Path, command: &str, mut on_line: impl FnMut(&str)) -> Result<(), String> {
    let stream = UnixStream::connect(path).map_err(|e| {
        format!("no pmcache server answers on {} ({e}); is it running?", path.display())
    })?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    writeln!(writer, "{command}").map_err(|e| e.to_string())?;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(|e| e.to_string())?;
        if let Some(message) = line.strip_prefix("error ") {
            return Err(message.to_string());
        }
        on_line(&line);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct NoFrontend;

    impl Frontend for NoFrontend {
        fn stop(&self) {}

        fn stats(&self) -> Vec<(&'static str, u64)> {
            Vec::new()
        }
    }

    /// Once closed, the control thread hands its listener back still bound: until the server
    /// removes the socket, a connection to it is taken, so an online `detach` probing it does
    /// not take the moments before the removal for a server that died.
    #[test]
    fn a_closed_control_socket_takes_connections_until_its_listener_is_dropped() {
        let shm = tempfile::tempdir_in("/dev/shm").expect("shm dir");
        let disk = tempfile::tempdir().expect("disk dir");
        let backing = disk.path().join("backing.img");
        std::fs::File::create(&backing).and_then(|f| f.set_len(16 << 20)).expect("backing");
        let mut config = crate::CacheConfig::new(shm.path().join("cache.pm"), backing);
        config.cache_size = Some(8 << 20);
        let (engine, _) = crate::open::open_or_format(&config, 4).expect("a cache");
        let path = shm.path().join("cache.ctl");
        let listener = bind(&path).expect("bind");
        let closing = Arc::new(AtomicBool::new(false));
        let served = Served {
            engine: Arc::new(engine),
            latencies: Arc::default(),
            frontend: NoFrontend,
            attachment: Arc::new(Attachment::unrecorded()),
            detach: Arc::default(),
            closing: closing.clone(),
        };
        let thread = std::thread::spawn(move || serve(listener, served));
        let mut reply = String::new();
        request(&path, "stats", |line| reply = line.to_owned()).expect("stats");
        assert!(reply.contains("\"slot_count\""), "{reply}");
        closing.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&path);
        let listener = thread.join().expect("the control thread");
        assert!(UnixStream::connect(&path).is_ok(), "the socket stopped taking connections");
        drop(listener);
        assert!(UnixStream::connect(&path).is_err(), "a dropped listener took a connection");
    }
}
