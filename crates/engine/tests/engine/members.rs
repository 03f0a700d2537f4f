//! A cache of several members (one medium per NUMA node) on a simulated machine: each
//! thread says which CPU it runs on, and the engine must place its writes on the member of
//! that CPU's node, fall back to the nearest member when it is full, count reads and writes
//! local or remote, recover a set after a power cut, and refuse a set with a member missing,
//! repeated, out of order or from another cache. The placement is verified on the media
//! themselves (which member's metadata holds each block), not only by the engine's counters.

use std::cell::Cell;
use std::sync::Arc;

use pmcache_engine::format::{BlockState, DecodedEntry, FormatError, Geometry, SlotEntry};
use pmcache_engine::layout::sort_members;
use pmcache_engine::testing::SimBacking;
use pmcache_engine::{
    AdmissionConfig, Config, Engine, Error, ManualClock, MemberStats, PlacementConfig,
    PlacementPolicy, WriteRequest,
};
use pmcache_media::numa::Topology;
use pmcache_media::{CrashMedium, CrashSwitch, Medium, MediumSet};

const BLOCK: usize = 512;
/// 4 KiB superblock, 4 KiB of entries, 64 slots.
const MEMBER_BYTES: u64 = 8192 + 64 * BLOCK as u64;
const BACKING_BLOCKS: u64 = 1024;

type Set = MediumSet<CrashMedium>;
type SetEngine = Engine<Set, SimBacking, Arc<ManualClock>>;

