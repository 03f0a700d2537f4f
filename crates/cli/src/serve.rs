//! `pmcache serve`: the cache as an NBD export, one engine lane per client connection, a
//! control socket for `pmcache stats`, `flush` and `detach`, and a clean shutdown on SIGINT or
//! SIGTERM (in-flight requests finish, the backing store is synced, the cache marked clean).
//! On a volatile medium (tmpfs, ramfs, hugetlbfs) a stop writes every dirty block back first, and the
//! attachment is recorded in a state file outside the medium (`crate::state`).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pmcache_engine::{CacheMode, Error, Lane, MonotonicClock, WriteRequest};
use pmcache_media::{FileSystem, MediumKind, MediumSync, PmemFile};
use pmcache_nbd::{
    BatchWrite, BlockExtent, BlockSizes, Export, ExportConn, ExportError, ListenAddr, Server,
    ServerConfig,
};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::cache::{
    Backing, CacheArgs, CacheEngine, MEDIUM_SYNC_HELP, Opened, human, open_or_format, parse_size,
};
use crate::control;
use crate::state;
use crate::tls::TlsArgs;

/// Default cache medium of `pmcache serve` with no arguments.
pub const DEFAULT_CACHE: &str = "/dev/shm/pmcache-default.pm";
/// Default backing file of `pmcache serve` with no arguments.
pub const DEFAULT_BACKING: &str = "./pmcache-data/backing.img";
const DEFAULT_BACKING_BYTES: u64 = 8 << 30;

/// Options of `pmcache serve`. With none, it runs on the embedded default.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The cache medium: a file on a DAX file system, a device-dax node, or a file in /dev/shm
    /// (emulated PM); any other file only with --medium-sync msync (default: a 1 GiB file in
    /// /dev/shm).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// How a medium that is neither DAX nor volatile is made durable: `auto` refuses it,
    /// `msync` syncs its pages at every persist (slow: a device write per cache write).
    #[arg(long, default_value = "auto", value_name = "auto|msync", long_help = MEDIUM_SYNC_HELP)]
    pub medium_sync: MediumSync,
    /// The backing store (default: a sparse 8 GiB file under ./pmcache-data, created if missing).
    #[arg(long)]
    pub backing: Option<PathBuf>,
    /// Size of a new cache medium [default: 1G]. Given for an existing cache, it must be the
    /// medium's size.
    #[arg(long, value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// Cache block size in bytes, for a new cache [default: 4096]. Given for an existing
    /// cache, it must be the cache's.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Cache mode: writeback, writethrough, writearound, passthrough, writeonly.
    #[arg(long, default_value = "writeback")]
    pub mode: pmcache_engine::CacheMode,
    /// Backing-store I/O engine (default: io_uring).
    #[arg(long)]
    pub engine: Option<String>,
    /// Eviction policy: clock or fifo.
    #[arg(long, default_value = "clock")]
    pub eviction: pmcache_engine::EvictionKind,
    /// Attach an existing cache although the file at --backing is another file than the one
    /// it was formatted for (another inode: a copy, a move across file systems, a restore).
    /// You vouch that it holds the data the cache was written over; its size and path must
    /// still match. Needed at every attach until the cache is formatted again.
    #[arg(long)]
    pub backing_moved: bool,
    /// TCP address to listen on (loopback unless --allow-remote).
    #[arg(long, default_value = "127.0.0.1:10809", conflicts_with = "socket")]
    pub listen: SocketAddr,
    /// Listen on a unix socket instead of TCP.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Allow listening on a non-loopback address.
    #[arg(long)]
    pub allow_remote: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Export name.
    #[arg(long, default_value = "pmcache")]
    pub export: String,
    /// Most simultaneous client connections.
    #[arg(long, default_value_t = 16)]
    pub max_connections: usize,
    /// Seconds a client has to take each batch of replies off its socket; a client that stops
    /// reading (or reads too slowly) is dropped then, freeing its connection, engine lane and
    /// buffers.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    pub write_timeout: f64,
    /// Seconds a connection may stay idle (no request from its client) before it is dropped;
    /// 0 keeps idle connections (the default: the kernel's NBD client keeps an idle mounted
    /// device's connection open for as long as the mount lives).
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0, value_parser = seconds)]
    pub idle_timeout: f64,
    /// Control socket for `pmcache stats/flush/detach` (default: the cache path + ".ctl").
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// A setting of the background cleaner, `KEY=VALUE` (repeatable; change it later with
    /// `pmcache set`): order=lba|oldest|none, adaptive=off|boost|boost-pid, target_pct,
    /// high_pct, low_pct, idle_target_pct, idle_ms, queue_depth, batch_blocks, merge_blocks,
    /// kp, ki, kd, rate_min, rate_max, nice_base, nice_boost, stall_timeout_ms.
    /// `order=none` runs no cleaner (writers then write back inline).
    #[arg(long = "cleaner", value_name = "KEY=VALUE")]
    pub cleaner: Vec<String>,
    /// Where the attachment of the backing store to a cache on a volatile medium (tmpfs,
    /// ramfs, hugetlbfs: lost at a reboot) is recorded, outside the medium [default: the backing file's
    /// path + ".pmcache-state"; for a block device,
    /// /var/lib/pmcache/<its path with / as ->.pmcache-state]. `serve` refuses to start when
    /// it records blocks that may not have been written back from a cache that is gone
    /// (docs/DURABILITY.md, "Stop and lost volatile media").
    #[arg(long, value_name = "PATH")]
    pub state_file: Option<PathBuf>,
    /// Start although the state file records that the backing store may lack blocks that only
    /// a volatile cache held, and that cache is gone (or is not the one given): those blocks
    /// are abandoned, and the backing store is served as it is.
    #[arg(long)]
    pub accept_stale_backing: bool,
}

