//! NUMA placement: which member of the cache a lane takes free slots from.
//!
//! With [`PlacementPolicy::Local`] a lane refilling its free run asks which CPU its thread
//! runs on now, and takes from the member on that CPU's node first, then from the others
//! nearest first (by the kernel's node distances); only when every member's pool is empty does
//! it reclaim, again local member first. So a write's data and its metadata entry land on the
//! writer's node, wherever the thread runs (an NBD connection's thread, a ublk queue pinned to
//! its CPUs), and a member that fills up spills to its nearest neighbour.
//! [`PlacementPolicy::Interleave`] ignores nodes: each refill starts at the next member, so
//! writes spread evenly over all members (the policy of a cache that knows no nodes).
//!
//! Reads are served from wherever the block is. Reads and writes are counted per member as
//! local (the lane's node is the member's) or remote.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use pmcache_media::MEMBERS_MAX;
use pmcache_media::numa::{Topology, current_cpu};
use smallvec::SmallVec;

use crate::layout::Layout;
use crate::sync::{AtomicU64, Ordering};

/// Where lanes allocate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlacementPolicy {
    /// On the member of the writer's node, falling back nearest first.
    #[default]
    Local,
    /// Over every member in turn, whatever the writer's node.
    Interleave,
}

impl fmt::Display for PlacementPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlacementPolicy::Local => "local",
            PlacementPolicy::Interleave => "interleave",
        })
    }
}

impl FromStr for PlacementPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local" => Ok(PlacementPolicy::Local),
            "interleave" => Ok(PlacementPolicy::Interleave),
            _ => Err(format!("unknown placement {s:?}; expected local or interleave")),
        }
    }
}

/// How the engine places writes on the members of a cache.
#[derive(Clone, Debug)]
pub struct PlacementConfig {
    /// Local (the default) or interleaved.
    pub policy: PlacementPolicy,
    /// The machine's nodes; `None` reads them from sysfs when the engine starts.
    pub topology: Option<Arc<Topology>>,
    /// The CPU the calling thread runs on (`sched_getcpu`; tests simulate CPUs with their
    /// own).
    pub current_cpu: fn() -> Option<usize>,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        Self { policy: PlacementPolicy::Local, topology: None, current_cpu }
    }
}

/// Members in the order a lane tries them.
pub(crate) type MemberOrder = SmallVec<[u8; MEMBERS_MAX]>;

/// The placement tables, built when the engine starts.
pub(crate) struct Placement {
    policy: PlacementPolicy,
    members: usize,
    topology: Arc<Topology>,
    current_cpu: fn() -> Option<usize>,
    /// By node number: the members nearest first (unknown nodes last).
    by_node: Vec<MemberOrder>,
    /// Each member's node.
    member_nodes: SmallVec<[Option<u32>; MEMBERS_MAX]>,
    /// For a thread whose node is not known: member order.
    in_order: MemberOrder,
}

impl Placement {
    pub(crate) fn new(layout: &Layout, config: &PlacementConfig) -> Self {
        let members = layout.members();
        let topology = config.topology.clone().unwrap_or_else(|| Arc::new(Topology::detect()));
        let max_node = topology.nodes().iter().copied().max().unwrap_or(0) as usize;
        let by_node = (0..=max_node as u32)
            .map(|node| {
                let mut order: MemberOrder = (0..members.len() as u8).collect();
                order.sort_by_key(|&m| {
                    let distance = members[usize::from(m)]
                        .node
                        .map_or(u32::MAX, |to| topology.distance(node, to));
                    (distance, m)
                });
                order
            })
            .collect();
        Self {
            policy: config.policy,
            members: members.len(),
            topology,
            current_cpu: config.current_cpu,
            by_node,
            member_nodes: members.iter().map(|m| m.node).collect(),
            in_order: (0..members.len() as u8).collect(),
        }
    }

    /// Whether the cache has one member (nothing to place).
    pub(crate) fn single(&self) -> bool {
        self.members == 1
    }

    /// The node the calling thread runs on, if known.
    pub(crate) fn current_node(&self) -> Option<u32> {
        (self.current_cpu)().map(|cpu| self.topology.node_of_cpu(cpu))
    }

    /// Whether a lane on `node` reaches `member` locally: the member is on that node (or it
    /// is the cache's only member: nothing is remote then).
    #[inline]
    pub(crate) fn is_local(&self, member: usize, node: Option<u32>) -> bool {
        self.single() || (node.is_some() && self.member_nodes[member] == node)
    }

    /// The members a lane on `node` takes free slots from, first to last; `turn` counts the
    /// lane's refills (interleaving starts each at the next member).
    pub(crate) fn order(&self, node: Option<u32>, turn: usize) -> MemberOrder {
        match self.policy {
            PlacementPolicy::Interleave => {
                let mut order = self.in_order.clone();
                order.rotate_left(turn % self.members);
                order
            }
            PlacementPolicy::Local => node
                .and_then(|node| self.by_node.get(node as usize))
                .map_or_else(|| self.in_order.clone(), MemberOrder::clone),
        }
    }
}

