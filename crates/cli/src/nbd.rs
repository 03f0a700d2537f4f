//! `pmcache serve` over NBD: the cache as an NBD export, one engine lane per client
//! connection, stopped by the control socket or a signal (`crate::serving`).

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pmcache_engine::{Error, READS_PENDING_MAX, ReadRequest, WriteRequest};
use pmcache_nbd::{
    BatchWrite, BlockExtent, BlockSizes, Export, ExportConn, ExportError, ListenAddr, Server,
    ServerConfig, ShutdownHandle, Started,
};

use crate::args::ServeArgs;
use crate::cache::CacheEngine;
use crate::conn::CacheConn;
use crate::control::Frontend;
use crate::serving::{Serving, print_serving};

struct CacheExport {
    engine: &'static CacheEngine,
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

    /// Writes group-committed in write-back modes, whole blocks left in flight to the backing
    /// store otherwise (`Lane::write_batch_start`).
    fn write_batch_start(&mut self, writes: &[BatchWrite<'_>], started: &mut Vec<Started>) {
        let requests = writes.iter().map(|w| WriteRequest {
            offset: w.offset_bytes,
            data: w.data,
            fua: w.fua,
        });
        self.write_batch_start_into(
            requests,
            started,
            |result| Started::Done(result.map_err(export_error)),
            Started::Pending,
        );
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

    /// Hits answered at once, misses left in flight on the lane's queue
    /// (`Lane::read_batch_start`).
    fn read_batch_start(
        &mut self,
        reads: &mut [pmcache_nbd::BatchRead<'_>],
        started: &mut Vec<Started>,
    ) {
        let requests =
            reads.iter_mut().map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf });
        self.read_batch_start_into(
            requests,
            started,
            |result| Started::Done(result.map_err(export_error)),
            Started::Pending,
        );
    }

    fn pending(&self) -> usize {
        self.lane.pending()
    }

    fn pending_max(&self) -> usize {
        READS_PENDING_MAX
    }

    fn completion_fd(&self) -> Option<BorrowedFd<'_>> {
        CacheConn::completion_fd(self)
    }

    fn complete(&mut self, min: usize, done: &mut pmcache_nbd::export::Completed<'_>) -> usize {
        self.complete_into(min, done, export_error)
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

impl Frontend for ShutdownHandle {
    fn stop(&self) {
        self.shutdown();
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let server = ShutdownHandle::stats(self);
        vec![
            ("connections_open", server.connections_open),
            ("connections_accepted", server.connections_accepted),
            ("connections_refused_at_limit", server.connections_refused_at_limit),
            ("connections_dropped_write_timeout", server.connections_dropped_write_timeout),
            ("connections_dropped_idle", server.connections_dropped_idle),
        ]
    }
}

/// Runs the server until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: &ServeArgs) -> Result<(), String> {
    // Mistakes in the arguments are refused before anything is opened (a recovery run and
    // then undone by a refused address would leave a clean cache marked unclean).
    if args.socket.is_none() && !args.listen.ip().is_loopback() && !args.allow_remote {
        return Err(format!(
            "refusing to listen on {}, which is not a loopback address, without --allow-remote \
             (NBD itself authenticates nobody: anyone who reaches the port reads and writes the \
             device unless --tls=require authenticates clients by a key or a certificate)",
            args.listen
        ));
    }
    let tls = args.tls.config()?;
    let listen = match &args.socket {
        Some(path) => ListenAddr::Unix(path.clone()),
        None => ListenAddr::Tcp(args.listen),
    };
    let warning = args.tls.check_remote(&listen, args.allow_remote, args.allow_unauthenticated)?;
    tls.load().map_err(|e| format!("TLS: {e}"))?;
    // One lane per connection, plus two for control requests (a flush without a cleaner
    // drains through a lane) and the cleaner's.
    let mut serving = Serving::open(args, args.max_connections + 3, || match &args.socket {
        Some(socket) => remove_stale_socket(socket),
        None => Ok(()),
    })?;
    let engine = serving.engine;
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
    if let Some(warning) = warning {
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
    println!("{}", args.tls.clients_line(&server.local_addr()));
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
