//! Several backing stores on one cache medium: a store table at offset 0 naming a window per
//! store, each window a whole cache of its own (`pmcache_engine::stores`,
//! `pmcache_media::Window`), on the crash-simulating medium and simulated backing stores cut
//! by one switch.
//!
//! - Power is cut at random persist points of a workload spread over every store's lanes;
//!   after it the table reads back as formatted, every store's cache attaches on its window,
//!   every block of every store reads back its last acknowledged write (the write the cut
//!   interrupted: old or new), no store's data shows in another's window or device, and a
//!   drain leaves each backing store holding exactly its own store's data.
//! - Power is cut at every persist point of the format protocol (clear the table, format
//!   each window, write the table), on a fresh medium and over an older one: the medium then
//!   names nothing (no table, and no cache at offset 0) or names every store, each window
//!   holding a freshly formatted cache — never a torn table (its magic word is written, and
//!   cleared, on its own).
//! - A table with a byte changed is refused (by its checksum, magic or version), the read
//!   changing nothing on the medium, and each window's cache stays intact.
//! - A store's cache, used alone, changes no byte outside its window.

use std::sync::Arc;

use pmcache_engine::stores::{STORE_ALIGN_BYTES, STORE_TABLE_BYTES, StoreTable, StoreTableError};
use pmcache_engine::testing::SimBacking;
use pmcache_engine::testing::model::{BLOCK, config, pattern};
use pmcache_engine::{
    AdmissionConfig, CacheMode, Config, Engine, EvictionKind, Lane, ManualClock, RecoveryReport,
};
use pmcache_media::{CrashMedium, CrashSwitch, Medium, MediumSet, Window};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A store's window served as the engine's medium.
type StoreMedium = MediumSet<Window<Arc<CrashMedium>>>;
type StoreEngine = Engine<StoreMedium, SimBacking, Arc<ManualClock>>;
type StoreLane<'e> = Lane<'e, StoreMedium, SimBacking, Arc<ManualClock>>;

/// Each store's window: the smallest a table allows (one alignment unit), 112 slots of
/// `BLOCK` bytes.
const WINDOW_BYTES: u64 = STORE_ALIGN_BYTES;
/// First bytes of every block the tests write: then the store's index and the write's number.
const TAG: &[u8; 4] = b"PMST";

fn names(stores: usize) -> Vec<String> {
    ["db", "logs", "home"][..stores].iter().map(|s| s.to_string()).collect()
}

/// The table region and one window per store.
fn medium_bytes(stores: usize) -> u64 {
    STORE_ALIGN_BYTES + stores as u64 * WINDOW_BYTES
}

/// Blocks of store `store`'s backing store: more than its cache's slots, and a different
/// size per store (so each cache records a backing identity no other store's device has).
fn backing_blocks(store: usize) -> u64 {
    160 + 32 * store as u64
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::default())
}

fn store_config(eviction: EvictionKind) -> Config {
    config(CacheMode::WriteBack, eviction, AdmissionConfig::Always)
}

/// The data of write `id` of store `store` to block `block`: tagged with both, unique.
fn block_data(store: usize, id: u64, block: u64) -> Vec<u8> {
    let mut data = pattern(id * 8 + store as u64, block * BLOCK as u64, BLOCK as u64);
    data[..4].copy_from_slice(TAG);
    data[4] = store as u8;
    data[5..8].copy_from_slice(&(id as u32).to_le_bytes()[..3]);
    data
}

/// The store a block of data was written by, if it carries a tag.
fn tagged_store(data: &[u8]) -> Option<usize> {
    (data[..4] == TAG[..]).then_some(data[4] as usize)
}

/// A shared medium and one backing store per store, all cut by one switch.
struct Parts {
    switch: Arc<CrashSwitch>,
    medium: Arc<CrashMedium>,
    backings: Vec<SimBacking>,
}