/// The control socket path of a cache.
pub fn default_control_path(cache: &Path) -> PathBuf {
    let mut name = cache.as_os_str().to_owned();
    name.push(".ctl");
    PathBuf::from(name)
}

struct CacheExport {
    engine: &'static CacheEngine,
}

struct CacheConn {
    lane: Lane<'static, PmemFile, Backing, MonotonicClock>,
}

fn export_error(err: Error) -> ExportError {
    ExportError::new(err.errno(), err.to_string())
}

impl Export for CacheExport {
    type Conn = CacheConn;

    fn open_conn(&self) -> Result<CacheConn, ExportError> {
        self.engine.lane().map(|lane| CacheConn { lane }).map_err(export_error)
    }

    fn size_bytes(&self) -> u64 {
        self.engine.size_bytes()
    }

    fn block_sizes(&self) -> BlockSizes {
        let preferred = self.engine.block_size();
        BlockSizes { min_bytes: 512, preferred_bytes: preferred, max_bytes: 32 << 20 }
    }

    /// Safe in every mode: write-back writes are durable at acknowledgement, and a FLUSH on any
    /// connection syncs the backing store for every write any connection completed.
    fn can_multi_conn(&self) -> bool {
        true
    }
}

impl ExportConn for CacheConn {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.lane.read(offset_bytes, buf).map_err(export_error)
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.lane.write(offset_bytes, data, fua).map_err(export_error)
    }

    /// The writes a client had in flight, group-committed by the engine (`Lane::write_batch`).
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        let requests: Vec<WriteRequest<'_>> = writes
            .iter()
            .map(|w| WriteRequest { offset: w.offset_bytes, data: w.data, fua: w.fua })
            .collect();
        let mut results = Vec::with_capacity(writes.len());
        self.lane.write_batch(&requests, &mut results);
        outcomes.extend(results.into_iter().map(|r| r.map_err(export_error)));
    }

    /// The reads a client had in flight, pipelined by the engine (`Lane::read_batch`).
    fn read_batch(
        &mut self,
        reads: &mut [pmcache_nbd::export::BatchRead<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        let mut requests: Vec<pmcache_engine::ReadRequest<'_>> = reads
            .iter_mut()
            .map(|r| pmcache_engine::ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf })
            .collect();
        let mut results = Vec::with_capacity(requests.len());
        self.lane.read_batch(&mut requests, &mut results);
        outcomes.extend(results.into_iter().map(|r| r.map_err(export_error)));
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        self.lane.flush().map_err(export_error)
    }

    /// Holes of the backing store not cached are holes that read as zeroes; the rest is
    /// data (`Engine::extents`).
    fn block_status(
        &mut self,
        offset_bytes: u64,
        len_bytes: u32,
        extents_max: usize,
        extents: &mut Vec<BlockExtent>,
    ) -> Result<(), ExportError> {
        let mut found = Vec::with_capacity(extents_max.min(64));
        let engine = self.lane.engine();
        engine
            .extents(offset_bytes, u64::from(len_bytes), extents_max, &mut found)
            .map_err(export_error)?;
        extents.extend(found.into_iter().map(|e| BlockExtent {
            // Within the request's length, a u32.
            len_bytes: u32::try_from(e.len).unwrap_or(len_bytes),
            hole: e.hole,
            zero: e.hole,
        }));
        Ok(())
    }

    fn trim(&mut self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<(), ExportError> {
        self.lane.trim(offset_bytes, len_bytes).map_err(export_error)?;
        if fua { self.flush() } else { Ok(()) }
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), ExportError> {
        self.lane.write_zeroes(offset_bytes, len_bytes, fua).map_err(export_error)
    }
}

