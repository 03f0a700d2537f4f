//! The NBD server: listener, connection threads, the per-connection protocol loop, shutdown.
//!
//! One thread per client connection, each with its own [`BlockConn`]. Requests on a
//! connection are pipelined: the thread decodes requests from a read buffer and executes
//! them in order, appending replies to an output buffer that it writes out whenever no
//! further complete request header is buffered (so a burst of pipelined requests costs one
//! `read` and one `write` system call, and a lone request is answered at once). Requests of
//! the same kind that are already buffered go to the export together: a WRITE with the
//! writes whose payloads have arrived after it ([`BlockConn::write_batch`], at most 32), a
//! READ with the reads whose headers have arrived after it ([`BlockConn::read_batch`], at
//! most [`READ_BATCH_MAX`] and [`READ_BATCH_BYTES_MAX`] of data). All buffers are allocated
//! when a connection enters transmission, sized from the configuration: a 256 KiB read
//! buffer, a write-payload buffer and a reply buffer of the maximum request size (a read
//! batch's data fits in it too). A connection that misbehaves is closed alone; bad requests
//! get the spec's error and the connection keeps working (see [`codec::Session::validate`]).
//!
//! Shutdown ([`ShutdownHandle::shutdown`], callable from any thread) stops accepting, shuts
//! down the read side of every connection (each finishes the request it is executing, writes
//! its pending replies, flushes its `BlockConn`), and [`Server::run`] returns once all
//! connection threads have exited.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::codec::{
    self, CLIENT_FLAGS_BYTES, ExportInfo, Negotiation, OPTION_DATA_BYTES_MAX, OPTION_HEADER_BYTES,
    OptionOutcome, ProtocolError, REQUEST_HEADER_BYTES, Request, STRING_BYTES_MAX,
    STRUCTURED_READ_HEADER_BYTES, Session,
};
use crate::export::{BlockSizes, Export, extent_flags};
use crate::tls::{ConnTls, MaybeTls, TlsConfig, TlsError};
use pmcache_block::{BatchRead, BatchWrite, BlockConn, BlockError, BlockExtent, Started};

mod conn;
mod sock;
mod wire;

pub use conn::{serve_connection, serve_connection_tls};
use sock::{ConnSock, Listener, Sock};

/// The default NBD port.
pub const DEFAULT_PORT: u16 = 10809;
/// Default maximum read or write payload (32 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: u32 = 32 << 20;
/// Default maximum number of simultaneous client connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// Largest accepted `max_request_bytes`.
pub const MAX_REQUEST_BYTES_LIMIT: u32 = 256 << 20;

const READ_BUFFER_BYTES: usize = 256 * 1024;
const OUT_FLUSH_BYTES: usize = 256 * 1024;
/// Writes handed to the export together at most.
const WRITE_BATCH_MAX: usize = 32;
/// Reads handed to the export together ([`BlockConn::read_batch`]) at most: the cache
/// engine's pipelined read chunk.
pub const READ_BATCH_MAX: usize = 32;
/// Data bytes of the reads of one batch at most, when the maximum request size is larger
/// (otherwise that size is the bound): a batch's replies are built in the reply buffer before
/// any is sent, so this bounds what one batch pins there and how long its first reply waits.
/// A read larger than the bound is a batch of its own. At 1 MiB, reads of up to 32 KiB fill a
/// batch of [`READ_BATCH_MAX`].
pub const READ_BATCH_BYTES_MAX: usize = 1 << 20;
/// Most extents in one block status reply (8 KiB of descriptors); a client asks again for
/// the rest of a range.
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 1024;
const SHUTDOWN_WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default [`ServerConfig::write_timeout`].
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address; port 0 picks an ephemeral port.
    Tcp(SocketAddr),
    /// A unix socket path (must not exist yet; removed when the server returns).
    Unix(PathBuf),
}

impl ListenAddr {
    /// The NBD URI for `export_name` at this address (`nbd://host:port/name` or
    /// `nbd+unix:///name?socket=path`).
    pub fn nbd_uri(&self, export_name: &str) -> String {
        match self {
            ListenAddr::Tcp(a) => format!("nbd://{a}/{export_name}"),
            ListenAddr::Unix(p) => format!("nbd+unix:///{export_name}?socket={}", p.display()),
        }
    }
}

