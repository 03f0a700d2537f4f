//! A panic in one connection's write ends the whole `pmcache serve` process by abort, and the
//! restart on the same medium finds every acknowledged write.
//!
//! The server runs with the `panic-mid-write` failpoint armed (`PMCACHE_FAILPOINT`, a test
//! hook of the engine: docs/TESTING.md): its `N`th block write panics with its data in a slot,
//! its block's index entry reserved and its stripe locked, before its metadata entry is stored.
//! Several connections write stamped blocks, some pipelined (group commits), and record a
//! write as acknowledged only once its reply arrived. The server must die of SIGABRT, every
//! connection must be cut (none goes on being served to the end of its writes), and after a
//! restart every block must hold its last acknowledged stamp or a later one that was in
//! flight.
//!
//! The binary under test is the shipped configuration: `test-opt` inherits the release
//! profile's `panic = "abort"`, so it aborts at the panic itself. A build that unwinds (the
//! `dev`/`test` profiles) aborts through the engine's guard at the entry point the panic
//! unwinds out of (or where another thread finds a lock it released poisoned), which says so
//! on stderr: the test checks which of the two happened.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use pmcache_nbd::codec::CMD_WRITE;

use crate::common::*;

const BLOCK: u64 = 4 * KIB;
/// The block write that panics.
const PANIC_AT: u64 = 300;
const CONNS: u64 = 4;
/// Writes each connection keeps in flight: 1 for the first connection (each write alone,
/// `Lane::write`), more for the others (pipelined writes are group-committed).
const QUEUE_DEPTHS: [usize; CONNS as usize] = [1, 4, 8, 8];
/// Writes each connection sends at most: a server that goes on serving after the panic lets
/// the other writers finish these.
const WRITES_MAX_PER_CONN: u64 = 20 * PANIC_AT;
/// Blocks written (each connection owns those `b` with `b % CONNS` = its number).
const SPAN_BLOCKS: u64 = 2048;
/// What the engine prints when a panic unwinds out of an entry point, or when another thread
/// finds a lock the unwinding released poisoned.
const UNWOUND_MESSAGES: [&str; 2] = ["a panic unwound out of Lane::", "an engine lock is poisoned"];
const SIGABRT: i32 = 6;