/// A number of seconds, 0 or more (at most a day).
fn seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if (0.0..=86_400.0).contains(&s) => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds between 0 and 86400")),
    }
}

/// A number of seconds above 0 (at most a day).
fn positive_seconds(text: &str) -> Result<f64, String> {
    seconds(text).and_then(|s| if s > 0.0 { Ok(s) } else { Err("must be above 0".into()) })
}

fn ensure_default_backing(path: &Path) -> Result<(), String> {
    if path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::File::create(path)
        .and_then(|f| f.set_len(DEFAULT_BACKING_BYTES))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Runs the server until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: ServeArgs) -> Result<(), String> {
    let embedded = args.backing.is_none();
    let backing = args.backing.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_BACKING));
    if embedded {
        ensure_default_backing(&backing)?;
    }
    let cache = args.cache.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE));
    let cache_args = CacheArgs {
        cache: cache.clone(),
        medium_sync: args.medium_sync,
        backing: backing.clone(),
        cache_size: args.cache_size,
        block_size: args.block_size,
        mode: args.mode,
        engine: args.engine.clone(),
        eviction: args.eviction,
        backing_moved: args.backing_moved,
    };
    // Mistakes in the arguments are refused before anything is opened (a recovery run and
    // then undone by a refused address would leave a clean cache marked unclean).
    if args.socket.is_none() && !args.listen.ip().is_loopback() && !args.allow_remote {
        return Err(format!(
            "refusing to listen on {}, which is not a loopback address, without --allow-remote \
             (without --tls=require, NBD has no authentication: anyone who reaches the port \
             reads and writes the device)",
            args.listen
        ));
    }
    let tls = args.tls.config()?;
    tls.load().map_err(|e| format!("TLS: {e}"))?;
    if let Some(dir) = cache.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        return Err(format!(
            "the directory of the cache medium {} does not exist: {}",
            cache.display(),
            dir.display()
        ));
    }
    let mut cleaner_config = pmcache_engine::CleanerConfig::default();
    cleaner_config
        .set_all(args.cleaner.iter().map(String::as_str))
        .map_err(|e| format!("--cleaner: {e}"))?;
    // The control socket first: a second server on a live cache is refused before it opens
    // (and so touches) the medium. It is removed only when the cache is marked clean, which is
    // what an online `pmcache detach` waits for.
    let control_path = args.control.clone().unwrap_or_else(|| default_control_path(&cache));
    let control_listener = control::bind(&control_path)?;
    let mut control_file = RemoveOnDrop(Some(control_path.clone()));
    if let Some(socket) = &args.socket {
        remove_stale_socket(socket)?;
    }
    // A backing store whose newest blocks may be in a volatile cache that is gone is refused
    // before the medium is opened (or created).
    let state_path = args.state_file.clone().unwrap_or_else(|| state::default_path(&backing));
    let overrode = check_state(&state_path, &cache, args.accept_stale_backing)?;
    // One lane per connection, plus two for control requests (a flush without a cleaner
    // drains through a lane) and the cleaner's.
    let max_lanes = args.max_connections + 3;
    let (engine, opened) = open_or_format(&cache_args, max_lanes)?;
    match &opened {
        Opened::Formatted => eprintln!("pmcache: formatted {} as a new cache", cache.display()),
        Opened::Attached(report) => eprintln!(
            "pmcache: attached {} ({} shutdown): {} clean and {} dirty blocks, {} made dirty by the synced rule, {} torn and {} corrupt entries dropped, in {:.1} ms",
            cache.display(),
            if report.was_clean_shutdown { "clean" } else { "unclean" },
            report.clean,
            report.dirty,
            report.clean_made_dirty,
            report.torn,
            report.corrupt,
            report.duration_ns as f64 / 1e6
        ),
    }
    if let Opened::Attached(report) = &opened
        && report.synced_seq_invalid
    {
        eprintln!(
            "pmcache: warning: the synced sequence word was corrupt; taken as 0, so every clean \
             block was made dirty (it will be written back again)"
        );
    }
    // A volatile medium: the attachment is recorded (the backing store possibly stale) before
    // any client can write.
    let kind = engine.medium().kind();
    let file_system = FileSystem::of_path(&cache)
        .map(|fs| fs.name)
        .unwrap_or_else(|e| format!("a file system that could not be read ({e})"));
    let volatile = (kind == MediumKind::Volatile).then(|| file_system.clone());
    if kind == MediumKind::Msync {
        eprintln!(
            "pmcache: the cache medium is in msync mode ({file_system}): every persist waits for \
             msync(MS_SYNC) of its pages, so each write waits for the device"
        );
    }
    let uuid = engine.superblock().uuid;
    match &volatile {
        Some(fs) => {
            let may_dirty = matches!(args.mode, CacheMode::WriteBack | CacheMode::WriteOnly)
                || engine.dirty_slots() > 0;
            let record = state::Record {
                backing: state::absolute(&backing),
                cache: state::absolute(&cache),
                cache_uuid: uuid,
                cache_volatile: true,
                backing_stale: may_dirty,
                updated_unix_secs: state::now_unix_secs(),
            };
            state::store(&state_path, &record)?;
            eprintln!(
                "pmcache: the cache medium is volatile ({fs}: lost at a reboot): a stop writes \
                 every dirty block back first; the attachment is recorded in {}",
                state_path.display()
            );
        }
        // A record that was overridden would refuse the next start again: it no longer
        // describes this backing store.
        None if overrode => state::remove(&state_path)?,
        None => {}
    }
    // The engine lives as long as the process; lanes borrow it from the connection threads.
    let engine: &'static CacheEngine = Box::leak(Box::new(engine));
    let mut cleaner = engine.cleaner(cleaner_config).map_err(|e| format!("cleaner: {e}"))?;
    // Set before the cleaner is stopped when every dirty block is to be written back (a
    // volatile medium, or a detach): the cleaner's thread then does it after its run, through
    // the cleaner's queue, which belongs to that thread.
    let write_back_all = Arc::new(AtomicBool::new(false));
    let cleaner_thread = {
        let write_back_all = write_back_all.clone();
        std::thread::Builder::new()
            .name("pmcache-cleaner".into())
            .spawn(move || {
                cleaner.run(|note| {
                    if let Some(note) = note {
                        eprintln!("pmcache: {note}; the cleaner runs at a fixed priority");
                    }
                });
                write_back_all.load(Ordering::SeqCst).then(|| cleaner.drain())
            })
            .map_err(|e| format!("starting the cleaner: {e}"))?
    };
    let listen = match &args.socket {
        Some(path) => ListenAddr::Unix(path.clone()),
        None => ListenAddr::Tcp(args.listen),
    };
    let config = ServerConfig {
        export_name: args.export.clone(),
        listen,
        allow_remote: args.allow_remote,
        max_connections: args.max_connections,
        write_timeout: Duration::from_secs_f64(args.write_timeout),
        idle_timeout: (args.idle_timeout > 0.0).then(|| Duration::from_secs_f64(args.idle_timeout)),
        tls,
        ..ServerConfig::default()
    };
    if let Some(warning) = args.tls.remote_warning(&config.listen, config.allow_remote) {
        eprintln!("{warning}");
    }
    let server =
        Server::bind(config, Arc::new(CacheExport { engine })).map_err(|e| e.to_string())?;
    let shutdown = server.shutdown_handle();
    let detach = Arc::new(AtomicBool::new(false));

    {
        let shutdown = shutdown.clone();
        let detach = detach.clone();
        std::thread::Builder::new()
            .name("pmcache-control".into())
            .spawn(move || control::serve(control_listener, engine, shutdown, detach))
            .map_err(|e| e.to_string())?;
    }
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|e| e.to_string())?;
    {
        let shutdown = shutdown.clone();
        let lost = if volatile.is_some() {
            " (the medium is volatile: a reboot before that start loses the blocks not written \
             back)"
        } else {
            ""
        };
        let then = if volatile.is_some() {
            "every dirty block is written back (the medium is volatile) and the cache is marked \
             clean"
        } else {
            "the cache is marked clean"
        };
        std::thread::Builder::new()
            .name("pmcache-signals".into())
            .spawn(move || {
                let mut received = signals.forever();
                if received.next().is_some() {
                    eprintln!(
                        "pmcache: shutting down: requests in flight finish, then {then} (a \
                         second SIGINT or SIGTERM stops at once)"
                    );
                    shutdown.shutdown();
                }
                // A shutdown can wait (a client that stopped reading is cut after a grace
                // period; a detach writes everything back): a second signal ends the process
                // at once. Nothing acknowledged is lost by that: every acknowledged write is
                // already durable on the medium, and the next start recovers the cache as
                // after a crash (unclean shutdown).
                if let Some(signal) = received.next() {
                    eprintln!(
                        "pmcache: second signal: stopping at once, without a clean shutdown; \
                         acknowledged writes are on the medium and the next start recovers \
                         them{lost}"
                    );
                    std::process::exit(128 + signal);
                }
            })
            .map_err(|e| e.to_string())?;
    }

    let uri = server.local_addr().nbd_uri(&args.export);
    print_how_to_connect(
        &server.local_addr(),
        &args.export,
        &uri,
        &cache,
        &backing,
        engine,
        &control_path,
    );
    if let Some(lines) = args.tls.how_to_connect(&server.local_addr(), &args.export) {
        println!("{lines}");
    }
    // From here the control socket stays unless the cache is marked clean: an online
    // `pmcache detach` takes its removal for "every block written back and the cache marked
    // clean", and a socket nobody answers on for a stop without that (an error, or a panic
    // unwinding through here).
    control_file.keep();
    let served = server.run().map_err(|e| e.to_string());
    let detaching = detach.load(Ordering::SeqCst);
    let writing_back = detaching || volatile.is_some();
    write_back_all.store(writing_back, Ordering::SeqCst);
    let total = engine.dirty_slots();
    engine.stop_cleaner();
    // Every dirty block written back by the cleaner's thread after its run (its queue belongs
    // to that thread), when asked for above; this thread shows the progress.
    if writing_back {
        let started = Instant::now();
        let mut progress = Progress::new(total, &backing);
        while !cleaner_thread.is_finished() {
            progress.update(total.saturating_sub(engine.dirty_slots()));
            std::thread::sleep(Duration::from_millis(100));
        }
        progress.finish(total.saturating_sub(engine.dirty_slots()), started.elapsed());
    }
    let written_back = cleaner_thread
        .join()
        .map_err(|_| "the cleaner thread panicked".to_string())?
        .map(|drained| drained.map_err(|e| e.to_string()));
    match written_back {
        Some(Err(e)) if detaching => {
            return Err(format!(
                "write-back before detach failed: {e}; the cache keeps its dirty blocks (nothing \
                 acknowledged is lost) and was not marked clean"
            ));
        }
        Some(Err(e)) => {
            return Err(format!(
                "write-back before stopping failed: {e}; the cache was not marked clean and keeps \
                 its dirty blocks on {} (nothing acknowledged is lost while the medium lasts), \
                 but that medium is volatile ({}): a reboot loses them. Make the backing store \
                 take writes again, then start pmcache again on the same cache (it recovers \
                 them) and stop or detach it",
                cache.display(),
                volatile.as_deref().unwrap_or("tmpfs")
            ));
        }
        Some(Ok(_)) | None => {}
    }
    // Connection threads have ended and dropped their lanes (the cleaner too); a control
    // request may still hold one for a moment.
    let mut attempts = 0;
    loop {
        match engine.shutdown() {
            Err(Error::LanesOpen { .. }) if attempts < 600 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("clean shutdown failed: {e}")),
            Ok(()) => break,
        }
    }
    // The backing store holds every block now: recorded before the control socket goes (an
    // online `detach` waits for that).
    let recorded = if written_back.is_some() {
        state::mark_backing_complete(&state_path, &cache, uuid)
    } else {
        Ok(false)
    };
    let _ = std::fs::remove_file(&control_path);
    let what = match (detaching, written_back.is_some()) {
        (true, _) => " and detached (every block written back)",
        (false, true) => " (every block written back: the medium is volatile)",
        (false, false) => "",
    };
    eprintln!("pmcache: {}: cache marked clean{what}", cache.display());
    match recorded {
        Ok(true) => {
            eprintln!("pmcache: {}: the backing store holds every block", state_path.display())
        }
        Ok(false) => {}
        Err(e) => {
            return Err(format!(
                "{e}; the cache was written back and marked clean, but the state file still \
                 says the backing store may lack blocks: if the medium is lost, start with \
                 --accept-stale-backing"
            ));
        }
    }
    served
}

