//! The order of backing-store writes between the cleaner and everything else that writes or
//! discards a block there: an older copy never lands after a newer one, and two overlapping
//! requests in flight end as one of their two orders, block by block. Each test stages the
//! race with the hooks of `HookedBacking`: a second request is started at the moment one
//! operation is about to reach the device, and given a bounded time to finish before that
//! operation goes on (where the engine orders the second after the first, it waits, and the
//! test goes on when that time is up).
#![cfg(not(feature = "shuttle"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use pmcache_backing::BackingStore;
use pmcache_engine::testing::hooked::HookedBacking;
use pmcache_engine::testing::model::{BLOCK, World, config, pattern};
use pmcache_engine::{
    AdmissionConfig, CacheMode, CleanerConfig, Engine, EvictionKind, ManualClock, WriteBackOrder,
};

type HookedEngine =
    Engine<pmcache_engine::testing::model::SimMedium, Arc<HookedBacking>, Arc<ManualClock>>;

/// How long a hook lets the request it started run before the operation it interrupted goes
/// on: ample for a request that nothing holds back.
const RACE_WINDOW: Duration = Duration::from_millis(400);

const B: u64 = BLOCK as u64;

fn hooked_engine(seed: u64) -> (World, Arc<HookedBacking>, Arc<HookedEngine>) {
    hooked_engine_over(seed, HookedBacking::new)
}

/// [`hooked_engine`] over the backing store `wrap` makes of the world's device.
fn hooked_engine_over(
    seed: u64,
    wrap: fn(pmcache_engine::testing::SimBacking) -> Arc<HookedBacking>,
) -> (World, Arc<HookedBacking>, Arc<HookedEngine>) {
    let world = World::fresh(seed);
    let backing = wrap(world.backing.clone());
    let cfg = pmcache_engine::Config {
        max_lanes: 4,
        ..config(CacheMode::WriteBack, EvictionKind::Clock, AdmissionConfig::Always)
    };
    let clock = Arc::new(ManualClock::default());
    let engine =
        Engine::format(world.medium.clone(), backing.clone(), clock, &cfg).expect("format");
    // Write-zeroes of 2 whole blocks or more go through to the backing store (256 by default):
    // the model's device has 48.
    engine.set_zero_through_blocks_min(2);
    (world, backing, Arc::new(engine))
}

fn cleaner_config() -> CleanerConfig {
    CleanerConfig {
        order: WriteBackOrder::Lba,
        target_pct: 0,
        idle_target_pct: 0,
        idle_ms: 0,
        queue_depth: 2,
        batch_blocks: 4,
        merge_blocks: 1,
        ..CleanerConfig::default()
    }
}

/// The threads of the requests a hook started, to join.
type RaceThreads = Arc<std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>>;

/// Runs `request` on a thread of its own and waits for it at most `RACE_WINDOW`; returns
/// whether it finished in that time (it goes on either way, and `join` waits for the rest).
fn race(request: impl FnOnce() + Send + 'static) -> (bool, std::thread::JoinHandle<()>) {
    let (done, finished) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        request();
        let _ = done.send(());
    });
    (finished.recv_timeout(RACE_WINDOW).is_ok(), thread)
}

fn read_block(engine: &HookedEngine, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    engine.lane().unwrap().read(lba * B, &mut buf).unwrap();
    buf
}

/// Asserts that `got` is `want`, naming the first byte that differs (not the whole block).
fn assert_block(got: &[u8], want: &[u8], what: &str) {
    if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!("{what}: byte {at} is {:#x}, not {:#x}", got[at], want[at]);
    }
}

/// What the backing store holds of `lba`, durably.
fn durable_block(world: &World, lba: u64) -> Vec<u8> {
    world.backing.durable_contents()[(lba * B) as usize..((lba + 1) * B) as usize].to_vec()
}

/// A dirty block's copy is on its way from the cleaner; meanwhile a client trims the block
/// (acknowledged), then zeroes a range of whole blocks over it, which goes to the backing
/// store directly since the block is no longer cached (acknowledged). The cleaner's old copy
/// must not land after the zeroes: the block reads zeroes, now and from the backing store.
#[test]
fn trim_then_write_zeroes_during_the_cleaners_copy_read_zeroes() {
    let (world, backing, engine) = hooked_engine(2);
    let old = pattern(1, 3 * B, B);
    engine.lane().unwrap().write(3 * B, &old, false).unwrap();
    let mut cleaner = engine.cleaner(cleaner_config()).unwrap();
    let staged = {
        let engine = engine.clone();
        inside_the_cleaners_write(&backing, 3, move || {
            let mut lane = engine.lane().unwrap();
            lane.trim(3 * B, B).unwrap();
            lane.write_zeroes(0, 8 * B, false).unwrap();
        })
    };
    cleaner.clean_batch(16);
    staged.join("the cleaner's write of block 3");
    cleaner.clean_batch(16);
    drop(cleaner);
    assert_block(&read_block(&engine, 3), &[0u8; BLOCK], "block 3 after trim and zeroes");
    engine.lane().unwrap().flush().unwrap();
    assert_block(&durable_block(&world, 3), &[0u8; BLOCK], "block 3 on the backing store");
    engine.audit().unwrap();
}

