//! The socket a VMM connects to: a unix socket listened on for as long as the device is
//! served. Each connection (a VM started, or QEMU reconnecting after this server was
//! restarted) gets a backend of its own — the rust-vmm daemon, a thread per virtqueue, a
//! target per virtqueue made for it — and when the VMM goes away the next connection is
//! waited for. [`Stopper::stop`] ends the connection in service and the wait.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pmcache_block::BlockConn;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::BlkBackend;
use crate::queue::QueueCounters;
use crate::virtio::Geometry;

/// How often a server waiting for a VMM looks whether it was stopped.
const STOP_POLL: Duration = Duration::from_millis(100);

/// An error serving the device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be listened on.
    #[error("listening on {path}: {source}")]
    Listen {
        /// The socket's path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The targets of a connection's queues could not be made.
    #[error("the virtqueues' targets: {0}")]
    Targets(String),
    /// The vhost-user daemon failed.
    #[error("vhost-user: {0}")]
    Daemon(String),
}

/// Stops a server from another thread (a signal, `pmcache detach`), and reads its counters.
#[derive(Clone, Default)]
pub struct Stopper {
    inner: Arc<StopperInner>,
}

#[derive(Default)]
struct StopperInner {
    stopped: AtomicBool,
    connection: Mutex<Option<ShutdownHandle>>,
    connections: AtomicU64,
    /// Counters of the connections that ended.
    ended: Mutex<QueueCounters>,
    /// Reads the counters of the connection in service.
    live: Mutex<Option<Box<dyn Fn() -> QueueCounters + Send>>>,
}

impl Stopper {
    /// Stops the server: the connection in service is closed (the VMM sees the backend go
    /// and waits to reconnect), and no other is accepted.
    pub fn stop(&self) {
        self.inner.stopped.store(true, Ordering::SeqCst);
        if let Some(handle) =
            self.inner.connection.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
        {
            handle.shutdown();
        }
    }

    fn stopped(&self) -> bool {
        self.inner.stopped.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.inner.connections.load(Ordering::Relaxed)
    }

    /// The requests served so far, over every connection.
    pub fn counters(&self) -> QueueCounters {
        let mut sum = *self.inner.ended.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = self.inner.live.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let c = live();
            sum.requests += c.requests;
            sum.batches += c.batches;
            sum.errors += c.errors;
            sum.bounced += c.bounced;
        }
        sum
    }
}

/// Listens on `socket` (which must not exist) and serves a device of `geometry` to each VMM
/// that connects, one at a time, until `stopper` is stopped; `targets` makes the targets of
/// a connection's virtqueues (one each). `ready` is called once the socket listens. The
/// socket is removed at the end.
pub fn serve<T, F>(
    socket: &Path,
    geometry: Geometry,
    mut targets: F,
    stopper: &Stopper,
    ready: impl FnOnce(),
) -> Result<(), Error>
where
    T: BlockConn + Send + 'static,
    F: FnMut() -> Result<Vec<T>, String>,
{
    let listen_error = |source| Error::Listen { path: socket.to_owned(), source };
    let std_listener = UnixListener::bind(socket).map_err(listen_error)?;
    let _remove = RemoveSocket(socket.to_owned());
    let fd = std_listener.as_raw_fd();
    let mut listener = Listener::from(std_listener);
    ready();
    while !stopper.stopped() {
        if !readable(fd, STOP_POLL).map_err(listen_error)? {
            continue;
        }
        let backend = Arc::new(BlkBackend::new(geometry, targets().map_err(Error::Targets)?));
        let memory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut daemon = VhostUserDaemon::new("pmcache-vhost".into(), backend.clone(), memory)
            .map_err(|e| Error::Daemon(e.to_string()))?;
        if let Err(e) = daemon.start(&mut listener) {
            tracing::warn!("vhost-user: a connection was not taken: {e}");
            continue;
        }
        stopper.inner.connections.fetch_add(1, Ordering::Relaxed);
        {
            let counted = backend.clone();
            *stopper.inner.live.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(Box::new(move || counted.counters()));
        }
        *stopper.inner.connection.lock().unwrap_or_else(|e| e.into_inner()) =
            daemon.shutdown_handle();
        // A stop that came before the handle was there.
        if stopper.stopped() {
            daemon.request_shutdown();
        }
        match daemon.wait() {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => tracing::info!("vhost-user: the VMM disconnected"),
            Err(e) if stopper.stopped() => tracing::debug!("vhost-user: stopped: {e}"),
            Err(e) => tracing::warn!("vhost-user: the connection ended: {e}"),
        }
        *stopper.inner.connection.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *stopper.inner.live.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // The worker threads end and are joined with the daemon; the targets go with the
        // backend.
        drop(daemon);
        let counters = backend.counters();
        let mut ended = stopper.inner.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.requests += counters.requests;
        ended.batches += counters.batches;
        ended.errors += counters.errors;
        ended.bounced += counters.bounced;
    }
    Ok(())
}

/// Whether `fd` is readable within `timeout`.
fn readable(fd: i32, timeout: Duration) -> std::io::Result<bool> {
    let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid `pollfd` for the duration of the call; `fd` is the listener's, open
    // for as long as `serve` runs.
    let n = unsafe { libc::poll(&mut pollfd, 1, ms) };
    match n {
        0 => Ok(false),
        n if n > 0 => Ok(true),
        _ => {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted { Ok(false) } else { Err(e) }
        }
    }
}

/// Removes the socket when the server ends.
struct RemoveSocket(PathBuf);

impl Drop for RemoveSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
