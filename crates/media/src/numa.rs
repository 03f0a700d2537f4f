//! NUMA: the machine's nodes (which CPUs each has, their distances, which have memory) and
//! the node a cache medium's memory is on.
//!
//! The topology is read from `/sys/devices/system/node` (`nodeN/cpulist`, `nodeN/distance`,
//! `has_memory`); where any of it is missing (a container, a kernel without NUMA) the machine
//! is one node 0 holding every CPU.
//!
//! A medium's node is asked of what placed it:
//! - a device (a device-dax node, or the block device under an fsdax file system): its sysfs
//!   `numa_node` (`/sys/dev/{char,block}/MAJ:MIN/device/numa_node`, through the parent disk
//!   for a partition); real PM is where the hardware put it;
//! - a tmpfs mounted with a single-node bind policy (`mpol=bind:N`), as the emulation binds a
//!   file to a node: that node;
//! - otherwise it is unknown.
//!
//! What a mapping's pages really are on is read page by page with
//! `get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)` ([`node_of_page`]), to check a claim.

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::kind::{dev_major, dev_minor};

/// `get_mempolicy` flags (`linux/mempolicy.h`; not in the `libc` crate).
const MPOL_F_NODE: libc::c_ulong = 1;
const MPOL_F_ADDR: libc::c_ulong = 2;

/// Where the kernel describes NUMA nodes.
pub const SYSFS_NODES: &str = "/sys/devices/system/node";

/// The machine's NUMA nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Online nodes, ascending.
    nodes: Vec<u32>,
    /// The node of each CPU, by CPU number (a CPU no node lists: the first node).
    cpu_node: Vec<u32>,
    /// `distances[i][j]`: from `nodes[i]` to `nodes[j]` (10 is local, as ACPI's SLIT).
    distances: Vec<Vec<u32>>,
    /// Nodes with memory, ascending.
    memory_nodes: Vec<u32>,
}

impl Topology {
    /// One node 0 with `cpus` CPUs and memory.
    pub fn single(cpus: usize) -> Self {
        Self {
            nodes: vec![0],
            cpu_node: vec![0; cpus.max(1)],
            distances: vec![vec![10]],
            memory_nodes: vec![0],
        }
    }

    /// A machine whose CPU `c` is on node `cpu_node[c]`, its nodes numbered from 0 up,
    /// every node with memory, at `distances` (`distances[i][j]` from node `i` to node `j`).
    /// For tests and simulations of machines this is not.
    ///
    /// # Panics
    /// If `distances` is not square, or a CPU's node has no row.
    pub fn simulated(cpu_node: Vec<u32>, distances: Vec<Vec<u32>>) -> Self {
        let count = distances.len();
        assert!(
            count > 0
                && distances.iter().all(|r| r.len() == count)
                && cpu_node.iter().all(|&node| (node as usize) < count),
            "a simulated topology needs a distance row per node, each with a column per node"
        );
        let nodes: Vec<u32> = (0..count as u32).collect();
        Self { memory_nodes: nodes.clone(), nodes, cpu_node, distances }
    }

    /// This machine's topology, or one node if sysfs does not describe it.
    pub fn detect() -> Self {
        Self::from_sysfs(Path::new(SYSFS_NODES)).unwrap_or_else(|| {
            Self::single(std::thread::available_parallelism().map_or(1, usize::from))
        })
    }