/// A write-zeroes over uncached blocks is about to zero them on the backing store when a
/// partial write of one of them arrives (it merges with the block's old bytes there). The
/// outcome must be one of the two orders: the partial write's bytes over zeroes (zeroes
/// first), or all zeroes (the write first) — never the old bytes around the written ones.
#[test]
fn a_partial_write_racing_a_write_zeroes_through_ends_in_one_of_the_two_orders() {
    let (world, backing, engine) = hooked_engine(4);
    let old = pattern(1, 0, 8 * B);
    world.backing.write_at(&old, 0).unwrap();
    world.backing.flush().unwrap();
    let piece = pattern(2, 5 * B + 100, 50);
    let staged = {
        let (engine, piece) = (engine.clone(), piece.clone());
        stage(
            |hook| backing.on_write_zeroes(hook),
            |_| true,
            move || engine.lane().unwrap().write(5 * B + 100, &piece, false).unwrap(),
        )
    };
    engine.lane().unwrap().write_zeroes(0, 8 * B, false).unwrap();
    staged.join("the zeroes' write to the backing store");
    let zeroes_first = {
        let mut block = vec![0u8; BLOCK];
        block[100..150].copy_from_slice(&piece);
        block
    };
    let got = read_block(&engine, 5);
    assert!(
        got == zeroes_first || got == vec![0u8; BLOCK],
        "block 5 is neither order: old bytes {} of {} kept",
        got.iter().zip(&old[5 * BLOCK..6 * BLOCK]).filter(|(g, o)| g == o && **o != 0).count(),
        BLOCK
    );
    let mut cleaner = engine.cleaner(cleaner_config()).unwrap();
    cleaner.drain().unwrap();
    drop(cleaner);
    assert_block(&durable_block(&world, 5), &got, "the backing store after a drain");
    engine.audit().unwrap();
}

/// A write-zeroes over an uncached block is about to zero it on the backing store when a
/// full write of the block arrives and the cleaner writes it back; the cleaner's clean mark
/// comes after the zeroes landed. The block must read what the backing store holds once
/// nothing is dirty: a copy marked clean over zeroes would lose the write at eviction.
#[test]
fn a_full_write_cleaned_while_a_write_zeroes_through_lands_is_not_lost() {
    let (world, backing, engine) = hooked_engine(6);
    let old = pattern(1, 0, 8 * B);
    world.backing.write_at(&old, 0).unwrap();
    world.backing.flush().unwrap();
    let new = pattern(3, 6 * B, B);
    let zeroes_landed = Arc::new(AtomicBool::new(false));
    let fired = Arc::new(AtomicBool::new(false));
    let threads = Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        // The cleaner's flush (of its batch with the new block) waits until the zeroes have
        // landed, so its clean mark comes after them.
        let (zeroes_landed, fired) = (zeroes_landed.clone(), fired.clone());
        backing.on_flush(move |_| {
            if fired.load(Ordering::SeqCst) && !zeroes_landed.load(Ordering::SeqCst) {
                let deadline = std::time::Instant::now() + RACE_WINDOW * 2;
                while !zeroes_landed.load(Ordering::SeqCst) && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
    }
    {
        let (engine, fired, threads, new, zeroes_landed) =
            (engine.clone(), fired.clone(), threads.clone(), new.clone(), zeroes_landed.clone());
        backing.on_write_zeroes(move |_| {
            if fired.swap(true, Ordering::SeqCst) {
                return;
            }
            let (engine, new) = (engine.clone(), new.clone());
            let (_, thread) = race(move || {
                engine.lane().unwrap().write(6 * B, &new, false).unwrap();
                let mut cleaner = engine.cleaner(cleaner_config()).unwrap();
                cleaner.clean_batch(16);
            });
            threads.lock().unwrap().push(thread);
            // The zeroes land when this hook returns: a moment after it.
            let zeroes_landed = zeroes_landed.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                zeroes_landed.store(true, Ordering::SeqCst);
            });
        });
    }
    engine.lane().unwrap().write_zeroes(0, 8 * B, false).unwrap();
    for thread in threads.lock().unwrap().drain(..) {
        thread.join().unwrap();
    }
    let got = read_block(&engine, 6);
    assert!(got == new || got == vec![0u8; BLOCK], "block 6 is neither order");
    let mut cleaner = engine.cleaner(cleaner_config()).unwrap();
    cleaner.drain().unwrap();
    drop(cleaner);
    assert_eq!(engine.dirty_slots(), 0);
    assert_block(&durable_block(&world, 6), &got, "the backing store lacks what the cache serves");
    engine.audit().unwrap();
}

/// A request staged inside one backing-store operation (see [`stage`]).
struct Staged {
    fired: Arc<AtomicBool>,
    threads: RaceThreads,
}

