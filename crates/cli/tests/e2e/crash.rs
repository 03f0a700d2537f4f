//! kill -9 of `pmcache serve` (write-back, cache in /dev/shm) in the middle of a write stream,
//! restart on the same cache and backing file (attach + recovery), and a check that every
//! write the server had acknowledged is there.
//!
//! Two loads: our own pipelined NBD client, which stamps every 512-byte sector it writes with
//! (sector, unique stamp) and records a stamp as acknowledged only when the write's reply has
//! arrived — so after the restart each sector must hold its last acknowledged stamp or a later
//! one that was in flight at the kill, nothing else; and fio (sequential writes with crc32c
//! verify headers, 2 connections), whose completed-bytes count is an acknowledged prefix
//! because the server replies in order on each connection.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use pmcache_nbd::codec::{CMD_FLAG_FUA, CMD_FLUSH, CMD_WRITE};

use crate::common::*;

const SECTOR: u64 = 512;
const REGION: u64 = 64 * KIB;
const CONNS: u64 = 2;
const QUEUE_DEPTH: usize = 8;

/// What a sector may hold: its last acknowledged stamp (0: never written, zeros) or one of
/// the stamps written after it whose reply had not arrived.
#[derive(Clone, Debug, Default)]
struct Sector {
    acked: u64,
    pending: Vec<u64>,
}

