//! The `Medium` contract, checked on every implementation the engine runs on: the mapped file
//! (in `/dev/shm`, as pmcache emulates PM here), the crash-simulating medium, and both behind
//! an `Arc` (the engine's crash tests share one medium between an engine and the test). Then,
//! on the crash-simulating medium, *what becomes durable when*: each persisting method, line
//! by line, and the power switch's own bookkeeping. Every crash test of the engine trusts this
//! medium to model persistence exactly; these tests hold it to that on its own.

use std::sync::Arc;

use pmcache_media::{CrashMedium, CrashSwitch, Medium, PmemFile};

/// A medium of this many bytes: 3 pages (the mapped file's minimum), plus 8 bytes so that the
/// last cache line is a partial one on the crash-simulating medium.
const LEN: u64 = 3 * 4096 + 8;

fn filled(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i * 7) as u8)).collect()
}

fn read(m: &impl Medium, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    m.read(offset, &mut buf);
    buf
}

/// What every medium must show any thread at once, before any persistence: writes and word
/// stores are read back exactly, at every alignment, and touch nothing beside them.
fn visible_semantics(m: &impl Medium, len: u64) {
    assert_eq!(m.len_bytes(), len);
    assert_eq!(read(m, 0, len as usize), vec![0u8; len as usize], "a new medium is zeroed");

    // Byte writes: at 0, at odd offsets across words and lines, and up to the last byte.
    for (offset, n, seed) in [(0u64, 64usize, 1u8), (3, 130, 2), (61, 9, 3), (4096 + 5, 1, 4)] {
        let data = filled(n, seed);
        m.write(offset, &data);
        assert_eq!(read(m, offset, n), data, "write of {n} at {offset}");
    }
    let tail = filled(13, 5);
    m.write(len - 13, &tail);
    assert_eq!(read(m, len - 13, 13), tail);
    let mut empty = [0u8; 0];
    m.read(len, &mut empty);
    // A write leaves its neighbours alone.
    m.write(200, &[0xee; 5]);
    assert_eq!(read(m, 199, 7), [0, 0xee, 0xee, 0xee, 0xee, 0xee, 0]);

    // Words: the first, one in the middle, the last.
    for (offset, value) in [(0u64, 0x0102_0304_0506_0708u64), (1024, u64::MAX), (len - 8, 42)] {
        m.store_u64(offset, value);
        assert_eq!(m.load_u64(offset), value);
        assert_eq!(read(m, offset, 8), value.to_le_bytes(), "word {offset} in memory order");
    }

    // Pairs: both words, in place, neighbours untouched, with and without the flush.
    m.write(2048 - 8, &[0u8; 32]);
    m.store_pair(2048, 0x1111, 0x2222);
    assert_eq!((m.load_u64(2048), m.load_u64(2056)), (0x1111, 0x2222));
    assert_eq!((m.load_u64(2040), m.load_u64(2064)), (0, 0), "a pair spilled");
    m.store_pair_flush(2064, 0x3333, 0x4444);
    m.drain();
    assert_eq!((m.load_u64(2064), m.load_u64(2072)), (0x3333, 0x4444));
    assert_eq!(m.load_u64(2056), 0x2222);

    // The persisting forms write what they are given; prefetch changes nothing.
    let block = filled(4096, 6);
    m.write_flush(4096, &block);
    m.drain();
    assert_eq!(read(m, 4096, 4096), block);
    let odd = filled(100, 7);
    m.write_flush(8192 + 8, &odd);
    m.drain();
    assert_eq!(read(m, 8192 + 8, 100), odd);
    let persisted = filled(24, 8);
    m.write_persist(8192 + 200, &persisted);
    assert_eq!(read(m, 8192 + 200, 24), persisted);
    let before = read(m, 0, len as usize);
    m.prefetch(4096, 4096);
    m.persist(0, len);
    m.flush(100, 0);
    assert_eq!(read(m, 0, len as usize), before, "prefetch or persist changed the contents");
}

fn crash_medium(len: u64) -> CrashMedium {
    CrashMedium::new(len, CrashSwitch::new(), 7)
}

#[test]
fn the_crash_medium_keeps_the_contract() {
    visible_semantics(&crash_medium(LEN), LEN);
    visible_semantics(&Arc::new(crash_medium(LEN)), LEN);
}

#[test]
fn the_mapped_file_keeps_the_contract() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
    let medium = PmemFile::open(&dir.path().join("a"), Some(LEN)).expect("medium");
    visible_semantics(&medium, LEN);
    let medium = PmemFile::open(&dir.path().join("b"), Some(LEN)).expect("medium");
    visible_semantics(&Arc::new(medium), LEN);
}