impl Parts {
    fn fresh(stores: usize, seed: u64) -> Self {
        let switch = CrashSwitch::new();
        let medium = Arc::new(CrashMedium::new(medium_bytes(stores), switch.clone(), seed));
        let backings = (0..stores)
            .map(|i| {
                let bytes = backing_blocks(i) * BLOCK as u64;
                SimBacking::new(bytes, switch.clone(), seed ^ (0xb0 + i as u64))
            })
            .collect();
        Self { switch, medium, backings }
    }

    /// Parts holding `medium` and `backings` durably, on a new switch.
    fn from_images(medium: Vec<u64>, backings: Vec<Vec<u8>>, seed: u64) -> Self {
        let switch = CrashSwitch::new();
        let medium = Arc::new(CrashMedium::from_image(medium, switch.clone(), seed));
        let backings = (backings.into_iter().enumerate())
            .map(|(i, image)| {
                SimBacking::from_image(image, switch.clone(), seed ^ (0xb0 + i as u64))
            })
            .collect();
        Self { switch, medium, backings }
    }

    /// What a power cut left (the switch must have cut power).
    fn after_power_cut(&self, seed: u64) -> Self {
        assert!(self.switch.has_crashed(), "power was not cut");
        let medium = self.medium.crash_image().expect("the medium's image at the cut");
        let backings = (self.backings.iter())
            .map(|b| b.crash_image().expect("the backing store's image at the cut"))
            .collect();
        Self::from_images(medium, backings, seed)
    }

    /// What every part holds durably now, as parts on a new switch.
    fn durable_copy(&self, seed: u64) -> Self {
        let backings = self.backings.iter().map(SimBacking::durable_contents).collect();
        Self::from_images(self.medium.durable_image(), backings, seed)
    }

    fn window(&self, table: &StoreTable, store: usize) -> StoreMedium {
        MediumSet::single(Window::new(self.medium.clone(), table.stores[store].window.clone()))
    }

    /// Attaches store `store`'s cache on its window.
    fn open(
        &self,
        table: &StoreTable,
        store: usize,
        cfg: &Config,
    ) -> Result<(StoreEngine, RecoveryReport), pmcache_engine::Error> {
        Engine::open(self.window(table, store), self.backings[store].clone(), clock(), cfg)
    }

    /// Every byte of the medium as loads see it now.
    fn medium_bytes_now(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; self.medium.len_bytes() as usize];
        self.medium.read(0, &mut bytes);
        bytes
    }
}

/// The format protocol: clear the table, format every window, write the table (the commit).
fn format_stores(parts: &Parts, table: &StoreTable, cfg: &Config) -> Vec<StoreEngine> {
    StoreTable::clear(&parts.medium);
    let engines = (0..table.stores.len())
        .map(|i| {
            Engine::format(parts.window(table, i), parts.backings[i].clone(), clock(), cfg)
                .unwrap_or_else(|e| panic!("format store {i}: {e}"))
        })
        .collect();
    table.write(&parts.medium);
    engines
}

fn plan(stores: usize) -> StoreTable {
    StoreTable::plan(medium_bytes(stores), &names(stores)).expect("plan")
}

/// Checks that every tagged block found in the medium's bytes lies in the window of the store
/// that wrote it, and that none is in the table's region.
fn check_no_data_outside_its_window(bytes: &[u8], table: &StoreTable, context: &str) {
    for at in (0..bytes.len()).step_by(BLOCK) {
        let Some(writer) = tagged_store(&bytes[at..at + BLOCK]) else { continue };
        let owner = table.stores.iter().position(|s| s.window.contains(&(at as u64)));
        assert_eq!(
            owner,
            Some(writer),
            "{context}: a block written by store {writer} lies at byte {at} of the medium, in \
             the window of store {owner:?}"
        );
    }
}

/// Acknowledged data of one store, by block.
struct StoreModel {
    blocks: Vec<Vec<u8>>,
    /// What the write the power cut interrupted would have left, where it would have: the
    /// block may hold that or its acknowledged data.
    in_flight: Vec<Option<Vec<u8>>>,
    /// Blocks of the interrupted write read back old, and new.
    interrupted_read: [u64; 2],
    writes: u64,
}

