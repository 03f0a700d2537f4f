//! Servers opened inside a process through the library, as the benches and embedders open
//! them: served on a thread, stopped with a `StopHandle`, and gone when stopped — the medium's
//! lock let go (a second server of the same cache in the same process attaches it and finds
//! the first one's data), each server with its own read latencies.

use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pmcache_nbd::{ListenAddr, ServerConfig};
use pmcache_serve::{CacheConfig, ServeConfig, Silent, StopHandle};
use pmcache_testkit::{pseudo_random, qemu_io, read_file};

const TIMEOUT: Duration = Duration::from_secs(60);

struct Bed {
    shm: tempfile::TempDir,
    disk: tempfile::TempDir,
}

impl Bed {
    fn new() -> Bed {
        let bed = Bed {
            shm: tempfile::tempdir_in("/dev/shm").expect("shm dir"),
            disk: tempfile::tempdir().expect("disk dir"),
        };
        std::fs::File::create(bed.backing())
            .and_then(|f| f.set_len(32 << 20))
            .expect("backing file");
        bed
    }

    fn backing(&self) -> std::path::PathBuf {
        self.disk.path().join("backing.img")
    }

    fn socket(&self) -> std::path::PathBuf {
        self.shm.path().join("nbd.sock")
    }

    fn control(&self) -> std::path::PathBuf {
        self.shm.path().join("cache.ctl")
    }

    /// Serves the cache on a thread of this process until `stop`, once it listens.
    fn serve(&self, stop: &StopHandle) -> JoinHandle<Result<(), String>> {
        let thread = self.spawn(stop);
        let deadline = Instant::now() + TIMEOUT;
        while !(self.socket().exists() && self.control().exists()) {
            assert!(!thread.is_finished(), "the server ended before it listened");
            assert!(Instant::now() < deadline, "the server did not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        thread
    }

    /// Serves the cache on a thread of this process until `stop`.
    fn spawn(&self, stop: &StopHandle) -> JoinHandle<Result<(), String>> {
        let mut cache = CacheConfig::new(self.shm.path().join("cache.pm"), self.backing());
        cache.cache_size = Some(16 << 20);
        let mut config = ServeConfig::new(cache);
        config.control = Some(self.control());
        config.stop = stop.clone();
        let server = ServerConfig {
            listen: ListenAddr::Unix(self.socket()),
            export_name: "pm".into(),
            ..ServerConfig::default()
        };
        std::thread::spawn(move || pmcache_serve::nbd::serve(&config, server, Arc::new(Silent)))
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///pm?socket={}", self.socket().display())
    }
}

fn stats(control: &Path) -> serde_json::Value {
    let mut reply = String::new();
    pmcache_serve::control::request(control, "stats", |line| reply = line.to_owned())
        .expect("stats");
    serde_json::from_str(&reply).expect("stats JSON")
}

#[test]
fn a_server_stopped_in_process_lets_go_of_its_cache_for_the_next() {
    let bed = Bed::new();
    let data = pseudo_random(256 << 10, 7);
    let pattern = bed.shm.path().join("pattern");
    std::fs::write(&pattern, &data).expect("pattern");
    let stop = StopHandle::default();
    let first = bed.serve(&stop);
    let write = format!("write -s {} 1M 256k", pattern.display());
    qemu_io(&bed.uri(), &[write, "write -P 0x5a 8M 64k".into()], TIMEOUT);
    let read = "read -P 0 4M 64k".to_string();
    qemu_io(&bed.uri(), &[read.clone(), read], TIMEOUT);
    let served = stats(&bed.control());
    assert!(served["read_hit_latency_count"].as_u64().expect("hits") >= 1, "{served}");
    stop.stop();
    first.join().expect("the first server's thread").expect("the first server's stop");
    assert!(!bed.control().exists(), "the control socket outlived the server");
    // The stop wrote every dirty block back (the medium is volatile) ...
    let backing = read_file(&bed.backing());
    assert_eq!(&backing[1 << 20..(1 << 20) + data.len()], &data[..]);

    // ... and let go of the medium: a second server in this process attaches it (a leaked
    // engine would still hold its lock), with read latencies of its own.
    let stop = StopHandle::default();
    let second = bed.serve(&stop);
    let fresh = stats(&bed.control());
    assert_eq!(fresh["read_hit_latency_count"].as_u64(), Some(0), "latencies shared: {fresh}");
    let out = qemu_io(&bed.uri(), &["read -P 0x5a 8M 64k".into()], TIMEOUT);
    assert!(out.contains("read 65536/65536"), "{out}");
    let after = stats(&bed.control());
    assert!(after["read_hits"].as_u64().expect("hits") >= 1, "not served from the cache: {after}");
    stop.stop();
    second.join().expect("the second server's thread").expect("the second server's stop");
}

#[test]
fn a_stop_asked_before_the_frontend_runs_stops_it_when_it_does() {
    let bed = Bed::new();
    let stop = StopHandle::default();
    stop.stop();
    let server = bed.spawn(&stop);
    server.join().expect("the server's thread").expect("a clean stop");
    assert!(!bed.socket().exists() && !bed.control().exists());
}