/// Reads the state file and refuses (with what happened, what is lost and how to go on) a
/// backing store whose newest blocks may be in a volatile cache that is gone, or that is
/// still there but is not `cache`. Returns whether a refusal was overridden by
/// `--accept-stale-backing`.
fn check_state(path: &Path, cache: &Path, accept: bool) -> Result<bool, String> {
    let record = match state::load(path) {
        Ok(Some(record)) => record,
        Ok(None) => return Ok(false),
        Err(e) if accept => {
            eprintln!("pmcache: warning: {e}; starting anyway (--accept-stale-backing)");
            return Ok(true);
        }
        Err(e) => {
            return Err(format!(
                "{e}. It records whether the backing store may lack blocks held by a volatile \
                 cache; inspect it, or pass --accept-stale-backing to start anyway"
            ));
        }
    };
    let now = state::probe_medium(&record.cache);
    let same = state::same_file(&record.cache, cache);
    match state::check(&record, now, same) {
        Ok(()) => Ok(false),
        Err(refusal) => {
            let message = state::refusal_message(&refusal, &record, path, cache);
            if !accept {
                return Err(message);
            }
            eprintln!("pmcache: warning: --accept-stale-backing: {message}");
            eprintln!("pmcache: starting anyway: the backing store is served as it is");
            Ok(true)
        }
    }
}

