//! Two caches, two hosts, one RBD image (two `RbdImage`s in this process, each a host): which
//! cache holds dirty blocks is recorded on the image, a second cache is refused while another
//! holds them unless the operator takes the image over, the cache taken over is refused when it
//! comes back, and a host whose lock was broken writes nothing more. On a throwaway
//! single-host cluster (scripts/ceph/cluster.sh), one image per case.

use pmcache_backing::rbd::claim::{HOLDER_KEY, SUPERSEDED_KEY, uuid_text};
use pmcache_backing::{BackingError, BackingStore, IoBuf, IoRequest, RbdImage};
use pmcache_testkit::ceph::Cluster;

const BLOCK: usize = 4096;
const CACHE_A: [u8; 16] = [0xa; 16];
const CACHE_B: [u8; 16] = [0xb; 16];

fn block(fill: u8) -> Vec<u8> {
    vec![fill; BLOCK]
}

/// The image's blocks 0 and 1 as a client without a lock reads them.
fn blocks_0_and_1(cluster: &Cluster, name: &str) -> (Vec<u8>, Vec<u8>) {
    let image = RbdImage::open_with(&cluster.spec(name, &[]), true).expect("open read-only");
    let (mut b0, mut b1) = (block(0), block(0));
    image.read_at(&mut b0, 0).expect("read block 0");
    image.read_at(&mut b1, BLOCK as u64).expect("read block 1");
    (b0, b1)
}

/// A write through the store's queue (the cleaner's path); its result.
fn queued_write(store: &RbdImage, fill: u8, offset: u64) -> Result<(), BackingError> {
    let mut queue = store.open_queue(4).expect("open a queue");
    let mut buf = IoBuf::new(BLOCK);
    buf.fill(fill);
    queue.push(IoRequest::write(offset, buf, 7)).expect("room");
    let mut done = Vec::new();
    queue.reap(1, &mut done).expect("reap");
    assert_eq!(done.len(), 1);
    done.pop().expect("one completion").result
}

#[test]
fn two_hosts_one_image() {
    let cluster = Cluster::start();
    a_dead_holder_is_taken_over_and_refused_when_it_comes_back(&cluster);
    a_holder_whose_lock_was_broken_writes_nothing_more(&cluster);
}

/// Host A attached with dirty blocks and died; B is refused, then takes the image over (the
/// `takeover=1` override), writes and detaches; A, started again on its own cache, is refused
/// and writes nothing: the image keeps B's data.
fn a_dead_holder_is_taken_over_and_refused_when_it_comes_back(cluster: &Cluster) {
    let name = "dead-holder";
    cluster.create_image(name, "16M");
    let spec = cluster.spec(name, &[]);

    // A fresh image records nothing: writes are not held back, and a claim records A.
    let a = RbdImage::open(&spec).expect("A opens");
    a.write_at(&block(0xa0), 0).expect("A writes before its claim: nothing recorded");
    a.claim(CACHE_A, false).expect("A claims");
    let holder = cluster.image_meta(name, HOLDER_KEY).expect("A recorded as the holder");
    assert!(holder.starts_with(&format!("{} host=", uuid_text(CACHE_A))), "{holder}");
    a.write_at(&block(0xa1), 0).expect("A writes back");
    a.flush().expect("A flushes");
    // A dies holding dirty blocks: no disclaim, no release (the lock goes with the client).
    drop(a);
    assert!(cluster.image_meta(name, HOLDER_KEY).is_some(), "a crash keeps the record");

    // A's own cache attaching again is its recovery: not refused.
    let a = RbdImage::open(&spec).expect("A opens again");
    match a.write_at(&block(0xa2), 0) {
        Err(BackingError::Unclaimed { op: "write", record, .. }) => {
            assert!(record.contains(&uuid_text(CACHE_A)), "{record}")
        }
        other => panic!("a write before the claim on a recorded image: {other:?}"),
    }
    a.claim(CACHE_A, false).expect("the same cache claims again");
    a.write_at(&block(0xa2), 0).expect("A writes after its claim");
    drop(a);

    // B: refused while A's record stands, naming A and the override.
    let b = RbdImage::open(&spec).expect("B opens (the lock is free)");
    let err = b.claim(CACHE_B, false).expect_err("B is refused while A holds dirty blocks");
    assert!(matches!(err, BackingError::HeldByAnother { .. }), "{err:?}");
    let shown = err.to_string();
    assert!(shown.contains(&uuid_text(CACHE_A)) && shown.contains("takeover=1"), "{shown}");
    assert_eq!(err.errno(), libc::EBUSY);
    let refused = b.write_at(&block(0xb0), 0).expect_err("B writes nothing unclaimed");
    assert!(matches!(refused, BackingError::Unclaimed { .. }), "{refused:?}");
    assert!(matches!(queued_write(&b, 0xb0, 0), Err(BackingError::Unclaimed { op: "write", .. })));
    drop(b);
    assert_eq!(blocks_0_and_1(cluster, name), (block(0xa2), block(0)), "B wrote nothing");

    // B with the override in its spec takes the image over, writes, and detaches clean.
    let b = RbdImage::open(&cluster.spec(name, &["takeover=1"])).expect("B opens, takeover=1");
    b.claim(CACHE_B, false).expect("B takes the image over");
    let superseded = cluster.image_meta(name, SUPERSEDED_KEY).expect("A recorded taken over");
    assert!(
        superseded.starts_with(&format!("{} by {} host=", uuid_text(CACHE_A), uuid_text(CACHE_B))),
        "{superseded}"
    );
    b.write_at(&block(0xb1), 0).expect("B writes");
    queued_write(&b, 0xb2, BLOCK as u64).expect("B writes through its queue");
    b.flush().expect("B flushes");
    b.disclaim().expect("B holds no dirty block any more");
    b.release().expect("B detaches");
    assert_eq!(cluster.image_meta(name, HOLDER_KEY), None, "a disclaim removes the record");
    drop(b);

    // A comes back on its own cache: refused, even with the override, and writes nothing.
    let a = RbdImage::open(&cluster.spec(name, &["takeover=1"])).expect("A opens");
    for attempt in [a.write_at(&block(0xa3), 0), a.discard(0, BLOCK as u64)] {
        assert!(matches!(attempt, Err(BackingError::Unclaimed { .. })), "{attempt:?}");
    }
    let err = a.claim(CACHE_A, false).expect_err("the cache taken over is refused");
    let shown = err.to_string();
    assert!(
        matches!(&err, BackingError::TakenOver { cache, .. } if *cache == uuid_text(CACHE_A)),
        "{err:?}"
    );
    assert!(
        shown.contains(&uuid_text(CACHE_B))
            && shown.contains("older")
            && shown.contains("rbd image-meta remove rbd/dead-holder pmcache.superseded"),
        "{shown}"
    );
    assert_eq!(err.errno(), libc::ESTALE);
    assert!(matches!(a.write_at(&block(0xa3), 0), Err(BackingError::Unclaimed { .. })));
    assert!(matches!(
        queued_write(&a, 0xa3, BLOCK as u64),
        Err(BackingError::Unclaimed { op: "write", .. })
    ));
    drop(a);
    assert_eq!(blocks_0_and_1(cluster, name), (block(0xb1), block(0xb2)), "B's data stays");

    // A cache formatted anew (another uuid) attaches: the record of A does not stand in its way.
    let c = RbdImage::open(&spec).expect("C opens");
    c.claim([0xc; 16], false).expect("a new cache claims an image nobody holds");
    c.write_at(&block(0xc1), 0).expect("C writes");
}

