//! Where the cache medium's memory is, said at start on a machine of several NUMA nodes (or
//! whenever the medium declares a node), with a warning when its pages are not on the node it
//! declares.

use std::path::Path;

use pmcache_media::PmemFile;
use pmcache_media::numa::{NodeSource, Topology};

/// Pages sampled over the medium to see where it is.
const SAMPLED_PAGES: u64 = 64;

/// Says on stderr where the medium at `path` is (see the module docs), and returns its node:
/// `given` (the operator's `PATH@NODE`), else the one it declares. A given node that is not
/// where the medium's pages are gets a warning.
pub(crate) fn report_medium_node(
    path: &Path,
    medium: &PmemFile,
    given: Option<u32>,
) -> Option<u32> {
    let nodes = Topology::detect().nodes().len();
    let declared = medium.declared_node();
    let node = given.or(declared.as_ref().map(|(node, _)| *node));
    if nodes <= 1 && declared.is_none() && given.is_none() {
        return node;
    }
    let claim = match (given, declared) {
        (Some(node), Some((declared, source))) if declared != node => {
            eprintln!(
                "pmcache: warning: {} is given as NUMA node {node}, but {source} says node \
                 {declared}",
                path.display()
            );
            Some((node, NodeSource::Given))
        }
        (Some(_), Some(declared)) => Some(declared),
        (Some(node), None) => Some((node, NodeSource::Given)),
        (None, declared) => declared,
    };
    if let Some(line) = medium_node_message(claim, &medium.page_nodes(SAMPLED_PAGES), nodes) {
        eprintln!("{line} [{}]", path.display());
    }
    node
}

/// The line for a medium that declares `declared` and whose sampled pages are on `pages`
/// (node, count) on a machine of `nodes` nodes, if there is something to say.
fn medium_node_message(
    declared: Option<(u32, NodeSource)>,
    pages: &[(u32, u64)],
    nodes: usize,
) -> Option<String> {
    let sampled: u64 = pages.iter().map(|(_, n)| n).sum();
    let spread =
        pages.iter().map(|(node, n)| format!("node {node}: {n}")).collect::<Vec<_>>().join(", ");
    match declared {
        Some((node, source)) => {
            let there = pages.iter().find(|(n, _)| *n == node).map_or(0, |(_, c)| *c);
            Some(if there == sampled {
                format!(
                    "pmcache: the cache medium is on NUMA node {node} ({source}); {there} of \
                     {sampled} sampled pages are there"
                )
            } else {
                format!(
                    "pmcache: warning: the cache medium says it is on NUMA node {node} \
                     ({source}), but only {there} of {sampled} sampled pages are there \
                     ({spread}): its writes and reads cross to another node"
                )
            })
        }
        None if nodes > 1 && sampled > 0 => Some(format!(
            "pmcache: the cache medium declares no NUMA node (no device numa_node, no tmpfs \
             mpol=bind:N) on a machine of {nodes} nodes; its sampled pages are on {spread}"
        )),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_medium_on_its_node_is_said_and_one_elsewhere_is_warned_of() {
        let bound = || Some((1, NodeSource::MountPolicy("bind:1".into())));
        let line = medium_node_message(bound(), &[(1, 64)], 2).unwrap();
        assert!(
            line.contains("on NUMA node 1 (its tmpfs mount's mpol=bind:1); 64 of 64"),
            "{line}"
        );
        let line = medium_node_message(bound(), &[(0, 60), (1, 4)], 2).unwrap();
        assert!(line.contains("warning") && line.contains("only 4 of 64"), "{line}");
        assert!(line.contains("node 0: 60, node 1: 4"), "{line}");
        let line = medium_node_message(None, &[(0, 32), (1, 32)], 2).unwrap();
        assert!(line.contains("declares no NUMA node") && line.contains("2 nodes"), "{line}");
        assert_eq!(medium_node_message(None, &[(0, 64)], 1), None, "one node: nothing to say");
    }
}
