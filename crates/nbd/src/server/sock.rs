//! Sockets: a connection's socket with its handshake, reply and idle deadlines, and the
//! listener.

use super::*;

/// A connected socket.
#[derive(Debug)]
pub(super) enum Sock {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Sock {
    pub(super) fn try_clone(&self) -> io::Result<Sock> {
        match self {
            Sock::Tcp(s) => s.try_clone().map(Sock::Tcp),
            Sock::Unix(s) => s.try_clone().map(Sock::Unix),
        }
    }

    pub(super) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.shutdown(how),
            Sock::Unix(s) => s.shutdown(how),
        }
    }

    pub(super) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.set_read_timeout(t),
            Sock::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub(super) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.set_write_timeout(t),
            Sock::Unix(s) => s.set_write_timeout(t),
        }
    }
}

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.read(buf),
            Sock::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.write(buf),
            Sock::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection's socket with its deadlines.
///
/// - Handshake: every read during the handshake waits at most until the deadline, so a
///   client trickling bytes cannot hold the connection (and one of `max_connections`) past
///   `handshake_timeout`, as a timeout restarted by every read would let it.
/// - Replies: the writes of one batch of replies (from its first `write` to the
///   `end_replies` that ends it) share one deadline, `write_timeout` after the first: a
///   client that stops reading, or reads a byte at a time, is dropped when it passes.
/// - Idle: in transmission, a read waits at most `idle_timeout` (if set).
#[derive(Debug)]
pub(super) struct ConnSock {
    pub(super) sock: Sock,
    id: u64,
    handshake_deadline: Option<Instant>,
    write_timeout: Duration,
    idle_timeout: Option<Duration>,
    /// The deadline of the batch of replies under way, set by its first write.
    flush_deadline: Option<Instant>,
    /// The socket's send timeout is shorter than `write_timeout` (a flush's later writes
    /// shorten it to what is left); restored when the flush ends.
    send_timeout_shortened: bool,
    /// The connection is being dropped for a timeout (counted and logged once).
    timed_out: bool,
    counters: Arc<ServerCounters>,
}

impl ConnSock {
    pub(super) fn new(
        sock: Sock,
        id: u64,
        config: &ServerConfig,
        counters: Arc<ServerCounters>,
    ) -> Self {
        Self {
            sock,
            id,
            handshake_deadline: Some(Instant::now() + config.handshake_timeout),
            write_timeout: config.write_timeout,
            idle_timeout: config.idle_timeout,
            flush_deadline: None,
            send_timeout_shortened: false,
            timed_out: false,
            counters,
        }
    }

    pub(super) fn write_timed_out(&mut self) -> io::Error {
        if !std::mem::replace(&mut self.timed_out, true) {
            self.counters.dropped_write_timeout.fetch_add(1, Ordering::Relaxed);
            warn!(
                id = self.id,
                write_timeout_s = self.write_timeout.as_secs_f64(),
                "dropping a connection whose client did not read its replies in time"
            );
        }
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client did not read its replies within the write timeout ({:?})",
                self.write_timeout
            ),
        )
    }
}

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

impl Read for ConnSock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(deadline) = self.handshake_deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not finish the handshake in time",
                ));
            }
            self.sock.set_read_timeout(Some(left))?;
            return self.sock.read(buf);
        }
        match self.sock.read(buf) {
            Err(e) if is_timeout(&e) => {
                let idle = self.idle_timeout.unwrap_or_default();
                if !std::mem::replace(&mut self.timed_out, true) {
                    self.counters.dropped_idle.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        id = self.id,
                        idle_timeout_s = idle.as_secs_f64(),
                        "dropping a connection whose client sent nothing within the idle timeout"
                    );
                }
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client sent nothing within the idle timeout ({idle:?})"),
                ))
            }
            other => other,
        }
    }
}

impl Write for ConnSock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.timed_out {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the connection timed out"));
        }
        let now = Instant::now();
        match self.flush_deadline {
            // The socket's send timeout is `write_timeout` already.
            None => self.flush_deadline = Some(now + self.write_timeout),
            Some(deadline) => {
                let left = deadline.saturating_duration_since(now);
                if left.is_zero() {
                    return Err(self.write_timed_out());
                }
                self.sock.set_write_timeout(Some(left))?;
                self.send_timeout_shortened = true;
            }
        }
        match self.sock.write(buf) {
            Err(e) if is_timeout(&e) => Err(self.write_timed_out()),
            other => other,
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for ConnSock {
    fn poll_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(match &self.sock {
            Sock::Tcp(s) => s.as_fd(),
            Sock::Unix(s) => s.as_fd(),
        })
    }

    fn end_handshake(&mut self) -> io::Result<()> {
        self.handshake_deadline = None;
        self.sock.set_read_timeout(self.idle_timeout)
    }

    /// Ends the batch of replies under way: the next write starts a new deadline.
    fn end_replies(&mut self) -> io::Result<()> {
        self.flush_deadline = None;
        if std::mem::take(&mut self.send_timeout_shortened) {
            self.sock.set_write_timeout(Some(self.write_timeout))?;
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(super) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    pub(super) fn accept(&self) -> io::Result<Sock> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok(Sock::Tcp(s))
            }
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Sock::Unix(s)),
        }
    }

    pub(super) fn local_addr(&self) -> io::Result<ListenAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().map(ListenAddr::Tcp),
            Listener::Unix(_, p) => Ok(ListenAddr::Unix(p.clone())),
        }
    }
}
