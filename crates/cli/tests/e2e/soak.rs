//! A soak of the hardened server: 16 fio connections writing and verifying (crc32c) while a
//! raw client stops reading in the middle of its replies and another sends TRIM and
//! WRITE_ZEROES requests of nearly 4 GiB, for a bounded time on loopback. Every verify passes,
//! the stalled client is dropped at the write timeout, the oversized requests are answered
//! with bounded work, and the server's own memory stays bounded.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pmcache_nbd::codec::{CMD_READ, CMD_TRIM, CMD_WRITE_ZEROES};

use crate::common::*;

const GIB: u64 = 1 << 30;
/// The largest aligned length an NBD request carries: 4 GiB less 512 bytes.
const HUGE_LEN_BYTES: u32 = u32::MAX - 511;

/// Anonymous (heap and stack) resident memory of a process, in KiB: what the server itself
/// holds, without the cache medium it maps from /dev/shm.
fn rss_anon_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("RssAnon in /proc/<pid>/status")
}

#[test]
fn sixteen_verifying_clients_beside_a_stalled_one_and_oversized_trims() {
    require_fio_nbd();
    // fio's 16 regions fill the first GiB; the oversized requests cover the 4 GiB after it.
    let setup = Setup::new("soak", 5 * GIB + 512 * MIB, 64 * MIB);
    let server = setup.serve(Via::Tcp, &["--max-connections", "20", "--write-timeout", "2"]);
    let addr = server.addr();
    let pid = server.pid();

    // The stalled client: 128 MiB of reads it never takes off the socket.
    let mut stalled = NbdClient::ready(addr);
    for cookie in 0..4u64 {
        stalled.request(CMD_READ, 0, cookie, cookie * 32 * MIB, 32 << 20, &[]);
    }

    // The client sending TRIM and WRITE_ZEROES of nearly 4 GiB until fio is done.
    let done = Arc::new(AtomicBool::new(false));
    let oversized = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut c = NbdClient::ready(addr);
            c.stream.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
            let mut answered = Vec::new();
            let mut cookie = 100u64;
            while !done.load(Ordering::SeqCst) || answered.len() < 4 {
                let command = if cookie.is_multiple_of(2) { CMD_TRIM } else { CMD_WRITE_ZEROES };
                let started = Instant::now();
                c.request(command, 0, cookie, GIB, HUGE_LEN_BYTES, &[]);
                let reply = c.simple_reply();
                answered.push((command, reply, started.elapsed()));
                cookie += 1;
            }
            answered
        })
    };

    let rss_before_kib = rss_anon_kib(pid);
    let mut fio = Command::new("fio");
    fio.args([
        "--name=soak",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri),
        "--rw=randwrite",
        "--bs=4k",
        "--size=24m",
        "--numjobs=16",
        "--offset_increment=64m",
        "--iodepth=8",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--verify_state_save=0",
        "--output-format=json",
    ])
    .current_dir(setup.disk.path());
    let fio_run = std::thread::spawn(move || run_ok(&mut fio, Duration::from_secs(300)));
    let mut rss_peak_kib = rss_before_kib;
    while !fio_run.is_finished() {
        rss_peak_kib = rss_peak_kib.max(rss_anon_kib(pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = fio_run.join().expect("fio thread");
    done.store(true, Ordering::SeqCst);
    let answered = oversized.join().expect("oversized client");

    let v = fio_json(&out);
    let jobs = v["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 16, "{v}");
    for j in jobs {
        assert_eq!(j["error"], 0, "{j}");
        assert!(j["read"]["io_bytes"].as_u64().unwrap_or(0) >= 24 * MIB, "verify reads: {j}");
    }
    for (command, (error, _), took) in &answered {
        assert_eq!(*error, 0, "command {command} failed");
        assert!(*took < Duration::from_secs(60), "command {command} took {took:?}");
    }
    let stats = setup.stats();
    assert_eq!(stats["connections_dropped_write_timeout"], 1, "{stats}");
    // The oversized WRITE_ZEROES wrote no dirty block per block of their 4 GiB (each would
    // be a million blocks to clean); fio wrote 98,304 blocks in all.
    let cleaned = stats["cleaner_blocks_cleaned"].as_u64().expect("cleaner_blocks_cleaned");
    let inline = stats["writebacks"].as_u64().unwrap_or(0);
    assert!(cleaned + inline < 500_000, "{stats}");
    let logs = server.logs();
    assert!(logs.contains("did not read its replies in time"), "{logs}");
    // 16 busy connections, a stalled one with its replies queued: bounded by the per
    // connection buffers (a 32 MiB payload buffer and its reply buffer at most), not by what
    // the clients sent.
    eprintln!("server RssAnon: {rss_before_kib} KiB before, {rss_peak_kib} KiB at peak");
    assert!(rss_peak_kib < 512 * 1024, "RssAnon peaked at {rss_peak_kib} KiB");
    drop(stalled);
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean"), "{logs}");
}