/// Server configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Name of the export ([`Server::bind`]; [`Server::bind_exports`] names each of its
    /// own). The empty name (the default export) also selects it (the first).
    pub export_name: String,
    /// Listener address. Default: `127.0.0.1:10809`.
    pub listen: ListenAddr,
    /// Allow a TCP listener on a non-loopback address. Default: false.
    pub allow_remote: bool,
    /// Simultaneous connections; further connections are closed at once. Default: 16.
    pub max_connections: usize,
    /// Largest read/write payload (advertised as the maximum block size, clamped to the
    /// export's). Larger requests get `EOVERFLOW`. Default: 32 MiB.
    pub max_request_bytes: u32,
    /// A client must finish the handshake within this time. Default: 10 s.
    pub handshake_timeout: Duration,
    /// A client must take each batch of replies (at most the largest read plus 256 KiB) off
    /// the socket within this time, or its connection is dropped: a client that stops reading
    /// cannot pin a connection thread, its engine lane and its buffers. Default: 30 s.
    pub write_timeout: Duration,
    /// A connection whose client sends nothing for this long in transmission is dropped
    /// (`None`: never). Default: `None`, because the kernel's NBD client keeps an idle
    /// mounted device's connection open for as long as the mount lives.
    pub idle_timeout: Option<Duration>,
    /// TLS (`NBD_OPT_STARTTLS`): off, offered or required, and the credentials. Default: off.
    pub tls: TlsConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            export_name: String::new(),
            listen: ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT))),
            allow_remote: false,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            handshake_timeout: Duration::from_secs(10),
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            idle_timeout: None,
            tls: TlsConfig::default(),
        }
    }
}

/// Errors that stop the server (as opposed to a single connection).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Listening on a non-loopback address needs `allow_remote`.
    #[error("refusing to listen on non-loopback address {0} without allow_remote")]
    RemoteNotAllowed(SocketAddr),
    /// The configuration or the export's geometry is invalid.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The TLS configuration or its credentials are invalid.
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    /// Binding the listener failed.
    #[error("cannot listen on {addr:?}: {source}")]
    Bind {
        /// The address.
        addr: ListenAddr,
        /// The cause.
        source: io::Error,
    },
}