impl StoreModel {
    fn new(blocks: u64) -> Self {
        Self {
            blocks: vec![vec![0u8; BLOCK]; blocks as usize],
            in_flight: vec![None; blocks as usize],
            interrupted_read: [0; 2],
            writes: 0,
        }
    }

    /// Checks what block `block` of store `store` read, and settles it there.
    fn check_block(&mut self, store: usize, block: usize, got: &[u8], context: &str) {
        let acked = &self.blocks[block];
        let interrupted = self.in_flight[block].take();
        if got == &acked[..] || interrupted.as_deref() == Some(got) {
            if let Some(new) = &interrupted {
                self.interrupted_read[usize::from(got == &new[..])] += 1;
            }
            self.blocks[block] = got.to_vec();
            return;
        }
        let whose = match tagged_store(got) {
            Some(writer) if writer != store => format!("data written by store {writer}"),
            Some(_) => "another write of its own".to_string(),
            None if got.iter().all(|&b| b == 0) => "zeroes".to_string(),
            None => "untagged bytes".to_string(),
        };
        panic!(
            "{context}: store {store} block {block} reads {whose} ({:?}...), not its last \
             acknowledged write ({:?}...){}",
            &got[..8],
            &acked[..8],
            if interrupted.is_some() { " nor the interrupted one" } else { "" }
        );
    }

    fn image(&self) -> Vec<u8> {
        self.blocks.concat()
    }
}

/// How a workload run went.
struct Workload {
    parts: Parts,
    table: StoreTable,
    models: Vec<StoreModel>,
    /// Persist points of the format protocol and of the workload.
    format_points: u64,
    workload_points: u64,
    /// The cut came inside an operation of the workload.
    cut_inside: bool,
    evictions: u64,
    writebacks: u64,
}

const OPS: usize = 600;

/// Formats `stores` stores and runs a random workload (from `seed`) over their lanes,
/// cutting power at persist point `cut` of the workload (counted from the end of the
/// format), if any, and stopping at the cut.
fn run_workload(seed: u64, stores: usize, cfg: &Config, cut: Option<u64>) -> Workload {
    let parts = Parts::fresh(stores, seed);
    let table = plan(stores);
    let engines = format_stores(&parts, &table, cfg);
    let format_points = parts.switch.points();
    if let Some(point) = cut {
        parts.switch.arm(format_points + point);
    }
    let mut models: Vec<StoreModel> =
        (0..stores).map(|i| StoreModel::new(backing_blocks(i))).collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut cut_inside = false;
    {
        let mut lanes: Vec<StoreLane<'_>> =
            engines.iter().map(|e| e.lane().expect("lane")).collect();
        for op in 0..OPS {
            let store = rng.gen_range(0..stores);
            let model = &mut models[store];
            let lane = &mut lanes[store];
            let blocks = model.blocks.len() as u64;
            let first = rng.gen_range(0..blocks);
            let count = rng.gen_range(1..=3u64).min(blocks - first);
            let offset = first * BLOCK as u64;
            let context = format!("seed {seed} op {op} (store {store}, blocks {first}+{count})");
            match rng.gen_range(0..100) {
                0..=54 => {
                    let fua = rng.gen_bool(0.1);
                    let datas: Vec<Vec<u8>> = (first..first + count)
                        .map(|block| {
                            model.writes += 1;
                            block_data(store, model.writes, block)
                        })
                        .collect();
                    let result = lane.write(offset, &datas.concat(), fua);
                    if parts.switch.has_crashed() {
                        // Interrupted: each block old or new.
                        for (block, data) in (first..first + count).zip(datas) {
                            model.in_flight[block as usize] = Some(data);
                        }
                    } else {
                        result.unwrap_or_else(|e| panic!("{context}: write: {e}"));
                        for (block, data) in (first..first + count).zip(datas) {
                            model.blocks[block as usize] = data;
                        }
                    }
                }
                55..=89 => {
                    let mut buf = vec![0u8; (count as usize) * BLOCK];
                    match lane.read(offset, &mut buf) {
                        Ok(()) => {
                            for (i, got) in buf.chunks(BLOCK).enumerate() {
                                let block = first as usize + i;
                                model.check_block(store, block, got, &context);
                            }
                        }
                        Err(_) if parts.switch.has_crashed() => {}
                        Err(e) => panic!("{context}: read: {e}"),
                    }
                }
                90..=97 => {
                    let result = lane.flush();
                    if !parts.switch.has_crashed() {
                        result.unwrap_or_else(|e| panic!("{context}: flush: {e}"));
                    }
                }
                _ => {
                    let result = lane.drain();
                    if !parts.switch.has_crashed() {
                        result.unwrap_or_else(|e| panic!("{context}: drain: {e}"));
                    }
                }
            }
            if parts.switch.has_crashed() {
                cut_inside = true;
                break;
            }
        }
    }
    let workload_points = parts.switch.points() - format_points;
    let evictions = engines.iter().map(|e| e.stats().evictions).sum();
    let writebacks = engines.iter().map(|e| e.stats().writebacks).sum();
    if !parts.switch.has_crashed() {
        for (i, engine) in engines.iter().enumerate() {
            engine.audit().unwrap_or_else(|e| panic!("seed {seed}: store {i}: audit: {e}"));
        }
    }
    drop(engines);
    Workload {
        parts,
        table,
        models,
        format_points,
        workload_points,
        cut_inside,
        evictions,
        writebacks,
    }
}