    /// The topology described under `root` (a `/sys/devices/system/node`), or `None` if its
    /// files are missing or do not agree.
    pub fn from_sysfs(root: &Path) -> Option<Self> {
        let read = |name: &str| std::fs::read_to_string(root.join(name)).ok();
        let nodes: Vec<u32> =
            parse_cpulist(&read("online")?)?.into_iter().map(|n| n as u32).collect();
        if nodes.is_empty() {
            return None;
        }
        let mut cpu_node: Vec<u32> = Vec::new();
        let mut distances = Vec::with_capacity(nodes.len());
        for &node in &nodes {
            for cpu in parse_cpulist(&read(&format!("node{node}/cpulist"))?)? {
                if cpu_node.len() <= cpu {
                    cpu_node.resize(cpu + 1, u32::MAX);
                }
                cpu_node[cpu] = node;
            }
            let row: Vec<u32> = read(&format!("node{node}/distance"))?
                .split_whitespace()
                .map(|d| d.parse().ok())
                .collect::<Option<_>>()?;
            if row.len() != nodes.len() {
                return None;
            }
            distances.push(row);
        }
        for node in &mut cpu_node {
            if *node == u32::MAX {
                *node = nodes[0];
            }
        }
        if cpu_node.is_empty() {
            cpu_node.push(nodes[0]);
        }
        let memory_nodes = match read("has_memory") {
            Some(text) => parse_cpulist(&text)?.into_iter().map(|n| n as u32).collect(),
            None => nodes.clone(),
        };
        Some(Self { nodes, cpu_node, distances, memory_nodes })
    }

    /// Online nodes, ascending.
    pub fn nodes(&self) -> &[u32] {
        &self.nodes
    }

    /// Nodes with memory, ascending.
    pub fn memory_nodes(&self) -> &[u32] {
        &self.memory_nodes
    }

    /// The node of `cpu` (the first node for a CPU it does not know).
    pub fn node_of_cpu(&self, cpu: usize) -> u32 {
        self.cpu_node.get(cpu).copied().unwrap_or(self.nodes[0])
    }

    /// The CPUs of `node`, ascending.
    pub fn cpus_of(&self, node: u32) -> Vec<usize> {
        (0..self.cpu_node.len()).filter(|&cpu| self.cpu_node[cpu] == node).collect()
    }

    /// The distance from node `from` to node `to` (`u32::MAX` for a node it does not know).
    pub fn distance(&self, from: u32, to: u32) -> u32 {
        let index = |node| self.nodes.iter().position(|&n| n == node);
        match (index(from), index(to)) {
            (Some(i), Some(j)) => self.distances[i][j],
            _ => u32::MAX,
        }
    }

    /// `candidates` ordered nearest to `from` first, ties by the lower node number.
    pub fn nearest_first(&self, from: u32, candidates: &[u32]) -> Vec<u32> {
        let mut ordered = candidates.to_vec();
        ordered.sort_by_key(|&node| (self.distance(from, node), node));
        ordered
    }
}

/// The CPU the calling thread runs on now (`sched_getcpu`, a vDSO call), `None` where the
/// kernel does not say.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments, no memory touched; returns a CPU number or -1.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// Pins the calling thread to `cpu` (`sched_setaffinity`), as a benchmark places its
/// threads on the nodes of a machine.
pub fn pin_to_cpu(cpu: usize) -> std::io::Result<()> {
    // SAFETY: `cpu_set_t` is plain data, zeroed is the empty set; CPU_SET writes one bit of it
    // (it checks the index against the set's size); sched_setaffinity reads the set for the
    // calling thread (pid 0) and keeps no pointer.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A list of numbers as sysfs writes CPU and node lists (`0-3,8,10-11`; empty is none).
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last): (usize, usize) = (first.parse().ok()?, last.parse().ok()?);
                if last < first || last - first > 1 << 16 {
                    return None;
                }
                out.extend(first..=last);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// Where a medium's node came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeSource {
    /// The sysfs `numa_node` of this device directory.
    Device(PathBuf),
    /// The memory policy of its tmpfs mount (`mpol=bind:N`).
    MountPolicy(String),
    /// The operator said so (`--cache PATH@NODE`).
    Given,
}

impl std::fmt::Display for NodeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeSource::Device(dir) => write!(f, "{}", dir.join("numa_node").display()),
            NodeSource::MountPolicy(policy) => write!(f, "its tmpfs mount's mpol={policy}"),
            NodeSource::Given => f.write_str("as given"),
        }
    }
}