/// Why a connection ended badly. Logged; never stops the server.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The socket failed.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    /// The client violated the protocol; the connection was closed.
    #[error("protocol violation: {0}")]
    Protocol(#[from] ProtocolError),
    /// The export could not open a connection.
    #[error("export: {0}")]
    Export(#[from] BlockError),
    /// TLS could not start.
    #[error("{0}")]
    Tls(#[from] TlsError),
}

/// How a connection ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnEnd {
    /// The client sent `NBD_OPT_ABORT` during the handshake.
    Aborted,
    /// The client sent `NBD_CMD_DISC`.
    Disconnected,
    /// The client closed the socket (or the server shut the read side down).
    Closed,
}

/// A byte stream a connection is served over. Implemented for the server's sockets; tests
/// and fuzzers can implement it for in-memory streams.
pub trait Transport: Read + Write {
    /// Called when the handshake is over (the server uses it to lift the handshake timeout).
    fn end_handshake(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// Called when a batch of replies has been written out and flushed (the server uses it to
    /// end the batch's write deadline). Apart from `flush`, which a TLS library may also call
    /// for each record it sends.
    fn end_replies(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// The descriptor that polls readable when the client has sent more (the server waits on
    /// it beside an export's reads in flight); `None` if there is none to poll (the server
    /// then completes its reads in flight before it reads from the client).
    fn poll_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }

    /// Whether bytes the client sent are already held above the descriptor (decrypted TLS
    /// records): a read returns them without the descriptor polling readable.
    fn has_buffered_input(&mut self) -> bool {
        false
    }
}

impl<T: Transport + ?Sized> Transport for &mut T {
    fn end_handshake(&mut self) -> io::Result<()> {
        (**self).end_handshake()
    }

    fn end_replies(&mut self) -> io::Result<()> {
        (**self).end_replies()
    }

    fn poll_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        (**self).poll_fd()
    }

    fn has_buffered_input(&mut self) -> bool {
        (**self).has_buffered_input()
    }
}

/// An in-memory [`Transport`] for tests and fuzzing: reads come from a fixed byte string
/// (then end of stream), writes are collected in [`ReplayTransport::output`].
#[derive(Debug, Default, Clone)]
pub struct ReplayTransport {
    input: Vec<u8>,
    pos: usize,
    /// Everything the server wrote.
    pub output: Vec<u8>,
}

impl ReplayTransport {
    /// A transport whose reads return `input`.
    pub fn new(input: Vec<u8>) -> Self {
        Self { input, pos: 0, output: Vec::new() }
    }
}

impl Read for ReplayTransport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let rest = self.input.get(self.pos..).unwrap_or_default();
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for ReplayTransport {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for ReplayTransport {}

/// Computes what the negotiation advertises, validating the export's geometry.
pub fn export_info<E: Export>(
    export: &E,
    export_name: &str,
    max_request_bytes: u32,
) -> Result<ExportInfo, ServerError> {
    let bad = |m: &str| ServerError::InvalidConfig(m.to_owned());
    let bs = export.block_sizes();
    bs.validate().map_err(bad)?;
    if export_name.len() > STRING_BYTES_MAX {
        return Err(bad("export name longer than 4096 bytes"));
    }
    if !export.size_bytes().is_multiple_of(u64::from(bs.min_bytes)) {
        return Err(bad("export size is not a multiple of the minimum block size"));
    }
    if !(1..=MAX_REQUEST_BYTES_LIMIT).contains(&max_request_bytes) {
        return Err(bad("max_request_bytes must be between 1 and 256 MiB"));
    }
    let max = bs.max_bytes.min(max_request_bytes);
    let max_bytes = max - max % bs.min_bytes;
    if max_bytes < bs.min_bytes {
        return Err(bad("max_request_bytes is smaller than the minimum block size"));
    }
    Ok(ExportInfo {
        name: export_name.to_owned(),
        size_bytes: export.size_bytes(),
        block_sizes: BlockSizes { max_bytes, ..bs },
        can_multi_conn: export.can_multi_conn(),
    })
}

/// What the server counts (see [`ServerStats`]).
#[derive(Debug, Default)]
struct ServerCounters {
    accepted: AtomicU64,
    refused_at_limit: AtomicU64,
    dropped_write_timeout: AtomicU64,
    dropped_idle: AtomicU64,
}

/// The server's connection counts since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections accepted and served.
    pub connections_accepted: u64,
    /// Connections closed at once because `max_connections` were open.
    pub connections_refused_at_limit: u64,
    /// Connections dropped because their client did not read replies within `write_timeout`.
    pub connections_dropped_write_timeout: u64,
    /// Connections dropped because their client sent nothing within `idle_timeout`.
    pub connections_dropped_idle: u64,
    /// Connections open now.
    pub connections_open: u64,
}

/// No export picked yet (a connection in its handshake).
const NO_EXPORT: usize = usize::MAX;

/// A connection's socket, and the export it picked ([`NO_EXPORT`] until it does).
#[derive(Debug)]
struct Registered {
    sock: Sock,
    export: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    wake_addr: ListenAddr,
    conns: Mutex<HashMap<u64, Registered>>,
    counters: Arc<ServerCounters>,
    /// Per export: closed by [`ShutdownHandle::close_export`].
    closed: Vec<AtomicBool>,
}

impl Shared {
    fn shut_conns(&self) {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        for Registered { sock, .. } in conns.values() {
            // Best effort: the socket may already be closed by its peer. The timeout covers
            // sends that start from now on; one already blocked keeps the timeout it started
            // with, which `cut_conns` ends.
            let _ = sock.set_write_timeout(Some(SHUTDOWN_WRITE_TIMEOUT));
            let _ = sock.shutdown(Shutdown::Read);
        }
    }

    /// Shuts down both directions of every connection still open: a connection thread
    /// blocked sending replies to a client that stopped reading returns (EPIPE).
    fn cut_conns(&self) {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        for (id, Registered { sock, .. }) in conns.iter() {
            warn!(id, "connection still sending after the shutdown grace period; cutting it");
            let _ = sock.shutdown(Shutdown::Both);
        }
    }
}

/// Stops a running [`Server`]. Cheap to clone; usable from any thread (e.g. a signal thread).
#[derive(Debug, Clone)]
pub struct ShutdownHandle {
    shared: Arc<Shared>,
}

impl ShutdownHandle {
    /// Stops accepting, lets every connection finish its current request and pending replies,
    /// and makes [`Server::run`] return after flushing each connection's export state.
    /// Returns immediately; idempotent.
    pub fn shutdown(&self) {
        if self.shared.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.shut_conns();
        // Wake the accept loop with a connection of our own.
        match &self.shared.wake_addr {
            ListenAddr::Tcp(a) => {
                let mut a = *a;
                if a.ip().is_unspecified() {
                    a.set_ip(if a.is_ipv4() {
                        [127, 0, 0, 1].into()
                    } else {
                        std::net::Ipv6Addr::LOCALHOST.into()
                    });
                }
                let _ = TcpStream::connect_timeout(&a, Duration::from_secs(1));
            }
            ListenAddr::Unix(p) => {
                let _ = UnixStream::connect(p);
            }
        }
    }

    /// Stops serving export `index` (of those [`Server::bind_exports`] was given) while the
    /// others go on: a client picking it from now on is refused (`ERR_SHUTDOWN`), and each
    /// connection serving it finishes its current request and pending replies and closes, as
    /// at a shutdown. Once every export is closed the server shuts down. Idempotent.
    ///
    /// # Panics
    /// If there is no export `index`.
    pub fn close_export(&self, index: usize) {
        let shared = &self.shared;
        if shared.closed[index].swap(true, Ordering::SeqCst) {
            return;
        }
        {
            let conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
            for Registered { sock, export } in conns.values() {
                if export.load(Ordering::SeqCst) == index {
                    let _ = sock.set_write_timeout(Some(SHUTDOWN_WRITE_TIMEOUT));
                    let _ = sock.shutdown(Shutdown::Read);
                }
            }
        }
        if shared.closed.iter().all(|c| c.load(Ordering::SeqCst)) {
            self.shutdown();
        }
    }

    /// Whether export `index` was closed ([`ShutdownHandle::close_export`], or a shutdown).
    pub fn is_export_closed(&self, index: usize) -> bool {
        self.is_shutdown() || self.shared.closed[index].load(Ordering::SeqCst)
    }

    /// Connections serving export `index` now.
    pub fn export_connections(&self, index: usize) -> u64 {
        let conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.values().filter(|r| r.export.load(Ordering::SeqCst) == index).count() as u64
    }

    /// True once shutdown was requested.
    pub fn is_shutdown(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
    }

    /// The server's connection counts.
    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.counters;
        let open = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).len();
        ServerStats {
            connections_accepted: c.accepted.load(Ordering::Relaxed),
            connections_refused_at_limit: c.refused_at_limit.load(Ordering::Relaxed),
            connections_dropped_write_timeout: c.dropped_write_timeout.load(Ordering::Relaxed),
            connections_dropped_idle: c.dropped_idle.load(Ordering::Relaxed),
            connections_open: open as u64,
        }
    }
}