/// Power cut at a random persist point of a workload over two or three stores: the table
/// reads back, every store recovers on its own window with every acknowledged write of its
/// own and nothing of another's, and a drain leaves each backing store holding its data.
#[test]
fn each_store_recovers_its_own_acknowledged_writes_after_a_power_cut() {
    let seeds = pmcache_engine::testing::proptest_cases(200) as u64;
    let (mut cut_inside, mut evictions, mut writebacks, mut interrupted) = (0, 0, 0, 0);
    let mut interrupted_read = [0u64; 2];
    for seed in 0..seeds {
        let seed = 0x5700_0000 + seed;
        let stores = 2 + (seed % 2) as usize;
        let eviction = if seed % 4 < 2 { EvictionKind::Clock } else { EvictionKind::Fifo };
        let cfg = store_config(eviction);
        // A dry run counts the workload's persist points; the run cuts at one of them.
        let dry = run_workload(seed, stores, &cfg, None);
        assert!(dry.workload_points > 0, "seed {seed}: the workload persisted nothing");
        let point = SmallRng::seed_from_u64(!seed).gen_range(1..=dry.workload_points);
        let mut run = run_workload(seed, stores, &cfg, Some(point));
        assert_eq!(run.format_points, dry.format_points, "seed {seed}: format points differ");
        if run.cut_inside {
            cut_inside += 1;
        } else {
            run.parts.switch.cut_now();
        }
        evictions += dry.evictions + run.evictions;
        writebacks += dry.writebacks + run.writebacks;
        interrupted += run.models.iter().flat_map(|m| &m.in_flight).filter(|b| b.is_some()).count();
        let context = format!("seed {seed} ({stores} stores, cut at workload point {point})");

        let after = run.parts.after_power_cut(seed + 1000);
        assert_eq!(StoreTable::read(&after.medium), Ok(run.table.clone()), "{context}: table");
        check_no_data_outside_its_window(&after.medium_bytes_now(), &run.table, &context);
        for store in 0..stores {
            let context = format!("{context}, store {store}");
            // Its cache records its own backing store: another's is refused.
            let other = (store + 1) % stores;
            let wrong = Engine::open(
                after.window(&run.table, store),
                after.backings[other].clone(),
                clock(),
                &cfg,
            );
            assert!(wrong.is_err(), "{context}: attached with store {other}'s backing store");

            let (engine, report) = after
                .open(&run.table, store, &cfg)
                .unwrap_or_else(|e| panic!("{context}: recovery: {e}"));
            assert_eq!(report.corrupt, 0, "{context}: recovery found corruption: {report:?}");
            assert!(!report.synced_seq_invalid, "{context}: {report:?}");
            engine.audit().unwrap_or_else(|e| panic!("{context}: audit after recovery: {e}"));
            let model = &mut run.models[store];
            let mut lane = engine.lane().expect("lane");
            let mut buf = vec![0u8; BLOCK];
            for block in 0..model.blocks.len() {
                lane.read((block * BLOCK) as u64, &mut buf)
                    .unwrap_or_else(|e| panic!("{context}: read block {block}: {e}"));
                model.check_block(store, block, &buf, &format!("{context}, after recovery"));
            }
            lane.drain().unwrap_or_else(|e| panic!("{context}: drain: {e}"));
            for block in 0..model.blocks.len() {
                lane.read((block * BLOCK) as u64, &mut buf).expect("read after the drain");
                model.check_block(store, block, &buf, &format!("{context}, after the drain"));
            }
            drop(lane);
            engine.audit().unwrap_or_else(|e| panic!("{context}: audit after the drain: {e}"));
            let durable = after.backings[store].durable_contents();
            let expected = model.image();
            if let Some(block) = (0..model.blocks.len()).find(|&b| {
                durable[b * BLOCK..(b + 1) * BLOCK] != expected[b * BLOCK..(b + 1) * BLOCK]
            }) {
                panic!(
                    "{context}: after the drain, backing block {block} holds {:?}..., not {:?}...",
                    &durable[block * BLOCK..block * BLOCK + 8],
                    &expected[block * BLOCK..block * BLOCK + 8]
                );
            }
        }
        check_no_data_outside_its_window(&after.medium_bytes_now(), &run.table, &context);
        for model in &run.models {
            interrupted_read[0] += model.interrupted_read[0];
            interrupted_read[1] += model.interrupted_read[1];
        }
    }
    eprintln!(
        "{seeds} runs: {cut_inside} cut inside the workload, {interrupted} blocks written by an \
         interrupted write ({} read back old, {} new), {evictions} evictions, {writebacks} \
         write-backs",
        interrupted_read[0], interrupted_read[1]
    );
    assert!(cut_inside * 4 >= seeds * 3, "only {cut_inside} of {seeds} cuts inside the workload");
    assert!(evictions > 0 && writebacks > 0, "the workloads never evicted or wrote back");
    // The cuts inside writes left some blocks old and some new: both readings were tested.
    assert!(interrupted_read.iter().all(|&n| n > 0), "interrupted blocks {interrupted_read:?}");
}