/// The 4 KiB a block holds after a write with `stamp` (0: never written, zeros).
fn block_bytes(block: u64, stamp: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK as usize];
    if stamp == 0 {
        return b;
    }
    b[..8].copy_from_slice(&block.to_le_bytes());
    b[8..16].copy_from_slice(&stamp.to_le_bytes());
    let mut x = (block ^ stamp.rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in b[16..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    b
}

/// What a block may hold: its last acknowledged stamp (0: zeros) or one written after it
/// whose reply had not arrived.
#[derive(Clone, Debug, Default)]
struct Logged {
    acked: u64,
    pending: Vec<u64>,
}

/// `pmcache serve` with `PMCACHE_FAILPOINT` set, SIGKILLed when dropped unless it exited.
struct ArmedServer {
    child: Option<Child>,
    addr: std::net::SocketAddr,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl ArmedServer {
    fn start(setup: &Setup, failpoint: &str) -> ArmedServer {
        let stdout = setup.shm.path().join("armed.out");
        let stderr = setup.shm.path().join("armed.err");
        let cache_size = setup.cache_bytes.to_string();
        let child = Command::new(PMCACHE)
            .args(["serve", "--cache", &setup.cache_arg(), "--cache-size", &cache_size])
            .args(["--backing", &setup.backing_arg(), "--control", &setup.control_arg()])
            .args(["--mode", "writeback", "--listen", "127.0.0.1:0"])
            .env("PMCACHE_FAILPOINT", failpoint)
            // The panic hook runs before the abort (the panicking thread still holding its
            // stripe), and the other connections are served meanwhile; symbolizing a
            // backtrace would make that last long.
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("stdout log"))
            .stderr(std::fs::File::create(&stderr).expect("stderr log"))
            .spawn()
            .expect("start pmcache serve");
        let mut server = ArmedServer {
            child: Some(child),
            addr: "127.0.0.1:0".parse().expect("an address"),
            stdout,
            stderr,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&server.stdout).unwrap_or_default();
            if let Some(uri) = text.lines().find_map(|l| l.trim().strip_prefix("NBD URI:")) {
                let rest = uri.trim().strip_prefix("nbd://").expect("a TCP URI");
                server.addr = rest.split('/').next().expect("host:port").parse().expect("addr");
                return server;
            }
            let status = server.child.as_mut().expect("running").try_wait().expect("try_wait");
            assert!(
                status.is_none(),
                "exited with {status:?} before listening:\n{}",
                server.logs()
            );
            assert!(Instant::now() < deadline, "did not start:\n{}", server.logs());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn logs(&self) -> String {
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        format!("--- stdout\n{}--- stderr\n{}", read(&self.stdout), read(&self.stderr))
    }

    /// The exit status, once the process exited by itself within `timeout`.
    fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut()?.try_wait().expect("try_wait") {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for ArmedServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What one connection wrote.
struct Written {
    log: HashMap<u64, Logged>,
    acked: u64,
    /// The connection was cut before all its writes were answered.
    cut: bool,
}

/// One connection's writes until its connection dies or it sent `WRITES_MAX_PER_CONN`:
/// whole blocks at random among its own, `depth` in flight.
fn write_until_dead(mut c: NbdClient, conn: u64, depth: usize) -> Written {
    let mut log: HashMap<u64, Logged> = HashMap::new();
    let mut rng = 0x5eed_1234_5678_9abc_u64 ^ conn.wrapping_mul(0x9e37_79b9);
    let mut in_flight = std::collections::VecDeque::new();
    let (mut sent, mut acked) = (0u64, 0u64);
    loop {
        while in_flight.len() < depth && sent < WRITES_MAX_PER_CONN {
            sent += 1;
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let block = (rng % (SPAN_BLOCKS / CONNS)) * CONNS + conn;
            let stamp = (conn << 32) | sent;
            log.entry(block).or_default().pending.push(stamp);
            let data = block_bytes(block, stamp);
            if c.try_request(CMD_WRITE, 0, sent, block * BLOCK, BLOCK as u32, &data).is_err() {
                return Written { log, acked, cut: true };
            }
            in_flight.push_back((sent, block, stamp));
        }
        let Some(&(cookie, block, stamp)) = in_flight.front() else {
            return Written { log, acked, cut: false };
        };
        let Ok((error, replied)) = c.try_simple_reply() else {
            return Written { log, acked, cut: true };
        };
        in_flight.pop_front();
        assert_eq!(replied, cookie, "replies come in order on a connection");
        if error == 0 {
            acked += 1;
            let logged = log.get_mut(&block).expect("logged");
            logged.acked = stamp;
            logged.pending.retain(|&p| p > stamp);
        }
    }
}

#[test]
fn a_panic_mid_write_aborts_the_server_and_loses_no_acknowledged_write() {
    let setup = Setup::new("panic", 64 * MIB, 16 * MIB);
    let mut server = ArmedServer::start(&setup, &format!("panic-mid-write:{PANIC_AT}"));
    // Every client is connected before any writes: a connection still negotiating when the
    // failpoint aborts the server would fail in the handshake, not in its writes.
    let clients: Vec<_> = (0..CONNS).map(|_| NbdClient::ready(server.addr)).collect();
    let writers: Vec<_> = clients
        .into_iter()
        .zip(0..CONNS)
        .map(|(c, conn)| {
            std::thread::spawn(move || write_until_dead(c, conn, QUEUE_DEPTHS[conn as usize]))
        })
        .collect();
    let mut log = HashMap::new();
    let (mut acked, mut served_to_the_end) = (0, Vec::new());
    for (conn, writer) in writers.into_iter().enumerate() {
        let written = writer.join().expect("writer thread");
        log.extend(written.log);
        acked += written.acked;
        if !written.cut {
            served_to_the_end.push(conn);
        }
    }
    let status = server.wait(Duration::from_secs(30));
    let logs = server.logs();
    assert!(
        served_to_the_end.is_empty(),
        "connections {served_to_the_end:?} were served on after write {PANIC_AT} panicked, to \
         the end of their writes ({acked} acknowledged; exit status {status:?}):\n{logs}"
    );
    let status = status.unwrap_or_else(|| panic!("the server is still running:\n{logs}"));
    assert_eq!(status.signal(), Some(SIGABRT), "not an abort: {status}:\n{logs}");
    assert!(
        logs.contains(&format!("failpoint PMCACHE_FAILPOINT=panic-mid-write:{PANIC_AT}")),
        "the failpoint did not fire:\n{logs}"
    );
    // Which abort: `panic = "abort"` at the panic (the release profile and `test-opt`, which
    // inherits it), or the engine's guard once the panic unwound to an entry point.
    let profile_dir = Path::new(PMCACHE).parent().and_then(Path::file_name);
    let aborts_at_panic = profile_dir.is_some_and(|d| d == "release" || d == "test-opt");
    assert_eq!(
        !UNWOUND_MESSAGES.iter().any(|m| logs.contains(m)),
        aborts_at_panic,
        "{PMCACHE} (profile directory {profile_dir:?}) should abort {}:\n{logs}",
        if aborts_at_panic { "at the panic, with no unwinding" } else { "through the guard" }
    );
    assert!(acked > 100, "only {acked} writes acknowledged before the panic");
    println!("{acked} writes acknowledged before the abort, over {} blocks", log.len());

    // Recovery from the medium: every acknowledged write is there.
    let server = setup.serve(Via::Tcp, &["--mode", "writeback"]);
    let logs = server.logs();
    assert!(logs.contains("(unclean shutdown)"), "not a recovery:\n{logs}");
    let mut c = NbdClient::ready(server.addr());
    let mut lost = Vec::new();
    for (&block, logged) in &log {
        let data = c.read_at(block * BLOCK, BLOCK as u32);
        let holds = std::iter::once(logged.acked)
            .chain(logged.pending.iter().copied())
            .any(|stamp| data == block_bytes(block, stamp));
        if !holds {
            lost.push(format!(
                "block {block}: acknowledged stamp {:#x}, {} in flight, holds stamp {:#x}",
                logged.acked,
                logged.pending.len(),
                u64::from_le_bytes(data[8..16].try_into().expect("8"))
            ));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} blocks lost an acknowledged write:\n{}",
        lost.len(),
        log.len(),
        lost[..lost.len().min(10)].join("\n")
    );
    server.terminate();
}