/// An NBD server of one export, or of several picked by name.
#[derive(Debug)]
pub struct Server<E: Export> {
    listener: Listener,
    exports: Arc<Vec<Arc<E>>>,
    infos: Arc<Vec<ExportInfo>>,
    config: ServerConfig,
    tls: ConnTls,
    shared: Arc<Shared>,
}

impl<E: Export> Server<E> {
    /// Validates the configuration and the export's geometry and binds the listener.
    pub fn bind(config: ServerConfig, export: Arc<E>) -> Result<Self, ServerError> {
        let name = config.export_name.clone();
        Self::bind_exports(config, vec![(name, export)])
    }

    /// [`Server::bind`] for several exports, each with its name (`config.export_name` is not
    /// used): a client picks one by name, the empty name picking the first, and
    /// `NBD_OPT_LIST` lists them in this order. Each can be closed alone
    /// ([`ShutdownHandle::close_export`]).
    pub fn bind_exports(
        config: ServerConfig,
        exports: Vec<(String, Arc<E>)>,
    ) -> Result<Self, ServerError> {
        if config.max_connections == 0 {
            return Err(ServerError::InvalidConfig("max_connections must be at least 1".into()));
        }
        if exports.is_empty() {
            return Err(ServerError::InvalidConfig("a server has an export at least".into()));
        }
        let mut infos = Vec::with_capacity(exports.len());
        for (i, (name, export)) in exports.iter().enumerate() {
            if exports[..i].iter().any(|(other, _)| other == name) {
                return Err(ServerError::InvalidConfig(format!("two exports are named {name:?}")));
            }
            infos.push(export_info(&**export, name, config.max_request_bytes)?);
        }
        let exports: Vec<Arc<E>> = exports.into_iter().map(|(_, export)| export).collect();
        let tls = config.tls.load()?;
        let bind_err = |source| ServerError::Bind { addr: config.listen.clone(), source };
        let listener = match &config.listen {
            ListenAddr::Tcp(a) => {
                if !a.ip().is_loopback() && !config.allow_remote {
                    return Err(ServerError::RemoteNotAllowed(*a));
                }
                Listener::Tcp(TcpListener::bind(a).map_err(bind_err)?)
            }
            ListenAddr::Unix(p) => {
                Listener::Unix(UnixListener::bind(p).map_err(bind_err)?, p.clone())
            }
        };
        let wake_addr = listener.local_addr().map_err(bind_err)?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            wake_addr,
            conns: Mutex::new(HashMap::new()),
            counters: Arc::default(),
            closed: exports.iter().map(|_| AtomicBool::new(false)).collect(),
        });
        let (exports, infos) = (Arc::new(exports), Arc::new(infos));
        Ok(Self { listener, exports, infos, config, tls, shared })
    }

    /// The bound address (with the real port if port 0 was requested).
    pub fn local_addr(&self) -> ListenAddr {
        self.shared.wake_addr.clone()
    }

    /// What the handshake advertises (of the first export).
    pub fn export_info(&self) -> &ExportInfo {
        &self.infos[0]
    }

    /// A handle that stops this server.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle { shared: self.shared.clone() }
    }

    /// Runs [`Server::run`] on a new thread.
    pub fn spawn(self) -> io::Result<RunningServer> {
        let handle = self.shutdown_handle();
        let addr = self.local_addr();
        let thread = thread::Builder::new().name("nbd-accept".into()).spawn(move || self.run())?;
        Ok(RunningServer { handle, addr, thread })
    }

    /// Accepts and serves connections until shut down; then waits for every connection.
    pub fn run(self) -> Result<(), ServerError> {
        info!(addr = ?self.shared.wake_addr, "NBD server listening");
        let mut workers: Vec<JoinHandle<()>> = Vec::new();
        let mut next_id = 0u64;
        while !self.shared.stop.load(Ordering::SeqCst) {
            let accepted = self.listener.accept();
            if self.shared.stop.load(Ordering::SeqCst) {
                break;
            }
            let sock = match accepted {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            workers.retain(|w| !w.is_finished());
            if workers.len() >= self.config.max_connections {
                self.shared.counters.refused_at_limit.fetch_add(1, Ordering::Relaxed);
                warn!(
                    max = self.config.max_connections,
                    "connection limit reached; closing new connection"
                );
                continue;
            }
            let id = next_id;
            next_id += 1;
            match self.start_conn(id, sock) {
                Ok(w) => workers.push(w),
                Err(e) => warn!(error = %e, "cannot start connection"),
            }
        }
        self.shared.shut_conns();
        // Connections finish their request and pending replies; one whose client stopped
        // reading is cut after the grace period, so shutdown never hangs on a client.
        let deadline = Instant::now() + SHUTDOWN_WRITE_TIMEOUT;
        while workers.iter().any(|w| !w.is_finished()) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        self.shared.cut_conns();
        for w in workers {
            if w.join().is_err() {
                warn!("a connection thread panicked");
            }
        }
        if let Listener::Unix(_, p) = &self.listener {
            let _ = std::fs::remove_file(p);
        }
        info!("NBD server stopped");
        Ok(())
    }

    fn start_conn(&self, id: u64, sock: Sock) -> io::Result<JoinHandle<()>> {
        sock.set_read_timeout(Some(self.config.handshake_timeout))?;
        sock.set_write_timeout(Some(self.config.write_timeout))?;
        let conn = ConnSock::new(sock, id, &self.config, self.shared.counters.clone());
        let picked = Arc::new(AtomicUsize::new(NO_EXPORT));
        let registered = Registered { sock: conn.sock.try_clone()?, export: picked.clone() };
        self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, registered);
        let exports = self.exports.clone();
        let infos = self.infos.clone();
        let tls = self.tls.clone();
        let shared = self.shared.clone();
        let spawned = thread::Builder::new().name(format!("nbd-conn-{id}")).spawn(move || {
            // Unregisters the connection however the thread ends, a panic included: the
            // registered clone of its socket would otherwise keep the connection open, and
            // the client would wait instead of seeing it close.
            let _registered = Unregister { shared: shared.clone(), id };
            debug!(id, "connection opened");
            // The export is recorded before its closed flag is read, and `close_export` sets
            // that flag before it looks at the recorded exports: a connection picking an
            // export being closed either is refused here or is shut down there.
            // A connection refused goes back to no export, so that it does not count as one
            // of that export's while its client haggles on.
            let pick = |index: usize| {
                picked.store(index, Ordering::SeqCst);
                if shared.closed[index].load(Ordering::SeqCst) {
                    picked.store(NO_EXPORT, Ordering::SeqCst);
                    return None;
                }
                Some(&*exports[index])
            };
            match conn::serve_connection_to(conn, &infos, &tls, pick) {
                Ok(end) => debug!(id, ?end, "connection ended"),
                Err(e) => warn!(id, error = %e, "connection closed"),
            }
        });
        if spawned.is_err() {
            self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        } else {
            self.shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
        }
        spawned
    }
}