thread_local! {
    static CPU: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The simulated `sched_getcpu`: what the thread said with `run_on`.
fn this_cpu() -> Option<usize> {
    CPU.with(Cell::get)
}

fn run_on(cpu: usize) {
    CPU.with(|c| c.set(Some(cpu)));
}

/// CPU `n` is on node `n`; `distances` between the nodes.
fn config(policy: PlacementPolicy, distances: Vec<Vec<u32>>) -> Config {
    let cpu_node = (0..distances.len() as u32).collect();
    Config {
        block_size: BLOCK as u32,
        max_lanes: 4,
        admission: AdmissionConfig::Always,
        placement: PlacementConfig {
            policy,
            topology: Some(Arc::new(Topology::simulated(cpu_node, distances))),
            current_cpu: this_cpu,
        },
        ..Config::default()
    }
}

fn two_nodes() -> Vec<Vec<u32>> {
    vec![vec![10, 21], vec![21, 10]]
}

/// Member `i` on node `nodes[i]`, all cut by `switch`.
fn set_on(nodes: &[u32], switch: &Arc<CrashSwitch>) -> Set {
    MediumSet::new(
        nodes
            .iter()
            .enumerate()
            .map(|(i, &node)| {
                (CrashMedium::new(MEMBER_BYTES, switch.clone(), 7 + i as u64), Some(node))
            })
            .collect(),
    )
}

fn block_of(lba: u64, round: u8) -> Vec<u8> {
    vec![(lba as u8).wrapping_mul(3) ^ round; BLOCK]
}

/// Writes blocks `lbas` from a thread on `cpu`, each `block_of(lba, round)`.
fn write_from(engine: &SetEngine, cpu: usize, lbas: std::ops::Range<u64>, round: u8) {
    std::thread::scope(|scope| {
        scope.spawn(move || {
            run_on(cpu);
            let mut lane = engine.lane().expect("lane");
            for lba in lbas {
                lane.write(lba * BLOCK as u64, &block_of(lba, round), false).expect("write");
            }
        });
    });
}

/// Reads blocks `lbas` from a thread on `cpu` and checks them.
fn read_from(engine: &SetEngine, cpu: usize, lbas: std::ops::Range<u64>, round: u8) {
    std::thread::scope(|scope| {
        scope.spawn(move || {
            run_on(cpu);
            let mut lane = engine.lane().expect("lane");
            let mut buf = vec![0u8; BLOCK];
            for lba in lbas {
                lane.read(lba * BLOCK as u64, &mut buf).expect("read");
                assert_eq!(buf, block_of(lba, round), "block {lba}");
            }
        });
    });
}

/// The blocks whose valid entries are on `member` (a medium of the set), read from its own
/// metadata table.
fn blocks_on(member: &CrashMedium) -> Vec<u64> {
    let geometry = Geometry::for_medium(member.len_bytes(), BLOCK as u32).unwrap();
    let mut out: Vec<u64> = (0..geometry.slot_count as u32)
        .filter_map(|slot| {
            let at = geometry.entry_offset(slot);
            match SlotEntry::decode(member.load_u64(at), member.load_u64(at + 8)) {
                DecodedEntry::Valid(SlotEntry { lba, state: BlockState::Dirty, .. }) => Some(lba),
                _ => None,
            }
        })
        .collect();
    out.sort_unstable();
    out
}

fn format(set: Set, switch: &Arc<CrashSwitch>, config: &Config) -> (SetEngine, SimBacking) {
    let backing = SimBacking::new(BACKING_BLOCKS * BLOCK as u64, switch.clone(), 3);
    let clock = Arc::new(ManualClock::default());
    (Engine::format(set, backing.clone(), clock, config).expect("format"), backing)
}

fn writes(stats: &[MemberStats]) -> Vec<(u64, u64)> {
    stats.iter().map(|m| (m.writes_local, m.writes_remote)).collect()
}

/// Threads on node 0 and node 1 write their own blocks: each block's data and entry land on
/// its writer's member, every write counted local; reads count where they were served from.
#[test]
fn writes_land_on_the_writers_node_and_reads_count_local_or_remote() {
    let switch = CrashSwitch::new();
    let set = set_on(&[0, 1], &switch);
    let (engine, _) = format(set.clone(), &switch, &config(PlacementPolicy::Local, two_nodes()));
    write_from(&engine, 0, 0..20, 1);
    write_from(&engine, 1, 100..130, 1);
    let media: Vec<&CrashMedium> = set.media().collect();
    assert_eq!(blocks_on(media[0]), (0..20).collect::<Vec<_>>());
    assert_eq!(blocks_on(media[1]), (100..130).collect::<Vec<_>>());
    let stats = engine.member_stats();
    assert_eq!(writes(&stats), [(20, 0), (30, 0)]);
    assert_eq!((stats[0].node, stats[1].node), (Some(0), Some(1)));
    assert_eq!((stats[0].dirty, stats[1].dirty), (20, 30));
    assert_eq!((stats[0].slots, stats[1].slots), (64, 64));
    // The writers' lanes are gone: their unused runs went back to their members' pools.
    assert_eq!((stats[0].free, stats[1].free), (44, 34));
    // Node 1 reads node 0's blocks (remote), node 0 reads them too (local).
    read_from(&engine, 1, 0..20, 1);
    read_from(&engine, 0, 0..10, 1);
    let stats = engine.member_stats();
    assert_eq!((stats[0].reads_local, stats[0].reads_remote), (10, 20));
    assert_eq!((stats[1].reads_local, stats[1].reads_remote), (0, 0));
    assert_eq!(engine.stats().read_hits, 30);
    // A batch from node 1 (a group commit: its slots are taken from the lane's run at once)
    // lands and counts on node 1's member too.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            run_on(1);
            let mut lane = engine.lane().expect("lane");
            let blocks: Vec<Vec<u8>> = (300..308).map(|lba| block_of(lba, 1)).collect();
            let requests: Vec<WriteRequest<'_>> = blocks
                .iter()
                .zip(300u64..)
                .map(|(data, lba)| WriteRequest { offset: lba * BLOCK as u64, data, fua: false })
                .collect();
            let mut outcomes = Vec::new();
            lane.write_batch(&requests, &mut outcomes);
            assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        });
    });
    assert_eq!(writes(&engine.member_stats()), [(20, 0), (38, 0)]);
    assert_eq!(blocks_on(media[1]), (100..130).chain(300..308).collect::<Vec<_>>());
    engine.audit().expect("audit");
}