/// Progress of the final write-back (the dirty count, polled) on stderr: a bar on a terminal,
/// otherwise a line at the start, at each quarter and at the end.
struct Progress {
    total: u64,
    bar: Option<ProgressBar>,
    quarters_said: u64,
}

impl Progress {
    fn new(total: u64, backing: &Path) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "pmcache: writing back {bar:40} {pos}/{len} dirty blocks ({eta})",
                )
                .expect("valid template"),
            );
            bar
        });
        if bar.is_none() {
            eprintln!("pmcache: writing back {total} dirty blocks to {}", backing.display());
        }
        Self { total, bar, quarters_said: 0 }
    }

    fn update(&mut self, cleaned: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(cleaned.min(self.total)),
            None if self.total > 0 => {
                let quarters = (cleaned.min(self.total) * 4 / self.total).min(3);
                if quarters > self.quarters_said {
                    self.quarters_said = quarters;
                    eprintln!("pmcache: written back {cleaned} of {} dirty blocks", self.total);
                }
            }
            None => {}
        }
    }

    fn finish(&self, cleaned: u64, took: Duration) {
        if let Some(bar) = &self.bar {
            bar.set_position(cleaned.min(self.total));
            bar.abandon();
        }
        eprintln!(
            "pmcache: write-back ended after {:.1} s: {cleaned} of {} blocks written back",
            took.as_secs_f64(),
            self.total
        );
    }
}