/// One lane's reads and writes of one member, local or remote.
#[derive(Default)]
pub(crate) struct MemberCounters {
    pub(crate) reads_local: AtomicU64,
    pub(crate) reads_remote: AtomicU64,
    pub(crate) writes_local: AtomicU64,
    pub(crate) writes_remote: AtomicU64,
}

impl MemberCounters {
    /// Adds this lane's counts. Wrapping: a slot taken back unused counts -1 where it was
    /// counted +1, which may be the other bucket if the lane moved between the two.
    pub(crate) fn add_to(&self, stats: &mut MemberStats) {
        let add = |sum: &mut u64, counter: &AtomicU64| {
            *sum = sum.wrapping_add(counter.load(Ordering::Relaxed));
        };
        add(&mut stats.reads_local, &self.reads_local);
        add(&mut stats.reads_remote, &self.reads_remote);
        add(&mut stats.writes_local, &self.writes_local);
        add(&mut stats.writes_remote, &self.writes_remote);
    }
}

/// One member's figures ([`crate::Engine::member_stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberStats {
    /// Its number in the set.
    pub index: usize,
    /// Its NUMA node, if known.
    pub node: Option<u32>,
    /// Its slots.
    pub slots: u64,
    /// Those holding dirty blocks.
    pub dirty: u64,
    /// Those free (in its pool).
    pub free: u64,
    /// Blocks read from it by lanes on its node.
    pub reads_local: u64,
    /// Blocks read from it by lanes on other nodes (or an unknown one).
    pub reads_remote: u64,
    /// Slots of it that lanes on its node filled (writes, admitted read misses).
    pub writes_local: u64,
    /// Slots of it that lanes on other nodes (or an unknown one) filled.
    pub writes_remote: u64,
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use pmcache_media::MemberSpan;

    use super::*;

    fn layout(nodes: &[Option<u32>]) -> Layout {
        let spans: Vec<MemberSpan> = nodes
            .iter()
            .enumerate()
            .map(|(i, &node)| {
                let start = i as u64 * (1 << 20);
                MemberSpan { range: start..start + (1 << 20), node }
            })
            .collect();
        Layout::for_format(&spans, 4096, false).unwrap()
    }

    fn config(policy: PlacementPolicy, topology: Topology) -> PlacementConfig {
        PlacementConfig { policy, topology: Some(Arc::new(topology)), current_cpu: || Some(0) }
    }

    /// Four nodes in a ring (0-1-2-3-0: a neighbour is 20 away, the opposite node 30): a lane
    /// takes its own node's member first, then the neighbours (the lower member first on a tie),
    /// then the far one; a member of unknown node comes last.
    #[test]
    fn local_placement_orders_members_nearest_first() {
        let ring = vec![
            vec![10, 20, 30, 20],
            vec![20, 10, 20, 30],
            vec![30, 20, 10, 20],
            vec![20, 30, 20, 10],
        ];
        let topology = Topology::simulated(vec![0, 1, 2, 3], ring);
        let layout = layout(&[Some(3), Some(2), Some(1), Some(0), None]);
        let placement = Placement::new(&layout, &config(PlacementPolicy::Local, topology));
        assert_eq!(&placement.order(Some(0), 7)[..], [3, 0, 2, 1, 4]);
        assert_eq!(&placement.order(Some(2), 0)[..], [1, 0, 2, 3, 4]);
        assert!(placement.is_local(2, Some(1)) && placement.is_local(3, Some(0)));
        assert!(!placement.is_local(2, Some(0)) && !placement.is_local(4, Some(0)));
        assert!(!placement.is_local(0, None) && !placement.is_local(0, Some(9)));
        // A thread of unknown node: member order.
        assert_eq!(&placement.order(None, 0)[..], [0, 1, 2, 3, 4]);
        assert!(!placement.single());
    }

    #[test]
    fn interleaving_starts_each_refill_at_the_next_member() {
        let topology = Topology::simulated(vec![0, 1], vec![vec![10, 21], vec![21, 10]]);
        let layout = layout(&[Some(0), Some(1)]);
        let placement = Placement::new(&layout, &config(PlacementPolicy::Interleave, topology));
        assert_eq!(&placement.order(Some(0), 0)[..], [0, 1]);
        assert_eq!(&placement.order(Some(0), 1)[..], [1, 0]);
        assert_eq!(&placement.order(Some(1), 2)[..], [0, 1]);
    }

    /// A one-member cache: everything is local, whatever the node.
    #[test]
    fn one_member_is_everyones_local_member() {
        let placement = Placement::new(
            &layout(&[None]),
            &config(
                PlacementPolicy::Local,
                Topology::simulated(vec![0, 1], vec![vec![10, 21], vec![21, 10]]),
            ),
        );
        assert!(placement.single());
        assert!(placement.is_local(0, Some(1)) && placement.is_local(0, None));
        assert_eq!(&placement.order(Some(1), 3)[..], [0]);
    }

    #[test]
    fn policies_parse_and_print() {
        for policy in [PlacementPolicy::Local, PlacementPolicy::Interleave] {
            assert_eq!(policy.to_string().parse::<PlacementPolicy>(), Ok(policy));
        }
        let err = "first-touch".parse::<PlacementPolicy>().unwrap_err();
        assert!(err.contains("local or interleave"), "{err}");
    }
}
