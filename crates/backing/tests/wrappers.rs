//! Tests of the latency, throttle and fault-injection wrappers, over a psync file in /dev/shm.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pmcache_backing::wrappers::{FaultStore, LatencyDist, LatencyStore, OpMask, ThrottleStore};
use pmcache_backing::{
    BackingError, BackingStore, IoBuf, IoQueue, IoRequest, PsyncFile, SyncQueue,
};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn shm_file(bytes: u64) -> (tempfile::NamedTempFile, PsyncFile) {
    let dir = std::env::var("PMCACHE_TEST_SHM_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let file = tempfile::NamedTempFile::new_in(dir).expect("scratch file");
    file.as_file().set_len(bytes).expect("size");
    let store = PsyncFile::open(file.path()).expect("open");
    (file, store)
}

#[test]
fn nth_io_fails_once_with_the_errno_and_leaves_data_alone() {
    let (_f, store) = shm_file(1 << 20);
    let store = FaultStore::new(store, 1).fail_nth(OpMask::WRITE, 3, libc::EIO);
    for i in 0..5u8 {
        let result = store.write_at(&[i + 1; 4096], u64::from(i) * 4096);
        if i == 2 {
            let err = result.unwrap_err();
            assert_eq!(err.errno(), libc::EIO);
            assert!(matches!(err, BackingError::Io { op: "write", offset: 8192, .. }), "{err:?}");
        } else {
            result.expect("other writes succeed");
        }
    }
    assert_eq!(store.injected(), 1);
    let mut back = [0u8; 4096];
    store.read_at(&mut back, 8192).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the failed write must not reach the store");
    store.read_at(&mut back, 12288).unwrap();
    assert!(back.iter().all(|&b| b == 4));
}

#[test]
fn range_faults_hit_only_overlapping_requests() {
    let (_f, store) = shm_file(1 << 20);
    let store = FaultStore::new(store, 1).fail_range(OpMask::READ, 8192, 12288, libc::ENODATA);
    let mut buf = [0u8; 4096];
    store.read_at(&mut buf, 4096).expect("before the range");
    store.read_at(&mut buf, 12288).expect("after the range");
    assert_eq!(store.read_at(&mut buf, 8192).unwrap_err().errno(), libc::ENODATA);
    assert_eq!(store.read_at(&mut [0u8; 2], 12287).unwrap_err().errno(), libc::ENODATA);
    store.write_at(&buf, 8192).expect("writes are not in the mask");
    assert_eq!(store.injected(), 2);
}

#[test]
fn probability_faults_are_seeded_and_roughly_that_often() {
    let (_f, store) = shm_file(1 << 20);
    let store = Arc::new(store);
    let run = |seed: u64| -> Vec<bool> {
        let faulty =
            FaultStore::new(store.clone(), seed).fail_probability(OpMask::READ, 0.25, libc::EIO);
        (0..1000).map(|i| faulty.read_at(&mut [0u8; 512], (i % 64) * 512).is_err()).collect()
    };
    let a = run(7);
    let failures = a.iter().filter(|&&e| e).count();
    assert!((180..=320).contains(&failures), "{failures} failures of 1000 at p=0.25");
    assert_eq!(a, run(7), "the same seed replays the same faults");
    assert_ne!(a, run(8));
    let never = FaultStore::new(store.clone(), 1).fail_probability(OpMask::ALL, 0.0, libc::EIO);
    assert!((0..100).all(|_| never.read_at(&mut [0u8; 512], 0).is_ok()));
}

#[test]
fn short_transfers_tear_writes_and_report_reads() {
    let (_f, store) = shm_file(1 << 20);
    let store =
        FaultStore::new(store, 1).short_nth(OpMask::WRITE, 1, 4096).short_nth(OpMask::READ, 2, 100);
    match store.write_at(&[0xEE; 8192], 0) {
        Err(BackingError::ShortWrite { offset: 0, len: 8192, got: 4096 }) => {}
        other => panic!("expected a torn write, got {other:?}"),
    }
    let mut back = vec![0u8; 8192];
    store.read_at(&mut back, 0).expect("first read is whole");
    assert!(back[..4096].iter().all(|&b| b == 0xEE), "the torn prefix is on the store");
    assert!(back[4096..].iter().all(|&b| b == 0), "the rest is not");
    let mut back = vec![0u8; 8192];
    match store.read_at(&mut back, 0) {
        Err(e @ BackingError::ShortRead { got: 100, .. }) => assert_eq!(e.errno(), libc::EIO),
        other => panic!("expected a short read, got {other:?}"),
    }
    assert!(back[..100].iter().all(|&b| b == 0xEE) && back[100..].iter().all(|&b| b == 0));
}

#[test]
fn faults_reach_queued_completions_through_a_sync_queue() {
    let (_f, store) = shm_file(1 << 20);
    let store: Arc<dyn BackingStore> =
        Arc::new(FaultStore::new(store, 1).fail_nth(OpMask::READ, 2, libc::EIO).fail_nth(
            OpMask::FLUSH,
            1,
            libc::EIO,
        ));
    assert!(store.open_queue(4).is_err(), "wrappers have no native queue");
    let mut queue = SyncQueue::new(store, 4);
    for i in 0..3 {
        queue.push(IoRequest::read(i * 4096, IoBuf::new(4096), i)).unwrap();
    }
    queue.push(IoRequest::flush(9)).unwrap();
    assert!(queue.push(IoRequest::flush(10)).is_err(), "depth 4");
    let mut out = Vec::new();
    queue.reap(4, &mut out).unwrap();
    let failed: Vec<u64> = out.iter().filter(|c| c.result.is_err()).map(|c| c.user_data).collect();
    assert_eq!(failed, vec![1, 9]);
}

#[test]
fn fixed_latency_pads_every_request() {
    let (_f, store) = shm_file(1 << 20);
    let store = LatencyStore::new(store, LatencyDist::Fixed(Duration::from_millis(3)), 1);
    let start = Instant::now();
    for i in 0..10 {
        store.read_at(&mut [0u8; 4096], i * 4096).unwrap();
    }
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(30), "10 x 3 ms took {elapsed:?}");
    assert!(elapsed < Duration::from_millis(300), "10 x 3 ms took {elapsed:?}");
    assert!(store.injected_ns_total() >= 25_000_000);
    let start = Instant::now();
    store.flush().unwrap();
    assert!(start.elapsed() < Duration::from_millis(3), "flush is not in the default mask");
}