/// Writes `round`'s data to every block of every store, then flushes: a medium with caches
/// holding data (dirty blocks, and clean ones after some write-backs) to format over.
fn fill(engines: &[StoreEngine], round: u64) {
    for (store, engine) in engines.iter().enumerate() {
        let mut lane = engine.lane().expect("lane");
        for block in 0..backing_blocks(store) {
            let data = block_data(store, round, block);
            lane.write(block * BLOCK as u64, &data, false).expect("write");
        }
        lane.flush().expect("flush");
    }
}

/// Power cut at every persist point of the format protocol, on a fresh medium and over an
/// older medium of the same stores (caches holding data): afterwards the medium names nothing
/// or every store, each of whose caches then attaches, and is the new (empty) one once the
/// old table is cleared. No cut leaves a torn table: the magic word is what names it, cleared
/// first and written last, each time alone.
#[test]
fn a_power_cut_during_the_format_leaves_a_table_naming_formatted_caches_or_none() {
    let cfg = store_config(EvictionKind::Clock);
    let (mut none, mut named) = (0, 0);
    for stores in 1..=3 {
        let table = plan(stores);
        for over_old in [false, true] {
            // What the medium and the backing stores hold before the format.
            let base = Parts::fresh(stores, 7);
            if over_old {
                let engines = format_stores(&base, &table, &cfg);
                fill(&engines, 1);
            }
            let base_image = base.medium.durable_image();
            let base_backings: Vec<Vec<u8>> =
                base.backings.iter().map(SimBacking::durable_contents).collect();
            let parts_at =
                |seed| Parts::from_images(base_image.clone(), base_backings.clone(), seed);

            let dry = parts_at(0);
            drop(format_stores(&dry, &table, &cfg));
            let points = dry.switch.points();
            // The clear's fence, each window's fences, the table's fence.
            assert!(points >= 2 + stores as u64, "{points} persist points");
            for (point, seed) in (1..=points + 1).flat_map(|p| (0..8).map(move |s| (p, s))) {
                let context = format!(
                    "{stores} stores{}, cut at point {point} of {points} (seed {seed})",
                    if over_old { " over an old medium" } else { "" }
                );
                let parts = parts_at(point * 8 + seed);
                parts.switch.arm(point);
                drop(format_stores(&parts, &table, &cfg));
                if !parts.switch.has_crashed() {
                    parts.switch.cut_now();
                }
                let after = parts.after_power_cut(point * 8 + seed + 1000);
                match StoreTable::read(&after.medium) {
                    Ok(read) => {
                        named += 1;
                        assert_eq!(read, table, "{context}: the table read back");
                        // Before the clear's fence, the old caches are still whole.
                        let fresh = !(over_old && point == 1);
                        for store in 0..stores {
                            let (engine, report) = after
                                .open(&table, store, &cfg)
                                .unwrap_or_else(|e| panic!("{context}: store {store}: {e}"));
                            assert_eq!(report.corrupt + report.torn, 0, "{context}: {report:?}");
                            let cached = report.clean + report.dirty;
                            if fresh {
                                assert_eq!(cached, 0, "{context}: store {store}: an old cache");
                            } else {
                                assert!(cached > 0, "{context}: store {store}: old cache lost");
                            }
                            engine.audit().unwrap_or_else(|e| panic!("{context}: audit: {e}"));
                        }
                    }
                    Err(StoreTableError::NotATable { found }) => {
                        none += 1;
                        // The magic word names nothing (what lies behind it may be a table's
                        // body written or cleared in part).
                        assert_eq!(found, [0u8; 8], "{context}: {found:02x?}");
                        // Nor is there a cache at the medium's start.
                        let whole = MediumSet::single(Window::whole(after.medium.clone()));
                        let backing = after.backings[0].clone();
                        assert!(
                            Engine::open(whole, backing, clock(), &cfg).is_err(),
                            "{context}: a cache attached at offset 0"
                        );
                    }
                    Err(e) => panic!("{context}: {e}"),
                }
            }
        }
    }
    eprintln!("format cuts: {none} left no table, {named} the whole table");
    assert!(none > 0 && named > 0, "the cuts never left one of the two outcomes");
}