/// Removes a file when dropped (the control socket, on every way out of `run` but those that
/// `keep` it).
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn keep(&mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Removes a unix socket left behind by a server that was killed (nothing answers on it), so
/// a restart after a crash can listen again; refuses if a server still answers.
fn remove_stale_socket(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else { return Ok(()) };
    if !meta.file_type().is_socket() {
        return Err(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(format!("{} is in use: another server listens on it", path.display()));
    }
    std::fs::remove_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn print_how_to_connect(
    addr: &ListenAddr,
    export: &str,
    uri: &str,
    cache: &Path,
    backing: &Path,
    engine: &CacheEngine,
    control: &Path,
) {
    let slots = engine.superblock().geometry.slot_count;
    println!(
        "pmcache: serving {} ({} cache, medium: {}, {} slots of {} B, {}) in front of {} ({})",
        cache.display(),
        human(engine.superblock().geometry.medium_bytes),
        engine.medium().kind(),
        slots,
        engine.block_size(),
        engine.mode(),
        backing.display(),
        human(engine.size_bytes())
    );
    println!("  NBD URI:     {uri}");
    println!("  qemu-io:     qemu-io -f raw {uri}");
    println!("  nbdinfo:     nbdinfo {uri}");
    println!("  nbdfuse:     mkdir -p mnt && nbdfuse mnt/disk {uri} &");
    match addr {
        ListenAddr::Tcp(sock) => println!(
            "  nbd-client:  nbd-client {} {} /dev/nbd0 -N {export}   (needs the kernel nbd module)",
            sock.ip(),
            sock.port()
        ),
        ListenAddr::Unix(path) => println!(
            "  nbd-client:  nbd-client -u {} /dev/nbd0 -N {export}   (needs the kernel nbd module)",
            path.display()
        ),
    }
    println!("  stats:       pmcache stats --control {}", control.display());
    println!(
        "  stop:        Ctrl-C (clean shutdown), or `pmcache detach --cache {}`",
        cache.display()
    );
}