/// Removes a connection's socket from the registry when its thread ends.
struct Unregister {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

/// A server running on its own thread (from [`Server::spawn`]).
#[derive(Debug)]
pub struct RunningServer {
    handle: ShutdownHandle,
    addr: ListenAddr,
    thread: JoinHandle<Result<(), ServerError>>,
}

impl RunningServer {
    /// The bound address.
    pub fn addr(&self) -> &ListenAddr {
        &self.addr
    }

    /// A handle that stops the server.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.handle.clone()
    }

    /// The server's connection counts.
    pub fn stats(&self) -> ServerStats {
        self.handle.stats()
    }

    /// Shuts down and waits for the server to return.
    pub fn stop(self) -> Result<(), ServerError> {
        self.handle.shutdown();
        self.thread
            .join()
            .unwrap_or_else(|_| Err(ServerError::InvalidConfig("server thread panicked".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The URIs clients take (libnbd's and qemu's syntax).
    #[test]
    fn nbd_uris_name_the_export_and_the_address() {
        let tcp = ListenAddr::Tcp("127.0.0.1:10809".parse().expect("address"));
        assert_eq!(tcp.nbd_uri("pm"), "nbd://127.0.0.1:10809/pm");
        let v6 = ListenAddr::Tcp("[::1]:7".parse().expect("address"));
        assert_eq!(v6.nbd_uri(""), "nbd://[::1]:7/");
        let unix = ListenAddr::Unix(PathBuf::from("/run/pmcache.sock"));
        assert_eq!(unix.nbd_uri("pm"), "nbd+unix:///pm?socket=/run/pmcache.sock");
    }

    fn mem(size_bytes: u64, min_bytes: u32, max_bytes: u32) -> crate::MemExport {
        let sizes = BlockSizes { min_bytes, preferred_bytes: min_bytes.max(4096), max_bytes };
        crate::MemExport::new(size_bytes, sizes).expect("export")
    }

    /// What the handshake advertises: the export's maximum clamped to the server's, rounded
    /// down to the minimum; an export name up to 4096 bytes; refusals name what is wrong.
    #[test]
    fn export_info_clamps_and_refuses_precisely() {
        let export = mem(1 << 20, 512, 1 << 20);
        let info = export_info(&export, "pm", 64 << 10).expect("valid");
        assert_eq!((info.name.as_str(), info.size_bytes), ("pm", 1 << 20));
        assert_eq!(info.block_sizes.max_bytes, 64 << 10, "clamped to the server's maximum");
        let info = export_info(&export, "pm", (64 << 10) + 100).expect("valid");
        assert_eq!(info.block_sizes.max_bytes, 64 << 10, "rounded down to the minimum");
        let info = export_info(&export, "pm", 512).expect("one minimum block");
        assert_eq!(info.block_sizes.max_bytes, 512);
        assert_eq!(
            export_info(&export, &"n".repeat(4096), 1 << 20).expect("4096").name.len(),
            4096
        );
        let refused = |e: Result<ExportInfo, ServerError>| match e {
            Err(ServerError::InvalidConfig(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let m = refused(export_info(&export, &"n".repeat(4097), 1 << 20));
        assert!(m.contains("4096"), "{m}");
        let m = refused(export_info(&export, "pm", 511));
        assert!(m.contains("smaller than the minimum"), "{m}");
        let m = refused(export_info(&export, "pm", 0));
        assert!(m.contains("between 1 and 256 MiB"), "{m}");
        let m = refused(export_info(&export, "pm", (256 << 20) + 1));
        assert!(m.contains("between 1 and 256 MiB"), "{m}");
        export_info(&export, "pm", 256 << 20).expect("256 MiB is allowed");
        let m = refused(export_info(&Uneven, "pm", 1 << 20));
        assert!(m.contains("multiple of the minimum"), "{m}");
    }

    /// An export whose size is not a whole number of its minimum blocks.
    struct Uneven;

    impl Export for Uneven {
        type Conn<'a> = crate::mem::MemConn;
        fn open_conn(&self) -> Result<Self::Conn<'_>, BlockError> {
            unreachable!("never served")
        }
        fn size_bytes(&self) -> u64 {
            (1 << 20) + 512
        }
        fn block_sizes(&self) -> BlockSizes {
            BlockSizes { min_bytes: 1024, preferred_bytes: 4096, max_bytes: 1 << 20 }
        }
        fn can_multi_conn(&self) -> bool {
            false
        }
    }

    // ----- one connection over an in-memory transport -----

    fn option_bytes(out: &mut Vec<u8>, option: u32, data: &[u8]) {
        out.extend_from_slice(&codec::IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&option.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
    }

    /// Client flags and a GO for export "pm" asking for block sizes.
    fn handshake_bytes() -> Vec<u8> {
        let mut b = 3u32.to_be_bytes().to_vec();
        let go = codec::tests::go(b"pm", &[codec::INFO_BLOCK_SIZE]);
        option_bytes(&mut b, codec::OPT_GO, &go);
        b
    }

    fn request_bytes(out: &mut Vec<u8>, command: u16, cookie: u64, offset: u64, len: u32) {
        out.extend_from_slice(&codec::REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&command.to_be_bytes());
        out.extend_from_slice(&cookie.to_be_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
    }

    fn serve(input: Vec<u8>) -> (Result<ConnEnd, ConnError>, crate::MemExport, Vec<u8>) {
        let export = mem(1 << 20, 512, 1 << 20);
        let info = export_info(&export, "pm", 1 << 20).expect("info");
        let mut transport = ReplayTransport::new(input);
        let end = serve_connection(&mut transport, &export, &info);
        (end, export, transport.output)
    }

    /// How a connection ends is how the client ended it: gone during the handshake or
    /// after it (closed), an ABORT (aborted, after its ACK), a DISC (disconnected); a
    /// protocol violation is an error. Writes acknowledged before the client went away stay.
    #[test]
    fn a_connection_ends_as_its_client_ends_it() {
        assert!(matches!(serve(Vec::new()).0, Ok(ConnEnd::Closed)), "gone before its flags");
        assert!(matches!(serve(3u32.to_be_bytes().to_vec()).0, Ok(ConnEnd::Closed)));
        let mut abort = 3u32.to_be_bytes().to_vec();
        option_bytes(&mut abort, codec::OPT_ABORT, &[]);
        let (end, _, out) = serve(abort);
        assert!(matches!(end, Ok(ConnEnd::Aborted)), "{end:?}");
        assert_eq!(out[out.len() - 8..out.len() - 4], codec::REP_ACK.to_be_bytes());
        let mut bad = 3u32.to_be_bytes().to_vec();
        option_bytes(&mut bad, codec::OPT_GO, &[]);
        bad[4] ^= 0xff;
        assert!(matches!(
            serve(bad).0,
            Err(ConnError::Protocol(codec::ProtocolError::BadOptionMagic(_)))
        ));
        let mut write_then_gone = handshake_bytes();
        request_bytes(&mut write_then_gone, codec::CMD_WRITE, 1, 4096, 512);
        write_then_gone.extend_from_slice(&[0x5a; 512]);
        let (end, export, _) = serve(write_then_gone.clone());
        assert!(matches!(end, Ok(ConnEnd::Closed)), "{end:?}");
        let mut back = [0u8; 512];
        export.read_at(4096, &mut back).expect("read");
        assert_eq!(back, [0x5a; 512]);
        let mut cut_mid_payload = write_then_gone.clone();
        cut_mid_payload.truncate(cut_mid_payload.len() - 100);
        assert!(matches!(serve(cut_mid_payload).0, Ok(ConnEnd::Closed)));
        let mut disc = write_then_gone;
        request_bytes(&mut disc, codec::CMD_DISC, 2, 0, 0);
        assert!(matches!(serve(disc).0, Ok(ConnEnd::Disconnected)));
    }

    /// When the export cannot open a connection, a GO is refused with a reason and the
    /// haggling goes on (here the client then leaves); EXPORT_NAME, which has no error
    /// reply, ends the connection with the export's error.
    #[test]
    fn an_export_that_cannot_open_a_connection() {
        let export = mem(1 << 20, 512, 1 << 20);
        export.refuse_conns(true);
        let info = export_info(&export, "pm", 1 << 20).expect("info");
        let mut transport = ReplayTransport::new(handshake_bytes());
        let end = serve_connection(&mut transport, &export, &info);
        assert!(matches!(end, Ok(ConnEnd::Closed)), "{end:?}");
        let out = &transport.output;
        let reply_type = u32::from_be_bytes(out[18 + 12..18 + 16].try_into().expect("4"));
        assert_eq!(reply_type, codec::REP_ERR_SHUTDOWN);
        let mut by_name = 3u32.to_be_bytes().to_vec();
        option_bytes(&mut by_name, codec::OPT_EXPORT_NAME, b"pm");
        let mut transport = ReplayTransport::new(by_name);
        match serve_connection(&mut transport, &export, &info) {
            Err(ConnError::Export(e)) => assert_eq!(e.errno(), libc::EBUSY),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(transport.output.len(), 18, "nothing after the greeting");
    }

    /// Pipelined writes that fill the read buffer many times over, one straddling each
    /// refill: every write lands whole, in place, each acknowledged once, in order.
    #[test]
    fn pipelined_writes_across_read_buffer_refills_land_whole() {
        let count = 200u64;
        let mut input = handshake_bytes();
        for i in 0..count {
            request_bytes(&mut input, codec::CMD_WRITE, i, i * 4096, 4096);
            input.extend((0..4096u64).map(|b| (b * 7 + i * 13) as u8));
        }
        let (end, export, out) = serve(input);
        assert!(matches!(end, Ok(ConnEnd::Closed)), "{end:?}");
        let replies = &out[out.len() - count as usize * codec::SIMPLE_REPLY_BYTES..];
        for (i, reply) in replies.chunks(codec::SIMPLE_REPLY_BYTES).enumerate() {
            assert_eq!(reply[4..8], [0; 4], "write {i} failed");
            assert_eq!(u64::from_be_bytes(reply[8..16].try_into().expect("8")), i as u64);
        }
        let mut back = vec![0u8; 4096];
        for i in 0..count {
            export.read_at(i * 4096, &mut back).expect("read");
            let want: Vec<u8> = (0..4096u64).map(|b| (b * 7 + i * 13) as u8).collect();
            assert!(back == want, "write {i} did not land whole");
        }
        assert!(export.stats().batched_writes > 0, "the writes were batched");
    }

    /// On a structured session a failed read gets a structured error chunk, and a failed
    /// write a simple reply with the error (structured replies are for reads only here).
    #[test]
    fn failures_are_answered_in_the_form_the_command_takes() {
        let mut input = 3u32.to_be_bytes().to_vec();
        option_bytes(&mut input, codec::OPT_STRUCTURED_REPLY, &[]);
        input.extend_from_slice(&handshake_bytes()[4..]);
        request_bytes(&mut input, codec::CMD_WRITE, 1, 8192, 512);
        input.extend_from_slice(&[1; 512]);
        request_bytes(&mut input, codec::CMD_READ, 2, 8192, 512);
        let export = mem(1 << 20, 512, 1 << 20);
        export.set_fault(Some((8192, 8704, libc::EIO)));
        let info = export_info(&export, "pm", 1 << 20).expect("info");
        let mut transport = ReplayTransport::new(input);
        let end = serve_connection(&mut transport, &export, &info);
        assert!(matches!(end, Ok(ConnEnd::Closed)), "{end:?}");
        let out = &transport.output;
        let simple = codec::SIMPLE_REPLY_MAGIC.to_be_bytes();
        let at = out.windows(4).position(|w| w == simple).expect("a simple reply");
        assert_eq!(out[at + 4..at + 8], codec::NBD_EIO.to_be_bytes(), "the write's error");
        assert_eq!(u64::from_be_bytes(out[at + 8..at + 16].try_into().expect("8")), 1);
        let chunk = &out[at + 16..];
        assert_eq!(chunk[..4], codec::STRUCTURED_REPLY_MAGIC.to_be_bytes(), "the read's chunk");
        assert_eq!(u16::from_be_bytes([chunk[6], chunk[7]]), codec::REPLY_TYPE_ERROR);
        assert_eq!(u64::from_be_bytes(chunk[8..16].try_into().expect("8")), 2);
        assert_eq!(chunk[20..24], codec::NBD_EIO.to_be_bytes());
    }

    /// A transport that serves `input`, then ends the stream or (`fail_at_end`) fails with a
    /// socket error other than end of stream; with `interrupt`, every other read is
    /// interrupted (EINTR) first. It records the size of every write it is given.
    struct Scripted {
        input: ReplayTransport,
        interrupt: bool,
        interrupted_last: bool,
        fail_at_end: bool,
        write_sizes: Vec<usize>,
    }

    impl Scripted {
        fn new(input: Vec<u8>) -> Self {
            Self {
                input: ReplayTransport::new(input),
                interrupt: false,
                interrupted_last: false,
                fail_at_end: false,
                write_sizes: Vec::new(),
            }
        }
    }

    impl std::io::Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.interrupt && !self.interrupted_last {
                self.interrupted_last = true;
                return Err(io::ErrorKind::Interrupted.into());
            }
            self.interrupted_last = false;
            match self.input.read(buf)? {
                0 if self.fail_at_end => Err(io::Error::other("link down")),
                n => Ok(n),
            }
        }
    }

    impl std::io::Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.write_sizes.push(buf.len());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Transport for Scripted {}

    /// Reads interrupted by signals are retried; a socket error that is not the client going
    /// away ends the connection as an error, in the handshake and in transmission alike.
    #[test]
    fn interrupted_reads_retry_and_socket_errors_are_errors() {
        let export = mem(1 << 20, 512, 1 << 20);
        let info = export_info(&export, "pm", 1 << 20).expect("info");
        let mut in_transmission = handshake_bytes();
        request_bytes(&mut in_transmission, codec::CMD_WRITE, 1, 0, 512);
        in_transmission.extend_from_slice(&[3; 512]);
        for input in [3u32.to_be_bytes().to_vec(), in_transmission] {
            let mut t = Scripted { interrupt: true, fail_at_end: true, ..Scripted::new(input) };
            match serve_connection(&mut t, &export, &info) {
                Err(ConnError::Io(e)) => assert_eq!(e.to_string(), "link down"),
                other => panic!("unexpected {other:?}"),
            }
        }
        let mut back = [0u8; 512];
        export.read_at(0, &mut back).expect("read");
        assert_eq!(back, [3; 512], "the write before the error was served");
    }

    /// Replies are sent in pieces of at most the flush size plus one read batch's replies,
    /// however many requests are pipelined: the reply buffer stays bounded.
    #[test]
    fn pipelined_replies_go_out_in_bounded_pieces() {
        let export = mem(1 << 20, 512, 1 << 20);
        let info = export_info(&export, "pm", 1 << 20).expect("info");
        let mut input = handshake_bytes();
        let read_bytes = 64 << 10;
        for i in 0..64u64 {
            request_bytes(&mut input, codec::CMD_READ, i, (i % 16) * read_bytes, read_bytes as u32);
        }
        let mut transport = Scripted::new(input);
        let end = serve_connection(&mut transport, &export, &info);
        assert!(matches!(end, Ok(ConnEnd::Closed)), "{end:?}");
        let total: usize = transport.write_sizes.iter().sum();
        assert!(total > 64 * read_bytes as usize, "every read answered: {total} bytes");
        let largest = transport.write_sizes.iter().copied().max().unwrap_or(0);
        let batch_replies = READ_BATCH_BYTES_MAX + READ_BATCH_MAX * codec::SIMPLE_REPLY_BYTES;
        let bound = OUT_FLUSH_BYTES + batch_replies;
        assert!(largest <= bound, "a write of {largest} bytes, bound {bound}");
        assert!(total > 2 * bound, "the replies were more than the bound");
    }
}