/// A formatted medium of three stores, each cache holding data.
fn formatted_three_stores(cfg: &Config) -> (Parts, StoreTable) {
    let parts = Parts::fresh(3, 11);
    let table = plan(3);
    let engines = format_stores(&parts, &table, cfg);
    fill(&engines, 2);
    (parts, table)
}

/// Checks that store `store`'s cache attaches and serves `fill`'s data of `round`.
fn check_store_data(parts: &Parts, table: &StoreTable, store: usize, cfg: &Config, round: u64) {
    let (engine, report) =
        parts.open(table, store, cfg).unwrap_or_else(|e| panic!("store {store}: {e}"));
    assert_eq!(report.corrupt, 0, "store {store}: {report:?}");
    assert!(report.clean + report.dirty > 0, "store {store}: an empty cache");
    let mut lane = engine.lane().expect("lane");
    let mut buf = vec![0u8; BLOCK];
    for block in 0..backing_blocks(store) {
        lane.read(block * BLOCK as u64, &mut buf).expect("read");
        assert!(buf == block_data(store, round, block), "store {store} block {block}");
    }
}

/// Every byte of the table changed in turn: the table is refused (a changed magic as no table,
/// a changed version as another version's, any other byte by its checksum), reading it
/// changes nothing on the medium, and each window's cache attaches with its data.
#[test]
fn a_corrupt_store_table_is_refused_and_other_bytes_untouched() {
    let cfg = store_config(EvictionKind::Clock);
    let (parts, table) = formatted_three_stores(&cfg);
    let before = parts.medium_bytes_now();
    assert_eq!(StoreTable::read(&parts.medium), Ok(table.clone()));
    let mut original = [0u8; 1];
    for at in 0..STORE_TABLE_BYTES as u64 {
        parts.medium.read(at, &mut original);
        parts.medium.write_persist(at, &[original[0] ^ 0x10]);
        let read = StoreTable::read(&parts.medium);
        match at {
            0..8 => {
                assert!(matches!(read, Err(StoreTableError::NotATable { .. })), "{at}: {read:?}")
            }
            8..12 => assert!(
                matches!(read, Err(StoreTableError::UnsupportedVersion(_))),
                "{at}: {read:?}"
            ),
            _ => assert!(
                matches!(read, Err(StoreTableError::BadChecksum { .. })),
                "byte {at}: {read:?}"
            ),
        }
        let mut changed = vec![0u8; STORE_TABLE_BYTES];
        parts.medium.read(0, &mut changed);
        assert!(
            changed.iter().zip(&before).enumerate().all(|(i, (a, b))| (a == b) == (i as u64 != at)),
            "byte {at}: the read changed the table's bytes"
        );
        parts.medium.write_persist(at, &original);
    }
    assert_eq!(parts.medium_bytes_now(), before, "the medium changed");
    // A corrupt table that stays so after a power cut; the windows are intact.
    parts.medium.write_persist(2048, &[0xee]);
    parts.switch.cut_now();
    let after = parts.after_power_cut(12);
    assert!(matches!(StoreTable::read(&after.medium), Err(StoreTableError::BadChecksum { .. })));
    for store in 0..3 {
        check_store_data(&after, &table, store, &cfg, 2);
    }
}