/// The word at byte `offset` of the durable image.
fn durable(m: &CrashMedium, offset: u64) -> u64 {
    m.durable_image()[offset as usize / 8]
}

/// Each persisting method on the crash-simulating medium, directly and through an `Arc`: its
/// words become durable at the drain (or within the call for the `persist` forms), not
/// before, and a drain makes nothing durable that was not flushed.
#[test]
fn each_persisting_method_makes_its_words_durable_at_the_drain() {
    fn check(m: &CrashMedium, via: &impl Medium) {
        // store_u64 + flush + drain.
        via.store_u64(64, 1);
        via.flush(64, 8);
        assert_eq!(durable(m, 64), 0, "durable before the drain");
        via.drain();
        assert_eq!(durable(m, 64), 1);
        // A store never flushed stays volatile through a drain.
        via.store_u64(128, 2);
        via.drain();
        assert_eq!(durable(m, 128), 0, "a drain made an unflushed word durable");
        assert_eq!(m.durable_image().len() as u64, m.len_bytes() / 8);
        // persist.
        via.persist(128, 8);
        assert_eq!(durable(m, 128), 2);
        // write_flush: every word of the range.
        let data = filled(256, 9);
        via.write_flush(1024, &data);
        assert_eq!(durable(m, 1024), 0);
        via.drain();
        let image: Vec<u8> =
            m.durable_image()[128..160].iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(image, data);
        // write_persist.
        via.write_persist(2048, &[3; 8]);
        assert_eq!(durable(m, 2048), u64::from_le_bytes([3; 8]));
        // store_pair: not durable by itself; store_pair_flush: both words at the drain.
        via.store_pair(4096, 4, 5);
        via.drain();
        assert_eq!((durable(m, 4096), durable(m, 4104)), (0, 0));
        via.store_pair_flush(4096 + 16, 6, 7);
        assert_eq!(durable(m, 4096 + 16), 0);
        via.drain();
        assert_eq!((durable(m, 4096 + 16), durable(m, 4096 + 24)), (6, 7));
        // The lines a flush covers: every line the range touches, and whole lines (the pair
        // stored above shares the pair-flushed line, so it is durable now too).
        assert_eq!((durable(m, 4096), durable(m, 4104)), (4, 5));
        via.store_u64(8192 + 56, 8);
        via.store_u64(8192 + 64, 9);
        via.store_u64(8192 + 128, 10);
        via.flush(8192 + 56, 8); // the last word of a line: that line alone
        via.drain();
        assert_eq!(durable(m, 8192 + 56), 8);
        assert_eq!(durable(m, 8192 + 64), 0, "a flush went past its last line");
        via.flush(8192 + 60, 8); // bytes 60..68: the ends of two lines
        via.drain();
        assert_eq!(durable(m, 8192 + 64), 9);
        assert_eq!(durable(m, 8192 + 128), 0, "a flush went past its last line");
        // The medium's last, partial line (one word).
        via.store_u64(m.len_bytes() - 8, 11);
        via.persist(m.len_bytes() - 8, 8);
        assert_eq!(durable(m, m.len_bytes() - 8), 11);
    }
    let m = crash_medium(LEN);
    check(&m, &m);
    let m = crash_medium(LEN);
    check(&m, &Arc::new(m.clone()));
}

/// The power switch counts each drain as a persist point; cutting power (armed or at once)
/// captures the image of that instant, and nothing becomes durable afterwards.
#[test]
fn the_switch_counts_persist_points_and_a_cut_freezes_the_medium() {
    let switch = CrashSwitch::new();
    let m = CrashMedium::new(LEN, switch.clone(), 9);
    assert_eq!(switch.points(), 0);
    for i in 1..=3u64 {
        m.store_u64(8 * i, i);
        m.persist(8 * i, 8);
        assert_eq!(switch.points(), i);
    }
    assert!(format!("{switch:?}").contains("points: 3"), "{switch:?}");
    assert!(format!("{m:?}").contains(&format!("len_bytes: {LEN}")), "{m:?}");
    assert!(!switch.has_crashed() && m.crash_image().is_none());
    switch.cut_now();
    assert!(switch.has_crashed());
    let image = m.crash_image().expect("the cut captured an image");
    assert_eq!(image[1..4], [1, 2, 3], "a persisted word was lost");
    m.store_u64(64, 4);
    m.persist(64, 8);
    assert_eq!(durable(&m, 64), 0, "a persist after the cut became durable");
    assert_eq!(m.crash_image(), Some(image), "the image changed after the cut");
    assert!(format!("{switch:?}").contains("crashed: true"), "{switch:?}");
}
