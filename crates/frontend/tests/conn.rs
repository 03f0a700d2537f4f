//! `CacheConn` served as each frontend serves it: through a ublk queue's dispatcher and as an
//! NBD connection, over a cache on a temporary medium.

use std::sync::Arc;

use pmcache_backing::PsyncFile;
use pmcache_block::{BatchRead, BlockConn};
use pmcache_engine::{Config, Engine, MonotonicClock};

use pmcache_frontend::{Backing, CacheConn, CacheEngine, ReadLatencies};
use pmcache_media::{MediumOptions, MediumSet, MediumSync, PmemFile, Window};
use pmcache_ublk::mapping::{UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ, UBLK_IO_OP_WRITE};
use pmcache_ublk::{Dispatcher, Geometry, IoDesc};

const CACHE_BYTES: u64 = 8 << 20;
const BACKING_BYTES: u64 = 4 << 20;
const BLOCK: usize = 4096;

/// A write-back cache over a psync backing file, both in a directory that lives as long as
/// the engine is used. The medium is on tmpfs where there is one, else synced with msync.
fn engine() -> (tempfile::TempDir, CacheEngine) {
    let shm = std::path::Path::new("/dev/shm");
    let (tmp, sync) = if shm.is_dir() {
        (tempfile::tempdir_in(shm).expect("tempdir"), MediumSync::Auto)
    } else {
        (tempfile::tempdir().expect("tempdir"), MediumSync::Msync)
    };
    let options = MediumOptions { create_len_bytes: Some(CACHE_BYTES), sync };
    let medium = PmemFile::open_with(&tmp.path().join("medium"), &options).expect("medium");
    let backing_path = tmp.path().join("backing");
    std::fs::File::create(&backing_path)
        .and_then(|f| f.set_len(BACKING_BYTES))
        .expect("backing file");
    let backing: Backing = Arc::new(PsyncFile::open(&backing_path).expect("backing"));
    let config = Config { max_lanes: 4, ..Config::default() };
    let engine = Engine::format(
        MediumSet::single(Window::whole(Arc::new(medium))),
        backing,
        MonotonicClock::default(),
        &config,
    )
    .expect("format");
    (tmp, engine)
}

fn stat(latencies: &ReadLatencies, name: &str) -> u64 {
    latencies.stats().into_iter().find(|(n, _)| n == name).map_or(0, |(_, v)| v)
}

#[test]
fn a_ublk_queue_writes_then_reads_through_the_lane() {
    let (_tmp, engine) = engine();
    let latencies = Arc::new(ReadLatencies::default());
    let mut conn = CacheConn::new(engine.lane().expect("lane"), latencies.clone());
    let geometry = Geometry {
        size_bytes: engine.size_bytes(),
        logical_block_bytes: BLOCK as u32,
        max_io_bytes: BLOCK as u32,
    };
    let mut dispatcher = Dispatcher::new(geometry, 4);
    let mut bufs = vec![vec![0u8; BLOCK]; 4];
    let sectors = (BLOCK / 512) as u32;
    // Two writes and a flush received together.
    bufs[0].fill(0x11);
    bufs[1].fill(0x22);
    dispatcher.receive(0, &IoDesc::new(UBLK_IO_OP_WRITE, 0, 0, sectors));
    dispatcher.receive(1, &IoDesc::new(UBLK_IO_OP_WRITE, 0, u64::from(sectors), sectors));
    dispatcher.receive(2, &IoDesc::new(UBLK_IO_OP_FLUSH, 0, 0, 0));
    dispatcher.dispatch(&mut conn, &mut bufs);
    let mut done: Vec<(u16, i32)> = dispatcher.completions().collect();
    done.sort_unstable();
    assert_eq!(done, [(0, BLOCK as i32), (1, BLOCK as i32), (2, 0)]);
    // Both blocks read back together (hits), into other tags.
    let hits_before = stat(&latencies, "read_hit_latency_count");
    dispatcher.receive(2, &IoDesc::new(UBLK_IO_OP_READ, 0, 0, sectors));
    dispatcher.receive(3, &IoDesc::new(UBLK_IO_OP_READ, 0, u64::from(sectors), sectors));
    dispatcher.dispatch(&mut conn, &mut bufs);
    let mut done: Vec<(u16, i32)> = dispatcher.completions().collect();
    done.sort_unstable();
    assert_eq!(done, [(2, BLOCK as i32), (3, BLOCK as i32)]);
    assert!(bufs[2].iter().all(|&b| b == 0x11));
    assert!(bufs[3].iter().all(|&b| b == 0x22));
    // The lane is the engine's, for calls beside the frontend's.
    let mut direct = vec![0u8; BLOCK];
    conn.lane().read(BLOCK as u64, &mut direct).expect("direct read");
    assert_eq!(direct, bufs[3]);
    // A connection's latencies reach the server's when it ends.
    drop(conn);
    assert!(stat(&latencies, "read_hit_latency_count") >= hits_before + 2);
}

#[test]
fn an_nbd_connection_writes_reads_and_reports_errors_as_errnos() {
    let (_tmp, engine) = engine();
    let mut conn = CacheConn::new(engine.lane().expect("lane"), Default::default());
    let data = vec![0x5au8; BLOCK];
    BlockConn::write(&mut conn, 2 * BLOCK as u64, &data, true).expect("write");
    let (mut a, mut b) = (vec![0u8; BLOCK], vec![0xffu8; BLOCK]);
    let mut reads = [
        BatchRead { offset_bytes: 2 * BLOCK as u64, buf: &mut a },
        BatchRead { offset_bytes: 3 * BLOCK as u64, buf: &mut b },
    ];
    let mut outcomes = Vec::new();
    BlockConn::read_batch(&mut conn, &mut reads, &mut outcomes);
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(a, data);
    // Never written: the backing file's zeroes.
    assert!(b.iter().all(|&x| x == 0));
    BlockConn::flush(&mut conn).expect("flush");
    // Past the end: refused with an errno, not a panic.
    let err = BlockConn::read(&mut conn, BACKING_BYTES, &mut a).expect_err("out of range");
    assert_ne!(err.errno(), 0);
}