/// The node of the device `major:minor` (`char_device`: a device-dax node; otherwise a block
/// device, a partition's through its disk) from sysfs under `sys` (`/sys`), if it has one
/// (`numa_node` is -1 where the platform does not say).
pub fn node_of_device(
    sys: &Path,
    major: u64,
    minor: u64,
    char_device: bool,
) -> Option<(u32, NodeSource)> {
    let kind = if char_device { "char" } else { "block" };
    let dir = sys.join("dev").join(kind).join(format!("{major}:{minor}"));
    // A partition's directory sits inside its disk's, which has the `device` link.
    for candidate in [dir.join("device"), dir.join("..").join("device")] {
        let Ok(text) = std::fs::read_to_string(candidate.join("numa_node")) else { continue };
        return match text.trim().parse::<i64>() {
            Ok(node) if node >= 0 => Some((node as u32, NodeSource::Device(candidate))),
            _ => None,
        };
    }
    None
}

/// The node a tmpfs mount binds its files to: the `mpol=bind:N` (or `prefer:N`) super option
/// of the mount of device `major:minor` in `mountinfo`'s text, when it names one node.
pub fn node_of_mount_policy(mountinfo: &str, major: u64, minor: u64) -> Option<(u32, NodeSource)> {
    let wanted = format!("{major}:{minor}");
    let options = mountinfo
        .lines()
        .filter(|line| line.split_whitespace().nth(2) == Some(wanted.as_str()))
        .filter_map(|line| line.split(" - ").nth(1)?.split_whitespace().nth(2).map(str::to_owned))
        .next_back()?;
    let policy = options.split(',').find_map(|o| o.strip_prefix("mpol="))?;
    let (mode, nodes) = policy.split_once(':')?;
    // A mode may carry a flag (`bind=static:1`).
    if !matches!(mode.split('=').next(), Some("bind" | "prefer")) {
        return None;
    }
    match parse_cpulist(nodes)?.as_slice() {
        &[node] => Some((node as u32, NodeSource::MountPolicy(policy.to_owned()))),
        _ => None,
    }
}

/// The node `file` (a medium) says it is on: a device node's own `numa_node`; for a regular
/// file, its tmpfs mount's single-node policy, else the `numa_node` of the block device
/// under its file system (fsdax on a pmem device). `None` where nothing says.
pub fn node_of_file(file: &File) -> Option<(u32, NodeSource)> {
    let meta = file.metadata().ok()?;
    let sys = Path::new("/sys");
    let file_type = meta.file_type();
    if file_type.is_char_device() || file_type.is_block_device() {
        let rdev = meta.rdev();
        return node_of_device(sys, dev_major(rdev), dev_minor(rdev), file_type.is_char_device());
    }
    let (major, minor) = (dev_major(meta.dev()), dev_minor(meta.dev()));
    std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .and_then(|mountinfo| node_of_mount_policy(&mountinfo, major, minor))
        .or_else(|| node_of_device(sys, major, minor, false))
}

/// Pages of `len_bytes` from `base` sampled at `samples` evenly spaced places, counted by
/// the node each is on (ascending by node); pages the kernel would not place are left out.
pub fn sample_page_nodes(base: usize, len_bytes: u64, samples: u64) -> Vec<(u32, u64)> {
    let page = crate::kind::page_bytes() as u64;
    let pages = (len_bytes / page).max(1);
    let samples = samples.clamp(1, pages);
    let mut counts: Vec<(u32, u64)> = Vec::new();
    for i in 0..samples {
        let offset = i * pages / samples * page;
        let Ok(node) = node_of_page(base + offset as usize) else { continue };
        match counts.iter_mut().find(|(n, _)| *n == node) {
            Some((_, count)) => *count += 1,
            None => counts.push((node, 1)),
        }
    }
    counts.sort_unstable();
    counts
}