impl Staged {
    /// Asserts that the operation happened (`what` it was), and waits for the request.
    fn join(&self, what: &str) {
        assert!(self.fired.load(Ordering::SeqCst), "{what} did not happen");
        for thread in self.threads.lock().unwrap().drain(..) {
            thread.join().unwrap();
        }
    }
}

/// Stages `request` inside the first operation a hook set by `set_hook` sees with an offset
/// `at` accepts: the request runs on a thread of its own, given `RACE_WINDOW` before that
/// operation reaches the device.
fn stage(
    set_hook: impl FnOnce(Box<dyn FnMut(u64) + Send>),
    at: impl Fn(u64) -> bool + Send + 'static,
    request: impl FnOnce() + Send + 'static,
) -> Staged {
    let staged =
        Staged { fired: Arc::new(AtomicBool::new(false)), threads: RaceThreads::default() };
    let mut request = Some(request);
    let (fired, threads) = (staged.fired.clone(), staged.threads.clone());
    set_hook(Box::new(move |offset| {
        if !at(offset) || fired.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(request) = request.take() {
            let (_, thread) = race(request);
            threads.lock().unwrap().push(thread);
        }
    }));
    staged
}

/// Stages `request` inside the cleaner's backing write of block `lba` (its copy of the block's
/// older data is on its way).
fn inside_the_cleaners_write(
    backing: &Arc<HookedBacking>,
    lba: u64,
    request: impl FnOnce() + Send + 'static,
) -> Staged {
    stage(|hook| backing.on_write(hook), move |offset| offset == lba * B, request)
}

/// A write-through write of a block whose older dirty copy the cleaner is writing back (the
/// cache switched from write-back to write-through with dirty blocks): the write-through's
/// backing write must land after the cleaner's, or the backing store keeps the older data
/// while the cache drops its copy.
#[test]
fn a_write_through_during_the_cleaners_copy_lands_after_it() {
    let (world, backing, engine) = hooked_engine(8);
    engine.lane().unwrap().write(3 * B, &pattern(1, 3 * B, B), false).unwrap();
    engine.set_mode(CacheMode::WriteThrough);
    let newer = pattern(2, 3 * B, B);
    let mut cleaner = engine.cleaner(cleaner_config()).unwrap();
    let staged = {
        let (engine, newer) = (engine.clone(), newer.clone());
        inside_the_cleaners_write(&backing, 3, move || {
            engine.lane().unwrap().write(3 * B, &newer, false).unwrap();
        })
    };
    cleaner.clean_batch(16);
    staged.join("the cleaner's write of block 3");
    drop(cleaner);
    assert_block(&read_block(&engine, 3), &newer, "block 3 read");
    engine.lane().unwrap().flush().unwrap();
    assert_block(&durable_block(&world, 3), &newer, "block 3 on the backing store");
    engine.audit().unwrap();
}

/// A drain through a lane (an inline write-back) of a block overwritten while the cleaner's
/// copy of its older data is on its way: the drain's write must land after the cleaner's, or
/// the newer data is marked clean over a backing store that ends with the older.
#[test]
fn an_inline_write_back_during_the_cleaners_copy_lands_after_it() {
    let (world, backing, engine) = hooked_engine(10);
    engine.lane().unwrap().write(3 * B, &pattern(1, 3 * B, B), false).unwrap();
    let newer = pattern(2, 3 * B, B);
    let mut cleaner = engine.cleaner(cleaner_config()).unwrap();
    let staged = {
        let (engine, newer) = (engine.clone(), newer.clone());
        inside_the_cleaners_write(&backing, 3, move || {
            let mut lane = engine.lane().unwrap();
            lane.write(3 * B, &newer, false).unwrap();
            lane.drain().unwrap();
        })
    };
    cleaner.clean_batch(16);
    staged.join("the cleaner's write of block 3");
    cleaner.clean_batch(16);
    drop(cleaner);
    assert_block(&read_block(&engine, 3), &newer, "block 3 read");
    engine.lane().unwrap().drain().unwrap();
    assert_eq!(engine.dirty_slots(), 0);
    assert_block(&durable_block(&world, 3), &newer, "block 3 on the backing store");
    engine.audit().unwrap();
}

/// A write-zeroes of whole blocks over holes that a TRIM punched and nothing synced yet writes
/// nothing to the backing store (a hole reads as zeroes already); acknowledged, its zeroes must
/// be durable all the same, so the punch is synced before the acknowledgement.
#[test]
fn a_write_zeroes_over_unsynced_holes_is_durable_when_acknowledged() {
    let (world, _backing, engine) = hooked_engine_over(12, HookedBacking::with_holes);
    let old = pattern(1, 0, 8 * B);
    world.backing.write_at(&old, 0).unwrap();
    world.backing.flush().unwrap();
    let mut lane = engine.lane().unwrap();
    lane.trim(0, 8 * B).unwrap();
    lane.write_zeroes(0, 8 * B, false).unwrap();
    // No flush: what the backing store holds durably now.
    let durable = world.backing.durable_contents();
    assert_block(&durable[..8 * BLOCK], &[0u8; 8 * BLOCK], "blocks 0..8, durably");
    drop(lane);
    engine.audit().unwrap();
}