/// One store's cache written past its capacity (evictions, write-backs), drained and shut
/// down: every byte of the medium outside its window is as it was.
#[test]
fn a_stores_cache_changes_no_byte_outside_its_window() {
    let cfg = store_config(EvictionKind::Fifo);
    let (parts, table) = formatted_three_stores(&cfg);
    let parts = parts.durable_copy(13);
    let before = parts.medium_bytes_now();
    let window = table.stores[1].window.clone();
    {
        let (engine, _) = parts.open(&table, 1, &cfg).expect("attach");
        let mut lane = engine.lane().expect("lane");
        for round in 3..6 {
            for block in (0..backing_blocks(1)).rev() {
                lane.write(block * BLOCK as u64, &block_data(1, round, block), round == 4)
                    .expect("write");
            }
        }
        lane.drain().expect("drain");
        drop(lane);
        assert!(engine.stats().evictions > 0, "the cache never evicted");
        engine.shutdown().expect("shutdown");
    }
    let now = parts.medium_bytes_now();
    assert!(
        now[window.start as usize..window.end as usize]
            != before[window.start as usize..window.end as usize]
    );
    let outside = |bytes: &[u8]| {
        let (low, high) = (&bytes[..window.start as usize], &bytes[window.end as usize..]);
        [low.to_vec(), high.to_vec()].concat()
    };
    assert!(outside(&now) == outside(&before), "bytes outside store 1's window changed");
    assert_eq!(StoreTable::read(&parts.medium), Ok(table.clone()));
    check_store_data(&parts, &table, 0, &cfg, 2);
    check_store_data(&parts, &table, 2, &cfg, 2);
    check_store_data(&parts, &table, 1, &cfg, 5);
}