/// Three nodes where node 2 is nearer node 0 than node 1 is: a writer on node 0 that fills
/// its member goes on to node 2's, never node 1's, and every block reads back.
#[test]
fn a_full_member_falls_back_to_the_nearest_one() {
    let distances = vec![vec![10, 30, 20], vec![30, 10, 20], vec![20, 20, 10]];
    let switch = CrashSwitch::new();
    let set = set_on(&[0, 1, 2], &switch);
    let (engine, _) = format(set.clone(), &switch, &config(PlacementPolicy::Local, distances));
    write_from(&engine, 0, 0..104, 1);
    assert_eq!(writes(&engine.member_stats()), [(64, 0), (0, 0), (0, 40)]);
    let media: Vec<&CrashMedium> = set.media().collect();
    assert_eq!(blocks_on(media[0]), (0..64).collect::<Vec<_>>());
    assert!(blocks_on(media[1]).is_empty());
    assert_eq!(blocks_on(media[2]), (64..104).collect::<Vec<_>>());
    read_from(&engine, 2, 0..104, 1);
    let stats = engine.member_stats();
    assert_eq!((stats[2].reads_local, stats[0].reads_remote), (40, 64));
    // One read over the blocks of both members: slots 63 and 64 are consecutive numbers on
    // two media, so the read's one-copy runs stop at member 0's end.
    let mut lane = engine.lane().expect("lane");
    let mut all = vec![0u8; 104 * BLOCK];
    lane.read(0, &mut all).expect("read across members");
    for (lba, block) in all.chunks(BLOCK).enumerate() {
        assert_eq!(block, block_of(lba as u64, 1), "block {lba}");
    }
    drop(lane);
    engine.audit().expect("audit");
}

/// Interleaved placement ignores the node: one writer's blocks spread evenly.
#[test]
fn interleaving_spreads_one_writers_blocks_over_every_member() {
    let switch = CrashSwitch::new();
    let set = set_on(&[0, 1], &switch);
    let (engine, _) =
        format(set.clone(), &switch, &config(PlacementPolicy::Interleave, two_nodes()));
    write_from(&engine, 0, 0..64, 1);
    let media: Vec<&CrashMedium> = set.media().collect();
    let (on_0, on_1) = (blocks_on(media[0]).len(), blocks_on(media[1]).len());
    assert_eq!(on_0 + on_1, 64);
    assert!((24..=40).contains(&on_0), "{on_0} of 64 blocks on member 0");
    let stats = engine.member_stats();
    assert_eq!((stats[0].writes_local, stats[1].writes_remote), (on_0 as u64, on_1 as u64));
}

/// Power is cut with dirty blocks on both members and no flush: recovery from the media
/// alone (given in either order) brings every acknowledged write back, from the member it
/// was on.
#[test]
fn a_set_recovers_every_members_writes_after_a_power_cut() {
    let switch = CrashSwitch::new();
    let set = set_on(&[0, 1], &switch);
    let config = config(PlacementPolicy::Local, two_nodes());
    let (engine, backing) = format(set.clone(), &switch, &config);
    write_from(&engine, 0, 0..40, 1);
    write_from(&engine, 1, 200..240, 1);
    // Overwrites from the other node: the new copies go to the writer's member, the old ones
    // are freed on theirs.
    write_from(&engine, 1, 0..10, 2);
    switch.cut_now();
    drop(engine);
    let after = CrashSwitch::new();
    let images: Vec<CrashMedium> = set
        .media()
        .enumerate()
        .map(|(i, m)| {
            CrashMedium::from_image(m.crash_image().expect("cut"), after.clone(), i as u64)
        })
        .collect();
    let backing = SimBacking::from_image(backing.crash_image().expect("cut"), after.clone(), 4);
    // Given in the wrong order: sorted by what their superblocks record.
    let mut given = vec![(images[1].clone(), Some(1)), (images[0].clone(), Some(0))];
    sort_members(&mut given);
    let clock = Arc::new(ManualClock::default());
    let (engine, report) =
        Engine::open(MediumSet::new(given), backing, clock, &config).expect("recover the set");
    assert_eq!(report.dirty, 80, "{report:?}");
    assert_eq!(report.superseded + report.torn + report.corrupt, 0, "{report:?}");
    read_from(&engine, 0, 10..40, 1);
    read_from(&engine, 0, 0..10, 2);
    read_from(&engine, 1, 200..240, 1);
    assert_eq!(blocks_on(&images[1]), (0..10).chain(200..240).collect::<Vec<_>>());
    engine.audit().expect("audit");
}