/// Host A alive and attached; an operator breaks its lock (`rbd lock rm`: A is blocklisted)
/// and B takes the image over and writes; A's next write-back fails with the lock-lost error,
/// and so does everything A writes after it; the image keeps B's data.
fn a_holder_whose_lock_was_broken_writes_nothing_more(cluster: &Cluster) {
    let name = "broken-lock";
    cluster.create_image(name, "16M");
    let spec = cluster.spec(name, &[]);
    let a = RbdImage::open(&spec).expect("A opens");
    a.claim(CACHE_A, false).expect("A claims");
    a.write_at(&block(0xa1), 0).expect("A writes back");
    a.flush().expect("A flushes");
    let refused = RbdImage::open(&spec).err().expect("B is refused while A holds the lock");
    assert!(matches!(refused, BackingError::Locked { .. }), "{refused:?}");

    cluster.break_lock(name);
    let b = RbdImage::open(&spec).expect("B opens once A's lock is broken");
    let err = b.claim(CACHE_B, false).expect_err("A's record stands");
    assert!(matches!(err, BackingError::HeldByAnother { .. }), "{err:?}");
    b.claim(CACHE_B, true).expect("B takes the image over (the override as an argument)");
    b.write_at(&block(0xb1), 0).expect("B writes");
    b.write_at(&block(0xb2), BLOCK as u64).expect("B writes");
    b.flush().expect("B flushes");

    // A's next write-back (the cleaner's queue) fails: the lock is gone.
    assert!(!a.lock_lost());
    match queued_write(&a, 0xa2, BLOCK as u64) {
        Err(BackingError::LockLost { store, why }) => {
            assert_eq!(store, "rbd:rbd/broken-lock");
            assert!(!why.is_empty());
            eprintln!("A's write-back after its lock was broken: {why}");
        }
        other => panic!("A's write-back after its lock was broken: {other:?}"),
    }
    assert!(a.lock_lost());
    // From then on every write, discard, write-zeroes and flush fails at once, the same way.
    for (op, result) in [
        ("write", a.write_at(&block(0xa3), 0)),
        ("discard", a.discard(0, BLOCK as u64)),
        ("write-zeroes", a.write_zeroes(0, BLOCK as u64)),
        ("flush", a.flush()),
        ("queued write", queued_write(&a, 0xa3, 0)),
        ("disclaim", a.disclaim()),
        ("claim", a.claim(CACHE_A, true)),
    ] {
        match result {
            Err(err @ BackingError::LockLost { .. }) => {
                assert_eq!(err.errno(), libc::ESHUTDOWN, "{op}");
                assert!(err.to_string().contains("lost the image's exclusive lock"), "{op}: {err}");
            }
            other => panic!("{op} after the lock was lost: {other:?}"),
        }
    }
    assert!(
        cluster.image_meta(name, HOLDER_KEY).is_some_and(|h| h.starts_with(&uuid_text(CACHE_B))),
        "A's disclaim left B's record alone"
    );
    drop(a);
    assert_eq!(blocks_0_and_1(cluster, name), (block(0xb1), block(0xb2)), "B's data stays");
    drop(b);
}