#[test]
fn latency_distributions_stay_in_their_bounds() {
    let mut rng = SmallRng::seed_from_u64(3);
    let hdd = LatencyDist::hdd();
    for _ in 0..1000 {
        let d = hdd.sample(&mut rng);
        assert!(d >= Duration::from_millis(2) && d <= Duration::from_millis(14), "{d:?}");
    }
    let exp = LatencyDist::Exponential {
        min: Duration::from_micros(50),
        mean_extra: Duration::from_micros(100),
    };
    let samples: Vec<Duration> = (0..20_000).map(|_| exp.sample(&mut rng)).collect();
    assert!(samples.iter().all(|&d| d >= Duration::from_micros(50)));
    let mean_us = samples.iter().map(|d| d.as_secs_f64() * 1e6).sum::<f64>() / samples.len() as f64;
    assert!((140.0..160.0).contains(&mean_us), "exponential mean {mean_us} µs, expected ~150");
    // A wrapped store really takes at least the sampled latency (SATA SSD: >= 90 µs).
    let (_f, store) = shm_file(1 << 20);
    let store = LatencyStore::new(store, LatencyDist::sata_ssd(), 2);
    for _ in 0..20 {
        let start = Instant::now();
        store.read_at(&mut [0u8; 4096], 0).unwrap();
        assert!(start.elapsed() >= Duration::from_micros(90));
    }
}

#[test]
fn throttle_holds_iops_and_bandwidth() {
    let (_f, store) = shm_file(4 << 20);
    let store = Arc::new(ThrottleStore::new(store, Some(1000), None));
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let store = store.clone();
            s.spawn(move || {
                for i in 0..25 {
                    store.read_at(&mut [0u8; 512], (t * 25 + i) * 512).unwrap();
                }
            });
        }
    });
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(49), "50 I/Os at 1000 IOPS took {elapsed:?}");
    assert!(elapsed < Duration::from_millis(500), "50 I/Os at 1000 IOPS took {elapsed:?}");

    let (_f, store) = shm_file(4 << 20);
    let store = ThrottleStore::new(store, None, Some(4 << 20));
    let start = Instant::now();
    for i in 0..8 {
        store.write_at(&vec![1u8; 64 << 10], i * (64 << 10)).unwrap();
    }
    // 8 x 64 KiB at 4 MiB/s: the 8th starts 7 x 15.6 ms after the first.
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(109), "512 KiB at 4 MiB/s took {elapsed:?}");
}

/// The latency wrapper's queue keeps requests in flight together, each for its own latency:
/// nothing is ready before it, the completion descriptor polls readable when it has passed,
/// and eight reads of 40 ms finish in about 40 ms, not 320.
#[test]
fn latency_queue_overlaps_requests_and_signals_their_completion() {
    use rustix::event::{PollFd, PollFlags, poll};
    let (_file, store) = shm_file(1 << 20);
    store.write_at(&[7u8; 4096], 8192).expect("write");
    let store = LatencyStore::new(store, LatencyDist::Fixed(Duration::from_millis(40)), 3);
    let mut queue = store.open_queue(8).expect("queue");
    let began = Instant::now();
    for i in 0..8u64 {
        let req = IoRequest::read(8192, IoBuf::new(4096), i);
        assert!(queue.push(req).is_ok(), "room for read {i}");
    }
    queue.submit().expect("submit");
    let mut done = Vec::new();
    assert_eq!(queue.reap(0, &mut done).expect("poll"), 0, "ready before its latency");
    let fd = queue.completion_fd().expect("a completion descriptor");
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    poll(&mut fds, None).expect("poll");
    let signalled = began.elapsed();
    assert!(signalled >= Duration::from_millis(39), "signalled after {signalled:?}");
    assert_eq!(queue.reap(8, &mut done).expect("reap"), 8);
    let took = began.elapsed();
    assert!(took < Duration::from_millis(200), "eight reads took {took:?}: not overlapped");
    assert!(done.iter().all(|c| c.result.is_ok() && c.buf[..] == [7u8; 4096]));
}