fn open_err(set: Set, backing: &SimBacking) -> String {
    let clock = Arc::new(ManualClock::default());
    let config = config(PlacementPolicy::Local, two_nodes());
    match Engine::open(set, backing.clone(), clock, &config) {
        Ok(_) => panic!("an incomplete or mixed set was attached"),
        Err(Error::Format(e @ FormatError::BadSet(_))) => e.to_string(),
        Err(other) => panic!("not a set error: {other}"),
    }
}

/// A member missing, repeated, out of order or from another cache: refused with what is
/// wrong, before anything is changed.
#[test]
fn a_set_with_a_member_missing_repeated_misplaced_or_foreign_is_refused() {
    let switch = CrashSwitch::new();
    let set = set_on(&[0, 1, 0], &switch);
    let config = config(PlacementPolicy::Local, two_nodes());
    let (engine, backing) = format(set.clone(), &switch, &config);
    write_from(&engine, 0, 0..5, 1);
    engine.shutdown().expect("shutdown");
    drop(engine);
    let media: Vec<CrashMedium> = set.media().cloned().collect();
    let before: Vec<Vec<u64>> = media.iter().map(CrashMedium::durable_image).collect();
    let of = |picks: &[usize]| {
        MediumSet::new(picks.iter().map(|&i| (media[i].clone(), None)).collect::<Vec<_>>())
    };
    let missing = open_err(of(&[0, 1]), &backing);
    assert!(missing.contains("has 3 members, 2 given (members [0, 1])"), "{missing}");
    assert!(missing.contains("every member's medium is needed"), "{missing}");
    let repeated = open_err(of(&[0, 1, 1]), &backing);
    assert!(repeated.contains("given as member 2 is member 1 of 3"), "{repeated}");
    let misplaced = open_err(of(&[1, 0, 2]), &backing);
    assert!(misplaced.contains("given as member 0 is member 1 of 3"), "{misplaced}");
    // A member of another cache of the same shape.
    let other_switch = CrashSwitch::new();
    let other = set_on(&[0, 1, 0], &other_switch);
    let (other_engine, _) = format(other.clone(), &other_switch, &config);
    drop(other_engine);
    let stranger = other.media().nth(1).expect("member 1").clone();
    let mixed =
        MediumSet::new(vec![(media[0].clone(), None), (stranger, None), (media[2].clone(), None)]);
    let foreign = open_err(mixed, &backing);
    assert!(foreign.contains("member 1 belongs to the cache"), "{foreign}");
    // Nothing was written by the refusals; the whole set still attaches.
    let after: Vec<Vec<u64>> = media.iter().map(CrashMedium::durable_image).collect();
    assert!(before == after, "a refused attach changed a member");
    let clock = Arc::new(ManualClock::default());
    let (engine, _) = Engine::open(of(&[0, 1, 2]), backing, clock, &config).expect("whole set");
    read_from(&engine, 0, 0..5, 1);
}

/// A cache of format version 2 (one medium, bytes 112..124 of its header zero) attaches as a
/// set of one, its blocks intact.
#[test]
fn a_version_2_cache_attaches_as_a_set_of_one() {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(MEMBER_BYTES, switch.clone(), 1);
    let config = config(PlacementPolicy::Local, two_nodes());
    let (engine, backing) = format(MediumSet::single(medium.clone()), &switch, &config);
    write_from(&engine, 1, 0..8, 5);
    engine.shutdown().expect("shutdown");
    drop(engine);
    // Rewrite the header as version 2 wrote it.
    let mut header = [0u8; 128];
    medium.read(0, &mut header);
    header[8..12].copy_from_slice(&2u32.to_le_bytes());
    header[112..124].fill(0);
    let crc = crc32c::crc32c(&header[..124]);
    header[124..128].copy_from_slice(&crc.to_le_bytes());
    medium.write_persist(0, &header);
    let clock = Arc::new(ManualClock::default());
    // A plain medium (no set around it) is a set of one too.
    let (engine, report) =
        Engine::open(medium, backing, clock, &config).expect("a version-2 cache attaches");
    assert!(report.was_clean_shutdown);
    assert_eq!(engine.superblock().membership.count, 1);
    assert_eq!(engine.layout().members().len(), 1);
    let mut lane = engine.lane().expect("lane");
    let mut buf = vec![0u8; BLOCK];
    for lba in 0..8 {
        lane.read(lba * BLOCK as u64, &mut buf).expect("read");
        assert_eq!(buf, block_of(lba, 5));
    }
}