/// The bytes a sector holds after a write with `stamp` (0: zeros).
fn sector_bytes(sector: u64, stamp: u64) -> [u8; SECTOR as usize] {
    let mut b = [0u8; SECTOR as usize];
    if stamp == 0 {
        return b;
    }
    b[..8].copy_from_slice(&sector.to_le_bytes());
    b[8..16].copy_from_slice(&stamp.to_le_bytes());
    let mut x = (sector ^ stamp.rotate_left(23)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in b[16..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Starts one writer per connection, each with the part of `log` in its own sectors
/// (connections own disjoint sectors, so their logs merge back without conflicts).
fn spawn_writers(
    addr: std::net::SocketAddr,
    round: u64,
    span_bytes: u64,
    log: &mut HashMap<u64, Sector>,
) -> Vec<std::thread::JoinHandle<(HashMap<u64, Sector>, u64)>> {
    let mut parts: Vec<HashMap<u64, Sector>> = (0..CONNS).map(|_| HashMap::new()).collect();
    for (s, sector) in log.drain() {
        parts[((s * SECTOR / REGION) % CONNS) as usize].insert(s, sector);
    }
    parts
        .into_iter()
        .enumerate()
        .map(|(conn, part)| {
            std::thread::spawn(move || {
                write_until_killed(addr, conn as u64, round, span_bytes, part)
            })
        })
        .collect()
}

/// One connection's write stream until the connection dies: writes of 512 B to 32 KiB (half
/// of them 4 KiB-aligned whole blocks, the rest 512-byte aligned and often partial blocks)
/// inside this connection's 64 KiB regions of the first `span_bytes`, `QUEUE_DEPTH`
/// pipelined, some with FUA, an occasional FLUSH. Returns the log and the number of
/// acknowledged writes.
fn write_until_killed(
    addr: std::net::SocketAddr,
    conn: u64,
    round: u64,
    span_bytes: u64,
    mut log: HashMap<u64, Sector>,
) -> (HashMap<u64, Sector>, u64) {
    let mut c = NbdClient::ready(addr);
    let mut rng = Rng(0x5eed_0000 ^ (round << 8) ^ conn ^ 0xdead_beef_cafe);
    let regions = span_bytes / REGION;
    let mut in_flight = std::collections::VecDeque::new();
    let mut acked_writes = 0u64;
    let mut seq = 0u64;
    let mut payload = Vec::new();
    'stream: loop {
        while in_flight.len() < QUEUE_DEPTH {
            seq += 1;
            let cookie = seq;
            if rng.below(64) == 0 {
                if c.try_request(CMD_FLUSH, 0, cookie, 0, 0, &[]).is_err() {
                    break 'stream;
                }
                in_flight.push_back((cookie, 0, 0, 0));
                continue;
            }
            let region = (rng.below(regions / CONNS) * CONNS) + conn;
            let (offset_in_region, sectors) = if rng.below(2) == 0 {
                let blocks = 1 + rng.below(8);
                (rng.below(REGION / 4096 - blocks + 1) * 4096, blocks * 8)
            } else {
                let sectors = 1 + rng.below(24);
                (rng.below(REGION / SECTOR - sectors + 1) * SECTOR, sectors)
            };
            let first = (region * REGION + offset_in_region) / SECTOR;
            let stamp = (round << 48) | (conn << 40) | seq;
            payload.clear();
            for s in first..first + sectors {
                payload.extend_from_slice(&sector_bytes(s, stamp));
                log.entry(s).or_default().pending.push(stamp);
            }
            let flags = if rng.below(8) == 0 { CMD_FLAG_FUA } else { 0 };
            let len = (sectors * SECTOR) as u32;
            if c.try_request(CMD_WRITE, flags, cookie, first * SECTOR, len, &payload).is_err() {
                break 'stream;
            }
            in_flight.push_back((cookie, first, sectors, stamp));
        }
        let Ok((error, cookie)) = c.try_simple_reply() else { break };
        let (want, first, sectors, stamp) = in_flight.pop_front().expect("a request in flight");
        assert_eq!(cookie, want, "pmcache replies in order on a connection");
        if error != 0 || sectors == 0 {
            continue; // not acknowledged (stays pending), or a flush
        }
        acked_writes += 1;
        for s in first..first + sectors {
            let sector = log.get_mut(&s).expect("logged");
            sector.acked = stamp;
            sector.pending.retain(|&p| p > stamp);
        }
    }
    (log, acked_writes)
}

/// Reads every logged sector back and checks it holds an allowed stamp; then records what it
/// holds as acknowledged (reads after recovery must be stable, and the next round builds on
/// it).
fn verify(addr: std::net::SocketAddr, log: &mut HashMap<u64, Sector>, what: &str) {
    let mut c = NbdClient::ready(addr);
    let mut regions: Vec<u64> = log.keys().map(|s| s * SECTOR / REGION).collect();
    regions.sort_unstable();
    regions.dedup();
    let mut lost = Vec::new();
    let mut checked = 0u64;
    for region in regions {
        let data = c.read_at(region * REGION, REGION as u32);
        for (i, actual) in data.chunks(SECTOR as usize).enumerate() {
            let s = region * REGION / SECTOR + i as u64;
            let Some(sector) = log.get_mut(&s) else { continue };
            checked += 1;
            let found = std::iter::once(sector.acked)
                .chain(sector.pending.iter().copied())
                .find(|&stamp| actual == sector_bytes(s, stamp));
            match found {
                Some(stamp) => *sector = Sector { acked: stamp, pending: Vec::new() },
                None => lost.push(format!(
                    "sector {s} (byte {}): acknowledged stamp {:#x}, {} in flight, holds sector {} stamp {:#x}",
                    s * SECTOR,
                    sector.acked,
                    sector.pending.len(),
                    u64::from_le_bytes(actual[..8].try_into().expect("8")),
                    u64::from_le_bytes(actual[8..16].try_into().expect("8")),
                )),
            }
        }
    }
    assert!(
        lost.is_empty(),
        "{what}: {} of {checked} sectors lost an acknowledged write, e.g.:\n{}",
        lost.len(),
        lost[..lost.len().min(10)].join("\n")
    );
}

#[test]
fn kill_9_mid_stream_loses_no_acknowledged_write() {
    // 256 MiB backing store, writes over its first 96 MiB, through a 16 MiB cache: the cache
    // fills with dirty blocks within the first round and every later write forces write-back.
    let setup = Setup::new("kill9", 256 * MIB, 16 * MIB);
    let span_bytes = 96 * MIB;
    let mut log: HashMap<u64, Sector> = HashMap::new();
    let mut server = setup.serve(Via::Tcp, &["--mode", "writeback"]);
    for (round, delay_ms) in [(1u64, 900u64), (2, 600), (3, 1300)] {
        let clients = spawn_writers(server.addr(), round, span_bytes, &mut log);
        // At least `delay_ms`, and until the round wrote twice the cache's size.
        let stats = wait_written(&setup, 2 * setup.cache_bytes, Duration::from_millis(delay_ms));
        server.kill9();
        for client in clients {
            let (part, acked) = client.join().expect("client thread");
            assert!(acked > 200, "round {round}: only {acked} writes acknowledged before the kill");
            log.extend(part);
        }
        if round > 1 {
            assert!(
                stats["writebacks"].as_u64().unwrap_or(0) > 0,
                "round {round}: no write-back under cache pressure: {stats}"
            );
        }
        server = setup.serve(Via::Tcp, &["--mode", "writeback"]);
        let logs = server.logs();
        assert!(logs.contains("(unclean shutdown)"), "round {round}: not a recovery:\n{logs}");
        verify(server.addr(), &mut log, &format!("after kill -9 #{round}"));
    }
    // A clean stop, a healthy cache, then an offline detach: the backing file alone holds
    // every acknowledged write.
    server.terminate();
    let check = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success() && text.contains("last shutdown: clean"), "{text}");
    let detach = setup.pmcache(&[
        "detach",
        "--cache",
        &setup.cache_arg(),
        "--backing",
        &setup.backing_arg(),
    ]);
    assert!(detach.status.success(), "{}", String::from_utf8_lossy(&detach.stderr));
    let backing = read_file_at(&setup.backing, 0, span_bytes as usize);
    let mut wrong = 0;
    for (&s, sector) in &log {
        let at = (s * SECTOR) as usize;
        if backing[at..at + SECTOR as usize] != sector_bytes(s, sector.acked) {
            wrong += 1;
        }
    }
    assert_eq!(
        wrong,
        0,
        "{wrong} of {} sectors differ in the backing file after detach",
        log.len()
    );
}

/// fio: 2 jobs (2 connections) writing sequentially with crc32c verify headers at iodepth 16,
/// SIGKILL of the server, restart, and `verify_only` over the prefix both jobs had completed.
#[test]
fn kill_9_during_fio_write_keeps_completed_writes() {
    require_fio_nbd();
    let setup = Setup::new("kill9fio", 1024 * MIB, 16 * MIB);
    let server = setup.serve(Via::Unix, &["--mode", "writeback"]);
    let job = |size: &str| -> Vec<String> {
        [
            "--name=crash",
            "--ioengine=nbd",
            &format!("--uri={}", server_uri_unix(&setup)),
            "--rw=write",
            "--bs=4k",
            &format!("--size={size}"),
            "--numjobs=2",
            "--offset_increment=512m",
            "--iodepth=16",
            "--verify=crc32c",
            "--randrepeat=1",
            "--output-format=json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let mut writer = Command::new("fio");
    writer.args(job("512m")).arg("--do_verify=0").current_dir(setup.disk.path());
    let fio = std::thread::spawn(move || run(&mut writer, Duration::from_secs(120)));
    wait_written(&setup, 4 * setup.cache_bytes, Duration::from_millis(300));
    server.kill9();
    let out = fio.join().expect("fio thread");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "fio finished before the kill; make it write more:\n{text}");
    let v = fio_json(&text);
    let completed: Vec<u64> = v["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["write"]["io_bytes"].as_u64().expect("io_bytes"))
        .collect();
    let prefix = completed.iter().copied().min().expect("2 jobs") / 4096 * 4096;
    // The two jobs run at their own pace (one can have written twice the other's bytes), so
    // the bound is on what gets verified: both prefixes together must exceed the cache, so the
    // verified data cannot all still sit in the cache — part of it was written back and evicted.
    let verified_bytes = prefix * completed.len() as u64;
    assert!(
        verified_bytes > setup.cache_bytes,
        "too little written before the kill to outgrow the cache: {completed:?}"
    );

    let server = setup.serve(Via::Unix, &["--mode", "writeback"]);
    assert!(server.logs().contains("(unclean shutdown)"), "{}", server.logs());
    let mut verifier = Command::new("fio");
    verifier
        .args(job(&prefix.to_string()))
        .args(["--verify_only", "--verify_fatal=1"])
        .current_dir(setup.disk.path());
    let out = run(&mut verifier, Duration::from_secs(120));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio verify of the {prefix} bytes per job acknowledged before the kill failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for j in fio_json(&text)["jobs"].as_array().expect("jobs") {
        assert_eq!(j["error"], 0, "{j}");
        assert_eq!(j["read"]["io_bytes"].as_u64(), Some(prefix), "{j}");
    }
    server.terminate();
}

/// The NBD URI of a server on `setup`'s unix socket (stable across restarts).
fn server_uri_unix(setup: &Setup) -> String {
    format!("nbd+unix:///{EXPORT}?socket={}", setup.shm.path().join("nbd.sock").display())
}

/// Waits at least `min_wait` and until the running server has accepted `bytes` of writes
/// (at most 30 s); returns its statistics.
fn wait_written(setup: &Setup, bytes: u64, min_wait: Duration) -> serde_json::Value {
    let started = std::time::Instant::now();
    std::thread::sleep(min_wait);
    loop {
        let stats = setup.stats();
        if stats["bytes_written"].as_u64().unwrap_or(0) >= bytes {
            return stats;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "writes too slow: {stats}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `pmcache check` is run against the medium of a live server (monitoring does that) while it
/// takes writes, and the server is killed right after each check: every acknowledged write
/// must survive (a check must not change the medium under the server).
#[test]
fn check_on_a_live_cache_leaves_it_intact() {
    let setup = Setup::new("livecheck", 256 * MIB, 16 * MIB);
    let span_bytes = 96 * MIB;
    let mut log: HashMap<u64, Sector> = HashMap::new();
    let mut server = setup.serve(Via::Tcp, &["--mode", "writeback"]);
    for round in 1..=ROUNDS_LIVE_CHECK {
        let clients = spawn_writers(server.addr(), round, span_bytes, &mut log);
        wait_written(&setup, setup.cache_bytes, Duration::from_millis(100));
        let out = setup.pmcache(&["check", "--cache", &setup.cache_arg()]);
        server.kill9();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        for client in clients {
            log.extend(client.join().expect("client thread").0);
        }
        server = setup.serve(Via::Tcp, &["--mode", "writeback"]);
        verify(
            server.addr(),
            &mut log,
            &format!("after `pmcache check` on the live cache and kill -9 #{round}"),
        );
    }
    server.terminate();
}

const ROUNDS_LIVE_CHECK: u64 = 6;
