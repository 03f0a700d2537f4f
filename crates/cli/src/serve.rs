//! `pmcache serve`: the cache as an NBD export, one engine lane per client connection, a
//! control socket for `pmcache stats`, `flush` and `detach`, and a clean shutdown on SIGINT or
//! SIGTERM (in-flight requests finish, the backing store is synced, the cache marked clean).
//! On a volatile medium (tmpfs, ramfs, hugetlbfs) a stop writes every dirty block back first, and the
//! attachment is recorded in a state file outside the medium (`crate::state`). What both
//! frontends share around serving is `crate::serving`; `--ublk` serves a kernel block device
//! instead (`crate::ublk`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pmcache_engine::{Error, Lane, MonotonicClock, ReadRequest, WriteRequest};
use pmcache_media::{MediumSync, PmemFile};
use pmcache_nbd::{
    BatchWrite, BlockExtent, BlockSizes, Export, ExportConn, ExportError, ListenAddr, Server,
    ServerConfig,
};

use crate::cache::{Backing, CacheEngine, MEDIUM_SYNC_HELP, human, parse_size};
use crate::serving::Serving;
use crate::tls::TlsArgs;

/// Default cache medium of `pmcache serve` with no arguments.
pub const DEFAULT_CACHE: &str = "/dev/shm/pmcache-default.pm";
/// Default backing file of `pmcache serve` with no arguments.
pub const DEFAULT_BACKING: &str = "./pmcache-data/backing.img";

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
    /// Serve the cache as a kernel block device, /dev/ublkbN, through the kernel's ublk
    /// driver (Linux 6.0 or later, module ublk_drv; needs root) instead of over NBD
    /// (docs/UBLK.md). One thread and one engine lane per queue.
    #[arg(long, conflicts_with_all = ["listen", "socket", "allow_remote", "export"])]
    pub ublk: bool,
    /// ublk hardware queues: a thread and an engine lane each.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "ublk")]
    pub ublk_queues: u16,
    /// ublk tags per queue: the requests each queue can have in flight.
    #[arg(long, value_name = "N", default_value_t = 128, requires = "ublk")]
    pub ublk_depth: u16,
    /// What a device does when its server dies: `on`, it stays with its requests waiting
    /// (and a file system mounted on it waiting too) until `--recover N` takes it over; `off`,
    /// the driver fails its requests at once (the file system sees I/O errors) and `pmcache
    /// ublk remove N` deletes it. Kernels without user recovery behave as `off`.
    #[arg(long, value_enum, value_name = "on|off", default_value = "on", requires = "ublk")]
    pub ublk_recovery: Switch,
    /// Take over /dev/ublkbN, left by a server of this cache that died (user recovery): the
    /// cache is recovered from its medium, the device keeps its number, queues and depth, and
    /// a file system mounted on it carries on. Refused for a device of another cache, a
    /// device still served, or one added without user recovery (`pmcache ublk list` shows
    /// them all).
    #[arg(long, value_name = "N", requires = "ublk")]
    pub recover: Option<u32>,
    /// Start although the state file records that the backing store may lack blocks that only
    /// a volatile cache held, and that cache is gone (or is not the one given): those blocks
    /// are abandoned, and the backing store is served as it is.
    #[arg(long)]
    pub accept_stale_backing: bool,
}

/// A feature turned on or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// Turned on.
    On,
    /// Turned off.
    Off,
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

/// One engine lane, served by one frontend connection or queue: NBD's `ExportConn` here,
/// ublk's `Target` in `crate::ublk`.
pub(crate) struct CacheConn {
    pub(crate) lane: Lane<'static, PmemFile, Backing, MonotonicClock>,
    /// The engine's outcomes of one batch, kept from batch to batch.
    results: Vec<Result<(), Error>>,
}

impl CacheConn {
    pub(crate) fn new(lane: Lane<'static, PmemFile, Backing, MonotonicClock>) -> Self {
        Self { lane, results: Vec::new() }
    }

    /// The writes a frontend had in flight together, group-committed by the engine
    /// (`Lane::write_batch`); their outcomes appended to `outcomes` through `map`.
    pub(crate) fn write_batch_into<'a, E>(
        &mut self,
        writes: impl Iterator<Item = WriteRequest<'a>>,
        outcomes: &mut Vec<Result<(), E>>,
        map: fn(Error) -> E,
    ) {
        let requests: Vec<WriteRequest<'a>> = writes.collect();
        self.lane.write_batch(&requests, &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(map)));
    }

    /// The reads a frontend had in flight together, pipelined by the engine
    /// (`Lane::read_batch`); their outcomes appended to `outcomes` through `map`.
    pub(crate) fn read_batch_into<'a, E>(
        &mut self,
        reads: impl Iterator<Item = ReadRequest<'a>>,
        outcomes: &mut Vec<Result<(), E>>,
        map: fn(Error) -> E,
    ) {
        let mut requests: Vec<ReadRequest<'a>> = reads.collect();
        self.lane.read_batch(&mut requests, &mut self.results);
        outcomes.extend(self.results.drain(..).map(|r| r.map_err(map)));
    }
}

fn export_error(err: Error) -> ExportError {
    ExportError::new(err.errno(), err.to_string())
}

impl Export for CacheExport {
    type Conn = CacheConn;

    fn open_conn(&self) -> Result<CacheConn, ExportError> {
        self.engine.lane().map(CacheConn::new).map_err(export_error)
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
        let requests = writes.iter().map(|w| WriteRequest {
            offset: w.offset_bytes,
            data: w.data,
            fua: w.fua,
        });
        self.write_batch_into(requests, outcomes, export_error);
    }

    /// The reads a client had in flight, pipelined by the engine (`Lane::read_batch`).
    fn read_batch(
        &mut self,
        reads: &mut [pmcache_nbd::export::BatchRead<'_>],
        outcomes: &mut Vec<Result<(), ExportError>>,
    ) {
        let requests =
            reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf });
        self.read_batch_into(requests, outcomes, export_error);
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

/// Runs the server until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: ServeArgs) -> Result<(), String> {
    if args.ublk {
        return crate::ublk::run(args);
    }
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
    // One lane per connection, plus two for control requests (a flush without a cleaner
    // drains through a lane) and the cleaner's.
    let mut serving = Serving::open(&args, args.max_connections + 3, || match &args.socket {
        Some(socket) => remove_stale_socket(socket),
        None => Ok(()),
    })?;
    let engine = serving.engine;
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
    serving.start_control(server.shutdown_handle())?;
    let uri = server.local_addr().nbd_uri(&args.export);
    print_how_to_connect(
        &server.local_addr(),
        &args.export,
        &uri,
        &serving.cache,
        &serving.backing,
        engine,
        &serving.control_path,
    );
    if let Some(lines) = args.tls.how_to_connect(&server.local_addr(), &args.export) {
        println!("{lines}");
    }
    serving.keep_control_socket();
    let served = server.run().map_err(|e| e.to_string());
    serving.finish(served)
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
    print_serving(cache, backing, engine);
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

/// The startup line: the cache (size, medium kind, slots, mode) in front of its backing store.
pub(crate) fn print_serving(cache: &Path, backing: &Path, engine: &CacheEngine) {
    println!(
        "pmcache: serving {} ({} cache, medium: {}, {} slots of {} B, {}) in front of {} ({})",
        cache.display(),
        human(engine.superblock().geometry.medium_bytes),
        engine.medium().kind(),
        engine.superblock().geometry.slot_count,
        engine.block_size(),
        engine.mode(),
        backing.display(),
        human(engine.size_bytes())
    );
}