/// The node of the page at address `addr` of this process's memory, faulting it in first if it is
/// not yet (as a read would); an error where the kernel has no NUMA support.
pub fn node_of_page(addr: usize) -> std::io::Result<u32> {
    let mut node: libc::c_int = -1;
    // SAFETY: `get_mempolicy` writes one int to `node` (a valid local) and reads no node mask
    // (null, size 0); `addr` is only looked up in this process's page tables (an unmapped
    // address is EFAULT, not an access).
    let result = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    u32::try_from(node).map_err(|_| std::io::Error::other("get_mempolicy returned no node"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_sysfs(
        nodes: &[(&str, &str)],
        online: &str,
        has_memory: Option<&str>,
    ) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("online"), format!("{online}\n")).unwrap();
        if let Some(memory) = has_memory {
            std::fs::write(dir.path().join("has_memory"), format!("{memory}\n")).unwrap();
        }
        for (i, (cpulist, distance)) in nodes.iter().enumerate() {
            let node = dir.path().join(format!("node{i}"));
            std::fs::create_dir(&node).unwrap();
            std::fs::write(node.join("cpulist"), format!("{cpulist}\n")).unwrap();
            std::fs::write(node.join("distance"), format!("{distance}\n")).unwrap();
        }
        dir
    }

    #[test]
    fn cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist("\n"), Some(vec![]));
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a"), None);
    }

    #[test]
    fn a_three_node_topology_is_read_with_a_memoryless_node() {
        let dir = fake_sysfs(
            &[("0-1", "10 21 31"), ("2-3", "21 10 21"), ("", "31 21 10")],
            "0-2",
            Some("0-1"),
        );
        let t = Topology::from_sysfs(dir.path()).expect("topology");
        assert_eq!(t.nodes(), [0, 1, 2]);
        assert_eq!(t.memory_nodes(), [0, 1]);
        assert_eq!((t.node_of_cpu(1), t.node_of_cpu(2), t.node_of_cpu(99)), (0, 1, 0));
        assert_eq!((t.distance(0, 2), t.distance(2, 1), t.distance(0, 7)), (31, 21, u32::MAX));
        assert_eq!(t.nearest_first(2, &[0, 1]), [1, 0]);
        assert_eq!(t.nearest_first(1, &[2, 0]), [0, 2], "a tie goes to the lower node");
    }

    #[test]
    fn a_missing_or_inconsistent_sysfs_is_no_topology() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Topology::from_sysfs(dir.path()), None, "no files");
        let dir = fake_sysfs(&[("0-1", "10 21")], "0", None);
        assert_eq!(Topology::from_sysfs(dir.path()), None, "a distance row of the wrong size");
        assert_eq!(Topology::single(4).node_of_cpu(3), 0);
    }

    #[test]
    fn this_machine_has_a_topology_with_every_cpu_on_a_node() {
        let t = Topology::detect();
        assert!(!t.nodes().is_empty());
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        for cpu in 0..cpus {
            assert!(t.nodes().contains(&t.node_of_cpu(cpu)), "cpu {cpu}");
        }
    }

    #[test]
    fn a_device_node_is_read_through_a_partition_to_its_disk() {
        let sys = tempfile::tempdir().unwrap();
        let disk = sys.path().join("devices/pmem1");
        std::fs::create_dir_all(disk.join("device")).unwrap();
        std::fs::write(disk.join("device/numa_node"), "1\n").unwrap();
        std::fs::create_dir_all(disk.join("pmem1p1")).unwrap();
        std::fs::create_dir_all(sys.path().join("dev/block")).unwrap();
        std::os::unix::fs::symlink(disk.join("pmem1p1"), sys.path().join("dev/block/259:3"))
            .unwrap();
        std::os::unix::fs::symlink(&disk, sys.path().join("dev/block/259:2")).unwrap();
        let node = |minor| node_of_device(sys.path(), 259, minor, false).map(|(n, _)| n);
        assert_eq!((node(2), node(3)), (Some(1), Some(1)));
        assert_eq!(node(4), None, "no such device");
        let dax = sys.path().join("devices/dax0.0");
        std::fs::create_dir_all(dax.join("device")).unwrap();
        std::fs::write(dax.join("device/numa_node"), "-1\n").unwrap();
        std::fs::create_dir_all(sys.path().join("dev/char")).unwrap();
        std::os::unix::fs::symlink(&dax, sys.path().join("dev/char/251:0")).unwrap();
        assert_eq!(node_of_device(sys.path(), 251, 0, true), None, "the platform does not say");
    }

    #[test]
    fn a_tmpfs_bound_to_one_node_names_it() {
        let mountinfo = "\
30 1 0:27 / /dev/shm rw,nosuid - tmpfs tmpfs rw,size=1024k
41 1 0:40 / /mnt/n1 rw - tmpfs tmpfs rw,mpol=bind:1
42 1 0:41 / /mnt/n01 rw - tmpfs tmpfs rw,mpol=bind:0-1
43 1 0:42 / /mnt/i rw - tmpfs tmpfs rw,mpol=interleave:0-1
44 1 0:43 / /mnt/s rw - tmpfs tmpfs rw,mpol=bind=static:2
";
        let node = |minor| node_of_mount_policy(mountinfo, 0, minor).map(|(n, _)| n);
        assert_eq!(node(27), None, "no policy");
        assert_eq!(node(40), Some(1));
        assert_eq!(node(41), None, "two nodes");
        assert_eq!(node(42), None, "interleaved");
        assert_eq!(node(43), Some(2), "a mode flag");
    }

    #[test]
    fn a_medium_in_dev_shm_is_placed_on_nodes_of_this_machine() {
        let dir = tempfile::tempdir_in("/dev/shm").expect("/dev/shm");
        let medium = crate::PmemFile::open(&dir.path().join("m"), Some(4 << 20)).unwrap();
        medium.reserve().unwrap();
        // /dev/shm has no single-node policy here: nothing says where it is.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        if !mountinfo.contains("mpol=") {
            assert_eq!(medium.declared_node(), None);
        }
        if let Err(e) = node_of_page(&mountinfo as *const String as usize) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSYS), "{e}");
            return;
        }
        let counts = medium.page_nodes(16);
        assert_eq!(counts.iter().map(|(_, n)| n).sum::<u64>(), 16, "{counts:?}");
        let nodes = Topology::detect();
        assert!(counts.iter().all(|(node, _)| nodes.nodes().contains(node)), "{counts:?}");
    }

    /// A real tmpfs mounted `mpol=bind:N` on the first memory node (root only; said and
    /// skipped otherwise): the medium declares the node and every sampled page is on it.
    #[test]
    fn a_medium_on_a_tmpfs_bound_to_a_node_declares_it_and_is_there() {
        let node = Topology::detect().memory_nodes()[0];
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size=8m,mpol=bind:{node}"), "tmpfs"])
            .arg(dir.path())
            .output();
        match mounted {
            Ok(out) if out.status.success() => {}
            other => {
                eprintln!("no tmpfs mount here ({other:?}): not checked");
                return;
            }
        }
        let checked = std::panic::catch_unwind(|| {
            let medium = crate::PmemFile::open(&dir.path().join("m"), Some(4 << 20)).unwrap();
            medium.reserve().unwrap();
            let (declared, source) = medium.declared_node().expect("a declared node");
            assert_eq!(declared, node);
            assert_eq!(source, NodeSource::MountPolicy(format!("bind:{node}")));
            assert_eq!(medium.page_nodes(16), [(node, 16)]);
        });
        let _ = std::process::Command::new("umount").arg(dir.path()).status();
        if let Err(panic) = checked {
            std::panic::resume_unwind(panic);
        }
    }

    #[test]
    fn a_touched_page_is_on_a_node_of_this_machine() {
        let page = vec![1u8; 4096];
        match node_of_page(page.as_ptr() as usize) {
            Ok(node) => assert!(Topology::detect().nodes().contains(&node), "node {node}"),
            // A kernel without NUMA support answers ENOSYS.
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOSYS), "{e}"),
        }
    }
}
